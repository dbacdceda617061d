"""The RPCs of sequences that move: ExportSequence, ImportSequence,
CreateImportTicket and PushSequence, a part of the servicer.

They translate, as every handler does; what a stream holds and how it is checked
is ``engine/transfer.py``.  A push makes this server the client of the receiver's
ImportSequence: it presents only the ticket the receiver issued to the caller's
tenant (and says which tenant that is, so a ticket of another tenant is refused),
never the caller's credentials, over TLS when this server serves TLS.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import grpc

from ferrum_rpc import convert
from ferrum_rpc.errors import (
    Draining,
    ExecutorError,
    FingerprintMismatch,
    InvalidInput,
    Reason,
    TransferCorrupted,
    TransferStalled,
    from_rpc_error,
    shown,
)
from ..engine.facade import transfer
from . import tickets
from .edge import deadline_of, required_handle
from .gate import Gate
from .push import PUSH_FAILED, PushConfig
from .handler import call, handler
from ferrum_rpc.metadata import TENANT_HEADER, TICKET_HEADER
from ferrum_rpc.types import ServerState
from ferrum_rpc.v1 import executor_pb2 as pb
from ferrum_rpc.v1 import executor_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


class ImportReads:
    """How one import stream is read: each message waited for at most ``idle_s``
    (TRANSFER_STALLED past it); :meth:`end` (a drain) ends the stream at its next read,
    or the one it waits in, with DRAINING."""

    def __init__(self, idle_s: float):
        self.idle_s = idle_s
        self.ending = False
        self._read: asyncio.Future | None = None  # the read waited for now

    async def next(self, messages):
        """The stream's next message; None once the caller closed it."""
        if not self.ending:
            self._read = read = asyncio.ensure_future(anext(messages))
            try:
                done, _ = await asyncio.wait((read,), timeout=self.idle_s)
            finally:  # a timeout, or this call cancelled: the read goes too
                self._read = None
                read.cancel()
            if not done:
                raise TransferStalled(f"the import stream sent nothing for {self.idle_s:g} s "
                                      "(--import-idle-timeout): ended, and what it buffered freed")
            if not read.cancelled():
                try:
                    return read.result()
                except StopAsyncIteration:
                    return None
        raise Draining("the server is shutting down: the import was not finished; import it elsewhere")

    def end(self) -> None:
        self.ending = True
        if self._read is not None:
            self._read.cancel()


