"""Crash-safe serving: every loaded model runs in a runner process of its own.

The real daemon, the real llama.cpp, SmolLM2: a runner killed (SIGKILL, SIGSEGV) in the middle
of a streamed or a non-streamed request gives those requests a clear error in their API's
shape, the daemon and the other models keep serving, and the next request loads the model
again; a runner that dies while loading, twice, is a clear error; no runner outlives a
daemon killed with SIGKILL or stopped with SIGTERM.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest
from daemon import MODEL, Daemon

from localrun.backends.llamacpp.amx import cpu_has_amx
from localrun.backends.llamacpp.cpu import extra_buffers

pytestmark = pytest.mark.timeout(300)

STORY = [{"role": "user", "content": "Tell me a very long story about a dragon."}]
# generates until max_tokens whatever the model says: a stream that is surely still running when killed
LONG = {"max_tokens": 1500, "temperature": 0.7, "ignore_eos": True}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("home_runner"), LOCALRUN_NUM_PARALLEL="2", LOCALRUN_CONTEXT_LENGTH="2048",
               LOCALRUN_MAX_LOADED_MODELS="2")
    try:
        d.pull()
        modelfile = f"FROM {MODEL}\nSYSTEM You are a pirate.\n"
        with d.http.stream("POST", "/api/create", json={"model": "pirate", "modelfile": modelfile}) as r:
            assert [json.loads(x) for x in r.iter_lines() if x.strip()][-1]["status"] == "success"
        yield d
    finally:
        d.stop()


def _ask(d: Daemon, model: str = MODEL, **kw) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4, **kw}
    return d.http.post("/v1/chat/completions", json=body)


def _kill_when_streaming(d: Daemon, pid: int, sig: int, lines) -> list[str]:
    """Read SSE/NDJSON lines; after a few tokens arrived, kill the runner; return every line."""
    seen = []
    for line in lines:
        if line.strip():
            seen.append(line)
        if len(seen) == 3:
            os.kill(pid, sig)
    return seen


def test_runner_is_a_child_process_shown_by_ps(daemon):
    assert _ask(daemon).status_code == 200
    m = next(m for m in daemon.ps() if m["name"] == MODEL)
    pid = m["runner"]["pid"]
    assert pid != daemon.proc.pid and pid in [p.pid for p in daemon.runners()]
    assert m["runner"]["rss_bytes"] > 50 * 2**20  # the weights live in the runner
    assert psutil.Process(daemon.proc.pid).memory_info().rss < psutil.Process(pid).memory_info().rss + 2**30


def test_sigkill_mid_stream_openai(daemon):
    assert _ask(daemon).status_code == 200
    pid = daemon.runner_pid()
    body = {"model": MODEL, "messages": STORY, "stream": True, **LONG}
    with daemon.http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        lines = _kill_when_streaming(daemon, pid, signal.SIGKILL, r.iter_lines())
    err = json.loads(lines[-2].removeprefix("data: "))["error"]
    assert lines[-1] == "data: [DONE]"  # an error event, then the stream ends properly
    assert MODEL in err["message"] and "SIGKILL" in err["message"] and err["type"] == "server_error"
    assert daemon.http.get("/api/version").status_code == 200
    r = _ask(daemon)  # the next request loads the model again, in a new runner
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
    assert daemon.runner_pid() != pid


def test_sigkill_mid_stream_with_the_openai_sdk(daemon):
    import openai

    client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    assert _ask(daemon).status_code == 200
    pid = daemon.runner_pid()
    stream = client.chat.completions.create(model=MODEL, messages=STORY, stream=True, max_tokens=1500,
                                            extra_body={"ignore_eos": True})
    with pytest.raises(openai.APIError) as e:
        for i, _chunk in enumerate(stream):
            if i == 2:
                os.kill(pid, signal.SIGKILL)
    assert "SIGKILL" in str(e.value) and MODEL in str(e.value)


def test_sigsegv_mid_stream_ollama_names_the_native_crash(daemon):
    """A native crash (what llama.cpp's AMX path does on Intel AMX CPUs) ends the NDJSON stream
    with an error line naming the signal and the setting to try."""
    assert _ask(daemon).status_code == 200
    pid = daemon.runner_pid()
    body = {"model": MODEL, "messages": STORY, "options": {"num_predict": 1500}}
    with daemon.http.stream("POST", "/api/chat", json=body) as r:
        lines = _kill_when_streaming(daemon, pid, signal.SIGSEGV, r.iter_lines())
    last = json.loads(lines[-1])
    assert "SIGSEGV" in last["error"] and "llama.cpp" in last["error"] and last["status"] == 500
    assert "LOCALRUN_LLAMACPP_EXTRA_BUFFERS=off" in last["error"] or extra_buffers("auto")[0] is False
    assert _ask(daemon).status_code == 200


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/api/chat"])
def test_sigkill_mid_non_streamed_request(daemon, route):
    assert _ask(daemon).status_code == 200
    pid = daemon.runner_pid()
    story = {"type": "array", "items": {"type": "integer"}, "minItems": 250}  # hundreds of tokens at least
    body = {"model": MODEL, "messages": STORY, "stream": False, **LONG,  # /v1 reads these, /api the next two
            "options": {"num_predict": 1500}, "format": story}
    out: list = []
    t = threading.Thread(target=lambda: out.append(daemon.http.post(route, json=body)))
    t.start()
    daemon.wait_ps(lambda ms: any(m["name"] == MODEL and m["active"] for m in ms))
    time.sleep(0.5)
    os.kill(pid, signal.SIGKILL)
    t.join(60)
    r = out[0]
    assert r.status_code >= 500
    msg = r.json()["error"]["message"] if route.startswith("/v1") else r.json()["error"]
    assert MODEL in msg and "SIGKILL" in msg
    assert _ask(daemon).status_code == 200


def test_other_models_keep_serving(daemon):
    """Kill one model's runner while another model streams: the other stream finishes whole."""
    assert _ask(daemon).status_code == 200 and _ask(daemon, "pirate").status_code == 200
    victim, other = daemon.runner_pid(MODEL), daemon.runner_pid("pirate:latest")
    assert victim != other
    done: list = []

    def stream_other():
        body = {"model": "pirate", "messages": STORY, "stream": True, "max_tokens": 60, "ignore_eos": True,
                "stream_options": {"include_usage": True}}
        try:
            with httpx.Client(base_url=daemon.url, timeout=120) as c, \
                    c.stream("POST", "/v1/chat/completions", json=body) as r:
                done.append([x for x in r.iter_lines() if x.strip()])
        except Exception as exc:  # noqa: BLE001 - the assertion below says what it was
            done.append(exc)

    t = threading.Thread(target=stream_other)
    t.start()
    daemon.wait_ps(lambda ms: any(m["name"] == "pirate:latest" and m["active"] for m in ms))
    os.kill(victim, signal.SIGKILL)
    t.join(120)
    assert done and not isinstance(done[0], Exception), done
    lines = done[0]
    assert lines[-1] == "data: [DONE]" and '"error"' not in "".join(lines)
    usage = json.loads(lines[-2].removeprefix("data: "))["usage"]
    assert usage["completion_tokens"] == 60
    assert daemon.runner_pid("pirate:latest") == other  # untouched


def test_abort_reaches_the_runner(daemon):
    """A client that leaves mid-stream: the runner stops generating (the model goes idle)."""
    assert _ask(daemon).status_code == 200
    body = {"model": MODEL, "messages": STORY, "stream": True, **LONG}
    with daemon.http.stream("POST", "/v1/chat/completions", json=body) as r:
        it = r.iter_lines()
        next(it), next(it)
    daemon.wait_ps(lambda ms: all(m["active"] == 0 for m in ms), timeout=10)
    proc = psutil.Process(daemon.runner_pid())
    proc.cpu_percent(None)
    time.sleep(1.0)
    assert proc.cpu_percent(None) < 50  # not still decoding the abandoned answer


def test_the_runner_tokenizes_and_checks_the_window(daemon):
    """One choice: the runner tokenizes the prompt as it starts the request (one round trip, not
    two). The prompt's count, the window check and the cap on max_tokens are the same as when the
    daemon tokenizes first (n = 2), streamed or not."""
    def post(prompt: str, **kw) -> httpx.Response:
        return daemon.http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1,
                                                         "temperature": 0, **kw})

    k = 1000
    one = post("word " * k).json()["usage"]
    assert one["prompt_tokens"] > 900
    assert post("word " * k, n=2).json()["usage"]["prompt_tokens"] == one["prompt_tokens"]
    with daemon.http.stream("POST", "/v1/completions", json={
            "model": MODEL, "prompt": "word " * k, "max_tokens": 1, "stream": True,
            "stream_options": {"include_usage": True}}) as r:
        usage = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")][-1]["usage"]
    assert usage["prompt_tokens"] == one["prompt_tokens"]
    r = daemon.http.post("/api/generate", json={"model": MODEL, "prompt": "word " * k, "raw": True, "stream": False,
                                                "options": {"num_predict": 1}})
    assert r.json()["prompt_eval_count"] == one["prompt_tokens"]

    k += 2048 - 4 - one["prompt_tokens"]  # " word" is a token: 4 tokens of the 2048 window left
    capped = post("word " * k, max_tokens=50, ignore_eos=True).json()
    assert capped["usage"]["prompt_tokens"] == 2044, capped
    assert capped["usage"]["completion_tokens"] == 4 and capped["choices"][0]["finish_reason"] == "length"
    for n in (1, 2):
        r = post("word " * (k + 10), n=n)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"].startswith("the prompt is 2054 tokens but the context window is 2048"), r.text
    assert _ask(daemon).status_code == 200  # nothing stuck


