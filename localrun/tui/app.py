"""The localrun chat app (Textual), a client of the daemon's HTTP API only."""

from __future__ import annotations

import asyncio
import time

from textual import on, work
from textual.actions import SkipAction
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Footer, Markdown
from textual.worker import Worker, WorkerState

from localrun.attachments import MAX_ATTACHMENTS, Attachment, AttachmentError, is_image_path, read_image
from localrun.client import APIError, AsyncDaemonClient, DaemonUnavailable
from localrun.tui.commands import HELP, PARAMS, CommandError, parse_command
from localrun.tui.store import ChatStore, Conversation
from localrun.tui.widgets import (
    ChatInput,
    ChatList,
    MessageView,
    ModelPicker,
    Notice,
    PullBar,
    SettingsPanel,
    StatusBar,
)

WIDE = 100  # from this width on, the settings panel is shown at start


def describe_processor(entry: dict | None) -> str:
    """An /api/ps entry -> 'llama.cpp CPU', 'CUDA native', ... (as honest as the daemon is)."""
    if not entry:
        return ""
    backend = entry.get("backend")
    device = entry.get("device")
    if isinstance(backend, dict):
        device = device or backend.get("device")
        backend = backend.get("name")
    if backend and device:
        return "CUDA native" if backend == "native" and str(device).upper().startswith("CUDA") else f"{backend} {device}"
    if backend:
        return str(backend)
    if entry.get("processor"):
        return str(entry["processor"])
    return "GPU" if entry.get("size_vram") else "CPU"


def final_stats(final: dict | None, ttft: float | None, wall: float, completion_chars: int) -> dict:
    """Stats of the last reply from the final chunk (Ollama's fields), TTFT measured here."""
    stats: dict = {"ttft": ttft}
    if not final:
        return stats
    prompt = final.get("prompt_eval_count")
    completion = final.get("eval_count")
    cached = final.get("cached_tokens")  # prompt tokens served from the daemon's prefix cache
    eval_ns = final.get("eval_duration")
    if completion is not None:
        stats.update(prompt=prompt or 0, cached=cached or 0, completion=completion)
        if eval_ns:
            stats["tps"] = completion / (eval_ns / 1e9)
        elif ttft is not None and wall > ttft and completion > 1:
            stats["tps"] = (completion - 1) / (wall - ttft)
    return stats


def explain_error(exc: BaseException, model: str | None) -> str:
    if isinstance(exc, DaemonUnavailable):
        return exc.message + " — then send your message again."
    if isinstance(exc, APIError):
        msg = exc.message
        if exc.status == 404:
            return f"{msg} — /model NAME pulls a model, Ctrl+O lists the library."
        if exc.status == 503:
            return f"the daemon is busy ({msg}) — try again in a moment."
        if exc.status == 507:
            return f"{model or 'the model'} does not fit in memory: {msg} — try a smaller model or /set num_ctx lower."
        if exc.status >= 500:
            return f"{model or 'the model'} failed: {msg}"
        return msg
    return f"unexpected error: {type(exc).__name__}: {exc}"