class TransferRpcs:
    """The transfer RPCs (ExportSequence, ImportSequence, CreateImportTicket,
    PushSequence), a part of the servicer: the tickets this server issued, where a push
    may go, and the bytes and calls transfers hold."""

    def __init__(self, gate: Gate, push: PushConfig, budget_bytes: int, import_idle_s: float):
        self.gate = gate
        self.tickets = tickets.TicketBook()  # import tickets issued here
        self.push = push  # where PushSequence may connect, and how
        self.budget = transfer.TransferBudget(budget_bytes, self._largest_pool_bytes)  # what imports buffer
        self.import_idle_s = import_idle_s
        self._imports: set[ImportReads] = set()  # the imports running (a drain ends them)
        self.transfers = 0  # exports, pushes and imports running now (a draining server waits for them)
        self.pushes = 0  # pushes running now (each with a channel of its own)

    def _largest_pool_bytes(self) -> int:
        """The default in-flight transfer budget: the largest hosted KV pool's bytes."""
        return max((transfer.pool_bytes(w.executor) for w in list(self.gate.workers.values())), default=0)

    @contextlib.contextmanager
    def _transfer(self):
        self.transfers += 1
        try:
            yield
        finally:
            self.transfers -= 1

    def transfer_figures(self) -> dict[str, int]:
        """GetStatus' and the metrics' view of transfers (server-wide, every model)."""
        return dict(imports_in_flight=self.budget.imports, transfer_bytes_in_flight=self.budget.buffered,
                    transfer_budget_bytes=self.budget.limit, pushes_in_flight=self.pushes)

    @contextlib.contextmanager
    def _importing(self):
        """An import call: refused while draining, counted, and ended by :meth:`end_imports`.
        It is not an in-flight call (its caller sets its pace): a drain does not wait
        for it past the export grace."""
        if self.gate.state is ServerState.DRAINING:
            raise Draining("the server is shutting down")
        reads = ImportReads(self.import_idle_s)
        self._imports.add(reads)
        self.budget.imports += 1
        try:
            with self._transfer():
                yield reads
        finally:
            self.budget.imports -= 1
            self._imports.discard(reads)

    def end_imports(self) -> None:
        """Ends every import still reading its stream (a drain, once its grace is over)."""
        for reads in list(self._imports):
            reads.end()

    def _chunk_bytes(self, worker, asked: int) -> int:
        limit = worker.executor.config.max_message_bytes
        return min(asked or transfer.DEFAULT_CHUNK_BYTES, limit)

    @staticmethod
    def _check_unsplit(worker, rpc: str) -> None:
        """A tensor-parallel server's KV is split by head over its ranks: rank 0 alone
        cannot export or import a whole sequence (not built yet)."""
        if getattr(worker.executor, "shard", None) is not None:
            raise ExecutorError(f"{rpc} is not served with --tensor-parallel yet: each rank holds only its KV "
                                f"heads", code=grpc.StatusCode.UNIMPLEMENTED)

    async def _snapshot(self, request, context, tenant: str):
        worker = self.gate.worker(request.model or request.kv_cache.model)
        self._check_unsplit(worker, "exporting a sequence")
        snap = await worker.front.call(transfer.snapshot, worker.executor, required_handle(request), tenant,
                                 deadline=deadline_of(context))
        return worker, snap

    @handler(admit=False)
    async def ExportSequence(self, request, context, tenant: str):
        """Header, KV chunks, trailer (see ``transfer.export_messages``); the sequence is unchanged."""
        with self._transfer():
            worker, snap = await self._snapshot(request, context, tenant)
            for message in transfer.export_messages(snap, self._chunk_bytes(worker, request.chunk_bytes)):
                yield message

    @contextlib.contextmanager
    def redeemed(self, secret: str, stated_tenant: str):
        """A ticketed import's tenant: the ticket is claimed for the call, used if it
        succeeds, given back (within its lifetime) if it fails."""
        ticket = self.tickets.claim(secret, stated_tenant)
        try:
            yield ticket
        except BaseException:
            self.tickets.finish(ticket, ok=False)
            raise
        self.tickets.finish(ticket, ok=True)

    def _import_target(self, header: pb.SequenceHeader, ticket: tickets.Ticket | None):
        """The worker an import goes to: the ticket's model, else the hosted model with
        the stream's fingerprint (its own name first), else the default one (which
        then refuses it with the precise difference)."""
        if ticket is not None:
            return self.gate.worker(ticket.model), ticket.fingerprint
        workers = self.gate.workers
        named = workers.get(header.model)
        ordered = ([named] if named is not None else []) + list(workers.values())
        for worker in ordered:
            if transfer.fingerprint(worker.executor).digest == header.fingerprint.digest:
                return worker, None
        return self.gate.worker(""), None

    # An import admits itself (_importing): it is refused while draining, but a drain
    # does not wait for it past the export grace.
    @handler(admit=False, ticketed=True)
    async def ImportSequence(self, request_iterator, context, tenant: str):
        """Every message is checked as it arrives; the sequence is made in one worker job
        after the trailer (nothing is taken before); a cancelled import is undone."""
        presented = tickets.ticket_of(context.invocation_metadata())
        ticket = self.tickets.claimed(presented[0]) if presented else None
        receiver, worker, incoming = None, None, None
        messages = aiter(request_iterator)
        with self._importing() as reads:
            try:
                while (message := await reads.next(messages)) is not None:
                    if not isinstance(message, pb.SequenceChunk):  # bytes that did not parse
                        raise InvalidInput(getattr(message, "why", "a malformed SequenceChunk"))
                    if receiver is None:
                        if message.WhichOneof("part") != "header":
                            raise InvalidInput("an import stream starts with its header")
                        worker, expected = self._import_target(message.header, ticket)
                        self._check_unsplit(worker, "ImportSequence")
                        receiver = transfer.Receiver(worker.executor, expected, self.budget, tenant)
                    receiver.take(message)
                if receiver is None:
                    raise TransferCorrupted("the import stream was empty: truncated")
                incoming = receiver.done()
                handle, _ = await worker.front.create(transfer.install, worker.executor, incoming, tenant,
                                                deadline=deadline_of(context), tenant=tenant)
            except ExecutorError as refusal:
                if not isinstance(refusal, (TransferStalled, Draining)):  # the caller may still be sending
                    if receiver is not None:
                        receiver.close()  # its bytes leave the budget first
                    await _read_out(messages)
                raise
            finally:  # however the call ended: the buffer goes (even while a traceback keeps
                # this frame) and its bytes leave the budget
                incoming = None
                if receiver is not None:
                    receiver.close()
        return pb.ImportSequenceResponse(kv_cache=convert.handle_to_proto(handle))

    @call
    async def CreateImportTicket(self, request, context, tenant: str):
        worker = self.gate.worker(request.model)
        self._check_unsplit(worker, "CreateImportTicket")
        ours = transfer.fingerprint(worker.executor).digest
        if request.fingerprint and request.fingerprint != ours:
            raise FingerprintMismatch(f"this server's fingerprint is {ours}, not {request.fingerprint[:64]!r}")
        ticket = self.tickets.issue(tenant, worker.executor.name, ours, request.ttl_s)
        return pb.ImportTicket(ticket=ticket.secret, ttl_s=ticket.expires - time.monotonic(), model=ticket.model)

    @handler(admit=False)
    async def PushSequence(self, request, context, tenant: str):
        """Streams a snapshot of the sequence to the receiver's ImportSequence; with
        ``move`` releases it here once the receiver confirmed (unless a call changed it
        meanwhile: then it stays and ``released`` is false)."""
        with self._transfer():
            self.pushes += 1
            try:
                return await self._push(request, context, tenant)
            finally:
                self.pushes -= 1

    async def _push(self, request, context, tenant: str):
        if not request.ticket:
            raise InvalidInput("ticket is required: ask the receiver for one (CreateImportTicket)")
        loop = asyncio.get_running_loop()
        address, host = await loop.run_in_executor(None, tickets.check_target, request.target, self.push.allowed)
        worker, snap = await self._snapshot(request, context, tenant)
        sent = 0

        def counted():
            nonlocal sent
            for message in transfer.export_messages(snap, self._chunk_bytes(worker, request.chunk_bytes)):
                sent += message.ByteSize()
                yield message

        start = time.perf_counter()
        remaining = context.time_remaining()
        timeout = self.push.timeout_s if remaining is None else remaining
        failed = None
        metadata = ((TICKET_HEADER, request.ticket), (TENANT_HEADER, tenant))
        async with self.push.channel(address, host) as channel:  # closed when the push ends
            stub = pb_grpc.ModelExecutorStub(channel)
            try:
                reply = await _stream_to(stub.ImportSequence(timeout=timeout, metadata=metadata), counted())
            except grpc.RpcError as exc:
                # Raised below, outside this handler: an error raised in it would keep the
                # gRPC error as its context, and through its traceback the call, which keeps
                # the closed channel's subchannel reconnecting to the target until the
                # garbage collector finds the cycle.
                failed = from_rpc_error(exc)
            if failed is not None and failed.reason is None and failed.code is grpc.StatusCode.INTERNAL:
                failed = await _ticket_refusal(stub, timeout, metadata) or failed
        if failed is not None and failed.reason is None:  # no refusal: unreachable, broken or hung
            log.warning("push of %s to %s (%s) failed after %.1f s: %s", snap.handle.cache_id, shown(request.target),
                        address, time.perf_counter() - start, failed)
            raise ExecutorError(PUSH_FAILED, code=grpc.StatusCode.ABORTED)
        if failed is not None:  # the receiver's refusal, as it gave it
            raise failed
        released = False
        if request.move:
            released = await worker.front.call(transfer.release_if_unchanged, worker.executor, snap, tenant)
        log.info("pushed %s (%d tokens, %d bytes) to %s in %.1f ms%s", snap.handle.cache_id, len(snap.tokens),
                 sent, request.target, 1e3 * (time.perf_counter() - start),
                 " and released it" if released else " (kept here)")
        return pb.PushSequenceResponse(kv_cache=reply.kv_cache, bytes_sent=sent, released=released)


