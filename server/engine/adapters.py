"""LoRA adapters on a hosted model, the executor's side: loading and unloading them
by name, giving a new sequence its adapter, and each forward's adapter slot per
sequence (``models/lora.py`` does the arithmetic).

A load reads, checks and arranges the adapter's tensors off the worker
(``Lora.build``, on a thread of its own that yields to the forwards:
``build_thread_init``); only putting it in a slot runs on the worker, between
forwards (``Lora.load``): a dict insert.  A build that fails or whose caller went
away changes nothing.

An adapter's users are its live sequences, counted when it matters (a load that may
evict, an unload): an adapter with live sequences is never evicted, unloaded or
replaced, so the slot a sequence's forward names does not change under it."""

from __future__ import annotations

import collections
import contextlib
import ctypes
import logging
import os
import re
import threading
import time
from typing import Callable

import torch

from ferrum_rpc.errors import (AdapterInUse, AdapterInvalid, AdapterLimitExceeded, AdapterNotFound, Cancelled,
                               ExecutorError, StartupError)
from ..kv.blocks import BlockManager
from ..models.lora import AdapterSet, BuiltAdapter
from ..models.lora_read import AdapterError

log = logging.getLogger(__name__)

ADAPTER_NAME = re.compile(r"[A-Za-z0-9._-]{1,128}")
EVICTED_SHOWN = 64  # ListAdapters' evicted names, newest last


class Lora:
    """The LoRA adapters one executor hosts: the model's adapter set (``set``; None
    without --max-adapters or with tensor parallelism), each one's scaling, and the
    block manager whose live sequences are their users."""

    def __init__(self, model, config, kv: BlockManager, name: str, enabled: bool = True):
        self.config, self.kv, self.name = config, kv, name
        self.scaling: dict[str, float] = {}
        self.set: AdapterSet | None = None
        if enabled and config.max_adapters:
            self.set = AdapterSet(model, config.max_adapters, config.max_lora_rank,
                                  config.adapter_memory_mb * 2**20 if config.adapter_memory_mb else None)

    def load_startup(self) -> None:
        """Loads the start-up adapters (--lora)."""
        if self.set is None:
            return
        for name, path in self.config.loras:
            try:
                self.load(name, path)
            except ExecutorError as exc:  # start-up: one line, exit 2
                raise StartupError(f"--lora {name}={path}: {exc}") from None

    def _held_set(self) -> AdapterSet:
        if self.set is None:
            raise AdapterNotFound(f"model {self.name!r} serves no LoRA adapters (--max-adapters 0"
                                  f"{' or tensor parallelism' if self.config.tensor_parallel > 1 else ''})")
        return self.set

    def _count_users(self) -> None:
        """Each adapter's users: its live sequences (worker thread)."""
        users = collections.Counter(seq.adapter for seq in self.kv.sequences() if seq.adapter)
        for adapter in self.set.by_name.values():
            adapter.refs = users.get(adapter.name, 0)

    def build(self, name: str, path: str, replace: bool = False) -> tuple[BuiltAdapter, float]:
        """Adapter ``name`` read from ``path`` (inside --adapter-root when set), checked and
        arranged for the forward, on the calling thread (any but the worker: nothing the
        forwards read changes), with the seconds that took; ``load`` installs it."""
        adapters = self._held_set()
        _check_name(name)
        start = time.perf_counter()
        with _refusals():
            built = adapters.build(name, path, replace, self.config.adapter_root or None)
        return built, time.perf_counter() - start

    def load(self, name: str, path: str, replace: bool = False,
                     gone: Callable[[], bool] = lambda: False,
                     built: tuple[BuiltAdapter, float] | None = None) -> dict:
        """Loads (or, with ``replace``, reloads) adapter ``name``; returns its entry.  Installs
        what ``build`` made (``built``) or, without it, builds it here first
        (start-up).  Worker thread, between forwards.  ``gone()``: the caller went away;
        then nothing changes."""
        adapters = self._held_set()
        _check_name(name)
        self._count_users()
        held = adapters.by_name.get(name)
        if held is not None and not replace:
            raise AdapterInvalid(f"name: adapter {name!r} is loaded already (set replace to reload it)")
        if held is not None and held.refs:
            raise AdapterInUse(f"adapter {name!r} has {held.refs} live sequences: it cannot be replaced under them")
        if gone():
            raise Cancelled("the caller cancelled the load")
        adapter, build_s = built if built is not None else self.build(name, path, replace)
        if gone():
            raise Cancelled("the caller cancelled the load; nothing was loaded")
        start = time.perf_counter()
        with _refusals():
            adapters.install(name, adapter, replace=replace)
        self.kv.events.resync_all()  # the watchers' hellos name the adapters' roots (and one may be evicted)
        self.scaling[name] = adapter.read.scaling
        return self.entry(name, load_s=build_s + time.perf_counter() - start)

    def unload(self, name: str) -> None:
        adapters = self._held_set()
        if name not in adapters.by_name:
            raise AdapterNotFound(f"model {self.name!r} holds no adapter {name[:128]!r}")
        self._count_users()
        if users := adapters.by_name[name].refs:
            raise AdapterInUse(f"adapter {name!r} has {users} live sequences: release them first")
        adapters.remove(name)
        self.kv.events.resync_all()

    def digests(self) -> dict[str, str]:
        """Each loaded adapter's content digest, by name (the roots of its KV chains)."""
        return {} if self.set is None else {a.name: a.digest for a in self.set.by_name.values()}

    def entry(self, name: str, load_s: float = 0.0) -> dict:
        a = self.set.by_name[name]
        return {"name": a.name, "path": a.path, "rank": a.rank, "scaling": self.scaling.get(name, 0.0),
                "target_modules": list(a.modules), "bytes": a.nbytes, "sequences": a.refs, "load_s": load_s,
                "digest": a.digest}

    def entries(self, tenant: str | None = None) -> tuple[list[dict], list[str]]:
        """Every loaded adapter's entry (slot order) and the names evicted lately.  With
        ``tenant`` (a caller who is no admin): each adapter's name, rank and modules only,
        and the live sequences of that tenant alone."""
        if self.set is None:
            return [], []
        self._count_users()
        held = sorted(self.set.by_name.values(), key=lambda a: a.slot)
        evicted = self.set.evicted[-EVICTED_SHOWN:]
        if tenant is None:
            return [self.entry(a.name) for a in held], evicted
        own = collections.Counter(seq.adapter for seq in self.kv.sequences() if seq.adapter and seq.tenant == tenant)
        return [{"name": a.name, "rank": a.rank, "target_modules": list(a.modules), "sequences": own[a.name]}
                for a in held], evicted

    def for_new_sequence(self, adapter: str) -> tuple[str, str]:
        """The (name, content digest) a new sequence running ``adapter`` records; ("", "") for the base."""
        if not adapter:
            return "", ""
        adapters = self._held_set()
        held = adapters.by_name.get(adapter)
        if held is None:
            raise AdapterNotFound(f"model {self.name!r} holds no adapter {adapter[:128]!r} (ListAdapters)")
        adapters.touch(adapter)
        return held.name, held.digest


