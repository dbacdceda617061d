"""One set of request rules (``ferrum_rpc.rules``): for each bad request the Python
client refuses before the wire, the same request sent raw to a real server is refused
with the same reason and the same message, and the refusals change nothing (the
sequence decodes after them as before)."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from ferrum_rpc import convert
from ferrum_rpc.client import InvalidInput, LogitsPolicy, TokenChoice
from ferrum_rpc.errors import from_rpc_error, from_status_proto
from ferrum_rpc.types import HiddenStatesRequest, LogitsKind, SpeculativeSampling
from ferrum_rpc.v1 import executor_pb2 as pb
from ferrum_rpc.v1 import executor_pb2_grpc as pb_grpc

PROMPT = [1, 17, 42, 99, 5]
CHOICE = TokenChoice(temperature=0.7)


@pytest.fixture(scope="module")
def stub(tiny_server):
    with grpc.insecure_channel(tiny_server.target) as channel:
        yield pb_grpc.ModelExecutorStub(channel)


@pytest.fixture
def handle(client):
    out = client.prefill(PROMPT, logits=LogitsPolicy.argmax())
    yield out.kv_cache
    client.release_cache(out.kv_cache)


def _cases(handle):
    """(name, the client's call, the RPC, the raw request the wire would carry)."""
    h = convert.handle_to_proto(handle)
    return [
        ("empty prompt", lambda c: c.prefill([]), "Prefill", pb.PrefillRequest(request_id="r-empty")),
        ("request_id on a continuation", lambda c: c.prefill([5], kv_cache=handle, request_id="r-cont"),
         "Prefill", pb.PrefillRequest(token_ids=[5], kv_cache=h, request_id="r-cont")),
        ("hidden states asking nothing", lambda c: c.prefill(PROMPT, hidden_states=HiddenStatesRequest()),
         "Prefill", pb.PrefillRequest(token_ids=PROMPT, request_id="r-hidden", hidden_states=pb.HiddenStatesRequest())),
        ("hidden position past the prompt",
         lambda c: c.prefill(PROMPT, hidden_states=HiddenStatesRequest(layers=(0,), positions=(9,))),
         "Prefill", pb.PrefillRequest(token_ids=PROMPT, request_id="r-hpos",
                                      hidden_states=pb.HiddenStatesRequest(layers=[0], positions=[9]))),
        ("top_k 0", lambda c: c.decode(5, handle, logits=LogitsPolicy(LogitsKind.TOP_K, top_k=0)),
         "Decode", pb.DecodeRequest(token_id=5, kv_cache=h, logits=convert.policy_to_proto(
             LogitsPolicy(LogitsKind.TOP_K, top_k=0)))),
        ("a sequence twice in a batch", lambda c: c.batch_decode([(5, handle), (6, handle)]),
         "BatchDecode", pb.BatchDecodeRequest(items=[pb.DecodeItem(token_id=5, kv_cache=h),
                                                     pb.DecodeItem(token_id=6, kv_cache=h)])),
        ("a sequence continued twice", lambda c: c.batch_prefill([([1], handle), ([2], handle)]),
         "BatchPrefill", pb.BatchPrefillRequest(items=[pb.PrefillItem(token_ids=[1], kv_cache=h),
                                                       pb.PrefillItem(token_ids=[2], kv_cache=h)])),
        ("fork into none", lambda c: c.fork_cache(handle, 0), "ForkCache",
         pb.ForkCacheRequest(kv_cache=h, num_children=0)),
        ("two acceptance rules",
         lambda c: c.speculative_decode(5, [6, 7], handle, sampling=SpeculativeSampling(), token_choice=CHOICE),
         "SpeculativeDecode", pb.SpeculativeDecodeRequest(
             token_id=5, draft_token_ids=[6, 7], kv_cache=h, sampling=pb.SpeculativeSampling(temperature=1, top_p=1),
             token_choice=convert.token_choice_to_proto(CHOICE))),
        ("sampling at temperature 0",
         lambda c: c.speculative_decode(5, [6], handle, sampling=SpeculativeSampling(temperature=0.0)),
         "SpeculativeDecode", pb.SpeculativeDecodeRequest(
             token_id=5, draft_token_ids=[6], kv_cache=h, sampling=pb.SpeculativeSampling(temperature=0, top_p=1))),
        ("ticket lifetime", lambda c: c.create_import_ticket(ttl_s=1e6), "CreateImportTicket",
         pb.CreateImportTicketRequest(ttl_s=1e6)),
        ("push target", lambda c: c.push_sequence(handle, "no-port", "t"), "PushSequence",
         pb.PushSequenceRequest(kv_cache=h, target="no-port", ticket="t")),
    ]


def test_the_client_refuses_what_the_server_refuses_with_the_same_reason(client, stub, handle):
    def next_logits():
        fresh = client.prefill(PROMPT, logits=LogitsPolicy.argmax())
        try:
            return np.asarray(client.decode(PROMPT[-1], fresh.kv_cache, logits=LogitsPolicy()).logits)
        finally:
            client.release_cache(fresh.kv_cache)

    before = next_logits()
    for name, call, rpc, raw in _cases(handle):
        with pytest.raises(InvalidInput) as local:
            call(client)
        with pytest.raises(grpc.RpcError) as remote:
            reply = getattr(stub, rpc)(raw, timeout=30)
            if rpc in ("BatchDecode", "BatchPrefill"):  # server-streaming: the error comes with the stream
                list(reply)
        server = from_rpc_error(remote.value)
        assert isinstance(server, InvalidInput), (name, server)
        assert str(local.value) == str(server), name
    # the refusals changed nothing: the handle still decodes, and a fresh prompt gives what it gave
    grown = client.decode(PROMPT[-1], handle, logits=LogitsPolicy.argmax()).kv_cache
    assert grown.sequence_length == len(PROMPT) + 1
    assert client.truncate_kv(grown, len(PROMPT)) == handle
    np.testing.assert_array_equal(next_logits(), before)


def test_decode_ahead_rules_are_the_clients_too(client, stub, handle):
    """DecodeSession's decoding-ahead rules: the client's ``decode_ahead`` refuses an
    over-long run before the stream opens, with the reason a raw stream gets."""
    with pytest.raises(InvalidInput) as local:
        client.decode_ahead(5, handle, CHOICE, max_new_tokens=5000)
    raw = pb.DecodeSessionRequest(step_id=1, items=[pb.DecodeItem(
        token_id=5, kv_cache=convert.handle_to_proto(handle), token_choice=convert.token_choice_to_proto(CHOICE))],
        max_new_tokens=5000)
    replies = list(stub.DecodeSession(iter([raw]), timeout=30))
    assert replies and replies[0].HasField("error")
    server = from_status_proto(replies[0].error)
    assert isinstance(server, InvalidInput)
    assert str(local.value) == str(server)
