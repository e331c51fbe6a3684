"""Property-based tests (hypothesis) over the library's parsers of untrusted input:
the GGUF header reader (random headers, and the real SmolLM2 header truncated,
bit-flipped and given absurd counts), the Modelfile parser and model-name / digest
parsing. Each must answer InvalidRequest (or succeed with sane values), never another
exception, and stay bounded in time (a deadline per example) and memory (tracemalloc).

Derandomized (CI-stable), a few hundred examples each, no example database."""

from __future__ import annotations

import os
import re
import struct
import tracemalloc
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from localrun.errors import InvalidRequest
from localrun.library import Modelfile, parse_modelfile, parse_name, read_gguf_info, validate_digest
from localrun.library.gguf_info import GGUFInfo
from localrun.library.names import validate_filename

FUZZ = settings(derandomize=True, database=None, deadline=1500, max_examples=200,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
FUZZ_SMOL = settings(FUZZ, max_examples=100)  # each example walks the 98k-string SmolLM2 header
MAX_PEAK = 64 << 20  # Python allocations while reading one (small or header-only) file

# --------------------------------------------------------------------------- GGUF header


def _struct_fields(data: bytes) -> list[tuple[int, int]]:
    """(offset, width) of every integer field of a well-formed GGUF header: counts,
    lengths, value types, array types, scalar values, tensor dims, types and offsets."""
    sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
    out = [(4, 4), (8, 8), (16, 8)]
    pos = 24
    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)

    def u(fmt: str, width: int) -> int:
        nonlocal pos
        out.append((pos, width))
        v = struct.unpack_from(fmt, data, pos)[0]
        pos += width
        return v

    def value(t: int) -> None:
        nonlocal pos
        if t in sizes:
            out.append((pos, sizes[t]))
            pos += sizes[t]
        elif t == 8:
            n = u("<Q", 8)
            pos += n
        else:
            et, count = u("<I", 4), u("<Q", 8)
            if et in sizes:
                pos += count * sizes[et]  # (count and et were read before this line)
            else:
                for _ in range(count):
                    value(et)

    for _ in range(n_kv):
        n = u("<Q", 8)
        pos += n
        value(u("<I", 4))
    for _ in range(n_tensors):
        n = u("<Q", 8)
        pos += n
        for _ in range(u("<I", 4)):
            u("<Q", 8)
        u("<I", 4)
        u("<Q", 8)
    return out


@pytest.fixture(scope="module")
def smol_header(smollm2_gguf, tmp_path_factory):
    """The real SmolLM2 header (kv + tensor table, ~1.8 MB) in a file of the real size
    whose tensor data is a sparse hole: what the reader sees of the real file."""
    size = smollm2_gguf.stat().st_size
    with open(smollm2_gguf, "rb") as f:
        data = f.read(2 << 20)
    fields = _struct_fields(data)
    header_end = max(o + w for o, w in fields)
    header = data[:header_end]
    d = tmp_path_factory.mktemp("fuzz")
    base = d / "smol-header.gguf"
    base.write_bytes(header)
    os.truncate(base, size)
    info = read_gguf_info(base)  # the unmutated header reads like the real file
    assert info.tensor_count == 272 and info.vocab_size == 49152
    return _Header(path=base, header=header, size=size, fields=fields, dir=d)


@dataclass(repr=False)
class _Header:
    path: Path
    header: bytes
    size: int
    fields: list
    dir: Path

    def __repr__(self) -> str:  # hypothesis prints its arguments: not 2 MB of header
        return f"<SmolLM2 header of {len(self.header)} bytes at {self.path}>"


