"""Parity with transformers: the native engine's greedy tokens and logprobs against a
transformers model's own generate()."""

from __future__ import annotations

import pytest
import torch

from localrun.engine import SamplingParams


def assert_greedy_parity(eng, hf, prompts: list[list[int]], max_tokens: int = 8) -> None:
    """Greedy tokens identical and logprobs within 1e-4 for every prompt (the engine runs them
    batched, so long prompts are chunked by its token budget)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, want_logprobs=True)
    outs = eng.generate(prompts, params)
    for p, o in zip(prompts, outs):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=max_tokens, do_sample=False, output_scores=True,
                          return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
        assert o.token_ids == ref.sequences[0, len(p):].tolist()
        ref_lp = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(ref.scores, o.token_ids)]
        assert [lp for _, lp, _ in o.logprobs] == pytest.approx(ref_lp, abs=1e-4)
