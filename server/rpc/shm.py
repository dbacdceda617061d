"""Shared-memory logits for callers on the same host (the model: Triton's system
shared-memory extension, with the object made by the server).

A caller asks for a region (``RegisterSharedMemory``, a stream that holds the
registration while it is open); the server creates a new POSIX shared-memory
object of that size itself (an unguessable name, ``O_CREAT | O_EXCL``, mode
0600, its pages reserved with ``posix_fallocate``) and answers with the
object's name, which the caller opens to read from.  Requests whose logits
policy names the region get their full logits rows written there, and the
reply carries only where.

Why the server creates the object (and not the caller):

- The server writes only into objects it made for the registering tenant.
  A caller cannot name another tenant's object, another program's object or
  a semaphore: there is no caller-supplied key to check.  (A caller could
  pass a file descriptor over a Unix socket instead, but gRPC exposes no
  ancillary data; owner uids prove nothing between tenants of one uid.)
- The server never maps the object: it writes with ``pwrite`` on its file
  descriptor.  A caller that shrinks the object (``ftruncate``) cannot make
  the server die of SIGBUS; writing past a shrunk end just grows the file
  again.  A region whose object shrank is refused before a call runs.
- The object is unlinked by the client once it has opened it, and by the
  server when the registration ends, whichever comes first; the memory goes
  when the last descriptor and mapping close.

A region is closed only once no admitted call still writes into it
(``pins``); ``UnregisterSharedMemory`` answers after that, so no byte is
written into a region after its caller was told it is unregistered.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import secrets
import stat
import threading
from dataclasses import dataclass, field

import numpy as np

from ferrum_rpc.errors import (
    ExecutorError,
    InvalidInput,
    SharedMemoryNotFound,
    TenantQuotaExceeded,
    shown,
)
from ferrum_rpc.rules import check_region

try:  # CPython's own binding of shm_open/shm_unlink (what multiprocessing.shared_memory uses)
    import _posixshmem
except ImportError:  # pragma: no cover - not a POSIX system
    _posixshmem = None

log = logging.getLogger(__name__)

MAX_REGIONS_PER_TENANT = 64
MAX_BYTES_PER_TENANT = 4 << 30  # every region of one tenant together (tmpfs pages, reserved up front)


def available() -> bool:
    return _posixshmem is not None


@dataclass(eq=False)
class Region:
    tenant: str
    name: str
    key: str  # the object's name, for the caller to open
    byte_size: int
    fd: int | None
    lock: threading.Lock = field(default_factory=threading.Lock)
    closed: bool = False
    # Set when unregistered (always on the event loop: every unregister comes from a handler).
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    pins: int = 0  # calls that will write here; the descriptor stays until the last is done

    def pin(self) -> None:
        """Keeps the region for one call, checked before the call runs (so the write
        after it cannot fail): refused once unregistered or if its object shrank."""
        with self.lock:
            if self.closed:
                raise SharedMemoryNotFound(f"shared-memory region {shown(self.name)} was unregistered")
            size = os.fstat(self.fd).st_size
            if size < self.byte_size:
                raise InvalidInput(f"shared-memory region {shown(self.name)}: its object was shrunk to {size} "
                                   f"bytes (registered {self.byte_size}); register a new region")
            self.pins += 1

    def hold(self) -> None:
        """One more pin for a write already admitted (the reply builder's own)."""
        with self.lock:
            self.pins += 1

    def unpin(self) -> None:
        with self.lock:
            self.pins -= 1
            self._release_if_done()

    def check(self, offset: int, nbytes: int) -> None:
        if offset < 0 or offset + nbytes > self.byte_size:
            raise InvalidInput(f"logits of {nbytes} bytes at offset {offset} pass the end of shared-memory region "
                               f"{shown(self.name)} ({self.byte_size} bytes)")

    def write(self, offset: int, array: np.ndarray) -> None:
        """Copies ``array``'s bytes to ``offset`` inside the region (a pinned region;
        bounds checked again).  ``pwrite`` on the descriptor, never a mapping:
        an object shrunk meanwhile cannot fault the server."""
        self.check(offset, array.nbytes)
        data = memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8))
        done = 0
        while done < len(data):
            done += os.pwrite(self.fd, data[done:], offset + done)

    def close(self) -> None:
        """Unregisters: no new call may pin it; released once the pinned ones are done."""
        with self.lock:
            self.closed = True
            self._release_if_done()
        self.ended.set()

    async def drained(self, poll_s: float = 0.005) -> None:
        """Returns once no admitted call will write into the region any more."""
        while self.pins:
            await asyncio.sleep(poll_s)

    def _release_if_done(self) -> None:  # lock held
        if self.closed and self.pins == 0 and self.fd is not None:
            os.close(self.fd)
            self.fd = None
            _unlink(self.key)


