"""kernels/moe.py, the fused mixture-of-experts kernel, and kernels/moe_route.py, the router's top-k, against
kernels/moe_reference.py's fused_moe_ref and moe_route_ref.

As tests/test_kernels.py: class TestMoETriton runs under Triton's CPU interpreter in a subprocess
(test_moe_kernels_in_interpreter; tiny shapes, the interpreter is slow) or on a CUDA GPU in this
process; test_moe_kernels_compile_for_h100 compiles each kernel for an H100 at the Qwen3-30B-A3B shape
with every tile configuration the wrapper picks (Triton's ptxas, no GPU needed). The oracle is the
fp32 reference on the same (rounded) inputs; tolerance as test_kernels.py's.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest
import torch

from localrun.kernels import moe_reference as R
from localrun.kernels import ops as K

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA and not INTERPRETED else "cpu"
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}


def rel_err(out: torch.Tensor, oracle: torch.Tensor) -> float:
    out, oracle = out.double().cpu(), oracle.double().cpu()
    assert not out.isnan().any(), "output has NaN"
    return float((out - oracle).abs().max() / oracle.abs().max().clamp_min(1e-30))


def moe_case(T, E, k, H, I, dtype, *, bias=False, unused=(), seed=0):
    """Random inputs in `dtype` on DEVICE: x, w13, w2, biases (or None), router weights and ids; the
    experts in `unused` get no token."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    w13 = torch.randn(E, 2 * I, H, generator=g) / H ** 0.5
    w2 = torch.randn(E, H, I, generator=g) / I ** 0.5
    b13 = torch.randn(E, 2 * I, generator=g) if bias else None
    b2 = torch.randn(E, H, generator=g) if bias else None
    logits = torch.randn(T, E, generator=g)
    logits[:, list(unused)] = -1e4
    weights, ids = R.moe_route_ref(logits, k)
    dev = [t.to(DEVICE, dtype) if t is not None else None for t in (x, w13, w2, b13, b2)]
    return (*dev, weights.to(DEVICE), ids.to(DEVICE))


