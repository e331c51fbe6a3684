"""Device run 1b (session 37, H100): where the batch-1 decode step's 6.4 ms go, and whether a Triton
GEMV (kernels/matvec.py) beats cuBLAS for the decode linears at 1-8 rows.
1. each linear of the 8B shape at M = 1, 2, 4, 8: cuBLAS (F.linear) against the GEMV over a config sweep,
   timed as CUDA-graph replays over enough weight copies that L2 (50 MB) holds none of them;
2. ITL (gpu_check.itl) with cuBLAS / with the best GEMV configs, alternated, graphs recaptured each time;
3. the bs=1 graph's replay time and its kernels by name (torch.profiler), and a profile of 40 live decode steps.
Writes $OUT/itl-diag.json as it goes."""
import gc, json, os, statistics, sys, time
import torch
import torch.nn.functional as F
T0 = time.time()
LIMIT = float(os.environ.get("DIAG_LIMIT_S", "330"))
OUT = os.environ.get("OUT", "/tmp")
from localrun.kernels import matvec as GV
res = {"device": torch.cuda.get_device_name(0)}
def dump():
    res["elapsed_s"] = round(time.time() - T0, 1)
    json.dump(res, open(f"{OUT}/itl-diag.json", "w"), indent=1)
def left():
    return LIMIT - (time.time() - T0)

def timed(fn, calls):
    """us per call: `calls` calls captured in one CUDA graph, replayed; median of 7 replays."""
    fn(0); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            fn(i)
    g.replay(); torch.cuda.synchronize()
    ts = []
    for _ in range(7):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); b.synchronize()
        ts.append(a.elapsed_time(b) * 1000 / calls)
    del g
    return statistics.median(ts)

