"""Replies with results: logits, chosen tokens, handles and timing into protobuf.

Large replies are built and serialized on one reply-builder thread, a bounded slice
at a time, so the event loop keeps answering everyone else meanwhile; FULL logits
go into the reply, or into the caller's shared-memory region when its policy names
one (checked and pinned before the call runs, so the write after it cannot fail)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from concurrent.futures import ThreadPoolExecutor

from ferrum_rpc import convert
from ferrum_rpc.rules import check_shared_memory_offset
from ferrum_rpc.types import ChosenToken, LogitsPolicy
from .ledger import Undelivered
from .shm import SharedMemoryRegistry
from ..engine.facade import ModelWorker, Undo

LARGE_REPLY_BYTES = 1 << 20  # replies at least this large are built off the event loop


def _payload_bytes(logits) -> int:
    if logits is None:  # a chosen token only
        return 0
    values = logits.values
    size = values.numel() * values.element_size() if hasattr(values, "numel") else values.nbytes
    return size + (logits.token_ids.size * 5 if logits.token_ids is not None else 0)


class Replies:
    def __init__(self, shm: SharedMemoryRegistry):
        self._shm = shm
        # One thread: big replies are built one at a time, never on the event loop.
        self._reply_builder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reply-builder")

    @contextlib.contextmanager
    def logits_targets(self, policy: LogitsPolicy, rows: list[int], worker: ModelWorker, tenant: str):
        """Where each output's full logits go when ``policy`` names a shared-memory
        region: one ``(region, offset)`` per output, rows packed one after another.
        Everything is checked, and the region pinned, before the call runs: the
        write after it cannot fail.  Without shared memory every output's target is None."""
        if policy is None or policy.shared_memory is None:
            yield [None] * len(rows)
            return
        target = policy.shared_memory
        region = self._shm.get(tenant, target.region)  # another tenant's region: "not found"
        check_shared_memory_offset(policy)
        element = 4 if policy.dtype == "float32" else 2
        row_bytes = worker.executor.model_config.vocab_size * element
        offsets = [target.offset + row_bytes * before for before in itertools.accumulate(rows, initial=0)]
        region.check(target.offset, offsets[-1] - target.offset)
        region.pin()
        try:
            yield [(region, offset) for offset in offsets[:-1]]
        finally:
            region.unpin()

    async def step_replies(self, cls, fields: dict, outs, received_ns: int, single: bool, targets: list,
                            keys: list[int]):
        """A decode step's replies (``cls`` with ``fields``): one message per sequence,
        tagged with its index, or with ``single`` one message whose ``results`` hold all;
        each with the ledger keys (see ``Undelivered``) of the results it carries."""
        if single:
            reply = cls(**fields)
            for index, out in enumerate(outs):
                self.result(reply.results.add(index=index, **fields), out, received_ns, targets[index])
            yield keys, reply
            return
        for index, out in enumerate(outs):
            yield keys[index:index + 1], await self.reply(cls(index=index, **fields), out, received_ns,
                                                           target=targets[index])

    @staticmethod
    def register_decodes(ledger: Undelivered, worker: ModelWorker, undo: list[Undo]) -> list[int]:
        """One ledger entry per decoded sequence (``undo``: a decode's records, one an input)."""
        return [ledger.add(worker, [record]) for record in undo]

    @staticmethod
    def result(message, out, received_ns: int, target=None):
        """Fills a reply's logits, handle and timing in place (large logits are copied once,
        into the reply or into shared memory)."""
        if out.logits is not None:
            convert.fill_logits(message.logits, out.logits, target)
        if isinstance(getattr(out, "chosen", None), ChosenToken):  # SpeculativeOutput's is a tuple
            message.chosen.CopyFrom(convert.chosen_to_proto(out.chosen))
        message.kv_cache.CopyFrom(convert.handle_to_proto(out.kv_cache))
        message.timing.CopyFrom(convert.timing_to_proto(out.timing))
        message.timing.total_ns = time.perf_counter_ns() - received_ns
        return message

    async def reply(self, message, out, received_ns: int, worker: ModelWorker | None = None,
                     undo: list[Undo] = (), target=None):
        """:meth:`result`, built and serialized on the reply-builder thread when large.

        If the caller goes away while a large reply is being built, ``undo``
        (see ``Undo``) is applied on ``worker``: nobody will ever hold the handle
        this reply carries."""
        if _payload_bytes(out.logits) < LARGE_REPLY_BYTES:
            return self.result(message, out, received_ns, target)

        def build() -> bytes:
            try:
                return self.result(message, out, received_ns, target).SerializeToString()
            finally:
                if target is not None:
                    target[0].unpin()

        if target is not None:  # the builder's own pin: a cancelled await must not release the region under it
            target[0].hold()
        job = self._reply_builder.submit(build)
        try:
            return await asyncio.wrap_future(job)
        except asyncio.CancelledError:
            # a build that never started never runs its finally: its pin is given back here
            # (cancel() is False once it runs; then its finally does it)
            if job.cancel() and target is not None:
                target[0].unpin()
            if worker is not None and undo:
                worker.undo(list(undo), "a reply whose caller went away while it was built")
            raise
