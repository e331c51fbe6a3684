"""Embedding models and rerankers through the real daemon over HTTP, against llama.cpp's own llama-server on the
same GGUFs: tiny random XLM-RoBERTa models laid out as bge-m3 (CLS pooling) and bge-reranker-v2-m3 (a classifier
head) are (tests/xlmr_model.py), and the bundled SmolLM2 beside them. The daemon embeds with the model's own
pooling, reranks on /v1/rerank (Jina/Cohere/vLLM/llama-server's shape and TEI's), and refuses what such a model
cannot do with a clear 400 before loading it."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
from daemon import MODEL, Daemon

pytestmark = pytest.mark.timeout(600)

pytest.importorskip("llama_cpp")

EMBED, RERANK, TEMPLATED = "tiny-embed", "tiny-rerank", "tiny-rerank-templated"
N_CTX = 512  # the tiny models' trained context (XLM-R's 514 positions less its padding offset)
TEXTS = ["the cat sat on the mat", "paris is the capital of france", "water boils at one hundred degrees",
         "why is the sky blue", "a red fox jumps over the lazy dog in the park"]
QUERY = "what is the capital of france"
EXACT = 1e-6  # one input a pass, as llama-server computes it (measured: 2e-8)
# several inputs share a pass: llama.cpp's f16 arithmetic moves with the batch's make-up (measured: embeddings 2e-4,
# reranking logits 1.3e-3, for llama-server's own batches as for the daemon's; the texts differ by 0.02 and more)
TOL = 5e-3


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, xlmr_ggufs):
    embed, rerank, templated = xlmr_ggufs
    d = Daemon(tmp_path_factory.mktemp("home_pooled"), LOCALRUN_MAX_LOADED_MODELS="3", LOCALRUN_NUM_PARALLEL="1",
               LOCALRUN_CONTEXT_LENGTH="1024")
    try:
        d.pull()
        for name, path in ((EMBED, embed), (RERANK, rerank), (TEMPLATED, templated)):
            r = d.http.post("/api/create", json={"model": name, "modelfile": f"FROM {path}\n", "stream": False})
            assert r.status_code == 200, r.text
        yield d
    finally:
        d.stop()


def _server(binary, gguf, *args):
    """llama-server on `gguf` with `args`, the daemon's window and threads, and a client of it."""
    from llama_server import llama_server_client

    return llama_server_client(binary, gguf, N_CTX, *args)


@pytest.fixture(scope="module")
def llama_embed(llama_server_bin, xlmr_ggufs):
    """llama-server --embedding on the embedding model (its own pooling: the GGUF's CLS)."""
    with _server(llama_server_bin, xlmr_ggufs[0], "--embedding") as h:
        yield h


@pytest.fixture(scope="module")
def llama_rerank(llama_server_bin, xlmr_ggufs):
    with _server(llama_server_bin, xlmr_ggufs[1], "--reranking") as h:
        yield h


def _close(a: list[float], b: list[float], tol: float = TOL) -> bool:
    return len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) < tol


def test_embeddings_use_the_models_pooling_as_llama_server_does(daemon, llama_embed, xlmr_ggufs):
    """/v1/embeddings (the openai SDK), /api/embed (the ollama SDK) and /api/embeddings give llama-server's vectors:
    the GGUF's CLS pooling, normalized. Mean pooling (what the daemon used for every model before) gives others."""
    import llama_cpp
    import ollama
    from openai import OpenAI

    ref = [llama_embed.post("/v1/embeddings", json={"input": t}).json()["data"][0]["embedding"] for t in TEXTS]
    client = OpenAI(base_url=daemon.url + "/v1", api_key="x")
    for t, r in zip(TEXTS, ref):  # one text a request: llama-server's numbers
        assert _close(client.embeddings.create(model=EMBED, input=t).data[0].embedding, r, EXACT)
    oa = client.embeddings.create(model=EMBED, input=TEXTS)
    ours = [x.embedding for x in oa.data]
    assert all(_close(a, b) for a, b in zip(ours, ref)), [max(abs(x - y) for x, y in zip(a, b)) for a, b in zip(ours, ref)]
    assert oa.usage.prompt_tokens == sum(len(llama_embed.post("/tokenize", json={"content": t, "add_special": True})
                                             .json()["tokens"]) for t in TEXTS)
    ol = ollama.Client(host=daemon.url).embed(model=EMBED, input=TEXTS[2])
    assert _close(list(ol.embeddings[0]), ref[2], EXACT)
    legacy = daemon.http.post("/api/embeddings", json={"model": EMBED, "prompt": TEXTS[1]}).json()["embedding"]
    assert _close(legacy, ref[1], EXACT)
    # the texts are told apart (the test would not notice a constant vector otherwise)
    assert max(abs(x - y) for x, y in zip(ref[0], ref[1])) > 0.01

    mean = llama_cpp.Llama(model_path=str(xlmr_ggufs[0]), embedding=True, pooling_type=llama_cpp.LLAMA_POOLING_TYPE_MEAN,
                           n_ctx=N_CTX, n_batch=N_CTX, n_ubatch=N_CTX, verbose=False)
    try:
        other = mean.embed(TEXTS[0], normalize=True)
    finally:
        mean.close()
    assert not _close(other, ref[0])


