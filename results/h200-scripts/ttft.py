"""TTFT at 512 tokens on the 8B shape: wall time vs the GPU's kernel time and the host's launch time (one profiled request)."""
import asyncio, os, random, statistics, time
import torch
from localrun.engine import EngineConfig, LLMEngine, SamplingParams

OUT = os.environ.get("OUT", "/tmp")
t = time.perf_counter()
DEV = os.environ.get("DEV", "cuda")
if DEV == "cuda":
    eng = LLMEngine.from_random("llama-3.1-8b", EngineConfig(device="cuda", dtype="bfloat16", gpu_memory_fraction=0.8))
else:
    eng = LLMEngine.from_random("tiny", EngineConfig(device="cpu", kv_cache_tokens=4096, max_model_len=2048))
print("build", round(time.perf_counter() - t, 2), {k: round(v, 2) for k, v in eng.timings.items()}, flush=True)
rng = random.Random(7)
V = eng.model_config.vocab_size

def prompt(n=512 if DEV == 'cuda' else 32):
    return [rng.randrange(1000, V) for _ in range(n)]

async def one(p):
    t = time.perf_counter()
    s = eng.add_request(p, SamplingParams(temperature=1.0, max_tokens=1, ignore_eos=True))
    async for d in s:
        if d.token_ids:
            return (time.perf_counter() - t) * 1000

async def main():
    eng.start()
    try:
        ms = [await one(prompt()) for _ in range(12)]
        print("ttft ms (online loop):", [round(x, 1) for x in ms], "p50", round(statistics.median(ms[2:]), 2), flush=True)
    finally:
        eng.shutdown()

asyncio.run(main())
# the same request through generate() in this thread: its host time in launch vs the wall time
params = SamplingParams(temperature=1.0, max_tokens=1, ignore_eos=True)
launch_t = []
orig = eng.runner.launch
def timed_launch(b):
    t = time.perf_counter(); h = orig(b); launch_t.append(time.perf_counter() - t); return h
eng.runner.launch = timed_launch
walls = []
for _ in range(6):
    t = time.perf_counter(); eng.generate([prompt()], params); walls.append((time.perf_counter() - t) * 1000)
print("generate() wall ms", [round(x, 1) for x in walls], "launch host ms", [round(x * 1000, 1) for x in launch_t], flush=True)
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
    eng.generate([prompt()], params)
ev = prof.events()
k = sorted([e for e in ev if e.device_type == torch.autograd.DeviceType.CUDA], key=lambda e: e.time_range.start)
if k:
    busy = sum(e.time_range.elapsed_us() for e in k)
    span = k[-1].time_range.end - k[0].time_range.start
    print(f"GPU kernels: {len(k)}, busy {busy/1000:.2f} ms over a span of {span/1000:.2f} ms", flush=True)
ka = prof.key_averages()
rows = sorted(ka, key=lambda e: -getattr(e, "self_device_time_total", 0))[:14]
for e in rows:
    print(f"  dev {getattr(e,'self_device_time_total',0)/1000:7.2f} ms  cpu {e.self_cpu_time_total/1000:7.2f} ms {e.count:5d}x {e.key[:90]}")
rows = sorted(ka, key=lambda e: -e.self_cpu_time_total)[:14]
print("by host time:")
for e in rows:
    print(f"  cpu {e.self_cpu_time_total/1000:7.2f} ms  dev {getattr(e,'self_device_time_total',0)/1000:7.2f} ms {e.count:5d}x {e.key[:90]}")
prof.export_chrome_trace(f"{OUT}/ttft-trace.json")
os.system(f"gzip -f {OUT}/ttft-trace.json")
