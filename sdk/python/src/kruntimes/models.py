"""The values the SDK sends and returns: options, operations, events and results.

They are plain frozen dataclasses, shared by the sync client (:mod:`kruntimes`) and the
async one (:mod:`kruntimes.aio`). Field names follow design document 001 and
``docs/session-mode.md``; the wire's camelCase is the SDK's business.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from .errors import InvalidRequest

#: The largest file a ``write_file`` or ``read_file`` moves (1 MiB, the gateway's cap).
MAX_FILE_BYTES = 1024 * 1024
#: The largest standard input of a command (1 MiB).
MAX_STDIN_BYTES = 1024 * 1024
#: The largest listing page.
MAX_LIST_LIMIT = 1000
#: The longest operation ID.
MAX_OPERATION_ID_BYTES = 128

_OPERATION_ID = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,255}$")

ReleaseMode = Literal["drain", "immediate"]
EventType = Literal["accepted", "started", "output", "completed", "failed"]


def _seconds(value: float | None, what: str) -> int | None:
    """Whole seconds, rounded up; ``None`` stays ``None``."""
    if value is None:
        return None
    if value <= 0:
        raise InvalidRequest(f"{what} must be greater than zero, not {value}")
    whole = int(value)
    return whole + (1 if value > whole else 0)


def duration_text(seconds: float) -> str:
    """A duration as the API spells it (``90s``, ``250ms``)."""
    if seconds <= 0:
        raise InvalidRequest(f"a duration must be greater than zero, not {seconds}")
    if float(seconds).is_integer():
        return f"{int(seconds)}s"
    return f"{max(1, round(seconds * 1000))}ms"


def check_env(env: Mapping[str, str] | None) -> list[dict[str, str]]:
    """``env`` as the Run's ``spec.env`` list, checked."""
    if not env:
        return []
    out = []
    for name, value in env.items():
        if not _ENV_NAME.match(name):
            raise InvalidRequest(
                f"environment variable {name!r}: a name is letters, digits and '_', not starting with a digit"
            )
        if name.startswith("KRUNTIME_"):
            raise InvalidRequest(f"environment variable {name}: names starting with KRUNTIME_ are reserved")
        if not isinstance(value, str):
            raise InvalidRequest(f"environment variable {name}: the value must be a string")
        out.append({"name": name, "value": value})
    if len(out) > 256:
        raise InvalidRequest(f"{len(out)} environment variables; at most 256")
    return out


# ---------------------------------------------------------------------------------------
# Sandboxes
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AcquireOptions:
    """How to acquire a sandbox (one session Run).

    Attributes:
        name: The Run's exact name; else ``generate_name`` is used.
        generate_name: The name prefix (default ``<runtime>-sandbox-``).
        lease_timeout_seconds: End the sandbox (``Timeout``/``LeaseExpired``) when no
            heartbeat arrives for this long. An open session sends heartbeats. ``None``:
            no lease.
        queue_size: Queued operations at most (1..32).
        operation_timeout: The longest one operation may run, in seconds (at most 300).
        env: Environment variables of every command.
        labels: Labels of the Run, to find sandboxes by.
        source: A program text written into the workspace before it is Ready.
        timeout: The longest the whole reservation may last, in seconds.
        wait: How long to wait until it is Ready, in seconds.
    """

    name: str | None = None
    generate_name: str | None = None
    lease_timeout_seconds: float | None = None
    queue_size: int | None = None
    operation_timeout: float | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    labels: Mapping[str, str] = field(default_factory=dict)
    source: str | None = None
    timeout: float | None = None
    wait: float = 300.0

    def to_run(self, runtime: str) -> dict[str, Any]:
        """The session Run these options describe (checked before anything is sent)."""
        session: dict[str, Any] = {}
        lease = _seconds(self.lease_timeout_seconds, "the lease timeout")
        if lease is not None:
            session["leaseTimeoutSeconds"] = lease
        if self.queue_size is not None:
            if not 1 <= self.queue_size <= 32:
                raise InvalidRequest(f"queue_size must be 1 to 32, not {self.queue_size}")
            session["queueSize"] = self.queue_size
        if self.operation_timeout is not None:
            session["operationTimeout"] = duration_text(self.operation_timeout)
        spec: dict[str, Any] = {"runtime": runtime, "mode": {"session": session}}
        env = check_env(self.env)
        if env:
            spec["env"] = env
        if self.source is not None:
            spec["source"] = {"inline": self.source}
        if self.timeout is not None:
            spec["timeout"] = duration_text(self.timeout)
        # The registration-cleanup finalizer goes on at create, as the Rust SDK does: runtimed
        # would add it before registering, and finds it there (one API write fewer).
        metadata: dict[str, Any] = {"finalizers": ["kruntimes.io/registration-cleanup"]}
        if self.name:
            metadata["name"] = self.name
        else:
            metadata["generateName"] = self.generate_name or f"{runtime}-sandbox-"
        if self.labels:
            metadata["labels"] = dict(self.labels)
        return {"apiVersion": "kruntimes.io/v1alpha1", "kind": "Run", "metadata": metadata, "spec": spec}


