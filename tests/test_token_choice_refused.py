"""Token choice is served on Prefill, Decode, BatchDecode, DecodeSession and
BatchPrefill (tests/test_token_choice.py); SpeculativeDecode's acceptance by the
server's own choice is not yet: a ``token_choice`` there is refused with
UNIMPLEMENTED, and the refused call changes no state: never silently ignored."""

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


def test_speculative_decode_with_a_token_choice_is_refused_and_changes_nothing(stub):
    caps = stub.GetCapabilities(pb.GetCapabilitiesRequest(), timeout=30)
    assert caps.token_choice  # served elsewhere
    handle = stub.Prefill(pb.PrefillRequest(token_ids=[3, 7, 11], logits=ARGMAX), timeout=30).kv_cache
    before = stub.GetStatus(pb.GetStatusRequest(), timeout=30)

    with pytest.raises(grpc.RpcError) as info:
        stub.SpeculativeDecode(pb.SpeculativeDecodeRequest(
            kv_cache=handle, token_id=2, draft_token_ids=[4], token_choice=CHOICE), timeout=30)
    assert info.value.code() is grpc.StatusCode.UNIMPLEMENTED, info.value
    assert "token_choice is not served on SpeculativeDecode" in info.value.details()

    after = stub.GetStatus(pb.GetStatusRequest(), timeout=30)
    assert (after.active_sequences, after.kv_blocks_used) == (before.active_sequences, before.kv_blocks_used)
    out = stub.Decode(pb.DecodeRequest(kv_cache=handle, token_id=2, logits=ARGMAX), timeout=30)
    assert out.kv_cache.sequence_length == handle.sequence_length + 1  # the handle was still current
    stub.ReleaseCache(pb.ReleaseCacheRequest(cache_id=handle.cache_id), timeout=30)
