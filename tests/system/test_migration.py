"""Sequences that move, through real server processes on loopback.

Export from A, import into B: the next decode's float32 logits equal A's bit for
bit, and greedy decoding goes on with the same tokens (forked and truncated
sequences too, and an export kept as bytes imported after A restarts).  Every
refused import (fingerprint, sizes, checksum, truncation, pool, quota, a cancel
mid-stream) leaves the importing server's blocks, sequences and prefix cache as
they were.  Servers run with two tenants' tokens, so exports and tickets are
checked against the tenant too.
"""

from __future__ import annotations

import asyncio
import signal
import time

import grpc
import numpy as np
import pytest

from ferrum_rpc import sequence_file
from ferrum_rpc.client import AsyncExecutorClient, ExecutorClient, LogitsPolicy
from ferrum_rpc.errors import (
    CacheNotFound,
    ExecutorError,
    FingerprintMismatch,
    InvalidInput,
    KvCapacityExhausted,
    PushTargetRefused,
    TenantQuotaExceeded,
    TicketExpired,
    TicketNotFound,
    TicketUsed,
    TransferCorrupted,
)
from ferrum_rpc.harness import ServerProcess, all_serving
from ferrum_rpc.v1 import executor_pb2 as pb
from ferrum_rpc.v1 import executor_pb2_grpc as pb_grpc
from tests.system.test_security import pki  # noqa: F401  (a fixture: a CA and a server certificate)
from tests.waiting import wait_for, wait_for_async

TOKENS = {"alice": "alice-token-0123456789", "bob": "bob-token-0123456789ab"}
FLAGS = ("--block-size", "4", "--no-warmup", "--threads", "1", "--grace", "5")


@pytest.fixture(scope="module")
def tokens_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("migration") / "tokens"
    path.write_text("".join(f"{tenant} {token}\n" for tenant, token in TOKENS.items()))
    return str(path)


@pytest.fixture(scope="module")
def servers(tiny_llama_dir, tokens_file):
    """A and B (the same model, server processes), M (block size 8: another fingerprint)
    and S (a pool of 8 blocks, a tenant quota of 16 tokens), both in-process servers
    (real gRPC on loopback; they only ever refuse or take an import)."""
    from tests.conftest import running_server

    auth = ("--auth-tokens", tokens_file)
    a = ServerProcess(f"tiny={tiny_llama_dir}", *FLAGS, "--kv-tokens", "1024", *auth)
    b = ServerProcess(f"tiny={tiny_llama_dir}", *FLAGS, "--kv-tokens", "1024", *auth)
    tokens = {"auth_tokens": tokens_file, "warmup": False}
    with running_server(tiny_llama_dir, server_kwargs=tokens, block_size=8) as m, \
            running_server(tiny_llama_dir, server_kwargs=tokens, kv_tokens=32, tenant_kv_tokens=16) as s, \
            all_serving(a, b) as (a, b):
        yield {"a": a, "b": b, "m": m, "s": s}


def connect(server: ServerProcess, tenant: str = "alice") -> ExecutorClient:
    return ExecutorClient(server.target, timeout=30, token=TOKENS[tenant])


def prompt(n: int, seed: int = 0) -> list[int]:
    return [(37 * i + 11 + 101 * seed) % 320 for i in range(n)]


def bits(out) -> np.ndarray:
    """A full float32 logits row as its bit patterns: equal means bit-identical."""
    return np.asarray(out.logits.values, dtype=np.float32).view(np.uint32)


def state(c: ExecutorClient) -> tuple:
    """What a refused import must leave as it was: blocks, sequences, prefix cache."""
    s = c.status()
    return (s.kv_blocks_used, s.kv_blocks_free, s.active_sequences, s.kv_blocks_cached, s.kv_blocks_shared,
            s.prefill_operations, s.prefix_cache_queried_tokens)


