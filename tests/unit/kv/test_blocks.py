"""The torch-free KV block manager on its own: no model, no device memory.

``Pool`` below stands in for the device KV pool (one token id per slot) and
performs exactly what the executor does around the manager: the block copies
of a write plan, the writes of a forward, ``commit`` on success and
``undo_write`` on failure.  Reading a sequence back through its block table
then checks that sharing and copy on write never let anyone see somebody
else's tokens.
"""

from __future__ import annotations

import itertools
import random
import time
from collections import Counter

import grpc
import pytest

from ferrum_rpc.errors import CacheExpired, CacheNotFound, KvCapacityExhausted, Reason
from ferrum_rpc.server.kv.blocks import BlockManager, SequenceState, WritePlan

GARBAGE = -1  # what a failed forward may leave in the slots it was given


# -- helpers -------------------------------------------------------------------------
def snapshot(m: BlockManager, free_order: bool = True) -> tuple:
    """Everything observable about the manager, its books included."""
    books = m.snapshot()
    seqs = {cid: (s.length, s.block_ids, s.tokens, s.hashes, s.last_used) for cid, s in books.sequences.items()}
    free = books.free if free_order else frozenset(books.free)
    return (m.num_free, m.num_used, len(m), seqs, books.refs, free, dict(books.hash_of),
            dict(books.block_of), m.queried_tokens, m.hit_tokens, m.expired_count)


def tables(m: BlockManager) -> tuple:
    """Sequences, ref counts and the free set: what undo_write must restore."""
    books = m.snapshot()
    seqs = {cid: (s.length, s.block_ids, s.tokens, s.hashes) for cid, s in books.sequences.items()}
    return seqs, books.refs, frozenset(books.free)


def refs(m: BlockManager, seq: SequenceState) -> list[int]:
    held = m.snapshot().refs
    return [held[b] for b in seq.block_ids]


def check_books(m: BlockManager) -> None:
    """Ref counts, free list and hash maps agree with the block tables."""
    books = m.snapshot()
    held = Counter(b for s in books.sequences.values() for b in s.block_ids)
    for s in books.sequences.values():
        assert len(set(s.block_ids)) == len(s.block_ids), f"{s.cache_id} holds a block twice"
        assert len(s.block_ids) == m.blocks_for(s.length), f"{s.cache_id} has stray blocks"
        assert len(s.tokens) == s.length
    assert [books.refs[b] for b in range(m.num_blocks)] == [held.get(b, 0) for b in range(m.num_blocks)]
    assert set(books.free) == {b for b in range(m.num_blocks) if books.refs[b] == 0}
    assert (m.num_used, m.num_free) == (len(held), m.num_blocks - len(held))
    assert m.num_shared == sum(1 for n in held.values() if n > 1)
    assert {d: b for b, d in books.hash_of.items()} == books.block_of, "hash maps disagree"
    assert m.num_cached_free == sum(1 for b in books.free if b in books.hash_of)


def assert_all_free(m: BlockManager) -> None:
    assert m.num_free == m.num_blocks and m.num_used == 0 and len(m) == 0
    books = m.snapshot()
    assert sorted(books.free) == list(range(m.num_blocks))
    assert all(r == 0 for r in books.refs)
    assert m.num_shared == 0


class Pool:
    """A fake device pool driven the way the executor drives the real one."""

    def __init__(self, m: BlockManager):
        self.m = m
        self.slots: list[int | None] = [None] * (m.num_blocks * m.block_size)
        self.known: dict[bytes, tuple[int, ...]] = {}  # block hash -> the tokens it stands for
        self.copies = 0

    def begin(self, seq: SequenceState, tokens: list[int]) -> WritePlan:
        """executor._begin, then the forward's writes."""
        start = seq.length
        plan = self.m.prepare_write(seq, start, start + len(tokens))
        bs = self.m.block_size
        for src, dst in plan.copies:
            self.slots[dst * bs:(dst + 1) * bs] = self.slots[src * bs:(src + 1) * bs]
        self.copies += len(plan.copies)
        for slot, t in zip(self.m.slots(seq, start, start + len(tokens)), tokens):
            self.slots[slot] = t
        return plan

    def write(self, seq: SequenceState, tokens: list[int]) -> WritePlan:
        """A successful forward: begin + commit."""
        start = seq.length
        plan = self.begin(seq, tokens)
        self.m.commit(seq, start, tokens)
        bs = self.m.block_size
        for i, digest in enumerate(seq.hashes):
            self.known[digest] = tuple(seq.tokens[i * bs:(i + 1) * bs])
        return plan

    def fail(self, seq: SequenceState, num_tokens: int) -> WritePlan:
        """A forward that scribbled over its slots and then raised."""
        plan = self.begin(seq, [GARBAGE] * num_tokens)
        self.m.undo_write(seq, plan)
        return plan

    def read(self, seq: SequenceState) -> list[int | None]:
        return [self.slots[s] for s in self.m.slots(seq, 0, seq.length)]

    def check(self) -> None:
        """Every live sequence reads back its own tokens; every hashed block holds its tokens."""
        for s in self.m.sequences():
            assert self.read(s) == s.tokens, f"{s.cache_id} reads back the wrong KV"
            bs = self.m.block_size
            assert s.hashes == self.m.block_hashes(s.tokens[:len(s.hashes) * bs], s.tenant)
        bs = self.m.block_size
        for b, digest in self.m.snapshot().hash_of.items():
            assert tuple(self.slots[b * bs:(b + 1) * bs]) == self.known[digest], f"block {b} is stale"


