"""Qwen3-MoE and Mixtral (models/moe_llama.py) on tiny random-init transformers models, fp32 on CPU:
greedy tokens identical to transformers' own generate (each prompt alone) and logprobs close, each prompt
prefilled whole, then batched together with other requests and prefilled in small chunks, a
prompt extending a cached one (the radix cache), and two tensor-parallel ranks against one."""

from __future__ import annotations

import pytest
import torch

from localrun.engine import EngineConfig, LLMEngine, SamplingParams
from localrun.engine.config import ModelConfig
from parity import assert_greedy_parity

transformers = pytest.importorskip("transformers")

VOCAB = 300
# head_dim 16, 3 layers; decisive logits (initializer_range 0.3): greedy picks are no near-ties
COMMON = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              vocab_size=VOCAB, max_position_embeddings=256, initializer_range=0.3)


def _hf_model(kind: str):
    torch.manual_seed(0)
    if kind == "qwen3_moe":  # top-3 of 8, renormalised, q/k norms, layer 1 dense (mlp_only_layers)
        cfg = transformers.Qwen3MoeConfig(**COMMON, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                                          num_experts_per_tok=3, norm_topk_prob=True, mlp_only_layers=[1])
        m = transformers.Qwen3MoeForCausalLM(cfg)
    elif kind == "qwen3_moe_unnormalised":  # norm_topk_prob off (transformers' default), every layer sparse
        cfg = transformers.Qwen3MoeConfig(**COMMON, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                                          num_experts_per_tok=2, norm_topk_prob=False)
        m = transformers.Qwen3MoeForCausalLM(cfg)
    else:  # Mixtral: top-2 of 6, a sliding window of 8 on every layer (prompts past it)
        cfg = transformers.MixtralConfig(**COMMON, intermediate_size=32, num_local_experts=6, num_experts_per_tok=2,
                                         sliding_window=8)
        m = transformers.MixtralForCausalLM(cfg)
    with torch.no_grad():  # norms away from 1: a norm read wrongly shows
        for name, p in m.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0, 0.2)
    return m.float().eval()


def _prompts(n=(5, 40, 90), seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (k,), generator=g).tolist() for k in n]


def _engine(path, **kw) -> LLMEngine:
    return LLMEngine.from_safetensors(path, EngineConfig(device="cpu", dtype="float32", max_model_len=256,
                                                         page_size=4, **kw))


def _reference(hf, prompts, max_tokens=8) -> list[tuple[list[int], list[float]]]:
    """transformers' greedy tokens and their logprobs, each prompt alone."""
    out = []
    for p in prompts:
        ref = hf.generate(torch.tensor([p]), max_new_tokens=max_tokens, do_sample=False, output_scores=True,
                          return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
        toks = ref.sequences[0, len(p):].tolist()
        out.append((toks, [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(ref.scores, toks)]))
    return out


def _assert_same(outs, refs) -> None:
    for o, (toks, lps) in zip(outs, refs):
        assert o.token_ids == toks
        assert [lp for _, lp, _ in o.logprobs] == pytest.approx(lps, abs=1e-4)


GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, want_logprobs=True)


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_moe_models_match_transformers(kind, tmp_path):
    hf = _hf_model(kind)
    hf.save_pretrained(tmp_path, safe_serialization=True)  # one tensor per expert, as transformers writes them
    prompts = _prompts()
    refs = _reference(hf, prompts)
    whole = _engine(tmp_path)  # each prompt prefilled in one step
    mc = whole.model_config
    assert mc.num_experts == hf.config.num_local_experts and mc.num_experts_per_tok == hf.config.num_experts_per_tok
    assert [mc.layer_is_moe(i) for i in range(3)] == ([True, False, True] if kind == "qwen3_moe" else [True] * 3)
    assert mc.num_params == sum(p.numel() for p in hf.parameters())  # every expert counted
    assert whole.weight_bytes == mc.num_params * 4  # ... and allocated (fp32)
    assert mc.active_params < mc.num_params
    _assert_same(whole.generate(prompts, GREEDY), refs)
    # batched with other requests and prefilled in chunks of 16 tokens (the 90-token prompt: 6 steps)
    chunked = _engine(tmp_path, max_num_batched_tokens=16)
    _assert_same(chunked.generate(prompts + _prompts((23, 7, 61), seed=2), GREEDY), refs)
    # a prompt that extends a finished one starts from its cached pages
    before = chunked.stats()["prefix_hit_tokens"]
    assert_greedy_parity(chunked, hf, [prompts[2] + [7, 8, 9, 10, 11]], max_tokens=4)
    assert chunked.stats()["prefix_hit_tokens"] > before


