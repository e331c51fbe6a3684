"""The chat app's replies: a message sent, the answer streamed into the view as Markdown, its stats shown."""

from __future__ import annotations

import asyncio
import time

from textual import work
from textual.widgets import Markdown

from localrun.tui.reporting import explain_error, final_stats
from localrun.tui.widgets import MessageView


class ReplyStreaming:
    """ChatApp's part that sends a message and streams the reply (a mixin: it works on the app's client,
    conversation, log view and status bar, and sets `generating` while a reply streams)."""

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
