"""The chat app's model: the daemon asked at start, a model chosen, pulled when missing, or picked from a list."""

from __future__ import annotations

import asyncio

from textual import work

from localrun.client import APIError, DaemonUnavailable
from localrun.tui.reporting import describe_processor, explain_error
from localrun.tui.widgets import ModelPicker, PullBar


class ModelSwitching:
    """ChatApp's part that picks, pulls and switches the conversation's model (a mixin: it works on the app's
    client, conversation, status bar and log)."""

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

    async def action_pick_model(self) -> None:
        await self.open_picker()
