"""Prepared in session 37, run in session 47 (gpu9.sh; results/gemv-ab-nvidia-h100.json): can the one-row GEMV (kernels/matvec.py) hide
its ~3.5 us of fixed cost per launch (ramp-up, tail, launch latency; 129 launches a batch-1 step of the 8B shape)?
Variants of the kernel, defined here (the production kernel is untouched):
  base  - kernels/matvec.py's kernel;
  prefetch - the next weight tile loaded before the current one is used (Triton does not pipeline these loads
          itself: no cp.async in the PTX with tl.range num_stages=3);
  pdl   - programmatic dependent launch (launch_pdl=True): the first weight tile is loaded before gdc_wait(),
          i.e. while the kernel that writes x is still finishing;
  pdl+prefetch.
1. micro: 32 pairs [a Triton kernel that writes x] -> [GEMV reading x], captured in one CUDA graph, for the qkv, o
   and down shapes (weights cycled so L2 holds none); us per pair;
2. ITL of the 8B shape (gpu_check.itl), kernels.gemv swapped for each variant, graphs recaptured, alternated.
Writes $OUT/gemv-pdl.json."""
import gc, json, os, statistics, time
import torch
import triton
import triton.language as tl
from localrun import kernels
from localrun.kernels import matvec
OUT = os.environ.get("OUT", "/tmp")
T0 = time.time()
res = {"device": torch.cuda.get_device_name(0), "triton": triton.__version__}
def dump():
    json.dump(res, open(f"{OUT}/gemv-pdl.json", "w"), indent=1)
try:
    from triton.language.extra.cuda import gdc_wait
except Exception as e:  # noqa: BLE001
    res["no_pdl"] = repr(e)
    @triton.jit
    def gdc_wait():
        pass


@triton.jit
def _gemv_v(X, W, Y, N, K, stride_wn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
            PREFETCH: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    w_rows = W + rn.to(tl.int64)[:, None] * stride_wn
    w = tl.load(w_rows + rk[None, :], mask=n_ok[:, None] & (rk < K)[None, :], other=0.0, eviction_policy="evict_first")
    if PDL:
        gdc_wait()  # x is written by the kernel before this one
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    if PREFETCH:  # the next weight tile is loaded before this one is used (two tiles in flight per program)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            nk = kk + BLOCK_K
            w_next = tl.load(w_rows + nk[None, :], mask=n_ok[:, None] & (nk < K)[None, :], other=0.0,
                             eviction_policy="evict_first")
            x = tl.load(X + kk, mask=kk < K, other=0.0).to(tl.float32)
            acc += w.to(tl.float32) * x[None, :]
            w = w_next
    else:
        x = tl.load(X + rk, mask=rk < K, other=0.0).to(tl.float32)
        acc += w.to(tl.float32) * x[None, :]
        for k0 in range(BLOCK_K, K, BLOCK_K):
            kk = k0 + rk
            wk = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & (kk < K)[None, :], other=0.0,
                         eviction_policy="evict_first").to(tl.float32)
            xk = tl.load(X + kk, mask=kk < K, other=0.0).to(tl.float32)
            acc += wk * xk[None, :]
    tl.store(Y + rn, tl.sum(acc, axis=1).to(Y.dtype.element_ty), mask=n_ok)


def variant(pdl, prefetch):
    def gemv(x, w, bias=None):
        if bias is not None or x.shape[0] != 1 or w.stride(1) != 1:
            return matvec.gemv(x, w, bias)
        N, K = w.shape
        bn, bk, warps = matvec.config(K)
        y = torch.empty((1, N), dtype=x.dtype, device=x.device)
        _gemv_v[(triton.cdiv(N, bn),)](x.contiguous(), w, y, N, K, w.stride(0), BLOCK_N=bn, BLOCK_K=bk, PDL=pdl,
                                        PREFETCH=prefetch, num_warps=warps, **({"launch_pdl": True} if pdl else {}))
        return y
    return gemv


@triton.jit
def _writer(X, Src, K, BLOCK: tl.constexpr):  # stands in for add+RMSNorm / SiLU: writes the GEMV's input
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < K
    tl.store(X + offs, tl.load(Src + offs, mask=m) * 1.0001, mask=m)


VARIANTS = {"base": matvec.gemv, "prefetch": variant(False, True), "pdl": variant(True, False),
            "pdl+prefetch": variant(True, True)}
dev = "cuda"
micro = {}
for name, (N, K) in {"qkv": (6144, 4096), "o": (4096, 4096), "down": (4096, 14336)}.items():
    copies = max(1, -(-300_000_000 // (N * K * 2)))
    ws = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    src = torch.randn(1, K, device=dev, dtype=torch.bfloat16)
    x = torch.empty_like(src)
    ref = torch.nn.functional.linear(src * 1.0001, ws[0])
    row = {}
    for vname, fn in VARIANTS.items():
        try:
            _writer[(triton.cdiv(K, 1024),)](x, src, K, BLOCK=1024)
            err = ((fn(x, ws[0]).float() - ref.float()).abs().max() / ref.float().abs().max()).item()
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for i in range(32):
                    _writer[(triton.cdiv(K, 1024),)](x, src, K, BLOCK=1024)
                    fn(x, ws[i % copies])
            g.replay(); torch.cuda.synchronize()
            ts = []
            for _ in range(7):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record(); g.replay(); b.record(); b.synchronize()
                ts.append(a.elapsed_time(b) * 1000 / 32)
            row[vname] = {"us_per_pair": round(statistics.median(ts), 2), "err": err}
            del g
        except Exception as e:  # noqa: BLE001
            row[vname] = {"error": repr(e)[:300]}
        print(name, vname, row[vname], flush=True)
    micro[name] = row
    res["micro"] = micro; dump()
    del ws; gc.collect(); torch.cuda.empty_cache()

from localrun.engine import LLMEngine
from localrun.bench.gpu_check import FULL, _engine_config, itl
eng = LLMEngine.from_random("llama-3.1-8b", _engine_config("cuda", FULL, 0.8))
orig = kernels.gemv
rows = []
for vname in ("base", "pdl", "pdl+prefetch", "prefetch", "base", "pdl", "pdl+prefetch", "prefetch"):
    if time.time() - T0 > float(os.environ.get("GEMV_PDL_LIMIT_S", "150")):
        break
    if "error" in micro["o"].get(vname, {}):
        continue
    kernels.gemv = VARIANTS[vname] if vname != "base" else orig
    try:
        eng.runner.graphs = None; gc.collect(); torch.cuda.empty_cache()
        eng.runner.setup_graphs(True)
        d = itl(eng, FULL)
        rows.append({"variant": vname, "itl_p50": round(d["itl_ms_p50"], 3), "itl_mean": round(d["itl_ms_mean"], 3),
                     "graph_fallbacks": dict(eng.runner.graphs.failed)})
    except Exception as e:  # noqa: BLE001
        rows.append({"variant": vname, "error": repr(e)[:300]})
    print(json.dumps(rows[-1]), flush=True)
    res["itl"] = rows; dump()
kernels.gemv = orig
print("done", round(time.time() - T0), flush=True)
