"""POST /tokenize and /detokenize, in llama-server's shape ({"content"} -> {"tokens"}; {"tokens"} ->
{"content"}) and vLLM's ({"prompt"} or {"messages"} -> {"tokens", "count", "max_model_len"}; {"tokens"} ->
{"prompt"}): the real daemon over HTTP, the real llama.cpp and SmolLM2, checked against llama.cpp's own
tokenizer called directly and against the prompt a chat completion reports."""

from __future__ import annotations

import pytest

from daemon import MODEL, Daemon

pytest.importorskip("llama_cpp")

TEXT = "Hello world! Tokenizers split <|im_start|> text like this: naïve café, 1234."


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("tokenize-home"), LOCALRUN_CONTEXT_LENGTH="1024", LOCALRUN_NUM_PARALLEL="1")
    d.pull()
    yield d
    d.stop()


@pytest.fixture(scope="module")
def vocab(smollm2_gguf):
    import llama_cpp

    return llama_cpp.Llama(model_path=str(smollm2_gguf), vocab_only=True, verbose=False)


def test_tokenize_matches_llama_cpp_and_detokenize_round_trips(daemon, vocab):
    r = daemon.http.post("/tokenize", json={"model": MODEL, "content": TEXT})
    assert r.status_code == 200, r.text
    body = r.json()
    # llama-server: no BOS unless add_special, special tokens parsed
    assert body["tokens"] == vocab.tokenize(TEXT.encode(), add_bos=False, special=True)
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 1024 and body["model"] == MODEL
    # vLLM's prompt: add_special_tokens as asked
    for special in (True, False):
        r = daemon.http.post("/tokenize", json={"model": MODEL, "prompt": TEXT, "add_special_tokens": special})
        assert r.json()["tokens"] == vocab.tokenize(TEXT.encode(), add_bos=special, special=True), r.text
    d = daemon.http.post("/detokenize", json={"model": MODEL, "tokens": body["tokens"]})
    assert d.status_code == 200, d.text
    assert d.json()["content"] == d.json()["prompt"] == TEXT


def test_tokenize_messages_counts_what_a_chat_completion_reports(daemon):
    messages = [{"role": "system", "content": "You answer in one word."},
                {"role": "user", "content": "What colour is the sky on a clear day?"}]
    t = daemon.http.post("/tokenize", json={"model": MODEL, "messages": messages})
    assert t.status_code == 200, t.text
    c = daemon.http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 1})
    assert c.status_code == 200, c.text
    assert t.json()["count"] == c.json()["usage"]["prompt_tokens"] > 10
    # the same text through the chat template, tokenized as a raw prompt, gives the same ids
    im_start = daemon.http.post("/tokenize", json={"model": MODEL, "content": "<|im_start|>"}).json()["tokens"]
    assert len(im_start) == 1 and t.json()["tokens"].count(im_start[0]) == 3  # system, user, the assistant's turn


def test_without_a_model_the_one_loaded_is_used(daemon):
    daemon.http.post("/tokenize", json={"model": MODEL, "content": "warm"})
    r = daemon.http.post("/tokenize", json={"content": "no model named"})
    assert r.status_code == 200 and r.json()["model"] == MODEL, r.text


