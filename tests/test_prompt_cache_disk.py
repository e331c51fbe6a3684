"""The prompt cache on disk (localrun/backends/prompt_disk.py): the store's checks (corrupt, truncated, foreign
and half-written files are removed, never loaded), its LRU bound and two writers on one folder; then a real
daemon with SmolLM2 restarted between two requests with the same long system prompt: the same greedy answer,
a TTFT far below the cold prefill's, and a daemon killed while writing plus a corrupted file, after which the
next start serves and says once that it removed the bad file."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from localrun.backends.prompt_disk import SUFFIX, PromptDisk

KEY = {"backend": "llama.cpp", "build": "test", "model": "sha256:aa"}


def _disk(root, key=KEY, limit=1 << 30, min_tokens=4) -> PromptDisk:
    return PromptDisk(root, key, limit=limit, min_tokens=min_tokens, name="t")


def _saved(d: PromptDisk, tokens, payload: bytes) -> None:
    assert d.save(tokens, payload)
    d.flush()


def test_a_saved_state_is_found_by_its_longest_shared_prefix_and_read_back(tmp_path):
    d = _disk(tmp_path)
    payload = os.urandom(10_000)
    _saved(d, list(range(100)), payload)
    again = _disk(tmp_path)  # a restart: the index comes from the headers
    e, k = again.best(list(range(60)) + [7, 7, 7], 63)
    assert k == 60 and len(e.tokens) == 100
    assert again.read(e) == payload
    assert again.best([5, 6, 7], 3) == (None, 0)
    assert again.best(list(range(100)), 100, max_len=99) == (None, 0)  # longer than a slot's cells
    # a foreign model's entry is never a match, and stays (it is that model's)
    other = _disk(tmp_path, key={**KEY, "model": "sha256:bb"})
    assert other.entries == [] and len(list(tmp_path.glob(f"*{SUFFIX}"))) == 1
    # a prompt that extends a saved one replaces it (its tokens say everything the old one did)
    _saved(again, list(range(200)), payload * 2)
    assert [len(x.tokens) for x in again.entries] == [200] and len(list(tmp_path.glob(f"*{SUFFIX}"))) == 1
    again.close(); d.close(); other.close()


@pytest.mark.parametrize("damage", ["flip", "truncate", "header", "foreign"])
def test_a_damaged_file_is_removed_never_loaded_and_reported_once(tmp_path, caplog, damage):
    d = _disk(tmp_path)
    _saved(d, list(range(50)), os.urandom(5000))
    d.close()
    (path,) = tmp_path.glob(f"*{SUFFIX}")
    raw = bytearray(path.read_bytes())
    if damage == "flip":
        raw[-100] ^= 0xFF  # in the payload: only the checksum finds it
    elif damage == "truncate":
        raw = raw[:len(raw) // 2]
    elif damage == "header":
        raw[:8] = b"GARBAGE!"
    else:  # another model's entry under this model's name
        raw = bytearray(raw.replace(b"sha256:aa", b"sha256:zz"))
    path.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING, logger="localrun.prompt_cache"):
        again = _disk(tmp_path)
        e, k = again.best(list(range(50)), 50)
        got = again.read(e) if e is not None else None
    assert got is None and not path.exists()
    assert again.counters["disk_bad_files"] == 1
    assert len([r for r in caplog.records if "ignored and removed" in r.getMessage()]) == 1
    again.close()


def test_the_folder_stays_within_its_bound_least_recently_used_first(tmp_path):
    d = _disk(tmp_path, limit=35_000)
    for i in range(3):
        _saved(d, [i] * 10, bytes(10_000))
        time.sleep(0.02)
    e0, _ = d.best([0] * 10, 10)
    assert d.read(e0) is not None  # a hit: now the most recently used
    time.sleep(0.02)
    _saved(d, [3] * 10, bytes(10_000))  # over 35,000: the least recently used goes ([1])
    left = sorted(int(e.tokens[0]) for e in d.entries)
    assert left == [0, 2, 3], left
    assert sum(p.stat().st_size for p in tmp_path.glob(f"*{SUFFIX}")) <= 35_000
    assert not d.save([9] * 10, bytes(40_000))  # larger than the whole bound: never queued
    assert _disk(tmp_path, limit=0).save([1] * 10, b"x") is False  # 0 = off
    d.close()


def test_two_writers_on_one_folder_never_leave_a_bad_file(tmp_path):
    a, b = _disk(tmp_path, limit=400_000), _disk(tmp_path, limit=400_000)
    payloads = {i: os.urandom(20_000) for i in range(30)}

    def write(d, ids):
        for i in ids:
            d.save([i] * 8 + [1000 + i], payloads[i])
        d.flush()

    ts = [threading.Thread(target=write, args=(a, range(0, 30))), threading.Thread(target=write, args=(b, range(29, -1, -1)))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    c = _disk(tmp_path, limit=400_000)
    assert c.counters["disk_bad_files"] == 0 and c.entries
    for e in c.entries:
        i = int(e.tokens[0])
        assert c.read(e) == payloads[i]
    assert not list(tmp_path.glob(".*.tmp"))  # every temporary file renamed or removed
    assert sum(p.stat().st_size for p in tmp_path.glob(f"*{SUFFIX}")) <= 400_000
    for d in (a, b, c):
        d.close()


def test_a_killed_writers_temporary_file_is_never_read_and_old_ones_go(tmp_path):
    d = _disk(tmp_path)
    _saved(d, list(range(20)), b"y" * 1000)
    d.close()
    (path,) = tmp_path.glob(f"*{SUFFIX}")
    tmp = tmp_path / f".{path.name}.123.abcd.tmp"
    tmp.write_bytes(path.read_bytes()[:300])
    old = time.time() - 7200
    os.utime(tmp, (old, old))
    again = _disk(tmp_path)
    assert len(again.entries) == 1 and not tmp.exists()
    again.close()


# -- a real daemon ----------------------------------------------------------------------------------
# a fixed thread count (PARAMETER num_thread): with the automatic one (cpu_share.ThreadGovernor) the count follows
# other processes' load, and llama.cpp's CPU kernels round differently at another count, so two runs of one
# greedy request on a busy box can answer differently whatever is cached
FIXED = "smol-fixed-threads"
SYSTEM = ("You are a careful assistant for a hardware store. " + " ".join(
    f"Policy {i}: aisle {i % 17} holds item number {i * 37 % 1000}, priced at {i % 9 + 1} dollars." for i in range(75)))


def _ask(d, question: str, system: str = SYSTEM) -> tuple[float, str, dict]:
    """(time to the first token, the greedy answer, the final chunk) of one streamed /api/generate."""
    import json

    t0 = time.perf_counter()
    first, text, final = None, "", {}
    body = {"model": FIXED, "system": system, "prompt": question, "stream": True,
            "options": {"temperature": 0, "num_predict": 24, "num_ctx": 4096}}
    with d.http.stream("POST", "/api/generate", json=body) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.strip():
                continue
            ev = json.loads(line)
            if ev.get("response") and first is None:
                first = time.perf_counter() - t0
            text += ev.get("response", "")
            if ev.get("done"):
                final = ev
    return first or (time.perf_counter() - t0), text, final


def _kill(d) -> None:
    kids = d.runners()
    d.proc.send_signal(signal.SIGKILL)
    for p in kids:
        p.kill()
    d.proc.wait(10)
    d.http.close()


def test_a_restarted_daemon_reads_the_long_prompt_back_and_survives_a_kill_and_a_bad_file(tmp_path):
    import daemon
    from daemon import Daemon

    home = tmp_path / "home"
    env = dict(LOCALRUN_NUM_PARALLEL="1", LOCALRUN_PROMPT_CACHE_MIN="1024")
    d = Daemon(home, **env)
    try:
        d.pull()
        r = d.http.post("/api/create", json={"model": FIXED, "from": "smollm2:135m", "stream": False,
                                             "parameters": {"num_thread": 2}})
        assert r.status_code == 200, r.text
        cold_ttft, cold, final = _ask(d, "Which aisle holds item 111?")
        assert final["prompt_eval_count"] >= 1024, final
        deadline = time.monotonic() + 60  # the state is written in the background
        while not list((home / "prompt-cache").glob(f"*{SUFFIX}")) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert list((home / "prompt-cache").glob(f"*{SUFFIX}"))
    finally:
        d.stop()
    d = Daemon(home, **env)
    try:
        warm_ttft, warm, final = _ask(d, "Which aisle holds item 111?")
        ps = d.ps()
        metrics = d.http.get("/metrics").text
        shown = subprocess.run([sys.executable, "-m", "localrun", "ps", "-v"], capture_output=True, text=True, timeout=60,
                               env={**os.environ, "LOCALRUN_HOST": f"127.0.0.1:{d.port}", "PYTHONPATH": str(daemon.REPO)})
    finally:
        d.stop()
    print(f"\nSmolLM2-135M, {final['prompt_eval_count']} prompt tokens: cold TTFT {cold_ttft * 1000:.0f} ms, after a "
          f"restart {warm_ttft * 1000:.0f} ms ({warm_ttft / cold_ttft:.1%})")
    assert warm == cold
    assert ps[0]["prompt_cache"]["hits"] == 1 and ps[0]["prompt_cache"]["restored_tokens"] >= 1000, ps[0]
    assert 'localrun_prompt_disk_lookups_total{model="smol-fixed-threads:latest",result="hit"} 1.0' in metrics
    assert "prompt cache on disk: 1 hit(s)" in shown.stdout, (shown.stdout, shown.stderr)
    assert warm_ttft <= 0.5 * cold_ttft, (warm_ttft, cold_ttft)

    # a daemon killed while it writes a new prompt's state, then the saved entry corrupted on disk
    d = Daemon(home, **env)
    try:
        _ask(d, "Which aisle holds item 222?", system=SYSTEM.replace("hardware", "garden"))
    finally:
        _kill(d)
    files = list((home / "prompt-cache").glob(f"*{SUFFIX}"))
    for p in files:
        raw = bytearray(p.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        p.write_bytes(bytes(raw))
    d = Daemon(home, **env)
    try:
        _, again, _ = _ask(d, "Which aisle holds item 111?")
        assert again == cold  # computed again: the bad file was never loaded
        log = d.log.read_text(errors="replace")
        assert d.ps()[0]["prompt_cache"]["bad_files"] >= 1
    finally:
        d.stop()
    said = [line for line in log.splitlines() if "ignored and removed" in line]
    assert 1 <= len(said) <= len(files), said
    assert len({line.split("removed ")[1].split()[0] for line in said}) == len(said)  # once a file
    assert "Traceback" not in log
