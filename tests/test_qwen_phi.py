"""Qwen3 (per-head q/k RMSNorm, explicit head_dim) and Phi-3 / Phi-4 (fused qkv / gate_up
checkpoints, partial rotary, "longrope" scaling in both regimes) on the native engine:
tiny random-init transformers models saved as safetensors, and the same weights written as
GGUF the way llama.cpp's convert_hf_to_gguf.py writes them, compared token by token with
transformers. Also: the cos/sin table vs transformers' rotary embedding, the rms_norm op
(Triton under TRITON_INTERPRET=1), and architectures the engine refuses."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from localrun.kernels import ops as K
from localrun.engine import EngineConfig, LLMEngine, ModelConfig, SamplingParams
from gguf_util import add_decoder_metadata
from parity import assert_greedy_parity

transformers = pytest.importorskip("transformers")

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
HAS_CUDA = torch.cuda.is_available()
ORIG = 32  # the tiny Phi-3's original_max_position_embeddings: longrope's short/long boundary
COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=300, initializer_range=0.3)


def _longrope(rotary_dim: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"rope_type": "longrope", "rope_theta": 10000.0,
            "short_factor": (1 + torch.rand(rotary_dim // 2, generator=g)).tolist(),
            "long_factor": (2 + 6 * torch.rand(rotary_dim // 2, generator=g)).tolist()}


def hf_model(kind: str):
    torch.manual_seed(0)
    if kind == "qwen3":  # head_dim 32 with 4 heads: q is 128 wide on a 64-wide model
        cfg = transformers.Qwen3Config(**COMMON, head_dim=32, max_position_embeddings=256, tie_word_embeddings=True)
        m = transformers.Qwen3ForCausalLM(cfg)
    else:  # phi3: head_dim 16, partial_rotary_factor 0.75 (Phi-4-mini's) -> 12 rotated dims, longrope
        cfg = transformers.Phi3Config(**COMMON, max_position_embeddings=128, original_max_position_embeddings=ORIG,
                                      rope_parameters={**_longrope(12), "partial_rotary_factor": 0.75},
                                      pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
        m = transformers.Phi3ForCausalLM(cfg)
    with torch.no_grad():  # norms away from 1, so that a norm loaded wrong (or skipped) shows
        for name, p in m.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
    return m.float().eval()


# ----------------------------------------------------------------------------- GGUF as llama.cpp writes it
def write_gguf(hf, path) -> None:
    """The tiny model as convert_hf_to_gguf.py converts Qwen3ForCausalLM (arch qwen3: attn_q_norm /
    attn_k_norm, Q/K not permuted) and Phi3ForCausalLM (arch phi3: attn_qkv fused, ffn_up = gate|up,
    rope_factors_long/short tensors, original context length, attn_factor, rope dimension count)."""
    import gguf

    c = hf.config
    arch = c.model_type
    w = gguf.GGUFWriter(str(path), arch)
    add_decoder_metadata(w, c)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    tensors = {}
    sd = {k: v.detach().float().numpy() for k, v in hf.state_dict().items()}
    if arch == "qwen3":
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
    else:
        rope_dims = int(c.hidden_size // c.num_attention_heads * c.rope_parameters["partial_rotary_factor"])
        orig = c.rope_parameters["original_max_position_embeddings"]
        w.add_rope_scaling_orig_ctx_len(orig)
        w.add_rope_dimension_count(rope_dims)
        w.add_sliding_window(c.sliding_window or 0)
        scale = c.max_position_embeddings / orig
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1 else 1.0)
        tensors["rope_factors_long.weight"] = np.array(c.rope_parameters["long_factor"], dtype=np.float32)
        tensors["rope_factors_short.weight"] = np.array(c.rope_parameters["short_factor"], dtype=np.float32)
    names = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    layer = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "self_attn.qkv_proj": "attn_qkv",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
             "mlp.gate_up_proj": "ffn_up"}
    for k, v in sd.items():
        base, leaf = k.rsplit(".", 1)
        if base.startswith("model.layers."):
            i, rest = base.removeprefix("model.layers.").split(".", 1)
            tensors[f"blk.{i}.{layer[rest]}.{leaf}"] = v
        elif not (base == "lm_head" and c.tie_word_embeddings):
            tensors[f"{names[base]}.{leaf}"] = v
    for name, v in tensors.items():
        w.add_tensor(name, np.ascontiguousarray(v))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def engine(hf, fmt: str, tmp_path, max_model_len: int) -> LLMEngine:
    cfg = EngineConfig(device="cpu", dtype="float32", max_model_len=max_model_len, max_num_batched_tokens=64)
    if fmt == "safetensors":
        hf.save_pretrained(tmp_path, safe_serialization=True)
        return LLMEngine.from_safetensors(tmp_path, cfg)
    from localrun.engine.models.loader import read_gguf

    write_gguf(hf, tmp_path / "m.gguf")  # (it has no vocabulary, so the weights go in without a tokenizer)
    mcfg, get, names, _ = read_gguf(tmp_path / "m.gguf")
    if mcfg.arch == "phi3":  # loaded fused, as stored
        assert {"model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.mlp.gate_up_proj.weight"} <= names
    return LLMEngine.from_hf_state(mcfg, get, names, cfg)


def assert_matches_transformers(eng, hf, prompt_lens, max_tokens=8):
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in prompt_lens]
    assert_greedy_parity(eng, hf, prompts, max_tokens)  # prompts over 64 tokens are chunked


@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
def test_qwen3_matches_transformers(fmt, tmp_path):
    hf = hf_model("qwen3")
    eng = engine(hf, fmt, tmp_path, 256)
    mc = eng.model_config
    assert mc.arch == "qwen3" and mc.qk_norm and mc.head_dim == 32 and not mc.attention_bias
    assert_matches_transformers(eng, hf, (5, 40, 90))


@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
def test_phi3_longrope_short_regime_matches_transformers(fmt, tmp_path):
    """max_model_len <= original_max_position_embeddings: short factors, as transformers uses
    for sequences that stay within it (prompt + new tokens <= 32)."""
    hf = hf_model("phi3")
    eng = engine(hf, fmt, tmp_path, ORIG)
    mc = eng.model_config
    assert mc.arch == "phi3" and mc.rotary_dim == 12 and mc.rope_scaling["rope_type"] == "longrope"
    assert mc.rope_scaling["original_max_position_embeddings"] == ORIG and mc.rope_scaling["factor"] == 4.0
    assert_matches_transformers(eng, hf, (3, 11, 24))


@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
def test_phi3_longrope_long_regime_matches_transformers(fmt, tmp_path):
    """max_model_len > original: long factors for every position, as transformers uses for
    prompts longer than 32 tokens (the 90-token one is prefilled in two chunks)."""
    hf = hf_model("phi3")
    eng = engine(hf, fmt, tmp_path, 128)
    assert_matches_transformers(eng, hf, (33, 50, 90))


@pytest.mark.parametrize("regime", ["short", "long"])
def test_longrope_cos_sin_table_matches_transformers(regime):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    rope = {**_longrope(24, seed=3), "partial_rotary_factor": 0.75}
    cfg = transformers.Phi3Config(hidden_size=128, num_attention_heads=4, max_position_embeddings=4096,
                                  original_max_position_embeddings=512, rope_parameters=rope)
    mc = ModelConfig.from_hf_config(cfg.to_dict())
    assert mc.rotary_dim == 24 and mc.rope_scaling["factor"] == 8.0
    max_pos = 512 if regime == "short" else 1000  # our rule: long factors when the table outgrows 512
    inv_freq, attention = K.longrope_inv_freq(mc.rotary_dim, mc.rope_theta, mc.rope_scaling, max_pos)
    hf_inv_freq, hf_attention = ROPE_INIT_FUNCTIONS["longrope"](cfg, "cpu", seq_len=max_pos)
    assert torch.allclose(inv_freq.float(), hf_inv_freq, rtol=1e-6) and attention == pytest.approx(hf_attention)
    assert attention == pytest.approx(math.sqrt(1 + math.log(8) / math.log(512)))
    table = K.rope_cos_sin_cache(mc.head_dim, max_pos, mc.rope_theta, mc.rope_scaling, rotary_dim=mc.rotary_dim)
    positions = torch.arange(max_pos)[None]  # transformers picks the factors by max(position) + 1
    cos, sin = Phi3RotaryEmbedding(cfg)(torch.zeros(1, dtype=torch.float32), positions)
    assert cos.shape[-1] == 24  # transformers: [cos | cos] over the rotated dims, times the attention factor
    # (transformers forms position * inv_freq in float32: ~1e-4 off at position 1000; the table is float64-exact)
    assert torch.allclose(table[:, :12], cos[0, :, :12], atol=5e-4, rtol=0), regime
    assert torch.allclose(table[:, 12:], sin[0, :, :12], atol=5e-4, rtol=0), regime
    other = K.rope_cos_sin_cache(mc.head_dim, 1000 if regime == "short" else 512, mc.rope_theta, mc.rope_scaling,
                                 rotary_dim=mc.rotary_dim)
    assert (table[:100] - other[:100]).abs().max() > 0.1  # the two regimes really differ


def test_phi3_with_fused_weights_splits_over_tensor_parallel_ranks(tmp_path):
    """A rank's shard of the fused qkv_proj / gate_up_proj (its q heads, its kv heads, its MLP
    columns) equals the slices of the per-projection layout the Llama loader reads."""
    from localrun.engine.layers.ops import Ops
    from localrun.engine.models.llama import LlamaModel
    from localrun.engine.parallel.group import TPGroup

    hf = hf_model("phi3")
    mc = ModelConfig.from_hf_config(hf.config.to_dict())
    sd = {k: v.detach() for k, v in hf.state_dict().items()}
    i = mc.intermediate_size
    q, kv = mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim
    split = dict(sd)  # the same weights with separate q/k/v and gate/up, as Llama checkpoints have
    for layer in range(mc.num_layers):
        p = f"model.layers.{layer}."
        qkv, gu = split.pop(p + "self_attn.qkv_proj.weight"), split.pop(p + "mlp.gate_up_proj.weight")
        split[p + "self_attn.q_proj.weight"], split[p + "self_attn.k_proj.weight"], \
            split[p + "self_attn.v_proj.weight"] = qkv[:q], qkv[q:q + kv], qkv[q + kv:]
        split[p + "mlp.gate_proj.weight"], split[p + "mlp.up_proj.weight"] = gu[:i], gu[i:]
    for rank in range(2):
        models = []
        for state in (sd, split):
            m = LlamaModel(mc, 16, torch.float32, "cpu", Ops(reference=True), tp=TPGroup(rank, 2))
            m.load_hf_state(state.__getitem__, set(state))
            models.append(m)
        for (name, a), (_, b) in zip(models[0].named_parameters(), models[1].named_parameters()):
            assert torch.equal(a, b), (rank, name)
        assert models[0].layers[0].qkv_proj.shape[0] == (q + 2 * kv) // 2


@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
def test_phi3_sliding_window_matches_transformers(fmt, tmp_path):
    """Phi-3-mini-4k's sliding window (2047 there; 8 here, prompts past it, chunked): the window
    comes from config.json's sliding_window or the GGUF's phi3.attention.sliding_window."""
    hf = hf_model("phi3")
    hf.config.sliding_window = 8
    eng = engine(hf, fmt, tmp_path, ORIG)
    assert eng.model_config.sliding_window == 8 and eng.model_config.layer_window(1) == 8
    assert_matches_transformers(eng, hf, (3, 12, 23))


@pytest.mark.parametrize("model_type,arch,words", [
    ("qwen2_moe", "Qwen2MoeForCausalLM", "Qwen2-MoE"),
    ("gpt2", "GPT2LMHeadModel", "'gpt2'"),
])
def test_unsupported_safetensors_architectures_are_refused(tmp_path, model_type, arch, words):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type, "architectures": [arch],
                                                       "hidden_size": 64, "num_hidden_layers": 2}))
    with pytest.raises(ValueError) as e:
        LLMEngine.from_safetensors(tmp_path, EngineConfig(device="cpu"))
    assert words in str(e.value) and "llama.cpp backend" in str(e.value)


def test_unsupported_gguf_architecture_is_refused(tmp_path):
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="GGUF architecture 'gpt2' is not supported.*llama.cpp backend"):
        LLMEngine.from_gguf(tmp_path / "m.gguf", EngineConfig(device="cpu"))


# ----------------------------------------------------------------------------- rms_norm op
def test_rms_norm_ref_matches_qwen3_norm():
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    norm = Qwen3RMSNorm(16, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(16))
    x = torch.randn(5, 3, 16)
    assert torch.allclose(K.rms_norm_ref(x, norm.weight.detach(), 1e-6), norm(x).detach(), atol=1e-6)


@pytest.mark.skipif(INTERPRETED or HAS_CUDA, reason="TestTritonRmsNorm runs in this process")
def test_rms_norm_triton_in_interpreter():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", f"{__file__}::TestTritonRmsNorm", "-q", "-p", "no:cacheprovider", "-x"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "passed" in r.stdout and "skipped" not in r.stdout, (r.stdout + r.stderr)[-4000:]


@pytest.mark.skipif(not (INTERPRETED or HAS_CUDA), reason="via test_rms_norm_triton_in_interpreter, or on a GPU")
class TestTritonRmsNorm:
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_strided_heads(self, dtype):
        dev = "cuda" if HAS_CUDA and not INTERPRETED else "cpu"
        assert K.uses_triton(torch.zeros(1, device=dev))
        qkv = torch.randn(7, (6 + 2 * 2) * 24).to(dtype=dtype, device=dev)  # q heads 6, kv heads 2, head_dim 24
        q = qkv[:, :6 * 24].view(7, 6, 24)  # a strided view, as the model hands it over
        w = torch.randn(24).to(dtype=dtype, device=dev)
        out = K.rms_norm(q, w, 1e-6)
        ref = K.rms_norm_ref(q.float(), w.float(), 1e-6)
        assert out.shape == q.shape and out.dtype == dtype and out.is_contiguous()
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        assert float((out.float() - ref).abs().max() / ref.abs().max()) <= tol
        flat = K.rms_norm(qkv[:, :24], w, 1e-6)  # [T, D] works too
        assert torch.allclose(flat.float(), K.rms_norm_ref(qkv[:, :24].float(), w.float(), 1e-6), atol=tol * 10)


# ----------------------------------------------------------------------------- backend choice
def test_auto_backend_sends_foreign_gguf_architectures_to_llamacpp(monkeypatch, tmp_path):
    from types import SimpleNamespace

    from localrun.backends import select
    from localrun.backends.select import GPU, choose, model_architecture
    from localrun.errors import BackendError

    monkeypatch.setattr(select, "native_import_error", lambda: None)
    h100 = GPU("NVIDIA H100 80GB HBM3", (9, 0), 78 * 2**30, 80 * 2**30)

    def facts(arch):
        return SimpleNamespace(architecture=arch, file_type="BF16", parameter_count=int(1e9), tensor_bytes=int(2e9))

    for arch in ("qwen3", "phi3", "llama"):
        assert choose("auto", "gguf", h100, facts(arch), llamacpp_gpu=True).backend == "native"
    c = choose("auto", "gguf", h100, facts("deepseek2"), llamacpp_gpu=True)
    assert c.backend == "llamacpp" and "'deepseek2'" in c.reason and "qwen3" in c.reason  # says what it runs
    assert choose("auto", "gguf", None, facts("deepseek2")).backend == "llamacpp"
    assert choose("llamacpp", "gguf", h100, facts("deepseek2")).backend == "llamacpp"
    with pytest.raises(BackendError, match="LOCALRUN_BACKEND=native.*'deepseek2'.*llama.cpp"):
        choose("native", "gguf", h100, facts("deepseek2"))
    # safetensors: the architecture comes from config.json; one the engine does not run is an error
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_moe"}))
    arch = model_architecture("safetensors", tmp_path, None)
    assert arch == "qwen2_moe"
    with pytest.raises(BackendError, match="Qwen2-MoE.*import a GGUF"):
        choose("auto", "safetensors", h100, None, arch=arch)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "phi3"}))
    assert choose("auto", "safetensors", None, None, arch=model_architecture("safetensors", tmp_path)).backend == \
        "native"
    assert model_architecture("gguf", tmp_path, None) is None  # a GGUF's comes from its header facts only


@pytest.mark.parametrize("kind", ["phi3", "qwen3"])
def test_two_ranks_match_one(kind, tmp_path):
    """tensor_parallel 2 (gloo, a process per rank) from the checkpoint: Phi-3's fused qkv_proj /
    gate_up_proj read as row shards, Qwen3's q/k norms whole on every rank; same greedy tokens."""
    hf = hf_model(kind)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    prompts = [[(7 * i + 3) % 300 for i in range(n)] for n in (5, 40)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, want_logprobs=True)
    outs = []
    for tp in (1, 2):
        eng = LLMEngine.from_safetensors(tmp_path, EngineConfig(device="cpu", dtype="float32", max_model_len=128,
                                                                kv_cache_tokens=512, tensor_parallel=tp))
        try:
            outs.append(eng.generate(prompts, params))
        finally:
            eng.shutdown()
    for a, b in zip(*outs):
        assert a.token_ids == b.token_ids
        assert [lp for _, lp, _ in b.logprobs] == pytest.approx([lp for _, lp, _ in a.logprobs], abs=1e-4)
