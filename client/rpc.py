"""The client's RPCs, each written once: :data:`RPCS` holds, for every unary and
server-streaming call, its request builder, its reply parser and its streaming shape.

:class:`~ferrum_rpc.client.client.ExecutorClient` and
:class:`~ferrum_rpc.client.client.AsyncExecutorClient` get one public method per
entry (:data:`INVOKED`), each calling its class's invoker
(``_invoke``: deadline, deadline header, error mapping), so a new RPC is one entry
here and the two clients cannot drift.  The bidirectional DecodeSession and the
shared-memory registration stream hold state across messages and are objects of
their own (``client.py``, ``shm.py``); they use the builders and parsers below.

A builder's parameters, after the client, are the public method's (names, defaults
and annotations), and its docstring is the method's.
"""

from __future__ import annotations

import inspect
import uuid
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Sequence, Union

from ferrum_rpc import convert, tensor_codec
from ferrum_rpc.errors import ExecutorError, RequestIdExists
from ferrum_rpc.types import (  # the table's `returns` name some of these
    Capabilities,
    DecodeInput,
    DecodeOutput,
    ExecutorStatus,
    HiddenStatesRequest,
    KvCacheHandle,
    LogitsKind,
    LogitsPolicy,
    ModelInfo,
    PrefillOutput,
    SequencePush,
    SpeculativeOutput,
    SpeculativeSampling,
    TokenChoice,
    VerifyOutput,
)
from ferrum_rpc.v1 import executor_pb2 as pb
from . import admin, transfer
from ferrum_rpc.rules import (
    check_decode_batch,
    check_drafts,
    check_fork,
    check_hidden,
    check_id,
    check_logits_policy,
    check_prefill_batch,
    check_sampling,
    check_shared_memory_offset,
    check_prefill,
    checked_id,
    checked_ids,
    validate_token_choice,
)

DecodeItem = Union[DecodeInput, tuple[int, KvCacheHandle]]
Prompt = Union[Sequence[int], tuple[Sequence[int], KvCacheHandle]]



@dataclass(frozen=True)
class Rpc:
    """One RPC as the clients call it.

    Attributes:
        name: the client method.
        method: the stub method (the proto's rpc name).
        request: ``(client, *args, **kwargs) -> request message``; its parameters are
            the method's, and its docstring is the method's.
        reply: ``(client, reply) -> result``; for a stream, ``(client, [replies]) -> result``.
        returns: the result's type, as the method's return annotation.
        stream: the server streams its replies; the invoker collects them in order.
        each: stream only: ``(client, message, *args, **kwargs)``, called as each
            message arrives (progress callbacks).
        with_args: ``reply`` also gets the call's arguments: ``(client, reply, *args, **kwargs)``.
        keep: stream only: keep each message for ``reply`` (False: ``each`` took it already).
        names: ``(request, args, kwargs)``: the request_ids the client generated for the
            sequences a request would create; when such a call ends with its outcome
            unknown (cancelled, timed out, connection lost), the invoker releases them by
            name, so a lost reply leaves no orphan.  A caller's own request_id is never
            released by the client: the caller retries with it (or releases it).
        existing: ``(client, error) -> result``: the result of a call the server answered
            with REQUEST_ID_EXISTS (a retry whose sequence is live), or None to raise it.
        replicas: how a replica set runs the call when it writes no flow of its own
            (``replicas/contract.py``): ``"any"``, one usable replica answers (queries);
            ``"every"``, each replica in turn, returning the last one's result.
    """

    name: str
    method: str
    request: Callable[..., Any]
    reply: Callable[[Any, Any], Any]
    returns: str
    stream: bool = False
    each: Callable[..., None] | None = None
    with_args: bool = False
    names: Callable[[Any, tuple, dict], list[str]] | None = None
    existing: Callable[[Any, RequestIdExists], Any] | None = None
    replicas: str = ""

    def seen(self, client, message, args: tuple, kwargs: dict):
        """A streamed message as it arrives: shown to ``each``, then kept."""
        if self.each is not None:
            self.each(client, message, *args, **kwargs)
        return message

    def answered(self, client, error: RequestIdExists):
        """The result REQUEST_ID_EXISTS stands for, or the error raised again."""
        if self.existing is None or error.handle is None:
            raise error
        return self.existing(client, error)

    def result(self, client, reply, args: tuple, kwargs: dict):
        """The call's result from its reply (or replies)."""
        return self.reply(client, reply, *args, **kwargs) if self.with_args else self.reply(client, reply)


