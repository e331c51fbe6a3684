"""`localrun create --quantize` and Ollama's create `quantize`, through the real daemon: an F16 GGUF (SmolLM2-135M,
the bundled Q4_1 written out in F16 by llama.cpp) is stored quantized, and the stored file equals, byte for byte,
what llama.cpp's own llama-quantize (built from the same vendored source as the tests' llama-server) writes from the
same file. The CLI from a file, the ollama SDK from a model of the library; refusals leave the library as it was; a
client that goes away stops the quantizer and nothing is stored."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
from daemon import MODEL, Daemon
from gguf_util import requantize

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def f16(smollm2_gguf, tmp_path_factory) -> Path:
    """SmolLM2-135M in F16: llama.cpp's quantizer writes the bundled Q4_1 out unquantized (allow_requantize)."""
    return requantize(smollm2_gguf, tmp_path_factory.mktemp("f16") / "smollm2-f16.gguf", 1)


@pytest.fixture(scope="module")
def llama_quantize(llama_server_bin) -> Path:
    """llama.cpp's llama-quantize, built in llama-server's build tree (a second target: seconds)."""
    build = llama_server_bin.parent.parent
    if not (build / "CMakeCache.txt").exists():
        pytest.skip(f"{llama_server_bin} is not in a cmake build tree (LOCALRUN_LLAMA_SERVER): no llama-quantize")
    r = subprocess.run(["cmake", "--build", str(build), "--target", "llama-quantize", "-j", "2"], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return build / "bin" / "llama-quantize"


def reference(llama_quantize: Path, src: Path, kind: str, out: Path) -> str:
    """sha256 of llama-quantize's output."""
    r = subprocess.run([str(llama_quantize), str(src), str(out), kind, "2"], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return hashlib.sha256(out.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("quantize"), LOCALRUN_NUM_PARALLEL="1", LOCALRUN_CONTEXT_LENGTH="1024")
    try:
        d.pull()
        yield d
    finally:
        d.stop()


def model_blob(daemon, name: str) -> tuple[str, dict]:
    """(the stored model file's sha256, /api/show's details)."""
    r = daemon.http.post("/api/show", json={"model": name})
    assert r.status_code == 200, r.text
    man = daemon.http.get("/api/tags").json()
    assert any(m["name"] == name for m in man["models"]), man
    mf = r.json()["modelfile"]
    blob = next(line.split(" ", 1)[1] for line in mf.splitlines() if line.startswith("FROM "))
    return hashlib.sha256(Path(blob).read_bytes()).hexdigest(), r.json()["details"]


def test_the_cli_stores_what_llama_quantize_writes(daemon, f16, llama_quantize, tmp_path):
    (tmp_path / "Modelfile").write_text(f"FROM {f16}\n")
    env = {**os.environ, "LOCALRUN_HOST": daemon.url.removeprefix("http://")}
    r = subprocess.run([sys.executable, "-m", "localrun", "create", "smolq8", "-f", str(tmp_path / "Modelfile"),
                        "-q", "q8_0"], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "quantizing F16 model to Q8_0" in r.stdout + r.stderr
    digest, details = model_blob(daemon, "smolq8:latest")
    assert digest == reference(llama_quantize, f16, "Q8_0", tmp_path / "ref.gguf")
    assert details["quantization_level"] == "Q8_0"
    r = daemon.http.post("/api/chat", json={"model": "smolq8", "stream": False, "options": {"num_predict": 8,
                         "temperature": 0}, "messages": [{"role": "user", "content": "Say hello."}]})
    assert r.status_code == 200 and r.json()["message"]["content"], r.text
    # the unquantized file was read where it lies, never stored: only the Q8_0 blob came in
    blobs = [p.stat().st_size for p in (daemon.home / "models" / "blobs").iterdir()]
    assert f16.stat().st_size not in blobs


def test_the_ollama_sdk_quantizes_a_model_of_the_library(daemon, f16, llama_quantize, tmp_path):
    import ollama

    client = ollama.Client(host=daemon.url)
    events = list(client.create(model="smolf16", files={f16.name: client.create_blob(f16)}, stream=True))
    assert events[-1].status == "success"
    events = list(client.create(model="smolq4", from_="smolf16", quantize="q4_K_M", stream=True))
    assert events[-1].status == "success"
    assert any(e.status == "quantizing F16 model to Q4_K_M" for e in events)
    digest, details = model_blob(daemon, "smolq4:latest")
    assert digest == reference(llama_quantize, f16, "Q4_K_M", tmp_path / "ref.gguf")
    assert details["quantization_level"] == "Q4_K_M" and client.show("smolq4").details.parent_model == "smolf16:latest"


def test_refusals_leave_the_library_as_it_was(daemon, f16, tmp_path):
    import ollama

    before = sorted(m["name"] for m in daemon.http.get("/api/tags").json()["models"])
    r = daemon.http.post("/api/create", json={"model": "x", "from": MODEL, "quantize": "q9_k"})
    assert r.status_code == 400 and "Q4_K_M" in r.json()["error"], r.text  # the types, before any work
    client = ollama.Client(host=daemon.url)
    with pytest.raises(ollama.ResponseError, match="F16, BF16 or F32; this one is Q4_1"):
        client.create(model="x", from_=MODEL, quantize="q8_0")
    (tmp_path / "st").mkdir()  # a safetensors model's folder: refused before anything is read or copied
    r = daemon.http.post("/api/create", json={"model": "x", "modelfile": f"FROM {tmp_path / 'st'}\n", "quantize": "q8_0",
                                              "stream": False})
    assert r.status_code == 400 and "needs a GGUF model" in r.json()["error"], r.text
    env = {**os.environ, "LOCALRUN_HOST": daemon.url.removeprefix("http://")}
    (tmp_path / "Modelfile").write_text(f"FROM {MODEL}\n")
    r = subprocess.run([sys.executable, "-m", "localrun", "create", "x", "-f", str(tmp_path / "Modelfile"), "-q",
                        "q4_0"], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "F16, BF16 or F32" in r.stderr, r.stdout + r.stderr
    assert sorted(m["name"] for m in daemon.http.get("/api/tags").json()["models"]) == before


def _quantizers(daemon) -> list[psutil.Process]:
    return [p for p in psutil.Process(daemon.proc.pid).children(recursive=True)
            if "localrun.library.quantize" in p.cmdline()]


def test_a_client_that_goes_away_stops_the_quantizer(daemon, f16):
    """IQ4_XS takes SmolLM2 ~9 s on 2 cores: the stream is dropped once the quantizer has written a part, the
    quantizer is killed, its partial file goes and no model is stored."""
    with httpx.Client(base_url=daemon.url, timeout=120) as c:
        with c.stream("POST", "/api/create", json={"model": "gone", "quantize": "iq4_xs",
                                                     "modelfile": f"FROM {f16}\n"}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                ev = json.loads(line)
                assert "error" not in ev, ev
                if ev.get("status", "").startswith("quantizing") and ev.get("completed"):
                    break
            running = _quantizers(daemon)
            assert running, "no quantizer while the file is being written"
    psutil.wait_procs(running, timeout=30)
    assert not _quantizers(daemon)
    time.sleep(0.5)
    assert "gone:latest" not in [m["name"] for m in daemon.http.get("/api/tags").json()["models"]]
    assert not list((daemon.home / "models" / "tmp").iterdir())
