"""The real daemon (`python -m localrun.server`) on a free 127.0.0.1 port, the real
library (offline smollm2:135m pull through /api/pull), the real llama.cpp and SmolLM2.

Daemon A (NUM_PARALLEL=2, an API key): the OpenAI SDK against /v1, httpx against /api,
docs/security.md's bad inputs, NUM_PARALLEL+1 concurrent chats x 3 rounds.
Daemon B (NUM_PARALLEL=1, MAX_QUEUE=1, MAX_LOADED_MODELS=1): a client leaving
mid-stream frees the slot, queue overflow answers 503 + Retry-After, a second model
(created from a Modelfile) evicts the first, keep_alive 0 unloads.
"""

from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from daemon import KEY, MODEL, Daemon, pulled_daemon

pytestmark = pytest.mark.timeout(300)

@pytest.fixture(scope="module")
def daemon_a(tmp_path_factory):
    with pulled_daemon(tmp_path_factory.mktemp("home_a"), LOCALRUN_API_KEY=KEY, LOCALRUN_NUM_PARALLEL="2",
                       LOCALRUN_MAX_QUEUE="8", LOCALRUN_CONTEXT_LENGTH="2048", LOCALRUN_ORIGINS="http://app.example") as d:
        yield d


@pytest.fixture(scope="module")
def daemon_b(tmp_path_factory):
    with pulled_daemon(tmp_path_factory.mktemp("home_b"), LOCALRUN_NUM_PARALLEL="1", LOCALRUN_MAX_QUEUE="1",
                       LOCALRUN_MAX_LOADED_MODELS="1", LOCALRUN_CONTEXT_LENGTH="1024") as d:
        yield d


@pytest.fixture(scope="module")
def oai(daemon_a):
    from openai import OpenAI

    return OpenAI(base_url=daemon_a.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


CHAT = [{"role": "user", "content": "What is the capital of France?"}]


# -- OpenAI SDK ------------------------------------------------------------------------------
def test_models_list_and_get(oai, daemon_a):
    ids = [m.id for m in oai.models.list().data]
    assert MODEL in ids
    assert oai.models.retrieve(MODEL).id == MODEL
    # vLLM's max_model_len: the context a request gets by default (LOCALRUN_CONTEXT_LENGTH=2048 here)
    listed = {m["id"]: m for m in daemon_a.http.get("/v1/models").json()["data"]}
    assert listed[MODEL]["max_model_len"] == 2048
    assert daemon_a.http.get(f"/v1/models/{MODEL}").json()["max_model_len"] == 2048


def test_chat_completion(oai):
    r = oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0, seed=1)
    ch = r.choices[0]
    assert ch.message.role == "assistant" and ch.message.content
    assert ch.finish_reason in ("stop", "length")
    u = r.usage
    assert u.prompt_tokens > 5 and 0 < u.completion_tokens <= 8 and u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details.cached_tokens is not None
    # same seed + greedy, same answer; the second run reuses the cached prompt prefix
    r2 = oai.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=8, temperature=0, seed=1)
    assert r2.choices[0].message.content == ch.message.content
    assert r2.usage.prompt_tokens_details.cached_tokens > 0


def test_chat_stream_with_usage_and_n(oai):
    stream = oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, stream=True, n=2,
                                         stream_options={"include_usage": True}, temperature=0.7, seed=3)
    texts, finishes, usage = {0: "", 1: ""}, {}, None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for ch in chunk.choices:
            texts[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finishes[ch.index] = ch.finish_reason
    assert texts[0] and texts[1] and set(finishes) == {0, 1}
    assert usage is not None and usage.completion_tokens > 0 and usage.prompt_tokens > 0


def test_sse_ends_with_done(daemon_a):
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 3, "stream": True}
    with daemon_a.http.stream("POST", "/v1/chat/completions", json=body) as r:
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"


def test_completions_logprobs_and_stop(oai):
    r = oai.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0,
                               logprobs=2)
    ch = r.choices[0]
    assert ch.text and len(ch.logprobs.tokens) == r.usage.completion_tokens
    assert all(lp <= 0 for lp in ch.logprobs.token_logprobs) and len(ch.logprobs.top_logprobs[0]) == 2
    first_word = ch.text.strip().split()[0]
    r2 = oai.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0,
                                stop=[first_word])
    assert first_word not in r2.choices[0].text and r2.choices[0].finish_reason == "stop"


def test_ignore_eos_generates_exactly_max_tokens(oai):
    msgs = [{"role": "user", "content": "Reply with the single word: yes"}]
    r = oai.chat.completions.create(model=MODEL, messages=msgs, max_tokens=48, temperature=0)
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens < 48
    r = oai.chat.completions.create(model=MODEL, messages=msgs, max_tokens=48, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 48


def test_chat_logprobs(oai):
    r = oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0, logprobs=True,
                                    top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens and len(content[0].top_logprobs) == 3


def test_json_schema_output(oai):
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
              "required": ["city", "population"], "additionalProperties": False}
    r = oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=60, temperature=0,
                                    response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}})
    obj = json.loads(r.choices[0].message.content)
    assert isinstance(obj["city"], str) and isinstance(obj["population"], int)
    r2 = oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=40, temperature=0,
                                     response_format={"type": "json_object"})
    assert isinstance(json.loads(r2.choices[0].message.content), dict)


def test_embeddings(oai):
    r = oai.embeddings.create(model=MODEL, input=["hello world", "bonjour le monde"])
    assert len(r.data) == 2 and len(r.data[0].embedding) == 576
    assert r.usage.prompt_tokens > 0


def test_openai_errors(oai):
    import openai

    with pytest.raises(openai.NotFoundError) as e:
        oai.chat.completions.create(model="no-such-model:1b", messages=CHAT)
    assert "not found" in str(e.value)
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model=MODEL, messages=[])
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=0)
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model=MODEL, messages=CHAT, n=1000)
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model=MODEL, messages=CHAT, temperature=9)
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model=MODEL, messages=CHAT, logprobs=True, top_logprobs=99)
    with pytest.raises(openai.BadRequestError, match="needs 'logprobs': true"):
        oai.chat.completions.create(model=MODEL, messages=CHAT, top_logprobs=2, max_tokens=2)
    # top_logprobs 0 without logprobs asks for nothing: answered (clients send it as a default; vLLM takes it)
    assert oai.chat.completions.create(model=MODEL, messages=CHAT, top_logprobs=0, max_tokens=2).choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError) as e:  # invalid JSON schema -> 400, next request works
        oai.chat.completions.create(model=MODEL, messages=CHAT, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "not-a-type"}}})
    assert "schema" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:  # prompt longer than the window: 400 naming it
        oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "word " * 3000}], max_tokens=2)
    assert "2048" in str(e.value) and e.value.code == "context_length_exceeded"  # OpenAI's code, which SDKs read
    assert oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2).choices[0].message.content is not None