def test_a_generating_models_batch_embeds_each_text_as_alone(daemon):
    """A generating model is mean-pooled. A batch of texts (about 1,300 tokens: more than one 512-token pass) gives
    each text the vector it gets alone, up to flash attention's batch-dependent arithmetic (measured: 1e-3). llama.cpp
    pools each pass on its own, so a text cut over two passes came out up to 0.066 off in passes of 512."""
    from localrun.bench.vs_llama_server import Vocab, distinct_prompts
    from localrun.library.catalog import bundled_gguf

    texts = distinct_prompts(Vocab(bundled_gguf()), 16, 80, 7)
    batch = daemon.http.post("/v1/embeddings", json={"model": MODEL, "input": texts}).json()
    assert batch["usage"]["prompt_tokens"] > 2 * 512, batch["usage"]
    vectors = [d["embedding"] for d in sorted(batch["data"], key=lambda d: d["index"])]
    for t, v in zip(texts, vectors):
        alone = daemon.http.post("/v1/embeddings", json={"model": MODEL, "input": t}).json()["data"][0]["embedding"]
        assert _close(v, alone, 0.01), max(abs(x - y) for x, y in zip(v, alone))


def _sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def test_rerank_equals_llama_servers_in_every_shape(daemon, llama_rerank):
    ref = llama_rerank.post("/v1/rerank", json={"query": QUERY, "documents": TEXTS}).json()
    raw = {x["index"]: x["relevance_score"] for x in ref["results"]}
    assert sorted(raw) == list(range(len(TEXTS)))
    assert max(raw.values()) - min(raw.values()) > 0.01  # the documents score apart

    for i in (0, 3):  # one document a request: llama-server's numbers
        one = daemon.http.post("/v1/rerank", json={"model": RERANK, "query": QUERY, "documents": [TEXTS[i]],
                                                   "raw_scores": True}).json()["results"][0]["relevance_score"]
        ref_one = llama_rerank.post("/v1/rerank", json={"query": QUERY, "documents": [TEXTS[i]]}).json()
        assert abs(one - ref_one["results"][0]["relevance_score"]) < EXACT
    r = daemon.http.post("/v1/rerank", json={"model": RERANK, "query": QUERY, "documents": TEXTS})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == f"{RERANK}:latest" and body["object"] == "list" and body["id"].startswith("rerank-")
    assert body["usage"] == ref["usage"]  # the same pairs, token for token
    res = body["results"]
    assert [x["index"] for x in res] == [x["index"] for x in ref["results"]]  # best first, as llama-server sorts
    for x in res:  # relevance: the sigmoid of the classifier's logit, as vLLM, TEI and sentence-transformers give it
        assert abs(x["relevance_score"] - _sigmoid(raw[x["index"]])) < TOL
        assert x["document"] == {"text": TEXTS[x["index"]]}
    assert [x["relevance_score"] for x in res] == sorted((x["relevance_score"] for x in res), reverse=True)

    # raw_scores: the logits, llama-server's numbers; top_n; no documents; the other paths and Cohere's objects
    r = daemon.http.post("/rerank", json={"model": RERANK, "query": QUERY, "documents": [{"text": t} for t in TEXTS],
                                          "top_n": 2, "return_documents": False, "raw_scores": True}).json()
    assert [x["index"] for x in r["results"]] == [x["index"] for x in ref["results"]][:2]
    assert all(abs(x["relevance_score"] - raw[x["index"]]) < TOL and "document" not in x for x in r["results"])
    for path in ("/v2/rerank", "/v1/reranking", "/reranking"):
        assert daemon.http.post(path, json={"model": RERANK, "query": QUERY, "documents": TEXTS[:2]}).status_code == 200
    # TEI: "texts", a bare list of {"index", "score"} (+ "text" with return_text)
    tei = daemon.http.post("/rerank", json={"model": RERANK, "query": QUERY, "texts": TEXTS, "return_text": True}).json()
    assert isinstance(tei, list) and [x["index"] for x in tei] == [x["index"] for x in res]
    assert all(abs(x["score"] - _sigmoid(raw[x["index"]])) < TOL and x["text"] == TEXTS[x["index"]] for x in tei)

    # more documents than one call to the runner scores (RERANK_GROUP): the same scores, in order
    from localrun.server.generation_service import RERANK_GROUP

    many = TEXTS * (RERANK_GROUP // len(TEXTS) + 2)
    r = daemon.http.post("/v1/rerank", json={"model": RERANK, "query": QUERY, "documents": many, "raw_scores": True})
    assert all(abs(x["relevance_score"] - raw[x["index"] % len(TEXTS)]) < TOL for x in r.json()["results"])


@pytest.fixture(scope="module")
def llama_rerank_templated(llama_server_bin, xlmr_ggufs):
    with _server(llama_server_bin, xlmr_ggufs[2], "--reranking") as h:
        yield h


def test_a_rerank_template_lays_the_pairs_out_as_llama_server_does(daemon, llama_rerank_templated):
    """A reranker whose GGUF has a rerank template (Qwen3-Reranker's way: tests/xlmr_model.RERANK_TEMPLATE) has each
    pair laid out by it, as llama-server does: the same tokens and scores; a long document is cut to the window."""
    from xlmr_model import RERANK_TEMPLATE

    h = llama_rerank_templated
    for doc in TEXTS[:3]:
        ours = daemon.http.post("/v1/rerank", json={"model": TEMPLATED, "query": QUERY, "documents": [doc],
                                                    "raw_scores": True}).json()
        ref = h.post("/v1/rerank", json={"query": QUERY, "documents": [doc]}).json()
        assert ours["usage"] == ref["usage"], (ours, ref)
        text = RERANK_TEMPLATE.replace("{query}", QUERY).replace("{document}", doc)
        assert ours["usage"]["prompt_tokens"] == len(h.post("/tokenize", json={"content": text, "parse_special": True})
                                                     .json()["tokens"])
        assert abs(ours["results"][0]["relevance_score"] - ref["results"][0]["relevance_score"]) < EXACT
    # the template was used: the plain layout of the same pair has other tokens
    plain = daemon.http.post("/v1/rerank", json={"model": RERANK, "query": QUERY, "documents": [TEXTS[2]]}).json()
    assert plain["usage"]["prompt_tokens"] != ours["usage"]["prompt_tokens"], (plain["usage"], ours["usage"])
    long_doc = "the cat sat on the mat and " * 200
    r = daemon.http.post("/v1/rerank", json={"model": TEMPLATED, "query": QUERY, "documents": [long_doc]})
    assert r.status_code == 400 and "longer than the reranking window of 512 tokens" in r.text, r.text
    r = daemon.http.post("/v1/rerank", json={"model": TEMPLATED, "query": QUERY, "documents": [long_doc],
                                             "truncate": True})
    assert r.status_code == 200 and 500 <= r.json()["usage"]["prompt_tokens"] <= N_CTX, r.text


def test_a_pair_over_the_window_is_a_400_or_cut_with_truncate(daemon, llama_rerank):
    long_doc = "the cat sat on the mat and " * 200  # ~2,000 tokens against a 512-token window
    r = daemon.http.post("/v1/rerank", json={"model": RERANK, "query": QUERY, "documents": [TEXTS[0], long_doc]})
    assert r.status_code == 400 and "reranking window of 512 tokens" in r.json()["error"]["message"], r.text
    assert "'truncate': true" in r.json()["error"]["message"]
    r = daemon.http.post("/v1/rerank", json={"model": RERANK, "query": QUERY, "documents": [TEXTS[0], long_doc],
                                             "truncate": True, "raw_scores": True})
    assert r.status_code == 200, r.text
    ref = llama_rerank.post("/v1/rerank", json={"query": QUERY, "documents": [TEXTS[0]]}).json()
    assert r.json()["usage"]["prompt_tokens"] == ref["usage"]["prompt_tokens"] + N_CTX
    first = next(x for x in r.json()["results"] if x["index"] == 0)
    assert abs(first["relevance_score"] - ref["results"][0]["relevance_score"]) < TOL
    cut = next(x for x in r.json()["results"] if x["index"] == 1)  # the first 512 tokens of the pair, as sent alone
    n_doc = N_CTX - (ref["usage"]["prompt_tokens"] - len(llama_rerank.post("/tokenize", json={"content": TEXTS[0]})
                                                          .json()["tokens"]))
    doc_ids = llama_rerank.post("/tokenize", json={"content": long_doc}).json()["tokens"][:n_doc]
    head = llama_rerank.post("/detokenize", json={"tokens": doc_ids}).json()["content"]
    alone = daemon.http.post("/v1/rerank", json={"model": RERANK, "query": QUERY, "documents": [head],
                                                 "raw_scores": True}).json()
    assert alone["usage"]["prompt_tokens"] == N_CTX
    assert abs(alone["results"][0]["relevance_score"] - cut["relevance_score"]) < TOL


@pytest.mark.parametrize("path,body", [
    ("/api/chat", {"messages": [{"role": "user", "content": "hi"}], "stream": False}),
    ("/api/generate", {"prompt": "hi", "stream": False}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/completions", {"prompt": "hi"}),
    ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}),
])
def test_generating_with_a_pooling_model_is_a_400_before_any_load(daemon, path, body):
    daemon.http.post("/api/generate", json={"model": EMBED, "keep_alive": 0})  # unloaded, if loaded
    daemon.http.post("/api/generate", json={"model": RERANK, "keep_alive": 0})
    for model, where in ((EMBED, "/api/embed or /v1/embeddings"), (RERANK, "POST /v1/rerank")):
        r = daemon.http.post(path, json={"model": model, **body})
        assert r.status_code == 400, r.text
        text = r.text
        assert f'\\"{model}:latest\\" does not support' in text and where in text, text
    assert not {m["name"] for m in daemon.ps()} & {f"{EMBED}:latest", f"{RERANK}:latest"}


