"""StopScanner: the text sent equals the text up to the first stop string, however the text
is split into pieces; nothing is held back that cannot start a stop string."""

from __future__ import annotations

import random

from localrun.stop_strings import StopScanner


def _run(stops, pieces, matched=None):
    s = StopScanner(stops)
    sent, hit = [], False
    for p in pieces:
        out, hit = s.feed(p)
        sent.append(out)
        if hit:
            break
    if not hit:
        sent.append(s.flush())
    if matched is not None:
        matched.append(s.matched)
    return "".join(sent), hit, sent


def test_first_piece_is_not_held_back():
    _, _, sent = _run(["<|im_end|>"], ["The", " story", "<|im", "_end|>", "tail"])
    assert sent[:2] == ["The", " story"] and sent[2] == ""


def test_random_splits_match_the_reference():
    rng = random.Random(0)
    alphabet = "ab<|>xy "
    for _ in range(3000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(0, 3))]
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 6))))
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        matched = []
        got, hit, _ = _run(stops, pieces, matched)
        first = min((i for i in (text.find(s) for s in stops if s) if i >= 0), default=-1)
        assert hit == (first >= 0), (text, stops, pieces)
        assert got == (text[:first] if first >= 0 else text), (text, stops, pieces)
        # which stop string ended it: one that occurs where the text was cut
        assert (matched[0] is None) if first < 0 else text.startswith(matched[0], first), (text, stops, matched)