def test_ollama_chat_drops_its_oldest_turns_to_fit_the_window(daemon_a, smollm2_gguf):
    """Ollama's /api/chat `truncate` (on unless false): a conversation that outgrows num_ctx loses its oldest
    turns, the system message and the last question kept, so a long chat in an Ollama client goes on. The
    expected cut is found here independently: Ollama's own scan from the front (prompt.go's chatPrompt),
    with the model's template and llama.cpp's tokenizer, cutting before user turns and leaving the answer
    its num_predict; the daemon's prompt_eval_count must be exactly that prompt's, and its greedy answer
    that of the cut conversation sent whole."""
    import llama_cpp
    import ollama

    from localrun.templates.chat import render_chat
    from localrun.library import read_gguf_info

    num_ctx, num_predict = 512, 16
    system = {"role": "system", "content": "You are a helpful assistant who answers briefly."}
    msgs = [system]
    for i in range(24):
        msgs += [{"role": "user", "content": f"Tell me fact number {i} about the ocean. " * (1 + i % 3)},
                 {"role": "assistant", "content": f"Fact {i}: the ocean covers most of the planet. " * (1 + i % 2)}]
    msgs.append({"role": "user", "content": "What is the capital of France?"})
    template = read_gguf_info(smollm2_gguf).chat_template
    vocab = llama_cpp.Llama(model_path=str(smollm2_gguf), vocab_only=True, verbose=False)

    def n_tokens(kept: list[dict]) -> int:
        text = render_chat(template, kept, add_generation_prompt=True)
        return len(vocab.tokenize(text.encode(), add_bos=True, special=True))

    assert n_tokens(msgs) > num_ctx
    cut = next(i for i in range(1, len(msgs)) if msgs[i]["role"] == "user"
               and n_tokens([system] + msgs[i:]) <= num_ctx - num_predict)
    kept = [system] + msgs[cut:]
    client = ollama.Client(host=daemon_a.url, headers={"Authorization": f"Bearer {KEY}"})
    opts = {"num_ctx": num_ctx, "num_predict": num_predict, "temperature": 0}
    r = client.chat(model=MODEL, messages=msgs, options=opts)
    assert r.done and r.prompt_eval_count == n_tokens(kept), (r.prompt_eval_count, n_tokens(kept), cut)
    alone = client.chat(model=MODEL, messages=kept, options=opts)
    assert r.message.content == alone.message.content and alone.prompt_eval_count == r.prompt_eval_count
    whole = daemon_a.http.post("/api/chat", json={"model": MODEL, "messages": msgs, "options": opts, "stream": False,
                                                  "truncate": False})  # the whole chat: refused as too long
    assert whole.status_code == 400 and "context window is 512 tokens" in whole.json()["error"], whole.text
    bad = daemon_a.http.post("/api/chat", json={"model": MODEL, "messages": msgs, "truncate": "yes"})
    assert bad.status_code == 400 and "'truncate' must be true or false" in bad.text


