"""The llama.cpp backend's KV cache type (LOCALRUN_KV_CACHE_TYPE, PARAMETER kv_cache_type), as
OLLAMA_KV_CACHE_TYPE: f16 by default, q8_0 (int8) and q4_0 blocks for about a half and a quarter of the
memory. Checked on the real SmolLM2 in llama.cpp (the sequence's state really is that size, the answer
stays the model's, cached prefixes still copy), on a tiny model whose 16-wide heads no 32-element block
divides (llama.cpp refuses such a cache; the load keeps f16 and says so), and through the real daemon
(the memory plan, /api/ps)."""

from __future__ import annotations

import asyncio
import types

import pytest
from daemon import MODEL, Daemon

from localrun.backends.base import GenerationRequest, LoadSpec, SamplingOptions
from localrun.errors import InvalidRequest

pytestmark = pytest.mark.timeout(600)

pytest.importorskip("llama_cpp")


def run(coro):
    return asyncio.run(coro)


async def answer(backend, prompt: str, **opts):
    o = SamplingOptions(**{"temperature": 0.0, "max_tokens": 6, "logprobs": True, "top_logprobs": 2, **opts})
    return [c async for c in backend.generate(GenerationRequest(prompt=prompt, options=o))]


def spec(gguf, kv: str | None, **kw) -> LoadSpec:
    extra = {"n_threads": 2, **({"kv_cache_type": kv} if kv is not None else {})}
    return LoadSpec("smollm2:135m", gguf, "gguf", num_ctx=kw.pop("num_ctx", 512), num_parallel=kw.pop("parallel", 2),
                    extra=extra)


# -- names, the estimate ---------------------------------------------------------------------------
def test_names_map_to_llama_cpp_cache_types(monkeypatch):
    from localrun.backends.llamacpp import memory as llamacpp
    from localrun.config import settings

    assert settings({"LOCALRUN_KV_CACHE_TYPE": "Q4_0"}).kv_cache_type == "q4_0"
    with pytest.raises(ValueError, match="LOCALRUN_KV_CACHE_TYPE must be one of .*q4_0.*'q5_9'"):
        settings({"LOCALRUN_KV_CACHE_TYPE": "q5_9"})
    s = LoadSpec("m", "x.gguf", "gguf", num_ctx=8)
    for env, want in (("auto", "f16"), ("f16", "f16"), ("bf16", "bf16"), ("fp32", "f32"), ("q8_0", "q8_0"),
                      ("int8", "q8_0"), ("fp8", "q8_0"), ("q4_0", "q4_0")):
        monkeypatch.setenv("LOCALRUN_KV_CACHE_TYPE", env)
        assert llamacpp.kv_cache_type(s) == want, env
    s.extra["kv_cache_type"] = "q4_0"  # the Modelfile's PARAMETER wins over the environment
    assert llamacpp.kv_cache_type(s) == "q4_0"
    s.extra["kv_cache_type"] = "int4"
    with pytest.raises(InvalidRequest, match="must be one of"):
        llamacpp.kv_cache_type(s)


def test_a_head_size_the_blocks_do_not_divide_keeps_f16():
    from localrun.backends.llamacpp.memory import kv_type_for_model

    def header(hidden, heads, **meta):
        return types.SimpleNamespace(architecture="llama", embedding_length=hidden, head_count=heads,
                                     metadata={f"llama.attention.{k}": v for k, v in meta.items()})

    assert kv_type_for_model("q8_0", header(576, 9)) == ("q8_0", "")  # SmolLM2: 64
    kv, why = kv_type_for_model("q4_0", header(2560, 32))  # phi-2's 80
    assert kv == "f16" and "head size 80 is not a multiple of 32" in why and "q4_0" in why
    assert kv_type_for_model("q8_0", header(640, 4, key_length=256, value_length=256)) == ("q8_0", "")  # Gemma 3
    assert kv_type_for_model("q8_0", header(2048, 16, key_length=128, value_length=80))[0] == "f16"
    assert kv_type_for_model("f16", header(2560, 32)) == ("f16", "")


