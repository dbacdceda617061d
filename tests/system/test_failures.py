"""Regression tests for failures found by probing a running server (issue: correct
under every failure).  Each goes through real gRPC; the model worker is held with
gates (jobs that wait on an Event), never with sleeps, so "in the middle of a
chunked prefill" is a fact and not a guess.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
import torch

from ferrum_rpc import convert
from ferrum_rpc.client import ExecutorClient, LogitsPolicy
from ferrum_rpc.errors import (CacheExpired, InvalidInput, KvCapacityExhausted, ModelNotFound, SequenceTooLong,
                               from_rpc_error)
from ferrum_rpc.v1 import executor_pb2 as pb
from ferrum_rpc.v1 import executor_pb2_grpc as pb_grpc
from tests.conftest import TINY, running_server
from tests.waiting import wait_for

VOCAB = TINY["vocab_size"]
CODE = grpc.StatusCode


def prompt(n: int, seed: int = 0) -> list[int]:
    return [(37 * i + 11 + 101 * seed) % VOCAB for i in range(n)]


class Gates:
    """Holds a server's model worker: each gate is a job that waits on its Event."""

    def __init__(self, server, model: str = "tiny"):
        self.worker = server.app.servicer.gate.workers[model]
        self.events: list[threading.Event] = []

    def add(self):
        event = threading.Event()
        self.events.append(event)
        return event, self.worker.submit(event.wait, 30)

    def hold(self) -> threading.Event:
        """A gate that is running now: the worker is provably busy."""
        event, job = self.add()
        wait_for(job.running, 10, "the gate to hold the worker")
        return event

    def release_all(self) -> None:
        for event in self.events:
            event.set()


def kv_state(c: ExecutorClient) -> tuple[int, int, int]:
    s = c.status()
    return s.kv_blocks_used, s.kv_blocks_free, s.active_sequences


@pytest.fixture
def pool():
    with ThreadPoolExecutor(4) as executor:
        yield executor


# -- 1. the idle reaper never takes a sequence a job is using --------------------------
def test_idle_reaper_never_frees_a_sequence_mid_chunked_prefill(tiny_llama_dir, hf_tiny_llama, pool):
    long_prompt = prompt(24)
    idle_s = 0.5
    with running_server(tiny_llama_dir, prefill_chunk=8, idle_timeout_s=idle_s) as server, \
            ExecutorClient(server.target, timeout=30) as ex:
        gates = Gates(server)
        first = gates.hold()
        call = pool.submit(ex.prefill, long_prompt)
        wait_for(lambda: gates.worker.queue_depth, 10, "one call queued", until=lambda n: n == 1)
        second, second_job = gates.add()  # queue: [prefill, gate 2]
        first.set()  # the prefill's first chunk runs, then gate 2 holds the worker ...
        wait_for(second_job.running, 10, "the second gate to hold the worker")
        # ... until the sequence is idle past the timeout and a reaper pass is due, so that the
        # worker's next turn reaps before the prefill's next chunk runs
        due = max(gates.worker._next_reap, time.monotonic() + idle_s)
        wait_for(lambda: time.monotonic() > due, 10, "the idle timeout and the next reaper pass to be due")
        second.set()
        out = call.result(timeout=30)
        assert gates.worker._next_reap > due, "no reaper pass ran while the sequence was idle"

        status = ex.status()
        assert status.sequences_expired == 0
        assert status.active_sequences == 1
        ids = out.kv_cache.block_table.block_ids
        assert len(set(ids)) == len(ids) == len(long_prompt) // 4  # no block listed twice
        assert status.kv_blocks_used == len(ids)
        # The KV is intact: the next step equals transformers on the same tokens.
        step = ex.decode(7, out.kv_cache)
        with torch.no_grad():
            ref = hf_tiny_llama(torch.tensor([long_prompt + [7]])).logits[0, -1].numpy()
        np.testing.assert_allclose(step.logits.values[0], ref, atol=1e-4, rtol=0)
        # A second caller sharing the prefix gets cached blocks and correct logits too.
        again = ex.prefill(long_prompt + [7], logits=LogitsPolicy.full())
        assert again.cached_tokens > 0
        np.testing.assert_allclose(again.logits.values[0], ref, atol=1e-4, rtol=0)