# -- what the builders and parsers read of a client: ``model`` and ``_regions`` --------------


def read_region(c, location: pb.SharedMemoryLocation) -> memoryview:
    region = c._regions.get(location.region)
    if region is None:
        raise ExecutorError(f"logits were written to shared-memory region {location.region!r}, "
                            "which this client did not register")
    return region.view(location)


def output(c, cls, reply):
    logits = convert.logits_from_proto(reply.logits, lambda loc: read_region(c, loc)) \
        if reply.HasField("logits") else None  # unset: a chosen token only
    return cls(logits, convert.handle_from_proto(reply.kv_cache), convert.timing_from_proto(reply.timing))


def chosen_output(c, cls, reply):
    """:func:`output`, with the token the server chose (``.chosen``; None without a token_choice)."""
    out = output(c, cls, reply)
    return replace(out, chosen=convert.chosen_from_proto(reply.chosen)) if reply.HasField("chosen") else out


def set_logits(req, logits: LogitsPolicy | None) -> None:
    """None leaves the field unset: full float32 rows, none where a token_choice is given."""
    if logits is not None:
        check_logits_policy(logits, 1)
        check_shared_memory_offset(logits)
        req.logits.CopyFrom(convert.policy_to_proto(logits))


def set_choice(message, choice: TokenChoice | None, field: str = "token_choice") -> None:
    """The policy, checked against the server's rules (``ferrum_rpc.rules``) before it is sent."""
    if choice is not None:
        validate_token_choice(choice, None, field)
        message.token_choice.CopyFrom(convert.token_choice_to_proto(choice))


def batch_request(c, items: Iterable[DecodeItem], logits: LogitsPolicy | None,
                  token_choice: TokenChoice | None = None) -> pb.BatchDecodeRequest:
    # Small rows (top-k, argmax, rows in shared memory, a chosen token only) come back in
    # one message (each stream message costs both sides a write and a read); full rows stay one message each.
    req = pb.BatchDecodeRequest(model=c.model)
    set_logits(req, logits)
    for n, item in enumerate(items):
        token_id, handle, choice = (item.token_id, item.kv_cache, item.token_choice) \
            if isinstance(item, DecodeInput) else (*item, None)
        message = req.items.add(token_id=checked_id("items.token_id", token_id),
                                kv_cache=convert.handle_to_proto(handle))
        set_choice(message, choice if choice is not None else token_choice, f"items[{n}].token_choice")
    check_decode_batch([i.kv_cache.cache_id for i in req.items])
    if logits is None:
        req.single_reply = bool(req.items) and all(i.HasField("token_choice") for i in req.items)
    else:
        req.single_reply = logits.kind is not LogitsKind.FULL or logits.shared_memory is not None
    return req


def session_request(c, step_id: int, items: Iterable[DecodeItem], logits: LogitsPolicy | None,
                    token_choice: TokenChoice | None = None) -> pb.DecodeSessionRequest:
    batch = batch_request(c, items, logits, token_choice)
    req = pb.DecodeSessionRequest(step_id=step_id, model=batch.model, items=batch.items,
                                  single_reply=batch.single_reply)
    if batch.HasField("logits"):
        req.logits.CopyFrom(batch.logits)
    return req


def batch_outputs(c, replies: Sequence[pb.BatchDecodeResponse]) -> list[DecodeOutput]:
    replies = [r for reply in replies for r in (reply.results or [reply])]  # single_reply: one message
    return [chosen_output(c, DecodeOutput, r) for r in sorted(replies, key=lambda r: r.index)]


