"""`bench_sdk.py`: the Python SDK against the Rust SDK, in the same run, on one real
`kruntimes up` (API server, controller-manager, local workers with the default
`namespaces` sandbox, the HTTPS gateway).

It starts `kruntimes up` (found through `$KRUNTIMES_BIN`, else next to `bench-sdk` in the
cargo target dir: build both in one profile) in a temporary data directory on ephemeral
ports, then, `--rounds` times (default 2), runs `bench-sdk` (the Rust SDK) and the same
measurements with the Python SDK (sync client, then async), one after the other:

- acquire: `--acquires` sandboxes (default 20) one at a time: `acquire_sandbox` until it
  returns Ready; each released (immediate, not timed) before the next.
- exec: `--execs` (default 500) commands `true` (argv) on one session, one at a time:
  `session.exec` until the completed event (20 warm-up calls first).
- invoke: `--invokes` (default 1000) warm invocations of `def handle(event): return event`
  (20 warm-up calls first).

Prints one JSON object: each SDK's milliseconds at p50/p95/p99/max (the samples of all
rounds pooled, in whole microseconds, the percentiles picked exactly as
`kruntimes_bench::percentile_of` picks them), the Python process's mean CPU time per exec
and per invoke (`time.process_time_ns`, both threads of the sync client) and the Python
overhead over Rust at p50 and p99.

    cargo build --release -p kruntimes -p kruntimes-runtime-server -p kruntimes-bench
    scripts/python-sdk.sh --co -q >/dev/null   # makes target/python-sdk-venv
    target/python-sdk-venv/bin/python bench/python/bench_sdk.py --profile release
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import kruntimes
from kruntimes import aio
from kruntimes.kubernetes import from_kube_config

REPO = Path(__file__).resolve().parents[2]
WARMUP = 20


def percentiles(samples_us: list[int]) -> dict[str, float]:
    """Milliseconds at p50/p95/p99/max, exactly as `kruntimes_bench::percentile_of`
    computes them: the sample at index round(p/100 * (n - 1)) of the sorted samples, with
    Rust's `f64::round` (half away from zero, where Python's `round` goes to even), 0 for
    no samples. Samples are whole microseconds on both sides (`Duration::as_micros`)."""
    values = sorted(samples_us)

    def at(p: float) -> float:
        if not values:
            return 0.0
        index = math.floor(p / 100 * (len(values) - 1) + 0.5)
        return values[min(index, len(values) - 1)] / 1e3

    return {"p50": at(50), "p95": at(95), "p99": at(99), "max": at(100)}


def mean_ms(samples_us: list[int]) -> float:
    """The mean of whole-microsecond samples, in milliseconds (0 for none)."""
    return round(sum(samples_us) / len(samples_us) / 1e3, 3) if samples_us else 0.0


def micros_since(started_ns: int) -> int:
    """Whole microseconds since `started_ns` (`time.perf_counter_ns`), truncated as
    `Duration::as_micros` truncates."""
    return (time.perf_counter_ns() - started_ns) // 1000


def start_server(binary: Path, tmp: Path) -> tuple[subprocess.Popen[str], Path]:
    process = subprocess.Popen(
        [
            str(binary),
            "up",
            "--data-dir",
            str(tmp / "data"),
            "--apiserver-addr",
            "127.0.0.1:0",
            "--gateway-addr",
            "127.0.0.1:0",
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "RUST_LOG": "warn"},
        start_new_session=True,
    )
    lines: queue.Queue[str | None] = queue.Queue()

    def drain() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.put(line.strip())
        lines.put(None)

    threading.Thread(target=drain, daemon=True).start()
    deadline = time.monotonic() + 120
    while True:
        line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
        if line is None:
            raise RuntimeError(f"kruntimes up exited with {process.wait()}")
        if line == "kruntimes ready":
            return process, tmp / "data" / "kubeconfig"


def python_sync(kubeconfig: Path, args: argparse.Namespace, samples: dict[str, list[int]]) -> None:
    with from_kube_config(kubeconfig) as client:
        bash = client.runtime("default", "bash")
        for _ in range(args.acquires):
            started = time.perf_counter_ns()
            sandbox = bash.acquire_sandbox()
            samples["acquire"].append(micros_since(started))
            sandbox.release("immediate")
        sandbox = bash.acquire_sandbox()
        with sandbox.open_session() as session:
            for i in range(args.execs + WARMUP):
                cpu = time.process_time_ns()
                started = time.perf_counter_ns()
                result = session.exec(["true"])
                elapsed = micros_since(started)
                cpu_us = (time.process_time_ns() - cpu) // 1000
                assert result.exit_code == 0, result
                if i >= WARMUP:
                    samples["exec"].append(elapsed)
                    samples["exec_cpu"].append(cpu_us)
        sandbox.release("immediate")
        fn = client.runtime("default", "python").create_function(
            "bench-sdk-python", source="def handle(event):\n    return event\n"
        )
        for i in range(args.invokes + WARMUP):
            payload = {"n": i}
            cpu = time.process_time_ns()
            started = time.perf_counter_ns()
            answer = fn.invoke(payload)
            elapsed = micros_since(started)
            cpu_us = (time.process_time_ns() - cpu) // 1000
            assert answer == payload, answer
            if i >= WARMUP:
                samples["invoke"].append(elapsed)
                samples["invoke_cpu"].append(cpu_us)
        fn.delete()


async def python_async(kubeconfig: Path, args: argparse.Namespace, samples: dict[str, list[int]]) -> None:
    async with aio.from_kube_config(kubeconfig) as client:
        bash = client.runtime("default", "bash")
        sandbox = await bash.acquire_sandbox()
        async with await sandbox.open_session() as session:
            for i in range(args.execs + WARMUP):
                cpu = time.process_time_ns()
                started = time.perf_counter_ns()
                result = await session.exec(["true"])
                elapsed = micros_since(started)
                cpu_us = (time.process_time_ns() - cpu) // 1000
                assert result.exit_code == 0, result
                if i >= WARMUP:
                    samples["exec"].append(elapsed)
                    samples["exec_cpu"].append(cpu_us)
        await sandbox.release("immediate")
        fn = await client.runtime("default", "python").create_function(
            "bench-sdk-python-async", source="def handle(event):\n    return event\n"
        )
        for i in range(args.invokes + WARMUP):
            payload = {"n": i}
            cpu = time.process_time_ns()
            started = time.perf_counter_ns()
            answer = await fn.invoke(payload)
            elapsed = micros_since(started)
            cpu_us = (time.process_time_ns() - cpu) // 1000
            assert answer == payload, answer
            if i >= WARMUP:
                samples["invoke"].append(elapsed)
                samples["invoke_cpu"].append(cpu_us)
        await fn.delete()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", default="release", help="the cargo profile of kruntimes and bench-sdk")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--acquires", type=int, default=20)
    parser.add_argument("--execs", type=int, default=500)
    parser.add_argument("--invokes", type=int, default=1000)
    args = parser.parse_args()
    target = Path(os.environ.get("CARGO_TARGET_DIR") or REPO / "target") / args.profile
    binary = Path(os.environ.get("KRUNTIMES_BIN") or target / "kruntimes")
    bench_sdk = target / "bench-sdk"
    tmp = Path(tempfile.mkdtemp(prefix="bench-sdk-"))
    process, kubeconfig = start_server(binary, tmp)
    rust: dict[str, list[int]] = {"acquire": [], "exec": [], "invoke": []}
    py_sync: dict[str, list[int]] = {"acquire": [], "exec": [], "invoke": [], "exec_cpu": [], "invoke_cpu": []}
    py_async: dict[str, list[int]] = {"acquire": [], "exec": [], "invoke": [], "exec_cpu": [], "invoke_cpu": []}
    try:
        for round_ in range(args.rounds):
            out = subprocess.run(
                [
                    str(bench_sdk),
                    "--kubeconfig",
                    str(kubeconfig),
                    "--acquires",
                    str(args.acquires),
                    "--execs",
                    str(args.execs),
                    "--invokes",
                    str(args.invokes),
                    "--function",
                    f"bench-sdk-rust-{round_}",
                    "--samples",
                ],
                capture_output=True,
                text=True,
                check=True,
                timeout=1800,
            )
            for key, values in json.loads(out.stdout)["samples_us"].items():
                rust[key] += [int(v) for v in values]
            python_sync(kubeconfig, args, py_sync)
            asyncio.run(python_async(kubeconfig, args, py_async))
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=60)
        shutil.rmtree(tmp, ignore_errors=True)

    report: dict[str, Any] = {
        "rounds": args.rounds,
        "acquires": args.acquires,
        "execs": args.execs,
        "invokes": args.invokes,
        "profile": args.profile,
        "python": sys.version.split()[0],
        "kruntimes_sdk": kruntimes.__version__,
        "rust": {
            "acquire_ms": percentiles(rust["acquire"]),
            "exec_true_ms": percentiles(rust["exec"]),
            "invoke_ms": percentiles(rust["invoke"]),
        },
        "python_sync": {
            "acquire_ms": percentiles(py_sync["acquire"]),
            "exec_true_ms": percentiles(py_sync["exec"]),
            "invoke_ms": percentiles(py_sync["invoke"]),
            "exec_cpu_ms_mean": mean_ms(py_sync["exec_cpu"]),
            "invoke_cpu_ms_mean": mean_ms(py_sync["invoke_cpu"]),
        },
        "python_async": {
            "exec_true_ms": percentiles(py_async["exec"]),
            "invoke_ms": percentiles(py_async["invoke"]),
            "exec_cpu_ms_mean": mean_ms(py_async["exec_cpu"]),
            "invoke_cpu_ms_mean": mean_ms(py_async["invoke_cpu"]),
        },
    }
    overhead: dict[str, Any] = {}
    for flavour in ("python_sync", "python_async"):
        for key in ("exec_true_ms", "invoke_ms"):
            for p in ("p50", "p99"):
                overhead[f"{flavour}.{key}.{p}"] = round(report[flavour][key][p] - report["rust"][key][p], 3)
    report["python_overhead_ms"] = overhead
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
