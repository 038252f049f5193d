"""Sandboxes through the sync client, against the real ``kruntimes up``."""

from __future__ import annotations

import time

import pytest

import kruntimes
from kruntimes import AcquireOptions, Command, ListFilesOptions, Operation


def test_fifty_operations_run_and_report_in_the_order_sent(sandbox: kruntimes.Sandbox) -> None:
    with sandbox.open_session() as session:
        sent: list[str] = []
        events: list[kruntimes.Event] = []
        # Two batches of 25: a session queues at most 32 operations.
        for batch in range(2):
            ids = [
                session.send(Operation(command=Command(shell=f"echo {i} >> order.log; echo {i}")))
                for i in range(batch * 25, batch * 25 + 25)
            ]
            sent += ids
            done = 0
            while done < len(ids):
                event = session.receive(timeout=60)
                events.append(event)
                done += event.type == "completed"
    # Events of different operations may interleave slightly on the connection (separate
    # streams, docs/session-mode.md); `sequence` is the order the owner produced them in.
    by_sequence = sorted(events, key=lambda e: e.sequence)
    assert [e.sequence for e in by_sequence] == list(range(by_sequence[0].sequence, by_sequence[0].sequence + 200))
    completed = [e.operation_id for e in by_sequence if e.type == "completed"]
    assert completed == sent
    assert all(e.state == "Succeeded" for e in events if e.type == "completed")
    # Each operation's events come in its own order.
    for op in sent:
        kinds = [e.type for e in events if e.operation_id == op]
        assert kinds == ["accepted", "started", "output", "completed"], kinds
    outputs = [e.data for e in by_sequence if e.type == "output"]
    assert outputs == [f"{i}\n".encode() for i in range(50)]
    assert sandbox.read_file("order.log") == b"".join(f"{i}\n".encode() for i in range(50))


def test_exit_codes_stdin_cwd_and_env(sandbox: kruntimes.Sandbox) -> None:
    failed = sandbox.exec(["sh", "-c", "echo out; echo err >&2; exit 7"])
    assert (failed.exit_code, failed.stdout, failed.stderr, failed.state) == (7, b"out\n", b"err\n", "Failed")
    assert not failed.timed_out and not failed.ok
    assert sandbox.exec(["true"]).exit_code == 0
    assert sandbox.exec(["cat"], stdin=b"\x00binary\xff").stdout == b"\x00binary\xff"
    assert sandbox.exec(shell="tr a-z A-Z", stdin="shout").stdout == b"SHOUT"
    sandbox.make_directory("work/dir")
    assert sandbox.exec(["pwd"], cwd="work/dir").stdout.decode().rstrip().endswith("/work/dir")
    assert sandbox.exec(shell="echo $GREETING", env={"GREETING": "hello"}).stdout == b"hello\n"
    missing = sandbox.exec(["no-such-program-here"])
    assert missing.exit_code != 0


def test_acquire_options_reach_the_run(bash: kruntimes.Runtime) -> None:
    options = AcquireOptions(
        generate_name="opts-", env={"FROM_RUN": "yes"}, labels={"team": "sdk"}, queue_size=4, operation_timeout=30
    )
    with bash.acquire_sandbox(options) as sb:
        assert sb.name.startswith("opts-")
        assert sb.run()["metadata"]["labels"]["team"] == "sdk"
        assert sb.exec(shell="echo $FROM_RUN").stdout == b"yes\n"
        status = sb.status()
        assert (status.queue_size, status.operation_timeout_seconds, status.phase) == (4, 30, "Ready")
        assert status.run_uid == sb.uid


def test_cancel_ends_a_running_operation(sandbox: kruntimes.Sandbox) -> None:
    with sandbox.open_session() as session:
        with pytest.raises(TimeoutError):
            session.receive(timeout=0.2)  # nothing was sent on this connection
        op = session.send(Operation(command=Command(argv=["sleep", "60"])))
        while (event := session.receive(timeout=30)).type != "started":
            pass
        assert session.cancel(op)
        while not (event := session.receive(timeout=30)).is_final:
            pass
        assert (event.operation_id, event.type, event.state) == (op, "completed", "Cancelled")
        # The session goes on after a cancel.
        assert session.exec(["echo", "after"]).stdout == b"after\n"


def test_a_command_past_its_timeout_is_a_timed_out_result(sandbox: kruntimes.Sandbox) -> None:
    started = time.monotonic()
    result = sandbox.exec(["sleep", "30"], timeout=1)
    assert result.timed_out and result.state == "TimedOut"
    assert result.exit_code is None
    assert time.monotonic() - started < 20


