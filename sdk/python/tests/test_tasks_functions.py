"""Tasks and functions through the sync client, against the real ``kruntimes up``."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

import kruntimes


def test_a_task_reports_its_outputs_and_logs(bash: kruntimes.Runtime) -> None:
    task = bash.run(["sh", "-c", 'echo out; echo err >&2; echo ANSWER=42 >> "$KRUNTIME_OUTPUTS"'], env={"X": "1"})
    result = task.wait(timeout=120)
    assert (result.phase, result.exit_code, result.outputs) == ("Succeeded", 0, {"ANSWER": "42"})
    assert (result.stdout, result.stderr) == (b"out\n", b"err\n")
    assert result.succeeded
    task.delete()


def test_a_failing_task_is_a_result(python: kruntimes.Runtime) -> None:
    task = python.run(source="import sys\nprint('about to fail')\nsys.exit(3)\n")
    result = task.wait(timeout=120)
    assert (result.phase, result.exit_code, result.stdout) == ("Failed", 3, b"about to fail\n")
    task.delete()


def test_a_task_past_its_timeout_ends_timeout(bash: kruntimes.Runtime) -> None:
    task = bash.run(["sleep", "60"], timeout=1)
    result = task.wait(timeout=120)
    assert result.phase == "Timeout"
    task.delete()


def test_log_follow_streams_until_the_task_ends(bash: kruntimes.Runtime) -> None:
    # The task prints its first line and runs on for 30 s: the stream is read while it runs.
    task = bash.run(["sh", "-c", "echo first; for i in $(seq 1 300); do sleep 0.1; echo tick; done; echo last"])
    chunks = task.logs("stdout", follow=True)
    received = b""
    for chunk in chunks:
        received += chunk
        if b"first\n" in received:
            break
    assert task.phase() == "Running"
    task.cancel()
    assert task.wait(timeout=60).phase == "Cancelled"
    task.delete()
    finished = bash.run(["sh", "-c", "for i in 1 2 3; do echo line $i; sleep 0.2; done"])
    assert b"".join(finished.logs(follow=True)) == b"line 1\nline 2\nline 3\n"
    finished.delete()


def test_bad_tasks_are_refused_before_sending(bash: kruntimes.Runtime) -> None:
    with pytest.raises(kruntimes.InvalidRequest):
        bash.run()
    with pytest.raises(kruntimes.InvalidRequest):
        bash.run(["/bin/sh"])
    with pytest.raises(kruntimes.InvalidRequest):
        bash.run(["true"], env={"1BAD": "x"})


HANDLER = """
import time

def handle(event):
    if event.get("fail"):
        return 1 / 0
    if event.get("sleep"):
        time.sleep(event["sleep"])
    print("seen", event.get("name"))
    return {"hello": event.get("name", "world")}
"""


@pytest.fixture(scope="module")
def greeter(python: kruntimes.Runtime) -> Iterator[kruntimes.Function]:
    fn = python.create_function("greeter", source=HANDLER, handler="main:handle", idle_timeout=600)
    yield fn
    fn.delete()


def test_invoke_returns_the_handlers_result(greeter: kruntimes.Function) -> None:
    assert greeter.invoke({"name": "python"}) == {"hello": "python"}
    answer = greeter.call({"name": "x"}, invocation_id="call-1")
    assert (answer.invocation_id, answer.outcome, answer.result) == ("call-1", "Succeeded", {"hello": "x"})
    assert answer.stdout == "seen x\n" and answer.served_by


def test_a_handler_error_carries_its_traceback(greeter: kruntimes.Function) -> None:
    with pytest.raises(kruntimes.InvocationError) as error:
        greeter.invoke({"fail": True}, invocation_id="boom")
    assert error.value.error_type == "ZeroDivisionError"
    assert "1 / 0" in error.value.traceback and error.value.invocation_id == "boom"


def invoke_at_once(fn: kruntimes.Function, count: int) -> list[object]:
    """Sends `count` invocations at once, each sleeping 3 s in the handler; returns their
    answers and TooManyRequests errors."""
    results: list[object] = []

    def call(payload: dict[str, object]) -> None:
        try:
            results.append(fn.invoke(payload))
        except kruntimes.TooManyRequests as e:
            results.append(e)

    threads = [threading.Thread(target=call, args=({"sleep": 3, "name": str(i)},)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_overlapping_invocations_get_429(greeter: kruntimes.Function) -> None:
    # Both are sent while the handler sleeps 3 s: one at a time, never queued.
    results = invoke_at_once(greeter, 2)
    refused = [r for r in results if isinstance(r, kruntimes.TooManyRequests)]
    assert len(refused) == 1 and refused[0].status == 429, results
    assert refused[0].retry_after == 1.0, "the gateway says when to try again"
    assert greeter.invoke({"name": "after"}) == {"hello": "after"}


def test_a_function_runs_its_concurrency_at_once(python: kruntimes.Runtime) -> None:
    with pytest.raises(kruntimes.InvalidRequest):
        python.create_function("too-many", source=HANDLER, concurrency=65)
    fn = python.create_function("pair", source=HANDLER, concurrency=2)
    try:
        # Three are sent while the handler sleeps 3 s: two run at once, each in its own
        # interpreter; the third is refused, never queued.
        results = invoke_at_once(fn, 3)
        refused = [r for r in results if isinstance(r, kruntimes.TooManyRequests)]
        answered = [r for r in results if isinstance(r, dict)]
        assert len(refused) == 1 and refused[0].status == 429, results
        assert len(answered) == 2, results
    finally:
        fn.delete()


def test_functions_that_fail_or_are_gone(python: kruntimes.Runtime, client: kruntimes.Client) -> None:
    fn = python.create_function("short-lived", source="def handle(e):\n    return e\n")
    assert fn.invoke([1, 2]) == [1, 2]
    with pytest.raises(kruntimes.Conflict):
        python.create_function("short-lived", source="def handle(e):\n    return e\n")
    fn.delete()
    with pytest.raises((kruntimes.NotFound, kruntimes.Unavailable)) as gone:
        fn.invoke({})
    assert gone.value.status in (404, 503)
    with pytest.raises(kruntimes.NotFound):
        client.function("default", "short-lived")
    with pytest.raises(kruntimes.RunStateError) as broken:
        python.create_function("broken", source="import no_such_module\n", max_attempts=1)
    assert broken.value.phase == "Failed"
    client.task("default", "broken").delete()
    with pytest.raises(kruntimes.InvalidRequest):
        fn.invoke({}, invocation_id="")
