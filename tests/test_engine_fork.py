"""n > 1 as one group (issue #15 part 4): the leader prefills the prompt once, the other choices
fork from it (shared full pages, a copied partial page, the first token sampled from the same
logits) and decode on their own. Outputs must equal those of separate requests; the prompt is
computed once; every abort and preemption path gives every page back."""

from __future__ import annotations

import asyncio

import pytest

from localrun.engine import EngineConfig, LLMEngine, SamplingParams
from localrun.engine.config import ModelConfig

TINY = ModelConfig(64, 2, 4, 2, 128, 300, rope_theta=10000.0)
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def _engine(**kw) -> LLMEngine:
    return LLMEngine.from_random(TINY, EngineConfig(device="cpu", max_model_len=256, **kw), seed=3)


def _prompt(n: int, salt: int = 0) -> list[int]:
    return [(7 * i + 3 + salt) % 300 for i in range(n)]


def _all_free(eng: LLMEngine) -> bool:
    eng.step()  # an overlap engine may still hold the last launched step: handle it
    eng.clear_prefix_cache()
    return eng.pool.num_free == eng.pool.num_pages


@pytest.fixture(scope="module")
def eng():
    return _engine()


@pytest.mark.parametrize("kv", ["auto", "int8"])
@pytest.mark.parametrize("length", [37, 32])  # a partial last page (copied), and whole pages only
def test_greedy_group_gives_n_copies_of_the_single_answer(kv, length):
    eng = _engine(kv_cache_dtype=kv)  # int8: the copied page must carry its scales
    p = _prompt(length)
    one = eng.generate([p], GREEDY)[0].token_ids
    assert _all_free(eng)
    before = eng.stats()
    outs = eng.generate([p], GREEDY, n=3)
    after = eng.stats()
    assert [o.token_ids for o in outs] == [one] * 3
    assert after["prefill_tokens"] - before["prefill_tokens"] == length  # the prompt, once
    assert after["forked_seqs"] - before["forked_seqs"] == 2
    assert all(o.prompt_tokens == length and o.completion_tokens == 10 for o in outs)
    assert _all_free(eng)


def test_greedy_group_with_a_sliding_window_layer():
    from dataclasses import replace

    cfg = replace(TINY, sliding_window=8, layer_types=["sliding_attention", "full_attention"])
    e = LLMEngine.from_random(cfg, EngineConfig(device="cpu", max_model_len=256), seed=3)
    p = _prompt(37, salt=12)
    one = e.generate([p], GREEDY)[0].token_ids
    assert [o.token_ids for o in e.generate([p], GREEDY, n=3)] == [one] * 3
    assert e.stats()["forked_seqs"] == 2 and _all_free(e)


def test_seeded_choices_equal_the_same_seeds_run_as_separate_requests(eng):
    p = _prompt(37, salt=1)
    params = [SamplingParams(temperature=0.9, top_p=0.9, max_tokens=12, ignore_eos=True, seed=100 + i,
                             want_logprobs=True, logprobs=2, repetition_penalty=1.2) for i in range(4)]
    grouped = eng.generate([p], params, n=4)
    alone = [eng.generate([p], [sp])[0] for sp in params]  # one at a time: no batch, no group
    assert eng.stats()["forked_seqs"] >= 3
    assert [o.token_ids for o in grouped] == [o.token_ids for o in alone]
    assert len({tuple(o.token_ids) for o in grouped}) > 1  # the seeds do differ
    for g, a in zip(grouped, alone):  # the first token's logprobs come from the shared logits row
        assert [lp for _, lp, _ in g.logprobs] == pytest.approx([lp for _, lp, _ in a.logprobs], abs=1e-4)


