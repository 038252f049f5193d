"""Waking a session its owner suspended for idleness: the gateway answers a call to it
``503 SessionWaking`` with ``Retry-After`` (it never buffers) and asks a worker to resume
it; the SDK tries the call again until the session is Ready, so a caller sees only
latency. Every refusal tried again here means nothing was sent to a worker, so a retry
never runs anything twice."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from ..errors import KruntimesError, SandboxStateError, SessionSuspended, SessionWaking, Unavailable

#: How long a call keeps trying while its session wakes from an auto-suspend, in seconds.
WAKE_DEADLINE = 60.0
#: The longest wait between two tries of a waking session's call, in seconds.
WAKE_RETRY_CAP = 2.0
#: Phases a woken session passes through on its way back to Ready.
RESUMING_PHASES = frozenset({"Suspended", "Pending", "Scheduled"})

T = TypeVar("T")


def wake_delay(error: KruntimesError, woken: bool) -> float | None:
    """How long a call waits before trying again after ``error`` while its session may be
    waking, or ``None`` to give up with the error. A ``SessionWaking`` answer is retried
    after its ``Retry-After`` (at most :data:`WAKE_RETRY_CAP`); once one was seen
    (``woken``), so are the steps of the resume: the Run Suspended, Pending or Scheduled on
    its way back (the gateway's 409 ``SessionSuspended`` once the marker is gone, its 503
    ``NotReady``)."""
    if isinstance(error, SessionWaking):
        delay = 1.0 if error.retry_after is None else error.retry_after
    elif not woken:
        return None
    elif isinstance(error, SessionSuspended) or (
        isinstance(error, SandboxStateError) and error.phase in RESUMING_PHASES
    ):
        delay = 0.25
    elif isinstance(error, Unavailable) and error.reason == "NotReady":
        delay = 1.0 if error.retry_after is None else error.retry_after
    else:
        return None
    return min(max(delay, 0.0), WAKE_RETRY_CAP)


async def through_wake(attempt: Callable[[], Awaitable[T]]) -> T:
    """Runs ``attempt`` until it succeeds, fails for another reason than a wake, or
    :data:`WAKE_DEADLINE` passes (:func:`wake_delay` says which failures are tried again)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAKE_DEADLINE
    woken = False
    while True:
        try:
            return await attempt()
        except KruntimesError as error:
            woken = woken or isinstance(error, SessionWaking)
            delay = wake_delay(error, woken)
            if delay is None or loop.time() + delay >= deadline:
                raise
        await asyncio.sleep(delay)
