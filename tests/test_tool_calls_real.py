"""Tool calls as real small models write them, through the real daemon, llama.cpp and the real SDKs.

Qwen2.5-Coder-0.5B-Instruct (and the 1.5B with LOCALRUN_TEST_1_5B=1), temperature 0, asked with
tools on all four APIs (OpenAI chat completions, Ollama /api/chat, Anthropic /v1/messages, OpenAI
Responses), streamed and not. These models mostly answer a tool request with the call in a fenced
```json block (once a JSON list of calls), not in their template's <tool_call> markers; the
lenient shapes (server/lenient_calls.py) make those calls. Cases: one call, two calls, no tool
wanted, a name no tool has (the model asked to call a function that is not offered), broken JSON
(the call cut by max_tokens), and a forced call (tool_choice) on a question that wants none.
Every answer is also checked against an oracle written here: no content holds a fenced or bare
JSON call of an offered tool whose arguments fit its schema, and no streamed content delta holds
any of a recognised call's JSON. The model's raw text for each case (the same prompt through
/v1/completions) is printed (pytest -s) for the record."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

import anthropic
import httpx
import jsonschema
import ollama
import openai
import pytest

from daemon import Daemon

pytestmark = pytest.mark.timeout(3600)

WEATHER = {"name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
TOOLS = [{"type": "function", "function": WEATHER}]
MODEL = "qcoder"


@dataclass
class Case:
    name: str
    prompt: str
    max_tokens: int
    tool_choice: str | None = None  # "named": the call forced to get_weather


CASES = [
    Case("single", "What is the weather in Paris?", 48),
    Case("several", "Call get_weather for Paris and get_weather for Tokyo. Reply with a JSON list of both calls.", 96),
    Case("none", "What is 2+2? Answer with just the number.", 16),
    Case("wrong_name", "Call the get_time function with zone set to UTC.", 48),
    Case("broken", "What is the weather in Paris?", 12),  # cut inside the call's JSON
]
FORCED = Case("forced", "What is 2+2? Answer with just the number.", 48, "named")


@dataclass
class Answer:
    content: str = ""
    calls: list[tuple[str, dict]] = field(default_factory=list)
    cut: bool = False  # stopped by the token limit
    deltas: list[str] = field(default_factory=list)  # streamed content pieces


@pytest.fixture(scope="module", params=["0.5b", "1.5b"])
def real(request, tmp_path_factory):
    gguf = request.getfixturevalue("qwen_coder_05b" if request.param == "0.5b" else "qwen_coder_15b")
    d = Daemon(tmp_path_factory.mktemp(f"tools_{request.param}"), LOCALRUN_CONTEXT_LENGTH="2048")
    try:
        r = d.http.post("/api/create", json={"model": MODEL, "modelfile": f"FROM {gguf}\n", "stream": False}, timeout=600)
        assert r.status_code == 200, r.text
        yield request.param, d
    finally:
        d.stop()


# -- the four APIs, each as (content, calls, cut, content deltas) ------------------------------------
def _openai(d, case: Case, stream: bool) -> Answer:
    c = openai.OpenAI(base_url=d.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    kw = dict(model=MODEL, messages=[{"role": "user", "content": case.prompt}], tools=TOOLS, temperature=0,
              max_tokens=case.max_tokens)
    if case.tool_choice:
        kw["tool_choice"] = {"type": "function", "function": {"name": "get_weather"}}
    if not stream:
        ch = c.chat.completions.create(**kw).choices[0]
        return Answer(ch.message.content or "", [(k.function.name, json.loads(k.function.arguments))
                                                 for k in ch.message.tool_calls or []], ch.finish_reason == "length")
    a, args, names, finish = Answer(), {}, {}, None
    for chunk in c.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            if ch.delta.content:
                a.deltas.append(ch.delta.content)
            for k in ch.delta.tool_calls or []:
                if k.function.name:
                    names[k.index] = k.function.name
                args[k.index] = args.get(k.index, "") + (k.function.arguments or "")
            finish = ch.finish_reason or finish
    a.content, a.cut = "".join(a.deltas), finish == "length"
    a.calls = [(names[i], json.loads(args[i])) for i in sorted(names)]
    return a


def _ollama(d, case: Case, stream: bool) -> Answer:
    c = ollama.Client(host=d.url, timeout=300)
    kw = dict(model=MODEL, messages=[{"role": "user", "content": case.prompt}], tools=TOOLS,
              options={"temperature": 0, "num_predict": case.max_tokens})
    if not stream:
        r = c.chat(**kw)
        return Answer(r.message.content or "", [(k.function.name, dict(k.function.arguments))
                                                for k in r.message.tool_calls or []], r.done_reason == "length")
    a = Answer()
    for part in c.chat(stream=True, **kw):
        if part.message.content:
            a.deltas.append(part.message.content)
        a.calls += [(k.function.name, dict(k.function.arguments)) for k in part.message.tool_calls or []]
        if part.done:
            a.cut = part.done_reason == "length"
    a.content = "".join(a.deltas)
    return a


def _anthropic(d, case: Case, stream: bool) -> Answer:
    c = anthropic.Anthropic(base_url=d.url, api_key="unused", max_retries=0, timeout=300)
    kw = dict(model=MODEL, max_tokens=case.max_tokens, extra_body={"temperature": 0}, messages=[{"role": "user", "content": case.prompt}],
              tools=[{"name": WEATHER["name"], "description": WEATHER["description"], "input_schema": WEATHER["parameters"]}])
    if case.tool_choice:
        kw["tool_choice"] = {"type": "tool", "name": "get_weather"}
    if not stream:
        m = c.messages.create(**kw)
        return Answer("".join(b.text for b in m.content if b.type == "text"),
                      [(b.name, dict(b.input)) for b in m.content if b.type == "tool_use"], m.stop_reason == "max_tokens")
    a, blocks, stop = Answer(), {}, None
    for ev in c.messages.create(stream=True, **kw):
        if ev.type == "content_block_start" and ev.content_block.type == "tool_use":
            blocks[ev.index] = [ev.content_block.name, ""]
        elif ev.type == "content_block_delta" and ev.delta.type == "text_delta":
            a.deltas.append(ev.delta.text)
        elif ev.type == "content_block_delta" and ev.delta.type == "input_json_delta":
            blocks[ev.index][1] += ev.delta.partial_json
        elif ev.type == "message_delta":
            stop = ev.delta.stop_reason
    a.content, a.cut = "".join(a.deltas), stop == "max_tokens"
    a.calls = [(n, json.loads(j or "{}")) for n, j in (blocks[i] for i in sorted(blocks))]
    return a


def _responses(d, case: Case, stream: bool) -> Answer:
    body = {"model": MODEL, "input": case.prompt, "temperature": 0, "max_output_tokens": case.max_tokens,
            "tools": [{"type": "function", **WEATHER}], "stream": stream}
    if not stream:
        r = d.http.post("/v1/responses", json=body, timeout=300)
        assert r.status_code == 200, r.text
        return _from_response(r.json(), Answer())
    a, done = Answer(), None
    with httpx.stream("POST", d.url + "/v1/responses", json=body, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue
            ev = json.loads(line[5:])
            if ev["type"] == "response.output_text.delta":
                a.deltas.append(ev["delta"])
            elif ev["type"] in ("response.completed", "response.incomplete"):
                done = ev["response"]
    assert done is not None
    _from_response(done, a)
    assert a.content == "".join(a.deltas)  # the final object says what the deltas did
    return a


def _from_response(resp: dict, a: Answer) -> Answer:
    for item in resp["output"]:
        if item["type"] == "message":
            a.content += "".join(p["text"] for p in item["content"] if p["type"] == "output_text")
        elif item["type"] == "function_call":
            a.calls.append((item["name"], json.loads(item["arguments"])))
    a.cut = resp["status"] == "incomplete"
    return a


APIS = {"openai": _openai, "ollama": _ollama, "anthropic": _anthropic, "responses": _responses}


# -- the oracle -------------------------------------------------------------------------------------
def _fitting_calls(text: str) -> list:
    """Calls of an offered tool whose arguments fit, written as fenced or bare JSON in `text`."""
    found = []
    blocks = re.findall(r"```[a-z_]*\n(.*?)```", text, re.S) + [text]
    for b in blocks:
        try:
            value = json.loads(b, strict=False)
        except ValueError:
            continue
        for o in value if isinstance(value, list) else [value]:
            if isinstance(o, dict) and o.get("name") == WEATHER["name"]:
                args = o.get("arguments", o.get("parameters"))
                args = json.loads(args) if isinstance(args, str) else args
                if isinstance(args, dict) and jsonschema.Draft7Validator(WEATHER["parameters"]).is_valid(args):
                    found.append(o)
    return found


def _check(a: Answer, stream: bool) -> None:
    for name, args in a.calls:
        assert name == WEATHER["name"]
        jsonschema.validate(args, WEATHER["parameters"])
    assert not _fitting_calls(a.content), a.content  # a call never stays text
    if stream and a.calls:  # and none of its JSON went out as content first
        assert not any('"name"' in p or "```json" in p or "get_weather" in p for p in a.deltas), a.deltas


RAW: dict[tuple[str, str], str] = {}


def _raw(size: str, d: Daemon, case: Case) -> str:
    """What the model writes for this case, as text (the same rendered prompt through /v1/completions)."""
    if (size, case.name) not in RAW:
        from localrun.templates.chat import render_chat

        tpl = d.http.post("/api/show", json={"model": MODEL}).json()["template"]
        prompt = render_chat(tpl, [{"role": "user", "content": case.prompt}], add_generation_prompt=True, tools=TOOLS)
        r = d.http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "temperature": 0,
                                                 "max_tokens": case.max_tokens}, timeout=300)
        RAW[size, case.name] = r.json()["choices"][0]["text"]
        print(f"\n[{size} {case.name}] raw: {RAW[size, case.name]!r}")
    return RAW[size, case.name]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_tool_calls_as_small_models_write_them(real, case):
    size, d = real
    raw = _raw(size, d, case)
    seen = []
    for api, ask in APIS.items():
        for stream in (False, True):
            a = ask(d, case, stream)
            seen.append(f"{api}{'/stream' if stream else ''}: calls={a.calls} content={a.content!r}")
            _check(a, stream)
            where = (size, case.name, api, stream, a)
            if case.name == "single":
                assert len(a.calls) == 1 and "Paris" in a.calls[0][1]["city"] and not a.cut, where
                assert not a.content.strip(), where  # the fence and its JSON are the call, not text
            elif case.name == "several":
                assert [n for n, _ in a.calls] == ["get_weather"] * 2, where
                assert {"Paris", "Tokyo"} == {args["city"] for _, args in a.calls}, where
            elif case.name == "none":
                assert a.calls == [] and "4" in a.content, where
            elif case.name == "wrong_name":  # a function no tool is: its JSON stays text, as the model wrote it
                assert a.calls == [] and "get_time" in a.content and a.content.lstrip()[:1] in "`{[", where
                assert a.content == raw or api != "openai", where  # (the same rendered prompt as /v1/completions)
            elif case.name == "broken":  # the JSON was cut: text
                assert a.calls == [] and a.cut and "get_weather" in a.content and a.content.lstrip()[:1] in "`{[", where
                assert a.content == raw or api != "openai", where
    print(f"\n[{size} {case.name}]\n  " + "\n  ".join(seen))


@pytest.mark.parametrize("api", ["openai", "anthropic"])
def test_a_forced_call_stays_forced(real, api):
    """tool_choice naming the tool on a question that wants none: still a call, streamed and not."""
    size, d = real
    for stream in (False, True):
        a = APIS[api](d, FORCED, stream)
        _check(a, stream)
        assert [n for n, _ in a.calls] == ["get_weather"] and not a.content.strip(), (size, api, stream, a)
