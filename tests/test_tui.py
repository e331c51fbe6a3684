"""The chat TUI driven by Textual's Pilot against the REAL daemon (a subprocess on a free
127.0.0.1 port, its own LOCALRUN_HOME) and the real SmolLM2 GGUF.

Screenshots: TUI_SCREENSHOT_DIR=docs/screenshots python -m pytest tests/test_tui.py -k screenshots
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from localrun.tui.app import ChatApp
from localrun.tui.reporting import describe_processor, final_stats
from localrun.tui.commands import CommandError, parse_command
from localrun.tui.store import ChatStore, Conversation
from localrun.tui.widgets import ChatList, MessageView, ModelPicker, Notice, PullBar, SettingsPanel

MODEL = "smollm2:135m"
SECOND = "pirate:latest"
SIZE = (80, 24)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    """`python -m localrun serve` on a free port; yields its base URL and home."""
    home = tmp_path_factory.mktemp("tui-home")
    port = _free_port()
    env = dict(os.environ, LOCALRUN_HOME=str(home), LOCALRUN_HOST=f"127.0.0.1:{port}",
               LOCALRUN_KEEP_ALIVE="10m", LOCALRUN_BACKEND="llamacpp")
    env.pop("NO_COLOR", None)
    log = open(home / "daemon.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "localrun", "serve"], env=env, stdout=log,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while True:
        try:
            if httpx.get(url + "/api/version", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("daemon did not start:\n" + (home / "daemon.log").read_text(errors="replace")[-3000:])
        time.sleep(0.2)
    try:
        yield {"url": url, "home": home}
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def _ndjson(resp: httpx.Response) -> list[dict]:
    events = [json.loads(line) for line in resp.iter_lines() if line.strip()]
    assert not any("error" in e for e in events), events
    return events


@pytest.fixture(scope="module")
def models(daemon):
    """smollm2:135m pulled (offline fallback) and a second model made from it by a Modelfile."""
    url = daemon["url"]
    with httpx.Client(base_url=url, timeout=300) as c:
        with c.stream("POST", "/api/pull", json={"model": MODEL}) as r:
            assert r.status_code == 200
            _ndjson(r)
        modelfile = f"FROM {MODEL}\nSYSTEM You are a pirate. Always answer like a pirate.\nPARAMETER temperature 0.7\n"
        with c.stream("POST", "/api/create", json={"model": SECOND, "modelfile": modelfile}) as r:
            assert r.status_code == 200, r.read()
            _ndjson(r)
        names = {m["name"] for m in c.get("/api/tags").json()["models"]}
    assert {MODEL, SECOND} <= names
    return daemon


@pytest.fixture
def store(tmp_path) -> ChatStore:
    return ChatStore(tmp_path / "chats")


async def wait_for(pilot, cond, timeout: float = 60.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await pilot.pause(0.05)


async def type_and_send(pilot, text: str) -> None:
    app = pilot.app
    app.input_box.focus()
    app.input_box.text = text
    await pilot.press("enter")
    await pilot.pause()


async def ready(pilot, model: str = MODEL) -> None:
    app = pilot.app
    await wait_for(pilot, lambda: app.conv.model == model and not app.pulling, 60, "the model to be chosen")


def replies(app) -> list[MessageView]:
    return [v for v in app.query(MessageView) if v.role == "assistant"]


async def reply_done(pilot) -> None:
    await wait_for(pilot, lambda: pilot.app.idle, 300, "the reply to finish")
    await pilot.pause(0.2)


# ---------------------------------------------------------------------------------- no daemon needed


def test_parse_commands():
    assert parse_command("/set temperature 0.2").value == 0.2
    assert parse_command("/set parameter num_ctx 4096") == parse_command("/set num_ctx 4096")
    assert parse_command("/set max_tokens 5").key == "num_predict"
    assert parse_command("/set system You are terse.").value == "You are terse."
    assert parse_command("/model smollm2:135m").value == "smollm2:135m"
    assert parse_command("/unset seed").key == "seed"
    assert parse_command("/bye").name == "bye"
    assert parse_command("/save my-chat").value == "my-chat"
    assert [parse_command(c).value for c in ("/set think", "/set think off", "/set think high", "/set nothink")] == [
        True, False, "high", False]
    assert parse_command("/unset think") == parse_command("/unset think").__class__("unset", "think")
    for bad in ("/set temperature hot", "/set top_p 1.5", "/set num_ctx 4", "/set nope 1", "/frobnicate",
                "/set num_predict 0", "/set seed 1.5", "/model a b", "/set system", "/set think maybe", "/save",
                "/save a b"):
        with pytest.raises(CommandError):
            parse_command(bad)


def test_store_roundtrip_and_damaged_files(store):
    conv = Conversation(model=MODEL, system="be brief", options={"temperature": 0.1}, think="low",
                        messages=[{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "hi"}])
    store.save(conv)
    (store.root / "broken.json").write_text("{not json")
    (store.root / "other.json").write_text(json.dumps({"messages": "nope"}))
    listed = store.list()
    assert [c.id for c in listed] == [conv.id]
    back = store.load(conv.id)
    assert back.messages == conv.messages and back.options == conv.options and back.system == "be brief"
    assert back.think == "low"
    assert back.display_title() == "hello there"
    with pytest.raises(ValueError):
        store.path("../etc/passwd")


def test_status_helpers():
    assert describe_processor({"backend": "llama.cpp", "device": "CPU"}) == "llama.cpp CPU"
    assert describe_processor({"backend": "native", "device": "CUDA"}) == "CUDA native"
    final = {"done": True, "prompt_eval_count": 20, "eval_count": 10, "eval_duration": 500_000_000}
    s = final_stats(final, 0.1, 1.0, 30)
    assert s["completion"] == 10 and s["prompt"] == 20 and abs(s["tps"] - 20.0) < 1e-9


def _colourful(svg: str) -> int:
    """How many distinct non-grey colours an SVG screenshot uses."""
    import re

    cols = {c.lower() for c in re.findall(r"#([0-9a-fA-F]{6})\b", svg)} - {"ff5f57", "febc2e", "28c840"}  # window dots
    return sum(1 for c in cols if max(int(c[i:i + 2], 16) for i in (0, 2, 4)) - min(int(c[i:i + 2], 16) for i in (0, 2, 4)) > 8)


async def test_no_color(monkeypatch, store):
    url = f"http://127.0.0.1:{_free_port()}"
    shots = {}
    for no_color in (False, True):
        if no_color:
            monkeypatch.setenv("NO_COLOR", "1")
        else:
            monkeypatch.delenv("NO_COLOR", raising=False)
        app = ChatApp(model=MODEL, base_url=url, store=store)
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: app.last_error is not None, 20, "the error message")
            assert app.no_color == no_color
            shots[no_color] = app.export_screenshot()
    assert _colourful(shots[False]) > 0 and _colourful(shots[True]) == 0


async def test_daemon_down_shows_message_and_keeps_running(store, tmp_path):
    url = f"http://127.0.0.1:{_free_port()}"  # nothing listens here
    app = ChatApp(model=MODEL, base_url=url, store=store)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.last_error is not None, 20, "the error message")
        assert "cannot reach the localrun daemon" in app.last_error and url in app.last_error
        app.last_error = None
        await type_and_send(pilot, "hello?")
        await wait_for(pilot, lambda: app.last_error is not None and app.idle, 20, "the send error")
        assert "localrun serve" in app.last_error
        # nothing was lost: the message is back in the input box, no reply, nothing half-stored
        assert app.input_box.text == "hello?"
        assert app.conv.messages == [] and not replies(app)
        errors = [n for n in app.query(Notice) if n.kind == "error"]
        assert len(errors) >= 2
        await type_and_send(pilot, "/help")
        assert any(v.label == "Help" for v in app.query(MessageView))
        assert app.is_running
        app.save_screenshot("daemon_down.svg", path=str(tmp_path))


async def test_thinking_is_shown_folded_and_kept_out_of_the_answer(store, tmp_path):
    """A model that thinks (a fake backend behind the real app): the reasoning goes into a folded
    section above the answer, the answer alone into the conversation's content."""
    from fakes import FakeModel, InProcessDaemon

    from localrun.library import Library
    from localrun.tui.widgets import Collapsible

    template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                "<|im_start|>assistant\n<think>\n")  # the template opens the think block itself
    home = tmp_path / "home"
    lib = Library(home / "models")
    lib.pull(MODEL)
    lib.create("thinker", f'FROM {MODEL}\nTEMPLATE """{template}"""\n')
    d = InProcessDaemon(home, FakeModel(rules={"riddle": "Two and two make four.</think>\n\nFour."}))
    try:
        app = ChatApp(model="thinker:latest", base_url=d.url, store=store)
        async with app.run_test(size=SIZE) as pilot:
            await ready(pilot, "thinker:latest")
            await type_and_send(pilot, "A riddle: 2+2?")
            await reply_done(pilot)
            view = replies(app)[-1]
            assert view.content == "Four." and view.thinking == "Two and two make four."
            fold = view.query_one(".thinking", Collapsible)
            assert fold.collapsed and "Thinking (5 words)" in str(fold.title)
            assert app.conv.messages[-1] == {"role": "assistant", "content": "Four.",
                                             "thinking": "Two and two make four."}
            # resumed later, the fold is still there
            loaded = store.load(app.conv.id)
            assert loaded.messages[-1]["thinking"] == "Two and two make four."
    finally:
        d.stop()


