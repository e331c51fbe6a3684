"""The chat app's slash commands (/set, /model, /image, /save, ...), parsed by tui.commands, carried out here."""

from __future__ import annotations

import asyncio

from localrun.attachments import MAX_ATTACHMENTS, AttachmentError, read_image
from localrun.client import APIError, DaemonUnavailable
from localrun.tui.commands import CommandError, parse_command
from localrun.tui.widgets import SettingsPanel


class SlashCommands:
    """ChatApp's part that carries out a slash command line (a mixin: the commands change the app's
    conversation, settings and attachments, or call its actions)."""

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
