"""Images on every API, end to end: the real daemon (tests/daemon.py) on the tiny random Gemma 3 VLM
(tests/vlm_model.py), driven by the SDKs users use (openai: chat and Responses; anthropic; ollama:
chat and generate), streamed and not. The test of truth is agreement: localrun's greedy answer
equals llama.cpp's own multimodal path (libmtmd) on the same files, image and prompt text (the tiny
VLM's Gemma 3 template, rendered here by hand); a different image gives a different answer; usage
counts the image tokens. Then the red-team cases (oversized, too many, a decompression bomb,
corrupt, unsupported, a remote URL while fetching is off, a loopback URL while it is on, an image
to a model without a projector on every API): a 4xx in each API's error shape naming the part,
and the daemon keeps serving."""

from __future__ import annotations

import base64
import io
import struct
import zlib
from pathlib import Path

import httpx
import pytest
from daemon import MODEL, Daemon
from vlm_model import mtmd_reference, png

from localrun.backends.base import MEDIA_MARKER

pytestmark = pytest.mark.timeout(900)
pytest.importorskip("llama_cpp")
pytest.importorskip("PIL")
anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")
ollama = pytest.importorskip("ollama")

VLM = "tiny-vlm"
N = 8  # tokens per answer (the references hold no end-of-generation token within them)
Q = "describe it"
GREEN, BLUE, NOISE = png((0, 255, 0)), png((0, 0, 255), (48, 64)), png((0, 0, 0), (64, 64), noise_seed=1)
MAX_PIXELS, MAX_COUNT, MAX_BYTES = 512 * 512, 4, 300_000


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + b64(data)


def turn(role: str, text: str) -> str:
    return f"<start_of_turn>{role}\n{text}<end_of_turn>\n"


def gemma(*turns: tuple[str, str]) -> str:
    """The prompt the daemon renders with the tiny VLM's template (BOS included, as tokenized)."""
    return "<bos>" + "".join(turn(r, t) for r, t in turns) + "<start_of_turn>model\n"


@pytest.fixture(scope="module")
def expect(vlm):
    """prompt, images -> the text llama.cpp's own multimodal path answers greedily (N tokens)."""
    import llama_cpp

    vocab = llama_cpp.Llama(model_path=str(vlm[0]), vocab_only=True, verbose=False)
    memo: dict = {}

    def text(prompt: str, images: list[bytes]) -> str:
        key = (prompt, tuple(images))
        if key not in memo:
            ids = mtmd_reference(*vlm, prompt, images, N)
            memo[key] = vocab.detokenize(ids).decode("utf-8", errors="replace")
        return memo[key]

    yield text
    vocab.close()


def _create(d: Daemon, vlm) -> None:
    gguf, mmproj = vlm
    r = d.http.post("/api/create", json={"model": VLM, "modelfile": f"FROM {gguf}\nFROM {mmproj}\n", "stream": False})
    assert r.status_code == 200, r.text


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, vlm):
    d = Daemon(tmp_path_factory.mktemp("home_images"), LOCALRUN_NUM_PARALLEL="2",
               LOCALRUN_IMAGE_MAX_PIXELS=str(MAX_PIXELS), LOCALRUN_IMAGE_MAX_COUNT=str(MAX_COUNT),
               LOCALRUN_IMAGE_MAX_BYTES=str(MAX_BYTES))
    try:
        _create(d, vlm)
        d.pull(MODEL)
        yield d
    finally:
        d.stop()


def oai(d: Daemon):
    return openai.OpenAI(base_url=d.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def claude(d: Daemon):
    return anthropic.Anthropic(base_url=d.url, api_key="unused", max_retries=0, timeout=120)


def oll(d: Daemon):
    return ollama.Client(host=d.url, timeout=120)


def openai_parts(img: bytes, text: str = Q) -> list[dict]:
    return [{"type": "image_url", "image_url": {"url": data_url(img), "detail": "low"}}, {"type": "text", "text": text}]


def claude_blocks(img: bytes, text: str = Q) -> list[dict]:
    return [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64(img)}},
            {"type": "text", "text": text}]


