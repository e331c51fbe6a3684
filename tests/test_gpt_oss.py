"""gpt-oss in the native engine: a tiny random transformers GptOssForCausalLM (top-k MoE with router bias
and clamped SwiGLU, attention sinks, sliding window on alternate layers, YaRN RoPE) saved with
save_pretrained, in bf16 layout and as an MXFP4 checkpoint, served by the engine: greedy tokens equal to
transformers' generate, with prompts longer than the window, prefill in chunks and batched. Units: MXFP4
dequantisation against transformers' own, attention sinks in the references (against dense math) and in the
Triton kernels (under the interpreter, in a subprocess), YaRN frequencies against transformers', config.json
parsing."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from localrun.engine import EngineConfig, LLMEngine, SamplingParams
from localrun.engine.config import ModelConfig
from localrun.engine.models.gpt_oss import FP4_E2M1_VALUES, dequantize_mxfp4
from localrun.kernels import ops as K
from localrun.kernels import reference

transformers = pytest.importorskip("transformers")

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
VOCAB = 300
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
            max_position_embeddings=256, initializer_range=0.3,
            rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0, "beta_fast": 32.0,
                             "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 32})


def _hf_model(seed: int = 0):
    """The tiny model, with sinks, router bias and expert biases large enough to matter."""
    torch.manual_seed(seed)
    m = transformers.GptOssForCausalLM(transformers.GptOssConfig(**TINY)).float().eval()
    with torch.no_grad():
        for layer in m.model.layers:
            layer.self_attn.sinks.normal_(0, 1.0)
            layer.mlp.router.bias.normal_(0, 0.5)
            layer.mlp.experts.gate_up_proj_bias.normal_(0, 0.5)
            layer.mlp.experts.down_proj_bias.normal_(0, 0.5)
    return m


def _engine(path, budget: int = 32) -> LLMEngine:
    return LLMEngine.from_safetensors(path, EngineConfig(device="cpu", dtype="float32", max_model_len=256,
                                                         max_num_batched_tokens=budget))


def _prompts(seed: int = 1, lengths=(5, 40, 90)) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)  # 40 and 90 tokens: past the window (8) and the step budget (32)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


def assert_matches_transformers(eng: LLMEngine, hf, prompts: list[list[int]], max_tokens: int) -> None:
    """The engine's greedy tokens (the prompts batched) equal transformers' greedy continuation, each token
    the argmax of a full forward pass over prompt + tokens so far, and its logprobs agree within 1e-4.
    (A forward pass, not generate(): on some prompts longer than the window, transformers 5.23's generate()
    for gpt-oss computes the sliding layers' prefill differently from its own forward pass; the engine
    agrees with the forward pass.)"""
    outs = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                                                want_logprobs=True))
    for p, o in zip(prompts, outs):
        ids, ref_lp = list(p), []
        with torch.no_grad():
            for _ in range(max_tokens):
                lp = torch.log_softmax(hf(torch.tensor([ids])).logits[0, -1].float(), -1)
                ids.append(int(lp.argmax()))
                ref_lp.append(float(lp[ids[-1]]))
        assert o.token_ids == ids[len(p):]
        assert [lp for _, lp, _ in o.logprobs] == pytest.approx(ref_lp, abs=1e-4)


def test_tiny_gpt_oss_matches_transformers(tmp_path):
    hf = _hf_model()
    hf.save_pretrained(tmp_path)
    eng = _engine(tmp_path)
    mc = eng.model_config
    assert (mc.arch, mc.num_experts, mc.num_experts_per_tok, mc.moe_scoring, mc.moe_activation) == \
        ("gpt_oss", 4, 2, "topk_softmax", "swiglu_oai")
    assert mc.attention_sinks and mc.rope_scaling["rope_type"] == "yarn"
    assert [mc.layer_window(i) for i in range(4)] == [8, 0, 8, 0]
    prompts = _prompts()
    # batched (three prompts in flight together), the two long ones prefilled in chunks of <= 32 tokens
    assert_matches_transformers(eng, hf, prompts, max_tokens=6)
    # batched with other requests: a sampled one beside the greedy ones changes none of the greedy tokens
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    alone = [o.token_ids for o in eng.generate(prompts[1:], greedy)]
    mixed = eng.generate([prompts[0], prompts[1], prompts[2]],
                         [SamplingParams(temperature=1.0, seed=3, max_tokens=6, ignore_eos=True), greedy, greedy])
    assert [o.token_ids for o in mixed[1:]] == alone
    assert len({t for o in alone for t in o}) > 2  # not one token over and over: the parity above means something


def test_two_ranks_match_one(tmp_path):
    """Tensor parallelism (two CPU ranks, each reading its shard of the checkpoint): its heads' sinks and
    q/k/v rows, its columns of o_proj (the bias added once), its rows of every expert's gate and up and
    columns of down (w2's bias once): the same greedy tokens as one rank."""
    _hf_model().save_pretrained(tmp_path)
    prompts, outs = _prompts(lengths=(5, 40)), []
    for tp in (1, 2):
        eng = LLMEngine.from_safetensors(tmp_path, EngineConfig(device="cpu", dtype="float32", max_model_len=128,
                                                                kv_cache_tokens=512, max_num_batched_tokens=32,
                                                                tensor_parallel=tp))
        try:
            outs.append(eng.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                                             want_logprobs=True)))
        finally:
            eng.shutdown()
    for one, two in zip(*outs):
        assert two.token_ids == one.token_ids
        assert [lp for _, lp, _ in two.logprobs] == pytest.approx([lp for _, lp, _ in one.logprobs], abs=1e-4)


