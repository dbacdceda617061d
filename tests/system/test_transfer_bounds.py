"""What transfers may hold, and for how long, through real server processes on loopback.

An import stream buffers its sequence's KV until its trailer: that buffer counts
against the tenant's KV quota and the server's in-flight transfer budget (a stream
past either is refused RESOURCE_EXHAUSTED and holds nothing), GetStatus shows it, a
stream that sends nothing past the idle limit is ended and freed, and a drain does
not wait for one.  A push has keepalive and a deadline of its own, closes its channel
when it ends, and answers one code and message whatever it met at an unreachable
target.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import threading
import time

import grpc
import pytest

from ferrum_rpc import sequence_file
from ferrum_rpc.client import ExecutorClient, LogitsPolicy
from ferrum_rpc.errors import (
    Draining,
    ExecutorError,
    TenantQuotaExceeded,
    TransferBudgetExhausted,
    TransferStalled,
    from_rpc_error,
)
from ferrum_rpc.harness import ServerProcess, all_serving
from ferrum_rpc.v1 import executor_pb2_grpc as pb_grpc
from tests.waiting import wait_for_async

TOKENS = {"alice": "alice-token-0123456789", "bob": "bob-token-0123456789ab"}
FLAGS = ("--block-size", "4", "--no-warmup", "--threads", "1", "--kv-tokens", "1024")
PER_TOKEN = 2 * 2 * 2 * 16 * 4  # K and V, 2 layers, 2 KV heads, head_dim 16, float32 (conftest.TINY)
IDLE_S = 2.0  # the receiver's --import-idle-timeout
BUDGET = int(0.15 * (1 << 20))  # the receiver's --transfer-budget-mb 0.15: 157,286 bytes
QUOTA = 256  # the receiver's --tenant-kv-tokens: 131,072 bytes of KV
PUSH_TIMEOUT_S = 3.0  # the pusher's --push-timeout


@pytest.fixture(scope="module")
def tokens_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("transfer-bounds") / "tokens"
    path.write_text("".join(f"{tenant} {token}\n" for tenant, token in TOKENS.items()))
    return str(path)


@pytest.fixture(scope="module")
def servers(tiny_llama_dir, tokens_file):
    """P pushes (and exports what the tests import), R receives imports under tight
    bounds (two tenants), Z is a receiver the push test freezes."""
    p = ServerProcess(f"tiny={tiny_llama_dir}", *FLAGS, "--push-timeout", str(PUSH_TIMEOUT_S))
    r = ServerProcess(f"tiny={tiny_llama_dir}", *FLAGS, "--auth-tokens", tokens_file, "--import-idle-timeout",
                      str(IDLE_S), "--transfer-budget-mb", "0.15", "--tenant-kv-tokens", str(QUOTA),
                      "--metrics-port", "0")
    z = ServerProcess(f"tiny={tiny_llama_dir}", *FLAGS)
    with all_serving(p, r, z) as (p, r, z):
        yield {"p": p, "r": r, "z": z}


def prompt(n: int, seed: int = 0) -> list[int]:
    return [(37 * i + 11 + 101 * seed) % 320 for i in range(n)]


@pytest.fixture(scope="module")
def exports(servers):
    """Exports from P by length (tokens), one token of KV per message."""
    out = {}
    with ExecutorClient(servers["p"].target, timeout=30) as p:
        for n in (200, 100, 20):
            handle = p.prefill(prompt(n, seed=n), logits=LogitsPolicy.argmax()).kv_cache
            out[n] = list(sequence_file.messages(p.export_sequence(handle, None, PER_TOKEN)))
            p.release_cache(handle)
    return out


def auth(tenant: str):
    return (("authorization", f"Bearer {TOKENS[tenant]}"),)


def transfers(server: ServerProcess) -> tuple[int, int]:
    """(imports in flight, KV bytes they buffer) as GetStatus tells them."""
    with ExecutorClient(server.target, timeout=30, token=TOKENS["alice"]) as c:
        s = c.status()
    return s.imports_in_flight, s.transfer_bytes_in_flight


def gauges(server: ServerProcess) -> dict[str, float]:
    """The transfer gauges of the server's Prometheus endpoint (its port from its log)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    port = server.wait_for(r"metrics on http://[^:]+:(\d+)/metrics", timeout=5).group(1)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    names = ("ferrum_imports_in_flight", "ferrum_transfer_bytes_in_flight", "ferrum_transfer_budget_bytes")
    return {f.name: f.samples[0].value for f in text_string_to_metric_families(text) if f.name in names}


