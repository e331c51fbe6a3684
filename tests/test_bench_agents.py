"""`localrun bench agents` and `launch`'s agent settings.

Fast: each task's check fails on the untouched repository and passes once the task is done by hand;
`launch`'s lean profile and Codex model catalog, given to the real Codex CLI pointed at a stand-in
server that records what Codex sends (no fallback-metadata warning, the lean prompt and tools).
One real run of the bench machinery: the no-tool task through `localrun launch codex --lean` on
Qwen2.5-Coder-0.5B against a daemon the bench starts.
"""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import threading
from pathlib import Path

import pytest

from localrun.agents import command as agent_command
from localrun.agents import profiles
from localrun.bench import agents_tasks as tasks

pytestmark = pytest.mark.timeout(900)

SOLUTIONS = {
    "read": ("", "The secret word is PELICAN."),
    "find-def": ("", "It is defined in app/net/headers.py"),
    "fix-test": ("calc.py", "def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    return a * b\n"),
    "create-file": ("hello.txt", "Hello, world!\n"),
    "rename": ("", ""),
    "run-command": ("", "It prints 506."),
    "two-step": ("port.txt", "8731\n"),
    "no-tool": ("", "144"),
}


def test_each_check_fails_untouched_and_passes_when_done(tmp_path):
    assert len(tasks.TASKS) >= 8 and {t.name for t in tasks.TASKS} == set(SOLUTIONS)
    for t in tasks.TASKS:
        repo = tasks.make_repo(t, tmp_path / t.name)
        ok, why = tasks.score(t, repo, "I could not do it.")
        assert not ok, (t.name, why)
        path, text = SOLUTIONS[t.name]
        answer = text
        if t.name == "rename":
            for f in ("prices.py", "report.py"):
                (repo / f).write_text((repo / f).read_text().replace("compute_total", "sum_prices"))
            answer = "done"
        elif path:
            (repo / path).write_text(text)
            answer = "done"
        ok, why = tasks.score(t, repo, answer)
        assert ok, (t.name, why)
    t = tasks.select("fix-test")[0]  # editing the test instead of the code fails
    repo = tasks.make_repo(t, tmp_path / "cheat")
    (repo / "test_calc.py").write_text("print('ok')\n")
    assert tasks.score(t, repo, "") == (False, "test_calc.py was changed")
    with pytest.raises(ValueError, match="unknown task"):
        tasks.select("read,nope")


def test_profiles_and_model_metadata():
    assert profiles.parameter_count({"details": {"parameter_size": "1.5B"}}) == 1_500_000_000
    assert profiles.parameter_count({"model_info": {"general.parameter_count": 494_032_768}}) == 494_032_768
    assert profiles.parameter_count({"details": {"parameter_size": "?"}}) is None
    assert profiles.output_limit(32768, {}) == 8192 and profiles.output_limit(2048, {}) == 512
    assert profiles.output_limit(32768, {"parameters": "num_ctx 4096\nnum_predict 64"}) == 64
    mf = profiles.agent_modelfile("m", 32768, {})
    assert mf == "FROM m\nPARAMETER num_ctx 32768\nPARAMETER num_predict 8192\n"
    assert "num_predict" not in profiles.agent_modelfile("m", 8192, {"parameters": "num_predict 64"}).split("\n", 2)[2]
    lean = profiles.codex_catalog("m:latest-agent", 32768, True, None)["models"][0]
    assert lean["slug"] == "m:latest-agent" and lean["context_window"] == 32768
    assert lean["base_instructions"] == profiles.LEAN_INSTRUCTIONS
    assert profiles.codex_catalog("m", 8192, False, None) == {}  # no entry of Codex's own: its fallback stays
    own = {"slug": "gpt-x", "base_instructions": "B", "priority": 3, "max_context_window": 1, "tool_mode": None}
    full = profiles.codex_catalog("m", 8192, False, own)["models"][0]
    assert full["slug"] == "m" and full["context_window"] == 8192 and full["base_instructions"] == "B"
    assert "max_context_window" not in full
    argv, env = agent_command.command("claude", "/x/claude", "http://h", "m", None, ["-p", "hi"], lean=True,
                                      max_output=512, env={})
    assert argv == ["/x/claude", *profiles.claude_lean_args(), "-p", "hi"] and "--bare" in argv
    assert env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] == "512" and env["ANTHROPIC_BASE_URL"] == "http://h"
    argv, _ = agent_command.command("codex", "/x/codex", "http://h", "m", None, ["exec", "hi"], lean=True,
                                    catalog="/c.json", env={})
    assert 'model_catalog_json="/c.json"' in argv and argv[-4:] == ["-m", "m", "exec", "hi"]
    assert argv.index("--disable") < argv.index("exec")


