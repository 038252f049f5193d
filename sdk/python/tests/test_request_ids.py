"""Creation request IDs and idle timeouts of sandboxes (issue 19 items 5 and 7; design
document 003), sync and async, against the real ``kruntimes up``: a retry with the same ID
and options returns the same sandbox, other options are a conflict that creates nothing,
release keeps the ended Run as the ID's tombstone and a retry is then refused, racing
creates give one Run, a malformed ID is refused before any request, and a Python retry of
a create made by the Rust SDK (``krt``) returns that sandbox."""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml

import kruntimes
from kruntimes import AcquireOptions, RequestConflict, RequestIdReserved, request_run_name
from kruntimes.aio import from_kube_config as async_from_kube_config
from kruntimes.kubernetes import from_kube_config
from kruntimes.models import REQUEST_DIGEST_ANNOTATION, REQUEST_ID_ANNOTATION, duration_text, request_digest

from .conftest import Server

TERMINAL = ("Succeeded", "Failed", "Timeout", "Cancelled")


def runs_of(server: Server, request_id: str) -> list[dict[str, Any]]:
    """The Runs of the namespace that carry ``request_id``."""
    runs = json.loads(server.kubectl("get", "runs", "-n", "default", "-o", "json"))["items"]
    return [r for r in runs if (r["metadata"].get("annotations") or {}).get(REQUEST_ID_ANNOTATION) == request_id]


def purge(server: Server, name: str) -> None:
    """Deletes a tombstone (frees its request ID)."""
    server.kubectl("delete", "run", name, "-n", "default", "--ignore-not-found", "--wait=false")


def test_a_request_id_names_the_run_and_records_the_digest() -> None:
    run = AcquireOptions(request_id="agent-1.turn-7").to_run("bash")
    name = run["metadata"]["name"]
    assert name == request_run_name("agent-1.turn-7") and name.startswith("req-") and len(name) == 44
    assert "generateName" not in run["metadata"]
    annotations = run["metadata"]["annotations"]
    assert annotations[REQUEST_ID_ANNOTATION] == "agent-1.turn-7"
    # The digest is over the Rust SDK's bytes: compact JSON of [spec, labels or null].
    assert annotations[REQUEST_DIGEST_ANNOTATION] == request_digest(run["spec"], None)
    assert json.dumps([run["spec"], None], separators=(",", ":")) == ('[{"runtime":"bash","mode":{"session":{}}},null]')
    other = AcquireOptions(request_id="agent-1.turn-7", timeout=60).to_run("bash")
    assert other["metadata"]["name"] == name
    assert other["metadata"]["annotations"][REQUEST_DIGEST_ANNOTATION] != annotations[REQUEST_DIGEST_ANNOTATION]
    # Labels count, in any order they are given.
    a = AcquireOptions(request_id="x", labels={"b": "2", "a": "1"}).to_run("bash")
    b = AcquireOptions(request_id="x", labels={"a": "1", "b": "2"}).to_run("bash")
    assert a["metadata"]["annotations"] == b["metadata"]["annotations"]
    assert a["metadata"]["annotations"] != AcquireOptions(request_id="x").to_run("bash")["metadata"]["annotations"]
    for bad in (
        AcquireOptions(request_id=""),
        AcquireOptions(request_id="no spaces"),
        AcquireOptions(request_id="trailing-newline\n"),
        AcquireOptions(request_id="x" * 129),
        AcquireOptions(request_id="é"),
        AcquireOptions(request_id="ok", name="mine"),
        AcquireOptions(request_id="ok", generate_name="mine-"),
    ):
        with pytest.raises(kruntimes.InvalidRequest):
            bad.to_run("bash")
    AcquireOptions(request_id="A-z_0.9" + "x" * 121).to_run("bash")  # 128 bytes


