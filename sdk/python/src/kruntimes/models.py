"""The values the SDK sends and returns: options, operations, events and results.

They are plain frozen dataclasses, shared by the sync client (:mod:`kruntimes`) and the
async one (:mod:`kruntimes.aio`). Field names follow design document 001 and
``docs/session-mode.md``; the wire's camelCase is the SDK's business.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from decimal import Decimal
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

_OPERATION_ID = re.compile(r"[A-Za-z0-9._-]{1,128}")

#: The annotation that carries a sandbox's creation request ID (as the Rust SDK writes it).
REQUEST_ID_ANNOTATION = "kruntimes.io/request-id"
#: The annotation that carries the SHA-256 of the spec and labels a request ID created its
#: sandbox with.
REQUEST_DIGEST_ANNOTATION = "kruntimes.io/request-digest"
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,255}$")
#: The annotation with which the SDK records, on a checkpoint, the Runtime of the sandbox
#: it captured: a fork runs on the same Runtime, also once that sandbox is gone.
RUNTIME_ANNOTATION = "kruntimes.io/runtime"
#: The most sandboxes one fork makes.
MAX_FORK_COUNT = 100
#: The longest object name (a DNS-1123 subdomain).
MAX_OBJECT_NAME_BYTES = 253
_OBJECT_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")

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


def _millis(value: float | timedelta) -> int:
    """``value`` (seconds, or a timedelta) in whole milliseconds, rounded up, as the Rust
    SDK rounds a ``Duration``."""
    if isinstance(value, timedelta):
        micros = value // timedelta(microseconds=1)
        return -(-micros // 1000)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequest(f"a duration is seconds or a timedelta, not {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        raise InvalidRequest(f"a duration must be finite, not {value}")
    # The decimal the caller wrote (1.1 is 1100 ms, not 1100.0000000000002).
    return math.ceil(Decimal(repr(value)) * 1000)


def duration_text(value: float | timedelta) -> str:
    """A duration (seconds, or a timedelta) as the API spells it, exactly as the Rust SDK
    renders one: whole milliseconds rounded up, in the largest unit that divides it
    (``2h``, ``30m``, ``90s``, ``1500ms``)."""
    millis = _millis(value)
    if millis <= 0:
        raise InvalidRequest(f"a duration must be greater than zero, not {value}")
    for unit, size in (("h", 3_600_000), ("m", 60_000), ("s", 1_000)):
        if millis % size == 0:
            return f"{millis // size}{unit}"
    return f"{millis}ms"


def is_request_id(request_id: str) -> bool:
    """Whether ``request_id`` is a creation request ID: 1 to 128 bytes of ``[A-Za-z0-9._-]``."""
    return isinstance(request_id, str) and _OPERATION_ID.fullmatch(request_id) is not None


def request_run_name(request_id: str) -> str:
    """The name of the Run a request ID creates, as the Rust SDK derives it: ``req-`` and
    the first 20 bytes of the ID's SHA-256 in hex (a DNS label whatever the ID spells)."""
    return "req-" + hashlib.sha256(request_id.encode()).hexdigest()[:40]


def request_digest(spec: Mapping[str, Any], labels: Mapping[str, str] | None) -> str:
    """The SHA-256 (hex) of what a request ID creates, over the same bytes as the Rust SDK:
    the compact JSON of ``[spec, labels]`` (``null`` for no labels), the spec's fields in
    the Rust struct's order, labels sorted by key, non-ASCII as UTF-8."""
    text = json.dumps(
        [spec, dict(sorted(labels.items())) if labels else None],
        separators=(",", ":"),
        ensure_ascii=False,
    )
    return hashlib.sha256(text.encode()).hexdigest()


def is_object_name(name: str) -> bool:
    """Whether ``name`` is an object name: a DNS-1123 subdomain of at most 253 bytes
    (lower-case letters, digits, ``-`` and ``.``)."""
    return isinstance(name, str) and len(name) <= MAX_OBJECT_NAME_BYTES and _OBJECT_NAME.fullmatch(name) is not None


