"""Speculative decoding in the native engine (localrun.engine.speculative): prompt-lookup
drafts verified in one step must leave greedy and seeded outputs exactly as without them."""

from __future__ import annotations

import pytest

from localrun.templates.chat import render_chat
from localrun.engine import EngineConfig, LLMEngine, SamplingParams
from localrun.engine.config import ModelConfig
from localrun.engine.speculative import propose_ngram

TINY = ModelConfig(64, 2, 4, 2, 128, 300)
# repetitive prompts give the lookup something to find; the third is prefilled in chunks
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8] * 3, [9, 8, 7] * 5 + [1, 2], list(range(40)) + list(range(20))]


def _engine(mode: str, **kw) -> LLMEngine:
    cfg = dict(device="cpu", max_model_len=256, page_size=4, max_num_batched_tokens=16, speculative=mode)
    cfg.update(kw)
    return LLMEngine.from_random(TINY, EngineConfig(**cfg), seed=0)


def test_propose_ngram_most_recent_longest_match():
    toks = [5, 1, 2, 9, 9, 1, 2, 3, 4, 7, 1, 2]
    assert propose_ngram(toks, 3, 1, 3) == [3, 4, 7]  # "1 2" last seen at 5..6 (3 grams: no match)
    assert propose_ngram(toks, 2, 1, 3) == [3, 4]
    assert propose_ngram([1, 2, 3, 1, 2, 3], 5, 1, 3) == [1, 2, 3]  # "2 3" ... at 0..2 -> continues 1 2 3
    assert propose_ngram([1, 2, 3, 4], 4, 1, 3) == []  # nothing repeats
    assert propose_ngram([7, 7], 4, 1, 3) == [7]  # the suffix itself never counts as its own match
    assert propose_ngram([4, 1, 2, 3], 0, 1, 3) == []
    assert propose_ngram([1, 2, 8, 2], 2, 2, 3) == []  # min_n 2: a 1-gram match is not enough


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
    SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.01, seed=5, max_tokens=30, ignore_eos=True,
                   logprobs=2, repetition_penalty=1.1, frequency_penalty=0.2),
], ids=["greedy", "seeded-penalties-logprobs"])
def test_ngram_outputs_identical_to_plain_decoding(params):
    base = _engine("off").generate(PROMPTS, params)
    eng = _engine("ngram", num_speculative_tokens=5)
    outs = eng.generate(PROMPTS, params)
    for a, b in zip(base, outs):
        assert b.token_ids == a.token_ids
        assert b.finish_reason == a.finish_reason == "length"
        if a.logprobs:
            assert [(t, round(lp, 4)) for t, lp, _ in b.logprobs] == [(t, round(lp, 4)) for t, lp, _ in a.logprobs]
    st = eng.stats()
    assert st["speculative"] == "ngram" and st["spec_draft_tokens"] > 0
    # verification steps are decodes, not prefill: only the prompts count (nothing is preempted here)
    assert st["preemptions"] == 0 and st["prefill_tokens"] == sum(map(len, PROMPTS))
    if params.greedy:  # the random model repeats itself: the lookup pays
        assert st["spec_accepted_tokens"] > 0 and st["spec_tokens_per_row_step"] > 1.0
    # rolled-back drafts leave no page behind
    assert st["kv_pages_free"] + st["cached_pages"] == st["kv_pages_total"]


def test_ngram_respects_max_tokens_stop_ids_and_tiny_budgets():
    greedy = SamplingParams(temperature=0, max_tokens=23, ignore_eos=True)
    base = _engine("off").generate(PROMPTS, greedy)
    # budget 3 tokens a step: drafts are cut to fit (or dropped) and still verify right
    eng = _engine("ngram", num_speculative_tokens=8, max_num_batched_tokens=3)
    outs = eng.generate(PROMPTS, greedy)
    assert [o.token_ids for o in outs] == [o.token_ids for o in base]
    assert all(o.completion_tokens == 23 for o in outs)
    stop = base[0].token_ids[10]  # a stop token met inside an accepted draft ends the request there
    p = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[stop])
    a, b = _engine("off").generate(PROMPTS[:1], p)[0], _engine("ngram").generate(PROMPTS[:1], p)[0]
    assert b.token_ids == a.token_ids and b.finish_reason == "stop" and b.token_ids[-1] == stop


