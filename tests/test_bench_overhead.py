"""`localrun bench overhead`: the daemon vs llama-cpp-python called directly, at smoke length."""

import os
import re

import pytest

pytestmark = pytest.mark.timeout(300)


def test_the_overhead_benchmark_runs(tmp_path):
    """The daemon-vs-direct benchmark (`localrun bench overhead`, run at full length by
    hand) at smoke length: both sides write the same greedy text and it prints its table. No budget
    is asserted (a shared CI machine's timings say little); the budgets are in its exit status."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("LOCALRUN_")}
    r = subprocess.run([sys.executable, "-m", "localrun.bench", "overhead", "--rounds", "2", "--prompts", "1",
                        "--max-tokens", "8", "--ttft-prompts", "1", "--max-overhead", "1000", "--max-ttft", "100000"],
                       env={**env, "TMPDIR": str(tmp_path)}, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    # two rounds, each a fresh daemon and a fresh direct Llama, pulled once into one temporary library
    assert r.stdout.count("a fresh daemon and a fresh direct Llama") == 2 and r.stdout.count("pulling") == 1, r.stdout
    assert r.stdout.count("text same") == 4, r.stdout  # 2 rounds x 1 prompt x (direct beside stdlib, beside httpx)
    assert not list(tmp_path.glob("localrun-bench-*")), "the temporary library is removed"
    for client in ("stdlib", "httpx"):
        assert f"daemon overhead ({client} client): tok/s" in r.stdout and "median of per-prompt pairs" in r.stdout
        assert "TTFT alone (2 prompts x 2 tokens, order alternating)" in r.stdout, r.stdout
        assert re.search(r"90% intervals of those medians \(bootstrap\): tok/s [-+][\d.]+% to [-+][\d.]+% \(2 pairs\), "
                         r"TTFT [-+][\d.]+ to [-+][\d.]+ ms \(2 pairs\)", r.stdout), r.stdout
        assert re.search(r"each round's pair medians \(tok/s / TTFT\): [-+][\d.]+% / [-+][\d.]+ ms, "
                         r"[-+][\d.]+% / [-+][\d.]+ ms\n", r.stdout), r.stdout
        # each side's prefill compute found (the runner's from /metrics, the direct one's around its decode)
        assert re.search(r"TTFT less each side's own prefill compute .*: daemon [-+][\d.]+ ms over direct, median of "
                         r"2 pairs", r.stdout), r.stdout
        assert re.search(r"the prefill itself: direct [\d.]+ ms, daemon's runner [\d.]+ ms", r.stdout), r.stdout
        # a long stream's time a token split into llama_decode's step and what is around it, each side
        m = re.search(r"a token's time outside llama_decode .*: direct ([\d.]+) ms, daemon ([\d.]+) ms .*: "
                      r"[-+][\d.]+ ms a token, [-+][\d.]+% of direct's step \(median of 2 pairs", r.stdout)
        assert m, r.stdout
        m2 = re.search(r"the decode step itself: direct ([\d.]+) ms, daemon's runner ([\d.]+) ms", r.stdout)
        assert m2, r.stdout
        # the decode step is milliseconds on any CPU; what is around it is less than the step
        assert all(float(x) > 0.5 for x in m2.groups()), r.stdout
        assert all(0.0 <= float(x) < 20.0 for x in m.groups()), r.stdout
        # where the overhead goes: the runner's CPU is found (llama.cpp computes there: milliseconds a
        # token on any CPU), and so are the daemon's and the client's
        m = re.search(r"CPU per generated token: direct (\d+) us .* through the daemon with " + client +
                      r" (\d+) us = runner (\d+) .* daemon (\d+) \+ HTTP client (\d+)", r.stdout)
        assert m, r.stdout
        direct, total, runner, daemon, client_us = map(int, m.groups())
        assert direct > 1000 and runner > 1000 and client_us > 0, r.stdout
        assert total == pytest.approx(runner + daemon + client_us, abs=2), r.stdout


def test_median_interval():
    from localrun.bench.overhead import median_ci

    xs = [float(x) for x in range(1, 101)]
    lo, hi = median_ci(xs)
    assert lo < 50.5 < hi and hi - lo < 20 and (lo, hi) == median_ci(xs)  # around the median, seeded
    assert median_ci([3.0]) == (3.0, 3.0)
    wide = median_ci([0.0, 100.0] * 5)
    assert wide[0] == 0.0 and wide[1] == 100.0  # two camps: one run's median could be either


@pytest.mark.parametrize("flag", ["--rounds", "--prompts"])
def test_no_rounds_or_prompts_is_refused_before_anything_starts(flag):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "localrun.bench", "overhead", flag, "0"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and f"argument {flag}: expected a positive integer, got 0" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and "round 1" not in r.stdout
