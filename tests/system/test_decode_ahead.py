"""Decoding ahead through real gRPC: a DecodeSession step with
``max_new_tokens`` lets the server choose, append and stream tokens on its own.
N server-side steps equal N single steps token for token (greedy and seeded, one
item and a batch of mixed lengths); a stop token ends it; a stop message ends it
with a handle covering exactly the tokens received; a cancelled session leaves the
sequence where the step found it; a caller that stops reading pauses the step;
``forwards_per_response`` packs several forwards a message with the same tokens;
bad requests are refused with no state change."""

from __future__ import annotations


import grpc
import pytest

from ferrum_rpc import convert
from ferrum_rpc.client import DecodeInput, ExecutorClient, TokenChoice
from ferrum_rpc.errors import ExecutorError, Reason
from ferrum_rpc.server.engine.ahead import QUEUED_FORWARDS
from ferrum_rpc.v1 import executor_pb2 as pb
from ferrum_rpc.v1 import executor_pb2_grpc as pb_grpc
from tests.conftest import executor_snapshot
from tests.waiting import wait_for

PROMPTS = ([1, 17, 42, 99, 5, 230, 17, 8], [3, 4, 5], [200, 201, 9, 9, 9, 12, 40, 41, 42, 43, 44])
GREEDY = TokenChoice(temperature=0.0)
SEEDED = TokenChoice(temperature=0.9, top_k=40, top_p=0.95, seed=77, presence_penalty=0.5)


@pytest.fixture(scope="module")
def client(tiny_server):
    with ExecutorClient(tiny_server.target, timeout=60) as c:
        yield c


def _executor(server):
    return server.app.servicer.gate.workers["tiny"].executor


def _single_steps(client, prompt, choice, n):
    """The reference: Prefill, then n Decode calls each feeding the last chosen token."""
    out = client.prefill(prompt, token_choice=choice)
    tokens, handle = [out.chosen.token_id], out.kv_cache
    for _ in range(n):
        out = client.decode(tokens[-1], handle, token_choice=choice)
        tokens.append(out.chosen.token_id)
        handle = out.kv_cache
    client.release_cache(handle)
    return tokens


