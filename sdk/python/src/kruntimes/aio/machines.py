"""The machines view (design document ``fn/machines/machines.go``), async: claim a
machine, put a file on it, run something, give it back.

A client only: there is no pool here, no scheduler and no queue. A machine is a session Run
on a Runtime's warm pool, acquired as any sandbox is, and every call goes through the
gateway to the session's own queue. ``exec`` machines of one project run side by side. A
``dev`` machine holds its project's Workspace (the project names it): its files are
restored at the claim and committed at the release, and its Run is named after the
project, so a second claim gets :class:`~kruntimes.Conflict` (409) from the API server
while the first exists. ``desktop`` needs a display, which this version does not have
(:class:`~kruntimes.InvalidRequest`).

.. code-block:: python

    machines = AsyncMachines(client, "python")
    lease = await machines.claim(Spec(org="acme", cls="exec", project="my-function"))
    await machines.write(lease, "main.py", "print('hi')\\n")
    result = await machines.exec(lease, ExecRequest(argv=["python3", "main.py"]))
    await machines.release(lease)
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field

from ..errors import Conflict, InvalidRequest, KruntimesError, NotFound
from ..models import MAX_FILE_BYTES, AcquireOptions, Command, Operation
from ..models import ExecResult as OperationResult
from ._api import AsyncClient
from ._client import TERMINAL_PHASES, AsyncConnection, meta, phase_of
from ._sandbox import AsyncSandbox, acquire

#: The label that names a machine's project.
PROJECT_LABEL = "kruntimes.io/project"
#: The label that names a machine's class.
CLASS_LABEL = "kruntimes.io/machine-class"

#: The lifetime classes, as the machines view spells them, and as ``spec.mode.session.class``.
CLASSES = {"exec": "Exec", "dev": "Dev", "desktop": "Desktop"}

_LABEL_VALUE = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)*")


@dataclass(frozen=True)
class Spec:
    """What a caller asks for. No image, node, size or placement: those are the Runtime's.

    Attributes:
        org: The tenant: the namespace the machine lives in.
        cls: The lifetime class: ``"exec"`` (seconds, no volume, concurrent), ``"dev"``
            (the project's Workspace, exclusive per project; the project must then be a
            DNS-1123 name) or ``"desktop"`` (refused by this version).
        project: The machine's project (a label value); for a function, its name.
        ttl_sec: A floor under leaks: the machine ends this many seconds after the claim
            (``spec.timeout``); ``0``: the platform's idle TTL only.
    """

    org: str
    cls: str
    project: str
    ttl_sec: int = 0


@dataclass(frozen=True)
class Lease:
    """A claimed machine.

    Attributes:
        id: The session Run's name.
        org: Its namespace.
        status: Its phase when claimed (``"Ready"``).
    """

    id: str
    org: str
    status: str
    sandbox: AsyncSandbox = field(repr=False, compare=False)


@dataclass(frozen=True)
class ExecRequest:
    """One command: argv only, never a shell line.

    Attributes:
        argv: The program and its arguments, passed as they are.
        cwd: The working directory, relative to the workspace.
        env: Environment variables of this command.
        stdin: Given on standard input (at most 1 MiB).
        timeout_sec: Its own limit in seconds (``0``: the session's operation timeout).
    """

    argv: list[str]
    cwd: str = ""
    env: Mapping[str, str] = field(default_factory=dict)
    stdin: str | bytes = b""
    timeout_sec: int = 0


@dataclass(frozen=True)
class ExecResult:
    """One finished command. A non-zero ``exit_code`` is a successful call carrying a
    failed program.

    Attributes:
        exit_code: The program's code; 128 + the signal that killed it; 124 when its
            timeout ran out; 127 when it does not exist (126: it cannot be executed).
        stdout: Standard output (at most 1 MiB).
        stderr: Standard error (at most 1 MiB; the reason, for 126 and 127).
        duration_ms: How long it ran.
        timed_out: Its timeout ran out; it and everything it started were killed.
    """

    exit_code: int
    stdout: bytes
    stderr: bytes
    duration_ms: int
    timed_out: bool = False


class AsyncMachines:
    """The machines of one Runtime (in each org's namespace): the whole dependency of a
    caller."""

    def __init__(self, client: AsyncClient, runtime: str) -> None:
        self._client = client
        self.runtime = runtime

    async def claim(self, spec: Spec) -> Lease:
        """Claims a machine: a session Run of ``spec.cls`` in namespace ``spec.org``,
        labelled with its project and class, Ready when this returns. A ``dev`` machine is
        the Run named after the project, with the project's Workspace. Raises
        :class:`~kruntimes.InvalidRequest` for a bad org, class or project (nothing sent) and
        the API server's refusals (:class:`~kruntimes.Conflict` while another ``dev``
        machine of the project exists, :class:`~kruntimes.Forbidden` for an org the caller
        may not use).

        An ended ``dev`` Run of the project that was never deleted does not block the claim:
        it is deleted (that Run only, by its UID) and the claim made again, once."""
        session_class = CLASSES.get(spec.cls)
        if session_class is None:
            raise InvalidRequest(f"the class is one of {', '.join(CLASSES)}, not {spec.cls!r}")
        if not _LABEL_VALUE.fullmatch(spec.project):
            raise InvalidRequest(
                f"the project {spec.project!r} is not 1 to 63 characters of [A-Za-z0-9._-] "
                "starting and ending alphanumeric"
            )
        if not spec.org:
            raise InvalidRequest("the org is empty")
        if spec.ttl_sec < 0:
            raise InvalidRequest(f"ttl_sec must not be negative, not {spec.ttl_sec}")
        dev = spec.cls == "dev"
        if dev and not _DNS_SUBDOMAIN.fullmatch(spec.project):
            raise InvalidRequest(
                f"the project {spec.project!r} names a dev machine's Workspace and Run: it must be "
                "lower-case [a-z0-9.-], starting and ending alphanumeric"
            )
        options = AcquireOptions(
            generate_name=None if dev else f"{_prefix(spec.project)}-",
            workspace=spec.project if dev else None,
            labels={PROJECT_LABEL: spec.project, CLASS_LABEL: spec.cls},
            timeout=float(spec.ttl_sec) if spec.ttl_sec else None,
            session_class=session_class,
        )
        connection = self._client.connection
        try:
            sandbox = await acquire(connection, spec.org, self.runtime, options, give_back_on_failure=True)
        except Conflict:
            if not dev or not await _remove_ended(connection, spec.org, spec.project):
                raise
            sandbox = await acquire(connection, spec.org, self.runtime, options, give_back_on_failure=True)
        return Lease(id=sandbox.name, org=spec.org, status="Ready", sandbox=sandbox)

    async def write(self, lease: Lease, path: str, content: str | bytes) -> None:
        """Writes ``content`` to ``path`` (relative to the workspace; missing directories
        are made) after every operation sent to the machine before it; a file over 1 MiB
        is streamed with the file API instead, which is not queued."""
        data = content.encode() if isinstance(content, str) else bytes(content)
        parent = path.rpartition("/")[0]
        if parent:
            _written(parent, await lease.sandbox.execute(Operation(make_directory=(parent, True))))
        if len(data) > MAX_FILE_BYTES:
            # No operation carries more: streamed with the file API, which is not queued
            # (it waits for nothing sent before it).
            await lease.sandbox.upload(path, _chunks(data), size=len(data))
            return
        _written(path, await lease.sandbox.execute(Operation(write_file=(path, data, False))))

    async def exec(self, lease: Lease, request: ExecRequest) -> ExecResult:
        """Runs ``request.argv`` on the machine, after every operation sent to it before."""
        if not request.argv:
            raise InvalidRequest("argv is empty")
        if request.timeout_sec < 0:
            raise InvalidRequest(f"timeout_sec must not be negative, not {request.timeout_sec}")
        command = Command(
            argv=list(request.argv),
            cwd=request.cwd or None,
            env=dict(request.env),
            stdin=request.stdin or None,
        )
        timeout = float(request.timeout_sec) if request.timeout_sec else None
        done = await lease.sandbox.execute(Operation(command=command, timeout=timeout))
        if done.exit_code is None:
            raise KruntimesError(f"the command's result has no exit code ({done.reason}: {done.message})")
        return ExecResult(
            exit_code=done.exit_code,
            stdout=done.stdout,
            stderr=done.stderr,
            duration_ms=round(done.duration_ms),
            timed_out=done.timed_out,
        )

    async def release(self, lease: Lease) -> None:
        """Gives the machine back: the Run is asked to end at once (anything still running
        is cancelled) and deleted. An ``exec`` machine's release does not wait: its worker
        closes the session and frees the slot, and the Run goes once that is done. A
        ``dev`` machine's release returns once the Run is gone, that is once its files are
        committed to the project's Workspace, so the next claim of the project finds them."""
        sandbox = lease.sandbox
        await sandbox.end_and_delete()
        try:
            run = await sandbox.run()
        except NotFound:
            return
        if meta(run, "uid") == sandbox.uid and (run.get("spec") or {}).get("workspace"):
            await self._client.connection.wait_run(
                lease.org, lease.id, sandbox.uid, lambda r: False, _RELEASE_WAIT, "committed and gone"
            )


#: How long a ``dev`` machine's release waits for its commit.
_RELEASE_WAIT = 120.0


async def _remove_ended(connection: AsyncConnection, namespace: str, name: str) -> bool:
    """Deletes the Run ``name`` of an earlier ``dev`` machine when it has ended (by its UID)
    and waits until it is gone: ``True`` when it is (or already was), ``False`` when it is
    live or still committing (being deleted)."""
    try:
        run = await connection.get_run(namespace, name)
    except NotFound:
        return True
    # Only a dev machine of this project: a Run of another kind that happens to carry the
    # name (a task kept for its logs) is never deleted here.
    workspace = ((run.get("spec") or {}).get("workspace") or {}).get("name")
    labels = (run.get("metadata") or {}).get("labels") or {}
    if workspace != name or labels.get(CLASS_LABEL) != "dev":
        return False
    if phase_of(run) not in TERMINAL_PHASES or (run.get("metadata") or {}).get("deletionTimestamp"):
        return False
    uid = meta(run, "uid")
    with contextlib.suppress(NotFound, Conflict):
        await connection.delete_run(namespace, name, uid)
    await connection.wait_run(namespace, name, uid, lambda r: False, _RELEASE_WAIT, "gone")
    return True


async def _chunks(data: bytes) -> AsyncIterator[bytes]:
    for start in range(0, len(data), 1 << 20):
        yield data[start : start + (1 << 20)]


def _written(path: str, done: OperationResult) -> None:
    if done.state != "Succeeded":
        raise KruntimesError(f"writing {path} failed: {done.reason}: {done.message}")


def _prefix(project: str) -> str:
    """The Run name prefix of ``project``: lower-case ``[a-z0-9-]``, at most 40 characters,
    starting with a letter."""
    prefix = re.sub(r"[^a-z0-9]", "-", project.lower())[:40].rstrip("-")
    if not prefix or not prefix[0].isalpha():
        prefix = "m-" + prefix
    return prefix
