"""The executor's checks: every rule a request must meet before any state changes, in
one place that the executor, the import path and the worker call.  A request's shape
(tokens, logits policies and message sizes, ids, analysis requests) is checked by the
contract's rules (:mod:`ferrum_rpc.rules`, which the clients share) against this
server's :class:`~ferrum_rpc.rules.Limits`; what needs the server's state (a handle
against its sequence, lengths, the pool and the sequence caps) is checked here.  Each
reads the executor's fixed facts and its block manager, and changes nothing."""

from __future__ import annotations

from typing import Callable

from ferrum_rpc.errors import (
    InvalidInput,
    KvCapacityExhausted,
    LengthMismatch,
    SequenceLimitExceeded,
    SequenceTooLong,
    StaleHandle,
    shown,
)
from ferrum_rpc.rules import Limits, check_hidden, check_id, check_logits_policy, check_tokens
from ferrum_rpc.types import HiddenStatesRequest, KvCacheHandle, LogitsPolicy
from ..config import TenantBounds
from ..kv.blocks import BlockManager, SequenceState



class Checks:
    """One executor's rules, from its fixed facts (model shape, config, maximum length,
    instance id), its block manager and its tenants' bounds (``bounds(tenant)``)."""

    def __init__(self, model_config, config, kv: BlockManager, max_seq_len: int, instance_id: str,
                 bounds: Callable[[str], TenantBounds]):
        self.model_config, self.config, self.kv = model_config, config, kv
        self.max_seq_len, self.instance_id, self.bounds = max_seq_len, instance_id, bounds

    @property
    def limits(self) -> Limits:
        """This server's facts the contract's rules read (read each time: a test or an
        operator may change the config's bounds on a live executor)."""
        mc, config = self.model_config, self.config
        return Limits(vocab_size=mc.vocab_size, max_batch_size=config.max_batch_size,
                      max_message_bytes=config.max_message_bytes, prefill_chunk=config.prefill_chunk,
                      num_layers=mc.num_layers, num_heads=mc.num_heads, hidden_size=mc.hidden_size)

    def hidden(self, hidden: HiddenStatesRequest, tokens: int, start: int) -> None:
        """An analysis request for ``tokens`` tokens after ``start`` (no state read)."""
        check_hidden(hidden, tokens, start, self.limits)

    def tokens(self, token_ids: list[int]) -> None:
        check_tokens(token_ids, self.limits)

    def policy(self, policy: LogitsPolicy, positions: int) -> None:
        """The policy, and that ``positions`` rows of it fit one reply (no state read)."""
        check_logits_policy(policy, positions, self.limits)

    reply_fits = policy

    def id(self, value: str, field: str) -> None:
        check_id(value, field)

    def resolve(self, handle: KvCacheHandle, tenant: str) -> SequenceState:
        """The sequence a handle names; validates without touching any state
        (the idle clock included: only a call that succeeds restarts it)."""
        self.id(handle.cache_id, "kv_cache.cache_id")
        self.id(handle.server_instance_id, "kv_cache.server_instance_id")
        if handle.server_instance_id != self.instance_id:
            raise StaleHandle(
                f"handle {shown(handle.cache_id)} was issued by server instance "
                f"{shown(handle.server_instance_id)}, this is {self.instance_id!r}"
            )
        seq = self.kv.get(handle.cache_id, tenant)  # another tenant's: "not found"
        self.not_busy(seq)
        if handle.sequence_length != seq.length:
            raise LengthMismatch(
                f"handle says {handle.sequence_length} tokens, the server holds {seq.length} "
                f"for {shown(handle.cache_id)}"
            )
        return seq

    def length(self, start: int, num_new: int) -> None:
        if start + num_new > self.max_seq_len:
            raise SequenceTooLong(
                f"{start} + {num_new} tokens exceed the maximum sequence length {self.max_seq_len}"
            )

    def fits_pool(self, length: int) -> None:
        """Refuses up front a sequence that could never fit, even in an empty pool."""
        if self.kv.blocks_for(length) > self.kv.num_blocks:
            raise KvCapacityExhausted(
                f"{length} tokens need {self.kv.blocks_for(length)} KV blocks; the whole pool has "
                f"{self.kv.num_blocks}"
            )

    def sequence_room(self, tenant: str, new: int) -> None:
        """Refuses ``new`` more sequences past the server's or the tenant's cap."""
        cap, tenant_cap = self.config.max_sequences, self.bounds(tenant).max_sequences
        if cap and len(self.kv) + new > cap:
            raise SequenceLimitExceeded(
                f"the server holds {len(self.kv)} live sequences, its cap is {cap}; release some")
        if tenant_cap and self.kv.count(tenant) + new > tenant_cap:
            raise SequenceLimitExceeded(
                f"your tenant holds {self.kv.count(tenant)} live sequences, its cap is {tenant_cap} "
                f"(--tenant-max-sequences); release some")

    def not_busy(self, seq: SequenceState) -> None:
        if seq.pins:
            raise InvalidInput(f"sequence {shown(seq.cache_id)} is in the middle of a chunked prefill")
