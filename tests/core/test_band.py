"""Alignment and packed sequences: the band of keys each query row reaches.

The pictures of `attngrad.core.band` are checked as pictures; every strategy is
checked against the same computation as one call per segment (packed) or
against SDPA's own ``CausalBias`` (bottom-right), in float64.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right, causal_upper_left

import attngrad
from attngrad.core.band import (
    Band,
    BandSpec,
    validate_band,
    validate_segments,
    validate_window,
)
from attngrad.core.contract import Shapes
from attngrad.core.scores import ScoreMods
from attngrad.core.tiling import key_schedule, schedule
from helpers import TENSOR_STRATEGIES


def picture(band: Band) -> list[str]:
    j = torch.arange(band.seq_k)
    inside = (j >= band.lo[:, None]) & (j < band.hi[:, None])
    return ["".join("x" if a else "." for a in row) for row in inside.tolist()]


def test_causal_alignments() -> None:
    assert picture(Band.of(2, 4, None, 0)) == ["x...", "xx.."]
    assert picture(Band.of(2, 4, None, 0, "bottom-right")) == ["xxx.", "xxxx"]
    # more queries than keys: the first rows sit before every key and see nothing
    assert picture(Band.of(4, 2, None, 0, "bottom-right")) == ["..", "..", "x.", "xx"]


def test_window_bottom_right() -> None:
    assert picture(Band.of(3, 6, 1, 0, "bottom-right")) == ["..xx..", "...xx.", "....xx"]


def test_packed_picture_of_the_docstring() -> None:
    band = Band.of(5, 6, None, 0, "bottom-right", ((0, 3, 5), (0, 2, 6)))
    assert picture(band) == ["......", "x.....", "xx....", "..xxx.", "..xxxx"]


def test_query_span_inverts_the_rows_intervals() -> None:
    band = Band.of(9, 11, 2, 1, "bottom-right", ((0, 4, 4, 9), (0, 3, 7, 11)))
    first, stop = band.query_span()
    j = torch.arange(11)
    inside = (j >= band.lo[:, None]) & (j < band.hi[:, None])  # [Nq, Nk]
    for key in range(11):
        rows = torch.nonzero(inside[:, key]).flatten().tolist()
        assert rows == list(range(int(first[key]), int(stop[key]))), key


def _qkv(b: int, h: int, nq: int, nk: int, d: int = 6) -> list[torch.Tensor]:
    torch.manual_seed(0)
    shapes = ((b, h, nq, d), (b, h, nk, d), (b, h, nk, d))
    return [torch.randn(*s, dtype=torch.float64, requires_grad=True) for s in shapes]


def _grads(out: torch.Tensor, xs: list[torch.Tensor]) -> list[torch.Tensor]:
    torch.manual_seed(1)
    return list(torch.autograd.grad(out, xs, torch.randn_like(out)))


@pytest.mark.parametrize("strategy", TENSOR_STRATEGIES)
@pytest.mark.parametrize("nq, nk", [(5, 9), (9, 5), (7, 7)])
def test_bottom_right_matches_sdpa_causal_lower_right(strategy: str, nq: int, nk: int) -> None:
    xs = _qkv(2, 2, nq, nk)
    got = attngrad.attention(*xs, is_causal=True, align="bottom-right", strategy=strategy)
    want = F.scaled_dot_product_attention(*xs, attn_mask=causal_lower_right(nq, nk))
    live = torch.arange(nq) + nk - nq >= 0  # SDPA gives NaN-free rows only where keys exist
    torch.testing.assert_close(got[:, :, live], want[:, :, live], rtol=0, atol=1e-12)
    assert torch.equal(got[:, :, ~live], torch.zeros_like(got[:, :, ~live]))
    # SDPA's CausalBias objects are accepted as the mask
    for bias, align in (
        (causal_lower_right(nq, nk), "bottom-right"),
        (causal_upper_left(nq, nk), "top-left"),
    ):
        again = attngrad.attention(*xs, attn_mask=bias, strategy=strategy)
        assert torch.equal(
            again, attngrad.attention(*xs, is_causal=True, align=align, strategy=strategy)
        )


SEGMENTS = [((0, 3, 8, 8, 12), (0, 5, 5, 9, 14)), ((0, 12), (0, 14))]


@pytest.mark.parametrize("strategy", TENSOR_STRATEGIES)
@pytest.mark.parametrize("segments", SEGMENTS)
@pytest.mark.parametrize("align", ["top-left", "bottom-right"])
def test_packed_equals_one_call_per_segment(strategy: str, segments: tuple, align: str) -> None:
    cu_q, cu_k = segments
    q, k, v = _qkv(2, 3, cu_q[-1], cu_k[-1])
    kw = {"is_causal": True, "window": (3, None), "align": align, "strategy": strategy}
    opts = {"block_q": 4, "block_k": 4} if strategy == "flash" else {}
    got = attngrad.attention(
        q, k, v, cu_seqlens_q=torch.tensor(cu_q), cu_seqlens_k=torch.tensor(cu_k), **kw, **opts
    )
    parts = []
    for s in range(len(cu_q) - 1):
        qs, ks = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])
        parts.append(attngrad.attention(q[:, :, qs], k[:, :, ks], v[:, :, ks], **kw))
    want = torch.cat(parts, dim=2)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    for a, b in zip(_grads(got, [q, k, v]), _grads(want, [q, k, v]), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_an_empty_key_segment_gives_zero_rows() -> None:
    q, k, v = _qkv(1, 2, 6, 4)
    cu_q, cu_k = torch.tensor([0, 2, 6]), torch.tensor([0, 0, 4])
    for strategy in TENSOR_STRATEGIES:
        out = attngrad.attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, strategy=strategy)
        assert torch.equal(out[:, :, :2], torch.zeros_like(out[:, :, :2])), strategy
        assert not torch.isnan(torch.cat(_grads(out, [q, k, v]), dim=2)).any()


def test_the_tiled_pass_skips_every_tile_outside_the_segments() -> None:
    cu = tuple(range(0, 4097, 512))
    band = Band.of(4096, 4096, None, 0, segments=(cu, cu))
    mods = ScoreMods(None, None, band, 1, 4096, 4096)
    tiles = sum(len(keys) for _, keys in schedule(mods, (256, 256)))
    assert tiles == 8 * 3  # per segment of 2 x 2 tiles: the causal 3


def test_bad_segments_alignments_and_causal_bias_are_refused() -> None:
    q = torch.randn(1, 2, 6, 4)
    cases = [
        ({"cu_seqlens_q": torch.tensor([0, 4, 3, 6])}, ValueError, "never decrease"),
        ({"cu_seqlens_q": torch.tensor([0, 4, 5])}, ValueError, "end at the sequence length 6"),
        ({"cu_seqlens_q": torch.tensor([1, 6])}, ValueError, "start at 0"),
        ({"cu_seqlens_q": torch.tensor([0.0, 6.0])}, ValueError, "int32/int64"),
        ({"cu_seqlens_q": [0, 6]}, TypeError, "cu_seqlens_q must be"),
        (
            {"cu_seqlens_q": torch.tensor([0, 6]), "cu_seqlens_k": torch.tensor([0, 2, 6])},
            ValueError,
            "segments",
        ),
        ({"align": "center"}, ValueError, "align must be"),
        ({"attn_mask": causal_lower_right(6, 5)}, ValueError, "CausalBias"),
        ({"attn_mask": causal_lower_right(6, 6), "is_causal": True}, ValueError, "CausalBias"),
        ({"attn_mask": causal_upper_left(6, 6), "align": "bottom-right"}, ValueError, "align"),
    ]
    for kwargs, error, match in cases:
        with pytest.raises(error, match=match):
            attngrad.attention(q, q, q, **kwargs)


@pytest.mark.parametrize("strategy", TENSOR_STRATEGIES)
def test_packed_bottom_right_gradgradcheck_and_forward_mode(strategy: str) -> None:
    q, k, v = (x.detach()[:, :, :6].clone().requires_grad_() for x in _qkv(1, 2, 7, 7, d=3))
    cu_q, cu_k = torch.tensor([0, 4, 6]), torch.tensor([0, 1, 6])

    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attngrad.attention(
            q, k, v, is_causal=True, align="bottom-right", window=(2, None),
            cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, strategy=strategy,
        )  # fmt: skip

    assert torch.autograd.gradcheck(call, (q, k, v), check_forward_ad=True)
    assert torch.autograd.gradgradcheck(call, (q, k, v))


# -- the module that decides the band: one spec from every keyword that states it


def _spec(**keywords: object) -> BandSpec:
    shapes = Shapes((1,), 2, 2, 6, 9, 4, 4)
    args = {"attn_mask": None, "is_causal": False, "window": None, "align": "top-left"}
    args |= keywords
    cu = (args.pop("cu_seqlens_q", None), args.pop("cu_seqlens_k", None))
    return validate_band(**args, cu_seqlens=cu, shapes=shapes, device=torch.device("cpu"))  # type: ignore[arg-type]


def test_validate_band_folds_causal_causal_bias_window_and_segments_into_one_spec() -> None:
    assert _spec() == BandSpec() and not BandSpec().bounded
    assert _spec().build(6, 9) is None  # every query sees every key: no band to lay out
    assert _spec(is_causal=True) == BandSpec(None, 0)
    assert _spec(is_causal=True, window=(2, 3)) == BandSpec(2, 0)  # causal caps the right edge
    assert _spec(window=[2, None], align="bottom-right") == BandSpec(2, None, "bottom-right")
    assert _spec(attn_mask=causal_lower_right(6, 9)) == BandSpec(None, 0, "bottom-right")
    assert _spec(attn_mask=causal_upper_left(6, 9), window=(1, 1)) == BandSpec(1, 0)
    packed = _spec(cu_seqlens_q=torch.tensor([0, 2, 6]), cu_seqlens_k=torch.tensor([0, 4, 9]))
    assert packed == BandSpec(segments=((0, 2, 6), (0, 4, 9))) and packed.bounded
    # the spec lays out the same rows as the band built from its parts
    band = _spec(is_causal=True, window=(2, None), align="bottom-right").build(6, 9)
    assert band is not None
    assert picture(band) == picture(Band.of(6, 9, 2, 0, "bottom-right"))


def test_unread_segments_wait_for_the_op() -> None:
    # under torch.compile the values are read where the call runs: the spec has none yet
    shapes = Shapes((1,), 2, 2, 6, 6, 4, 4)
    cu = torch.tensor([0, 2, 6])
    spec = validate_band(None, True, None, "top-left", (cu, None), shapes, cu.device, read=False)
    assert spec == BandSpec(None, 0)
    read = replace(spec, segments=validate_segments(cu, None, shapes, cu.device))  # as the op does
    assert read == BandSpec(None, 0, segments=((0, 2, 6), (0, 2, 6)))


@pytest.mark.parametrize(
    ("window", "error", "words"),
    [
        ((1, 2, 3), ValueError, "window must be a pair (left, right), got (1, 2, 3)"),
        ((1.5, 0), TypeError, "window's left side must be an int >= 0 or None, got 1.5"),
        ((0, -1), ValueError, "window's right side must be >= 0 or None, got -1"),
    ],
)
def test_bad_windows_name_the_side_and_show_the_value(window, error, words) -> None:
    with pytest.raises(error) as info:
        validate_window(window)
    assert words in str(info.value) and "window=(128, 0)" in str(info.value)


@pytest.mark.parametrize("blocks", [(7, 5), (4, 4), (16, 3)], ids=str)
@pytest.mark.parametrize("window", [(None, None), (3, 0), (None, 2)], ids=str)
def test_forward_and_backward_visit_the_same_tiles(blocks, window) -> None:
    # regression: forward's key tiles started at each row block's span and backward's at the
    # multiples of block_k, so a score near a segment or band edge was formed in tiles of two
    # shapes, rounded two ways by the BLAS, and backward's P was not forward's (float64 dv 30x
    # the other strategies' error with packed segments and 7 x 5 tiles)
    cu_q, cu_k = (0, 3, 17, 20), (0, 1, 6, 9)
    band = Band.of(20, 9, *window, segments=(cu_q, cu_k))
    mods = ScoreMods(None, None, band, 1, 20, 9)
    forward = {
        (r.start, r.stop, k.start, k.stop) for r, keys in schedule(mods, blocks) for k in keys
    }
    backward = {
        (r.start, r.stop, k.start, k.stop)
        for _, pairs in key_schedule(mods, blocks)
        for r, k in pairs
    }
    assert forward == backward
    assert all(k0 < k1 for *_, k0, k1 in forward)
