"""The package's layout, checked by reading the source with `ast` (nothing is imported).

- No import circle anywhere in `localrun/`. An edge A -> B is any `import` / `from ... import`
  of a localrun module in A: at module level AND inside functions and classes (a function-level
  import that closes a loop is still a loop, only deferred), except under `if TYPE_CHECKING:`
  (annotations only, never run). `from pkg import name` points at the submodule `pkg.name` when
  there is one, else at `pkg` (its `__init__`). Importing a submodule runs its parents'
  `__init__` too; that implicit edge is not counted (a package's `__init__` may re-export).
- No module imports another module's private (`_x`) name, at any level.
- The engine core (scheduler, runner, sampler and the engine loop; models, kernels, KV and
  quantization aside) stays within its line budget, and every engine module opens with a
  docstring whose first line alone states its job.
- A newcomer finds the KV pool, the prefix cache, the attention backends, a model family and
  the scheduler by path alone.
- Arrows run one way: an import from one concern (a subpackage of localrun, or a top-level module)
  into another is allowed only where ARROWS below lists it.
- No file in localrun/ or kernels/ is over FILE_LINES lines and no class over CLASS_LINES, but for
  the exceptions listed with their reason; no two classes in localrun/ share a name.
"""

from __future__ import annotations

import ast
import os
from collections import defaultdict
from pathlib import Path

import pytest

import localrun

ROOT = Path(localrun.__file__).resolve().parent
CORE = ("scheduler.py", "runner.py", "sampler.py", "engine.py")
CORE_BUDGET = 2500


def _py_files(base: Path) -> list[Path]:
    """The .py files under base, not following links (localrun/kernels links to the top-level kernels/)."""
    out = []
    for d, dirs, files in os.walk(base):
        dirs[:] = sorted(x for x in dirs if not (Path(d) / x).is_symlink() and x != "__pycache__")
        out += [Path(d) / f for f in files if f.endswith(".py")]
    return sorted(out)


