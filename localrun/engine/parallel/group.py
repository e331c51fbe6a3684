"""TPGroup: one rank's view of a tensor-parallel group (shard shapes, collectives, step messages).

Tensor parallelism for the native engine: one process per rank over torch.distributed
(NCCL on CUDA, gloo on CPU).

Rank 0 is the engine (scheduler, sampler, tokenizer) inside the calling process; it spawns
ranks 1..N-1 as child processes (PDEATHSIG: they die with it; launch.py). Every rank holds its shard of
the weights (attention heads, KV heads, MLP columns and vocabulary rows split N ways) and its
shard of the KV pool (num_kv_heads / N heads). Before each forward rank 0 sends the step's
host arrays (HostStep plus the page-table writes since the last step) to each follower as one
int32 message over a pipe; the followers run the same forward. The collectives are an
all_reduce after o_proj, after down_proj and after the vocab-parallel embedding lookup, a
gather of the logits shards to rank 0, and a broadcast of the sampled tokens (a decode's
input may be the last step's token, still on the device).

Followers wait for work on their pipe, not in a collective, so an idle engine never hits the
collective timeout. A follower that dies is seen by rank 0's watcher thread (the child's
sentinel): the engine turns fatal, its requests end with an error naming the rank, and the
runner process exits (the daemon reloads the model on the next request). A collective
waiting on a dead peer fails (gloo: at once, the connection closes) or times out.
"""

from __future__ import annotations

import logging
import signal
import threading
from dataclasses import replace
from multiprocessing.connection import Connection, wait
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from localrun.engine.config import ModelConfig
from localrun.engine.layers.attention import HostStep

log = logging.getLogger("localrun.engine")

COLLECTIVE_TIMEOUT_S = 300.0  # a collective (or the start-up rendezvous) waiting longer than this fails
MSG_STEP, MSG_EMBED, MSG_SHUTDOWN = 1, 2, 3
_HEADER = 8  # kind, num_decodes, num_real_seqs, padded bs (-1: none), T, B, S, journal length


def check_shapes(cfg: ModelConfig, world: int) -> None:
    """Raise a clear error when the model cannot be split `world` ways."""
    if world < 1:
        raise ValueError(f"tensor_parallel must be >= 1, got {world}")
    if world == 1:
        return
    bad = [f"{what} {n}" for what, n in (("num_heads", cfg.num_heads), ("num_kv_heads", cfg.num_kv_heads),
                                         ("intermediate_size", cfg.intermediate_size),
                                         ("moe_intermediate_size", cfg.moe_intermediate_size)) if n % world]
    if bad:
        raise ValueError(f"tensor_parallel {world} must divide the model's {' and '.join(bad)}; "
                         f"use a tensor_parallel that divides num_kv_heads {cfg.num_kv_heads}")


