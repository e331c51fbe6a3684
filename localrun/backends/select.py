"""Which backend runs a model, and why.

``auto``: localrun's native engine on NVIDIA GPUs of compute capability 8.0 or newer
(when ``localrun.backends.native`` imports), else llama.cpp (Metal on Apple silicon,
partial CUDA offload on consumer GPUs, CPU threads otherwise). Safetensors models need
the native engine (llama.cpp runs GGUF only). A quantized GGUF (Q4_K_M, Q8_0, ...) is an
exception on such a GPU: the native engine would dequantize it to bfloat16 (an 8B Q4_K_M
file of 4.9 GB becomes ~16 GB), so it goes to llama.cpp when that would not fit the GPU's
free memory, or when llama.cpp's build can offload to the GPU (it then decodes from the
quantized weights, ~3x fewer bytes per token than bfloat16). A GGUF of an architecture the
native engine does not run (localrun.archs) goes to llama.cpp; a safetensors model of one is
refused with a clear error. With ``LOCALRUN_NATIVE_ON_CPU=1`` and no CUDA GPU, ``auto`` runs a
GGUF of an architecture the native engine supports on the native engine (torch on the CPU). The
reason is a sentence users see in ``localrun ps`` / ``/api/ps`` and in the log.

When ``auto`` chose the native engine for a GGUF model and its load fails, the model manager
loads it with llama.cpp instead (``fallback_reason``); ``LOCALRUN_BACKEND=native`` reports the error.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from types import ModuleType

from localrun.archs import NATIVE_ARCHS, is_native, unsupported_message
from localrun.errors import BackendError

log = logging.getLogger("localrun.select")


@dataclass(frozen=True)
class GPU:
    name: str
    capability: tuple[int, int]
    free_bytes: int
    total_bytes: int


@dataclass(frozen=True)
class BackendChoice:
    backend: str  # "llamacpp" | "native"
    reason: str


UNQUANTIZED = {"F32", "F16", "BF16"}  # GGUF file types the native engine loads without growing them
NATIVE_HEADROOM_BYTES = 2 << 30  # beyond the weights: a KV cache and activations worth having


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def _quantized_gguf_choice(gpu: GPU, info, llamacpp_gpu: bool | None) -> BackendChoice | None:
    """llama.cpp for a quantized GGUF that bfloat16 would not fit, or that llama.cpp's GPU build
    decodes faster; None: the native engine is fine (unquantized, or unknown)."""
    file_type = str(getattr(info, "file_type", "") or "").upper()
    params = int(getattr(info, "parameter_count", 0) or 0)
    if not file_type or file_type in UNQUANTIZED or file_type == "UNKNOWN" or not params:
        return None
    size = int(getattr(info, "tensor_bytes", 0) or 0)
    bf16 = 2 * params
    what = f"a {file_type} GGUF ({_gib(size)}) would be {_gib(bf16)} as bfloat16 on the native engine"
    if bf16 + NATIVE_HEADROOM_BYTES > gpu.free_bytes:
        return BackendChoice("llamacpp", f"llama.cpp: {what}, more than CUDA GPU {gpu.name} has free "
                                  f"({_gib(gpu.free_bytes)})")
    if llamacpp_gpu is None:
        llamacpp_gpu = llamacpp_build().gpu_offload
    if llamacpp_gpu:
        return BackendChoice("llamacpp", f"llama.cpp on CUDA GPU {gpu.name}: {what}; llama.cpp decodes from the "
                                  f"quantized weights ({bf16 / max(size, 1):.1f}x fewer bytes per token)")
    return None


def cuda_gpu() -> GPU | None:
    """The first CUDA GPU (free memory read fresh), or None.

    Asked of nvidia-smi first, so the daemon never creates a CUDA context of its own (that
    would hold VRAM in the daemon; the runner processes own the GPU). torch is the fallback
    where nvidia-smi is missing."""
    gpu = _nvidia_smi_gpu()
    if gpu is not None:
        return gpu
    if importlib.util.find_spec("torch") is None:
        return None
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        free, total = torch.cuda.mem_get_info(0)
        return GPU(torch.cuda.get_device_name(0), tuple(torch.cuda.get_device_capability(0)), int(free), int(total))
    except Exception as exc:  # broken driver etc.: run on CPU and say so in the log
        log.warning("CUDA probe failed (%s); treating this machine as CPU-only", exc)
        return None


def local_cuda_gpu() -> GPU | None:
    """cuda_gpu(), probed only where an NVIDIA driver exists, so CPU machines never import torch."""
    if sys.platform.startswith("linux") and not (os.path.exists("/dev/nvidiactl") or shutil.which("nvidia-smi")):
        return None
    if sys.platform == "darwin":
        return None
    return cuda_gpu()


def _nvidia_smi_gpu() -> GPU | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--query-gpu=name,compute_cap,memory.free,memory.total",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10)
        name, cap, free, total = [x.strip() for x in out.stdout.splitlines()[0].split(",")]
        major, minor = cap.split(".")
        return GPU(name, (int(major), int(minor)), int(float(free)) * 2**20, int(float(total)) * 2**20)
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as exc:
        log.info("nvidia-smi gave no usable answer (%s); asking torch", exc)
        return None


# The one documented way to get a llama.cpp that runs on NVIDIA GPUs from pip (the README says the same)
LLAMACPP_CUDA_INSTALL = ('CMAKE_ARGS="-DGGML_CUDA=on" pip install --force-reinstall --no-cache-dir '
                         'llama-cpp-python')


@dataclass(frozen=True)
class LlamaCppBuild:
    installed: bool
    gpu_offload: bool  # llama_supports_gpu_offload(): CUDA, Metal, Vulkan, ...
    system_info: str = ""  # llama_print_system_info(): the backends and CPU features it was built with

    @property
    def summary(self) -> str:
        if not self.installed:
            return "not installed"
        gpus = [b for b in ("CUDA", "Metal", "Vulkan", "HIP", "SYCL") if b.lower() in self.system_info.lower()]
        return ("GPU offload: " + (", ".join(gpus) or "yes")) if self.gpu_offload else "CPU only (no GPU offload)"


_PROBE = ("import json, llama_cpp; print(json.dumps({'gpu': bool(llama_cpp.llama_supports_gpu_offload()), "
          "'info': llama_cpp.llama_print_system_info().decode('utf-8', 'replace')}))")


@lru_cache(maxsize=1)
def llamacpp_build() -> LlamaCppBuild:
    """What the installed llama-cpp-python was built to do, asked in a child process (cached): loading
    a CUDA build's libraries initialises the CUDA driver, which the daemon leaves to its runners."""
    if importlib.util.find_spec("llama_cpp") is None:
        return LlamaCppBuild(False, False)
    try:
        out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=60)
        d = json.loads(out.stdout.strip().splitlines()[-1])
        return LlamaCppBuild(True, bool(d["gpu"]), str(d["info"]).strip())
    except (OSError, subprocess.SubprocessError, ValueError, IndexError, KeyError) as exc:
        log.warning("could not ask llama.cpp what its build supports (%s); assuming CPU only", exc)
        return LlamaCppBuild(True, False)