class _Recorder(http.server.BaseHTTPRequestHandler):
    bodies: list = []

    def do_POST(self):  # noqa: N802
        n = int(self.headers.get("content-length") or 0)
        _Recorder.bodies.append(json.loads(self.rfile.read(n) or b"{}"))
        self.send_response(400)
        self.send_header("content-type", "application/json")
        self.end_headers()
        self.wfile.write(b'{"error": {"message": "recorded", "type": "invalid_request_error"}}')

    def log_message(self, *a):
        pass


@pytest.mark.skipif(not (agent_command.CACHE / "codex").exists() and not __import__("shutil").which("codex"),
                    reason="Codex CLI is not installed (npm install --prefix ~/.cache/localrun-agents @openai/codex)")
@pytest.mark.parametrize("lean", [True, False], ids=["lean", "full"])
def test_codex_gets_the_model_metadata(tmp_path, lean):
    """The real Codex CLI with `launch`'s settings, against a stand-in that records its first request: no
    "Model metadata ... not found" warning; lean: the short instructions and at most four tools; full:
    Codex's own instructions for its models (thousands of characters) and its full tool set."""
    exe = agent_command.agent_binary("codex")
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "CODEX_", "LOCALRUN_"))}
    env["HOME"] = str(home)
    own = None if lean else profiles.codex_own_entry(exe, env)
    if not lean:
        assert own is not None and len(own["base_instructions"]) > 2000
    catalog = profiles.write_catalog(profiles.codex_catalog("qc:latest-agent", 32768, lean, own), tmp_path / "cat")
    _Recorder.bodies = []
    server = http.server.HTTPServer(("127.0.0.1", 0), _Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        argv, env = agent_command.command("codex", exe, f"http://127.0.0.1:{server.server_port}", "qc:latest-agent",
                                          None, ["exec", "--skip-git-repo-check", "-c",
                                                 "model_providers.localrun.request_max_retries=0", "-c",
                                                 "model_providers.localrun.stream_max_retries=0", "hi"],
                                          lean=lean, catalog=str(catalog), env=env)
        r = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
                           stdin=subprocess.DEVNULL)
    finally:
        server.shutdown()
    out = r.stdout + r.stderr
    assert _Recorder.bodies, out[-2000:]
    assert "Model metadata" not in out and "fallback metadata" not in out, out[-2000:]
    body = _Recorder.bodies[0]
    first = body["input"][0]
    text = first["content"][0]["text"]
    tools = [t.get("name") or t["type"] for t in body["tools"]]
    if lean:
        assert text == profiles.LEAN_INSTRUCTIONS and len(tools) <= 4, (text, tools)
        assert not any("skills" in json.dumps(m) for m in body["input"])
    else:
        assert text == own["base_instructions"] and len(tools) > 4, tools


@pytest.mark.skipif(not (agent_command.CACHE / "codex").exists(), reason="Codex CLI is not installed")
def test_bench_agents_runs_a_task(qwen_coder_05b, tmp_path):
    """The machinery end to end: a daemon of its own, the agent model loaded, `localrun launch codex --lean`
    on the no-tool task, the run scored and counted from the daemon's /metrics."""
    from localrun.bench.agents import SuiteConfig, run_suite

    cfg = SuiteConfig([("qwen2.5-coder-0.5b", qwen_coder_05b)], ["codex"], ["lean"], tasks.select("no-tool"), timeout=600,
                 max_ctx=8192)
    lines: list[str] = []
    res = run_suite(cfg, say=lines.append)
    (row,) = res["rows"]
    print(lines, row)
    assert row["server"] == "localrun" and row["cli"] == "codex" and row["profile"] == "lean"
    assert row["rc"] == 0 and not row["timed_out"], row
    assert row["requests"] >= 1 and row["prompt_tokens"] > 500, row  # the lean prompt reached the daemon
    assert isinstance(row["passed"], bool) and row["why"]
    assert res["summary"][0]["tasks"] == 1 and res["summary"][0]["passed"] == int(row["passed"])
