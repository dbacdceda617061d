"""LoRA adapters on a hosted model, the executor's side: loading and unloading them
by name (on the worker thread, between forwards), giving a new sequence its adapter,
and each forward's adapter slot per sequence (``models/lora.py`` does the arithmetic).

An adapter's users are its live sequences, counted when it matters (a load that may
evict, an unload): an adapter with live sequences is never evicted, unloaded or
replaced, so the slot a sequence's forward names does not change under it."""

from __future__ import annotations

import collections
import json
import logging
import math
import re
import time
from pathlib import Path
from typing import Callable

from ferrum_rpc.errors import (AdapterInUse, AdapterInvalid, AdapterLimitExceeded, AdapterNotFound, Cancelled,
                               ExecutorError, StartupError)
from ..kv.blocks import SequenceState
from ..models.lora import BASE, AdapterSet
from ..models.lora_read import AdapterError

log = logging.getLogger(__name__)

ADAPTER_NAME = re.compile(r"[A-Za-z0-9._-]{1,128}")
EVICTED_SHOWN = 64  # ListAdapters' evicted names, newest last


class HostsAdapters:
    """Mixed into :class:`~.executor.TorchExecutor` (its ``model``, ``config``, ``kv``, ``name``)."""

    adapters: AdapterSet | None = None

    def open_adapters(self) -> None:
        """Makes the model's adapter set (--max-adapters; none with tensor parallelism)
        and loads the start-up ones (--lora)."""
        cfg = self.config
        if not cfg.max_adapters:
            return
        self.adapter_scaling: dict[str, float] = {}
        self.adapters = AdapterSet(self.model, cfg.max_adapters, cfg.max_lora_rank,
                                   cfg.adapter_memory_mb * 2**20 if cfg.adapter_memory_mb else None)
        for name, path in cfg.loras:
            try:
                self.load_adapter(name, path)
            except ExecutorError as exc:  # start-up: one line, exit 2
                raise StartupError(f"--lora {name}={path}: {exc}") from None

    def _adapter_set(self) -> AdapterSet:
        if self.adapters is None:
            raise AdapterNotFound(f"model {self.name!r} serves no LoRA adapters (--max-adapters 0"
                                  f"{' or tensor parallelism' if self.config.tensor_parallel > 1 else ''})")
        return self.adapters

    def _count_users(self) -> None:
        """Each adapter's users: its live sequences (worker thread)."""
        users = collections.Counter(seq.adapter for seq in self.kv.sequences() if seq.adapter)
        for adapter in self.adapters.by_name.values():
            adapter.refs = users.get(adapter.name, 0)

    def load_adapter(self, name: str, path: str, replace: bool = False,
                     gone: Callable[[], bool] = lambda: False) -> dict:
        """Loads (or, with ``replace``, reloads) adapter ``name`` from ``path``; returns its entry.
        ``gone()``: the caller went away; a new adapter read meanwhile is dropped again (a
        replaced one's new weights stand: the old ones are gone)."""
        adapters = self._adapter_set()
        if not ADAPTER_NAME.fullmatch(name or ""):
            raise AdapterInvalid(f"name: an adapter name is 1 to 128 bytes of [A-Za-z0-9._-], got {name[:40]!r}")
        self._count_users()
        held = adapters.by_name.get(name)
        if held is not None and not replace:
            raise AdapterInvalid(f"name: adapter {name!r} is loaded already (set replace to reload it)")
        if held is not None and held.refs:
            raise AdapterInUse(f"adapter {name!r} has {held.refs} live sequences: it cannot be replaced under them")
        if gone():
            raise Cancelled("the caller cancelled the load")
        start = time.perf_counter()
        try:
            adapters.add(name, path, replace=replace)
        except AdapterError as exc:
            if exc.field in ("max_adapters", "max_bytes"):
                raise AdapterLimitExceeded(str(exc)) from None
            raise AdapterInvalid(str(exc)) from None
        except OSError as exc:
            raise AdapterInvalid(f"path: cannot read the adapter folder: {exc.strerror or exc}") from None
        if gone() and held is None:
            adapters.remove(name)
            raise Cancelled("the caller cancelled the load; the adapter was dropped again")
        self.kv.events.resync_all()  # the watchers' hellos name the adapters' roots (and one may be evicted)
        self.adapter_scaling[name] = _scaling(path)
        return self.adapter_entry(name, load_s=time.perf_counter() - start)

    def unload_adapter(self, name: str) -> None:
        adapters = self._adapter_set()
        if name not in adapters.by_name:
            raise AdapterNotFound(f"model {self.name!r} holds no adapter {name[:128]!r}")
        self._count_users()
        if users := adapters.by_name[name].refs:
            raise AdapterInUse(f"adapter {name!r} has {users} live sequences: release them first")
        adapters.remove(name)
        self.kv.events.resync_all()

    def adapter_digests(self) -> dict[str, str]:
        """Each loaded adapter's content digest, by name (the roots of its KV chains)."""
        return {} if self.adapters is None else {a.name: a.digest for a in self.adapters.by_name.values()}

    def adapter_entry(self, name: str, load_s: float = 0.0) -> dict:
        a = self.adapters.by_name[name]
        return {"name": a.name, "path": a.path, "rank": a.rank, "scaling": self.adapter_scaling.get(name, 0.0),
                "target_modules": list(a.modules), "bytes": a.nbytes, "sequences": a.refs, "load_s": load_s,
                "digest": a.digest}

    def adapter_entries(self) -> tuple[list[dict], list[str]]:
        """Every loaded adapter's entry (slot order) and the names evicted lately."""
        if self.adapters is None:
            return [], []
        self._count_users()
        return ([self.adapter_entry(a.name) for a in sorted(self.adapters.by_name.values(), key=lambda a: a.slot)],
                self.adapters.evicted[-EVICTED_SHOWN:])

    def adapter_for_new_sequence(self, adapter: str) -> tuple[str, str]:
        """The (name, content digest) a new sequence running ``adapter`` records; ("", "") for the base."""
        if not adapter:
            return "", ""
        adapters = self._adapter_set()
        held = adapters.by_name.get(adapter)
        if held is None:
            raise AdapterNotFound(f"model {self.name!r} holds no adapter {adapter[:128]!r} (ListAdapters)")
        adapters.touch(adapter)
        return held.name, held.digest

    def adapter_slot(self, seq: SequenceState) -> int:
        """The slot a forward runs ``seq`` with (BASE: no adapter)."""
        return self.adapters.slot(seq.adapter) if seq.adapter else BASE


def _scaling(path: str) -> float:
    """The adapter's scaling as its config states it (lora_alpha / r, or / sqrt(r) with
    use_rslora; a module of rank_pattern or alpha_pattern may differ)."""
    config = json.loads((Path(path) / "adapter_config.json").read_text())
    rank = config["r"]
    return config["lora_alpha"] / (math.sqrt(rank) if config.get("use_rslora") else rank)