def greedy(c: ExecutorClient, token: int, handle, n: int) -> tuple[list[int], list[np.ndarray], object]:
    """n greedy steps from ``token``: the tokens chosen, every row's bits, the last handle."""
    out_tokens, rows = [], []
    for _ in range(n):
        out = c.decode(token, handle)
        rows.append(bits(out))
        token, handle = int(out.logits.argmax()[0]), out.kv_cache
        out_tokens.append(token)
    return out_tokens, rows, handle


def assert_moves_exactly(src: ExecutorClient, dst: ExecutorClient, handle, token: int, steps: int = 4):
    """Exports ``handle`` from src, imports it into dst, and decodes ``steps`` greedy steps
    from ``token`` on both: every logits row bit-identical, the same tokens."""
    data = src.export_sequence(handle)
    moved = dst.import_sequence(data)
    assert moved.sequence_length == handle.sequence_length
    assert moved.server_instance_id != handle.server_instance_id
    there = greedy(dst, token, moved, steps)
    here = greedy(src, token, handle, steps)
    assert there[0] == here[0]
    for mine, theirs in zip(here[1], there[1]):
        assert np.array_equal(mine, theirs)
    return here[2], there[2]


# -- export and import ---------------------------------------------------------------------------


def test_capabilities_say_imports_are_accepted_and_give_the_fingerprint(servers):
    with connect(servers["a"]) as a, connect(servers["b"]) as b, connect(servers["m"]) as m:
        ca, cb, cm = a.capabilities(), b.capabilities(), m.capabilities()
    assert ca.accepts_imports and cb.accepts_imports
    assert len(ca.kv_fingerprint) == 32 and ca.kv_fingerprint == cb.kv_fingerprint
    assert cm.kv_fingerprint != ca.kv_fingerprint  # another block size


def test_moved_sequence_decodes_bit_identically_and_joins_the_prefix_cache(servers):
    with connect(servers["a"]) as a, connect(servers["b"]) as b:
        out = a.prefill(prompt(10))  # two full blocks and a partial one
        token = int(out.logits.argmax()[0])
        handle = a.decode(token, out.kv_cache).kv_cache  # a decoded token in the KV too
        before = b.status()
        a_end, b_end = assert_moves_exactly(a, b, handle, 7)
        after = b.status()
        assert after.prefill_operations == before.prefill_operations  # moved, not recomputed
        # its full blocks joined B's prefix cache under alice: a prompt sharing them hits
        hit = b.prefill(prompt(10)[:8] + [1, 2, 3], logits=LogitsPolicy.argmax())
        assert hit.cached_tokens == 8
        with connect(servers["b"], "bob") as bob:  # never another tenant's
            assert bob.prefill(prompt(10)[:8] + [1, 2, 3], logits=LogitsPolicy.argmax()).cached_tokens == 0
        for c, h in ((a, a_end), (b, b_end), (b, hit.kv_cache)):
            c.release_cache(h)


def test_forked_and_truncated_sequences_move(servers):
    with connect(servers["a"]) as a, connect(servers["b"]) as b:
        parent = a.prefill(prompt(9, seed=1)).kv_cache
        child, other = a.fork_cache(parent, 2)
        child = a.decode(5, child).kv_cache  # diverges inside a shared block (copy on write)
        ends = list(assert_moves_exactly(a, b, child, 9))
        longer = a.forward_verify([3, 4, 5, 6, 7], other).kv_cache
        cut = a.truncate_kv(longer, 11)
        ends += assert_moves_exactly(a, b, cut, 8)
        a.release_cache(parent)
        for h in ends:
            (a if h.server_instance_id == servers["a"].instance else b).release_cache(h)


