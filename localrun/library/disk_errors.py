"""Storage errors: an OSError while writing the library turned into a LocalrunError (507 when the disk is full).

Every part of the store (blobs, manifests, temp files) and the daemon's own stores use these, so a
full disk reads the same wherever it happens.
"""

from __future__ import annotations

import contextlib
import errno
from typing import Iterator

from localrun.errors import LocalrunError


class DiskFull(LocalrunError):
    status = 507
    code = "disk_full"


def disk_full_error(e: OSError, what: str) -> LocalrunError:
    if e.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", -1)):
        return DiskFull(f"disk full: not enough space to {what}; free some space (e.g. `localrun rm` unused models) and try again")
    return LocalrunError(f"cannot {what}: {e.strerror or e}", status=500, code="storage_error")


@contextlib.contextmanager
def storage_errors(what: str) -> Iterator[None]:
    """Turn OSErrors into LocalrunErrors (507 'disk full: ...' for ENOSPC)."""
    try:
        yield
    except LocalrunError:
        raise
    except OSError as e:
        raise disk_full_error(e, what) from None
