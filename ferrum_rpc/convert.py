"""Protobuf <-> domain objects, the one translation both sides share.

The servicer and the client only call these; neither builds messages field by
field elsewhere.
"""

from __future__ import annotations

from dataclasses import asdict
from dataclasses import fields as dataclass_fields

import numpy as np

from ferrum_rpc import tensor_codec
from ferrum_rpc.errors import InvalidInput
from ferrum_rpc.types import (
    BlockTable,
    Capabilities,
    ChosenToken,
    LogprobsMode,
    TokenChoice,
    TokenLogprob,
    ExecutorStatus,
    KvCacheHandle,
    Logits,
    LogitsKind,
    LogitsPolicy,
    ModelInfo,
    ExecutorState,
    HiddenStatesRequest,
    MemoryRequirements,
    ServerState,
    SharedMemoryTarget,
    Timing,
)
from ferrum_rpc.v1 import executor_pb2 as pb

_KIND_TO_PROTO = {
    LogitsKind.FULL: pb.LOGITS_KIND_FULL,
    LogitsKind.TOP_K: pb.LOGITS_KIND_TOP_K,
    LogitsKind.ARGMAX: pb.LOGITS_KIND_ARGMAX,
}
_KIND_FROM_PROTO = {v: k for k, v in _KIND_TO_PROTO.items()}
_KIND_FROM_PROTO[pb.LOGITS_KIND_UNSPECIFIED] = LogitsKind.FULL
_ID_SLICE = 1 << 18
# A handle's fields that the message carries as they are (all but the block table and
# the server's own change count, which never leaves the server).
_HANDLE_SCALARS = tuple(f.name for f in dataclass_fields(KvCacheHandle) if f.name not in ("block_table", "change"))


def handle_to_proto(h: KvCacheHandle) -> pb.KvCacheHandle:
    fields = {name: getattr(h, name) for name in _HANDLE_SCALARS}
    return pb.KvCacheHandle(**fields, block_table=pb.BlockTable(block_size=h.block_table.block_size,
                                                                block_ids=h.block_table.block_ids))


def handle_from_proto(m: pb.KvCacheHandle) -> KvCacheHandle:
    fields = {name: getattr(m, name) for name in _HANDLE_SCALARS}
    return KvCacheHandle(**fields, block_table=BlockTable(m.block_table.block_size, tuple(m.block_table.block_ids)))


def policy_to_proto(p: LogitsPolicy) -> pb.LogitsPolicy:
    return pb.LogitsPolicy(
        kind=_KIND_TO_PROTO[p.kind],
        dtype=tensor_codec.dtype_to_proto(p.dtype),
        top_k=p.top_k,
        all_positions=p.all_positions,
        shared_memory=(pb.SharedMemoryTarget(region=p.shared_memory.region, offset=p.shared_memory.offset)
                       if p.shared_memory else None),
    )


def policy_from_proto(m: pb.LogitsPolicy) -> LogitsPolicy:
    kind = _KIND_FROM_PROTO.get(m.kind)
    if kind is None:
        raise InvalidInput(f"unknown logits kind {m.kind}")
    dtype = "float32" if m.dtype == pb.DTYPE_UNSPECIFIED else tensor_codec.dtype_from_proto(m.dtype)
    target = None
    if m.HasField("shared_memory"):
        if kind is not LogitsKind.FULL:
            raise InvalidInput("logits.shared_memory needs LOGITS_KIND_FULL (top-k and argmax rows are small)")
        target = SharedMemoryTarget(m.shared_memory.region, m.shared_memory.offset)
    return LogitsPolicy(kind=kind, dtype=dtype, top_k=m.top_k, all_positions=m.all_positions, shared_memory=target)


_LOGPROBS_MODE_TO_PROTO = {LogprobsMode.RAW: pb.LOGPROBS_MODE_RAW, LogprobsMode.PROCESSED: pb.LOGPROBS_MODE_PROCESSED}
_LOGPROBS_MODE_FROM_PROTO = {v: k for k, v in _LOGPROBS_MODE_TO_PROTO.items()}
_LOGPROBS_MODE_FROM_PROTO[pb.LOGPROBS_MODE_UNSPECIFIED] = LogprobsMode.RAW


def token_choice_to_proto(c: TokenChoice) -> pb.TokenChoice:
    """Defaults stay unset on the wire (temperature 1, top_p 1, repetition 1, no seed)."""
    m = pb.TokenChoice(top_k=c.top_k, min_p=c.min_p, presence_penalty=c.presence_penalty,
                       frequency_penalty=c.frequency_penalty, logit_bias=dict(c.logit_bias),
                       allowed_token_bitmask=bytes(c.allowed_token_bitmask), top_logprobs=c.top_logprobs,
                       logprobs_mode=_LOGPROBS_MODE_TO_PROTO[c.logprobs_mode])
    for name, default in (("temperature", 1.0), ("top_p", 1.0), ("repetition_penalty", 1.0)):
        if getattr(c, name) != default:
            setattr(m, name, getattr(c, name))
    if c.seed is not None:
        m.seed = c.seed
    return m


