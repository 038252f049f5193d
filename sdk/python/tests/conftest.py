"""One real ``kruntimes up`` per test session: the built binary from the cargo target dir,
on ``127.0.0.1:0`` addresses, in a temporary data directory; stopped (its whole process
group) at the end. No part of kruntimes is mocked."""

from __future__ import annotations

import contextlib
import os
import queue
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import kruntimes
from kruntimes.kubernetes import from_kube_config

REPO = Path(__file__).resolve().parents[3]
START_DEADLINE = 120.0


def kruntimes_bin() -> Path:
    """``$KRUNTIMES_BIN``, else ``kruntimes`` in the cargo target dir (``$CARGO_TARGET_DIR``
    or the repository's ``target/``), debug build first."""
    if os.environ.get("KRUNTIMES_BIN"):
        return Path(os.environ["KRUNTIMES_BIN"])
    target = Path(os.environ.get("CARGO_TARGET_DIR") or REPO / "target")
    for profile in ("debug", "release"):
        candidate = target / profile / "kruntimes"
        if candidate.is_file():
            return candidate
    raise RuntimeError(f"no kruntimes binary under {target}: run `cargo build --workspace --bins` first")


def krt_bin() -> Path:
    """``$KRT_BIN``, else ``krt`` beside the ``kruntimes`` binary the tests start."""
    if os.environ.get("KRT_BIN"):
        return Path(os.environ["KRT_BIN"])
    return kruntimes_bin().parent / "krt"


@dataclass
class Server:
    """A running ``kruntimes up``."""

    process: subprocess.Popen[str]
    data_dir: Path
    kubeconfig: Path
    gateway_url: str

    def kubectl(self, *args: str, stdin: str | None = None) -> str:
        """The real kubectl against this server."""
        home = self.data_dir.parent / "home"
        home.mkdir(exist_ok=True)
        out = subprocess.run(
            [os.environ.get("KUBECTL", "/usr/bin/kubectl"), *args],
            env={**os.environ, "KUBECONFIG": str(self.kubeconfig), "HOME": str(home)},
            input=stdin,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        return out.stdout

    def krt(self, *args: str) -> str:
        """The real ``krt`` (the Rust SDK's CLI) against this server; its stdout."""
        home = self.data_dir.parent / "home"
        home.mkdir(exist_ok=True)
        out = subprocess.run(
            [str(krt_bin()), *args],
            env={**os.environ, "KUBECONFIG": str(self.kubeconfig), "HOME": str(home)},
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 0, f"krt {' '.join(args)} exited {out.returncode}: {out.stderr}"
        return out.stdout


@pytest.fixture(scope="session")
def server() -> Iterator[Server]:
    tmp = Path(tempfile.mkdtemp(prefix="kruntimes-py-"))
    data_dir = tmp / "data"
    process = subprocess.Popen(
        [
            str(kruntimes_bin()),
            "up",
            "--data-dir",
            str(data_dir),
            "--apiserver-addr",
            "127.0.0.1:0",
            "--gateway-addr",
            "127.0.0.1:0",
            # Sandboxes hold a worker each; a few tests hold two at once.
            "--default-min-replicas",
            "3",
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL if not os.environ.get("KRUNTIMES_TEST_LOGS") else None,
        text=True,
        env={**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "warn")},
        start_new_session=True,  # its own process group: stopped whole at the end
    )
    lines: queue.Queue[str | None] = queue.Queue()

    def drain() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=drain, daemon=True).start()
    gateway = ""
    seen: list[str] = []
    deadline = time.monotonic() + START_DEADLINE
    try:
        while True:
            left = deadline - time.monotonic()
            try:
                line = lines.get(timeout=max(0.0, left))
            except queue.Empty:
                raise RuntimeError("kruntimes up did not become ready; it printed:\n" + "\n".join(seen)) from None
            if line is None:
                raise RuntimeError(f"kruntimes up exited ({process.wait()}); it printed:\n" + "\n".join(seen))
            seen.append(line)
            if line.startswith("gateway ready at "):
                gateway = line.removeprefix("gateway ready at ").strip()
            if line.strip() == "kruntimes ready":
                break
        yield Server(process, data_dir, data_dir / "kubeconfig", gateway)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        if not os.environ.get("KRUNTIMES_KEEP_TEST_DATA"):
            shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="session")
def client(server: Server) -> Iterator[kruntimes.Client]:
    with from_kube_config(server.kubeconfig) as c:
        yield c


@pytest.fixture(scope="session")
def bash(client: kruntimes.Client) -> kruntimes.Runtime:
    return client.runtime("default", "bash")


@pytest.fixture(scope="session")
def python(client: kruntimes.Client) -> kruntimes.Runtime:
    return client.runtime("default", "python")


@pytest.fixture(scope="session")
def sandbox(bash: kruntimes.Runtime) -> Iterator[kruntimes.Sandbox]:
    """One sandbox shared by the tests that do not end it."""
    sb = bash.acquire_sandbox(kruntimes.AcquireOptions(generate_name="shared-"))
    yield sb
    sb.release("immediate")
