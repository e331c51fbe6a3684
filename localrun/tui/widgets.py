"""Widgets and modal screens of the chat app."""

from __future__ import annotations

import time

from textual import events, on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.message import Message
from textual.screen import ModalScreen
from textual.widgets import Collapsible, Input, Label, Markdown, OptionList, ProgressBar, Static, TextArea
from textual.widgets.option_list import Option

from localrun.tui.commands import PARAMS, CommandError, parse_param
from localrun.tui.store import Conversation


def human_size(n: int | None) -> str:
    if not n:
        return ""
    size = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if size < 1000 or unit == "TB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return ""


class ChatInput(TextArea):
    """Multi-line prompt box: Enter sends; Ctrl+J / Shift+Enter / Alt+Enter insert a newline.

    Ctrl+J is the one that works in every terminal (it sends a line feed, Enter sends a
    carriage return); Shift+Enter only arrives where the terminal reports modifiers.
    """

    BINDINGS = [
        Binding("enter", "submit", "Send", show=True),
        Binding("ctrl+j", "newline", "Newline", show=False),
    ]
    NEWLINE_KEYS = ("ctrl+j", "shift+enter", "alt+enter", "ctrl+enter")

    class Submitted(Message):
        def __init__(self, text: str) -> None:
            super().__init__()
            self.text = text

    def __init__(self, **kwargs) -> None:
        super().__init__(soft_wrap=True, show_line_numbers=False, tab_behavior="focus", **kwargs)

    async def _on_key(self, event: events.Key) -> None:
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            self.action_submit()
            return
        if event.key in self.NEWLINE_KEYS:
            event.stop()
            event.prevent_default()
            self.action_newline()
            return
        await super()._on_key(event)

    def action_submit(self) -> None:
        text = self.text
        if text.strip():
            self.post_message(self.Submitted(text))

    def action_newline(self) -> None:
        start, end = self.selection
        self._replace_via_keyboard("\n", start, end)


class MessageView(Vertical):
    """One turn: a role line, the model's thinking folded away (when it thought), and the text
    rendered as Markdown."""

    def __init__(self, role: str, content: str = "", label: str | None = None, thinking: str = "",
                 attachments: list[str] | None = None) -> None:
        super().__init__(classes=f"message -{role}")
        self.role = role
        self.label = label or {"user": "You", "assistant": "Assistant", "system": "System"}.get(role, role)
        self.content = content
        self.thinking = thinking
        self.attachments = list(attachments or [])  # what was attached (e.g. "cat.png (png, 1.2 KB)")
        self.sent: list = []  # the Attachments sent with this turn (they come back if the reply fails)

    def compose(self) -> ComposeResult:
        yield Label(self.label, classes="role")
        for a in self.attachments:
            yield Label(f"[image] {a}", classes="attachment", markup=False)
        if self.thinking:
            yield self._thinking_fold()
        yield Markdown(self.content, classes="body")

    def _thinking_fold(self) -> Collapsible:
        return Collapsible(Static(self.thinking, classes="thinking-text", markup=False),
                           title=self._thinking_title(), collapsed=True, classes="thinking")

    def _thinking_title(self) -> str:
        return f"Thinking ({len(self.thinking.split())} words)"

    async def add_thinking(self, piece: str) -> None:
        """Stream the model's reasoning into the fold (created, folded, on the first piece)."""
        self.thinking += piece
        folds = self.query(".thinking")
        if not folds:
            await self.mount(self._thinking_fold(), before=self.body)
            return
        fold = folds.first(Collapsible)
        fold.title = self._thinking_title()
        fold.query_one(".thinking-text", Static).update(self.thinking)

    @property
    def body(self) -> Markdown:
        return self.query_one(".body", Markdown)

    def set_note(self, note: str) -> None:
        self.mount(Label(note, classes="note"))


