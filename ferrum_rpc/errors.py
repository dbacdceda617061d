"""The error table: every failure the executor reports, mapped in one place.

The reasons, their status codes and whether each is retryable or leaves the outcome
unknown are read from the proto's ``ErrorReason`` (its value options), the one
definition every language's table comes from.  Server and client share this module:
the server turns an :class:`ExecutorError` into a gRPC status whose details carry a
``google.rpc.ErrorInfo`` with the reason; the client turns that status back into the
same exception class, so caller code can ``except CacheNotFound`` whether it runs
in-process or remote.
"""

from __future__ import annotations

import enum

import grpc

from ferrum_rpc.v1 import executor_pb2 as _pb

ERROR_DOMAIN = "ferrum.executor.v1"


def _table() -> dict[str, tuple[grpc.StatusCode, bool, bool]]:
    """The proto's error table (``ErrorReason`` and its value options): reason name ->
    (status code, retryable, outcome unknown)."""
    codes = {c.value[0]: c for c in grpc.StatusCode}
    rows = {}
    for value in _pb.ErrorReason.DESCRIPTOR.values:
        if value.number:
            options = value.GetOptions().Extensions
            rows[value.name] = (codes[options[_pb.status_code]], options[_pb.retryable], options[_pb.outcome_unknown])
    return rows


_TABLE = _table()

# Machine-readable reasons (``ErrorInfo.reason``): the proto's ErrorReason values, by name.
Reason = enum.Enum("Reason", {name: name for name in _TABLE}, type=str, module=__name__, qualname="Reason")

STATUS_FOR_REASON: dict[Reason, grpc.StatusCode] = {Reason(name): row[0] for name, row in _TABLE.items()}
RETRYABLE: frozenset[Reason] = frozenset(Reason(name) for name, row in _TABLE.items() if row[1])
OUTCOME_UNKNOWN: frozenset[Reason] = frozenset(Reason(name) for name, row in _TABLE.items() if row[2])
# A status without a reason of the table (the connection, a deadline, a cancel): whether
# the call may have run (see the proto's ``outcome_unknown`` option).
UNKNOWN_OUTCOME_CODES = frozenset({grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED,
                                   grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL})


class ExecutorError(Exception):
    """A failure of an executor call; ``reason`` is None for statuses outside the table.

    Attributes:
        reason: the table's reason, or None (e.g. UNIMPLEMENTED, DEADLINE_EXCEEDED).
        code: the gRPC status code.
        message: human-readable detail.
    """

    reason: Reason | None = None

    def __init__(self, message: str, *, code: grpc.StatusCode | None = None):
        super().__init__(message)
        self.message = message
        if code is None:
            code = STATUS_FOR_REASON.get(self.reason, grpc.StatusCode.INTERNAL)
        self.code = code

    def __str__(self) -> str:
        tag = self.reason.value if self.reason else self.code.name
        return f"{tag}: {self.message}"

    @property
    def retryable(self) -> bool:
        """The call changed nothing and may succeed if made again (later, or elsewhere)."""
        return self.reason in RETRYABLE if self.reason else self.code is grpc.StatusCode.UNAVAILABLE

    @property
    def outcome_unknown(self) -> bool:
        """The caller cannot tell whether the call took effect."""
        return self.reason in OUTCOME_UNKNOWN if self.reason else self.code in UNKNOWN_OUTCOME_CODES


class DeadlineExceeded(ExecutorError):
    """The caller's deadline passed before the work finished; the work was undone."""

    def __init__(self, message: str):
        super().__init__(message, code=grpc.StatusCode.DEADLINE_EXCEEDED)


class Cancelled(ExecutorError):
    """The caller went away (cancelled, disconnected); the work was stopped and undone."""

    def __init__(self, message: str):
        super().__init__(message, code=grpc.StatusCode.CANCELLED)


def shown(text: str, limit: int = 48) -> str:
    """A caller-supplied string as it may appear in an error: quoted and cut to ``limit``
    characters, so no error echoes unbounded input (16 KB ids, say) into trailers."""
    if len(text) <= limit:
        return repr(text)
    return repr(text[:limit]) + f"... ({len(text)} characters)"