@pytest.mark.parametrize("path,body,message", [
    ("/v1/embeddings", {"model": RERANK, "input": "x"}, "does not support embeddings: it is a reranker"),
    ("/api/embed", {"model": RERANK, "input": "x"}, "does not support embeddings: it is a reranker"),
    ("/v1/rerank", {"model": EMBED, "query": "q", "documents": ["d"]}, "does not support reranking: it is an "
                                                                        "embedding model"),
    ("/v1/rerank", {"model": MODEL, "query": "q", "documents": ["d"]}, "it is a text generation model"),
    ("/v1/rerank", {"model": RERANK, "documents": ["d"]}, "'query' must be a non-empty string"),
    ("/v1/rerank", {"model": RERANK, "query": "q", "documents": []}, "'documents' must be a non-empty array"),
    ("/v1/rerank", {"model": RERANK, "query": "q"}, "'documents' must be a non-empty array"),
    ("/v1/rerank", {"model": RERANK, "query": "q", "documents": ["a", 3]}, "'documents[1]' must be a string"),
    ("/v1/rerank", {"model": RERANK, "query": "q", "documents": ["a"] * 1025}, "the limit is 1024"),
    ("/v1/rerank", {"model": RERANK, "query": "q", "documents": ["a"], "top_n": 0}, "top_n"),
    ("/v1/rerank", {"model": RERANK, "query": "the cat sat " * 300, "documents": ["a"] * 64, "truncate": True},
     "the query is"),
    ("/v1/rerank", {"model": "nope", "query": "q", "documents": ["a"]}, "nope"),
])
def test_bad_pooling_requests_are_clear_4xx(daemon, path, body, message):
    r = daemon.http.post(path, json=body)
    assert 400 <= r.status_code < 500 and message in r.text, r.text


