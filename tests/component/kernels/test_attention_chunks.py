"""The fused paged attention's fixed arithmetic (csrc/attention_tasks.cpp): a query's
keys in chunks of 256, so its bits are the same alone, in a block of prompt queries,
as a decode step, in a batch, on 1 or 2 threads, and close to a float64 reference,
at context lengths around the chunk boundaries; over an int8 pool, each row read as its
values times its blocks' scales, and where rows are whole blocks of 32, the scores taken
as integer dot products of the query quantized the same way (q8_0)."""

import pytest
import torch

from ferrum_rpc.server.kernels import fused
from ferrum_rpc.server.kv.pool import SCALE_DTYPE, dequantize_rows, quantize_query, scale_blocks

H, HKV, BS, SCALE = 6, 2, 16, 0.3
LENGTHS = (1, 8, 255, 256, 257, 512, 513, 520)


@pytest.fixture(scope="module")
def ops():
    ok, why = fused.probe_fused(torch.float32)
    assert ok, f"the fused ops should build and agree on this machine: {why}"
    return torch.ops.ferrum_fused


class Sequence:
    """One sequence's K and V in shuffled pool blocks, written by a prompt's fused op
    (an int8 pool: float32 activations, the rows quantized as written)."""

    def __init__(self, length: int, dim: int, dtype: torch.dtype, seed: int):
        gen = torch.Generator().manual_seed(seed)
        self.n, self.dim, self.dtype = length, dim, dtype
        blocks = (length + BS - 1) // BS
        self.scales: tuple[torch.Tensor, ...] = ()
        if dtype == torch.int8:  # unwritten slots: NaN scales
            self.k_cache = torch.zeros((blocks + 2, BS, HKV, dim), dtype=dtype)
            self.scales = tuple(torch.full((blocks + 2, BS, HKV, scale_blocks(dim)), float("nan"), dtype=SCALE_DTYPE)
                                for _ in range(2))
            dtype = torch.float32
        else:
            self.k_cache = torch.full((blocks + 2, BS, HKV, dim), float("nan"), dtype=dtype)  # unwritten slots: NaN
        self.v_cache = self.k_cache.clone()
        self.table = torch.randperm(blocks + 2, generator=gen)[:blocks]
        self.q = torch.randn(length, H, dim, generator=gen).to(dtype)
        self.k = torch.randn(length, HKV, dim, generator=gen).to(dtype)
        self.v = torch.randn(length, HKV, dim, generator=gen).to(dtype)
        # no rotation (cos 1, sin 0): the reference is plain attention
        self.cos, self.sin = torch.ones(max(LENGTHS), dim), torch.zeros(max(LENGTHS), dim)

    def slots(self, positions: torch.Tensor) -> torch.Tensor:
        return self.table[positions // BS] * BS + positions % BS

    def run(self, start: int, stop: int) -> torch.Tensor:
        """Queries start..stop-1 as one forward (B 1, T stop - start): (T, H * D)."""
        pos = torch.arange(start, stop)
        return torch.ops.ferrum_fused.paged_attention(
            self.q[None, start:stop], self.k[None, start:stop], self.v[None, start:stop], self.cos, self.sin,
            pos[None], self.k_cache, self.v_cache, self.slots(pos), self.table[None], SCALE, *self.scales)[0]

    def reference(self, p: int, quantized_query: bool = True) -> torch.Tensor:
        """Query p in float64 (over an int8 pool: keys and values as the pool holds them,
        dequantized, and where the rows are whole blocks of 32 and ``quantized_query``,
        the query as the integer scores quantize it): (H * D)."""
        q, k, v = self.q[p].double(), self.k[:p + 1].double(), self.v[:p + 1].double()
        if self.scales and self.dim % 32 == 0 and quantized_query:
            q = quantize_query(self.q[p]).double()  # kv/pool.py's, the eager paths' query
        if self.scales:
            slots = self.slots(torch.arange(p + 1))
            k, v = (dequantize_rows(c.flatten(0, 1)[slots], s.flatten(0, 1)[slots], torch.float64)
                    for c, s in zip((self.k_cache, self.v_cache), self.scales))
        k, v = k.repeat_interleave(H // HKV, dim=1), v.repeat_interleave(H // HKV, dim=1)  # (n, H, D)
        w = torch.softmax(torch.einsum("hd,nhd->hn", q, k) * SCALE, dim=-1)
        return torch.einsum("hn,nhd->hd", w, v).reshape(-1)


def batch_run(seqs: list[Sequence], positions: list[int]) -> torch.Tensor:
    """A decode step of several sequences (one query each) in one forward: (B, H * D);
    int8 pools' scales concatenated as their values are."""
    nb = max(len(s.table) for s in seqs)
    base, tables, slots = 0, [], []
    for s, p in zip(seqs, positions):
        t = s.table + base
        tables.append(torch.cat([t, t[:1].repeat(nb - len(t))]))
        slots.append(s.slots(torch.tensor([p])) + base * BS)
        base += s.k_cache.shape[0]
    pick = lambda x: torch.stack([s.__dict__[x][p] for s, p in zip(seqs, positions)])[:, None]  # noqa: E731
    cat = lambda x: torch.cat([getattr(s, x) for s in seqs])  # noqa: E731
    scales = [torch.cat([s.scales[i] for s in seqs]) for i in range(2)] if seqs[0].scales else []
    return torch.ops.ferrum_fused.paged_attention(
        pick("q"), pick("k"), pick("v"), seqs[0].cos, seqs[0].sin, torch.tensor(positions)[:, None], cat("k_cache"),
        cat("v_cache"), torch.cat(slots), torch.stack(tables), SCALE, *scales)[:, 0]


# 16: the vector loops where the ISA has them (64 and 32: the AVX-512 loops' two value
# widths too); 12: the portable ones
@pytest.mark.parametrize("dim", [16, 64, 32, 12])
def test_a_query_has_the_same_bits_in_a_prompt_alone_in_a_batch_and_on_any_threads(ops, isa, dim):
    if dim % 8 and isa != "avx2":
        pytest.skip("a head dim that is no multiple of 8 runs the portable loops on any ISA: once is enough")
    seq = Sequence(max(LENGTHS), dim, torch.float32, seed=dim)
    prompt = seq.run(0, seq.n)  # every query in blocks of consecutive queries
    for p in LENGTHS:
        want = seq.reference(p - 1)
        assert (prompt[p - 1].double() - want).abs().max() <= 2e-6 * want.abs().max() + 1e-6, p
    chunked = torch.cat([seq.run(0, 300), seq.run(300, seq.n)])  # a prompt in two forwards
    assert torch.equal(chunked, prompt)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            for p in LENGTHS:  # a decode step alone (its chunks split across tasks, then merged)
                assert torch.equal(seq.run(p - 1, p)[0], prompt[p - 1]), (n, p)
    finally:
        torch.set_num_threads(threads)
    others = [Sequence(n, dim, torch.float32, seed=n) for n in (40, 300)]
    for o in others:
        o.run(0, o.n)
    step = batch_run([others[0], seq, others[1]], [39, 256, 299])
    assert torch.equal(step[1], prompt[256])
    assert torch.equal(step[2], others[1].run(0, 300)[299])


@pytest.mark.parametrize("dim", [64, 48, 16, 12, 160])
def test_an_int8_pool_is_read_as_its_values_times_their_blocks_scales(ops, isa, dim):
    """The loops read each key and value of an int8 pool as its int8 values times
    their block's scale (48: a shorter last block; 16 and 12: one block, the row; 160:
    five, past the loops' unrolled counts); a decode step gives the prompt's bits."""
    if dim % 8 and isa != "avx2":
        pytest.skip("a head dim that is no multiple of 8 runs the portable loops on any ISA: once is enough")
    seq = Sequence(300, dim, torch.int8, seed=dim)
    prompt = seq.run(0, seq.n)
    for p in (1, 8, 256, 257, 300):
        want = seq.reference(p - 1)
        assert (prompt[p - 1].double() - want).abs().max() <= 2e-6 * want.abs().max() + 1e-6, p
        assert torch.equal(seq.run(p - 1, p)[0], prompt[p - 1]), p


@pytest.mark.parametrize("dim", [64, 32, 160])
def test_an_int8_pools_integer_scores_stay_close_to_a_float_query(ops, isa, dim):
    """The integer scores (rows of whole blocks of 32) quantize the query: against float64
    attention of the unquantized query over the same int8 rows, each output within 3% of
    the largest (the query's rounding, at most half a step of 1/127 of its block's
    largest value an element, moves each score, and the softmax carries it; seen: up to
    1.1% here); against the quantized query's, 2e-6 (the other test).
    A decode step alone and in a batch keeps the prompt's bits."""
    seq = Sequence(300, dim, torch.int8, seed=dim + 11)
    prompt = seq.run(0, seq.n)
    worst = 0.0
    for p in (1, 8, 256, 257, 300):
        want = seq.reference(p - 1, quantized_query=False)
        err = (prompt[p - 1].double() - want).abs().max().item() / want.abs().max().item()
        assert err <= 3e-2, (p, err)
        worst = max(worst, err)
        assert torch.equal(seq.run(p - 1, p)[0], prompt[p - 1]), p
    assert worst > 1e-6  # the query was quantized: the float query's attention is not what ran
    other = Sequence(41, dim, torch.int8, seed=7)
    other.run(0, other.n)
    both = Sequence(300, dim, torch.int8, seed=dim + 11)
    both.run(0, 299)
    step = batch_run([other, both], [40, 299])
    assert torch.equal(step[1], prompt[299])


def test_bfloat16_pool_matches_float64(ops, isa):
    seq = Sequence(300, 16, torch.bfloat16, seed=3)
    prompt = seq.run(0, seq.n)
    for p in (1, 256, 257, 300):
        want = seq.reference(p - 1)
        assert (prompt[p - 1].double() - want).abs().max() <= 1e-2 * want.abs().max(), p
        assert torch.equal(seq.run(p - 1, p)[0], prompt[p - 1]), p


def test_a_nan_key_gives_a_nan_output(ops, isa):
    """Corrupt KV must not pass for plausible attention (the executor fails such a row)."""
    seq = Sequence(300, 16, torch.float32, seed=4)
    seq.run(0, seq.n - 1)
    seq.k_cache[seq.table[0], 3] = float("nan")  # key 3, in the first chunk
    assert seq.run(seq.n - 1, seq.n).isnan().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("dim", [64, 32, 16])
def test_the_avx512_loops_give_the_avx2_loops_bits(ops, dtype, dim):
    """The wider loops of AVX-512 machines (four query heads' scores per K load, three
    heads' sums per V load) keep every score's and sum's chain: a prompt and a decode
    step give the same bits on both."""
    if torch.ops.ferrum_woq.set_max_isa("avx512") != "avx512":
        pytest.skip("this CPU cannot run the avx512 path")
    out = {}
    dot = ops.set_panel_dot(False)  # bfloat16's dot product path is its own (the tests below)
    try:  # an int8 pool's integer scores: VNNI's dot product and AVX2's byte multiply-adds
        for isa in ("avx512", "avx2"):
            torch.ops.ferrum_woq.set_max_isa(isa)
            seq = Sequence(300, dim, dtype, seed=dim)
            out[isa] = torch.cat([seq.run(0, 290), *(seq.run(p, p + 1) for p in range(290, 300))])
    finally:
        torch.ops.ferrum_woq.set_max_isa("avx512")
        ops.set_panel_dot(dot)
    assert torch.equal(out["avx512"], out["avx2"])


@pytest.fixture
def dot_path(ops):
    if torch.ops.ferrum_woq.set_max_isa("avx512") != "avx512" or not ops.panel_dot_runs():
        pytest.skip("this CPU has no AVX-512 BF16 dot product")
    return ops


# 64, 32, 16: the dot product's loops at each width of their value sums; 24: no multiple
# of 16, so the multiply-add loops
@pytest.mark.parametrize("dim", [64, 32, 16, 24])
def test_a_bfloat16_query_on_the_dot_product_keeps_its_bits_and_stays_close(dot_path, dim):
    """A bfloat16 model's attention on the dot product (queries and p rounded to bfloat16,
    dims and keys summed in pairs): a query's bits are the same in a prompt, a prompt cut
    in two, a decode step alone on 1 or 2 threads and a batch, at odd and even lengths around
    the chunk boundaries, and close to float64 attention over the same bfloat16 inputs."""
    seq = Sequence(max(LENGTHS), dim, torch.bfloat16, seed=dim + 1)
    prompt = seq.run(0, seq.n)
    for p in (*LENGTHS, 3, 77, 301):
        want = seq.reference(p - 1)
        assert (prompt[p - 1].double() - want).abs().max() <= 1e-2 * want.abs().max() + 1e-3, p
    assert torch.equal(torch.cat([seq.run(0, 257), seq.run(257, seq.n)]), prompt)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            for p in (*LENGTHS, 3, 77, 301):
                assert torch.equal(seq.run(p - 1, p)[0], prompt[p - 1]), (n, p)
    finally:
        torch.set_num_threads(threads)
    other = Sequence(41, dim, torch.bfloat16, seed=7)
    other.run(0, other.n)
    step = batch_run([other, seq], [40, 300])
    assert torch.equal(step[1], prompt[300])
    dot = dot_path.set_panel_dot(False)
    try:
        plain = Sequence(max(LENGTHS), dim, torch.bfloat16, seed=dim + 1).run(0, seq.n)
    finally:
        dot_path.set_panel_dot(dot)
    # the path ran (its roundings show) where the dims allow it, and not where they do not
    assert torch.equal(plain, prompt) == (dim % 16 != 0)


def test_a_nan_key_gives_a_nan_output_on_the_dot_product(dot_path):
    seq = Sequence(301, 64, torch.bfloat16, seed=5)
    seq.run(0, seq.n - 1)
    seq.k_cache[seq.table[0], 3] = float("nan")
    assert seq.run(seq.n - 1, seq.n).isnan().all()
    seq = Sequence(301, 64, torch.bfloat16, seed=5)
    seq.run(0, seq.n - 1)
    seq.v_cache[seq.table[0], 3] = float("nan")  # a value: every output reads it
    assert seq.run(seq.n - 1, seq.n).isnan().all()
