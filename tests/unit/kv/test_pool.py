"""KvBatch's index tensors: a single decode step's (built from lists) equal what the
general path (numpy, any batch) gives the same sequence, and a batch moved on in
place (``next_position``) equals one built at the next position."""

from __future__ import annotations

import pytest
import torch

from ferrum_rpc.server.kv.pool import KvPool


@pytest.mark.parametrize("table,start", [([3], 0), ([3], 15), ([3, 7], 16), ([5, 2, 9, 1], 50), ([0, 4], 31)])
def test_one_decode_step_indexes_as_the_general_path(table, start):
    pool = KvPool(1, 10, 16, 1, 4, torch.float32, torch.device("cpu"))
    one = pool.batch([table], [start], [1])
    both = pool.batch([table, table], [start, start], [1, 1])  # two rows: the general path
    for name in ("tables", "positions", "write_slots"):
        got, want = getattr(one, name), getattr(both, name)[:1]
        assert got.dtype == want.dtype == torch.int64 and torch.equal(got, want), name
    assert one.write_slots.tolist() == [table[start // 16] * 16 + start % 16]


@pytest.mark.parametrize("rows", [1, 3])
def test_next_position_indexes_as_a_fresh_batch_at_the_next_position(rows):
    pool = KvPool(1, 10, 16, 1, 4, torch.float32, torch.device("cpu"))
    tables, starts = [[5, 2, 9, 1], [3], [0, 4]][:rows], [50, 1, 16][:rows]
    moving = pool.batch(tables, starts, [1] * rows)
    assert moving.mask.shape[-1] == 64  # built once at the first position, dropped when the batch moves on
    for step in range(1, 10):  # the rows stay inside their blocks (50 + 9 < 64, 1 + 9 < 16, 16 + 9 < 32)
        moving.next_position()
        fresh = pool.batch(tables, [s + step for s in starts], [1] * rows)
        for name in ("tables", "positions", "write_slots", "mask"):
            assert torch.equal(getattr(moving, name), getattr(fresh, name)), (name, step)