@pytest.mark.parametrize("choice", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_decoding_ahead_equals_single_steps(client, choice):
    n = 20
    want = [_single_steps(client, p, choice, n) for p in PROMPTS]
    outs = [client.prefill(p, token_choice=choice) for p in PROMPTS]
    with client.decode_session() as session:
        run = session.decode_ahead([DecodeInput(o.chosen.token_id, o.kv_cache, choice) for o in outs], n)
        got = [[o.chosen.token_id] for o in outs]
        for index, chosen in run:
            got[index].append(chosen.token_id)
        results = run.results
    assert got == want
    for prompt, out, result in zip(PROMPTS, outs, results):
        assert result.finish_reason == "length"
        assert [c.token_id for c in result.chosen] == got[PROMPTS.index(prompt)][1:]
        assert result.kv_cache.sequence_length == len(prompt) + n  # the last token is the next step's
        step = client.decode(result.chosen[-1].token_id, result.kv_cache, token_choice=choice)
        assert step.kv_cache.sequence_length == len(prompt) + n + 1
        client.release_cache(step.kv_cache)


def test_forwards_per_response_sends_several_forwards_a_message_with_the_same_tokens(client, tiny_server):
    """``forwards_per_response`` = 4 over 10 forwards of 3 items: 3 messages (4, 4 and 2
    forwards), each's ``results`` forward after forward in item order, the handles on
    the last; the tokens those of single steps.  The client's whole run (no on_token)
    asks for it and gets the same tokens."""
    n = 10
    want = [_single_steps(client, p, GREEDY, n) for p in PROMPTS]
    outs = [client.prefill(p, token_choice=GREEDY) for p in PROMPTS]
    request = pb.DecodeSessionRequest(step_id=5, max_new_tokens=n, forwards_per_response=4)
    for o in outs:
        item = request.items.add(token_id=o.chosen.token_id, kv_cache=convert.handle_to_proto(o.kv_cache))
        item.token_choice.CopyFrom(convert.token_choice_to_proto(GREEDY))
    with grpc.insecure_channel(tiny_server.target) as channel:
        replies = list(pb_grpc.ModelExecutorStub(channel).DecodeSession(iter([request]), timeout=30))
    assert [len(r.results) for r in replies] == [12, 12, 6]
    results = [r for reply in replies for r in reply.results]
    assert [r.index for r in results] == [0, 1, 2] * n
    got = [[o.chosen.token_id] for o in outs]
    for r in results:
        got[r.index].append(r.chosen.token_id)
    assert got == want
    assert [r.finish_reason for r in results[-3:]] == [pb.FINISH_REASON_LENGTH] * 3
    assert not any(r.HasField("kv_cache") for r in results[:-3])
    for prompt, r in zip(PROMPTS, results[-3:]):
        assert r.kv_cache.sequence_length == len(prompt) + n
        client.release_cache(convert.handle_from_proto(r.kv_cache))
    out = client.prefill(PROMPTS[2], token_choice=GREEDY)
    result = client.decode_ahead(out.chosen.token_id, out.kv_cache, GREEDY, n)
    assert [out.chosen.token_id] + [c.token_id for c in result.chosen] == want[2]
    client.release_cache(result.kv_cache)


def test_a_stop_token_ends_the_item_and_is_emitted(client):
    want = _single_steps(client, PROMPTS[0], GREEDY, 16)
    stop_at = next(i for i in range(4, 16) if want[i] not in want[1:i])  # its first occurrence
    out = client.prefill(PROMPTS[0], token_choice=GREEDY)
    with client.decode_session() as session:
        run = session.decode_ahead([DecodeInput(out.chosen.token_id, out.kv_cache, GREEDY)], 100,
                                   stop_token_ids=[want[stop_at]])
        (result,) = run.wait()
    assert result.finish_reason == "stop_token"
    assert [c.token_id for c in result.chosen] == want[1:stop_at + 1]
    assert result.kv_cache.sequence_length == len(PROMPTS[0]) + stop_at
    client.release_cache(result.kv_cache)


def test_a_stop_message_leaves_a_handle_covering_the_tokens_received(client, tiny_server):
    """Stop after 5 tokens received: the run ends after the server's current forward,
    every token it chose is received, and the handle covers exactly them; the sequence
    goes on from there as if it had been decoded step by step."""
    want = _single_steps(client, PROMPTS[2], GREEDY, 200)
    out = client.prefill(PROMPTS[2], token_choice=GREEDY)
    with client.decode_session() as session:
        run = session.decode_ahead([DecodeInput(out.chosen.token_id, out.kv_cache, GREEDY)], 200)
        received = []
        for _, chosen in run:
            received.append(chosen.token_id)
            if len(received) == 5:
                run.stop()
        (result,) = run.results
        assert result.finish_reason == "stopped"
        assert 5 <= len(received) < 200
        assert received == want[1:len(received) + 1]
        assert result.kv_cache.sequence_length == len(PROMPTS[2]) + len(received)
        seq = _executor(tiny_server).kv.snapshot().sequences[result.kv_cache.cache_id]
        assert seq.length == result.kv_cache.sequence_length
        (step,) = session.step([DecodeInput(received[-1], result.kv_cache, GREEDY)])  # the session goes on
        assert step.chosen.token_id == want[len(received) + 1]
    client.release_cache(step.kv_cache)


def test_a_cancelled_session_leaves_the_sequence_where_the_step_found_it(client, tiny_server):
    out = client.prefill(PROMPTS[0], token_choice=GREEDY)
    before = _executor(tiny_server).kv.snapshot().sequences[out.kv_cache.cache_id].length
    with grpc.insecure_channel(tiny_server.target) as channel:
        stub = pb_grpc.ModelExecutorStub(channel)
        request = pb.DecodeSessionRequest(step_id=1, max_new_tokens=200)
        item = request.items.add(token_id=out.chosen.token_id, kv_cache=convert.handle_to_proto(out.kv_cache))
        item.token_choice.CopyFrom(convert.token_choice_to_proto(GREEDY))
        call = stub.DecodeSession(iter([request]), timeout=30)
        for n, reply in enumerate(call):
            assert reply.HasField("chosen") and not reply.HasField("error")
            if n == 3:
                call.cancel()
                break
    wait_for(lambda: _executor(tiny_server).kv.snapshot().sequences[out.kv_cache.cache_id].length, 10,
             f"the cancelled run to be undone (length back to {before})", until=lambda n: n == before)
    step = client.decode(out.chosen.token_id, out.kv_cache, token_choice=GREEDY)  # the old handle holds
    client.release_cache(step.kv_cache)


def _paused_for_good(length, client) -> int:
    """The unread run's length once it is paused with replies it cannot send, and stays so
    across a GetStatus (a job through the model worker and a turn of the server's event
    loop, where a write that could still complete would complete and unpause the run)."""
    def observe():
        before = length()
        status = client.status()
        return before, length(), status.ahead_runs_paused, status.session_bytes_unsent

    _, after, _, _ = wait_for(observe, 30, "(length, length, runs paused, bytes unsent) of a run paused for good",
                              until=lambda o: o[0] == o[1] and o[2] == 1 and o[3] > 0)
    return after


def test_a_caller_that_stops_reading_pauses_the_run(tiny_server, client):
    """The caller's receive window is 1 KiB and each reply carries 20 logprobs: once
    the window, gRPC's buffers and the step's 32 unread replies are full, the server
    decodes no further until the caller reads (the sequence stops growing while another
    caller's decode runs a forward)."""
    options = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]
    choice = TokenChoice(temperature=0.0, top_logprobs=20)
    with ExecutorClient(tiny_server.target, timeout=60, channel_options=options) as c:
        out = c.prefill(PROMPTS[1], token_choice=choice)
        ex = _executor(tiny_server)
        with c.decode_session() as session:
            run = session.decode_ahead([DecodeInput(out.chosen.token_id, out.kv_cache, choice)], 240)

            def length():
                return ex.kv.snapshot().sequences[out.kv_cache.cache_id].length

            paused = _paused_for_good(length, client)
            other = client.prefill(PROMPTS[0], token_choice=GREEDY)
            step = client.decode(other.chosen.token_id, other.kv_cache, token_choice=GREEDY)  # a forward
            client.release_cache(step.kv_cache)
            assert length() == paused < len(PROMPTS[1]) + 240, "the unread run kept decoding"
            (result,) = run.wait()  # reading lets it finish
        assert result.finish_reason == "length" and len(result.chosen) == 240
        c.release_cache(result.kv_cache)


