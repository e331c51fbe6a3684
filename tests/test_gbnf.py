"""structured/gbnf.py: the JSON-schema converter's fixes, checked against the grammar's own meaning
(the integer ranges as regular expressions) and against llama.cpp parsing them (test_llamacpp_batch)."""

from __future__ import annotations

import random
import re

import pytest

from localrun.structured.gbnf import integer_bounds, integer_range
from localrun.errors import InvalidRequest


def _regex(gbnf: str) -> re.Pattern:
    """The range's GBNF (literals, classes, {k}, groups, alternation) as a Python regex."""
    out = re.sub(r'"([^"]*)"', lambda m: re.escape(m.group(1)), gbnf)
    return re.compile(out.replace(" ", ""))


@pytest.mark.parametrize("lo,hi", [(1, 5), (0, 0), (-7, 123), (15, 2307), (-2307, -15), (99, 100), (1, 10), (0, 9),
                                   (-1, 1), (10, 99), (100, 999), (123, 123), (-50, 0), (7, 70000)])
def test_integer_range_matches_exactly_the_integers_in_it(lo, hi):
    rx = _regex(integer_range(lo, hi))
    for n in range(lo - 300, hi + 301):
        assert bool(rx.fullmatch(str(n))) == (lo <= n <= hi), (lo, hi, n)
    for bad in ("01", "-0", "007", "+1", "1.0", ""):
        assert not rx.fullmatch(bad)


def test_random_ranges_and_open_ends():
    rng = random.Random(5)
    for _ in range(60):
        a, b = sorted(rng.randint(-10 ** rng.randint(1, 7), 10 ** rng.randint(1, 7)) for _ in range(2))
        rx = _regex(integer_range(a, b))
        for n in [a, b, a - 1, b + 1, *(rng.randint(a - 1000, b + 1000) for _ in range(200))]:
            assert bool(rx.fullmatch(str(n))) == (a <= n <= b), (a, b, n)
    rx = _regex(integer_range(1, None))
    assert rx.fullmatch("1") and rx.fullmatch("9" * 16) and not rx.fullmatch("0") and not rx.fullmatch("1" + "0" * 16)
    rx = _regex(integer_range(None, -3))
    assert rx.fullmatch("-3") and rx.fullmatch("-" + "9" * 16) and not rx.fullmatch("-2") and not rx.fullmatch("5")


def test_bounds_from_the_schema():
    assert integer_bounds({"minimum": 1, "maximum": 5}) == (1, 5)
    assert integer_bounds({"exclusiveMinimum": 0, "exclusiveMaximum": 10}) == (1, 9)
    assert integer_bounds({"minimum": 0.5, "maximum": 4.5}) == (1, 4)
    assert integer_bounds({"minimum": 1, "exclusiveMinimum": True, "maximum": 5, "exclusiveMaximum": True}) == (2, 4)
    with pytest.raises(InvalidRequest, match="no integer"):
        integer_bounds({"minimum": 5, "maximum": 4})
    with pytest.raises(InvalidRequest, match="no value of at most 16 digits"):
        integer_range(10 ** 20, None)
    with pytest.raises(InvalidRequest, match="must be a number"):
        integer_bounds({"minimum": "1"})
