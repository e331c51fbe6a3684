"""Images in requests: the translators read each API's shape into :class:`ImageInput` (where the
image sat, its base64 text or its URL) and put MEDIA_MARKER in the message text where it goes; the
generation service turns them into bytes with :func:`load_images`, bounded:

- images per request (LOCALRUN_IMAGE_MAX_COUNT) and encoded bytes per request, all images together
  (LOCALRUN_IMAGE_MAX_BYTES; checked on the base64 length before decoding, and while a URL streams),
- pixels per image (LOCALRUN_IMAGE_MAX_PIXELS), read from the header before anything is decoded
  (a decompression bomb is refused, not decoded); then the image is decoded once on a worker
  thread, so a corrupt or unsupported one is a 400 naming its part, never a runner's problem,
- http(s) URLs only with LOCALRUN_IMAGE_URLS=1: the host is resolved, every address must be public
  (no loopback, private, link-local, reserved, multicast), the request goes to the checked address
  (TLS still verified against the host name), redirects are followed by hand and checked the same
  way, the body is streamed with a byte cap and the whole fetch has a time bound. No proxy from the
  environment is used (it would reach addresses the check never saw).

Nothing here runs on the event loop for long: decoding and header reads go to a worker thread.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import ipaddress
import socket
from dataclasses import dataclass
from typing import Any
from urllib.parse import urljoin

from localrun.backends.base import MEDIA_MARKER
from localrun.errors import InvalidRequest

# what llama.cpp's image decoder (stb_image, in libmtmd) reads; others (WebP, TIFF, ...) it cannot
FORMATS = ("PNG", "JPEG", "GIF", "BMP")
MAX_REDIRECTS = 3


@dataclass
class ImageInput:
    """One image of a request, as the client sent it (not yet decoded)."""

    where: str  # the request part it came from ("messages[1].content[0]"), named in errors
    data: str | None = None  # base64 text
    url: str | None = None  # an http(s) URL

    def __repr__(self) -> str:  # never a megabyte of base64 in a log line
        what = "url" if self.url else f"{len(self.data or '')} base64 chars"
        return f"ImageInput({self.where!r}, {what})"


def from_base64(data: Any, where: str) -> ImageInput:
    if not isinstance(data, str) or not data.strip():
        raise InvalidRequest(f"{where}: an image must be a non-empty base64 string")
    return ImageInput(where, data=data)


def from_url(url: Any, where: str) -> ImageInput:
    """A data URL (``data:image/png;base64,...``) or an http(s) URL."""
    if not isinstance(url, str) or not url.strip():
        raise InvalidRequest(f"{where}: the image URL must be a non-empty string")
    if url[:5].lower() == "data:":
        head, sep, payload = url[5:].partition(",")
        if not sep or not head.lower().endswith(";base64"):
            raise InvalidRequest(f"{where}: a data URL must be base64 (data:image/png;base64,...)")
        media = head[: -len(";base64")].split(";")[0].strip().lower()
        if media and not media.startswith("image/"):
            raise InvalidRequest(f"{where}: the data URL holds {media[:40]}, not an image")
        return from_base64(payload, where)
    if url[:7].lower() == "http://" or url[:8].lower() == "https://":
        return ImageInput(where, url=url)
    raise InvalidRequest(f"{where}: the image URL must be a data URL (data:image/png;base64,...) or an http(s) URL")


def markers(n: int) -> str:
    return MEDIA_MARKER * n


def take_images(messages: list[dict]) -> list[ImageInput] | None:
    """The images of normalized messages, in prompt order (taken off the messages)."""
    out: list[ImageInput] = []
    for m in messages:
        out.extend(m.pop("images", None) or ())
    return out or None


# -- bytes ------------------------------------------------------------------------------------
async def load_images(images: list[ImageInput], settings: Any) -> list[bytes]:
    """The images' bytes, each checked (count, bytes, pixels, decodable); InvalidRequest naming the
    part otherwise. Remote URLs are fetched only when settings.image_urls is on."""
    if len(images) > settings.image_max_count:
        raise InvalidRequest(f"the request carries {len(images)} images; the limit is {settings.image_max_count} "
                             "(LOCALRUN_IMAGE_MAX_COUNT)")
    budget = settings.image_max_bytes
    for img in images:  # refuse what is too big before decoding or fetching anything
        if img.url is not None and not settings.image_urls:
            raise InvalidRequest(f"{img.where}: localrun does not fetch image URLs unless the daemon runs with "
                                 "LOCALRUN_IMAGE_URLS=1; send the image inline (base64 / a data URL)")
        if img.data is not None:
            budget -= max(0, len(img.data) * 3 // 4 - 2)  # the decoded size, to within the padding
            if budget < 0:
                raise _too_many_bytes(img.where, settings)
    raw: list[bytes | None] = [None] * len(images)
    budget = settings.image_max_bytes
    for i, img in enumerate(images):
        if img.url is not None:
            data = await fetch_image(img.url, img.where, budget, settings.image_url_timeout)
            raw[i] = data
            budget -= len(data)
    return await asyncio.to_thread(_decode_all, images, raw, settings)


def _too_many_bytes(where: str, settings: Any) -> InvalidRequest:
    return InvalidRequest(f"{where}: the request's images are over {settings.image_max_bytes} bytes together "
                          "(LOCALRUN_IMAGE_MAX_BYTES)")


def _decode_all(images: list[ImageInput], raw: list[bytes | None], settings: Any) -> list[bytes]:
    """Worker thread: base64 -> bytes, the total checked, each image's header and data checked."""
    out = []
    total = 0
    for img, data in zip(images, raw):
        if data is None:
            try:
                data = base64.b64decode("".join(img.data.split()), validate=True)
            except (binascii.Error, ValueError):
                raise InvalidRequest(f"{img.where}: the image is not valid base64") from None
        total += len(data)
        if total > settings.image_max_bytes:
            raise _too_many_bytes(img.where, settings)
        check_image(data, img.where, settings.image_max_pixels)
        out.append(data)
    return out


