"""Validated GGUF header reading.

A GGUF file is untrusted input: truncated headers, string or array lengths that run
past the end of the file, absurd dimension counts and tensor data past the end of the
file all crashed llama.cpp and Ollama (see docs/security.md, 'Untrusted model files').
:func:`read_gguf_info` walks the whole header with a bounds check on every read BEFORE
anything else reads the file, and only then reports what it found. The format knowledge
(value types, quantization block sizes, file types, key names) comes from the ``gguf``
library; the walk itself is bounded and skips the large token arrays instead of building
them (``gguf.GGUFReader`` materializes all of them: seconds per call on a 100 MB
file, and unbounded memory on a hostile one).
"""

from __future__ import annotations

import mmap
import os
import struct
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from localrun.errors import InvalidRequest
from localrun.library.paths import open_regular

GGUF_MAGIC = b"GGUF"
MAX_DIMS = 4  # GGML_MAX_DIMS
# The bounds below cap the work and memory one header can cost, whatever the file's
# size: real models have < 100 metadata keys, < 20k tensors, < 2M token/merge strings.
MAX_KEY_LEN = 1024  # metadata keys and tensor names (llama.cpp caps tensor names at 63 bytes)
MAX_STRING_LEN = 64 * 1024 * 1024  # a string value's length (long ones are skipped, never decoded)
MAX_ARRAY_DEPTH = 2
MAX_KV = 1 << 16
MAX_TENSORS = 1 << 16
MAX_ARRAY_ITEMS = 1 << 22  # strings and nested arrays walked in all metadata arrays together
MAX_ELEMENTS = 1 << 60
METADATA_ARRAY_LIMIT = 16  # small arrays (general.languages) are kept in .metadata; big ones omitted
METADATA_STRING_LIMIT = 1 << 20  # longer strings are skipped (shown as null), never decoded
MAX_KEPT_STRINGS = 16 << 20  # bytes of metadata strings decoded per header, all together
# cached_gguf_info: (path, inode, size, mtime) -> the header read
_info_cache: dict[tuple, GGUFInfo] = {}
_info_lock = threading.Lock()


@dataclass
class GGUFInfo:
    architecture: str
    parameter_count: int
    file_type: str  # quantization name, e.g. "Q4_1", "Q4_K_M", "F16"
    context_length: int | None
    block_count: int | None
    embedding_length: int | None
    head_count: int | None
    head_count_kv: int | None
    feed_forward_length: int | None
    vocab_size: int | None
    chat_template: str | None
    bos_token_id: int | None
    eos_token_id: int | None
    tensor_bytes: int
    metadata: dict[str, Any] = field(default_factory=dict)
    tensor_count: int = 0
    version: int = 0
    file_size: int = 0
    tokenizer_model: str | None = None
    # per-layer tensor bytes ("blk.N" -> bytes), for the daemon's memory planning
    layer_bytes: dict[int, int] = field(default_factory=dict, repr=False)
    # each tensor's dimensions, innermost first (ggml's ne), e.g. for checking that a LoRA adapter fits a model
    tensor_dims: dict[str, tuple[int, ...]] = field(default_factory=dict, repr=False)

    @property
    def quantization(self) -> str:
        return self.file_type

    @property
    def parameter_size(self) -> str:
        return format_parameter_count(self.parameter_count)

    @property
    def adapter_type(self) -> str | None:
        """"lora" (or another adapter.type) for an adapter GGUF (general.type "adapter", as llama.cpp's
        convert_lora_to_gguf.py writes it), None for a model."""
        if self.metadata.get("general.type") != "adapter":
            return None
        return str(self.metadata.get("adapter.type") or "unknown")

    def model_info(self) -> dict[str, Any]:
        """Ollama /api/show 'model_info': scalar metadata plus the parameter count."""
        out = dict(self.metadata)
        out["general.architecture"] = self.architecture
        out["general.parameter_count"] = self.parameter_count
        return dict(sorted(out.items()))


