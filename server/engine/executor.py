"""The torch executor: the Ferrum executor contract, in-process.

Every call validates, then plans (reserving KV room), then runs: a failed
call leaves every sequence exactly as it was.  Each change a call makes to a
sequence has its :class:`Undo` record, and :meth:`TorchExecutor.undo` is the
one way back, for a call that failed and for one whose caller went away.
It is not thread-safe by design: one model worker thread (``worker.py``)
makes every call, so the KV pool is never touched from two threads.

The executor's other concepts live beside it: ``forward.py`` (one forward over
any mix of steps), ``prompt.py`` (prompts in parts), ``speculative.py`` (the
speculative-sampling math) and ``stats.py`` (counters, memory accounting, the
load-time benchmark).
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Iterable

import torch

from ferrum_rpc.errors import ExecutorError
from ..choice.rows import row_max
from ferrum_rpc.rules import check_decode_batch, validate_token_choice
from ..config import ExecutorConfig, TenantBounds, tenant_bounds
from .adapters import Lora
from .weights import Weights
from .checks import Checks
from . import choosing
from . import describe
from . import speculating
from .forward import AppendPlan, PlanKind, Rows, Step, forward
from .opened import Opened
from .graphs import decode_graphs
from ..kv.pool import KV_TORCH_DTYPES, KvPool
from ..kv.blocks import BlockManager, SequenceState, WritePlan
from .undo import Undo
from ..kv.events import KvEventHub
from ..models import TORCH_DTYPES, load_model
from ..parallel import runner
from ..parallel.group import CURRENT
from ..parallel.shard import Shard
from .prompt import PromptInParts
from .sequences import Sequences
from .stats import Stats
from ferrum_rpc.types import (Capabilities, DecodeInput, DecodeOutput, ExecutorStatus, HiddenStatesRequest,
                              KvCacheHandle, Logits, LogitsKind, LogitsPolicy, MemoryRequirements, ModelInfo,
                              PrefillOutput, ServerState, SpeculativeOutput, SpeculativeSampling, Timing,
                              TokenChoice, VerifyOutput)

log = logging.getLogger(__name__)


def verify_policy(policy: LogitsPolicy) -> LogitsPolicy:
    """ForwardVerify's policy: the caller's, over every position."""
    return replace(policy, all_positions=True)


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
        self.kv_dtype = KV_TORCH_DTYPES[config.kv_dtype_name]  # the pool's (int8: quantized, kv/pool.py)
        self.max_seq_len = min(config.max_seq_len or mc.max_position_embeddings, mc.max_position_embeddings)
        # tensor parallel (parallel/): this rank's shard of the model and of the pool (its KV heads);
        # every forward and block copy goes through the runner, which sends it to the other ranks
        self.shard = getattr(model, "tp", None)
        self.kv_heads = mc.num_kv_heads // (self.shard.degree if self.shard else 1)
        num_blocks = -(-self._kv_tokens(config, mc) // config.block_size)
        self.kv = BlockManager(num_blocks, config.block_size, prefix_caching=config.prefix_caching)
        self.kv.events = KvEventHub(config.block_size)  # WatchKvEvents' subscribers
        self.pool = KvPool(mc.num_layers, num_blocks, config.block_size, self.kv_heads,
                           mc.head_dim, self.kv_dtype, self.device)
        self.runner = None
        self.graphs = decode_graphs(self, model)  # plain decode steps as CUDA graphs, or None
        if self.shard is not None:
            self.runner = runner.Runner(self.shard, self.device, forward)
            runner.send_pool(self.runner, num_blocks, config.block_size)
        self.stats = Stats(model, mc, self.kv, self.pool, self.dtype, self.kv_dtype)
        self.checks = Checks(mc, config, self.kv, self.max_seq_len, instance_id, self.bounds)
        self.optimal_batch_size = 0  # measured by crossover.measure_optimal_batch (the server's warm-up)
        self.weights = Weights()  # what it serves: checkpoint, updates on top, version and digest
        log.info("%s: KV pool of %d blocks x %d tokens (%.1f MiB of %s on %s)", name, num_blocks,
                 config.block_size, self.pool.nbytes / 2**20, config.kv_dtype_name, self.device)
        # LoRA adapters (none with tensor parallelism); self.adapters is their set, or None
        self.lora = Lora(model, config, self.kv, name, enabled=self.shard is None)
        self.adapters = self.lora.set
        self.seqs = Sequences(name, instance_id, mc, self.device, config, self.kv, self.pool, self.checks, self.lora,
                              self._copy_blocks, self.bounds, lambda: self.weights.version)
        self.lora.load_startup()

    def _kv_tokens(self, config: ExecutorConfig, mc) -> int:
        if not config.kv_memory_fraction:
            return config.kv_tokens
        if self.device.type == "cuda":
            available = torch.cuda.mem_get_info(self.device)[0]
        else:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        per_token = KvPool.bytes_per_token(mc.num_layers, self.kv_heads, mc.head_dim, self.kv_dtype)
        tokens = int(available * config.kv_memory_fraction) // per_token
        log.info("KV pool sized to %.0f%% of %.1f GiB available: %d tokens",
                 100 * config.kv_memory_fraction, available / 2**30, tokens)
        return max(tokens, config.block_size)

    @classmethod
    def from_path(cls, name: str, path: str | Path, config: ExecutorConfig,
                  instance_id: str | None = None) -> TorchExecutor:
        device = torch.device(config.device)
        shard = None
        if config.tensor_parallel > 1:  # rank 0 of a group that group.launch_local / group.join set up
            group = CURRENT["group"]
            device, shard = group.device(config.device), Shard.of_model(group.rank, group.degree, path)
        model = load_model(path, TORCH_DTYPES[config.dtype], device, config.linear_kernel, config.quantize,
                           config.step_ops, shard=shard, batch_invariant=config.batch_invariant)
        executor = cls(name, model, config, instance_id or uuid.uuid4().hex)
        executor.weights = Weights.of_folder(path)
        return executor

    # -- the contract's queries ----------------------------------------------------
    def info(self) -> ModelInfo:
        return describe.info(self)

    def capabilities(self) -> Capabilities:
        return describe.capabilities(self)

    def status(self, state: ServerState = ServerState.SERVING, queue_depth: int = 0,
               tenant: str = "") -> ExecutorStatus:
        return describe.status(self, state, queue_depth, self.bounds(tenant))

    def memory_requirements(self) -> MemoryRequirements:
        return self.stats.memory_requirements()

    def speculative_decode(self, token_id: int, draft: list[int], kv_cache: KvCacheHandle,
                           policy: LogitsPolicy | None = LogitsPolicy(), sampling: SpeculativeSampling | None = None,
                           tenant: str = "", choice: TokenChoice | None = None) -> SpeculativeOutput:
        return speculating.speculative_decode(self, token_id, draft, kv_cache, policy, sampling, tenant, choice)

    # -- the contract: validate, plan, run ------------------------------------------
    def prefill(self, token_ids: list[int], kv_cache: KvCacheHandle | None = None,
                policy: LogitsPolicy | None = LogitsPolicy(), hidden: HiddenStatesRequest | None = None,
                tenant: str = "", choice: TokenChoice | None = None, as_output: bool = False) -> PrefillOutput:
        """Runs a prompt (or the next part of one, when ``kv_cache`` is given), in
        forwards of up to ``config.prefill_chunk`` tokens.

        ``tenant`` (every call that names or makes a sequence takes it): whose the
        sequence is; another tenant's sequences are "not found" ("" = auth off).
        ``choice``: also choose the token after the prompt (``out.chosen``); with it,
        ``policy=None`` returns no logits. ``as_output``: the tokens are output for the
        penalties (verified drafts), not prompt."""
        prompt = self.open_prefill(token_ids, kv_cache, policy, hidden, tenant, choice=choice, as_output=as_output)
        try:
            while True:
                plan = prompt.next_part(self.config.prefill_chunk)
                t0 = time.perf_counter_ns()
                rows = self._run_one(plan)
                if (done := prompt.part_done(plan, rows, time.perf_counter_ns() - t0)) is not None:
                    return done
        except BaseException:
            prompt.abandon()
            raise

    def open_prefill(self, token_ids: list[int], kv_cache: KvCacheHandle | None = None,
                     policy: LogitsPolicy | None = LogitsPolicy(),
                     hidden: HiddenStatesRequest | None = None, tenant: str = "",
                     choice: TokenChoice | None = None, as_output: bool = False, name: str = "",
                     adapter: str = "") -> PromptInParts:
        """Validates a prefill and opens its sequence (taking any cached prefix),
        to be run in parts, each one step of some forward (see
        :class:`PromptInParts`); raises with no state change. ``policy=None``: the
        logits field was unset (full float32 rows, none with a ``choice``).  ``name``:
        the caller's request_id for a new sequence (see :meth:`release_named`);
        ``adapter``: the LoRA adapter a new sequence runs with."""
        if choice is not None:
            self.check_token_choice(choice)
        want_logits = policy is not None or choice is None
        policy = LogitsPolicy() if policy is None else policy
        if hidden is not None:  # the handle is resolved first: its claimed length is not to be trusted
            start = self.checks.resolve(kv_cache, tenant).length if kv_cache is not None else 0
            self.checks.hidden(hidden, len(token_ids), start)
        opened = self.seqs.open(token_ids, kv_cache, policy, tenant, reuse_prefix=hidden is None, name=name,
                                    adapter=adapter)
        self.kv.pin(opened.seq)
        return PromptInParts(self, opened, list(token_ids), policy, hidden, choice=choice,
                             want_logits=want_logits, as_output=as_output)

    @property
    def limits(self):
        """This server's facts the contract's rules read (:class:`ferrum_rpc.rules.Limits`)."""
        return self.checks.limits

    def check_token_choice(self, choice: TokenChoice, field: str = "token_choice") -> None:
        """INVALID_INPUT naming the first bad field of ``choice`` (reads no state: any thread)."""
        validate_token_choice(choice, self.model_config.vocab_size, field)

    def plan_part(self, opened: Opened, tokens: list[int], rows: Rows, policy: LogitsPolicy) -> AppendPlan:
        """Plans an opened prompt's next ``tokens`` (reserving their KV room); raises with
        nothing reserved."""
        return AppendPlan([self.seqs.step(opened, tokens, rows)], policy, PlanKind.PART)

    def plan_decode(self, inputs: list[DecodeInput], policy: LogitsPolicy | None, tenant: str = "") -> AppendPlan:
        """Validates a BatchDecode request and reserves its KV room; raises with no state change.
        ``policy=None``: the logits field was unset: full float32 rows for the items
        without a token_choice, none for those with one."""
        check_decode_batch([i.kv_cache.cache_id for i in inputs], self.limits)
        for n, item in enumerate(inputs):
            if item.token_choice is not None:
                self.check_token_choice(item.token_choice, "token_choice" if len(inputs) == 1
                                        else f"items[{n}].token_choice")
        wants = [policy is not None or item.token_choice is None for item in inputs]
        policy = LogitsPolicy() if policy is None else policy
        self.checks.policy(policy, 1)
        self.checks.tokens([i.token_id for i in inputs])
        seqs = [self.checks.resolve(i.kv_cache, tenant) for i in inputs]
        for seq in seqs:
            self.checks.length(seq.length, 1)
        steps: list[Step] = []
        try:
            for seq, item, want in zip(seqs, inputs, wants):
                steps.append(self.seqs.step(Opened(seq, False, 0, seq.length, seq.last_used), [item.token_id], Rows.LAST))
                steps[-1].choice, steps[-1].logits = item.token_choice, want
        except BaseException:
            self.seqs.unplan(steps)
            raise
        return AppendPlan(steps, policy, PlanKind.DECODE)

    def run(self, plans: list[AppendPlan]) -> list:
        """Runs planned appends, any mix of kinds and lengths, as ONE forward and one
        LM-head GEMM over just the rows the plans asked for (see ``forward.py``).

        If the forward fails, every sequence is put back as it was before its call
        and the error is raised.  Otherwise each plan's appends are committed and its
        result returned in order (see :class:`PlanKind`), except a plan whose own rows
        could not be served (a token choice over non-finite logits): its sequences
        are put back and its entry is the error, for its call alone.
        """
        steps = [s for p in plans for s in p.steps]
        t0 = time.perf_counter_ns()
        try:
            chosen = None
            if self.runner is None:
                logits = self.graphs.forward(steps) if self.graphs is not None and self.graphs.takes(steps) else None
                if logits is None:
                    logits = forward(self.model, self.pool, steps)
            else:  # token choice across the ranks' vocabulary slices unless whole rows are gathered anyway
                top = self._top_only(plans)
                requests = choosing.choice_requests(steps) if top is not None else None
                logits, chosen = self.runner.forward(self.model, self.pool, steps, top, requests)
        except BaseException as exc:
            self.seqs.unplan(steps)
            self.stats.failed = not isinstance(exc, (ExecutorError, GeneratorExit, KeyboardInterrupt))
            raise
        for step in steps:
            self.kv.commit(step.seq, step.start, step.tokens)
        self.stats.failed = False
        self.stats.count_forward(all(p.kind is PlanKind.DECODE for p in plans), time.perf_counter_ns() - t0,
                                 len(steps), sum(len(s.tokens) for s in steps))
        choosing.choose(steps, logits, chosen)
        timing = Timing(forward_ns=time.perf_counter_ns() - t0, batch_size=len(steps))
        results, at = [], 0  # each plan's rows in ``logits`` are adjacent
        for plan in plans:
            n = sum(step.rows.count(len(step.tokens)) for step in plan.steps)
            rows = logits[at:at + n] if n and logits is not None else None
            at += n
            if (failure := next((s.failure for s in plan.steps if s.failure is not None), None)) is not None:
                for step in plan.steps:  # this call alone fails, and changes nothing
                    self.undo([step.opened.undo_record])
                results.append(failure)
                continue
            if plan.kind is PlanKind.PART:
                results.append(rows)
                continue
            # the policy over the rows that go back as logits at once, then a row each
            wanted = [j for j, step in enumerate(plan.steps) if step.logits]
            both = None
            if wanted:
                both = self.apply_policy(rows if len(wanted) == len(plan.steps) else rows[wanted], plan.policy)
            outs, k = [], 0
            for step in plan.steps:
                got = None
                if step.logits:
                    got = Logits(both.kind, both.values[k:k + 1],
                                 None if both.token_ids is None else both.token_ids[k:k + 1], both.vocab_size)
                    k += 1
                outs.append(DecodeOutput(got, self.handle(step.seq), timing, chosen=step.chosen))
            results.append(outs)
        return results

    def _run_one(self, plan: AppendPlan):
        """:meth:`run` of one plan, its failure raised."""
        (result,) = self.run([plan])
        if isinstance(result, BaseException):
            raise result
        return result

    @staticmethod
    def _top_only(plans: list[AppendPlan]) -> int | None:
        """Tensor parallel: the k best per row every consumer of this forward's rows
        needs (ARGMAX 1, TOP_K k), so only those cross between ranks; None when some
        row goes back FULL (whole rows are gathered, and token choice runs on them);
        0 when no row goes back (token choice only: nothing but its reductions crosses)."""
        if not any(s.logits for p in plans for s in p.steps):
            return 0
        if any(p.policy.kind is LogitsKind.FULL and any(s.logits for s in p.steps) for p in plans):
            return None
        return max(p.policy.top_k if p.policy.kind is LogitsKind.TOP_K else 1 for p in plans)

    def undo(self, undos: Iterable[Undo]) -> None:
        """THE undo (``Sequences.undo``)."""
        self.seqs.undo(undos)

    def decode(self, token_id: int, kv_cache: KvCacheHandle,
               policy: LogitsPolicy | None = LogitsPolicy(), tenant: str = "",
               choice: TokenChoice | None = None) -> DecodeOutput:
        return self.batch_decode([DecodeInput(token_id, kv_cache, choice)], policy, tenant)[0]

    def batch_decode(self, inputs: list[DecodeInput], policy: LogitsPolicy | None = LogitsPolicy(),
                     tenant: str = "") -> list[DecodeOutput]:
        """One batched forward over sequences of any lengths."""
        return self._run_one(self.plan_decode(inputs, policy, tenant))

    def forward_verify(self, token_ids: list[int], kv_cache: KvCacheHandle,
                       policy: LogitsPolicy = LogitsPolicy(), tenant: str = "") -> VerifyOutput:
        """Appends N+1 tokens and returns N+1 logits rows: a continued prefill over
        every position (so a long verify runs in chunks like a prompt)."""
        out = self.prefill(token_ids, kv_cache, verify_policy(policy), tenant=tenant, as_output=True)
        return VerifyOutput(out.logits, out.kv_cache, out.timing)

    def truncate_kv(self, kv_cache: KvCacheHandle, new_length: int, tenant: str = "") -> KvCacheHandle:
        return self.seqs.truncate(kv_cache, new_length, tenant)

    def release_cache(self, cache_id: str, tenant: str = "") -> int:
        return self.seqs.release(cache_id, tenant)

    def release_named(self, name: str, tenant: str = "", aborted: bool = False) -> int:
        return self.seqs.release_named(name, tenant, aborted)

    def fork_cache(self, kv_cache: KvCacheHandle, num_children: int, tenant: str = "") -> list[KvCacheHandle]:
        return self.seqs.fork(kv_cache, num_children, tenant)

    def expire_idle(self) -> list[str]:
        return self.seqs.expire_idle()

    # -- internals ----------------------------------------------------------------
    def bounds(self, tenant: str) -> TenantBounds:
        """What ``tenant`` may hold at once on this executor (config.tenant_bounds)."""
        return tenant_bounds(self.config, tenant, self.kv.num_blocks * self.kv.block_size)

    def reserve(self, seq: SequenceState, tokens: int) -> WritePlan:
        return self.seqs.reserve(seq, tokens)

    def handle(self, seq: SequenceState) -> KvCacheHandle:
        return self.seqs.handle(seq)

    def _copy_blocks(self, copies: list) -> None:
        if self.runner is None:
            self.pool.copy_blocks(copies)
        else:
            self.runner.copy_blocks(self.pool, copies)

    def apply_policy(self, rows: torch.Tensor, policy: LogitsPolicy) -> Logits:
        """rows: (P, V) float32 on the device -> what the caller asked for, on the CPU."""
        vocab = rows.shape[-1]
        if policy.kind is LogitsKind.FULL:
            return Logits(LogitsKind.FULL, rows.to(TORCH_DTYPES[policy.dtype]).cpu(), None, vocab)
        if policy.kind is LogitsKind.ARGMAX:
            values, ids = row_max(rows)  # (P, 1): far cheaper than topk(1)
        else:
            values, ids = rows.topk(policy.top_k, dim=-1)  # (P, k) each, sorted
        return Logits(policy.kind, values.cpu(), ids.cpu().numpy(), vocab)
