"""The GPU path's fallbacks: per-kernel trials at warm-up, a KV pool allocation that retries smaller, out-of-memory tests.

Each fallback is a slower path with its reason, logged once as a warning and kept in the
engine's `fallbacks` list (shown by `localrun ps -v` and /api/ps):

- a Triton kernel that raises when it is first compiled and launched on tiny inputs (or whose
  output differs from its torch reference) runs its torch reference for this load
  (`try_kernels`; per kernel, once, at warm-up, never per step);
- a decode CUDA graph whose capture raises runs eagerly at that batch size (runner.DecodeGraphs);
- a KV pool allocation refused as out of memory is retried at half the pages, down to a floor
  that holds one full-length sequence (`allocate_pool`);
- out of memory during a step ends that step's requests, and the engine shrinks its KV pool
  and batch and goes on serving (LLMEngine).

`LOCALRUN_FAULTS` (faults.py) makes each of these steps fail for real on any machine.
"""

from __future__ import annotations

import gc
import logging
from typing import Callable

import torch

from localrun.kernels import ops as kernels
from localrun.engine import faults
from localrun.engine.kv.pool import table_width

log = logging.getLogger("localrun.engine")

ATTENTION_KERNELS = ("store_kv", "paged_decode_attention", "extend_attention")
POINTWISE_KERNELS = ("fused_add_rmsnorm", "apply_rope", "silu_and_mul", "gelu_tanh_and_mul", "rms_norm")
SAMPLER_KERNELS = ("sample_temperature",)  # every model's sampler
MATMUL_KERNELS = ("gemv",)  # every model's linear layers at one row (layers/ops.Ops.linear)
MOE_KERNELS = ("moe_route", "fused_moe")  # a mixture of experts' router and experts (layers/moe.py)
KERNELS = ATTENTION_KERNELS + POINTWISE_KERNELS + SAMPLER_KERNELS + MATMUL_KERNELS + MOE_KERNELS
REASON_CHARS = 240  # a fallback's reason is cut to this many characters
FP8_STORE_TOL = 0.13  # e4m3 keeps 3 mantissa bits: two roundings of one value may differ by a step (1/8)


def short(exc: BaseException) -> str:
    """`Type: message`, on one line and bounded (a Triton compile error can run to pages)."""
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= REASON_CHARS else text[:REASON_CHARS - 3] + "..."


def is_out_of_memory(exc: BaseException) -> bool:
    """An allocation the device (or host) refused: CUDA's OutOfMemoryError, MemoryError, the CPU allocator's error."""
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("out of memory" in text.lower() or "can't allocate memory" in text)