def _kill_runners_for(d: Daemon, seconds: float, killed: list) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for p in d.runners():
            try:
                p.kill()
                killed.append(p.pid)
            except psutil.Error:
                pass
        time.sleep(0.01)


def test_runner_dying_while_loading_twice_is_a_clear_error(tmp_path):
    d = Daemon(tmp_path / "home")
    try:
        d.pull()
        killed: list = []
        t = threading.Thread(target=_kill_runners_for, args=(d, 8.0, killed))
        t.start()
        r = _ask(d)
        t.join()
        assert r.status_code == 500, r.text
        msg = r.json()["error"]["message"]
        assert "died twice while loading" in msg and "SIGKILL" in msg and "out-of-memory" in msg, msg
        assert len(set(killed)) == 2, killed  # tried once more, then gave up: no restart loop
        assert d.ps() == []
        assert _ask(d).status_code == 200  # nothing kills it now: loads and answers
        assert "died twice while loading" in d.log.read_text() or "trying once more" in d.log.read_text()
    finally:
        d.stop()


def test_sigkill_daemon_leaves_no_runner(tmp_path):
    d = Daemon(tmp_path / "home")
    d.pull()
    assert _ask(d).status_code == 200
    runners = d.runners()
    assert len(runners) == 1
    d.proc.kill()
    d.proc.wait(10)
    gone, alive = psutil.wait_procs(runners, timeout=10)
    for p in alive:
        p.kill()
    assert not alive, "a runner outlived its SIGKILLed daemon"
    d.http.close()


