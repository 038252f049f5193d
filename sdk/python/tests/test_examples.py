"""The examples and the README's quick start run as written."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from .conftest import Server

SDK = Path(__file__).resolve().parents[1]


def run(server: Server, *args: str) -> str:
    out = subprocess.run(
        [sys.executable, *args],
        env={**os.environ, "KUBECONFIG": str(server.kubeconfig)},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_the_agent_tool_loop(server: Server) -> None:
    out = run(server, str(SDK / "examples" / "agent_tool_loop.py"))
    assert "step 1 done" in out and "5050" in out
    assert "exit code 1" in out and "this one fails on purpose" in out


def test_the_function_script(server: Server) -> None:
    out = run(server, str(SDK / "examples" / "call_function.py"))
    assert "{'words': 5, 'longest': 'quick'}" in out
    assert "the handler raised KeyError" in out


def test_the_readme_quick_start(server: Server) -> None:
    readme = (SDK / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", readme, re.S)
    assert code is not None
    assert "hello from the sandbox" in run(server, "-c", code.group(1))
