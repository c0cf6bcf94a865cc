"""`attngrad bench`: the FLOP convention, the CLI's CSV, table and plot."""

from __future__ import annotations

import argparse
import csv
import math
import sys
from pathlib import Path

import pytest

from attngrad.bench import (
    CSV_COLUMNS,
    PASSES,
    BenchRow,
    crossover,
    flops,
    format_table,
    gemm_rate,
    register,
    run_bench,
)
from helpers import TENSOR_STRATEGIES

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    return parser


def _run(argv: list[str]) -> int:
    args = _parser().parse_args(["bench", *argv])
    return int(args.run(args))


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


def test_gemm_rate_is_positive() -> None:
    rate = gemm_rate(size=64, repeats=1)
    assert math.isfinite(rate) and rate > 0


def test_defaults_match_the_reference_shape() -> None:
    args = _parser().parse_args(["bench"])
    assert (args.batch, args.heads, args.head_dim, args.seq) == (1, 8, 64, [1024, 2048, 4096])
    assert (args.causal, args.dtype, args.repeats) == ("both", "float32", 5)
    assert (args.strategy, args.baseline) == (None, None)  # all strategies, math and flash
    assert (args.csv, args.plot) == ("results/bench.csv", "results/bench.png")


def test_cli_writes_csv_table_and_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    csv_path, png_path = tmp_path / "out" / "bench.csv", tmp_path / "out" / "bench.png"
    argv = ["--seq", "64", "128", "--heads", "2", "--head-dim", "16", "--repeats", "1"]
    argv += ["--gemm-size", "64", "--csv", str(csv_path), "--plot", str(png_path)]
    assert _run(argv) == 0

    columns, rows = _read_csv(csv_path)
    assert columns == [*CSV_COLUMNS, "ratio_vs_sdpa_math", "ratio_vs_sdpa_flash"]
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

    assert png_path.read_bytes()[:8] == PNG_MAGIC
    out = capsys.readouterr().out
    assert "vs sdpa-math" in out and "vs sdpa-flash" in out
    assert f"wrote {csv_path}" in out and f"wrote {png_path}" in out


def test_plot_is_skipped_without_matplotlib(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # None in sys.modules makes `import matplotlib...` raise ImportError
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    csv_path, png_path = tmp_path / "bench.csv", tmp_path / "bench.png"
    argv = ["--seq", "32", "--heads", "1", "--head-dim", "8", "--repeats", "1", "--causal", "no"]
    argv += ["--strategy", "explicit", "--baseline", "math", "--gemm-size", "32"]
    assert _run([*argv, "--csv", str(csv_path), "--plot", str(png_path)]) == 0
    assert csv_path.exists() and not png_path.exists()
    assert "matplotlib is not installed" in capsys.readouterr().err


def test_run_bench_rows_and_table() -> None:
    rows = run_bench(
        [16], [True], ["auto", "flash"], ["flash"], 1, 2, 8, repeats=2, progress=False, gemm_size=32
    )
    assert [(r.pass_, r.contender) for r in rows] == [
        (p, name) for p in PASSES for name in ("auto", "flash", "sdpa-flash")
    ]
    assert all(r.causal and r.repeats == 2 and set(r.ratios) == {"sdpa-flash"} for r in rows)
    table = format_table(rows)
    assert "N=16 causal=yes" in table
    # one line per row, each starting with its pass
    assert sum(line.startswith(PASSES) for line in table.splitlines()) == len(rows)


def test_run_bench_rejects_an_unknown_baseline() -> None:
    with pytest.raises(ValueError, match="baseline"):
        run_bench([16], [False], ["explicit"], ["cudnn"], progress=False, gemm_size=32)


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
        gemm_gflops=1.0,
    )


def test_crossover_is_where_flash_stays_faster() -> None:
    # flash wins at 256 by noise, loses at 512, then wins from 1024 on: the answer is 1024
    times = {256: (1.0, 2.0), 512: (3.0, 2.0), 1024: (3.0, 4.0), 2048: (5.0, 9.0)}
    rows = [_row(n, "flash", f) for n, (f, _) in times.items()]
    rows += [_row(n, "explicit", e) for n, (_, e) in times.items()]
    assert crossover(rows) == 1024
    assert crossover([_row(256, "flash", 2.0), _row(256, "explicit", 1.0)]) is None
