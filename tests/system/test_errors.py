"""Every row of the error table, through real gRPC.

Each failure is checked three ways: the typed exception (class, ``.code``,
``.reason``), the server's KV bookkeeping (GetStatus before == after), and the
sequence itself: after the failed call it must decode to the same logits as a
reference sequence that was fed the same tokens and never saw a failure.
After every failure another caller must still be served.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import grpc
import numpy as np
import pytest
from tests.conftest import running_server
from google.protobuf.message import Message
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from ferrum_rpc import convert
from ferrum_rpc.client import AsyncExecutorClient, ExecutorClient
from ferrum_rpc.errors import (
    ERROR_DOMAIN,
    CacheNotFound,
    Draining,
    ExecutorError,
    InvalidInput,
    KvCapacityExhausted,
    LengthMismatch,
    ModelNotFound,
    Reason,
    SequenceTooLong,
    StaleHandle,
    from_rpc_error,
)
from ferrum_rpc.types import KvCacheHandle, LogitsPolicy, ServerState
from ferrum_rpc.v1 import executor_pb2 as pb
from ferrum_rpc.v1 import executor_pb2_grpc as pb_grpc
from tests.waiting import wait_for

VOCAB = 320  # conftest.TINY
CODE = grpc.StatusCode

# The design's error table, written out here rather than read from the library.
TABLE: dict[type[ExecutorError], tuple[grpc.StatusCode, Reason]] = {
    CacheNotFound: (CODE.NOT_FOUND, Reason.CACHE_NOT_FOUND),
    StaleHandle: (CODE.FAILED_PRECONDITION, Reason.STALE_HANDLE),
    LengthMismatch: (CODE.FAILED_PRECONDITION, Reason.LENGTH_MISMATCH),
    InvalidInput: (CODE.INVALID_ARGUMENT, Reason.INVALID_INPUT),
    SequenceTooLong: (CODE.OUT_OF_RANGE, Reason.SEQUENCE_TOO_LONG),
    KvCapacityExhausted: (CODE.RESOURCE_EXHAUSTED, Reason.KV_CAPACITY_EXHAUSTED),
    ModelNotFound: (CODE.NOT_FOUND, Reason.MODEL_NOT_FOUND),
    Draining: (CODE.UNAVAILABLE, Reason.DRAINING),
}


def prompt(n: int, seed: int = 0) -> list[int]:
    return [(37 * i + 11 + 101 * seed) % VOCAB for i in range(n)]


# -- helpers ------------------------------------------------------------------------
def expect(cls: type[ExecutorError], fn, *args, **kwargs) -> ExecutorError:
    """Runs a call that must fail with exactly ``cls``, its table code and reason."""
    with pytest.raises(ExecutorError) as info:
        fn(*args, **kwargs)
    err = info.value
    code, reason = TABLE[cls]
    assert type(err) is cls, f"expected {cls.__name__}, got {type(err).__name__}: {err}"
    assert err.code == code, f"{cls.__name__}: code {err.code}, expected {code}"
    assert err.reason is reason
    assert err.message, "the human-readable detail was lost"
    return err


def kv_state(c: ExecutorClient) -> tuple[int, int, int]:
    s = c.status()
    return s.kv_blocks_used, s.kv_blocks_free, s.active_sequences


def assert_serves(other: ExecutorClient) -> None:
    """Another caller gets a full prefill/decode/release round trip."""
    out = other.prefill([3, 1, 4, 1, 5], logits=LogitsPolicy.argmax())
    assert out.kv_cache.sequence_length == 5
    step = other.decode(9, out.kv_cache, logits=LogitsPolicy.topk(3))
    assert step.kv_cache.sequence_length == 6 and step.logits.values.shape == (1, 3)
    assert other.release_cache(step.kv_cache) == 2  # 6 tokens in blocks of 4


def check_failure(c: ExecutorClient, other: ExecutorClient | None, cls, fn, *args, **kwargs):
    """``fn`` fails with ``cls``, KV bookkeeping is untouched and ``other`` is still served."""
    before = kv_state(c)
    err = expect(cls, fn, *args, **kwargs)
    assert kv_state(c) == before, f"a failed call ({cls.__name__}) changed the KV state"
    if other is not None:
        assert_serves(other)
        assert kv_state(c) == before
    return err


def assert_same_sequence(c: ExecutorClient, subject: KvCacheHandle, reference: KvCacheHandle,
                         token: int = 17) -> tuple[KvCacheHandle, KvCacheHandle]:
    """Decodes ``token`` on both sequences: lengths, block tables and logits must agree."""
    assert subject.sequence_length == reference.sequence_length
    a = c.decode(token, subject)
    b = c.decode(token, reference)
    assert a.kv_cache.sequence_length == subject.sequence_length + 1
    assert b.kv_cache.sequence_length == reference.sequence_length + 1
    assert a.kv_cache.cache_id == subject.cache_id
    # Blocks shared with other sequences (prefix cache) may be swapped for a
    # private copy on write; the table never loses blocks.
    assert len(a.kv_cache.block_table.block_ids) >= len(subject.block_table.block_ids)
    assert a.logits.values.dtype == np.float32 and a.logits.values.shape == (1, VOCAB)
    np.testing.assert_allclose(a.logits.values, b.logits.values, atol=1e-4, rtol=0)
    return a.kv_cache, b.kv_cache


class Sequences:
    """Prefills sequences on one server and releases whatever is left at teardown."""

    def __init__(self, c: ExecutorClient):
        self.c = c
        self.ids: list[str] = []

    def prefill(self, tokens: list[int]) -> KvCacheHandle:
        handle = self.c.prefill(tokens).kv_cache
        self.ids.append(handle.cache_id)
        return handle

    def twins(self, tokens: list[int]) -> tuple[KvCacheHandle, KvCacheHandle]:
        """A subject and a reference sequence fed the same tokens."""
        return self.prefill(tokens), self.prefill(tokens)

    def release_all(self) -> None:
        for cache_id in self.ids:
            try:
                self.c.release_cache(cache_id)
            except CacheNotFound:
                pass
        self.ids.clear()


@pytest.fixture
def seqs(client):
    s = Sequences(client)
    yield s
    s.release_all()


@pytest.fixture
def other(tiny_server):
    with ExecutorClient(tiny_server.target, timeout=30) as c:
        yield c


@pytest.fixture
def raw(tiny_server):
    with grpc.insecure_channel(tiny_server.target) as channel:
        yield pb_grpc.ModelExecutorStub(channel)


# Calls that take a handle, each appending to / touching the sequence it names.
HANDLE_OPS = {
    "decode": lambda c, h: c.decode(5, h),
    "batch_decode": lambda c, h: c.batch_decode([(5, h)]),
    "prefill_chunk": lambda c, h: c.prefill([5, 6], kv_cache=h),
    "forward_verify": lambda c, h: c.forward_verify([5, 6, 7], h),
    "truncate_kv": lambda c, h: c.truncate_kv(h, 1),
}


# -- CACHE_NOT_FOUND ------------------------------------------------------------------
@pytest.mark.parametrize("op", HANDLE_OPS)
def test_unknown_cache_id(client, other, seqs, op):
    subject, reference = seqs.twins(prompt(6))
    bad = replace(subject, cache_id="0" * 32)
    check_failure(client, other, CacheNotFound, HANDLE_OPS[op], client, bad)
    assert_same_sequence(client, subject, reference)


def test_release_of_unknown_cache_id(client, other, seqs):
    subject, reference = seqs.twins(prompt(6))
    err = check_failure(client, other, CacheNotFound, client.release_cache, "no-such-cache")
    assert "no-such-cache" in err.message
    assert_same_sequence(client, subject, reference)


def test_released_sequence_is_not_found_afterwards(client, other, seqs):
    subject, reference = seqs.prefill(prompt(9)), seqs.prefill(prompt(9, seed=1))  # no shared blocks
    used, free, active = kv_state(client)
    assert client.release_cache(subject) == 3
    assert kv_state(client) == (used - 3, free + 3, active - 1)
    check_failure(client, other, CacheNotFound, client.decode, 5, subject)
    check_failure(client, other, CacheNotFound, client.release_cache, subject)
    check_failure(client, other, CacheNotFound, client.prefill, [5], kv_cache=subject)
    client.decode(5, reference)  # the other sequence is unaffected


# -- STALE_HANDLE ---------------------------------------------------------------------
@pytest.mark.parametrize("op", HANDLE_OPS)
def test_handle_of_another_server_instance(client, other, seqs, op):
    subject, reference = seqs.twins(prompt(6))
    stale = replace(subject, server_instance_id="f" * 32)
    err = check_failure(client, other, StaleHandle, HANDLE_OPS[op], client, stale)
    assert "f" * 32 in err.message
    assert_same_sequence(client, subject, reference)


def test_handle_from_a_real_other_server_is_stale(client, other, seqs, tiny_llama_dir):
    subject, reference = seqs.twins(prompt(6))
    with running_server(tiny_llama_dir) as second, ExecutorClient(second.target, timeout=30) as c2:
        foreign = c2.prefill(prompt(6)).kv_cache
        assert foreign.server_instance_id != subject.server_instance_id
        # same model name, same shape: only the instance id tells them apart
        check_failure(client, other, StaleHandle, client.decode, 5, foreign)
        # and the same cache_id as a local one is still stale
        mixed = replace(subject, server_instance_id=foreign.server_instance_id)
        check_failure(client, other, StaleHandle, client.decode, 5, mixed)
        c2.release_cache(foreign)
    assert_same_sequence(client, subject, reference)


# -- LENGTH_MISMATCH ------------------------------------------------------------------
@pytest.mark.parametrize("delta", [-1, +1, -5])
@pytest.mark.parametrize("op", HANDLE_OPS)
def test_handle_length_differs_from_server(client, other, seqs, op, delta):
    subject, reference = seqs.twins(prompt(7))
    wrong = replace(subject, sequence_length=subject.sequence_length + delta)
    err = check_failure(client, other, LengthMismatch, HANDLE_OPS[op], client, wrong)
    assert str(subject.sequence_length) in err.message
    assert_same_sequence(client, subject, reference)


def test_reusing_an_old_handle_after_decode_is_a_length_mismatch(client, other, seqs):
    subject, reference = seqs.twins(prompt(5))
    subject2, reference2 = assert_same_sequence(client, subject, reference, token=40)
    check_failure(client, other, LengthMismatch, client.decode, 41, subject)  # the old handle
    assert_same_sequence(client, subject2, reference2, token=41)


def test_reusing_a_handle_after_truncate_is_a_length_mismatch(client, other, seqs):
    subject, _ = seqs.twins(prompt(10))
    reference = seqs.prefill(prompt(6))
    short = client.truncate_kv(subject, 6)
    assert short.sequence_length == 6 and len(short.block_table.block_ids) == 2
    check_failure(client, other, LengthMismatch, client.decode, 5, subject)
    assert_same_sequence(client, short, reference)


# -- INVALID_INPUT --------------------------------------------------------------------
def test_empty_prefill(client, other):
    check_failure(client, other, InvalidInput, client.prefill, [])


@pytest.mark.parametrize("call", ["prefill_chunk", "forward_verify", "batch_decode"])
def test_empty_input_on_a_sequence(client, other, seqs, call):
    subject, reference = seqs.twins(prompt(6))
    fn = {
        "prefill_chunk": lambda: client.prefill([], kv_cache=subject),
        "forward_verify": lambda: client.forward_verify([], subject),
        "batch_decode": lambda: client.batch_decode([]),
    }[call]
    check_failure(client, other, InvalidInput, fn)
    assert_same_sequence(client, subject, reference)


@pytest.mark.parametrize("bad_token", [VOCAB, VOCAB + 1, 2**32 - 1])
@pytest.mark.parametrize("call", ["prefill", "prefill_chunk", "decode", "batch_decode", "forward_verify"])
def test_token_id_outside_vocabulary(client, other, seqs, call, bad_token):
    subject, reference = seqs.twins(prompt(6))
    fn = {
        "prefill": lambda: client.prefill([1, 2, bad_token, 3]),
        "prefill_chunk": lambda: client.prefill([5, bad_token], kv_cache=subject),
        "decode": lambda: client.decode(bad_token, subject),
        "batch_decode": lambda: client.batch_decode([(bad_token, subject)]),
        "forward_verify": lambda: client.forward_verify([5, 6, bad_token], subject),
    }[call]
    err = check_failure(client, other, InvalidInput, fn)
    assert str(bad_token) in err.message
    assert_same_sequence(client, subject, reference)


def test_last_vocabulary_id_is_accepted(client, seqs):
    subject = seqs.prefill([VOCAB - 1, 0])
    assert client.decode(VOCAB - 1, subject).kv_cache.sequence_length == 3


@pytest.mark.parametrize("k", [0, VOCAB + 1, 10_000])
@pytest.mark.parametrize("call", ["prefill", "prefill_chunk", "decode", "batch_decode", "forward_verify"])
def test_bad_top_k(client, other, seqs, call, k):
    subject, reference = seqs.twins(prompt(6))
    policy = LogitsPolicy.topk(k)
    fn = {
        "prefill": lambda: client.prefill([1, 2, 3], logits=policy),
        "prefill_chunk": lambda: client.prefill([5, 6], kv_cache=subject, logits=policy),
        "decode": lambda: client.decode(5, subject, logits=policy),
        "batch_decode": lambda: client.batch_decode([(5, subject)], logits=policy),
        "forward_verify": lambda: client.forward_verify([5, 6], subject, logits=policy),
    }[call]
    check_failure(client, other, InvalidInput, fn)
    assert_same_sequence(client, subject, reference)


def test_top_k_bounds_are_accepted(client, seqs):
    subject = seqs.prefill(prompt(4))
    out = client.decode(5, subject, logits=LogitsPolicy.topk(VOCAB))
    assert out.logits.values.shape == (1, VOCAB) and out.logits.token_ids.shape == (1, VOCAB)
    out = client.decode(6, out.kv_cache, logits=LogitsPolicy.topk(1))
    assert out.logits.values.shape == (1, 1)


def raw_failure(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        result = call()
        if not isinstance(result, Message):
            list(result)  # a stream fails while it is read
    return info.value


def assert_invalid_on_the_wire(exc: grpc.RpcError) -> None:
    assert exc.code() == CODE.INVALID_ARGUMENT
    typed = from_rpc_error(exc)
    assert type(typed) is InvalidInput and typed.reason is Reason.INVALID_INPUT
    assert typed.code == CODE.INVALID_ARGUMENT


@pytest.mark.parametrize("dtype", [pb.DTYPE_INT32, pb.DTYPE_INT64, pb.DTYPE_UINT32, 99])
@pytest.mark.parametrize("rpc", ["Prefill", "PrefillChunk", "Decode", "BatchDecode", "ForwardVerify"])
def test_bad_logits_dtype_via_raw_stub(client, other, seqs, raw, rpc, dtype):
    subject, reference = seqs.twins(prompt(6))
    policy = pb.LogitsPolicy(kind=pb.LOGITS_KIND_FULL, dtype=dtype)
    handle = convert.handle_to_proto(subject)
    request = {
        "Prefill": lambda: raw.Prefill(pb.PrefillRequest(token_ids=[1, 2, 3], logits=policy)),
        "PrefillChunk": lambda: raw.Prefill(pb.PrefillRequest(token_ids=[5], kv_cache=handle, logits=policy)),
        "Decode": lambda: raw.Decode(pb.DecodeRequest(token_id=5, kv_cache=handle, logits=policy)),
        "BatchDecode": lambda: raw.BatchDecode(pb.BatchDecodeRequest(
            items=[pb.DecodeItem(token_id=5, kv_cache=handle)], logits=policy)),
        "ForwardVerify": lambda: raw.ForwardVerify(pb.ForwardVerifyRequest(
            token_ids=[5, 6], kv_cache=handle, logits=policy)),
    }[rpc]
    before = kv_state(client)
    assert_invalid_on_the_wire(raw_failure(request))
    assert kv_state(client) == before
    assert_serves(other)
    assert_same_sequence(client, subject, reference)


def test_unknown_logits_kind_via_raw_stub(client, seqs, raw):
    subject, reference = seqs.twins(prompt(6))
    request = pb.DecodeRequest(token_id=5, kv_cache=convert.handle_to_proto(subject),
                               logits=pb.LogitsPolicy(kind=42))
    before = kv_state(client)
    assert_invalid_on_the_wire(raw_failure(lambda: raw.Decode(request)))
    assert kv_state(client) == before
    assert_same_sequence(client, subject, reference)


def test_error_info_on_the_wire(raw):
    """Non-Python callers read the reason from google.rpc.ErrorInfo in the status details."""
    exc = raw_failure(lambda: raw.Prefill(pb.PrefillRequest(token_ids=[])))
    assert exc.code() == CODE.INVALID_ARGUMENT
    status = rpc_status.from_call(exc)
    assert status is not None and status.code == CODE.INVALID_ARGUMENT.value[0]
    infos = []
    for detail in status.details:
        info = error_details_pb2.ErrorInfo()
        assert detail.Unpack(info)
        infos.append(info)
    assert [(i.reason, i.domain) for i in infos] == [("INVALID_INPUT", ERROR_DOMAIN)]
    assert ERROR_DOMAIN == "ferrum.executor.v1"


@pytest.mark.parametrize("new_length", [7, 8, 100])
def test_truncate_past_the_end(client, other, seqs, new_length):
    subject, reference = seqs.twins(prompt(6))
    check_failure(client, other, InvalidInput, client.truncate_kv, subject, new_length)
    assert_same_sequence(client, subject, reference)


def test_truncate_to_the_current_length_is_a_no_op(client, seqs):
    subject, reference = seqs.twins(prompt(6))
    same = client.truncate_kv(subject, 6)
    assert same == subject
    assert_same_sequence(client, same, reference)


# -- SEQUENCE_TOO_LONG ----------------------------------------------------------------
MAX_LEN = 32


@pytest.fixture(scope="module")
def short_server(tiny_llama_dir):
    with running_server(tiny_llama_dir, max_seq_len=MAX_LEN) as server:
        yield server


@pytest.fixture
def short(short_server):
    with ExecutorClient(short_server.target, timeout=30) as c:
        yield c


@pytest.fixture
def short_other(short_server):
    with ExecutorClient(short_server.target, timeout=30) as c:
        yield c


@pytest.fixture
def short_seqs(short):
    s = Sequences(short)
    yield s
    s.release_all()


def test_max_length_is_advertised(short):
    assert short.info().max_sequence_length == MAX_LEN
    assert short.capabilities().max_sequence_length == MAX_LEN


def test_prefill_too_long(short, short_other, short_seqs):
    for n in (MAX_LEN + 1, MAX_LEN + 50):
        err = check_failure(short, short_other, SequenceTooLong, short.prefill, prompt(n))
        assert str(MAX_LEN) in err.message
    at_limit = short_seqs.prefill(prompt(MAX_LEN))  # exactly the limit is fine
    assert at_limit.sequence_length == MAX_LEN


def test_decode_at_the_limit(short, short_other, short_seqs):
    tokens = prompt(MAX_LEN)
    subject = short_seqs.prefill(tokens)
    reference = short_seqs.prefill(tokens[:-1])
    for call in (lambda: short.decode(5, subject), lambda: short.batch_decode([(5, subject)]),
                 lambda: short.forward_verify([5], subject), lambda: short.prefill([5], kv_cache=subject)):
        check_failure(short, short_other, SequenceTooLong, call)
    # the server still holds MAX_LEN tokens (the handle is accepted) ...
    rolled = short.truncate_kv(subject, MAX_LEN - 1)
    # ... and the first MAX_LEN - 1 positions are intact
    assert_same_sequence(short, rolled, reference, token=tokens[-1])


def test_decode_up_to_the_limit_then_refused(short, short_other, short_seqs):
    subject, reference = short_seqs.twins(prompt(MAX_LEN - 2))
    subject, reference = assert_same_sequence(short, subject, reference, token=1)
    subject, reference = assert_same_sequence(short, subject, reference, token=2)
    assert subject.sequence_length == MAX_LEN
    check_failure(short, short_other, SequenceTooLong, short.decode, 3, subject)
    check_failure(short, short_other, SequenceTooLong, short.decode, 3, reference)


def test_chunked_prefill_past_the_limit(short, short_other, short_seqs):
    subject, reference = short_seqs.twins(prompt(MAX_LEN - 2))
    check_failure(short, short_other, SequenceTooLong, short.prefill, [7, 8, 9], kv_cache=subject)
    check_failure(short, short_other, SequenceTooLong, short.forward_verify, [7, 8, 9], subject)
    a = short.prefill([7, 8], kv_cache=subject)  # exactly up to the limit
    b = short.prefill([7, 8], kv_cache=reference)
    assert a.kv_cache.sequence_length == b.kv_cache.sequence_length == MAX_LEN
    np.testing.assert_allclose(a.logits.values, b.logits.values, atol=1e-4, rtol=0)


def test_batch_with_one_sequence_at_the_limit_fails_whole(short, short_other, short_seqs):
    full = short_seqs.prefill(prompt(MAX_LEN, seed=1))
    # at block boundaries, so the items before the refused one must reserve (then return) a block
    a, a_ref = short_seqs.twins(prompt(8, seed=2))
    b, b_ref = short_seqs.twins(prompt(12, seed=3))
    check_failure(short, short_other, SequenceTooLong, short.batch_decode, [(4, a), (5, b), (6, full)])
    assert_same_sequence(short, a, a_ref, token=4)
    assert_same_sequence(short, b, b_ref, token=5)
    assert short.truncate_kv(full, MAX_LEN).sequence_length == MAX_LEN  # untouched as well


# -- KV_CAPACITY_EXHAUSTED --------------------------------------------------------------
NUM_BLOCKS = 16  # kv_tokens=64, block_size=4


@pytest.fixture
def small_server(tiny_llama_dir):
    with running_server(tiny_llama_dir, kv_tokens=64, block_size=4) as server:
        yield server


@pytest.fixture
def small(small_server):
    with ExecutorClient(small_server.target, timeout=30) as c:
        caps = c.capabilities()
        assert (caps.kv_num_blocks, caps.kv_block_size, caps.kv_capacity_tokens) == (NUM_BLOCKS, 4, 64)
        assert kv_state(c) == (0, NUM_BLOCKS, 0), "warm-up leaked KV blocks"
        yield c


def test_prefill_without_free_blocks_then_recovery(small):
    filler = small.prefill(prompt(60, seed=1)).kv_cache  # 15 of 16 blocks
    assert kv_state(small) == (15, 1, 1)
    err = check_failure(small, None, KvCapacityExhausted, small.prefill, prompt(8))  # needs 2
    assert "2" in err.message
    small.info()  # still serving
    assert small.prefill(prompt(4)).kv_cache.sequence_length == 4  # 1 block still fits
    assert kv_state(small) == (16, 0, 2)
    check_failure(small, None, KvCapacityExhausted, small.prefill, [1])
    assert small.release_cache(filler) == 15
    out = small.prefill(prompt(8))  # the same request, now with room
    assert out.kv_cache.sequence_length == 8 and len(out.kv_cache.block_table.block_ids) == 2


def test_prefill_larger_than_the_whole_pool(small):
    check_failure(small, None, KvCapacityExhausted, small.prefill, prompt(65))
    assert kv_state(small) == (0, NUM_BLOCKS, 0)
    out = small.prefill(prompt(64))
    assert kv_state(small) == (NUM_BLOCKS, 0, 1)
    small.release_cache(out.kv_cache)
    assert kv_state(small) == (0, NUM_BLOCKS, 0)


def test_decode_without_free_blocks_leaves_the_sequence_then_recovers(small):
    subject = small.prefill(prompt(4)).kv_cache  # a full block: the next token needs a new one
    reference = small.prefill(prompt(4)).kv_cache
    roomy = small.prefill(prompt(3, seed=4)).kv_cache  # room for one more in its block
    filler = small.prefill(prompt(52, seed=1)).kv_cache  # 13 blocks: the pool is full
    assert kv_state(small) == (NUM_BLOCKS, 0, 4)
    check_failure(small, None, KvCapacityExhausted, small.decode, 5, subject)
    check_failure(small, None, KvCapacityExhausted, small.batch_decode, [(5, subject)])
    check_failure(small, None, KvCapacityExhausted, small.forward_verify, [5, 6], subject)
    check_failure(small, None, KvCapacityExhausted, small.prefill, [5], kv_cache=subject)
    check_failure(small, None, KvCapacityExhausted, small.forward_verify, [5, 6], roomy)  # needs 2
    # a token that fits in a sequence's own last block needs nothing from the pool
    assert small.decode(5, roomy).kv_cache.sequence_length == 4
    small.release_cache(filler)
    assert kv_state(small) == (3, 13, 3)
    assert_same_sequence(small, subject, reference, token=5)  # the same decode, now with room
    assert kv_state(small) == (5, 11, 3)


def test_failed_batch_decode_for_want_of_blocks_leaves_all_items(small):
    subjects = [small.prefill(prompt(4, seed=s)).kv_cache for s in range(3)]
    references = [small.prefill(prompt(4, seed=s)).kv_cache for s in range(3)]
    filler = small.prefill(prompt(32, seed=9)).kv_cache  # 8 blocks
    assert kv_state(small) == (14, 2, 7)  # 2 free: the first two items get one, the third does not
    tokens = [11, 12, 13]
    items = list(zip(tokens, subjects))
    check_failure(small, None, KvCapacityExhausted, small.batch_decode, items)
    for h in subjects:  # every item still has its one block and its length
        assert small.truncate_kv(h, 4) == h
    # the third item alone fits: only the reservation of the whole batch failed
    small.release_cache(filler)
    outs = small.batch_decode(items)  # recovery: the same request succeeds
    refs = small.batch_decode(list(zip(tokens, references)))
    for h, out, ref in zip(subjects, outs, refs):
        assert out.kv_cache.cache_id == h.cache_id and out.kv_cache.sequence_length == 5
        assert out.kv_cache.block_table.block_ids[0] == h.block_table.block_ids[0]
        np.testing.assert_allclose(out.logits.values, ref.logits.values, atol=1e-4, rtol=0)
    for h in outs + refs:
        small.release_cache(h.kv_cache)
    assert kv_state(small) == (0, NUM_BLOCKS, 0), "blocks leaked"


# -- MODEL_NOT_FOUND -------------------------------------------------------------------
@pytest.fixture
def nope(tiny_server):
    with ExecutorClient(tiny_server.target, model="nope", timeout=30) as c:
        yield c


def test_unknown_model_on_queries(client, other, nope):
    for fn in (nope.info, nope.capabilities, nope.status):
        err = check_failure(client, other, ModelNotFound, fn)
        assert "nope" in err.message


@pytest.mark.parametrize("call", ["prefill", "prefill_chunk", "decode", "batch_decode",
                                  "forward_verify", "release"])
def test_unknown_model_on_calls(client, other, nope, seqs, call):
    subject, reference = seqs.twins(prompt(6))
    fn = {
        "prefill": lambda: nope.prefill([1, 2, 3]),
        "prefill_chunk": lambda: nope.prefill([5], kv_cache=subject),
        "decode": lambda: nope.decode(5, subject),
        "batch_decode": lambda: nope.batch_decode([(5, subject)]),
        "forward_verify": lambda: nope.forward_verify([5, 6], subject),
        "release": lambda: nope.release_cache(subject.cache_id),  # must NOT free it
    }[call]
    check_failure(client, other, ModelNotFound, fn)
    assert_same_sequence(client, subject, reference)


@pytest.mark.parametrize("op", HANDLE_OPS)
def test_handle_naming_an_unknown_model(client, other, seqs, op):
    subject, reference = seqs.twins(prompt(6))
    check_failure(client, other, ModelNotFound, HANDLE_OPS[op], client, replace(subject, model="nope"))
    assert_same_sequence(client, subject, reference)


# -- BatchDecode: one bad item fails the whole batch -------------------------------------
BAD_ITEMS = {
    "unknown_cache": lambda a, b: [(5, a), (6, replace(b, cache_id="0" * 32)), (7, b)],
    "duplicate": lambda a, b: [(5, a), (6, b), (7, a)],
    "stale": lambda a, b: [(5, a), (6, replace(b, server_instance_id="f" * 32))],
    "length_mismatch": lambda a, b: [(5, a), (6, replace(b, sequence_length=b.sequence_length - 1))],
    "token_outside_vocab": lambda a, b: [(5, a), (VOCAB, b)],
}
BAD_ITEM_ERRORS = {
    "unknown_cache": CacheNotFound,
    "duplicate": InvalidInput,
    "stale": StaleHandle,
    "length_mismatch": LengthMismatch,
    "token_outside_vocab": InvalidInput,
}


@pytest.mark.parametrize("bad", BAD_ITEMS)
def test_batch_decode_with_one_bad_item(client, other, seqs, bad):
    a, a_ref = seqs.twins(prompt(5, seed=1))
    b, b_ref = seqs.twins(prompt(9, seed=2))
    check_failure(client, other, BAD_ITEM_ERRORS[bad], client.batch_decode, BAD_ITEMS[bad](a, b))
    assert_same_sequence(client, a, a_ref, token=5)
    assert_same_sequence(client, b, b_ref, token=6)


def test_failed_batch_streams_nothing(client, seqs, raw):
    a = seqs.prefill(prompt(5))
    h = convert.handle_to_proto(a)
    request = pb.BatchDecodeRequest(items=[pb.DecodeItem(token_id=5, kv_cache=h),
                                           pb.DecodeItem(token_id=6, kv_cache=h)])
    received = []
    with pytest.raises(grpc.RpcError) as info:
        for reply in raw.BatchDecode(request):
            received.append(reply)
    assert received == [], "a failed batch must not deliver partial results"
    assert info.value.code() == CODE.INVALID_ARGUMENT
    assert from_rpc_error(info.value).reason is Reason.INVALID_INPUT


# -- Forward: UNIMPLEMENTED --------------------------------------------------------------
def test_forward_is_unimplemented(client, other, raw):
    before = kv_state(client)
    with pytest.raises(grpc.RpcError) as info:
        raw.Forward(pb.ForwardRequest(input=pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[1], data=b"\0" * 4)))
    assert info.value.code() == CODE.UNIMPLEMENTED
    typed = from_rpc_error(info.value)
    assert type(typed) is ExecutorError and typed.reason is None
    assert typed.code == CODE.UNIMPLEMENTED
    assert kv_state(client) == before
    assert_serves(other)


# -- DRAINING -------------------------------------------------------------------------------
def test_draining_refuses_calls_and_keeps_state(tiny_llama_dir):
    with running_server(tiny_llama_dir) as server, ExecutorClient(server.target, timeout=30) as c:
        subject, reference = (c.prefill(prompt(6)).kv_cache for _ in range(2))
        before = kv_state(c)
        server.app.servicer.gate.state = ServerState.DRAINING  # the flag SIGTERM's drain sets
        # Queries stay answered so callers can watch the drain.
        assert c.status().state is ServerState.DRAINING
        assert c.info().name == "tiny" and c.capabilities().model == "tiny"
        calls = [
            (c.prefill, ([1, 2, 3],)), (c.decode, (5, subject)), (c.batch_decode, ([(5, subject)],)),
            (c.forward_verify, ([5, 6], subject)), (c.truncate_kv, (subject, 2)),
            (c.release_cache, (subject,)),
        ]
        for fn, args in calls:
            err = expect(Draining, fn, *args)
            assert "shutting down" in err.message
        with ExecutorClient(server.target, timeout=30) as late:  # a new caller too
            expect(Draining, late.prefill, [1])
        assert server.app.servicer.gate.inflight == 0, "refused calls were counted as in flight"
        # nothing was touched while refusing: lift the flag (test only) and look
        server.app.servicer.gate.state = ServerState.SERVING
        assert kv_state(c) == before
        assert_same_sequence(c, subject, reference)


# -- many callers: failures do not disturb coalesced neighbours ---------------------------
def test_failing_callers_do_not_disturb_concurrent_good_ones(tiny_llama_dir):
    steps, workers = 6, 4
    with running_server(tiny_llama_dir, batch_wait_ms=2) as server:
        clients = [ExecutorClient(server.target, timeout=30) for _ in range(2 * workers)]
        try:
            c = clients[0]
            pairs = [(c.prefill(prompt(5, seed=i)).kv_cache, c.prefill(prompt(5, seed=i)).kv_cache)
                     for i in range(workers)]
            barrier = threading.Barrier(2 * workers)

            def good(i):
                cl, h = clients[i], pairs[i][0]
                barrier.wait()
                outs = []
                for t in range(steps):
                    out = cl.decode(20 + t, h)
                    h = out.kv_cache
                    outs.append(out.logits.values)
                return outs

            def bad(i):
                cl = clients[workers + i]
                subject = pairs[i][0]
                barrier.wait()
                errors = []
                for _ in range(steps):
                    with pytest.raises(ExecutorError) as info:
                        cl.decode(20, replace(subject, cache_id=f"gone-{i}"))
                    errors.append(type(info.value))
                return errors

            with ThreadPoolExecutor(2 * workers) as pool:
                goods = [pool.submit(good, i) for i in range(workers)]
                bads = [pool.submit(bad, i) for i in range(workers)]
                good_logits = [f.result() for f in goods]
                assert all(f.result() == [CacheNotFound] * steps for f in bads)
            for i, (_, ref) in enumerate(pairs):  # the same tokens, sequentially
                for t in range(steps):
                    out = c.decode(20 + t, ref)
                    ref = out.kv_cache
                    np.testing.assert_allclose(good_logits[i][t], out.logits.values, atol=1e-4, rtol=0)
            used, _, active = kv_state(c)
            assert active == 2 * workers
            # 5 + 6 = 11 tokens -> 3 blocks each; each pair shares its first (prompt) block
            assert used == workers * (2 * 3 - 1)
        finally:
            for cl in clients:
                cl.close()


def test_two_concurrent_decodes_of_one_handle_one_is_a_length_mismatch(tiny_llama_dir):
    """Two callers decode the same handle at once: one appends, the other is refused.

    Whatever the batching, the second decode names a length the server no
    longer holds, so it must fail with LENGTH_MISMATCH and change nothing; the
    sequence must end up exactly one token longer, holding the winner's token.
    With batch_wait_ms > 0 the worker used to put both into ONE forward
    (ModelWorker._wait_for_more does not check the batch's cache ids), writing
    two tokens into the same KV position and reporting success to both.
    """
    with running_server(tiny_llama_dir, batch_wait_ms=300) as server:
        clients = [ExecutorClient(server.target, timeout=30) for _ in range(3)]
        try:
            c = clients[2]
            subject, reference = (c.prefill(prompt(4)).kv_cache for _ in range(2))  # full blocks
            before = kv_state(c)
            barrier = threading.Barrier(2)

            def decode(i):
                barrier.wait()
                try:
                    return clients[i].decode(30 + i, subject)
                except ExecutorError as exc:
                    return exc

            with ThreadPoolExecutor(2) as pool:
                results = list(pool.map(decode, range(2)))
            wins = [(i, r) for i, r in enumerate(results) if not isinstance(r, ExecutorError)]
            losses = [r for r in results if isinstance(r, ExecutorError)]
            assert len(wins) == 1 and len(losses) == 1, (
                f"both concurrent decodes of one handle succeeded (batch sizes "
                f"{[r.timing.batch_size for r in results if not isinstance(r, ExecutorError)]})"
            )
            assert type(losses[0]) is LengthMismatch
            assert (losses[0].code, losses[0].reason) == TABLE[LengthMismatch]
            winner, out = wins[0]
            assert out.kv_cache.sequence_length == 5
            assert kv_state(c) == (before[0] + 1, before[1] - 1, before[2])  # 5th token: a 2nd block
            expected = c.decode(30 + winner, reference)
            np.testing.assert_allclose(out.logits.values, expected.logits.values, atol=1e-4, rtol=0)
            assert_same_sequence(c, out.kv_cache, expected.kv_cache, token=3)
        finally:
            for cl in clients:
                cl.close()


def test_coalesced_decodes_never_exceed_max_batch_size(tiny_llama_dir):
    """Dynamic batching must respect max_batch_size, also for decodes that arrive
    during the batch_wait_ms window (ModelWorker._wait_for_more adds the next
    queued job without checking the size)."""
    with running_server(tiny_llama_dir, batch_wait_ms=500, max_batch_size=2) as server:
        clients = [ExecutorClient(server.target, timeout=30) for _ in range(2)]
        try:
            c = clients[0]
            handles = [c.prefill(prompt(4, seed=i)).kv_cache for i in range(3)]
            assert c.capabilities().max_batch_size == 2

            def first():
                return clients[0].batch_decode([(5, handles[0])])

            worker = server.app.servicer.gate.workers["tiny"]

            def second():
                # arrives while the worker waits for more work: the first call is in, its job taken
                wait_for(lambda: (server.app.servicer.gate.inflight, worker.queue_depth), 10,
                         "(calls in flight, jobs queued) with the first decode taken", until=lambda o: o == (1, 0))
                return clients[1].batch_decode([(6, handles[1]), (7, handles[2])])

            with ThreadPoolExecutor(2) as pool:
                outs = [f.result() for f in (pool.submit(first), pool.submit(second))]
            sizes = [o.timing.batch_size for batch in outs for o in batch]
            assert max(sizes) <= 2, f"forwards of {sizes} sequences with max_batch_size=2"
        finally:
            for cl in clients:
                cl.close()


# -- the asyncio client maps errors the same way -------------------------------------------
def test_async_client_maps_errors(tiny_server, client, seqs):
    subject, reference = seqs.twins(prompt(6))
    before = kv_state(client)

    async def scenario():
        got = []
        async with AsyncExecutorClient(tiny_server.target, timeout=30) as ac:
            for coro in (
                ac.decode(5, replace(subject, cache_id="0" * 32)),
                ac.decode(5, replace(subject, server_instance_id="f" * 32)),
                ac.decode(5, replace(subject, sequence_length=5)),
                ac.prefill([]),
                ac.batch_decode([(5, subject), (6, subject)]),  # a failing stream
                ac.release_cache("no-such-cache"),
            ):
                with pytest.raises(ExecutorError) as info:
                    await coro
                got.append(info.value)
            ok = await ac.prefill([1, 2, 3], logits=LogitsPolicy.argmax())  # still serving
            assert ok.kv_cache.sequence_length == 3
            await ac.release_cache(ok.kv_cache)
        async with AsyncExecutorClient(tiny_server.target, model="nope", timeout=30) as an:
            with pytest.raises(ExecutorError) as info:
                await an.status()
            got.append(info.value)
        return got

    errors = asyncio.run(scenario())
    expected = [CacheNotFound, StaleHandle, LengthMismatch, InvalidInput, InvalidInput, CacheNotFound,
                ModelNotFound]
    assert [type(e) for e in errors] == expected
    for err, cls in zip(errors, expected):
        assert (err.code, err.reason) == TABLE[cls]
    assert kv_state(client) == before
    assert_same_sequence(client, subject, reference)


def test_async_client_draining(tiny_llama_dir):
    with running_server(tiny_llama_dir) as server:
        server.app.servicer.gate.state = ServerState.DRAINING

        async def scenario():
            async with AsyncExecutorClient(server.target, timeout=30) as ac:
                with pytest.raises(Draining) as info:
                    await ac.prefill([1, 2])
                return info.value

        err = asyncio.run(scenario())
        assert (err.code, err.reason) == (CODE.UNAVAILABLE, Reason.DRAINING)
