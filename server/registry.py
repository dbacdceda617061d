"""The models a server hosts: which are serving, loading or unloaded, and how a
model is loaded, warmed, added and removed.

One home for both the state (the routing table the servicer reads on every call)
and the procedure (start-up loading, and the LoadModel / UnloadModel RPCs); the
servicer turns requests into calls on it, the app builds it and drains it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator

import grpc
from grpc_health.v1 import health_pb2
from grpc_health.v1._async import HealthServicer

from ferrum_rpc.errors import Draining, ExecutorError, InvalidInput, ModelLoading, ModelNotFound, shown
from ferrum_rpc.rules import check_model_name
from .config import ExecutorConfig
from .engine import crossover
from .engine.executor import TorchExecutor
from .engine.worker import ModelWorker

log = logging.getLogger(__name__)



@dataclass(frozen=True)
class Hosted:
    """One row of ListModels: a model being loaded (``worker`` None) or serving."""
    name: str
    path: str
    worker: ModelWorker | None
    is_default: bool = False


class Registry:
    """Name -> worker, plus the names being loaded and the names unloaded."""

    def __init__(self, config: ExecutorConfig, instance_id: str, health: HealthServicer | None = None,
                 warmup: bool = True, remeasure: bool = False):
        self.config, self.instance_id, self.health, self.warmup = config, instance_id, health, warmup
        self.remeasure = remeasure
        self.workers: dict[str, ModelWorker] = {}
        self.paths: dict[str, str] = {}  # model -> the folder it came from
        self.loading: dict[str, str] = {}  # models being loaded by LoadModel -> folder
        self.unloaded: set[str] = set()  # names whose handles now get "was unloaded"
        self.default = ""

    # -- the routing table -----------------------------------------------------------
    def worker(self, model: str) -> ModelWorker:
        """The worker serving ``model`` ("" = the default), or the precise refusal."""
        try:
            return self.workers[model or self.default]
        except KeyError:
            if model in self.loading:
                raise ModelLoading(f"model {shown(model)} is still loading") from None
            if model in self.unloaded:
                raise ModelNotFound(f"model {shown(model)} was unloaded; its sequences are gone") from None
            raise ModelNotFound(f"no model named {shown(model)}; hosted: {sorted(self.workers)}") from None

    def hosted(self) -> list[Hosted]:
        """Models being loaded first, then the serving ones, in the order they came."""
        return [Hosted(name, path, None) for name, path in self.loading.items()] + [
            Hosted(name, self.paths.get(name, ""), worker, name == self.default)
            for name, worker in list(self.workers.items())]

    # -- the procedure -----------------------------------------------------------------
    async def load(self, name: str, path: str) -> ModelWorker:
        """Loads, warms and adds one model (start-up: raises what loading raised)."""
        worker = await self._start(name, path)
        await self._warm(worker)
        self.loading.pop(name, None)  # a name start-up marked loading (App.load); no await until _add lists it
        await self._add(worker, path)
        return worker

    def check_new(self, name: str, path: str) -> None:
        """Refuses (INVALID_INPUT) a LoadModel name that is taken or too long, and a path
        that is over 4,096 bytes, that the OS refuses (ENAMETOOLONG, EACCES, ...) or that
        is no model folder; errors show a bounded prefix of the path, never the OS's own
        message with all of it."""
        check_model_name(name, path)
        if name in self.workers or name in self.loading:
            raise InvalidInput(f"a model named {shown(name)} is hosted already")
        try:
            found = (Path(path) / "config.json").is_file()
        except (OSError, ValueError) as exc:
            why = getattr(exc, "strerror", None) or type(exc).__name__
            raise InvalidInput(f"{shown(path)} is no model folder the server can read ({why})") from None
        if not found:
            raise InvalidInput(f"{shown(path)} is no model folder on the server (no config.json)")

    async def load_stages(self, name: str, path: str, draining: bool) -> AsyncIterator[str]:
        """LoadModel: yields each stage as it starts ("loading", "warming up") and
        "serving" at the end, while the other models serve.  A failed or abandoned
        load leaves nothing behind."""
        self._check_not_split("LoadModel")
        self.check_new(name, path)
        if draining:
            raise Draining("the server is shutting down")
        self.loading[name] = path
        worker = None
        try:
            yield "loading"
            try:
                worker = await self._start(name, path)
            except ExecutorError:
                raise
            except Exception as exc:
                raise InvalidInput(f"cannot load {shown(path)}: {type(exc).__name__}: "
                                   f"{shown(str(exc), 512)}") from None
            yield "warming up"
            await self._warm(worker)
            await self._add(worker, path)
            worker = None  # serving: no longer ours to clean up
        finally:
            self.loading.pop(name, None)
            if worker is not None:  # failed or abandoned after loading: stop it
                asyncio.get_running_loop().run_in_executor(None, worker.stop)
        yield "serving"

    async def unload(self, name: str) -> int:
        """Unloads a model: refused to new calls at once, in-flight calls finish, then
        its worker stops and its KV and weights go; returns the sequences it held."""
        self._check_not_split("UnloadModel")
        check_model_name(name)
        self.worker(name)  # the precise refusal: loading, unloaded, unknown
        worker = self.workers.pop(name)
        self.paths.pop(name, None)
        self.unloaded.add(name)
        if self.default == name:
            self.default = next(iter(self.workers), "")
        await self._set_health(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        await asyncio.get_running_loop().run_in_executor(None, worker.stop)
        dropped = len(worker.executor.kv)
        worker.executor = None  # the model and its pool go with the last reference
        log.info("unloaded %s (%d sequence(s) dropped)", name, dropped)
        return dropped

    def _check_not_split(self, rpc: str) -> None:
        """A tensor-parallel server's ranks hold the one model they started with."""
        if self.config.tensor_parallel > 1:
            raise ExecutorError(f"{rpc} is not served with --tensor-parallel: every rank holds the model it "
                                f"started with", code=grpc.StatusCode.UNIMPLEMENTED)

    def stop_all(self, timeout: float) -> None:
        for worker in self.workers.values():
            worker.stop(timeout=timeout)

    async def _start(self, name: str, path: str) -> ModelWorker:
        """A worker thread with the model loaded on it (raises what loading raised)."""
        load = functools.partial(TorchExecutor.from_path, name, path, self.config, self.instance_id)
        worker = ModelWorker(load, name, self.config.batch_wait_ms)
        try:
            await asyncio.shield(worker.started())
        except asyncio.CancelledError:  # abandoned (LoadModel's caller went away): stop it once loaded
            worker.loaded.add_done_callback(
                lambda f: None if f.exception() else threading.Thread(target=worker.stop, daemon=True).start())
            raise
        return worker

    async def _warm(self, worker: ModelWorker) -> None:
        if self.warmup:
            await worker.front.call(_warm_up, worker.executor, self.remeasure)

    async def _add(self, worker: ModelWorker, path: str) -> None:
        name = worker.executor.name
        self.workers[name] = worker
        self.paths[name] = path
        self.unloaded.discard(name)
        self.default = self.default or name
        await self._set_health(name, health_pb2.HealthCheckResponse.SERVING)

    async def _set_health(self, name: str, status) -> None:
        if self.health is not None:
            await self.health.set(name, status)


def _warm_up(executor: TorchExecutor, remeasure: bool = False) -> None:
    out = executor.prefill([0] * 8)
    executor.decode(0, out.kv_cache)
    executor.release_cache(out.kv_cache.cache_id)
    crossover.optimal_batch(executor, remeasure)  # the stored result where nothing it depends on changed
