"""LoRA adapters (a Modelfile's ADAPTER, Ollama's create `adapters`) through the real daemon on the bundled
SmolLM2-135M, against llama.cpp's own llama-server with --lora on the same files: generation and embeddings equal
llama-server's with the adapter (and differ from the model without it); `localrun create` and the ollama SDK's
create(from_, adapters) both make the model; an adapter that is a model, fits another model, is missing or is a
directory is a 400 that says so, before anything is stored; one that does not fit is a clear error from the
backend, never a crashed process (llama-cpp-python's own Llama(lora_path=...) segfaults on it). The native engine
merges the adapter into the weights at load: the same tokens and logprobs as transformers with the PEFT adapter."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
from daemon import MODEL, Daemon, pulled_daemon

pytestmark = pytest.mark.timeout(600)
pytest.importorskip("llama_cpp")

N_CTX = 1024
N = 24
PROMPTS = ["Once upon a time", "<|im_start|>user\nTell me a story about a dragon.<|im_end|>\n<|im_start|>assistant\n"]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, lora_ggufs):
    with pulled_daemon(tmp_path_factory.mktemp("home_lora"), LOCALRUN_NUM_PARALLEL="2",
                       LOCALRUN_CONTEXT_LENGTH=str(N_CTX)) as d:
        yield d


@pytest.fixture(scope="module")
def tuned(daemon, lora_ggufs, tmp_path_factory):
    """`localrun create tuned -f Modelfile`: the bundled model with SmolLM2's adapter, by the CLI."""
    d = tmp_path_factory.mktemp("modelfile")
    (d / "Modelfile").write_text(f"FROM {MODEL}\nADAPTER {lora_ggufs[0]}\n")
    env = {**__import__("os").environ, "LOCALRUN_HOST": daemon.url.removeprefix("http://")}
    r = subprocess.run([sys.executable, "-m", "localrun", "create", "tuned", "-f", str(d / "Modelfile")], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return "tuned:latest"


@pytest.fixture(scope="module")
def llama_srv(llama_server_bin, smollm2_gguf, lora_ggufs):
    """llama-server on the bundled GGUF with --lora (one slot of the daemon's context, the same threads)."""
    from llama_server import llama_server_client

    with llama_server_client(llama_server_bin, smollm2_gguf, N_CTX, "--lora", str(lora_ggufs[0])) as h:
        yield h


def _generate(daemon, model: str, prompt: str) -> list:
    """The greedy answer as (token text, logprob, [(text, logprob), ...]) per token (OpenAI's completions)."""
    r = daemon.http.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": N,
                                                  "temperature": 0, "logprobs": 3})
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    return [(t, x, list(top.items())) for t, x, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"])]


def _reference(h: httpx.Client, prompt: str) -> list:
    """llama-server's greedy answer, in the same shape."""
    r = h.post("/completion", json={"prompt": prompt, "n_predict": N, "temperature": 0, "n_probs": 3,
                                    "cache_prompt": False})
    assert r.status_code == 200, r.text
    return [(p["token"], p["logprob"], [(t["token"], t["logprob"]) for t in p["top_logprobs"]])
            for p in r.json()["completion_probabilities"]]


def _agree(reference: list, got: list) -> None:
    """The same answer, up to a near tie that llama.cpp's batch-dependent arithmetic may flip (bench.greedy)."""
    from localrun.bench.greedy import compare

    cmp = compare(reference, got)
    assert cmp.acceptable, cmp
    if cmp.verdict == "same":
        assert len(got) == N


def _text(tokens: list) -> str:
    return "".join(t for t, _, _ in tokens)


def test_generation_with_the_adapter_is_llama_servers(daemon, tuned, llama_srv):
    for prompt in PROMPTS:
        _agree(_reference(llama_srv, prompt), _generate(daemon, tuned, prompt))
    # the adapter changes the answer: without it the model says something else
    assert _text(_generate(daemon, tuned, PROMPTS[0])) != _text(_generate(daemon, MODEL, PROMPTS[0]))
    assert "\nADAPTER " in daemon.http.post("/api/show", json={"model": tuned}).json()["modelfile"]


def test_two_streams_through_the_adapter_each_get_their_own_answer(daemon, tuned):
    import concurrent.futures as cf

    alone = [_generate(daemon, tuned, p) for p in PROMPTS]
    with cf.ThreadPoolExecutor(2) as pool:
        both = list(pool.map(lambda p: _generate(daemon, tuned, p), PROMPTS))
    for a, b in zip(alone, both):
        _agree(a, b)


def test_embeddings_with_the_adapter_are_llama_servers(daemon, tuned, llama_server_bin, smollm2_gguf, lora_ggufs):
    from llama_server import llama_server_client

    texts = ["The sea is calm tonight.", "Three colors: red, green and blue."]
    r = daemon.http.post("/api/embed", json={"model": tuned, "input": texts})
    assert r.status_code == 200, r.text
    mine = r.json()["embeddings"]
    base = daemon.http.post("/api/embed", json={"model": MODEL, "input": texts}).json()["embeddings"]
    with llama_server_client(llama_server_bin, smollm2_gguf, N_CTX, "--lora", str(lora_ggufs[0]), "--embedding",
                             "--pooling", "mean") as h:
        ref = h.post("/v1/embeddings", json={"input": texts}).json()["data"]
    for m, b, want in zip(mine, base, sorted(ref, key=lambda d: d["index"])):
        assert max(abs(x - y) for x, y in zip(m, want["embedding"])) < 1e-4
        assert max(abs(x - y) for x, y in zip(m, b)) > 1e-3  # the adapter is applied


def test_the_ollama_sdk_creates_a_model_from_a_base_and_an_uploaded_adapter(daemon, tuned, lora_ggufs):
    import ollama

    client = ollama.Client(host=daemon.url)
    digest = client.create_blob(lora_ggufs[0])
    events = list(client.create(model="tuned2", from_=MODEL, adapters={lora_ggufs[0].name: digest}, stream=True))
    assert events[-1].status == "success"
    assert "ADAPTER " in client.show("tuned2").modelfile
    _agree(_generate(daemon, tuned, PROMPTS[0]), _generate(daemon, "tuned2", PROMPTS[0]))
    # a model made FROM the tuned one keeps its adapter
    r = daemon.http.post("/api/create", json={"model": "tuned3", "from": "tuned2", "system": "Be brief.",
                                              "stream": False})
    assert r.status_code == 200, r.text
    _agree(_generate(daemon, tuned, PROMPTS[0]), _generate(daemon, "tuned3", PROMPTS[0]))


def test_bad_adapters_are_a_400_that_says_what_is_wrong(daemon, tuned, lora_ggufs, smollm2_gguf, tmp_path):
    h = daemon.http
    before = sorted(m["name"] for m in h.get("/api/tags").json()["models"])
    (tmp_path / "adir").mkdir()
    cases = [
        (f"FROM {MODEL}\nADAPTER {smollm2_gguf}\n", "is not a LoRA adapter but a model"),
        (f"FROM {MODEL}\nADAPTER {lora_ggufs[1]}\n", "does not fit the model"),
        (f"FROM {MODEL}\nADAPTER {tmp_path / 'nope.gguf'}\n", "nope.gguf"),
        (f"FROM {MODEL}\nADAPTER {tmp_path / 'adir'}\n", "a directory without adapter_config.json"),
        (f"FROM {lora_ggufs[0]}\n", "adapter, not a model"),
        (f"FROM {MODEL}\nADAPTER {lora_ggufs[0]}\nADAPTER {lora_ggufs[0]}\n", "only one ADAPTER"),
    ]
    for modelfile, words in cases:
        r = h.post("/api/create", json={"model": "bad", "modelfile": modelfile, "stream": False})
        assert 400 <= r.status_code < 500 and words in r.json()["error"], (modelfile, r.status_code, r.text)
    digest = "sha256:" + "0" * 64
    for body, words in [({"from": MODEL, "adapters": {"a.gguf": digest}}, "upload the file first"),
                        ({"from": MODEL, "adapters": "a.gguf"}, "'adapters' must be an object"),
                        ({"modelfile": f"FROM {MODEL}\nADAPTER {lora_ggufs[0]}\n", "adapters": {"a.gguf": digest}},
                         "upload the file first")]:
        r = h.post("/api/create", json={"model": "bad", "stream": False, **body})
        assert r.status_code == 400 and words in r.json()["error"], (body, r.text)
    assert sorted(m["name"] for m in h.get("/api/tags").json()["models"]) == before
    assert _generate(daemon, tuned, PROMPTS[1])  # what was there still works


def test_an_adapter_that_does_not_fit_is_a_clear_load_error_not_a_crash(smollm2_gguf, lora_ggufs):
    """The backends load an adapter llama.cpp refuses (the daemon's create checks shapes first; a hand-made
    manifest or a changed file could still get here) as a BackendError, in this very process."""
    from localrun.backends.base import LoadSpec
    from localrun.backends.llamacpp.pooled import Pooled
    from localrun.backends.llamacpp import LlamaCppBackend
    from localrun.errors import BackendError

    spec = LoadSpec(name="misfit", weights=smollm2_gguf, format="gguf", num_ctx=256, num_parallel=1,
                    extra={"adapter": str(lora_ggufs[1])})
    with pytest.raises(BackendError, match="could not load the LoRA adapter of misfit"):
        LlamaCppBackend(spec)
    pooled = Pooled(spec, window=256, pooling=1, n_threads=2, n_gpu_layers=0, extra_bufts=False)
    with pytest.raises(BackendError, match="was it trained on this model"):
        pooled.embed(["hello"])


def _transformers_with_adapter(smollm2_gguf, lora_ggufs):
    """transformers' SmolLM2 (dequantized from the GGUF, float32) with the PEFT adapter merged in Hugging Face's
    own layout: W += alpha / r * B @ A, from the adapter as PEFT saved it (before llama.cpp's converter)."""
    import json

    import torch
    import transformers
    from safetensors.torch import load_file

    peft = lora_ggufs[0].parent / "hf" / "smollm2" / "lora"
    cfg = json.loads((peft / "adapter_config.json").read_text())
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name,
                                                           dtype=torch.float32).eval()
    state, lora = hf.state_dict(), load_file(str(peft / "adapter_model.safetensors"))
    with torch.no_grad():
        for key, a in lora.items():
            if key.endswith(".lora_A.weight"):
                name = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight") + ".weight"
                b = lora[key.replace(".lora_A.", ".lora_B.")]
                state[name].add_(cfg["lora_alpha"] / cfg["r"] * (b @ a))
    return hf


