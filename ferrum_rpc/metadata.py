"""The gRPC metadata keys the contract defines (server and clients read these names)."""

from __future__ import annotations

import time

DEADLINE_HEADER = "ferrum-deadline-unix-ns"  # optional: the caller's absolute deadline, wall-clock ns
TICKET_HEADER = "ferrum-import-ticket"  # ImportSequence with a ticket: a push from another server
TENANT_HEADER = "ferrum-import-tenant"  # the tenant the pushing server's caller is (the ticket must be theirs)


def deadline_metadata(timeout: float | None) -> tuple[tuple[str, str], ...] | None:
    """The metadata of a call with ``timeout``: its absolute deadline (DEADLINE_HEADER)."""
    if timeout is None:
        return None
    return ((DEADLINE_HEADER, str(time.time_ns() + int(timeout * 1e9))),)
