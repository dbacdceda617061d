"""The single-use import tickets of server-to-server pushes, read from a call's
metadata, and the check of where a push may connect: what the transfer RPCs need
around a move (the move itself is ``engine/transfer.py``)."""

from __future__ import annotations

import ipaddress
import secrets
import socket
import threading
import time
from dataclasses import dataclass

from ferrum_rpc.errors import PushTargetRefused, TicketExpired, TicketNotFound, TicketUsed, shown
from ferrum_rpc.metadata import TENANT_HEADER, TICKET_HEADER
from ferrum_rpc.rules import DEFAULT_TICKET_TTL_S, MAX_TICKET_TTL_S, check_push_target, check_ticket_ttl

MAX_TICKETS = 10_000  # outstanding tickets kept (the oldest go first)


@dataclass
class Ticket:
    secret: str
    tenant: str
    model: str
    fingerprint: str
    expires: float
    state: str = "new"  # "new", "claimed" (an import is running on it), "used"


class TicketBook:
    """Import tickets this server issued: single-use, short-lived, bound to a tenant, a
    model and a fingerprint.  Thread-safe; a ticket is claimed when an import starts
    and used once it succeeds (a failed import puts it back, within its lifetime)."""

    def __init__(self) -> None:
        self._tickets: dict[str, Ticket] = {}
        self._lock = threading.Lock()

    def issue(self, tenant: str, model: str, fingerprint_digest: str, ttl_s: float) -> Ticket:
        check_ticket_ttl(ttl_s)
        ticket = Ticket(secrets.token_urlsafe(32), tenant, model, fingerprint_digest,
                        time.monotonic() + (ttl_s or DEFAULT_TICKET_TTL_S))
        with self._lock:
            now = time.monotonic()
            for key in [k for k, t in self._tickets.items() if t.expires < now - MAX_TICKET_TTL_S]:
                del self._tickets[key]  # long past: "not found" is as true as "expired" now
            while len(self._tickets) >= MAX_TICKETS:
                del self._tickets[next(iter(self._tickets))]
            self._tickets[ticket.secret] = ticket
        return ticket

    def claim(self, secret: str, tenant: str) -> Ticket:
        """Starts an import on a ticket presented for ``tenant``; the precise refusal otherwise."""
        with self._lock:
            ticket = self._tickets.get(secret)
            if ticket is None or not secrets.compare_digest(ticket.tenant.encode(), tenant.encode()):
                raise TicketNotFound("no such import ticket for this tenant (ask the receiver for one with "
                                     "CreateImportTicket)")
            if ticket.state != "new":
                raise TicketUsed("the import ticket was used already; tickets are single-use")
            if time.monotonic() > ticket.expires:
                raise TicketExpired("the import ticket expired; ask the receiver for a new one")
            ticket.state = "claimed"
            return ticket

    def claimed(self, secret: str) -> Ticket:
        """The ticket a running import claimed (see :meth:`claim`)."""
        with self._lock:
            return self._tickets[secret]

    def finish(self, ticket: Ticket, ok: bool) -> None:
        with self._lock:
            ticket.state = "used" if ok else "new"


def ticket_of(metadata) -> tuple[str, str] | None:
    """(ticket, stated tenant) from a call's metadata, or None without a ticket."""
    md = dict(metadata or ())
    return (md[TICKET_HEADER], md.get(TENANT_HEADER, "")) if TICKET_HEADER in md else None


# -- where a push may go ----------------------------------------------------------------------


def check_target(target: str, allowed: tuple) -> tuple[str, str]:
    """Refuses (PUSH_TARGET_REFUSED) a push target that is no "host:port", or any of
    whose resolved addresses lies outside ``allowed``: the caller names the address
    this server connects to, so it may only be one the operator allowed.  Returns
    (the address to connect to, the host name TLS verifies): the checked address
    itself, so a name that resolves elsewhere a moment later changes nothing."""
    host, port = check_push_target(target)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise PushTargetRefused(f"cannot resolve the push target {shown(target)}: {exc}") from None
    for *_, address in infos:
        ip = ipaddress.ip_address(address[0])
        if not any(ip in net for net in allowed):
            raise PushTargetRefused(f"pushing to {shown(target)} ({ip}) is not allowed here: the operator's "
                                    "--push-allow names the networks this server may push to")
    ip = ipaddress.ip_address(infos[0][4][0])
    return (f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"), host