def llamacpp_gpu_advice(gpu: "GPU | None", build: LlamaCppBuild) -> str | None:
    """The warning `serve` prints when an NVIDIA GPU is here but llama.cpp cannot use it (None otherwise)."""
    if gpu is None or not build.installed or build.gpu_offload:
        return None
    return (f"an NVIDIA GPU is present ({gpu.name}) but the installed llama-cpp-python is built for CPU only, "
            f"so GGUF models on llama.cpp run on the CPU; for a CUDA build run: {LLAMACPP_CUDA_INSTALL}")


def is_apple_silicon() -> bool:
    return sys.platform == "darwin" and platform.machine() == "arm64"


@lru_cache(maxsize=1)
def native_import_error() -> str | None:
    """None when localrun.backends.native imports, else why not (cached)."""
    try:
        importlib.import_module("localrun.backends.native")
        return None
    except Exception as exc:  # ImportError, or a broken optional dependency
        return f"{type(exc).__name__}: {exc}"


def model_architecture(fmt: str, weights: str | Path | None, info=None) -> str | None:
    """The model's architecture name (GGUF general.architecture, or a safetensors model's
    config.json model_type), None when unknown. Reads no weights."""
    arch = getattr(info, "architecture", None)
    if arch or fmt == "gguf" or weights is None:
        return str(arch) if arch else None
    try:
        cfg = json.loads((Path(weights) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}
    arch = cfg.get("model_type") or text.get("model_type")
    return str(arch) if arch else None


def choose(setting: str, fmt: str = "gguf", gpu: GPU | None = None, info=None,
           llamacpp_gpu: bool | None = None, arch: str | None = None, vision: bool = False,
           native_on_cpu: bool = False, pooled: bool = False) -> BackendChoice:
    """Pick a backend for a model of format `fmt` under LOCALRUN_BACKEND=`setting`.

    info: the GGUF header facts (localrun.library's GGUFInfo: file_type, parameter_count,
    tensor_bytes, architecture) of a GGUF model; without them a GGUF on a capable GPU goes to
    the native engine. arch: the model's architecture (default: info's; see
    model_architecture). llamacpp_gpu: whether llama.cpp's build offloads to GPUs (None: ask it).
    vision: the model has a vision projector (only llama.cpp runs one). native_on_cpu
    (LOCALRUN_NATIVE_ON_CPU): auto without a CUDA GPU picks the native engine for a GGUF it runs. pooled:
    an embedding model or a reranker, which only llama.cpp runs (whatever the setting). (A LoRA adapter
    changes nothing here: llama.cpp applies it as it loads the model, the native engine merges it into the
    weights.)"""
    if pooled and fmt == "gguf":
        return BackendChoice("llamacpp", "llama.cpp: an embedding model or a reranker, which only llama.cpp pools")
    arch = arch or getattr(info, "architecture", None)
    foreign = bool(arch) and not is_native(arch)  # an architecture the native engine does not run
    if setting == "native" and foreign:
        raise BackendError(f"LOCALRUN_BACKEND=native: {unsupported_message(arch, 'architecture')}"
                           + ("" if fmt == "gguf" else "; a safetensors model needs the native engine: import a "
                              "GGUF of it instead"))
    if setting == "native":
        err = native_import_error()
        if err:
            raise BackendError(f"LOCALRUN_BACKEND=native but the native engine cannot be imported ({err}); "
                               "install localrun[native] or set LOCALRUN_BACKEND=auto")
        where = f"CUDA GPU {gpu.name}" if gpu else "CPU (torch reference path)"
        return BackendChoice("native", f"native engine on {where}: LOCALRUN_BACKEND=native")
    if setting == "llamacpp":
        if fmt != "gguf":
            raise BackendError("LOCALRUN_BACKEND=llamacpp runs GGUF files only; this model is safetensors "
                               "(set LOCALRUN_BACKEND=auto or native)")
        return BackendChoice("llamacpp", "llama.cpp: LOCALRUN_BACKEND=llamacpp")
    # auto (the native engine is imported only where it could be chosen: it pulls in torch)
    if fmt != "gguf" and foreign:
        raise BackendError(f"{unsupported_message(arch, 'architecture')}; safetensors models run only on the "
                           "native engine, so import a GGUF of this model for llama.cpp")
    if fmt != "gguf":
        err = native_import_error()
        if err:
            raise BackendError(f"safetensors models need the native engine, which cannot be imported ({err}); "
                               "install localrun[native] or import a GGUF instead")
        return BackendChoice("native", "native engine: safetensors models run only on the native engine")
    if vision:
        return BackendChoice("llamacpp", "llama.cpp: the model has a vision projector, which only llama.cpp runs")
    if gpu is not None and gpu.capability >= (8, 0) and foreign:
        return BackendChoice("llamacpp", f"llama.cpp: the native engine does not run architecture {arch!r} "
                                  f"(it runs {', '.join(NATIVE_ARCHS)})")
    if gpu is not None and gpu.capability >= (8, 0):
        quantized = _quantized_gguf_choice(gpu, info, llamacpp_gpu) if info is not None else None
        if quantized is not None:
            return quantized
        err = native_import_error()
        if err is None:
            return BackendChoice("native", f"native engine: CUDA GPU {gpu.name} has compute capability "
                                    f"{gpu.capability[0]}.{gpu.capability[1]} (>= 8.0)")
        return BackendChoice("llamacpp", f"llama.cpp: CUDA GPU {gpu.name} could run the native engine but it "
                                  f"does not import ({err})")
    if gpu is not None:
        return BackendChoice("llamacpp", f"llama.cpp: CUDA GPU {gpu.name} has compute capability "
                                  f"{gpu.capability[0]}.{gpu.capability[1]} (< 8.0 for the native engine)")
    if native_on_cpu and gpu is None and not foreign:
        err = native_import_error()
        if err is None:
            return BackendChoice("native", "native engine on CPU (torch reference path): LOCALRUN_NATIVE_ON_CPU=1")
        return BackendChoice("llamacpp", f"llama.cpp on CPU: LOCALRUN_NATIVE_ON_CPU=1 but the native engine does not "
                                  f"import ({err})")
    if is_apple_silicon():
        return BackendChoice("llamacpp", "llama.cpp with Metal: Apple silicon")
    return BackendChoice("llamacpp", "llama.cpp on CPU: no CUDA GPU found")


def fallback_reason(error: str) -> str:
    """What ps shows when auto's native choice failed to load and llama.cpp runs the model instead."""
    return f"native engine failed to load: {error}; running on llama.cpp"


def backend_module(name: str) -> ModuleType:
    """The module exposing load(spec) and estimate_memory(spec) for a backend name."""
    if name == "llamacpp":
        if importlib.util.find_spec("llama_cpp") is None:
            raise BackendError("llama-cpp-python is not installed: pip install llama-cpp-python")
        return importlib.import_module("localrun.backends.llamacpp")
    if name == "native":
        return importlib.import_module("localrun.backends.native")
    raise BackendError(f"unknown backend {name!r}")


__all__ = ["GPU", "BackendChoice", "choose", "model_architecture", "cuda_gpu", "backend_module", "is_apple_silicon",
           "native_import_error", "fallback_reason", "llamacpp_build", "llamacpp_gpu_advice", "LLAMACPP_CUDA_INSTALL", "LlamaCppBuild"]
