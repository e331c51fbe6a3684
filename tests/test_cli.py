"""The CLI driven as a subprocess (`python -m localrun ...`) against the real daemon
(started by `localrun serve` on a free port, with its own LOCALRUN_HOME) and the real
SmolLM2 GGUF; plus the client library (sync and async) against the same daemon."""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import signal
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from daemon import stop_pid

from localrun.config import ENV_VARS

REPO = Path(__file__).resolve().parents[1]
MODEL = "smollm2:135m"
FAST = ["-o", "temperature=0", "-o", "num_predict=8", "-o", "num_ctx=512"]

pytestmark = pytest.mark.timeout(300)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_env(home: Path, port: int, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOCALRUN_")}
    env.update(LOCALRUN_HOME=str(home), LOCALRUN_HOST=f"127.0.0.1:{port}", HF_HUB_OFFLINE="1",
               HF_HUB_DISABLE_TELEMETRY="1", PYTHONUNBUFFERED="1", LOCALRUN_CONTEXT_LENGTH="512")
    env.update(extra)
    return env


def cli(env: dict, *args: str, input: str | None = None, timeout: float = 120, cwd=None):
    return subprocess.run([sys.executable, "-m", "localrun", *args], env=env, input=input if input is not None else "",
                          capture_output=True, text=True, timeout=timeout, cwd=cwd or REPO)


def wait_up(url: str, proc: subprocess.Popen | None = None, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"daemon exited with {proc.returncode}: {proc.stdout.read()[-2000:]}")
        try:
            if httpx.get(url + "/api/version", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError("daemon did not come up")


def assert_clean_error(r: subprocess.CompletedProcess, *, code: int | None = None) -> str:
    assert r.returncode != 0, r
    if code is not None:
        assert r.returncode == code, r
    assert "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip(), "an error must say what went wrong"
    return r.stderr


def _sigint_default() -> None:
    # a test run started in the background by a non-interactive shell inherits SIGINT ignored,
    # and so would the CLI; a user's terminal delivers it
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@contextlib.contextmanager
def serving(env: dict, url: str, prefix: tuple[str, ...] = ()):
    """`localrun serve` in the foreground with `env` until the block ends (SIGINT, as Ctrl+C); the
    process is yielded, its output readable from proc.stdout afterwards. `prefix`: a command that
    execs it (``unshare -m``)."""
    proc = subprocess.Popen([*prefix, sys.executable, "-m", "localrun", "serve"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=REPO, preexec_fn=_sigint_default)
    try:
        wait_up(url, proc)
        yield proc
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    """`localrun serve` in the foreground, with the model pulled once."""
    home = tmp_path_factory.mktemp("cli-home")
    port = free_port()
    env = make_env(home, port)
    with serving(env, f"http://127.0.0.1:{port}"):
        yield {"env": env, "url": f"http://127.0.0.1:{port}", "home": home}


@pytest.fixture(scope="module")
def pulled(daemon):
    r = cli(daemon["env"], "pull", MODEL)
    assert r.returncode == 0, r.stderr
    daemon["pull"] = r
    return daemon


# ---------------------------------------------------------------------------------------
# No daemon needed
# ---------------------------------------------------------------------------------------


def test_serve_help_lists_every_setting(tmp_path):
    env = make_env(tmp_path, 12345, LOCALRUN_KEEP_ALIVE="7m", LOCALRUN_NUM_PARALLEL="3")
    r = cli(env, "serve", "--help")
    assert r.returncode == 0, r.stderr
    for name, (default, _) in ENV_VARS.items():
        assert name in r.stdout
        assert default in r.stdout
    assert "current: 420s" in r.stdout  # LOCALRUN_KEEP_ALIVE=7m, read through config
    assert "current: 127.0.0.1:12345" in r.stdout
    assert str(tmp_path) in r.stdout


def test_models_live_where_localrun_models_says(tmp_path):
    """LOCALRUN_MODELS (Ollama's OLLAMA_MODELS): the library on another disk, the rest under the home;
    a place that cannot hold it stops `serve` at start with a message, not the first pull."""
    home, models, port = tmp_path / "home", tmp_path / "big-disk" / "models", free_port()
    env = make_env(home, port, LOCALRUN_MODELS=str(models))
    with serving(env, f"http://127.0.0.1:{port}") as proc:
        r = cli(env, "pull", MODEL)
        assert r.returncode == 0, r.stderr
        shown = cli(env, "show", MODEL).stdout
        assert str(models) in shown, shown  # the weights' path
        assert any((models / "blobs").iterdir()) and not (home / "models").exists()
    assert f"LOCALRUN_MODELS={models}" in proc.stdout.read()
    (tmp_path / "a-file").write_text("not a folder")
    r = cli(make_env(home, free_port(), LOCALRUN_MODELS=str(tmp_path / "a-file")), "serve")
    msg = assert_clean_error(r)
    assert "LOCALRUN_MODELS" in msg and "a-file" in msg, msg


def test_run_shows_a_thinking_models_thoughts(tmp_path):
    """As `ollama run` shows them: 'Thinking...', the thoughts, '...done thinking.', the answer;
    --hidethinking leaves them out, --think=false asks the model not to think (its template closes
    the block in the prompt), /set nothink and /set hidethinking in the REPL. The real daemon app and
    library with a fake backend (a thinking model no package ships)."""
    from fakes import FakeModel, InProcessDaemon, api_rules, library_home

    home = library_home(tmp_path / "home")
    fake = FakeModel(rules=api_rules())
    d = InProcessDaemon(home, fake)
    try:
        env = make_env(home, d.port)
        r = cli(env, "run", "thinker", "A puzzle: 2+2?")
        assert r.returncode == 0, r.stderr
        assert r.stdout == "Thinking...\nTwo and two.\n...done thinking.\n\nFour.\n", r.stdout
        r = cli(env, "run", "thinker", "A puzzle: 2+2?", "--hidethinking")
        assert r.returncode == 0 and r.stdout == "Four.\n", (r.stdout, r.stderr)
        r = cli(env, "run", "thinker", "A puzzle: 2+2?", "--think=false")
        assert r.returncode == 0 and r.stdout == "Four.\n", (r.stdout, r.stderr)
        assert "<think>\n\n</think>" in fake.requests[-1].prompt  # the model was asked not to think
        assert "</think>" not in fake.requests[-2].prompt
        r = cli(env, "run", "thinker", "hi", "--think=maybe")
        assert "--think" in assert_clean_error(r, code=1)
        r = cli(env, "run", "thinker", "--plain", input="A puzzle?\n/set hidethinking\nA puzzle again?\n/set nothink\n"
                                                          "A puzzle, no thinking?\n")
        assert r.returncode == 0, r.stderr
        assert r.stdout.count("Thinking...") == 1 and r.stdout.count("Four.") == 3, r.stdout
        assert "<think>\n\n</think>" in fake.requests[-1].prompt
    finally:
        d.stop()


def test_bad_arguments_give_usage_errors(tmp_path):
    env = make_env(tmp_path, free_port())
    r = cli(env, "run")
    assert_clean_error(r, code=2)
    assert "usage:" in r.stderr
    r = cli(env, "frobnicate")
    assert_clean_error(r, code=2)
    assert "invalid choice" in r.stderr
    r = cli(env, "--no-autostart", "run", MODEL, "hi", "--keepalive", "soon")
    assert_clean_error(r, code=1)
    assert "--keepalive" in r.stderr


def test_unreachable_daemon_without_autostart(tmp_path):
    port = free_port()
    r = cli(make_env(tmp_path, port), "--no-autostart", "list")
    err = assert_clean_error(r, code=1)
    assert f"127.0.0.1:{port}" in err and "localrun serve" in err
    assert len(err.strip().splitlines()) == 1


def test_bad_environment_is_one_line(tmp_path):
    r = cli(make_env(tmp_path, free_port(), LOCALRUN_NUM_PARALLEL="many"), "list")
    err = assert_clean_error(r, code=1)
    assert "LOCALRUN_NUM_PARALLEL" in err


def test_misspelled_option_is_a_usage_error(tmp_path):
    """-o num_predcit=3 (a typo the daemon would pass over: an unbounded answer) is refused before any daemon
    is asked, argparse-style (exit 2), naming the option meant."""
    env = make_env(tmp_path, free_port())
    r = cli(env, "--no-autostart", "run", MODEL, "hi", "-o", "num_predcit=3")
    err = assert_clean_error(r, code=2)
    assert "usage:" in err and "num_predcit" in err and "did you mean num_predict" in err, err
    assert "daemon" not in err, err  # no daemon was needed to say so
    r = cli(env, "--no-autostart", "run", MODEL, "hi", "-o", "Temperature=0")
    assert "did you mean temperature" in assert_clean_error(r, code=2)
    r = cli(env, "--no-autostart", "run", MODEL, "hi", "-o", "frobnicate=1")
    err = assert_clean_error(r, code=2)
    assert "known options:" in err and "num_predict" in err and "temperature" in err, err
    # a known option goes on to the daemon (none answers here)
    r = cli(env, "--no-autostart", "run", MODEL, "hi", "-o", "num_predict=3", "-o", "stop=x")
    assert "no localrun daemon answers" in assert_clean_error(r, code=1)


def test_bad_host_flag_names_the_flag(tmp_path):
    env = make_env(tmp_path, free_port())
    for args in (("--host", "127.0.0.1:99999", "list"), ("--host", "foo:bar", "ps"), ("serve", "--host", "foo:bar")):
        r = cli(env, *args)
        err = assert_clean_error(r, code=1)
        assert "--host:" in err and "LOCALRUN_HOST" not in err, (args, err)
        assert args[-1] in err or args[1] in err, err
    # a bad LOCALRUN_HOST is still named as the variable
    r = cli(dict(env, LOCALRUN_HOST="127.0.0.1:99999"), "list")
    assert "LOCALRUN_HOST" in assert_clean_error(r, code=1)


def test_daemon_that_cannot_start_is_a_clear_error(tmp_path):
    with socket.socket() as squatter:  # something else holds the port and never answers HTTP
        squatter.bind(("127.0.0.1", 0))
        squatter.listen(8)
        port = squatter.getsockname()[1]
        r = cli(make_env(tmp_path, port), "list", timeout=90)
    err = assert_clean_error(r, code=1)
    assert "exited at start" in err and "server.log" in err, err


def test_autostart_starts_a_daemon_in_the_background(tmp_path):
    port = free_port()
    env = make_env(tmp_path, port, LOCALRUN_API_KEY="sekrit")  # the started daemon and the CLI share it
    r = cli(env, "list", timeout=90)
    pid = None
    try:
        assert r.returncode == 0, r.stderr
        m = re.search(r"started the daemon at \S+ \(pid (\d+)\)", r.stderr)
        assert m, r.stderr
        pid = int(m.group(1))
        assert "NAME" in r.stdout and "MODIFIED" in r.stdout
        # it outlives the CLI and keeps answering; a second command reuses it
        auth = {"Authorization": "Bearer sekrit"}
        assert httpx.get(f"http://127.0.0.1:{port}/api/version", headers=auth, timeout=5).status_code == 200
        r2 = cli(env, "ps")
        assert r2.returncode == 0 and "started the daemon" not in r2.stderr
        assert (tmp_path / "logs" / "server.log").is_file()
        # `run` pulls a model the library lacks first, as `ollama run` does
        r3 = cli(env, "run", MODEL, "Hi", *FAST)
        assert r3.returncode == 0, r3.stderr
        assert "success" in r3.stderr and r3.stdout.strip()
        r4 = cli(dict(env, LOCALRUN_API_KEY="wrong"), "list")
        assert "started the daemon" not in r4.stderr
        assert_clean_error(r4, code=1)
    finally:
        if pid:
            stop_pid(pid)


def _serve_processes(port: int) -> list:
    """This machine's `localrun serve` processes bound for 127.0.0.1:`port` (by their LOCALRUN_HOST)."""
    import psutil

    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            cmd = " ".join(p.info["cmdline"] or [])
            if "localrun" in cmd and "serve" in cmd and p.environ().get("LOCALRUN_HOST") == f"127.0.0.1:{port}":
                found.append(p)
        except psutil.Error:
            pass
    return found


def test_racing_autostarts_start_one_daemon(tmp_path):
    """`(localrun list &); (localrun list &); localrun ps` with no daemon: each spawns one, one binds the
    port, the others exit ("address already in use"). Only the command whose own child serves says it
    started the daemon (with the pid that serves); the others say one started meanwhile, and leave no
    child of theirs behind."""
    port = free_port()
    env = make_env(tmp_path, port)
    procs = [subprocess.Popen([sys.executable, "-m", "localrun", verb], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=REPO) for verb in ("list", "list", "ps")]
    try:
        outs = [p.communicate(timeout=120) for p in procs]
        assert all(p.returncode == 0 for p in procs), outs
        started = [int(m.group(1)) for _, err in outs
                   for m in re.finditer(r"started the daemon at \S+ \(pid (\d+)\)", err)]
        assert len(started) == 1, [err for _, err in outs]
        meanwhile = sum("a daemon started meanwhile" in err for _, err in outs)
        assert meanwhile + len(started) <= 3
        deadline = time.monotonic() + 10
        while len(alive := _serve_processes(port)) > 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert [p.pid for p in alive] == started, (alive, started, [err for _, err in outs])
        assert httpx.get(f"http://127.0.0.1:{port}/api/version", timeout=5).status_code == 200
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in _serve_processes(port):
            stop_pid(p.pid)


# ---------------------------------------------------------------------------------------
# Against the daemon
# ---------------------------------------------------------------------------------------


def test_pull_draws_progress(pulled):
    r = pulled["pull"]
    assert "success" in r.stderr
    assert re.search(r"\d+(\.\d+)?/\d+(\.\d+)? MB", r.stderr), r.stderr  # rich DownloadColumn: bytes
    assert "Traceback" not in r.stderr


def test_list(pulled):
    r = cli(pulled["env"], "ls")
    assert r.returncode == 0, r.stderr
    header, *rows = r.stdout.strip().splitlines()
    assert header.split() == ["NAME", "ID", "SIZE", "MODIFIED", "CAPABILITIES"]
    row = next(x for x in rows if x.startswith(MODEL))
    assert re.search(r"\b[0-9a-f]{12}\b", row) and " MB" in row and ("ago" in row or "just now" in row)


def test_show(pulled):
    env = pulled["env"]
    r = cli(env, "show", MODEL)
    assert r.returncode == 0, r.stderr
    assert re.search(r"architecture\s+llama", r.stdout)
    assert re.search(r"parameters\s+13\d\.\d+M", r.stdout)
    path = re.search(r"path\s+(\S.*)$", r.stdout, re.M).group(1).strip()
    assert Path(path).is_file() and Path(path).stat().st_size > 90_000_000
    r = cli(env, "show", MODEL, "--modelfile")
    assert r.returncode == 0 and "FROM" in r.stdout
    r = cli(env, "show", MODEL, "--template")
    assert r.returncode == 0 and "im_start" in r.stdout
    r = cli(env, "show", MODEL, "--parameters")
    assert r.returncode == 0, r.stderr
    r = cli(env, "show", MODEL, "--verbose")
    assert r.returncode == 0 and "general.architecture" in r.stdout
    r = cli(env, "show", MODEL, "--modelfile", "--license")
    assert_clean_error(r, code=2)


def test_run_with_prompt_streams_answer(pulled):
    r = cli(pulled["env"], "run", MODEL, "Say hello.", *FAST)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()
    # options before the prompt words, as people type it: `run MODEL --verbose PROMPT`
    r = cli(pulled["env"], "run", MODEL, "--verbose", *FAST, "Say", "hello.")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() and "prompt eval count" in r.stderr


def test_piped_stdin_is_the_prompt_and_verbose_stats(pulled):
    env = pulled["env"]

    def prompt_tokens(r):
        assert r.returncode == 0, r.stderr
        return int(re.search(r"prompt eval count:\s+(\d+) token", r.stderr).group(1))

    alone = cli(env, "run", MODEL, "Summarize:", "--verbose", *FAST)
    n_alone = prompt_tokens(alone)
    for label in ("total duration", "time to first token", "cached prompt tokens", "eval rate"):
        assert label in alone.stderr
    assert re.search(r"eval rate:\s+\d+\.\d+ tokens/s", alone.stderr)
    story = "The quick brown fox jumps over the lazy dog. " * 3
    both = cli(env, "run", MODEL, "Summarize:", "--verbose", *FAST, input=story)
    assert prompt_tokens(both) >= n_alone + 25  # stdin (~30 tokens) was appended to PROMPT
    only = cli(env, "run", MODEL, "--verbose", *FAST, input=story)
    assert prompt_tokens(only) >= n_alone + 20


def test_format_json_output_parses(pulled, tmp_path):
    r = cli(pulled["env"], "run", MODEL, "Give a JSON object with keys name and age for a person.",
            "--format", "json", "-o", "temperature=0", "-o", "num_predict=96")
    assert r.returncode == 0, r.stderr
    assert isinstance(json.loads(r.stdout), (dict, list))
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}}, "required": ["name"]}
    (tmp_path / "person.json").write_text(json.dumps(schema))
    r = cli(pulled["env"], "run", MODEL, "Name one animal.", "--format", str(tmp_path / "person.json"),
            "-o", "temperature=0", "-o", "num_predict=40")
    assert r.returncode == 0, r.stderr
    assert isinstance(json.loads(r.stdout)["name"], str)
    r = cli(pulled["env"], "run", MODEL, "hi", "--format", "yaml")
    assert "--format" in assert_clean_error(r, code=1)


