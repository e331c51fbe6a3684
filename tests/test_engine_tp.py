"""Tensor parallelism in the native engine on CPU (gloo, one process per rank): 2 ranks give
the same greedy tokens and logprobs as 1 (GQA; tied and untied embeddings; a vocabulary that
does not split evenly), a rank killed mid-generation ends the request with a clear error and
nothing hangs, and bad settings are refused with a message that says what to do."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import torch

from localrun.engine import EngineConfig, LLMEngine, SamplingParams
from localrun.engine.config import ModelConfig
from localrun.engine.parallel.group import TPGroup, check_shapes

# GQA (4 query heads, 2 KV heads), untied head, an odd vocabulary (the last shard is padded)
UNTIED = ModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                     vocab_size=301, max_position_embeddings=256)


def _cfg(tp: int, **kw) -> EngineConfig:
    base = dict(device="cpu", dtype="float32", max_model_len=128, kv_cache_tokens=1024, max_num_batched_tokens=64,
                tensor_parallel=tp)
    return EngineConfig(**{**base, **kw})


PROMPTS = [[(7 * i + 3) % 301 for i in range(n)] for n in (5, 40, 90)]  # the 90-token prompt is chunked (budget 64)
PARAMS = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, want_logprobs=True, logprobs=3)


def _run(engine: LLMEngine):
    try:
        outs = engine.generate(PROMPTS, PARAMS)
        emb = engine.embed([PROMPTS[0], PROMPTS[1][:9]])
        stats = engine.stats()
    finally:
        engine.shutdown()
    return outs, emb, stats


def _same(a, b) -> None:
    (outs1, emb1, _), (outs2, emb2, _) = a, b
    for o1, o2 in zip(outs1, outs2):
        assert o2.token_ids == o1.token_ids
        assert [lp for _, lp, _ in o2.logprobs] == pytest.approx([lp for _, lp, _ in o1.logprobs], abs=1e-4)
        for (_, _, top1), (_, _, top2) in zip(o1.logprobs, o2.logprobs):
            assert [t for t, _ in top2] == [t for t, _ in top1]
    for v1, v2 in zip(emb1, emb2):
        assert v2 == pytest.approx(v1, abs=1e-5)


def test_two_ranks_match_one_random_untied_gqa():
    """Random weights drawn identically for any split; overlap and the padded decode-graph path
    (eager on CPU) on, so sampled tokens feed the next step from the device on every rank."""
    kw = dict(overlap=True, cuda_graphs=True)
    one = _run(LLMEngine.from_random(UNTIED, _cfg(1, **kw), seed=5))
    engine = LLMEngine.from_random(UNTIED, _cfg(2, **kw), seed=5)
    procs = list(engine.tp.procs)
    two = _run(engine)
    assert [p.exitcode for p in procs] == [0]  # shutdown: the follower left on its own
    _same(one, two)
    s1, s2 = one[2], two[2]
    assert s2["tensor_parallel"] == 2 and s1["tensor_parallel"] == 1
    assert s2["kv_bytes_per_rank"] * 2 == s1["kv_bytes_per_rank"]  # each rank holds half the KV heads
    assert s2["weight_bytes_per_rank"] < 0.6 * s1["weight_bytes_per_rank"]  # norms are replicated


def _write_qwen2_checkpoint(d, vocab: int = 301, h: int = 64, inter: int = 128, layers: int = 2, nq: int = 4,
                            nkv: int = 2) -> None:
    """A Qwen2-style safetensors checkpoint (q/k/v bias, tied embeddings) with random weights."""
    import json

    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    d_head = h // nq

    def w(*shape):
        return (torch.randn(*shape, generator=g) * 0.3).contiguous()

    sd = {"model.embed_tokens.weight": w(vocab, h), "model.norm.weight": 1 + w(h) / 3}
    for i in range(layers):
        p = f"model.layers.{i}."
        sd.update({p + "input_layernorm.weight": 1 + w(h) / 3, p + "post_attention_layernorm.weight": 1 + w(h) / 3,
                   p + "self_attn.q_proj.weight": w(nq * d_head, h), p + "self_attn.q_proj.bias": w(nq * d_head),
                   p + "self_attn.k_proj.weight": w(nkv * d_head, h), p + "self_attn.k_proj.bias": w(nkv * d_head),
                   p + "self_attn.v_proj.weight": w(nkv * d_head, h), p + "self_attn.v_proj.bias": w(nkv * d_head),
                   p + "self_attn.o_proj.weight": w(h, nq * d_head), p + "mlp.gate_proj.weight": w(inter, h),
                   p + "mlp.up_proj.weight": w(inter, h), p + "mlp.down_proj.weight": w(h, inter)})
    save_file(sd, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps({
        "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": h, "intermediate_size": inter,
        "num_hidden_layers": layers, "num_attention_heads": nq, "num_key_value_heads": nkv, "vocab_size": vocab,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": True}))


def test_two_ranks_match_one_safetensors_tied_bias(tmp_path):
    """A Qwen2-style checkpoint (q/k/v bias, tied embeddings) read shard by shard with
    safetensors' get_slice."""
    _write_qwen2_checkpoint(tmp_path)
    one = _run(LLMEngine.from_safetensors(tmp_path, _cfg(1)))
    two = _run(LLMEngine.from_safetensors(tmp_path, _cfg(2)))
    assert one[0][0].token_ids and two[2]["tensor_parallel"] == 2
    _same(one, two)