def check_object_name(name: str, what: str) -> str:
    """``name`` when it is an object name (:func:`is_object_name`); else
    :class:`InvalidRequest` naming ``what`` it is."""
    if not is_object_name(name):
        raise InvalidRequest(
            f"{what} is a DNS-1123 subdomain of at most {MAX_OBJECT_NAME_BYTES} bytes "
            f"(lower-case letters, digits, '-' and '.'), not {name!r}"
        )
    return name


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
class Checkpoint:
    """A checkpoint: a ``Snapshot`` of a sandbox's files, taken while it goes on
    (:meth:`~kruntimes.Sandbox.checkpoint`). It holds every operation accepted before it
    was created and none after. It is not owned by its sandbox and outlives it; forks
    (:meth:`~kruntimes.Client.fork`) start from it.

    Attributes:
        name: The Snapshot's name.
        namespace: Its namespace (the sandbox's, and its forks').
        uid: Its UID, which forks pin.
        run_name: The sandbox (session Run) it captures.
        run_uid: That Run's UID, when the Snapshot pins it.
        runtime: The sandbox's Runtime, when recorded (forks run on it).
        phase: ``Pending``, ``Capturing``, ``Ready`` or ``Failed``.
        size_bytes: Bytes of the captured files, uncompressed (once Ready).
        files: Files captured (once Ready).
        digest: ``sha256:<hex>`` of the archive (once Ready).
        last_sequence: The session's last operation sequence number at capture.
        uri: Where the archive lives (``status.location.uri``).
        completion_time: When it became Ready or Failed (RFC 3339).
        reason: Why it failed, when it did (``status.reason``).
        message: What failed, when it did (``status.message``).
    """

    name: str
    namespace: str
    uid: str
    run_name: str
    run_uid: str | None
    runtime: str | None
    phase: str
    size_bytes: int | None = None
    files: int | None = None
    digest: str | None = None
    last_sequence: int | None = None
    uri: str | None = None
    completion_time: str | None = None
    reason: str | None = None
    message: str | None = None

    @property
    def ready(self) -> bool:
        """Phase ``Ready``: it can be forked."""
        return self.phase == "Ready"

    @staticmethod
    def from_wire(snapshot: Mapping[str, Any]) -> Checkpoint:
        """From a Snapshot object."""
        metadata = snapshot.get("metadata") or {}
        run = ((snapshot.get("spec") or {}).get("source") or {}).get("run") or {}
        status = snapshot.get("status") or {}

        def text(value: Any) -> str | None:
            return str(value) if value not in (None, "") else None

        def number(value: Any) -> int | None:
            return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None

        return Checkpoint(
            name=str(metadata.get("name") or ""),
            namespace=str(metadata.get("namespace") or ""),
            uid=str(metadata.get("uid") or ""),
            run_name=str(run.get("name") or ""),
            run_uid=text(run.get("uid")),
            runtime=text((metadata.get("annotations") or {}).get(RUNTIME_ANNOTATION)),
            phase=str(status.get("phase") or "Pending"),
            size_bytes=number(status.get("sizeBytes")),
            files=number(status.get("files")),
            digest=text(status.get("digest")),
            last_sequence=number(status.get("lastSequence")),
            uri=text((status.get("location") or {}).get("uri")),
            completion_time=text(status.get("completionTime")),
            reason=text(status.get("reason")),
            message=text(status.get("message")),
        )


def checkpoint_body(name: str, run_name: str, run_uid: str, runtime: str | None) -> dict[str, Any]:
    """The Snapshot that checkpoints the session Run ``run_name`` (pinned to ``run_uid``),
    recording its ``runtime`` (checked before anything is sent)."""
    metadata: dict[str, Any] = {"name": check_object_name(name, "a checkpoint's name")}
    if runtime:
        metadata["annotations"] = {RUNTIME_ANNOTATION: runtime}
    return {
        "apiVersion": "kruntimes.io/v1alpha1",
        "kind": "Snapshot",
        "metadata": metadata,
        "spec": {"source": {"run": {"name": run_name, "uid": run_uid}}, "reason": "Checkpoint"},
    }


def check_fork_count(count: int) -> int:
    """``count`` when it is a number of forks one call may make (1 to 100); else
    :class:`ValueError`."""
    if isinstance(count, bool) or not isinstance(count, int):
        raise ValueError(f"a fork count is a whole number, not {count!r}")
    if not 1 <= count <= MAX_FORK_COUNT:
        raise ValueError(f"a fork makes 1 to {MAX_FORK_COUNT} sandboxes, not {count}")
    return count


#: The values of ``spec.mode.session.onWorkerLoss``.
WORKER_LOSS_POLICIES = ("Fail", "ResumeFromSnapshot")

