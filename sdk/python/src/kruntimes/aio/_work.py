"""Tasks (task Runs, their logs through the gateway) and functions (function Runs invoked
over HTTPS at their published endpoint)."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Mapping
from typing import Any
from urllib.parse import quote

import httpx2

from ..errors import (
    Conflict,
    InvalidRequest,
    InvocationError,
    KruntimesError,
    NotFound,
    OperationTimeout,
    OutcomeUnknown,
    RunStateError,
    Unavailable,
)
from ..models import Invocation, TaskResult, check_env, duration_text
from ._client import (
    TERMINAL_PHASES,
    AsyncConnection,
    Endpoint,
    error_answer,
    meta,
    phase_of,
    status_field,
    transport_error,
)
from ._http1 import AnswerTimeout, AnswerTooLarge, Broken, NotSent

#: The most task log bytes :meth:`AsyncTask.wait` keeps per stream by default.
DEFAULT_MAX_LOG_BYTES = 16 * 1024 * 1024
#: The largest invocation payload (1 MiB).
MAX_PAYLOAD_BYTES = 1024 * 1024
#: The largest invocation answer read.
MAX_ANSWER_BYTES = 4 * 1024 * 1024
#: How long an invocation waits for its answer by default, in seconds.
DEFAULT_INVOKE_TIMEOUT = 300.0
_INVOCATION_ID = re.compile(r"^[\x21-\x7e]{1,128}$")


def _run_state_error(run: Mapping[str, Any], text: str) -> RunStateError:
    name = meta(run, "name")
    reason = status_field(run, "reason")
    message = status_field(run, "message")
    detail = "".join(f": {p}" for p in (reason, message) if p)
    return RunStateError(
        f"run {name} {text} (phase {phase_of(run)}{detail})",
        name=name,
        phase=phase_of(run),
        run_reason=reason,
        run_message=message,
    )


# ---------------------------------------------------------------------------------------
# Tasks
# ---------------------------------------------------------------------------------------


def task_run(
    runtime: str,
    *,
    argv: list[str] | None,
    source: str | None,
    entrypoint: str | None,
    env: Mapping[str, str] | None,
    timeout: float | None,
    name: str | None,
) -> dict[str, Any]:
    """The task Run of :meth:`AsyncRuntime.run` (checked)."""
    if (argv is None) == (source is None):
        raise InvalidRequest("a task is exactly one of argv=[...] or source=...")
    task: dict[str, Any] = {}
    spec: dict[str, Any] = {"runtime": runtime, "mode": {"task": task}}
    if argv is not None:
        if not argv or not all(isinstance(a, str) for a in argv) or not argv[0]:
            raise InvalidRequest("argv must be a non-empty list of strings")
        if "/" in argv[0]:
            raise InvalidRequest(f"the program {argv[0]!r} must be a name without '/' (it runs on the worker)")
        task["entrypoint"] = argv[0]
        if len(argv) > 1:
            task["args"] = list(argv[1:])
    else:
        spec["source"] = {"inline": source}
        if entrypoint:
            task["entrypoint"] = entrypoint
    env_list = check_env(env)
    if env_list:
        spec["env"] = env_list
    if timeout is not None:
        spec["timeout"] = duration_text(timeout)
    metadata: dict[str, Any] = {"name": name} if name else {"generateName": f"{runtime}-"}
    return {"apiVersion": "kruntimes.io/v1alpha1", "kind": "Run", "metadata": metadata, "spec": spec}


class AsyncTask:
    """A task Run: a program run to completion on a worker."""

    def __init__(self, connection: AsyncConnection, run: Mapping[str, Any]) -> None:
        self._connection = connection
        self.name = meta(run, "name")
        self.namespace = meta(run, "namespace") or connection.namespace
        self.uid = meta(run, "uid")

    def __repr__(self) -> str:
        return f"AsyncTask(namespace={self.namespace!r}, name={self.name!r})"

    async def run(self) -> dict[str, Any]:
        """The Run as it is now."""
        return await self._connection.get_run(self.namespace, self.name)

    async def phase(self) -> str:
        """The Run's phase now."""
        return phase_of(await self.run())

    async def wait(self, timeout: float | None = None, *, max_log_bytes: int = DEFAULT_MAX_LOG_BYTES) -> TaskResult:
        """Waits until the task ends and returns its phase, exit code, outputs, stdout and
        stderr. A failed program is a result (``phase == "Failed"``), not an exception.
        Raises :class:`~kruntimes.OperationTimeout` after ``timeout`` seconds (the task
        goes on)."""
        run = await self._connection.wait_run(
            self.namespace,
            self.name,
            self.uid,
            lambda r: phase_of(r) in TERMINAL_PHASES,
            timeout if timeout is not None else 365 * 86400.0,
            "finished",
        )
        if run is None:
            raise NotFound(f"task {self.name} was deleted while waiting for it")
        status = run.get("status") or {}
        started = bool(status.get("startTime"))
        stdout = await self._read_log("stdout", max_log_bytes) if started else b""
        stderr = await self._read_log("stderr", max_log_bytes) if started else b""
        exit_code = status.get("exitCode")
        return TaskResult(
            name=self.name,
            phase=phase_of(run),
            exit_code=int(exit_code) if exit_code is not None else None,
            outputs={str(k): str(v) for k, v in (status.get("outputs") or {}).items()},
            stdout=stdout,
            stderr=stderr,
            reason=status_field(run, "reason"),
            message=status_field(run, "message"),
        )

    async def _read_log(self, stream: str, limit: int) -> bytes:
        out = bytearray()
        try:
            async for chunk in self.logs(stream, follow=False):
                out.extend(chunk)
                if len(out) >= limit:
                    return bytes(out[:limit])
        except Conflict as e:
            if e.reason == "NotStarted":
                return b""
            raise
        return bytes(out)

    async def logs(self, stream: str = "stdout", *, follow: bool = False) -> AsyncIterator[bytes]:
        """The task's ``stdout`` or ``stderr`` as it arrives, through the gateway; with
        ``follow`` until the task ends (the gateway first waits up to 60 s for it to
        start)."""
        if stream not in ("stdout", "stderr"):
            raise InvalidRequest(f"the stream is 'stdout' or 'stderr', not {stream!r}")
        origin, client = self._connection.gateway()
        path = (
            f"/v1/namespaces/{quote(self.namespace, safe='')}/runs/{quote(self.name, safe='')}/logs"
            f"?stream={stream}&follow={'true' if follow else 'false'}"
        )
        timeout = httpx2.Timeout(60.0, read=None if follow else 60.0)
        try:
            async with client.stream("GET", path, timeout=timeout) as response:
                if response.status_code != 200:
                    body = await response.aread()
                    raise error_answer(response.status_code, body[:65536], response.headers)
                async for chunk in response.aiter_raw():
                    if chunk:
                        yield chunk
        except httpx2.TransportError as e:
            raise transport_error(e, origin + path, mutation=False) from None

    async def cancel(self) -> None:
        """Asks the task to end now (``Cancelled``); returns without waiting."""
        run = await self.run()
        if meta(run, "uid") != self.uid or phase_of(run) in TERMINAL_PHASES:
            return
        await self._connection.patch_run(self.namespace, self.name, {"spec": {"termination": {"mode": "Immediate"}}})

    async def delete(self, *, wait: float = 120.0) -> None:
        """Deletes the Run (this UID only) and waits until it is gone."""
        if await self._connection.delete_run(self.namespace, self.name, self.uid):
            await self._connection.wait_run(self.namespace, self.name, self.uid, lambda r: False, wait, "gone")


