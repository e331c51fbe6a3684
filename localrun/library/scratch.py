"""The store's scratch space: temp files and directories under tmp/, each flock'ed by its writer, and named locks.

Every write into the store goes through a temp file here first (see store.py). A temp is locked by
its writer for as long as it exists, and the kernel drops a dead process's locks, so clean_temp()
removes exactly what killed processes left behind.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import stat
import threading
import uuid
from pathlib import Path
from typing import BinaryIO, Callable, Iterator

from localrun.library.disk_errors import storage_errors

try:
    import fcntl
except ImportError:  # Windows: a file another process holds open cannot be deleted there
    fcntl = None  # type: ignore[assignment]


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def lock_nb(fd: int) -> bool:
    """Take an exclusive flock on fd without waiting; False when another process holds it."""
    if fcntl is None:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


class Scratch:
    """tmp/ and locks/ of a store; `ensure` makes the store's directories (called before any temp or lock)."""

    def __init__(self, tmp: Path, locks: Path, ensure: Callable[[], None]):
        self.tmp, self.locks, self.ensure = tmp, locks, ensure

    @contextlib.contextmanager
    def lock(self, key: str, cancel: threading.Event | None = None, on_wait: Callable[[], None] | None = None):
        """A cross-process (and cross-thread) exclusive lock named by key."""
        import filelock

        self.ensure()
        name = hashlib.sha256(key.encode()).hexdigest()[:32]
        lk = filelock.FileLock(str(self.locks / f"{name}.lock"))
        waited = False
        while True:
            try:
                lk.acquire(timeout=0.2)
                break
            except filelock.Timeout:
                if cancel is not None and cancel.is_set():
                    from localrun.library.model import Cancelled

                    raise Cancelled("pull cancelled") from None
                if not waited and on_wait:
                    on_wait()
                waited = True
        try:
            yield
        finally:
            lk.release()

    @contextlib.contextmanager
    def _tmp_gate(self, exclusive: bool) -> Iterator[None]:
        """Writers hold locks/tmp.gate shared while they create and lock a temp;
        clean_temp holds it exclusively, so it never sees a temp not yet locked."""
        if fcntl is None:
            yield
            return
        fd = os.open(self.locks / "tmp.gate", os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            yield
        finally:
            os.close(fd)

    def _owned_temp(self, directory: bool) -> tuple[Path, int]:
        """A new file or directory under tmp/ and an fd holding its flock."""
        self.ensure()
        with storage_errors("create a temp file in the model library"), self._tmp_gate(exclusive=False):
            path = self.tmp / uuid.uuid4().hex
            if directory:
                path.mkdir()
                fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            else:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
            lock_nb(fd)  # a brand-new inode: nobody else can hold it
        return path, fd

    @contextlib.contextmanager
    def temp_file(self) -> Iterator[tuple[Path, BinaryIO]]:
        """A new file under tmp/, open for writing and owned (locked) by this process until
        the block ends; removed then, unless it was moved into the store (adopt)."""
        path, fd = self._owned_temp(directory=False)
        f = os.fdopen(fd, "w+b")
        try:
            yield path, f
        finally:
            with contextlib.suppress(OSError):
                path.unlink()  # still holding the lock: clean_temp never races this
            f.close()

    @contextlib.contextmanager
    def temp_dir(self) -> Iterator[Path]:
        """Like temp_file, for a directory (views are built in one, then renamed)."""
        path, fd = self._owned_temp(directory=True)
        try:
            yield path
        finally:
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            os.close(fd)

    def clean_temp(self) -> int:
        """Remove what a killed process left under tmp/: every temp file or directory
        whose lock nobody holds. Temps of live writers (this process's included) stay, and
        so do partial downloads (downloads/*.partial, resumed by the next pull). Returns
        how many entries it removed."""
        if not self.tmp.is_dir():
            return 0
        removed = 0
        self.ensure()
        with self._tmp_gate(exclusive=True):
            for p in list(self.tmp.iterdir()):
                removed += self._remove_unowned(p)
        return removed

    @staticmethod
    def _remove_unowned(p: Path) -> bool:
        try:
            st = p.lstat()
            if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
                p.unlink()  # a link or a FIFO: never ours to keep
                return True
            fd = os.open(p, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
                         | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            return False
        try:
            if not lock_nb(fd):
                return False  # a live process is writing it
            if stat.S_ISDIR(st.st_mode):
                shutil.rmtree(p)
            else:
                p.unlink()
            return True
        except OSError:
            return False
        finally:
            os.close(fd)

