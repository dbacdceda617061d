"""Decoding ahead on a DecodeSession: the server keeps choosing and appending tokens
on its own and streams each one back as it is chosen (``DecodeSessionRequest.max_new_tokens``).

A run is iterated for ``(index, ChosenToken)`` pairs as they arrive; ``stop()``
asks the server to end it after its current forward, and iterating on then
yields the tokens chosen until then.  Once every item has ended, ``results`` holds
each item's handle (covering exactly the emitted tokens: the last one is the next
step's token) and why it ended.  A failed run raises the table's exception and
its sequences are where the run found them.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import AsyncIterator, Iterable, Iterator

import grpc

from ferrum_rpc import convert
from . import rpc as rpcs
from ferrum_rpc.rules import check_decode_session, checked_ids
from ferrum_rpc.errors import ExecutorError, from_rpc_error, from_status_proto
from ferrum_rpc.types import ChosenToken, DecodeInput, KvCacheHandle, LogitsPolicy, TokenChoice
from ferrum_rpc.v1 import executor_pb2 as pb

_ARGMAX = LogitsPolicy.argmax()  # a resumed run's catch-up only needs the KV
# A whole run that no on_token watches asks for a response per this many forwards
# (DecodeSessionRequest.forwards_per_response): each response costs the server a
# socket write and this process a read, on the cores the forwards need when both
# share a host; a lost run's replay (see run_ahead) redoes at most this many forwards
# more than it would have.
UNWATCHED_FORWARDS_PER_RESPONSE = 16

FINISH_REASONS = {
    pb.FINISH_REASON_LENGTH: "length",  # max_new_tokens emitted
    pb.FINISH_REASON_STOP_TOKEN: "stop_token",  # a stop token emitted (the last token)
    pb.FINISH_REASON_STOPPED: "stopped",  # stop() ended it
    pb.FINISH_REASON_MAX_SEQUENCE_LENGTH: "max_sequence_length",  # the sequence is full
}


@dataclass(frozen=True)
class AheadResult:
    """One item's end: its handle (length = before + len(chosen)), why, and every token
    the run chose for it, in order (the last is not in the KV yet)."""

    kv_cache: KvCacheHandle
    finish_reason: str
    chosen: tuple[ChosenToken, ...]


def ahead_request(session, items: Iterable[rpcs.DecodeItem], max_new_tokens: int,
                  token_choice: TokenChoice | None, stop_token_ids: Iterable[int],
                  forwards_per_response: int = 0) -> pb.DecodeSessionRequest:
    request = session._request(items, None, token_choice)
    request.single_reply = False
    request.max_new_tokens = max_new_tokens
    request.stop_token_ids.extend(checked_ids("stop_token_ids", stop_token_ids))
    request.forwards_per_response = forwards_per_response
    check_decode_session(request)
    return request


class _Run:
    """What both flavours share: the replies of one run, item by item."""

    def __init__(self, session, request: pb.DecodeSessionRequest):
        self._session, self.step_id = session, request.step_id
        self._chosen: list[list[ChosenToken]] = [[] for _ in request.items]
        self._results: list[AheadResult | None] = [None] * len(request.items)
        self._left = len(request.items)

    @property
    def finished(self) -> bool:
        return self._left == 0

    @property
    def results(self) -> list[AheadResult]:
        """Every item's end, in item order (read the run to its end first)."""
        if not self.finished:
            raise RuntimeError("the run has not ended: iterate it to its end first")
        return list(self._results)

    def _stop_request(self) -> pb.DecodeSessionRequest:
        return pb.DecodeSessionRequest(step_id=self.step_id, stop=True)

    def _take(self, reply: pb.DecodeSessionResponse) -> list[tuple[int, ChosenToken]]:
        """The tokens one response carries (one per item still going, in ``results``
        when there are several)."""
        if reply.HasField("error"):
            self._left = 0
            raise from_status_proto(reply.error)
        if reply.step_id != self.step_id:
            raise ExecutorError(f"a reply of step {reply.step_id} during decode-ahead step {self.step_id}",
                                code=grpc.StatusCode.INTERNAL)
        return [self._take_one(r) for r in (reply.results or [reply])]

    def _take_one(self, reply: pb.DecodeSessionResponse) -> tuple[int, ChosenToken]:
        chosen = convert.chosen_from_proto(reply.chosen)
        self._chosen[reply.index].append(chosen)
        if reply.HasField("kv_cache"):
            handle = convert.handle_from_proto(reply.kv_cache)
            self._results[reply.index] = AheadResult(handle, FINISH_REASONS.get(reply.finish_reason, "unknown"),
                                                     tuple(self._chosen[reply.index]))
            self._left -= 1
        return reply.index, chosen


class DecodeAhead(_Run):
    """A decode-ahead run on a :class:`~ferrum_rpc.client.client.DecodeSession`."""

    def __iter__(self) -> Iterator[tuple[int, ChosenToken]]:
        while not self.finished:
            try:
                reply = next(self._session._responses)
            except StopIteration:
                raise ExecutorError("the session stream ended", code=grpc.StatusCode.UNAVAILABLE) from None
            except grpc.RpcError as exc:
                raise from_rpc_error(exc) from None
            yield from self._take(reply)

    def stop(self) -> None:
        """Ends the run after the server's current forward; read on for the last tokens."""
        if not self.finished:
            self._session._requests.put(self._stop_request())

    def wait(self) -> list[AheadResult]:
        """Reads the run to its end; every item's result."""
        for _ in self:
            pass
        return self.results


