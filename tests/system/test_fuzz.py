"""Property-based fuzzing of every RPC through real gRPC (hypothesis).

Generated and mutated requests: forged handles (one field changed at a time),
extreme numbers, empty and oversized repeated fields, garbage bytes as the
serialized message, malformed DecodeSession streams.  Every call must be
answered with a status from the error table (never INTERNAL or UNKNOWN); a
call that fails must change no state (KV blocks and sequences as before); the
server must keep serving.

Bounded for CI (``FERRUM_FUZZ_EXAMPLES``, default 40 per property).  The soak
mode is the same file with a larger bound:

    FERRUM_FUZZ_EXAMPLES=2000 python -m pytest tests/system/test_fuzz.py -q -p no:cacheprovider
"""

from __future__ import annotations

import logging
import os

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ferrum_rpc.v1 import executor_pb2 as pb
from ferrum_rpc.v1 import executor_pb2_grpc as pb_grpc
from tests.conftest import TINY, running_server

log = logging.getLogger(__name__)
EXAMPLES = int(os.environ.get("FERRUM_FUZZ_EXAMPLES", "40"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=not os.environ.get("FERRUM_FUZZ_RANDOM"),
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
TABLE_CODES = {  # every status code the error table (and admission) can give
    grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNIMPLEMENTED,
}
TRIED = {"calls": 0}
VOCAB = TINY["vocab_size"]
U32 = st.integers(0, 2**32 - 1)


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    with running_server(tiny_llama_dir, kv_tokens=256, block_size=4, max_sequences=64) as srv:
        yield srv
    log.info("fuzz: %d calls tried", TRIED["calls"])
    print(f"\nfuzz: {TRIED['calls']} calls tried")


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server.target) as channel:
        yield pb_grpc.ModelExecutorStub(channel), channel


@pytest.fixture(scope="module")
def base(stub):
    """One real sequence the forged handles start from."""
    s, _ = stub
    return s.Prefill(pb.PrefillRequest(token_ids=[1, 2, 3, 4, 5]), timeout=10).kv_cache


def _state(s) -> tuple:
    st_ = s.GetStatus(pb.GetStatusRequest(), timeout=10)
    return st_.kv_blocks_used, st_.kv_blocks_free, st_.active_sequences


def _call(s, method: str, request):
    """Calls an RPC; returns (reply or None, code).  Unary and server-streaming both."""
    TRIED["calls"] += 1
    fn = getattr(s, method)
    try:
        reply = fn(request, timeout=10)
        if method == "BatchDecode":
            reply = list(reply)
        return reply, grpc.StatusCode.OK
    except grpc.RpcError as exc:
        return None, exc.code()


def _check(s, method: str, request, undo=None) -> None:
    before = _state(s)
    reply, code = _call(s, method, request)
    if code is grpc.StatusCode.OK:
        if undo is not None:
            undo(reply)
        return
    assert code in TABLE_CODES, f"{method} answered {code.name}"
    assert _state(s) == before, f"a failed {method} changed state"


def _handle_mutations(h: pb.KvCacheHandle):
    """Strategies for a copy of ``h`` with one field changed."""
    def with_field(name, values):
        def build(value):
            m = pb.KvCacheHandle()
            m.CopyFrom(h)
            if name == "block_ids":
                del m.block_table.block_ids[:]
                m.block_table.block_ids.extend(value)
            elif name == "block_size":
                m.block_table.block_size = value
            else:
                setattr(m, name, value)
            return m
        return values.map(build)

    text = st.text(max_size=300)
    return st.one_of(
        with_field("cache_id", st.one_of(text, st.just(""), st.just("f" * 32), st.just(h.cache_id + "x"))),
        with_field("server_instance_id", st.one_of(text, st.just(""))),
        with_field("sequence_length", U32),
        with_field("num_layers", U32), with_field("num_kv_heads", U32), with_field("head_dim", U32),
        with_field("device", text), with_field("model", st.one_of(text, st.just(""))),
        with_field("block_size", U32), with_field("block_ids", st.lists(U32, max_size=64)),
    )


def _policy():
    return st.builds(pb.LogitsPolicy, kind=st.integers(0, 5), dtype=st.integers(0, 5), top_k=U32,
                     all_positions=st.booleans())


def _tokens(max_size=40):
    return st.one_of(st.lists(st.integers(0, VOCAB - 1), max_size=max_size), st.lists(U32, max_size=max_size),
                     st.just([]), st.just(list(range(VOCAB)) * 8))  # oversized: past the max length


@FUZZ
@given(data=st.data())
def test_forged_handles_on_every_handle_taking_rpc(stub, base, data):
    s, _ = stub
    handle = data.draw(_handle_mutations(base))
    method = data.draw(st.sampled_from(["Decode", "BatchDecode", "ForwardVerify", "TruncateKv", "ForkCache",
                                        "Prefill", "ReleaseCache"]))
    policy = data.draw(_policy())

    if method == "Decode":
        req = pb.DecodeRequest(token_id=data.draw(U32), kv_cache=handle, logits=policy)
    elif method == "BatchDecode":
        req = pb.BatchDecodeRequest(logits=policy, single_reply=data.draw(st.booleans()))
        for _ in range(data.draw(st.integers(0, 3))):
            req.items.add(token_id=data.draw(U32), kv_cache=handle)
    elif method == "ForwardVerify":
        req = pb.ForwardVerifyRequest(token_ids=data.draw(_tokens()), kv_cache=handle, logits=policy)
    elif method == "TruncateKv":
        req = pb.TruncateKvRequest(kv_cache=handle, new_length=data.draw(U32))
    elif method == "ForkCache":
        req = pb.ForkCacheRequest(kv_cache=handle, num_children=data.draw(U32))
    elif method == "Prefill":
        req = pb.PrefillRequest(token_ids=data.draw(_tokens()), kv_cache=handle, logits=policy)
    else:
        req = pb.ReleaseCacheRequest(cache_id=handle.cache_id if handle.cache_id != base.cache_id else "f" * 32)
    _check(s, method, req, undo=lambda reply: _undo(s, base, reply))


def _undo(s, base: pb.KvCacheHandle, reply) -> None:
    """Puts the base sequence back after a call that succeeded (forged fields the server
    ignores): truncate to its length, release any children or new sequences."""
    replies = reply if isinstance(reply, list) else [reply]
    for r in replies:
        for child in getattr(r, "children", []):
            s.ReleaseCache(pb.ReleaseCacheRequest(cache_id=child.cache_id), timeout=10)
        h = getattr(r, "kv_cache", None)
        if h is not None and h.cache_id and h.cache_id != base.cache_id:
            s.ReleaseCache(pb.ReleaseCacheRequest(cache_id=h.cache_id), timeout=10)
    current = pb.KvCacheHandle()
    current.CopyFrom(base)
    for length in range(base.sequence_length, base.sequence_length + 64):
        current.sequence_length = length
        try:
            s.TruncateKv(pb.TruncateKvRequest(kv_cache=current, new_length=base.sequence_length), timeout=10)
            return
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.FAILED_PRECONDITION:
                raise


@FUZZ
@given(tokens=_tokens(200), policy=_policy(), model=st.one_of(st.just(""), st.just("tiny"), st.text(max_size=20)))
def test_new_prompts_with_extreme_inputs(stub, tokens, policy, model):
    s, _ = stub

    def release(reply):
        s.ReleaseCache(pb.ReleaseCacheRequest(cache_id=reply.kv_cache.cache_id), timeout=10)

    _check(s, "Prefill", pb.PrefillRequest(model=model, token_ids=tokens, logits=policy), undo=release)


METHODS = [m.name for m in pb.DESCRIPTOR.services_by_name["ModelExecutor"].methods]


@FUZZ
@given(method=st.sampled_from(METHODS), garbage=st.binary(max_size=2000))
def test_garbage_bytes_as_the_serialized_message(stub, method, garbage):
    s, channel = stub
    desc = pb.DESCRIPTOR.services_by_name["ModelExecutor"].methods_by_name[method]
    path = f"/{desc.containing_service.full_name}/{method}"
    before = _state(s)
    TRIED["calls"] += 1
    ident = lambda b: b  # noqa: E731
    if desc.client_streaming:
        call = channel.stream_stream(path, request_serializer=ident, response_deserializer=ident)
        replies = call(iter([garbage, garbage]), timeout=10)
    elif desc.server_streaming:
        replies = channel.unary_stream(path, request_serializer=ident, response_deserializer=ident)(garbage, timeout=10)
    else:
        replies = raw = None
        try:
            raw = channel.unary_unary(path, request_serializer=ident, response_deserializer=ident)(garbage, timeout=10)
            code = grpc.StatusCode.OK
        except grpc.RpcError as exc:
            code = exc.code()
    if replies is not None:
        try:
            out = list(replies)
            code = grpc.StatusCode.OK
        except grpc.RpcError as exc:
            out, code = [], exc.code()
        if desc.client_streaming:  # session steps answer errors in-band
            for raw in out:
                reply = pb.DecodeSessionResponse.FromString(raw)
                if reply.HasField("error"):
                    assert reply.error.code not in (grpc.StatusCode.INTERNAL.value[0],
                                                    grpc.StatusCode.UNKNOWN.value[0])
    assert code in TABLE_CODES | {grpc.StatusCode.OK}, f"{method} answered {code.name}"
    if code is grpc.StatusCode.OK and method == "Prefill":  # bytes that parse as a valid prompt made a sequence
        made = pb.PrefillResponse.FromString(raw).kv_cache.cache_id
        s.ReleaseCache(pb.ReleaseCacheRequest(cache_id=made), timeout=10)
    assert _state(s) == before  # queries and refusals change nothing; an accepted prompt was released


@FUZZ
@given(steps=st.lists(st.one_of(st.binary(max_size=200), st.builds(
    lambda t, n: pb.DecodeSessionRequest(step_id=t, items=[pb.DecodeItem(token_id=t % 2**32)] * n)
    .SerializeToString(), U32, st.integers(0, 5))), max_size=6))
def test_malformed_session_streams(stub, steps):
    s, channel = stub
    before = _state(s)
    TRIED["calls"] += 1
    ident = lambda b: b  # noqa: E731
    call = channel.stream_stream("/ferrum_rpc.v1.ModelExecutor/DecodeSession", request_serializer=ident,
                                 response_deserializer=pb.DecodeSessionResponse.FromString)
    try:
        for reply in call(iter(steps), timeout=10):
            if reply.HasField("error"):
                assert reply.error.code not in (grpc.StatusCode.INTERNAL.value[0], grpc.StatusCode.UNKNOWN.value[0])
    except grpc.RpcError as exc:
        assert exc.code() in TABLE_CODES
    assert _state(s) == before


def test_the_server_still_serves_after_the_fuzzing(stub):
    s, _ = stub
    out = s.Prefill(pb.PrefillRequest(token_ids=[9, 8, 7]), timeout=10)
    assert out.kv_cache.sequence_length == 3
    s.ReleaseCache(pb.ReleaseCacheRequest(cache_id=out.kv_cache.cache_id), timeout=10)
