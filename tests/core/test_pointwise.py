"""A score function of elementwise ops runs once on broadcast indices, with vmap's result.

`attngrad.core.pointwise.Reads` classifies a score function while finding its captures:
elementwise (every op one of `ELEMENTWISE`, or a captured tensor indexed at every
position) or not.  An elementwise one must give, values and every derivative, what the
nested vmaps give; anything else (chained indexing, a reduction, a matmul) must stay on
vmap, where torch's per-score semantics hold by construction.

It also finds the relative ones, ``score + x(b, h, q_idx - kv_idx)`` (either index moved by
a constant, as a ring pair's function is), which a tile evaluates at its distances only: every derivative must be what evaluating them score by
score gives, and a function that reads q_idx or kv_idx any other way, or the score other
than once and added, must not be taken for one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch
from torch.nn.attention.flex_attention import and_masks, or_masks

from attngrad.core.block_table import MaskFunction
from attngrad.core.score_function import ScoreFunction
from attngrad.ring.shifted import shifted

torch.manual_seed(0)
B, H, N = 2, 4, 24
TABLE = torch.randn(H, 2 * N - 1, dtype=torch.float64, requires_grad=True)
SLOPES = torch.rand(H, dtype=torch.float64, requires_grad=True)
BIAS = torch.randn(B, 1, N, N, dtype=torch.float64)
GATE = torch.tensor(0.7, dtype=torch.float64, requires_grad=True)

ELEMENTWISE: dict[str, Callable[..., torch.Tensor]] = {
    "alibi": lambda s, b, h, i, j: s - SLOPES[h] * (i - j).abs(),
    "table": lambda s, b, h, i, j: s + TABLE[h, i - j + N - 1],
    "softcap-gate": lambda s, b, h, i, j: torch.tanh(s / 3) * 3 * torch.sigmoid(GATE),
    "full-index": lambda s, b, h, i, j: torch.where(i >= j, s + BIAS[b, 0, i, j], -1e4),
}
BUCKETS = torch.randn(H, 8, dtype=torch.float64, requires_grad=True)


def _bucket(d: torch.Tensor) -> torch.Tensor:
    """A T5-style bucket of a distance: exact below 4, logarithmic up to 7."""
    far = 4 + (torch.log(d.abs().clamp(min=1).double() / 4) / 2).long()
    return torch.where(d.abs() < 4, d.abs().long(), far.clamp(max=7))


RELATIVE: dict[str, Callable[..., torch.Tensor]] = {
    "alibi": ELEMENTWISE["alibi"],
    "table": ELEMENTWISE["table"],
    "buckets": lambda s, b, h, i, j: s + BUCKETS[h, _bucket(i - j)],
    "per-batch": lambda s, b, h, i, j: s + (b + 1) * SLOPES[h] * torch.sub(j, i),
    "scalar-first": lambda s, b, h, i, j: GATE * (i - j) + s - 2.0,
    # moved to a ring pair's global origin (q_idx + 16, kv_idx + 40): still a distance
    "alibi-moved": shifted(ELEMENTWISE["alibi"], 5, q=16, kv=40),
    "table-moved": shifted(ELEMENTWISE["table"], 5, q=5, kv=3),
    "moved-by-hand": lambda s, b, h, i, j: s + SLOPES[h] * ((i - 3) - (2 + j)),
}
NOT_RELATIVE: dict[str, Callable[..., torch.Tensor]] = {
    "score-subtracted": lambda s, b, h, i, j: TABLE[h, i - j + N - 1] - s,
    "reads-q_idx": lambda s, b, h, i, j: s + SLOPES[h] * i,
    "distance-and-q_idx": lambda s, b, h, i, j: s + SLOPES[h] * (i - j) * (i > 3),
    "score-twice": lambda s, b, h, i, j: s + s * SLOPES[h],
    "scaled-score": lambda s, b, h, i, j: torch.add(TABLE[h, i - j + N - 1], s, alpha=2),
    "full-index": ELEMENTWISE["full-index"],
    "chained-index": lambda s, b, h, i, j: s + TABLE[h][i - j + N - 1],
    "index-from-a-constant": lambda s, b, h, i, j: s + SLOPES[h] * ((4 - i) - j),
    "index-scaled": lambda s, b, h, i, j: s + SLOPES[h] * ((i * 2) - j),
    "moved-reads-q_idx": shifted(lambda s, b, h, i, j: s + SLOPES[h] * (i - j) * (i > 3), 5, q=8),
}
NOT_ELEMENTWISE: dict[str, Callable[..., torch.Tensor]] = {
    "chained-index": lambda s, b, h, i, j: s + BIAS[b][0][i][j],
    "reduction": lambda s, b, h, i, j: s + SLOPES.sum() * 0 + SLOPES[h],
    "matmul": lambda s, b, h, i, j: s + SLOPES @ SLOPES,
}


def _function(fn: Callable[..., torch.Tensor]) -> ScoreFunction:
    return ScoreFunction.of(fn, torch.zeros(B, H, N, 8, dtype=torch.float64), B)


@pytest.mark.parametrize("name", ELEMENTWISE)
def test_elementwise_functions_are_found(name: str) -> None:
    assert _function(ELEMENTWISE[name]).elementwise


@pytest.mark.parametrize("name", NOT_ELEMENTWISE)
def test_other_functions_stay_on_vmap(name: str) -> None:
    assert not _function(NOT_ELEMENTWISE[name]).elementwise


@pytest.mark.parametrize("name", ELEMENTWISE)
def test_broadcast_gives_what_vmap_gives(name: str) -> None:
    fast = _function(ELEMENTWISE[name])
    slow = dataclasses.replace(fast, elementwise=False, relative=False)
    rows, cols = slice(3, 17), slice(5, 24)
    raw = torch.randn(B, H, 1, 14, 19, dtype=torch.float64)  # [B, Hkv, G, r, c]
    ds = torch.randn(B, H, 14, 19, dtype=torch.float64)
    direction = torch.randn_like(ds)
    results = []
    for f in (fast, slow):
        values = f.values_(raw.clone(), rows, cols)
        grads = [torch.zeros_like(t) for t in f.captured]
        pulled = f.pullback_(raw.clone(), rows, cols, ds.clone(), grads)
        pushed = f.push(raw, rows, cols, direction, [torch.ones_like(t) for t in f.captured])
        results.append((values, pulled, pushed, *grads))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", RELATIVE)
def test_relative_functions_are_found(name: str) -> None:
    assert _function(RELATIVE[name]).relative


@pytest.mark.parametrize("name", NOT_RELATIVE)
def test_other_functions_are_not_taken_for_relative(name: str) -> None:
    assert not _function(NOT_RELATIVE[name]).relative


@pytest.mark.parametrize("name", RELATIVE)
def test_relative_gives_what_score_by_score_gives(name: str) -> None:
    """Values, pullback, push and the second-order step, with every capture's gradient."""
    fast = _function(RELATIVE[name])
    slow = dataclasses.replace(fast, relative=False)
    rows, cols = slice(3, 17), slice(5, 24)
    raw = torch.randn(B, 2, 2, 14, 19, dtype=torch.float64)  # [B, Hkv, G, r, c]
    ds, s_hat, s_dot = (torch.randn(B, 2, 28, 19, dtype=torch.float64) for _ in range(3))
    results = []
    for f in (fast, slow):
        dots = [torch.ones_like(t) if t.is_floating_point() else None for t in f.captured]
        values = f.values_(raw.clone(), rows, cols)
        pulled_grads = [torch.zeros_like(t) for t in f.captured]
        pulled = f.pullback_(raw.clone(), rows, cols, ds.clone(), pulled_grads)
        pushed = f.push(raw, rows, cols, s_dot, dots)
        second_grads = [torch.zeros_like(t) for t in f.captured]
        second = f.second(raw, rows, cols, ds, s_hat, s_dot, dots, second_grads)
        results.append((values, pulled, pushed, second, *pulled_grads, *second_grads))
    assert len(results[0]) > 4  # every function here reads a capture
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


