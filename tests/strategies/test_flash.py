"""The flash strategy's own machinery: tile sizes, the tile schedule, tile skipping."""

from __future__ import annotations

import pytest
import torch

import attngrad
from attngrad.core.band import Band
from attngrad.core.contract import Shapes
from attngrad.core.interface import Backward, Problem
from attngrad.core.scores import ScoreMods
from attngrad.core.tiling import Blocks, key_schedule, schedule
from attngrad.strategies.flash import strategy as flash
from attngrad.verify.cases import make_inputs, outputs_and_grads
from attngrad.verify.check import strategy_fn
from helpers import assert_rule, case


def _mods(nq: int, nk: int, causal: bool = False, window=None) -> ScoreMods:
    shapes = Shapes(lead=(1,), heads_q=1, heads_kv=1, seq_q=nq, seq_k=nk, head_dim=8, value_dim=8)
    return ScoreMods.build(None, causal, window, shapes)


def _tiles(mods: ScoreMods, blocks: tuple[int, int]) -> int:
    return sum(len(cols) for _, cols in schedule(mods, blocks))


def test_schedule_covers_every_key_once_per_row_block():
    mods = _mods(100, 70)
    for rows, cols in schedule(mods, (32, 16)):
        keys = [j for c in cols for j in range(c.start, c.stop)]
        assert keys == list(range(70)), rows


def test_causal_visits_about_half_of_the_tiles():
    blocks = (64, 64)
    full = _tiles(_mods(4096, 4096), blocks)
    causal = _tiles(_mods(4096, 4096, causal=True), blocks)
    assert full == 64 * 64
    # the diagonal tiles stay: (64 * 65 / 2) of 64 * 64
    assert causal == 64 * 65 // 2
    assert 0.5 <= causal / full <= 0.51


def test_window_visits_only_the_band():
    blocks = (64, 64)
    window = _tiles(_mods(4096, 4096, window=(128, 0)), blocks)
    # each row block needs its own tile and the two before it (plus a partial start)
    assert window <= 3 * 64


@pytest.mark.parametrize(
    ("causal", "window"), [(False, None), (True, None), (False, (5, 3)), (True, (7, None))], ids=str
)
def test_key_schedule_visits_each_pair_in_the_band_exactly_once(causal, window):
    mods = _mods(37, 45, causal=causal, window=window)
    seen = torch.zeros(37, 45, dtype=torch.int64)
    for cols, pairs in key_schedule(mods, (8, 16)):
        for rows, keys in pairs:
            assert cols.start <= keys.start < keys.stop <= cols.stop
            seen[rows, keys] += 1
    inside = torch.zeros(37, 45, dtype=torch.bool)
    for i in range(37):
        lo, hi = mods.key_span(slice(i, i + 1))
        inside[i, lo:hi] = True
    assert seen.max() == 1 and bool((seen == 1)[inside].all())
    # tiles only reach past the band by less than one row block's spread
    assert seen.sum() <= inside.sum() + 37 * 8


def test_key_schedule_with_causal_visits_about_half():
    def area(causal: bool) -> int:
        tiles = key_schedule(_mods(4096, 4096, causal=causal), (256, 256))
        return sum((r.stop - r.start) * (c.stop - c.start) for _, pairs in tiles for r, c in pairs)

    assert 0.5 <= area(True) / area(False) <= 0.54


def test_causal_with_more_queries_than_keys_keeps_every_key_for_late_rows():
    for rows, cols in schedule(_mods(10, 4, causal=True), (3, 2)):
        stop = max(c.stop for c in cols)
        assert stop == min(4, rows.stop)


@pytest.mark.parametrize(
    ("nq", "nk", "groups"), [(4096, 4096, 1), (97, 1, 1), (1, 5000, 8), (300, 300, 4)]
)
def test_default_blocks_are_positive_and_bounded(nq, nk, groups):
    bq, bk = flash.tiles(Shapes((1,), groups, 1, nq, nk, 8, 8), torch.float32, None, None)
    assert 1 <= bq <= max(nq, 1) and 1 <= bk <= max(nk, 1)
    assert bq * groups * bk <= 256 * 1024  # one score tile per (batch, head) stays small


def test_given_blocks_are_used():
    assert flash.tiles(Shapes((1,), 1, 1, 100, 100, 8, 8), torch.float32, 7, 9) == (7, 9)


