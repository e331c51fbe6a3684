"""The memory plan made before every load.

Weights + KV cache for the requested context (estimated by the backend from the GGUF
header) against free RAM (psutil) and free VRAM (torch.cuda.mem_get_info where CUDA is
present) decide: all layers on the GPU, N layers offloaded, CPU only, or refuse with a
message naming needed vs free memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from localrun.backends.base import MemoryEstimate
from localrun.errors import InsufficientMemory

GPU_HEADROOM = 0.90  # leave 10% of free VRAM for the driver and fragmentation
RAM_HEADROOM = 0.95


def gib(n: int | float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def free_ram() -> int:
    import psutil

    return int(psutil.virtual_memory().available)


@dataclass
class Plan:
    device: str  # "CPU" | "CUDA" | "Metal"
    n_gpu_layers: int  # -1 = all, 0 = none
    processor: str  # what `ps` shows: "100% GPU", "100% CPU", "37%/63% CPU/GPU"
    size: int  # bytes the model will hold (weights + KV + buffers)
    size_vram: int
    detail: str  # sentence for the log and /api/ps

    @property
    def summary(self) -> str:
        return f"{self.processor}: {self.detail}"


def plan_load(est: MemoryEstimate, layers: int, *, ram_free: int, gpu_free: int | None = None,
              gpu_kind: str | None = None) -> Plan:
    """Decide where a model goes. `gpu_free` None means no usable GPU."""
    plan = _plan_load(est, layers, ram_free=ram_free, gpu_free=gpu_free, gpu_kind=gpu_kind)
    if est.kv_type:
        plan.detail += f" ({est.kv_type} KV cache: {gib(est.kv_bytes)})"
    if est.note:
        plan.detail += f"; {est.note}"
    if est.host_cache_bytes:
        ram_left = ram_free - (plan.size - plan.size_vram)
        if est.host_cache_bytes > ram_left * RAM_HEADROOM:
            raise InsufficientMemory(
                f"the prefix cache's host tier wants {gib(est.host_cache_bytes)} of RAM but only {gib(max(ram_left, 0))} "
                "is free after the model; lower LOCALRUN_HOST_CACHE (a size, a fraction, or 0 for none)")
        plan.size += est.host_cache_bytes
        plan.detail += f", up to {gib(est.host_cache_bytes)} host RAM for the prefix cache's host tier"
    return plan


def _plan_load(est: MemoryEstimate, layers: int, *, ram_free: int, gpu_free: int | None,
               gpu_kind: str | None) -> Plan:
    need = est.total_bytes
    layers = max(layers, 1)
    if gpu_kind == "Metal":  # unified memory: the GPU uses RAM
        if need <= ram_free * RAM_HEADROOM:
            return Plan("Metal", -1, "100% GPU", need, need, f"all {layers} layers on Metal, needs {gib(need)} of {gib(ram_free)} free")
        raise InsufficientMemory(_refuse(need, ram_free, "unified memory"))
    if gpu_free is not None and gpu_kind:
        budget = int(gpu_free * GPU_HEADROOM)
        if need <= budget:
            return Plan(gpu_kind, -1, "100% GPU", need, need,
                        f"all {layers} layers on the GPU, needs {gib(need)} of {gib(gpu_free)} free VRAM")
        per_layer = (est.weights_bytes + est.kv_bytes) / layers
        n = int((budget - est.overhead_bytes) // per_layer) if per_layer else 0
        n = max(0, min(n, layers - 1))
        if n > 0:
            vram = int(n * per_layer + est.overhead_bytes)
            ram_need = need - int(n * per_layer)
            if ram_need <= ram_free * RAM_HEADROOM:
                gpu_pct = round(100 * n / layers)
                return Plan(gpu_kind, n, f"{100 - gpu_pct}%/{gpu_pct}% CPU/GPU", need, vram,
                            f"{n}/{layers} layers on the GPU ({gib(vram)} of {gib(gpu_free)} free VRAM), "
                            f"the rest on CPU ({gib(ram_need)} of {gib(ram_free)} free RAM)")
    if need <= ram_free * RAM_HEADROOM:
        why = "no usable GPU" if gpu_free is None else f"does not fit {gib(gpu_free)} free VRAM"
        return Plan("CPU", 0, "100% CPU", need, 0, f"on CPU ({why}), needs {gib(need)} of {gib(ram_free)} free RAM")
    where = "RAM" if gpu_free is None else "RAM + VRAM"
    raise InsufficientMemory(_refuse(need, ram_free + int(gpu_free or 0), where))


def auto_parallel(estimate: Callable[[int], MemoryEstimate], layers: int, most: int, *, ram_free: int,
                  gpu_free: int | None = None, gpu_kind: str | None = None) -> tuple[int, str]:
    """LOCALRUN_NUM_PARALLEL=auto: the most parallel sequences (``most``, then halving) whose KV cache
    (``estimate(n)``: the memory of a load with n of them) fits with the weights: wholly on the GPU
    where there is one, else in RAM. (n, why) for the log and `ps`; 1 when none fits, and then the
    memory plan decides (offload part of the model, or refuse)."""
    n = max(1, most)
    while n >= 1:
        est = estimate(n)
        try:
            plan = plan_load(est, layers, ram_free=ram_free, gpu_free=gpu_free, gpu_kind=gpu_kind)
        except InsufficientMemory:
            plan = None
        if plan is not None and (gpu_kind is None or plan.n_gpu_layers == -1):
            where = plan.device if plan.device != "CPU" else "RAM"
            return n, (f"{n} parallel (auto: the KV cache of {n} x the context, {gib(est.kv_bytes)}, fits in "
                       f"{where})")
        if n == 1:
            break
        n //= 2
    return 1, "1 parallel (auto: a larger KV cache would not fit)"


def _refuse(need: int, free: int, where: str) -> str:
    return (f"model needs {gib(need)} (weights + KV cache for the context) but only {gib(free)} of {where} "
            "is free; unload other models (`localrun stop`), use a smaller num_ctx, or a smaller quantization")
