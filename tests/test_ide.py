"""IDE plugins against the real daemon: fill in the middle on Ollama's /api/generate (suffix), OpenAI's
/v1/completions (suffix) and llama-server's /infill, on the tiny FIM model (tests/fim_model.py), streamed and
not; greedy output on every route equals llama.cpp's own decoding of llama-server's infill layout; a model
without FIM tokens is a clear 400 on each route; and the handshakes GitHub Copilot Chat and Continue make,
replayed step by step as their sources send them."""

from __future__ import annotations

import json

import httpx
import pytest
from daemon import KEY, MODEL, Daemon
from fim_model import Reference

import localrun

pytestmark = pytest.mark.timeout(600)
pytest.importorskip("llama_cpp")

FIM = "tinyfim:latest"
N_CTX = 4096
N = 12
CASES = [("def add(a, b):\n    return ", "\n\nfor i in range(10):\n    print(i)\n"),
         ("class Point:\n    x = 0\n    ", "\nif x > 0:\n    y = x * 2\nelse:\n    y = -x\n")]


@pytest.fixture(scope="module")
def ref(fim_gguf):
    r = Reference(fim_gguf, N_CTX)
    yield r
    r.close()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, fim_gguf):
    d = Daemon(tmp_path_factory.mktemp("home_ide"), LOCALRUN_API_KEY=KEY, LOCALRUN_NUM_PARALLEL="2",
               LOCALRUN_CONTEXT_LENGTH=str(N_CTX), LOCALRUN_BACKEND="llamacpp", LOCALRUN_MAX_LOADED_MODELS="2")
    try:
        d.pull()
        r = d.http.post("/api/create", json={"model": FIM, "modelfile": f"FROM {fim_gguf}\n", "stream": False})
        assert r.status_code == 200, r.text
        yield d
    finally:
        d.stop()


@pytest.fixture(scope="module")
def llama_srv(llama_server_bin, fim_gguf):
    """llama.cpp's own llama-server on the same GGUF, one slot of the daemon's context, the same threads."""
    from llama_server import llama_server_client

    with llama_server_client(llama_server_bin, fim_gguf, N_CTX) as h:
        yield h


def _version_at_least(v: str, minimum: str) -> bool:
    """Copilot Chat's comparison (numeric, part by part)."""
    a, b = [int(x) for x in v.split(".")], [int(x) for x in minimum.split(".")]
    n = max(len(a), len(b))
    return (a + [0] * (n - len(a))) >= (b + [0] * (n - len(b)))


# -- fill in the middle: agreement with llama.cpp ---------------------------------------------------
def _expected(ref: Reference, prefix: str, suffix: str, **kw) -> tuple[list[int], str]:
    layout = ref.layout(prefix, suffix, **kw)
    return layout, ref.text(ref.greedy(layout, N))


def _ndjson(r: httpx.Response) -> list[dict]:
    return [json.loads(line) for line in r.iter_lines() if line.strip()]


def _sse(r: httpx.Response) -> list[dict]:
    out = []
    for line in r.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[6:]))
    return out


