"""GPU micro-benchmark of localrun.kernels against the torch references and the machine's ceilings.

    python -m localrun.kernels.bench_kernels [--json results.json]

On a CUDA GPU it measures, at Llama-3.1-8B shapes in bf16:
  * the ceilings: device-to-device memcpy bandwidth (GB/s) and an 8192^3 bf16 matmul (TFLOP/s);
  * paged decode attention: achieved GB/s (K/V bytes read / time) for Triton vs the reference;
  * extend (prefill) attention: achieved TFLOP/s (causal FLOPs / time) for Triton vs the
    reference, and vs torch's dense scaled_dot_product_attention where the batch has no prefix;
  * sliding-window attention at Gemma 3 1B's attention shape (window 512, plus Gemma 2's soft-cap):
    decode GB/s and extend TFLOP/s over the keys inside the window, with the same kernel attending
    globally as the baseline (same amount: its figure shows what skipping the out-of-window pages saves);
  * store_kv, add+RMSNorm, RoPE, SiLU-and-mul, GELU-tanh-and-mul: GB/s for Triton vs the reference;
  * the fused MoE kernel at Qwen3-30B-A3B's experts (128, top-8, 2048 -> 768): at decode batches GB/s of
    the routed experts' weights, at prefill sizes TFLOP/s, against the reference (a gathered GEMM per
    routed expert, fp32 sums) and a naive per-expert loop over all experts as transformers runs them.
Each Triton result is also checked against the reference (max relative error printed).
Times are means over repetitions: Triton kernels replayed from a CUDA graph
(triton.testing.do_bench_cudagraph, no CPU launch cost), the references and ceilings with
triton.testing.do_bench (they sync with the host or are large enough not to care).

`--tiny` runs the same code at toy shapes, for a CPU smoke test under TRITON_INTERPRET=1
(its numbers mean nothing).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from localrun.kernels import ops as K
from localrun.kernels._common import interpreting


def _time_ms(fn: Callable[[], object], cuda: bool, graph: bool = False) -> float:
    """Mean milliseconds per call. graph=True replays fn from a CUDA graph, so CPU launch cost
    (which decode at small batch would otherwise show) stays out; it falls back to plain
    timing when fn cannot be captured (e.g. it syncs with the host)."""
    if cuda:
        import triton.testing

        if graph:
            try:
                return float(triton.testing.do_bench_cudagraph(fn, rep=100))
            except Exception as exc:  # noqa: BLE001 - capture failed: time it launch by launch
                torch.cuda.synchronize()
                print(f"  (CUDA graph capture failed: {type(exc).__name__}; timing launch by launch)")
        return float(triton.testing.do_bench(fn, warmup=25, rep=100))
    fn()
    reps, t0 = 3, time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) * 1000 / reps


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30))


class Bench:
    def __init__(self, device: str, tiny: bool):
        self.device, self.tiny, self.cuda = device, tiny, device == "cuda"
        self.rows: list[dict] = []

    def record(self, group: str, case: str, unit: str, amount: float, triton_fn, ref_fn=None, check=None,
               baseline: tuple[str, Callable] | None = None, label: str = "triton") -> None:
        """amount: bytes (unit GB/s) or FLOPs (unit TFLOP/s) one call moves or computes."""
        scale = 1e9 if unit == "GB/s" else 1e12
        row = {"group": group, "case": case, "unit": unit}
        row[f"{label}_ms"] = _time_ms(triton_fn, self.cuda, graph=label == "triton")
        row[label] = amount / (row[f"{label}_ms"] / 1e3) / scale
        if ref_fn is not None:
            row["ref_ms"] = _time_ms(ref_fn, self.cuda)
            row["ref"] = amount / (row["ref_ms"] / 1e3) / scale
        if baseline is not None:
            row["baseline_name"] = baseline[0]
            row["baseline_ms"] = _time_ms(baseline[1], self.cuda)
            row["baseline"] = amount / (row["baseline_ms"] / 1e3) / scale
        if check is not None:
            row["max_rel_err"] = check()
        self.rows.append(row)
        extra = f"  {row['baseline_name']} {row['baseline']:8.2f}" if baseline else ""
        ref = f"ref {row['ref']:9.2f} ({row['ref_ms']:8.3f} ms)" if ref_fn else ""
        err = f"  err {row['max_rel_err']:.1e}" if check else ""
        print(f"{group:>10} {case:<34} {label:>8} {row[label]:9.2f} {unit:<7} ({row[f'{label}_ms']:8.3f} ms)  "
              f"{ref}{extra}{err}", flush=True)


def _shapes(tiny: bool) -> dict:
    if tiny:
        return dict(hq=4, hkv=2, d=16, page=4, hidden=48, inter=40, mm=64, copy_mb=1,
                    moe=dict(E=8, k=2, H=48, I=40, tokens=[1, 37]),
                    decode=[(2, 19)], extend=[[(0, 7), (5, 9)], [(0, 8)] * 2], tokens=9, max_pos=64,
                    window=dict(hq=4, hkv=1, d=16, window=5, decode=[(2, 19)], extend=[[(0, 12)]]))
    return dict(hq=32, hkv=8, d=128, page=16, hidden=4096, inter=14336, mm=8192, copy_mb=1024,
                decode=[(1, 1024), (1, 8192), (8, 2048), (32, 2048), (64, 1024), (128, 4096)],
                extend=[[(0, 2048)], [(0, 512)] * 4, [(2048, 512)] * 2, [(0, 1000), (3000, 100), (0, 1)]],
                tokens=8192, max_pos=131072,
                # Qwen3-30B-A3B's experts: decode batches of 1-64 sequences, prefill chunks of 512 and 4096 tokens
                moe=dict(E=128, k=8, H=2048, I=768, tokens=[1, 8, 64, 512, 4096]),
                # Gemma 3 1B's attention (4 query heads, 1 KV head, head_dim 256) and its 512-token window
                window=dict(hq=4, hkv=1, d=256, window=512, decode=[(32, 4096), (128, 8192)],
                            extend=[[(0, 4096)], [(4096, 1024)] * 4]))


def _paged(seq_lens, hkv, d, page, dtype, device):
    """A pool holding seq_lens tokens on shuffled pages; returns caches, page table, seq_lens."""
    pages = [math.ceil(n / page) for n in seq_lens]
    perm = torch.randperm(sum(pages), device=device).to(torch.int32)
    table = torch.zeros(len(seq_lens), max(pages), dtype=torch.int32, device=device)
    used = 0
    for b, n in enumerate(pages):
        table[b, :n] = perm[used:used + n]
        used += n
    k_cache = torch.randn(sum(pages), page, hkv, d, dtype=dtype, device=device)
    v_cache = torch.randn_like(k_cache)
    return k_cache, v_cache, table, torch.tensor(seq_lens, dtype=torch.int32, device=device)


def run(bench: Bench) -> None:
    s, dev = _shapes(bench.tiny), bench.device
    dt = torch.bfloat16
    hq, hkv, d = s["hq"], s["hkv"], s["d"]
    scale = d ** -0.5
    elt = torch.finfo(dt).bits // 8

    # Ceilings.
    src = torch.empty(s["copy_mb"] << 20, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    bench.record("ceiling", f"memcpy {s['copy_mb']} MiB", "GB/s", 2 * src.numel(), lambda: dst.copy_(src),
                 label="measured")
    del src, dst
    n = s["mm"]
    a, b = torch.randn(n, n, dtype=dt, device=dev), torch.randn(n, n, dtype=dt, device=dev)
    bench.record("ceiling", f"bf16 matmul {n}^3", "TFLOP/s", 2 * n ** 3, lambda: a @ b, label="measured")
    del a, b

    # Paged decode attention: bytes = the K and V rows read (+ q and o). One timed call runs
    # the kernel over several layers' caches, as a decode step does, so that the KV bytes
    # exceed the L2 cache (a CUDA-graph replay does not flush it) and come from memory.
    for batch, seq_len in s["decode"]:
        kc, vc, table, lens = _paged([seq_len] * batch, hkv, d, s["page"], dt, dev)
        q = torch.randn(batch, hq, d, dtype=dt, device=dev)
        per_layer = (2 * batch * seq_len * hkv * d + 2 * batch * hq * d) * elt
        layers = 1 if bench.tiny else max(1, min(32, math.ceil((512 << 20) / per_layer)))
        caches = [(kc, vc)] + [(torch.randn_like(kc), torch.randn_like(vc)) for _ in range(layers - 1)]
        args = (q, kc, vc, table, lens, scale)
        small = batch * seq_len <= 64 * 1024  # the reference materialises fp32 copies of K and V
        bench.record("decode", f"B={batch} L={seq_len} x{layers} layers", "GB/s", per_layer * layers,
                     lambda: [K.paged_decode_attention(q, k, v, table, lens, scale) for k, v in caches],
                     (lambda: [K.paged_decode_attention_ref(q, k, v, table, lens, scale) for k, v in caches])
                     if small else None,
                     (lambda: _rel_err(K.paged_decode_attention(*args), K.paged_decode_attention_ref(*args)))
                     if small else None)
        del kc, vc, caches

    # Extend attention: FLOPs = 4 * D * Hq * (keys each query sees), causal.
    for spans in s["extend"]:
        seq_lens = [p + m for p, m in spans]
        kc, vc, table, lens = _paged(seq_lens, hkv, d, s["page"], dt, dev)
        q_lens = [m for _, m in spans]
        cu = torch.tensor([0] + q_lens, device=dev).cumsum(0).to(torch.int32)
        q = torch.randn(sum(q_lens), hq, d, dtype=dt, device=dev)
        flops = 4 * d * hq * sum(m * p + m * (m + 1) // 2 for p, m in spans)
        args = (q, kc, vc, table, cu, lens, scale)
        baseline = None
        if all(p == 0 for p, _ in spans) and len(set(q_lens)) == 1:  # dense equivalent exists
            qd = q.view(len(spans), q_lens[0], hq, d).transpose(1, 2)
            kd = torch.randn(len(spans), hkv, q_lens[0], d, dtype=dt, device=dev)
            baseline = ("sdpa", lambda: torch.nn.functional.scaled_dot_product_attention(
                qd, kd, kd, is_causal=True, enable_gqa=True))
        label = "+".join(f"{p}/{m}" for p, m in spans[:3]) + ("..." if len(spans) > 3 else "")
        bench.record("extend", f"prefix/new {label}", "TFLOP/s", flops,
                     lambda: K.extend_attention(*args, max_q_len=max(q_lens)),
                     lambda: K.extend_attention_ref(*args),
                     lambda: _rel_err(K.extend_attention(*args), K.extend_attention_ref(*args)), baseline)
        del kc, vc

    _window(bench, s, dt, elt)

    # Pointwise ops at a prefill-sized batch of tokens: bytes read + written.
    t, h, inter = s["tokens"], s["hidden"], s["inter"]
    x, r, w = (torch.randn(t, h, dtype=dt, device=dev), torch.randn(t, h, dtype=dt, device=dev),
               torch.randn(h, dtype=dt, device=dev))
    bench.record("rmsnorm", f"add+rmsnorm T={t} H={h}", "GB/s", 4 * t * h * elt,
                 lambda: K.fused_add_rmsnorm(x, r, w, 1e-5), lambda: K.fused_add_rmsnorm_ref(x, r, w, 1e-5),
                 lambda: _rel_err(K.fused_add_rmsnorm(x, r, w, 1e-5)[0], K.fused_add_rmsnorm_ref(x, r, w, 1e-5)[0]))
    gu = torch.randn(t, 2 * inter, dtype=dt, device=dev)
    bench.record("silu_mul", f"T={t} I={inter}", "GB/s", 3 * t * inter * elt,
                 lambda: K.silu_and_mul(gu), lambda: K.silu_and_mul_ref(gu),
                 lambda: _rel_err(K.silu_and_mul(gu), K.silu_and_mul_ref(gu)))
    bench.record("gelu_mul", f"T={t} I={inter}", "GB/s", 3 * t * inter * elt,
                 lambda: K.gelu_tanh_and_mul(gu), lambda: K.gelu_tanh_and_mul_ref(gu),
                 lambda: _rel_err(K.gelu_tanh_and_mul(gu), K.gelu_tanh_and_mul_ref(gu)))
    del gu
    cache = K.rope_cos_sin_cache(d, s["max_pos"], 500000.0, {"rope_type": "llama3", "factor": 8.0}, device=dev)
    pos = torch.randint(0, s["max_pos"], (t,), device=dev)
    qr, kr = torch.randn(t, hq, d, dtype=dt, device=dev), torch.randn(t, hkv, d, dtype=dt, device=dev)
    bench.record("rope", f"T={t}", "GB/s", 2 * t * (hq + hkv) * d * elt,
                 lambda: K.apply_rope(qr, kr, pos, cache), lambda: K.apply_rope_ref(qr, kr, pos, cache),
                 lambda: _rel_err(K.apply_rope(qr, kr, pos, cache)[0], K.apply_rope_ref(qr, kr, pos, cache)[0]))
    qkv = torch.randn(t, (hq + 2 * hkv) * d, dtype=dt, device=dev)
    qn, wn = qkv[:, :hq * d].view(t, hq, d), torch.randn(d, dtype=dt, device=dev)  # Qwen3's q norm, on the qkv view
    bench.record("qk_norm", f"q heads T={t}", "GB/s", 2 * t * hq * d * elt,
                 lambda: K.rms_norm(qn, wn, 1e-6), lambda: K.rms_norm_ref(qn, wn, 1e-6),
                 lambda: _rel_err(K.rms_norm(qn, wn, 1e-6), K.rms_norm_ref(qn, wn, 1e-6)))
    del qkv
    kc, vc, _, _ = _paged([t], hkv, d, s["page"], dt, dev)
    slots = torch.randperm(kc.shape[0] * kc.shape[1], device=dev)[:t]
    bench.record("store_kv", f"T={t}", "GB/s", 4 * t * hkv * d * elt,
                 lambda: K.store_kv(kr, kr, kc, vc, slots), lambda: K.store_kv_ref(kr, kr, kc, vc, slots))

    # One row through a linear layer (a decode step of one sequence): the weight's bytes. The MLP's two
    # matrices, both larger than an H100's or H200's L2 (the replays would read a smaller one from L2);
    # the reference is torch's F.linear (cuBLAS).
    for n, k in ((2 * inter, h), (h, inter)):
        wm, xv = torch.randn(n, k, dtype=dt, device=dev) / k ** 0.5, torch.randn(1, k, dtype=dt, device=dev)
        bench.record("gemv", f"1x{k} @ {n}x{k}", "GB/s", n * k * elt,
                     lambda: K.gemv(xv, wm), lambda: K.gemv_ref(xv, wm), lambda: _rel_err(K.gemv(xv, wm), K.gemv_ref(xv, wm)))
        del wm
    _moe(bench, s, dt, elt)


def _moe_naive(x, w13, w2, weights, ids):
    """transformers' Qwen3-MoE block: each expert in turn, its tokens found by comparison, in the model dtype."""
    out = torch.zeros_like(x)
    inter = w2.shape[2]
    for e in range(w13.shape[0]):
        tok, slot = torch.where(ids == e)
        h = x[tok] @ w13[e].t()
        y = (torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]) @ w2[e].t()
        out.index_add_(0, tok, y * weights[tok, slot, None].to(x.dtype))
    return out


