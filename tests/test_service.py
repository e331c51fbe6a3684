"""The generation service and the API translators, in-process, over real HTTP on 127.0.0.1,
against the small fake backend (tests/fakes.py): every API shape, streamed tool calls whole,
reasoning split out, queueing, eviction, keep-alive, cancellation, stream errors, metrics.
The real library holds the models (SmolLM2's GGUF header drives the memory plan); only the
backend is fake. The same behaviours run end to end against llama.cpp in test_server.py."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
from fakes import MODEL, FakeModel, InProcessDaemon, api_rules, library_home, metric_samples, wait_until

pytestmark = pytest.mark.timeout(120)

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                             "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                            "required": ["city"]}}}
MSGS = [{"role": "user", "content": "Hi there"}]


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    return library_home(tmp_path_factory.mktemp("svc_home"))


@pytest.fixture
def fake():
    return FakeModel(rules=api_rules())


@pytest.fixture
def daemon(home, fake):
    d = InProcessDaemon(home, fake, LOCALRUN_NUM_PARALLEL="1")
    yield d
    d.stop()


def _sse(r: httpx.Response) -> list:
    out = []
    for line in r.iter_lines():
        if line.startswith("data: "):
            out.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
    return out


# -- OpenAI ------------------------------------------------------------------------------------
def test_openai_chat_stream_and_n(daemon):
    from openai import OpenAI

    client = OpenAI(base_url=daemon.url + "/v1", api_key="x", max_retries=0)
    r = client.chat.completions.create(model=MODEL, messages=MSGS, n=2)
    assert [c.message.content for c in r.choices] == ["Hello from the fake model."] * 2
    assert r.usage.completion_tokens == 2 * len("Hello from the fake model.")
    text = "".join(c.choices[0].delta.content or "" for c in
                   client.chat.completions.create(model=MODEL, messages=MSGS, stream=True) if c.choices)
    assert text == "Hello from the fake model."
    r = client.completions.create(model=MODEL, prompt="Say the magic words", max_tokens=50, stop=["STOP"])
    assert r.choices[0].text == "abc " and r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_openai_forced_tool_call_comes_back_whole(daemon, stream):
    from openai import OpenAI

    client = OpenAI(base_url=daemon.url + "/v1", api_key="x", max_retries=0)
    kw = dict(model="toolsmol", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER],
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    if not stream:
        ch = client.chat.completions.create(**kw).choices[0]
        calls, finish = ch.message.tool_calls, ch.finish_reason
        assert ch.message.content is None
    else:
        chunks = list(client.chat.completions.create(**kw, stream=True))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        calls = [tc for d in deltas for tc in (d.tool_calls or [])]
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason][0]
        assert "".join(d.content or "" for d in deltas) == ""  # no JSON text leaks (or doubles) into content
    assert finish == "tool_calls" and len(calls) == 1
    assert calls[0].function.name == "get_weather" and json.loads(calls[0].function.arguments) == {"city": "Paris"}


def test_openai_reasoning_content(daemon):
    r = httpx.post(daemon.url + "/v1/chat/completions", json={"model": "thinker", "messages": [
        {"role": "user", "content": "A puzzle: 2+2?"}]}).json()
    msg = r["choices"][0]["message"]
    assert msg["reasoning_content"] == "Two and two." and msg["content"] == "Four."
    with httpx.stream("POST", daemon.url + "/v1/chat/completions", json={
            "model": "thinker", "stream": True, "messages": [{"role": "user", "content": "A puzzle: 2+2?"}]}) as s:
        events = _sse(s)
    deltas = [e["choices"][0]["delta"] for e in events[:-1] if e["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Two and two."
    assert "".join(d.get("content") or "" for d in deltas) == "Four."
    # enable_thinking false reaches the template (which closes the think block itself)
    r = httpx.post(daemon.url + "/v1/chat/completions", json={
        "model": "thinker", "messages": [{"role": "user", "content": "A puzzle: 2+2?"}],
        "chat_template_kwargs": {"enable_thinking": False}}).json()
    assert "<think>\n\n</think>" in daemon.state.generation.manager.runners["thinker:latest"].backend.model.requests[-1].prompt
    assert "reasoning_content" not in r["choices"][0]["message"]


def test_backend_error_mid_stream_is_an_error_event_then_done(daemon, fake):
    fake.fail_with = "the fake backend broke"
    with httpx.stream("POST", daemon.url + "/v1/chat/completions", json={"model": MODEL, "messages": MSGS,
                                                                        "stream": True}) as r:
        events = _sse(r)
    assert events[-1] == "[DONE]" and "the fake backend broke" in events[-2]["error"]["message"]
    with httpx.stream("POST", daemon.url + "/api/chat", json={"model": MODEL, "messages": MSGS}) as r:
        lines = [json.loads(x) for x in r.iter_lines() if x.strip()]
    assert "the fake backend broke" in lines[-1]["error"]


def test_json_schema_refused_up_front_when_the_backend_cannot(home):
    fake = FakeModel(supports_json_schema=False)
    d = InProcessDaemon(home, fake)
    try:
        r = httpx.post(d.url + "/v1/chat/completions", json={"model": MODEL, "messages": MSGS, "stream": True,
                                                             "response_format": {"type": "json_object"}})
        assert r.status_code == 400 and "cannot constrain" in r.json()["error"]["message"]
        assert fake.requests == []  # refused before the backend saw anything
    finally:
        d.stop()


# -- Ollama --------------------------------------------------------------------------------------
def test_ollama_sdk_chat_tools_and_thinking(daemon):
    import ollama

    client = ollama.Client(host=daemon.url)
    r = client.chat(model=MODEL, messages=MSGS)
    assert r.message.content == "Hello from the fake model." and r.done
    r = client.chat(model="toolsmol", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER])
    assert r.message.tool_calls[0].function.name == "get_weather"
    assert r.message.tool_calls[0].function.arguments == {"city": "Paris"}
    calls = [tc for ch in client.chat(model="toolsmol", messages=[{"role": "user", "content": "Weather?"}],
                                      tools=[WEATHER], stream=True) for tc in (ch.message.tool_calls or [])]
    assert len(calls) == 1 and calls[0].function.arguments == {"city": "Paris"}
    r = client.chat(model="thinker", messages=[{"role": "user", "content": "A puzzle"}], think=True)
    assert r.message.thinking == "Two and two." and r.message.content == "Four."
    r = client.generate(model="thinker", prompt="A puzzle", think=False)
    assert not r.thinking and r.response == "Four."
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model=MODEL, messages=MSGS, think=True)
    assert "does not support thinking" in str(e.value)


# gpt-oss's way, cut down: the effort goes into the system message; the answer comes on channels
OSS_TEMPLATE = ("<|start|>system<|message|>Reasoning: {{ reasoning_effort | default('medium') }}<|end|>"
                "{% for m in messages %}<|start|>{{ m.role }}{% if m.role == 'assistant' %}<|channel|>final{% endif %}"
                "<|message|>{{ m.content }}<|end|>{% endfor %}<|start|>assistant")


def test_reasoning_effort_reaches_a_gpt_oss_template_from_every_api(tmp_path):
    """Ollama's think levels (the CLI's --think=high), OpenAI chat's reasoning_effort and the Responses
    API's reasoning.effort reach a template that takes one (gpt-oss: "Reasoning: high"); think true
    on such a model is no 400 (it thinks on channels, not in <think> blocks); "none" asks a <think>
    model not to think; a templated /api/generate on such a model is parsed by channel too. The level
    was dropped before, think true was refused, and /api/generate gave the channels' text run together."""
    import ollama
    from openai import OpenAI

    oss = "<|channel|>analysis<|message|>Deep thought.<|end|><|start|>assistant<|channel|>final<|message|>Done."
    fake = FakeModel(rules={**api_rules(), "Reasoning: high": oss, "Reasoning: ": "<|channel|>final<|message|>Ok."})
    home = library_home(tmp_path / "home", {"oss": f'FROM {MODEL}\nTEMPLATE """{OSS_TEMPLATE}"""\n'})
    d = InProcessDaemon(home, fake, LOCALRUN_NUM_PARALLEL="1")
    try:
        client = ollama.Client(host=d.url)
        r = client.chat(model="oss", messages=[{"role": "user", "content": "Think hard"}], think="high")
        assert "Reasoning: high" in fake.requests[-1].prompt
        assert r.message.thinking == "Deep thought." and r.message.content == "Done."
        r = client.generate(model="oss", prompt="Think a little", think="low")
        assert "Reasoning: low" in fake.requests[-1].prompt and r.response == "Ok."
        client.chat(model="oss", messages=[{"role": "user", "content": "Think"}], think=True)  # no 400
        assert "Reasoning: medium" in fake.requests[-1].prompt
        oai = OpenAI(base_url=d.url + "/v1", api_key="x", max_retries=0)
        c = oai.chat.completions.create(model="oss", messages=[{"role": "user", "content": "Hm"}],
                                        reasoning_effort="high")
        assert "Reasoning: high" in fake.requests[-1].prompt and c.choices[0].message.content == "Done."
        oai.responses.create(model="oss", input="Hm", reasoning={"effort": "minimal"})
        assert "Reasoning: low" in fake.requests[-1].prompt
        # "none" on a <think> model: the template closes the block (enable_thinking false)
        oai.chat.completions.create(model="thinker", messages=[{"role": "user", "content": "A puzzle"}],
                                    reasoning_effort="none")
        assert fake.requests[-1].prompt.endswith("<think>\n\n</think>\n\n")
        r = httpx.post(d.url + "/v1/chat/completions", json={"model": "oss", "messages": MSGS, "reasoning_effort": 3})
        assert r.status_code == 400 and "reasoning_effort" in r.json()["error"]["message"]
    finally:
        d.stop()


