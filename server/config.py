"""Serving configuration: frozen dataclasses built once at the CLI edge."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from pathlib import Path

from ferrum_rpc.errors import StartupError

MIB = 1 << 20
LINEAR_KERNELS = ("auto", "onednn-packed", "aten")  # see kernels/select.py
QUANTIZATIONS = ("none", "int8", "int4", "w8a8", "w4a8")  # see woq.py and qact.py
STEP_OPS = ("auto", "fused", "eager")  # see fused.py
BATCH_INVARIANT = ("auto", "on", "off")  # see models/loader.py
KV_DTYPES = ("auto", "float32", "bfloat16", "int8")


def batch_invariant_mode(value: str | bool) -> str:
    """A batch_invariant setting as one of BATCH_INVARIANT: True and False mean on and off."""
    return ("on" if value else "off") if isinstance(value, bool) else value


@dataclass(frozen=True)
class ExecutorConfig:
    """Limits of one hosted model.

    Args:
        dtype: "float32" or "bfloat16" (weights, activations and, by default, KV).
        kv_dtype: the KV pool's dtype: "bfloat16" under float32 activations, any
            ``quantize`` (half the pool's bytes, and of what a long context's
            attention reads; keys and values rounded once, as written), or
            ``dtype``'s; "auto": bfloat16 with w8a8 and w4a8 (activations already
            rounded to 8 bits a block, as llama.cpp keeps its KV in 16 bits),
            else ``dtype``'s; "int8" under either dtype: each key and value row
            (a token's kv head) quantized by blocks of 32, each by its own absolute
            maximum, a float16 scale beside it (kv/pool.py ``quantize_rows``, llama.cpp's
            q8_0; ~1.06 bytes a value).
            ``kv_dtype_name`` is the one resolved.
        device: "cpu", "cuda" or "cuda:N".
        kv_tokens: KV pool capacity in tokens (rounded up to whole blocks).
        block_size: tokens per KV block.
        max_batch_size: most sequences in one batched forward.
        max_seq_len: longest sequence; 0 means the model's max positions.
        max_message_bytes: largest reply; requests whose logits would not fit
            are refused up front with INVALID_INPUT.
        batch_wait_ms: how long the worker may wait for more decodes to batch.
        kv_memory_fraction: if > 0, size the KV pool to this fraction of the
            device's available memory instead of ``kv_tokens``.
        idle_timeout_s: reclaim sequences unused this long (0: never).
        prefill_chunk: prompts longer than this run in chunks, letting other
            callers' decodes run in between.
        step_token_budget: the unified forward's budget: most tokens in one
            forward while callers are decoding.  Each forward takes every
            waiting decode first (up to ``max_batch_size``), then fills the
            rest with parts of waiting prompts (at least a quarter of the
            budget, so prompts never starve).  Once nobody has decoded for a
            second, prompts run parts of up to ``prefill_chunk`` tokens each,
            as many as the budget or one chunk allow.  0: prompts and decodes
            never share a forward (they alternate; the pre-0.3 schedule).
        prefix_caching: share identical full prompt blocks across sequences.
        linear_kernel: "auto" probes the oneDNN prepacked linear (faster
            bfloat16 everywhere and float32 batches; float32 weights take 2x
            memory) and falls back to plain ``F.linear`` where it cannot run;
            "aten" forces the fallback; "onednn-packed" fails at load where it
            cannot run.  See ``kernels/select.py``.  With ``quantize``, "aten" forces
            the torch fallbacks (dequantized weights through ``F.linear``).
        quantize: "none", "int8" or "int4": 8- or 4-bit block weights with
            activations kept to about 15 bits (two int8 digits per block,
            ``qact.TwoDigitLinear``; in ``dtype`` where the integer kernel cannot
            run, ``woq.py``); "w8a8" or "w4a8": the same weights, activations
            rounded to one int8 digit per block of 32 (llama.cpp's Q8_1), faster
            and less exact; all multiply in integers (``qact.py``; CPU only; KV
            stays in ``dtype``).
        step_ops: "auto" runs RMSNorm, the MLP activation and decode-sized
            attention as the fused C++ ops of ``kernels/csrc`` (``fused.h``) where they build
            and agree with the eager ops here (CPU); "eager" forces the torch
            ops; "fused" fails at load where the fused ops cannot run.
        cuda_graphs: "auto" replays each plain decode step as a captured CUDA graph
            on a CUDA device (``engine/graphs.py``); "off" runs every step eagerly.
            No effect on the CPU.
    """

    dtype: str = "float32"
    kv_dtype: str = "auto"
    device: str = "cpu"
    kv_tokens: int = 16384
    block_size: int = 16
    max_batch_size: int = 64
    max_seq_len: int = 0
    max_message_bytes: int = 256 * MIB
    batch_wait_ms: float = 0.0
    kv_memory_fraction: float = 0.0
    idle_timeout_s: float = 600.0
    prefill_chunk: int = 256
    step_token_budget: int = 128
    prefix_caching: bool = True
    linear_kernel: str = "auto"
    quantize: str = "none"
    step_ops: str = "auto"
    cuda_graphs: str = "auto"
    # every linear, attention and norm on one per-row arithmetic: a row's logits do not
    # depend on the batch, the prompt's chunking or the prefix cache (models.llama.make_batch_invariant).
    # "auto": wherever this model, dtype, device and kernel choice allow it (the loader says why
    # not otherwise); "on": refuse to start where they do not; "off".  True / False mean on / off.
    batch_invariant: str | bool = "auto"
    max_sequences: int = 10_000  # live sequences in all, forks included (0: no cap); ~17 KB each
    # Per-tenant bounds (see tenant_bounds).  None: the default, which binds each tenant of
    # --auth-tokens and not the anonymous caller of a server without tokens (everyone is that
    # one tenant there, so a per-tenant default would only shrink the server); a number binds
    # every tenant, the anonymous one included; 0: no cap.
    tenant_max_sequences: int | None = None  # live sequences; default: half of max_sequences
    tenant_kv_tokens: int | None = None  # KV tokens held; default: half of the pool
    tenant_ahead_sequences: int | None = None  # sequences decoding ahead at once; default: max_batch_size // 4
    # tensor parallelism (server/parallel/): ranks the model is split over (1: not split), and
    # the longest a forward waits for the other ranks before the server fails closed
    tensor_parallel: int = 1
    tensor_parallel_timeout_s: float = 30.0
    # LoRA adapters (engine/adapters.py): how many at once (0: none served), the largest rank,
    # the bytes they may take in all (0: no cap), and those loaded at start (name, folder)
    max_adapters: int = 8
    max_lora_rank: int = 64
    adapter_memory_mb: int = 0
    loras: tuple[tuple[str, str], ...] = ()
    # the folder every adapter is read from (--lora and LoadAdapter), its folder and files
    # checked inside it after following symbolic links; stored resolved.  "": any folder
    # the server can read (LoadAdapter is for admin tenants either way)
    adapter_root: str = ""

    @property
    def kv_dtype_name(self) -> str:
        """The KV pool's dtype, "auto" resolved (see ``kv_dtype``)."""
        if self.kv_dtype != "auto":
            return self.kv_dtype
        return "bfloat16" if self.quantize in ("w8a8", "w4a8") else self.dtype

    def __post_init__(self):
        if self.dtype not in ("float32", "bfloat16"):
            raise StartupError(f"dtype must be float32 or bfloat16, not {self.dtype!r}")
        if self.cuda_graphs not in ("auto", "off"):
            raise StartupError(f"cuda_graphs must be auto or off, not {self.cuda_graphs!r}")
        if self.kv_dtype not in KV_DTYPES:
            raise StartupError(f"kv_dtype must be one of {KV_DTYPES}, not {self.kv_dtype!r}")
        if self.kv_dtype not in ("auto", "int8", self.dtype) and self.dtype != "float32":
            raise StartupError(f"--kv-dtype {self.kv_dtype} needs --dtype float32 (a {self.dtype} model keeps "
                               f"its KV in {self.dtype})")
        if self.kv_tokens <= 0 or self.block_size <= 0 or self.max_batch_size <= 0:
            raise StartupError("kv_tokens, block_size and max_batch_size (--kv-tokens, --block-size, --max-batch) "
                               "must be positive")
        if not 0 <= self.kv_memory_fraction < 1:
            raise StartupError("kv_memory_fraction (--kv-memory-fraction) must be in [0, 1)")
        if self.prefill_chunk <= 0:
            raise StartupError("prefill_chunk (--prefill-chunk) must be positive")
        if self.step_token_budget < 0:
            raise StartupError("step_token_budget (--step-token-budget) must be 0 (off) or positive")
        if self.linear_kernel not in LINEAR_KERNELS:
            raise StartupError(f"linear_kernel must be one of {LINEAR_KERNELS}, not {self.linear_kernel!r}")
        if self.step_ops not in STEP_OPS:
            raise StartupError(f"step_ops must be one of {STEP_OPS}, not {self.step_ops!r}")
        if self.quantize not in QUANTIZATIONS:
            raise StartupError(f"quantize must be one of {QUANTIZATIONS}, not {self.quantize!r}")
        if self.quantize != "none" and not self.device.startswith("cpu"):
            raise StartupError("--quantize is a CPU path; serve unquantized weights on " + self.device)
        for name in ("tenant_max_sequences", "tenant_kv_tokens", "tenant_ahead_sequences"):
            if (value := getattr(self, name)) is not None and value < 0:
                raise StartupError(f"{name} (--{name.replace('_', '-')}) must be 0 (no cap) or positive")
        if self.tensor_parallel < 1 or self.tensor_parallel_timeout_s <= 0:
            raise StartupError("--tensor-parallel must be at least 1 and --tensor-parallel-timeout positive")
        object.__setattr__(self, "batch_invariant", batch_invariant_mode(self.batch_invariant))
        if self.batch_invariant not in BATCH_INVARIANT:
            raise StartupError(f"batch_invariant must be one of {BATCH_INVARIANT}, not {self.batch_invariant!r}")
        if self.batch_invariant == "on" and (self.step_ops == "eager" or not self.device.startswith("cpu")):
            raise StartupError("--batch-invariant runs on CPUs with the fused ops; not with --step-ops eager or "
                               "a GPU")
        if self.max_adapters < 0 or self.max_lora_rank < 1 or self.adapter_memory_mb < 0:
            raise StartupError("--max-adapters and --adapter-memory-mb must be 0 or more, --max-lora-rank positive")
        if self.adapter_root:
            object.__setattr__(self, "adapter_root", resolved_folder(self.adapter_root, "--adapter-root"))
        if self.loras and (self.tensor_parallel > 1 or not self.max_adapters):
            raise StartupError("--lora needs --max-adapters above 0 and no --tensor-parallel (adapters are not "
                               "sharded)")
        if self.quantize != "none" and self.linear_kernel == "onednn-packed":
            raise StartupError("quantized weights do not use the oneDNN packed linear; "
                               "use --linear-kernel auto or aten")


def resolved_folder(path: str, option: str) -> str:
    """``path`` resolved (symbolic links followed), refused unless it is a folder."""
    try:
        real = Path(path).resolve(strict=True)
    except (OSError, RuntimeError) as exc:
        raise StartupError(f"{option} {path}: {getattr(exc, 'strerror', None) or 'cannot be resolved'}") from None
    if not real.is_dir():
        raise StartupError(f"{option} {path}: not a folder")
    return str(real)


@dataclass(frozen=True)
class TenantBounds:
    """What one tenant may hold at once (0: no cap)."""

    max_sequences: int
    kv_tokens: int
    ahead_sequences: int


def tenant_bounds(config: ExecutorConfig, tenant: str, pool_tokens: int) -> TenantBounds:
    """``tenant``'s bounds under ``config`` on a pool of ``pool_tokens`` ("" is the anonymous
    caller of a server without tokens: the defaults leave it alone)."""
    named = tenant != ""

    def bound(value: int | None, default: int) -> int:
        return value if value is not None else default if named else 0

    return TenantBounds(bound(config.tenant_max_sequences, config.max_sequences // 2),
                        bound(config.tenant_kv_tokens, pool_tokens // 2),
                        bound(config.tenant_ahead_sequences, max(1, config.max_batch_size // 4)))


@dataclass(frozen=True)
class ModelSpec:
    name: str
    path: str


@dataclass(frozen=True)
class ServerConfig:
    models: tuple[ModelSpec, ...]
    executor: ExecutorConfig = field(default_factory=ExecutorConfig)
    host: str = "127.0.0.1"
    port: int = 50051
    grace_s: float = 30.0
    warmup: bool = True
    remeasure: bool = False  # time the decode crossover again instead of reading the stored one
    tls_cert: str = ""  # PEM chain; with tls_key: serve TLS only
    tls_key: str = ""
    tls_client_ca: str = ""  # PEM CA bundle: require and verify client certificates (mTLS)
    auth_tokens: str = ""  # file of "<tenant> <token>" lines: require bearer tokens
    insecure: bool = False  # allow a non-loopback address without TLS and tokens
    metrics_port: int | None = None  # Prometheus exposition (None: off; 0: a free port)
    metrics_host: str = "127.0.0.1"
    # RegisterSharedMemory: "auto" serves it only on a loopback address (callers on
    # this host by construction), "on" everywhere, "off" nowhere.
    shared_memory: str = "auto"
    # Tenants (of --auth-tokens) allowed to load and unload models; without
    # tokens every caller may (the server is then on loopback or --insecure).
    admin_tenants: tuple[str, ...] = ()
    # Once listening, write {"address", "host", "port", "instance_id", "pid", "state"}
    # here as JSON (atomically); rewritten with state "serving" once every model serves,
    # removed when the server exits.  "": none.
    port_file: str = ""
    # Sequences that move: the networks PushSequence may connect to (the caller
    # names the address, so by default only this machine), the CA receivers' TLS
    # certificates chain to, and how long a draining server keeps answering exports.
    push_allow: str = "loopback"
    push_ca: str = ""
    export_grace_s: float = 0.0  # off by default: a drain ends as soon as in-flight calls do
    # Bounds on what transfers hold: the KV bytes all imports in flight may buffer at once
    # (0: the bytes of the largest hosted KV pool, so any sequence that fits a pool can be
    # imported), how long an import stream may send nothing before it is ended, and the
    # deadline of a push's call to its receiver when the caller gave PushSequence none.
    transfer_budget_bytes: int = 0
    import_idle_timeout_s: float = 30.0
    push_timeout_s: float = 60.0

    @property
    def shared_memory_enabled(self) -> bool:
        return self.shared_memory == "on" or (self.shared_memory == "auto" and is_loopback(self.host))

    def __post_init__(self):
        if self.shared_memory not in ("auto", "on", "off"):
            raise StartupError(f"shared_memory must be auto, on or off, got {self.shared_memory!r}")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise StartupError("--tls-cert and --tls-key go together")
        if self.tls_client_ca and not self.tls_cert:
            raise StartupError("--tls-client-ca needs --tls-cert and --tls-key")
        if not 0 <= self.export_grace_s <= 300:
            raise StartupError(f"--export-grace must be in 0..=300 seconds, got {self.export_grace_s}")
        if self.transfer_budget_bytes < 0:
            raise StartupError(f"--transfer-budget-mb must be 0 (the largest KV pool) or positive, got "
                               f"{self.transfer_budget_bytes / MIB:g}")
        if not 0 < self.import_idle_timeout_s <= 3600:
            raise StartupError(f"--import-idle-timeout must be in (0, 3600] seconds, got {self.import_idle_timeout_s}")
        if not 0 < self.push_timeout_s <= 3600:
            raise StartupError(f"--push-timeout must be in (0, 3600] seconds, got {self.push_timeout_s}")
        try:
            parse_allow(self.push_allow)
        except ValueError as exc:
            raise StartupError(f"--push-allow {self.push_allow!r}: {exc}") from None
        if not is_loopback(self.host) and not (self.tls_cert and self.auth_tokens) and not self.insecure:
            raise StartupError(
                f"refusing to serve on {self.host} without TLS and tokens: anyone who can reach it could "
                f"read and drive every sequence.  Give --tls-cert/--tls-key and --auth-tokens, or --insecure "
                f"if the network itself is trusted")


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a bind address) is only reachable from this machine."""
    import ipaddress

    if host in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def parse_allow(spec: str) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
    """``--push-allow``: comma-separated networks (CIDR or addresses); "loopback" for
    127.0.0.0/8 and ::1, "none" for nothing."""
    nets = []
    for item in (s.strip() for s in spec.split(",")):
        if item == "loopback":
            nets += [ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("::1/128")]
        elif item and item != "none":
            nets.append(ipaddress.ip_network(item, strict=False))
    return tuple(nets)
