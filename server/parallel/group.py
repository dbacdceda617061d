"""A tensor-parallel group's processes: joining through torch.distributed's TCP
rendezvous, launching the other ranks on this machine, rank 0's watchdog, and
failing closed when a rank is lost."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import socket
import threading
import time
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from ferrum_rpc.errors import RankLost

log = logging.getLogger(__name__)

IDLE_TIMEOUT = timedelta(days=365)  # ranks wait for the next plan without end; rank 0's watchdog bounds a forward


# -- failing closed -----------------------------------------------------------------------
@dataclass
class _Lost:
    error: RankLost | None = None
    callbacks: list = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


LOST = _Lost()


def fail(why: str) -> None:
    """Marks the group lost (once) and tells whoever listens (the app: stop serving, exit)."""
    with LOST.lock:
        if LOST.error is not None:
            return
        LOST.error = RankLost(why)
        callbacks = list(LOST.callbacks)
    log.error("tensor parallelism lost: %s", why)
    for callback in callbacks:
        with contextlib.suppress(Exception):  # e.g. an event loop already closed
            callback(LOST.error)


def on_lost(callback) -> None:
    """Calls ``callback(RankLost)`` once the group is lost (at once if it is already)."""
    with LOST.lock:
        LOST.callbacks.append(callback)
        error = LOST.error
    if error is not None:
        callback(error)


class Watchdog(threading.Thread):
    """Rank 0's guard: a local rank process that exits, or a forward running past
    ``timeout_s`` (a rank that hangs), fails the group (see :func:`fail`)."""

    POLL_S = 0.1

    def __init__(self, procs: list, timeout_s: float):
        super().__init__(name="tp-watchdog", daemon=True)
        self.procs, self.timeout_s = procs, timeout_s
        self.runner = None  # rank 0's runner.Runner, once it has one

    def run(self) -> None:
        while LOST.error is None:
            for rank, proc in enumerate(self.procs, 1):
                if not proc.is_alive():
                    fail(f"rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}")
                    return
            since = self.runner.busy_since if self.runner else None
            if since is not None and time.monotonic() - since > self.timeout_s:
                fail(f"a forward has waited {self.timeout_s:g} s for the other ranks (a rank hangs)")
                return
            time.sleep(self.POLL_S)


# -- processes -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Group:
    """How this process joins: its rank, the degree, where rank 0 listens."""

    rank: int
    degree: int
    master: str  # host:port of torch.distributed's TCP rendezvous
    timeout_s: float = 30.0  # the longest rank 0 waits for the others in one forward

    def backend(self, device: str) -> str:
        return "nccl" if device.startswith("cuda") else "gloo"

    def device(self, device: str) -> torch.device:
        """CUDA: one device per local rank (LOCAL_RANK, as torchrun sets it, else the rank)."""
        if not device.startswith("cuda"):
            return torch.device(device)
        local = int(os.environ.get("LOCAL_RANK", self.rank))
        return torch.device("cuda", local % max(torch.cuda.device_count(), 1))


CURRENT: dict[str, object] = {}  # "group", "watchdog", "procs" in this process once joined


def join(group: Group, device: str) -> None:
    """Joins the process group through torch.distributed's TCP rendezvous."""
    if group.device(device).type == "cuda":
        torch.cuda.set_device(group.device(device))
    dist.init_process_group(group.backend(device), init_method=f"tcp://{group.master}", rank=group.rank,
                            world_size=group.degree, timeout=IDLE_TIMEOUT)
    CURRENT["group"] = group
    log.info("rank %d of %d joined (%s, rendezvous %s)", group.rank, group.degree, group.backend(device),
             group.master)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_local(group: Group, rank_main: Callable, model_path: str, executor_config, threads: int = 0) -> None:
    """Rank 0 on one machine: spawns ranks 1..N-1 running ``rank_main`` (they die with
    this process), joins the group with them and starts the watchdog."""
    ctx = multiprocessing.get_context("spawn")
    procs = []
    for rank in range(1, group.degree):
        proc = ctx.Process(target=rank_main, args=(replace(group, rank=rank), model_path, executor_config,
                                                   logging.getLogger().level, os.getpid(), threads),
                           name=f"ferrum-rpc-rank-{rank}", daemon=True)
        proc.start()
        procs.append(proc)
    CURRENT["procs"] = procs
    join(group, executor_config.device)
    watchdog = Watchdog(procs, group.timeout_s)
    CURRENT["watchdog"] = watchdog
    watchdog.start()


def start_remote_watchdog(group: Group) -> None:
    """Rank 0 whose ranks run elsewhere: only the hang guard (a dead remote rank ends
    rank 0's next collective with an error, which fails the group)."""
    watchdog = Watchdog([], group.timeout_s)
    CURRENT["watchdog"] = watchdog
    watchdog.start()


def shutdown() -> None:
    """Rank 0's normal exit (the worker has stopped): tells the ranks to stop and waits a
    little for them."""
    if (runner := CURRENT.get("runner")) is not None:
        runner.stop()
        forwards, shard = max(runner.forwards, 1), runner.shard
        log.info("tensor parallel: %d forwards, %.2f ms a forward in all-reduces, %.2f ms in the LM head's "
                 "reduction, %.0f bytes a forward gathered by the LM head, %d token-choice rows on whole rows",
                 runner.forwards, shard.allreduce_ns / 1e6 / forwards, shard.gather_ns / 1e6 / forwards,
                 shard.lm_head_bytes / forwards, shard.choice_fallback_rows)
    for proc in CURRENT.get("procs", ()):
        proc.join(5)
        if proc.is_alive():
            proc.kill()
    # Before the interpreter exits: left to static destructors, the rendezvous store's
    # thread was destroyed still running about one exit in five ("terminate called
    # without an active exception", SIGABRT, exit status -6 after a clean drain).
    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
