"""Paths a user supplies (``FROM ./model.gguf``, a safetensors directory, ``/api/create``'s
``from``): opened without blocking on a FIFO or a device, and every OSError they cause
turned into an InvalidRequest (HTTP 400) that names only what the user wrote, never the
daemon's working directory, home or user name (see docs/security.md, 'Paths a user
names')."""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path
from typing import BinaryIO, Iterator

from localrun.errors import InvalidRequest

_REASONS = {
    errno.ENOENT: "no such file or directory",
    errno.ENAMETOOLONG: "the path is too long",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
    errno.ELOOP: "too many levels of symbolic links",
    errno.ENOTDIR: "a part of the path is not a directory",
    errno.EISDIR: "it is a directory",
    errno.ENXIO: "no such device",
    errno.ENODEV: "no such device",
    errno.EIO: "input/output error while reading it",
}


def shown(text: str | os.PathLike, limit: int = 80) -> str:
    """How an error message names a user's path: as written when relative, only its last
    component when absolute or ~-based; control characters escaped; cut to `limit`."""
    t = os.fspath(text)
    if t.startswith(("/", "~", "\\")) or (len(t) > 1 and t[1] == ":"):
        t = ".../" + os.path.basename(t.rstrip("/\\"))
    t = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in t[: limit + 1])
    return t if len(t) <= limit else t[:limit] + "..."


def reason(e: OSError) -> str:
    return _REASONS.get(e.errno) or (e.strerror or type(e).__name__).lower()


@contextlib.contextmanager
def user_path_errors(what: str) -> Iterator[None]:
    """OSErrors inside become InvalidRequest("<what>: <reason>"); the exception's own text,
    which carries the absolute path, is dropped."""
    try:
        yield
    except OSError as e:
        raise InvalidRequest(f"{what}: {reason(e)}") from None


def check_regular(path: Path, what: str) -> os.stat_result:
    """stat a user's path (following links) and refuse anything but a regular file."""
    with user_path_errors(what):
        st = os.stat(path)
    if stat.S_ISDIR(st.st_mode):
        raise InvalidRequest(f"{what} is a directory, not a file")
    if not stat.S_ISREG(st.st_mode):
        raise InvalidRequest(f"{what} is not a regular file (directory, device, FIFO or socket)")
    return st


def open_regular(path: Path, what: str) -> tuple[BinaryIO, int]:
    """Open a user's regular file for reading: (file, size). Checked with stat before the
    open (a device is never opened) and with fstat after it (a file swapped for a FIFO in
    between never blocks: O_NONBLOCK)."""
    check_regular(path, what)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
    with user_path_errors(what):
        fd = os.open(path, flags)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InvalidRequest(f"{what} is not a regular file (directory, device, FIFO or socket)")
        if flags & getattr(os, "O_NONBLOCK", 0):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb"), st.st_size
    except BaseException:
        os.close(fd)
        raise


def files_view() -> str:
    """Which view of the file system this process has, as a short opaque tag: two processes with
    the same tag see the same files at the same paths. On Linux: the boot and the mount namespace
    (a container has its own, though it may share the host's loopback through a published port);
    elsewhere the host's name. `localrun create` sends a daemon paths only when its tag is the CLI's,
    and uploads the files otherwise."""
    import hashlib
    import socket

    parts = [socket.gethostname()]
    try:
        parts.append(Path("/proc/sys/kernel/random/boot_id").read_text().strip())
        parts.append(str(os.stat("/proc/self/ns/mnt").st_ino))
    except OSError:
        pass
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


__all__ = ["shown", "reason", "user_path_errors", "check_regular", "open_regular", "files_view"]