def _mxfp4_pack(codes: torch.Tensor) -> torch.Tensor:
    """FP4 codes [..., G, 32] (0..15) -> bytes [..., G, 16], the earlier value in the low nibble."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)


def test_dequantize_mxfp4_known_values():
    lut = torch.tensor(FP4_E2M1_VALUES)
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (3, 5, 2, 32), generator=g)
    exps = torch.randint(120, 134, (3, 5, 2), generator=g)
    out = dequantize_mxfp4(_mxfp4_pack(codes), exps.to(torch.uint8), torch.float32)
    want = (lut[codes] * torch.pow(2.0, (exps - 127).float())[..., None]).reshape(3, 5, 64)
    assert torch.equal(out, want)
    assert torch.equal(dequantize_mxfp4(_mxfp4_pack(codes), exps.to(torch.uint8)), want.to(torch.bfloat16))
    # one byte spelled out: 0x7A holds codes 0xA (-1.0, first) and 0x7 (6.0); scale 2 ** (128 - 127)
    blocks = torch.zeros(1, 16, dtype=torch.uint8)
    blocks[0, 0] = 0x7A
    assert dequantize_mxfp4(blocks, torch.tensor([128], dtype=torch.uint8), torch.float32)[:3].tolist() == \
        [-2.0, 12.0, 0.0]
    # transformers' own dequantisation (its [E, cols, rows] parameter layout is ours transposed)
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    theirs = convert_moe_packed_tensors(_mxfp4_pack(codes), exps.to(torch.uint8), dtype=torch.float32)
    assert torch.equal(theirs.transpose(1, 2), out)
    with pytest.raises(ValueError, match="do not match"):
        dequantize_mxfp4(_mxfp4_pack(codes), exps[..., :1].to(torch.uint8))


def test_mxfp4_checkpoint_dequantised_at_load(tmp_path, caplog):
    """A checkpoint as released (experts as *_blocks / *_scales, quantization_config mxfp4): the engine
    dequantises the experts, says so in the load log, and matches transformers run on the same values."""
    from safetensors.torch import save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    hf = _hf_model(seed=2)
    cfg = hf.config
    E, H, inter = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
    g = torch.Generator().manual_seed(5)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    for i, layer in enumerate(hf.model.layers):
        p = f"model.layers.{i}.mlp.experts."
        for proj, rows, cols in (("gate_up_proj", 2 * inter, H), ("down_proj", H, inter)):
            blocks = _mxfp4_pack(torch.randint(0, 16, (E, rows, cols // 32, 32), generator=g))
            scales = torch.randint(122, 126, (E, rows, cols // 32), generator=g).to(torch.uint8)
            with torch.no_grad():  # transformers runs the dequantised values: [E, cols, rows]
                getattr(layer.mlp.experts, proj).copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
            del state[p + proj]
            state[p + proj + "_blocks"], state[p + proj + "_scales"] = blocks, scales
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    conf = cfg.to_dict()
    conf["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (tmp_path / "config.json").write_text(json.dumps(conf))
    with caplog.at_level("INFO", logger="localrun.engine"):
        eng = _engine(tmp_path)
    assert eng.model.dequantised_experts
    assert any("MXFP4 expert weights dequantised at load" in r.getMessage() for r in caplog.records)
    assert_matches_transformers(eng, hf, _prompts(seed=4, lengths=(13, 90)), max_tokens=5)


def test_config_from_released_config_json():
    """The released checkpoints' config.json (old-style rope_theta / rope_scaling, experts_per_token)."""
    conf = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 2880,
            "intermediate_size": 2880, "num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8,
            "head_dim": 64, "vocab_size": 201088, "num_local_experts": 32, "experts_per_token": 4,
            "sliding_window": 128, "rope_theta": 150000, "max_position_embeddings": 131072, "swiglu_limit": 7.0,
            "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                             "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": False},
            "eos_token_id": 200002, "quantization_config": {"quant_method": "mxfp4"}}
    mc = ModelConfig.from_hf_config(conf)
    assert (mc.num_experts, mc.num_experts_per_tok, mc.moe_intermediate_size, mc.head_dim) == (32, 4, 2880, 64)
    assert mc.layer_types[:2] == ["sliding_attention", "full_attention"] and mc.layer_window(0) == 128
    assert mc.rope_theta == 150000.0 and mc.rope_scaling["factor"] == 32.0 and mc.eos_token_ids == [200002]
    with pytest.raises(ValueError, match="quantization"):
        ModelConfig.from_hf_config({**conf, "quantization_config": {"quant_method": "gptq"}})
    with pytest.raises(ValueError, match="swiglu_limit"):
        ModelConfig.from_hf_config({**conf, "swiglu_limit": 10.0})


