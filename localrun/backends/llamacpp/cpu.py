"""How a llama.cpp load uses the CPU: its compute threads, and whether its extra buffer types are on.

The extra buffer types are AMX and the repacked CPU weights; on a CPU with AMX, AMX itself is denied to
llama.cpp (``amx.deny_amx``) so the repacked weights can stay.
"""

from __future__ import annotations

import os

from localrun.backends.base import LoadSpec
from localrun.backends.llamacpp.amx import cpu_has_amx, deny_amx


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
    localrun.backends.llamacpp.amx: llama-cpp-python 0.3.36's AMX path crashes on the first token there,
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
