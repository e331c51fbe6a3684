"""Ollama's way to make a model from local files: each file uploaded to POST /api/blobs/<sha256>
(HEAD first, to skip what the daemon has), then /api/create with `files` naming the blobs. This is
what the `ollama create` CLI and the Ollama SDKs' create_blob + create(files=...) do.

The library's half runs in process; the daemon's half drives the real daemon over HTTP with the
real ollama SDK and the real SmolLM2 GGUF (98 MB: past the 32 MiB body limit other routes keep)."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time

import httpx
import numpy as np
import pytest

from daemon import Daemon
from localrun.errors import InvalidRequest
from localrun.library.api import Library
from localrun.library.store import MT_FILE, MT_MODEL, MT_PROJECTOR
from test_library import make_gguf


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _upload(lib: Library, data: bytes, digest: str | None = None) -> str:
    up = lib.upload(digest or _digest(data))
    try:
        for i in range(0, len(data), 1000):
            up.write(data[i:i + 1000])
        return up.finish()[0]
    finally:
        up.close()


def _layers(lib: Library, name: str) -> list[dict]:
    path = next(p for mn, p in lib.store.iter_manifests() if mn.display == f"{name}:latest")
    return json.loads(path.read_text())["layers"]


# ----------------------------------------------------------------------------- the library's half

def test_an_upload_lands_only_with_the_sha256_it_was_named_by(tmp_path):
    lib = Library(tmp_path / "models")
    data = b"some model bytes " * 1000
    d = _upload(lib, data)
    assert d == _digest(data) and lib.has_blob(d) and lib.store.blob_path(d).read_bytes() == data
    other = b"other bytes"
    with pytest.raises(InvalidRequest, match="sha256 is .* not sha256:"):
        _upload(lib, other, _digest(b"what the client said"))
    assert not lib.has_blob(_digest(other)) and not lib.has_blob(_digest(b"what the client said"))
    up = lib.upload(_digest(b"abandoned"))  # a client that went away: close without finish
    up.write(b"aband")
    up.close()
    assert not lib.has_blob(_digest(b"abandoned"))
    assert list(lib.store.tmp.iterdir()) == []  # no temp file left behind either way
    with pytest.raises(InvalidRequest, match="digest"):
        lib.upload("sha256:../../etc")


def test_create_from_uploaded_files(tmp_path):
    from safetensors.numpy import save_file

    lib = Library(tmp_path / "models")
    g = make_gguf(tmp_path / "tiny.gguf").read_bytes()
    dg = _upload(lib, g)
    r = lib.create("tiny", "SYSTEM be brief\nPARAMETER temperature 0.3\n", files={"tiny.gguf": dg})
    assert r.weights.read_bytes() == g and r.system == "be brief" and r.parameters["temperature"] == 0.3
    assert [(l["mediaType"], l["digest"]) for l in _layers(lib, "tiny")][0] == (MT_MODEL, dg)
    assert lib.show("tiny")["details"]["format"] == "gguf"

    # a safetensors model: its files by name; files localrun does not keep are left out
    d = tmp_path / "st"
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "llama", "architectures": ["LlamaForCausalLM"], '
                                   '"max_position_embeddings": 512, "num_hidden_layers": 1, "hidden_size": 8}')
    save_file({"w": np.zeros((4, 8), dtype=np.float32)}, str(d / "model.safetensors"))
    files = {fn: _upload(lib, (d / fn).read_bytes()) for fn in ("config.json", "model.safetensors")}
    files["README.md"] = _upload(lib, b"# not part of the model")
    r2 = lib.create("tiny-st", "", files=files)
    assert r2.format == "safetensors"
    assert sorted(p.name for p in r2.weights.iterdir()) == ["config.json", "model.safetensors"]
    assert {l["mediaType"] for l in _layers(lib, "tiny-st")} == {MT_FILE}

    # what is refused, each time with nothing stored
    missing = _digest(b"never uploaded")
    for files, words in [
        ({"tiny.gguf": missing}, "upload the file first"),
        ({"../tiny.gguf": dg}, "invalid file name"),
        ({"tiny.gguf": "md5:abc"}, "digest"),
        ({"a.gguf": dg, "b.gguf": dg}, "one GGUF model"),
        ({"tiny.gguf": dg, "notes.txt": files["README.md"]}, "mixes GGUF"),
        ({"README.md": files["README.md"]}, "holds no model"),
        ({}, "'files' must be"),
    ]:
        with pytest.raises(InvalidRequest, match=words):
            lib.create("bad", "", files=files)
    assert not lib.exists("bad")


def test_a_projector_among_the_files(tmp_path, vlm):
    gguf, mmproj = vlm
    lib = Library(tmp_path / "models")
    files = {"model.gguf": _upload(lib, gguf.read_bytes()), "mmproj.gguf": _upload(lib, mmproj.read_bytes())}
    r = lib.create("vlm", "", files=files)
    assert r.projector is not None and r.projector.read_bytes() == mmproj.read_bytes()
    assert [l["mediaType"] for l in _layers(lib, "vlm")].count(MT_PROJECTOR) == 1


def test_gc_keeps_a_fresh_upload_until_its_create(tmp_path):
    """Removing another model collects unreferenced blobs: not one uploaded for a create to come."""
    lib = Library(tmp_path / "models")
    a = make_gguf(tmp_path / "a.gguf", template="A").read_bytes()
    lib.create("a", "", files={"a.gguf": _upload(lib, a)})
    b = make_gguf(tmp_path / "b.gguf", template="B").read_bytes()
    db = _upload(lib, b)
    lib.remove("a")
    assert not lib.has_blob(_digest(a))  # a's blob went with it
    assert lib.has_blob(db)
    assert lib.create("b", "", files={"b.gguf": db}).weights.read_bytes() == b


# ----------------------------------------------------------------------------- the daemon's half

def _blob_path(lib: Library, digest: str):
    return lib.store.blobs / digest.replace(":", "-")


@pytest.mark.parametrize("noprune", ["0", "1"])
def test_the_daemon_prunes_blobs_no_model_uses_when_it_starts(tmp_path, noprune):
    """As Ollama at start (OLLAMA_NOPRUNE): blobs no manifest names and older than an hour (an upload
    whose create never came, what a killed create left) go when the daemon starts; a model's blobs
    and a fresh upload stay. LOCALRUN_NOPRUNE=1 keeps them all."""
    home = tmp_path / "home"
    lib = Library(home / "models")
    used = make_gguf(tmp_path / "a.gguf", template="A").read_bytes()
    lib.create("used", "", files={"a.gguf": _upload(lib, used)})
    old = _upload(lib, make_gguf(tmp_path / "b.gguf", template="B").read_bytes())
    fresh = _upload(lib, make_gguf(tmp_path / "c.gguf", template="C").read_bytes())
    two_hours_ago = time.time() - 7200
    for digest in (_digest(used), old):
        os.utime(_blob_path(lib, digest), (two_hours_ago, two_hours_ago))
    d = Daemon(home, LOCALRUN_NOPRUNE=noprune)
    try:
        log = d.log.read_text(errors="replace")
        assert lib.has_blob(_digest(used)) and lib.has_blob(fresh)
        if noprune == "1":
            assert lib.has_blob(old) and "blobs no model uses" not in log
        else:
            assert not lib.has_blob(old) and "of blobs no model uses" in log, log[-2000:]
        assert [m["name"] for m in d.http.get("/api/tags").json()["models"]] == ["used:latest"]
    finally:
        d.stop()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("blobs-home"))
    yield d
    d.stop()


def test_ollama_sdk_creates_a_model_from_a_local_gguf(daemon, smollm2_gguf):
    import ollama

    client = ollama.Client(host=daemon.url)
    digest = client.create_blob(smollm2_gguf)  # 98 MB in one POST
    assert daemon.http.head(f"/api/blobs/{digest}").status_code == 200
    events = list(client.create(model="mine", files={smollm2_gguf.name: digest}, system="You are a pirate.",
                                parameters={"temperature": 0, "num_predict": 8}, stream=True))
    assert events[-1].status == "success"
    shown = client.show("mine")
    assert "You are a pirate." in shown.modelfile and shown.details.format == "gguf"
    r = client.chat(model="mine", messages=[{"role": "user", "content": "Say hello."}])
    assert r.message.content.strip() and r.eval_count <= 8
    # the SDK uploads again without asking first: the daemon already has it (200, the body unread)
    assert client.create_blob(smollm2_gguf) == digest
    assert daemon.http.post(f"/api/blobs/{digest}", content=b"").status_code == 200


def test_blob_upload_errors(daemon):
    http = daemon.http
    data = b"x" * 100_000
    assert http.head(f"/api/blobs/{_digest(data)}").status_code == 404
    wrong = _digest(b"something else")
    r = http.post(f"/api/blobs/{wrong}", content=data)
    assert r.status_code == 400 and "sha256" in r.json()["error"]
    assert http.head(f"/api/blobs/{wrong}").status_code == 404
    assert http.head(f"/api/blobs/{_digest(data)}").status_code == 404  # nothing stored under either name
    for bad in ("sha256:1234", "md5:" + "0" * 32, "sha256:" + "G" * 64):
        r = http.post(f"/api/blobs/{bad}", content=data)
        assert r.status_code == 400 and "digest" in r.json()["error"], (bad, r.text)
        assert http.head(f"/api/blobs/{bad}").status_code == 400
    # a chunked body (no Content-Length), streamed in pieces
    r = http.post(f"/api/blobs/{_digest(data)}", content=(data[i:i + 7000] for i in range(0, len(data), 7000)))
    assert r.status_code == 201 and http.head(f"/api/blobs/{_digest(data)}").status_code == 200
    # more than the disk has: refused before a byte is written
    with socket.create_connection(("127.0.0.1", daemon.port)) as sock:  # (httpx will not send a short body)
        sock.sendall(f"POST /api/blobs/{_digest(b'huge')} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {1 << 60}\r\n"
                     "Connection: close\r\n\r\n".encode())
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 507") and b"free" in body, answer
    # create's refusals
    for body, words in [
        ({"model": "m", "files": {"a.gguf": _digest(b"never uploaded")}}, "upload the file first"),
        ({"model": "m", "files": {"a.gguf": _digest(data)}, "from": "smollm2:135m"}, "not both"),
        ({"model": "m", "files": "a.gguf"}, "'files' must be"),
        ({"model": "m", "from": "smollm2:135m", "quantize": "q4_K_M"}, "F16, BF16 or F32; this one is Q4_1"),
        ({"model": "m", "from": "smollm2:135m", "quantize": "q4_k_x"}, "Q4_K_M"),
        ({"model": "m", "from": "smollm2:135m", "adapters": {"lora.gguf": _digest(data)}}, "not a valid GGUF"),
        ({"model": "m", "from": "smollm2:135m", "adapters": {"a.gguf": _digest(data), "b.gguf": _digest(data)}},
         "must map one LoRA adapter GGUF"),
        ({"model": "m", "files": {"x.bin": _digest(data)}}, "holds no model"),
    ]:
        r = http.post("/api/create", json={**body, "stream": False})
        assert r.status_code == 400 and words in r.json()["error"], (body, r.text)
    assert "m:latest" not in {m["name"] for m in http.get("/api/tags").json()["models"]}


def test_an_upload_cut_off_midway_leaves_nothing(daemon):
    """The client goes away halfway through: no blob, no temp file, and the daemon serves on."""
    data = b"y" * 3_000_000
    digest = _digest(data)
    with socket.create_connection(("127.0.0.1", daemon.port)) as s:
        s.sendall(f"POST /api/blobs/{digest} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len(data)}\r\n\r\n"
                  .encode() + data[:1_000_000])
        time.sleep(0.5)
    tmp = daemon.home / "models" / "tmp"
    deadline = time.monotonic() + 10
    while tmp.is_dir() and any(tmp.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not tmp.is_dir() or not any(tmp.iterdir())
    assert daemon.http.head(f"/api/blobs/{digest}").status_code == 404
    assert daemon.http.get("/api/version").status_code == 200
    r = httpx.post(f"{daemon.url}/api/blobs/{digest}", content=data, timeout=60)
    assert r.status_code == 201


def test_a_stalled_upload_is_dropped(tmp_path, monkeypatch):
    """An upload that stops sending (a hung client) is answered 408 after BLOB_IDLE_S of silence and
    leaves nothing: every piece of work a request starts has a bound. The real app in process (the
    idle bound shortened), a fake backend."""
    from fakes import FakeModel, InProcessDaemon

    from localrun.server import routes_ollama_models as routes_ollama

    monkeypatch.setattr(routes_ollama, "BLOB_IDLE_S", 0.5)
    home = tmp_path / "home"
    d = InProcessDaemon(home, FakeModel())
    try:
        data = b"z" * 1000
        with socket.create_connection(("127.0.0.1", d.port)) as s:
            s.sendall(f"POST /api/blobs/{_digest(data)} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len(data)}\r\n"
                      "\r\n".encode() + data[:100])
            s.settimeout(10)
            answer = s.recv(65536)
        assert answer.startswith(b"HTTP/1.1 408") and b"stalled" in answer, answer
        assert httpx.head(f"{d.url}/api/blobs/{_digest(data)}").status_code == 404
        assert not any((home / "models" / "tmp").iterdir())
    finally:
        d.stop()


def test_a_chunked_upload_stops_before_the_disk_is_full(tmp_path, monkeypatch):
    """Without a Content-Length the size is not known up front: the free space is checked as the pieces
    come (here the disk says 10 MiB are free), and the upload ends with a 507 before it fills the disk.
    The real app in process, shutil.disk_usage's answer replaced."""
    import collections

    from fakes import FakeModel, InProcessDaemon

    from localrun.server import routes_ollama_models as routes_ollama

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(routes_ollama.shutil, "disk_usage", lambda path: usage(1 << 40, 1 << 40, 10 << 20))
    home = tmp_path / "home"
    d = InProcessDaemon(home, FakeModel())
    try:
        data = os.urandom(6 << 20)
        r = httpx.post(f"{d.url}/api/blobs/{_digest(data)}", timeout=60,
                       content=(data[i:i + (1 << 20)] for i in range(0, len(data), 1 << 20)))
        assert r.status_code == 507 and "free" in r.json()["error"], r.text
        assert httpx.head(f"{d.url}/api/blobs/{_digest(data)}").status_code == 404
        assert not any((home / "models" / "tmp").iterdir())
    finally:
        d.stop()
