"""Stop strings over streamed text, shared by every backend (pure Python, no dependencies).

Text is held back only while its end could still become a stop string: the longest
suffix of what is pending that is a prefix of some stop string. Everything before that
goes out at once, so a stop list does not delay the first token (holding back a fixed
``len(longest stop) - 1`` characters would).
"""

from __future__ import annotations


def held_back(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of `text` that starts some stop string (0 if none): what a
    stream must hold back, since it may still become a stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if s.startswith(text[-n:]):
                best = n
                break
    return best


class StopScanner:
    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.matched: str | None = None  # the stop string that was hit (the earliest in the text)

    def feed(self, text: str) -> tuple[str, bool]:
        """Add streamed text; returns (text safe to send now, whether a stop string was hit).
        After a hit, the returned text ends just before the stop string."""
        if not self.stops:
            return text, False
        self.pending += text
        hits = [(i, s) for i, s in ((self.pending.find(s), s) for s in self.stops) if i >= 0]
        if hits:
            cut, self.matched = min(hits, key=lambda h: h[0])
            out, self.pending = self.pending[:cut], ""
            return out, True
        keep = self._partial(self.pending)
        out, self.pending = self.pending[: len(self.pending) - keep], self.pending[len(self.pending) - keep:]
        return out, False

    def _partial(self, text: str) -> int:
        return held_back(text, self.stops)

    def flush(self) -> str:
        """What is still held back, at the end of generation."""
        out, self.pending = self.pending, ""
        return out


__all__ = ["StopScanner", "held_back"]