def responses_input(img: bytes, text: str = Q) -> list[dict]:
    return [{"role": "user", "content": [{"type": "input_image", "image_url": data_url(img)},
                                         {"type": "input_text", "text": text}]}]


# -- the four APIs, through their SDKs ---------------------------------------------------------------
def ask_openai(d, img, stream):
    c = oai(d)
    kw = dict(model=VLM, max_tokens=N, temperature=0, messages=[{"role": "user", "content": openai_parts(img)}])
    if not stream:
        r = c.chat.completions.create(**kw)
        return r.choices[0].message.content, r.usage.prompt_tokens
    text, usage = "", None
    for ch in c.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        if ch.choices and ch.choices[0].delta.content:
            text += ch.choices[0].delta.content
        usage = ch.usage or usage
    return text, usage.prompt_tokens


def ask_responses(d, img, stream):
    c = oai(d)
    kw = dict(model=VLM, max_output_tokens=N, temperature=0, input=responses_input(img))
    if not stream:
        r = c.responses.create(**kw)
        return r.output_text, r.usage.input_tokens
    text, usage = "", None
    for ev in c.responses.create(stream=True, **kw):
        if ev.type == "response.output_text.delta":
            text += ev.delta
        elif ev.type in ("response.completed", "response.incomplete"):
            usage = ev.response.usage
    return text, usage.input_tokens


def ask_anthropic(d, img, stream):
    c = claude(d)
    kw = dict(model=VLM, max_tokens=N, extra_body={"temperature": 0}, messages=[{"role": "user", "content": claude_blocks(img)}])
    if not stream:
        r = c.messages.create(**kw)
        text = "".join(b.text for b in r.content if b.type == "text")
        return text, r.usage.input_tokens + (r.usage.cache_read_input_tokens or 0)
    with c.messages.stream(**kw) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    return text, final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0)


def ask_ollama_chat(d, img, stream):
    kw = dict(model=VLM, messages=[{"role": "user", "content": Q, "images": [img]}],
              options={"temperature": 0, "num_predict": N})
    if not stream:
        r = oll(d).chat(**kw)
        return r.message.content, r.prompt_eval_count
    text, n = "", None
    for part in oll(d).chat(stream=True, **kw):
        text += part.message.content or ""
        n = part.prompt_eval_count or n
    return text, n


def ask_ollama_generate(d, img, stream):
    kw = dict(model=VLM, prompt=Q, images=[img], options={"temperature": 0, "num_predict": N})
    if not stream:
        r = oll(d).generate(**kw)
        return r.response, r.prompt_eval_count
    text, n = "", None
    for part in oll(d).generate(stream=True, **kw):
        text += part.response or ""
        n = part.prompt_eval_count or n
    return text, n


APIS = {"openai": ask_openai, "responses": ask_responses, "anthropic": ask_anthropic,
        "ollama-chat": ask_ollama_chat, "ollama-generate": ask_ollama_generate}


@pytest.fixture(scope="module")
def text_only_prompt_tokens(daemon):
    r = oai(daemon).chat.completions.create(model=VLM, max_tokens=1, temperature=0,
                                            messages=[{"role": "user", "content": Q}])
    return r.usage.prompt_tokens


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("api", list(APIS))
def test_each_api_agrees_with_llama_cpp(daemon, expect, text_only_prompt_tokens, api, stream):
    answers = {}
    for name, img in (("green", GREEN), ("blue", BLUE)):
        text, prompt_tokens = APIS[api](daemon, img, stream)
        assert text == expect(gemma(("user", MEDIA_MARKER + Q)), [img]), (api, name)
        assert prompt_tokens >= text_only_prompt_tokens + 16  # the image's 16 tokens are counted
        answers[name] = text
    assert answers["green"] != answers["blue"]  # the image steers the answer