class TPGroup:
    """This rank's view of a tensor-parallel group. `world == 1` makes every collective a no-op
    (the model code calls them unconditionally)."""

    def __init__(self, rank: int = 0, world: int = 1) -> None:
        self.rank, self.world = rank, world
        self.conns: list[Connection] = []  # rank 0: a pipe to each follower; a follower: its pipe from rank 0
        self.procs: list = []
        self.dead: str | None = None  # rank 0: why a follower is gone
        self._dead_event = threading.Event()
        self._on_death: list[Callable[[str], None]] = []
        self._closing = False
        self.stop_r: Connection | None = None
        self.stop_w: Connection | None = None
        self.watcher_thread: threading.Thread | None = None
        self.saved_threads: int | None = None  # CPU: rank 0's torch thread count before the group split the cores

    # -- shapes ------------------------------------------------------------------------------
    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """The shard's attention shape (its KV pool holds num_kv_heads / world heads)."""
        if self.world == 1:
            return cfg
        return replace(cfg, num_heads=cfg.num_heads // self.world, num_kv_heads=cfg.num_kv_heads // self.world,
                       head_dim=cfg.head_dim)

    def vocab_shard(self, vocab: int) -> tuple[int, int, int]:
        """(first row, rows held, rows allocated): the vocabulary split in equal padded shards."""
        per = -(-vocab // self.world)
        start = min(vocab, self.rank * per)
        return start, min(vocab, start + per) - start, per

    # -- collectives (the model's) -----------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            dist.all_reduce(x)
        return x

    def gather_logits(self, local: torch.Tensor, vocab: int) -> torch.Tensor | None:
        """[T, per] shards -> [T, vocab] on rank 0 (None elsewhere)."""
        if self.world == 1:
            return local
        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(self.world)] if self.rank == 0 else None
        dist.gather(local, parts, dst=0)
        return torch.cat(parts, dim=-1)[:, :vocab] if self.rank == 0 else None

    def broadcast(self, x: torch.Tensor) -> None:
        if self.world > 1:
            dist.broadcast(x, src=0)

    def min_int(self, v: int, device) -> int:
        """The smallest of every rank's v (e.g. a KV page count every rank can hold)."""
        if self.world == 1:
            return v
        t = torch.tensor([v], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    # -- the step message (rank 0 -> followers) ----------------------------------------------
    def send_step(self, step, bs: int | None, journal: list) -> None:
        """One int32 message: a header, the HostStep arrays and the page-table writes."""
        jr = _encode_journal(journal)
        journal.clear()
        T, B, S = step.num_tokens, len(step.seq_lens), len(step.sample_idx)
        head = np.array([MSG_STEP, step.num_decodes, step.num_real_seqs, -1 if bs is None else bs, T, B, S, len(jr)],
                        dtype=np.int32)
        self._send(np.concatenate([head, step.input_ids, step.prev_idx, step.positions, step.slots, step.seq_lens,
                                   step.cu_seqlens_q, step.rows, step.sample_idx, jr]).astype(np.int32, copy=False))

    def send_embed(self, token_lists: list[list[int]]) -> None:
        lens = [len(t) for t in token_lists]
        head = np.array([MSG_EMBED, len(lens), 0, 0, 0, 0, 0, 0], dtype=np.int32)
        self._send(np.concatenate([head, np.asarray(lens, np.int32),
                                   np.asarray([x for t in token_lists for x in t], np.int32)]))

    def _send(self, msg: np.ndarray) -> None:
        if self.dead:
            raise RuntimeError(self.dead)
        buf = msg.tobytes()
        for c in self.conns:
            c.send_bytes(buf)

    def recv(self):
        """A follower's next order: ("step", HostStep, bs, journal) | ("embed", lists) | ("shutdown",)."""
        try:
            msg = np.frombuffer(self.conns[0].recv_bytes(), dtype=np.int32)
        except (EOFError, OSError):  # rank 0 is gone
            return ("shutdown",)
        kind = int(msg[0])
        if kind == MSG_STEP:
            nd, nr, bs, T, B, S, J = (int(v) for v in msg[1:_HEADER])
            parts, o = [], _HEADER
            for n in (T, T, T, T, B, B + 1, B, S, J):
                parts.append(msg[o:o + n])
                o += n
            step = HostStep(input_ids=parts[0], prev_idx=parts[1], positions=parts[2], slots=parts[3],
                            seq_lens=parts[4], cu_seqlens_q=parts[5], rows=parts[6], sample_idx=parts[7],
                            num_decodes=nd, num_real_seqs=nr)
            return ("step", step, None if bs < 0 else bs, parts[8])
        if kind == MSG_EMBED:
            n = int(msg[1])
            lens = msg[_HEADER:_HEADER + n]
            flat, out, o = msg[_HEADER + n:], [], 0
            for k in lens:
                out.append(flat[o:o + int(k)].tolist())
                o += int(k)
            return ("embed", out)
        return ("shutdown",)

    # -- rank 0: followers' lifetime ---------------------------------------------------------
    def on_death(self, fn: Callable[[str], None]) -> None:
        self._on_death.append(fn)
        if self.dead:
            fn(self.dead)

    def wait_dead(self, timeout: float) -> str | None:
        """Why a follower died, waiting up to `timeout` for the watcher to see it (a collective
        fails a moment before the sentinel fires)."""
        if self.world > 1 and self.rank == 0:
            self._dead_event.wait(timeout)
        return self.dead

    def watch(self) -> None:
        """Rank 0's watcher thread (launch.start runs it): wait for a follower to exit or for close()."""
        sentinels = {p.sentinel: (r, p) for r, p in enumerate(self.procs, start=1)}
        ready = wait(list(sentinels) + [self.stop_r])
        if self._closing or self.stop_r in ready:
            return
        r, p = sentinels[next(s for s in ready if s in sentinels)]
        p.join(1.0)
        self.dead = (f"tensor-parallel rank {r} (pid {p.pid}) {_describe(p.exitcode)}; the model must be loaded "
                     "again")
        log.error("%s", self.dead)
        self._dead_event.set()
        for fn in list(self._on_death):
            try:
                fn(self.dead)
            except Exception:  # noqa: BLE001 - every listener hears it
                log.exception("tensor-parallel death handler failed")

    def close(self) -> None:
        """Rank 0: tell the followers to exit, reap them (SIGKILL after a grace), leave the group."""
        if self.world == 1 or self._closing:
            return
        self._closing = True
        if self.rank == 0:
            head = np.array([MSG_SHUTDOWN] + [0] * (_HEADER - 1), dtype=np.int32).tobytes()
            for c in self.conns:
                try:
                    c.send_bytes(head)
                except OSError:
                    pass
            for p in self.procs:
                p.join(5.0)
                if p.exitcode is None:
                    log.warning("tensor-parallel rank (pid %s) did not exit; killing it", p.pid)
                    p.kill()
                    p.join(5.0)
            if self.stop_w is not None:  # only now: the watcher thread's exit SIGKILLs the followers (PDEATHSIG)
                self.stop_w.send_bytes(b"x")
            for c in self.conns:
                c.close()
            if self.saved_threads is not None:
                torch.set_num_threads(self.saved_threads)
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a dead peer: nothing left to tear down cleanly
                pass


def _encode_journal(journal: list) -> np.ndarray:
    if not journal:
        return np.zeros(0, dtype=np.int32)
    out = []
    for row, start, pages in journal:
        out.append(np.array([row, start, len(pages)], dtype=np.int32))
        out.append(np.asarray(pages, dtype=np.int32))
    return np.concatenate(out)


def apply_journal(table, jr: np.ndarray) -> None:
    """A follower replays rank 0's page-table writes, in order."""
    o = 0
    while o < len(jr):
        row, start, n = int(jr[o]), int(jr[o + 1]), int(jr[o + 2])
        table.write(row, start, jr[o + 3:o + 3 + n].tolist())
        o += 3 + n


def _describe(code: int | None) -> str:
    if code is None:
        return "stopped answering"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"
