"""Server assembly: executors + workers + servicer, health, reflection, drain on SIGTERM.

``build_server`` binds and starts the gRPC server at once (health says
NOT_SERVING); ``App.load`` then loads and warms each model off the event loop
and flips health to SERVING.  ``serve`` is the CLI's entry point.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
import uuid
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from ferrum_rpc.errors import ExecutorError, StartupError
from .rpc.auth import AuthInterceptor, TlsFiles, TokenTable
from .config import ServerConfig, parse_allow
from .preflight import PortFile, check_tls_files
from .rpc.push import PushConfig
from .registry import Registry
from .rpc.handler import add_executor_service
from .rpc.servicer import ExecutorServicer
from ferrum_rpc.types import ServerState
from ferrum_rpc.v1 import executor_pb2 as pb

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["ModelExecutor"].full_name
HEALTH_NAME = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
MESSAGE_SLACK = 1 << 20  # room for handles/timing around the largest logits payload
DRAIN_SETTLE_S = 0.2
FAIL_SETTLE_S = 0.5  # a lost tensor-parallel group: time for the failed calls' statuses to go out


def channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """gRPC size limits for both ends: the largest logits reply plus slack."""
    limit = max_message_bytes + MESSAGE_SLACK
    return [("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit)]


# The clients ping every 2 s (2 s to answer; ferrum_rpc.client.Keepalive) so a server that
# stops answering is left within ~4 s.  gRPC servers by default accept a ping without
# data only every 5 minutes, and none on a connection with no call: past 2 such "strikes"
# they close the connection with GOAWAY "too_many_pings".  Accept one a second, with or
# without calls (half the clients' interval, so timer jitter never strikes), and keep the
# strike limit against clients that ping faster.  (gRPC core 1.85 reads the receive side
# as "grpc.http2.min_ping_interval_without_data_ms"; "min_recv_ping_interval..." and
# "min_time_between_pings_ms" are not arguments it knows.)  The server's own pings (every
# 30 s, 10 s to answer) find callers that vanished without a reset, so their calls are undone.
KEEPALIVE_SERVER_OPTIONS = [
    ("grpc.http2.min_ping_interval_without_data_ms", 1000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
]


@dataclass
class App:
    config: ServerConfig
    server: grpc.aio.Server
    port: int
    servicer: ExecutorServicer
    health: HealthServicer
    metrics_port: int | None = None
    port_file: PortFile | None = None

    async def load(self) -> None:
        """Loads and warms every model, then reports SERVING.  Each model is "loading"
        until it serves (calls naming it get MODEL_LOADING, not MODEL_NOT_FOUND, while
        the ones before it already serve), as a model LoadModel loads is."""
        self.registry.loading.update((spec.name, spec.path) for spec in self.config.models)
        for spec in self.config.models:
            await self.registry.load(spec.name, spec.path)
        self.servicer.gate.state = ServerState.SERVING
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("serving %s on port %d", ", ".join(self.registry.workers), self.port)
        if self.port_file:
            self.port_file.write(state="serving")

    async def drain(self, grace_s: float) -> None:
        """Refuses new calls (UNAVAILABLE/DRAINING), lets in-flight ones finish, stops."""
        log.info("draining: %d call(s) in flight", self.servicer.gate.inflight)
        self.servicer.gate.state = ServerState.DRAINING
        if self.port_file:  # whoever reads it stops sending new work here
            with contextlib.suppress(StartupError):  # the drain goes on if the file cannot be written
                self.port_file.write(state="draining")
        self.servicer.shm.close_all()  # ends the registration streams; pinned calls finish their writes
        self.servicer.end_watches()  # KV events streams end: routers stop placing here
        await self.health.enter_graceful_shutdown()
        try:
            await asyncio.wait_for(self.servicer.wait_idle(), grace_s)
        except asyncio.TimeoutError:
            log.warning("grace period over with %d call(s) in flight", self.servicer.gate.inflight)
        await self._export_grace(self.config.export_grace_s)
        # Imports still streaming are ended now (DRAINING, their buffers freed): a stalled
        # one holds the drain no longer than the export grace.
        self.servicer.end_imports()
        # Calls gRPC core accepted but had not yet handed to us would be CANCELLED
        # by server.stop (grpc/grpc#41785); a short pause lets them in to be refused
        # with DRAINING instead.  It narrows the window; it cannot close it.
        await asyncio.sleep(DRAIN_SETTLE_S)
        await self.server.stop(grace=1.0)
        self.registry.stop_all(timeout=grace_s)
        log.info("stopped")

    async def fail_closed(self, error: ExecutorError) -> None:
        """A tensor-parallel rank is lost (``tp.fail``): health NOT_SERVING, every call
        unanswered and every new one fails UNAVAILABLE/TENSOR_PARALLEL_RANK_LOST, then
        the server stops (the CLI exits non-zero so a supervisor restarts it)."""
        self.servicer.gate.lost = error
        for name in ("", SERVICE_NAME, *self.registry.workers):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        for worker in list(self.registry.workers.values()):
            worker.fail_all(error)
        await asyncio.sleep(FAIL_SETTLE_S)  # the failed calls' statuses go out
        await self.server.stop(grace=FAIL_SETTLE_S)
    def _live_sequences(self) -> int:
        return sum(len(w.executor.kv) for w in list(self.registry.workers.values()) if w.executor is not None)

    async def _export_grace(self, grace_s: float) -> None:
        """Keeps answering ExportSequence / PushSequence while live sequences
        remain, for at most ``grace_s`` (``--export-grace``), so their callers move them
        elsewhere instead of recomputing them; ends early once every sequence has left
        and no transfer is running."""
        live = self._live_sequences()
        if not grace_s or not live:
            return
        log.info("draining: %d live sequence(s) may be exported or pushed for up to %.1fs (--export-grace)",
                 live, grace_s)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        while (self._live_sequences() or self.servicer.transfers) and loop.time() < deadline:
            await asyncio.sleep(0.05)
        left = self._live_sequences()
        if left:
            log.warning("export grace over: %d sequence(s) were not moved and go with this process", left)
        else:
            log.info("export grace: every live sequence has left")

    @property
    def registry(self) -> Registry:
        return self.servicer.gate.registry


async def build_server(config: ServerConfig) -> App:
    """Binds ``config.host:config.port`` (0 picks a free port) and starts serving health."""
    instance_id = uuid.uuid4().hex
    tokens = TokenTable.load(config.auth_tokens) if config.auth_tokens else None
    # no SO_REUSEPORT (gRPC sets it by default on Linux): a second server on a serving
    # server's port must fail to start, not quietly take half of its connections
    options = channel_options(config.executor.max_message_bytes) + KEEPALIVE_SERVER_OPTIONS + [("grpc.so_reuseport", 0)]
    server = grpc.aio.server(options=options,
                             interceptors=[AuthInterceptor(tokens)] if tokens else None)
    metrics = None
    if config.metrics_port is not None:
        from .rpc.metrics import Metrics

        metrics = Metrics(lambda: [w.executor for w in list(servicer.gate.workers.values())],
                          transfers=lambda: servicer.transfer_figures())
    health = HealthServicer()
    registry = Registry(config.executor, instance_id, health, warmup=config.warmup,
                        remeasure=config.remeasure)
    push = PushConfig(parse_allow(config.push_allow), tls=bool(config.tls_cert), ca=config.push_ca,
                      cert=config.tls_cert, key=config.tls_key, max_message_bytes=config.executor.max_message_bytes,
                      timeout_s=config.push_timeout_s)
    servicer = ExecutorServicer(instance_id, tokens, metrics, shared_memory=config.shared_memory_enabled,
                                admin_tenants=config.admin_tenants, registry=registry, push=push,
                                transfer_budget_bytes=config.transfer_budget_bytes,
                                import_idle_s=config.import_idle_timeout_s)
    add_executor_service(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection((SERVICE_NAME, HEALTH_NAME, reflection.SERVICE_NAME), server)
    address = f"{config.host}:{config.port}"
    if config.port and (refused := _plain_bind_error(config.host, config.port)) is not None:
        raise refused
    try:
        if config.tls_cert:
            port = server.add_secure_port(address, _tls_credentials(config))
        else:
            port = server.add_insecure_port(address)
    except RuntimeError:  # gRPC says only "Failed to bind"; find out why
        raise _bind_error(config.host, config.port) from None
    security = ("mTLS" if config.tls_client_ca else "TLS" if config.tls_cert else "plaintext") + \
        (", bearer tokens" if tokens else ", no authentication")
    for name in ("", SERVICE_NAME):
        await health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    await server.start()
    log.info("listening on %s:%d (instance %s) with %s", config.host, port, instance_id, security)
    port_file = PortFile(config.port_file) if config.port_file else None
    if port_file:
        host = f"[{config.host}]" if ":" in config.host and not config.host.startswith("[") else config.host
        try:
            port_file.write(address=f"{host}:{port}", host=config.host, port=port, instance_id=instance_id,
                            state="listening")
        except StartupError:
            await server.stop(None)
            raise
    try:
        metrics_port = metrics.serve(config.metrics_port, config.metrics_host) if metrics else None
    except OSError as exc:
        await server.stop(None)
        raise StartupError(f"cannot serve metrics on {config.metrics_host}:{config.metrics_port} "
                           f"(--metrics-host/--metrics-port): {exc.strerror or exc}") from None
    return App(config, server, port, servicer, health, metrics_port, port_file)


def _tls_credentials(config: ServerConfig) -> grpc.ServerCredentials:
    """The server's TLS credentials, the files checked first (``preflight.check_tls_files``):
    gRPC's own failure says only that it could not bind."""
    check_tls_files(config)
    return TlsFiles(config.tls_cert, config.tls_key, config.tls_client_ca).credentials()