def test_ps_stop_and_keepalive(pulled):
    env = pulled["env"]
    r = cli(env, "stop", MODEL)  # (whatever an earlier test left loaded)
    r = cli(env, "run", MODEL, "--keepalive", "10m", input="")  # empty stdin: just load the model
    assert r.returncode == 0 and not r.stdout.strip(), r.stderr
    r = cli(env, "ps")
    assert r.returncode == 0, r.stderr
    header, *rows = r.stdout.strip().splitlines()
    assert header.split() == ["NAME", "ID", "SIZE", "PROCESSOR", "WHERE", "BACKEND", "CONTEXT", "PARALLEL", "UNTIL"]
    row = next(x for x in rows if x.startswith(MODEL))
    assert "100% CPU" in row and re.search(r"CPU\s+llama\.cpp\s+\d+\s+\d+\s", row) and "from now" in row
    shown = {m["name"]: m for m in httpx.get(pulled["url"] + "/api/ps").json()["models"]}[MODEL]
    assert re.search(rf"llama\.cpp\s+{shown['context_length']}\s+{shown['slots']}\s", row), (row, shown)
    assert re.search(r"\b(9|10) minutes from now", row), row
    r = cli(env, "ps", "--verbose")
    assert r.returncode == 0 and "context" in r.stdout and "slot" in r.stdout
    assert re.search(r"context \d+ tokens \(f16 KV cache\)", r.stdout), r.stdout
    assert re.search(r"runner process \d+: \d+ MB resident", r.stdout), r.stdout  # the model's own process
    r = cli(env, "stop", MODEL)
    assert r.returncode == 0, r.stderr
    deadline = time.monotonic() + 10
    while MODEL in cli(env, "ps").stdout:
        assert time.monotonic() < deadline, "stop did not unload the model"
        time.sleep(0.3)
    r = cli(env, "stop", MODEL)
    assert "not running" in assert_clean_error(r, code=1)


