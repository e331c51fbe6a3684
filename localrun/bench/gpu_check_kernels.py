"""gpu-check's kernel_parity item: every Triton kernel against its torch reference at the shapes that matter."""

from __future__ import annotations

import os
import time
import traceback
from typing import Any, Callable

from localrun.bench.gpu_check_sizes import KERNEL_TOL, Sizes, tail, torch_module

def paged_caches(seq_lens, hkv, d, page, dtype, device, torch):
    """Caches holding seq_lens tokens on shuffled pages: (k_cache, v_cache, page_table, seq_lens)."""
    import math

    pages = [max(1, math.ceil(n / page)) for n in seq_lens]
    g = torch.Generator().manual_seed(1)
    perm = torch.randperm(sum(pages) + 2, generator=g).to(torch.int32)
    table = torch.zeros(len(seq_lens), max(pages), dtype=torch.int32)
    used = 0
    for b, n in enumerate(pages):
        table[b, :n] = perm[used:used + n]
        used += n
    shape = (sum(pages) + 2, page, hkv, d)
    kc = torch.randn(shape, generator=g).to(dtype=dtype, device=device)
    vc = torch.randn(shape, generator=g).to(dtype=dtype, device=device)
    return kc, vc, table.to(device), torch.tensor(seq_lens, dtype=torch.int32, device=device)


def attention_shapes(kind: str) -> list[dict]:
    """Attention configurations: GQA at the 8B shape, SmolLM2's, a sliding window with a soft-cap, MHA."""
    if kind == "tiny":
        return [dict(name="GQA 4/2 d16", hq=4, hkv=2, d=16, page=4, decode=[3, 19], extend=[(0, 7), (5, 9)]),
                dict(name="window 4/1 d16 W5 cap", hq=4, hkv=1, d=16, page=4, window=5, softcap=50.0,
                     decode=[2, 19], extend=[(0, 12)])]
    long = kind == "full"
    return [
        dict(name="llama-3.1-8b GQA 32/8 d128", hq=32, hkv=8, d=128, page=16,
             decode=[1, 17, 300, 2048, 4096] if long else [1, 300, 1024],
             extend=[(0, 512), (700, 64), (0, 1)] if long else [(0, 256), (300, 32)]),
        dict(name="smollm2 GQA 9/3 d64", hq=9, hkv=3, d=64, page=16, decode=[5, 130, 1000],
             extend=[(0, 200), (64, 17)]),
        dict(name="gemma-3 window 4/1 d256 W512 cap50", hq=4, hkv=1, d=256, page=16, window=512, softcap=50.0,
             decode=[100, 1500] if long else [700], extend=[(0, 700), (600, 100)] if long else [(0, 600)]),
        dict(name="MHA 8/8 d64", hq=8, hkv=8, d=64, page=16, decode=[33, 513], extend=[(0, 100), (40, 40)]),
    ]


