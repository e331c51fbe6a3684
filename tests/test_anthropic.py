"""The Anthropic Messages API (/v1/messages, /v1/messages/count_tokens) through the official
`anthropic` SDK.

Fast tests: the real app in-process on 127.0.0.1 with the small fake backend (tests/fakes.py):
messages, streaming with Anthropic's event sequence, tool use round trips, thinking blocks,
count_tokens, stop sequences, max_tokens and the context window, errors as the SDK's
exception types, x-api-key auth. End to end: the real daemon, llama.cpp and SmolLM2
(tests/daemon.py): a message, a stream, a forced tool call, stop sequences, the prefix cache.
"""

from __future__ import annotations

import json
import re
import threading

import anthropic
import httpx
import pytest
from fakes import (DEFAULT_REPLY, MODEL, TOOLS_TEMPLATE, FakeModel, InProcessDaemon, api_rules, library_home,
                   wait_until)

pytestmark = pytest.mark.timeout(300)

WEATHER = {"name": "get_weather", "description": "Weather for a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                            "required": ["city"]}}
HI = [{"role": "user", "content": "Hi there"}]


def _client(d, **kw) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=d.url, api_key=kw.pop("api_key", "unused"), max_retries=0, timeout=120, **kw)


def _events(d, body: dict, headers: dict | None = None) -> list[tuple[str, dict]]:
    """The raw SSE of a streamed /v1/messages: (event name, data) pairs."""
    out, name = [], None
    with httpx.stream("POST", d.url + "/v1/messages", json={**body, "stream": True}, headers=headers, timeout=120) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                out.append((name, json.loads(line[6:])))
                name = None
    return out


def _check_sequence(events: list[tuple[str, dict]]) -> None:
    """Anthropic's grammar: message_start, ping, blocks (start, deltas, stop, indexes 0..n-1 in
    order), message_delta, message_stop; keep-alive pings may come between any two; each
    `event:` line names its data's type."""
    assert all(name == data["type"] for name, data in events), events
    kinds = [data["type"] for _, data in events]
    assert kinds[:2] == ["message_start", "ping"] and kinds[-2:] == ["message_delta", "message_stop"], kinds
    assert all(data == {"type": "ping"} for _, data in events if data["type"] == "ping"), events
    open_index, next_index = None, 0
    for _, data in events[2:-2]:
        if data["type"] == "ping":
            continue
        if data["type"] == "content_block_start":
            assert open_index is None and data["index"] == next_index, events
            open_index, next_index = data["index"], next_index + 1
        elif data["type"] == "content_block_delta":
            assert data["index"] == open_index, events
        else:
            assert data["type"] == "content_block_stop" and data["index"] == open_index, events
            open_index = None
    assert open_index is None


# -- fast: in-process, fake backend ----------------------------------------------------------------
@pytest.fixture(scope="module")
def home(tmp_path_factory):
    return library_home(tmp_path_factory.mktemp("anthropic_home"), {"stopper": f"FROM {MODEL}\nPARAMETER stop STOP\n"})


@pytest.fixture
def fake():
    return FakeModel(rules=api_rules())


@pytest.fixture
def daemon(home, fake):
    d = InProcessDaemon(home, fake)
    yield d
    d.stop()


def _prompt(fake: FakeModel) -> str:
    return fake.requests[-1].prompt