def prefill_output(c, reply: pb.PrefillResponse) -> PrefillOutput:
    out = chosen_output(c, PrefillOutput, reply)
    hidden = tuple(tensor_codec.to_numpy(t) for t in getattr(reply, "hidden_states", ()))
    weights = tuple(tensor_codec.to_numpy(t) for t in getattr(reply, "attention_weights", ()))
    return replace(out, cached_tokens=reply.cached_tokens, hidden_states=hidden, attention_weights=weights)


def split_prompt(prompt: Prompt) -> tuple[Sequence[int], KvCacheHandle | None]:
    """A batch_prefill prompt as (token ids, the handle it continues or None)."""
    continues = isinstance(prompt, tuple) and len(prompt) == 2 and isinstance(prompt[1], KvCacheHandle)
    return prompt if continues else (prompt, None)


# -- builders (their signatures are the public methods') ------------------------------------


def _info(c) -> pb.GetModelInfoRequest:
    return pb.GetModelInfoRequest(model=c.model)


def _capabilities(c) -> pb.GetCapabilitiesRequest:
    return pb.GetCapabilitiesRequest(model=c.model)


def _status(c) -> pb.GetStatusRequest:
    return pb.GetStatusRequest(model=c.model)


def _prefill(c, token_ids: Sequence[int], kv_cache: KvCacheHandle | None = None,
             logits: LogitsPolicy | None = None,
             hidden_states: HiddenStatesRequest | None = None,
             token_choice: TokenChoice | None = None, request_id: str | None = None,
             adapter: str = "") -> pb.PrefillRequest:
    """Runs a prompt, or continues ``kv_cache`` with the next chunk of one; with
    ``hidden_states``, also returns those layers' hidden states (``out.hidden_states``).
    With ``token_choice``, the server also chooses the token after it (``out.chosen``);
    ``logits`` None: full float32 logits, none with a token_choice.  ``request_id``:
    the caller's name for the new sequence, unique among its tenant's live ones
    (``release_cache(request_id=...)``), which the client never releases itself: a
    retry with it whose first attempt made the sequence (its reply lost) returns that
    sequence (``out.existing``, no logits); None: the client names it, and releases it
    by that name if the call is cancelled or times out.  ``adapter``: the LoRA adapter a
    new sequence runs with (``list_adapters``), kept for its life."""
    req = pb.PrefillRequest(model=c.model, token_ids=checked_ids("token_ids", token_ids), adapter=adapter)
    check_prefill(req.token_ids, kv_cache is not None, request_id or "")
    if hidden_states is not None:
        check_hidden(hidden_states, len(req.token_ids), 0)
    set_logits(req, logits)
    set_choice(req, token_choice)
    if kv_cache is not None:
        req.kv_cache.CopyFrom(convert.handle_to_proto(kv_cache))
    if request_id is not None or kv_cache is None:
        req.request_id = new_request_id() if request_id is None else request_id
    if hidden_states is not None:
        req.hidden_states.CopyFrom(convert.hidden_request_to_proto(hidden_states))
    return req


def _decode(c, token_id: int, kv_cache: KvCacheHandle, logits: LogitsPolicy | None = None,
            token_choice: TokenChoice | None = None) -> pb.DecodeRequest:
    """Appends ``token_id``; with ``token_choice`` the server also chooses the next
    token (``out.chosen``); ``logits`` None: full float32 logits, none with a token_choice."""
    req = pb.DecodeRequest(model=c.model, token_id=checked_id("token_id", token_id),
                           kv_cache=convert.handle_to_proto(kv_cache))
    set_logits(req, logits)
    set_choice(req, token_choice)
    return req


def _batch_decode(c, items: Iterable[DecodeItem], logits: LogitsPolicy | None = None,
                  token_choice: TokenChoice | None = None) -> pb.BatchDecodeRequest:
    """One batched forward; outputs in the order of ``items``. An item's token choice is
    its ``DecodeInput.token_choice``, else ``token_choice``; ``logits`` None: full
    float32 logits for items without a choice, none for those with one."""
    return batch_request(c, items, logits, token_choice)


