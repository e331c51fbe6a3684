"""llama-server's own completion route (POST /completion and /completions) and GET /props, against the real daemon
and llama.cpp's own llama-server on the bundled SmolLM2: the same greedy answers token by token (up to a near tie
that llama.cpp's batch-dependent arithmetic may flip), the same prompt counts and stop types, the same
completion_probabilities shape, streamed and not, several prompts in one request, token-id prompts, and a clear
400 in llama-server's error shape for what localrun does not take. Continue's llama.cpp provider is replayed as
its source sends it."""

from __future__ import annotations

import json

import httpx
import pytest
from daemon import MODEL, pulled_daemon

from localrun.bench.greedy import compare

pytestmark = pytest.mark.timeout(600)
pytest.importorskip("llama_cpp")

N_CTX = 2048
N = 12
CHATML = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
PROMPTS = [CHATML.format("What is the capital of France?"), "The three primary colors are",
           CHATML.format("Write a haiku about autumn leaves.")]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    with pulled_daemon(tmp_path_factory.mktemp("home_completion"), LOCALRUN_NUM_PARALLEL="2",
                       LOCALRUN_CONTEXT_LENGTH=str(N_CTX)) as d:
        yield d


@pytest.fixture(scope="module")
def llama_srv(llama_server_bin, smollm2_gguf):
    from llama_server import llama_server_client

    with llama_server_client(llama_server_bin, smollm2_gguf, N_CTX) as h:
        yield h


def _sse(r: httpx.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]


def _tokens(body: dict) -> list:
    """completion_probabilities as bench.greedy compares them: (text, logprob, [(text, logprob), ...])."""
    return [(x["token"], x["logprob"], [(t["token"], t["logprob"]) for t in x["top_logprobs"]])
            for x in body["completion_probabilities"]]


def _agree(reference: list, got: list) -> None:
    cmp = compare(reference, got)
    assert cmp.acceptable, cmp
    if cmp.verdict == "same":
        assert [t for t, _, _ in got] == [t for t, _, _ in reference]


def test_completion_is_llama_servers(daemon, llama_srv):
    """Greedy /completion with n_probs: the same tokens, prompt length and stop type as llama-server's, and
    each token's log-probability within 0.05 of its; the streamed text is the same as the whole answer."""
    verdicts = []
    for prompt in PROMPTS:
        body = {"prompt": prompt, "n_predict": N, "temperature": 0, "n_probs": 3}
        r = llama_srv.post("/completion", json={**body, "cache_prompt": False})
        assert r.status_code == 200, r.text
        truth = r.json()
        r = daemon.http.post("/completion", json=body)
        assert r.status_code == 200, r.text
        got = r.json()
        assert got["tokens_evaluated"] == truth["tokens_evaluated"], prompt
        ref, ours = _tokens(truth), _tokens(got)
        _agree(ref, ours)
        verdicts.append(compare(ref, ours).verdict)
        if verdicts[-1] == "same":
            assert got["content"] == truth["content"] and got["stop_type"] == truth["stop_type"]
            assert [[t["id"] for t in x["top_logprobs"]] for x in got["completion_probabilities"]] == \
                [[t["id"] for t in x["top_logprobs"]] for x in truth["completion_probabilities"]]
            assert max(abs(a[1] - b[1]) for a, b in zip(ref, ours)) < 0.05
        assert got["content"] == "".join(t for t, _, _ in ours)
        assert set(truth) - {"id_slot", "tokens"} <= set(got) | {"generation_settings"}, set(truth) - set(got)
        assert got["stop"] is True and got["model"] == MODEL
        assert got["generation_settings"]["n_predict"] == N and got["generation_settings"]["n_probs"] == 3
        assert got["timings"]["predicted_n"] == got["tokens_predicted"] == len(ours)
        # streamed: each data line a chunk of the same answer, the last one stop: true with the counts
        with daemon.http.stream("POST", "/completion", json={**body, "stream": True}) as s:
            assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
            events = _sse(s)
        assert "".join(e["content"] for e in events) == got["content"]
        assert events[-1]["stop"] is True and all(e["stop"] is False for e in events[:-1])
        assert events[-1]["tokens_predicted"] == got["tokens_predicted"]
        streamed = [p for e in events[:-1] for p in e.get("completion_probabilities", [])]
        assert [p["token"] for p in streamed] == [t for t, _, _ in ours]
    assert "same" in verdicts, verdicts  # a near tie is rare: not every prompt meets one