def format_parameter_count(n: int) -> str:
    if n >= 1_000_000_000:
        return f"{n / 1e9:.1f}B"
    if n >= 1_000_000:
        return f"{n / 1e6:.2f}M"
    if n >= 1_000:
        return f"{n / 1e3:.2f}K"
    return str(n)


class _Bad(Exception):
    pass


_U64 = struct.Struct("<Q")


class _Walker:
    def __init__(self, buf, size: int):
        self.buf = buf
        self.size = size
        self.pos = 0
        self.items_left = MAX_ARRAY_ITEMS
        self.kept_left = MAX_KEPT_STRINGS

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise _Bad(f"{what} runs past the end of the file (truncated?)")

    def unpack(self, fmt: str, n: int, what: str):
        self.need(n, what)
        v = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += n
        return v

    def u32(self, what: str) -> int:
        return self.unpack("<I", 4, what)

    def u64(self, what: str) -> int:
        return self.unpack("<Q", 8, what)

    def string(self, what: str, limit: int = MAX_STRING_LEN, keep: bool = True) -> str | None:
        """A string; None (skipped, not decoded) when keep is False or it is long."""
        n = self.u64(f"{what} length")
        if n > limit:
            raise _Bad(f"{what} length {n} is absurd")
        self.need(n, what)
        if not keep or n > METADATA_STRING_LIMIT:
            self.pos += n
            return None
        self.kept_left -= n
        if self.kept_left < 0:
            raise _Bad(f"metadata strings total more than {MAX_KEPT_STRINGS >> 20} MiB")
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise _Bad(f"{what} is not valid UTF-8") from None

    def take_items(self, count: int, key: str) -> None:
        self.items_left -= count
        if self.items_left < 0:
            raise _Bad(f"metadata {key!r}: the metadata arrays hold more than {MAX_ARRAY_ITEMS} strings or arrays in all")

    def skip_strings(self, count: int, key: str) -> None:
        """Step over `count` strings with a bounds check each (token lists: fast path)."""
        buf, pos, end, unpack = self.buf, self.pos, self.size, _U64.unpack_from
        for _ in range(count):
            if pos + 8 > end:
                break
            pos += 8 + unpack(buf, pos)[0]
        else:
            if pos <= end:
                self.pos = pos
                return
        raise _Bad(f"metadata {key!r} array runs past the end of the file (truncated?)")


_TYPES: tuple | None = None


def _value_types():
    global _TYPES
    if _TYPES is None:
        from gguf import GGUFValueType as T

        scalars = {
            T.UINT8: ("<B", 1), T.INT8: ("<b", 1), T.UINT16: ("<H", 2), T.INT16: ("<h", 2),
            T.UINT32: ("<I", 4), T.INT32: ("<i", 4), T.FLOAT32: ("<f", 4), T.BOOL: ("<?", 1),
            T.UINT64: ("<Q", 8), T.INT64: ("<q", 8), T.FLOAT64: ("<d", 8),
        }
        _TYPES = (T, scalars, {int(t): t for t in T})
    return _TYPES