def test_several_images_and_earlier_turns(daemon, expect):
    """Two images in one message, one in an earlier turn, on Ollama's chat and OpenAI's; n = 2 gets
    the images in every choice."""
    want = expect(gemma(("user", MEDIA_MARKER + Q), ("model", "ok"), ("user", MEDIA_MARKER * 2 + "and these")),
                  [GREEN, BLUE, NOISE])
    r = oll(daemon).chat(model=VLM, options={"temperature": 0, "num_predict": N}, messages=[
        {"role": "user", "content": Q, "images": [GREEN]}, {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "and these", "images": [BLUE, NOISE]}])
    assert r.message.content == want
    msgs = [{"role": "user", "content": openai_parts(GREEN)}, {"role": "assistant", "content": "ok"},
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(BLUE)}},
                                         {"type": "image_url", "image_url": {"url": data_url(NOISE)}},
                                         {"type": "text", "text": "and these"}]}]
    r = oai(daemon).chat.completions.create(model=VLM, max_tokens=N, temperature=0, n=2, messages=msgs)
    assert [c.message.content for c in r.choices] == [want, want]


def test_a_chat_that_outgrows_the_window_drops_old_turns_with_their_images(daemon, expect):
    """Ollama's truncation on a vision chat: the early turns (one with an image) go, and their image
    with them; the last turn's image stays with its turn. The answer is llama.cpp's to that turn alone."""
    long = "tell me more about the colours of the sea " * 12
    msgs = [{"role": "user", "content": long, "images": [b64(GREEN)]}, {"role": "assistant", "content": "ok"},
            {"role": "user", "content": long}, {"role": "assistant", "content": "ok"},
            {"role": "user", "content": Q, "images": [b64(BLUE)]}]
    r = daemon.http.post("/api/chat", json={"model": VLM, "messages": msgs, "stream": False,
                                            "options": {"temperature": 0, "num_predict": N, "num_ctx": 128}})
    assert r.status_code == 200, r.text
    assert r.json()["message"]["content"] == expect(gemma(("user", MEDIA_MARKER + Q)), [BLUE])
    whole = daemon.http.post("/api/chat", json={"model": VLM, "messages": msgs, "stream": False, "truncate": False,
                                                "options": {"temperature": 0, "num_predict": N, "num_ctx": 128}})
    assert whole.status_code == 400 and "context window is 128 tokens" in whole.text, whole.text


def test_responses_keep_the_image_for_the_next_turn(daemon, expect, text_only_prompt_tokens):
    """A stored response's input image is sent again with previous_response_id."""
    c = oai(daemon)
    first = c.responses.create(model=VLM, max_output_tokens=N, temperature=0, input=responses_input(GREEN))
    assert first.output_text == expect(gemma(("user", MEDIA_MARKER + Q)), [GREEN])
    items = c.responses.input_items.list(first.id)
    assert [p.type for p in items.data[0].content] == ["input_image", "input_text"]
    second = c.responses.create(model=VLM, max_output_tokens=N, temperature=0, previous_response_id=first.id,
                                input="and now?")
    assert second.usage.input_tokens >= text_only_prompt_tokens + 16
    assert second.output_text == expect(gemma(("user", MEDIA_MARKER + Q), ("model", first.output_text),
                                              ("user", "and now?")), [GREEN])


def test_anthropic_count_tokens_counts_the_image(daemon):
    c = claude(daemon)
    msgs = [{"role": "user", "content": claude_blocks(GREEN)}]
    counted = c.messages.count_tokens(model=VLM, messages=msgs).input_tokens
    r = c.messages.create(model=VLM, max_tokens=1, messages=msgs)
    assert counted == r.usage.input_tokens + (r.usage.cache_read_input_tokens or 0)
    assert counted >= c.messages.count_tokens(model=VLM, messages=[{"role": "user", "content": Q}]).input_tokens + 16


