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


# -- a regex, choices or a grammar of the request's own (vLLM, SGLang, llama-server), through llguidance -------
DATE = r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]"
COLORS = ["red", "green", "blue", "dark purple"]
ITEMS = 'root ::= item{2,3}\nitem ::= "- " [a-z]+ ("," [a-z]+)? "\\n"'  # GBNF: 2-3 lines of "- word"
ITEMS_RE = r"(- [a-z]+(,[a-z]+)?\n){2,3}"


def test_regex_choice_and_grammar_through_the_sdks(daemon):
    """vLLM's structured_outputs and guided_*, SGLang's regex and ebnf, llama-server's grammar: sampled outputs (a
    few seeds, n > 1, a stream) all match; each server's name for a constraint does the same."""
    import re

    from openai import OpenAI

    oai = OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    ask = [{"role": "user", "content": "When did it happen? Give a date."}]
    for extra in ({"structured_outputs": {"regex": DATE}}, {"guided_regex": DATE}, {"regex": DATE}):
        r = oai.chat.completions.create(model=MODEL, messages=ask, max_tokens=20, temperature=1.0, seed=7, n=2,
                                        extra_body=extra)
        for ch in r.choices:
            assert re.fullmatch(DATE, ch.message.content) and ch.finish_reason == "stop", (extra, ch)
    stream = oai.chat.completions.create(model=MODEL, messages=ask, max_tokens=20, temperature=0, stream=True,
                                         extra_body={"guided_regex": DATE})
    assert re.fullmatch(DATE, "".join(c.choices[0].delta.content or "" for c in stream if c.choices))
    seen = set()
    pick = [{"role": "user", "content": "Pick one of red, green or blue. Answer with the color only."}]
    for seed in range(8):
        extra = {"structured_outputs": {"choice": COLORS}} if seed % 2 else {"guided_choice": COLORS}
        r = oai.chat.completions.create(model=MODEL, messages=pick, max_tokens=10, temperature=1.2, seed=seed,
                                        extra_body=extra)
        assert r.choices[0].message.content in COLORS, r.choices[0].message.content
        seen.add(r.choices[0].message.content)
    assert len(seen) >= 2  # sampled among the choices, not one forced answer
    r = oai.completions.create(model=MODEL, prompt="Q: Is water wet?\nA:", max_tokens=5, temperature=0,
                               extra_body={"guided_choice": [" yes", " no"]})
    assert r.choices[0].text in (" yes", " no") and r.choices[0].finish_reason == "stop"
    for extra in ({"grammar": ITEMS}, {"ebnf": ITEMS}, {"structured_outputs": {"grammar": ITEMS}},
                  {"guided_grammar": ITEMS}):
        r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "List some fruits."}],
                                        max_tokens=40, temperature=0.9, seed=3, extra_body=extra)
        assert re.fullmatch(ITEMS_RE, r.choices[0].message.content), (extra, r.choices[0].message.content)
    # vLLM's guided_json (an object, or its text) is response_format's json_schema
    r = oai.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=30, temperature=0,
                                    extra_body={"guided_json": json.dumps(ANSWER)})
    jsonschema.validate(json.loads(r.choices[0].message.content), ANSWER)


def test_bad_constraints_are_400(daemon):
    """Each is refused with what is wrong, before any output; the daemon keeps serving."""
    cases = [({"guided_regex": "(?=a)b"}, "lookaround"), ({"regex": "(a)\\1"}, "backreference"),
             ({"guided_regex": "(unclosed"}, "does not parse"), ({"guided_regex": "a{5000}"}, "1000"),
             ({"guided_regex": "(?i)yes"}, "case-insensitive"), ({"guided_choice": []}, "non-empty strings"),
             ({"guided_choice": ["a", 3]}, "non-empty strings"), ({"grammar": 'x ::= "a"'}, "root"),
             ({"grammar": "root ::= undefined-rule"}, "undefined-rule"), ({"grammar": "root ::= " + "(" * 70 + '"a"'
                                                                          + ")" * 70}, "64 groups"),
             ({"grammar": 'root ::= "a" "b'}, "grammar"), ({"guided_choice": ["a"], "guided_regex": "a"}, "one output"),
             ({"regex": "a", "response_format": {"type": "json_object"}}, "one output"),
             ({"structured_outputs": {"structural_tag": "{}"}}, "structural_tag"),
             ({"structured_outputs": "a"}, "object"), ({"guided_json": "{not json"}, "JSON schema")]
    for extra, needle in cases:
        r = daemon.http.post("/v1/chat/completions", json={"model": MODEL, "messages": QUESTION, "max_tokens": 5,
                                                           **extra})
        assert r.status_code == 400, (extra, r.text)
        assert needle in r.json()["error"]["message"], (extra, r.text)
    r = daemon.http.post("/v1/chat/completions", json={
        "model": "toolsmol", "messages": QUESTION, "max_tokens": 5, "guided_regex": "a+",
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        "tool_choice": "required"})
    assert r.status_code == 400 and "tool_choice" in r.json()["error"]["message"], r.text
    r = daemon.http.post("/v1/chat/completions", json={"model": MODEL, "messages": QUESTION, "max_tokens": 2})
    assert r.status_code == 200  # still serving


def test_an_ambiguous_grammar_is_bounded(daemon):
    """A repetition of 200 identical alternatives kept llama.cpp's own grammar engine on one token for over five
    minutes (the model's other streams stalled behind it); llguidance runs it in milliseconds a token. A grammar
    past llguidance's bounds on one token's work ends its request with a 400 saying so, and a stream beside both
    gets its answer."""
    import concurrent.futures
    import time

    alts = 'root ::= (' + " | ".join(['"a"'] * 200) + ')+'
    wide = "root ::= " + " | ".join(f"r{i}" for i in range(2100)) + "\n" + "\n".join(
        f'r{i} ::= "w{i}" [a-z]' for i in range(2100))  # (2,101 Earley items in a row; llguidance allows 2,000)
    assert len(wide) < 65536

    def post(extra, timeout=120):
        return daemon.http.post("/v1/completions", json={"model": MODEL, "prompt": "aaaa", "max_tokens": 20,
                                                         "temperature": 0, **extra}, timeout=timeout)

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        t0 = time.monotonic()
        a, w, plain = pool.submit(post, {"grammar": alts}), pool.submit(post, {"grammar": wide}), pool.submit(post, {})
        r = a.result()
        assert r.status_code == 200 and set(r.json()["choices"][0]["text"]) <= {"a"}, r.text
        r = w.result()
        assert r.status_code == 400 and "stopped the generation" in r.json()["error"]["message"], r.text
        assert plain.result().status_code == 200
        assert time.monotonic() - t0 < 60
