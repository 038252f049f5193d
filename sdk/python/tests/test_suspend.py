"""Suspend and resume: the settle rule (pure), the options, and the round trip against the
real ``kruntimes up`` (files, mode bits and symlinks kept, sequence numbers continuing)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

import kruntimes
from kruntimes import (
    AcquireOptions,
    Command,
    InvalidRequest,
    Operation,
    SandboxStateError,
    SessionSuspended,
    Superseded,
)
from kruntimes.aio._sandbox import _AT_TARGET, suspend_settled


def _run(
    phase: str, *, suspend: bool, generation: int, conditions: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    return {
        "metadata": {"name": "sb", "uid": "u-1", "generation": generation},
        "spec": {"suspend": suspend, "mode": {"session": {}}},
        "status": {"phase": phase, "conditions": conditions or []},
    }


def test_a_suspend_settles_when_suspended_and_goes_on_while_capturing() -> None:
    assert suspend_settled(_run("Ready", suspend=True, generation=2), True, 2) is None
    assert suspend_settled(_run("Suspended", suspend=True, generation=2), True, 2) is _AT_TARGET


def test_a_resume_settles_when_ready_and_not_asked_to_suspend() -> None:
    assert suspend_settled(_run("Suspended", suspend=False, generation=3), False, 3) is None
    assert suspend_settled(_run("Pending", suspend=False, generation=3), False, 3) is None
    assert suspend_settled(_run("Ready", suspend=False, generation=3), False, 3) is _AT_TARGET
    # Asked to suspend again by an older request that has not been overtaken: not there.
    assert suspend_settled(_run("Ready", suspend=True, generation=3), False, 3) is None


def test_an_overtaken_request_is_superseded_with_both_generations() -> None:
    error = suspend_settled(_run("Ready", suspend=False, generation=3), True, 2)
    assert isinstance(error, Superseded)
    assert (error.generation, error.current_generation, error.status, error.reason) == (2, 3, 409, "Superseded")
    error = suspend_settled(_run("Suspended", suspend=True, generation=5), False, 4)
    assert isinstance(error, Superseded)
    # A newer generation that asks the same (another field changed) is not an overtaking.
    assert suspend_settled(_run("Suspended", suspend=True, generation=7), True, 2) is _AT_TARGET


def test_an_ended_run_and_a_refused_suspend_are_state_errors() -> None:
    ended = suspend_settled(_run("Cancelled", suspend=True, generation=2), True, 2)
    assert isinstance(ended, SandboxStateError) and ended.phase == "Cancelled"
    refused = [{"type": "Suspended", "status": "False", "reason": "NoSnapshotStore", "observedGeneration": 2}]
    error = suspend_settled(_run("Ready", suspend=True, generation=2, conditions=refused), True, 2)
    assert isinstance(error, SandboxStateError) and "NoSnapshotStore" in str(error)
    # A retrying store is not a refusal: it goes on.
    retrying = [{"type": "Suspended", "status": "False", "reason": "SnapshotRetrying", "observedGeneration": 2}]
    assert suspend_settled(_run("Ready", suspend=True, generation=2, conditions=retrying), True, 2) is None
    # A refusal of an earlier request does not answer this one.
    assert suspend_settled(_run("Ready", suspend=True, generation=3, conditions=refused), True, 3) is None


def test_auto_suspend_and_worker_loss_options_reach_the_spec() -> None:
    run = AcquireOptions(auto_suspend_after=timedelta(minutes=15), on_worker_loss="ResumeFromSnapshot").to_run("bash")
    session = run["spec"]["mode"]["session"]
    assert session == {"autoSuspendAfter": "15m", "onWorkerLoss": "ResumeFromSnapshot"}
    with pytest.raises(InvalidRequest, match="at least one second"):
        AcquireOptions(auto_suspend_after=0.5).to_run("bash")
    with pytest.raises(InvalidRequest, match="on_worker_loss"):
        AcquireOptions(on_worker_loss="Retry").to_run("bash")


def test_suspend_then_resume_keeps_the_files_and_the_sequence(bash: kruntimes.Runtime) -> None:
    with bash.acquire_sandbox(AcquireOptions(generate_name="suspend-")) as sandbox:
        setup = "printf 'x' > data.txt && chmod 600 data.txt && printf '#!/bin/sh\\necho hi\\n' > run.sh"
        result = sandbox.exec(shell=setup + " && chmod 755 run.sh && ln -s data.txt link && mkdir -p d/e")
        assert result.exit_code == 0, result.stderr
        for _ in range(5):
            assert sandbox.exec(shell="true").exit_code == 0
        before = sandbox.status().last_sequence
        assert before >= 15
        generation = sandbox.suspend(wait=120)
        assert generation >= 2
        assert sandbox.run()["status"]["phase"] == "Suspended"
        # Suspending again is a success at once.
        assert sandbox.suspend(wait=120) == generation
        with pytest.raises(SessionSuspended):
            sandbox.exec(shell="true")
        resumed = sandbox.resume(wait=120)
        assert resumed > generation
        run = sandbox.run()
        assert run["status"]["phase"] == "Ready" and int(run["status"]["incarnation"]) >= 2
        result = sandbox.exec(shell="stat -c '%a %n' data.txt run.sh && readlink link && ./run.sh && test -d d/e")
        assert result.exit_code == 0, result.stderr
        assert result.stdout.decode().split("\n")[:4] == ["600 data.txt", "755 run.sh", "data.txt", "hi"]
        assert sandbox.read_file("link") == b"x"
        # Sequence numbers continue after the last one before the suspend.
        with sandbox.open_session() as session:
            session.send(Operation(command=Command(shell="true")))
            first = session.receive(timeout=60)
        assert first.sequence > before, (first.sequence, before)
        # Resuming a Ready sandbox is a success at once.
        assert sandbox.resume(wait=120) == resumed