def test_native_engine_merges_the_adapter_as_peft_applies_it(smollm2_gguf, lora_ggufs):
    """The native engine (CPU, float32) with the adapter merged at load: the same greedy tokens and logprobs as
    transformers with the PEFT adapter applied to the same dequantized weights."""
    import torch

    from localrun.engine.config import EngineConfig
    from localrun.engine.engine import LLMEngine
    from localrun.engine.sampler import SamplingParams

    cfg = EngineConfig(device="cpu", dtype="float32", max_model_len=512)
    eng = LLMEngine.from_gguf(smollm2_gguf, cfg, adapter=lora_ggufs[0])
    try:
        prompts = [eng.tokenizer.encode(p) for p in PROMPTS]
        outs = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1))
    finally:
        eng.shutdown()
    hf = _transformers_with_adapter(smollm2_gguf, lora_ggufs)
    for p, o in zip(prompts, outs):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False, pad_token_id=2)[0, len(p):].tolist()
        assert o.token_ids == ref
        with torch.inference_mode():
            lp = torch.log_softmax(hf(torch.tensor([p + ref])).logits[0, len(p) - 1:-1].float(), -1)
        # (the adapter moves these logprobs by far more: without it the answers differ, test_generation_...)
        assert max(abs(c - float(lp[j, t])) for j, (t, c, _) in enumerate(o.logprobs)) < 1e-3


