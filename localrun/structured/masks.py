"""The native engine's constrained decoding: llguidance grammars, per-request matchers and torch token masks.

`GrammarCompiler` (one per engine and tokenizer) turns a JSON schema into a `Grammar`, once
per canonical schema (LRU cache); call it off the engine loop thread (it takes ~1-5 ms per new
schema, plus ~1.5 s once to index the tokenizer). A request carries the Grammar in
`SamplingParams.grammar`; its Sequence gets its own `GrammarMatcher` (a copy of the grammar's
initial matcher: microseconds). Each step the engine fills one bitmask row per grammar row on
the host (`fill_masks`), copies it to the device, and the sampler sends the logits of
disallowed tokens to -inf (`apply_token_mask`). The matcher consumes each sampled token as the
engine handles it; once the grammar is complete (nothing can follow), the request stops.

llguidance was chosen by `localrun bench grammar` (see docs/structures.md): compile 1-5 ms
for every schema tried (xgrammar took 5.6 s on a string of maxLength 600, outlines-core 20 s),
a mask in 16-140 us per token, a dependency-free wheel, and a cheap deep copy (fork).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict

import torch

from localrun.structured.constraints import JSON_OPTIONS, PARSER_LIMITS

GRAMMAR_CACHE_SIZE = 64  # compiled schemas kept per engine
ANY_JSON_OBJECT: dict = {"type": "object"}


class GrammarMatcher:
    """One request's position in its grammar."""

    __slots__ = ("_m",)

    def __init__(self, matcher) -> None:
        self._m = matcher

    def consume(self, token: int) -> bool:
        """Advance by a sampled token; False when the grammar does not allow it."""
        return bool(self._m.consume_token(token))

    @property
    def is_stopped(self) -> bool:
        """The grammar is complete and nothing may follow (or the matcher failed)."""
        return self._m.is_stopped() or self._m.is_error()

    def fork(self) -> "GrammarMatcher":
        """An independent copy at the same position (for n > 1 after a shared prefill)."""
        return GrammarMatcher(self._m.deep_copy())

    def fill(self, row: torch.Tensor) -> None:
        """Write the allowed-token bitmask (int32 words, bit i of word w = token 32w+i) into a
        contiguous CPU row; a stopped matcher allows only end-of-sequence."""
        self._m.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())

    @property
    def error(self) -> str:
        return self._m.get_error() if self._m.is_error() else ""


class Grammar:
    """A compiled grammar: immutable, shared by every request with the same schema."""

    __slots__ = ("key", "_initial")

    def __init__(self, key: str, initial) -> None:
        self.key, self._initial = key, initial

    def matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self._initial.deep_copy())

    def __repr__(self) -> str:
        return f"Grammar({self.key[:60]!r})"


class GrammarCompiler:
    """JSON schema -> Grammar for one tokenizer and vocabulary size (thread-safe)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, list(eos_token_ids)
        self._ll_tokenizer = None
        self._cache: OrderedDict[str, Grammar] = OrderedDict()
        self._lock = threading.Lock()

    def _tokenizer(self):
        if self._ll_tokenizer is None:
            try:
                import llguidance.hf
            except ImportError:
                raise ValueError("structured output needs the llguidance package: pip install llguidance") from None
            self._ll_tokenizer = llguidance.hf.from_tokenizer(self.tokenizer._tok, n_vocab=self.vocab_size,
                                                              eos_token=self.eos_token_ids)
        return self._ll_tokenizer

    def json_schema(self, schema: dict | None) -> Grammar:
        """The grammar of JSON text valid under `schema` (None: any JSON object); ValueError
        with llguidance's reason when the schema cannot be compiled."""
        key = json.dumps(ANY_JSON_OBJECT if schema is None else schema, separators=(",", ":"))  # key order kept: it is the output order

        def text() -> str:
            import llguidance

            return llguidance.LLMatcher.grammar_from_json_schema(key, defaults=JSON_OPTIONS)

        return self._compile(key, text, "the JSON schema", None)

    def lark(self, lark: str) -> Grammar:
        """The grammar of llguidance's Lark text (a request's regex, choices or GBNF grammar, through
        localrun.structured.constraints.constraint_lark); ValueError with llguidance's reason when it cannot be compiled."""
        return self._compile("lark:" + lark, lambda: lark, "the grammar", PARSER_LIMITS)

    def _compile(self, key: str, text, what: str, limits: dict | None) -> Grammar:
        with self._lock:
            g = self._cache.get(key)
            if g is not None:
                self._cache.move_to_end(key)
                return g
            tokenizer = self._tokenizer()
            import llguidance

            try:
                m = llguidance.LLMatcher(tokenizer, text(), limits=llguidance.LLParserLimits(**limits or {}))
            except Exception as exc:  # llguidance reports some bad schemas by raising
                raise ValueError(f"cannot build a grammar for {what}: {exc}") from None
            if m.is_error():
                raise ValueError(f"cannot build a grammar for {what}: {m.get_error()}")
            g = self._cache[key] = Grammar(key, m)
            while len(self._cache) > GRAMMAR_CACHE_SIZE:
                self._cache.popitem(last=False)
            return g


def mask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def fill_masks(matchers: list[GrammarMatcher], vocab_size: int, device: torch.device) -> torch.Tensor:
    """The bitmasks [len(matchers), words] of the matchers' next tokens, on `device` (filled on
    the host, one non-blocking copy on CUDA)."""
    cuda = device.type == "cuda"
    mask = torch.empty((len(matchers), mask_words(vocab_size)), dtype=torch.int32, pin_memory=cuda)
    for i, m in enumerate(matchers):
        m.fill(mask[i])
    return mask.to(device, non_blocking=True) if cuda else mask


_BITS: dict[torch.device, torch.Tensor] = {}


def apply_token_mask(logits: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """logits [n, V] with -inf where rows' bitmasks [len(rows), words] disallow (a new tensor;
    other rows unchanged)."""
    V = logits.shape[1]
    bits = _BITS.get(logits.device)
    if bits is None:
        bits = _BITS[logits.device] = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((mask[:, :, None] >> bits) & 1).view(mask.shape[0], -1)[:, :V].bool()
    out = logits.clone()
    out[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
    return out
