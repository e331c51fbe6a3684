"""Quantized KV cache (EngineConfig.kv_cache_dtype fp8 / int8): the reference quantizer's error
bounds, the torch reference attention over quantized pages, the Triton store / decode / extend
kernels against it (tiny shapes; in Triton's CPU interpreter via a subprocess, as in
test_kernels.py), the pool's size accounting, the engine's greedy agreement on a tiny random
model, and the settings' validation."""

from __future__ import annotations

import asyncio
import importlib.util
import math
import os
import re
import subprocess
import sys

import pytest
import torch

from localrun.kernels import ops as K
from localrun.engine import EngineConfig, LLMEngine, SamplingParams
from localrun.engine.config import ModelConfig
from localrun.engine.kv.pool import KVPool

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA and not INTERPRETED else "cpu"
QDTYPES = [torch.int8, torch.float8_e4m3fn]
TINY = ModelConfig(64, 2, 4, 2, 128, 300, rope_theta=10000.0)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def rel_err(out, oracle) -> float:
    out, oracle = out.double().cpu(), oracle.double().cpu()
    assert not out.isnan().any(), "output has NaN"
    return float((out - oracle).abs().max() / oracle.abs().max())


def quantized_pool(seq_lens, hkv, d, page_size, qdtype, device, write=K.store_kv_ref, kv_scale=1.0):
    """Sequences of random K/V written through `write` into shuffled pages of a quantized pool
    whose unwritten values are garbage and unwritten scales NaN (a read of a wrong slot shows)."""
    pages = [math.ceil(n / page_size) for n in seq_lens]
    num_pages = sum(pages) + 2
    perm = torch.randperm(num_pages).tolist()
    table = torch.zeros((len(seq_lens), max(1, max(pages))), dtype=torch.int32)
    slots = []
    for b, n in enumerate(seq_lens):
        table[b, : pages[b]] = torch.tensor([perm.pop() for _ in range(pages[b])], dtype=torch.int32)
        slots += [int(table[b, p // page_size]) * page_size + p % page_size for p in range(n)]
    shape = (num_pages, page_size, hkv, d)
    caches = [torch.randint(-100, 100, shape, dtype=torch.int8).view(torch.uint8).to(device) for _ in range(2)]
    caches = [c.view(qdtype) for c in caches]
    scales = [torch.full(shape[:3], float("nan"), device=device) for _ in range(2)]
    # heads of very different magnitudes: one scale per head matters
    mag = torch.logspace(-1, 1, hkv)[None, :, None] * kv_scale
    k = torch.randn(sum(seq_lens), hkv, d) * mag
    v = torch.randn(sum(seq_lens), hkv, d) * mag
    slots_t = torch.tensor(slots, dtype=torch.int64, device=device)
    write(k.to(device), v.to(device), caches[0], caches[1], slots_t, scales[0], scales[1])
    return k, v, caches, scales, table.to(device), torch.tensor(seq_lens, dtype=torch.int32, device=device), slots_t


# --------------------------------------------------------------------------- reference quantizer

@pytest.mark.parametrize("qdtype", QDTYPES)
def test_quantize_round_trip_error_bounds(qdtype):
    x = torch.randn(64, 3, 96) * torch.tensor([1e-3, 1.0, 300.0])[None, :, None]
    x[5, 1] = 0.0  # an all-zero vector
    q, s = K.quantize_kv_ref(x, qdtype)
    assert q.dtype == qdtype and s.dtype == torch.float32 and s.shape == x.shape[:2]
    back = K.dequantize_kv_ref(q, s)
    err = (back - x).abs()
    amax = x.abs().amax(-1, keepdim=True)
    if qdtype == torch.int8:  # uniform grid of step amax/127: at most half a step off
        assert int(q.view(torch.int8).abs().max()) == 127
        assert bool((err <= amax / 254 * (1 + 1e-5) + 1e-12).all())
    else:  # e4m3: 3 mantissa bits, relative error <= 2^-4; subnormals (below 2^-6 * scale): <= 2^-10 * scale
        assert float(q.float().abs().max()) == 448.0
        bound = torch.maximum(x.abs() * 2**-4, s[..., None] * 2**-10) * (1 + 1e-5)
        assert bool((err <= bound).all())
    assert torch.equal(back[5, 1], torch.zeros(96)) and bool(s.isfinite().all())
    # the bound is tight: the error is not zero
    assert float(err.max()) > 0


@pytest.mark.parametrize("qdtype", QDTYPES)
def test_reference_attention_over_quantized_pages(qdtype):
    """Decode and extend over quantized pages = the same attention over dequantized values, and
    close to attention over the unquantized K/V (int8 much closer than fp8; over 20 seeds the
    worst errors were 0.052 and 0.17, the means 0.018 and 0.083)."""
    hkv, hq, d, P = 2, 4, 32, 4
    seq_lens = [1, 9, 23]
    k, v, (kc, vc), (ks, vs), table, lens, slots = quantized_pool(seq_lens, hkv, d, P, qdtype, "cpu")
    assert torch.equal(ks.view(-1, hkv)[slots], K.quantize_kv_ref(k, qdtype)[1])
    # the same pool unquantized (fp32), and holding the dequantized values
    exact = [torch.zeros(kc.shape) for _ in range(2)]
    K.store_kv_ref(k, v, exact[0], exact[1], slots)
    deq = [torch.zeros(kc.shape) for _ in range(2)]
    K.store_kv_ref(K.dequantize_kv_ref(*K.quantize_kv_ref(k, qdtype)),
                   K.dequantize_kv_ref(*K.quantize_kv_ref(v, qdtype)), deq[0], deq[1], slots)
    scale = d ** -0.5
    q = torch.randn(3, hq, d)
    out = K.paged_decode_attention_ref(q, kc, vc, table, lens, scale, k_scale=ks, v_scale=vs)
    assert rel_err(out, K.paged_decode_attention_ref(q, *deq, table, lens, scale)) < 1e-6
    tol = 0.06 if qdtype == torch.int8 else 0.25
    assert rel_err(out, K.paged_decode_attention_ref(q, *exact, table, lens, scale)) < tol
    # extend: the last 5 / 1 / 7 tokens of each sequence are new
    q_lens = [1, 5, 7]
    cu = torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32)
    qe = torch.randn(sum(q_lens), hq, d)
    out = K.extend_attention_ref(qe, kc, vc, table, cu, lens, scale, k_scale=ks, v_scale=vs)
    assert rel_err(out, K.extend_attention_ref(qe, *deq, table, cu, lens, scale)) < 1e-6
    assert rel_err(out, K.extend_attention_ref(qe, *exact, table, cu, lens, scale)) < tol


def test_store_ref_refuses_a_quantized_cache_without_scales():
    kc = torch.zeros(2, 4, 1, 8, dtype=torch.int8)
    with pytest.raises(ValueError, match="needs its scale"):
        K.store_kv_ref(torch.randn(1, 1, 8), torch.randn(1, 1, 8), kc, kc.clone(), torch.tensor([0]))


# --------------------------------------------------------------------------- pool and budget

def test_pool_pages_for_a_budget_grow_with_quantization():
    cfg = ModelConfig(576, 30, 9, 3, 1536, 49152)  # SmolLM2-135M: head_dim 64, 3 KV heads
    budget, P = 64 * 2**20, 16
    pages = {dt: KVPool.pages_for_budget(cfg, budget, P, dt)
             for dt in (torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.int8)}
    assert pages[torch.float8_e4m3fn] == pages[torch.int8]
    # 64 one-byte values + a 4-byte scale per head vector, vs 128 (bf16) and 256 (fp32) bytes
    assert pages[torch.int8] == budget // (P * 2 * 30 * 3 * (64 + 4))
    assert 1.85 < pages[torch.int8] / pages[torch.bfloat16] < 2.0
    assert 3.7 < pages[torch.int8] / pages[torch.float32] < 4.0
    pool = KVPool(TINY, 5, P, torch.int8, "cpu")
    tensors = pool.page_tensors()
    assert len(tensors) == 4 * TINY.num_layers and all(t.shape[0] == 5 for t in tensors)
    assert pool.nbytes == 5 * P * TINY.kv_bytes_per_token(torch.int8)
    assert pool.layers[1] == (pool.k_caches[1], pool.v_caches[1], pool.k_scales[1], pool.v_scales[1])
    plain = KVPool(TINY, 5, P, torch.float32, "cpu")
    assert len(plain.page_tensors()) == 2 * TINY.num_layers and plain.layers[0][2] is None
    assert plain.nbytes == 5 * P * TINY.kv_bytes_per_token(torch.float32)


def test_engine_kv_budget_counts_the_quantized_size():
    budget = 40 * 16 * TINY.kv_bytes_per_token(torch.float32)
    cfg = dict(device="cpu", max_model_len=128, kv_memory_bytes=budget)
    model = LLMEngine.from_random(TINY, EngineConfig(**cfg), seed=0).model
    n = {kv: LLMEngine(model, TINY, EngineConfig(**cfg, kv_cache_dtype=kv), None) for kv in ("auto", "bf16", "int8")}
    assert n["auto"].pool.num_pages == 40 and n["auto"].stats()["kv_dtype"] == "fp32"
    assert n["bf16"].pool.num_pages == 80 and n["bf16"].stats()["kv_dtype"] == "bf16"
    # head_dim 16: 16 one-byte values + a 4-byte scale per head vector vs 64 bytes in fp32
    assert n["int8"].pool.num_pages == budget // (16 * TINY.kv_bytes_per_token(torch.int8)) == 128
    assert n["int8"].stats()["kv_dtype"] == "int8" and n["int8"].stats()["kv_bytes"] <= budget


# --------------------------------------------------------------------------- settings

def test_bad_kv_cache_setting_is_a_clear_error():
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of auto, bf16, fp16, fp32, fp8, int8.*'q4_0'"):
        EngineConfig(device="cpu", kv_cache_dtype="q4_0")
    assert EngineConfig(device="cpu", kv_cache_dtype="q8_0").kv_torch_dtype == torch.int8  # Ollama's name
    assert EngineConfig(device="cpu", kv_cache_dtype="FP8").kv_torch_dtype == torch.float8_e4m3fn
    assert EngineConfig(device="cpu", dtype="bfloat16").kv_torch_dtype == torch.bfloat16


def test_env_var_is_validated_and_listed():
    from localrun.config import ENV_VARS, settings

    assert "LOCALRUN_KV_CACHE_TYPE" in ENV_VARS
    assert settings({}).kv_cache_type == "auto"
    assert settings({"LOCALRUN_KV_CACHE_TYPE": " Int8 "}).kv_cache_type == "int8"
    assert settings({"LOCALRUN_KV_CACHE_TYPE": "f16"}).kv_cache_type == "fp16"
    assert settings({"LOCALRUN_KV_CACHE_TYPE": "q4_0"}).kv_cache_type == "q4_0"  # llama.cpp's (int8 natively)
    with pytest.raises(ValueError, match=r"LOCALRUN_KV_CACHE_TYPE must be one of .*fp8.*int8.*'q4_1'"):
        settings({"LOCALRUN_KV_CACHE_TYPE": "q4_1"})
    assert ("LOCALRUN_KV_CACHE_TYPE", "fp8") in settings({"LOCALRUN_KV_CACHE_TYPE": "fp8"}).describe()


# --------------------------------------------------------------------------- engine, tiny random model

def test_engine_greedy_with_quantized_kv_agrees_with_unquantized():
    """Teacher-forced next-token
    agreement at every third position (fp8 and int8: each from the unquantized run's own prefix,
    so one early flip does not decide the rest). The random model's logit margins are small (often < 0.05):
    these bounds fail if quantization noise were much larger than it should be. cuda_graphs=True
    runs the padded static-buffer decode (eager on CPU) for fp8."""
    cfg = dict(device="cpu", max_model_len=256, max_num_batched_tokens=64)
    base = LLMEngine.from_random(TINY, EngineConfig(**cfg), seed=5)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (5, 40, 90, 17)]
    ref = [o.token_ids for o in base.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))]
    forced = [p + r[:i] for p, r in zip(prompts, ref) for i in range(0, len(r), 3)]
    want = [r[i] for r in ref for i in range(0, len(r), 3)]
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    # measured: int8 32/32, fp8 28/32 (a run with the scales ignored would agree by chance only)
    for kv, graphs, bound in (("int8", False, 0.95), ("fp8", True, 0.75)):
        eng = LLMEngine(base.model, TINY, EngineConfig(**cfg, kv_cache_dtype=kv, cuda_graphs=graphs), None)
        assert eng.pool.quantized
        got = [o.token_ids[0] for o in eng.generate(forced, one)]
        agree = sum(a == b for a, b in zip(got, want)) / len(want)
        print(f"{kv}: teacher-forced agreement {agree:.3f} over {len(want)} positions")
        assert agree >= bound, (kv, agree)
        if kv == "int8":  # free-running: every request completes in full (agreement of free-running
            # greedy on a random model is decided by near-ties: the real model's is measured by bench kv-quant)
            outs = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
            assert [len(o.token_ids) for o in outs] == [24] * len(prompts)
        assert eng.pool.num_free + (eng.cache.num_pages if eng.cache else 0) == eng.pool.num_pages


