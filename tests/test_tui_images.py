"""Images in the chat TUI: `/image PATH` and a dropped path (a message that is just an existing image
file's path) attach to the next message and show as attachment lines. Driven by Textual's Pilot
(attachment handling, errors) and, end to end, `localrun chat` in a real terminal inside tmux against
the real daemon serving the tiny vision model: the reply to a message with two attached images
equals the ollama SDK's /api/chat answer for the same images and text."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
import time
import uuid

import pytest
from vlm_model import png, vision_daemon

from localrun.tui.app import ChatApp
from localrun.tui.commands import CommandError, parse_command
from localrun.tui.store import ChatStore
from localrun.tui.widgets import MessageView, Notice

pytestmark = pytest.mark.timeout(300)
RED, NOISE = png((255, 0, 0)), png((0, 0, 0), (80, 80), noise_seed=0)
OPTIONS = {"temperature": 0, "num_predict": 10, "seed": 1}
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def pics(tmp_path):
    d = tmp_path / "pics"
    d.mkdir()
    (d / "red.png").write_bytes(RED)
    (d / "noise.png").write_bytes(NOISE)
    (d / "my cat.png").write_bytes(RED)
    (d / "notes.png").write_text("not an image\n")
    return d


def test_parse_image_commands():
    assert parse_command("/image ./cat.png").value == "./cat.png"
    assert parse_command('/image "my cat.png"').value == "my cat.png"
    assert parse_command(r"/image my\ cat.png").value == "my cat.png"
    assert parse_command("/detach").name == "detach"
    with pytest.raises(CommandError, match="usage: /image PATH"):
        parse_command("/image")
    with pytest.raises(CommandError, match="takes no argument"):
        parse_command("/detach all")


async def test_attach_errors_drops_and_detach_without_a_daemon(pics, tmp_path):
    """No daemon is needed to attach: files are read and checked by the app."""
    from test_tui import type_and_send, wait_for

    app = ChatApp(model=None, base_url="http://127.0.0.1:9", store=ChatStore(tmp_path / "chats"))
    async with app.run_test(size=(100, 30)) as pilot:
        notices = lambda kind: [n.text for n in app.query(Notice) if n.kind == kind]  # noqa: E731
        await type_and_send(pilot, f"/image {pics}/nope.png")
        await wait_for(pilot, lambda: any("no such file" in t for t in notices("error")), 10, "the error")
        await type_and_send(pilot, f"/image {pics}/notes.png")
        await wait_for(pilot, lambda: any("not an image" in t for t in notices("error")), 10, "the error")
        assert app.pending == []
        await type_and_send(pilot, f"/image {pics}/red.png")
        await wait_for(pilot, lambda: len(app.pending) == 1, 10, "the attachment")
        await type_and_send(pilot, f"'{pics}/my cat.png'")  # dropped on the terminal: quoted path
        await wait_for(pilot, lambda: len(app.pending) == 2, 10, "the dropped attachment")
        assert app.input_box.text == ""  # the path did not become a message
        assert any(t.startswith("[image] red.png (png,") for t in notices("info"))
        assert any(t.startswith("[image] my cat.png (png,") and "(2 images)" in t for t in notices("info"))
        assert [a.data for a in app.pending] == [RED, RED]
        await type_and_send(pilot, "/detach")
        await wait_for(pilot, lambda: not app.pending, 10, "detach")
        assert app.conv.messages == [] and app.is_running


async def test_a_resumed_conversation_shows_its_attachments(tmp_path):
    from test_tui import wait_for

    from localrun.tui.store import Conversation

    store = ChatStore(tmp_path / "chats")
    b64 = base64.b64encode(RED).decode()
    conv = Conversation(model="vlm:latest", messages=[
        {"role": "user", "content": "describe", "images": [b64], "attachments": ["red.png (png, 70 B)"]},
        {"role": "assistant", "content": "red"}])
    store.save(conv)
    loaded = store.load(conv.id)
    assert loaded.messages[0]["images"] == [b64] and loaded.messages[0]["attachments"] == ["red.png (png, 70 B)"]
    app = ChatApp(model=None, base_url="http://127.0.0.1:9", store=store)
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_for(pilot, lambda: app.last_error is not None, 20, "the app to start (no daemon there)")
        await app.resume(conv.id)
        await wait_for(pilot, lambda: any(v.role == "user" for v in app.query(MessageView)), 10, "the resume")
        view = next(v for v in app.query(MessageView) if v.role == "user")
        assert view.attachments == ["red.png (png, 70 B)"]
        assert "[image] red.png (png, 70 B)" in [str(lbl.render()) for lbl in view.query(".attachment")]


@pytest.fixture(scope="module")
def daemon(vlm, smollm2_gguf, tmp_path_factory):
    with vision_daemon(tmp_path_factory.mktemp("tui-images-home"), vlm, smollm2_gguf) as d:
        yield d


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")
def test_chat_in_tmux_sends_attached_images(daemon, pics):
    import ollama

    sock = f"lr-test-{uuid.uuid4().hex[:8]}"
    tmux = ["tmux", "-L", sock]
    env = dict(os.environ, LOCALRUN_HOME=str(daemon.home), LOCALRUN_HOST=f"127.0.0.1:{daemon.port}",
               TERM="xterm-256color", PYTHONPATH=REPO)
    env.pop("NO_COLOR", None)
    env.pop("TMUX", None)
    chats = daemon.home / "chats"
    before = set(chats.glob("*.json")) if chats.is_dir() else set()
    cmd = f"cd {pics} && exec {sys.executable} -m localrun chat vlm"
    subprocess.run([*tmux, "new-session", "-d", "-s", "t", "-x", "110", "-y", "34", cmd], env=env, check=True)

    def screen() -> str:
        return subprocess.run([*tmux, "capture-pane", "-p", "-t", "t"], capture_output=True, text=True).stdout

    def wait(cond, timeout, what):
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}; the screen:\n{screen()}")
            time.sleep(0.2)

    def send(text: str) -> None:
        subprocess.run([*tmux, "send-keys", "-t", "t", "-l", text], check=True)
        time.sleep(0.2)
        subprocess.run([*tmux, "send-keys", "-t", "t", "Enter"], check=True)
        time.sleep(0.4)

    def new_chats():
        return [p for p in chats.glob("*.json") if p not in before] if chats.is_dir() else []

    try:
        wait(lambda: "model: vlm:latest" in screen(), 60, "the app did not start")
        for k, v in OPTIONS.items():
            send(f"/set {k} {v}")
        send("/image red.png")  # relative to the terminal's directory
        wait(lambda: "[image] red.png (png," in screen(), 20, "no attachment line for /image")
        send(f"{pics}/noise.png")  # a dropped file: the message is just its path
        wait(lambda: "[image] noise.png (png," in screen(), 20, "no attachment line for the dropped path")
        send("describe")

        def replied() -> bool:
            return any(len(json.loads(p.read_text())["messages"]) == 2 for p in new_chats())

        wait(replied, 120, "no reply was saved")
        msgs = json.loads(new_chats()[0].read_text())["messages"]
        assert msgs[0]["content"] == "describe"
        assert [base64.b64decode(i) for i in msgs[0]["images"]] == [RED, NOISE]
        assert [a.split(" (")[0] for a in msgs[0]["attachments"]] == ["red.png", "noise.png"]
        want = ollama.Client(host=daemon.url).chat(
            model="vlm", messages=[{"role": "user", "content": "describe", "images": [RED, NOISE]}],
            options=OPTIONS).message.content
        assert want and msgs[1]["content"] == want
        # the user's turn on screen carries both attachment lines
        text = screen()
        you = text.rfind("You")
        assert you >= 0 and "[image] red.png" in text[you:] and "[image] noise.png" in text[you:], text
        subprocess.run([*tmux, "send-keys", "-t", "t", "C-q"], check=True)
        wait(lambda: subprocess.run([*tmux, "has-session", "-t", "t"], capture_output=True).returncode != 0, 20,
             "the app did not quit")
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True)


async def test_an_image_for_a_text_model_is_refused_and_stays_attached(daemon, pics, tmp_path):
    from test_tui import ready, type_and_send, wait_for

    app = ChatApp(model="text", base_url=daemon.url, store=ChatStore(tmp_path / "chats"))
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot, "text:latest")
        await type_and_send(pilot, f"/image {pics}/red.png")
        await wait_for(pilot, lambda: len(app.pending) == 1, 10, "the attachment")
        warnings = [n.text for n in app.query(Notice) if n.kind == "warning"]
        assert any("text:latest has no vision projector" in w for w in warnings), warnings
        await type_and_send(pilot, "describe")
        await wait_for(pilot, lambda: app.last_error is not None and app.idle, 60, "the daemon's refusal")
        assert "cannot take images: it has no vision projector" in app.last_error, app.last_error
        # nothing lost: the question is back in the input box, the image still attached, nothing stored
        assert app.input_box.text == "describe" and [a.data for a in app.pending] == [RED]
        assert app.conv.messages == [] and not [v for v in app.query(MessageView) if v.role == "assistant"]
        assert daemon.http.get("/api/tags").status_code == 200
