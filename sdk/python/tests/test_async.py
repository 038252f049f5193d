"""The async twin (:mod:`kruntimes.aio`), against the same ``kruntimes up``."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

import kruntimes
from kruntimes import AcquireOptions, Command, ListFilesOptions, Operation
from kruntimes.aio import AsyncClient, from_kube_config

from .conftest import Server


@pytest_asyncio.fixture
async def aclient(server: Server) -> AsyncIterator[AsyncClient]:
    async with from_kube_config(server.kubeconfig) as client:
        yield client


@pytest.mark.asyncio
async def test_async_sandbox_orders_exec_files_cancel_and_release(aclient: AsyncClient) -> None:
    runtime = aclient.runtime("default", "bash")
    async with await runtime.acquire_sandbox(AcquireOptions(generate_name="async-", lease_timeout_seconds=30)) as sb:
        result = await sb.exec(["sh", "-c", "cat; exit 4"], stdin=b"in")
        assert (result.exit_code, result.stdout) == (4, b"in")
        async with await sb.open_session() as session:
            ids = [await session.send(Operation(command=Command(argv=["echo", str(i)]))) for i in range(20)]
            outputs: list[bytes] = []
            completed: list[str] = []
            async for event in session:
                if event.type == "output":
                    outputs.append(event.data)
                if event.type == "completed":
                    completed.append(event.operation_id)
                    if len(completed) == len(ids):
                        break
            assert completed == ids and outputs == [f"{i}\n".encode() for i in range(20)]
            long = await session.send(Operation(command=Command(argv=["sleep", "60"])))
            while (await session.receive(timeout=30)).type != "started":
                pass
            assert await session.cancel(long)
            while not (event := await session.receive(timeout=30)).is_final:
                pass
            assert event.state == "Cancelled"
        await sb.write_file("dir/a.txt", "A")
        await sb.exec(shell="cd dir && seq -f 'n%04g' 1 1100 | xargs touch")
        entries = [e async for e in sb.iter_files("dir")]
        assert len(entries) == 1101 and entries[0].path == "dir/a.txt"
        page = await sb.list_files(ListFilesOptions(directory="dir", limit=1000))
        assert len(page.entries) == 1000 and page.next_page_token
        assert await sb.read_file("dir/a.txt") == b"A"
        timed = await sb.exec(["sleep", "30"], timeout=1)
        assert timed.timed_out
        name = sb.name
    with pytest.raises(kruntimes.NotFound):
        await aclient.open(name)


@pytest.mark.asyncio
async def test_async_sessions_run_concurrently_on_one_sandbox(aclient: AsyncClient) -> None:
    runtime = aclient.runtime("bash")
    sb = await runtime.acquire_sandbox(generate_name="async-conc-")
    try:
        results = await asyncio.gather(*(sb.exec(["echo", str(i)]) for i in range(10)))
        assert [r.stdout for r in results] == [f"{i}\n".encode() for i in range(10)]
        assert (await sb.status()).phase == "Ready"
    finally:
        assert await sb.release("immediate") == "Cancelled"


@pytest.mark.asyncio
async def test_async_tasks_and_functions(aclient: AsyncClient) -> None:
    task = await aclient.runtime("bash").run(["sh", "-c", "echo hi; exit 2"])
    result = await task.wait(timeout=120)
    assert (result.phase, result.exit_code, result.stdout) == ("Failed", 2, b"hi\n")
    await task.delete()
    python = aclient.runtime("default", "python")
    fn = await python.create_function("async-fn", source="def handle(e):\n    return {'n': e['n'] * 2}\n")
    try:
        assert await fn.invoke({"n": 21}) == {"n": 42}
        with pytest.raises(kruntimes.InvocationError) as error:
            await fn.invoke({})
        assert error.value.error_type == "KeyError"
    finally:
        await fn.delete()