def test_generation_hits_window_length(daemon_a):
    r = daemon_a.http.post("/v1/completions", json={"model": MODEL, "prompt": "Count: 1, 2, 3,", "max_tokens": 500,
                                                     "num_ctx": 24, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"] == 24


# -- docs/security.md (bad inputs) -------------------------------------------------------------
def test_security_bad_inputs(daemon_a):
    h = daemon_a.http
    assert httpx.get(daemon_a.url + "/api/tags").status_code == 401  # no API key
    assert httpx.get(daemon_a.url + "/api/tags", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert h.get("/api/tags", headers={"Host": "evil.example.com"}).status_code == 403  # DNS rebinding
    assert h.get("/api/tags", headers={"Host": "localhost:1234"}).status_code == 200
    r = h.post("/api/chat", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]
    r = h.post("/v1/chat/completions", content=b"[1,2]")
    assert r.status_code == 400 and r.json()["error"]["message"]
    r = h.post("/api/chat", json={"model": "ghost:7b", "messages": CHAT})
    assert r.status_code == 404 and "ghost" in r.json()["error"]
    r = h.post("/api/chat", json={"model": "../../etc/passwd", "messages": CHAT})
    assert r.status_code in (400, 404)
    r = h.post("/api/generate", content=b"{" + b" " * (33 * 2**20) + b"}")
    assert r.status_code == 413
    r = h.post("/api/chat", json={"model": MODEL, "messages": [{"role": "user", "content": ""}]})
    assert r.status_code == 400
    r = h.post("/api/chat", json={"model": MODEL, "messages": CHAT, "options": {"temperature": "hot"}})
    assert r.status_code == 400
    r = h.post("/api/generate", json={"model": MODEL, "prompt": "hi " * 3000, "stream": False})
    assert r.status_code == 400 and "2048" in r.json()["error"]
    r = h.post("/api/chat", json={"model": MODEL, "messages": CHAT, "format": {"type": 12}})
    assert r.status_code == 400
    pre = {"Origin": "http://app.example", "Access-Control-Request-Method": "POST"}
    r = httpx.options(daemon_a.url + "/api/chat", headers=pre)  # CORS preflight: allowed origin
    assert r.headers.get("access-control-allow-origin") == "http://app.example"
    r = httpx.options(daemon_a.url + "/api/chat", headers={**pre, "Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in r.headers
    r = h.get("/api/tags", headers={"Origin": "http://evil.example"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    r = h.get("/api/tags", headers={"X-Big": "x" * 100_000})  # oversized headers: refused, daemon alive
    assert r.status_code in (400, 413, 431)
    assert h.get("/").text == "localrun is running"  # still alive


# -- Ollama-shaped API -------------------------------------------------------------------------------
def test_api_version_tags_show(daemon_a):
    h = daemon_a.http
    assert h.get("/api/version").json()["version"]
    names = [m["name"] for m in h.get("/api/tags").json()["models"]]
    assert MODEL in names
    show = h.post("/api/show", json={"model": MODEL}).json()
    assert show["details"]["family"] == "llama" and "template" in show


def test_api_chat_stream_stats(daemon_a):
    with daemon_a.http.stream("POST", "/api/chat", json={"model": MODEL, "messages": CHAT,
                                                        "options": {"num_predict": 5, "temperature": 0}}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
        chunks = [json.loads(line) for line in r.iter_lines() if line.strip()]
    final = chunks[-1]
    assert final["done"] is True and final["done_reason"] in ("stop", "length")
    for k in ("total_duration", "load_duration", "prompt_eval_count", "prompt_eval_duration", "eval_count",
              "eval_duration", "cached_tokens"):
        assert isinstance(final[k], int), k
    assert final["eval_count"] <= 5 and "".join(c["message"]["content"] for c in chunks[:-1])


def test_api_generate_json_format_and_embed(daemon_a):
    h = daemon_a.http
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}}, "required": ["name"]}
    r = h.post("/api/generate", json={"model": MODEL, "prompt": "Give a JSON object with a name.", "format": schema,
                                      "stream": False, "options": {"num_predict": 40, "temperature": 0}})
    assert r.status_code == 200 and r.json()["done_reason"] == "stop"
    assert isinstance(json.loads(r.json()["response"])["name"], str)
    r = h.post("/api/generate", json={"model": MODEL, "prompt": "Give a JSON object.", "format": "json",
                                      "stream": False, "options": {"num_predict": 5}})
    assert r.status_code == 200 and r.json()["response"].lstrip().startswith("{")
    e = h.post("/api/embed", json={"model": MODEL, "input": ["a", "b", "c"]}).json()
    assert len(e["embeddings"]) == 3 and len(e["embeddings"][0]) == 576
    legacy = h.post("/api/embeddings", json={"model": MODEL, "prompt": "a"}).json()["embedding"]
    assert legacy == pytest.approx(e["embeddings"][0], abs=1e-4)


def test_ps_shows_backend_and_reason(daemon_a):
    models = daemon_a.wait_ps(lambda ms: any(m["name"] == MODEL for m in ms))
    m = next(m for m in models if m["name"] == MODEL)
    assert m["backend"] == "llama.cpp" and m["processor"] == "100% CPU"
    assert "CPU" in m["reason"] and m["size"] > 0 and m["expires_at"]
    assert m["details"]["family"] == "llama"


def test_concurrent_chats_rounds(daemon_a):
    """NUM_PARALLEL+1 concurrent chats x 3 rounds: all complete, nothing hangs."""
    def one(i: int) -> str:
        r = daemon_a.http.post("/api/chat", json={"model": MODEL, "messages": [{"role": "user", "content": f"Say {i}"}],
                                                  "stream": False, "options": {"num_predict": 6}})
        assert r.status_code == 200, r.text
        return r.json()["done_reason"]

    with ThreadPoolExecutor(3) as ex:
        for _ in range(3):
            assert all(x in ("stop", "length") for x in ex.map(one, range(3)))


# -- daemon B: slots, queue, eviction, keep_alive ----------------------------------------------------
# Requests that hold a slot for a while: ignore_eos makes the length exact (a grammar forcing a long
# answer did too, but llama.cpp's grammar sampling can take seconds per token on a busy machine).
def _long_stream(d: Daemon, started: threading.Event | None = None, out: list | None = None):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell a story."}], "stream": True,
            "max_tokens": 180, "ignore_eos": True, "temperature": 0.5}
    with httpx.Client(base_url=d.url, timeout=300) as c, c.stream("POST", "/v1/chat/completions", json=body) as r:
        if started:
            started.set()
        lines = [x for x in r.iter_lines() if x.startswith("data: ")]
    if out is not None:
        out.append((r.status_code, lines[-1] if lines else None))


def test_disconnect_frees_slot(daemon_b):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell a story."}], "stream": True,
            "max_tokens": 400, "ignore_eos": True}
    with httpx.Client(base_url=daemon_b.url, timeout=60) as c:
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            it = r.iter_lines()
            next(it), next(it)  # two tokens arrived: the only slot is busy
            assert daemon_b.ps()[0]["active"] == 1
        # the client went away mid-stream
    daemon_b.wait_ps(lambda ms: ms and ms[0]["active"] == 0, timeout=10)
    t0 = time.monotonic()
    r = daemon_b.http.post("/api/chat", json={"model": MODEL, "messages": CHAT, "stream": False,
                                              "options": {"num_predict": 3}})
    assert r.status_code == 200 and r.json()["done"] and time.monotonic() - t0 < 30


def test_disconnect_mid_non_stream_aborts(daemon_b):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell a story."}], "stream": False,
            "max_tokens": 1500, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(daemon_b.url + "/v1/chat/completions", json=body, timeout=httpx.Timeout(60, read=1.5))
    t0 = time.monotonic()
    daemon_b.wait_ps(lambda ms: ms and ms[0]["active"] == 0, timeout=10)  # aborted, not run to the end
    assert time.monotonic() - t0 < 5


def test_queue_overflow_503(daemon_b):
    results: list = []
    t1 = threading.Thread(target=_long_stream, args=(daemon_b, None, results))
    t1.start()
    daemon_b.wait_ps(lambda ms: ms and ms[0]["active"] == 1)
    t2 = threading.Thread(target=_long_stream, args=(daemon_b, None, results))
    t2.start()
    daemon_b.wait_ps(lambda ms: ms and ms[0]["waiting"] == 1)
    r = daemon_b.http.post("/api/chat", json={"model": MODEL, "messages": CHAT, "stream": False})
    assert r.status_code == 503 and int(r.headers["Retry-After"]) >= 1 and "LOCALRUN_MAX_QUEUE" in r.json()["error"]
    r = daemon_b.http.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT})
    assert r.status_code == 503 and r.json()["error"]["message"]
    t1.join(240)
    t2.join(240)
    assert len(results) == 2 and all(code == 200 and last == "data: [DONE]" for code, last in results), results


def test_second_model_evicts_first_and_keep_alive_zero(daemon_b):
    h = daemon_b.http
    h.post("/api/generate", json={"model": MODEL}).raise_for_status()  # load only
    assert [m["name"] for m in daemon_b.ps()] == [MODEL]
    modelfile = f"FROM {MODEL}\nSYSTEM You answer in one word.\nPARAMETER temperature 0\n"
    with h.stream("POST", "/api/create", json={"model": "oneword:latest", "modelfile": modelfile}) as r:
        events = [json.loads(x) for x in r.iter_lines() if x.strip()]
    assert r.status_code == 200 and events[-1]["status"] == "success", events
    r = h.post("/api/chat", json={"model": "oneword", "messages": CHAT, "stream": False, "options": {"num_predict": 4}})
    assert r.status_code == 200, r.text
    assert [m["name"] for m in daemon_b.ps()] == ["oneword:latest"]  # LOCALRUN_MAX_LOADED_MODELS=1: first evicted
    r = h.post("/api/chat", json={"model": "oneword", "messages": CHAT, "stream": False, "keep_alive": 0,
                                  "options": {"num_predict": 2}})
    assert r.status_code == 200
    daemon_b.wait_ps(lambda ms: ms == [], timeout=10)  # keep_alive 0 unloads after the request
    h.post("/api/generate", json={"model": MODEL, "keep_alive": "1m"}).raise_for_status()
    assert daemon_b.ps()[0]["name"] == MODEL
    r = h.post("/api/generate", json={"model": MODEL, "keep_alive": 0})  # Ollama's `stop`
    assert r.status_code == 200 and r.json()["done_reason"] == "unload" and daemon_b.ps() == []
    r = h.post("/api/chat", json={"model": MODEL, "messages": CHAT, "stream": False, "keep_alive": "1s",
                                  "options": {"num_predict": 2}})
    assert r.status_code == 200 and daemon_b.ps()[0]["name"] == MODEL
    daemon_b.wait_ps(lambda ms: ms == [], timeout=10)  # the idle reaper unloads after keep_alive
    assert h.request("DELETE", "/api/delete", json={"model": "oneword"}).status_code == 200
    assert h.post("/api/show", json={"model": "oneword"}).status_code == 404


TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nYou may call a tool. Reply with <tool_call>{\"name\": ..., \"arguments\": ...}"
    "</tool_call>. Tools:\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "<|im_start|>assistant\n"
)
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                             "parameters": {"type": "object", "properties": {"city": {"type": "string",
                                                                                                     "maxLength": 20}},
                                                            "required": ["city"]}}}


