"""Sequences that move: export a sequence as tokens + KV + a compatibility
fingerprint, and import such a stream (the single-use tickets of server-to-server
pushes, and where a push may go, are the rpc layer's: ``rpc/tickets.py``).

An export is a stream of ``SequenceChunk`` messages: one header (tokens, prompt
spans, the fingerprint, sizes), the KV of consecutive tokens in chunks (the pool's
dtype, K then V, all layers; an int8 pool's block scales after them, K's then V's),
one trailer (a BLAKE2b checksum).  The importer checks
every part as it arrives (:class:`Receiver`, no executor state touched) and only
then, in one worker job (:func:`install`), takes blocks, writes the pool and makes
the sequence: a refused, truncated or cancelled import leaves blocks, sequences
and the prefix cache exactly as they were.

KV moves bit for bit (no recomputation), so the next decode after an import gives
the same float32 logits as it would have on the exporting server, provided both
run the same weights, dtype, quantization and KV layout: what the fingerprint
says.  The fingerprint's weights digest hashes the model folder's files, so it
survives a restart, and an export kept as bytes imports into the restarted server.
"""

from __future__ import annotations

import logging
import secrets
import uuid
from dataclasses import dataclass
from typing import Iterator

import torch

from ferrum_rpc import tensor_codec
from ferrum_rpc.errors import (
    FingerprintMismatch,
    InvalidInput,
    KvCapacityExhausted,
    TenantQuotaExceeded,
    TransferCorrupted,
    shown,
)
from ferrum_rpc.hashing import stream_hasher, text_digest
from ferrum_rpc.types import KvCacheHandle
from ferrum_rpc.v1 import executor_pb2 as pb
from .transfer_budget import TransferBudget

from ..kv.pool import SCALES_LAYOUT, KvPool

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
DEFAULT_CHUNK_BYTES = 4 << 20  # small enough to interleave with other calls' replies, big enough to amortize


# -- the fingerprint ------------------------------------------------------------------------


def fingerprint(executor, weights_digest: str | None = None) -> pb.KvFingerprint:
    """The executor's KV compatibility fingerprint (``KvFingerprint``), digest filled in;
    ``weights_digest``: of the weights a sequence's KV was computed with, where those
    are not the ones serving now (a sequence kept across an UpdateWeights)."""
    mc = executor.model_config
    fp = pb.KvFingerprint(
        weights_digest=executor.weights.digest if weights_digest is None else weights_digest, dtype=tensor_codec.dtype_to_proto(executor.config.dtype),
        quantization=executor.config.quantize, block_size=executor.kv.block_size, tensor_parallel=1,
        kv_layout=f"paged-kv/v1 layers={mc.num_layers} kv_heads={mc.num_kv_heads} head_dim={mc.head_dim}"
                  + ("" if (kv := executor.config.kv_dtype_name) == executor.config.dtype else f" kv_dtype={kv}")
                  + (f" {SCALES_LAYOUT}" if kv == "int8" else ""))
    fp.digest = fingerprint_digest(fp)
    return fp


def fingerprint_digest(fp: pb.KvFingerprint) -> str:
    """BLAKE2b-128 (hex) over the fingerprint's fields (not its own digest)."""
    text = "\n".join(str(v) for v in (fp.weights_digest, fp.dtype, fp.quantization, fp.kv_layout,
                                      fp.block_size, fp.tensor_parallel))
    return text_digest(text)


def kv_dtype_of(fp: pb.KvFingerprint) -> str:
    """The KV pool dtype a fingerprint names (its layout's kv_dtype, else its dtype's)."""
    for part in fp.kv_layout.split():
        if part.startswith("kv_dtype="):
            return part.removeprefix("kv_dtype=")
    return tensor_codec.dtype_from_proto(fp.dtype) if fp.dtype else "unknown"


