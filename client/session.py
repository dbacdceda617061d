"""DecodeSession streams as objects: one bidirectional call, a step per request, the
replies read as steps finish; decoding ahead starts from a session (``ahead.py``)."""

from __future__ import annotations

from typing import Iterable

import grpc

from . import rpc as rpcs
from .ahead import AsyncDecodeAhead, DecodeAhead, ahead_request
from .rpc import DecodeItem
from ferrum_rpc.errors import ExecutorError, from_rpc_error, from_status_proto
from ferrum_rpc.metadata import deadline_metadata
from ferrum_rpc.types import DecodeOutput, LogitsPolicy, TokenChoice
from ferrum_rpc.v1 import executor_pb2 as pb
from ferrum_rpc.v1 import executor_pb2_grpc as pb_grpc


class _Session:
    """What both DecodeSession flavours share: a step's request and its replies."""

    def __init__(self, model: str, regions: dict | None):
        self.model, self._regions = model, regions if regions is not None else {}
        self._next_step = 0

    def _request(self, items: Iterable[DecodeItem], logits: LogitsPolicy | None,
                 token_choice: TokenChoice | None = None) -> pb.DecodeSessionRequest:
        self._next_step += 1
        return rpcs.session_request(self, self._next_step, items, logits, token_choice)

    @staticmethod
    def _take(replies: list, reply: pb.DecodeSessionResponse) -> None:
        """Adds a reply's results to ``replies``; a step's error raises its table exception."""
        if reply.HasField("error"):
            raise from_status_proto(reply.error)
        replies.extend(reply.results or [reply])


class DecodeSession(_Session):
    """A bidirectional decode stream used step by step from one thread.

    Each :meth:`step` sends one request (any number of sequences) and waits for
    its replies; a failed step raises the table's exception and the session
    stays usable.  Close it (or use ``with``) to end the stream.
    """

    _END = object()

    def __init__(self, stub: pb_grpc.ModelExecutorStub, model: str, timeout: float | None,
                 regions: dict | None = None):
        import queue

        super().__init__(model, regions)
        self._requests: queue.Queue = queue.Queue()
        self._responses = stub.DecodeSession(iter(self._requests.get, self._END), timeout=timeout,
                                             metadata=deadline_metadata(timeout))

    def step(self, items: Iterable[DecodeItem], logits: LogitsPolicy | None = None,
             token_choice: TokenChoice | None = None) -> list[DecodeOutput]:
        """One step; an item's token choice is its ``DecodeInput.token_choice``, else
        ``token_choice`` (``out.chosen``); ``logits`` None: full float32 logits for items
        without a choice, none for those with one."""
        request = self._request(items, logits, token_choice)
        self._requests.put(request)
        replies: list = []
        try:
            while len(replies) < len(request.items):
                self._take(replies, next(self._responses))
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None
        return rpcs.batch_outputs(self, replies)

    def decode_ahead(self, items: Iterable[DecodeItem], max_new_tokens: int,
                     token_choice: TokenChoice | None = None, stop_token_ids: Iterable[int] = (),
                     forwards_per_response: int = 0) -> DecodeAhead:
        """Starts decoding ahead (see :mod:`ferrum_rpc.client.ahead`): the server chooses
        and appends up to ``max_new_tokens`` tokens per item on its own, streaming each
        (or, with ``forwards_per_response`` > 1, that many forwards' tokens at a time);
        iterate the run (to its end) before the next step on this session."""
        request = ahead_request(self, items, max_new_tokens, token_choice, stop_token_ids, forwards_per_response)
        self._requests.put(request)
        return DecodeAhead(self, request)

    def close(self) -> None:
        self._requests.put(self._END)
        for _ in self._responses:  # let the server finish the stream cleanly
            pass

    def cancel(self) -> None:
        """Ends the stream at once (a cancel): the server undoes the session's unconfirmed
        steps.  For a session that failed or that its caller abandons."""
        self._requests.put(self._END)
        self._responses.cancel()

    def __enter__(self) -> DecodeSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncDecodeSession(_Session):
    """:class:`DecodeSession` for asyncio: ``async with client.decode_session() as s``."""

    def __init__(self, stub: pb_grpc.ModelExecutorStub, model: str, timeout: float | None,
                 regions: dict | None = None):
        super().__init__(model, regions)
        self._call = stub.DecodeSession(timeout=timeout, metadata=deadline_metadata(timeout))

    async def step(self, items: Iterable[DecodeItem], logits: LogitsPolicy | None = None,
                   token_choice: TokenChoice | None = None) -> list[DecodeOutput]:
        """:meth:`DecodeSession.step`."""
        request = self._request(items, logits, token_choice)
        replies: list = []
        try:
            await self._call.write(request)
            while len(replies) < len(request.items):
                reply = await self._call.read()
                if reply is grpc.aio.EOF:
                    raise ExecutorError("the session stream ended", code=grpc.StatusCode.UNAVAILABLE)
                self._take(replies, reply)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None
        return rpcs.batch_outputs(self, replies)

    async def decode_ahead(self, items: Iterable[DecodeItem], max_new_tokens: int,
                           token_choice: TokenChoice | None = None, stop_token_ids: Iterable[int] = (),
                           forwards_per_response: int = 0) -> AsyncDecodeAhead:
        """:meth:`DecodeSession.decode_ahead`: ``async for index, chosen in run``."""
        request = ahead_request(self, items, max_new_tokens, token_choice, stop_token_ids, forwards_per_response)
        try:
            await self._call.write(request)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None
        return AsyncDecodeAhead(self, request)

    def cancel(self) -> None:
        """:meth:`DecodeSession.cancel`."""
        self._call.cancel()

    async def close(self) -> None:
        await self._call.done_writing()
        while await self._call.read() is not grpc.aio.EOF:  # let the server finish cleanly
            pass

    async def __aenter__(self) -> AsyncDecodeSession:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
