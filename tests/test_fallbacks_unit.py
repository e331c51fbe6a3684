"""Fast in-process tests of the fallbacks' parts (engine/fallbacks.py), beside the daemon tests in
test_fallbacks.py: the kernel trial's comparison and its failures, the KV pool's shrinking
allocation and resize, and an out-of-memory step in a running engine (its requests end, a
request still waiting is served, the next one equals the same request before)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from localrun.kernels import ops as kernels
from localrun.engine import EngineConfig, LLMEngine, SamplingParams, faults
from localrun.engine import fallbacks as fb
from localrun.engine.config import ModelConfig
from localrun.engine.kv.pool import KVPool

CFG = ModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, vocab_size=300)


@pytest.fixture(autouse=True)
def no_faults(monkeypatch):
    monkeypatch.delenv("LOCALRUN_FAULTS", raising=False)
    faults.reset()
    yield
    faults.reset()


def test_kernel_trial_keeps_good_kernels_and_drops_failing_or_wrong_ones(monkeypatch):
    """On CPU (no interpreter) each op dispatches to its reference, which agrees with itself;
    a kernel that raises, one that returns wrong values and an injected failure fall back."""
    seen: list[str] = []
    assert fb.try_kernels(CFG, torch.float32, torch.float32, 16, torch.device("cpu"), seen.append) == frozenset()
    assert seen == []

    def broken(*a, **k):
        raise RuntimeError("PTX compile failed: sm_120 not supported")

    monkeypatch.setattr(kernels, "rms_norm", broken)
    monkeypatch.setattr(kernels, "silu_and_mul", lambda x: kernels.silu_and_mul_ref(x) * 1.5)
    monkeypatch.setenv("LOCALRUN_FAULTS", "kernel:extend_attention")
    refs = fb.try_kernels(CFG, torch.float32, torch.float32, 16, torch.device("cpu"), seen.append)
    assert refs == {"rms_norm", "silu_and_mul", "extend_attention"}
    assert seen[0].startswith("kernel extend_attention: torch reference (Triton compile/launch failed at warm-up: "
                              "InjectedFault")
    assert "kernel silu_and_mul: torch reference (its output differs from the torch reference" in seen[1]
    assert seen[2] == ("kernel rms_norm: torch reference (Triton compile/launch failed at warm-up: RuntimeError: "
                       "PTX compile failed: sm_120 not supported)")


def test_kernel_trials_on_threads_retry_a_failure_alone_before_it_counts(monkeypatch):
    """threads > 1: the trials after the first run on a pool; one that fails only beside others
    (as a compile racing another could) passes when tried again alone and keeps its kernel; one
    that fails alone too falls back, recorded once."""
    import threading
    import time

    names = fb.ATTENTION_KERNELS + ("fused_add_rmsnorm", "apply_rope", "silu_and_mul")
    inside, seen, calls = [0], [], {"apply_rope": 0}
    lock = threading.Lock()
    rope = kernels.apply_rope

    def crowded_rope(*a, **k):  # raises while another trial runs at the same time
        with lock:
            inside[0] += 1
            calls["apply_rope"] += 1
        try:
            time.sleep(0.05)
            with lock:
                others = inside[0] > 1 or busy[0] > 0
            if others:
                raise RuntimeError("a concurrent compile clobbered this one")
            return rope(*a, **k)
        finally:
            with lock:
                inside[0] -= 1

    busy = [0]
    silu = kernels.silu_and_mul

    def slow_silu(x):  # keeps another trial busy while apply_rope's runs
        with lock:
            busy[0] += 1
        try:
            time.sleep(0.2)
            return silu(x)
        finally:
            with lock:
                busy[0] -= 1

    def broken(*a, **k):
        raise RuntimeError("PTX compile failed")

    monkeypatch.setattr(kernels, "apply_rope", crowded_rope)
    monkeypatch.setattr(kernels, "silu_and_mul", slow_silu)
    monkeypatch.setattr(kernels, "fused_add_rmsnorm", broken)
    refs = fb.try_kernels(CFG, torch.float32, torch.float32, 16, torch.device("cpu"), seen.append, names=names,
                          threads=4)
    assert refs == {"fused_add_rmsnorm"}
    assert calls["apply_rope"] == 2  # failed beside silu_and_mul, then passed alone
    assert seen == ["kernel fused_add_rmsnorm: torch reference (Triton compile/launch failed at warm-up: "
                    "RuntimeError: PTX compile failed)"]
    seen.clear()  # a kernel outside `names` is not tried at all
    assert fb.try_kernels(CFG, torch.float32, torch.float32, 16, torch.device("cpu"), seen.append,
                          names=("store_kv",), threads=4) == frozenset() and seen == []


def test_kernel_trial_of_a_quantized_cache_compares_dequantized_pages():
    seen: list[str] = []
    assert fb.try_kernels(CFG, torch.float32, torch.int8, 16, torch.device("cpu"), seen.append) == frozenset()
    assert seen == []


def test_pool_allocation_halves_down_to_the_floor():
    made: list[int] = []

    def make(n: int) -> KVPool:
        made.append(n)
        if n > 20:
            raise torch.OutOfMemoryError(f"CUDA out of memory: tried {n} pages")
        return KVPool(CFG, n, 16, torch.float32, "cpu")

    seen: list[str] = []
    pool = fb.allocate_pool(make, 100, 9, torch.device("cpu"), seen.append)
    assert made == [100, 50, 25, 12] and pool.num_pages == 12
    assert seen == ["KV cache: 12 pages instead of 100 (allocating 100 failed: OutOfMemoryError: CUDA out of "
                    "memory: tried 100 pages)"]
    with pytest.raises(MemoryError, match=r"not enough host memory for a KV cache of 30 pages .* from 100 pages.*"
                                          r"lower num_ctx"):
        fb.allocate_pool(make, 100, 30, torch.device("cpu"), seen.append)
    with pytest.raises(ValueError):  # not out of memory: not retried
        fb.allocate_pool(make, 0, 0, torch.device("cpu"), seen.append)


def test_pool_resize_needs_every_page_free():
    pool = KVPool(CFG, 10, 16, torch.int8, "cpu")
    pages = pool.alloc(2)
    with pytest.raises(RuntimeError, match="2 pages in use"):
        pool.resize(5)
    pool.decref(pages)
    pool.resize(5)
    assert pool.num_pages == pool.num_free == 5 and pool.k_caches[0].shape[0] == 5 and pool.k_scales[0].shape[0] == 5
    assert len(pool.layers) == CFG.num_layers and pool.alloc(5) == [0, 1, 2, 3, 4]


async def _run(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> tuple[list[int], object]:
    toks, last = [], None
    async for d in engine.add_request(prompt, params):
        toks += d.token_ids
        last = d
    return toks, last


def test_an_out_of_memory_step_ends_its_requests_and_the_engine_goes_on(monkeypatch):
    cfg = EngineConfig(device="cpu", max_model_len=64, kv_cache_tokens=1024, max_num_seqs=1, max_num_batched_tokens=32)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    before = LLMEngine.from_random("tiny", cfg).generate([[5, 6, 7, 8]], params)[0].token_ids
    monkeypatch.setenv("LOCALRUN_FAULTS", "step_oom:1")
    engine = LLMEngine.from_random("tiny", cfg)
    changes: list[int] = []
    engine.on_fallback = lambda: changes.append(len(engine.fallbacks))
    pages = engine.pool.num_pages

    async def main():
        engine.start()
        try:  # max_num_seqs 1: the second request waits while the first runs (and fails)
            first, second = await asyncio.gather(_run(engine, [5, 6, 7, 8], params), _run(engine, [5, 6, 7, 8], params))
            third = await _run(engine, [5, 6, 7, 8], params)
        finally:
            engine.shutdown()
        return first, second, third

    (t1, d1), (t2, d2), (t3, d3) = asyncio.run(main())
    assert t1 == [] and d1.error_kind == "out_of_memory" and "out of memory while running this request" in d1.error
    assert d2.error is None and t2 == before and t3 == before
    assert changes == [1] and engine.fallbacks[0].startswith("out of memory in a step (OutOfMemoryError: injected")
    assert engine.pool.num_pages == max(pages // 2, 64 // 16 + 1) < pages
    assert engine.config.max_num_batched_tokens == 32 and engine.config.max_num_seqs == 1  # at their floors
    assert engine.fatal is None


def test_graph_capture_failures_leave_those_sizes_eager(monkeypatch):
    """The padded decode path on CPU runs the capture procedure (warm-up, then the capture point):
    sizes whose capture fails are listed in one fallback and decode eagerly, padded, exactly."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13]]
    plain = LLMEngine.from_random("tiny", EngineConfig(device="cpu", max_model_len=64, max_num_seqs=4))
    want = [o.token_ids for o in plain.generate(prompts, params)]
    monkeypatch.setenv("LOCALRUN_FAULTS", "graph_capture:1,graph_capture:4")
    engine = LLMEngine.from_random("tiny", EngineConfig(device="cpu", max_model_len=64, max_num_seqs=4,
                                                        cuda_graphs=True))
    assert engine.runner.graphs.sizes == [1, 2, 4] and sorted(engine.runner.graphs.failed) == [1, 4]
    assert engine.fallbacks == [f"decode batch {bs}: eager, not a CUDA graph (capture failed: InjectedFault: "
                                f"injected capture failure at batch {bs} (LOCALRUN_FAULTS))" for bs in (1, 4)]
    assert [o.token_ids for o in engine.generate(prompts, params)] == want


def test_an_out_of_memory_step_that_cannot_shrink_makes_the_engine_fatal(monkeypatch):
    """When not even one full-length sequence's pages can be allocated again, the engine is fatal
    (the native backend's runner then exits and the daemon reloads the model)."""
    cfg = EngineConfig(device="cpu", max_model_len=64, kv_cache_tokens=1024, max_num_seqs=2)
    monkeypatch.setenv("LOCALRUN_FAULTS", "step_oom:1")
    engine = LLMEngine.from_random("tiny", cfg)
    monkeypatch.setenv("LOCALRUN_FAULTS", "step_oom:1,kv_alloc:10")  # from now on: the shrink's allocations

    async def main():
        engine.start()
        try:
            return await _run(engine, [5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=4))
        finally:
            engine.shutdown()

    toks, last = asyncio.run(main())
    assert toks == [] and last.error_kind is None and last.error == engine.fatal
    assert "shrinking failed: MemoryError: not enough host memory for a KV cache of 5 pages" in engine.fatal
    assert engine.fallbacks == []