@dataclass(frozen=True)
class Command:
    """A program to run in a sandbox: ``argv`` or a ``shell`` line (exactly one).

    Attributes:
        argv: The program and its arguments.
        shell: One line for ``bash -c``.
        cwd: The working directory, relative to the workspace.
        env: Extra environment variables.
        stdin: Bytes (or text, UTF-8) on the program's standard input, at most 1 MiB.
        timeout: Seconds before the operation is ended ``TimedOut`` (at most the session's
            operation timeout).
    """

    argv: Sequence[str] | None = None
    shell: str | None = None
    cwd: str | None = None
    env: Mapping[str, str] | None = None
    stdin: bytes | str | None = None
    timeout: float | None = None


@dataclass(frozen=True)
class Operation:
    """One operation of a session: a command, or a file mutation (exactly one).

    Attributes:
        command: Run a program.
        write_file: ``(path, content, executable)``.
        make_directory: ``(path, parents)``.
        delete: ``(path, recursive)``.
        rename: ``(from, to)``.
        operation_id: 1..128 bytes of ``[A-Za-z0-9._-]``, unique in the session; the
            session assigns ``op-<n>`` when absent.
        timeout: Seconds (for a command, ``Command.timeout`` also works).
    """

    command: Command | None = None
    write_file: tuple[str, bytes, bool] | None = None
    make_directory: tuple[str, bool] | None = None
    delete: tuple[str, bool] | None = None
    rename: tuple[str, str] | None = None
    operation_id: str | None = None
    timeout: float | None = None

    def to_wire(self) -> dict[str, Any]:
        """The operation's JSON object (checked)."""
        kinds = [
            k for k in (self.command, self.write_file, self.make_directory, self.delete, self.rename) if k is not None
        ]
        if len(kinds) != 1:
            raise InvalidRequest("an operation is exactly one of command, write_file, make_directory, delete, rename")
        out: dict[str, Any] = {}
        if self.operation_id is not None:
            if not _OPERATION_ID.match(self.operation_id):
                raise InvalidRequest("an operation ID is 1 to 128 bytes of letters, digits, '.', '_' and '-'")
            out["operationId"] = self.operation_id
        timeout = self.timeout
        if self.command is not None:
            c = self.command
            if (c.argv is None) == (c.shell is None):
                raise InvalidRequest("a command is exactly one of argv or shell")
            command: dict[str, Any] = {}
            if c.argv is not None:
                argv = list(c.argv)
                if not argv or not all(isinstance(a, str) for a in argv):
                    raise InvalidRequest("argv must be a non-empty list of strings")
                command["argv"] = argv
            else:
                command["shell"] = c.shell
            if c.cwd:
                command["cwd"] = c.cwd
            if c.env:
                check_env(c.env)
                command["env"] = dict(c.env)
            if c.stdin is not None:
                data = c.stdin.encode() if isinstance(c.stdin, str) else bytes(c.stdin)
                if len(data) > MAX_STDIN_BYTES:
                    raise InvalidRequest(f"stdin of {len(data)} bytes is over the limit of {MAX_STDIN_BYTES}")
                command["stdin"] = base64.b64encode(data).decode()
            out["command"] = command
            if timeout is None:
                timeout = c.timeout
        elif self.write_file is not None:
            path, content, executable = self.write_file
            if len(content) > MAX_FILE_BYTES:
                raise InvalidRequest(f"a file of {len(content)} bytes is over the limit of {MAX_FILE_BYTES}")
            out["writeFile"] = {
                "path": path,
                "content": base64.b64encode(content).decode(),
                "executable": executable,
            }
        elif self.make_directory is not None:
            out["makeDirectory"] = {"path": self.make_directory[0], "parents": self.make_directory[1]}
        elif self.delete is not None:
            out["delete"] = {"path": self.delete[0], "recursive": self.delete[1]}
        elif self.rename is not None:
            out["rename"] = {"from": self.rename[0], "to": self.rename[1]}
        secs = _seconds(timeout, "an operation's timeout")
        if secs is not None:
            out["timeoutSeconds"] = secs
        return out


