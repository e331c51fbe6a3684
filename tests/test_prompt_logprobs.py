"""Scoring a prompt: each prompt token's logprob (OpenAI completions' `echo` with `logprobs`, `max_tokens`
0 or 1), batches of prompts in one completions request, and vLLM's /tokenizer_info: what lm-eval's
`local-completions` model needs for its loglikelihood tasks (multiple choice: MMLU, HellaSwag, ARC...).

The real llama.cpp and SmolLM2, checked against llama.cpp called directly (every position's logits, one
pass); the real daemon over HTTP with the openai SDK; and the real lm-eval CLI on a local task, its
per-choice loglikelihoods checked against the same direct computation.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys

import pytest
from daemon import MODEL, Daemon
from llama_backend import smollm2_backend

from localrun.backends.base import GenerationRequest, SamplingOptions
from localrun.bench.kv_quant import llamacpp_logprobs

pytestmark = pytest.mark.timeout(600)

pytest.importorskip("llama_cpp")

# ~330 tokens: the prompt's logprobs are computed over several steps (prompt_logprobs_rows tokens each)
LONG = ("The quick brown fox jumps over the lazy dog. " * 12 + "Water boils at one hundred degrees Celsius at sea "
        "level, and it freezes at zero. " * 8 + "The capital of France is")
TOL = 2e-3  # nats: llama.cpp's arithmetic differs slightly with how a batch is cut (here: bit-equal)


@pytest.fixture(scope="module")
def backend(smollm2_gguf):
    b = smollm2_backend(smollm2_gguf, 1024, 3)
    yield b
    asyncio.run(b.close())


async def _run(backend, ids: list[int], **opts):
    o = SamplingOptions(**{"temperature": 0.0, **opts})
    chunks = [c async for c in backend.generate(GenerationRequest(prompt="", options=o, prompt_token_ids=ids))]
    return chunks


def test_prompt_logprobs_equal_llama_cpp_directly_and_beside_other_streams(backend, smollm2_gguf):
    """Every prompt token's logprob (the first has none) as llama.cpp computes it directly, fed in the
    same chunks; the greedy top-1 alternative is the argmax; the cache is not used for a scored prompt (it
    keeps no logits); max_tokens 0 generates nothing. Beside two decoding streams the values move only
    as llama.cpp's batch-dependent arithmetic moves them (measured on SmolLM2: mean 0.007 nats, max
    0.13; llama.cpp alone, fed 512 tokens a pass instead of 128, moves positions 256-259 by 0.14)."""
    from localrun.backends.llamacpp.batch import prompt_logprobs_rows

    rows = prompt_logprobs_rows(backend.engine.n_vocab)
    assert rows == 128  # SmolLM2's 49k vocabulary: 25 MB of logits a step
    ids = asyncio.run(backend.tokenize(LONG))
    assert len(ids) > 2 * rows
    ref = llamacpp_logprobs(smollm2_gguf, "f16", ids, rows, 2)

    async def main():
        await _run(backend, ids, max_tokens=4)  # the same prompt, now cached
        alone = await _run(backend, ids, max_tokens=0, prompt_logprobs=1)
        others = [asyncio.ensure_future(_run(backend, other, max_tokens=60, ignore_eos=True))
                  for other in (await backend.tokenize("Once upon a time"), await backend.tokenize("Hello"))]
        await asyncio.sleep(0.3)  # they are decoding
        beside = await _run(backend, ids, max_tokens=0, prompt_logprobs=1)
        generated = await _run(backend, ids, max_tokens=3, prompt_logprobs=0, logprobs=True)
        await asyncio.gather(*others)
        plain = await _run(backend, ids, max_tokens=3)
        return alone, beside, generated, plain

    alone, beside, generated, plain = asyncio.run(main())
    assert len(alone) == 1 and alone[0].finish_reason == "length" and not alone[0].token_ids
    assert alone[0].usage.completion_tokens == 0 and alone[0].usage.cached_tokens == 0
    lps = alone[0].prompt_logprobs
    assert len(lps) == len(ids) and lps[0].logprob is None and not lps[0].top
    assert "".join(x.token for x in lps) == LONG
    assert max(abs(x.logprob - r) for x, r in zip(lps[1:], ref)) < 1e-6
    # top-1: the argmax; it equals the prompt token's own logprob exactly when the prompt token is it
    greedy_hits = 0
    for x in lps[1:]:
        (tok, best), = x.top
        assert best >= x.logprob - 1e-12
        greedy_hits += x.token == tok and best == x.logprob
    assert 0 < greedy_hits < len(ids) - 1
    # beside other streams: a row of theirs, or a neighbour's, would be off by nats, not hundredths
    moved = [abs(a.logprob - b.logprob) for a, b in zip(lps[1:], beside[0].prompt_logprobs[1:])]
    assert len(moved) == len(ids) - 1 and sum(moved) / len(moved) < 0.02 and max(moved) < 0.5, max(moved)
    # with generation: prompt logprobs on the first chunk only, and the same tokens as a plain request
    assert len(generated[0].prompt_logprobs) == len(ids)
    assert sum((c.token_ids for c in generated), []) == sum((c.token_ids for c in plain), [])
    assert all(c.prompt_logprobs is None for c in generated[1:])


def test_scored_prompts_that_share_a_context_reuse_its_logprobs(smollm2_gguf):
    """lm-eval scores each choice of a question as context + choice: the second choice on reuses the
    context's cells and the logprobs the first computed for them (cached_tokens says so), and gets
    exactly the numbers a fresh computation gives; stored logprobs with fewer alternatives than asked
    are not reused, with more they are cut to the number asked."""
    def fresh():
        return smollm2_backend(smollm2_gguf, 1024, 2)

    endings = [" Paris.", " London, a big city.", " Berlin", " a city in Europe"]
    b = fresh()
    try:
        prompts = [asyncio.run(b.tokenize(LONG + e)) for e in endings]
        shared = asyncio.run(b.tokenize(LONG))

        async def main():
            scored = [await _run(b, ids, max_tokens=1, prompt_logprobs=1) for ids in prompts]
            more = await _run(b, prompts[0], max_tokens=0, prompt_logprobs=3)  # asks for more alternatives
            fewer = await _run(b, prompts[1], max_tokens=0, prompt_logprobs=2)  # fewer than the 3 now stored
            return scored, more, fewer

        scored, more, fewer = asyncio.run(main())
    finally:
        asyncio.run(b.close())
    cached = [c[-1].usage.cached_tokens for c in scored]
    assert cached[0] == 0 and all(len(shared) - 8 <= n < len(shared) for n in cached[1:]), cached
    assert more[0].usage.cached_tokens == 0 and fewer[0].usage.cached_tokens > len(shared) - 8
    assert all(len(x.top) == 2 for x in fewer[0].prompt_logprobs[1:])
    for ids, got in zip(prompts, scored):
        b = fresh()
        try:
            want = asyncio.run(_run(b, ids, max_tokens=1, prompt_logprobs=1))[0].prompt_logprobs
        finally:
            asyncio.run(b.close())
        assert [(x.token, x.logprob, x.top) for x in got[0].prompt_logprobs] == \
            [(x.token, x.logprob, x.top) for x in want]


def test_a_scored_prompt_with_images_is_refused(backend):
    from localrun.errors import InvalidRequest

    async def main():
        o = SamplingOptions(max_tokens=0, prompt_logprobs=0)
        return [c async for c in backend.generate(GenerationRequest(prompt="<__media__> x", options=o,
                                                                    images=[b"\x89PNG"]))]

    with pytest.raises(InvalidRequest, match="images"):
        asyncio.run(main())


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("scoring-home"), LOCALRUN_CONTEXT_LENGTH="1024", LOCALRUN_NUM_PARALLEL="2")
    d.pull()
    yield d
    d.stop()


def test_echo_with_logprobs_through_the_openai_sdk(daemon, smollm2_gguf):
    """OpenAI's legacy shape: the prompt's tokens, then the generated ones; the first logprob and its
    top_logprobs null; text offsets into the echoed text; streamed, the echo chunk carries them."""
    from openai import OpenAI

    client = OpenAI(base_url=daemon.url + "/v1", api_key="x", max_retries=0)
    text = "The capital of France is Paris. The capital of Germany is"
    ids = daemon.http.post("/tokenize", json={"model": MODEL, "prompt": text}).json()["tokens"]
    ref = llamacpp_logprobs(smollm2_gguf, "f16", ids, 512, 2)

    r = client.completions.create(model=MODEL, prompt=text, echo=True, logprobs=2, max_tokens=0)
    ch = r.choices[0]
    assert ch.text == text and ch.finish_reason == "length" and r.usage.completion_tokens == 0
    lp = ch.logprobs
    assert "".join(lp.tokens) == text and len(lp.tokens) == len(ids) == r.usage.prompt_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert max(abs(a - b) for a, b in zip(lp.token_logprobs[1:], ref)) < TOL
    assert all(len(t) == 2 for t in lp.top_logprobs[1:])
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]

    g = client.completions.create(model=MODEL, prompt=text, echo=True, logprobs=1, max_tokens=3, temperature=0)
    plain = client.completions.create(model=MODEL, prompt=text, max_tokens=3, temperature=0)
    gl = g.choices[0].logprobs
    assert g.choices[0].text == text + plain.choices[0].text
    assert len(gl.tokens) == len(ids) + 3 and gl.token_logprobs[0] is None
    assert gl.token_logprobs[1:len(ids)] == pytest.approx(lp.token_logprobs[1:], abs=1e-9)
    assert "".join(gl.tokens[len(ids):]) == plain.choices[0].text

    # text offsets count from the prompt's start, echoed or not, streamed or not (as OpenAI and vLLM count them)
    assert gl.text_offset == [sum(len(t) for t in gl.tokens[:i]) for i in range(len(gl.tokens))]
    p = client.completions.create(model=MODEL, prompt=text, logprobs=1, max_tokens=3, temperature=0).choices[0]
    assert p.logprobs.tokens == gl.tokens[len(ids):]
    assert p.logprobs.text_offset == gl.text_offset[len(ids):] == [
        len(text) + sum(len(t) for t in p.logprobs.tokens[:i]) for i in range(3)]

    chunks = [c.choices[0] for c in client.completions.create(model=MODEL, prompt=text, echo=True, logprobs=1,
                                                              max_tokens=3, temperature=0, stream=True) if c.choices]
    assert chunks[0].text == text and chunks[0].logprobs.token_logprobs == gl.token_logprobs[:len(ids)]
    assert "".join(c.text for c in chunks) == g.choices[0].text
    assert [o for c in chunks if c.logprobs for o in c.logprobs.text_offset] == gl.text_offset
    chunks = [c.choices[0] for c in client.completions.create(model=MODEL, prompt=text, logprobs=1, max_tokens=3,
                                                              temperature=0, stream=True) if c.choices]
    assert [o for c in chunks if c.logprobs for o in c.logprobs.text_offset] == p.logprobs.text_offset

    # a prompt of token ids echoes their text
    t = client.completions.create(model=MODEL, prompt=ids, echo=True, logprobs=0, max_tokens=0)
    assert t.choices[0].text == text and t.choices[0].logprobs.token_logprobs == lp.token_logprobs


def test_a_batch_of_prompts_in_one_request(daemon):
    """An array of prompts (texts or token-id arrays): choice index = prompt x n + choice, each prompt's
    answer as it gets alone; usage summed. Bad batches are 400s naming the fault."""
    from openai import BadRequestError, OpenAI

    client = OpenAI(base_url=daemon.url + "/v1", api_key="x", max_retries=0)
    texts = ["The capital of France is", "Once upon a time", "1, 2, 3, 4,"]
    ids = daemon.http.post("/tokenize", json={"model": MODEL, "prompt": texts[1]}).json()["tokens"]
    alone = [client.completions.create(model=MODEL, prompt=t, max_tokens=6, temperature=0) for t in texts]
    batch = client.completions.create(model=MODEL, prompt=[texts[0], ids, texts[2]], max_tokens=6, temperature=0, n=2)
    assert [c.index for c in batch.choices] == list(range(6))
    for c in batch.choices:
        assert c.text == alone[c.index // 2].choices[0].text
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert batch.usage.completion_tokens == 2 * sum(a.usage.completion_tokens for a in alone)
    for bad, words in (({"prompt": texts, "stream": True}, "a stream takes one prompt"),
                       ({"prompt": ["ok", ""]}, "must not be empty"),
                       ({"prompt": ["ok", [1, 10_000_000]]}, "vocabulary"),
                       ({"prompt": ["x"] * 300}, "at most 256"),
                       ({"prompt": texts[0], "max_tokens": 0}, "0 only with 'echo'")):
        with pytest.raises(BadRequestError) as e:
            client.completions.create(model=MODEL, max_tokens=bad.pop("max_tokens", 2), **bad)
        assert words in str(e.value), e.value
    assert client.completions.create(model=MODEL, prompt=texts[0], max_tokens=2).choices[0].text  # still serving


def test_tokenizer_info_in_vllms_shape(daemon):
    r = daemon.http.get("/tokenizer_info")
    assert r.status_code == 200, r.text
    info = r.json()
    assert info["eos_token"] == "<|im_end|>" and info["model"] == MODEL and info["model_max_length"] == 1024
    assert "<|im_start|>" in info["chat_template"]
    eos = daemon.http.post("/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False}).json()
    assert eos["tokens"] == [2]  # one special token, as lm-eval's remote tokenizer takes eos_token_id
    assert daemon.http.get("/tokenizer_info", params={"model": "nope"}).status_code == 404


LM_EVAL_DOCS = [
    {"question": "The capital of France is", "choices": ["Paris", "London", "Berlin", "Madrid"], "answer": 0},
    {"question": "Water freezes at zero degrees", "choices": ["Celsius", "Kelvin", "bananas"], "answer": 0},
    {"question": "One, two, three, four,", "choices": ["five", "ten", "seven"], "answer": 0},
    {"question": "The opposite of hot is", "choices": ["cold", "warm", "loud"], "answer": 0},
]


def test_lm_eval_loglikelihood_and_generation_through_the_daemon(daemon, smollm2_gguf, tmp_path):
    """The real lm-eval CLI (`local-completions`, its default tokenizer backend: it finds /tokenizer_info and
    tokenizes through /tokenize) on a local multiple-choice task and a generation task: each choice's
    loglikelihood is what llama.cpp computes directly for the same tokens, and each generation is the
    daemon's own greedy answer to the same prompt, cut at the task's stop string."""
    pytest.importorskip("lm_eval")
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in LM_EVAL_DOCS))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    common = (f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
              "doc_to_text: \"{{question}}\"\n")
    (tasks / "lr_mc.yaml").write_text(
        "task: lr_mc\n" + common + "output_type: multiple_choice\ndoc_to_choice: \"{{choices}}\"\n"
        "doc_to_target: \"{{answer}}\"\nmetric_list:\n  - metric: acc\n")
    (tasks / "lr_gen.yaml").write_text(
        "task: lr_gen\n" + common + "output_type: generate_until\ndoc_to_target: \"{{choices[answer]}}\"\n"
        "generation_kwargs:\n  until: [\".\", \"\\n\"]\n  max_gen_toks: 12\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n")
    out = tmp_path / "out"
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1",
           "TOKENIZERS_PARALLELISM": "false", "OPENAI_API_KEY": "x"}
    cmd = [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args",
           f"model={MODEL},base_url={daemon.url}/v1/completions,num_concurrent=2,max_retries=1",
           "--tasks", "lr_mc,lr_gen", "--include_path", str(tasks), "--output_path", str(out), "--log_samples"]
    run = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, (run.stdout[-3000:], run.stderr[-5000:])
    assert "Using remote tokenizer backend" in run.stderr, run.stderr[-3000:]  # not a Hugging Face download

    def samples(task: str) -> list[dict]:
        found = sorted(out.rglob(f"samples_{task}_*.jsonl"))
        assert found, list(out.rglob("*"))
        return sorted((json.loads(x) for x in found[-1].read_text().splitlines()), key=lambda s: s["doc_id"])

    def tok(text: str) -> list[int]:
        return daemon.http.post("/tokenize", json={"model": MODEL, "prompt": text,
                                                  "add_special_tokens": False}).json()["tokens"]

    mc = samples("lr_mc")
    assert len(mc) == len(LM_EVAL_DOCS)
    for s, doc in zip(mc, LM_EVAL_DOCS):
        ctx = tok(doc["question"])
        for (ll, _greedy), choice in zip((r[0] for r in s["resps"]), doc["choices"]):
            whole = tok(doc["question"] + " " + choice)
            assert whole[:len(ctx)] == ctx
            ref = sum(llamacpp_logprobs(smollm2_gguf, "f16", whole, 512, 2)[len(ctx) - 1:])
            assert math.isclose(float(ll), ref, abs_tol=TOL * len(whole)), (doc, choice, ll, ref)
    from openai import OpenAI

    client = OpenAI(base_url=daemon.url + "/v1", api_key="x", max_retries=0)
    gen = samples("lr_gen")
    for s, doc in zip(gen, LM_EVAL_DOCS):
        mine = client.completions.create(model=MODEL, prompt=doc["question"], max_tokens=12, temperature=0,
                                         stop=[".", "\n"]).choices[0].text
        assert s["resps"][0][0] == mine, (doc, s["resps"], mine)


# -- the native engine (CPU here; the same code on CUDA) -------------------------------------------------
@pytest.mark.parametrize("overlap", [False, True])
def test_native_engine_scores_prompts_as_a_full_forward_does(smollm2_gguf, overlap):
    """The native engine's prompt logprobs equal a plain forward over the whole prompt (no KV cache,
    one pass): in 128-token chunks beside other sequences, with the same prompt already cached (a
    scored prompt is computed whole), with overlap scheduling (the scores reach the host a step later)
    and without; max_tokens 0 generates nothing; n > 1 members each get them."""
    import torch

    from localrun.engine.config import EngineConfig
    from localrun.engine.engine import LLMEngine
    from localrun.engine.sampler import SamplingParams

    eng = LLMEngine.from_gguf(smollm2_gguf, EngineConfig(device="cpu", dtype="float32", max_model_len=1024,
                                                         max_num_batched_tokens=128, overlap=overlap,
                                                         cuda_graphs=overlap))
    try:
        ids = eng.tokenizer.encode(LONG)
        with torch.inference_mode():
            lp = torch.log_softmax(eng.model.compute_logits(eng.runner.hidden_states([ids])[0]).float(), -1)
        ref = lp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].tolist()
        top2 = lp.topk(2, dim=-1)
        eng.generate([ids], SamplingParams(temperature=0, max_tokens=2))  # cached now
        scored, other, again = eng.generate(
            [ids, ids[:40], ids], [SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=2),
                                   SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                                   SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=0)])
        plain = eng.generate([ids], SamplingParams(temperature=0, max_tokens=3))[0]
        n2 = eng.generate([ids], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0), n=2)
    finally:
        eng.shutdown()
    assert scored.token_ids == [] and scored.finish_reason == "length" and scored.cached_tokens == 0
    pl = scored.prompt_logprobs
    assert len(pl) == len(ids) and pl[0] == (ids[0], None, [])
    assert [t for t, _, _ in pl] == ids
    assert max(abs(x[1] - r) for x, r in zip(pl[1:], ref)) < 1e-4
    for j, (_, _, top) in enumerate(pl[1:]):
        assert [t for t, _ in top] == top2.indices[j].tolist()
    assert again.token_ids == plain.token_ids and again.cached_tokens == 0 and other.completion_tokens == 30
    assert max(abs(a[1] - b[1]) for a, b in zip(pl[1:], again.prompt_logprobs[1:])) < 1e-4
    assert all(o.prompt_logprobs is not None and len(o.prompt_logprobs) == len(ids) and o.prompt_logprobs[-1][1]
               is not None for o in n2)


def test_native_backend_echo_with_logprobs_over_http(tmp_path):
    """The same OpenAI echo request as on llama.cpp, served by the native engine in its runner process."""
    from openai import OpenAI

    d = Daemon(tmp_path / "home", LOCALRUN_BACKEND="native", LOCALRUN_CONTEXT_LENGTH="512")
    try:
        d.pull()
        client = OpenAI(base_url=d.url + "/v1", api_key="x", max_retries=0, timeout=120)
        text = "The capital of France is Paris. The capital of Germany is"
        r = client.completions.create(model=MODEL, prompt=text, echo=True, logprobs=1, max_tokens=0)
        lp = r.choices[0].logprobs
        assert r.choices[0].text == text and "".join(lp.tokens) == text and r.usage.completion_tokens == 0
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert all(v <= 0 for v in lp.token_logprobs[1:]) and lp.token_logprobs[-1] > -1  # " is": expected
        g = client.completions.create(model=MODEL, prompt=text, echo=True, logprobs=1, max_tokens=2, temperature=0)
        gl = g.choices[0].logprobs.token_logprobs
        assert len(gl) == len(lp.tokens) + 2 and gl[0] is None
        assert gl[1:len(lp.tokens)] == pytest.approx(lp.token_logprobs[1:], abs=1e-3)
    finally:
        d.stop()
