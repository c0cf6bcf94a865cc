"""The memory ledger: the strategies' saved-bytes formulas (attngrad.tools.ledger) against what autograd saves."""

from __future__ import annotations

import csv
import sys

import pytest
import torch

from attngrad.api import attention
from attngrad.cli import app as cli
from attngrad.core.contract import Shapes
from attngrad.tools.ledger import (
    ledger_row,
    predicted_saved_bytes,
    run_ledger,
    run_second_order_ledger,
    second_order_row,
)
from attngrad.tools.memory import measure_peak_bytes, measure_saved_bytes
from attngrad.verify.cases import Case
from helpers import TENSOR_STRATEGIES

# the calibration's GEMM, kept tiny: these tests check the wiring, not the rate
FAST_GEMM = ["--gemm-time", "0.01"]

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
LAYOUTS = [
    # (B, Hq, Hkv, Nq, Nk, d, dv): plain, GQA, Nq != Nk with dv != d, MQA
    (2, 4, 4, 16, 16, 8, 8),
    (1, 6, 2, 9, 23, 8, 8),
    (1, 4, 2, 31, 7, 16, 5),
    (3, 4, 1, 5, 5, 4, 4),
]


def _layout(sizes, dtype, causal=False) -> Case:
    b, hq, hkv, nq, nk, d, dv = sizes
    return Case(Shapes((b,), hq, hkv, nq, nk, d, dv), dtype, "causal" if causal else "none")


def _id(sizes) -> str:
    b, hq, hkv, nq, nk, d, dv = sizes
    return f"B{b}-H{hq}:{hkv}-N{nq}x{nk}-d{d}:{dv}"


