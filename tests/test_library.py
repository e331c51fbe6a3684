"""The model library through its Python API: names, GGUF validation, Modelfiles,
create/show/copy/remove with the real SmolLM2 GGUF, and the offline default pull.
Hub pulls (fake hub on 127.0.0.1) live in test_library_pull.py."""

from __future__ import annotations

import os
import struct
import time
from pathlib import Path

import numpy as np
import pytest

from localrun.errors import InvalidRequest, LocalrunError, ModelDamaged, NotFound
from localrun.library import Library, Modelfile, parse_modelfile, parse_name, read_gguf_info, validate_digest

REPO = Path(__file__).resolve().parents[1]
SMOL_SHA = "sha256:b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def make_gguf(path: Path, *, arch: str = "llama", big: int = 0, template: str | None = "{{ messages[0]['content'] }}") -> Path:
    """A small real GGUF written with gguf.GGUFWriter (big: extra MiB of tensor data)."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(256)
    w.add_block_count(1)
    w.add_embedding_length(32)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_feed_forward_length(64)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(64)])
    if template:
        w.add_chat_template(template)
    rng = np.random.default_rng(0)
    w.add_tensor("token_embd.weight", rng.random((64, 32), dtype=np.float32))
    w.add_tensor("blk.0.attn_q.weight", rng.random((32, 32), dtype=np.float32))
    if big:
        w.add_tensor("blk.0.ffn_up.weight", rng.random((big * 256, 1024), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def lib(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    return Library(tmp_path / "models")


# --------------------------------------------------------------------------- names

@pytest.mark.parametrize("text,display,tag,repo", [
    ("smollm2:135m", "smollm2:135m", "135m", None),
    ("smollm2", "smollm2:latest", "latest", None),
    ("Me/My-Model:V1", "me/my-model:v1", "v1", None),
    ("hf.co/ORG/Repo-GGUF:Q4_K_M", "hf.co/ORG/Repo-GGUF:Q4_K_M", "Q4_K_M", "ORG/Repo-GGUF"),
    ("huggingface.co/org/repo", "hf.co/org/repo:latest", "latest", "org/repo"),
    ("https://hf.co/org/repo:q8_0", "hf.co/org/repo:q8_0", "q8_0", "org/repo"),
])
def test_parse_name_valid(text, display, tag, repo):
    n = parse_name(text)
    assert n.display == display and n.tag == tag and n.repo_id == repo and n.is_hf == (repo is not None)


@pytest.mark.parametrize("bad", ["", "  ", "../etc/passwd", "a/../b", "/abs/path", "~/x", "a\x00b", "a\\b", "a b",
                                 "a:", "a:b:c/d", ":tag", "hf.co/onlyorg", "hf.co/a/b/c", "x/y/z", "evil.com/a/b",
                                 "-lead", "a/b:..", "name:t@g", "a" * 200, None, 5])
def test_parse_name_invalid(bad):
    with pytest.raises(InvalidRequest) as e:
        parse_name(bad)
    assert e.value.status == 400 and "invalid model name" in e.value.message


@pytest.mark.parametrize("bad", ["sha256:" + "a" * 63, "sha256:" + "a" * 65, "sha256:" + "A" * 64, "sha512:" + "a" * 64,
                                 "sha256:../../" + "a" * 58, "sha256:" + "a" * 63 + "\x00", "", None,
                                 "sha256:" + "a" * 63 + "/"])
def test_digest_validation(lib, bad):
    with pytest.raises(InvalidRequest):
        validate_digest(bad)
    with pytest.raises(InvalidRequest):
        lib.store.blob_path(bad)
    assert validate_digest("sha256-" + "b" * 64) == "sha256:" + "b" * 64


# --------------------------------------------------------------------------- GGUF

def test_real_gguf_info_matches_gguf_reader(smollm2_gguf):
    from gguf import GGUFReader

    info = read_gguf_info(smollm2_gguf)
    r = GGUFReader(smollm2_gguf)
    assert info.architecture == "llama" and info.file_type == "Q4_1"
    assert (info.block_count, info.head_count, info.head_count_kv, info.embedding_length) == (30, 9, 3, 576)
    assert info.vocab_size == 49152 and info.context_length == 8192
    assert info.parameter_count == sum(int(t.n_elements) for t in r.tensors)
    assert info.tensor_bytes == sum(int(t.n_bytes) for t in r.tensors)
    assert info.tensor_count == len(r.tensors)
    assert "<|im_start|>" in info.chat_template
    assert info.parameter_size == "134.52M"
    assert info.metadata["tokenizer.ggml.tokens"] is None  # big arrays omitted


def _corruptions(good: bytes):
    """(label, bytes) of broken variants of a small valid GGUF."""
    n_kv_off = 16
    yield "empty", b""
    yield "magic only", good[:4]
    yield "header cut", good[:20]
    for frac in (0.05, 0.2, 0.5):
        yield f"truncated at {frac}", good[: int(len(good) * frac)]
    yield "tensor data past EOF", good[:-100]
    yield "bad magic", b"GGUX" + good[4:]
    yield "version 1", good[:4] + struct.pack("<I", 1) + good[8:]
    yield "absurd tensor count", good[:8] + struct.pack("<Q", 1 << 40) + good[16:]
    yield "absurd kv count", good[:n_kv_off] + struct.pack("<Q", 1 << 50) + good[24:]
    # first key's string length -> huge
    yield "absurd string length", good[:24] + struct.pack("<Q", 1 << 62) + good[32:]
    # the token list's array length -> huge
    i = good.find(b"tokenizer.ggml.tokens")
    arr = i + len(b"tokenizer.ggml.tokens") + 4 + 4  # value type, element type
    yield "absurd array length", good[:arr] + struct.pack("<Q", 1 << 60) + good[arr + 8:]
    # first tensor's n_dims -> 9, then a dimension -> 0 / huge
    j = good.find(b"token_embd.weight") + len(b"token_embd.weight")
    yield "too many dims", good[:j] + struct.pack("<I", 9) + good[j + 4:]
    yield "zero dim", good[:j + 4] + struct.pack("<Q", 0) + good[j + 12:]
    yield "huge dims", good[:j + 4] + struct.pack("<Q", 1 << 40) + struct.pack("<Q", 1 << 40) + good[j + 20:]
    yield "unknown tensor type", good[:j + 20] + struct.pack("<I", 999) + good[j + 24:]
    yield "offset past EOF", good[:j + 24] + struct.pack("<Q", 1 << 32) + good[j + 32:]


def test_corrupt_ggufs_rejected(tmp_path, lib):
    good_path = make_gguf(tmp_path / "good.gguf")
    good = good_path.read_bytes()
    assert read_gguf_info(good_path).architecture == "llama"
    for label, data in _corruptions(good):
        p = tmp_path / "bad.gguf"
        p.write_bytes(data)
        with pytest.raises(InvalidRequest) as e:
            read_gguf_info(p)
        assert "bad.gguf is not a valid GGUF" in e.value.message, label
        assert str(tmp_path) not in e.value.message  # no directories leak
        # and create refuses it, storing nothing
        with pytest.raises(InvalidRequest):
            lib.create("bad", "FROM ./bad.gguf", base_dir=tmp_path)
    assert lib.list() == []
    assert not any(lib.store.blobs.glob("sha256-*")) if lib.store.blobs.exists() else True


def test_import_refuses_non_regular_files(tmp_path, lib):
    os.mkfifo(tmp_path / "fifo.gguf")
    (tmp_path / "dir.gguf").mkdir()
    for src, msg in (("./fifo.gguf", "not a regular file"), ("./missing.gguf", "no such file"),
                     ("./dir.gguf", "safetensors model directory")):
        t0 = time.monotonic()
        with pytest.raises(InvalidRequest) as e:
            lib.create("x", f"FROM {src}", base_dir=tmp_path)
        assert msg in e.value.message and time.monotonic() - t0 < 5
    with pytest.raises(NotFound):
        lib.create("x", "FROM nosuchmodel:1b", base_dir=tmp_path)
    assert lib.list() == []


# --------------------------------------------------------------------------- Modelfile

def test_modelfile_parse_and_render_round_trip():
    text = (REPO / "modelfiles" / "json.Modelfile").read_text()
    mf = parse_modelfile(text)
    assert mf.from_ == "smollm2:135m"
    assert mf.parameters == {"temperature": 0.0, "seed": 42, "num_predict": 256, "stop": ["<|im_end|>"]}
    assert mf.messages[1] == {"role": "assistant", "content": '{"color": "red", "hex": "#ff0000"}'}
    again = parse_modelfile(mf.to_text())
    assert again == mf
    tricky = Modelfile("x", {"stop": ['"', "a b"]}, None, '  padded "quoted" ', [{"role": "user", "content": 'ends with "'}],
                       'multi\nline', None)
    assert parse_modelfile(tricky.to_text()) == tricky


@pytest.mark.parametrize("text,line,msg", [
    ("FROM a\nBOGUS x", 2, "unknown instruction"),
    ("FROM a\n\nPARAMETER temperature warm", 3, "must be a number"),
    ("FROM a\nPARAMETER top_p 1.5", 2, "out of range"),
    ("FROM a\nPARAMETER num_ctx 2.5", 2, "integer"),
    ("FROM a\nPARAMETER flux 1", 2, "unknown parameter"),
    ("FROM a\nPARAMETER temperature", 2, "needs a name and a value"),
    ("FROM a\nSYSTEM \"\"\"never closed\nstill open", 2, "never closed"),
    ("FROM a\nMESSAGE robot hi", 2, "role"),
    ("FROM a\nFROM b\nFROM c", 3, "FROM appears three times"),  # a second FROM is the vision projector
    ("FROM a\nTEMPLATE {% for %}", 2, "TEMPLATE does not compile"),
    ("FROM a\nSYSTEM \"unterminated", 2, "quoted string"),
])
def test_modelfile_errors_name_the_line(text, line, msg):
    with pytest.raises(InvalidRequest) as e:
        parse_modelfile(text)
    assert f"line {line}" in e.value.message and msg in e.value.message
    with pytest.raises(InvalidRequest, match="no FROM"):
        parse_modelfile("PARAMETER temperature 1")


# --------------------------------------------------------------------------- offline default + round trips

def test_default_model_offline(tmp_path, monkeypatch, smollm2_gguf):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("LOCALRUN_HOME", str(tmp_path / "home"))
    lib = Library()  # settings().models_dir
    assert lib.root == tmp_path / "home" / "models"
    events = []
    t0 = time.monotonic()
    r = lib.pull("smollm2:135m", progress=events.append)
    assert time.monotonic() - t0 < 20
    statuses = [e.status for e in events]
    assert statuses[0] == "pulling manifest" and statuses[-1] == "success"
    assert "verifying sha256 digest" in statuses and "writing manifest" in statuses
    assert events[-2].to_dict() == {"status": "writing manifest"}
    assert r.name == "smollm2:135m" and r.format == "gguf" and r.info.architecture == "llama"
    assert r.weights == lib.store.blob_path(SMOL_SHA)
    assert r.weights.stat().st_size == 98362432
    assert r.weights.stat().st_ino != smollm2_gguf.stat().st_ino  # a copy: the package's file is not the blob
    assert r.template and "<|im_start|>" in r.template  # from the GGUF
    assert r.parameters == {"stop": ["<|im_end|>"]}
    # a second pull transfers nothing and is quick; "smollm2" finds the default tag
    t0 = time.monotonic()
    lib.pull("smollm2:135m")
    assert time.monotonic() - t0 < 5
    assert lib.resolve("smollm2").name == "smollm2:135m" and lib.exists("smollm2")


@pytest.fixture(scope="module")
def smol_lib(tmp_path_factory):
    """One library with smollm2:135m pulled offline, shared by the round-trip tests."""
    mp = pytest.MonkeyPatch()
    mp.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    lib = Library(tmp_path_factory.mktemp("smol") / "models")
    lib.pull("smollm2:135m")
    yield lib
    mp.undo()


def test_modelfile_create_show_copy_remove(smol_lib):
    lib = smol_lib
    base = lib.resolve("smollm2:135m")
    made = {}
    for fn, name in (("pirate.Modelfile", "pirate"), ("json.Modelfile", "json-bot"), ("longctx.Modelfile", "smollm2-8k")):
        events = []
        made[name] = lib.create(name, (REPO / "modelfiles" / fn).read_text(), base_dir=REPO / "modelfiles",
                                progress=events.append)
        assert events[-1].status == "success"
        assert made[name].weights == base.weights  # same blob, no copy
    p = made["pirate"]
    assert p.name == "pirate:latest" and "Captain Smol" in p.system
    assert p.parameters == {"temperature": 0.8, "top_p": 0.9, "stop": ["<|im_end|>"]}
    assert made["json-bot"].messages[0]["role"] == "user"
    assert made["smollm2-8k"].parameters["num_ctx"] == 8192
    assert made["smollm2-8k"].license.startswith("Apache-2.0")

    show = lib.show("pirate")
    assert show["weights_path"] == str(base.weights) and Path(show["weights_path"]).is_file()
    assert show["details"]["family"] == "llama" and show["details"]["quantization_level"] == "Q4_1"
    assert show["details"]["parameter_size"] == "134.52M" and show["details"]["parent_model"] == "smollm2:135m"
    assert show["model_info"]["llama.context_length"] == 8192
    assert show["model_info"]["general.parameter_count"] == 134515008
    assert 'stop                           "<|im_end|>"' in show["parameters"]
    assert show["system"] == p.system and "<|im_start|>" in show["template"]
    assert show["digest"] == p.digest
    # show's Modelfile builds the same model again
    again = lib.create("pirate2", show["modelfile"])
    assert (again.system, again.parameters, again.template) == (p.system, p.parameters, p.template)

    # a Modelfile FROM another created model inherits and overrides
    child = lib.create("pirate-cold", "FROM pirate\nPARAMETER temperature 0.1\n")
    assert child.system == p.system and child.parameters["temperature"] == 0.1 and child.parameters["top_p"] == 0.9

    lib.copy("pirate", "me/pirate:v2")
    assert lib.resolve("me/pirate:v2").digest == p.digest
    names = [m.name for m in lib.list()]
    assert names == sorted(names) and {"pirate:latest", "me/pirate:v2", "smollm2:135m"} <= set(names)

    system_blob = next(l["digest"] for l in lib.store.read_manifest(parse_name("pirate"))[0]["layers"]
                       if l["mediaType"].endswith(".system"))
    for n in ("pirate", "pirate2", "pirate-cold"):
        lib.remove(n)
    assert lib.store.has_blob(system_blob)  # me/pirate:v2 still uses it
    lib.remove("me/pirate:v2")
    assert not lib.store.has_blob(system_blob)  # garbage-collected
    assert lib.store.has_blob(SMOL_SHA)  # still referenced by smollm2:135m and the others
    with pytest.raises(NotFound):
        lib.resolve("pirate")
    with pytest.raises(NotFound):
        lib.remove("pirate")
    with pytest.raises(NotFound):
        lib.copy("nope", "x")
    with pytest.raises(InvalidRequest):
        lib.copy("smollm2:135m", "../evil")
    for n in ("json-bot", "smollm2-8k"):
        lib.remove(n)


def test_import_local_gguf_and_safetensors(tmp_path, lib):
    from safetensors.numpy import save_file

    g = make_gguf(tmp_path / "tiny.gguf")
    r = lib.create("tiny", "FROM ./tiny.gguf\nSYSTEM hi\n", base_dir=tmp_path)
    assert r.format == "gguf" and r.info.parameter_count == 64 * 32 + 32 * 32
    assert r.weights.stat().st_ino != g.stat().st_ino  # a copy, never a link to the user's file
    assert r.adapter is None and r.template == "{{ messages[0]['content'] }}"

    d = tmp_path / "st"
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "llama", "architectures": ["LlamaForCausalLM"], '
                                   '"max_position_embeddings": 512, "num_hidden_layers": 1, "hidden_size": 8}')
    (d / "tokenizer_config.json").write_text('{"chat_template": "{{ messages }}"}')
    save_file({"w": np.zeros((4, 8), dtype=np.float32), "b": np.zeros(8, dtype=np.float32)}, str(d / "model.safetensors"))
    (d / "pytorch_model.bin").write_bytes(b"never imported")
    r2 = lib.create("tiny-st", "FROM ./st", base_dir=tmp_path)
    assert r2.format == "safetensors" and r2.weights.is_dir()
    assert sorted(p.name for p in r2.weights.iterdir()) == ["config.json", "model.safetensors", "tokenizer_config.json"]
    assert r2.template == "{{ messages }}" and r2.info is None
    s = lib.show("tiny-st")
    assert s["details"]["format"] == "safetensors" and s["model_info"]["general.parameter_count"] == 40
    assert s["model_info"]["llama.context_length"] == 512 and s["weights_path"] == str(r2.weights)
    # a corrupt safetensors header is refused and nothing is stored
    (d / "model.safetensors").write_bytes(struct.pack("<Q", 10**12) + b"{}")
    with pytest.raises(InvalidRequest, match="not a valid safetensors"):
        lib.create("bad-st", "FROM ./st", base_dir=tmp_path)
    assert [m.name for m in lib.list()] == ["tiny-st:latest", "tiny:latest"]
    lib.remove("tiny-st")
    lib.remove("tiny")
    assert not any(lib.store.blobs.iterdir()) and not any(lib.store.views.iterdir())
    assert g.is_file()  # the user's file is untouched


def test_a_model_whose_weights_went_missing_can_still_be_removed(tmp_path, lib):
    """resolve refuses such a model (nothing could load it); delete names it from its manifest alone
    (stored_name), so it can still be removed; a name with no manifest is 'not found'."""
    make_gguf(tmp_path / "tiny.gguf")
    r = lib.create("tiny", "FROM ./tiny.gguf\n", base_dir=tmp_path)
    r.weights.unlink()
    with pytest.raises(ModelDamaged, match="missing"):  # (a 500 naming the model; 404 is for no such model)
        lib.resolve("tiny")
    assert lib.stored_name("tiny") == "tiny:latest"
    lib.remove(lib.stored_name("tiny"))
    with pytest.raises(NotFound, match="'tiny' not found; `localrun list`"):
        lib.stored_name("tiny")


def test_disk_full(tmp_path, lib):
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.system(f"mount -t tmpfs -o size=1m tmpfs {mnt} 2>/dev/null") != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        small = Library(mnt / "models")
        make_gguf(tmp_path / "tiny.gguf")
        make_gguf(tmp_path / "big.gguf", big=2)
        ok = small.create("tiny", "FROM ./tiny.gguf", base_dir=tmp_path)  # cross-device: copied
        with pytest.raises(LocalrunError) as e:
            small.create("big", "FROM ./big.gguf", base_dir=tmp_path)
        assert e.value.status == 507 and e.value.message.startswith("disk full:")
        assert [m.name for m in small.list()] == ["tiny:latest"]
        assert small.resolve("tiny").digest == ok.digest and read_gguf_info(small.resolve("tiny").weights)
        assert not any(small.store.tmp.iterdir())
    finally:
        os.system(f"umount {mnt}")


def test_tampered_manifest_is_refused(smol_lib):
    """A manifest edited to point outside blobs/ is refused, never followed."""
    lib = smol_lib
    lib.copy("smollm2:135m", "evil")
    path = lib.store.manifest_path(parse_name("evil"))
    path.write_text(path.read_text().replace(SMOL_SHA, "sha256:../../../../etc/passwd" + "0" * 37))
    with pytest.raises(LocalrunError) as e:
        lib.resolve("evil")
    assert e.value.status == 500 and "corrupt" in e.value.message
    assert "evil:latest" not in [m.name for m in lib.list()]
    lib.remove("evil")
    assert lib.resolve("smollm2:135m").weights.is_file()


def test_resolve_follows_every_change_to_the_library(smol_lib):
    """resolve keeps its answer per name (a request resolves its model each time) only while the manifest
    is the one it read: a re-create, a copy over, an rm, or a stored exact name that now wins over the
    catalog's tag are seen at once, and what a caller changes in an answer does not leak into the next."""
    lib = smol_lib
    lib.create("cached", "FROM smollm2:135m\nPARAMETER temperature 0.3\n")
    first = lib.resolve("cached")
    assert first.parameters["temperature"] == 0.3
    first.parameters["temperature"] = 9.9
    first.details["family"] = "changed"
    first.messages.append({"role": "user", "content": "leaked"})
    again = lib.resolve("cached")
    assert again.parameters["temperature"] == 0.3 and again.details["family"] == "llama" and again.messages == []
    lib.create("cached", "FROM smollm2:135m\nPARAMETER temperature 0.7\n")
    assert lib.resolve("cached").parameters["temperature"] == 0.7
    lib.copy("smollm2:135m", "cached")
    assert "temperature" not in lib.resolve("cached").parameters
    lib.remove("cached")
    with pytest.raises(NotFound):
        lib.resolve("cached")
    # "smollm2" (no tag) is the catalog's smollm2:135m until a smollm2:latest is stored
    assert lib.resolve("smollm2").name == "smollm2:135m"
    lib.create("smollm2:latest", "FROM smollm2:135m\nSYSTEM mine\n")
    assert lib.resolve("smollm2").name == "smollm2:latest" and lib.resolve("smollm2").system == "mine"
    lib.remove("smollm2:latest")
    assert lib.resolve("smollm2").name == "smollm2:135m"


