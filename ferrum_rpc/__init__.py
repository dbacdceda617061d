"""ferrum-rpc: the Ferrum executor contract over gRPC.

The shared core lives here: generated stubs (``ferrum_rpc.v1``), the tensor
codec, the typed handle/result objects and the error table.  The server is
``ferrum_rpc.server`` and the client library ``ferrum_rpc.client``.
"""

from ferrum_rpc.errors import ExecutorError, Reason
from ferrum_rpc.types import (
    BlockTable,
    DecodeInput,
    DecodeOutput,
    KvCacheHandle,
    Logits,
    LogitsKind,
    LogitsPolicy,
    PrefillOutput,
    Timing,
    VerifyOutput,
)

__all__ = [
    "BlockTable",
    "DecodeInput",
    "DecodeOutput",
    "ExecutorError",
    "KvCacheHandle",
    "Logits",
    "LogitsKind",
    "LogitsPolicy",
    "PrefillOutput",
    "Reason",
    "Timing",
    "VerifyOutput",
]