def test_message_usage_and_prefix_cache(daemon, fake):
    client = _client(daemon)
    kw = dict(model=MODEL, max_tokens=100, system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}],
              messages=[{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"},
                        {"role": "user", "content": [{"type": "text", "text": "How are you?"}]}],
              metadata={"user_id": "u1"}, extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 40})
    r = client.messages.create(**kw)
    assert r.type == "message" and r.role == "assistant" and r.model == MODEL and r.id.startswith("msg_")
    assert [b.type for b in r.content] == ["text"] and r.content[0].text == DEFAULT_REPLY
    assert r.stop_reason == "end_turn" and r.stop_sequence is None
    prompt = _prompt(fake)
    assert ("<|im_start|>system\nBe brief.\nBe kind.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
            "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nHow are you?<|im_end|>") in prompt
    o = fake.requests[-1].options
    assert (o.temperature, o.top_p, o.top_k, o.max_tokens) == (0.5, 0.9, 40, 100)
    u = r.usage
    assert u.output_tokens == len(DEFAULT_REPLY) and u.input_tokens == len(prompt)  # the fake: a token per character
    assert u.cache_read_input_tokens == 0 and u.cache_creation_input_tokens == 0
    # the same prompt again: read from the (fake's one-slot) prefix cache; the parts sum to the prompt
    u = client.messages.create(**kw).usage
    assert u.cache_read_input_tokens > 0 and u.input_tokens + u.cache_read_input_tokens == len(prompt)
    assert client.messages.count_tokens(model=MODEL, system=kw["system"], messages=kw["messages"]).input_tokens == len(prompt)


def test_claude_codes_billing_header_is_left_out_of_the_prompt(daemon, fake):
    """Claude Code's first system block (recorded: tests/agents/claude_code_request.json) is an
    attribution line that changes from prompt to prompt: left out, two sessions' prompts are the
    same and the second reads the first's prefix from the cache."""
    from pathlib import Path
    recorded = json.loads((Path(__file__).parent / "agents" / "claude_code_request.json").read_text())["body"]["system"]
    assert recorded[0]["text"].startswith("x-anthropic-billing-header: cc_version=")
    client = _client(daemon)
    usages, prompts = [], []
    for suffix in ("1c0", "84c"):
        system = [{**recorded[0], "text": recorded[0]["text"].replace("1c0", suffix)}, recorded[1]]  # the fake
        # counts a token per character: the rest of the recorded system is too long for its window
        usages.append(client.messages.create(model=MODEL, max_tokens=20, system=system, messages=HI).usage)
        prompts.append(_prompt(fake))
    assert prompts[0] == prompts[1] and "billing" not in prompts[0]
    assert "<|im_start|>system\nYou are a Claude agent, built on Anthropic's Claude Agent SDK." in prompts[0]
    assert usages[1].input_tokens < 10 < usages[1].cache_read_input_tokens
    # only a line that is the header alone goes; as a string system prompt too; other text stays
    client.messages.create(model=MODEL, max_tokens=20, messages=HI,
                           system="x-anthropic-billing-header: cc_version=1; cch=0a;\nBe brief. x-anthropic-billing-header: kept")
    assert "<|im_start|>system\nBe brief. x-anthropic-billing-header: kept<|im_end|>" in _prompt(fake)


def test_stream_event_sequence_and_sdk_helpers(daemon):
    client = _client(daemon)
    with client.messages.stream(model=MODEL, max_tokens=100, messages=HI) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == DEFAULT_REPLY and final.content[0].text == DEFAULT_REPLY
    assert final.stop_reason == "end_turn" and final.usage.output_tokens == len(DEFAULT_REPLY)
    events = _events(daemon, {"model": MODEL, "max_tokens": 100, "messages": HI})
    _check_sequence(events)
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["input_tokens"] > 0
    assert events[2][1]["content_block"] == {"type": "text", "text": ""}
    assert "".join(d["delta"]["text"] for _, d in events if d["type"] == "content_block_delta") == DEFAULT_REPLY
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == len(DEFAULT_REPLY)


def test_keepalive_pings_between_slow_events(home, monkeypatch):
    """A model slower than PING_EVERY between tokens (a long prefill): keep-alive pings go out in
    between, in Anthropic's shape; the SDK skips them and its accumulated message equals the
    unstreamed one."""
    from localrun.server import routes_anthropic

    monkeypatch.setattr(routes_anthropic, "PING_EVERY", 0.05)
    fake = FakeModel(token_delay=0.15)
    d = InProcessDaemon(home, fake)
    try:
        body = {"model": MODEL, "max_tokens": 6, "messages": HI}
        events = _events(d, body)
        _check_sequence(events)
        kinds = [data["type"] for _, data in events]
        assert kinds.count("ping") > 2 and "ping" in kinds[3:-3], kinds  # inside the text block too
        client = _client(d)
        with client.messages.stream(**body) as s:
            streamed = s.get_final_message()
        whole = client.messages.create(**body)
        assert [(b.type, b.text) for b in streamed.content] == [(b.type, b.text) for b in whole.content] == [("text", DEFAULT_REPLY[:6])]
        assert streamed.stop_reason == whole.stop_reason == "max_tokens"
        assert streamed.usage.output_tokens == whole.usage.output_tokens == 6
    finally:
        d.stop()