def test_the_memory_estimate_follows_the_type(smollm2_gguf, monkeypatch):
    from localrun.backends.llamacpp import estimate_memory
    from localrun.server.memory import plan_load

    cells = 512 * 2
    per_token = 30 * 3 * (64 + 64)  # SmolLM2: 30 layers, 3 KV heads of 64, K and V
    monkeypatch.delenv("LOCALRUN_KV_CACHE_TYPE", raising=False)
    f16 = estimate_memory(spec(smollm2_gguf, None))
    assert f16.kv_bytes == cells * per_token * 2 and f16.kv_type == ""
    q8 = estimate_memory(spec(smollm2_gguf, "q8_0"))
    assert q8.kv_bytes == cells * per_token * 34 // 32 and q8.kv_type == "q8_0"
    monkeypatch.setenv("LOCALRUN_KV_CACHE_TYPE", "q4_0")
    q4 = estimate_memory(spec(smollm2_gguf, None))
    assert q4.kv_bytes == cells * per_token * 18 // 32 and q4.weights_bytes == f16.weights_bytes
    assert "q4_0 KV cache" in plan_load(q4, 30, ram_free=64 * 2**30).detail


# -- the real llama.cpp, SmolLM2 ---------------------------------------------------------------------
def test_the_cache_holds_the_type_and_the_answer_stays_the_models(smollm2_gguf):
    """The sequence's state (its KV cells) is llama.cpp's own measure of the cache: q8_0 is 34 and q4_0
    18 bytes a 32-element block against f16's 64. The greedy answer's first token is the model's."""
    from localrun.backends.llamacpp import LlamaCppBackend

    sizes, firsts = {}, {}
    for kv in ("f16", "q8_0", "q4_0"):
        b = LlamaCppBackend(spec(smollm2_gguf, kv))
        try:
            assert b.info.kv_cache_type == kv and f"({kv})" in b.info.reason and not b.info.fallbacks
            chunks = run(answer(b, "The capital of France is"))
            sizes[kv] = b._lib.llama_state_seq_get_size(b.engine.ctx, 0)
            firsts[kv] = chunks[0].logprobs[0].top
            assert chunks[0].text == " Paris", (kv, chunks[0].text)
        finally:
            run(b.close())
    assert 0.52 < sizes["q8_0"] / sizes["f16"] < 34 / 64 + 0.01, sizes
    assert 0.27 < sizes["q4_0"] / sizes["f16"] < 18 / 64 + 0.01, sizes
    # the quantized caches move the first token's probability, not its rank
    assert all(top[0][0] == " Paris" for top in firsts.values()), firsts


def test_a_quantized_cache_copies_prefixes_cell_by_cell_as_whole_streams(smollm2_gguf):
    """With q8_0 blocks in the cache, a prefix copied by its cells (the sequence's state saved and
    loaded) answers token for token as llama.cpp's whole-stream copy."""
    from localrun.backends.llamacpp import LlamaCppBackend

    system = "<|im_start|>system\nYou are a terse assistant who answers in one sentence.<|im_end|>\n"
    prompts = [f"{system}<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"
               for q in ("Why is the sky blue?", "Name three primary colors.", "What do bees make?")]

    def serve(cell_by_cell: bool):
        b = LlamaCppBackend(spec(smollm2_gguf, "q8_0", num_ctx=2048))
        b.engine.copy_cells = cell_by_cell
        try:
            texts = ["".join(c.text for c in run(answer(b, p, max_tokens=24, ignore_eos=True))) for p in prompts]
            return texts, run(b.stats())
        finally:
            run(b.close())

    (cells, st_cells), (whole, st_whole) = serve(True), serve(False)
    assert st_cells["copied_cells"] > 0 and st_whole["copied_streams"] >= 1, (st_cells, st_whole)
    assert cells == whole