def _forward_verify(c, token_ids: Sequence[int], kv_cache: KvCacheHandle,
                    logits: LogitsPolicy = LogitsPolicy()) -> pb.ForwardVerifyRequest:
    return pb.ForwardVerifyRequest(model=c.model, token_ids=checked_ids("token_ids", token_ids),
                                   kv_cache=convert.handle_to_proto(kv_cache),
                                   logits=convert.policy_to_proto(logits))


def _speculative_decode(c, token_id: int, draft: Sequence[int], kv_cache: KvCacheHandle,
                        logits: LogitsPolicy | None = None,
                        sampling: SpeculativeSampling | None = None,
                        token_choice: TokenChoice | None = None) -> pb.SpeculativeDecodeRequest:
    """One round of server-side speculative decoding: ``token_id`` (the last sampled
    token) and ``draft`` verified in one forward, the agreeing drafts kept (greedy),
    or with ``sampling`` the drafts probabilistic acceptance keeps, or with
    ``token_choice`` the drafts equal to the server's own choices (``out.chosen``:
    each kept draft's, then the next token's; the tokens Decode steps with that
    choice would give). ``logits`` None: full float32, none with a token_choice."""
    req = pb.SpeculativeDecodeRequest(model=c.model, token_id=checked_id("token_id", token_id),
                                      draft_token_ids=checked_ids("draft", draft),
                                      kv_cache=convert.handle_to_proto(kv_cache))
    check_drafts(len(draft), token_choice is not None, sampling is not None)
    set_logits(req, logits)
    set_choice(req, token_choice)
    if sampling is not None:
        check_sampling(sampling)
        req.sampling.CopyFrom(pb.SpeculativeSampling(temperature=sampling.temperature, top_k=sampling.top_k,
                                                     top_p=sampling.top_p, seed=sampling.seed))
    return req


def _batch_prefill(c, prompts: Iterable[Prompt], logits: LogitsPolicy | None = None,
                   token_choice: TokenChoice | Sequence[TokenChoice | None] | None = None,
                   adapters: str | Sequence[str] = "") -> pb.BatchPrefillRequest:
    """Several prompts (token ids, or ``(token_ids, handle)`` to continue one) in one
    call, run as shared forwards; outputs in order.  All or nothing. ``token_choice``:
    one for every prompt, or one (or None) per prompt; ``logits`` None: full float32
    logits, none for prompts with a token_choice.  ``adapters``: the LoRA adapter of every
    new sequence, or one per prompt ("" the base model)."""
    req = pb.BatchPrefillRequest(model=c.model)
    set_logits(req, logits)
    prompts = list(prompts)
    choices = [token_choice] * len(prompts) if token_choice is None or isinstance(token_choice, TokenChoice) \
        else list(token_choice)
    if len(choices) != len(prompts):
        raise ValueError(f"{len(choices)} token choices for {len(prompts)} prompts")
    adapters = [adapters] * len(prompts) if isinstance(adapters, str) else list(adapters)
    if len(adapters) != len(prompts):
        raise ValueError(f"{len(adapters)} adapters for {len(prompts)} prompts")
    for n, (prompt, choice, adapter) in enumerate(zip(prompts, choices, adapters)):
        token_ids, handle = split_prompt(prompt)
        item = req.items.add(token_ids=checked_ids("prompts.token_ids", token_ids))
        if handle is not None:
            item.kv_cache.CopyFrom(convert.handle_to_proto(handle))
        else:
            item.request_id = new_request_id()  # released by this name if the call's outcome is unknown
            item.adapter = adapter
        set_choice(item, choice, f"items[{n}].token_choice")
    check_prefill_batch([i.kv_cache.cache_id for i in req.items if i.HasField("kv_cache")],
                        [i.request_id for i in req.items], len(req.items))
    return req