def _read_bounded(path: Path, *, traced: bool = True) -> GGUFInfo | None:
    """read_gguf_info: InvalidRequest or a sane GGUFInfo, within MAX_PEAK of allocations
    (traced: tracemalloc slows the 98k-string SmolLM2 walk ~15x, so those tests rely on
    the deadline and test_gguf_header_caps_bound_work_and_memory covers memory)."""
    if traced:
        tracemalloc.start()
    try:
        info = read_gguf_info(path, display_name="fuzz.gguf")
    except InvalidRequest as e:
        assert e.message.startswith("fuzz.gguf "), e.message
        assert str(path.parent) not in e.message
        return None
    finally:
        if traced:
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            assert peak < MAX_PEAK, f"reading the header allocated {peak} bytes"
    _check_info(info, path.stat().st_size)
    return info


def _check_info(info: GGUFInfo, size: int) -> None:
    assert isinstance(info.architecture, str) and info.architecture
    for name in ("context_length", "block_count", "embedding_length", "head_count", "head_count_kv",
                 "feed_forward_length", "vocab_size", "bos_token_id", "eos_token_id"):
        v = getattr(info, name)
        assert v is None or (type(v) is int and v >= 0), (name, v)
    assert isinstance(info.file_type, str) and isinstance(info.parameter_size, str)
    assert info.chat_template is None or isinstance(info.chat_template, str)
    assert info.tokenizer_model is None or isinstance(info.tokenizer_model, str)
    assert 0 <= info.tensor_bytes <= size and info.file_size == size
    assert all(type(k) is int and type(v) is int for k, v in info.layer_bytes.items())
    info.model_info()


_ABSURD = [0, 1, 2, 3, 7, 8, 9, 12, 13, 31, 255, 1 << 15, (1 << 31) - 1, 1 << 31, (1 << 32) - 1]
_ABSURD64 = _ABSURD + [1 << 32, 1 << 40, 1 << 48, (1 << 63) - 1, 1 << 63, (1 << 64) - 1, 98362432, 98362433]


@st.composite
def _field_overwrite(draw, fields):
    off, width = draw(st.sampled_from(fields))
    pool = _ABSURD64 if width == 8 else [v for v in _ABSURD if v < 1 << (8 * width)]
    value = draw(st.sampled_from(pool) | st.integers(0, (1 << (8 * width)) - 1))
    return off, value.to_bytes(width, "little")


@FUZZ_SMOL
@given(data=st.data())
def test_gguf_real_header_mutated(smol_header, data):
    """Absurd counts, lengths, types and values in the real header's fields, and bit flips."""
    h = smol_header
    header: bytes = h.header
    edits = data.draw(st.lists(
        _field_overwrite(h.fields)
        | st.tuples(st.integers(0, len(header) - 1), st.integers(0, 255).map(lambda b: bytes([b]))),
        min_size=1, max_size=4))
    with open(h.path, "r+b") as f:
        try:
            for off, b in edits:
                f.seek(off)
                f.write(b)
            f.flush()
            _read_bounded(h.path, traced=False)
        finally:
            for off, b in edits:
                f.seek(off)
                f.write(header[off:off + len(b)])


@FUZZ_SMOL
@given(cut=st.integers(0, 98362432) | st.integers(0, 1785700) | st.sampled_from([0, 3, 4, 8, 23, 24, 25]))
def test_gguf_real_header_truncated(smol_header, cut):
    h = smol_header
    p = h.dir / "cut.gguf"
    p.write_bytes(h.header[:cut])
    if cut > len(h.header):
        os.truncate(p, cut)
    assert (_read_bounded(p, traced=False) is None) == (cut < h.size)  # only the whole file is valid


# random headers built field by field: sometimes well-formed, mostly not
_u32 = st.integers(0, 15) | st.sampled_from(_ABSURD)
_u64 = st.integers(0, 64) | st.sampled_from(_ABSURD64)