def written(m: BlockManager, cid: str, tokens: list[int]) -> SequenceState:
    """A new sequence holding ``tokens`` (computed, not adopted)."""
    seq = m.create(cid)
    m.prepare_write(seq, 0, len(tokens))
    m.commit(seq, 0, tokens)
    return seq


def append(m: BlockManager, seq: SequenceState, tokens: list[int]) -> WritePlan:
    start = seq.length
    plan = m.prepare_write(seq, start, start + len(tokens))
    m.commit(seq, start, tokens)
    return plan


# -- basics --------------------------------------------------------------------------
@pytest.mark.parametrize("num_blocks, block_size", [(0, 4), (4, 0), (-1, 4)])
def test_rejects_empty_pool(num_blocks, block_size):
    with pytest.raises(ValueError):
        BlockManager(num_blocks, block_size)


def test_fresh_pool_is_all_free():
    m = BlockManager(8, 4)
    assert (m.num_blocks, m.block_size, m.num_free, m.num_used, len(m)) == (8, 4, 8, 0, 0)
    assert (m.num_shared, m.num_cached_free) == (0, 0)
    assert (m.queried_tokens, m.hit_tokens, m.expired_count) == (0, 0, 0)
    assert m.prefix_caching is True


@pytest.mark.parametrize("tokens, blocks", [(0, 0), (1, 1), (4, 1), (5, 2), (8, 2), (9, 3)])
def test_blocks_for_rounds_up(tokens, blocks):
    assert BlockManager(16, 4).blocks_for(tokens) == blocks


def test_create_get_contains_and_duplicate():
    m = BlockManager(8, 4)
    seq = m.create("a")
    assert "a" in m and "b" not in m and len(m) == 1
    assert m.get("a") is seq and seq.length == 0 and seq.block_ids == [] and seq.tokens == []
    with pytest.raises(ValueError):
        m.create("a")
    assert len(m) == 1 and m.get("a") is seq


def test_get_unknown_raises_cache_not_found():
    m = BlockManager(8, 4)
    with pytest.raises(CacheNotFound) as info:
        m.get("nope")
    assert "nope" in str(info.value)
    assert type(info.value) is CacheNotFound
    assert info.value.reason is Reason.CACHE_NOT_FOUND and info.value.code is grpc.StatusCode.NOT_FOUND


# -- writing -------------------------------------------------------------------------
def test_prepare_write_allocates_only_missing_blocks_and_leaves_length_alone():
    m = BlockManager(8, 4)
    seq = m.create("a")
    plan = m.prepare_write(seq, 0, 5)  # 5 tokens -> 2 blocks
    assert len(plan.added) == 2 and seq.block_ids == plan.added
    assert plan.copies == [] and plan.replaced == []
    assert seq.length == 0 and seq.tokens == [], "prepare_write must not commit"
    assert (m.num_free, m.num_used) == (6, 2)
    m.commit(seq, 0, [1, 2, 3, 4, 5])
    assert seq.length == 5 and seq.tokens == [1, 2, 3, 4, 5]
    plan = m.prepare_write(seq, 5, 8)  # still fits in 2 blocks
    assert plan == WritePlan() and len(seq.block_ids) == 2 and m.num_free == 6
    m.commit(seq, 5, [6, 7, 8])
    first_two = list(seq.block_ids)
    plan = m.prepare_write(seq, 8, 9)  # crosses into a 3rd block
    assert len(plan.added) == 1 and seq.block_ids == first_two + plan.added
    assert m.num_used == 3 and len(set(seq.block_ids)) == 3, "a block handed out twice"


def test_commit_records_tokens_and_registers_full_blocks():
    m = BlockManager(8, 4)
    seq = m.create("a")
    m.prepare_write(seq, 0, 6)
    m.commit(seq, 0, [1, 2, 3, 4, 5, 6])
    assert (seq.length, seq.tokens) == (6, [1, 2, 3, 4, 5, 6])
    assert seq.hashes == m.block_hashes([1, 2, 3, 4], "") and len(seq.hashes) == 1
    assert m.snapshot().hash_of == {seq.block_ids[0]: seq.hashes[0]}, "a partial block was hashed"
    append(m, seq, [7, 8])
    assert len(seq.hashes) == 2 and set(m.snapshot().hash_of) == set(seq.block_ids)
    check_books(m)