def test_stop_resolves_names_as_the_daemon_does(pulled):
    """`stop` takes the names every other verb takes (the daemon resolves them: smollm2 is smollm2:135m
    through its catalog alias, case is folded), and says so when the model is not loaded or not there."""
    env = pulled["env"]

    def load():
        r = cli(env, "run", MODEL, "--keepalive", "10m", input="")  # empty stdin: just load the model
        assert r.returncode == 0, r.stderr
        assert MODEL in cli(env, "ps").stdout

    for name in ("SMOLLM2:135m", "smollm2"):
        load()
        r = cli(env, "stop", name)
        assert r.returncode == 0, (name, r.stderr)
        assert MODEL not in cli(env, "ps").stdout, name
    r = cli(env, "stop", "smollm2")
    assert "'smollm2' is not running" in assert_clean_error(r, code=1)
    r = cli(env, "stop", "no-such-model")
    assert "no-such-model" in assert_clean_error(r, code=1)
    assert "smollm2:latest" not in cli(env, "list").stdout


def test_repl_refuses_a_misspelled_parameter(pulled):
    script = "/set parameter num_predcit 3\n/set parameter temprature 0\n/show info\n/bye\n"
    r = cli(pulled["env"], "run", MODEL, "--plain", input=script)
    assert r.returncode == 0, r.stderr
    assert "did you mean num_predict" in r.stderr and "did you mean temperature" in r.stderr, r.stderr
    assert "Set parameter" not in r.stdout and "Session parameters" not in r.stdout, r.stdout


