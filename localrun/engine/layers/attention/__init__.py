"""Paged attention: one backend interface and the choice of its implementation for a device.

base.AttentionBackend is the interface; triton_backend (Triton kernels) and torch_backend
(the torch references) implement it."""

from __future__ import annotations

import logging

import torch

from localrun.kernels import ops as kernels
from localrun.engine.kv.pool import KVPool, PageTable
from localrun.engine.layers.attention.base import (AttentionBackend, AttnMetadata, HostStep, StepBuffers,
                                                   padding_step)
from localrun.engine.layers.attention.torch_backend import TorchAttention
from localrun.engine.layers.attention.triton_backend import TritonAttention

log = logging.getLogger("localrun.engine")

__all__ = ["AttentionBackend", "AttnMetadata", "HostStep", "StepBuffers", "padding_step", "TorchAttention",
           "TritonAttention", "check_kv_dtype", "use_triton", "make_backend"]


def check_kv_dtype(kv_dtype: torch.dtype, device, triton: bool) -> None:
    """fp8 pages on the Triton path need a GPU that converts fp8 (compute capability 8.9+)."""
    dev = torch.device(device)
    if triton and kv_dtype == torch.float8_e4m3fn and dev.type == "cuda":
        cap = torch.cuda.get_device_capability(dev)
        if cap < (8, 9):
            raise ValueError(f"an fp8 KV cache needs a GPU of compute capability 8.9 or newer (Ada, Hopper); this "
                             f"one is {cap[0]}.{cap[1]}: use kv_cache_dtype int8 (LOCALRUN_KV_CACHE_TYPE=int8)")


def use_triton(device: str, use: bool | None) -> bool:
    """The Triton kernels on CUDA (use None or True, when Triton imports); on CPU only when asked
    (use True) under Triton's interpreter (TRITON_INTERPRET=1: tests); else the torch references."""
    if use is False:
        return False
    if not str(device).startswith("cuda"):
        return bool(use) and kernels.uses_triton(torch.empty(0))
    if not kernels.triton_available():
        if use:
            raise RuntimeError("use_triton=True but triton is not importable")
        log.warning("triton unavailable; using torch attention")
        return False
    return True


def make_backend(triton: bool, pool: KVPool, table: PageTable, buffers: StepBuffers,
                 refs: frozenset[str] = frozenset()) -> AttentionBackend:
    """The Triton backend (its kernels in `refs` run their torch reference) or the torch one."""
    return TritonAttention(pool, table, buffers, refs) if triton else TorchAttention(pool, table, buffers)
