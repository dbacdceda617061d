"""Shared-memory logits for callers on the same host (the model: Triton's system
shared-memory extension).

A caller creates a POSIX shared-memory object and registers a region of it
(``RegisterSharedMemory``, a stream that holds the registration while it is
open); requests whose logits policy names the region get their full logits
rows written there, and the reply carries only where.  Regions belong to the
caller's tenant; another tenant's region is not found.  Every write is
bounds-checked before the request runs (a failed call changes no state), and a
region is unmapped only once no admitted call will still write into it.

The objects are opened with Python's ``multiprocessing.shared_memory`` (no
hand-written mmap code); the server never unlinks them, the caller owns them.
"""

from __future__ import annotations

import asyncio
import re
import sys
import threading
from dataclasses import dataclass, field
from multiprocessing import resource_tracker, shared_memory

import numpy as np

from ferrum_rpc.errors import InvalidInput, SharedMemoryNotFound, TenantQuotaExceeded, shown

KEY_RE = re.compile(r"/?[A-Za-z0-9._-]{1,200}")
MAX_NAME_BYTES = 128
MAX_REGIONS_PER_TENANT = 64


def _attach(key: str) -> shared_memory.SharedMemory:
    """Opens an existing object without taking ownership: the caller unlinks it, not us."""
    if sys.version_info >= (3, 13):
        return shared_memory.SharedMemory(name=key, create=False, track=False)
    shm = shared_memory.SharedMemory(name=key, create=False)
    # Before 3.13 attaching registers the object with the resource tracker, which
    # would unlink it when this process exits (bpo-39959): not ours to remove.
    resource_tracker.unregister(shm._name, "shared_memory")  # noqa: SLF001
    return shm


@dataclass(eq=False)
class Region:
    tenant: str
    name: str
    key: str
    offset: int
    byte_size: int
    shm: shared_memory.SharedMemory | None
    lock: threading.Lock = field(default_factory=threading.Lock)
    closed: bool = False
    # Set when unregistered (always on the event loop: every unregister comes from a handler).
    ended: asyncio.Event = field(default_factory=asyncio.Event)

    pins: int = 0  # calls that will write here; the mapping stays until the last is done

    def pin(self) -> None:
        """Keeps the mapping for one call (checked before the call runs, so a write
        can never fail after the call changed state)."""
        with self.lock:
            if self.closed:
                raise SharedMemoryNotFound(f"shared-memory region {shown(self.name)} was unregistered")
            self.pins += 1

    def unpin(self) -> None:
        with self.lock:
            self.pins -= 1
            self._unmap_if_done()

    def check(self, offset: int, nbytes: int) -> None:
        if offset < 0 or offset + nbytes > self.byte_size:
            raise InvalidInput(f"logits of {nbytes} bytes at offset {offset} pass the end of shared-memory region "
                               f"{shown(self.name)} ({self.byte_size} bytes)")

    def write(self, offset: int, array: np.ndarray) -> None:
        """Copies ``array``'s bytes to ``offset`` inside the region (a pinned region;
        bounds checked again)."""
        self.check(offset, array.nbytes)
        dst = np.frombuffer(self.shm.buf, dtype=np.uint8, count=array.nbytes, offset=self.offset + offset)
        np.copyto(dst, np.ascontiguousarray(array).reshape(-1).view(np.uint8))
        del dst  # no view may outlive the write: unmapping needs none exported

    def close(self) -> None:
        """Unregisters: no new call may pin it; unmapped once the pinned ones are done."""
        with self.lock:
            self.closed = True
            self._unmap_if_done()
        self.ended.set()

    def _unmap_if_done(self) -> None:  # lock held
        if self.closed and self.pins == 0 and self.shm is not None:
            self.shm.close()
            self.shm = None


class SharedMemoryRegistry:
    """Registered regions, by (tenant, name)."""

    def __init__(self) -> None:
        self._regions: dict[tuple[str, str], Region] = {}
        self._lock = threading.Lock()

    def register(self, tenant: str, name: str, key: str, offset: int, byte_size: int) -> Region:
        if not name or len(name.encode()) > MAX_NAME_BYTES:
            raise InvalidInput(f"name must be 1..={MAX_NAME_BYTES} bytes, got {len(name.encode())}")
        if not KEY_RE.fullmatch(key) or key.strip("/") in (".", ".."):
            raise InvalidInput(f"key must name one shared-memory object (letters, digits, '.', '_', '-', "
                               f"an optional leading '/'), got {shown(key)}")
        if byte_size <= 0:
            raise InvalidInput("byte_size must be > 0")
        try:
            shm = _attach(key)
        except FileNotFoundError:
            raise InvalidInput(f"no shared-memory object {shown(key)}") from None
        except OSError as exc:
            raise InvalidInput(f"shared-memory object {shown(key)} cannot be opened: {exc.strerror}") from None
        if offset + byte_size > shm.size:
            shm.close()
            raise InvalidInput(f"offset {offset} + byte_size {byte_size} pass the end of {shown(key)} "
                               f"({shm.size} bytes)")
        region = Region(tenant, name, key, offset, byte_size, shm)
        with self._lock:
            if (tenant, name) in self._regions:
                error = InvalidInput(f"a shared-memory region named {shown(name)} is registered already")
            elif sum(1 for t, _ in self._regions if t == tenant) >= MAX_REGIONS_PER_TENANT:
                error = TenantQuotaExceeded(f"at most {MAX_REGIONS_PER_TENANT} shared-memory regions per tenant")
            else:
                self._regions[(tenant, name)] = region
                return region
        shm.close()
        raise error

    def get(self, tenant: str, name: str) -> Region:
        with self._lock:
            region = self._regions.get((tenant, name))
        if region is None:
            raise SharedMemoryNotFound(f"no shared-memory region named {shown(name)}")
        return region

    def unregister(self, tenant: str, name: str = "", region: Region | None = None) -> int:
        """Unregisters ``name`` (empty: every region of ``tenant``); with ``region``,
        only if that very registration is still the one under its name."""
        with self._lock:
            keys = [k for k, r in self._regions.items()
                    if k[0] == tenant and (not name or k[1] == name) and (region is None or r is region)]
            gone = [self._regions.pop(k) for k in keys]
        for r in gone:
            r.close()
        return len(gone)

    def close_all(self) -> None:
        with self._lock:
            gone, self._regions = list(self._regions.values()), {}
        for r in gone:
            r.close()

    def __len__(self) -> int:
        return len(self._regions)