def test_parallel_tool_calls_false_keeps_one_call(home):
    """OpenAI chat's parallel_tool_calls: false: at most one call comes back (streamed or not); by
    default both calls the model wrote do."""
    from openai import OpenAI

    two = ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
           '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>')
    fake = FakeModel(rules={"Two cities": two})
    d = InProcessDaemon(home, fake, LOCALRUN_NUM_PARALLEL="1")
    try:
        client = OpenAI(base_url=d.url + "/v1", api_key="x", max_retries=0)
        ask = {"model": "toolsmol", "messages": [{"role": "user", "content": "Two cities"}], "tools": [WEATHER]}
        r = client.chat.completions.create(**ask)
        assert [c.function.arguments for c in r.choices[0].message.tool_calls] == ['{"city": "Paris"}',
                                                                                  '{"city": "Rome"}']
        r = client.chat.completions.create(**ask, parallel_tool_calls=False)
        assert [c.function.arguments for c in r.choices[0].message.tool_calls] == ['{"city": "Paris"}']
        streamed = [tc for ch in client.chat.completions.create(**ask, parallel_tool_calls=False, stream=True)
                    for tc in ((ch.choices[0].delta.tool_calls or []) if ch.choices else [])]
        assert len(streamed) == 1 and streamed[0].function.arguments == '{"city": "Paris"}'
    finally:
        d.stop()


