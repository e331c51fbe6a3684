"""The native engine failing to load a GGUF model at all, through the real daemon and runner
processes: with LOCALRUN_BACKEND=auto the model is loaded with llama.cpp instead (the reason in
/api/ps "fallbacks" and in the log, once); with LOCALRUN_BACKEND=native the load error is the
answer, the daemon lives on and serves other models. The failure is real: LOCALRUN_FAULTS makes
the runner's native load raise at its start (`native_load:MODEL` fails only that model)."""

from __future__ import annotations

import pytest

from daemon import MODEL, Daemon

pytestmark = pytest.mark.timeout(400)

OTHER = "smol-other:latest"  # the same weights under another name: the fault names only MODEL


def _generate(d: Daemon, model: str):
    return d.http.post("/api/generate", json={"model": model, "prompt": "The sky is", "stream": False,
                                               "options": {"num_predict": 4, "temperature": 0}})


def _daemon(tmp_path, **env) -> Daemon:
    d = Daemon(tmp_path / "home", LOCALRUN_CONTEXT_LENGTH="512", LOCALRUN_FAULTS=f"native_load:{MODEL}", **env)
    try:
        d.pull()
        r = d.http.post("/api/create", json={"model": OTHER, "from": MODEL, "stream": False})
        assert r.status_code == 200, r.text
    except BaseException:
        d.stop()
        raise
    return d


def test_auto_falls_back_to_llamacpp_when_the_native_load_fails(tmp_path):
    d = _daemon(tmp_path, LOCALRUN_BACKEND="auto", LOCALRUN_NATIVE_ON_CPU="1")
    try:
        # the other name loads on the native engine: LOCALRUN_NATIVE_ON_CPU makes auto pick it on a CPU
        r = _generate(d, OTHER)
        assert r.status_code == 200 and r.json()["response"], r.text
        (other,) = [m for m in d.ps() if m["name"] == OTHER]
        assert other["backend"] == "native" and other["fallbacks"] == [], other

        for _ in range(2):  # the fallback's load, then a request on the loaded model
            r = _generate(d, MODEL)
            assert r.status_code == 200 and r.json()["response"], r.text
        (m,) = [m for m in d.ps() if m["name"] == MODEL]
        assert m["backend"] == "llama.cpp", m
        (why,) = m["fallbacks"]
        assert why.startswith("native engine failed to load: ") and why.endswith("; running on llama.cpp"), why
        assert "InjectedFault" in why and "native_load" in why, why
        assert "native engine failed to load" in m["reason"], m["reason"]

        # unloaded and loaded again: straight to llama.cpp (the failure is remembered), logged once
        r = d.http.post("/api/generate", json={"model": MODEL, "keep_alive": 0})
        assert r.status_code == 200, r.text
        d.wait_ps(lambda ms: MODEL not in [x["name"] for x in ms])
        r = _generate(d, MODEL)
        assert r.status_code == 200 and r.json()["response"], r.text
        (m,) = [m for m in d.ps() if m["name"] == MODEL]
        assert m["backend"] == "llama.cpp" and m["fallbacks"] == [why], m
        log = d.log.read_text(errors="replace")
        assert log.count(f"WARNING localrun.manager: {MODEL}: native engine failed to load") == 1, log[-3000:]
    finally:
        d.stop()


def test_explicit_native_reports_the_load_error_and_the_daemon_serves_on(tmp_path):
    d = _daemon(tmp_path, LOCALRUN_BACKEND="native")
    try:
        r = _generate(d, MODEL)
        assert r.status_code == 500, r.text
        err = r.json()["error"]
        assert "native_load" in err and MODEL in err, err
        assert MODEL not in [m["name"] for m in d.ps()]
        assert d.proc.poll() is None

        r = _generate(d, OTHER)  # another model is served, on the native engine
        assert r.status_code == 200 and r.json()["response"], r.text
        (m,) = d.ps()
        assert m["name"] == OTHER and m["backend"] == "native" and m["fallbacks"] == [], m
    finally:
        d.stop()
