"""Prefix-cache-aware request routing for Ray Serve replicas of localrun's native engine.

Two parts:

* :class:`PrefixTable` - plain Python, no Ray: a bounded LRU table of chained hashes of a prompt's
  fixed-size character blocks -> the replica that last prefilled that prefix (and so holds its KV in
  its radix cache). Lookups walk the new prompt's blocks and stop at the first unknown one.
* :class:`PrefixAffinityRouter` - a Ray Serve custom request router (``ray.serve.request_router``,
  Ray >= 2.46) built on the table. Importing this module imports Ray; only
  ``localrun.cluster.ray_serve`` imports it, and only when Ray Serve is used.

Routing rule (per request, in the process that holds the deployment handle - the ingress):

1. The prompt *extends a whole earlier prompt* (a conversation's next turn: the rendered template of
   turn k+1 starts with the rendered prompt of turn k), or the known prefix covers at least
   ``min_match_ratio`` of it: prefer the replica that served that prefix, unless its queue is longer
   than the least-loaded replica's by more than ``imbalance_threshold`` requests.
2. Otherwise (a new conversation, or only a shared system prompt matched): least-loaded, ties broken
   round-robin, so new conversations on an idle deployment spread out.

Why "extends a whole prompt" and not "any match": every chat shares its template header (often a
default system prompt); affinity on that alone would pile all conversations onto the first replica.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any, Iterable

log = logging.getLogger("localrun.cluster")

BLOCK_CHARS = 16  # prompt characters per table entry
MAX_BLOCKS = 200_000  # table bound (~200k entries, tens of MB at most)


def _text_of(arg: Any) -> str | None:
    """The prompt a routed call carries: an object or dict with `prompt` (ours), or Ray-LLM-style `messages`."""
    prompt = getattr(arg, "prompt", None)
    if prompt is None and isinstance(arg, dict):
        prompt = arg.get("prompt")
    if isinstance(prompt, str):
        return prompt
    messages = getattr(arg, "messages", None)
    if isinstance(messages, list):
        return "".join(str(m.get("content", "")) if isinstance(m, dict) else str(m) for m in messages)
    return None


class PrefixTable:
    """block hash -> [owner, terminal]; `terminal` marks the last full block of a prompt that was routed."""

    def __init__(self, block_chars: int = BLOCK_CHARS, max_blocks: int = MAX_BLOCKS) -> None:
        if block_chars < 1 or max_blocks < 1:
            raise ValueError("block_chars and max_blocks must be at least 1")
        self.block_chars, self.max_blocks = block_chars, max_blocks
        self._table: OrderedDict[int, list] = OrderedDict()

    def __len__(self) -> int:
        return len(self._table)

    def _hashes(self, text: str) -> list[int]:
        out, h, b = [], 0, self.block_chars
        for i in range(len(text) // b):
            h = hash((h, text[i * b:(i + 1) * b]))
            out.append(h)
        return out

    def match(self, text: str, alive: Iterable[str] | None = None) -> tuple[str | None, int, bool]:
        """(owner of the longest known prefix, its length in characters, whether it covers a whole
        earlier prompt). Entries of replicas not in `alive` end the walk."""
        alive = set(alive) if alive is not None else None
        owner, depth, whole = None, 0, False
        for i, h in enumerate(self._hashes(text)):
            e = self._table.get(h)
            if e is None or (alive is not None and e[0] not in alive):
                break
            self._table.move_to_end(h)
            owner, depth = e[0], (i + 1) * self.block_chars
            whole = whole or e[1]
        return owner, depth, whole

    def insert(self, text: str, replica: str) -> None:
        hs = self._hashes(text)
        for i, h in enumerate(hs):
            e = self._table.get(h)
            last = i == len(hs) - 1
            if e is None:
                self._table[h] = [replica, last]
            else:
                e[0], e[1] = replica, e[1] or last
                self._table.move_to_end(h)
        while len(self._table) > self.max_blocks:
            self._table.popitem(last=False)

    def drop(self, replica: str) -> None:
        """Forget a replica (it died or was scaled down): its KV is gone."""
        for h in [h for h, e in self._table.items() if e[0] == replica]:
            del self._table[h]


def _router_base():
    from ray.serve.request_router import FIFOMixin, RequestRouter

    return FIFOMixin, RequestRouter


_FIFOMixin, _RequestRouter = _router_base()


class PrefixAffinityRouter(_FIFOMixin, _RequestRouter):
    """Ray Serve request router: prompt-prefix affinity over least-loaded (see the module docstring).

    Configure with ``RequestRouterConfig(request_router_class=PrefixAffinityRouter,
    request_router_kwargs={...})``; the kwargs are :meth:`initialize_state`'s.
    """

    def initialize_state(self, block_chars: int = BLOCK_CHARS, max_blocks: int = MAX_BLOCKS,
                         min_match_ratio: float = 0.75, imbalance_threshold: int = 4) -> None:
        self.table = PrefixTable(block_chars, max_blocks)
        self.min_match_ratio = float(min_match_ratio)
        self.imbalance_threshold = int(imbalance_threshold)
        self._turn = 0

    def _queue_len(self, replica) -> int | None:
        return self._replica_queue_len_cache.get(replica.replica_id)

    async def choose_replicas(self, candidate_replicas: list, pending_request=None) -> list[list]:
        if not candidate_replicas:
            return []
        by_id = {r.replica_id.to_full_id_str(): r for r in candidate_replicas}
        text = None
        if pending_request is not None and pending_request.args:
            text = _text_of(pending_request.args[0])
        # least-loaded: the base takes the shortest queue, the first listed on ties - rotate that order so
        # new conversations on an idle deployment take turns instead of piling onto one replica
        k = self._turn % len(candidate_replicas)
        spread = list(candidate_replicas[k:]) + list(candidate_replicas[:k])
        if not text:
            return [spread]
        owner, depth, whole = self.table.match(text, by_id)
        if owner is None or not (whole or depth >= self.min_match_ratio * len(text)):
            self._turn += 1
            return [spread]
        best = by_id[owner]
        lens = [q for q in (self._queue_len(r) for r in candidate_replicas) if q is not None]
        mine = self._queue_len(best)
        if mine is not None and lens and mine - min(lens) > self.imbalance_threshold:
            self._turn += 1
            return [spread]
        return [[best], [r for r in spread if r is not best]]

    def on_request_routed(self, pending_request, replica_id, result) -> None:
        if pending_request is not None and pending_request.args:
            text = _text_of(pending_request.args[0])
            if text:
                self.table.insert(text, replica_id.to_full_id_str())

    def on_replica_actor_died(self, replica_id) -> None:
        super().on_replica_actor_died(replica_id)
        self.table.drop(replica_id.to_full_id_str())

    def update_replicas(self, replicas: list) -> None:
        old = set(self._replica_id_set)
        super().update_replicas(replicas)
        for rid in old - set(self._replica_id_set):
            self.table.drop(rid.to_full_id_str())
