"""Starting a tensor-parallel group: rank 0 spawns the follower processes, each builds its engine and follows."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import socket
import sys
import threading
from dataclasses import replace
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Callable

import torch
import torch.distributed as dist

from localrun.engine.parallel.group import COLLECTIVE_TIMEOUT_S, TPGroup

log = logging.getLogger("localrun.engine")


def _die_with_parent() -> None:
    """SIGKILL when the parent dies (Linux). PDEATHSIG follows the parent *thread* that forked
    us, which is why rank 0 starts followers from its watcher thread, alive as long as they are."""
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
        except Exception:  # pragma: no cover - the pipe's EOF still ends an idle follower
            pass
    if os.getppid() != parent or parent == 1:
        os._exit(0)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _backend(device: str) -> str:
    return "nccl" if str(device).startswith("cuda") else "gloo"


def start(world: int, device: str, recipe: tuple, config, build: Callable, timeout_s: float = COLLECTIVE_TIMEOUT_S
          ) -> TPGroup:
    """Rank 0: spawn ranks 1..world-1 (each builds its shard from `recipe` and follows), join the
    process group, and return rank 0's TPGroup. The followers run `_follower_main`: `build(recipe,
    config, group)` (picklable: a module-level function or a classmethod) returns an object whose
    `follow()` runs rank 0's steps until told to stop (the engine, LLMEngine.from_recipe)."""
    if world == 1:
        return TPGroup()
    if dist.is_initialized():
        raise RuntimeError("a tensor-parallel group is already running in this process; close that engine first")
    cuda = str(device).startswith("cuda")
    if cuda and torch.cuda.device_count() < world:
        raise ValueError(f"tensor_parallel {world} needs {world} GPUs; {torch.cuda.device_count()} are visible")
    init = f"tcp://127.0.0.1:{_free_port()}"
    g = TPGroup(0, world)
    if not cuda:  # CPU: the ranks share the cores (more threads than cores spin against each other)
        g.saved_threads = torch.get_num_threads()
        torch.set_num_threads(max(1, g.saved_threads // world))
    threads = 0 if cuda else torch.get_num_threads()
    ctx = mp.get_context("spawn")
    g.stop_r, g.stop_w = ctx.Pipe(duplex=False)
    spawned = threading.Event()
    failed: list[BaseException] = []

    def watcher() -> None:
        try:
            for r in range(1, world):
                mine, theirs = ctx.Pipe(duplex=False)  # (reader, writer): rank 0 writes
                p = ctx.Process(target=_follower_main, name=f"localrun-tp{r}", daemon=True,
                                args=(r, world, init, recipe, config, mine, timeout_s, threads, build))
                p.start()
                mine.close()
                g.conns.append(theirs)
                g.procs.append(p)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller below
            failed.append(exc)
        finally:
            spawned.set()
        if not failed:
            g.watch()

    g.watcher_thread = threading.Thread(target=watcher, name="localrun-tp-watch", daemon=True)
    g.watcher_thread.start()
    spawned.wait()
    if failed:
        g.close()
        raise RuntimeError(f"could not start the tensor-parallel ranks: {failed[0]}") from failed[0]
    if cuda:
        torch.cuda.set_device(0)
    try:
        dist.init_process_group(_backend(device), init_method=init, rank=0, world_size=world,
                                timeout=timedelta(seconds=timeout_s))
    except Exception as exc:
        g.close()
        raise RuntimeError(f"tensor-parallel start-up failed: {g.dead or exc}") from exc
    log.info("tensor parallel: %d ranks over %s (followers: pids %s)", world, _backend(device),
             ", ".join(str(p.pid) for p in g.procs))
    return g


def _follower_main(rank: int, world: int, init: str, recipe: tuple, config, conn: Connection,
                   timeout_s: float, threads: int, build: Callable) -> None:
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 decides when the group stops
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s %(levelname)s tp-rank{rank} %(name)s: %(message)s")
    code = 0
    try:
        if threads:
            torch.set_num_threads(threads)
        if str(config.device).startswith("cuda"):
            torch.cuda.set_device(rank)
            config = replace(config, device=f"cuda:{rank}")
        dist.init_process_group(_backend(config.device), init_method=init, rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s))
        g = TPGroup(rank, world)
        g.conns = [conn]
        build(recipe, config, g).follow()
    except BaseException:  # noqa: BLE001 - rank 0 sees the exit status
        log.exception("tensor-parallel rank %d failed", rank)
        code = 1
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass
    os._exit(code)
