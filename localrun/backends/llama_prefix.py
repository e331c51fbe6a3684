"""Which token prefixes llama.cpp's unified KV cache holds, and for which sequences.

The batched llama.cpp loop (``localrun.backends.llama_batch``) keeps one KV cache for every
sequence of a model. A cell of that cache holds one token's K/V and the set of sequence ids
that use it; ``llama_memory_seq_cp(src, dst, 0, n)`` adds ``dst`` to the cells of ``src``'s
first ``n`` positions (nothing is copied) and ``llama_memory_seq_rm`` takes a sequence off its
cells, freeing those no sequence uses any more. :class:`PrefixIndex` mirrors that bookkeeping
in a tree, the way SGLang's radix cache does:

- a :class:`Block` is a run of cells (their tokens, in order) used by the same set of
  sequences, its ``owners``; its children continue it; a sequence is the path from the root
  to its ``leaf`` block, and every block on that path lists it among its owners;
- blocks are cells, not strings: two sequences that computed the same tokens each on their own
  have two sibling blocks with equal tokens, because llama.cpp holds those tokens twice;
- :meth:`match` finds the longest prefix of a prompt the cache holds (and a sequence that holds
  it), :meth:`share` records a ``seq_cp``, :meth:`append` a decode, :meth:`truncate` a
  ``seq_rm`` and returns the cells it freed; ``used`` counts the cells in use, exactly as
  llama.cpp does when every change goes through here.

Pure Python and torch-free: tests drive it in microseconds without llama.cpp.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(eq=False)
class Block:
    start: int  # position of the block's first token in every sequence that owns it
    tokens: list[int]
    owners: set[int] = field(default_factory=set)
    parent: "Block | None" = None
    children: list["Block"] = field(default_factory=list)

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


class PrefixIndex:
    """The cells of a unified KV cache as a tree of blocks (see the module docstring)."""

    def __init__(self) -> None:
        self.root = Block(0, [])
        self.leaf: dict[int, Block] = {}  # sequence id -> the last block of its path
        self.used = 0  # cells in use

    # -- reading -----------------------------------------------------------------------------
    def length(self, seq: int) -> int:
        """Tokens (cells) sequence ``seq`` holds."""
        leaf = self.leaf.get(seq)
        return leaf.end if leaf is not None else 0

    def tokens(self, seq: int) -> list[int]:
        out: list[list[int]] = []
        b = self.leaf.get(seq)
        while b is not None and b is not self.root:
            out.append(b.tokens)
            b = b.parent
        return [t for part in reversed(out) for t in part]

    def match(self, tokens: list[int]) -> tuple[int, int | None]:
        """(n, seq): the longest prefix of ``tokens`` whose cells the cache holds, and a sequence
        holding all n of them (None when n is 0). Every path is searched: sibling blocks may start
        alike (the same tokens computed twice) and go on differently."""
        best_n, best = 0, None
        stack = [(self.root, 0)]
        while stack:
            node, n = stack.pop()
            for child in node.children:
                k = _common(child.tokens, tokens, n)
                if not k:
                    continue
                if n + k > best_n:
                    best_n, best = n + k, child
                if k == len(child.tokens) and n + k < len(tokens):
                    stack.append((child, n + k))
        return (best_n, min(best.owners)) if best is not None else (0, None)

    # -- changes (each mirrors one llama.cpp call) -------------------------------------------
    def share(self, src: int, dst: int, n: int) -> None:
        """llama_memory_seq_cp(src, dst, 0, n): ``dst`` (empty) uses ``src``'s first n cells."""
        if dst in self.leaf:
            raise ValueError(f"sequence {dst} is not empty")
        if n <= 0:
            return
        if n > self.length(src):
            raise ValueError(f"sequence {src} holds {self.length(src)} tokens, not {n}")
        b = self.leaf[src]
        while b.start >= n:
            b = b.parent
        if b.end > n:
            b = self._split(b, n - b.start)
        self.leaf[dst] = b
        while b is not self.root:
            b.owners.add(dst)
            b = b.parent

    def append(self, seq: int, tokens: list[int]) -> None:
        """A decode wrote ``tokens`` for ``seq`` at its next positions (fresh cells)."""
        if not tokens:
            return
        leaf = self.leaf.get(seq, self.root)
        if leaf is not self.root and leaf.owners == {seq} and not leaf.children:
            leaf.tokens.extend(tokens)
        else:
            new = Block(leaf.end, list(tokens), {seq}, leaf)
            leaf.children.append(new)
            self.leaf[seq] = new
        self.used += len(tokens)

    def truncate(self, seq: int, n: int) -> int:
        """llama_memory_seq_rm(seq, n, -1): ``seq`` keeps its first n cells. The cells no other
        sequence uses are freed: their count is returned. n = 0 forgets the sequence."""
        b = self.leaf.get(seq)
        if b is None:
            return 0
        freed = 0
        while b is not self.root and b.start >= n:
            parent = b.parent
            freed += self._drop_owner(b, seq)
            b = parent
        if b is not self.root and b.end > n:
            if b.owners == {seq} and not b.children:
                freed += b.end - n
                del b.tokens[n - b.start:]
            else:
                top = self._split(b, n - b.start)
                freed += self._drop_owner(b, seq)
                b = top
        if b is self.root:
            self.leaf.pop(seq, None)
        else:
            self.leaf[seq] = b
        self.used -= freed
        return freed

    # -- internals ---------------------------------------------------------------------------
    def _split(self, b: Block, k: int) -> Block:
        """Cut b after its first k tokens (0 < k < len): a new block takes them, above b; returns
        it. Sequences whose leaf is b (or below) keep it; their paths now pass through the new block."""
        top = Block(b.start, b.tokens[:k], set(b.owners), b.parent, [b])
        siblings = b.parent.children
        siblings[siblings.index(b)] = top
        b.parent, b.start, b.tokens = top, b.start + k, b.tokens[k:]
        return top

    def _drop_owner(self, b: Block, seq: int) -> int:
        """seq leaves block b; a block nobody owns goes (its cells are free): returns how many."""
        b.owners.discard(seq)
        if b.owners:
            return 0
        b.parent.children.remove(b)
        return len(b.tokens)


def _common(a: list[int], b: list[int], offset: int) -> int:
    """How many leading tokens of ``a`` equal ``b[offset:]``."""
    n = min(len(a), len(b) - offset)
    i = 0
    while i < n and a[i] == b[offset + i]:
        i += 1
    return i