@dataclass(frozen=True)
class Event:
    """One event of a session operation, in the order the sandbox produced them.

    ``type`` is ``accepted`` (admitted to the queue; ``position``), ``started``,
    ``output`` (``stream``, ``data``), ``completed`` (``state``, ``exit_code``,
    ``duration_ms``, ``reason``, ``message``) or ``failed`` (``code``, ``message``: the
    operation's events were cut off, its outcome is unknown). ``sequence`` is per session,
    from 1, contiguous over the session's operations (0 on ``failed``).
    """

    type: EventType
    operation_id: str
    sequence: int
    position: int | None = None
    stream: str | None = None
    data: bytes = b""
    truncated: bool = False
    state: str | None = None
    exit_code: int | None = None
    duration_ms: float | None = None
    reason: str | None = None
    message: str | None = None
    code: int | None = None
    stdout_truncated: bool = False
    stderr_truncated: bool = False

    @property
    def is_final(self) -> bool:
        """The operation's last event (``completed`` or ``failed``)."""
        return self.type in ("completed", "failed")


@dataclass(frozen=True)
class ExecResult:
    """What a command did. A non-zero ``exit_code`` is a result, not an error.

    Attributes:
        operation_id: The operation's ID.
        exit_code: The program's exit code; ``None`` when it ended without one (killed by a
            signal, timed out, cancelled, did not start).
        stdout: Its standard output (at most 1 MiB; ``stdout_truncated`` past that).
        stderr: Its standard error.
        state: ``Succeeded``, ``Failed``, ``Cancelled`` or ``TimedOut``.
        reason: Why it ended (``Completed``, ``NonZeroExitCode``, ``OOMKilled``, …).
        timed_out: It ran past its timeout.
        duration_ms: How long it ran.
    """

    operation_id: str
    exit_code: int | None
    stdout: bytes
    stderr: bytes
    state: str
    reason: str
    message: str
    timed_out: bool
    duration_ms: float
    stdout_truncated: bool = False
    stderr_truncated: bool = False

    @property
    def ok(self) -> bool:
        """Exit code 0."""
        return self.exit_code == 0


@dataclass(frozen=True)
class FileEntry:
    """One entry of a directory listing (``path`` relative to the workspace)."""

    path: str
    directory: bool = False
    size_bytes: int = 0
    symlink: bool = False


@dataclass(frozen=True)
class FilePage:
    """One page of a listing: pass ``next_page_token`` for the next; empty means no later
    entry was seen."""

    entries: list[FileEntry]
    next_page_token: str = ""