def test_a_long_prefill_starts_the_stream_and_keeps_it_alive(home, monkeypatch):
    """A prefill longer than PING_EVERY: the stream starts and SSE comments (": ping") keep it alive until
    message_start (nothing went out before: a client or proxy with an idle timeout gave up); the SDK
    skips them. A prefill that fails after the stream began ends it with an error event; one that fails
    at once is still a 400. A client leaving during the long prefill aborts the request."""
    from localrun.server import routes_anthropic

    monkeypatch.setattr(routes_anthropic, "PING_EVERY", 0.05)
    fake = FakeModel(prefill_delay=0.4)
    d = InProcessDaemon(home, fake)
    try:
        body = {"model": MODEL, "max_tokens": 6, "messages": HI}
        with httpx.stream("POST", d.url + "/v1/messages", json={**body, "stream": True}, timeout=60) as r:
            lines = [x for x in r.iter_lines() if x]
        first_event = lines.index("event: message_start")
        assert first_event >= 3 and set(lines[:first_event]) == {": ping"}, lines[:first_event + 1]
        client = _client(d)
        with client.messages.stream(**body) as s:
            streamed = s.get_final_message()
        assert [(b.type, b.text) for b in streamed.content] == [("text", DEFAULT_REPLY[:6])]
        assert streamed.usage.input_tokens + streamed.usage.cache_read_input_tokens > 0

        fake.fail_prefill = "the prompt is 9000 tokens, longer than the context window of 8192 tokens"
        events = _events(d, body)
        assert events[-1][1]["type"] == "error" and "9000 tokens" in events[-1][1]["error"]["message"], events
        fake.prefill_delay = 0
        r = httpx.post(d.url + "/v1/messages", json={**body, "stream": True}, timeout=60)
        assert r.status_code == 400 and "9000 tokens" in r.json()["error"]["message"], r.text

        fake.fail_prefill, fake.prefill_delay = None, 5.0
        aborted = len(fake.aborted)
        with httpx.stream("POST", d.url + "/v1/messages", json={**body, "stream": True}, timeout=60) as r:
            assert next(r.iter_lines()) == ": ping"  # the stream began; the client leaves
        wait_until(lambda: len(fake.aborted) == aborted + 1 and fake.running == 0, timeout=3)
    finally:
        d.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_a_lone_surrogate_in_a_call_is_replaced_not_a_failed_response(daemon, fake, stream):
    """The JSON grammar lets a sampled model write "\\ud800" alone, which UTF-8 cannot encode: the
    call still arrives, with U+FFFD in its place."""
    fake.rules = {"Weather": '{"name": "get_weather", "arguments": {"city": "Pa\\ud800ris"}}'}
    client = _client(daemon)
    kw = dict(model="toolsmol", max_tokens=200, tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"},
              messages=[{"role": "user", "content": "Weather in Paris?"}])
    if stream:
        with client.messages.stream(**kw) as s:
            msg = s.get_final_message()
    else:
        msg = client.messages.create(**kw)
    assert msg.stop_reason == "tool_use" and msg.content[0].input == {"city": "Pa\ufffd\ufffd\ufffdris"}


