"""`attngrad bench --features` (`attngrad.tools.bench_features`): each variant really uses its
feature, and the rows, table, CSV, plot and CLI refusals have their documented
structure.  No timed assertions."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

from attngrad.cli import app as cli
from attngrad.cli.bench_features import features_table
from attngrad.tools import bench_features
from attngrad.tools.bench_features import (
    DROPOUT_P,
    FEATURES,
    SEGMENTS,
    TARGET_SEQ,
    TARGET_STRATEGY,
    FeatureRow,
    feature_calls,
    run_features,
    segment_bounds,
    steps,
    targets,
)
from attngrad.tools.machine import Machine
from helpers import TENSOR_STRATEGIES

FAST_GEMM = ["--gemm-time", "0.01"]
MACHINE = Machine("a test CPU", 1, "float32", 64, 1.0)
NAMES = [f.name for f in FEATURES]


def _outputs(strategy: str, n: int = 64, heads: int = 2) -> dict[str, torch.Tensor]:
    q, k, v = (torch.randn(1, heads, n, 8, dtype=torch.float64) for _ in range(3))
    return {name: fn(q, k, v) for name, fn in feature_calls(strategy, n, heads).items()}


@pytest.mark.parametrize("strategy", TENSOR_STRATEGIES)
def test_every_variant_changes_the_output_of_its_baseline(strategy: str) -> None:
    out = _outputs(strategy)
    assert set(out) == {"none", "causal", *NAMES}
    for f in FEATURES:
        assert not torch.allclose(out[f.name], out[f.baseline]), f.name


@pytest.mark.parametrize("strategy", TENSOR_STRATEGIES)
def test_packed_is_causal_attention_within_each_segment(strategy: str) -> None:
    n, heads = 64, 2
    q, k, v = (torch.randn(1, heads, n, 8, dtype=torch.float64) for _ in range(3))
    calls = feature_calls(strategy, n, heads)
    cut = n // SEGMENTS
    pieces = [
        calls["causal"](q[..., s : s + cut, :], k[..., s : s + cut, :], v[..., s : s + cut, :])
        for s in range(0, n, cut)
    ]
    torch.testing.assert_close(calls["packed"](q, k, v), torch.cat(pieces, dim=-2))


def test_dropout_draws_a_new_mask_each_call_and_drops_about_p() -> None:
    n, heads = 64, 2
    q, k = (torch.zeros(1, heads, n, 8, dtype=torch.float64) for _ in range(2))
    v = torch.eye(n, dtype=torch.float64).expand(1, heads, n, n)  # O = P with dropout, per entry
    dropout = feature_calls("flash", n, heads)["dropout"]
    first, second = dropout(q, k, v), dropout(q, k, v)
    assert not torch.equal(first, second)
    dropped = (first == 0).double().mean().item()
    assert abs(dropped - DROPOUT_P) < 0.02  # 8192 entries: 5 standard deviations
    torch.testing.assert_close(
        first[first != 0].max(), torch.tensor(1 / n / (1 - DROPOUT_P)).double()
    )


def test_segment_bounds_and_the_multiple_of_8_rule() -> None:
    assert segment_bounds(64).tolist() == [0, 8, 16, 24, 32, 40, 48, 56, 64]
    with pytest.raises(ValueError, match=f"multiple of {SEGMENTS}"):
        segment_bounds(60)
    with pytest.raises(ValueError, match="got 12"):
        run_features([64, 12], repeats=1)


def test_run_features_rows_in_order() -> None:
    notes: list[str] = []
    strategies = ["flash", "explicit"]
    rows = run_features([32, 64], strategies, 1, 2, 8, repeats=2, step=notes.append)
    assert len(notes) == steps([32, 64], 2) == 4
    assert notes[-1] == "N=64 round 2/2"
    expected = [(n, s, f) for n in (32, 64) for s in strategies for f in NAMES]
    assert [(r.seq, r.strategy, r.feature) for r in rows] == expected
    for r in rows:
        assert (r.batch, r.heads, r.head_dim, r.dtype, r.device) == (1, 2, 8, "float32", "cpu")
        assert r.low_s <= r.median_s and r.base_low_s <= r.base_median_s and r.ratio > 0
        assert r.baseline == ("causal" if r.feature == "packed" else "none")
        has_target = r.strategy == TARGET_STRATEGY and r.feature in ("dropout", "packed")
        assert (r.target is not None) == has_target == (r.met is not None)
    assert [row for _, row in targets(rows)] == [None, None]  # N=4096 not measured


def _row(feature: str, seq: int, low: float, target: float | None) -> FeatureRow:
    base = "causal" if feature == "packed" else "none"
    return FeatureRow(1, 8, seq, 64, "float32", "cpu", 3, feature, base, "flash",
                      low, low * 1.1, 1.0, 1.1, target)  # fmt: skip


def test_table_marks_the_targets() -> None:
    rows = [
        _row("dropout", TARGET_SEQ, 1.10, 1.15),
        _row("packed", TARGET_SEQ, 0.30, 0.25),
        _row("softcap", TARGET_SEQ, 1.05, None),
        _row("sinks", TARGET_SEQ, 1.01, None),
    ]
    assert [(f.name, r.met) for f, r in targets(rows) if r] == [
        ("dropout", True),
        ("packed", False),
    ]
    lines = features_table(rows, MACHINE).splitlines()
    assert lines[0].startswith("machine: a test CPU, 1 threads")
    assert any("dropout <= 1.15, packed <= 0.25" in line for line in lines)
    assert f"N={TARGET_SEQ}" in lines
    split = [line.split() for line in lines]
    cells = {c[0]: c for c in split if c[1:2] == ["flash"]}
    assert cells["dropout"][-3:] == ["<=", "1.15", "pass"]
    assert cells["packed"][-3:] == ["<=", "0.25", "FAIL"]
    assert cells["softcap"][-2:] == ["-", "-"] and cells["sinks"][4] == "1.010"
    assert features_table([], MACHINE).endswith("(no measurements)")


def test_cli_writes_table_csv_and_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    csv_path, png_path = tmp_path / "f.csv", tmp_path / "f.png"
    argv = ["bench", "--features", "--seq", "64", "--heads", "2", "--head-dim", "8"]
    argv += ["--repeats", "1", "--strategy", "flash", "--strategy", "recompute"]
    argv += ["--csv", str(csv_path), "--plot", str(png_path), *FAST_GEMM]
    assert cli.main(argv) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("machine: ") and "N=64" in captured.out
    assert "bench --features [" in captured.err
    with csv_path.open(newline="", encoding="utf-8") as f:
        records = list(csv.DictReader(f))
    assert [(r["strategy"], r["feature"]) for r in records] == [
        (s, f) for s in ("flash", "recompute") for f in NAMES
    ]
    assert all(r["machine"] and r["gemm_gflops"] for r in records)
    assert [r["target"] for r in records[:4]] == ["1.15", "0.25", "", ""]
    assert records[0]["met"] in ("True", "False") and records[4]["target"] == ""
    pytest.importorskip("matplotlib")
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--seq", "60"], "multiple of 8"),
        (["--order", "2"], "drop --order 2"),
        (["--baseline", "math"], "drop --baseline"),
        (["--strategy", "auto"], "named strategies"),
        (["--strategy", "triton"], "triton on CUDA only"),
    ],
)
def test_cli_refuses(extra: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "--features", *extra, *FAST_GEMM]) == 2
    assert message in capsys.readouterr().err


def test_device_goes_with_features_only(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "--device", "cpu", "--seq", "16", *FAST_GEMM]) == 2
    assert "--device goes with --features only" in capsys.readouterr().err


def test_features_defaults_to_flash_at_4096_and_leaves_plain_bench_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    args = cli._parser().parse_args(["bench"])
    assert (args.features, args.device, args.seq) == (False, None, [1024, 2048, 4096])
    asked: list[tuple[object, ...]] = []

    def run(seqs: list[int], strategies: list[str], **kw: object) -> list[FeatureRow]:
        asked.append((seqs, strategies, kw["heads"], kw["device"]))
        return []

    monkeypatch.setattr(bench_features, "run_features", run)
    assert cli.main(["bench", "--features", "--csv", "", "--plot", "", *FAST_GEMM]) == 0
    assert asked == [([TARGET_SEQ], [TARGET_STRATEGY], 8, torch.device("cpu"))]
