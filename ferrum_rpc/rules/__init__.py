"""The contract's rules for what a request may carry, in one place: the server checks
every request against them before any state changes, and the clients check what they
send against the same rules before it goes out, so a caller gets the server's reason
(INVALID_INPUT naming the field) without a round trip.

- :mod:`.choice`: token ids, a token-choice policy's ranges, logit bias and the
  allowed-token bitmask (and its layout);
- :mod:`.requests`: the shape of each request (batches, ids, logits policies, hidden
  states, decoding ahead, drafts, forks, releases, shared-memory regions, tickets,
  push targets), against a server's :class:`Limits` where a rule needs one.

What only the server can check (a handle against its sequence, a region against its
registry, an import stream against its fingerprint) stays with the state it reads.
No torch (numpy for the bitmask): any layer, and any client, may import it."""

from .choice import (
    MAX_LOGIT_BIAS,
    MAX_PENALTY,
    allows,
    checked_id,
    checked_ids,
    pack_allowed_tokens,
    unpack_allowed_tokens,
    validate_token_choice,
)
from .requests import (
    MAX_DECODE_AHEAD,
    MAX_ID_BYTES,
    MAX_NAME_BYTES,
    MAX_PATH_BYTES,
    MAX_STOP_TOKENS,
    MAX_TICKET_TTL_S,
    DEFAULT_TICKET_TTL_S,
    Limits,
    check_decode_batch,
    check_decode_session,
    check_drafts,
    check_fork,
    check_hidden,
    check_id,
    check_logits_policy,
    check_model_name,
    check_prefill,
    check_prefill_batch,
    check_push_target,
    check_region,
    check_release,
    check_sampling,
    check_shared_memory_offset,
    check_ticket_ttl,
    check_tokens,
)

__all__ = [
    "MAX_LOGIT_BIAS",
    "MAX_PENALTY",
    "allows",
    "checked_id",
    "checked_ids",
    "pack_allowed_tokens",
    "unpack_allowed_tokens",
    "validate_token_choice",
    "MAX_DECODE_AHEAD",
    "MAX_ID_BYTES",
    "MAX_NAME_BYTES",
    "MAX_PATH_BYTES",
    "MAX_STOP_TOKENS",
    "MAX_TICKET_TTL_S",
    "DEFAULT_TICKET_TTL_S",
    "Limits",
    "check_decode_batch",
    "check_decode_session",
    "check_drafts",
    "check_fork",
    "check_hidden",
    "check_id",
    "check_logits_policy",
    "check_model_name",
    "check_prefill",
    "check_prefill_batch",
    "check_push_target",
    "check_region",
    "check_release",
    "check_sampling",
    "check_shared_memory_offset",
    "check_ticket_ttl",
    "check_tokens",
]
