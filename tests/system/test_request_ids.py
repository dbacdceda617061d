"""Caller-chosen sequence names (``request_id``), through real gRPC: a caller whose
reply was lost retries with the name it chose and gets the sequence its first attempt
made, or releases it by that name; a release by name aborts a Prefill still running, a
name released before its call ran makes that call fail CANCELLED, names are unique per
tenant and private to it (another prompt under a live name is REQUEST_ID_TAKEN), their
limit is 128 UTF-8 bytes, and the Python clients release by name, when a call ends with
its outcome unknown, only the names they generated."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest

from ferrum_rpc.client import AsyncExecutorClient, ExecutorClient, InvalidInput, LogitsPolicy
from ferrum_rpc.errors import ExecutorError, Reason, RequestIdTaken, from_rpc_error
from ferrum_rpc.v1 import executor_pb2 as pb
from tests.conftest import TENANT_TOKENS, tenants_server
from tests.waiting import wait_for, wait_for_async

ALICE, BOB = TENANT_TOKENS["alice"], TENANT_TOKENS["bob"]
ARGMAX = LogitsPolicy.argmax()
PROMPT = [1, 17, 42, 99, 5, 230, 17, 8]


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    with tenants_server(tiny_llama_dir, tmp_path_factory, prefill_chunk=8) as srv:
        yield srv


def _worker(server):
    return server.app.servicer.gate.workers["tiny"]


def _live(server, tenant: str) -> int:
    return _worker(server).executor.kv.count(tenant)


def test_a_named_sequence_is_released_by_its_name_and_names_are_per_tenant(server, alice, bob):
    out = alice.prefill(PROMPT, logits=ARGMAX, request_id="job-1")
    with pytest.raises(RequestIdTaken, match="request_id 'job-1' already names a live sequence"):
        alice.prefill(PROMPT[:5], logits=ARGMAX, request_id="job-1")
    mine = bob.prefill(PROMPT, logits=ARGMAX, request_id="job-1")  # bob's names are his own
    assert bob.release_cache(request_id="job-2") == 0  # nothing of bob's has that name
    assert alice.release_cache(request_id="job-1") > 0
    with pytest.raises(ExecutorError) as caught:
        alice.decode(3, out.kv_cache, logits=ARGMAX)
    assert caught.value.code is grpc.StatusCode.NOT_FOUND
    assert bob.decode(3, mine.kv_cache, logits=ARGMAX).kv_cache.sequence_length == len(PROMPT) + 1
    again = alice.prefill(PROMPT, logits=ARGMAX, request_id="job-1")  # free again once released
    alice.release_cache(again.kv_cache)
    bob.release_cache(request_id="job-1")
    with pytest.raises(InvalidInput, match="leave it empty when continuing"):
        alice.prefill([5], again.kv_cache, logits=ARGMAX, request_id="x")


def test_a_name_released_before_its_call_ran_makes_the_call_fail_cancelled(server, alice):
    before = _live(server, "alice")
    assert alice.release_cache(request_id="late-1") == 0
    with pytest.raises(ExecutorError) as caught:
        alice.prefill(PROMPT, logits=ARGMAX, request_id="late-1")
    assert caught.value.code is grpc.StatusCode.CANCELLED and "released by its caller" in str(caught.value)
    with pytest.raises(ExecutorError) as caught:
        _batch_named(alice, "late-1")  # a BatchPrefill item named so: the whole call, nothing made
    assert caught.value.code is grpc.StatusCode.CANCELLED
    assert _live(server, "alice") == before


def _batch_named(client, name: str):
    request = pb.BatchPrefillRequest(items=[pb.PrefillItem(token_ids=PROMPT, request_id=name),
                                            pb.PrefillItem(token_ids=PROMPT[:4], request_id=name + "-other")])
    try:
        return list(client._stub.BatchPrefill(request, timeout=30))
    except grpc.RpcError as exc:
        raise from_rpc_error(exc) from None


def _hold_next_forward(ex) -> tuple[threading.Event, threading.Event]:
    """Makes the executor's next forward wait: ``entered`` is set once it started, and it
    goes on when ``go`` is set (or after 10 s); later forwards run as usual."""
    real, entered, go = ex.run, threading.Event(), threading.Event()

    def run(plans):
        ex.run = real
        entered.set()
        go.wait(10)
        return real(plans)

    ex.run = run
    return entered, go


def test_release_by_name_aborts_a_prefill_still_running(server, alice):
    """The prompt's first part is held in the forward until the release is queued behind
    it: the release aborts the prompt, which is undone and answers CANCELLED."""
    worker = _worker(server)
    entered, go = _hold_next_forward(worker.executor)
    before = _live(server, "alice")
    result: list = []
    caller = threading.Thread(target=lambda: result.append(_call(alice, PROMPT * 8, "long-1")))
    caller.start()
    assert entered.wait(10)
    releaser = threading.Thread(target=lambda: alice.release_cache(request_id="long-1"))
    releaser.start()
    wait_for(lambda: any(j is not None and j.fn == worker.release_named for j in list(worker.queue.jobs)), 10,
             "the release to be queued behind the held prompt")
    go.set()
    caller.join(10)
    releaser.join(10)
    assert isinstance(result[0], ExecutorError) and result[0].code is grpc.StatusCode.CANCELLED
    assert _live(server, "alice") == before


def _call(client, prompt, name):
    try:
        return client.prefill(prompt, logits=ARGMAX, request_id=name)
    except ExecutorError as exc:
        return exc


def test_the_clients_release_what_a_call_cancelled_mid_reply_created(server):
    """The asyncio client's Prefill is cancelled after the server answered (the reply
    may or may not be read): the client releases the sequence by its name."""
    async def main():
        async with AsyncExecutorClient(server.target, timeout=30, token=ALICE) as client:
            before = _live(server, "alice")
            for delay in (0.0, 0.002, 0.005, 0.01, 0.02, 0.05):
                task = asyncio.ensure_future(client.prefill(PROMPT * 4, logits=ARGMAX))
                await asyncio.sleep(delay)  # workload: cancels the call at points swept across its life
                task.cancel()
                try:
                    out = await task
                except asyncio.CancelledError:
                    pass
                else:
                    await client.release_cache(out.kv_cache)
            await asyncio.wait(list(client._releasing), timeout=10) if client._releasing else None
            await wait_for_async(lambda: _live(server, "alice"), 10, f"alice's live sequences back to {before}",
                                 until=lambda n: n == before)

    asyncio.run(main())


def test_the_sync_client_releases_what_a_timed_out_prefill_created(server, alice):
    """A server that stalls after committing the prompt: the caller times out, and its
    client releases the sequence by name (the server undoes it too; either suffices)."""
    worker = _worker(server)
    ex = worker.executor
    real = ex.run
    timed_out = threading.Event()

    def run(plans):
        ex.run = real
        out = real(plans)
        timed_out.wait(10)  # the stall lasts until the caller has given up
        return out

    before = _live(server, "alice")
    ex.run = run
    try:
        with ExecutorClient(server.target, timeout=0.3, token=ALICE) as hasty:
            with pytest.raises(ExecutorError) as caught:
                hasty.prefill(PROMPT, logits=ARGMAX)
    finally:
        timed_out.set()
    assert caught.value.code is grpc.StatusCode.DEADLINE_EXCEEDED
    wait_for(lambda: _live(server, "alice"), 10, f"alice's live sequences back to {before}",
             until=lambda n: n == before)
    worker.submit(lambda: None).result(timeout=10)  # the stalled prompt's job has ended, and made nothing
    assert _live(server, "alice") == before


# -- retries of a call whose reply was lost ---------------------------------------------------
def test_a_retry_after_a_timeout_makes_the_sequence_instead_of_being_refused(server, alice):
    """The caller's own name is never released by the client: a prefill that timed out
    before the server ran it leaves the name free, and the retry with it runs."""
    before = _live(server, "alice")
    with ExecutorClient(server.target, timeout=1e-9, token=ALICE) as hasty:
        with pytest.raises(ExecutorError) as caught:
            hasty.prefill(PROMPT, logits=ARGMAX, request_id="retry-1")
    assert caught.value.code is grpc.StatusCode.DEADLINE_EXCEEDED
    out = alice.prefill(PROMPT, logits=ARGMAX, request_id="retry-1")
    assert not out.existing and out.logits is not None and out.kv_cache.sequence_length == len(PROMPT)
    assert _live(server, "alice") == before + 1
    assert alice.release_cache(request_id="retry-1") > 0
    assert _live(server, "alice") == before


def test_a_retry_whose_first_attempt_made_the_sequence_gets_its_handle(server, alice):
    """The first attempt's reply is lost (made through the raw stub, its reply dropped):
    the retry with the same name and prompt is answered with that sequence; the raw
    status is ALREADY_EXISTS / REQUEST_ID_EXISTS carrying the handle, nothing changed."""
    before = _live(server, "alice")
    alice._stub.Prefill(pb.PrefillRequest(token_ids=PROMPT, request_id="lost-1"), timeout=30)
    again = alice.prefill(PROMPT, logits=ARGMAX, request_id="lost-1")
    assert again.existing and again.logits is None and again.kv_cache.sequence_length == len(PROMPT)
    assert _worker(server).executor.kv.names.named("alice", "lost-1").cache_id == again.kv_cache.cache_id
    with pytest.raises(grpc.RpcError) as raw:
        alice._stub.Prefill(pb.PrefillRequest(token_ids=PROMPT, request_id="lost-1"), timeout=30)
    err = from_rpc_error(raw.value)
    assert raw.value.code() is grpc.StatusCode.ALREADY_EXISTS and err.reason is Reason.REQUEST_ID_EXISTS
    assert err.handle == again.kv_cache
    assert _live(server, "alice") == before + 1
    step = alice.decode(int(PROMPT[-1]), again.kv_cache, logits=ARGMAX)  # the handle is current
    assert step.kv_cache.sequence_length == len(PROMPT) + 1
    with pytest.raises(RequestIdTaken, match="another prompt"):  # another adapter is another prompt too
        alice.prefill(PROMPT, logits=ARGMAX, request_id="lost-1", adapter="no-such-adapter")
    alice.release_cache(step.kv_cache)
    assert _live(server, "alice") == before


def test_a_retry_while_the_first_attempt_still_runs_waits_for_its_outcome(server, alice):
    """The first attempt's first part is held in the forward until the retry is queued
    behind it; the retry waits while the sequence is being made and then gets it."""
    worker = _worker(server)
    entered, go = _hold_next_forward(worker.executor)
    before = _live(server, "alice")
    first: list = []
    prompt = PROMPT * 3  # three parts of 8 tokens (prefill_chunk=8)
    caller = threading.Thread(target=lambda: first.append(
        alice._stub.Prefill(pb.PrefillRequest(token_ids=prompt, request_id="slow-1"), timeout=30)))
    caller.start()
    assert entered.wait(10)
    retried: list = []
    retry = threading.Thread(target=lambda: retried.append(_call(alice, prompt, "slow-1")))
    retry.start()
    wait_for(lambda: any(j is not None and j.prefill is not None and j.prefill.name == "slow-1"
                         for j in list(worker.queue.jobs)), 10, "the retry to be queued behind the held first attempt")
    go.set()
    caller.join(10)
    retry.join(10)
    assert not caller.is_alive() and not retry.is_alive()
    assert retried[0].existing and retried[0].kv_cache.cache_id == first[0].kv_cache.cache_id
    assert retried[0].kv_cache.sequence_length == len(prompt)
    assert _live(server, "alice") == before + 1
    alice.release_cache(request_id="slow-1")
    assert _live(server, "alice") == before


def test_request_ids_are_limited_to_128_utf8_bytes(server, alice):
    before = _live(server, "alice")
    fits = "é" * 64  # 64 characters, 128 bytes
    out = alice.prefill(PROMPT, logits=ARGMAX, request_id=fits)
    assert alice.release_cache(request_id=fits) > 0 and out.kv_cache.sequence_length == len(PROMPT)
    too_long = "é" * 65  # 65 characters, 130 bytes
    with pytest.raises(InvalidInput, match="request_id is 130 bytes long"):
        alice.prefill(PROMPT, logits=ARGMAX, request_id=too_long)
    with pytest.raises(InvalidInput, match="request_id is 130 bytes long"):
        alice.release_cache(request_id=too_long)
    assert _live(server, "alice") == before