@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_use_round_trip(daemon, fake, stream):
    client = _client(daemon)
    kw = dict(model="toolsmol", max_tokens=200, tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"},
              messages=[{"role": "user", "content": "Weather in Paris?"}])
    if stream:
        with client.messages.stream(**kw) as s:
            assert "".join(s.text_stream) == ""  # no call JSON leaks into text
            msg = s.get_final_message()
        events = _events(daemon, kw)
        _check_sequence(events)
        json_deltas = [d["delta"] for _, d in events if d["type"] == "content_block_delta"]
        assert [d["type"] for d in json_deltas] == ["input_json_delta"]  # the call comes whole
        assert json.loads(json_deltas[0]["partial_json"]) == {"city": "Paris"}
        assert events[2][1]["content_block"]["input"] == {}
    else:
        msg = client.messages.create(**kw)
    assert msg.stop_reason == "tool_use" and [b.type for b in msg.content] == ["tool_use"]
    call = msg.content[0]
    assert call.name == "get_weather" and call.input == {"city": "Paris"} and call.id
    assert fake.requests[-1].options.json_schema["properties"]["name"] == {"const": "get_weather"}  # forced
    # the tool's answer goes back as a tool_result and renders as a tool message
    fake.rules = {"sunny, 24C": "It is sunny in Paris.", **fake.rules}
    r = client.messages.create(model="toolsmol", max_tokens=200, tools=[WEATHER], messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [b.model_dump() for b in msg.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "sunny, 24C"},
                                     {"type": "text", "text": "Thanks!"}]}])
    assert r.content[0].text == "It is sunny in Paris." and r.stop_reason == "end_turn"
    prompt = _prompt(fake)
    assert '<|im_start|>assistant\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in prompt
    assert "<|im_start|>tool\nsunny, 24C<|im_end|>\n<|im_start|>user\nThanks!<|im_end|>" in prompt
    assert fake.requests[-1].options.json_schema is None  # auto: nothing forced


def test_tool_choice_any_none_and_errors(daemon, fake, monkeypatch):
    client = _client(daemon)
    msgs = [{"role": "user", "content": "What is the Weather?"}]
    r = client.messages.create(model="toolsmol", max_tokens=200, tools=[WEATHER], tool_choice={"type": "any"}, messages=msgs)
    assert r.stop_reason == "tool_use" and r.content[-1].input == {"city": "Paris"}
    r = client.messages.create(model="toolsmol", max_tokens=200, tools=[WEATHER], tool_choice={"type": "none"},
                               messages=[{"role": "user", "content": "Hi"}])
    assert "Tools:" not in _prompt(fake) and r.content[0].text == DEFAULT_REPLY
    for bad, needle in (({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "not in 'tools'"),
                        ({"tools": [{"name": "x"}]}, "input_schema"),
                        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "not supported"),
                        ({"tools": [{**WEATHER, "input_schema": {"type": 12}}]}, "invalid JSON schema")):
        with pytest.raises(anthropic.BadRequestError) as e:
            client.messages.create(model="toolsmol", max_tokens=20, messages=msgs, **bad)
        assert e.value.body["error"]["type"] == "invalid_request_error" and needle in e.value.body["error"]["message"]
    monkeypatch.setenv("LOCALRUN_GENERIC_TOOLS", "off")  # SmolLM2's own template never renders tools
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL, max_tokens=20, messages=msgs, tools=[WEATHER])
    assert "does not support tools" in e.value.body["error"]["message"]


def test_thinking_blocks(daemon, fake):
    client = _client(daemon)
    puzzle = [{"role": "user", "content": "A puzzle: 2+2?"}]
    r = client.messages.create(model="thinker", max_tokens=200, messages=puzzle,
                               thinking={"type": "enabled", "budget_tokens": 1024})
    assert [b.type for b in r.content] == ["thinking", "text"]
    assert r.content[0].thinking == "Two and two." and r.content[0].signature == "" and r.content[1].text == "Four."
    with client.messages.stream(model="thinker", max_tokens=200, messages=puzzle,
                                thinking={"type": "enabled", "budget_tokens": 1024}) as s:
        final = s.get_final_message()
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in final.content] == [
        ("thinking", "Two and two."), ("text", "Four.")]
    events = _events(daemon, {"model": "thinker", "max_tokens": 200, "messages": puzzle})  # unset: as the model does
    _check_sequence(events)
    assert events[2][1]["content_block"] == {"type": "thinking", "thinking": "", "signature": ""}
    assert {d["delta"]["type"] for _, d in events if d["type"] == "content_block_delta"} == {"thinking_delta", "text_delta"}
    # earlier turns' thinking blocks are accepted and left out of the prompt
    r = client.messages.create(model="thinker", max_tokens=200, thinking={"type": "disabled"}, messages=[
        *puzzle, {"role": "assistant", "content": [b.model_dump() for b in final.content]},
        {"role": "user", "content": "And the puzzle 3+3?"}])
    assert [b.type for b in r.content] == ["text"] and r.content[0].text == "Four."
    prompt = _prompt(fake)
    assert "Two and two" not in prompt and "<|im_start|>assistant\nFour.<|im_end|>" in prompt
    assert prompt.endswith("<think>\n\n</think>\n\n")  # disabled reaches the template
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL, max_tokens=20, messages=HI, thinking={"type": "enabled", "budget_tokens": 1024})
    assert "does not support thinking" in e.value.body["error"]["message"]


