"""Token choice on the batched loop's thread: sampler chains, grammar checks, logprobs.

:func:`make_sampler` builds a request's llama.cpp sampler chain (logit bias, penalties, top-k/p, min-p,
temperature, its own seeded RNG) and its JSON grammar's sampler; :func:`plain_greedy` says when an argmax over
the logits row picks the same token. :class:`TokenChooser` picks a token under a grammar or an llguidance
matcher (the chain first, the whole vocabulary masked only when the constraint refuses that token), computes
the logprobs of output and prompt tokens, and keeps the per-token facts asked of llama.cpp once (pieces,
end-of-generation tokens).
"""

from __future__ import annotations

import ctypes
import math
import random
from typing import Any, Callable, Sequence

import numpy as np

from localrun.backends.base import SamplingOptions, TokenLogprob
from localrun.backends.llamacpp.pieces import token_piece
from localrun.backends.llamacpp.slots import Request
from localrun.errors import BackendError, InvalidRequest

def make_sampler(lib, vocab, n_vocab: int, o: SamplingOptions, window: int, grammar: str | None = None,
                 banned: Sequence[int] = ()):
    """(a llama.cpp sampler chain for one request, its grammar's sampler or None): the caller frees
    each with llama_sampler_free. The grammar stays out of the chain, as in llama-server: it checks
    the token the chain picks and masks the whole vocabulary only when it refuses that one
    (TokenChooser.constrained). `banned` tokens are never picked (ban_eog: the
    end-of-generation tokens, as llama-server's ignore_eos bans them). InvalidRequest when the grammar does not parse."""
    chain = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())

    def add(s) -> None:
        if not s:
            lib.llama_sampler_free(chain)
            raise BackendError("llama.cpp could not create a sampler")
        lib.llama_sampler_chain_add(chain, s)

    bias = {**{int(t): float(b) for t, b in (o.logit_bias or {}).items()}, **{int(t): -math.inf for t in banned}}
    if bias:
        items = [lib.llama_logit_bias(t, b) for t, b in bias.items()]
        add(lib.llama_sampler_init_logit_bias(n_vocab, len(items), (lib.llama_logit_bias * len(items))(*items)))
    last_n = window if o.repeat_last_n < 0 else o.repeat_last_n
    add(lib.llama_sampler_init_penalties(n_vocab, last_n, o.repeat_penalty, o.frequency_penalty, o.presence_penalty))
    if o.temperature <= 0:
        add(lib.llama_sampler_init_greedy())
    else:
        add(lib.llama_sampler_init_top_k(o.top_k))
        add(lib.llama_sampler_init_top_p(o.top_p, 1))
        add(lib.llama_sampler_init_min_p(o.min_p, 1))
        add(lib.llama_sampler_init_temp(o.temperature))
        add(lib.llama_sampler_init_dist(o.seed if o.seed is not None else random.getrandbits(31)))
    g = None
    if grammar is not None:
        g = lib.llama_sampler_init_grammar(vocab, grammar.encode("utf-8"), b"root")
        if not g:
            lib.llama_sampler_free(chain)
            raise InvalidRequest("llama.cpp cannot parse the JSON schema's grammar")
    return chain, g


class _Candidates:
    """llama.cpp's candidate arrays (llama_token_data: id, logit, p) for a pick outside
    llama_sampler_sample: one over the whole vocabulary, one of a single token; reused for every
    pick (on the loop's thread)."""

    def __init__(self, lib, n_vocab: int) -> None:
        self.lib, self.n = lib, n_vocab
        self.arr = np.zeros(n_vocab, dtype=np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)]))
        self.ids = np.arange(n_vocab, dtype=np.int32)
        self.data = self.arr.ctypes.data_as(ctypes.POINTER(lib.llama_token_data))
        self.all = lib.llama_token_data_array(self.data, n_vocab, -1, False)
        self.one = lib.llama_token_data(0, 0.0, 0.0)
        self.single = lib.llama_token_data_array(ctypes.pointer(self.one), 1, -1, False)

    def pick(self, logits: np.ndarray, chain, mask=None) -> int:
        """The token `chain` picks from `logits` (after `mask`, a grammar sampler, when given)."""
        a = self.all
        self.arr["id"], self.arr["logit"], self.arr["p"] = self.ids, logits, 0.0
        a.data, a.size, a.selected, a.sorted = self.data, self.n, -1, False  # (a sampler may repoint data)
        if mask is not None:
            self.lib.llama_sampler_apply(mask, ctypes.byref(a))
        self.lib.llama_sampler_apply(chain, ctypes.byref(a))
        return int(a.data[a.selected].id)

    def allows(self, grammar, tok: int) -> bool:
        """Whether `grammar` (a sampler) lets `tok` come next."""
        self.one.id, self.one.logit, self.one.p = tok, 1.0, 0.0
        self.single.size, self.single.selected, self.single.sorted = 1, -1, False
        self.lib.llama_sampler_apply(grammar, ctypes.byref(self.single))
        return self.one.logit != float("-inf")


