"""Structured output over real HTTP on both backends (llama.cpp and the native engine): the real
daemon and SmolLM2, OpenAI chat response_format (json_schema, json_object) through the openai
SDK, Ollama /api/chat format, an Anthropic forced tool call, and the Responses API's
text.format; every output validates against its schema; a bad schema is a 400 naming it."""

from __future__ import annotations

import json

import jsonschema
import pytest
from daemon import MODEL, Daemon
from fakes import TOOLS_TEMPLATE

pytestmark = pytest.mark.timeout(600)

ANSWER = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                           "city": {"type": "string", "maxLength": 12}},
          "required": ["answer", "city"], "additionalProperties": False}
WEATHER = {"name": "get_weather", "description": "Weather for a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                            "required": ["city"], "additionalProperties": False}}
QUESTION = [{"role": "user", "content": "Is Paris the capital of France? Answer in JSON."}]


@pytest.fixture(scope="module", params=["llamacpp", "native"])
def daemon(request, tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp(f"structured_{request.param}"), LOCALRUN_BACKEND=request.param,
               LOCALRUN_NUM_PARALLEL="2", LOCALRUN_CONTEXT_LENGTH="1024", HF_HUB_OFFLINE="1")
    try:
        d.pull()
        r = d.http.post("/api/create", json={"model": "toolsmol", "from": MODEL, "template": TOOLS_TEMPLATE,
                                             "stream": False})
        assert r.status_code == 200, r.text
        yield d
    finally:
        d.stop()


def test_openai_chat_response_format(daemon):
    from openai import OpenAI

    oai = OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    r = oai.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=30, temperature=0, response_format={
        "type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER}})
    jsonschema.validate(json.loads(r.choices[0].message.content), ANSWER)
    assert r.choices[0].finish_reason == "stop"
    # sampled: room for a 12-character city of 4-byte characters, a byte token each (the envelope is ~12)
    r = oai.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=80, temperature=0.7, seed=5,
                                    response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER}})
    jsonschema.validate(json.loads(r.choices[0].message.content), ANSWER)
    r = oai.chat.completions.create(model=MODEL, max_tokens=40, temperature=0, response_format={"type": "json_object"},
                                    messages=[{"role": "user", "content": 'Reply with {"capital": ...} for France.'}])
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_ollama_format_schema(daemon):
    r = daemon.http.post("/api/chat", json={"model": MODEL, "messages": QUESTION, "stream": False, "format": ANSWER,
                                            "options": {"num_predict": 30, "temperature": 0}}, timeout=300)
    assert r.status_code == 200, r.text
    jsonschema.validate(json.loads(r.json()["message"]["content"]), ANSWER)


def test_anthropic_forced_tool(daemon):
    import anthropic

    client = anthropic.Anthropic(base_url=daemon.url, api_key="unused", max_retries=0, timeout=300)
    # greedy: sampled at Anthropic's default temperature 1, the 135M model can fill the 12-character
    # city with rare characters of several byte tokens each and run out of max_tokens first (this SDK
    # has no temperature argument any more; the API still takes it)
    msg = client.messages.create(model="toolsmol", max_tokens=60, tools=[WEATHER], extra_body={"temperature": 0},
                                 tool_choice={"type": "tool", "name": "get_weather"},
                                 messages=[{"role": "user", "content": "Weather in Paris?"}])
    assert msg.stop_reason == "tool_use", msg
    call = msg.content[-1]
    assert call.type == "tool_use" and call.name == "get_weather"
    jsonschema.validate(call.input, WEATHER["input_schema"])


def test_responses_text_format(daemon):
    from openai import OpenAI

    oai = OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    r = oai.responses.create(model=MODEL, input=QUESTION[0]["content"], temperature=0, max_output_tokens=30,
                             text={"format": {"type": "json_schema", "name": "a", "schema": ANSWER}})
    jsonschema.validate(json.loads(r.output_text), ANSWER)


def test_bad_schemas_are_400(daemon):
    bad = [({"type": "object", "properties": {"a": {"type": "string", "maxLength": 100000}}}, "maxLength"),
           ({"type": "object", "properties": {"a": {"$ref": "#/definitions/missing"}}}, "schema")]
    for schema, needle in bad:
        r = daemon.http.post("/v1/chat/completions", json={
            "model": MODEL, "messages": QUESTION, "max_tokens": 5,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
        assert r.status_code == 400, (schema, r.text)
        assert needle in r.json()["error"]["message"], r.text
    r = daemon.http.post("/v1/chat/completions", json={"model": MODEL, "messages": QUESTION, "max_tokens": 2})
    assert r.status_code == 200  # still serving


def test_forced_call_envelope_is_closed():
    """A forced call's envelope takes exactly name and arguments: sampled, SmolLM2 used to go on
    after the arguments with keys of its own until max_tokens (2 of 12 forced calls at max_tokens 40)."""
    from localrun.server.params import tool_choice_schema

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER["input_schema"]}},
             {"type": "function", "function": {"name": "other", "parameters": {"type": "object"}}}]
    call = {"name": "get_weather", "arguments": {"city": "Paris"}}
    for choice in ({"name": "get_weather"}, "required"):
        _, schema = tool_choice_schema(tools, choice)
        jsonschema.validate(call, schema)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({**call, "type": "function"}, schema)
