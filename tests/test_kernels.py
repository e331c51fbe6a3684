"""localrun.kernels: torch references against naive dense math and transformers, and the
Triton kernels against the references.

The Triton tests (class TestTriton) run
  * under Triton's CPU interpreter: test_triton_kernels_in_interpreter starts
    `TRITON_INTERPRET=1 python -m pytest tests/test_kernels.py::TestTriton` in a subprocess, so
    the interpreter setting never leaks into this process or other test modules; or run
    that command yourself to see each case;
  * on a CUDA GPU, in this process, at the same tiny shapes (TestTriton) and at real
    Llama-3.1-8B shapes (the @pytest.mark.gpu tests).
Inputs are fresh random tensors; KV caches start as NaN so a read of a wrong slot shows.
Tolerance: max|out - oracle| / max|oracle| <= 1e-5 in fp32, <= 1e-2 in bf16, where the
oracle is the fp32 reference run on the same (bf16-rounded) inputs.
"""

from __future__ import annotations

import importlib.util
import itertools
import math
import os
import re
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

from localrun.kernels import ops as K
from localrun.kernels import reference

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_CUDA = torch.cuda.is_available()
# Where TestTriton runs its kernels: the GPU when there is one, else the CPU interpreter.
DEVICE = "cuda" if HAS_CUDA and not INTERPRETED else "cpu"
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
DTYPES = [torch.float32, torch.bfloat16]


def rel_err(out: torch.Tensor, oracle: torch.Tensor) -> float:
    out, oracle = out.double().cpu(), oracle.double().cpu()
    assert not out.isnan().any(), "output has NaN"
    return float((out - oracle).abs().max() / oracle.abs().max().clamp_min(1e-30))


