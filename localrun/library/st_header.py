"""A .safetensors file's header, checked (bounded reads): what the store asks of a stored blob and what create
asks of a user's file. A leaf of the library (the store imports it: no import circle through create and pull)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

from localrun.errors import InvalidRequest
from localrun.library.paths import open_regular

MAX_SAFETENSORS_HEADER = 100 * 1024 * 1024
_ST_DTYPES = {"F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "U16", "U32", "U64", "BOOL",
              "F8_E4M3", "F8_E5M2", "F8_E8M0", "F4", "F6_E2M3", "F6_E3M2", "C64"}


def safetensors_header_params(path: Path, display: str) -> tuple[int, dict[str, int]]:
    """Validate a .safetensors header (bounds of every tensor) and count its elements.
    Returns (parameter count, {dtype: bytes})."""
    f, size = open_regular(path, display)
    with f:
        head = f.read(8)
        if len(head) < 8:
            raise InvalidRequest(f"{display} is not a valid safetensors file: truncated header")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_SAFETENSORS_HEADER or 8 + n > size:
            raise InvalidRequest(f"{display} is not a valid safetensors file: header length {n} is absurd")
        try:
            header = json.loads(f.read(n))
        except (ValueError, UnicodeDecodeError):
            raise InvalidRequest(f"{display} is not a valid safetensors file: header is not JSON") from None
    if not isinstance(header, dict):
        raise InvalidRequest(f"{display} is not a valid safetensors file: header is not an object")
    data = size - 8 - n
    params = 0
    by_dtype: dict[str, int] = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (b, e) = t["dtype"], t["shape"], t["data_offsets"]
            ok = (dtype in _ST_DTYPES and isinstance(shape, list) and len(shape) <= 8
                  and all(isinstance(d, int) and 0 <= d < 1 << 40 for d in shape)
                  and isinstance(b, int) and isinstance(e, int) and 0 <= b <= e <= data)
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise InvalidRequest(f"{display} is not a valid safetensors file: tensor {name[:80]!r} is malformed or runs past the end")
        count = 1
        for d in shape:
            count *= d
        params += count
        by_dtype[dtype] = by_dtype.get(dtype, 0) + (e - b)
    return params, by_dtype


__all__ = ["safetensors_header_params", "MAX_SAFETENSORS_HEADER"]
