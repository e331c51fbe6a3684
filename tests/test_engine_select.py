"""Backend choice for GGUF models on a GPU the native engine runs on (issue #14 item 8): a
quantized GGUF goes to llama.cpp where bfloat16 would not fit or llama.cpp's GPU build
decodes it from fewer bytes; unquantized GGUFs and safetensors stay native; the reason
says why (it is what `localrun ps` shows)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from localrun.backends import select
from localrun.backends.select import GPU, choose

GiB = 2**30
H100 = GPU("NVIDIA H100 80GB HBM3", (9, 0), 78 * GiB, 80 * GiB)
SMALL = GPU("NVIDIA A10", (8, 6), 12 * GiB, 24 * GiB)


def facts(file_type: str, params: float, size: float):
    return SimpleNamespace(file_type=file_type, parameter_count=int(params), tensor_bytes=int(size))


@pytest.fixture(autouse=True)
def native_imports(monkeypatch):
    monkeypatch.setattr(select, "native_import_error", lambda: None)


def test_quantized_gguf_that_would_not_fit_as_bf16_goes_to_llamacpp():
    c = choose("auto", "gguf", SMALL, facts("Q4_K_M", 8.03e9, 4.9e9), llamacpp_gpu=False)
    assert c.backend == "llamacpp"
    assert "Q4_K_M" in c.reason and "15.0 GiB as bfloat16" in c.reason and "12.0 GiB" in c.reason


def test_quantized_gguf_goes_to_llamacpps_gpu_build_when_it_has_one():
    c = choose("auto", "gguf", H100, facts("Q4_K_M", 8.03e9, 4.9e9), llamacpp_gpu=True)
    assert c.backend == "llamacpp" and "fewer bytes per token" in c.reason and "H100" in c.reason


def test_quantized_gguf_that_fits_stays_native_without_a_llamacpp_gpu_build():
    c = choose("auto", "gguf", H100, facts("Q4_K_M", 8.03e9, 4.9e9), llamacpp_gpu=False)
    assert c.backend == "native" and "9.0" in c.reason


@pytest.mark.parametrize("file_type", ["BF16", "F16", "F32"])
def test_unquantized_gguf_and_unknown_facts_stay_native(file_type):
    assert choose("auto", "gguf", H100, facts(file_type, 8.03e9, 16.1e9), llamacpp_gpu=True).backend == "native"
    assert choose("auto", "gguf", H100, None, llamacpp_gpu=True).backend == "native"


def test_explicit_settings_win():
    q = facts("Q4_K_M", 8.03e9, 4.9e9)
    assert choose("native", "gguf", SMALL, q).backend == "native"
    assert choose("llamacpp", "gguf", H100, q).backend == "llamacpp"
    assert choose("auto", "safetensors", SMALL, None).backend == "native"


def test_real_gguf_header_facts(smollm2_gguf):
    from localrun.library import read_gguf_info

    info = read_gguf_info(smollm2_gguf)  # Q4_1, 135M parameters
    tiny_gpu = GPU("tiny", (8, 0), GiB, GiB)
    c = choose("auto", "gguf", tiny_gpu, info, llamacpp_gpu=False)
    assert c.backend == "llamacpp" and "Q4_1" in c.reason


def test_native_on_cpu_lets_auto_pick_the_native_engine_without_a_gpu():
    from localrun.config import settings

    assert choose("auto", "gguf", None, None).backend == "llamacpp"  # the default on a CPU
    c = choose("auto", "gguf", None, None, arch="llama", native_on_cpu=True)
    assert c.backend == "native" and "LOCALRUN_NATIVE_ON_CPU=1" in c.reason
    # an architecture the native engine does not run, a vision model, a GPU: unchanged
    assert choose("auto", "gguf", None, None, arch="mamba", native_on_cpu=True).backend == "llamacpp"
    assert choose("auto", "gguf", None, None, arch="llama", vision=True, native_on_cpu=True).backend == "llamacpp"
    assert choose("auto", "gguf", SMALL, facts("Q4_K_M", 8.03e9, 4.9e9), llamacpp_gpu=False,
                  native_on_cpu=True).backend == "llamacpp"
    assert settings({"LOCALRUN_NATIVE_ON_CPU": "1"}).native_on_cpu
    assert not settings({}).native_on_cpu
    with pytest.raises(ValueError, match="LOCALRUN_NATIVE_ON_CPU"):
        settings({"LOCALRUN_NATIVE_ON_CPU": "maybe"})
    assert dict(settings({"LOCALRUN_NATIVE_ON_CPU": "1"}).describe())["LOCALRUN_NATIVE_ON_CPU"] == "1"
