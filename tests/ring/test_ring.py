"""Ring attention: layouts, the stats merge, the block math, errors, and real process groups.

The distributed tests start real gloo process groups (spawned processes, a
FileStore in tmp_path): one group per world size runs every case in a loop and
writes its shards to a file; the parent reassembles them with `unshard` and
judges them by the rule of `attngrad.verify.rule` against the float64 reference.
Spawning costs ~2 s per group.  The same groups run dropout and sinks, judged
against single-process flash attention under the same seed (`ExtraCase`).
"""

from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import attngrad
from attngrad import strategies
from attngrad.core.contract import Shapes
from attngrad.core.dropout import Dropout, draw_seed
from attngrad.core.interface import Backward, Problem
from attngrad.ring import ring_attention, shard, unshard
from attngrad.ring.attention import merge_partial_
from attngrad.ring.comm import RingComm
from attngrad.ring.layout import LAYOUTS, Block, shards, step_blocks
from attngrad.strategies import REGISTRY, tiled_default, unavailable_reason
from attngrad.verify.cases import Case, make_inputs
from attngrad.verify.reference import reference_attention, reference_lse
from attngrad.verify.rule import judge_outputs
from helpers import assert_rule, case

NEG_INF = float("-inf")

# ---------------------------------------------------------------------------
# shard / unshard


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_unshard_inverts_shard(layout, world):
    x = torch.randn(2, 3, 2 * world * 5, 4)
    pieces = [shard(x, r, world, layout) for r in range(world)]
    assert all(s.shape == (2, 3, 2 * 5, 4) for s in pieces)
    assert torch.equal(unshard(pieces, layout), x)
    assert torch.equal(shards(x, world, layout), torch.stack(pieces))  # all at once, one copy


def test_zigzag_pairs_an_early_chunk_with_a_late_one():
    x = torch.arange(12.0).view(12, 1)  # P = 3: six chunks of two positions
    held = [shard(x, r, 3, "zigzag").flatten().tolist() for r in range(3)]
    assert held == [[0, 1, 10, 11], [2, 3, 8, 9], [4, 5, 6, 7]]
    assert shard(x, 1, 3, "contiguous").flatten().tolist() == [4, 5, 6, 7]


def test_shard_is_a_copy():
    x = torch.randn(8, 2)
    s = shard(x, 0, 2)
    s.zero_()
    assert not torch.equal(x[:4], s)


@pytest.mark.parametrize(
    ("n", "world", "rank", "layout", "match"),
    [
        (10, 4, 0, "contiguous", "length 10.*4 equal chunks"),
        (12, 4, 0, "zigzag", "length 12.*8 equal chunks"),  # contiguous could split it
        (8, 2, 2, "contiguous", r"rank must be in \[0, 2\).*got 2"),
        (8, 0, 0, "contiguous", "world must be an int >= 1, got 0"),
        (8, 2, 0, "rows", "layout must be one of"),
    ],
)
def test_bad_shard_arguments_name_the_sizes(n, world, rank, layout, match):
    with pytest.raises(ValueError, match=match):
        shard(torch.zeros(n, 2), rank, world, layout)


def test_shard_of_a_1d_tensor_says_where_the_sequence_must_be():
    with pytest.raises(ValueError, match=r"x must be a tensor \[..., N, d\].*got \(8,\)"):
        shard(torch.zeros(8), 0, 2)


@pytest.mark.parametrize(
    ("shards", "layout", "match"),
    [
        ([], "contiguous", "shards is empty"),
        ([torch.zeros(4, 2), torch.zeros(5, 2)], "contiguous", r"\(4, 2\), \(5, 2\)"),
        ([torch.zeros(3, 2), torch.zeros(3, 2)], "zigzag", "length 3.*2 equal chunks"),
    ],
)
def test_bad_unshard_arguments_name_the_sizes(shards, layout, match):
    with pytest.raises(ValueError, match=match):
        unshard(shards, layout)


# ---------------------------------------------------------------------------
# which blocks a step computes


def test_zigzag_causal_skips_future_pairs_unmasks_past_ones_and_masks_the_diagonal():
    # P = 2, shards of 2m = 8: rank 0 holds chunks (0, 3), rank 1 holds (1, 2)
    m = 4
    first, second = slice(0, m), slice(m, 2 * m)
    both = slice(0, 2 * m)
    # origins: the global (query, key) positions of each block's first row and key
    assert step_blocks(0, 0, 2, "zigzag", 2 * m, True) == [
        Block(first, first, True, (0, 0)),  # chunk 0 x chunk 0: the diagonal
        Block(second, first, False, (3 * m, 0)),  # chunk 3 x chunk 0: the past (0 x 3 skipped)
        Block(second, second, True, (3 * m, 3 * m)),  # chunk 3 x chunk 3
    ]
    # rank 0 against rank 1's (1, 2): chunk 0 sees neither, chunk 3 sees both whole
    assert step_blocks(0, 1, 2, "zigzag", 2 * m, True) == [Block(second, both, False, (3 * m, m))]
    # rank 1 against rank 0's (0, 3): chunks 1 and 2 both see chunk 0 whole, chunk 3 not
    assert step_blocks(1, 0, 2, "zigzag", 2 * m, True) == [Block(both, first, False, (m, 0))]