def token_choice_from_proto(m: pb.TokenChoice, field: str = "token_choice") -> TokenChoice:
    """The wire's policy; ranges are checked by the server's validate_token_choice.
    ``field`` names the policy in the error, as validation does ("items[3].token_choice")."""
    mode = _LOGPROBS_MODE_FROM_PROTO.get(m.logprobs_mode)
    if mode is None:
        raise InvalidInput(f"{field}.logprobs_mode: unknown value {m.logprobs_mode}")
    return TokenChoice(
        temperature=m.temperature if m.HasField("temperature") else 1.0,
        top_k=m.top_k,
        top_p=m.top_p if m.HasField("top_p") else 1.0,
        min_p=m.min_p,
        seed=m.seed if m.HasField("seed") else None,
        repetition_penalty=m.repetition_penalty if m.HasField("repetition_penalty") else 1.0,
        presence_penalty=m.presence_penalty,
        frequency_penalty=m.frequency_penalty,
        logit_bias=dict(m.logit_bias),
        allowed_token_bitmask=m.allowed_token_bitmask,
        top_logprobs=m.top_logprobs,
        logprobs_mode=mode,
    )


def chosen_to_proto(c: ChosenToken) -> pb.ChosenToken:
    return pb.ChosenToken(token_id=c.token_id, logprob=c.logprob,
                          top_logprobs=[pb.TokenLogprob(token_id=t.token_id, logprob=t.logprob)
                                        for t in c.top_logprobs])


def chosen_from_proto(m: pb.ChosenToken) -> ChosenToken:
    return ChosenToken(m.token_id, m.logprob, tuple(TokenLogprob(t.token_id, t.logprob) for t in m.top_logprobs))


def logits_to_proto(logits: Logits) -> pb.Logits:
    message = pb.Logits()
    fill_logits(message, logits)
    return message


def fill_logits(message: pb.Logits, logits: Logits, shared_memory=None) -> None:
    """Writes ``logits`` into ``message`` in place (no copies of the payload beyond one).

    FULL rows travel as a raw tensor, or, with ``shared_memory`` (a
    ``(region, offset)`` whose ``region.write`` copies them there), only their
    location; TOP_K / ARGMAX as packed float scores and uint32 ids."""
    message.kind = _KIND_TO_PROTO[logits.kind]
    message.vocab_size = logits.vocab_size
    message.positions = logits.values.shape[0]
    if logits.kind is LogitsKind.FULL:
        if shared_memory is None:
            tensor_codec.encode_into(message.values, logits.values)
            return
        region, offset = shared_memory
        array, wire = tensor_codec.as_numpy(logits.values)
        region.write(offset, array)
        message.values.dtype = wire
        message.values.shape.extend(array.shape)
        message.shared_memory.region, message.shared_memory.offset = region.name, offset
        message.shared_memory.byte_size = array.nbytes
        return
    scores = np.asarray(logits.values, dtype=np.float32).reshape(-1) if not hasattr(logits.values, "numpy") \
        else logits.values.float().reshape(-1).numpy()
    ids = logits.token_ids.reshape(-1)
    for start in range(0, ids.size, _ID_SLICE):  # a bounded slice at a time: no list of millions of numbers
        message.scores.extend(scores[start:start + _ID_SLICE].tolist())
        message.token_ids.extend(ids[start:start + _ID_SLICE].tolist())


