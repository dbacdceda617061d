"""The executor's sequences: the KV side of every call.

It creates a prompt's sequence (taking any cached prefix) or finds the one it
continues, reserves room for the tokens a step appends (private copies of shared
blocks made, within the tenant's quota), and gives room back; it truncates,
forks, releases and expires sequences, applies undo records (the one way back),
and makes the handle a reply carries.  The executor (``executor.py``) runs the
model over what it reserved."""

from __future__ import annotations

import logging
import uuid
from typing import TYPE_CHECKING, Callable, Iterable

from ferrum_rpc.errors import AdapterInvalid, InvalidInput, RequestIdExists, TenantQuotaExceeded, shown
from ferrum_rpc.rules import check_fork, check_prefill
from ferrum_rpc.types import BlockTable, KvCacheHandle, LogitsPolicy
from ..config import ExecutorConfig, TenantBounds
from ..kv.blocks import BlockManager, SequenceState, WritePlan
from ..kv.names import prompt_key
from ..kv.pool import KvPool
from .checks import Checks
from .forward import Rows, Step
from .opened import Opened
from .undo import Undo

if TYPE_CHECKING:
    from .adapters import Lora

log = logging.getLogger(__name__)


class Sequences:
    """Args:
        kv, pool: the block manager and the pool it hands out.
        copies: runs a reservation's block copies (on every tensor-parallel rank).
        bounds: what a tenant may hold (the executor's).
        version: the weights version a handle names now.
    """

    def __init__(self, name: str, instance_id: str, model_config, device, config: ExecutorConfig,
                 kv: BlockManager, pool: KvPool, checks: Checks, lora: Lora,
                 copies: Callable[[list], None], bounds: Callable[[str], TenantBounds], version: Callable[[], int]):
        self.name, self.instance_id, self.model_config, self.device = name, instance_id, model_config, device
        self.config, self.kv, self.pool, self.checks, self.lora = config, kv, pool, checks, lora
        self._copies, self._bounds, self._version = copies, bounds, version

    def open(self, token_ids: list[int], kv_cache: KvCacheHandle | None,
                      policy: LogitsPolicy, tenant: str, reuse_prefix: bool = True, name: str = "",
                      adapter: str = "") -> Opened:
        """Validates a prefill and finds (or creates, taking any cached prefix) its sequence."""
        check_prefill(token_ids, kv_cache is not None, name, self.checks.limits)
        key = prompt_key(token_ids, adapter) if name else b""
        if name and (live := self.kv.names.check_name(tenant, name, key)) is not None:  # a retry: its sequence
            raise RequestIdExists(f"request_id {shown(name)} names the live sequence this same prompt made; "
                                  "nothing was done (its handle is in the error)", handle=self.handle(live))
        self.checks.policy(policy, len(token_ids) if policy.all_positions else 1)
        seq = self.checks.resolve(kv_cache, tenant) if kv_cache is not None else None
        start = seq.length if seq else 0
        self.checks.length(start, len(token_ids))
        self.checks.fits_pool(start + len(token_ids))
        if seq is not None:
            if adapter and adapter != seq.adapter:
                raise AdapterInvalid("adapter: a sequence keeps the adapter it was created with; leave it empty "
                                     "when continuing a sequence")
            return Opened(seq, False, 0, seq.length, seq.last_used)
        self.checks.sequence_room(tenant, 1)
        adapter, adapter_digest = self.lora.for_new_sequence(adapter)
        seq = self.kv.create(uuid.uuid4().hex, tenant, name, adapter, adapter_digest, key)
        cached = 0
        if reuse_prefix and not policy.all_positions:  # a hit must leave the last token to compute
            cached = self.kv.adopt_prefix(seq, token_ids, len(token_ids) - 1)
        return Opened(seq, True, cached, 0, seq.last_used)

    def step(self, opened: Opened, tokens: list[int], rows: Rows) -> Step:
        """Reserves room (and private copies of shared blocks) for ``tokens`` after the sequence's end."""
        return Step(opened, list(tokens), opened.seq.length, self.reserve(opened.seq, len(tokens)), rows)

    def reserve(self, seq: SequenceState, tokens: int) -> WritePlan:
        """Makes room for ``tokens`` after the sequence's end (private copies of shared
        blocks made), within its tenant's KV quota; raises with nothing reserved."""
        plan = self.kv.prepare_write(seq, seq.length, seq.length + tokens)
        if quota := self._bounds(seq.tenant).kv_tokens:
            held = self.kv.blocks_held(seq.tenant)
            if held * self.kv.block_size > quota:
                self.kv.undo_write(seq, plan)
                raise TenantQuotaExceeded(
                    f"your tenant would hold {held * self.kv.block_size} KV tokens ({held} blocks), over its "
                    f"quota of {quota} (--tenant-kv-tokens); release or truncate sequences")
        self._copies(plan.copies)
        return plan

    def undo(self, undos: Iterable[Undo]) -> None:
        """THE undo: puts each record's sequence back as it was before its call (see
        :class:`Undo`): released if the call created it, else truncated back (idle
        clock too, where the record has it).  Records whose sequence is gone, or
        is no longer as the call left it (``left_at``, ``left_change``), are skipped;
        applying a record twice is harmless."""
        for undo in undos:
            if undo.cache_id not in self.kv:
                continue
            seq = self.kv.get(undo.cache_id)
            if undo.left_at is not None and seq.length != undo.left_at:
                continue
            if undo.left_change is not None and seq.changes != undo.left_change:
                continue
            if undo.back_to is None:
                self.kv.release(undo.cache_id)
            elif undo.back_to <= seq.length:
                self.kv.shrink(seq, undo.back_to, touch=False)
                if undo.clock is not None:
                    seq.last_used = undo.clock

    def unplan(self, steps: list[Step]) -> None:
        """Gives back the steps' reserved KV room and puts their sequences back as they were."""
        for step in steps:
            self.kv.undo_write(step.seq, step.plan)
            self.undo([step.opened.undo_record])

    def truncate(self, kv_cache: KvCacheHandle, new_length: int, tenant: str = "") -> KvCacheHandle:
        seq = self.checks.resolve(kv_cache, tenant)
        if not 0 <= new_length <= seq.length:
            raise InvalidInput(f"new_length {new_length} is outside 0..={seq.length}")
        self.kv.shrink(seq, new_length)
        return self.handle(seq)

    def release(self, cache_id: str, tenant: str = "") -> int:
        """Forgets a sequence; returns how many blocks went back to the pool."""
        self.checks.id(cache_id, "cache_id")
        self.checks.not_busy(self.kv.get(cache_id, tenant))
        return self.kv.release(cache_id)

    def release_named(self, name: str, tenant: str = "", aborted: bool = False) -> int:
        """Releases the tenant's sequence its caller named ``name`` (request_id); with none
        live, the name is remembered as released so a call bringing it later fails
        CANCELLED (:meth:`~..kv.names.Names.check_name`).  ``aborted``: the worker has just
        aborted the call creating it, which undoes it at its next step.  Returns the
        blocks freed."""
        self.checks.id(name, "request_id")
        seq = self.kv.names.named(tenant, name)
        if seq is None:
            self.kv.names.release_name(tenant, name)
            return 0
        if aborted and seq.pins:
            return 0
        self.checks.not_busy(seq)
        return self.kv.release(seq.cache_id)

    def fork(self, kv_cache: KvCacheHandle, num_children: int, tenant: str = "") -> list[KvCacheHandle]:
        """N new sequences sharing the parent's blocks; the first write to a shared block copies it."""
        check_fork(num_children, self.checks.limits)
        seq = self.checks.resolve(kv_cache, tenant)
        self.checks.sequence_room(seq.tenant, num_children)
        children = self.kv.fork(seq, [uuid.uuid4().hex for _ in range(num_children)])
        return [self.handle(c) for c in children]

    def expire_idle(self) -> list[str]:
        """Reclaims sequences idle past ``config.idle_timeout_s``; returns their ids."""
        if not self.config.idle_timeout_s:
            return []
        expired = self.kv.expire_idle(self.config.idle_timeout_s)
        if expired:
            log.info("%s: reclaimed %d idle sequence(s)", self.name, len(expired))
        return expired

    def handle(self, seq: SequenceState) -> KvCacheHandle:
        mc = self.model_config
        return KvCacheHandle(
            cache_id=seq.cache_id, sequence_length=seq.length, num_layers=mc.num_layers,
            num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim, device=str(self.device),
            block_table=BlockTable(self.kv.block_size, tuple(seq.block_ids)),
            model=self.name, server_instance_id=self.instance_id, adapter=seq.adapter,
            weights_version=self._version(), change=seq.changes,
        )
