"""WatchKvEvents: a tenant's prefix-cache blocks as they are stored and removed, streamed
to KV-aware routers (``kv/events.py`` holds the hub).  A mixin of the servicer: reads
its ``_worker``, ``state`` and ``watches``."""

from __future__ import annotations

import asyncio

import grpc

from ferrum_rpc import hashing
from ferrum_rpc.errors import Draining, ExecutorError
from ferrum_rpc.types import ServerState
from ferrum_rpc.v1 import executor_pb2 as pb
from ..kv import events as kv_events
from .handler import query


def _kv_block(block: kv_events.Stored) -> pb.KvBlock:
    return pb.KvBlock(block_hash=block.digest, parent_hash=block.parent, token_ids=block.tokens)


def _kv_event(number: int, event) -> pb.KvEvent:
    if isinstance(event, kv_events.Stored):
        return pb.KvEvent(sequence=number, stored=_kv_block(event))
    if isinstance(event, kv_events.Removed):
        return pb.KvEvent(sequence=number, removed=event.digest)
    return pb.KvEvent(sequence=number, all_cleared=True)


class KvEventRpcs:
    @query  # not admitted: a watch lasts as long as its caller, and draining must not wait for it
    async def WatchKvEvents(self, request, context, tenant: str):
        """The caller's tenant's prefix-cache blocks as they are stored and removed
        (``kv_events.py``), until the caller goes or the model unloads."""
        worker = self._worker(request.model)
        kv = worker.executor.kv
        if not kv.prefix_caching:
            raise ExecutorError(f"model {worker.executor.name!r} serves with prefix caching off: it caches no blocks "
                                f"to tell of", code=grpc.StatusCode.UNIMPLEMENTED)
        if self.state is ServerState.DRAINING:
            raise Draining("the server is draining: watch another replica")
        hub = kv.events
        sub = kv_events.Subscriber(tenant, asyncio.get_running_loop())
        self.watches.add(sub)

        def hello(snapshot: bool) -> pb.KvEventsHello:  # on the worker thread, between forwards
            first, blocks = hub.subscribe(sub, lambda: kv.cached_blocks(tenant) if snapshot else [])
            return pb.KvEventsHello(chain_root=hashing.chain_root(tenant, "", kv.generation),
                                    adapter_roots={name: hashing.chain_root(tenant, digest, kv.generation)
                                                   for name, digest in worker.executor.adapter_digests().items()},
                                    block_size=kv.block_size,
                                    model=worker.executor.name, queue_limit=hub.queue_limit, next_sequence=first,
                                    cached=[_kv_block(b) for b in blocks])
        try:
            yield pb.KvEventBatch(hello=await worker.call(hello, request.snapshot))
            while True:
                await sub.wake.wait()
                events, behind, closed = hub.take(sub)
                if behind:
                    yield pb.KvEventBatch(resync=True, hello=await worker.call(hello, True))
                    continue
                if events:
                    yield pb.KvEventBatch(events=[_kv_event(n, e) for n, e in events])
                if closed:
                    return
        finally:
            hub.unsubscribe(sub)
            self.watches.discard(sub)

    def end_watches(self) -> None:
        """Ends every WatchKvEvents stream (draining: its subscribers go elsewhere)."""
        for sub in self.watches:
            sub.closed = True
            sub.wake.set()
