"""What handlers read off a call at the edge of the server: its deadline on the
worker's clock, and the handle a request must carry.  Shared by the servicer, the
DecodeSession and the transfer RPCs."""

from __future__ import annotations

import time

from ferrum_rpc import convert
from ferrum_rpc.errors import DeadlineExceeded, InvalidInput
from ferrum_rpc.metadata import DEADLINE_HEADER
from ferrum_rpc.types import KvCacheHandle



def deadline_of(context) -> float | None:
    """The caller's deadline on the worker's clock (None: it waits forever).

    The earlier of gRPC's own (a relative timeout, which this server counts from when it
    read the call's headers) and the absolute one a client may send as
    ``ferrum-deadline-unix-ns`` (wall-clock ns since the epoch, counted from when the
    caller sent the call; it relies on the two clocks agreeing, as on loopback).  Without
    it, a call that sat in the socket of a frozen or stalled server past its deadline
    would run on resume with a fresh one, after its caller gave up.  A call whose deadline
    has passed is refused here, before it is queued, and changes nothing (the worker
    refuses a queued job whose deadline passed, ``Job.gone``)."""
    now = time.monotonic()
    remaining = context.time_remaining()
    deadline = None if remaining is None else now + remaining
    for key, value in context.invocation_metadata() or ():
        if key == DEADLINE_HEADER:
            try:
                absolute = now + (int(value) - time.time_ns()) / 1e9
            except ValueError:  # advisory: an unreadable value is ignored
                break
            deadline = absolute if deadline is None else min(deadline, absolute)
            break
    if deadline is not None and deadline <= now:
        raise DeadlineExceeded("the caller's deadline passed before the call was read; nothing was done")
    return deadline


def required_handle(message) -> KvCacheHandle:
    """The request's ``kv_cache`` handle (INVALID_INPUT when it has none)."""
    if not message.HasField("kv_cache"):
        raise InvalidInput("kv_cache is required")
    return convert.handle_from_proto(message.kv_cache)
