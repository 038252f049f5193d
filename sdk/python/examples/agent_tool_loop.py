"""An agent tool loop: a "model" writes code, a sandbox runs it, the output goes back.

The model is stubbed with a fixed list of code strings, so the loop runs as written against
`kruntimes up`; swap ``FakeModel`` for a real model client. Each turn's code runs in the
same sandbox, so files persist between turns (processes do not). A non-zero exit code is
fed back to the model like any other result.

    python examples/agent_tool_loop.py            # kubeconfig of `kruntimes up` in .kruntimes/
"""

from __future__ import annotations

import sys

from kruntimes import AcquireOptions, ExecResult
from kruntimes.kubernetes import from_kube_config


class FakeModel:
    """Stands in for a model: answers each observation with the next piece of code."""

    def __init__(self) -> None:
        self._turns = [
            "import platform; print('python', platform.python_version())",
            "open('notes.txt', 'w').write('step 1 done\\n'); print('wrote notes.txt')",
            "print(open('notes.txt').read().strip()); print(sum(range(101)))",
            "raise SystemExit('this one fails on purpose')",
        ]

    def next_code(self, observation: str) -> str | None:
        return self._turns.pop(0) if self._turns else None


def observe(result: ExecResult) -> str:
    """What the model is told about a run."""
    text = f"exit code {result.exit_code}"
    if result.timed_out:
        text += " (timed out)"
    return (
        f"{text}\nstdout:\n{result.stdout.decode(errors='replace')}\nstderr:\n{result.stderr.decode(errors='replace')}"
    )


def main() -> int:
    model = FakeModel()
    with from_kube_config(sys.argv[1] if len(sys.argv) > 1 else None) as client:
        runtime = client.runtime("default", "python")
        # A lease ends the sandbox if this script dies without releasing it.
        with runtime.acquire_sandbox(AcquireOptions(generate_name="agent-", lease_timeout_seconds=60)) as sandbox:
            observation = "start"
            while (code := model.next_code(observation)) is not None:
                sandbox.write_file("turn.py", code)
                result = sandbox.exec(["python3", "turn.py"], timeout=30)
                observation = observe(result)
                print(f">>> {code}\n{observation}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
