"""`localrun bench spec`: speculative decoding vs plain decoding, same run, interleaved.

An input-heavy workload where the answer copies from the prompt (quote a passage back, fix
its typos, continue a list it starts), greedy, on a real model (default: the bundled
SmolLM2-135M GGUF) or random weights (token-id prompts that repeat themselves). Two engines
are loaded side by side (plain and speculative, the same weights) and the rounds alternate
which goes first, so drift on a busy machine hits both alike.

Two cases:
- single stream: the requests one at a time (where speculation is meant to pay);
- batch: --batch requests at once (a large batch is already compute-efficient per token, so
  verifying drafts costs more than it saves; printed to show it).

Per case and mode: output tok/s (best round and mean), the draft acceptance rate, tokens per
verified sequence-step, and whether every greedy text is identical to plain decoding's.
"""

from __future__ import annotations

import random
import time
from typing import Any

from localrun.bench.throughput import BenchModelSource, engine_config, load_engine, release_memory, shutdown_engine

PASSAGES = [
    "The river runs past the old mill, where the miller grinds wheat into flour every morning. "
    "Children from the village bring baskets of grain, and the miller pays them with bread and honey. "
    "In winter the river freezes, the wheel stops, and the mill is quiet until spring returns.",
    "To install the tool, download the archive, unpack it into a folder of your choice, and add that "
    "folder to your PATH. Then open a new terminal and run the command with --version to check that "
    "the install worked. If it fails, remove the folder and repeat the steps from the beginning.",
    "Our meeting notes: the budget for the next quarter is approved; the design team will hire two "
    "people; the release moves from May to June because testing needs more time; and the office "
    "will be closed on the first Friday of every month for maintenance of the building.",
    "Def fibonacci(n): if n is less than two, return n. Otherwise return fibonacci(n - 1) plus "
    "fibonacci(n - 2). The function is slow for large n because it computes the same values many "
    "times; a cache of earlier results makes it fast, and a loop makes it faster still.",
]
TASKS = [
    "Repeat the following text exactly, word for word:\n\n{p}",
    "Fix any spelling or grammar mistakes in this text and write out the corrected text in full:\n\n{p}",
    "Rewrite this text, keeping every sentence but putting it in a numbered list:\n\n{p}",
]


def build_prompts(engine, n: int, seed: int = 0) -> list[list[int]]:
    """n chat prompts (passage x task) with the model's tokenizer; without one (random
    weights), token ids of a random 'passage' that the prompt states twice."""
    tok = engine.tokenizer
    if tok is not None and tok.chat_template:
        from localrun.templates.chat import render_chat

        out = []
        for i in range(n):
            text = TASKS[i % len(TASKS)].format(p=PASSAGES[(i // len(TASKS) + i) % len(PASSAGES)])
            out.append(tok.encode(render_chat(tok.chat_template, [{"role": "user", "content": text}])))
        return out
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    lo = min(1000, vocab // 4)
    out = []
    for _ in range(n):
        passage = [rng.randrange(lo, vocab) for _ in range(48)]
        out.append(passage + [rng.randrange(lo, vocab) for _ in range(4)] + passage)
    return out


def _delta(after: dict, before: dict) -> dict[str, Any]:
    d = {k: after.get(k, 0) - before.get(k, 0) for k in ("spec_draft_tokens", "spec_accepted_tokens",
                                                          "spec_verified_rows")}
    emitted = (after.get("spec_tokens_per_row_step", 0) * after.get("spec_verified_rows", 0)
               - before.get("spec_tokens_per_row_step", 0) * before.get("spec_verified_rows", 0))
    d["acceptance_rate"] = d["spec_accepted_tokens"] / d["spec_draft_tokens"] if d["spec_draft_tokens"] else None
    d["tokens_per_row_step"] = emitted / d["spec_verified_rows"] if d["spec_verified_rows"] else None
    return d


def _run_case(engine, prompts: list[list[int]], params, one_at_a_time: bool) -> tuple[list, float, dict]:
    before = engine.stats()
    t = time.perf_counter()
    if one_at_a_time:
        outs = [engine.generate([p], params)[0] for p in prompts]
    else:
        outs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - t
    engine.clear_prefix_cache()  # each round prefills the same prompts again
    return outs, elapsed, _delta(engine.stats(), before)


def run_spec(src: BenchModelSource, requests: int = 4, batch: int = 32, max_tokens: int = 96, rounds: int = 2,
             spec_tokens: int = 4, mode: str = "ngram", draft_model: str | None = None,
             engine_args: dict[str, Any] | None = None, console=None) -> dict[str, Any]:
    from localrun.engine import SamplingParams

    if min(requests, batch, max_tokens, rounds, spec_tokens) < 1:
        raise ValueError("spec benchmark sizes must all be >= 1")
    args = {k: v for k, v in (engine_args or {}).items() if v is not None}
    args["overlap"] = False  # the plain engine serial too: the comparison is speculation alone
    if args.get("max_num_seqs") is not None and args["max_num_seqs"] < batch:
        raise ValueError(f"--max-num-seqs {args['max_num_seqs']} is below --batch {batch}")
    plain = load_engine(src, engine_config({**args, "speculative": "off"}))
    spec = load_engine(src, engine_config({**args, "speculative": mode, "num_speculative_tokens": spec_tokens,
                                           "draft_model": draft_model}))
    try:
        single_prompts = build_prompts(plain, requests)
        batch_prompts = build_prompts(plain, batch, seed=1)
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=False)
        engines = {"off": plain, "spec": spec}
        _run_case(plain, single_prompts[:1], SamplingParams(temperature=0, max_tokens=4), True)  # warm-up
        _run_case(spec, single_prompts[:1], SamplingParams(temperature=0, max_tokens=4), True)
        cases: dict[str, dict[str, Any]] = {}
        for case, prompts, one in (("single", single_prompts, True), ("batch", batch_prompts, False)):
            res = {m: {"elapsed_s": [], "output_tokens": 0} for m in engines}
            texts: dict[str, list] = {}
            for r in range(rounds):
                order = ["off", "spec"] if r % 2 == 0 else ["spec", "off"]
                for m in order:
                    outs, elapsed, d = _run_case(engines[m], prompts, params, one)
                    res[m]["elapsed_s"].append(elapsed)
                    res[m]["output_tokens"] = sum(o.completion_tokens for o in outs)
                    texts[m] = [o.token_ids for o in outs]
                    if m == "spec":
                        res[m].update(d)
            for m in engines:
                toks, el = res[m]["output_tokens"], res[m]["elapsed_s"]
                res[m]["output_tok_s_best"] = toks / min(el)
                res[m]["output_tok_s_mean"] = toks * len(el) / sum(el)
            res["identical"] = texts["off"] == texts["spec"]
            res["speedup_x"] = res["spec"]["output_tok_s_best"] / res["off"]["output_tok_s_best"]
            res["requests"] = len(prompts)
            res["prompt_tokens_mean"] = sum(map(len, prompts)) / len(prompts)
            cases[case] = res
    finally:
        for e in (plain, spec):
            shutdown_engine(e)
        plain = spec = None
        release_memory()
    return {"mode": "spec", "model": src.name, "speculative": mode, "num_speculative_tokens": spec_tokens,
            "draft_model": draft_model, "workload": {"requests": requests, "batch": batch, "max_tokens": max_tokens,
                                                     "rounds": rounds, "greedy": True},
            **cases}
