"""Vision models in the library, against the real daemon and a fake Hugging Face hub on 127.0.0.1
serving the tiny VLM's files (tests/vlm_model.py): `pull` fetches the repo's mmproj GGUF with the
model (the one matching the model's precision) as the projector layer, shared by two tags; a
Modelfile FROM the pulled model inherits it; `show --modelfile` prints both FROM lines; `/api/show`,
`/api/tags` and `localrun list` report `vision` among the capabilities; a second FROM that is not a
projector is a 400 that leaves the daemon serving."""

from __future__ import annotations

import hashlib
import json

import pytest
from daemon import Daemon
from fakehub import FakeHub
from test_cli import cli, make_env

from localrun.library.api import Library
from localrun.library.pull import RemoteFile, choose_projector, quant_of
from test_library import make_gguf

pytestmark = pytest.mark.timeout(300)
VLM_REPO = "org/Tiny-VLM-GGUF"


def names(*fns: str) -> list[RemoteFile]:
    return [RemoteFile(fn, 1, None, None) for fn in fns]


def test_projector_choice_follows_the_model_precision():
    files = names("m-Q4_K_M.gguf", "m-Q8_0.gguf", "m-F16.gguf", "m-BF16.gguf",
                  "mmproj-F16.gguf", "mmproj-BF16.gguf", "mmproj-F32.gguf", "mmproj-Q8_0.gguf")
    pick = lambda model: choose_projector(files, model).filename  # noqa: E731
    assert pick("m-Q8_0.gguf") == "mmproj-Q8_0.gguf"  # its own quant
    assert pick("m-Q4_K_M.gguf") == "mmproj-Q8_0.gguf"  # its family: quantized
    assert pick("m-BF16.gguf") == "mmproj-BF16.gguf"
    assert pick("m-F16.gguf") == "mmproj-F16.gguf"
    assert choose_projector(names("m-Q4_K_M.gguf", "mmproj-model-f16.gguf", "mmproj-model-f32.gguf"),
                            "m-Q4_K_M.gguf").filename == "mmproj-model-f16.gguf"  # else F16
    assert choose_projector(names("m-BF16.gguf", "mmproj-b.gguf", "mmproj-a.gguf"),
                            "m-BF16.gguf").filename == "mmproj-a.gguf"  # else the first
    assert choose_projector(names("m-Q4_K_M.gguf", "sub/mmproj-F16.gguf"), "m-Q4_K_M.gguf") is None
    assert choose_projector(names("m-Q4_K_M.gguf"), "m-Q4_K_M.gguf") is None
    assert quant_of("gemma-3-4b-it-IQ4_XS.gguf") == "IQ4_XS" and quant_of("mmproj-model-bf16.gguf") == "BF16"


def test_capabilities_in_ollamas_words(tmp_path, vlm, monkeypatch):
    monkeypatch.delenv("LOCALRUN_GENERIC_TOOLS", raising=False)  # the default: on
    lib = Library(tmp_path / "models")
    gguf, mmproj = vlm
    think = "{% if tools %}{{ tools | tojson }}{% endif %}{% for m in messages %}<think>{{ m['content'] }}{% endfor %}"
    lib.create("thinker", f"FROM {make_gguf(tmp_path / 't.gguf')}\nTEMPLATE \"\"\"{think}\"\"\"\n")
    lib.create("plain", f"FROM {make_gguf(tmp_path / 'p.gguf')}\n")
    lib.create("encoder", f"FROM {make_gguf(tmp_path / 'e.gguf', arch='bert', template=None)}\n")
    lib.create("vlm", f"FROM {gguf}\nFROM {mmproj}\n")
    assert lib.show("thinker")["capabilities"] == ["completion", "tools", "thinking"]
    # a template without tools: the generic tool format stands in (LOCALRUN_GENERIC_TOOLS, on by default)
    assert lib.show("plain")["capabilities"] == ["completion", "tools"]
    assert lib.show("plain")["tool_format"] == "generic" and lib.show("thinker")["tool_format"] == "template"
    assert lib.show("encoder")["capabilities"] == ["embedding"]
    vlm_show = lib.show("vlm")
    assert vlm_show["capabilities"][0] == "completion" and "vision" in vlm_show["capabilities"]
    assert vlm_show["projector_info"]["general.architecture"] == "clip"
    assert {m.name: m.capabilities for m in lib.list()} == {
        n + ":latest": lib.show(n)["capabilities"] for n in ("thinker", "plain", "encoder", "vlm")}
    monkeypatch.setenv("LOCALRUN_GENERIC_TOOLS", "off")
    assert lib.show("plain")["capabilities"] == ["completion"] and lib.show("plain")["tool_format"] is None