def logits_from_proto(m: pb.Logits, shared_memory=None) -> Logits:
    """The reply's logits; rows written to shared memory are read through
    ``shared_memory(location) -> memoryview`` (the caller's own mapping)."""
    kind = _KIND_FROM_PROTO[m.kind]
    if kind is LogitsKind.FULL:
        if m.HasField("shared_memory"):
            if shared_memory is None:
                raise InvalidInput(f"logits were written to shared-memory region {m.shared_memory.region!r}, "
                                   "which this client did not register")
            values = tensor_codec.to_numpy(m.values, shared_memory(m.shared_memory))
        else:
            values = tensor_codec.to_numpy(m.values)
        return Logits(kind=kind, values=values, vocab_size=m.vocab_size)
    positions = m.positions or (1 if m.token_ids else 0)
    scores = np.asarray(m.scores, dtype=np.float32)
    token_ids = np.asarray(m.token_ids, dtype=np.int64)
    if scores.size != token_ids.size or (positions and scores.size % positions):
        raise InvalidInput(f"logits carry {scores.size} scores and {token_ids.size} ids over {positions} rows")
    shape = (positions, scores.size // positions if positions else 0)
    return Logits(kind=kind, values=scores.reshape(shape), token_ids=token_ids.reshape(shape),
                  vocab_size=m.vocab_size)


def hidden_request_to_proto(h: HiddenStatesRequest) -> pb.HiddenStatesRequest:
    return pb.HiddenStatesRequest(layers=h.layers, positions=h.positions, attention_layers=h.attention_layers,
                                  attention_heads=h.attention_heads)


def hidden_request_from_proto(m: pb.HiddenStatesRequest) -> HiddenStatesRequest:
    return HiddenStatesRequest(tuple(m.layers), tuple(m.positions), tuple(m.attention_layers),
                               tuple(m.attention_heads))


def timing_to_proto(t: Timing) -> pb.Timing:
    return pb.Timing(
        queue_ns=t.queue_ns, forward_ns=t.forward_ns, total_ns=t.total_ns, batch_size=t.batch_size
    )


def timing_from_proto(m: pb.Timing) -> Timing:
    return Timing(m.queue_ns, m.forward_ns, m.total_ns, m.batch_size)


def model_info_to_proto(info: ModelInfo) -> pb.ModelInfo:
    fields = asdict(info)
    fields["dtype"] = tensor_codec.dtype_to_proto(info.dtype)
    # an int8 KV pool (--kv-dtype int8) is named by DTYPE_INT8, a dtype no tensor travels in
    kv = info.kv_dtype or info.dtype
    fields["kv_dtype"] = pb.DTYPE_INT8 if kv == "int8" else tensor_codec.dtype_to_proto(kv)
    return pb.ModelInfo(**fields)


def model_info_from_proto(m: pb.ModelInfo) -> ModelInfo:
    fields = _fields_of(ModelInfo, m)
    fields["dtype"] = tensor_codec.dtype_from_proto(m.dtype)
    fields["kv_dtype"] = ("int8" if m.kv_dtype == pb.DTYPE_INT8 else tensor_codec.dtype_from_proto(m.kv_dtype)) \
        if m.kv_dtype else fields["dtype"]
    fields["eos_token_ids"] = tuple(m.eos_token_ids)
    return ModelInfo(**fields)


def capabilities_to_proto(c: Capabilities) -> pb.Capabilities:
    fields = asdict(c)
    fields["logits_kinds"] = [_KIND_TO_PROTO[k] for k in c.logits_kinds]
    fields["logits_dtypes"] = [tensor_codec.dtype_to_proto(d) for d in c.logits_dtypes]
    fields["supported_dtypes"] = [tensor_codec.dtype_to_proto(d) for d in c.supported_dtypes]
    fields["memory"] = pb.MemoryRequirements(**asdict(c.memory))
    return pb.Capabilities(**fields)


def capabilities_from_proto(m: pb.Capabilities) -> Capabilities:
    fields = _fields_of(Capabilities, m)
    fields["logits_kinds"] = tuple(_KIND_FROM_PROTO[k] for k in m.logits_kinds)
    fields["logits_dtypes"] = tuple(tensor_codec.dtype_from_proto(d) for d in m.logits_dtypes)
    fields["models"] = tuple(m.models)
    fields["attention_mechanisms"] = tuple(m.attention_mechanisms)
    fields["supported_dtypes"] = tuple(tensor_codec.dtype_from_proto(d) for d in m.supported_dtypes)
    fields["supported_devices"] = tuple(m.supported_devices)
    fields["tensor_parallel_fallbacks"] = tuple(m.tensor_parallel_fallbacks)
    fields["tensor_parallel_degree"] = m.tensor_parallel_degree or 1
    fields["memory"] = MemoryRequirements(**_fields_of(MemoryRequirements, m.memory))
    return Capabilities(**fields)


def status_to_proto(s: ExecutorStatus) -> pb.Status:
    fields = asdict(s)
    fields["state"] = s.state.value
    fields["executor_state"] = s.executor_state.value
    return pb.Status(**fields)


def status_from_proto(m: pb.Status) -> ExecutorStatus:
    fields = _fields_of(ExecutorStatus, m)
    fields["state"] = ServerState(m.state)
    fields["executor_state"] = ExecutorState(m.executor_state or ExecutorState.INITIALIZING.value)
    return ExecutorStatus(**fields)


def _fields_of(cls, message) -> dict:
    return {f.name: getattr(message, f.name) for f in dataclass_fields(cls)}
