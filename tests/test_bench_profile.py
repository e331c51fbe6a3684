"""`localrun bench profile` for real at a tiny shape on the CPU: every step of a batch's generation timed in
its phases through the engine's public step methods; the table's numbers add up."""

from __future__ import annotations

import json
import math

from localrun.bench.cli import main
from localrun.bench.step_profile import PHASES


def test_profile_times_every_step_in_phases(capsys):
    rc = main(["profile", "--random-weights", "--shape", "tiny", "--batch", "3", "--prompt-len", "12", "--steps", "5",
               "--device", "cpu", "--kv-cache-tokens", "1024", "--max-model-len", "256", "--threads", "1",
               "--kernels", "5", "--no-save", "--json"])
    out = capsys.readouterr()
    assert rc == 0, out.err[-3000:]
    res = json.loads(out.out)
    assert res["mode"] == "profile" and res["device"] == "cpu" and res["overlap"] is False
    assert (res["batch"], res["prompt_len"], res["steps_per_request"]) == (3, 12, 5)
    kinds = res["kinds"]
    assert set(kinds) == {"prefill", "decode"}, kinds
    # one prefill step for the three prompts (they fit one batch); each of the next four tokens a decode step
    assert kinds["prefill"]["steps"] == 1 and kinds["prefill"]["tokens_mean"] == 36
    assert kinds["decode"]["steps"] == 4 and kinds["decode"]["rows_mean"] == 3 == kinds["decode"]["tokens_mean"]
    assert res["steps"] == 5
    step_ms = 0.0
    for kind in kinds.values():
        ph = kind["phases"]
        assert set(ph) == {*PHASES, "total"}
        for name, v in ph.items():
            for key in ("mean_ms", "p50_ms", "p95_ms", "total_ms"):
                assert math.isfinite(v[key]) and v[key] >= 0, (name, v)
        assert ph["launch"]["total_ms"] > 0 and ph["total"]["mean_ms"] > 0
        assert math.isclose(sum(ph[p]["total_ms"] for p in PHASES), ph["total"]["total_ms"], rel_tol=1e-6)
        assert math.isclose(sum(ph[p]["share"] for p in PHASES), 1.0, rel_tol=1e-6)
        step_ms += ph["total"]["total_ms"]
    assert math.isclose(step_ms, res["step_ms_sum"], rel_tol=1e-6)
    assert 0 < res["step_ms_sum"] <= 1000 * res["wall_s"]
    assert "profile: random:tiny on cpu" in out.err and "launch" in out.err
    ops = res["top_ops"]  # --kernels 5: the ops of one more run under torch.profiler
    assert len(ops) == 5 and all(o["op"] and o["calls"] > 0 and o["self_ms"] >= 0 for o in ops)
    assert ops[0]["where"] == "host" and ops[0]["self_ms"] == max(o["self_ms"] for o in ops) > 0