def test_sequences_get_disjoint_blocks():
    m = BlockManager(10, 2)
    seqs = [m.create(str(i)) for i in range(5)]
    for i, s in enumerate(seqs):
        append(m, s, [10 * i + j for j in range(4)])
    ids = [b for s in seqs for b in s.block_ids]
    assert sorted(ids) == list(range(10))
    assert m.num_free == 0 and m.num_shared == 0
    check_books(m)


def test_undo_write_returns_the_added_blocks():
    m = BlockManager(8, 4)
    seq = written(m, "a", [1, 2, 3, 4, 5])
    before = tables(m)
    plan = m.prepare_write(seq, 5, 13)
    assert len(plan.added) == 2 and m.num_free == 4
    m.undo_write(seq, plan)
    assert tables(m) == before and seq.length == 5
    check_books(m)


def test_undo_write_of_a_plan_that_added_nothing_keeps_the_table():
    m = BlockManager(8, 4)
    seq = written(m, "a", [1, 2, 3, 4, 5])
    before = tables(m)
    plan = m.prepare_write(seq, 5, 6)  # room in the last block already
    assert plan == WritePlan()
    m.undo_write(seq, plan)
    assert tables(m) == before and len(seq.block_ids) == 2


def test_slots_map_positions_through_the_block_table():
    m = BlockManager(8, 4)
    written(m, "filler", [9, 9, 9, 9])  # takes block 0, so "a" gets non-trivial ids
    seq = m.create("a")
    m.prepare_write(seq, 0, 10)
    b0, b1, b2 = seq.block_ids
    assert 0 not in seq.block_ids
    expected = [b0 * 4 + i for i in range(4)] + [b1 * 4 + i for i in range(4)] + [b2 * 4, b2 * 4 + 1]
    assert m.slots(seq, 0, 10) == expected
    assert m.slots(seq, 5, 7) == [b1 * 4 + 1, b1 * 4 + 2]
    assert m.slots(seq, 3, 3) == []


def test_slots_follow_a_scrambled_block_table():
    m = BlockManager(4, 2)
    seq = m.create("a")
    seq.block_ids = [3, 1]  # physical order need not match logical order
    assert m.slots(seq, 0, 4) == [6, 7, 2, 3]


def test_shrink_frees_blocks_past_the_new_length():
    m = BlockManager(8, 4)
    seq = written(m, "a", list(range(1, 13)))
    first = list(seq.block_ids)
    assert m.shrink(seq, 5) == 1
    assert seq.length == 5 and seq.block_ids == first[:2] and seq.tokens == [1, 2, 3, 4, 5]
    assert len(seq.hashes) == 1
    assert m.num_used == 2 and first[2] in m.snapshot().free
    assert m.shrink(seq, 4) == 1 and seq.block_ids == first[:1] and seq.length == 4
    assert m.shrink(seq, 4) == 0  # no-op
    assert m.shrink(seq, 0) == 1 and seq.block_ids == [] and seq.length == 0 and seq.hashes == []
    assert m.num_free == 8
    check_books(m)


def test_release_frees_everything_and_forgets_the_sequence():
    m = BlockManager(8, 4)
    written(m, "a", list(range(9)))
    assert m.release("a") == 3
    assert "a" not in m and len(m) == 0 and m.num_free == 8
    with pytest.raises(CacheNotFound):
        m.release("a")
    assert_all_free(m)


def test_release_of_an_empty_sequence():
    m = BlockManager(4, 4)
    m.create("a")
    assert m.release("a") == 0 and m.num_free == 4 and len(m) == 0


def test_exhaustion_raises_and_changes_nothing():
    m = BlockManager(4, 4)
    a = written(m, "a", list(range(12)))  # 3 of 4 blocks
    b = m.create("b")
    before = snapshot(m)
    with pytest.raises(KvCapacityExhausted) as info:
        m.prepare_write(b, 0, 8)  # needs 2, 1 free
    assert info.value.reason is Reason.KV_CAPACITY_EXHAUSTED
    assert info.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert snapshot(m) == before
    with pytest.raises(KvCapacityExhausted):
        m.prepare_write(a, 12, 20)  # a needs 2 more
    assert snapshot(m) == before
    assert a.length == 12 and len(a.block_ids) == 3 and b.block_ids == []
    # exactly what is left still fits
    assert len(m.prepare_write(b, 0, 4).added) == 1 and m.num_free == 0


def test_exhaustion_when_a_request_exceeds_the_whole_pool():
    m = BlockManager(2, 4)
    seq = m.create("a")
    before = snapshot(m)
    with pytest.raises(KvCapacityExhausted):
        m.prepare_write(seq, 0, 9)
    assert snapshot(m) == before and m.num_free == 2 and seq.block_ids == []


def test_released_blocks_are_reused():
    m = BlockManager(3, 2)
    written(m, "a", [1, 2, 3, 4, 5, 6])
    b = m.create("b")
    with pytest.raises(KvCapacityExhausted):
        m.prepare_write(b, 0, 1)
    assert m.release("a") == 3
    assert len(m.prepare_write(b, 0, 6).added) == 3 and m.num_free == 0