def test_sigterm_daemon_stops_runners_and_exits_cleanly(tmp_path):
    d = Daemon(tmp_path / "home")
    d.pull()
    assert _ask(d).status_code == 200
    runners = d.runners()
    d.stop()  # asserts that every runner is gone
    assert d.proc.returncode == 0
    assert all(not p.is_running() for p in runners)


# -- llama.cpp's extra buffer types (AMX) ---------------------------------------------------
CPUINFO_AMX = "processor\t: 0\nflags\t\t: fpu sse avx512f amx_bf16 amx_tile amx_int8\n"
CPUINFO_EPYC = "processor\t: 0\nflags\t\t: fpu sse avx2 sha_ni\n"


def test_extra_buffers_auto_follows_the_cpu():
    assert cpu_has_amx(CPUINFO_AMX) and not cpu_has_amx(CPUINFO_EPYC) and not cpu_has_amx("")
    assert extra_buffers("auto", amx=True, deny=lambda: False)[0] is False  # AMX that cannot be denied: all off
    assert extra_buffers("auto", amx=False)[0] is True
    assert extra_buffers("on", amx=True)[0] is True and extra_buffers("off", amx=False)[0] is False
    # on this machine: auto reads /proc/cpuinfo (tests/test_amx.py: AMX denied, the rest kept)
    here = Path("/proc/cpuinfo")
    if here.exists():
        why = extra_buffers("auto", deny=lambda: True)[1]
        assert ("AMX denied" in why) is cpu_has_amx(here.read_text())


def test_extra_buffers_off_serves_and_says_so(tmp_path):
    d = Daemon(tmp_path / "home", LOCALRUN_LLAMACPP_EXTRA_BUFFERS="off")
    try:
        d.pull()
        r = _ask(d, max_tokens=8, temperature=0)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 0
        assert "extra buffer types off" in d.ps()[0]["reason"]
    finally:
        d.stop()
