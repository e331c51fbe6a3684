"""Image files a user attaches to a message (the CLI's ``run --image``, a path inside the prompt, the
TUI's ``/image``), read on the client and sent as Ollama's ``images`` (base64) on /api/chat.

Client-side only (no server imports). A file is checked before anything is sent: it must exist, be
readable, be at most MAX_IMAGE_FILE_BYTES and start like a PNG, JPEG, WebP, GIF or BMP; anything else
raises AttachmentError with a message for the user. A WebP (which llama.cpp's decoder does not read)
is sent as PNG. The daemon applies its own bounds again.
"""

from __future__ import annotations

import base64
import os
import re
from dataclasses import dataclass
from pathlib import Path

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".gif", ".bmp")
MAX_IMAGE_FILE_BYTES = 20_000_000  # one attached file; the daemon's own cap per request may be lower
MAX_ATTACHMENTS = 32  # files per message

_EXT = r"\.(?:png|jpe?g|webp|gif|bmp)"
# a quoted path ("my cat.png" / 'my cat.png'), or a bare one whose spaces are escaped (my\ cat.png),
# standing alone between whitespace (trailing , ; : ! ? ) or a sentence's full stop allowed)
_PATH_IN_PROMPT = re.compile(
    rf"""(?<!\S)(?:"(?P<dq>[^"\n]+?{_EXT})"|'(?P<sq>[^'\n]+?{_EXT})'|(?P<bare>(?:\\ |[^\s"'])+?{_EXT}))"""
    rf"""(?=[,;:!?)]*(?:\.?(?:\s|$)))""", re.I)


class AttachmentError(ValueError):
    """An attached file cannot be sent (missing, unreadable, too large, not an image)."""


@dataclass
class Attachment:
    path: Path
    data: bytes
    kind: str  # "png", "jpeg", ...

    @property
    def b64(self) -> str:
        return base64.b64encode(self.data).decode("ascii")

    def label(self) -> str:
        return f"{self.path.name} ({self.kind}, {_human(len(self.data))})"


def _human(n: int) -> str:
    for unit in ("B", "KB", "MB"):
        if n < 1000 or unit == "MB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"


def sniff_image(head: bytes) -> str | None:
    """The image format from a file's first bytes, or None."""
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return "png"
    if head.startswith(b"\xff\xd8\xff"):
        return "jpeg"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "webp"
    if head[:6] in (b"GIF87a", b"GIF89a"):
        return "gif"
    if head.startswith(b"BM"):
        return "bmp"
    return None


def expand(path: str | os.PathLike, base: Path | None = None) -> Path:
    p = Path(os.path.expanduser(os.fspath(path)))
    if not p.is_absolute() and base is not None:
        p = base / p
    return p


def read_image(path: str | os.PathLike, base: Path | None = None) -> Attachment:
    """Read and check one image file; AttachmentError (naming the file) when it cannot be sent."""
    shown = os.fspath(path)
    p = expand(path, base)
    try:
        if not p.exists():
            raise AttachmentError(f"image {shown}: no such file")
        if not p.is_file():
            raise AttachmentError(f"image {shown}: not a regular file")
        size = p.stat().st_size
        if size > MAX_IMAGE_FILE_BYTES:
            raise AttachmentError(f"image {shown} is too large ({_human(size)}; at most {_human(MAX_IMAGE_FILE_BYTES)})")
        if size == 0:
            raise AttachmentError(f"image {shown} is empty")
        with open(p, "rb") as f:
            data = f.read(MAX_IMAGE_FILE_BYTES + 1)
    except AttachmentError:
        raise
    except (OSError, ValueError) as e:  # permission denied, a name too long, ...
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise AttachmentError(f"cannot read image {shown}: {reason}") from None
    if len(data) > MAX_IMAGE_FILE_BYTES:  # it grew while we looked
        raise AttachmentError(f"image {shown} is too large (at most {_human(MAX_IMAGE_FILE_BYTES)})")
    kind = sniff_image(data[:16])
    if kind is None:
        raise AttachmentError(f"{shown} is not an image localrun can send (PNG, JPEG, WebP, GIF or BMP)")
    if kind == "webp":  # llama.cpp's image decoder reads no WebP: send it as PNG
        data, kind = _webp_to_png(data, shown), "webp→png"
    return Attachment(p, data, kind)


def _webp_to_png(data: bytes, shown: str) -> bytes:
    """The first frame of a WebP as PNG; its size is read from the header and bounded
    (LOCALRUN_IMAGE_MAX_PIXELS) before anything is decoded."""
    import io

    from PIL import Image, UnidentifiedImageError

    from localrun.config import settings

    limit = settings().image_max_pixels
    try:
        with Image.open(io.BytesIO(data), formats=["WEBP"]) as im:
            w, h = im.size
            if w * h > limit:
                raise AttachmentError(f"image {shown} is {w}x{h} pixels; at most {limit} (LOCALRUN_IMAGE_MAX_PIXELS)")
            out = io.BytesIO()
            im.convert("RGBA" if "A" in im.getbands() else "RGB").save(out, format="PNG")
            return out.getvalue()
    except AttachmentError:
        raise
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
        raise AttachmentError(f"image {shown} could not be decoded as WebP ({e})") from None


def read_images(paths: list[str], base: Path | None = None) -> list[Attachment]:
    if len(paths) > MAX_ATTACHMENTS:
        raise AttachmentError(f"{len(paths)} images attached; at most {MAX_ATTACHMENTS} per message")
    return [read_image(p, base) for p in paths]


def split_image_paths(prompt: str, base: Path | None = None) -> tuple[str, list[str]]:
    """Ollama's habit: paths of existing image files written inside a prompt become attachments and
    leave the prompt. Returns (the prompt without them, the paths as written). A path that names no
    file stays in the prompt as text."""
    found: list[str] = []

    def take(m: re.Match) -> str:
        raw = m.group("dq") or m.group("sq") or m.group("bare").replace("\\ ", " ")
        try:
            ok = expand(raw, base).is_file()
        except (OSError, ValueError):
            ok = False
        if not ok:
            return m.group(0)
        found.append(raw)
        return ""

    text = _PATH_IN_PROMPT.sub(take, prompt)
    if not found:
        return prompt, []
    text = re.sub(r"[ \t]+([,;:!?.])", r"\1", re.sub(r"[ \t]{2,}", " ", text))
    return text.strip(), found


def is_image_path(text: str, base: Path | None = None) -> str | None:
    """The path when ``text`` is nothing but one existing image file's path (a file dropped on a
    terminal: quoted, or with escaped spaces), else None."""
    t = text.strip()
    rest, paths = split_image_paths(t, base)
    return paths[0] if len(paths) == 1 and not rest.strip() else None


__all__ = ["Attachment", "AttachmentError", "IMAGE_EXTENSIONS", "MAX_ATTACHMENTS", "MAX_IMAGE_FILE_BYTES",
           "is_image_path", "read_image", "read_images", "sniff_image", "split_image_paths"]