DOCUMENTS = torch.tensor([0] * 10 + [1] * 14)
MASKS: dict[str, Callable[..., torch.Tensor]] = {
    "sliding": lambda b, h, i, j: (i >= j) & (i - j < 5),
    "documents": lambda b, h, i, j: (DOCUMENTS[i] == DOCUMENTS[j]) & (i >= j),
    "per-head": lambda b, h, i, j: (i - j).abs() <= h + b,
    "chained-index": lambda b, h, i, j: DOCUMENTS[i] == DOCUMENTS[j] + 0 * DOCUMENTS.sum(),
    # torch's and_masks / or_masks start from a 0-d constant, q_idx.new_ones(())
    "and-masks": and_masks(
        lambda b, h, i, j: i >= j, lambda b, h, i, j: DOCUMENTS[i] == DOCUMENTS[j]
    ),
    "or-masks": or_masks(lambda b, h, i, j: j < 3, lambda b, h, i, j: (i - j).abs() <= h),
}


@pytest.mark.parametrize("name", MASKS)
def test_mask_functions_broadcast_as_vmap_gives_them(name: str) -> None:
    """A mask_mod's keep over a tile, and over keys given by index (several blocks side
    by side), is the same on broadcast indices as under vmap."""
    mask = MaskFunction.of(MASKS[name], torch.device("cpu"), B, H)
    assert mask.elementwise == (name != "chained-index")
    slow = dataclasses.replace(mask, elementwise=False)
    rows, cols = slice(3, 17), slice(5, 24)
    keys = torch.tensor([0, 1, 2, 20, 21, 22, 23], dtype=torch.int32)
    for f in (mask, slow):
        assert f.keep(B, rows, cols, torch.device("cpu")).shape == (B, H, 14, 19)
    torch.testing.assert_close(
        mask.keep(B, rows, cols, torch.device("cpu")), slow.keep(B, rows, cols, torch.device("cpu"))
    )
    by_index = mask.keep(B, rows, keys, torch.device("cpu"))
    whole = slow.keep(B, rows, slice(0, N), torch.device("cpu"))
    assert torch.equal(by_index, whole[..., keys.long()])


