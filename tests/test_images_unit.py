"""server/images.py in process (fast, no daemon, no model): the part shapes each API sends, the
bounds (count, bytes, pixels from the header, corrupt and unsupported data), the address check for
remote URLs, and that a URL to a loopback or private address is refused before any connection
(this test connects to nothing)."""

from __future__ import annotations

import asyncio
import base64
import io
import ipaddress
import socket
import struct
import zlib

import pytest
from vlm_model import png

from localrun.config import settings
from localrun.errors import InvalidRequest
from localrun.server import params
from localrun.server.images import (ImageInput, check_image, fetch_image, from_base64, from_url, load_images,
                                    public_address, take_images)

pytest.importorskip("PIL")
RED = png((255, 0, 0), (16, 16))


def limits(**env):
    return settings({"LOCALRUN_HOME": "/nonexistent", **env})


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def test_part_shapes():
    assert from_url("data:image/png;base64," + b64(RED), "p").data == b64(RED)
    assert from_url("https://example.invalid/x.png", "p").url
    for bad, says in (("data:text/plain;base64,aGk=", "not an image"), ("data:image/png,rawbytes", "base64"),
                      ("file:///etc/passwd", "data URL"), ("", "non-empty"), (7, "non-empty")):
        with pytest.raises(InvalidRequest, match=says):
            from_url(bad, "messages[0].content[1]")
    with pytest.raises(InvalidRequest, match="messages\\[2\\].images\\[0\\]"):
        from_base64(None, "messages[2].images[0]")


def test_messages_carry_their_images_in_marker_order():
    msgs = params.normalize_messages([
        {"role": "user", "content": "first", "images": [b64(RED)]},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [{"type": "text", "text": "a"},
                                     {"type": "image_url", "image_url": {"url": "data:image/png;base64,QUJD"}},
                                     {"type": "image_url", "image_url": "data:image/png;base64,REVG"}]}],
        ollama_images=True)
    assert msgs[0]["content"] == "<__media__>first" and msgs[2]["content"] == "a<__media__><__media__>"
    images = take_images(msgs)
    assert [i.where for i in images] == ["messages[0].images[0]", "messages[2].content[1]", "messages[2].content[2]"]
    assert all("images" not in m for m in msgs)
    # without ollama_images (OpenAI, Anthropic, Responses) an "images" key of strings is no image
    assert take_images(params.normalize_messages([{"role": "user", "content": "x", "images": ["QUJD"]}])) is None


def _header_liar(w: int, h: int) -> bytes:
    ihdr = b"IHDR" + struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return RED[:8] + struct.pack(">I", 13) + ihdr + struct.pack(">I", zlib.crc32(ihdr)) + RED[33:]


