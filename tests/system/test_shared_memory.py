"""Shared-memory logits through a real server: rows equal the gRPC path bit for bit,
bounds and names are checked before anything runs (no state changes), regions
belong to one tenant, and a registration ends with its stream (close, a killed
client) or an explicit unregister."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from multiprocessing import shared_memory

import grpc
import numpy as np
import pytest

from ferrum_rpc.client import ExecutorClient
from ferrum_rpc.errors import ExecutorError, InvalidInput, SharedMemoryNotFound
from ferrum_rpc.types import DecodeInput, LogitsPolicy, SharedMemoryTarget
from ferrum_rpc.v1 import executor_pb2 as pb
from ferrum_rpc.v1 import executor_pb2_grpc as pb_grpc
from tests.conftest import running_server
from tests.waiting import wait_for

PROMPT = [5, 9, 13, 2, 77, 31, 8, 100, 4, 6]
VOCAB = 320  # the tiny model's


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    # No prefix cache: a twin prefill computes exactly what the first one did.
    with running_server(tiny_llama_dir, prefix_caching=False) as s:
        yield s


@pytest.fixture
def ex(server):
    with ExecutorClient(server.target, timeout=30) as c:
        yield c


def _state(ex: ExecutorClient) -> tuple[int, int]:
    st = ex.status()
    return st.active_sequences, st.kv_blocks_used


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_prefill_rows_equal_the_grpc_path_bit_for_bit(ex, dtype):
    with ex.shared_memory(1 << 20) as region:
        assert ex.capabilities().shared_memory
        wire = ex.prefill(PROMPT, logits=LogitsPolicy.full(dtype, all_positions=True))
        shm = ex.prefill(PROMPT, logits=LogitsPolicy.full(dtype, all_positions=True,
                                                          shared_memory=region.target(4096)))
        assert shm.logits.values.shape == wire.logits.values.shape == (len(PROMPT), VOCAB)
        np.testing.assert_array_equal(shm.logits.values, wire.logits.values)
        assert shm.kv_cache.sequence_length == len(PROMPT)
        if dtype == "float32":  # no copy: the array is the region's memory
            assert not shm.logits.values.flags.owndata
        for out in (wire, shm):
            ex.release_cache(out.kv_cache)


def test_batch_decode_and_session_rows_land_in_request_order(ex):
    heads = [ex.prefill(PROMPT[: 3 + i], logits=LogitsPolicy.argmax()) for i in range(4)]
    twins = [ex.prefill(PROMPT[: 3 + i], logits=LogitsPolicy.argmax()) for i in range(4)]
    tokens = [h.logits.argmax()[0] for h in heads]
    with ex.shared_memory(4 * VOCAB * 4 + 64) as region:
        wire = ex.batch_decode([DecodeInput(t, h.kv_cache) for t, h in zip(tokens, heads)], LogitsPolicy.full())
        shm = ex.batch_decode([DecodeInput(t, h.kv_cache) for t, h in zip(tokens, twins)],
                              LogitsPolicy.full(shared_memory=region.target(64)))
        for w, s in zip(wire, shm):
            np.testing.assert_array_equal(s.logits.values, w.logits.values)
        # the rows sit one after another from the offset, in request order
        raw = np.frombuffer(region.view(pb.SharedMemoryLocation(offset=64, byte_size=4 * VOCAB * 4)), np.float32)
        np.testing.assert_array_equal(raw.reshape(4, VOCAB), np.concatenate([w.logits.values for w in wire]))

        with ex.decode_session() as session:
            nxt = [w.logits.argmax()[0] for w in wire]
            a = session.step([DecodeInput(t, w.kv_cache) for t, w in zip(nxt, wire)], LogitsPolicy.full())
            b = session.step([DecodeInput(t, s.kv_cache) for t, s in zip(nxt, shm)],
                             LogitsPolicy.full(shared_memory=region.target()))
            for x, y in zip(a, b):
                np.testing.assert_array_equal(y.logits.values, x.logits.values)
    for out in a + b:
        ex.release_cache(out.kv_cache)


def test_rows_past_the_region_or_unaligned_change_nothing(ex):
    seq = ex.prefill(PROMPT, logits=LogitsPolicy.argmax())
    with ex.shared_memory(VOCAB * 4 * 3) as region:
        before = _state(ex)
        with pytest.raises(InvalidInput, match="pass the end"):
            ex.prefill(PROMPT, logits=LogitsPolicy.full(all_positions=True, shared_memory=region.target()))
        with pytest.raises(InvalidInput, match="pass the end"):
            ex.decode(1, seq.kv_cache, LogitsPolicy.full(shared_memory=region.target(VOCAB * 4 * 3 - 4)))
        with pytest.raises(InvalidInput, match="multiple of 4"):
            ex.decode(1, seq.kv_cache, LogitsPolicy.full(shared_memory=region.target(2)))
        with pytest.raises(InvalidInput, match="LOGITS_KIND_FULL"):
            ex.decode(1, seq.kv_cache, LogitsPolicy(LogitsPolicy.argmax().kind,
                                                   shared_memory=region.target()))
        assert _state(ex) == before
        # the sequence is untouched: its handle still works, at its old length
        out = ex.decode(1, seq.kv_cache, LogitsPolicy.full(shared_memory=region.target(VOCAB * 4)))
        assert out.kv_cache.sequence_length == len(PROMPT) + 1
    ex.release_cache(out.kv_cache)


def _register(stub, metadata=None, **fields):
    """A raw registration (as any gRPC caller would make it): its first reply and the open call."""
    call = stub.RegisterSharedMemory(pb.RegisterSharedMemoryRequest(**fields), timeout=30, metadata=metadata)
    try:
        return next(call), call
    except BaseException:
        call.cancel()
        raise


def test_registration_is_checked(server, ex):
    stub = pb_grpc.ModelExecutorStub(grpc.insecure_channel(server.target))
    obj = shared_memory.SharedMemory(create=True, size=4096)
    empty = shared_memory.SharedMemory(create=True, size=1)
    os.ftruncate(empty._fd, 0)  # noqa: SLF001 - an empty object, as a hostile caller makes it
    try:
        for fields, why in [
            (dict(name="r", key=obj.name, byte_size=16), "key and offset must be empty"),  # a caller-made object
            (dict(name="r", key=empty.name, byte_size=16), "key and offset must be empty"),
            (dict(name="r", key="../etc/passwd", byte_size=16), "key and offset must be empty"),
            (dict(name="r", offset=16, byte_size=16), "key and offset must be empty"),
            (dict(name="r", byte_size=0), "byte_size must be > 0"),
            (dict(name="", byte_size=16), "name must be"),
            (dict(name="a\x00b", byte_size=16), "name must be"),
        ]:
            for _ in range(3):
                with pytest.raises(grpc.RpcError) as info:
                    _register(stub, **fields)
                assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
                assert why in info.value.details()
        with pytest.raises(grpc.RpcError) as info:  # past the tenant's bytes
            _register(stub, name="huge", byte_size=5 << 30)
        assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        with ex.shared_memory(64, name="taken"):
            with pytest.raises(InvalidInput, match="registered already"):
                ex.shared_memory(64, name="taken")
        assert len(server.app.servicer.shm) == 0  # nothing left behind by any refusal
        assert obj.buf[:16] == bytes(16)  # the caller's own object was never opened for writing
    finally:
        for o in (obj, empty):
            o.close()
            o.unlink()


def test_the_server_creates_the_object_and_writes_only_there(server, ex):
    seq = ex.prefill(PROMPT, logits=LogitsPolicy.argmax())
    with ex.shared_memory(VOCAB * 4) as region:
        assert region.key.startswith("/ferrum-logits-")
        # the client unlinked the name once it had the object open: nobody else can open it now
        with pytest.raises(FileNotFoundError):
            shared_memory.SharedMemory(name=region.key)
        out = ex.decode(1, seq.kv_cache, LogitsPolicy.full(shared_memory=region.target()))
        assert out.logits.values.shape == (1, VOCAB) and np.isfinite(out.logits.values).all()
    ex.release_cache(out.kv_cache)


def test_close_and_unregister_end_the_registration(server, ex):
    seq = ex.prefill(PROMPT, logits=LogitsPolicy.argmax())
    region = ex.shared_memory(VOCAB * 4, name="short-lived")
    target = region.target()
    region.close()
    wait_for(lambda: len(server.app.servicer.shm), 10, "no registered region", until=lambda n: n == 0)
    with pytest.raises(SharedMemoryNotFound):
        ex.decode(1, seq.kv_cache, LogitsPolicy.full(shared_memory=target))

    region = ex.shared_memory(VOCAB * 4, name="unregistered")
    stub = pb_grpc.ModelExecutorStub(grpc.insecure_channel(server.target))
    assert stub.UnregisterSharedMemory(pb.UnregisterSharedMemoryRequest(name="unregistered")).unregistered == 1
    with pytest.raises(SharedMemoryNotFound):
        ex.decode(1, seq.kv_cache, LogitsPolicy.full(shared_memory=region.target()))
    region.close()
    assert ex.decode(1, seq.kv_cache).kv_cache.sequence_length == len(PROMPT) + 1  # nothing changed before
    ex.release_cache(seq.kv_cache)


def test_a_killed_client_loses_its_region(server, ex):
    script = textwrap.dedent(f"""
        import sys, time
        from ferrum_rpc.client import ExecutorClient
        region = ExecutorClient({server.target!r}).shared_memory(4096, name="doomed")
        print("registered", flush=True)
        time.sleep(60)  # workload: the client lives, holding its region, until the test kills it
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "registered"
        assert len(server.app.servicer.shm) == 1
        proc.kill()
        proc.wait(10)
        wait_for(lambda: len(server.app.servicer.shm), 10, "no registered region", until=lambda n: n == 0)
    finally:
        proc.kill()


