"""The chat app's conversations: saved as they change, started anew, cleared, listed and resumed."""

from __future__ import annotations

from localrun.tui.store import Conversation
from localrun.tui.widgets import ChatList, MessageView, SettingsPanel


class ConversationKeeping:
    """ChatApp's part that keeps conversations in its ChatStore and swaps the one shown (a mixin: it works on
    the app's conversation, store, log view and status bar)."""

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
