"""Shared-memory logits on the caller's side: a POSIX shared-memory object this
client creates, registers with the server and reads full logits rows from.

    with client.shared_memory(64 << 20) as region:
        out = client.prefill(prompt, logits=LogitsPolicy.full(all_positions=True,
                                                             shared_memory=region.target()))
        out.logits.values  # a numpy view of the rows inside the region (float32: no copy)

The registration lives while this object is open (the server holds it on an
open stream and drops it when the stream ends: ``close``, a crash or a lost
connection).  A float32 ``values`` array aliases the region: the next request
that writes the same bytes overwrites it, so copy what must outlive that.
"""

from __future__ import annotations

import uuid
from multiprocessing import shared_memory

import grpc

from ferrum_rpc.errors import ExecutorError, from_rpc_error
from ferrum_rpc.types import SharedMemoryTarget
from ferrum_rpc.v1 import executor_pb2 as pb


class _Shm(shared_memory.SharedMemory):
    def __del__(self):
        try:
            self.close()
        except BufferError:  # logits arrays still alias the mapping: it is unmapped with the last of them
            pass


class SharedMemoryRegion:
    """A region registered with one server; see :meth:`ExecutorClient.shared_memory`."""

    def __init__(self, stub, byte_size: int, name: str | None = None, metadata=None):
        if byte_size <= 0:
            raise ValueError("byte_size must be > 0")
        self.name = name or f"logits-{uuid.uuid4().hex[:12]}"
        self.byte_size = byte_size
        self._shm = _Shm(create=True, size=byte_size)
        self.key = self._shm.name
        self._stub, self._metadata = stub, metadata
        request = pb.RegisterSharedMemoryRequest(name=self.name, key=self.key, offset=0, byte_size=byte_size)
        self._call = stub.RegisterSharedMemory(request, metadata=metadata)  # no deadline: it lasts until close
        try:
            next(self._call)
        except grpc.RpcError as exc:
            self._release()
            raise from_rpc_error(exc) from None
        except StopIteration:
            self._release()
            raise ExecutorError("the server ended the shared-memory registration at once") from None

    def target(self, offset: int = 0) -> SharedMemoryTarget:
        """Where a request's logits rows should go (``LogitsPolicy.full(shared_memory=...)``)."""
        return SharedMemoryTarget(self.name, offset)

    def view(self, location: pb.SharedMemoryLocation) -> memoryview:
        """The bytes a reply says were written (bounds checked against this region)."""
        end = location.offset + location.byte_size
        if end > self.byte_size:
            raise ExecutorError(f"reply names bytes {location.offset}..{end} of a {self.byte_size}-byte region")
        return self._shm.buf[location.offset:end]

    def close(self) -> None:
        """Unregisters (done when this returns), ends the registration stream and
        removes the object."""
        if self._call is not None:
            try:
                self._stub.UnregisterSharedMemory(pb.UnregisterSharedMemoryRequest(name=self.name),
                                                  metadata=self._metadata, timeout=10)
            except grpc.RpcError:  # the server is gone: so is the registration
                pass
            self._call.cancel()
            self._call = None
        self._release()

    def _release(self) -> None:
        if self._shm is None:
            return
        try:
            self._shm.close()
        except BufferError:  # arrays still alias the mapping: it goes with the last of them
            pass
        self._shm.unlink()  # the name goes now; the memory once nothing maps it
        self._shm = None

    def __enter__(self) -> SharedMemoryRegion:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