def oracle(x, w13, w2, b13, b2, weights, ids, activation):
    f = [t.float() if t is not None else None for t in (x, w13, w2, b13, b2)]
    return R.fused_moe_ref(f[0], f[1], f[2], weights, ids, activation=activation, w13_bias=f[3], w2_bias=f[4])


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (pip install triton)")
@pytest.mark.skipif(INTERPRETED or HAS_CUDA, reason="TestMoETriton runs in this process (interpreter or GPU)")
def test_moe_kernels_in_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", f"{__file__}::TestMoETriton", "-q", "-p", "no:cacheprovider", "-x"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    tail = (r.stdout + r.stderr)[-8000:]
    assert r.returncode == 0, tail
    summary = r.stdout.strip().splitlines()[-1]
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) >= 12 and "skipped" not in summary, tail
    print(f"interpreter run: {summary}")


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (pip install triton)")
@pytest.mark.skipif(INTERPRETED, reason="the interpreter replaces compilation")
@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
def test_moe_kernels_compile_for_h100():
    """The GPU compiler accepts the four kernels at the Qwen3-30B-A3B shape (E=128, k=8, H=2048,
    I=768) in bf16, for each tile configuration config() picks from a decode step to a long prefill,
    and gpt-oss's variant (biases, clamped SwiGLU); each fits an H100's shared memory."""
    from test_kernels import _compile_for_gpu

    from localrun.kernels import moe

    h100, bf = (9, 0), "*bf16"
    configs = {moe.config(T, 8, 128, 2048, 768) for T in (1, 8, 64, 256, 512, 1024, 4096)}
    assert len({c.block_m for c in configs}) >= 3, configs
    ep = 128
    _compile_for_gpu(moe._align_kernel, h100, {"Ids": "*i32", "SortedIds": "*i32", "BlockExpert": "*i32"},
                     dict(BLOCK_M=16, EP=ep, CHUNK=4096 // ep), num_warps=4)
    _compile_for_gpu(moe._sum_k_kernel, h100, {"Parts": "*fp32", "Out": bf}, dict(TOP_K=8, BLOCK=1024), num_warps=4)
    from localrun.kernels import moe_route

    _compile_for_gpu(moe_route._route_kernel, h100, {"Logits": bf, "Weights": "*fp32", "Ids": "*i32"},
                     dict(TOP_K=8, BLOCK_E=128, SOFTMAX_FIRST=True, RENORMALIZE=True), num_warps=1)  # Qwen3-MoE's
    for i, c in enumerate(sorted(configs)):  # SiLU without biases, gpt-oss's variant, in turn (each compile takes seconds)
        act, bias = i % 2, i % 2 == 1
        meta = _compile_for_gpu(
            moe._up_kernel, h100,
            {"X": bf, "W13": bf, "B13": bf, "SortedIds": "*i32", "BlockExpert": "*i32", "Act": bf,
             "alpha": "fp32", "limit": "fp32"},
            dict(TOP_K=8, BLOCK_M=c.block_m, BLOCK_N=c.block_n1, BLOCK_K=c.block_k, EVEN_K=True, HAS_BIAS=bias,
                 ACT=act, PRECISION="tf32"), num_warps=c.num_warps, num_stages=c.num_stages)
        assert 0 < meta.shared <= 227 * 1024, (c, meta.shared)
        meta = _compile_for_gpu(
            moe._down_kernel, h100,
            {"Act": bf, "W2": bf, "B2": bf, "SortedIds": "*i32", "BlockExpert": "*i32", "TopkW": "*fp32",
             "Out": "*fp32"},
            dict(BLOCK_M=c.block_m, BLOCK_N=c.block_n2, BLOCK_K=c.block_k, EVEN_K=True, HAS_BIAS=bias,
                 PRECISION="tf32"), num_warps=c.num_warps, num_stages=c.num_stages)
        assert 0 < meta.shared <= 227 * 1024, (c, meta.shared)


def test_fused_moe_uses_the_reference_without_interpreter_on_cpu():
    if INTERPRETED:
        pytest.skip("TRITON_INTERPRET=1 routes CPU tensors to Triton by design")
    x, w13, w2, b13, b2, w, ids = moe_case(3, 4, 2, 16, 8, torch.float32)
    assert torch.equal(K.fused_moe(x, w13, w2, w, ids), K.fused_moe_ref(x, w13, w2, w, ids))


needs_triton_here = pytest.mark.skipif(
    not HAS_TRITON or not (INTERPRETED or HAS_CUDA),
    reason="Triton tests run on a GPU, or under TRITON_INTERPRET=1 via test_moe_kernels_in_interpreter")


@needs_triton_here
class TestMoETriton:
    def test_dispatches_to_the_kernel(self, monkeypatch):
        from localrun.kernels import moe

        calls = []
        real = moe.fused_moe
        monkeypatch.setattr(moe, "fused_moe", lambda *a, **kw: calls.append(1) or real(*a, **kw))
        x, w13, w2, b13, b2, w, ids = moe_case(2, 4, 2, 16, 8, torch.float32)
        op = K._dispatch("moe", K.fused_moe_ref)  # a fresh dispatcher (ops.fused_moe's binds the kernel on first use)
        out = op(x, w13, w2, w, ids)
        assert calls == [1] and rel_err(out, oracle(x, w13, w2, b13, b2, w, ids, "silu")) <= 1e-5

    @pytest.mark.parametrize("path", ["kernel", "torch"])
    def test_align_sorts_pairs_by_expert_in_padded_blocks(self, monkeypatch, path):
        """Both ways of aligning (the one-program kernel at decode sizes, torch's sort and sums past
        ALIGN_KERNEL_MAX_PAIRS) give the same blocks, each one expert's pairs in pair order."""
        from localrun.kernels import moe

        E, bm = 6, 16
        ids = torch.tensor([[3, 0], [3, 5], [0, 3], [5, 3]] * 9, dtype=torch.int32, device=DEVICE)  # 1, 2, 4: none
        monkeypatch.setattr(moe, "ALIGN_KERNEL_MAX_PAIRS", 1000 if path == "kernel" else 0)
        sorted_ids, block_expert = moe.align(ids, E, bm)
        other = {"kernel": 0, "torch": 1000}[path]
        monkeypatch.setattr(moe, "ALIGN_KERNEL_MAX_PAIRS", other)
        s2, b2 = moe.align(ids, E, bm)
        used = int((block_expert < E).sum())
        assert torch.equal(block_expert[:used], b2[:used]) and torch.equal(sorted_ids[:used * bm], s2[:used * bm])
        flat = ids.reshape(-1).cpu()
        tk = flat.numel()
        s, be = sorted_ids.cpu(), block_expert.cpu()
        assert s.numel() == be.numel() * bm >= tk + 3 * (bm - 1)
        used = int((be < E).sum())
        counts = torch.bincount(flat.long(), minlength=E)
        assert used == int(((counts + bm - 1) // bm).sum())  # each expert's run padded to whole blocks
        assert (be[:used].diff() >= 0).all() and (be[used:] >= E).all()
        assert set(be[:used].tolist()) == {0, 3, 5}
        rows = s[:used * bm].view(used, bm)
        real = rows < tk
        assert sorted(rows[real].tolist()) == list(range(tk))  # every pair once, padding marked tk
        for b in range(used):  # a block's pairs are its expert's, in pair order
            pairs = rows[b][real[b]]
            assert (flat[pairs] == be[b]).all() and (pairs.diff() > 0).all()

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    @pytest.mark.parametrize("T,E,k,activation,bias,unused", [
        (1, 4, 1, "silu", False, ()),  # a decode step, top-1
        (1, 8, 4, "swiglu_oai", True, ()),  # gpt-oss's activation and biases
        (3, 6, 2, "silu", True, (1, 4)),  # experts without tokens
        (40, 4, 2, "silu", False, ()),  # more pairs per expert than a block holds
        (37, 5, 4, "swiglu_oai", False, (2,)),
    ])
    def test_fused_moe_matches_reference(self, dtype, T, E, k, activation, bias, unused):
        from localrun.kernels import moe

        x, w13, w2, b13, b2, w, ids = moe_case(T, E, k, 32, 24, dtype, bias=bias, unused=unused, seed=T + k)
        out = moe.fused_moe(x, w13, w2, w, ids, activation=activation, w13_bias=b13, w2_bias=b2)
        assert out.shape == x.shape and out.dtype == dtype
        err = rel_err(out, oracle(x, w13, w2, b13, b2, w, ids, activation))
        assert err <= TOL[dtype], f"relative error {err:.3g} > {TOL[dtype]}"

    @pytest.mark.parametrize("E,k,scoring,renormalize,dtype", [
        (8, 2, "softmax_topk", True, torch.float32), (6, 1, "softmax_topk", False, torch.bfloat16),
        (128, 8, "softmax_topk", True, torch.bfloat16), (32, 4, "topk_softmax", True, torch.float32),
        (20, 3, "softmax_topk", False, torch.float32)])
    def test_moe_route_matches_reference(self, E, k, scoring, renormalize, dtype):
        from localrun.kernels import moe_route

        logits = (torch.randn(11, E, generator=torch.Generator().manual_seed(E)) * 3).to(DEVICE, dtype)
        w, ids = moe_route.moe_route(logits, k, scoring=scoring, renormalize=renormalize)
        rw, rids = R.moe_route_ref(logits, k, scoring=scoring, renormalize=renormalize)
        assert ids.dtype == torch.int32 and w.dtype == torch.float32 and w.shape == ids.shape == (11, k)
        assert rel_err(w, rw) <= 1e-5  # ids: the same logits picked (bf16 logits may tie: either expert is right)
        assert torch.equal(logits.gather(1, ids.long()).cpu(), logits.gather(1, rids.long()).cpu())
        if dtype == torch.float32:
            assert torch.equal(ids.cpu(), rids.cpu())
        if renormalize or scoring == "topk_softmax":
            assert torch.allclose(w.sum(1).cpu(), torch.ones(11))
        assert K.moe_route(logits, k, scoring=scoring, renormalize=renormalize)[1].equal(ids)  # the dispatched op

    def test_fp16_ragged_k_and_clamp_limit(self):
        """fp16; widths that are no multiple of the block (masked K, wrapped columns); inputs big
        enough that gpt-oss's clamp (limit 7) cuts."""
        from localrun.kernels import moe

        x, w13, w2, b13, b2, w, ids = moe_case(5, 3, 2, 40, 20, torch.float16, bias=True, seed=7)
        x = x * 8
        out = moe.fused_moe(x, w13, w2, w, ids, activation="swiglu_oai", w13_bias=b13, w2_bias=b2)
        f = [t.float() for t in (x, w13, w2, b13, b2)]
        gate = (f[0] @ f[1][:, :20].transpose(1, 2) + f[3][:, None, :20])
        assert (gate > 7).any()  # the clamp matters in this case
        assert rel_err(out, oracle(x, w13, w2, b13, b2, w, ids, "swiglu_oai")) <= TOL[torch.float16]

    def test_prefill_alignment_path(self, monkeypatch):
        from localrun.kernels import moe

        monkeypatch.setattr(moe, "ALIGN_KERNEL_MAX_PAIRS", 8)  # past it: torch's alignment, as a prefill's
        x, w13, w2, b13, b2, w, ids = moe_case(30, 6, 2, 32, 16, torch.bfloat16, unused=(2,), seed=9)
        out = moe.fused_moe(x, w13, w2, w, ids)
        assert rel_err(out, oracle(x, w13, w2, b13, b2, w, ids, "silu")) <= TOL[torch.bfloat16]

    def test_long_inputs_run_in_chunks(self, monkeypatch):
        from localrun.kernels import moe

        x, w13, w2, b13, b2, w, ids = moe_case(21, 4, 2, 16, 8, torch.float32, seed=3)
        monkeypatch.setattr(moe, "CHUNK_FLOATS", 2 * 16 * 8)  # 8 tokens a chunk: 3 chunks
        out = moe.fused_moe(x, w13, w2, w, ids)
        assert rel_err(out, oracle(x, w13, w2, b13, b2, w, ids, "silu")) <= 1e-5

    def test_empty_batch_and_bad_shapes(self):
        from localrun.kernels import moe

        x, w13, w2, b13, b2, w, ids = moe_case(2, 4, 2, 16, 8, torch.float32)
        assert moe.fused_moe(x[:0], w13, w2, w[:0], ids[:0]).shape == (0, 16)
        with pytest.raises(ValueError, match="activation"):
            moe.fused_moe(x, w13, w2, w, ids, activation="gelu")
        with pytest.raises(ValueError, match="shapes disagree"):
            moe.fused_moe(x, w13, w2[:, :, :4], w, ids)
        with pytest.raises(ValueError, match="topk_ids"):
            moe.fused_moe(x, w13, w2, w, ids[:1])
        with pytest.raises(ValueError, match="w2_bias"):
            moe.fused_moe(x, w13, w2, w, ids, w2_bias=torch.zeros(4, 8, device=DEVICE))

    @pytest.mark.parametrize("fault", [False, True])
    def test_engine_trial_keeps_or_drops_the_kernel(self, monkeypatch, fault):
        """engine/fallbacks.try_kernels runs fused_moe against its reference; a kernel that fails
        (an injected compile failure) runs the reference for the load, recorded with its reason."""
        from localrun.engine import fallbacks as fb
        from localrun.engine import faults
        from localrun.engine.config import ModelConfig

        cfg = ModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                          vocab_size=300, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
        monkeypatch.setenv("LOCALRUN_FAULTS", "kernel:fused_moe" if fault else "")
        faults.reset()
        seen: list[str] = []
        try:
            failed = fb.try_kernels(cfg, torch.bfloat16, torch.bfloat16, 16, torch.device(DEVICE), seen.append,
                                    names=fb.MOE_KERNELS)
        finally:
            faults.reset()
        assert failed == ({"fused_moe"} if fault else set())
        assert (seen[0].startswith("kernel fused_moe: torch reference (Triton compile/launch failed at warm-up: "
                                   "InjectedFault") if fault else seen == [])

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_moe_layer_through_the_kernel(self, dtype):
        """layers/moe.MoEMLP (router, top-k, experts) with the Triton ops equals it with the references."""
        from localrun.engine.config import ModelConfig
        from localrun.engine.layers.moe import MoEMLP
        from localrun.engine.layers.ops import Ops

        cfg = ModelConfig(64, 1, 4, 2, 128, 300, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
        layer = MoEMLP(cfg, dtype)
        g = torch.Generator().manual_seed(4)
        with torch.no_grad():
            for p in layer.parameters():
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
        layer = layer.to(DEVICE)
        h = torch.randn(9, 64, generator=g).to(DEVICE, dtype)
        assert Ops().fused_moe is K.fused_moe and Ops(refs=frozenset({"fused_moe"})).fused_moe is K.fused_moe_ref
        out, ref = layer(h, Ops()), layer(h, Ops(reference=True))
        assert out.dtype == dtype and rel_err(out, ref) <= TOL[dtype]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or not HAS_TRITON or INTERPRETED,
                    reason="needs a CUDA GPU (in the interpreter every kernel of the engine runs: ~50 s on 2 cores; "
                           "TestMoETriton.test_moe_layer_through_the_kernel covers the layer there)")
def test_gpu_engine_qwen3_moe_runs_the_kernel(monkeypatch):
    """A Qwen3-MoE engine (models/moe_llama.py) runs its experts through the kernel, tried at load, and its
    decode steps are captured as CUDA graphs (the kernel never syncs with the host): no fallback of either
    kind; greedy tokens equal the torch-reference engine's (fp32)."""
    from localrun.engine import EngineConfig, LLMEngine, SamplingParams
    from localrun.engine.config import ModelConfig

    monkeypatch.delenv("LOCALRUN_FAULTS", raising=False)
    calls = []
    kernel = K.fused_moe  # what layers/ops.Ops binds
    monkeypatch.setattr(K, "fused_moe", lambda *a, **kw: calls.append(a[0].shape[0]) or kernel(*a, **kw))
    cfg = ModelConfig.from_hf_config({
        "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "intermediate_size": 128, "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2,
        "norm_topk_prob": True, "vocab_size": 300, "rope_theta": 10000.0, "max_position_embeddings": 256})
    common = dict(device="cuda", dtype="float32", max_model_len=64, max_num_seqs=4)
    eng = LLMEngine.from_random(cfg, EngineConfig(use_triton=True, cuda_graphs=True, **common), seed=3)
    assert eng.fallbacks == [] and eng.runner.graphs is not None and eng.runner.graphs.graphs
    calls.clear()
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8]]
    got = [o.token_ids for o in eng.generate(prompts, params)]
    assert calls and max(calls) > 1  # the prefill batch eagerly (the decode steps replay graphs)
    ref = LLMEngine.from_random(cfg, EngineConfig(use_triton=False, cuda_graphs=False, **common), seed=3)
    assert got == [o.token_ids for o in ref.generate(prompts, params)]
