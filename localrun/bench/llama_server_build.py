"""llama.cpp's own ``llama-server``, built from the very llama.cpp that the installed llama-cpp-python vendors.

The benchmarks that compare localrun with llama-server (``bench llama-server``, ``bench typing --llama-server``)
and the tests that check agreement with it need the binary. :func:`ensure_llama_server` finds it:

1. ``LOCALRUN_LLAMA_SERVER`` (a path to a llama-server binary) when it is set;
2. else a build cached under the user cache directory (``~/.cache/localrun/llama-server/<version>-<machine>``),
   keyed by the installed llama-cpp-python version, reused when present;
3. else it builds one there: the pinned sdist (``pip download --no-deps --no-binary llama-cpp-python
   llama-cpp-python==<installed version>``, from PyPI or pip's cache; its build tools may come as wheels),
   unpacked, then cmake configure and ``cmake --build --target llama-server -j<cores>`` (a few minutes on a
   fast machine; about 13 CPU-minutes in all: 5.7 min on 2 idle cores, tens of minutes on busy ones).

A file lock keeps two processes from building at once (the second waits, then reuses the first's build).
Missing tools (cmake, a C and C++ compiler) are a :class:`MissingToolError` naming them.

Stdlib only at import (``localrun bench`` stays importable without the server stack).
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

CMAKE_FLAGS = ("-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
               "-DLLAMA_BUILD_SERVER=ON", "-DCMAKE_BUILD_TYPE=Release")
DOWNLOAD_TIMEOUT = 1800.0  # seconds: the sdist is ~75 MB
CONFIGURE_TIMEOUT = 600.0
BUILD_TIMEOUT = 3 * 3600.0  # a slow 2-core machine takes tens of minutes


class BuildError(Exception):
    """llama-server could not be found or built; the message says why and what to do."""


class MissingToolError(BuildError):
    """A tool the build needs (cmake, a C or C++ compiler) is not installed."""


def llama_cpp_python_version() -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version("llama-cpp-python")
    except importlib.metadata.PackageNotFoundError:
        raise BuildError("llama-cpp-python is not installed (pip install llama-cpp-python): llama-server is built "
                         "from the llama.cpp it vendors") from None


def cache_root() -> Path:
    try:
        import platformdirs

        return Path(platformdirs.user_cache_dir("localrun", appauthor=False)) / "llama-server"
    except ImportError:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return Path(base) / "localrun" / "llama-server"


def build_dir(version: str | None = None) -> Path:
    """Where the build for the installed llama-cpp-python (or ``version``) lives."""
    return cache_root() / f"{version or llama_cpp_python_version()}-{platform.machine() or 'unknown'}"


def missing_tools() -> list[str]:
    """The build tools that are absent: cmake, a C compiler, a C++ compiler (CC / CXX honoured)."""
    missing = []
    if shutil.which("cmake") is None:
        missing.append("cmake")
    cc = os.environ.get("CC")
    if not (shutil.which(cc) if cc else any(shutil.which(c) for c in ("cc", "gcc", "clang"))):
        missing.append("a C compiler (cc, gcc or clang)" if not cc else f"the C compiler CC={cc}")
    cxx = os.environ.get("CXX")
    if not (shutil.which(cxx) if cxx else any(shutil.which(c) for c in ("c++", "g++", "clang++"))):
        missing.append("a C++ compiler (c++, g++ or clang++)" if not cxx else f"the C++ compiler CXX={cxx}")
    return missing


def configured_binary() -> Path | None:
    """LOCALRUN_LLAMA_SERVER, checked (a BuildError when it names no executable file)."""
    from localrun.config import settings

    path = settings().llama_server
    if path is None:
        return None
    p = Path(path).expanduser()
    if not p.is_file() or not os.access(p, os.X_OK):
        raise BuildError(f"LOCALRUN_LLAMA_SERVER={path} is not an executable file (unset it to build llama-server "
                         "from the vendored llama.cpp)")
    return p


def ensure_llama_server(progress: Callable[[str], None] = print) -> Path:
    """The llama-server binary: LOCALRUN_LLAMA_SERVER, else the cached build, else a fresh build (see the module)."""
    given = configured_binary()
    if given is not None:
        return given
    version = llama_cpp_python_version()
    where = build_dir(version)
    binary = where / "build" / "bin" / "llama-server"
    done = where / "complete"
    if done.exists() and binary.exists():
        return binary
    where.mkdir(parents=True, exist_ok=True)
    with _Lock(where.parent / f"{where.name}.lock", progress):
        if done.exists() and binary.exists():  # another process built it while this one waited
            return binary
        missing = missing_tools()
        if missing:
            raise MissingToolError(f"building llama-server needs {' and '.join(missing)}: install "
                                   f"{'them' if len(missing) > 1 else 'it'} (e.g. apt-get install cmake g++), or set "
                                   "LOCALRUN_LLAMA_SERVER to a llama-server binary")
        t0 = time.monotonic()
        src = _sdist(version, where, progress)
        _build(src, where / "build", progress)
        if not binary.exists():
            raise BuildError(f"the build finished but {binary} is missing (log: {where / 'build.log'})")
        done.write_text(f"llama-cpp-python {version}\n")
        progress(f"llama-server built in {(time.monotonic() - t0) / 60:.1f} min: {binary}")
    return binary


class _Lock:
    """An exclusive flock on ``path`` (waits, saying so, when another process holds it)."""

    def __init__(self, path: Path, progress: Callable[[str], None]):
        self.path, self.progress, self.fd = path, progress, -1

    def __enter__(self) -> "_Lock":
        import fcntl

        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.progress(f"another process is building llama-server ({self.path}); waiting for it ...")
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc) -> None:
        import fcntl

        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


def _sdist(version: str, where: Path, progress: Callable[[str], None]) -> Path:
    """The unpacked llama-cpp-python sdist (downloaded with pip, unpacked once)."""
    import tarfile

    src = where / f"llama_cpp_python-{version}"
    if (src / "vendor" / "llama.cpp" / "CMakeLists.txt").exists():
        return src
    dl = where / "sdist"
    tarballs = sorted(dl.glob("llama_cpp_python-*.tar.gz")) if dl.exists() else []
    if not tarballs:
        progress(f"downloading the llama-cpp-python {version} source (pip download; ~75 MB) ...")
        dl.mkdir(parents=True, exist_ok=True)
        _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-python", "-d", str(dl),
              f"llama-cpp-python=={version}"], where / "download.log", DOWNLOAD_TIMEOUT, progress)
        tarballs = sorted(dl.glob("llama_cpp_python-*.tar.gz"))
        if not tarballs:
            raise BuildError(f"pip download left no llama_cpp_python-*.tar.gz in {dl}")
    progress(f"unpacking {tarballs[0].name} ...")
    tmp = where / "unpack.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    with tarfile.open(tarballs[0]) as tar:
        tar.extractall(tmp, filter="data")
    inner = [p for p in tmp.iterdir() if p.is_dir()]
    if len(inner) != 1 or not (inner[0] / "vendor" / "llama.cpp" / "CMakeLists.txt").exists():
        raise BuildError(f"{tarballs[0]} holds no vendor/llama.cpp")
    shutil.rmtree(src, ignore_errors=True)
    inner[0].rename(src)
    shutil.rmtree(tmp, ignore_errors=True)
    return src


def _build(src: Path, build: Path, progress: Callable[[str], None]) -> None:
    cores = os.cpu_count() or 2
    log = build.parent / "build.log"
    progress(f"configuring llama.cpp (cmake; log: {log}) ...")
    argv = ["cmake", "-S", str(src / "vendor" / "llama.cpp"), "-B", str(build), *CMAKE_FLAGS]
    if shutil.which("ninja") and not (build / "CMakeCache.txt").exists():
        argv += ["-G", "Ninja"]
    _run(argv, log, CONFIGURE_TIMEOUT, progress)
    progress(f"building llama-server with {cores} jobs (a few minutes; tens on 2 cores) ...")
    _run(["cmake", "--build", str(build), "--target", "llama-server", "-j", str(cores)], log, BUILD_TIMEOUT, progress,
         steps=True)


_STEP = re.compile(r"^\[\s*(\d+)%\]|^\[(\d+)/(\d+)\]")  # make's "[ 45%]" or ninja's "[12/180]"


def _run(argv: list[str], log: Path, timeout: float, progress: Callable[[str], None], steps: bool = False) -> None:
    """Run one build step, its output appended to ``log``; progress every 10% of a build; bounded."""
    deadline = time.monotonic() + timeout
    last = -10
    with open(log, "ab") as f:
        f.write(f"$ {' '.join(argv)}\n".encode())
        f.flush()
        try:
            proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        except OSError as exc:
            raise BuildError(f"{argv[0]} could not start: {exc}") from None
        assert proc.stdout is not None
        try:
            for raw in proc.stdout:
                f.write(raw)
                if time.monotonic() > deadline:
                    raise subprocess.TimeoutExpired(argv, timeout)
                m = _STEP.match(raw.decode("utf-8", "replace")) if steps else None
                if m:
                    pct = int(m.group(1)) if m.group(1) else 100 * int(m.group(2)) // max(1, int(m.group(3)))
                    if pct >= last + 10:
                        last = pct - pct % 10
                        progress(f"  llama-server build {pct}%")
            proc.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise BuildError(f"{' '.join(argv[:3])} ... took more than {timeout / 60:.0f} min (log: {log})") from None
        except BaseException:
            proc.kill()
            proc.wait()
            raise
    if proc.returncode:
        tail = log.read_bytes()[-3000:].decode("utf-8", "replace")
        raise BuildError(f"{' '.join(argv[:3])} ... failed (exit {proc.returncode}; log: {log}):\n{tail}")


def main(argv: list[str] | None = None) -> int:
    """`localrun bench build-llama-server`: print the binary's path (building it when needed)."""
    try:
        path = ensure_llama_server(progress=lambda s: print(s, file=sys.stderr, flush=True))
    except BuildError as exc:
        print(f"localrun bench build-llama-server: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0
