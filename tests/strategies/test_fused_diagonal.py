"""Relative score functions on fused: their term along the diagonals (``fused/diagonal.py``).

The kernels' ``diagonal`` argument is checked against the same term given as a float mask
(a Toeplitz bias, its gradient summed along the diagonals), and relative score_mods through
`attngrad.flex_attention` on fused against the tensor-op tiles in float64, captured
tensors' gradients included, with GQA, Nq != Nk and partial BlockMask blocks.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

import attngrad
from attngrad.core.score_function import ScoreFunction
from attngrad.strategies.fused import build
from attngrad.strategies.fused.diagonal import Diagonal

DTYPES = [torch.float32, torch.float64]


@pytest.fixture(scope="module", autouse=True)
def _library() -> None:
    build.load()


def toeplitz_bias(dd: torch.Tensor, nq: int, nk: int) -> torch.Tensor:
    """D [B, H, Nq + Nk - 1] as the bias it stands for: [B, H, Nq, Nk], D[.., j - i + Nq - 1]."""
    e = torch.arange(nk)[None, :] - torch.arange(nq)[:, None] + nq - 1
    return dd[:, :, e]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("sizes", [(37, 53), (53, 37), (300, 9)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_diagonal_is_the_toeplitz_bias_it_stands_for(dtype, sizes, causal):
    nq, nk = sizes
    b, hq, hkv, d = 2, 4, 2, 16
    g = torch.Generator().manual_seed(3)
    q = torch.randn(b, hq, nq, d, generator=g, dtype=dtype)
    k, v = (torch.randn(b, hkv, nk, d, generator=g, dtype=dtype) for _ in range(2))
    dout = torch.randn(b, hq, nq, d, generator=g, dtype=dtype)
    dd = torch.randn(b, hq, nq + nk - 1, generator=g, dtype=dtype)
    band = (
        [torch.zeros(nq, dtype=torch.int64), torch.arange(1, nq + 1).clamp(max=nk)]
        if causal else [None, None]
    )  # fmt: skip
    mods = [None, None, *band, None, None]
    scale, tiles, engine = d**-0.5, (16, 8), build.load().engine_id
    o, stats = torch.ops.attngrad_fused.forward(
        q, k, v, *mods, scale, 0.0, 0, 1.0, *tiles, engine, diagonal=dd
    )
    delta = (o * dout).sum(-1)
    dq, dk, dv, _, _, ddd = torch.ops.attngrad_fused.backward(
        dout, q, k, v, stats, delta, *mods, scale, 0.0, 0, 1.0, *tiles, engine, False,
        diagonal=dd, need_ddiagonal=True,
    )  # fmt: skip

    qr, kr, vr, br = (t.clone().requires_grad_() for t in (q, k, v, dd))
    want = attngrad.attention(
        qr, kr, vr, attn_mask=toeplitz_bias(br, nq, nk), window=(None, 0) if causal else None,
        enable_gqa=True, strategy="explicit", scale=scale,
    )  # fmt: skip
    grads = torch.autograd.grad(want, (qr, kr, vr, br), dout)
    tol = {"rtol": 2e-5, "atol": 2e-5} if dtype == torch.float32 else {"rtol": 1e-10, "atol": 1e-10}
    for got, ref in zip((o, dq, dk, dv, ddd), (want, *grads), strict=True):
        torch.testing.assert_close(got, ref, **tol)


def test_the_diagonals_gradient_is_the_same_bits_for_any_thread_count():
    g = torch.Generator().manual_seed(4)
    q, k, v, dout = (torch.randn(1, 2, 300, 8, generator=g) for _ in range(4))
    dd = torch.randn(1, 2, 599, generator=g)
    engine = build.load().engine_id
    args = (*(None,) * 6, 0.35, 0.0, 0, 1.0, 64, 32, engine)
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            o, stats = torch.ops.attngrad_fused.forward(q, k, v, *args, diagonal=dd)
            out = torch.ops.attngrad_fused.backward(
                dout, q, k, v, stats, (o * dout).sum(-1), *args, False, diagonal=dd,
                need_ddiagonal=True,
            )  # fmt: skip
            results.append(out[5])
    finally:
        torch.set_num_threads(before)
    assert torch.equal(*results)


def test_a_diagonal_beside_a_program_is_a_value_error():
    q = torch.randn(1, 1, 4, 8)
    code = torch.zeros(1, 6, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"program .* or as its diagonal term, not both"):
        torch.ops.attngrad_fused.forward(
            q, q, q, *(None,) * 6, 1.0, 0.0, 0, 1.0, 4, 4, 0, code=code,
            constants=torch.zeros(1, dtype=torch.float64), indices=torch.zeros(0, dtype=torch.int64),
            out=0, captured=[], diagonal=torch.zeros(1, 1, 7),
        )  # fmt: skip


def _bucket(distance: torch.Tensor) -> torch.Tensor:  # T5's, 16 buckets, reach 64
    distance = distance.abs()
    far = 8 + (torch.log(distance.float().clamp(min=1) / 8) / 2.0794415 * 8).long()
    return torch.where(distance < 8, distance, far.clamp(max=15))


def relative_functions(b: int, hq: int, nq: int, nk: int, dtype: torch.dtype, gen):
    """{name: (score_mod, its captured tensors)}, each relative."""
    slopes = torch.rand(hq, generator=gen, dtype=dtype).requires_grad_()
    table = torch.randn(b, hq, nq + nk - 1, generator=gen, dtype=dtype).requires_grad_()
    buckets = torch.randn(hq, 16, generator=gen, dtype=dtype).requires_grad_()
    return {
        "alibi": (lambda s, b_, h, i, j: s - slopes[h] * (i - j), (slopes,)),
        "table": (lambda s, b_, h, i, j: s + table[b_, h, i - j + nk - 1], (table,)),
        "buckets": (lambda s, b_, h, i, j: s + buckets[h, _bucket(i - j)], (buckets,)),
    }


@pytest.mark.parametrize("masked", [False, True], ids=["all", "blockmask"])
@pytest.mark.parametrize("sizes", [(45, 70), (70, 45)], ids=str)
@pytest.mark.parametrize("name", ["alibi", "table", "buckets"])
def test_relative_score_mods_on_fused_match_the_tensor_op_tiles(name, sizes, masked):
    nq, nk = sizes
    b, hq, hkv, d, dtype = 2, 4, 2, 16, torch.float64
    g = torch.Generator().manual_seed(8)
    q = torch.randn(b, hq, nq, d, generator=g, dtype=dtype).requires_grad_()
    k, v = (torch.randn(b, hkv, nk, d, generator=g, dtype=dtype).requires_grad_() for _ in "kv")
    fn, captured = relative_functions(b, hq, nq, nk, dtype, g)[name]
    mask = (
        create_block_mask(lambda b_, h, i, j: (i - j).abs() < 20, None, None, nq, nk,
                          device="cpu", BLOCK_SIZE=16)
        if masked else None
    )  # fmt: skip
    assert Diagonal.of(ScoreFunction.of(fn, q, b), (b, hq, nq, nk), dtype) is not None
    results = []
    for strategy in ("fused", "flash"):
        o = attngrad.flex_attention(
            q, k, v, fn, block_mask=mask, enable_gqa=True, strategy=strategy
        )
        loss = (o * torch.cos(o.detach())).sum()
        results.append((o, *torch.autograd.grad(loss, (q, k, v, *captured))))
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_a_term_out_of_bounds_at_some_distance_runs_as_a_program_where_the_mask_keeps():
    """A table of the causal distances alone, read at n - 1 - (i - j): in bounds where
    j <= i, which the BlockMask keeps, out of bounds (not wrapped) where j > i."""
    n, dtype = 40, torch.float64
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(1, 2, n, 8, generator=g, dtype=dtype).requires_grad_() for _ in "qkv")
    table = torch.randn(2, n, generator=g, dtype=dtype).requires_grad_()

    def causal_table(s, b, h, i, j):  # type: ignore[no-untyped-def]
        return s + table[h, n - 1 - (i - j)]

    mask = create_block_mask(lambda b, h, i, j: i >= j, None, None, n, n, device="cpu",
                             BLOCK_SIZE=8)  # fmt: skip
    score = ScoreFunction.of(causal_table, q, 1)
    assert score.relative and Diagonal.of(score, (1, 2, n, n), dtype) is None
    results = []
    for strategy in ("fused", "flash"):
        o = attngrad.flex_attention(q, k, v, causal_table, block_mask=mask, strategy=strategy)
        results.append((o, *torch.autograd.grad(o.sum(), (q, k, v, table))))
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
