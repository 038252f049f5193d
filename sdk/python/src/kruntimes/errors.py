"""The exceptions of the SDK: one hierarchy under :class:`KruntimesError`.

A non-zero exit code, a timed-out command or a cancelled operation is a *result*
(:class:`~kruntimes.models.ExecResult`, a ``completed`` event), never an exception.

Nothing in this SDK retries a call automatically. :class:`OutcomeUnknown` says that a
request or frame was sent and no answer tells what happened (the connection broke, no
answer came in time, the gateway answered 502 or 504): the operation may or may not have
run. Retry such a call only when running it twice is safe.
"""

from __future__ import annotations

#: The longest server message an error keeps, in characters (the gateway bounds its own).
MAX_MESSAGE_CHARS = 1024


def bounded(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """``text`` on one line, cut to ``limit`` characters."""
    one_line = " ".join(text.split())
    if len(one_line) > limit:
        return one_line[: limit - 1] + "…"
    return one_line


class KruntimesError(Exception):
    """Any failure of a kruntimes call.

    Attributes:
        status: The HTTP (or HTTP-like) status when the server gave one.
        reason: The machine-readable reason (``NotFound``, ``Conflict``, …) when known.
        message: The server's (or the SDK's) message, bounded, on one line.
    """

    def __init__(self, message: str, *, status: int | None = None, reason: str | None = None) -> None:
        self.message = bounded(message)
        self.status = status
        self.reason = reason
        super().__init__(self._describe())

    def _describe(self) -> str:
        prefix = ""
        if self.status is not None:
            prefix = f"{self.status} {self.reason or ''}".rstrip() + ": "
        elif self.reason:
            prefix = f"{self.reason}: "
        return prefix + self.message


class InvalidRequest(KruntimesError):
    """The request is malformed (the SDK's own checks before sending, or a 400/413/422)."""


class Unauthorized(KruntimesError):
    """No valid credentials (401)."""


class NotFound(KruntimesError):
    """The object does not exist (404)."""


class Forbidden(KruntimesError):
    """The caller may not do this (403)."""


class Conflict(KruntimesError):
    """The object's state refuses the call (409): a name taken, a draining session, a
    repeated operation ID."""


class RequestConflict(Conflict):
    """A sandbox was already created for this creation request ID with other options (a
    409; nothing was created).

    Attributes:
        request_id: The request ID.
        name: The Run it created.
    """

    def __init__(self, message: str, *, request_id: str, name: str) -> None:
        self.request_id = request_id
        self.name = name
        super().__init__(message, status=409, reason="RequestConflict")


class RequestIdReserved(Conflict):
    """The sandbox this creation request ID created has ended (or is being deleted): its
    Run stays as the ID's tombstone, so the ID never creates a second sandbox (a 409).
    Deleting that Run purges the tombstone and frees the ID.

    Attributes:
        request_id: The request ID.
        name: The Run it created.
        phase: That Run's phase now (``Succeeded``, ``Cancelled``, …).
    """

    def __init__(self, message: str, *, request_id: str, name: str, phase: str) -> None:
        self.request_id = request_id
        self.name = name
        self.phase = phase
        super().__init__(message, status=409, reason="RequestIdReserved")


class SessionSuspended(Conflict):
    """The session is Suspended (a 409 ``SessionSuspended``): its workspace is in a
    snapshot and no worker holds it. Resume it (``Sandbox.resume()``) and call again."""


class SessionSuspending(Conflict):
    """The session is being suspended (a 409 ``SessionSuspending``): ``spec.suspend`` is
    true and the Run is still Ready, so new operations and uploads are refused until it is
    Suspended (or resumed)."""


class Superseded(Conflict):
    """A suspend or resume was overtaken by a newer, opposite one before it took effect: the
    Run's ``metadata.generation`` moved past the caller's with ``spec.suspend`` the other way.

    Attributes:
        generation: The generation the caller's patch produced.
        current_generation: The Run's generation that overtook it.
    """

    def __init__(self, message: str, *, generation: int, current_generation: int) -> None:
        self.generation = generation
        self.current_generation = current_generation
        super().__init__(message, status=409, reason="Superseded")


class TooManyRequests(KruntimesError):
    """Over a limit (429): a session's full queue, a function's ``concurrency`` already in
    flight, the gateway's concurrency cap. Never queued, never retried by the SDK.

    Attributes:
        retry_after: Seconds the server suggested waiting (``Retry-After``), when it did.
    """

    def __init__(
        self,
        message: str,
        *,
        status: int | None = 429,
        reason: str | None = "TooManyRequests",
        retry_after: float | None = None,
    ) -> None:
        self.retry_after = retry_after
        super().__init__(message, status=status, reason=reason)


class RunStateError(KruntimesError):
    """The Run is in a phase that cannot take the call, or it ended while being waited for.

    Attributes:
        name: The Run's name.
        phase: Its phase (``Pending``, ``Finalizing``, ``Failed``, …).
        run_reason: ``status.reason`` of the Run, when set (``LeaseExpired``, …).
        run_message: ``status.message`` of the Run, when set.
    """

    def __init__(
        self,
        message: str,
        *,
        name: str,
        phase: str,
        run_reason: str | None = None,
        run_message: str | None = None,
        status: int | None = None,
        reason: str | None = None,
    ) -> None:
        self.name = name
        self.phase = phase
        self.run_reason = run_reason
        self.run_message = run_message
        super().__init__(message, status=status, reason=reason)


class SandboxStateError(RunStateError):
    """The sandbox cannot take the call in its phase: not yet Ready, draining, ended (with
    the Run's phase and reason, e.g. ``Timeout``/``LeaseExpired``), replaced by another Run
    of the same name, or not a sandbox at all."""


class SnapshotStateError(KruntimesError):
    """A checkpoint (a ``Snapshot``) cannot serve the call: its capture ``Failed`` (with the
    Snapshot's reason and message), it is not ``Ready`` yet and cannot be forked, it was
    deleted while being waited for (phase ``Deleted``), or the name now holds another
    Snapshot than the one meant (reason ``Replaced``).

    Attributes:
        name: The Snapshot's name.
        phase: Its phase (``Pending``, ``Capturing``, ``Failed``, …).
        snapshot_reason: ``status.reason`` of the Snapshot, when set.
        snapshot_message: ``status.message`` of the Snapshot, when set.
    """

    def __init__(
        self,
        message: str,
        *,
        name: str,
        phase: str,
        snapshot_reason: str | None = None,
        snapshot_message: str | None = None,
        status: int | None = None,
        reason: str | None = None,
    ) -> None:
        self.name = name
        self.phase = phase
        self.snapshot_reason = snapshot_reason
        self.snapshot_message = snapshot_message
        super().__init__(message, status=status, reason=reason)


class OperationTimeout(KruntimesError):
    """A wait passed its limit (acquiring, releasing, a checkpoint, a task or a function),
    or a function's handler ran past its time (outcome ``TimedOut``). The Run goes on."""


class InvocationError(KruntimesError):
    """The function's handler raised (outcome ``Failed``).

    Attributes:
        error_type: The exception's type, e.g. ``ValueError``.
        error_message: Its message.
        traceback: The handler's traceback, as the runtime formatted it.
        invocation_id: The invocation's ID.
        stdout: What the handler printed (at most 64 KiB, the end kept).
        stderr: What it wrote to stderr.
    """

    def __init__(
        self,
        *,
        error_type: str,
        error_message: str,
        traceback: str,
        invocation_id: str,
        stdout: str = "",
        stderr: str = "",
    ) -> None:
        self.error_type = error_type
        self.error_message = error_message
        self.traceback = traceback
        self.invocation_id = invocation_id
        self.stdout = stdout
        self.stderr = stderr
        super().__init__(
            f"the handler failed ({invocation_id}): {error_type}: {error_message}",
            reason="InvocationFailed",
        )


class OutcomeUnknown(KruntimesError):
    """Something was sent and no answer says what happened: it may or may not have taken
    effect. Never retried automatically.

    Attributes:
        operation_id: The session operation or invocation concerned, when known.
    """

    def __init__(
        self,
        message: str,
        *,
        operation_id: str | None = None,
        status: int | None = None,
        reason: str | None = "OutcomeUnknown",
    ) -> None:
        self.operation_id = operation_id
        super().__init__(message, status=status, reason=reason)


class Unavailable(KruntimesError):
    """The server could not be reached before anything was sent, or answered 503: nothing
    happened.

    Attributes:
        retry_after: Seconds the server suggested waiting (``Retry-After``), when it did.
    """

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        reason: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        self.retry_after = retry_after
        super().__init__(message, status=status, reason=reason)


class SessionWaking(Unavailable):
    """The session was suspended by its owner for idleness and this call is waking it (a 503
    ``SessionWaking`` with ``Retry-After``): nothing was sent to a worker. The sandbox calls
    of this SDK try again until it is Ready (at most a minute), so a caller sees this only
    when the wake takes longer than that."""


class SessionClosed(KruntimesError):
    """The session's connection is closed (by :meth:`close`, by the gateway, or lost).

    Attributes:
        status: The gateway's status when it ended the connection with an ``error`` frame.
    """


def from_status(
    status: int,
    reason: str | None,
    message: str,
    *,
    retry_after: float | None = None,
    operation_id: str | None = None,
) -> KruntimesError:
    """The exception for an error answer (an HTTP status or a ``rejected`` frame)."""
    if status in (502, 504) or reason == "OutcomeUnknown":
        return OutcomeUnknown(message, operation_id=operation_id, status=status, reason=reason)
    if status == 404:
        return NotFound(message, status=status, reason=reason)
    if status == 403:
        return Forbidden(message, status=status, reason=reason)
    if status == 401:
        return Unauthorized(message, status=status, reason=reason)
    if status == 409 and reason == "SessionSuspended":
        return SessionSuspended(message, status=status, reason=reason)
    if status == 409 and reason == "SessionSuspending":
        return SessionSuspending(message, status=status, reason=reason)
    if status == 409:
        return Conflict(message, status=status, reason=reason)
    if status == 429:
        return TooManyRequests(message, status=status, reason=reason, retry_after=retry_after)
    if status in (400, 413, 422):
        return InvalidRequest(message, status=status, reason=reason)
    if status == 503 and reason == "SessionWaking":
        return SessionWaking(message, status=status, reason=reason, retry_after=retry_after)
    if status == 503:
        return Unavailable(message, status=status, reason=reason, retry_after=retry_after)
    return KruntimesError(message, status=status, reason=reason)


def parse_retry_after(value: str | None) -> float | None:
    """``Retry-After`` in seconds (the delta-seconds form; a date is ignored)."""
    if not value:
        return None
    try:
        seconds = float(value.strip())
    except ValueError:
        return None
    return seconds if seconds >= 0 else None


__all__ = [
    "Conflict",
    "Forbidden",
    "InvalidRequest",
    "InvocationError",
    "KruntimesError",
    "NotFound",
    "OperationTimeout",
    "OutcomeUnknown",
    "RequestConflict",
    "RequestIdReserved",
    "RunStateError",
    "SandboxStateError",
    "SessionClosed",
    "SessionSuspended",
    "SessionSuspending",
    "SessionWaking",
    "SnapshotStateError",
    "Superseded",
    "TooManyRequests",
    "Unauthorized",
    "Unavailable",
    "from_status",
]
