"""A session: one WebSocket to a sandbox (``GET {endpoint}/operations:ws``).

The gateway reads a connection's frames one at a time and answers each with exactly one
reply, in order (docs/session-mode.md, "Replies on the WebSocket"): a ``send`` with its
operation's ``queued`` event or ``rejected``, a ``cancel`` with ``cancelled``, a
``heartbeat`` with ``heartbeat``. So the session keeps its requests in a FIFO and matches
each reply to the oldest one; frames are written under a lock, so that FIFO is the wire's
order. Every other frame is an event of an operation: it goes to that operation's
follower when one is following it (``exec``), else to the queue ``receive`` reads.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import json
from collections.abc import Mapping
from typing import Any

from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed

from ..errors import (
    InvalidRequest,
    KruntimesError,
    OutcomeUnknown,
    SessionClosed,
    from_status,
)
from ..models import Command, Event, ExecResult, Operation
from ._wake import through_wake

#: How long a frame's reply may take, in seconds; past it the outcome is unknown.
REPLY_TIMEOUT = 60.0
#: The largest frame sent or received (the gateway closes the socket with 1009 beyond).
MAX_FRAME_BYTES = 2 * 1024 * 1024
#: Events kept for ``receive`` at most; past it the reader waits (back-pressure on the
#: socket), so a caller that never receives holds the connection, not the memory.
MAX_QUEUED_EVENTS = 4096

_EVENT_KINDS = {"queued": "accepted", "started": "started", "output": "output", "completed": "completed"}


def parse_event(frame: Mapping[str, Any]) -> Event:
    """An ``event`` frame as an :class:`Event`."""
    op = str(frame.get("operationId") or "")
    seq = int(frame.get("sequence") or 0)
    for key, kind in _EVENT_KINDS.items():
        body = frame.get(key)
        if body is None:
            continue
        if not isinstance(body, dict):
            raise KruntimesError(f"the gateway sent a malformed {key} event")
        if kind == "accepted":
            return Event("accepted", op, seq, position=int(body.get("position") or 0))
        if kind == "started":
            return Event("started", op, seq)
        if kind == "output":
            return Event(
                "output",
                op,
                seq,
                stream=str(body.get("stream") or "stdout"),
                data=base64.b64decode(body.get("data") or ""),
                truncated=bool(body.get("truncated")),
            )
        exit_code = body.get("exitCode")
        return Event(
            "completed",
            op,
            seq,
            state=str(body.get("state") or ""),
            exit_code=int(exit_code) if exit_code is not None else None,
            duration_ms=float(body.get("durationMs") or 0.0),
            reason=str(body.get("reason") or ""),
            message=str(body.get("message") or ""),
            stdout_truncated=bool(body.get("stdoutTruncated")),
            stderr_truncated=bool(body.get("stderrTruncated")),
        )
    raise KruntimesError("the gateway sent an event of an unknown kind")


class _Request:
    __slots__ = ("follow", "future", "kind")

    def __init__(self, kind: str, future: asyncio.Future[Any], follow: bool) -> None:
        self.kind = kind
        self.future = future
        self.follow = follow


_CLOSED = object()


def _retrieve(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


class AsyncSession:
    """An open connection to a sandbox: :meth:`send` operations, :meth:`receive` their
    events, :meth:`cancel` one, :meth:`close` the connection.

    Closing the connection does not cancel anything: operations run on, and their later
    events are dropped. While open, the session sends a heartbeat every third of the
    sandbox's lease, which keeps the lease alive.
    """

    def __init__(self, ws: ClientConnection, heartbeat_interval: float | None) -> None:
        self._ws = ws
        self._pending: collections.deque[_Request] = collections.deque()
        self._write_lock = asyncio.Lock()
        self._events: asyncio.Queue[Any] = asyncio.Queue(MAX_QUEUED_EVENTS)
        self._followers: dict[str, asyncio.Queue[Any]] = {}
        self._closed: KruntimesError | None = None
        self._reader = asyncio.get_running_loop().create_task(self._read())
        self._heartbeats: asyncio.Task[None] | None = None
        #: The last heartbeat failure, when a heartbeat was refused.
        self.heartbeat_error: KruntimesError | None = None
        if heartbeat_interval is not None:
            self._heartbeats = asyncio.get_running_loop().create_task(self._beat(heartbeat_interval))

    @property
    def closed(self) -> bool:
        """The connection has ended."""
        return self._closed is not None

    # -- reading --------------------------------------------------------------------------

    async def _read(self) -> None:
        ending: KruntimesError = SessionClosed("the session's connection is closed")
        try:
            async for raw in self._ws:
                frame = json.loads(raw)
                if not isinstance(frame, dict):
                    raise KruntimesError("the gateway sent a frame that is not a JSON object")
                end = await self._handle(frame)
                if end is not None:
                    ending = end
                    break
        except ConnectionClosed as e:
            code = e.rcvd.code if e.rcvd is not None else None
            ending = SessionClosed(f"the connection closed (code {code})" if code else "the connection was lost")
        except (ValueError, KruntimesError) as e:
            ending = SessionClosed(f"the gateway broke the session protocol: {e}")
            await self._ws.close(1002)
        except asyncio.CancelledError:
            pass
        finally:
            self._finish(ending)

    async def _handle(self, frame: dict[str, Any]) -> KruntimesError | None:
        kind = frame.get("type")
        if kind == "event":
            event = parse_event(frame)
            if event.type == "accepted":
                request = self._reply("send")
                if request.follow:
                    self._followers[event.operation_id] = asyncio.Queue()
                if not request.future.done():
                    request.future.set_result(event.operation_id)
            await self._route(event)
        elif kind == "rejected":
            request = self._reply(None)
            status = int(frame.get("status") or 0)
            error = from_status(
                status,
                frame.get("reason"),
                str(frame.get("message") or "rejected"),
                operation_id=frame.get("operationId"),
            )
            if not request.future.done():
                request.future.set_exception(error)
            if status in (401, 403):
                return SessionClosed(f"the gateway refused the session: {error}", status=status)
        elif kind == "cancelled":
            request = self._reply("cancel")
            if not request.future.done():
                request.future.set_result((bool(frame.get("found")), str(frame.get("state") or "")))
        elif kind == "heartbeat":
            request = self._reply("heartbeat")
            if not request.future.done():
                request.future.set_result(frame.get("leaseExpiresAt"))
        elif kind == "error":
            status = int(frame.get("status") or 0)
            message = str(frame.get("message") or "")
            op = frame.get("operationId")
            if op:
                # This operation's events were cut off: it may or may not run to its end.
                await self._route(Event("failed", str(op), 0, code=status, message=message, reason=frame.get("reason")))
            else:
                return SessionClosed(
                    f"the gateway ended the connection: {status} {frame.get('reason') or ''}: {message}",
                    status=status,
                    reason=frame.get("reason"),
                )
        else:
            raise KruntimesError(f"the gateway sent a frame of unknown type {kind!r}")
        return None

    def _reply(self, expected: str | None) -> _Request:
        if not self._pending:
            raise KruntimesError("the gateway sent a reply to no request")
        request = self._pending.popleft()
        if expected is not None and request.kind != expected:
            raise KruntimesError(f"the gateway answered a {request.kind} with a {expected} reply")
        return request

    async def _route(self, event: Event) -> None:
        follower = self._followers.get(event.operation_id)
        if follower is not None:
            follower.put_nowait(event)
        else:
            await self._events.put(event)

    def _finish(self, ending: KruntimesError) -> None:
        if self._closed is not None:
            return
        self._closed = ending
        while self._pending:
            request = self._pending.popleft()
            if not request.future.done():
                request.future.set_exception(
                    OutcomeUnknown(f"the connection ended before the {request.kind} was answered: {ending.message}")
                )
        for follower in self._followers.values():
            follower.put_nowait(_CLOSED)
        with contextlib.suppress(asyncio.QueueFull):
            self._events.put_nowait(_CLOSED)
        if self._heartbeats is not None:
            self._heartbeats.cancel()

    # -- writing --------------------------------------------------------------------------

    async def _request(
        self, frame: dict[str, Any], kind: str, follow: bool = False, timeout: float = REPLY_TIMEOUT
    ) -> Any:
        text = json.dumps(frame, separators=(",", ":"))
        if len(text) > MAX_FRAME_BYTES:
            raise InvalidRequest(f"the frame of {len(text)} bytes is over the limit of {MAX_FRAME_BYTES}")
        if self._closed is not None:
            raise SessionClosed(f"the session's connection is closed; nothing was sent ({self._closed.message})")
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        # A caller that stopped waiting (a cancelled heartbeat) leaves the reply unread.
        future.add_done_callback(_retrieve)
        async with self._write_lock:
            if self._closed is not None:
                raise SessionClosed(f"the session's connection is closed; nothing was sent ({self._closed.message})")
            self._pending.append(_Request(kind, future, follow))
            # A frame may have gone out before the connection broke: the reply's wait below
            # then ends in OutcomeUnknown, never in "not sent".
            with contextlib.suppress(ConnectionClosed):
                await self._ws.send(text)
        try:
            return await asyncio.wait_for(asyncio.shield(future), timeout)
        except asyncio.TimeoutError:
            raise OutcomeUnknown(f"no answer to the {kind} within {timeout:g}s") from None

    async def send(self, operation: Operation, *, follow: bool = False) -> str:
        """Sends one operation and returns its ID once the sandbox admitted it (the
        ``accepted`` event, which :meth:`receive` also returns).

        Raises :class:`~kruntimes.TooManyRequests` when the queue is full,
        :class:`~kruntimes.Conflict` when the sandbox drains or the ID is taken,
        :class:`~kruntimes.InvalidRequest` for a malformed operation (nothing ran), and
        :class:`~kruntimes.OutcomeUnknown` when the connection broke or no reply came.

        A sandbox its owner suspended for idleness is woken: the send is rejected
        ``SessionWaking`` (nothing admitted) and sent again until it is Ready, for at most
        a minute (:class:`~kruntimes.SessionWaking` past that).
        """
        frame = {"type": "send", "operation": operation.to_wire()}

        async def attempt() -> str:
            op_id: str = await self._request(frame, "send", follow=follow)
            return op_id

        return await through_wake(attempt)

    async def cancel(self, operation_id: str) -> bool:
        """Cancels a queued or running operation; True when the sandbox found it (its
        ``completed`` event then says ``Cancelled``, unless it ended first)."""
        found, _state = await self._request({"type": "cancel", "operationId": operation_id}, "cancel")
        return bool(found)

    async def heartbeat(self) -> str | None:
        """Renews the sandbox's lease now; returns when it expires (RFC 3339)."""
        expires: str | None = await self._request({"type": "heartbeat"}, "heartbeat")
        return expires

    async def _beat(self, interval: float) -> None:
        while self._closed is None:
            await asyncio.sleep(interval)
            try:
                await self.heartbeat()
            except SessionClosed:
                return
            except KruntimesError as e:
                self.heartbeat_error = e

    async def receive(self, timeout: float | None = None) -> Event:
        """The next event of the operations sent on this connection (not those an
        :meth:`exec` follows), in the order they arrived.

        Raises :class:`~kruntimes.SessionClosed` once the connection has ended and every
        event before the end was received; :class:`TimeoutError` after ``timeout``."""
        if self._closed is not None and self._events.empty():
            raise self._closed_error()
        try:
            item = await asyncio.wait_for(self._events.get(), timeout)
        except asyncio.TimeoutError:
            # The builtin TimeoutError on every version (3.10's asyncio has its own).
            raise TimeoutError(f"no event within {timeout:g}s") from None
        if item is _CLOSED:
            with contextlib.suppress(asyncio.QueueFull):
                self._events.put_nowait(_CLOSED)
            raise self._closed_error()
        assert isinstance(item, Event)
        return item

    def _closed_error(self) -> SessionClosed:
        ended = self._closed
        if isinstance(ended, SessionClosed):
            return SessionClosed(ended.message, status=ended.status, reason=ended.reason)
        return SessionClosed("the session's connection is closed")

    def __aiter__(self) -> AsyncSession:
        return self

    async def __anext__(self) -> Event:
        try:
            return await self.receive()
        except SessionClosed:
            raise StopAsyncIteration from None

    async def follow(self, operation_id: str) -> ExecResult:
        """Collects the events of a followed operation until its end."""
        queue = self._followers.get(operation_id)
        if queue is None:
            raise KruntimesError(f"operation {operation_id} is not followed")
        stdout = bytearray()
        stderr = bytearray()
        try:
            while True:
                item = await queue.get()
                if item is _CLOSED:
                    raise OutcomeUnknown(
                        f"the connection ended before operation {operation_id} completed; it may run on",
                        operation_id=operation_id,
                    )
                assert isinstance(item, Event)
                if item.type == "output":
                    (stderr if item.stream == "stderr" else stdout).extend(item.data)
                elif item.type == "failed":
                    raise OutcomeUnknown(
                        f"the events of operation {operation_id} were cut off ({item.code}: {item.message}); "
                        "it may or may not run to its end",
                        operation_id=operation_id,
                    )
                elif item.type == "completed":
                    state = item.state or ""
                    return ExecResult(
                        operation_id=operation_id,
                        exit_code=item.exit_code,
                        stdout=bytes(stdout),
                        stderr=bytes(stderr),
                        state=state,
                        reason=item.reason or "",
                        message=item.message or "",
                        timed_out=state == "TimedOut",
                        duration_ms=item.duration_ms or 0.0,
                        stdout_truncated=item.stdout_truncated,
                        stderr_truncated=item.stderr_truncated,
                    )
        finally:
            self._followers.pop(operation_id, None)

    async def run(self, operation: Operation) -> ExecResult:
        """Sends one operation and follows it to its end (events of other operations
        received meanwhile are kept for :meth:`receive`)."""
        op_id = await self.send(operation, follow=True)
        return await self.follow(op_id)

    async def exec(
        self,
        argv: list[str] | None = None,
        *,
        shell: str | None = None,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        stdin: bytes | str | None = None,
        timeout: float | None = None,
        operation_id: str | None = None,
    ) -> ExecResult:
        """Runs one command and returns what it did; a non-zero exit code is a result."""
        command = Command(argv=argv, shell=shell, cwd=cwd, env=env, stdin=stdin, timeout=timeout)
        return await self.run(Operation(command=command, operation_id=operation_id))

    async def close(self) -> None:
        """Closes the connection only: the sandbox and its operations go on."""
        if self._heartbeats is not None:
            self._heartbeats.cancel()
        with contextlib.suppress(Exception):
            await self._ws.close()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader
        self._finish(SessionClosed("the session was closed"))

    async def __aenter__(self) -> AsyncSession:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
