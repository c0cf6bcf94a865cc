"""`attngrad bench`: the FLOP convention, the rows, and the command's CSV, table and plot."""

from __future__ import annotations

import csv
import math
import sys
from pathlib import Path

import pytest

from attngrad.cli import app as cli
from attngrad.cli.bench import bench_table
from attngrad.tools import bench_step
from attngrad.tools.bench_step import (
    PASSES,
    BenchRow,
    auto_choice,
    crossover,
    estimate_seconds,
    flops,
    run_bench,
    step_flops,
    steps,
)
from attngrad.tools.machine import Machine
from attngrad.tools.timing import Spread
from helpers import TENSOR_STRATEGIES

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# the calibration's GEMM, kept tiny: these tests check the wiring, not the rate
FAST_GEMM = ["--gemm-time", "0.01"]
CSV_COLUMNS = [
    "batch", "heads", "seq_q", "seq_k", "head_dim", "dtype", "causal", "pass", "contender",
    "auto", "repeats", "median_ms", "min_ms", "max_ms", "gflops", "gemm_fraction",
]  # fmt: skip
MACHINE_COLUMNS = [
    "machine", "threads", "gemm_dtype", "gemm_size", "gemm_gflops", "tile_gflops",
    "fma_peak_gflops", "capability",
]  # fmt: skip


def _run(argv: list[str]) -> int:
    return cli.main(["bench", *argv, *FAST_GEMM])


