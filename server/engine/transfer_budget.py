"""What KV imports in flight may buffer, per tenant and in all (``transfer.py``'s
imports reserve it; the rpc layer owns one per server)."""

from __future__ import annotations

import threading
from typing import Callable

from ferrum_rpc.errors import TenantQuotaExceeded, TransferBudgetExhausted


class TransferBudget:
    """The KV bytes imports in flight buffer, per tenant and in all, and how many imports
    run.  An import reserves its whole buffer when its header arrives (the buffer is
    allocated then) and gives it back when the call ends, however it ends; a reservation
    past the tenant's quota or the server's budget is refused and holds nothing.  Used on
    the event loop; the lock lets a metrics scrape read it from its own thread."""

    def __init__(self, limit_bytes: int, auto_limit: Callable[[], int]):
        self.limit_bytes = limit_bytes  # 0: auto_limit() (the largest hosted KV pool)
        self.auto_limit = auto_limit
        self.buffered = 0
        self.by_tenant: dict[str, int] = {}
        self.imports = 0  # import calls running (reserved or not yet)
        self._lock = threading.Lock()

    @property
    def limit(self) -> int:
        return self.limit_bytes or self.auto_limit()

    def reserve(self, tenant: str, nbytes: int, tenant_limit: int, per_token: int) -> None:
        """Counts ``nbytes`` against ``tenant``'s ``tenant_limit`` (0: none; the quota in
        KV tokens times ``per_token``) and the server's budget, or refuses it."""
        with self._lock:
            held = self.by_tenant.get(tenant, 0)
            if tenant_limit and held + nbytes > tenant_limit * per_token:
                raise TenantQuotaExceeded(
                    f"the import would buffer {nbytes} bytes of KV while your tenant's imports in flight buffer "
                    f"{held}: over its quota of {tenant_limit} KV tokens ({tenant_limit * per_token} bytes at "
                    f"{per_token} a token); let them finish first")
            limit = self.limit
            if self.buffered + nbytes > limit:
                raise TransferBudgetExhausted(
                    f"the import would buffer {nbytes} bytes of KV while imports in flight buffer "
                    f"{self.buffered}: over this server's in-flight transfer budget of {limit} bytes "
                    f"(--transfer-budget-mb); retry once they finish")
            self.buffered += nbytes
            self.by_tenant[tenant] = held + nbytes

    def release(self, tenant: str, nbytes: int) -> None:
        with self._lock:
            self.buffered -= nbytes
            left = self.by_tenant.pop(tenant) - nbytes
            if left:
                self.by_tenant[tenant] = left
