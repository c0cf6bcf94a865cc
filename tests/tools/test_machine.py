"""`attngrad.tools.machine`: the header every figure carries, and a calibration bounded by time."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from attngrad.tools.machine import (
    BUSY,
    BUSY_NOTE,
    MAX_GEMM_SIZE,
    Machine,
    gemm_rate,
    probe,
    processor_name,
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_calibration_stops_at_a_size_the_budget_allows(dtype: torch.dtype) -> None:
    notes: list[str] = []
    size, gflops = gemm_rate(dtype, budget=0.005, note=notes.append)
    assert math.isfinite(gflops) and gflops > 0
    assert 64 <= size <= MAX_GEMM_SIZE and size % 64 == 0
    # one note per size tried, the last one the size it settled on
    assert notes and notes[-1].startswith(f"GEMM {size}² {str(dtype).removeprefix('torch.')}: ")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"budget": 0.0}, "budget must be a positive"),
        ({"repeats": 1}, "repeats must be at least 2"),
    ],
    ids=["no-budget", "one-repeat"],
)
def test_gemm_rate_rejects_bad_arguments(kwargs: dict[str, float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        gemm_rate(**kwargs)  # type: ignore[arg-type]


def test_probe_names_the_processor_and_threads() -> None:
    machine = probe(torch.float32, budget=0.005)
    assert machine.processor == processor_name() and machine.processor
    assert machine.threads == torch.get_num_threads()
    assert machine.gemm_dtype == "float32"


def test_line_and_columns_say_the_same() -> None:
    machine = Machine("AMD EPYC", 2, "float16", 512, 1.25)
    assert machine.line() == "machine: AMD EPYC, 2 threads, float16 GEMM 512² 1.2 GFLOP/s"
    assert machine.columns() == {
        "machine": "AMD EPYC",
        "threads": 2,
        "gemm_dtype": "float16",
        "gemm_size": 512,
        "gemm_gflops": "1.25",
        "tile_gflops": "",
        "fma_peak_gflops": "",
        "capability": machine.capability,
    }


def test_the_ceiling_is_the_tile_products_rate_where_measured() -> None:
    machine = Machine("AMD EPYC", 2, "float32", 512, 120.0, tile_gflops=210.0)
    assert machine.ceiling_gflops == 210.0
    assert machine.line().endswith("tile products 210.0 GFLOP/s (2 x one thread's)")
    assert machine.columns()["tile_gflops"] == "210"
    assert Machine("AMD EPYC", 2, "float32", 512, 120.0).ceiling_gflops == 120.0


def test_probe_measures_the_tile_products_on_cpu() -> None:
    machine = probe(torch.float32, budget=0.005)
    assert machine.tile_gflops is not None and machine.tile_gflops > 0
    assert probe(torch.float64, budget=0.005).tile_gflops is None


def test_probe_measures_the_fma_peak_and_rates_are_fractions_of_it() -> None:
    machine = probe(torch.float32, budget=0.005)
    assert machine.fma_gflops is not None and machine.fma_gflops > 0
    assert "float32 FMA peak" in machine.line() and machine.capability in machine.line()
    assert machine.of_peak(machine.fma_gflops / 4) == "25.0%"
    assert Machine("AMD EPYC", 2, "float32", 512, 120.0).of_peak(10.0) == "-"


def test_a_rate_above_the_peak_reads_busy_not_over_100_percent() -> None:
    machine = Machine("AMD EPYC", 2, "float32", 512, 120.0, fma_gflops=100.0)
    assert machine.of_peak(100.0) == "100.0%"
    assert machine.of_peak(141.0) == BUSY  # the probe ran while the machine was busy
    assert "busy" in BUSY_NOTE and BUSY.endswith("*") and BUSY_NOTE.startswith("*")


def test_the_peak_is_the_best_of_many_short_probes(monkeypatch: pytest.MonkeyPatch) -> None:
    # a busy machine: most probes share a core with another process, a few run alone
    build = pytest.importorskip("attngrad.strategies.fused.build")
    rates = iter([40.0] + [20.0, 21.0, 95.0, 22.0] * 10_000)
    calls: list[tuple[int, bool]] = []

    def probe(reps: int, threads: bool) -> float:
        calls.append((reps, threads))
        return next(rates)

    ops = SimpleNamespace(attngrad_fused=SimpleNamespace(fma_peak=probe))
    monkeypatch.setattr(build, "torch", SimpleNamespace(ops=ops))
    assert build.fma_peak(seconds=0.01, threads=True) == 95.0
    assert len(calls) > 4 and all(threads for _, threads in calls[1:])