def test_tools_and_tool_choice(daemon_a, oai):
    import openai

    # SmolLM2's own template never renders tools: the generic tool format stands in (LOCALRUN_GENERIC_TOOLS,
    # on by default; with it off this is a 400, tests/test_anthropic.py)
    r = oai.chat.completions.create(model=MODEL, messages=CHAT, tools=[WEATHER], max_tokens=40, temperature=0,
                                    tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert r.choices[0].finish_reason == "tool_calls", r.choices[0]
    assert r.choices[0].message.tool_calls[0].function.name == "get_weather"
    modelfile = f'FROM {MODEL}\nTEMPLATE """{TOOLS_TEMPLATE}"""\n'
    with daemon_a.http.stream("POST", "/api/create", json={"model": "toolsmol", "modelfile": modelfile}) as r:
        assert [json.loads(x) for x in r.iter_lines() if x.strip()][-1]["status"] == "success"
    r = oai.chat.completions.create(model="toolsmol", messages=[{"role": "user", "content": "Weather in Paris?"}],
                                    tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                    max_tokens=40, temperature=0)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls", ch
    call = ch.message.tool_calls[0]
    assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments)["city"], str)
    # the tool's answer goes back in the conversation and renders
    r = oai.chat.completions.create(model="toolsmol", tools=[WEATHER], tool_choice="none", max_tokens=4, messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"}])
    assert r.choices[0].finish_reason in ("stop", "length")
    r = daemon_a.http.post("/api/chat", json={"model": "toolsmol", "messages": CHAT, "tools": [WEATHER], "stream": False,
                                              "options": {"num_predict": 8}})
    assert r.status_code == 200 and r.json()["done"]


def test_ollama_sdk_and_langchain_against_the_real_model(daemon_a):
    """The SDKs users point at Ollama/OpenAI servers work by changing only the base URL (and key)."""
    import ollama
    from langchain_ollama import ChatOllama
    from langchain_openai import ChatOpenAI

    auth = {"Authorization": f"Bearer {KEY}"}
    client = ollama.Client(host=daemon_a.url, headers=auth)
    r = client.chat(model=MODEL, messages=CHAT, options={"num_predict": 8, "temperature": 0})
    assert r.message.content and r.done and r.eval_count <= 8
    text = "".join(c.message.content for c in client.chat(model=MODEL, messages=CHAT, stream=True,
                                                            options={"num_predict": 8, "temperature": 0}))
    assert text == r.message.content
    assert len(client.embed(model=MODEL, input="hello").embeddings[0]) == 576
    with pytest.raises(ollama.ResponseError) as e:  # no registry: a clear 501, not "no such endpoint"
        client.push(MODEL)
    assert e.value.status_code == 501 and "does not push models to a registry" in e.value.error
    lc_ollama = ChatOllama(base_url=daemon_a.url, model=MODEL, num_predict=8, temperature=0,
                           client_kwargs={"headers": auth})
    assert lc_ollama.invoke("What is the capital of France?").content == r.message.content
    lc_openai = ChatOpenAI(base_url=daemon_a.url + "/v1", api_key=KEY, model=MODEL, max_tokens=8, temperature=0,
                           max_retries=0)
    assert lc_openai.invoke("What is the capital of France?").content == r.message.content


def test_ollama_generate_continues_from_an_earlier_answers_context(daemon_a):
    """Ollama's /api/generate `context` (deprecated there, still sent by older clients and the SDK's
    generate(context=...)): the earlier prompt and answer come before the new prompt, token for token,
    as the returned context shows; before, it was silently dropped."""
    import ollama

    client = ollama.Client(host=daemon_a.url, headers={"Authorization": f"Bearer {KEY}"})
    opts = {"num_predict": 6, "temperature": 0}
    first = client.generate(model=MODEL, prompt="My name is Ada.", options=opts)
    assert first.context and len(first.context) == first.prompt_eval_count + first.eval_count
    alone = client.generate(model=MODEL, prompt="What is my name?", options=opts)
    after = client.generate(model=MODEL, prompt="What is my name?", context=first.context, options=opts)
    assert after.context[:len(first.context)] == first.context  # the earlier turn, then this one
    assert after.prompt_eval_count == len(first.context) + alone.prompt_eval_count, (after, alone)
    assert after.context[len(first.context):after.prompt_eval_count] == alone.context[:alone.prompt_eval_count]
    streamed = list(client.generate(model=MODEL, prompt="What is my name?", context=first.context, options=opts,
                                    stream=True))
    assert "".join(s.response for s in streamed) == after.response and streamed[-1].context == after.context
    for bad, words in (([1, "2"], "array of token ids"), ("1 2", "array of token ids"), ([1, True], "array of token ids"),
                       ([10_000_000], "not in this model's vocabulary"), ([1], "cannot be combined")):
        body = {"model": MODEL, "prompt": "hi", "context": bad, "stream": False, "options": opts}
        r = daemon_a.http.post("/api/generate", json={**body, **({"suffix": "x"} if bad == [1] else {})})
        assert r.status_code == 400 and words in r.json()["error"], r.text


def test_ollama_load_options_in_a_request_reload_the_model(daemon_b):
    """Ollama's per-request num_thread / num_gpu (Open WebUI's advanced parameters send them) decide how
    the model is loaded: other values than the loaded model's reload it, as Ollama does; the same
    values again do not; leaving them out goes back to the daemon's own choice. Before, they were
    silently ignored."""
    def generate(**options):
        r = daemon_b.http.post("/api/generate", json={"model": MODEL, "prompt": "Hi", "stream": False,
                                                      "options": {"num_predict": 2, **options}})
        assert r.status_code == 200, r.text
        (m,) = daemon_b.ps()
        return m["reason"]

    def reloads() -> int:
        return daemon_b.log.read_text(errors="replace").count(f"reloading {MODEL}")

    def threads(reason: str) -> str:
        return re.search(r"(\d+) threads", reason).group(1)

    auto = threads(generate())
    n = reloads()
    assert threads(generate(num_thread=3)) == "3" and reloads() == n + 1
    assert threads(generate(num_thread=3)) == "3" and reloads() == n + 1  # the same: no reload
    assert threads(generate()) == auto and reloads() == n + 2
    assert "load options {'num_thread': 3} -> none" in daemon_b.log.read_text(errors="replace")
    for bad in ({"num_thread": "2"}, {"num_thread": -3}, {"num_gpu": 5000}, {"num_thread": True}):
        r = daemon_b.http.post("/api/generate", json={"model": MODEL, "prompt": "Hi", "stream": False,
                                                      "options": {"num_predict": 2, **bad}})
        assert r.status_code == 400 and next(iter(bad)) in r.json()["error"], r.text
    assert reloads() == n + 2


def test_an_anthropic_prefill_is_continued_by_the_real_model(daemon_a, smollm2_gguf):
    """The anthropic SDK with a final assistant turn: SmolLM2 goes on from its text, exactly as a raw
    completion of the chat's prompt (a new assistant turn opened) followed by that text does."""
    import anthropic

    from localrun.templates.chat import render_chat
    from localrun.library import read_gguf_info

    prefix = "The capital of France is"
    client = anthropic.Anthropic(base_url=daemon_a.url, api_key=KEY, max_retries=0)
    r = client.messages.create(model=MODEL, max_tokens=8, extra_body={"temperature": 0}, messages=[
        *CHAT, {"role": "assistant", "content": prefix}])
    prompt = render_chat(read_gguf_info(smollm2_gguf).chat_template, CHAT) + prefix
    raw = daemon_a.http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 8,
                                                     "temperature": 0}).json()
    assert r.content[0].text == raw["choices"][0]["text"] and r.content[0].text.strip(), (r, raw)
    # Anthropic counts a cached prefix apart from the rest
    assert r.usage.input_tokens + r.usage.cache_read_input_tokens == raw["usage"]["prompt_tokens"]


