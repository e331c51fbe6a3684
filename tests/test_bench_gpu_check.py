"""`localrun bench gpu-check` end to end on CPU at toy sizes (--tiny), in an interpreter where the
server stack (fastapi, pydantic, gguf, ...) cannot be imported, as on the GPU box; and the
benchmark changes of issue #14: unique serve prompts, a cold first start, exact token counts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from test_bench_engine import BLOCKER

ROOT = Path(__file__).resolve().parents[1]
transformers = pytest.importorskip("transformers")


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


def test_gpu_check_runs_end_to_end_without_server_dependencies(tmp_path, tiny_llama_dir):
    out = tmp_path / "results"
    p = subprocess.run([sys.executable, "-c", BLOCKER, "gpu-check", "--tiny", "--out", str(out),
                        "--parity-model", str(tiny_llama_dir)],
                       capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    (path,) = out.glob("gpu-check-*.json")
    assert path.name == "gpu-check-cpu-tiny.json"
    res = json.loads(path.read_text())
    steps = res["steps"]
    assert set(steps) == {"coldstart", "parity", "throughput", "latency", "prefix"}
    assert not [k for k, v in steps.items() if "error" in v]
    cold = steps["coldstart"]
    assert [r["triton_cache"] for r in cold["runs"]] == ["cold", "warm"]
    assert cold["first_run_cold_s"] == cold["runs"][0]["first_token_s"] > 0
    for kind in ("real_weights", "random_init"):  # float32 on CPU: the tokens agree exactly
        par = steps["parity"][kind]
        assert par["passed"] and par["top1_agreement"] == 1.0 and par["max_abs_logprob_diff"] < 1e-3, par
    assert steps["parity"]["real_weights"]["model"] == tiny_llama_dir.name
    tp = steps["throughput"]
    assert tp["requests"] == 8 and tp["passes"][0]["mismatched_requests"] == 0 and tp["total_tok_s"] > 0
    assert tp["engine_config"]["cuda_graphs"] and tp["engine_config"]["overlap"]  # the GPU paths, run eagerly
    lat = steps["latency"]
    assert lat["itl_output_tokens"] == 12 and lat["itl_ms_p50"] > 0 and len(lat["ttft_ms_all"]) == 3
    pre = steps["prefix"]
    assert pre["cache_on"]["cached_tokens"] > 0 == pre["cache_off"]["cached_tokens"]
    summary = res["summary"]
    assert summary["total_tok_s"]["value"] == tp["total_tok_s"] and summary["total_tok_s"]["target"] == ">= 20000"
    assert res["env"]["device"] == "cpu" and res["device"] == "cpu"


def test_gpu_check_refuses_a_full_run_without_a_gpu(capsys):
    from localrun.bench.cli import main

    if __import__("torch").cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert main(["gpu-check", "--out", "/nonexistent"]) == 1
    assert "--tiny" in capsys.readouterr().err
    assert main(["gpu-check", "--tiny", "--skip", "nope"]) == 1
    assert "unknown --skip" in capsys.readouterr().err


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