class CacheNotFound(ExecutorError):
    reason = Reason.CACHE_NOT_FOUND


class CacheExpired(CacheNotFound):
    """The sequence was reclaimed after sitting idle past the server's timeout."""

    reason = Reason.CACHE_EXPIRED


class StaleHandle(ExecutorError):
    reason = Reason.STALE_HANDLE


class LengthMismatch(ExecutorError):
    reason = Reason.LENGTH_MISMATCH


class InvalidInput(ExecutorError):
    reason = Reason.INVALID_INPUT


class SequenceTooLong(ExecutorError):
    reason = Reason.SEQUENCE_TOO_LONG


class KvCapacityExhausted(ExecutorError):
    reason = Reason.KV_CAPACITY_EXHAUSTED


class ModelNotFound(ExecutorError):
    reason = Reason.MODEL_NOT_FOUND


class ModelLoading(ExecutorError):
    reason = Reason.MODEL_LOADING


class Draining(ExecutorError):
    reason = Reason.DRAINING


class Unauthenticated(ExecutorError):
    """No bearer token, or one the server does not know (``--auth-tokens``)."""

    reason = Reason.UNAUTHENTICATED


class SequenceLimitExceeded(ExecutorError):
    """Too many live sequences: the caller's tenant cap or the server's (``--max-sequences``)."""

    reason = Reason.SEQUENCE_LIMIT_EXCEEDED


class TenantQuotaExceeded(ExecutorError):
    """The caller's tenant would hold more KV than ``--tenant-kv-tokens``."""

    reason = Reason.TENANT_QUOTA_EXCEEDED


class SharedMemoryNotFound(ExecutorError):
    """The caller's tenant has no shared-memory region of that name (never registered,
    unregistered, or its registration stream ended)."""

    reason = Reason.SHARED_MEMORY_NOT_FOUND


class AdminOnly(ExecutorError):
    """A model-registry change (LoadModel, UnloadModel) by a tenant that is not an admin."""

    reason = Reason.ADMIN_ONLY


class RankLost(ExecutorError):
    """A tensor-parallel rank died or hung: the server no longer serves (it exits so a
    supervisor restarts it); its sequences are gone, as with any dead server."""

    reason = Reason.TENSOR_PARALLEL_RANK_LOST
class FingerprintMismatch(ExecutorError):
    """An export from a server whose KV is not compatible with this one's (weights,
    dtype, quantization, KV layout, block size or tensor-parallel degree differ)."""

    reason = Reason.FINGERPRINT_MISMATCH


class TransferCorrupted(ExecutorError):
    """An import stream whose checksum does not match, or that ended before its trailer."""

    reason = Reason.TRANSFER_CORRUPTED


class TicketNotFound(ExecutorError):
    """No import ticket of that value for this tenant (never issued, or another tenant's)."""

    reason = Reason.TICKET_NOT_FOUND


class TicketExpired(ExecutorError):
    """The import ticket's time to live has passed."""

    reason = Reason.TICKET_EXPIRED


class TicketUsed(ExecutorError):
    """The import ticket was used already (or is being used by another push now)."""

    reason = Reason.TICKET_USED


class PushTargetRefused(ExecutorError):
    """PushSequence named a receiver this server may not connect to (``--push-allow``)."""

    reason = Reason.PUSH_TARGET_REFUSED


class NonFiniteLogits(ExecutorError):
    """The model's logits for a token the server was asked to choose hold a NaN or an
    infinity (a sequence whose KV state is corrupt, or weights that overflow): no token
    can be chosen.  Only that call fails and it changes nothing; the other rows of the
    same forward are served."""

    reason = Reason.NON_FINITE_LOGITS


class TransferBudgetExhausted(ExecutorError):
    """An import would buffer more KV than the server's in-flight transfer budget
    (``--transfer-budget-mb``) leaves while other imports are streaming."""

    reason = Reason.TRANSFER_BUDGET_EXHAUSTED