async def test_thinking_turned_off_and_on(store, tmp_path):
    """/set nothink asks the model not to think (the template closes the block in the prompt) and
    /unset think leaves it to the template again; `localrun run MODEL --think=false` opens the app
    that way (ChatApp's think). The real app and library, a fake backend."""
    from fakes import FakeModel, InProcessDaemon, api_rules, library_home

    home = library_home(tmp_path / "home")
    fake = FakeModel(rules=api_rules())
    d = InProcessDaemon(home, fake)
    try:
        app = ChatApp(model="thinker:latest", base_url=d.url, store=store)
        async with app.run_test(size=SIZE) as pilot:
            await ready(pilot, "thinker:latest")
            await type_and_send(pilot, "/set nothink")
            await type_and_send(pilot, "A puzzle: 2+2?")
            await reply_done(pilot)
            assert "<think>\n\n</think>" in fake.requests[-1].prompt
            assert replies(app)[-1].content == "Four." and not replies(app)[-1].thinking
            await type_and_send(pilot, "/unset think")
            await type_and_send(pilot, "Another puzzle: 3+3?")
            await reply_done(pilot)
            assert "</think>" not in fake.requests[-1].prompt.split("Another puzzle")[-1]
            assert replies(app)[-1].thinking == "Two and two."
        app = ChatApp(model="thinker:latest", base_url=d.url, store=store, think=False)
        async with app.run_test(size=SIZE) as pilot:
            await ready(pilot, "thinker:latest")
            await type_and_send(pilot, "A puzzle: 2+2?")
            await reply_done(pilot)
            assert "<think>\n\n</think>" in fake.requests[-1].prompt and not replies(app)[-1].thinking
    finally:
        d.stop()