def test_show_tags_and_ps_describe_them(daemon):
    show = daemon.http.post("/api/show", json={"model": RERANK}).json()
    assert show["capabilities"] == ["rerank"]
    assert daemon.http.post("/api/show", json={"model": EMBED}).json()["capabilities"] == ["embedding"]
    tags = {m["name"]: m for m in daemon.http.get("/api/tags").json()["models"]}
    assert set(tags) >= {f"{EMBED}:latest", f"{RERANK}:latest", MODEL}
    daemon.http.post("/v1/rerank", json={"model": RERANK, "query": "q", "documents": ["d"]})
    daemon.http.post("/api/embed", json={"model": EMBED, "input": "d"})
    ps = {m["name"]: m for m in daemon.ps()}
    for name in (EMBED, RERANK):
        m = ps[f"{name}:latest"]
        # one pooling context of the model's trained window (1,024 asked), no decoding KV cache: a few MB
        assert m["context_length"] == N_CTX and m["backend"] == "llama.cpp", m
        assert m["size"] < 64 * 2**20, m
    cli = subprocess.run([sys.executable, "-m", "localrun", "list"], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "LOCALRUN_HOST": daemon.url.removeprefix("http://")})
    assert cli.returncode == 0 and any(line.startswith(f"{RERANK}:latest") and line.rstrip().endswith("rerank")
                                       for line in cli.stdout.splitlines()), cli.stdout