def _bind_error(host: str, port: int) -> StartupError:
    """Why ``host:port`` cannot be bound, found by trying it with a plain socket."""
    return _plain_bind_error(host, port) or StartupError(
        f"cannot listen on {host}:{port} (--host/--port): gRPC could not bind it")


def _plain_bind_error(host: str, port: int) -> StartupError | None:
    """Why a plain socket cannot bind ``host:port``, or None where it can: tried before
    gRPC binds a fixed port, so a port in use is one line of ours and no gRPC log."""
    import socket

    try:
        for family, kind, proto, _, address in socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM,
                                                                  flags=socket.AI_PASSIVE):
            with socket.socket(family, kind, proto) as probe:
                # as gRPC binds: a port whose last connections linger (TIME_WAIT) is free
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind(address)
    except socket.gaierror as exc:
        why = f"cannot resolve the address ({exc.strerror or exc})"
    except OSError as exc:
        why = exc.strerror or str(exc)
    except (OverflowError, ValueError, UnicodeError) as exc:
        why = str(exc)
    else:
        return None
    return StartupError(f"cannot listen on {host}:{port} (--host/--port): {why}")


async def serve(config: ServerConfig) -> None:
    """Runs until SIGTERM/SIGINT, then drains; ``config`` has passed ``preflight`` (the
    CLI runs it before importing torch).  A server that cannot start (see
    :class:`StartupError`: address, a model that does not load) raises StartupError
    naming the problem and the option."""
    app = await build_server(config)
    try:
        await _run(app)
    finally:
        if app.port_file:
            app.port_file.remove()


