"""Fill in the middle through the generation service, in-process over real HTTP against the fake backend
(tests/fakes.py): each route hands the backend the same Infill, a backend without FIM support is refused
before it sees anything, long texts are cut to what the layout can use, Ollama's `context` comes back.
The same routes run against llama.cpp and a real FIM model in test_ide.py."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from fakes import MODEL, FakeModel, InProcessDaemon, library_home

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    return library_home(tmp_path_factory.mktemp("ide_home"))


def _daemon(home, **kw):
    fake = FakeModel(rules={"def add": "a + b"}, **kw)
    return fake, InProcessDaemon(home, fake)


def test_each_route_hands_the_backend_the_infill(home):
    fake, d = _daemon(home, supports_infill=True)
    try:
        h = httpx.Client(base_url=d.url, timeout=30)
        r = h.post("/api/generate", json={"model": MODEL, "prompt": "def add(a, b):\n    return ", "suffix": "\n# end",
                                          "stream": False})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["response"] == "a + b"
        # `context`: the prompt's tokens (here one a character: prefix + suffix) then the answer's
        assert body["context"] == [ord(c) for c in "def add(a, b):\n    return \n# end" + "a + b"]
        r = h.post("/v1/completions", json={"model": MODEL, "prompt": "def add(", "suffix": ")", "n": 2})
        assert [c["text"] for c in r.json()["choices"]] == ["a + b"] * 2
        lines = [json.loads(x[6:]) for x in h.post("/infill", json={
            "model": MODEL, "input_prefix": "def add(", "input_suffix": ")", "prompt": "a",
            "input_extra": [{"filename": "x.py", "text": "import os"}, {"text": "y = 1"}], "stream": True,
            "n_predict": 3}).text.splitlines() if x.startswith("data: ")]
        assert "".join(x["content"] for x in lines) == "a +" and lines[-1]["stop"] is True
        assert lines[-1]["stop_type"] == "limit" and lines[-1]["tokens_predicted"] == 3
        infills = [(q.prompt, q.infill) for q in fake.requests]
        assert infills[0][1].prefix == "def add(a, b):\n    return " and infills[0][1].suffix == "\n# end"
        assert infills[1][1].prefix == infills[2][1].prefix == "def add(" and infills[1][0] == ""
        assert infills[3][0] == "a" and infills[3][1].extra == [{"filename": "x.py", "text": "import os"},
                                                              {"filename": "tmp", "text": "y = 1"}]
        # no suffix: a plain completion, as before
        h.post("/v1/completions", json={"model": MODEL, "prompt": "def add("})
        assert fake.requests[-1].infill is None
    finally:
        d.stop()


def test_a_backend_without_infill_is_refused_before_it_sees_anything(home):
    fake, d = _daemon(home, supports_infill=False)
    try:
        h = httpx.Client(base_url=d.url, timeout=30)
        r = h.post("/api/generate", json={"model": MODEL, "prompt": "x", "suffix": "y", "stream": True})
        assert r.status_code == 400 and "cannot fill in the middle" in r.json()["error"]
        r = h.post("/v1/completions", json={"model": MODEL, "prompt": "x", "suffix": "y", "stream": True})
        assert r.status_code == 400 and "cannot fill in the middle" in r.json()["error"]["message"]
        r = h.post("/infill", json={"model": MODEL, "input_prefix": "x", "input_suffix": "y", "stream": True})
        assert r.status_code == 400 and r.json()["error"]["code"] == 400
        assert fake.requests == []
    finally:
        d.stop()


def test_texts_the_layout_cannot_use_are_cut_before_the_runner(home):
    fake, d = _daemon(home, supports_infill=True, max_token_bytes=4)
    try:
        prefix, suffix = "p" * 100_000 + "END", "START" + "s" * 100_000
        extra = [{"filename": f"f{i}.py", "text": str(i) * 50_000} for i in range(10)]
        r = httpx.post(d.url + "/infill", json={"model": MODEL, "input_prefix": prefix, "input_suffix": suffix,
                                                "input_extra": extra, "n_predict": 2}, timeout=30)
        assert r.status_code == 200, r.text
        inf = fake.requests[-1].infill
        keep_pre, keep_suf = 4 * 1536 + 4096, 4 * 512 + 4096  # max_token_bytes x the tokens the layout keeps
        assert inf.prefix == prefix[-keep_pre:] and inf.suffix == suffix[:keep_suf]
        # the chunks nearest the prefix, up to what the window holds (4 bytes x num_ctx + a margin)
        assert inf.extra[-1]["filename"] == "f9.py" and extra[-1]["text"].endswith(inf.extra[-1]["text"])
        assert len(inf.extra) < len(extra) and sum(len(c["text"]) for c in inf.extra) <= 4 * 32768 + 4096
    finally:
        d.stop()


def test_infill_model_choice_without_a_model_field(home):
    fake, d = _daemon(home, supports_infill=True)
    try:
        r = httpx.post(d.url + "/infill", json={"input_prefix": "def add(", "input_suffix": ")"}, timeout=30)
        assert r.status_code == 400 and "'model' is required" in r.json()["error"]["message"]  # three in the library
        httpx.post(d.url + "/api/generate", json={"model": MODEL, "stream": False}, timeout=30)  # load one
        r = httpx.post(d.url + "/infill", json={"input_prefix": "def add(", "input_suffix": ")"}, timeout=30)
        assert r.status_code == 200 and r.json()["content"] == "a + b" and r.json()["model"] == MODEL
    finally:
        d.stop()


@pytest.mark.parametrize("path, body", [
    ("/infill", {"input_prefix": "def add(", "input_suffix": ")", "stream": True}),
    ("/api/generate", {"prompt": "def add(", "suffix": ")", "stream": True}),
    ("/v1/completions", {"prompt": "def add(", "suffix": ")", "stream": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "def add"}], "stream": True}),
])
def test_a_stale_completion_given_up_before_its_first_token_stops_the_work(home, path, body):
    """An IDE gives the completion of the last keystroke up when the next one comes, often while the
    prompt is still being computed: the backend request ends then, not after its first token."""
    fake, d = _daemon(home, supports_infill=True)
    fake.token_delay = 3.0  # the first token takes 3 s (a long prefill)
    try:
        t0 = time.monotonic()
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(d.url + path, json={"model": MODEL, **body}, timeout=httpx.Timeout(30, read=0.3))
        wait_until = time.monotonic() + 2.0
        while not fake.aborted and time.monotonic() < wait_until:
            time.sleep(0.02)
        assert len(fake.aborted) == 1 and fake.finished == [], (fake.aborted, fake.finished)
        assert time.monotonic() - t0 < 2.0  # well before the first token would have come
    finally:
        d.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_infill_t_max_predict_ms_ends_after_a_new_line(home, stream):
    """llama-server's time limit (llama.vscode sends it): past t_max_predict_ms since the first token, once a
    new line was generated, the answer ends there (stop_type "limit") and the backend request is aborted."""
    fake = FakeModel(rules={"def add": "a\n" + "b" * 200}, token_delay=0.02, supports_infill=True)
    d = InProcessDaemon(home, fake)
    try:
        body = {"model": MODEL, "input_prefix": "def add(", "input_suffix": ")", "t_max_predict_ms": 150,
                "stream": stream}
        r = httpx.post(d.url + "/infill", json=body, timeout=30)
        assert r.status_code == 200, r.text
        if stream:
            events = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: ")]
            content, last = "".join(e["content"] for e in events), events[-1]
        else:
            last = r.json()
            content = last["content"]
        assert content.startswith("a\nb") and len(content) < 100, content
        assert last["stop_type"] == "limit" and last["has_new_line"] is True
        assert last["tokens_predicted"] == len(content)  # one token a character
        deadline = time.monotonic() + 5
        while not fake.aborted and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(fake.aborted) == 1 and fake.finished == []
        # without the limit the whole answer comes
        r = httpx.post(d.url + "/infill", json={**body, "t_max_predict_ms": None, "stream": False}, timeout=30)
        assert r.json()["content"] == "a\n" + "b" * 200 and r.json()["stop_type"] == "eos"
    finally:
        d.stop()
