"""Quantizing a GGUF model at create time, as ``ollama create --quantize q4_K_M`` does: a model in F16, BF16 or F32
becomes a smaller one (Q8_0, the K-quants, the legacy types) through llama.cpp's own quantizer
(``llama_model_quantize``, what its ``llama-quantize`` tool runs), so the file equals llama-quantize's.

The quantizer runs in a child process (``python -m localrun.library.quantize SRC DST FTYPE THREADS``): it takes
the machine's cores for minutes on a big model, a client that goes away (or a daemon that stops) kills it and
its partial file goes, and a crash in it is an error on the create, never a dead daemon. Progress is the output
file's size against the size the type gives the source's weights.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from localrun.errors import InvalidRequest, LocalrunError

# the types a create may ask for: name -> (llama_ftype, bits per weight for the progress estimate). The i-quants
# below 4 bits need an importance matrix, which a create has no way to give, so they are not offered
TYPES = {"Q8_0": (7, 8.5), "Q6_K": (18, 6.56), "Q5_K_M": (17, 5.69), "Q5_K_S": (16, 5.54), "Q5_1": (9, 6.0),
         "Q5_0": (8, 5.5), "Q4_K_M": (15, 4.89), "Q4_K_S": (14, 4.58), "Q4_1": (3, 5.0), "Q4_0": (2, 4.5),
         "IQ4_NL": (25, 4.5), "IQ4_XS": (30, 4.25), "Q3_K_L": (13, 4.27), "Q3_K_M": (12, 3.91), "Q3_K_S": (11, 3.5),
         "Q2_K": (10, 3.35)}
SOURCE_TYPES = {"F16": 16, "BF16": 16, "F32": 32}  # what can be quantized, with its bits per weight
POLL_S = 0.25


def quant_type(value: object) -> str:
    """The canonical name of a requested type ('q4_k_m' -> 'Q4_K_M'); InvalidRequest listing them otherwise."""
    name = value.strip().upper() if isinstance(value, str) else ""
    if name not in TYPES:
        raise InvalidRequest(f"'quantize' must be one of {', '.join(TYPES)} (e.g. q4_K_M), not {repr(value)[:40]}")
    return name


def check_source(file_type: str, target: str) -> None:
    """InvalidRequest unless a model of `file_type` can be quantized to `target` (as Ollama: F16 and F32 only,
    and BF16 here too)."""
    if file_type.upper() not in SOURCE_TYPES:
        raise InvalidRequest(f"quantizing to {target} needs a model in F16, BF16 or F32; this one is {file_type}: "
                             "create it from the unquantized GGUF (or without --quantize)")


def expected_bytes(size: int, file_type: str, target: str) -> int:
    """About how large a model file of `size` bytes in `file_type` (F16, BF16, F32) is once quantized to `target`."""
    return max(1, int(size * TYPES[target][1] / SOURCE_TYPES[file_type.upper()]))


def quantize(src: Path, dst: Path, target: str, threads: int, total: int, progress: Callable[[int], None],
             cancelled: Callable[[], bool]) -> None:
    """Quantize `src` into `dst` (a path on the library's disk) in a child process; progress(bytes written, at most
    `total`, the expected size: expected_bytes) every POLL_S. LocalrunError with llama.cpp's last words when it
    fails; Cancelled once `cancelled()` is true (the child killed)."""
    from localrun.library.model import Cancelled

    ftype = TYPES[target][0]
    cmd = [sys.executable, "-m", "localrun.library.quantize", str(src), str(dst), str(ftype), str(threads),
           str(os.getpid())]
    # llama.cpp logs a line per tensor: to a file (a pipe nobody reads until the end would fill and stall it)
    with tempfile.TemporaryFile() as log, subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log,
                                                           stdin=subprocess.DEVNULL) as proc:
        try:
            while proc.poll() is None:
                if cancelled():
                    raise Cancelled("create cancelled while quantizing; nothing was stored")
                with contextlib.suppress(OSError):
                    progress(min(dst.stat().st_size, total - 1))
                time.sleep(POLL_S)
        finally:
            if proc.poll() is None:  # cancelled (or the progress callback raised): the child goes at once
                proc.kill()
                proc.wait()
        if proc.returncode != 0:
            log.seek(max(0, log.seek(0, 2) - 4096))
            last = " ".join(log.read().decode("utf-8", "replace").strip().splitlines()[-3:])[-600:]
            raise LocalrunError(f"quantizing to {target} failed (llama.cpp, exit {proc.returncode}): {last}",
                                status=500, code="quantize_failed")
    progress(total)


def _die_with_parent(parent: int) -> None:
    """Linux: this process is killed when the daemon's thread that started it goes (a daemon killed outright
    leaves no quantizer running on; its temp file goes at the next start)."""
    try:
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the daemon's cancel still kills it
        return
    if os.getppid() != parent:  # the parent went before the prctl
        os._exit(1)


def _main(argv: list[str]) -> int:
    src, dst, ftype, threads = argv[1], argv[2], int(argv[3]), int(argv[4])
    if len(argv) > 5:
        _die_with_parent(int(argv[5]))
    import llama_cpp

    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread = ftype, threads
    return int(llama_cpp.llama_model_quantize(src.encode(), dst.encode(), params))


if __name__ == "__main__":
    sys.exit(_main(sys.argv))
