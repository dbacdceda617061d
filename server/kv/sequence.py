"""One sequence's bookkeeping: its blocks, tokens, owner, name, adapter and weights
version (plain data; the block manager changes it)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass
class SequenceState:
    cache_id: str
    length: int = 0
    block_ids: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # the first `length` are committed
    hashes: list[bytes] = field(default_factory=list)  # chained hashes of leading full blocks
    last_used: float = field(default_factory=time.monotonic)  # end of its last successful call
    pins: int = 0  # jobs using it right now (a chunked prefill, a long verify): never reaped
    tenant: str = ""  # who made it: nobody else can see it (auth off: everyone is tenant "")
    name: str = ""  # the caller's request_id for it, unique among its tenant's live sequences ("" = none)
    prompt_key: bytes = b""  # named ones: a digest of the tokens and adapter of the Prefill that made it
    adapter: str = ""  # the LoRA adapter it runs with ("" = the base model), and that adapter's content digest
    adapter_digest: str = ""
    # the weights version its oldest KV was computed under: a sequence older than the
    # serving weights holds KV they did not compute, so it publishes no prefix-cache block
    generation: int = 0
    # (start, end) of each Prefill that ran on it, in order: the penalties' prompt/output
    # split. Everything up to the last Prefill's end is prompt, what came after
    # (decode steps, verified drafts) is output; shrink keeps it consistent.
    prompt_spans: list[tuple[int, int]] = field(default_factory=list)
    # how many times its tokens changed (appended, matched from the prefix cache, cut):
    # an undo record applies only while the sequence is as the recorded call left it,
    # which its length alone cannot tell (cut back and grown to the same length again)
    changes: int = 0

    @property
    def output_start(self) -> int:
        """Where the output starts: tokens[:output_start] are prompt, the rest output."""
        return min(self.prompt_spans[-1][1], self.length) if self.prompt_spans else 0


@dataclass(frozen=True)
class SequenceView:
    """A sequence as it was when :meth:`BlockManager.snapshot` was taken (see :class:`SequenceState`)."""

    cache_id: str
    length: int
    block_ids: tuple[int, ...]
    tokens: tuple[int, ...]
    hashes: tuple[bytes, ...]
    last_used: float
    pins: int
    tenant: str
    prompt_spans: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class BlockSnapshot:
    """The manager's books at one moment, read-only: for tests and debugging."""

    sequences: Mapping[str, SequenceView]  # cache id -> sequence
    refs: tuple[int, ...]  # block -> how many sequences hold it (0: free)
    free: tuple[int, ...]  # the free blocks, in the order the free list hands them out
    hash_of: Mapping[int, bytes]  # prefix-cache index: block -> hash of its full content
    block_of: Mapping[bytes, int]  # and back: hash -> block
