"""`localrun bench overhead`: the daemon vs llama-cpp-python called directly, at smoke length."""

import os

import pytest

pytestmark = pytest.mark.timeout(300)


def test_the_overhead_benchmark_runs(tmp_path):
    """The daemon-vs-direct benchmark (`localrun bench overhead`, run at full length by
    hand) at smoke length: both sides write the same greedy text and it prints its table. No budget
    is asserted (a shared CI machine's timings say little); the budgets are in its exit status."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("LOCALRUN_")}
    r = subprocess.run([sys.executable, "-m", "localrun.bench", "overhead", "--prompts", "2", "--max-tokens", "8",
                        "--max-overhead", "1000", "--max-ttft", "100000"], env={**env, "TMPDIR": str(tmp_path)},
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("text same") == 2, r.stdout
    assert "daemon overhead: tok/s" in r.stdout and "median of per-prompt pairs" in r.stdout, r.stdout
