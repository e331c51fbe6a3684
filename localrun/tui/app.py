"""The localrun chat app (Textual), a client of the daemon's HTTP API only.

ChatApp holds the layout, the key bindings and what every part shares (the client, the
conversation, the log view, the status bar); its parts are mixins beside it:
`model_switch.py` (picking and pulling the model), `replies.py` (sending a message and streaming
the reply), `slash.py` (slash commands) and `conversations.py` (saving, clearing, resuming).
Textual's message handlers (`@on`) stay on ChatApp itself: Textual collects them from the
App's own class body.
"""

from __future__ import annotations

from textual import on
from textual.actions import SkipAction
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Footer
from textual.worker import Worker, WorkerState

from localrun.attachments import Attachment, is_image_path
from localrun.client import AsyncDaemonClient
from localrun.tui.commands import HELP
from localrun.tui.conversations import ConversationKeeping
from localrun.tui.model_switch import ModelSwitching
from localrun.tui.replies import ReplyStreaming
from localrun.tui.slash import SlashCommands
from localrun.tui.store import ChatStore, Conversation
from localrun.tui.widgets import ChatInput, MessageView, Notice, PullBar, SettingsPanel, StatusBar

WIDE = 100  # from this width on, the settings panel is shown at start


class ChatApp(SlashCommands, ConversationKeeping, ReplyStreaming, ModelSwitching, App[int]):
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

    # ------------------------------------------------------------------ sending (replies.py streams the reply)
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

    # ------------------------------------------------------------------ settings (slash.py: the commands)
    @on(SettingsPanel.Changed)
    def _panel_changed(self, event: SettingsPanel.Changed) -> None:
        if event.key == "system":
            self.conv.system = event.value
        elif event.value is None:
            self.conv.options.pop(event.key, None)
        else:
            self.conv.options[event.key] = event.value
        self.save()

    # ------------------------------------------------------------------ misc actions
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


__all__ = ["ChatApp"]
