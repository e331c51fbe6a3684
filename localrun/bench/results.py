"""Where bench results go: one JSON object per line, with enough context to rerun and
compare (machine, device, versions, git commit). Also the small shared helpers every
mode uses (peak-memory sampling, percentiles, the rich table)."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

DEFAULT_OUT = Path("results") / "bench.jsonl"


def _version(mod: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(mod)
    except Exception:
        return None


def git_commit() -> str | None:
    """The commit of the localrun checkout this code runs from (None outside git)."""
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10
        )
        if out.returncode != 0:
            return None
        commit = out.stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "--", "."],
            cwd=here.parent, capture_output=True, text=True, timeout=10,
        )
        return commit + ("-dirty" if dirty.returncode == 0 and dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def device_name() -> str:
    torch = sys.modules.get("torch")
    if torch is None:
        try:
            import torch  # noqa: F811
        except ImportError:
            return "cpu"
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return "cpu"


def _loadavg() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)  # a busy machine explains slow numbers
    except (OSError, AttributeError):
        return None


def environment() -> dict[str, Any]:
    """Machine, device and versions, recorded with every result."""
    import psutil

    import localrun

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "machine": {
            "cpu": cpu,
            "cores": psutil.cpu_count(logical=True),
            "physical_cores": psutil.cpu_count(logical=False),
            "ram_bytes": psutil.virtual_memory().total,
            "load_avg_1m": _loadavg(),
            "os": platform.platform(),
        },
        "device": device_name(),
        "versions": {
            "python": platform.python_version(),
            "torch": _version("torch"),
            "transformers": _version("transformers"),
            "localrun": getattr(localrun, "__version__", None),
        },
        "git_commit": git_commit(),
    }


def append_result(result: dict[str, Any], out: Path | str | None = None) -> Path:
    """Append ``result`` (plus timestamp and environment) as one JSON line; returns the path."""
    path = Path(out) if out else DEFAULT_OUT
    record = {"time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), **result}
    record.setdefault("env", environment())
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record, default=str) + "\n")
    return path


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]; None if empty."""
    if not values:
        return None
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


class PeakMemory:
    """Peak process RSS (sampled every ``interval`` s on a thread) and
    torch.cuda.max_memory_allocated over a ``with`` block."""

    def __init__(self, interval: float = 0.02):
        import psutil

        self._proc = psutil.Process(os.getpid())
        self.interval = interval
        self.peak_rss = 0
        self.cuda_peak: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak_rss = max(self.peak_rss, self._proc.memory_info().rss)
            self._stop.wait(self.interval)

    def __enter__(self) -> "PeakMemory":
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        self.peak_rss = self._proc.memory_info().rss
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join()
        self.peak_rss = max(self.peak_rss, self._proc.memory_info().rss)
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available():
            self.cuda_peak = int(torch.cuda.max_memory_allocated())

    def as_dict(self) -> dict[str, int | None]:
        return {"peak_rss_bytes": self.peak_rss, "cuda_max_memory_allocated_bytes": self.cuda_peak}


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def fmt_num(v: Any, digits: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.{digits}f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def print_table(title: str, columns: list[str], rows: list[list[Any]], console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for i, c in enumerate(columns):
        table.add_column(c, justify="left" if i == 0 else "right", overflow="fold", min_width=12 if i == 0 else None)
    for row in rows:
        table.add_row(*[fmt_num(v) if not isinstance(v, str) else v for v in row])
    (console or Console()).print(table)


def progress_bar(description: str, total: int, console=None):
    """A rich progress bar (context manager); returns (progress, callback(done, total))."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    prog = Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
        TimeElapsedColumn(), TimeRemainingColumn(), console=console, transient=True,
    )
    task = prog.add_task(description, total=total)

    def update(done: int, total_: int | None = None) -> None:
        if total_ is not None:
            prog.update(task, total=total_)
        prog.update(task, completed=done)

    return prog, update


def now() -> float:
    return time.perf_counter()
