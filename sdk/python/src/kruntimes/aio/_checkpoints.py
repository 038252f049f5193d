"""Checkpoints and forks of sandboxes.

A checkpoint is a ``Snapshot`` the client creates, naming the sandbox's session Run and
pinning its UID (``spec.source.run``, ``spec.reason: Checkpoint``). The worker that owns
the session takes it as a barrier in the session's queue: every operation accepted before
it is in the capture and none after, while the session goes on. Its status goes
``Pending → Capturing → Ready | Failed``; it is not owned by its Run and outlives it.

A fork is a session Run whose ``spec.source.snapshot`` names a Ready checkpoint and pins
its UID; with ``spec.suspend: true`` it is created Suspended to it. The Snapshot records
no Runtime, so the SDK writes the sandbox's Runtime on it (``kruntimes.io/runtime``) for
the forks to run on.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

from ..errors import Conflict, InvalidRequest, KruntimesError, NotFound, SnapshotStateError
from ..models import Checkpoint, checkpoint_body, snapshot_reference
from ._client import AsyncConnection, meta, phase_of, status_field

#: The phases a Snapshot ends in: ``Ready`` and ``Failed`` are final.
SNAPSHOT_FINAL_PHASES = frozenset({"Ready", "Failed"})


def snapshot_error(snapshot: Mapping[str, Any], text: str, *, reason: str | None = None) -> SnapshotStateError:
    """A :class:`SnapshotStateError` for ``snapshot``, with its phase, reason and message."""
    name = meta(snapshot, "name")
    phase = phase_of(snapshot)
    snapshot_reason = status_field(snapshot, "reason")
    snapshot_message = status_field(snapshot, "message")
    detail = "".join(f": {p}" for p in (snapshot_reason, snapshot_message) if p)
    return SnapshotStateError(
        f"checkpoint {name} {text} (phase {phase}{detail})",
        name=name,
        phase=phase,
        snapshot_reason=snapshot_reason,
        snapshot_message=snapshot_message,
        reason=reason,
    )


def checkpoint_outcome(snapshot: Mapping[str, Any]) -> Checkpoint | SnapshotStateError | None:
    """How a checkpoint's capture stands in ``snapshot``: ``None`` while it goes on
    (``Pending``, ``Capturing``), the :class:`Checkpoint` once ``Ready``, the error the
    caller gets once ``Failed``."""
    phase = phase_of(snapshot)
    if phase == "Ready":
        return Checkpoint.from_wire(snapshot)
    if phase == "Failed":
        return snapshot_error(snapshot, "failed", reason="CheckpointFailed")
    return None


def forkable(snapshot: Mapping[str, Any], wanted: Checkpoint | str, runtime: str | None) -> Checkpoint:
    """The :class:`Checkpoint` a fork on ``runtime`` (``None``: the one it records) may
    start from, when ``snapshot`` (read just now) is the one ``wanted`` (the same UID,
    when ``wanted`` is a :class:`Checkpoint`) and is Ready; else why it may not."""
    name = meta(snapshot, "name")
    if isinstance(wanted, Checkpoint) and wanted.uid and meta(snapshot, "uid") != wanted.uid:
        raise SnapshotStateError(
            f"checkpoint {name} was replaced: its Snapshot now has UID {meta(snapshot, 'uid')}, not {wanted.uid}",
            name=name,
            phase=phase_of(snapshot),
            reason="Replaced",
        )
    phase = phase_of(snapshot)
    if phase == "Failed":
        raise snapshot_error(snapshot, "failed and cannot be forked", reason="CheckpointFailed")
    if phase != "Ready":
        raise snapshot_error(snapshot, "is not Ready yet and cannot be forked; wait until it is", reason="NotReady")
    checkpoint = Checkpoint.from_wire(snapshot)
    if runtime is not None and checkpoint.runtime is not None and checkpoint.runtime != runtime:
        raise InvalidRequest(
            f"checkpoint {name} was taken of a sandbox on Runtime {checkpoint.runtime}: "
            f"fork it on that Runtime, not {runtime}"
        )
    return checkpoint


async def take(
    connection: AsyncConnection, namespace: str, run: Mapping[str, Any], name: str, timeout: float
) -> Checkpoint:
    """Creates the checkpoint ``name`` of the session Run ``run`` and waits until it is
    Ready (see :meth:`AsyncSandbox.checkpoint`)."""
    run_name, run_uid = meta(run, "name"), meta(run, "uid")
    body = checkpoint_body(name, run_name, run_uid, (run.get("spec") or {}).get("runtime"))
    body["metadata"]["namespace"] = namespace
    try:
        created = await connection.create_snapshot(body, namespace)
    except Conflict as e:
        if e.reason != "AlreadyExists":
            raise
        raise await _name_taken(connection, namespace, name, run_uid) from None
    settled = await connection.wait_snapshot(
        namespace,
        name,
        meta(created, "uid"),
        lambda s: phase_of(s) in SNAPSHOT_FINAL_PHASES,
        timeout,
        "captured",
        first=created,
    )
    if settled is None:
        raise SnapshotStateError(
            f"checkpoint {name} was deleted before it was captured",
            name=name,
            phase="Deleted",
            status=404,
            reason="NotFound",
        )
    outcome = checkpoint_outcome(settled)
    if isinstance(outcome, SnapshotStateError):
        raise outcome
    assert outcome is not None
    return outcome


async def _name_taken(connection: AsyncConnection, namespace: str, name: str, run_uid: str) -> Conflict:
    """The error of a checkpoint whose name another Snapshot holds (409 ``AlreadyExists``),
    saying whose it is when that can be read."""
    whose = ""
    with contextlib.suppress(KruntimesError):
        existing = Checkpoint.from_wire(await connection.get_snapshot(namespace, name))
        if existing.run_uid == run_uid:
            whose = f" (of this sandbox, {existing.phase}: read it with client.checkpoint({name!r}))"
        elif existing.run_name:
            whose = f" (of sandbox {existing.run_name})"
    return Conflict(
        f"a checkpoint named {name} already exists in namespace {namespace}{whose}; a checkpoint's name is "
        "unique in its namespace: pick another, or delete that one",
        status=409,
        reason="AlreadyExists",
    )


async def read(connection: AsyncConnection, namespace: str, name: str) -> Checkpoint:
    """The checkpoint ``name`` as it is now."""
    return Checkpoint.from_wire(await connection.get_snapshot(namespace, name))


async def resolve(
    connection: AsyncConnection, namespace: str, runtime: str | None, wanted: Checkpoint | str
) -> Checkpoint:
    """The checkpoint a fork in ``namespace`` on ``runtime`` starts from, read now: it
    must be Ready (and, for a :class:`Checkpoint`, the same Snapshot)."""
    name = snapshot_reference(wanted)["name"]
    if isinstance(wanted, Checkpoint) and wanted.namespace and wanted.namespace != namespace:
        raise InvalidRequest(
            f"checkpoint {name} is in namespace {wanted.namespace}: a fork is made in its checkpoint's namespace, "
            f"not {namespace}"
        )
    try:
        snapshot = await connection.get_snapshot(namespace, name)
    except NotFound as e:
        raise NotFound(
            f"no checkpoint {name} in namespace {namespace} to fork", status=e.status, reason=e.reason
        ) from None
    return forkable(snapshot, wanted, runtime)


async def runtime_of(connection: AsyncConnection, namespace: str, checkpoint: Checkpoint) -> str:
    """The Runtime a fork of ``checkpoint`` runs on: the one it records, else that of its
    sandbox while that still exists."""
    if checkpoint.runtime:
        return checkpoint.runtime
    with contextlib.suppress(NotFound):
        run = await connection.get_run(namespace, checkpoint.run_name)
        runtime = (run.get("spec") or {}).get("runtime")
        if runtime and (checkpoint.run_uid is None or meta(run, "uid") == checkpoint.run_uid):
            return str(runtime)
    raise InvalidRequest(
        f"checkpoint {checkpoint.name} records no Runtime and its sandbox {checkpoint.run_name} is gone: "
        "pass runtime= (the Runtime of that sandbox)"
    )


__all__ = ["checkpoint_outcome", "forkable", "read", "resolve", "runtime_of", "take"]
