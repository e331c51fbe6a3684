"""A mixture of experts from GGUF: a tiny random Qwen3-MoE (tests/tools/tiny_moe.py: 8 experts, top 2) converted
by llama.cpp's own converter (stacked ffn_{gate,up,down}_exps, the router ffn_gate_inp), served by the native engine
through the real daemon, against llama.cpp's greedy answer on the same file (equal, or parting only at an honest
near tie: localrun.bench.greedy); `show` lists the experts; `auto` picks as for a dense model."""

from __future__ import annotations

from pathlib import Path

import pytest

from daemon import Daemon
from localrun.bench.greedy import compare

openai = pytest.importorskip("openai")
llama_cpp = pytest.importorskip("llama_cpp")

MODEL = "tiny-moe"
PROMPTS = ["The quick brown fox", "def fibonacci(n):", "Once upon a time, in a land far away, there lived"]
N = 10


@pytest.fixture(scope="module")
def moe_gguf(tmp_path_factory, request) -> Path:
    from vlm_model import build_models

    try:
        cache = request.config.cache.mkdir("tiny-moe")
    except AttributeError:  # the cache plugin is off
        cache = tmp_path_factory.mktemp("tiny-moe")
    return build_models(cache, "tiny_moe.py", {"tiny-moe.gguf": ("",)})[0]


def _tokens(lp: dict) -> list:
    """OpenAI's legacy completion logprobs as localrun.bench.greedy Tokens. A token holding part of a UTF-8
    character reads ' ' from llama-cpp-python and ' \ufffd' from localrun: compared without the U+FFFD."""
    def t(text):
        return text.replace("\ufffd", "")

    return [(t(tok), float(lp_), [(t(k), v) for k, v in top.items()])
            for tok, lp_, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"])]


def test_native_engine_serves_a_qwen3_moe_gguf_as_llama_cpp_answers(moe_gguf, tmp_path):
    llm = llama_cpp.Llama(model_path=str(moe_gguf), n_ctx=256, n_threads=2, verbose=False, logits_all=True)
    try:
        refs = [_tokens(llm.create_completion(p, max_tokens=N, temperature=0, logprobs=5)["choices"][0]["logprobs"])
                for p in PROMPTS]
    finally:
        llm.close()

    d = Daemon(tmp_path / "home", LOCALRUN_BACKEND="native", LOCALRUN_CONTEXT_LENGTH="256")
    try:
        r = d.http.post("/api/create", json={"model": MODEL, "modelfile": f"FROM {moe_gguf}\n", "stream": False})
        assert r.status_code == 200, r.text
        client = openai.OpenAI(base_url=d.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        for prompt, ref in zip(PROMPTS, refs):
            out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=N, temperature=0, logprobs=5,
                                            extra_body={"ignore_eos": True})
            got = _tokens(out.choices[0].logprobs.model_dump())
            c = compare(ref, got)
            assert c.acceptable, (prompt, c, [t for t, _, _ in ref], [t for t, _, _ in got])
        (m,) = [m for m in d.ps() if m["name"].startswith(MODEL)]
        (m,) = [m for m in d.ps() if m["name"].startswith(MODEL)]
        assert m["backend"] == "native" and m["fallbacks"] == [], m
        show = d.http.post("/api/show", json={"model": MODEL}).json()
        assert (show["model_info"]["qwen3moe.expert_count"], show["model_info"]["qwen3moe.expert_used_count"]) == (8, 2)
        from localrun.cli.models import render_show

        assert "experts             8 (2 active per token)" in render_show(show)
    finally:
        d.stop()


def test_auto_sends_moe_models_where_it_sends_dense_ones(monkeypatch, tmp_path):
    """The native engine on a datacenter GPU, llama.cpp elsewhere: the rule of a dense model."""
    import json
    from types import SimpleNamespace

    from localrun.backends import select
    from localrun.backends.select import GPU, choose, model_architecture

    monkeypatch.setattr(select, "native_import_error", lambda: None)
    h100 = GPU("NVIDIA H100 80GB HBM3", (9, 0), 78 * 2**30, 80 * 2**30)
    t4 = GPU("Tesla T4", (7, 5), 15 * 2**30, 16 * 2**30)
    for arch in ("qwen3moe", "llama", "qwen3"):  # a Mixtral GGUF says llama
        facts = SimpleNamespace(architecture=arch, file_type="BF16", parameter_count=int(3e9), tensor_bytes=int(6e9))
        assert choose("auto", "gguf", h100, facts, llamacpp_gpu=True).backend == "native", arch
        assert choose("auto", "gguf", t4, facts, llamacpp_gpu=True).backend == "llamacpp", arch
        assert choose("auto", "gguf", None, facts).backend == "llamacpp", arch
    for model_type in ("qwen3_moe", "mixtral"):
        (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
        arch = model_architecture("safetensors", tmp_path)
        assert choose("auto", "safetensors", h100, None, arch=arch).backend == "native"
        assert choose("auto", "safetensors", None, None, arch=arch).backend == "native"  # safetensors: native only