def test_token_prompts_batches_and_alias(daemon):
    """A prompt as token ids answers as its text does; an array of prompts is an array of answers, each with its
    index; /completions is the same route; llama-server's max_tokens is n_predict; return_tokens gives the ids."""
    h = daemon.http
    text = PROMPTS[1]
    ids = h.post("/tokenize", json={"model": MODEL, "content": text}).json()["tokens"]
    one = h.post("/completion", json={"prompt": text, "n_predict": 8, "temperature": 0, "return_tokens": True}).json()
    by_ids = h.post("/completions", json={"prompt": ids, "max_tokens": 8, "temperature": 0}).json()
    assert by_ids["content"] == one["content"] and by_ids["tokens_predicted"] == 8 == one["tokens_predicted"]
    assert len(one["tokens"]) == 8
    assert h.post("/detokenize", json={"model": MODEL, "tokens": one["tokens"]}).json()["content"] == one["content"]
    many = h.post("/completion", json={"prompt": [text, ids, PROMPTS[0]], "n_predict": 8, "temperature": 0})
    assert many.status_code == 200, many.text
    arr = many.json()
    assert [a["index"] for a in arr] == [0, 1, 2]
    assert arr[0]["content"] == arr[1]["content"] == one["content"] != arr[2]["content"]
    # response_fields picks (nested) values, as llama-server's does
    r = h.post("/completion", json={"prompt": text, "n_predict": 4, "temperature": 0,
                                    "response_fields": ["content", "timings/predicted_n"]})
    assert r.json() == {"content": r.json()["content"], "timings/predicted_n": 4}
    # a grammar and a logit bias in llama-server's shapes reach the sampler
    r = h.post("/completion", json={"prompt": PROMPTS[0], "n_predict": 8, "temperature": 0,
                                    "grammar": 'root ::= "yes" | "no"'})
    assert r.status_code == 200, r.text
    assert r.json()["content"] in ("yes", "no")
    first = one["tokens"][0]
    r = h.post("/completion", json={"prompt": text, "n_predict": 2, "temperature": 0, "return_tokens": True,
                                    "logit_bias": [[first, False]]})
    assert r.status_code == 200, r.text
    assert r.json()["tokens"][0] != first


def test_ignore_eos_empty_and_long_prompts_are_llama_servers(daemon, llama_srv):
    """ignore_eos bans the end-of-generation tokens (llama-server's meaning: exactly n_predict tokens of text, no
    hidden special tokens); an empty prompt answers empty; a token-id prompt shows as text; a prompt that fills the
    window ends the answer with truncated: true; one over it is llama-server's exceed_context_size_error."""
    h = daemon.http
    body = {"prompt": CHATML.format("Say yes"), "n_predict": 16, "temperature": 0, "ignore_eos": True, "n_probs": 1,
            "return_tokens": True}
    truth = llama_srv.post("/completion", json={**body, "cache_prompt": False}).json()
    got = h.post("/completion", json=body).json()
    _agree(_tokens(truth), _tokens(got))
    assert got["tokens_predicted"] == 16 == truth["tokens_predicted"] and got["stop_type"] == "limit"
    eog = set(h.post("/tokenize", json={"content": "<|im_end|><|im_start|><|endoftext|>"}).json()["tokens"])
    assert not eog & set(got["tokens"]) and "<|im" not in got["content"]
    assert all(x["token"] for x in got["completion_probabilities"])  # no special token's empty text
    # an empty prompt: nothing evaluated, nothing generated (llama-server answers the same for this model)
    for server in (llama_srv, h):
        r = server.post("/completion", json={"prompt": "", "n_predict": 4})
        assert r.status_code == 200, r.text
        assert (r.json()["content"], r.json()["tokens_evaluated"], r.json()["stop_type"]) == ("", 0, "none")
    arr = h.post("/completion", json={"prompt": ["", "The sky is"], "n_predict": 2, "temperature": 0}).json()
    assert arr[0]["content"] == "" and arr[1]["content"] and arr[1]["index"] == 1
    with h.stream("POST", "/completion", json={"prompt": "", "stream": True}) as s:
        assert [e["stop"] for e in _sse(s)] == [True]
    # token ids: the answer shows the prompt as text, as llama-server does
    ids = h.post("/tokenize", json={"content": "Hello,"}).json()["tokens"]
    assert h.post("/completion", json={"prompt": ids, "n_predict": 1}).json()["prompt"] == "Hello," == \
        llama_srv.post("/completion", json={"prompt": ids, "n_predict": 1}).json()["prompt"]
    # a prompt that leaves 8 tokens of the window: the answer stops there, truncated
    long = h.post("/tokenize", json={"content": "The quick brown fox jumps over the lazy dog. " * 250}).json()["tokens"]
    body = {"prompt": long[:N_CTX - 8], "n_predict": 16, "temperature": 0}
    truth = llama_srv.post("/completion", json=body).json()
    got = h.post("/completion", json=body).json()
    assert (got["tokens_predicted"], got["truncated"]) == (truth["tokens_predicted"], truth["truncated"]) == (8, True)
    # over it: llama-server's error type and counts (the llama.cpp web UI reads them)
    for server in (llama_srv, h):
        r = server.post("/completion", json={"prompt": long[:N_CTX + 100], "n_predict": 4})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert (err["type"], err["n_prompt_tokens"], err["n_ctx"]) == ("exceed_context_size_error", N_CTX + 100, N_CTX)