def _check_fingerprint(theirs: pb.KvFingerprint, ours: pb.KvFingerprint) -> None:
    if fingerprint_digest(theirs) != theirs.digest:
        raise TransferCorrupted("the header's fingerprint digest does not match its fields")
    if theirs.digest == ours.digest:
        return
    differ = [name for name in ("weights_digest", "dtype", "quantization", "kv_layout", "block_size",
                                "tensor_parallel") if getattr(theirs, name) != getattr(ours, name)]
    kv_dtype = "" if (a := kv_dtype_of(theirs)) == (b := kv_dtype_of(ours)) else \
        f"; the export's KV pool holds {a}, this server's {b} (--kv-dtype): KV moves only between pools of one dtype"
    raise FingerprintMismatch(f"the export's KV is not compatible with this server's (differs in: "
                              f"{', '.join(differ)}{kv_dtype}; export {theirs.digest}, here {ours.digest})")


def pool_bytes(executor) -> int:
    """The bytes of the executor's KV pool (what an import may at most fill)."""
    return executor.pool.nbytes


def _bytes_per_token(executor) -> int:
    mc = executor.model_config
    return KvPool.bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim, executor.pool.k.dtype)


def _pool_rows(executor) -> list[torch.Tensor]:
    """K and V of the pool as (layers, slots, kv_heads, head_dim) views, then an int8
    pool's K and V scales as (layers, slots, kv_heads, scale blocks)."""
    pool = executor.pool
    return [t.flatten(1, 2) for t in pool.tensors()]