#: The values of ``spec.mode.session.class`` (the machines view's lifetime classes; only
#: ``Exec`` is served: ``Dev`` needs project Workspaces and ``Desktop`` a display).
SESSION_CLASSES = ("Exec", "Dev", "Desktop")


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
        idle_timeout: End the sandbox (``Timeout``/``IdleTimeout``) after this long without
            an operation or file write, in seconds or a :class:`~datetime.timedelta` (at
            least one second; ``spec.mode.session.idleTimeout``). It may only lower the
            platform's idle TTL (``--session-idle-ttl``, 168h by default): a longer one is
            clamped to it. ``None``: the platform's TTL.
        env: Environment variables of every command.
        labels: Labels of the Run, to find sandboxes by.
        source: A program text written into the workspace before it is Ready.
        timeout: The longest the whole reservation may last, in seconds.
        wait: How long to wait until it is Ready, in seconds.
        request_id: A creation request ID (1 to 128 bytes of ``[A-Za-z0-9._-]``), which
            makes the create safe to retry after a lost answer: a retry with the same ID
            and the same options returns the same sandbox, one with other options raises
            :class:`~kruntimes.RequestConflict`, and once that sandbox ended (a release
            keeps its Run as the ID's tombstone) :class:`~kruntimes.RequestIdReserved`. The
            Run's name is derived from it (:func:`request_run_name`, the same as the Rust
            SDK's), so ``name`` and ``generate_name`` must be unset.
        auto_suspend_after: Suspend the sandbox after this long without an operation or
            file write (reads, listings and heartbeats do not count), in seconds or a
            :class:`~datetime.timedelta`, at least a second
            (``spec.mode.session.autoSuspendAfter``). ``None``: never on idle.
        on_worker_loss: What a lost worker does to the sandbox: ``"Fail"`` (the default)
            or ``"ResumeFromSnapshot"`` (``spec.mode.session.onWorkerLoss``).
        session_class: The machine's lifetime class (``spec.mode.session.class``):
            ``"Exec"`` (what a sandbox is without it); ``"Dev"`` (needs ``workspace``);
            ``"Desktop"`` is refused (422) by this version.
        from_snapshot: Start the sandbox from a checkpoint's files (a fork,
            ``spec.source.snapshot``): a :class:`Checkpoint` or a Snapshot's name, in the
            sandbox's namespace, taken of a sandbox on the same Runtime. The Snapshot is
            read first and must be ``Ready``; the fork pins its UID. ``source`` must be
            unset.
        suspended: With ``from_snapshot``: create the fork ``Suspended`` to the checkpoint
            (``spec.suspend``; it takes no slot) and return once it is; ``resume()`` it
            later.
        workspace: The project Workspace to restore before Ready and commit to at the end
            (``spec.workspace``). The sandbox is then named after it (the Run's name is the
            Workspace's lock): ``name``, ``generate_name`` and ``request_id`` must be unset
            or the same name, and a second sandbox of the Workspace gets 409 while the first
            exists.
    """

    name: str | None = None
    generate_name: str | None = None
    lease_timeout_seconds: float | None = None
    queue_size: int | None = None
    operation_timeout: float | None = None
    idle_timeout: float | timedelta | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    labels: Mapping[str, str] = field(default_factory=dict)
    source: str | None = None
    timeout: float | None = None
    wait: float = 300.0
    request_id: str | None = None
    auto_suspend_after: float | timedelta | None = None
    on_worker_loss: str | None = None
    session_class: str | None = None
    from_snapshot: Checkpoint | str | None = None
    suspended: bool = False
    workspace: str | None = None

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
        if self.idle_timeout is not None:
            if _millis(self.idle_timeout) < 1000:
                raise InvalidRequest(
                    f"idle_timeout must be at least one second (leave it out for the platform's idle TTL), "
                    f"not {self.idle_timeout}"
                )
            session["idleTimeout"] = duration_text(self.idle_timeout)
        if self.auto_suspend_after is not None:
            if _millis(self.auto_suspend_after) < 1_000:
                raise InvalidRequest(
                    f"auto_suspend_after must be at least one second (leave it out to never suspend on idle), "
                    f"not {self.auto_suspend_after}"
                )
            session["autoSuspendAfter"] = duration_text(self.auto_suspend_after)
        if self.on_worker_loss is not None:
            if self.on_worker_loss not in WORKER_LOSS_POLICIES:
                raise InvalidRequest(
                    f"on_worker_loss is one of {', '.join(WORKER_LOSS_POLICIES)}, not {self.on_worker_loss!r}"
                )
            session["onWorkerLoss"] = self.on_worker_loss
        if self.session_class is not None:
            if self.session_class not in SESSION_CLASSES:
                raise InvalidRequest(
                    f"session_class is one of {', '.join(SESSION_CLASSES)}, not {self.session_class!r}"
                )
            session["class"] = self.session_class
        # The fields in the order of the Rust SDK's RunSpec (runtime, mode, source, env,
        # timeout, suspend): a request ID's digest is taken over this JSON, byte for byte
        # the same.
        spec: dict[str, Any] = {"runtime": runtime, "mode": {"session": session}}
        source: dict[str, Any] = {}
        if self.source is not None:
            source["inline"] = self.source
        if self.from_snapshot is not None:
            if self.source is not None:
                raise InvalidRequest("a fork takes its files from its checkpoint: leave source unset")
            source["snapshot"] = snapshot_reference(self.from_snapshot)
        if source:
            spec["source"] = source
        env = check_env(self.env)
        if env:
            spec["env"] = env
        if self.timeout is not None:
            spec["timeout"] = duration_text(self.timeout)
        if self.workspace is not None:
            check_object_name(self.workspace, "a Workspace's name")
            if self.from_snapshot is not None:
                raise InvalidRequest("a sandbox with a Workspace starts from its head: leave from_snapshot unset")
            if self.request_id is not None or self.generate_name is not None or self.name not in (None, self.workspace):
                raise InvalidRequest(
                    "a sandbox with a Workspace is named after it: leave name, generate_name and request_id unset"
                )
            spec["workspace"] = {"name": self.workspace}
        elif self.session_class == "Dev":
            raise InvalidRequest("a Dev machine needs its project's Workspace (workspace)")
        if self.suspended:
            if self.from_snapshot is None:
                raise InvalidRequest("only a fork (from_snapshot) is created suspended")
            spec["suspend"] = True
        # The registration-cleanup finalizer goes on at create, as the Rust SDK does: runtimed
        # would add it before registering, and finds it there (one API write fewer).
        metadata: dict[str, Any] = {"finalizers": ["kruntimes.io/registration-cleanup"]}
        labels = dict(self.labels) if self.labels else None
        if labels is not None:
            metadata["labels"] = labels
        if self.request_id is not None:
            if not is_request_id(self.request_id):
                raise InvalidRequest(f"a request ID is 1 to 128 bytes of [A-Za-z0-9._-], not {self.request_id!r}")
            if self.name is not None or self.generate_name is not None:
                raise InvalidRequest("a request ID names the sandbox itself: leave name and generate_name unset")
            metadata["name"] = request_run_name(self.request_id)
            metadata["annotations"] = {
                REQUEST_ID_ANNOTATION: self.request_id,
                REQUEST_DIGEST_ANNOTATION: request_digest(spec, labels),
            }
        elif self.name or self.workspace:
            metadata["name"] = self.name or self.workspace
        else:
            metadata["generateName"] = self.generate_name or f"{runtime}-sandbox-"
        return {"apiVersion": "kruntimes.io/v1alpha1", "kind": "Run", "metadata": metadata, "spec": spec}


def snapshot_reference(snapshot: Checkpoint | str) -> dict[str, str]:
    """``spec.source.snapshot`` of a fork of ``snapshot``: its name, and its UID when known
    (a :class:`Checkpoint`)."""
    name = check_object_name(snapshot.name if isinstance(snapshot, Checkpoint) else snapshot, "a checkpoint's name")
    reference = {"name": name}
    if isinstance(snapshot, Checkpoint) and snapshot.uid:
        reference["uid"] = snapshot.uid
    return reference


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
            if not _OPERATION_ID.fullmatch(self.operation_id):
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
    "MAX_FORK_COUNT",
    "REQUEST_DIGEST_ANNOTATION",
    "REQUEST_ID_ANNOTATION",
    "RUNTIME_ANNOTATION",
    "AcquireOptions",
    "Checkpoint",
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
    "check_fork_count",
    "check_object_name",
    "checkpoint_body",
    "is_object_name",
    "is_request_id",
    "request_digest",
    "request_run_name",
]
