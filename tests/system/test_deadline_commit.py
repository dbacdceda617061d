"""A call answered DEADLINE_EXCEEDED changes nothing, even when its forward finished:
the server's event loop stalls (as in a process stopped and resumed) while a decode's
forward runs, the caller's deadline passes, and the finished decode must be undone,
not applied, so the caller's retry with its last handle succeeds.  Through real gRPC
on a real in-process server; the stall is a sleep scheduled on the server's loop from
inside the forward, so the order of events is fixed, not raced."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from ferrum_rpc.client import ExecutorClient, LogitsPolicy, TokenChoice
from ferrum_rpc.errors import ExecutorError
from tests.conftest import running_server

STALL_S = 1.5
TIMEOUT_S = 0.5


@pytest.fixture
def server(tiny_llama_dir):
    with running_server(tiny_llama_dir) as srv:
        yield srv


def _stall_loop_during_next_forward(server) -> threading.Event:
    """On the next forward: stall the server's event loop for STALL_S (scheduled from the
    worker thread, which then waits until the loop is inside the stall), then run it."""
    ex = server.app.servicer.gate.workers["tiny"].executor
    real, stalled = ex.run, threading.Event()

    def run(plans):
        ex.run = real
        server.loop.call_soon_threadsafe(lambda: (stalled.set(), time.sleep(STALL_S)))  # workload: the stall
        stalled.wait(5)
        return real(plans)

    ex.run = run
    return stalled


@pytest.mark.parametrize("call", ["decode", "decode_choice", "prefill_continued"])
def test_a_call_whose_deadline_passed_while_the_server_stalled_is_undone(server, call):
    with ExecutorClient(server.target, timeout=30) as steady, \
            ExecutorClient(server.target, timeout=TIMEOUT_S) as hasty:
        handle = steady.prefill([1, 17, 42, 99, 5], logits=LogitsPolicy.argmax()).kv_cache
        stalled = _stall_loop_during_next_forward(server)
        with pytest.raises(ExecutorError) as caught:
            if call == "decode":
                hasty.decode(7, handle, logits=LogitsPolicy.argmax())
            elif call == "decode_choice":
                hasty.decode(7, handle, token_choice=TokenChoice(temperature=1.0, seed=3))
            else:
                hasty.prefill([7, 8, 9], handle, logits=LogitsPolicy.argmax())
        assert stalled.is_set() and caught.value.code is grpc.StatusCode.DEADLINE_EXCEEDED
        serving = threading.Event()  # the loop runs this after the stall: the server is serving again
        server.loop.call_soon_threadsafe(serving.set)
        assert serving.wait(10 + STALL_S)
        retry = steady.decode(7, handle, logits=LogitsPolicy.argmax())  # the caller's retry, same handle
        assert retry.kv_cache.sequence_length == handle.sequence_length + 1
        steady.release_cache(retry.kv_cache)
