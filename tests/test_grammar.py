"""Constrained decoding in the native engine: a random-weight model with the SmolLM2
vocabulary (49152) and the real SmolLM2 tokenizer; every constrained output must parse and
validate, with overlap scheduling on and off, greedy and seeded sampling."""

from __future__ import annotations

import json

import jsonschema
import pytest

from localrun.engine import EngineConfig, LLMEngine
from localrun.engine.models.loader import read_gguf
from localrun.engine.sampler import SamplingParams
from localrun.engine.models.shapes import get_shape
from localrun.engine.tokenizer import Tokenizer

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {
        "status": {"enum": ["active", "inactive", "pending"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "owner": {"type": "object", "properties": {"admin": {"type": "boolean"},
                                                   "id": {"type": "integer", "minimum": 1, "maximum": 999}},
                  "required": ["admin", "id"], "additionalProperties": False}},
     "required": ["status", "tags", "owner"], "additionalProperties": False},
    {"type": "object", "properties": {"name": {"const": "get_weather"},
                                      "arguments": {"type": "object", "properties": {
                                          "unit": {"enum": ["celsius", "fahrenheit"]},
                                          "days": {"type": "integer", "minimum": 1, "maximum": 14}},
                                          "required": ["unit", "days"], "additionalProperties": False}},
     "required": ["name", "arguments"], "additionalProperties": False},
]


@pytest.fixture(scope="module")
def tokenizer(smollm2_gguf):
    _, _, _, meta = read_gguf(smollm2_gguf)
    return Tokenizer.from_gguf(smollm2_gguf, meta["eos_token_ids"], meta["chat_template"])


def _engine(tokenizer, overlap: bool) -> LLMEngine:
    """The tiny random Llama (hidden 64, 2 layers) over SmolLM2's vocabulary, with its tokenizer."""
    cfg = EngineConfig(device="cpu", max_model_len=256, kv_cache_tokens=2048, max_num_seqs=8, overlap=overlap)
    return LLMEngine._make(get_shape("tiny"), cfg, lambda m: m.init_random(0), lambda: tokenizer)


@pytest.fixture(scope="module", params=[False, True], ids=["serial", "overlap"])
def engine(request, tokenizer):
    return _engine(tokenizer, request.param)


def _prompts(tokenizer, n):
    return [tokenizer.encode(f"Request {i}: answer in JSON.") for i in range(n)]


def test_constrained_outputs_validate(engine, tokenizer):
    grammars = [engine.compile_grammar(s) for s in SCHEMAS]
    params = [SamplingParams(temperature=0, max_tokens=80, grammar=g) for g in grammars]
    params += [SamplingParams(temperature=1.0, seed=7 + i, max_tokens=80, grammar=g) for i, g in enumerate(grammars)]
    outs = engine.generate(_prompts(tokenizer, len(params)), params)
    for p, o in zip(params, outs):
        schema = SCHEMAS[grammars.index(p.grammar)]
        assert o.finish_reason == "stop", (o.text, o.finish_reason)
        jsonschema.validate(json.loads(o.text), schema)
        assert o.token_ids[-1] not in tokenizer.eos_token_ids  # stopped when the grammar completed
    # seeded sampling is reproducible with grammars too
    again = engine.generate(_prompts(tokenizer, len(params))[3:], params[3:])
    assert [o.token_ids for o in again] == [o.token_ids for o in outs[3:]]


def test_free_rows_unchanged_by_grammar_rows(engine, tokenizer):
    free = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True) for _ in range(2)]
    alone = engine.generate(_prompts(tokenizer, 2), free)
    g = engine.compile_grammar(SCHEMAS[1])
    prompts = _prompts(tokenizer, 5)
    mixed = engine.generate([prompts[0], prompts[2], prompts[1], prompts[3], prompts[4]], free[:1] + [SamplingParams(temperature=0, max_tokens=80, grammar=g),
                            free[1], SamplingParams(temperature=1.0, max_tokens=80, grammar=g, seed=3),
                            SamplingParams(temperature=0, max_tokens=80, grammar=engine.compile_grammar(SCHEMAS[0]))])
    assert [mixed[0].token_ids, mixed[2].token_ids] == [o.token_ids for o in alone]
    for o, s in ((mixed[1], SCHEMAS[1]), (mixed[3], SCHEMAS[1]), (mixed[4], SCHEMAS[0])):
        jsonschema.validate(json.loads(o.text), s)


def test_max_tokens_bounds_a_grammar_request(engine, tokenizer):
    out = engine.generate(_prompts(tokenizer, 1), SamplingParams(temperature=0, max_tokens=3,
                                                                 grammar=engine.compile_grammar(SCHEMAS[1])))[0]
    assert out.finish_reason == "length" and out.completion_tokens == 3
    assert out.text.startswith('{"status":')


def test_compile_cache_errors_and_fork(engine):
    g = engine.compile_grammar(SCHEMAS[0])
    assert engine.compile_grammar(json.loads(json.dumps(SCHEMAS[0]))) is g  # cached by canonical JSON
    assert engine.compile_grammar(None) is engine.compile_grammar({"type": "object"})
    with pytest.raises(ValueError, match="JSON schema"):
        engine.compile_grammar({"type": "object", "properties": {"a": {"$ref": "#/definitions/missing"}}})
    with pytest.raises(ValueError, match="compile_grammar"):
        engine.generate([[1, 2]], SamplingParams(grammar={"type": "object"}))
    # fork: an independent copy of a request's grammar state
    tok = engine.tokenizer
    m = g.matcher()
    for t in tok.encode('{"name": "Al'):
        assert m.consume(t)
    child = m.fork()
    for t in tok.encode('", "age": 5}'):
        assert child.consume(t)
    assert child.is_stopped and not m.is_stopped
    for t in tok.encode('ice", "age": 77}'):  # the parent goes on from where the fork was taken
        assert m.consume(t)
    assert m.is_stopped


def test_group_choices_with_a_grammar_each_validate(engine, tokenizer):
    """n > 1 with a grammar: the forked choices get their own matchers (fresh at the fork) and
    sample their first token under the mask; each choice equals the same seed run alone."""
    g = engine.compile_grammar(SCHEMAS[0])
    params = [SamplingParams(temperature=1.0, seed=11 + i, max_tokens=60, grammar=g) for i in range(3)]
    prompt = _prompts(tokenizer, 1)
    shared = engine.generate(prompt, params, n=3)
    alone = engine.generate(prompt, params, n=3, share_prefill=False)
    assert engine.stats()["forked_seqs"] >= 2
    for o, a in zip(shared, alone):
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), SCHEMAS[0])
        assert o.token_ids == a.token_ids
