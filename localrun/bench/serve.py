"""`localrun bench serve`: online latency/throughput against any OpenAI-compatible URL.

Method (docs/benchmarks.md): async clients, fixed input / output lengths
(default 512 / 256), a concurrency ladder (default 1, 10, 50, 100). At each level, ``c``
clients send streamed requests back to back; the first ``warmup`` seconds are not
measured, then a fixed ``window`` is. Measured in the window, from SSE chunk arrival
times:

- output tok/s = output tokens that arrived inside the window / window seconds
  (chunks are counted; the tokens-per-chunk ratio of finished requests, from the
  server's usage counts, converts chunks to tokens and is reported: 1.0 on servers that
  stream one token per chunk)
- TTFT = first content chunk - request sent (requests whose first token arrived in the window)
- ITL = gaps between consecutive content chunks of one request (both inside the window)

Every request gets a prompt of its own (seeded by a counter that runs across all levels), so
no request can reuse another's KV from a prefix cache: a cycled pool of prompts would let
the cache inflate the high-concurrency levels.

Requests ask for ``max_tokens`` = output length and ``ignore_eos`` (vLLM/SGLang/localrun
accept it; a server that rejects the field is retried without it and the result says so).
Prompts are built to be exactly ``input_len`` tokens long where a tokenizer is available
(``--tokenizer``), else approximated with one-token words; the server's own usage counts
are reported either way.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import httpx

from localrun.bench.results import percentile

# Common English words that BPE tokenizers (Llama 3, SmolLM2, Qwen, Mistral) encode as
# one token each when preceded by a space.
_WORDS = (
    "the of and to in is was for on are with as be at by this had not but from or have an they "
    "which one you were all we her she there been if more when will would who so no out up into "
    "do than time could new two may then first any like now my such make over our even most me "
    "state after also made many did must before back see through way where get much go well your "
    "know should down work year because come people just say each those take day good how long "
    "little use man great under last never very while might us old off same world here three small "
    "large part place case point group end right high number life children house family water city"
).split()


class ServeBenchError(Exception):
    """The server cannot be benchmarked; the message says what to do."""


@dataclass
class RequestTrace:
    sent: float
    chunk_times: list[float] = field(default_factory=list)
    finished: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    error: str | None = None


def build_prompt(input_len: int, seed: int, tokenizer=None) -> str:
    """A distinct prompt of exactly ``input_len`` tokens (with a tokenizer; special tokens
    not counted) or ~``input_len`` one-token words without one."""
    rng = random.Random(seed)
    # distinct from the first token on, so requests share no prefix a cache could reuse
    words = [_WORDS[(seed * 7919) % len(_WORDS)]] + [rng.choice(_WORDS) for _ in range(input_len * 2 + 8)]
    text = " ".join(words)
    if tokenizer is None:
        return " ".join(words[:input_len])
    enc = lambda t: tokenizer.encode(t, add_special_tokens=False)  # noqa: E731
    ids = enc(text)[:input_len]
    for _ in range(8):  # decode/re-encode can merge or split a token at the cut
        text = tokenizer.decode(ids)
        n = len(enc(text))
        if n == input_len:
            return text
        ids = ids[: len(ids) - 1] if n > input_len else ids + enc(" " + rng.choice(_WORDS))[:1]
    return text  # closest we got; usage counts report the truth


class BenchClient:
    def __init__(self, url: str, model: str, endpoint: str, api_key: str | None, concurrency: int):
        self.url = url.rstrip("/")
        self.model = model
        self.endpoint = endpoint
        self.ignore_eos = True
        self.temperature = 1.0  # the field's method; 0 = greedy (localrun bench llama-server)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.AsyncClient(
            headers=headers,
            timeout=httpx.Timeout(connect=30.0, read=900.0, write=60.0, pool=900.0),
            limits=httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8),
        )

    def body(self, prompt: str, max_tokens: int) -> dict[str, Any]:
        b: dict[str, Any] = {
            "model": self.model, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": self.temperature, "top_p": 1.0,
        }
        if self.endpoint == "chat":
            b["messages"] = [{"role": "user", "content": prompt}]
        else:
            b["prompt"] = prompt
        if self.ignore_eos:
            b["ignore_eos"] = True
        return b

    async def request(self, prompt: str, max_tokens: int, tr: RequestTrace | None = None) -> RequestTrace:
        """One streamed request; fills ``tr`` (registered by the caller, so a request
        cancelled mid-stream still leaves its chunk times behind)."""
        path = "/chat/completions" if self.endpoint == "chat" else "/completions"
        tr = tr or RequestTrace(sent=0.0)
        tr.sent = time.perf_counter()
        async with self.http.stream("POST", self.url + path, json=self.body(prompt, max_tokens)) as resp:
            if resp.status_code >= 400:
                tr.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode('utf-8', 'replace')[:500]}"
                return tr
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                try:
                    ev = json.loads(data)
                except ValueError:
                    continue
                if "error" in ev:
                    tr.error = str(ev["error"])
                    break
                for ch in ev.get("choices") or []:
                    piece = ch.get("text") if self.endpoint != "chat" else (ch.get("delta") or {}).get("content")
                    if piece:
                        tr.chunk_times.append(time.perf_counter())
                        break
                usage = ev.get("usage")
                if usage:
                    tr.prompt_tokens = usage.get("prompt_tokens")
                    tr.completion_tokens = usage.get("completion_tokens")
        tr.finished = time.perf_counter()
        return tr

    async def close(self) -> None:
        await self.http.aclose()


async def _resolve_model(client: BenchClient) -> str:
    try:
        r = await client.http.get(client.url + "/models")
    except httpx.HTTPError as exc:
        raise ServeBenchError(
            f"no server answers at {client.url} ({exc.__class__.__name__}): start one with "
            "`localrun serve`, or pass --url of an OpenAI-compatible server (e.g. http://127.0.0.1:8000/v1)"
        ) from None
    if r.status_code >= 400:
        raise ServeBenchError(f"GET {client.url}/models answered HTTP {r.status_code}: {r.text[:300]}")
    data = (r.json() or {}).get("data") or []
    if not data:
        raise ServeBenchError(f"{client.url}/models lists no model: pass --model NAME (pull one with `localrun pull`)")
    return data[0]["id"]


async def _probe(client: BenchClient, prompt: str, output_len: int) -> None:
    """One untimed request: loads the model, and finds out whether ignore_eos is accepted."""
    try:
        tr = await client.request(prompt, output_len)
    except httpx.HTTPError as exc:
        raise ServeBenchError(f"request to {client.url} failed: {exc.__class__.__name__}: {exc}") from None
    if tr.error and tr.error.startswith(("HTTP 400", "HTTP 422")) and "ignore_eos" in tr.error:
        client.ignore_eos = False
        tr = await client.request(prompt, output_len)
    if tr.error:
        raise ServeBenchError(f"the server rejected a benchmark request: {tr.error}")


class PromptSource:
    """A distinct prompt for every request (never reused, within a level or across levels)."""

    def __init__(self, input_len: int, tokenizer=None, first_seed: int = 0) -> None:
        self.input_len, self.tokenizer = input_len, tokenizer
        self._seeds = itertools.count(first_seed)
        self.issued = 0

    def next(self) -> str:
        self.issued += 1
        return build_prompt(self.input_len, next(self._seeds), self.tokenizer)


async def run_level(
    client: BenchClient,
    concurrency: int,
    prompts: PromptSource,
    output_len: int,
    warmup_s: float,
    window_s: float,
    tick: Callable[[float], None] | None = None,
) -> dict[str, Any]:
    """``concurrency`` clients back to back for warmup_s + window_s; metrics over the window."""
    live: list[RequestTrace] = []
    start = time.perf_counter()
    t0 = start + warmup_s
    t1 = t0 + window_s

    async def worker() -> None:
        while time.perf_counter() < t1:
            tr = RequestTrace(sent=time.perf_counter())
            live.append(tr)
            try:
                await client.request(prompts.next(), output_len, tr)
            except httpx.HTTPError as exc:
                tr.error = f"{exc.__class__.__name__}: {exc}"
            if tr.error:  # e.g. 503 queue full: back off instead of hammering
                await asyncio.sleep(0.1)

    tasks = [asyncio.create_task(worker()) for _ in range(concurrency)]
    try:
        while time.perf_counter() < t1:
            await asyncio.sleep(min(0.25, max(0.0, t1 - time.perf_counter())))
            if tick:
                tick(min(1.0, (time.perf_counter() - start) / (warmup_s + window_s)))
            if all(t.done() for t in tasks):
                break
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    errors = [tr.error for tr in live if tr.error]
    if errors and not any(tr.finished and not tr.error for tr in live):
        raise ServeBenchError(f"every request failed at concurrency {concurrency}: {errors[0]}")

    chunks_in = [t for tr in live for t in tr.chunk_times if t0 <= t <= t1]
    done = [tr for tr in live if tr.finished and not tr.error and tr.completion_tokens]
    total_chunks = sum(len(tr.chunk_times) for tr in done)
    tok_per_chunk = (sum(tr.completion_tokens for tr in done) / total_chunks) if total_chunks else 1.0
    ttft = [tr.chunk_times[0] - tr.sent for tr in live if tr.chunk_times and t0 <= tr.chunk_times[0] <= t1]
    itl = [
        b - a for tr in live for a, b in zip(tr.chunk_times, tr.chunk_times[1:]) if t0 <= a and b <= t1
    ]
    finished_in = [tr for tr in done if t0 <= tr.finished <= t1]
    out_tokens = len(chunks_in) * tok_per_chunk
    ms = lambda v: None if v is None else v * 1000.0  # noqa: E731
    return {
        "concurrency": concurrency,
        "window_s": window_s,
        "warmup_s": warmup_s,
        "requests_sent": len(live),
        "requests_finished_in_window": len(finished_in),
        "errors": len(errors),
        "output_chunks_in_window": len(chunks_in),
        "tokens_per_chunk": tok_per_chunk,
        "output_tokens_in_window": out_tokens,
        "output_tok_s": out_tokens / window_s,
        "requests_per_s": len(finished_in) / window_s,
        "ttft_ms_p50": ms(percentile(ttft, 50)),
        "ttft_ms_p95": ms(percentile(ttft, 95)),
        "itl_ms_p50": ms(percentile(itl, 50)),
        "itl_ms_p95": ms(percentile(itl, 95)),
        "ttft_samples": len(ttft),
        "itl_samples": len(itl),
        "server_prompt_tokens_mean": _mean([tr.prompt_tokens for tr in done if tr.prompt_tokens]),
        "server_completion_tokens_mean": _mean([tr.completion_tokens for tr in done]),
    }


def _mean(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def default_url() -> str:
    from localrun.config import settings

    return settings().base_url + "/v1"


def default_api_key(url: str) -> str | None:
    """The daemon's key (LOCALRUN_API_KEY) when benchmarking the daemon itself."""
    from localrun.config import settings

    s = settings()
    return s.api_key if url.rstrip("/").startswith(s.base_url) else None