def test_ref_counts_track_ownership():
    m = BlockManager(6, 2)
    a = written(m, "a", [1, 2, 3, 4])
    assert refs(m, a) == [1, 1] and sum(m.snapshot().refs) == 2
    m.shrink(a, 2)
    assert sum(m.snapshot().refs) == 1 and m.snapshot().refs[a.block_ids[0]] == 1
    m.release("a")
    assert sum(m.snapshot().refs) == 0


# -- prefix caching ------------------------------------------------------------------
def test_adopt_prefix_shares_the_leading_full_blocks():
    m = BlockManager(16, 4)
    prompt = list(range(1, 14))  # 3 full blocks + 1 token
    a = written(m, "a", prompt)
    b = m.create("b")
    hit = m.adopt_prefix(b, prompt, len(prompt) - 1)
    assert hit == 12
    assert b.block_ids == a.block_ids[:3], "the prefix hit must reuse the very same blocks"
    assert refs(m, a) == [2, 2, 2, 1]
    assert (b.length, b.tokens, b.hashes) == (12, prompt[:12], a.hashes[:3])
    assert m.num_shared == 3 and m.num_used == 4
    assert (m.queried_tokens, m.hit_tokens) == (13, 12)
    # the hit counts as committed: the rest is written after it, into a block of b's own
    plan = m.prepare_write(b, 12, 13)
    assert plan.copies == [] and len(plan.added) == 1 and plan.added[0] != a.block_ids[3]
    m.commit(b, 12, prompt[12:])
    assert b.block_ids[:3] == a.block_ids[:3] and m.num_shared == 3
    check_books(m)