def _read_value(w: _Walker, vtype: int, key: str, depth: int, keep: bool):
    T, scalars, by_value = _value_types()
    t = by_value.get(vtype)
    if t is None:
        raise _Bad(f"metadata {key!r} has unknown value type {vtype}")
    if t in scalars:
        fmt, n = scalars[t]
        v = w.unpack(fmt, n, f"metadata {key!r}")
        if t == T.BOOL:
            return bool(v)
        return v
    if t == T.STRING:
        return w.string(f"metadata {key!r}", keep=keep)
    # ARRAY
    if depth >= MAX_ARRAY_DEPTH:
        raise _Bad(f"metadata {key!r} nests arrays too deeply")
    etype = w.u32(f"metadata {key!r} array type")
    count = w.u64(f"metadata {key!r} array length")
    et = by_value.get(etype)
    if et is None:
        raise _Bad(f"metadata {key!r} array has unknown element type {etype}")
    if et in scalars:
        fmt, n = scalars[et]
        if count > (w.size - w.pos) // n:
            raise _Bad(f"metadata {key!r} array length {count} runs past the end of the file")
        if keep and count <= METADATA_ARRAY_LIMIT:
            vals = list(struct.unpack_from(f"<{count}{fmt[1]}", w.buf, w.pos))
            w.pos += count * n
            return vals
        w.pos += count * n
        return _ArrayLen(count)
    # arrays of strings or arrays: each element is at least 8 bytes (its length / header)
    if count > (w.size - w.pos) // 8:
        raise _Bad(f"metadata {key!r} array length {count} runs past the end of the file")
    w.take_items(count, key)
    small = keep and count <= METADATA_ARRAY_LIMIT
    if et == T.STRING and not small:
        w.skip_strings(count, key)
        return _ArrayLen(count)
    vals = []
    for _ in range(count):
        v = _read_value(w, etype, key, depth + 1, keep=small)
        if small:
            vals.append(v)
    return vals if small else _ArrayLen(count)


class _ArrayLen(int):
    """Marks a big array that was skipped; the int is its length."""


def _count(v: Any, floats: bool = True) -> int | None:
    """A non-negative integer from a metadata value (an integral float too), else None:
    a hostile header's inf, nan, negative, bool or string never becomes a size."""
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v if v >= 0 else None
    if floats and isinstance(v, float) and v.is_integer() and 0 <= v < 2.0 ** 63:
        return int(v)
    return None


def _file_type_name(value: int | None, tensor_types: dict[int, int]) -> str:
    from gguf import GGMLQuantizationType, LlamaFileType

    if value is not None:
        try:
            name = LlamaFileType(value).name
            for prefix in ("MOSTLY_", "ALL_"):
                if name.startswith(prefix):
                    name = name[len(prefix):]
            return name
        except ValueError:
            pass
    if tensor_types:
        t = max(tensor_types, key=tensor_types.get)
        try:
            return GGMLQuantizationType(t).name
        except ValueError:
            pass
    return "unknown"


def read_gguf_info(path: str | os.PathLike, *, display_name: str | None = None) -> GGUFInfo:
    """Validate a GGUF file's header and tensor table and describe it.

    Raises InvalidRequest("<name> is not a valid GGUF: <why>") on anything malformed.
    ``display_name`` is what error messages call the file (default: its base name, so
    no directory or user name leaks into HTTP errors).
    """
    p = Path(path)
    what = display_name or p.name
    f, size = open_regular(p, what)
    with f:
        if size < 24:
            raise InvalidRequest(f"{what} is not a valid GGUF: the file is only {size} bytes (truncated?)")
        try:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as e:
            raise InvalidRequest(f"{what} is not a valid GGUF: cannot map it ({e})") from None
        try:
            return _walk(buf, size)
        except _Bad as e:
            raise InvalidRequest(f"{what} is not a valid GGUF: {e}") from None
        finally:
            buf.close()


