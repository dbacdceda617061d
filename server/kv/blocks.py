"""KV block bookkeeping: free list, per-sequence block tables, ref counts, prefix hashes.

Plain Python with no torch, so it is tested on its own and never touches
device memory; the executor only turns the block ids it hands out into slot
indices of the preallocated pool (and performs the block copies it is told
to).  Every mutating call either succeeds whole or raises leaving the state
exactly as it was.

Sharing (as in vLLM's block pool):
- a full block is identified by a hash of its tokens and of every token
  before it; a new prompt whose leading full blocks hash the same reuses
  them by reference count instead of recomputing them;
- freed blocks keep their hash and stay reusable until the free list hands
  them out again (least recently freed first);
- a block referenced by several sequences (prefix hits, forks) is copied
  before one of them writes into it (copy on write).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from types import MappingProxyType

from ferrum_rpc.errors import CacheExpired, CacheNotFound, KvCapacityExhausted, WeightsChanged, shown
from ferrum_rpc.hashing import block_hash, chain_root
from .events import KvEventHub, Stored
from .names import Names
from .prefix import PrefixIndex
from .sequence import BlockSnapshot, SequenceState, SequenceView

_EXPIRED_MEMORY = 100_000  # expired ids remembered, to answer CACHE_EXPIRED instead of NOT_FOUND


@dataclass
class WritePlan:
    """What :meth:`BlockManager.prepare_write` changed, so it can be undone."""

    added: list[int] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) to copy before writing
    replaced: list[tuple[int, int]] = field(default_factory=list)  # (table index, old block)


class BlockManager:
    """Hands out fixed-size KV blocks from a pool that never grows.

    Args:
        num_blocks: blocks in the pool.
        block_size: tokens per block.
        prefix_caching: share identical full prompt blocks across sequences.
    """

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._refs = [0] * num_blocks
        self.prefix = PrefixIndex()  # the prefix cache's hash <-> block index
        self._seqs: dict[str, SequenceState] = {}
        self._expired: OrderedDict[str, str] = OrderedDict()  # cache id -> its tenant
        self._invalidated: OrderedDict[str, str] = OrderedDict()  # dropped by a weights update: id -> tenant
        self.generation = 0  # the model's weights version: prefix-cache chains start from a root of it
        self.names = Names(self._seqs)  # the callers' request_ids of the live sequences
        self.queried_tokens = 0
        self.hit_tokens = 0
        self.expired_count = 0

    # -- pool figures ----------------------------------------------------------
    @property
    def events(self) -> KvEventHub | None:
        """The KV-event hub the prefix index tells (set by the executor)."""
        return self.prefix.events

    @events.setter
    def events(self, hub: KvEventHub | None) -> None:
        self.prefix.events = hub

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_shared(self) -> int:
        return sum(1 for r in self._refs if r > 1)

    @property
    def num_cached_free(self) -> int:
        return sum(1 for b in self._free if b in self.prefix)

    def snapshot(self) -> BlockSnapshot:
        """A read-only copy of the books (sequences, ref counts, free list, prefix-hash
        index); later calls do not change it."""
        seqs = {cid: SequenceView(cid, s.length, tuple(s.block_ids), tuple(s.tokens), tuple(s.hashes),
                                  s.last_used, s.pins, s.tenant, tuple(s.prompt_spans))
                for cid, s in self._seqs.items()}
        return BlockSnapshot(MappingProxyType(seqs), tuple(self._refs), tuple(self._free),
                             MappingProxyType(dict(self.prefix.hash_of)),
                             MappingProxyType(dict(self.prefix.block_of)))

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _take(self, n: int) -> list[int]:
        if n > len(self._free):
            raise KvCapacityExhausted(
                f"need {n} free KV blocks, {len(self._free)} of {self.num_blocks} free"
            )
        taken = [self._free.popitem(last=False)[0] for _ in range(n)]
        for b in taken:
            self.prefix.forget(b)
            self._refs[b] = 1
        return taken

    def _ref(self, block: int) -> None:
        if self._refs[block] == 0:
            del self._free[block]
        self._refs[block] += 1

    def _drop(self, blocks: list[int]) -> int:
        """Drops one reference to each block; returns how many went back to the free list."""
        freed = 0
        for b in reversed(blocks):  # a sequence's tail is evicted before its head
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free[b] = None
                freed += 1
        return freed

    def cached_blocks(self, tenant: str) -> list[Stored]:
        """The reusable blocks of ``tenant``, in the order they were stored (a KV events snapshot)."""
        return self.prefix.stored(tenant)

    # -- sequences ------------------------------------------------------------
    def __contains__(self, cache_id: str) -> bool:
        return cache_id in self._seqs

    def __len__(self) -> int:
        return len(self._seqs)

    def get(self, cache_id: str, tenant: str | None = None) -> SequenceState:
        """The sequence ``cache_id``.  With ``tenant`` given, another tenant's
        sequence (live or expired) is answered exactly like an unknown id."""
        seq = self._seqs.get(cache_id)
        if seq is not None and (tenant is None or seq.tenant == tenant):
            return seq
        if tenant is not None and self._invalidated.get(cache_id) == tenant:
            raise WeightsChanged(f"KV cache {shown(cache_id)} was dropped when the model's weights changed; "
                                 f"start a new sequence")
        if cache_id in self._expired and seq is None and (tenant is None or self._expired[cache_id] == tenant):
            raise CacheExpired(f"KV cache {shown(cache_id)} was reclaimed after sitting idle")
        raise CacheNotFound(f"no KV cache with id {shown(cache_id)}")

    def sequences(self) -> list[SequenceState]:
        """A snapshot of the live sequences (safe to take from another thread)."""
        return list(self._seqs.values())

    def count(self, tenant: str) -> int:
        """Live sequences of ``tenant``."""
        return sum(1 for s in self._seqs.values() if s.tenant == tenant)

    def blocks_held(self, tenant: str) -> int:
        """Distinct KV blocks the sequences of ``tenant`` hold (shared ones once)."""
        return len({b for s in self._seqs.values() if s.tenant == tenant for b in s.block_ids})

    def create(self, cache_id: str, tenant: str = "", name: str = "", adapter: str = "",
               adapter_digest: str = "", prompt_key: bytes = b"") -> SequenceState:
        """A new empty sequence of ``tenant``, named ``name`` by its caller (see :meth:`Names.check_name`)
        for the prompt ``prompt_key``, running ``adapter`` (its prefix cache is that adapter's,
        see ``chain_root``)."""
        if cache_id in self._seqs:
            raise ValueError(f"duplicate cache id {cache_id!r}")
        if name:
            self.names.add(tenant, name, cache_id)
        self._expired.pop(cache_id, None)
        seq = self._seqs[cache_id] = SequenceState(cache_id, tenant=tenant, name=name, adapter=adapter,
                                                   adapter_digest=adapter_digest, prompt_key=prompt_key,
                                                   generation=self.generation)
        return seq

    def release(self, cache_id: str) -> int:
        """Forgets a sequence; returns how many of its blocks went back to the free list
        (blocks still shared with other sequences stay in use)."""
        seq = self.get(cache_id)
        del self._seqs[cache_id]
        if seq.name:
            self.names.drop(seq.tenant, seq.name)
        return self._drop(seq.block_ids)

    def pin(self, seq: SequenceState) -> None:
        """Marks ``seq`` as in use by a job that spans several worker slices."""
        seq.pins += 1

    def unpin(self, seq: SequenceState, touch: bool) -> None:
        """Ends a :meth:`pin`; ``touch`` (the job succeeded) restarts the idle clock now."""
        seq.pins -= 1
        if touch:
            seq.last_used = time.monotonic()

    def expire_idle(self, idle_s: float, now: float | None = None) -> list[str]:
        """Releases sequences unused for ``idle_s`` seconds (never a pinned one);
        later lookups say CACHE_EXPIRED."""
        now = time.monotonic() if now is None else now
        stale = [cid for cid, s in self._seqs.items() if not s.pins and now - s.last_used > idle_s]
        for cid in stale:
            tenant = self._seqs[cid].tenant
            self.release(cid)
            self._expired[cid] = tenant
            if len(self._expired) > _EXPIRED_MEMORY:
                self._expired.popitem(last=False)
        self.expired_count += len(stale)
        return stale

    # -- prefix cache -------------------------------------------------------------
    _block_hash = staticmethod(block_hash)  # the chain routers compute too (ferrum_rpc.hashing)
    def _root(self, tenant: str, adapter_digest: str = "", generation: int | None = None) -> bytes:
        return chain_root(tenant, adapter_digest, self.generation if generation is None else generation)

    def is_current(self, seq: SequenceState) -> bool:
        """Whether every token of ``seq`` was computed with the weights serving now."""
        return seq.generation == self.generation

    def start_generation(self, generation: int) -> None:
        """The weights changed: every cached block is forgotten, and chains start from
        roots of ``generation`` from now on (KV-event streams resync: a new hello names
        the root, its snapshot is empty)."""
        self.generation = generation
        self.prefix.clear()

    def invalidate(self) -> int:
        """Drops every live sequence no job is using now, and makes every call naming any
        of them (a job's too, once it is done) fail WEIGHTS_CHANGED; returns how many
        were dropped."""
        dropped = 0
        for cid, seq in list(self._seqs.items()):
            self._invalidated[cid] = seq.tenant
            if len(self._invalidated) > _EXPIRED_MEMORY:
                self._invalidated.popitem(last=False)
            if not seq.pins:
                self.release(cid)
                dropped += 1
        return dropped

    def block_hashes(self, tokens: list[int], tenant: str, adapter_digest: str = "") -> list[bytes]:
        """Chained hashes of each full block of ``tokens`` (per tenant and adapter): what a
        sequence holding them has as its ``hashes``."""
        out, bs, parent = [], self.block_size, self._root(tenant, adapter_digest)
        for i in range(len(tokens) // bs):
            parent = self._block_hash(parent, tokens[i * bs:(i + 1) * bs])
            out.append(parent)
        return out

    def adopt_prefix(self, seq: SequenceState, tokens: list[int], max_tokens: int) -> int:
        """Gives a new, empty sequence the cached blocks matching the start of ``tokens``.

        At most ``max_tokens`` tokens (rounded down to whole blocks) are taken.
        Returns the number of tokens served from cache; they count as committed.
        """
        if not self.prefix_caching or seq.block_ids:
            return 0
        self.queried_tokens += len(tokens)
        limit = max(0, min(max_tokens, len(tokens))) // self.block_size * self.block_size
        matched: list[int] = []
        hashes = self.block_hashes(tokens[:limit], seq.tenant, seq.adapter_digest)
        for digest in hashes:
            block = self.prefix.lookup(digest)
            if block is None:
                break
            matched.append(block)
        for block in matched:
            self._ref(block)
        n = len(matched) * self.block_size
        seq.block_ids.extend(matched)
        seq.hashes[:] = hashes[:len(matched)]
        seq.tokens[:] = tokens[:n]
        seq.length = n
        seq.changes += 1
        self.hit_tokens += n
        return n

    def _register(self, seq: SequenceState) -> None:
        """Hashes seq's newly completed full blocks and publishes them for reuse.

        The chain starts from the root of the weights version the sequence began under.
        A sequence from older weights keeps its hashes but publishes nothing: each of its
        blocks was computed, at least in part, from KV the serving weights did not make
        (attention reads every earlier token), so it must never be hit under them."""
        if not self.prefix_caching:
            return
        bs = self.block_size
        publish = self.is_current(seq)
        for i in range(len(seq.hashes), seq.length // bs):
            parent = seq.hashes[-1] if seq.hashes else self._root(seq.tenant, seq.adapter_digest, seq.generation)
            digest = self._block_hash(parent, seq.tokens[i * bs:(i + 1) * bs])
            seq.hashes.append(digest)
            if publish:
                self.prefix.add(seq.block_ids[i], digest, seq.tenant, parent, tuple(seq.tokens[i * bs:(i + 1) * bs]))

    # -- writing ------------------------------------------------------------------
    def prepare_write(self, seq: SequenceState, start: int, end: int) -> WritePlan:
        """Makes positions [start, end) writable by ``seq`` alone.

        Adds blocks up to ``end`` and swaps any shared block in the range for a
        private copy (the caller copies the KV of each ``plan.copies`` pair
        before writing).  The length is not changed: call :meth:`commit`, or
        :meth:`undo_write` if the forward fails.
        """
        first, have = start // self.block_size, len(seq.block_ids)
        shared = [i for i in range(first, min(have, self.blocks_for(end))) if self._refs[seq.block_ids[i]] > 1]
        need = max(0, self.blocks_for(end) - have)
        if need + len(shared) > len(self._free):
            raise KvCapacityExhausted(
                f"need {need + len(shared)} free KV blocks, {len(self._free)} of {self.num_blocks} free"
            )
        plan = WritePlan()
        for i in shared:
            old, (new,) = seq.block_ids[i], self._take(1)
            self._refs[old] -= 1
            seq.block_ids[i] = new
            plan.copies.append((old, new))
            plan.replaced.append((i, old))
        for i in range(first, min(have, self.blocks_for(end))):
            self.prefix.forget(seq.block_ids[i])  # its content is about to change
        del seq.hashes[first:]
        plan.added = self._take(need)
        seq.block_ids.extend(plan.added)
        return plan

    def undo_write(self, seq: SequenceState, plan: WritePlan) -> None:
        del seq.block_ids[len(seq.block_ids) - len(plan.added):]
        self._drop(plan.added)
        for i, old in plan.replaced:
            self._drop([seq.block_ids[i]])
            self._ref(old)
            seq.block_ids[i] = old

    def commit(self, seq: SequenceState, start: int, tokens: list[int]) -> None:
        """Records that ``tokens`` now occupy positions [start, start + len)."""
        seq.tokens[start:] = tokens
        seq.length = start + len(tokens)
        seq.changes += 1
        seq.last_used = time.monotonic()
        self._register(seq)

    @staticmethod
    def mark_prompt(seq: SequenceState, start: int, end: int) -> None:
        """Records that a Prefill appended [start, end): every token up to ``end`` is prompt."""
        seq.prompt_spans.append((start, end))

    def shrink(self, seq: SequenceState, new_length: int, touch: bool = True) -> int:
        """Sets the length to ``new_length`` and drops blocks past it; returns blocks freed.
        ``touch=False`` (a rollback) leaves the idle clock as it was. Prefills that started
        at or after ``new_length`` are forgotten (undoing a Prefill puts the prompt/output
        split back where it was), one cut through is clipped."""
        while seq.prompt_spans and seq.prompt_spans[-1][0] >= new_length:
            seq.prompt_spans.pop()
        if seq.prompt_spans and seq.prompt_spans[-1][1] > new_length:
            seq.prompt_spans[-1] = (seq.prompt_spans[-1][0], new_length)
        keep = self.blocks_for(new_length)
        dropped = seq.block_ids[keep:]
        del seq.block_ids[keep:]
        del seq.tokens[new_length:]
        del seq.hashes[new_length // self.block_size:]
        seq.length = new_length
        seq.changes += 1
        if new_length == 0:  # no KV of older weights is left in it
            seq.generation = self.generation
        if touch:
            seq.last_used = time.monotonic()
        return self._drop(dropped)

    def fork(self, seq: SequenceState, child_ids: list[str]) -> list[SequenceState]:
        """New sequences sharing every block of ``seq`` (copy on write later)."""
        if len(set(child_ids)) != len(child_ids) or any(cid in self._seqs for cid in child_ids):
            raise ValueError("duplicate cache id")
        children = []
        for cid in child_ids:
            for block in seq.block_ids:
                self._ref(block)
            child = self._seqs[cid] = SequenceState(
                cid, seq.length, list(seq.block_ids), list(seq.tokens), list(seq.hashes), tenant=seq.tenant,
                adapter=seq.adapter, adapter_digest=seq.adapter_digest, prompt_spans=list(seq.prompt_spans),
                generation=seq.generation,
            )
            children.append(child)
        seq.last_used = time.monotonic()
        return children

    def slots(self, seq: SequenceState, start: int, end: int) -> list[int]:
        """Pool slot index of each token position in [start, end)."""
        bs = self.block_size
        ids = seq.block_ids
        return [ids[p // bs] * bs + p % bs for p in range(start, end)]
