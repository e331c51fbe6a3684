"""Weight-only quantization (localrun/engine/layers/quant.py): quantize/dequantize bounds, quantized
linear vs float linear (per-channel and group-32 paths), GGUF Q8_0 loaded as int8, the engine
with int8 weights on a tiny model, memory accounting, settings errors, fp8 (CUDA only)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from localrun.engine import EngineConfig, LLMEngine, SamplingParams
from localrun.engine.config import ModelConfig
from localrun.engine.layers.quant import (QuantizedWeight, dequantize, linear, quantize_fp8, quantize_int8,
                                   weight_bytes)

TINY = ModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                   vocab_size=256, max_position_embeddings=256)


def _config(**kw) -> EngineConfig:
    return EngineConfig(device="cpu", dtype="float32", max_model_len=128, kv_cache_tokens=512, **kw)


# ----------------------------------------------------------------------------- quantize/dequantize
@pytest.mark.parametrize("group", [None, 32])
def test_int8_round_trip_error_is_at_most_half_a_step(group):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 128, generator=g) * torch.logspace(-3, 1, 96).unsqueeze(1)  # rows of very different size
    w[5] = 0.0  # an all-zero row stays zero
    q, s = quantize_int8(w, group)
    assert q.dtype == torch.int8 and s.dtype == torch.float32
    assert s.shape == (96, 1 if group is None else 128 // 32)
    err = (w - dequantize(q, s)).abs().reshape(96, s.shape[1], -1)
    assert (err <= s.unsqueeze(-1) / 2 * (1 + 1e-5)).all()
    assert (dequantize(q, s)[5] == 0).all()
    assert q.abs().max() == 127  # the largest value of each group uses the full range


def test_fp8_round_trip_error_bound():
    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(1))
    q, s = quantize_fp8(w)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (64, 1)
    err = (w - dequantize(q, s)).abs()
    # e4m3: 3 mantissa bits -> relative error <= 2^-4; subnormals: absolute <= 2^-10 * scale
    assert (err <= w.abs() / 16 + s / 1024 + 1e-7).all()


# ----------------------------------------------------------------------------- quantized linear
def _qw(w: torch.Tensor, group: int | None) -> QuantizedWeight:
    qw = QuantizedWeight(w.shape[0], w.shape[1], "int8", "cpu")
    qw.allocate(group)
    qw.set_rows(0, w)
    return qw


@pytest.mark.parametrize("group", [None, 32])
@pytest.mark.parametrize("rows", [1, 3, 37])  # 1, 3: the int8 kernel path on CPU (per-channel); 37: dequantize
def test_quantized_linear_matches_float_linear(group, rows):
    g = torch.Generator().manual_seed(2)
    w = torch.randn(700, 96, generator=g) / 10  # 700 rows: several dequantize chunks when group-wise
    x, b = torch.randn(rows, 96, generator=g), torch.randn(700, generator=g)
    qw = _qw(w, group)
    ref = F.linear(x, qw.dequantize(), b)  # the stored numbers, in float
    y = linear(x, qw, b)
    assert y.shape == (rows, 700) and y.dtype == x.dtype
    bf16_kernel = group is None and rows <= 4  # _weight_int8pack_mm takes bf16 activations
    tol = 3e-2 if bf16_kernel else 1e-4
    assert (y - ref).abs().max() <= tol * ref.abs().max()
    # and vs the unquantized weight: the int8 error stays a small fraction of the output
    full = F.linear(x, w, b)
    assert (y - full).abs().max() <= 0.05 * full.abs().max()


def test_quantized_embedding_lookup_dequantizes_rows():
    w = torch.randn(50, 64, generator=torch.Generator().manual_seed(3))
    qw = _qw(w, 32)
    ids = torch.tensor([[0, 7], [49, 7]])
    from localrun.engine.layers.quant import embedding

    out = embedding(ids, qw, torch.float32)
    assert out.shape == (2, 2, 64)
    assert torch.equal(out[1, 1], qw.dequantize()[7])
    assert (out[1, 0] - w[49]).abs().max() <= qw.scale[49].max() / 2 * 1.0001


# ----------------------------------------------------------------------------- GGUF Q8_0
def _write_q8_0_gguf(path: Path) -> Path:
    import gguf

    c = TINY
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(256)
    w.add_block_count(c.num_layers)
    w.add_embedding_length(c.hidden_size)
    w.add_head_count(c.num_heads)
    w.add_head_count_kv(c.num_kv_heads)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_layer_norm_rms_eps(1e-5)
    rng = np.random.default_rng(0)
    h, i, d = c.hidden_size, c.intermediate_size, c.head_dim

    def q8(name: str, rows: int, cols: int, std: float) -> None:
        a = (rng.standard_normal((rows, cols)) * std).astype(np.float32)
        w.add_tensor(name, gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0),
                     raw_dtype=gguf.GGMLQuantizationType.Q8_0)

    q8("token_embd.weight", c.vocab_size, h, 1.0)  # tied: also the lm_head
    w.add_tensor("output_norm.weight", np.ones(h, dtype=np.float32))
    for layer in range(c.num_layers):
        p = f"blk.{layer}."
        w.add_tensor(p + "attn_norm.weight", np.ones(h, dtype=np.float32))
        w.add_tensor(p + "ffn_norm.weight", np.ones(h, dtype=np.float32))
        q8(p + "attn_q.weight", c.num_heads * d, h, 0.3)
        q8(p + "attn_k.weight", c.num_kv_heads * d, h, 0.3)
        q8(p + "attn_v.weight", c.num_kv_heads * d, h, 0.3)
        q8(p + "attn_output.weight", h, c.num_heads * d, 0.3)
        q8(p + "ffn_gate.weight", i, h, 0.3)
        q8(p + "ffn_up.weight", i, h, 0.3)
        q8(p + "ffn_down.weight", h, i, 0.2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def q8_gguf(tmp_path_factory):
    pytest.importorskip("gguf")
    return _write_q8_0_gguf(tmp_path_factory.mktemp("q8") / "tiny-q8_0.gguf")


def _greedy(engine: LLMEngine, prompts, n: int = 24):
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=0,
                                                   want_logprobs=True))
    return [o.token_ids for o in outs], [[lp[1] for lp in o.logprobs] for o in outs]


PROMPTS = [[1, 2, 3, 4, 5], [200, 17, 9], [42] * 7, [5, 100, 150, 250, 3, 60]]


def test_q8_0_tensors_load_as_int8_and_match_the_float_model(q8_gguf):
    from localrun.engine.models.loader import read_gguf

    mcfg, get, names, _ = read_gguf(q8_gguf)
    fl = LLMEngine.from_hf_state(mcfg, get, names, _config())
    q = LLMEngine.from_hf_state(mcfg, get, names, _config(weight_dtype="int8"))
    qkv = q.model.layers[0].qkv_proj
    assert isinstance(qkv, QuantizedWeight) and qkv.group == 32
    assert qkv.qweight.dtype == torch.int8 and qkv.scale.dtype == torch.float32
    # exact w.r.t. the file: the stored int8 x scale is what the float loader dequantizes to
    assert torch.equal(qkv.dequantize(), fl.model.layers[0].qkv_proj)
    assert torch.equal(q.model.embed_tokens.dequantize(), fl.model.embed_tokens)
    # bytes: 1 per weight + a float32 scale per 32, and the norms in float32
    c = TINY
    mats = c.vocab_size * c.hidden_size + c.num_layers * (
        c.hidden_size * c.head_dim * (2 * c.num_heads + 2 * c.num_kv_heads) + 3 * c.hidden_size * c.intermediate_size)
    norms = (2 * c.num_layers + 1) * c.hidden_size * 4
    assert q.stats()["weight_bytes"] == mats + mats // 32 * 4 + norms == q.weight_bytes
    assert fl.stats()["weight_bytes"] == mats * 4 + norms
    # the same numbers in float: greedy tokens equal, logprobs within float rounding
    (ft, flp), (qt, qlp) = _greedy(fl, PROMPTS), _greedy(q, PROMPTS)
    assert ft == qt
    assert max(abs(a - b) for x, y in zip(flp, qlp) for a, b in zip(x, y)) < 1e-3


# ----------------------------------------------------------------------------- engine, int8
def test_engine_int8_on_a_random_model_agrees_with_float():
    fl = LLMEngine.from_random(TINY, _config(), seed=3)
    q = LLMEngine.from_random(TINY, _config(weight_dtype="int8"), seed=3)
    assert q.model.layers[1].gate_up_proj.group == TINY.hidden_size  # per output channel
    # the same float weights underneath (one draw order for both)
    w = q.model.layers[1].gate_up_proj
    assert (w.dequantize() - fl.model.layers[1].gate_up_proj).abs().max() <= w.scale.max() / 2 * 1.0001
    # a random model's logits are nearly flat, so long greedy runs drift apart on near-ties (measured:
    # 74% of tokens before the first disagreement); the first token of each prompt is a clean
    # top-1 comparison: measured 45/48 agree
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, TINY.vocab_size, int(rng.integers(3, 12))).tolist() for _ in range(48)]
    (ft, flp), (qt, qlp) = _greedy(fl, prompts, 1), _greedy(q, prompts, 1)
    assert sum(a == b for a, b in zip(ft, qt)) >= 41, (ft, qt)
    assert max(abs(a[0] - b[0]) for a, b in zip(flp, qlp)) < 0.5
    ratio = q.weight_bytes / fl.weight_bytes
    assert 0.25 <= ratio < 0.27  # int8 of float32 (+ per-row scales, float norms)


# ----------------------------------------------------------------------------- settings, accounting
def test_bad_weight_dtype_settings_are_refused_clearly():
    from localrun.config import ENV_VARS, settings

    assert "LOCALRUN_WEIGHT_DTYPE" in ENV_VARS
    assert settings({"LOCALRUN_WEIGHT_DTYPE": "INT8"}).weight_dtype == "int8"
    assert settings({}).weight_dtype == "auto"
    with pytest.raises(ValueError, match="LOCALRUN_WEIGHT_DTYPE must be auto, int8 or fp8"):
        settings({"LOCALRUN_WEIGHT_DTYPE": "int4"})
    with pytest.raises(ValueError, match="weight_dtype must be auto, int8 or fp8"):
        _config(weight_dtype="q4")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="compute capability >= 8.9"):
            _config(weight_dtype="fp8")


def test_native_memory_estimate_counts_quantized_weights(q8_gguf, monkeypatch):
    pytest.importorskip("fastapi")
    from localrun.backends.base import LoadSpec
    from localrun.backends.native import estimate_memory
    from localrun.errors import InvalidRequest

    spec = LoadSpec(name="tiny", weights=q8_gguf, format="gguf", num_ctx=128, extra={"native_device": "cpu"})
    monkeypatch.delenv("LOCALRUN_WEIGHT_DTYPE", raising=False)
    auto = estimate_memory(spec).weights_bytes
    monkeypatch.setenv("LOCALRUN_WEIGHT_DTYPE", "int8")
    int8 = estimate_memory(spec).weights_bytes
    from localrun.engine.models.loader import read_gguf

    mcfg, get, names, _ = read_gguf(q8_gguf)
    assert auto == mcfg.num_params * 4
    norms = (2 * mcfg.num_layers + 1) * mcfg.hidden_size
    assert int8 == int((mcfg.num_params - norms) * 1.125) + norms * 4  # upper bound: group-32 scales
    # and it holds: the loaded engine's weights are no bigger than the plan
    assert LLMEngine.from_hf_state(mcfg, get, names, _config(weight_dtype="int8")).weight_bytes <= int8
    spec.extra["weight_dtype"] = "int3"
    with pytest.raises(InvalidRequest, match="weight_dtype must be auto, int8 or fp8"):
        estimate_memory(spec)


# ----------------------------------------------------------------------------- CUDA
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_cuda_quantized_linear(kind):
    if kind == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        with pytest.raises(ValueError, match="compute capability"):
            EngineConfig(device="cuda", weight_dtype="fp8")
        return
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(4096, 1024, generator=g, device="cuda") / 32
    qw = QuantizedWeight(4096, 1024, kind, "cuda")
    qw.allocate()
    qw.set_rows(0, w)
    for rows in (1, 5, 300):
        x = torch.randn(rows, 1024, generator=g, device="cuda", dtype=torch.bfloat16)
        ref = F.linear(x.float(), w)
        y = linear(x, qw)
        assert y.dtype == torch.bfloat16 and y.shape == (rows, 4096)
        rel = ((y.float() - ref).norm() / ref.norm()).item()
        assert rel < (0.06 if kind == "fp8" else 0.02), rel


@cuda
@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_cuda_engine_quantized(kind):
    if kind == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs compute capability >= 8.9")
    shape = ModelConfig(hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=512,
                        vocab_size=512, max_position_embeddings=256)
    kw = dict(device="cuda", max_model_len=128, kv_cache_tokens=1024)
    fl = LLMEngine.from_random(shape, EngineConfig(**kw), seed=1)
    q = LLMEngine.from_random(shape, EngineConfig(**kw, weight_dtype=kind), seed=1)
    assert q.weight_bytes < 0.6 * fl.weight_bytes
    (ft, _), (qt, _) = _greedy(fl, PROMPTS, 16), _greedy(q, PROMPTS, 16)
    assert all(len(t) == 16 for t in qt)
    agree = sum(next((k for k, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(ft, qt))
    assert agree / sum(map(len, ft)) >= 0.5, (ft, qt)
