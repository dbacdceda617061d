"""Results that never reach the caller are undone (issue 20, items 5 and 6), on a
real server process: a streaming call that ends before its replies were handed
to gRPC leaves those sequences as they were, and a speculative round that fails
after its forward puts the sequence back."""

from __future__ import annotations

import math
import threading

import grpc
import pytest

from ferrum_rpc.client import ExecutorClient, LogitsPolicy
from ferrum_rpc.errors import ExecutorError, InvalidInput
from ferrum_rpc.types import SpeculativeSampling
from ferrum_rpc.v1 import executor_pb2 as pb
from ferrum_rpc.v1 import executor_pb2_grpc as pb_grpc
from tests.conftest import running_server
from tests.system.test_replicas import Replica
from tests.waiting import wait_for

FULL = pb.LogitsPolicy(kind=pb.LOGITS_KIND_FULL)  # 256 KiB a row: a few unread replies fill HTTP/2's windows
ARGMAX = pb.LogitsPolicy(kind=pb.LOGITS_KIND_ARGMAX)


@pytest.fixture(scope="module")
def huge_vocab_dir(tmp_path_factory):
    """SmolLM2's rows are 192 KiB; these are 256 KiB (65,536 tokens, hidden size 64)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.conftest import _save_tiny

    return _save_tiny(tmp_path_factory.mktemp("tiny-huge-vocab"), LlamaConfig, LlamaForCausalLM, seed=4,
                      vocab_size=65536)


@pytest.fixture(scope="module")
def replica(huge_vocab_dir):
    r = Replica(huge_vocab_dir, "--max-batch", "32", "--max-message-mb", "64")
    try:
        r.wait_serving()
        yield r
    finally:
        r.kill()


@pytest.fixture
def stub(replica):
    # no BDP probing: the stream windows stay at their initial 64 KiB, so a server can never
    # have handed every reply to gRPC (and ended the call OK) before the caller cancels
    with grpc.insecure_channel(replica.target, options=[("grpc.http2.bdp_probe", 0)]) as channel:
        yield pb_grpc.ModelExecutorStub(channel)


def _status(stub) -> tuple[int, int]:
    st = stub.GetStatus(pb.GetStatusRequest(), timeout=30)
    return st.active_sequences, st.kv_blocks_used


def _prompts(stub, n: int) -> list[pb.KvCacheHandle]:
    return [stub.Prefill(pb.PrefillRequest(token_ids=[3 + i, 7, 11, 5 + i], logits=ARGMAX), timeout=30).kv_cache
            for i in range(n)]


def _advanced(stub, handles) -> int:
    """How many sequences are past their handles (probed with a decode at the handle's length)."""
    count = 0
    for h in handles:
        try:
            out = stub.Decode(pb.DecodeRequest(kv_cache=h, token_id=1, logits=ARGMAX), timeout=30)
            stub.TruncateKv(pb.TruncateKvRequest(kv_cache=out.kv_cache, new_length=h.sequence_length), timeout=30)
        except grpc.RpcError as exc:
            assert exc.code() is grpc.StatusCode.FAILED_PRECONDITION and "LENGTH_MISMATCH" in exc.details()
            count += 1
    return count


def _advanced_after_undo(stub, handles, timeout: float = 10.0) -> int:
    """:func:`_advanced`, asked again until it reads 0; fails after ``timeout`` (the undo
    runs on the server's worker thread after the call ends)."""
    return wait_for(lambda: _advanced(stub, handles), timeout, "no sequence past its handle (the undo)",
                    until=lambda count: count == 0)


def _release(stub, handles) -> None:
    for h in handles:
        stub.ReleaseCache(pb.ReleaseCacheRequest(cache_id=h.cache_id), timeout=30)


def _settle(stub, expected, timeout: float = 10.0):
    return wait_for(lambda: _status(stub), timeout, f"(sequences, blocks used) back to {expected}",
                    until=lambda now: now == expected)


def test_batch_decode_cancelled_after_one_reply_changes_nothing(stub):
    """A cancelled call changes no state, whatever it had read: the reply read is void too."""
    handles = _prompts(stub, 32)
    call = stub.BatchDecode(pb.BatchDecodeRequest(items=[pb.DecodeItem(kv_cache=h, token_id=2) for h in handles],
                                                  logits=FULL), timeout=30)
    first = next(call)  # the batch's one forward ran; the other 31 replies cannot fit the 64 KiB windows
    call.cancel()
    advanced = _advanced_after_undo(stub, handles)
    assert advanced == 0, f"{advanced} of 32 sequences moved although the call was cancelled"
    assert first.kv_cache.sequence_length == handles[first.index].sequence_length + 1
    with pytest.raises(grpc.RpcError) as info:  # the handle the cancelled call carried is void
        stub.Decode(pb.DecodeRequest(kv_cache=first.kv_cache, token_id=1, logits=ARGMAX), timeout=30)
    assert "LENGTH_MISMATCH" in info.value.details()
    _release(stub, handles)


def test_decode_session_never_read_then_cancelled_changes_nothing(stub):
    handles = _prompts(stub, 24)
    requests = [pb.DecodeSessionRequest(step_id=i, items=[pb.DecodeItem(kv_cache=h, token_id=2)], logits=FULL)
                for i, h in enumerate(handles)]
    before = stub.GetStatus(pb.GetStatusRequest(), timeout=30).tokens_processed
    call = stub.DecodeSession(iter(requests), timeout=30)

    def observe():  # no reply is read
        first = stub.GetStatus(pb.GetStatusRequest(), timeout=30)
        then = stub.GetStatus(pb.GetStatusRequest(), timeout=30)  # a worker job and an event-loop turn later
        return first.tokens_processed, then.tokens_processed, then.session_bytes_unsent

    # steps ran and the session holds replies it cannot send: it runs no more until read
    wait_for(observe, 30, "(tokens, tokens, bytes unsent) of a session that stopped",
             until=lambda o: o[0] == o[1] > before and o[2] > 0)
    call.cancel()
    advanced = _advanced_after_undo(stub, handles)
    assert advanced == 0, f"{advanced} of 24 sequences advanced while their replies sat unread"
    _release(stub, handles)


def test_decode_session_keeps_steps_the_caller_confirmed(stub):
    """A step is confirmed by the caller's next step on its sequence (or a clean end):
    cancelling undoes only each sequence's last, unconfirmed step."""
    import queue

    # ten times: gRPC ends the request stream of a cancelled call as it does a half-close, and
    # about one cancel in three reaches the handler that way first (0.2 ms before the cancel)
    for _ in range(10):
        (handle,) = _prompts(stub, 1)
        outbox: queue.Queue = queue.Queue()
        call = stub.DecodeSession(iter(outbox.get, None), timeout=30)
        outbox.put(pb.DecodeSessionRequest(step_id=1, items=[pb.DecodeItem(kv_cache=handle, token_id=2)],
                                           logits=ARGMAX))
        first = next(call)
        outbox.put(pb.DecodeSessionRequest(step_id=2, items=[pb.DecodeItem(kv_cache=first.kv_cache, token_id=3)],
                                           logits=ARGMAX))
        second = next(call)
        assert second.kv_cache.sequence_length == handle.sequence_length + 2
        call.cancel()
        assert _advanced_after_undo(stub, [first.kv_cache]) == 0  # back where the first step left it
        _release(stub, [handle])

    # the control: a clean end (half-close, read to the end) keeps every step
    (handle,) = _prompts(stub, 1)
    replies = list(stub.DecodeSession(iter([pb.DecodeSessionRequest(
        step_id=1, items=[pb.DecodeItem(kv_cache=handle, token_id=2)], logits=ARGMAX)]), timeout=30))
    # the call ended OK, so its handler has returned: an undo it queued runs before these probes
    assert _advanced(stub, [replies[0].kv_cache]) == 0 and _advanced(stub, [handle]) == 1
    _release(stub, [handle])


def test_batch_prefill_cancelled_leaves_no_sequence(stub):
    before = _status(stub)
    items = [pb.PrefillItem(token_ids=list(range(5 + i, 25 + i))) for i in range(24)]  # 6 MB of replies
    call = stub.BatchPrefill(pb.BatchPrefillRequest(items=items, logits=FULL), timeout=30)
    first = next(call)
    # every prompt's sequence is made while the replies wait on the 64 KiB windows
    wait_for(lambda: _status(stub)[0], 30, "the 24 prompts' sequences", until=lambda n: n == before[0] + 24)
    call.cancel()
    seqs, _ = _settle(stub, before)
    assert (seqs, _) == before, f"{seqs - before[0]} of 24 prompts' sequences stayed after the call was cancelled"
    with pytest.raises(grpc.RpcError) as info:
        stub.ReleaseCache(pb.ReleaseCacheRequest(cache_id=first.kv_cache.cache_id), timeout=30)
    assert info.value.code() is grpc.StatusCode.NOT_FOUND


def test_a_read_stream_keeps_everything(stub):
    """The control: a caller that reads every reply keeps every sequence advanced."""
    handles = _prompts(stub, 8)
    replies = list(stub.BatchDecode(pb.BatchDecodeRequest(items=[pb.DecodeItem(kv_cache=h, token_id=2)
                                                                 for h in handles], logits=FULL), timeout=30))
    assert len(replies) == 8 and _advanced(stub, handles) == 8
    _release(stub, [r.kv_cache for r in replies])


@pytest.fixture(scope="module")
def ex(tiny_llama_dir):
    with running_server(tiny_llama_dir) as server, ExecutorClient(server.target, timeout=30) as client:
        yield client


@pytest.mark.parametrize("temperature", [1e-40, 1e-30, 1e-6])
def test_speculative_temperatures_that_underflow_are_greedy(ex, temperature):
    seq = ex.prefill([3, 14, 15, 92, 65], logits=LogitsPolicy.argmax())
    greedy = ex.speculative_decode(7, [8, 9, 10], seq.kv_cache)
    ex.truncate_kv(greedy.kv_cache, seq.kv_cache.sequence_length)
    sampled = ex.speculative_decode(7, [8, 9, 10], seq.kv_cache,
                                    sampling=SpeculativeSampling(temperature=temperature, seed=1))
    assert (sampled.accepted_token_ids, sampled.next_token_id) == (greedy.accepted_token_ids, greedy.next_token_id)
    ex.release_cache(sampled.kv_cache)


@pytest.mark.parametrize("temperature", [0.0, -1.0, math.nan, math.inf])
def test_speculative_bad_temperatures_change_nothing(ex, temperature):
    seq = ex.prefill([3, 14, 15, 92, 65], logits=LogitsPolicy.argmax())
    with pytest.raises(InvalidInput, match="finite temperature"):
        ex.speculative_decode(7, [8, 9], seq.kv_cache, sampling=SpeculativeSampling(temperature=temperature, seed=1))
    assert ex.decode(7, seq.kv_cache).kv_cache.sequence_length == 6  # the handle is still current
    ex.release_cache(seq.kv_cache)


def test_a_failure_after_the_speculative_forward_rolls_back(ex, monkeypatch):
    """Fault injection: the acceptance step raises after the forward wrote the drafts' KV."""
    from ferrum_rpc.server.choice import speculative

    def broken(*args):
        raise RuntimeError("injected failure after the forward")

    monkeypatch.setattr(speculative, "accept_sampled", broken)
    seq = ex.prefill([3, 14, 15, 92, 65], logits=LogitsPolicy.argmax())
    before = ex.status()
    with pytest.raises(ExecutorError) as info:
        ex.speculative_decode(7, [8, 9, 10], seq.kv_cache, sampling=SpeculativeSampling(temperature=0.7, seed=1))
    assert info.value.code is grpc.StatusCode.INTERNAL
    after = ex.status()
    assert (after.active_sequences, after.kv_blocks_used) == (before.active_sequences, before.kv_blocks_used)
    assert ex.decode(7, seq.kv_cache).kv_cache.sequence_length == 6
    ex.release_cache(seq.kv_cache)