class TransferStalled(ExecutorError):
    """An import stream sent nothing for longer than the server's limit
    (``--import-idle-timeout``); it was ended and what it buffered freed."""

    reason = Reason.TRANSFER_STALLED


class FailoverFailed(ExecutorError):
    """Client side, never on the wire: a replica-set client could not move a sequence
    (or place a new one) onto a healthy replica within its bounds (attempts, seconds).

    The call changed nothing the caller can see: the sequence's handle still names
    what the client held before the call.

    Attributes:
        cause: the error that started the failover (or the last one met while trying).
        attempts: the replicas tried.
    """

    def __init__(self, message: str, *, cause: ExecutorError | None = None, attempts: int = 0):
        super().__init__(message, code=grpc.StatusCode.UNAVAILABLE)
        self.cause, self.attempts = cause, attempts


class NotServing(grpc.FutureTimeoutError, TimeoutError):
    """Client side, never on the wire: ``wait_ready`` ran out of time before the server
    served the model.  The message names the target, the model and what was last seen
    (no connection, the server still loading, the model still loading).  A
    ``grpc.FutureTimeoutError`` (what ``wait_ready`` raised when it waited only for the
    connection) and a ``TimeoutError``."""


class StartupError(ValueError):
    """Never on the wire: a server that cannot start as configured (a token or TLS
    file missing, unreadable or invalid, a model folder that is none, an address it
    cannot bind, options that do not go together).  The message names the problem
    and the file or option; ``ferrum-rpc serve`` prints it as one line and exits 2."""


class AdapterNotFound(ExecutorError):
    """The call names a LoRA adapter the model does not hold (never loaded, unloaded,
    or evicted to make room): ListAdapters shows those it holds."""

    reason = Reason.ADAPTER_NOT_FOUND


class AdapterInvalid(ExecutorError):
    """A LoRA adapter folder the server cannot serve: the message names the field of
    adapter_config.json or the tensor that is wrong (an unsupported option, a module
    the model lacks, a rank over --max-lora-rank, shapes of another architecture)."""

    reason = Reason.ADAPTER_INVALID


class AdapterInUse(ExecutorError):
    """The adapter has live sequences: release them (or let them expire) first."""

    reason = Reason.ADAPTER_IN_USE


class AdapterLimitExceeded(ExecutorError):
    """No room for another adapter: every slot (--max-adapters) or the byte budget is
    held by adapters with live sequences."""

    reason = Reason.ADAPTER_LIMIT_EXCEEDED


class WeightsChanged(ExecutorError):
    """The model's weights were updated with invalidate_sequences: the sequences that
    lived then were dropped (their KV came from the old weights).  Start a new one."""

    reason = Reason.WEIGHTS_CHANGED


class RequestIdExists(ExecutorError):
    """A Prefill named its new sequence with a request_id that already names a live
    sequence of the caller's tenant, made by the same prompt (the same tokens and
    adapter): a retry of a call whose reply was lost.  Nothing was done; ``handle`` is
    that sequence's handle as it is now (the status carries it as a KvCacheHandle
    detail).  The typed clients answer such a retry with it (``PrefillOutput.existing``)."""

    reason = Reason.REQUEST_ID_EXISTS

    def __init__(self, message: str, *, code: grpc.StatusCode | None = None, handle=None):
        super().__init__(message, code=code)
        self.handle = handle


class RequestIdTaken(ExecutorError):
    """A Prefill's request_id names a live sequence of the caller's tenant that another
    prompt (other tokens or another adapter) made: names are unique among a tenant's
    live sequences.  Nothing was done."""

    reason = Reason.REQUEST_ID_TAKEN


class RequestIdBusy(RequestIdTaken):
    """Server side: the request_id's sequence is still being made by an earlier call
    (its outcome unknown yet); the model worker holds the new call until that one ends.
    On the wire it is REQUEST_ID_TAKEN."""