def test_without_causal_every_step_is_one_unmasked_block():
    for layout, world in itertools.product(LAYOUTS, [2, 3]):
        for rank, source in itertools.product(range(world), repeat=2):
            blocks = step_blocks(rank, source, world, layout, 6, False)
            assert [(b.rows, b.cols, b.causal) for b in blocks] == [(slice(0, 6),) * 2 + (False,)]


def _global_positions(rank: int, world: int, layout: str, n: int) -> torch.Tensor:
    """The global positions of a rank's n local ones: int64 [n]."""
    return shard(torch.arange(n * world).view(-1, 1), rank, world, layout).flatten()


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_positional_blocks_sit_at_their_global_origin_and_cover_each_pair_once(
    layout, world, is_causal
):
    """What dropout needs: every block is contiguous in the global sequence, at its origin."""
    n = 4
    seen = torch.zeros(n * world, n * world, dtype=torch.int64)
    for rank, source in itertools.product(range(world), repeat=2):
        q_at, k_at = (_global_positions(r, world, layout, n) for r in (rank, source))
        for b in step_blocks(rank, source, world, layout, n, is_causal, positional=True):
            rows, cols = q_at[b.rows], k_at[b.cols]
            assert b.origin is not None
            assert torch.equal(rows, torch.arange(len(rows)) + b.origin[0])
            assert torch.equal(cols, torch.arange(len(cols)) + b.origin[1])
            visible = torch.ones(len(rows), len(cols), dtype=torch.int64)
            seen[rows.unsqueeze(-1), cols] += visible.tril() if b.causal else visible
    full = torch.ones_like(seen)
    assert torch.equal(seen, full.tril() if is_causal else full)


def test_zigzag_merges_across_a_gap_only_without_dropout():
    # P = 3: rank 0 holds chunks (0, 5), rank 1 (1, 4); no pair is adjacent in the sequence
    merged = step_blocks(0, 1, 3, "zigzag", 4, False)
    assert [(b.rows, b.cols, b.origin) for b in merged] == [(slice(0, 4), slice(0, 4), None)]
    with pytest.raises(ValueError, match=r"not adjacent in the sequence.*positional=True"):
        merged[0].score_mods(2, dropout=Dropout(0.5, 1, 2))
    split = step_blocks(0, 1, 3, "zigzag", 4, False, positional=True)
    assert [b.origin for b in split] == [(0, 2), (0, 8), (10, 2), (10, 8)]
    # rank 2 holds chunks (2, 3), adjacent: its blocks merge, origin and all
    assert step_blocks(2, 2, 3, "zigzag", 4, False, positional=True) == [
        Block(slice(0, 4), slice(0, 4), False, (4, 4))
    ]


def _causal_work(rank: int, world: int, layout: str, n: int) -> int:
    """(query, key) pairs rank computes over all steps: a causal block counts its lower triangle."""
    work = 0
    for source in range(world):
        for b in step_blocks(rank, source, world, layout, n, True):
            r, c = b.rows.stop - b.rows.start, b.cols.stop - b.cols.start
            work += r * (r + 1) // 2 if b.causal else r * c
    return work


@pytest.mark.parametrize("world", [2, 3, 4])
def test_zigzag_balances_causal_work_and_contiguous_does_not(world):
    n = 8
    zigzag = {_causal_work(r, world, "zigzag", n) for r in range(world)}
    contiguous = [_causal_work(r, world, "contiguous", n) for r in range(world)]
    assert len(zigzag) == 1
    assert contiguous == sorted(contiguous) and contiguous[0] < contiguous[-1]
    # every visible pair of the causal N x N matrix is computed exactly once
    total = world * n * (world * n + 1) // 2
    assert zigzag.pop() * world == total == sum(contiguous)


# ---------------------------------------------------------------------------
# the stats merge and the block math

DEAD = (0.0, float("inf"))  # the stats (m, log l) of a row that attends nothing


def _flash_block(q, k, v, causal=False, scale=0.5, kernel="flash"):
    mods = Block(slice(0, q.shape[2]), slice(0, k.shape[2]), causal).score_mods(k.shape[1])
    strategy = REGISTRY[kernel]
    tiles = strategy.tiles(Shapes.of(q, k, v), q.dtype, None, None)
    o, saved = strategy.forward(Problem(q, k, v, mods, scale, tiles))
    return o, saved["stats"]


def _block_backward(kernel, inputs, o, stats, cols, scale=0.5):
    """dq, dk, dv of the whole call, key block by key block into the same accumulators."""
    q, k, v, dout = (inputs[n] for n in ("q", "k", "v", "dout"))
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    strategy = REGISTRY[kernel]
    for c in cols:
        kc, vc = k[:, :, c], v[:, :, c]
        mods = Block(slice(0, q.shape[2]), c, False).score_mods(k.shape[1])
        tiles = strategy.tiles(Shapes.of(q, kc, vc), q.dtype, None, None)
        grads = (dq, dk[:, :, c], dv[:, :, c], None)
        saved = {"o": o, "stats": stats}
        problem = Problem(q, kc, vc, mods, scale, tiles)
        strategy.backward_into(Backward(problem, saved, dout, None, grads))
    return {"dq": dq, "dk": dk, "dv": dv}


