"""The llama.cpp backend (llama-cpp-python).

One ``Llama`` context per parallel slot (the weights are mmapped, so the slots share
them in memory; each slot owns its own KV cache and keeps its last prompt for prefix
reuse). Generation runs on a worker thread per request and feeds an asyncio queue;
closing the async generator sets a cancel flag the worker checks between tokens, so a
client that goes away stops the work within one token and frees the slot.

Chat templates are never rendered here (the daemon renders them in the jinja2
sandbox, ``localrun.chat_template``); this module only sees finished prompt strings.
``llama_cpp`` is imported lazily so ``localrun.backends`` imports on a GPU box without it.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import ctypes
import functools
import json
import logging
import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, AsyncIterator

from localrun.backends.base import (
    BackendInfo,
    Chunk,
    GenerationRequest,
    INLINE_TOKENIZE_CHARS,
    LoadSpec,
    MemoryEstimate,
    merge_chunks,
    TokenLogprob,
    Usage,
)
from localrun.errors import BackendError, InvalidRequest
from localrun.stop_strings import StopScanner

log = logging.getLogger("localrun.llamacpp")

# "any JSON object" grammar for JSON mode (format: "json", response_format json_object)
_JSON_OBJECT_SCHEMA: dict[str, Any] = {"type": "object"}
_EMBED_MAX_CTX = 2048


def physical_cores() -> int:
    """llama-cpp-python defaults to a poor thread count; use the physical cores."""
    try:
        import psutil

        n = psutil.cpu_count(logical=False)
    except Exception:  # pragma: no cover - psutil is a dependency
        n = None
    return max(1, n or os.cpu_count() or 1)


_AMX_FLAGS = ("amx_tile", "amx_int8", "amx_bf16")


def cpu_has_amx(cpuinfo: str | None = None) -> bool:
    """True when the CPU advertises Intel AMX (the amx_* flags in /proc/cpuinfo on Linux)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
                cpuinfo = f.read()
        except OSError:  # not Linux: no way to tell here; llama.cpp's default stays
            return False
    for line in cpuinfo.splitlines():
        if line.startswith("flags") and ":" in line:
            flags = set(line.split(":", 1)[1].split())
            return any(f in flags for f in _AMX_FLAGS)
    return False


def extra_buffers(setting: str, amx: bool | None = None) -> tuple[bool, str]:
    """Whether llama.cpp may use its extra buffer types (AMX and repacked CPU weights), and why.

    ``auto`` turns them off on CPUs with AMX: llama-cpp-python 0.3.36 built from source takes a
    general protection fault at ``ldtilecfg`` in ``ggml_backend_amx_mul_mat`` on the first token
    there (llama.cpp #20824, Ollama #17249)."""
    if setting == "on":
        return True, "extra buffer types on (LOCALRUN_LLAMACPP_EXTRA_BUFFERS=on)"
    if setting == "off":
        return False, "extra buffer types off (LOCALRUN_LLAMACPP_EXTRA_BUFFERS=off)"
    if cpu_has_amx() if amx is None else amx:
        return False, "extra buffer types off: this CPU has AMX, where llama.cpp's AMX path crashes"
    return True, "extra buffer types on"


@contextlib.contextmanager
def _model_params(**fields: Any):
    """Set llama_model_params fields that llama_cpp.Llama() does not expose (use_extra_bufts).

    Llama() builds its params from llama_model_default_params() and loads the model inside
    its constructor, so the defaults are adjusted for the duration of that call. A runner
    process loads one model at a time, so nothing else sees the change."""
    import llama_cpp.llama_cpp as lib

    original = lib.llama_model_default_params
    if not fields:
        yield
        return

    def patched():
        params = original()
        for k, v in fields.items():
            setattr(params, k, v)
        return params

    lib.llama_model_default_params = patched
    try:
        yield
    finally:
        lib.llama_model_default_params = original


def gpu_offload_supported() -> bool:
    """True when this llama.cpp build can put layers on a GPU (CUDA, Metal, ...)."""
    try:
        import llama_cpp

        return bool(llama_cpp.llama_supports_gpu_offload())
    except Exception:
        return False


def _gguf_info(spec: LoadSpec):
    info = spec.extra.get("gguf_info")
    if info is not None:
        return info
    try:
        from localrun.library import read_gguf_info

        return read_gguf_info(spec.weights)
    except ImportError:
        return None