class Notice(Static):
    """An info / error line in the conversation (never sent to the model)."""

    def __init__(self, text: str, kind: str = "info") -> None:
        prefix = {"error": "✖ ", "warning": "! ", "info": "· "}.get(kind, "")
        super().__init__(prefix + text, classes=f"notice -{kind}", markup=False)
        self.kind = kind
        self.text = text


class StatusBar(Static):
    """model · backend device · TTFT · tok/s · prompt / cached / completion tokens."""

    def __init__(self, **kwargs) -> None:
        super().__init__("", markup=False, **kwargs)
        self.model: str | None = None
        self.processor: str = ""
        self.state: str = ""
        self.stats: dict = {}
        self.refresh_text()

    def set(self, **fields) -> None:
        for k, v in fields.items():
            setattr(self, k, v)
        self.refresh_text()

    def parts(self) -> list[str]:
        parts = [self.model or "no model"]
        if self.processor:
            parts.append(self.processor)
        s = self.stats
        if self.state:
            parts.append(self.state)
        if s.get("ttft") is not None:
            parts.append(f"TTFT {s['ttft'] * 1000:.0f} ms")
        if s.get("tps") is not None:
            parts.append(f"{s['tps']:.1f} tok/s")
        if s.get("completion") is not None:
            parts.append(f"prompt {s.get('prompt', 0)} / cached {s.get('cached') or 0} / completion {s['completion']}")
        return parts

    def text(self) -> str:
        return " │ ".join(self.parts())

    def refresh_text(self) -> None:
        """One line when it fits; else break between parts (never inside one) at 80 columns."""
        width = max(self.content_size.width, 20) if self.is_mounted else 10_000
        lines: list[str] = []
        for part in self.parts():
            if lines and len(lines[-1]) + 3 + len(part) <= width:
                lines[-1] += " │ " + part
            else:
                lines.append(part)
        self.update("\n".join(lines))

    def on_resize(self) -> None:
        self.refresh_text()


class PullBar(Horizontal):
    """Shown while a model is being pulled: status text + progress bar."""

    def compose(self) -> ComposeResult:
        yield Label("", id="pull-label")
        yield ProgressBar(total=None, show_eta=False, id="pull-progress")

    def show_event(self, name: str, event: dict) -> None:
        status = str(event.get("status", ""))
        total, done = event.get("total"), event.get("completed")
        label = f"pulling {name}: {status}"
        if total:
            label += f" ({human_size(done or 0)} / {human_size(total)})"
        self.query_one("#pull-label", Label).update(label)
        bar = self.query_one(ProgressBar)
        if total:
            bar.update(total=total, progress=done or 0)
        elif status == "success":
            bar.update(total=1, progress=1)


class SettingsPanel(VerticalScroll):
    """System prompt and generation parameters; blank = the model's default (F2 toggles)."""

    LABELS = {"temperature": "temperature", "top_p": "top_p", "num_predict": "max tokens", "num_ctx": "num_ctx",
              "seed": "seed"}

    class Changed(Message):
        def __init__(self, key: str, value) -> None:
            super().__init__()
            self.key = key
            self.value = value

    def compose(self) -> ComposeResult:
        yield Label("Settings", classes="panel-title")
        yield Label("blank = model default", classes="hint")
        yield Label("System prompt")
        yield TextArea(id="set-system", soft_wrap=True, tab_behavior="focus", show_line_numbers=False)
        for p in PARAMS.values():
            with Horizontal(classes="param-row"):
                yield Label(self.LABELS[p.name], classes="param-label")
                yield Input(placeholder="default", id=f"set-{p.name}", classes="param", tooltip=p.help,
                            compact=True)
        yield Static("", id="settings-error", markup=False)

    def show_values(self, system: str | None, options: dict) -> None:
        """Reflect the current conversation's settings without firing Changed."""
        with self.prevent(Input.Changed, TextArea.Changed):
            self.query_one("#set-system", TextArea).text = system or ""
            for name in PARAMS:
                v = options.get(name)
                inp = self.query_one(f"#set-{name}", Input)
                inp.value = "" if v is None else f"{v:g}" if isinstance(v, float) else str(v)
                inp.remove_class("-invalid")
        self.query_one("#settings-error", Static).update("")

    @on(TextArea.Changed, "#set-system")
    def _system_changed(self, event: TextArea.Changed) -> None:
        event.stop()
        self.post_message(self.Changed("system", event.text_area.text.strip() or None))

    @on(Input.Changed)
    def _changed(self, event: Input.Changed) -> None:
        event.stop()
        key = (event.input.id or "").removeprefix("set-")
        err = self.query_one("#settings-error", Static)
        try:
            value = parse_param(key, event.value)
        except CommandError as exc:
            event.input.add_class("-invalid")
            err.update(str(exc))
            return
        event.input.remove_class("-invalid")
        err.update("")
        self.post_message(self.Changed(key, value))

    @on(Input.Submitted)
    def _submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.app.query_one(ChatInput).focus()