def release_memory(device: torch.device) -> None:
    """Hand cached blocks back, so that a retry sees what is really free."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


# -- kernels ---------------------------------------------------------------------------------
def _inputs(cfg, dtype: torch.dtype, kv_dtype: torch.dtype, page_size: int, device) -> dict:
    """Tiny inputs in the model's shapes (heads, head_dim) and dtypes: two sequences over a few
    pages, one decode token each, a chunk of 5 new tokens each.

    Triton compiles a kernel once per variant: per constexpr, per argument dtype, and per integer
    argument that is 1, a multiple of 16, or neither. The inputs take the steps' dtypes and kinds of
    integers (the page table's row width: kv.pool.table_width, as PageTable's), and every
    variant the model launches (q- and k-shaped head norms, each kind of attention layer), so the
    trials compile what the steps launch and the profiling step compiles nothing
    (tests/test_kernels.py checks it with the CUDA backend's own rules)."""
    g = torch.Generator().manual_seed(0)

    def rnd(*shape, dt=dtype):
        return torch.randn(*shape, generator=g).to(dtype=dt, device=device)

    hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    lens = [page_size + 3, 7]
    pages = [-(-n // page_size) for n in lens]
    num_pages = sum(pages) + 1
    table = torch.zeros((2, table_width(max(pages))), dtype=torch.int32)
    order, slots = list(range(num_pages - 1, 0, -1)), []
    for b, n in enumerate(lens):
        table[b, :pages[b]] = torch.tensor([order.pop() for _ in range(pages[b])], dtype=torch.int32)
        slots += [int(table[b, p // page_size]) * page_size + p % page_size for p in range(n)]
    quant = kv_dtype in (torch.int8, torch.float8_e4m3fn)
    shape = (num_pages, page_size, hkv, d)
    T = sum(lens)
    x = rnd(T, cfg.hidden_size)
    norm_dt = torch.float32 if cfg.is_gemma else dtype  # Gemma keeps its norms' (1 + weight) in float32
    return {
        "lens": lens, "table": table.to(device), "slots": torch.tensor(slots, dtype=torch.int32, device=device),
        "k": rnd(T, hkv, d), "v": rnd(T, hkv, d), "q": rnd(T, hq, d),
        "q_dec": rnd(2, hq, d), "q_ext": rnd(10, hq, d),
        "cache_shape": shape, "kv_dtype": kv_dtype, "quant": quant, "device": device,
        "x": x, "res": rnd(T, cfg.hidden_size),
        "w": 1 + rnd(cfg.hidden_size, dt=norm_dt) / 4, "hw": 1 + rnd(d, dt=norm_dt) / 4,
        "gate_up": rnd(T, 2 * cfg.intermediate_size), "pos": torch.arange(T, dtype=torch.int32, device=device) % 64,
        "cos_sin": kernels.rope_cos_sin_cache(d, 64, 10000.0, device=device, dtype=dtype, rotary_dim=cfg.rotary_dim),
        "scale": d ** -0.5,
        # (window, softcap) of each kind of attention layer the model has (SLIDING / SOFTCAP are constexprs)
        "attn": sorted({(cfg.layer_window(i), float(cfg.attn_logit_softcap or 0.0)) for i in range(cfg.num_layers)}),
        # gpt-oss's attention sinks (a SINKS constexpr in both attention kernels): float32, one per query head
        "sinks": rnd(hq, dt=torch.float32) if cfg.attention_sinks else None,
        "head_norm_by_add_rmsnorm": bool(cfg.is_gemma and cfg.qk_norm),  # Gemma 3's q/k norms (models/gemma.py)
        # the sampler's logits (made in _run, only when it is tried): the model's vocabulary on a GPU (the
        # kernel variant its steps launch), narrow under the interpreter (it runs a program at a time)
        "vocab": cfg.vocab_size if torch.device(device).type == "cuda" else 64,
        # the linear layers' input widths (the kernel's variant depends on K alone) and whether qkv has a bias
        "gemv_k": sorted({cfg.hidden_size, cfg.num_heads * d, cfg.intermediate_size}), "qkv_bias": bool(cfg.attention_bias),
        "dtype": dtype,
        "moe": _moe_shape(cfg, device),
    }


def _caches(inp: dict, store: Callable) -> tuple:
    dev, dt = inp["device"], inp["kv_dtype"]
    k_cache = torch.zeros(inp["cache_shape"], dtype=dt, device=dev)
    v_cache = torch.zeros(inp["cache_shape"], dtype=dt, device=dev)
    ks = vs = None
    if inp["quant"]:
        ks = torch.ones(inp["cache_shape"][:3], dtype=kernels.KV_SCALE_DTYPE, device=dev)
        vs = torch.ones(inp["cache_shape"][:3], dtype=kernels.KV_SCALE_DTYPE, device=dev)
    store(inp["k"], inp["v"], k_cache, v_cache, inp["slots"], ks, vs)
    return k_cache, v_cache, ks, vs


def _dense(t: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    return t.float() * scale.float()[..., None] if scale is not None else t.float()


def _run(name: str, fn: Callable, inp: dict) -> list[torch.Tensor]:
    """Kernel `name` (Triton or reference, as `fn`) on the tiny inputs; its outputs as float tensors."""
    ref_store = kernels.store_kv_ref
    if name == "store_kv":
        k_cache, v_cache, ks, vs = _caches(inp, fn)
        return [_dense(k_cache, ks), _dense(v_cache, vs)]
    k_cache, v_cache, ks, vs = _caches(inp, ref_store)
    lens = torch.tensor(inp["lens"], dtype=torch.int32, device=inp["device"])
    sinks = {} if inp["sinks"] is None else {"sinks": inp["sinks"]}
    if name == "paged_decode_attention":
        return [fn(inp["q_dec"], k_cache, v_cache, inp["table"], lens, inp["scale"], k_scale=ks, v_scale=vs,
                   window=w, softcap=c, **sinks).float() for w, c in inp["attn"]]
    if name == "extend_attention":  # the last 5 tokens of each sequence are new
        cu = torch.tensor([0, 5, 10], dtype=torch.int32, device=inp["device"])
        return [fn(inp["q_ext"], k_cache, v_cache, inp["table"], cu, lens, inp["scale"], max_q_len=5, k_scale=ks,
                   v_scale=vs, window=w, softcap=c, **sinks).float() for w, c in inp["attn"]]
    if name == "sample_temperature":  # each row has a winner no draw can miss; even rows greedy
        x = torch.randn(4, inp["vocab"], generator=torch.Generator().manual_seed(1)).to(inp["device"])
        rows = torch.arange(x.shape[0], device=x.device)
        x[rows, (rows * 7) % x.shape[1]] += 100.0
        temp = (rows % 2).to(torch.float32)
        return [fn(x, temp, 1234).float()]
    if name == "gemv":  # one row times 16 rows of weights, at each input width the model has
        g, dev, dt = torch.Generator().manual_seed(2), inp["device"], inp["dtype"]
        out = []
        for k in inp["gemv_k"]:
            x, w = torch.randn(1, k, generator=g), torch.randn(16, k, generator=g) / k ** 0.5
            out.append(fn(x.to(dev, dt), w.to(dev, dt)).float())
            if inp["qkv_bias"] and k == inp["x"].shape[1]:  # qkv's bias (Qwen2)
                out.append(fn(x.to(dev, dt), w.to(dev, dt), torch.randn(16, generator=g).to(dev, dt)).float())
        return out
    if name == "fused_moe":
        return _run_moe(fn, inp)
    if name == "moe_route":  # the weights, and the logits the ids pick (equal logits may swap their experts)
        m, g = inp["moe"], torch.Generator().manual_seed(4)
        out = []
        for T in m["tokens"]:
            logits = torch.randn(T, m["E"], generator=g).to(inp["device"], inp["dtype"])
            w, ids = fn(logits, m["k"], scoring=m["scoring"], renormalize=m["renormalize"])
            out += [w.float(), logits.gather(1, ids.long()).float()]
        return out
    if name == "fused_add_rmsnorm":  # with a residual, and without (the first layer's)
        out = [t.float() for t in fn(inp["x"].clone(), inp["res"].clone(), inp["w"], 1e-6)]
        out.append(fn(inp["x"].clone(), None, inp["w"], 1e-6)[0].float())
        if inp["head_norm_by_add_rmsnorm"]:  # per head: [T * heads, head_dim]
            out.append(fn(inp["q"].reshape(-1, inp["q"].shape[-1]), None, inp["hw"], 1e-6)[0].float())
        return out
    if name == "rms_norm":  # q's heads and k's
        return [fn(inp["q"].clone(), inp["hw"], 1e-6).float(), fn(inp["k"].clone(), inp["hw"], 1e-6).float()]
    if name == "apply_rope":
        return [t.float() for t in fn(inp["q"].clone(), inp["k"].clone(), inp["pos"], inp["cos_sin"])]
    return [fn(inp["gate_up"].clone()).float()]  # silu_and_mul, gelu_tanh_and_mul


def _moe_shape(cfg, device) -> dict:
    """The router's and the experts' trials: on a GPU the model's experts, top-k and widths, and one token count per tile
    configuration kernels/moe.config picks (a decode step's, then 8, 32 and 64 tokens per expert), so
    the trials compile the variants the steps launch; under the interpreter 8 tiny experts, top-2, at one
    token and at 40 (several blocks of one expert). Activation and biases (gpt-oss's clamped SwiGLU
    comes with biases) as the model's."""
    act = cfg.moe_activation
    kind = {"activation": act, "bias": act == "swiglu_oai", "scoring": cfg.moe_scoring,
            "renormalize": cfg.norm_topk_prob}
    if torch.device(device).type != "cuda" or not cfg.is_moe:
        return {"E": 8, "k": 2, "H": 64, "I": 32, "tokens": (1, 40), **kind}
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    tokens = (1,) + tuple(sorted({max(17, -(-per * E // k)) for per in (8, 32, 64)}))
    return {"E": E, "k": k, "H": cfg.hidden_size, "I": cfg.moe_intermediate_size or cfg.intermediate_size,
            "tokens": tokens, **kind}


def _run_moe(fn: Callable, inp: dict) -> list[torch.Tensor]:
    """The experts' kernel at each token count of inp["moe"], the last expert never routed to. One
    expert's random weights stand for all of them (a stride-0 expand: the model's shapes in little memory)."""
    g, dev, dt, m = torch.Generator().manual_seed(3), inp["device"], inp["dtype"], inp["moe"]
    E, H, I, k = m["E"], m["H"], m["I"], m["k"]

    def experts(*shape, scale=1.0):
        one = (torch.randn(1, *shape, generator=g) * scale).to(dev, dt)
        return one.expand(E, *shape)

    w13, w2 = experts(2 * I, H, scale=H ** -0.5), experts(H, I, scale=I ** -0.5)
    b13, b2 = (experts(2 * I), experts(H)) if m["bias"] else (None, None)
    out = []
    for T in m["tokens"]:
        logits = torch.randn(T, E, generator=g)
        logits[:, E - 1] = -1e4
        weights, ids = kernels.moe_route_ref(logits, k)
        out.append(fn(torch.randn(T, H, generator=g).to(dev, dt), w13, w2, weights.to(dev), ids.to(dev),
                      activation=m["activation"], w13_bias=b13, w2_bias=b2).float())
    return out


def try_kernels(cfg, dtype: torch.dtype, kv_dtype: torch.dtype, page_size: int, device,
                record: Callable[[str], None], names: tuple[str, ...] = KERNELS,
                threads: int = 1) -> frozenset[str]:
    """Compile and launch each Triton kernel in `names` once on tiny inputs and compare it with
    its torch reference; return the names of those that raised (or disagree), which then run
    their reference for this load. Each one is `record`ed with its reason.

    threads > 1 (CUDA): the trials after the first run on that many threads. With an empty
    Triton cache each trial is a compile of a second or more, and Triton's compiler and the
    launcher's C build release the GIL for part of it. A trial that fails there is tried again
    alone before it counts (a failure of the threads, not of the kernel, must not cost speed)."""
    injected = {a for a in faults.active("kernel") if a}
    inp = _inputs(cfg, dtype, kv_dtype, page_size, device)
    tol = 1e-3 if dtype == torch.float32 else 5e-2

    def trial(name: str) -> str | None:
        try:
            if name in injected:
                raise faults.InjectedFault(f"injected compile failure of the Triton kernel {name} (LOCALRUN_FAULTS)")
            got = _run(name, getattr(kernels, name), inp)
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # a launch failure shows here, not later in a step
            want = _run(name, getattr(kernels, f"{name}_ref"), inp)
            err = max(float(((a - b).abs().max() / b.abs().max().clamp_min(1e-6))) for a, b in zip(got, want))
            limit = FP8_STORE_TOL if name == "store_kv" and kv_dtype == torch.float8_e4m3fn else tol
            if not err <= limit:  # NaN too
                return f"its output differs from the torch reference (relative error {err:.3g} > {limit:g})"
            return None
        except Exception as exc:  # noqa: BLE001 - any failure of this kernel: use its reference
            return f"Triton compile/launch failed at warm-up: {short(exc)}"

    names = tuple(names)
    reasons: dict[str, str | None] = {}
    if names:  # the first alone: it sets up Triton's driver (its launcher utilities), shared by all
        reasons[names[0]] = trial(names[0])
    rest = names[1:]
    if threads > 1 and len(rest) > 1:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(min(threads, len(rest)), thread_name_prefix="localrun-kernel-trial") as pool:
            reasons.update(zip(rest, pool.map(trial, rest)))
        for name in rest:
            if reasons[name] is not None and name not in injected:
                reasons[name] = trial(name)
    else:
        reasons.update((name, trial(name)) for name in rest)
    failed = set()
    for name in names:
        if reasons[name] is not None:
            failed.add(name)
            record(f"kernel {name}: torch reference ({reasons[name]})")
    return frozenset(failed)


# -- the KV pool -----------------------------------------------------------------------------
def allocate_pool(make: Callable[[int], object], pages: int, floor: int, device: torch.device,
                  record: Callable[[str], None], what: str = "KV cache") -> object:
    """`make(pages)`, retried at half the pages (never below `floor`) while the allocation is
    refused as out of memory; a smaller pool is `record`ed once. MemoryError, naming the memory
    and the settings to change, when even `floor` pages do not fit."""
    first, failure = pages, None
    while True:
        try:
            if faults.take("kv_alloc"):
                raise torch.OutOfMemoryError(f"injected: allocating {pages} KV pages failed (LOCALRUN_FAULTS kv_alloc)")
            pool = make(pages)
        except Exception as exc:  # noqa: BLE001 - only out-of-memory is retried
            if not is_out_of_memory(exc):
                raise
            failure = failure or short(exc)
            release_memory(device)
            if pages <= floor:
                where = "GPU" if device.type == "cuda" else "host"
                raise MemoryError(
                    f"not enough {where} memory for a {what} of {pages} pages (one sequence of the full context), "
                    f"even after retrying smaller from {first} pages: {short(exc)}; lower num_ctx, use "
                    f"LOCALRUN_KV_CACHE_TYPE=int8, or free memory (`localrun stop` other models)") from None
            pages = max(floor, pages // 2)
            continue
        if pages < first:
            record(f"{what}: {pages} pages instead of {first} (allocating {first} failed: {failure})")
        return pool


# -- out of memory in a step -----------------------------------------------------------------
def shrink_after_oom(engine) -> str:
    """After a step ran out of memory (its requests already aborted): halve the step's token
    budget and the batch, and the KV pool when no page is held any more (the prefix cache is
    dropped first); the decode graphs are captured again for the new sizes. Returns what was
    shrunk, in words. MemoryError when not even one full-length sequence's pages fit now."""
    cfg, pool, runner = engine.config, engine.pool, engine.runner
    done = []
    seqs, tokens = cfg.max_num_seqs, cfg.max_num_batched_tokens
    cfg.max_num_seqs = max(1, seqs // 2)
    cfg.max_num_batched_tokens = max(min(tokens, 64), tokens // 2)
    done.append(f"shrank its batch to {cfg.max_num_seqs} sequences (from {seqs}) and {cfg.max_num_batched_tokens} "
                f"tokens a step (from {tokens})")
    if engine.cache is not None:
        engine.cache.reset()
    graphs = runner.graphs
    floor = -(-cfg.max_model_len // cfg.page_size) + 1  # one full-length sequence
    if pool.num_free == pool.num_pages and pool.num_pages > floor:
        old = pool.num_pages
        runner.graphs = None  # captured graphs hold the old pages' addresses
        release_memory(engine.device)

        def make(n: int):
            pool.resize(n)
            return pool

        allocate_pool(make, max(floor, old // 2), floor, engine.device, lambda _: None)
        if engine.host_pool is not None:
            engine.host_pool.rebind(pool)
        done.append(f"its KV cache to {pool.num_pages} pages (from {old})")
    if graphs is not None and (runner.graphs is None or graphs.sizes != cfg.graph_batch_sizes()):
        runner.graphs = None
        runner.setup_graphs(graphs.capture)
    return ", ".join(done)