def test_export_to_a_file_and_async_clients(servers, tmp_path):
    async def run():
        async with AsyncExecutorClient(servers["a"].target, timeout=30, token=TOKENS["alice"]) as a, \
                AsyncExecutorClient(servers["b"].target, timeout=30, token=TOKENS["alice"]) as b:
            out = await a.prefill(prompt(6, seed=2))
            path = tmp_path / "seq.ferrum"
            with open(path, "wb") as f:
                written = await a.export_sequence(out.kv_cache, f, 64)  # small chunks: many messages
            assert written == path.stat().st_size
            assert len(list(sequence_file.messages(path.read_bytes()))) > 3
            with open(path, "rb") as f:
                moved = await b.import_sequence(f)
            x, y = await a.decode(3, out.kv_cache), await b.decode(3, moved)
            assert np.array_equal(bits(x), bits(y))
            await a.release_cache(x.kv_cache)
            await b.release_cache(y.kv_cache)
    asyncio.run(run())


def test_another_tenants_sequence_cannot_be_exported(servers):
    with connect(servers["a"]) as alice, connect(servers["a"], "bob") as bob:
        handle = alice.prefill(prompt(5)).kv_cache
        with pytest.raises(CacheNotFound):
            bob.export_sequence(handle)
        alice.release_cache(handle)


# -- refusals change nothing ---------------------------------------------------------------------


def frames(data: bytes) -> list[pb.SequenceChunk]:
    return list(sequence_file.messages(data))


def joined(messages) -> bytes:
    return b"".join(sequence_file.frame(m) for m in messages)


def refused(c: ExecutorClient, data: bytes, cls: type[ExecutorError]) -> ExecutorError:
    before = state(c)
    with pytest.raises(ExecutorError) as info:
        c.import_sequence(data)
    assert type(info.value) is cls, info.value
    assert state(c) == before
    return info.value


@pytest.fixture(scope="module")
def export(servers):
    """An export of 20 tokens from A (alice's), in chunks of 2 tokens."""
    with connect(servers["a"]) as a:
        out = a.prefill(prompt(20, seed=4), logits=LogitsPolicy.argmax())
        data = a.export_sequence(out.kv_cache, None, 2 * 2 * 2 * 2 * 16 * 4)
        a.release_cache(out.kv_cache)
    return data


def test_a_corrupted_truncated_or_misshapen_stream_is_refused(servers, export):
    messages = frames(export)
    kinds = [m.WhichOneof("part") for m in messages]
    assert kinds == ["header"] + ["kv"] * 10 + ["trailer"]
    with connect(servers["b"]) as b:
        flipped = [pb.SequenceChunk.FromString(m.SerializeToString()) for m in messages]
        data = bytearray(flipped[3].kv.data)
        data[5] ^= 1
        flipped[3].kv.data = bytes(data)
        assert "checksum" in refused(b, joined(flipped), TransferCorrupted).message
        assert "truncated" in refused(b, joined(messages[:-1]), TransferCorrupted).message
        assert "truncated" in refused(b, joined(messages[:4]), TransferCorrupted).message
        wrong = pb.SequenceChunk.FromString(messages[0].SerializeToString())
        wrong.header.kv_bytes += 4
        assert "kv_bytes" in refused(b, joined([wrong, *messages[1:]]), InvalidInput).message
        short = pb.SequenceChunk.FromString(messages[0].SerializeToString())
        del short.header.token_ids[-1]
        refused(b, joined([short, *messages[1:]]), InvalidInput)
        refused(b, joined([messages[0], messages[2], *messages[1:]]), InvalidInput)  # chunks out of order
        refused(b, joined(messages[1:]), InvalidInput)  # no header
        forged = pb.SequenceChunk.FromString(messages[0].SerializeToString())
        forged.header.fingerprint.block_size = 8  # says another layout but keeps the digest
        refused(b, joined([forged, *messages[1:]]), TransferCorrupted)


def test_a_fingerprint_mismatch_is_refused(servers, export):
    with connect(servers["m"]) as m:
        err = refused(m, export, FingerprintMismatch)
        assert "block_size" in err.message


