"""Until the executor serves it, a ``token_choice`` (issue 22's contract, implemented in
server/sampling.py) is refused with UNIMPLEMENTED wherever a request may carry one,
and the refused call changes no state: never silently ignored."""

from __future__ import annotations

import grpc
import pytest

from ferrum_rpc.v1 import executor_pb2 as pb
from ferrum_rpc.v1 import executor_pb2_grpc as pb_grpc

ARGMAX = pb.LogitsPolicy(kind=pb.LOGITS_KIND_ARGMAX)
CHOICE = pb.TokenChoice(temperature=0.8, seed=7)


@pytest.fixture
def stub(tiny_server):
    with grpc.insecure_channel(tiny_server.target) as channel:
        yield pb_grpc.ModelExecutorStub(channel)


def _refused(call) -> None:
    with pytest.raises(grpc.RpcError) as info:
        result = call()
        if hasattr(result, "__iter__") and not isinstance(result, pb.PrefillResponse):
            list(result)
    assert info.value.code() is grpc.StatusCode.UNIMPLEMENTED, info.value
    assert "token_choice is not served" in info.value.details()


def test_every_request_with_a_token_choice_is_refused_and_changes_nothing(stub):
    caps = stub.GetCapabilities(pb.GetCapabilitiesRequest(), timeout=30)
    assert not caps.token_choice
    handle = stub.Prefill(pb.PrefillRequest(token_ids=[3, 7, 11], logits=ARGMAX), timeout=30).kv_cache
    before = stub.GetStatus(pb.GetStatusRequest(), timeout=30)

    _refused(lambda: stub.Prefill(pb.PrefillRequest(token_ids=[3, 7], token_choice=CHOICE), timeout=30))
    _refused(lambda: stub.Decode(pb.DecodeRequest(kv_cache=handle, token_id=2, token_choice=CHOICE), timeout=30))
    _refused(lambda: stub.BatchDecode(pb.BatchDecodeRequest(
        items=[pb.DecodeItem(kv_cache=handle, token_id=2, token_choice=CHOICE)]), timeout=30))
    _refused(lambda: stub.BatchPrefill(pb.BatchPrefillRequest(
        items=[pb.PrefillItem(token_ids=[5, 6], token_choice=CHOICE)]), timeout=30))
    _refused(lambda: stub.SpeculativeDecode(pb.SpeculativeDecodeRequest(
        kv_cache=handle, token_id=2, draft_token_ids=[4], token_choice=CHOICE), timeout=30))
    session = stub.DecodeSession(iter([pb.DecodeSessionRequest(
        step_id=1, items=[pb.DecodeItem(kv_cache=handle, token_id=2, token_choice=CHOICE)])]), timeout=30)
    (reply,) = list(session)  # a session answers a failed step with its error and goes on
    assert reply.error.code == grpc.StatusCode.UNIMPLEMENTED.value[0]
    assert "token_choice is not served" in reply.error.message

    after = stub.GetStatus(pb.GetStatusRequest(), timeout=30)
    assert (after.active_sequences, after.kv_blocks_used) == (before.active_sequences, before.kv_blocks_used)
    out = stub.Decode(pb.DecodeRequest(kv_cache=handle, token_id=2, logits=ARGMAX), timeout=30)
    assert out.kv_cache.sequence_length == handle.sequence_length + 1  # the handle was still current
    stub.ReleaseCache(pb.ReleaseCacheRequest(cache_id=handle.cache_id), timeout=30)
