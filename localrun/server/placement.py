"""Where and how a model loads: the backend it runs on, the LoadSpec it gets, and the memory its load needs.

The model manager (:mod:`localrun.server.manager`) decides when to load and what to evict; this
module answers the questions a load asks first:

- which backend ``choose`` picks for the model on this machine, and whether ``auto``'s native
  choice for a GGUF falls back to llama.cpp (a native load of that model failed before: kept per
  model digest until the daemon restarts);
- the context a load gets (the Modelfile's num_ctx, else LOCALRUN_CONTEXT_LENGTH, capped at the
  trained context; a pooled model's at POOLED_WINDOW);
- the ``LoadSpec``: weights, projector, adapter, the Modelfile's load PARAMETERs; with
  NUM_PARALLEL auto, the slots sized from free memory (``memory.auto_parallel``); the backend's
  memory estimate and where its layers can go (CUDA, Metal, or the CPU);
- the load options (``LOAD_OPTIONS``: Ollama's per-request num_thread, num_gpu) that make a
  loaded model reload;
- the largest num_ctx a load fits in free memory (``fitting_context``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from localrun.backends.base import POOLED_WINDOW, LoadSpec, MemoryEstimate
from localrun.backends.select import (BackendChoice, backend_module, choose, is_apple_silicon, llamacpp_build,
                                     local_cuda_gpu, model_architecture)
from localrun.config import AUTO_PARALLEL, Settings
from localrun.errors import InsufficientMemory, InvalidRequest
from localrun.library.capabilities import model_kind
from localrun.server.loaded import LoadedModel
from localrun.server.memory import Plan, auto_parallel, plan_load

log = logging.getLogger("localrun.manager")  # (the manager's log: these lines are about its loads)

# Ollama's request options that decide how a model is loaded, not how it samples, with the value that
# leaves them to the daemon: a request that asks for other values than the loaded model's reloads it
# (once idle), as Ollama does
LOAD_OPTIONS = {"num_thread": 0, "num_gpu": -1}


def load_options(resolved: Any) -> dict[str, Any]:
    """The load options (LOAD_OPTIONS) among a resolved model's parameters: its Modelfile's, or a
    request's over them (with_load_options)."""
    params = getattr(resolved, "parameters", None) or {}
    return {k: params[k] for k in LOAD_OPTIONS if k in params}


def with_load_options(resolved: Any, options: Any) -> Any:
    """`resolved` with a request's load options (Ollama's `options`: num_thread, num_gpu) over its
    Modelfile's; itself when the request names none. InvalidRequest for a value that is not a
    whole number in range."""
    if not isinstance(options, dict) or not any(k in options for k in LOAD_OPTIONS):
        return resolved
    params = dict(resolved.parameters or {})
    for k, auto in LOAD_OPTIONS.items():
        if k in options and options[k] is not None:
            v = options[k]
            if not isinstance(v, int) or isinstance(v, bool) or not auto <= v <= 4096:
                raise InvalidRequest(f"'{k}' must be a whole number from {auto} ({auto}: automatic) to 4096")
            if v == auto:  # the daemon's own choice (threads: the physical cores; layers: what fits), as if unset
                params.pop(k, None)
            else:
                params[k] = v
    return dataclasses.replace(resolved, parameters=params)


def gpu_target(backend: str, offload: bool, gpu: Any) -> tuple[str | None, int | None]:
    """Where a load's layers can go: (the GPU's kind, its free bytes), or (None, None) for the CPU.
    The native engine runs on CUDA; llama.cpp offloads when its build can (`offload`): to CUDA,
    or to Metal on Apple silicon."""
    if backend == "native":
        return ("CUDA", gpu.free_bytes) if gpu else (None, None)
    if offload:
        if gpu is not None:
            return "CUDA", gpu.free_bytes
        if is_apple_silicon():
            return "Metal", None
    return None, None


@dataclass
class SizedLoad:
    """A load's LoadSpec with its slots sized, the memory it needs, and where its layers can go."""

    backend: str  # the chosen backend's name ("llamacpp", "native", ...)
    module: Any  # its module (backend_module): estimate_memory, ...
    spec: LoadSpec
    estimate: MemoryEstimate
    layers: int
    offload: bool  # llama.cpp's build can put layers on a GPU
    parallel_why: str  # how NUM_PARALLEL auto sized the slots ("" when it did not)

    def where(self, gpu: Any) -> tuple[str | None, int | None]:
        return gpu_target(self.backend, self.offload, gpu)


