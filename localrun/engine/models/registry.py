"""The model registry: each family's module registers its class; model_class picks one for a config.

The families register when localrun.engine.models is imported, which Python does before this
module (its package), so a caller of model_class always sees every family."""

from __future__ import annotations

from typing import Callable

import torch

from localrun.engine.config import EngineConfig, ModelConfig
from localrun.engine.layers.attention import use_triton
from localrun.engine.layers.ops import Ops

# (class, when(cfg)): a family claims the configs its `when` accepts; `when` None marks the
# default family (Llama), used for every config no other family claims
_FAMILIES: list[tuple[type[torch.nn.Module], Callable[[ModelConfig], bool] | None]] = []


def register(cls: type[torch.nn.Module], when: Callable[[ModelConfig], bool] | None = None) -> type[torch.nn.Module]:
    """Add a family: `cls(cfg, max_pos, dtype, device, ops, weight_dtype=..., tp=...)` builds it."""
    _FAMILIES.append((cls, when))
    return cls


def model_class(cfg: ModelConfig) -> type[torch.nn.Module]:
    """The model class for a config: the first family whose `when` accepts it, else the default."""
    for cls, when in _FAMILIES:
        if when is not None and when(cfg):
            return cls
    defaults = [cls for cls, when in _FAMILIES if when is None]
    if not defaults:
        raise RuntimeError("no default model family is registered")
    return defaults[0]


def build_model(mcfg: ModelConfig, config: EngineConfig, tp=None) -> torch.nn.Module:
    """The model of `mcfg`'s family (this rank's shard), allocated on the device, weights not yet filled."""
    ops = Ops(reference=not use_triton(config.device, config.use_triton))
    return model_class(mcfg)(mcfg, max(config.max_model_len, 1), config.torch_dtype, config.device, ops,
                             weight_dtype=config.weight_dtype, tp=tp)