# triton's block kernels run here in Triton's interpreter (TRITON_INTERPRET=1, see conftest)
by_kernel = pytest.mark.parametrize(
    "kernel",
    [
        "flash",
        pytest.param(
            "triton",
            marks=pytest.mark.skipif(
                unavailable_reason("triton", torch.device("cpu")) is not None,
                reason="Triton's interpreter is not available",
            ),
        ),
    ],
)


def test_the_default_block_kernel_is_fused_on_cpu(monkeypatch):
    assert tiled_default(torch.device("cpu"), 64, 64) == "fused"
    # flash where fused cannot be built, and on CUDA past the triton kernels' head dims
    assert tiled_default(torch.device("cuda"), 300, 64) == "flash"
    monkeypatch.setattr(strategies, "_fused_runs", lambda device: False)
    assert tiled_default(torch.device("cpu"), 64, 64) == "flash"


@by_kernel
def test_merging_two_key_halves_gives_attention_over_all_keys(kernel):
    c = case((2,), 4, 2, 9, 14, 8, 5, scale=0.5)
    inputs = make_inputs(c)
    q, k, v = (inputs[n] for n in "qkv")
    _, stats_all = _flash_block(q, k, v, kernel=kernel)
    o, stats = _flash_block(q, k[:, :, :6], v[:, :, :6], kernel=kernel)
    o_b, stats_b = _flash_block(q, k[:, :, 6:], v[:, :, 6:], kernel=kernel)
    merge_partial_(o, stats, o_b, stats_b)
    assert stats.shape == stats_all.shape == (2, 4, 9, 2)
    # the merged O, and the merged stats through backward (they rebuild P there)
    assert_rule(c, inputs, {"out": o, **_block_backward(kernel, inputs, o, stats, [slice(0, 14)])})


