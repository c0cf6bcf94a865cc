"""The second-order pass over key blocks: the row sums' shares add up, and each block's pass
given their totals adds up to the whole pass.

This is what ring attention's double backward does with a sharded sequence's keys
(`attngrad.ring.second`): here one process cuts the keys into unequal blocks, each a
problem of its own against the rows' final O and statistics, and the blocks' gradients,
summed (grad k and grad v joined along the keys), must be the whole call's -- in
float64 to 1e-12, for the shared tiled pass (flash) and the fused kernel, with a bias,
a softcap, GQA, a row that attends nothing and every cotangent at once.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from attngrad.autograd.second_order import ROW_SUMS, second_order_of, sums_of
from attngrad.core.contract import Shapes
from attngrad.core.interface import Problem
from attngrad.core.scores import ScoreMods
from attngrad.strategies import REGISTRY, unavailable_reason

F64 = torch.float64
B, HQ, HKV, NQ, NK, D, DV = 2, 4, 2, 24, 40, 8, 6
CUTS = (0, 7, 23, 40)  # three key blocks of unequal length, not on tile edges


def _problem(strategy, q, k, v, bias, softcap) -> Problem:
    mods = ScoreMods(bias, None, None, k.shape[1], q.shape[2], k.shape[2], softcap)
    tiles = strategy.tiles(Shapes.of(q, k, v), q.dtype, 8, 8)
    return Problem(q, k, v, mods, 0.4, tiles)


def _inputs(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=g, dtype=F64)

    bias = randn(B, HQ, NQ, NK)
    bias[:, :, 3] = torch.finfo(F64).min  # row 3 attends nothing: padding at finfo.min
    x = {"q": randn(B, HQ, NQ, D), "k": randn(B, HKV, NK, D), "v": randn(B, HKV, NK, DV)}
    x |= {"bias": bias, "dout": randn(B, HQ, NQ, DV), "dlse": randn(B, HQ, NQ)}
    for name in ("q", "k", "v", "bias"):
        x["g" + name] = randn(*x[name].shape)
    return x


@pytest.mark.parametrize("softcap", [None, 2.5])
@pytest.mark.parametrize("name", ["flash", "fused"])
def test_key_blocks_add_up_to_the_whole_pass(name: str, softcap: float | None) -> None:
    if unavailable_reason(name, torch.device("cpu")) is not None:
        pytest.skip(unavailable_reason(name, torch.device("cpu")))
    strategy = REGISTRY[name]
    x = _inputs(seed=3 if softcap is None else 4)
    whole = _problem(strategy, x["q"], x["k"], x["v"], x["bias"], softcap)
    _, saved = strategy.forward(whole)
    cotangents = (x["gq"], x["gk"], x["gv"], x["gbias"])
    need = (True,) * 6
    want = second_order_of(strategy, whole, saved, cotangents, x["dout"], x["dlse"], need)

    blocks = []
    for a, b in itertools.pairwise(CUTS):
        cols = slice(a, b)
        part = _problem(strategy, x["q"], x["k"][:, :, cols], x["v"][:, :, cols],
                        x["bias"][..., cols], softcap)  # fmt: skip
        cot = (x["gq"], x["gk"][:, :, cols], x["gv"][:, :, cols], x["gbias"][..., cols])
        blocks.append((part, cot))
    sums = sum(sums_of(strategy, p, saved, c, x["dout"]) for p, c in blocks)
    assert isinstance(sums, torch.Tensor) and sums.shape == (B, HQ, NQ, ROW_SUMS)
    parts = [
        second_order_of(strategy, p, saved, c, x["dout"], x["dlse"], need, sums) for p, c in blocks
    ]
    got = (
        sum(p[0] for p in parts),  # grad dout
        sums[..., 1],  # grad dlse = r
        sum(p[2] for p in parts),  # grad q
        torch.cat([p[3] for p in parts], dim=2),  # grad k, joined along the keys
        torch.cat([p[4] for p in parts], dim=2),  # grad v
        torch.cat([p[5] for p in parts], dim=-1),  # grad bias
    )
    for what, w, g in zip(("dout", "dlse", "q", "k", "v", "bias"), want, got, strict=True):
        assert not torch.isnan(g).any(), what
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12, msg=what)
    for p in parts:  # the grad dlse a block returns is the whole r, not a share
        torch.testing.assert_close(p[1], want[1], rtol=1e-12, atol=1e-12)