@dataclass(frozen=True)
class Uploaded:
    """What an upload wrote: the sandbox path, the bytes sent (a tar stream's length for a
    directory) and the regular files written (1 for a file)."""

    path: str
    size_bytes: int
    files: int


@dataclass(frozen=True)
class ListFilesOptions:
    """Which page of which directory to list.

    Attributes:
        directory: Relative to the workspace; empty: the workspace.
        limit: Entries per page, 1..1000; 0 leaves it to the server (100).
        page_token: The previous page's ``next_page_token``; empty: the first page.
    """

    directory: str = ""
    limit: int = 0
    page_token: str = ""


@dataclass(frozen=True)
class SandboxStatus:
    """A sandbox's session as its owner sees it (``GET {endpoint}``)."""

    run_uid: str
    run_name: str
    phase: str
    state: str
    served_by: str
    queued: int
    running_operation_id: str
    last_sequence: int
    queue_size: int
    operation_timeout_seconds: int
    lease_timeout_seconds: int
    lease_expires_at: str | None

    @staticmethod
    def from_wire(body: Mapping[str, Any]) -> SandboxStatus:
        """From the gateway's JSON."""
        return SandboxStatus(
            run_uid=str(body.get("runUID", "")),
            run_name=str(body.get("runName", "")),
            phase=str(body.get("phase", "")),
            state=str(body.get("state", "")),
            served_by=str(body.get("servedBy", "")),
            queued=int(body.get("queued", 0) or 0),
            running_operation_id=str(body.get("runningOperationId", "")),
            last_sequence=int(body.get("lastSequence", 0) or 0),
            queue_size=int(body.get("queueSize", 0) or 0),
            operation_timeout_seconds=int(body.get("operationTimeoutSeconds", 0) or 0),
            lease_timeout_seconds=int(body.get("leaseTimeoutSeconds", 0) or 0),
            lease_expires_at=body.get("leaseExpiresAt") or None,
        )


# ---------------------------------------------------------------------------------------
# Tasks and functions
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TaskResult:
    """How a task ended.

    Attributes:
        phase: ``Succeeded``, ``Failed``, ``Timeout`` or ``Cancelled``.
        exit_code: The program's exit code, when it had one.
        outputs: What the program wrote to ``$KRUNTIME_OUTPUTS`` (``KEY=VALUE`` lines).
        stdout: Its standard output, from the gateway's log (at most ``max_log_bytes``).
        stderr: Its standard error.
        reason: ``status.reason`` (``Completed``, ``NonZeroExitCode``, ``Timeout``, …).
        message: ``status.message``.
    """

    name: str
    phase: str
    exit_code: int | None
    outputs: dict[str, str]
    stdout: bytes
    stderr: bytes
    reason: str | None
    message: str | None

    @property
    def succeeded(self) -> bool:
        """Phase ``Succeeded``."""
        return self.phase == "Succeeded"


@dataclass(frozen=True)
class Invocation:
    """A function call's whole answer (``Function.call``).

    Attributes:
        invocation_id: The invocation's ID.
        outcome: ``Succeeded``, ``Failed`` or ``TimedOut``.
        result: The handler's JSON result (``None`` unless it succeeded).
        error: ``{"type", "message", "traceback"}`` when it failed.
        stdout: What the invocation printed (at most 64 KiB, the end kept).
        stderr: What it wrote to stderr.
        duration_seconds: The handler's time.
        served_by: The worker Pod that ran it.
        hops: How often the call was forwarded (0 or 1).
    """

    invocation_id: str
    outcome: str
    result: Any
    error: Mapping[str, Any] | None
    stdout: str
    stderr: str
    duration_seconds: float
    served_by: str
    hops: int


__all__ = [
    "AcquireOptions",
    "Command",
    "Event",
    "ExecResult",
    "FileEntry",
    "FilePage",
    "Invocation",
    "ListFilesOptions",
    "Operation",
    "ReleaseMode",
    "SandboxStatus",
    "TaskResult",
]