def test_the_daemon_loads_an_adapted_model_on_the_native_engine(tmp_path, lora_ggufs, smollm2_gguf):
    """LOCALRUN_BACKEND=native: the same model made by create answers with the native engine's adapted tokens."""
    from localrun.engine.config import EngineConfig
    from localrun.engine.engine import LLMEngine
    from localrun.engine.sampler import SamplingParams

    eng = LLMEngine.from_gguf(smollm2_gguf, EngineConfig(device="cpu", dtype="float32", max_model_len=512),
                              adapter=lora_ggufs[0])
    try:
        want = eng.generate([eng.tokenizer.encode(PROMPTS[0])], SamplingParams(temperature=0, max_tokens=12,
                                                                                ignore_eos=True))[0].text
    finally:
        eng.shutdown()
    d = Daemon(tmp_path / "home", LOCALRUN_BACKEND="native", LOCALRUN_CONTEXT_LENGTH="512")
    try:
        d.pull()
        r = d.http.post("/api/create", json={"model": "tuned-native", "stream": False,
                                             "modelfile": f"FROM {MODEL}\nADAPTER {lora_ggufs[0]}\n"})
        assert r.status_code == 200, r.text
        r = d.http.post("/api/generate", json={"model": "tuned-native", "prompt": PROMPTS[0], "raw": True,
                                               "stream": False, "options": {"temperature": 0, "num_predict": 12}})
        assert r.status_code == 200, r.text
        assert r.json()["response"] == want
        m = [m for m in d.ps() if m["name"] == "tuned-native:latest"][0]
        assert m["backend"] == "native" and m["fallbacks"] == [], m
    finally:
        d.stop()