def estimate_memory(spec: LoadSpec) -> MemoryEstimate:
    """Weights + f16 KV cache for num_ctx x slots + compute buffers, from the GGUF header."""
    info = _gguf_info(spec)
    weights = int(getattr(info, "tensor_bytes", 0) or 0) or Path(spec.weights).stat().st_size
    layers = int(getattr(info, "block_count", 0) or 0)
    hidden = int(getattr(info, "embedding_length", 0) or 0)
    heads = int(getattr(info, "head_count", 0) or 0)
    kv_heads = int(getattr(info, "head_count_kv", 0) or 0) or heads
    vocab = int(getattr(info, "vocab_size", 0) or 0)
    head_dim = hidden // heads if heads else 0
    slots = max(1, spec.num_parallel)
    # K and V, f16 (2 bytes), per layer per token per KV head
    kv = 2 * layers * spec.num_ctx * kv_heads * head_dim * 2 * slots
    if not kv:  # unknown header: assume a 4096-wide, 32-layer model
        kv = 2 * 32 * spec.num_ctx * 4096 * 2 * slots // 4
    # compute buffer (~ batch x hidden activations + logits) per slot, plus a fixed margin
    overhead = 64 * 2**20 + slots * (512 * max(hidden, 1) * 4 * 8 + vocab * 4 * 2)
    return MemoryEstimate(weights_bytes=weights, kv_bytes=kv, overhead_bytes=overhead)


def _token_piece(llama_cpp, vocab, token: int, special: bool = False) -> bytes:
    buf = ctypes.create_string_buffer(64)
    n = llama_cpp.llama_token_to_piece(vocab, token, buf, 64, 0, special)
    if n < 0:  # piece longer than the buffer
        buf = ctypes.create_string_buffer(-n)
        n = llama_cpp.llama_token_to_piece(vocab, token, buf, -n, 0, special)
    return buf.raw[: max(n, 0)]


def _common_prefix(llm, tokens: list[int]) -> int:
    n = 0
    for a, b in zip(llm._input_ids[: llm.n_tokens], tokens):
        if a != b:
            break
        n += 1
    return n


# Bounds on what a JSON schema may ask of llama.cpp's grammar: repetition counts are expanded into
# nested rules (minItems 1024 made sampling take ~1 s per token here; a huge one took gigabytes).
SCHEMA_MAX_COUNT = 256  # minItems, maxLength, ... above this are refused
SCHEMA_MAX_NODES = 5000  # objects and arrays in the schema
SCHEMA_MAX_DEPTH = 32
GRAMMAR_MAX_BYTES = 64 * 1024  # of GBNF text
_COUNT_KEYS = ("minItems", "maxItems", "minLength", "maxLength", "minProperties", "maxProperties",
               "minContains", "maxContains")


def check_schema_bounds(schema: Any) -> None:
    """InvalidRequest when the schema asks for more grammar than localrun builds (walked
    iteratively, so a deep schema cannot exhaust the stack)."""
    stack: list[tuple[Any, int]] = [(schema, 0)]
    nodes = 0
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            nodes += 1
            for k in _COUNT_KEYS:
                v = node.get(k)
                if isinstance(v, (int, float)) and not isinstance(v, bool) and v > SCHEMA_MAX_COUNT:
                    raise InvalidRequest(f"the JSON schema's '{k}' is {v:g}; localrun builds grammars for counts up "
                                         f"to {SCHEMA_MAX_COUNT}")
            children = list(node.values())
        elif isinstance(node, list):
            nodes += 1
            children = node
        else:
            continue
        if nodes > SCHEMA_MAX_NODES or depth > SCHEMA_MAX_DEPTH:
            raise InvalidRequest(f"the JSON schema is too large to build a grammar for (over {SCHEMA_MAX_NODES} "
                                 f"objects or {SCHEMA_MAX_DEPTH} levels deep)")
        stack.extend((c, depth + 1) for c in children)


def json_schema_grammar(schema: dict[str, Any]):
    """A llama.cpp grammar for a JSON schema, built once per schema (cached); InvalidRequest
    when it cannot be built or is over the bounds above."""
    return _grammar(json.dumps(schema, sort_keys=True, separators=(",", ":")))


@functools.lru_cache(maxsize=64)
def _grammar(schema_json: str):
    from llama_cpp.llama_grammar import LlamaGrammar, json_schema_to_gbnf

    check_schema_bounds(json.loads(schema_json))
    try:
        gbnf = json_schema_to_gbnf(schema_json)
    except Exception as exc:
        raise InvalidRequest(f"invalid JSON schema in response_format: {exc}") from None
    if len(gbnf) > GRAMMAR_MAX_BYTES:
        raise InvalidRequest(f"the JSON schema's grammar is {len(gbnf)} bytes, over the {GRAMMAR_MAX_BYTES} byte limit; "
                             "simplify the schema")
    try:
        return LlamaGrammar.from_string(gbnf, verbose=False)
    except Exception as exc:
        raise InvalidRequest(f"llama.cpp cannot use the JSON schema's grammar: {exc}") from None


