"""Comparing two greedy answers to one prompt, honestly.

A batched server computes a request's tokens beside other requests, in KV cells wherever the
cache has room, and llama.cpp's arithmetic depends on both (the cell layout changes how the
attention sums are grouped; a quantized model then rounds its activations differently): a greedy
answer served next to other requests can differ from the same request served alone. Measured on
SmolLM2-135M Q4_1 (2-core Xeon), the log-probabilities of the same tokens typically moved by 0.1 to 0.3 between such runs (and
twice by more than 0.5), and answers parted where the two best tokens were that close. A
difference in the answer is then honest only where neither run could tell the two tokens apart:
at the first token where the answers part, each must list the other's token among its top
candidates, at most ``NEAR_TIE`` nats below its own choice. A wrong KV cache (a bug) shows as a
divergence where a run was sure.

Tokens are compared as the APIs stream them: ``(text, logprob, [(text, logprob), ...])`` per
generated token, as in OpenAI's ``logprobs.content`` entries with ``top_logprobs``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

NEAR_TIE = 1.0  # nats: the other token had at least 1/e of the chosen one's probability (see above)

Token = tuple[str, float, list[tuple[str, float]]]


@dataclass
class Comparison:
    verdict: str  # "same" | "near_tie" | "differs"
    index: int | None = None  # the first token where the answers part
    reference_token: str | None = None
    got_token: str | None = None
    gap: float | None = None  # reference: logprob of its token minus the other's (None: not among its candidates)
    gap_got: float | None = None  # the same, seen from the other answer

    @property
    def acceptable(self) -> bool:
        return self.verdict != "differs"


def compare(reference: list[Token], got: list[Token], tol: float = NEAR_TIE) -> Comparison:
    """Where and how ``got`` departs from ``reference`` (both greedy answers to one prompt). At the
    first token where they part, each answer that has a token there must list the other's token
    among its candidates, at most ``tol`` nats below its own: a near tie seen from both sides. An
    answer that ended there chose the end-of-turn token, whose text is empty."""
    for i in range(max(len(reference), len(got))):
        ref = reference[i] if i < len(reference) else None
        oth = got[i] if i < len(got) else None
        if ref is not None and oth is not None and ref[0] == oth[0]:
            continue
        r_tok = ref[0] if ref is not None else ""
        g_tok = oth[0] if oth is not None else ""
        gap_r = _gap(ref, g_tok)
        gap_g = _gap(oth, r_tok)
        seen = [g for side, g in ((ref, gap_r), (oth, gap_g)) if side is not None]
        ok = all(g is not None and g <= tol for g in seen)
        return Comparison("near_tie" if ok else "differs", i, r_tok, g_tok, gap_r, gap_g)
    return Comparison("same")


def _gap(token: Token | None, other: str) -> float | None:
    """How far below its own choice an answer put ``other`` at that position (None: not a candidate)."""
    if token is None:
        return None
    text, lp, top = token
    alt = next((l for t, l in top if t == other), None)
    return None if alt is None else lp - alt


def openai_tokens(content: Iterable[dict[str, Any]]) -> list[Token]:
    """OpenAI chat ``logprobs.content`` entries (dicts, or the SDK's objects) as Tokens."""
    out: list[Token] = []
    for c in content:
        get = c.get if isinstance(c, dict) else (lambda k, c=c: getattr(c, k))
        top = [((t.get("token") if isinstance(t, dict) else t.token), (t.get("logprob") if isinstance(t, dict)
                else t.logprob)) for t in (get("top_logprobs") or [])]
        out.append((get("token"), float(get("logprob")), top))
    return out
