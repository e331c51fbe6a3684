"""llama.cpp's repacked weights on every x86 CPU, AMX denied (localrun.backends.llamacpp.amx).

On Intel CPUs with AMX, llama-cpp-python 0.3.36's AMX path crashes on the first token; the runner
keeps llama.cpp's other extra buffer types (the repacked Q4_0/Q4_K/IQ4_NL weights, 1.4-1.7x the
prefill) by making the kernel refuse llama.cpp's request for AMX state. Here: the seccomp filter
refuses that one request and nothing else, in every thread and in child processes; a Q4_0 model
(the bundled SmolLM2 requantized by llama.cpp) loads with CPU_REPACK weights in a fresh process and
computes the logits the plain weights give; and the real daemon serves it, saying so in /api/ps. On
AMD (no AMX) the same checks hold without the filter: that is llama.cpp's default there.
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from pathlib import Path

import pytest
from daemon import Daemon
from gguf_util import requantize

from localrun.backends.llamacpp.amx import cpu_has_amx
from localrun.backends.llamacpp.cpu import extra_buffers

REPO = Path(__file__).resolve().parents[1]
x86_linux = pytest.mark.skipif(not sys.platform.startswith("linux") or platform.machine() != "x86_64",
                               reason="the filter is for x86-64 Linux")


def _run(code: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout,
                          cwd=str(REPO))


def test_auto_keeps_the_extra_buffers_where_amx_can_be_denied():
    assert extra_buffers("auto", amx=True, deny=lambda: True)[0] is True
    assert "AMX denied" in extra_buffers("auto", amx=True, deny=lambda: True)[1]
    assert extra_buffers("auto", amx=True, deny=lambda: False)[0] is False  # a kernel without seccomp: as before
    denied = []
    assert extra_buffers("auto", amx=False, deny=lambda: denied.append(1) or True)[0] is True
    assert extra_buffers("on", amx=True, deny=lambda: denied.append(1) or True)[0] is True
    assert extra_buffers("off", amx=True, deny=lambda: denied.append(1) or True)[0] is False
    assert denied == []  # only auto on an AMX CPU puts the filter in place


DENY = r"""
import ctypes, json, os, subprocess, sys, threading
from localrun.backends.llamacpp import amx

libc = ctypes.CDLL(None, use_errno=True)

def req():  # what ggml_amx_init asks: arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
    rc = libc.syscall(158, 0x1023, 18)
    return 0 if rc == 0 else ctypes.get_errno()

def supported():  # another arch_prctl: ARCH_GET_XCOMP_SUPP, the features the kernel supports
    mask = ctypes.c_uint64(0)
    rc = libc.syscall(158, 0x1021, ctypes.byref(mask))
    return rc, mask.value

out = {}
go, done = threading.Event(), threading.Event()
def older():  # a thread that was running before the filter came
    go.wait(); out["older_thread"] = req(); done.set()
t = threading.Thread(target=older); t.start()
out["first"] = amx.deny_amx()
out["again"] = amx.deny_amx()
out["this_thread"] = req()
go.set(); done.wait()
out["get_supp"] = supported()[0]
child = subprocess.run([sys.executable, "-c", "import ctypes; l = ctypes.CDLL(None, use_errno=True); "
                        "print(l.syscall(158, 0x1023, 18), ctypes.get_errno())"], capture_output=True, text=True)
out["child"] = child.stdout.split()
out["status"] = {k: v.strip() for k, v in (ln.split(":", 1) for ln in open("/proc/self/status") if ":" in ln)
                 if k in ("Seccomp", "Seccomp_filters", "NoNewPrivs")}
print(json.dumps(out))
"""


@x86_linux
def test_the_filter_refuses_llama_cpps_amx_request_and_nothing_else():
    r = _run(DENY)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["first"] is True and out["again"] is True
    assert out["this_thread"] == 1 and out["older_thread"] == 1  # EPERM in every thread (TSYNC)
    assert out["child"] == ["-1", "1"]  # and in the processes it starts
    assert out["get_supp"] == 0  # another arch_prctl goes through
    assert out["status"] == {"NoNewPrivs": "1", "Seccomp": "2", "Seccomp_filters": "1"}  # one filter, added once


@pytest.fixture(scope="module")
def q4_0(smollm2_gguf, tmp_path_factory) -> Path:
    """The bundled SmolLM2 requantized to Q4_0 by llama.cpp: a type its CPU backend repacks on x86 (Q4_1 is not)."""
    return requantize(smollm2_gguf, tmp_path_factory.mktemp("q4_0") / "smollm2-q4_0.gguf", 2)


LOGITS = r"""
import json, sys
import numpy as np
from localrun.backends.llamacpp.cpu import extra_buffers
from localrun.backends.llamacpp.pooled import model_params
import llama_cpp