# --------------------------------------------------------------------------- Triton (tiny)

@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (pip install triton)")
@pytest.mark.skipif(INTERPRETED or HAS_CUDA, reason="TestTritonQuant runs in this process (interpreter or GPU)")
def test_triton_quant_kernels_in_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", f"{__file__}::TestTritonQuant", "-q", "-p", "no:cacheprovider", "-x"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    tail = (r.stdout + r.stderr)[-8000:]
    assert r.returncode == 0, tail
    summary = r.stdout.strip().splitlines()[-1]
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) >= 8 and "skipped" not in summary, tail


@pytest.mark.skipif(not HAS_TRITON or not (INTERPRETED or HAS_CUDA),
                    reason="Triton tests run on a GPU, or under TRITON_INTERPRET=1 via the test above")
class TestTritonQuant:
    @pytest.mark.parametrize("qdtype", QDTYPES)
    def test_store_kv(self, qdtype):
        if HAS_CUDA and qdtype == torch.float8_e4m3fn and torch.cuda.get_device_capability() < (8, 9):
            pytest.skip("fp8 conversion needs compute capability 8.9+")
        T, hkv, d = 7, 3, 24  # head count and dim not powers of two
        kv = torch.randn(T, 3 * hkv, d, device=DEVICE) * torch.logspace(-2, 2, 3 * hkv, device=DEVICE)[None, :, None]
        k, v = kv[:, :hkv], kv[:, hkv: 2 * hkv]  # strided views, as sliced from a fused qkv
        slots = torch.randperm(4 * 4)[:T].to(DEVICE)
        slots[2] = -1
        shape = (4, 4, hkv, d)
        out = [torch.zeros(shape, dtype=qdtype, device=DEVICE) for _ in range(4)]
        sc = [torch.full(shape[:3], -1.0, device=DEVICE) for _ in range(4)]
        K.store_kv(k, v, out[0], out[1], slots, sc[0], sc[1])
        K.store_kv_ref(k, v, out[2], out[3], slots, sc[2], sc[3])
        for a, b in ((0, 2), (1, 3)):
            torch.testing.assert_close(sc[a], sc[b], rtol=1e-6, atol=0)
            assert int((sc[a] == -1).sum()) == (16 - (T - 1)) * hkv  # padding and unused slots untouched
            # the same value, or (a division rounded the other way at a tie) one step apart
            diff = (out[a].float() - out[b].float()).abs()
            step = 1.0 if qdtype == torch.int8 else out[b].float().abs() * 2**-3 + 2**-9
            assert bool((diff <= step).all()) and float((diff > 0).float().mean()) < 0.01

    @pytest.mark.parametrize("qdtype", QDTYPES)
    @pytest.mark.parametrize("qtype", [torch.float32, torch.bfloat16])
    def test_paged_decode_attention(self, qdtype, qtype):
        if HAS_CUDA and qdtype == torch.float8_e4m3fn and torch.cuda.get_device_capability() < (8, 9):
            pytest.skip("fp8 conversion needs compute capability 8.9+")
        hkv, hq, d, P = 2, 6, 32, 4
        _, _, (kc, vc), (ks, vs), table, lens, _ = quantized_pool([1, 19, 0, 8], hkv, d, P, qdtype, DEVICE,
                                                                  write=K.store_kv)
        q = torch.randn(4, hq, d, device=DEVICE).to(qtype)
        out = K.paged_decode_attention(q, kc, vc, table, lens, d ** -0.5, num_kv_splits=3, k_scale=ks, v_scale=vs)
        oracle = K.paged_decode_attention_ref(q.float(), kc, vc, table, lens, d ** -0.5, k_scale=ks, v_scale=vs)
        assert out.dtype == qtype
        assert rel_err(out, oracle) <= (1e-5 if qtype == torch.float32 else 1e-2)
        assert torch.equal(out[2].float(), torch.zeros_like(out[2].float()))  # the empty row

    @pytest.mark.parametrize("qdtype", QDTYPES)
    @pytest.mark.parametrize("qtype", [torch.float32, torch.bfloat16])
    def test_extend_attention(self, qdtype, qtype):
        if HAS_CUDA and qdtype == torch.float8_e4m3fn and torch.cuda.get_device_capability() < (8, 9):
            pytest.skip("fp8 conversion needs compute capability 8.9+")
        hkv, hq, d, P = 2, 4, 16, 4
        spans = [(0, 7), (12, 7), (3, 1), (20, 19)]  # (cached prefix, new tokens)
        lens_list = [a + b for a, b in spans]
        _, _, (kc, vc), (ks, vs), table, lens, _ = quantized_pool(lens_list, hkv, d, P, qdtype, DEVICE,
                                                                  write=K.store_kv)
        cu = torch.tensor([0] + [b for _, b in spans]).cumsum(0).to(torch.int32).to(DEVICE)
        q = torch.randn(int(cu[-1]), hq, d, device=DEVICE).to(qtype)
        out = K.extend_attention(q, kc, vc, table, cu, lens, d ** -0.5, k_scale=ks, v_scale=vs)
        oracle = K.extend_attention_ref(q.float(), kc, vc, table, cu, lens, d ** -0.5, k_scale=ks, v_scale=vs)
        assert rel_err(out, oracle) <= (1e-5 if qtype == torch.float32 else 1e-2)

    def test_kernels_refuse_missing_scales(self):
        kc = torch.zeros(2, 4, 1, 16, dtype=torch.int8, device=DEVICE)
        with pytest.raises(ValueError, match="needs k_scale"):
            K.paged_decode_attention(torch.randn(1, 1, 16, device=DEVICE), kc, kc.clone(),
                                     torch.zeros(1, 1, dtype=torch.int32, device=DEVICE),
                                     torch.ones(1, dtype=torch.int32, device=DEVICE), 0.25)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (pip install triton)")