class AsyncDecodeAhead(_Run):
    """:class:`DecodeAhead` on an :class:`~ferrum_rpc.client.client.AsyncDecodeSession`."""

    async def __aiter__(self) -> AsyncIterator[tuple[int, ChosenToken]]:
        while not self.finished:
            try:
                reply = await self._session._call.read()
            except grpc.RpcError as exc:
                raise from_rpc_error(exc) from None
            if reply is grpc.aio.EOF:
                raise ExecutorError("the session stream ended", code=grpc.StatusCode.UNAVAILABLE)
            for taken in self._take(reply):
                yield taken

    async def stop(self) -> None:
        if not self.finished:
            await self._session._call.write(self._stop_request())

    async def wait(self) -> list[AheadResult]:
        async for _ in self:
            pass
        return self.results


# -- a whole run as one call (every client, replica sets included) ----------------------

def _finished_early(got: list[ChosenToken], max_new_tokens: int, stop_ids: frozenset[int],
                    stopped: bool) -> str | None:
    """Why a run resumed after ``got`` has nothing left to do (None: it goes on)."""
    if got and got[-1].token_id in stop_ids:
        return "stop_token"
    if len(got) >= max_new_tokens:
        return "length"
    return "stopped" if stopped else None


def _forwards_per_response(on_token) -> int:
    """One response per forward for a run whose tokens someone watches as they come."""
    return 0 if on_token is not None else UNWATCHED_FORWARDS_PER_RESPONSE


def _resume_args(got: list[ChosenToken], token_id: int) -> tuple[list[int], int]:
    """What a resumed run appends first (the tokens a lost run had already emitted, all
    but its last) and the token it then goes on from."""
    return [token_id] + [c.token_id for c in got[:-1]], got[-1].token_id


def run_ahead(client, kv_cache: KvCacheHandle, token_id: int, token_choice: TokenChoice, max_new_tokens: int,
              stop_token_ids: Iterable[int], got: list[ChosenToken], on_token, stopped: list[bool]) -> AheadResult:
    """One decode-ahead run on ``client``'s server, to its end.  ``got`` holds (and
    receives) the tokens emitted so far: when it is not empty the run resumes a lost
    one, first appending those tokens (ForwardVerify, as output) so the server's
    sequence and choices go on exactly where the lost run left off.  ``on_token(chosen)``
    sees each new token; a truthy return asks the server to stop (``stopped[0]``)."""
    stop_ids = frozenset(stop_token_ids)
    handle, token = kv_cache, token_id
    if got:
        appended, token = _resume_args(got, token_id)
        handle = client.forward_verify(appended, handle, logits=_ARGMAX).kv_cache
        done = _finished_early(got, max_new_tokens, stop_ids, stopped[0])
        if done:
            return AheadResult(handle, done, tuple(got))
    session = client.decode_session()
    try:
        run = session.decode_ahead([DecodeInput(token, handle, token_choice)], max_new_tokens - len(got),
                                   token_choice, sorted(stop_ids), _forwards_per_response(on_token))
        for _, chosen in run:
            got.append(chosen)
            if on_token is not None and on_token(chosen) and not stopped[0]:
                stopped[0] = True
                run.stop()
        (result,) = run.results
    except BaseException:
        session.cancel()  # the server undoes the run: a failed call changes nothing
        raise
    session.close()
    return AheadResult(result.kv_cache, result.finish_reason, tuple(got))


async def run_ahead_async(client, kv_cache: KvCacheHandle, token_id: int, token_choice: TokenChoice,
                          max_new_tokens: int, stop_token_ids: Iterable[int], got: list[ChosenToken], on_token,
                          stopped: list[bool]) -> AheadResult:
    """:func:`run_ahead` on an asyncio client (``on_token`` may be a coroutine function)."""
    stop_ids = frozenset(stop_token_ids)
    handle, token = kv_cache, token_id
    if got:
        appended, token = _resume_args(got, token_id)
        handle = (await client.forward_verify(appended, handle, logits=_ARGMAX)).kv_cache
        done = _finished_early(got, max_new_tokens, stop_ids, stopped[0])
        if done:
            return AheadResult(handle, done, tuple(got))
    session = client.decode_session()
    try:
        run = await session.decode_ahead([DecodeInput(token, handle, token_choice)], max_new_tokens - len(got),
                                         token_choice, sorted(stop_ids), _forwards_per_response(on_token))
        async for _, chosen in run:
            got.append(chosen)
            wants_stop = on_token(chosen) if on_token is not None else None
            if inspect.isawaitable(wants_stop):
                wants_stop = await wants_stop
            if wants_stop and not stopped[0]:
                stopped[0] = True
                await run.stop()
        (result,) = run.results
    except BaseException:
        session.cancel()
        raise
    await session.close()
    return AheadResult(result.kv_cache, result.finish_reason, tuple(got))
