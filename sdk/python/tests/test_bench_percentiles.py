"""The SDK benchmark (``bench/python/bench_sdk.py``) picks percentiles exactly as the Rust
side (``kruntimes_bench::percentile_of``) does, so the two columns compare."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[3] / "bench" / "python" / "bench_sdk.py"


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_sdk", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_percentiles_take_the_nearest_rank_rounding_half_away_from_zero() -> None:
    percentiles = _bench().percentiles
    # The Rust unit test's case: 1..=100 ms in reverse.
    hundred = percentiles([ms * 1000 for ms in range(100, 0, -1)])
    assert (hundred["p50"], hundred["p99"], hundred["max"]) == (51.0, 99.0, 100.0)
    # Index 0.5 rounds up as f64::round does (Python's round would give 0, the lower one).
    assert percentiles([1000, 3000])["p50"] == 3.0
    # Index 2.5 (six samples): 3, not round()'s 2.
    assert percentiles([0, 1000, 2000, 3000, 4000, 5000])["p50"] == 3.0
    assert percentiles([]) == {"p50": 0.0, "p95": 0.0, "p99": 0.0, "max": 0.0}
