"""Shared memory against a hostile or unlucky caller, on real server processes
(issue 20, items 1-4): a shrunk object cannot kill the server, a caller cannot
make the server write into an object it did not get from the server, refused
registrations leak no descriptors, and a cancelled copy cannot outlive an
unregister."""

from __future__ import annotations

import os
import threading
import time

import _posixshmem
import grpc
import pytest

from ferrum_rpc.v1 import executor_pb2 as pb
from ferrum_rpc.v1 import executor_pb2_grpc as pb_grpc
from tests.system.test_replicas import Replica
from tests.waiting import wait_for

VOCAB = 8192  # rows of 32 KiB: a 200-position reply is built on the reply-builder thread
PROMPT = list(range(3, 203))
ALICE, BOB = "alice-token-aaaaaaaaaaaaaaaaaaaa", "bob-token-bbbbbbbbbbbbbbbbbbbbbbb"


@pytest.fixture(scope="module")
def replica(wide_vocab_dir, tmp_path_factory):
    tokens = tmp_path_factory.mktemp("tokens") / "tokens"
    tokens.write_text(f"alice {ALICE}\nbob {BOB}\n")
    r = Replica(wide_vocab_dir, "--auth-tokens", str(tokens))
    try:
        r.wait_serving()
        yield r
    finally:
        r.kill()


def _md(token: str):
    return [("authorization", f"Bearer {token}")]


@pytest.fixture
def stub(replica):
    with grpc.insecure_channel(replica.target) as channel:
        yield pb_grpc.ModelExecutorStub(channel)


def _register(stub, token, **fields):
    call = stub.RegisterSharedMemory(pb.RegisterSharedMemoryRequest(**fields), metadata=_md(token), timeout=60)
    return next(call), call


def _full(region: str, offset: int = 0, all_positions: bool = False) -> pb.LogitsPolicy:
    return pb.LogitsPolicy(kind=pb.LOGITS_KIND_FULL, all_positions=all_positions,
                           shared_memory=pb.SharedMemoryTarget(region=region, offset=offset))


def _prefill(stub, token, tokens=PROMPT[:8], **kw):
    return stub.Prefill(pb.PrefillRequest(token_ids=tokens, **kw), metadata=_md(token), timeout=60)


def _active(stub, token) -> int:
    return stub.GetStatus(pb.GetStatusRequest(), metadata=_md(token), timeout=30).active_sequences


def test_a_shrunk_object_is_refused_and_cannot_kill_the_server(replica, stub):
    first, call = _register(stub, ALICE, name="shrinkable", byte_size=VOCAB * 4 * 4)
    seq = _prefill(stub, ALICE).kv_cache
    fd = _posixshmem.shm_open(first.key, os.O_RDWR)  # the caller opened it as documented (before unlinking)
    try:
        os.ftruncate(fd, 0)
        with pytest.raises(grpc.RpcError) as info:
            stub.Decode(pb.DecodeRequest(kv_cache=seq, token_id=1, logits=_full("shrinkable")),
                        metadata=_md(ALICE), timeout=30)
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "shrunk" in info.value.details()
        # shrinking while rows are being written: the server writes with pwrite, never through a mapping
        stop = threading.Event()

        def flap():
            while not stop.is_set():
                os.ftruncate(fd, 0)
                os.ftruncate(fd, VOCAB * 4 * 4)

        flapper = threading.Thread(target=flap)
        flapper.start()
        outcomes = set()
        try:
            for _ in range(40):
                try:
                    out = stub.Decode(pb.DecodeRequest(kv_cache=seq, token_id=1, logits=_full("shrinkable")),
                                      metadata=_md(ALICE), timeout=30)
                    seq = out.kv_cache
                    outcomes.add("ok")
                except grpc.RpcError as exc:
                    assert exc.code() is grpc.StatusCode.INVALID_ARGUMENT, exc.details()
                    outcomes.add("refused")
        finally:
            stop.set()
            flapper.join()
        assert replica.alive(), "the server died"
        # the sequence is consistent with every answer the caller got
        out = stub.Decode(pb.DecodeRequest(kv_cache=seq, token_id=1), metadata=_md(ALICE), timeout=30)
        assert out.kv_cache.sequence_length == seq.sequence_length + 1
    finally:
        os.close(fd)
        call.cancel()


def test_a_tenant_cannot_point_the_server_at_anothers_object(replica, stub):
    bob_first, bob_call = _register(stub, BOB, name="bobs", byte_size=VOCAB * 4)
    fd = _posixshmem.shm_open(bob_first.key, os.O_RDWR)
    try:
        os.pwrite(fd, b"\xab" * (VOCAB * 4), 0)
        for key in (bob_first.key, bob_first.key.lstrip("/"), "sem.some-semaphore"):
            with pytest.raises(grpc.RpcError) as info:
                _register(stub, ALICE, name="stolen", key=key, byte_size=VOCAB * 4)
            assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        # alice's own region works, and her rows land in her object only
        alice_first, alice_call = _register(stub, ALICE, name="bobs", byte_size=VOCAB * 4)  # same name, her own
        assert alice_first.key != bob_first.key
        _prefill(stub, ALICE, logits=_full("bobs"))
        assert os.pread(fd, VOCAB * 4, 0) == b"\xab" * (VOCAB * 4)
        alice_call.cancel()
    finally:
        os.close(fd)
        bob_call.cancel()