def _unlink(key: str) -> None:
    try:
        _posixshmem.shm_unlink(key)
    except FileNotFoundError:  # the caller unlinked it once it had it open
        pass
    except OSError as exc:
        log.warning("cannot unlink shared-memory object %s: %s", key, exc.strerror)


def _create(byte_size: int) -> tuple[str, int]:
    """A new object of ``byte_size`` bytes, only this uid may open, its pages reserved."""
    key = f"/ferrum-logits-{os.getpid()}-{secrets.token_hex(12)}"
    fd = _posixshmem.shm_open(key, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
    try:
        os.ftruncate(fd, byte_size)
        os.posix_fallocate(fd, 0, byte_size)  # tmpfs full: fails now, not at a write after the forward
    except OSError as exc:
        os.close(fd)
        _unlink(key)
        if exc.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
            raise ExecutorError(f"no room for a {byte_size}-byte shared-memory object on this host",
                                code=_resource_exhausted()) from None
        raise
    assert stat.S_ISREG(os.fstat(fd).st_mode)
    return key, fd


def _resource_exhausted():
    import grpc

    return grpc.StatusCode.RESOURCE_EXHAUSTED


class SharedMemoryRegistry:
    """Registered regions, by (tenant, name)."""

    def __init__(self) -> None:
        self._regions: dict[tuple[str, str], Region] = {}
        self._lock = threading.Lock()

    def register(self, tenant: str, name: str, key: str, offset: int, byte_size: int) -> Region:
        """Creates the region's object (see the module docstring); ``key`` and ``offset``
        are fields of the earlier contract in which the caller made the object,
        and must be empty now."""
        check_region(name, key, offset, byte_size)
        with self._lock:
            mine = [r for (t, _), r in self._regions.items() if t == tenant]
            if (tenant, name) in self._regions:
                raise InvalidInput(f"a shared-memory region named {shown(name)} is registered already")
            if len(mine) >= MAX_REGIONS_PER_TENANT:
                raise TenantQuotaExceeded(f"at most {MAX_REGIONS_PER_TENANT} shared-memory regions per tenant")
            if sum(r.byte_size for r in mine) + byte_size > MAX_BYTES_PER_TENANT:
                raise TenantQuotaExceeded(f"at most {MAX_BYTES_PER_TENANT} bytes of shared-memory regions per "
                                          f"tenant; {sum(r.byte_size for r in mine)} are registered")
            # reserved under the lock: two registrations of one name cannot both create objects
            self._regions[(tenant, name)] = placeholder = Region(tenant, name, "", byte_size, None)
        try:
            key, fd = _create(byte_size)
        except BaseException:
            with self._lock:
                self._regions.pop((tenant, name), None)
            raise
        region = Region(tenant, name, key, byte_size, fd)
        with self._lock:
            if self._regions.get((tenant, name)) is placeholder:
                self._regions[(tenant, name)] = region
                return region
        region.close()  # unregistered while being created (an unregister-all): gone at once
        raise SharedMemoryNotFound(f"shared-memory region {shown(name)} was unregistered while being created")

    def get(self, tenant: str, name: str) -> Region:
        with self._lock:
            region = self._regions.get((tenant, name))
        if region is None or not region.key:  # none, or still being created
            raise SharedMemoryNotFound(f"no shared-memory region named {shown(name)}")
        return region

    def unregister(self, tenant: str, name: str = "", region: Region | None = None) -> list[Region]:
        """Unregisters ``name`` (empty: every region of ``tenant``); with ``region``,
        only if that very registration is still the one under its name.  Returns
        the regions unregistered (``Region.drained`` says when their writes ended)."""
        with self._lock:
            keys = [k for k, r in self._regions.items()
                    if k[0] == tenant and (not name or k[1] == name) and (region is None or r is region)]
            gone = [self._regions.pop(k) for k in keys]
        for r in gone:
            _close_quietly(r)
        return gone

    def close_all(self) -> None:
        with self._lock:
            gone, self._regions = list(self._regions.values()), {}
        for r in gone:
            _close_quietly(r)

    def __len__(self) -> int:
        return len(self._regions)


def _close_quietly(region: Region) -> None:
    """One region's failure to close must not keep the others registered."""
    try:
        region.close()
    except Exception:
        log.exception("closing shared-memory region %s failed", shown(region.name))