def _read_csv(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    with path.open(newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        return list(reader.fieldnames or []), list(reader)


# forward = 4·B·H·Nq·Nk·d, half with causal; backward 2.5x; forward+backward 3.5x.
@pytest.mark.parametrize(
    ("shape", "causal", "pass_", "expected"),
    [
        ((1, 8, 4096, 4096, 64), False, "forward", 34_359_738_368),
        ((1, 8, 4096, 4096, 64), True, "forward", 17_179_869_184),
        ((1, 8, 4096, 4096, 64), False, "backward", 85_899_345_920),
        ((1, 8, 4096, 4096, 64), True, "forward+backward", 60_129_542_144),
        # Nq != Nk, every size distinct: a swapped or dropped dim changes the count
        ((2, 3, 5, 7, 16), False, "forward", 13_440),
        ((2, 3, 5, 7, 16), True, "forward", 6_720),
        ((2, 3, 5, 7, 16), False, "backward", 33_600),
        ((2, 3, 7, 5, 16), True, "forward+backward", 23_520),
    ],
    ids=lambda x: "-".join(map(str, x)) if isinstance(x, tuple) else str(x),
)
def test_flops_by_the_design_convention(
    shape: tuple[int, int, int, int, int], causal: bool, pass_: str, expected: int
) -> None:
    assert flops(*shape, causal, pass_) == expected


def test_flops_rejects_an_unknown_pass() -> None:
    with pytest.raises(ValueError, match="pass_"):
        flops(1, 1, 8, 8, 8, False, "fwd")


def test_defaults_match_the_reference_shape() -> None:
    args = cli._parser().parse_args(["bench"])
    assert (args.batch, args.heads, args.head_dim, args.seq) == (1, 8, 64, [1024, 2048, 4096])
    assert (args.causal, args.dtype, args.repeats) == ("both", "float32", 5)
    assert (args.strategy, args.baseline) == (
        None,
        None,
    )  # all strategies, sdpa-math and sdpa-flash
    assert (args.csv, args.plot) == (None, None)  # results/bench.csv and .png


def test_cli_writes_csv_table_and_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    csv_path, png_path = tmp_path / "out" / "bench.csv", tmp_path / "out" / "bench.png"
    argv = ["--seq", "64", "128", "--heads", "2", "--head-dim", "16", "--repeats", "1"]
    argv += ["--csv", str(csv_path), "--plot", str(png_path)]
    assert _run(argv) == 0

    columns, rows = _read_csv(csv_path)
    ratios = ["ratio_vs_sdpa_math", "ratio_vs_sdpa_flash"]
    assert columns == [*CSV_COLUMNS, *ratios, *MACHINE_COLUMNS]
    # triton runs on CPU only in Triton's interpreter, which timing runs leave out
    contenders = [*TENSOR_STRATEGIES, "sdpa-math", "sdpa-flash"]
    keys = [(r["seq_q"], r["causal"], r["pass"], r["contender"]) for r in rows]
    assert keys == [
        (n, c, p, name)
        for n in ("64", "128")
        for c in ("False", "True")
        for p in PASSES
        for name in contenders
    ]
    for r in rows:
        ratios = [float(r["ratio_vs_sdpa_math"]), float(r["ratio_vs_sdpa_flash"])]
        assert all(math.isfinite(x) and x > 0 for x in ratios), r
        # GFLOP/s is the documented FLOP count over the median time
        n = flops(1, 2, int(r["seq_q"]), int(r["seq_k"]), 16, r["causal"] == "True", r["pass"])
        expected = n / (float(r["median_ms"]) / 1e3) / 1e9
        assert float(r["gflops"]) == pytest.approx(expected, rel=1e-3, abs=1e-3)
        fraction = float(r["gflops"]) / float(r["gemm_gflops"])
        assert float(r["gemm_fraction"]) == pytest.approx(fraction, rel=1e-3, abs=1e-4)
        if r["contender"] == "sdpa-math":
            assert float(r["ratio_vs_sdpa_math"]) == 1.0
        assert float(r["min_ms"]) <= float(r["median_ms"]) <= float(r["max_ms"])
        assert r["auto"] == auto_choice(1, 2, int(r["seq_q"]), 16, r["causal"] == "True")
        assert int(r["threads"]) >= 1 and r["machine"]

    assert png_path.read_bytes()[:8] == PNG_MAGIC
    captured = capsys.readouterr()
    out = captured.out
    assert out.startswith("machine: ") and " threads, float32 GEMM " in out.splitlines()[0]
    assert "vs sdpa-math" in out and "vs sdpa-flash" in out and "min–max ms" in out
    assert f"N=64 causal=no (strategy auto picks {auto_choice(1, 2, 64, 16, False)})" in out
    assert f"wrote {csv_path}" in out and f"wrote {png_path}" in out
    assert "calibrating the float32 matmul rate" in captured.err
    # said up front, before the first round: how many steps and about how long
    (estimate,) = [line for line in captured.err.splitlines() if line.startswith("bench: ")]
    assert estimate.startswith(f"bench: {2 * 2 * len(PASSES)} steps, about ")
    assert captured.err.index(estimate) < captured.err.index("bench [")


def test_the_estimate_counts_every_call_of_every_contender() -> None:
    # one N, one mode: 3 passes x (repeats + warm-up) calls, + backward's graph, per contender
    one = estimate_seconds([64], [False], 1, 5, gemm_gflops=1.0)
    work = sum(6 * flops(1, 8, 64, 64, 64, False, p) for p in PASSES)
    work += flops(1, 8, 64, 64, 64, False, "backward")
    assert one == pytest.approx(work / (0.3 * 1e9))
    assert estimate_seconds([64], [False], 4, 5, gemm_gflops=1.0) == pytest.approx(4 * one)
    assert estimate_seconds([64, 128], [False], 1, 5, 1.0) == pytest.approx(5 * one)
    assert estimate_seconds([64], [True], 1, 5, gemm_gflops=2.0) == pytest.approx(one / 4)
    weights = step_flops([64, 128], [False, True], 2, 1, 8, 64)
    assert len(weights) == steps([64, 128], [False, True], 2)
    assert weights[0] == flops(1, 8, 64, 64, 64, False, "forward") and weights[-1] == flops(
        1, 8, 128, 128, 64, True, "forward+backward"
    )


def test_rounds_that_spread_are_called_unreliable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # a busy machine: one contender's rounds 9x apart, the rest steady
    def spreads(times: dict[str, list[float]]) -> dict[str, Spread]:
        return {n: Spread(1.0, 0.2, 1.8) if n == "flash" else Spread(1, 0.99, 1.01) for n in times}

    monkeypatch.setattr(bench_step, "spreads", spreads)
    argv = ["--seq", "16", "--heads", "1", "--head-dim", "8", "--repeats", "1", "--causal", "no"]
    assert _run([*argv, "--csv", "", "--plot", "", "--strategy", "flash"]) == 0
    out = capsys.readouterr().out
    assert "warning: the rounds of 3 of 9 measurements spread by more than 20%" in out
    assert "9.0x from fastest to slowest" in out and "unreliable" in out
    monkeypatch.setattr(bench_step, "spreads", lambda t: {n: Spread(1, 0.91, 1.09) for n in t})
    assert _run([*argv, "--csv", "", "--plot", "", "--strategy", "flash"]) == 0
    assert "warning" not in capsys.readouterr().out  # 18% apart: steady enough


def test_empty_paths_skip_the_csv_and_the_plot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    argv = ["--seq", "16", "--heads", "1", "--head-dim", "8", "--repeats", "1", "--causal", "no"]
    assert _run([*argv, "--strategy", "explicit", "--csv", "", "--plot", ""]) == 0
    assert list(tmp_path.iterdir()) == []
    assert "wrote" not in capsys.readouterr().out


def test_plot_is_skipped_without_matplotlib(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # None in sys.modules makes `import matplotlib...` raise ImportError
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    csv_path, png_path = tmp_path / "bench.csv", tmp_path / "bench.png"
    argv = ["--seq", "32", "--heads", "1", "--head-dim", "8", "--repeats", "1", "--causal", "no"]
    argv += ["--strategy", "explicit", "--baseline", "math"]
    assert _run([*argv, "--csv", str(csv_path), "--plot", str(png_path)]) == 0
    assert csv_path.exists() and not png_path.exists()
    assert "matplotlib is not installed" in capsys.readouterr().err


def _machine(gemm_gflops: float, dtype: str = "float32") -> Machine:
    return Machine("a test CPU", 1, dtype, 64, gemm_gflops)


def test_run_bench_rows_and_table() -> None:
    notes: list[str] = []
    rows = run_bench(
        [16], [True], ["auto", "flash"], ["sdpa-flash"], 1, 2, 8, repeats=2, gemm_gflops=1e6,
        step=notes.append,
    )  # fmt: skip
    assert [(r.pass_, r.contender) for r in rows] == [
        (p, name) for p in PASSES for name in ("auto", "flash", "sdpa-flash")
    ]
    assert all(r.causal and r.repeats == 2 and set(r.ratios) == {"sdpa-flash"} for r in rows)
    picked = auto_choice(1, 2, 16, 16, True)
    assert all(r.low_s <= r.time_s <= r.high_s and r.auto == picked for r in rows)
    assert len(notes) == len(PASSES) * 2 and notes[0].startswith("N=16 causal=yes")
    table = bench_table(rows, _machine(1e6))
    assert table.startswith("machine: a test CPU, 1 threads, float32 GEMM 64²")
    assert f"N=16 causal=yes (strategy auto picks {picked})" in table
    # one line per row, each starting with its pass; nothing above the GEMM rate, no footnote
    assert sum(line.startswith(PASSES) for line in table.splitlines()) == len(rows)
    assert "*" not in table


@pytest.mark.parametrize(
    ("dtype", "why"),
    [("float32", "a longer --gemm-time"), ("float16", "16-bit inputs compute in float32")],
)
def test_a_fraction_above_the_gemm_rate_is_starred_and_explained(dtype: str, why: str) -> None:
    rows = [_row(256, "flash", 1e-3), _row(256, "explicit", 1.0)]
    table = bench_table(rows, _machine(1.0, dtype))
    starred = [line for line in table.splitlines() if "%*" in line]
    assert len(starred) == 1 and "flash" in starred[0]
    footnote = table.splitlines()[-1]
    assert footnote.startswith("* above 100%: attention ran faster than the measured")
    assert why in footnote


def test_run_bench_rejects_an_unknown_baseline() -> None:
    with pytest.raises(ValueError, match="baseline"):
        run_bench([16], [False], ["explicit"], ["cudnn"], gemm_gflops=1.0)


def _row(n: int, contender: str, time_s: float) -> BenchRow:
    return BenchRow(
        batch=1,
        heads=1,
        seq_q=n,
        seq_k=n,
        head_dim=8,
        dtype="float32",
        causal=False,
        pass_="forward+backward",
        contender=contender,
        repeats=1,
        time_s=time_s,
        low_s=time_s,
        high_s=time_s,
        gemm_gflops=1.0,
        auto="explicit",
    )


def test_crossover_is_where_flash_stays_faster() -> None:
    # flash wins at 256 by noise, loses at 512, then wins from 1024 on: the answer is 1024
    times = {256: (1.0, 2.0), 512: (3.0, 2.0), 1024: (3.0, 4.0), 2048: (5.0, 9.0)}
    rows = [_row(n, "flash", f) for n, (f, _) in times.items()]
    rows += [_row(n, "explicit", e) for n, (_, e) in times.items()]
    assert crossover(rows) == 1024
    assert crossover([_row(256, "flash", 2.0), _row(256, "explicit", 1.0)]) is None