async def until_transfers(server: ServerProcess, want: tuple[int, int], timeout: float = 10.0) -> None:
    await wait_for_async(lambda: asyncio.to_thread(transfers, server), timeout,
                         f"(imports, bytes) in flight of {want}", until=lambda got: got == want)


def stalled(stub, messages, tenant: str, gap_s: float = 0.0):
    """An ImportSequence call that sends ``messages`` (``gap_s`` apart) and then neither
    its trailer nor its end: it waits until the call is cancelled."""
    async def send():
        for m in messages:
            yield m
            if gap_s:
                await asyncio.sleep(gap_s)  # workload: a slow sender
        await asyncio.Event().wait()

    return stub.ImportSequence(send(), metadata=auth(tenant))


async def failure(call) -> ExecutorError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await asyncio.wait_for(call, 20)
    return from_rpc_error(info.value)


def refused(target: str, messages, tenant: str) -> ExecutorError:
    """An ImportSequence the server refuses while the caller is still sending: its
    status as the server gave it.  Through the sync API: grpc.aio can report a write
    that fails because the server already ended the call as INTERNAL "Internal error
    from Core", overwriting the server's status (grpc/grpc#36066), a race this check
    lost now and then.  The stream stays open after its messages until the call has
    ended."""
    ended = threading.Event()

    def send():
        yield from messages
        ended.wait(30)

    with grpc.insecure_channel(target) as channel:
        try:
            with pytest.raises(grpc.RpcError) as info:
                pb_grpc.ModelExecutorStub(channel).ImportSequence(send(), metadata=auth(tenant), timeout=20)
        finally:
            ended.set()
    return from_rpc_error(info.value)


# -- imports: bounded in bytes and in time ---------------------------------------------------------


def test_a_stalled_import_shows_in_status_and_is_ended_after_the_idle_limit(servers, exports):
    """Header and every KV chunk, then nothing: GetStatus and the metrics show its bytes
    while it waits; past --import-idle-timeout it ends DEADLINE_EXCEEDED/TRANSFER_STALLED and GetStatus
    shows nothing held; the same stream, whole, imports afterwards."""
    r = servers["r"]
    messages = exports[200]

    async def run():
        async with grpc.aio.insecure_channel(r.target) as channel:
            call = stalled(pb_grpc.ModelExecutorStub(channel), messages[:-1], "alice")
            start = time.monotonic()
            await until_transfers(r, (1, 200 * PER_TOKEN))
            held = await asyncio.to_thread(gauges, r)
            err = await failure(call)
            return err, time.monotonic() - start, held

    err, took, held = asyncio.run(run())
    assert held == {"ferrum_imports_in_flight": 1, "ferrum_transfer_bytes_in_flight": 200 * PER_TOKEN,
                    "ferrum_transfer_budget_bytes": BUDGET}
    assert type(err) is TransferStalled and err.code is grpc.StatusCode.DEADLINE_EXCEEDED, err
    assert "--import-idle-timeout" in err.message
    assert IDLE_S <= took < IDLE_S + 8
    assert transfers(r) == (0, 0)
    assert gauges(r)["ferrum_transfer_bytes_in_flight"] == 0
    with ExecutorClient(r.target, timeout=30, token=TOKENS["alice"]) as c:
        before = c.status().active_sequences
        handle = c.import_sequence(b"".join(sequence_file.frame(m) for m in messages))
        assert c.status().active_sequences == before + 1
        c.release_cache(handle)


