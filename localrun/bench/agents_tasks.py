"""The tasks of `localrun bench agents`: each a fresh throw-away git repository, a prompt, and a check of
the answer or of the repository afterwards.

The same words for every model and agent (nothing here is tuned to one model); a check reads only
what the task asks for, so a model that does the work another way still passes.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

Check = Callable[[Path, str], "tuple[bool, str]"]


@dataclass(frozen=True)
class Task:
    name: str
    what: str  # what it exercises, for the table
    prompt: str
    files: dict[str, str]
    check: Check
    keep: dict[str, str] = field(default_factory=dict)  # files that must end as they began (a test, say)


def _run(repo: Path, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], cwd=repo, capture_output=True, text=True, timeout=60)


def _says(word: str) -> Check:
    def check(repo: Path, answer: str) -> tuple[bool, str]:
        ok = word.lower() in answer.lower()
        return ok, f"answer {'names' if ok else 'does not name'} {word!r}"
    return check


def _file_is(path: str, text: str) -> Check:
    def check(repo: Path, answer: str) -> tuple[bool, str]:
        p = repo / path
        if not p.is_file():
            return False, f"{path} does not exist"
        got = p.read_text(errors="replace").strip()
        return got == text, f"{path} holds {got[:60]!r}" + ("" if got == text else f", not {text!r}")
    return check


def _tests_pass(repo: Path, answer: str) -> tuple[bool, str]:
    r = _run(repo, "test_calc.py")
    return r.returncode == 0, "test_calc.py passes" if r.returncode == 0 else f"test_calc.py fails: {r.stderr[-200:]!r}"


def _renamed(repo: Path, answer: str) -> tuple[bool, str]:
    texts = {n: (repo / n).read_text(errors="replace") if (repo / n).is_file() else ""
             for n in ("prices.py", "report.py")}
    if any("compute_total" in t for t in texts.values()):
        return False, "compute_total is still there"
    if "def sum_prices" not in texts["prices.py"] or "sum_prices(" not in texts["report.py"]:
        return False, "sum_prices is not defined in prices.py and called in report.py"
    r = _run(repo, "report.py")
    ok = r.returncode == 0 and r.stdout.strip() == "total 60"
    return ok, "report.py runs and prints total 60" if ok else f"report.py: rc {r.returncode} {r.stdout[-80:]!r}"


TASKS: list[Task] = [
    Task("read", "read a file and answer", "Read the file notes.txt and tell me the secret word.",
         {"notes.txt": "Shopping: bread, milk.\nThe secret word is PELICAN.\nCall the plumber on Monday.\n"},
         _says("PELICAN")),
    Task("find-def", "find where a function is defined",
         "In which file of this repository is the function parse_header defined? Answer with its path.",
         {"app/main.py": "from app.net.headers import parse_header\n\n\ndef main():\n    print(parse_header('a: b'))\n",
          "app/net/__init__.py": "", "app/__init__.py": "",
          "app/net/headers.py": "def parse_header(line):\n    key, _, value = line.partition(':')\n"
                                "    return key.strip(), value.strip()\n",
          "app/net/util.py": "def clamp(x, lo, hi):\n    return max(lo, min(hi, x))\n"},
         _says("headers.py")),
    Task("fix-test", "fix a failing test",
         "Running `python3 test_calc.py` fails. Fix the bug in calc.py so that the test passes. Do not change "
         "test_calc.py.",
         {"calc.py": "def add(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a * b\n",
          "test_calc.py": "from calc import add, mul\n\nassert add(2, 3) == 5, 'add'\nassert mul(2, 3) == 6, 'mul'\n"
                          "print('ok')\n"},
         _tests_pass, keep={"test_calc.py": ""}),
    Task("create-file", "create a file", "Create a file named hello.txt that contains exactly: Hello, world!",
         {"README.md": "# A scratch repository\n"}, _file_is("hello.txt", "Hello, world!")),
    Task("rename", "rename a symbol across two files",
         "Rename the function compute_total to sum_prices everywhere: in prices.py and in report.py.",
         {"prices.py": "def compute_total(items):\n    return sum(items)\n",
          "report.py": "from prices import compute_total\n\nprint('total', compute_total([10, 20, 30]))\n"},
         _renamed),
    Task("run-command", "run a command and report its output",
         "Run `python3 count.py` and tell me the number it prints.",
         {"count.py": "n = sum(i * i for i in range(1, 12))\nprint(n)\n"}, _says("506")),
    Task("two-step", "read, then write what was read",
         "Find the value of port in config.ini, then write just that number into a new file port.txt.",
         {"config.ini": "[server]\nhost = 0.0.0.0\nport = 8731\nworkers = 4\n"}, _file_is("port.txt", "8731")),
    Task("no-tool", "a question that needs no tool", "What is 12 times 12? Answer with just the number.",
         {"README.md": "# A scratch repository\n"}, _says("144")),
]


def make_repo(task: Task, where: Path) -> Path:
    """A fresh git repository holding the task's files, committed."""
    where.mkdir(parents=True)
    for rel, text in task.files.items():
        p = where / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    git = ["git", "-c", "user.email=bench@localrun", "-c", "user.name=bench", "-c", "init.defaultBranch=main"]
    for argv in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "task"]):
        subprocess.run(git + argv, cwd=where, check=True, capture_output=True, timeout=60)
    return where


def score(task: Task, repo: Path, answer: str) -> tuple[bool, str]:
    for rel in task.keep:
        if (repo / rel).read_text(errors="replace") != task.files[rel]:
            return False, f"{rel} was changed"
    try:
        return task.check(repo, answer)
    except (OSError, subprocess.SubprocessError) as exc:
        return False, f"check failed: {exc}"


def select(names: str | None) -> list[Task]:
    if not names:
        return list(TASKS)
    want = [n.strip() for n in names.split(",") if n.strip()]
    known = {t.name: t for t in TASKS}
    unknown = [n for n in want if n not in known]
    if unknown:
        raise ValueError(f"unknown task(s) {', '.join(unknown)}: the tasks are {', '.join(known)}")
    return [known[n] for n in want]


__all__ = ["Task", "TASKS", "make_repo", "score", "select"]