def test_regions_belong_to_their_tenant(tiny_llama_dir, tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("alice alice-token-aaaaaaaaaaaaaaaaaaaa\nbob bob-token-bbbbbbbbbbbbbbbbbbbbbbb\n")
    with running_server(tiny_llama_dir, server_kwargs={"auth_tokens": str(tokens)}) as server, \
            ExecutorClient(server.target, timeout=10, token="alice-token-aaaaaaaaaaaaaaaaaaaa") as alice, \
            ExecutorClient(server.target, timeout=10, token="bob-token-bbbbbbbbbbbbbbbbbbbbbbb") as bob:
        with alice.shared_memory(VOCAB * 4, name="mine") as region:
            seq = bob.prefill(PROMPT, logits=LogitsPolicy.argmax())
            before = bob.status().active_sequences
            with pytest.raises(SharedMemoryNotFound):
                bob.decode(1, seq.kv_cache, LogitsPolicy.full(shared_memory=SharedMemoryTarget("mine")))
            assert bob.status().active_sequences == before
            # bob may use the same name for his own region; alice's stays hers
            with bob.shared_memory(VOCAB * 4, name="mine"):
                out = bob.decode(1, seq.kv_cache, LogitsPolicy.full(shared_memory=SharedMemoryTarget("mine")))
                assert out.logits.values.shape == (1, VOCAB)
            # unregister-all is per tenant too
            stub = pb_grpc.ModelExecutorStub(grpc.insecure_channel(server.target))
            md = [("authorization", "Bearer bob-token-bbbbbbbbbbbbbbbbbbbbbbb")]
            assert stub.UnregisterSharedMemory(pb.UnregisterSharedMemoryRequest(), metadata=md).unregistered == 0
            a = alice.prefill(PROMPT, logits=LogitsPolicy.full(shared_memory=region.target()))
            assert a.logits.values.shape == (1, VOCAB)


def test_servers_off_loopback_do_not_serve_it_unless_asked(tiny_llama_dir):
    with running_server(tiny_llama_dir, server_kwargs={"shared_memory": "off"}) as server, \
            ExecutorClient(server.target, timeout=10) as ex:
        assert not ex.capabilities().shared_memory
        with pytest.raises(ExecutorError, match="shared memory is off") as info:
            ex.shared_memory(64)
        assert info.value.code is grpc.StatusCode.UNIMPLEMENTED


def test_the_asyncio_client_registers_and_reads_regions_too(server, ex):
    import asyncio

    from ferrum_rpc.client import AsyncExecutorClient

    async def run():
        async with AsyncExecutorClient(server.target, timeout=30) as aex:
            async with await aex.shared_memory(len(PROMPT) * VOCAB * 4) as region:
                out = await aex.prefill(PROMPT, logits=LogitsPolicy.full(all_positions=True,
                                                                         shared_memory=region.target()))
                rows = np.array(out.logits.values)
                await aex.release_cache(out.kv_cache)
            with pytest.raises(SharedMemoryNotFound):  # aclose unregistered it before returning
                await aex.prefill(PROMPT, logits=LogitsPolicy.full(shared_memory=region.target()))
            return rows

    rows = asyncio.run(run())
    wire = ex.prefill(PROMPT, logits=LogitsPolicy.full(all_positions=True))
    np.testing.assert_array_equal(rows, wire.logits.values)
    ex.release_cache(wire.kv_cache)