@pytest.mark.parametrize(("bq", "bk"), [(1, 1), (5, 3), (64, 7), (1000, 1000)], ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_any_block_size_obeys_the_rule(bq, bk, causal):
    c = case((2,), 4, 2, 23, 19, 8, 5, "causal" if causal else "none")
    inputs = make_inputs(c)
    flash = strategy_fn("flash")
    fn = lambda *a, **kw: flash(*a, block_q=bq, block_k=bk, **kw)  # noqa: E731
    assert_rule(c, inputs, outputs_and_grads(fn, c, inputs, c.dtype))


def test_flash_saves_q_k_v_o_and_row_stats_only():
    q = torch.randn(1, 4, 40, 16, requires_grad=True)
    k = torch.randn(1, 2, 50, 16, requires_grad=True)
    v = torch.randn(1, 2, 50, 8, requires_grad=True)
    saved: list[torch.Tensor] = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = attngrad.attention(q, k, v, enable_gqa=True, strategy="flash")
    shapes = [tuple(t.shape) for t in saved]
    stats = (1, 4, 40, 2)  # (m, log l) per row
    assert shapes == [(1, 4, 40, 16), (1, 2, 50, 16), (1, 2, 50, 8), (1, 4, 40, 8), stats]
    assert saved[3].data_ptr() == out.data_ptr()  # O is the output itself, not a copy
    assert saved[4].dtype == torch.float32


@pytest.mark.parametrize("block", ["block_q", "block_k"])
@pytest.mark.parametrize(
    ("value", "error"),
    [(0, ValueError), (-3, ValueError), (2.5, TypeError), ("64", TypeError)],
    ids=str,
)
def test_bad_block_size_names_it(block, value, error):
    q = torch.randn(1, 2, 8, 4)
    with pytest.raises(error, match=block):
        attngrad.attention(q, q, q, strategy="flash", **{block: value})


@pytest.mark.parametrize("strategy", ["explicit", "recompute"])
def test_block_size_for_an_untiled_strategy_is_an_error(strategy):
    q = torch.randn(1, 2, 8, 4)
    with pytest.raises(ValueError, match="flash"):
        attngrad.attention(q, q, q, strategy=strategy, block_q=4)


def test_where_fused_cannot_run_auto_takes_flash_for_long_sequences_and_block_sizes(monkeypatch):
    from attngrad import strategies
    from attngrad.strategies import resolve

    monkeypatch.setattr(strategies, "_fused_runs", lambda device: False)

    short = Shapes((1,), 8, 8, 256, 256, 64, 64)
    long = Shapes((1,), 8, 8, 4096, 4096, 64, 64)  # 2**24 scores
    assert resolve("auto", short, tiling_given=False) == "explicit"
    assert resolve("auto", long, tiling_given=False) == "flash"
    assert resolve("auto", short, tiling_given=True) == "flash"
    assert resolve("recompute", long, tiling_given=False) == "recompute"
    n512 = Shapes((1,), 8, 8, 512, 512, 64, 64)
    n1024 = Shapes((1,), 8, 8, 1024, 1024, 64, 64)
    assert resolve("auto", n512, tiling_given=False) == "explicit"
    assert resolve("auto", n1024, tiling_given=False) == "flash"
    assert resolve("auto", n512, tiling_given=False, banded=True) == "flash"
    assert resolve("auto", Shapes((1,), 8, 8, 511, 512, 64, 64), False, banded=True) == "explicit"


def test_backward_into_adds_to_what_the_accumulators_hold():
    c = case((1,), 4, 2, 30, 21, 8, 5, "causal", scale=0.3)
    inputs = make_inputs(c)
    q, k, v, dout = (inputs[n] for n in ("q", "k", "v", "dout"))
    mods = ScoreMods(None, None, Band.of(30, 21, None, 0), 2, 30, 21)  # causal: right = 0
    problem = Problem(q, k, v, mods, 0.3, Blocks(8, 8))
    o, saved = flash.forward(problem)
    assert saved["stats"].shape == (1, 4, 30, 2) and saved["o"] is o
    dq, dk, dv = (torch.zeros_like(t) for t in (q, k, v))
    flash.backward_into(Backward(problem, saved, dout, None, (dq, dk, dv, None)))
    assert_rule(c, inputs, {"out": o, "dq": dq, "dk": dk, "dv": dv})
    # into held values: their sum (held values small, so the sum's rounding stays
    # within the rule's floor of the gradient itself)
    start = [torch.randn_like(t) / 64 for t in (q, k, v)]
    grads = [t.clone() for t in start]
    flash.backward_into(Backward(problem, saved, dout, None, (*grads, None)))
    added = [g - s for g, s in zip(grads, start, strict=True)]
    assert not any(torch.equal(a, g) for a, g in zip(added, grads, strict=True))
    assert_rule(c, inputs, dict(zip(("dq", "dk", "dv"), added, strict=True)))
