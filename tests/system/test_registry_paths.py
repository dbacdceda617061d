"""Hostile inputs that used to be echoed or trusted (issue 20, item 11), through a real
gRPC server.

LoadModel with a path the OS refuses (a 256-character component: ENAMETOOLONG) answered
INTERNAL with the raw OSError, path and all, and a traceback in the log; a 100 KB path
was echoed whole, so the trailers outgrew gRPC's metadata limit and the caller got
RESOURCE_EXHAUSTED instead of the error.  Both are INVALID_ARGUMENT / INVALID_INPUT now,
with a bounded message and no traceback.

A continuation Prefill asking for attention weights with a handle claiming 2^31 tokens
got a message-size refusal computed from the claimed length: the handle is now resolved
before its length is used (LENGTH_MISMATCH, CACHE_NOT_FOUND, STALE_HANDLE as for any
other call), and nothing changes.
"""

from __future__ import annotations

import dataclasses
import logging

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from ferrum_rpc.client import CacheNotFound, ExecutorClient, LengthMismatch, LogitsPolicy
from ferrum_rpc.errors import StaleHandle
from ferrum_rpc.types import HiddenStatesRequest
from ferrum_rpc.v1 import executor_pb2 as pb
from ferrum_rpc.v1 import executor_pb2_grpc as pb_grpc
from tests.conftest import running_server

BOUND = 400  # characters an error message may take, whatever the path


def _reason(err: grpc.RpcError) -> str | None:
    status = rpc_status.from_call(err)
    for detail in status.details if status else ():
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            return info.reason
    return None


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    with running_server(tiny_llama_dir, name="first") as srv:
        yield srv


def _load(target: str, name: str, path: str) -> grpc.RpcError:
    """A LoadModel that must fail: its error, as the wire has it."""
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.ModelExecutorStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            for _ in stub.LoadModel(pb.LoadModelRequest(name=name, path=path), timeout=30):
                pass
    return info.value


@pytest.mark.parametrize("shape", ["component-256", "path-100k", "path-4097", "under-a-file"])
def test_load_model_refuses_paths_the_os_refuses_with_a_bounded_message(server, tmp_path, caplog, shape):
    (tmp_path / "file").write_text("x")
    path = {
        "component-256": str(tmp_path / ("a" * 256) / "model"),  # ENAMETOOLONG from stat
        "path-100k": "/" + "b/" * 50_000,  # 100 KB: the trailers could never hold it
        "path-4097": "/" + "c" * 4096,  # one byte over the cap
        "under-a-file": str(tmp_path / "file" / "model"),  # ENOTDIR
    }[shape]
    with caplog.at_level(logging.INFO, logger="ferrum_rpc"):
        err = _load(server.target, "x", path)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (err.code(), err.details()[:200])
    assert _reason(err) == "INVALID_INPUT"
    assert len(err.details()) < BOUND, err.details()[:BOUND]
    assert path[:16] in err.details()  # a prefix of the path, to recognise it by
    assert not [r for r in caplog.records if r.exc_info], "no traceback for a caller's bad path"
    with ExecutorClient(server.target, timeout=30) as ex:
        assert [m.name for m in ex.list_models()] == ["first"]


@pytest.fixture
def ex(server):
    with ExecutorClient(server.target, timeout=30) as client:
        yield client


def _attention():
    return HiddenStatesRequest(attention_layers=(0,))  # its size grows with the sequence's start


def test_a_continuation_with_hidden_states_resolves_its_handle_before_sizing(ex):
    head = ex.prefill([1, 2, 3, 4], logits=LogitsPolicy.argmax())
    handle = head.kv_cache
    before = (ex.status().active_sequences, ex.status().kv_blocks_used)
    huge = dataclasses.replace(handle, sequence_length=2**31)  # 4 x 4 heads x (2^31 + 2) x 2 rows: ~69 GB
    with pytest.raises(LengthMismatch, match="2147483648"):
        ex.prefill([5, 6], huge, hidden_states=_attention())
    with pytest.raises(CacheNotFound):
        ex.prefill([5, 6], dataclasses.replace(huge, cache_id="no-such-sequence"), hidden_states=_attention())
    with pytest.raises(StaleHandle):
        ex.prefill([5, 6], dataclasses.replace(huge, server_instance_id="another-server"),
                   hidden_states=_attention())
    assert (ex.status().active_sequences, ex.status().kv_blocks_used) == before
    # the real handle is untouched and its continuation's weights are sized from the real start
    out = ex.prefill([5, 6], handle, hidden_states=_attention())
    assert out.kv_cache.sequence_length == 6 and out.attention_weights[0].shape == (4, 2, 6)
    ex.release_cache(out.kv_cache)