def test_a_final_assistant_turn_is_continued(daemon, fake):
    """Anthropic's prefill: the prompt ends with the assistant's text, not with a new turn, and the
    answer is what comes after it; count_tokens counts that same prompt."""
    client = _client(daemon)
    msgs = [*HI, {"role": "assistant", "content": "The answer is"}]
    r = client.messages.create(model=MODEL, max_tokens=30, messages=msgs)
    prompt = _prompt(fake)
    assert prompt.endswith("<|im_start|>assistant\nThe answer is"), prompt[-80:]
    assert r.content[0].text == DEFAULT_REPLY and r.stop_reason == "end_turn"
    n = client.messages.count_tokens(model=MODEL, messages=msgs).input_tokens
    assert n == len(prompt)  # the fake's tokens are characters
    # and as vLLM asks for it on the OpenAI API, and as Ollama's chat does with a final assistant message
    r = httpx.post(daemon.url + "/v1/chat/completions", json={
        "model": MODEL, "messages": msgs, "continue_final_message": True, "add_generation_prompt": False})
    assert r.status_code == 200 and _prompt(fake) == prompt, r.text
    r = httpx.post(daemon.url + "/api/chat", json={"model": MODEL, "messages": msgs, "stream": False})
    assert r.status_code == 200 and _prompt(fake) == prompt, r.text
    # without the switch the OpenAI API opens a new turn after it (vLLM's default)
    httpx.post(daemon.url + "/v1/chat/completions", json={"model": MODEL, "messages": msgs})
    assert _prompt(fake).endswith("The answer is<|im_end|>\n<|im_start|>assistant\n"), _prompt(fake)[-80:]


def test_count_tokens(daemon, fake):
    client = _client(daemon)
    plain = client.messages.count_tokens(model="toolsmol", messages=HI).input_tokens
    with_tools = client.messages.count_tokens(model="toolsmol", messages=HI, tools=[WEATHER]).input_tokens
    assert 0 < plain < with_tools  # the tools are rendered into the prompt
    r = client.messages.create(model="toolsmol", max_tokens=50, messages=HI, tools=[WEATHER])
    assert r.usage.input_tokens + r.usage.cache_read_input_tokens == with_tools == len(_prompt(fake))
    n = len(fake.requests)
    short = client.messages.count_tokens(model=MODEL, messages=HI).input_tokens
    longer = [*HI, {"role": "assistant", "content": "Hello!"}]  # counting may end on the assistant's turn
    assert client.messages.count_tokens(model=MODEL, messages=longer).input_tokens > short > 0
    assert len(fake.requests) == n  # nothing was generated
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="nope", messages=HI)