# ---------------------------------------------------------------------------------- real daemon


async def test_pull_from_picker_with_progress(daemon, store):
    url = daemon["url"]
    httpx.request("DELETE", url + "/api/delete", json={"model": MODEL}, timeout=60)  # make sure it is not pulled
    app = ChatApp(base_url=url, store=store)
    seen: list[dict] = []
    orig = PullBar.show_event

    def spy(self, name, event):
        seen.append(dict(event))
        orig(self, name, event)

    PullBar.show_event = spy
    try:
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: isinstance(app.screen, ModelPicker), 30, "the model picker")
            app.screen.query_one("#picker-input").value = MODEL
            app.screen.query_one("#picker-input").focus()
            await pilot.press("enter")
            await wait_for(pilot, lambda: app.pulling or app.conv.model == MODEL, 30, "the pull to start")
            await ready(pilot)
            assert app.last_error is None
    finally:
        PullBar.show_event = orig
    assert seen and seen[-1]["status"] == "success"
    assert any(e.get("total") for e in seen), seen  # the bar had a size to show
    assert MODEL in {m["name"] for m in httpx.get(url + "/api/tags").json()["models"]}


async def test_send_streams_markdown_reply_and_saves(models, store, tmp_path):
    app = ChatApp(model=MODEL, base_url=models["url"], store=store)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await type_and_send(pilot, "/set num_predict 24")
        assert app.conv.options == {"num_predict": 24}
        writes: list[str] = []
        await type_and_send(pilot, "Write a haiku about the sea.")
        assert app.generating
        view = None
        while app.generating:  # watch the reply grow while tokens arrive
            rs = replies(app)
            if rs:
                view = rs[-1]
                src = view.body.source
                if src and (not writes or src != writes[-1]):
                    writes.append(src)
            await pilot.pause(0.02)
        await reply_done(pilot)
        assert app.last_error is None
        assert len(writes) >= 2 and app.reply_chunks >= 2, writes  # shown piece by piece, not all at once
        assert [m["role"] for m in app.conv.messages] == ["user", "assistant"]
        reply = app.conv.messages[-1]["content"]
        assert reply.strip() and view.body.source == reply
        stats = app.status.stats
        assert 0 < stats["completion"] <= 24 and stats["prompt"] > 0 and stats["tps"] > 0 and stats["ttft"] > 0
        text = app.status.text()
        assert MODEL in text and "tok/s" in text and "TTFT" in text and "completion" in text
        assert "llama.cpp" in text and "CPU" in text  # backend + device from /api/ps
        saved = store.load(app.conv.id)
        assert saved.messages == app.conv.messages and saved.model == MODEL
        # copy the last reply
        await pilot.press("f3")
        assert app.clipboard == reply
        app.save_screenshot("chat.svg", path=str(tmp_path))