async def _run(app: App) -> None:
    config = app.config
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    lost: asyncio.Future = loop.create_future()
    if config.executor.tensor_parallel > 1:
        from .parallel import group as tp

        tp.on_lost(lambda error: loop.call_soon_threadsafe(
            lambda: None if lost.done() else lost.set_result(error)))
    loader = asyncio.create_task(app.load())
    stopped = asyncio.create_task(stop.wait())
    await asyncio.wait([loader, stopped, lost], return_when=asyncio.FIRST_COMPLETED)
    if not lost.done() and loader.done() and not loader.exception():
        await asyncio.wait([stopped, lost], return_when=asyncio.FIRST_COMPLETED)
    if lost.done():
        loader.cancel()
        await app.fail_closed(lost.result())
        raise lost.result()
    if loader.done() and loader.exception():
        await app.server.stop(None)
        exc = loader.exception()
        if isinstance(exc, StartupError):
            raise exc
        # loading is in order: the failed model is the first one not serving
        spec = next((s for s in config.models if s.name not in app.servicer.gate.workers), None)
        where = f"--model {spec.name}={spec.path}" if spec else "--model"
        raise StartupError(f"{where}: cannot load it: {type(exc).__name__}: {exc}") from exc
    loader.cancel()
    await app.drain(config.grace_s)


class BackgroundServer:
    """A server on its own event-loop thread, for tests, benchmarks and notebooks.

    Usage: ``with BackgroundServer(config) as srv: ExecutorClient(srv.target)``.
    """

    def __init__(self, config: ServerConfig):
        self.config = config
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="grpc-server", daemon=True)
        self._thread.start()
        self.app: App = self._run(build_server(config))
        self._run(self.app.load())

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    @property
    def target(self) -> str:
        return f"{self.config.host}:{self.app.port}"

    def stop(self, grace_s: float = 5.0) -> None:
        if self.loop.is_running():
            self._run(self.app.drain(grace_s))
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join()

    def __enter__(self) -> BackgroundServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
