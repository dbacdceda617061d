"""The contract's Python types keep up with the .proto: every field of a message has
a counterpart in its dataclass (or is named here as wire-only, with the reason),
every dataclass field exists on the wire, and the enums carry the same members.
Adding a proto field without its Python counterpart fails here, not in a caller."""

from __future__ import annotations

import dataclasses

import pytest

from ferrum_rpc import types as t
from ferrum_rpc.v1 import executor_pb2 as pb

# message -> (its Python type, {wire-only field: why it has no counterpart})
PAIRS = {
    pb.KvCacheHandle: (t.KvCacheHandle, {}),
    pb.BlockTable: (t.BlockTable, {}),
    pb.LogitsPolicy: (t.LogitsPolicy, {}),
    pb.SharedMemoryTarget: (t.SharedMemoryTarget, {}),
    pb.Logits: (t.Logits, {
        "scores": "TOP_K/ARGMAX scores arrive as Logits.values (packed floats on the wire)",
        "positions": "Logits.values.shape[0]",
        "shared_memory": "where FULL rows were written; the client reads them into Logits.values",
    }),
    pb.Timing: (t.Timing, {}),
    pb.HiddenStatesRequest: (t.HiddenStatesRequest, {}),
    pb.MemoryRequirements: (t.MemoryRequirements, {}),
    pb.SpeculativeSampling: (t.SpeculativeSampling, {}),
    pb.ModelInfo: (t.ModelInfo, {}),
    pb.Capabilities: (t.Capabilities, {}),
    pb.Status: (t.ExecutorStatus, {}),
    pb.PrefillResponse: (t.PrefillOutput, {}),
    pb.DecodeResponse: (t.DecodeOutput, {}),
    pb.ForwardVerifyResponse: (t.VerifyOutput, {}),
    pb.SpeculativeDecodeResponse: (t.SpeculativeOutput, {}),
    pb.DecodeItem: (t.DecodeInput, {}),
    pb.TokenChoice: (t.TokenChoice, {}),
    pb.ChosenToken: (t.ChosenToken, {}),
    pb.TokenLogprob: (t.TokenLogprob, {}),
    pb.PushSequenceResponse: (t.SequencePush, {}),
}
# Python type -> {field never on the wire (the client's or the server's own): why}
CLIENT_ONLY = {
    t.KvCacheHandle: {"change": "the server's own change count of the sequence, kept on the handles it makes for "
                                "its undo records; never sent (ferrum_rpc/convert.py leaves it out)"},
    t.PrefillOutput: {"existing": "the client's mark of a retried Prefill answered REQUEST_ID_EXISTS (the handle "
                                  "came in the error's details, not in a PrefillResponse)"},
}


@pytest.mark.parametrize("message", list(PAIRS), ids=lambda m: m.DESCRIPTOR.name)
def test_every_proto_field_has_a_python_counterpart(message):
    cls, wire_only = PAIRS[message]
    wire = {f.name for f in message.DESCRIPTOR.fields}
    python = {f.name for f in dataclasses.fields(cls)}
    assert wire - python - set(wire_only) == set(), f"{message.DESCRIPTOR.name} fields missing from {cls.__name__}"
    assert python - wire - set(CLIENT_ONLY.get(cls, ())) == set(), f"{cls.__name__} fields that are not on the wire"
    assert set(wire_only) <= wire, "a wire-only entry names a field that no longer exists"


def test_every_response_message_with_a_handle_is_mirrored():
    """A new reply message that carries a KvCacheHandle needs a Python type (or a line here)."""
    mirrored = {m.DESCRIPTOR.name for m in PAIRS}
    handled_elsewhere = {  # replies the client turns into one of the mirrored types, or a plain handle
        "BatchDecodeResponse", "BatchPrefillResponse", "DecodeSessionResponse", "TruncateKvResponse",
        "ForkCacheResponse", "ImportSequenceResponse",
    }
    carriers = {m.name for m in pb.DESCRIPTOR.message_types_by_name.values()
                if m.name.endswith(("Response", "Result"))
                and any(f.message_type is not None and f.message_type.name == "KvCacheHandle" for f in m.fields)}
    assert carriers - mirrored - handled_elsewhere == set()
    assert handled_elsewhere <= carriers, "a line here names a reply that no longer carries a handle"


@pytest.mark.parametrize("python, wire, prefix", [
    (t.LogitsKind, pb.LogitsKind, "LOGITS_KIND_"),
    (t.ExecutorState, pb.Status.ExecutorState, "EXECUTOR_STATE_"),
    (t.ServerState, pb.Status.State, "STATE_"),
    (t.LogprobsMode, pb.LogprobsMode, "LOGPROBS_MODE_"),
])
def test_enums_carry_the_same_members(python, wire, prefix):
    names = {n.removeprefix(prefix): v for n, v in wire.items() if not n.endswith("UNSPECIFIED")}
    assert {m.name: m.value for m in python} == names


def test_token_choice_and_chosen_token_round_trip_the_wire():
    from ferrum_rpc import convert

    choice = t.TokenChoice(temperature=0.5, top_k=3, top_p=0.25, min_p=0.125, seed=2**64 - 1,
                           repetition_penalty=1.25, presence_penalty=-0.5, frequency_penalty=2.0,
                           logit_bias={3: -1.5, 0: 100.0}, allowed_token_bitmask=b"\x01\x00\x00\x80",
                           top_logprobs=20, logprobs_mode=t.LogprobsMode.PROCESSED)
    assert convert.token_choice_from_proto(convert.token_choice_to_proto(choice)) == choice
    default = convert.token_choice_to_proto(t.TokenChoice())
    assert not default.HasField("temperature") and not default.HasField("seed") and not default.HasField("top_p")
    assert convert.token_choice_from_proto(pb.TokenChoice()) == t.TokenChoice()  # unset: OpenAI's defaults
    assert convert.token_choice_from_proto(pb.TokenChoice(temperature=0.0)).is_greedy
    assert convert.token_choice_from_proto(pb.TokenChoice(top_p=0.0)).top_p == 0.0  # set 0 reaches validation
    chosen = t.ChosenToken(7, -0.5, (t.TokenLogprob(7, -0.5), t.TokenLogprob(2, -1.25)))
    assert convert.chosen_from_proto(convert.chosen_to_proto(chosen)) == chosen
