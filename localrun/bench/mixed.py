"""`localrun bench mixed`: every API at once against one daemon, for a bounded time, with checks.

Where `bench soak` holds one kind of request steady (and checks each answer against a reference),
this one mixes what a real machine sees: streamed chat through the OpenAI, Ollama and Anthropic
APIs, streams the client walks away from after a few tokens, text completions, embeddings (some
past the window: Ollama truncates them), a long Ollama chat that has to drop turns, token counts,
/tokenize and /detokenize (now and then an id outside the vocabulary: a 400), scored prompts as lm-eval
sends them (a batch of a question's choices, `echo` with `logprobs`), `ps` and `show`, unloads
(`keep_alive: 0`) of a model other requests are using, a second model with its own runner (its chat
template an Ollama Go template), and beside them a loop that creates and deletes models and uploads blobs.

It passes when, for the whole run: no 5xx, no transport error (a dropped connection, a reset), no
error inside a stream, no 4xx except a full queue (503 is not counted either); and afterwards the
daemon still answers, its runners are at most LOCALRUN_MAX_LOADED_MODELS, and the library holds no
temp file (every upload and create finished or cleaned up). It starts its own daemon (a temporary
LOCALRUN_HOME, the bundled smollm2:135m, no network) unless --url names one on this machine.

    localrun bench mixed [--seconds 120] [--clients 8] [--url http://127.0.0.1:11480]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import random
import time
from pathlib import Path

MODEL = "smollm2:135m"
SECOND = "mixed-pirate:latest"  # a second model (same weights, its own runner)
KINDS = ("openai", "openai_walk_away", "ollama", "ollama_long_chat", "anthropic", "completions", "embeddings",
         "ollama_embed_truncated", "count_tokens", "tokenize", "scoring", "ps", "show", "unload", "second_model")
# the second model's template: ChatML in Ollama's Go template language (rendered by localrun.templates.go)
SECOND_TEMPLATE = ("{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}"
                   "<|im_start|>assistant\n")


def add_parser(sub) -> None:
    ap = sub.add_parser("mixed", help="every API at once (streams, walk-aways, embeddings, unloads, creates, "
                        "uploads) for a bounded time: no 5xx, no dropped connection, nothing left behind",
                        description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=120.0, help="how long the mix runs (default 120)")
    ap.add_argument("--clients", type=int, default=8, help="concurrent request loops (default 8)")
    ap.add_argument("--url", default=None, help="an existing daemon on this machine instead of our own")
    ap.add_argument("--seed", type=int, default=0)


class Tally:
    def __init__(self) -> None:
        self.ok: dict[str, int] = {k: 0 for k in (*KINDS, "create", "delete", "upload")}
        self.busy = 0  # 503: a full queue, honoured, not a failure
        self.problems: list[str] = []

    def problem(self, what: str) -> None:
        self.problems.append(what[:400])

    def answered(self, kind: str, what: str, r, ok: tuple[int, ...] = (200,)) -> None:
        """r answered `what` (a `kind` of request): counted, or a problem when its status is not in `ok`."""
        if r.status_code in ok:
            self.ok[kind] += 1
        else:
            self.problem(f"{what}: HTTP {r.status_code}: {r.text[:300]}")


async def _stream(c, path: str, body: dict, walk_away: int | None = None):
    """POST a streaming request; the response (read), or None after walking away. Errors inside the
    stream (an SSE error event, an NDJSON error line) raise."""
    n = 0
    async with c.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return r
        async for line in r.aiter_lines():
            if not line.strip():
                continue
            n += 1
            head = line[:60]
            if line.startswith("event: error") or '"error"' in head:
                raise RuntimeError(f"an error inside the stream of {path}: {line[:300]}")
            if walk_away is not None and n >= walk_away:
                return None  # closing the response: the daemon must abort the request
    return r


def _messages(rng: random.Random, i: int) -> list[dict]:
    topic = rng.choice(["tea", "ships", "bees", "rain", "bridges", "paper"])
    return [{"role": "user", "content": f"Tell me a short fact number {i} about {topic}."}]


async def _one(c, kind: str, model: str, rng: random.Random, i: int):
    if kind in ("openai", "openai_walk_away", "second_model"):
        return await _stream(c, "/v1/chat/completions", {
            "model": model, "messages": _messages(rng, i), "max_tokens": rng.randint(1, 40), "stream": True,
            "temperature": 0.7}, walk_away=3 if kind == "openai_walk_away" else None)
    if kind == "ollama":
        return await _stream(c, "/api/chat", {"model": model, "messages": _messages(rng, i),
                                              "options": {"num_predict": 20}})
    if kind == "ollama_long_chat":  # ~2,000 tokens against a 1,024 window: Ollama drops the oldest turns
        msgs: list[dict] = []
        for j in range(40):
            msgs += [{"role": "user", "content": f"Question {j}: tell me about the ocean. " * 4},
                     {"role": "assistant", "content": "It is deep. " * 8}]
        msgs.append({"role": "user", "content": "Summarize."})
        return await c.post("/api/chat", json={"model": model, "messages": msgs, "stream": False,
                                               "options": {"num_predict": 8, "num_ctx": 1024}})
    if kind == "anthropic":
        return await _stream(c, "/v1/messages", {"model": model, "max_tokens": 20, "stream": True,
                                                 "messages": _messages(rng, i)})
    if kind == "completions":
        return await c.post("/v1/completions", json={"model": model, "prompt": "Once upon a time", "max_tokens": 10})
    if kind == "embeddings":
        return await c.post("/v1/embeddings", json={"model": MODEL, "input": [
            f"text {i} " * rng.randint(1, 50) for _ in range(rng.randint(1, 4))]})
    if kind == "ollama_embed_truncated":
        return await c.post("/api/embed", json={"model": MODEL, "input": "word " * rng.randint(1, 3000)})
    if kind == "count_tokens":
        return await c.post("/v1/messages/count_tokens", json={"model": model, "messages": _messages(rng, i)})
    if kind == "tokenize":  # there and back; now and then an id outside the vocabulary: a 400, the runner lives on
        r = await c.post("/tokenize", json={"model": model, "messages": _messages(rng, i)})
        if r.status_code != 200:
            return r
        ids = r.json()["tokens"]
        if rng.random() < 0.2:
            bad = await c.post("/detokenize", json={"model": model, "tokens": [*ids, 10_000_000]})
            if bad.status_code not in (400, 503):
                raise RuntimeError(f"an id outside the vocabulary got HTTP {bad.status_code}: {bad.text[:200]}")
        return await c.post("/detokenize", json={"model": model, "tokens": ids})
    if kind == "scoring":  # lm-eval's loglikelihood: a question's choices in one batch, each scored
        context = f"Question {i % 7}: which word follows 'the quick brown'? Answer:"
        choices = rng.sample([" fox", " dog", " cat", " bird", " house"], rng.randint(2, 4))
        r = await c.post("/v1/completions", json={"model": model, "prompt": [context + x for x in choices],
                                                  "echo": True, "logprobs": 1, "max_tokens": rng.choice([0, 1]),
                                                  "temperature": 0})
        if r.status_code == 200:
            for ch in r.json()["choices"]:
                lp = ch["logprobs"]
                if lp["token_logprobs"][0] is not None or None in lp["token_logprobs"][1:] or \
                        not ch["text"].startswith(context):
                    raise RuntimeError(f"a scored prompt came back wrong: {str(ch)[:300]}")
        return r
    if kind == "ps":
        return await c.get("/api/ps")
    if kind == "show":
        return await c.post("/api/show", json={"model": model})
    if kind == "unload":
        return await c.post("/api/generate", json={"model": rng.choice([MODEL, SECOND]), "keep_alive": 0})
    raise ValueError(kind)


async def _client(c, wid: int, deadline: float, seed: int, tally: Tally) -> None:
    import httpx

    rng = random.Random(seed * 1000 + wid)
    i = 0
    while time.monotonic() < deadline:
        i += 1
        kind = rng.choice(KINDS)
        model = SECOND if kind == "second_model" or rng.random() < 0.2 else MODEL
        try:
            r = await _one(c, kind, model, rng, i)
        except (httpx.TransportError, httpx.StreamError) as exc:
            tally.problem(f"{kind} ({model}): the connection failed: {type(exc).__name__}: {exc}")
            continue
        except RuntimeError as exc:
            tally.problem(f"{kind} ({model}): {exc}")
            continue
        if r is None:  # walked away
            tally.ok[kind] += 1
        elif r.status_code == 503:
            tally.busy += 1
            await asyncio.sleep(float(r.headers.get("retry-after") or 1))
        else:
            tally.answered(kind, f"{kind} ({model})", r, ok=tuple(range(200, 400)))


async def _library_churn(c, deadline: float, tally: Tally) -> None:
    """Creates and deletes models and uploads blobs while the clients run."""
    n = 0
    while time.monotonic() < deadline:
        n += 1
        name = f"mixed-tmp{n % 3}"
        r = await c.post("/api/create", json={"model": name, "from": MODEL, "system": f"You are number {n}.",
                                              "stream": False})
        tally.answered("create", f"create {name}", r)
        data = os.urandom(200_000)
        r = await c.post(f"/api/blobs/sha256:{hashlib.sha256(data).hexdigest()}", content=data)
        tally.answered("upload", "upload", r, ok=(200, 201))
        r = await c.request("DELETE", "/api/delete", json={"model": name})
        tally.answered("delete", f"delete {name}", r)
        await asyncio.sleep(1.0)


async def _mix(url: str, seconds: float, clients: int, seed: int, models_dir: Path | None) -> Tally:
    import httpx

    from localrun.bench.soak_daemon import SoakError

    tally = Tally()
    async with httpx.AsyncClient(base_url=url, timeout=600) as c:
        r = await c.post("/api/pull", json={"model": MODEL, "stream": False})
        if r.status_code != 200:
            raise SoakError(f"pulling {MODEL} failed: HTTP {r.status_code}: {r.text[:300]}")
        r = await c.post("/api/create", json={"model": SECOND, "from": MODEL, "system": "You are a pirate.",
                                              "template": SECOND_TEMPLATE, "stream": False})
        if r.status_code != 200:
            raise SoakError(f"creating {SECOND} failed: HTTP {r.status_code}: {r.text[:300]}")
        deadline = time.monotonic() + seconds
        await asyncio.gather(*(_client(c, w, deadline, seed, tally) for w in range(clients)),
                             _library_churn(c, deadline, tally))
        # afterwards: the daemon answers, its runners are bounded, nothing is left in the library's tmp/
        try:
            ps = (await c.get("/api/ps", timeout=30)).json()["models"]
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            tally.problem(f"after the mix the daemon did not answer /api/ps: {exc!r}")
            return tally
        if models_dir is not None:  # our own daemon: LOCALRUN_MAX_LOADED_MODELS at its default
            from localrun.config import settings

            max_loaded = settings({}).max_loaded_models
            if len(ps) > max_loaded:
                tally.problem(f"{len(ps)} models loaded after the mix, more than LOCALRUN_MAX_LOADED_MODELS="
                              f"{max_loaded}")
        await c.request("DELETE", "/api/delete", json={"model": SECOND})
    if models_dir is not None:
        left = [p.name for p in (models_dir / "tmp").iterdir()] if (models_dir / "tmp").is_dir() else []
        if left:
            tally.problem(f"temp files left in the library after the mix: {left[:5]}")
    return tally


def run(a: argparse.Namespace) -> int:
    from localrun.bench.soak_daemon import OwnDaemon, SoakConfig, SoakError, check_loopback, wait_ready

    own = None
    try:
        if a.url:
            url, models_dir = check_loopback(a.url), None
        else:
            own = OwnDaemon(SoakConfig(num_parallel=4))
            url, models_dir = own.url, own.home / "models"
        asyncio.run(wait_ready(url, own, 120.0))
        t0 = time.monotonic()
        tally = asyncio.run(_mix(url, a.seconds, a.clients, a.seed, models_dir))
        wall = time.monotonic() - t0
        if own is not None and (code := own.stop()) != 0:
            tally.problem(f"the daemon exited with code {code} on SIGTERM:\n{own.log_tail()}")
    except SoakError as exc:
        print(f"error: {exc}")
        return 2
    finally:
        if own is not None:
            own.stop()  # (again: a no-op once it has exited)
            own.cleanup()
    print(f"mixed workload: {a.clients} clients + library churn for {a.seconds:g} s ({wall:.0f} s with setup), "
          f"{sum(tally.ok.values())} requests answered, {tally.busy} queue-full (503, retried)")
    for kind, n in tally.ok.items():
        print(f"  {kind:24} {n:6d}")
    for p in tally.problems[:30]:
        print(f"PROBLEM {p}")
    print(f"problems: {len(tally.problems)}")
    return 1 if tally.problems else 0
