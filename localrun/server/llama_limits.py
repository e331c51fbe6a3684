"""llama-server's limits on a completion that the daemon applies to its events: ``t_max_predict_ms`` (a time
limit that ends a completion at a new line) and ``n_indent`` (each line after the first must be indented at
least that much, llama.vscode's way of keeping a completion inside the block it started in)."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import AsyncIterator

from localrun.server.generation import Generation
from localrun.server.job import Delta, Done


class IndentLimit:
    """n_indent as llama-server applies it: a line after the first whose indentation (spaces, tabs) is shorter
    than n ends the completion at its indentation (kept), an empty line too. The indentation of a line is held
    back until its first other character says whether the line stays."""

    def __init__(self, n: int) -> None:
        self.n, self.held, self.at_line_start = n, "", False

    def feed(self, text: str) -> tuple[str, bool]:
        """(the text to send now, whether the completion ends here)."""
        out: list[str] = []
        for ch in text:
            if self.at_line_start:
                if ch in " \t":
                    self.held += ch
                    continue
                out.append(self.held)
                if len(self.held) < self.n:
                    self.held = ""
                    return "".join(out), True
                self.held, self.at_line_start = "", False
            out.append(ch)
            if ch == "\n":
                self.at_line_start = True
        return "".join(out), False

    def flush(self) -> str:
        held, self.held = self.held, ""
        return held


def _cut(gen: Generation, first: float, now: float) -> Done:
    """The Done of a completion the daemon ended: the backend's own usage comes with its last chunk, which this cut
    never reads, so the timings are as the daemon saw them (the prompt's up to the first token; the rest after)."""
    u = gen.usage
    u.completion_tokens = len(gen.output_ids.get(0, []))
    u.prompt_eval_seconds = u.prompt_eval_seconds or max(first - gen.t0, 0.0)
    u.eval_seconds = u.eval_seconds or (now - first)
    return Done(0, "length", u)


async def bounded(gen: Generation, t_max_predict_ms: int | None,
                  n_indent: int | None = None) -> AsyncIterator[Delta | Done]:
    """The generation's events; with t_max_predict_ms, llama-server's time limit: once a new line has
    been generated and more than that many ms went by since the first token, it ends there (the backend
    request is aborted), finish reason "length" (llama-server's stop_type "limit"); with n_indent, the
    indentation limit (IndentLimit), ending it the same way."""
    events = gen.events()
    first, new_line = None, False
    indent = IndentLimit(n_indent) if n_indent else None
    try:
        async for ev in events:
            if isinstance(ev, Done) or not (t_max_predict_ms or indent):
                if isinstance(ev, Done) and indent is not None and indent.held:
                    yield Delta(0, content=indent.flush())
                yield ev
                continue
            if isinstance(ev, Delta) and (ev.content or ev.token_ids):
                now = time.perf_counter()
                first = first or now
                stop = False
                if indent is not None:
                    text, stop = indent.feed(ev.content)
                    ev = replace(ev, content=text, cut_chars=min(ev.cut_chars, len(text)))
                new_line = new_line or "\n" in ev.content
                yield ev
                if stop or (t_max_predict_ms and new_line and (now - first) * 1e3 > t_max_predict_ms):
                    yield _cut(gen, first, now)
                    return
            else:
                yield ev
    finally:
        await events.aclose()