def kernel_cases(kind: str, device: str, dtype) -> list[tuple[str, Callable, Callable]]:
    """(case, Triton call, reference call): each returns a tensor; the reference runs in float32
    on the same (dtype-rounded) inputs, so it is the oracle."""
    import importlib

    torch = torch_module()
    mod = {m: importlib.import_module(f"localrun.kernels.{m}")
           for m in ("decode_attention", "extend_attn", "kv_store", "rmsnorm", "head_rmsnorm", "rope", "activation",
                     "matvec", "moe")}
    from localrun.kernels import ops as K

    g = torch.Generator().manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype=dtype, device=device)

    f = lambda t: t.float()  # noqa: E731
    cases = []
    for s in attention_shapes(kind):
        hq, hkv, d, page = s["hq"], s["hkv"], s["d"], s["page"]
        opts = {"window": s.get("window", 0), "softcap": s.get("softcap", 0.0)}
        scale = d ** -0.5
        kc, vc, table, lens = paged_caches(s["decode"], hkv, d, page, dtype, device, torch)
        q = rnd(len(s["decode"]), hq, d)
        cases.append((f"paged_decode_attention {s['name']} lens {s['decode']}",
                      lambda q=q, kc=kc, vc=vc, t=table, n=lens, sc=scale, o=opts:
                      mod["decode_attention"].paged_decode_attention(q, kc, vc, t, n, sc, **o),
                      lambda q=q, kc=kc, vc=vc, t=table, n=lens, sc=scale, o=opts:
                      K.paged_decode_attention_ref(f(q), f(kc), f(vc), t, n, sc, **o)))
        spans = s["extend"]
        kc, vc, table, lens = paged_caches([p + m for p, m in spans], hkv, d, page, dtype, device, torch)
        q_lens = [m for _, m in spans]
        cu = torch.tensor([0] + q_lens).cumsum(0).to(device=device, dtype=torch.int32)
        q = rnd(sum(q_lens), hq, d)
        cases.append((f"extend_attention {s['name']} prefix/new {spans}",
                      lambda q=q, kc=kc, vc=vc, t=table, cu=cu, n=lens, sc=scale, o=opts, m=max(q_lens):
                      mod["extend_attn"].extend_attention(q, kc, vc, t, cu, n, sc, max_q_len=m, **o),
                      lambda q=q, kc=kc, vc=vc, t=table, cu=cu, n=lens, sc=scale, o=opts:
                      K.extend_attention_ref(f(q), f(kc), f(vc), t, cu, n, sc, **o)))
    big = kind != "tiny"
    T, H, inter, hq, hkv, d = (512, 4096, 14336, 32, 8, 128) if big else (9, 48, 40, 4, 2, 16)
    x, r, w = rnd(T, H), rnd(T, H), rnd(H)
    cases.append((f"fused_add_rmsnorm T={T} H={H}", lambda: mod["rmsnorm"].fused_add_rmsnorm(x, r, w, 1e-5)[0],
                  lambda: K.fused_add_rmsnorm_ref(f(x.to(dtype) + r), None, f(w), 1e-5)[0]))
    qkv = rnd(T, (hq + 2 * hkv) * d)
    qn, wn = qkv[:, :hq * d].view(T, hq, d), rnd(d)  # Qwen3's q norm over a strided view of qkv
    cases.append((f"rms_norm (q/k heads) T={T} {hq}x{d}", lambda: mod["head_rmsnorm"].rms_norm(qn, wn, 1e-6),
                  lambda: K.rms_norm_ref(f(qn), f(wn), 1e-6)))
    max_pos = 8192 if big else 64
    cache = K.rope_cos_sin_cache(d, max_pos, 500000.0, {"rope_type": "llama3", "factor": 8.0,
                                                        "original_max_position_embeddings": 8192}, device=device)
    pos = torch.randint(0, max_pos, (T,), generator=g).to(device)
    qr, kr = rnd(T, hq, d), rnd(T, hkv, d)
    cases.append((f"apply_rope (llama3 scaling) T={T} {hq}/{hkv}x{d}",
                  lambda: torch.cat([t.flatten() for t in mod["rope"].apply_rope(qr, kr, pos, cache)]),
                  lambda: torch.cat([t.flatten() for t in K.apply_rope_ref(f(qr), f(kr), pos, cache)])))
    gu = rnd(T, 2 * inter)
    cases.append((f"silu_and_mul T={T} I={inter}", lambda: mod["activation"].silu_and_mul(gu),
                  lambda: K.silu_and_mul_ref(f(gu))))
    cases.append((f"gelu_tanh_and_mul T={T} I={inter}", lambda: mod["activation"].gelu_tanh_and_mul(gu),
                  lambda: K.gelu_tanh_and_mul_ref(f(gu))))
    kc0, vc0, _, _ = paged_caches([T], hkv, d, 16 if big else 4, dtype, device, torch)
    slots = torch.randperm(kc0.shape[0] * kc0.shape[1], generator=g)[:T].to(device)

    def store(fn):
        kc, vc = kc0.clone(), vc0.clone()
        fn(kr, qr[:, :hkv].contiguous(), kc, vc, slots)
        return torch.cat([kc.flatten(), vc.flatten()])

    cases.append((f"store_kv T={T} {hkv}x{d}", lambda: store(mod["kv_store"].store_kv),
                  lambda: store(K.store_kv_ref).float()))
    # the one-row linear layer, its input written by the kernel just before it (on Hopper the GEMV
    # starts before that kernel ends and waits for its writes in-kernel: a missed wait reads stale x)
    for m, n, k, bias in ((1, (hq + 2 * hkv) * d, H, None), (1, H, inter, None), (3, H, H, rnd(H))):
        xs, wm = rnd(m, k), rnd(n, k)
        cases.append((f"gemv M={m} N={n} K={k}{' +bias' if bias is not None else ''}",
                       lambda xs=xs, wm=wm, b=bias: mod["matvec"].gemv(xs * 2, wm, b),
                       lambda xs=xs, wm=wm, b=bias: K.gemv_ref(f(xs * 2), f(wm), None if b is None else f(b))))
    cases += moe_cases(kind, device, dtype, mod["moe"].fused_moe, g)
    return cases


def moe_shapes(kind: str) -> list[dict]:
    """The fused MoE kernel's cases: Qwen3-30B-A3B's experts (128, top-8, 2048 -> 768) at a decode step,
    a decode batch and a prefill chunk; gpt-oss-20b's (32, top-4, 2880 -> 2880, biases, clamped SwiGLU)."""
    if kind == "tiny":
        return [dict(name="E8 top-2 48->40", E=8, k=2, H=48, I=40, tokens=[1, 37]),
                dict(name="E6 top-2 48->24 swiglu_oai +bias", E=6, k=2, H=48, I=24, tokens=[5], act="swiglu_oai")]
    return [dict(name="qwen3-30b-a3b E128 top-8 2048->768", E=128, k=8, H=2048, I=768,
                 tokens=[1, 64, 512] if kind == "full" else [1, 256]),
            dict(name="gpt-oss-20b E32 top-4 2880->2880 swiglu_oai +bias", E=32, k=4, H=2880, I=2880,
                 tokens=[1, 256] if kind == "full" else [1], act="swiglu_oai")]


