"""Fast tests of the batched llama.cpp loop's bookkeeping, without llama.cpp: the prefix index
against a cell-by-cell model of llama.cpp's unified KV cache, prompt lookup, and the honest
comparison of greedy answers."""

from __future__ import annotations

import random

import pytest

from localrun.backends.llama_batch import lookup_draft
from localrun.backends.llama_prefix import PrefixIndex
from localrun.bench.greedy import NEAR_TIE, compare


class Cells:
    """llama.cpp's unified KV cache cell by cell: each cell holds a token at a position and the
    set of sequences using it (llama_kv_cells: seq_cp adds, seq_rm removes, a cell nobody uses is free)."""

    def __init__(self) -> None:
        self.cells: list[tuple[int, int, set[int]]] = []  # (pos, token, seqs)

    def seq_cp(self, src: int, dst: int, n: int) -> None:
        for pos, _, seqs in self.cells:
            if src in seqs and pos < n:
                seqs.add(dst)

    def seq_rm(self, seq: int, keep: int) -> None:
        for pos, _, seqs in self.cells:
            if seq in seqs and pos >= keep:
                seqs.discard(seq)
        self.cells = [c for c in self.cells if c[2]]

    def append(self, seq: int, tokens: list[int]) -> None:
        start = self.length(seq)
        self.cells += [(start + i, t, {seq}) for i, t in enumerate(tokens)]

    def length(self, seq: int) -> int:
        return sum(1 for _, _, s in self.cells if seq in s)

    def tokens(self, seq: int) -> list[int]:
        return [t for _, t, _ in sorted((c for c in self.cells if seq in c[2]), key=lambda c: c[0])]

    @property
    def used(self) -> int:
        return len(self.cells)


def _check(index: PrefixIndex, cells: Cells, seqs: range) -> None:
    assert index.used == cells.used
    for s in seqs:
        assert index.tokens(s) == cells.tokens(s), s
        assert index.length(s) == cells.length(s)


def test_share_append_truncate_match_against_cells():
    index, cells = PrefixIndex(), Cells()
    index.append(0, [1, 2, 3, 4, 5]); cells.append(0, [1, 2, 3, 4, 5])
    assert index.match([1, 2, 3, 9]) == (3, 0)
    index.share(0, 1, 3); cells.seq_cp(0, 1, 3)  # cells shared, not copied
    assert index.used == 5
    index.append(1, [7, 8]); cells.append(1, [7, 8])
    assert index.used == 7 and index.tokens(1) == [1, 2, 3, 7, 8]
    assert index.match([1, 2, 3, 7, 8, 9]) == (5, 1) and index.match([1, 2, 3, 4]) == (4, 0)
    assert index.truncate(0, 0) == 2  # only 4, 5 were 0's alone
    cells.seq_rm(0, 0)
    _check(index, cells, range(2))
    assert index.match([1, 2, 3, 4]) == (3, 1)
    assert index.truncate(1, 2) == 3 and index.tokens(1) == [1, 2]
    assert index.truncate(1, 0) == 2 and index.used == 0 and index.match([1]) == (0, None)


def test_two_sequences_that_computed_the_same_tokens_hold_them_twice():
    index = PrefixIndex()
    index.append(0, [1, 2, 3])
    index.append(1, [1, 2, 3])  # computed on its own (no share): llama.cpp holds these tokens twice
    assert index.used == 6
    n, seq = index.match([1, 2, 3])
    assert n == 3 and seq in (0, 1)
    assert index.truncate(0, 0) == 3 and index.used == 3 and index.match([1, 2, 3]) == (3, 1)


@pytest.mark.parametrize("seed", range(30))
def test_random_operations_keep_the_books_of_llama_cpp(seed):
    """Random share / append / truncate over 6 sequences and a 4-token alphabet (so prefixes
    collide): the index's cell count, each sequence's tokens, and what match() promises (the
    sequence it names holds that prefix) always agree with the cell-by-cell model."""
    rng = random.Random(seed)
    index, cells = PrefixIndex(), Cells()
    seqs = range(6)
    for _ in range(300):
        op = rng.random()
        s = rng.choice(seqs)
        if op < 0.45:
            toks = [rng.randrange(4) for _ in range(rng.randint(1, 5))]
            index.append(s, toks); cells.append(s, toks)
        elif op < 0.65:
            src = rng.choice(seqs)
            if src != s and index.length(src):
                index.truncate(s, 0); cells.seq_rm(s, 0)  # share() takes an empty destination
                n = rng.randint(1, index.length(src))
                index.share(src, s, n); cells.seq_cp(src, s, n)
        else:
            keep = rng.randint(0, index.length(s))
            freed_before = cells.used
            cells.seq_rm(s, keep)
            assert index.truncate(s, keep) == freed_before - cells.used
        _check(index, cells, seqs)
        probe = [rng.randrange(4) for _ in range(rng.randint(1, 12))]
        n, holder = index.match(probe)
        if n:
            assert cells.tokens(holder)[:n] == probe[:n]
        assert all(cells.tokens(x)[:n + 1] != probe[:n + 1] or n == len(probe) for x in seqs)


def test_lookup_draft_copies_what_followed_the_ngram():
    assert lookup_draft([5, 6, 7, 8, 9, 5, 6, 7], 3) == [8, 9, 5]
    assert lookup_draft([5, 6, 7, 8, 9, 6, 7], 2) == [8, 9]  # the longest n-gram that occurred
    assert lookup_draft([1, 2, 3], 4) == []  # nothing repeats
    assert lookup_draft([1, 2, 1], 0) == []


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