def test_chat_with_an_alias_opens_the_librarys_model(pulled):
    """`localrun chat smollm2` opens the TUI on smollm2:135m (the daemon's alias), not a fresh smollm2:latest."""
    t = Pty(pulled["env"], "chat", "smollm2")
    try:
        t.read_until(b"\x1b[?1049h")  # the TUI switched to the alternate screen
        t.read_until(b"model: " + MODEL.encode(), timeout=30)
        assert b"pulling" not in t.out
        t.send(b"\x11")  # ctrl+q quits
        assert t.wait() == 0
    finally:
        t.close()
    assert "smollm2:latest" not in cli(pulled["env"], "list").stdout


def test_cp_and_rm(pulled):
    env = pulled["env"]
    r = cli(env, "cp", MODEL, "mycopy")
    assert r.returncode == 0, r.stderr
    assert "mycopy:latest" in cli(env, "list").stdout
    r = cli(env, "rm", "mycopy")
    assert r.returncode == 0 and "deleted 'mycopy'" in r.stdout
    listing = cli(env, "list").stdout
    assert "mycopy" not in listing and MODEL in listing  # the shared blob survives
    r = cli(env, "rm", "mycopy")
    msg = assert_clean_error(r, code=1)
    assert "'mycopy' not found" in msg and "localrun list" in msg and "pull" not in msg, msg