async def run_serve(
    url: str,
    model: str | None = None,
    input_len: int = 512,
    output_len: int = 256,
    concurrencies: tuple[int, ...] = (1, 10, 50, 100),
    warmup_s: float = 10.0,
    window_s: float = 60.0,
    tokenizer=None,
    endpoint: str = "completions",
    api_key: str | None = None,
    console=None,
) -> dict[str, Any]:
    """The whole ladder; returns a result dict (``levels`` holds one dict per concurrency)."""
    from localrun.bench.results import progress_bar

    if input_len < 1 or output_len < 1:
        raise ServeBenchError("--input-len and --output-len must be >= 1")
    if not concurrencies or min(concurrencies) < 1:
        raise ServeBenchError("--concurrency needs positive integers, e.g. 1,10,50,100")
    if window_s <= 0 or warmup_s < 0:
        raise ServeBenchError("--window must be > 0 and --warmup >= 0 seconds")
    client = BenchClient(url, model or "", endpoint, api_key, max(concurrencies))
    try:
        if not client.model:
            client.model = await _resolve_model(client)
        prompts = PromptSource(input_len, tokenizer)
        await _probe(client, prompts.next(), output_len)
        levels = []
        prog, update = progress_bar("bench serve", len(concurrencies) * 100, console)
        with prog:
            for k, c in enumerate(concurrencies):
                prog.update(prog.task_ids[0], description=f"concurrency {c}")
                levels.append(
                    await run_level(client, c, prompts, output_len, warmup_s, window_s,
                                    tick=lambda f, k=k: update(int((k + f) * 100)))
                )
        return {
            "mode": "serve",
            "url": url,
            "model": client.model,
            "endpoint": endpoint,
            "input_len": input_len,
            "output_len": output_len,
            "exact_input_len": tokenizer is not None,
            "ignore_eos_sent": client.ignore_eos,
            "unique_prompts": prompts.issued,  # one per request, the probe included
            "levels": levels,
        }
    finally:
        await client.close()