@pytest.fixture(scope="module")
def hub(vlm):
    gguf, mmproj = vlm
    text, proj = gguf.read_bytes(), mmproj.read_bytes()
    # a second, different projector (one weight byte changed: still a valid clip GGUF)
    proj_q8 = proj[:-1] + bytes([proj[-1] ^ 1])
    h = FakeHub()
    h.add_file(VLM_REPO, "tiny-vlm-Q8_0.gguf", text)
    h.add_file(VLM_REPO, "tiny-vlm-Q4_K_M.gguf", text)
    h.add_file(VLM_REPO, "tiny-vlm-F16.gguf", text)
    h.add_file(VLM_REPO, "mmproj-tiny-vlm-F16.gguf", proj)
    h.add_file(VLM_REPO, "mmproj-tiny-vlm-Q8_0.gguf", proj_q8)
    h.add_file(VLM_REPO, "README.md", b"# tiny vlm\n")
    h.start()
    h.proj, h.proj_q8 = proj, proj_q8
    yield h
    h.stop()


@pytest.fixture(scope="module")
def daemon(hub, tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("vision-home"), HF_ENDPOINT=hub.url, HF_HUB_OFFLINE="0",
               LOCALRUN_CONTEXT_LENGTH="512")
    yield d
    d.stop()


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def manifest_layers(d: Daemon, name: str) -> dict:
    """mediaType -> layers, from the manifest the daemon wrote under its models dir."""
    org_repo, tag = name.removeprefix("hf.co/").rsplit(":", 1)
    paths = list((d.home).rglob(f"manifests/**/{tag}"))
    path = next(p for p in paths if p.is_file() and org_repo.split("/")[1] in str(p))
    out: dict = {}
    for layer in json.loads(path.read_text())["layers"]:
        out.setdefault(layer["mediaType"], []).append(layer)
    return out


def show(d: Daemon, name: str) -> dict:
    r = d.http.post("/api/show", json={"model": name})
    assert r.status_code == 200, r.text
    return r.json()


def test_pull_fetches_the_matching_projector(daemon, hub):
    hub.reset_counters()
    events = daemon.pull(f"hf.co/{VLM_REPO}:Q8_0")
    assert any(e.get("digest") == sha(hub.proj_q8) for e in events), events
    layers = manifest_layers(daemon, f"hf.co/{VLM_REPO}:Q8_0")
    proj = layers["application/vnd.ollama.image.projector"]
    assert len(proj) == 1 and proj[0]["digest"] == sha(hub.proj_q8) and proj[0]["filename"] == "mmproj-tiny-vlm-Q8_0.gguf"
    assert hub.gets.get("mmproj-tiny-vlm-F16.gguf") is None  # only the chosen projector is downloaded
    info = show(daemon, f"hf.co/{VLM_REPO}:Q8_0")
    assert info["capabilities"][0] == "completion" and "vision" in info["capabilities"]
    assert info["source"]["projector"] == "mmproj-tiny-vlm-Q8_0.gguf"
    import ollama  # the real SDK reads them too

    assert "vision" in ollama.Client(host=daemon.url).show(f"hf.co/{VLM_REPO}:Q8_0").capabilities

    # another tag of the same quant family shares the projector blob: not downloaded again
    daemon.pull(f"hf.co/{VLM_REPO}:Q4_K_M")
    assert manifest_layers(daemon, f"hf.co/{VLM_REPO}:Q4_K_M")["application/vnd.ollama.image.projector"][0]["digest"] \
        == sha(hub.proj_q8)
    assert hub.gets["mmproj-tiny-vlm-Q8_0.gguf"] == 1
    # an F16 model takes the F16 projector
    daemon.pull(f"hf.co/{VLM_REPO}:F16")
    assert manifest_layers(daemon, f"hf.co/{VLM_REPO}:F16")["application/vnd.ollama.image.projector"][0]["digest"] \
        == sha(hub.proj)