def test_a_bfloat16_pool_moves_between_its_likes_and_only_there(servers, tokens_file, tiny_llama_dir):
    """--kv-dtype bfloat16 is in the fingerprint (its layout): two such servers move a
    sequence bit-exactly (half the bytes a token), and neither takes the other kind's."""
    from tests.conftest import running_server

    tokens = {"auth_tokens": tokens_file, "warmup": False}
    with running_server(tiny_llama_dir, server_kwargs=tokens, kv_dtype="bfloat16") as x, \
            running_server(tiny_llama_dir, server_kwargs=tokens, kv_dtype="bfloat16") as y, \
            connect(x) as cx, connect(y) as cy, connect(servers["a"]) as a:
        fx, fy, fa = (c.capabilities().kv_fingerprint for c in (cx, cy, a))
        assert fx == fy != fa
        handle = cx.prefill(prompt(10, seed=6), logits=LogitsPolicy.argmax()).kv_cache
        assert len(cx.export_sequence(handle)) < 0.6 * len(a.export_sequence(
            ours := a.prefill(prompt(10, seed=6), logits=LogitsPolicy.argmax()).kv_cache))
        ends = assert_moves_exactly(cx, cy, handle, 7)
        assert "kv_layout" in refused(cx, a.export_sequence(ours), FingerprintMismatch).message
        assert "kv_layout" in refused(a, cx.export_sequence(ends[0]), FingerprintMismatch).message
        a.release_cache(ours)
        cx.release_cache(ends[0])
        cy.release_cache(ends[1])


def test_larger_than_the_pool_or_the_quota_is_refused(servers, export):
    with connect(servers["a"]) as a:
        out = a.prefill(prompt(14, seed=5), logits=LogitsPolicy.argmax())
        small = a.export_sequence(out.kv_cache)  # 4 blocks = 16 tokens: within the quota
        a.release_cache(out.kv_cache)
        out = a.prefill(prompt(40, seed=6), logits=LogitsPolicy.argmax())
        large = a.export_sequence(out.kv_cache)  # 10 blocks: more than S's whole pool of 8
        a.release_cache(out.kv_cache)
    with connect(servers["s"]) as s:
        refused(s, large, KvCapacityExhausted)
        refused(s, export, TenantQuotaExceeded)  # 20 tokens: 5 blocks, over 16 tokens of quota
        first = s.import_sequence(small)
        refused(s, small, TenantQuotaExceeded)  # a second one would pass alice's quota
        with connect(servers["s"], "bob") as bob:
            second = bob.import_sequence(small)  # bob has his own quota
            refused(bob, small, KvCapacityExhausted)  # ... but the pool is full now
            bob.release_cache(second)
        s.release_cache(first)


def test_an_import_cancelled_mid_stream_changes_nothing(servers, export):
    messages = frames(export)

    async def run():
        async with grpc.aio.insecure_channel(servers["b"].target) as channel:
            stub = pb_grpc.ModelExecutorStub(channel)
            sent = asyncio.Event()

            async def some_then_wait():
                for m in messages[:-1]:
                    yield m
                sent.set()
                await asyncio.Event().wait()  # the trailer never comes: the call is cancelled first
                yield messages[-1]

            auth = (("authorization", f"Bearer {TOKENS['alice']}"),)
            call = stub.ImportSequence(some_then_wait(), metadata=auth)
            await sent.wait()
            # the server has read everything but the trailer: 20 tokens' KV buffered
            await wait_for_async(lambda: stub.GetStatus(pb.GetStatusRequest(), timeout=10, metadata=auth), 10,
                                 "the import's 20 tokens buffered on B",
                                 until=lambda st: (st.imports_in_flight, st.transfer_bytes_in_flight) == (1, 20 * 512))
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call

    with connect(servers["b"]) as b:
        before = state(b)
        asyncio.run(run())
        assert state(b) == before
        moved = b.import_sequence(export)  # and the same stream, whole, imports
        b.release_cache(moved)


# -- direct migration: A pushes to B with a ticket B issued ----------------------------------------


