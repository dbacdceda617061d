"""What the rpc layer may use of the engine, and through it of the layers below: the
one door rpc imports (the layer test holds it to this module).  Names are re-exported
from where they live, each imported when first asked for (PEP 562), so an rpc module
that needs only torch-free names (the undo record, KV events) imports no torch;
``KvWatch`` is the engine's side of WatchKvEvents, so rpc reads no block manager."""

from __future__ import annotations

from dataclasses import dataclass

import importlib
from typing import TYPE_CHECKING

from ferrum_rpc import hashing
from ..kv.events import KvEventHub, Removed, Stored, Subscriber

if TYPE_CHECKING:
    from . import transfer, weights
    from .adapters import build_thread_init
    from .ahead import QUEUED_FORWARDS, AheadRun, Emitted, Finish
    from .undo import Undo
    from .worker import ModelWorker

_LAZY = {"transfer": (".transfer", None), "weights": (".weights", None), "QUEUED_FORWARDS": (".ahead", "QUEUED_FORWARDS"),
         "AheadRun": (".ahead", "AheadRun"), "Emitted": (".ahead", "Emitted"), "Finish": (".ahead", "Finish"),
         "Undo": (".undo", "Undo"), "ModelWorker": (".worker", "ModelWorker"),
         "build_thread_init": (".adapters", "build_thread_init")}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attr = _LAZY[name]
    loaded = importlib.import_module(module, __package__)
    return loaded if attr is None else getattr(loaded, attr)

__all__ = ["QUEUED_FORWARDS", "AheadRun", "Emitted", "Finish", "KvHello", "KvWatch", "ModelWorker", "Removed",
           "Stored", "Subscriber", "Undo", "build_thread_init", "transfer", "weights"]


@dataclass(frozen=True)
class KvHello:
    """What a watcher is told first: where its chains start and what is cached now."""

    chain_root: bytes
    adapter_roots: dict[str, bytes]
    block_size: int
    model: str
    queue_limit: int
    next_sequence: int
    cached: list[Stored]


class KvWatch:
    """One model's KV events for one tenant's watcher (``kv/events.py`` holds the hub)."""

    def __init__(self, executor):
        self.executor, self.kv = executor, executor.kv

    @property
    def prefix_caching(self) -> bool:
        return self.kv.prefix_caching

    @property
    def hub(self) -> KvEventHub:
        return self.kv.events

    def hello(self, sub: Subscriber, tenant: str, snapshot: bool) -> KvHello:
        """Subscribes ``sub`` (worker thread, between forwards, so no event is missed or
        told twice) and returns its hello, with the tenant's cached blocks if ``snapshot``."""
        kv = self.kv
        first, blocks = self.hub.subscribe(sub, lambda: kv.cached_blocks(tenant) if snapshot else [])
        roots = {name: hashing.chain_root(tenant, digest, kv.generation)
                 for name, digest in self.executor.lora.digests().items()}
        return KvHello(hashing.chain_root(tenant, "", kv.generation), roots, kv.block_size, self.executor.name,
                       self.hub.queue_limit, first, blocks)