def test_create_resolves_paths_next_to_the_modelfile(pulled, smollm2_gguf, tmp_path):
    env = pulled["env"]
    d = tmp_path / "proj"
    d.mkdir()
    os.symlink(smollm2_gguf, d / "weights.gguf")
    (d / "Modelfile").write_text('FROM ./weights.gguf\nPARAMETER temperature 0.25\nSYSTEM """You are a pirate."""\n')
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    r = cli(env, "create", "pirate", "-f", str(Path("..") / "proj" / "Modelfile"), cwd=elsewhere)
    assert r.returncode == 0, r.stderr
    assert "success" in r.stderr and "uploading" not in r.stderr  # a daemon that sees the file reads it itself
    assert "pirate" in cli(env, "show", "pirate", "--system").stdout
    assert "0.25" in cli(env, "show", "pirate", "--parameters").stdout
    r = cli(env, "run", "pirate", "Hello", *FAST)
    assert r.returncode == 0, r.stderr
    r = cli(env, "create", "broken", "-f", str(tmp_path / "nope" / "Modelfile"))
    assert "no Modelfile" in assert_clean_error(r, code=1)


def test_create_against_a_daemon_on_another_machine_uploads_the_files(smollm2_gguf, tmp_path):
    """A daemon that is not on this machine cannot read the files a Modelfile's FROM names: the CLI
    uploads them (POST /api/blobs, skipped when the daemon has them) as `ollama create` does. Here the
    daemon listens on 127.0.0.2, an address the CLI does not count as this machine."""
    home, port = tmp_path / "remote-home", free_port()
    env = make_env(home, port, LOCALRUN_HOST=f"127.0.0.2:{port}")
    with serving(env, f"http://127.0.0.2:{port}") as proc:
        d = tmp_path / "proj"
        d.mkdir()
        os.symlink(smollm2_gguf, d / "weights.gguf")
        (d / "Modelfile").write_text('FROM ./weights.gguf\nSYSTEM """You are a pirate."""\n'
                                     'PARAMETER stop "<|im_end|>"\nPARAMETER temperature 0.25\n')
        r = cli(env, "create", "pirate", "-f", str(d / "Modelfile"))
        assert r.returncode == 0, r.stderr
        assert "uploading weights.gguf" in r.stderr and "success" in r.stderr
        assert "pirate" in cli(env, "show", "pirate", "--system").stdout
        params = cli(env, "show", "pirate", "--parameters").stdout
        assert "0.25" in params and "<|im_end|>" in params
        r = cli(env, "run", "pirate", "Hello", *FAST)
        assert r.returncode == 0 and r.stdout.strip(), r.stderr
        # again: the daemon has the file, so nothing is sent twice
        r = cli(env, "create", "pirate2", "-f", str(d / "Modelfile"))
        assert r.returncode == 0 and "uploading" not in r.stderr, r.stderr
        # a FROM that names a model goes as it is; a FROM file that is not there is a clean error
        (d / "Modelfile.child").write_text("FROM pirate\nSYSTEM be brief\n")
        assert cli(env, "create", "child", "-f", str(d / "Modelfile.child")).returncode == 0
        (d / "Modelfile.bad").write_text("FROM ./missing.gguf\n")
        assert "missing.gguf" in assert_clean_error(cli(env, "create", "bad", "-f", str(d / "Modelfile.bad")), code=1)
    log = proc.stdout.read()
    assert log.count("stored an uploaded file") == 1, log[-3000:]


