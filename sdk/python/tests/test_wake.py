"""Wake on demand: a sandbox its owner suspended for idleness is woken by the next call
(the gateway answers 503 ``SessionWaking`` with ``Retry-After``, the SDK tries again until
it is Ready), so the caller sees one successful result; the retry rule itself (pure)."""

from __future__ import annotations

import io
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

import kruntimes
from kruntimes import AcquireOptions
from kruntimes.aio import AsyncClient, AsyncSandbox, from_kube_config
from kruntimes.aio._client import TERMINAL_PHASES, phase_of
from kruntimes.aio._sandbox import AUTO_SUSPENDED_ANNOTATION, auto_suspended
from kruntimes.aio._wake import WAKE_RETRY_CAP, wake_delay
from kruntimes.errors import from_status

from .conftest import Server


def _run(*, suspend: bool, marker: str | None, incarnation: int | None) -> dict[str, Any]:
    annotations = {} if marker is None else {AUTO_SUSPENDED_ANNOTATION: marker}
    status: dict[str, Any] = {"phase": "Suspended"}
    if incarnation is not None:
        status["incarnation"] = incarnation
    return {"metadata": {"annotations": annotations}, "spec": {"suspend": suspend}, "status": status}


def test_only_the_owners_marker_of_the_current_incarnation_makes_a_session_wakeable() -> None:
    assert auto_suspended(_run(suspend=True, marker="1", incarnation=None))
    assert auto_suspended(_run(suspend=True, marker=" 3 ", incarnation=3))
    # A marker of an earlier incarnation, no marker, or no suspend request: the user's.
    assert not auto_suspended(_run(suspend=True, marker="2", incarnation=3))
    assert not auto_suspended(_run(suspend=True, marker=None, incarnation=1))
    assert not auto_suspended(_run(suspend=False, marker="1", incarnation=1))
    garbled = _run(suspend=True, marker="1", incarnation=None)
    garbled["status"]["incarnation"] = "x"
    assert not auto_suspended(garbled)


def test_a_waking_answer_is_retried_after_its_retry_after_and_the_resume_steps_once_woken() -> None:
    waking = from_status(503, "SessionWaking", "waking", retry_after=1.0)
    assert isinstance(waking, kruntimes.SessionWaking) and isinstance(waking, kruntimes.Unavailable)
    assert wake_delay(waking, False) == 1.0
    assert wake_delay(from_status(503, "SessionWaking", "waking", retry_after=30.0), False) == WAKE_RETRY_CAP
    suspended = kruntimes.SessionSuspended("suspended", status=409, reason="SessionSuspended")
    pending = kruntimes.SandboxStateError("not ready", name="s", phase="Pending")
    not_ready = from_status(503, "NotReady", "not ready", retry_after=1.0)
    for step in (suspended, pending, not_ready):
        # Before a wake was seen these are the caller's answer; after it, steps of the resume.
        assert wake_delay(step, False) is None
        assert wake_delay(step, True) is not None
    # An ended Run, or any other refusal, is never tried again.
    assert wake_delay(kruntimes.SandboxStateError("ended", name="s", phase="Failed"), True) is None
    assert wake_delay(from_status(409, "SessionSuspending", "suspending"), True) is None
    assert wake_delay(from_status(503, "Other", "down"), True) is None


@pytest_asyncio.fixture
async def aclient(server: Server) -> AsyncIterator[AsyncClient]:
    async with from_kube_config(server.kubeconfig) as client:
        yield client


async def _auto_suspended(sandbox: AsyncSandbox) -> dict[str, Any]:
    """Waits (a watch) until the owner has suspended ``sandbox`` for idleness."""
    run = await sandbox._connection.wait_run(
        sandbox.namespace,
        sandbox.name,
        sandbox.uid,
        lambda r: (phase_of(r) == "Suspended" and auto_suspended(r)) or phase_of(r) in TERMINAL_PHASES,
        120,
        "auto-suspended",
    )
    assert run is not None and phase_of(run) == "Suspended", run
    return run


@pytest.mark.asyncio
async def test_an_auto_suspended_sandbox_is_woken_by_the_next_exec_and_upload(aclient: AsyncClient) -> None:
    runtime = aclient.runtime("default", "bash")
    options = AcquireOptions(generate_name="wake-", auto_suspend_after=2)
    async with await runtime.acquire_sandbox(options) as sandbox:
        wrote = await sandbox.exec(shell="echo kept > f")
        assert wrote.exit_code == 0, wrote.stderr
        suspended = await _auto_suspended(sandbox)
        endpoint = suspended["status"]["endpoint"]["url"]

        # One exec: answered SessionWaking until the session is back, then run once.
        woken = await sandbox.exec(shell="cat f && echo once >> log")
        assert (woken.exit_code, woken.stdout) == (0, b"kept\n"), woken.stderr
        run = await sandbox.run()
        assert phase_of(run) == "Ready" and run["status"]["incarnation"] == 2
        assert run["status"]["endpoint"]["url"] == endpoint, "woken at the endpoint it kept"
        assert AUTO_SUSPENDED_ANNOTATION not in (run["metadata"].get("annotations") or {})

        # Idle again: an upload (its body read once) wakes it first, then is sent once.
        await _auto_suspended(sandbox)
        uploaded = await sandbox.upload("g", io.BytesIO(b"uploaded"), size=8)
        assert uploaded.size_bytes == 8
        assert await sandbox.read_file("g") == b"uploaded"
        assert await sandbox.read_file("log") == b"once\n", "the woken exec ran exactly once"
        assert int((await sandbox.run())["status"]["incarnation"]) == 3

        # Idle once more: a download (a plain read) wakes it too.
        await _auto_suspended(sandbox)
        chunks: list[bytes] = []
        assert await sandbox.download("f", chunks.append) == 5
        assert b"".join(chunks) == b"kept\n"
        assert int((await sandbox.run())["status"]["incarnation"]) == 4