def _read(executor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The pool's rows at ``slots`` on the CPU: KV (2, layers, tokens, kv_heads, head_dim)
    and an int8 pool's scales (2, layers, tokens, kv_heads, scale blocks), else None."""
    rows = [t.index_select(1, slots) for t in _pool_rows(executor)]
    kv = torch.stack(rows[:2]).cpu()
    return kv, (torch.stack(rows[2:]).cpu() if len(rows) > 2 else None)


# -- export ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Snapshot:
    """A sequence as it was when read (worker thread), to be streamed from any thread."""

    handle: KvCacheHandle
    tokens: tuple[int, ...]
    spans: tuple[tuple[int, int], ...]
    kv: torch.Tensor  # (2, layers, tokens, kv_heads, head_dim) on the CPU, the pool's dtype
    fingerprint: pb.KvFingerprint
    model: str
    adapter: str = ""
    adapter_digest: str = ""
    scales: torch.Tensor | None = None  # an int8 pool's: (2, layers, tokens, kv_heads, scale blocks)


def snapshot(executor, handle: KvCacheHandle, tenant: str) -> Snapshot:
    """Reads a sequence out (runs on the worker thread; changes nothing, not even its
    idle clock).  Another tenant's sequence is CACHE_NOT_FOUND, as everywhere."""
    seq = executor.checks.resolve(handle, tenant)
    slots = torch.tensor(executor.kv.slots(seq, 0, seq.length), dtype=torch.long, device=executor.pool.k.device)
    kv, scales = _read(executor, slots)  # (2, L, T, H, D), (2, L, T, H, scale blocks) or None
    return Snapshot(executor.handle(seq), tuple(seq.tokens[:seq.length]), tuple(seq.prompt_spans), kv,
                    fingerprint(executor, executor.weights.digest_of(seq.generation)), executor.name, seq.adapter,
                    seq.adapter_digest, scales)


def export_messages(snap: Snapshot, chunk_bytes: int = 0) -> Iterator[pb.SequenceChunk]:
    """The export stream of a snapshot: header, KV chunks of at most ``chunk_bytes``
    (at least one token each), trailer."""
    kv, scales = snap.kv, snap.scales
    length = kv.shape[2]
    per_token = sum(t[:, :, :1].numel() * t.element_size() for t in (kv, scales) if t is not None)
    h = stream_hasher()
    h.update(snap.fingerprint.digest.encode())
    h.update(b"".join(t.to_bytes(4, "little") for t in snap.tokens))
    _hash_adapter(h, snap.adapter, snap.adapter_digest)
    yield pb.SequenceChunk(header=pb.SequenceHeader(
        format_version=FORMAT_VERSION, fingerprint=snap.fingerprint, token_ids=snap.tokens,
        sequence_length=length, prompt_spans=[x for span in snap.spans for x in span],
        kv_bytes=per_token * length, kv_bytes_per_token=per_token, model=snap.model, adapter=snap.adapter,
        adapter_digest=snap.adapter_digest))
    step = max(1, (chunk_bytes or DEFAULT_CHUNK_BYTES) // per_token)
    for start in range(0, length, step):
        parts = [t[:, :, start:start + step].contiguous() for t in (kv, scales) if t is not None]
        # dtype-agnostic bytes (bfloat16 has no numpy type): the values, then any scales
        data = b"".join(part.view(torch.uint8).numpy().tobytes() for part in parts)
        h.update(data)
        yield pb.SequenceChunk(kv=pb.KvChunk(first_token=start, num_tokens=parts[0].shape[2], data=data))
    yield pb.SequenceChunk(trailer=pb.SequenceTrailer(checksum=h.digest()))


# -- import ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Incoming:
    """A whole, checked import stream: what :func:`install` writes."""

    tokens: list[int]
    spans: list[tuple[int, int]]
    kv: torch.Tensor  # (2, layers, tokens, kv_heads, head_dim), the pool's dtype, on the CPU
    fingerprint: str
    adapter: str = ""
    adapter_digest: str = ""
    scales: torch.Tensor | None = None  # an int8 pool's: (2, layers, tokens, kv_heads, scale blocks)


def _hash_adapter(h, adapter: str, digest: str) -> None:
    """An export's adapter in its checksum (nothing for the base model's sequences)."""
    if adapter or digest:
        h.update(b"adapter:" + adapter.encode() + b"\x00" + digest.encode())


def check_adapter(executor, adapter: str, digest: str) -> None:
    """FINGERPRINT_MISMATCH unless this model holds ``adapter`` with that content digest."""
    if not adapter and not digest:
        return
    held = executor.adapters.by_name.get(adapter) if executor.adapters is not None else None
    if held is None or held.digest != digest:
        raise FingerprintMismatch(f"the sequence runs adapter {shown(adapter)} (digest {shown(digest)}); this "
                                  f"server holds " + (f"another version of it (digest {held.digest})" if held
                                                      else "no adapter of that name") +
                                  ": load the same adapter here first")


class Receiver:
    """Checks an import stream message by message against an executor's fixed facts
    (fingerprint, vocabulary, maximum length, pool size, quota); reads no state that
    the worker changes, so it runs on the event loop.  :meth:`done` gives the
    :class:`Incoming` once the trailer's checksum matched.  With a ``budget``, the KV
    buffer is reserved for ``tenant`` before it is allocated; :meth:`close` frees it."""

    def __init__(self, executor, fingerprint_digest_expected: str | None = None,
                 budget: TransferBudget | None = None, tenant: str = ""):
        self.executor = executor
        self.ours = fingerprint(executor)
        self.expected = fingerprint_digest_expected  # a ticket's: the stream must carry this one
        self.budget, self.tenant = budget, tenant
        self.reserved = 0  # bytes this import holds of the budget
        self.header: pb.SequenceHeader | None = None
        self.kv: torch.Tensor | None = None
        self.scales: torch.Tensor | None = None  # an int8 pool's
        self.received = 0  # tokens of KV so far
        self.hash = stream_hasher()
        self.checked: Incoming | None = None

    def take(self, message: pb.SequenceChunk) -> None:
        kind = message.WhichOneof("part")
        if self.checked is not None:
            raise InvalidInput("a message after the trailer: an import stream ends with its trailer")
        if kind is None:
            raise InvalidInput("an import stream message with no part (header, kv or trailer)")
        if (kind == "header") != (self.header is None):
            raise InvalidInput("an import stream starts with one header, and has only one"
                               if kind == "header" else "an import stream starts with its header")
        getattr(self, f"_{kind}")(getattr(message, kind))

    def _header(self, header: pb.SequenceHeader) -> None:
        ex = self.executor
        if header.format_version != FORMAT_VERSION:
            raise InvalidInput(f"format_version {header.format_version} is not {FORMAT_VERSION}")
        if self.expected is not None and header.fingerprint.digest != self.expected:
            raise FingerprintMismatch(f"the ticket was issued for fingerprint {self.expected}, the stream "
                                      f"carries {shown(header.fingerprint.digest)}")
        _check_fingerprint(header.fingerprint, self.ours)
        check_adapter(ex, header.adapter, header.adapter_digest)
        length, per_token = header.sequence_length, _bytes_per_token(ex)
        if not 1 <= length or len(header.token_ids) != length:
            raise InvalidInput(f"sequence_length {length} with {len(header.token_ids)} token ids: they must "
                               "agree, and a sequence has at least one token")
        if header.kv_bytes_per_token != per_token or header.kv_bytes != per_token * length:
            raise InvalidInput(f"kv_bytes {header.kv_bytes} ({header.kv_bytes_per_token} a token) for {length} "
                               f"tokens; this model's KV is {per_token} bytes a token")
        ex.checks.tokens(list(header.token_ids))
        ex.checks.length(0, length)
        ex.checks.fits_pool(length)  # before any KV is buffered: a stream larger than the pool stops here
        quota = ex.bounds(self.tenant).kv_tokens
        if quota and ex.kv.blocks_for(length) * ex.kv.block_size > quota:
            raise TenantQuotaExceeded(f"the sequence needs {ex.kv.blocks_for(length) * ex.kv.block_size} KV "
                                      f"tokens, over the tenant quota of {quota}")
        spans = list(header.prompt_spans)
        pairs = list(zip(spans[::2], spans[1::2]))
        if len(spans) % 2 or any(not 0 <= a < b <= length for a, b in pairs) or \
                any(b1 > a2 for (_, b1), (a2, _) in zip(pairs, pairs[1:])):
            raise InvalidInput("prompt_spans must be ordered [start, end) pairs within the sequence")
        if self.budget is not None:
            self.budget.reserve(self.tenant, header.kv_bytes, ex.config.tenant_kv_tokens, per_token)
            self.reserved = header.kv_bytes
        mc = ex.model_config
        self.header = header
        self.kv = torch.empty((2, mc.num_layers, length, mc.num_kv_heads, mc.head_dim), dtype=ex.pool.k.dtype)
        if ex.pool.quantized:
            self.scales = torch.empty((2, mc.num_layers, length, *ex.pool.k_scale.shape[3:]),
                                      dtype=ex.pool.k_scale.dtype)
        self.hash.update(header.fingerprint.digest.encode())
        self.hash.update(b"".join(t.to_bytes(4, "little") for t in header.token_ids))
        _hash_adapter(self.hash, header.adapter, header.adapter_digest)

    def _kv(self, chunk: pb.KvChunk) -> None:
        length, n = self.header.sequence_length, chunk.num_tokens
        if chunk.first_token != self.received or n < 1 or self.received + n > length:
            raise InvalidInput(f"a KV chunk of tokens [{chunk.first_token}, {chunk.first_token + n}) where "
                               f"[{self.received}, ...) up to {length} was due")
        size = n * self.header.kv_bytes_per_token
        if len(chunk.data) != size:
            raise InvalidInput(f"a KV chunk of {n} tokens holds {len(chunk.data)} bytes, not {size}")
        self.hash.update(chunk.data)
        _, L, _, H, D = self.kv.shape
        data = torch.frombuffer(bytearray(chunk.data), dtype=torch.uint8)
        split = self.kv[:, :, :n].numel() * self.kv.element_size()  # the values', then the scales' bytes
        self.kv[:, :, self.received:self.received + n] = data[:split].view(self.kv.dtype).view(2, L, n, H, D)
        if self.scales is not None:
            self.scales[:, :, self.received:self.received + n] = \
                data[split:].view(self.scales.dtype).view(2, L, n, *self.scales.shape[3:])
        self.received += n

    def _trailer(self, trailer: pb.SequenceTrailer) -> None:
        if self.received != self.header.sequence_length:
            raise TransferCorrupted(f"the trailer came after {self.received} of "
                                    f"{self.header.sequence_length} tokens of KV")
        if not secrets.compare_digest(trailer.checksum, self.hash.digest()):
            raise TransferCorrupted("the checksum does not match the stream: it was altered on the way")
        spans = list(self.header.prompt_spans)
        self.checked = Incoming(list(self.header.token_ids), list(zip(spans[::2], spans[1::2])), self.kv,
                                self.header.fingerprint.digest, self.header.adapter, self.header.adapter_digest,
                                self.scales)

    def close(self) -> None:
        """Drops the buffer and gives its bytes back to the budget (the call ended)."""
        self.kv = self.scales = self.checked = None
        if self.reserved:
            self.budget.release(self.tenant, self.reserved)
            self.reserved = 0

    def done(self) -> Incoming:
        """The checked stream; TRANSFER_CORRUPTED when it ended before its trailer."""
        if self.checked is None:
            got = "nothing" if self.header is None else \
                f"{self.received} of {self.header.sequence_length} tokens of KV and no trailer"
            raise TransferCorrupted(f"the import stream ended early ({got}): truncated")
        return self.checked


def install(executor, incoming: Incoming, tenant: str) -> KvCacheHandle:
    """Makes the imported sequence (runs on the worker thread): every check that reads
    live state (sequence caps, free blocks, the tenant's quota) first, then the blocks
    are taken, the KV written and the tokens committed, so its full blocks join this
    server's prefix cache under ``tenant``.  Raises with nothing changed."""
    ex, kv = executor, executor.kv
    length = len(incoming.tokens)
    if incoming.fingerprint != fingerprint(ex).digest:  # the model may have been reloaded meanwhile
        raise FingerprintMismatch("this server's fingerprint changed during the import")
    check_adapter(ex, incoming.adapter, incoming.adapter_digest)  # it may have been unloaded meanwhile
    ex.checks.sequence_room(tenant, 1)
    need = kv.blocks_for(length)
    if need > kv.num_free:
        raise KvCapacityExhausted(f"need {need} free KV blocks, {kv.num_free} of {kv.num_blocks} free")
    if (quota := ex.bounds(tenant).kv_tokens) and (kv.blocks_held(tenant) + need) * kv.block_size > quota:
        raise TenantQuotaExceeded(f"your tenant would hold {(kv.blocks_held(tenant) + need) * kv.block_size} KV "
                                  f"tokens, over its quota of {quota} (--tenant-kv-tokens); release or truncate "
                                  f"sequences")
    seq = kv.create(uuid.uuid4().hex, tenant, adapter=incoming.adapter, adapter_digest=incoming.adapter_digest)
    try:
        kv.prepare_write(seq, 0, length)  # cannot fail now: the blocks are there
        slots = torch.tensor(kv.slots(seq, 0, length), dtype=torch.long, device=ex.pool.k.device)
        rows = _pool_rows(ex)
        for pool, values in zip(rows, [*incoming.kv, *([] if incoming.scales is None else incoming.scales)]):
            pool[:, slots] = values.to(pool.device)
        kv.commit(seq, 0, incoming.tokens)
        seq.prompt_spans[:] = incoming.spans
    except BaseException:
        kv.release(seq.cache_id)
        raise
    log.info("%s: imported a sequence of %d tokens as %s", ex.name, length, seq.cache_id)
    return ex.handle(seq)


def release_if_unchanged(executor, snap: Snapshot, tenant: str) -> bool:
    """A move's last step (worker thread): releases the pushed sequence unless a call
    changed it since it was read (then it stays, and the caller is told)."""
    seq = executor.kv.get(snap.handle.cache_id, tenant)
    if seq.pins or seq.length != len(snap.tokens) or tuple(seq.tokens[:seq.length]) != snap.tokens:
        return False
    executor.kv.release(seq.cache_id)
    return True
