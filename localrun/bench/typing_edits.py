"""`localrun bench typing`: code completion while someone types, as an IDE plugin sends it.

A source file of about --file-tokens tokens; the cursor sits in its middle and a line of code is typed
there one token-sized piece at a time (words, spaces, punctuation). At each keystroke (--rate per
second) the plugin asks for a completion of --max-tokens tokens with the code before and after the
cursor (fill in the middle), and gives up the request before it if that one is still running (closes
its connection: the server must stop working on it), as llama.vscode and Continue do. Every request
shares the file's head with the one before, so a prefix cache serves most of the prompt.

Reported: p50/p95 time to first token and to last token (of the requests that finished), how many
were given up, and prompt / cached tokens per request. Routes: llama-server's ``/infill`` (default),
Ollama's ``/api/generate`` with ``suffix``, OpenAI's ``/v1/completions`` with ``suffix``. Against the
localrun daemon by default; ``--url`` points it at another server (llama-server answers ``/infill``).

``--llama-server [PATH]`` compares localrun with llama.cpp's own server in one run: both are started here on
``--gguf`` with the same threads, slots and context (bench/vs_llama_server.py's helpers), and rounds of the
same keystrokes run on one, then the other (the order alternating), localrun on ``--route``, llama-server on
``/infill``. Printed per server: p50/p95 time to first and last token over all its rounds, and the ratio of
the p95 totals (localrun / llama-server; at most 1.0 is the goal). Without PATH the binary is
LOCALRUN_LLAMA_SERVER, else the build cached by ``localrun bench build-llama-server`` (built once).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import time
from typing import Any

ROUTES = ("infill", "ollama", "openai")
TYPED = "    total = sum(item.price * item.quantity for item in order.items if item.quantity > 0)\n"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", help="server base URL (default: the localrun daemon's)")
    p.add_argument("--model", help="a model with fill-in-the-middle tokens (default: the server's choice on /infill)")
    p.add_argument("--api-key", help="bearer key (default: LOCALRUN_API_KEY for the daemon)")
    p.add_argument("--route", choices=ROUTES, default="infill")
    p.add_argument("--file-tokens", type=int, default=1500, help="about this many tokens of code around the cursor")
    p.add_argument("--edits", type=int, default=60, help="keystrokes (one request each)")
    p.add_argument("--rate", type=float, default=10.0, help="keystrokes per second")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens each completion asks for")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds one request may take")
    p.add_argument("--llama-server", nargs="?", const="auto", metavar="PATH",
                   help="compare with llama.cpp's llama-server, interleaved (PATH, else LOCALRUN_LLAMA_SERVER, else "
                        "the cached build of the vendored llama.cpp); both started here on --gguf")
    p.add_argument("--gguf", help="with --llama-server: the GGUF both servers run (a model with FIM tokens)")
    p.add_argument("--rounds", type=int, default=2, help="with --llama-server: rounds per server")
    p.add_argument("--threads", dest="typing_threads", type=int, metavar="N",
                   help="with --llama-server: threads for both (default: the physical cores)")
    p.add_argument("--parallel", type=int, default=2, help="with --llama-server: sequences (slots) of both servers")
    p.add_argument("--ctx", type=int, default=4096, help="with --llama-server: context per sequence")


def source_file(tokens: int) -> tuple[str, str]:
    """(code before the cursor, code after it): about `tokens` tokens of Python (~3.5 characters a token)."""
    block = ("class Order{i}:\n    def __init__(self, items, customer):\n        self.items = list(items)\n"
             "        self.customer = customer\n\n    def weight_{i}(self):\n        return sum(x.weight for x in "
             "self.items)  # kilograms\n\n\n")
    text, i = "", 0
    while len(text) < tokens * 3.5:
        text += block.format(i=i)
        i += 1
    cut = text.find("\n", len(text) // 2) + 1
    return text[:cut] + "def order_total(order):\n", "\n    return total\n\n\n" + text[cut:]


def keystrokes(text: str) -> list[str]:
    """Token-sized pieces of `text`: words, runs of spaces, single punctuation marks."""
    return re.findall(r"\w+|[ \t]+|\n|[^\w\s]", text)


def _body(route: str, model: str | None, prefix: str, suffix: str, max_tokens: int) -> tuple[str, dict]:
    if route == "infill":
        body: dict[str, Any] = {"input_prefix": prefix, "input_suffix": suffix, "n_predict": max_tokens,
                                "temperature": 0, "stream": True, "ignore_eos": True, "cache_prompt": True}
        if model:
            body["model"] = model
        return "/infill", body
    if route == "ollama":
        return "/api/generate", {"model": model, "prompt": prefix, "suffix": suffix, "stream": True, "raw": True,
                                 "options": {"temperature": 0, "num_predict": max_tokens}}
    return "/v1/completions", {"model": model, "prompt": prefix, "suffix": suffix, "max_tokens": max_tokens,
                               "temperature": 0, "stream": True, "ignore_eos": True,
                               "stream_options": {"include_usage": True}}


def _read(route: str, line: str) -> tuple[bool, dict | None]:
    """(has generated text, final numbers {prompt, cached, tokens} or None) from one stream line."""
    if route == "ollama":
        if not line.strip():
            return False, None
        obj = json.loads(line)
        if "error" in obj:
            raise RuntimeError(obj["error"])
        if obj.get("done"):
            return False, {"prompt": obj.get("prompt_eval_count", 0), "cached": obj.get("cached_tokens", 0),
                           "tokens": obj.get("eval_count", 0)}
        return bool(obj.get("response")), None
    if not line.startswith("data: ") or line == "data: [DONE]":
        return False, None
    obj = json.loads(line[6:])
    if "error" in obj and obj["error"]:
        raise RuntimeError(str(obj["error"]))
    if route == "infill":
        if obj.get("stop"):
            t = obj.get("timings") or {}
            return bool(obj.get("content")), {"prompt": obj.get("tokens_evaluated", 0), "cached": t.get("cache_n", 0),
                                              "tokens": obj.get("tokens_predicted", 0)}
        return bool(obj.get("content")), None
    if obj.get("usage"):
        u = obj["usage"]
        return False, {"prompt": u.get("prompt_tokens", 0),
                       "cached": (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
                       "tokens": u.get("completion_tokens", 0)}
    return any(c.get("text") for c in obj.get("choices") or []), None


async def run_typing(url: str, route: str, model: str | None, file_tokens: int, edits: int, rate: float,
                     max_tokens: int, api_key: str | None = None, timeout: float = 120.0) -> dict[str, Any]:
    import httpx

    from localrun.bench.results import percentile

    if edits < 1 or rate <= 0 or max_tokens < 1 or file_tokens < 1:
        raise ValueError("--edits, --rate, --max-tokens and --file-tokens must be positive")
    if route != "infill" and not model:
        raise ValueError(f"--model is required for the {route} route")
    head, tail = source_file(file_tokens)
    keys = keystrokes(TYPED * (1 + edits // max(1, len(keystrokes(TYPED)))))[:edits]
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    records: list[dict] = []

    async def one(client, i: int, prefix: str) -> None:
        rec: dict[str, Any] = {"i": i, "sent": time.perf_counter(), "first": None, "last": None, "final": None}
        records.append(rec)
        path, body = _body(route, model, prefix, tail, max_tokens)
        for attempt in (1, 2):
            try:
                async with client.stream("POST", path, json=body) as r:
                    if r.status_code != 200:
                        raise RuntimeError(f"{path} answered {r.status_code}: {(await r.aread())[:300]!r}")
                    async for line in r.aiter_lines():
                        text, final = _read(route, line)
                        if text and rec["first"] is None:
                            rec["first"] = time.perf_counter()
                        if final is not None:
                            rec["final"] = final
                    rec["last"] = time.perf_counter()
                return
            except httpx.RemoteProtocolError:
                # a kept-alive connection the server had just closed: sent again on a new one (the time counts)
                if attempt == 2 or rec["first"] is not None:
                    raise

    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=timeout) as client:
        # one request first: loads the model, so the edits measure typing, not loading
        await one(client, -1, head)
        records.clear()
        t0 = time.perf_counter()
        typed, task = "", None
        for i, piece in enumerate(keys):
            delay = t0 + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if task is not None and not task.done():
                task.cancel()  # the plugin gives the stale completion up: its connection closes
                try:
                    await task
                except asyncio.CancelledError:
                    pass
            elif task is not None:
                task.result()  # a failed request fails the run
            typed += piece
            task = asyncio.ensure_future(one(client, i, head + typed))
        if task is not None:
            await task
        wall = time.perf_counter() - t0

    done = [r for r in records if r["last"] is not None and r["final"] is not None]
    firsts = [1e3 * (r["first"] - r["sent"]) for r in records if r["first"] is not None]
    lasts = [1e3 * (r["last"] - r["sent"]) for r in done]
    prompts = [r["final"]["prompt"] for r in done]
    cached = [r["final"]["cached"] for r in done]

    return {"bench": "typing", "url": url, "route": route, "model": model, "file_tokens": file_tokens,
            "edits": len(records), "rate": rate, "max_tokens": max_tokens, "wall_s": round(wall, 2),
            "finished": len(done), "given_up": len(records) - len(done),
            **_stats(firsts, lasts, prompts, cached), "samples": {"ttft_ms": firsts, "last_token_ms": lasts,
                                                                  "prompt_tokens": prompts, "cached_tokens": cached}}


def _stats(firsts: list[float], lasts: list[float], prompts: list[int], cached: list[int]) -> dict[str, Any]:
    from localrun.bench.results import percentile

    def p(xs: list[float], q: float) -> float | None:
        v = percentile(xs, q)
        return round(v, 1) if v is not None else None

    return {"ttft_ms_p50": p(firsts, 50), "ttft_ms_p95": p(firsts, 95),
            "last_token_ms_p50": p(lasts, 50), "last_token_ms_p95": p(lasts, 95),
            "prompt_tokens_mean": round(sum(prompts) / len(prompts), 1) if prompts else None,
            "cached_tokens_mean": round(sum(cached) / len(cached), 1) if cached else None,
            "cached_tokens_max": max(cached) if cached else None}


async def compare(gguf: str, llama_server_bin: str, route: str, file_tokens: int, edits: int, rate: float,
                  max_tokens: int, rounds: int, threads: int, parallel: int, ctx: int, timeout: float = 120.0,
                  progress=print) -> dict[str, Any]:
    """localrun and llama-server, both started here on ``gguf``, rounds of the same keystrokes interleaved."""
    import tempfile
    from pathlib import Path

    import httpx

    from localrun.backends.llamacpp.cpu import extra_buffers
    from localrun.bench import vs_llama_server as vs

    if rounds < 1 or threads < 1 or parallel < 1 or ctx < 16:
        raise ValueError("--rounds, --threads, --parallel must be positive and --ctx at least 16")
    if not Path(gguf).is_file():
        raise ValueError(f"--gguf {gguf}: no such file")
    cfg = vs.Config(gguf=Path(gguf).resolve(), llama_server=Path(llama_server_bin), threads=threads, parallel=parallel,
                    ctx=ctx, extra_buffers=extra_buffers("auto")[0])
    home = Path(tempfile.mkdtemp(prefix="localrun-typing-"))
    servers = {"localrun": vs.localrun_server(cfg, home), "llama-server": vs.llama_server(cfg, home)}
    runs: list[dict[str, Any]] = []
    async with vs.serving(servers, home):  # both stopped however the run ends (SIGTERM too)
        for s in servers.values():
            await vs.start(s, cfg)
        for rnd in range(rounds):
            order = ["localrun", "llama-server"] if rnd % 2 == 0 else ["llama-server", "localrun"]
            for name in order:
                await asyncio.sleep(0.5)  # let the other server's threads settle
                s = servers[name]
                try:
                    res = await run_typing(s.url, route if name == "localrun" else "infill",
                                           s.model if name == "localrun" else None, file_tokens, edits, rate,
                                           max_tokens, None, timeout)
                except (OSError, RuntimeError, httpx.HTTPError) as exc:  # say which server failed
                    raise vs.VsError(f"{name}: {type(exc).__name__}: {exc}\n{s.log_tail()}") from None
                res.update(server=name, round=rnd)
                runs.append(res)
                progress(f"round {rnd + 1} {name:12} TTFT p50 {res['ttft_ms_p50']} ms  last token p95 "
                         f"{res['last_token_ms_p95']} ms  finished {res['finished']}/{res['edits']}")
    summary: dict[str, Any] = {}
    for name in servers:
        mine = [r for r in runs if r["server"] == name]
        smp = {k: [x for r in mine for x in r["samples"][k]] for k in mine[0]["samples"]}
        summary[name] = {"edits": sum(r["edits"] for r in mine), "finished": sum(r["finished"] for r in mine),
                         "given_up": sum(r["given_up"] for r in mine),
                         **_stats(smp["ttft_ms"], smp["last_token_ms"], smp["prompt_tokens"], smp["cached_tokens"])}
    a, b = summary["localrun"]["last_token_ms_p95"], summary["llama-server"]["last_token_ms_p95"]
    summary["ratio_p95_total"] = round(a / b, 3) if a and b else None
    for r in runs:
        r.pop("samples", None)
    return {"bench": "typing-vs-llama-server", "gguf": str(gguf), "llama_server": str(llama_server_bin),
            "route": route, "file_tokens": file_tokens, "edits": edits, "rate": rate, "max_tokens": max_tokens,
            "rounds": rounds, "threads": threads, "parallel": parallel, "ctx": ctx, "runs": runs, "summary": summary}


def run(a: argparse.Namespace) -> dict[str, Any]:
    from localrun.bench.serve import default_api_key

    if a.llama_server:
        return run_compare(a)

    if a.url:
        url = a.url.rstrip("/")
    else:
        from localrun.config import settings

        url = settings().base_url
    key = a.api_key or default_api_key(url)
    return asyncio.run(run_typing(url, a.route, a.model, a.file_tokens, a.edits, a.rate, a.max_tokens, key,
                                  a.timeout))


def run_compare(a: argparse.Namespace) -> dict[str, Any]:
    import sys

    from localrun.backends.llamacpp.cpu import physical_cores
    from localrun.bench.llama_server_build import BuildError, ensure_llama_server
    from localrun.bench.vs_llama_server import VsError

    if a.url:
        raise ValueError("--llama-server starts both servers itself: leave --url out")
    if not a.gguf:
        raise ValueError("--llama-server needs --gguf FILE: the GGUF both servers run (a model with FIM tokens)")
    progress = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    try:
        binary = ensure_llama_server(progress) if a.llama_server == "auto" else a.llama_server
        return asyncio.run(compare(a.gguf, str(binary), a.route, a.file_tokens, a.edits, a.rate, a.max_tokens,
                                   a.rounds, a.typing_threads or physical_cores(), a.parallel, a.ctx, a.timeout,
                                   progress))
    except (asyncio.CancelledError, KeyboardInterrupt):
        raise ValueError("stopped; both servers were stopped") from None
    except (BuildError, VsError) as exc:
        raise ValueError(str(exc)) from None