@pytest.mark.parametrize("path,body,words", [
    ("/tokenize", {}, "send one of 'content'"),
    ("/tokenize", {"content": "a", "prompt": "b"}, "not 'content' and 'prompt'"),
    ("/tokenize", {"prompt": 12}, "'prompt' must be a string"),
    ("/tokenize", {"content": "a", "with_pieces": True}, "with_pieces"),
    ("/tokenize", {"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": False},
     "add_generation_prompt"),
    ("/tokenize", {"messages": "hi"}, "messages"),
    ("/tokenize", {"content": "x" * 200_000}, "context window"),
    ("/detokenize", {"tokens": "1 2 3"}, "array of token ids"),
    ("/detokenize", {"tokens": [1, True]}, "array of token ids"),
    ("/detokenize", {"tokens": [1, 10_000_000]}, "not in this model's vocabulary of 49152"),
    ("/detokenize", {"tokens": [-1]}, "not in this model's vocabulary"),
])
def test_bad_input_is_a_400_and_the_runner_lives_on(daemon, path, body, words):
    r = daemon.http.post(path, json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert words in err["message"] and err["type"] == "invalid_request_error", err
    # the runner that refused it still answers (an id outside the vocabulary would have killed it)
    ok = daemon.http.post("/detokenize", json={"model": MODEL, "tokens": [28, 29]})
    assert ok.status_code == 200 and ok.json()["content"], ok.text


def test_an_unknown_model_is_a_404(daemon):
    r = daemon.http.post("/detokenize", json={"model": "no-such-model", "tokens": [1]})
    assert r.status_code == 404 and "no-such-model" in r.json()["error"]["message"], r.text


def test_a_prompt_of_token_ids_answers_as_its_text_does(daemon):
    """OpenAI completions' other prompt form (an array of token ids; vLLM takes it, /tokenize gives it):
    greedy, the same answer as the text; an id outside the vocabulary is a 400 and the runner lives on."""
    from openai import BadRequestError, OpenAI

    client = OpenAI(base_url=daemon.url + "/v1", api_key="x", max_retries=0)
    text = "The capital of France is"
    ids = daemon.http.post("/tokenize", json={"model": MODEL, "prompt": text}).json()["tokens"]
    by_text = client.completions.create(model=MODEL, prompt=text, max_tokens=8, temperature=0)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text and by_text.choices[0].text.strip()
    assert by_ids.usage.prompt_tokens == len(ids) == by_text.usage.prompt_tokens
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=[ids], max_tokens=8, temperature=0, stream=True) if c.choices)
    assert streamed == by_text.choices[0].text
    for bad, words in (([1, 10_000_000], "not in this model's vocabulary"), ([], "array of token ids"),
                       ([1, "2"], "array of token ids")):
        with pytest.raises(BadRequestError) as e:
            client.completions.create(model=MODEL, prompt=bad, max_tokens=4)
        assert words in str(e.value), e.value
    echoed = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0, echo=True)
    assert echoed.choices[0].text == text + by_text.choices[0].text  # the ids' text, then the answer
    with pytest.raises(BadRequestError) as e:  # longer than the window
        client.completions.create(model=MODEL, prompt=[28] * 2000, max_tokens=4)
    assert "context window" in str(e.value)
    assert client.completions.create(model=MODEL, prompt=ids, max_tokens=2).choices[0].text  # still serving


def test_without_a_model_and_no_single_choice_the_400_says_to_name_one(daemon):
    assert daemon.http.post("/api/copy", json={"source": MODEL, "destination": "other-tok"}).status_code == 200
    try:
        daemon.http.post("/api/generate", json={"model": MODEL, "keep_alive": 0})  # nothing loaded now
        daemon.wait_ps(lambda ms: not ms)
        r = daemon.http.post("/tokenize", json={"content": "hi"})
        assert r.status_code == 400 and "name one, the one whose tokens you want" in r.json()["error"]["message"], r.text
    finally:
        daemon.http.request("DELETE", "/api/delete", json={"model": "other-tok"})


def test_counting_tokens_does_not_wait_behind_a_running_stream(daemon):
    """One generation slot (NUM_PARALLEL=1), taken by a long stream: /tokenize, /detokenize and
    Anthropic's count_tokens answer at once, while the stream goes on (an agent counts its context while
    another request of its runs); they took a generation slot and waited for the stream to end."""
    import threading
    import time

    import httpx

    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 600, "temperature": 0, "ignore_eos": True,
            "stream": True}
    started, finished = threading.Event(), threading.Event()

    def stream():
        with httpx.stream("POST", daemon.url + "/v1/completions", json=body, timeout=300) as r:
            for n, _ in enumerate(r.iter_lines()):
                if n == 3:
                    started.set()
        finished.set()

    t = threading.Thread(target=stream)
    t.start()
    try:
        assert started.wait(60)
        t0 = time.monotonic()
        assert daemon.http.post("/tokenize", json={"model": MODEL, "content": "hello"}).status_code == 200
        assert daemon.http.post("/detokenize", json={"model": MODEL, "tokens": [28, 29]}).status_code == 200
        r = daemon.http.post("/v1/messages/count_tokens", json={"model": MODEL, "messages": [
            {"role": "user", "content": "hello"}]})
        assert r.status_code == 200 and r.json()["input_tokens"] > 0, r.text
        took = time.monotonic() - t0
        assert not finished.is_set(), "the stream ended first: nothing was measured"
        assert took < 3.0, f"token counts took {took:.1f} s beside a running stream"
    finally:
        t.join(120)