def test_stop_sequences_and_max_tokens(daemon):
    client = _client(daemon)
    magic = [{"role": "user", "content": "Say the magic words"}]
    r = client.messages.create(model=MODEL, max_tokens=100, messages=magic, stop_sequences=["STOP", "zzz"])
    assert r.content[0].text == "abc " and r.stop_reason == "stop_sequence" and r.stop_sequence == "STOP"
    with client.messages.stream(model=MODEL, max_tokens=100, messages=magic, stop_sequences=["STOP"]) as s:
        assert "".join(s.text_stream) == "abc "
        final = s.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == "STOP"
    # a stop string of the model's own (a Modelfile PARAMETER) ends its turn; request ones add to it
    r = client.messages.create(model="stopper", max_tokens=100, messages=magic)
    assert r.content[0].text == "abc " and r.stop_reason == "end_turn" and r.stop_sequence is None
    r = client.messages.create(model="stopper", max_tokens=100, messages=magic, stop_sequences=["bc"])
    assert r.content[0].text == "a" and r.stop_reason == "stop_sequence" and r.stop_sequence == "bc"
    r = client.messages.create(model=MODEL, max_tokens=3, messages=HI)
    assert r.content[0].text == DEFAULT_REPLY[:3] and r.stop_reason == "max_tokens" and r.usage.output_tokens == 3


def test_context_window_exceeded(daemon):
    client = _client(daemon)
    n = client.messages.count_tokens(model=MODEL, messages=HI).input_tokens
    r = httpx.post(daemon.url + "/api/create", json={"model": "tight", "from": MODEL, "parameters": {"num_ctx": n + 5},
                                                     "stream": False}, timeout=60)
    assert r.status_code == 200
    r = client.messages.create(model="tight", max_tokens=100, messages=HI)
    assert r.content[0].text == DEFAULT_REPLY[:5] and r.stop_reason == "model_context_window_exceeded"


def test_output_config_format(home, daemon, fake):
    client = _client(daemon)
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
    client.messages.create(model=MODEL, max_tokens=50, messages=HI,
                           output_config={"format": {"type": "json_schema", "schema": schema}})
    assert fake.requests[-1].options.json_schema == schema
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL, max_tokens=50, messages=HI,
                               output_config={"format": {"type": "json_schema", "schema": {"type": 7}}})
    assert "invalid JSON schema" in e.value.body["error"]["message"]
    plain = FakeModel(supports_json_schema=False)  # a backend that cannot constrain output: refused up front
    d = InProcessDaemon(home, plain)
    try:
        with pytest.raises(anthropic.BadRequestError) as e:
            _client(d).messages.create(model=MODEL, max_tokens=50, messages=HI,
                                       output_config={"format": {"type": "json_schema", "schema": schema}})
        assert "cannot constrain" in e.value.body["error"]["message"] and plain.requests == []
    finally:
        d.stop()


@pytest.mark.parametrize("body, needle", [
    ({"messages": HI}, "'max_tokens' is required"),
    ({"max_tokens": 0, "messages": HI}, "'max_tokens' must be >= 1"),
    ({"max_tokens": 5, "messages": []}, "'messages' must be a non-empty list"),
    ({"max_tokens": 5, "messages": HI, "temperature": 1.5}, "'temperature' must be <= 1.0"),
    ({"max_tokens": 5, "messages": HI, "stop_sequences": "x" * 300}, "'stop_sequences' allows at most"),
    ({"max_tokens": 5, "messages": [{"role": "robot", "content": "x"}]}, "role 'user', 'assistant' or 'system'"),
    ({"max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, "no user or assistant message"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]},
     "cannot take images: it has no vision projector"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
        {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}]}]}]},
     "document content blocks are not supported"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "x", "input": {}}]}]},
     "\"tool_use\" are not supported"),
    ({"max_tokens": 5, "messages": [*HI, {"role": "assistant", "content": "  "}]}, "to continue is empty"),
    ({"max_tokens": 5, "messages": HI, "thinking": {"type": "sometimes"}}, "'thinking' must be"),
    ({"max_tokens": 5, "messages": HI, "tool_choice": {"type": "whatever"}, "tools": []}, "'tool_choice' must be"),
    ({"max_tokens": 5, "messages": HI, "system": [{"type": "image"}]}, "system[0]"),
])
def test_bad_requests_are_anthropic_shaped_400s(daemon, fake, body, needle):
    r = httpx.post(daemon.url + "/v1/messages", json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error" and needle in err["error"]["message"]
    assert fake.requests == []


def test_sdk_errors_not_found_and_mid_stream(daemon, fake):
    client = _client(daemon)
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="no-such-model", max_tokens=5, messages=HI)
    assert e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model=MODEL, max_tokens=5, messages=HI, extra_body={"top_k": -1})
    fake.fail_with = "the fake backend broke"
    with pytest.raises(anthropic.APIStatusError) as e:
        with client.messages.stream(model=MODEL, max_tokens=100, messages=HI) as s:
            "".join(s.text_stream)
    assert "the fake backend broke" in str(e.value)
    events = _events(daemon, {"model": MODEL, "max_tokens": 100, "messages": HI})
    assert events[-1] == ("error", {"type": "error", "error": {"type": "api_error", "message": "the fake backend broke"}})
    with pytest.raises(anthropic.InternalServerError) as e:  # not streamed: a 500 in Anthropic's shape
        client.messages.create(model=MODEL, max_tokens=100, messages=HI)
    assert e.value.body == {"type": "error", "error": {"type": "api_error", "message": "the fake backend broke"}}