def _moe(bench: Bench, s: dict, dt, elt: int) -> None:
    """fused_moe vs the reference and the naive loop. Decode batches: the bytes of the distinct routed
    experts' weights (each read once); prefill: 2 * T * k * 3 * H * I FLOPs."""
    m, dev = s["moe"], bench.device
    E, k, H, inter = m["E"], m["k"], m["H"], m["I"]
    w13 = torch.randn(E, 2 * inter, H, dtype=dt, device=dev) / H ** 0.5
    w2 = torch.randn(E, H, inter, dtype=dt, device=dev) / inter ** 0.5
    for T in m["tokens"]:
        x = torch.randn(T, H, dtype=dt, device=dev)
        weights, ids = K.moe_route_ref(torch.randn(T, E, device=dev), k)
        args = (x, w13, w2, weights, ids)
        decode = T * k <= E * 4
        amount = int(ids.unique().numel()) * 3 * H * inter * elt if decode else 2 * T * k * 3 * H * inter
        bench.record("moe", f"T={T} E={E} top-{k} {H}->{inter}", "GB/s" if decode else "TFLOP/s", amount,
                     lambda: K.fused_moe(*args), lambda: K.fused_moe_ref(*args),
                     lambda: _rel_err(K.fused_moe(*args), K.fused_moe_ref(*args)),
                     ("naive", lambda: _moe_naive(*args)))
    del w13, w2