def test_failing_calls_do_not_keep_a_sequence_alive(tiny_llama_dir):
    with running_server(tiny_llama_dir, idle_timeout_s=0.5) as server, \
            ExecutorClient(server.target, timeout=30) as ex:
        handle = ex.prefill(prompt(6)).kv_cache
        stale = convert.handle_from_proto(convert.handle_to_proto(handle))
        wrong = pb.KvCacheHandle()
        wrong.CopyFrom(convert.handle_to_proto(stale))
        wrong.sequence_length += 1
        bad = convert.handle_from_proto(wrong)

        def fail_once_more() -> int:
            with pytest.raises(Exception):
                ex.decode(5, bad)
            return ex.status().sequences_expired

        # only failing calls use the sequence until the reaper takes it
        wait_for(fail_once_more, 10, "the sequence to expire while only failing calls name it")
        with pytest.raises(CacheExpired):
            ex.decode(5, handle)


# -- 2. a failed call changes nothing ----------------------------------------------
def test_every_reply_kind_is_size_checked_before_any_work(tiny_llama_dir):
    with running_server(tiny_llama_dir, max_message_bytes=32 * 1024) as server, \
            ExecutorClient(server.target, timeout=30) as ex:
        before, forwards = kv_state(ex), ex.status().forwards
        too_big = LogitsPolicy.topk(VOCAB, all_positions=True)  # 40 x 320 x (4 + up to 5) bytes
        with pytest.raises(InvalidInput, match="message limit"):
            ex.prefill(prompt(40), logits=too_big)
        handle = ex.prefill(prompt(8), logits=LogitsPolicy.argmax()).kv_cache
        state = kv_state(ex)
        with pytest.raises(InvalidInput, match="message limit"):
            ex.forward_verify(prompt(40, seed=1), handle, logits=LogitsPolicy.topk(VOCAB))
        assert kv_state(ex) == state
        ex.release_cache(handle)
        assert kv_state(ex) == before
        assert ex.status().forwards == forwards + 1  # only the good prefill ran
        # within the limit, the same kinds are served
        ok = ex.prefill(prompt(10), logits=LogitsPolicy.topk(VOCAB, all_positions=True))
        assert ok.logits.values.shape == (10, VOCAB)
        # BatchDecode with small rows answers in one message (single_reply): all rows count together
        handles = [ex.prefill(prompt(8, seed=i), logits=LogitsPolicy.argmax()).kv_cache for i in range(12)]
        state, forwards = kv_state(ex), ex.status().forwards
        with pytest.raises(InvalidInput, match="message limit"):  # 12 x 320 x 9 bytes > 32 KiB
            ex.batch_decode([(1, h) for h in handles], logits=LogitsPolicy.topk(VOCAB))
        assert kv_state(ex) == state and ex.status().forwards == forwards
        outs = ex.batch_decode([(1, h) for h in handles[:8]], logits=LogitsPolicy.topk(VOCAB))
        assert [o.kv_cache.sequence_length for o in outs] == [9] * 8


@pytest.mark.parametrize("how", ["deadline", "cancel"])
def test_abandoned_chunked_prefill_stops_and_undoes_its_work(tiny_llama_dir, how, pool):
    with running_server(tiny_llama_dir, prefill_chunk=8) as server, \
            ExecutorClient(server.target, timeout=30) as ex:
        before, forwards = kv_state(ex), ex.status().forwards
        stub = pb_grpc.ModelExecutorStub(grpc.insecure_channel(server.target))
        gates = Gates(server)
        first = gates.hold()
        request = pb.PrefillRequest(token_ids=prompt(200), logits=pb.LogitsPolicy(kind=pb.LOGITS_KIND_ARGMAX))
        call = stub.Prefill.future(request, timeout=0.5 if how == "deadline" else 30)
        wait_for(lambda: gates.worker.queue_depth, 10, "one call queued", until=lambda n: n == 1)
        second, second_job = gates.add()
        first.set()  # one chunk runs, then the worker is held again
        wait_for(second_job.running, 10, "the second gate to hold the worker")
        if how == "cancel":
            call.cancel()
        with pytest.raises(grpc.FutureCancelledError if how == "cancel" else grpc.RpcError) as info:
            call.result(timeout=10)
        if how == "deadline":
            assert info.value.code() == CODE.DEADLINE_EXCEEDED
        wait_for(lambda: server.app.servicer.gate.inflight, 10, "the server to see the caller go",
                 until=lambda n: n == 0)
        second.set()
        assert kv_state(ex) == before  # every chunk undone, nothing stranded
        assert ex.status().forwards <= forwards + 2  # it stopped at the next chunk boundary


