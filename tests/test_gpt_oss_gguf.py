"""gpt-oss from GGUF: a tiny random GptOssForCausalLM (tests/tools/tiny_gpt_oss.py: 4 experts, top 2, sinks,
router and expert biases, sliding window 8 on alternate layers, YaRN), in bf16 and as a released-style MXFP4
checkpoint, each converted by llama.cpp's own converter (it splits transformers' interleaved gate_up_proj into
stacked ffn_gate_exps / ffn_up_exps with their biases, repacking MXFP4 experts into GGUF MXFP4; the sinks as
attn_sinks), served by the native engine through the real daemon, against llama.cpp's greedy answer on the same
file (equal, or parting only at an honest near tie: localrun.bench.greedy). The prompts run past the window."""

from __future__ import annotations

from pathlib import Path

import pytest

from daemon import Daemon
from localrun.bench.greedy import compare
from test_moe_gguf import _tokens

openai = pytest.importorskip("openai")
llama_cpp = pytest.importorskip("llama_cpp")

MODELS = ("tiny-gpt-oss", "tiny-gpt-oss-mxfp4")
PROMPTS = ["The quick brown fox", "def fibonacci(n):",
           "Once upon a time, in a land far away, there lived a king who had three daughters, and"]
N = 10


@pytest.fixture(scope="module")
def gpt_oss_ggufs(tmp_path_factory, request) -> list[Path]:
    """(the bf16 GGUF, the MXFP4 one)."""
    from vlm_model import build_models

    try:
        cache = request.config.cache.mkdir("tiny-gpt-oss")
    except AttributeError:  # the cache plugin is off
        cache = tmp_path_factory.mktemp("tiny-gpt-oss")
    return build_models(cache, "tiny_gpt_oss.py", {"tiny-gpt-oss.gguf": ("",), "tiny-gpt-oss-mxfp4.gguf": ("mxfp4",)})


def test_the_gguf_reads_as_gpt_oss(gpt_oss_ggufs):
    """The config the engine reads from llama.cpp's metadata keys: what the Hugging Face config says, YaRN as
    llama.cpp applies it (the correction range rounded out to whole dims); the MXFP4 GGUF's experts read as the
    checkpoint's blocks / scales dequantised (gate rows 0::2, up rows 1::2 of gate_up_proj)."""
    import torch
    from safetensors.torch import load_file

    from localrun.engine.models.gpt_oss import dequantize_mxfp4
    from localrun.engine.models.loader import read_gguf

    cfg, get, names, _ = read_gguf(gpt_oss_ggufs[0])
    assert not cfg.experts_mxfp4
    assert (cfg.arch, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == ("gpt_oss", 4, 2, 32)
    assert (cfg.moe_scoring, cfg.moe_activation, cfg.attention_sinks) == ("topk_softmax", "swiglu_oai", True)
    assert cfg.layer_types == ["sliding_attention", "full_attention"] * 2 and cfg.sliding_window == 8
    assert cfg.rope_scaling == {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 128,
                                "truncate": True, "beta_fast": 32.0, "beta_slow": 1.0}
    assert tuple(get("model.layers.0.mlp.experts.gate_proj.weight").shape) == (4, 32, 64)
    assert tuple(get("model.layers.0.mlp.experts.down_proj.weight").shape) == (4, 64, 32)
    assert tuple(get("model.layers.1.self_attn.sinks").shape) == (4,)

    cfg, get, names, _ = read_gguf(gpt_oss_ggufs[1])
    assert cfg.experts_mxfp4
    st = load_file(str(gpt_oss_ggufs[1].parent / "hf" / "mxfp4" / "model.safetensors"))
    e = "model.layers.2.mlp.experts."
    gate_up = dequantize_mxfp4(st[e + "gate_up_proj_blocks"], st[e + "gate_up_proj_scales"], torch.float32)
    assert torch.equal(get(e + "gate_proj.weight"), gate_up[:, 0::2])
    assert torch.equal(get(e + "up_proj.weight"), gate_up[:, 1::2])
    assert torch.equal(get(e + "down_proj.weight"),
                       dequantize_mxfp4(st[e + "down_proj_blocks"], st[e + "down_proj_scales"], torch.float32))


def test_native_engine_serves_gpt_oss_ggufs_as_llama_cpp_answers(gpt_oss_ggufs, tmp_path):
    refs = {}
    for model, path in zip(MODELS, gpt_oss_ggufs):
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=256, n_threads=2, verbose=False, logits_all=True)
        try:
            refs[model] = [_tokens(llm.create_completion(p, max_tokens=N, temperature=0, logprobs=5)["choices"][0]
                                   ["logprobs"]) for p in PROMPTS]
        finally:
            llm.close()
    assert refs[MODELS[0]] != refs[MODELS[1]]  # the MXFP4 experts are other weights: another answer

    d = Daemon(tmp_path / "home", LOCALRUN_BACKEND="native", LOCALRUN_CONTEXT_LENGTH="256", LOCALRUN_MAX_LOADED_MODELS="1")
    try:
        client = openai.OpenAI(base_url=d.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        for model, path in zip(MODELS, gpt_oss_ggufs):
            r = d.http.post("/api/create", json={"model": model, "modelfile": f"FROM {path}\n", "stream": False})
            assert r.status_code == 200, r.text
            for prompt, ref in zip(PROMPTS, refs[model]):
                out = client.completions.create(model=model, prompt=prompt, max_tokens=N, temperature=0, logprobs=5,
                                                extra_body={"ignore_eos": True})
                got = _tokens(out.choices[0].logprobs.model_dump())
                c = compare(ref, got)
                assert c.acceptable, (model, prompt, c, [t for t, _, _ in ref], [t for t, _, _ in got])
            (m,) = [m for m in d.ps() if m["name"].split(":")[0] == model]
            assert m["backend"] == "native" and m["fallbacks"] == [], m
    finally:
        d.stop()


def test_auto_sends_a_gpt_oss_gguf_where_it_sends_other_ggufs(monkeypatch):
    """auto's rule, unchanged: the native engine on a datacenter GPU for an unquantized GGUF, llama.cpp for a
    quantized one (MXFP4) where llama.cpp has the GPU, and llama.cpp without a GPU."""
    from types import SimpleNamespace

    from localrun.backends import select
    from localrun.backends.select import GPU, choose

    monkeypatch.setattr(select, "native_import_error", lambda: None)
    h100 = GPU("NVIDIA H100 80GB HBM3", (9, 0), 78 * 2**30, 80 * 2**30)

    def facts(file_type):
        return SimpleNamespace(architecture="gpt-oss", file_type=file_type, parameter_count=int(21e9),
                               tensor_bytes=int(13e9))

    assert choose("auto", "gguf", h100, facts("BF16"), llamacpp_gpu=True).backend == "native"
    assert choose("auto", "gguf", h100, facts("MXFP4"), llamacpp_gpu=True).backend == "llamacpp"
    assert choose("auto", "gguf", None, facts("BF16")).backend == "llamacpp"
    assert choose("native", "gguf", None, facts("MXFP4")).backend == "native"