class LlamaCppBackend:
    def __init__(self, spec: LoadSpec):
        import llama_cpp

        self._llama_cpp = llama_cpp
        self.spec = spec
        self.n_threads = int(spec.extra.get("n_threads") or physical_cores())
        self.n_gpu_layers = int(spec.extra.get("n_gpu_layers", 0))
        self.extra_bufts, self.extra_bufts_reason = extra_buffers(str(spec.extra.get("extra_buffers", "auto")))
        slots = max(1, spec.num_parallel)
        self._free: list = []  # idle contexts; a request takes the one sharing the longest prefix
        self._free_cv = threading.Condition()
        self._contexts = []
        try:
            for _ in range(slots):
                llm = self._new_llama(n_ctx=spec.num_ctx)
                self._contexts.append(llm)
                self._free.append(llm)
        except Exception as exc:
            self._close()
            raise BackendError(f"llama.cpp failed to load {spec.name}: {exc}") from None
        main = self._contexts[0]
        self._main = main
        self._vocab = main._model.vocab
        self._n_vocab = main.n_vocab()
        self._embedder = None
        self._embed_lock = threading.Lock()
        self._tok_lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers=slots + 1, thread_name_prefix=f"llamacpp-{spec.name}")
        size = int(spec.extra.get("size_bytes") or 0) or estimate_memory(spec).total_bytes
        device = spec.extra.get("device", "CPU")
        vram = int(spec.extra.get("size_vram", 0))
        self.info = BackendInfo(
            name="llama.cpp",
            device=device,
            processor=spec.extra.get("processor", "100% CPU"),
            reason=f"{spec.extra.get('reason') or 'llama.cpp on CPU'}; {self.n_threads} threads, {self.extra_bufts_reason}",
            context_length=spec.num_ctx,
            slots=slots,
            size_bytes=size,
            size_vram_bytes=vram,
            max_token_bytes=max((len(_token_piece(llama_cpp, self._vocab, t, special=True))
                                 for t in range(self._n_vocab)), default=0),
        )

    def _new_llama(self, n_ctx: int, embedding: bool = False):
        llama_cpp = self._llama_cpp
        kwargs: dict[str, Any] = dict(
            model_path=str(self.spec.weights),
            n_ctx=n_ctx,
            n_threads=self.n_threads,
            n_threads_batch=self.n_threads,
            n_gpu_layers=self.n_gpu_layers,
            last_n_tokens_size=int(self.spec.extra.get("repeat_last_n", 64)),
            verbose=False,
        )
        if not embedding:
            draft = self._draft()
            if draft is not None:
                kwargs["draft_model"] = draft
        if embedding:
            kwargs.update(embedding=True, n_batch=n_ctx, n_ubatch=n_ctx, pooling_type=llama_cpp.LLAMA_POOLING_TYPE_MEAN)
        with _model_params(**({} if self.extra_bufts else {"use_extra_bufts": False})):
            return llama_cpp.Llama(**kwargs)

    def _draft(self):
        """llama.cpp's prompt-lookup decoding for LOCALRUN_SPECULATIVE / PARAMETER speculative ngram
        (a draft model is the native engine's only)."""
        from localrun.config import speculative_for_load

        try:
            mode, _, k = speculative_for_load(self.spec.extra)
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None
        if mode == "off":
            return None
        if mode != "ngram":
            log.warning("speculative=%s: the llama.cpp backend supports only ngram (prompt lookup); %s runs "
                        "without speculation", mode, self.spec.name)
            return None
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        return LlamaPromptLookupDecoding(max_ngram_size=3, num_pred_tokens=k)

    # -- tokens ------------------------------------------------------------------------
    def _encode(self, text: str, add_special: bool) -> list[int]:  # the caller holds _tok_lock
        return self._main.tokenize(text.encode("utf-8"), add_bos=add_special, special=True)

    def _tokenize(self, text: str, add_special: bool = False) -> list[int]:
        with self._tok_lock:
            return self._encode(text, add_special)

    def _detokenize(self, token_ids: list[int]) -> str:
        return b"".join(_token_piece(self._llama_cpp, self._vocab, t) for t in token_ids).decode("utf-8", "replace")

    async def tokenize(self, text: str, add_special: bool = False) -> list[int]:
        # about 1 us a character: a short text costs less than the hop to a thread and back
        if len(text) <= INLINE_TOKENIZE_CHARS and self._tok_lock.acquire(blocking=False):
            try:
                return self._encode(text, add_special)
            finally:
                self._tok_lock.release()
        return await asyncio.to_thread(self._tokenize, text, add_special)

    async def detokenize(self, token_ids: list[int]) -> str:
        return self._detokenize(token_ids)

    # -- generation ----------------------------------------------------------------------
    async def generate(self, request: GenerationRequest) -> AsyncIterator[Chunk]:
        loop = asyncio.get_running_loop()
        out: asyncio.Queue = asyncio.Queue()
        cancel = threading.Event()
        delivered = threading.Event()  # set once the consumer took the first chunk

        def emit(item) -> None:
            loop.call_soon_threadsafe(out.put_nowait, item)

        self._executor.submit(self._worker, request, emit, cancel, delivered)
        try:
            while True:
                item = await out.get()
                # a slow consumer gets what piled up as one chunk (fewer events, same tokens)
                while not out.empty() and not isinstance(item, BaseException) and item.finish_reason is None:
                    nxt = out.get_nowait()
                    if isinstance(nxt, BaseException):
                        item = nxt
                        break
                    item = merge_chunks(item, nxt)
                if isinstance(item, BaseException):
                    raise item
                yield item
                delivered.set()
                if item.finish_reason is not None:
                    return
        finally:
            log.debug("generate %s closed by its consumer", request.request_id)
            cancel.set()
            delivered.set()

    def _take_slot(self, tokens: list[int]):
        """Block until a context is free; prefer the one whose KV already holds the longest
        prefix of `tokens` (its cached prompt is reused)."""
        with self._free_cv:
            while not self._free:
                self._free_cv.wait()
            best = max(self._free, key=lambda llm: _common_prefix(llm, tokens))
            self._free.remove(best)
            return best

    def _give_slot(self, llm) -> None:
        with self._free_cv:
            self._free.append(llm)
            self._free_cv.notify()

    def _worker(self, request: GenerationRequest, emit, cancel: threading.Event, delivered: threading.Event) -> None:
        try:
            tokens = list(request.prompt_token_ids or self._tokenize(request.prompt, request.add_special))
        except Exception as exc:
            emit(BackendError(f"llama.cpp could not tokenize the prompt: {exc}"))
            return
        llm = self._take_slot(tokens)
        try:
            self._generate(llm, tokens, request, emit, cancel, delivered)
        except Exception as exc:
            if not isinstance(exc, (InvalidRequest, BackendError)):
                log.exception("generation failed")
                exc = BackendError(f"llama.cpp: {exc}")
            emit(exc)
        finally:
            self._give_slot(llm)

    def _generate(self, llm, tokens: list[int], request: GenerationRequest, emit, cancel: threading.Event,
                  delivered: threading.Event) -> None:
        import numpy as np

        llama_cpp = self._llama_cpp
        o = request.options
        t0 = time.perf_counter()
        n_ctx = llm.n_ctx()
        if not tokens:
            raise InvalidRequest("the prompt is empty")
        if len(tokens) >= n_ctx:
            raise InvalidRequest(f"the prompt is {len(tokens)} tokens, longer than the context window of {n_ctx} tokens")
        # Reuse the slot's cached prefix, but re-evaluate at least the prompt's last two tokens:
        # llama.cpp computes a lone token (a batch of one) with other kernels than a longer batch,
        # so a fully cached prompt re-evaluated from its last token alone got different logits, and
        # greedy answers that depended on what the slot had run before. Batches of two or more
        # agree with a fresh evaluation exactly. llama-cpp-python reuses what n_tokens leaves it.
        cached = max(0, min(_common_prefix(llm, tokens), len(tokens) - 2))
        llm.n_tokens = min(llm.n_tokens, cached)
        grammar = None
        if o.json_schema is not None or o.json_mode:
            grammar = json_schema_grammar(o.json_schema if o.json_schema is not None else _JSON_OBJECT_SCHEMA)
        llm.set_seed(o.seed if o.seed is not None else random.getrandbits(31))
        gen = llm.generate(
            tokens,
            top_k=o.top_k,
            top_p=o.top_p,
            min_p=o.min_p,
            typical_p=1.0,
            temp=o.temperature,
            repeat_penalty=o.repeat_penalty,
            frequency_penalty=o.frequency_penalty,
            presence_penalty=o.presence_penalty,
            grammar=grammar,
        )
        limit = n_ctx - len(tokens)
        if o.max_tokens is not None:
            limit = min(limit, o.max_tokens)
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        stops = StopScanner(o.stop)
        stop_ids = set(o.stop_token_ids)
        n_out = 0
        t_first = None
        finish = "length"
        tail = ""
        try:
            for token in gen:
                if cancel.is_set():
                    finish = "abort"
                    break
                if t_first is None:
                    t_first = time.perf_counter()
                if not o.ignore_eos and (llama_cpp.llama_vocab_is_eog(self._vocab, token) or token in stop_ids):
                    finish = "stop"
                    tail = decoder.decode(b"", final=True) + stops.flush()
                    break
                n_out += 1
                lp = self._logprob(llm, token, o.top_logprobs, np) if o.logprobs else None
                text, hit = stops.feed(decoder.decode(_token_piece(llama_cpp, self._vocab, token)))
                if hit:
                    finish = "stop"
                    if text:
                        emit(Chunk(text=text, token_ids=[token], logprobs=[lp] if lp else None))
                    break
                if n_out >= limit:
                    text += decoder.decode(b"", final=True) + stops.flush()
                    emit(Chunk(text=text, token_ids=[token], logprobs=[lp] if lp else None))
                    break
                if text or lp:
                    emit(Chunk(text=text, token_ids=[token], logprobs=[lp] if lp else None))
                    if not delivered.is_set():
                        # time to first token: let the server send the first chunk before the next
                        # decode takes the CPU (bounded, so a stalled consumer cannot stall us)
                        delivered.wait(0.05)
        finally:
            gen.close()
        log.debug("generation %s ended: %s after %d tokens", request.request_id, finish, n_out)
        t_end = time.perf_counter()
        t_first = t_first or t_end
        emit(
            Chunk(
                text=tail,
                finish_reason=finish,
                stop_sequence=stops.matched,
                usage=Usage(
                    prompt_tokens=len(tokens),
                    completion_tokens=n_out,
                    cached_tokens=cached,
                    prompt_eval_seconds=t_first - t0,
                    eval_seconds=t_end - t_first,
                ),
            )
        )

    def _logprob(self, llm, token: int, top_n: int, np) -> TokenLogprob:
        """Log-probabilities of the raw model distribution the token was sampled from."""
        ptr = llm._ctx.get_logits_ith(-1)
        logits = np.ctypeslib.as_array(ptr, shape=(self._n_vocab,)).astype(np.float64)
        m = logits.max()
        lse = m + np.log(np.exp(logits - m).sum())
        top: list[tuple[str, float]] = []
        if top_n > 0:
            idx = np.argpartition(-logits, top_n)[:top_n]
            idx = idx[np.argsort(-logits[idx])]
            top = [(self._detokenize([int(i)]), float(logits[i] - lse)) for i in idx]
        return TokenLogprob(token=self._detokenize([token]), logprob=float(logits[token] - lse), top=top)

    # -- embeddings ----------------------------------------------------------------------
    def _embed_sync(self, texts: list[str]) -> list[list[float]]:
        with self._embed_lock:
            if self._embedder is None:
                self._embedder = self._new_llama(n_ctx=min(self.spec.num_ctx, _EMBED_MAX_CTX), embedding=True)
            emb = self._embedder
            limit = emb.n_batch
            for t in texts:
                n = len(emb.tokenize(t.encode("utf-8"), add_bos=True))
                if n > limit:
                    raise InvalidRequest(f"an input is {n} tokens, longer than the embedding window of {limit} tokens")
            return [list(map(float, v)) for v in emb.embed(texts, normalize=True)]

    async def embed(self, texts: list[str]) -> list[list[float]]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._embed_sync, texts)

    async def close(self) -> None:
        await asyncio.to_thread(self._close)

    def _close(self) -> None:
        ex = getattr(self, "_executor", None)
        if ex is not None:
            ex.shutdown(wait=True, cancel_futures=True)
        for llm in [*getattr(self, "_contexts", []), getattr(self, "_embedder", None)]:
            if llm is not None:
                try:
                    llm.close()
                except Exception:  # pragma: no cover
                    pass
        self._contexts = []
        self._embedder = None


def load(spec: LoadSpec) -> LlamaCppBackend:
    if spec.format != "gguf":
        raise BackendError(f"llama.cpp runs GGUF files only; {spec.name} is {spec.format} (use LOCALRUN_BACKEND=native)")
    return LlamaCppBackend(spec)