def test_three_expired_long_prefills_leave_no_blocks_behind(tiny_llama_dir):
    with running_server(tiny_llama_dir, prefill_chunk=8, kv_tokens=1024) as server, \
            ExecutorClient(server.target, timeout=30) as ex:
        before = kv_state(ex)
        stub = pb_grpc.ModelExecutorStub(grpc.insecure_channel(server.target))
        gates = Gates(server)
        gate = gates.hold()
        request = pb.PrefillRequest(token_ids=prompt(240), logits=pb.LogitsPolicy(kind=pb.LOGITS_KIND_ARGMAX))
        calls = [stub.Prefill.future(request, timeout=0.3) for _ in range(3)]
        for call in calls:
            with pytest.raises(grpc.RpcError) as info:
                call.result(timeout=10)
            assert info.value.code() == CODE.DEADLINE_EXCEEDED
        gate.set()
        assert kv_state(ex) == before


def test_prompt_larger_than_the_whole_pool_is_refused_before_any_forward(tiny_llama_dir):
    """Refused at once: no wait for room can admit it (a deadline of half the admission
    wait would expire if it were parked like a prompt that may fit later)."""
    from ferrum_rpc.server.engine.worker import ModelWorker

    with running_server(tiny_llama_dir, kv_tokens=64, prefill_chunk=8, max_seq_len=256) as server, \
            ExecutorClient(server.target, timeout=30) as ex, \
            ExecutorClient(server.target, timeout=ModelWorker.ADMISSION_WAIT_S / 2) as hasty:
        forwards = ex.status().forwards
        with pytest.raises(KvCapacityExhausted, match="whole pool"):
            hasty.prefill(prompt(100))
        with pytest.raises(SequenceTooLong):
            hasty.prefill(prompt(300))
        handle = ex.prefill(prompt(8)).kv_cache
        with pytest.raises(KvCapacityExhausted, match="whole pool"):
            ex.forward_verify(prompt(80), handle)
        assert ex.status().forwards == forwards + 1