def test_prefill_tokens_once_vs_separate_requests():
    p, P = _prompt(45, salt=2), 16
    counts = {}
    for name, kw, share in (("group", {}, True), ("separate", {}, False),
                            ("separate, no prefix cache", {"enable_prefix_cache": False}, False)):
        e = _engine(**kw)
        outs = e.generate([p], GREEDY, n=4, share_prefill=share)
        assert len({tuple(o.token_ids) for o in outs}) == 1
        counts[name] = e.stats()["prefill_tokens"]
    assert counts["group"] == 45
    # separate: the others wait for the leader's full pages, then compute the partial page themselves
    assert counts["separate"] == 45 + 3 * (45 % P)
    assert counts["separate, no prefix cache"] == 4 * 45


def test_two_prompts_each_a_group_in_one_batch(eng):
    a, b = _prompt(20, salt=3), _prompt(50, salt=4)
    ref = [o.token_ids for o in eng.generate([a, b], GREEDY)]
    outs = eng.generate([a, b], GREEDY, n=2)
    assert [o.token_ids for o in outs] == [ref[0], ref[0], ref[1], ref[1]]
    assert _all_free(eng)


OVERLAP_PROMPTS = [_prompt(21, salt=9), _prompt(40, salt=10)]
OVERLAP_PARAMS = [SamplingParams(temperature=0 if k % 3 == 0 else 0.8, seed=k, max_tokens=20, ignore_eos=True,
                                 presence_penalty=0.5 if k % 2 else 0.0) for k in range(6)]
SMALL_POOL = dict(kv_cache_tokens=160, max_num_batched_tokens=48)


@pytest.fixture(scope="module")
def serial_separate():
    eng = _engine(overlap=False, cuda_graphs=False, **SMALL_POOL)
    return [o.token_ids for o in eng.generate(OVERLAP_PROMPTS, OVERLAP_PARAMS, n=3, share_prefill=False)]


@pytest.mark.parametrize("overlap,graphs", [(True, False), (False, True), (True, True)])
def test_groups_under_overlap_and_padded_decode_equal_separate_serial_requests(overlap, graphs, serial_separate):
    """The CUDA paths, run on CPU: a fork launched while the step before is still in flight,
    followers' first decodes read their tokens from the device, in padded decode batches; a
    small pool preempts members too."""
    eng = _engine(overlap=overlap, cuda_graphs=graphs, **SMALL_POOL)
    outs = eng.generate(OVERLAP_PROMPTS, OVERLAP_PARAMS, n=3)
    assert [o.token_ids for o in outs] == serial_separate
    s = eng.stats()
    assert s["forked_seqs"] >= 2 and s["preemptions"] > 0, s
    assert _all_free(eng)


# -- the online path: aborts at every stage, a late member, preemption ----------------------------
async def _run(eng: LLMEngine, streams: dict) -> dict:
    """Step the engine (no loop thread) until idle; each stream's (tokens, finish reason)."""
    for _ in range(500):
        eng.step()  # the first one takes in what was added since the last
        await asyncio.sleep(0)
        if not eng.has_work():
            break
    await asyncio.sleep(0)
    out = {}
    for key, s in streams.items():
        toks, reason = [], None
        while not s.queue.empty():
            d = s.queue.get_nowait()
            toks += d.token_ids
            reason = d.finish_reason or reason
        out[key] = (toks, reason)
    return out


def _add(eng, p, gid, size, idx, params=GREEDY):
    return eng.add_request(p, params, f"{gid}-{idx}", group=(gid, size, idx))


@pytest.mark.parametrize("who", ["leader", "follower"])
def test_abort_before_the_fork_keeps_refcounts(who):
    eng = _engine(max_num_batched_tokens=16)  # a 40-token prompt takes 3 chunks: time to abort
    p = _prompt(40, salt=5)
    one = eng.generate([p], GREEDY)[0].token_ids
    assert _all_free(eng)
    forked = eng.stats()["forked_seqs"]

    async def go():
        streams = {i: _add(eng, p, "g", 3, i) for i in range(3)}
        eng.step()  # the group starts: the leader's first chunk; the others are held
        assert eng.stats()["running"] == 1
        eng.abort("g-0" if who == "leader" else "g-2")
        return await _run(eng, streams)

    res = asyncio.run(go())
    gone = 0 if who == "leader" else 2
    assert res[gone] == ([], "abort")
    assert all(res[i] == (one, "length") for i in range(3) if i != gone)
    # leader gone: the others run on their own (prefix cache); follower gone: the other one forks
    assert eng.stats()["forked_seqs"] - forked == (0 if who == "leader" else 1)
    assert _all_free(eng)


