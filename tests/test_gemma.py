"""Sliding-window attention, logit soft-capping, Gemma 2 and Gemma 3 on tiny random-init
transformers models: greedy tokens identical and logprobs close, fp32 on CPU, with prompts
longer than the window and chunked prefill (a cached prefix on the paged KV)."""

from __future__ import annotations

import pytest
import torch

from localrun.engine import EngineConfig, LLMEngine, SamplingParams
from localrun.engine.config import ModelConfig
from gguf_util import add_decoder_metadata
from parity import assert_greedy_parity

transformers = pytest.importorskip("transformers")

# head_dim 16, 4 layers (both layer kinds), window 8 (prompts of 5 to 90 tokens)
COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, vocab_size=300, max_position_embeddings=256,
              initializer_range=0.3)


def _randomize_norms(model) -> None:
    """Gemma's norms start at 0 (weight 1 + 0): give them values so the +1 folding is tested."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0, 0.3)


def _hf_model(kind: str):
    torch.manual_seed(0)
    if kind == "mistral":
        return transformers.MistralForCausalLM(transformers.MistralConfig(**COMMON, sliding_window=8))
    if kind == "qwen2":  # use_sliding_window: layers from max_window_layers on
        cfg = transformers.Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=8, max_window_layers=2)
        return transformers.Qwen2ForCausalLM(cfg)
    if kind == "gemma2":
        cfg = transformers.Gemma2Config(**COMMON, sliding_window=8, query_pre_attn_scalar=24,
                                        attn_logit_softcapping=3.0, final_logit_softcapping=5.0)
        m = transformers.Gemma2ForCausalLM(cfg)
    else:  # gemma3: local layers 0-2 (rope base 100), global layer 3 (linear rope scaling), q/k norms
        cfg = transformers.Gemma3TextConfig(**COMMON, sliding_window=8, sliding_window_pattern=4,
                                            query_pre_attn_scalar=16, rope_parameters={
                                                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                                                "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                   "rope_theta": 10000.0}})
        m = transformers.Gemma3ForCausalLM(cfg)
    _randomize_norms(m)
    return m


def _prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 300, (n,), generator=g).tolist() for n in (5, 40, 90)]


@pytest.mark.parametrize("kind", ["mistral", "qwen2", "gemma2", "gemma3"])
def test_sliding_window_models_match_transformers(kind, tmp_path):
    hf = _hf_model(kind).float().eval()
    hf.save_pretrained(tmp_path, safe_serialization=True)
    eng = LLMEngine.from_safetensors(tmp_path, EngineConfig(device="cpu", dtype="float32", max_model_len=256,
                                                            max_num_batched_tokens=32, page_size=4))
    mc = eng.model_config
    windows = [mc.layer_window(i) for i in range(mc.num_layers)]
    assert windows == {"mistral": [8] * 4, "qwen2": [0, 0, 8, 8], "gemma2": [8, 0, 8, 0],
                       "gemma3": [8, 8, 8, 0]}[kind]
    if kind == "gemma2":
        assert (mc.attn_logit_softcap, mc.final_logit_softcap, mc.query_pre_attn_scalar) == (3.0, 5.0, 24.0)
    if kind == "gemma3":
        assert mc.rope_local_theta == 100.0 and mc.rope_scaling["rope_type"] == "linear"
    assert_greedy_parity(eng, hf, _prompts())
    # the prefix cache: a prompt that extends a finished one starts from its cached pages
    p = _prompts()[2]
    assert_greedy_parity(eng, hf, [p + [7, 8, 9, 10, 11]], max_tokens=4)
    assert eng.stats()["kv_pages_free"] + eng.stats()["cached_pages"] == eng.stats()["kv_pages_total"]


def test_window_changes_the_output(tmp_path):
    """The window is not a no-op at these lengths: a Mistral without it generates differently."""
    hf = _hf_model("mistral").float().eval()
    hf.save_pretrained(tmp_path, safe_serialization=True)
    cfg = EngineConfig(device="cpu", dtype="float32", max_model_len=256, max_num_batched_tokens=32)
    eng = LLMEngine.from_safetensors(tmp_path, cfg)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, want_logprobs=True)
    with_window = eng.generate([_prompts()[2]], params)[0]
    hf.config.sliding_window = None
    hf.save_pretrained(tmp_path / "global", safe_serialization=True)
    without = LLMEngine.from_safetensors(tmp_path / "global", cfg).generate([_prompts()[2]], params)[0]
    assert [lp for _, lp, _ in with_window.logprobs] != pytest.approx([lp for _, lp, _ in without.logprobs], abs=1e-3)


def test_multimodal_gemma3_config_uses_its_text_config():
    text = transformers.Gemma3TextConfig(**COMMON, sliding_window=8).to_dict()
    mc = ModelConfig.from_hf_config({"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
                                     "text_config": text, "eos_token_id": [1, 106]})
    assert (mc.arch, mc.hidden_size, mc.num_layers, mc.eos_token_ids) == ("gemma3", 64, 4, [1, 106])
    with pytest.raises(ValueError, match="text_config"):
        ModelConfig.from_hf_config({"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"]})


def test_bad_sliding_window_settings_are_refused():
    with pytest.raises(ValueError, match="layer_types must list 2"):
        ModelConfig(64, 2, 4, 2, 128, 300, sliding_window=8, layer_types=["sliding_attention"])
    with pytest.raises(ValueError, match="sliding_window must be"):
        ModelConfig(64, 2, 4, 2, 128, 300, sliding_window=-1)


def test_multimodal_gemma3_checkpoint_runs_its_language_model(tmp_path):
    """Gemma3ForConditionalGeneration's weights (language model under model.language_model.*, a vision
    tower beside it): the native engine loads the language model and matches transformers on text."""
    torch.manual_seed(0)
    text = transformers.Gemma3TextConfig(**COMMON, sliding_window=8, sliding_window_pattern=2)
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=28, patch_size=14)
    cfg = transformers.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
                                    image_token_index=299, boi_token_index=297, eoi_token_index=298)
    hf = transformers.Gemma3ForConditionalGeneration(cfg)
    _randomize_norms(hf.model.language_model)
    hf = hf.float().eval()
    hf.save_pretrained(tmp_path, safe_serialization=True)
    eng = LLMEngine.from_safetensors(tmp_path, EngineConfig(device="cpu", dtype="float32", max_model_len=256,
                                                            max_num_batched_tokens=32, page_size=4))
    assert eng.model_config.arch == "gemma3"
    assert_greedy_parity(eng, hf, _prompts()[:2], max_tokens=4)


def _write_gguf_like_llama_cpp(hf, path, arch: str):
    """A GGUF file written from a transformers model the way llama.cpp's convert_hf_to_gguf.py does
    for Gemma 2 / 3: gguf's own tensor-name map, norm weights stored as 1 + w, no Q/K permutation,
    no lm_head (tied), and the metadata keys the converter writes."""
    import gguf

    cfg = hf.config
    w = gguf.GGUFWriter(str(path), arch)
    add_decoder_metadata(w, cfg)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_sliding_window(cfg.sliding_window)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    else:
        w.add_rope_freq_base(cfg.rope_parameters["full_attention"]["rope_theta"])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA2 if arch == "gemma2" else gguf.MODEL_ARCH.GEMMA3,
                                     cfg.num_hidden_layers)
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight":
            continue
        t = t.detach().float()
        if name.endswith("norm.weight"):
            t = t + 1
        w.add_tensor(names.get_name(name, try_suffixes=(".weight",)), t.numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_gemma_gguf_matches_transformers(arch, tmp_path):
    pytest.importorskip("gguf")
    from localrun.engine.models.loader import read_gguf

    torch.manual_seed(0)
    if arch == "gemma2":  # llama.cpp's defaults: scale by head_dim, layers alternate sliding / global
        cfg = transformers.Gemma2Config(**COMMON, sliding_window=8, query_pre_attn_scalar=16,
                                        attn_logit_softcapping=3.0, final_logit_softcapping=5.0)
        hf = transformers.Gemma2ForCausalLM(cfg)
    else:  # llama.cpp's Gemma 3: 5 sliding : 1 global, sliding layers at RoPE base 10000
        cfg = transformers.Gemma3TextConfig(**{**COMMON, "num_hidden_layers": 7}, sliding_window=8,
                                            query_pre_attn_scalar=16, rope_parameters={
                                                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                "full_attention": {"rope_type": "default", "rope_theta": 50000.0}})
        hf = transformers.Gemma3ForCausalLM(cfg)
    _randomize_norms(hf)
    hf = hf.float().eval()
    path = _write_gguf_like_llama_cpp(hf, tmp_path / f"{arch}.gguf", arch)
    mcfg, get, names, _ = read_gguf(path)
    assert mcfg.arch == arch and mcfg.tie_word_embeddings
    expect = cfg.layer_types
    assert [("sliding_attention" if mcfg.layer_window(i) else "full_attention") for i in range(mcfg.num_layers)] \
        == expect
    eng = LLMEngine.from_hf_state(mcfg, get, names, EngineConfig(device="cpu", dtype="float32", max_model_len=256,
                                                                 max_num_batched_tokens=32, page_size=4))
    assert_greedy_parity(eng, hf, _prompts()[1:], max_tokens=6)


def test_gemma_shapes_and_the_graph_decode_path():
    """The named shapes describe the real models; a tiny random Gemma 2 decodes the same through the
    padded static-buffer decode (the CUDA-graph path, run eagerly on CPU) as without it."""
    from localrun.engine.models.shapes import get_shape

    g2, g3 = get_shape("gemma-2-2b"), get_shape("gemma-3-1b")
    assert round(g2.num_params / 1e9, 2) == 2.61 and round(g3.num_params / 1e9, 2) == 1.0
    assert [g2.layer_window(i) for i in range(4)] == [4096, 0, 4096, 0]
    assert [g3.layer_window(i) for i in range(6)] == [512] * 5 + [0]
    tiny = ModelConfig(64, 4, 4, 2, 128, 300, head_dim=16, arch="gemma2", sliding_window=8,
                       layer_types=["sliding_attention", "full_attention"] * 2, attn_logit_softcap=3.0,
                       final_logit_softcap=5.0, query_pre_attn_scalar=16, tie_word_embeddings=True)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, want_logprobs=True)
    outs = []
    for graphs in (False, True):
        cfg = EngineConfig(device="cpu", dtype="float32", max_model_len=128, cuda_graphs=graphs, page_size=4,
                           max_num_seqs=4)
        outs.append(LLMEngine.from_random(tiny, cfg, seed=2).generate(_prompts()[:2], params))
    for a, b in zip(*outs):
        assert a.token_ids == b.token_ids
        assert [lp for _, lp, _ in a.logprobs] == pytest.approx([lp for _, lp, _ in b.logprobs], abs=1e-5)


@pytest.mark.parametrize("kind", ["gemma3"])
def test_gemma_two_tensor_parallel_ranks_match_transformers(kind, tmp_path):
    """Gemma 3 (q/k norms, a second RoPE table, float32 norms) split over 2 ranks (gloo on CPU):
    heads, KV heads, MLP columns and the vocabulary sharded, the embedding scale and the norms
    replicated; still token for token transformers'."""
    hf = _hf_model(kind).float().eval()
    hf.save_pretrained(tmp_path, safe_serialization=True)
    eng = LLMEngine.from_safetensors(tmp_path, EngineConfig(device="cpu", dtype="float32", max_model_len=256,
                                                            max_num_batched_tokens=32, page_size=4,
                                                            kv_cache_tokens=1024, tensor_parallel=2))
    try:
        assert eng.stats()["tensor_parallel"] == 2
        assert_greedy_parity(eng, hf, _prompts()[1:], max_tokens=6)
    finally:
        eng.shutdown()
