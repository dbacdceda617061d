"""UpdateWeights: a hosted model's weights replaced in place (``engine/weights.py`` does
the rebuild and the swap).  The stream is read whole and checked (sizes, checksum)
here; what the file holds is checked on the worker thread before anything changes.
One update at a time per model; admin tenants only (when tokens are on)."""

from __future__ import annotations

import asyncio
import secrets
import threading

import grpc

from ferrum_rpc.hashing import stream_hasher
from ferrum_rpc.errors import ExecutorError, InvalidInput, TransferCorrupted
from ferrum_rpc.v1 import executor_pb2 as pb
from .handler import Malformed
from .migration import ImportReads


class WeightsRpcs:
    """A mixin of the servicer: reads its ``_worker``, ``import_idle_s`` and ``_updating``."""

    async def UpdateWeights(self, request_iterator, context, tenant: str):
        messages, reads = aiter(request_iterator), ImportReads(self.import_idle_s)
        first = await reads.next(messages)
        if isinstance(first, Malformed):
            raise InvalidInput(first.why)
        if first is None or first.WhichOneof("part") != "header":
            raise InvalidInput("an UpdateWeights stream starts with its header")
        header = first.header
        worker = self._worker(header.model)
        executor = worker.executor
        if getattr(executor, "shard", None) is not None:
            raise ExecutorError("UpdateWeights is not served with --tensor-parallel: restart the ranks on the new "
                                "weights", code=grpc.StatusCode.UNIMPLEMENTED)
        if not 0 < header.total_bytes <= executor.update_limit_bytes:
            raise InvalidInput(f"total_bytes {header.total_bytes}: an update of this model is 1 to "
                               f"{executor.update_limit_bytes} bytes (its checkpoint and a header)")
        lock = self._updating.setdefault(header.model or "", asyncio.Lock())
        async with lock:  # the buffer is held by one update at a time
            data, digest = bytearray(), stream_hasher()
            while True:
                message = await reads.next(messages)
                if isinstance(message, Malformed):
                    raise InvalidInput(message.why)
                part = message.WhichOneof("part") if message is not None else None
                if part == "data":
                    if len(data) + len(message.data) > header.total_bytes:
                        raise InvalidInput(f"the data passes total_bytes ({header.total_bytes})")
                    data += message.data
                    # off the event loop (hashlib lets go of the GIL): the next message arrives meanwhile
                    await asyncio.get_running_loop().run_in_executor(None, digest.update, message.data)
                elif part == "trailer":
                    break
                else:
                    raise TransferCorrupted("the stream ended before its trailer" if part is None
                                            else "a second header in an UpdateWeights stream")
            if len(data) != header.total_bytes:
                raise InvalidInput(f"the data holds {len(data)} bytes, total_bytes said {header.total_bytes}")
            if not secrets.compare_digest(message.trailer.checksum, digest.digest()):
                raise TransferCorrupted("the checksum does not match the data: it was altered on the way")
            data = bytes(data)  # the format's parser takes bytes; the bytearray goes
            gone = threading.Event()
            try:
                done = await worker.call(executor.update_weights, data, digest.digest(),
                                         header.invalidate_sequences, gone.is_set)
            except asyncio.CancelledError:
                gone.set()  # a rebuild under way is not swapped in
                raise
        return pb.UpdateWeightsResponse(**done)
