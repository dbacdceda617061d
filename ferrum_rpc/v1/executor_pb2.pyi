from google.protobuf import descriptor_pb2 as _descriptor_pb2
from google.rpc import status_pb2 as _status_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ErrorReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ERROR_REASON_UNSPECIFIED: _ClassVar[ErrorReason]
    CACHE_NOT_FOUND: _ClassVar[ErrorReason]
    CACHE_EXPIRED: _ClassVar[ErrorReason]
    STALE_HANDLE: _ClassVar[ErrorReason]
    LENGTH_MISMATCH: _ClassVar[ErrorReason]
    INVALID_INPUT: _ClassVar[ErrorReason]
    SEQUENCE_TOO_LONG: _ClassVar[ErrorReason]
    KV_CAPACITY_EXHAUSTED: _ClassVar[ErrorReason]
    MODEL_NOT_FOUND: _ClassVar[ErrorReason]
    MODEL_LOADING: _ClassVar[ErrorReason]
    DRAINING: _ClassVar[ErrorReason]
    UNAUTHENTICATED: _ClassVar[ErrorReason]
    SEQUENCE_LIMIT_EXCEEDED: _ClassVar[ErrorReason]
    TENANT_QUOTA_EXCEEDED: _ClassVar[ErrorReason]
    SHARED_MEMORY_NOT_FOUND: _ClassVar[ErrorReason]
    ADMIN_ONLY: _ClassVar[ErrorReason]
    TENSOR_PARALLEL_RANK_LOST: _ClassVar[ErrorReason]
    FINGERPRINT_MISMATCH: _ClassVar[ErrorReason]
    TRANSFER_CORRUPTED: _ClassVar[ErrorReason]
    TICKET_NOT_FOUND: _ClassVar[ErrorReason]
    TICKET_EXPIRED: _ClassVar[ErrorReason]
    TICKET_USED: _ClassVar[ErrorReason]
    PUSH_TARGET_REFUSED: _ClassVar[ErrorReason]
    NON_FINITE_LOGITS: _ClassVar[ErrorReason]
    TRANSFER_BUDGET_EXHAUSTED: _ClassVar[ErrorReason]
    TRANSFER_STALLED: _ClassVar[ErrorReason]
    ADAPTER_NOT_FOUND: _ClassVar[ErrorReason]
    ADAPTER_INVALID: _ClassVar[ErrorReason]
    ADAPTER_IN_USE: _ClassVar[ErrorReason]
    ADAPTER_LIMIT_EXCEEDED: _ClassVar[ErrorReason]
    WEIGHTS_CHANGED: _ClassVar[ErrorReason]
    REQUEST_ID_EXISTS: _ClassVar[ErrorReason]
    REQUEST_ID_TAKEN: _ClassVar[ErrorReason]

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]
    DTYPE_INT32: _ClassVar[DType]
    DTYPE_INT64: _ClassVar[DType]
    DTYPE_UINT32: _ClassVar[DType]
    DTYPE_INT8: _ClassVar[DType]

class LogitsKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LOGITS_KIND_UNSPECIFIED: _ClassVar[LogitsKind]
    LOGITS_KIND_FULL: _ClassVar[LogitsKind]
    LOGITS_KIND_TOP_K: _ClassVar[LogitsKind]
    LOGITS_KIND_ARGMAX: _ClassVar[LogitsKind]

class LogprobsMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LOGPROBS_MODE_UNSPECIFIED: _ClassVar[LogprobsMode]
    LOGPROBS_MODE_RAW: _ClassVar[LogprobsMode]
    LOGPROBS_MODE_PROCESSED: _ClassVar[LogprobsMode]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_STOP_TOKEN: _ClassVar[FinishReason]
    FINISH_REASON_STOPPED: _ClassVar[FinishReason]
    FINISH_REASON_MAX_SEQUENCE_LENGTH: _ClassVar[FinishReason]
ERROR_REASON_UNSPECIFIED: ErrorReason
CACHE_NOT_FOUND: ErrorReason
CACHE_EXPIRED: ErrorReason
STALE_HANDLE: ErrorReason
LENGTH_MISMATCH: ErrorReason
INVALID_INPUT: ErrorReason
SEQUENCE_TOO_LONG: ErrorReason
KV_CAPACITY_EXHAUSTED: ErrorReason
MODEL_NOT_FOUND: ErrorReason
MODEL_LOADING: ErrorReason
DRAINING: ErrorReason
UNAUTHENTICATED: ErrorReason
SEQUENCE_LIMIT_EXCEEDED: ErrorReason
TENANT_QUOTA_EXCEEDED: ErrorReason
SHARED_MEMORY_NOT_FOUND: ErrorReason
ADMIN_ONLY: ErrorReason
TENSOR_PARALLEL_RANK_LOST: ErrorReason
FINGERPRINT_MISMATCH: ErrorReason
TRANSFER_CORRUPTED: ErrorReason
TICKET_NOT_FOUND: ErrorReason
TICKET_EXPIRED: ErrorReason
TICKET_USED: ErrorReason
PUSH_TARGET_REFUSED: ErrorReason
NON_FINITE_LOGITS: ErrorReason
TRANSFER_BUDGET_EXHAUSTED: ErrorReason
TRANSFER_STALLED: ErrorReason
ADAPTER_NOT_FOUND: ErrorReason
ADAPTER_INVALID: ErrorReason
ADAPTER_IN_USE: ErrorReason
ADAPTER_LIMIT_EXCEEDED: ErrorReason
WEIGHTS_CHANGED: ErrorReason
REQUEST_ID_EXISTS: ErrorReason
REQUEST_ID_TAKEN: ErrorReason
DTYPE_UNSPECIFIED: DType
DTYPE_FLOAT32: DType
DTYPE_FLOAT16: DType
DTYPE_BFLOAT16: DType
DTYPE_INT32: DType
DTYPE_INT64: DType
DTYPE_UINT32: DType
DTYPE_INT8: DType
LOGITS_KIND_UNSPECIFIED: LogitsKind
LOGITS_KIND_FULL: LogitsKind
LOGITS_KIND_TOP_K: LogitsKind
LOGITS_KIND_ARGMAX: LogitsKind
LOGPROBS_MODE_UNSPECIFIED: LogprobsMode
LOGPROBS_MODE_RAW: LogprobsMode
LOGPROBS_MODE_PROCESSED: LogprobsMode
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_STOP_TOKEN: FinishReason
FINISH_REASON_STOPPED: FinishReason
FINISH_REASON_MAX_SEQUENCE_LENGTH: FinishReason
STATUS_CODE_FIELD_NUMBER: _ClassVar[int]
status_code: _descriptor.FieldDescriptor
RETRYABLE_FIELD_NUMBER: _ClassVar[int]
retryable: _descriptor.FieldDescriptor
OUTCOME_UNKNOWN_FIELD_NUMBER: _ClassVar[int]
outcome_unknown: _descriptor.FieldDescriptor

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class BlockTable(_message.Message):
    __slots__ = ("block_size", "block_ids")
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    block_size: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, block_size: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class KvCacheHandle(_message.Message):
    __slots__ = ("cache_id", "sequence_length", "num_layers", "num_kv_heads", "head_dim", "device", "block_table", "model", "server_instance_id", "adapter", "weights_version")
    CACHE_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TABLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SERVER_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    cache_id: str
    sequence_length: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    device: str
    block_table: BlockTable
    model: str
    server_instance_id: str
    adapter: str
    weights_version: int
    def __init__(self, cache_id: _Optional[str] = ..., sequence_length: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., device: _Optional[str] = ..., block_table: _Optional[_Union[BlockTable, _Mapping]] = ..., model: _Optional[str] = ..., server_instance_id: _Optional[str] = ..., adapter: _Optional[str] = ..., weights_version: _Optional[int] = ...) -> None: ...

