"""The administrative RPCs: the model registry (ListModels, LoadModel, UnloadModel,
admin tenants only for changes), LoRA adapters (LoadAdapter, UnloadAdapter,
ListAdapters) and shared-memory regions (RegisterSharedMemory,
UnregisterSharedMemory).  A part of the servicer: the gate's registry and state, the
shared-memory regions it shares with the servicer, and the transfers' figures."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import grpc

from ferrum_rpc import convert
from ferrum_rpc.errors import AdapterInvalid, Draining, ExecutorError, shown
from ferrum_rpc.types import ServerState
from ferrum_rpc.v1 import executor_pb2 as pb
from ..engine.facade import build_thread_init
from ferrum_rpc.rules import MAX_PATH_BYTES
from .gate import Gate
from .handler import handler, query
from .shm import SharedMemoryRegistry


class AdminRpcs:
    def __init__(self, gate: Gate, shm: SharedMemoryRegistry, shared_memory: bool,
                 transfer_figures: Callable[[], dict[str, int]]):
        self.gate, self.shm, self.shared_memory = gate, shm, shared_memory
        self.transfer_figures = transfer_figures  # GetStatus' view of the transfers running
        self._adapter_builds: ThreadPoolExecutor | None = None

    # -- the model registry ----------------------------------------------------------------
    @query
    async def ListModels(self, request, context, tenant: str):
        reply = pb.ListModelsResponse()
        for model in self.gate.registry.hosted():
            if model.worker is None:
                reply.models.add(name=model.name, state="loading", path=model.path)
                continue
            status = await model.worker.front.call(model.worker.executor.status, self.gate.state, model.worker.work_queued)
            status = dataclasses.replace(status, **self.transfer_figures())
            reply.models.add(name=model.name, state="serving", path=model.path, is_default=model.is_default,
                             status=convert.status_to_proto(status))
        return reply

    @handler(admit=False, admin=True)
    async def LoadModel(self, request, context, tenant: str):
        """One progress message per stage (see ``Registry.load_stages``)."""
        start = time.perf_counter()
        draining = self.gate.state is ServerState.DRAINING
        async with contextlib.aclosing(self.gate.registry.load_stages(request.name, request.path, draining)) as stages:
            async for stage in stages:  # closed with this call: an abandoned load is undone at once
                yield pb.LoadModelResponse(stage=stage, elapsed_s=time.perf_counter() - start)

    @handler(admit=False, admin=True)
    async def UnloadModel(self, request, context, tenant: str):
        if request.name:
            self.gate.worker(request.name)  # the precise refusal: loading, unloaded, unknown
        return pb.UnloadModelResponse(sequences_dropped=await self.gate.registry.unload(request.name))

    # -- LoRA adapters (engine/adapters.py): built off the worker, installed on it between forwards --
    def _adapter_builder(self) -> ThreadPoolExecutor:
        """The one thread adapters are read and built on, yielding the cores to the forwards
        (``build_thread_init``); loads queue for it one at a time."""
        if self._adapter_builds is None:
            self._adapter_builds = ThreadPoolExecutor(max_workers=1, thread_name_prefix="adapter-build",
                                                      initializer=build_thread_init)
        return self._adapter_builds

    @handler(admin=True)
    async def LoadAdapter(self, request, context, tenant: str):
        worker = self.gate.worker(request.model)
        executor = worker.executor
        check_adapter_folder(request.path, executor.config.adapter_root)
        gone = threading.Event()
        try:
            # read, checked and arranged beside the serving model: forwards go on meanwhile;
            # a caller who leaves during the build gets nothing installed
            built = await asyncio.get_running_loop().run_in_executor(
                self._adapter_builder(), executor.lora.build, request.name, request.path, request.replace)
            entry = await worker.front.call(executor.lora.load, request.name, request.path, request.replace,
                                      gone.is_set, built)
        except asyncio.CancelledError:
            gone.set()  # a load queued on the worker never runs, one under way installs nothing
            raise
        return _adapter_entry(entry)

    @handler(admin=True)
    async def UnloadAdapter(self, request, context, tenant: str):
        worker = self.gate.worker(request.model)
        await worker.front.call(worker.executor.lora.unload, request.name)
        return pb.UnloadAdapterResponse()

    @query
    async def ListAdapters(self, request, context, tenant: str):
        """Admins see every field; another tenant sees names, ranks and modules, and the
        live sequences it runs itself (not where adapters lie or what others run)."""
        worker = self.gate.worker(request.model)
        entries, evicted = await worker.front.call(worker.executor.lora.entries,
                                             None if self.gate.is_admin(tenant) else tenant)
        return pb.ListAdaptersResponse(adapters=[_adapter_entry(e) for e in entries], evicted=evicted)

    # -- shared memory -------------------------------------------------------------
    @handler(admit=False, observe=False)  # observed when it answers, not when the registration ends
    async def RegisterSharedMemory(self, request, context, tenant: str):
        """Registers the region, answers once, and holds the registration until the
        caller cancels, disconnects or unregisters it (or the server drains).  Not
        an in-flight call: a drain does not wait for it."""
        start = time.perf_counter()
        try:
            if not self.shared_memory:
                raise ExecutorError("shared memory is off on this server (it serves it on loopback addresses, "
                                    "or with --shared-memory on)", code=grpc.StatusCode.UNIMPLEMENTED)
            if self.gate.state is ServerState.DRAINING:
                raise Draining("the server is shutting down")
            creating = asyncio.get_running_loop().run_in_executor(  # reserving the pages may take a while
                None, self.shm.register, tenant, request.name, request.key, request.offset, request.byte_size)
            try:
                region = await asyncio.shield(creating)
            except asyncio.CancelledError:  # the caller left: what was created goes at once
                creating.add_done_callback(lambda f: f.exception() or self.shm.unregister(tenant, region=f.result()))
                raise
        except Exception as exc:
            self.gate.observe("RegisterSharedMemory", tenant, exc, start)
            raise
        self.gate.observe("RegisterSharedMemory", tenant, None, start)
        try:
            yield pb.RegisterSharedMemoryResponse(name=region.name, byte_size=region.byte_size, key=region.key)
            await region.ended.wait()
        finally:
            self.shm.unregister(region.tenant, region.name, region)

    @query
    async def UnregisterSharedMemory(self, request, context, tenant: str):
        """Answers once no admitted call will write into the regions any more."""
        gone = self.shm.unregister(tenant, request.name)
        for region in gone:
            await region.drained()
        return pb.UnregisterSharedMemoryResponse(unregistered=len(gone))


def check_adapter_folder(path: str, root: str = "") -> None:
    """Refuses (ADAPTER_INVALID) a LoadAdapter path over 4,096 bytes, one outside ``root``
    (--adapter-root, resolved) once its symbolic links are followed, one the OS refuses,
    or one that is no PEFT adapter folder; errors show a bounded prefix of the path,
    never the OS's own message with all of it.  The reader checks each file it opens
    against ``root`` again."""
    if len(path.encode()) > MAX_PATH_BYTES:
        raise AdapterInvalid(f"path: {shown(path)} is over {MAX_PATH_BYTES} bytes")
    try:
        if root and path and not Path(os.path.realpath(path)).is_relative_to(root):
            raise AdapterInvalid(f"path: {shown(path)} is not inside --adapter-root (after following symbolic "
                                 f"links)")
        found = bool(path) and (Path(path) / "adapter_config.json").is_file()
    except (OSError, ValueError) as exc:
        why = getattr(exc, "strerror", None) or type(exc).__name__
        raise AdapterInvalid(f"path: {shown(path)} is no adapter folder the server can read ({why})") from None
    if not found:
        raise AdapterInvalid(f"path: {shown(path)} is no LoRA adapter folder on the server (no adapter_config.json)")


def _adapter_entry(entry: dict) -> pb.AdapterEntry:
    return pb.AdapterEntry(**entry)
