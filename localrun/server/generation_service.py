"""The generation service: the one way from a validated request to tokens.

Every API (OpenAI chat/completions, Ollama generate/chat, Anthropic Messages, OpenAI
Responses) is a translator: it turns its JSON into a :class:`~localrun.server.job.Job`, calls
:meth:`GenerationService.start`, and turns the typed events of the
:class:`~localrun.server.generation.Generation` it gets back into its own wire shape. The
checks live here, once:

1. render the prompt (the model's template in the sandbox; Modelfile SYSTEM/MESSAGE:
   :mod:`localrun.server.prompt`),
2. lease the model (queue, admission, load: the model manager),
3. check the backend can do what the job asks (JSON schema, images, ...): 400 up front; images
   are checked and decoded before the lease (server/images.py: a model without a projector, too
   many, too big, a bomb, corrupt, a URL while fetching is off: 400 naming the part),
4. tokenize once (n choices share the prompt), check the context window (400 naming it),
   cap max_tokens at the room left (``fit_window``). A runner process tokenizes a single
   choice's prompt itself, with that same check, as part of starting it: one round trip to
   the runner before the first token, not two,
5. start the backend stream and wait for its first event, so a backend's refusal (a
   grammar it cannot build, a window it cannot fit) is still an HTTP error, not a broken
   stream,
6. split what the model writes into reasoning, content and tool calls
   (:mod:`localrun.server.output`) and hand back :class:`Delta`, :class:`ToolCalls`,
   :class:`Done` events with a normalized finish reason and usage (the Generation's events).

The lease is released exactly once: when the events end, when the consumer closes them,
or by :meth:`Generation.release` (idempotent) from whoever gives up first.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any, AsyncIterator, Awaitable, Callable

from localrun.backends.base import (CONTEXT_EXCEEDED, INFILL_BATCH, MEDIA_MARKER, GenerationRequest, Infill,
                                    fit_window)
from localrun.errors import InvalidRequest, ShuttingDown
from localrun.library.capabilities import KIND_USE, model_kind
from localrun.server import generic_tools
from localrun.server.generation import Generation
from localrun.server.harmony import is_harmony
from localrun.server.images import load_images
from localrun.server.job import Job
from localrun.server.loaded import Lease
from localrun.server.manager import DEFAULT, ModelManager
from localrun.server.output import Reasoning, reasoning_for
from localrun.server.prompt import context_advice, preserved_specials, render_prompt

log = logging.getLogger("localrun.generation")

RERANK_GROUP = 32  # documents one call to the runner scores


class GenerationService:
    def __init__(self, manager: ModelManager, metrics: Any = None) -> None:
        self.manager = manager
        self.metrics = metrics
        self.active: set[Generation] = set()
        self.draining = False

    def _admit(self) -> None:
        if self.draining:
            raise ShuttingDown("the daemon is shutting down; send the request again once it is back")

    async def drain(self, grace: float) -> None:
        """Admit nothing new; let running generations go on for up to `grace` seconds, then end
        each remaining one with an error (its stream closes properly, with a finish reason)."""
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        while self.active and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if not self.active:
            return
        exc = ShuttingDown(f"the daemon is shutting down: this answer was cut after the {grace:g}s grace period "
                           "(LOCALRUN_SHUTDOWN_GRACE); send the request again once it is back")
        for gen in list(self.active):
            gen.interrupted = exc
        for runner in list(self.manager.runners.values()):
            interrupt = getattr(runner.backend, "interrupt_all", None)
            if interrupt is not None:  # wakes the streams waiting on their next token
                interrupt(exc)

    async def start(self, job: Job, *, prime: bool = True) -> Generation:
        """Render, lease, check, tokenize and start `job`; raises (with the lease given back)
        on anything the request itself got wrong, before any response is sent. `prime` False: the
        backend is not started yet; the caller runs Generation.prime (or prime_soon) next."""
        self._admit()
        t0 = time.perf_counter()
        _check_generates(job)
        images = await self._images(job)
        prompt, reasoning = await self._render(job)
        if images:
            self._check_markers(prompt, images)
        lease, release = await self._lease(job)
        gen = None
        try:
            self._admit()  # it may have waited in the queue while the daemon began to stop
            self._check_capabilities(job, lease)
            if job.truncate and job.messages and len(job.messages) > 1:
                job, prompt, reasoning, images = await self._fit_messages(job, lease, prompt, reasoning, images)
            self._check_length(prompt, lease)
            if job.token_prompt is not None:
                requests = self._requests(job, lease, prompt, list(job.token_prompt))
            elif job.infill is not None:  # the backend lays the prompt out (and checks the window)
                requests = self._requests(job, lease, prompt, None)
            elif images or (job.n == 1 and getattr(lease.backend, "tokenizes_in_generate", False)):
                # the runner tokenizes (a prompt with images only it can: image tokens come from the projector)
                requests = self._requests(job, lease, prompt, None, images)
            else:
                ids = await lease.backend.tokenize(prompt, add_special=job.add_special)
                requests = self._requests(job, lease, prompt, ids)
            gen = Generation(self, job, lease, release, requests, prompt, reasoning, t0)
            self.active.add(gen)
            if self.metrics is not None:
                self.metrics.started(gen)
            if prime:
                await gen._prime()
        except InvalidRequest as exc:
            if gen is not None:
                self.active.discard(gen)
            await release()
            raise context_advice(exc, job, lease) from None
        except BaseException:
            if gen is not None:
                self.active.discard(gen)
            await release()
            raise
        return gen

    async def count_tokens(self, job: Job) -> int:
        """The length in tokens of the prompt `job` renders to, by its model's own template and
        tokenizer; nothing is generated (the model is loaded, or kept, for its tokenizer)."""
        self._admit()
        if job.images:
            # image tokens are known once the runner has laid the prompt out with the projector: start it
            # (prefill and one token, its prefix then cached for the real request) and read its length
            opts = replace(job.options, max_tokens=1, json_schema=None, json_mode=False, regex=None, choices=None,
                           grammar=None, logit_bias=None,
                           logprobs=False, stop=[], stop_token_ids=[])
            gen = await self.start(replace(job, options=opts, n=1, tools=job.tools))
            try:
                return gen.prompt_tokens
            finally:
                await gen.release()
        return len((await self.tokenize(job))[0])

    async def tokenize(self, job: Job) -> tuple[list[int], int]:
        """The token ids of the prompt `job` renders to (its model's template and tokenizer; images
        are not laid out here: count_tokens does that) and the window (num_ctx) they would run in.
        Nothing is generated; the model is loaded, or kept, for its tokenizer."""
        self._admit()
        if job.images:
            raise InvalidRequest("images are not tokenized here: /v1/messages/count_tokens counts a prompt with "
                                 "images")
        prompt, _ = await self._render(job)
        lease, release = await self._lease(job, slot=False)  # no generation slot: never behind a stream
        try:
            self._check_length(prompt, lease)  # bounded work: a prompt that cannot fit is not tokenized
            return await lease.backend.tokenize(prompt, add_special=job.add_special), lease.num_ctx
        finally:
            await release()

    async def detokenize(self, resolved: Any, ids: list[int], *, keep_alive: Any = DEFAULT) -> str:
        """The text token ids stand for, by the model's own vocabulary (an id outside it is a 400)."""
        self._admit()
        async with self.manager.use(resolved, keep_alive=keep_alive, slot=False) as lease:
            return await lease.backend.detokenize(ids)

    async def tokenizer(self, resolved: Any, *, keep_alive: Any = DEFAULT) -> tuple[str, str, int]:
        """The model's (begin-of-text token, end-of-text token, window): its vocabulary's, loaded (or kept)."""
        self._admit()
        async with self.manager.use(resolved, keep_alive=keep_alive, slot=False) as lease:
            info = lease.backend.info
            return info.bos_token, info.eos_token, lease.num_ctx

    async def embed(self, resolved: Any, texts: list[str], *, keep_alive: Any = DEFAULT,
                    dimensions: int | None = None, truncate: bool = False) -> tuple[list[list[float]], int]:
        """Embedding vectors (truncated to `dimensions`, then re-normalized, as OpenAI's
        text-embedding-3 models do) and the number of input tokens. An input longer than the model's
        embedding window is a 400, or with `truncate` (Ollama's /api/embed) its first tokens are embedded."""
        self._admit()
        if model_kind(resolved) == "rerank":
            what, where = KIND_USE["rerank"]
            raise InvalidRequest(f'"{resolved.name}" does not support embeddings: it is {what}, which scores '
                                 f"documents against a query; use it with {where}")
        async with self._able(resolved, keep_alive, "supports_embeddings", "make embeddings") as lease:
            vectors = await lease.backend.embed(texts, truncate=truncate)
            counts = [len(await lease.backend.tokenize(t, add_special=True)) for t in texts]
            window = lease.backend.info.embed_window
            n_tokens = sum(min(n, window) for n in counts) if truncate and window else sum(counts)
        if dimensions is not None:
            if vectors and dimensions > len(vectors[0]):  # (OpenAI refuses a size its model cannot give)
                raise InvalidRequest(f"'dimensions' is {dimensions}; {resolved.name}'s embeddings have "
                                     f"{len(vectors[0])}: ask for {len(vectors[0])} or fewer")
            vectors = [_renormalize(v[:dimensions]) for v in vectors]
        return vectors, n_tokens

    @asynccontextmanager
    async def _able(self, resolved: Any, keep_alive: Any, able: str, doing: str) -> AsyncIterator[Lease]:
        """A lease of the loaded model whose backend can (BackendInfo.`able`), else a 400 saying it cannot `doing`."""
        async with self.manager.use(resolved, keep_alive=keep_alive) as lease:
            info = lease.backend.info
            if not getattr(info, able):
                raise InvalidRequest(f"{resolved.name} runs on the {info.name} backend, which does not {doing}")
            yield lease

    async def rerank(self, resolved: Any, query: str, documents: list[str], *, keep_alive: Any = DEFAULT,
                     truncate: bool = False) -> tuple[list[list[float]], list[int]]:
        """Each document's classifier outputs against the query, and each pair's tokens (a reranker's: the
        model's GGUF has a classifier head). A pair over the model's window is a 400, or with `truncate`
        its document is cut."""
        self._admit()
        if (kind := model_kind(resolved)) != "rerank":
            what = KIND_USE[kind][0]
            raise InvalidRequest(f'"{resolved.name}" does not support reranking: it is {what}. A reranker\'s GGUF '
                                 "has a classifier head (bge-reranker-v2-m3, Qwen3-Reranker)")
        async with self._able(resolved, keep_alive, "supports_rerank", "rerank") as lease:
            scores: list[list[float]] = []
            counts: list[int] = []
            # a few documents a call: a client that goes away stops the work within one group
            for i in range(0, len(documents), RERANK_GROUP):
                s, c = await lease.backend.rerank(query, documents[i:i + RERANK_GROUP], truncate=truncate)
                scores += s
                counts += c
            return scores, counts

    @staticmethod
    async def _render(job: Job) -> tuple[str, Reasoning | None]:
        """The prompt, and how the model marks its thinking (None: it does not think)."""
        if job.infill is not None:  # laid out by the backend with the model's FIM tokens, no template
            return job.prompt or "", None
        if job.messages is not None and job.tool_format is None and generic_tools.needed(
                job.resolved.template, job.tools):
            await asyncio.to_thread(generic_tools.prepare, job)  # may build a grammar: off the loop
        # a template runs on a worker thread (a slow one must not stall the loop); a raw prompt has none
        prompt = render_prompt(job) if job.raw and job.messages is None else await asyncio.to_thread(render_prompt, job)
        reasoning = reasoning_for(job.template or job.resolved.template, prompt)
        if job.think is True and reasoning is None and not is_harmony(job.template or job.resolved.template):
            raise InvalidRequest(f"{job.resolved.name} does not support thinking (its template has no "
                                 "<think> block); leave thinking unset or turn it off")
        return prompt, reasoning

    async def _fit_messages(self, job: Job, lease: Lease, prompt: str, reasoning, images: list[bytes] | None):
        """Ollama's chat truncation: a conversation whose prompt leaves the answer less than a quarter of
        the window (or its max_tokens, if fewer) loses its oldest turns, cut before a user message (a
        template may insist that turns alternate from a user one), the system messages among them kept;
        the fewest dropped that fit, found by bisection (each try one render and one tokenize). When even
        the last user turn on its own leaves too little room, that is what goes; a prompt over the window
        is then refused as ever. Images in dropped turns go with them; an image counts here as its marker's
        text (only the runner knows its tokens), so a kept one can still overflow: a 400 then, as ever.
        (job, prompt, reasoning, images)."""
        window = lease.num_ctx
        room = max(1, min(job.options.max_tokens or window, window // 4))
        target = window - room
        if len(prompt.encode()) + 2 <= target:  # no token stands for less than a byte (+ BOS / EOS)
            return job, prompt, reasoning, images
        msgs = job.messages

        per_token = lease.backend.info.max_token_bytes

        async def tokens(text: str) -> int:
            if per_token and len(text) > per_token * window:  # cannot fit: not worth tokenizing (_check_length)
                return window + 1
            return len(await lease.backend.tokenize(text, add_special=job.add_special))

        if await tokens(prompt) <= target:
            return job, prompt, reasoning, images
        cuts = [i for i, m in enumerate(msgs) if i > 0 and m["role"] == "user"]
        if not cuts:
            return job, prompt, reasoning, images

        async def cut_at(i: int):
            kept = [m for m in msgs[:i] if m["role"] == "system"] + msgs[i:]
            cut = replace(job, messages=kept)
            text, why = await self._render(cut)
            return cut, text, why

        lo, hi, best = 0, len(cuts) - 1, None
        while lo <= hi:  # the fewest turns dropped whose prompt fits (fewer dropped: never shorter)
            mid = (lo + hi) // 2
            found = await cut_at(cuts[mid])
            if await tokens(found[1]) <= target:
                best, hi = (cuts[mid], found), mid - 1
            else:
                lo = mid + 1
        i, (cut, text, why) = best if best is not None else (cuts[-1], await cut_at(cuts[-1]))
        dropped = [m for m in msgs[:i] if m["role"] != "system"]
        if images:  # each message holds the images of its markers, in order: the kept ones keep theirs
            kept, at = [], 0
            for j, m in enumerate(msgs):
                n = str(m.get("content") or "").count(MEDIA_MARKER)
                if j >= i or m["role"] == "system":
                    kept += images[at:at + n]
                at += n
            images = kept or None
            self._check_markers(text, images or [])
        log.info("%s: the chat's %d oldest of %d messages were dropped to fit num_ctx %d (%s)", job.resolved.name,
                 len(dropped), len(msgs), window, job.api)
        return cut, text, why, images

    async def _images(self, job: Job) -> list[bytes] | None:
        """The job's images as bytes, every bound checked (server/images.py), or None. A model
        without a vision projector is refused here, before anything is loaded or fetched."""
        if not job.images:
            return None
        if getattr(job.resolved, "projector", None) is None:
            raise InvalidRequest(f"{job.resolved.name} cannot take images: it has no vision projector. Send text "
                                 "only, or use a vision model (one pulled with its projector, or created with a "
                                 "second FROM naming its mmproj GGUF)")
        return await load_images(job.images, self.manager.settings)

    @staticmethod
    def _check_markers(prompt: str, images: list[bytes]) -> None:
        found = prompt.count(MEDIA_MARKER)
        if found != len(images):
            raise InvalidRequest(f"the rendered prompt holds {found} image place(s) for {len(images)} image(s): the "
                                 f"text {MEDIA_MARKER} is reserved for images, and the model's template must keep "
                                 "every message that carries one")

    async def _lease(self, job: Job, slot: bool = True) -> tuple[Lease, Callable[[], Awaitable[None]]]:
        cm = self.manager.use(job.resolved, num_ctx=job.num_ctx, keep_alive=job.keep_alive, slot=slot)
        lease = await cm.__aenter__()
        done = False

        async def release() -> None:
            nonlocal done
            if not done:
                done = True
                await cm.__aexit__(None, None, None)

        return lease, release

    @staticmethod
    def _check_capabilities(job: Job, lease: Lease) -> None:
        info = lease.backend.info
        o = job.options
        if o.constraints() and not info.supports_json_schema:
            raise InvalidRequest(f"{job.resolved.name} runs on the {info.name} backend, which cannot constrain "
                                 "output (JSON, a regex, choices, a grammar) yet; use LOCALRUN_BACKEND=llamacpp")
        if o.logprobs and not info.supports_logprobs:
            raise InvalidRequest(f"the {info.name} backend does not return logprobs")
        if (o.prompt_logprobs is not None or o.max_tokens == 0) and not info.supports_prompt_logprobs:
            raise InvalidRequest(f"{job.resolved.name} runs on the {info.name} backend, which does not score prompts "
                                 "(the prompt's logprobs, max_tokens 0); use LOCALRUN_BACKEND=llamacpp for them")
        if job.images and not info.supports_images:
            raise InvalidRequest(f"{job.resolved.name} runs on the {info.name} backend, which cannot take images yet; "
                                 "run it with LOCALRUN_BACKEND=llamacpp (or auto) to send it images")
        if job.infill is not None and not info.supports_infill:
            raise InvalidRequest(infill_refusal(job.resolved.name, info.name))
        if o.logit_bias and not info.supports_logit_bias:
            raise InvalidRequest(f"{job.resolved.name} runs on the {info.name} backend, which does not take "
                                 "logit_bias; use LOCALRUN_BACKEND=llamacpp for it")

    @staticmethod
    def _trim_infill(job: Job, lease: Lease) -> Infill:
        """The infill with texts no longer than the layout can use: the backend keeps the prefix's last
        3/4 x INFILL_BATCH tokens, the suffix's first 1/4 and as many tokens of the extra chunks as the
        window holds, and no token is longer than max_token_bytes, so characters beyond that (plus a
        margin for the tokens at the cut) cannot reach the model: a 30 MB file costs no 30 s tokenizing."""
        inf = job.infill
        per_token = lease.backend.info.max_token_bytes
        if inf is None or not per_token:
            return inf
        margin = 4096
        keep_pre = per_token * (3 * (INFILL_BATCH // 4)) + margin
        keep_suf = per_token * (INFILL_BATCH // 4) + margin
        room = per_token * lease.num_ctx + margin
        extra: list[dict] = []
        for chunk in reversed(inf.extra):  # the layout keeps the extra tokens nearest the prefix
            if room <= 0:
                break
            text = chunk.get("text") or ""
            text = text[-room:] if len(text) > room else text
            room -= len(text) + len(chunk.get("filename") or "")
            extra.append({**chunk, "text": text})
        extra.reverse()
        return Infill(prefix=inf.prefix[-keep_pre:] if len(inf.prefix) > keep_pre else inf.prefix,
                      suffix=inf.suffix[:keep_suf], extra=extra)

    @staticmethod
    def _check_length(prompt: str, lease: Lease) -> None:
        """Refuse a prompt that cannot fit the window before spending time tokenizing it: no
        token stands for more than max_token_bytes bytes (and a character is at least a byte)."""
        per_token = lease.backend.info.max_token_bytes
        if per_token and len(prompt) > per_token * lease.num_ctx:
            raise InvalidRequest(f"the prompt is {len(prompt)} characters: more than the context window of "
                                 f"{lease.num_ctx} tokens (num_ctx) can hold; shorten the prompt or ask for a larger "
                                 "num_ctx", code=CONTEXT_EXCEEDED)

    @staticmethod
    def _requests(job: Job, lease: Lease, prompt: str, ids: list[int] | None,
                  images: list[bytes] | None = None) -> list[GenerationRequest]:
        """The backend requests of `job`; `ids` None: the runner tokenizes and checks the window.
        Every choice carries the images (the same bytes objects)."""
        o = replace(job.options, stop=list(job.options.stop), stop_token_ids=list(job.options.stop_token_ids))
        if job.infill is not None:  # n separate requests, each laid out and window-checked by the backend
            infill = GenerationService._trim_infill(job, lease)
            return [GenerationRequest(prompt=prompt, options=replace(o, seed=o.seed + i) if (o.seed is not None and i)
                                      else o, request_id=uuid.uuid4().hex, window=lease.num_ctx, infill=infill)
                    for i in range(job.n)]
        if ids is not None:
            o.max_tokens = fit_window(len(ids), lease.num_ctx, o.max_tokens)
        out = []
        gid = uuid.uuid4().hex if job.n > 1 and lease.backend.info.supports_groups else None
        for i in range(job.n):
            oi = replace(o, seed=o.seed + i) if (o.seed is not None and i) else o
            if ids is None:
                oi = replace(oi, stop=list(oi.stop), stop_token_ids=list(oi.stop_token_ids))  # the runner caps each
                out.append(GenerationRequest(prompt=prompt, options=oi, request_id=uuid.uuid4().hex,
                                             add_special=job.add_special, window=lease.num_ctx, images=images,
                                             return_prompt_ids=job.prompt_ids, group=(gid, job.n, i) if gid else None,
                                             preserve=preserved_specials(job), cache_key=job.cache_key))
            else:
                out.append(GenerationRequest(prompt=prompt, options=oi, request_id=uuid.uuid4().hex,
                                             prompt_token_ids=ids, group=(gid, job.n, i) if gid else None,
                                             preserve=preserved_specials(job), cache_key=job.cache_key))
        return out


def infill_refusal(model: str, backend: str) -> str:
    return (f"{model} cannot fill in the middle (suffix / input_suffix) on the {backend} backend: its vocabulary "
            "has no fill-in-the-middle tokens, or its backend cannot lay them out (llama.cpp can); use a code model "
            "with FIM tokens such as Qwen2.5-Coder, or send the prompt without a suffix")


def _check_generates(job: Job) -> None:
    """An embedding model or a reranker generates nothing: refused before it is loaded, in Ollama's words
    ('"all-minilm" does not support chat') and with where to use it."""
    kind = model_kind(job.resolved)
    if kind == "completion":
        return
    what, where = KIND_USE[kind]
    raise InvalidRequest(f'"{job.resolved.name}" does not support {"chat" if job.messages is not None else "generate"}: '
                         f"it is {what}; use it with {where}")


def _renormalize(v: list[float]) -> list[float]:
    norm = sum(x * x for x in v) ** 0.5
    return [x / norm for x in v] if norm > 0 else v



__all__ = ["GenerationService", "RERANK_GROUP", "infill_refusal"]
