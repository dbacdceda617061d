"""Waiting on a condition with a deadline: the one place under tests/ that polls.

A test waits for something it can observe (a status field, a future's state, a file's
contents, a process's exit) and fails at a deadline naming what it waited for and the
last value it saw; it never sleeps a fixed time in the hope that the thing happened.
tests/unit/test_no_sleeps.py keeps every other sleep under tests/ to the ones marked
``# workload:`` (sleeps that are the work under test, not a wait).
"""

from __future__ import annotations

import asyncio
import inspect
import time
from typing import Any, Callable, TypeVar

T = TypeVar("T")

FIRST_POLL_S = 0.001  # the first pause between two looks; it doubles up to LAST_POLL_S
LAST_POLL_S = 0.05


def _failure(what: str, timeout: float, value: Any) -> AssertionError:
    return AssertionError(f"timed out after {timeout:g} s waiting for {what} (last observed: {value!r})")


def wait_for(observe: Callable[[], T], timeout: float, what: str,
             until: Callable[[T], bool] = bool, poll_s: float = LAST_POLL_S) -> T:
    """Calls ``observe`` until ``until`` holds for what it returns (by default: until it
    returns something true), and returns that value.  Polls with a short backoff (1 ms,
    doubling to ``poll_s``, 50 ms unless a test must catch a short-lived state); at
    ``timeout`` seconds raises AssertionError naming ``what`` and the last value observed.
    An exception from ``observe`` propagates at once."""
    deadline = time.monotonic() + timeout
    pause = min(FIRST_POLL_S, poll_s)
    while True:
        value = observe()
        if until(value):
            return value
        left = deadline - time.monotonic()
        if left <= 0:
            raise _failure(what, timeout, value)
        time.sleep(min(pause, left))
        pause = min(2 * pause, poll_s)


async def wait_for_async(observe: Callable[[], Any], timeout: float, what: str,
                         until: Callable[[Any], bool] = bool, poll_s: float = LAST_POLL_S) -> Any:
    """``wait_for`` inside an event loop: ``observe`` may be a plain function or a
    coroutine function; the pauses between looks let the loop run."""
    deadline = time.monotonic() + timeout
    pause = min(FIRST_POLL_S, poll_s)
    while True:
        value = observe()
        if inspect.isawaitable(value):
            value = await value
        if until(value):
            return value
        left = deadline - time.monotonic()
        if left <= 0:
            raise _failure(what, timeout, value)
        await asyncio.sleep(min(pause, left))
        pause = min(2 * pause, poll_s)
