"""`localrun bench throughput | prefix | startup --target engine` on CPU at tiny sizes: each
mode runs the real engine (SmolLM2) and its arithmetic is right."""

from __future__ import annotations

import json
import math

import pytest

from localrun.bench import dataset as ds
from localrun.bench.cli import main as bench_main

# Short real conversations: with the SmolLM2 tokenizer every prompt and answer is 4..12 tokens.
CONVS = [
    ("What is the capital of France?", "The capital of France is Paris."),
    ("Name a primary color.", "Red is a primary color."),
    ("hi", "Hello there, how can I help?"),  # prompt < 4 tokens: filtered out
    ("How many legs does a spider have?", "A spider has eight legs."),
    ("Translate 'cat' into German.", "Die Katze, or simply Katze."),
    ("What is two plus two?", "Two plus two is four."),
    ("Is the sun a star?", "Yes"),  # output < 4 tokens: filtered out
    ("Who wrote Hamlet?", "William Shakespeare wrote Hamlet."),
]


@pytest.fixture(scope="module")
def sharegpt_file(tmp_path_factory):
    recs = [{"id": f"c{i}", "conversations": [{"from": "human", "value": p}, {"from": "gpt", "value": a}]}
            for i, (p, a) in enumerate(CONVS)]
    path = tmp_path_factory.mktemp("data") / "sharegpt.json"
    path.write_text(json.dumps(recs)[:-1] + ', {"id": "cut", "conversations": [{"from": "hu', encoding="utf-8")
    return path