def test_push_copies_or_moves_a_sequence_with_a_single_use_ticket(servers):
    with connect(servers["a"]) as a, connect(servers["b"]) as b:
        out = a.prefill(prompt(11, seed=7))
        handle = a.decode(int(out.logits.argmax()[0]), out.kv_cache).kv_cache
        ticket = b.create_import_ticket(a.capabilities().kv_fingerprint).ticket
        before = b.status()
        copy = a.push_sequence(handle, servers["b"].target, ticket)
        assert not copy.released and copy.bytes_sent > handle.sequence_length * 512
        assert copy.kv_cache.server_instance_id == servers["b"].instance
        assert b.status().prefill_operations == before.prefill_operations
        x, y = a.decode(4, handle), b.decode(4, copy.kv_cache)  # both keep it, and agree bit for bit
        assert np.array_equal(bits(x), bits(y))
        # the ticket was used: a second push with it is refused and changes nothing
        unchanged = state(b)
        with pytest.raises(TicketUsed):
            a.push_sequence(x.kv_cache, servers["b"].target, ticket)
        assert state(b) == unchanged
        moved = a.push_sequence(x.kv_cache, servers["b"].target, b.create_import_ticket().ticket, move=True)
        assert moved.released
        with pytest.raises(CacheNotFound):
            a.decode(5, x.kv_cache)
        z = b.decode(5, moved.kv_cache)
        assert np.array_equal(bits(z), bits(b.decode(5, y.kv_cache)))
        b.release_cache(z.kv_cache)
        b.release_cache(copy.kv_cache)


def test_a_push_over_the_receivers_quota_answers_its_refusal(servers):
    """S refuses a 20-token push at its header (alice's quota there is 16 tokens) while
    the pusher still has its KV chunks to send: the push answers TENANT_QUOTA_EXCEEDED
    as S gave it, five times in a row, not the fixed ABORTED of a receiver it could not
    reach (S reads the rest of the stream out before it answers), and changes nothing."""
    with connect(servers["a"]) as a, connect(servers["s"]) as s:
        handle = a.prefill(prompt(20, seed=8)).kv_cache
        unchanged = state(s)
        for _ in range(5):
            ticket = s.create_import_ticket(a.capabilities().kv_fingerprint).ticket
            with pytest.raises(TenantQuotaExceeded):
                a.push_sequence(handle, servers["s"].target, ticket, move=True, chunk_bytes=512)
        assert state(s) == unchanged
        assert a.export_sequence(handle)
        a.release_cache(handle)


def test_tickets_refused_expired_other_tenants_unknown_or_for_another_fingerprint(servers):
    with connect(servers["a"]) as a, connect(servers["b"]) as b, connect(servers["b"], "bob") as bob, \
            connect(servers["m"]) as m:
        handle = a.prefill(prompt(6, seed=8), logits=LogitsPolicy.argmax()).kv_cache
        target = servers["b"].target
        unchanged, mine = state(b), state(a)
        short = b.create_import_ticket(ttl_s=0.2).ticket
        expired_after = time.monotonic() + 0.2  # later than the server's own expiry (one clock)
        bobs = bob.create_import_ticket().ticket
        wait_for(lambda: time.monotonic() > expired_after, 5, "the short ticket's 0.2 s to pass")
        for ticket, cls in ((short, TicketExpired), (bobs, TicketNotFound), ("no-such-ticket", TicketNotFound)):
            with pytest.raises(ExecutorError) as info:
                a.push_sequence(handle, target, ticket)
            assert type(info.value) is cls, info.value
        with pytest.raises(FingerprintMismatch):
            b.create_import_ticket("0" * 32)
        # a push whose stream does not match the ticket's fingerprint; the ticket survives it
        ticket = b.create_import_ticket().ticket
        other = m.prefill(prompt(6, seed=8), logits=LogitsPolicy.argmax()).kv_cache
        with pytest.raises(FingerprintMismatch):
            m.push_sequence(other, target, ticket, move=True)
        assert m.export_sequence(other)  # a failed move keeps the sequence
        assert state(b) == unchanged and state(a) == mine
        moved = a.push_sequence(handle, target, ticket, move=True)
        b.release_cache(moved.kv_cache)
        m.release_cache(other)