def test_client_leaving_mid_stream_aborts(home):
    fake = FakeModel(token_delay=0.02)
    d = InProcessDaemon(home, fake)
    try:
        body = {"model": MODEL, "max_tokens": 500, "messages": HI, "stream": True}
        with httpx.stream("POST", d.url + "/v1/messages", json=body) as r:
            next(r.iter_lines())
        wait_until(lambda: len(fake.aborted) == 1)
        assert fake.finished == []
        wait_until(lambda: d.state.manager.runners[MODEL].active == 0)
    finally:
        d.stop()


def test_queue_full_is_overloaded_529(home):
    fake = FakeModel(token_delay=0.02)
    d = InProcessDaemon(home, fake, LOCALRUN_MAX_QUEUE="1")
    try:
        client = _client(d)
        done = []
        ask = lambda: done.append(client.messages.create(model=MODEL, max_tokens=40, messages=HI))  # noqa: E731
        threads = [threading.Thread(target=ask) for _ in range(2)]
        threads[0].start()
        wait_until(lambda: (r := d.state.manager.runners.get(MODEL)) is not None and r.active == 1)
        threads[1].start()
        wait_until(lambda: d.state.manager.runners[MODEL].waiting == 1)
        with pytest.raises(anthropic.OverloadedError) as e:
            client.messages.create(model=MODEL, max_tokens=5, messages=HI)
        assert e.value.status_code == 529 and e.value.body["error"]["type"] == "overloaded_error"
        assert int(e.value.response.headers["retry-after"]) >= 1
        with pytest.raises(anthropic.OverloadedError):
            client.messages.count_tokens(model=MODEL, messages=HI)
        for t in threads:
            t.join(60)
        assert len(done) == 2
    finally:
        d.stop()


def test_x_api_key(home):
    d = InProcessDaemon(home, FakeModel(), LOCALRUN_API_KEY="s3cret")
    try:
        assert _client(d, api_key="s3cret").messages.create(model=MODEL, max_tokens=50, messages=HI).content[0].text
        with pytest.raises(anthropic.AuthenticationError) as e:
            _client(d, api_key="wrong").messages.create(model=MODEL, max_tokens=50, messages=HI)
        assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "authentication_error"
        r = httpx.post(d.url + "/v1/messages", json={"model": MODEL, "max_tokens": 5, "messages": HI})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        r = httpx.post(d.url + "/v1/messages/count_tokens", json={"model": MODEL, "messages": HI},
                       headers={"Authorization": "Bearer s3cret"})  # bearer works too
        assert r.status_code == 200 and r.json()["input_tokens"] > 0
    finally:
        d.stop()



# -- end to end: the real daemon, llama.cpp, SmolLM2 ---------------------------------------------------
@pytest.fixture(scope="module")
def real(tmp_path_factory):
    from daemon import KEY, Daemon

    d = Daemon(tmp_path_factory.mktemp("anthropic_real"), LOCALRUN_API_KEY=KEY, LOCALRUN_CONTEXT_LENGTH="1024")
    try:
        d.pull()
        r = d.http.post("/api/create", json={"model": "toolsmol", "from": MODEL, "template": TOOLS_TEMPLATE,
                                             "stream": False})
        assert r.status_code == 200, r.text
        yield d, _client(d, api_key=KEY)  # the SDK sends the key as x-api-key
    finally:
        d.stop()


CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]


def test_real_message_and_prefix_cache(real):
    d, client = real
    r = client.messages.create(model=MODEL, max_tokens=8, messages=CAPITAL, system="Answer briefly.")
    assert r.content[0].type == "text" and r.content[0].text and r.stop_reason in ("end_turn", "max_tokens")
    u = r.usage
    assert 0 < u.output_tokens <= 8 and u.input_tokens > 5
    n = client.messages.count_tokens(model=MODEL, messages=CAPITAL, system="Answer briefly.").input_tokens
    assert n == u.input_tokens + u.cache_read_input_tokens  # the model's own tokenizer and template
    again = client.messages.create(model=MODEL, max_tokens=8, messages=CAPITAL, system="Answer briefly.").usage
    assert again.cache_read_input_tokens > 0 and again.input_tokens + again.cache_read_input_tokens == n


def test_real_prompt_over_the_window_reads_as_anthropic_words_it(real):
    """Anthropic's wording, "prompt is too long: N tokens > M maximum", which Claude Code and agent loops
    look for to compact the conversation; our advice follows it."""
    import anthropic

    d, client = real
    long = [{"role": "user", "content": "Tell me about the ocean. " * 300}]
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL, max_tokens=8, messages=long)
    msg = e.value.body["error"]["message"]
    assert e.value.status_code == 400 and e.value.body["error"]["type"] == "invalid_request_error"
    assert re.match(r"prompt is too long: \d+ tokens > 1024 maximum \(the context window, num_ctx\); \S", msg), msg
    assert "num_ctx" in msg.split(";", 1)[1]  # the advice: a larger num_ctx, up to what the model was trained for
    assert client.messages.create(model=MODEL, max_tokens=4, messages=CAPITAL).content[0].text


def test_real_stream(real):
    d, client = real
    with client.messages.stream(model=MODEL, max_tokens=6, messages=CAPITAL) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text and final.content[0].text == text and 0 < final.usage.output_tokens <= 6
    events = _events(d, {"model": MODEL, "max_tokens": 4, "messages": CAPITAL}, headers={"x-api-key": d.key})
    _check_sequence(events)


def test_real_stop_sequence(real):
    """Stops that any English answer holds within a few tokens (a word taken from one greedy answer
    need not come again: llama.cpp's numbers depend on which slot, with which cached prefix, runs it)."""
    d, client = real
    stops = ["a", "e", "i", "o"]
    r = client.messages.create(model=MODEL, max_tokens=8, messages=CAPITAL, stop_sequences=stops,
                               extra_body={"temperature": 0})
    text = "".join(b.text for b in r.content if b.type == "text")
    assert r.stop_reason == "stop_sequence" and r.stop_sequence in stops, r
    assert not any(s in text for s in stops)


def test_real_forced_tool_call(real):
    d, client = real
    # sampled (Anthropic's default temperature 1): whatever the model picks, the grammar keeps the call
    # JSON and bounds it (a 20-character city of at most 6 tokens each, \uXXXX, plus ~20 for the rest), so
    # 200 tokens always finish it: a reply that is not a call is a bug (it found raw newlines in strings)
    with client.messages.stream(model="toolsmol", max_tokens=200, tools=[WEATHER],
                                tool_choice={"type": "tool", "name": "get_weather"},
                                messages=[{"role": "user", "content": "Weather in Paris?"}]) as s:
        msg = s.get_final_message()
    assert msg.stop_reason == "tool_use", msg
    call = msg.content[-1]
    assert call.type == "tool_use" and call.name == "get_weather" and isinstance(call.input["city"], str)
    r = client.messages.create(model="toolsmol", max_tokens=4, tools=[WEATHER], messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [b.model_dump() for b in msg.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "sunny"}]}])
    assert r.stop_reason in ("end_turn", "max_tokens", "tool_use")
