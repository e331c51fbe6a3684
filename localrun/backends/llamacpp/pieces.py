"""Token pieces and tokenizing with a cache of pieces: a prompt's text that came before costs no tokenizer time again.

llama.cpp tokenizes a text in two stages (``llama_vocab::impl::tokenize``): it cuts the text at every
special token (``tokenizer_st_partition``: each special token's text, longest first, every occurrence
in what is still raw text), then tokenizes each raw piece between them on its own, with a fresh
session (BPE and SentencePiece vocabularies). So a raw piece's tokens are the same in any text it is
part of. A chat resends its whole history every turn and an agent its system prompt and tools every
request: with the pieces' tokens kept, only the new message is tokenized. (About 1-5 us a character
on a 2-core Xeon, cold after a prefill: a 40,000-character conversation costs 40-200 ms of TTFT
every turn otherwise, even when its KV cells are all cached.)

The cut is done here exactly as llama.cpp does it, and only for vocabularies where that is the whole
story: SentencePiece ("llama") or byte-level BPE ("gpt2") sessions, no special token that strips the
whitespace beside it, no two special tokens with one text, and no two of one length that could
overlap (llama.cpp's sort leaves their order open). Any other vocabulary is tokenized by llama.cpp in
one call, as before. tests/test_llama_pieces.py checks the result against llama.cpp's on every
tokenizer test vocabulary llama.cpp ships.
"""

from __future__ import annotations

import ctypes
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence

MAX_SPECIALS = 1024  # more special tokens than this: the cut costs more in Python than it saves (one scan each)
CACHE_BYTES = 16 << 20  # the pieces kept (their text and ids), least recently used dropped first
SESSIONS = {b"llama": 1, b"gpt2": 2}  # tokenizer.ggml.model -> the vocabulary type llama.cpp gives it


def token_piece(lib, vocab, token: int, special: bool = False) -> bytes:
    buf = ctypes.create_string_buffer(64)
    n = lib.llama_token_to_piece(vocab, token, buf, 64, 0, special)
    if n < 0:  # longer than the buffer
        buf = ctypes.create_string_buffer(-n)
        n = lib.llama_token_to_piece(vocab, token, buf, -n, 0, special)
    return buf.raw[: max(n, 0)]


def pieces_text(lib, vocab, ids: list[int]) -> str:
    """The text of token ids, special tokens written out (ids already checked against the vocabulary)."""
    return b"".join(token_piece(lib, vocab, t, special=True) for t in ids).decode("utf-8", "replace")


def longest_piece(lib, vocab, n_vocab: int) -> int:
    """The most bytes one token of the vocabulary stands for (BackendInfo.max_token_bytes). Every load asks
    this of every token: one buffer for all of them, and a piece longer than it counted by the size
    llama.cpp says it needs (-n), not written (SmolLM2's 49,152 tokens: 95 -> 55 ms)."""
    size = 256
    buf = ctypes.create_string_buffer(size)
    to_piece = lib.llama_token_to_piece
    longest = 0
    for t in range(n_vocab):
        n = abs(to_piece(vocab, t, buf, size, 0, True))
        if n > longest:
            longest = n
    return longest


def llama_tokenize(lib, vocab, data: bytes, add_special: bool, special: bool) -> list[int]:
    """llama.cpp's llama_tokenize of `data`, whole (one call; a second when the first buffer was short)."""
    cap = len(data) + 8
    buf = (lib.llama_token * cap)()
    n = lib.llama_tokenize(vocab, data, len(data), buf, cap, add_special, special)
    if n < 0:  # more tokens than bytes (added specials): the exact size comes back negated
        cap = -n
        buf = (lib.llama_token * cap)()
        n = lib.llama_tokenize(vocab, data, len(data), buf, cap, add_special, special)
        if n < 0:
            from localrun.errors import BackendError

            raise BackendError(f"llama.cpp could not tokenize a text of {len(data)} bytes")
    return list(buf[:n])


def _meta(lib, model, key: bytes) -> bytes | None:
    buf = ctypes.create_string_buffer(64)
    n = lib.llama_model_meta_val_str(model, key, buf, len(buf))
    return buf.value if 0 <= n < len(buf) else None


def _overlapping(texts: list[bytes]) -> bool:
    """Whether an occurrence of one of `texts` (all of one length, all different) can share bytes with an
    occurrence of another: some text's end is another's start."""
    starts: dict[bytes, set[int]] = {}
    for i, t in enumerate(texts):
        for k in range(1, len(t)):
            starts.setdefault(t[:k], set()).add(i)
    for i, t in enumerate(texts):
        for k in range(1, len(t)):
            owners = starts.get(t[-k:])
            if owners and (len(owners) > 1 or i not in owners):
                return True
    return False