def run_json(argv: list[str], capsys) -> dict:
    rc = bench_main(argv + ["--json"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err[-2000:]
    return json.loads(captured.out)


def check_rates(r: dict, requests: int, inp: int, out: int) -> None:
    t = r["elapsed_s"]
    assert t > 0
    assert math.isclose(r["requests_per_s"], requests / t, rel_tol=1e-9)
    assert math.isclose(r["input_tok_s"], inp / t, rel_tol=1e-9)
    assert math.isclose(r["output_tok_s"], out / t, rel_tol=1e-9)
    assert math.isclose(r["total_tok_s"], (inp + out) / t, rel_tol=1e-9)


def test_throughput_with_transformers_baseline(smollm2_gguf, sharegpt_file, tmp_path, capsys):
    out_file = tmp_path / "bench.jsonl"
    res = run_json(["throughput", "--model", str(smollm2_gguf), "--dataset", str(sharegpt_file),
                    "--num-prompts", "4", "--warmup", "1", "--baseline", "transformers",
                    "--hf-max-batch-size", "2", "--out", str(out_file), "--threads", "1", "--fused-sampling"], capsys)
    assert res["engine_config"]["fused_sampling"] is True  # (inert on CPU: it needs the Triton kernels)

    # The expected workload, independently: vLLM's sampling with the HF tokenizer of the same GGUF.
    tok = ds.load_hf_tokenizer(smollm2_gguf)
    expected = ds.sample_sharegpt(ds.hf_encoder(tok), 4, dataset=sharegpt_file)
    assert all(4 <= r.prompt_len and r.output_len >= 4 for r in expected.requests)
    w = res["workload"]
    assert (w["num_prompts"], w["input_tokens"], w["output_tokens"]) == \
           (4, expected.input_tokens, expected.output_tokens)

    eng = res["engine"]
    (p,) = eng["passes"]
    # token counts equal what the engine generated (ignore_eos, max_tokens = real length)
    assert p["mismatched_requests"] == 0
    assert (p["input_tokens"], p["output_tokens"]) == (expected.input_tokens, expected.output_tokens)
    assert (eng["input_tokens"], eng["output_tokens"], eng["requests"]) == (p["input_tokens"], p["output_tokens"], 4)
    check_rates(p, 4, p["input_tokens"], p["output_tokens"])
    check_rates(eng, 4, eng["input_tokens"], eng["output_tokens"])
    assert eng["peak_rss_bytes"] > 100 << 20 and eng["cuda_max_memory_allocated_bytes"] is None

    base = res["baseline"]
    assert base["name"] == "transformers" and base["batches"] == 2
    assert (base["input_tokens"], base["output_tokens"]) == (expected.input_tokens, expected.output_tokens)
    assert base["generated_tokens_incl_padding"] >= expected.output_tokens
    check_rates(base, 4, base["input_tokens"], base["output_tokens"])
    assert math.isclose(res["ratio_total_tok_s"], eng["total_tok_s"] / base["total_tok_s"], rel_tol=1e-9)

    lines = out_file.read_text().splitlines()
    assert len(lines) == 1
    saved = json.loads(lines[0])
    assert saved["mode"] == "throughput" and saved["engine"]["output_tokens"] == expected.output_tokens
    env = saved["env"]
    assert env["machine"]["cores"] >= 1 and env["machine"]["ram_bytes"] > 0 and env["device"] == "cpu"
    assert env["versions"]["torch"] and env["versions"]["transformers"] and env["versions"]["localrun"]
    assert env["git_commit"]


def test_prefix_cache_on_vs_off(capsys):
    res = run_json(["prefix", "--random-weights", "--shape", "smollm2-135m", "--system-len", "64",
                    "--num-questions", "3", "--question-len", "4", "--chats", "2", "--turns", "2",
                    "--user-len", "12", "--max-tokens", "5", "--no-save", "--threads", "1"], capsys)
    on, off = res["cache_on"], res["cache_off"]
    for run in (on, off):
        s = run["shared"]
        assert s["requests"] == 3 and s["prompt_tokens"] == 3 * (64 + 4) and s["output_tokens"] == 3 * 5
        m = run["multiturn"]
        # turn 1: 12 user tokens; turn 2: 12 + 5 answer + 12 user tokens, for 2 chats
        assert m["requests"] == 4 and m["prompt_tokens"] == 2 * 12 + 2 * 29 and m["output_tokens"] == 4 * 5
        for r in (s, m):
            assert math.isclose(r["total_tok_s"], (r["prompt_tokens"] + r["output_tokens"]) / r["elapsed_s"])
            assert math.isclose(r["hit_rate"], r["cached_tokens"] / r["prompt_tokens"])
            assert r["ttft_ms_p50"] > 0
    assert off["shared"]["cached_tokens"] == 0 and off["multiturn"]["cached_tokens"] == 0
    # cache on: questions 2 and 3 reuse the 64-token system prompt (4 whole pages of 16);
    # turn 2 of each chat reuses turn 1's history (its first whole page)
    assert on["shared"]["cached_tokens"] == 2 * 64
    assert on["multiturn"]["cached_tokens"] == 2 * 16
    assert math.isclose(res["speedup"]["shared"]["throughput_x"],
                        on["shared"]["total_tok_s"] / off["shared"]["total_tok_s"])


def test_startup_engine_cold_start(capsys):
    res = run_json(["startup", "--target", "engine", "--random-weights", "--shape", "smollm2-135m",
                    "--runs", "1", "--no-save", "--threads", "1"], capsys)
    (run,) = res["runs"]
    assert 0 < run["import_s"] < run["first_token_s"] <= run["process_exit_s"]
    assert run["load_s"] > 0 and run["engine_weights_s"] > 0
    assert run["triton_cache"] == "cold" and res["first_run_cold_s"] == run["first_token_s"]
    assert res["first_token_s_min"] == res["first_token_s_max"] == run["first_token_s"]


def test_bad_arguments_give_clear_errors(tmp_path, capsys):
    assert bench_main(["throughput", "--model", str(tmp_path / "missing")]) == 1
    assert "missing" in capsys.readouterr().err
    assert bench_main(["throughput", "--random-weights", "--shape", "nope"]) == 1
    assert "unknown --shape" in capsys.readouterr().err
    assert bench_main(["serve", "--concurrency", "0,1"]) == 2  # argparse usage error
    assert "positive" in capsys.readouterr().err


BLOCKER = r"""
import sys, importlib.abc
BLOCK = {"fastapi", "uvicorn", "pydantic", "gguf", "platformdirs", "textual", "llama_cpp"}
class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in BLOCK:
            raise ImportError(f"{name} is not installed on a GPU box")
sys.meta_path.insert(0, Blocker())
from localrun.bench.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_throughput_random_weights_without_server_dependencies(tmp_path):
    """The GPU-box path: a sampled prompt file, a random model of a named shape, and an
    interpreter where the server stack (fastapi, pydantic, gguf, ...) cannot be imported."""
    import subprocess
    import sys

    src = ds.read_prompt_file(ds.Path(__file__).resolve().parents[1] / "localrun/bench/data/sharegpt-smollm2-1000.jsonl.gz")
    short = [r for r in src.requests if r.prompt_len <= 24][:2]
    for r in short:
        r.output_len = 2 + r.prompt_len % 3  # tiny outputs for CPU
    pf = tmp_path / "p.jsonl"
    ds.write_prompt_file(pf, ds.PromptSet(short, {"seed": 0}))
    out = tmp_path / "r.jsonl"
    p = subprocess.run([sys.executable, "-c", BLOCKER, "throughput", "--random-weights", "--shape", "smollm2-135m",
                        "--prompts", str(pf), "--num-prompts", "2", "--warmup", "1", "--passes", "2",
                        "--threads", "1", "--out", str(out)], capture_output=True, text=True, timeout=300,
                       cwd=ds.Path(__file__).resolve().parents[1])
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads(out.read_text())
    eng = res["engine"]
    assert res["model"] == "random:smollm2-135m" and len(eng["passes"]) == 2
    inp, outp = sum(r.prompt_len for r in short), sum(r.output_len for r in short)
    for ps in eng["passes"]:
        assert (ps["input_tokens"], ps["output_tokens"], ps["mismatched_requests"]) == (inp, outp, 0)
        assert ps["cached_tokens"] == 0  # the prefix cache is cleared before each pass
    # two passes: rates are all tokens over all generate time
    total_t = sum(ps["elapsed_s"] for ps in eng["passes"])
    assert math.isclose(eng["total_tok_s"], 2 * (inp + outp) / total_t, rel_tol=1e-9)
    assert math.isclose(eng["elapsed_s"], total_t / 2, rel_tol=1e-9)


def test_prefix_host_tier_round_robin(capsys):
    res = run_json(["prefix", "--host-tier", "--random-weights", "--shape", "tiny", "--page-size", "4",
                    "--kv-cache-tokens", "32", "--turns", "3", "--user-len", "4", "--max-tokens", "2",
                    "--max-model-len", "128", "--host-cache", "1MiB", "--no-save", "--threads", "1"], capsys)
    w, on, off = res["workload"], res["host_on"], res["host_off"]
    # device pool: 8 + 1 pages of 4 = 36 tokens; a chat ends at 3 x (4 + 2) = 18 tokens: 6 chats = 3x the pool
    assert on["device_pool_tokens"] == off["device_pool_tokens"] == 36 and w["chats"] == 6
    for r in (on, off):
        assert r["requests"] == 18 and r["prompt_tokens"] == 6 * (4 + 10 + 16) and r["output_tokens"] == 18 * 2
        assert r["prefill_tokens"] == r["prompt_tokens"] - r["cached_tokens"]
        assert r["engine_stats"]["prefix_hit_tokens"] == r["cached_tokens"]
    assert off["engine_stats"]["prefix_host_hit_tokens"] == 0 and off["engine_stats"]["host_pages_total"] == 0
    # host tier: every whole page of every history comes back (turn 2: 1 page, turn 3: 2 pages, per chat)
    assert on["cached_tokens"] == 6 * (4 + 8) > off["cached_tokens"]
    assert on["engine_stats"]["prefix_host_hit_tokens"] > 0
    assert math.isclose(res["speedup"]["elapsed_x"], off["elapsed_s"] / on["elapsed_s"])