def test_ollama_embed_truncates_long_inputs_as_ollama_does(daemon_b):
    """Ollama's /api/embed (and /api/embeddings) cut an input to the model's embedding window unless
    truncate is false (RAG clients send long chunks); OpenAI's route refuses it, with OpenAI's code."""
    d = daemon_b
    long = "The quick brown fox jumps over the lazy dog. " * 120  # ~1,300 tokens; the window is 1,024
    r = d.http.post("/api/embed", json={"model": MODEL, "input": [long, long + "Unrelated words at the end. " * 40]})
    assert r.status_code == 200, r.text
    a, b = r.json()["embeddings"]
    assert a == b  # only the first 1,024 tokens count: what follows the cut changes nothing
    assert r.json()["prompt_eval_count"] == 2 * 1024
    short = d.http.post("/api/embed", json={"model": MODEL, "input": "The quick brown fox."}).json()["embeddings"][0]
    assert short != a
    legacy = d.http.post("/api/embeddings", json={"model": MODEL, "prompt": long})
    assert legacy.status_code == 200 and legacy.json()["embedding"] == a
    r = d.http.post("/api/embed", json={"model": MODEL, "input": long, "truncate": False})
    assert r.status_code == 400 and "longer than the embedding window of 1024 tokens" in r.json()["error"], r.text
    r = d.http.post("/v1/embeddings", json={"model": MODEL, "input": long})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    r = d.http.post("/api/embed", json={"model": MODEL, "input": long, "truncate": "no"})
    assert r.status_code == 400 and "'truncate' must be true or false" in r.text