def module_files(root: Path) -> dict[str, Path]:
    """Module name -> file, for `root` and, when it sits beside the package, `kernels/` (shipped
    as localrun.kernels)."""
    out = {}
    trees = [(root, [root.name])]
    if (root.parent / "kernels").is_dir() and root.name == "localrun":
        trees.append((root.parent / "kernels", ["localrun", "kernels"]))
    for base, prefix in trees:
        for p in _py_files(base):
            parts = prefix + list(p.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = p
    return out


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def imports(root: Path) -> tuple[dict[str, set[str]], list[str]]:
    """(module -> the localrun modules it imports, ["module:line imports pkg._name", ...])."""
    mods = module_files(root)
    top = root.name

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = {m: set() for m in mods}
    private: list[str] = []
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        stack: list[ast.AST] = [ast.parse(path.read_text(encoding="utf-8"), str(path))]
        while stack:
            node = stack.pop()
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.If) and _is_type_checking(child):
                    stack.extend(child.orelse)
                    continue
                stack.append(child)
                if isinstance(child, ast.Import):
                    for alias in child.names:
                        if alias.name.split(".")[0] == top:
                            target = resolve(alias.name)
                            if target:
                                edges[mod].add(target)
                            if any(p.startswith("_") and not p.startswith("__") for p in alias.name.split(".")):
                                private.append(f"{mod}:{child.lineno} imports {alias.name}")
                elif isinstance(child, ast.ImportFrom):
                    base = child.module or ""
                    if child.level:
                        up = package.split(".")[: len(package.split(".")) - child.level + 1]
                        base = ".".join(up + ([child.module] if child.module else []))
                    if base.split(".")[0] != top:
                        continue
                    for alias in child.names:
                        full = f"{base}.{alias.name}"
                        target = full if full in mods else resolve(base)
                        if target and target != mod:
                            edges[mod].add(target)
                        if alias.name.startswith("_") and not alias.name.startswith("__") and full not in mods:
                            private.append(f"{mod}:{child.lineno} imports {base}.{alias.name}")
    return edges, private


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), plus self-loops."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        work = [(v, iter(sorted(edges.get(v, ()))))]
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        while work:
            node, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                    break
                if w in on:
                    low[node] = min(low[node], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == node:
                            break
                    if len(comp) > 1 or node in edges.get(node, ()):
                        out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_no_import_circles():
    edges, _ = imports(ROOT)
    assert sum(len(t) for t in edges.values()) > 100  # the walk sees the package's imports
    found = cycles(edges)
    assert not found, "import circles (module- and function-level imports):\n" + "\n".join(
        " -> ".join(c) for c in found)


def test_no_private_imports_across_modules():
    _, private = imports(ROOT)
    assert not private, "imports of another module's private names:\n" + "\n".join(private)


def test_the_checks_catch_what_they_look_for(tmp_path):
    """The walker on a planted package: a function-level circle, a module-level circle and a
    private import are all reported; TYPE_CHECKING imports are not."""
    pkg = tmp_path / "localrun"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from localrun.b import thing\n")
    (pkg / "b.py").write_text("def f():\n    from localrun import a\n    return a\nthing = 1\n")
    (pkg / "sub" / "c.py").write_text("from . import d\nfrom localrun.a import _hidden\n")
    (pkg / "sub" / "d.py").write_text("import localrun.sub.c\n")
    (pkg / "e.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from localrun.f import X\n")
    (pkg / "f.py").write_text("from localrun.e import TYPE_CHECKING\n")
    edges, private = imports(pkg)
    assert sorted(cycles(edges)) == [["localrun.a", "localrun.b"], ["localrun.sub.c", "localrun.sub.d"]]
    assert private == ["localrun.sub.c:2 imports localrun.a._hidden"]


def _docstring_summary(path: Path) -> str | None:
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")), clean=False)
    if not doc or not doc.strip():
        return None
    lines = doc.split("\n")
    if len(lines) > 1 and lines[1].strip():
        return None  # the summary runs on: not one line
    return lines[0].strip() or None


@pytest.mark.parametrize("path", sorted((ROOT / "engine").rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_engine_module_states_its_job_in_one_line(path):
    summary = _docstring_summary(path)
    assert summary and len(summary) > 20, f"{path}: the docstring's first line alone should state the module's job"


def test_the_engine_core_is_within_its_line_budget():
    sizes = {name: len((ROOT / "engine" / name).read_text(encoding="utf-8").splitlines()) for name in CORE}
    assert sum(sizes.values()) <= CORE_BUDGET, sizes


@pytest.mark.parametrize("where", ["engine/kv/pool.py", "engine/kv/radix.py", "engine/kv/host.py", "engine/kv/base.py",
                                   "engine/layers/attention/base.py", "engine/layers/attention/triton_backend.py",
                                   "engine/layers/attention/torch_backend.py", "engine/layers/quant.py",
                                   "engine/models/registry.py", "engine/models/llama.py", "engine/models/gemma.py",
                                   "engine/scheduler.py", "engine/runner.py", "engine/sampler.py", "engine/engine.py",
                                   "bench/overhead.py"])
def test_a_newcomer_finds_it_by_path(where):
    assert (ROOT / where).is_file()


# -- direction ------------------------------------------------------------------------------------
# Which concern may import which: a concern is a subpackage of localrun or a top-level module
# ("localrun" is the package's own __init__: its version). Leaves at the bottom, clients at the top;
# an arrow not written here is a finding (add it here only with a reason in the commit).
BASE = {"localrun", "errors", "config", "archs", "stop_strings"}
ARROWS: dict[str, set[str]] = {
    "localrun": set(),
    "errors": set(),
    "archs": set(),
    "stop_strings": set(),
    "config": {"errors"},
    "kernels": set(),  # torch and Triton only
    "templates": BASE,  # chat templates: Jinja and Go
    "structured": BASE,  # a request's output constraint: JSON schema, regex, GBNF, llguidance masks
    "engine": BASE | {"kernels", "structured"},  # the native engine: never backends, server, library
    "library": BASE | {"templates"},  # the model store: runs nothing, never server or backends
    "backends": BASE | {"engine", "structured", "library"},  # each loaded model, behind the Backend protocol
    "attachments": BASE,
    "server": BASE | {"backends", "structured", "library", "templates", "attachments"},  # the daemon
    "cluster": BASE | {"server", "backends", "library"},  # replicas on Ray Serve
    "client": BASE | {"library"},  # HTTP client of the daemon; reads local files for uploads
    "tui": BASE | {"client", "attachments"},  # a client of the HTTP API only
    # `serve` runs the daemon; `create` parses a Modelfile and hashes files for upload (library), as Ollama's CLI does
    "cli": BASE | {"agents", "client", "tui", "server", "bench", "cluster", "attachments", "library"},
    "agents": BASE,  # the coding agents' argv, environment and settings: launch and bench agents share them
    "bench": BASE | {"agents", "engine", "kernels", "backends", "structured", "library", "templates", "cluster", "server"},
    "healthcheck": BASE,
    "__main__": BASE | {"cli"},
}


def concern(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def test_arrows_run_the_written_way():
    edges, _ = imports(ROOT)
    against = sorted(f"{a} -> {b}" for a, targets in edges.items() for b in targets
                     if concern(a) != concern(b) and concern(b) not in ARROWS.get(concern(a), set()))
    assert not against, "imports against the written direction (tests/test_layout.py ARROWS):\n" + "\n".join(against)
    unknown = sorted({concern(m) for m in edges} - set(ARROWS))
    assert not unknown, f"concerns with no written arrows: {unknown}"


def test_the_direction_check_catches_an_arrow_back_up(tmp_path):
    pkg = tmp_path / "localrun"
    for sub in ("engine", "backends"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "engine" / "loop.py").write_text("from localrun.backends import thing\n")
    (pkg / "backends" / "thing.py").write_text("from localrun.engine import loop\n")
    edges, _ = imports(pkg)
    against = [(a, b) for a, ts in edges.items() for b in ts
               if concern(a) != concern(b) and concern(b) not in ARROWS[concern(a)]]
    assert against == [("localrun.engine.loop", "localrun.backends.thing")]


# -- size -----------------------------------------------------------------------------------------
FILE_LINES = 600
CLASS_LINES = 400
# path relative to the repository -> why it may be longer (none today)
LONG_FILES: dict[str, str] = {}
LONG_CLASSES: dict[str, str] = {}  # "path:Class" -> why


def _sources() -> list[Path]:
    return [p for p in module_files(ROOT).values()]


def test_no_file_over_its_line_budget():
    repo = ROOT.parent
    over = {str(p.relative_to(repo)): n for p in _sources()
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > FILE_LINES}
    over = {k: n for k, n in over.items() if k not in LONG_FILES}
    assert not over, f"files over {FILE_LINES} lines (split them, or list one in LONG_FILES with a reason): {over}"


def test_no_class_over_its_line_budget():
    repo = ROOT.parent
    over = {}
    for p in _sources():
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                key = f"{p.relative_to(repo)}:{node.name}"
                n = node.end_lineno - node.lineno + 1
                if n > CLASS_LINES and key not in LONG_CLASSES:
                    over[key] = n
    assert not over, f"classes over {CLASS_LINES} lines (split them, or list one in LONG_CLASSES): {over}"


def test_distinct_classes_have_distinct_names():
    where: dict[str, list[str]] = defaultdict(list)
    for mod, p in module_files(ROOT).items():
        for node in ast.parse(p.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                where[node.name].append(mod)
    twice = {name: mods for name, mods in where.items() if len(mods) > 1}
    assert not twice, f"one class name for different things: {twice}"