def test_an_adapter_that_does_not_fit_a_model_file_stores_nothing(tmp_path, lora_ggufs, monkeypatch):
    """FROM a GGUF file with an ADAPTER that does not fit it: refused before the model file is copied in."""
    from test_library import make_gguf

    from localrun.errors import InvalidRequest
    from localrun.library.api import Library

    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    lib = Library(tmp_path / "models")
    make_gguf(tmp_path / "tiny.gguf")  # a llama whose blk.0.attn_q is 32 x 32
    with pytest.raises(InvalidRequest, match="FROM must name the model the adapter was trained on"):
        lib.create("x", f"FROM ./tiny.gguf\nADAPTER {lora_ggufs[1]}\n", base_dir=tmp_path)
    assert lib.list() == [] and (not lib.store.blobs.exists() or not any(lib.store.blobs.iterdir()))


def _tensors(path) -> tuple[dict, float]:
    import gguf
    import numpy as np

    r = gguf.GGUFReader(str(path))
    alpha = float(r.fields["adapter.lora.alpha"].contents())
    return {t.name: np.array(t.data, dtype=np.float32).reshape(tuple(reversed(t.shape.tolist()))) for t in r.tensors}, alpha


def test_a_peft_adapter_directory_converts_to_what_llama_cpps_converter_writes(daemon, tuned, lora_ggufs, tmp_path):
    """ADAPTER <a PEFT directory> (as Ollama takes a safetensors adapter): converted here to the same GGUF
    llama.cpp's convert_lora_to_gguf.py writes (Q/K rows permuted alike), and the model answers as with that GGUF;
    the ollama SDK's create with the directory's two files uploaded does the same."""
    import json
    import shutil

    import numpy as np
    import ollama

    peft = lora_ggufs[0].parent / "hf" / "smollm2" / "lora"
    r = daemon.http.post("/api/create", json={"model": "tuned-peft", "stream": False,
                                              "modelfile": f"FROM {MODEL}\nADAPTER {peft}\n"})
    assert r.status_code == 200, r.text
    modelfile = daemon.http.post("/api/show", json={"model": "tuned-peft"}).json()["modelfile"]
    stored = modelfile.split("\nADAPTER ")[1].split("\n")[0]
    mine, alpha = _tensors(stored)
    want, want_alpha = _tensors(lora_ggufs[0])
    assert sorted(mine) == sorted(want) and alpha == want_alpha == 16.0
    assert all(np.array_equal(mine[k], want[k]) for k in want)
    _agree(_generate(daemon, tuned, PROMPTS[0]), _generate(daemon, "tuned-peft", PROMPTS[0]))

    client = ollama.Client(host=daemon.url)
    files = {fn: client.create_blob(peft / fn) for fn in ("adapter_config.json", "adapter_model.safetensors")}
    events = list(client.create(model="tuned-peft2", from_=MODEL, adapters=files, stream=True))
    assert events[-1].status == "success"
    _agree(_generate(daemon, tuned, PROMPTS[1]), _generate(daemon, "tuned-peft2", PROMPTS[1]))

    # what a LoRA GGUF cannot hold is a 400 that says what to do
    cfg = json.loads((peft / "adapter_config.json").read_text())
    for name, change, words in [("dora", {"use_dora": True}, "DoRA"), ("saved", {"modules_to_save": ["lm_head"]},
                                "modules_to_save"), ("prefix", {"peft_type": "PREFIX_TUNING"}, "only LoRA")]:
        d = tmp_path / name
        d.mkdir()
        shutil.copy(peft / "adapter_model.safetensors", d)
        (d / "adapter_config.json").write_text(json.dumps({**cfg, **change}))
        r = daemon.http.post("/api/create", json={"model": "bad", "stream": False,
                                                  "modelfile": f"FROM {MODEL}\nADAPTER {d}\n"})
        assert r.status_code == 400 and words in r.json()["error"], r.text
    from safetensors.numpy import save_file

    d = tmp_path / "head"
    shutil.copytree(peft, d)
    save_file({"base_model.model.lm_head.lora_A.weight": np.zeros((8, 576), np.float32)}, str(d / "adapter_model.safetensors"))
    r = daemon.http.post("/api/create", json={"model": "bad", "stream": False,
                                              "modelfile": f"FROM {MODEL}\nADAPTER {d}\n"})
    assert r.status_code == 400 and "convert_lora_to_gguf.py" in r.json()["error"], r.text
    assert "bad:latest" not in {m["name"] for m in daemon.http.get("/api/tags").json()["models"]}


