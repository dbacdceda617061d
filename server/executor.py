"""The torch executor: the Ferrum executor contract, in-process.

Every public method validates first and mutates last, so a failed call leaves
every sequence exactly as it was.  It is not thread-safe by design: one model
worker thread (``worker.py``) makes every call, so the KV pool is never
touched from two threads.
"""

from __future__ import annotations

import collections
import logging
import math
import os
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from ferrum_rpc.errors import (
    ExecutorError,
    InvalidInput,
    KvCapacityExhausted,
    LengthMismatch,
    SequenceLimitExceeded,
    SequenceTooLong,
    StaleHandle,
    TenantQuotaExceeded,
    shown,
)
from ferrum_rpc.server.auth import current_tenant
from ferrum_rpc.server.config import ExecutorConfig
from ferrum_rpc.server.kv_cache import KvPool, RaggedBatch
from ferrum_rpc.server.kv_manager import BlockManager, SequenceState, WritePlan
from ferrum_rpc.server.models import load_model
from ferrum_rpc.types import (
    LOGITS_DTYPES,
    BlockTable,
    Capabilities,
    DecodeInput,
    DecodeOutput,
    ExecutorState,
    ExecutorStatus,
    HiddenStatesRequest,
    KvCacheHandle,
    Logits,
    LogitsKind,
    LogitsPolicy,
    MemoryRequirements,
    ModelInfo,
    PrefillOutput,
    ServerState,
    SpeculativeOutput,
    SpeculativeSampling,
    Timing,
    VerifyOutput,
)

log = logging.getLogger(__name__)

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_WIRE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
_SCORED_ENTRY_BYTES = 4 + 5  # TOP_K/ARGMAX: a float32 score and a varint token id (<= 5 bytes)
MAX_ID_BYTES = 128  # longest cache id accepted (ours are 32 hex digits)


@dataclass
class _Opened:
    """A validated call's sequence and what is needed to put it back as it was."""

    seq: SequenceState
    created: bool  # the call made the sequence: a failure forgets it
    cached: int  # prompt tokens served from the prefix cache
    origin: int  # the sequence's length before the call
    clock: float  # its idle clock before the call (a failure leaves it untouched)


@dataclass
class _Step:
    """One sequence's part of a forward: ``tokens`` written from position ``start``."""

    opened: _Opened  # the call it belongs to: a failure puts the sequence back to that
    tokens: list[int]
    start: int
    plan: WritePlan  # the KV room reserved for it
    rows: str  # hidden rows that go through the LM head: "all", "last" or "none"
    # analysis: layer -> this step's hidden states (T, C), filled by run() for the layers asked
    hidden: dict[int, torch.Tensor | None] | None = None
    # analysis: decoder layer -> this step's attention weights (H, T, start + T) of the heads asked
    attention: dict[int, torch.Tensor | None] | None = None
    heads: tuple[int, ...] = ()

    @property
    def seq(self) -> SequenceState:
        return self.opened.seq


@dataclass
class AppendPlan:
    """Validated appends whose KV room is reserved: ``TorchExecutor.run`` runs any
    number of plans (prefills, decodes, verifies, prompt chunks) as one forward.

    ``kind`` says what the plan's result is: "prefill" (one step -> a
    PrefillOutput), "decode" (a DecodeOutput per step) or "chunk" (one step ->
    its float32 logits rows, or None when it asked for none).
    """

    steps: list[_Step]
    policy: LogitsPolicy
    kind: str


# Below this temperature sampling is greedy (vLLM's _SAMPLING_EPS): logits / T would
# overflow float32 (1e-40 makes every finite logit inf and the softmax NaN).
GREEDY_BELOW_TEMPERATURE = 1e-5


