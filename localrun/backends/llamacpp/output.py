"""A step's output in the batched loop: sampled tokens through each request's stop handling, chunks to consumers.

:meth:`Output.emit` feeds a request's sampled tokens through its end-of-generation and stop tokens, stop
strings and token limit, and queues what they give as one chunk; :meth:`Output.flush` hands a step's
chunks (and errors) on: one wake-up per event loop, not per chunk, and one write per runner outbox.
Everything here runs on the loop's thread.
"""

from __future__ import annotations

import time
from typing import Any

from localrun.backends.base import Chunk, TokenLogprob, Usage
from localrun.backends.llamacpp.sampling import TokenChooser
from localrun.backends.llamacpp.slots import Request


class Output:
    """The chunks and errors of the step under way, until :meth:`flush`."""

    def __init__(self, chooser: TokenChooser) -> None:
        self.chooser = chooser  # its pieces and end-of-generation tokens
        self._items: list[tuple[Request, Any]] = []

    def put(self, r: Request, item: Any) -> None:
        """A chunk or an exception for r's consumer, handed on at the next flush."""
        self._items.append((r, item))

    def emit(self, r: Request, sampled: list[tuple[int, TokenLogprob | None]]) -> None:
        """Feed sampled tokens through r's stop handling and hand on what they give as one chunk."""
        o = r.options
        chooser = self.chooser
        now = time.perf_counter()
        first = r.t_first is None
        if first:
            r.t_first = now
        text_parts: list[str] = []
        ids: list[int] = []
        lps: list[TokenLogprob] = []
        finish = None
        for tok, lp in sampled:
            if not o.ignore_eos and (chooser.is_eog(tok) or tok in r.stop_ids):
                finish = "stop"
                text_parts.append(r.decoder.decode(b"", final=True) + r.stops.flush())
                break
            r.n_out += 1
            r.history.append(tok)
            ids.append(tok)
            if lp is not None:
                lps.append(lp)
            text, hit = r.stops.feed(r.decoder.decode(chooser.piece(tok, tok in r.preserved)))
            text_parts.append(text)
            if hit:
                finish = "stop"
                break
            if r.n_out >= r.limit:
                finish = "length"
                text_parts.append(r.decoder.decode(b"", final=True) + r.stops.flush())
                break
        if not sampled:  # max_tokens 0
            finish = "length"
        elif finish is None:
            r.pending = [sampled[-1][0]]
        chunk = Chunk(text="".join(text_parts), token_ids=ids, logprobs=lps or None,
                      prompt_logprobs=r.prompt_lps if first else None)
        if finish is not None:
            r.finished = True
            chunk.finish_reason, chunk.stop_sequence = finish, r.stops.matched
            chunk.usage = Usage(prompt_tokens=len(r.prompt), completion_tokens=r.n_out, cached_tokens=r.n_cached,
                                prompt_eval_seconds=r.t_first - r.t0, eval_seconds=now - r.t_first)
        if chunk.text or chunk.token_ids or chunk.finish_reason or chunk.prompt_logprobs is not None:
            self._items.append((r, chunk))

    def flush(self) -> None:
        """Hand this step's chunks to their consumers: one wake-up per event loop, not per chunk
        (a sink's: one write per outbox)."""
        if not self._items:
            return
        by_loop: dict[Any, list[tuple[Request, Any]]] = {}
        outboxes: dict[int, Any] = {}
        for r, item in self._items:
            if r.sink is not None:
                r.sink.put(item)
                outboxes[id(r.sink.outbox)] = r.sink.outbox
            else:
                by_loop.setdefault(r.loop, []).append((r, item))
        self._items = []
        for outbox in outboxes.values():
            outbox.flush()
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # that loop has closed: nobody is waiting for these
                pass


def _put_all(items: list[tuple[Request, Any]]) -> None:
    for r, item in items:
        r.queue.put_nowait(item)
