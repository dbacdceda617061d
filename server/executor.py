"""The torch executor: the Ferrum executor contract, in-process.

Every public method validates first and mutates last, so a failed call leaves
every sequence exactly as it was.  It is not thread-safe by design: one model
worker thread (``worker.py``) makes every call, so the KV pool is never
touched from two threads.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Generator

import torch

from ferrum_rpc.errors import InvalidInput, LengthMismatch, SequenceTooLong, StaleHandle
from ferrum_rpc.server.config import ExecutorConfig
from ferrum_rpc.server.kv_cache import KvPool
from ferrum_rpc.server.kv_manager import BlockManager, SequenceState, WritePlan
from ferrum_rpc.server.models import load_model
from ferrum_rpc.types import (
    LOGITS_DTYPES,
    BlockTable,
    Capabilities,
    DecodeInput,
    DecodeOutput,
    ExecutorStatus,
    KvCacheHandle,
    Logits,
    LogitsKind,
    LogitsPolicy,
    ModelInfo,
    PrefillOutput,
    ServerState,
    Timing,
    VerifyOutput,
)

log = logging.getLogger(__name__)

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_WIRE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass
class _Step:
    """One sequence's part of a forward: tokens written from position ``start``."""

    seq: SequenceState
    tokens: list[int]
    start: int
    plan: WritePlan


@dataclass
class PrefillPlan:
    """A validated prefill whose KV room is reserved (see ``plan_prefill``)."""

    step: _Step
    policy: LogitsPolicy
    created: bool
    cached: int  # prompt tokens served from the prefix cache


@dataclass
class DecodePlan:
    """A validated BatchDecode request whose KV room is already reserved."""

    steps: list[_Step]
    policy: LogitsPolicy


