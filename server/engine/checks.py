"""The executor's checks: every rule a request must meet before any state changes
(tokens, lengths, logits policies and message sizes, ids, handles, the pool and the
sequence caps), in one place that the executor, the import path and the worker call.
Each reads the executor's fixed facts and its block manager, and changes nothing."""

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
from ferrum_rpc.types import LOGITS_DTYPES, HiddenStatesRequest, KvCacheHandle, LogitsKind, LogitsPolicy
from ..config import TenantBounds
from ..kv.blocks import BlockManager, SequenceState

_WIRE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
_SCORED_ENTRY_BYTES = 4 + 5  # TOP_K/ARGMAX: a float32 score and a varint token id (<= 5 bytes)
MAX_ID_BYTES = 128  # longest id accepted, in UTF-8 bytes (cache ids, request ids; ours are 32 hex digits)


class Checks:
    """One executor's rules, from its fixed facts (model shape, config, maximum length,
    instance id), its block manager and its tenants' bounds (``bounds(tenant)``)."""

    def __init__(self, model_config, config, kv: BlockManager, max_seq_len: int, instance_id: str,
                 bounds: Callable[[str], TenantBounds]):
        self.model_config, self.config, self.kv = model_config, config, kv
        self.max_seq_len, self.instance_id, self.bounds = max_seq_len, instance_id, bounds

    def hidden(self, hidden: HiddenStatesRequest, tokens: int, start: int) -> None:
        """Validates an analysis request for ``tokens`` tokens after ``start`` and that
        its tensors fit the message limit (no state read)."""
        mc = self.model_config
        layers, heads = mc.num_layers, mc.num_heads
        if not hidden.layers and not hidden.attention_layers:
            raise InvalidInput("hidden_states asks for nothing: give layers, attention_layers or both")
        if bad := [layer for layer in hidden.layers if not 0 <= layer <= layers]:
            raise InvalidInput(f"hidden_states.layers must be in 0..={layers}, got {bad[:8]}")
        if bad := [layer for layer in hidden.attention_layers if not 0 <= layer < layers]:
            raise InvalidInput(f"hidden_states.attention_layers must be in 0..{layers - 1}, got {bad[:8]}")
        if bad := [h for h in hidden.attention_heads if not 0 <= h < heads]:
            raise InvalidInput(f"hidden_states.attention_heads must be in 0..{heads - 1}, got {bad[:8]}")
        if hidden.attention_heads and not hidden.attention_layers:
            raise InvalidInput("hidden_states.attention_heads needs attention_layers")
        if bad := [p for p in hidden.positions if not 0 <= p < tokens]:
            raise InvalidInput(f"hidden_states.positions must be in 0..{tokens - 1}, got {bad[:8]}")
        rows = len(hidden.positions) or tokens
        size = 4 * rows * (len(hidden.layers) * mc.hidden_size
                           + len(hidden.attention_layers) * (len(hidden.attention_heads) or heads) * (start + tokens))
        if size > self.config.max_message_bytes:
            raise InvalidInput(f"hidden states of {len(hidden.layers)} layers and attention weights of "
                               f"{len(hidden.attention_layers)} layers at {rows} positions need {size} bytes, over "
                               f"the {self.config.max_message_bytes}-byte message limit; ask for fewer layers, "
                               "heads or positions")

    def tokens(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise InvalidInput("no tokens given")
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidInput(f"token id {bad[0]} is outside the vocabulary (size {vocab})")

    def reply_fits(self, policy: LogitsPolicy, positions: int) -> None:
        """Raises INVALID_INPUT unless ``positions`` rows of ``policy`` fit one reply (reads no state)."""
        self.policy(policy, positions)

    def policy(self, policy: LogitsPolicy, positions: int) -> None:
        """Checks the policy, and that its reply will fit the message limit (every kind,
        before any work: a reply that fails at send time would strand the sequence)."""
        vocab = self.model_config.vocab_size
        if policy.kind is LogitsKind.TOP_K and not 1 <= policy.top_k <= vocab:
            raise InvalidInput(f"top_k must be in 1..={vocab}, got {policy.top_k}")
        if policy.dtype not in LOGITS_DTYPES:
            raise InvalidInput(f"logits dtype must be one of {LOGITS_DTYPES}, got {shown(policy.dtype)}")
        if policy.kind is LogitsKind.FULL:
            per_position = vocab * _WIRE_BYTES[policy.dtype]
        else:
            per_position = (policy.top_k if policy.kind is LogitsKind.TOP_K else 1) * _SCORED_ENTRY_BYTES
        size = positions * per_position
        if size > self.config.max_message_bytes:
            raise InvalidInput(
                f"{policy.kind.name} logits for {positions} positions need up to {size} bytes, over the "
                f"{self.config.max_message_bytes}-byte message limit; ask for fewer positions, a smaller "
                f"top-k or the last position only"
            )

    def id(self, value: str, field: str) -> None:
        if not value:
            raise InvalidInput(f"{field} is required")
        if (size := len(value.encode("utf-8", "surrogatepass"))) > MAX_ID_BYTES:  # the contract's unit: UTF-8 bytes
            raise InvalidInput(f"{field} is {size} bytes long (UTF-8); at most {MAX_ID_BYTES}")

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
