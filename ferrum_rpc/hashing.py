"""The hashes the contract defines, each written once: callers in any language must
reproduce them, so the server and the Python client both import them from here.

- The KV block chain (prefix caching, KV events, the client's KV-aware router):
  BLAKE2b-128 chained block by block from a per-tenant root.
- The seeded draw's key (token choice): BLAKE2b-64 of a tag, the seed and the position.
- Transfer digests (export/import): BLAKE2b-256 over a stream's bytes, BLAKE2b-128
  of a KV fingerprint's fields, BLAKE2b-256 of a model folder's weights.

BLAKE2b because every language's standard library has it, with no structure between
neighbouring keys.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Iterable, Sequence

_DRAW_TAG = b"ferrum-rpc/token-choice/v1"


# -- the KV block chain ---------------------------------------------------------------------

def chain_root(tenant: str, adapter_digest: str = "", weights_version: int = 0) -> bytes:
    """Where a tenant's hash chains start: prefix sharing never crosses tenants,
    so a cache hit (or an event) tells a caller nothing about anyone else's prompts.
    A sequence running a LoRA adapter chains from a root of its own, keyed by the
    adapter's content digest (ListAdapters): its KV is the adapter's, never the base's
    or another adapter's.  After an UpdateWeights (``weights_version`` above 0) chains
    start from a root of that version: KV computed with older weights is never a hit."""
    key = b"tenant:" + tenant.encode()
    if adapter_digest:
        key += b"\x00adapter:" + adapter_digest.encode()
    if weights_version:
        key += b"\x00weights:" + str(weights_version).encode()
    return hashlib.blake2b(key, digest_size=16).digest()


def block_hash(parent: bytes, block_tokens: Iterable[int]) -> bytes:
    """BLAKE2b-128 of the parent's hash and the block's token ids as little-endian uint32."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(b"".join(int(t).to_bytes(4, "little") for t in block_tokens))
    return h.digest()


def block_chain(root: bytes, block_size: int, tokens: Sequence[int]) -> list[bytes]:
    """The hashes of ``tokens``' full blocks, each chained on the one before, from ``root``."""
    out, parent = [], root
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = block_hash(parent, tokens[start:start + block_size])
        out.append(parent)
    return out


# -- the seeded draw --------------------------------------------------------------------------

def draw_key(seed: int, position: int) -> int:
    """The 64-bit word that keys the draw of the token at ``position`` of a sequence
    seeded with ``seed``: the first 8 bytes of BLAKE2b(tag || seed || position), both
    unsigned 64-bit little-endian, read little-endian."""
    key = _DRAW_TAG + seed.to_bytes(8, "little") + position.to_bytes(8, "little")
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")


# -- transfers --------------------------------------------------------------------------------

def stream_hasher():
    """A BLAKE2b-256 hasher: an export stream's checksum over its fingerprint digest,
    token ids and KV bytes, in stream order; an UpdateWeights stream's over its data."""
    return hashlib.blake2b(digest_size=32)


def text_digest(text: str) -> str:
    """BLAKE2b-128 (hex) of ``text`` (a KV fingerprint's fields, one per line)."""
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def updated_weights_digest(before: str, update_checksum: bytes) -> str:
    """The weights digest after an UpdateWeights: BLAKE2b-256 (hex) of the digest before
    and the update's checksum (an export's fingerprint then names the new weights)."""
    return hashlib.blake2b(before.encode() + update_checksum, digest_size=32).hexdigest()


def weights_digest(path: str | Path) -> str:
    """BLAKE2b-256 (hex) of a model folder's config.json and *.safetensors, in name order
    (it reads every byte: the server keeps it per folder, ``engine.weights.stored_weights_digest``)."""
    folder = Path(path)
    return files_digest([folder / "config.json", *sorted(folder.glob("*.safetensors"))])


def files_digest(files: Sequence[str | Path]) -> str:
    """BLAKE2b-256 (hex) over each file's name and BLAKE2b-256, in the order given: a
    model's weights digest, a LoRA adapter's digest (AdapterEntry.digest)."""
    files = [Path(f) for f in files]
    h = hashlib.blake2b(digest_size=32)
    for f in files:
        h.update(f.name.encode() + b"\0")
        with open(f, "rb") as fh:
            h.update(hashlib.file_digest(fh, lambda: hashlib.blake2b(digest_size=32)).digest())
    return h.hexdigest()