@pytest.mark.skipif(INTERPRETED, reason="the interpreter replaces compilation")
@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
def test_quant_kernels_compile_for_h100():
    """The GPU compiler (no GPU needed) accepts the quantized variants at Llama-3.1-8B shapes with
    bf16 queries (what the interpreter cannot show): the store for int8 and fp8, decode over fp8
    pages, extend over int8 pages (the two share attend_kv_block)."""
    from test_kernels import _compile_for_gpu

    from localrun.kernels import decode_attention, extend_attn, kv_store

    bf, h100, i8, f8 = "*bf16", (9, 0), "*i8", "*fp8e4nv"
    for quant, c in ((1, i8), (2, f8)):
        _compile_for_gpu(kv_store._store_kv_kernel, h100, {"Kin": bf, "Vin": bf, "KCache": c, "VCache": c,
                                                           "KScale": "*fp32", "VScale": "*fp32", "SlotMapping": "*i64"},
                         dict(NUM_HEADS=8, HEAD_DIM=128, BLOCK_H=8, BLOCK_D=128, QUANT=quant, INTERP_FP8=False),
                         num_warps=4)
    _compile_for_gpu(
        decode_attention._decode_split_kernel, h100,
        {"Q": bf, "K": f8, "V": f8, "KScale": "*fp32", "VScale": "*fp32", "PageTable": "*i32", "SeqLens": "*i32",
         "MidO": "*fp32", "MidLse": "*fp32", "scale_log2": "fp32", "num_splits": "i32"},
        dict(GROUP=4, HEAD_DIM=128, BLOCK_D=128, BLOCK_H=16, BLOCK_N=32, PAGE_SIZE=16, PRECISION="tf32",
             QUANT=2), num_warps=4, num_stages=2)
    block_m, block_n, warps, stages = extend_attn._default_config(h100, 128)
    _compile_for_gpu(
        extend_attn._extend_kernel, h100,
        {"Q": bf, "K": i8, "V": i8, "KScale": "*fp32", "VScale": "*fp32", "O": bf, "PageTable": "*i32",
         "CuSeqlensQ": "*i32", "SeqLens": "*i32", "Sinks": "*fp32", "scale_log2": "fp32"},
        dict(GROUP=4, HEAD_DIM=128, BLOCK_D=128, BLOCK_M=block_m, BLOCK_N=block_n, PAGE_SIZE=16, PRECISION="tf32",
             QUANT=1, SINKS=False), num_warps=warps, num_stages=stages)


