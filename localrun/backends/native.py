"""The native engine behind the Backend protocol (localrun.engine; torch on CPU, Triton on CUDA).

The daemon renders chat templates itself and hands us finished prompts. One LLMEngine per
loaded model runs its loop on a thread; each generate() is one engine request whose
stream feeds this async generator. Closing the generator aborts the request and frees
its KV pages at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from functools import lru_cache
from pathlib import Path
from typing import AsyncIterator, Callable

import torch

from localrun.backends.base import (
    BackendInfo,
    check_token_ids,
    Chunk,
    GenerationRequest,
    INLINE_TOKENIZE_CHARS,
    LoadSpec,
    MemoryEstimate,
    SamplingOptions,
    TokenLogprob,
    Usage,
)
from localrun.engine import EngineConfig, LLMEngine, SamplingParams
from localrun.engine.config import CUDA_MAX_NUM_SEQS, ModelConfig, kv_dtype_name, parse_dtype, parse_kv_cache_dtype
from localrun.engine.parallel.group import check_shapes
from localrun.engine.layers.quant import estimate_weight_bytes
from localrun.errors import BackendError, InsufficientMemory, InvalidRequest

log = logging.getLogger("localrun.native")

MAX_BATCH = 64  # sequences one engine batches on CPU (the daemon's slots for this model; CUDA: the engine's default)


def _model_config(spec: LoadSpec) -> ModelConfig:
    p = Path(spec.weights)
    return _read_config(str(p), spec.format, p.stat().st_mtime_ns)


@lru_cache(maxsize=16)
def _read_config(path: str, fmt: str, mtime_ns: int) -> ModelConfig:
    if fmt == "gguf":
        from localrun.engine.models.loader import read_gguf

        return read_gguf(path)[0]
    import json

    return ModelConfig.from_hf_config(json.loads((Path(path) / "config.json").read_text()))


def _device_dtype(spec: LoadSpec) -> tuple[str, torch.dtype]:
    device = spec.extra.get("native_device") or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = spec.extra.get("dtype") or ("bfloat16" if device == "cuda" else "float32")
    return device, parse_dtype(dtype)


def _kv_dtype(spec: LoadSpec, dtype: torch.dtype) -> torch.dtype:
    """The KV cache dtype: spec.extra["kv_cache_type"], else LOCALRUN_KV_CACHE_TYPE (auto: the model's dtype)."""
    from localrun.config import settings

    try:
        name = spec.extra.get("kv_cache_type") or settings().kv_cache_type
        if str(name).strip().lower() == "q4_0":  # llama.cpp's 4-bit blocks: int8 is the engine's smallest
            log.info("%s: KV cache q4_0 asked; the native engine stores it as int8", spec.name)
            name = "int8"
        return parse_kv_cache_dtype(name, dtype)
    except ValueError as exc:  # the message names the setting and its choices
        raise InvalidRequest(str(exc)) from None


def _weight_dtype(spec: LoadSpec) -> str:
    """auto | int8 | fp8: a `weight_dtype` in the load's extra parameters, else LOCALRUN_WEIGHT_DTYPE."""
    from localrun.engine.layers.quant import parse_weight_dtype

    raw = spec.extra.get("weight_dtype")
    if raw is None:
        from localrun.config import settings

        raw = settings().weight_dtype
    try:
        return parse_weight_dtype(str(raw))
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None
def _tensor_parallel(spec: LoadSpec) -> int:
    """Modelfile PARAMETER tensor_parallel, else LOCALRUN_TENSOR_PARALLEL."""
    v = spec.extra.get("tensor_parallel")
    if v is None:
        from localrun.config import settings

        return settings().tensor_parallel
    return int(v)


def _speculative(spec: LoadSpec) -> dict:
    """EngineConfig's speculative fields: PARAMETER speculative, else LOCALRUN_SPECULATIVE."""
    from localrun.config import speculative_for_load

    try:
        mode, draft, k = speculative_for_load(spec.extra)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None
    return {"speculative": mode, "draft_model": draft, "num_speculative_tokens": k}


FOLLOWER_RSS_BYTES = 400 * 2**20  # CPU: each extra rank is a process with its own torch runtime


def _kv_tokens(spec: LoadSpec) -> int:
    """CPU: num_ctx for each of max(num_parallel, 4) sequences (preemption handles the rest)."""
    return spec.num_ctx * max(spec.num_parallel, 4)


def estimate_memory(spec: LoadSpec) -> MemoryEstimate:
    try:
        cfg = _model_config(spec)
    except (ValueError, KeyError, OSError) as exc:
        raise InvalidRequest(f"the native engine cannot run {spec.name}: {exc}") from None
    device, dtype = _device_dtype(spec)
    kv_dtype = _kv_dtype(spec, dtype)
    tp = _tensor_parallel(spec)
    try:
        check_shapes(cfg, tp)
    except ValueError as exc:
        raise InvalidRequest(f"the native engine cannot split {spec.name}: {exc}") from None
    elem = torch.empty((), dtype=dtype).element_size()
    weights = estimate_weight_bytes(cfg, _weight_dtype(spec), elem)  # int8/fp8: <= 1.125 bytes a weight
    kv = cfg.kv_bytes_per_token(kv_dtype) * _kv_tokens(spec)
    overhead = 256 * 2**20 + 2048 * cfg.vocab_size * 4  # activations + a step's logits
    kv_type = kv_dtype_name(kv_dtype)
    host = _host_tier_bytes(kv, tp)
    note = _dequant_note(cfg, dtype)
    if tp > 1 and device == "cuda":  # the plan is for one GPU: each holds 1/tp of the weights and KV heads
        return MemoryEstimate(weights_bytes=-(-weights // tp), kv_bytes=-(-kv // tp), overhead_bytes=overhead,
                              kv_type=kv_type, host_cache_bytes=host, note=note)
    return MemoryEstimate(weights_bytes=weights, kv_bytes=kv, overhead_bytes=overhead + (tp - 1) * FOLLOWER_RSS_BYTES,
                          kv_type=kv_type, host_cache_bytes=host, note=note)


def _dequant_note(cfg: ModelConfig, dtype: torch.dtype) -> str:
    """What the plan says of weights stored smaller than they run: gpt-oss's MXFP4 experts, dequantised at
    load (the native engine has no MXFP4 kernel), hold 2 bytes a weight in bf16 where the file has 17/32."""
    if not cfg.experts_mxfp4:
        return ""
    mi = cfg.moe_intermediate_size or cfg.intermediate_size
    n = sum(cfg.num_experts * 3 * cfg.hidden_size * mi for layer in range(cfg.num_layers) if cfg.layer_is_moe(layer))
    name = str(dtype).removeprefix("torch.")
    return (f"MXFP4 expert weights dequantised to {name} at load (no MXFP4 kernel): "
            f"{n * dtype.itemsize / 2**30:.2f} GiB where the checkpoint holds {n * 17 / 32 / 2**30:.2f} GiB")


def _host_tier_bytes(kv_bytes: int, tp: int) -> int:
    """The most host RAM the prefix cache's host tier will take (LOCALRUN_HOST_CACHE; auto: the
    engine's default, at most HOST_AUTO_POOL_MULTIPLE x the KV pool; none under tensor parallelism)."""
    from localrun.config import settings
    from localrun.engine.build import HOST_AUTO_POOL_MULTIPLE
    from localrun.engine.kv.host import default_host_cache_bytes

    if tp > 1:
        return 0
    budget = _host_cache_bytes(settings().host_cache)
    if budget is None:
        budget = min(default_host_cache_bytes(), HOST_AUTO_POOL_MULTIPLE * kv_bytes)
    return max(int(budget), 0)


def _params(o: SamplingOptions, prompt_len: int, max_len: int, grammar=None,
            keep_special: frozenset[int] = frozenset()) -> SamplingParams:
    room = max_len - prompt_len
    if room < 1:
        raise InvalidRequest(f"the prompt ({prompt_len} tokens) fills the context window ({max_len}); "
                             "shorten it or raise num_ctx")
    try:
        return SamplingParams(
            temperature=o.temperature, top_p=o.top_p, top_k=o.top_k, min_p=o.min_p,
            repetition_penalty=o.repeat_penalty, presence_penalty=o.presence_penalty,
            frequency_penalty=o.frequency_penalty, seed=o.seed,
            max_tokens=room if o.max_tokens is None else min(o.max_tokens, room),
            stop=list(o.stop), stop_token_ids=list(o.stop_token_ids), ignore_eos=o.ignore_eos,
            logprobs=o.top_logprobs if o.logprobs else 0, want_logprobs=o.logprobs,
            penalty_window=o.repeat_last_n if o.repeat_last_n != 0 else -1, grammar=grammar,
            prompt_logprobs=o.prompt_logprobs, keep_special=keep_special,
        )
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None


def _cuda_error(message: str) -> bool:
    """A CUDA error (illegal memory access, device-side assert, ECC, ...) leaves the process's CUDA
    context unusable; every later kernel launch fails too."""
    return "CUDA error" in message or "cudaError" in message or "AcceleratorError" in message


class NativeBackend:
    _fatal: str | None = None

    @property
    def fatal(self) -> str | None:
        """Set when the backend cannot go on (a poisoned CUDA context, a dead tensor-parallel rank:
        the engine's own mark counts even with no request in flight); the runner then exits and
        the daemon loads the model afresh on the next request."""
        return self._fatal or self.engine.fatal

    @fatal.setter
    def fatal(self, message: str | None) -> None:
        self._fatal = message

    def __init__(self, spec: LoadSpec, engine: LLMEngine, device: str) -> None:
        self.spec, self.engine = spec, engine
        if engine.tokenizer is None:
            raise BackendError(f"{spec.name} has no tokenizer files (tokenizer.json); the daemon needs one")
        self.tokenizer = engine.tokenizer
        weights = engine.weight_bytes  # this rank's, as stored (int8/fp8 data and scales when quantized)
        tp = engine.tp.world
        size = (weights + engine.pool.nbytes) * tp  # every rank holds a shard this size
        cuda = device == "cuda"
        pool = engine.pool
        reason = spec.extra.get("reason") or f"native engine on {'CUDA' if cuda else 'CPU'}"
        reason += (f"; KV cache {kv_dtype_name(pool.dtype)}: {pool.num_pages * pool.page_size} tokens in "
                   f"{pool.nbytes / 2**20:.0f} MiB")
        if tp > 1:
            reason += (f"; tensor parallel {tp}: {weights / 2**20:.1f} MiB weights + "
                       f"{pool.nbytes / 2**20:.1f} MiB KV per rank")
        self.info = BackendInfo(
            name="native", device="CUDA" if cuda else "CPU",
            processor=spec.extra.get("processor") or ("100% GPU" if cuda else "100% CPU"),
            reason=reason,
            context_length=engine.config.max_model_len, slots=engine.config.max_num_seqs,
            size_bytes=size, size_vram_bytes=size if cuda else 0,
            supports_embeddings=True, supports_logprobs=True, supports_json_schema=True,
            max_token_bytes=self.tokenizer.max_token_bytes(),
            supports_groups=tp == 1,  # tensor parallelism: the engine runs group members on their own
            fallbacks=list(engine.fallbacks),
            kv_cache_type=kv_dtype_name(pool.dtype),
            embed_window=engine.config.max_model_len,
            bos_token=self.tokenizer.bos_token, eos_token=self.tokenizer.eos_token,
            supports_prompt_logprobs=engine.scores_prompts,
        )
        self.on_info: Callable[[], None] | None = None  # the runner sends self.info to the daemon (any thread)
        engine.on_fallback = self._fallbacks_changed
        engine.start()

    def _fallbacks_changed(self) -> None:
        """A fallback after loading (engine thread): the new list, and the pool's size, go to ps."""
        pool, tp = self.engine.pool, self.engine.tp.world
        self.info.fallbacks = list(self.engine.fallbacks)
        self.info.size_bytes = (self.engine.weight_bytes + pool.nbytes) * tp
        if self.info.device == "CUDA":
            self.info.size_vram_bytes = self.info.size_bytes
        if self.on_info is not None:
            try:
                self.on_info()
            except RuntimeError:  # the runner's event loop is closing: nobody to tell
                pass

    async def tokenize(self, text: str, add_special: bool = False) -> list[int]:
        if len(text) <= INLINE_TOKENIZE_CHARS:  # a short text costs less than the hop to a thread
            return self.tokenizer.encode(text, add_special=add_special)
        return await asyncio.to_thread(self.tokenizer.encode, text, add_special=add_special)

    async def detokenize(self, token_ids: list[int]) -> str:
        check_token_ids(token_ids, self.tokenizer.vocab_size)
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=False)

    async def _grammar(self, o: SamplingOptions):
        """The compiled grammar of a structured request (None otherwise): the llama.cpp backend's
        bounds on the schema, then a cached compile on a worker thread (never the event loop or
        the engine's loop thread); InvalidRequest (400) when the schema cannot be used."""
        from localrun.structured.constraints import constraint_lark

        if o.own_constraint():
            try:
                return await asyncio.to_thread(
                    lambda: self.engine.compile_grammar(lark=constraint_lark(o.regex, o.choices, o.grammar)))
            except ValueError as exc:
                raise InvalidRequest(f"{exc}; fix or simplify it") from None
        if o.json_schema is None and not o.json_mode:
            return None
        from localrun.structured.bounds import check_schema_bounds

        if o.json_schema is not None:
            check_schema_bounds(o.json_schema)
        try:
            return await asyncio.to_thread(self.engine.compile_grammar, o.json_schema)
        except ValueError as exc:
            raise InvalidRequest(f"{exc}; fix or simplify the schema") from None

    def _logprobs(self, items) -> list[TokenLogprob]:
        s = self.tokenizer.token_str
        return [TokenLogprob(s(t), lp, [(s(i), v) for i, v in top], top_ids=[int(i) for i, _ in top])
                for t, lp, top in items]

    async def generate(self, request: GenerationRequest) -> AsyncIterator[Chunk]:
        ids = request.prompt_token_ids
        if ids is None:
            ids = await self.tokenize(request.prompt, add_special=request.add_special)
        else:  # the daemon's, or a client's (a prompt of token ids)
            check_token_ids(ids, self.tokenizer.vocab_size)
        if not ids:
            raise InvalidRequest("the prompt is empty")
        params = _params(request.options, len(ids), self.engine.config.max_model_len, await self._grammar(request.options),
                         self.tokenizer.kept_specials(request.preserve))  # a harmony chat's markers, a call's
        if self.engine.fatal:  # a tensor-parallel rank died: this runner must restart
            self.fatal = self.engine.fatal
            raise BackendError(self.engine.fatal)
        try:
            stream = self.engine.add_request(ids, params, f"{request.request_id or 'req'}-{uuid.uuid4().hex[:8]}",
                                             group=request.group)
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None
        try:
            async for d in stream:
                if d.error:
                    if _cuda_error(d.error) or self.engine.fatal:  # a poisoned CUDA context, a dead
                        self.fatal = d.error  # tensor-parallel rank: the runner must restart
                    elif d.error_kind == "out_of_memory":  # the engine shrank itself and goes on
                        raise BackendError(d.error, status=503, code="out_of_memory")
                    elif d.error_kind == "grammar":  # the request's own grammar stopped it
                        raise InvalidRequest(d.error)
                    raise BackendError(d.error)
                usage = None
                if d.usage is not None:
                    usage = Usage(prompt_tokens=d.usage["prompt_tokens"], completion_tokens=d.usage["completion_tokens"],
                                  cached_tokens=d.usage["cached_tokens"], prompt_eval_seconds=d.usage["prompt_eval_seconds"],
                                  eval_seconds=d.usage["eval_seconds"])
                yield Chunk(text=d.text, token_ids=list(d.token_ids),
                            logprobs=self._logprobs(d.logprobs) if d.logprobs else None,
                            finish_reason=d.finish_reason, usage=usage, stop_sequence=d.stop_sequence,
                            prompt_logprobs=self._logprobs(d.prompt_logprobs) if d.prompt_logprobs else None)
        finally:
            await stream.aclose()  # no-op when finished; aborts (and frees KV) otherwise

    async def stats(self) -> dict:
        """KV pages, prefix-cache hits, running/waiting sequences (for /metrics)."""
        return self.engine.stats()

    async def embed(self, texts: list[str], truncate: bool = False) -> list[list[float]]:
        ids = [await self.tokenize(t, add_special=True) for t in texts]
        if truncate:
            ids = [i[:self.engine.config.max_model_len] for i in ids]
        if any(not i for i in ids):
            raise InvalidRequest("cannot embed an empty input")
        try:
            return await asyncio.to_thread(self.engine.embed, ids)
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None
        except RuntimeError:
            if self.engine.fatal:
                self.fatal = self.engine.fatal
                raise BackendError(self.engine.fatal) from None
            raise

    async def close(self) -> None:
        await asyncio.to_thread(self._close)

    def _close(self) -> None:
        self.engine.shutdown()
        if self.info.device == "CUDA":
            del self.engine
            torch.cuda.empty_cache()


def _host_cache_bytes(setting: int | float | None) -> int | None:
    """LOCALRUN_HOST_CACHE for EngineConfig.host_cache_bytes: bytes as given, a fraction of the RAM
    available now, or None (the engine's default)."""
    if isinstance(setting, float):
        from localrun.engine.kv.host import available_ram

        return int(setting * available_ram())
    return setting


def _fault_paths(device: str) -> dict:
    """LOCALRUN_FAULTS on CPU: a graph_capture fault turns on the padded decode path (the capture
    procedure, without CUDA) and a kernel fault the Triton kernels (under TRITON_INTERPRET=1 only),
    so that the fault has the step it names to fail."""
    from localrun.engine import faults

    if device == "cuda":
        return {}
    return {**({"cuda_graphs": True} if faults.active("graph_capture") else {}),
            **({"use_triton": True} if faults.active("kernel") else {})}


def load(spec: LoadSpec) -> NativeBackend:
    from localrun.engine import faults

    if any(arg is None or arg == spec.name for arg in faults.active("native_load")):
        raise faults.InjectedFault(f"{faults.ENV}=native_load: the native engine's load of {spec.name} fails")
    device, dtype = _device_dtype(spec)
    try:
        cfg = EngineConfig(
            dtype=str(dtype).removeprefix("torch."), device=device, max_model_len=spec.num_ctx,
            kv_cache_dtype=kv_dtype_name(_kv_dtype(spec, dtype)),
            max_num_seqs=max(spec.num_parallel, MAX_BATCH if device != "cuda" else CUDA_MAX_NUM_SEQS),
            kv_cache_tokens=None if device == "cuda" else _kv_tokens(spec), weight_dtype=_weight_dtype(spec),
            tensor_parallel=_tensor_parallel(spec), **_speculative(spec), **_fault_paths(device),
        )
    except ValueError as exc:  # e.g. fp8 weights on a GPU without fp8 tensor cores
        raise BackendError(f"the native engine cannot load {spec.name}: {exc}") from None
    from localrun.config import settings

    s = settings()
    if device == "cuda":
        cfg.gpu_memory_fraction = s.gpu_memory_fraction
    cfg.host_cache_bytes = _host_cache_bytes(s.host_cache)
    t0 = time.perf_counter()
    try:
        if spec.format == "gguf":
            engine = LLMEngine.from_gguf(spec.weights, cfg, adapter=spec.extra.get("adapter"))
        else:
            engine = LLMEngine.from_safetensors(spec.weights, cfg)
    except MemoryError as exc:
        raise InsufficientMemory(f"{spec.name} does not fit: {exc}") from None
    except (ValueError, KeyError) as exc:
        raise BackendError(f"the native engine cannot load {spec.name}: {exc}") from None
    log.info("native engine loaded %s in %.1fs on %s (%s): %s", spec.name, time.perf_counter() - t0, device, dtype,
             ", ".join(f"{k} {v:.2f}" for k, v in engine.timings.items()))
    return NativeBackend(spec, engine, device)