# ---------------------------------------------------------------------------------------
# Functions
# ---------------------------------------------------------------------------------------


def function_run(
    runtime: str,
    name: str,
    *,
    source: str,
    handler: str,
    idle_timeout: float | None,
    env: Mapping[str, str] | None,
    timeout: float | None,
    max_attempts: int | None,
    concurrency: int | None = None,
) -> dict[str, Any]:
    """The function Run of :meth:`AsyncRuntime.create_function` (checked)."""
    if not handler:
        raise InvalidRequest("a function needs a handler, e.g. 'main:handle'")
    function: dict[str, Any] = {"handler": handler}
    if idle_timeout is not None:
        if idle_timeout <= 0:
            raise InvalidRequest("idle_timeout must be greater than zero")
        function["idleTimeoutSeconds"] = int(-(-idle_timeout // 1))
    if concurrency is not None:
        if isinstance(concurrency, bool) or not isinstance(concurrency, int) or not 1 <= concurrency <= 64:
            raise InvalidRequest("concurrency must be a whole number from 1 to 64")
        function["concurrency"] = concurrency
    spec: dict[str, Any] = {"runtime": runtime, "mode": {"function": function}, "source": {"inline": source}}
    env_list = check_env(env)
    if env_list:
        spec["env"] = env_list
    if timeout is not None:
        spec["timeout"] = duration_text(timeout)
    if max_attempts is not None:
        spec["retryPolicy"] = {"maxAttempts": max_attempts}
    return {"apiVersion": "kruntimes.io/v1alpha1", "kind": "Run", "metadata": {"name": name}, "spec": spec}


class AsyncFunction:
    """A Ready function Run: :meth:`invoke` it, :meth:`delete` it.

    The endpoint is the one the Run published when this object was made; :meth:`refresh`
    reads it again (after the Run recovered on another worker, say)."""

    def __init__(self, connection: AsyncConnection, run: Mapping[str, Any]) -> None:
        self._connection = connection
        self.name = meta(run, "name")
        self.namespace = meta(run, "namespace") or connection.namespace
        self.uid = meta(run, "uid")
        if ((run.get("spec") or {}).get("mode") or {}).get("function") is None:
            raise _run_state_error(run, "is not a function Run")
        if phase_of(run) != "Ready":
            raise _run_state_error(run, "is not ready")
        self._endpoint = Endpoint(run)

    def __repr__(self) -> str:
        return f"AsyncFunction(namespace={self.namespace!r}, name={self.name!r})"

    async def refresh(self) -> None:
        """Reads the Run again and takes its endpoint as it is now."""
        run = await self._connection.get_run(self.namespace, self.name)
        fresh = AsyncFunction(self._connection, run)
        self.uid, self._endpoint = fresh.uid, fresh._endpoint

    async def call(
        self, payload: Any = None, *, invocation_id: str | None = None, timeout: float = DEFAULT_INVOKE_TIMEOUT
    ) -> Invocation:
        """Invokes the handler once and returns the whole answer, whatever the handler did
        (``outcome`` ``Succeeded``, ``Failed`` or ``TimedOut``).

        Raises :class:`~kruntimes.TooManyRequests` while the function's ``concurrency``
        invocations are in flight (one by default),
        :class:`~kruntimes.NotFound` for a deleted function, :class:`~kruntimes.Unavailable`
        when it is not ready, and :class:`~kruntimes.OutcomeUnknown` when no answer says
        what happened (502, 504, a broken connection, no answer within ``timeout``).
        Never retried."""
        body = json.dumps({} if payload is None else payload, separators=(",", ":")).encode()
        if len(body) > MAX_PAYLOAD_BYTES:
            raise InvalidRequest(f"the payload of {len(body)} bytes is over the limit of {MAX_PAYLOAD_BYTES}")
        headers = [("Content-Type", "application/json"), ("Accept", "application/json")]
        if invocation_id is not None:
            if not _INVOCATION_ID.match(invocation_id):
                raise InvalidRequest("an invocation ID is 1 to 128 printable ASCII bytes")
            headers.append(("X-Kruntime-Invocation-ID", invocation_id))
        endpoint = self._endpoint
        pool = self._connection.invoker(endpoint.origin, endpoint.ca_bundle)
        authorization = await self._connection.authorization()
        while True:
            sent = headers if authorization is None else [*headers, ("Authorization", authorization)]
            try:
                response = await pool.request(
                    "POST", endpoint.path, sent, body, limit=MAX_ANSWER_BYTES, timeout=timeout, connect_timeout=30.0
                )
            except NotSent as e:
                raise Unavailable(f"cannot reach {endpoint.url}; nothing was sent: {e}") from None
            except AnswerTimeout:
                raise OutcomeUnknown(
                    f"no answer from {endpoint.url} within {timeout:g}s; the handler may or may not have run",
                    operation_id=invocation_id,
                ) from None
            except AnswerTooLarge:
                raise KruntimesError(f"the answer of {endpoint.url} is over {MAX_ANSWER_BYTES} bytes") from None
            except (Broken, OSError) as e:
                raise OutcomeUnknown(
                    f"the connection to {endpoint.url} broke after the request was sent; "
                    f"the handler may or may not have run: {e}",
                    operation_id=invocation_id,
                ) from None
            if response.status != 401 or authorization is None:
                break
            # Refused before dispatch: the credentials may have rotated (a token file, an
            # exec plugin). Ask the kubeconfig's flow once for fresh ones.
            fresh = await self._connection.authorization(rejected=authorization)
            if fresh is None or fresh == authorization:
                break
            authorization = fresh
        echoed = response.headers.get("x-kruntime-invocation-id") or invocation_id or ""
        if response.status != 200:
            error = error_answer(response.status, response.body, response.headers)
            if isinstance(error, OutcomeUnknown):
                error.operation_id = echoed or None
            raise error
        try:
            answer = json.loads(response.body)
        except ValueError:
            raise OutcomeUnknown(f"the answer of {endpoint.url} is not JSON", operation_id=echoed) from None
        if not isinstance(answer, dict):
            raise OutcomeUnknown(f"the answer of {endpoint.url} is not a JSON object", operation_id=echoed)
        return Invocation(
            invocation_id=str(answer.get("invocationId") or echoed),
            outcome=str(answer.get("outcome") or ""),
            result=answer.get("result"),
            error=answer.get("error"),
            stdout=str(answer.get("stdout") or ""),
            stderr=str(answer.get("stderr") or ""),
            duration_seconds=float(answer.get("durationSeconds") or 0.0),
            served_by=str(answer.get("servedBy") or ""),
            hops=int(answer.get("hops") or 0),
        )

    async def invoke(
        self, payload: Any = None, *, invocation_id: str | None = None, timeout: float = DEFAULT_INVOKE_TIMEOUT
    ) -> Any:
        """Invokes the handler once and returns its JSON result.

        A handler that raised is :class:`~kruntimes.InvocationError` (with its type,
        message and traceback); one that ran past its time is
        :class:`~kruntimes.OperationTimeout`; the rest as :meth:`call`."""
        answer = await self.call(payload, invocation_id=invocation_id, timeout=timeout)
        if answer.outcome == "Succeeded":
            return answer.result
        if answer.outcome == "TimedOut":
            raise OperationTimeout(f"the handler of {self.name} timed out ({answer.invocation_id})")
        error = answer.error or {}
        raise InvocationError(
            error_type=str(error.get("type") or "Error"),
            error_message=str(error.get("message") or answer.outcome),
            traceback=str(error.get("traceback") or ""),
            invocation_id=answer.invocation_id,
            stdout=answer.stdout,
            stderr=answer.stderr,
        )

    async def delete(self, *, wait: float = 120.0) -> None:
        """Deletes the function (this UID only) and waits until its Run is gone."""
        if await self._connection.delete_run(self.namespace, self.name, self.uid):
            await self._connection.wait_run(self.namespace, self.name, self.uid, lambda r: False, wait, "gone")


async def create_function(
    connection: AsyncConnection, namespace: str, body: dict[str, Any], wait: float
) -> AsyncFunction:
    """Creates a function Run and waits until it is Ready."""
    body["metadata"]["namespace"] = namespace
    name = body["metadata"]["name"]
    created = await connection.create_run(body, namespace, f"function {name}")
    run = await connection.wait_run(
        namespace,
        name,
        meta(created, "uid"),
        lambda r: phase_of(r) == "Ready" or phase_of(r) in TERMINAL_PHASES,
        wait,
        "ready",
        first=created,
    )
    if run is None:
        raise NotFound(f"function {name} was deleted while waiting for it")
    if phase_of(run) != "Ready":
        raise _run_state_error(run, "ended before it was ready")
    return AsyncFunction(connection, run)