def assert_close(out: torch.Tensor, oracle: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.shape == oracle.shape and out.dtype == dtype
    err = rel_err(out, oracle)
    assert err <= TOL[dtype], f"relative error {err:.3g} > {TOL[dtype]} ({dtype})"


@dataclass
class PagedBatch:
    """Sequences with random K/V scattered over shuffled pages of a NaN-initialised pool."""

    k: list[torch.Tensor]  # per sequence [L, Hkv, D] (the tokens in the cache)
    v: list[torch.Tensor]
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    page_table: torch.Tensor  # int32 [B, P], unused entries -1
    seq_lens: torch.Tensor  # int32 [B]
    slots: torch.Tensor  # int64 [sum L], in sequence order


def make_paged_batch(seq_lens, num_kv_heads, head_dim, page_size, dtype, device, spare_pages=3,
                     write=K.store_kv_ref) -> PagedBatch:
    pages_per_seq = [math.ceil(n / page_size) for n in seq_lens]
    num_pages = sum(pages_per_seq) + spare_pages
    perm = torch.randperm(num_pages).tolist()
    table = torch.full((len(seq_lens), max(1, max(pages_per_seq))), -1, dtype=torch.int32)
    slots = []
    for b, n in enumerate(seq_lens):
        table[b, : pages_per_seq[b]] = torch.tensor([perm.pop() for _ in range(pages_per_seq[b])], dtype=torch.int32)
        slots += [int(table[b, p // page_size]) * page_size + p % page_size for p in range(n)]
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    v_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    ks = [torch.randn(n, num_kv_heads, head_dim).to(dtype=dtype, device=device) for n in seq_lens]
    vs = [torch.randn(n, num_kv_heads, head_dim).to(dtype=dtype, device=device) for n in seq_lens]
    slots_t = torch.tensor(slots, dtype=torch.int64, device=device)
    if slots:
        write(torch.cat(ks), torch.cat(vs), k_cache, v_cache, slots_t)
    return PagedBatch(ks, vs, k_cache, v_cache, table.to(device),
                      torch.tensor(seq_lens, dtype=torch.int32, device=device), slots_t)


def dense_attention(q, k, v, q_positions, scale, window=0, softcap=0.0):
    """Naive float64 attention of q [M, Hq, D] at q_positions over k/v [L, Hkv, D] (keys <= position;
    with window W > 0 only keys > position - W; softcap c > 0: scores c * tanh(s / c))."""
    group = q.shape[1] // k.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for i, pos in enumerate(q_positions):
        lo = max(0, pos - window + 1) if window else 0
        for h in range(q.shape[1]):
            keys = k[lo: pos + 1, h // group].double()
            s = keys @ q[i, h].double() * scale
            if softcap:
                s = torch.tanh(s / softcap) * softcap
            w = torch.softmax(s, dim=0)
            out[i, h] = w @ v[lo: pos + 1, h // group].double()
    return out


def extend_inputs(prefix_and_new, num_q_heads, num_kv_heads, head_dim, page_size, dtype, device):
    seq_lens = [p + n for p, n in prefix_and_new]
    batch = make_paged_batch(seq_lens, num_kv_heads, head_dim, page_size, dtype, device)
    q_lens = [n for _, n in prefix_and_new]
    cu = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32).to(device)
    q = torch.randn(sum(q_lens), num_q_heads, head_dim).to(dtype=dtype, device=device)
    return batch, q, cu


def upcast(*tensors):
    return [t.float() for t in tensors]


# --------------------------------------------------------------------------- references

def test_ops_use_torch_references_without_interpreter_on_cpu():
    if INTERPRETED:
        pytest.skip("TRITON_INTERPRET=1 routes CPU tensors to Triton by design")
    assert not K.uses_triton(torch.zeros(1))
    x = torch.randn(3, 8)
    assert torch.equal(K.silu_and_mul(x), K.silu_and_mul_ref(x))


def test_store_kv_ref_writes_slots_and_skips_padding():
    kc = torch.zeros(3, 4, 2, 8)
    vc = torch.zeros(3, 4, 2, 8)
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    K.store_kv_ref(k, v, kc, vc, torch.tensor([9, -1, 2]))
    assert torch.equal(kc[2, 1], k[0]) and torch.equal(vc[0, 2], v[2])
    assert int((kc != 0).any(-1).any(-1).sum()) == 2  # the padding token wrote nothing


@pytest.mark.parametrize("seq_lens,page_size,num_q_heads,num_kv_heads", [
    ([1, 7, 19], 4, 4, 2), ([5, 16, 9], 8, 6, 2), ([3], 4, 2, 2)])
def test_decode_ref_matches_dense(seq_lens, page_size, num_q_heads, num_kv_heads):
    head_dim, scale = 16, 0.3
    batch = make_paged_batch(seq_lens, num_kv_heads, head_dim, page_size, torch.float32, "cpu")
    q = torch.randn(len(seq_lens), num_q_heads, head_dim)
    out = K.paged_decode_attention_ref(q, batch.k_cache, batch.v_cache, batch.page_table, batch.seq_lens, scale)
    for b, n in enumerate(seq_lens):
        dense = dense_attention(q[b:b + 1], batch.k[b], batch.v[b], [n - 1], scale)
        assert rel_err(out[b:b + 1], dense) <= 1e-5


def test_extend_ref_matches_dense_and_decode():
    head_dim, scale, num_q_heads = 16, 0.25, 4
    spans = [(0, 7), (12, 7), (3, 1), (0, 1)]
    batch, q, cu = extend_inputs(spans, num_q_heads, 2, head_dim, 4, torch.float32, "cpu")
    out = K.extend_attention_ref(q, batch.k_cache, batch.v_cache, batch.page_table, cu, batch.seq_lens, scale)
    for b, (prefix, new) in enumerate(spans):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        dense = dense_attention(q[rows], batch.k[b], batch.v[b], range(prefix, prefix + new), scale)
        assert rel_err(out[rows], dense) <= 1e-5
    # A one-token extend is a decode step.
    last = q[cu[1:] - 1]
    decode = K.paged_decode_attention_ref(last, batch.k_cache, batch.v_cache, batch.page_table, batch.seq_lens, scale)
    assert rel_err(out[cu[1:] - 1], decode) <= 1e-6


WINDOW_CAP = [(5, 0.0), (0, 2.0), (7, 1.5), (64, 0.0)]  # (sliding window, soft-cap): 64 covers every sequence


@pytest.mark.parametrize("window,softcap", WINDOW_CAP)
def test_decode_and_extend_ref_window_softcap_match_dense(window, softcap):
    head_dim, scale = 16, 0.3
    seq_lens = [1, 7, 19, 37]
    batch = make_paged_batch(seq_lens, 2, head_dim, 4, torch.float32, "cpu")
    q = torch.randn(len(seq_lens), 4, head_dim)
    out = K.paged_decode_attention_ref(q, batch.k_cache, batch.v_cache, batch.page_table, batch.seq_lens, scale,
                                       window=window, softcap=softcap)
    for b, n in enumerate(seq_lens):
        dense = dense_attention(q[b:b + 1], batch.k[b], batch.v[b], [n - 1], scale, window, softcap)
        assert rel_err(out[b:b + 1], dense) <= 1e-5
    spans = [(0, 7), (12, 7), (3, 1), (0, 19), (9, 30)]
    batch, q, cu = extend_inputs(spans, 4, 2, head_dim, 4, torch.float32, "cpu")
    out = K.extend_attention_ref(q, batch.k_cache, batch.v_cache, batch.page_table, cu, batch.seq_lens, scale,
                                 window=window, softcap=softcap)
    for b, (prefix, new) in enumerate(spans):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        dense = dense_attention(q[rows], batch.k[b], batch.v[b], range(prefix, prefix + new), scale, window, softcap)
        assert rel_err(out[rows], dense) <= 1e-5
    # no cache (embeddings): the same masks
    k, v = batch.k[3], batch.v[3]
    rows = slice(int(cu[3]), int(cu[4]))
    out = reference.causal_attention(q[rows], k, v, scale, softcap=softcap, window=window)
    assert rel_err(out, dense_attention(q[rows], k, v, range(19), scale, window, softcap)) <= 1e-5


def test_window_mask_is_transformers_sliding_window():
    """Key j is visible from query p when p - W < j <= p: transformers' sliding_window_overlay
    (the mask of Mistral, Qwen2, Gemma 2 and Gemma 3 sliding layers)."""
    from transformers.masking_utils import and_masks, causal_mask_function, sliding_window_overlay

    fn = and_masks(sliding_window_overlay(5), causal_mask_function)
    ours = reference.window_mask(torch.arange(12), 12, 5)
    t = lambda i: torch.tensor(i)  # noqa: E731 - the mask functions take index tensors
    theirs = torch.tensor([[bool(fn(t(0), t(0), t(i), t(j))) for j in range(12)] for i in range(12)])
    assert torch.equal(ours, theirs) and int(ours[11].sum()) == 5


def test_rmsnorm_ref_matches_transformers():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(48, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(48))
    x, r = torch.randn(5, 48), torch.randn(5, 48)
    out, new_r = K.fused_add_rmsnorm_ref(x, r, norm.weight.detach(), 1e-6)
    assert torch.equal(new_r, x + r)
    assert rel_err(out, norm(x + r).detach()) <= 1e-6
    out2, same = K.fused_add_rmsnorm_ref(x, None, norm.weight.detach(), 1e-6)
    assert same is x and rel_err(out2, norm(x).detach()) <= 1e-6


@pytest.mark.parametrize("scaling", [None, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}])
def test_rope_ref_matches_transformers(scaling):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    head_dim, base = 64, 500000.0
    params = {"rope_type": "default", "rope_theta": base, **(scaling or {})}
    cfg = LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
                      max_position_embeddings=131072, rope_parameters=params)
    if scaling:
        hf_inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
        ours = K.rope_inv_freq(head_dim, base, scaling)
        assert rel_err(ours, hf_inv_freq) <= 1e-6
        assert not torch.allclose(ours, K.rope_inv_freq(head_dim, base, None))  # scaling did something
    cache = K.rope_cos_sin_cache(head_dim, 300, base, scaling)
    positions = torch.tensor([0, 1, 7, 19, 255, 299])
    q, k = torch.randn(6, 4, head_dim), torch.randn(6, 2, head_dim)
    cos, sin = LlamaRotaryEmbedding(cfg)(q, positions[None])
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    ours_q, ours_k = K.apply_rope_ref(q, k, positions, cache)
    assert rel_err(ours_q, hf_q[0].transpose(0, 1)) <= 1e-5
    assert rel_err(ours_k, hf_k[0].transpose(0, 1)) <= 1e-5


def test_rope_rejects_unknown_scaling():
    with pytest.raises(ValueError, match="dynamic"):
        K.rope_cos_sin_cache(64, 8, 10000.0, {"rope_type": "dynamic", "factor": 4.0})
    with pytest.raises(ValueError, match="original_max_position_embeddings"):  # yarn needs its original length
        K.rope_cos_sin_cache(64, 8, 10000.0, {"rope_type": "yarn", "factor": 4.0})


def test_silu_and_mul_ref_matches_formula():
    x = torch.randn(5, 2 * 40)
    gate, up = x[:, :40].double(), x[:, 40:].double()
    assert rel_err(K.silu_and_mul_ref(x), gate * torch.sigmoid(gate) * up) <= 1e-6


def test_gelu_tanh_and_mul_ref_matches_transformers():
    from transformers.activations import ACT2FN

    x = torch.randn(6, 80) * 4
    assert rel_err(K.gelu_tanh_and_mul_ref(x), ACT2FN["gelu_pytorch_tanh"](x[:, :40]) * x[:, 40:]) <= 1e-6


# --------------------------------------------------------------------------- Triton, tiny shapes

@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (pip install triton)")
@pytest.mark.skipif(INTERPRETED or HAS_CUDA, reason="TestTriton runs in this process (interpreter or GPU)")
def test_triton_kernels_in_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", f"{__file__}::TestTriton", "-q", "-p", "no:cacheprovider", "-x"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    tail = (r.stdout + r.stderr)[-8000:]
    assert r.returncode == 0, tail
    summary = r.stdout.strip().splitlines()[-1]
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) >= 20 and "skipped" not in summary, tail
    print(f"interpreter run: {summary}")


def _compile_for_gpu(kernel, capability: tuple[int, int], types: dict, consts: dict, **options):
    """Compile a @triton.jit kernel down to a cubin for an NVIDIA GPU of this compute capability,
    without a GPU (Triton ships ptxas). Returns the compiled kernel's metadata."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    signature = {n: "constexpr" if n in consts else types.get(n, "i32") for n in kernel.arg_names}
    target = GPUTarget("cuda", capability[0] * 10 + capability[1], 32)
    return compile(ASTSource(kernel, signature, consts), target=target, options=options).metadata


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (pip install triton)")
@pytest.mark.skipif(INTERPRETED, reason="the interpreter replaces compilation")
@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
def test_triton_kernels_compile_for_h100_and_rtx40():
    """The GPU compiler (not the interpreter) accepts every kernel at Llama-3.1-8B shapes in bf16,
    and the extend tiles chosen for each GPU fit its shared memory."""
    from localrun.kernels import activation, decode_attention, extend_attn, kv_store, matvec, rmsnorm, rope, sampling

    bf = "*bf16"
    h100 = (9, 0)
    meta = _compile_for_gpu(
        decode_attention._decode_split_kernel, h100,
        {"Q": bf, "K": bf, "V": bf, "KScale": "*fp32", "VScale": "*fp32", "PageTable": "*i32", "SeqLens": "*i32",
         "MidO": "*fp32", "MidLse": "*fp32", "scale_log2": "fp32", "num_splits": "i32", "softcap_log2": "fp32"},
        dict(GROUP=4, HEAD_DIM=128, BLOCK_D=128, BLOCK_H=16, BLOCK_N=32, PAGE_SIZE=16, PRECISION="tf32", QUANT=0,
             SLIDING=False, SOFTCAP=False),
        num_warps=4, num_stages=2)
    assert meta.shared > 0
    # Gemma 2's attention (head_dim 256, 2 query heads per KV head): sliding window + soft-capping
    _compile_for_gpu(
        decode_attention._decode_split_kernel, h100,
        {"Q": bf, "K": bf, "V": bf, "KScale": "*fp32", "VScale": "*fp32", "PageTable": "*i32", "SeqLens": "*i32",
         "MidO": "*fp32", "MidLse": "*fp32", "scale_log2": "fp32", "num_splits": "i32", "softcap_log2": "fp32"},
        dict(GROUP=2, HEAD_DIM=256, BLOCK_D=256, BLOCK_H=16, BLOCK_N=32, PAGE_SIZE=16, PRECISION="tf32", QUANT=0,
             SLIDING=True, SOFTCAP=True),
        num_warps=4, num_stages=2)
    for sinks in (False, True):  # gpt-oss: attention sinks join the merge's denominator
        _compile_for_gpu(decode_attention._decode_merge_kernel, h100,
                         {"MidO": "*fp32", "MidLse": "*fp32", "O": bf, "Sinks": "*fp32", "num_splits": "i32"},
                         dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_S=decode_attention.MAX_KV_SPLITS, SINKS=sinks),
                         num_warps=4)
    for (capability, shared_limit), (head_dim, gemma) in itertools.product(
            ((h100, 227 * 1024), ((8, 9), 99 * 1024)), ((128, False), (256, True))):  # Llama; Gemma 2
        block_m, block_n, warps, stages = extend_attn._default_config(capability, head_dim)
        meta = _compile_for_gpu(
            extend_attn._extend_kernel, capability,
            {"Q": bf, "K": bf, "V": bf, "KScale": "*fp32", "VScale": "*fp32", "O": bf, "PageTable": "*i32",
             "CuSeqlensQ": "*i32", "SeqLens": "*i32", "Sinks": "*fp32", "scale_log2": "fp32", "softcap_log2": "fp32"},
            dict(GROUP=4, HEAD_DIM=head_dim, BLOCK_D=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, PAGE_SIZE=16,
                 PRECISION="tf32", QUANT=0, SLIDING=gemma, SOFTCAP=gemma, SINKS=gemma), num_warps=warps,
            num_stages=stages)
        assert 0 < meta.shared <= shared_limit, (capability, head_dim, gemma, meta.shared)
    _compile_for_gpu(kv_store._store_kv_kernel, h100, {"Kin": bf, "Vin": bf, "KCache": bf, "VCache": bf,
                                                       "KScale": "*fp32", "VScale": "*fp32", "SlotMapping": "*i64"},
                     dict(NUM_HEADS=8, HEAD_DIM=128, BLOCK_H=8, BLOCK_D=128, QUANT=0, INTERP_FP8=False), num_warps=4)
    _compile_for_gpu(rmsnorm._add_rmsnorm_kernel, h100, {"X": bf, "Residual": bf, "Weight": bf, "Out": bf,
                                                         "NewResidual": bf, "eps": "fp32"},
                     dict(HIDDEN=4096, BLOCK=4096, HAS_RESIDUAL=True), num_warps=16)
    _compile_for_gpu(rope._rope_kernel, h100, {"Q": bf, "K": bf, "QOut": bf, "KOut": bf, "Positions": "*i64",
                                               "CosSin": "*fp32"},
                     dict(NUM_Q_HEADS=32, NUM_KV_HEADS=8, BLOCK_HQ=32, BLOCK_HK=8, HEAD_DIM=128, HALF=64,
                          BLOCK_HALF=64, BLOCK_PASS=0), num_warps=4)
    _compile_for_gpu(activation._act_and_mul_kernel, h100, {"X": bf, "Out": bf},
                     dict(INTER=14336, BLOCK=1024, GELU=False), num_warps=4)
    _compile_for_gpu(activation._act_and_mul_kernel, h100, {"X": bf, "Out": bf},
                     dict(INTER=9216, BLOCK=1024, GELU=True), num_warps=4)
    _compile_for_gpu(sampling._gumbel_argmax_kernel, h100,
                     {"Logits": "*fp32", "Temp": "*fp32", "OutVal": "*fp32", "OutIdx": "*i32"},
                     dict(CHUNK=8192, BLOCK=1024), num_warps=4)
    for k, bias in ((4096, False), (14336, False), (3584, True)):  # Llama-3.1-8B's widths; Qwen2's biased qkv
        bn, bk, warps = matvec.config(k)
        _compile_for_gpu(matvec._gemv_row_kernel, h100, {"X": bf, "W": bf, "Bias": bf, "Y": bf},
                         dict(BLOCK_N=bn, BLOCK_K=bk, HAS_BIAS=bias), num_warps=warps)
        _compile_for_gpu(matvec._gemv_kernel, h100, {"X": bf, "W": bf, "Bias": bf, "Y": bf},
                         dict(BLOCK_M=4, BLOCK_N=bn, BLOCK_K=bk, HAS_BIAS=bias), num_warps=warps)


def _jit_params(kernel):
    """The parameters Triton compiles a @triton.jit kernel with (name, constexpr, do_not_specialize).
    Under TRITON_INTERPRET=1 the decorator returns an InterpretedFunction, which keeps the decorator's
    arguments but has no `params`: the compiler's own JITFunction is built from the same function and
    arguments then, so both ways read what the compiler would specialise."""
    if hasattr(kernel, "params"):
        return kernel.params
    from triton.runtime.jit import JITFunction

    return JITFunction(kernel.fn, **{k: v for k, v in kernel.kwargs.items()
                                     if k in ("do_not_specialize", "do_not_specialize_on_alignment")}).params


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (pip install triton)")
def test_decode_split_count_is_a_runtime_argument():
    """No kernel variant per batch size: the split count is neither a constexpr nor specialised
    (Triton would otherwise compile again for 1 and for multiples of 16), and the partial-result
    buffers have a fixed split dimension (their strides never change). Runs compiled and under
    TRITON_INTERPRET=1."""
    from localrun.kernels import decode_attention

    for kernel in (decode_attention._decode_split_kernel, decode_attention._decode_merge_kernel):
        params = _jit_params(kernel)
        assert [p.name for p in params if p.do_not_specialize and p.name != "window"] == ["num_splits"]
        assert not next(p for p in params if p.name == "num_splits").is_constexpr
        assert "NUM_SPLITS" not in kernel.arg_names
    # the sliding window is a runtime value too (one variant for every window size)
    assert [p.name for p in _jit_params(decode_attention._decode_split_kernel) if p.do_not_specialize] == \
        ["num_splits", "window"]


needs_triton_here = pytest.mark.skipif(
    not HAS_TRITON or not (INTERPRETED or HAS_CUDA),
    reason="Triton tests run on a GPU, or under TRITON_INTERPRET=1 via test_triton_kernels_in_interpreter")


@needs_triton_here
class TestTriton:
    def test_dispatches_to_triton(self):
        assert K.uses_triton(torch.zeros(1, device=DEVICE))

    @pytest.mark.parametrize("dtype", DTYPES)
    def test_store_kv(self, dtype):
        T, hkv, d = 9, 2, 16
        kv = torch.randn(T, 3 * hkv, d).to(dtype=dtype, device=DEVICE)
        k, v = kv[:, :hkv], kv[:, hkv: 2 * hkv]  # strided views, as sliced from a fused qkv
        slots = torch.randperm(5 * 4)[:T].to(DEVICE)
        slots[3] = -1
        caches = [torch.full((5, 4, hkv, d), float("nan"), dtype=dtype, device=DEVICE) for _ in range(4)]
        K.store_kv(k, v, caches[0], caches[1], slots)
        K.store_kv_ref(k, v, caches[2], caches[3], slots)
        assert torch.equal(caches[0].isnan(), caches[2].isnan()) and int((~caches[0].isnan()).sum()) == (T - 1) * hkv * d
        assert torch.equal(caches[0].nan_to_num(), caches[2].nan_to_num())
        assert torch.equal(caches[1].nan_to_num(), caches[3].nan_to_num())

    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("seq_lens,page_size,num_q_heads,num_kv_heads,head_dim,splits", [
        ([1, 7, 19], 4, 4, 2, 16, 3),  # more splits than a 1-token sequence can fill
        ([19, 8, 1], 8, 6, 2, 32, None),  # 3 query heads per KV head, default splits
        ([33, 2, 0], 4, 2, 2, 24, 1),  # MHA, head_dim not a power of two, one split, an empty (padding) row
    ])
    def test_paged_decode_attention(self, dtype, seq_lens, page_size, num_q_heads, num_kv_heads, head_dim, splits):
        scale = head_dim ** -0.5
        batch = make_paged_batch(seq_lens, num_kv_heads, head_dim, page_size, dtype, DEVICE, write=K.store_kv)
        q = torch.randn(len(seq_lens), num_q_heads, head_dim).to(dtype=dtype, device=DEVICE)
        out = K.paged_decode_attention(q, batch.k_cache, batch.v_cache, batch.page_table, batch.seq_lens, scale,
                                       num_kv_splits=splits)
        oracle = K.paged_decode_attention_ref(*upcast(q, batch.k_cache, batch.v_cache), batch.page_table,
                                              batch.seq_lens, scale)
        assert_close(out, oracle, dtype)
        assert torch.equal(out[batch.seq_lens == 0].float(), torch.zeros_like(out[batch.seq_lens == 0].float()))

    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("spans,page_size,num_q_heads,num_kv_heads,head_dim,max_q_len", [
        ([(0, 7), (12, 7), (3, 1), (0, 19), (40, 5)], 4, 4, 2, 16, None),  # (cached prefix, new) per sequence
        ([(5, 20), (0, 1), (17, 0)], 8, 6, 2, 32, 20),  # q block crossing, an idle sequence, tight grid
    ])
    def test_extend_attention(self, dtype, spans, page_size, num_q_heads, num_kv_heads, head_dim, max_q_len):
        scale = head_dim ** -0.5
        batch, q, cu = extend_inputs(spans, num_q_heads, num_kv_heads, head_dim, page_size, dtype, DEVICE)
        out = K.extend_attention(q, batch.k_cache, batch.v_cache, batch.page_table, cu, batch.seq_lens, scale,
                                 max_q_len=max_q_len)
        oracle = K.extend_attention_ref(*upcast(q, batch.k_cache, batch.v_cache), batch.page_table, cu,
                                        batch.seq_lens, scale)
        assert_close(out, oracle, dtype)

    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("window,softcap", WINDOW_CAP)
    def test_paged_decode_attention_window_softcap(self, dtype, window, softcap):
        """Sliding window (the splits cover only the window's blocks) and soft-capping, against the
        reference; 3 splits, so some splits of a long sequence start past a page boundary."""
        seq_lens, head_dim = [1, 7, 19, 37, 0], 16
        batch = make_paged_batch(seq_lens, 2, head_dim, 4, dtype, DEVICE, write=K.store_kv)
        q = torch.randn(len(seq_lens), 4, head_dim).to(dtype=dtype, device=DEVICE)
        out = K.paged_decode_attention(q, batch.k_cache, batch.v_cache, batch.page_table, batch.seq_lens, 0.3,
                                       num_kv_splits=3, window=window, softcap=softcap)
        oracle = K.paged_decode_attention_ref(*upcast(q, batch.k_cache, batch.v_cache), batch.page_table,
                                              batch.seq_lens, 0.3, window=window, softcap=softcap)
        assert_close(out, oracle, dtype)

    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("window,softcap", WINDOW_CAP)
    def test_extend_attention_window_softcap(self, dtype, window, softcap):
        """Chunks with and without a cached prefix, longer than the window and than a query block
        (rows of one block whose windows start in different key blocks)."""
        spans = [(0, 7), (12, 7), (3, 1), (0, 19), (40, 5), (9, 30)]
        batch, q, cu = extend_inputs(spans, 4, 2, 16, 4, dtype, DEVICE)
        out = K.extend_attention(q, batch.k_cache, batch.v_cache, batch.page_table, cu, batch.seq_lens, 0.25,
                                 window=window, softcap=softcap)
        oracle = K.extend_attention_ref(*upcast(q, batch.k_cache, batch.v_cache), batch.page_table, cu,
                                        batch.seq_lens, 0.25, window=window, softcap=softcap)
        assert_close(out, oracle, dtype)

    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("with_residual", [True, False])
    def test_fused_add_rmsnorm(self, dtype, with_residual):
        x = torch.randn(5, 48).to(dtype=dtype, device=DEVICE)
        r = torch.randn(5, 48).to(dtype=dtype, device=DEVICE) if with_residual else None
        w = torch.randn(48).to(dtype=dtype, device=DEVICE)
        out, new_r = K.fused_add_rmsnorm(x, r, w, 1e-5)
        if r is None:
            assert new_r is x
        else:  # (the interpreter rounds fp32 -> bf16 its own way: not bit-exact with torch)
            assert_close(new_r, x.float() + r.float(), dtype)
        assert_close(out, K.fused_add_rmsnorm_ref(new_r.float(), None, w.float(), 1e-5)[0], dtype)

    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("scaling,rotary_dim", [
        (None, None), ({"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 64}, None),
        (None, 16),  # partial rotary: the last 16 dims pass through
    ])
    def test_apply_rope(self, dtype, scaling, rotary_dim):
        cache = K.rope_cos_sin_cache(32, 100, 10000.0, scaling, device=DEVICE, rotary_dim=rotary_dim)
        positions = torch.tensor([0, 3, 99, 42, 7], device=DEVICE)
        q = torch.randn(5, 6, 32).to(dtype=dtype, device=DEVICE)
        k = torch.randn(5, 3, 32).to(dtype=dtype, device=DEVICE)
        q_in, k_in = q.clone(), k.clone()
        out_q, out_k = K.apply_rope(q, k, positions, cache)
        ref_q, ref_k = K.apply_rope_ref(q.float(), k.float(), positions, cache)
        assert torch.equal(q, q_in) and torch.equal(k, k_in)  # inputs untouched
        assert_close(out_q, ref_q, dtype)
        assert_close(out_k, ref_k, dtype)

    @pytest.mark.parametrize("dtype", DTYPES)
    def test_silu_and_mul(self, dtype):
        x = torch.randn(5, 2 * 100).to(dtype=dtype, device=DEVICE) * 3
        assert_close(K.silu_and_mul(x), K.silu_and_mul_ref(x.float()), dtype)

    @pytest.mark.parametrize("dtype", DTYPES)
    def test_gelu_tanh_and_mul(self, dtype):
        x = torch.randn(5, 2 * 100).to(dtype=dtype, device=DEVICE) * 6  # far into both tails of tanh
        assert_close(K.gelu_tanh_and_mul(x), K.gelu_tanh_and_mul_ref(x.float()), dtype)


    @pytest.mark.parametrize("dtype", DTYPES)
    def test_gemv(self, dtype):
        """One row (the engine's use), a few rows, a bias, widths that are and are not multiples of the
        block, and a weight that is a column slice of a wider one (row stride > K)."""
        for m, n, k, bias in ((1, 37, 70, False), (1, 64, 96, True), (3, 40, 128, True), (8, 9, 33, False)):
            x = torch.randn(m, k).to(dtype=dtype, device=DEVICE)
            w = (torch.randn(n, k) / k ** 0.5).to(dtype=dtype, device=DEVICE)
            b = torch.randn(n).to(dtype=dtype, device=DEVICE) if bias else None
            assert_close(K.gemv(x, w, b), K.gemv_ref(x.float(), w.float(), None if b is None else b.float()), dtype)
        wide = torch.randn(16, 200).to(dtype=dtype, device=DEVICE)
        x = torch.randn(1, 120).to(dtype=dtype, device=DEVICE)
        assert_close(K.gemv(x, wide[:, :120]), K.gemv_ref(x.float(), wide[:, :120].float()), dtype)
        with pytest.raises(ValueError, match="at most"):
            K.gemv(torch.randn(9, 8, device=DEVICE), torch.randn(4, 8, device=DEVICE))

    def test_sample_temperature_draws_from_softmax_over_t(self):
        """The one-pass Gumbel-max draw: 256 rows of the same 5 logits at T=0.5 against softmax(x/T)
        (chi-square, 4 degrees of freedom, below its 1e-4 quantile; T ignored, or the noise off, is
        far above it); the same seed gives the same tokens, another seed others."""
        x = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5]], device=DEVICE).expand(256, 5).contiguous()
        t = torch.full((256,), 0.5, device=DEVICE)
        tokens = K.sample_temperature(x, t, 7)
        assert tokens.dtype == torch.int64 and tokens.shape == (256,)
        counts = torch.bincount(tokens.cpu(), minlength=5).double()
        want = torch.softmax(x[0].double().cpu() / 0.5, -1) * 256
        chi2 = float(((counts - want) ** 2 / want).sum())
        assert chi2 < 23.5, (counts.tolist(), want.tolist())
        assert torch.equal(K.sample_temperature(x[:32], t[:32], 7), tokens[:32])
        assert not torch.equal(K.sample_temperature(x[:32], t[:32], 8), tokens[:32])

    def test_sample_temperature_greedy_rows_masks_and_chunks(self):
        """Temperature 0 is the argmax; -inf tokens are never drawn; a vocabulary of several chunks
        (the winner in the last, partial one); bf16 logits."""
        vocab = 2500  # 3 chunks under the interpreter, one on a GPU
        x = torch.randn(4, vocab, device=DEVICE)
        x[0, 2400] = 30.0  # greedy row: the argmax sits in the last chunk
        x[1] = float("-inf")
        x[1, [3, 2499]] = 0.0  # only these two can be drawn
        x[2, 1234] = 200.0  # a sure winner at T=1
        t = torch.tensor([0.0, 1.0, 1.0, 0.0], device=DEVICE)
        for dtype in (torch.float32, torch.bfloat16):
            got = K.sample_temperature(x.to(dtype), t, 3).tolist()
            assert got[0] == 2400 and got[1] in (3, 2499) and got[2] == 1234
            assert got[3] == int(x[3].to(dtype).float().argmax())
        draws = {K.sample_temperature(x[1:2], t[1:2], s).item() for s in range(12)}
        assert draws == {3, 2499}

    @pytest.mark.parametrize("fault, every_batch", [("", False), ("", True), ("kernel:sample_temperature", False)])
    def test_engine_fused_sampling_and_its_trial(self, monkeypatch, fault, every_batch):
        """The sampler kernel is tried at load; the runner draws plain temperature rows with it in batches
        of up to runner.FUSED_SAMPLING_ROWS rows, or in every batch with EngineConfig(fused_sampling=True).
        When its trial fails (LOCALRUN_FAULTS) the load records the fallback and the torch sampler draws.
        Either way every request gets its tokens."""
        from localrun.engine import EngineConfig, LLMEngine, SamplingParams, runner
        from localrun.engine.config import ModelConfig

        monkeypatch.setenv("LOCALRUN_FAULTS", fault)
        cfg = ModelConfig(64, 2, 4, 2, 128, 300, rope_theta=10000.0)
        eng = LLMEngine.from_random(cfg, EngineConfig(device=DEVICE, max_model_len=64, max_num_seqs=12,
                                                      use_triton=True, fused_sampling=every_batch, cuda_graphs=False),
                                    seed=3)
        assert eng.runner.fused_rows == (0 if fault else math.inf if every_batch else runner.FUSED_SAMPLING_ROWS)
        assert any("sample_temperature" in f for f in eng.fallbacks) == bool(fault)
        calls = []
        kernel = K.sample_temperature
        monkeypatch.setattr(K, "sample_temperature", lambda x, *a: calls.append(x.shape[0]) or kernel(x, *a))
        for n in (2, 10):  # a small batch, and one above FUSED_SAMPLING_ROWS
            calls.clear()
            outs = eng.generate([[1, 2, 3 + i] for i in range(n)],
                                SamplingParams(temperature=0.8, max_tokens=3, ignore_eos=True))
            assert [len(o.token_ids) for o in outs] == [3] * n and all(0 <= t < 300 for o in outs for t in o.token_ids)
            assert bool(calls) == (not fault and (n <= runner.FUSED_SAMPLING_ROWS or every_batch)), (n, calls)

    @pytest.mark.parametrize("fault", ["", "kernel:gemv"])
    def test_engine_one_row_linears_and_their_trial(self, monkeypatch, fault):
        """A step of one sequence runs its linear layers (and the logits) through the gemv kernel, tried
        at load; when the trial fails (LOCALRUN_FAULTS) the load records the fallback and cuBLAS (F.linear)
        runs them. Greedy tokens equal the torch-reference engine's either way (fp32)."""
        from localrun.engine import EngineConfig, LLMEngine, SamplingParams
        from localrun.engine.config import ModelConfig
        from localrun.engine.layers import quant

        monkeypatch.setenv("LOCALRUN_FAULTS", fault)
        calls = []
        kernel = K.gemv  # the op Ops.linear calls (it runs the kernel: INTERPRETED or CUDA)
        monkeypatch.setattr(K, "gemv", lambda *a, **k: calls.append(a[0].shape) or kernel(*a, **k))
        cfg = ModelConfig(64, 2, 4, 2, 128, 300, rope_theta=10000.0, attention_bias=True)
        common = dict(device=DEVICE, max_model_len=64, max_num_seqs=4, cuda_graphs=False)
        eng = LLMEngine.from_random(cfg, EngineConfig(use_triton=True, **common), seed=3)
        assert any("gemv" in f for f in eng.fallbacks) == bool(fault)
        assert (eng.model.ops.linear is quant.linear) == bool(fault)
        calls.clear()
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        got = eng.generate([[1, 2, 3, 4, 5]], params)[0].token_ids
        # 5 decode steps x (2 layers x 4 linears + the logits) and the prompt's logits row; the prompt's
        # linears (5 rows) are cuBLAS's
        assert len(calls) == (0 if fault else 5 * 9 + 1) and all(s[0] == 1 for s in calls)
        ref = LLMEngine.from_random(cfg, EngineConfig(use_triton=False, **common), seed=3)
        assert got == ref.generate([[1, 2, 3, 4, 5]], params)[0].token_ids

    @pytest.mark.skipif(not INTERPRETED, reason="records launches through the interpreter (on a GPU: gpu-check's "
                                                "coldstart item times the compiles)")
    @pytest.mark.parametrize("kind", ["llama", "qwen3", "gemma", "phi"])
    def test_kernel_trials_compile_every_variant_the_steps_launch(self, monkeypatch, kind):
        """Cold start: Triton compiles a kernel once per variant (constexprs, argument dtypes, integers
        that are 1 or a multiple of 16, pointer alignment). Every launch of a load's profiling step and
        of its prefill and decode steps (graph path on, bf16) must be a variant the kernel trials
        (engine/fallbacks.py) launched already, by the CUDA backend's own specialisation rules, or
        it compiles in the profiling step after the trials (on the 8B shape that was ~1.1 s of the
        cold start: the page table's row stride, int32 positions and slots, the first layer's norm)."""
        runtime_jit = pytest.importorskip("triton.runtime.jit")
        nvidia = pytest.importorskip("triton.backends.nvidia.compiler")
        from triton.backends.compiler import GPUTarget
        from triton.runtime.interpreter import InterpretedFunction

        from localrun.engine import EngineConfig, LLMEngine, SamplingParams
        from localrun.engine.config import ModelConfig
        from localrun.engine.runner import profile_and_warm

        base = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, vocab_size=300)
        cfg, kv = {
            "llama": (ModelConfig(**base), "int8"),
            "qwen3": (ModelConfig(**base, head_dim=32, qk_norm=True), "auto"),
            "gemma": (ModelConfig(**{**base, "num_kv_heads": 1}, head_dim=32, arch="gemma3", sliding_window=8,
                                  layer_types=["sliding_attention", "full_attention"], attn_logit_softcap=50.0,
                                  query_pre_attn_scalar=32, rope_local_theta=10000.0, qk_norm=True), "auto"),
            "phi": (ModelConfig(**base, rotary_dim=12, sliding_window=8), "auto"),  # partial rotary
        }[kind]
        from localrun.engine import fallbacks

        launches, phase = [], ["step"]  # "trial" only inside try_kernels: graph warm-ups count as steps
        run, try_kernels = InterpretedFunction.run, fallbacks.try_kernels

        def recording_run(fn, *args, grid, warmup, **kw):
            launches.append((phase[0], fn, args, kw))
            return run(fn, *args, grid=grid, warmup=warmup, **kw)

        def trials(*args, **kw):
            phase[0] = "trial"
            try:
                return try_kernels(*args, **kw)
            finally:
                phase[0] = "step"

        monkeypatch.setattr(InterpretedFunction, "run", recording_run)
        monkeypatch.setattr(fallbacks, "try_kernels", trials)
        eng = LLMEngine.from_random(cfg, EngineConfig(device=DEVICE, dtype="bfloat16", max_model_len=256, max_num_seqs=4,
                                                      max_num_batched_tokens=48, use_triton=True, cuda_graphs=True,
                                                      kv_cache_dtype=kv), seed=3)
        assert eng.fallbacks == [] and any(ph == "trial" for ph, *_ in launches)
        profile_and_warm(eng.model, eng.config, True)
        eng.generate([[1, 2, 3] * 7, [4, 5]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))

        backend = nvidia.CUDABackend(GPUTarget("cuda", 90, 32))
        binders, seen = {}, {"trial": set(), "step": set()}
        for ph, fn, args, kw in launches:
            if fn.fn not in binders:
                jit = runtime_jit.JITFunction(fn.fn, **{k: v for k, v in fn.kwargs.items()
                                                        if k in ("do_not_specialize", "do_not_specialize_on_alignment")})
                binders[fn.fn] = runtime_jit.create_function_from_signature(jit.signature, jit.params, backend)
            _, spec, options = binders[fn.fn](*args, **kw)
            seen[ph].add((fn.fn.__name__, str(spec), str(sorted(options.items()))))
        kernels_run = {k[0] for k in seen["step"]}
        assert {"_extend_kernel", "_decode_split_kernel", "_rope_kernel", "_store_kv_kernel", "_gemv_row_kernel"} <= kernels_run
        missing = sorted(seen["step"] - seen["trial"])
        assert not missing, "variants first compiled after the trials:\n" + "\n".join(
            f"{name}: {spec} {opts}" for name, spec, opts in missing)

    @pytest.mark.skipif(not INTERPRETED, reason="on a GPU, run the benchmark itself (it takes minutes)")
    def test_bench_kernels_smoke(self, capsys):
        from localrun.kernels import bench_kernels

        assert bench_kernels.main(["--tiny"]) == 0
        out = capsys.readouterr().out
        for group in ("ceiling", "decode", "extend", "window", "rmsnorm", "silu_mul", "gelu_mul", "rope", "store_kv",
                      "gemv", "moe"):
            assert f"{group} " in out, out


# --------------------------------------------------------------------------- GPU, real shapes

needs_gpu = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA or not HAS_TRITON, reason="needs a CUDA GPU and triton")]
HQ, HKV, HD = 32, 8, 128  # Llama-3.1-8B attention
BF16 = torch.bfloat16


@pytest.mark.parametrize("batch_size", [1, 48])
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or not HAS_TRITON, reason="needs a CUDA GPU and triton")
def test_gpu_decode_llama8b_shape(batch_size):
    seq_lens = torch.randint(1, 4097, (batch_size,)).tolist()
    batch = make_paged_batch(seq_lens, HKV, HD, 16, BF16, "cuda", write=K.store_kv)
    q = torch.randn(batch_size, HQ, HD, dtype=BF16, device="cuda")
    out = K.paged_decode_attention(q, batch.k_cache, batch.v_cache, batch.page_table, batch.seq_lens, HD ** -0.5)
    oracle = K.paged_decode_attention_ref(*upcast(q, batch.k_cache, batch.v_cache), batch.page_table,
                                          batch.seq_lens, HD ** -0.5)
    assert_close(out, oracle, BF16)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or not HAS_TRITON, reason="needs a CUDA GPU and triton")
