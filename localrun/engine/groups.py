"""Groups of requests (n > 1 choices of one prompt): held until every member arrives, then one prefill and forks.

A group's members are added one by one (each with its own `add_request` call, params and
stream). `RequestGroups` holds them until all have arrived, or GROUP_WAIT_S has passed, and
then hands them to the scheduler together: the first by index prefills the prompt once and
the others fork from it (`Scheduler.add_group`). Everything here runs under the engine's
step lock, except `wait()`, which the loop reads without it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from localrun.engine.requests import EngineRequest
from localrun.engine.scheduler import Scheduler

GROUP_WAIT_S = 0.25  # a group (n > 1) waits at most this long for all its members before it starts


@dataclass
class WaitingGroup:
    """Members of a group that arrived while it waits for the rest (at most GROUP_WAIT_S)."""

    size: int
    deadline: float
    members: list[EngineRequest] = field(default_factory=list)
    arrived: int = 0  # members seen, including aborted ones
    started: bool = False  # handed to the scheduler; members arriving later run on their own


class RequestGroups:
    """The groups whose members are still arriving, and when the next must start."""

    def __init__(self, scheduler: Scheduler, enabled: bool) -> None:
        self.scheduler = scheduler
        self.enabled = enabled  # False with tensor parallelism: every member runs on its own
        self.waiting: dict[str, WaitingGroup] = {}  # groups (n > 1) whose members are still arriving
        self.deadline: float | None = None  # the earliest deadline of a waiting group (for the loop)

    def join(self, req: EngineRequest) -> bool:
        """Hold a group member until its group starts; False: run it on its own (a group of
        one, tensor parallelism, or its group already started)."""
        gid, size, _ = req.group
        if size < 2 or not self.enabled:
            return False
        g = self.waiting.get(gid)
        if g is None:
            g = self.waiting[gid] = WaitingGroup(size, time.perf_counter() + GROUP_WAIT_S)
        g.arrived += 1
        if g.arrived >= g.size:
            del self.waiting[gid]  # every member is here: nothing more to wait for
        if g.started:
            return False
        g.members.append(req)
        if g.arrived >= g.size:
            self._start(g)
        return True

    def leave(self, req: EngineRequest) -> bool:
        """An aborted member still waiting for its group: drop it (True)."""
        g = self.waiting.get(req.group[0]) if req.group else None
        if g is None or g.started or req not in g.members:
            return False
        g.members.remove(req)
        return True

    def start_due(self, now: float) -> None:
        """Start the groups whose wait is over; forget long-started ones; set the next deadline."""
        for gid, g in list(self.waiting.items()):
            if not g.started and now >= g.deadline:
                self._start(g)  # late members will run on their own
            if g.started and now >= g.deadline + 60 * GROUP_WAIT_S:
                del self.waiting[gid]  # members that never came: forget the group
        waits = [g.deadline for g in self.waiting.values() if not g.started]
        self.deadline = min(waits) if waits else None

    def _start(self, g: WaitingGroup) -> None:
        g.started = True
        members = sorted(g.members, key=lambda r: r.group[2])
        g.members = []
        if not members:
            return
        leader = members[0].seq
        same = [r.seq for r in members[1:] if r.seq.token_ids == leader.token_ids]
        self.scheduler.add_group(leader, same)
        for r in members[1:]:
            if r.seq.token_ids != leader.token_ids:  # not the same prompt: no sharing
                self.scheduler.add(r.seq)

    def wait(self) -> float | None:
        """Seconds until the next waiting group must start (None: no group waits); read by the
        loop without the step lock, so from one attribute set under it."""
        deadline = self.deadline
        return None if deadline is None else max(0.0, deadline - time.perf_counter())

    def clear(self) -> None:
        """Forget every waiting group (their members are failed by the caller)."""
        self.waiting.clear()
        self.deadline = None
