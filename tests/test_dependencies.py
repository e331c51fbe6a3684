"""localrun next to the packages users install with it: nothing in the source tree shadows a package
from the index, or is shadowed by one.

The break this guards against: transformers 5.25 imports Hugging Face's `kernels` package, and when
the repository's top-level `kernels/` folder was a package, Python run from the repository root (or
any process with the root on its path, as every runner had) found that folder first, so every native
load failed with `ImportError: cannot import name ... from 'kernels'`. Now `kernels/` is a folder of
modules without `__init__.py` (shipped as localrun.kernels through the link localrun/kernels), which
Python takes as a top-level package only when no installed package has the name. And runner processes
start without their working directory on `sys.path`.

Hugging Face's `kernels` is in the test extra, so this file runs next to it; CI runs it again against
the newest release of every dependency (.ci/newest)."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from daemon import Daemon, MODEL

ROOT = Path(__file__).resolve().parents[1]


def _run_at_root(code: str) -> subprocess.CompletedProcess:
    """`python -c code` with the repository root as working directory: sys.path[0] is the root, as for
    `python -m pytest` or `python -m localrun serve` run there."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


def test_the_repository_root_holds_no_package_but_localrun():
    """Whatever is importable from the root's folder (where `python -m` puts it first on sys.path) is
    `localrun` alone: no other regular package, no module, so nothing there can shadow a package."""
    tops = sorted(p.name for p in ROOT.iterdir()
                  if (p.is_dir() and (p / "__init__.py").is_file()) or (p.is_file() and p.suffix == ".py"))
    assert tops == ["localrun"], tops
    assert not (ROOT / "kernels" / "__init__.py").exists()
    assert (ROOT / "localrun" / "kernels").resolve() == (ROOT / "kernels").resolve()


def test_no_test_helper_takes_an_installed_package_name():
    """pytest puts tests/ on sys.path: a helper module there named like an installed distribution's
    top-level package would shadow it in every test (a `daemon.py` beside python-daemon, say)."""
    installed = importlib.metadata.packages_distributions()
    helpers = {p.stem for p in Path(__file__).parent.glob("*.py") if not p.stem.startswith(("test_", "conftest"))}
    helpers |= {p.name for p in Path(__file__).parent.iterdir() if (p / "__init__.py").is_file()}
    taken = {h: installed[h] for h in helpers if h in installed}
    assert not taken, f"tests/ helpers named like installed packages: {taken}"


def test_hugging_face_kernels_is_found_from_the_repository_root():
    """From the root, `import kernels` is Hugging Face's package (installed with the test extra), and
    localrun's ops import beside it, in one interpreter, as transformers' model loading needs."""
    version = importlib.metadata.version("kernels")  # the test extra installs it: pip install -e ".[test]"
    r = _run_at_root(
        "import sys, kernels, importlib.metadata as m\n"
        "import localrun.kernels.ops as ops\n"
        "print(kernels.__file__)\n"
        "print(m.version('kernels'), hasattr(kernels, 'get_kernel'), callable(ops.store_kv))\n"
        "print(sys.path[0])\n")
    assert r.returncode == 0, r.stderr[-3000:]
    where, facts, first = r.stdout.splitlines()[:3]
    assert first in ("", str(ROOT)), first  # the root was first on the path
    assert not Path(where).resolve().is_relative_to(ROOT), where
    assert facts == f"{version} True True", facts


def test_transformers_loads_a_model_from_the_repository_root(tmp_path):
    """transformers, with Hugging Face's kernels installed, builds and runs a model from the root: the
    path where `from kernels import ...` inside transformers broke."""
    r = _run_at_root(
        "import torch, transformers\n"
        "from transformers.utils import is_kernels_available\n"
        "cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,\n"
        "    num_attention_heads=2, num_key_value_heads=1, vocab_size=64, max_position_embeddings=64)\n"
        f"transformers.LlamaForCausalLM(cfg).save_pretrained({str(tmp_path)!r})\n"
        f"m = transformers.AutoModelForCausalLM.from_pretrained({str(tmp_path)!r})\n"
        "print(is_kernels_available(), tuple(m(torch.tensor([[1, 2, 3]])).logits.shape))\n")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split("\n")[-2] == "True (1, 3, 64)", r.stdout[-2000:]


def test_a_runner_does_not_import_from_the_daemons_working_directory(tmp_path):
    """A daemon started in a folder that holds files named like the packages a runner imports (a user's
    project with a `llama_cpp.py`, or a `kernels/` package) still serves: the runner process does not
    put its working directory on sys.path, nor an empty PYTHONPATH entry (which means the same). The
    daemon is the installed `localrun` script, as a user starts it."""
    script = Path(sys.executable).parent / "localrun"
    if not script.is_file():
        pytest.skip("no `localrun` script beside this Python (pip install -e . makes one)")
    work = tmp_path / "project"
    (work / "kernels").mkdir(parents=True)
    poison = 'raise ImportError("imported from the working directory")\n'
    (work / "llama_cpp.py").write_text(poison)
    (work / "kernels" / "__init__.py").write_text(poison)
    # PYTHONPATH ends in an empty entry, which Python reads as the working directory
    d = Daemon(tmp_path / "home", argv=[str(script), "serve"], cwd=str(work), PYTHONPATH=f"{ROOT}{os.pathsep}")
    try:
        d.pull()
        r = d.http.post("/api/generate", json={"model": MODEL, "prompt": "Hi", "stream": False,
                                               "options": {"num_predict": 2, "temperature": 0, "num_ctx": 256}})
        assert r.status_code == 200, r.text
        assert r.json()["eval_count"] >= 1
    except httpx.HTTPError as exc:  # pragma: no cover - the log says why
        raise AssertionError(d.log.read_text(errors="replace")[-3000:]) from exc
    finally:
        d.stop()


def test_the_native_engine_serves_from_the_repository_root(tmp_path):
    """The daemon run as `python -m localrun.server` in the repository root (the root first on every
    process's path), with Hugging Face's kernels installed: the native engine loads the bundled model
    and answers. This is the load that failed with `cannot import name ... from 'kernels'`."""
    d = Daemon(tmp_path / "home", cwd=str(ROOT), LOCALRUN_BACKEND="native", LOCALRUN_CONTEXT_LENGTH="512")
    try:
        d.pull()
        r = d.http.post("/api/generate", json={"model": MODEL, "prompt": "Hi", "stream": False,
                                               "options": {"num_predict": 2, "temperature": 0}})
        assert r.status_code == 200, r.text + d.log.read_text(errors="replace")[-3000:]
        assert r.json()["eval_count"] >= 1
        (loaded,) = d.ps()
        assert loaded["backend"] == "native", loaded
    finally:
        d.stop()
