"""KV block bookkeeping: free list, per-sequence block tables, ref counts.

Plain Python with no torch, so it is tested on its own and never touches
device memory; the executor only turns the block ids it hands out into slot
indices of the preallocated pool.  Every mutating call either succeeds whole
or raises leaving the state exactly as it was.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ferrum_rpc.errors import CacheNotFound, KvCapacityExhausted


@dataclass
class SequenceState:
    cache_id: str
    length: int = 0
    block_ids: list[int] = field(default_factory=list)


class BlockManager:
    """Hands out fixed-size KV blocks from a pool that never grows.

    Args:
        num_blocks: blocks in the pool.
        block_size: tokens per block.
    """

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks
        self._seqs: dict[str, SequenceState] = {}

    # -- pool ---------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _take(self, n: int) -> list[int]:
        if n > len(self._free):
            raise KvCapacityExhausted(
                f"need {n} free KV blocks, {len(self._free)} of {self.num_blocks} free"
            )
        taken = [self._free.popleft() for _ in range(n)]
        for b in taken:
            self._refs[b] = 1
        return taken

    def _drop(self, blocks: list[int]) -> None:
        for b in blocks:
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free.append(b)

    # -- sequences ------------------------------------------------------------
    def __contains__(self, cache_id: str) -> bool:
        return cache_id in self._seqs

    def __len__(self) -> int:
        return len(self._seqs)

    def get(self, cache_id: str) -> SequenceState:
        try:
            return self._seqs[cache_id]
        except KeyError:
            raise CacheNotFound(f"no KV cache with id {cache_id!r}") from None

    def create(self, cache_id: str) -> SequenceState:
        if cache_id in self._seqs:
            raise ValueError(f"duplicate cache id {cache_id!r}")
        seq = self._seqs[cache_id] = SequenceState(cache_id)
        return seq

    def grow(self, seq: SequenceState, new_length: int) -> list[int]:
        """Makes room for ``new_length`` tokens; returns the newly added blocks.

        The sequence's ``length`` is not changed: the caller commits it after
        the forward succeeds, or calls :meth:`shrink` to undo.
        """
        need = self.blocks_for(new_length) - len(seq.block_ids)
        added = self._take(need) if need > 0 else []
        seq.block_ids.extend(added)
        return added

    def shrink(self, seq: SequenceState, new_length: int) -> int:
        """Sets the length to ``new_length`` and frees blocks past it; returns blocks freed."""
        keep = self.blocks_for(new_length)
        dropped = seq.block_ids[keep:]
        del seq.block_ids[keep:]
        self._drop(dropped)
        seq.length = new_length
        return len(dropped)

    def release(self, cache_id: str) -> int:
        """Forgets a sequence and frees its blocks; returns how many were freed."""
        seq = self.get(cache_id)
        del self._seqs[cache_id]
        self._drop(seq.block_ids)
        return len(seq.block_ids)

    def slots(self, seq: SequenceState, start: int, end: int) -> list[int]:
        """Pool slot index of each token position in [start, end)."""
        bs = self.block_size
        ids = seq.block_ids
        return [ids[p // bs] * bs + p % bs for p in range(start, end)]