async def test_stop_mid_reply_with_escape_and_ctrl_c(models, store):
    app = ChatApp(model=MODEL, base_url=models["url"], store=store)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await type_and_send(pilot, "/set num_predict 400")
        await type_and_send(pilot, "/set temperature 0")  # greedy: a long answer every time, no early stop
        for key in ("escape", "ctrl+c"):
            await type_and_send(pilot, "/new")  # same fresh prompt each round (greedy: same long answer)
            n_before = len(app.conv.messages)
            # (greedy, SmolLM2 writes all 400 tokens of this essay: ~3 s on a fast CPU. "Count from 1 to 200"
            # stops by itself after 121 tokens, which a CPU left to llama.cpp alone finishes before the key)
            # sent without waiting on the pilot, and polled with plain sleeps: pilot.press and pilot.pause
            # wait for the screen to settle, which the stream they start keeps from happening until its end
            # (measured: 356-371 of the 400 chunks were in before they returned)
            app.input_box.focus()
            app.input_box.text = "Write a long essay about the history of tea."
            sending = asyncio.create_task(pilot.press("enter"))
            deadline = time.monotonic() + 60
            while not (app.generating and app.reply_chunks > 0):
                assert time.monotonic() < deadline, "timed out waiting for the first tokens"
                await asyncio.sleep(0.01)
            n_press = app.reply_chunks
            t = time.monotonic()
            await pilot.press(key)
            await sending
            await wait_for(pilot, lambda: not app.generating, 10, "the stop")
            stop_latency = time.monotonic() - t
            await wait_for(pilot, lambda: app.idle, 60, "the reply to be wrapped up")
            assert stop_latency < 5, stop_latency
            assert app.reply_chunks < 400, (n_press, app.reply_chunks)  # stopped mid-reply, not at its end
            assert app.status.stats.get("completion") is None  # no final chunk: it really was cut short
            assert app.is_running and app.last_error is None
            assert len(app.conv.messages) == n_before + 2  # partial reply kept
            assert app.status.state == "stopped"
            assert any(str(lbl.render()) == "(stopped)" for lbl in replies(app)[-1].query(".note"))
            # the daemon aborted the request: the model answers the next one straight away
        r = httpx.post(models["url"] + "/api/chat", timeout=60, json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": False,
            "options": {"num_predict": 2}})
        assert r.status_code == 200