class ChatApp(App[int]):
    """`localrun chat`: stream replies from the daemon as Markdown."""

    CSS_PATH = "chat.tcss"
    TITLE = "localrun chat"
    ENABLE_COMMAND_PALETTE = False  # slash commands and the footer cover it; saves footer room at 80 columns
    BINDINGS = [
        Binding("escape", "stop", "Stop", priority=True),
        Binding("ctrl+c", "stop", "Stop", show=False, priority=True),
        Binding("ctrl+n", "new", "New"),
        Binding("ctrl+l", "clear", "Clear"),
        Binding("ctrl+o", "pick_model", "Model"),
        Binding("ctrl+r", "chats", "Chats"),
        Binding("f3", "copy_last", "Copy"),
        Binding("f2", "toggle_settings", "Settings"),
        Binding("f1", "help", "Help"),
        Binding("ctrl+q", "quit", "Quit"),
    ]
    # Footer order: Send (from the input box) first, then these; Quit stays visible at 80 columns.

    def __init__(self, model: str | None = None, base_url: str | None = None, store: ChatStore | None = None,
                 options: dict | None = None, think: bool | str | None = None):
        super().__init__()
        self.client = AsyncDaemonClient(base_url=base_url)
        self.store = store or ChatStore()
        # `localrun run MODEL -o NAME=VALUE --think=...` opens the app with those settings
        self.conv = Conversation(model=model, options=dict(options or {}), think=think)
        self.requested_model = model
        self.generating = False
        self.pulling: str | None = None
        self.last_error: str | None = None  # the last error shown (tests and screenshots read it)
        self._gen_worker = None
        self._started = self._stop_early = False  # generate's task has run / a stop came before that
        self.reply_chunks = 0
        self._pull_worker = None
        self.pending: list[Attachment] = []  # images attached to the next message (/image, a dropped path)
        self.model_caps: list[str] | None = None  # the chosen model's capabilities (/api/show), when known

    # ------------------------------------------------------------------ layout
    def compose(self) -> ComposeResult:
        with Horizontal(id="main"):
            with Vertical(id="chat-column"):
                yield VerticalScroll(id="log")
                yield PullBar(id="pull")
                yield ChatInput(id="input")
            yield SettingsPanel(id="settings")
        yield StatusBar(id="status")
        yield Footer(compact=True)

    @property
    def idle(self) -> bool:
        """No reply streaming and the last one fully wrapped up (view, status, save)."""
        return not self.generating and (self._gen_worker is None or self._gen_worker.is_finished)

    @property
    def log_view(self) -> VerticalScroll:
        return self.query_one("#log", VerticalScroll)

    @property
    def status(self) -> StatusBar:
        return self.query_one(StatusBar)

    @property
    def input_box(self) -> ChatInput:
        return self.query_one(ChatInput)

    async def on_mount(self) -> None:
        self.query_one("#pull").display = False
        self.query_one(SettingsPanel).display = self.size.width >= WIDE
        self.query_one(SettingsPanel).show_values(self.conv.system, self.conv.options)
        self.log_view.anchor()
        self.status.set(model=self.conv.model)
        self.input_box.focus()
        await self.note("Enter sends · Ctrl+J newline · Esc stops a reply · F1 help · /help lists commands")
        self.startup()

    async def on_unmount(self) -> None:
        await self.client.aclose()

    async def note(self, text: str, kind: str = "info") -> Notice:
        if kind == "error":
            self.last_error = text
        n = Notice(text, kind)
        await self.log_view.mount(n)
        self.log_view.scroll_end(animate=False)
        return n

    # ------------------------------------------------------------------ startup / models
    @work(exclusive=True, group="startup", exit_on_error=False)
    async def startup(self) -> None:
        try:
            await self.client.version()
        except (DaemonUnavailable, APIError) as exc:
            await self.note(explain_error(exc, None), "error")
            return
        if self.requested_model:
            await self.use_model(self.requested_model)
        elif not self.conv.model:
            await self.open_picker()

    async def use_model(self, name: str) -> None:
        """Switch to `name`; pull it first when the library lacks it. The name goes to the daemon as typed (it
        resolves names: 'smollm2' is the library's smollm2:135m through its catalog alias), and the chat then
        names the model as the daemon does."""
        name = name.strip()
        try:
            info = await self.client.show(name)
        except APIError as exc:
            if exc.status != 404:
                await self.note(explain_error(exc, name), "error")
                return
            self.pull_model(name)
            return
        except DaemonUnavailable as exc:
            await self.note(explain_error(exc, name), "error")
            return
        await self.set_model(await self.daemon_name(name), info)

    async def daemon_name(self, name: str) -> str:
        """The library name the daemon resolves `name` to (as /api/ps and the replies name it); `name` itself
        when the daemon does not say."""
        try:
            return await self.client.resolve_name(name) or name
        except (DaemonUnavailable, APIError):
            return name

    async def set_model(self, name: str, info: dict | None = None) -> None:
        self.conv.model = name
        caps = (info or {}).get("capabilities")
        self.model_caps = list(caps) if isinstance(caps, list) else None
        self.status.set(model=name, processor="", stats={}, state="")
        d = (info or {}).get("details") or {}
        extra = " ".join(x for x in (d.get("parameter_size"), d.get("quantization_level")) if x)
        await self.note(f"model: {name}" + (f" ({extra})" if extra else ""))
        if self.model_caps is not None and "completion" not in self.model_caps:  # it would refuse the first message
            what, where = (("a reranker", "POST /v1/rerank") if "rerank" in self.model_caps
                           else ("an embedding model", "/api/embed or /v1/embeddings"))
            await self.note(f"{name} is {what}: it cannot chat (use it with {where}); pick another with /model",
                            "warning")
        self.save()
        await self.refresh_processor()

    async def refresh_processor(self) -> None:
        try:
            running = await self.client.ps()
        except (DaemonUnavailable, APIError):
            return
        model = self.conv.model
        entry = next((m for m in running if model in (m.get("name"), m.get("model"))), None)
        self.status.set(processor=describe_processor(entry) if entry else "not loaded")

    @work(exclusive=True, group="pull", exit_on_error=False)
    async def pull_model(self, name: str) -> None:
        bar = self.query_one(PullBar)
        bar.display = True
        self.pulling = name
        self.status.set(state=f"pulling {name}…")
        ok = False
        try:
            async for event in self.client.pull(name):
                bar.show_event(name, event)
                if event.get("status") == "success":
                    ok = True
        except asyncio.CancelledError:
            await self.note(f"pull of {name} cancelled", "warning")
            raise
        except (DaemonUnavailable, APIError) as exc:
            await self.note(f"could not pull {name}: {explain_error(exc, name)}", "error")
        finally:
            self.pulling = None
            bar.display = False
            self.status.set(state="")
        if ok:
            await self.use_model(name)

    async def open_picker(self) -> None:
        error = None
        try:
            models = await self.client.tags()
        except (DaemonUnavailable, APIError) as exc:
            models, error = [], explain_error(exc, None)
            await self.note(error, "error")
            return
        self.push_screen(ModelPicker(models, self.conv.model, error), self._picked_model)

    def _picked_model(self, name: str | None) -> None:
        if name:
            self.run_worker(self.use_model(name), group="model", exit_on_error=False)

    # ------------------------------------------------------------------ sending
    @on(ChatInput.Submitted)
    async def _submitted(self, event: ChatInput.Submitted) -> None:
        text = event.text.strip()
        dropped = is_image_path(text) if text and "\n" not in text else None
        if dropped is not None:  # a file dropped on the terminal (or a pasted path): attach it
            self.input_box.clear()
            await self.attach(dropped)
            return
        if text.startswith("/"):
            self.input_box.clear()
            await self.run_command(text)
            return
        if self.generating:
            self.notify("A reply is still streaming: press Esc to stop it first.", severity="warning")
            return
        if self.pulling:
            self.notify(f"Still pulling {self.pulling}: wait, or press Esc to cancel.", severity="warning")
            return
        if not self.conv.model:
            await self.note("no model chosen yet: pick one (Ctrl+O) or /model NAME", "error")
            return
        self.input_box.clear()
        await self.send(text)

    async def send(self, text: str) -> None:
        msg: dict = {"role": "user", "content": text}
        sent, labels = list(self.pending), [a.label() for a in self.pending]
        if sent:
            msg["images"] = [a.b64 for a in sent]
            msg["attachments"] = labels  # shown again on resume; not sent
            self.pending = []
        self.conv.messages.append(msg)
        view = MessageView("user", text, attachments=labels)
        view.sent = sent
        await self.log_view.mount(view)
        self.log_view.scroll_end(animate=False)
        self.generating = True
        self.reply_chunks = 0
        self._started, self._stop_early = False, False
        self.refresh_bindings()
        self._gen_worker = self.generate(view)

    @work(exclusive=True, group="generate", exit_on_error=False)
    async def generate(self, user_view: MessageView) -> None:
        self._started = True
        conv = self.conv  # /new, /clear or a resume may swap self.conv while this runs
        model = conv.model
        messages = ([{"role": "system", "content": conv.system}] if conv.system else []) + [
            {k: v for k, v in m.items() if k != "attachments"} for m in conv.messages]
        options = dict(conv.options) or None
        reply = MessageView("assistant", "", label=model)
        await self.log_view.mount(reply)
        self.log_view.scroll_end(animate=False)
        stream = None  # started with the first piece of content
        self.status.set(state="thinking…", stats={})
        text, final, ttft, error = "", None, None, None
        self.reply_chunks = 0  # content chunks of the reply being streamed
        t0 = time.monotonic()
        outcome = "done"
        try:
            if self._stop_early:
                raise asyncio.CancelledError  # stopped before this task's first step (see action_stop)
            async for chunk in self.client.chat(model, messages, options=options, think=conv.think):
                message = chunk.get("message") or {}
                thought = message.get("thinking") or ""
                if thought:
                    if ttft is None:
                        ttft = time.monotonic() - t0
                    await reply.add_thinking(thought)
                piece = message.get("content") or ""
                if piece:
                    if ttft is None:
                        ttft = time.monotonic() - t0
                        self.status.set(state="generating…")
                    text += piece
                    self.reply_chunks += 1
                    stream = stream or Markdown.get_stream(reply.body)
                    await stream.write(piece)
                if chunk.get("done"):
                    final = chunk
        except asyncio.CancelledError:
            outcome = "stopped"
        except Exception as exc:  # DaemonUnavailable, APIError, a broken stream: never fatal
            outcome, error = "error", explain_error(exc, model)
        finally:
            self.generating = False
            if stream is not None:
                await stream.stop()
        wall = time.monotonic() - t0
        if text:
            turn = {"role": "assistant", "content": text}
            if reply.thinking:  # kept for the screen; the daemon drops it from the prompt
                turn["thinking"] = reply.thinking
            conv.messages.append(turn)
        elif conv.messages and conv.messages[-1]["role"] == "user":
            conv.messages.pop()  # nothing came back: the question goes back to the input box
        self.save(conv)
        if conv is not self.conv or not self.is_running:
            return  # the view moved on; the reply is stored with its conversation
        self.refresh_bindings()
        if text:
            reply.content = text
            if outcome == "stopped":
                reply.set_note("(stopped)")
            elif final and final.get("done_reason") == "length":
                reply.set_note("(cut off at num_predict: /set num_predict N for longer replies)")
        else:
            await reply.remove()
            await user_view.remove()
            if not self.input_box.text.strip():
                self.input_box.text = user_view.content
            if user_view.sent and not self.pending:  # the images stay attached with the question
                self.pending = list(user_view.sent)
        if error:
            await self.note(error, "error")
        elif not text and outcome == "stopped":
            await self.note("stopped before the first token; your message is back in the input box", "warning")
        self.status.set(state="stopped" if outcome == "stopped" else "", stats=final_stats(final, ttft, wall, len(text)))
        await self.refresh_processor()

    def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        """A bug in a background task shows up as a message instead of ending the app."""
        if event.state == WorkerState.ERROR:
            self.generating = False
            self.notify(f"internal error: {event.worker.error!r}", severity="error", timeout=10)
            self.last_error = f"internal error: {event.worker.error!r}"

    def check_action(self, action: str, parameters: tuple) -> bool | None:
        if action == "stop":  # hidden (and passed on to Esc/Ctrl+C's usual job) when idle
            return bool(self.generating or self.pulling)
        return True

    def action_stop(self) -> None:
        if isinstance(self.screen, ModalScreen) or not (self.generating or self.pulling):
            raise SkipAction()  # let Esc / Ctrl+C do their usual job
        if self.generating and not self._started:
            # asyncio drops a task cancelled before its first step without running any of it (generate's
            # clean-up included), so the app would say "generating" for ever: generate stops itself instead
            self._stop_early = True
        elif self.generating:
            self.workers.cancel_group(self, "generate")
        elif self.pulling:
            self.workers.cancel_group(self, "pull")

    # ------------------------------------------------------------------ commands
    async def run_command(self, line: str) -> None:
        try:
            cmd = parse_command(line)
        except CommandError as exc:
            await self.note(str(exc), "error")
            return
        if cmd.name == "set":
            if cmd.key == "system":
                self.conv.system = cmd.value
                await self.note(f"system prompt set ({len(cmd.value)} characters)")
            elif cmd.key == "think":
                self.conv.think = cmd.value
                await self.note("thinking: " + {True: "on", False: "off"}.get(cmd.value, str(cmd.value)))
            else:
                self.conv.options[cmd.key] = cmd.value
                await self.note(f"{cmd.key} = {cmd.value}")
            self._settings_changed()
        elif cmd.name == "unset":
            if cmd.key == "system":
                self.conv.system = None
            elif cmd.key == "think":
                self.conv.think = None
            else:
                self.conv.options.pop(cmd.key, None)
            await self.note(f"{cmd.key} back to the model's default")
            self._settings_changed()
        elif cmd.name == "model":
            await self.use_model(str(cmd.value))
        elif cmd.name == "models":
            await self.action_pick_model()
        elif cmd.name == "clear":
            await self.action_clear()
        elif cmd.name == "new":
            await self.action_new()
        elif cmd.name == "chats":
            self.action_chats()
        elif cmd.name == "copy":
            await self.action_copy_last()
        elif cmd.name == "help":
            await self.action_help()
        elif cmd.name == "stop":
            if self.generating or self.pulling:
                self.action_stop()
        elif cmd.name == "bye":
            self.exit(0)
        elif cmd.name == "image":
            await self.attach(str(cmd.value))
        elif cmd.name == "save":
            await self.save_model(str(cmd.value))
        elif cmd.name == "detach":
            n, self.pending = len(self.pending), []
            await self.note(f"dropped {n} attached image(s)" if n else "no image is attached")

    async def save_model(self, name: str) -> None:
        """Ollama's /save: a new model from this chat's model with its system prompt, parameters and messages."""
        if not self.conv.model:
            await self.note("no model chosen yet: pick one (Ctrl+O) or /model NAME", "error")
            return
        try:
            async for _ in self.client.save_session(name, self.conv.model, system=self.conv.system,
                                                    parameters=self.conv.options, messages=self.conv.messages):
                pass
        except (DaemonUnavailable, APIError) as exc:
            await self.note(f"could not save {name}: {getattr(exc, 'message', str(exc))}", "error")
            return
        await self.note(f"saved as {name}: `localrun run {name}` goes on from this chat")

    async def attach(self, path: str) -> None:
        """Read one image file (checked: exists, readable, size, format) for the next message."""
        if len(self.pending) >= MAX_ATTACHMENTS:
            await self.note(f"at most {MAX_ATTACHMENTS} images per message; /detach drops them", "error")
            return
        try:
            a = await asyncio.to_thread(read_image, path)
        except AttachmentError as exc:
            await self.note(str(exc), "error")
            return
        self.pending.append(a)
        n = len(self.pending)
        await self.note(f"[image] {a.label()} attached to your next message"
                        + (f" ({n} images)" if n > 1 else "") + " · /detach drops it")
        if self.model_caps is not None and "vision" not in self.model_caps and self.conv.model:
            await self.note(f"{self.conv.model} has no vision projector, so it cannot see images: "
                            "/model NAME switches to a vision model", "warning")

    def _settings_changed(self) -> None:
        self.query_one(SettingsPanel).show_values(self.conv.system, self.conv.options)
        self.save()

    @on(SettingsPanel.Changed)
    def _panel_changed(self, event: SettingsPanel.Changed) -> None:
        if event.key == "system":
            self.conv.system = event.value
        elif event.value is None:
            self.conv.options.pop(event.key, None)
        else:
            self.conv.options[event.key] = event.value
        self.save()

    # ------------------------------------------------------------------ conversations
    def save(self, conv: Conversation | None = None) -> None:
        conv = conv or self.conv
        if not conv.messages:
            return
        try:
            self.store.save(conv)
        except OSError as exc:
            self.notify(f"could not save the conversation: {exc}", severity="error")

    async def _reset_view(self) -> None:
        await self.log_view.remove_children()
        self.status.set(stats={}, state="")

    async def action_new(self) -> None:
        if self.generating:
            self.action_stop()
        self.save()
        self.conv = Conversation(model=self.conv.model, system=self.conv.system, options=dict(self.conv.options),
                                 think=self.conv.think)
        await self._reset_view()
        await self.note("new conversation" + (f" with {self.conv.model}" if self.conv.model else ""))
        self.input_box.focus()

    async def action_clear(self) -> None:
        if self.generating:
            self.action_stop()
        self.conv.messages.clear()
        try:
            self.store.delete(self.conv.id)
        except (OSError, ValueError):
            pass
        await self._reset_view()
        await self.note("conversation cleared")
        self.input_box.focus()

    def action_chats(self) -> None:
        self.push_screen(ChatList(self.store.list(), self.store), self._picked_chat)

    def _picked_chat(self, conv_id: str | None) -> None:
        if conv_id:
            self.run_worker(self.resume(conv_id), group="resume", exit_on_error=False)

    async def resume(self, conv_id: str) -> None:
        if self.generating:
            self.action_stop()
        try:
            conv = self.store.load(conv_id)
        except (OSError, ValueError) as exc:
            await self.note(f"could not open conversation {conv_id}: {exc}", "error")
            return
        self.save()
        self.conv = conv
        await self._reset_view()
        for m in conv.messages:
            label = conv.model if m["role"] == "assistant" else None
            await self.log_view.mount(MessageView(m["role"], m["content"], label=label,
                                                  thinking=m.get("thinking") or "", attachments=m.get("attachments")))
        self.query_one(SettingsPanel).show_values(conv.system, conv.options)
        self.status.set(model=conv.model, processor="")
        await self.note(f"resumed “{conv.display_title()}” ({len(conv.messages)} messages)")
        self.log_view.scroll_end(animate=False)
        self.input_box.focus()
        if conv.model:
            await self.refresh_processor()

    # ------------------------------------------------------------------ misc actions
    async def action_pick_model(self) -> None:
        await self.open_picker()

    async def action_copy_last(self) -> None:
        last = next((m["content"] for m in reversed(self.conv.messages) if m["role"] == "assistant"), None)
        if not last:
            self.notify("No reply to copy yet.", severity="warning")
            return
        self.copy_to_clipboard(last)
        self.notify(f"Copied the last reply ({len(last)} characters).")

    def action_toggle_settings(self) -> None:
        panel = self.query_one(SettingsPanel)
        panel.display = not panel.display
        if panel.display:
            panel.query_one("#set-system").focus()
        else:
            self.input_box.focus()

    async def action_help(self) -> None:
        await self.log_view.mount(MessageView("system", HELP, label="Help"))
        self.log_view.scroll_end(animate=False)


__all__ = ["ChatApp", "describe_processor", "final_stats", "PARAMS"]