def test_create_against_a_daemon_with_its_own_files_uploads_them(smollm2_gguf, tmp_path):
    """A daemon in a container, reached through a port published on 127.0.0.1, is on this machine's
    loopback but does not see its files (or sees others at the same paths): the CLI uploads them, as
    to another machine. Here the daemon runs in a mount namespace of its own (`unshare -m`, as a
    container's), on 127.0.0.1."""
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode:
        pytest.skip("`unshare -m` is not allowed here (it needs root or user namespaces)")
    home, port = tmp_path / "boxed-home", free_port()
    env = make_env(home, port)
    with serving(env, f"http://127.0.0.1:{port}", prefix=("unshare", "-m")) as proc:
        d = tmp_path / "proj"
        d.mkdir()
        os.symlink(smollm2_gguf, d / "weights.gguf")
        (d / "Modelfile").write_text("FROM ./weights.gguf\nSYSTEM be brief\n")
        r = cli(env, "create", "boxed", "-f", str(d / "Modelfile"))
        assert r.returncode == 0, r.stderr
        assert "uploading weights.gguf" in r.stderr and "success" in r.stderr
        assert "be brief" in cli(env, "show", "boxed", "--system").stdout
    log = proc.stdout.read()
    assert log.count("stored an uploaded file") == 1, log[-3000:]


def test_create_from_repo_modelfiles(pulled):
    examples = sorted((REPO / "modelfiles").glob("*")) if (REPO / "modelfiles").is_dir() else []
    examples = [p for p in examples if p.is_file() and "FROM smollm2" in p.read_text(errors="replace")]
    if not examples:
        pytest.skip("no modelfiles/ example built on smollm2 in this checkout")
    r = cli(pulled["env"], "create", "example-model", "-f", str(examples[0]))
    assert r.returncode == 0, r.stderr
    assert "example-model:latest" in cli(pulled["env"], "list").stdout


def test_unknown_model_is_a_clear_error(pulled):
    env = pulled["env"]
    r = cli(env, "run", "no-such-model:7b", "hi")
    err = assert_clean_error(r, code=1)
    assert "no-such-model" in err
    r = cli(env, "show", "no-such-model")
    assert "no-such-model" in assert_clean_error(r, code=1)
    r = cli(env, "pull", "bad..name")
    assert_clean_error(r, code=1)