@pytest.mark.parametrize("change, why", [
    (lambda r: setattr(r, "max_new_tokens", 4097), "at most 4096"),
    (lambda r: r.items[0].ClearField("token_choice"), "needs a token_choice"),
    (lambda r: r.logits.CopyFrom(pb.LogitsPolicy(kind=pb.LOGITS_KIND_ARGMAX)), "logits and single_reply"),
    (lambda r: setattr(r, "single_reply", True), "logits and single_reply"),
    (lambda r: r.stop_token_ids.append(320), "outside the vocabulary"),
    (lambda r: r.stop_token_ids.extend(range(65)), "at most 64"),
    (lambda r: (setattr(r, "max_new_tokens", 0), r.stop_token_ids.append(5)), "set max_new_tokens"),
    (lambda r: setattr(r, "forwards_per_response", 4097), "at most 4096"),
    (lambda r: (setattr(r, "max_new_tokens", 0), setattr(r, "forwards_per_response", 2)), "set max_new_tokens"),
])
def test_bad_decode_ahead_requests_change_nothing(client, tiny_server, change, why):
    out = client.prefill(PROMPTS[0], token_choice=GREEDY)
    before = executor_snapshot(_executor(tiny_server))
    with grpc.insecure_channel(tiny_server.target) as channel:
        stub = pb_grpc.ModelExecutorStub(channel)
        request = pb.DecodeSessionRequest(step_id=9, max_new_tokens=10)
        item = request.items.add(token_id=out.chosen.token_id, kv_cache=convert.handle_to_proto(out.kv_cache))
        item.token_choice.CopyFrom(convert.token_choice_to_proto(GREEDY))
        change(request)
        (reply,) = list(stub.DecodeSession(iter([request]), timeout=30))
    assert reply.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and why in reply.error.message
    assert executor_snapshot(_executor(tiny_server)) == before
    client.release_cache(out.kv_cache)


def test_a_stop_message_with_anything_else_is_refused(tiny_server):
    with grpc.insecure_channel(tiny_server.target) as channel:
        stub = pb_grpc.ModelExecutorStub(channel)
        for extra in ({"max_new_tokens": 4}, {"forwards_per_response": 4}):
            (reply,) = list(stub.DecodeSession(iter([pb.DecodeSessionRequest(step_id=3, stop=True, **extra)]),
                                               timeout=30))
            assert reply.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "stop only" in reply.error.message


def test_the_server_advertises_its_bound(client):
    assert client.capabilities().max_decode_ahead == 4096


