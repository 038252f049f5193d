"""A lean HTTP/1.1 client for the invoke path and uploads: kept-alive TLS connections to
one origin, with h11 (the HTTP/1.1 state machine httpx's own transport is built on)
framing requests and answers over plain asyncio transports.

Why not httpx here: a warm invoke through httpx2 (client, httpcore2 pool, anyio streams)
cost about 0.7-0.9 ms of CPU per call on the benchmark machine, several times what the
request and the answer need, and httpcore2 writes the head and the body of a request in
two ``send`` calls, which wakes the gateway twice. This client writes each request in one
``send``, reads the answer into one buffer bounded by the caller's limit, and keeps the
connection for the next call only when both sides finished the exchange cleanly.

Uploads (:meth:`Http1Pool.request_streamed`) come here for another reason: the answer is
read while the body is still being sent, so a refusal the server sends mid-body (and the
connection it then closes) is reported as that refusal; httpcore2 reads the answer only
after the whole body, and saw a broken connection instead.

Every failure says whether the request may have reached the server: :class:`NotSent`
(the connection could not be made) or :class:`Broken` (it was, and the exchange did not
complete). Nothing is retried here.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass

import h11

#: The largest answer head (status line and headers).
MAX_HEAD_BYTES = 64 * 1024
#: The most idle connections kept per origin.
MAX_IDLE = 8


class NotSent(Exception):
    """The connection could not be made (or its TLS handshake failed): nothing was sent."""


class Broken(Exception):
    """The connection ended or broke after (part of) the request was written."""


class AnswerTimeout(Exception):
    """No whole answer within the call's time, after the request was written."""


class AnswerTooLarge(Exception):
    """The answer's body is over the caller's limit (the connection is dropped)."""


@dataclass(frozen=True)
class Answer:
    """An HTTP answer: status, headers (names in lower case; the last of repeated ones)
    and the whole body."""

    status: int
    headers: dict[str, str]
    body: bytes


class _Connection(asyncio.Protocol):
    """One TLS connection and its h11 state; :meth:`exchange` runs one request."""

    def __init__(self) -> None:
        self.h11 = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD_BYTES)
        self.transport: asyncio.Transport | None = None
        #: Closed, at EOF, or sent bytes while idle: never reused.
        self.dead = False
        self._busy = False
        self._eof = False
        self._received = 0
        self._limit = 0
        self._waiter: asyncio.Future[None] | None = None
        self._write_paused = False

    # -- asyncio.Protocol -----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if not self._busy:
            # Bytes nobody asked for: the exchange state is unknown, drop the connection.
            self.close()
            return
        self._received += len(data)
        if self._received > self._limit:
            # Past the answer's bound: stop reading; the exchange reports it.
            self.close()
            self._wake()
            return
        self.h11.receive_data(data)
        self._wake()

    def eof_received(self) -> bool | None:
        self._end()
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self._end()

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        self._wake()

    # -- the rest -------------------------------------------------------------------------

    def _end(self) -> None:
        self.dead = True
        if self._busy and not self._eof:
            self._eof = True
            self.h11.receive_data(b"")
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def close(self) -> None:
        self.dead = True
        if self.transport is not None:
            self.transport.close()

    def reusable(self) -> bool:
        return not self.dead and self.transport is not None and not self.transport.is_closing()

    async def _wait(self) -> None:
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _begin(self, limit: int) -> None:
        self._busy = True
        self._received = 0
        self._limit = limit + MAX_HEAD_BYTES

    async def exchange(self, request: bytes, limit: int, deadline: float) -> Answer:
        """Writes ``request`` (already framed by :meth:`frame`) and reads the whole answer."""
        assert self.transport is not None
        self._begin(limit)
        try:
            self.transport.write(request)
            return await self._answer(limit, deadline)
        except BaseException:
            # Anything short of a whole answer (cancellation too) leaves the connection in
            # an unknown state: it is never reused.
            self.close()
            raise
        finally:
            self._busy = False

    async def exchange_streamed(
        self, head: h11.Request, body: AsyncIterator[bytes], limit: int, idle_timeout: float, answer_timeout: float
    ) -> Answer:
        """Writes ``head``, then ``body`` a chunk at a time (waiting while the transport's
        buffer is full, at most ``idle_timeout`` seconds each), then reads the answer
        (within ``answer_timeout`` seconds of the body's end). An answer that comes before
        the body is all sent (a refusal) ends the sending: it is the result."""
        assert self.transport is not None
        loop = asyncio.get_running_loop()
        self._begin(limit)
        try:
            self.transport.write(self.h11.send(head) or b"")
            complete = True
            async for chunk in body:
                if self._received or self.dead:
                    complete = False
                    break
                self.transport.write(self.h11.send(h11.Data(data=chunk)) or b"")
                stalled = loop.time() + idle_timeout
                while self._write_paused and not self.dead and not self._received:
                    if loop.time() >= stalled:
                        raise AnswerTimeout()
                    timer = loop.call_at(stalled, self._wake)
                    try:
                        await self._wait()
                    finally:
                        timer.cancel()
            if complete and not self._received and not self.dead:
                self.transport.write(self.h11.send(h11.EndOfMessage()) or b"")
            return await self._answer(limit, loop.time() + answer_timeout)
        except BaseException:
            self.close()
            raise
        finally:
            self._busy = False
            aclose = getattr(body, "aclose", None)
            if aclose is not None:
                await aclose()

    async def _answer(self, limit: int, deadline: float) -> Answer:
        loop = asyncio.get_running_loop()
        timed_out = False

        def expire() -> None:
            nonlocal timed_out
            timed_out = True
            self._wake()

        timer = loop.call_at(deadline, expire)
        try:
            status = 0
            headers: dict[str, str] = {}
            body = bytearray()
            while True:
                try:
                    event = self.h11.next_event()
                except h11.RemoteProtocolError as e:
                    raise Broken(f"the answer is not HTTP/1.1: {e}") from None
                if event is h11.NEED_DATA:
                    if self._received > self._limit:
                        raise AnswerTooLarge()
                    if timed_out:
                        raise AnswerTimeout()
                    if self.dead and self._eof:
                        raise Broken("the server closed the connection before it answered")
                    await self._wait()
                    continue
                if isinstance(event, h11.Response):
                    status = event.status_code
                    headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in event.headers}
                elif isinstance(event, h11.Data):
                    body += event.data
                    if len(body) > limit:
                        raise AnswerTooLarge()
                elif isinstance(event, h11.EndOfMessage):
                    break
                elif isinstance(event, h11.ConnectionClosed):
                    raise Broken("the server closed the connection before it answered")
                # h11.InformationalResponse (1xx): read on.
            self._busy = False
            if self.h11.our_state is h11.DONE and self.h11.their_state is h11.DONE and not self.dead:
                self.h11.start_next_cycle()
            else:
                self.close()
            return Answer(status, headers, bytes(body))
        finally:
            timer.cancel()

    def frame(self, method: str, target: str, headers: list[tuple[str, str]], body: bytes) -> bytes:
        """The request's bytes: head and body in one buffer, so one ``send``."""
        parts = [
            self.h11.send(h11.Request(method=method, target=target, headers=headers)),
            self.h11.send(h11.Data(data=body)) if body else b"",
            self.h11.send(h11.EndOfMessage()),
        ]
        return b"".join(p for p in parts if p)


