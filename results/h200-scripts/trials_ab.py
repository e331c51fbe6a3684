"""The kernel trials with an empty Triton cache: serial (threads=1) vs threaded, each in a fresh cache dir (run in a fresh process each)."""
import os, sys, tempfile, time
threads = int(sys.argv[1])
os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix=f"tc{threads}-")
import torch
from localrun.engine import fallbacks as fb
from localrun.engine.models.shapes import get_shape
torch.zeros(1, device="cuda")
cfg = get_shape("llama-3.1-8b")
names = fb.ATTENTION_KERNELS + ("fused_add_rmsnorm", "apply_rope", "silu_and_mul")
seen = []
t = time.perf_counter()
refs = fb.try_kernels(cfg, torch.bfloat16, torch.bfloat16, 16, torch.device("cuda"), seen.append, names=names, threads=threads)
print(f"trials threads={threads}: {time.perf_counter() - t:.2f} s, refs {sorted(refs)}, {seen}", flush=True)