def _block_mask(fn: Callable[..., torch.Tensor], nq: int, nk: int, block: int) -> object:
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(fn, None, None, nq, nk, device="cpu", BLOCK_SIZE=block)


BANDS: dict[str, Callable[..., torch.Tensor]] = {
    "causal": lambda b, h, i, j: i >= j,
    "window": lambda b, h, i, j: (i >= j) & (i - j < 9),
    "documents": lambda b, h, i, j: (i // 12 == j // 12) & (i >= j),
    "prefix": lambda b, h, i, j: (j < 5) | (i >= j),
    "dilated": lambda b, h, i, j: (i - j) % 3 == 0,  # not one interval: a dense keep
    "per-head": lambda b, h, i, j: (i - j).abs() <= h,  # differs by head: a dense keep
}


@pytest.mark.parametrize("name", BANDS)
@pytest.mark.parametrize(("nq", "nk", "block"), [(37, 53, 8), (64, 64, 16)])
def test_a_masks_band_is_the_same_found_all_at_once(
    name: str, nq: int, nk: int, block: int
) -> None:
    """The fused kernels' band of a BlockMask (`BlockTable.rows_of_keys`): found over every
    partial block at once for an elementwise mask_mod, block by block under vmap."""
    from attngrad.core.block_table import BlockTable

    q, k = torch.zeros(1, H, nq, 8), torch.zeros(1, H, nk, 8)
    table = BlockTable.of(_block_mask(BANDS[name], nq, nk, block), q, k, 1)
    assert table.mask.elementwise
    slow = dataclasses.replace(table, mask=dataclasses.replace(table.mask, elementwise=False))
    fast_out, slow_out = (t.rows_of_keys(1, torch.device("cpu")) for t in (table, slow))
    assert (fast_out[2] is None) == (slow_out[2] is None) == (name not in ("dilated", "per-head"))
    for a, b in zip(fast_out, slow_out, strict=True):
        assert (a is None and b is None) or torch.equal(a, b)
