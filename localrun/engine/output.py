"""The engine's per-token output: stop tokens and strings, detokenized text, grammar steps, stream deltas, ends.

`TokenOutput` is a mixin of `LLMEngine` (the token path shares the engine's request table,
scheduler and limits, and runs once per token, so it stays plain methods on the engine with
no extra indirection). The step hands each sampled token to `on_token`; a request ends in
`_finish`, which streams its last delta (with usage) or files it for `generate`.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from localrun.engine.requests import EngineRequest, StreamDelta
from localrun.engine.scheduler import Scheduler, Sequence
from localrun.stop_strings import held_back

if TYPE_CHECKING:
    from localrun.engine.config import EngineConfig
    from localrun.engine.speculative import SpecDecoder

log = logging.getLogger("localrun.engine")


class TokenOutput:
    """on_token and what it leads to: a request's text, stops, grammar, streamed deltas and its end."""

    # the engine's state this reads and writes (set in LLMEngine.__init__)
    config: EngineConfig
    scheduler: Scheduler
    spec: SpecDecoder | None
    eos_ids: set[int]
    _requests: dict[str, EngineRequest]
    _done: dict[str, EngineRequest]

    def on_token(self, seq: Sequence, tok: int, lp, now: float) -> bool:
        """Hand `seq`'s next token (already in seq.token_ids) to its request: stream it, check stops
        and limits. False when the request finished or was aborted while the step ran (the token
        is void)."""
        req = self._requests.get(seq.id)
        if req is None or req.seq is not seq or seq.finish_reason:
            return False
        self._on_token(req, tok, lp, now)
        return True

    def _on_token(self, req: EngineRequest, tok: int, lp, now: float) -> None:
        seq, p = req.seq, req.seq.params
        req.first_token_time = req.first_token_time or now
        if p.max_tokens == 0:  # the prompt scored: the token its last row sampled is not wanted
            self._finish(req, "length")
            return
        if seq.matcher is not None and seq.matcher.error:  # past llguidance's bounds: its mask let only EOS through
            self._grammar_failed(req, seq.matcher.error)
            return
        req.num_tokens += 1
        req.pending_ids.append(tok)
        if lp is not None:
            req.logprobs.append((tok, lp[0], lp[1]))
            req.pending_lp.append(req.logprobs[-1])
        finish = None
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_ids):
            finish = "stop"
        else:
            if req.detok is not None:
                req.text += req.detok.add(tok)
                if p.stop:
                    finish = self._cut_stop(req)
            if seq.matcher is not None and finish is None:
                finish = self._grammar_token(seq, tok)
                if finish == "grammar":
                    self._grammar_failed(req, seq.matcher.error)
                    return
        if finish is None and (req.num_tokens >= p.max_tokens
                               or seq.prompt_len + req.num_tokens >= self.config.max_model_len):
            finish = "length"
        if finish:
            self._finish(req, finish)
        elif req.stream is not None:
            hold = held_back(req.text[req.sent:], p.stop) if p.stop else 0  # only a possible stop's start
            self._emit(req, max(req.sent, len(req.text) - hold))

    @staticmethod
    def _grammar_token(seq: Sequence, tok: int) -> str | None:
        """Advance the request's grammar; "stop" once the grammar is complete (nothing may follow), "grammar" when
        it went past llguidance's bounds."""
        if not seq.matcher.consume(tok):
            if seq.matcher.error and "satisfy the grammar" not in seq.matcher.error:  # its bounds, not the token
                return "grammar"
            # the mask allowed it, so this is a bug: end the request cleanly
            log.warning("request %s: the grammar rejected sampled token %d (%s)", seq.id, tok, seq.matcher.error)
            return "stop"
        return "stop" if seq.matcher.is_stopped else None

    @staticmethod
    def _cut_stop(req: EngineRequest) -> str | None:
        stops = req.seq.params.stop
        start = max(0, req.sent - max(len(s) for s in stops))
        hits = [(i, s) for i, s in ((req.text.find(s, start), s) for s in stops) if i >= 0]
        if not hits:
            return None
        cut, req.stop_sequence = min(hits, key=lambda h: h[0])
        req.text = req.text[:cut]
        return "stop"

    def _emit(self, req: EngineRequest, upto: int, finish: str | None = None, usage: dict | None = None,
              error: str | None = None, error_kind: str | None = None) -> None:
        text = req.text[req.sent:upto] if upto > req.sent else ""
        if not (text or req.pending_ids or finish):
            return
        req.sent = max(req.sent, upto)
        delta = StreamDelta(req.pending_ids, text, finish, req.pending_lp or None, usage, error=error,
                            error_kind=error_kind, stop_sequence=req.stop_sequence if finish else None)
        if not req.prompt_sent and req.seq.prompt_lps is not None:
            req.prompt_sent, delta.prompt_logprobs = True, req.seq.prompt_lps
        req.pending_ids, req.pending_lp = [], []
        try:
            req.stream._push(delta)
        except RuntimeError:  # the client's event loop is gone: nobody is listening
            if finish is None:
                self.scheduler.abort(req.seq.id)
                self._finish(req, "abort", release=False)

    def _finish(self, req: EngineRequest, reason: str, release: bool = True, error: str | None = None,
                error_kind: str | None = None) -> None:
        seq = req.seq
        seq.finish_reason = seq.finish_reason or reason
        if release:
            self.scheduler.finish(seq)
        req.finish_time = time.perf_counter()
        self._requests.pop(seq.id, None)
        if req.stream is not None:
            self._emit(req, len(req.text), seq.finish_reason, self._usage(req), error, error_kind)
        else:
            self._done[seq.id] = req

    def _grammar_failed(self, req: EngineRequest, why: str) -> None:
        """End `req` with an error: its grammar stopped the generation (an empty language, or more work for one
        token than llguidance's bounds allow)."""
        from localrun.structured.constraints import stopped_message

        self._finish(req, "abort", error=stopped_message(why), error_kind="grammar")

    def _usage(self, req: EngineRequest) -> dict:
        first = req.first_token_time or req.finish_time
        usage = {"prompt_tokens": req.seq.prompt_len, "completion_tokens": req.num_tokens,
                 "cached_tokens": max(req.seq.cached_tokens, 0),
                 "prompt_eval_seconds": first - req.arrival_time, "eval_seconds": req.finish_time - first}
        if self.spec is not None:
            usage["spec_draft_tokens"] = req.seq.spec_draft_tokens
            usage["spec_accepted_tokens"] = req.seq.spec_accepted_tokens
        return usage