# -- red team ------------------------------------------------------------------------------------------
def _png_header_lie(width: int, height: int) -> bytes:
    """A tiny PNG whose header claims width x height (a decompression bomb's calling card)."""
    raw = png((1, 2, 3), (8, 8))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = b"IHDR" + ihdr
    return raw[:8] + struct.pack(">I", 13) + chunk + struct.pack(">I", zlib.crc32(chunk)) + raw[33:]


def _zeros_png(side: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("L", (side, side), 0).save(buf, format="PNG")
    return buf.getvalue()


def _webp() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (16, 16), (9, 9, 9)).save(buf, format="WEBP")
    return buf.getvalue()


BIG_NOISE = png((0, 0, 0), (400, 400), noise_seed=3)  # ~480 KB of incompressible pixels: over MAX_BYTES
BOMB = _zeros_png(2048)  # 4 M pixels in a few KB
LIAR = _png_header_lie(100_000, 100_000)
CASES = {
    "oversized": ([BIG_NOISE], "LOCALRUN_IMAGE_MAX_BYTES"),
    "too many": ([GREEN] * (MAX_COUNT + 1), "LOCALRUN_IMAGE_MAX_COUNT"),
    "bomb": ([BOMB], "LOCALRUN_IMAGE_MAX_PIXELS"),
    "header bomb": ([LIAR], "pixels"),
    "truncated": ([NOISE[: len(NOISE) // 2]], "corrupt or truncated"),
    "not an image": ([b"hello, world: not an image at all"], "not an image"),
    "webp": ([_webp()], "not an image localrun can read"),
}


def _openai_body(images, model=VLM):
    parts = [{"type": "image_url", "image_url": {"url": data_url(i)}} for i in images] + [{"type": "text", "text": Q}]
    return "/v1/chat/completions", {"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": parts}]}


def _responses_body(images, model=VLM):
    parts = [{"type": "input_image", "image_url": data_url(i)} for i in images] + [{"type": "input_text", "text": Q}]
    return "/v1/responses", {"model": model, "max_output_tokens": 2, "input": [{"role": "user", "content": parts}]}


def _anthropic_body(images, model=VLM):
    blocks = [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64(i)}}
              for i in images] + [{"type": "text", "text": Q}]
    return "/v1/messages", {"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": blocks}]}


def _ollama_chat_body(images, model=VLM):
    return "/api/chat", {"model": model, "stream": False, "options": {"num_predict": 2},
                         "messages": [{"role": "user", "content": Q, "images": [b64(i) for i in images]}]}


def _ollama_generate_body(images, model=VLM):
    return "/api/generate", {"model": model, "stream": False, "options": {"num_predict": 2}, "prompt": Q,
                             "images": [b64(i) for i in images]}


BODIES = {"openai": _openai_body, "responses": _responses_body, "anthropic": _anthropic_body,
          "ollama-chat": _ollama_chat_body, "ollama-generate": _ollama_generate_body}


def _post(d: Daemon, path_body: tuple[str, dict]) -> httpx.Response:
    return d.http.post(path_body[0], json=path_body[1])


def _error_message(api: str, r: httpx.Response) -> str:
    body = r.json()
    if api == "anthropic":
        assert body["type"] == "error"
        return body["error"]["message"]
    if api.startswith("ollama"):
        return body["error"]
    return body["error"]["message"]


def _still_serving(d: Daemon) -> None:
    r = _post(d, _ollama_chat_body([GREEN]))
    assert r.status_code == 200 and r.json()["done"], r.text
    assert d.proc.poll() is None