class ModelPicker(ModalScreen[str | None]):
    """Pick a model from /api/tags, or type any name to pull it."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, models: list[dict], current: str | None, error: str | None = None) -> None:
        super().__init__()
        self.models = models
        self.current = current
        self.error = error

    def compose(self) -> ComposeResult:
        with Vertical(id="picker", classes="dialog"):
            yield Label("Choose a model  (Enter picks · Esc cancels)", classes="dialog-title")
            options = []
            for m in self.models:
                name = m.get("name") or m.get("model") or "?"
                d = m.get("details") or {}
                extra = " ".join(x for x in (d.get("parameter_size"), d.get("quantization_level"), human_size(m.get("size"))) if x)
                mark = "● " if name == self.current else "  "
                options.append(Option(f"{mark}{name}  {extra}", id=name))
            yield OptionList(*options, id="picker-list")
            if not self.models:
                yield Static(self.error or "No models in the library yet: type a name below to pull one.", classes="hint", markup=False)
            yield Input(placeholder="or type a name to pull, e.g. smollm2:135m or hf.co/ORG/REPO:Q4_K_M", id="picker-input")

    def on_mount(self) -> None:
        (self.query_one(OptionList) if self.models else self.query_one(Input)).focus()

    @on(OptionList.OptionSelected)
    def _picked(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(event.option.id)

    @on(Input.Submitted)
    def _typed(self, event: Input.Submitted) -> None:
        name = event.value.strip()
        if name:
            self.dismiss(name)

    def action_cancel(self) -> None:
        self.dismiss(None)


class ChatList(ModalScreen[str | None]):
    """Saved conversations, newest first; Enter resumes, Delete removes."""

    BINDINGS = [Binding("escape", "cancel", "Cancel"), Binding("delete", "delete", "Delete")]

    def __init__(self, conversations: list[Conversation], store) -> None:
        super().__init__()
        self.conversations = conversations
        self.store = store

    def compose(self) -> ComposeResult:
        with Vertical(id="chats", classes="dialog"):
            yield Label("Saved conversations  (Enter resumes · Del deletes · Esc)", classes="dialog-title")
            yield OptionList(*[self._option(c) for c in self.conversations], id="chat-list")
            if not self.conversations:
                yield Static("No saved conversations yet.", classes="hint")

    @staticmethod
    def _option(c: Conversation) -> Option:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(c.updated_at))
        n = sum(1 for m in c.messages if m.get("role") == "user")
        return Option(f"{when}  {c.display_title()}  [{c.model or '?'} · {n} msg]", id=c.id)

    @on(OptionList.OptionSelected)
    def _picked(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(event.option.id)

    def action_delete(self) -> None:
        ol = self.query_one(OptionList)
        if ol.highlighted is None:
            return
        option = ol.get_option_at_index(ol.highlighted)
        self.store.delete(option.id)
        ol.remove_option(option.id)

    def action_cancel(self) -> None:
        self.dismiss(None)