def _word_tokenizer(vocab_size: int):
    """A word-level tokenizer ("w0 w1 ..."), built in memory: the backend needs one."""
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from localrun.engine.tokenizer import Tokenizer

    vocab = {"<unk>": 0, **{f"w{i}": i for i in range(1, vocab_size)}}
    t = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    return Tokenizer(PreTrainedTokenizerFast(tokenizer_object=t, unk_token="<unk>"), [], None)


def test_killed_rank_fails_the_request_and_nothing_hangs(tmp_path):
    """SIGKILL a follower mid-generation: the request in flight ends with an error naming the
    rank, the native backend turns fatal (its runner then exits 70 and the daemon reloads),
    later requests are refused at once, and shutdown does not hang."""
    native = pytest.importorskip("localrun.backends.native")
    from localrun.backends.base import GenerationRequest, LoadSpec, SamplingOptions
    from localrun.errors import BackendError

    tokenizer = _word_tokenizer(UNTIED.vocab_size)
    engine = LLMEngine.from_random(UNTIED, _cfg(2), seed=1)
    engine.tokenizer = tokenizer
    follower = engine.tp.procs[0]
    backend = native.NativeBackend(LoadSpec(name="tiny-tp2", weights=tmp_path, format="safetensors", num_ctx=128),
                                   engine, "cpu")
    assert "tensor parallel 2" in backend.info.reason and "per rank" in backend.info.reason
    opts = SamplingOptions(temperature=0, ignore_eos=True)

    async def go():
        chunks = []
        with pytest.raises(BackendError, match="tensor-parallel rank 1 .* killed by SIGKILL") as err:
            async for chunk in backend.generate(GenerationRequest("w1 w2 w3", opts)):
                if not chunks:
                    os.kill(follower.pid, signal.SIGKILL)
                chunks.append(chunk)
        assert chunks and chunks[-1].finish_reason is None  # it was cut short, not finished
        assert backend.fatal == engine.fatal and engine.fatal in str(err.value)
        with pytest.raises(BackendError, match="rank 1"):  # refused at once: the model must be reloaded
            async for _ in backend.generate(GenerationRequest("w4", opts)):
                pass

    t = time.monotonic()
    try:
        asyncio.run(asyncio.wait_for(go(), 60))
        assert time.monotonic() - t < 30
    finally:
        t = time.monotonic()
        asyncio.run(backend.close())
        assert time.monotonic() - t < 15
    assert follower.exitcode == -signal.SIGKILL


