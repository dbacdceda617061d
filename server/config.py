"""Serving configuration: frozen dataclasses built once at the CLI edge."""

from __future__ import annotations

from dataclasses import dataclass, field

MIB = 1 << 20


@dataclass(frozen=True)
class ExecutorConfig:
    """Limits of one hosted model.

    Args:
        dtype: "float32" or "bfloat16" (weights, activations and KV).
        device: "cpu", "cuda" or "cuda:N".
        kv_tokens: KV pool capacity in tokens (rounded up to whole blocks).
        block_size: tokens per KV block.
        max_batch_size: most sequences in one batched forward.
        max_seq_len: longest sequence; 0 means the model's max positions.
        max_message_bytes: largest reply; requests whose logits would not fit
            are refused up front with INVALID_INPUT.
        batch_wait_ms: how long the worker may wait for more decodes to batch.
    """

    dtype: str = "float32"
    device: str = "cpu"
    kv_tokens: int = 16384
    block_size: int = 16
    max_batch_size: int = 64
    max_seq_len: int = 0
    max_message_bytes: int = 256 * MIB
    batch_wait_ms: float = 0.0

    def __post_init__(self):
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be float32 or bfloat16, not {self.dtype!r}")
        if self.kv_tokens <= 0 or self.block_size <= 0 or self.max_batch_size <= 0:
            raise ValueError("kv_tokens, block_size and max_batch_size must be positive")


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
