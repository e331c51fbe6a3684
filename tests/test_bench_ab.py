"""`localrun bench ab` for real at a tiny shape on the CPU: a git revision checked out against this tree with
an engine option changed, each trial a fresh process, alternated, in an interpreter that cannot import the
server stack (as on the GPU box); the results file's structure and numbers. And its arithmetic: the A,B,B,A
order and the bootstrap interval of the difference of medians."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from localrun.bench.ab import compare, order

ROOT = Path(__file__).resolve().parents[1]
BLOCKER = """
import importlib.abc, sys
class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in {"fastapi", "uvicorn", "pydantic", "gguf", "platformdirs", "textual", "llama_cpp"}:
            raise ImportError(f"{name} is not installed on a GPU box")
sys.meta_path.insert(0, Blocker())
"""


def test_order_alternates_which_side_goes_first():
    assert order(1) == ["a", "b"]
    assert order(3) == ["a", "b", "b", "a", "a", "b"]


def test_compare_medians_and_interval():
    a, b = [10.0, 11.0, 12.0, 10.5], [8.0, 8.5, 9.0, 8.2]
    c = compare(a, b, "lower", level=0.9, seed=1)
    assert c["a_median"] == 10.75 and math.isclose(c["b_median"], 8.35)
    assert math.isclose(c["diff"], 8.35 - 10.75) and math.isclose(c["diff_pct"], 100 * (8.35 - 10.75) / 10.75)
    lo, hi = c["interval"]
    assert lo <= c["diff"] <= hi < 0 and c["verdict"] == "B better"
    assert compare(a, b, "higher", seed=1)["verdict"] == "B worse"
    assert compare(a, b, "lower", seed=1) == compare(a, b, "lower", seed=1)  # seeded
    same = compare([1.0, 2.0, 3.0], [1.5, 2.5, 2.0], "lower")
    assert same["interval"][0] <= 0 <= same["interval"][1] and same["verdict"].startswith("no difference")
    one = compare([1.0], [2.0], "lower")
    assert one["interval"] is None and one["verdict"].startswith("one trial a side")


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs a git checkout")
def test_ab_of_a_revision_and_this_tree(tmp_path):
    out = tmp_path / "ab.json"
    (tmp_path / "sitecustomize.py").write_text(BLOCKER)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LOCALRUN_", "TRITON_"))}
    env["PYTHONPATH"] = f"{tmp_path}{os.pathsep}{ROOT}"
    p = subprocess.run([sys.executable, "-m", "localrun.bench", "ab", "--measure", "decode", "--rounds", "1",
                        "--device", "cpu", "--shape", "tiny", "--prompt-len", "8", "--output-len", "4", "--batch", "2",
                        "--repeats", "1", "--a-rev", "HEAD", "--b-engine", "max_num_seqs=8", "--engine",
                        "max_model_len=256", "--a-env", "OMP_NUM_THREADS=1", "--b-env", "OMP_NUM_THREADS=1",
                        "--output", str(out), "--json"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    res = json.loads(out.read_text())
    assert json.loads(p.stdout) == {**res, "saved_to": str(out)}
    assert res["mode"] == "ab" and res["measure"] == "decode" and res["unit"] == "ms" and res["device"] == "cpu"
    assert res["shape"] == "tiny" and res["order"] == ["a", "b"] and res["rounds"] == 1
    assert res["sizes"] == {"prompt_len": 8, "output_len": 4, "batch": 2, "repeats": 1}
    a, b = res["sides"]["a"], res["sides"]["b"]
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    assert a["rev"] == head.strip() and a["root"] and "rev HEAD" in a["what"]
    assert b["rev"] is None and b["root"] is None and "this tree" in b["what"]
    assert a["engine"] == {"max_model_len": 256} and b["engine"] == {"max_model_len": 256, "max_num_seqs": 8}
    assert a["env"] == b["env"] == {"OMP_NUM_THREADS": "1"}
    assert [t["side"] for t in res["trials"]] == ["a", "b"]
    ta, tb = res["trials"]
    assert ta["localrun"] != tb["localrun"] and tb["localrun"] == str(ROOT / "localrun")  # each side's own code
    assert tb["engine"] == b["engine"]
    for t in res["trials"]:
        assert t["better"] == "lower" and len(t["samples"]) == 1 and t["build_s"] > 0
        assert math.isfinite(t["value"]) and t["value"] > 0
    c = res["comparison"]
    assert c["a_median"] == ta["value"] and c["b_median"] == tb["value"]
    assert math.isclose(c["diff"], tb["value"] - ta["value"]) and c["interval"] is None
    assert "B - A" in p.stderr and "ab: decode" in p.stderr


def test_ab_refuses_a_bad_side(tmp_path, capsys):
    from localrun.bench.cli import main

    assert main(["ab", "--measure", "ttft", "--a-path", str(tmp_path), "--output", str(tmp_path / "x.json")]) == 1
    assert "no localrun/__init__.py" in capsys.readouterr().err
    assert main(["ab", "--measure", "ttft", "--b-env", "NOEQUALS", "--output", str(tmp_path / "x.json")]) == 1
    assert "KEY=VALUE" in capsys.readouterr().err