@pytest.mark.parametrize("truncate", [True, False])
def test_yarn_frequencies_match_transformers(truncate):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
              "truncate": truncate, "original_max_position_embeddings": 4096}
    cfg = transformers.GptOssConfig(head_dim=64, rope_parameters=dict(params))
    theirs, attention = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    ours, factor = reference.yarn_inv_freq(64, 150000.0, params)
    assert torch.allclose(ours.float(), theirs, rtol=1e-6) and factor == pytest.approx(attention)
    table = K.rope_cos_sin_cache(64, 10, 150000.0, params)  # cos and sin scaled by the attention factor
    assert table[0, 0].item() == pytest.approx(attention)


def _dense_with_sinks(q, k, v, positions, scale, sinks, window=0):
    """Naive float64 attention with a sink logit per head in the softmax's denominator."""
    group = q.shape[1] // k.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for i, pos in enumerate(positions):
        lo = max(0, pos - window + 1) if window else 0
        for h in range(q.shape[1]):
            s = k[lo:pos + 1, h // group].double() @ q[i, h].double() * scale
            w = torch.exp(s) / (torch.exp(s).sum() + torch.exp(sinks[h].double()))
            out[i, h] = w @ v[lo:pos + 1, h // group].double()
    return out


@pytest.mark.parametrize("window", [0, 5])
def test_attention_sinks_references_match_dense(window):
    from test_kernels import extend_inputs, make_paged_batch, rel_err

    torch.manual_seed(0)
    sinks = torch.randn(4) * 2
    seq_lens = [1, 7, 19, 37]
    batch = make_paged_batch(seq_lens, 2, 16, 4, torch.float32, "cpu")
    q = torch.randn(len(seq_lens), 4, 16)
    out = K.paged_decode_attention_ref(q, batch.k_cache, batch.v_cache, batch.page_table, batch.seq_lens, 0.3,
                                       window=window, sinks=sinks)
    for b, n in enumerate(seq_lens):
        assert rel_err(out[b:b + 1], _dense_with_sinks(q[b:b + 1], batch.k[b], batch.v[b], [n - 1], 0.3, sinks,
                                                       window)) <= 1e-5
    spans = [(0, 7), (12, 7), (3, 1), (9, 30)]
    batch, q, cu = extend_inputs(spans, 4, 2, 16, 4, torch.float32, "cpu")
    out = K.extend_attention_ref(q, batch.k_cache, batch.v_cache, batch.page_table, cu, batch.seq_lens, 0.25,
                                 window=window, sinks=sinks)
    for b, (prefix, new) in enumerate(spans):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        dense = _dense_with_sinks(q[rows], batch.k[b], batch.v[b], range(prefix, prefix + new), 0.25, sinks, window)
        assert rel_err(out[rows], dense) <= 1e-5
    k, v = batch.k[0], batch.v[0]  # no cache (embeddings): the same math
    out = reference.causal_attention(q[:7], k, v, 0.25, window=window, sinks=sinks)
    assert rel_err(out, _dense_with_sinks(q[:7], k, v, range(7), 0.25, sinks, window)) <= 1e-5
    # the sinks change the result (the dense oracle above is not plain attention in disguise)
    plain = reference.causal_attention(q[:7], k, v, 0.25, window=window)
    assert not torch.allclose(out, plain)


@pytest.mark.skipif(not INTERPRETED, reason="run under TRITON_INTERPRET=1 by test_sink_kernels_in_interpreter")
@pytest.mark.parametrize("dtype,window", [(torch.float32, 5), (torch.bfloat16, 0)])
def test_triton_sinks_match_reference(dtype, window):
    from test_kernels import assert_close, extend_inputs, make_paged_batch, upcast

    torch.manual_seed(0)
    sinks = torch.randn(4) * 2
    seq_lens = [1, 7, 19, 37, 0]
    batch = make_paged_batch(seq_lens, 2, 16, 4, dtype, "cpu", write=K.store_kv)
    q = torch.randn(len(seq_lens), 4, 16).to(dtype)
    out = K.paged_decode_attention(q, batch.k_cache, batch.v_cache, batch.page_table, batch.seq_lens, 0.3,
                                   num_kv_splits=3, window=window, sinks=sinks)
    oracle = K.paged_decode_attention_ref(*upcast(q, batch.k_cache, batch.v_cache), batch.page_table,
                                          batch.seq_lens, 0.3, window=window, sinks=sinks)
    assert_close(out, oracle, dtype)
    spans = [(0, 7), (12, 7), (3, 1), (0, 19), (9, 30)]
    batch, q, cu = extend_inputs(spans, 4, 2, 16, 4, dtype, "cpu")
    out = K.extend_attention(q, batch.k_cache, batch.v_cache, batch.page_table, cu, batch.seq_lens, 0.25,
                             window=window, sinks=sinks)
    oracle = K.extend_attention_ref(*upcast(q, batch.k_cache, batch.v_cache), batch.page_table, cu,
                                    batch.seq_lens, 0.25, window=window, sinks=sinks)
    assert_close(out, oracle, dtype)


@pytest.mark.skipif(not INTERPRETED, reason="run under TRITON_INTERPRET=1 by test_sink_kernels_in_interpreter")
def test_kernel_trials_cover_sinks():
    """The engine's warm-up trials run the attention kernels with the model's sinks (the SINKS variant the
    steps launch) and keep them: they agree with the references."""
    from localrun.engine import fallbacks as fb

    mc = ModelConfig.from_hf_config({**transformers.GptOssConfig(**TINY).to_dict()})
    seen: list[str] = []
    names = ("paged_decode_attention", "extend_attention")
    assert fb.try_kernels(mc, torch.float32, torch.float32, 16, torch.device("cpu"), seen.append, names=names) \
        == frozenset(), seen
    assert fb._inputs(mc, torch.float32, torch.float32, 16, "cpu")["sinks"].shape == (4,)


def test_sink_kernels_in_interpreter():
    pytest.importorskip("triton")
    if INTERPRETED:
        pytest.skip("already interpreting")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", f"{__file__}::test_triton_sinks_match_reference",
           f"{__file__}::test_kernel_trials_cover_sinks", "-q", "-p", "no:cacheprovider", "-x"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    tail = (r.stdout + r.stderr)[-6000:]
    assert r.returncode == 0, tail
    passed = re.search(r"(\d+) passed", r.stdout.strip().splitlines()[-1])
    assert passed and int(passed.group(1)) == 3, tail


def test_memory_plan_counts_experts_and_says_they_are_dequantised():
    """gpt-oss-20b's shape: the plan's weights count every expert (about 21B parameters), and with an MXFP4
    checkpoint the plan's detail says the experts are dequantised to bf16 at load."""
    from localrun.backends.base import MemoryEstimate
    from localrun.backends.native import _dequant_note
    from localrun.server.memory import plan_load

    conf = {"model_type": "gpt_oss", "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 24,
            "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 201088,
            "num_local_experts": 32, "num_experts_per_tok": 4, "sliding_window": 128,
            "quantization_config": {"quant_method": "mxfp4"}}
    mc = ModelConfig.from_hf_config(conf)
    assert 20.5e9 < mc.num_params < 21.5e9  # OpenAI's model card: 21B parameters
    note = _dequant_note(mc, torch.bfloat16)
    assert note.startswith("MXFP4 expert weights dequantised to bfloat16 at load")
    assert _dequant_note(ModelConfig.from_hf_config({k: v for k, v in conf.items() if k != "quantization_config"}),
                         torch.bfloat16) == ""
    plan = plan_load(MemoryEstimate(weights_bytes=mc.num_params * 2, kv_bytes=2**30, overhead_bytes=0, note=note),
                     24, ram_free=2**40)
    assert note in plan.detail
