"""The llama.cpp backend (llama-cpp-python's low-level bindings).

One llama.cpp context per loaded model, driven by one batched loop
(``localrun.backends.llama_batch``): up to ``num_parallel`` requests decode together, each
with its own sampler chain and KV stream, and a prompt starts from the longest prefix any earlier
or running request left in the cache. A request's chunks reach its async generator through an
asyncio queue; closing the generator cancels the request, which ends at the next step (within a
token) and leaves its tokens cached.

Chat templates are never rendered here (the daemon renders them in the jinja2
sandbox, ``localrun.chat_template``); this module only sees finished prompt strings.
``llama_cpp`` is imported lazily so ``localrun.backends`` imports on a GPU box without it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
from pathlib import Path
from typing import Any, AsyncIterator

from localrun.backends.base import (
    BackendInfo,
    check_token_ids,
    Chunk,
    GenerationRequest,
    INFILL_BATCH,
    INLINE_TOKENIZE_CHARS,
    Infill,
    LoadSpec,
    MEDIA_MARKER,
    MemoryEstimate,
    fit_window,
    merge_chunks,
)
from localrun.backends.amx import cpu_has_amx, deny_amx
from localrun.backends.fresh_threads import FreshThreadExecutor
from localrun.backends.llama_batch import load_lora, longest_piece, pieces_text, prompt_logprobs_rows
from localrun.backends.llama_pieces import PieceTokenizer, llama_tokenize
from localrun.backends.llama_pooled import (MAX_WINDOW as EMBED_WINDOW, Pooled, backend_pooling, is_causal, load_options,
                                           pooled_ubatch, pooled_window)
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


def physical_cores() -> int:
    """llama-cpp-python defaults to a poor thread count; use the physical cores."""
    try:
        import psutil

        n = psutil.cpu_count(logical=False)
    except Exception:  # pragma: no cover - psutil is a dependency
        n = None
    return max(1, n or os.cpu_count() or 1)


def extra_buffers(setting: str, amx: bool | None = None, deny=deny_amx) -> tuple[bool, str]:
    """Whether llama.cpp may use its extra buffer types (AMX and repacked CPU weights), and why.

    ``auto`` keeps them on CPUs with AMX too, with AMX itself denied to llama.cpp (`deny`, see
    localrun.backends.amx: llama-cpp-python 0.3.36's AMX path crashes on the first token there,
    llama.cpp #20824, Ollama #17249), so the repacked weights stay; where that denial cannot be put in
    place, they go off. ``on`` leaves llama.cpp every type it finds, AMX included."""
    if setting == "on":
        return True, "extra buffer types on (LOCALRUN_LLAMACPP_EXTRA_BUFFERS=on)"
    if setting == "off":
        return False, "extra buffer types off (LOCALRUN_LLAMACPP_EXTRA_BUFFERS=off)"
    if cpu_has_amx() if amx is None else amx:
        if deny():
            return True, "extra buffer types on, AMX denied to llama.cpp (its AMX path crashes on this CPU)"
        return False, "extra buffer types off: this CPU has AMX, where llama.cpp's AMX path crashes"
    return True, "extra buffer types on"


def cpu_choices(spec: LoadSpec) -> tuple[int, bool, str]:
    """(compute threads: the spec's n_threads, else the physical cores; whether llama.cpp's extra buffer types are
    on, and why) for a load of `spec`."""
    bufts, why = extra_buffers(str(spec.extra.get("extra_buffers", "auto")))
    return int(spec.extra.get("n_threads") or physical_cores()), bufts, why


def spec_gguf_info(spec: LoadSpec):
    """The GGUF header of the spec's weights: the daemon's parsed one when it came along, else read here (None
    without the library's reader)."""
    info = spec.extra.get("gguf_info")
    if info is not None:
        return info
    try:
        from localrun.library import read_gguf_info

        return read_gguf_info(spec.weights)
    except ImportError:
        return None


# LOCALRUN_KV_CACHE_TYPE's names (config.KV_CACHE_TYPES) as llama.cpp's cache types; fp8 has no
# llama.cpp type, q8_0 is its 8-bit one
_KV_TYPE_NAMES = {"auto": "f16", "fp16": "f16", "bf16": "bf16", "fp32": "f32", "int8": "q8_0", "fp8": "q8_0",
                  "q4_0": "q4_0"}
# llama.cpp cache type -> (ggml_type, bytes per element); q8_0 and q4_0 are blocks of 32 elements
# (34 and 18 bytes), so a quantized cache needs head sizes that 32 divides
KV_TYPES = {"f16": (1, 2.0), "bf16": (30, 2.0), "f32": (0, 4.0), "q8_0": (8, 34 / 32), "q4_0": (2, 18 / 32)}
KV_BLOCK = 32
QUANTIZED_KV = ("q8_0", "q4_0")


def kv_cache_type(spec: LoadSpec) -> str:
    """llama.cpp's KV cache type for a load: PARAMETER kv_cache_type, else LOCALRUN_KV_CACHE_TYPE."""
    from localrun.config import parse_kv_cache_type, settings

    raw = spec.extra.get("kv_cache_type")
    try:
        name = parse_kv_cache_type(str(raw)) if raw is not None else settings().kv_cache_type
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None
    return _KV_TYPE_NAMES[name]


def _head_sizes(info) -> tuple[int, int]:
    """(K, V) head sizes from the GGUF header: attention.key_length / value_length, else width / heads."""
    hidden = int(getattr(info, "embedding_length", 0) or 0)
    heads = int(getattr(info, "head_count", 0) or 0)
    meta = getattr(info, "metadata", None) or {}
    arch = getattr(info, "architecture", "")
    default = hidden // heads if heads else 0

    def size(key: str) -> int:
        v = meta.get(f"{arch}.attention.{key}")
        return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else default

    return size("key_length"), size("value_length")


def kv_type_for_model(kv_type: str, info) -> tuple[str, str]:
    """The cache type a load gets, and why when that is not the one asked for: a quantized cache is
    made of 32-element blocks, so a model whose head size 32 does not divide keeps f16 (llama.cpp
    would refuse the context)."""
    if kv_type not in QUANTIZED_KV:
        return kv_type, ""
    k, v = _head_sizes(info)
    odd = [x for x in (k, v) if x and x % KV_BLOCK]
    if odd:
        return "f16", (f"KV cache f16, not {kv_type}: the model's head size {odd[0]} is not a multiple of "
                       f"{KV_BLOCK}, {kv_type}'s block")
    return kv_type, ""


def estimate_memory(spec: LoadSpec) -> MemoryEstimate:
    """Weights + the KV cache (LOCALRUN_KV_CACHE_TYPE) for num_ctx x slots + compute buffers, from the GGUF header."""
    info = spec_gguf_info(spec)
    weights = int(getattr(info, "tensor_bytes", 0) or 0) or Path(spec.weights).stat().st_size
    if spec.extra.get("adapter"):  # a LoRA adapter's tensors sit beside the model's
        weights += Path(spec.extra["adapter"]).stat().st_size
    layers = int(getattr(info, "block_count", 0) or 0)
    hidden = int(getattr(info, "embedding_length", 0) or 0)
    heads = int(getattr(info, "head_count", 0) or 0)
    kv_heads = int(getattr(info, "head_count_kv", 0) or 0) or heads
    vocab = int(getattr(info, "vocab_size", 0) or 0)
    k_dim, v_dim = _head_sizes(info)
    kv_type, _ = kv_type_for_model(kv_cache_type(spec), info)
    per_element = KV_TYPES[kv_type][1]
    slots = max(1, spec.num_parallel)
    if spec.embedding:  # one pooling context of its window (llama_pooled), no decoding streams
        return _pooled_estimate(info, weights, layers, hidden, kv_heads, k_dim + v_dim, pooled_window(spec, info))
    # K and V per layer per token per KV head
    kv = int(layers * spec.num_ctx * kv_heads * (k_dim + v_dim) * per_element * slots)
    if not kv:  # unknown header: assume a 4096-wide, 32-layer model
        kv = int(2 * 32 * spec.num_ctx * 4096 * per_element * slots // 4)
    # compute buffer (~ batch x hidden activations + logits) per slot, plus a fixed margin, plus the
    # output rows a scored prompt (echo + logprobs) fills in one step
    overhead = (64 * 2**20 + slots * (512 * max(hidden, 1) * 4 * 8 + vocab * 4 * 2)
                + prompt_logprobs_rows(vocab) * vocab * 4)
    return MemoryEstimate(weights_bytes=weights, kv_bytes=kv, overhead_bytes=overhead,
                          kv_type=kv_type if kv_type != "f16" else "")


def _pooled_estimate(info, weights: int, layers: int, hidden: int, kv_heads: int, kv_dims: int,
                     window: int) -> MemoryEstimate:
    """An embedding model's or a reranker's memory: weights, a KV cache of one window when the model is causal
    (an encoder keeps none: llama.cpp makes it no memory), and the compute buffer of one pass (an encoder's is the
    whole window): activations, and the attention scores of every head should flash attention be unavailable."""
    causal = is_causal(info)
    heads = int(getattr(info, "head_count", 0) or 0) or 1
    kv = layers * window * kv_heads * kv_dims * 2 if causal else 0
    ubatch = pooled_ubatch(window, backend_pooling(info), causal)
    overhead = 32 * 2**20 + ubatch * max(hidden, 1) * 4 * 8 + ubatch * window * heads * 4
    return MemoryEstimate(weights_bytes=weights, kv_bytes=int(kv), overhead_bytes=int(overhead))


def cut_inside_char(tail: bytes) -> bool:
    """Whether bytes ending in ``tail`` (their last 4) end inside a UTF-8 character: llama-server's
    validate_utf8 (tools/server), which holds a stream's text back while this is so."""
    for i in range(1, min(4, len(tail)) + 1):
        c = tail[-i]
        if (c & 0xE0 == 0xC0 and i < 2) or (c & 0xF0 == 0xE0 and i < 3) or (c & 0xF8 == 0xF0 and i < 4):
            return True
    return False


class _ShapedSink:
    """A direct stream's sink as the loop sees it: raw chunks go through the stream's ``shape``
    (the held partial characters) on their way to the runner's sink. The loop's thread only."""

    def __init__(self, sink: Any) -> None:
        self.sink, self.outbox, self.delivered = sink, sink.outbox, sink.delivered
        self.shape: Any = None  # set by _submit before the request reaches the loop

    def put(self, item: Any) -> None:
        if isinstance(item, BaseException):
            self.sink.put(item)
            return
        chunk = self.shape(item)
        if chunk is not None:
            self.sink.put(chunk)
        else:  # held (it ends inside a character): nothing for the consumer to take yet
            self.delivered.set()


class LlamaCppBackend:
    """A GGUF model in one batched llama.cpp context (:class:`~localrun.backends.llama_batch.BatchedLlama`):
    up to ``spec.num_parallel`` sequences decode together, and a prompt starts from the longest
    prefix of it any earlier or running request left in the KV cache."""

    def __init__(self, spec: LoadSpec):
        import llama_cpp
        import llama_cpp.llama_cpp as lib
        from llama_cpp._logger import set_verbose

        from localrun.backends.cpu_share import ThreadGovernor
        from localrun.backends.llama_batch import BatchedLlama

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
        self._mtmd = None  # llama.cpp's multimodal context: the vision projector (LoadSpec.extra["projector"])
        adapter = None  # the LoRA adapter (LoadSpec.extra["adapter"]), applied to every sequence of the context
        try:
            if spec.extra.get("adapter"):
                adapter = load_lora(lib, model, ctx, str(spec.extra["adapter"]), spec.name)
            if spec.extra.get("projector"):
                self._mtmd = self._load_projector(str(spec.extra["projector"]), model)
        except BaseException:
            lib.llama_free(ctx)
            lib.llama_model_free(model)  # (and the adapter with it)
            raise
        images = dict(encode=self._encode_image, decode_image=self._decode_image) if self._mtmd else {}
        self._n_batch = int(cparams.n_batch)
        # a thread count chosen here gives way to other processes' load (cpu_share); one the model's
        # Modelfile sets (num_thread) is kept as it is
        governor = None if spec.extra.get("n_threads") else ThreadGovernor(self.n_threads)
        self.engine = BatchedLlama(lib, model, ctx, parallel=parallel, step_tokens=step_tokens, share_prefixes=share,
                                   name=spec.name, governor=governor,
                                   # cells copied one sequence at a time: KV in host memory, no sliding window
                                   # (Gemma 3's windowed cache restored that way answered otherwise)
                                   copy_cells=self.n_gpu_layers == 0 and lib.llama_model_n_swa(model) == 0, **images)
        self._vocab = self.engine.vocab
        self._n_vocab = self.engine.n_vocab
        self._matchers = Matchers(lib, self._vocab, self._n_vocab)
        self._pieces = None  # llama_pieces.PieceTokenizer, set once the rest of the load is done
        self._n_layer = int(lib.llama_model_n_layer(model))
        # a second context for embeddings, made on the first request: mean pooling (a generating model's GGUF
        # sets no pooling; one that does is an embedding model, llama_pooled.PooledBackend's)
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
            supports_images=self._mtmd is not None,
            supports_infill=self._fim_tokens() is not None,
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
        """llama_pieces.PieceTokenizer for this vocabulary, or None (every text to llama.cpp whole)."""
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
        req, _ = await self._submit(request, sink=_ShapedSink(sink))
        try:
            await sink.done
        finally:
            sink.closed = True
            if not req.finished:
                self.engine.cancel(req)

    async def _submit(self, request: GenerationRequest, *, loop: Any = None, queue: Any = None,
                      sink: _ShapedSink | None = None):
        """Tokenize, check, make the sampler chain, and hand `request` to the loop, whose chunks go to
        `queue` on `loop` or to `sink`: (the loop's Request, the function that turns its raw chunks
        into this stream's)."""
        from localrun.backends.llama_batch import Request, make_sampler, plain_greedy

        o = request.options
        window = min(request.window or self.spec.num_ctx, self.spec.num_ctx)
        spans: list = []
        chunks = None  # the images' llama.cpp chunks: ours until the loop takes the request
        sampler = gsampler = None
        # the prompt's length (image tokens, the infill layout) goes on the first chunk
        first = bool(request.images) or request.infill is not None
        opened = False  # the first chunk is out (it says how much of the prompt the cache gave)
        tail, loose, held = b"", b"", None  # last bytes; bytes since the last whole character; held chunks
        piece = self.engine.piece

        def shape(item: Chunk) -> Chunk | None:
            """As llama-server streams: no text while the output's bytes end inside a character
            (None: held, it goes out with the next chunk)."""
            nonlocal first, opened, tail, loose, held
            if not opened:
                item.cached_tokens, opened = req.n_cached, True  # (req: made below, before any chunk comes)
            if first:
                item.prompt_tokens, first = len(tokens), False
                if request.infill is not None:  # the layout only this backend knows (Ollama's `context`)
                    item.prompt_token_ids = list(tokens)
            for t in item.token_ids:
                p = piece(t)
                tail, loose = (tail + p)[-4:], loose + p
                if not cut_inside_char(tail):
                    loose = b""
            if held is not None:
                item = merge_chunks(held, item)
                held = None
            if loose:
                if item.finish_reason is None:
                    held = item
                    return None
                cut = loose.decode("utf-8", "replace")
                item.cut_chars = len(cut) if item.text.endswith(cut) else 0  # (not when a stop string cut it)
            return item

        try:
            if request.images and o.prompt_logprobs is not None:
                raise InvalidRequest("prompt logprobs cannot be computed for a prompt with images")
            if request.images:  # llama.cpp's multimodal library tokenizes text and images together
                tokens, spans, chunks = await asyncio.to_thread(self._tokenize_images, request)
            elif request.infill is not None:
                # llama-server lays it out with its own n_predict (-1 unless started with -n), not the request's
                tokens = await asyncio.to_thread(self.infill_tokens, request.infill, request.prompt, window, None)
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
            banned = self.engine.eog_ids() if o.ban_eog else ()  # (llama-server's ignore_eos)
            args = (self._lib, self._vocab, self._n_vocab, o, window, grammar, banned)
            # llama.cpp parses the grammar as the sampler is made: a long one off the event loop
            sampler, gsampler = (make_sampler(*args) if len(grammar or "") < 4096
                                 else await asyncio.to_thread(make_sampler, *args))
            req = Request(prompt=tokens, options=o, sampler=sampler, grammar=gsampler, loop=loop, queue=queue,
                          window=window, speculative=self.speculative, rid=request.request_id, images=spans,
                          preserved=self._preserved(request.preserve), cache_key=request.cache_key,
                          matcher=matcher, argmax=plain_greedy(o, grammar) and matcher is None, sink=sink)
            if sink is not None:
                req.delivered = sink.delivered  # the daemon's 'delivered' ends the loop's first-token wait
                sink.shape = shape  # before the loop can emit anything
            if chunks is not None:
                req.on_end = functools.partial(self._mtmd_lib().mtmd_input_chunks_free, chunks)
            self.engine.submit(req)
            sampler = gsampler = chunks = None  # the loop frees them when the request leaves it
        finally:
            for s in (sampler, gsampler):
                if s is not None:
                    self._lib.llama_sampler_free(s)
            if chunks is not None:
                self._mtmd_lib().mtmd_input_chunks_free(chunks)
        return req, shape

    async def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    # -- fill in the middle -------------------------------------------------------------------------
    def _fim_tokens(self) -> dict[str, int] | None:
        """The vocabulary's FIM tokens (llama.cpp finds them by id in the GGUF or by their text); None
        when prefix, suffix or middle is missing."""
        lib, v = self._lib, self._vocab
        ids = {k: int(getattr(lib, f"llama_vocab_fim_{k}")(v)) for k in ("pre", "suf", "mid", "rep", "sep")}
        return ids if min(ids["pre"], ids["suf"], ids["mid"]) >= 0 else None

    def infill_tokens(self, infill: Infill, prompt: str, n_ctx: int, n_predict: int | None) -> list[int]:
        """The prompt llama-server's /infill builds (format_prompt_infill in tools/server): the repo-level
        pattern [FIM_REP]myproject [FIM_SEP]file chunk ... [FIM_SEP]filename [FIM_PRE]prefix prompt
        [FIM_SUF]suffix [FIM_MID], the prefix's tail and the suffix's head cut to fit a batch (3:1), the
        extra chunks to fit the context; prefix/suffix/extra texts are not parsed for special tokens."""
        fim = self._fim_tokens()
        if fim is None:
            raise InvalidRequest(f"{self.spec.name} cannot fill in the middle: its vocabulary has no "
                                 "fill-in-the-middle tokens (use a code model such as Qwen2.5-Coder or CodeLlama)")
        lib, v = self._lib, self._vocab

        def tok(text: str) -> list[int]:
            return self._tokenize(text, False, special=False)

        extra: list[int] = []
        if fim["rep"] >= 0:
            extra += [fim["rep"], *tok("myproject\n")]
        for chunk in infill.extra:
            if fim["sep"] >= 0:
                extra += [fim["sep"], *tok(str(chunk.get("filename") or "tmp") + "\n")]
            else:
                extra += tok("\n\n--- snippet ---\n\n")
            extra += tok(str(chunk.get("text") or ""))
        if fim["sep"] >= 0:
            extra += [fim["sep"], *tok("filename\n")]
        prefix, suffix = tok(infill.prefix), tok(infill.suffix)
        head = self._tokenize(prompt, False) if prompt else []  # as llama-server tokenizes the prompt
        n_batch = INFILL_BATCH
        n_prefix = min(len(prefix), 3 * (n_batch // 4))
        n_suffix = min(len(suffix), max(0, n_batch // 4 - (2 + len(head))))
        n_extra = min(max(0, n_ctx - n_batch - 2 * (n_predict if n_predict is not None else -1)), len(extra))
        inp = [fim["pre"], *prefix[len(prefix) - n_prefix:], *head]
        end = [fim["suf"], *suffix[:n_suffix]]
        if lib.llama_vocab_get_add_bos(v):
            inp.insert(0, int(lib.llama_vocab_bos(v)))
        return [*extra[len(extra) - n_extra:], *inp, *end, fim["mid"]]

    # -- images (llama.cpp's multimodal library, mtmd) ----------------------------------------------
    @staticmethod
    def _mtmd_lib():
        import llama_cpp.mtmd_cpp as mtmd

        return mtmd

    def _load_projector(self, path: str, model):
        from llama_cpp._logger import llama_log_callback

        mtmd = self._mtmd_lib()
        mtmd.mtmd_helper_log_set(llama_log_callback, None)  # its log as llama.cpp's: errors only, unless debugging
        params = mtmd.mtmd_context_params_default()
        params.use_gpu = self.n_gpu_layers != 0
        params.print_timings = False
        params.n_threads = self.n_threads
        mctx = mtmd.mtmd_init_from_file(path.encode("utf-8"), model, params)
        if not mctx:
            raise BackendError(f"llama.cpp could not load the vision projector {path} for {self.spec.name} (see the "
                               "runner's log): is it the projector of this model?")
        if not mtmd.mtmd_support_vision(mctx):
            mtmd.mtmd_free(mctx)
            raise BackendError(f"{path} is not a vision projector (it has no image encoder)")
        if mtmd.mtmd_decode_use_mrope(mctx):  # positions are not cells there: no prefix sharing across images
            log.info("%s uses M-RoPE positions: prompts with images are not shared with others", self.spec.name)
        return mctx

    def _tokenize_images(self, request: GenerationRequest) -> tuple[list[int], list, Any]:
        """(tokens, image spans, mtmd chunks) of a prompt with MEDIA_MARKER where each image goes;
        an image's positions hold stand-ins from its bytes' hash (llama_batch.image_standins).
        Runs off the event loop: decoding the images is real work."""
        import ctypes
        import hashlib

        from localrun.backends.llama_batch import ImageSpan, image_standins

        mtmd = self._mtmd_lib()
        if self._mtmd is None:
            raise InvalidRequest(f"{self.spec.name} has no vision projector: it cannot take images")
        n_markers = request.prompt.count(MEDIA_MARKER)
        if n_markers != len(request.images):
            raise InvalidRequest(f"the prompt has {n_markers} image place(s) but {len(request.images)} image(s) came")
        bitmaps = []
        chunks = None
        try:
            for i, data in enumerate(request.images):
                buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
                bm = mtmd.mtmd_helper_bitmap_init_from_buf(self._mtmd, buf, len(data), False)
                if not bm:
                    raise InvalidRequest(f"image {i + 1} could not be decoded: send a PNG, JPEG, GIF or BMP image")
                mtmd.mtmd_bitmap_set_id(bm, hashlib.sha256(data).hexdigest().encode("ascii"))
                bitmaps.append(bm)
            text = mtmd.mtmd_input_text()
            raw = request.prompt.replace(MEDIA_MARKER, mtmd.mtmd_default_marker().decode("utf-8")).encode("utf-8")
            text.text, text.text_len = raw, len(raw)
            text.add_special, text.parse_special = request.add_special, True
            chunks = mtmd.mtmd_input_chunks_init()
            arr = (mtmd.mtmd_bitmap_p_ctypes * len(bitmaps))(*bitmaps)
            if mtmd.mtmd_tokenize(self._mtmd, chunks, ctypes.byref(text), arr, len(bitmaps)) != 0:
                raise InvalidRequest("llama.cpp could not place the images in the prompt")
            tokens: list[int] = []
            spans = []
            digests = [hashlib.sha256(d).digest() for d in request.images]
            for k in range(mtmd.mtmd_input_chunks_size(chunks)):
                chunk = mtmd.mtmd_input_chunks_get(chunks, k)
                if mtmd.mtmd_input_chunk_get_type(chunk) == mtmd.MTMD_INPUT_CHUNK_TYPE_TEXT:
                    n = ctypes.c_size_t()
                    ptr = mtmd.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
                    tokens += [ptr[j] for j in range(n.value)]
                else:
                    n_tok = int(mtmd.mtmd_input_chunk_get_n_tokens(chunk))
                    spans.append(ImageSpan(len(tokens), n_tok, chunk))
                    tokens += image_standins(digests[len(spans) - 1], n_tok)
            if spans and mtmd.mtmd_decode_use_mrope(self._mtmd):
                # positions there are not one per cell: make the stand-ins unique to this request
                salt = os.urandom(8)
                for sp in spans:
                    tokens[sp.start:sp.end] = image_standins(hashlib.sha256(salt + bytes(sp.start)).digest(), sp.n)
            return tokens, spans, chunks
        except BaseException:
            if chunks is not None:
                mtmd.mtmd_input_chunks_free(chunks)
            raise
        finally:
            for bm in bitmaps:
                mtmd.mtmd_bitmap_free(bm)

    def _encode_image(self, span) -> Any:
        """Runs on the loop's encoder thread: the image chunk's embeddings (a copy)."""
        import numpy as np

        mtmd = self._mtmd_lib()
        if mtmd.mtmd_encode_chunk(self._mtmd, span.chunk) != 0:
            raise BackendError("llama.cpp could not encode an image (see the runner's log)")
        n_embd = int(self._lib.llama_model_n_embd_inp(self.engine.model))
        ptr = mtmd.mtmd_get_output_embd(self._mtmd)
        return np.ctypeslib.as_array(ptr, shape=(span.n * n_embd,)).copy()

    def _decode_image(self, span, seq: int, pos: int) -> None:
        """Runs on the loop's thread: the encoded image into sequence `seq` from position `pos`."""
        import ctypes

        mtmd = self._mtmd_lib()
        new_pos = self._lib.llama_pos(0)
        embd = span.embd.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        rc = mtmd.mtmd_helper_decode_image_chunk(self._mtmd, self.engine.ctx, span.chunk, embd, pos, seq,
                                                 self._n_batch, ctypes.byref(new_pos),
                                                 mtmd.mtmd_helper_post_decode_callback(), None)
        if rc != 0:
            raise BackendError(f"llama.cpp could not decode an image into the context (code {rc})")

    # -- embeddings ----------------------------------------------------------------------
    def _embed_sync(self, texts: list[str], truncate: bool = False, cancel: Any = None) -> list[list[float]]:
        return self._embedder.embed(texts, truncate, cancel)

    async def embed(self, texts: list[str], truncate: bool = False) -> list[list[float]]:
        from localrun.backends.llama_pooled import cancellable

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
        if getattr(self, "_mtmd", None):
            self._mtmd_lib().mtmd_free(self._mtmd)
            self._mtmd = None
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
    (llama_pooled.PooledBackend); a generating model the batched one (LlamaCppBackend)."""
    if spec.format != "gguf":
        raise BackendError(f"llama.cpp runs GGUF files only; {spec.name} is {spec.format} (use LOCALRUN_BACKEND=native)")
    if spec.embedding:
        from localrun.backends.llama_pooled import PooledBackend

        n_threads, extra_bufts, bufts_reason = cpu_choices(spec)
        return PooledBackend(spec, spec_gguf_info(spec), n_threads=n_threads, extra_bufts=extra_bufts,
                             bufts_reason=bufts_reason)
    return LlamaCppBackend(spec)
