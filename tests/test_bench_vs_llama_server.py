"""`localrun bench llama-server` and `localrun bench typing --llama-server`: a run stopped with SIGTERM (a CI
timeout, `kill`) stops both servers it started, the daemon's runner process included, instead of leaving them
running in their own sessions."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

pytest.importorskip("llama_cpp")


def _servers(bench: psutil.Process) -> list[psutil.Process]:
    try:
        return [p for p in bench.children(recursive=True)
                if any("llama-server" in a or a == "localrun.server" or a == "localrun.backends.runner.worker"
                       for a in p.cmdline())]
    except psutil.NoSuchProcess:
        return []


@pytest.mark.parametrize("bench", ["llama-server", "typing"])
def test_sigterm_stops_both_servers(bench, llama_server_bin, smollm2_gguf, tmp_path, request):
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOCALRUN_")}
    if bench == "llama-server":
        argv = ["llama-server", "--llama-server", str(llama_server_bin), "--gguf", str(smollm2_gguf), "--rounds", "1",
                "--workloads", "single", "--single-requests", "200", "--threads", "1", "--parallel", "1", "--ctx", "512"]
    else:
        argv = ["typing", "--llama-server", str(llama_server_bin), "--gguf", str(request.getfixturevalue("fim_gguf")),
                "--edits", "2000", "--rounds", "1", "--threads", "1", "--parallel", "1"]
    proc = subprocess.Popen([sys.executable, "-m", "localrun.bench", *argv], env=env, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    bench = psutil.Process(proc.pid)
    seen: list[psutil.Process] = []
    deadline = time.monotonic() + 300
    try:
        # both servers up, with the daemon's runner: llama-server, the daemon and its worker
        while time.monotonic() < deadline and proc.poll() is None:
            seen = _servers(bench)
            names = " ".join(" ".join(p.cmdline()) for p in seen)
            if "llama-server" in names and "localrun.server" in names and "localrun.backends.runner.worker" in names:
                break
            time.sleep(0.5)
        assert proc.poll() is None, proc.stdout.read()
        assert len(seen) >= 3, [p.cmdline() for p in seen]
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode != 0 and "both servers were stopped" in out, (proc.returncode, out[-2000:])
        gone, alive = psutil.wait_procs(seen, timeout=30)
        assert not alive, [p.cmdline() for p in alive]
    finally:
        if proc.poll() is None:
            proc.kill()
        for p in seen:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass


def test_a_short_run_with_the_daemons_own_threads(llama_server_bin, smollm2_gguf, tmp_path):
    """A whole run at smoke length with --auto-threads: localrun keeps its own thread choice (the governor
    on, as a user's daemon) and each localrun phase says what the governor did; the JSON has the ratio."""
    import json

    env = {k: v for k, v in os.environ.items() if not k.startswith("LOCALRUN_")}
    out = tmp_path / "res.json"
    r = subprocess.run([sys.executable, "-m", "localrun.bench", "llama-server", "--llama-server", str(llama_server_bin),
                        "--gguf", str(smollm2_gguf), "--rounds", "1", "--workloads", "single", "--single-requests",
                        "2", "--input-len", "32", "--output-len", "8", "--parallel", "1", "--ctx", "512",
                        "--auto-threads", "--out", str(out)], env=env, cwd=tmp_path, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    line = next(x for x in r.stdout.splitlines() if x.startswith("round 1 single   localrun"))
    assert "threads: " in line, r.stdout
    res = json.loads(out.read_text())
    assert res["config"]["auto_threads"] is True
    (phase,) = [p for p in res["phases"] if p["server"] == "localrun"]
    assert isinstance(phase["thread_changes"], list) and res["summary"]["single"]["ratio"] > 0