def test_check_image():
    check_image(RED, "p", 256)
    with pytest.raises(InvalidRequest, match="16x16 = 256 pixels, over the limit of 255"):
        check_image(RED, "p", 255)
    with pytest.raises(InvalidRequest, match="p: .*(pixels|LOCALRUN_IMAGE_MAX_PIXELS)"):
        check_image(_header_liar(60_000, 60_000), "p", 1 << 24)  # refused from the header, never decoded
    with pytest.raises(InvalidRequest, match="p: the PNG image is corrupt or truncated"):
        noise = png((0, 0, 0), (64, 64), noise_seed=2)
        check_image(noise[: len(noise) // 2], "p", 1 << 24)
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (4, 4)).save(buf, format="WEBP")
    for data in (buf.getvalue(), b"GIF89a", b"\x00" * 64):
        with pytest.raises(InvalidRequest, match="p: "):
            check_image(data, "p", 1 << 24)


def test_load_images_bounds():
    ok = asyncio.run(load_images([ImageInput("a", data=b64(RED))], limits()))
    assert ok == [RED]
    with pytest.raises(InvalidRequest, match="LOCALRUN_IMAGE_MAX_COUNT"):
        asyncio.run(load_images([ImageInput("a", data=b64(RED))] * 3, limits(LOCALRUN_IMAGE_MAX_COUNT="2")))
    with pytest.raises(InvalidRequest, match="b: the request's images are over .*LOCALRUN_IMAGE_MAX_BYTES"):
        asyncio.run(load_images([ImageInput("a", data=b64(RED)), ImageInput("b", data=b64(RED))],
                                limits(LOCALRUN_IMAGE_MAX_BYTES=str(len(RED) + 10))))
    with pytest.raises(InvalidRequest, match="a: the image is not valid base64"):
        asyncio.run(load_images([ImageInput("a", data="not base64!")], limits()))
    with pytest.raises(InvalidRequest, match="LOCALRUN_IMAGE_URLS=1"):
        asyncio.run(load_images([ImageInput("u", url="http://example.invalid/x.png")], limits()))


@pytest.mark.parametrize("addr,ok", [("8.8.8.8", True), ("2001:4860:4860::8888", True), ("127.0.0.1", False),
                                     ("10.1.2.3", False), ("172.16.0.1", False), ("192.168.1.1", False),
                                     ("169.254.169.254", False), ("100.64.0.1", False), ("0.0.0.0", False),
                                     ("224.0.0.1", False), ("240.0.0.1", False), ("::1", False), ("::", False),
                                     ("fc00::1", False), ("fe80::1", False), ("::ffff:127.0.0.1", False),
                                     ("2002:7f00:1::", False), ("192.0.2.1", False)])
def test_public_address(addr, ok):
    assert public_address(ipaddress.ip_address(addr)) is ok


def test_a_loopback_url_is_refused_before_connecting(monkeypatch):
    connects = []
    real = socket.socket.connect

    def spy(self, address):
        connects.append(address)
        return real(self, address)

    monkeypatch.setattr(socket.socket, "connect", spy)
    for url in ("http://127.0.0.1:9/x.png", "http://localhost/x.png", "https://[::1]/x.png",
                "http://169.254.169.254/x", "http://0x7f000001/x.png"):
        with pytest.raises(InvalidRequest, match="not a public address|cannot resolve"):
            asyncio.run(fetch_image(url, "p", 1 << 20, 5.0))
    assert connects == []


@pytest.fixture
def loopback_server():
    """A small HTTP server on 127.0.0.1: an image, an endless body, a slow one, redirects."""
    import http.server
    import threading
    import time

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):
            if self.path == "/ok.png":
                self.send_response(200)
                self.send_header("Content-Length", str(len(RED)))
                self.end_headers()
                self.wfile.write(RED)
            elif self.path == "/endless":
                self.send_response(200)
                self.end_headers()
                try:
                    for _ in range(10_000):
                        self.wfile.write(b"\0" * 65536)
                except OSError:
                    pass
            elif self.path == "/slow":
                time.sleep(3)
                self.send_response(200)
                self.end_headers()
            elif self.path.startswith("/to/"):
                self.send_response(302)
                self.send_header("Location", self.path[len("/to"):] if self.path[4] != "h" else self.path[4:])
                self.end_headers()
            else:
                self.send_response(404)
                self.end_headers()

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_fetch_caps_and_redirect_checks(loopback_server, monkeypatch):
    """The fetch path itself, against a loopback server (loopback allowed for this test only, by
    name: 127.0.0.1; a redirect to a private address is still refused)."""
    from localrun.server import images

    monkeypatch.setattr(images, "public_address", lambda ip: str(ip) == "127.0.0.1")
    base = loopback_server
    assert asyncio.run(fetch_image(f"{base}/ok.png", "p", 1 << 20, 5.0)) == RED
    assert asyncio.run(fetch_image(f"{base}/to/ok.png", "p", 1 << 20, 5.0)) == RED
    with pytest.raises(InvalidRequest, match=r"the image at the URL is \d+ bytes, over"):
        asyncio.run(fetch_image(f"{base}/ok.png", "p", 10, 5.0))  # Content-Length over the cap
    with pytest.raises(InvalidRequest, match="over the request's image budget"):
        asyncio.run(fetch_image(f"{base}/endless", "p", 1 << 20, 5.0))  # streamed past the cap
    with pytest.raises(InvalidRequest, match="took over 1s"):
        asyncio.run(fetch_image(f"{base}/slow", "p", 1 << 20, 1.0))
    with pytest.raises(InvalidRequest, match="10.0.0.1, not a public address"):
        asyncio.run(fetch_image(f"{base}/to/http://10.0.0.1/x.png", "p", 1 << 20, 5.0))
    with pytest.raises(InvalidRequest, match="HTTP 404"):
        asyncio.run(fetch_image(f"{base}/missing", "p", 1 << 20, 5.0))
    with pytest.raises(InvalidRequest, match="redirects more than"):
        asyncio.run(fetch_image(f"{base}/to/to/to/to/to/ok.png", "p", 1 << 20, 5.0))
    # through load_images: the fetched bytes are checked like inline ones
    got = asyncio.run(load_images([ImageInput("u", url=f"{base}/ok.png")], limits(LOCALRUN_IMAGE_URLS="1")))
    assert got == [RED]


def test_images_are_checked_off_the_event_loop(monkeypatch):
    """Decoding and the header checks run on a worker thread: the event loop's thread never does them."""
    import threading

    from localrun.server import images

    seen = []
    real = images.check_image

    def spy(data, where, max_pixels):
        seen.append(threading.current_thread())
        return real(data, where, max_pixels)

    monkeypatch.setattr(images, "check_image", spy)

    async def main():
        loop_thread = threading.current_thread()
        await load_images([ImageInput("a", data=b64(RED)), ImageInput("b", data=b64(RED))], limits())
        return loop_thread

    loop_thread = asyncio.run(main())
    assert len(seen) == 2 and all(t is not loop_thread for t in seen)
