"""The preallocated KV pool on the executor's device, and its per-forward view.

The pool is allocated once at start-up and never grows.  Each forward gets a
``KvBatch`` that knows where the new tokens go (slot indices) and which
blocks hold each sequence's context; attention calls ``update`` per layer.
"""

from __future__ import annotations

import torch


class KvPool:
    """K and V for every layer: (layers, blocks, block_size, kv_heads, head_dim)."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int,
                 num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        # One extra block at the end takes the writes of padded tokens in ragged batches.
        shape = (num_layers, num_blocks + 1, block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.block_size = block_size
        self.scratch_block = num_blocks

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copies the KV of block ``src`` into block ``dst`` for every layer (copy on write)."""
        if pairs:
            src = torch.tensor([p[0] for p in pairs], device=self.k.device)
            dst = torch.tensor([p[1] for p in pairs], device=self.k.device)
            self.k[:, dst] = self.k[:, src]
            self.v[:, dst] = self.v[:, src]

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def batch(self, block_tables: list[list[int]], starts: list[int], counts: list[int]) -> KvBatch:
        """A view for B sequences, sequence b appending ``counts[b]`` tokens after ``starts[b]``.

        ``block_tables[b]`` must already cover ``starts[b] + counts[b]`` tokens.
        """
        return KvBatch(self, block_tables, starts, counts)


class KvBatch:
    """One forward's view of the pool: where new tokens go and what each sequence sees.

    Sequences shorter than the longest in a ragged batch are padded; padded
    positions repeat the sequence's last real position (so they see valid keys
    and produce finite, ignored outputs) and write into a scratch block that no
    block table contains.
    """

    def __init__(self, pool: KvPool, block_tables: list[list[int]], starts: list[int], counts: list[int]):
        device, bs = pool.k.device, pool.block_size
        self.pool = pool
        # analysis: decoder layer -> its attention weights (B, H, T, S) float32, filled by the
        # forward for the layers asked (which then runs the eager attention path)
        self.attention: dict[int, torch.Tensor | None] | None = None
        width = max(len(t) for t in block_tables)
        tables = torch.tensor([t + [0] * (width - len(t)) for t in block_tables], device=device)
        self.tables = tables  # (B, nb) block ids, padded with block 0 (masked / never reached)
        self.flat_tables = tables.reshape(-1)  # (B*nb,): padded with block 0, masked below
        T = max(counts)
        start = torch.tensor(starts, device=device).unsqueeze(1)  # (B, 1)
        count = torch.tensor(counts, device=device).unsqueeze(1)  # (B, 1)
        offset = torch.arange(T, device=device)  # (T,)
        real = offset < count  # (B, T)
        pos = start + torch.minimum(offset, count - 1)  # (B, T) absolute positions, padding clamped
        self.positions = pos
        slots = tables.gather(1, pos // bs) * bs + pos % bs
        scratch = pool.scratch_block * bs  # padded tokens' keys/values land here, unseen
        self.write_slots = torch.where(real, slots, scratch).reshape(-1)  # (B*T,)
        keys = torch.arange(width * bs, device=device)  # (S,)
        # Query at absolute position p sees keys 0..p of its own sequence.
        self.mask = (keys.view(1, 1, -1) <= pos.unsqueeze(-1)).unsqueeze(1)  # (B, 1, T, S)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Writes k, v (B, T, Hkv, D) and returns the context (B, Hkv, S, D) each."""
        B, _, H, D = k.shape
        out = []
        for pool, new in ((self.pool.k[layer], k), (self.pool.v[layer], v)):
            pool.view(-1, H, D).index_copy_(0, self.write_slots, new.reshape(-1, H, D))
            ctx = pool.index_select(0, self.flat_tables)  # (B*nb, bs, Hkv, D); 6x faster than pool[tables]
            out.append(ctx.view(B, -1, H, D).transpose(1, 2))
        return out[0], out[1]


class RaggedBatch:
    """One forward over steps of different lengths, without padding them to one width.

    Steps of equal length form a group with its own padded-free ``KvBatch``
    (all decodes, one group; each prompt chunk, its own).  The model runs
    embeddings, norms, projections and MLPs over every group's tokens as one
    (1, N) row of tokens, and attention per group (see ``Attention.forward``):
    a unified step of 32 decodes and a 200-token prompt chunk costs the
    linears of 232 tokens, not 33 rows padded to 200.
    """

    def __init__(self, pool: KvPool, groups: list[tuple[list[list[int]], list[int], int]]):
        """``groups``: per group, the block tables and start positions of its
        sequences and the tokens each appends; tokens are laid out group after
        group, each group sequence-major."""
        self.groups: list[tuple[KvBatch, int, int, int]] = []  # (kv, batch, width, first row)
        row = 0
        for tables, starts, width in groups:
            kv = KvBatch(pool, tables, starts, [width] * len(tables))
            self.groups.append((kv, len(tables), width, row))
            row += len(tables) * width
        self.tokens = row