def test_generate_decodes_ahead_by_default_with_the_step_by_step_tokens(client):
    """``generate_ids`` on one server's client decodes ahead (one session step, no
    Decode call per token) and yields what one Decode per token yields; a caller that
    stops reading early stops the run and the sequence is released."""
    from ferrum_rpc.client.generate import decodes_ahead, generate_ids
    from ferrum_rpc.client.sampling import SamplingParams

    params = SamplingParams(temperature=0.8, top_k=30, seed=5)
    assert decodes_ahead(client, 40, None)
    stepped = list(generate_ids(client, PROMPTS[0], 40, params, ahead=False))
    assert list(generate_ids(client, PROMPTS[0], 40, params)) == stepped
    stops = {stepped[12]}
    assert list(generate_ids(client, PROMPTS[0], 40, params, stop_ids=stops)) == \
        stepped[:stepped.index(stepped[12]) + 1]
    tokens = generate_ids(client, PROMPTS[0], 200, params)
    assert [next(tokens) for _ in range(3)] == stepped[:3]
    tokens.close()  # stops reading after 3: the run is stopped, the KV released
    assert client.status().active_sequences == 0


def test_the_asyncio_session_decodes_ahead_and_stops(tiny_server, client):
    import asyncio

    from ferrum_rpc.client import AsyncExecutorClient

    want = _single_steps(client, PROMPTS[1], SEEDED, 30)

    async def main():
        async with AsyncExecutorClient(tiny_server.target, timeout=60) as ac:
            out = await ac.prefill(PROMPTS[1], token_choice=SEEDED)
            async with ac.decode_session() as session:
                run = await session.decode_ahead([DecodeInput(out.chosen.token_id, out.kv_cache, SEEDED)], 30)
                whole = [c.token_id async for _, c in run]
                (result,) = run.results
                run = await session.decode_ahead([DecodeInput(whole[-1], result.kv_cache, SEEDED)], 100)
                more = []
                async for _, chosen in run:
                    more.append(chosen.token_id)
                    if len(more) == 2:
                        await run.stop()
                (after,) = run.results
            await ac.release_cache(after.kv_cache)
            return whole, result, more, after

    whole, result, more, after = asyncio.run(main())
    assert whole == want[1:] and result.finish_reason == "length"
    assert after.finish_reason == "stopped" and after.kv_cache.sequence_length == len(PROMPTS[1]) + 30 + len(more)


def test_a_second_run_under_a_running_step_id_is_refused(client):
    outs = [client.prefill(p, token_choice=GREEDY) for p in PROMPTS[:2]]
    with client.decode_session() as session:
        first = session.decode_ahead([DecodeInput(outs[0].chosen.token_id, outs[0].kv_cache, GREEDY)], 200)
        session._next_step -= 1  # the next request reuses the running step's id
        second = session.decode_ahead([DecodeInput(outs[1].chosen.token_id, outs[1].kv_cache, GREEDY)], 5)
        assert first.step_id == second.step_id
        first.stop()
        error = None
        while not first.finished:
            reply = next(session._responses)
            if reply.HasField("error"):
                error = reply.error
            else:
                first._take(reply)  # its tokens
        while error is None:
            reply = next(session._responses)
            error = reply.error if reply.HasField("error") else None
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "still running" in error.message
    assert first.results[0].finish_reason == "stopped"
    for out in outs:
        client.release_cache(out.kv_cache)


def test_a_full_pool_mid_run_answers_its_error_and_leaves_the_sequence_as_it_was(tiny_llama_dir):
    """A 64-token pool: a run of 200 fills it after a few dozen tokens. The step answers
    KV_CAPACITY_EXHAUSTED, the sequence is back at the length the run found it at, every
    block the run took is free again, and the session serves the next step."""
    from tests.conftest import running_server

    with running_server(tiny_llama_dir, kv_tokens=64, block_size=4) as server, \
            ExecutorClient(server.target, timeout=60) as c:
        ex = _executor(server)
        out = c.prefill(PROMPTS[0], token_choice=GREEDY)
        before = executor_snapshot(ex)
        with c.decode_session() as session:
            run = session.decode_ahead([DecodeInput(out.chosen.token_id, out.kv_cache, GREEDY)], 200)
            received = 0
            with pytest.raises(ExecutorError) as caught:
                for _ in run:
                    received += 1
            assert caught.value.reason is Reason.KV_CAPACITY_EXHAUSTED and received > 0
            wait_for(lambda: executor_snapshot(ex)["free"], 10,  # the undo runs on the worker
                     f"the failed run's blocks to be given back ({before['free']} free)",
                     until=lambda free: free == before["free"])
            assert ex.kv.snapshot().sequences[out.kv_cache.cache_id].length == len(PROMPTS[0])
            (step,) = session.step([DecodeInput(out.chosen.token_id, out.kv_cache, GREEDY)])
            assert step.kv_cache.sequence_length == len(PROMPTS[0]) + 1
        c.release_cache(step.kv_cache)


# -- a caller that never reads at the socket level ---------------------------------------
def _frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + payload