def test_pulling_a_repo_of_only_a_lora_adapter_says_what_it_is(tmp_path, lora_ggufs, monkeypatch):
    from fakehub import FakeHub

    from localrun.errors import InvalidRequest
    from localrun.library.api import Library

    hub = FakeHub()
    hub.add_path("org/Tiny-LoRA-GGUF", lora_ggufs[0], "tiny-lora-F32.gguf")
    hub.start()
    try:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        lib = Library(tmp_path / "models")
        with pytest.raises(InvalidRequest, match="tiny-lora-F32.gguf is a lora adapter, not a model: pull the model"):
            lib.pull("hf.co/org/Tiny-LoRA-GGUF")
        assert lib.list() == []
    finally:
        hub.stop()


def test_tensor_parallel_ranks_merge_the_adapter_too(smollm2_gguf, lora_ggufs):
    """Three ranks (SmolLM2's 9 query and 3 KV heads split three ways; gloo on CPU) each merge the update of their
    shard of every adapted weight (read whole, then cut): the same tokens and logprobs as one rank."""
    from localrun.engine.config import EngineConfig
    from localrun.engine.engine import LLMEngine
    from localrun.engine.sampler import SamplingParams

    outs = {}
    for tp in (1, 3):
        eng = LLMEngine.from_gguf(smollm2_gguf, EngineConfig(device="cpu", dtype="float32", max_model_len=256,
                                                             kv_cache_tokens=1024, tensor_parallel=tp),
                                  adapter=lora_ggufs[0])
        try:
            ids = eng.tokenizer.encode(PROMPTS[0])
            outs[tp] = eng.generate([ids], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1))[0]
        finally:
            eng.shutdown()
    assert outs[3].token_ids == outs[1].token_ids
    assert max(abs(a[1] - b[1]) for a, b in zip(outs[1].logprobs, outs[3].logprobs)) < 1e-4