def _window(bench: Bench, s: dict, dt, elt: int) -> None:
    """Sliding-window decode and extend (with a soft-cap) vs the same kernel attending globally.
    The amount is what the window needs (its K/V bytes; the FLOPs over visible keys), so the
    baseline's figure is the window's work at the global kernel's speed."""
    g, dev = s["window"], bench.device
    hq, hkv, d, win = g["hq"], g["hkv"], g["d"], g["window"]
    scale, cap = d ** -0.5, 50.0
    for batch, seq_len in g["decode"]:
        kc, vc, table, lens = _paged([seq_len] * batch, hkv, d, s["page"], dt, dev)
        q = torch.randn(batch, hq, d, dtype=dt, device=dev)
        args = (q, kc, vc, table, lens, scale)
        amount = (2 * batch * min(win, seq_len) * hkv * d + 2 * batch * hq * d) * elt
        bench.record("window", f"decode B={batch} L={seq_len} W={win} cap", "GB/s", amount,
                     lambda: K.paged_decode_attention(*args, window=win, softcap=cap), None,
                     lambda: _rel_err(K.paged_decode_attention(*args, window=win, softcap=cap),
                                      K.paged_decode_attention_ref(*args, window=win, softcap=cap)),
                     ("global", lambda: K.paged_decode_attention(*args)))
        del kc, vc
    for spans in g["extend"]:
        kc, vc, table, lens = _paged([p + m for p, m in spans], hkv, d, s["page"], dt, dev)
        q_lens = [m for _, m in spans]
        cu = torch.tensor([0] + q_lens, device=dev).cumsum(0).to(torch.int32)
        q = torch.randn(sum(q_lens), hq, d, dtype=dt, device=dev)
        args = (q, kc, vc, table, cu, lens, scale)
        visible = sum(min(win, pos + 1) for p, m in spans for pos in range(p, p + m))
        label = "+".join(f"{p}/{m}" for p, m in spans[:2]) + ("..." if len(spans) > 2 else "")
        bench.record("window", f"extend {label} W={win} cap", "TFLOP/s", 4 * d * hq * visible,
                     lambda: K.extend_attention(*args, max_q_len=max(q_lens), window=win, softcap=cap), None,
                     lambda: _rel_err(K.extend_attention(*args, window=win, softcap=cap),
                                      K.extend_attention_ref(*args, window=win, softcap=cap)),
                     ("global", lambda: K.extend_attention(*args, max_q_len=max(q_lens))))
        del kc, vc


def _versions() -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    try:
        info["commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent,
                                        capture_output=True, text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        info["commit"] = None
    return info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--tiny", action="store_true", help="toy shapes (CPU smoke run under TRITON_INTERPRET=1)")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and not interpreting()
    if not K.triton_available():
        print("triton is not installed: pip install triton", file=sys.stderr)
        return 2
    if not cuda and not (args.tiny and interpreting()):
        print("bench_kernels needs a CUDA GPU (for a CPU smoke run: TRITON_INTERPRET=1 ... --tiny)", file=sys.stderr)
        return 2
    device = "cuda" if cuda else "cpu"
    torch.manual_seed(0)
    name = torch.cuda.get_device_name() if cuda else f"cpu (Triton interpreter) {platform.processor()}"
    print(f"device: {name}  {_versions()}", flush=True)
    bench = Bench(device, args.tiny)
    with torch.inference_mode():
        run(bench)
    if args.json:
        args.json.write_text(json.dumps({"device": name, **_versions(), "tiny": args.tiny, "results": bench.rows},
                                        indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
