"""Pulls from a fake Hugging Face hub on 127.0.0.1 (tests/fakehub.py) through the real
huggingface-hub client: quant choice, safetensors repos, unknown repos and files,
wrong bytes, a dropped connection and its resume, concurrent pulls (threads and
processes) doing one transfer, cancellation, a SIGKILLed pull, a full disk."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from fakehub import FakeHub
from localrun.errors import LocalrunError, NotFound
from localrun.library import Cancelled, Library
from test_library import make_gguf

REPO_ROOT = Path(__file__).resolve().parents[1]
GGUF_REPO = "org/Tiny-GGUF"
BIG = "tiny-Q4_K_M.gguf"


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    from safetensors.numpy import save_file

    d = tmp_path_factory.mktemp("hubfiles")
    h = FakeHub()
    h.add_path(GGUF_REPO, make_gguf(d / "a.gguf", big=2), BIG)  # ~2 MiB
    h.add_path(GGUF_REPO, make_gguf(d / "b.gguf"), "tiny-Q8_0.gguf")
    h.add_path(GGUF_REPO, make_gguf(d / "c.gguf"), "mmproj-tiny-Q8_0.gguf")
    h.add_file(GGUF_REPO, "README.md", b"# tiny\n")
    save_file({"w": np.ones((16, 8), dtype=np.float32)}, str(d / "model.safetensors"))
    h.add_path("org/Tiny", d / "model.safetensors")
    h.add_file("org/Tiny", "config.json", b'{"model_type": "llama", "max_position_embeddings": 128, "num_hidden_layers": 1}')
    h.add_file("org/Tiny", "tokenizer_config.json", b'{"chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"}')
    h.add_file("org/Tiny", "tokenizer.json", b'{"version": "1.0"}')
    h.add_file("org/Tiny", "pytorch_model.bin", b"pickles are never downloaded")
    h.add_path("Qwen/Qwen2.5-0.5B-Instruct-GGUF", make_gguf(d / "q.gguf"), "qwen2.5-0.5b-instruct-q4_k_m.gguf")
    for fn, data in h.repos["org/Tiny"].items():  # the catalog's safetensors repo for smollm2:135m
        h.add_file("HuggingFaceTB/SmolLM2-135M-Instruct", fn, data)
    h.start()
    yield h
    h.stop()


@pytest.fixture
def lib(hub, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    hub.mode, hub.delay = "normal", 0.0
    hub.reset_counters()
    return Library(tmp_path / "models")


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def assert_nothing_installed(lib: Library, data: bytes) -> None:
    assert lib.list() == []
    assert not lib.store.has_blob(sha(data))


def test_pull_gguf_by_quant(hub, lib):
    events = []
    r = lib.pull(f"hf.co/{GGUF_REPO}:q8_0", progress=events.append)
    data = hub.repos[GGUF_REPO]["tiny-Q8_0.gguf"]
    assert r.name == f"hf.co/{GGUF_REPO}:q8_0" and r.format == "gguf"
    assert r.weights == lib.store.blob_path(sha(data)) and r.weights.read_bytes() == data
    pulling = [e for e in events if e.status == f"pulling {sha(data)[7:19]}"]
    assert pulling and pulling[-1].completed == pulling[-1].total == len(data) and pulling[-1].digest == sha(data)
    statuses = [e.status for e in events]
    assert statuses[-2:] == ["writing manifest", "success"] and "verifying sha256 digest" in statuses
    # the repo's mmproj file is no vision projector (its architecture is llama): not used, and said so
    assert r.projector is None
    assert any(s.startswith("skipping mmproj-tiny-Q8_0.gguf: not a vision projector") for s in statuses), statuses

    r2 = lib.pull(f"hf.co/{GGUF_REPO}:Q4_K_M")
    assert r2.weights.read_bytes() == hub.repos[GGUF_REPO][BIG]
    assert lib.show(f"hf.co/{GGUF_REPO}:Q4_K_M")["source"]["file"] == BIG
    # no tag on a GGUF-only repo: its Q4_K_M
    assert lib.pull(f"hf.co/{GGUF_REPO}").weights == r2.weights
    assert hub.gets[BIG] == 1  # already in the store: not fetched again

    with pytest.raises(NotFound) as e:
        lib.pull(f"hf.co/{GGUF_REPO}:Q2_K")
    assert "no Q2_K GGUF" in e.value.message and "Q4_K_M" in e.value.message and "Q8_0" in e.value.message


def test_pull_safetensors_repo(hub, lib):
    r = lib.pull("hf.co/org/Tiny")
    assert r.format == "safetensors" and r.weights.is_dir()
    assert sorted(p.name for p in r.weights.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json",
                                                           "tokenizer_config.json"]
    assert (r.weights / "config.json").read_bytes() == hub.repos["org/Tiny"]["config.json"]
    assert r.template.startswith("{% for m in messages %}")
    assert "pytorch_model.bin" not in hub.gets
    s = lib.show("hf.co/org/Tiny")
    assert s["details"]["format"] == "safetensors" and s["model_info"]["general.parameter_count"] == 128
    lib.remove("hf.co/org/Tiny")
    assert lib.list() == [] and not any(lib.store.blobs.iterdir())


def test_unknown_repo_and_file(hub, lib):
    with pytest.raises(NotFound) as e:
        lib.pull("hf.co/org/does-not-exist:Q4_K_M")
    assert "org/does-not-exist not found" in e.value.message
    with pytest.raises(NotFound):
        lib.pull("hf.co/org/Tiny:Q4_K_M")  # a safetensors repo has no GGUF
    with pytest.raises(NotFound, match="not in the catalog"):
        lib.pull("nosuch:model")
    assert lib.list() == []


def test_catalog_alias_through_the_hub(hub, lib):
    r = lib.pull("qwen2.5:0.5b")
    assert r.name == "qwen2.5:0.5b" and r.format == "gguf"
    assert lib.show("qwen2.5")["source"]["repo"] == "Qwen/Qwen2.5-0.5B-Instruct-GGUF"
    st = lib.pull("smollm2:135m-safetensors")  # the native engine's safetensors variant
    assert st.format == "safetensors" and (st.weights / "model.safetensors").is_file()
    assert st.parameters == {"stop": ["<|im_end|>"]}


def test_wrong_bytes_rejected(hub, lib):
    hub.mode = "wrong"
    data = hub.repos[GGUF_REPO][BIG]
    with pytest.raises(LocalrunError) as e:
        lib.pull(f"hf.co/{GGUF_REPO}:Q4_K_M")
    assert e.value.code == "digest_mismatch" and "sha256 mismatch" in e.value.message
    assert_nothing_installed(lib, data)
    assert not any(lib.store.downloads.glob("*.partial")) and not any(lib.store.tmp.iterdir())
    hub.mode = "normal"
    assert lib.pull(f"hf.co/{GGUF_REPO}:Q4_K_M").weights.read_bytes() == data


def test_dropped_connection_then_resume(hub, lib):
    data = hub.repos[GGUF_REPO][BIG]
    half = 1 << 20  # huggingface-hub writes whole 1 MiB chunks (localrun sets its chunk size)
    hub.mode, hub.drop_at = "drop", half
    with pytest.raises(LocalrunError) as e:
        lib.pull(f"hf.co/{GGUF_REPO}:Q4_K_M")
    assert e.value.status == 502
    assert_nothing_installed(lib, data)
    partial = list(lib.store.downloads.glob("*.partial"))
    assert len(partial) == 1 and partial[0].stat().st_size == half
    hub.mode = "normal"
    hub.reset_counters()
    r = lib.pull(f"hf.co/{GGUF_REPO}:Q4_K_M")
    assert r.weights.read_bytes() == data
    assert hub.ranges[BIG] == [half]  # resumed with Range, not restarted
    assert hub.sent[BIG] == len(data) - half
    assert not any(lib.store.downloads.glob("*.partial"))


def test_cancel_leaves_nothing_and_resumes(hub, lib):
    hub.delay = 0.02
    cancel = threading.Event()

    def progress(ev):
        if ev.completed:
            cancel.set()

    with pytest.raises(Cancelled):
        lib.pull(f"hf.co/{GGUF_REPO}:Q4_K_M", progress=progress, cancel=cancel)
    data = hub.repos[GGUF_REPO][BIG]
    assert_nothing_installed(lib, data)
    hub.delay = 0
    lib.pull(f"hf.co/{GGUF_REPO}:Q4_K_M")
    assert hub.ranges[BIG][-1] > 0  # the second pull resumed the first one's bytes


def test_two_threads_one_transfer(hub, lib):
    hub.delay = 0.01
    results, errors = [], []

    def run():
        try:
            results.append(Library(lib.root).pull(f"hf.co/{GGUF_REPO}:Q4_K_M"))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    ts = [threading.Thread(target=run) for _ in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not errors and len(results) == 2
    assert results[0].digest == results[1].digest
    assert hub.gets[BIG] == 1 and hub.sent[BIG] == len(hub.repos[GGUF_REPO][BIG])


def _pull_proc(lib: Library, hub: FakeHub, name: str) -> subprocess.Popen:
    code = f"from localrun.library import Library; Library({str(lib.root)!r}).pull({name!r}); print('OK')"
    env = {**os.environ, "HF_ENDPOINT": hub.url, "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def test_two_processes_one_transfer(hub, lib):
    hub.delay = 0.05  # ~1.6 s transfer, so the two processes overlap
    procs = [_pull_proc(lib, hub, f"hf.co/{GGUF_REPO}:Q4_K_M") for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert hub.gets[BIG] == 1 and hub.sent[BIG] == len(hub.repos[GGUF_REPO][BIG])
    assert [m.name for m in lib.list()] == [f"hf.co/{GGUF_REPO}:Q4_K_M"]


def test_sigkill_mid_pull_then_clean_pull(hub, lib):
    hub.delay = 0.2  # ~6 s transfer
    proc = _pull_proc(lib, hub, f"hf.co/{GGUF_REPO}:Q4_K_M")
    deadline = time.monotonic() + 60

    def partial_bytes() -> int:
        return sum(p.stat().st_size for p in lib.store.downloads.glob("*.partial")) if lib.store.downloads.is_dir() else 0

    while partial_bytes() == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert partial_bytes() > 0, "the pulling process never wrote any bytes"
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)
    data = hub.repos[GGUF_REPO][BIG]
    assert_nothing_installed(lib, data)
    hub.delay = 0
    hub.reset_counters()
    r = lib.pull(f"hf.co/{GGUF_REPO}:Q4_K_M")
    assert r.weights.read_bytes() == data and [m.name for m in lib.list()] == [r.name]
    assert hub.ranges[BIG][0] > 0 and hub.sent[BIG] < len(data)  # resumed the killed pull's bytes


def test_hub_unreachable(hub, lib, monkeypatch):
    lib.pull(f"hf.co/{GGUF_REPO}:q8_0")
    lib.pull("qwen2.5:0.5b")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    t0 = time.monotonic()
    with pytest.raises(LocalrunError) as e:
        lib.pull(f"hf.co/{GGUF_REPO}:Q4_K_M")
    assert e.value.code == "hub_unreachable" and time.monotonic() - t0 < 15
    # a model we already have still "pulls" (the local copy is used)
    assert lib.pull(f"hf.co/{GGUF_REPO}:q8_0").name == f"hf.co/{GGUF_REPO}:q8_0"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    events = []
    assert lib.pull("qwen2.5:0.5b", progress=events.append).name == "qwen2.5:0.5b"
    assert events[-1].status == "success"
    with pytest.raises(LocalrunError, match="HF_HUB_OFFLINE"):
        lib.pull("qwen2.5:1.5b")


def test_disk_full_during_pull(hub, tmp_path, lib):
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.system(f"mount -t tmpfs -o size=1m tmpfs {mnt} 2>/dev/null") != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        small = Library(mnt / "models")
        small.pull(f"hf.co/{GGUF_REPO}:q8_0")
        with pytest.raises(LocalrunError) as e:
            small.pull(f"hf.co/{GGUF_REPO}:Q4_K_M")
        assert e.value.status == 507 and e.value.message.startswith("disk full:")
        assert [m.name for m in small.list()] == [f"hf.co/{GGUF_REPO}:q8_0"]
        assert small.resolve(f"hf.co/{GGUF_REPO}:q8_0").weights.read_bytes() == hub.repos[GGUF_REPO]["tiny-Q8_0.gguf"]
    finally:
        os.system(f"umount {mnt}")