def test_gpu_decode_compiles_once_for_every_batch_size():
    from localrun.kernels import decode_attention

    kernel = decode_attention._decode_split_kernel
    for batch_size in (1, 2, 3, 8, 17, 64, 256):  # split counts 16 .. 1
        batch = make_paged_batch([5] * batch_size, HKV, HD, 16, BF16, "cuda", write=K.store_kv)
        q = torch.randn(batch_size, HQ, HD, dtype=BF16, device="cuda")
        K.paged_decode_attention(q, batch.k_cache, batch.v_cache, batch.page_table, batch.seq_lens, HD ** -0.5)
    torch.cuda.synchronize()
    assert sum(len(c[0]) for c in kernel.device_caches.values()) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or not HAS_TRITON, reason="needs a CUDA GPU and triton")
def test_gpu_extend_llama8b_shape():
    spans = [(0, 1000), (1500, 300), (37, 1), (0, 2048), (4000, 96)]
    batch, q, cu = extend_inputs(spans, HQ, HKV, HD, 16, BF16, "cuda")
    out = K.extend_attention(q, batch.k_cache, batch.v_cache, batch.page_table, cu, batch.seq_lens, HD ** -0.5,
                             max_q_len=2048)
    oracle = K.extend_attention_ref(*upcast(q, batch.k_cache, batch.v_cache), batch.page_table, cu,
                                    batch.seq_lens, HD ** -0.5)
    assert_close(out, oracle, BF16)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or not HAS_TRITON, reason="needs a CUDA GPU and triton")