# -- 3. big replies are built off the event loop -------------------------------------
@pytest.fixture(scope="module")
def wide_model_dir(tmp_path_factory):
    """A tiny model with a 50k vocabulary, so replies are large while forwards stay cheap."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    config = LlamaConfig(vocab_size=50_000, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512)
    path = tmp_path_factory.mktemp("wide-llama")
    LlamaForCausalLM(config).eval().save_pretrained(path)
    return path


def test_a_huge_reply_does_not_stall_other_callers(wide_model_dir, pool):
    with running_server(wide_model_dir, name="tiny") as server, \
            ExecutorClient(server.target, timeout=60) as ex:
        stub = pb_grpc.ModelExecutorStub(grpc.insecure_channel(
            server.target, options=[("grpc.max_receive_message_length", 512 << 20)]))
        request = pb.PrefillRequest(token_ids=[(7 * i) % 50_000 for i in range(250)], logits=pb.LogitsPolicy(
            kind=pb.LOGITS_KIND_TOP_K, top_k=50_000, all_positions=True))
        big = pool.submit(stub.Prefill, request, timeout=120)
        worst = 0.0
        while not big.done():
            t0 = time.perf_counter()
            ex.info()  # needs no model: must never wait behind another caller's reply
            worst = max(worst, time.perf_counter() - t0)
        reply = big.result()
        assert reply.logits.positions == 250 and not reply.logits.HasField("values")
        assert len(reply.logits.scores) == len(reply.logits.token_ids) == 250 * 50_000
        assert worst < 1.0, f"GetModelInfo waited {worst:.2f}s behind a large reply"


# -- 4. long verifies run in chunks -------------------------------------------------------
def test_long_forward_verify_runs_in_chunks_with_decodes_between(tiny_llama_dir, pool):
    with running_server(tiny_llama_dir, prefill_chunk=8) as server, \
            ExecutorClient(server.target, timeout=30) as ex:
        base, draft = prompt(5), prompt(40, seed=2)
        handle = ex.prefill(base).kv_cache
        other = ex.prefill(prompt(3, seed=3)).kv_cache
        reference = ex.prefill(base + draft, logits=LogitsPolicy.full(all_positions=True))

        gates = Gates(server)
        first = gates.hold()
        verify = pool.submit(ex.forward_verify, draft, handle)
        wait_for(lambda: gates.worker.queue_depth, 10, "one call queued", until=lambda n: n == 1)
        decode = pool.submit(ex.decode, 9, other)
        wait_for(lambda: gates.worker.queue_depth, 10, "two calls queued", until=lambda n: n == 2)
        second, second_job = gates.add()  # queue: [verify, decode, gate 2]
        first.set()
        wait_for(second_job.running, 10, "the second gate to hold the worker")  # verify ran one chunk, requeued behind the decode
        assert decode.result(timeout=10).kv_cache.sequence_length == 4
        assert not verify.done()
        second.set()
        out = verify.result(timeout=30)
        assert out.kv_cache.sequence_length == len(base) + len(draft)
        np.testing.assert_allclose(out.logits.values, reference.logits.values[len(base):], atol=1e-4, rtol=0)


# -- 5. DecodeSession back-pressure ---------------------------------------------------
def test_decode_session_stops_reading_when_the_caller_does_not(wide_model_dir):
    with running_server(wide_model_dir, name="tiny") as server, \
            ExecutorClient(server.target, timeout=60) as ex:
        handles = [ex.prefill([1 + i, 2, 3], logits=LogitsPolicy.argmax()).kv_cache for i in range(128)]
        before = ex.status().tokens_processed
        requests = [pb.DecodeSessionRequest(step_id=i, items=[pb.DecodeItem(
            token_id=5, kv_cache=convert.handle_to_proto(h))]) for i, h in enumerate(handles)]
        channel = grpc.insecure_channel(server.target)
        stream = pb_grpc.ModelExecutorStub(channel).DecodeSession(iter(requests), timeout=30)

        def observe():  # the caller writes 128 steps of 200 KB replies and reads none
            first = ex.status()
            then = ex.status()  # a job through the worker and a turn of the event loop later
            return first.tokens_processed, then.tokens_processed, then.session_bytes_unsent

        # the session holds replies it cannot send and runs no more steps
        _, done, _ = wait_for(observe, 30, "(tokens, tokens, bytes unsent) of a session that stopped",
                              until=lambda o: o[0] == o[1] > before and o[2] > 0)
        ran = done - before
        # the window of pending steps plus what the transport buffers (a few MB), not all 128
        assert ran <= 48, f"{ran} of 128 steps ran for a caller that reads nothing"
        got = [next(stream) for _ in range(128)]  # reading resumes the session; nothing is lost
        assert sorted(r.step_id for r in got) == list(range(128))
        assert all(not r.HasField("error") for r in got)
        stream.cancel()
        channel.close()


# -- 6. malformed input ---------------------------------------------------------------------
def test_unparseable_request_is_invalid_input_with_one_short_log_line(tiny_server, caplog):
    channel = grpc.insecure_channel(tiny_server.target)
    prefill = channel.unary_unary("/ferrum.executor.v1.ModelExecutor/Prefill")
    caplog.set_level(logging.WARNING, logger="ferrum_rpc")
    for _ in range(30):
        with pytest.raises(grpc.RpcError) as info:
            prefill(b"\xff\xff\xff\xff", timeout=10)
        err = from_rpc_error(info.value)
        assert info.value.code() == CODE.INVALID_ARGUMENT and type(err) is InvalidInput
        assert "PrefillRequest" in err.message
    records = [r for r in caplog.records if "malformed" in r.getMessage()]
    assert 1 <= len(records) <= 2  # rate-limited
    assert all(r.exc_info is None and len(r.getMessage()) < 300 for r in records)
    channel.close()


def test_huge_ids_are_refused_without_being_echoed(tiny_server, client):
    huge = "x" * 16384
    with pytest.raises(InvalidInput) as info:
        client.release_cache(huge)
    assert len(str(info.value)) < 300
    handle = client.prefill([1, 2, 3]).kv_cache
    forged = pb.KvCacheHandle()
    forged.CopyFrom(convert.handle_to_proto(handle))
    forged.cache_id = huge
    with pytest.raises(InvalidInput) as info:
        client.decode(5, convert.handle_from_proto(forged))
    assert "cache_id" in str(info.value) and len(str(info.value)) < 300
    with ExecutorClient(tiny_server.target, model=huge, timeout=10) as other:
        with pytest.raises(ModelNotFound) as info:
            other.prefill([1, 2])
    assert len(str(info.value)) < 400
    client.release_cache(handle)


def test_handle_with_only_a_cache_id_names_the_missing_field(tiny_server, client):
    handle = client.prefill([1, 2, 3]).kv_cache
    stub = pb_grpc.ModelExecutorStub(grpc.insecure_channel(tiny_server.target))
    request = pb.DecodeRequest(token_id=4, kv_cache=pb.KvCacheHandle(cache_id=handle.cache_id,
                                                                        sequence_length=3))
    with pytest.raises(grpc.RpcError) as info:
        stub.Decode(request, timeout=10)
    err = from_rpc_error(info.value)
    assert type(err) is InvalidInput and "server_instance_id" in err.message
    # with the instance id (as the last reply said), the same minimal handle works
    request.kv_cache.server_instance_id = handle.server_instance_id
    assert stub.Decode(request, timeout=10).kv_cache.sequence_length == 4