@st.composite
def _gguf_bytes(draw) -> bytes:
    out = bytearray(b"GGUF")
    out += struct.pack("<I", draw(st.sampled_from([3, 3, 3, 2, 1, 4, 0x03000000])))
    n_t, n_kv = draw(_u64 | st.integers(0, 3)), draw(_u64 | st.integers(0, 6))
    out += struct.pack("<QQ", n_t, n_kv)

    def string(s: bytes) -> bytes:
        return struct.pack("<Q", draw(st.just(len(s)) | _u64)) + s

    keys = st.sampled_from([b"general.architecture", b"general.alignment", b"llama.context_length",
                            b"llama.attention.head_count_kv", b"tokenizer.ggml.tokens", b"tokenizer.chat_template",
                            b"tokenizer.ggml.bos_token_id", b"general.file_type", b""]) | st.binary(max_size=12)
    for _ in range(draw(st.integers(0, 6))):
        out += string(draw(keys))
        vtype = draw(_u32)
        out += struct.pack("<I", vtype)
        if vtype == 9:
            out += struct.pack("<IQ", draw(_u32), draw(_u64 | st.integers(0, 4)))
        out += draw(st.binary(max_size=24) | st.sampled_from([string(b"llama"), struct.pack("<f", float("inf")),
                                                               struct.pack("<f", float("nan")), struct.pack("<d", -1e300),
                                                               struct.pack("<q", -5)]))
    for _ in range(draw(st.integers(0, 3))):
        out += string(draw(st.sampled_from([b"token_embd.weight", b"blk.0.attn_q.weight", b"blk.x.y"])
                           | st.binary(max_size=8)))
        dims = draw(st.lists(_u64, max_size=5))
        out += struct.pack("<I", draw(st.just(len(dims)) | _u32)) + b"".join(struct.pack("<Q", d) for d in dims)
        out += struct.pack("<IQ", draw(_u32), draw(_u64))
    out += draw(st.binary(max_size=64))
    return bytes(out)


@FUZZ
@given(blob=_gguf_bytes() | st.binary(max_size=256) | st.binary(max_size=64).map(lambda b: b"GGUF\x03\0\0\0" + b))
def test_gguf_random_headers(tmp_path_factory, blob):
    p = tmp_path_factory.getbasetemp() / "random.gguf"
    p.write_bytes(blob)
    _read_bounded(p)


def _kv_header(kvs: list[bytes], n_kv: int | None = None) -> bytes:
    """A GGUF header with no tensors and the given encoded key/value pairs."""
    arch = _gstr(b"general.architecture") + struct.pack("<I", 8) + _gstr(b"llama")
    return b"GGUF" + struct.pack("<IQQ", 3, 0, (n_kv or len(kvs)) + 1) + arch + b"".join(kvs)


def _gstr(b: bytes) -> bytes:
    return struct.pack("<Q", len(b)) + b


