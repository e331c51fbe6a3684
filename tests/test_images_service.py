"""The generation service's image plumbing, in process (the real app and library, a fake backend):
every choice gets the image bytes in marker order and the runner-side tokenizing window; a backend
that cannot take images (the native engine) is a 400 naming the fix; a model without a projector is
refused before anything loads."""

from __future__ import annotations

import base64

import httpx
import pytest
from fakes import MODEL, FakeModel, InProcessDaemon, library_home
from vlm_model import build_tiny_vlm, png

from localrun.backends.base import MEDIA_MARKER

pytest.importorskip("PIL")
GREEN, BLUE = png((0, 255, 0), (16, 16)), png((0, 0, 255), (8, 8))


@pytest.fixture(scope="module")
def home(tmp_path_factory, request):
    try:
        cache = request.config.cache.mkdir("tiny-vlm")
    except AttributeError:
        cache = tmp_path_factory.mktemp("tiny-vlm")
    _, mmproj = build_tiny_vlm(cache)
    return library_home(tmp_path_factory.mktemp("home"), {"vision": f"FROM {MODEL}\nFROM {mmproj}\n"})


def _url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def _chat(d, model: str, n: int = 1) -> httpx.Response:
    content = [{"type": "text", "text": "compare "}, {"type": "image_url", "image_url": {"url": _url(GREEN)}},
               {"type": "text", "text": " with "}, {"type": "image_url", "image_url": {"url": _url(BLUE)}}]
    return httpx.post(d.url + "/v1/chat/completions", timeout=30,
                      json={"model": model, "n": n, "max_tokens": 4, "messages": [{"role": "user", "content": content}]})


def test_every_choice_gets_the_images(home):
    m = FakeModel(supports_images=True, supports_groups=True)
    d = InProcessDaemon(home, m)
    try:
        r = _chat(d, "vision", n=2)
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"]) == 2
        assert len(m.requests) == 2
        for req in m.requests:
            assert req.images == [GREEN, BLUE]
            assert f"compare {MEDIA_MARKER} with {MEDIA_MARKER}" in req.prompt
            assert req.prompt_token_ids is None and req.window  # the runner tokenizes (image tokens)
        assert {req.group[2] for req in m.requests} == {0, 1}
        # Ollama's chat: the images go before the text, in order
        r = httpx.post(d.url + "/api/chat", timeout=30, json={"model": "vision", "stream": False, "messages": [
            {"role": "user", "content": "hi", "images": [base64.b64encode(BLUE).decode()]}]})
        assert r.status_code == 200, r.text
        assert m.requests[-1].images == [BLUE] and f"{MEDIA_MARKER}hi" in m.requests[-1].prompt
    finally:
        d.stop()


def test_a_backend_without_images_and_a_model_without_a_projector(home):
    m = FakeModel(supports_images=False)
    d = InProcessDaemon(home, m)
    try:
        r = _chat(d, MODEL)
        assert r.status_code == 400 and "no vision projector" in r.json()["error"]["message"]
        assert m.loads == []  # refused before anything was loaded
        r = _chat(d, "vision")
        assert r.status_code == 400
        msg = r.json()["error"]["message"]
        assert "fake backend, which cannot take images yet" in msg and "LOCALRUN_BACKEND=llamacpp" in msg
        assert m.requests == []
    finally:
        d.stop()


def test_anthropic_tool_result_images_reach_the_backend(home):
    m = FakeModel(supports_images=True)
    d = InProcessDaemon(home, m)
    try:
        blocks = [{"type": "tool_result", "tool_use_id": "t1", "content": [
            {"type": "text", "text": "the screenshot:"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(GREEN).decode()}}]},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(BLUE).decode()}},
            {"type": "text", "text": "what changed?"}]
        r = httpx.post(d.url + "/v1/messages", timeout=30, json={"model": "vision", "max_tokens": 4, "messages": [
            {"role": "user", "content": "shoot"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "shot", "input": {}}]},
            {"role": "user", "content": blocks}]})
        assert r.status_code == 200, r.text
        req = m.requests[-1]
        assert req.images == [GREEN, BLUE]
        assert f"the screenshot:{MEDIA_MARKER}" in req.prompt and f"{MEDIA_MARKER}what changed?" in req.prompt
    finally:
        d.stop()