def test_without_a_model_the_one_used_last(daemon):
    """llama-server's clients name no model: they get the loaded model used last (not a 400 once a second model
    was used)."""
    h = daemon.http
    r = h.post("/api/create", json={"model": "smolt", "from": MODEL, "parameters": {"temperature": 0.1},
                                    "stream": False})
    assert r.status_code == 200, r.text
    for name in ("smolt:latest", MODEL, "smolt:latest"):
        assert h.post("/completion", json={"model": name, "prompt": "Hi", "n_predict": 1}).status_code == 200
        assert h.post("/completion", json={"prompt": "Hi", "n_predict": 1}).json()["model"] == name
        assert h.get("/props").json()["model_alias"] == name
    assert h.get("/props", params={"model": MODEL}).json()["default_generation_settings"]["params"]["temperature"] \
        != h.get("/props", params={"model": "smolt"}).json()["default_generation_settings"]["params"]["temperature"]
    assert h.request("DELETE", "/api/delete", json={"model": "smolt"}).status_code == 200


@pytest.mark.parametrize("body, message", [
    ({}, '"prompt" is required'),
    ({"prompt": ["text", 12, 13]}, "mixes text and token ids"),
    ({"prompt": [PROMPTS[0], PROMPTS[1]], "stream": True}, "a stream takes one prompt"),
    ({"prompt": "hi", "post_sampling_probs": True}, '"post_sampling_probs" is not supported'),
    ({"prompt": "hi", "logit_bias": [[1, 500]]}, "bias from -100 to 100"),
    ({"prompt": "hi", "n_probs": 1000}, "n_probs"),
    ({"prompt": [[]]}, "the prompt is empty"),
    ({"prompt": "hi", "logit_bias": [["a", 1]]}, "[token id, bias]"),
])
def test_completion_bad_input_is_a_400_in_llama_servers_shape(daemon, body, message):
    r = daemon.http.post("/completion", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == 400 and err["type"] == "invalid_request_error" and message in err["message"], err


def test_props_is_llama_servers(daemon, llama_srv):
    """GET /props: the context a sequence gets, the parallel sequences, the chat template and BOS/EOS, in
    llama-server's keys."""
    truth = llama_srv.get("/props").json()
    r = daemon.http.get("/props")
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["default_generation_settings"]["n_ctx"] == N_CTX == truth["default_generation_settings"]["n_ctx"]
    assert got["total_slots"] == 2 and got["model_alias"] == MODEL
    assert "<|im_start|>" in got["chat_template"] and got["eos_token"] == truth["eos_token"]
    assert got["modalities"] == {"vision": False, "audio": False}
    assert {"default_generation_settings", "total_slots", "chat_template", "bos_token", "eos_token",
            "build_info", "modalities"} <= set(got) & set(truth)
    assert daemon.http.get("/props", params={"model": "nope:1"}).status_code == 404


def test_continue_llama_cpp_provider(daemon):
    """Continue's llama.cpp provider (core/llm/llms/LlamaCpp.ts) as it sends: POST {apiBase}completion with the
    rendered prompt, stream: true and its options; it reads each data line's "content"."""
    h = daemon.http
    body = {"prompt": PROMPTS[0], "stream": True, "n_predict": 16, "frequency_penalty": 0, "presence_penalty": 0,
            "min_p": 0.05, "mirostat": 0, "stop": ["<|im_end|>"], "top_k": 40, "top_p": 0.95, "temperature": 0,
            "cache_prompt": True}
    with h.stream("POST", "/completion", json=body, headers={"Content-Type": "application/json"}) as s:
        assert s.status_code == 200
        text = "".join(e.get("content", "") for e in _sse(s))
    assert "Paris" in text