use, why = extra_buffers(sys.argv[2])
with model_params(**({} if use else {"use_extra_bufts": False})):
    llm = llama_cpp.Llama(sys.argv[1], n_ctx=512, n_threads=2, n_batch=512, logits_all=True, verbose=True)
toks = llm.tokenize(b"The capital of France is Paris. The capital of Germany is")
llm.eval(toks)
row = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float64)
print("RESULT " + json.dumps({"use": use, "why": why, "logits": row.tolist()}))
"""


def _logits(gguf: Path, setting: str) -> tuple[dict, str]:
    r = _run(LOGITS, str(gguf), setting, timeout=240)
    assert r.returncode == 0, f"exit {r.returncode}: {r.stderr[-3000:]}"
    line = next(x for x in r.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):]), r.stderr


@x86_linux
def test_a_q4_0_model_runs_on_repacked_weights_and_computes_what_plain_weights_do(q4_0):
    import numpy as np

    auto, log = _logits(q4_0, "auto")  # a fresh process: on an AMX CPU without the filter this dies (SIGILL/SIGSEGV)
    assert auto["use"] is True, auto["why"]
    assert "CPU_REPACK model buffer size" in log, log[-3000:]  # the weights were repacked
    if cpu_has_amx():
        assert "AMX is not ready to be used" in log and "AMX model buffer" not in log
    plain, log_off = _logits(q4_0, "off")
    assert "CPU_REPACK" not in log_off
    a, b = np.array(auto["logits"]), np.array(plain["logits"])
    # the same quantized weights through other kernels (llama.cpp's default on every x86 CPU without AMX): the
    # logits close, not bit-equal; measured on SmolLM2 Q4_0: correlation 0.9993, KL 0.010 nats, the same top 3
    assert np.corrcoef(a, b)[0, 1] > 0.998, np.corrcoef(a, b)[0, 1]

    def log_softmax(x):
        x = x - x.max()
        return x - np.log(np.exp(x).sum())

    la, lb = log_softmax(a), log_softmax(b)
    kl = float((np.exp(lb) * (lb - la)).sum())
    assert kl < 0.05, kl
    top = np.sort(b)[-2:]
    if top[1] - top[0] > 0.1:  # no near-tie at the top: the same greedy token
        assert int(np.argmax(a)) == int(np.argmax(b))


@x86_linux
def test_the_daemon_serves_a_repacked_model_and_says_how(q4_0, tmp_path):
    d = Daemon(tmp_path / "home", LOCALRUN_NUM_PARALLEL="1", LOCALRUN_CONTEXT_LENGTH="1024")
    try:
        modelfile = f"FROM {q4_0}\n"
        with d.http.stream("POST", "/api/create", json={"model": "q40", "modelfile": modelfile}) as r:
            assert [json.loads(x) for x in r.iter_lines() if x.strip()][-1]["status"] == "success"
        r = d.http.post("/api/generate", json={"model": "q40", "prompt": "The capital of France is", "raw": True,
                                               "stream": False, "options": {"num_predict": 8, "temperature": 0}})
        assert r.status_code == 200 and r.json()["eval_count"] > 0, r.text
        reason = d.ps()[0]["reason"]
        assert extra_buffers("auto", deny=lambda: True)[1] in reason, reason
        runner = d.runners()[0]
        with open(f"/proc/{runner.pid}/status") as f:
            status = dict(ln.split(":", 1) for ln in f if ":" in ln)
        # the runner computes under the filter where the CPU has AMX, and only there
        assert (int(status["Seccomp_filters"]) >= 1) is cpu_has_amx(), status["Seccomp_filters"]
    finally:
        d.stop()