class Placement:
    """The backend, LoadSpec and memory inputs of a load, with this daemon's settings; and the native
    loads of `auto` that failed (model digest -> why), which llama.cpp then loads."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.native_failed: dict[str, str] = {}  # model digest -> why auto's native load failed

    # -- the context a load gets ---------------------------------------------------------
    def default_num_ctx(self, resolved: Any, quiet: bool = False) -> int:
        n = resolved.parameters.get("num_ctx") if resolved.parameters else None
        n = int(n or self.settings.context_length)
        return self.cap_ctx(resolved, n, quiet)

    def cap_ctx(self, resolved: Any, n: int, quiet: bool = False) -> int:
        train = getattr(getattr(resolved, "info", None), "context_length", None)
        if train and n > train:
            if not quiet:
                log.info("%s: num_ctx %d capped at the model's trained context %d", resolved.name, n, train)
            n = int(train)
        if n > POOLED_WINDOW and model_kind(resolved) != "completion":  # an embedding model's or a reranker's
            n = POOLED_WINDOW
        return n

    # -- the backend -----------------------------------------------------------------------
    def choose(self, resolved: Any, gpu: Any) -> BackendChoice:
        """The backend `choose` picks for `resolved` on this machine, with this daemon's settings."""
        return choose(self.settings.backend, resolved.format, gpu, info=resolved.info,
                      arch=model_architecture(resolved.format, resolved.weights, resolved.info),
                      vision=getattr(resolved, "projector", None) is not None,
                      native_on_cpu=self.settings.native_on_cpu, pooled=model_kind(resolved) != "completion")

    def may_fall_back(self, resolved: Any, choice: BackendChoice) -> bool:
        """auto picked the native engine for a GGUF: llama.cpp runs it if that load fails."""
        return self.settings.backend == "auto" and choice.backend == "native" and resolved.format == "gguf"

    def fell_back(self, resolved: Any, choice: BackendChoice) -> bool:
        """Such a load failed before (kept until the daemon restarts): llama.cpp loads it."""
        return self.may_fall_back(resolved, choice) and resolved.digest in self.native_failed

    # -- the spec and its memory -------------------------------------------------------------
    def spec(self, resolved: Any, num_ctx: int) -> LoadSpec:
        """What a load of `resolved` with `num_ctx` asks its backend for."""
        spec = LoadSpec(name=resolved.name, weights=resolved.weights, format=resolved.format, num_ctx=num_ctx,
                        num_parallel=self.settings.num_parallel or 1, extra={"gguf_info": resolved.info},
                        embedding=model_kind(resolved) != "completion")
        s = self.settings  # the prompt cache on disk (backends/prompt_disk.py): its entries are keyed by the digest
        spec.extra.update(digest=str(getattr(resolved, "digest", "") or ""), prompt_cache_dir=str(s.prompt_cache_dir),
                          prompt_cache_disk=s.prompt_cache_disk, prompt_cache_min=s.prompt_cache_min)
        if getattr(resolved, "projector", None) is not None:
            spec.extra["projector"] = str(resolved.projector)
        if getattr(resolved, "adapter", None):
            spec.extra["adapter"] = str(resolved.adapter)
        if resolved.parameters:
            for k in ("repeat_last_n", "num_thread", "num_gpu", "main_gpu", "use_mmap", "tensor_parallel",
                      "kv_cache_type", "weight_dtype", "speculative", "num_speculative_tokens"):
                if k in resolved.parameters:
                    spec.extra[k] = resolved.parameters[k]
        if "num_thread" in spec.extra:
            spec.extra["n_threads"] = int(spec.extra["num_thread"])
        return spec

    async def sized(self, resolved: Any, num_ctx: int, gpu: Any, choice: BackendChoice,
                    free_ram: Callable[[], int]) -> SizedLoad:
        """The spec of a load of `resolved` with `choice`, its slots sized from free memory when
        NUM_PARALLEL is auto (llama.cpp), and its memory estimate. `free_ram` is asked when the
        slots are sized (the manager's: what a test of it replaces)."""
        module = backend_module(choice.backend)
        spec = self.spec(resolved, num_ctx)
        # what llama.cpp's build can do is asked once, in a child process: off the event loop
        offload = choice.backend == "llamacpp" and (await asyncio.to_thread(llamacpp_build)).gpu_offload
        layers = int(getattr(resolved.info, "block_count", 0) or 1)
        parallel_why = ""
        if not self.settings.num_parallel and choice.backend == "llamacpp" and not spec.embedding:  # auto: from memory
            gpu_kind, gpu_free = gpu_target(choice.backend, offload, gpu)

            def estimate(n: int):
                return module.estimate_memory(dataclasses.replace(spec, num_parallel=n))

            spec.num_parallel, parallel_why = await asyncio.to_thread(
                auto_parallel, estimate, layers, AUTO_PARALLEL, ram_free=free_ram(), gpu_free=gpu_free,
                gpu_kind=gpu_kind)
        est = await asyncio.to_thread(module.estimate_memory, spec)
        return SizedLoad(choice.backend, module, spec, est, layers, offload, parallel_why)

    def placed(self, sized: SizedLoad, choice: BackendChoice, plan: Plan) -> LoadSpec:
        """`sized`'s spec with the memory plan's placement written in (a Modelfile's PARAMETER num_gpu
        over the plan's layers on llama.cpp), for the runner and for ps."""
        spec = sized.spec
        if "num_gpu" in spec.extra and choice.backend == "llamacpp":  # Modelfile PARAMETER num_gpu wins
            plan.n_gpu_layers = int(spec.extra["num_gpu"])
        spec.extra.update(n_gpu_layers=plan.n_gpu_layers, device=plan.device, processor=plan.processor,
                          reason="; ".join(x for x in (choice.reason, plan.detail, sized.parallel_why) if x),
                          size_vram=plan.size_vram)
        spec.extra.update(size_bytes=sized.estimate.total_bytes, extra_buffers=self.settings.llamacpp_extra_buffers)
        return spec

    async def fitting_context(self, resolved: Any, ceiling: int, loaded: Mapping[str, LoadedModel],
                              free_ram: Callable[[], int]) -> tuple[int, str]:
        """The largest num_ctx up to `ceiling` (the ceiling, or a multiple of 1,024) that a load of
        `resolved` fits in the memory free with every model in `loaded` unloaded: the plan a load makes
        (estimate_memory, then plan_load), asked at each size; one sequence when NUM_PARALLEL is
        auto (a load then sizes its slots from what is left). (num_ctx, why)."""
        gpu = await asyncio.to_thread(local_cuda_gpu)
        choice = self.choose(resolved, gpu)
        if self.fell_back(resolved, choice):  # auto's native load of it failed before: llama.cpp loads it
            choice = BackendChoice("llamacpp", "llama.cpp")
        module = backend_module(choice.backend)
        offload = choice.backend == "llamacpp" and (await asyncio.to_thread(llamacpp_build)).gpu_offload
        gpu_kind, gpu_free = None, None
        if gpu is not None and (choice.backend == "native" or offload):
            gpu_kind, gpu_free = "CUDA", gpu.free_bytes + sum(r.plan.size_vram for r in loaded.values())
        elif offload and is_apple_silicon():
            gpu_kind = "Metal"
        ram = free_ram() + sum(r.plan.size - r.plan.size_vram for r in loaded.values())
        layers = int(getattr(resolved.info, "block_count", 0) or 1)
        spec = self.spec(resolved, ceiling)  # the spec a load of it would get

        def fits(n: int) -> bool:
            try:
                plan_load(module.estimate_memory(dataclasses.replace(spec, num_ctx=n)), layers, ram_free=ram,
                          gpu_free=gpu_free, gpu_kind=gpu_kind)
                return True
            except InsufficientMemory:
                return False

        def search() -> tuple[int, str]:
            if fits(ceiling):
                return ceiling, "the model's trained context, which the free memory holds"
            lo, hi = 0, ceiling // 1024  # fits(lo * 1024) (or lo 0: none checked fits), not fits(hi * 1024)
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if fits(mid * 1024) else (lo, mid)
            if lo == 0:
                return min(ceiling, 1024), "not even 1,024 tokens fit the free memory: the load will say why"
            return lo * 1024, f"what the free memory holds (the model was trained for {ceiling})"

        return await asyncio.to_thread(search)


__all__ = ["Placement", "SizedLoad", "LOAD_OPTIONS", "load_options", "with_load_options", "gpu_target"]