def test_speculative_config_errors():
    with pytest.raises(ValueError, match="off, ngram or draft"):
        EngineConfig(device="cpu", speculative="medusa")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineConfig(device="cpu", speculative="ngram", num_speculative_tokens=0)
    with pytest.raises(ValueError, match="ngram_min"):
        EngineConfig(device="cpu", speculative="ngram", ngram_min=3, ngram_max=2)
    with pytest.raises(ValueError, match="draft_model"):
        EngineConfig(device="cpu", speculative="draft")


def test_ngram_smollm2_greedy_identical(smollm2_gguf):
    """The real model, CPU fp32: a prompt that quotes a passage back gets drafts accepted, and
    the text is the same as the same engine's with its speculator detached (plain steps)."""
    passage = "The quick brown fox jumps over the lazy dog. The lazy dog sleeps in the warm sun."
    eng = LLMEngine.from_gguf(smollm2_gguf, EngineConfig(device="cpu", dtype="float32", max_model_len=256,
                                                         speculative="ngram"))
    tok = eng.tokenizer
    ids = tok.encode(render_chat(tok.chat_template, [{"role": "user",
                                                      "content": f"Repeat this text exactly:\n\n{passage}"}]))
    params = SamplingParams(temperature=0, max_tokens=20)
    spec = eng.generate([ids], params)[0]
    stats = eng.stats()
    eng.spec = None  # the plain step from here on
    plain = eng.generate([ids], params)[0]
    assert spec.token_ids == plain.token_ids and spec.text == plain.text
    assert stats["spec_acceptance_rate"] > 0.3, stats


def test_speculative_settings_and_modelfile(monkeypatch):
    from localrun.config import parse_speculative, settings, speculative_for_load
    from localrun.library.modelfile import parse_modelfile

    assert parse_speculative(None) == ("off", None) and parse_speculative("NGRAM") == ("ngram", None)
    assert parse_speculative("draft:/m/draft.gguf") == ("draft", "/m/draft.gguf")
    for bad in ("draft", "eagle", "ngram:3"):
        with pytest.raises(ValueError, match="LOCALRUN_SPECULATIVE must be off, ngram or draft:PATH"):
            parse_speculative(bad)
    s = settings({"LOCALRUN_SPECULATIVE": "ngram", "LOCALRUN_SPECULATIVE_TOKENS": "6"})
    assert (s.speculative, s.speculative_tokens) == ("ngram", 6)
    assert ("LOCALRUN_SPECULATIVE", "ngram") in s.describe() and ("LOCALRUN_SPECULATIVE_TOKENS", "6") in s.describe()
    with pytest.raises(ValueError, match="LOCALRUN_SPECULATIVE_TOKENS must be at most 32"):
        settings({"LOCALRUN_SPECULATIVE_TOKENS": "99"})
    mf = parse_modelfile("FROM x\nPARAMETER speculative ngram\nPARAMETER num_speculative_tokens 3\n")
    assert mf.parameters == {"speculative": "ngram", "num_speculative_tokens": 3}
    monkeypatch.setenv("LOCALRUN_SPECULATIVE", "off")
    assert speculative_for_load(mf.parameters) == ("ngram", None, 3)  # the Modelfile wins over the setting
    assert speculative_for_load({}) == ("off", None, 4)
    with pytest.raises(ValueError, match="PARAMETER speculative"):
        speculative_for_load({"speculative": "medusa"})


SMALL = ModelConfig(32, 1, 2, 1, 64, 300)  # another shape, the same vocabulary


@pytest.mark.parametrize("draft,expect_all", [(("random", TINY, 0), True), (("random", SMALL, 1), False)],
                         ids=["draft-is-target", "other-tiny-draft"])
def test_draft_model_outputs_identical_to_plain_decoding(draft, expect_all):
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    seeded = SamplingParams(temperature=0.8, top_k=20, seed=3, max_tokens=20, ignore_eos=True)
    plain = _engine("off")
    eng = _engine("draft", draft_model=draft, num_speculative_tokens=4)
    for params in (greedy, seeded):
        assert [o.token_ids for o in eng.generate(PROMPTS, params)] == \
            [o.token_ids for o in plain.generate(PROMPTS, params)]
        if params is greedy:
            st = eng.stats()
            assert st["spec_draft_tokens"] > 0
            if expect_all:  # the draft is the target: every greedy draft is accepted
                assert st["spec_acceptance_rate"] == 1.0 and st["spec_tokens_per_row_step"] > 3
    st = eng.stats()
    assert st["kv_pages_free"] + st["cached_pages"] == st["kv_pages_total"]