def _truncate_kv(c, kv_cache: KvCacheHandle, new_length: int) -> pb.TruncateKvRequest:
    return pb.TruncateKvRequest(kv_cache=convert.handle_to_proto(kv_cache), new_length=new_length)


def _release_cache(c, cache: KvCacheHandle | str | None = None, request_id: str | None = None) -> pb.ReleaseCacheRequest:
    """Frees a sequence (handle or cache_id), or the one created under ``request_id``
    (aborting its Prefill if that still runs; see the proto); returns the blocks freed."""
    if (cache is None) == (request_id is None):
        raise ValueError("release_cache takes a handle or cache_id, or a request_id")
    if request_id is not None:
        check_id(request_id, "request_id")
        return pb.ReleaseCacheRequest(request_id=request_id, model=c.model)
    if isinstance(cache, KvCacheHandle):
        return pb.ReleaseCacheRequest(cache_id=cache.cache_id, model=cache.model)
    return pb.ReleaseCacheRequest(cache_id=cache, model=c.model)


def new_request_id() -> str:
    """A fresh request_id: 32 random hex digits."""
    return uuid.uuid4().hex


def generated_names(request, args: tuple, kwargs: dict) -> list[str]:
    """The request_ids the client generated for the sequences a Prefill or BatchPrefill
    request would create (batch_prefill names every new sequence itself; prefill names
    one unless its caller gave a ``request_id``)."""
    if hasattr(request, "items"):
        return [item.request_id for item in request.items if item.request_id]
    given = inspect.signature(_prefill).bind(None, *args, **kwargs).arguments.get("request_id")
    return [request.request_id] if request.request_id and given is None else []


def existing_output(c, error: RequestIdExists) -> PrefillOutput:
    """A retried prefill's result when its first attempt made the sequence: its handle."""
    return PrefillOutput(None, error.handle, existing=True)


def _fork_cache(c, kv_cache: KvCacheHandle, num_children: int) -> pb.ForkCacheRequest:
    """N handles sharing ``kv_cache``'s blocks (copied on first divergent write)."""
    check_fork(num_children)
    return pb.ForkCacheRequest(kv_cache=convert.handle_to_proto(kv_cache), num_children=num_children)


# -- the table ------------------------------------------------------------------------------


def _handles(c, reply: pb.ForkCacheResponse) -> list[KvCacheHandle]:
    return [convert.handle_from_proto(h) for h in reply.children]


def _speculative_output(c, reply: pb.SpeculativeDecodeResponse) -> SpeculativeOutput:
    out = output(c, DecodeOutput, reply)
    return SpeculativeOutput(tuple(reply.accepted_token_ids), reply.next_token_id, out.logits, out.kv_cache,
                             out.timing, tuple(convert.chosen_from_proto(m) for m in reply.chosen))


STATUS = Rpc("status", "GetStatus", _status, lambda c, r: convert.status_from_proto(r), "ExecutorStatus",
             replicas="any")