def test_ollama_pull_and_create_not_streamed_and_bad_names(daemon):
    r = httpx.post(daemon.url + "/api/pull", json={"model": MODEL, "stream": False}, timeout=60)
    assert r.status_code == 200 and r.json() == {"status": "success"}
    with httpx.Client(base_url=daemon.url, timeout=60) as c:  # one kept-alive connection throughout
        r = c.post("/api/create", json={"model": "copy1", "from": MODEL, "stream": False})
        assert r.status_code == 200 and r.json() == {"status": "success"}
        r = c.post("/api/pull", json={"model": "../../etc/passwd"})  # streamed, but a 400 before any 200
        assert r.status_code == 400 and "error" in r.json()
        r = c.post("/api/create", json={"model": "bad name!", "from": MODEL})
        assert r.status_code == 400
        assert c.get("/api/version").status_code == 200


def test_ollama_embed_dimensions(daemon):
    r = httpx.post(daemon.url + "/api/embed", json={"model": MODEL, "input": ["ab", "abcd"], "dimensions": 2}).json()
    assert [len(v) for v in r["embeddings"]] == [2, 2]
    assert all(abs(sum(x * x for x in v) - 1) < 1e-6 for v in r["embeddings"])  # re-normalized
    r = httpx.post(daemon.url + "/v1/embeddings", json={"model": MODEL, "input": "ab", "dimensions": 3}).json()
    assert len(r["data"][0]["embedding"]) == 3