def test_rank_dying_while_idle_marks_the_backend_fatal_at_once(tmp_path):
    """No request in flight: the watcher still marks the engine, and so the backend, fatal (the
    runner's fatal watch then exits, so the daemon reloads the model on the next request)."""
    native = pytest.importorskip("localrun.backends.native")
    from localrun.backends.base import LoadSpec

    engine = LLMEngine.from_random(UNTIED, _cfg(2), seed=1)
    engine.tokenizer = _word_tokenizer(UNTIED.vocab_size)
    backend = native.NativeBackend(LoadSpec(name="tiny-tp2", weights=tmp_path, format="safetensors", num_ctx=128),
                                   engine, "cpu")
    try:
        assert backend.fatal is None
        os.kill(engine.tp.procs[0].pid, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while backend.fatal is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert backend.fatal and "rank 1" in backend.fatal
    finally:
        t = time.monotonic()
        asyncio.run(backend.close())
        assert time.monotonic() - t < 15


def test_settings_are_validated(monkeypatch):
    with pytest.raises(ValueError, match="tensor_parallel must be a whole number >= 1"):
        EngineConfig(device="cpu", tensor_parallel=0)
    with pytest.raises(ValueError, match="tensor_parallel must be a whole number"):
        EngineConfig(device="cpu", tensor_parallel=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="tensor_parallel 3 must divide the model's num_heads 4 and num_kv_heads 2"):
        check_shapes(UNTIED, 3)
    with pytest.raises(ValueError, match="num_kv_heads 2"):  # refused before any process starts
        LLMEngine.from_random(UNTIED, _cfg(4))
    with pytest.raises(ValueError, match="from_gguf, from_safetensors or from_random"):
        LLMEngine.from_hf_state(UNTIED, lambda n: None, set(), _cfg(2))
    check_shapes(UNTIED, 2)
    g = TPGroup(1, 2)
    assert g.vocab_shard(301) == (151, 150, 151)
    assert g.local_config(UNTIED).num_kv_heads == 1 and g.local_config(UNTIED).head_dim == 16

    from localrun.config import ENV_VARS, settings

    assert "LOCALRUN_TENSOR_PARALLEL" in ENV_VARS
    assert settings({}).tensor_parallel == 1
    assert settings({"LOCALRUN_TENSOR_PARALLEL": "2"}).tensor_parallel == 2
    for bad, msg in (("0", ">= 1"), ("two", "must be an integer"), ("65", "at most 64")):
        with pytest.raises(ValueError, match=f"LOCALRUN_TENSOR_PARALLEL.*{msg}"):
            settings({"LOCALRUN_TENSOR_PARALLEL": bad})

    from localrun.errors import InvalidRequest
    from localrun.library.modelfile import parse_parameter

    assert parse_parameter("tensor_parallel", "2") == 2
    with pytest.raises(InvalidRequest, match="tensor_parallel"):
        parse_parameter("tensor_parallel", "0")


def test_memory_estimate_checks_the_split(tmp_path, monkeypatch):
    native = pytest.importorskip("localrun.backends.native")
    from localrun.backends.base import LoadSpec
    from localrun.errors import InvalidRequest

    _write_qwen2_checkpoint(tmp_path, layers=1)
    spec = lambda tp: LoadSpec(name="q", weights=tmp_path, format="safetensors", num_ctx=128,  # noqa: E731
                               extra={"native_device": "cpu", "tensor_parallel": tp})
    with pytest.raises(InvalidRequest, match="cannot split q: tensor_parallel 3 must divide"):
        native.estimate_memory(spec(3))
    one, two = native.estimate_memory(spec(1)), native.estimate_memory(spec(2))
    assert two.weights_bytes == one.weights_bytes and two.kv_bytes == one.kv_bytes  # CPU: one machine's RAM
    assert two.overhead_bytes == one.overhead_bytes + native.FOLLOWER_RSS_BYTES
    monkeypatch.setenv("LOCALRUN_TENSOR_PARALLEL", "3")  # no Modelfile parameter: the setting applies
    no_param = LoadSpec(name="q", weights=tmp_path, format="safetensors", num_ctx=128, extra={"native_device": "cpu"})
    with pytest.raises(InvalidRequest, match="tensor_parallel 3"):
        native.estimate_memory(no_param)
