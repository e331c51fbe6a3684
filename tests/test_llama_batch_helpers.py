"""Fast tests of the batched llama.cpp loop's helpers, without llama.cpp: prompt lookup, image
stand-ins, and the honest comparison of greedy answers."""

from __future__ import annotations

import pytest

from localrun.backends.llamacpp.batch import lookup_draft
from localrun.backends.llamacpp.images import image_standins
from localrun.bench.greedy import NEAR_TIE, compare


def test_lookup_draft_copies_what_followed_the_ngram():
    assert lookup_draft([5, 6, 7, 8, 9, 5, 6, 7], 3) == [8, 9, 5]
    assert lookup_draft([5, 6, 7, 8, 9, 6, 7], 2) == [8, 9]  # the longest n-gram that occurred
    assert lookup_draft([1, 2, 3], 4) == []  # nothing repeats
    assert lookup_draft([1, 2, 1], 0) == []


def test_image_standins_are_no_tokens_and_follow_the_image():
    a, b = image_standins(b"\x01" * 32, 16), image_standins(b"\x02" * 32, 16)
    assert len(a) == 16 and all(t < 0 for t in a + b) and a != b
    assert image_standins(b"\x01" * 32, 16) == a  # the same image, the same stand-ins


def _tok(text, lp, *top):
    return (text, lp, [(text, lp), *top])


def test_compare_greedy_answers():
    ref = [_tok("The", -0.1), _tok(" sky", -0.2, (" sea", -0.3)), _tok(" is", -0.1)]
    assert compare(ref, ref).verdict == "same"
    near = compare(ref, [_tok("The", -0.1), _tok(" sea", -0.25, (" sky", -0.28))])
    assert near.verdict == "near_tie" and near.index == 1
    assert near.gap == pytest.approx(0.1) and near.gap_got == pytest.approx(0.03)
    # a tie for the reference but not for the other run (it was sure): not honest
    assert compare(ref, [_tok("The", -0.1), _tok(" sea", -0.01, (" sky", -0.01 - NEAR_TIE - 0.1))]).verdict == "differs"
    assert compare(ref, [_tok("The", -0.1), _tok(" sea", -0.3)]).verdict == "differs"  # " sky" not its candidate
    far = [_tok("The", -0.1), _tok(" sky", -0.2, (" sea", -0.2 - NEAR_TIE - 0.01))]
    assert compare(far, [_tok("The", -0.1), _tok(" sea", -0.3, (" sky", -0.4))]).verdict == "differs"
    assert compare(ref, [_tok("The", -0.1), _tok(" cat", -0.3, (" sky", -0.4))]).verdict == "differs"
    # one answer stopped (end of turn, empty text) where the other went on
    stopped = [_tok("The", -0.1), _tok(" sky", -0.2, ("", -0.4))]
    assert compare(stopped, stopped[:1]).verdict == "near_tie"
    assert compare(stopped[:1], stopped).verdict == "near_tie"
    assert compare(ref[:1] + [_tok(" sky", -0.2, ("", -5.0))], ref[:1]).verdict == "differs"
