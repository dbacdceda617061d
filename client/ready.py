"""What ``wait_ready`` means, once for both single-target clients
(:class:`~ferrum_rpc.client.ExecutorClient`, :class:`~ferrum_rpc.client.AsyncExecutorClient`):
the server serves the client's model, as GetStatus says, not merely a connected channel."""

from __future__ import annotations

import time

import grpc

from ferrum_rpc.errors import Draining, ExecutorError, NotServing, Reason
from ferrum_rpc.types import ServerState

READY_PAUSE_S = (0.02, 0.5)  # the first and the longest pause between status probes


class Readiness:
    """What both clients' ``wait_ready`` share: the deadline, what one GetStatus probe's
    outcome means (the model serves: done; the server or the model still loading, or the
    connection lost: ask again; anything else: raised at once, waiting cannot change it),
    the growing pause between probes, and the error once time runs out."""

    def __init__(self, client, timeout: float):
        self.client, self.timeout = client, timeout
        self.deadline = time.monotonic() + timeout
        self.seen = "no connection"
        self._pause = READY_PAUSE_S[0]

    def left(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    def served(self, outcome) -> bool:
        """True once ``outcome`` (a status, or the ExecutorError asking gave) says the model serves."""
        if isinstance(outcome, ExecutorError):
            if outcome.code is grpc.StatusCode.DEADLINE_EXCEEDED and outcome.reason is None:
                return False  # the probe ran out of the time left: expired() says what was seen before
            if outcome.reason is not Reason.MODEL_LOADING and not (
                    outcome.reason is None and outcome.code is grpc.StatusCode.UNAVAILABLE):
                raise outcome
            self.seen = str(outcome)
            return False
        if outcome.state is ServerState.SERVING:
            return True
        if outcome.state is ServerState.DRAINING:
            raise Draining(f"{self.client.target} is shutting down: it will not serve {self.model_shown()}")
        self.seen = "the server still loading its models"
        return False

    def done(self, outcome) -> bool:
        """:meth:`served`, and once time has run out without it, :meth:`expired` raised."""
        if self.served(outcome):
            return True
        if self.left() <= 0:
            raise self.expired()
        return False

    def pause(self) -> float:
        pause, self._pause = min(self._pause, self.left()), min(2 * self._pause, READY_PAUSE_S[1])
        return pause

    def model_shown(self) -> str:
        return f"model {self.client.model!r}" if self.client.model else "its default model"

    def expired(self) -> NotServing:
        return NotServing(f"{self.client.target} did not serve {self.model_shown()} within {self.timeout:g} s "
                          f"(last seen: {self.seen})")