# -- the model manager -------------------------------------------------------------------------------
def test_queue_overflow_and_queue_order(home):
    fake = FakeModel(token_delay=0.01, slots=1)
    d = InProcessDaemon(home, fake, LOCALRUN_MAX_QUEUE="1")
    try:
        results = {}

        def ask(i):
            results[i] = httpx.post(d.url + "/v1/chat/completions", json={"model": MODEL, "messages": MSGS},
                                    timeout=30).status_code

        first = threading.Thread(target=ask, args=(1,))
        first.start()
        wait_until(lambda: (r := d.state.manager.runners.get(MODEL)) is not None and r.active == 1)
        second = threading.Thread(target=ask, args=(2,))
        second.start()
        wait_until(lambda: d.state.manager.runners[MODEL].waiting == 1)
        r = httpx.post(d.url + "/api/chat", json={"model": MODEL, "messages": MSGS})
        assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
        first.join(30)
        second.join(30)
        assert results == {1: 200, 2: 200}
    finally:
        d.stop()


def test_eviction_keep_alive_and_reaper(home):
    fake = FakeModel()
    d = InProcessDaemon(home, fake, LOCALRUN_MAX_LOADED_MODELS="1")
    try:
        post = lambda model, **kw: httpx.post(d.url + "/api/chat", json={"model": model, "messages": MSGS,
                                                                         "stream": False, **kw})
        assert post(MODEL).status_code == 200
        assert post("toolsmol").status_code == 200  # evicts the first
        assert fake.closes == [MODEL] and list(d.state.manager.runners) == ["toolsmol:latest"]
        assert post("toolsmol", keep_alive=0).status_code == 200
        wait_until(lambda: not d.state.manager.runners)  # keep_alive 0: unloaded once idle
        assert post(MODEL, keep_alive="1s").status_code == 200
        wait_until(lambda: not d.state.manager.runners, timeout=5)  # the reaper, after 1 s
        assert fake.loads == [MODEL, "toolsmol:latest", MODEL] and fake.closes[-1] == MODEL
    finally:
        d.stop()


@pytest.mark.parametrize("stream", [True, False])
def test_client_leaving_aborts_the_backend_request(home, stream):
    fake = FakeModel(token_delay=0.02)
    d = InProcessDaemon(home, fake)
    try:
        body = {"model": MODEL, "messages": MSGS, "max_tokens": 500, "ignore_eos": True, "stream": stream}
        if stream:
            with httpx.stream("POST", d.url + "/v1/chat/completions", json=body) as r:
                it = r.iter_lines()
                next(it), next(it)
        else:
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(d.url + "/v1/chat/completions", json=body, timeout=httpx.Timeout(10, read=0.5))
        wait_until(lambda: len(fake.aborted) == 1, timeout=5)
        assert fake.finished == []
        wait_until(lambda: d.state.manager.runners[MODEL].active == 0, timeout=5)
    finally:
        d.stop()


# -- metrics ---------------------------------------------------------------------------------------
def test_metrics(home):
    fake = FakeModel(token_delay=0.001)
    d = InProcessDaemon(home, fake, LOCALRUN_API_KEY="k")
    try:
        auth = {"Authorization": "Bearer k"}
        assert httpx.get(d.url + "/metrics").status_code == 401  # behind the API key
        for _ in range(2):
            r = httpx.post(d.url + "/v1/chat/completions", headers=auth, json={"model": MODEL, "messages": MSGS})
            assert r.status_code == 200
        httpx.post(d.url + "/v1/chat/completions", headers=auth, json={"model": "nope", "messages": MSGS})
        text = httpx.get(d.url + "/metrics", headers=auth).text
        samples = metric_samples(text)
        assert samples[("localrun_http_requests_total", (("route", "/v1/chat/completions"), ("status", "200")))] == 2
        assert samples[("localrun_http_requests_total", (("route", "/v1/chat/completions"), ("status", "404")))] == 1
        assert samples[("localrun_http_requests_total", (("route", "/metrics"), ("status", "401")))] == 1
        assert samples[("localrun_completion_tokens_total", (("model", MODEL),))] == 2 * len("Hello from the fake model.")
        assert samples[("localrun_time_to_first_token_seconds_count", (("model", MODEL),))] == 2
        assert samples[("localrun_inter_token_latency_seconds_count", (("model", MODEL),))] > 20
        assert samples[("localrun_cached_prompt_tokens_total", (("model", MODEL),))] > 0  # the 2nd prompt repeats
        assert samples[("localrun_queue_depth", (("model", MODEL),))] == 0
        assert 0 < samples[("localrun_prefix_cache_hit_rate", (("model", MODEL),))] <= 0.5
        assert samples[("localrun_models_loaded", ())] == 1
    finally:
        d.stop()