def test_every_route_agrees_with_llama_cpp_streamed_and_not(daemon, ref):
    h = daemon.http
    answers = []
    for prefix, suffix in CASES:
        layout, want = _expected(ref, prefix, suffix)
        # Ollama /api/generate with suffix (not streamed): the text, and `context` = the laid-out prompt + answer
        r = h.post("/api/generate", json={"model": FIM, "prompt": prefix, "suffix": suffix, "stream": False,
                                          "options": {"temperature": 0, "num_predict": N}})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["response"] == want and body["done"]
        assert body["context"][:len(layout)] == layout and body["prompt_eval_count"] == len(layout)
        assert ref.text(body["context"][len(layout):]).startswith(want)
        # streamed
        with h.stream("POST", "/api/generate", json={"model": FIM, "prompt": prefix, "suffix": suffix,
                                                     "options": {"temperature": 0, "num_predict": N}}) as s:
            lines = _ndjson(s)
        assert "".join(x["response"] for x in lines) == want and lines[-1]["done"]
        assert lines[-1]["context"][:len(layout)] == layout
        # OpenAI /v1/completions with suffix, not streamed and streamed
        r = h.post("/v1/completions", json={"model": FIM, "prompt": prefix, "suffix": suffix, "max_tokens": N,
                                            "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want
        assert r.json()["usage"]["prompt_tokens"] == len(layout)
        with h.stream("POST", "/v1/completions", json={"model": FIM, "prompt": prefix, "suffix": suffix,
                                                       "max_tokens": N, "temperature": 0, "stream": True}) as s:
            chunks = _sse(s)
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == want
        # llama-server's /infill, not streamed and streamed
        r = h.post("/infill", json={"model": FIM, "input_prefix": prefix, "input_suffix": suffix, "n_predict": N,
                                    "temperature": 0})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["content"] == want and body["stop"] is True
        assert body["tokens_evaluated"] == len(layout) and body["stop_type"] in ("eos", "limit")
        assert body["timings"]["predicted_n"] == body["tokens_predicted"]
        with h.stream("POST", "/infill", json={"model": FIM, "input_prefix": prefix, "input_suffix": suffix,
                                               "n_predict": N, "temperature": 0, "stream": True}) as s:
            events = _sse(s)
        assert "".join(e["content"] for e in events) == want
        assert events[-1]["stop"] is True and all(e["stop"] is False for e in events[:-1])
        answers.append((layout, want))
    # the suffix reaches the model: another suffix, another layout and another answer
    assert answers[0][0] != answers[1][0]
    _, other = _expected(ref, CASES[0][0], CASES[1][1])
    assert other != answers[0][1]
    r = h.post("/v1/completions", json={"model": FIM, "prompt": CASES[0][0], "suffix": CASES[1][1], "max_tokens": N,
                                        "temperature": 0})
    assert r.json()["choices"][0]["text"] == other


# other files' chunks: a few small ones, and more than the context leaves them (llama-server keeps their tail)
BIG_EXTRA = "".join(f"def helper_{i}(x):\n    return x * {i} + {i * 7}\n\n" for i in range(150))
EXTRAS = [[], [{"filename": "util.py", "text": "def sub(a, b):\n    return a - b\n"}, {"text": "import os\n"}],
          [{"filename": "helpers.py", "text": BIG_EXTRA}]]


def test_every_route_equals_llama_servers_infill(daemon, llama_srv):
    """The test of truth: greedy output of /api/generate (suffix), /v1/completions (suffix) and /infill, streamed
    and not, equals what llama.cpp's own llama-server answers on /infill for the same GGUF; the prompt's length
    equals llama-server's; and the answer changes with the suffix."""
    h = daemon.http
    seen: dict[tuple, str] = {}
    cases = [(p, s, []) for p, _ in CASES for _, s in CASES] + [(CASES[0][0], CASES[0][1], e) for e in EXTRAS[1:]]
    for prefix, suffix, extra in cases:
        body = {"input_prefix": prefix, "input_suffix": suffix, "input_extra": extra, "n_predict": N,
                "temperature": 0, "cache_prompt": True}
        r = llama_srv.post("/infill", json=body)
        assert r.status_code == 200, r.text
        truth = r.json()
        want, n_prompt = truth["content"], truth["tokens_evaluated"]
        seen[(prefix, suffix, len(extra))] = want
        with llama_srv.stream("POST", "/infill", json={**body, "stream": True}) as s:
            want_streamed = "".join(e["content"] for e in _sse(s))
        # /infill
        r = h.post("/infill", json={"model": FIM, **body})
        assert r.status_code == 200, r.text
        assert (r.json()["content"], r.json()["tokens_evaluated"]) == (want, n_prompt), (prefix, suffix, len(extra))
        with h.stream("POST", "/infill", json={"model": FIM, **body, "stream": True}) as s:
            assert "".join(e["content"] for e in _sse(s)) == want_streamed
        if extra:
            continue  # Ollama's and OpenAI's requests carry no other files
        # Ollama /api/generate with suffix
        gen = {"model": FIM, "prompt": prefix, "suffix": suffix, "options": {"temperature": 0, "num_predict": N}}
        r = h.post("/api/generate", json={**gen, "stream": False})
        assert r.status_code == 200, r.text
        assert (r.json()["response"], r.json()["prompt_eval_count"]) == (want, n_prompt)
        with h.stream("POST", "/api/generate", json=gen) as s:
            assert "".join(x["response"] for x in _ndjson(s)) == want
        # OpenAI /v1/completions with suffix
        comp = {"model": FIM, "prompt": prefix, "suffix": suffix, "max_tokens": N, "temperature": 0}
        r = h.post("/v1/completions", json=comp)
        assert r.status_code == 200, r.text
        assert (r.json()["choices"][0]["text"], r.json()["usage"]["prompt_tokens"]) == (want, n_prompt)
        with h.stream("POST", "/v1/completions", json={**comp, "stream": True}) as s:
            assert "".join(c["choices"][0]["text"] for c in _sse(s) if c["choices"]) == want
    # the suffix reaches the model on both servers: the same prefix, another suffix, another answer
    assert seen[(CASES[0][0], CASES[0][1], 0)] != seen[(CASES[0][0], CASES[1][1], 0)]
    assert seen[(CASES[1][0], CASES[0][1], 0)] != seen[(CASES[1][0], CASES[1][1], 0)]


def test_infill_extra_chunks_prompt_and_response_fields(daemon, ref):
    prefix, suffix = CASES[0]
    extra = [{"filename": "util.py", "text": "def sub(a, b):\n    return a - b\n"}, {"text": "import os\n"}]
    layout = ref.layout(prefix, suffix, extra=extra, prompt="a")
    want = ref.text(ref.greedy(layout, N))
    r = daemon.http.post("/infill", json={"model": FIM, "input_prefix": prefix, "input_suffix": suffix,
                                          "input_extra": extra, "prompt": "a", "n_predict": N, "temperature": 0,
                                          "response_fields": ["content", "timings/prompt_n", "tokens_cached"]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == {"content", "timings/prompt_n", "tokens_cached"}
    assert body["content"] == want
    # the extra chunks came first: a second request with the same files reuses their cache
    r2 = daemon.http.post("/infill", json={"model": FIM, "input_prefix": prefix + "a", "input_suffix": suffix,
                                           "input_extra": extra, "n_predict": 4, "temperature": 0})
    assert r2.json()["timings"]["cache_n"] > 0
    # the openai SDK sends suffix as it is
    from openai import OpenAI

    oai = OpenAI(base_url=daemon.url + "/v1", api_key=KEY, max_retries=0)
    c = oai.completions.create(model=FIM, prompt=prefix, suffix=suffix, max_tokens=N, temperature=0)
    assert c.choices[0].text == _expected(ref, prefix, suffix)[1]


def test_llama_vscode_warm_up_and_completions_beside_a_chat_model(daemon, ref):
    """llama.vscode's cache warm-up (n_predict 0, as it sends it when a file opens or is saved: the prompt into
    the cache, nothing generated; it was a 400, so no warm-up ever happened) makes the next completion over
    the same files find them cached; and with a chat model loaded too, an /infill that names no model (as
    llama.vscode sends it) goes to the loaded model that can fill in the middle (it was a 400)."""
    extra = [{"filename": "warm.py", "text": "def warm(a, b):\n    return a * b + 1\n" * 8}]
    h = daemon.http
    h.post("/api/generate", json={"model": MODEL, "keep_alive": "5m"}).raise_for_status()  # the chat model loaded
    h.post("/api/generate", json={"model": FIM, "keep_alive": "5m"}).raise_for_status()
    assert {m["name"] for m in daemon.ps()} >= {MODEL, FIM}
    warm = {"input_prefix": "", "input_suffix": "", "input_extra": extra, "prompt": "", "n_predict": 0,
            "samplers": [], "cache_prompt": True, "t_max_predict_ms": 1}
    r = h.post("/infill", json=warm)  # (no model named: the loaded one with FIM tokens)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["content"] == "" and body["tokens_predicted"] == 0 and body["model"] == FIM, body
    prefix, suffix = CASES[0]
    r = h.post("/infill", json={"input_prefix": prefix, "input_suffix": suffix, "input_extra": extra,
                                "n_predict": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["timings"]["cache_n"] > 40, r.json()["timings"]  # the files' tokens came from the cache
    assert r.json()["content"] == ref.text(ref.greedy(ref.layout(prefix, suffix, extra=extra), 4))
    assert h.get("/health").json() == {"status": "ok"}


def test_a_model_without_fim_tokens_is_a_clear_400_on_every_route(daemon):
    h = daemon.http
    r = h.post("/api/generate", json={"model": MODEL, "prompt": "def f(", "suffix": "\n", "stream": False})
    assert r.status_code == 400 and "fill in the middle" in r.json()["error"]
    r = h.post("/v1/completions", json={"model": MODEL, "prompt": "def f(", "suffix": "\n"})
    assert r.status_code == 400 and "fill in the middle" in r.json()["error"]["message"]
    assert r.json()["error"]["type"] == "invalid_request_error"
    r = h.post("/infill", json={"model": MODEL, "input_prefix": "def f(", "input_suffix": "\n"})
    assert r.status_code == 400 and "fill in the middle" in r.json()["error"]["message"]
    assert r.json()["error"]["code"] == 400
    # without a suffix the same model completes as before
    r = h.post("/api/generate", json={"model": MODEL, "prompt": "def f(", "suffix": "", "raw": True, "stream": False,
                                      "options": {"num_predict": 4, "temperature": 0}})
    assert r.status_code == 200 and r.json()["done"]
    body = r.json()
    assert "context" not in body  # (raw mode returns none, as Ollama's)


@pytest.mark.parametrize("body, message", [
    ({"input_suffix": "x"}, '"input_prefix" is required'),
    ({"input_prefix": "x"}, '"input_suffix" is required'),
    ({"input_prefix": 1, "input_suffix": "x"}, '"input_prefix" must be a string'),
    ({"input_prefix": "x", "input_suffix": "y", "input_extra": "z"}, '"input_extra" must be an array'),
    ({"input_prefix": "x", "input_suffix": "y", "input_extra": [{"filename": "a"}]}, '"text" field'),
    ({"input_prefix": "x", "input_suffix": "y", "prompt": 3}, '"prompt" must be a string'),
    ({"input_prefix": "x", "input_suffix": "y", "model": "nope:latest"}, "nope"),
])
def test_infill_bad_input(daemon, body, message):
    r = daemon.http.post("/infill", json={"model": FIM, **body} if "model" not in body else body)
    assert 400 <= r.status_code < 500, r.text
    err = r.json()["error"]
    assert message in err["message"] and err["code"] == r.status_code


def test_suffix_bad_input(daemon):
    r = daemon.http.post("/api/generate", json={"model": FIM, "prompt": "x", "suffix": 3})
    assert r.status_code == 400 and "'suffix' must be a string" in r.json()["error"]
    r = daemon.http.post("/v1/completions", json={"model": FIM, "prompt": "x", "suffix": "y", "echo": True})
    assert r.status_code == 400 and "echo" in r.json()["error"]["message"]


# -- handshakes --------------------------------------------------------------------------------------
def test_copilot_chat_sequence(daemon):
    """microsoft/vscode-copilot-chat's Ollama provider: GET /api/version (>= 0.6.4), GET /api/tags, POST
    /api/show {model} per model (capabilities, model_info[general.architecture], [<arch>.context_length],
    [general.basename]), then chat over /v1/chat/completions (streamed, with tools when the model has them)."""
    h = httpx.Client(base_url=daemon.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
    v = h.get("/api/version").json()
    assert _version_at_least(v["version"], "0.6.4") and v["localrun_version"] == localrun.__version__
    models = h.get("/api/tags").json()["models"]
    names = {m["model"] for m in models}
    assert {MODEL, FIM} <= names
    for m in models:
        assert {"name", "model", "modified_at", "size", "digest", "details"} <= set(m)
        info = h.post("/api/show", json={"model": m["model"]}).json()
        arch = info["model_info"]["general.architecture"]
        context = info["model_info"][f"{arch}.context_length"]
        assert isinstance(context, int) and context > 0
        assert isinstance(info["model_info"]["general.basename"], str) and info["model_info"]["general.basename"]
        assert "completion" in info["capabilities"]
        assert ("insert" in info["capabilities"]) == (m["model"] == FIM)
    from openai import OpenAI

    oai = OpenAI(base_url=daemon.url + "/v1", api_key=KEY, max_retries=0)
    stream = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], stream=True,
                                         max_tokens=8, temperature=0, stream_options={"include_usage": True})
    parts = [c for c in stream]
    assert any(c.choices and c.choices[0].delta.content for c in parts) and parts[-1].usage is not None


def test_continue_sequence(daemon, ref):
    """continuedev/continue's Ollama class: POST /api/show {name} (parameters parsed line by line, FIM when
    the template names .Suffix, now also `insert` in capabilities), then tab autocomplete streams
    POST /api/generate {model, prompt: prefix, suffix, raw, options: {temperature, num_predict, stop,
    num_ctx}, keep_alive: 1800, stream: true} and reads `response` from each NDJSON line."""
    import re

    h = daemon.http
    show = h.post("/api/show", json={"name": FIM}).json()
    for name in (FIM, MODEL):  # a line its pattern does not match throws before it looks for .Suffix
        for line in h.post("/api/show", json={"name": name}).json()["parameters"].split("\n"):
            if line:
                assert re.match(r'^(\S+)\s+((?:".*")|\S+)$', line), line
    assert ".Suffix" in show["template"] and "insert" in show["capabilities"]
    assert ".Suffix" not in h.post("/api/show", json={"name": MODEL}).json()["template"]
    prefix, suffix = CASES[1]
    want = _expected(ref, prefix, suffix)[1]
    with h.stream("POST", "/api/generate", json={
            "model": FIM, "prompt": prefix, "suffix": suffix, "raw": True, "keep_alive": 1800, "stream": True,
            "options": {"temperature": 0, "num_predict": N, "num_ctx": N_CTX, "stop": ["<|endoftext|>"]}}) as s:
        assert s.status_code == 200
        lines = _ndjson(s)
    assert "error" not in lines[-1] and lines[-1]["done"]
    assert "".join(x["response"] for x in lines) == want.split("<|endoftext|>")[0]
    # the ollama python client sends the same fields
    import ollama

    client = ollama.Client(host=daemon.url, headers={"Authorization": f"Bearer {KEY}"})
    g = client.generate(model=FIM, prompt=prefix, suffix=suffix, options={"temperature": 0, "num_predict": N})
    assert g.response == want and g.context[:g.prompt_eval_count] == ref.layout(prefix, suffix)
    assert "insert" in client.show(FIM).capabilities


@pytest.mark.parametrize("route", ["infill", "ollama", "openai"])
def test_bench_typing_smoke(daemon, route):
    """`localrun bench typing` with tiny numbers: keystrokes at 20/s, stale requests given up (their
    connections closed), the daemon serves the rest from the prefix cache and ends with nothing running."""
    import asyncio

    from localrun.bench.typing_edits import run_typing

    res = asyncio.run(run_typing(daemon.url, route, FIM, file_tokens=300, edits=6, rate=20, max_tokens=4,
                                 api_key=KEY))
    assert res["edits"] == 6 and res["finished"] >= 1 and res["finished"] + res["given_up"] == 6
    assert res["last_token_ms_p50"] > 0 and res["prompt_tokens_mean"] > 200
    assert res["cached_tokens_max"] > 100  # the file's head came from the cache
    daemon.wait_ps(lambda ms: all(m["active"] == 0 for m in ms))


def test_zed_raw_fim_prompt(daemon, ref):
    """Zed's Ollama edit prediction writes the FIM tokens into a raw /api/generate prompt itself (Qwen's
    spelling for qwen2.5-coder models): they are read as the model's special tokens, and the answer is
    the one llama.cpp gives to the same tokens."""
    prefix, suffix = CASES[0]
    r = daemon.http.post("/api/generate", json={
        "model": FIM, "prompt": f"<|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>", "raw": True,
        "stream": False, "options": {"num_predict": N, "temperature": 0, "stop": ["<|endoftext|>", "<|fim_pad|>"]}})
    assert r.status_code == 200, r.text
    body = r.json()
    # (a raw answer carries no `context`, as Ollama's: the prompt's ids as the daemon tokenizes them)
    prompt_ids = daemon.http.post("/tokenize", json={
        "model": FIM, "content": f"<|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>",
        "add_special": True}).json()["tokens"]
    assert len(prompt_ids) == body["prompt_eval_count"]
    assert prompt_ids[1] == ref.fim("pre") and prompt_ids[-1] == ref.fim("mid") and ref.fim("suf") in prompt_ids
    assert body["response"] == ref.text(ref.greedy(prompt_ids, N))


def test_localrun_version_names_localrun_versions(daemon):
    """`localrun --version` is unchanged; `localrun version` shows the daemon's localrun version, not the
    Ollama API level /api/version answers for clients."""
    import os
    import subprocess
    import sys

    env = {**{k: v for k, v in os.environ.items() if not k.startswith("LOCALRUN_")},
           "LOCALRUN_HOST": daemon.url.removeprefix("http://"), "LOCALRUN_API_KEY": KEY,
           "LOCALRUN_HOME": str(daemon.home)}
    r = subprocess.run([sys.executable, "-m", "localrun", "version"], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert f"localrun version {localrun.__version__}" in r.stdout
    assert f"daemon version {localrun.__version__} at" in r.stdout
    r = subprocess.run([sys.executable, "-m", "localrun", "--version"], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and f"localrun version {localrun.__version__}" in r.stdout


def test_bench_typing_against_llama_server(llama_server_bin, fim_gguf, tmp_path):
    """`localrun bench typing --llama-server`, briefly: both servers started on the tiny FIM model, rounds of the
    same keystrokes interleaved; both servers' rows, their latencies and the ratio of p95 totals are printed."""
    import os
    import subprocess
    import sys

    env = {**{k: v for k, v in os.environ.items() if not k.startswith("LOCALRUN_")}, "COLUMNS": "240",
           "LOCALRUN_HOME": str(tmp_path / "home")}
    r = subprocess.run([sys.executable, "-m", "localrun", "bench", "typing", "--llama-server", str(llama_server_bin),
                        "--gguf", str(fim_gguf), "--file-tokens", "300", "--edits", "4", "--rate", "10",
                        "--max-tokens", "4", "--rounds", "2", "--ctx", "2048", "--no-save", "--json"],
                       env=env, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout)
    assert [(x["round"], x["server"]) for x in res["runs"]] == [(0, "localrun"), (0, "llama-server"),
                                                                 (1, "llama-server"), (1, "localrun")]
    s = res["summary"]
    for name in ("localrun", "llama-server"):
        assert s[name]["edits"] == 8 and s[name]["finished"] >= 2  # each round's last keystroke is awaited
        assert 0 < s[name]["ttft_ms_p50"] <= s[name]["last_token_ms_p95"]
        assert s[name]["prompt_tokens_mean"] > 200
    ratio = s["ratio_p95_total"]
    assert ratio == round(s["localrun"]["last_token_ms_p95"] / s["llama-server"]["last_token_ms_p95"], 3)
    for row in ("│ localrun ", "│ llama-server ", f"localrun / llama-server: {ratio}", "machine: "):
        assert row in r.stderr, r.stderr[-3000:]
    # without a GGUF, or with a missing one: a clear message, exit 1, nothing started
    for extra, message in (([], "--llama-server needs --gguf FILE"), (["--gguf", str(tmp_path / "no.gguf")],
                                                                      "no such file")):
        r = subprocess.run([sys.executable, "-m", "localrun", "bench", "typing", "--llama-server",
                            str(llama_server_bin), *extra, "--no-save"], env=env, capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 1 and message in r.stderr and "Traceback" not in r.stderr, r.stderr
