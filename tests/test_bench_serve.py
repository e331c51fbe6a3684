"""`localrun bench serve` and `bench startup --target serve` against a real daemon
(llama.cpp + SmolLM2) over real HTTP on 127.0.0.1."""

from __future__ import annotations

import json
import math

import pytest

from localrun.bench.cli import main as bench_main
from localrun.bench.dataset import load_hf_tokenizer
from localrun.bench.serve import build_prompt
from test_server import MODEL, Daemon  # the daemon harness of the server tests


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("bench_home"), LOCALRUN_NUM_PARALLEL="2", LOCALRUN_CONTEXT_LENGTH="1024")
    try:
        d.pull(MODEL)
        yield d
    finally:
        d.stop()


def test_build_prompt_is_exactly_n_tokens(smollm2_gguf):
    tok = load_hf_tokenizer(smollm2_gguf)
    for n in (1, 16, 100):
        prompts = {build_prompt(n, seed, tok) for seed in range(3)}
        assert len(prompts) == 3  # distinct: no accidental prefix sharing between requests
        for p in prompts:
            assert len(tok.encode(p, add_special_tokens=False)) == n


def test_every_request_gets_a_prompt_of_its_own(smollm2_gguf):
    from localrun.bench.serve import PromptSource

    tok = load_hf_tokenizer(smollm2_gguf)
    src = PromptSource(64, tok)
    prompts = [src.next() for _ in range(300)]  # more than the old cycled pool of 4 x concurrency
    assert len(set(prompts)) == 300 and src.issued == 300
    # no two share a whole page (16 tokens) of prefix a cache could reuse
    heads = {tuple(tok.encode(p, add_special_tokens=False)[:16]) for p in prompts}
    assert len(heads) == 300


def test_bench_serve_ladder(daemon, smollm2_gguf, tmp_path, capsys):
    out = tmp_path / "r.jsonl"
    window = 6.0
    rc = bench_main(["serve", "--url", daemon.url + "/v1", "--model", MODEL, "--input-len", "16", "--output-len", "8",
                     "--concurrency", "1,2", "--warmup", "1", "--window", str(window), "--tokenizer", str(smollm2_gguf),
                     "--json", "--out", str(out)])
    cap = capsys.readouterr()
    assert rc == 0, cap.err[-2000:]
    res = json.loads(cap.out)
    assert res["model"] == MODEL and res["exact_input_len"] is True
    levels = res["levels"]
    assert [lv["concurrency"] for lv in levels] == [1, 2]
    # on a loaded 2-core CI box a level may finish few requests: the speed-independent part
    # is the arithmetic, checked on every level
    assert sum(lv["requests_finished_in_window"] for lv in levels) >= 1
    for lv in levels:
        assert lv["errors"] == 0 and lv["requests_sent"] >= lv["concurrency"]
        if lv["server_prompt_tokens_mean"] is not None:
            # the server counts exactly the prompt we built, and at most max_tokens outputs
            assert lv["server_prompt_tokens_mean"] == 16
            assert 1 <= lv["server_completion_tokens_mean"] <= 8
            assert lv["tokens_per_chunk"] >= 1.0
        assert math.isclose(lv["output_tokens_in_window"], lv["output_chunks_in_window"] * lv["tokens_per_chunk"])
        assert math.isclose(lv["output_tok_s"], lv["output_tokens_in_window"] / window)
        assert math.isclose(lv["requests_per_s"], lv["requests_finished_in_window"] / window)
        if lv["ttft_samples"]:
            assert 0 < lv["ttft_ms_p50"] <= lv["ttft_ms_p95"]
        if lv["itl_samples"]:
            assert 0 <= lv["itl_ms_p50"] <= lv["itl_ms_p95"]
    assert res["unique_prompts"] == 1 + sum(lv["requests_sent"] for lv in levels)  # the probe, then one each
    saved = json.loads(out.read_text().splitlines()[0])
    assert saved["mode"] == "serve" and saved["env"]["git_commit"]


def test_bench_serve_without_a_server_is_a_clear_error(capsys):
    from localrun.bench.startup import free_port

    rc = bench_main(["serve", "--url", f"http://127.0.0.1:{free_port()}/v1", "--window", "1", "--no-save"])
    assert rc == 1
    assert "no server answers" in capsys.readouterr().err


def test_bench_startup_serve(daemon, capsys):
    rc = bench_main(["startup", "--target", "serve", "--model", MODEL, "--home", str(daemon.home), "--runs", "1",
                     "--timeout", "120", "--json", "--no-save"])
    cap = capsys.readouterr()
    assert rc == 0, cap.err[-2000:]
    res = json.loads(cap.out)
    (run,) = res["runs"]
    assert 0 < run["ready_s"] < run["first_token_s"] < 120
    assert res["first_token_s_p50"] == run["first_token_s"]