class TorchExecutor:
    """Hosts one model and its KV pool.

    Args:
        name: the model name callers use.
        model: a loaded model (see ``models.load_model``).
        config: serving limits.
        instance_id: identifies this server process in handles.
    """

    def __init__(self, name: str, model: torch.nn.Module, config: ExecutorConfig, instance_id: str):
        self.name, self.model, self.config, self.instance_id = name, model, config, instance_id
        mc = model.config
        self.model_config = mc
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.max_seq_len = min(config.max_seq_len or mc.max_position_embeddings, mc.max_position_embeddings)
        num_blocks = -(-self._kv_tokens(config, mc) // config.block_size)
        self.kv = BlockManager(num_blocks, config.block_size, prefix_caching=config.prefix_caching)
        self.busy: set[str] = set()  # sequences in the middle of a chunked prefill
        self.pool = KvPool(mc.num_layers, num_blocks, config.block_size, mc.num_kv_heads,
                           mc.head_dim, self.dtype, self.device)
        self.forwards = 0
        self.tokens_processed = 0
        self.started = time.monotonic()
        log.info("%s: KV pool of %d blocks x %d tokens (%.1f MiB on %s)", name, num_blocks,
                 config.block_size, self.pool.nbytes / 2**20, self.device)

    def _kv_tokens(self, config: ExecutorConfig, mc) -> int:
        if not config.kv_memory_fraction:
            return config.kv_tokens
        if self.device.type == "cuda":
            available = torch.cuda.mem_get_info(self.device)[0]
        else:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        per_token = KvPool.bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim, self.dtype)
        tokens = int(available * config.kv_memory_fraction) // per_token
        log.info("KV pool sized to %.0f%% of %.1f GiB available: %d tokens",
                 100 * config.kv_memory_fraction, available / 2**30, tokens)
        return max(tokens, config.block_size)

    @classmethod
    def from_path(cls, name: str, path: str | Path, config: ExecutorConfig,
                  instance_id: str | None = None) -> TorchExecutor:
        device = torch.device(config.device)
        model = load_model(path, TORCH_DTYPES[config.dtype], device, config.linear_kernel)
        return cls(name, model, config, instance_id or uuid.uuid4().hex)

    # -- queries ---------------------------------------------------------------
    def info(self) -> ModelInfo:
        mc = self.model_config
        return ModelInfo(
            name=self.name, architecture=mc.architecture, vocab_size=mc.vocab_size,
            hidden_size=mc.hidden_size, num_layers=mc.num_layers, num_attention_heads=mc.num_heads,
            num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim, max_sequence_length=self.max_seq_len,
            dtype=self.config.dtype, device=str(self.device),
            parameter_count=getattr(self.model, "parameter_count", 0),
            eos_token_ids=mc.eos_token_ids, bos_token_id=mc.bos_token_id or 0,
        )

    def capabilities(self) -> Capabilities:
        return Capabilities(
            model=self.name, max_batch_size=self.config.max_batch_size,
            max_sequence_length=self.max_seq_len, kv_block_size=self.kv.block_size,
            kv_num_blocks=self.kv.num_blocks, kv_capacity_tokens=self.kv.num_blocks * self.kv.block_size,
            logits_kinds=tuple(LogitsKind), logits_dtypes=LOGITS_DTYPES, chunked_prefill=True,
            forward_verify=True, truncate_kv=True, max_message_bytes=self.config.max_message_bytes,
            idle_timeout_s=self.config.idle_timeout_s, prefill_chunk_tokens=self.config.prefill_chunk,
            decode_session=True, prefix_cache=self.config.prefix_caching, fork_cache=True,
            mixture_of_experts=self.model_config.num_experts > 0,
            architecture=self.model_config.architecture, kv_bytes=self.pool.nbytes,
            kernel_path=self.model.kernels.describe(), cpu_capability=self.model.kernels.cpu_capability,
        )

    def status(self, state: ServerState = ServerState.SERVING, queue_depth: int = 0) -> ExecutorStatus:
        return ExecutorStatus(
            state=state, server_instance_id=self.instance_id, model=self.name,
            kv_blocks_total=self.kv.num_blocks, kv_blocks_used=self.kv.num_used,
            kv_blocks_free=self.kv.num_free, active_sequences=len(self.kv), queue_depth=queue_depth,
            forwards=self.forwards, tokens_processed=self.tokens_processed,
            uptime_s=time.monotonic() - self.started, kv_blocks_shared=self.kv.num_shared,
            prefix_cache_queried_tokens=self.kv.queried_tokens, prefix_cache_hit_tokens=self.kv.hit_tokens,
            prefix_cache_hit_rate=self.kv.hit_tokens / self.kv.queried_tokens if self.kv.queried_tokens else 0.0,
            sequences_expired=self.kv.expired_count, kv_blocks_cached=self.kv.num_cached_free,
        )

    # -- the contract ------------------------------------------------------------
    def prefill(self, token_ids: list[int], kv_cache: KvCacheHandle | None = None,
                policy: LogitsPolicy = LogitsPolicy()) -> PrefillOutput:
        """Runs a prompt (or the next chunk of one, when ``kv_cache`` is given)."""
        steps = self.prefill_chunks(token_ids, kv_cache, policy)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value

    def prefill_chunks(self, token_ids: list[int], kv_cache: KvCacheHandle | None = None,
                       policy: LogitsPolicy = LogitsPolicy()) -> Generator[None, None, PrefillOutput]:
        """:meth:`prefill` in chunks of ``config.prefill_chunk`` tokens, yielding between them.

        The worker runs other callers' decodes at each yield.  If any chunk
        fails, every chunk is undone: the sequence is as it was before the call.
        """
        seq, created, cached = self._open_prefill(token_ids, kv_cache, policy)
        origin = seq.length - cached
        self.busy.add(seq.cache_id)
        hidden_rows, forward_ns, chunk = [], 0, self.config.prefill_chunk
        try:
            for offset in range(cached, len(token_ids), chunk):
                if offset > cached:
                    yield
                step = self._begin(seq, token_ids[offset:offset + chunk])
                hidden, ns = self._forward_or_undo([step])
                self._commit(step)
                forward_ns += ns
                if policy.all_positions:
                    hidden_rows.append(hidden[0])  # (T_chunk, C)
                else:
                    hidden_rows = [hidden[0, -1:]]  # only the prompt's last position counts
            t0 = time.perf_counter_ns()
            with torch.inference_mode():
                rows = torch.cat(hidden_rows) if len(hidden_rows) > 1 else hidden_rows[0]
                logits = self._apply_policy(self.model.logits(rows), policy)
            forward_ns += time.perf_counter_ns() - t0
        except BaseException:
            self._close_failed_prefill(seq, created, origin)
            raise
        finally:
            self.busy.discard(seq.cache_id)
        return PrefillOutput(logits, self._handle(seq), Timing(forward_ns=forward_ns, batch_size=1),
                             cached_tokens=cached)

    def plan_prefill(self, token_ids: list[int], kv_cache: KvCacheHandle | None,
                     policy: LogitsPolicy) -> PrefillPlan:
        """Validates a prefill that fits one forward and reserves its KV room; raises
        with no state change.  Plans from several callers run together in :meth:`run_prefills`."""
        seq, created, cached = self._open_prefill(token_ids, kv_cache, policy)
        try:
            step = self._begin(seq, token_ids[cached:])
        except BaseException:
            self._close_failed_prefill(seq, created, seq.length - cached)
            raise
        return PrefillPlan(step, policy, created, cached)

    def run_prefills(self, plans: list[PrefillPlan]) -> list[PrefillOutput]:
        """Runs planned prefills (any lengths) in ONE padded forward."""
        t0 = time.perf_counter_ns()
        try:
            hidden, _ = self._forward([p.step for p in plans])
        except BaseException:
            for plan in plans:
                self._abort(plan.step)
                self._close_failed_prefill(plan.step.seq, plan.created, plan.step.start - plan.cached)
            raise
        row_sets = []
        for b, plan in enumerate(plans):
            self._commit(plan.step)
            n = len(plan.step.tokens)
            row_sets.append(hidden[b, :n] if plan.policy.all_positions else hidden[b, n - 1:n])  # (P, C)
        with torch.inference_mode():  # one LM-head GEMM for every plan's rows
            logits = self.model.logits(torch.cat(row_sets)).split([len(r) for r in row_sets])
            results = [self._apply_policy(rows, plan.policy) for rows, plan in zip(logits, plans)]
        timing = Timing(forward_ns=time.perf_counter_ns() - t0, batch_size=len(plans))
        return [PrefillOutput(result, self._handle(plan.step.seq), timing, cached_tokens=plan.cached)
                for result, plan in zip(results, plans)]

    def _open_prefill(self, token_ids: list[int], kv_cache: KvCacheHandle | None,
                      policy: LogitsPolicy) -> tuple[SequenceState, bool, int]:
        """Validates a prefill and finds (or creates, taking any cached prefix) its sequence.

        Returns the sequence, whether it was created, and the prompt tokens served from cache.
        """
        self._check_tokens(token_ids)
        self._check_policy(policy, len(token_ids) if policy.all_positions else 1)
        seq = self._resolve(kv_cache) if kv_cache is not None else None
        self._check_length(seq.length if seq else 0, len(token_ids))
        if seq is not None:
            return seq, False, 0
        seq = self.kv.create(uuid.uuid4().hex)
        cached = 0
        if not policy.all_positions:  # a hit must leave the last token to compute
            cached = self.kv.adopt_prefix(seq, token_ids, len(token_ids) - 1)
        return seq, True, cached

    def _close_failed_prefill(self, seq: SequenceState, created: bool, origin: int) -> None:
        """Puts a sequence back as it was before a failed prefill (forgets it if new)."""
        if created:
            self.kv.release(seq.cache_id)
        else:
            self.kv.shrink(seq, origin)

    def decode(self, token_id: int, kv_cache: KvCacheHandle,
               policy: LogitsPolicy = LogitsPolicy()) -> DecodeOutput:
        return self.batch_decode([DecodeInput(token_id, kv_cache)], policy)[0]

    def batch_decode(self, inputs: list[DecodeInput], policy: LogitsPolicy = LogitsPolicy()) -> list[DecodeOutput]:
        """One batched forward over sequences of any lengths."""
        return self.run_decode([self.plan_decode(inputs, policy)])[0]

    def forward_verify(self, token_ids: list[int], kv_cache: KvCacheHandle,
                       policy: LogitsPolicy = LogitsPolicy()) -> VerifyOutput:
        """Appends N+1 tokens in one forward; returns N+1 logits rows."""
        self._check_tokens(token_ids)
        self._check_policy(policy, len(token_ids))
        seq = self._resolve(kv_cache)
        self._check_length(seq.length, len(token_ids))
        step = self._begin(seq, token_ids)
        t0 = time.perf_counter_ns()
        hidden, _ = self._forward_or_undo([step])
        self._commit(step)
        with torch.inference_mode():
            logits = self._apply_policy(self.model.logits(hidden[0]), policy)
        forward_ns = time.perf_counter_ns() - t0
        return VerifyOutput(logits, self._handle(seq), Timing(forward_ns=forward_ns, batch_size=1))

    def truncate_kv(self, kv_cache: KvCacheHandle, new_length: int) -> KvCacheHandle:
        seq = self._resolve(kv_cache)
        if not 0 <= new_length <= seq.length:
            raise InvalidInput(f"new_length {new_length} is outside 0..={seq.length}")
        self.kv.shrink(seq, new_length)
        return self._handle(seq)

    def release_cache(self, cache_id: str) -> int:
        """Forgets a sequence; returns how many blocks went back to the pool."""
        self._check_not_busy(cache_id)
        return self.kv.release(cache_id)

    def fork_cache(self, kv_cache: KvCacheHandle, num_children: int) -> list[KvCacheHandle]:
        """N new sequences sharing the parent's blocks; the first write to a shared block copies it."""
        if not 1 <= num_children <= self.config.max_batch_size:
            raise InvalidInput(f"num_children must be in 1..={self.config.max_batch_size}, got {num_children}")
        seq = self._resolve(kv_cache)
        children = self.kv.fork(seq, [uuid.uuid4().hex for _ in range(num_children)])
        return [self._handle(c) for c in children]

    def expire_idle(self) -> list[str]:
        """Reclaims sequences idle past ``config.idle_timeout_s``; returns their ids."""
        if not self.config.idle_timeout_s:
            return []
        expired = self.kv.expire_idle(self.config.idle_timeout_s)
        if expired:
            log.info("%s: reclaimed %d idle sequence(s)", self.name, len(expired))
        return expired

    # -- batched decode, in two halves so the worker can coalesce callers --------
    def plan_decode(self, inputs: list[DecodeInput], policy: LogitsPolicy) -> DecodePlan:
        """Validates a batch and reserves its KV room; raises with no state change."""
        if not inputs:
            raise InvalidInput("batch_decode needs at least one input")
        if len(inputs) > self.config.max_batch_size:
            raise InvalidInput(f"{len(inputs)} sequences exceed max batch size {self.config.max_batch_size}")
        self._check_policy(policy, 1)
        ids = [i.kv_cache.cache_id for i in inputs]
        if len(set(ids)) != len(ids):
            raise InvalidInput("a sequence appears more than once in one batch")
        self._check_tokens([i.token_id for i in inputs])
        seqs = [self._resolve(i.kv_cache) for i in inputs]
        for seq in seqs:
            self._check_length(seq.length, 1)
        steps: list[_Step] = []
        try:
            for seq, item in zip(seqs, inputs):
                steps.append(self._begin(seq, [item.token_id]))
        except Exception:
            for step in steps:
                self._abort(step)
            raise
        return DecodePlan(steps, policy)

    def run_decode(self, plans: list[DecodePlan]) -> list[list[DecodeOutput]]:
        """Runs every planned sequence in ONE forward; returns outputs per plan."""
        steps = [s for p in plans for s in p.steps]
        t0 = time.perf_counter_ns()
        hidden, _ = self._forward_or_undo(steps)
        with torch.inference_mode():
            rows = self.model.logits(hidden[:, -1])  # (B, V) float32
        forward_ns = time.perf_counter_ns() - t0  # the model and its LM head
        timing = Timing(forward_ns=forward_ns, batch_size=len(steps))
        results, i = [], 0
        for plan in plans:
            outs = []
            for step in plan.steps:
                self._commit(step)
                logits = self._apply_policy(rows[i:i + 1], plan.policy)
                outs.append(DecodeOutput(logits, self._handle(step.seq), timing))
                i += 1
            results.append(outs)
        return results

    # -- internals -----------------------------------------------------------------
    def _check_tokens(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise InvalidInput("no tokens given")
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidInput(f"token id {bad[0]} is outside the vocabulary (size {vocab})")

    def _check_policy(self, policy: LogitsPolicy, positions: int) -> None:
        vocab = self.model_config.vocab_size
        if policy.kind is LogitsKind.TOP_K and not 1 <= policy.top_k <= vocab:
            raise InvalidInput(f"top_k must be in 1..={vocab}, got {policy.top_k}")
        if policy.dtype not in LOGITS_DTYPES:
            raise InvalidInput(f"logits dtype must be one of {LOGITS_DTYPES}, got {policy.dtype!r}")
        if policy.kind is LogitsKind.FULL:
            size = positions * vocab * _WIRE_BYTES[policy.dtype]
            if size > self.config.max_message_bytes:
                raise InvalidInput(
                    f"full logits for {positions} positions need {size} bytes, over the "
                    f"{self.config.max_message_bytes}-byte message limit; ask for top-k or the last position"
                )

    def _resolve(self, handle: KvCacheHandle) -> SequenceState:
        if handle.server_instance_id != self.instance_id:
            raise StaleHandle(
                f"handle {handle.cache_id!r} was issued by server instance "
                f"{handle.server_instance_id!r}, this is {self.instance_id!r}"
            )
        seq = self.kv.get(handle.cache_id)
        self._check_not_busy(seq.cache_id)
        seq.last_used = time.monotonic()
        if handle.sequence_length != seq.length:
            raise LengthMismatch(
                f"handle says {handle.sequence_length} tokens, the server holds {seq.length} "
                f"for {handle.cache_id!r}"
            )
        return seq

    def _check_length(self, start: int, num_new: int) -> None:
        if start + num_new > self.max_seq_len:
            raise SequenceTooLong(
                f"{start} + {num_new} tokens exceed the maximum sequence length {self.max_seq_len}"
            )

    def _check_not_busy(self, cache_id: str) -> None:
        if cache_id in self.busy:
            raise InvalidInput(f"sequence {cache_id!r} is in the middle of a chunked prefill")

    def _begin(self, seq: SequenceState, tokens: list[int]) -> _Step:
        """Reserves room (and private copies of shared blocks) for ``tokens`` after seq's end."""
        start = seq.length
        plan = self.kv.prepare_write(seq, start, start + len(tokens))
        self.pool.copy_blocks(plan.copies)
        return _Step(seq, list(tokens), start, plan)

    def _abort(self, step: _Step) -> None:
        self.kv.undo_write(step.seq, step.plan)

    def _commit(self, step: _Step) -> None:
        self.kv.commit(step.seq, step.start, step.tokens)

    def _forward_or_undo(self, steps: list[_Step]) -> tuple[torch.Tensor, int]:
        try:
            return self._forward(steps)
        except BaseException:
            for step in steps:
                self._abort(step)
            raise

    def _forward(self, steps: list[_Step]) -> tuple[torch.Tensor, int]:
        """One forward over every step (ragged: shorter steps are padded, see KvBatch).

        Returns hidden states (B, T, C); step b's own rows are ``[:len(step.tokens)]``.
        """
        counts = [len(s.tokens) for s in steps]
        width = max(counts)
        t0 = time.perf_counter_ns()
        kv = self.pool.batch([s.seq.block_ids for s in steps], [s.start for s in steps], counts)
        ids = torch.tensor([s.tokens + [0] * (width - len(s.tokens)) for s in steps], device=self.device)
        with torch.inference_mode():
            hidden = self.model(ids, kv.positions, kv)  # (B, T, C)
        self.forwards += 1
        self.tokens_processed += sum(counts)
        return hidden, time.perf_counter_ns() - t0

    def _apply_policy(self, rows: torch.Tensor, policy: LogitsPolicy) -> Logits:
        """rows: (P, V) float32 on the device -> what the caller asked for, on the CPU."""
        vocab = rows.shape[-1]
        if policy.kind is LogitsKind.FULL:
            return Logits(LogitsKind.FULL, rows.to(TORCH_DTYPES[policy.dtype]).cpu(), None, vocab)
        if policy.kind is LogitsKind.ARGMAX:
            values, ids = rows.max(dim=-1, keepdim=True)  # (P, 1): far cheaper than topk(1)
        else:
            values, ids = rows.topk(policy.top_k, dim=-1)  # (P, k) each, sorted
        return Logits(policy.kind, values.cpu(), ids.cpu().numpy(), vocab)

    def _handle(self, seq: SequenceState) -> KvCacheHandle:
        mc = self.model_config
        return KvCacheHandle(
            cache_id=seq.cache_id, sequence_length=seq.length, num_layers=mc.num_layers,
            num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim, device=str(self.device),
            block_table=BlockTable(self.kv.block_size, tuple(seq.block_ids)),
            model=self.name, server_instance_id=self.instance_id,
        )