def moe_cases(kind: str, device: str, dtype, kernel: Callable, g) -> list[tuple[str, Callable, Callable]]:
    """The router's top-k (its weights scattered over the experts) and the experts' kernel at moe_shapes."""
    import importlib

    torch = torch_module()
    from localrun.kernels import ops as K

    cases = []
    gd = torch.Generator(device=device).manual_seed(5)  # the experts drawn where they run (GBs at full size)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gd, device=device) * scale).to(dtype)

    route = importlib.import_module("localrun.kernels.moe_route").moe_route
    for s in moe_shapes(kind):
        E, k, H, I, act = s["E"], s["k"], s["H"], s["I"], s.get("act", "silu")
        scoring = "topk_softmax" if act == "swiglu_oai" else "softmax_topk"  # gpt-oss's router, Qwen3-MoE's
        logits = rnd(max(s["tokens"]), E, scale=3.0)

        def dense(fn, lg=logits, k=k, sc=scoring):  # the weights and the logits the ids pick (ties may swap ids)
            w, ids = fn(lg, k, scoring=sc)
            return torch.cat([w.float(), lg.gather(1, ids.long()).float()], dim=1)

        cases.append((f"moe_route {s['name']} T={logits.shape[0]}", lambda d=dense: d(route),
                      lambda d=dense: d(K.moe_route_ref)))
        w13, w2 = rnd(E, 2 * I, H, scale=H ** -0.5), rnd(E, H, I, scale=I ** -0.5)
        bias = act == "swiglu_oai"
        b13, b2 = (rnd(E, 2 * I), rnd(E, H)) if bias else (None, None)
        for T in s["tokens"]:
            x = torch.randn(T, H, generator=g).to(dtype=dtype, device=device)
            weights, ids = K.moe_route_ref(torch.randn(T, E, generator=g), k)
            weights, ids = weights.to(device), ids.to(device)
            kw = dict(activation=act)
            cases.append((f"fused_moe {s['name']} T={T}",
                          lambda x=x, w13=w13, w2=w2, w=weights, i=ids, b13=b13, b2=b2, kw=kw:
                          kernel(x, w13, w2, w, i, w13_bias=b13, w2_bias=b2, **kw),
                          lambda x=x, w13=w13, w2=w2, w=weights, i=ids, b13=b13, b2=b2, kw=kw:
                          K.fused_moe_ref(x.float(), w13.float(), w2.float(), w, i, **kw,
                                          w13_bias=None if b13 is None else b13.float(),
                                          w2_bias=None if b2 is None else b2.float())))
    return cases


def kernel_parity(sizes: Sizes, device: str) -> dict[str, Any]:
    """Every Triton kernel against its torch reference; on a CPU in Triton's interpreter (this
    item's child process runs with TRITON_INTERPRET=1 there), or skipped without Triton."""
    import importlib.util

    torch = torch_module()
    if importlib.util.find_spec("triton") is None:
        return {"status": "skipped", "reason": "skipped: no GPU (and Triton is not installed for its interpreter)"}
    if device != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return {"status": "skipped", "reason": "skipped: no GPU (TRITON_INTERPRET is not set)"}
    dtype_name = "bfloat16" if device == "cuda" else "float32"
    tol = KERNEL_TOL[dtype_name]
    rows, t0 = [], time.perf_counter()
    for case, triton_fn, ref_fn in kernel_cases(sizes.kernel_shapes, device, getattr(torch, dtype_name)):
        t = time.perf_counter()
        try:
            out, ref = triton_fn(), ref_fn()
            if device == "cuda":
                torch.cuda.synchronize()
            out, ref = out.double().cpu(), ref.double().cpu()
            bad = bool(out.isnan().any()) or out.shape != ref.shape
            err = float("nan") if bad else float((out - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
            rows.append({"case": case, "max_rel_err": err, "passed": (not bad) and err <= tol,
                         "seconds": time.perf_counter() - t})
        except Exception as exc:  # noqa: BLE001 - a kernel that does not compile or launch: record it, go on
            rows.append({"case": case, "passed": False, "error": f"{type(exc).__name__}: {exc}",
                         "error_tail": tail(traceback.format_exc()), "seconds": time.perf_counter() - t})
            if device == "cuda" and "CUDA error" in str(exc):
                break  # the context is poisoned: every later launch fails too
    failed = [r["case"] for r in rows if not r["passed"]]
    worst = max((r.get("max_rel_err", 0.0) for r in rows if r.get("max_rel_err") == r.get("max_rel_err")), default=None)
    return {"status": "fail" if failed else "pass", "dtype": dtype_name,
            "where": "CUDA" if device == "cuda" else "CPU, Triton's interpreter (TRITON_INTERPRET=1)",
            "target": f"every case max |triton - reference| / max |reference| <= {tol:g} ({dtype_name} inputs, "
                      "the float32 torch reference as the oracle)",
            "value": worst, "cases": rows, "failed": failed, "compute_seconds": time.perf_counter() - t0}
