"""The llama.cpp backend (llama-cpp-python's low-level bindings): the load, and requests into the batched loop.

One llama.cpp context per loaded model, driven by one batched loop
(``localrun.backends.llamacpp.batch``): up to ``num_parallel`` requests decode together, each
with its own sampler chain and KV stream, and a prompt starts from the longest prefix any earlier
or running request left in the cache. A request's chunks reach its async generator through an
asyncio queue; closing the generator cancels the request, which ends at the next step (within a
token) and leaves its tokens cached.

Chat templates are never rendered here (the daemon renders them in the jinja2
sandbox, ``localrun.templates.chat``); this module only sees finished prompt strings.
``llama_cpp`` is imported lazily so ``localrun.backends`` imports on a GPU box without it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any, AsyncIterator

from localrun.backends.base import (
    BackendInfo,
    check_token_ids,
    Chunk,
    GenerationRequest,
    INLINE_TOKENIZE_CHARS,
    LoadSpec,
    fit_window,
    merge_chunks,
)
from localrun.backends.llamacpp.cpu import cpu_choices
from localrun.backends.llamacpp.fresh_threads import FreshThreadExecutor
from localrun.backends.llamacpp.images import Vision, mtmd_lib
from localrun.backends.llamacpp.infill import fim_tokens, infill_tokens
from localrun.backends.llamacpp.lora import load_lora
from localrun.backends.llamacpp.memory import (KV_TYPES, QUANTIZED_KV, estimate_memory, kv_cache_type, kv_type_for_model,
                                              spec_gguf_info)
from localrun.backends.llamacpp.pieces import PieceTokenizer, llama_tokenize, longest_piece, pieces_text
from localrun.backends.llamacpp.pooled import MAX_WINDOW as EMBED_WINDOW, Pooled, load_options
from localrun.backends.llamacpp.streaming import ShapedSink, stream_shaper
from localrun.errors import BackendError, InvalidRequest
from localrun.structured.bounds import check_schema_bounds
from localrun.structured.constraints import Matchers, constraint_lark, has_number_bounds, json_schema_lark
from localrun.structured.gbnf import json_schema_grammar

log = logging.getLogger("localrun.llamacpp")

# "any JSON object" grammar for JSON mode (format: "json", response_format json_object)
_JSON_OBJECT_SCHEMA: dict[str, Any] = {"type": "object"}
# prompt tokens one step of the batched loop computes at most (beside every running sequence's next
# token): a long prompt is prefilled in chunks of this, so the streams already running wait for one
# chunk, not the whole prompt
STEP_TOKENS = 512


class LlamaCppBackend:
    """A GGUF model in one batched llama.cpp context (:class:`~localrun.backends.llamacpp.batch.BatchedLlama`):
    up to ``spec.num_parallel`` sequences decode together, and a prompt starts from the longest
    prefix of it any earlier or running request left in the KV cache."""

    def __init__(self, spec: LoadSpec):
        import llama_cpp
        import llama_cpp.llama_cpp as lib
        from llama_cpp._logger import set_verbose

        from localrun.backends.llamacpp.batch import BatchedLlama
        from localrun.backends.llamacpp.cpu_share import ThreadGovernor

        set_verbose(log.isEnabledFor(logging.DEBUG))  # llama.cpp's own log: errors only, unless debugging
        self._llama_cpp, self._lib = llama_cpp, lib
        self.spec = spec
        self.n_threads, self.extra_bufts, self.extra_bufts_reason = cpu_choices(spec)
        self.n_gpu_layers = int(spec.extra.get("n_gpu_layers", 0))
        self.speculative = self._speculative_tokens()
        kv = kv_cache_type(spec)  # (a bad name is an InvalidRequest before anything loads)
        self.kv_type, self.kv_note = kv_type_for_model(kv, spec_gguf_info(spec) if kv in QUANTIZED_KV else None)
        parallel = max(1, spec.num_parallel)
        step_tokens = max(STEP_TOKENS, parallel * 2)
        mparams = lib.llama_model_default_params()
        mparams.n_gpu_layers = self.n_gpu_layers
        if not self.extra_bufts:
            mparams.use_extra_bufts = False
        opts = load_options(spec)  # (llama_model_params has load_mode, not use_mmap: a ctypes struct takes any name)
        if opts.get("use_mmap") is False:
            mparams.load_mode = lib.LLAMA_LOAD_MODE_NONE
        if "main_gpu" in opts:
            mparams.main_gpu = opts["main_gpu"]
        model = lib.llama_model_load_from_file(str(spec.weights).encode("utf-8"), mparams)
        if not model:
            raise BackendError(f"llama.cpp failed to load {spec.name} from {spec.weights} (see the runner's log)")
        # recurrent state cannot be cut back to a prefix: such models get no shared prefixes
        share = not (lib.llama_model_is_recurrent(model) or lib.llama_model_is_hybrid(model))
        cparams = lib.llama_context_default_params()
        cparams.n_ctx = spec.num_ctx * parallel
        cparams.n_seq_max = parallel
        # one KV stream of num_ctx cells per sequence (as llama-server lays it out), not one unified
        # cache: on a CPU, llama.cpp's attention reads every cell of a unified cache for every query,
        # so each sequence's step paid for all the others' cells (measured: 8 streams of SmolLM2-135M
        # decoded 13% slower, and 46% slower with 8k cells of cached prefixes beside them); a shared
        # prefix is a stream copy instead (a memcpy), and cached prefixes cost no step anything
        cparams.kv_unified = False
        cparams.swa_full = True  # a sliding-window layer keeps every cell, so any prefix can be reused
        cparams.n_batch = step_tokens + parallel * (1 + self.speculative)  # a prefill chunk + every decode row
        cparams.n_ubatch = min(512, cparams.n_batch)
        cparams.n_outputs_max_per_seq = 0
        cparams.n_threads = cparams.n_threads_batch = self.n_threads
        cparams.no_perf = True
        cparams.type_k = cparams.type_v = KV_TYPES[self.kv_type][0]
        ctx = lib.llama_init_from_model(model, cparams)
        if not ctx and self.kv_type in QUANTIZED_KV:
            # llama.cpp refuses a quantized V cache without flash attention (a device without it)
            self.kv_note = f"KV cache f16, not {self.kv_type}: llama.cpp could not make a {self.kv_type} cache here"
            log.warning("%s: %s (a quantized V cache needs flash attention); loading with f16", spec.name, self.kv_note)
            self.kv_type = "f16"
            cparams.type_k = cparams.type_v = KV_TYPES["f16"][0]
            ctx = lib.llama_init_from_model(model, cparams)
        if not ctx:
            lib.llama_model_free(model)
            raise BackendError(f"llama.cpp could not create a context of {cparams.n_ctx} tokens for {spec.name}; "
                               "use a smaller num_ctx or LOCALRUN_NUM_PARALLEL")
        self.vision: Vision | None = None  # the vision projector (LoadSpec.extra["projector"]), llama.cpp's mtmd
        adapter = None  # the LoRA adapter (LoadSpec.extra["adapter"]), applied to every sequence of the context
        try:
            if spec.extra.get("adapter"):
                adapter = load_lora(lib, model, ctx, str(spec.extra["adapter"]), spec.name)
            if spec.extra.get("projector"):
                self.vision = Vision(lib, str(spec.extra["projector"]), model, ctx, n_batch=int(cparams.n_batch),
                                     use_gpu=self.n_gpu_layers != 0, n_threads=self.n_threads, name=spec.name)
        except BaseException:
            lib.llama_free(ctx)
            lib.llama_model_free(model)  # (and the adapter with it)
            raise
        images = dict(encode=self.vision.encode, decode_image=self.vision.decode) if self.vision else {}
        # a thread count chosen here gives way to other processes' load (cpu_share); one the model's
        # Modelfile sets (num_thread) is kept as it is
        governor = None if spec.extra.get("n_threads") else ThreadGovernor(self.n_threads)
        disk = self._prompt_disk(lib, model, share)
        self.engine = BatchedLlama(lib, model, ctx, parallel=parallel, step_tokens=step_tokens, share_prefixes=share,
                                   name=spec.name, governor=governor,
                                   # cells copied one sequence at a time: KV in host memory, no sliding window
                                   # (Gemma 3's windowed cache restored that way answered otherwise)
                                   copy_cells=self.n_gpu_layers == 0 and lib.llama_model_n_swa(model) == 0,
                                   disk=disk, **images)
        self._vocab = self.engine.vocab
        self._n_vocab = self.engine.n_vocab
        self._matchers = Matchers(lib, self._vocab, self._n_vocab)
        self._pieces = None  # pieces.PieceTokenizer, set once the rest of the load is done
        self._n_layer = int(lib.llama_model_n_layer(model))
        # a second context for embeddings, made on the first request: mean pooling (a generating model's GGUF
        # sets no pooling; one that does is an embedding model, pooled.PooledBackend's)
        self._embedder = Pooled(spec, window=min(spec.num_ctx, EMBED_WINDOW), pooling=1, n_threads=self.n_threads,
                                n_gpu_layers=self.n_gpu_layers, extra_bufts=self.extra_bufts)
        # embeddings compute on a thread that exits after each request: a thread that lived on would keep an
        # OpenMP team that slows every step of the loop (fresh_threads.py)
        self._executor = FreshThreadExecutor(f"llamacpp-embed-{spec.name}")
        size = int(spec.extra.get("size_bytes") or 0) or estimate_memory(spec).total_bytes
        device = spec.extra.get("device", "CPU")
        how = (f"{self.n_threads} threads, {self.extra_bufts_reason}; one batched context: {parallel} parallel "
               f"sequences of {spec.num_ctx} KV cells each ({self.kv_type})" + (", cached prefixes" if share else "")
               + (", a LoRA adapter" if adapter else ""))
        self.info = BackendInfo(
            name="llama.cpp",
            device=device,
            processor=spec.extra.get("processor", "100% CPU"),
            reason=f"{spec.extra.get('reason') or 'llama.cpp on CPU'}; {how}",
            context_length=spec.num_ctx,
            slots=parallel,
            size_bytes=size,
            size_vram_bytes=int(spec.extra.get("size_vram", 0)),
            max_token_bytes=longest_piece(lib, self._vocab, self._n_vocab),
            supports_groups=True,
            supports_logit_bias=True, supports_prompt_logprobs=True,
            supports_images=self.vision is not None,
            supports_infill=fim_tokens(lib, self._vocab) is not None,
            placement=placement(device, self.n_gpu_layers, self._n_layer),
            fallbacks=[self.kv_note] if self.kv_note else [],
            kv_cache_type=self.kv_type,
            embed_window=min(spec.num_ctx, EMBED_WINDOW),
            bos_token=self._special_text(lib.llama_vocab_bos(self._vocab)),
            eos_token=self._special_text(lib.llama_vocab_eos(self._vocab)),
        )
        self._pieces = self._piece_tokenizer(model)

    @property
    def fatal(self) -> str | None:
        """Set when llama.cpp cannot go on (a compute error): the runner exits and the daemon reloads."""
        return self.engine.fatal

    def _prompt_disk(self, lib, model, share: bool):
        """The prompt cache on disk (prompt_disk.PromptDisk), keyed by what makes a saved sequence state this
        load's: llama.cpp's build and CPU features, the KV type, the layers offloaded, an adapter; None when off.
        Not for a model whose state cannot be cut back (recurrent) or one with a sliding window (Gemma 3's
        windowed cells, restored from a sequence state, answered otherwise: see Admission.copy_stream)."""
        if not share or lib.llama_model_n_swa(model) != 0 or self.spec.extra.get("projector"):
            return None
        import hashlib

        from localrun.backends.prompt_disk import open_for

        system = hashlib.blake2b(lib.llama_print_system_info() or b"", digest_size=8).hexdigest()
        return open_for(self.spec, {"backend": "llama.cpp", "build": f"{self._llama_cpp.__version__}/{system}",
                                    "kv": self.kv_type, "gpu_layers": self.n_gpu_layers,
                                    "extra_bufts": bool(self.extra_bufts), "adapter": self.spec.extra.get("adapter") or ""})

    def _speculative_tokens(self) -> int:
        """Draft tokens per step for LOCALRUN_SPECULATIVE / PARAMETER speculative ngram (prompt lookup;
        a draft model is the native engine's only); 0 when off."""
        from localrun.config import speculative_for_load

        try:
            mode, _, k = speculative_for_load(self.spec.extra)
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None
        if mode == "off":
            return 0
        if mode != "ngram":
            log.warning("speculative=%s: the llama.cpp backend supports only ngram (prompt lookup); %s runs "
                        "without speculation", mode, self.spec.name)
            return 0
        return int(k)

    # -- tokens ------------------------------------------------------------------------
    def _tokenize(self, text: str, add_special: bool = False, special: bool = True) -> list[int]:
        data = text.encode("utf-8")
        pieces = self._pieces
        if pieces is not None:  # the text's pieces llama.cpp tokenized before are not tokenized again
            return pieces.tokenize(data, add_special, special)
        return self._tokenize_raw(data, add_special, special)

    def _tokenize_raw(self, data: bytes, add_special: bool, special: bool) -> list[int]:
        return llama_tokenize(self._lib, self._vocab, data, add_special, special)

    def _piece_tokenizer(self, model):
        """pieces.PieceTokenizer for this vocabulary, or None (every text to llama.cpp whole)."""
        try:
            return PieceTokenizer.for_vocab(self._lib, model, self._vocab, self._tokenize_raw)
        except Exception:  # noqa: BLE001 - only a cache: without it llama.cpp tokenizes every text whole
            log.exception("%s: no piece cache for the tokenizer", self.spec.name)
            return None

    def _special_text(self, token: int) -> str:
        """A special token's text ("" for none: llama.cpp's LLAMA_TOKEN_NULL is -1)."""
        return self._detokenize([token]) if 0 <= token < self._n_vocab else ""

    def _detokenize(self, token_ids: list[int]) -> str:
        return pieces_text(self._lib, self._vocab, token_ids)

    @functools.lru_cache(maxsize=64)  # noqa: B019 - one backend per runner process
    def _preserved_ids(self, texts: tuple[str, ...]) -> frozenset:
        out = set()
        for t in texts:
            ids = self._tokenize(t, False, True) if len(t) <= 64 else []
            if len(ids) == 1:  # a single (special) token: keep its text in the output
                out.add(ids[0])
        return frozenset(out)

    def _preserved(self, texts: list[str] | None) -> frozenset:
        return self._preserved_ids(tuple(texts[:64])) if texts else frozenset()

    async def tokenize(self, text: str, add_special: bool = False) -> list[int]:
        # about 1 us a character: a short text costs less than the hop to a thread and back
        if len(text) <= INLINE_TOKENIZE_CHARS:
            return self._tokenize(text, add_special)
        return await asyncio.to_thread(self._tokenize, text, add_special)

    async def detokenize(self, token_ids: list[int]) -> str:
        check_token_ids(token_ids, self._n_vocab)
        if len(token_ids) > 4096:  # about a microsecond each: a long list off the event loop
            return await asyncio.to_thread(self._detokenize, token_ids)
        return self._detokenize(token_ids)

    # -- generation ----------------------------------------------------------------------
    async def generate(self, request: GenerationRequest) -> AsyncIterator[Chunk]:
        out: asyncio.Queue = asyncio.Queue()
        req, shape = await self._submit(request, loop=asyncio.get_running_loop(), queue=out)
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
                chunk = shape(item)
                if chunk is not None:
                    yield chunk
                req.delivered.set()
                if item.finish_reason is not None:
                    return
        finally:
            log.debug("generate %s closed by its consumer", request.request_id)
            if not req.finished:
                self.engine.cancel(req)
            req.delivered.set()

    async def generate_direct(self, request: GenerationRequest, sink: Any) -> None:
        """:meth:`generate` for a runner process: the loop's thread hands each chunk to
        ``sink.put(chunk)`` itself (then an exception, if the request fails), and ``sink.outbox.flush()``
        once a step, without waking the event loop for every token; ``sink.delivered`` (a
        threading.Event, set by whoever hands the first chunk on) ends the loop's first-token wait.
        Returns when the request has ended (``sink.done``, a future the outbox resolves); cancelled, it
        ends the request in the loop."""
        req, _ = await self._submit(request, sink=ShapedSink(sink))
        try:
            await sink.done
        finally:
            sink.closed = True
            if not req.finished:
                self.engine.cancel(req)

    async def _submit(self, request: GenerationRequest, *, loop: Any = None, queue: Any = None,
                      sink: ShapedSink | None = None):
        """Tokenize, check, make the sampler chain, and hand `request` to the loop, whose chunks go to
        `queue` on `loop` or to `sink`: (the loop's Request, the function that turns its raw chunks
        into this stream's)."""
        from localrun.backends.llamacpp.sampling import make_sampler, plain_greedy
        from localrun.backends.llamacpp.slots import Request

        o = request.options
        window = min(request.window or self.spec.num_ctx, self.spec.num_ctx)
        spans: list = []
        chunks = None  # the images' llama.cpp chunks: ours until the loop takes the request
        sampler = gsampler = None
        try:
            if request.images and o.prompt_logprobs is not None:
                raise InvalidRequest("prompt logprobs cannot be computed for a prompt with images")
            if request.images:  # llama.cpp's multimodal library tokenizes text and images together
                tokens, spans, chunks = await asyncio.to_thread(self._tokenize_images, request)
            elif request.infill is not None:
                # llama-server lays it out with its own n_predict (-1 unless started with -n), not the request's
                tokens = await asyncio.to_thread(infill_tokens, self._lib, self._vocab, self._tokenize, self.spec.name,
                                                 request.infill, request.prompt, window, None)
            elif request.prompt_token_ids is not None:  # the daemon's, or a client's (a prompt of token ids)
                tokens = list(request.prompt_token_ids)
                check_token_ids(tokens, self._n_vocab)
            else:
                tokens = await self.tokenize(request.prompt, request.add_special)
            if (request.images or request.infill is not None) and request.window is not None:
                o.max_tokens = fit_window(len(tokens), request.window, o.max_tokens)  # the runner left it to us
            if not tokens:
                raise InvalidRequest("the prompt is empty")
            if len(tokens) >= window:
                raise InvalidRequest(f"the prompt is {len(tokens)} tokens, longer than the context window of "
                                     f"{window} tokens")
            for t in o.logit_bias or {}:
                if not 0 <= int(t) < self._n_vocab:
                    raise InvalidRequest(f"logit_bias names token {t}, outside this model's vocabulary of "
                                         f"{self._n_vocab}")
            grammar = None
            matcher = None  # a request's own regex / choices / grammar: llguidance runs it (read off the event loop)
            if o.json_schema is not None and has_number_bounds(o.json_schema):
                # llama.cpp's converter keeps any value for a number's minimum / maximum: llguidance follows them
                check_schema_bounds(o.json_schema)
                schema = o.json_schema
                matcher = await asyncio.to_thread(lambda: self._matchers.matcher(json_schema_lark(schema)))
            elif o.json_schema is not None or o.json_mode:
                grammar = json_schema_grammar(o.json_schema if o.json_schema is not None else _JSON_OBJECT_SCHEMA)
            if o.own_constraint():
                matcher = await asyncio.to_thread(
                    lambda: self._matchers.matcher(constraint_lark(o.regex, o.choices, o.grammar)))
            banned = self.engine.chooser.eog_ids() if o.ban_eog else ()  # (llama-server's ignore_eos)
            args = (self._lib, self._vocab, self._n_vocab, o, window, grammar, banned)
            # llama.cpp parses the grammar as the sampler is made: a long one off the event loop
            sampler, gsampler = (make_sampler(*args) if len(grammar or "") < 4096
                                 else await asyncio.to_thread(make_sampler, *args))
            req = Request(prompt=tokens, options=o, sampler=sampler, grammar=gsampler, loop=loop, queue=queue,
                          window=window, speculative=self.speculative, rid=request.request_id, images=spans,
                          preserved=self._preserved(request.preserve), cache_key=request.cache_key,
                          matcher=matcher, argmax=plain_greedy(o, grammar) and matcher is None, sink=sink)
            shape = stream_shaper(request, req, tokens, self.engine.chooser.piece)
            if sink is not None:
                req.delivered = sink.delivered  # the daemon's 'delivered' ends the loop's first-token wait
                sink.shape = shape  # before the loop can emit anything
            if chunks is not None:
                req.on_end = functools.partial(mtmd_lib().mtmd_input_chunks_free, chunks)
            self.engine.submit(req)
            sampler = gsampler = chunks = None  # the loop frees them when the request leaves it
        finally:
            for s in (sampler, gsampler):
                if s is not None:
                    self._lib.llama_sampler_free(s)
            if chunks is not None:
                mtmd_lib().mtmd_input_chunks_free(chunks)
        return req, shape

    async def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    def _tokenize_images(self, request: GenerationRequest) -> tuple[list[int], list, Any]:
        """(tokens, image spans, mtmd chunks) of a prompt with MEDIA_MARKER where each image goes
        (images.Vision.tokenize). Runs off the event loop: decoding the images is real work."""
        if self.vision is None:
            raise InvalidRequest(f"{self.spec.name} has no vision projector: it cannot take images")
        return self.vision.tokenize(request)

    # -- embeddings ----------------------------------------------------------------------
    def _embed_sync(self, texts: list[str], truncate: bool = False, cancel: Any = None) -> list[list[float]]:
        return self._embedder.embed(texts, truncate, cancel)

    async def embed(self, texts: list[str], truncate: bool = False) -> list[list[float]]:
        from localrun.backends.llamacpp.pooled import cancellable

        return await cancellable(self._executor, self._embed_sync, texts, truncate)

    async def close(self) -> None:
        await asyncio.to_thread(self._close)

    def _close(self) -> None:
        ex = getattr(self, "_executor", None)
        if ex is not None:
            ex.shutdown(wait=True, cancel_futures=True)
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close()
        if getattr(self, "vision", None):
            self.vision.close()
            self.vision = None
        if getattr(self, "_embedder", None) is not None:
            self._embedder.close()


def placement(device: str, n_gpu_layers: int, n_layer: int) -> str:
    """Where a model's layers run, as `ps` shows it: "CUDA: 31/31 layers", "Metal", "CPU"
    (llama.cpp counts the output layer as one more)."""
    if device in ("CPU", "") or n_gpu_layers == 0:
        return "CPU"
    if device == "Metal":
        return "Metal"
    total = n_layer + 1
    on = total if n_gpu_layers < 0 else min(n_gpu_layers, total)
    return f"{device}: {on}/{total} layers"


def load(spec: LoadSpec):
    """The backend of a GGUF: an embedding model or a reranker (spec.embedding) gets only a pooling context
    (pooled.PooledBackend); a generating model the batched one (LlamaCppBackend)."""
    if spec.format != "gguf":
        raise BackendError(f"llama.cpp runs GGUF files only; {spec.name} is {spec.format} (use LOCALRUN_BACKEND=native)")
    if spec.embedding:
        from localrun.backends.llamacpp.pooled import PooledBackend

        n_threads, extra_bufts, bufts_reason = cpu_choices(spec)
        return PooledBackend(spec, spec_gguf_info(spec), n_threads=n_threads, extra_bufts=extra_bufts,
                             bufts_reason=bufts_reason)
    return LlamaCppBackend(spec)
