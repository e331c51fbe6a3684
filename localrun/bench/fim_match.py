"""`localrun bench fim`: fill-in-the-middle exact match on a held-out set, localrun's three routes against
llama.cpp's own llama-server on the same GGUF.

The set is bench/fim_holes.py's: single-line holes cut from the standard library's Python files, half of them
with a neighbouring file as repository context. Both servers are started here on ``--gguf`` (one slot of
``--ctx`` tokens, the same threads: bench/vs_llama_server.py's helpers). Each hole goes, greedy (temperature 0),
at most ``--max-tokens`` tokens, stopping at a new line, through

- llama-server ``/infill`` (input_prefix, input_suffix, input_extra): the reference;
- localrun ``/infill`` (the same body);
- localrun ``/api/generate`` (prompt, suffix, input_extra);
- localrun ``/v1/completions`` (prompt, suffix, input_extra).

Printed per route: exact matches with the hole's line (the completion up to its first new line, trailing
spaces off, equal to the line's code), and on how many holes the route's text is the same as llama-server's
(the whole text, byte for byte). The holes where a route differs from llama-server are listed.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path
from typing import Any

ROUTES = ("llama-server", "infill", "ollama", "openai")


def add_parser(sub) -> None:
    p = sub.add_parser("fim", help="fill-in-the-middle exact match on holes cut from the standard library: "
                       "localrun's /infill, /api/generate and /v1/completions vs llama-server's /infill")
    p.add_argument("--gguf", required=True, help="a GGUF with fill-in-the-middle tokens (e.g. Qwen2.5-Coder)")
    p.add_argument("--holes", type=int, default=100, help="how many holes (the set's first N)")
    p.add_argument("--seed", type=int, default=None, help="the set's seed (default: bench/fim_holes.py's SEED)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens a completion may take (it stops at a new line)")
    p.add_argument("--ctx", type=int, default=4096, help="context of each server's one slot")
    p.add_argument("--threads", dest="fim_threads", type=int, metavar="N", help="threads for both (default: the "
                   "physical cores)")
    p.add_argument("--llama-server", default="auto", metavar="PATH",
                   help="llama-server binary (default: LOCALRUN_LLAMA_SERVER, else the cached build of the vendored "
                        "llama.cpp)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds one request may take")
    p.add_argument("--out", help="append the result here (default results/bench.jsonl)")
    p.add_argument("--no-save", action="store_true", help="do not append the result to a file")
    p.add_argument("--json", action="store_true", help="also print the result as JSON")


def request(route: str, model: str | None, hole, max_tokens: int) -> tuple[str, dict]:
    """(path, body) of one hole on one route: greedy, at most `max_tokens`, stopping at a new line."""
    if route in ("llama-server", "infill"):
        body: dict[str, Any] = {"input_prefix": hole.prefix, "input_suffix": hole.suffix, "input_extra": hole.extra,
                                "n_predict": max_tokens, "temperature": 0, "stop": ["\n"], "cache_prompt": True}
        if model:
            body["model"] = model
        return "/infill", body
    if route == "ollama":
        return "/api/generate", {"model": model, "prompt": hole.prefix, "suffix": hole.suffix,
                                 "input_extra": hole.extra, "stream": False,
                                 "options": {"temperature": 0, "num_predict": max_tokens, "stop": ["\n"]}}
    return "/v1/completions", {"model": model, "prompt": hole.prefix, "suffix": hole.suffix, "input_extra": hole.extra,
                               "max_tokens": max_tokens, "temperature": 0, "stop": ["\n"]}


def answer_text(route: str, obj: dict) -> str:
    if route in ("llama-server", "infill"):
        return obj["content"]
    if route == "ollama":
        return obj["response"]
    return obj["choices"][0]["text"]


async def complete(client, route: str, model: str | None, hole, max_tokens: int) -> str:
    path, body = request(route, model, hole, max_tokens)
    r = await client.post(path, json=body)
    if r.status_code != 200:
        raise RuntimeError(f"{route} {path} answered {r.status_code}: {r.text[:300]}")
    return answer_text(route, r.json())


def score(holes: list, texts: dict[str, list[str]]) -> dict[str, Any]:
    """Exact matches per route and agreement of each localrun route with llama-server, hole by hole."""
    from localrun.bench.fim_holes import first_line

    ref = texts["llama-server"]
    out: dict[str, Any] = {}
    for route, got in texts.items():
        exact = [first_line(t) == h.answer for t, h in zip(got, holes)]
        row = {"exact": sum(exact), "holes": len(got), "exact_rate": round(sum(exact) / len(got), 3) if got else None}
        if route != "llama-server":
            same = [a == b for a, b in zip(got, ref)]
            row["same_as_llama_server"] = sum(same)
            row["differs"] = [{"hole": f"{holes[i].file}:{holes[i].line}", "llama_server": ref[i], "localrun": got[i]}
                              for i, s in enumerate(same) if not s]
        out[route] = row
    return out


async def compare(gguf: str, binary: str, holes: list, max_tokens: int, ctx: int, threads: int,
                  timeout: float = 300.0, progress=print) -> dict[str, Any]:
    """Both servers started here on `gguf`; every hole through the four routes; their texts and the score."""
    import tempfile

    import httpx

    from localrun.backends.llamacpp.cpu import extra_buffers
    from localrun.bench import vs_llama_server as vs

    cfg = vs.Config(gguf=Path(gguf).resolve(), llama_server=Path(binary), threads=threads, parallel=1, ctx=ctx,
                    extra_buffers=extra_buffers("auto")[0])
    home = Path(tempfile.mkdtemp(prefix="localrun-fim-"))
    servers = {"localrun": vs.localrun_server(cfg, home), "llama-server": vs.llama_server(cfg, home)}
    texts: dict[str, list[str]] = {r: [] for r in ROUTES}
    seconds = {r: 0.0 for r in ROUTES}
    async with vs.serving(servers, home):
        for s in servers.values():
            await vs.start(s, cfg)
        lr, ls = servers["localrun"], servers["llama-server"]
        limits = httpx.Limits(max_keepalive_connections=0)  # llama-server drops idle kept-alive connections
        async with httpx.AsyncClient(base_url=ls.url, timeout=timeout, limits=limits) as hs, \
                httpx.AsyncClient(base_url=lr.url, timeout=timeout) as hl:
            try:
                await _all_holes(hs, hl, ls, lr, holes, max_tokens, texts, seconds, progress)
            except asyncio.CancelledError:  # SIGTERM (vs.serving) or Ctrl+C: the holes done so far are scored
                asyncio.current_task().uncancel()
                progress(f"stopped after {len(texts['openai'])} holes")
    n = len(texts["openai"])
    return {"texts": {r: t[:n] for r, t in texts.items()}, "seconds": {r: round(v, 1) for r, v in seconds.items()}}


async def _all_holes(hs, hl, ls, lr, holes: list, max_tokens: int, texts: dict, seconds: dict, progress) -> None:
    import httpx

    from localrun.bench import vs_llama_server as vs

    for i, hole in enumerate(holes):
        for route in ROUTES:
            t0 = time.perf_counter()
            try:
                text = await complete(hs if route == "llama-server" else hl, route,
                                      None if route == "llama-server" else lr.model, hole, max_tokens)
            except (OSError, RuntimeError, httpx.HTTPError) as exc:
                s = ls if route == "llama-server" else lr
                raise vs.VsError(f"{route}: {type(exc).__name__}: {exc}\n{s.log_tail()}") from None
            seconds[route] += time.perf_counter() - t0
            texts[route].append(text)
        marks = " ".join(f"{r}={'=' if texts[r][-1] == texts['llama-server'][-1] else 'x'}" for r in ROUTES[1:])
        progress(f"hole {i + 1}/{len(holes)} {hole.file}:{hole.line}  llama-server "
                 f"{texts['llama-server'][-1]!r}  {marks}")


def run(a: argparse.Namespace) -> dict[str, Any]:
    import sys

    from localrun.backends.llamacpp.cpu import physical_cores
    from localrun.bench import fim_holes
    from localrun.bench.llama_server_build import BuildError, ensure_llama_server
    from localrun.bench.vs_llama_server import VsError

    if a.holes < 1 or a.max_tokens < 1 or a.ctx < 2048 + 2:
        raise ValueError("--holes and --max-tokens must be positive and --ctx above 2050 (llama-server's FIM layout "
                         "takes a 2048-token batch)")
    if not Path(a.gguf).is_file():
        raise ValueError(f"--gguf {a.gguf}: no such file")
    seed = fim_holes.SEED if a.seed is None else a.seed
    holes = fim_holes.make_holes(a.holes, seed)
    progress = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    try:
        binary = ensure_llama_server(progress) if a.llama_server == "auto" else a.llama_server
        got = asyncio.run(compare(a.gguf, str(binary), holes, a.max_tokens, a.ctx, a.fim_threads or physical_cores(),
                                  a.timeout, progress))
    except (asyncio.CancelledError, KeyboardInterrupt):
        raise ValueError("stopped; both servers were stopped") from None
    except (BuildError, VsError) as exc:
        raise ValueError(str(exc)) from None
    holes = holes[:len(got["texts"]["openai"])]  # all of them unless the run was stopped
    if not holes:
        raise ValueError("stopped before the first hole was done")
    return {"bench": "fim", "gguf": str(a.gguf), "llama_server": str(binary), "max_tokens": a.max_tokens,
            "ctx": a.ctx, "threads": a.fim_threads or physical_cores(), "set": fim_holes.describe(holes, seed),
            "routes": score(holes, got["texts"]), "seconds": got["seconds"],
            "answers": [{"hole": f"{h.file}:{h.line}", "answer": h.answer,
                         **{r: got["texts"][r][i] for r in ROUTES}} for i, h in enumerate(holes)]}


def print_rows(res: dict[str, Any], con) -> None:
    from localrun.bench.results import print_table

    st = res["set"]
    print_table(f"fim: {res['set']['holes']} single-line holes from Python {st['python']}'s standard library "
                f"({st['with_extra']} with another file as context), {Path(res['gguf']).name}, greedy, "
                f"<= {res['max_tokens']} tokens, stop at a new line",
                ["route", "exact match", "rate", "same text as llama-server", "seconds"],
                [[r, row["exact"], row["exact_rate"],
                  "reference" if r == "llama-server" else f"{row['same_as_llama_server']}/{row['holes']}",
                  res["seconds"][r]] for r, row in res["routes"].items()], con)
    for r, row in res["routes"].items():
        for d in row.get("differs", [])[:5]:
            con.print(f"{r} differs at {d['hole']}: llama-server {d['llama_server']!r}, localrun {d['localrun']!r}")
    con.print(f"set sha256 {st['sha256']} (seed {st['seed']}, {st['stdlib']})")