async def test_stop_before_the_reply_task_runs(models, store):
    """Esc between Enter and the reply task's first step (a fast typist, a busy machine). asyncio drops
    a task cancelled that early without running any of it, which left the app "generating" for ever
    (and made the test above fail in CI when its second round's key came that early)."""
    app = ChatApp(model=MODEL, base_url=models["url"], store=store)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        question = "Write a long essay about the history of tea."
        await app.send(question)  # what Enter does; the reply's task is created, not yet run
        app.action_stop()  # no await in between: the stop lands before that task's first step
        await wait_for(pilot, lambda: app.idle, 10, "the stop")
        assert app.conv.messages == [] and app.input_box.text == question  # the question is back
        assert app.status.state == "stopped" and app.last_error is None
        assert not replies(app)
        await type_and_send(pilot, "/set num_predict 3")
        await type_and_send(pilot, question)  # and the next send answers
        await reply_done(pilot)
        assert [m["role"] for m in app.conv.messages] == ["user", "assistant"]


async def test_switch_model_and_change_parameters(models, store):
    app = ChatApp(model=MODEL, base_url=models["url"], store=store)
    async with app.run_test(size=(120, 30)) as pilot:
        await ready(pilot)
        await type_and_send(pilot, "/set num_predict 3")
        await type_and_send(pilot, "Tell me a long story about ships.")
        await reply_done(pilot)
        assert app.status.stats["completion"] <= 3
        # switch model with /model
        await type_and_send(pilot, f"/model {SECOND}")
        await ready(pilot, SECOND)
        # change parameters in the side panel (shown at 120 columns)
        panel = app.query_one(SettingsPanel)
        assert panel.display
        assert panel.query_one("#set-num_predict").value == "3"  # the /set shows up in the panel
        panel.query_one("#set-num_predict").value = "5"
        panel.query_one("#set-temperature").value = "0"
        await pilot.pause()
        assert app.conv.options == {"num_predict": 5, "temperature": 0.0}
        await type_and_send(pilot, "/set system You are a terse pirate.")
        assert app.conv.system == "You are a terse pirate."
        assert panel.query_one("#set-system").text == "You are a terse pirate."
        panel.query_one("#set-top_p").value = "2"  # invalid: flagged, not applied
        await pilot.pause()
        assert "top_p" not in app.conv.options and panel.query_one("#set-top_p").has_class("-invalid")
        await type_and_send(pilot, "Who are you? Answer at length.")
        await reply_done(pilot)
        assert app.last_error is None
        assert 0 < app.status.stats["completion"] <= 5
        assert replies(app)[-1].label == SECOND
        assert store.load(app.conv.id).system == "You are a terse pirate."
        running = {m.get("name") or m.get("model") for m in httpx.get(models["url"] + "/api/ps").json()["models"]}
        assert SECOND in running
        # the Ctrl+O picker lists both models and picking one switches back
        await pilot.press("ctrl+o")
        await wait_for(pilot, lambda: isinstance(app.screen, ModelPicker), 10, "the picker")
        ids = [app.screen.query_one("#picker-list").get_option_at_index(i).id
               for i in range(app.screen.query_one("#picker-list").option_count)]
        assert MODEL in ids and SECOND in ids
        ol = app.screen.query_one("#picker-list")
        ol.highlighted = ids.index(MODEL)
        ol.focus()
        await pilot.press("enter")
        await ready(pilot)
        # an unknown model: a clear message, the current model stays
        app.last_error = None
        await type_and_send(pilot, "/model no-such-model:7b")
        await wait_for(pilot, lambda: app.last_error is not None, 30, "the error")
        assert "no-such-model" in app.last_error
        assert app.conv.model == MODEL and app.is_running


