"""llama.cpp's thread count under other processes' load (localrun.backends.llamacpp.cpu_share).

The decision, with a fake clock and fake CPU times (fast); then the real thing: a real
daemon streaming SmolLM2 through the real llama.cpp while busy processes take every CPU. Without
the governor, OpenMP's threads wait at every barrier for the one the kernel preempted, and the
answer crawls (measured on 2 vCPUs: 1.5 tok/s against ~110 idle; with it 47-83 tok/s)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from fakes import metric_samples
from localrun.backends.llamacpp.cpu_share import SLACK, ThreadGovernor, busy_seconds, threads_for, usable_cpus


def test_threads_for_gives_way_to_other_processes():
    # 2 cores, all computing for llama.cpp
    assert threads_for(0.0, 2, 2) == 2
    assert threads_for(SLACK - 0.01, 2, 2) == 2  # the daemon and its clients: a few percent
    assert threads_for(0.67, 2, 2) == 1  # one busy process beside two compute threads
    assert threads_for(1.9, 2, 2) == 1  # never none
    # 8 physical cores with 16 hyperthreads: others fit in the 8 siblings first
    assert threads_for(7.5, 8, 16) == 8
    assert threads_for(10.0, 8, 16) == 6
    assert threads_for(3.0, 16, 16) == 13


class FakeMachine:
    """The CPUs' times and this process's CPU time, advanced by hand: `cpus` CPUs, `others` of them
    busy with other processes, `ours` with this one."""

    def __init__(self, cpus: int) -> None:
        self.cpus = cpus
        self.t = 0.0
        self.busy = self.total = 0.0
        self.own = 0.0

    def run(self, seconds: float, others: float, ours: float) -> None:
        self.t += seconds
        self.total += self.cpus * seconds
        self.busy += (others + ours) * seconds
        self.own += ours * seconds

    def governor(self, n_max: int) -> ThreadGovernor:
        return ThreadGovernor(n_max, logical=self.cpus, interval=0.5, clock=lambda: self.t,
                              sample=lambda: (self.busy, self.total), own=lambda: self.own)


def test_the_governor_drops_threads_at_once_and_takes_them_back_after_two_quiet_windows():
    m = FakeMachine(cpus=2)
    g = m.governor(2)
    assert g.poll() is None  # the first step begins a spell of steps
    m.run(0.2, others=0.0, ours=2.0)
    assert g.poll() is None  # not a whole window yet
    m.run(0.4, others=0.05, ours=1.95)
    assert g.poll() is None and g.current == 2 and g.others == pytest.approx(0.05, abs=0.05)
    m.run(0.5, others=0.7, ours=1.3)  # a compile job starts
    assert g.poll() == 1 and g.current == 1 and g.others == pytest.approx(0.7, abs=0.05)
    m.run(0.5, others=1.0, ours=1.0)
    assert g.poll() is None and g.current == 1  # it stays while the job runs
    m.run(0.5, others=0.0, ours=1.0)  # the job ended: one quiet window is not enough
    assert g.poll() is None and g.current == 1
    m.run(0.5, others=1.0, ours=1.0)  # it was a pause: the count of quiet windows starts again
    assert g.poll() is None and g.current == 1
    m.run(0.5, others=0.0, ours=1.0)
    assert g.poll() is None
    m.run(0.5, others=0.0, ours=1.0)
    assert g.poll() == 2 and g.current == 2 and g.changes == 2
    # idle while another program computes on every CPU, then steps again: the idle spell is no part
    # of any window; the next whole window of steps decides
    g.idle()
    m.run(3.0, others=2.0, ours=0.0)
    assert g.poll() is None and g.current == 2
    m.run(0.5, others=0.1, ours=1.9)
    assert g.poll() is None and g.current == 2 and g.others == pytest.approx(0.1, abs=0.05)


def short_requests(m: FakeMachine, g: ThreadGovernor, n: int, *, during: float, between: float) -> None:
    """`n` requests of 0.1 s (a poll per 10 ms step), each followed by 0.15 s idle: `during` and
    `between`, the CPUs other programs take while the steps run and while the loop is idle."""
    for _ in range(n):
        for _ in range(10):
            n_threads = g.poll()
            assert n_threads is None or n_threads == g.current
            m.run(0.01, others=during, ours=g.current * (2 - during) / 2)
        g.idle()
        m.run(0.15, others=between, ours=0.0)


def test_other_programs_between_short_requests_take_no_threads():
    """An agent's tool runs its tests between two requests, or a benchmark's other side computes
    between the daemon's: that load is gone when the next request comes. A window counted across
    the idle spells dropped a thread (halving the next prefill): only the steps count."""
    m = FakeMachine(cpus=2)
    g = m.governor(2)
    short_requests(m, g, 20, during=0.02, between=2.0)
    assert g.current == 2 and g.changes == 0 and g.others < SLACK
    # a window gathers the steps of several short requests: a compile job that runs while they
    # compute is still seen
    short_requests(m, g, 10, during=1.0, between=1.0)
    assert g.current == 1 and g.others > 0.5
    # and once it is gone, the threads come back across short requests too
    short_requests(m, g, 20, during=0.02, between=0.0)
    assert g.current == 2 and g.changes == 2


def test_the_governor_reads_this_machine():
    cpus = usable_cpus()
    assert cpus, "sched_getaffinity gives the CPUs we may run on"
    sample = busy_seconds(cpus)
    assert sample is not None and 0 <= sample[0] <= sample[1]
    g = ThreadGovernor(len(cpus), interval=0.05)
    assert g.enabled and g.logical == len(cpus)
    assert g.poll() is None  # a spell begins
    time.sleep(0.1)
    g.poll()
    assert g.others >= 0.0


@pytest.mark.timeout(300)
def test_a_stream_keeps_its_pace_while_other_processes_take_every_cpu(tmp_path):
    """Busy processes on every CPU beside the real daemon: a 48-token stream still finishes in
    seconds (the runner gives up threads and says so in the log), and once they are gone the
    runner computes with every thread again."""
    pytest.importorskip("llama_cpp")
    from daemon import MODEL, Daemon

    d = Daemon(tmp_path / "home", LOCALRUN_NUM_PARALLEL="1", LOCALRUN_CONTEXT_LENGTH="1024",
               LOCALRUN_LOG_LEVEL="info")
    hogs: list[subprocess.Popen] = []
    try:
        d.pull()
        body = {"model": MODEL, "prompt": "The history of tea begins", "max_tokens": 48, "temperature": 0,
                "ignore_eos": True}
        assert d.http.post("/v1/completions", json=body).status_code == 200  # loaded, warm
        hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in usable_cpus() or [0, 1]]
        time.sleep(1.0)
        t0 = time.monotonic()
        r = d.http.post("/v1/completions", json=body)
        took = time.monotonic() - t0
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 48
        log = d.log.read_text(errors="replace")
        assert "llama.cpp computes with 1 of" in log, log[-2000:]
        assert took < 20, f"48 tokens took {took:.1f} s beside {len(hogs)} busy processes"
        m = metric_samples(d.http.get("/metrics").text)
        assert m[("localrun_compute_threads", (("model", MODEL),))] == 1, m
        assert m[("localrun_compute_thread_changes_total", (("model", MODEL),))] >= 1, m
        for h in hogs:
            h.kill()
            h.wait()
        hogs = []
        for _ in range(10):  # two quiet windows of steps: the threads come back
            assert d.http.post("/v1/completions", json=body).status_code == 200
            last = [line for line in d.log.read_text(errors="replace").splitlines() if "llama.cpp computes with" in line][-1]
            n_max = int(last.split(" of ")[1].split()[0])
            if f"computes with {n_max} of {n_max} threads" in last:
                break
        assert f"computes with {n_max} of {n_max} threads" in last, last
    finally:
        for h in hogs:
            h.kill()
            h.wait()
        d.stop()


@pytest.mark.timeout(300)
def test_other_programs_between_requests_cost_the_next_request_no_thread(tmp_path):
    """The real daemon: busy processes on every CPU while the model is idle (an agent's tool running
    its tests between two requests), gone when the next request comes. The runner keeps every
    thread: a window of the clock that spanned the idle spell counted their load and dropped one."""
    pytest.importorskip("llama_cpp")
    from daemon import MODEL, Daemon

    d = Daemon(tmp_path / "home", LOCALRUN_NUM_PARALLEL="1", LOCALRUN_CONTEXT_LENGTH="1024",
               LOCALRUN_LOG_LEVEL="info")
    try:
        d.pull()
        body = {"model": MODEL, "prompt": "The history of tea begins", "max_tokens": 24, "temperature": 0,
                "ignore_eos": True}
        assert d.http.post("/v1/completions", json=body).status_code == 200  # loaded, warm
        threads = metric_samples(d.http.get("/metrics").text)[("localrun_compute_threads", (("model", MODEL),))]
        assert threads >= 1
        for _ in range(6):
            hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in usable_cpus() or [0, 1]]
            time.sleep(0.6)
            for h in hogs:
                h.kill()
                h.wait()
            assert d.http.post("/v1/completions", json=body).status_code == 200
        log = d.log.read_text(errors="replace")
        assert "llama.cpp computes with" not in log, [x for x in log.splitlines() if "computes with" in x]
        m = metric_samples(d.http.get("/metrics").text)
        assert m[("localrun_compute_thread_changes_total", (("model", MODEL),))] == 0, m
        assert m[("localrun_compute_threads", (("model", MODEL),))] == threads, m
    finally:
        d.stop()