def check_image(data: bytes, where: str, max_pixels: int) -> None:
    """A supported format, at most `max_pixels` pixels (from the header, before decoding), and
    data that decodes. Runs on a worker thread."""
    import warnings

    from PIL import Image, UnidentifiedImageError

    if not data:
        raise InvalidRequest(f"{where}: the image is empty")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            im = Image.open(io.BytesIO(data), formats=FORMATS)  # lazy: reads the header only
        except Image.DecompressionBombError:
            raise InvalidRequest(f"{where}: the image has too many pixels (over LOCALRUN_IMAGE_MAX_PIXELS="
                                 f"{max_pixels})") from None
        except UnidentifiedImageError:
            raise InvalidRequest(f"{where}: not an image localrun can read: send {', '.join(FORMATS[:-1])} or "
                                 f"{FORMATS[-1]}") from None
        except Exception as exc:  # a header that breaks the parser
            raise InvalidRequest(f"{where}: the image is corrupt ({type(exc).__name__})") from None
        with im:
            w, h = im.size
            if w <= 0 or h <= 0:
                raise InvalidRequest(f"{where}: the image has no pixels")
            if w * h > max_pixels:
                raise InvalidRequest(f"{where}: the image is {w}x{h} = {w * h} pixels, over the limit of {max_pixels} "
                                     "(LOCALRUN_IMAGE_MAX_PIXELS); send a smaller image")
            try:
                im.load()
            except Exception as exc:  # truncated or corrupt data
                raise InvalidRequest(f"{where}: the {im.format} image is corrupt or truncated "
                                     f"({type(exc).__name__}: {str(exc)[:80]})") from None


# -- remote URLs --------------------------------------------------------------------------------
def public_address(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Whether an image may be fetched from `ip`: a global unicast address, nothing else."""
    if isinstance(ip, ipaddress.IPv6Address):
        inner = ip.ipv4_mapped or ip.sixtofour or (ip.teredo[1] if ip.teredo else None)
        if inner is not None and not public_address(inner):
            return False
    return ip.is_global and not ip.is_multicast and not ip.is_reserved


async def _resolve(host: str, port: int, where: str) -> str:
    """The address to connect to: every address the host resolves to must be public."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise InvalidRequest(f"{where}: cannot resolve the image URL's host {host[:100]!r} ({exc.strerror or exc})") from None
    addrs = []
    for info in infos:
        ip = ipaddress.ip_address(str(info[4][0]).split("%")[0])
        if not public_address(ip):
            raise InvalidRequest(f"{where}: the image URL's host {host[:100]!r} is {ip}, not a public address; "
                                 "localrun fetches images from public addresses only (never loopback, private, "
                                 "link-local or reserved ones)")
        addrs.append(ip)
    if not addrs:
        raise InvalidRequest(f"{where}: the image URL's host {host[:100]!r} has no address")
    return str(addrs[0])


async def fetch_image(url: str, where: str, cap: int, timeout: float) -> bytes:
    """GET `url` (public addresses only, redirects checked, at most `cap` bytes, `timeout` seconds)."""
    import httpx

    try:
        return await asyncio.wait_for(_fetch(url, where, cap), timeout)
    except asyncio.TimeoutError:
        raise InvalidRequest(f"{where}: fetching the image URL took over {timeout:g}s (LOCALRUN_IMAGE_URL_TIMEOUT)") from None
    except httpx.HTTPError as exc:
        raise InvalidRequest(f"{where}: could not fetch the image URL ({type(exc).__name__})") from None


async def _fetch(url: str, where: str, cap: int) -> bytes:
    import httpx

    async with httpx.AsyncClient(follow_redirects=False, trust_env=False) as client:
        for _ in range(MAX_REDIRECTS + 1):
            try:
                u = httpx.URL(url)
            except Exception:
                raise InvalidRequest(f"{where}: the image URL is not a valid URL") from None
            if u.scheme not in ("http", "https") or not u.host:
                raise InvalidRequest(f"{where}: the image URL must be http(s) with a host")
            port = u.port or (443 if u.scheme == "https" else 80)
            ip = await _resolve(u.host, port, where)
            target = u.copy_with(host=ip)
            headers = {"Host": u.netloc.decode("ascii"), "Accept": "image/*"}
            ext = {"sni_hostname": u.host} if u.scheme == "https" else {}
            async with client.stream("GET", target, headers=headers, extensions=ext) as r:
                if r.is_redirect and "location" in r.headers:
                    url = urljoin(url, r.headers["location"])
                    continue
                if r.status_code != 200:
                    raise InvalidRequest(f"{where}: fetching the image URL answered HTTP {r.status_code}")
                length = r.headers.get("content-length")
                if length and length.isdigit() and int(length) > cap:
                    raise InvalidRequest(f"{where}: the image at the URL is {length} bytes, over the request's "
                                         "image budget (LOCALRUN_IMAGE_MAX_BYTES)")
                buf = bytearray()
                async for piece in r.aiter_bytes():
                    buf += piece
                    if len(buf) > cap:
                        raise InvalidRequest(f"{where}: the image at the URL is over the request's image budget "
                                             "(LOCALRUN_IMAGE_MAX_BYTES)")
                return bytes(buf)
    raise InvalidRequest(f"{where}: the image URL redirects more than {MAX_REDIRECTS} times")


__all__ = ["ImageInput", "FORMATS", "from_base64", "from_url", "take_images", "markers", "load_images",
           "check_image", "public_address", "fetch_image"]