async def test_a_model_named_as_the_daemon_resolves_it_is_not_pulled_again(models, store):
    """`localrun chat smollm2` / `/model smollm2`: the daemon resolves smollm2 to the library's smollm2:135m (its
    catalog alias), as `run`, `show` and `rm` do; the TUI must not pull a second copy as smollm2:latest, and it
    names the model as the daemon does (the status bar, /api/ps, the replies)."""
    url = models["url"]
    pulls: list[str] = []
    app = ChatApp(model="smollm2", base_url=url, store=store)
    orig = app.pull_model
    app.pull_model = lambda name: (pulls.append(name), orig(name))[1]
    async with app.run_test(size=SIZE) as pilot:
        # (the chat starts with the name as given; the daemon's answer names the model)
        await wait_for(pilot, lambda: app.conv.model != "smollm2" or app.last_error is not None or bool(pulls), 30,
                       "the model to be chosen")
        assert not pulls and app.last_error is None
        assert app.conv.model == MODEL
        await type_and_send(pilot, "/model pirate")
        await wait_for(pilot, lambda: app.conv.model != MODEL or app.last_error is not None or bool(pulls), 30,
                       "the switch")
        assert app.conv.model == SECOND
        await type_and_send(pilot, "/model SMOLLM2:135m")
        await wait_for(pilot, lambda: app.conv.model != SECOND or app.last_error is not None or bool(pulls), 30,
                       "the switch back")
        assert app.conv.model == MODEL and not pulls and app.last_error is None
    names = {m["name"] for m in httpx.get(url + "/api/tags").json()["models"]}
    assert "smollm2:latest" not in names and MODEL in names


async def test_resume_saved_conversation(models, store):
    url = models["url"]
    app = ChatApp(model=MODEL, base_url=url, store=store)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await type_and_send(pilot, "/set num_predict 8")
        await type_and_send(pilot, "My name is Ada. Remember it.")
        await reply_done(pilot)
        first_id = app.conv.id
        first_prompt = app.status.stats["prompt"]
        await pilot.press("ctrl+n")  # new conversation; the old one stays saved
        await pilot.pause()
        assert app.conv.id != first_id and app.conv.messages == []
        assert app.conv.options == {"num_predict": 8}
    app2 = ChatApp(model=MODEL, base_url=url, store=store)
    async with app2.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: isinstance(app2.screen, ChatList), 10, "the chat list")
        ol = app2.screen.query_one("#chat-list")
        ids = [ol.get_option_at_index(i).id for i in range(ol.option_count)]
        assert first_id in ids
        ol.highlighted = ids.index(first_id)
        ol.focus()
        await pilot.press("enter")
        await wait_for(pilot, lambda: app2.conv.id == first_id, 10, "the resume")
        assert len(replies(app2)) == 1 and app2.conv.options == {"num_predict": 8}
        await type_and_send(pilot, "What is my name?")
        await reply_done(pilot)
        assert app2.last_error is None and len(app2.conv.messages) == 4
        assert app2.status.stats["prompt"] > first_prompt  # the history went with the request
        assert len(store.load(first_id).messages) == 4
        await type_and_send(pilot, "/clear")
        await pilot.pause()
        assert app2.conv.messages == [] and first_id not in {c.id for c in store.list()}