def test_imports_past_the_tenant_quota_or_the_budget_are_refused_and_hold_nothing(servers, exports):
    """Streams that keep sending (one KV chunk every 0.5 s, within the idle limit) hold
    their buffers: alice's second would pass her quota in bytes (TENANT_QUOTA_EXCEEDED),
    bob's first fits, his second would pass the server's budget
    (TRANSFER_BUDGET_EXHAUSTED); refusals hold nothing, and once the streams end the
    bytes are free again."""
    r = servers["r"]

    async def run():
        async with grpc.aio.insecure_channel(r.target) as channel:
            stub = pb_grpc.ModelExecutorStub(channel)
            first = stalled(stub, exports[200], "alice", gap_s=0.5)  # 102,400 bytes
            await until_transfers(r, (1, 200 * PER_TOKEN))
            quota = await asyncio.to_thread(refused, r.target, exports[100], "alice")  # 153,600 > 131,072 of quota
            await until_transfers(r, (1, 200 * PER_TOKEN))
            second = stalled(stub, exports[100], "bob", gap_s=0.5)  # 153,600 in all, within 157,286
            await until_transfers(r, (2, 300 * PER_TOKEN))
            budget = await asyncio.to_thread(refused, r.target, exports[20], "bob")  # 163,840 > 157,286
            await until_transfers(r, (2, 300 * PER_TOKEN))
            first.cancel()
            second.cancel()
            await until_transfers(r, (0, 0))
            return quota, budget

    quota, budget = asyncio.run(run())
    assert type(quota) is TenantQuotaExceeded and quota.code is grpc.StatusCode.RESOURCE_EXHAUSTED, quota
    assert f"{100 * PER_TOKEN} bytes" in quota.message and f"quota of {QUOTA} KV tokens" in quota.message
    assert type(budget) is TransferBudgetExhausted and budget.code is grpc.StatusCode.RESOURCE_EXHAUSTED, budget
    assert f"budget of {BUDGET} bytes" in budget.message and "--transfer-budget-mb" in budget.message
    with ExecutorClient(r.target, timeout=30, token=TOKENS["bob"]) as c:
        assert c.status().transfer_budget_bytes == BUDGET
        handle = c.import_sequence(b"".join(sequence_file.frame(m) for m in exports[20]))
        c.release_cache(handle)


def test_a_stalled_import_does_not_hold_a_drain(tiny_llama_dir, exports):
    """SIGTERM while an import waits for its trailer (--grace 20, no export grace): the
    import ends UNAVAILABLE/DRAINING at once and the server exits 0 well inside the grace."""
    d = ServerProcess(f"tiny={tiny_llama_dir}", *FLAGS, "--grace", "20")
    try:
        d.wait_serving()

        async def run():
            async with grpc.aio.insecure_channel(d.target) as channel:
                call = stalled(pb_grpc.ModelExecutorStub(channel), exports[200][:-1], "alice")
                await until_transfers(d, (1, 200 * PER_TOKEN))
                start = time.monotonic()
                d.proc.send_signal(signal.SIGTERM)
                err = await failure(call)
                return err, time.monotonic() - start

        err, took = asyncio.run(run())
        assert type(err) is Draining, err
        assert took < 5, f"the import ended {took:.1f} s after SIGTERM"
        assert d.proc.wait(10) == 0
    finally:
        d.kill()


# -- pushes: they end, and say nothing about ports ------------------------------------------------------