def test_draft_model_errors(tmp_path):
    with pytest.raises(ValueError, match="share the tokenizer"):
        _engine("draft", draft_model=("random", ModelConfig(32, 1, 2, 1, 64, 200), 0))
    with pytest.raises(ValueError, match="neither a GGUF file"):
        _engine("draft", draft_model=str(tmp_path / "missing.gguf"))


def test_bench_spec_runs_and_compares(capsys):
    """`localrun bench spec` at tiny sizes: both cases run, plain vs speculative texts compared."""
    import json

    from localrun.bench.cli import main as bench_main

    rc = bench_main(["spec", "--random-weights", "--shape", "tiny", "--requests", "2", "--batch", "3",
                     "--max-tokens", "8", "--rounds", "2", "--max-model-len", "256", "--no-save", "--json"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err[-2000:]
    res = json.loads(captured.out)
    for case, n in (("single", 2), ("batch", 3)):
        c = res[case]
        assert c["requests"] == n and c["identical"] is True
        assert len(c["off"]["elapsed_s"]) == len(c["spec"]["elapsed_s"]) == 2
        assert c["spec"]["output_tok_s_best"] > 0 and c["speedup_x"] > 0
    assert "speculative decoding" in captured.err


def test_metrics_report_speculation_from_engine_stats():
    pytest.importorskip("prometheus_client")
    from fakes import engine_metric_samples

    eng = _engine("ngram")
    eng.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    stats = eng.stats()
    samples = engine_metric_samples(stats)
    assert samples[("localrun_spec_tokens_total", (("kind", "drafted"), ("model", "m")))] == stats["spec_draft_tokens"]
    assert samples[("localrun_spec_tokens_total", (("kind", "accepted"), ("model", "m")))] == \
        stats["spec_accepted_tokens"] > 0
    assert samples[("localrun_spec_acceptance_rate", (("model", "m"),))] == pytest.approx(stats["spec_acceptance_rate"])
    assert samples[("localrun_spec_tokens_per_step", (("model", "m"),))] > 1.0


def test_usage_reports_drafts_per_request():
    import asyncio

    eng = _engine("ngram")

    async def run():
        eng.start()
        try:
            stream = eng.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
            return [d async for d in stream]
        finally:
            eng.shutdown()

    deltas = asyncio.run(run())
    usage = deltas[-1].usage
    assert usage["completion_tokens"] == 20 == sum(len(d.token_ids) for d in deltas)
    assert 0 < usage["spec_accepted_tokens"] <= usage["spec_draft_tokens"]


def test_drafts_fit_the_step_when_new_sequences_are_admitted():
    """max_num_seqs 4: two sequences decode with drafts, then two more arrive and are admitted in
    the same step; the step samples more rows (sequences + draft tokens) than max_num_seqs, and
    the step buffers must hold them (they are sized by the token budget when speculation is on)."""
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [PROMPTS[0], PROMPTS[1], [5, 6] * 6, [3, 1, 3, 1, 3]]
    base = _engine("off", max_num_seqs=4).generate(prompts, greedy)
    # a draft model (the target itself) drafts every step, so the drafts always claim the room
    eng = _engine("draft", draft_model=("random", TINY, 0), max_num_seqs=4, num_speculative_tokens=6,
                  max_num_batched_tokens=64)
    reqs = [eng._new_request(p, greedy, None) for p in prompts]
    eng._done = {}
    for r in reqs[:2]:
        eng._requests[r.seq.id] = r
        eng.scheduler.add(r.seq)
    for _ in range(2):  # prefill, then decodes with drafts
        eng.step()
    for r in reqs[2:]:
        eng._requests[r.seq.id] = r
        eng.scheduler.add(r.seq)
    while len(eng._done) < len(reqs):
        eng.step()
    assert [eng._output(r).token_ids for r in reqs] == [o.token_ids for o in base]
    assert eng.stats()["spec_accepted_tokens"] > 0


def test_llamacpp_prompt_lookup_same_greedy_text(smollm2_gguf):
    """llama.cpp: PARAMETER speculative ngram drafts tokens by prompt lookup in the batched loop;
    drafts are accepted and the greedy text is unchanged."""
    pytest.importorskip("llama_cpp")
    import asyncio

    from localrun.backends.base import GenerationRequest, LoadSpec, SamplingOptions
    from localrun.backends.llamacpp import LlamaCppBackend

    text = "Repeat exactly: the cat sat on the mat, and the dog sat on the log."
    prompt = f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
    opts = SamplingOptions(temperature=0.0, max_tokens=16)

    def answer(extra: dict) -> tuple[str, int, dict]:
        backend = LlamaCppBackend(LoadSpec("smollm2:135m", smollm2_gguf, "gguf", num_ctx=256, num_parallel=1,
                                           extra={"n_threads": 2, **extra}))

        async def run() -> tuple[str, dict]:
            text = "".join([ch.text async for ch in backend.generate(GenerationRequest(prompt=prompt, options=opts))])
            return text, await backend.stats()

        try:
            text, stats = asyncio.run(run())
            return text, backend.speculative, stats
        finally:
            asyncio.run(backend.close())

    plain, k_plain, stats_plain = answer({})
    spec, k, stats = answer({"speculative": "ngram", "num_speculative_tokens": 5})
    assert k_plain == 0 and stats_plain["spec_draft_tokens"] == 0
    assert k == 5 and stats["spec_accepted_tokens"] > 0 and stats["steps"] < stats_plain["steps"]
    assert spec == plain and "cat sat on the mat" in spec


def test_ngram_with_n_choices_and_running_drafts_equals_plain():
    """n > 1: a group forks (page copies, followers on the leader's logits) in a step that also
    verifies another sequence's draft; seeded choices equal plain decoding's."""
    params = [SamplingParams(temperature=0.9, seed=100 + i, max_tokens=12, ignore_eos=True) for i in range(3)]
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    prompt = [7, 3, 9, 4, 2, 8, 6, 1, 5, 10, 11]  # not a multiple of the page size: a partial page is copied

    def run(eng):
        reqs = [eng._new_request(PROMPTS[0], greedy, None)]
        eng._done = {}
        eng._requests[reqs[0].seq.id] = reqs[0]
        eng.scheduler.add(reqs[0].seq)
        eng.step()
        eng.step()  # PROMPTS[0] decodes (with drafts when speculative) when the group arrives
        outs = eng.generate([prompt], params, n=3)
        while reqs[0].seq.id not in eng._done:
            eng.step()
        return [o.token_ids for o in outs], eng._output(reqs[0]).token_ids

    plain = run(_engine("off"))
    eng = _engine("draft", draft_model=("random", TINY, 0))  # drafts every step
    assert run(eng) == plain
    assert eng.stats()["forked_seqs"] == 2 and eng.stats()["spec_accepted_tokens"] > 0


def test_grammar_rows_get_no_draft_and_stay_valid(smollm2_gguf):
    import json

    from localrun.engine.models.loader import read_gguf
    from localrun.engine.models.shapes import get_shape
    from localrun.engine.tokenizer import Tokenizer

    _, _, _, meta = read_gguf(smollm2_gguf)
    tok = Tokenizer.from_gguf(smollm2_gguf, meta["eos_token_ids"], meta["chat_template"])
    cfg = EngineConfig(device="cpu", max_model_len=256, kv_cache_tokens=2048, max_num_seqs=8, speculative="ngram")
    eng = LLMEngine._make(get_shape("tiny"), cfg, lambda m: m.init_random(0), lambda: tok)
    g = eng.compile_grammar({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    rep = tok.encode("one two three one two three one two three one two")
    params = [SamplingParams(temperature=0, max_tokens=60, grammar=g),
              SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)]
    outs = eng.generate([tok.encode("JSON please:"), rep], params)
    assert isinstance(json.loads(outs[0].text)["a"], int) and outs[0].finish_reason == "stop"
    eng.spec = None
    assert eng.generate([rep], params[1:])[0].token_ids == outs[1].token_ids
