"""The engine's hot path, proved on CPU: the batched device sampler (distributions, per-request
seeds, greedy), persistent step buffers and the page table against a per-step rebuild, the
overlap loop and the padded CUDA-graph decode path (run eagerly here) giving the same outputs
as the plain serial loop, and decodes-first scheduling. The CUDA-only parts (graph capture
and replay) are the @pytest.mark.gpu tests at the end."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from localrun.engine import EngineConfig, LLMEngine, SamplingParams
from localrun.engine.layers.attention import HostStep, StepBuffers
from localrun.engine.config import ModelConfig
from localrun.engine.kv.pool import KVPool, PageTable
from localrun.engine.kv.radix import RadixCache
from localrun.engine.runner import profile_and_warm
from localrun.engine.sampler import SamplingBatch, _apply_penalties, sample, seeded_exponential
from localrun.engine.scheduler import PENDING, Scheduler, Sequence

TINY = ModelConfig(64, 2, 4, 2, 128, 300, rope_theta=10000.0)
# chi-square critical values at p = 1e-4 by degrees of freedom (the draws are seeded: no flakes)
CHI2_CRIT = {1: 15.14, 2: 18.42, 3: 21.11, 4: 23.51, 5: 25.74}


# --------------------------------------------------------------------------- sampler
def _expected(logits: list[float], p: SamplingParams) -> np.ndarray:
    """The filtered distribution, computed independently in float64 (HF/vLLM semantics)."""
    x = np.asarray(logits, dtype=np.float64) / p.temperature
    if p.top_k:
        x = np.where(x < np.sort(x)[::-1][p.top_k - 1], -np.inf, x)
    q = np.exp(x - x.max())
    q /= q.sum()
    if p.top_p < 1:
        order = np.argsort(-q, kind="stable")
        before = np.cumsum(q[order]) - q[order]
        q[order[before > p.top_p]] = 0.0
    if p.min_p:
        q = np.where(q < p.min_p * q.max(), 0.0, q)
    return q / q.sum()


def _batch(params, n_vocab, positions=None, histories=None, pending=None):
    n = len(params)
    hist = histories or [[]] * n
    return SamplingBatch.build(params, hist, [0] * n, positions or [0] * n, pending or [False] * n, n_vocab, "cpu")


@pytest.mark.parametrize("kw", [
    dict(temperature=0.7), dict(temperature=1.0, top_k=3), dict(temperature=1.0, top_p=0.8),
    dict(temperature=1.0, min_p=0.2), dict(temperature=1.3, top_k=4, top_p=0.9, min_p=0.05),
])
@pytest.mark.parametrize("seeded", [True, False])
def test_sampler_draws_follow_the_filtered_distribution(kw, seeded):
    logits = [2.0, 1.5, 1.0, 0.3, -0.5, -1.0]
    n = 6000
    if seeded:  # one request per row, each with its own seed: the hash noise must be uniform
        params = [SamplingParams(**kw, seed=i) for i in range(n)]
    else:
        torch.manual_seed(0)
        params = [SamplingParams(**kw)] * n
    b = _batch(params, len(logits))
    tokens, _ = sample(torch.tensor([logits] * n), b).to_host(b)
    counts = np.bincount(tokens, minlength=len(logits))
    want = _expected(logits, params[0])
    assert counts[want == 0].sum() == 0, (counts, want)  # never outside the kept set
    keep = want > 0
    chi2 = float((((counts - n * want) ** 2)[keep] / (n * want[keep])).sum())
    assert chi2 < CHI2_CRIT[int(keep.sum()) - 1], (chi2, counts, n * want)


def test_seeded_draws_do_not_depend_on_the_batch():
    V = 50
    g = torch.Generator().manual_seed(1)
    base = torch.randn(V, generator=g)
    p = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    alone = _batch([p], V, positions=[5])
    tok_alone = sample(base[None].clone(), alone).to_host(alone)[0][0]
    # the same request at row 3 of a batch of strangers (unseeded, greedy, other seeds)
    others = [SamplingParams(temperature=0.9), SamplingParams(temperature=0), SamplingParams(seed=9, top_k=5)]
    params = others + [p] + others
    logits = torch.randn(len(params), V, generator=g)
    logits[3] = base
    b = _batch(params, V, positions=[0, 0, 7, 5, 1, 1, 2])
    assert sample(logits, b).to_host(b)[0][3] == tok_alone
    # the noise is a function of (seed, position, token id) only ...
    keys = alone.seed_keys
    assert torch.equal(seeded_exponential(keys, V), seeded_exponential(keys.clone(), V))
    # ... and changes with the position
    later = _batch([p], V, positions=[6])
    assert not torch.equal(seeded_exponential(later.seed_keys, V), seeded_exponential(keys, V))


def test_greedy_rows_take_the_argmax_in_any_batch():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(9, 40, generator=g)
    greedy = _batch([SamplingParams(temperature=0)] * 9, 40)
    assert sample(logits, greedy).to_host(greedy)[0] == logits.argmax(-1).tolist()
    mixed = [SamplingParams(temperature=0) if i % 2 else SamplingParams(temperature=1.5, seed=i) for i in range(9)]
    b = _batch(mixed, 40)
    toks = sample(logits, b).to_host(b)[0]
    assert [t for i, t in enumerate(toks) if i % 2] == logits.argmax(-1)[1::2].tolist()
    assert [t for i, t in enumerate(toks) if i % 2 == 0] != logits.argmax(-1)[0::2].tolist()  # those sampled


def test_plain_temperature_batches_take_the_one_pass_draw(monkeypatch):
    """fused (the runner sets it when the Triton kernels are on): a batch of plain temperature
    rows, greedy rows among them, is one kernels.sample_temperature call (on CPU its torch
    reference; the kernel itself is tests/test_kernels.py's), drawing from softmax(x / T); a batch
    with a filter or a seed keeps the torch path, so a seeded row's token does not change."""
    from localrun.kernels import ops as kernels

    calls = []
    real = kernels.sample_temperature
    monkeypatch.setattr(kernels, "sample_temperature", lambda *a: calls.append(a) or real(*a))
    logits = [2.0, 1.5, 1.0, 0.3, -0.5, -1.0]
    n = 6000
    torch.manual_seed(0)
    params = [SamplingParams(temperature=0.7) if i % 5 else SamplingParams(temperature=0) for i in range(n)]
    b = _batch(params, len(logits))
    b.fused = True
    tokens = np.asarray(sample(torch.tensor([logits] * n), b).to_host(b)[0])
    assert len(calls) == 1 and torch.equal(calls[0][1], torch.tensor([0.0 if i % 5 == 0 else 0.7 for i in range(n)]))
    assert (tokens[::5] == 0).all()  # greedy rows: the argmax
    drawn = np.delete(tokens, np.s_[::5])
    counts = np.bincount(drawn, minlength=len(logits))
    want = _expected(logits, params[1]) * len(drawn)
    assert float(((counts - want) ** 2 / want).sum()) < CHI2_CRIT[5], (counts, want)
    for other in (SamplingParams(temperature=0.7, top_k=3), SamplingParams(temperature=0.7, seed=5)):
        b = _batch([other, SamplingParams(temperature=0.7)], len(logits))
        b.fused = True
        sample(torch.tensor([logits] * 2), b)
    assert len(calls) == 1


def _penalised_reference(row: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    """The per-row penalties as the engine applied them before batching."""
    row = row.clone()
    w = p.penalty_window
    out = output[-w:] if w > 0 else output
    if p.repetition_penalty != 1.0:
        hist = (prompt + output)[-w:] if w > 0 else prompt + output
        ids = torch.tensor(sorted(set(hist)), dtype=torch.long)
        if len(ids):
            v = row[ids]
            row[ids] = torch.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
    if out and (p.presence_penalty or p.frequency_penalty):
        ids, counts = torch.tensor(out, dtype=torch.long).unique(return_counts=True)
        row[ids] -= p.frequency_penalty * counts.to(row.dtype) + p.presence_penalty
    return row


@pytest.mark.parametrize("pending", [False, True])
def test_batched_penalties_equal_the_per_row_reference(pending):
    rng = random.Random(3)
    V, n = 30, 8
    logits = torch.randn(n, V, generator=torch.Generator().manual_seed(3))
    params, prompts, outputs = [], [], []
    for i in range(n):
        params.append(SamplingParams(temperature=0, repetition_penalty=[1.0, 1.3, 0.8][i % 3],
                                     presence_penalty=[0.0, 0.5][i % 2], frequency_penalty=[0.0, 0.25, 1.0][i % 3],
                                     penalty_window=[-1, 4, 1][i % 3]))
        prompts.append([rng.randrange(V) for _ in range(rng.randint(1, 6))])
        outputs.append([rng.randrange(V) for _ in range(rng.randint(1, 9))])
    want = torch.stack([_penalised_reference(logits[i], params[i], prompts[i], outputs[i]) for i in range(n)])
    # pending: each row's last output token is still on the device (the row's input this step)
    hist = [p + (o[:-1] if pending else o) for p, o in zip(prompts, outputs)]
    b = SamplingBatch.build(params, hist, [len(p) for p in prompts], [len(o) for o in outputs], [pending] * n, V, "cpu")
    last = torch.tensor([o[-1] for o in outputs])
    got = _apply_penalties(logits, b.penalties, last if pending else None)
    assert torch.allclose(got, want, atol=1e-6)


# --------------------------------------------------------------------------- persistent buffers
def _random_step(rng: np.random.Generator, T: int, B: int) -> HostStep:
    cu = np.sort(rng.choice(np.arange(1, T), B - 1, replace=False)).astype(np.int32)
    cu = np.concatenate([[0], cu, [T]]).astype(np.int32)
    i32 = lambda a: np.asarray(a, dtype=np.int32)  # noqa: E731
    return HostStep(input_ids=i32(rng.integers(0, 300, T)), prev_idx=i32(rng.integers(-1, 4, T)),
                    positions=i32(rng.integers(0, 99, T)), slots=i32(rng.integers(-1, 500, T)),
                    seq_lens=i32(rng.integers(1, 99, B)), cu_seqlens_q=cu, rows=i32(rng.integers(0, 8, B)),
                    sample_idx=i32(cu[1:] - 1), num_decodes=0, num_real_seqs=B)


@pytest.mark.parametrize("separate", [False, True])
def test_step_buffers_hold_each_step_at_fixed_offsets(separate):
    rng = np.random.default_rng(0)
    buf = StepBuffers(64, 8, "cpu", separate=separate)
    views = {name: buf.d[name] for name in buf.d}
    for T, B in ((5, 2), (64, 8), (17, 3), (9, 9 - 1)):
        step = _random_step(rng, T, B)
        buf.write(step)
        for name in ("input_ids", "prev_idx", "positions", "slots", "seq_lens", "cu_seqlens_q", "rows", "sample_idx"):
            arr = getattr(step, name)
            assert buf.view(name, len(arr)).tolist() == arr.tolist(), name
            assert buf.d[name].data_ptr() == views[name].data_ptr()  # the same memory every step
    with pytest.raises(ValueError, match="exceeds"):
        buf.write(_random_step(rng, 65, 2))


@pytest.mark.parametrize("separate", [False, True])
def test_page_table_updates_reach_the_device_table(separate):
    rng = random.Random(4)
    t = PageTable(6, 10, "cpu", separate=separate)
    rows = [t.alloc_row() for _ in range(6)]
    for _ in range(40):
        r = rng.choice(rows)
        start = rng.randrange(t.max_pages)
        t.write(r, start, [rng.randrange(1000) for _ in range(rng.randint(1, t.max_pages - start))])
        if rng.random() < 0.3:
            t.flush()
    t.flush()
    assert torch.equal(t.table, torch.from_numpy(t.host)) and not t.table[t.dummy_row].any()


def _naive_step(batch, P: int) -> dict:
    """The per-step rebuild from Python lists (what the runner did before the buffers)."""
    ids, pos, slots, lens, cu = [], [], [], [], [0]
    for s, n in zip(batch.seqs, batch.num_tokens):
        start, end = s.num_computed, s.num_computed + n
        ids += s.token_ids[start:end]
        pos += range(start, end)
        slots += [s.pages[p // P] * P + p % P for p in range(start, end)]
        lens.append(end)
        cu.append(cu[-1] + n)
    return {"ids": ids, "positions": pos, "slots": slots, "seq_lens": lens, "cu": cu,
            "pages": [list(s.pages) for s in batch.seqs]}


def _workload(vocab: int, n: int = 10, seed: int = 0):
    rng = random.Random(seed)
    shared = [rng.randrange(vocab) for _ in range(40)]
    prompts, params = [], []
    for i in range(n):
        own = [rng.randrange(vocab) for _ in range(rng.randint(3, 30))]
        prompts.append(shared[: rng.choice([0, 16, 32])] + own)
        kind = i % 4
        if kind == 0:
            p = SamplingParams(temperature=0, max_tokens=rng.randint(3, 14), ignore_eos=True, want_logprobs=True)
        elif kind == 1:
            p = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=i, max_tokens=rng.randint(3, 14),
                               ignore_eos=True, logprobs=2)
        elif kind == 2:
            p = SamplingParams(temperature=1.0, min_p=0.05, seed=i, repetition_penalty=1.3, presence_penalty=0.5,
                               frequency_penalty=0.2, penalty_window=6, max_tokens=rng.randint(3, 14), ignore_eos=True)
        else:
            p = SamplingParams(temperature=0.0, repetition_penalty=1.2, max_tokens=rng.randint(3, 14), ignore_eos=True)
        params.append(p)
    return prompts, params


@pytest.fixture(scope="module")
def tiny_model():
    eng = LLMEngine.from_random(TINY, EngineConfig(device="cpu", max_model_len=256), seed=5)
    return eng.model


def _engine(model, **kw) -> LLMEngine:
    base = dict(device="cpu", max_model_len=256, page_size=4, max_num_batched_tokens=48, max_num_seqs=6,
                kv_memory_bytes=28 * 4 * TINY.kv_bytes_per_token(torch.float32))
    return LLMEngine(model, TINY, EngineConfig(**{**base, **kw}), None)


@pytest.mark.parametrize("overlap,graphs", [(False, True), (True, False), (True, True)])
def test_persistent_step_metadata_equals_a_per_step_rebuild(tiny_model, overlap, graphs):
    eng = _engine(tiny_model, overlap=overlap, cuda_graphs=graphs)
    runner, P = eng.runner, eng.config.page_size
    launched = []  # (ids on the device, the batch's sequences and chunk starts) checked at the end
    real_launch = runner.launch

    def checked(batch):
        want = _naive_step(batch, P)
        starts = [s.num_computed for s in batch.seqs]
        handle = real_launch(batch)
        B, T = len(batch.seqs), len(want["ids"])
        b = runner.buffers
        assert b.view("positions", T).tolist() == want["positions"]
        assert b.view("slots", T).tolist() == want["slots"]
        assert b.view("seq_lens", B).tolist() == want["seq_lens"]
        assert b.view("cu_seqlens_q", B + 1).tolist() == want["cu"]
        table = runner.attn.batch_table
        for i, pages in enumerate(want["pages"]):
            assert table[i, : len(pages)].tolist() == pages
        if graphs and batch.num_decodes == B and runner.graphs.size_for(B) > B:  # padding rows
            bs = runner.graphs.size_for(B)
            assert set(b.view("slots", bs)[B:].tolist()) == {-1} and set(b.view("seq_lens", bs)[B:].tolist()) == {0}
        known = [t for t in want["ids"] if t != PENDING]
        assert [t for t, w in zip(b.view("input_ids", T).tolist(), want["ids"]) if w != PENDING] == known
        launched.append((b.view("input_ids", T).tolist(), list(batch.seqs), starts, list(batch.num_tokens),
                         PENDING in want["ids"]))
        return handle

    runner.launch = checked
    prompts, params = _workload(TINY.vocab_size)
    eng.generate(prompts, params)
    assert eng.stats()["preemptions"] > 0  # the small pool made the scheduler preempt
    for ids, seqs, starts, ns, _ in launched:  # pending inputs were gathered on the device: now known
        assert ids == [t for s, a, n in zip(seqs, starts, ns) for t in s.token_ids[a:a + n]]
    assert any(p for *_, p in launched) == overlap  # overlap: inputs still on the device at launch


def test_overlap_and_padded_decode_give_the_serial_outputs(tiny_model):
    prompts, params = _workload(TINY.vocab_size, n=12, seed=1)
    serial = _engine(tiny_model, overlap=False, cuda_graphs=False).generate(prompts, params)
    # stop tokens that occur: a request stops on the 3rd token of its serial run
    for i in range(0, 12, 3):
        params[i].stop_token_ids = [serial[i].token_ids[2]] if len(serial[i].token_ids) > 2 else []
    ref = _engine(tiny_model, overlap=False, cuda_graphs=False)
    serial = ref.generate(prompts, params)
    assert ref.stats()["preemptions"] > 0
    assert any(o.finish_reason == "stop" for o in serial) and any(o.finish_reason == "length" for o in serial)
    for overlap, graphs in ((True, False), (False, True), (True, True)):
        eng = _engine(tiny_model, overlap=overlap, cuda_graphs=graphs)
        outs = eng.generate(prompts, params)
        for a, b in zip(serial, outs):
            assert (b.token_ids, b.finish_reason, b.completion_tokens) == (a.token_ids, a.finish_reason,
                                                                          a.completion_tokens), (overlap, graphs)
            if a.logprobs is not None:
                assert [(t, round(lp, 4)) for t, lp, _ in b.logprobs] == [(t, round(lp, 4)) for t, lp, _ in a.logprobs]
        eng.step()  # an overlap engine may still hold the last launched step: handle it
        eng.clear_prefix_cache()
        s = eng.stats()
        assert s["kv_pages_free"] == s["kv_pages_total"] and s["running"] == s["waiting"] == 0


def test_separate_host_and_device_buffers_give_the_same_outputs(tiny_model, monkeypatch):
    """The CUDA layout (step buffers uploaded by copy, page-table entries flushed by scatter),
    run on CPU: the same tokens as the shared-memory layout."""
    import functools

    from localrun.engine import runner as runner_mod

    prompts, params = _workload(TINY.vocab_size, n=8, seed=4)
    want = _engine(tiny_model, overlap=True, cuda_graphs=True).generate(prompts, params)
    monkeypatch.setattr(runner_mod, "PageTable", functools.partial(PageTable, separate=True))
    monkeypatch.setattr(runner_mod, "StepBuffers", functools.partial(StepBuffers, separate=True))
    eng = _engine(tiny_model, overlap=True, cuda_graphs=True)
    assert eng.runner.table.separate and eng.runner.buffers.separate
    assert [o.token_ids for o in eng.generate(prompts, params)] == [o.token_ids for o in want]


async def test_online_overlap_streams_and_aborts(tiny_model):
    eng = _engine(tiny_model, overlap=True, cuda_graphs=True)
    prompts, params = _workload(TINY.vocab_size, n=4, seed=2)
    want = _engine(tiny_model).generate(prompts, params)
    eng.start()
    try:
        got = []
        for p, sp in zip(prompts, params):
            ids = []
            async for d in eng.add_request(p, sp):
                ids += d.token_ids
                last = d
            got.append(ids)
            assert last.usage["completion_tokens"] == len(ids)
        assert got == [o.token_ids for o in want]
        long = eng.add_request(prompts[0], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
        async for d in long:
            break
        await long.aclose()
    finally:
        eng.shutdown()
    eng.clear_prefix_cache()
    assert eng.stats()["kv_pages_free"] == eng.stats()["kv_pages_total"]


# --------------------------------------------------------------------------- scheduling
def test_decodes_come_first_in_the_token_budget():
    cfg = EngineConfig(device="cpu", max_model_len=256, page_size=4, max_num_batched_tokens=16, max_num_seqs=8)
    pool = KVPool(TINY, 64, 4, torch.float32, "cpu")
    sched = Scheduler(cfg, pool, RadixCache(pool), PageTable(8, 64, "cpu"))

    def step():
        b = sched.schedule()
        sched.update(b)
        for s in b.seqs:  # what the engine does once the step's tokens are back
            if s.num_computed == len(s.token_ids):
                s.token_ids.append(7)
        return b

    old = Sequence("old", list(range(100, 140)), SamplingParams())  # arrived first, 40-token prompt
    young = [Sequence(f"young{i}", [1, 2, 3 + i], SamplingParams()) for i in range(4)]
    for s in young:
        sched.add(s)
    assert step().num_tokens == [3, 3, 3, 3]  # the young ones' prompts
    sched.add(old)
    b = step()
    assert b.seqs == young + [old] and b.num_tokens == [1, 1, 1, 1, 12] and b.num_decodes == 4
    b = step()  # the oldest sequence is still prefilling: the decodes go first all the same
    assert b.seqs == young + [old] and b.num_tokens == [1, 1, 1, 1, 12] and b.num_decodes == 4


def test_graph_batch_sizes():
    assert EngineConfig(device="cpu", max_num_seqs=256).graph_batch_sizes() == [1, 2, 4, 8, 16] + list(range(32, 257, 32))
    assert EngineConfig(device="cpu", max_num_seqs=64).graph_batch_sizes() == [1, 2, 4, 8, 16, 32, 64]
    assert EngineConfig(device="cpu", max_num_seqs=6).graph_batch_sizes() == [1, 2, 4, 6]
    assert EngineConfig(device="cpu", max_num_seqs=64, cuda_graph_max_bs=20).graph_batch_sizes() == [1, 2, 4, 8, 16, 20]


def test_profile_and_warm_runs_the_widest_step(tiny_model):
    cfg = EngineConfig(device="cpu", max_model_len=64, max_num_batched_tokens=150, max_num_seqs=4)
    assert profile_and_warm(tiny_model, cfg, triton=False) == 0  # (the peak is measured on CUDA only)
    assert tiny_model.attn is None


def test_model_is_built_in_its_dtype_without_a_float32_copy():
    from localrun.engine.layers.ops import Ops
    from localrun.engine.models.llama import LlamaModel

    m = LlamaModel(TINY, 32, torch.bfloat16, "cpu", Ops(reference=True))
    assert {p.dtype for p in m.parameters()} == {torch.bfloat16} and {p.device.type for p in m.parameters()} == {"cpu"}


# --------------------------------------------------------------------------- GPU
needs_gpu = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_cuda_graphs_and_overlap_match_eager_serial():
    cfg = dict(device="cuda", dtype="float32", max_model_len=256, max_num_seqs=8, kv_cache_tokens=2048)
    ref = LLMEngine.from_random(TINY, EngineConfig(**cfg, cuda_graphs=False, overlap=False), seed=5)
    fast = LLMEngine(ref.model, TINY, EngineConfig(**cfg), None)
    assert fast.runner.graphs is not None and len(fast.runner.graphs.graphs) == len(fast.config.graph_batch_sizes())
    prompts, params = _workload(TINY.vocab_size, n=8, seed=3)
    a, b = ref.generate(prompts, params), fast.generate(prompts, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert math.isfinite(fast.timings["graphs_s"])