def test_modelfile_load_time_engine_parameters():
    mf = parse_modelfile("FROM x\nPARAMETER kv_cache_type INT8\nPARAMETER weight_dtype int8\nPARAMETER tensor_parallel 3\n")
    assert mf.parameters == {"kv_cache_type": "int8", "weight_dtype": "int8", "tensor_parallel": 3}
    # Ollama's llama.cpp load options: whether the weights are mapped, and the main GPU
    mf = parse_modelfile("FROM x\nPARAMETER use_mmap false\nPARAMETER main_gpu 1\n")
    assert mf.parameters == {"use_mmap": False, "main_gpu": 1}
    assert "PARAMETER use_mmap false" in mf.to_text() and parse_modelfile(mf.to_text()).parameters == mf.parameters
    assert parse_modelfile("FROM x\nPARAMETER use_mmap True\n").parameters == {"use_mmap": True}
    with pytest.raises(InvalidRequest, match="use_mmap must be true or false"):
        parse_modelfile("FROM x\nPARAMETER use_mmap 1\n")
    with pytest.raises(InvalidRequest, match="main_gpu"):
        parse_modelfile("FROM x\nPARAMETER main_gpu -1\n")
    with pytest.raises(InvalidRequest, match="kv_cache_type must be one of .*int4"):
        parse_modelfile("FROM x\nPARAMETER kv_cache_type int4\n")
    with pytest.raises(InvalidRequest, match="weight_dtype must be one of"):
        parse_modelfile("FROM x\nPARAMETER weight_dtype q4\n")
