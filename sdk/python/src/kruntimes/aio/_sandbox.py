"""Sandboxes: session Runs (design document 001, "SDK Sandbox and Session Model").

Every data-plane call derives its endpoint from the Run as it is now: it reads the Run
first and refuses one that is not a session, not Ready (status, reads and listings also
take Finalizing), not the Run this sandbox was made from (same name, another UID), or
whose endpoint does not end with ``/sessions/<uid>``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import posixpath
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import replace
from typing import Any
from urllib.parse import quote

import httpx2
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidHandshake, InvalidStatus

from ..errors import (
    Conflict,
    InvalidRequest,
    KruntimesError,
    NotFound,
    OutcomeUnknown,
    RequestConflict,
    RequestIdReserved,
    SandboxStateError,
    SessionSuspended,
    SessionSuspending,
    Superseded,
    from_status,
)
from ..models import (
    MAX_FILE_BYTES,
    MAX_LIST_LIMIT,
    REQUEST_DIGEST_ANNOTATION,
    REQUEST_ID_ANNOTATION,
    AcquireOptions,
    Checkpoint,
    ExecResult,
    FileEntry,
    FilePage,
    ListFilesOptions,
    Operation,
    ReleaseMode,
    SandboxStatus,
    Uploaded,
    check_fork_count,
    check_object_name,
)
from . import _checkpoints, _transfer
from ._client import (
    CALL_TIMEOUT,
    TERMINAL_PHASES,
    AsyncConnection,
    Endpoint,
    error_answer,
    meta,
    phase_of,
    status_field,
    transport_error,
)
from ._session import MAX_FRAME_BYTES, AsyncSession
from ._transfer import Readable, Writable
from ._wake import through_wake

#: The largest listing answer read.
MAX_LISTING_BYTES = 16 * 1024 * 1024
#: The largest status answer read.
MAX_STATUS_BYTES = 64 * 1024
#: The annotation with which a session's owner marks a suspend of its own (for idleness),
#: naming the incarnation it suspended: a call wakes such a session, never another.
AUTO_SUSPENDED_ANNOTATION = "kruntimes.io/auto-suspended"


def auto_suspended(run: Mapping[str, Any]) -> bool:
    """Whether ``run`` was suspended by its owner for idleness (``spec.suspend`` and the
    auto-suspend marker naming its current incarnation): a call wakes it."""
    if not (run.get("spec") or {}).get("suspend"):
        return False
    marker = _annotation(run, AUTO_SUSPENDED_ANNOTATION)
    try:
        incarnation = max(int((run.get("status") or {}).get("incarnation") or 1), 1)
    except (TypeError, ValueError):
        return False
    return marker is not None and marker.strip() == str(incarnation)


def suspend_deferred(run: Mapping[str, Any]) -> bool:
    """Whether the Run's current suspend request is deferred (the store is retrying, or there
    is none): the session goes on serving meanwhile."""
    generation = _generation(run)
    return any(
        c.get("type") == "Suspended"
        and c.get("status") == "False"
        and c.get("reason") in ("SnapshotRetrying", "NoSnapshotStore")
        and c.get("observedGeneration") == generation
        for c in (run.get("status") or {}).get("conditions") or []
    )


#: The longest operation timeout a session allows, in seconds.
MAX_OPERATION_SECONDS = 300.0
#: The largest ``operations:execute`` answer taken: two 1 MiB streams in base64 and the rest.
MAX_EXECUTE_BYTES = 3 * 1024 * 1024


def executed(answer: Mapping[str, Any]) -> ExecResult:
    """The :class:`~kruntimes.ExecResult` of an ``operations:execute`` answer."""
    try:
        exit_code = answer.get("exitCode")
        return ExecResult(
            operation_id=str(answer["operationId"]),
            exit_code=int(exit_code) if exit_code is not None else None,
            stdout=base64.b64decode(str(answer.get("stdout") or ""), validate=True),
            stderr=base64.b64decode(str(answer.get("stderr") or ""), validate=True),
            state=str(answer["state"]),
            reason=str(answer.get("reason") or ""),
            message=str(answer.get("message") or ""),
            timed_out=bool(answer.get("timedOut")),
            duration_ms=float(answer.get("durationMs") or 0.0),
            stdout_truncated=bool(answer.get("stdoutTruncated")),
            stderr_truncated=bool(answer.get("stderrTruncated")),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise KruntimesError(f"the gateway's operation result is malformed: {e}") from None


def _json_object(body: bytes) -> dict[str, Any]:
    try:
        value = json.loads(body)
    except ValueError as e:
        raise KruntimesError(f"the gateway's answer is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise KruntimesError("the gateway's answer is not a JSON object")
    return value


def _state_error(run: Mapping[str, Any], text: str) -> SandboxStateError:
    name = meta(run, "name")
    phase = phase_of(run)
    reason = status_field(run, "reason")
    message = status_field(run, "message")
    detail = "".join(f": {p}" for p in (reason, message) if p)
    return SandboxStateError(
        f"sandbox {name} {text} (phase {phase}{detail})",
        name=name,
        phase=phase,
        run_reason=reason,
        run_message=message,
    )


class AsyncSandbox:
    """A session Run: see the module documentation. Made by
    :meth:`AsyncRuntime.acquire_sandbox` or :meth:`AsyncClient.open`."""

    def __init__(self, connection: AsyncConnection, run: Mapping[str, Any]) -> None:
        session = ((run.get("spec") or {}).get("mode") or {}).get("session")
        self._connection = connection
        self.name = meta(run, "name")
        self.namespace = meta(run, "namespace") or connection.namespace
        self.uid = meta(run, "uid")
        if session is None:
            raise _state_error(run, "is not a sandbox (not a session Run)")
        lease = session.get("leaseTimeoutSeconds")
        #: The lease in seconds, when the Run has one.
        self.lease_timeout_seconds: int | None = int(lease) if lease else None
        #: The creation request ID the sandbox was made with, if any: :meth:`release` keeps
        #: the ended Run as its tombstone.
        self.request_id: str | None = _annotation(run, REQUEST_ID_ANNOTATION)
        self._helper: AsyncSession | None = None
        self._helper_lock = asyncio.Lock()

    def __repr__(self) -> str:
        return f"AsyncSandbox(namespace={self.namespace!r}, name={self.name!r}, uid={self.uid!r})"

    async def run(self) -> dict[str, Any]:
        """The Run as it is now."""
        return await self._connection.get_run(self.namespace, self.name)

    def _gone(self) -> SandboxStateError:
        return SandboxStateError(
            f"sandbox {self.name} is gone (no Run of that name in namespace {self.namespace})",
            name=self.name,
            phase="Deleted",
            status=404,
            reason="NotFound",
        )

    def _check_same(self, run: Mapping[str, Any]) -> None:
        """Refuses a Run of this name that is not the one this sandbox was made from."""
        if meta(run, "uid") != self.uid:
            raise SandboxStateError(
                f"sandbox {self.name} was replaced: its Run now has UID {meta(run, 'uid')}, not {self.uid}",
                name=self.name,
                phase=phase_of(run),
                reason="Replaced",
            )

    async def _current(self) -> dict[str, Any]:
        """The Run as it is now, refused when gone or replaced."""
        try:
            run = await self.run()
        except NotFound:
            raise self._gone() from None
        self._check_same(run)
        return run

    async def _target(self, *, reads: bool, session: bool = False) -> Endpoint:
        """The endpoint of the Run as it is now, for a call that only ``reads`` or opens a
        ``session``."""
        return self._target_of(await self._current(), reads=reads, session=session)

    def _target_of(self, run: Mapping[str, Any], *, reads: bool, session: bool = False) -> Endpoint:
        """The endpoint of ``run`` for a call that only ``reads`` or opens a ``session``. A
        session suspended by its owner for idleness is called at the endpoint it kept: the
        gateway wakes it (503 ``SessionWaking``)."""
        phase = phase_of(run)
        wakeable = auto_suspended(run)
        if phase == "Suspended" and not wakeable:
            raise SessionSuspended(
                f"sandbox {self.name} is suspended; resume it first", status=409, reason="SessionSuspended"
            )
        spec_suspend = bool((run.get("spec") or {}).get("suspend"))
        if phase == "Ready" and session and not wakeable and spec_suspend and not suspend_deferred(run):
            raise SessionSuspending(
                f"sandbox {self.name} is being suspended; new operations are refused until it is resumed",
                status=409,
                reason="SessionSuspending",
            )
        if not (phase == "Ready" or (reads and phase == "Finalizing") or (phase == "Suspended" and wakeable)):
            raise _state_error(run, "is not ready")
        endpoint = Endpoint(run)
        if not endpoint.path.endswith(f"/sessions/{self.uid}"):
            raise KruntimesError(f"the endpoint {endpoint.url!r} of sandbox {self.name} does not name this Run")
        return endpoint

    async def _awake_target(self, *, reads: bool) -> Endpoint:
        """The endpoint for a call that cannot be sent twice (an upload's body is read once):
        a session suspended for idleness is woken first, by a status call tried through
        the wake. A suspend that begins after that is answered ``SessionWaking``, with
        nothing sent."""
        run = await self._current()
        if auto_suspended(run):
            await self.status()
            run = await self._current()
        return self._target_of(run, reads=reads)

    async def _call(self, method: str, suffix: str, *, mutation: bool, limit: int) -> tuple[httpx2.Headers, bytes]:
        return await through_wake(lambda: self._call_once(method, suffix, mutation=mutation, limit=limit))

    async def _call_once(self, method: str, suffix: str, *, mutation: bool, limit: int) -> tuple[httpx2.Headers, bytes]:
        endpoint = await self._target(reads=True)
        client = self._connection.http(endpoint.origin, endpoint.ca_bundle)
        url = endpoint.url + suffix
        try:
            async with client.stream(method, endpoint.path + suffix) as response:
                body = bytearray()
                async for chunk in response.aiter_bytes():
                    body.extend(chunk)
                    if len(body) > limit:
                        raise KruntimesError(f"the answer of {url} is over {limit} bytes")
        except httpx2.TransportError as e:
            raise transport_error(e, url, mutation=mutation) from None
        if response.status_code != 200:
            raise error_answer(response.status_code, bytes(body), response.headers)
        return response.headers, bytes(body)

    async def status(self) -> SandboxStatus:
        """The session's status (phase, queue, lease). Does not renew the lease."""
        _, body = await self._call("GET", "", mutation=False, limit=MAX_STATUS_BYTES)
        return SandboxStatus.from_wire(_json_object(body))

    async def renew(self) -> SandboxStatus:
        """A heartbeat: renews the lease; returns the status."""
        _, body = await self._call("POST", ":renew", mutation=True, limit=MAX_STATUS_BYTES)
        return SandboxStatus.from_wire(_json_object(body))

    async def list_files(self, options: ListFilesOptions | None = None) -> FilePage:
        """One page of a workspace directory: pass its ``next_page_token`` for the next.
        A listing is not a snapshot: entries changed between pages may be missed or
        repeated."""
        options = options or ListFilesOptions()
        if not 0 <= options.limit <= MAX_LIST_LIMIT:
            raise InvalidRequest(f"a listing page is 1 to {MAX_LIST_LIMIT} entries (0: the server's default)")
        query = f"path={quote(options.directory, safe='')}&directory=true"
        if options.limit:
            query += f"&limit={options.limit}"
        if options.page_token:
            query += f"&pageToken={quote(options.page_token, safe='')}"
        _, raw = await self._call("GET", f"/files?{query}", mutation=False, limit=MAX_LISTING_BYTES)
        body = _json_object(raw)
        entries = [
            FileEntry(
                path=str(e.get("path", "")),
                directory=bool(e.get("directory")),
                size_bytes=int(e.get("sizeBytes") or 0),
                symlink=bool(e.get("symlink")),
            )
            for e in body.get("entries") or []
        ]
        return FilePage(entries=entries, next_page_token=str(body.get("nextPageToken") or ""))

    async def iter_file_pages(self, directory: str = "", limit: int = MAX_LIST_LIMIT) -> AsyncIterator[FilePage]:
        """Every page of a directory, one request at a time."""
        token = ""
        while True:
            page = await self.list_files(ListFilesOptions(directory=directory, limit=limit, page_token=token))
            yield page
            if not page.next_page_token:
                return
            token = page.next_page_token

    async def iter_files(self, directory: str = "", limit: int = MAX_LIST_LIMIT) -> AsyncIterator[FileEntry]:
        """Every entry of a directory, page after page."""
        async for page in self.iter_file_pages(directory, limit):
            for entry in page.entries:
                yield entry

    async def read_file(self, path: str) -> bytes:
        """A workspace file's bytes (at most 1 MiB: 413 beyond). 404 for no such file,
        400 for a path that leaves the workspace; a directory is refused (list it)."""
        if not path:
            raise InvalidRequest("the workspace is a directory: list it")
        headers, body = await self._call(
            "GET", f"/files?path={quote(path, safe='')}", mutation=False, limit=MAX_FILE_BYTES + 1
        )
        if headers.get("content-type", "").startswith("application/json"):
            raise InvalidRequest(f"{path} is a directory: list it", reason="IsADirectory")
        return body

    async def upload(
        self,
        path: str,
        reader: Readable | AsyncIterable[bytes],
        *,
        size: int | None = None,
        executable: bool = False,
    ) -> Uploaded:
        """Streams ``reader`` (a binary file, or an async iterable of bytes) into the
        workspace file ``path``, created or replaced atomically (the old file stays until
        every byte arrived); ``size``, when known, is announced, so that a file over the
        server's cap is refused before its bytes are sent. The parent directory must exist.

        Errors: :class:`~kruntimes.InvalidRequest` 413 ``FileTooLarge`` over the cap, 400
        for a path that leaves the workspace (``PathEscapes`` through a symlink), a source
        that gives other than ``size`` bytes (nothing is written); :class:`~kruntimes.NotFound`
        for a missing parent; :class:`~kruntimes.Conflict` ``IsADirectory``; 507 when the
        workspace's disk is full."""
        return await _transfer.upload(self, path, reader, size=size, executable=executable)

    async def upload_file(self, local: str | os.PathLike[str], path: str) -> Uploaded:
        """Uploads the local file ``local`` to ``path``, executable when it is."""
        return await _transfer.upload_file(self, local, path)

    async def upload_tar(
        self, path: str, reader: Readable | AsyncIterable[bytes], *, size: int | None = None
    ) -> Uploaded:
        """Streams a tar stream (ustar, GNU or pax) from ``reader``, extracted into ``path``
        (a new or empty directory). One entry that would leave ``path`` (an absolute name,
        ``..``, a link out) or a device fails the whole upload, which leaves nothing."""
        return await _transfer.upload(self, path, reader, size=size, executable=False, archive=True)

    async def upload_dir(self, local: str | os.PathLike[str], path: str) -> Uploaded:
        """Uploads the local directory ``local`` as a tar stream, extracted into ``path`` (a
        new or empty directory: :class:`~kruntimes.Conflict` ``DirectoryNotEmpty``
        otherwise). Symlinks go as links; what is neither a file, a directory nor a link is
        left out."""
        return await _transfer.upload_dir(self, local, path)

    async def download(self, path: str, writer: Writable | Callable[[bytes], Any]) -> int:
        """Streams the workspace file ``path`` into ``writer`` (a binary file, or a callable
        taking each chunk; called off the event loop); returns the bytes written. A
        download that breaks off raises, with what was written left to the caller.
        :class:`~kruntimes.InvalidRequest` ``IsADirectory`` for a directory,
        :class:`~kruntimes.NotFound` for no such file."""
        return await _transfer.download(self, path, writer)

    async def download_file(self, path: str, local: str | os.PathLike[str]) -> int:
        """Downloads ``path`` to the local file ``local``, atomically (a temporary beside it,
        renamed into place once complete), executable when it is in the sandbox."""
        return await _transfer.download_file(self, path, local)

    async def download_dir(self, path: str, local: str | os.PathLike[str]) -> int:
        """Downloads the directory ``path`` (``""``: the workspace) as a tar stream and
        unpacks it into the local directory ``local`` (created; it must not exist or be
        empty); returns the bytes of the stream. Entries that would leave ``local`` (an
        absolute name, ``..``, a path through a symlink, a link pointing out) and devices
        are refused (:class:`~kruntimes.InvalidRequest` ``InvalidArchive``); what was
        unpacked before stays."""
        return await _transfer.download_dir(self, path, local)

    async def open_session(self) -> AsyncSession:
        """Opens a session: a connection over which operations are sent and their events
        received. Opening renews the lease; while it is open, it sends heartbeats. A
        session suspended for idleness is woken, and the opening waits until it is Ready."""
        return await through_wake(self._open_session_once)

    async def _open_session_once(self) -> AsyncSession:
        endpoint = await self._target(reads=False, session=True)
        ws_url = "wss://" + endpoint.origin[len("https://") :] + endpoint.path + "/operations:ws"
        ssl_context = self._connection.ssl_context(endpoint.ca_bundle)
        authorization = await self._connection.authorization()
        while True:
            headers = {"Authorization": authorization} if authorization else {}
            try:
                ws = await connect(
                    ws_url,
                    additional_headers=headers,
                    ssl=ssl_context,
                    max_size=MAX_FRAME_BYTES,
                    compression=None,
                    open_timeout=CALL_TIMEOUT,
                    ping_interval=None,
                    proxy=None,
                )
                break
            except InvalidStatus as e:
                response = e.response
                if response.status_code == 401 and authorization is not None:
                    # Credentials that rotated (a token file, an exec plugin): ask the
                    # kubeconfig's flow once for fresh ones, as the invoke path does.
                    fresh = await self._connection.authorization(rejected=authorization)
                    if fresh is not None and fresh != authorization:
                        authorization = fresh
                        continue
                raise error_answer(response.status_code, bytes(response.body or b""), dict(response.headers)) from None
            except (OSError, InvalidHandshake, asyncio.TimeoutError) as e:
                raise transport_error(e, ws_url, mutation=False) from None
        interval = self.lease_timeout_seconds / 3.0 if self.lease_timeout_seconds else None
        return AsyncSession(ws, interval)

    async def _helper_session(self) -> AsyncSession:
        async with self._helper_lock:
            if self._helper is None or self._helper.closed:
                self._helper = await self.open_session()
            return self._helper

    async def run_operation(self, operation: Operation) -> ExecResult:
        """Sends one operation on the sandbox's own session (opened on first use, kept
        until :meth:`close`) and follows it to its end."""
        session = await self._helper_session()
        return await session.run(operation)

    async def exec(
        self,
        argv: list[str] | None = None,
        *,
        shell: str | None = None,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        stdin: bytes | str | None = None,
        timeout: float | None = None,
    ) -> ExecResult:
        """Runs ``argv`` (or a ``shell`` line) and returns its exit code, stdout, stderr and
        whether it timed out. A non-zero exit code is a result, not an exception."""
        session = await self._helper_session()
        return await session.exec(argv, shell=shell, cwd=cwd, env=env, stdin=stdin, timeout=timeout)

    async def execute(self, operation: Operation) -> ExecResult:
        """Runs one operation to its end with one HTTP call (``POST …/operations:execute``:
        the same queue and order as a session's operations, no WebSocket). A command's
        ``exit_code`` follows the shell's rules: its own code, 128 + a killing signal, 124
        when its timeout ran out (``timed_out``), 127 when the program does not exist (126:
        not executable; the reason on stderr). A non-zero exit is a result. What did not run
        to an end raises: :class:`~kruntimes.Conflict` (409 ``SessionClosed``,
        ``OperationCancelled``), :class:`~kruntimes.NotFound` or
        :class:`~kruntimes.InvalidRequest` (a wrong working directory),
        :class:`~kruntimes.Unavailable` (503 ``SandboxLost``),
        :class:`~kruntimes.OutcomeUnknown` (502: the events were cut off, or the machine
        could not start it; a lost connection after sending). An auto-suspended sandbox is
        woken first."""
        body = json.dumps(operation.to_wire()).encode()
        timeout = (operation.timeout or MAX_OPERATION_SECONDS) + MAX_OPERATION_SECONDS + CALL_TIMEOUT
        return await through_wake(lambda: self._execute_once(body, timeout))

    async def _execute_once(self, body: bytes, timeout: float) -> ExecResult:
        endpoint = await self._target(reads=False, session=True)
        client = self._connection.http(endpoint.origin, endpoint.ca_bundle)
        url = endpoint.url + "/operations:execute"
        try:
            async with client.stream(
                "POST",
                endpoint.path + "/operations:execute",
                content=body,
                headers={"content-type": "application/json"},
                timeout=timeout,
            ) as response:
                answer = bytearray()
                async for chunk in response.aiter_bytes():
                    answer.extend(chunk)
                    if len(answer) > MAX_EXECUTE_BYTES:
                        raise OutcomeUnknown(
                            f"the answer of {url} is over {MAX_EXECUTE_BYTES} bytes; the operation was sent",
                            status=502,
                            reason="OutcomeUnknown",
                        )
        except httpx2.TransportError as e:
            raise transport_error(e, url, mutation=True) from None
        if response.status_code != 200:
            raise error_answer(response.status_code, bytes(answer), response.headers)
        return executed(_json_object(bytes(answer)))

    async def _mutate(self, operation: Operation) -> ExecResult:
        result = await self.run_operation(operation)
        if result.state != "Succeeded":
            status = {"NotFound": 404, "AlreadyExists": 409, "InvalidPath": 400}.get(result.reason)
            raise from_status(status or 400, result.reason or result.state, result.message or result.state)
        return result

    async def write_file(
        self, path: str, data: bytes | str, *, executable: bool = False, make_parents: bool = True
    ) -> None:
        """Writes a workspace file (at most 1 MiB), creating its parent directories first
        unless ``make_parents`` is false."""
        content = data.encode() if isinstance(data, str) else bytes(data)
        parent = posixpath.dirname(path)
        if make_parents and parent:
            await self._mutate(Operation(make_directory=(parent, True)))
        await self._mutate(Operation(write_file=(path, content, executable)))

    async def make_directory(self, path: str, *, parents: bool = True) -> None:
        """Creates a workspace directory."""
        await self._mutate(Operation(make_directory=(path, parents)))

    async def delete(self, path: str, *, recursive: bool = False) -> None:
        """Deletes a workspace file (or directory, ``recursive``)."""
        await self._mutate(Operation(delete=(path, recursive)))

    async def rename(self, source: str, target: str) -> None:
        """Renames a workspace path."""
        await self._mutate(Operation(rename=(source, target)))

    async def wait_ended(self, timeout: float = 300.0) -> str | None:
        """Waits until the sandbox's Run has ended (a lease that expired, a release from
        elsewhere, ``spec.timeout``) and returns its phase; ``None`` when it was deleted.
        Raises :class:`~kruntimes.OperationTimeout` after ``timeout`` seconds."""
        run = await self._connection.wait_run(
            self.namespace, self.name, self.uid, lambda r: phase_of(r) in TERMINAL_PHASES, timeout, "ended"
        )
        return None if run is None else phase_of(run)

    # -- Suspend and resume ---------------------------------------------------------------

    async def suspend(self, *, wait: float | None = 300.0) -> int:
        """Suspends the sandbox: sets ``spec.suspend: true``; its worker lets the accepted
        operations finish, captures the workspace's files into a Snapshot and releases its
        slot (Ready → ``Suspended``). Meanwhile new operations get
        :class:`~kruntimes.SessionSuspending`. Waits up to ``wait`` seconds until it is
        Suspended (``None``: does not wait) and returns the Run's ``metadata.generation``
        that the request produced. An already suspended sandbox is a success at once.

        Raises :class:`~kruntimes.Superseded` when a newer resume overtook this request
        before it took effect, :class:`~kruntimes.SandboxStateError` when the sandbox ended
        (or is gone, or cannot be suspended, e.g. no snapshot store), and
        :class:`~kruntimes.OperationTimeout` after ``wait`` seconds (it goes on)."""
        # The sandbox's own WebSocket session ends with the worker's: close it first.
        await self.close()
        return await self._set_suspend(True, wait)

    async def resume(self, *, wait: float | None = 300.0) -> int:
        """Resumes a suspended sandbox: sets ``spec.suspend: false``; it is placed again
        (preferring the worker that still holds its files), restored from its Snapshot and
        Ready at the same endpoint, with operation sequence numbers continuing. Waits up to
        ``wait`` seconds until it is Ready (``None``: does not wait) and returns the
        generation the request produced. A sandbox that is Ready and not being suspended
        is a success at once; one being suspended is told to stay.

        Raises as :meth:`suspend` (:class:`~kruntimes.Superseded` when a newer suspend
        overtook this request)."""
        return await self._set_suspend(False, wait)

    async def _set_suspend(self, suspend: bool, wait: float | None) -> int:
        conn = self._connection
        try:
            run = await conn.patch_run(self.namespace, self.name, {"spec": {"suspend": suspend}})
        except NotFound:
            raise self._gone() from None
        self._check_same(run)
        generation = _generation(run)
        if wait is None:
            return generation
        what = "suspended" if suspend else "resumed"
        settled = await conn.wait_run(
            self.namespace,
            self.name,
            self.uid,
            lambda r: suspend_settled(r, suspend, generation) is not None,
            wait,
            what,
            first=run,
        )
        if settled is None:
            raise SandboxStateError(
                f"sandbox {self.name} was deleted before it was {what}",
                name=self.name,
                phase="Deleted",
                status=404,
                reason="NotFound",
            )
        error = suspend_settled(settled, suspend, generation)
        if error is not None and error is not _AT_TARGET:
            raise error
        return generation

    # -- Checkpoints ----------------------------------------------------------------------

    async def checkpoint(self, name: str, *, timeout: float = 300.0) -> Checkpoint:
        """Checkpoints the sandbox while it goes on: creates the Snapshot ``name`` of its
        Run (pinned to its UID), which its worker takes as a barrier in the session's queue:
        every operation accepted before the call is in it, none after. Waits on a watch up
        to ``timeout`` seconds until it is Ready and returns it. The checkpoint is not owned
        by the sandbox and outlives it; :meth:`AsyncClient.fork` starts sandboxes from it,
        and :meth:`AsyncClient.delete_checkpoint` deletes it.

        Raises :class:`~kruntimes.InvalidRequest` for a name that is not an object name,
        :class:`~kruntimes.Conflict` (reason ``AlreadyExists``) when a Snapshot of that name
        exists, :class:`~kruntimes.SnapshotStateError` when the capture fails (with the
        Snapshot's reason and message) or the Snapshot is deleted meanwhile,
        :class:`~kruntimes.SandboxStateError` when the sandbox is gone or ended, and
        :class:`~kruntimes.OperationTimeout` after ``timeout`` seconds (it goes on)."""
        check_object_name(name, "a checkpoint's name")
        run = await self._current()
        if phase_of(run) in TERMINAL_PHASES:
            raise _state_error(run, "has ended: there is nothing to checkpoint")
        return await _checkpoints.take(self._connection, self.namespace, run, name, timeout)

    async def close(self) -> None:
        """Closes the sandbox's own session (the one :meth:`exec` uses); the sandbox goes on."""
        helper, self._helper = self._helper, None
        if helper is not None:
            await helper.close()

    async def end_and_delete(self) -> None:
        """Asks the sandbox to end at once (termination ``Immediate``: running and queued
        work is cancelled) and deletes its Run (UID precondition), without waiting for
        either: its worker closes the session and frees the slot, and the Run goes once
        that cleanup is done. What the machines view's ``release`` does. A Run already gone
        is fine."""
        await self.close()
        # A termination is refused (422) on a Run that ended already, and a Conflict on the
        # delete means another Run of the name now: this one is gone.
        await _give_back(self._connection, self.namespace, self.name, self.uid)

    async def release(self, mode: ReleaseMode = "drain", *, wait: float = 300.0) -> str | None:
        """Ends the sandbox and deletes its Run: ``drain`` finishes accepted work, exports
        artifacts and ends ``Succeeded``; ``immediate`` cancels everything and ends
        ``Cancelled``. Waits for the end, deletes the Run (UID precondition) and waits
        until it is gone. Returns the phase it ended in (``None`` when it was gone already).
        An ``immediate`` request is never downgraded by a later ``drain``.

        A sandbox made with a creation request ID (:attr:`request_id`) is not deleted: its
        ended Run is kept as the ID's tombstone, so that a retry of the creation gets
        :class:`~kruntimes.RequestIdReserved` instead of a second sandbox. Deleting the Run
        (``kubectl delete run NAME``) purges it."""
        if mode not in ("drain", "immediate"):
            raise InvalidRequest(f"the release mode is 'drain' or 'immediate', not {mode!r}")
        await self.close()
        conn = self._connection
        try:
            run = await self.run()
        except NotFound:
            return None
        if meta(run, "uid") != self.uid:
            return None
        asked = ((run.get("spec") or {}).get("termination") or {}).get("mode")
        want = "Immediate" if mode == "immediate" else "Drain"
        if phase_of(run) not in TERMINAL_PHASES and (asked is None or (asked == "Drain" and want == "Immediate")):
            try:
                run = await conn.patch_run(self.namespace, self.name, {"spec": {"termination": {"mode": want}}})
            except NotFound:
                return None
        ended = await conn.wait_run(
            self.namespace, self.name, self.uid, lambda r: phase_of(r) in TERMINAL_PHASES, wait, "ended", first=run
        )
        if ended is None:
            return None
        phase = phase_of(ended)
        if self.request_id is not None:
            # The ended Run is the request ID's tombstone: kept, as the Rust SDK keeps it.
            return phase
        if await conn.delete_run(self.namespace, self.name, self.uid):
            await conn.wait_run(self.namespace, self.name, self.uid, lambda r: False, wait, "gone")
        return phase

    async def __aenter__(self) -> AsyncSandbox:
        return self

    async def __aexit__(self, exc_type: object, exc: object, tb: object) -> None:
        # A clean exit drains (accepted work finishes); an exception cancels at once.
        await self.release("immediate" if exc_type is not None else "drain")


def _generation(run: Mapping[str, Any]) -> int:
    value = (run.get("metadata") or {}).get("generation")
    return int(value) if isinstance(value, int) else 1


#: What :func:`suspend_settled` returns when the Run reached the request's target.
_AT_TARGET = KruntimesError("at target")

#: ``Suspended=False`` reasons of a suspend that cannot succeed until something changes.
SUSPEND_REFUSED_REASONS = frozenset({"NoSnapshotStore"})


def suspend_settled(run: Mapping[str, Any], suspend: bool, generation: int) -> KruntimesError | None:
    """Whether a suspend (``suspend``) or resume request that produced ``generation`` has
    settled in ``run``: ``None`` while it goes on; ``_AT_TARGET`` when the Run is where the
    request wanted it (Suspended; or Ready and not asked to suspend); else the error the
    caller gets: :class:`Superseded` when a newer opposite request overtook it, a
    :class:`SandboxStateError` when the Run ended or the suspend was refused."""
    phase = phase_of(run)
    spec_suspend = bool((run.get("spec") or {}).get("suspend"))
    current = _generation(run)
    if phase in TERMINAL_PHASES:
        return _state_error(run, "ended")
    if spec_suspend != suspend and current > generation:
        other = "resume" if suspend else "suspend"
        return Superseded(
            f"the {'suspend' if suspend else 'resume'} of sandbox {meta(run, 'name')} (generation {generation}) "
            f"was overtaken by a {other} (generation {current})",
            generation=generation,
            current_generation=current,
        )
    if suspend and phase == "Suspended":
        return _AT_TARGET
    if not suspend and phase == "Ready" and not spec_suspend:
        return _AT_TARGET
    if suspend:
        for condition in (run.get("status") or {}).get("conditions") or []:
            if (
                condition.get("type") == "Suspended"
                and condition.get("status") == "False"
                and condition.get("reason") in SUSPEND_REFUSED_REASONS
                and int(condition.get("observedGeneration") or 0) >= generation
            ):
                name = meta(run, "name")
                message = condition.get("message") or condition["reason"]
                return SandboxStateError(
                    f"sandbox {name} cannot be suspended: {condition['reason']}: {message}",
                    name=name,
                    phase=phase,
                    run_reason=str(condition["reason"]),
                    run_message=str(message),
                )
    return None


def _annotation(run: Mapping[str, Any], key: str) -> str | None:
    value = ((run.get("metadata") or {}).get("annotations") or {}).get(key)
    return None if value is None else str(value)


#: How many times a create of a request ID is tried when its Run vanishes between the
#: create's ``AlreadyExists`` and the read (the tombstone was purged meanwhile).
REQUEST_CREATE_TRIES = 3


async def _resolve_request(
    connection: AsyncConnection, namespace: str, wanted: Mapping[str, Any]
) -> dict[str, Any] | None:
    """The Run a request ID already created, when it was created with the same spec and
    labels and has not ended; ``None`` when it is gone (create again); otherwise why the
    request cannot be served."""
    name = meta(wanted, "name")
    request_id = _annotation(wanted, REQUEST_ID_ANNOTATION) or ""
    try:
        existing = await connection.get_run(namespace, name)
    except NotFound:
        return None
    same_request = _annotation(existing, REQUEST_ID_ANNOTATION) == request_id
    same_spec = _annotation(existing, REQUEST_DIGEST_ANNOTATION) == _annotation(wanted, REQUEST_DIGEST_ANNOTATION)
    if not same_request or not same_spec:
        raise RequestConflict(
            f"request ID {request_id!r} already created sandbox {name} with another spec",
            request_id=request_id,
            name=name,
        )
    phase = phase_of(existing)
    if phase in TERMINAL_PHASES or meta(existing, "deletionTimestamp"):
        raise RequestIdReserved(
            f"request ID {request_id!r} already created sandbox {name}, which ended {phase}",
            request_id=request_id,
            name=name,
            phase=phase,
        )
    return existing


async def acquire(
    connection: AsyncConnection,
    namespace: str,
    runtime: str,
    options: AcquireOptions,
    *,
    give_back_on_failure: bool = False,
) -> AsyncSandbox:
    """Creates one session Run and waits until it is Ready (a fork created ``suspended``:
    Suspended). With a request ID, a Run that ID created already (an earlier try, or a
    racing one) is the sandbox, when its spec and labels are the same and it has not
    ended. With ``give_back_on_failure`` (the machines view's claim), a Run that was
    created but did not become Ready (it ended, the wait ran out, the call was cancelled)
    is asked to end at once and deleted, best effort. A fork's checkpoint is read first:
    it must be Ready, and the fork pins its UID."""
    options.to_run(runtime)  # checked before anything is sent
    if options.from_snapshot is not None:
        source = await _checkpoints.resolve(connection, namespace, runtime, options.from_snapshot)
        options = replace(options, from_snapshot=source)
    return await _create(connection, namespace, runtime, options, give_back_on_failure=give_back_on_failure)


async def fork(
    connection: AsyncConnection,
    namespace: str,
    snapshot: Checkpoint | str,
    options: AcquireOptions,
    *,
    count: int = 1,
    suspended: bool = False,
    runtime: str | None = None,
) -> list[AsyncSandbox]:
    """``count`` sandboxes started from the checkpoint ``snapshot`` (see
    :meth:`AsyncClient.fork`): the checkpoint is read once, and every fork pins its UID."""
    check_fork_count(count)
    if count > 1 and (options.name is not None or options.request_id is not None):
        raise InvalidRequest("a name or a request ID names one sandbox: fork more than one with generate_name")
    checked = replace(options, from_snapshot=snapshot, suspended=suspended)
    # Checked before anything is sent (the Runtime may not be known yet: nothing checked
    # depends on it).
    checked.to_run(runtime or "")
    source = await _checkpoints.resolve(connection, namespace, runtime, snapshot)
    runtime = runtime or await _checkpoints.runtime_of(connection, namespace, source)
    if options.name is None and options.request_id is None and options.generate_name is None:
        checked = replace(checked, generate_name=f"{runtime}-fork-")
    checked = replace(checked, from_snapshot=source)
    return await _all_or_none(
        connection,
        [_create(connection, namespace, runtime, checked, give_back_on_failure=count > 1) for _ in range(count)],
    )


async def _all_or_none(connection: AsyncConnection, creates: list[Awaitable[AsyncSandbox]]) -> list[AsyncSandbox]:
    """Runs ``creates`` at once; when one fails (or the call is cancelled), the others are
    stopped, the sandboxes made already are ended and deleted (best effort, not waited
    for), and the first error is raised."""
    tasks = [asyncio.ensure_future(create) for create in creates]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        for made in outcomes:
            if isinstance(made, AsyncSandbox):
                with contextlib.suppress(Exception):
                    await asyncio.shield(_give_back(connection, made.namespace, made.name, made.uid))
        raise


async def _create(
    connection: AsyncConnection,
    namespace: str,
    runtime: str,
    options: AcquireOptions,
    *,
    give_back_on_failure: bool,
) -> AsyncSandbox:
    """:func:`acquire` once the options are final (a fork's checkpoint resolved)."""
    body = options.to_run(runtime)
    body["metadata"]["namespace"] = namespace
    what = f"a sandbox on Runtime {runtime}"
    created: dict[str, Any] | None = None
    for _ in range(REQUEST_CREATE_TRIES):
        try:
            created = await connection.create_run(body, namespace, what)
        except Conflict as e:
            # A request ID's Run exists: the API server let exactly one create through.
            if options.request_id is None or e.reason != "AlreadyExists":
                raise
            created = await _resolve_request(connection, namespace, body)
        if created is not None:
            break
    if created is None:
        raise KruntimesError(f"cannot create {what}: its request ID's Run kept being deleted")
    name, uid = meta(created, "name"), meta(created, "uid")
    # A fork created suspended is done once Suspended to its checkpoint; any other, Ready.
    target = "Suspended" if options.suspended else "Ready"
    try:
        run = await connection.wait_run(
            namespace,
            name,
            uid,
            lambda r: phase_of(r) == target or phase_of(r) in TERMINAL_PHASES,
            options.wait,
            target.lower(),
            first=created,
        )
        if run is None:
            raise SandboxStateError(f"sandbox {name} was deleted while waiting for it", name=name, phase="Deleted")
        if phase_of(run) != target:
            raise _state_error(run, f"ended before it was {target.lower()}")
        sandbox = AsyncSandbox(connection, run)
        if target == "Ready":
            Endpoint(run)  # a Ready sandbox must be callable
        return sandbox
    except BaseException:
        if give_back_on_failure:
            # Shielded: a cancelled claim still gives its Run back; the claim's own
            # error is what the caller hears.
            with contextlib.suppress(Exception):
                await asyncio.shield(_give_back(connection, namespace, name, uid))
        raise


async def _give_back(connection: AsyncConnection, namespace: str, name: str, uid: str) -> None:
    """Termination ``Immediate`` and a UID-checked delete of Run ``name``, not waited for."""
    with contextlib.suppress(NotFound, InvalidRequest):
        await connection.patch_run(namespace, name, {"spec": {"termination": {"mode": "Immediate"}}})
    with contextlib.suppress(NotFound, Conflict):
        await connection.delete_run(namespace, name, uid)


async def open_existing(connection: AsyncConnection, namespace: str, name: str) -> AsyncSandbox:
    """The existing sandbox ``name`` (a session Run, in any phase)."""
    return AsyncSandbox(connection, await connection.get_run(namespace, name))


__all__ = ["AsyncSandbox", "acquire", "fork", "open_existing"]
