"""What the model worker queues: a decode step, a prompt in parts, or a call, each a
:class:`Job` with its future, deadline, tenant and whether its caller still waits."""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any, Callable, NamedTuple

from ferrum_rpc.errors import Cancelled, DeadlineExceeded, ExecutorError
from ferrum_rpc.types import DecodeInput, HiddenStatesRequest, KvCacheHandle, LogitsPolicy
from .undo import Undo
from .prompt import PromptInParts


@dataclass(frozen=True)
class DecodeWork:
    """A decode step: one token for each sequence, and what each reply carries."""
    inputs: list[DecodeInput]
    policy: LogitsPolicy

    def undo_records(self, outs: list) -> list[Undo]:
        """Each sequence back to the length its input handle had (one record an input)."""
        return [Undo.of(i.kv_cache, o.kv_cache) for i, o in zip(self.inputs, outs)]


@dataclass(frozen=True)
class PromptWork:
    """A prompt, run in parts: its tokens, the sequence it continues (None: a new one),
    what its reply carries, the hidden states asked for, the token choice after it,
    and whether its tokens count as output for the penalties (ForwardVerify)."""
    token_ids: list[int]
    kv_cache: KvCacheHandle | None
    policy: LogitsPolicy
    hidden: HiddenStatesRequest | None = None
    choice: Any = None
    as_output: bool = False
    name: str = ""  # the caller's request_id for the sequence it creates
    adapter: str = ""  # the LoRA adapter the sequence it creates runs with


class Done(NamedTuple):
    """A finished call's result and the undo records that put back what it changed:
    the records its caller applies if the reply never goes out (see ``Undo``)."""
    out: Any
    undo_records: list[Undo]


@dataclass
class Job:
    """One queued piece of work: a call (``fn(*args)``), a decode step or a prompt."""
    fn: Callable[..., Any] | None
    args: tuple
    future: Future = field(default_factory=Future)
    enqueued_ns: int = field(default_factory=time.perf_counter_ns)
    decode: DecodeWork | None = None
    prefill: PromptWork | None = None
    prompt: PromptInParts | None = None  # once its first part is planned
    queue_ns: int = 0
    deadline: float | None = None  # time.monotonic() past which the caller no longer waits
    abandoned: bool = False  # the caller went away: stop before the next part and undo
    parked_at: float | None = None  # a prompt first found no room for the whole of it (see policy.take_prompts)
    tenant: str = ""  # who submitted it ("" = auth off): its sequences, its fair share
    run: Any = None  # the decode-ahead run (ahead.AheadRun) whose forward this decode job is

    @property
    def analysis(self) -> bool:
        """A prompt asking for hidden states: its parts run in forwards of their own."""
        return self.prefill is not None and self.prefill.hidden is not None

    def sequence(self) -> str | None:
        """The existing sequence a prompt continues (None: a new one)."""
        return self.prefill.kv_cache.cache_id if self.prefill and self.prefill.kv_cache is not None else None

    def gone(self) -> ExecutorError | None:
        """Why this job's caller no longer waits for it, or None while it does."""
        if self.abandoned:
            return Cancelled("the caller cancelled the call")
        if self.deadline is not None and time.monotonic() > self.deadline:
            return DeadlineExceeded("the caller's deadline passed; the work was undone")
        return None


def with_queue_time(result: Any, queue_ns: int) -> Any:
    """Stamps the queue time on an output (or a list of them); other results pass through."""
    if isinstance(result, list):
        return [with_queue_time(r, queue_ns) for r in result]
    if hasattr(result, "timing"):
        return replace(result, timing=replace(result.timing, queue_ns=queue_ns))
    return result