def test_files_write_read_and_list_past_a_thousand_entries(sandbox: kruntimes.Sandbox) -> None:
    sandbox.write_file("files/data.bin", bytes(range(256)) * 4, executable=False)
    assert sandbox.read_file("files/data.bin") == bytes(range(256)) * 4
    sandbox.write_file("files/run.sh", "#!/bin/sh\necho ran\n", executable=True)
    assert sandbox.exec(["./files/run.sh"]).stdout == b"ran\n"
    result = sandbox.exec(shell="mkdir many && cd many && seq -f 'f%04g' 1 1203 | xargs touch")
    assert result.exit_code == 0, result.stderr
    first = sandbox.list_files(ListFilesOptions(directory="many", limit=1000))
    assert len(first.entries) == 1000 and first.next_page_token
    second = sandbox.list_files(ListFilesOptions(directory="many", limit=1000, page_token=first.next_page_token))
    assert len(second.entries) == 203 and not second.next_page_token
    names = [e.path for e in first.entries + second.entries]
    assert names == [f"many/f{i:04d}" for i in range(1, 1204)]
    assert [e.path for e in sandbox.iter_files("many", limit=500)] == names
    assert [len(p.entries) for p in sandbox.iter_file_pages("many", limit=500)] == [500, 500, 203]
    default = sandbox.list_files(ListFilesOptions(directory="many"))
    assert len(default.entries) == 100  # the server's default page
    sandbox.rename("files/data.bin", "files/moved.bin")
    sandbox.delete("files/moved.bin")
    with pytest.raises(kruntimes.NotFound):
        sandbox.read_file("files/moved.bin")
    with pytest.raises(kruntimes.InvalidRequest):
        sandbox.read_file("../outside")
    with pytest.raises(kruntimes.InvalidRequest):
        sandbox.read_file("files")  # a directory
    with pytest.raises(kruntimes.InvalidRequest):
        sandbox.list_files(ListFilesOptions(limit=1001))
    with pytest.raises(kruntimes.InvalidRequest):
        sandbox.list_files(ListFilesOptions(directory="many", page_token="not-a-token"))
    with pytest.raises(kruntimes.InvalidRequest):
        sandbox.write_file("big", b"x" * (1024 * 1024 + 1))


def test_release_drain_finishes_accepted_work(bash: kruntimes.Runtime, client: kruntimes.Client) -> None:
    sb = bash.acquire_sandbox(generate_name="drain-")
    session = sb.open_session()
    op = session.send(Operation(command=Command(shell="sleep 1; echo drained")))
    assert sb.release("drain") == "Succeeded"
    # The accepted operation ran to its end before the sandbox closed.
    output = b""
    while not (event := session.receive(timeout=30)).is_final:
        if event.type == "output":
            output += event.data
    assert (event.operation_id, event.state, output) == (op, "Succeeded", b"drained\n")
    session.close()
    with pytest.raises(kruntimes.NotFound):
        client.open("default", sb.name)
    assert sb.release() is None  # already gone: nothing to do


def test_release_immediate_cancels_running_work(bash: kruntimes.Runtime) -> None:
    sb = bash.acquire_sandbox(generate_name="immediate-")
    session = sb.open_session()
    session.send(Operation(command=Command(argv=["sleep", "120"])))
    started = time.monotonic()
    assert sb.release("immediate") == "Cancelled"
    assert time.monotonic() - started < 60
    session.close()
    with pytest.raises(kruntimes.InvalidRequest):
        sb.release("later")  # type: ignore[arg-type]


def test_a_context_manager_releases_the_sandbox(bash: kruntimes.Runtime, client: kruntimes.Client) -> None:
    with pytest.raises(RuntimeError), bash.acquire_sandbox(generate_name="ctx-") as sb:
        name = sb.name
        raise RuntimeError("the agent crashed")
    with pytest.raises(kruntimes.NotFound):
        client.open(name)


def test_the_lease_expires_without_heartbeats_and_holds_with_a_session(bash: kruntimes.Runtime) -> None:
    # `held` is acquired last, so its session opens within its lease on a slow machine.
    lapsed = bash.acquire_sandbox(generate_name="lapsed-", lease_timeout_seconds=2)
    held = bash.acquire_sandbox(generate_name="held-", lease_timeout_seconds=2)
    try:
        with held.open_session() as session:
            # Time passing is what is tested here: 3 leases with no call but heartbeats.
            assert lapsed.wait_ended(timeout=60) == "Timeout"
            time.sleep(4)
            assert session.exec(["echo", "alive"]).stdout == b"alive\n"
        with pytest.raises(kruntimes.SandboxStateError) as error:
            lapsed.exec(["true"])
        assert (error.value.phase, error.value.run_reason) == ("Timeout", "LeaseExpired")
        assert held.renew().lease_timeout_seconds == 2
    finally:
        held.release("immediate")
        lapsed.release("immediate")


def test_a_full_queue_and_a_repeated_id_are_refused(bash: kruntimes.Runtime) -> None:
    with bash.acquire_sandbox(generate_name="queue-", queue_size=1) as sb, sb.open_session() as session:
        first = session.send(Operation(command=Command(argv=["sleep", "60"]), operation_id="long"))
        while session.receive(timeout=30).type != "started":
            pass
        with pytest.raises(kruntimes.Conflict):
            session.send(Operation(command=Command(argv=["true"]), operation_id="long"))
        session.send(Operation(command=Command(argv=["true"])))
        with pytest.raises(kruntimes.TooManyRequests) as full:
            session.send(Operation(command=Command(argv=["true"])))
        assert full.value.status == 429
        session.cancel(first)


def test_state_errors_name_the_phase(client: kruntimes.Client, bash: kruntimes.Runtime) -> None:
    with pytest.raises(kruntimes.NotFound):
        client.open("default", "no-such-sandbox")
    task = bash.run(["true"])
    with pytest.raises(kruntimes.SandboxStateError, match="not a sandbox"):
        client.open("default", task.name)
    task.delete()
    sb = bash.acquire_sandbox(generate_name="ended-")
    sb.release("immediate")
    with pytest.raises(kruntimes.SandboxStateError) as gone:
        sb.exec(["true"])
    assert gone.value.phase == "Deleted"
    with pytest.raises(kruntimes.InvalidRequest):
        bash.acquire_sandbox(queue_size=99)
    with pytest.raises(kruntimes.InvalidRequest):
        bash.acquire_sandbox(env={"KRUNTIME_X": "reserved"})
