"""Typed, immutable objects of the executor contract, shared by server and client.

They mirror the Ferrum engine's executor types (``PrefillInput``/``DecodeInput``
results and the ``KvCacheHandle``).  On the server ``Logits.values`` is a torch
tensor; on the client it is a numpy array decoded from the wire.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Mapping


@dataclass(frozen=True)
class BlockTable:
    block_size: int
    block_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class KvCacheHandle:
    """A sequence whose KV lives on a server; rebuilt from the wire on the caller side."""

    cache_id: str
    sequence_length: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    device: str
    block_table: BlockTable
    model: str
    server_instance_id: str
    adapter: str = ""  # the LoRA adapter the sequence runs with ("" = the base model; information)
    weights_version: int = 0  # the model's weights version when the handle was issued (information)
    # server side only, never on the wire: the sequence's change count when the handle
    # was issued (what an undo record made from it checks; None on a caller's handle)
    change: int | None = field(default=None, compare=False, repr=False)


class LogitsKind(enum.Enum):
    FULL = 1
    TOP_K = 2
    ARGMAX = 3


LOGITS_DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class SharedMemoryTarget:
    """Where full logits rows go instead of the reply: a registered region's name and
    a byte offset inside it (see ``ExecutorClient.shared_memory``)."""

    region: str
    offset: int = 0


@dataclass(frozen=True)
class LogitsPolicy:
    """What the server sends back per position.

    Args:
        kind: full rows, the top-k entries, or the argmax only.
        dtype: wire dtype of full rows: "float32", "float16" or "bfloat16".
        top_k: k for ``LogitsKind.TOP_K``.
        all_positions: prefill only; every prompt position instead of the last.
        shared_memory: FULL only; write the rows into this registered region and
            return only their location (a batched step's rows follow one another).
    """

    kind: LogitsKind = LogitsKind.FULL
    dtype: str = "float32"
    top_k: int = 0
    all_positions: bool = False
    shared_memory: SharedMemoryTarget | None = None

    @classmethod
    def full(cls, dtype: str = "float32", all_positions: bool = False,
             shared_memory: SharedMemoryTarget | None = None) -> LogitsPolicy:
        return cls(LogitsKind.FULL, dtype=dtype, all_positions=all_positions, shared_memory=shared_memory)

    @classmethod
    def topk(cls, k: int, all_positions: bool = False) -> LogitsPolicy:
        return cls(LogitsKind.TOP_K, top_k=k, all_positions=all_positions)

    @classmethod
    def argmax(cls, all_positions: bool = False) -> LogitsPolicy:
        return cls(LogitsKind.ARGMAX, all_positions=all_positions)


class LogprobsMode(enum.Enum):
    """Which distribution a chosen token's logprobs describe.

    RAW (the default, as vLLM's ``logprobs_mode="raw_logprobs"``): the model's own
    log-softmax over the logits row, before any penalty, bias, mask, temperature or
    filter: it describes the model, not the sampler, so it is comparable across
    requests with different settings, agrees with ``log_softmax`` of the FULL logits a
    caller may ask for alongside, and serves scoring/perplexity. PROCESSED: the
    distribution the token was actually chosen from (after penalties, bias and mask,
    and for sampled rows temperature and top-k/top-p/min-p); tokens it excludes are
    never listed.
    """

    RAW = 1
    PROCESSED = 2


MAX_TOP_LOGPROBS = 20  # the bound on TokenChoice.top_logprobs (OpenAI's)
# Below this temperature the choice is greedy (vLLM's _SAMPLING_EPS): logits / T would
# overflow float32 for T much smaller.
GREEDY_BELOW_TEMPERATURE = 1e-5



@dataclass(frozen=True)
class TokenChoice:
    """The executor chooses the next token of a sequence (instead of returning logits
    only). Defaults are OpenAI's and vLLM's; see ``ferrum_rpc.server.choice.sampling`` for
    the order of operations and ``validate_token_choice`` for the ranges.

    Args:
        temperature: >= 0, finite; below 1e-5 (0 included) the choice is greedy: the
            argmax after penalties, bias and mask.
        top_k: keep the k highest logits (ties at the k-th kept); 0: off.
        top_p: keep the smallest set of most likely tokens whose mass reaches top_p;
            in (0, 1], 1: off.
        min_p: drop tokens less likely than min_p times the most likely; [0, 1], 0: off.
        seed: the draw at position p is a function of (seed, p) and the distribution
            only: the same token alone, in any batch, after a restart. None: fresh
            randomness each call (not reproducible).
        repetition_penalty: > 0; logits of tokens in prompt + output divided by it
            where positive, multiplied where negative (CTRL, vLLM); 1: off.
        presence_penalty: [-2, 2]; subtracted once from each token in the output.
        frequency_penalty: [-2, 2]; subtracted once per occurrence in the output.
        logit_bias: {token id: bias}, bias finite in [-100, 100], added to the logits.
        allowed_token_bitmask: packed little-endian int32 words, bit i of word j
            allows token 32*j + i (xgrammar's and llguidance's layout); exactly
            4 * ceil(vocab / 32) bytes; empty: every token allowed.
        top_logprobs: also return the n most likely tokens with their logprobs,
            0 ..= MAX_TOP_LOGPROBS.
        logprobs_mode: which distribution the logprobs describe (RAW by default).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    allowed_token_bitmask: bytes = b""
    top_logprobs: int = 0
    logprobs_mode: LogprobsMode = LogprobsMode.RAW

    @classmethod
    def greedy(cls, **kwargs) -> TokenChoice:
        """The argmax (after any penalties, bias and mask given in kwargs)."""
        return cls(temperature=0.0, **kwargs)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float


@dataclass(frozen=True)
class ChosenToken:
    """The token the executor chose for a sequence, its logprob and, when asked, the
    most likely alternatives (descending), all in the TokenChoice's logprobs_mode."""

    token_id: int
    logprob: float
    top_logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class Logits:
    """Logits for one or more positions, shaped (positions, ...).

    ``values`` is (P, vocab) for FULL, (P, k) for TOP_K and (P, 1) for ARGMAX;
    ``token_ids`` has the same shape for TOP_K/ARGMAX and is None for FULL.
    """

    kind: LogitsKind
    values: Any
    token_ids: Any = None
    vocab_size: int = 0

    def __array__(self, dtype=None, copy=None):
        """The logits as one dense (positions, vocab) numpy array, so numpy functions
        (``np.argmax``, ``np.asarray``) read token ids as indices: FULL's values as
        they are; for TOP_K and ARGMAX, the returned scores at their token ids and
        -inf at every token the reply left out (``vocab_size`` wide)."""
        import numpy as np

        values = np.asarray(self.values)
        if self.kind is not LogitsKind.FULL:
            ids = np.asarray(self.token_ids, dtype=np.int64)
            dense = np.full((ids.shape[0], self.vocab_size), -np.inf, dtype=np.float32)
            np.put_along_axis(dense, ids, values.astype(np.float32), axis=-1)
            values = dense
        return values if dtype is None else values.astype(dtype, copy=False)

    def argmax(self) -> list[int]:
        """The highest-scoring token id of each position."""
        if self.kind is LogitsKind.FULL:
            return [int(i) for i in self.values.argmax(-1)]
        return [int(row[0]) for row in self.token_ids]


@dataclass(frozen=True)
class Timing:
    queue_ns: int = 0
    forward_ns: int = 0
    total_ns: int = 0
    batch_size: int = 0


@dataclass(frozen=True)
class HiddenStatesRequest:
    """Analysis outputs a prefill should return at ``positions`` of the call
    (empty: all): hidden states of ``layers`` as transformers'
    ``output_hidden_states`` indexes them (0 embeddings, i the output of layer i,
    num_layers the final normed output), and attention weights of
    ``attention_layers`` (decoder layers, as ``output_attentions`` indexes them)
    for ``attention_heads`` (empty: all)."""

    layers: tuple[int, ...] = ()
    positions: tuple[int, ...] = ()
    attention_layers: tuple[int, ...] = ()  # decoder layers whose attention weights to return
    attention_heads: tuple[int, ...] = ()  # their query heads (empty: all)


@dataclass(frozen=True)
class PrefillOutput:
    logits: Logits | None
    kv_cache: KvCacheHandle
    timing: Timing = field(default_factory=Timing)
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    hidden_states: tuple = ()  # with a HiddenStatesRequest: (positions, hidden) arrays, one per layer
    attention_weights: tuple = ()  # with attention_layers: (heads, positions, sequence_length) arrays, one per layer
    chosen: ChosenToken | None = None  # with a TokenChoice: the next token the executor chose
    # A retry answered with the live sequence its request_id names, which this same prompt
    # made (REQUEST_ID_EXISTS): kv_cache is that sequence's handle as it is now; no logits,
    # hidden states or chosen token came back (the lost reply's are not recomputed).
    existing: bool = False


@dataclass(frozen=True)
class DecodeInput:
    token_id: int
    kv_cache: KvCacheHandle
    token_choice: TokenChoice | None = None  # set: the executor chooses this sequence's next token


@dataclass(frozen=True)
class DecodeOutput:
    logits: Logits | None
    kv_cache: KvCacheHandle
    timing: Timing = field(default_factory=Timing)
    chosen: ChosenToken | None = None  # with a TokenChoice: the next token the executor chose


@dataclass(frozen=True)
class VerifyOutput:
    logits: Logits
    kv_cache: KvCacheHandle
    timing: Timing = field(default_factory=Timing)


@dataclass(frozen=True)
class MemoryRequirements:
    """A model's memory needs (Ferrum's ``MemoryRequirements``), bytes."""

    parameter_bytes: int = 0
    kv_bytes_per_token_per_layer: int = 0
    activation_bytes_per_token: int = 0
    overhead_bytes: int = 0
    num_layers: int = 0

    def calculate_total_memory(self, batch_size: int, sequence_length: int) -> int:
        """Bytes to serve ``batch_size`` sequences of ``sequence_length`` tokens (as the
        trait's ``calculate_total_memory``): weights, overhead, and per token its KV in
        every layer plus its working set in a forward."""
        tokens = batch_size * sequence_length
        per_token = self.kv_bytes_per_token_per_layer * self.num_layers + self.activation_bytes_per_token
        return self.parameter_bytes + self.overhead_bytes + tokens * per_token


class ExecutorState(enum.Enum):
    """Ferrum's executor states."""

    INITIALIZING = 1
    READY = 2
    BUSY = 3
    ERROR = 4
    SHUTDOWN = 5


@dataclass(frozen=True)
class SpeculativeSampling:
    """Probabilistic acceptance for server-side speculative decoding: the target's
    distribution (temperature, top-k, top-p) and the round's seed."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0


@dataclass(frozen=True)
class SpeculativeOutput:
    """A round of server-side speculative decoding: the drafts greedy decoding agreed
    with, greedy's next token after them (not in the KV yet), its logits row and
    the sequence (1 + len(accepted_token_ids) tokens longer)."""

    accepted_token_ids: tuple[int, ...]
    next_token_id: int
    logits: Logits | None
    kv_cache: KvCacheHandle
    timing: Timing = field(default_factory=Timing)
    chosen: tuple[ChosenToken, ...] = ()  # with a TokenChoice: each accepted draft, then the next token


@dataclass(frozen=True)
class ModelInfo:
    name: str
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    max_sequence_length: int
    dtype: str
    device: str
    parameter_count: int
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int = 0
    kv_dtype: str = ""  # the KV pool's dtype ("": a server that predates it, so dtype)


@dataclass(frozen=True)
class Capabilities:
    model: str
    max_batch_size: int
    max_sequence_length: int
    kv_block_size: int
    kv_num_blocks: int
    kv_capacity_tokens: int
    logits_kinds: tuple[LogitsKind, ...]
    logits_dtypes: tuple[str, ...]
    chunked_prefill: bool
    forward_verify: bool
    truncate_kv: bool
    max_message_bytes: int
    models: tuple[str, ...] = ()
    idle_timeout_s: float = 0.0
    prefill_chunk_tokens: int = 0
    decode_session: bool = False
    prefix_cache: bool = False
    fork_cache: bool = False
    mixture_of_experts: bool = False
    architecture: str = ""
    kv_bytes: int = 0
    kernel_path: str = ""
    cpu_capability: str = ""
    quantization: str = "none"
    shared_memory: bool = False  # RegisterSharedMemory is served (set by the server, not the executor)
    speculative_decode: bool = True
    batch_prefill: bool = True
    attention_mechanisms: tuple[str, ...] = ()
    supported_dtypes: tuple[str, ...] = ()
    supported_devices: tuple[str, ...] = ()
    tensor_parallel: bool = False
    pipeline_parallel: bool = False
    dynamic_batching: bool = True
    continuous_batching: bool = True
    memory: MemoryRequirements = field(default_factory=MemoryRequirements)
    optimal_batch_size: int = 0
    token_choice: bool = False  # the server chooses tokens for requests with a TokenChoice
    max_decode_ahead: int = 0  # DecodeSession steps may decode ahead up to this many tokens (0: not served)
    tensor_parallel_degree: int = 1  # ranks the model is split over
    tensor_parallel_fallbacks: tuple[str, ...] = ()  # fast paths that cannot run sharded, and what runs
    accepts_imports: bool = False  # ImportSequence is served
    kv_fingerprint: str = ""  # the KV compatibility fingerprint's digest: exports import where it is equal
    kv_events: bool = False  # WatchKvEvents is served (prefix caching on)
    batch_invariant: bool = False  # a row's logits do not depend on what shares its forward (--batch-invariant)
    max_adapters: int = 0  # LoRA adapters loaded at once (--max-adapters; 0: none served)
    max_lora_rank: int = 0  # the largest rank an adapter may have (--max-lora-rank)
    weights_version: int = 0  # 0 as loaded, one more after each UpdateWeights
    kv_dtype: str = ""  # the KV pool's dtype: float32, bfloat16 or int8 ("": a server that predates it)

    def supports_batch_size(self, batch_size: int) -> bool:
        """Whether one forward may carry ``batch_size`` sequences (the trait's check)."""
        return 1 <= batch_size <= self.max_batch_size


class ServerState(enum.Enum):
    LOADING = 1
    SERVING = 2
    DRAINING = 3


@dataclass(frozen=True)
class SequencePush:
    """What PushSequence did: the sequence's handle on the receiver, the bytes
    sent, and whether the sender released its copy (a move)."""

    kv_cache: KvCacheHandle
    bytes_sent: int
    released: bool


@dataclass(frozen=True)
class ExecutorStatus:
    state: ServerState
    server_instance_id: str
    model: str
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_free: int
    active_sequences: int
    queue_depth: int
    forwards: int
    tokens_processed: int
    uptime_s: float
    kv_blocks_shared: int = 0
    prefix_cache_queried_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    prefix_cache_hit_rate: float = 0.0
    sequences_expired: int = 0
    kv_blocks_cached: int = 0
    executor_state: ExecutorState = ExecutorState.READY
    prefill_operations: int = 0
    decode_operations: int = 0
    avg_prefill_ms: float = 0.0
    avg_decode_ms: float = 0.0
    memory_allocated_bytes: int = 0
    memory_used_bytes: int = 0
    memory_peak_bytes: int = 0
    memory_utilization: float = 0.0
    # the asking tenant's bounds (0: no cap) and what decoding ahead holds now
    tenant_max_sequences: int = 0
    tenant_kv_tokens: int = 0
    tenant_ahead_sequences: int = 0
    ahead_sequences: int = 0
    ahead_runs_paused: int = 0
    session_bytes_unsent: int = 0
    # server-wide: imports running, the KV bytes they buffer, the budget for those, pushes running
    imports_in_flight: int = 0
    transfer_bytes_in_flight: int = 0
    transfer_budget_bytes: int = 0
    pushes_in_flight: int = 0
    adapters_loaded: int = 0  # LoRA adapters held, and the bytes of their weights
    adapter_bytes: int = 0
    weights_version: int = 0