RPCS: tuple[Rpc, ...] = (
    Rpc("info", "GetModelInfo", _info, lambda c, r: convert.model_info_from_proto(r), "ModelInfo", replicas="any"),
    Rpc("capabilities", "GetCapabilities", _capabilities, lambda c, r: convert.capabilities_from_proto(r),
        "Capabilities", replicas="any"),
    STATUS,
    Rpc("prefill", "Prefill", _prefill, prefill_output, "PrefillOutput", names=generated_names,
        existing=existing_output),
    Rpc("decode", "Decode", _decode, lambda c, r: chosen_output(c, DecodeOutput, r), "DecodeOutput"),
    Rpc("batch_decode", "BatchDecode", _batch_decode, batch_outputs, "list[DecodeOutput]", stream=True),
    Rpc("forward_verify", "ForwardVerify", _forward_verify, lambda c, r: output(c, VerifyOutput, r), "VerifyOutput"),
    Rpc("speculative_decode", "SpeculativeDecode", _speculative_decode, _speculative_output, "SpeculativeOutput"),
    Rpc("batch_prefill", "BatchPrefill", _batch_prefill,
        lambda c, rs: [prefill_output(c, r) for r in sorted(rs, key=lambda r: r.index)], "list[PrefillOutput]",
        stream=True, names=generated_names),
    Rpc("truncate_kv", "TruncateKv", _truncate_kv, lambda c, r: convert.handle_from_proto(r.kv_cache),
        "KvCacheHandle"),
    Rpc("release_cache", "ReleaseCache", _release_cache, lambda c, r: r.blocks_freed, "int"),
    Rpc("fork_cache", "ForkCache", _fork_cache, _handles, "list[KvCacheHandle]"),
    Rpc("list_models", "ListModels", admin.list_models, lambda c, r: list(r.models), "list[pb.ModelEntry]",
        replicas="any"),
    Rpc("load_model", "LoadModel", admin.load_model, lambda c, rs: None, "None", stream=True, each=admin.load_progress,
        replicas="every"),
    Rpc("unload_model", "UnloadModel", admin.unload_model, lambda c, r: r.sequences_dropped, "int"),
    Rpc("load_adapter", "LoadAdapter", admin.load_adapter, lambda c, r: r, "pb.AdapterEntry", replicas="every"),
    Rpc("unload_adapter", "UnloadAdapter", admin.unload_adapter, lambda c, r: None, "None", replicas="every"),
    Rpc("list_adapters", "ListAdapters", admin.list_adapters, lambda c, r: list(r.adapters), "list[pb.AdapterEntry]",
        replicas="any"),
    Rpc("update_weights", "UpdateWeights", admin.update_weights, lambda c, r: r, "pb.UpdateWeightsResponse",
        replicas="every"),
    Rpc("export_sequence", "ExportSequence", transfer.export_sequence, transfer.export_result, "bytes | int", stream=True,
        each=transfer.export_each, with_args=True),
    Rpc("import_sequence", "ImportSequence", transfer.import_sequence, lambda c, r: convert.handle_from_proto(r.kv_cache),
        "KvCacheHandle"),
    Rpc("create_import_ticket", "CreateImportTicket", transfer.create_import_ticket, lambda c, r: r, "pb.ImportTicket"),
    Rpc("push_sequence", "PushSequence", transfer.push_sequence, transfer.pushed, "SequencePush"),
)


# -- one method per entry ----------------------------------------------------------------------


def method(name: str, like: Callable, returns: Any, run: Callable, aio: bool) -> Callable:
    """A method named ``name`` returning ``run(self, *args, **kwargs)`` (awaited when
    ``aio``), with ``like``'s parameters (its first renamed ``self``) as its signature,
    ``returns`` as its return annotation and ``like``'s docstring."""
    if aio:
        async def call(self, *args, **kwargs):
            return await run(self, *args, **kwargs)
    else:
        def call(self, *args, **kwargs):
            return run(self, *args, **kwargs)
    sig = inspect.signature(like)
    first, *rest = sig.parameters.values()
    call.__signature__ = sig.replace(parameters=[first.replace(name="self"), *rest], return_annotation=returns)
    call.__name__ = call.__qualname__ = name
    call.__doc__ = like.__doc__
    return call


def with_methods(calls: dict[str, Callable[[bool], Callable]], aio: bool) -> Callable[[type], type]:
    """Class decorator: the method ``make(aio)`` for every ``name: make`` of ``calls``."""
    def decorate(cls: type) -> type:
        for name, make in calls.items():
            made = make(aio)
            made.__qualname__, made.__module__ = f"{cls.__qualname__}.{name}", cls.__module__
            setattr(cls, name, made)
        return cls
    return decorate


def _invoked(rpc: Rpc) -> Callable[[bool], Callable]:
    return lambda aio: method(rpc.name, rpc.request, rpc.returns,
                              lambda self, *args, **kwargs: self._invoke(rpc, args, kwargs), aio)


# What ExecutorClient and AsyncExecutorClient get: a method per RPC, calling their ``_invoke``.
INVOKED = {rpc.name: _invoked(rpc) for rpc in RPCS}