def _walk(buf, size: int) -> GGUFInfo:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    w = _Walker(buf, size)
    if bytes(buf[0:4]) != GGUF_MAGIC:
        raise _Bad("bad magic (not a GGUF file)")
    w.pos = 4
    version = w.u32("version")
    if version not in (2, 3):
        if version and struct.unpack("<I", struct.pack(">I", version))[0] in (2, 3):
            raise _Bad("big-endian GGUF files are not supported")
        raise _Bad(f"unsupported GGUF version {version}")
    n_tensors = w.u64("tensor count")
    n_kv = w.u64("metadata count")
    if n_tensors > MAX_TENSORS or n_tensors * 24 > size:
        raise _Bad(f"tensor count {n_tensors} is absurd for a {size}-byte file")
    if n_kv > MAX_KV or n_kv * 12 > size:
        raise _Bad(f"metadata count {n_kv} is absurd for a {size}-byte file")

    meta: dict[str, Any] = {}
    array_lens: dict[str, int] = {}
    for i in range(n_kv):
        key = w.string(f"metadata key #{i}", limit=MAX_KEY_LEN)
        if not key:
            raise _Bad(f"metadata key #{i} is empty")
        if key in meta or key in array_lens:
            raise _Bad(f"metadata key {key!r} appears twice")
        vtype = w.u32(f"metadata {key!r} type")
        v = _read_value(w, vtype, key, 0, keep=True)
        if v is None and key == "tokenizer.chat_template":
            raise _Bad(f"tokenizer.chat_template is longer than {METADATA_STRING_LIMIT >> 20} MiB")
        if isinstance(v, _ArrayLen):
            array_lens[key] = int(v)
        elif isinstance(v, list):
            array_lens[key] = len(v)
            meta[key] = v
        else:
            meta[key] = v

    alignment = meta.get("general.alignment", 32)
    if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0 or alignment & (alignment - 1):
        raise _Bad(f"general.alignment {alignment!r} is not a power of two")

    tensors = []
    dims_of: dict[str, tuple[int, ...]] = {}
    names: set[str] = set()
    for i in range(n_tensors):
        name = w.string(f"tensor #{i} name", limit=MAX_KEY_LEN)
        if name in names:
            raise _Bad(f"tensor {name!r} appears twice")
        names.add(name)
        n_dims = w.u32(f"tensor {name!r} dimension count")
        if not 1 <= n_dims <= MAX_DIMS:
            raise _Bad(f"tensor {name!r} has {n_dims} dimensions (at most {MAX_DIMS})")
        dims = [w.u64(f"tensor {name!r} dimensions") for _ in range(n_dims)]
        n_el = 1
        for d in dims:
            if d == 0 or d > MAX_ELEMENTS:
                raise _Bad(f"tensor {name!r} has an absurd dimension {d}")
            n_el *= d
            if n_el > MAX_ELEMENTS:
                raise _Bad(f"tensor {name!r} element count overflows")
        ttype = w.u32(f"tensor {name!r} type")
        try:
            qt = GGMLQuantizationType(ttype)
            block, type_size = GGML_QUANT_SIZES[qt]
        except (ValueError, KeyError):
            raise _Bad(f"tensor {name!r} has unknown type {ttype}") from None
        if dims[0] % block:
            raise _Bad(f"tensor {name!r} row size {dims[0]} is not a multiple of its block size {block}")
        offset = w.u64(f"tensor {name!r} offset")
        if offset % alignment:
            raise _Bad(f"tensor {name!r} offset {offset} is not aligned to {alignment}")
        nbytes = n_el // block * type_size
        tensors.append((name, ttype, n_el, offset, nbytes))
        dims_of[name] = tuple(dims)

    data_start = (w.pos + alignment - 1) // alignment * alignment
    data_size = size - data_start
    if n_tensors and data_size < 0:
        raise _Bad("tensor data section is missing (truncated?)")
    tensor_bytes = 0
    params = 0
    by_type: dict[int, int] = {}
    layer_bytes: dict[int, int] = {}
    spans = []
    for name, ttype, n_el, offset, nbytes in tensors:
        if offset + nbytes > data_size:
            raise _Bad(f"tensor {name!r} data ({nbytes} bytes at offset {offset}) runs past the end of the file (truncated?)")
        spans.append((offset, offset + nbytes, name))
        tensor_bytes += nbytes
        params += n_el
        if name.endswith(".weight") and n_el > 1024:
            by_type[ttype] = by_type.get(ttype, 0) + nbytes
        if name.startswith("blk."):
            try:
                layer = int(name.split(".")[1])
                layer_bytes[layer] = layer_bytes.get(layer, 0) + nbytes
            except (IndexError, ValueError):
                pass
    spans.sort()
    for (s0, e0, n0), (s1, e1, n1) in zip(spans, spans[1:]):
        if s1 < e0:
            raise _Bad(f"tensors {n0!r} and {n1!r} overlap")

    arch = meta.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise _Bad("general.architecture is missing")

    def num(key: str) -> int | None:
        v = meta.get(f"{arch}.{key}")
        if isinstance(v, list):  # per-layer values (e.g. head_count_kv on some models)
            v = max((_count(x) for x in v if _count(x) is not None), default=None)
        return _count(v)

    vocab = num("vocab_size") or array_lens.get("tokenizer.ggml.tokens")
    tmpl = meta.get("tokenizer.chat_template")
    metadata = dict(meta)  # strings over METADATA_STRING_LIMIT were skipped: None, like big arrays
    for k in array_lens:
        metadata.setdefault(k, None)  # Ollama shows big arrays as null
    return GGUFInfo(
        architecture=arch,
        parameter_count=params,
        file_type=_file_type_name(_count(meta.get("general.file_type"), floats=False), by_type),
        context_length=num("context_length"),
        block_count=num("block_count"),
        embedding_length=num("embedding_length"),
        head_count=num("attention.head_count"),
        head_count_kv=num("attention.head_count_kv"),
        feed_forward_length=num("feed_forward_length"),
        vocab_size=vocab,
        chat_template=tmpl if isinstance(tmpl, str) else None,
        bos_token_id=_count(meta.get("tokenizer.ggml.bos_token_id"), floats=False),
        eos_token_id=_count(meta.get("tokenizer.ggml.eos_token_id"), floats=False),
        tensor_bytes=tensor_bytes,
        metadata=metadata,
        tensor_count=n_tensors,
        version=version,
        file_size=size,
        tokenizer_model=meta.get("tokenizer.ggml.model") if isinstance(meta.get("tokenizer.ggml.model"), str) else None,
        layer_bytes=layer_bytes,
        tensor_dims=dims_of,
    )


