"""Replica sets: one client over several servers that know nothing of each other.

The design keeps servers unaware of each other; the caller's client does the rest.
A handle names its server instance, so every call on a sequence goes to the replica
that owns it (affinity).  New sequences go where there is room, or to the replica
that already holds the prompt's prefix (locality).  The client remembers every
token it has sent on a live sequence, so it can rebuild a sequence on another
replica by replaying that history when the owner dies, restarts or drains; the
caller's call returns what it would have returned, carrying the new handle, and
the old handle keeps working as an alias.  With replica roles
(``ReplicaPolicy.roles``, :mod:`ferrum_rpc.client.disagg`), prompts run on prefill
replicas and each sequence moves to a decode replica before it decodes.

The routing is written once, as generators ("flows") that perform no I/O: they
yield the calls they need and get back results or have the call's exception thrown
in.  The modules:

- :mod:`.policy`: :class:`ReplicaPolicy` and which errors move a sequence.
- :mod:`.actions`: what flows yield (a call, parallel calls, a sleep, a lost stream).
- :mod:`.placement`: where a new sequence goes, replica health and probes, retry bounds.
- :mod:`.failover`: calls on one sequence, and its moves (replay, migration, resync).
- :mod:`.batches`: batches split by owner, moved and run again, or undone as a whole.
- :mod:`.releases`: releases by handle, cache id and request_id.
- :mod:`.routing`: the state the flows share (:class:`_Routing`).
- :mod:`.contract`: every public call as one flow (:class:`_Contract`, :data:`DRIVEN`).
- :mod:`.drivers`: the blocking and asyncio drivers, which perform the I/O and only that.
- :mod:`.sessions`: DecodeSessions over the set (drivers holding one stream per replica).
- :mod:`.clients`: :class:`ReplicaSetClient`, :class:`AsyncReplicaSetClient`, :func:`connect`.

The bookkeeping (replicas, sequences and their histories, replay pieces, the LRU)
is :mod:`ferrum_rpc.client.fleet`; KV-event placement :mod:`ferrum_rpc.client.kv_router`.
"""

from .actions import Flow, _Call, _Done, _Lost, _Parallel, _Sleep, _resume
from .batches import _entries, _Item, _item_choices, _prompt_choices, _prompt_entries
from .clients import (
    RECONNECT_OPTIONS,
    AsyncReplicaSetClient,
    ReplicaSetClient,
    _ReplicaSet,
    connect,
    connect_async,
    resolve_targets,
)
from .contract import DRIVEN, _Contract, _driven, _export_header, _RESULTS
from .drivers import AsyncDriver, SyncDriver
from .policy import REPLAY_LOGITS, ReplicaPolicy, moves_sequence
from .routing import _Routing
from .sessions import AsyncReplicaDecodeSession, ReplicaDecodeSession, _ReplicaSessions
from ..fleet import TrackedSequence, _Fleet, _key, _Replica, _Sequence, replay_pieces, shrink_spans

__all__ = ["AsyncReplicaSetClient", "ReplicaPolicy", "ReplicaSetClient", "TrackedSequence", "connect",
           "connect_async", "resolve_targets"]