def test_qwen3_moe_without_renormalised_weights(tmp_path):
    """norm_topk_prob off (transformers' default for Qwen3-MoE): the top-k softmax weights as they are."""
    hf = _hf_model("qwen3_moe_unnormalised")
    hf.save_pretrained(tmp_path, safe_serialization=True)
    eng = _engine(tmp_path, max_num_batched_tokens=16)
    assert not eng.model_config.norm_topk_prob
    prompts = _prompts((5, 40))
    _assert_same(eng.generate(prompts, GREEDY), _reference(hf, prompts))


def test_stacked_expert_checkpoints_load_the_same(tmp_path):
    """transformers 5's own stacked layout (mlp.experts.gate_up_proj [E, 2I, H], down_proj [E, H, I]) gives
    the weights the per-expert files give."""
    from safetensors.torch import save_file

    hf = _hf_model("qwen3_moe")
    hf.save_pretrained(tmp_path / "per-expert", safe_serialization=True)
    stacked = tmp_path / "stacked"
    stacked.mkdir()
    (stacked / "config.json").write_text((tmp_path / "per-expert" / "config.json").read_text())
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, str(stacked / "model.safetensors"))
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in hf.state_dict())
    a, b = _engine(tmp_path / "per-expert"), _engine(stacked)
    for (name, x), (_, y) in zip(a.model.named_parameters(), b.model.named_parameters()):
        assert torch.equal(x, y), name
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    assert b.generate(_prompts()[:2], params)[0].token_ids == a.generate(_prompts()[:2], params)[0].token_ids


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_two_ranks_match_one(kind, tmp_path):
    """tensor_parallel 2 (gloo, a process per rank): each rank holds half of every expert's intermediate
    dimension (the router whole), the dense layer's MLP split as a Llama's; same greedy tokens."""
    hf = _hf_model(kind)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    prompts = _prompts((5, 40))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, want_logprobs=True)
    outs = []
    for tp in (1, 2):
        eng = _engine(tmp_path, kv_cache_tokens=512, tensor_parallel=tp)
        try:
            outs.append(eng.generate(prompts, params))
        finally:
            eng.shutdown()
    for a, b in zip(*outs):
        assert a.token_ids == b.token_ids
        assert [lp for _, lp, _ in a.logprobs] == pytest.approx([lp for _, lp, _ in b.logprobs], abs=1e-4)


def test_random_moe_shapes_run_and_split():
    """A named MoE shape with random weights (benchmarks): it runs, and two ranks draw the same model as one."""
    from localrun.engine.models.shapes import get_shape

    big = get_shape("qwen3-30b-a3b")
    assert round(big.num_params / 1e9, 1) == 30.5 and 3.3e9 < big.active_params < 3.4e9  # Qwen: 30.5B, 3.3B
    assert round(get_shape("mixtral-8x7b").num_params / 1e9, 1) == 46.7
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outs = []
    for tp in (1, 2):
        eng = LLMEngine.from_random("tiny-moe", EngineConfig(device="cpu", dtype="float32", max_model_len=64,
                                                             kv_cache_tokens=256, tensor_parallel=tp))
        try:
            outs.append([o.token_ids for o in eng.generate([[1, 2, 3, 4, 5], [9, 8, 7]], params)])
        finally:
            eng.shutdown()
    assert outs[0] == outs[1]


def test_bad_moe_configs_are_refused():
    base = {"model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "intermediate_size": 96, "vocab_size": 300, "num_experts": 8}
    with pytest.raises(ValueError, match="num_experts_per_tok 9"):
        ModelConfig.from_hf_config({**base, "num_experts_per_tok": 9})
    with pytest.raises(ValueError, match="hidden_act 'gelu'.*llama.cpp backend"):
        ModelConfig.from_hf_config({**base, "num_experts_per_tok": 2, "hidden_act": "gelu"})
