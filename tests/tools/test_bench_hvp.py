"""`attngrad bench --order 2` (`attngrad.tools.bench_hvp`): the HVP agrees with SDPA MATH's, and the
command's rows, table and CSV have their documented structure.  No timed assertions."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest
import torch

from attngrad.cli import app as cli
from attngrad.cli.bench_hvp import order2_table
from attngrad.tools.bench_hvp import BASELINE, MEASURES, hvp, run_order2
from attngrad.tools.machine import Machine
from attngrad.tools.paths import path_fn
from helpers import TENSOR_STRATEGIES

FAST_GEMM = ["--gemm-time", "0.01"]


def _inputs(
    shape: tuple[int, ...], dtype: torch.dtype
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...], torch.Tensor]:
    q, k, v, dout, *w = (torch.randn(shape, dtype=dtype) for _ in range(7))
    return (q.requires_grad_(), k.requires_grad_(), v.requires_grad_()), tuple(w), dout


@pytest.mark.parametrize("strategy", TENSOR_STRATEGIES)
@pytest.mark.parametrize("loss", ["square", "dot"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_hvp_agrees_with_sdpa_math_in_float64(strategy: str, loss: str, causal: bool) -> None:
    # N=40 with flash's default tiles is one tile; 16x16 tiles exercise the tiled passes
    inputs, w, dout = _inputs((1, 2, 40, 8), torch.float64)
    expected = hvp(path_fn(BASELINE, causal), inputs, w, loss, dout)  # type: ignore[arg-type]
    fn = path_fn(strategy, causal)
    if strategy == "flash":
        import attngrad

        def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return attngrad.attention(  # type: ignore[return-value]
                q, k, v, is_causal=causal, strategy="flash", block_q=16, block_k=16
            )

    got = hvp(fn, inputs, w, loss, dout)  # type: ignore[arg-type]
    for name, a, b in zip("qkv", got, expected, strict=True):
        assert a.dtype == torch.float64
        assert torch.allclose(a, b, rtol=1e-9, atol=1e-10), (name, (a - b).abs().max().item())


def test_hvp_is_the_hessian_times_w() -> None:
    # against the full Hessian of the same loss in q alone (torch.autograd.functional.hessian)
    inputs, w, _ = _inputs((1, 1, 12, 4), torch.float64)
    q, k, v = inputs

    def loss(q: torch.Tensor) -> torch.Tensor:
        return path_fn("flash", False)(q, k, v).square().sum() / 2

    hessian = torch.autograd.functional.hessian(loss, q.detach())  # [q.shape, q.shape]
    expected = (hessian.reshape(q.numel(), q.numel()) @ w[0].reshape(-1)).reshape(q.shape)
    zero = torch.zeros_like(q)
    got = hvp(path_fn("flash", False), inputs, (w[0], zero, zero))
    assert torch.allclose(got[0], expected, rtol=1e-9, atol=1e-12)


def test_hvp_rejects_dot_without_dout_and_an_unknown_loss() -> None:
    inputs, w, _ = _inputs((1, 1, 4, 4), torch.float64)
    with pytest.raises(ValueError, match="dout"):
        hvp(path_fn("flash", False), inputs, w, "dot")
    with pytest.raises(ValueError, match="loss"):
        hvp(path_fn("flash", False), inputs, w, "cube")  # type: ignore[arg-type]


def test_run_order2_rows_and_table() -> None:
    notes: list[str] = []
    contenders = ["flash", "explicit", BASELINE]
    rows = run_order2([16, 32], [False, True], contenders, 1, 2, 8, repeats=2, step=notes.append)
    assert len(notes) == 2 * 2 * 2 * 2  # (N, causal) x (hvp, forward/jvp) x repeats
    expected = [
        (n, c, m, name)
        for n in (16, 32)
        for c in (False, True)
        for m, name in [("hvp", x) for x in contenders]
        + [(m, x) for x in contenders for m in ("forward", "jvp")]
    ]
    assert [(r.seq, r.causal, r.measure, r.contender) for r in rows] == expected
    assert {r.measure for r in rows} == set(MEASURES)
    for r in rows:
        assert r.low_s <= r.time_s <= r.high_s and r.repeats == 2 and r.loss == "square"
        assert r.ratio is not None and math.isfinite(r.ratio) and r.ratio > 0
        assert r.ratio_of_min is not None and r.ratio_of_min > 0
        if r.contender == BASELINE:
            assert r.ratio == 1.0 == r.ratio_of_min
        if r.measure == "hvp":
            assert r.peak is not None and r.peak_beyond_io is not None
            assert 0 <= r.peak_beyond_io < r.peak
        else:
            assert r.peak is None
        assert (r.jvp_over_forward is not None) == (r.measure == "jvp")
    table = order2_table(rows, Machine("a test CPU", 1, "float32", 64, 1.0))
    lines = table.splitlines()
    assert lines[0].startswith("machine: a test CPU, 1 threads")
    assert "L = sum(O**2)/2" in table and "create_graph=True" in table
    assert table.count("N=16 causal=no") == 1 and table.count("N=32 causal=yes") == 1
    heads = [line.split() for line in lines if line.startswith(("hvp ", "jvp "))]
    assert heads.count(["hvp", "median", "ms", "min–max", "ms", "vs", "sdpa-math", "(min)",
                        "peak", "beyond", "I/O"]) == 4  # fmt: skip
    assert sum(h[0] == "jvp" and "jvp/forward" in h for h in heads) == 4
    # one line per contender under each header
    for name in contenders:
        assert sum(line.startswith(name + " ") for line in lines) == 4 * 2


def test_a_contender_that_would_not_fit_is_skipped_with_a_note() -> None:
    notes: list[str] = []
    rows = run_order2(
        [16, 64], [False], ["flash", BASELINE], 1, 1, 8, repeats=1, memory=1, note=notes.append
    )
    # at N=16 nothing is known yet, so both run; at N=64 the N² scaling of any peak > 1 byte
    assert [(r.seq, r.contender) for r in rows if r.measure == "hvp"] == [
        (16, "flash"), (16, BASELINE),
    ]  # fmt: skip
    assert len(notes) == 2 and all("skipped at N=64" in n for n in notes)


def test_cli_order_2_writes_csv_and_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    csv_path, png_path = tmp_path / "hvp.csv", tmp_path / "hvp.png"
    argv = ["bench", "--order", "2", "--seq", "16", "--heads", "1", "--head-dim", "8"]
    argv += ["--repeats", "1", "--causal", "no", "--strategy", "flash", "--loss", "dot"]
    argv += ["--csv", str(csv_path), "--plot", str(png_path), *FAST_GEMM]
    assert cli.main(argv) == 0
    with csv_path.open(newline="", encoding="utf-8") as f:
        records = list(csv.DictReader(f))
    assert [(r["measure"], r["contender"]) for r in records] == [
        ("hvp", "flash"), ("hvp", BASELINE), ("forward", "flash"), ("jvp", "flash"),
        ("forward", BASELINE), ("jvp", BASELINE),
    ]  # fmt: skip
    assert all(r["loss"] == "dot" and r["machine"] and r["ratio_vs_sdpa_math"] for r in records)
    assert records[0]["peak_bytes"] and not records[2]["peak_bytes"]
    assert records[3]["jvp_over_forward"] and not records[2]["jvp_over_forward"]
    pytest.importorskip("matplotlib")
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert out.startswith("machine: ") and "L = <O, dO>, dO fixed" in out


def test_cli_order_2_refuses_the_flash_baseline(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "--order", "2", "--seq", "16", "--baseline", "flash", *FAST_GEMM]
    assert cli.main([*argv, "--strategy", "flash"]) == 2
    assert "--order 2 compares with SDPA's math backend only" in capsys.readouterr().err


def test_order_defaults_leave_plain_bench_as_it_was() -> None:
    args = cli._parser().parse_args(["bench"])
    assert (args.order, args.loss, args.no_peak) == (1, "square", False)
    args = cli._parser().parse_args(["bench", "--order", "2", "--loss", "dot", "--no-peak"])
    assert (args.order, args.loss, args.no_peak) == (2, "dot", True)
