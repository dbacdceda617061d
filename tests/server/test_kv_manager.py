"""The torch-free KV block manager on its own: no model, no device memory."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ferrum_rpc.errors import CacheNotFound, KvCapacityExhausted
from ferrum_rpc.server.kv_manager import BlockManager


def snapshot(m: BlockManager) -> tuple:
    """Everything observable about the manager (plus its ref counts)."""
    seqs = {cid: (m.get(cid).length, tuple(m.get(cid).block_ids)) for cid in list(m._seqs)}
    return m.num_free, m.num_used, len(m), seqs, tuple(m._refs), tuple(m._free)


def test_module_does_not_import_torch():
    code = (
        "import sys; import ferrum_rpc.server.kv_manager; "
        "assert 'torch' not in sys.modules, 'kv_manager pulled in torch'"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("num_blocks, block_size", [(0, 4), (4, 0), (-1, 4)])
def test_rejects_empty_pool(num_blocks, block_size):
    with pytest.raises(ValueError):
        BlockManager(num_blocks, block_size)


def test_fresh_pool_is_all_free():
    m = BlockManager(8, 4)
    assert (m.num_blocks, m.block_size, m.num_free, m.num_used, len(m)) == (8, 4, 8, 0, 0)


@pytest.mark.parametrize("tokens, blocks", [(0, 0), (1, 1), (4, 1), (5, 2), (8, 2), (9, 3)])
def test_blocks_for_rounds_up(tokens, blocks):
    assert BlockManager(16, 4).blocks_for(tokens) == blocks


def test_create_get_contains_and_duplicate():
    m = BlockManager(8, 4)
    seq = m.create("a")
    assert "a" in m and "b" not in m and len(m) == 1
    assert m.get("a") is seq and seq.length == 0 and seq.block_ids == []
    with pytest.raises(ValueError):
        m.create("a")
    assert len(m) == 1 and m.get("a") is seq


def test_get_unknown_raises_cache_not_found():
    m = BlockManager(8, 4)
    with pytest.raises(CacheNotFound) as info:
        m.get("nope")
    assert "nope" in str(info.value)


def test_grow_allocates_only_missing_blocks_and_leaves_length_alone():
    m = BlockManager(8, 4)
    seq = m.create("a")
    added = m.grow(seq, 5)  # 5 tokens -> 2 blocks
    assert len(added) == 2 and seq.block_ids == added
    assert seq.length == 0, "grow must not commit the length"
    assert (m.num_free, m.num_used) == (6, 2)
    seq.length = 5
    assert m.grow(seq, 8) == []  # still fits in 2 blocks
    assert len(seq.block_ids) == 2 and m.num_free == 6
    more = m.grow(seq, 9)  # crosses into a 3rd block
    assert len(more) == 1 and seq.block_ids == added + more
    assert m.num_used == 3
    assert len(set(seq.block_ids)) == 3, "a block handed out twice"


def test_sequences_get_disjoint_blocks():
    m = BlockManager(10, 2)
    seqs = [m.create(str(i)) for i in range(5)]
    for s in seqs:
        m.grow(s, 4)
    ids = [b for s in seqs for b in s.block_ids]
    assert sorted(ids) == list(range(10))
    assert m.num_free == 0


def test_slots_map_positions_through_the_block_table():
    m = BlockManager(8, 4)
    filler = m.create("filler")
    m.grow(filler, 4)  # takes block 0, so "a" gets non-trivial ids
    seq = m.create("a")
    m.grow(seq, 10)
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
    seq = m.create("a")
    first = m.grow(seq, 12)
    seq.length = 12
    assert m.shrink(seq, 5) == 1
    assert seq.length == 5 and seq.block_ids == first[:2]
    assert m.num_used == 2 and first[2] in m._free
    assert m.shrink(seq, 4) == 1 and seq.block_ids == first[:1] and seq.length == 4
    assert m.shrink(seq, 4) == 0  # no-op
    assert m.shrink(seq, 0) == 1 and seq.block_ids == [] and seq.length == 0
    assert m.num_free == 8


def test_release_frees_everything_and_forgets_the_sequence():
    m = BlockManager(8, 4)
    seq = m.create("a")
    m.grow(seq, 9)
    assert m.release("a") == 3
    assert "a" not in m and len(m) == 0 and m.num_free == 8
    with pytest.raises(CacheNotFound):
        m.release("a")
    assert m.num_free == 8


def test_release_of_an_empty_sequence():
    m = BlockManager(4, 4)
    m.create("a")
    assert m.release("a") == 0 and m.num_free == 4 and len(m) == 0


def test_exhaustion_raises_and_changes_nothing():
    m = BlockManager(4, 4)
    a = m.create("a")
    m.grow(a, 12)  # 3 of 4 blocks
    a.length = 12
    b = m.create("b")
    before = snapshot(m)
    with pytest.raises(KvCapacityExhausted) as info:
        m.grow(b, 8)  # needs 2, 1 free
    assert info.value.reason.value == "KV_CAPACITY_EXHAUSTED"
    assert snapshot(m) == before
    with pytest.raises(KvCapacityExhausted):
        m.grow(a, 20)  # a needs 2 more
    assert snapshot(m) == before
    assert a.length == 12 and len(a.block_ids) == 3 and b.block_ids == []
    # exactly what is left still fits
    assert len(m.grow(b, 4)) == 1 and m.num_free == 0


def test_exhaustion_when_a_request_exceeds_the_whole_pool():
    m = BlockManager(2, 4)
    seq = m.create("a")
    with pytest.raises(KvCapacityExhausted):
        m.grow(seq, 9)
    assert m.num_free == 2 and seq.block_ids == []


def test_released_blocks_are_reused():
    m = BlockManager(3, 2)
    a = m.create("a")
    m.grow(a, 6)
    with pytest.raises(KvCapacityExhausted):
        m.grow(m.create("b"), 1)
    m.release("a")
    b = m.get("b")
    assert len(m.grow(b, 6)) == 3 and m.num_free == 0


def test_no_leaks_after_a_random_workload():
    import random

    rng = random.Random(1234)
    m = BlockManager(32, 4)
    live: dict[str, int] = {}
    for step in range(2000):
        op = rng.random()
        if op < 0.3 or not live:
            cid = f"s{step}"
            seq = m.create(cid)
            n = rng.randint(1, 20)
            try:
                m.grow(seq, n)
            except KvCapacityExhausted:
                m.release(cid)
                continue
            seq.length = n  # committed, as the executor does after a forward
            live[cid] = n
        elif op < 0.6:
            cid = rng.choice(sorted(live))
            seq = m.get(cid)
            n = seq.length + rng.randint(1, 10)
            before = list(seq.block_ids)
            try:
                m.grow(seq, n)
            except KvCapacityExhausted:
                assert seq.block_ids == before
            else:
                seq.length = n
        elif op < 0.8:
            cid = rng.choice(sorted(live))
            seq = m.get(cid)
            m.shrink(seq, rng.randint(0, seq.length))
        else:
            cid = rng.choice(sorted(live))
            m.release(cid)
            del live[cid]
        held = [b for cid in live for b in m.get(cid).block_ids]
        for cid in live:
            assert len(m.get(cid).block_ids) == m.blocks_for(m.get(cid).length)
        assert len(held) == len(set(held)), "a block is owned twice"
        assert m.num_used == len(held)
        assert set(held).isdisjoint(m._free)
    for cid in list(live):
        m.release(cid)
    assert m.num_free == m.num_blocks and m.num_used == 0 and len(m) == 0
    assert sorted(m._free) == list(range(m.num_blocks))
    assert all(r == 0 for r in m._refs)


def test_ref_counts_track_ownership():
    m = BlockManager(6, 2)
    a = m.create("a")
    m.grow(a, 4)
    assert [m._refs[b] for b in a.block_ids] == [1, 1]
    assert sum(m._refs) == 2
    m.shrink(a, 2)
    assert sum(m._refs) == 1 and m._refs[a.block_ids[0]] == 1
    m.release("a")
    assert sum(m._refs) == 0


def test_shared_block_is_freed_only_by_its_last_owner():
    """A prefix block held by two sequences (ref count 2) survives one release.

    BlockManager has no public sharing call yet, so the second owner is set up
    by hand the way a prefix-sharing fork would.
    """
    m = BlockManager(4, 2)
    a = m.create("a")
    m.grow(a, 4)
    a.length = 4
    shared = a.block_ids[0]
    b = m.create("b")
    b.block_ids.append(shared)
    m._refs[shared] += 1
    b.length = 2
    assert m.release("a") == 2
    assert shared not in m._free and m._refs[shared] == 1
    assert m.num_used == 1
    assert m.release("b") == 1
    assert shared in m._free and m.num_free == 4 and m._refs[shared] == 0
