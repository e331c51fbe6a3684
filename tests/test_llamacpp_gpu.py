"""Where llama.cpp runs, and how many sequences: the build's GPU support as the daemon reports it,
the advice `serve` prints when an NVIDIA GPU is present but llama.cpp is built for CPU only, the
placement `ps` shows, and LOCALRUN_NUM_PARALLEL=auto sized from memory.

No GPU here: the daemon test puts an `nvidia-smi` on PATH that answers like a real one for a GPU
the native engine does not take (compute capability 6.1), so the real daemon, the real llama.cpp
build probe and the real load path run as on such a machine."""

from __future__ import annotations

import os
import stat
import time

import pytest
from daemon import MODEL, Daemon

from localrun.backends.base import MemoryEstimate
from localrun.backends.llamacpp.backend import placement
from localrun.backends.select import GPU, LLAMACPP_CUDA_INSTALL, LlamaCppBuild, llamacpp_build, llamacpp_gpu_advice
from localrun.server.memory import auto_parallel

GiB = 2**30


def test_placement_words():
    assert placement("CUDA", -1, 30) == "CUDA: 31/31 layers"
    assert placement("CUDA", 12, 30) == "CUDA: 12/31 layers"
    assert placement("Metal", -1, 30) == "Metal"
    assert placement("CPU", 0, 30) == placement("CUDA", 0, 30) == "CPU"


def test_the_installed_build_is_asked_in_a_child_process():
    b = llamacpp_build()
    assert b.installed and "CPU" in b.system_info
    assert b.gpu_offload is False and b.summary == "CPU only (no GPU offload)"  # the CPU wheel CI builds


def test_gpu_advice_only_when_a_gpu_is_wasted():
    gpu = GPU("NVIDIA GeForce RTX 4090", (8, 9), 20 * GiB, 24 * GiB)
    cpu_build, cuda_build = LlamaCppBuild(True, False, "CPU : AVX2 = 1"), LlamaCppBuild(True, True, "CUDA : ARCHS = 890")
    advice = llamacpp_gpu_advice(gpu, cpu_build)
    assert "RTX 4090" in advice and LLAMACPP_CUDA_INSTALL in advice
    assert llamacpp_gpu_advice(gpu, cuda_build) is None and llamacpp_gpu_advice(None, cpu_build) is None
    assert cuda_build.summary == "GPU offload: CUDA"


def test_the_readme_gives_the_same_command():
    from daemon import REPO

    assert LLAMACPP_CUDA_INSTALL in (REPO / "README.md").read_text()


def test_auto_parallel_from_memory():
    def est(n: int) -> MemoryEstimate:  # 1 GiB of weights, 1 GiB of KV cache per sequence
        return MemoryEstimate(weights_bytes=GiB, kv_bytes=n * GiB, overhead_bytes=0)

    assert auto_parallel(est, 30, 4, ram_free=10 * GiB)[0] == 4
    n, why = auto_parallel(est, 30, 4, ram_free=int(3.5 * GiB))
    assert n == 2 and "RAM" in why
    assert auto_parallel(est, 30, 4, ram_free=2 * GiB) == (1, "1 parallel (auto: a larger KV cache would not fit)")
    # with a GPU: the most that fits wholly on it, even when RAM would take more
    n, why = auto_parallel(est, 30, 4, ram_free=64 * GiB, gpu_free=4 * GiB, gpu_kind="CUDA")
    assert n == 2 and "CUDA" in why


FAKE_SMI = """#!/bin/sh
# answers like nvidia-smi --query-gpu=name,compute_cap,memory.free,memory.total --format=csv,noheader,nounits
echo "NVIDIA GeForce GTX 1080 Ti, 6.1, 10000, 11264"
"""


@pytest.fixture(scope="module")
def gpu_daemon(tmp_path_factory):
    bin_dir = tmp_path_factory.mktemp("bin")
    smi = bin_dir / "nvidia-smi"
    smi.write_text(FAKE_SMI)
    smi.chmod(smi.stat().st_mode | stat.S_IXUSR)
    d = Daemon(tmp_path_factory.mktemp("home_gpu"), PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
               LOCALRUN_CONTEXT_LENGTH="1024")
    try:
        d.pull()
        yield d
    finally:
        d.stop()


def test_serve_says_once_how_to_get_a_cuda_build(gpu_daemon):
    deadline = time.monotonic() + 60
    while "llama.cpp build:" not in gpu_daemon.log.read_text(errors="replace"):
        assert time.monotonic() < deadline, gpu_daemon.log.read_text(errors="replace")[-2000:]
        time.sleep(0.2)
    time.sleep(0.5)
    log = gpu_daemon.log.read_text(errors="replace")
    assert "llama.cpp build: CPU only (no GPU offload)" in log
    assert log.count(LLAMACPP_CUDA_INSTALL) == 1 and "GTX 1080 Ti" in log


def test_ps_shows_where_and_how_many(gpu_daemon):
    r = gpu_daemon.http.post("/api/generate", json={"model": MODEL, "prompt": "Hi", "stream": False,
                                                     "options": {"num_predict": 4, "temperature": 0}})
    assert r.status_code == 200, r.text
    (m,) = gpu_daemon.ps()
    assert m["backend"] == "llama.cpp" and m["placement"] == "CPU" and m["processor"] == "100% CPU"
    assert "compute capability 6.1" in m["reason"]  # why not the native engine
    assert m["slots"] == 4 and "4 parallel (auto" in m["reason"]  # SmolLM2's KV cache is small
