"""The preallocated KV pool on the executor's device, and its per-forward view.

The pool is allocated once at start-up and never grows.  Each forward gets a
``KvBatch`` that knows where the new tokens go (slot indices) and which
blocks hold each sequence's context; attention calls ``update`` per layer.
"""

from __future__ import annotations

import numpy as np
import torch

# --kv-dtype's names as the pool's element types; int8 is quantized (see ``quantize_rows``)
KV_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8}
# An int8 pool's rows are quantized in blocks of SCALE_BLOCK values (llama.cpp's q8_0),
# each block's scale stored as SCALE_DTYPE beside the values, for K and for V
SCALE_BLOCK = 32
SCALE_DTYPE = torch.float16
# what the KV fingerprint's layout says of an int8 pool's scales: an export of another
# layout (one float32 scale a row, before these blocks) is refused, not misread
SCALES_LAYOUT = f"kv_scales={str(SCALE_DTYPE).removeprefix('torch.')}/{SCALE_BLOCK}"


def scale_blocks(head_dim: int) -> int:
    """Scales an int8 pool holds a row of ``head_dim`` values: blocks of SCALE_BLOCK from
    the row's start, the last one shorter where head_dim is no multiple of it (one
    block, the whole row, where head_dim <= SCALE_BLOCK)."""
    return -(-head_dim // SCALE_BLOCK)


def _blocks(x: torch.Tensor) -> torch.Tensor:
    """x (..., D) float32 -> (..., scale_blocks(D), SCALE_BLOCK), a shorter last block
    padded with zeros (which change no block's absolute maximum)."""
    D = x.shape[-1]
    nb = scale_blocks(D)
    if nb * SCALE_BLOCK != D:
        x = torch.nn.functional.pad(x, (0, nb * SCALE_BLOCK - D))
    return x.unflatten(-1, (nb, SCALE_BLOCK))


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., D) -> int8 values (..., D) and SCALE_DTYPE scales (..., scale_blocks(D)):
    symmetric, each block of a row (a token's one kv head) by its own absolute maximum,
    scale = absmax / 127 rounded to SCALE_DTYPE (to nearest even) and value = round(x /
    scale) by that stored scale (to nearest even) clamped to +-127, so a row's bits
    depend on that row alone.  A zero block has scale 0 and values 0; a block with a NaN
    or an infinity keeps a non-finite scale and values 0 (what it reads back is not
    finite).  The fused op's writer (csrc/attention.cpp, ``quantize_row``) computes the
    same bits."""
    D = x.shape[-1]
    blocks = _blocks(x.float())  # (..., nb, 32)
    scale = (blocks.abs().amax(-1) / 127).to(SCALE_DTYPE)
    s = scale.float().unsqueeze(-1)
    ok = s.isfinite() & (s > 0)
    values = torch.where(ok, blocks / torch.where(ok, s, 1), 0).round_().clamp_(-127, 127)
    return values.to(torch.int8).flatten(-2)[..., :D], scale


def quantize_query(q: torch.Tensor) -> torch.Tensor:
    """The query (..., D) as an int8 pool's scores take it: where D is a multiple of
    SCALE_BLOCK, the fused attention scores integer dot products of the key rows and the
    query quantized as a row is (blocks of SCALE_BLOCK, value = round(q / scale) to
    nearest even clamped to +-127) but with a float32 scale, absmax / 127
    (csrc/attention_loops.inc ``quantize_query``); returns those values times their
    scale in q's dtype, for the eager paths to attend with.  Other head dims: q.  A
    block with a NaN gives NaN."""
    if q.shape[-1] % SCALE_BLOCK:
        return q
    blocks = q.float().unflatten(-1, (-1, SCALE_BLOCK))
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    ok = scale.isfinite() & (scale > 0)
    values = torch.where(ok, blocks / torch.where(ok, scale, 1), 0).round_().clamp_(-127, 127)
    nan = blocks.isnan().any(-1, keepdim=True)
    return torch.where(nan, float("nan"), values * scale).flatten(-2).to(q.dtype)


def dequantize_rows(values: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 values (..., D) and their scales (..., scale_blocks(D)) -> each value times its
    block's scale in ``dtype`` (the product in float32)."""
    D = values.shape[-1]
    return (_blocks(values.float()) * scale.float().unsqueeze(-1)).flatten(-2)[..., :D].to(dtype)


class KvPool:
    """K and V for every layer: (layers, blocks, block_size, kv_heads, head_dim).

    An int8 pool (``dtype`` torch.int8, --kv-dtype int8) holds each key and value row
    quantized (``quantize_rows``) with its blocks' scales beside it in ``k_scale`` /
    ``v_scale`` (layers, blocks, block_size, kv_heads, scale_blocks(head_dim)) float16: 1
    byte a value and 2 a block of 32, where bfloat16 holds 2 a value.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int,
                 num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        # One extra block at the end takes the writes of padded tokens in ragged batches.
        shape = (num_layers, num_blocks + 1, block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.quantized = dtype == torch.int8
        self.k_scale = self.v_scale = None
        if self.quantized:
            scales = (*shape[:-1], scale_blocks(head_dim))
            self.k_scale = torch.zeros(scales, dtype=SCALE_DTYPE, device=device)
            self.v_scale = torch.zeros(scales, dtype=SCALE_DTYPE, device=device)
        self.block_size = block_size
        self.scratch_block = num_blocks
        self.layers = list(zip(self.k.unbind(0), self.v.unbind(0)))  # per layer (K, V) views, made once

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of the pool, shaped (layers, blocks, block_size, ...): K, V, and an
        int8 pool's scales.  What moves a block (copy on write) or a token (export,
        import) moves each of them."""
        return [self.k, self.v] + ([self.k_scale, self.v_scale] if self.quantized else [])

    def scales(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """One layer's (K, V) scales (blocks, block_size, kv_heads, scale_blocks), or (None, None)."""
        return (self.k_scale[layer], self.v_scale[layer]) if self.quantized else (None, None)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copies the KV of block ``src`` into block ``dst`` for every layer (copy on write),
        an int8 pool's scales with its values."""
        if pairs:
            src = torch.tensor([p[0] for p in pairs], device=self.k.device)
            dst = torch.tensor([p[1] for p in pairs], device=self.k.device)
            for t in self.tensors():
                t[:, dst] = t[:, src]

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """K and V of one token in every layer, an int8 pool's scales included."""
        row = head_dim * torch.empty((), dtype=dtype).element_size()
        if dtype == torch.int8:
            row += scale_blocks(head_dim) * torch.empty((), dtype=SCALE_DTYPE).element_size()
        return 2 * num_layers * num_kv_heads * row

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

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
        # The index arithmetic runs in numpy: a decode step's tensors are a few
        # elements, and each torch op costs microseconds, several times more right after
        # the layers have streamed their weights through the caches.
        if len(block_tables) == 1 and counts[0] == 1:  # one decode step: one tensor from a list, three views
            (table,), (start,) = block_tables, starts
            n = len(table)
            packed = torch.tensor([*table, start, table[start // bs] * bs + start % bs], dtype=torch.int64,
                                  device=device)
            self.tables, self.positions = packed[:n].view(1, n), packed[n:n + 1].view(1, 1)
            self.write_slots = packed[n + 1:]
            self._mask, self._moving = None, packed[n:]  # position and write slot, one in-place add
            return
        width = max(len(t) for t in block_tables)
        tables = np.zeros((len(block_tables), width), dtype=np.int64)
        for b, t in enumerate(block_tables):
            tables[b, :len(t)] = t
        T = max(counts)
        start = np.asarray(starts, dtype=np.int64)[:, None]  # (B, 1)
        count = np.asarray(counts, dtype=np.int64)[:, None]  # (B, 1)
        offset = np.arange(T, dtype=np.int64)  # (T,)
        pos = start + np.minimum(offset, count - 1)  # (B, T) absolute positions, padding clamped
        slots = np.take_along_axis(tables, pos // bs, 1) * bs + pos % bs
        scratch = pool.scratch_block * bs  # padded tokens' keys/values land here, unseen
        write_slots = np.where(offset < count, slots, scratch).reshape(-1)  # (B*T,)
        self.tables = torch.from_numpy(tables).to(device)  # (B, nb) block ids, padded with block 0 (masked / never reached)
        self.positions = torch.from_numpy(pos).to(device)
        self.write_slots = torch.from_numpy(write_slots).to(device)
        self._mask: torch.Tensor | None = None
        self._moving: torch.Tensor | None = None

    @classmethod
    def static(cls, pool: KvPool, tables: torch.Tensor, positions: torch.Tensor, write_slots: torch.Tensor) -> KvBatch:
        """A one-token-a-sequence view over tensors the caller fills before each use
        (tables (B, nb), positions (B, 1), write_slots (B,) on the pool's device): what a
        captured CUDA graph of a decode step reads (see ``engine/graphs.py``)."""
        kv = cls.__new__(cls)
        kv.pool, kv.attention, kv._mask, kv._moving = pool, None, None, None
        kv.tables, kv.positions, kv.write_slots = tables, positions, write_slots
        return kv

    def next_position(self) -> None:
        """Moves one-token steps (T = 1) on to each sequence's next position, writing the
        next slot of the same block: the caller keeps every step inside the block its
        table already holds (the tables are not redone)."""
        if self._moving is not None:
            self._moving += 1
        else:
            self.positions += 1
            self.write_slots += 1
        self._mask = None

    @property
    def flat_tables(self) -> torch.Tensor:
        """(B*nb,) block ids: padded with block 0, masked (see ``mask``)."""
        return self.tables.reshape(-1)

    @property
    def mask(self) -> torch.Tensor:
        """(B, 1, T, S): a query at absolute position p sees keys 0..p of its own
        sequence (built when an eager attention asks; the fused ops need none)."""
        if self._mask is None:
            keys = torch.arange(self.tables.shape[1] * self.pool.block_size, device=self.tables.device)  # (S,)
            self._mask = (keys.view(1, 1, -1) <= self.positions.unsqueeze(-1)).unsqueeze(1)
        return self._mask

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Writes k, v (B, T, Hkv, D) and returns the context (B, Hkv, S, D) each, in k's dtype
        (a bfloat16 pool under float32 activations: each value rounded once, as written)."""
        B, _, H, D = k.shape
        if self.pool.quantized:
            return self._update_quantized(layer, k, v)
        out = []
        for pool, new in ((self.pool.k[layer], k), (self.pool.v[layer], v)):
            pool.view(-1, H, D).index_copy_(0, self.write_slots, new.reshape(-1, H, D).to(pool.dtype))
            ctx = pool.index_select(0, self.flat_tables)  # (B*nb, bs, Hkv, D); one gather, cheaper than pool[tables]
            out.append(ctx.view(B, -1, H, D).transpose(1, 2).to(k.dtype))
        return out[0], out[1]

    def _update_quantized(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``update`` on an int8 pool: each new row quantized on its own and written with
        its scale; the context gathered as int8 and scales, then dequantized (its blocks
        only, never the whole pool)."""
        B, _, H, D = k.shape
        out = []
        for pool, scales, new in ((self.pool.k[layer], self.pool.k_scale[layer], k),
                                  (self.pool.v[layer], self.pool.v_scale[layer], v)):
            values, scale = quantize_rows(new.reshape(-1, H, D))  # (B*T, Hkv, D), (B*T, Hkv, nb)
            pool.view(-1, H, D).index_copy_(0, self.write_slots, values)
            scales.view(-1, *scale.shape[1:]).index_copy_(0, self.write_slots, scale)
            ctx = pool.index_select(0, self.flat_tables)  # (B*nb, bs, Hkv, D) int8
            ctx_scale = scales.index_select(0, self.flat_tables)  # (B*nb, bs, Hkv, scale blocks)
            out.append(dequantize_rows(ctx, ctx_scale, k.dtype).view(B, -1, H, D).transpose(1, 2))
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

    ragged = True  # what the model's attention asks of its cache object (it imports no KV type)

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
