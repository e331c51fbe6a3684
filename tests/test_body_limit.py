"""Request bodies over the daemon's limit sent chunked (no Content-Length, so the limit is only
known once the bytes arrive): a real daemon answers 413 in each API's own error shape on
/api/chat, /v1/chat/completions and /v1/messages, and goes on serving."""

from __future__ import annotations

import httpx
import pytest
from daemon import MODEL, Daemon

from localrun.server.app import MAX_BODY_BYTES

pytestmark = pytest.mark.timeout(300)

CHUNK = 2**20


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("home_limit"), LOCALRUN_CONTEXT_LENGTH="512")
    try:
        d.pull()
        yield d
    finally:
        d.stop()


def chunked_body(total: int):
    """A JSON request whose string field makes it `total` bytes, yielded 1 MiB at a time (httpx sends
    a generator body with Transfer-Encoding: chunked)."""
    head = b'{"model": "' + MODEL.encode() + b'", "max_tokens": 4, "messages": [{"role": "user", "content": "'
    tail = b'"}]}'
    yield head
    left = total - len(head) - len(tail)
    while left > 0:
        n = min(CHUNK, left)
        left -= n
        yield b"a" * n
    yield tail


def post_chunked(url: str, total: int) -> httpx.Response:
    return httpx.post(url, content=chunked_body(total), headers={"Content-Type": "application/json"}, timeout=120)


@pytest.mark.parametrize("path", ["/api/chat", "/v1/chat/completions", "/v1/messages"])
def test_chunked_body_over_the_limit_is_413_in_the_api_shape(daemon, path):
    r = post_chunked(daemon.url + path, 50 * 2**20)
    assert r.status_code == 413, r.text[:500]
    assert r.request.headers.get("transfer-encoding") == "chunked" and "content-length" not in r.request.headers
    body = r.json()
    limit = f"{MAX_BODY_BYTES // 2**20} MiB"
    if path == "/api/chat":  # Ollama: {"error": "..."}
        assert set(body) == {"error"} and "too large" in body["error"] and limit in body["error"]
    elif path == "/v1/messages":  # Anthropic
        assert body["type"] == "error" and body["error"]["type"] == "request_too_large"
        assert "too large" in body["error"]["message"]
    else:  # OpenAI
        err = body["error"]
        assert err["type"] == "invalid_request_error" and err["code"] == "request_too_large"
        assert "too large" in err["message"] and limit in err["message"]
    # still serving, the same API included
    assert daemon.http.get("/").status_code == 200


def test_chunked_body_under_the_limit_is_served_and_nothing_was_logged_as_a_crash(daemon):
    # a chunked request that stays under the limit is an ordinary request
    small = b'{"model": "' + MODEL.encode() + b'", "stream": false, "options": {"num_predict": 4, "temperature": 0},' \
            b' "messages": [{"role": "user", "content": "Hi"}]}'

    def gen():
        yield small[:20]
        yield small[20:]

    r = httpx.post(daemon.url + "/api/chat", content=gen(), timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["message"]["role"] == "assistant" and r.json()["done"] is True
    # just over the limit: refused (the count is exact), and the daemon goes on
    r = post_chunked(daemon.url + "/v1/chat/completions", MAX_BODY_BYTES + 1)
    assert r.status_code == 413
    r = daemon.http.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 4, "temperature": 0,
                                                        "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None
    log = daemon.log.read_text(errors="replace")
    assert "_TooLarge" not in log and "unhandled error" not in log
