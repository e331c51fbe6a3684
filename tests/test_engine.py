"""The native engine on the real SmolLM2-135M GGUF in fp32 on CPU: greedy tokens equal
transformers', batching, the radix prefix cache, preemption by recompute, KV accounting
for finish and abort, and the online loop's streams."""

from __future__ import annotations

import asyncio

import pytest
import torch

from localrun.templates.chat import render_chat
from localrun.engine import EngineConfig, LLMEngine, SamplingParams

transformers = pytest.importorskip("transformers")

GREEDY = SamplingParams(temperature=0, max_tokens=8)
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n   ",
    "Once upon a time, in a land far away, there lived a",
    "List three colors of the rainbow:",
]


@pytest.fixture(scope="module")
def engine(smollm2_gguf):
    return LLMEngine.from_gguf(smollm2_gguf, EngineConfig(device="cpu", dtype="float32", max_model_len=1024))


@pytest.fixture(scope="module")
def batched(engine, prompts):
    engine.clear_prefix_cache()
    return engine.generate(prompts, GREEDY)  # one batch, prompts of different lengths


@pytest.fixture(scope="module")
def prompts(engine):
    tok = engine.tokenizer
    chat = render_chat(tok.chat_template, [{"role": "user", "content": "What is 2+2?"}])
    return [tok.encode(p) for p in PROMPTS] + [tok.encode(chat)]


def _free_plus_cached(engine):
    s = engine.stats()
    return s["kv_pages_free"] + s["cached_pages"], s["kv_pages_total"]


def test_loaded_shape_and_tokenizer(engine):
    c = engine.model_config
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.hidden_size, c.vocab_size) == (30, 9, 3, 64, 576, 49152)
    assert c.tie_word_embeddings and c.rope_theta == 100000.0
    tok = engine.tokenizer
    assert tok.decode(tok.encode("Hello, world!")) == "Hello, world!"
    assert 2 in tok.eos_token_ids and "<|im_start|>" in tok.chat_template


def test_greedy_batched_matches_transformers(engine, prompts, batched, smollm2_gguf):
    outs = batched
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name,
                                                           dtype=torch.float32).eval()
    for p, o in zip(prompts, outs):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=GREEDY.max_tokens, do_sample=False, pad_token_id=2)
        ref_ids = ref[0, len(p):].tolist()
        assert o.token_ids == ref_ids, (engine.tokenizer.decode(p), o.text)
        assert o.completion_tokens == len(ref_ids) and o.prompt_tokens == len(p)
    assert outs[0].text.strip().startswith("Paris")
    assert outs[-1].finish_reason in ("stop", "length")


def test_batched_equals_one_by_one_and_pool_returns(engine, prompts, batched):
    free, total = _free_plus_cached(engine)
    assert free == total  # finished requests hold no pages (the radix tree may keep some)
    engine.clear_prefix_cache()
    assert engine.stats()["kv_pages_free"] == total and engine.stats()["cached_pages"] == 0
    for i in (0, 2):
        assert engine.generate([prompts[i]], GREEDY)[0].token_ids == batched[i].token_ids


def test_shared_prefix_hits_cache_with_identical_tokens(engine):
    tok = engine.tokenizer
    system = "You are a careful assistant. " + " ".join(f"Rule {i}: answer briefly and politely." for i in range(12))
    a = tok.encode(render_chat(tok.chat_template, [{"role": "system", "content": system},
                                                   {"role": "user", "content": "Name a fruit."}]))
    b = tok.encode(render_chat(tok.chat_template, [{"role": "system", "content": system},
                                                   {"role": "user", "content": "Name a vegetable."}]))
    params = SamplingParams(temperature=0, max_tokens=8)
    engine.clear_prefix_cache()
    cold = engine.generate([b], params)[0]
    assert cold.cached_tokens == 0
    engine.clear_prefix_cache()
    first = engine.generate([a], params)[0]
    warm = engine.generate([b], params)[0]
    assert first.cached_tokens == 0
    assert warm.cached_tokens >= 100 and warm.cached_tokens % engine.config.page_size == 0
    assert warm.token_ids == cold.token_ids
    # the same prompt again reuses everything but the pages holding its last token
    again = engine.generate([b], params)[0]
    assert again.cached_tokens >= len(b) - engine.config.page_size and again.token_ids == cold.token_ids
    st = engine.stats()
    assert st["prefix_hit_tokens"] >= warm.cached_tokens + again.cached_tokens