def test_ollama_logprobs_on_chat_and_generate(daemon_a):
    """Ollama's top-level logprobs / top_logprobs: each generated token with its log-probability and
    alternatives, streamed or not, the same numbers the OpenAI route gives for the same prompt."""
    d, prompt = daemon_a, "The capital of France is"
    r = d.http.post("/api/generate", json={"model": MODEL, "prompt": prompt, "raw": True, "stream": False,
                                           "logprobs": True, "top_logprobs": 2,
                                           "options": {"temperature": 0, "num_predict": 5}})
    assert r.status_code == 200, r.text
    body = r.json()
    lps = body["logprobs"]
    assert len(lps) == body["eval_count"] == 5 and "".join(x["token"] for x in lps) == body["response"]
    for x in lps:
        assert x["logprob"] <= 0 and len(x["top_logprobs"]) == 2 and x["top_logprobs"][0]["token"] == x["token"]
        assert x["bytes"] == list(x["token"].encode())
    oai = d.http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 5, "temperature": 0,
                                               "logprobs": 2}).json()["choices"][0]["logprobs"]
    assert oai["tokens"] == [x["token"] for x in lps]
    assert oai["token_logprobs"] == pytest.approx([x["logprob"] for x in lps], abs=1e-4)
    lines = []
    with d.http.stream("POST", "/api/chat", json={"model": MODEL, "messages": CHAT, "logprobs": True,
                                                  "options": {"temperature": 0, "num_predict": 6}}) as s:
        assert s.status_code == 200
        lines = [json.loads(x) for x in s.iter_lines() if x.strip()]
    text = "".join(x["message"]["content"] for x in lines)
    streamed = [lp for x in lines for lp in x.get("logprobs") or []]
    assert "".join(x["token"] for x in streamed) == text and len(streamed) == lines[-1]["eval_count"]
    assert all(x["top_logprobs"] == [] for x in streamed)
    plain = d.http.post("/api/chat", json={"model": MODEL, "messages": CHAT, "stream": False,
                                           "options": {"num_predict": 2}}).json()
    assert "logprobs" not in plain
    bad = d.http.post("/api/chat", json={"model": MODEL, "messages": CHAT, "top_logprobs": 3})
    assert bad.status_code == 400 and "needs 'logprobs': true" in bad.text


def test_create_fields_are_stored_exactly_as_sent(daemon_a):
    """/api/create's JSON fields (the ollama SDK's create(from_=, system=, parameters=, messages=)) are
    values, not Modelfile text: quotes, \"\"\", leading spaces and line breaks come back from /api/show as
    sent; a parameter every later request would refuse is refused here, and a key cannot add a line."""
    import ollama

    client = ollama.Client(host=daemon_a.url, headers=daemon_a.headers())
    system = 'Always answer "yes"\n\"\"\"a docstring\"\"\" '
    stops = ["\n\n", " Assistant:", '"quoted"', '"""']
    message = 'He said "hi" \"\"\" and left '
    try:
        client.create(model="fields", from_=MODEL, system=system, parameters={"stop": stops, "temperature": 5,
                                                                             "num_ctx": 512},
                      messages=[{"role": "user", "content": message}, {"role": "assistant", "content": " ok"}])
        shown = daemon_a.http.post("/api/show", json={"model": "fields"}).json()
        assert shown["system"] == system
        assert shown["messages"] == [{"role": "user", "content": message}, {"role": "assistant", "content": " ok"}]
        mf = shown["modelfile"]
        from localrun.library.modelfile import parse_modelfile

        assert parse_modelfile(mf).parameters == {"stop": stops, "temperature": 5.0, "num_ctx": 512}
        # a Modelfile temperature of 5 (Ollama caps none) is one a request takes too
        r = daemon_a.http.post("/api/generate", json={"model": "fields", "prompt": "hi", "stream": False,
                                                      "options": {"num_predict": 2, "temperature": 5}})
        assert r.status_code == 200, r.text
    finally:
        daemon_a.http.request("DELETE", "/api/delete", json={"model": "fields"})
    for fields, word in [({"parameters": {"num_ctx": 2}}, "num_ctx"),
                         ({"parameters": {"num_ctx": [512, 1024]}}, "one value"),
                         ({"parameters": {"temperature 1\nADAPTER /etc/passwd": 1}}, "unknown parameter"),
                         ({"parameters": {"stop": {"a": 1}}}, "stop"),
                         ({"from": MODEL + "\nADAPTER /etc/passwd"}, "line break"),
                         ({"messages": [{"role": "robot", "content": "x"}]}, "role"),
                         ({"system": 5}, "system")]:
        r = daemon_a.http.post("/api/create", json={"model": "badfields", "from": MODEL, **fields, "stream": False})
        assert r.status_code == 400 and word in r.json()["error"], (fields, r.text)
        assert daemon_a.http.post("/api/show", json={"model": "badfields"}).status_code == 404
    # the Modelfile's ranges are the requests' own: a num_ctx no request could run is refused at create
    r = daemon_a.http.post("/api/create", json={"model": "badfields", "stream": False,
                                                "modelfile": f"FROM {MODEL}\nPARAMETER num_ctx 2\n"})
    assert r.status_code == 400 and "num_ctx" in r.json()["error"], r.text
    for empty in ("", "\ufeff# nothing but a comment\n"):  # (`localrun create x -f empty`): the parser's own words
        r = daemon_a.http.post("/api/create", json={"model": "badfields", "stream": False, "modelfile": empty})
        assert r.status_code == 400 and "no FROM line" in r.json()["error"], r.text


def test_deleting_a_model_in_use_answers_at_once_and_it_unloads_after(daemon_a):
    """DELETE while the model streams (and while it loads) answers at once, as Ollama's does; the stream
    finishes; the runner unloads when its requests end and no later request loads the deleted name. It
    used to wait for the stream, and a request that came meanwhile loaded it again for good (keep_alive -1),
    a runner no name could unload."""
    h = daemon_a.http
    for name in ("victim", "victim2"):
        assert h.post("/api/copy", json={"source": MODEL, "destination": name}).status_code == 200
    body = {"model": "victim", "prompt": "Count from one to fifty:", "keep_alive": -1,
            "options": {"num_predict": 40, "temperature": 0}}
    with h.stream("POST", "/api/generate", json=body) as s:
        lines = s.iter_lines()
        first = json.loads(next(lines))
        assert first["done"] is False
        t0 = time.monotonic()
        assert h.request("DELETE", "/api/delete", json={"model": "victim"}).status_code == 200
        took = time.monotonic() - t0
        later = h.post("/api/generate", json={**body, "options": {"num_predict": 2}})
        assert later.status_code == 404, later.text
        rest = [json.loads(x) for x in lines if x]
    assert rest[-1]["done"] is True and rest[-1]["eval_count"] == 40  # the stream ran to its end
    assert took < 5, took  # not behind the stream's ~40 tokens
    daemon_a.wait_ps(lambda ms: all(m["name"] != "victim:latest" for m in ms), timeout=30)

    # deleted while its first request loads it: that request is served, then the runner goes
    result: dict = {}
    t = threading.Thread(target=lambda: result.update(r=h.post("/api/generate", json={
        **body, "model": "victim2", "stream": False, "options": {"num_predict": 2}})))
    t.start()
    daemon_a.wait_ps(lambda ms: True, timeout=5)
    time.sleep(0.2)
    assert h.request("DELETE", "/api/delete", json={"model": "victim2"}).status_code == 200
    t.join(120)
    assert result["r"].status_code in (200, 404), result["r"].text  # (404: it had not resolved the name yet)
    daemon_a.wait_ps(lambda ms: all(m["name"] != "victim2:latest" for m in ms), timeout=30)
    assert h.post("/api/show", json={"model": "victim2"}).status_code == 404