class LogitsPolicy(_message.Message):
    __slots__ = ("kind", "dtype", "top_k", "all_positions", "shared_memory")
    KIND_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    ALL_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    SHARED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    kind: LogitsKind
    dtype: DType
    top_k: int
    all_positions: bool
    shared_memory: SharedMemoryTarget
    def __init__(self, kind: _Optional[_Union[LogitsKind, str]] = ..., dtype: _Optional[_Union[DType, str]] = ..., top_k: _Optional[int] = ..., all_positions: _Optional[bool] = ..., shared_memory: _Optional[_Union[SharedMemoryTarget, _Mapping]] = ...) -> None: ...

class SharedMemoryTarget(_message.Message):
    __slots__ = ("region", "offset")
    REGION_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    region: str
    offset: int
    def __init__(self, region: _Optional[str] = ..., offset: _Optional[int] = ...) -> None: ...

class Logits(_message.Message):
    __slots__ = ("kind", "values", "token_ids", "vocab_size", "scores", "positions", "shared_memory")
    KIND_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    SCORES_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    SHARED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    kind: LogitsKind
    values: Tensor
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    vocab_size: int
    scores: _containers.RepeatedScalarFieldContainer[float]
    positions: int
    shared_memory: SharedMemoryLocation
    def __init__(self, kind: _Optional[_Union[LogitsKind, str]] = ..., values: _Optional[_Union[Tensor, _Mapping]] = ..., token_ids: _Optional[_Iterable[int]] = ..., vocab_size: _Optional[int] = ..., scores: _Optional[_Iterable[float]] = ..., positions: _Optional[int] = ..., shared_memory: _Optional[_Union[SharedMemoryLocation, _Mapping]] = ...) -> None: ...

class SharedMemoryLocation(_message.Message):
    __slots__ = ("region", "offset", "byte_size")
    REGION_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    BYTE_SIZE_FIELD_NUMBER: _ClassVar[int]
    region: str
    offset: int
    byte_size: int
    def __init__(self, region: _Optional[str] = ..., offset: _Optional[int] = ..., byte_size: _Optional[int] = ...) -> None: ...