@pytest.mark.parametrize("strategy", TENSOR_STRATEGIES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("sizes", LAYOUTS, ids=_id)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_predicted_equals_measured_byte_for_byte(strategy, dtype, sizes, causal):
    row = ledger_row(strategy, _layout(sizes, dtype, causal), peak=False)
    assert row.measured_saved == row.predicted_saved
    assert row.match is True


FEATURES = {
    "dropout": {"dropout_p": 0.3},
    "softcap": {"softcap": 5.0},
    "bottom-right": {"is_causal": True, "align": "bottom-right", "window": (4, None)},
    "packed": {
        "cu_seqlens_q": torch.tensor([0, 4, 4, 9]),
        "cu_seqlens_k": torch.tensor([0, 10, 15, 23]),
    },
}


@pytest.mark.parametrize("strategy", TENSOR_STRATEGIES)
@pytest.mark.parametrize("feature", FEATURES)
def test_dropout_softcap_alignment_and_segments_save_nothing_more(strategy, feature):
    """The same formula holds: no dropout mask, slope or band is saved for backward."""
    case = _layout(LAYOUTS[1], torch.float32)
    q, k, v = (
        torch.randn(*s, requires_grad=True) for s in ((1, 6, 9, 8), (1, 2, 23, 8), (1, 2, 23, 8))
    )
    kw = FEATURES[feature]
    measured, out = measure_saved_bytes(
        lambda: attention(q, k, v, enable_gqa=True, strategy=strategy, **kw)
    )
    assert measured == predicted_saved_bytes(strategy, case)
    out.sum().backward()  # and backward runs on what was saved


def test_formulas_by_hand():
    # B=1, Hq=8, Hkv=2, Nq=Nk=1024, d=dv=64, float32 (b=4, l=4; two statistics per row)
    lo = _layout((1, 8, 2, 1024, 1024, 64, 64), torch.float32)
    qkv = 4 * (8 * 1024 * 64 + 2 * 2 * 1024 * 64)
    stats = 2 * 4 * 8 * 1024
    assert predicted_saved_bytes("explicit", lo) == qkv + 4 * 8 * 1024 * 1024 + stats
    assert predicted_saved_bytes("recompute", lo) == qkv + 2 * 4 * 8 * 1024
    assert predicted_saved_bytes("flash", lo) == qkv + 4 * 8 * 1024 * 64 + 2 * 4 * 8 * 1024
    # the course chapter's C_saved = b(3BNd + BN^2) (+ the row statistics): H = 1, Nq = Nk
    seed = _layout((2, 1, 1, 100, 100, 16, 16), torch.float64)
    row_stats = 2 * 8 * 2 * 100
    assert (
        predicted_saved_bytes("explicit", seed)
        == 8 * (3 * 2 * 100 * 16 + 2 * 100 * 100) + row_stats
    )
    assert predicted_saved_bytes("recompute", seed) == 8 * 3 * 2 * 100 * 16 + 2 * 8 * 2 * 100
    assert predicted_saved_bytes("sdpa-math", seed) is None


def test_peak_memory_counts_allocations():
    # a 4 MiB tensor held while a 1 MiB one comes and goes: peak 5 MiB, all freed
    def run():
        a = torch.empty(1 << 20)
        b = torch.empty(1 << 18)
        del b
        return a.sum()

    assert measure_peak_bytes(run) == pytest.approx(5 * 2**20, rel=0.01)


def test_flash_and_recompute_peaks_are_far_below_explicit_peak():
    # N large enough that P (64 MiB) dwarfs a few flash tiles of at most 1 MiB each
    # and a few recompute chunks of ~8 MiB each
    lo = _layout((1, 1, 1, 4096, 4096, 16, 16), torch.float32)
    explicit = ledger_row("explicit", lo)
    p_bytes = 4 * 4096 * 4096
    assert explicit.peak_beyond_io >= p_bytes  # P itself must be in explicit's peak
    assert ledger_row("flash", lo).peak_beyond_io < p_bytes / 8
    assert ledger_row("recompute", lo).peak_beyond_io < p_bytes / 2


def test_run_ledger_rows_carry_their_layout():
    layouts = [_layout(LAYOUTS[1], torch.float16, causal=True)]
    seen: list[str] = []
    rows, notes = run_ledger(["flash", "explicit"], layouts, peak=False, step=seen.append)
    assert [r.path for r in rows] == ["flash", "explicit"] and notes == []
    assert seen == ["flash Nq=9 Nk=23", "explicit Nq=9 Nk=23"]
    r = rows[0]
    got = (r.batch, r.heads_q, r.heads_kv, r.seq_q, r.seq_k, r.head_dim, r.value_dim)
    assert got == LAYOUTS[1]
    assert (r.dtype, r.causal, r.peak) == ("float16", True, None)


def _ledger(argv: list[str]) -> int:
    return cli.main(["ledger", *argv, *FAST_GEMM])


def test_cli_table_and_sweep(tmp_path, capsys):
    argv = ["--heads", "2", "--heads-kv", "1", "--seq-q", "64", "--head-dim", "8"]
    assert _ledger(argv) == 0
    out, err = capsys.readouterr()
    assert "no plot for one size: --sweep" in err  # one size writes no PNG, and says so
    lines = out.splitlines()
    assert lines[0].startswith("machine: ") and " threads, float32 GEMM " in lines[0]
    assert lines[1].split()[:7] == ["path", "B", "H", "Nq", "x", "Nk", "d"]
    rows = {line.split()[0]: line.split() for line in lines[3:]}
    assert list(rows) == [*TENSOR_STRATEGIES, "sdpa-math", "sdpa-flash"]
    assert rows["flash"][1:6] == ["1", "2:1", "64", "8", "float32"]
    assert "NO" not in "\n".join(lines)
    csv_path, png_path = tmp_path / "ledger.csv", tmp_path / "ledger.png"
    argv = ["--heads", "1", "--head-dim", "8", "--no-peak", "--sweep", "16", "32", "64"]
    assert _ledger([*argv, "--csv", str(csv_path), "--plot", str(png_path)]) == 0
    rows = list(csv.DictReader(csv_path.open()))
    # triton runs on CPU only in Triton's interpreter, which timing and memory runs leave out
    assert len(rows) == 3 * (len(TENSOR_STRATEGIES) + 2)
    for column in ("batch", "heads_q", "head_dim", "dtype", "causal", "machine", "threads"):
        assert column in rows[0], column
    explicit = {int(r["seq_q"]): int(r["measured_saved"]) for r in rows if r["path"] == "explicit"}
    # the N^2 term: doubling N grows explicit's saved bytes by more than 2x
    assert explicit[64] / explicit[32] > 2.5
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_strategy_takes_strategies_and_sdpa_backends(capsys):
    argv = ["--heads", "1", "--seq-q", "16", "--head-dim", "8", "--no-peak"]
    assert _ledger([*argv, "--strategy", "recompute", "--strategy", "sdpa-flash"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines[3:]] == ["recompute", "sdpa-flash"]


def test_sweep_without_matplotlib_writes_the_csv_and_says_how_to_install(
    tmp_path, monkeypatch, capsys
):
    # None in sys.modules makes `import matplotlib...` raise ImportError
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    monkeypatch.chdir(tmp_path)
    argv = ["--heads", "1", "--head-dim", "8", "--no-peak", "--sweep", "16", "32"]
    assert _ledger([*argv, "--strategy", "flash"]) == 0
    assert (tmp_path / "results" / "ledger.csv").exists()
    assert not (tmp_path / "results" / "ledger.png").exists()
    assert "pip install 'attngrad[plot]'" in capsys.readouterr().err


def test_empty_paths_skip_the_csv_and_the_plot(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    argv = ["--heads", "1", "--head-dim", "8", "--no-peak", "--sweep", "16", "--strategy", "flash"]
    assert _ledger([*argv, "--csv", "", "--plot", ""]) == 0
    assert list(tmp_path.iterdir()) == []
    assert "wrote" not in capsys.readouterr().out


@pytest.mark.parametrize("device", ["tpu", "meta"])
def test_an_unknown_or_unmeasurable_device_is_an_argument_error(device, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["ledger", "--device", device])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --device: " in err and repr(device) in err


def test_second_order_rows_keep_what_the_create_graph_backward_saves():
    lo = _layout((1, 2, 2, 64, 64, 8, 8), torch.float32)
    rows = {r.path: r for r in run_second_order_ledger(
        ["explicit", "flash", "sdpa-math", "sdpa-flash"], [lo], peak=False)[0]}  # fmt: skip
    p_bytes = 4 * 2 * 64 * 64
    explicit, flash = rows["explicit"], rows["flash"]
    # AttentionGradients saves dO beside forward's q, k, v, P / O and stats, by reference:
    # the graph keeps forward's storages and dO, nothing new
    dout = 4 * 2 * 64 * 8
    assert explicit.forward_saved == predicted_saved_bytes("explicit", lo)
    assert explicit.backward_saved == explicit.forward_saved + dout
    assert explicit.kept == explicit.forward_saved + dout and explicit.kept >= p_bytes
    assert flash.kept == flash.forward_saved + dout and flash.kept < p_bytes
    assert rows["sdpa-math"].supported and rows["sdpa-math"].kept > p_bytes
    # SDPA's CPU flash kernel has no double backward: a row that says so, not a crash
    assert not rows["sdpa-flash"].supported and "not implemented" in rows["sdpa-flash"].note
    assert rows["sdpa-flash"].kept is None


def test_second_order_peak_of_flash_stays_below_explicits():
    lo = _layout((1, 1, 1, 2048, 2048, 16, 16), torch.float32)
    p_bytes = 4 * 2048 * 2048
    assert second_order_row("explicit", lo).peak_beyond_io >= p_bytes
    assert second_order_row("flash", lo).peak_beyond_io < p_bytes / 2


def test_cli_order_2_table_and_csv(tmp_path, capsys):
    csv_path = tmp_path / "order2.csv"
    argv = ["--heads", "1", "--seq-q", "32", "--head-dim", "8", "--no-peak", "--order", "2"]
    assert _ledger([*argv, "--csv", str(csv_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("second order: g = grad(O, (q, k, v), dO, create_graph=True)")
    rows = {line.split()[0]: line for line in lines[4:] if line.split()}
    assert {*TENSOR_STRATEGIES, "sdpa-math", "sdpa-flash"} <= set(rows)
    assert "sdpa-flash: no double backward (derivative for" in "\n".join(lines)
    records = list(csv.DictReader(csv_path.open()))
    assert {r["path"]: r["supported"] for r in records}["sdpa-flash"] == "False"
    assert "kept" in records[0] and "machine" in records[0]