def test_ollama_heads_empty_embeddings_and_raw_mode(daemon_a):
    """As Ollama answers them: HEAD on /api/version and /api/tags (health checks); an empty input to
    /api/embed (and an empty prompt to /api/embeddings) is an empty list, the model loaded; a list
    prompt on the one-text endpoint is a 400, not its first text's vector; raw mode with a system,
    template or context is a 400, and a raw answer carries no context."""
    h = daemon_a.http
    for path in ("/api/version", "/api/tags"):
        r = h.request("HEAD", path)
        assert r.status_code == 200 and r.content == b"", (path, r.status_code)
    for body in ({"input": []}, {"input": ""}, {}):  # (no input at all: Ollama's way to load an embedder)
        r = h.post("/api/embed", json={"model": MODEL, **body})
        assert r.status_code == 200 and r.json()["embeddings"] == [], r.text
    assert h.post("/api/embeddings", json={"model": MODEL, "prompt": ""}).json() == {"embedding": []}
    r = h.post("/api/embeddings", json={"model": MODEL, "prompt": ["a", "b"]})
    assert r.status_code == 400 and "/api/embed" in r.json()["error"], r.text
    assert h.post("/api/embed", json={"model": MODEL, "input": ["a", ""]}).status_code == 400
    base = {"model": MODEL, "prompt": "<|im_start|>user\nhi<|im_end|>\n", "raw": True, "stream": False,
            "options": {"num_predict": 2}}
    for extra in ({"system": "be a pirate"}, {"template": "{{ .Prompt }}"}, {"context": [1, 2]}):
        r = h.post("/api/generate", json={**base, **extra})
        assert r.status_code == 400 and "raw mode does not support" in r.json()["error"], (extra, r.text)
    r = h.post("/api/generate", json=base)
    assert r.status_code == 200 and "context" not in r.json(), r.text
    r = h.post("/api/generate", json={**base, "raw": False, "prompt": "hi"})
    assert r.status_code == 200 and r.json()["context"], r.text


@pytest.mark.parametrize("route", ["/v1/messages", "/v1/responses"])
def test_a_streamed_request_abandoned_in_the_queue_is_cancelled(daemon_b, route):
    """Anthropic's and the Responses API's streams, given up by their client while they wait for the only
    slot (Claude Code's Esc, an SDK timeout): the daemon lets them go at once, as the other routes do;
    they used to hold their queue place (MAX_QUEUE=1: the next client got a 529/503) until served."""
    long = {"model": MODEL, "messages": [{"role": "user", "content": "Tell a story."}], "stream": True,
            "max_tokens": 900, "ignore_eos": True}
    with httpx.Client(base_url=daemon_b.url, timeout=60) as c, c.stream("POST", "/v1/chat/completions", json=long) as r:
        lines = r.iter_lines()
        next(lines), next(lines)  # the only slot is taken, for 900 tokens
        body = ({"model": MODEL, "max_tokens": 8, "stream": True, "messages": CHAT} if route == "/v1/messages" else
                {"model": MODEL, "max_output_tokens": 16, "stream": True, "input": "hi"})
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(daemon_b.url + route, json=body, timeout=httpx.Timeout(60, read=1.0))
        # gone from the queue while the long stream still runs: not waiting to be served
        ms = daemon_b.wait_ps(lambda ms: ms and ms[0]["waiting"] == 0, timeout=3)
        assert ms[0]["active"] == 1
    daemon_b.wait_ps(lambda ms: ms and ms[0]["active"] == 0, timeout=10)


def test_a_forced_tool_call_cut_by_max_tokens_is_no_text(daemon_a, oai):
    """tool_choice any / required, max_tokens too small for the call: the answer is cut (max_tokens,
    length) with no text block: the grammar's {name, arguments} wrapper used to come back as the text."""
    import anthropic

    tool = {"name": "get_weather", "description": "The weather in a city",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
    client = anthropic.Anthropic(base_url=daemon_a.url, api_key=KEY, max_retries=0)
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    whole = client.messages.create(model=MODEL, max_tokens=64, tools=[tool], tool_choice={"type": "any"},
                                   messages=ask, extra_body={"temperature": 0})
    assert whole.stop_reason == "tool_use" and [b.type for b in whole.content] == ["tool_use"]
    for max_tokens in (3, 8, 12):
        r = client.messages.create(model=MODEL, max_tokens=max_tokens, tools=[tool], tool_choice={"type": "any"},
                                   messages=ask, extra_body={"temperature": 0})
        assert r.stop_reason == "max_tokens" and r.content == [], (max_tokens, r.content)
        with client.messages.stream(model=MODEL, max_tokens=max_tokens, tools=[tool], tool_choice={"type": "any"},
                                    messages=ask, extra_body={"temperature": 0}) as s:
            final = s.get_final_message()
        assert final.stop_reason == "max_tokens" and final.content == [], final.content
    fn = {"type": "function", "function": {"name": "get_weather", "parameters": tool["input_schema"]}}
    r = oai.chat.completions.create(model=MODEL, messages=ask, tools=[fn], tool_choice="required", max_tokens=8,
                                    temperature=0)
    assert r.choices[0].finish_reason == "length" and not r.choices[0].message.content, r.choices[0]


def test_openai_refuses_what_it_cannot_honour(daemon_a, oai):
    """What used to be answered silently wrong, refused as OpenAI refuses it: a forced tool call with no
    tools (it was answered with text), embeddings of more dimensions than the model has (the model's
    size came back), and a response id localrun could not have made is a 404 (NotFoundError), as an
    unknown well-formed one is."""
    import openai

    with pytest.raises(openai.BadRequestError, match="needs 'tools'"):
        oai.chat.completions.create(model=MODEL, messages=CHAT, tool_choice="required", max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="needs 'tools'"):
        oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4,
                                    tool_choice={"type": "function", "function": {"name": "f"}})
    r = oai.chat.completions.create(model=MODEL, messages=CHAT, tool_choice="none", max_tokens=2)
    assert r.choices[0].message.content is not None
    size = len(oai.embeddings.create(model=MODEL, input="hi").data[0].embedding)
    assert len(oai.embeddings.create(model=MODEL, input="hi", dimensions=size).data[0].embedding) == size
    with pytest.raises(openai.BadRequestError, match=f"have {size}"):
        oai.embeddings.create(model=MODEL, input="hi", dimensions=size + 1)
    for rid in ("resp_nope", "resp_" + "0" * 32):
        with pytest.raises(openai.NotFoundError):
            oai.responses.retrieve(rid)
        with pytest.raises(openai.NotFoundError):
            oai.responses.delete(rid)


