"""The native engine's GPU-path fallbacks, each made to happen for real (LOCALRUN_FAULTS in the
daemon's environment, so the step it names fails in the runner process) and driven over HTTP with
the OpenAI SDK: a Triton kernel whose warm-up launch raises runs its torch reference, a decode
graph whose capture raises runs eagerly, a KV pool allocation refused as out of memory is retried
smaller (and below one full-length sequence is a clear 507), an out-of-memory step ends its
request with a 503 and the engine shrinks and goes on. After each, /api/ps shows the fallback
with its reason and the next request is served, its greedy text equal to the same request on a
daemon without the fault.

The model is a tiny random Llama (2 layers, hidden 64) in safetensors with SmolLM2's tokenizer,
so the Triton kernels can run in Triton's CPU interpreter (TRITON_INTERPRET=1) within seconds."""

from __future__ import annotations

import contextlib
import importlib.util
import re
from collections.abc import Iterator

import pytest

from daemon import Daemon

pytestmark = pytest.mark.timeout(300)

openai = pytest.importorskip("openai")
transformers = pytest.importorskip("transformers")

TINY = "tiny-native"
PROMPT = "The quick brown fox jumps over"
N = 8


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, smollm2_gguf):
    import torch

    d = tmp_path_factory.mktemp("tiny-native")
    tok = transformers.AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)
    tok.save_pretrained(d)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                                   bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                   initializer_range=0.3)  # decisive logits: greedy picks are not near-ties
    transformers.LlamaForCausalLM(cfg).save_pretrained(d, safe_serialization=True)
    return d


@contextlib.contextmanager
def _daemon(home, tiny_dir, **env) -> Iterator[Daemon]:
    """A native-engine daemon with the tiny model created (env: LOCALRUN_FAULTS and the like), stopped after."""
    d = Daemon(home, LOCALRUN_BACKEND="native", LOCALRUN_CONTEXT_LENGTH="512", LOCALRUN_NUM_PARALLEL="1", **env)
    try:
        r = d.http.post("/api/create", json={"model": TINY, "modelfile": f"FROM {tiny_dir}\n", "stream": False})
        assert r.status_code == 200, r.text
        yield d
    finally:
        d.stop()


def _client(d: Daemon):
    return openai.OpenAI(base_url=d.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _complete(d: Daemon, prompt: str = PROMPT) -> str:
    r = _client(d).completions.create(model=TINY, prompt=prompt, max_tokens=N, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == N
    return r.choices[0].text


def _fallbacks(d: Daemon) -> list[str]:
    (m,) = [m for m in d.ps() if m["name"].startswith(TINY)]
    return m["fallbacks"]


@pytest.fixture(scope="module")
def baseline(tmp_path_factory, tiny_dir) -> str:
    with _daemon(tmp_path_factory.mktemp("home-baseline"), tiny_dir) as d:
        text = _complete(d)
        assert text and _fallbacks(d) == []
        return text


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (its CPU interpreter)")
def test_a_kernel_that_fails_at_warm_up_runs_its_torch_reference(tmp_path, tiny_dir, baseline):
    with _daemon(tmp_path / "home", tiny_dir, TRITON_INTERPRET="1", LOCALRUN_FAULTS="kernel:apply_rope") as d:
        assert _complete(d) == baseline  # the other kernels are Triton's (interpreted), rope the reference
        fbs = _fallbacks(d)
        assert len(fbs) == 1 and fbs[0].startswith("kernel apply_rope: torch reference (Triton compile/launch "
                                                   "failed at warm-up: InjectedFault"), fbs
        assert _complete(d, PROMPT + " the lazy dog")  # served again, no new fallback
        assert len(_fallbacks(d)) == 1
        log = d.log.read_text(errors="replace")
        assert log.count("fallback: kernel apply_rope") == 1  # once, at warm-up, not per step
        assert "fallback: kernel" not in log.replace("fallback: kernel apply_rope", "")


def test_a_graph_capture_that_fails_runs_that_batch_size_eagerly(tmp_path, tiny_dir, baseline):
    with _daemon(tmp_path / "home", tiny_dir, LOCALRUN_FAULTS="graph_capture:1") as d:
        assert _complete(d) == baseline
        fbs = _fallbacks(d)
        assert fbs == [fbs[0]] and fbs[0].startswith("decode batch 1: eager, not a CUDA graph (capture failed: "
                                                     "InjectedFault"), fbs  # the other sizes are not named
        assert _complete(d) == baseline


def test_a_kv_pool_allocation_refused_is_retried_smaller(tmp_path, tiny_dir, baseline):
    # CPU: 512 tokens x 4 sequences = 129 pages of 16; refused twice: 64 pages, then the floor of one
    # full-length sequence (512 / 16 + 1 = 33 pages)
    with _daemon(tmp_path / "home", tiny_dir, LOCALRUN_FAULTS="kv_alloc:2") as d:
        assert _complete(d) == baseline
        fbs = _fallbacks(d)
        assert len(fbs) == 1 and fbs[0].startswith("KV cache: 33 pages instead of 129 (allocating 129 failed: "
                                                   "OutOfMemoryError"), fbs
        (m,) = d.ps()
        assert "528 tokens" in m["reason"]  # the pool as allocated


def test_a_kv_pool_that_never_fits_is_a_clear_load_error(tmp_path, tiny_dir):
    with _daemon(tmp_path / "home", tiny_dir, LOCALRUN_FAULTS="kv_alloc:9") as d:
        with pytest.raises(openai.APIStatusError) as info:
            _complete(d)
        assert info.value.status_code == 507
        msg = str(info.value)
        assert "not enough host memory for a KV cache of 33 pages" in msg and "lower num_ctx" in msg, msg
        assert d.http.get("/api/version").status_code == 200 and d.ps() == []  # the daemon goes on


def test_out_of_memory_in_a_step_is_a_503_and_the_engine_goes_on(tmp_path, tiny_dir, baseline):
    with _daemon(tmp_path / "home", tiny_dir, LOCALRUN_FAULTS="step_oom:1") as d:
        with pytest.raises(openai.APIStatusError) as info:
            _complete(d)
        assert info.value.status_code == 503
        msg = str(info.value)
        assert "out of memory while running this request" in msg and "goes on serving" in msg, msg
        pid = d.runner_pid(TINY + ":latest")
        fbs = _fallbacks(d)  # sent by the runner after loading, before the request's error
        assert len(fbs) == 1 and fbs[0].startswith("out of memory in a step (OutOfMemoryError: injected"), fbs
        assert re.search(r"batch to 32 sequences \(from 64\) and 1024 tokens a step \(from 2048\), its KV cache "
                         r"to 64 pages \(from 129\)", fbs[0]), fbs
        assert _complete(d) == baseline  # the next request is served, by the same runner
        assert d.runner_pid(TINY + ":latest") == pid
        (m,) = d.ps()
        assert m["size"] > 0 and "fallbacks" in m
