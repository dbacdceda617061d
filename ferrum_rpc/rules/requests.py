"""Rules for the shape of a request: what each message may carry, read off the
message alone and, where a rule needs one, a server's :class:`Limits`.  Each raises
InvalidInput naming the field; none reads or changes state.  A client calls them with
the limits it knows (``Limits()``: none, so only the rules that need no server fact
apply); the server calls them with its own before anything runs."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from ferrum_rpc.errors import InvalidInput, shown
from ferrum_rpc.types import LOGITS_DTYPES, HiddenStatesRequest, LogitsKind, LogitsPolicy, SpeculativeSampling

MAX_ID_BYTES = 128  # longest id accepted, in UTF-8 bytes (cache ids, request ids; ours are 32 hex digits)
MAX_DECODE_AHEAD = 4096  # DecodeSessionRequest.max_new_tokens bound (Capabilities.max_decode_ahead)
MAX_STOP_TOKENS = 64  # DecodeSessionRequest.stop_token_ids bound
MAX_NAME_BYTES = 128  # a shared-memory region's or a hosted model's name, in UTF-8 bytes
MAX_PATH_BYTES = 4096  # the longest folder path LoadModel and LoadAdapter take
MAX_TICKET_TTL_S = 300.0  # an import ticket's longest lifetime
DEFAULT_TICKET_TTL_S = 30.0  # ttl_s 0

_UINT32 = 1 << 32
_WIRE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
_SCORED_ENTRY_BYTES = 4 + 5  # TOP_K/ARGMAX: a float32 score and a varint token id (<= 5 bytes)


@dataclass(frozen=True)
class Limits:
    """The server facts a rule may need (GetModelInfo and GetCapabilities carry each);
    None where the caller does not know it, and the rules needing it then pass."""

    vocab_size: int | None = None
    max_batch_size: int | None = None
    max_message_bytes: int | None = None
    prefill_chunk: int | None = None  # tokens of one forward: a speculative round's draft bound
    num_layers: int | None = None
    num_heads: int | None = None
    hidden_size: int | None = None


NO_LIMITS = Limits()


# ---------------------------------------------------------------------------- ids and tokens

def check_id(value: str, field: str) -> None:
    """A cache id, request id or server instance id: present, at most MAX_ID_BYTES (UTF-8)."""
    if not value:
        raise InvalidInput(f"{field} is required")
    if (size := len(value.encode("utf-8", "surrogatepass"))) > MAX_ID_BYTES:  # the contract's unit: UTF-8 bytes
        raise InvalidInput(f"{field} is {size} bytes long (UTF-8); at most {MAX_ID_BYTES}")


def check_tokens(token_ids: Sequence[int], limits: Limits = NO_LIMITS) -> None:
    """A prompt's (or a step's) token ids: at least one, each inside the vocabulary."""
    if not token_ids:
        raise InvalidInput("no tokens given")
    vocab = _UINT32 if limits.vocab_size is None else limits.vocab_size
    bad = [t for t in token_ids if not 0 <= t < vocab]
    if bad:
        raise InvalidInput(f"token id {bad[0]} is outside the vocabulary (size {vocab})")


def check_prefill(token_ids: Sequence[int], continuing: bool, request_id: str, limits: Limits = NO_LIMITS) -> None:
    """A Prefill (or a BatchPrefill item): its tokens, and a request_id only when it
    creates a sequence (it names the sequence made)."""
    if request_id:
        if continuing:
            raise InvalidInput("request_id names the sequence a Prefill creates; leave it empty when "
                               "continuing a sequence")
        check_id(request_id, "request_id")
    check_tokens(token_ids, limits)


# ---------------------------------------------------------------------------- replies

def check_logits_policy(policy: LogitsPolicy, positions: int, limits: Limits = NO_LIMITS) -> None:
    """The policy's ranges, and that ``positions`` rows of it fit one reply (every kind,
    before any work: a reply that fails at send time would strand the sequence)."""
    vocab = limits.vocab_size
    if policy.kind is LogitsKind.TOP_K and policy.top_k < 1:
        raise InvalidInput(f"top_k must be at least 1, got {policy.top_k}")
    if policy.kind is LogitsKind.TOP_K and vocab is not None and policy.top_k > vocab:
        raise InvalidInput(f"top_k must be in 1..={vocab} (the vocabulary), got {policy.top_k}")
    if policy.dtype not in LOGITS_DTYPES:
        raise InvalidInput(f"logits dtype must be one of {LOGITS_DTYPES}, got {shown(policy.dtype)}")
    if limits.max_message_bytes is None or vocab is None:
        return
    if policy.kind is LogitsKind.FULL:
        per_position = vocab * _WIRE_BYTES[policy.dtype]
    else:
        per_position = (policy.top_k if policy.kind is LogitsKind.TOP_K else 1) * _SCORED_ENTRY_BYTES
    size = positions * per_position
    if size > limits.max_message_bytes:
        raise InvalidInput(
            f"{policy.kind.name} logits for {positions} positions need up to {size} bytes, over the "
            f"{limits.max_message_bytes}-byte message limit; ask for fewer positions, a smaller "
            f"top-k or the last position only")


def check_shared_memory_offset(policy: LogitsPolicy) -> None:
    """Rows written into a shared-memory region start at a multiple of their element size."""
    element = 4 if policy.dtype == "float32" else 2
    if policy.shared_memory is not None and policy.shared_memory.offset % element:
        raise InvalidInput(f"logits.shared_memory.offset must be a multiple of {element}, "
                           f"got {policy.shared_memory.offset}")


def check_hidden(hidden: HiddenStatesRequest, tokens: int, start: int, limits: Limits = NO_LIMITS) -> None:
    """An analysis request for ``tokens`` tokens after ``start``: indexes in range, and
    its tensors within the message limit."""
    layers, heads = limits.num_layers, limits.num_heads
    if not hidden.layers and not hidden.attention_layers:
        raise InvalidInput("hidden_states asks for nothing: give layers, attention_layers or both")
    if layers is not None:
        if bad := [layer for layer in hidden.layers if not 0 <= layer <= layers]:
            raise InvalidInput(f"hidden_states.layers must be in 0..={layers}, got {bad[:8]}")
        if bad := [layer for layer in hidden.attention_layers if not 0 <= layer < layers]:
            raise InvalidInput(f"hidden_states.attention_layers must be in 0..{layers - 1}, got {bad[:8]}")
    if heads is not None and (bad := [h for h in hidden.attention_heads if not 0 <= h < heads]):
        raise InvalidInput(f"hidden_states.attention_heads must be in 0..{heads - 1}, got {bad[:8]}")
    if hidden.attention_heads and not hidden.attention_layers:
        raise InvalidInput("hidden_states.attention_heads needs attention_layers")
    if bad := [p for p in hidden.positions if not 0 <= p < tokens]:
        raise InvalidInput(f"hidden_states.positions must be in 0..{tokens - 1}, got {bad[:8]}")
    if None in (limits.max_message_bytes, limits.hidden_size, heads):
        return
    rows = len(hidden.positions) or tokens
    size = 4 * rows * (len(hidden.layers) * limits.hidden_size
                       + len(hidden.attention_layers) * (len(hidden.attention_heads) or heads) * (start + tokens))
    if size > limits.max_message_bytes:
        raise InvalidInput(f"hidden states of {len(hidden.layers)} layers and attention weights of "
                           f"{len(hidden.attention_layers)} layers at {rows} positions need {size} bytes, over "
                           f"the {limits.max_message_bytes}-byte message limit; ask for fewer layers, "
                           "heads or positions")


# ---------------------------------------------------------------------------- batches

def _batch_size(count: int, limits: Limits, what: str) -> None:
    if limits.max_batch_size is not None and count > limits.max_batch_size:
        raise InvalidInput(f"{count} {what} exceed max batch size {limits.max_batch_size}")


def check_decode_batch(cache_ids: Sequence[str], limits: Limits = NO_LIMITS) -> None:
    """A BatchDecode (or a DecodeSession step): 1 ..= max batch items, each sequence once."""
    if not cache_ids:
        raise InvalidInput("batch_decode needs at least one input")
    _batch_size(len(cache_ids), limits, "sequences")
    if len(set(cache_ids)) != len(cache_ids):
        raise InvalidInput("a sequence appears more than once in one batch")


def check_prefill_batch(continued: Sequence[str], request_ids: Sequence[str], count: int,
                        limits: Limits = NO_LIMITS) -> None:
    """A BatchPrefill of ``count`` prompts: 1 ..= max batch, a continued sequence
    (``continued``: their cache ids) at most once, a request_id naming one item."""
    if not count:
        raise InvalidInput("items is empty: BatchPrefill needs at least one prompt")
    _batch_size(count, limits, "prompts")
    if len(set(continued)) != len(continued):
        raise InvalidInput("a sequence may be continued at most once per BatchPrefill")
    names = [n for n in request_ids if n]
    if len(set(names)) != len(names):
        raise InvalidInput("a request_id may name at most one item of a BatchPrefill")


def check_fork(num_children: int, limits: Limits = NO_LIMITS) -> None:
    if num_children < 1:
        raise InvalidInput(f"num_children must be at least 1, got {num_children}")
    if limits.max_batch_size is not None and num_children > limits.max_batch_size:
        raise InvalidInput(f"num_children must be at most the max batch size {limits.max_batch_size}, "
                           f"got {num_children}")


def check_release(cache_id: str, request_id: str) -> None:
    if cache_id and request_id:
        raise InvalidInput("ReleaseCache takes a cache_id or a request_id, not both")


# ---------------------------------------------------------------------------- decoding ahead

def check_decode_session(message, limits: Limits = NO_LIMITS) -> None:
    """A DecodeSessionRequest (the wire message): a stop message carries its step_id and
    stop only; decoding ahead (max_new_tokens > 0) streams chosen tokens, so every item
    has a token_choice and no logits are asked for; its bounds; stop_token_ids and
    forwards_per_response only with max_new_tokens."""
    m = message
    if m.stop:
        if m.items or m.max_new_tokens or m.stop_token_ids or m.HasField("logits") or m.single_reply \
                or m.model or m.forwards_per_response:
            raise InvalidInput("a DecodeSession stop message carries its step_id and stop only")
        return
    if m.stop_token_ids and not m.max_new_tokens:
        raise InvalidInput("stop_token_ids end a decode-ahead run: set max_new_tokens, or leave "
                           "them empty (a single step stops nowhere)")
    if m.forwards_per_response and not m.max_new_tokens:
        raise InvalidInput("forwards_per_response is decoding ahead's: set max_new_tokens, or leave it 0")
    if not m.max_new_tokens:
        return
    if m.max_new_tokens > MAX_DECODE_AHEAD:
        raise InvalidInput(f"max_new_tokens must be at most {MAX_DECODE_AHEAD}, got {m.max_new_tokens}")
    if m.HasField("logits") or m.single_reply:
        raise InvalidInput("decoding ahead streams chosen tokens only: logits and single_reply must be unset")
    missing = [n for n, item in enumerate(m.items) if not item.HasField("token_choice")]
    if missing:
        raise InvalidInput(f"decoding ahead needs a token_choice on every item (items {missing} have none)")
    if m.forwards_per_response > MAX_DECODE_AHEAD:
        raise InvalidInput(f"forwards_per_response must be at most {MAX_DECODE_AHEAD}, "
                           f"got {m.forwards_per_response}")
    if len(m.stop_token_ids) > MAX_STOP_TOKENS:
        raise InvalidInput(f"stop_token_ids holds at most {MAX_STOP_TOKENS} ids, got {len(m.stop_token_ids)}")
    vocab = limits.vocab_size
    if vocab is not None and (bad := [t for t in m.stop_token_ids if t >= vocab]):
        raise InvalidInput(f"stop_token_ids {bad[:4]} are outside the vocabulary (size {vocab})")


# ---------------------------------------------------------------------------- speculative rounds

def check_drafts(drafts: int, has_choice: bool, has_sampling: bool, limits: Limits = NO_LIMITS) -> None:
    """A speculative round: the token and its drafts fit one forward, one acceptance rule."""
    if limits.prefill_chunk is not None and drafts + 1 > limits.prefill_chunk:
        raise InvalidInput(f"{drafts} drafts exceed {limits.prefill_chunk - 1} (one forward's chunk)")
    if has_choice and has_sampling:
        raise InvalidInput("token_choice and sampling are exclusive: give one acceptance rule")


def check_sampling(sampling: SpeculativeSampling) -> None:
    """A speculative round's probabilistic acceptance."""
    if not (math.isfinite(sampling.temperature) and sampling.temperature > 0 and 0 <= sampling.top_p <= 1
            and sampling.top_k >= 0):
        raise InvalidInput("sampling needs a finite temperature > 0, top_k >= 0 and top_p in [0, 1]")