def test_anthropic_message_start_splits_the_prompt_as_the_end_does(daemon_a):
    """A stream's message_start usage says what message_delta's does of the prompt: the cached part as
    cache_read_input_tokens (it said all of it was input and none cached, so a client adding the two
    counted the cached tokens twice)."""
    body = {"model": MODEL, "max_tokens": 4, "stream": True, "temperature": 0,
            "system": "You are a terse assistant. " * 20, "messages": [{"role": "user", "content": "Say hello"}]}
    for _ in range(2):  # the second finds the first's prompt in the prefix cache
        with daemon_a.http.stream("POST", "/v1/messages", json=body) as r:
            events = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: ")]
        start = events[0]["message"]["usage"]
        end = next(e for e in events if e["type"] == "message_delta")["usage"]
        keys = ("input_tokens", "cache_read_input_tokens")
        assert [start[k] for k in keys] == [end[k] for k in keys], (start, end)
    assert start["cache_read_input_tokens"] > 100, start


def test_a_json_schemas_number_bounds_hold(oai):
    """response_format json_schema (strict) with a number's minimum / maximum: every sampled answer keeps
    them (llama.cpp's grammar converter keeps any number: 4 of 6 seeds came back out of bounds, as 50 or
    123 against a maximum of 10; such schemas now go to llguidance, which follows the bounds, its numbers
    cut at 9 fraction digits: unbounded, a sampled model wrote hundreds until max_tokens)."""
    schema = {"type": "object", "additionalProperties": False, "required": ["n", "scores"],
              "properties": {"n": {"type": "number", "minimum": 0.5, "maximum": 10},
                             "scores": {"type": "array", "minItems": 1, "maxItems": 3,
                                        "items": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}}}}
    whole = 0
    for seed in range(6):
        r = oai.chat.completions.create(
            model=MODEL, max_tokens=80, temperature=1, seed=seed,
            messages=[{"role": "user", "content": "Give a big number like 500 and some scores, in JSON"}],
            response_format={"type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": schema}})
        ch = r.choices[0]
        if ch.finish_reason == "length":  # (cut: not whole JSON; the bounds of what came are not checked)
            continue
        out = json.loads(ch.message.content)
        assert 0.5 <= out["n"] <= 10 and 1 <= len(out["scores"]) <= 3, out
        assert all(0 < s < 1 for s in out["scores"]), out
        whole += 1
    assert whole >= 4, whole  # (numbers have 9 fraction digits at most: answers end)
    with pytest.raises(Exception, match="invalid JSON schema|400"):
        oai.chat.completions.create(
            model=MODEL, max_tokens=8, messages=CHAT, response_format={"type": "json_schema", "json_schema": {
                "name": "x", "schema": {"type": "number", "minimum": 5, "maximum": "ten"}}})


def test_logprob_bytes_are_the_tokens_own(oai, daemon_a):
    """Chat logprobs' `bytes` are each token's UTF-8 bytes, so byte-fallback tokens that are parts of one
    character (SmolLM2 writes emoji so) join back into the text (OpenAI's documented use); they were
    U+FFFD's bytes for each such part. The same through Ollama's logprobs and for the alternatives."""
    ask = [{"role": "user", "content": "Reply only with many emojis: 🌟🌌🌍✏️🌍⏰🎉🐱"}]
    r = oai.chat.completions.create(model=MODEL, messages=ask, max_tokens=12, temperature=0, logprobs=True,
                                    top_logprobs=3)
    lps = r.choices[0].logprobs.content
    joined = b"".join(bytes(x.bytes) for x in lps)
    assert joined.decode("utf-8", "replace") == r.choices[0].message.content, (joined, r.choices[0].message.content)
    parts = [x for x in lps if x.token == "\ufffd"]
    assert parts and all(bytes(x.bytes) != "\ufffd".encode() for x in parts), [(x.token, x.bytes) for x in lps]
    assert all(bytes(t.bytes) != "\ufffd".encode() for x in lps for t in x.top_logprobs)
    o = daemon_a.http.post("/api/chat", json={"model": MODEL, "messages": ask, "stream": False, "logprobs": True,
                                              "options": {"num_predict": 12, "temperature": 0}}).json()
    assert [x["bytes"] for x in o["logprobs"]] == [x.bytes for x in lps]


def test_an_abandoned_embedding_batch_stops_and_big_batches_are_taken(daemon_a):
    """A client that gives a big embedding batch up (a RAG ingest cancelled) frees the model's embedder
    before its next pass: the next small request answers at once (it waited for the whole abandoned batch,
    ~1 min on 2 cores). Batches up to OpenAI's 2,048 inputs are taken (LangChain's embedders send 1,000
    documents at once; the limit was 256); token ids get a 400 that says what to send."""
    big = {"model": MODEL, "input": ["word " * 500] * 16}
    for path in ("/v1/embeddings", "/api/embed"):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(daemon_a.url + path, json=big, headers=daemon_a.headers(), timeout=httpx.Timeout(60, read=1.0))
        t0 = time.monotonic()
        r = daemon_a.http.post(path, json={"model": MODEL, "input": "hi"})
        assert r.status_code == 200 and time.monotonic() - t0 < 8, (path, time.monotonic() - t0)
    r = daemon_a.http.post("/v1/embeddings", json={"model": MODEL, "input": [f"doc {i}" for i in range(300)]})
    assert r.status_code == 200 and len(r.json()["data"]) == 300, r.text[:300]
    r = daemon_a.http.post("/v1/embeddings", json={"model": MODEL, "input": [f"d{i}" for i in range(2049)]})
    assert r.status_code == 400 and "in batches" in r.json()["error"]["message"]
    r = daemon_a.http.post("/v1/embeddings", json={"model": MODEL, "input": [[1, 2, 3]]})
    assert r.status_code == 400 and "check_embedding_ctx_length" in r.json()["error"]["message"]