def test_durations_render_as_the_rust_sdk_renders_them() -> None:
    for value, text in (
        (90, "90s"),
        (60, "1m"),
        (1800, "30m"),
        (timedelta(minutes=30), "30m"),
        (timedelta(hours=2), "2h"),
        (7200.0, "2h"),
        (1.5, "1500ms"),
        (1.1, "1100ms"),
        (timedelta(microseconds=1), "1ms"),
        (0.0001, "1ms"),
        (timedelta(seconds=61, microseconds=500), "61001ms"),
    ):
        assert duration_text(value) == text, value
    session = AcquireOptions(idle_timeout=timedelta(minutes=30), operation_timeout=60).to_run("bash")
    assert session["spec"]["mode"]["session"] == {"operationTimeout": "1m", "idleTimeout": "30m"}
    for bad in (0, -1, 0.5, timedelta(milliseconds=999), float("nan"), float("inf")):
        with pytest.raises(kruntimes.InvalidRequest):
            AcquireOptions(idle_timeout=bad).to_run("bash")


def test_a_retry_returns_the_same_sandbox_another_spec_conflicts_and_release_keeps_the_tombstone(
    server: Server, bash: kruntimes.Runtime
) -> None:
    options = AcquireOptions(request_id="py-sync.turn-1", labels={"team": "sdk"}, idle_timeout=timedelta(minutes=30))
    first = bash.acquire_sandbox(options)
    try:
        assert first.name == request_run_name("py-sync.turn-1") and first.request_id == "py-sync.turn-1"
        assert first.run()["spec"]["mode"]["session"]["idleTimeout"] == "30m"
        again = bash.acquire_sandbox(options)
        assert (again.name, again.uid) == (first.name, first.uid)
        assert again.exec(["echo", "same"]).stdout == b"same\n"
        again.close()

        # The same ID with other options is a conflict, and creates nothing.
        for other in (
            AcquireOptions(request_id="py-sync.turn-1", labels={"team": "sdk"}),
            AcquireOptions(request_id="py-sync.turn-1", labels={"team": "other"}, idle_timeout=1800),
            AcquireOptions(request_id="py-sync.turn-1", labels={"team": "sdk"}, idle_timeout=1800, env={"A": "1"}),
        ):
            with pytest.raises(RequestConflict) as conflict:
                bash.acquire_sandbox(other)
            assert isinstance(conflict.value, kruntimes.Conflict)
            assert (conflict.value.status, conflict.value.reason) == (409, "RequestConflict")
            assert (conflict.value.request_id, conflict.value.name) == ("py-sync.turn-1", first.name)
        # A timedelta and the same seconds are the same options.
        same = bash.acquire_sandbox(
            AcquireOptions(request_id="py-sync.turn-1", labels={"team": "sdk"}, idle_timeout=1800)
        )
        assert same.uid == first.uid
        assert len(runs_of(server, "py-sync.turn-1")) == 1
    finally:
        phase = first.release()
    assert phase == "Succeeded"

    # After release the ID stays reserved: the ended Run is kept as its tombstone.
    kept = runs_of(server, "py-sync.turn-1")
    assert len(kept) == 1 and kept[0]["status"]["phase"] in TERMINAL
    assert kept[0]["metadata"]["uid"] == first.uid
    with pytest.raises(RequestIdReserved) as reserved:
        bash.acquire_sandbox(options)
    assert isinstance(reserved.value, kruntimes.Conflict)
    assert (reserved.value.status, reserved.value.name, reserved.value.phase) == (409, first.name, "Succeeded")
    assert len(runs_of(server, "py-sync.turn-1")) == 1
    # Released again, a tombstone stays a tombstone.
    assert first.release() == "Succeeded"
    assert len(runs_of(server, "py-sync.turn-1")) == 1
    purge(server, first.name)


def test_ten_racing_creates_in_threads_give_one_run(server: Server, bash: kruntimes.Runtime) -> None:
    options = AcquireOptions(request_id="py-race-threads")
    with ThreadPoolExecutor(10) as pool:
        sandboxes = list(pool.map(lambda _: bash.acquire_sandbox(options), range(10)))
    try:
        assert {sb.uid for sb in sandboxes} == {sandboxes[0].uid}
        assert len(runs_of(server, "py-race-threads")) == 1
    finally:
        sandboxes[0].release("immediate")
    purge(server, sandboxes[0].name)


