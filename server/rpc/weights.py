"""UpdateWeights: a hosted model's weights replaced in place (``engine/weights.py`` does
the rebuild and the swap).  Each data message's bytes go, off the event loop, to the
executor's upload (``engine/weights_file.py``: hashed, parsed and checked as they come)
while the next message is read; the trailer's checksum is compared at the end, the new
model is built off the worker too (forwards go on), and only the swap runs on the
model's worker.  One update at a time per model; admin tenants only (when tokens are on)."""

from __future__ import annotations

import asyncio
import threading

from ferrum_rpc.errors import InvalidInput, TransferCorrupted
from ferrum_rpc.v1 import executor_pb2 as pb
from ..engine.facade import weights
from .gate import Gate
from .handler import Malformed, handler
from .migration import ImportReads

class WeightsRpcs:
    """UpdateWeights, a part of the servicer: one update at a time per model."""

    def __init__(self, gate: Gate, import_idle_s: float):
        self.gate, self.import_idle_s = gate, import_idle_s
        self._updating: dict[str, asyncio.Lock] = {}  # model name -> the lock its update holds

    @handler(admin=True)
    async def UpdateWeights(self, request_iterator, context, tenant: str):
        messages, reads = aiter(request_iterator), ImportReads(self.import_idle_s)
        first = await reads.next(messages)
        if isinstance(first, Malformed):
            raise InvalidInput(first.why)
        if first is None or isinstance(first, memoryview) or first.WhichOneof("part") != "header":
            raise InvalidInput("an UpdateWeights stream starts with its header")
        header = first.header
        worker = self.gate.worker(header.model)
        executor = worker.executor
        if not 0 < header.total_bytes <= executor.weights.limit_bytes:
            raise InvalidInput(f"total_bytes {header.total_bytes}: an update of this model is 1 to "
                               f"{executor.weights.limit_bytes} bytes (its checkpoint and a header)")
        lock = self._updating.setdefault(header.model or "", asyncio.Lock())
        loop = asyncio.get_running_loop()
        async with lock:  # the upload's arrays are held by one update at a time
            upload = executor.weights.upload(header.total_bytes)
            adding = None  # the last message's bytes being added (hashlib and numpy let go of the GIL)
            try:
                while True:
                    message = await reads.next(messages)
                    if isinstance(message, Malformed):
                        raise InvalidInput(message.why)
                    if adding is not None:
                        await adding
                    part = "data" if isinstance(message, memoryview) else \
                        message.WhichOneof("part") if message is not None else None
                    if part == "data":
                        adding = loop.run_in_executor(None, upload.add, message)
                    elif part == "trailer":
                        break
                    else:
                        raise TransferCorrupted("the stream ended before its trailer" if part is None
                                                else "a second header in an UpdateWeights stream")
                tensors = await loop.run_in_executor(None, upload.finish, message.trailer.checksum)
            finally:
                if adding is not None and not adding.done():  # its failure, if any, is this call's no more
                    adding.add_done_callback(lambda f: f.cancelled() or f.exception())
            del upload
            gone = threading.Event()
            # the new model built beside the serving one, off the worker (forwards go on)
            build = loop.run_in_executor(None, weights.build, executor, tensors)
            try:
                built = await asyncio.shield(build)
                done = await worker.front.call(weights.update, executor, tensors, message.trailer.checksum,
                                         header.invalidate_sequences, gone.is_set, built)
            except asyncio.CancelledError:
                gone.set()  # a rebuild under way is not swapped in
                # the lock is held until a cancelled build's thread lets its model go, so a
                # next update never builds a third copy of the weights beside it
                await asyncio.wait({build})
                raise
        return pb.UpdateWeightsResponse(**done)
