"""The acceptance list of issue 18 through the async twin (:mod:`kruntimes.aio`), where
``test_async.py`` does not already cover it: ordering over 50 operations with exit codes,
stdin, cwd and env; both release modes; lease expiry; task outputs, timeout and log
follow; 429 on overlapping invocations and the invoke of a deleted function; the error
mapping."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

import kruntimes
from kruntimes import AcquireOptions, Command, Operation
from kruntimes.aio import AsyncClient, from_kube_config

from .conftest import Server


@pytest_asyncio.fixture
async def aclient(server: Server) -> AsyncIterator[AsyncClient]:
    async with from_kube_config(server.kubeconfig) as client:
        yield client


@pytest.mark.asyncio
async def test_async_fifty_operations_report_in_order_with_their_exit_codes(aclient: AsyncClient) -> None:
    runtime = aclient.runtime("default", "bash")
    async with await runtime.acquire_sandbox(AcquireOptions(generate_name="async-fifty-")) as sb:
        async with await sb.open_session() as session:
            ids: list[str] = []
            events: list[kruntimes.Event] = []
            # Two batches of 25: a session queues at most 32 operations.
            for batch in range(2):
                sent = [
                    await session.send(Operation(command=Command(shell=f"echo {i}; exit {i % 4}")))
                    for i in range(batch * 25, batch * 25 + 25)
                ]
                ids += sent
                done = 0
                while done < len(sent):
                    event = await session.receive(timeout=60)
                    events.append(event)
                    done += event.type == "completed"
            assert len(set(ids)) == 50
            # Each operation's events arrive in its own order; across operations `sequence`
            # is the order the owner produced them in (the connection may interleave them).
            for op in ids:
                own = [e for e in events if e.operation_id == op]
                assert [e.type for e in own] == ["accepted", "started", "output", "completed"], own
                assert [e.sequence for e in own] == sorted(e.sequence for e in own)
            by_sequence = sorted(events, key=lambda e: e.sequence)
            completed = [(e.operation_id, e.exit_code) for e in by_sequence if e.type == "completed"]
            assert completed == [(op, i % 4) for i, op in enumerate(ids)]
            outputs = [e.data for e in by_sequence if e.type == "output"]
            assert outputs == [f"{i}\n".encode() for i in range(50)]
        await sb.make_directory("sub/dir")
        result = await sb.exec(
            ["sh", "-c", 'pwd; echo "$GREETING"; cat; exit 7'], cwd="sub/dir", env={"GREETING": "hi"}, stdin="piped"
        )
        assert result.exit_code == 7 and not result.timed_out
        lines = result.stdout.decode().splitlines()
        assert lines[0].endswith("/sub/dir") and lines[1:] == ["hi", "piped"]
        failing = await sb.exec(["sh", "-c", "echo oops >&2; exit 1"])
        assert (failing.exit_code, failing.stderr) == (1, b"oops\n")


@pytest.mark.asyncio
async def test_async_release_drains_or_cancels(aclient: AsyncClient) -> None:
    runtime = aclient.runtime("bash")
    drained = await runtime.acquire_sandbox(generate_name="async-drain-")
    session = await drained.open_session()
    op = await session.send(Operation(command=Command(shell="sleep 1; echo drained")))
    assert await drained.release("drain") == "Succeeded"
    output = b""
    while not (event := await session.receive(timeout=30)).is_final:
        if event.type == "output":
            output += event.data
    assert (event.operation_id, event.state, output) == (op, "Succeeded", b"drained\n")
    await session.close()
    with pytest.raises(kruntimes.NotFound):
        await aclient.open(drained.name)

    cancelled = await runtime.acquire_sandbox(generate_name="async-immediate-")
    session = await cancelled.open_session()
    long = await session.send(Operation(command=Command(argv=["sleep", "120"])))
    assert await cancelled.release("immediate") == "Cancelled"
    while not (event := await session.receive(timeout=60)).is_final:
        pass
    assert (event.operation_id, event.state) == (long, "Cancelled")
    await session.close()


@pytest.mark.asyncio
async def test_async_a_lease_without_heartbeats_expires(aclient: AsyncClient) -> None:
    sb = await aclient.runtime("bash").acquire_sandbox(generate_name="async-lapsed-", lease_timeout_seconds=2)
    try:
        assert await sb.wait_ended(timeout=60) == "Timeout"
        with pytest.raises(kruntimes.SandboxStateError) as error:
            await sb.exec(["true"])
        assert (error.value.phase, error.value.run_reason) == ("Timeout", "LeaseExpired")
    finally:
        await sb.release("immediate")


@pytest.mark.asyncio
async def test_async_tasks_report_outputs_time_out_and_follow_their_logs(aclient: AsyncClient) -> None:
    bash = aclient.runtime("bash")
    task = await bash.run(["sh", "-c", 'echo out; echo err >&2; echo ANSWER=42 >> "$KRUNTIME_OUTPUTS"'])
    result = await task.wait(timeout=120)
    assert (result.phase, result.exit_code, result.outputs) == ("Succeeded", 0, {"ANSWER": "42"})
    assert (result.stdout, result.stderr) == (b"out\n", b"err\n")
    await task.delete()

    slow = await bash.run(["sleep", "60"], timeout=1)
    assert (await slow.wait(timeout=120)).phase == "Timeout"
    await slow.delete()

    running = await bash.run(["sh", "-c", "echo first; for i in $(seq 1 300); do sleep 0.1; echo tick; done"])
    received = b""
    async for chunk in running.logs("stdout", follow=True):
        received += chunk
        if b"first\n" in received:
            break
    assert await running.phase() == "Running"
    await running.cancel()
    assert (await running.wait(timeout=60)).phase == "Cancelled"
    await running.delete()

    finished = await bash.run(["sh", "-c", "for i in 1 2 3; do echo line $i; sleep 0.2; done"])
    assert b"".join([c async for c in finished.logs(follow=True)]) == b"line 1\nline 2\nline 3\n"
    await finished.delete()


HANDLER = """
import time

def handle(event):
    time.sleep(event.get("sleep", 0))
    return event
"""


@pytest.mark.asyncio
async def test_async_overlapping_invocations_get_429_and_a_deleted_function_is_gone(aclient: AsyncClient) -> None:
    python = aclient.runtime("default", "python")
    fn = await python.create_function("async-overlap", source=HANDLER)
    with pytest.raises(kruntimes.Conflict):
        await python.create_function("async-overlap", source=HANDLER)
    # Both are sent while the handler sleeps 3 s: one at a time, never queued.
    results = await asyncio.gather(
        fn.invoke({"sleep": 3, "n": 1}), fn.invoke({"sleep": 3, "n": 2}), return_exceptions=True
    )
    refused = [r for r in results if isinstance(r, kruntimes.TooManyRequests)]
    assert len(refused) == 1 and refused[0].status == 429, results
    assert refused[0].retry_after == 1.0, "the gateway says when to try again"
    assert next(r for r in results if isinstance(r, dict))["sleep"] == 3
    assert await fn.invoke({"n": 3}) == {"n": 3}
    await fn.delete()
    with pytest.raises((kruntimes.NotFound, kruntimes.Unavailable)) as gone:
        await fn.invoke({})
    assert gone.value.status in (404, 503)
    with pytest.raises(kruntimes.NotFound):
        await aclient.function("default", "async-overlap")
    with pytest.raises(kruntimes.NotFound):
        await aclient.open("default", "no-such-sandbox")