def test_a_push_goes_only_where_the_operator_allows(servers):
    with connect(servers["a"]) as a:
        handle = a.prefill(prompt(4, seed=9), logits=LogitsPolicy.argmax()).kv_cache
        with pytest.raises(PushTargetRefused):  # --push-allow is loopback by default
            a.push_sequence(handle, "10.255.255.1:50051", "some-ticket")
        with pytest.raises(InvalidInput):
            a.push_sequence(handle, "no port here", "some-ticket")
        a.release_cache(handle)


def test_an_export_kept_as_bytes_imports_after_the_exporter_restarts(servers):
    a = servers["a"]
    with connect(a) as c:
        out = c.prefill(prompt(13, seed=3))
        data = c.export_sequence(out.kv_cache)
        want = bits(c.decode(2, out.kv_cache))
    a.restart()
    with connect(a) as c:
        moved = c.import_sequence(data)
        assert moved.server_instance_id == a.instance
        assert np.array_equal(bits(c.decode(2, moved)), want)
        c.release_cache(moved)


# -- the replica client drains by migration -----------------------------------------------------------


def test_a_drained_replicas_sequence_migrates_with_no_prefill_on_the_other(servers, tiny_llama_dir, tokens_file):
    """SIGTERM on a replica holding a sequence: the replica set's next decode finds it
    DRAINING, has it pushed to the other replica (whose prefill counter does not move)
    and goes on there; every logits row equals a run that stayed on A, bit for bit;
    the drained server logs its export grace and exits 0 once the sequence has left."""
    from ferrum_rpc.client import ReplicaPolicy, ReplicaSetClient

    draining = ServerProcess(f"tiny={tiny_llama_dir}", *FLAGS, "--kv-tokens", "1024", "--auth-tokens", tokens_file,
                             "--export-grace", "20")
    try:
        draining.wait_serving()
        with connect(servers["a"]) as a:  # the reference: the same steps on one server
            out = a.prefill(prompt(10, seed=10))
            want_tokens, want_rows, end = greedy(a, int(out.logits.argmax()[0]), out.kv_cache, 6)
            a.release_cache(end)
        # placed by load alone (KV events would keep the prompt where it was first cached)
        policy = ReplicaPolicy(status_ttl_s=0.5, down_cooldown_s=0.3, seed=0, kv_events=False)
        with ReplicaSetClient([draining.target, servers["b"].target], timeout=30, token=TOKENS["alice"],
                              replica_policy=policy) as rs, connect(servers["b"]) as b:
            handle = None
            for _ in range(20):  # place until one lands on the replica to drain
                o = rs.prefill(prompt(10, seed=10))
                if rs.replica_of(o.kv_cache) == draining.target:
                    handle = o.kv_cache
                    break
                rs.release_cache(o.kv_cache)
            assert handle is not None, "no sequence was placed on the replica to drain"
            token, rows, tokens = int(o.logits.argmax()[0]), [], []
            for _ in range(3):
                step = rs.decode(token, handle)
                rows.append(bits(step))
                token, handle = int(step.logits.argmax()[0]), step.kv_cache
                tokens.append(token)
            prefills = b.status().prefill_operations
            draining.proc.send_signal(signal.SIGTERM)
            draining.wait_for("may be exported or pushed", timeout=10)
            for _ in range(3):
                step = rs.decode(token, handle)
                rows.append(bits(step))
                token, handle = int(step.logits.argmax()[0]), step.kv_cache
                tokens.append(token)
            assert rs.replica_of(handle) == servers["b"].target
            assert b.status().prefill_operations == prefills  # moved, not replayed
            assert tokens == want_tokens
            assert all(np.array_equal(x, y) for x, y in zip(rows, want_rows))
            rs.release_cache(handle)
        assert draining.proc.wait(30) == 0
        draining.wait_for("every live sequence has left", timeout=1)
        draining.wait_for(r"pushed \w+ \(\d+ tokens", timeout=1)
    finally:
        draining.kill()


# -- no server: the byte format and the ticket book ------------------------------------------------