def test_member_aborted_before_its_group_is_complete():
    eng = _engine()
    p = _prompt(30, salt=6)
    one = eng.generate([p], GREEDY)[0].token_ids

    async def go():
        streams = {0: _add(eng, p, "h", 3, 0), 1: _add(eng, p, "h", 3, 1)}
        eng.step()
        assert eng.stats()["running"] == 0  # held: member 2 has not arrived yet
        eng.abort("h-0")
        streams[2] = _add(eng, p, "h", 3, 2)  # the group is complete: 1 leads, 2 forks
        return await _run(eng, streams)

    res = asyncio.run(go())
    assert res == {0: ([], "abort"), 1: (one, "length"), 2: (one, "length")}
    assert eng.stats()["forked_seqs"] == 1
    assert _all_free(eng)


def test_group_starts_without_a_member_that_never_comes():
    eng = _engine()
    p = _prompt(30, salt=7)
    one = eng.generate([p], GREEDY)[0].token_ids
    eng.start()
    try:
        async def go():
            streams = [_add(eng, p, "k", 3, i) for i in range(2)]  # member 2 never comes

            async def collect(s):
                return [t async for d in s for t in d.token_ids]

            outs = await asyncio.wait_for(asyncio.gather(*(collect(s) for s in streams)), 30)
            late = await collect(_add(eng, p, "k", 3, 2))  # after the group started: on its own
            return outs, late

        outs, late = asyncio.run(go())
    finally:
        eng.shutdown()
    assert outs == [one, one] and late == one
    assert eng.stats()["forked_seqs"] == 1
    assert _all_free(eng)


def test_preemption_in_a_small_pool_gives_the_same_answers():
    # 8 pages of 16 tokens; 4 choices of 20 + 60 tokens need 20: members are preempted and recomputed
    eng = _engine(kv_cache_tokens=112, max_num_batched_tokens=64)
    p = _prompt(20, salt=8)
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    one = eng.generate([p], params)[0].token_ids
    assert _all_free(eng)
    outs = eng.generate([p], params, n=4)
    assert [o.token_ids for o in outs] == [one] * 4
    assert eng.stats()["forked_seqs"] == 3 and eng.stats()["preemptions"] > 0
    assert _all_free(eng)


def test_bad_groups_are_refused(eng):
    async def go():
        for group in (("g", 0, 0), ("g", 2, 2), ("g", 129, 0), ("g", "x", 0), "g"):
            with pytest.raises(ValueError, match="group"):
                eng.add_request([1, 2, 3], GREEDY, group=group)

    asyncio.run(go())
    with pytest.raises(ValueError, match="n must be"):
        eng.generate([[1, 2]], GREEDY, n=0)
    with pytest.raises(ValueError, match="one per choice"):
        eng.generate([[1, 2]], [GREEDY] * 3, n=2)


def test_bench_fork_modes_agree_and_count_prefill(eng):
    from localrun.bench.fork import MODES, run_mode

    p = _prompt(45, salt=11)
    res = {m: run_mode(eng, m, p, 4, 4) for m in MODES}
    assert res["group"]["tokens"] == res["separate"]["tokens"] == res["one by one"]["tokens"]
    assert [res[m]["prefill_tokens"] for m in MODES] == [45, 45 + 3 * 13, 45 + 3 * 13]
    assert res["group"]["ttft_last_ms"] <= res["one by one"]["ttft_last_ms"]