def _cli(daemon, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "localrun", "--no-autostart", *args], capture_output=True, text=True,
                          timeout=120, stdin=subprocess.DEVNULL,
                          env={**os.environ, "LOCALRUN_HOST": daemon.url.removeprefix("http://")})


def test_cli_run_prints_an_embedding_as_ollama_run_does(daemon):
    r = _cli(daemon, "run", EMBED, TEXTS[1])
    assert r.returncode == 0, r.stderr
    vector = json.loads(r.stdout)
    ref = daemon.http.post("/api/embed", json={"model": EMBED, "input": TEXTS[1]}).json()["embeddings"][0]
    assert vector == ref
    r = _cli(daemon, "run", EMBED, "--dimensions", "4", TEXTS[1])
    assert r.returncode == 0 and len(json.loads(r.stdout)) == 4
    r = _cli(daemon, "run", EMBED)
    assert r.returncode == 1 and "embedding models require input text" in r.stderr
    r = _cli(daemon, "run", EMBED, "--truncate=false", "the cat sat on the mat " * 200)
    assert r.returncode == 1 and "longer than the embedding window of 512 tokens" in r.stderr, r.stderr
    r = _cli(daemon, "run", RERANK, "hi")
    assert r.returncode == 1 and "is a reranker" in r.stderr and "/v1/rerank" in r.stderr


def test_use_mmap_false_reads_the_weights_instead_of_mapping_them(daemon):
    """PARAMETER use_mmap false (Ollama's) loads the weights into memory, in the generating backend and in a pooling
    one: the runner maps no model file. With the default, the file is mapped."""
    import time

    def unload_all() -> None:
        for m in daemon.ps():
            daemon.http.post("/api/generate", json={"model": m["name"], "keep_alive": 0})
        deadline = time.monotonic() + 30
        while daemon.runners() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not daemon.runners()

    def mapped_blobs() -> set[str]:
        out = set()
        for runner in daemon.runners():
            with open(f"/proc/{runner.pid}/maps") as f:
                out |= {line.split()[-1] for line in f if "/blobs/" in line}
        return out

    for base, path, body in ((MODEL, "/api/generate", {"prompt": "hi", "stream": False, "options": {"num_predict": 1}}),
                             (EMBED, "/api/embed", {"input": "hi"})):
        r = daemon.http.post("/api/create", json={"model": "nommap", "from": base, "parameters": {"use_mmap": False},
                                                  "stream": False})
        assert r.status_code == 200, r.text
        assert "PARAMETER use_mmap false" in daemon.http.post("/api/show", json={"model": "nommap"}).json()["modelfile"]
        for name in (base, "nommap"):
            unload_all()
            r = daemon.http.post(path, json={"model": name, **body})
            assert r.status_code == 200, r.text
            blobs = mapped_blobs()
            assert bool(blobs) == (name == base), (name, blobs)
        unload_all()
        assert daemon.http.request("DELETE", "/api/delete", json={"model": "nommap"}).status_code == 200


@pytest.mark.parametrize("which", [0, 1], ids=["embed", "rerank"])
def test_bench_embed_runs_both_servers_on_the_same_inputs(which, llama_server_bin, xlmr_ggufs, tmp_path):
    """`localrun bench embed` (short): both servers answer the same batch with the same numbers (the first round's
    largest difference), and it prints and writes the speed ratios."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOCALRUN_")}
    out = tmp_path / "embed.json"
    r = subprocess.run([sys.executable, "-m", "localrun.bench", "embed", "--llama-server", str(llama_server_bin),
                        "--gguf", str(xlmr_ggufs[which]), "--texts", "6", "--tokens", "24", "--singles", "3",
                        "--rounds", "2", "--out", str(out)], env=env, cwd=tmp_path, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["kind"] == ("embed", "rerank")[which]
    assert res["max_diff_first_round"] < TOL  # the same inputs, the same numbers (batch arithmetic aside)
    for w in ("batch", "single"):
        assert res["summary"][w]["speed"] > 0 and len(res["rounds_s"][w]["localrun"]) == 2
    assert "localrun vs llama-server" in r.stdout and "speed" in r.stdout