# ---------------------------------------------------------------------------- admin and transfer

def check_region(name: str, key: str, offset: int, byte_size: int) -> None:
    """A RegisterSharedMemory: a name, no caller-made object, a size."""
    if not name or len(name.encode()) > MAX_NAME_BYTES or "\x00" in name:
        raise InvalidInput(f"name must be 1..={MAX_NAME_BYTES} bytes without NUL, got {len(name.encode())}")
    if key or offset:
        raise InvalidInput("key and offset must be empty: the server creates the shared-memory object "
                           "and its reply names it (a caller-made object is not accepted)")
    if byte_size <= 0:
        raise InvalidInput("byte_size must be > 0")


def check_model_name(name: str, path: str | None = None) -> None:
    """A LoadModel's (``path`` given) or UnloadModel's name, and the folder path's length."""
    if path is None and not name:
        raise InvalidInput("name is required")
    if not name or len(name.encode()) > MAX_NAME_BYTES:
        raise InvalidInput(f"name must be 1..={MAX_NAME_BYTES} bytes")
    if path is not None and len(path.encode()) > MAX_PATH_BYTES:
        raise InvalidInput(f"path {shown(path)} is over {MAX_PATH_BYTES} bytes")


def check_ticket_ttl(ttl_s: float) -> None:
    if not 0 <= ttl_s <= MAX_TICKET_TTL_S:
        raise InvalidInput(f"ttl_s must be in 0..={MAX_TICKET_TTL_S:g} (0: {DEFAULT_TICKET_TTL_S:g}), got {ttl_s}")


def check_push_target(target: str) -> tuple[str, int]:
    """A PushSequence target as "host:port" (brackets around an IPv6 host allowed):
    returns (host, port)."""
    host, sep, port = target.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidInput(f"target must be host:port, got {shown(target)}")
    return host, int(port)
