"""The edge every RPC passes: requests parsed by our own deserializer (bytes that are no
valid message reach the handler as :class:`Malformed` and are answered INVALID_ARGUMENT /
INVALID_INPUT with one rate-limited log line, not UNKNOWN with a traceback), the one
wrapper around every handler (tenant, admission, metrics, error -> status), and the
service's registration with that deserializer."""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import time

import grpc

from ferrum_rpc.errors import ExecutorError, InvalidInput, to_rpc_status
from ferrum_rpc.v1 import executor_pb2 as pb
from . import tickets
from .auth import HANDLER_FACTORIES

log = logging.getLogger(__name__)


class Malformed:
    """Stands in for a request whose bytes did not parse as its message."""

    def __init__(self, why: str):
        self.why = why


class _RateLimitedLog:
    """At most one warning per ``every_s``; the rest are counted into the next one."""

    def __init__(self, every_s: float = 10.0):
        self.every_s, self._next, self._suppressed = every_s, 0.0, 0

    def warning(self, message: str) -> None:
        now = time.monotonic()
        if now < self._next:
            self._suppressed += 1
            return
        extra = f" ({self._suppressed} more since the last report)" if self._suppressed else ""
        log.warning("%s%s", message, extra)
        self._next, self._suppressed = now + self.every_s, 0


_malformed_log = _RateLimitedLog()


def _deserializer(cls):
    def parse(data: bytes):
        try:
            return cls.FromString(data)
        except Exception as exc:  # protobuf's DecodeError, and anything else a parser may raise
            why = f"the request is not a valid {cls.DESCRIPTOR.full_name} ({type(exc).__name__})"
            _malformed_log.warning(f"malformed request: {why}")
            return Malformed(why)
    return parse


DATA_TAG = b"\x12"  # WeightsChunk.data: field 2, length-delimited


def weights_chunk(parse):
    """UpdateWeights' deserializer: a message holding only ``data`` becomes a view of its
    payload in the bytes gRPC handed over (no copy); any other is ``parse``'d."""
    def read(message: bytes):
        if message[:1] == DATA_TAG:
            length, at, shift = 0, 1, 0
            while at < len(message) and at < 11:  # a varint: 7 bits a byte, high bit set on all but the last
                byte = message[at]
                length, at, shift = length | (byte & 0x7F) << shift, at + 1, shift + 7
                if not byte & 0x80:
                    if at + length == len(message):
                        return memoryview(message)[at:]
                    break
        return parse(message)
    return read


def _serialize(message) -> bytes:
    """Replies built off the loop arrive serialized already."""
    return message if isinstance(message, bytes) else message.SerializeToString()


def check_parsed(request) -> None:
    if isinstance(request, Malformed):
        raise InvalidInput(request.why)


def add_executor_service(servicer, server: grpc.aio.Server) -> None:
    """Registers the ModelExecutor service with our deserializer and serializer
    (the generated ``add_ModelExecutorServicer_to_server`` would let a parse error
    become UNKNOWN with a traceback); UpdateWeights' data messages reach it unparsed."""
    service = pb.DESCRIPTOR.services_by_name["ModelExecutor"]
    handlers = {}
    for method in service.methods:
        parse = _deserializer(getattr(pb, method.input_type.name))
        handlers[method.name] = HANDLER_FACTORIES[method.client_streaming, method.server_streaming](
            servicer.rpc(method.name),
            request_deserializer=weights_chunk(parse) if method.name == "UpdateWeights" else parse,
            response_serializer=_serialize,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))


def as_executor_error(exc: Exception) -> ExecutorError:
    if isinstance(exc, ExecutorError):
        return exc
    log.exception("internal error", exc_info=exc)
    return ExecutorError(f"internal error: {type(exc).__name__}: {exc}", code=grpc.StatusCode.INTERNAL)


async def _abort(context: grpc.aio.ServicerContext, exc: Exception) -> None:
    await context.abort_with_status(to_rpc_status(as_executor_error(exc)))


def handler(*, admit: bool = True, admin: bool = False, observe: bool = True, ticketed: bool = False):
    """The one wrapper around every RPC (a method of the servicer or of one of its parts,
    each holding the server's ``gate``): a request that did not parse is refused,
    the caller's tenant is found (and passed to the method as its last
    argument: every call below takes it explicitly), admin-only calls are checked, ``admit`` calls
    pass admission (draining, loading) and count as in flight, the call is
    observed for the metrics (``observe=False``: the method observes itself, per
    step or at its answer), and any error becomes its status.

    Queries (``admit=False``) are answered while draining too, so callers see the
    state.  A streaming method is written as an async generator, but served as a
    coroutine that hands each reply to ``context.write``: when the call ends early
    (cancelled, deadline, disconnect) gRPC cancels this coroutine, the
    CancelledError rises from the ``write`` it waits in, and the generator is
    closed there and then, so its ``except``/``finally`` undo at once.  Served as
    a generator, a call cancelled while gRPC was sending would leave the
    generator suspended at its ``yield`` until the garbage collector found it.

    ``ticketed`` (ImportSequence): a call carrying an import ticket runs as the
    ticket's tenant, the ticket claimed for the call and used up if it succeeds."""

    def wrap(method):
        def enter(self, request, context, stack: contextlib.ExitStack) -> str:
            """The caller's tenant, once the call may run."""
            check_parsed(request)  # a client stream's messages are checked one by one
            gate = self.gate
            if gate.lost is not None:  # a tensor-parallel rank is gone: nothing is answered again
                raise gate.lost
            presented = tickets.ticket_of(context.invocation_metadata()) if ticketed else None
            if presented is not None:
                if admit:
                    stack.enter_context(gate.admit())
                return stack.enter_context(self.redeemed(*presented)).tenant
            tenant = gate.tenant_of(context)
            if admin:
                gate.check_admin(tenant)
            if admit:
                stack.enter_context(gate.admit())
            return tenant

        async def served(self, request, context, body):
            """``body(tenant)`` once the call may run; its error becomes the call's status."""
            start, tenant = time.perf_counter(), ""
            try:
                with contextlib.ExitStack() as stack:
                    tenant = enter(self, request, context, stack)
                    reply = await body(tenant)
            except Exception as exc:
                if observe:
                    self.gate.observe(method.__name__, tenant, exc, start)
                await _abort(context, exc)
            else:
                if observe:
                    self.gate.observe(method.__name__, tenant, None, start, getattr(reply, "timing", None))
                return reply

        if inspect.isasyncgenfunction(method):
            @functools.wraps(method)
            async def stream(self, request, context):
                async def write_all(tenant: str) -> None:
                    async with contextlib.aclosing(method(self, request, context, tenant)) as replies:
                        async for reply in replies:
                            await context.write(reply)  # see the docstring
                await served(self, request, context, write_all)
            return stream

        @functools.wraps(method)
        async def unary(self, request, context):
            return await served(self, request, context, lambda tenant: method(self, request, context, tenant))
        return unary
    return wrap


query = handler(admit=False)  # answered while draining too
call = handler()
