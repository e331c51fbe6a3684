"""The native backend (localrun.backends.native) over the real SmolLM2 GGUF on CPU: the
Backend protocol as the daemon uses it: streaming chunks with usage and cached_tokens,
closing the generator aborts and frees KV pages, embeddings, clear errors."""

from __future__ import annotations

import asyncio
import math

import pytest

from localrun.backends.base import Backend, GenerationRequest, LoadSpec, SamplingOptions
from localrun.templates.chat import render_chat
from localrun.errors import InvalidRequest

native = pytest.importorskip("localrun.backends.native")


@pytest.fixture(scope="module")
def spec(smollm2_gguf):
    return LoadSpec(name="smollm2:135m", weights=smollm2_gguf, format="gguf", num_ctx=512, num_parallel=2)


@pytest.fixture(scope="module")
def backend(spec):
    b = native.load(spec)
    yield b
    b._close()


def _chat(b, text: str) -> str:
    system = "You are a helpful assistant who answers in one short sentence. " * 4
    return render_chat(b.engine.tokenizer.chat_template,
                       [{"role": "system", "content": system}, {"role": "user", "content": text}])


async def _collect(b, req):
    chunks = [c async for c in b.generate(req)]
    return "".join(c.text for c in chunks), chunks


async def test_estimate_and_info(backend, spec):
    est = native.estimate_memory(spec)
    assert est.weights_bytes > 100e6 and est.kv_bytes == 512 * 4 * 30 * 2 * 3 * 64 * 4
    assert isinstance(backend, Backend)
    assert backend.info.name == "native" and backend.info.device == "CPU" and backend.info.context_length == 512
    assert backend.info.slots >= 2 and backend.info.supports_json_schema
    assert await backend.detokenize(await backend.tokenize("Hello there")) == "Hello there"


async def test_generate_streams_with_usage_and_cache_hits(backend):
    opts = SamplingOptions(temperature=0, max_tokens=8, logprobs=True, top_logprobs=2)
    text, chunks = await _collect(backend, GenerationRequest(_chat(backend, "What is the capital of France?"), opts))
    last = chunks[-1]
    assert last.finish_reason in ("stop", "length") and last.usage.completion_tokens <= 8
    assert sum(len(c.token_ids) for c in chunks) == last.usage.completion_tokens
    assert "Paris" in text
    lps = [lp for c in chunks if c.logprobs for lp in c.logprobs]
    assert len(lps) == last.usage.completion_tokens and all(lp.logprob <= 0 and len(lp.top) == 2 for lp in lps)
    _, chunks2 = await _collect(backend, GenerationRequest(_chat(backend, "What is the capital of Spain?"), opts))
    u = chunks2[-1].usage
    assert u.cached_tokens >= 48 and u.prompt_tokens > u.cached_tokens  # the shared system prompt


async def test_closing_the_generator_aborts_and_frees_pages(backend):
    eng = backend.engine
    opts = SamplingOptions(temperature=0.7, seed=1, max_tokens=400, ignore_eos=True)
    gen = backend.generate(GenerationRequest("Tell me a very long story about a dragon.", opts))
    n = 0
    async for c in gen:
        n += len(c.token_ids)
        if n >= 2:
            break
    await gen.aclose()
    for _ in range(100):
        s = eng.stats()
        if s["running"] == 0 and s["waiting"] == 0:
            break
        await asyncio.sleep(0.05)
    s = eng.stats()
    assert s["running"] == 0 and s["kv_pages_free"] + s["cached_pages"] == s["kv_pages_total"]


async def test_concurrent_requests_and_stop_strings(backend):
    opts = SamplingOptions(temperature=0, max_tokens=6)
    reqs = [GenerationRequest(p, opts) for p in ("1, 2, 3, 4,", "The sky is", "Water boils at")]
    results = await asyncio.gather(*[_collect(backend, r) for r in reqs])
    alone = await _collect(backend, reqs[0])
    assert results[0][0] == alone[0]
    stop = SamplingOptions(temperature=0, max_tokens=6, stop=[","])
    text, chunks = await _collect(backend, GenerationRequest("1, 2, 3, 4,", stop))
    assert "," not in text and chunks[-1].finish_reason == "stop" and chunks[-1].stop_sequence == ","
    assert (await _collect(backend, reqs[0]))[1][-1].stop_sequence is None  # no stop string: none reported


async def test_embeddings(backend):
    a, b, c = await backend.embed(["I love cats", "I adore cats", "Quantum chromodynamics lecture notes"])
    assert len(a) == 576 and math.isclose(sum(x * x for x in a), 1.0, rel_tol=1e-4)
    dot = lambda u, v: sum(x * y for x, y in zip(u, v))  # noqa: E731
    assert dot(a, b) > dot(a, c)


async def test_json_schema_output(backend):
    import json

    import jsonschema

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                               "big": {"type": "boolean"}}, "required": ["city", "big"]}
    opts = SamplingOptions(temperature=0, max_tokens=30, json_schema=schema)
    text, chunks = await _collect(backend, GenerationRequest(_chat(backend, "Name a big city as JSON."), opts))
    assert chunks[-1].finish_reason == "stop"
    jsonschema.validate(json.loads(text), schema)
    text, _ = await _collect(backend, GenerationRequest(_chat(backend, "A JSON object, please."),
                                                        SamplingOptions(temperature=0, max_tokens=40, json_mode=True)))
    assert isinstance(json.loads(text), dict)


async def test_bad_requests(backend):
    with pytest.raises(InvalidRequest, match="context"):
        await _collect(backend, GenerationRequest("word " * 600, SamplingOptions(max_tokens=4)))
    with pytest.raises(InvalidRequest, match="JSON schema"):  # llguidance cannot resolve the $ref
        await _collect(backend, GenerationRequest("hi", SamplingOptions(json_schema={
            "type": "object", "properties": {"a": {"$ref": "#/definitions/missing"}}})))
    with pytest.raises(InvalidRequest, match="maxLength"):  # llama.cpp's bounds apply here too
        await _collect(backend, GenerationRequest("hi", SamplingOptions(json_schema={
            "type": "object", "properties": {"a": {"type": "string", "maxLength": 10**6}}})))
    with pytest.raises(InvalidRequest):
        await _collect(backend, GenerationRequest("hi", SamplingOptions(top_p=0)))
    with pytest.raises(InvalidRequest):
        await backend.embed([""])