def has_token_texts(path: str, size: int, groups) -> bool:
    """Whether the GGUF's vocabulary (tokenizer.ggml.tokens) holds one text of every group (sets of
    str): the header is walked to the token list (bounded: the walker's limits; one comparison per
    token whose length matches one of the texts)."""
    wanted = [{t.encode() for t in group} for group in groups]
    lengths = {len(t) for group in wanted for t in group}
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            w = _Walker(buf, size)
            if bytes(buf[0:4]) != GGUF_MAGIC:
                return False
            w.pos = 4
            w.u32("version")
            w.u64("tensor count")
            n_kv = w.u64("metadata count")
            T, _, _ = _value_types()
            for i in range(min(n_kv, 1 << 16)):
                key = w.string(f"metadata key #{i}", limit=MAX_KEY_LEN)
                vtype = w.u32("type")
                if key != "tokenizer.ggml.tokens":
                    _read_value(w, vtype, key, 0, keep=False)
                    continue
                if vtype != int(T.ARRAY) or w.u32("array type") != int(T.STRING):
                    return False
                count = w.u64("array length")
                found = [False] * len(wanted)
                pos, end, unpack = w.pos, size, struct.Struct("<Q").unpack_from
                for _ in range(count):
                    if pos + 8 > end:
                        return False
                    n = unpack(buf, pos)[0]
                    pos += 8
                    if n in lengths:
                        text = buf[pos:pos + n]
                        for g, group in enumerate(wanted):
                            if text in group:
                                found[g] = True
                    pos += n
                return all(found)
    except (OSError, ValueError, _Bad, struct.error):
        return False
    return False



def cached_gguf_info(path: Path) -> GGUFInfo:
    """read_gguf_info of a stored file, kept while the file's inode, size and mtime stay the same (the
    library reads the same few blobs' headers on every resolve, list and show)."""
    st = path.stat()
    key = (str(path), st.st_ino, st.st_size, st.st_mtime_ns)
    with _info_lock:
        hit = _info_cache.get(key)
    if hit is None:
        hit = read_gguf_info(path)
        with _info_lock:
            if len(_info_cache) > 64:
                _info_cache.clear()
            _info_cache[key] = hit
    return hit


__all__ = ["GGUFInfo", "read_gguf_info", "cached_gguf_info", "format_parameter_count", "has_token_texts"]