def test_repl_from_piped_stdin(pulled):
    script = "\n".join([
        "/set parameter num_predict 6",
        "/set parameter temperature 0",
        "/set system You answer briefly.",
        "/show parameters",
        "/frob",
        '"""Line one',
        'line two"""',
        "/bye",
        "never sent",
    ]) + "\n"
    r = cli(pulled["env"], "run", MODEL, "--plain", "--verbose", input=script)
    assert r.returncode == 0, r.stderr
    assert "Set parameter 'num_predict' to '6'" in r.stdout
    assert "Unknown command '/frob'" in r.stdout
    assert r.stderr.count("prompt eval count:") == 1  # one answer (the multi-line message); /bye ended it
    assert re.search(r"^eval count:\s+[1-6] token", r.stderr, re.M), r.stderr  # num_predict 6 was applied


def test_repl_save_makes_a_model_of_the_session(pulled):
    """Ollama's /save NAME: a new model from this one with the session's system message, parameters
    and conversation (MESSAGE history); `run NAME` goes on from that conversation, with its settings."""
    env = pulled["env"]
    script = "\n".join([
        "/set parameter temperature 0",
        "/set parameter num_predict 5",
        "/set system You answer in one word.",
        "Sky colour?",
        "/save",
        "/save saved-session",
        "/save bad..name",
        "/bye",
    ]) + "\n"
    r = cli(env, "run", MODEL, "--plain", input=script)
    assert r.returncode == 0, r.stderr
    assert "Usage:\n  /save <modelname>" in r.stdout and "Created new model 'saved-session'" in r.stdout
    assert "Error:" in r.stderr and "bad..name" in r.stderr and "Traceback" not in r.stderr
    mf = cli(env, "show", "saved-session", "--modelfile")
    assert mf.returncode == 0, mf.stderr
    assert "TEMPLATE" in mf.stdout and "SYSTEM You answer in one word." in mf.stdout  # the base model's template
    assert "PARAMETER num_predict 5" in mf.stdout and "PARAMETER temperature 0" in mf.stdout
    assert "MESSAGE user Sky colour?" in mf.stdout and mf.stdout.count("MESSAGE assistant") == 1
    info = httpx.post(f"http://{env['LOCALRUN_HOST']}/api/show", json={"model": "saved-session"}).json()
    assert [m["role"] for m in info["messages"]] == ["user", "assistant"]
    again = cli(env, "run", "saved-session", "--verbose", "And grass?")
    assert again.returncode == 0, again.stderr
    # its prompt is the saved system message and conversation, then the new question
    chat = [{"role": "system", "content": "You answer in one word."}, *info["messages"],
            {"role": "user", "content": "And grass?"}]
    want = httpx.post(f"http://{env['LOCALRUN_HOST']}/tokenize", json={"model": MODEL, "messages": chat}).json()
    assert int(re.search(r"prompt eval count:\s+(\d+)", again.stderr).group(1)) == want["count"]
    assert re.search(r"^eval count:\s+[1-5] token", again.stderr, re.M), again.stderr  # its num_predict 5
    cli(env, "rm", "saved-session")


