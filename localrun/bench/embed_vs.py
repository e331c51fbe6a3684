"""`localrun bench embed`: embeddings and reranking, localrun against llama.cpp's own llama-server on the same GGUF.

RAG indexers (Open WebUI, Continue, LangChain, LlamaIndex) send their documents to an embedding model in batches,
and a reranker scores a query's candidates in one request. This starts localrun and ``llama-server --embedding``
(``--pooling mean`` for a generating model, which localrun mean-pools too; ``--reranking`` for a reranker) on
loopback with the same GGUF and threads, and alternates them, round by round:

- ``batch``: one request with ``--texts`` distinct texts of ``--tokens`` tokens (a reranker: one query and that
  many documents), on ``/v1/embeddings`` (``/v1/rerank``);
- ``single``: ``--singles`` requests one after another, one text (one document) each.

Per server and workload: the wall time (``batch``) or the median request (``single``); per workload the speed ratio
llama-server time / localrun time (above 1: localrun is faster), the median over rounds. The first round also
compares the two servers' numbers for the same inputs (largest difference of a vector element or raw score).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

WORKLOADS = ("batch", "single")


async def _post(h, url: str, body: dict) -> dict | list:
    r = await h.post(url, json=body)
    if r.status_code != 200:
        from localrun.bench.vs_llama_server import VsError

        raise VsError(f"{url}: HTTP {r.status_code}: {r.text[:300]}")
    return r.json()


def _vectors(body: dict) -> list[list[float]]:
    return [d["embedding"] for d in sorted(body["data"], key=lambda d: d["index"])]


def _scores(body: dict) -> list[float]:
    return [x["relevance_score"] for x in sorted(body["results"], key=lambda x: x["index"])]


async def _request(h, server, kind: str, query: str, texts: list[str]) -> list:
    """The numbers one request gives: vectors, or raw reranking scores (llama-server's are raw logits; localrun's
    with raw_scores)."""
    if kind == "rerank":
        body: dict[str, Any] = {"query": query, "documents": texts}
        if server.name == "localrun":
            body.update(model=server.model, raw_scores=True)
        return _scores(await _post(h, server.url + "/v1/rerank", body))
    body = {"input": texts}
    if server.name == "localrun":
        body["model"] = server.model
    return _vectors(await _post(h, server.url + "/v1/embeddings", body))


async def _phase(server, kind: str, workload: str, query: str, texts: list[str]) -> tuple[float, list]:
    """(seconds: the batch's wall time, or the median single request; the numbers of the batch)."""
    import httpx

    async with httpx.AsyncClient(timeout=3600.0) as h:
        if workload == "batch":
            t0 = time.perf_counter()
            out = await _request(h, server, kind, query, texts)
            return time.perf_counter() - t0, out
        times = []
        for t in texts:
            t0 = time.perf_counter()
            await _request(h, server, kind, query, [t])
            times.append(time.perf_counter() - t0)
        return statistics.median(times), []


def _max_diff(a: list, b: list) -> float:
    flat = lambda v: [x for row in v for x in (row if isinstance(row, list) else [row])]  # noqa: E731
    return max((abs(x - y) for x, y in zip(flat(a), flat(b))), default=0.0)


async def run(cfg, kind: str, generating: bool, causal: bool, texts: int, tokens: int, singles: int, rounds: int,
              progress=print) -> dict[str, Any]:
    from localrun.bench import vs_llama_server as vs

    vocab = vs.Vocab(cfg.gguf)
    home = Path(tempfile.mkdtemp(prefix="localrun-bench-embed-"))
    servers = {"localrun": vs.localrun_server(cfg, home), "llama-server": vs.llama_server(cfg, home)}
    ls = servers["llama-server"]
    ls.argv += ["--reranking"] if kind == "rerank" else ["--embedding"] + (["--pooling", "mean"] if generating else [])
    if not causal:  # an encoder sees each input whole in one pass: localrun's passes are its window too
        ls.argv += ["-b", str(cfg.ctx), "-ub", str(cfg.ctx)]
    results: dict[str, dict[str, list[float]]] = {w: {n: [] for n in servers} for w in WORKLOADS}
    diffs: dict[str, float] = {}
    async with vs.serving(servers, home):
        for s in servers.values():
            await vs.start(s, cfg)
            await _phase(s, kind, "batch", "warm up", vs.distinct_prompts(vocab, 2, 8, 99))
        for rnd in range(rounds):
            order = ["localrun", "llama-server"] if rnd % 2 == 0 else ["llama-server", "localrun"]
            query = vs.distinct_prompts(vocab, 1, 12, 1000 + rnd)[0]
            batch = vs.distinct_prompts(vocab, texts, tokens, 2000 + rnd)
            single = vs.distinct_prompts(vocab, singles, tokens, 3000 + rnd)
            outs = {}
            for name in order:
                for w, inputs in (("batch", batch), ("single", single)):
                    sec, out = await _phase(servers[name], kind, w, query, inputs)
                    results[w][name].append(sec)
                    if w == "batch":
                        outs[name] = out
                    progress(f"round {rnd + 1}: {name} {w}: {sec * 1000:.0f} ms")
            if rnd == 0:
                diffs["batch"] = _max_diff(outs["localrun"], outs["llama-server"])
    summary = {}
    for w in WORKLOADS:
        lr, ls_t = results[w]["localrun"], results[w]["llama-server"]
        summary[w] = {"localrun_s": round(statistics.median(lr), 4), "llama_server_s": round(statistics.median(ls_t), 4),
                      "speed": round(statistics.median([b / a for a, b in zip(lr, ls_t)]), 3)}
    return {"gguf": str(cfg.gguf), "kind": kind, "threads": cfg.threads, "texts": texts, "tokens": tokens,
            "singles": singles, "rounds": rounds, "rounds_s": results, "summary": summary,
            "max_diff_first_round": diffs.get("batch")}


def add_parser(sub) -> None:
    e = sub.add_parser("embed", help="embeddings / reranking: localrun vs llama-server on the same GGUF, interleaved")
    e.add_argument("--gguf", type=Path, help="an embedding model, a reranker or a generating model (mean-pooled) "
                                             "(default: the bundled SmolLM2-135M)")
    e.add_argument("--llama-server", type=Path, help="a llama-server binary built from the vendored llama.cpp "
                                                     "(default: LOCALRUN_LLAMA_SERVER, else the cached build)")
    e.add_argument("--threads", dest="llama_threads", type=int, help="threads for both (default: the physical cores)")
    e.add_argument("--texts", type=int, default=64, help="texts (documents) in the batch request")
    e.add_argument("--tokens", type=int, default=80, help="tokens a text")
    e.add_argument("--singles", type=int, default=16, help="one-text requests, one after another")
    e.add_argument("--ctx", type=int, default=2048, help="the window (localrun: num_ctx; llama-server: -c)")
    e.add_argument("--rounds", type=int, default=2)
    e.add_argument("--out", type=Path, help="also write the result as JSON here")


def main(args) -> int:
    from localrun.backends.llamacpp.pooled import is_causal, pooled_window
    from localrun.backends.base import LoadSpec
    from localrun.backends.llamacpp.cpu import extra_buffers, physical_cores
    from localrun.bench import vs_llama_server as vs
    from localrun.bench.results import print_table
    from localrun.library import read_gguf_info
    from localrun.library.capabilities import gguf_kind

    try:
        gguf, binary = vs.gguf_and_server(args)
        if min(args.texts, args.tokens, args.singles, args.rounds) < 1:
            raise vs.VsError("--texts, --tokens, --singles and --rounds must be at least 1")
        info = read_gguf_info(gguf)
        kind = gguf_kind(info)
        window = pooled_window(LoadSpec("bench", gguf, "gguf", args.ctx), info)
        cfg = vs.Config(gguf=gguf, llama_server=binary, threads=args.llama_threads or physical_cores(),
                        parallel=1, ctx=window, extra_buffers=extra_buffers("auto")[0])
        res = asyncio.run(run(cfg, "rerank" if kind == "rerank" else "embed", kind == "completion", is_causal(info),
                              args.texts, args.tokens, args.singles, args.rounds))
    except (asyncio.CancelledError, KeyboardInterrupt):
        print("localrun bench embed: stopped; both servers were stopped", file=sys.stderr)
        return 130
    except vs.VsError as exc:
        print(f"localrun bench embed: {exc}", file=sys.stderr)
        return 1
    s = res["summary"]
    what = "documents" if res["kind"] == "rerank" else "texts"
    rows = [[f"batch: {args.texts} {what} of {args.tokens} tokens, one request", f"{s['batch']['localrun_s'] * 1000:.0f} ms",
             f"{s['batch']['llama_server_s'] * 1000:.0f} ms", f"{s['batch']['speed']:.2f}x"],
            [f"single: one {what[:-1]} a request, median of {args.singles}", f"{s['single']['localrun_s'] * 1000:.1f} ms",
             f"{s['single']['llama_server_s'] * 1000:.1f} ms", f"{s['single']['speed']:.2f}x"]]
    print_table(f"{res['kind']}: localrun vs llama-server, {cfg.gguf.name}, {cfg.threads} threads, window {cfg.ctx}, "
                f"{args.rounds} rounds (first round's largest difference: {res['max_diff_first_round']:.2g})",
                ["workload", "localrun", "llama-server", "speed (llama-server time / localrun's)"], rows)
    if args.out:
        args.out.write_text(json.dumps(res, indent=1))
    return 0