def test_gguf_header_caps_bound_work_and_memory(tmp_path):
    """The caps that bound a hostile header whatever the file's size: strings walked in
    metadata arrays, bytes of strings decoded, the chat template's length."""
    p = tmp_path / "caps.gguf"
    # an array of (empty) strings one past the cap (4M): refused before walking it
    count = (1 << 22) + 1
    p.write_bytes(_kv_header([_gstr(b"tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, count)]))
    os.truncate(p, p.stat().st_size + 8 * count)
    with pytest.raises(InvalidRequest, match="hold more than"):
        read_gguf_info(p)
    # 1 MiB strings: decoded up to MAX_KEPT_STRINGS in all, then refused, memory bounded
    big = b"x" * (1 << 20)
    n = 16 + 1  # 16 MiB of strings decoded at most
    p.write_bytes(_kv_header([_gstr(b"k%d" % i) + struct.pack("<I", 8) + _gstr(big) for i in range(n)]))
    tracemalloc.start()
    try:
        with pytest.raises(InvalidRequest, match="strings total more than"):
            read_gguf_info(p)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < (16 << 20) + (8 << 20)
    # a longer string is skipped (metadata shows null) and never decoded...
    p.write_bytes(_kv_header([_gstr(b"general.description") + struct.pack("<I", 8) + _gstr(big + b"y")]))
    assert read_gguf_info(p).metadata["general.description"] is None
    # ...but a chat template that long is refused, not silently replaced by a default
    p.write_bytes(_kv_header([_gstr(b"tokenizer.chat_template") + struct.pack("<I", 8) + _gstr(big + b"y")]))
    with pytest.raises(InvalidRequest, match="chat_template is longer than 1 MiB"):
        read_gguf_info(p)


def test_gguf_numbers_from_a_hostile_header(tmp_path):
    """inf / nan / negative / bool / string sizes never become GGUFInfo numbers (int(inf)
    raised OverflowError, a 500)."""
    p = tmp_path / "nums.gguf"
    kvs = [_gstr(b"llama.context_length") + struct.pack("<If", 6, float("inf")),
           _gstr(b"llama.block_count") + struct.pack("<If", 6, float("nan")),
           _gstr(b"llama.embedding_length") + struct.pack("<Ii", 5, -64),
           _gstr(b"llama.attention.head_count") + struct.pack("<I?", 7, True),
           _gstr(b"llama.attention.head_count_kv") + struct.pack("<IIQ", 9, 6, 2) + struct.pack("<ff", 4.0, float("inf")),
           _gstr(b"llama.feed_forward_length") + struct.pack("<If", 6, 64.0),
           _gstr(b"tokenizer.ggml.bos_token_id") + struct.pack("<I", 8) + _gstr(b"1"),
           _gstr(b"tokenizer.ggml.eos_token_id") + struct.pack("<Ii", 5, -1),
           _gstr(b"general.file_type") + struct.pack("<If", 6, 2.0)]
    p.write_bytes(_kv_header(kvs))
    info = read_gguf_info(p)
    assert (info.context_length, info.block_count, info.embedding_length, info.head_count) == (None,) * 4
    assert (info.head_count_kv, info.feed_forward_length) == (4, 64)
    assert (info.bos_token_id, info.eos_token_id, info.file_type) == (None, None, "unknown")
    _check_info(info, p.stat().st_size)


# --------------------------------------------------------------------------- Modelfile

_words = st.sampled_from(["FROM", "PARAMETER", "SYSTEM", "TEMPLATE", "MESSAGE", "LICENSE", "ADAPTER", "from", "#", "BOGUS"])
_args = st.sampled_from(['"""', '"', "\\", "temperature", "stop", "num_ctx", "top_p", "seed", "1e999", "nan", "-1",
                         "18446744073709551616", "9" * 5000, "user", "robot", "./x.gguf", "smollm2:135m", "{{ x }}",
                         "{% for %}", "{{ '\\u0000' }}", "\x00", "\r", "\t", " "]) | st.text(max_size=20)


@st.composite
def _modelfile_text(draw) -> str:
    lines = []
    for _ in range(draw(st.integers(0, 8))):
        lines.append(draw(_words) + " " + " ".join(draw(st.lists(_args, max_size=4))))
    sep = draw(st.sampled_from(["\n", "\r\n", "\r"]))
    return sep.join(lines)


@FUZZ
@given(text=_modelfile_text() | st.text(max_size=300))
def test_modelfile_parser_only_invalid_request(text):
    try:
        mf = parse_modelfile(text)
    except InvalidRequest as e:
        assert e.status == 400 and e.message
        return
    assert isinstance(mf.from_, str) and mf.from_
    assert parse_modelfile(mf.to_text()) == mf  # what show prints builds the same model


_value = st.text(min_size=1, max_size=30) | st.sampled_from(['"', '"""', 'a"', '"a', " a ", "a\rb", "a\r\nb", "\n",
                                                            "x\x00y", "\u2028", "\x85", '""" x """'])


@FUZZ
@given(system=_value, template=st.sampled_from(["{{ messages }}", "{% if x %}\r\n{{ y }}{% endif %}", '"""{{ 1 }}']),
       license_=_value, content=_value, stop=st.lists(_value, max_size=3))
def test_modelfile_render_round_trip(system, template, license_, content, stop):
    """Any values (from a GGUF's template, the API's fields) render to a Modelfile that
    parses back to the same values, or are refused with InvalidRequest."""
    mf = Modelfile("smollm2:135m", {"stop": list(dict.fromkeys(stop))} if stop else {}, template, system,
                   [{"role": "user", "content": content}], license_, None)
    assert parse_modelfile(mf.to_text()) == mf


# --------------------------------------------------------------------------- names and digests

_name_chars = st.lists(st.sampled_from(list("aZ09._-:/\\~ @\x00") + ["..", "hf.co/", "İ", "\u212a", "\ud800"]),
                       max_size=30).map("".join)
_SAFE_PART = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]*$")


@FUZZ
@given(text=_name_chars | st.text(max_size=60) | st.just("a" * 10_000))
def test_model_names_only_invalid_request(text):
    try:
        n = parse_name(text)
    except InvalidRequest as e:
        assert e.status == 400 and len(e.message) < 2000  # bounded, whatever the input
        return
    for part in n.parts:  # every part is a safe single path component
        assert _SAFE_PART.match(part) and ".." not in part and len(part.encode()) < 256, n.parts
    again = parse_name(n.display)
    assert again.parts == n.parts and again.display == n.display


@FUZZ
@given(text=st.text(max_size=80) | st.from_regex(r"sha256[:-][0-9a-fA-F]{60,68}\s?", fullmatch=True))
def test_digests_and_filenames_only_invalid_request(text):
    for fn in (validate_digest, validate_filename):
        try:
            out = fn(text)
        except InvalidRequest:
            continue
        assert "/" not in out and ".." not in out and "\x00" not in out


# --------------------------------------------------------------------------- FROM paths through create

@pytest.fixture(scope="module")
def from_base(tmp_path_factory):
    """A directory holding every kind of awkward entry, and a library beside it."""
    from localrun.library import Library

    d = tmp_path_factory.mktemp("from")
    base = d / "base"
    base.mkdir()
    os.mkfifo(base / "fifo.gguf")
    os.symlink("loop.gguf", base / "loop.gguf")
    os.symlink("/nonexistent/target", base / "dangling.gguf")
    (base / "file").write_text("not a model")
    (base / "dir.gguf").mkdir()
    (base / "st").mkdir()
    (base / "st" / "config.json").write_text("[1, 2]")
    (base / "st" / "model.safetensors").write_bytes(b"\xff" * 16)
    return base, Library(d / "models")


_segments = st.sampled_from(["..", ".", "~", "", "a" * 255, "a" * 256, "fifo.gguf", "loop.gguf", "dangling.gguf", "file",
                             "dir.gguf", "st", "x.gguf", "dev", "null", "proc", "\t", "\x1b", "é", "a:b", " "])


@FUZZ
@given(parts=st.lists(_segments, min_size=1, max_size=12), lead=st.sampled_from(["", "./", "/", "~/", "../"]),
       repeat=st.sampled_from([1, 1, 1, 40]))
def test_create_from_awkward_paths(from_base, parts, lead, repeat):
    """Whatever FROM names (a path of any shape, or a name), create answers a 4xx naming
    no directory of the server, or succeeds; never another exception."""
    from localrun.errors import LocalrunError

    base, lib = from_base
    text = lead + "/".join(parts * repeat)
    if not text.strip():
        return
    try:
        lib.create("x", f'FROM "{text}"' if text != text.strip() else f"FROM {text}", base_dir=base)
    except LocalrunError as e:
        assert 400 <= e.status < 500, (text[:80], e.status, e.message[:200])
        assert str(base) not in e.message and str(base.parent) not in e.message, e.message[:300]
        assert "Errno" not in e.message and len(e.message) < 2000