TICKET_REASONS = (Reason.TICKET_NOT_FOUND, Reason.TICKET_EXPIRED, Reason.TICKET_USED)
READ_OUT_S = 2.0  # a refused import's remaining messages are read (and dropped) for at most this long
READ_OUT_PAUSE_S = 0.25  # ... or until the caller pauses this long


async def _read_out(messages) -> None:
    """Reads and drops what a refused import's caller still sends, until it closes its
    side, pauses or READ_OUT_S passes, before the refusal is answered.  A grpc.aio
    caller whose write meets an ended call is told INTERNAL "Internal error from
    Core" in place of the server's status (grpc/grpc#36066): our pushes, the async
    client and any asyncio caller then lost the reason.  Nothing is buffered."""
    loop = asyncio.get_running_loop()
    end = loop.time() + READ_OUT_S
    while (left := end - loop.time()) > 0:
        read = asyncio.ensure_future(anext(messages))
        try:
            done, _ = await asyncio.wait((read,), timeout=min(left, READ_OUT_PAUSE_S))
        finally:  # a pause, or this call cancelled: the read goes too
            read.cancel()
        if not done:
            return
        if read.cancelled() or read.exception() is not None:  # the caller's end (StopAsyncIteration), or gone
            return


async def _ticket_refusal(stub, timeout: float, metadata) -> ExecutorError | None:
    """What the receiver says of the ticket alone, asked with an ImportSequence that sends
    no message: a receiver that refused the ticket while we still wrote sometimes ends the
    call so that gRPC reports only "Internal error from Core".  The receiver checks the
    ticket before reading, and a ticket it would take is given back when the empty stream
    fails, so asking changes nothing.  None: not a ticket refusal."""
    call = stub.ImportSequence(timeout=timeout, metadata=metadata)
    try:
        with contextlib.suppress(Exception):
            await call.done_writing()
        await call
    except grpc.RpcError as exc:
        refusal = from_rpc_error(exc)
        return refusal if refusal.reason in TICKET_REASONS else None
    return None


async def _stream_to(call, messages) -> pb.ImportSequenceResponse:
    """Writes ``messages`` on a client-streaming call, then returns its reply.  A receiver
    that refuses early (a ticket it does not know) ends the call while we still write:
    the write then fails, and the call's own status, with the receiver's reason, is what
    is raised (gRPC's request-iterator form reports "Internal error from Core" instead)."""
    for message in messages:
        try:
            await call.write(message)
        except Exception:  # the call has ended (RpcError, InvalidStateError): its status says why
            break
        if call.done():
            break
    else:
        with contextlib.suppress(Exception):  # ended meanwhile: awaiting it raises its status
            await call.done_writing()
    return await call