@pytest.mark.parametrize("api", list(BODIES))
def test_bad_images_are_4xx_naming_the_part(daemon, api):
    _still_serving(daemon)
    pid = daemon.runner_pid(VLM + ":latest")
    for case, (images, says) in CASES.items():
        r = _post(daemon, BODIES[api](images))
        assert 400 <= r.status_code < 500, (api, case, r.status_code, r.text[:300])
        msg = _error_message(api, r)
        assert says in msg, (api, case, msg)
        if case not in ("too many", "oversized"):  # those name the request's budget; the others their part
            assert {"openai": "messages[0].content[0]", "responses": "input[0].content[0]",
                    "anthropic": "messages[0].content[0]", "ollama-chat": "messages[0].images[0]",
                    "ollama-generate": "images[0]"}[api] in msg, (api, case, msg)
    path, body = BODIES[api]([BOMB])  # streamed: refused before the stream starts, in the same shape
    r = daemon.http.post(path, json={**body, "stream": True})
    assert r.status_code == 400 and "LOCALRUN_IMAGE_MAX_PIXELS" in _error_message(api, r), r.text
    _still_serving(daemon)
    assert daemon.runner_pid(VLM + ":latest") == pid  # the runner never saw them: no crash, no reload


@pytest.mark.parametrize("api", ["openai", "responses", "anthropic"])  # Ollama's API takes base64 only
def test_remote_url_while_fetching_is_off(daemon, api):
    url = "http://images.example.invalid/cat.png"  # never fetched: the setting is off
    path, body = {
        "openai": lambda: ("/v1/chat/completions", {"model": VLM, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": Q}]}]}),
        "responses": lambda: ("/v1/responses", {"model": VLM, "input": [{"role": "user", "content": [
            {"type": "input_image", "image_url": url}, {"type": "input_text", "text": Q}]}]}),
        "anthropic": lambda: ("/v1/messages", {"model": VLM, "max_tokens": 2, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": url}}, {"type": "text", "text": Q}]}]}),
    }[api]()
    r = daemon.http.post(path, json=body)
    assert r.status_code == 400, r.text
    assert "LOCALRUN_IMAGE_URLS=1" in _error_message(api, r)
    _still_serving(daemon)


@pytest.mark.parametrize("api", list(BODIES))
def test_a_model_without_a_projector_says_so(daemon, api):
    r = _post(daemon, BODIES[api]([GREEN], model=MODEL))
    assert r.status_code == 400, r.text
    msg = _error_message(api, r)
    assert "cannot take images" in msg and "vision projector" in msg, msg
    # the same model answers text (today's /api/chat used to drop the images and answer anyway)
    r = daemon.http.post("/api/chat", json={"model": MODEL, "stream": False, "options": {"num_predict": 2},
                                            "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200


def test_a_marker_typed_as_text_is_not_an_image_place(daemon):
    r = daemon.http.post("/api/chat", json={"model": VLM, "stream": False, "messages": [
        {"role": "user", "content": f"look: {MEDIA_MARKER}", "images": [b64(GREEN)]}]})
    assert r.status_code == 400 and "reserved for images" in r.json()["error"]
    r = daemon.http.post("/api/generate", json={"model": VLM, "stream": False, "raw": True, "prompt": "no place",
                                                "images": [b64(GREEN)]})
    assert r.status_code == 400 and MEDIA_MARKER in r.json()["error"]


def test_remote_urls_on_never_reach_loopback(tmp_path, vlm):
    """LOCALRUN_IMAGE_URLS=1: a URL whose host is (or resolves to) a loopback address is refused
    before any connection; this test fetches nothing from anywhere."""
    d = Daemon(tmp_path / "home", LOCALRUN_IMAGE_URLS="1", LOCALRUN_IMAGE_URL_TIMEOUT="5s")
    try:
        _create(d, vlm)
        for url in (f"{d.url}/api/version", f"http://localhost:{d.port}/x.png", "http://[::1]/x.png",
                    "http://169.254.169.254/latest/meta-data/", "http://10.0.0.1/x.png"):
            r = d.http.post("/v1/chat/completions", json={"model": VLM, "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": Q}]}]})
            assert r.status_code == 400, (url, r.text)
            assert "not a public address" in r.json()["error"]["message"], (url, r.text)
        r = d.http.post("/v1/chat/completions", json={"model": VLM, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "ftp://example.invalid/x.png"}}, {"type": "text", "text": Q}]}]})
        assert r.status_code == 400
        assert d.proc.poll() is None
    finally:
        d.stop()
