"""Finding and building llama.cpp's llama-server (localrun.bench.llama_server_build): LOCALRUN_LLAMA_SERVER, the
cached build reused, the lock that keeps a second process waiting for the first's build, a clear error naming a
missing tool; and llama-server's rule for streams that end inside a UTF-8 character (cut_inside_char). The real
build runs wherever the llama_server_bin fixture is used (tests/test_ide.py)."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time

import pytest

from localrun.backends.llamacpp.streaming import cut_inside_char
from localrun.bench import llama_server_build as b


def _env(tmp_path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOCALRUN_")}
    return {**env, "XDG_CACHE_HOME": str(tmp_path / "cache"), **extra}


def _cli(env) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "localrun", "bench", "build-llama-server"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_the_setting_names_the_binary(tmp_path):
    exe = tmp_path / "llama-server"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    p = _cli(_env(tmp_path, LOCALRUN_LLAMA_SERVER=str(exe)))
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0 and out.strip() == str(exe), err
    p = _cli(_env(tmp_path, LOCALRUN_LLAMA_SERVER=str(tmp_path / "nope")))
    out, err = p.communicate(timeout=60)
    assert p.returncode == 1 and "LOCALRUN_LLAMA_SERVER" in err and "not an executable file" in err
    assert "Traceback" not in err


def test_a_cached_build_is_reused_and_a_second_process_waits_for_the_first(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # where the subprocesses look too
    where = b.build_dir()
    binary = where / "build" / "bin" / "llama-server"
    assert where.name.startswith(b.llama_cpp_python_version() + "-")
    where.mkdir(parents=True)
    # another process holds the build lock: this one says so and waits, then takes the finished build
    fd = os.open(where.parent / f"{where.name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        p = _cli(_env(tmp_path))
        deadline = time.monotonic() + 60
        line = ""
        while "another process is building llama-server" not in line and time.monotonic() < deadline:
            line = p.stderr.readline()
            assert line or p.poll() is None, p.stdout.read()
        assert "waiting" in line
        assert p.poll() is None  # still waiting
        binary.parent.mkdir(parents=True)
        binary.write_text("#!/bin/sh\n")
        binary.chmod(0o755)
        (where / "complete").write_text("done\n")
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0 and out.strip() == str(binary), err
    # and later calls return at once
    p = _cli(_env(tmp_path))
    out, _ = p.communicate(timeout=60)
    assert out.strip() == str(binary)


def test_missing_tools_are_named(tmp_path):
    empty = tmp_path / "bin"
    empty.mkdir()
    env = _env(tmp_path, PATH=str(empty))
    env.pop("CC", None)
    env.pop("CXX", None)
    p = subprocess.run([sys.executable, "-m", "localrun", "bench", "build-llama-server"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 1, p.stderr
    assert "needs cmake and a C compiler" in p.stderr and "a C++ compiler" in p.stderr
    assert "LOCALRUN_LLAMA_SERVER" in p.stderr and "Traceback" not in p.stderr


def test_missing_tools_lists_only_what_is_absent(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    assert "the C++ compiler CXX=no-such-compiler-here" in b.missing_tools()


@pytest.mark.parametrize("text, cut", [
    (b"abc", False), ("é".encode(), False), ("€".encode()[:2], True), ("€".encode()[:1], True),
    ("😀".encode()[:3], True), ("😀".encode(), False), (b"x\xe2\x82", True), (b"\xe2\x82\xac\x41", False),
    (b"\x80", False),  # a stray continuation byte is invalid, not cut: it is sent (as U+FFFD)
])
def test_cut_inside_char_is_llama_servers_validate_utf8(text, cut):
    assert cut_inside_char(text[-4:]) is cut
