"""Building an engine: the model's shard and weights, kernel trials beside their load, the KV budget, host tier, graphs.

`make_engine` is what `LLMEngine.from_gguf` / `from_safetensors` / `from_random` (through
`from_recipe`) and `from_hf_state` run: it starts the other tensor-parallel ranks, builds this
rank's model and fills its weights while the Triton kernels' first compile and trial runs on
a thread of its own (`KernelTrials`, CUDA), then constructs the engine. The engine's
constructor sizes its KV pool with `kv_budget`, adds the prefix cache's host tier
(`host_kv_pool`) and captures the decode graphs (`decode_graphs`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Callable

import torch

from localrun.engine import fallbacks as fb
from localrun.engine.config import EngineConfig, ModelConfig
from localrun.engine.kv.host import HostKVPool, default_host_cache_bytes
from localrun.engine.kv.pool import KVPool
from localrun.engine.layers.attention import check_kv_dtype, use_triton
from localrun.engine.models import build_model
from localrun.engine.models.registry import model_class
from localrun.engine.parallel import launch
from localrun.engine.parallel.group import TPGroup, check_shapes
from localrun.engine.runner import ModelRunner

if TYPE_CHECKING:
    from localrun.engine.engine import LLMEngine

log = logging.getLogger("localrun.engine")

CUDA_RESERVE_BYTES = 1 << 30  # CUDA: decode graphs and their logits buffer, cuBLAS workspaces, allocator slack
HOST_AUTO_POOL_MULTIPLE = 4  # the default host tier holds at most this many times the device KV pool


def kernel_names(cls: type, mcfg: ModelConfig, config: EngineConfig) -> tuple[str, ...]:
    """The Triton kernels a model of `cls` launches (the attention kernels, its pointwise ones, the
    sampler's, the one-row linear layer of float weights, and a mixture of experts' grouped GEMM)."""
    matmul = fb.MATMUL_KERNELS if config.weight_dtype == "auto" else ()
    moe = fb.MOE_KERNELS if mcfg.is_moe else ()
    names = fb.ATTENTION_KERNELS + tuple(cls.pointwise_kernels(mcfg)) + fb.SAMPLER_KERNELS + matmul + moe
    return tuple(dict.fromkeys(names))  # (a family may list fused_moe among its own kernels too)


class KernelTrials:
    """fallbacks.try_kernels for one load: run at once, or on a thread of its own while the
    weights load (CUDA), the reasons recorded until the engine exists to take them."""

    def __init__(self, kv_cfg: ModelConfig, config: EngineConfig, names: tuple[str, ...], background: bool) -> None:
        self.reasons: list[str] = []
        self.failed: frozenset[str] = frozenset()
        self.error: BaseException | None = None
        self.seconds = 0.0
        device = torch.device(config.device)
        self.names = names
        self.threads = min(len(names), os.cpu_count() or 1) if device.type == "cuda" else 1
        args = (kv_cfg, config.torch_dtype, config.kv_torch_dtype, config.page_size, device)
        self._thread = threading.Thread(target=self._run, args=args, name="localrun-kernel-trials", daemon=True)
        if background:
            self._thread.start()
        else:
            self._run(*args)

    def _run(self, *args) -> None:
        t = time.perf_counter()
        try:
            self.failed = fb.try_kernels(*args, self.reasons.append, names=self.names, threads=self.threads)
        except BaseException as exc:  # noqa: BLE001 - raised again in the loading thread
            self.error = exc
        self.seconds = time.perf_counter() - t

    def wait(self) -> None:
        if self._thread.ident is not None:
            self._thread.join()

    def result(self, record: Callable[[str], None], timings: dict) -> frozenset[str]:
        """The kernels that run their torch reference; each reason `record`ed."""
        t = time.perf_counter()
        self.wait()
        if self._thread.ident is not None:
            timings["kernels_wait_s"] = time.perf_counter() - t
        timings["kernels_s"] = self.seconds
        if self.error is not None:
            raise self.error
        for reason in self.reasons:
            record(reason)
        return self.failed


def make_engine(cls: type[LLMEngine], mcfg: ModelConfig, config: EngineConfig | None, fill, tokenizer=lambda: None,
                recipe: tuple | None = None, tp: TPGroup | None = None) -> LLMEngine:
    """Build the model (this rank's shard) and the engine (of class `cls`). With config.tensor_parallel
    > 1 and no `tp`, this is rank 0: it starts the other ranks, which build theirs from `recipe`."""
    config = config or EngineConfig()
    check_shapes(mcfg, config.tensor_parallel)
    if tp is None:
        tp = TPGroup()
        if config.tensor_parallel > 1:
            if recipe is None:
                raise ValueError("tensor_parallel > 1 needs weights every rank can read itself: load with "
                                 "from_gguf, from_safetensors or from_random")
            tp = launch.start(config.tensor_parallel, config.device, recipe, config, cls.from_recipe)
    try:
        timings = {}
        trials = None
        if config.is_cuda and tp.world == 1 and use_triton(config.device, config.use_triton):
            t = time.perf_counter()
            torch.zeros(1, device=config.device)  # the CUDA context, before a second thread uses it
            timings["cuda_init_s"] = time.perf_counter() - t
            check_kv_dtype(config.kv_torch_dtype, config.device, True)  # (before a kernel compiles for it)
            # the kernels' first compile (seconds with an empty Triton cache) runs beside the weights' load
            trials = KernelTrials(tp.local_config(mcfg), config, kernel_names(model_class(mcfg), mcfg, config),
                                  background=True)
        t = time.perf_counter()
        try:
            model = build_model(mcfg, config, tp)
            fill(model)
            if config.is_cuda:
                torch.cuda.synchronize()
        except BaseException:
            if trials is not None:
                trials.wait()  # not one kernel compiling behind the error
            raise
        timings["weights_s"] = time.perf_counter() - t
        return cls(model, mcfg, config, tokenizer() if tp.rank == 0 else None, timings, trials)
    except BaseException:
        if tp.rank == 0:
            tp.close()
        raise


def kv_budget(config: EngineConfig, device: torch.device, per_page: int, activations: int) -> int:
    """Bytes for the KV pool: as configured, else what the device has room for (CUDA), capped at
    what max_num_seqs full-length sequences can use."""
    cfg = config
    useful = (cfg.max_num_seqs * cfg.max_model_len // cfg.page_size + 1) * per_page
    if cfg.kv_memory_bytes is not None:
        return cfg.kv_memory_bytes
    if cfg.kv_cache_tokens is not None:
        return (-(-cfg.kv_cache_tokens // cfg.page_size) + 1) * per_page
    if device.type == "cuda":
        # what is in use now (weights, other processes) comes out of the fraction of the
        # total, and so do the profiled step's activations
        free, total = torch.cuda.mem_get_info(device)
        room = int(total * cfg.gpu_memory_fraction) - (total - free) - activations - CUDA_RESERVE_BYTES
        room = min(room, free - activations - CUDA_RESERVE_BYTES)
        log.info("KV budget: %.2f GiB (%.2f GiB free of %.2f GiB, step activations %.2f GiB, fraction %.2f)",
                 room / 2**30, free / 2**30, total / 2**30, activations / 2**30, cfg.gpu_memory_fraction)
        return min(useful, room)
    # CPU: room for four full-length sequences (preemption and the prefix cache cover the rest)
    return min(useful, 4 * (cfg.max_model_len // cfg.page_size + 1) * per_page)


def host_kv_pool(config: EngineConfig, pool: KVPool, tp: TPGroup) -> HostKVPool | None:
    """The prefix cache's host tier (None when its budget is 0 or under one page, and with
    tensor parallelism: the followers' pools would need the same copies)."""
    if tp.world > 1:
        return None
    budget = config.host_cache_bytes
    if budget is None:
        budget = min(default_host_cache_bytes(), HOST_AUTO_POOL_MULTIPLE * pool.nbytes)
    pages = HostKVPool.pages_for_budget(pool, budget)
    if pages < 1:
        return None
    host = HostKVPool(pool, pages)
    log.info("prefix cache host tier: %d pages (%.1f MiB, %s)", pages, host.nbytes / 2**20,
             "host RAM, staged through pinned buffers" if host.cuda else "host RAM")
    return host


def setup_graphs(runner: ModelRunner, capture: bool, fallback: Callable[[str], None]) -> float:
    """Decode graphs at every padded size; a size whose capture fails runs eagerly (a fallback)."""
    t = runner.setup_graphs(capture)
    by_reason: dict[str, list[int]] = {}
    for bs, why in sorted(runner.graphs.failed.items()):
        by_reason.setdefault(why, []).append(bs)
    for why, sizes in by_reason.items():
        fallback(f"decode batch {', '.join(map(str, sizes))}: eager, not a CUDA graph "
                 f"({' '.join(why.split())[:fb.REASON_CHARS]})")
    return t


def decode_graphs(config: EngineConfig, device: torch.device, triton: bool, runner: ModelRunner,
                  fallback: Callable[[str], None], timings: dict) -> bool:
    """Whether decode steps run at padded sizes as graphs (config.cuda_graphs; by default on CUDA
    with the Triton kernels), captured here on CUDA (eager on CPU); False when attention cannot
    be captured (a fallback)."""
    graphs = config.cuda_graphs
    if graphs is None:
        graphs = device.type == "cuda" and triton
    if graphs:
        capture = device.type == "cuda"
        if capture and not triton:
            raise ValueError("cuda_graphs=True needs the Triton kernels (use_triton); the torch reference "
                             "path syncs with the host")
        if capture and not runner.attn.graphable:
            graphs = False
            fallback("CUDA graphs off: attention runs a torch reference (it reads lengths on the host)")
        else:
            timings["graphs_s"] = setup_graphs(runner, capture, fallback)
    return graphs
