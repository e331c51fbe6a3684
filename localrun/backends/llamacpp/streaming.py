"""A llama.cpp stream's chunks as llama-server streams them: no text while the output's bytes end inside a character.

:func:`stream_shaper` turns the batched loop's raw chunks of one request into the stream's (held partial
characters, the prompt's counts on the first chunk); :class:`ShapedSink` puts that between the loop and a
runner process's sink, on the loop's thread.
"""

from __future__ import annotations

from typing import Any, Callable

from localrun.backends.base import Chunk, GenerationRequest, merge_chunks
from localrun.backends.llamacpp.slots import Request


def cut_inside_char(tail: bytes) -> bool:
    """Whether bytes ending in ``tail`` (their last 4) end inside a UTF-8 character: llama-server's
    validate_utf8 (tools/server), which holds a stream's text back while this is so."""
    for i in range(1, min(4, len(tail)) + 1):
        c = tail[-i]
        if (c & 0xE0 == 0xC0 and i < 2) or (c & 0xF0 == 0xE0 and i < 3) or (c & 0xF8 == 0xF0 and i < 4):
            return True
    return False


def stream_shaper(request: GenerationRequest, req: Request, tokens: list[int],
                  piece: Callable[[int], bytes]) -> Callable[[Chunk], Chunk | None]:
    """The function that turns the loop's raw chunks of `req` (the loop's Request of `request`, whose prompt
    is `tokens`) into this stream's: the first says how much of the prompt the cache gave (and, with images or
    an infill layout, the prompt's length); text is held while the output's bytes end inside a character."""
    # the prompt's length (image tokens, the infill layout) goes on the first chunk
    first = bool(request.images) or request.infill is not None
    opened = False  # the first chunk is out (it says how much of the prompt the cache gave)
    tail, loose, held = b"", b"", None  # last bytes; bytes since the last whole character; held chunks

    def shape(item: Chunk) -> Chunk | None:
        """As llama-server streams: no text while the output's bytes end inside a character
        (None: held, it goes out with the next chunk)."""
        nonlocal first, opened, tail, loose, held
        if not opened:
            item.cached_tokens, opened = req.n_cached, True
        if first:
            item.prompt_tokens, first = len(tokens), False
            if request.infill is not None:  # the layout only this backend knows (Ollama's `context`)
                item.prompt_token_ids = list(tokens)
        for t in item.token_ids:
            p = piece(t)
            tail, loose = (tail + p)[-4:], loose + p
            if not cut_inside_char(tail):
                loose = b""
        if held is not None:
            item = merge_chunks(held, item)
            held = None
        if loose:
            if item.finish_reason is None:
                held = item
                return None
            cut = loose.decode("utf-8", "replace")
            item.cut_chars = len(cut) if item.text.endswith(cut) else 0  # (not when a stop string cut it)
        return item

    return shape


class ShapedSink:
    """A direct stream's sink as the loop sees it: raw chunks go through the stream's ``shape``
    (the held partial characters) on their way to the runner's sink. The loop's thread only."""

    def __init__(self, sink: Any) -> None:
        self.sink, self.outbox, self.delivered = sink, sink.outbox, sink.delivered
        self.shape: Any = None  # set by LlamaCppBackend._submit before the request reaches the loop

    def put(self, item: Any) -> None:
        if isinstance(item, BaseException):
            self.sink.put(item)
            return
        chunk = self.shape(item)
        if chunk is not None:
            self.sink.put(chunk)
        else:  # held (it ends inside a character): nothing for the consumer to take yet
            self.delivered.set()