ERROR_CLASSES: dict[Reason, type[ExecutorError]] = {
    cls.reason: cls
    for cls in (
        CacheNotFound,
        CacheExpired,
        StaleHandle,
        LengthMismatch,
        InvalidInput,
        SequenceTooLong,
        KvCapacityExhausted,
        ModelNotFound,
        ModelLoading,
        Draining,
        Unauthenticated,
        SequenceLimitExceeded,
        TenantQuotaExceeded,
        SharedMemoryNotFound,
        AdminOnly,
        RankLost,
        FingerprintMismatch,
        TransferCorrupted,
        TicketNotFound,
        TicketExpired,
        TicketUsed,
        PushTargetRefused,
        NonFiniteLogits,
        TransferBudgetExhausted,
        TransferStalled,
        AdapterNotFound,
        AdapterInvalid,
        AdapterInUse,
        AdapterLimitExceeded,
        WeightsChanged,
        RequestIdExists,
        RequestIdTaken,
    )
}


def to_status_proto(err: ExecutorError):
    """The ``google.rpc.Status`` message for an error: code, message and an ErrorInfo
    detail with the reason (and, for REQUEST_ID_EXISTS, a KvCacheHandle detail: the
    live sequence's handle).  Unary calls carry it in their trailers; DecodeSession
    replies carry the same message in their ``error`` field."""
    from google.protobuf import any_pb2
    from google.rpc import error_details_pb2, status_pb2

    detail = any_pb2.Any()
    detail.Pack(
        error_details_pb2.ErrorInfo(
            reason=err.reason.value if err.reason else err.code.name,
            domain=ERROR_DOMAIN,
        )
    )
    details = [detail]
    if getattr(err, "handle", None) is not None:
        from ferrum_rpc import convert
        details.append(any_pb2.Any())
        details[-1].Pack(convert.handle_to_proto(err.handle))
    return status_pb2.Status(code=err.code.value[0], message=str(err), details=details)


def to_rpc_status(err: ExecutorError):
    """Builds the ``grpc.Status`` (code, message, ErrorInfo detail) for an error."""
    from grpc_status import rpc_status

    return rpc_status.to_status(to_status_proto(err))


def _status_code(value: int) -> grpc.StatusCode:
    """The gRPC status code with this number; UNKNOWN for a number gRPC does not define."""
    return _CODES.get(value, grpc.StatusCode.UNKNOWN)


_CODES = {c.value[0]: c for c in grpc.StatusCode}


def from_status_proto(status, code: grpc.StatusCode | None = None) -> ExecutorError:
    """Rebuilds the typed error from a ``google.rpc.Status`` (a stream's in-band error,
    or a unary call's trailers).  Unknown codes and reasons give a plain ExecutorError;
    a KvCacheHandle detail becomes REQUEST_ID_EXISTS's ``handle``."""
    from google.rpc import error_details_pb2

    from ferrum_rpc import convert
    from ferrum_rpc.v1 import executor_pb2 as pb

    reason, handle = None, None
    for detail in status.details:
        if detail.Is(pb.KvCacheHandle.DESCRIPTOR):
            proto = pb.KvCacheHandle()
            detail.Unpack(proto)
            handle = convert.handle_from_proto(proto)
        elif detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            if info.domain == ERROR_DOMAIN and info.reason in Reason.__members__:
                reason = Reason(info.reason)
    cls = ERROR_CLASSES.get(reason, ExecutorError)
    prefix = f"{reason.value}: " if reason else ""
    err = cls(status.message.removeprefix(prefix), code=code or _status_code(status.code))
    if isinstance(err, RequestIdExists):
        err.handle = handle
    return err


def from_rpc_error(exc: grpc.RpcError) -> ExecutorError:
    """Rebuilds the typed error from a failed call (sync or asyncio)."""
    from google.rpc import status_pb2
    from grpc_status import rpc_status

    code = exc.code()
    try:
        status = rpc_status.from_call(exc)
    except ValueError:  # details disagree with code/message; keep what we have
        status = None
    if status is None:
        status = status_pb2.Status(code=code.value[0], message=exc.details() or "")
    return from_status_proto(status, code)