def _broken_gguf(path: Path) -> Path:
    """A GGUF with a valid header whose tensors are missing: the library accepts it, llama.cpp cannot load it."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(2)
    w.add_context_length(256)
    w.add_embedding_length(64)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_feed_forward_length(128)
    w.add_tensor("token_embd.weight", np.zeros((16, 64), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


async def test_load_failure_and_request_errors_are_reported(models, store, tmp_path):
    url = models["url"]
    gguf_path = _broken_gguf(tmp_path / "broken.gguf")
    with httpx.stream("POST", url + "/api/create", timeout=60,
                      json={"model": "broken:latest", "modelfile": f"FROM {gguf_path}\n"}) as r:
        assert r.status_code == 200
        _ndjson(r)
    app = ChatApp(model="broken:latest", base_url=url, store=store)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot, "broken:latest")
        await type_and_send(pilot, "hello")
        await wait_for(pilot, lambda: app.idle and app.last_error is not None, 60, "the load error")
        assert "failed to load" in app.last_error and "broken" in app.last_error
        assert app.is_running and app.conv.messages == [] and app.input_box.text == "hello"
        # a request the daemon rejects (400): said plainly, nothing lost
        await type_and_send(pilot, "/model smollm2:135m")
        await ready(pilot)
        app.last_error = None
        await type_and_send(pilot, "/set num_ctx 100000000")
        app.input_box.text = "hello"
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.idle and app.last_error is not None, 60, "the request error")
        assert "num_ctx" in app.last_error and app.input_box.text == "hello"
        await type_and_send(pilot, "/unset num_ctx")
        await type_and_send(pilot, "/set num_predict 2")
        app.last_error = None
        await type_and_send(pilot, "hello")
        await reply_done(pilot)
        assert app.last_error is None and len(app.conv.messages) == 2


async def test_screenshots(models, store, tmp_path):
    """SVGs of the main screens; TUI_SCREENSHOT_DIR=docs/screenshots writes them for the README."""
    out = Path(os.environ.get("TUI_SCREENSHOT_DIR") or tmp_path)
    out.mkdir(parents=True, exist_ok=True)
    app = ChatApp(model=MODEL, base_url=models["url"], store=store)
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot)
        await type_and_send(pilot, "/set num_predict 48")
        await type_and_send(pilot, "/set temperature 0")
        await type_and_send(pilot, "Show a Python function that adds two numbers, in a code block.")
        await reply_done(pilot)
        app.save_screenshot("chat.svg", path=str(out))
        await pilot.press("ctrl+o")
        await wait_for(pilot, lambda: isinstance(app.screen, ModelPicker), 10, "the picker")
        await pilot.pause(0.2)
        app.save_screenshot("model_picker.svg", path=str(out))
        await pilot.press("escape")
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: isinstance(app.screen, ChatList), 10, "the chat list")
        await pilot.pause(0.2)
        app.save_screenshot("saved_chats.svg", path=str(out))
        await pilot.press("escape")
    small = ChatApp(model=MODEL, base_url=models["url"], store=store)
    async with small.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await type_and_send(pilot, "/set num_predict 40")
        await type_and_send(pilot, "Give me three tips for writing clear **Markdown**, as a list.")
        await reply_done(pilot)
        small.save_screenshot("chat_80x24.svg", path=str(out))
        await type_and_send(pilot, "/help")
        await pilot.pause(0.3)
        small.log_view.scroll_to_widget(small.query(MessageView).last(), top=True, animate=False)
        await pilot.pause(0.2)
        small.save_screenshot("help_80x24.svg", path=str(out))
    for name in ("chat.svg", "model_picker.svg", "saved_chats.svg", "chat_80x24.svg", "help_80x24.svg"):
        svg = (out / name).read_text()
        assert svg.startswith("<svg") and MODEL in svg.replace("&#160;", " ")


@pytest.mark.skipif(sys.platform == "win32", reason="needs a POSIX pty")
def test_localrun_chat_in_a_real_terminal(models):
    """`localrun chat MODEL` in a pseudo-terminal at 80x24: the real key bytes a terminal sends
    (Enter = CR sends, Ctrl+J = LF inserts a newline, Ctrl+Q quits) drive the real app."""
    import fcntl
    import pty
    import struct
    import termios
    import threading

    home, port = models["home"], models["url"].rsplit(":", 1)[1]
    chats = home / "chats"
    before = set(chats.glob("*.json")) if chats.is_dir() else set()
    env = dict(os.environ, LOCALRUN_HOME=str(home), LOCALRUN_HOST=f"127.0.0.1:{port}", TERM="xterm-256color")
    env.pop("NO_COLOR", None)
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    proc = subprocess.Popen([sys.executable, "-m", "localrun", "chat", MODEL], stdin=slave, stdout=slave,
                            stderr=slave, env=env, start_new_session=True)
    os.close(slave)
    screen = bytearray()

    def drain():
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:
                return
            if not data:
                return
            screen.extend(data)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()

    def new_chats() -> list[Path]:
        return [p for p in chats.glob("*.json") if p not in before] if chats.is_dir() else []

    def wait(cond, timeout, what):
        deadline = time.monotonic() + timeout
        while not cond():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"{what}: rc={proc.poll()} screen tail={bytes(screen[-2000:])!r}")
            time.sleep(0.1)

    try:
        wait(lambda: b"Send" in screen and MODEL.encode() in screen, 60, "the app did not draw")
        time.sleep(1.0)
        os.write(master, b"/set num_predict 4\r")
        time.sleep(0.5)
        os.write(master, b"line one\nline two\r")

        def replied() -> bool:
            for p in new_chats():
                msgs = json.loads(p.read_text())["messages"]
                if len(msgs) == 2:
                    return True
            return False

        wait(replied, 120, "no reply was saved")
        msgs = json.loads(new_chats()[0].read_text())["messages"]
        assert msgs[0] == {"role": "user", "content": "line one\nline two"}
        assert msgs[1]["role"] == "assistant" and msgs[1]["content"]
        time.sleep(0.5)
        os.write(master, b"\x11")  # Ctrl+Q
        assert proc.wait(20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        os.close(master)


async def test_save_makes_a_model_of_the_chat(models, store):
    """/save NAME (Ollama's): a new model from this chat's model with its system prompt, parameters and
    messages, which the daemon then serves with that history."""
    from localrun.tui.widgets import Notice

    app = ChatApp(model=MODEL, base_url=models["url"], store=store)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await type_and_send(pilot, "/set num_predict 4")
        await type_and_send(pilot, "/set system You are terse.")
        await type_and_send(pilot, "Name a fruit.")
        await reply_done(pilot)
        await type_and_send(pilot, "/save tui-saved")
        await wait_for(pilot, lambda: any("saved as tui-saved" in n.text for n in app.query(Notice)), 30,
                       "the save")
        assert app.last_error is None
        await type_and_send(pilot, "/save bad..name")
        await wait_for(pilot, lambda: app.last_error is not None, 30, "the refusal")
        assert "could not save bad..name" in app.last_error
    try:
        info = httpx.post(models["url"] + "/api/show", json={"model": "tui-saved"}).json()
        assert info["system"] == "You are terse." and "num_predict" in info["parameters"]
        assert [(m["role"], m["content"]) for m in info["messages"]] == [
            (m["role"], m["content"]) for m in app.conv.messages]
    finally:
        httpx.request("DELETE", models["url"] + "/api/delete", json={"model": "tui-saved"})


async def test_an_embedding_model_is_said_to_be_one_when_chosen(models, store, xlmr_ggufs):
    """Choosing an embedding model says at once that it cannot chat, and where to use it; a message sent anyway gets
    the daemon's 400 (it is refused before the model loads), and the app goes on."""
    url = models["url"]
    r = httpx.post(url + "/api/create", json={"model": "tui-embed", "modelfile": f"FROM {xlmr_ggufs[0]}\n",
                                              "stream": False}, timeout=120)
    assert r.status_code == 200, r.text
    app = ChatApp(model=MODEL, base_url=url, store=store)
    async with app.run_test(size=(120, 30)) as pilot:
        await ready(pilot)
        await type_and_send(pilot, "/model tui-embed:latest")
        await ready(pilot, "tui-embed:latest")
        warn = lambda: [n.text for n in app.query(Notice) if n.kind == "warning"]  # noqa: E731
        await wait_for(pilot, lambda: any("is an embedding model: it cannot chat" in t for t in warn()), 10, "the note")
        assert any("/api/embed" in t for t in warn())
        await type_and_send(pilot, "hello")
        await wait_for(pilot, lambda: app.last_error is not None, 30, "the error")
        assert "does not support chat" in app.last_error and app.is_running