class Http1Pool:
    """Kept-alive HTTP/1.1 connections to ``host:port`` over TLS (``ssl_context``), at most
    :data:`MAX_IDLE` idle ones; a call takes an idle one or opens a new one."""

    def __init__(self, host: str, port: int, ssl_context: ssl.SSLContext) -> None:
        self.host = host
        self.port = port
        self.authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self._ssl = ssl_context
        self._idle: list[_Connection] = []

    async def _connect(self, timeout: float) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(
                    _Connection,
                    self.host,
                    self.port,
                    ssl=self._ssl,
                    server_hostname=self.host,
                    ssl_handshake_timeout=timeout,
                ),
                timeout,
            )
        except asyncio.TimeoutError:
            raise NotSent(f"no connection within {timeout:g}s") from None
        except (OSError, ssl.SSLError) as e:
            raise NotSent(str(e) or type(e).__name__) from None
        return conn

    async def request(
        self,
        method: str,
        target: str,
        headers: list[tuple[str, str]],
        body: bytes,
        *,
        limit: int,
        timeout: float,
        connect_timeout: float,
    ) -> Answer:
        """One request and its whole answer (body at most ``limit`` bytes), within
        ``timeout`` seconds after the connection is there."""
        conn: _Connection | None = None
        while self._idle:
            candidate = self._idle.pop()
            if candidate.reusable():
                conn = candidate
                break
            candidate.close()
        if conn is None:
            conn = await self._connect(connect_timeout)
        all_headers = [("Host", self.authority), *headers, ("Content-Length", str(len(body)))]
        try:
            framed = conn.frame(method, target, all_headers, body)
        except h11.LocalProtocolError as e:
            conn.close()
            raise ValueError(f"the request cannot be framed: {e}") from None
        deadline = asyncio.get_running_loop().time() + timeout
        answer = await conn.exchange(framed, limit, deadline)
        if conn.reusable():
            if len(self._idle) < MAX_IDLE:
                self._idle.append(conn)
            else:
                conn.close()
        return answer

    async def request_streamed(
        self,
        method: str,
        target: str,
        headers: list[tuple[str, str]],
        body: AsyncIterator[bytes],
        size: int | None,
        *,
        limit: int,
        idle_timeout: float,
        answer_timeout: float,
        connect_timeout: float,
    ) -> Answer:
        """One request with a streamed body (``Content-Length: size``, else chunked) on a
        new connection (so that a connection the server dropped while idle never makes an
        upload's outcome unknown); see :meth:`_Connection.exchange_streamed`."""
        conn = await self._connect(connect_timeout)
        framing = ("Content-Length", str(size)) if size is not None else ("Transfer-Encoding", "chunked")
        try:
            head = h11.Request(method=method, target=target, headers=[("Host", self.authority), *headers, framing])
        except h11.LocalProtocolError as e:
            conn.close()
            raise ValueError(f"the request cannot be framed: {e}") from None
        answer = await conn.exchange_streamed(head, body, limit, idle_timeout, answer_timeout)
        if conn.reusable() and len(self._idle) < MAX_IDLE:
            self._idle.append(conn)
        else:
            conn.close()
        return answer

    def close(self) -> None:
        """Closes the idle connections (those in use close when their call ends)."""
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()
