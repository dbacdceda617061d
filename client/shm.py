"""Shared-memory logits on the caller's side: a region registered with the server,
whose POSIX shared-memory object the server creates and this client opens (on
the same host, as the server's user) and reads full logits rows from.

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
from ferrum_rpc.rules import check_region
from ferrum_rpc.types import SharedMemoryTarget
from ferrum_rpc.v1 import executor_pb2 as pb


class _Shm(shared_memory.SharedMemory):
    def __del__(self):
        try:
            self.close()
        except BufferError:  # logits arrays still alias the mapping: it is unmapped with the last of them
            pass


def _attach(key: str) -> _Shm:
    """Opens the object the server created and unlinks its name at once: from now
    on only this mapping and the server's descriptor reach it."""
    shm = _Shm(name=key, create=False)
    try:
        shm.unlink()  # also drops the resource tracker's entry (before 3.13 attaching adds one)
    except FileNotFoundError:
        pass
    return shm


class SharedMemoryRegion:
    """A region registered with one server; see :meth:`ExecutorClient.shared_memory`.

    The server creates the shared-memory object (it writes only into objects it
    made for the registering tenant) and its first reply names it; this client
    opens it, which needs the server's user on the same host."""

    def __init__(self, stub, byte_size: int, name: str | None = None, metadata=None, *,
                 registry: dict | None = None, _register: bool = True):
        if byte_size <= 0:
            raise ValueError("byte_size must be > 0")
        self.name = name or f"logits-{uuid.uuid4().hex[:12]}"
        self.byte_size = byte_size
        self._shm: _Shm | None = None
        self.key = ""
        self._stub, self._metadata, self._call = stub, metadata, None
        self._registry = registry  # the client's regions by name: this one is in it while registered
        if _register:
            self._call = stub.RegisterSharedMemory(self._request(), metadata=metadata)  # lasts until close
            try:
                first = next(self._call)
            except grpc.RpcError as exc:
                self._call = None
                raise from_rpc_error(exc) from None
            except StopIteration:
                self._call = None
                raise ExecutorError("the server ended the shared-memory registration at once") from None
            self._opened(first)

    def _opened(self, first: pb.RegisterSharedMemoryResponse) -> None:
        try:
            self._shm = _attach(first.key)
        except OSError as exc:
            self._end_call()
            raise ExecutorError(f"cannot open the server's shared-memory object {first.key!r}: {exc.strerror} "
                                "(shared memory needs the server's user on the same host)") from None
        self.key = first.key
        self._registered()

    def _end_call(self) -> None:
        if self._call is not None:
            self._call.cancel()
            self._call = None

    def _registered(self) -> None:
        if self._registry is not None:
            self._registry[self.name] = self

    def _request(self) -> pb.RegisterSharedMemoryRequest:
        check_region(self.name, "", 0, self.byte_size)
        return pb.RegisterSharedMemoryRequest(name=self.name, byte_size=self.byte_size)

    def _unregister_request(self) -> pb.UnregisterSharedMemoryRequest:
        return pb.UnregisterSharedMemoryRequest(name=self.name)

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
        """Unregisters (done when this returns: the server writes nothing into the
        region after it), ends the registration stream and unmaps the object."""
        if self._call is not None:
            try:
                self._stub.UnregisterSharedMemory(self._unregister_request(), metadata=self._metadata, timeout=10)
            except grpc.RpcError:  # the server is gone: so is the registration
                pass
            self._call.cancel()
            self._call = None
        self._release()

    def _release(self) -> None:
        if self._registry is not None and self._registry.get(self.name) is self:
            del self._registry[self.name]
        if self._shm is None:
            return
        try:
            self._shm.close()
        except BufferError:  # arrays still alias the mapping: it goes with the last of them
            pass
        self._shm = None

    def __enter__(self) -> SharedMemoryRegion:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncSharedMemoryRegion(SharedMemoryRegion):
    """The same region for :class:`AsyncExecutorClient`: ``await client.shared_memory(n)``,
    then ``async with`` or ``await region.aclose()``."""

    @classmethod
    async def open(cls, stub, byte_size: int, name: str | None = None,
                   registry: dict | None = None) -> AsyncSharedMemoryRegion:
        region = cls(stub, byte_size, name, registry=registry, _register=False)
        region._call = stub.RegisterSharedMemory(region._request())
        try:
            first = await region._call.read()
        except grpc.RpcError as exc:
            region._call = None
            raise from_rpc_error(exc) from None
        if first is grpc.aio.EOF:
            region._call = None
            raise ExecutorError("the server ended the shared-memory registration at once")
        region._opened(first)
        return region

    async def aclose(self) -> None:
        if self._call is not None:
            try:
                await self._stub.UnregisterSharedMemory(self._unregister_request(), timeout=10)
            except grpc.RpcError:
                pass
            self._call.cancel()
            self._call = None
        self._release()

    def close(self) -> None:  # a blocking close has no place on the event loop
        raise TypeError("use await region.aclose() (or async with)")

    async def __aenter__(self) -> AsyncSharedMemoryRegion:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()