def _target_probs(rows: torch.Tensor, sampling: SpeculativeSampling) -> torch.Tensor:
    """rows (P, V) float32 logits -> the target's sampling distribution per row."""
    logits = rows / sampling.temperature
    if 0 < sampling.top_k < logits.shape[-1]:
        kth = logits.topk(sampling.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(dim=-1)
    if 0 < sampling.top_p < 1:
        ordered, order = probs.sort(dim=-1, descending=True)
        drop = ordered.cumsum(dim=-1) - ordered >= sampling.top_p  # keep the smallest set reaching top_p
        probs = probs.scatter(-1, order, ordered.masked_fill(drop, 0.0))
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def _accept_sampled(rows: torch.Tensor, draft: list[int], sampling: SpeculativeSampling) -> tuple[int, int]:
    """Speculative sampling for drafts proposed with certainty: draft i is kept with
    probability p_i(draft i); at the first rejection the next token is drawn from p_i
    without the rejected token, else from the row after the last draft.  Returns
    (drafts kept, next token)."""
    generator = torch.Generator().manual_seed(sampling.seed)
    probs = _target_probs(rows.float().cpu(), sampling)
    for i, token in enumerate(draft):
        if torch.rand((), generator=generator).item() < probs[i, token].item():
            continue
        residual = probs[i].clone()
        residual[token] = 0.0
        return i, int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
    return len(draft), int(torch.multinomial(probs[len(draft)], 1, generator=generator))


def resident_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weights as they sit in memory: every parameter and buffer, and the
    packed copies packed linears run on, each storage counted once."""
    seen: dict[int, int] = {}
    for module in model.modules():
        tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        packed = getattr(module, "packed", None)
        if isinstance(packed, torch.Tensor):
            tensors.append(packed)
        for t in tensors:
            if t.layout != torch.strided or t.is_mkldnn:  # opaque (oneDNN-packed): no storage to share
                seen[id(t)] = t.numel() * t.element_size()
            else:
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def _process_rss_bytes() -> int:
    """This process's resident memory (Linux), or 0."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def verify_policy(policy: LogitsPolicy) -> LogitsPolicy:
    """ForwardVerify's policy: the caller's, over every position."""
    return replace(policy, all_positions=True)


class PromptInParts:
    """A prompt run in parts, each part one step of a forward that may carry
    other work (decodes, other prompts' parts): the unified forward.

    The worker asks for the next part with the tokens it may take this step
    (:meth:`next_part`, which reserves the part's KV room), runs the plan with
    whatever else shares the forward, and hands back the part's rows
    (:meth:`part_done`), which returns the PrefillOutput after the last part.
    The sequence is pinned meanwhile, so the idle reaper never takes it; if a
    part fails, or the caller goes away between parts, :meth:`abort` undoes
    every part: the sequence is as it was before the call, idle clock
    included.
    """

    def __init__(self, executor: TorchExecutor, opened: _Opened, tokens: list[int], policy: LogitsPolicy,
                 hidden: HiddenStatesRequest | None):
        self.executor, self.opened, self.tokens, self.policy, self.hidden = executor, opened, tokens, policy, hidden
        self.offset = opened.cached  # tokens done (cached prefix included)
        self.rows: list[torch.Tensor] = []
        self.states: dict[int, list[torch.Tensor]] = {layer: [] for layer in (hidden.layers if hidden else ())}
        self.weights: dict[int, list[torch.Tensor]] = {layer: [] for layer in
                                                       (hidden.attention_layers if hidden else ())}
        self.forward_ns = 0
        self.open = True

    @property
    def remaining(self) -> int:
        return len(self.tokens) - self.offset

    @property
    def analysis(self) -> bool:
        """Asks for hidden states: its parts run in forwards of their own."""
        return self.hidden is not None

    def next_part(self, max_tokens: int) -> AppendPlan:
        """Plans the next ``min(max_tokens, remaining)`` tokens (reserving KV room); raises with
        nothing reserved (the caller then aborts the whole prompt)."""
        n = min(max_tokens, self.remaining)
        final = n == self.remaining
        want = "all" if self.policy.all_positions else "last" if final else "none"
        step = self.executor._step(self.opened, self.tokens[self.offset:self.offset + n], want)
        step.hidden = dict.fromkeys(self.states) if self.states else None
        if self.weights:
            step.attention, step.heads = dict.fromkeys(self.weights), tuple(self.hidden.attention_heads)
        return AppendPlan([step], self.policy, "chunk")

    def part_done(self, plan: AppendPlan, rows: torch.Tensor | None,
                  forward_ns: int = 0, batch_size: int = 1) -> PrefillOutput | None:
        """Takes a run part's rows; returns the output once the prompt is complete."""
        (step,) = plan.steps
        self.offset += len(step.tokens)
        self.forward_ns += forward_ns
        if rows is not None:
            self.rows.append(rows)
        for layer in self.states:
            self.states[layer].append(step.hidden[layer])
        for layer in self.weights:
            self.weights[layer].append(step.attention[layer])
        if self.remaining:
            return None
        ex, hidden = self.executor, self.hidden
        try:
            logits = ex._apply_policy(torch.cat(self.rows) if len(self.rows) > 1 else self.rows[0], self.policy)
            picked = list(hidden.positions) if hidden and hidden.positions else slice(None)
            states = tuple(torch.cat(self.states[layer])[picked].numpy() for layer in (hidden.layers if hidden else ()))
            length = self.opened.seq.length  # earlier parts saw fewer keys: zero-padded (causal) to all of them
            weights = tuple(torch.cat([F.pad(w, (0, length - w.shape[-1])) for w in self.weights[layer]], dim=1)
                            [:, picked].numpy() for layer in (hidden.attention_layers if hidden else ()))
        except BaseException:
            self.abort()
            raise
        self.open = False
        ex.kv.unpin(self.opened.seq, touch=True)
        return PrefillOutput(logits, ex._handle(self.opened.seq), Timing(forward_ns=self.forward_ns,
                                                                         batch_size=batch_size),
                             cached_tokens=self.opened.cached, hidden_states=states, attention_weights=weights)

    def abort(self) -> None:
        """Undoes every part run so far (safe to call twice, and after a failed forward)."""
        if self.open:
            self.open = False
            self.executor.kv.unpin(self.opened.seq, touch=False)
            self.executor._rollback(self.opened)


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
        self.pool = KvPool(mc.num_layers, num_blocks, config.block_size, mc.num_kv_heads,
                           mc.head_dim, self.dtype, self.device)
        self.forwards = 0
        self.tokens_processed = 0
        self.batch_sizes: collections.Counter[int] = collections.Counter()  # forwards by sequences in them
        self.started = time.monotonic()
        # Forwards by kind (prompt tokens in them, or decodes only): count and wall time.
        self.op_counts: collections.Counter[str] = collections.Counter()
        self.op_ns: collections.Counter[str] = collections.Counter()
        self.failed = False  # the last forward failed outside the error table
        self.parameter_bytes = resident_weight_bytes(model)
        self.block_bytes = KvPool.bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim,
                                                  self.dtype) * config.block_size
        self.memory_peak = self.parameter_bytes
        self.overhead_bytes = max(0, _process_rss_bytes() - self.parameter_bytes - self.pool.nbytes)
        self.optimal_batch_size = 0  # measured by measure_optimal_batch (the server's warm-up)
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
        model = load_model(path, TORCH_DTYPES[config.dtype], device, config.linear_kernel, config.quantize,
                           config.step_ops)
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
        mc = self.model_config
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
            quantization=self.config.quantize,
            attention_mechanisms=("causal", "rotary", "paged",
                                  "grouped-query" if mc.num_kv_heads < mc.num_heads else "multi-head"),
            supported_dtypes=tuple(d for d in TORCH_DTYPES if d != "float16"),
            supported_devices=("cpu", "cuda") if torch.cuda.is_available() else ("cpu",),
            memory=self.memory_requirements(), optimal_batch_size=self.optimal_batch_size,
        )

    def memory_requirements(self) -> MemoryRequirements:
        mc = self.model_config
        element = torch.tensor([], dtype=self.dtype).element_size()
        q_kv = (mc.num_heads + 2 * mc.num_kv_heads) * mc.head_dim
        intermediate = getattr(mc, "intermediate_size", 0) or 0
        return MemoryRequirements(
            parameter_bytes=self.parameter_bytes,
            kv_bytes_per_token_per_layer=KvPool.bytes_per_token(1, mc.num_kv_heads, mc.head_dim, self.dtype),
            activation_bytes_per_token=(4 * mc.hidden_size + q_kv + 3 * intermediate) * element + mc.vocab_size * 4,
            overhead_bytes=self.overhead_bytes, num_layers=mc.num_layers)

    def measure_optimal_batch(self, repeats: int = 3) -> int:
        """The decode crossover: times one decode step at batch 1, 2, 4, ... (as far as
        the batch limit and the pool allow) and returns the batch past which doubling
        raises throughput by less than 10%.  Uses (and releases) sequences of its own."""
        sizes, block = [1], self.kv.block_size
        room = self.kv.num_free // -(-(block + repeats * 7) // block)  # blocks one sequence may reach
        limit = min(self.config.max_batch_size, room, 64, self.config.max_sequences or 64,
                    self.config.tenant_max_sequences or 64)
        while sizes[-1] * 2 <= limit:
            sizes.append(sizes[-1] * 2)
        handles, best, step_s = [], sizes[0], {}
        counters = (self.forwards, self.tokens_processed, self.batch_sizes.copy(), self.op_counts.copy(),
                    self.op_ns.copy(), self.memory_peak, self.kv.queried_tokens, self.kv.hit_tokens)
        try:
            for _ in range(sizes[-1]):
                handles.append(self.prefill([0] * block, None, LogitsPolicy.argmax()).kv_cache)
            for size in sizes:
                times = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    outs = self.batch_decode([DecodeInput(0, h) for h in handles[:size]], LogitsPolicy.argmax())
                    times.append(time.perf_counter() - t0)
                    handles[:size] = [o.kv_cache for o in outs]
                step_s[size] = sorted(times)[len(times) // 2]
                if size > 1 and (size / step_s[size]) < 1.1 * (size // 2 / step_s[size // 2]):
                    break
                best = size
        except ExecutorError as exc:  # a pool or caps too small to measure: say so, serve anyway
            log.warning("%s: decode crossover not measured: %s", self.name, exc)
            return 0
        finally:
            for h in handles:
                self.release_cache(h.cache_id)
            # the measurement is not callers' work: the statistics do not count it
            (self.forwards, self.tokens_processed, self.batch_sizes, self.op_counts, self.op_ns, self.memory_peak,
             self.kv.queried_tokens, self.kv.hit_tokens) = counters
        self.optimal_batch_size = best
        log.info("%s: decode crossover at batch %d (step ms by batch: %s)", self.name, best,
                 ", ".join(f"{b}: {1e3 * t:.1f}" for b, t in step_s.items()))
        return best

    def status(self, state: ServerState = ServerState.SERVING, queue_depth: int = 0) -> ExecutorStatus:
        used, allocated = self._memory_used(), self.parameter_bytes + self.pool.nbytes
        return ExecutorStatus(
            state=state, server_instance_id=self.instance_id, model=self.name,
            kv_blocks_total=self.kv.num_blocks, kv_blocks_used=self.kv.num_used,
            kv_blocks_free=self.kv.num_free, active_sequences=len(self.kv), queue_depth=queue_depth,
            forwards=self.forwards, tokens_processed=self.tokens_processed,
            uptime_s=time.monotonic() - self.started, kv_blocks_shared=self.kv.num_shared,
            prefix_cache_queried_tokens=self.kv.queried_tokens, prefix_cache_hit_tokens=self.kv.hit_tokens,
            prefix_cache_hit_rate=self.kv.hit_tokens / self.kv.queried_tokens if self.kv.queried_tokens else 0.0,
            sequences_expired=self.kv.expired_count, kv_blocks_cached=self.kv.num_cached_free,
            executor_state=self._executor_state(state, queue_depth),
            prefill_operations=self.op_counts["prefill"], decode_operations=self.op_counts["decode"],
            avg_prefill_ms=self._avg_ms("prefill"), avg_decode_ms=self._avg_ms("decode"),
            memory_allocated_bytes=allocated, memory_used_bytes=used, memory_peak_bytes=self.memory_peak,
            memory_utilization=used / allocated,
        )

    def _memory_used(self) -> int:
        used = self.parameter_bytes + self.kv.num_used * self.block_bytes
        self.memory_peak = max(self.memory_peak, used)
        return used

    def _avg_ms(self, kind: str) -> float:
        return self.op_ns[kind] / self.op_counts[kind] / 1e6 if self.op_counts[kind] else 0.0

    def _executor_state(self, state: ServerState, queue_depth: int) -> ExecutorState:
        if state is ServerState.LOADING:
            return ExecutorState.INITIALIZING
        if state is ServerState.DRAINING:
            return ExecutorState.SHUTDOWN
        if self.failed:
            return ExecutorState.ERROR
        return ExecutorState.BUSY if queue_depth else ExecutorState.READY

    # -- the contract ------------------------------------------------------------
    def prefill(self, token_ids: list[int], kv_cache: KvCacheHandle | None = None,
                policy: LogitsPolicy = LogitsPolicy(), hidden: HiddenStatesRequest | None = None) -> PrefillOutput:
        """Runs a prompt (or the next part of one, when ``kv_cache`` is given), in
        forwards of up to ``config.prefill_chunk`` tokens."""
        prompt = self.open_prefill(token_ids, kv_cache, policy, hidden)
        try:
            while True:
                plan = prompt.next_part(self.config.prefill_chunk)
                t0 = time.perf_counter_ns()
                (rows,) = self.run([plan])
                if (done := prompt.part_done(plan, rows, time.perf_counter_ns() - t0)) is not None:
                    return done
        except BaseException:
            prompt.abort()
            raise

    def open_prefill(self, token_ids: list[int], kv_cache: KvCacheHandle | None = None,
                     policy: LogitsPolicy = LogitsPolicy(),
                     hidden: HiddenStatesRequest | None = None) -> PromptInParts:
        """Validates a prefill and opens its sequence (taking any cached prefix),
        to be run in parts, each one step of some forward (see
        :class:`PromptInParts`); raises with no state change."""
        if hidden is not None:  # the handle is resolved first: its claimed length is not to be trusted
            self._check_hidden(hidden, len(token_ids), self._resolve(kv_cache).length if kv_cache is not None else 0)
        opened = self._open_prefill(token_ids, kv_cache, policy, reuse_prefix=hidden is None)
        self.kv.pin(opened.seq)
        return PromptInParts(self, opened, list(token_ids), policy, hidden)

    def _check_hidden(self, hidden: HiddenStatesRequest, tokens: int, start: int) -> None:
        """Validates an analysis request for ``tokens`` tokens after ``start`` and that
        its tensors fit the message limit (no state read)."""
        mc = self.model_config
        layers, heads = mc.num_layers, mc.num_heads
        if not hidden.layers and not hidden.attention_layers:
            raise InvalidInput("hidden_states asks for nothing: give layers, attention_layers or both")
        if bad := [layer for layer in hidden.layers if not 0 <= layer <= layers]:
            raise InvalidInput(f"hidden_states.layers must be in 0..={layers}, got {bad[:8]}")
        if bad := [layer for layer in hidden.attention_layers if not 0 <= layer < layers]:
            raise InvalidInput(f"hidden_states.attention_layers must be in 0..{layers - 1}, got {bad[:8]}")
        if bad := [h for h in hidden.attention_heads if not 0 <= h < heads]:
            raise InvalidInput(f"hidden_states.attention_heads must be in 0..{heads - 1}, got {bad[:8]}")
        if hidden.attention_heads and not hidden.attention_layers:
            raise InvalidInput("hidden_states.attention_heads needs attention_layers")
        if bad := [p for p in hidden.positions if not 0 <= p < tokens]:
            raise InvalidInput(f"hidden_states.positions must be in 0..{tokens - 1}, got {bad[:8]}")
        rows = len(hidden.positions) or tokens
        size = 4 * rows * (len(hidden.layers) * mc.hidden_size
                           + len(hidden.attention_layers) * (len(hidden.attention_heads) or heads) * (start + tokens))
        if size > self.config.max_message_bytes:
            raise InvalidInput(f"hidden states of {len(hidden.layers)} layers and attention weights of "
                               f"{len(hidden.attention_layers)} layers at {rows} positions need {size} bytes, over "
                               f"the {self.config.max_message_bytes}-byte message limit; ask for fewer layers, "
                               "heads or positions")

    def plan_prefill(self, token_ids: list[int], kv_cache: KvCacheHandle | None,
                     policy: LogitsPolicy) -> AppendPlan:
        """Validates a prefill that fits one forward and reserves its KV room; raises
        with no state change."""
        opened = self._open_prefill(token_ids, kv_cache, policy)
        try:
            step = self._step(opened, token_ids[opened.cached:], "all" if policy.all_positions else "last")
        except BaseException:
            self._rollback(opened)
            raise
        return AppendPlan([step], policy, "prefill")

    def plan_decode(self, inputs: list[DecodeInput], policy: LogitsPolicy) -> AppendPlan:
        """Validates a BatchDecode request and reserves its KV room; raises with no state change."""
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
                steps.append(self._step(_Opened(seq, False, 0, seq.length, seq.last_used), [item.token_id], "last"))
        except BaseException:
            for step in steps:
                self._rollback(step.opened, step.plan)
            raise
        return AppendPlan(steps, policy, "decode")

    def run(self, plans: list[AppendPlan]) -> list:
        """Runs planned appends, any mix of kinds and lengths, as ONE (padded) forward
        and one LM-head GEMM over just the rows the plans asked for.

        Either every plan's appends are committed, or (on any failure) every
        sequence is put back as it was before its call.  Returns each plan's
        result in order (see :class:`AppendPlan`).
        """
        steps = [s for p in plans for s in p.steps]
        t0 = time.perf_counter_ns()
        try:
            hidden, firsts = self._forward(steps)  # (N, C), each step's first row
            picked = []
            for first, step in zip(firsts, steps):
                n = len(step.tokens)
                if step.rows != "none":
                    picked.append(hidden[first:first + n] if step.rows == "all" else hidden[first + n - 1:first + n])
            with torch.inference_mode():
                logits = self.model.logits(torch.cat(picked) if len(picked) > 1 else picked[0]) if picked else None
        except BaseException as exc:
            for step in steps:
                self._rollback(step.opened, step.plan)
            self.failed = not isinstance(exc, (ExecutorError, GeneratorExit, KeyboardInterrupt))
            raise
        for step in steps:
            self.kv.commit(step.seq, step.start, step.tokens)
        self.failed = False
        kind = "decode" if all(p.kind == "decode" for p in plans) else "prefill"
        self.op_counts[kind] += 1
        self.op_ns[kind] += time.perf_counter_ns() - t0
        self._memory_used()
        self.forwards += 1
        self.tokens_processed += sum(len(s.tokens) for s in steps)
        self.batch_sizes[len(steps)] += 1
        timing = Timing(forward_ns=time.perf_counter_ns() - t0, batch_size=len(steps))
        spans, at = [], 0  # each step's rows in ``logits``: (start, end), empty for "none"
        for step in steps:
            n = 0 if step.rows == "none" else len(step.tokens) if step.rows == "all" else 1
            spans.append((at, at + n))
            at += n
        results, i = [], 0
        for plan in plans:
            start, end = spans[i][0], spans[i + len(plan.steps) - 1][1]  # a plan's rows are adjacent
            rows = logits[start:end] if end > start else None
            i += len(plan.steps)
            if plan.kind == "chunk":
                results.append(rows)
            elif plan.kind == "prefill":
                step = plan.steps[0]
                results.append(PrefillOutput(self._apply_policy(rows, plan.policy), self._handle(step.seq),
                                             timing, cached_tokens=step.opened.cached))
            else:  # the policy over all of the plan's rows at once, then a row each
                both = self._apply_policy(rows, plan.policy)
                results.append([DecodeOutput(Logits(both.kind, both.values[j:j + 1],
                                                    None if both.token_ids is None else both.token_ids[j:j + 1],
                                                    both.vocab_size), self._handle(step.seq), timing)
                                for j, step in enumerate(plan.steps)])
        return results

    def _open_prefill(self, token_ids: list[int], kv_cache: KvCacheHandle | None,
                      policy: LogitsPolicy, reuse_prefix: bool = True) -> _Opened:
        """Validates a prefill and finds (or creates, taking any cached prefix) its sequence."""
        self._check_tokens(token_ids)
        self._check_policy(policy, len(token_ids) if policy.all_positions else 1)
        seq = self._resolve(kv_cache) if kv_cache is not None else None
        start = seq.length if seq else 0
        self._check_length(start, len(token_ids))
        self._check_fits_pool(start + len(token_ids))
        if seq is not None:
            return _Opened(seq, False, 0, seq.length, seq.last_used)
        tenant = current_tenant.get()
        self._check_sequence_room(tenant, 1)
        seq = self.kv.create(uuid.uuid4().hex, tenant)
        cached = 0
        if reuse_prefix and not policy.all_positions:  # a hit must leave the last token to compute
            cached = self.kv.adopt_prefix(seq, token_ids, len(token_ids) - 1)
        return _Opened(seq, True, cached, 0, seq.last_used)

    def _rollback(self, opened: _Opened, write: WritePlan | None = None) -> None:
        """THE rollback: gives back a reserved ``write`` (if any) and puts the
        sequence back as it was before its call (forgotten if the call made it).
        Safe to call twice for one call."""
        seq = opened.seq
        if write is not None:
            self.kv.undo_write(seq, write)
        if opened.created:
            if seq.cache_id in self.kv and self.kv.get(seq.cache_id) is seq:
                self.kv.release(seq.cache_id)
        elif seq.length >= opened.origin:
            self.kv.shrink(seq, opened.origin, touch=False)
            seq.last_used = opened.clock

    def undo_calls(self, changes: list[tuple]) -> None:
        """Puts back what finished calls did when their callers never got the reply
        (cancelled, deadline passed, disconnected): each ``(cache_id, length)``
        sequence is forgotten if ``length`` is None (the call created it), else
        truncated back to ``length``.  Sequences already gone are skipped, and so
        is a ``(cache_id, length, left_at)`` whose sequence is no longer at the
        length ``left_at`` the call left it (a later call moved it on)."""
        for cache_id, length, *left_at in changes:
            if cache_id not in self.kv:
                continue
            seq = self.kv.get(cache_id)
            if left_at and seq.length != left_at[0]:
                continue
            if length is None:
                self.kv.release(cache_id)
            elif length <= seq.length:
                self.kv.shrink(seq, length, touch=False)

    def decode(self, token_id: int, kv_cache: KvCacheHandle,
               policy: LogitsPolicy = LogitsPolicy()) -> DecodeOutput:
        return self.batch_decode([DecodeInput(token_id, kv_cache)], policy)[0]

    def batch_decode(self, inputs: list[DecodeInput], policy: LogitsPolicy = LogitsPolicy()) -> list[DecodeOutput]:
        """One batched forward over sequences of any lengths."""
        return self.run([self.plan_decode(inputs, policy)])[0]

    def forward_verify(self, token_ids: list[int], kv_cache: KvCacheHandle,
                       policy: LogitsPolicy = LogitsPolicy()) -> VerifyOutput:
        """Appends N+1 tokens and returns N+1 logits rows: a continued prefill over
        every position (so a long verify runs in chunks like a prompt)."""
        out = self.prefill(token_ids, kv_cache, verify_policy(policy))
        return VerifyOutput(out.logits, out.kv_cache, out.timing)

    def speculative_decode(self, token_id: int, draft: list[int], kv_cache: KvCacheHandle,
                           policy: LogitsPolicy = LogitsPolicy(),
                           sampling: SpeculativeSampling | None = None) -> SpeculativeOutput:
        """One round of greedy speculative decoding: ``token_id`` and the drafts in one
        forward, the longest prefix of drafts equal to greedy's choices kept, the
        rest truncated, and the logits after the kept ones in ``policy``.  Fails
        with no state change; it is one worker job, so nobody sees the drafts' KV."""
        if len(draft) + 1 > self.config.prefill_chunk:
            raise InvalidInput(f"{len(draft)} drafts exceed {self.config.prefill_chunk - 1} (one forward's chunk)")
        self._check_policy(policy, 1)
        if sampling is not None:
            if not (math.isfinite(sampling.temperature) and sampling.temperature > 0 and 0 <= sampling.top_p <= 1
                    and sampling.top_k >= 0):
                raise InvalidInput("sampling needs a finite temperature > 0, top_k >= 0 and top_p in [0, 1]")
            if sampling.temperature < GREEDY_BELOW_TEMPERATURE:  # logits / T would overflow float32: greedy
                sampling = None
        base = kv_cache.sequence_length
        out = self.prefill([token_id] + list(draft), kv_cache, LogitsPolicy(LogitsKind.FULL, all_positions=True))
        try:
            return self._accept_drafts(out, draft, base, policy, sampling)
        except BaseException:  # whatever fails after the forward: the sequence is put back as it was
            self.undo_calls([(out.kv_cache.cache_id, base)])
            raise

    def _accept_drafts(self, out: PrefillOutput, draft: list[int], base: int, policy: LogitsPolicy,
                       sampling: SpeculativeSampling | None) -> SpeculativeOutput:
        rows = out.logits.values  # (1 + len(draft), vocab) float32: row i predicts what follows input i
        if sampling is None:
            predicted = rows.argmax(dim=-1).tolist()
            agreed = 0
            while agreed < len(draft) and draft[agreed] == predicted[agreed]:
                agreed += 1
            following = predicted[agreed]
        else:
            agreed, following = _accept_sampled(rows, draft, sampling)
        seq = self.kv.get(out.kv_cache.cache_id, current_tenant.get())
        if agreed < len(draft):  # the rejected drafts' KV goes (their idle clock was restarted by the forward)
            self.kv.shrink(seq, base + 1 + agreed)
        return SpeculativeOutput(tuple(draft[:agreed]), following,
                                 self._apply_policy(rows[agreed:agreed + 1], policy), self._handle(seq), out.timing)

    def truncate_kv(self, kv_cache: KvCacheHandle, new_length: int) -> KvCacheHandle:
        seq = self._resolve(kv_cache)
        if not 0 <= new_length <= seq.length:
            raise InvalidInput(f"new_length {new_length} is outside 0..={seq.length}")
        self.kv.shrink(seq, new_length)
        return self._handle(seq)

    def release_cache(self, cache_id: str) -> int:
        """Forgets a sequence; returns how many blocks went back to the pool."""
        self._check_id(cache_id, "cache_id")
        self._check_not_busy(self.kv.get(cache_id, current_tenant.get()))
        return self.kv.release(cache_id)

    def fork_cache(self, kv_cache: KvCacheHandle, num_children: int) -> list[KvCacheHandle]:
        """N new sequences sharing the parent's blocks; the first write to a shared block copies it."""
        if not 1 <= num_children <= self.config.max_batch_size:
            raise InvalidInput(f"num_children must be in 1..={self.config.max_batch_size}, got {num_children}")
        seq = self._resolve(kv_cache)
        self._check_sequence_room(seq.tenant, num_children)
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

    # -- internals -----------------------------------------------------------------
    def _check_tokens(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise InvalidInput("no tokens given")
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidInput(f"token id {bad[0]} is outside the vocabulary (size {vocab})")

    def check_reply_fits(self, policy: LogitsPolicy, positions: int) -> None:
        """Raises INVALID_INPUT unless ``positions`` rows of ``policy`` fit one reply (reads no state)."""
        self._check_policy(policy, positions)

    def _check_policy(self, policy: LogitsPolicy, positions: int) -> None:
        """Checks the policy, and that its reply will fit the message limit (every kind,
        before any work: a reply that fails at send time would strand the sequence)."""
        vocab = self.model_config.vocab_size
        if policy.kind is LogitsKind.TOP_K and not 1 <= policy.top_k <= vocab:
            raise InvalidInput(f"top_k must be in 1..={vocab}, got {policy.top_k}")
        if policy.dtype not in LOGITS_DTYPES:
            raise InvalidInput(f"logits dtype must be one of {LOGITS_DTYPES}, got {shown(policy.dtype)}")
        if policy.kind is LogitsKind.FULL:
            per_position = vocab * _WIRE_BYTES[policy.dtype]
        else:
            per_position = (policy.top_k if policy.kind is LogitsKind.TOP_K else 1) * _SCORED_ENTRY_BYTES
        size = positions * per_position
        if size > self.config.max_message_bytes:
            raise InvalidInput(
                f"{policy.kind.name} logits for {positions} positions need up to {size} bytes, over the "
                f"{self.config.max_message_bytes}-byte message limit; ask for fewer positions, a smaller "
                f"top-k or the last position only"
            )

    def _check_id(self, value: str, field: str) -> None:
        if not value:
            raise InvalidInput(f"{field} is required")
        if len(value) > MAX_ID_BYTES:
            raise InvalidInput(f"{field} is {len(value)} characters long; at most {MAX_ID_BYTES}")

    def _resolve(self, handle: KvCacheHandle) -> SequenceState:
        """The sequence a handle names; validates without touching any state
        (the idle clock included: only a call that succeeds restarts it)."""
        self._check_id(handle.cache_id, "kv_cache.cache_id")
        self._check_id(handle.server_instance_id, "kv_cache.server_instance_id")
        if handle.server_instance_id != self.instance_id:
            raise StaleHandle(
                f"handle {shown(handle.cache_id)} was issued by server instance "
                f"{shown(handle.server_instance_id)}, this is {self.instance_id!r}"
            )
        seq = self.kv.get(handle.cache_id, current_tenant.get())  # another tenant's: "not found"
        self._check_not_busy(seq)
        if handle.sequence_length != seq.length:
            raise LengthMismatch(
                f"handle says {handle.sequence_length} tokens, the server holds {seq.length} "
                f"for {shown(handle.cache_id)}"
            )
        return seq

    def _check_length(self, start: int, num_new: int) -> None:
        if start + num_new > self.max_seq_len:
            raise SequenceTooLong(
                f"{start} + {num_new} tokens exceed the maximum sequence length {self.max_seq_len}"
            )

    def _check_fits_pool(self, length: int) -> None:
        """Refuses up front a sequence that could never fit, even in an empty pool."""
        if self.kv.blocks_for(length) > self.kv.num_blocks:
            raise KvCapacityExhausted(
                f"{length} tokens need {self.kv.blocks_for(length)} KV blocks; the whole pool has "
                f"{self.kv.num_blocks}"
            )

    def _check_sequence_room(self, tenant: str, new: int) -> None:
        """Refuses ``new`` more sequences past the server's or the tenant's cap."""
        cap, tenant_cap = self.config.max_sequences, self.config.tenant_max_sequences
        if cap and len(self.kv) + new > cap:
            raise SequenceLimitExceeded(
                f"the server holds {len(self.kv)} live sequences, its cap is {cap}; release some")
        if tenant_cap and self.kv.count(tenant) + new > tenant_cap:
            raise SequenceLimitExceeded(
                f"your tenant holds {self.kv.count(tenant)} live sequences, its cap is {tenant_cap}; release some")

    def _check_not_busy(self, seq: SequenceState) -> None:
        if seq.pins:
            raise InvalidInput(f"sequence {shown(seq.cache_id)} is in the middle of a chunked prefill")

    def _step(self, opened: _Opened, tokens: list[int], rows: str) -> _Step:
        """Reserves room (and private copies of shared blocks) for ``tokens`` after the sequence's end."""
        seq = opened.seq
        plan = self.kv.prepare_write(seq, seq.length, seq.length + len(tokens))
        if quota := self.config.tenant_kv_tokens:
            held = self.kv.blocks_held(seq.tenant)
            if held * self.kv.block_size > quota:
                self.kv.undo_write(seq, plan)
                raise TenantQuotaExceeded(
                    f"your tenant would hold {held * self.kv.block_size} KV tokens ({held} blocks), over its "
                    f"quota of {quota}; release or truncate sequences")
        self.pool.copy_blocks(plan.copies)
        return _Step(opened, list(tokens), seq.length, plan, rows)

    def _forward(self, steps: list[_Step]) -> tuple[torch.Tensor, list[int]]:
        """One forward over every step.

        Returns hidden states (N, C) and each step's first row in them (its rows
        are the next ``len(step.tokens)``).  Steps of one length run as one
        (B, T) batch (the decode fast path, fused whole-layer ops included);
        steps of mixed lengths (decodes beside prompt chunks) run ragged, each
        length a group, no token padded (see ``RaggedBatch``).  Steps that ask
        for hidden states of some layers get their rows of those (they run
        alone or with equal-length steps: the worker sees to it).
        """
        counts = [len(s.tokens) for s in steps]
        if len(set(counts)) > 1 and not any(s.hidden or s.attention for s in steps):
            return self._forward_ragged(steps)
        width = max(counts)
        kv = self.pool.batch([s.seq.block_ids for s in steps], [s.start for s in steps], counts)
        ids = torch.tensor([s.tokens + [0] * (width - len(s.tokens)) for s in steps], device=self.device)
        layers = {layer for s in steps if s.hidden for layer in s.hidden}
        capture = dict.fromkeys(layers) if layers else None
        if attention := {layer for s in steps if s.attention for layer in s.attention}:
            kv.attention = dict.fromkeys(attention)
        with torch.inference_mode():
            out = self.model(ids, kv.positions, kv, capture) if capture else self.model(ids, kv.positions, kv)
        for b, step in enumerate(steps):
            for layer in step.hidden or ():
                step.hidden[layer] = capture[layer][b, :counts[b]].float().cpu()
            heads = list(step.heads) or slice(None)
            for layer in step.attention or ():  # keys past the sequence's end are padding: dropped
                step.attention[layer] = kv.attention[layer][b, heads, :counts[b], :step.start + counts[b]].cpu()
        return out.reshape(-1, out.shape[-1]), [b * width for b in range(len(steps))]

    def _forward_ragged(self, steps: list[_Step]) -> tuple[torch.Tensor, list[int]]:
        by_length: dict[int, list[int]] = {}
        for i, step in enumerate(steps):
            by_length.setdefault(len(step.tokens), []).append(i)
        groups, ids, firsts = [], [], [0] * len(steps)
        for width, members in by_length.items():
            groups.append(([steps[i].seq.block_ids for i in members], [steps[i].start for i in members], width))
            for i in members:
                firsts[i] = len(ids)
                ids.extend(steps[i].tokens)
        kv = RaggedBatch(self.pool, groups)
        with torch.inference_mode():
            out = self.model(torch.tensor([ids], device=self.device), None, kv)  # (1, N, C)
        return out[0], firsts

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
