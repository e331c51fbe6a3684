"""The OpenAI Responses API (/v1/responses) with the official `openai` SDK's `client.responses`.

Fast tests: the real app over real HTTP on 127.0.0.1 with the small fake backend
(tests/fakes.py): shapes checked against the SDK's own pydantic types, streaming (raw
events, `create(stream=True)`, `responses.stream(...)`), function tools round trip through
previous_response_id, text.format, the store (retrieve, delete, bounds, damaged files, bad
ids), reasoning items, max_output_tokens -> incomplete, bad input.
End to end (the last section): the real daemon, llama.cpp and SmolLM2.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from fakes import FakeModel, InProcessDaemon, library_home
from openai import OpenAI
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from localrun.server.response_store import ResponseStore, new_response_id

pytestmark = pytest.mark.timeout(120)

MODEL = "smollm2:135m"
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
TWO_CALLS = ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
             '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>')
# renders tools, tool calls and tool results, so the tests can see the conversation the model got
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools: {% for t in tools %}{{ t | tojson }}{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% if m.tool_calls %}CALLS {{ m.tool_calls | tojson }}{% endif %}<|im_end|>\n{% endfor %}<|im_start|>assistant\n")
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather for a city", "strict": True,
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                          "additionalProperties": False}}
REPLY = "Hello from the fake model."
PATCH = '*** Begin Patch\n*** Add File: hello.txt\n+hello "you"\n*** End Patch'
PATCH_CALL = json.dumps({"name": "apply_patch", "arguments": {"input": PATCH}})
APPLY_PATCH = {"type": "custom", "name": "apply_patch", "description": "Edit files with a patch.",
               "format": {"type": "grammar", "syntax": "lark",
                          "definition": 'start: "*** Begin Patch" LF hunk+ "*** End Patch" LF?'}}
EVENTS = TypeAdapter(ResponseStreamEvent)


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    return library_home(tmp_path_factory.mktemp("responses_home"),
                        {"toolsmol": f'FROM {MODEL}\nTEMPLATE """{TOOLS_TEMPLATE}"""\n'})


@pytest.fixture
def fake():
    return FakeModel(rules={"22C and sunny": "Sunny in Paris.", "Patched": "Done.", "Patch it": PATCH_CALL, "Two cities": TWO_CALLS, "Weather": CALL,
                            "puzzle": "<think>Two and two.</think>\n\nFour.", "JSON please": '{"city": "Paris"}'})


@pytest.fixture
def daemon(home, fake):
    d = InProcessDaemon(home, fake)
    yield d
    d.stop()


@pytest.fixture
def client(daemon):
    return OpenAI(base_url=daemon.url + "/v1", api_key="x", max_retries=0)


def _prompt(fake: FakeModel) -> str:
    return fake.requests[-1].prompt


def _raw_events(daemon, body: dict) -> list[dict]:
    """A streamed response's events, each checked against the SDK's event types."""
    with httpx.stream("POST", daemon.url + "/v1/responses", json={**body, "stream": True}, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [x for x in r.iter_lines() if x]
    events, name = [], None
    for line in lines:
        if line.startswith("event: "):
            name = line[7:]
        else:
            assert line.startswith("data: ")
            ev = json.loads(line[6:])
            assert ev["type"] == name  # the SSE event name is the event's type
            EVENTS.validate_python(ev)
            events.append(ev)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


# -- create ------------------------------------------------------------------------------------------
def test_create_with_a_string_and_with_items(daemon, client, fake):
    r = client.responses.create(model=MODEL, input="Hi there", instructions="Answer like a pirate.")
    assert r.output_text == REPLY and r.status == "completed" and r.id.startswith("resp_")
    assert r.model == MODEL and r.instructions == "Answer like a pirate." and r.store is True
    prompt = _prompt(fake)
    assert "<|im_start|>system\nAnswer like a pirate.<|im_end|>" in prompt and "Hi there" in prompt
    u = r.usage
    assert u.input_tokens == len(prompt) and u.output_tokens == len(REPLY)  # the fake: a token per character
    assert u.total_tokens == u.input_tokens + u.output_tokens and u.output_tokens_details.reasoning_tokens == 0
    msg = r.output[0]
    assert (msg.type, msg.role, msg.status, msg.content[0].type) == ("message", "assistant", "completed", "output_text")

    r = client.responses.create(model=MODEL, input=[
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "First question"},
        {"role": "assistant", "content": "First answer"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Second "},
                                                         {"type": "input_text", "text": "question"}]}])
    assert r.output_text == REPLY
    prompt = _prompt(fake)
    assert prompt.index("Be brief.") < prompt.index("First question") < prompt.index("First answer") \
        < prompt.index("Second question")
    # the whole object, as the daemon sent it, against the SDK's own pydantic model
    raw = httpx.post(daemon.url + "/v1/responses", json={"model": MODEL, "input": "Hi", "metadata": {"k": "v"},
                                                         "temperature": 0.2, "top_p": 0.9, "user": "u1"}).json()
    Response.model_validate(raw)
    assert raw["metadata"] == {"k": "v"} and raw["temperature"] == 0.2 and raw["top_p"] == 0.9
    assert raw["error"] is None and raw["incomplete_details"] is None and raw["user"] == "u1"
    assert fake.requests[-1].options.temperature == 0.2 and fake.requests[-1].options.top_p == 0.9


def test_streaming_events_and_both_sdk_helpers(daemon, client):
    events = _raw_events(daemon, {"model": MODEL, "input": "Hi"})
    types = [e["type"] for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == REPLY
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    final = events[-1]["response"]
    assert final["status"] == "completed" and final["output"][0]["content"][0]["text"] == REPLY
    assert client.responses.retrieve(final["id"]).output_text == REPLY  # streamed responses are stored too

    deltas = [e.delta for e in client.responses.create(model=MODEL, input="Hi", stream=True)
              if e.type == "response.output_text.delta"]
    assert "".join(deltas) == REPLY
    with client.responses.stream(model=MODEL, input="Hi") as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert text == REPLY and final.output_text == REPLY and final.status == "completed"


# -- tools ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_function_call_round_trip_through_previous_response_id(daemon, client, fake, stream):
    kw = dict(model="toolsmol", input="Weather in Paris?", tools=[WEATHER])
    if not stream:
        r = client.responses.create(**kw)
    else:
        events = _raw_events(daemon, kw)
        args = [e for e in events if e["type"].startswith("response.function_call_arguments")]
        assert [e["type"] for e in args] == ["response.function_call_arguments.delta",
                                             "response.function_call_arguments.done"]
        assert json.loads(args[0]["delta"]) == json.loads(args[1]["arguments"]) == {"city": "Paris"}  # whole
        assert not [e for e in events if e["type"] == "response.output_text.delta"]  # no JSON leaks into text
        with client.responses.stream(**kw) as s:
            r = s.get_final_response()
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(r.output) == 1 and len(calls) == 1 and r.output_text == ""
    call = calls[0]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert call.status == "completed" and call.call_id.startswith("call_") and call.id.startswith("fc_")
    assert r.tools[0].name == "get_weather" and r.tool_choice == "auto"

    r2 = client.responses.create(model="toolsmol", tools=[WEATHER], previous_response_id=r.id, input=[
        {"type": "function_call_output", "call_id": call.call_id, "output": "22C and sunny"}])
    assert r2.output_text == "Sunny in Paris." and r2.previous_response_id == r.id
    prompt = _prompt(fake)
    assert prompt.index("Weather in Paris?") < prompt.index('"get_weather"', prompt.index("CALLS")) \
        < prompt.index("<|im_start|>tool\n22C and sunny")
    items = list(client.responses.input_items.list(r2.id, order="asc"))
    assert [i.type for i in items] == ["message", "function_call", "function_call_output"]


@pytest.mark.parametrize("stream", [False, True])
def test_custom_tool_call_round_trip(daemon, client, fake, stream):
    """A custom (freeform) tool, as Codex's apply_patch: the model sees a function taking one string
    (the grammar in its description); its call comes back as a custom_tool_call with the raw
    input; a custom_tool_call_output goes back in."""
    kw = dict(model="toolsmol", input="Patch it", tools=[APPLY_PATCH, WEATHER], store=False)
    if not stream:
        r = client.responses.create(**kw)
    else:
        events = _raw_events(daemon, kw)  # each checked against the SDK's event types
        kinds = [e["type"] for e in events]
        assert kinds[2:-1] == ["response.output_item.added", "response.custom_tool_call_input.delta",
                               "response.custom_tool_call_input.done", "response.output_item.done"], kinds
        assert events[3]["delta"] == events[4]["input"] == PATCH
        with client.responses.stream(**kw) as s:
            r = s.get_final_response()
    assert [o.type for o in r.output] == ["custom_tool_call"]
    call = r.output[0]
    assert call.name == "apply_patch" and call.input == PATCH and call.call_id.startswith("call_")
    assert r.tools[0].type == "custom" and r.tools[0].format.definition.startswith("start:")
    shown = json.loads(_prompt(fake).split("Tools: ")[1].split("<|im_end|>")[0].split("}{")[0] + "}")
    assert shown["function"]["name"] == "apply_patch"
    assert shown["function"]["parameters"]["properties"] == {"input": {"type": "string",
                                                                       "description": "the tool's raw input"}}
    assert "lark grammar:\nstart:" in shown["function"]["description"]

    r2 = client.responses.create(model="toolsmol", tools=[APPLY_PATCH], input=[
        {"role": "user", "content": "Patch it please"},
        {"type": "custom_tool_call", "call_id": call.call_id, "name": "apply_patch", "input": call.input},
        {"type": "custom_tool_call_output", "call_id": call.call_id, "output": "Patched hello.txt"}])
    assert r2.output_text == "Done."
    prompt = _prompt(fake)
    assert json.dumps(PATCH)[1:-1] in prompt.split("CALLS")[1] and "<|im_start|>tool\nPatched hello.txt" in prompt
    r3 = client.responses.create(model="toolsmol", input="Anything", tools=[APPLY_PATCH],
                                 tool_choice={"type": "custom", "name": "apply_patch"})
    assert r3.tool_choice.name == "apply_patch"
    assert fake.requests[-1].options.json_schema["properties"]["name"] == {"const": "apply_patch"}


def test_tool_choice_forces_a_call_and_parallel_tool_calls(client, fake):
    r = client.responses.create(model="toolsmol", input="Weather?", tools=[WEATHER],
                                tool_choice={"type": "function", "name": "get_weather"})
    assert r.output[0].type == "function_call" and r.tool_choice.name == "get_weather"
    forced = fake.requests[-1].options.json_schema
    assert forced["properties"]["name"] == {"const": "get_weather"}
    r = client.responses.create(model="toolsmol", input="Two cities", tools=[WEATHER])
    assert [json.loads(o.arguments)["city"] for o in r.output] == ["Paris", "Rome"]
    r = client.responses.create(model="toolsmol", input="Two cities", tools=[WEATHER], parallel_tool_calls=False)
    assert [json.loads(o.arguments)["city"] for o in r.output] == ["Paris"]
    r = client.responses.create(model="toolsmol", input="Two cities", tools=[WEATHER], max_tool_calls=1)
    assert [json.loads(o.arguments)["city"] for o in r.output] == ["Paris"] and r.max_tool_calls == 1
    r = client.responses.create(model="toolsmol", input="Weather?", tools=[WEATHER], tool_choice="none")
    assert "Tools:" not in _prompt(fake) and r.output[0].type == "message"  # the call is plain text then


# -- text.format ------------------------------------------------------------------------------------------
def test_text_format_json_schema_reaches_the_job(client, fake):
    from pydantic import BaseModel

    class City(BaseModel):
        city: str

    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
              "additionalProperties": False}
    r = client.responses.create(model=MODEL, input="JSON please",
                                text={"format": {"type": "json_schema", "name": "city", "schema": schema, "strict": True}})
    assert fake.requests[-1].options.json_schema == schema and json.loads(r.output_text) == {"city": "Paris"}
    assert r.text.format.type == "json_schema" and r.text.format.name == "city"
    parsed = client.responses.parse(model=MODEL, input="JSON please", text_format=City)
    assert parsed.output_parsed == City(city="Paris")
    client.responses.create(model=MODEL, input="JSON please", text={"format": {"type": "json_object"}})
    assert fake.requests[-1].options.json_mode is True
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="x", text={"format": {"type": "json_schema", "name": "bad",
                                                                         "schema": {"type": 12}}})
    assert "invalid JSON schema" in str(e.value)


# -- the store ----------------------------------------------------------------------------------------
def test_store_retrieve_delete_and_previous_response_id(daemon, client, fake):
    r1 = client.responses.create(model=MODEL, input="My name is Ada.", instructions="Speak like a pirate.")
    assert (daemon.settings.home / "responses" / f"{r1.id}.json").is_file()
    got = client.responses.retrieve(r1.id)
    assert got.model_dump() == r1.model_dump()
    r2 = client.responses.create(model=MODEL, input="What is my name?", previous_response_id=r1.id)
    prompt = _prompt(fake)
    assert prompt.index("My name is Ada.") < prompt.index(REPLY) < prompt.index("What is my name?")
    assert "pirate" not in prompt  # instructions are not carried over (as OpenAI specifies)
    r3 = client.responses.create(model=MODEL, input="And again?", previous_response_id=r2.id)
    prompt = _prompt(fake)
    assert prompt.index("My name is Ada.") < prompt.index("What is my name?") < prompt.index("And again?")
    assert [i.content[0].text for i in client.responses.input_items.list(r3.id) if i.type == "message"
            and i.role == "user"] == ["And again?", "What is my name?", "My name is Ada."]  # newest first
    page = client.responses.input_items.list(r3.id, order="asc", limit=2)
    assert [i.type for i in page.data] == ["message", "message"] and page.has_more
    assert len(list(client.responses.input_items.list(r3.id, limit=2))) == 5  # the SDK pages with 'after'

    client.responses.delete(r1.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r1.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(r1.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=MODEL, input="Hi", previous_response_id=r1.id)
    assert "no stored previous response" in str(e.value)
    assert client.responses.create(model=MODEL, input="Go on", previous_response_id=r2.id).output_text == REPLY

    r4 = client.responses.create(model=MODEL, input="Not kept", store=False)
    assert r4.store is False and not (daemon.settings.home / "responses" / f"{r4.id}.json").exists()
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r4.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="Hi", previous_response_id=r4.id)


def test_store_bounds_evict_the_oldest(daemon, client, tmp_path):
    daemon.app.state.responses = ResponseStore(tmp_path / "bounded", max_count=3)
    ids = [client.responses.create(model=MODEL, input=f"Turn {i}").id for i in range(5)]
    assert sorted(p.stem for p in (tmp_path / "bounded").glob("*.json")) == sorted(ids[2:])
    for rid in ids[:2]:
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(rid)
    # a conversation outlives the eviction of the response it started from: records stand alone
    r = client.responses.create(model=MODEL, input="Go on", previous_response_id=ids[4])
    assert client.responses.create(model=MODEL, input="More", previous_response_id=r.id).status == "completed"

    store = ResponseStore(tmp_path / "by_bytes", max_count=100, max_bytes=3000)
    for i in range(6):
        rid = new_response_id()
        store.save({"response": {"id": rid, "output": []}, "context": [{"text": "x" * 800, "n": i}]})
    kept = sorted((tmp_path / "by_bytes").glob("*.json"))
    assert len(kept) == 3 and sum(p.stat().st_size for p in kept) <= 3000
    assert [store.load(p.stem)["context"][0]["n"] for p in kept] == [3, 4, 5]  # the newest stay
    with pytest.raises(Exception, match="send 'store': false"):
        store.save({"response": {"id": new_response_id(), "output": []}, "context": [{"t": "x" * 4000}]})
    assert len(list((tmp_path / "by_bytes").glob("*"))) == 3  # nothing else changed, no temp files left


def test_bad_ids_and_damaged_files(daemon, client):
    for bad in ("resp_nothex", "resp_" + "0" * 31, "..%2F..%2Fetc%2Fpasswd", "resp_" + "a" * 32 + ".json"):
        r = httpx.get(f"{daemon.url}/v1/responses/{bad}")
        assert r.status_code in (400, 404) and r.json()["error"]["message"], bad
        r = httpx.delete(f"{daemon.url}/v1/responses/{bad}")
        assert r.status_code in (400, 404)
    r = httpx.post(daemon.url + "/v1/responses", json={"model": MODEL, "input": "Hi",
                                                       "previous_response_id": "../models/x"})
    assert r.status_code == 400 and "previous_response_id" in r.json()["error"]["message"]
    unknown = new_response_id()
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.retrieve(unknown)
    assert unknown in str(e.value)

    rid = client.responses.create(model=MODEL, input="Hi").id
    path = daemon.settings.home / "responses" / f"{rid}.json"
    for damage in (b"{not json", b'{"response": {"id": "resp_other", "output": []}, "context": []}', b"[]"):
        path.write_bytes(damage)
        r = httpx.get(f"{daemon.url}/v1/responses/{rid}")
        assert r.status_code == 500 and "damaged" in r.json()["error"]["message"] and str(path) not in r.text
        r = httpx.post(daemon.url + "/v1/responses", json={"model": MODEL, "input": "Hi", "previous_response_id": rid})
        assert r.status_code == 500 and "damaged" in r.json()["error"]["message"]
    client.responses.delete(rid)  # a damaged record can still be removed
    assert not path.exists()
    assert httpx.get(daemon.url + "/api/version").status_code == 200


# -- reasoning, limits, errors --------------------------------------------------------------------------
def test_reasoning_items_from_a_thinking_template(daemon, client, fake):
    r = client.responses.create(model="thinker", input="A puzzle: 2+2?")
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].type == "reasoning_text" and r.output[0].content[0].text == "Two and two."
    assert r.output[0].summary == [] and r.output_text == "Four."
    assert 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens
    events = _raw_events(daemon, {"model": "thinker", "input": "A puzzle: 2+2?"})
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == "Two and two."
    done = [e for e in events if e["type"] == "response.reasoning_text.done"]
    assert len(done) == 1 and done[0]["text"] == "Two and two." and done[0]["output_index"] == 0
    assert [e["item"]["type"] for e in events if e["type"] == "response.output_item.done"] == ["reasoning", "message"]
    # the reasoning item goes back with the conversation; effort "none" asks the template not to think
    r2 = client.responses.create(model="thinker", input="Another puzzle", previous_response_id=r.id,
                                 reasoning={"effort": "none"})
    assert "<think>\n\n</think>" in _prompt(fake) and [o.type for o in r2.output] == ["message"]
    assert r2.reasoning.effort == "none"
    # managing the context by hand (store false): the output items go back in as input as they are
    r3 = client.responses.create(model="thinker", store=False, input=[
        {"role": "user", "content": "A puzzle: 2+2?"}, *[o.model_dump(exclude_none=True) for o in r.output],
        {"role": "user", "content": "Why?"}])
    prompt = _prompt(fake)
    assert prompt.index("A puzzle: 2+2?") < prompt.index("<|im_start|>assistant\nFour.<|im_end|>") < prompt.index("Why?")
    assert r3.output_text == "Four."
    r4 = client.responses.create(model="thinker", input="A puzzle", reasoning={"effort": "high"})
    assert [o.type for o in r4.output] == ["reasoning", "message"]


def test_max_output_tokens_is_incomplete(daemon, client):
    r = client.responses.create(model=MODEL, input="Hi", max_output_tokens=5)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output_text == REPLY[:5] and r.output[0].status == "incomplete" and r.max_output_tokens == 5
    events = _raw_events(daemon, {"model": MODEL, "input": "Hi", "max_output_tokens": 5})
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def test_backend_error_mid_stream_is_an_error_event_then_failed(daemon, client, fake):
    fake.fail_with = "the fake backend broke"
    events = _raw_events(daemon, {"model": MODEL, "input": "Hi"})
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert "the fake backend broke" in events[-2]["message"]
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and "the fake backend broke" in failed["error"]["message"]
    with pytest.raises(openai.NotFoundError):  # a failed response is not stored
        client.responses.retrieve(failed["id"])
    with pytest.raises(openai.InternalServerError):  # not streamed: an HTTP error
        client.responses.create(model=MODEL, input="Hi")


@pytest.mark.parametrize("body, message", [
    ({"input": "Hi"}, "'model' is required"),
    ({"model": MODEL}, "'input'"),
    ({"model": MODEL, "input": "   "}, "must not be empty"),
    ({"model": MODEL, "input": []}, "'input'"),
    ({"model": MODEL, "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "must be a data URL"),
    ({"model": MODEL, "input": [{"role": "robot", "content": "hi"}]}, "role"),
    ({"model": MODEL, "input": [{"type": "made_up_call"}]}, "not supported"),
    ({"model": MODEL, "input": [{"type": "function_call_output", "output": "x"}]}, "call_id"),
    ({"model": MODEL, "input": "Hi", "tools": [{"type": "made_up_tool"}]}, "function tools"),
    ({"model": MODEL, "input": "Hi", "tools": [{"type": "namespace", "name": "ns"}]}, "namespace"),
    ({"model": "toolsmol", "input": "Hi", "tool_choice": "required"}, "'tools' is empty"),
    ({"model": "toolsmol", "input": "Hi", "tools": [{"type": "custom", "name": "x", "format": {"type": "grammar"}}]},
     "grammar format"),
    ({"model": "toolsmol", "input": "Hi", "tools": [{"type": "custom", "name": "x", "format": {
        "type": "grammar", "syntax": "lark", "definition": "x" * 40000}}]}, "longer than"),
    ({"model": "toolsmol", "input": "Hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
     "tool_choice"),
    ({"model": MODEL, "input": "Hi", "truncation": "auto"}, "truncation"),
    ({"model": MODEL, "input": "Hi", "background": True}, "background"),
    ({"model": MODEL, "input": "Hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"model": MODEL, "input": "Hi", "temperature": 3}, "temperature"),
    ({"model": MODEL, "input": "Hi", "text": {"format": {"type": "xml"}}}, "text.format"),
    ({"model": MODEL, "input": "Hi", "metadata": {"k": 1}}, "metadata"),
    ({"model": MODEL, "input": "Hi", "store": "yes"}, "'store'"),
])
def test_bad_requests_are_clear_400s(daemon, body, message):
    for stream in (False, True):
        r = httpx.post(daemon.url + "/v1/responses", json={**body, "stream": stream})
        assert r.status_code == 400, r.text
        assert message in r.json()["error"]["message"]
    r = httpx.post(daemon.url + "/v1/responses", json={"model": "no-such-model", "input": "Hi"})
    assert r.status_code == 404


# -- end to end: the real daemon, llama.cpp and SmolLM2 -----------------------------------------------------
@pytest.fixture(scope="module")
def real(tmp_path_factory):
    from daemon import Daemon

    d = Daemon(tmp_path_factory.mktemp("responses_real"), LOCALRUN_CONTEXT_LENGTH="2048")
    try:
        d.pull()
        yield d, OpenAI(base_url=d.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    finally:
        d.stop()


@pytest.mark.timeout(300)
def test_real_plain_and_streamed(real):
    d, client = real
    r = client.responses.create(model=MODEL, input="What is the capital of France?", max_output_tokens=12,
                                temperature=0, instructions="Answer in one short sentence.")
    assert r.output_text.strip() and r.status in ("completed", "incomplete")
    assert r.usage.input_tokens > 10 and 0 < r.usage.output_tokens <= 12
    with client.responses.create(model=MODEL, input="Say hello.", max_output_tokens=40, temperature=0,
                                 stream=True) as events:
        events = list(events)
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert events[0].type == "response.created" and events[-1].type in ("response.completed", "response.incomplete")
    assert text.strip() and final.output_text == text
    assert client.responses.retrieve(final.id).output_text == text


@pytest.mark.timeout(300)
def test_real_json_schema_and_two_turns(real):
    d, client = real
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
              "required": ["city", "population"], "additionalProperties": False}
    r = client.responses.create(model=MODEL, input="Name a big city and its population as JSON.", temperature=0,
                                max_output_tokens=60, text={"format": {"type": "json_schema", "name": "c", "schema": schema}})
    obj = json.loads(r.output_text)
    assert isinstance(obj["city"], str) and isinstance(obj["population"], int)
    r1 = client.responses.create(model=MODEL, input="My name is Ada. Remember it.", max_output_tokens=16, temperature=0)
    r2 = client.responses.create(model=MODEL, input="What is my name?", previous_response_id=r1.id,
                                 max_output_tokens=16, temperature=0)
    assert r2.previous_response_id == r1.id and r2.output_text.strip()
    assert r2.usage.input_tokens > r1.usage.input_tokens + r1.usage.output_tokens  # the first turn came along
    assert r2.usage.input_tokens_details.cached_tokens > 0  # llama.cpp reused the shared prefix
    assert (d.home / "responses" / f"{r2.id}.json").is_file()


def test_an_effort_on_a_model_that_cannot_think_still_answers(client):
    r = client.responses.create(model=MODEL, input="Hi there", reasoning={"effort": "high"})
    assert r.status == "completed" and r.output_text and r.reasoning.effort == "high"
