"""WatchKvEvents: a tenant's prefix-cache blocks as they are stored and removed, streamed
to KV-aware routers (``kv/events.py`` holds the hub)."""

from __future__ import annotations

import asyncio

import grpc

from ferrum_rpc.errors import Draining, ExecutorError
from ferrum_rpc.types import ServerState
from ferrum_rpc.v1 import executor_pb2 as pb
from ..engine.facade import KvWatch, Removed, Stored, Subscriber
from .gate import Gate
from .handler import query


def _kv_block(block: Stored) -> pb.KvBlock:
    return pb.KvBlock(block_hash=block.digest, parent_hash=block.parent, token_ids=block.tokens)


def _kv_event(number: int, event) -> pb.KvEvent:
    if isinstance(event, Stored):
        return pb.KvEvent(sequence=number, stored=_kv_block(event))
    if isinstance(event, Removed):
        return pb.KvEvent(sequence=number, removed=event.digest)
    return pb.KvEvent(sequence=number, all_cleared=True)


class KvEventRpcs:
    """WatchKvEvents, a part of the servicer, and the streams it has open."""

    def __init__(self, gate: Gate):
        self.gate = gate
        self.watches: set[Subscriber] = set()  # open WatchKvEvents streams

    @query  # not admitted: a watch lasts as long as its caller, and draining must not wait for it
    async def WatchKvEvents(self, request, context, tenant: str):
        """The caller's tenant's prefix-cache blocks as they are stored and removed
        (``kv/events.py``), until the caller goes or the model unloads."""
        worker = self.gate.worker(request.model)
        watch = KvWatch(worker.executor)
        if not watch.prefix_caching:
            raise ExecutorError(f"model {worker.executor.name!r} serves with prefix caching off: it caches no blocks "
                                f"to tell of", code=grpc.StatusCode.UNIMPLEMENTED)
        if self.gate.state is ServerState.DRAINING:
            raise Draining("the server is draining: watch another replica")
        hub = watch.hub
        sub = Subscriber(tenant, asyncio.get_running_loop())
        self.watches.add(sub)

        def hello(snapshot: bool) -> pb.KvEventsHello:  # on the worker thread, between forwards
            h = watch.hello(sub, tenant, snapshot)
            return pb.KvEventsHello(chain_root=h.chain_root, adapter_roots=h.adapter_roots, block_size=h.block_size,
                                    model=h.model, queue_limit=h.queue_limit, next_sequence=h.next_sequence,
                                    cached=[_kv_block(b) for b in h.cached])
        try:
            yield pb.KvEventBatch(hello=await worker.front.call(hello, request.snapshot))
            while True:
                await sub.wake.wait()
                events, behind, closed = hub.take(sub)
                if behind:
                    yield pb.KvEventBatch(resync=True, hello=await worker.front.call(hello, True))
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