def test_gpu_gemv_llama8b_shapes():
    for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)):
        x = torch.randn(1, k, dtype=BF16, device="cuda")
        w = torch.randn(n, k, dtype=BF16, device="cuda") / k ** 0.5
        assert_close(K.gemv(x, w), K.gemv_ref(x.float(), w.float()), BF16)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or not HAS_TRITON, reason="needs a CUDA GPU and triton")
def test_gpu_pointwise_llama8b_shape():
    T, hidden, inter = 777, 4096, 14336
    x, r = (torch.randn(T, hidden, dtype=BF16, device="cuda") for _ in range(2))
    w = torch.randn(hidden, dtype=BF16, device="cuda")
    out, new_r = K.fused_add_rmsnorm(x, r, w, 1e-5)
    assert torch.equal(new_r, x + r)
    assert_close(out, K.fused_add_rmsnorm_ref(new_r.float(), None, w.float(), 1e-5)[0], BF16)
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    cache = K.rope_cos_sin_cache(HD, 131072, 500000.0, scaling, device="cuda")
    positions = torch.randint(0, 131072, (T,), device="cuda")
    q, k = torch.randn(T, HQ, HD, dtype=BF16, device="cuda"), torch.randn(T, HKV, HD, dtype=BF16, device="cuda")
    for got, want in zip(K.apply_rope(q, k, positions, cache), K.apply_rope_ref(q.float(), k.float(), positions, cache)):
        assert_close(got, want, BF16)
    gate_up = torch.randn(T, 2 * inter, dtype=BF16, device="cuda")
    assert_close(K.silu_and_mul(gate_up), K.silu_and_mul_ref(gate_up.float()), BF16)
    slots = torch.randperm(64 * 16, device="cuda")[:T]
    caches = [torch.zeros(64, 16, HKV, HD, dtype=BF16, device="cuda") for _ in range(4)]
    K.store_kv(k, q[:, :HKV], caches[0], caches[1], slots)
    K.store_kv_ref(k, q[:, :HKV], caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