# --------------------------------------------------------------------------- the native backend, real SmolLM2

def test_native_backend_loads_the_configured_kv_type(smollm2_gguf, monkeypatch):
    """LOCALRUN_KV_CACHE_TYPE reaches the memory estimate, the memory plan and the engine at load;
    a bad value is a clear InvalidRequest before anything loads."""
    native = pytest.importorskip("localrun.backends.native")
    from localrun.backends.base import LoadSpec
    from localrun.errors import InvalidRequest
    from localrun.server.memory import plan_load

    spec = LoadSpec(name="smollm2:135m", weights=smollm2_gguf, format="gguf", num_ctx=256, num_parallel=1)
    monkeypatch.setenv("LOCALRUN_KV_CACHE_TYPE", "int8")
    est = native.estimate_memory(spec)
    tokens = 256 * 4
    assert est.kv_type == "int8" and est.kv_bytes == tokens * 30 * 2 * 3 * (64 + 4)  # SmolLM2: 30 layers, 3 KV heads
    plan = plan_load(est, 30, ram_free=64 * 2**30)
    assert "int8 KV cache" in plan.detail
    monkeypatch.setenv("LOCALRUN_KV_CACHE_TYPE", "q4_0")  # llama.cpp's 4-bit blocks: the engine's int8
    assert native.estimate_memory(spec).kv_type == "int8"
    monkeypatch.setenv("LOCALRUN_KV_CACHE_TYPE", "auto")
    assert native.estimate_memory(spec).kv_bytes == tokens * 30 * 2 * 3 * 64 * 4  # fp32 on CPU
    monkeypatch.setenv("LOCALRUN_KV_CACHE_TYPE", "int4")
    with pytest.raises(InvalidRequest, match="LOCALRUN_KV_CACHE_TYPE"):
        native.estimate_memory(spec)
    monkeypatch.delenv("LOCALRUN_KV_CACHE_TYPE")
    spec.extra["kv_cache_type"] = "fp8"
    b = native.load(spec)
    try:
        assert b.engine.pool.dtype == torch.float8_e4m3fn and b.engine.stats()["kv_dtype"] == "fp8"
        assert "KV cache fp8" in b.info.reason
        from localrun.backends.base import GenerationRequest, SamplingOptions

        async def answer() -> str:
            req = GenerationRequest("The capital of France is", SamplingOptions(temperature=0, max_tokens=4))
            return "".join([c.text async for c in b.generate(req)])

        assert "Paris" in asyncio.run(answer())
    finally:
        b._close()


def test_bench_perplexity_pass_matches_a_cacheless_forward():
    """bench kv-quant's teacher-forced pass through the paged cache (chunks of 5: extend over a
    cached prefix) gives the log-probabilities of one cache-free forward over the whole text,
    and frees its pages; over int8 pages it stays close."""
    from localrun.bench.kv_quant import agreement, text_logprobs

    eng = LLMEngine.from_random(TINY, EngineConfig(device="cpu", max_model_len=128), seed=3)
    ids = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    got = torch.tensor(text_logprobs(eng, ids, 5))
    with torch.inference_mode():
        lp = torch.log_softmax(eng.model.compute_logits(eng.runner.hidden_states([ids])[0]), -1)
    want = lp[torch.arange(39), torch.tensor(ids[1:])]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert eng.pool.num_free == eng.pool.num_pages
    q = LLMEngine(eng.model, TINY, EngineConfig(device="cpu", max_model_len=128, kv_cache_dtype="int8"), None)
    assert float((torch.tensor(text_logprobs(q, ids, 1)) - want).abs().max()) < 0.05
    assert agreement([[1, 2, 3], [4, 5, 6]], [[1, 2, 0], [4, 5, 6]]) == (5 / 6, 2.5, 1)
