"""An int8 KV pool (--kv-dtype int8) serving the real SmolLM2-135M through real gRPC:
the capabilities and the fingerprint name the dtype; greedy decoding gives bit-identical
logits alone, inside a batch of other sequences and with its prompt from the prefix
cache; a sequence exported from one int8 server imports into another and decodes there
bit for bit; an int8 export is refused by a bfloat16 server, which says why, and an
export of the earlier int8 layout (one float32 scale a row) by an int8 server.
(Accuracy against a float32 cache is measured by bench/kv_int8.py.)"""

from __future__ import annotations

import numpy as np
import pytest

from ferrum_rpc import sequence_file
from ferrum_rpc.client import DecodeInput, ExecutorClient, LogitsPolicy
from ferrum_rpc.errors import FingerprintMismatch
from ferrum_rpc.server.engine.transfer import fingerprint_digest
from tests.conftest import running_server

pytestmark = pytest.mark.cpu_only

FULL = LogitsPolicy.full()
STEPS = 6


@pytest.fixture(scope="module")
def servers(default_model_dir):
    """Two int8 servers and a bfloat16 one (each in-process, real gRPC on loopback)."""
    kw = dict(kv_tokens=2048, block_size=16, server_kwargs={"warmup": False})
    with running_server(default_model_dir, kv_dtype="int8", **kw) as a, \
            running_server(default_model_dir, kv_dtype="int8", **kw) as b, \
            running_server(default_model_dir, kv_dtype="bfloat16", **kw) as c:
        yield {"a": a, "b": b, "bf16": c}


def prompt(n: int, seed: int) -> list[int]:
    return [(97 * i + 13 + 331 * seed) % 40000 + 100 for i in range(n)]


def bits(row) -> np.ndarray:
    return np.asarray(row.logits.values, dtype=np.float32).view(np.uint32)


def greedy(c: ExecutorClient, out, steps: int = STEPS) -> tuple[list[int], list[np.ndarray]]:
    tokens, rows = [], [bits(out)]
    for _ in range(steps):
        token = int(out.logits.argmax()[0])
        tokens.append(token)
        out = c.decode(token, out.kv_cache, logits=FULL)
        rows.append(bits(out))
    c.release_cache(out.kv_cache)
    return tokens, rows


def same(x, y) -> bool:
    """Two greedy runs: the same tokens and every logits row bit-identical."""
    return x[0] == y[0] and len(x[1]) == len(y[1]) and all(np.array_equal(a, b) for a, b in zip(x[1], y[1]))


def test_capabilities_and_fingerprint_name_int8(servers):
    with ExecutorClient(servers["a"].target) as a, ExecutorClient(servers["b"].target) as b, \
            ExecutorClient(servers["bf16"].target) as c:
        ca, cb, cc = a.capabilities(), b.capabilities(), c.capabilities()
        assert (ca.kv_dtype, cc.kv_dtype) == ("int8", "bfloat16")
        assert a.info().kv_dtype == "int8"
        assert ca.kv_fingerprint == cb.kv_fingerprint != cc.kv_fingerprint
        assert ca.batch_invariant
        # int8 with its two float16 scales: 68 bytes a row of 64 values, where bfloat16 holds 128
        assert ca.kv_bytes * 128 == cc.kv_bytes * 68


def test_greedy_alone_batched_and_prefix_cached_are_bit_identical(servers):
    target = prompt(40, 0)
    with ExecutorClient(servers["a"].target, timeout=120) as c:
        alone = greedy(c, c.prefill(target, logits=FULL))
        # the same prompt again: its 2 full blocks from the prefix cache
        again = c.prefill(target, logits=FULL)
        assert again.cached_tokens == 32
        assert same(greedy(c, again), alone)
        # inside a batch of two other sequences of other lengths, every step
        out = c.prefill(target, logits=FULL)
        others = [c.prefill(prompt(n, seed), logits=FULL) for n, seed in ((23, 1), (57, 2))]
        handles = [out.kv_cache] + [o.kv_cache for o in others]
        tokens = [int(out.logits.argmax()[0])] + [int(o.logits.argmax()[0]) for o in others]
        rows = [bits(out)]
        for step in range(STEPS):
            outs = c.batch_decode([DecodeInput(t, h) for t, h in zip(tokens, handles)][::-1 if step % 2 else 1],
                                  logits=FULL)
            outs = outs[::-1] if step % 2 else outs
            rows.append(bits(outs[0]))
            handles = [o.kv_cache for o in outs]
            tokens = [int(o.logits.argmax()[0]) for o in outs]
        for h in handles:
            c.release_cache(h)
        assert all(np.array_equal(x, y) for x, y in zip(rows, alone[1]))


def test_an_int8_sequence_moves_bit_for_bit_and_a_bfloat16_server_refuses_it(servers):
    with ExecutorClient(servers["a"].target, timeout=120) as a, ExecutorClient(servers["b"].target, timeout=120) as b, \
            ExecutorClient(servers["bf16"].target, timeout=120) as c:
        out = a.prefill(prompt(37, 3), logits=FULL)
        data = a.export_sequence(out.kv_cache)
        moved = b.import_sequence(data)
        token = int(out.logits.argmax()[0])
        here, there = a.decode(token, out.kv_cache, logits=FULL), b.decode(token, moved, logits=FULL)
        assert np.array_equal(bits(here), bits(there))
        assert same(greedy(a, here), greedy(b, there))
        with pytest.raises(FingerprintMismatch) as info:
            c.import_sequence(data)
        message = str(info.value)
        assert "kv_layout" in message and "holds int8" in message and "bfloat16" in message
        assert c.status().active_sequences == 0


def test_an_export_of_the_earlier_int8_layout_is_refused(servers):
    """Before blocks, an int8 row carried one float32 scale: 68 bytes a row too, so only
    the fingerprint tells the layouts apart.  An export whose fingerprint is that of a
    server of the earlier layout (its kv_layout without kv_scales, its digest valid) is
    refused before any KV is read, and nothing is taken."""
    with ExecutorClient(servers["a"].target, timeout=120) as a, ExecutorClient(servers["b"].target, timeout=120) as b:
        out = a.prefill(prompt(20, 4), logits=FULL)
        messages = list(sequence_file.messages(a.export_sequence(out.kv_cache)))
        a.release_cache(out.kv_cache)
        fp = messages[0].header.fingerprint
        assert fp.kv_layout.endswith(" kv_dtype=int8 kv_scales=float16/32")
        fp.kv_layout = fp.kv_layout.removesuffix(" kv_scales=float16/32")
        fp.digest = fingerprint_digest(fp)
        before = b.status().active_sequences
        with pytest.raises(FingerprintMismatch, match="kv_layout"):
            b.import_sequence(b"".join(sequence_file.frame(m) for m in messages))
        assert b.status().active_sequences == before