def plain_greedy(o: SamplingOptions, grammar: str | None = None) -> bool:
    """Whether the sampler chain make_sampler builds from the same arguments picks the largest raw
    logit and nothing else: greedy, no logit bias, neutral penalties, no grammar. Such a request
    takes an argmax over its logits row instead (11 us against 76 us for the chain's pass over the
    49k-token vocabulary on SmolLM2, 0.5 ms of a 52 ms step at 8 streams on 2 cores); both pick the
    first largest logit."""
    return (o.temperature <= 0 and not o.logit_bias and o.repeat_penalty == 1.0 and o.presence_penalty == 0
            and o.frequency_penalty == 0 and grammar is None)


class TokenChooser:
    """A model's token choice at a step's batch rows, on the loop's thread (see the module docstring).
    ``fail(r, exc)`` ends a request with an error (a matcher past llguidance's bounds); ``slots`` are the
    loop's, whose cells' prompt logprobs :meth:`score_prompt` keeps."""

    def __init__(self, lib, ctx, vocab, n_vocab: int, counters: dict[str, Any], slots: list,
                 fail: Callable[[Any, BaseException], None]) -> None:
        self.lib, self.ctx, self.vocab, self.n_vocab = lib, ctx, vocab, n_vocab
        self.counters, self.slots, self.fail = counters, slots, fail
        self._candidates: _Candidates | None = None  # constrained's arrays, made on first use
        self._mask: np.ndarray | None = None  # matched's bitmask of the vocabulary (int32 words)
        # per-token facts asked of llama.cpp once: every ctypes call lets go of the GIL, and the
        # runner's event loop (handing the last step's chunks on) takes it each time
        self._pieces: dict[int, bytes] = {}
        self._eog: dict[int, bool] = {}
        self._eog_ids: np.ndarray | None = None

    def eog_ids(self) -> np.ndarray:
        """The vocabulary's end-of-generation tokens (llama_vocab_is_eog), found once (~10 ms for 50k tokens)."""
        if self._eog_ids is None:
            self._eog_ids = np.array([t for t in range(self.n_vocab) if self.lib.llama_vocab_is_eog(self.vocab, t)],
                                     dtype=np.int64)
        return self._eog_ids

    def is_eog(self, tok: int) -> bool:
        e = self._eog.get(tok)
        if e is None:
            e = self._eog[tok] = bool(self.lib.llama_vocab_is_eog(self.vocab, tok))
        return e

    def piece(self, tok: int, special: bool = False) -> bytes:
        """A token's bytes (any thread: the cache is a dict, filled once per token)."""
        if special:  # a preserved special token: its text, not the empty piece
            return token_piece(self.lib, self.vocab, tok, special=True)
        p = self._pieces.get(tok)
        if p is None:
            p = self._pieces[tok] = token_piece(self.lib, self.vocab, tok)
        return p

    def constrained(self, r: Request, row: int) -> int:
        """A token for r (which has a grammar) at a batch row, as llama-server's common_sampler_sample
        picks it: the chain picks from the row's logits; the grammar checks that one token; only when
        it refuses does the grammar mask the whole vocabulary (4.5 ms a token on SmolLM2's 49k, a
        step's worth) before the chain picks again. Greedy, this is the argmax of the tokens the
        grammar allows, as masking first gives; sampled, the first draw (from the unmasked
        distribution) stands when the grammar allows it, as in llama-server."""
        if self._candidates is None:
            self._candidates = _Candidates(self.lib, self.n_vocab)
        c = self._candidates
        logits = np.ctypeslib.as_array(self.lib.llama_get_logits_ith(self.ctx, row), shape=(self.n_vocab,))
        tok = c.pick(logits, r.sampler)
        if not c.allows(r.grammar, tok):
            self.counters["grammar_resamples"] += 1
            tok = c.pick(logits, r.sampler, mask=r.grammar)
        self.lib.llama_sampler_accept(r.grammar, tok)
        self.lib.llama_sampler_accept(r.sampler, tok)
        return tok

    def matched(self, r: Request, row: int) -> int | None:
        """A token for r (which has an llguidance matcher) at a batch row, as constrained picks one: the
        chain picks; the matcher checks that token; only when it refuses does its mask of the vocabulary (tens
        of microseconds) go over the logits before the chain picks again. None, with r ended with an error,
        when the grammar went past llguidance's bounds on one token's work."""
        if self._candidates is None:
            self._candidates = _Candidates(self.lib, self.n_vocab)
        c, m = self._candidates, r.matcher
        logits = np.ctypeslib.as_array(self.lib.llama_get_logits_ith(self.ctx, row), shape=(self.n_vocab,))
        tok = c.pick(logits, r.sampler)
        if not m.validate_tokens([tok]):
            self.counters["grammar_resamples"] += 1
            if self._mask is None:
                self._mask = np.zeros((self.n_vocab + 31) // 32, dtype=np.int32)
            m.unsafe_compute_mask_ptr(self._mask.ctypes.data, self._mask.nbytes)
            allowed = np.unpackbits(self._mask.view(np.uint8), count=self.n_vocab, bitorder="little").astype(bool)
            if not m.is_error() and allowed.any():
                tok = c.pick(np.where(allowed, logits, np.float32("-inf")), r.sampler)
        if m.is_error() or not m.consume_token(tok):
            from localrun.structured.constraints import stopped_message

            self.fail(r, InvalidRequest(stopped_message(m.get_error())))
            return None
        self.lib.llama_sampler_accept(r.sampler, tok)
        return tok

    def score_prompt(self, r: Request, start: int, block: np.ndarray) -> None:
        """r.prompt_lps gets the logprobs of the prompt tokens that the logits rows in `block` (those of
        prompt positions start, start+1, ...) predict: row j, prompt[start + j + 1] and its top
        alternatives (options.prompt_logprobs of them), as logprob computes them for output tokens."""
        prompt, top_n = r.prompt, r.options.prompt_logprobs or 0
        rows = block[:max(0, min(len(block), len(prompt) - 1 - start))]  # (a view of llama.cpp's logits)
        if not len(rows):
            return
        m = rows.max(axis=1)
        lse = m.astype(np.float64) + np.log(np.exp(rows - m[:, None]).sum(axis=1, dtype=np.float64))
        nxt = np.asarray(prompt[start + 1:start + 1 + len(rows)], dtype=np.int64)
        chosen = rows[np.arange(len(rows)), nxt] - lse
        if top_n == 1:  # (lm-eval asks for one: is the prompt's token the greedy one)
            tops = rows.argmax(axis=1)[:, None]
        elif top_n > 1:  # row by row: a whole block's argpartition holds an int64 per logit
            tops = np.empty((len(rows), top_n), dtype=np.int64)
            for j, row in enumerate(rows):
                idx = np.argpartition(row, len(row) - top_n)[-top_n:]
                tops[j] = idx[np.argsort(-row[idx], kind="stable")]
        for j, tok in enumerate(nxt.tolist()):
            top = [] if top_n <= 0 else [(self.prompt_text(int(t)), float(rows[j, t] - lse[j])) for t in tops[j]]
            r.prompt_lps.append(TokenLogprob(token=self.prompt_text(tok), logprob=float(chosen[j]), top=top))
        slot = self.slots[r.sid]  # its cells' logprobs, for a later scored prompt with the same start
        slot.lps = r.prompt_lps[1:]

    def prompt_text(self, tok: int) -> str:
        """A prompt token's text: control tokens written out, as the prompt was tokenized (parse_special)."""
        if tok < 0:  # an image's stand-in (prompt logprobs are refused with images)
            return ""
        return self.piece(tok, special=True).decode("utf-8", "replace")

    def logprob(self, row: int, token: int, top_n: int) -> TokenLogprob:
        """Log-probabilities of the raw model distribution at a batch row."""
        ptr = self.lib.llama_get_logits_ith(self.ctx, row)
        logits = np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).astype(np.float64)
        m = logits.max()
        lse = m + np.log(np.exp(logits - m).sum())
        top: list[tuple[str, float]] = []
        top_raw: list[bytes | None] | None = None
        if top_n > 0:
            idx = np.argpartition(-logits, top_n)[:top_n]
            idx = idx[np.argsort(-logits[idx])]
            texts = [_text_and_raw(self.piece(int(t))) for t in idx]
            top = [(text, float(logits[t] - lse)) for (text, _), t in zip(texts, idx)]
            if any(raw is not None for _, raw in texts):
                top_raw = [raw for _, raw in texts]
        text, raw = _text_and_raw(self.piece(token))
        return TokenLogprob(token=text, logprob=float(logits[token] - lse), top=top, raw=raw, top_raw=top_raw,
                            top_ids=[int(t) for t in idx] if top_n > 0 else None)


def _text_and_raw(piece: bytes) -> tuple[str, bytes | None]:
    """A token's text, and its bytes when they are not whole UTF-8 (the text shows U+FFFD there)."""
    try:
        return piece.decode("utf-8"), None
    except UnicodeDecodeError:
        return piece.decode("utf-8", "replace"), piece