class PieceTokenizer:
    """``tokenize(text, add_special, special)`` as llama_tokenize gives it, from cached pieces.
    `raw(data, add_special, special)` is llama.cpp's own tokenizer (one call); thread-safe."""

    def __init__(self, raw: Callable[[bytes, bool, bool], list[int]], specials: list[tuple[bytes, int, bool]],
                 bos: int | None, eos: int | None, max_bytes: int = CACHE_BYTES) -> None:
        self._raw = raw
        # (text, id) longest first, as llama.cpp's cache_special_tokens; the second list without the control
        # and unknown tokens, which llama.cpp leaves in the raw text when special tokens are not parsed
        ordered = sorted(specials, key=lambda s: -len(s[0]))
        self._cut = {True: [(t, i) for t, i, _ in ordered], False: [(t, i) for t, i, user in ordered if user]}
        self._bos, self._eos = bos, eos
        self._cache: OrderedDict[tuple[bool, bytes], array] = OrderedDict()  # (special, piece) -> its ids
        self._bytes = 0
        self.max_bytes = max_bytes
        self._lock = threading.Lock()

    @classmethod
    def for_vocab(cls, lib, model, vocab, raw: Callable[[bytes, bool, bool], list[int]]) -> PieceTokenizer | None:
        """The piece tokenizer for a loaded model's vocabulary, or None where llama.cpp's tokenizing is
        not the cut-then-tokenize-each-piece this copies (then every text goes to llama.cpp whole)."""
        kind = SESSIONS.get(_meta(lib, model, b"tokenizer.ggml.model") or b"")
        if kind is None or lib.llama_vocab_type(vocab) != kind:
            return None
        wanted = lib.LLAMA_TOKEN_ATTR_CONTROL | lib.LLAMA_TOKEN_ATTR_USER_DEFINED | lib.LLAMA_TOKEN_ATTR_UNKNOWN
        strips = lib.LLAMA_TOKEN_ATTR_LSTRIP | lib.LLAMA_TOKEN_ATTR_RSTRIP
        specials: list[tuple[bytes, int, bool]] = []
        for t in range(lib.llama_vocab_n_tokens(vocab)):
            attr = lib.llama_vocab_get_attr(vocab, t)
            if attr & wanted:
                if attr & strips:
                    return None
                text = lib.llama_vocab_get_text(vocab, t) or b""
                if not text:  # llama.cpp's find of "" matches everywhere: not a cut this copies
                    return None
                # cut also when special tokens are not parsed: what is neither control nor unknown (llama.cpp's test)
                specials.append((text, t, not attr & (lib.LLAMA_TOKEN_ATTR_CONTROL | lib.LLAMA_TOKEN_ATTR_UNKNOWN)))
                if len(specials) > MAX_SPECIALS:
                    return None
        texts = [s[0] for s in specials]
        if len(set(texts)) != len(texts):
            return None
        by_len: dict[int, list[bytes]] = {}
        for t in texts:
            by_len.setdefault(len(t), []).append(t)
        if any(_overlapping(group) for group in by_len.values() if len(group) > 1):
            return None
        bos = lib.llama_vocab_bos(vocab) if lib.llama_vocab_get_add_bos(vocab) else None
        eos = lib.llama_vocab_eos(vocab) if lib.llama_vocab_get_add_eos(vocab) else None
        if (bos is not None and bos < 0) or (eos is not None and eos < 0):
            return None
        return cls(raw, specials, bos, eos)

    def pieces(self, data: bytes, special: bool) -> list[bytes | int]:
        """`data` cut at its special tokens as llama.cpp cuts it: raw pieces (bytes) and token ids."""
        parts: list[bytes | int] = [data] if data else []
        for text, tid in self._cut[special]:
            if text not in data:  # in no piece either (one scan of the whole text)
                continue
            out: list[bytes | int] = []
            for p in parts:
                if type(p) is int:
                    out.append(p)
                    continue
                start = 0
                while (m := p.find(text, start)) >= 0:
                    if m > start:
                        out.append(p[start:m])
                    out.append(tid)
                    start = m + len(text)
                if start < len(p):
                    out.append(p[start:] if start else p)
            parts = out
        return parts

    def tokenize(self, text: str | bytes, add_special: bool, special: bool) -> list[int]:
        data = text.encode("utf-8") if isinstance(text, str) else text
        ids: list[int] = [self._bos] if add_special and self._bos is not None else []
        for p in self.pieces(data, special):
            if type(p) is int:
                ids.append(p)
            else:
                ids.extend(self._piece(p, special))
        if add_special and self._eos is not None:
            ids.append(self._eos)
        return ids

    def _piece(self, p: bytes, special: bool) -> Sequence[int]:
        key = (special, p)
        with self._lock:
            got = self._cache.get(key)
            if got is not None:
                self._cache.move_to_end(key)
                return got
        got = array("i", self._raw(p, False, special))  # 4 bytes a token (a tuple's ints: 36)
        size = len(p) + 4 * len(got)
        if size <= self.max_bytes // 4:  # one huge text does not empty the cache
            with self._lock:
                if key not in self._cache:
                    self._cache[key] = got
                    self._bytes += size
                    while self._bytes > self.max_bytes:
                        (_, old), ids = self._cache.popitem(last=False)
                        self._bytes -= len(old) + 4 * len(ids)
        return got

    @property
    def cached_bytes(self) -> int:
        """The pieces' text and token ids kept (at most max_bytes)."""
        return self._bytes


__all__ = ["PieceTokenizer", "CACHE_BYTES", "llama_tokenize"]
