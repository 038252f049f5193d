"""Checkpoints and forks: the bodies sent, the settle and fork rules (pure), the checks
made before anything is sent, and the round trips against the real ``kruntimes up``
(a fork has the checkpoint's files and none of the later changes, and goes its own way; a
checkpoint outlives its sandbox; forks created suspended resume with the files)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from types import SimpleNamespace
from typing import Any, cast

import pytest
import pytest_asyncio

import kruntimes
from kruntimes import (
    AcquireOptions,
    Checkpoint,
    Command,
    Conflict,
    InvalidRequest,
    Operation,
    OperationTimeout,
    SessionSuspended,
    SnapshotStateError,
)
from kruntimes._sync import Client, _Portal
from kruntimes.aio import AsyncClient, from_kube_config
from kruntimes.aio._checkpoints import checkpoint_outcome, forkable, take
from kruntimes.aio._client import AsyncConnection
from kruntimes.errors import from_status
from kruntimes.models import (
    REQUEST_DIGEST_ANNOTATION,
    RUNTIME_ANNOTATION,
    check_fork_count,
    checkpoint_body,
)

from .conftest import Server


def _snapshot(
    phase: str | None,
    *,
    uid: str = "s-1",
    runtime: str | None = "bash",
    reason: str | None = None,
    message: str | None = None,
) -> dict[str, Any]:
    status: dict[str, Any] = {}
    if phase is not None:
        status["phase"] = phase
    if phase == "Ready":
        status.update(
            sizeBytes=12,
            files=3,
            digest="sha256:ab",
            lastSequence=17,
            location={"uri": "file:///s/archive.tar.zst"},
            completionTime="2025-01-01T00:00:00Z",
        )
    if reason is not None:
        status.update(reason=reason, message=message)
    metadata: dict[str, Any] = {"name": "cp", "namespace": "default", "uid": uid}
    if runtime is not None:
        metadata["annotations"] = {RUNTIME_ANNOTATION: runtime}
    return {
        "metadata": metadata,
        "spec": {"source": {"run": {"name": "sb", "uid": "r-1"}}, "reason": "Checkpoint"},
        "status": status,
    }


def _checkpoint(uid: str = "s-1") -> Checkpoint:
    return Checkpoint(
        name="cp", namespace="default", uid=uid, run_name="sb", run_uid="r-1", runtime="bash", phase="Ready"
    )


def test_a_checkpoint_is_a_snapshot_of_the_run_pinned_to_its_uid() -> None:
    assert checkpoint_body("cp-1", "sb", "r-1", "bash") == {
        "apiVersion": "kruntimes.io/v1alpha1",
        "kind": "Snapshot",
        "metadata": {"name": "cp-1", "annotations": {RUNTIME_ANNOTATION: "bash"}},
        "spec": {"source": {"run": {"name": "sb", "uid": "r-1"}}, "reason": "Checkpoint"},
    }
    for bad in ("", "Upper", "under_score", "-lead", "trail-", "a" * 254):
        with pytest.raises(InvalidRequest, match="DNS-1123"):
            checkpoint_body(bad, "sb", "r-1", "bash")


def test_a_fork_names_its_checkpoint_pins_its_uid_and_may_be_created_suspended() -> None:
    run = AcquireOptions(from_snapshot=_checkpoint()).to_run("bash")
    assert run["spec"] == {
        "runtime": "bash",
        "mode": {"session": {}},
        "source": {"snapshot": {"name": "cp", "uid": "s-1"}},
    }
    assert "artifactInputs" not in run["spec"]
    suspended = AcquireOptions(from_snapshot="cp", suspended=True, timeout=60).to_run("bash")["spec"]
    # By name only (no UID known), and spec.suspend last, as the Rust RunSpec orders it.
    assert suspended["source"] == {"snapshot": {"name": "cp"}}
    assert list(suspended) == ["runtime", "mode", "source", "timeout", "suspend"] and suspended["suspend"] is True
    with pytest.raises(InvalidRequest, match="leave source unset"):
        AcquireOptions(from_snapshot="cp", source="echo hi").to_run("bash")
    with pytest.raises(InvalidRequest, match="only a fork"):
        AcquireOptions(suspended=True).to_run("bash")
    with pytest.raises(InvalidRequest, match="DNS-1123"):
        AcquireOptions(from_snapshot="Not A Name").to_run("bash")
    # A request ID's digest covers the checkpoint it forks, UID included.
    a = AcquireOptions(request_id="f-1", from_snapshot=_checkpoint("s-1")).to_run("bash")
    b = AcquireOptions(request_id="f-1", from_snapshot=_checkpoint("s-2")).to_run("bash")
    assert (
        a["metadata"]["annotations"][REQUEST_DIGEST_ANNOTATION]
        != b["metadata"]["annotations"][REQUEST_DIGEST_ANNOTATION]
    )


@pytest.mark.parametrize("count", [0, -1, 101, True, 1.5, "3"])
def test_a_fork_count_outside_1_to_100_is_a_value_error(count: Any) -> None:
    with pytest.raises(ValueError, match="fork"):
        check_fork_count(count)


def test_a_fork_count_of_1_and_100_is_taken() -> None:
    assert (check_fork_count(1), check_fork_count(100)) == (1, 100)


#: A connection with a namespace and nothing else: any request would fail (AttributeError).
_UNUSED = cast(AsyncConnection, SimpleNamespace(namespace="default"))


@pytest.mark.asyncio
async def test_fork_checks_its_count_and_names_before_sending() -> None:
    client = AsyncClient(_UNUSED)
    with pytest.raises(ValueError, match="1 to 100"):
        await client.fork("cp", count=101)
    with pytest.raises(ValueError):
        await client.fork(_checkpoint(), count=0, suspended=True)
    with pytest.raises(InvalidRequest, match="generate_name"):
        await client.fork("cp", count=2, name="one")
    with pytest.raises(InvalidRequest, match="leave source unset"):
        await client.fork("cp", source="echo hi")


def test_the_sync_fork_checks_its_count_before_sending() -> None:
    portal = _Portal()
    try:
        client = Client(portal, AsyncClient(_UNUSED))
        with pytest.raises(ValueError, match="1 to 100"):
            client.fork("cp", count=1000)
    finally:
        portal.stop()


def test_a_capture_goes_on_until_ready_or_failed() -> None:
    assert checkpoint_outcome(_snapshot(None)) is None
    assert checkpoint_outcome(_snapshot("Pending")) is None
    assert checkpoint_outcome(_snapshot("Capturing")) is None
    ready = checkpoint_outcome(_snapshot("Ready"))
    assert ready == Checkpoint(
        name="cp",
        namespace="default",
        uid="s-1",
        run_name="sb",
        run_uid="r-1",
        runtime="bash",
        phase="Ready",
        size_bytes=12,
        files=3,
        digest="sha256:ab",
        last_sequence=17,
        uri="file:///s/archive.tar.zst",
        completion_time="2025-01-01T00:00:00Z",
    )
    assert isinstance(ready, Checkpoint) and ready.ready
    failed = checkpoint_outcome(_snapshot("Failed", reason="StoreFailed", message="disk\nfull " + "x" * 5000))
    assert isinstance(failed, SnapshotStateError)
    assert (failed.name, failed.phase, failed.snapshot_reason, failed.reason) == (
        "cp",
        "Failed",
        "StoreFailed",
        "CheckpointFailed",
    )
    assert "StoreFailed: disk full" in failed.message
    assert "\n" not in failed.message and len(failed.message) <= 1024


def test_only_a_ready_checkpoint_of_the_same_uid_and_runtime_is_forked() -> None:
    assert forkable(_snapshot("Ready"), "cp", "bash").uid == "s-1"
    assert forkable(_snapshot("Ready"), _checkpoint(), None).runtime == "bash"
    # A checkpoint that records no Runtime is taken on the Runtime named.
    assert forkable(_snapshot("Ready", runtime=None), "cp", "python").runtime is None
    for phase in ("Pending", "Capturing"):
        with pytest.raises(SnapshotStateError, match="not Ready yet") as error:
            forkable(_snapshot(phase), "cp", "bash")
        assert (error.value.phase, error.value.reason) == (phase, "NotReady")
    with pytest.raises(SnapshotStateError, match=r"failed and cannot be forked.*NoStore") as failed:
        forkable(_snapshot("Failed", reason="NoStore", message="no store"), "cp", "bash")
    assert failed.value.snapshot_reason == "NoStore"
    with pytest.raises(SnapshotStateError, match="replaced") as replaced:
        forkable(_snapshot("Ready", uid="s-2"), _checkpoint("s-1"), "bash")
    assert replaced.value.reason == "Replaced"
    with pytest.raises(InvalidRequest, match="Runtime bash"):
        forkable(_snapshot("Ready"), "cp", "python")


class _FakeSnapshots:
    """The Snapshot calls of a connection, answered from fixed values."""

    def __init__(self, created: dict[str, Any] | Exception, existing: dict[str, Any] | None = None) -> None:
        self.created = created
        self.existing = existing
        self.bodies: list[dict[str, Any]] = []

    async def create_snapshot(self, body: dict[str, Any], namespace: str) -> dict[str, Any]:
        self.bodies.append(body)
        if isinstance(self.created, Exception):
            raise self.created
        return self.created

    async def get_snapshot(self, namespace: str, name: str) -> dict[str, Any]:
        if self.existing is None:
            raise kruntimes.NotFound("gone", status=404, reason="NotFound")
        return self.existing

    async def wait_snapshot(
        self,
        namespace: str,
        name: str,
        uid: str | None,
        done: Callable[[dict[str, Any]], bool],
        timeout: float,
        what: str,
        first: dict[str, Any] | None = None,
    ) -> dict[str, Any] | None:
        assert first is not None and uid == first["metadata"]["uid"]
        if done(first):
            return first
        raise OperationTimeout(f"snapshot {name} was not {what} after {timeout:g}s (phase {first['status']['phase']})")


_RUN = {"metadata": {"name": "sb", "uid": "r-1"}, "spec": {"runtime": "bash", "mode": {"session": {}}}}


@pytest.mark.asyncio
async def test_a_checkpoint_is_sent_pinned_and_its_failure_or_timeout_raises() -> None:
    fake = _FakeSnapshots(_snapshot("Ready"))
    checkpoint = await take(cast(AsyncConnection, fake), "default", _RUN, "cp", 30)
    assert checkpoint.ready and checkpoint.last_sequence == 17
    assert fake.bodies[0]["metadata"] == {
        "name": "cp",
        "namespace": "default",
        "annotations": {RUNTIME_ANNOTATION: "bash"},
    }
    assert fake.bodies[0]["spec"] == {"source": {"run": {"name": "sb", "uid": "r-1"}}, "reason": "Checkpoint"}
    failed = _FakeSnapshots(_snapshot("Failed", reason="CaptureFailed", message="the worker was lost"))
    with pytest.raises(SnapshotStateError, match="CaptureFailed: the worker was lost"):
        await take(cast(AsyncConnection, failed), "default", _RUN, "cp", 30)
    with pytest.raises(OperationTimeout, match="Capturing"):
        await take(cast(AsyncConnection, _FakeSnapshots(_snapshot("Capturing"))), "default", _RUN, "cp", 1)


@pytest.mark.asyncio
async def test_a_taken_name_is_a_conflict_that_says_whose_it_is() -> None:
    exists = from_status(409, "AlreadyExists", 'snapshots "cp" already exists')
    ours = _FakeSnapshots(exists, existing=_snapshot("Ready"))
    with pytest.raises(Conflict, match=r"already exists in namespace default \(of this sandbox, Ready") as error:
        await take(cast(AsyncConnection, ours), "default", _RUN, "cp", 30)
    assert (error.value.status, error.value.reason) == (409, "AlreadyExists")
    other = _snapshot("Capturing")
    other["spec"]["source"]["run"] = {"name": "other", "uid": "r-2"}
    with pytest.raises(Conflict, match="of sandbox other"):
        await take(cast(AsyncConnection, _FakeSnapshots(exists, existing=other)), "default", _RUN, "cp", 30)
    # Another conflict is not a taken name.
    with pytest.raises(Conflict, match=r"^409 Conflict: busy$"):
        await take(
            cast(AsyncConnection, _FakeSnapshots(Conflict("busy", status=409, reason="Conflict"))),
            "default",
            _RUN,
            "cp",
            30,
        )


# -- Against the real kruntimes up ---------------------------------------------------------


def test_a_fork_has_the_checkpoint_not_the_later_changes_and_goes_its_own_way(
    bash: kruntimes.Runtime, client: kruntimes.Client
) -> None:
    with bash.acquire_sandbox(AcquireOptions(generate_name="cp-src-")) as sandbox:
        sandbox.write_file("a.txt", "one")
        result = sandbox.exec(shell="printf 'v1' > b.txt && chmod 600 b.txt && ln -s a.txt link")
        assert result.exit_code == 0, result.stderr
        with sandbox.open_session() as session:
            # Accepted before the checkpoint, still running when it is created: in it.
            session.send(Operation(command=Command(shell="sleep 2 && printf queued > queued.txt")))
            checkpoint = sandbox.checkpoint(f"{sandbox.name}-cp", timeout=120)
        assert (checkpoint.phase, checkpoint.run_name, checkpoint.run_uid) == ("Ready", sandbox.name, sandbox.uid)
        assert checkpoint.namespace == "default" and checkpoint.uid and checkpoint.runtime == "bash"
        assert checkpoint.files is not None and checkpoint.files >= 3, checkpoint
        assert checkpoint.size_bytes is not None and checkpoint.size_bytes >= len("one" + "v1" + "queued")
        assert checkpoint.digest and checkpoint.uri and checkpoint.completion_time
        # The barrier: the capture's last sequence is the session's (nothing ran since).
        assert checkpoint.last_sequence == sandbox.status().last_sequence
        assert client.checkpoint(checkpoint.name) == checkpoint
        with pytest.raises(Conflict, match="already exists") as taken:
            sandbox.checkpoint(checkpoint.name)
        assert taken.value.reason == "AlreadyExists"
        # After the checkpoint: the sandbox goes on and changes.
        sandbox.write_file("b.txt", "v2")
        sandbox.write_file("c.txt", "later")
        sandbox.delete("queued.txt")
        [fork] = client.fork(checkpoint)
        try:
            run = fork.run()
            assert fork.name.startswith("bash-fork-") and fork.uid != sandbox.uid
            assert run["spec"]["runtime"] == "bash"
            assert run["spec"]["source"] == {"snapshot": {"name": checkpoint.name, "uid": checkpoint.uid}}
            assert fork.read_file("a.txt") == b"one"
            assert fork.read_file("b.txt") == b"v1"
            assert fork.read_file("queued.txt") == b"queued"
            assert fork.read_file("link") == b"one"
            with pytest.raises(kruntimes.NotFound):
                fork.read_file("c.txt")
            result = fork.exec(shell="stat -c '%a %n' b.txt && readlink link")
            assert result.stdout.decode().split("\n")[:2] == ["600 b.txt", "a.txt"], result.stderr
            # Each goes its own way.
            fork.write_file("a.txt", "fork")
            fork.write_file("d.txt", "fork only")
            sandbox.write_file("e.txt", "original only")
            assert sandbox.read_file("a.txt") == b"one"
            with pytest.raises(kruntimes.NotFound):
                sandbox.read_file("d.txt")
            with pytest.raises(kruntimes.NotFound):
                fork.read_file("e.txt")
            assert fork.read_file("b.txt") == b"v1" and sandbox.read_file("b.txt") == b"v2"
        finally:
            fork.release("immediate")
    assert client.delete_checkpoint(checkpoint)


def test_a_checkpoint_outlives_its_sandbox_and_is_still_forked(
    server: Server, bash: kruntimes.Runtime, client: kruntimes.Client
) -> None:
    sandbox = bash.acquire_sandbox(AcquireOptions(generate_name="cp-gone-"))
    try:
        sandbox.write_file("keep/kept.txt", "kept")
        checkpoint = sandbox.checkpoint(f"{sandbox.name}-cp", timeout=120)
    finally:
        assert sandbox.release("immediate") == "Cancelled"
    with pytest.raises(kruntimes.NotFound):
        client.open(sandbox.name)
    snapshot = json.loads(server.kubectl("get", "snapshot", checkpoint.name, "-n", "default", "-o", "json"))
    assert not snapshot["metadata"].get("ownerReferences"), snapshot["metadata"]
    again = client.checkpoint("default", checkpoint.name)
    assert (again.uid, again.phase, again.run_name) == (checkpoint.uid, "Ready", sandbox.name)
    # By name: the Runtime comes from the checkpoint, its sandbox being gone.
    [fork] = client.fork(checkpoint.name)
    try:
        assert fork.read_file("keep/kept.txt") == b"kept"
        assert fork.run()["spec"]["source"]["snapshot"]["uid"] == checkpoint.uid
    finally:
        fork.release("immediate")
    assert client.delete_checkpoint(checkpoint)
    assert not client.delete_checkpoint(checkpoint)
    with pytest.raises(kruntimes.NotFound):
        client.checkpoint(checkpoint.name)
    with pytest.raises(kruntimes.NotFound, match="no checkpoint"):
        client.fork(checkpoint.name)


def test_three_forks_created_suspended_each_resume_with_the_files(
    bash: kruntimes.Runtime, client: kruntimes.Client
) -> None:
    with bash.acquire_sandbox(AcquireOptions(generate_name="cp-many-")) as sandbox:
        setup = "mkdir -p d && printf 'x' > d/x.txt && printf '#!/bin/sh\\necho hi\\n' > run.sh && chmod 755 run.sh"
        result = sandbox.exec(shell=setup)
        assert result.exit_code == 0, result.stderr
        checkpoint = sandbox.checkpoint(f"{sandbox.name}-cp", timeout=120)
    forks = client.fork(checkpoint, count=3, suspended=True, wait=120)
    try:
        assert len(forks) == 3 and len({f.name for f in forks}) == 3
        for fork in forks:
            run = fork.run()
            assert run["status"]["phase"] == "Suspended" and run["spec"]["suspend"] is True, run["status"]
            assert run["spec"]["source"] == {"snapshot": {"name": checkpoint.name, "uid": checkpoint.uid}}
            with pytest.raises(SessionSuspended):
                fork.exec(shell="true")
        # One at a time: a resumed fork takes a slot.
        for fork in forks:
            fork.resume(wait=120)
            assert fork.run()["status"]["phase"] == "Ready"
            assert fork.read_file("d/x.txt") == b"x"
            result = fork.exec(shell="./run.sh")
            assert (result.exit_code, result.stdout) == (0, b"hi\n"), result.stderr
            fork.release("immediate")
    finally:
        for fork in forks:
            fork.release("immediate")
    assert client.delete_checkpoint(checkpoint)


@pytest_asyncio.fixture
async def aclient(server: Server) -> AsyncIterator[AsyncClient]:
    async with from_kube_config(server.kubeconfig) as client:
        yield client


@pytest.mark.asyncio
async def test_async_checkpoint_and_forks_through_acquire_sandbox_and_fork(aclient: AsyncClient) -> None:
    runtime = aclient.runtime("default", "bash")
    sandbox = await runtime.acquire_sandbox(generate_name="cp-async-")
    try:
        await sandbox.write_file("note.txt", "async")
        checkpoint = await sandbox.checkpoint(f"{sandbox.name}-cp", timeout=120)
        assert checkpoint.ready and checkpoint.run_uid == sandbox.uid
    finally:
        await sandbox.release("immediate")
    async with await runtime.acquire_sandbox(from_snapshot=checkpoint) as fork:
        assert await fork.read_file("note.txt") == b"async"
    with pytest.raises(InvalidRequest, match="Runtime bash"):
        await aclient.runtime("default", "python").acquire_sandbox(from_snapshot=checkpoint.name)
    forks = await aclient.fork(checkpoint, count=2)
    try:
        assert [await f.read_file("note.txt") for f in forks] == [b"async", b"async"]
        await forks[0].write_file("note.txt", "first")
        assert await forks[1].read_file("note.txt") == b"async"
    finally:
        for fork in forks:
            await fork.release("immediate")
    assert await aclient.delete_checkpoint(checkpoint.name)
