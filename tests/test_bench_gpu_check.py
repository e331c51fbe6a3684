"""`localrun bench gpu-check` end to end on CPU at toy sizes (--tiny), in an interpreter where the
server stack (fastapi, pydantic, gguf, ...) cannot be imported, as on the GPU box (a meta-path
blocker in a sitecustomize on PYTHONPATH, so the item processes it starts are blocked too); its
per-item time budgets and error records; and the benchmarks' exact token counts."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
transformers = pytest.importorskip("transformers")

BLOCK = ("fastapi", "uvicorn", "pydantic", "gguf", "platformdirs", "textual", "llama_cpp")
SITECUSTOMIZE = f"""
import importlib.abc, sys
BLOCK = {set(BLOCK)!r}
class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in BLOCK:
            raise ImportError(f"{{name}} is not installed on a GPU box")
sys.meta_path.insert(0, Blocker())
"""


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory):
    """Real (if random) weights in a safetensors dir: the --parity-model of the GPU box."""
    import torch

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=300, max_position_embeddings=256,
                                   initializer_range=0.3)
    d = tmp_path_factory.mktemp("tiny-llama")
    transformers.LlamaForCausalLM(cfg).save_pretrained(d, safe_serialization=True)
    return d


@pytest.fixture(scope="module")
def gpu_box_env(tmp_path_factory) -> dict[str, str]:
    """An environment whose Python (and every Python it starts) cannot import the server stack."""
    d = tmp_path_factory.mktemp("blocker")
    (d / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LOCALRUN_", "TRITON_"))}
    env["PYTHONPATH"] = f"{d}{os.pathsep}{ROOT}"
    for mod in BLOCK:
        p = subprocess.run([sys.executable, "-c", f"import {mod}"], env=env, capture_output=True, text=True)
        assert p.returncode != 0 and "not installed on a GPU box" in p.stderr, (mod, p.stderr[-500:])
    return env


def _gpu_check(env, out: Path, *args: str, timeout: float = 300) -> tuple[subprocess.CompletedProcess, dict]:
    p = subprocess.run([sys.executable, "-m", "localrun.bench", "gpu-check", "--tiny", "--out", str(out), *args],
                       capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
    (path,) = out.glob("gpu-check-*.json")
    assert path.name == "gpu-check-cpu-tiny.json"
    return p, json.loads(path.read_text())


def test_gpu_check_runs_every_item_without_server_dependencies(tmp_path, tiny_llama_dir, gpu_box_env):
    t0 = time.monotonic()
    p, res = _gpu_check(gpu_box_env, tmp_path / "results", "--parity-model", str(tiny_llama_dir))
    took = time.monotonic() - t0
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    items = res["items"]
    assert list(items) == ["kernel_parity", "greedy_parity", "graph_capture", "throughput", "ttft_512", "itl",
                           "prefix", "moe", "coldstart"]
    assert res["complete"] and res["device"] == "cpu" and res["env"]["device"] == "cpu" and res["sizes"] == "tiny"
    assert re.fullmatch(r"[0-9a-f]{40}(-dirty)?", res["commit"]), res["commit"]
    for name, item in items.items():
        assert item["status"] in ("pass", "skipped"), (name, item)
        assert item["seconds"] > 0 and item.get("target") or item["status"] == "skipped", (name, item)

    kp = items["kernel_parity"]
    if importlib.util.find_spec("triton") is not None:  # the kernels in Triton's interpreter, each checked
        assert kp["status"] == "pass" and kp["where"].startswith("CPU, Triton's interpreter"), kp
        names = " ".join(c["case"] for c in kp["cases"])
        for op in ("paged_decode_attention", "extend_attention", "fused_add_rmsnorm", "rms_norm", "apply_rope",
                   "silu_and_mul", "gelu_tanh_and_mul", "store_kv", "gemv", "fused_moe", "moe_route", "swiglu_oai"):
            assert op in names, op
        assert all(c["passed"] and c["max_rel_err"] <= 1e-5 for c in kp["cases"]), kp["cases"]
    else:
        assert kp["status"] == "skipped" and kp["reason"].startswith("skipped: no GPU"), kp

    gp = items["greedy_parity"]
    for kind in ("real_weights", "random_init"):  # float32 on CPU: the tokens agree exactly
        par = gp[kind]
        assert par["passed"] and par["top1_agreement"] == 1.0 and par["max_abs_logprob_diff"] < 1e-3, par
    assert gp["real_weights"]["model"] == tiny_llama_dir.name and gp["value"] == 1.0

    gc = items["graph_capture"]  # no CUDA: the padded decode path, prepared eagerly
    assert gc["status"] == "skipped" and gc["reason"].startswith("skipped: no GPU") and gc["batch_sizes"], gc
    assert gc["captured"] == [] and gc["graphs_s"] > 0

    tp = items["throughput"]
    assert tp["requests"] == 8 and tp["passes"][0]["mismatched_requests"] == 0 and tp["total_tok_s"] > 0
    assert tp["value"] == tp["total_tok_s"] and tp["target"] == ">= 20000 total tok/s" and tp["target_met"] is None
    assert tp["engine_config"]["cuda_graphs"] and tp["engine_config"]["overlap"]  # the GPU paths, run eagerly
    assert "SGLang" in tp["published"]
    tt = items["ttft_512"]
    assert tt["requests"] == 3 and len(tt["ttft_ms_all"]) == 3 and tt["value"] == tt["ttft_ms_p50"] > 0
    assert items["itl"]["itl_output_tokens"] == 12 and items["itl"]["value"] > 0
    pre = items["prefix"]
    assert pre["cache_on"]["cached_tokens"] > 0 == pre["cache_off"]["cached_tokens"]
    moe = items["moe"]  # a tiny Qwen3-MoE (its experts through the torch reference on a CPU): both measurements
    assert moe["model"].startswith("tiny qwen3_moe") and moe["experts"] == "8, top-2, 64 -> 32", moe
    assert moe["throughput"]["requests"] == 8 and moe["throughput"]["passes"][0]["mismatched_requests"] == 0
    assert moe["value"] == moe["throughput"]["total_tok_s"] > 0 and moe["itl"]["itl_output_tokens"] == 12
    assert moe["throughput"]["model_tflops"] > 0 and moe["active_params"] < moe["params"]
    assert moe["target"] == ">= 10000 total tok/s and ITL <= 5 ms p50" and moe["target_met"] is None
    assert "vllm-project/vllm#23151" in moe["published"]
    cold = items["coldstart"]
    assert [r["triton_cache"] for r in cold["runs"]] == ["cold", "warm"]
    assert cold["first_run_cold_s"] == cold["runs"][0]["first_token_s"] == cold["value"] > 0
    assert took < 240, took


def test_gpu_check_stops_an_item_past_its_budget_and_records_failures(tmp_path, gpu_box_env):
    # budgets no item can meet (0.2-0.6 s each, 3 s for the run): each is stopped and recorded, the run ends
    t0 = time.monotonic()
    p, res = _gpu_check(gpu_box_env, tmp_path / "a", "--skip", "kernel_parity,greedy_parity,prefix,moe,coldstart",
                        "--budget-scale", "0.01", timeout=60)
    assert p.returncode == 1 and "graph_capture" in p.stdout, p.stdout[-2000:]
    assert time.monotonic() - t0 < 30
    items = res["items"]
    assert items["graph_capture"]["status"] == "timed out" and items["graph_capture"]["error"] == "timed out after 0.3 s"
    for name in ("throughput", "ttft_512", "itl"):
        assert items[name]["status"] == "timed out", items[name]
        assert re.fullmatch(r"timed out after 0\.\d+ s|not started: the run's time budget of 3 s was spent",
                            items[name]["error"]), items[name]
    for name in ("kernel_parity", "greedy_parity", "prefix", "moe", "coldstart"):
        assert items[name] == {"status": "skipped", "reason": "skipped: --skip"}

    # an item that fails is recorded with its error's last lines, and the items after it still run
    p, res = _gpu_check(gpu_box_env, tmp_path / "b", "--skip", "kernel_parity,greedy_parity,prefix,moe,coldstart",
                        "--prompts", str(tmp_path / "missing.jsonl"))
    assert p.returncode == 1, p.stdout[-2000:]
    items = res["items"]
    tp = items["throughput"]
    assert tp["status"] == "error" and "missing.jsonl" in tp["error"] and "Traceback" in tp["error_tail"], tp
    assert items["graph_capture"]["status"] == "skipped" and items["ttft_512"]["status"] == "pass"
    assert items["itl"]["status"] == "pass"


def test_gpu_check_refuses_a_full_run_without_a_gpu(capsys):
    from localrun.bench.cli import main

    if __import__("torch").cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert main(["gpu-check", "--out", "/nonexistent"]) == 1
    assert "--tiny" in capsys.readouterr().err
    assert main(["gpu-check", "--tiny", "--skip", "nope"]) == 1
    assert "unknown --skip" in capsys.readouterr().err
    assert main(["gpu-check", "--tiny", "--quick"]) == 1
    assert "give one" in capsys.readouterr().err


def test_throughput_fails_when_token_counts_differ(tmp_path, capsys):
    from localrun.bench import dataset as ds
    from localrun.bench.cli import main

    reqs = ds.read_prompt_file(ROOT / "localrun/bench/data/sharegpt-smollm2-1000.jsonl.gz", 40).requests
    short = [r for r in reqs if 20 <= r.prompt_len <= 30][:2]
    for r in short:
        r.output_len = 40  # more than the context window below leaves
    pf = tmp_path / "p.jsonl"
    ds.write_prompt_file(pf, ds.PromptSet(short, {"seed": 0}))
    rc = main(["throughput", "--random-weights", "--shape", "tiny", "--prompts", str(pf), "--num-prompts", "2",
               "--warmup", "0",
               "--max-model-len", "48", "--no-save"])
    assert rc == 1
    assert "did not produce exactly the tokens asked" in capsys.readouterr().err


def test_cpu_bench_moved_out_of_the_engine(capsys):
    from localrun.bench.cli import main

    assert not (ROOT / "localrun/engine/bench_cpu.py").exists()
    engine_src = "\n".join(p.read_text() for p in (ROOT / "localrun/engine").glob("*.py"))
    assert "localrun.bench" not in engine_src  # the engine never imports the benchmarks
    assert main(["cpu", "--gguf", "/nonexistent.gguf", "--skip-hf", "--skip-prefix"]) == 1
    assert "nonexistent" in capsys.readouterr().err


def test_gpu_check_records_an_item_whose_process_dies_and_goes_on(tmp_path, gpu_box_env):
    """A crash (here a SIGKILL of the item's process, as a segfault or the OOM killer would end it)
    costs that item only: recorded with its output's last lines, the next item runs in a new process."""
    import psutil

    out = tmp_path / "results"
    proc = subprocess.Popen([sys.executable, "-m", "localrun.bench", "gpu-check", "--tiny", "--out", str(out),
                             "--skip", "kernel_parity,greedy_parity,graph_capture,throughput,ttft_512,itl,moe"],
                            cwd=ROOT, env=gpu_box_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        child = None
        while child is None:
            assert time.monotonic() < deadline and proc.poll() is None, "the prefix item's process never started"
            for p in psutil.Process(proc.pid).children():
                try:
                    if "--child" in p.cmdline() and '"items": ["prefix"]' in " ".join(p.cmdline()):
                        child = p
                except psutil.Error:
                    pass
            time.sleep(0.05)
        time.sleep(1.0)  # importing torch, or building its engine
        child.kill()
        stdout, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1, stdout[-3000:]
    res = json.loads((out / "gpu-check-cpu-tiny.json").read_text())
    pre, cold = res["items"]["prefix"], res["items"]["coldstart"]
    assert pre["status"] == "error" and pre["error"] == "its process exited with code -9 before reporting", pre
    assert "error_tail" in pre and pre["seconds"] >= 1.0
    assert cold["status"] == "pass" and [r["triton_cache"] for r in cold["runs"]] == ["cold", "warm"], cold
