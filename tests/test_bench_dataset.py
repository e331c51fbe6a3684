"""ShareGPT sampling (vLLM's method), the truncated-JSON reader and prompt files."""

from __future__ import annotations

import json
import random

import pytest

from localrun.bench import dataset as ds
from localrun.bench.cli import main as bench_main


def words(n: int, tag: str) -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


def encode_words(text: str) -> list[int]:
    """A whitespace tokenizer: one id per word (makes the expected filter outcome exact)."""
    return [len(w) for w in text.split()]


def conv(prompt: str, answer: str | None, extra_turns: int = 0, rid: str = "x") -> dict:
    prompt = f"{rid}: {prompt[prompt.index(' ') + 1:]}" if " " in prompt else prompt  # unique, same word count
    turns = [{"from": "human", "value": prompt}]
    if answer is not None:
        turns.append({"from": "gpt", "value": answer})
    turns += [{"from": "human", "value": "more"}] * extra_turns
    return {"id": rid, "conversations": turns}


@pytest.fixture
def synthetic(tmp_path):
    """A ShareGPT-shaped file cut mid-record, plus the records that are whole."""
    recs = [
        conv(words(10, "one"), None, rid="single-turn"),          # < 2 turns: never a candidate
        {"id": "no-conv"},                                         # malformed: skipped
        conv(words(3, "p"), words(50, "a"), rid="short-prompt"),   # prompt < 4
        conv(words(50, "p"), words(3, "a"), rid="short-output"),   # output < 4
        conv(words(1025, "p"), words(10, "a"), rid="long-prompt"), # prompt > 1024
        conv(words(1000, "p"), words(1049, "a"), rid="too-long"),  # total 2049 > 2048
        conv(words(1000, "p"), words(1048, "a"), rid="edge-total"),  # total 2048: kept
        conv(words(1024, "p"), words(4, "a"), rid="edge-prompt"),  # prompt 1024, output 4: kept
        conv(words(4, "p"), words(4, "a"), 3, rid="edge-min"),     # 4 / 4, extra turns ignored: kept
    ]
    recs += [conv(words(5 + i, f"q{i}_"), words(7 + 2 * i, f"r{i}_"), rid=f"n{i}") for i in range(20)]
    whole = json.dumps(recs, indent=2)
    tail = json.dumps(conv(words(30, "lost"), words(30, "gone"), rid="truncated"), indent=2)
    text = whole[:-1].rstrip() + ",\n" + tail[: len(tail) // 2]  # cut inside the last record
    path = tmp_path / "sharegpt.json"
    path.write_text(text, encoding="utf-8")
    return path, recs


def test_reader_recovers_whole_records_of_a_truncated_file(synthetic):
    path, recs = synthetic
    for chunk in (7, 64, 1 << 20):  # chunk edges everywhere: inside strings, between records
        got = list(ds.iter_json_array(path, chunk_chars=chunk))
        assert got == recs, chunk


def test_reader_handles_a_complete_array_and_rejects_non_arrays(tmp_path):
    p = tmp_path / "ok.json"
    p.write_text('[ {"a": 1} , {"b": [1, 2]} ]\n')
    assert list(ds.iter_json_array(p, chunk_chars=3)) == [{"a": 1}, {"b": [1, 2]}]
    bad = tmp_path / "bad.json"
    bad.write_text('{"a": 1}')
    with pytest.raises(ds.DatasetError, match="JSON array"):
        list(ds.iter_json_array(bad))


def test_sampling_matches_vllm_filters_and_order(synthetic):
    path, recs = synthetic
    # vLLM, independently: >= 2 turns, (turn0, turn1), random.seed(0); random.shuffle; filter; take N.
    pairs = [(r["conversations"][0]["value"], r["conversations"][1]["value"])
             for r in recs if len(r.get("conversations", [])) >= 2]
    random.seed(0)
    random.shuffle(pairs)
    expected = []
    for p, c in pairs:
        pl, ol = len(p.split()), len(c.split())
        if pl < 4 or ol < 4 or pl > 1024 or pl + ol > 2048:
            continue
        expected.append((p, pl, ol))

    got = ds.sample_sharegpt(encode_words, len(expected), dataset=path)
    assert [(r.prompt, r.prompt_len, r.output_len) for r in got.requests] == expected
    kept_ids = {r["id"] for r in recs if r.get("conversations") and
                any(r["conversations"][0]["value"] == e[0] for e in expected)}
    assert {"edge-total", "edge-prompt", "edge-min"} <= kept_ids
    assert not kept_ids & {"single-turn", "short-prompt", "short-output", "long-prompt", "too-long"}
    assert len(expected) == 23  # 20 normal + 3 edge cases
    assert got.meta["conversations"] == len(pairs)
    assert got.input_tokens == sum(e[1] for e in expected)
    assert got.output_tokens == sum(e[2] for e in expected)

    first5 = ds.sample_sharegpt(encode_words, 5, dataset=path)
    assert [r.prompt for r in first5.requests] == [e[0] for e in expected[:5]]

    with pytest.raises(ds.DatasetError, match="only 23 conversations pass"):
        ds.sample_sharegpt(encode_words, 24, dataset=path)


def test_prompt_file_round_trip_and_errors(tmp_path, synthetic):
    path, _ = synthetic
    ps = ds.sample_sharegpt(encode_words, 6, dataset=path)
    for name in ("p.jsonl", "p.jsonl.gz"):
        out = tmp_path / name
        ds.write_prompt_file(out, ps)
        back = ds.read_prompt_file(out)
        assert [(r.prompt, r.prompt_token_ids, r.output_len) for r in back.requests] == \
               [(r.prompt, r.prompt_token_ids, r.output_len) for r in ps.requests]
        assert back.meta["seed"] == 0
        assert len(ds.read_prompt_file(out, 3).requests) == 3
        with pytest.raises(ds.DatasetError, match="holds 6 prompts, 7 requested"):
            ds.read_prompt_file(out, 7)
    junk = tmp_path / "junk.jsonl"
    junk.write_text('{"prompt": "x"}\n')
    with pytest.raises(ds.DatasetError, match="junk.jsonl:1"):
        ds.read_prompt_file(junk)


def test_packaged_sharegpt_decodes_about_17k_conversations():
    pairs = ds.load_conversations(ds.sharegpt_path())
    assert 17_000 < len(pairs) < 18_000


def test_bundled_prompt_file_is_vllm_sampled():
    ps = ds.read_prompt_file(ds.Path(__file__).resolve().parents[1] / "localrun/bench/data/sharegpt-smollm2-1000.jsonl.gz")
    assert len(ps.requests) == 1000 and ps.meta["seed"] == 0
    for r in ps.requests:
        assert 4 <= r.prompt_len <= 1024 and r.output_len >= 4 and r.prompt_len + r.output_len <= 2048


def test_sample_cli_with_the_real_tokenizer(tmp_path, synthetic, smollm2_gguf, capsys):
    path, _ = synthetic
    out = tmp_path / "prompts.jsonl"
    rc = bench_main(["sample", "--tokenizer", str(smollm2_gguf), "--dataset", str(path), "--num-prompts", "5",
                     "--output", str(out)])
    assert rc == 0
    ps = ds.read_prompt_file(out)
    tok = ds.load_hf_tokenizer(smollm2_gguf)
    for r in ps.requests:
        assert r.prompt_token_ids == tok(r.prompt).input_ids
    assert "wrote 5 prompts" in capsys.readouterr().out
    # bad input: a clear message and exit 1, never a traceback
    assert bench_main(["sample", "--tokenizer", str(smollm2_gguf), "--dataset", str(tmp_path / "nope.json"),
                       "--output", str(out)]) == 1
    assert "dataset file not found" in capsys.readouterr().err