@pytest.mark.parametrize(
    "max_tokens, hit", [(13, 12), (12, 12), (11, 8), (8, 8), (7, 4), (4, 4), (3, 0), (0, 0), (-5, 0)]
)
def test_adopt_prefix_rounds_max_tokens_down_to_whole_blocks(max_tokens, hit):
    m = BlockManager(16, 4)
    prompt = list(range(1, 17))  # 4 full blocks
    a = written(m, "a", prompt)
    b = m.create("b")
    assert m.adopt_prefix(b, prompt[:13], max_tokens) == hit
    assert b.block_ids == a.block_ids[:hit // 4] and b.length == hit and b.tokens == prompt[:hit]
    assert (m.queried_tokens, m.hit_tokens) == (13, hit)
    assert m.num_shared == hit // 4
    check_books(m)


def test_partial_blocks_are_never_shared():
    m = BlockManager(8, 4)
    prompt = [1, 2, 3, 4, 5, 6]  # 1 full block + 2 tokens
    a = written(m, "a", prompt)
    assert len(m.snapshot().hash_of) == 1
    b = m.create("b")
    assert m.adopt_prefix(b, prompt, len(prompt)) == 4
    assert b.block_ids == a.block_ids[:1] and refs(m, a) == [2, 1]
    # even a longer prompt that agrees with a's partial block gets only the full one
    c = m.create("c")
    assert m.adopt_prefix(c, prompt + [7, 8, 9], 9) == 4
    assert a.block_ids[1] not in c.block_ids and m.snapshot().refs[a.block_ids[1]] == 1


def test_prefix_hashes_are_chained():
    m = BlockManager(16, 2)
    a = written(m, "a", [1, 2, 3, 4, 5, 6])
    # the same second block after a different first block is not a hit
    x = m.create("x")
    assert m.adopt_prefix(x, [9, 9, 3, 4, 5, 6, 0], 6) == 0 and x.block_ids == []
    # a divergence in the middle stops the match there
    y = m.create("y")
    assert m.adopt_prefix(y, [1, 2, 3, 9, 5, 6, 0], 6) == 2 and y.block_ids == a.block_ids[:1]
    # a block's content at another position is not a hit either
    z = m.create("z")
    assert m.adopt_prefix(z, [3, 4, 0], 2) == 0
    assert (m.queried_tokens, m.hit_tokens) == (17, 2)
    check_books(m)


def test_adopt_prefix_miss_counts_only_queried_tokens():
    m = BlockManager(8, 4)
    b = m.create("b")
    assert m.adopt_prefix(b, [1, 2, 3, 4, 5], 4) == 0
    assert (b.length, b.block_ids, b.tokens) == (0, [], [])
    assert (m.queried_tokens, m.hit_tokens, m.num_free) == (5, 0, 8)


def test_adopt_prefix_only_fills_an_empty_sequence():
    m = BlockManager(8, 4)
    written(m, "a", [1, 2, 3, 4, 5])
    b = written(m, "b", [7])
    before = tables(m)
    assert m.adopt_prefix(b, [1, 2, 3, 4, 5], 4) == 0
    assert tables(m) == before and m.hit_tokens == 0


def test_prefix_caching_off_shares_nothing():
    m = BlockManager(8, 4, prefix_caching=False)
    a = written(m, "a", [1, 2, 3, 4, 5, 6, 7, 8])
    assert m.snapshot().hash_of == {} and m.snapshot().block_of == {} and a.hashes == []
    b = m.create("b")
    assert m.adopt_prefix(b, [1, 2, 3, 4, 5, 6, 7, 8, 9], 8) == 0
    assert b.block_ids == [] and m.hit_tokens == 0 and m.num_shared == 0
    m.release("a")
    assert m.num_cached_free == 0


def test_shared_block_is_freed_only_by_its_last_owner():
    m = BlockManager(4, 2)
    a = written(m, "a", [1, 2, 3, 4])
    shared = a.block_ids[0]
    b = m.create("b")
    assert m.adopt_prefix(b, [1, 2, 3], 2) == 2 and b.block_ids == [shared]
    assert m.release("a") == 1
    assert shared not in m.snapshot().free and m.snapshot().refs[shared] == 1 and m.num_used == 1
    assert m.release("b") == 1
    assert shared in m.snapshot().free and m.num_free == 4 and m.snapshot().refs[shared] == 0


def test_release_returns_only_the_blocks_actually_freed():
    m = BlockManager(16, 4)
    prompt = list(range(1, 11))  # 2 full blocks + 2 tokens
    written(m, "a", prompt)
    b = m.create("b")
    m.adopt_prefix(b, prompt, 9)
    append(m, b, prompt[8:] + [99])
    assert m.num_used == 4 and m.num_shared == 2
    assert m.release("a") == 1  # its 2 prefix blocks stay with b
    assert m.num_used == 3 and m.num_shared == 0
    assert m.release("b") == 3
    assert_all_free(m)


# -- freed blocks stay cached --------------------------------------------------------
def test_freed_hashed_blocks_stay_reusable():
    m = BlockManager(8, 4)
    prompt = list(range(1, 11))  # 2 full blocks + 2 tokens
    a = written(m, "a", prompt)
    full = a.block_ids[:2]
    assert m.release("a") == 3
    assert m.num_free == 8 and m.num_cached_free == 2
    b = m.create("b")
    assert m.adopt_prefix(b, prompt, 9) == 8
    assert b.block_ids == full, "the freed blocks were not found again"
    assert m.num_cached_free == 0 and m.num_free == 6 and refs(m, b) == [1, 1]
    assert all(blk not in m.snapshot().free for blk in full)
    append(m, b, prompt[8:])
    check_books(m)


def test_cached_free_blocks_are_forgotten_once_handed_out():
    m = BlockManager(4, 4)
    prompt = list(range(1, 10))
    written(m, "a", prompt)
    m.release("a")
    assert m.num_cached_free == 2
    other = written(m, "other", [50 + i for i in range(16)])  # takes the whole pool
    assert m.num_free == 0 and m.num_cached_free == 0
    m.release("other")
    b = m.create("b")
    assert m.adopt_prefix(b, prompt, 8) == 0 and b.block_ids == []
    # other's own content is cached now
    c = m.create("c")
    assert m.adopt_prefix(c, other.tokens, 16) == 16


def test_least_recently_freed_blocks_are_handed_out_first_tail_before_head():
    m = BlockManager(8, 2)
    a = written(m, "a", [1, 2, 3, 4])  # blocks 0, 1
    b = written(m, "b", [5, 6, 7, 8])  # blocks 2, 3
    a_blocks, b_blocks = list(a.block_ids), list(b.block_ids)
    m.release("a")
    m.release("b")
    assert m.num_cached_free == 4
    filler = m.create("filler")
    taken = m.prepare_write(filler, 0, 10).added  # 5 blocks: the 4 never used, then a's tail
    assert taken[-1] == a_blocks[1] and not set(taken[:4]) & set(a_blocks + b_blocks)
    assert m.num_cached_free == 3
    x = m.create("x")
    assert m.adopt_prefix(x, [1, 2, 3, 4, 0], 4) == 2 and x.block_ids == a_blocks[:1]
    y = m.create("y")
    assert m.adopt_prefix(y, [5, 6, 7, 8, 0], 4) == 4 and y.block_ids == b_blocks


# -- fork and copy on write ----------------------------------------------------------
def test_fork_shares_every_block():
    m = BlockManager(8, 4)
    p = written(m, "p", [1, 2, 3, 4, 5, 6])
    c1, c2 = m.fork(p, ["c1", "c2"])
    assert "c1" in m and "c2" in m and m.get("c1") is c1
    for c in (c1, c2):
        assert (c.length, c.block_ids, c.tokens, c.hashes) == (p.length, p.block_ids, p.tokens, p.hashes)
        assert c.block_ids is not p.block_ids and c.tokens is not p.tokens
    assert refs(m, p) == [3, 3] and m.num_used == 2 and m.num_shared == 2
    check_books(m)


def test_fork_rejects_an_existing_id_and_changes_nothing():
    m = BlockManager(8, 4)
    p = written(m, "p", [1, 2, 3, 4, 5])
    written(m, "q", [7])
    before = snapshot(m)
    for ids in (["new", "q"], ["p"]):
        with pytest.raises(ValueError):
            m.fork(p, ids)
        assert snapshot(m) == before


def test_fork_rejects_a_repeated_child_id_and_changes_nothing():
    """fork(seq, ["x", "x"]) must not take two references for one tracked child."""
    m = BlockManager(8, 4)
    p = written(m, "p", [1, 2, 3, 4, 5])
    before = snapshot(m)
    with pytest.raises(ValueError):
        m.fork(p, ["x", "x"])
    assert snapshot(m) == before


def test_copy_on_write_of_a_shared_partial_block():
    m = BlockManager(8, 4)
    pool = Pool(m)
    p = m.create("p")
    pool.write(p, [1, 2, 3, 4, 5, 6])
    b0, b1 = p.block_ids
    (c,) = m.fork(p, ["c"])
    parent_before = (p.length, list(p.block_ids), list(p.tokens), list(p.hashes))
    plan = m.prepare_write(c, 6, 7)
    (new,) = [b for b in c.block_ids if b not in (b0, b1)]
    assert plan.copies == [(b1, new)] and plan.replaced == [(1, b1)] and plan.added == []
    assert c.block_ids == [b0, new]
    assert (p.length, p.block_ids, p.tokens, p.hashes) == tuple(parent_before), "the parent's table moved"
    assert m.snapshot().refs[b0] == 2 and m.snapshot().refs[b1] == 1 and m.snapshot().refs[new] == 1
    assert m.num_shared == 1 and m.num_used == 3
    m.undo_write(c, plan)
    # through the fake pool: the child's write lands in its copy only
    pool.write(c, [70])
    pool.write(p, [60, 61])
    assert pool.read(p) == [1, 2, 3, 4, 5, 6, 60, 61] and pool.read(c) == [1, 2, 3, 4, 5, 6, 70]
    pool.check()
    check_books(m)


def test_copy_on_write_with_room_to_add():
    m = BlockManager(8, 4)
    p = written(m, "p", [1, 2, 3, 4, 5, 6])
    (c,) = m.fork(p, ["c"])
    plan = m.prepare_write(c, 6, 10)
    assert len(plan.copies) == 1 and len(plan.added) == 1
    assert c.block_ids[0] == p.block_ids[0] and c.block_ids[2] == plan.added[0]
    assert m.num_used == 4
    m.commit(c, 6, [7, 8, 9, 10])
    check_books(m)


def test_undo_write_restores_a_copied_table_and_ref_counts_exactly():
    m = BlockManager(8, 4)
    p = written(m, "p", [1, 2, 3, 4, 5, 6])
    (c,) = m.fork(p, ["c"])
    before = tables(m)
    child_before = list(c.block_ids)
    plan = m.prepare_write(c, 6, 10)  # a copy and an added block
    assert plan.copies and plan.added
    m.undo_write(c, plan)
    assert c.block_ids == child_before and refs(m, c) == [2, 2]
    assert tables(m) == before
    check_books(m)


def test_undo_write_after_the_other_owner_left_takes_the_block_back_from_the_free_list():
    m = BlockManager(8, 4)
    p = written(m, "p", [1, 2, 3, 4, 5, 6])
    (c,) = m.fork(p, ["c"])
    b0, b1 = p.block_ids
    plan = m.prepare_write(c, 6, 7)  # c copies b1; p is b1's only owner now
    assert m.release("p") == 1 and b1 in m.snapshot().free
    m.undo_write(c, plan)
    assert c.block_ids == [b0, b1] and refs(m, c) == [1, 1]
    assert b1 not in m.snapshot().free
    check_books(m)
    assert m.release("c") == 2
    assert_all_free(m)


def test_only_the_first_writer_of_a_shared_block_copies():
    m = BlockManager(8, 4)
    p = written(m, "p", [1, 2, 3, 4, 5, 6])
    (c,) = m.fork(p, ["c"])
    assert m.prepare_write(c, 6, 7).copies
    m.commit(c, 6, [7])
    plan = m.prepare_write(p, 6, 7)  # p is now the only owner of its block
    assert plan == WritePlan()
    m.commit(p, 6, [8])
    assert m.num_shared == 1 and p.block_ids[0] == c.block_ids[0] and p.block_ids[1] != c.block_ids[1]
    check_books(m)


def test_fork_of_a_block_aligned_sequence_appends_without_copying():
    m = BlockManager(8, 4)
    p = written(m, "p", list(range(1, 9)))
    (c,) = m.fork(p, ["c"])
    plan = m.prepare_write(c, 8, 9)
    assert plan.copies == [] and len(plan.added) == 1
    assert c.block_ids[:2] == p.block_ids and refs(m, p) == [2, 2]


def test_copy_on_write_after_shrinking_into_a_shared_block():
    m = BlockManager(8, 4)
    pool = Pool(m)
    p = m.create("p")
    pool.write(p, list(range(1, 9)))
    (c,) = m.fork(p, ["c"])
    m.shrink(c, 2)
    assert c.block_ids == p.block_ids[:1] and refs(m, p) == [2, 1]
    plan = pool.write(c, [30, 31, 32, 33])
    assert plan.copies == [(p.block_ids[0], c.block_ids[0])] and len(plan.added) == 1
    assert pool.read(c) == [1, 2, 30, 31, 32, 33] and pool.read(p) == list(range(1, 9))
    assert set(p.block_ids).isdisjoint(c.block_ids)
    pool.check()
    check_books(m)


def test_writing_into_a_hashed_block_after_shrink_unhashes_it():
    m = BlockManager(8, 4)
    pool = Pool(m)
    a = m.create("a")
    pool.write(a, [1, 2, 3, 4, 5, 6, 7, 8])
    b1 = a.block_ids[1]
    stale = a.hashes[1]
    m.shrink(a, 6)
    assert a.block_ids[1] == b1 and len(a.hashes) == 1
    pool.write(a, [50, 51])  # overwrites positions 6, 7 of b1 in place
    assert a.block_ids[1] == b1, "an exclusive block must be written in place"
    assert stale not in m.snapshot().block_of and m.snapshot().hash_of[b1] == a.hashes[1] != stale
    old = m.create("old")
    assert m.adopt_prefix(old, [1, 2, 3, 4, 5, 6, 7, 8, 9], 8) == 4, "a prompt matched stale KV"
    new = m.create("new")
    assert m.adopt_prefix(new, [1, 2, 3, 4, 5, 6, 50, 51, 9], 8) == 8 and new.block_ids == a.block_ids
    pool.check()
    check_books(m)


def test_a_failed_write_into_a_hashed_block_leaves_it_unmatched():
    m = BlockManager(8, 4)
    pool = Pool(m)
    a = m.create("a")
    pool.write(a, [1, 2, 3, 4, 5, 6, 7, 8])
    m.shrink(a, 6)
    pool.fail(a, 2)  # the forward may have overwritten positions 6, 7 before failing
    assert a.length == 6 and len(a.block_ids) == 2
    b = m.create("b")
    assert m.adopt_prefix(b, [1, 2, 3, 4, 5, 6, 7, 8, 9], 8) == 4
    pool.check()
    check_books(m)


def test_a_shrunk_hashed_block_can_be_adopted_and_is_then_copied_by_its_writer():
    m = BlockManager(8, 4)
    pool = Pool(m)
    a = m.create("a")
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    pool.write(a, prompt)
    m.shrink(a, 6)  # block 1 still holds all of 5..8
    b = m.create("b")
    assert m.adopt_prefix(b, prompt + [9], 8) == 8 and b.block_ids == a.block_ids
    assert pool.read(b) == prompt
    plan = pool.write(a, [60])
    assert plan.copies == [(b.block_ids[1], a.block_ids[1])]
    assert pool.read(a) == [1, 2, 3, 4, 5, 6, 60] and pool.read(b) == prompt
    pool.check()
    check_books(m)


@pytest.mark.parametrize("order", list(itertools.permutations(["p", "c1", "c2"])))
@pytest.mark.parametrize("writes", [False, True])
def test_fork_then_release_in_any_order_leaks_nothing(order, writes):
    m = BlockManager(8, 4)
    p = written(m, "p", [1, 2, 3, 4, 5, 6])
    c1, c2 = m.fork(p, ["c1", "c2"])
    if writes:
        append(m, c1, [7, 8, 9])  # copies the shared partial block, adds one
        append(m, p, [10])  # still shared with c2: copies too
    check_books(m)
    freed = 0
    for cid in order:
        freed += m.release(cid)
        check_books(m)
    assert freed == (5 if writes else 2)
    assert_all_free(m)


# -- exhaustion with copy on write ---------------------------------------------------
def test_exhaustion_counts_the_copies_too_and_changes_nothing():
    m = BlockManager(4, 4)
    p = written(m, "p", [1, 2, 3, 4, 5, 6])
    (c,) = m.fork(p, ["c"])
    assert m.num_free == 2
    before = snapshot(m)
    with pytest.raises(KvCapacityExhausted):
        m.prepare_write(c, 6, 13)  # 2 added + 1 copy > 2 free
    assert snapshot(m) == before
    with pytest.raises(KvCapacityExhausted):
        m.prepare_write(p, 6, 13)
    assert snapshot(m) == before
    plan = m.prepare_write(c, 6, 9)  # 1 added + 1 copy: exactly fits
    assert len(plan.added) == 1 and len(plan.copies) == 1 and m.num_free == 0


def test_exhaustion_from_a_copy_alone():
    m = BlockManager(2, 4)
    p = written(m, "p", [1, 2, 3, 4, 5, 6])  # the whole pool
    (c,) = m.fork(p, ["c"])
    before = snapshot(m)
    with pytest.raises(KvCapacityExhausted):
        m.prepare_write(c, 6, 7)  # no block added, but one copy needed
    assert snapshot(m) == before


# -- idle expiry -----------------------------------------------------------------------
def test_expire_idle_releases_only_idle_sequences():
    m = BlockManager(16, 4)
    old = written(m, "old", [1, 2, 3, 4, 5])
    older = written(m, "older", [6, 7])
    fresh = written(m, "fresh", [8])
    old.last_used, older.last_used, fresh.last_used = 100.0, 50.0, 190.0
    assert sorted(m.expire_idle(30.0, now=200.0)) == ["old", "older"]
    assert m.expired_count == 2
    assert "old" not in m and "older" not in m and "fresh" in m
    assert m.num_used == 1 and m.get("fresh") is fresh
    for cid in ("old", "older"):
        with pytest.raises(CacheExpired) as info:
            m.get(cid)
        err = info.value
        assert isinstance(err, CacheNotFound)
        assert err.reason is Reason.CACHE_EXPIRED and err.code is grpc.StatusCode.NOT_FOUND
        assert cid in str(err)
    with pytest.raises(CacheExpired):
        m.release("old")
    with pytest.raises(CacheNotFound) as info:
        m.get("never")
    assert not isinstance(info.value, CacheExpired) and info.value.reason is Reason.CACHE_NOT_FOUND
    # nothing more is idle: a second sweep does nothing
    assert m.expire_idle(30.0, now=200.0) == [] and m.expired_count == 2
    assert m.expire_idle(30.0, now=250.0) == ["fresh"] and m.expired_count == 3
    assert_all_free(m)


def test_expire_idle_keeps_blocks_shared_with_a_live_sequence():
    m = BlockManager(8, 4)
    p = written(m, "p", [1, 2, 3, 4, 5, 6])
    (c,) = m.fork(p, ["c"])
    p.last_used, c.last_used = 0.0, 1000.0
    assert m.expire_idle(10.0, now=1000.0) == ["p"]
    assert c.block_ids == p.block_ids and refs(m, c) == [1, 1] and m.num_used == 2
    check_books(m)


def test_writes_and_shrinks_count_as_use():
    m = BlockManager(8, 4)
    a = written(m, "a", [1, 2])
    b = written(m, "b", [3, 4])
    idle = written(m, "idle", [5])
    a.last_used = b.last_used = idle.last_used = time.monotonic() - 1000
    append(m, a, [9])
    m.shrink(b, 1)
    assert m.expire_idle(100.0, now=time.monotonic() + 1) == ["idle"]
    assert "a" in m and "b" in m


# -- a random workload through the fake pool ---------------------------------------
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_workload_keeps_content_and_books_consistent(seed):
    rng = random.Random(seed)
    m = BlockManager(24, 2)
    pool = Pool(m)
    prompts = [[rng.randrange(3) for _ in range(rng.randint(1, 9))] for _ in range(5)]
    live: list[str] = []
    failures = 0
    for step in range(1200):
        op = rng.random()
        if op < 0.25 or not live:
            cid = f"s{step}"
            seq = m.create(cid)
            tokens = rng.choice(prompts) + [rng.randrange(3) for _ in range(rng.randint(0, 3))]
            hit = m.adopt_prefix(seq, tokens, len(tokens) - 1)
            assert hit % m.block_size == 0 and hit <= len(tokens) - 1
            assert pool.read(seq) == tokens[:hit], "adopted blocks hold other tokens"
            try:
                pool.write(seq, tokens[hit:])
            except KvCapacityExhausted:
                m.release(cid)
            else:
                live.append(cid)
        elif op < 0.55:
            seq = m.get(rng.choice(live))
            tokens = [rng.randrange(3) for _ in range(rng.randint(1, 5))]
            if rng.random() < 0.2:  # the forward fails after scribbling
                before = tables(m)
                try:
                    pool.fail(seq, len(tokens))
                except KvCapacityExhausted:
                    pass
                assert tables(m) == before
                failures += 1
            else:
                before = snapshot(m)
                try:
                    pool.write(seq, tokens)
                except KvCapacityExhausted:
                    assert snapshot(m) == before
        elif op < 0.7:
            seq = m.get(rng.choice(live))
            m.shrink(seq, rng.randint(0, seq.length))
        elif op < 0.8:
            seq = m.get(rng.choice(live))
            kids = [f"f{step}.{i}" for i in range(rng.randint(1, 2))]
            m.fork(seq, kids)
            live.extend(kids)
        else:
            cid = live.pop(rng.randrange(len(live)))
            used = m.num_used
            freed = m.release(cid)
            assert m.num_used == used - freed
        check_books(m)
        pool.check()
    assert m.hit_tokens > 0 and pool.copies > 0 and failures > 0, "the workload missed a feature"
    for cid in live:
        m.release(cid)
    assert_all_free(m)
