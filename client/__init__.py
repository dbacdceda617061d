"""The typed ferrum-rpc client: caller code reads like an in-process executor.

    from . import ExecutorClient
    with ExecutorClient("127.0.0.1:50051") as ex:
        out = ex.prefill(token_ids)
        step = ex.decode(next_id, out.kv_cache)

Several targets (``connect(["10.0.0.1:50051", "10.0.0.2:50051"])``) give a replica
set: placement by load, handle affinity, failover by replay
(``ferrum_rpc.client.replicas``); ``connect`` of one target is an ExecutorClient.
"""

from .ahead import AheadResult
from .client import AsyncExecutorClient, ClientTls, ExecutorClient, Keepalive
from .replicas import AsyncReplicaSetClient, ReplicaPolicy, ReplicaSetClient, connect, connect_async
from ferrum_rpc.errors import (
    CacheNotFound,
    Draining,
    ExecutorError,
    FailoverFailed,
    InvalidInput,
    KvCapacityExhausted,
    LengthMismatch,
    ModelNotFound,
    SequenceTooLong,
    StaleHandle,
)
from ferrum_rpc.types import (
    ChosenToken,
    DecodeInput,
    HiddenStatesRequest,
    KvCacheHandle,
    Logits,
    LogitsKind,
    LogitsPolicy,
    LogprobsMode,
    SpeculativeSampling,
    TokenChoice,
    TokenLogprob,
)

__all__ = [
    "AheadResult",
    "AsyncExecutorClient",
    "AsyncReplicaSetClient",
    "ClientTls",
    "CacheNotFound",
    "ChosenToken",
    "DecodeInput",
    "Draining",
    "ExecutorClient",
    "ExecutorError",
    "FailoverFailed",
    "HiddenStatesRequest",
    "InvalidInput",
    "Keepalive",
    "KvCacheHandle",
    "KvCapacityExhausted",
    "LengthMismatch",
    "Logits",
    "LogitsKind",
    "LogitsPolicy",
    "LogprobsMode",
    "ModelNotFound",
    "ReplicaPolicy",
    "ReplicaSetClient",
    "SequenceTooLong",
    "SpeculativeSampling",
    "StaleHandle",
    "TokenChoice",
    "TokenLogprob",
    "connect",
    "connect_async",
]