@contextlib.contextmanager
def listener():
    """A plain TCP server on loopback that is no gRPC server: it answers every
    connection with an HTTP/1.1 error and closes it; yields (port, accept times)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    accepts: list[float] = []

    def serve():
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            accepts.append(time.monotonic())
            with conn:
                try:
                    conn.settimeout(0.5)
                    conn.recv(1024)
                    conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
                except OSError:
                    pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield sock.getsockname()[1], accepts
    finally:
        sock.close()  # unblocks accept
        thread.join(5)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_push_answers_the_same_for_a_closed_port_and_a_non_grpc_listener_and_stops_connecting(servers):
    with ExecutorClient(servers["p"].target, timeout=30) as p, listener() as (port, accepts):
        handle = p.prefill(prompt(6, seed=1), logits=LogitsPolicy.argmax()).kv_cache
        errors = []
        for target in (f"127.0.0.1:{closed_port()}", f"127.0.0.1:{port}"):
            with pytest.raises(ExecutorError) as info:
                p.push_sequence(handle, target, "some-ticket", move=True)
            errors.append(info.value)
        returned = time.monotonic()
        assert accepts, "the push never reached the listener"
        # a channel the push left open would connect again within gRPC's 1 s reconnect backoff
        time.sleep(2.0)  # unobservable: nothing shows a closed channel but no connection after it
        late = [t for t in accepts if t > returned]
        assert late == [], f"{len(late)} connection(s) to the listener after the push returned"
        (closed, listening) = errors
        assert (closed.code, closed.reason, closed.message) == (listening.code, listening.reason, listening.message)
        assert closed.code is grpc.StatusCode.ABORTED
        assert str(port) not in listening.message
        assert p.export_sequence(handle)  # a failed move keeps the sequence
        p.release_cache(handle)
    servers["p"].wait_for(rf"push of \w+ to '127.0.0.1:{port}'", timeout=5)  # the cause is in the log


def test_a_push_to_a_frozen_receiver_without_a_caller_deadline_ends_at_the_push_timeout(servers):
    """The receiver is SIGSTOPped and the caller sets no deadline: the push ends ABORTED
    within --push-timeout (3 s here) and the sequence stays (a timer resumes the
    receiver after 25 s, so a push that would hang ends too)."""
    z = servers["z"]
    with ExecutorClient(servers["p"].target, timeout=None) as p, ExecutorClient(z.target, timeout=30) as rz:
        handle = p.prefill(prompt(6, seed=2), logits=LogitsPolicy.argmax()).kv_cache
        ticket = rz.create_import_ticket().ticket
        os.kill(z.pid, signal.SIGSTOP)
        resume = threading.Timer(25, os.kill, (z.pid, signal.SIGCONT))
        resume.start()
        try:
            start = time.monotonic()
            with pytest.raises(ExecutorError) as info:
                p.push_sequence(handle, z.target, ticket, move=True)
            took = time.monotonic() - start
        finally:
            resume.cancel()
            os.kill(z.pid, signal.SIGCONT)
        assert info.value.code is grpc.StatusCode.ABORTED, info.value
        assert took < PUSH_TIMEOUT_S + 3, f"the push ended after {took:.1f} s"
        assert p.export_sequence(handle)  # a failed move keeps the sequence
        p.release_cache(handle)


def test_an_asyncio_caller_refused_mid_stream_gets_the_refusal_every_time(servers, exports):
    """A grpc.aio caller streaming an export the server refuses early (two KV chunks out
    of order, with ~190 more to send) is told INVALID_ARGUMENT and why, not INTERNAL: the
    server reads out what the caller still sends before it answers, so no write meets
    an ended call (grpc.aio reports such a write as INTERNAL "Internal error from Core"
    in place of the status, grpc/grpc#36066).  Twenty times in a row, nothing held after."""
    r = servers["r"]
    messages = list(exports[200])
    messages[6], messages[7] = messages[7], messages[6]

    async def run():
        async with grpc.aio.insecure_channel(r.target) as channel:
            stub = pb_grpc.ModelExecutorStub(channel)
            errors = []
            for _ in range(20):
                async def send():
                    for m in messages:
                        yield m
                errors.append(await failure(stub.ImportSequence(send(), metadata=auth("alice"))))
            return errors

    errors = asyncio.run(run())
    assert [e.code for e in errors] == [grpc.StatusCode.INVALID_ARGUMENT] * 20, [repr(e) for e in errors]
    assert all("was due" in e.message for e in errors)
    assert transfers(r) == (0, 0)
