"""Memory plan and backend choice: pure functions, no daemon (the daemon tests cover the wiring)."""

from __future__ import annotations

import pytest

from localrun.backends.base import LoadSpec, MemoryEstimate
from localrun.backends.select import GPU, choose
from localrun.errors import BackendError, InsufficientMemory
from localrun.server.app import _host_allowed, error_body, is_loopback
from localrun.server.memory import plan_load

GiB = 2**30


def test_plan_full_gpu_partial_cpu_refuse():
    est = MemoryEstimate(weights_bytes=8 * GiB, kv_bytes=2 * GiB, overhead_bytes=GiB // 2)
    full = plan_load(est, 32, ram_free=64 * GiB, gpu_free=24 * GiB, gpu_kind="CUDA")
    assert full.n_gpu_layers == -1 and full.processor == "100% GPU"
    part = plan_load(est, 32, ram_free=64 * GiB, gpu_free=6 * GiB, gpu_kind="CUDA")
    assert 0 < part.n_gpu_layers < 32 and "CPU/GPU" in part.processor and part.size_vram < 6 * GiB
    cpu = plan_load(est, 32, ram_free=64 * GiB)
    assert cpu.n_gpu_layers == 0 and cpu.processor == "100% CPU"
    with pytest.raises(InsufficientMemory) as e:
        plan_load(est, 32, ram_free=4 * GiB)
    assert "10.50 GiB" in e.value.message and "4.00 GiB" in e.value.message and e.value.status == 507


def test_llamacpp_estimate_from_gguf_header(smollm2_gguf):
    from localrun.backends.llamacpp import estimate_memory
    from localrun.library import read_gguf_info

    info = read_gguf_info(smollm2_gguf)
    small = estimate_memory(LoadSpec("s", smollm2_gguf, "gguf", num_ctx=1024, extra={"gguf_info": info}))
    big = estimate_memory(LoadSpec("s", smollm2_gguf, "gguf", num_ctx=8192, num_parallel=2, extra={"gguf_info": info}))
    # 30 layers x 3 KV heads x 64 dims x K+V x f16 = 23040 bytes per token
    assert small.kv_bytes == 1024 * 23040 and big.kv_bytes == 2 * 8192 * 23040
    assert small.weights_bytes == info.tensor_bytes
    # the output rows a scored prompt (echo + logprobs) fills a step are counted: 128 x 49152 floats
    assert small.overhead_bytes >= 128 * 49152 * 4


def test_scored_prompt_rows_held_under_32_mb_of_logits():
    from localrun.backends.llamacpp.batch import prompt_logprobs_rows

    assert [prompt_logprobs_rows(v) for v in (49152, 151936, 262144, 10**7)] == [128, 55, 32, 8]
    assert all(prompt_logprobs_rows(v) * v * 4 <= 32 * 2**20 for v in (49152, 151936, 262144))


def test_backend_choice():
    assert choose("auto", "gguf", None).backend == "llamacpp"
    old = GPU("Tesla T4", (7, 5), 15 * GiB, 16 * GiB)
    c = choose("auto", "gguf", old)
    assert c.backend == "llamacpp" and "7.5" in c.reason
    assert choose("llamacpp", "gguf", None).reason.endswith("LOCALRUN_BACKEND=llamacpp")
    with pytest.raises(BackendError):
        choose("llamacpp", "safetensors", None)


def test_host_and_error_shapes():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and not is_loopback("0.0.0.0")
    for ok in ("localhost", "localhost:11480", "127.0.0.1:80", "[::1]:11480", "app.localhost"):
        assert _host_allowed(ok), ok
    for bad in ("evil.com", "127.0.0.1.evil.com", "192.168.1.5:11480", "localhost.evil.com"):
        assert not _host_allowed(bad), bad
    assert error_body("/v1/models", 404, "m", "model_not_found")["error"]["message"] == "m"
    assert error_body("/api/tags", 400, "m", "x") == {"error": "m"}


def test_non_loopback_bind_needs_api_key():
    from localrun.config import settings
    from localrun.server.app import check_bind

    with pytest.raises(SystemExit) as e:
        check_bind(settings({"LOCALRUN_HOST": "0.0.0.0:11480"}))
    assert "LOCALRUN_API_KEY" in str(e.value)
    check_bind(settings({"LOCALRUN_HOST": "0.0.0.0:11480", "LOCALRUN_API_KEY": "k"}))
    check_bind(settings({"LOCALRUN_HOST": "127.0.0.1:11480"}))


def test_gpu_probe_asks_nvidia_smi_not_torch(tmp_path, monkeypatch):
    """The daemon reads the GPU from nvidia-smi, so it never creates a CUDA context of its own."""
    import sys

    from localrun.backends import select

    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'NVIDIA H100 80GB HBM3, 9.0, 80000, 81559'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{__import__('os').environ['PATH']}")
    monkeypatch.setitem(sys.modules, "torch", None)  # importing torch would fail: it must not be asked
    gpu = select.cuda_gpu()
    assert gpu == GPU("NVIDIA H100 80GB HBM3", (9, 0), 80000 * 2**20, 81559 * 2**20)
    smi.write_text("#!/bin/sh\necho 'garbage'\n")
    monkeypatch.setattr(select.importlib.util, "find_spec", lambda name: None)  # and no torch either
    assert select.cuda_gpu() is None


def test_plan_counts_the_host_cache_tier_and_refuses_one_that_does_not_fit():
    est = MemoryEstimate(weights_bytes=2 * GiB, kv_bytes=GiB, overhead_bytes=GiB // 2, host_cache_bytes=4 * GiB)
    cpu = plan_load(est, 32, ram_free=16 * GiB)
    assert cpu.size == int(3.5 * GiB) + 4 * GiB and "4.00 GiB host RAM" in cpu.detail
    gpu = plan_load(est, 32, ram_free=16 * GiB, gpu_free=24 * GiB, gpu_kind="CUDA")
    assert gpu.size_vram == int(3.5 * GiB) and gpu.size == gpu.size_vram + 4 * GiB  # the tier is RAM, not VRAM
    with pytest.raises(InsufficientMemory, match="LOCALRUN_HOST_CACHE") as e:
        plan_load(est, 32, ram_free=6 * GiB)  # the model fits (3.5 GiB), its host tier does not
    assert e.value.status == 507


def test_native_estimate_names_its_host_tier(smollm2_gguf, monkeypatch):
    native = pytest.importorskip("localrun.backends.native")
    spec = LoadSpec(name="smollm2:135m", weights=smollm2_gguf, format="gguf", num_ctx=256, num_parallel=1)
    monkeypatch.setenv("LOCALRUN_HOST_CACHE", "1GiB")
    assert native.estimate_memory(spec).host_cache_bytes == GiB
    monkeypatch.setenv("LOCALRUN_HOST_CACHE", "0")
    assert native.estimate_memory(spec).host_cache_bytes == 0
    monkeypatch.setenv("LOCALRUN_HOST_CACHE", "auto")
    est = native.estimate_memory(spec)
    assert 0 < est.host_cache_bytes <= 4 * est.kv_bytes  # auto: at most 4x the KV pool
