"""Tensor parallelism on torch.distributed: one rank per device (or per machine),
each holding a shard of the weights and of the KV pool.

Megatron's split, as gpt-fast's ``tp.py`` does it, on our own modules: q/k/v and
gate/up are column-parallel (each rank owns whole heads, whole MLP columns),
o and down are row-parallel, so each layer costs two all-reduces of the hidden
states (forward hooks on ``self_attn`` and ``mlp``).  The KV pool splits by KV
head with the heads.  The LM head is vocabulary-parallel: ARGMAX and TOP_K
reduce each rank's own top-k (k values a row cross the wire, not V); FULL rows
gather whole rows; server-side token choice reduces a few numbers a row
(``tp_choice``), whole rows only for the rare policies it cannot decide otherwise.
Embeddings stay whole on every rank: a lookup reads one row a token, so sharding
them would save memory but no bandwidth, and cost one more all-reduce a forward.

Qwen3-MoE experts shard by expert *columns*: every rank holds every expert's
1/N of gate/up columns and down rows.  The router then runs identically on every
rank, each routed expert's work splits evenly whatever the routing, and the
MoE block needs the same one all-reduce as a dense MLP.  Sharding by expert
would leave a rank idle whenever its experts got no tokens (at batch 1, most
ranks) and needs token exchange (all-to-all) on top.

Rank 0 owns the gRPC server, the worker and the block manager.  Each forward it
broadcasts the plan (per step: tokens, start, block table, which rows go
through the LM head; plus the top-k it needs and each token choice's policy,
seed and penalty counts), then every rank runs the same
``forward.forward`` over its shard.  Block ids are the same on every rank.

The room: ``shard.py`` (the split of weights, and the collectives a shard takes part
in), ``runner.py`` (rank 0's side of a forward: broadcast the plan, run, reduce),
``group.py`` (joining, launching ranks, the watchdog, failing closed) and
``choice.py`` (token choice across vocabulary slices).  A rank's own process loop
is ``server/rank.py``.
"""
