"""The held-out set of `localrun bench fim`: single-line holes cut from Python files no one here wrote.

The files are the standard library of the Python running the benchmark (``sysconfig.get_paths()["stdlib"]``,
its tests and site-packages left out), sorted by path and shuffled with a fixed seed; each file gives at most
one hole, a line picked with the same seed among its candidates:

- code, not a comment, a blank line or a line inside a multi-line string (docstrings), as ``tokenize`` reads it;
- at least MIN_CHARS non-space characters and at most MAX_CHARS characters;
- the file decodes as UTF-8 and tokenizes.

A hole is what an editor sends with the cursor on a fresh, indented line: the prefix is the lines above
(whole lines, at most PREFIX_CHARS characters: about 450 tokens of Python; sized so that 100 holes run
through four routes in minutes on two CPU cores) and the line's indentation, the
suffix a new line and the lines below (whole lines, at most SUFFIX_CHARS characters), the answer the line's
code. Every other hole also carries a neighbouring file of the same folder (its head, at most EXTRA_CHARS
characters, whole lines) as repository context (``input_extra``). The set is the same on every machine with
the same Python version; ``describe()`` records which.
"""

from __future__ import annotations

import hashlib
import io
import random
import sys
import sysconfig
import tokenize
from dataclasses import asdict, dataclass, field
from pathlib import Path

MIN_CHARS = 10
MAX_CHARS = 100
PREFIX_CHARS = 1600
SUFFIX_CHARS = 500
EXTRA_CHARS = 1000
SEED = 58
SKIP_PARTS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}


@dataclass
class Hole:
    file: str  # path under the stdlib folder
    line: int  # 1-based
    prefix: str
    suffix: str
    answer: str  # the line's code: no indentation, no trailing spaces or newline
    extra: list[dict] = field(default_factory=list)  # [{"filename", "text"}]


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def python_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if not SKIP_PARTS.intersection(p.relative_to(root).parts[:-1]))


def _candidates(text: str) -> list[int]:
    """0-based indexes of the lines that may become holes."""
    lines = text.split("\n")
    in_string: set[int] = set()
    first_kind: dict[int, int] = {}
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            (r0, _), (r1, _) = tok.start, tok.end
            if tok.type == tokenize.STRING and r1 > r0:
                in_string.update(range(r0 - 1, r1))  # every line the string touches
            if tok.type not in (tokenize.INDENT, tokenize.DEDENT, tokenize.NL, tokenize.NEWLINE):
                first_kind.setdefault(r0 - 1, tok.type)
    except (tokenize.TokenError, SyntaxError, IndentationError):
        return []
    out = []
    for i, line in enumerate(lines):
        code = line.strip()
        if (i in in_string or first_kind.get(i) in (None, tokenize.COMMENT, tokenize.STRING)
                or len(code.replace(" ", "")) < MIN_CHARS or len(line) > MAX_CHARS or "\t" in line):
            continue
        out.append(i)
    return out


def _head(text: str, limit: int) -> str:
    """Whole lines from the top, at most `limit` characters."""
    if len(text) <= limit:
        return text
    cut = text.rfind("\n", 0, limit)
    return text[:cut + 1] if cut >= 0 else ""


def _tail(text: str, limit: int) -> str:
    """Whole lines from the bottom, at most `limit` characters (text ends with a newline)."""
    if len(text) <= limit:
        return text
    cut = text.find("\n", len(text) - limit)
    return text[cut + 1:] if cut >= 0 else ""


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def make_holes(n: int, seed: int = SEED, root: Path | None = None) -> list[Hole]:
    """`n` holes (fewer only if the files run out), the same for the same Python and seed."""
    root = root or stdlib_dir()
    files = python_files(root)
    order = list(files)
    random.Random(seed).shuffle(order)
    holes: list[Hole] = []
    for path in order:
        if len(holes) >= n:
            break
        text = _read(path)
        if not text or "\r" in text:
            continue
        cands = _candidates(text)
        if not cands:
            continue
        rng = random.Random(f"{seed}:{path.relative_to(root).as_posix()}")
        i = rng.choice(cands)
        lines = text.split("\n")
        line = lines[i]
        indent = line[:len(line) - len(line.lstrip())]
        prefix = _tail("".join(x + "\n" for x in lines[:i]), PREFIX_CHARS) + indent
        suffix = "\n" + _head("\n".join(lines[i + 1:]), SUFFIX_CHARS)
        extra = []
        if len(holes) % 2 == 0:
            siblings = [p for p in files if p.parent == path.parent and p != path]  # the next file of the folder
            sib = next((s for s in siblings if s > path), siblings[0]) if siblings else None
            sib_text = _read(sib) if sib is not None else None
            if sib_text:
                extra.append({"filename": sib.relative_to(root).as_posix(), "text": _head(sib_text, EXTRA_CHARS)})
        holes.append(Hole(file=path.relative_to(root).as_posix(), line=i + 1, prefix=prefix, suffix=suffix,
                          answer=line.strip(), extra=extra))
    return holes


def describe(holes: list[Hole], seed: int = SEED) -> dict:
    """What the set was cut from: the Python, the files and a digest of the holes."""
    digest = hashlib.sha256()
    for h in holes:
        digest.update(repr(sorted(asdict(h).items())).encode())
    return {"python": sys.version.split()[0], "implementation": sys.implementation.name, "stdlib": str(stdlib_dir()),
            "seed": seed, "holes": len(holes), "with_extra": sum(1 for h in holes if h.extra),
            "files": [f"{h.file}:{h.line}" for h in holes], "sha256": digest.hexdigest()[:16]}


def first_line(text: str) -> str:
    """A completion as the hole's answer is compared: up to its first new line, trailing spaces off."""
    return text.split("\n", 1)[0].rstrip()