def _literal(name: bytes, value: bytes) -> bytes:
    """An HPACK literal header field without indexing, new name, no Huffman (both < 127 bytes)."""
    return b"\x00" + bytes([len(name)]) + name + bytes([len(value)]) + value


def raw_decode_session(target: str, request: pb.DecodeSessionRequest, window: int, token: str | None = None):
    """A DecodeSession call on a bare TCP socket: the HTTP/2 preface, SETTINGS announcing
    ``window`` as the stream receive window (and an ACK sent ahead for the server's own
    SETTINGS, which this peer never reads), HEADERS, and one request message; the request
    stream stays open.  The caller then never recv()s: the server learns nothing but
    what HTTP/2 flow control tells it."""
    import socket

    host, port = target.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)))
    headers = b"".join([_literal(b":method", b"POST"), _literal(b":scheme", b"http"),
                        _literal(b":path", b"/ferrum.executor.v1.ModelExecutor/DecodeSession"),
                        _literal(b":authority", target.encode()), _literal(b"content-type", b"application/grpc"),
                        _literal(b"te", b"trailers")]
                       + ([_literal(b"authorization", f"Bearer {token}".encode())] if token else []))
    body = request.SerializeToString()
    sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
                 + _frame(0x4, 0, 0, (4).to_bytes(2, "big") + window.to_bytes(4, "big"))  # SETTINGS
                 + _frame(0x4, 0x1, 0, b"")  # SETTINGS ACK
                 + _frame(0x1, 0x4, 1, headers)  # HEADERS, END_HEADERS
                 + _frame(0x0, 0, 1, b"\x00" + len(body).to_bytes(4, "big") + body))  # DATA
    return sock


def test_a_caller_that_never_reads_the_socket_pauses_the_run_within_its_window(tiny_server, client):
    """A raw HTTP/2 peer with a 1 KiB receive window sends a decode-ahead step of 240
    tokens (20 logprobs each: responses of 80+ bytes) and never reads.  gRPC takes a
    response only into the caller's window, the session takes the run's next forward only
    once the last response's write completed, and the run queues at most QUEUED_FORWARDS
    forwards: so it pauses after at most window / (smallest response) + 1 (being written)
    + QUEUED_FORWARDS forwards.  Paused, it runs
    no forwards (GetStatus from another channel) and its sequence's KV stops growing,
    while another caller's decodes are served; closing the socket undoes the run."""
    window, choice = 1024, TokenChoice(temperature=0.0, top_logprobs=20)
    ex = _executor(tiny_server)
    out = client.prefill(PROMPTS[1], token_choice=choice)
    other = client.prefill(PROMPTS[0], token_choice=GREEDY)
    request = pb.DecodeSessionRequest(step_id=1, max_new_tokens=240)
    item = request.items.add(token_id=out.chosen.token_id, kv_cache=convert.handle_to_proto(out.kv_cache))
    item.token_choice.CopyFrom(convert.token_choice_to_proto(choice))
    # no response of this run can be smaller than this one (gRPC's 5-byte prefix included)
    smallest = 5 + len(pb.DecodeSessionResponse(step_id=1, chosen=pb.ChosenToken(
        token_id=1, top_logprobs=[pb.TokenLogprob(token_id=1)] * 20)).SerializeToString())
    bound = window // smallest + 1 + QUEUED_FORWARDS

    def length():
        return ex.kv.snapshot().sequences[out.kv_cache.cache_id].length

    sock = raw_decode_session(tiny_server.target, request, window)
    try:
        paused = _paused_for_good(length, client)
        status = client.status()
        forwards = status.forwards
        assert (status.ahead_sequences, status.ahead_runs_paused) == (1, 1) and status.session_bytes_unsent > 0
        assert len(PROMPTS[1]) < paused <= len(PROMPTS[1]) + bound, \
            f"the unread run decoded {paused - len(PROMPTS[1])} tokens, past its bound of {bound}"
        step = client.decode(other.chosen.token_id, other.kv_cache, token_choice=GREEDY)  # another caller
        assert step.kv_cache.sequence_length == len(PROMPTS[0]) + 1
        # GetStatus runs on the worker after that decode: a paused run that went on would show here
        assert client.status().forwards == forwards + 1  # that decode's forward only
        assert length() == paused
    finally:
        sock.close()
    wait_for(length, 10, "the abandoned run to be undone", until=lambda n: n == len(PROMPTS[1]))
    status = client.status()
    assert (status.ahead_sequences, status.ahead_runs_paused, status.session_bytes_unsent) == (0, 0, 0)
    client.release_cache(step.kv_cache)
    client.release_cache(out.kv_cache)