class TokenChoice(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "min_p", "seed", "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias", "allowed_token_bitmask", "top_logprobs", "logprobs_mode")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_BITMASK_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_MODE_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    allowed_token_bitmask: bytes
    top_logprobs: int
    logprobs_mode: LogprobsMode
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., allowed_token_bitmask: _Optional[bytes] = ..., top_logprobs: _Optional[int] = ..., logprobs_mode: _Optional[_Union[LogprobsMode, str]] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class ChosenToken(_message.Message):
    __slots__ = ("token_id", "logprob", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class Timing(_message.Message):
    __slots__ = ("queue_ns", "forward_ns", "total_ns", "batch_size")
    QUEUE_NS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_NS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_NS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    queue_ns: int
    forward_ns: int
    total_ns: int
    batch_size: int
    def __init__(self, queue_ns: _Optional[int] = ..., forward_ns: _Optional[int] = ..., total_ns: _Optional[int] = ..., batch_size: _Optional[int] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "architecture", "vocab_size", "hidden_size", "num_layers", "num_attention_heads", "num_kv_heads", "head_dim", "max_sequence_length", "dtype", "device", "parameter_count", "eos_token_ids", "bos_token_id", "kv_dtype")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_ATTENTION_HEADS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQUENCE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    PARAMETER_COUNT_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    max_sequence_length: int
    dtype: DType
    device: str
    parameter_count: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    bos_token_id: int
    kv_dtype: DType
    def __init__(self, name: _Optional[str] = ..., architecture: _Optional[str] = ..., vocab_size: _Optional[int] = ..., hidden_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_attention_heads: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., max_sequence_length: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ..., device: _Optional[str] = ..., parameter_count: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., bos_token_id: _Optional[int] = ..., kv_dtype: _Optional[_Union[DType, str]] = ...) -> None: ...

class GetCapabilitiesRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class Capabilities(_message.Message):
    __slots__ = ("model", "max_batch_size", "max_sequence_length", "kv_block_size", "kv_num_blocks", "kv_capacity_tokens", "logits_kinds", "logits_dtypes", "chunked_prefill", "forward_verify", "truncate_kv", "max_message_bytes", "models", "idle_timeout_s", "prefill_chunk_tokens", "decode_session", "prefix_cache", "fork_cache", "mixture_of_experts", "architecture", "kv_bytes", "kernel_path", "cpu_capability", "quantization", "shared_memory", "speculative_decode", "batch_prefill", "attention_mechanisms", "supported_dtypes", "supported_devices", "tensor_parallel", "pipeline_parallel", "dynamic_batching", "continuous_batching", "memory", "optimal_batch_size", "token_choice", "max_decode_ahead", "tensor_parallel_degree", "tensor_parallel_fallbacks", "accepts_imports", "kv_fingerprint", "kv_events", "batch_invariant", "max_adapters", "max_lora_rank", "weights_version", "kv_dtype")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQUENCE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_CAPACITY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGITS_KINDS_FIELD_NUMBER: _ClassVar[int]
    LOGITS_DTYPES_FIELD_NUMBER: _ClassVar[int]
    CHUNKED_PREFILL_FIELD_NUMBER: _ClassVar[int]
    FORWARD_VERIFY_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_KV_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    IDLE_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_CHUNK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DECODE_SESSION_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    FORK_CACHE_FIELD_NUMBER: _ClassVar[int]
    MIXTURE_OF_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    KERNEL_PATH_FIELD_NUMBER: _ClassVar[int]
    CPU_CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    SHARED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_DECODE_FIELD_NUMBER: _ClassVar[int]
    BATCH_PREFILL_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_MECHANISMS_FIELD_NUMBER: _ClassVar[int]
    SUPPORTED_DTYPES_FIELD_NUMBER: _ClassVar[int]
    SUPPORTED_DEVICES_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_PARALLEL_FIELD_NUMBER: _ClassVar[int]
    DYNAMIC_BATCHING_FIELD_NUMBER: _ClassVar[int]
    CONTINUOUS_BATCHING_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    OPTIMAL_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_CHOICE_FIELD_NUMBER: _ClassVar[int]
    MAX_DECODE_AHEAD_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_DEGREE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_FALLBACKS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTS_IMPORTS_FIELD_NUMBER: _ClassVar[int]
    KV_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_FIELD_NUMBER: _ClassVar[int]
    BATCH_INVARIANT_FIELD_NUMBER: _ClassVar[int]
    MAX_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    model: str
    max_batch_size: int
    max_sequence_length: int
    kv_block_size: int
    kv_num_blocks: int
    kv_capacity_tokens: int
    logits_kinds: _containers.RepeatedScalarFieldContainer[LogitsKind]
    logits_dtypes: _containers.RepeatedScalarFieldContainer[DType]
    chunked_prefill: bool
    forward_verify: bool
    truncate_kv: bool
    max_message_bytes: int
    models: _containers.RepeatedScalarFieldContainer[str]
    idle_timeout_s: float
    prefill_chunk_tokens: int
    decode_session: bool
    prefix_cache: bool
    fork_cache: bool
    mixture_of_experts: bool
    architecture: str
    kv_bytes: int
    kernel_path: str
    cpu_capability: str
    quantization: str
    shared_memory: bool
    speculative_decode: bool
    batch_prefill: bool
    attention_mechanisms: _containers.RepeatedScalarFieldContainer[str]
    supported_dtypes: _containers.RepeatedScalarFieldContainer[DType]
    supported_devices: _containers.RepeatedScalarFieldContainer[str]
    tensor_parallel: bool
    pipeline_parallel: bool
    dynamic_batching: bool
    continuous_batching: bool
    memory: MemoryRequirements
    optimal_batch_size: int
    token_choice: bool
    max_decode_ahead: int
    tensor_parallel_degree: int
    tensor_parallel_fallbacks: _containers.RepeatedScalarFieldContainer[str]
    accepts_imports: bool
    kv_fingerprint: str
    kv_events: bool
    batch_invariant: bool
    max_adapters: int
    max_lora_rank: int
    weights_version: int
    kv_dtype: str
    def __init__(self, model: _Optional[str] = ..., max_batch_size: _Optional[int] = ..., max_sequence_length: _Optional[int] = ..., kv_block_size: _Optional[int] = ..., kv_num_blocks: _Optional[int] = ..., kv_capacity_tokens: _Optional[int] = ..., logits_kinds: _Optional[_Iterable[_Union[LogitsKind, str]]] = ..., logits_dtypes: _Optional[_Iterable[_Union[DType, str]]] = ..., chunked_prefill: _Optional[bool] = ..., forward_verify: _Optional[bool] = ..., truncate_kv: _Optional[bool] = ..., max_message_bytes: _Optional[int] = ..., models: _Optional[_Iterable[str]] = ..., idle_timeout_s: _Optional[float] = ..., prefill_chunk_tokens: _Optional[int] = ..., decode_session: _Optional[bool] = ..., prefix_cache: _Optional[bool] = ..., fork_cache: _Optional[bool] = ..., mixture_of_experts: _Optional[bool] = ..., architecture: _Optional[str] = ..., kv_bytes: _Optional[int] = ..., kernel_path: _Optional[str] = ..., cpu_capability: _Optional[str] = ..., quantization: _Optional[str] = ..., shared_memory: _Optional[bool] = ..., speculative_decode: _Optional[bool] = ..., batch_prefill: _Optional[bool] = ..., attention_mechanisms: _Optional[_Iterable[str]] = ..., supported_dtypes: _Optional[_Iterable[_Union[DType, str]]] = ..., supported_devices: _Optional[_Iterable[str]] = ..., tensor_parallel: _Optional[bool] = ..., pipeline_parallel: _Optional[bool] = ..., dynamic_batching: _Optional[bool] = ..., continuous_batching: _Optional[bool] = ..., memory: _Optional[_Union[MemoryRequirements, _Mapping]] = ..., optimal_batch_size: _Optional[int] = ..., token_choice: _Optional[bool] = ..., max_decode_ahead: _Optional[int] = ..., tensor_parallel_degree: _Optional[int] = ..., tensor_parallel_fallbacks: _Optional[_Iterable[str]] = ..., accepts_imports: _Optional[bool] = ..., kv_fingerprint: _Optional[str] = ..., kv_events: _Optional[bool] = ..., batch_invariant: _Optional[bool] = ..., max_adapters: _Optional[int] = ..., max_lora_rank: _Optional[int] = ..., weights_version: _Optional[int] = ..., kv_dtype: _Optional[str] = ...) -> None: ...

class MemoryRequirements(_message.Message):
    __slots__ = ("parameter_bytes", "kv_bytes_per_token_per_layer", "activation_bytes_per_token", "overhead_bytes", "num_layers")
    PARAMETER_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_PER_TOKEN_PER_LAYER_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    OVERHEAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    parameter_bytes: int
    kv_bytes_per_token_per_layer: int
    activation_bytes_per_token: int
    overhead_bytes: int
    num_layers: int
    def __init__(self, parameter_bytes: _Optional[int] = ..., kv_bytes_per_token_per_layer: _Optional[int] = ..., activation_bytes_per_token: _Optional[int] = ..., overhead_bytes: _Optional[int] = ..., num_layers: _Optional[int] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class Status(_message.Message):
    __slots__ = ("state", "server_instance_id", "model", "kv_blocks_total", "kv_blocks_used", "kv_blocks_free", "active_sequences", "queue_depth", "forwards", "tokens_processed", "uptime_s", "kv_blocks_shared", "prefix_cache_queried_tokens", "prefix_cache_hit_tokens", "prefix_cache_hit_rate", "sequences_expired", "kv_blocks_cached", "executor_state", "prefill_operations", "decode_operations", "avg_prefill_ms", "avg_decode_ms", "memory_allocated_bytes", "memory_used_bytes", "memory_peak_bytes", "memory_utilization", "tenant_max_sequences", "tenant_kv_tokens", "tenant_ahead_sequences", "ahead_sequences", "ahead_runs_paused", "session_bytes_unsent", "imports_in_flight", "transfer_bytes_in_flight", "transfer_budget_bytes", "pushes_in_flight", "adapters_loaded", "adapter_bytes", "weights_version")
    class State(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STATE_UNSPECIFIED: _ClassVar[Status.State]
        STATE_LOADING: _ClassVar[Status.State]
        STATE_SERVING: _ClassVar[Status.State]
        STATE_DRAINING: _ClassVar[Status.State]
    STATE_UNSPECIFIED: Status.State
    STATE_LOADING: Status.State
    STATE_SERVING: Status.State
    STATE_DRAINING: Status.State
    class ExecutorState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        EXECUTOR_STATE_UNSPECIFIED: _ClassVar[Status.ExecutorState]
        EXECUTOR_STATE_INITIALIZING: _ClassVar[Status.ExecutorState]
        EXECUTOR_STATE_READY: _ClassVar[Status.ExecutorState]
        EXECUTOR_STATE_BUSY: _ClassVar[Status.ExecutorState]
        EXECUTOR_STATE_ERROR: _ClassVar[Status.ExecutorState]
        EXECUTOR_STATE_SHUTDOWN: _ClassVar[Status.ExecutorState]
    EXECUTOR_STATE_UNSPECIFIED: Status.ExecutorState
    EXECUTOR_STATE_INITIALIZING: Status.ExecutorState
    EXECUTOR_STATE_READY: Status.ExecutorState
    EXECUTOR_STATE_BUSY: Status.ExecutorState
    EXECUTOR_STATE_ERROR: Status.ExecutorState
    EXECUTOR_STATE_SHUTDOWN: Status.ExecutorState
    STATE_FIELD_NUMBER: _ClassVar[int]
    SERVER_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    FORWARDS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PROCESSED_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_SHARED_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_CACHED_FIELD_NUMBER: _ClassVar[int]
    EXECUTOR_STATE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_OPERATIONS_FIELD_NUMBER: _ClassVar[int]
    DECODE_OPERATIONS_FIELD_NUMBER: _ClassVar[int]
    AVG_PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    AVG_DECODE_MS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_ALLOCATED_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_PEAK_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    TENANT_MAX_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    TENANT_KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TENANT_AHEAD_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    AHEAD_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    AHEAD_RUNS_PAUSED_FIELD_NUMBER: _ClassVar[int]
    SESSION_BYTES_UNSENT_FIELD_NUMBER: _ClassVar[int]
    IMPORTS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BYTES_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    PUSHES_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_LOADED_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_BYTES_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    state: Status.State
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
    kv_blocks_shared: int
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    prefix_cache_hit_rate: float
    sequences_expired: int
    kv_blocks_cached: int
    executor_state: Status.ExecutorState
    prefill_operations: int
    decode_operations: int
    avg_prefill_ms: float
    avg_decode_ms: float
    memory_allocated_bytes: int
    memory_used_bytes: int
    memory_peak_bytes: int
    memory_utilization: float
    tenant_max_sequences: int
    tenant_kv_tokens: int
    tenant_ahead_sequences: int
    ahead_sequences: int
    ahead_runs_paused: int
    session_bytes_unsent: int
    imports_in_flight: int
    transfer_bytes_in_flight: int
    transfer_budget_bytes: int
    pushes_in_flight: int
    adapters_loaded: int
    adapter_bytes: int
    weights_version: int
    def __init__(self, state: _Optional[_Union[Status.State, str]] = ..., server_instance_id: _Optional[str] = ..., model: _Optional[str] = ..., kv_blocks_total: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., kv_blocks_free: _Optional[int] = ..., active_sequences: _Optional[int] = ..., queue_depth: _Optional[int] = ..., forwards: _Optional[int] = ..., tokens_processed: _Optional[int] = ..., uptime_s: _Optional[float] = ..., kv_blocks_shared: _Optional[int] = ..., prefix_cache_queried_tokens: _Optional[int] = ..., prefix_cache_hit_tokens: _Optional[int] = ..., prefix_cache_hit_rate: _Optional[float] = ..., sequences_expired: _Optional[int] = ..., kv_blocks_cached: _Optional[int] = ..., executor_state: _Optional[_Union[Status.ExecutorState, str]] = ..., prefill_operations: _Optional[int] = ..., decode_operations: _Optional[int] = ..., avg_prefill_ms: _Optional[float] = ..., avg_decode_ms: _Optional[float] = ..., memory_allocated_bytes: _Optional[int] = ..., memory_used_bytes: _Optional[int] = ..., memory_peak_bytes: _Optional[int] = ..., memory_utilization: _Optional[float] = ..., tenant_max_sequences: _Optional[int] = ..., tenant_kv_tokens: _Optional[int] = ..., tenant_ahead_sequences: _Optional[int] = ..., ahead_sequences: _Optional[int] = ..., ahead_runs_paused: _Optional[int] = ..., session_bytes_unsent: _Optional[int] = ..., imports_in_flight: _Optional[int] = ..., transfer_bytes_in_flight: _Optional[int] = ..., transfer_budget_bytes: _Optional[int] = ..., pushes_in_flight: _Optional[int] = ..., adapters_loaded: _Optional[int] = ..., adapter_bytes: _Optional[int] = ..., weights_version: _Optional[int] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("model", "token_ids", "kv_cache", "logits", "hidden_states", "token_choice", "request_id", "adapter")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_FIELD_NUMBER: _ClassVar[int]
    LOGITS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_STATES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_CHOICE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    model: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    kv_cache: KvCacheHandle
    logits: LogitsPolicy
    hidden_states: HiddenStatesRequest
    token_choice: TokenChoice
    request_id: str
    adapter: str
    def __init__(self, model: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., kv_cache: _Optional[_Union[KvCacheHandle, _Mapping]] = ..., logits: _Optional[_Union[LogitsPolicy, _Mapping]] = ..., hidden_states: _Optional[_Union[HiddenStatesRequest, _Mapping]] = ..., token_choice: _Optional[_Union[TokenChoice, _Mapping]] = ..., request_id: _Optional[str] = ..., adapter: _Optional[str] = ...) -> None: ...

class HiddenStatesRequest(_message.Message):
    __slots__ = ("layers", "positions", "attention_layers", "attention_heads")
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_LAYERS_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_HEADS_FIELD_NUMBER: _ClassVar[int]
    layers: _containers.RepeatedScalarFieldContainer[int]
    positions: _containers.RepeatedScalarFieldContainer[int]
    attention_layers: _containers.RepeatedScalarFieldContainer[int]
    attention_heads: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, layers: _Optional[_Iterable[int]] = ..., positions: _Optional[_Iterable[int]] = ..., attention_layers: _Optional[_Iterable[int]] = ..., attention_heads: _Optional[_Iterable[int]] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("logits", "kv_cache", "timing", "cached_tokens", "hidden_states", "attention_weights", "chosen")
    LOGITS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_STATES_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    CHOSEN_FIELD_NUMBER: _ClassVar[int]
    logits: Logits
    kv_cache: KvCacheHandle
    timing: Timing
    cached_tokens: int
    hidden_states: _containers.RepeatedCompositeFieldContainer[Tensor]
    attention_weights: _containers.RepeatedCompositeFieldContainer[Tensor]
    chosen: ChosenToken
    def __init__(self, logits: _Optional[_Union[Logits, _Mapping]] = ..., kv_cache: _Optional[_Union[KvCacheHandle, _Mapping]] = ..., timing: _Optional[_Union[Timing, _Mapping]] = ..., cached_tokens: _Optional[int] = ..., hidden_states: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., attention_weights: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., chosen: _Optional[_Union[ChosenToken, _Mapping]] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("model", "token_id", "kv_cache", "logits", "token_choice")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_FIELD_NUMBER: _ClassVar[int]
    LOGITS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_CHOICE_FIELD_NUMBER: _ClassVar[int]
    model: str
    token_id: int
    kv_cache: KvCacheHandle
    logits: LogitsPolicy
    token_choice: TokenChoice
    def __init__(self, model: _Optional[str] = ..., token_id: _Optional[int] = ..., kv_cache: _Optional[_Union[KvCacheHandle, _Mapping]] = ..., logits: _Optional[_Union[LogitsPolicy, _Mapping]] = ..., token_choice: _Optional[_Union[TokenChoice, _Mapping]] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("logits", "kv_cache", "timing", "chosen")
    LOGITS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    CHOSEN_FIELD_NUMBER: _ClassVar[int]
    logits: Logits
    kv_cache: KvCacheHandle
    timing: Timing
    chosen: ChosenToken
    def __init__(self, logits: _Optional[_Union[Logits, _Mapping]] = ..., kv_cache: _Optional[_Union[KvCacheHandle, _Mapping]] = ..., timing: _Optional[_Union[Timing, _Mapping]] = ..., chosen: _Optional[_Union[ChosenToken, _Mapping]] = ...) -> None: ...

class DecodeItem(_message.Message):
    __slots__ = ("token_id", "kv_cache", "token_choice")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_CHOICE_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    kv_cache: KvCacheHandle
    token_choice: TokenChoice
    def __init__(self, token_id: _Optional[int] = ..., kv_cache: _Optional[_Union[KvCacheHandle, _Mapping]] = ..., token_choice: _Optional[_Union[TokenChoice, _Mapping]] = ...) -> None: ...

class BatchDecodeRequest(_message.Message):
    __slots__ = ("model", "items", "logits", "single_reply")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    LOGITS_FIELD_NUMBER: _ClassVar[int]
    SINGLE_REPLY_FIELD_NUMBER: _ClassVar[int]
    model: str
    items: _containers.RepeatedCompositeFieldContainer[DecodeItem]
    logits: LogitsPolicy
    single_reply: bool
    def __init__(self, model: _Optional[str] = ..., items: _Optional[_Iterable[_Union[DecodeItem, _Mapping]]] = ..., logits: _Optional[_Union[LogitsPolicy, _Mapping]] = ..., single_reply: _Optional[bool] = ...) -> None: ...

class BatchDecodeResponse(_message.Message):
    __slots__ = ("index", "logits", "kv_cache", "timing", "results", "chosen")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    LOGITS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    CHOSEN_FIELD_NUMBER: _ClassVar[int]
    index: int
    logits: Logits
    kv_cache: KvCacheHandle
    timing: Timing
    results: _containers.RepeatedCompositeFieldContainer[BatchDecodeResponse]
    chosen: ChosenToken
    def __init__(self, index: _Optional[int] = ..., logits: _Optional[_Union[Logits, _Mapping]] = ..., kv_cache: _Optional[_Union[KvCacheHandle, _Mapping]] = ..., timing: _Optional[_Union[Timing, _Mapping]] = ..., results: _Optional[_Iterable[_Union[BatchDecodeResponse, _Mapping]]] = ..., chosen: _Optional[_Union[ChosenToken, _Mapping]] = ...) -> None: ...

class DecodeSessionRequest(_message.Message):
    __slots__ = ("step_id", "model", "items", "logits", "single_reply", "max_new_tokens", "stop_token_ids", "stop", "forwards_per_response")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    LOGITS_FIELD_NUMBER: _ClassVar[int]
    SINGLE_REPLY_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    FORWARDS_PER_RESPONSE_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    model: str
    items: _containers.RepeatedCompositeFieldContainer[DecodeItem]
    logits: LogitsPolicy
    single_reply: bool
    max_new_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    stop: bool
    forwards_per_response: int
    def __init__(self, step_id: _Optional[int] = ..., model: _Optional[str] = ..., items: _Optional[_Iterable[_Union[DecodeItem, _Mapping]]] = ..., logits: _Optional[_Union[LogitsPolicy, _Mapping]] = ..., single_reply: _Optional[bool] = ..., max_new_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., stop: _Optional[bool] = ..., forwards_per_response: _Optional[int] = ...) -> None: ...

class DecodeSessionResponse(_message.Message):
    __slots__ = ("step_id", "index", "logits", "kv_cache", "timing", "error", "results", "chosen", "finish_reason")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    LOGITS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    CHOSEN_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    index: int
    logits: Logits
    kv_cache: KvCacheHandle
    timing: Timing
    error: _status_pb2.Status
    results: _containers.RepeatedCompositeFieldContainer[DecodeSessionResponse]
    chosen: ChosenToken
    finish_reason: FinishReason
    def __init__(self, step_id: _Optional[int] = ..., index: _Optional[int] = ..., logits: _Optional[_Union[Logits, _Mapping]] = ..., kv_cache: _Optional[_Union[KvCacheHandle, _Mapping]] = ..., timing: _Optional[_Union[Timing, _Mapping]] = ..., error: _Optional[_Union[_status_pb2.Status, _Mapping]] = ..., results: _Optional[_Iterable[_Union[DecodeSessionResponse, _Mapping]]] = ..., chosen: _Optional[_Union[ChosenToken, _Mapping]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ...) -> None: ...

class ForkCacheRequest(_message.Message):
    __slots__ = ("kv_cache", "num_children")
    KV_CACHE_FIELD_NUMBER: _ClassVar[int]
    NUM_CHILDREN_FIELD_NUMBER: _ClassVar[int]
    kv_cache: KvCacheHandle
    num_children: int
    def __init__(self, kv_cache: _Optional[_Union[KvCacheHandle, _Mapping]] = ..., num_children: _Optional[int] = ...) -> None: ...

class ForkCacheResponse(_message.Message):
    __slots__ = ("children",)
    CHILDREN_FIELD_NUMBER: _ClassVar[int]
    children: _containers.RepeatedCompositeFieldContainer[KvCacheHandle]
    def __init__(self, children: _Optional[_Iterable[_Union[KvCacheHandle, _Mapping]]] = ...) -> None: ...

class ForwardVerifyRequest(_message.Message):
    __slots__ = ("model", "token_ids", "kv_cache", "logits")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_FIELD_NUMBER: _ClassVar[int]
    LOGITS_FIELD_NUMBER: _ClassVar[int]
    model: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    kv_cache: KvCacheHandle
    logits: LogitsPolicy
    def __init__(self, model: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., kv_cache: _Optional[_Union[KvCacheHandle, _Mapping]] = ..., logits: _Optional[_Union[LogitsPolicy, _Mapping]] = ...) -> None: ...

class ForwardVerifyResponse(_message.Message):
    __slots__ = ("logits", "kv_cache", "timing")
    LOGITS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    logits: Logits
    kv_cache: KvCacheHandle
    timing: Timing
    def __init__(self, logits: _Optional[_Union[Logits, _Mapping]] = ..., kv_cache: _Optional[_Union[KvCacheHandle, _Mapping]] = ..., timing: _Optional[_Union[Timing, _Mapping]] = ...) -> None: ...

class TruncateKvRequest(_message.Message):
    __slots__ = ("kv_cache", "new_length")
    KV_CACHE_FIELD_NUMBER: _ClassVar[int]
    NEW_LENGTH_FIELD_NUMBER: _ClassVar[int]
    kv_cache: KvCacheHandle
    new_length: int
    def __init__(self, kv_cache: _Optional[_Union[KvCacheHandle, _Mapping]] = ..., new_length: _Optional[int] = ...) -> None: ...

class TruncateKvResponse(_message.Message):
    __slots__ = ("kv_cache",)
    KV_CACHE_FIELD_NUMBER: _ClassVar[int]
    kv_cache: KvCacheHandle
    def __init__(self, kv_cache: _Optional[_Union[KvCacheHandle, _Mapping]] = ...) -> None: ...

class ReleaseCacheRequest(_message.Message):
    __slots__ = ("cache_id", "model", "request_id")
    CACHE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    cache_id: str
    model: str
    request_id: str
    def __init__(self, cache_id: _Optional[str] = ..., model: _Optional[str] = ..., request_id: _Optional[str] = ...) -> None: ...

class ReleaseCacheResponse(_message.Message):
    __slots__ = ("blocks_freed",)
    BLOCKS_FREED_FIELD_NUMBER: _ClassVar[int]
    blocks_freed: int
    def __init__(self, blocks_freed: _Optional[int] = ...) -> None: ...

class ForwardRequest(_message.Message):
    __slots__ = ("model", "input")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    INPUT_FIELD_NUMBER: _ClassVar[int]
    model: str
    input: Tensor
    def __init__(self, model: _Optional[str] = ..., input: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class ForwardResponse(_message.Message):
    __slots__ = ("output",)
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    output: Tensor
    def __init__(self, output: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class RegisterSharedMemoryRequest(_message.Message):
    __slots__ = ("name", "key", "offset", "byte_size")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    BYTE_SIZE_FIELD_NUMBER: _ClassVar[int]
    name: str
    key: str
    offset: int
    byte_size: int
    def __init__(self, name: _Optional[str] = ..., key: _Optional[str] = ..., offset: _Optional[int] = ..., byte_size: _Optional[int] = ...) -> None: ...

class RegisterSharedMemoryResponse(_message.Message):
    __slots__ = ("name", "byte_size", "key")
    NAME_FIELD_NUMBER: _ClassVar[int]
    BYTE_SIZE_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    name: str
    byte_size: int
    key: str
    def __init__(self, name: _Optional[str] = ..., byte_size: _Optional[int] = ..., key: _Optional[str] = ...) -> None: ...

class UnregisterSharedMemoryRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class UnregisterSharedMemoryResponse(_message.Message):
    __slots__ = ("unregistered",)
    UNREGISTERED_FIELD_NUMBER: _ClassVar[int]
    unregistered: int
    def __init__(self, unregistered: _Optional[int] = ...) -> None: ...

class SpeculativeDecodeRequest(_message.Message):
    __slots__ = ("model", "kv_cache", "token_id", "draft_token_ids", "logits", "sampling", "token_choice")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGITS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TOKEN_CHOICE_FIELD_NUMBER: _ClassVar[int]
    model: str
    kv_cache: KvCacheHandle
    token_id: int
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    logits: LogitsPolicy
    sampling: SpeculativeSampling
    token_choice: TokenChoice
    def __init__(self, model: _Optional[str] = ..., kv_cache: _Optional[_Union[KvCacheHandle, _Mapping]] = ..., token_id: _Optional[int] = ..., draft_token_ids: _Optional[_Iterable[int]] = ..., logits: _Optional[_Union[LogitsPolicy, _Mapping]] = ..., sampling: _Optional[_Union[SpeculativeSampling, _Mapping]] = ..., token_choice: _Optional[_Union[TokenChoice, _Mapping]] = ...) -> None: ...

class SpeculativeSampling(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ...) -> None: ...

class SpeculativeDecodeResponse(_message.Message):
    __slots__ = ("accepted_token_ids", "next_token_id", "logits", "kv_cache", "timing", "chosen")
    ACCEPTED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGITS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    CHOSEN_FIELD_NUMBER: _ClassVar[int]
    accepted_token_ids: _containers.RepeatedScalarFieldContainer[int]
    next_token_id: int
    logits: Logits
    kv_cache: KvCacheHandle
    timing: Timing
    chosen: _containers.RepeatedCompositeFieldContainer[ChosenToken]
    def __init__(self, accepted_token_ids: _Optional[_Iterable[int]] = ..., next_token_id: _Optional[int] = ..., logits: _Optional[_Union[Logits, _Mapping]] = ..., kv_cache: _Optional[_Union[KvCacheHandle, _Mapping]] = ..., timing: _Optional[_Union[Timing, _Mapping]] = ..., chosen: _Optional[_Iterable[_Union[ChosenToken, _Mapping]]] = ...) -> None: ...

class PrefillItem(_message.Message):
    __slots__ = ("token_ids", "kv_cache", "token_choice", "request_id", "adapter")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_CHOICE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    kv_cache: KvCacheHandle
    token_choice: TokenChoice
    request_id: str
    adapter: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., kv_cache: _Optional[_Union[KvCacheHandle, _Mapping]] = ..., token_choice: _Optional[_Union[TokenChoice, _Mapping]] = ..., request_id: _Optional[str] = ..., adapter: _Optional[str] = ...) -> None: ...

class BatchPrefillRequest(_message.Message):
    __slots__ = ("model", "items", "logits")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    LOGITS_FIELD_NUMBER: _ClassVar[int]
    model: str
    items: _containers.RepeatedCompositeFieldContainer[PrefillItem]
    logits: LogitsPolicy
    def __init__(self, model: _Optional[str] = ..., items: _Optional[_Iterable[_Union[PrefillItem, _Mapping]]] = ..., logits: _Optional[_Union[LogitsPolicy, _Mapping]] = ...) -> None: ...

class BatchPrefillResponse(_message.Message):
    __slots__ = ("index", "logits", "kv_cache", "timing", "cached_tokens", "chosen")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    LOGITS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CHOSEN_FIELD_NUMBER: _ClassVar[int]
    index: int
    logits: Logits
    kv_cache: KvCacheHandle
    timing: Timing
    cached_tokens: int
    chosen: ChosenToken
    def __init__(self, index: _Optional[int] = ..., logits: _Optional[_Union[Logits, _Mapping]] = ..., kv_cache: _Optional[_Union[KvCacheHandle, _Mapping]] = ..., timing: _Optional[_Union[Timing, _Mapping]] = ..., cached_tokens: _Optional[int] = ..., chosen: _Optional[_Union[ChosenToken, _Mapping]] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelEntry(_message.Message):
    __slots__ = ("name", "state", "path", "is_default", "status")
    NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    IS_DEFAULT_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    name: str
    state: str
    path: str
    is_default: bool
    status: Status
    def __init__(self, name: _Optional[str] = ..., state: _Optional[str] = ..., path: _Optional[str] = ..., is_default: _Optional[bool] = ..., status: _Optional[_Union[Status, _Mapping]] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelEntry]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelEntry, _Mapping]]] = ...) -> None: ...

class LoadModelRequest(_message.Message):
    __slots__ = ("name", "path")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class LoadModelResponse(_message.Message):
    __slots__ = ("stage", "elapsed_s")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_S_FIELD_NUMBER: _ClassVar[int]
    stage: str
    elapsed_s: float
    def __init__(self, stage: _Optional[str] = ..., elapsed_s: _Optional[float] = ...) -> None: ...

class UnloadModelRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class UnloadModelResponse(_message.Message):
    __slots__ = ("sequences_dropped",)
    SEQUENCES_DROPPED_FIELD_NUMBER: _ClassVar[int]
    sequences_dropped: int
    def __init__(self, sequences_dropped: _Optional[int] = ...) -> None: ...

class LoadAdapterRequest(_message.Message):
    __slots__ = ("model", "name", "path", "replace")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    REPLACE_FIELD_NUMBER: _ClassVar[int]
    model: str
    name: str
    path: str
    replace: bool
    def __init__(self, model: _Optional[str] = ..., name: _Optional[str] = ..., path: _Optional[str] = ..., replace: _Optional[bool] = ...) -> None: ...

class AdapterEntry(_message.Message):
    __slots__ = ("name", "path", "rank", "scaling", "target_modules", "bytes", "sequences", "load_s", "digest")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    SCALING_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODULES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    LOAD_S_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    rank: int
    scaling: float
    target_modules: _containers.RepeatedScalarFieldContainer[str]
    bytes: int
    sequences: int
    load_s: float
    digest: str
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., rank: _Optional[int] = ..., scaling: _Optional[float] = ..., target_modules: _Optional[_Iterable[str]] = ..., bytes: _Optional[int] = ..., sequences: _Optional[int] = ..., load_s: _Optional[float] = ..., digest: _Optional[str] = ...) -> None: ...

class UnloadAdapterRequest(_message.Message):
    __slots__ = ("model", "name")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    model: str
    name: str
    def __init__(self, model: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class UnloadAdapterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListAdaptersRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class WeightsChunk(_message.Message):
    __slots__ = ("header", "data", "trailer")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    TRAILER_FIELD_NUMBER: _ClassVar[int]
    header: WeightsHeader
    data: bytes
    trailer: WeightsTrailer
    def __init__(self, header: _Optional[_Union[WeightsHeader, _Mapping]] = ..., data: _Optional[bytes] = ..., trailer: _Optional[_Union[WeightsTrailer, _Mapping]] = ...) -> None: ...

class WeightsHeader(_message.Message):
    __slots__ = ("model", "total_bytes", "invalidate_sequences")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    INVALIDATE_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    model: str
    total_bytes: int
    invalidate_sequences: bool
    def __init__(self, model: _Optional[str] = ..., total_bytes: _Optional[int] = ..., invalidate_sequences: _Optional[bool] = ...) -> None: ...

class WeightsTrailer(_message.Message):
    __slots__ = ("checksum",)
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    checksum: bytes
    def __init__(self, checksum: _Optional[bytes] = ...) -> None: ...

class UpdateWeightsResponse(_message.Message):
    __slots__ = ("weights_version", "tensors", "rebuild_s", "paused_s", "sequences_invalidated")
    WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    REBUILD_S_FIELD_NUMBER: _ClassVar[int]
    PAUSED_S_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_INVALIDATED_FIELD_NUMBER: _ClassVar[int]
    weights_version: int
    tensors: int
    rebuild_s: float
    paused_s: float
    sequences_invalidated: int
    def __init__(self, weights_version: _Optional[int] = ..., tensors: _Optional[int] = ..., rebuild_s: _Optional[float] = ..., paused_s: _Optional[float] = ..., sequences_invalidated: _Optional[int] = ...) -> None: ...

class ListAdaptersResponse(_message.Message):
    __slots__ = ("adapters", "evicted")
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[AdapterEntry]
    evicted: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, adapters: _Optional[_Iterable[_Union[AdapterEntry, _Mapping]]] = ..., evicted: _Optional[_Iterable[str]] = ...) -> None: ...

class KvFingerprint(_message.Message):
    __slots__ = ("weights_digest", "dtype", "quantization", "kv_layout", "block_size", "tensor_parallel", "digest")
    WEIGHTS_DIGEST_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    weights_digest: str
    dtype: DType
    quantization: str
    kv_layout: str
    block_size: int
    tensor_parallel: int
    digest: str
    def __init__(self, weights_digest: _Optional[str] = ..., dtype: _Optional[_Union[DType, str]] = ..., quantization: _Optional[str] = ..., kv_layout: _Optional[str] = ..., block_size: _Optional[int] = ..., tensor_parallel: _Optional[int] = ..., digest: _Optional[str] = ...) -> None: ...

class ExportSequenceRequest(_message.Message):
    __slots__ = ("kv_cache", "model", "chunk_bytes")
    KV_CACHE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    kv_cache: KvCacheHandle
    model: str
    chunk_bytes: int
    def __init__(self, kv_cache: _Optional[_Union[KvCacheHandle, _Mapping]] = ..., model: _Optional[str] = ..., chunk_bytes: _Optional[int] = ...) -> None: ...

class SequenceChunk(_message.Message):
    __slots__ = ("header", "kv", "trailer")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    TRAILER_FIELD_NUMBER: _ClassVar[int]
    header: SequenceHeader
    kv: KvChunk
    trailer: SequenceTrailer
    def __init__(self, header: _Optional[_Union[SequenceHeader, _Mapping]] = ..., kv: _Optional[_Union[KvChunk, _Mapping]] = ..., trailer: _Optional[_Union[SequenceTrailer, _Mapping]] = ...) -> None: ...

class SequenceHeader(_message.Message):
    __slots__ = ("format_version", "fingerprint", "token_ids", "sequence_length", "prompt_spans", "kv_bytes", "kv_bytes_per_token", "model", "adapter", "adapter_digest")
    FORMAT_VERSION_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    PROMPT_SPANS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_DIGEST_FIELD_NUMBER: _ClassVar[int]
    format_version: int
    fingerprint: KvFingerprint
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sequence_length: int
    prompt_spans: _containers.RepeatedScalarFieldContainer[int]
    kv_bytes: int
    kv_bytes_per_token: int
    model: str
    adapter: str
    adapter_digest: str
    def __init__(self, format_version: _Optional[int] = ..., fingerprint: _Optional[_Union[KvFingerprint, _Mapping]] = ..., token_ids: _Optional[_Iterable[int]] = ..., sequence_length: _Optional[int] = ..., prompt_spans: _Optional[_Iterable[int]] = ..., kv_bytes: _Optional[int] = ..., kv_bytes_per_token: _Optional[int] = ..., model: _Optional[str] = ..., adapter: _Optional[str] = ..., adapter_digest: _Optional[str] = ...) -> None: ...

class KvChunk(_message.Message):
    __slots__ = ("first_token", "num_tokens", "data")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    first_token: int
    num_tokens: int
    data: bytes
    def __init__(self, first_token: _Optional[int] = ..., num_tokens: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class SequenceTrailer(_message.Message):
    __slots__ = ("checksum",)
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    checksum: bytes
    def __init__(self, checksum: _Optional[bytes] = ...) -> None: ...

class ImportSequenceResponse(_message.Message):
    __slots__ = ("kv_cache",)
    KV_CACHE_FIELD_NUMBER: _ClassVar[int]
    kv_cache: KvCacheHandle
    def __init__(self, kv_cache: _Optional[_Union[KvCacheHandle, _Mapping]] = ...) -> None: ...

class CreateImportTicketRequest(_message.Message):
    __slots__ = ("model", "fingerprint", "ttl_s")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    model: str
    fingerprint: str
    ttl_s: float
    def __init__(self, model: _Optional[str] = ..., fingerprint: _Optional[str] = ..., ttl_s: _Optional[float] = ...) -> None: ...

class ImportTicket(_message.Message):
    __slots__ = ("ticket", "ttl_s", "model")
    TICKET_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ticket: str
    ttl_s: float
    model: str
    def __init__(self, ticket: _Optional[str] = ..., ttl_s: _Optional[float] = ..., model: _Optional[str] = ...) -> None: ...

class PushSequenceRequest(_message.Message):
    __slots__ = ("kv_cache", "model", "target", "ticket", "move", "chunk_bytes")
    KV_CACHE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    MOVE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    kv_cache: KvCacheHandle
    model: str
    target: str
    ticket: str
    move: bool
    chunk_bytes: int
    def __init__(self, kv_cache: _Optional[_Union[KvCacheHandle, _Mapping]] = ..., model: _Optional[str] = ..., target: _Optional[str] = ..., ticket: _Optional[str] = ..., move: _Optional[bool] = ..., chunk_bytes: _Optional[int] = ...) -> None: ...

class PushSequenceResponse(_message.Message):
    __slots__ = ("kv_cache", "bytes_sent", "released")
    KV_CACHE_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    kv_cache: KvCacheHandle
    bytes_sent: int
    released: bool
    def __init__(self, kv_cache: _Optional[_Union[KvCacheHandle, _Mapping]] = ..., bytes_sent: _Optional[int] = ..., released: _Optional[bool] = ...) -> None: ...

class WatchKvEventsRequest(_message.Message):
    __slots__ = ("model", "snapshot")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    model: str
    snapshot: bool
    def __init__(self, model: _Optional[str] = ..., snapshot: _Optional[bool] = ...) -> None: ...

class KvBlock(_message.Message):
    __slots__ = ("block_hash", "parent_hash", "token_ids")
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    block_hash: bytes
    parent_hash: bytes
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, block_hash: _Optional[bytes] = ..., parent_hash: _Optional[bytes] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class KvEventsHello(_message.Message):
    __slots__ = ("chain_root", "block_size", "model", "queue_limit", "cached", "next_sequence", "adapter_roots")
    class AdapterRootsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bytes
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...
    CHAIN_ROOT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    QUEUE_LIMIT_FIELD_NUMBER: _ClassVar[int]
    CACHED_FIELD_NUMBER: _ClassVar[int]
    NEXT_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_ROOTS_FIELD_NUMBER: _ClassVar[int]
    chain_root: bytes
    block_size: int
    model: str
    queue_limit: int
    cached: _containers.RepeatedCompositeFieldContainer[KvBlock]
    next_sequence: int
    adapter_roots: _containers.ScalarMap[str, bytes]
    def __init__(self, chain_root: _Optional[bytes] = ..., block_size: _Optional[int] = ..., model: _Optional[str] = ..., queue_limit: _Optional[int] = ..., cached: _Optional[_Iterable[_Union[KvBlock, _Mapping]]] = ..., next_sequence: _Optional[int] = ..., adapter_roots: _Optional[_Mapping[str, bytes]] = ...) -> None: ...

class KvEvent(_message.Message):
    __slots__ = ("sequence", "stored", "removed", "all_cleared")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    ALL_CLEARED_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    stored: KvBlock
    removed: bytes
    all_cleared: bool
    def __init__(self, sequence: _Optional[int] = ..., stored: _Optional[_Union[KvBlock, _Mapping]] = ..., removed: _Optional[bytes] = ..., all_cleared: _Optional[bool] = ...) -> None: ...

class KvEventBatch(_message.Message):
    __slots__ = ("hello", "events", "resync")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    RESYNC_FIELD_NUMBER: _ClassVar[int]
    hello: KvEventsHello
    events: _containers.RepeatedCompositeFieldContainer[KvEvent]
    resync: bool
    def __init__(self, hello: _Optional[_Union[KvEventsHello, _Mapping]] = ..., events: _Optional[_Iterable[_Union[KvEvent, _Mapping]]] = ..., resync: _Optional[bool] = ...) -> None: ...