dev = "cuda"
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336), "lm_head": (128256, 4096)}
SWEEP = [(bn, bk, nw) for bn in (1, 2, 4, 8, 16) for bk in (512, 1024, 2048) for nw in (4, 8)
         if bn * bk // (32 * nw) <= 64] + [(1, 1024, 2), (2, 512, 2), (4, 256, 2)]
best = {}
micro = {}
for name, (N, K) in SHAPES.items():
    copies = max(1, -(-300_000_000 // (N * K * 2)))
    ws = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    calls = copies * max(1, 24 // copies)
    gb = N * K * 2 / 1e9
    row = {}
    for M in (1, 2, 4, 8):
        if left() < 200:
            break
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        ref = F.linear(x, ws[0])
        cu = timed(lambda i: F.linear(x, ws[i % copies]), calls)
        cand = SWEEP if M == 1 else [c for c in best.get((name, 1), []) if c[0] * c[1] * M // (32 * c[2]) <= 128][:4]
        tri = []
        for c in cand:
            try:
                y = GV.gemv(x, ws[0], cfg=c)
                err = ((y.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
                us = timed(lambda i, c=c: GV.gemv(x, ws[i % copies], cfg=c), calls)
                tri.append((us, c, err))
            except Exception as e:  # noqa: BLE001
                tri.append((float("inf"), c, repr(e)[:120]))
        tri.sort(key=lambda t: t[0])
        if M == 1:
            best[(name, 1)] = [t[1] for t in tri[:8]]
        row[M] = {"cublas_us": round(cu, 2), "cublas_GBs": round(gb / cu * 1e6, 1),
                  "gemv_best_us": round(tri[0][0], 2), "gemv_best_cfg": tri[0][1], "gemv_GBs": round(gb / tri[0][0] * 1e6, 1),
                  "gemv_err": tri[0][2], "top5": [(round(t[0], 2), t[1]) for t in tri[:5]]}
        print(name, M, json.dumps(row[M])[:300], flush=True)
    micro[name] = row
    res["micro"] = micro; dump()
    del ws; gc.collect(); torch.cuda.empty_cache()
print("micro done", round(time.time() - T0), flush=True)

# -- 2. the engine: ITL with cuBLAS / with the GEMV ------------------------------------------------
from localrun.engine import LLMEngine
from localrun.engine.layers import quant
from localrun.bench.gpu_check import FULL, _engine_config, itl, _session, _stream
from localrun.engine import SamplingParams
eng = LLMEngine.from_random("llama-3.1-8b", _engine_config("cuda", FULL, 0.8))
print("engine", round(time.time() - T0), eng.fallbacks, flush=True)
table = {}
for name, (N, K) in SHAPES.items():
    for M, r in micro.get(name, {}).items():
        table[(N, K, M)] = (tuple(r["gemv_best_cfg"]), r["gemv_best_us"] < r["cublas_us"])
orig = quant.linear
def linear_gemv(x, w, bias=None):
    if isinstance(w, torch.Tensor) and x.is_cuda and x.dim() == 2 and x.shape[0] <= 8:
        M = x.shape[0]
        N, K = w.shape
        Mp = 1 << (M - 1).bit_length()
        cfg, wins = table.get((N, K, Mp), (None, False))
        if wins:
            return GV.gemv(x, w, bias, cfg=cfg)
    return F.linear(x, w, bias)
def use(gemv):
    quant.linear = linear_gemv if gemv else orig
    eng.runner.graphs = None; gc.collect(); torch.cuda.empty_cache()
    eng.runner.setup_graphs(True)
def bs1_logits():
    r = eng.runner
    from localrun.engine.layers.attention import padding_step
    r.buffers.write(padding_step(1, r.table.dummy_row))
    return r.graphs.run(1)[:1].clone()
ab = []
base_logits = bs1_logits()
for gemv in (False, True, False, True, False, True):
    if left() < 60:
        break
    use(gemv)
    lg = bs1_logits()
    d = itl(eng, FULL)
    row = {"gemv": gemv, "itl_p50": round(d["itl_ms_p50"], 3), "itl_mean": round(d["itl_ms_mean"], 3),
           "logits_maxdiff": (lg - base_logits).abs().max().item(), "argmax_same": bool(lg.argmax() == base_logits.argmax())}
    ab.append(row); print(json.dumps(row), flush=True)
    res["itl_ab"] = ab; dump()

# -- 3. the bs=1 graph: replay time and kernels ------------------------------------------------------
def replay_profile(tag):
    r = eng.runner
    from localrun.engine.layers.attention import padding_step
    r.buffers.write(padding_step(1, r.table.dummy_row))
    g = r.graphs.graphs[1]
    for _ in range(5):
        g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(30):
        g.replay()
    b.record(); b.synchronize()
    out = {"replay_ms": round(a.elapsed_time(b) / 30, 3)}
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            g.replay()
        torch.cuda.synchronize()
    ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by = {}
    for e in ev:
        k = e.name[:90]
        t = by.setdefault(k, [0, 0.0])
        t[0] += 1; t[1] += e.time_range.elapsed_us()
    tot = sum(v[1] for v in by.values()) / 5
    out["kernel_us_per_replay"] = round(tot, 1)
    out["kernels_per_replay"] = sum(v[0] for v in by.values()) / 5
    out["top"] = sorted(((round(v[1] / 5, 1), v[0] // 5, k) for k, v in by.items()), reverse=True)[:25]
    res[f"replay_{tag}"] = out; dump()
    print(tag, json.dumps(out)[:1500], flush=True)
for gemv in (False, True):
    if left() < 25:
        break
    try:
        use(gemv)
        replay_profile("gemv" if gemv else "cublas")
    except Exception as e:  # noqa: BLE001
        print("replay profile failed", repr(e), flush=True)

# -- 4. 40 live decode steps (engine loop, sampler, host) under the profiler -------------------------
def live():
    use(False)
    import random
    rng = random.Random(3)
    prompt = [rng.randrange(eng.model_config.vocab_size) for _ in range(512)]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU]) as prof:
        t, times, n = _session(eng, lambda: _stream(eng, prompt, SamplingParams(temperature=1.0, max_tokens=48, ignore_eos=True)))
    gaps = [(b - a) * 1000 for a, b in zip(times, times[1:])]
    ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    ev.sort(key=lambda e: e.time_range.start)
    lo = ev[0].time_range.start + 0.4 * (ev[-1].time_range.end - ev[0].time_range.start)
    ev = [e for e in ev if e.time_range.start >= lo]  # the decode steps (the prefill is early)
    base = ev[0].time_range.start
    busy = sum(e.time_range.end - e.time_range.start for e in ev)
    span = ev[-1].time_range.end - base
    gaps_gpu = sorted(((ev[i + 1].time_range.start - ev[i].time_range.end), ev[i].name[:50], ev[i + 1].name[:50])
                      for i in range(len(ev) - 1))[-15:]
    by = {}
    for e in ev:
        t2 = by.setdefault(e.name[:90], [0, 0.0]); t2[0] += 1; t2[1] += e.time_range.end - e.time_range.start
    res["live"] = {"itl_p50": statistics.median(gaps), "tokens": n, "gpu_busy_us": busy, "gpu_span_us": span,
                   "busy_fraction": busy / span, "largest_gpu_gaps_us": gaps_gpu,
                   "top": sorted(((round(v[1], 1), v[0], k) for k, v in by.items()), reverse=True)[:30]}
    dump()
    print("live", json.dumps(res["live"])[:3000], flush=True)
if left() > 20:
    try:
        live()
    except Exception as e:  # noqa: BLE001
        print("live profile failed", repr(e), flush=True)
print("done", round(time.time() - T0), flush=True)
