"""The block manager across a weights version: a sequence begun under older weights
publishes no prefix-cache block under newer ones, whichever way its blocks complete
(appending, after a shrink, in a fork), while sequences begun under the new weights do."""

from __future__ import annotations

from ferrum_rpc.server.kv.blocks import BlockManager, SequenceState

BS = 4


def append(m: BlockManager, seq: SequenceState, tokens: list[int]) -> None:
    start = seq.length
    m.prepare_write(seq, start, start + len(tokens))
    m.commit(seq, start, tokens)


def hits(m: BlockManager, tokens: list[int]) -> int:
    probe = m.create("probe")
    try:
        return m.adopt_prefix(probe, tokens, len(tokens))
    finally:
        m.release("probe")


def test_a_block_completed_after_the_version_changed_is_not_published():
    m = BlockManager(16, BS)
    old = m.create("old")
    append(m, old, [1, 2])
    m.start_generation(1)
    append(m, old, [3, 4, 5, 6, 7, 8])
    assert old.generation == 0 and not m.is_current(old) and len(old.hashes) == 2
    assert hits(m, [1, 2, 3, 4, 5, 6, 7, 8, 9]) == 0 and not m.cached_blocks("")


def test_a_fork_of_an_old_sequence_is_old_and_a_new_sequence_is_published():
    m = BlockManager(16, BS)
    old = m.create("old")
    append(m, old, [1, 2])
    m.start_generation(1)
    (child,) = m.fork(old, ["child"])
    append(m, child, [3, 4])
    assert child.generation == 0 and hits(m, [1, 2, 3, 4, 5]) == 0
    new = m.create("new")
    append(m, new, [1, 2, 3, 4])
    assert new.generation == 1 and hits(m, [1, 2, 3, 4, 5]) == BS


def test_shrinking_into_the_first_block_keeps_the_old_version_and_to_nothing_drops_it():
    m = BlockManager(16, BS)
    seq = m.create("s")
    append(m, seq, [1, 2, 3, 4, 5, 6])
    m.start_generation(1)
    m.shrink(seq, 2)
    append(m, seq, [7, 8])
    assert hits(m, [1, 2, 7, 8, 9]) == 0
    m.shrink(seq, 0)  # no KV of the old weights is left
    append(m, seq, [1, 2, 7, 8])
    assert seq.generation == 1 and hits(m, [1, 2, 7, 8, 9]) == BS