def _check_name(name: str) -> None:
    if not ADAPTER_NAME.fullmatch(name or ""):
        raise AdapterInvalid(f"name: an adapter name is 1 to 128 bytes of [A-Za-z0-9._-], got {name[:40]!r}")


@contextlib.contextmanager
def _refusals():
    """The reader's and the set's refusals as the contract's errors."""
    try:
        yield
    except AdapterError as exc:
        if exc.field in ("max_adapters", "max_bytes"):
            raise AdapterLimitExceeded(str(exc)) from None
        raise AdapterInvalid(str(exc)) from None
    except OSError as exc:
        raise AdapterInvalid(f"path: cannot read the adapter folder: {exc.strerror or type(exc).__name__}") from None


def build_thread_init() -> None:
    """Runs first on the thread that builds adapters beside the forwards.  It takes the
    lowest CPU priority, for this thread alone (Linux's nice value is per thread), so
    the worker's forwards keep the cores; and its torch ops run on one OpenMP thread:
    a second OpenMP team beside the worker's would make libgomp, once it manages more
    threads than there are CPUs, stop spinning between parallel regions in every team,
    the worker's included."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    torch.get_num_threads()  # ATen's per-thread OpenMP setup runs now, not after the change below
    library = _openmp_library()
    if library is not None:
        library.omp_set_num_threads(1)  # the calling thread's own setting (an OpenMP ICV per thread)
    if torch.get_num_threads() != 1:
        log.info("the adapter builder's torch ops run on %d threads (no OpenMP library found to set)",
                 torch.get_num_threads())


def _openmp_library() -> ctypes.CDLL | None:
    """The OpenMP runtime this process has loaded (torch's), or None."""
    try:
        maps = open("/proc/self/maps").read()
    except OSError:
        return None
    for line in maps.splitlines():
        path = line.split(maxsplit=5)[-1] if len(line.split(maxsplit=5)) == 6 else ""
        if re.search(r"/lib(gomp|iomp5|omp)[^/]*\.so", path):
            try:
                return ctypes.CDLL(path)
            except OSError:
                return None
    return None