class Pty:
    """A CLI process on a pseudo-terminal (stdin and stdout are TTYs, as for a user)."""

    def __init__(self, env: dict, *args: str):
        import pty

        self.master, slave = pty.openpty()
        os.set_blocking(self.master, True)
        self.proc = subprocess.Popen([sys.executable, "-m", "localrun", *args], env=dict(env, COLUMNS="100", LINES="30"),
                                     stdin=slave, stdout=slave, stderr=slave, cwd=REPO, close_fds=True,
                                     start_new_session=True)
        os.close(slave)
        self.out = b""

    def read_until(self, token: bytes, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while token not in self.out:
            assert time.monotonic() < deadline, self.out.decode(errors="replace")[-3000:]
            if select.select([self.master], [], [], 0.5)[0]:
                try:
                    self.out += os.read(self.master, 65536)
                except OSError:
                    break

    def poll_once(self, timeout: float = 0.2) -> None:
        if select.select([self.master], [], [], timeout)[0]:
            try:
                self.out += os.read(self.master, 65536)
            except OSError:
                pass

    def send(self, data: bytes) -> None:
        self.out = b""
        os.write(self.master, data)

    def wait(self, timeout: float = 30) -> int:
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            if select.select([self.master], [], [], 0.2)[0]:  # keep draining so the child never blocks
                try:
                    os.read(self.master, 65536)
                except OSError:
                    pass
        return self.proc.wait(timeout=1)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        os.close(self.master)


def test_repl_on_a_terminal(pulled):
    t = Pty(pulled["env"], "run", MODEL, "--plain")
    try:
        t.read_until(b">>> ")
        t.send(b"/set parameter num_predict 4\n")
        t.read_until(b"Set parameter")
        t.read_until(b">>> ")  # type only at the prompt: text typed earlier is echoed twice
        t.send(b"Hi\n")
        t.read_until(b">>> ")
        # Ctrl+C during an answer stops it and returns to the prompt
        t.send(b"/set parameter num_predict 2000\n")
        t.read_until(b"Set parameter")
        t.read_until(b">>> ")
        t.send(b"Tell me a very long story.\n")
        t.read_until(b"story.\r\n")
        # interrupt as soon as the answer is streaming (a fixed sleep raced with short stories:
        # a Ctrl+C that lands on the next prompt makes readline drop the line typed after it)
        deadline = time.monotonic() + 60

        def output_after(echoed: int) -> None:
            while len(t.out) < echoed + 12:
                assert time.monotonic() < deadline, t.out.decode(errors="replace")
                t.poll_once()

        echoed = len(t.out)
        output_after(echoed)
        if t.out[echoed:].lstrip(b"\r\n").startswith(b">>> Tell m"):
            # typed before readline held the terminal (a loaded machine): the terminal echoed the line, then
            # readline showed it again after a fresh prompt; the answer streams after that second echo
            while t.out.count(b"story.\r\n") < 2:
                assert time.monotonic() < deadline, t.out.decode(errors="replace")
                t.poll_once()
            echoed = t.out.rindex(b"story.\r\n") + len(b"story.\r\n")
            output_after(echoed)
        assert b">>> " not in t.out[echoed:], "the answer ended before it could be interrupted"
        t.proc.send_signal(signal.SIGINT)
        t.read_until(b">>> ", timeout=20)
        assert t.proc.poll() is None
        t.send(b"/bye\n")
        assert t.wait() == 0
    finally:
        t.close()


def test_run_on_a_terminal_opens_the_chat_tui(pulled):
    t = Pty(pulled["env"], "run", MODEL)
    try:
        t.read_until(b"\x1b[?1049h")  # the TUI switched to the alternate screen
        t.read_until(MODEL.encode())  # and shows the model it was opened with
        time.sleep(1)
        t.send(b"\x11")  # ctrl+q quits
        assert t.wait() == 0
    finally:
        t.close()


def test_ctrl_c_stops_a_stream(pulled):
    proc = subprocess.Popen([sys.executable, "-m", "localrun", "run", MODEL, "Write a very long story about a dragon.",
                             "-o", "num_predict=2000", "-o", "num_ctx=2048"], env=pulled["env"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO, preexec_fn=_sigint_default)
    try:
        os.set_blocking(proc.stdout.fileno(), False)
        deadline = time.monotonic() + 60
        got = b""
        while len(got) < 20:
            assert time.monotonic() < deadline and proc.poll() is None, got
            got += proc.stdout.read() or b""
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=15) == 130
        assert b"Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    # the daemon is fine afterwards
    r = cli(pulled["env"], "run", MODEL, "Hi", *FAST)
    assert r.returncode == 0, r.stderr


# ---------------------------------------------------------------------------------------
# The client library itself (the TUI uses the async one)
# ---------------------------------------------------------------------------------------


def test_client_sync_and_async(pulled):
    from localrun.client import APIError, AsyncDaemonClient, DaemonClient

    with DaemonClient(pulled["url"]) as c:
        assert c.is_up() and c.version().get("version")
        assert any(m["name"] == MODEL for m in c.tags())
        chunks = list(c.chat(MODEL, [{"role": "user", "content": "Hi"}], options={"num_predict": 4, "temperature": 0}))
        assert chunks[-1]["done"] and chunks[-1]["eval_count"] >= 1
        with pytest.raises(APIError) as e:
            c.show("no-such-model")
        assert e.value.status == 404
        stream = c.generate(MODEL, "Count to one hundred:", options={"num_predict": 500})
        next(stream)
        stream.close()  # closing early closes the response; the daemon aborts the request

    async def go():
        async with AsyncDaemonClient(pulled["url"]) as a:
            assert await a.is_up()
            assert any(m["name"] == MODEL for m in await a.tags())
            parts = [ch async for ch in a.chat(MODEL, [{"role": "user", "content": "Hi"}],
                                                options={"num_predict": 4, "temperature": 0})]
            assert parts[-1]["done"]
            with pytest.raises(APIError):
                await a.show("no-such-model")

    import asyncio

    asyncio.run(go())


def test_serve_refuses_a_second_daemon_on_the_same_address(daemon):
    r = cli(daemon["env"], "serve", timeout=30)
    assert "already running" in assert_clean_error(r, code=1)


def test_word_wrap_breaks_between_words():
    import io

    from localrun.cli.stream import WordWrapper

    out = io.StringIO()
    w = WordWrapper(out, 20)
    for piece in ["Hello the", "re, this is a lo", "ng sentence that should wrap nicely\nacross ", "lines."]:
        w.write(piece)
    w.flush()
    assert out.getvalue() == "Hello there, this is\na long sentence that\nshould wrap nicely\nacross lines."


def test_bench_is_delegated(tmp_path):
    r = cli(make_env(tmp_path, free_port()), "--no-autostart", "bench", "--help")
    assert r.returncode == 0, r.stderr
    assert "usage: localrun bench" in r.stdout and "throughput" in r.stdout