# -- LangChain's chat models, pointed at the daemon by base URL only ----------------------------------
def test_langchain_openai_and_ollama_chat_models(daemon):
    from langchain_ollama import ChatOllama
    from langchain_openai import ChatOpenAI

    for llm in (ChatOpenAI(base_url=daemon.url + "/v1", api_key="unused", model=MODEL, max_retries=0),
                ChatOllama(base_url=daemon.url, model=MODEL)):
        assert llm.invoke("Hi").content == "Hello from the fake model."
        assert "".join(c.content for c in llm.stream("Hi")) == "Hello from the fake model."

    oai = ChatOpenAI(base_url=daemon.url + "/v1", api_key="unused", model="toolsmol", max_retries=0)
    forced = oai.bind_tools([WEATHER], tool_choice="get_weather")
    msg = forced.invoke("Weather in Paris?")
    assert msg.tool_calls[0]["name"] == "get_weather" and msg.tool_calls[0]["args"] == {"city": "Paris"}
    chunks = list(forced.stream("Weather in Paris?"))  # streamed: the call arrives whole
    total = chunks[0]
    for c in chunks[1:]:
        total = total + c
    assert total.tool_calls[0]["args"] == {"city": "Paris"} and not total.content

    olm = ChatOllama(base_url=daemon.url, model="toolsmol").bind_tools([WEATHER])
    msg = olm.invoke("Weather in Paris?")
    assert msg.tool_calls[0]["name"] == "get_weather" and msg.tool_calls[0]["args"] == {"city": "Paris"}
    thinker = ChatOllama(base_url=daemon.url, model="thinker", reasoning=True)
    msg = thinker.invoke("A puzzle: 2+2?")
    assert msg.content == "Four." and msg.additional_kwargs["reasoning_content"] == "Two and two."


# -- exact routes: the router's front for fixed paths ------------------------------------------------
def test_exact_routes_answer_as_fastapis_router_does(daemon):
    from localrun.server.app import ExactRoutes, exact_routes

    table = exact_routes(daemon.app)
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses", "/v1/embeddings",
                 "/api/chat", "/api/generate", "/api/embed", "/api/show"):
        assert ("POST", path) in table, path
    assert not any("{" in p for _, p in table) and ("GET", "/api/tags") in table

    def strip(obj):  # what differs between two answers anyway: ids, times, durations, the prompt found cached
        if isinstance(obj, dict):
            return {k: strip(v) for k, v in obj.items() if k not in ("id", "created", "created_at", "cached_tokens",
                                                                      "prompt_eval_count") and not k.endswith("_duration")}
        return [strip(v) for v in obj] if isinstance(obj, list) else obj

    calls = [("POST", "/v1/chat/completions", {"model": MODEL, "messages": MSGS, "max_tokens": 5, "temperature": 0}),
             ("POST", "/v1/chat/completions", {"model": MODEL, "messages": []}),  # 400, OpenAI's shape
             ("POST", "/v1/completions", {"model": "nope:1b", "prompt": "hi"}),  # 404 naming the pull
             ("POST", "/api/chat", {"model": MODEL, "messages": MSGS, "stream": False, "options": {"temperature": 0}}),
             ("POST", "/api/chat", {"model": MODEL, "messages": MSGS, "stream": True, "options": {"temperature": 0}}),
             ("POST", "/api/generate", "not json"),  # 400, Ollama's shape
             ("GET", "/v1/chat/completions", None),  # 405: a method the exact route has not
             ("GET", "/api/tags", None), ("POST", "/api/show", {"model": MODEL}), ("GET", "/api/version", None)]

    def answers():
        out = []
        with httpx.Client(base_url=daemon.url, timeout=30) as c:
            for method, path, body in calls:
                kw = {"content": body} if isinstance(body, str) else {"json": body} if body is not None else {}
                r = c.request(method, path, **kw)
                lines = [strip(json.loads(x)) for x in r.text.splitlines() if x.strip()]
                out.append((r.status_code, r.headers.get("content-type"), lines))
        return out

    stack = daemon.app.router.middleware_stack
    assert isinstance(stack, ExactRoutes)
    fast = answers()
    daemon.app.router.middleware_stack = stack.app  # FastAPI's router alone
    try:
        slow = answers()
    finally:
        daemon.app.router.middleware_stack = stack
    assert [a[0] for a in fast] == [200, 400, 404, 200, 200, 400, 405, 200, 200, 200]
    for a, b in zip(fast, slow):
        assert a == b