def _dead_like(o: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The partial of a block whose rows attend nothing: O = 0 and dead stats."""
    stats = torch.zeros(*o.shape[:-1], 2, dtype=o.dtype)
    stats[..., 1] = float("inf")
    return torch.zeros_like(o), stats


def test_a_fully_masked_partial_leaves_the_other_unchanged():
    c = case((1,), 2, 2, 5, 7, 4, 3, scale=0.5)
    inputs = make_inputs(c)
    o0, stats0 = _flash_block(*(inputs[n] for n in "qkv"))
    o, stats = o0.clone(), stats0.clone()
    merge_partial_(o, stats, *_dead_like(o))
    assert torch.equal(stats[..., 0], stats0[..., 0])
    assert_rule(c, inputs, {"out": o, **_block_backward("flash", inputs, o, stats, [slice(0, 7)])})
    # and merged into an empty state (O = 0, dead stats), a partial comes through
    o, stats = _dead_like(o0)
    merge_partial_(o, stats, o0, stats0)
    assert torch.equal(stats[..., 0], stats0[..., 0])
    assert_rule(c, inputs, {"out": o, **_block_backward("flash", inputs, o, stats, [slice(0, 7)])})


def test_a_fully_masked_partial_leaves_the_other_bit_for_bit():
    # regression: merge_partial_ scaled O by w * (1 / l) and rebuilt log l as
    # log(exp(log l)), so a partial of weight 0 moved the other by an ulp
    f64 = dict(dtype=torch.float64)
    o = torch.randn(64, 4, **f64)
    stats = torch.stack((torch.randn(64, **f64), torch.rand(64, **f64) * 3), -1)
    o0, stats0 = o.clone(), stats.clone()
    merge_partial_(o, stats, *_dead_like(o))
    assert torch.equal(o, o0) and torch.equal(stats, stats0)
    o, stats = _dead_like(o0)
    merge_partial_(o, stats, o0, stats0)
    assert torch.equal(o, o0) and torch.equal(stats, stats0)


def test_two_fully_masked_partials_merge_to_zero_not_nan():
    o, stats = torch.zeros(2, 3), torch.tensor([DEAD] * 2)
    merge_partial_(o, stats, torch.zeros(2, 3), torch.tensor([DEAD] * 2))
    assert torch.equal(o, torch.zeros(2, 3))
    assert torch.equal(stats, torch.tensor([DEAD] * 2))


def test_merge_does_not_overflow_where_exp_lse_would():
    # exp(800) overflows float64; the merge only ever takes exp of max differences <= 0.
    # As a block would give them: one key per part, scores 800 (value 1) and 790 (value 3).
    c = case((1,), 1, 1, 1, 2, 1, 2, scale=1.0)
    inputs = make_inputs(c)
    inputs["q"] = torch.full((1, 1, 1, 1), 10.0, dtype=torch.float64)
    inputs["k"] = torch.tensor([80.0, 79.0], dtype=torch.float64).view(1, 1, 2, 1)
    inputs["v"] = torch.tensor([[1.0, 1.0], [3.0, 3.0]], dtype=torch.float64).view(1, 1, 2, 2)
    o, stats = torch.ones(1, 2, dtype=torch.float64), torch.tensor([[800.0, 0.0]]).double()
    o_b, stats_b = torch.full((1, 2), 3.0, dtype=torch.float64), torch.tensor([[790.0, 0.0]])
    merge_partial_(o, stats, o_b, stats_b.double())
    assert stats[0, 0] == 800.0 and torch.isfinite(stats).all()
    assert_rule(c, inputs, {"out": o.view(1, 1, 1, 2)})


@by_kernel
def test_block_backward_with_the_global_stats_and_delta_sums_to_the_gradients(kernel):
    """Per key block, P = exp((S - m) - log l) from the global row stats and
    Delta = rowsum(dO * O_final) (module math)."""
    c = case((1,), 4, 2, 10, 12, 8, 6, scale=0.5)
    inputs = make_inputs(c)
    o, stats = _flash_block(*(inputs[n] for n in "qkv"), kernel=kernel)
    # two key blocks add into the same accumulators
    got = _block_backward(kernel, inputs, o, stats, [slice(0, 5), slice(5, 12)])
    assert_rule(c, inputs, {"out": o, **got})


# ---------------------------------------------------------------------------
# one rank: errors and the plain-attention fallback


def _qkv(n: int = 8, heads_q: int = 2, heads_kv: int = 2, seq_k: int | None = None):
    q = torch.randn(1, heads_q, n, 4)
    kv = torch.randn(1, heads_kv, n if seq_k is None else seq_k, 4)
    return q, kv, kv


@pytest.mark.parametrize(
    ("inputs", "kwargs", "error", "match"),
    [
        (_qkv(), {"layout": "rows"}, ValueError, "layout must be one of 'contiguous', 'zigzag'"),
        (_qkv(5), {"layout": "zigzag"}, ValueError, "odd length 5"),
        (_qkv(6, seq_k=8), {}, ValueError, "query has 6 positions but key and value have 8"),
        (_qkv(), {"timeout": 0}, ValueError, "timeout must be .* > 0, got 0"),
        (_qkv(), {"timeout": float("nan")}, ValueError, "timeout .* got nan"),
        (_qkv(), {"timeout": "60"}, TypeError, "timeout must be a number of seconds, got '60'"),
        (_qkv(), {"strategy": "explicit"}, ValueError, "strategy must be one of 'flash'"),
        (_qkv(heads_q=3), {}, ValueError, r"query heads \(3\) must be a multiple"),
        (_qkv(), {"group": "x"}, TypeError, "group must be a torch.distributed.ProcessGroup"),
        (_qkv(), {"dropout_p": 1.5}, ValueError, r"dropout_p must be in \[0, 1\], got 1.5"),
        (_qkv(), {"dropout_p": "0.1"}, TypeError, "dropout_p must be a float in"),
        (_qkv(), {"generator": 0}, TypeError, "generator must be a torch.Generator or None"),
        (_qkv(), {"sinks": torch.zeros(3)}, ValueError, r"sinks has shape \(3,\).*\[Hq\] = \[2\]"),
        (_qkv(), {"sinks": torch.zeros(2).long()}, TypeError, "sinks has dtype torch.int64"),
    ],
    ids=[
        "layout",
        "zigzag-odd",
        "seq-differs",
        "timeout0",
        "timeout-nan",
        "timeout-str",
        "strategy",
        "heads",
        "group",
        "dropout-range",
        "dropout-str",
        "generator",
        "sinks-shape",
        "sinks-dtype",
    ],
)
def test_bad_arguments_raise_naming_the_value(inputs, kwargs, error, match):
    with pytest.raises(error, match=match):
        ring_attention(*inputs, **kwargs)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_without_a_process_group_it_is_plain_attention(layout):
    assert not dist.is_initialized()
    q = torch.randn(2, 4, 10, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, 10, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 2, 10, 8, dtype=torch.float64, requires_grad=True)
    got = ring_attention(q, k, v, is_causal=True, scale=0.3, layout=layout)
    want = attngrad.attention(q, k, v, is_causal=True, scale=0.3, enable_gqa=True, strategy="fused")
    assert torch.equal(got, want)
    assert got.grad_fn.name() == want.grad_fn.name()


def test_without_a_process_group_dropout_and_sinks_pass_to_attention():
    q, k, v = (torch.randn(1, 4, 6, 4, dtype=torch.float64) for _ in range(3))
    sinks = torch.randn(4, dtype=torch.float64)
    kw = {"is_causal": True, "dropout_p": 0.5, "sinks": sinks}
    got = ring_attention(q, k, v, generator=torch.Generator().manual_seed(3), **kw)
    want = attngrad.attention(
        q, k, v, generator=torch.Generator().manual_seed(3), strategy="fused", **kw
    )
    assert torch.equal(got, want)


def test_world_size_one_is_plain_attention(tmp_path):
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        q, k, v = _qkv()
        got = ring_attention(q, k, v, is_causal=True)
        assert torch.equal(got, attngrad.attention(q, k, v, is_causal=True, strategy="fused"))
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------
# real process groups


@dataclass(frozen=True)
class RingCase:
    """One ring call: the full problem as a `verify.Case` (N = 2 * P * chunk) and its layout."""

    case: Case
    layout: str

    @property
    def id(self) -> str:
        return f"{self.case.id}-{self.layout}"


# (lead, Hq, Hkv, chunk, d, dv, dtype, causal, layout, scale).  chunk = 5: odd shard
# sizes (10 per rank); GQA with dv != d and a custom scale; no leading dims (the
# [H, N, d] layout) last (the saved-tensor check runs it again).
RING_SIZES = [
    (lead, hq, hkv, 5, d, dv, dtype, causal, layout, scale)
    for dtype in (torch.float64, torch.float32)
    for causal in (False, True)
    for layout in LAYOUTS
    for lead, hq, hkv, d, dv, scale in [((2,), 2, 2, 8, 8, None), ((1,), 4, 2, 8, 5, 0.3)]
] + [
    # bfloat16: k/v travel in bf16, partial outputs and dK/dV accumulate in float32
    ((1,), 4, 2, 5, 8, 8, torch.bfloat16, True, "zigzag", None),
    ((), 3, 1, 3, 4, 4, torch.float64, True, "zigzag", None),
]


def _ring_cases(world: int) -> list[RingCase]:
    """RING_SIZES at ``world`` ranks (ring attention always passes enable_gqa)."""
    cases = []
    for lead, hq, hkv, chunk, d, dv, dtype, causal, layout, scale in RING_SIZES:
        n, mask = 2 * chunk * world, "causal" if causal else "none"
        c = case(lead, hq, hkv, n, n, d, dv, mask, dtype=dtype, scale=scale, enable_gqa=True)
        cases.append(RingCase(c, layout))
    return cases


def _cases(world: int) -> list[tuple[RingCase, dict]]:
    """Every case with its full inputs; the parent and each worker draw the same ones."""
    return [(rc, make_inputs(rc.case, seed)) for seed, rc in enumerate(_ring_cases(world))]


def _run_case(rc: RingCase, full: dict, rank: int, world: int, group=None):
    """This rank's out, dq, dk, dv shards for one case."""
    c = rc.case
    mine = {n: shard(full[n], rank, world, rc.layout).to(c.dtype) for n in ("q", "k", "v", "dout")}
    leaves = [mine[n].clone().requires_grad_() for n in "qkv"]
    out = ring_attention(
        *leaves, group=group, is_causal=c.mask == "causal", scale=c.scale, layout=rc.layout
    )
    grads = torch.autograd.grad(out, leaves, mine["dout"])
    unchanged = all(torch.equal(leaf, mine[n]) for leaf, n in zip(leaves, "qkv", strict=True))
    return {"out": out.detach(), "dq": grads[0], "dk": grads[1], "dv": grads[2]}, unchanged


def _lse_case(cases: list[tuple[RingCase, dict]]) -> tuple[RingCase, dict]:
    """The first float64 causal case with GQA: where lse's gradient is checked."""
    return next(
        (rc, full)
        for rc, full in cases
        if rc.case.dtype == torch.float64 and rc.case.mask == "causal" and rc.case.shapes.groups > 1
    )


def _lse_shards(rc: RingCase, full: dict, rank: int, world: int) -> dict[str, torch.Tensor]:
    """This rank's lse shard and dq, dk, dv of a loss on out and lse (return_lse=True)."""
    c = rc.case
    mine = {n: shard(full[n], rank, world, rc.layout).to(c.dtype) for n in ("q", "k", "v", "dout")}
    leaves = [mine[n].clone().requires_grad_() for n in "qkv"]
    out, lse = ring_attention(
        *leaves, is_causal=c.mask == "causal", scale=c.scale, layout=rc.layout, return_lse=True
    )
    loss = (out * mine["dout"]).sum() + lse.sin().sum()
    grads = torch.autograd.grad(loss, leaves)
    return {"lse": lse.detach().unsqueeze(-1), **dict(zip(("dq", "dk", "dv"), grads, strict=True))}


def _assert_lse(ranks: list[dict], world: int) -> None:
    """lse and the gradients of the loss on it, gathered, against the float64 composite."""
    rc, full = _lse_case(_cases(world))
    c = rc.case
    got = {
        n: unshard([res["lse"][n] for res in ranks], rc.layout) for n in ("lse", "dq", "dk", "dv")
    }
    leaves = [full[n].clone().requires_grad_() for n in "qkv"]
    kw = {"is_causal": True, "scale": c.scale, "enable_gqa": True}
    out = reference_attention(*leaves, **kw)
    lse = reference_lse(leaves[0], leaves[1], **kw)
    want = torch.autograd.grad((out * full["dout"]).sum() + lse.sin().sum(), leaves)
    torch.testing.assert_close(got["lse"].squeeze(-1), lse.detach(), rtol=1e-10, atol=1e-10)
    for name, w in zip(("dq", "dk", "dv"), want, strict=True):
        torch.testing.assert_close(got[name], w, rtol=1e-10, atol=1e-10)


# -- dropout and sinks: against single-process flash under the same seed


@dataclass(frozen=True)
class ExtraCase:
    """A ring call with dropout and / or sinks, [2, Hq=4, N, d=4] with Hkv = 2, dv = 3, float64.

    Its twin is ``attention(..., strategy="flash", enable_gqa=True)`` on the
    gathered sequence.  Rank r seeds its generator (``generator=``, or the
    default one via torch.manual_seed) with DROPOUT_SEED + r: rank 0 as the
    single process, the others differently, so only rank 0's draw can match.
    """

    layout: str
    causal: bool
    dropout_p: float
    sinks: str | None = None  # "head": [Hq]; "token": [Hq, N]
    default_generator: bool = False

    @property
    def id(self) -> str:
        causal = "causal" if self.causal else "full"
        sinks = self.sinks or "nosinks"
        seeded = "default" if self.default_generator else "generator"
        return f"{self.layout}-{causal}-p{self.dropout_p}-{sinks}-{seeded}"


DROPOUT_SEED = 1234
EXTRA_CASES = [
    *(ExtraCase(layout, causal, 0.3) for layout in LAYOUTS for causal in (False, True)),
    ExtraCase("zigzag", True, 0.0, "head"),
    ExtraCase("contiguous", False, 0.3, "token", default_generator=True),
]


def _extra_inputs(ec: ExtraCase, world: int, seed: int) -> dict[str, torch.Tensor]:
    """Full float64 q, k, v, dout (and sinks) of the case: N = 6 * world."""
    gen = torch.Generator().manual_seed(seed)
    n = 6 * world

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    full = {"q": randn(2, 4, n, 4), "k": randn(2, 2, n, 4), "v": randn(2, 2, n, 3)}
    full["dout"] = randn(2, 4, n, 3)
    if ec.sinks is not None:
        full["sinks"] = randn(4) if ec.sinks == "head" else randn(4, n)
    return full


def _extra_cases(world: int) -> list[tuple[ExtraCase, dict[str, torch.Tensor]]]:
    return [(ec, _extra_inputs(ec, world, seed)) for seed, ec in enumerate(EXTRA_CASES)]


def _seeded(ec: ExtraCase, rank: int) -> torch.Generator:
    """The generator rank draws from, seeded DROPOUT_SEED + rank (rank 0: the single process's)."""
    seed = DROPOUT_SEED + rank
    return torch.manual_seed(seed) if ec.default_generator else torch.Generator().manual_seed(seed)


def _attend(ec: ExtraCase, full: dict, rank: int, world: int, call) -> dict[str, torch.Tensor]:
    """out and the gradients of q, k, v (and sinks) of ``call`` on rank's shard, float64.

    With world = 1 that is the full sequence (shard 0 of 1).
    """
    mine = {n: shard(full[n], rank, world, ec.layout) for n in ("q", "k", "v", "dout")}
    leaves = {n: mine[n].clone().requires_grad_() for n in "qkv"}
    if ec.sinks is not None:
        sinks = full["sinks"]
        if ec.sinks == "token":  # this rank's rows
            sinks = shard(sinks.unsqueeze(-1), rank, world, ec.layout).squeeze(-1)
        leaves["sinks"] = sinks.clone().requires_grad_()
    gen = _seeded(ec, rank)
    out = call(
        leaves["q"], leaves["k"], leaves["v"], is_causal=ec.causal, dropout_p=ec.dropout_p,
        generator=None if ec.default_generator else gen, sinks=leaves.get("sinks"),
    )  # fmt: skip
    grads = torch.autograd.grad(out, list(leaves.values()), mine["dout"])
    got = {"out": out.detach(), **{f"d{n}": g for n, g in zip(leaves, grads, strict=True)}}
    return {**got, "rng": gen.get_state()}


def _ring_call(ec: ExtraCase):
    return lambda *qkv, **kw: ring_attention(*qkv, layout=ec.layout, **kw)


def _flash_call(*qkv, **kw):
    return attngrad.attention(*qkv, strategy="flash", enable_gqa=True, **kw)


def _gather_extra(ec: ExtraCase, ranks: list[dict]) -> dict[str, torch.Tensor]:
    """The ranks' results over the full sequence; a per-head sink's gradient summed over ranks."""
    got = {n: unshard([res[n] for res in ranks], ec.layout) for n in ("out", "dq", "dk", "dv")}
    if ec.sinks == "head":  # each rank holds its rows' share: all_reduce(sum) in training
        got["dsinks"] = sum(res["dsinks"] for res in ranks)
    elif ec.sinks == "token":
        got["dsinks"] = unshard([res["dsinks"].unsqueeze(-1) for res in ranks], ec.layout)[..., 0]
    return got


def _assert_extra(ranks: list[dict], world: int) -> None:
    """Dropout and sinks through the ring equal single-process flash under the same seed."""
    for ec, full in _extra_cases(world):
        per_rank = [res["extra"][ec.id] for res in ranks]
        want = _attend(ec, full, 0, 1, _flash_call)
        got = _gather_extra(ec, per_rank)
        assert got.keys() == want.keys() - {"rng"}
        for name, w in got.items():
            torch.testing.assert_close(w, want[name], rtol=1e-10, atol=1e-10, msg=ec.id + name)
        if ec.dropout_p > 0:  # the mask is really there
            plain = _attend(replace(ec, dropout_p=0.0), full, 0, 1, _flash_call)
            assert not torch.allclose(plain["out"], want["out"]), ec.id
        for r, res in enumerate(per_rank):  # each generator advanced as attention's would
            gen = _seeded(ec, r)
            if ec.dropout_p > 0:  # one draw of (seed, offset)
                draw_seed(gen.device, gen)
            assert torch.equal(res["rng"], gen.get_state()), (ec.id, r)


def _error_of(call) -> tuple[str, str, float]:
    """The exception ``call`` raises (type name, message) and the seconds it took."""
    start = time.monotonic()
    try:
        call()
    except Exception as e:
        return type(e).__name__, str(e), time.monotonic() - start
    return "no error", "", time.monotonic() - start


# Short so that the failure scenarios are quick; long enough for a loaded 2-core machine.
TIMEOUT = 3.0


def _peer_dies(rank: int, world: int, out_dir: Path) -> tuple[str, str, float] | None:
    """Rank 1 exits at its first backward send; the others report what they raised."""
    if rank == 1:
        send_recv, calls = RingComm.send_recv, []

        def die_in_backward(self, tensors):
            calls.append(1)
            if len(calls) == world:  # forward sends P - 1 times, then backward starts
                os._exit(1)
            return send_recv(self, tensors)

        RingComm.send_recv = die_in_backward  # type: ignore[method-assign]
    q = torch.randn(1, 2, 6, 4, requires_grad=True)
    return _error_of(lambda: ring_attention(q, q, q, timeout=TIMEOUT).sum().backward())


def _peer_never_calls(rank: int, world: int, out_dir: Path) -> tuple[str, str, float] | None:
    """Rank 1 stays in the group but never calls ring_attention (until rank 0 has reported)."""
    if rank == 1:
        while not (out_dir / "failure0.pt").exists():
            time.sleep(0.05)
        return None
    return _error_of(lambda: ring_attention(*_qkv(), timeout=TIMEOUT))


def _ring_worker(rank: int, world: int, store: str, out_dir: str) -> None:
    """Every case, the cross-rank errors, then (the group breaks there) a peer failure."""
    torch.set_num_threads(1)  # as the conftest does; its NaN fill is left out: turning on
    # deterministic mode costs a spawned process ~2.4 s
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    cases = _cases(world)
    results: dict[str, object] = {}
    for rc, full in cases:
        results[rc.id], results[rc.id + "/unchanged"] = _run_case(rc, full, rank, world)
    # what forward keeps for backward: this rank's own q, k, v, O and row stats only
    rc, full = cases[-1]
    saved: list[tuple[int, ...]] = []
    with torch.autograd.graph.saved_tensors_hooks(
        lambda t: saved.append(tuple(t.shape)) or t, lambda t: t
    ):
        _run_case(rc, full, rank, world)
    results["saved"] = saved
    results["lse"] = _lse_shards(*_lse_case(cases), rank, world)
    results["extra"] = {
        ec.id: _attend(ec, full, rank, world, _ring_call(ec)) for ec, full in _extra_cases(world)
    }
    q = torch.randn(1, 2, 4, 8, requires_grad=True)
    # double backward runs on the ring (tests/ring/test_ring_derivatives.py judges it)
    results["create_graph"] = _error_of(
        lambda: torch.autograd.grad(ring_attention(q, q, q).square().sum(), q, create_graph=True)
    )[:2]
    # shards that differ across ranks: every rank raises the same ValueError
    q = torch.randn(1, 2, 4 + 2 * (rank == 1), 8)
    results["unequal"] = _error_of(lambda: ring_attention(q, q, q))[:2]
    q, kv = torch.randn(1, 2 + 2 * (rank == 1), 4, 8), torch.randn(1, 2, 4, 8)
    results["heads"] = _error_of(lambda: ring_attention(q, kv, kv))[:2]
    q = torch.randn(1, 2, 4, 8)
    results["dropout_p"] = _error_of(lambda: ring_attention(q, q, q, dropout_p=0.25 * (1 + rank)))[
        :2
    ]
    sinks = torch.zeros(2) if rank == 0 else None  # per-head sinks on rank 0 alone
    results["sinks"] = _error_of(lambda: ring_attention(q, q, q, sinks=sinks))[:2]
    if world == 3:  # a ring over a subgroup: ranks 0 and 2 (global ranks differ from group ranks)
        sub = dist.new_group([0, 2])
        if rank != 1:
            rc, full = cases[0]
            results["subgroup"], _ = _run_case(rc, full, rank // 2, 2, group=sub)
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    failure = (_peer_dies if world == 3 else _peer_never_calls)(rank, world, Path(out_dir))
    torch.save(failure, Path(out_dir) / f"failure{rank}.pt")
    os._exit(0)  # the group is broken now: do not wait on it at shutdown


def _launch(world: int, tmp_path: Path, deadline: float = 60.0) -> list[int | None]:
    """Run `_ring_worker` on ``world`` spawned processes; their exit codes."""
    ctx = mp.get_context("spawn")
    store = str(tmp_path / "store")
    procs = [
        ctx.Process(target=_ring_worker, args=(rank, world, store, str(tmp_path)))
        for rank in range(world)
    ]
    for p in procs:
        p.start()
    end = time.monotonic() + deadline
    for p in procs:
        p.join(max(0.0, end - time.monotonic()))
    for p in procs:
        if p.is_alive():  # never leave a worker behind, even when the test fails
            p.kill()
            p.join()
    return [p.exitcode for p in procs]


def _case_failures(rc: RingCase, got: dict[str, torch.Tensor], full: dict) -> list[str]:
    """Out and every gradient against the float64 reference, by the rule of `attngrad.verify.rule`."""
    c = rc.case
    failures = [f"{rc.id} {name} is {t.dtype}" for name, t in got.items() if t.dtype != c.dtype]
    return failures + [f"{rc.id} {v}" for v in judge_outputs(c, full, got) if not v.passed]


def _gathered(ranks: list[dict], key: str, layout: str) -> dict[str, torch.Tensor]:
    """out, dq, dk, dv over the full sequence from each rank's shards under ``key``."""
    return {n: unshard([res[key][n] for res in ranks], layout) for n in ("out", "dq", "dk", "dv")}


def _assert_ring_runs(world: int, tmp_path: Path) -> list[dict]:
    """Run the group; assert every case, the saved tensors and the cross-rank errors."""
    exits = _launch(world, tmp_path)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    failures = []
    for rc, full in _cases(world):
        failures += _case_failures(rc, _gathered(ranks, rc.id, rc.layout), full)
        failures += [
            f"{rc.id}: rank {r} modified an input"
            for r, res in enumerate(ranks)
            if not res[rc.id + "/unchanged"]
        ]
    assert not failures, "\n".join(failures)

    sh = _ring_cases(world)[-1].case.shapes  # no leading dims: B = 1 in [B, H, n, x]
    n, hq, hkv = sh.seq_q // world, sh.heads_q, sh.heads_kv
    q, kv, stats = (1, hq, n, sh.head_dim), (1, hkv, n, sh.head_dim), (1, hq, n, 2)
    for res in ranks:  # q, k, v, O, stats of this rank's shard: no other rank's block
        assert res["saved"] == [q, kv, kv, q, stats]

    _assert_lse(ranks, world)
    _assert_extra(ranks, world)
    for r, res in enumerate(ranks):
        kind, message = res["create_graph"]
        assert kind == "no error", (r, message)
        kind, message = res["unequal"]
        assert kind == "ArgumentError" and "seq_len: rank 0 4, rank 1 6" in message, (r, message)
        kind, message = res["heads"]
        assert kind == "ArgumentError" and "heads_q: rank 0 2, rank 1 4" in message, (r, message)
        kind, message = res["dropout_p"]
        assert kind == "ArgumentError" and "dropout_p: rank 0 0.25, rank 1 0.5" in message, (
            r,
            message,
        )
        kind, message = res["sinks"]
        assert (
            kind == "ArgumentError" and "sinks: rank 0 float32[1, 2, 1], rank 1 None" in message
        ), (
            r,
            message,
        )
    return [exits, *ranks]


def _assert_timed_out(failure: tuple[str, str, float], rank: int, world: int, what: str) -> float:
    kind, message, elapsed = failure
    assert kind == "RingTimeoutError", message
    assert f"rank {rank} of {world}: {what}" in message and f"timeout={TIMEOUT:g} s" in message
    # it raised, it did not hang: a generous bound, since a loaded 2-core machine (pytest -n 2)
    # can stall a worker for seconds; a hang would run into _launch's 60 s deadline instead
    assert elapsed < TIMEOUT + 20.0, elapsed
    return elapsed


def test_two_ranks_match_one_process_and_time_out_on_a_peer_that_never_calls(tmp_path):
    exits, *_ = _assert_ring_runs(2, tmp_path)
    assert exits == [0, 0]
    failure = torch.load(tmp_path / "failure0.pt")
    elapsed = _assert_timed_out(failure, 0, 2, "gathering the shard shapes")
    assert elapsed >= TIMEOUT - 0.1  # nothing failed: it waited the whole timeout


def test_three_ranks_match_one_process_and_raise_when_a_peer_dies(tmp_path):
    exits, *ranks = _assert_ring_runs(3, tmp_path)
    assert exits == [0, 1, 0]  # rank 1 died mid-run, the others finished
    for rank in (0, 2):
        failure = torch.load(tmp_path / f"failure{rank}.pt")
        _assert_timed_out(failure, rank, 3, "sending to / receiving from")
    # a ring over the subgroup of global ranks 0 and 2
    rc, full = _cases(3)[0]
    assert not _case_failures(rc, _gathered([ranks[0], ranks[2]], "subgroup", rc.layout), full)