def test_a_malformed_request_id_is_refused_before_any_request(server: Server, tmp_path: Path) -> None:
    # A kubeconfig whose API server cannot be reached: any request would be Unavailable.
    config = yaml.safe_load(server.kubeconfig.read_text())
    config["clusters"][0]["cluster"]["server"] = "https://127.0.0.1:1"
    unreachable = tmp_path / "kubeconfig"
    unreachable.write_text(yaml.safe_dump(config))
    with from_kube_config(unreachable) as client:
        bash = client.runtime("default", "bash")
        for bad in (
            AcquireOptions(request_id="no spaces"),
            AcquireOptions(request_id="x" * 129),
            AcquireOptions(request_id="fine", name="mine"),
            AcquireOptions(request_id="fine", generate_name="mine-"),
        ):
            with pytest.raises(kruntimes.InvalidRequest, match="request ID"):
                bash.acquire_sandbox(bad)
        # The same client does send a good one (and fails to reach the server).
        with pytest.raises(kruntimes.Unavailable):
            bash.acquire_sandbox(AcquireOptions(request_id="fine", wait=5))
    assert runs_of(server, "no spaces") == [] and runs_of(server, "fine") == []


@pytest.mark.asyncio
async def test_async_racing_creates_conflict_and_reserved(server: Server) -> None:
    async with async_from_kube_config(server.kubeconfig) as client:
        runtime = client.runtime("default", "bash")
        options = AcquireOptions(request_id="py-race-async", idle_timeout=90, env={"K": "v"})
        sandboxes = await asyncio.gather(*(runtime.acquire_sandbox(options) for _ in range(10)))
        first = sandboxes[0]
        try:
            assert {sb.uid for sb in sandboxes} == {first.uid}
            assert first.name == request_run_name("py-race-async")
            assert (await first.run())["spec"]["mode"]["session"]["idleTimeout"] == "90s"
            assert len(runs_of(server, "py-race-async")) == 1
            with pytest.raises(RequestConflict):
                await runtime.acquire_sandbox(AcquireOptions(request_id="py-race-async", idle_timeout=91))
            assert len(runs_of(server, "py-race-async")) == 1
        finally:
            assert await first.release() == "Succeeded"
        with pytest.raises(RequestIdReserved) as reserved:
            await runtime.acquire_sandbox(options)
        assert reserved.value.phase == "Succeeded"
        # Racing retries after the release are all refused; still one Run.
        retries = await asyncio.gather(*(runtime.acquire_sandbox(options) for _ in range(5)), return_exceptions=True)
        assert all(isinstance(r, RequestIdReserved) for r in retries), retries
        assert len(runs_of(server, "py-race-async")) == 1
    purge(server, first.name)


def test_a_python_retry_of_a_rust_create_returns_the_same_sandbox(server: Server, bash: kruntimes.Runtime) -> None:
    # krt is the Rust SDK's CLI: its Run's name and digest annotation are the Rust SDK's.
    value = 'h\u00e9llo "q" \\ \t\u2603 \x01'
    out = server.krt(
        "sandbox",
        "create",
        "--request-id",
        "rust-then-python",
        "-e",
        f"GREETING={value}",
        "-e",
        "B=2",
        "-l",
        "team=sdk",
        "-l",
        "app=agent",
        "--lease-timeout",
        "300",
        "--timeout",
        "1h",
        "--idle-timeout",
        "90s",
    )
    name = out.strip().splitlines()[-1].strip()
    assert name == request_run_name("rust-then-python")
    (rust_run,) = runs_of(server, "rust-then-python")
    options = AcquireOptions(
        request_id="rust-then-python",
        env={"GREETING": value, "B": "2"},
        labels={"team": "sdk", "app": "agent"},
        lease_timeout_seconds=300,
        timeout=3600,
        idle_timeout=timedelta(seconds=90),
    )
    # Byte for byte the Rust SDK's digest (the spec and labels, canonical JSON).
    ours = options.to_run("bash")
    assert ours["metadata"]["annotations"] == rust_run["metadata"]["annotations"]
    assert ours["spec"] == rust_run["spec"]
    sandbox = bash.acquire_sandbox(options)
    try:
        assert (sandbox.name, sandbox.uid) == (name, rust_run["metadata"]["uid"])
        assert sandbox.exec(shell='printf %s "$GREETING"').stdout == value.encode()
        with pytest.raises(RequestConflict):
            bash.acquire_sandbox(AcquireOptions(request_id="rust-then-python", env={"GREETING": value, "B": "2"}))
    finally:
        sandbox.release("immediate")
    assert len(runs_of(server, "rust-then-python")) == 1
    purge(server, name)
