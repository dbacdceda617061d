"""What every RPC passes, shared by the servicer and its parts (transfers, admin,
KV events, weights): who the caller is (its tenant, whether it is an admin), whether
the server admits the call now (loading, serving, draining, a rank lost), which
model's worker serves it, and the metrics that observe it."""

from __future__ import annotations

import asyncio
import time

import grpc

from ferrum_rpc.errors import AdminOnly, Draining, ExecutorError, ModelLoading, Unauthenticated, shown
from ferrum_rpc.types import ServerState
from ..engine.facade import ModelWorker
from .auth import TokenTable
from .hosting import HostedModels


class Gate:
    """One server's entry state (``state``, ``lost``, calls in flight) and the questions
    every handler asks of it."""

    def __init__(self, instance_id: str, registry: HostedModels, tokens: TokenTable | None = None,
                 admin_tenants: tuple[str, ...] = (), metrics=None):
        self.instance_id = instance_id
        self.registry = registry  # the models hosted, and how they are loaded and unloaded
        self.tokens = tokens  # None: auth off, every caller is tenant ""
        self.admin_tenants = frozenset(admin_tenants)
        self.metrics = metrics  # server.metrics.Metrics, or None
        self.state = ServerState.LOADING
        self.lost: ExecutorError | None = None  # set once a tensor-parallel rank is lost (App.fail_closed)
        self.inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def workers(self) -> dict[str, ModelWorker]:
        """The serving models' workers by name (the registry's routing table)."""
        return self.registry.workers

    def worker(self, model: str) -> ModelWorker:
        """The worker serving ``model`` ("" = the default), or the precise refusal."""
        if self.state is ServerState.LOADING and not self.workers:
            raise ModelLoading("the model is still loading")
        return self.registry.worker(model)

    # -- the caller ------------------------------------------------------------------------
    def tenant_of(self, context) -> str:
        """The tenant the caller's bearer token names ("" with auth off).  The
        AuthInterceptor has refused calls without a known token already (it guards
        health and reflection too); this is the one place a handler reads it."""
        if self.tokens is None:
            return ""
        tenant = self.tokens.tenant_for(context.invocation_metadata())
        if tenant is None:  # unreachable behind the interceptor; never serve as tenant ""
            raise Unauthenticated("no known bearer token")
        return tenant

    def is_admin(self, tenant: str) -> bool:
        """Whether ``tenant`` is an admin: one of --admin-tenants, or anyone with tokens off."""
        return self.tokens is None or tenant in self.admin_tenants

    def check_admin(self, tenant: str) -> None:
        if not self.is_admin(tenant):
            raise AdminOnly(f"loading and unloading models is for admin tenants (--admin-tenants); "
                            f"{shown(tenant)} is not one")

    # -- admission -------------------------------------------------------------------------
    class _Admission:
        def __init__(self, gate: Gate):
            self.gate = gate

        def __enter__(self):
            g = self.gate
            if g.state is ServerState.DRAINING:
                raise Draining("the server is shutting down")
            g.inflight += 1
            g._idle.clear()

        def __exit__(self, *exc):
            g = self.gate
            g.inflight -= 1
            if g.inflight == 0:
                g._idle.set()

    def admit(self) -> Gate._Admission:
        """A call in flight: refused while draining, counted until it ends."""
        return self._Admission(self)

    async def wait_idle(self) -> None:
        """Returns once no RPC is in flight."""
        await self._idle.wait()

    def observe(self, method: str, tenant: str, error: Exception | None, start: float, timing=None) -> None:
        if self.metrics is not None:
            if error is None:
                code = "OK"
            else:
                code = error.code.name if isinstance(error, ExecutorError) else grpc.StatusCode.INTERNAL.name
            self.metrics.observe(method, code, tenant, time.perf_counter() - start, timing)