def test_the_export_framing_round_trips_and_refuses_a_cut_file():
    import io

    chunks = [pb.SequenceChunk(kv=pb.KvChunk(first_token=i, num_tokens=1, data=bytes(300 * i))) for i in range(4)]
    data = b"".join(sequence_file.frame(c) for c in chunks)
    assert list(sequence_file.messages(data)) == chunks
    assert list(sequence_file.messages(io.BytesIO(data))) == chunks
    with pytest.raises(InvalidInput):
        list(sequence_file.messages(data[:-5]))  # ends inside a message
    with pytest.raises(InvalidInput):
        list(sequence_file.messages(data + b"\x80"))  # ends inside a length prefix


def test_tickets_are_single_use_bound_to_their_tenant_and_given_back_on_failure():
    from ferrum_rpc.server.rpc.tickets import TicketBook

    book = TicketBook()
    ticket = book.issue("alice", "tiny", "f" * 32, 0)
    with pytest.raises(TicketNotFound):
        book.claim(ticket.secret, "bob")
    claimed = book.claim(ticket.secret, "alice")
    with pytest.raises(TicketUsed):  # in use by a running import
        book.claim(ticket.secret, "alice")
    book.finish(claimed, ok=False)  # that import failed: the ticket is good again
    book.finish(book.claim(ticket.secret, "alice"), ok=True)
    with pytest.raises(TicketUsed):
        book.claim(ticket.secret, "alice")
    with pytest.raises(InvalidInput):
        book.issue("alice", "tiny", "f" * 32, 301)


def test_a_push_between_tls_servers_goes_over_verified_tls(tiny_llama_dir, pki):
    """Both servers serve TLS only (in-process servers, real sockets): the push reaches B
    over TLS, B's certificate verified against A's --push-ca; with a CA that did not
    sign it the push fails (ABORTED) and changes nothing on either side."""
    from ferrum_rpc.client import ClientTls
    from tests.conftest import running_server

    files = dict(tls_cert=str(pki / "server.pem"), tls_key=str(pki / "server.key"))
    tls = ClientTls(ca=str(pki / "ca.pem"))
    with running_server(tiny_llama_dir, server_kwargs={**files, "push_ca": str(pki / "ca.pem")}) as a, \
            running_server(tiny_llama_dir, server_kwargs={**files, "push_ca": str(pki / "rogue-ca.pem")}) as rogue, \
            running_server(tiny_llama_dir, server_kwargs=files) as b:
        with ExecutorClient(a.target, timeout=30, tls=tls) as ca, ExecutorClient(b.target, timeout=30, tls=tls) as cb, \
                ExecutorClient(rogue.target, timeout=30, tls=tls) as cr:
            handle = ca.prefill(prompt(7, seed=11)).kv_cache
            copy = ca.push_sequence(handle, b.target, cb.create_import_ticket().ticket)
            assert np.array_equal(bits(ca.decode(3, handle)), bits(cb.decode(3, copy.kv_cache)))
            other = cr.prefill(prompt(7, seed=11), logits=LogitsPolicy.argmax()).kv_cache
            unchanged = state(cb)
            with pytest.raises(ExecutorError) as info:
                cr.push_sequence(other, b.target, cb.create_import_ticket().ticket, move=True)
            assert info.value.code is grpc.StatusCode.ABORTED, info.value
            assert state(cb) == unchanged
            assert cr.export_sequence(other)  # still there


def test_a_bad_push_allow_or_export_grace_is_a_startup_error():
    """Refused when the configuration is built (the CLI prints the one line and exits 2)."""
    from ferrum_rpc.errors import StartupError
    from ferrum_rpc.server.config import ServerConfig

    with pytest.raises(StartupError, match="--push-allow"):
        ServerConfig(models=(), push_allow="loopback,not-a-network")
    with pytest.raises(StartupError, match="--export-grace"):
        ServerConfig(models=(), export_grace_s=301)
    assert ServerConfig(models=(), push_allow="10.0.3.0/24,none").push_allow
