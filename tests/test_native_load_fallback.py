"""The native engine failing to load a GGUF model at all, through the real daemon and runner
processes: with LOCALRUN_BACKEND=auto the model is loaded with llama.cpp instead (the reason in
/api/ps "fallbacks" and in the log, once); with LOCALRUN_BACKEND=native the load error is the
answer, the daemon lives on and serves other models. The failure is real: LOCALRUN_FAULTS makes
the runner's native load raise at its start (`native_load:MODEL` fails only that model)."""

from __future__ import annotations

import time

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


# -- in process: the real app and manager, a loader whose native load fails (fast) --------------------
class NativeFails:
    """A FakeModel's loader that refuses the native engine with an error a real load gives."""

    def __init__(self, model) -> None:
        self.model, self.calls, self.reasons, self.fake_loader = model, [], [], model.loader

    async def loader(self, spec, backend: str):
        from localrun.errors import BackendError

        self.calls.append(backend)
        self.reasons.append(spec.extra.get("reason", ""))
        if backend == "native":
            raise BackendError(f"the native engine cannot load {spec.name}: unsupported GGUF tensor type Q2_K")
        return await self.fake_loader(spec, backend)


def _in_process(tmp_path, **env):
    from fakes import FakeModel, InProcessDaemon, library_home

    fails = NativeFails(FakeModel())
    home = library_home(tmp_path / "home")
    model = fails.model
    model.loader = fails.loader  # the app is handed the failing loader
    return InProcessDaemon(home, model, **env), fails


def test_auto_fallback_in_process_is_remembered_per_model(tmp_path):
    import httpx

    d, fails = _in_process(tmp_path, LOCALRUN_BACKEND="auto", LOCALRUN_NATIVE_ON_CPU="1")
    try:
        with httpx.Client(base_url=d.url, timeout=60) as http:
            r = http.post("/api/generate", json={"model": MODEL, "prompt": "Hi", "stream": False})
            assert r.status_code == 200 and r.json()["response"], r.text
            assert fails.calls == ["native", "llamacpp"]
            (m,) = http.get("/api/ps").json()["models"]
            assert m["fallbacks"] == ["native engine failed to load: the native engine cannot load smollm2:135m: "
                                      "unsupported GGUF tensor type Q2_K; running on llama.cpp"], m
            assert fails.reasons[1].startswith("llama.cpp: native engine failed to load"), fails.reasons  # the load's reason
            assert http.post("/api/generate", json={"model": MODEL, "keep_alive": 0}).status_code == 200
            deadline = time.monotonic() + 10
            while http.get("/api/ps").json()["models"]:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            r = http.post("/api/generate", json={"model": MODEL, "prompt": "Hi", "stream": False})
            assert r.status_code == 200
            assert fails.calls == ["native", "llamacpp", "llamacpp"]  # the failure is remembered for this model
            assert http.get("/api/ps").json()["models"][0]["fallbacks"] == m["fallbacks"]
    finally:
        d.stop()


def test_explicit_native_in_process_is_an_error(tmp_path):
    import httpx

    d, fails = _in_process(tmp_path, LOCALRUN_BACKEND="native")
    try:
        with httpx.Client(base_url=d.url, timeout=60) as http:
            r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]})
            assert r.status_code == 500, r.text
            assert "unsupported GGUF tensor type Q2_K" in r.json()["error"]["message"]
            assert fails.calls == ["native"] and http.get("/api/ps").json()["models"] == []
    finally:
        d.stop()