def test_refused_registrations_leak_no_descriptors(replica, stub):
    def open_fds() -> int:
        return len(os.listdir(f"/proc/{replica.proc.pid}/fd"))

    empty = "/ferrum-test-empty-" + str(os.getpid())
    fd = _posixshmem.shm_open(empty, os.O_CREAT | os.O_RDWR, mode=0o600)
    try:
        for _ in range(20):  # warm: gRPC's own descriptors settle
            with pytest.raises(grpc.RpcError):
                _register(stub, ALICE, name="empty", key=empty, byte_size=16)
        before = open_fds()
        for _ in range(300):
            with pytest.raises(grpc.RpcError) as info:
                _register(stub, ALICE, name="empty", key=empty, byte_size=16)
            assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT  # never INTERNAL
        assert open_fds() <= before + 3
    finally:
        os.close(fd)
        _posixshmem.shm_unlink(empty)


def _fence(stub, token) -> None:
    """A call that queues behind every earlier one on the model worker and then on the
    reply-builder thread (its 1.3 MB reply is built there): once it returned, every earlier
    call's reply has been built and written wherever it was going to be."""
    out = stub.Prefill(pb.PrefillRequest(token_ids=PROMPT[:40], logits=pb.LogitsPolicy(
        kind=pb.LOGITS_KIND_FULL, all_positions=True)), metadata=_md(token), timeout=60)
    stub.ReleaseCache(pb.ReleaseCacheRequest(cache_id=out.kv_cache.cache_id), metadata=_md(token), timeout=30)


def test_no_write_lands_after_unregister_returns(replica, stub):
    size = len(PROMPT) * VOCAB * 4  # 6.5 MB: built and copied on the reply-builder thread
    for delay in (0.0, 0.01, 0.03, 0.06, 0.1):
        first, call = _register(stub, ALICE, name="raced", byte_size=size)
        fd = _posixshmem.shm_open(first.key, os.O_RDWR)
        try:
            active = _active(stub, ALICE)
            name = f"raced-{delay}"
            future = stub.Prefill.future(pb.PrefillRequest(token_ids=PROMPT, logits=_full("raced", all_positions=True),
                                                           request_id=name), metadata=_md(ALICE), timeout=60)
            time.sleep(delay)  # workload: cancels the call at points swept across its life
            future.cancel()
            reply = stub.UnregisterSharedMemory(pb.UnregisterSharedMemoryRequest(name="raced"), metadata=_md(ALICE),
                                                timeout=30)
            assert reply.unregistered == 1
            os.pwrite(fd, b"\x5a" * size, 0)
            _fence(stub, ALICE)  # the raced call's reply, if any, is built by now
            assert os.pread(fd, size, 0) == b"\x5a" * size, "the server wrote after Unregister returned"
            if future.cancelled():
                # The caller never got a handle.  The reply may have been handed to gRPC before
                # the cancel (then the sequence exists): what is guaranteed is that a release by
                # the caller's request_id leaves nothing, whichever side of the race it fell on.
                stub.ReleaseCache(pb.ReleaseCacheRequest(request_id=name), metadata=_md(ALICE), timeout=30)
                wait_for(lambda: _active(stub, ALICE), 10, f"alice's live sequences back to {active}",
                         until=lambda n: n == active)
            else:
                stub.ReleaseCache(pb.ReleaseCacheRequest(cache_id=future.result().kv_cache.cache_id),
                                  metadata=_md(ALICE), timeout=30)
        finally:
            os.close(fd)
            call.cancel()
    assert replica.alive()


def test_unregister_all_ends_every_registration(replica, stub):
    calls = [_register(stub, BOB, name=f"r{i}", byte_size=len(PROMPT) * VOCAB * 4)[1] for i in range(3)]
    future = stub.Prefill.future(pb.PrefillRequest(token_ids=PROMPT, logits=_full("r0", all_positions=True)),
                                 metadata=_md(BOB), timeout=60)
    time.sleep(0.02)  # workload: the Unregister races the prefill (either order must end all three)
    reply = stub.UnregisterSharedMemory(pb.UnregisterSharedMemoryRequest(), metadata=_md(BOB), timeout=30)
    assert reply.unregistered == 3
    for call in calls:  # each stream ends (the server answered the registration's end)
        assert list(call) == []
    try:
        stub.ReleaseCache(pb.ReleaseCacheRequest(cache_id=future.result().kv_cache.cache_id), metadata=_md(BOB),
                          timeout=30)
    except grpc.RpcError:
        pass
    for i in range(3):  # the names are free again
        _register(stub, BOB, name=f"r{i}", byte_size=64)[1].cancel()