def test_tags_and_list_mark_vision_models(daemon, smollm2_gguf, tmp_path):
    daemon.pull(f"hf.co/{VLM_REPO}:Q8_0")
    r = daemon.http.post("/api/create", json={"model": "plain", "modelfile": f"FROM {smollm2_gguf}\n", "stream": False})
    assert r.status_code == 200, r.text
    tags = {m["name"]: m for m in daemon.http.get("/api/tags").json()["models"]}
    assert "vision" in tags[f"hf.co/{VLM_REPO}:Q8_0"]["capabilities"]
    assert "vision" not in tags["plain:latest"]["capabilities"] and "completion" in tags["plain:latest"]["capabilities"]
    env = make_env(tmp_path, daemon.port)
    r = cli(env, "--no-autostart", "list")
    assert r.returncode == 0, r.stderr
    header, *rows = r.stdout.splitlines()
    assert header.split()[-1] == "CAPABILITIES"
    vision_row = next(x for x in rows if x.startswith(f"hf.co/{VLM_REPO}:Q8_0"))
    plain_row = next(x for x in rows if x.startswith("plain:latest"))
    assert "vision" in vision_row and "vision" not in plain_row


def test_modelfile_from_a_pulled_vision_model_inherits_its_projector(daemon, hub, tmp_path):
    daemon.pull(f"hf.co/{VLM_REPO}:Q8_0")
    r = daemon.http.post("/api/create", json={"model": "myvlm", "stream": False,
                                              "modelfile": f"FROM hf.co/{VLM_REPO}:Q8_0\nSYSTEM describe images briefly\n"})
    assert r.status_code == 200, r.text
    info = show(daemon, "myvlm")
    assert "vision" in info["capabilities"]
    env = make_env(tmp_path, daemon.port)
    r = cli(env, "--no-autostart", "show", "--modelfile", "myvlm")
    assert r.returncode == 0, r.stderr
    froms = [line.split(" ", 1)[1] for line in r.stdout.splitlines() if line.startswith("FROM ")]
    assert len(froms) == 2, r.stdout
    assert open(froms[0], "rb").read(4) == b"GGUF" and froms[0] == info["weights_path"]
    assert open(froms[1], "rb").read() == hub.proj_q8  # the projector's blob, second
    # that Modelfile builds the same model again
    r = daemon.http.post("/api/create", json={"model": "myvlm2", "modelfile": r.stdout, "stream": False})
    assert r.status_code == 200, r.text
    assert "vision" in show(daemon, "myvlm2")["capabilities"]
    r = cli(env, "--no-autostart", "show", "myvlm2")
    assert r.returncode == 0 and "vision" in r.stdout, r.stdout + r.stderr


def test_a_second_from_that_is_not_a_projector_is_a_400(daemon, vlm, smollm2_gguf):
    gguf, _ = vlm
    r = daemon.http.post("/api/create", json={"model": "bad", "stream": False,
                                              "modelfile": f"FROM {gguf}\nFROM {smollm2_gguf}\n"})
    assert r.status_code == 400, r.text
    assert "vision projector" in r.json()["error"] and "clip" in r.json()["error"]
    assert daemon.http.post("/api/show", json={"model": "bad"}).status_code == 404
    assert daemon.http.get("/api/tags").status_code == 200  # still serving