def test_tiny_pool_preempts_with_identical_outputs(engine, prompts, batched):
    # pages of 4 tokens: 3 requests are admitted (2+2+4 pages of prompt), then their decodes
    # need 2 more pages each with 2 free, so the newest are preempted and recomputed
    pick = [1, 3, 2, 0]
    cfg = EngineConfig(device="cpu", dtype="float32", max_model_len=1024, page_size=4,
                       kv_memory_bytes=10 * 4 * engine.model_config.kv_bytes_per_token(torch.float32))
    small = LLMEngine(engine.model, engine.model_config, cfg, engine.tokenizer)  # shares the weights
    assert small.pool.num_pages == 10
    outs = small.generate([prompts[i] for i in pick], GREEDY)
    assert small.stats()["preemptions"] > 0
    assert [o.token_ids for o in outs] == [batched[i].token_ids for i in pick]
    small.clear_prefix_cache()
    assert small.stats()["kv_pages_free"] == 10


def test_overlap_loop_and_padded_decode_match_the_serial_loop(engine, prompts, batched):
    """The GPU defaults (overlap scheduling, decode padded to graph sizes) on the real model:
    the same tokens and text as the serial loop, stop strings cut the same way."""
    cfg = EngineConfig(device="cpu", dtype="float32", max_model_len=1024, overlap=True, cuda_graphs=True)
    fast = LLMEngine(engine.model, engine.model_config, cfg, engine.tokenizer)  # shares the weights
    outs = fast.generate(prompts, GREEDY)
    assert [(o.token_ids, o.text, o.finish_reason) for o in outs] == \
           [(o.token_ids, o.text, o.finish_reason) for o in batched]
    stop = SamplingParams(temperature=0, max_tokens=6, stop=["aris"])
    cut, want = fast.generate([prompts[0]], stop)[0], engine.generate([prompts[0]], stop)[0]
    assert (cut.text, cut.finish_reason, cut.token_ids) == (" P", "stop", want.token_ids)


def test_stop_strings_and_max_tokens(engine, prompts):
    full = engine.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=6))[0]
    assert full.text.startswith(" Paris")
    cut = engine.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=6, stop=["aris"]))[0]
    assert cut.text == " P" and cut.finish_reason == "stop"
    one = engine.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=1))[0]
    assert one.completion_tokens == 1 and one.finish_reason == "length"
    stop_tok = engine.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=6,
                                                            stop_token_ids=[full.token_ids[2]]))[0]
    assert stop_tok.token_ids == full.token_ids[:3] and stop_tok.finish_reason == "stop"


async def test_online_stream_and_abort_free_pages(engine, prompts):
    engine.clear_prefix_cache()
    total = engine.stats()["kv_pages_total"]
    engine.start()
    try:
        stream = engine.add_request(prompts[0], SamplingParams(temperature=0, max_tokens=6))
        text, ids, last = "", [], None
        async for d in stream:
            text += d.text
            ids += d.token_ids
            last = d
        assert last.finish_reason == "length" and last.usage["completion_tokens"] == 6 == len(ids)
        assert text.startswith(" Paris")
        # abort mid-generation (and one still waiting) frees every page at once
        long = engine.add_request(prompts[2], SamplingParams(temperature=0, max_tokens=500, ignore_eos=True))
        got = 0
        async for d in long:
            got += len(d.token_ids)
            if got >= 3:
                break
        await long.aclose()
        for _ in range(200):
            s = engine.stats()
            if s["running"] == 0 and s["waiting"] == 0:
                break
            await asyncio.sleep(0.05)
        s = engine.stats()
        assert s["running"] == 0 and s["kv_pages_free"] + s["cached_pages"] == total
    finally:
        engine.shutdown()
    engine.clear_prefix_cache()
    assert engine.stats()["kv_pages_free"] == total


async def test_a_stop_list_does_not_delay_streamed_text(engine, prompts):
    """Only text that could still start a stop string is held back: with a stop string that
    never comes, every delta carries the same text as without one (a fixed hold of
    len(stop) - 1 characters kept the first tokens back)."""
    engine.start()
    try:
        async def deltas(stop):
            out = []
            async for d in engine.add_request(prompts[0], SamplingParams(temperature=0, max_tokens=8, stop=stop)):
                out.append((d.token_ids, d.text))
            return out

        plain, stopped = await deltas([]), await deltas(["ZZZZZZZZZZZZZZZZ"])
        assert stopped == plain and plain[0][1]
    finally:
        engine.shutdown()