# -- a model whose heads no block divides: the tiny FIM model (16-wide heads; conftest's fim_gguf) -------
def test_llama_cpp_refuses_the_blocks_and_the_load_keeps_f16(fim_gguf, monkeypatch):
    import llama_cpp.llama_cpp as lib

    from localrun.backends.llamacpp import backend as llamacpp

    model = lib.llama_model_load_from_file(str(fim_gguf).encode(), lib.llama_model_default_params())
    try:
        cp = lib.llama_context_default_params()
        cp.n_ctx, cp.type_k, cp.type_v = 256, llamacpp.KV_TYPES["q8_0"][0], llamacpp.KV_TYPES["q8_0"][0]
        assert not lib.llama_init_from_model(model, cp)  # what the header check spares the load
    finally:
        lib.llama_model_free(model)

    def load():
        s = LoadSpec("tinyfim", fim_gguf, "gguf", num_ctx=256, num_parallel=1,
                     extra={"n_threads": 2, "kv_cache_type": "q8_0"})
        b = llamacpp.LlamaCppBackend(s)
        try:
            chunks = run(answer(b, "def add(a, b):", max_tokens=4, ignore_eos=True, logprobs=False))
            return b.info, sum(len(c.token_ids) for c in chunks)
        finally:
            run(b.close())

    info, n = load()  # the header says 16: f16 without asking llama.cpp
    assert info.kv_cache_type == "f16" and n == 4
    assert info.fallbacks == ["KV cache f16, not q8_0: the model's head size 16 is not a multiple of 32, q8_0's block"]
    # were the header silent, llama.cpp's refusal is caught the same way
    monkeypatch.setattr(llamacpp, "kv_type_for_model", lambda kv, info: (kv, ""))
    info, n = load()
    assert info.kv_cache_type == "f16" and n == 4
    assert info.fallbacks == ["KV cache f16, not q8_0: llama.cpp could not make a q8_0 cache here"]


# -- through the real daemon ---------------------------------------------------------------------------
def test_the_daemon_plans_and_shows_the_type(tmp_path):
    """LOCALRUN_KV_CACHE_TYPE=q8_0 for every model, a Modelfile's PARAMETER kv_cache_type for one: each
    loads with its type, /api/ps says which, and the smaller cache is a smaller model in memory."""
    d = Daemon(tmp_path / "home", LOCALRUN_KV_CACHE_TYPE="q8_0", LOCALRUN_NUM_PARALLEL="2",
               LOCALRUN_CONTEXT_LENGTH="8192", LOCALRUN_BACKEND="llamacpp")
    try:
        d.pull()
        for name, mf in (("kv-f16", f"FROM {MODEL}\nPARAMETER kv_cache_type f16\n"),
                         ("kv-q4", f"FROM {MODEL}\nPARAMETER kv_cache_type q4_0\n")):
            r = d.http.post("/api/create", json={"model": name, "modelfile": mf, "stream": False})
            assert r.status_code == 200, r.text
        r = d.http.post("/api/create", json={"model": "kv-bad", "modelfile": f"FROM {MODEL}\nPARAMETER kv_cache_type q5\n",
                                             "stream": False})
        assert r.status_code == 400 and "kv_cache_type must be one of" in r.text
        for name in (MODEL, "kv-f16", "kv-q4"):
            r = d.http.post("/api/generate", json={"model": name, "prompt": "The capital of France is", "raw": True,
                                                   "stream": False, "options": {"temperature": 0, "num_predict": 3}})
            assert r.status_code == 200 and "Paris" in r.json()["response"], (name, r.text)
        ps = {m["name"]: m for m in d.ps()}
        want = {MODEL: "q8_0", "kv-f16:latest": "f16", "kv-q4:latest": "q4_0"}
        assert {n: ps[n]["kv_cache_type"] for n in want} == want, ps
        for n, kv in want.items():
            assert f"KV cells each ({kv})" in ps[n]["reason"], ps[n]["reason"]
        # 2 x 8192 cells of SmolLM2's 23,040 bytes a token in f16: 360 MiB; q8_0 191, q4_0 101
        assert ps["kv-f16:latest"]["size"] - ps[MODEL]["size"] > 150 * 2**20, ps
        assert ps[MODEL]["size"] - ps["kv-q4:latest"]["size"] > 80 * 2**20, ps
        # and the runners hold it: llama.cpp clears its KV buffer at load, so every page of it is resident
        rss = {n: ps[n]["runner"]["rss_bytes"] for n in want}
        assert rss["kv-f16:latest"] - rss[MODEL] > 120 * 2**20 and rss[MODEL] - rss["kv-q4:latest"] > 60 * 2**20, rss
    finally:
        d.stop()
