"""flex_ring_attention (score_mod, BlockMask) through both schemes, packed_ring_attention
(cu_seqlens) through the all-to-all; balanced_layout.

One group of 4 forkserver gloo processes (`process_group.shared_run`) runs every case at
P = 2, 3 and 4 (subgroups of ranks 0..P-1), then the cross-rank errors at P = 2 and the
ring's block-kernel calls at P = 4.  Each
rank saves its shards of out, lse and the derivatives, and the score_mod's captured
tensor's gradient all-reduced over the group; the tests reassemble the shards with
`unshard` and judge them against the single-process `attngrad.flex_attention` (or
`attngrad.attention` with cu_seqlens_q) call: float64 to 1e-10, float32 by the rule of
`attngrad.verify.rule` against the float64 reference.
"""

from __future__ import annotations

import functools
import gc
import os
import re
import weakref
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from duals import forward_mode, forward_over_reverse, func_forward_over_reverse, func_jvp
from process_group import join, launch, shared_run
from torch.distributed.nn.functional import all_reduce

import attngrad
from attngrad.core.block_table import BlockTable
from attngrad.core.contract import Shapes
from attngrad.core.score_function import ScoreFunction
from attngrad.core.score_program import compile_score
from attngrad.ring import (
    balanced_layout,
    flex_ring_attention,
    packed_ring_attention,
    rank_pairs,
    rank_work,
    ring_attention,
    shard,
    unshard,
)
from attngrad.ring.balance import block_work
from attngrad.ring.flex import at_heads, local_block_mask
from attngrad.ring.flex_pairs import FlexPairs
from attngrad.ring.shifted import pair_block_mask
from attngrad.strategies import REGISTRY
from attngrad.verify.cases import Case, make_inputs
from attngrad.verify.flex_cases import block_mask as verify_block_mask
from attngrad.verify.flex_cases import scenario
from attngrad.verify.rule import judge_outputs

F64, F32 = torch.float64, torch.float32
BLOCK = 4  # the BlockMasks' blocks: N = 8P spans 2P of them
REACH = 3  # the relative table's clipped distances


# ---------------------------------------------------------------------------
# the score and mask functions, written for the full sequence and global heads


def _alibi(theta: torch.Tensor):
    return lambda s, b, h, i, j: s + theta[h] * (j - i)


def _relative(theta: torch.Tensor):
    def score_mod(s, b, h, i, j):
        return s + theta[h, torch.clamp(j - i, -REACH, REACH) + REACH]

    return score_mod


SCORES = {"alibi": _alibi, "relative": _relative}


def _documents(n: int) -> list[int]:
    """Mixed lengths, no boundary on a block's edge: [0, 3, N/2 + 1, N - 2, N]."""
    return [0, 3, n // 2 + 1, n - 2, n]


def _doc_ids(n: int) -> torch.Tensor:
    cu = _documents(n)
    return torch.repeat_interleave(torch.arange(len(cu) - 1), torch.tensor(cu).diff())


@functools.cache
def _block_mask(name: str, n: int, heads: int, block: int = BLOCK):
    """The BlockMask called ``name`` over [N, N] in blocks of ``block``, built once per process
    (the same object at every call: the caches keyed by it are exercised too)."""
    docs = _doc_ids(n)
    masks = {
        "causal": lambda b, h, i, j: j <= i,
        "document": lambda b, h, i, j: docs[i] == docs[j],
        "causal-document": lambda b, h, i, j: (j <= i) & (docs[i] == docs[j]),
        "per-head": lambda b, h, i, j: (j <= i) & (i - j < 2 + 3 * h),  # a window per head
    }
    per_head = heads if name == "per-head" else None
    return attngrad.create_block_mask(masks[name], None, per_head, n, n, BLOCK_SIZE=block)


@dataclass(frozen=True)
class FlexShardCase:
    """One call at ``world`` ranks over [B = 2, Hq = 2P, N = 8P, d = 4] against [Hkv = P, dv = 3]
    (scheme "all_to_all"), or over [B = 1, Hq = 2, N = 64 or 96, d = 8] against [Hkv = 1,
    dv = 8] (scheme "ring": chunks of 16, several pairs of blocks each).

    score: a key of `SCORES` (its theta learnable) or None; mask: a `_block_mask` name or
    None, in blocks of ``block`` (the ring's pairs start on block edges where it divides
    16, else inside blocks); verify: a scenario of `attngrad.verify.flex_cases` instead of
    both (its score, theta and BlockMask, N = 48: the float32 cases the rule judges);
    packed: cu_seqlens through `packed_ring_attention` (causal) instead of flex; order:
    "first" (out, lse and the gradients of out * dout + sin(lse)), "second" (those with
    create_graph, then the gradients of the sum of their squares), "hvp" (the gradients'
    tangents along the inputs' tangents: forward over reverse), "forward" (forward_ad
    tangents) or "func" and "func-hvp" (forward mode and forward over reverse through
    torch.func).
    """

    world: int
    score: str | None = None
    mask: str | None = None
    layout: str = "zigzag"
    dtype: torch.dtype = F64
    order: str = "first"
    strategy: str = "flash"
    verify: str | None = None
    packed: bool = False
    scheme: str = "all_to_all"
    block: int = BLOCK

    @property
    def id(self) -> str:
        what = self.verify or ("packed" if self.packed else f"{self.score}+{self.mask}")
        what += "" if self.block == BLOCK else f"/{self.block}"
        dtype = str(self.dtype).removeprefix("torch.")
        return (
            f"{self.scheme}-P{self.world}-{self.layout}-{what}-{dtype}-{self.order}-{self.strategy}"
        )

    @property
    def case(self) -> Case:
        if self.verify:
            shapes = Shapes((2,), 2 * self.world, self.world, 48, 48, 4, 3)
        elif self.scheme == "ring":
            n = 96 if self.world == 3 else 64
            shapes = Shapes((1,), 2, 1, n, n, 8, 8)
        else:
            shapes = Shapes((2,), 2 * self.world, self.world, 8 * self.world, 8 * self.world, 4, 3)
        return Case(shapes, self.dtype, enable_gqa=True, flex=self.verify)


def _ring(world: int, score: str | None, mask: str | None, layout: str = "zigzag",
          **kw) -> FlexShardCase:  # fmt: skip
    return FlexShardCase(world, score, mask, layout, scheme="ring", **kw)


CASES = [
    *(FlexShardCase(p, "alibi", "causal") for p in (2, 3, 4)),
    FlexShardCase(3, "relative", None, "contiguous"),
    FlexShardCase(2, "relative", "causal-document"),
    FlexShardCase(4, None, "document"),
    FlexShardCase(4, "alibi", "per-head", "contiguous"),
    FlexShardCase(3, None, "per-head"),
    FlexShardCase(2, "alibi", "causal", order="second"),
    FlexShardCase(2, "relative", "per-head", order="forward"),
    FlexShardCase(3, "relative", "causal", order="func", strategy="fused"),
    FlexShardCase(2, "alibi", "causal-document", strategy="fused"),
    FlexShardCase(4, "relative", "per-head", strategy="fused"),
    FlexShardCase(3, dtype=F32, verify="alibi"),
    FlexShardCase(2, dtype=F32, verify="document", layout="contiguous"),
    FlexShardCase(2, packed=True),
    FlexShardCase(4, packed=True, layout="contiguous", order="second"),
    # scheme="ring": every pair's local call at its global origin
    _ring(2, "alibi", "causal"),
    _ring(3, "alibi", "causal", strategy="fused"),
    _ring(4, "alibi", "causal", "contiguous"),
    _ring(2, "relative", None, "contiguous", strategy="fused"),
    _ring(3, None, "document", "contiguous"),
    _ring(4, "relative", "causal-document", strategy="fused"),
    # blocks of 12 and 24: pairs that start inside a block (their BlockMask from <= 2 x 2)
    _ring(2, "relative", "causal-document", block=12, strategy="fused"),
    _ring(3, "alibi", "document", block=12),
    _ring(4, "alibi", "per-head", "contiguous", block=24, strategy="fused"),
    _ring(2, "alibi", "causal", order="second"),
    _ring(3, "relative", "causal-document", "contiguous", order="second", strategy="fused"),
    _ring(2, "relative", "per-head", order="forward", strategy="fused"),
    _ring(3, "alibi", "causal-document", order="forward"),
    _ring(2, "relative", "causal-document", order="func", strategy="fused"),
    _ring(3, "alibi", "causal", "contiguous", order="func"),
    _ring(3, None, None, dtype=F32, verify="alibi", strategy="fused"),
    _ring(2, "alibi", "causal-document", order="hvp", strategy="fused"),
    _ring(3, "relative", "causal", "contiguous", order="hvp"),
    _ring(2, "relative", "causal-document", order="func-hvp", strategy="fused"),
    FlexShardCase(2, "alibi", "causal", order="hvp"),
]


def _inputs(fc: FlexShardCase) -> dict:
    """The full float64 inputs (q, k, v, dout; theta when the score_mod reads one) and the
    tangents of forward mode."""
    seed = CASES.index(fc)
    full = make_inputs(fc.case, seed)
    gen = torch.Generator().manual_seed(100 + seed)
    hq = fc.case.shapes.heads_q
    if fc.score == "alibi":
        full["theta"] = 2.0 ** (-torch.arange(1, hq + 1, dtype=F64)) + 0.1 * torch.rand(
            hq, generator=gen, dtype=F64
        )
    elif fc.score == "relative":
        full["theta"] = 0.5 * torch.randn(hq, 2 * REACH + 1, generator=gen, dtype=F64)
    for name in ("q", "k", "v", "theta"):
        if full.get(name) is not None:
            full["t" + name] = torch.randn(full[name].shape, generator=gen, dtype=F64)
    return full


def _call(fc: FlexShardCase, x: dict, flex, packed):
    """(out, lse) of ``flex`` (flex_attention-style) or ``packed`` on the tensors x."""
    n = fc.case.shapes.seq_q
    if fc.packed:
        return packed(x["q"], x["k"], x["v"], torch.tensor(_documents(fc.case.shapes.seq_q)))
    theta = x.get("theta")
    if fc.verify:
        s = scenario(fc.verify)
        score = None if s.score is None else s.score(theta)
        blocks = verify_block_mask(fc.verify, n, n)
    else:
        score = None if fc.score is None else SCORES[fc.score](theta)
        heads = fc.case.shapes.heads_q
        blocks = None if fc.mask is None else _block_mask(fc.mask, n, heads, fc.block)
    return flex(x["q"], x["k"], x["v"], score, blocks)


def _run(fc: FlexShardCase, full: dict, rank: int, world: int, flex, packed, group=None) -> dict:
    """out, lse and the case's derivatives on rank's shards (world 1: the whole); theta's
    gradients all-reduced over ``group``."""
    mine = {}
    for name, t in full.items():
        if t is None:
            continue
        if name.removeprefix("t") in ("q", "k", "v", "dout"):
            t = shard(t, rank, world, fc.layout)
        mine[name] = t.to(fc.dtype)
    names = [n for n in ("q", "k", "v", "theta") if n in mine]
    tangents = {n: mine.get("t" + n) for n in names}  # forward mode's and hvp's
    if fc.order in ("forward", "func"):
        run = forward_mode if fc.order == "forward" else func_jvp
        return run(lambda x: _call(fc, x, flex, packed), {n: mine[n] for n in names}, tangents)
    leaves = {n: mine[n].clone().requires_grad_() for n in names}
    if fc.order in ("hvp", "func-hvp"):  # forward over reverse: the gradients' tangents
        run = forward_over_reverse if fc.order == "hvp" else func_forward_over_reverse
        got = run(
            lambda x: _call(fc, x, flex, packed),
            leaves,
            tangents,
            lambda out, lse: _loss(fc, mine, out, lse),
        )
    else:
        out, lse = _call(fc, leaves, flex, packed)
        second = fc.order == "second"
        grads = torch.autograd.grad(_loss(fc, mine, out, lse), list(leaves.values()),
                                    create_graph=second)  # fmt: skip
        got = {"out": out.detach(), "lse": lse.detach()}
        got |= {"d" + n: g.detach() for n, g in zip(names, grads, strict=True)}
    if fc.order == "second":
        penalty = sum(g.square().sum() for n, g in zip(names, grads, strict=True) if n != "theta")
        if "theta" in leaves:  # the penalty on theta's whole gradient: its shares summed
            whole = grads[-1] if world == 1 else all_reduce(grads[-1], group=group)
            penalty = penalty + whole.square().sum() / world  # world ranks add it
        seconds = torch.autograd.grad(penalty, list(leaves.values()))
        got |= {"d2" + n: g for n, g in zip(names, seconds, strict=True)}
    if world > 1:  # a replicated parameter's gradient: each rank's share, summed
        for name in ("dtheta", "d2theta", "hvptheta"):
            if name in got:
                dist.all_reduce(got[name], group=group)
    return got


def _loss(fc: FlexShardCase, mine: dict, out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """out * dout; in float64 also sin(lse) and, for a second derivative, out^2 / 2 (the
    gradients' dout then depends on out); the rule judges out * dout alone."""
    loss = (out * mine["dout"]).sum()
    if fc.dtype == F64:
        loss = loss + torch.where(lse.isfinite(), lse, 0.0).sin().sum()
        if fc.order in ("second", "hvp"):
            loss = loss + out.square().sum() / 2
    return loss


def _sharded(fc: FlexShardCase, group):
    def flex(q, k, v, score, blocks):
        return flex_ring_attention(
            q, k, v, score, blocks, group=group, layout=fc.layout, enable_gqa=True,
            return_lse=True, strategy=fc.strategy, scheme=fc.scheme,
        )  # fmt: skip

    def packed(q, k, v, cu):
        return packed_ring_attention(
            q, k, v, cu, group=group, is_causal=True, layout=fc.layout, return_lse=True,
            strategy=fc.strategy,
        )  # fmt: skip

    return flex, packed


def _single(fc: FlexShardCase):
    def flex(q, k, v, score, blocks):
        return attngrad.flex_attention(
            q, k, v, score, blocks, enable_gqa=True, return_lse=True, strategy=fc.strategy
        )

    def packed(q, k, v, cu):
        return attngrad.attention(
            q, k, v, is_causal=True, enable_gqa=True, cu_seqlens_q=cu, return_lse=True,
            strategy=fc.strategy,
        )  # fmt: skip

    return flex, packed


def _gather(fc: FlexShardCase, ranks: list[dict]) -> dict:
    got = {}
    for name in ranks[0]:
        parts = [res[name] for res in ranks]
        if "theta" in name:  # all-reduced: every rank holds the sum
            for part in parts[1:]:
                torch.testing.assert_close(part, parts[0], rtol=0, atol=0)
            got[name] = parts[0]
        elif name.endswith("lse"):
            got[name] = unshard([p.unsqueeze(-1) for p in parts], fc.layout).squeeze(-1)
        else:
            got[name] = unshard(parts, fc.layout)
    return got


# ---------------------------------------------------------------------------
# the worker: every case, then the cross-rank errors at P = 2

WORLD = 4


def _error_of(call) -> tuple[str, str]:
    try:
        call()
    except Exception as e:
        return type(e).__name__, str(e)
    return "no error", ""


def _errors(rank: int, group) -> dict[str, tuple[str, str]]:
    """What each rank raises when the ranks disagree (or when the heads do not divide)."""
    q, kv = torch.randn(1, 4, 8, 4), torch.randn(1, 2, 8, 4)
    q3 = torch.randn(1, 3, 8, 4)
    slopes = torch.rand(4, requires_grad=rank == 0)
    alibi = _alibi(slopes)

    def call(*args, q=q, kv=kv, **kw):
        return flex_ring_attention(q, kv, kv, *args, group=group, enable_gqa=True, **kw)

    causal = _block_mask("causal", 16, 4)
    coarse = attngrad.create_block_mask(lambda b, h, i, j: j <= i, None, None, 16, 16,
                                        BLOCK_SIZE=8)  # fmt: skip
    cu = torch.tensor([0, 5, 16] if rank == 0 else [0, 7, 16])
    ring = functools.partial(call, scheme="ring")
    return {
        "heads": _error_of(lambda: call(alibi, q=q3, kv=q3)),
        "score_mod": _error_of(lambda: call(alibi if rank == 0 else None)),
        "block_mask": _error_of(lambda: call(None, causal if rank == 0 else coarse)),
        "requires_grad": _error_of(lambda: call(alibi)),
        "cu_seqlens": _error_of(lambda: packed_ring_attention(q, kv, kv, cu, group=group)),
        "ring-score_mod": _error_of(lambda: ring(alibi if rank == 0 else None)),
        "ring-block_mask": _error_of(lambda: ring(None, causal if rank == 0 else coarse)),
        "ring-requires_grad": _error_of(lambda: ring(alibi)),
        "ring-lengths": _error_of(lambda: ring(None, _block_mask("causal", 8, 4))),
    }


def _block_calls(rank: int, group) -> dict[str, object]:
    """How many times the ring's block kernel runs forward and backward on this rank (of 4,
    contiguous: one chunk each) under documents of one chunk each and under causal: the
    pairs the BlockMask leaves empty are skipped, so 1 and rank + 1 of the 4 pairs; the
    same documents as ring_attention's attn_mask (bool, a float one at -inf, and one at
    finfo.min, whose scores are kept: 4 pairs)."""
    n = 64
    docs = torch.arange(n) // (n // WORLD)
    kernel = REGISTRY["flash"]
    calls = {"forward": 0, "backward_into": 0}

    def counted(name: str):
        method = getattr(kernel, name)

        def count(*args):
            calls[name] += 1
            return method(*args)

        return count

    q = shard(torch.randn(1, 2, n, 8, generator=torch.Generator().manual_seed(7)), rank, WORLD)
    q.requires_grad_()

    def flex(mask_mod):
        blocks = attngrad.create_block_mask(mask_mod, None, None, n, n, BLOCK_SIZE=8)
        return lambda: flex_ring_attention(q, q, q, None, blocks, group=group, scheme="ring",
                                           layout="contiguous", strategy="flash")  # fmt: skip

    def masked(mask):
        return lambda: ring_attention(q, q, q, attn_mask=shard(mask, rank, WORLD), group=group,
                                      strategy="flash")  # fmt: skip

    same = docs[:, None] == docs[None, :]
    runs = {
        "document": flex(lambda b, h, i, j: docs[i] == docs[j]),
        "causal": flex(lambda b, h, i, j: j <= i),
        "attn_mask bool": masked(same),
        "attn_mask -inf": masked(torch.zeros(n, n).masked_fill(~same, -torch.inf)),
        "attn_mask finfo.min": masked(
            torch.zeros(n, n).masked_fill(~same, torch.finfo(q.dtype).min)
        ),
    }
    found = {}
    for name, run in runs.items():
        calls.update(forward=0, backward_into=0)
        kernel.forward, kernel.backward_into = counted("forward"), counted("backward_into")
        try:
            out = run()
            out.sum().backward()
        finally:
            del kernel.forward, kernel.backward_into  # the class's methods again
        found[name] = (calls["forward"], calls["backward_into"])
        found[name + " out"] = out.detach()
    return found


def _through_ring_attention(rank: int, group) -> dict[str, list[torch.Tensor]]:
    """By scheme: out and the gradients of q and theta through `ring_attention`'s score_mod and
    block_mask keywords, then through `flex_ring_attention` (P = 2, zigzag)."""
    gen = torch.Generator().manual_seed(11)
    q, k, v = (shard(torch.randn(1, 4, 32, 4, generator=gen, dtype=F64), rank, 2, "zigzag")
               for _ in range(3))  # fmt: skip
    blocks = _block_mask("causal-document", 32, 4)
    found = {}
    for scheme in ("ring", "all_to_all"):
        runs = []
        for via_ring_attention in (True, False):
            x = q.clone().requires_grad_()
            theta = torch.full((4,), 0.25, dtype=F64, requires_grad=True)
            kw = {"group": group, "layout": "zigzag", "scheme": scheme}
            if via_ring_attention:
                out = ring_attention(x, k, v, score_mod=_alibi(theta), block_mask=blocks, **kw)
            else:
                out = flex_ring_attention(x, k, v, _alibi(theta), blocks, enable_gqa=True, **kw)
            out.square().sum().backward()
            runs += [out.detach(), x.grad, theta.grad]
        found[scheme] = runs
    return found


def _worker(rank: int, store: str, out_dir: str) -> None:
    groups = join(rank, store, WORLD)
    results: dict[str, object] = {}
    for fc in CASES:
        if rank < fc.world:
            flex, packed = _sharded(fc, groups[fc.world])
            group = groups[fc.world]
            results[fc.id] = _run(fc, _inputs(fc), rank, fc.world, flex, packed, group)
    if rank < 2:
        results["errors"] = _errors(rank, groups[2])
        results["ring_attention"] = _through_ring_attention(rank, groups[2])
    results["block calls"] = _block_calls(rank, groups[WORLD])
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    os._exit(0)


@pytest.fixture(scope="session")
def group_run(tmp_path_factory, worker_id) -> list[dict]:
    """Every rank's results; one launch per session (`process_group.shared_run`)."""
    out, exits = shared_run(
        tmp_path_factory, worker_id, "flex_shards_group",
        lambda folder: launch(_worker, __name__, folder, WORLD),
    )  # fmt: skip
    assert exits == [0] * WORLD, exits
    return [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]


# ---------------------------------------------------------------------------
# the judgements


@pytest.mark.parametrize("fc", CASES, ids=[fc.id for fc in CASES])
def test_sharded_flex_matches_the_single_process_call(fc, group_run):
    full = _inputs(fc)
    got = _gather(fc, [res[fc.id] for res in group_run[: fc.world]])
    want = _run(fc, full, 0, 1, *_single(fc))
    assert got.keys() == want.keys()
    if fc.dtype == F64:
        for name, w in want.items():
            torch.testing.assert_close(got[name], w, rtol=1e-10, atol=1e-10, msg=name)
        return
    names = [n for n in ("out", "dq", "dk", "dv", "dtheta", "lse") if n in got]
    failed = [str(v) for v in judge_outputs(fc.case, full, got, names) if not v.passed]
    assert not failed, "; ".join(failed)


def test_heads_that_do_not_divide_by_p_raise_on_every_rank(group_run):
    for rank, res in enumerate(group_run[:2]):
        kind, message = res["errors"]["heads"]
        assert kind == "ArgumentError", (rank, message)
        assert "query heads (3)" in message and "P = 2 ranks" in message, message


@pytest.mark.parametrize(
    ("key", "table"),
    [
        ("score_mod", "score_mod: rank 0 given, rank 1 None"),
        ("block_mask", "BLOCK_SIZE=(4, 4), 4 partial and 6 full blocks), rank 1 BlockMask"),
        ("requires_grad", "requires_grad: rank 0 ['score_mod'], rank 1 []"),
        ("cu_seqlens", "cu_seqlens: rank 0 2 documents"),
        ("ring-score_mod", "score_mod: rank 0 given, rank 1 None"),
        ("ring-block_mask", "BLOCK_SIZE=(4, 4), 4 partial and 6 full blocks), rank 1 BlockMask"),
        ("ring-requires_grad", "requires_grad: rank 0 ['score_mod'], rank 1 []"),
    ],
)
def test_settings_that_differ_across_ranks_raise_the_same_error_on_every_rank(
    group_run, key, table
):
    messages = [res["errors"][key] for res in group_run[:2]]
    assert messages[0] == messages[1]
    kind, message = messages[0]
    assert kind == "ArgumentError" and table in message, message


@pytest.mark.parametrize("scheme", ["ring", "all_to_all"])
def test_ring_attention_takes_score_mod_and_block_mask_as_flex_ring_attention(group_run, scheme):
    for res in group_run[:2]:
        runs = res["ring_attention"][scheme]
        for name, got, want in zip(("out", "dq", "dtheta"), runs[:3], runs[3:], strict=True):
            assert got.abs().sum() > 0, name
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=name)


def test_a_block_mask_built_for_other_lengths_is_refused_before_the_ring(group_run):
    for res in group_run[:2]:
        kind, message = res["errors"]["ring-lengths"]
        assert kind == "ArgumentError", message
        assert "(Q_LEN, KV_LEN) = (8, 8)" in message and "Nq = 16" in message, message


def test_the_ring_skips_the_pairs_the_block_mask_leaves_empty(group_run):
    calls = [res["block calls"] for res in group_run]
    assert [c["document"] for c in calls] == [(1, 1)] * WORLD
    assert [c["causal"] for c in calls] == [(r + 1, r + 1) for r in range(WORLD)]


def test_the_ring_skips_the_pairs_an_attn_mask_leaves_empty(group_run):
    calls = [res["block calls"] for res in group_run]
    assert [c["attn_mask bool"] for c in calls] == [(1, 1)] * WORLD
    assert [c["attn_mask -inf"] for c in calls] == [(1, 1)] * WORLD
    assert [c["attn_mask finfo.min"] for c in calls] == [(WORLD, WORLD)] * WORLD
    q = torch.randn(1, 2, 64, 8, generator=torch.Generator().manual_seed(7))
    same = (torch.arange(64) // 16)[:, None] == (torch.arange(64) // 16)[None, :]
    want = attngrad.attention(q, q, q, attn_mask=same, strategy="flash")
    for name in ("attn_mask bool", "attn_mask -inf"):
        got = unshard([c[name + " out"] for c in calls], "contiguous")
        torch.testing.assert_close(got, want, msg=name)


# ---------------------------------------------------------------------------
# one process: the wrappers, the local BlockMask, the errors, balance


def test_the_local_call_at_a_head_offset_is_the_full_calls_heads():
    """What each rank computes, without a group: the wrapped functions over heads 2..3 of a
    per-head mask give the full call's heads 2..3, on the fused kernels' programs too."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 4, 16, 8, dtype=F64) for _ in range(3))
    theta = torch.rand(4, dtype=F64)
    blocks = _block_mask("per-head", 16, 4)
    for strategy in ("flash", "fused"):
        full = attngrad.flex_attention(q, k, v, _alibi(theta), blocks, strategy=strategy)
        part = attngrad.flex_attention(
            q[:, 2:], k[:, 2:], v[:, 2:], at_heads(_alibi(theta), 2, 5),
            local_block_mask(blocks, 2, 2), strategy=strategy,
        )  # fmt: skip
        torch.testing.assert_close(part, full[:, 2:], rtol=1e-12, atol=1e-12)


def test_wrappers_are_kept_per_function_and_offset_and_freed_with_the_function():
    theta = torch.rand(4)
    fn = _alibi(theta)
    wrapped = at_heads(fn, 2, 5)
    assert at_heads(fn, 2, 5) is wrapped and at_heads(fn, 0, 5) is fn
    assert at_heads(fn, 1, 5) is not wrapped
    q = torch.randn(1, 2, 8, 4)
    score = ScoreFunction.of(wrapped, q, 1)
    program = compile_score(wrapped, score.captured_originals, F32, [False])
    assert not isinstance(program, str), program  # fused's programs trace the wrapper
    assert compile_score(wrapped, score.captured_originals, F32, [False]) is program
    gone = weakref.ref(fn), weakref.ref(wrapped)
    del fn, wrapped, score, program
    gc.collect()
    assert gone[0]() is None and gone[1]() is None  # no table keeps them alive


def test_the_local_block_mask_is_kept_per_block_mask_and_heads():
    blocks = _block_mask("per-head", 16, 4)
    local = local_block_mask(blocks, 2, 2)
    assert local_block_mask(blocks, 2, 2) is local
    assert local.kv_num_blocks.shape[1] == 2
    shared = _block_mask("causal", 16, 4)
    assert local_block_mask(shared, 0, 2) is shared  # rank 0 of a head-shared mask: itself
    moved = local_block_mask(shared, 2, 2)
    assert moved.kv_num_blocks is shared.kv_num_blocks and moved.mask_mod is not shared.mask_mod


@pytest.mark.parametrize("scheme", ["all_to_all", "ring"])
def test_without_a_process_group_it_is_flex_attention(scheme):
    q = torch.randn(1, 2, 16, 4, dtype=F64)
    theta = torch.rand(2, dtype=F64)
    blocks = _block_mask("causal", 16, 2)
    got = flex_ring_attention(q, q, q, _alibi(theta), blocks, return_lse=True, scheme=scheme)
    want = attngrad.flex_attention(q, q, q, _alibi(theta), blocks, return_lse=True)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    got = ring_attention(q, q, q, score_mod=_alibi(theta), block_mask=blocks, return_lse=True,
                         scheme=scheme)  # fmt: skip
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    cu = torch.tensor([0, 5, 16])
    torch.testing.assert_close(
        packed_ring_attention(q, q, q, cu, is_causal=True),
        attngrad.attention(q, q, q, is_causal=True, cu_seqlens_q=cu),
    )


@pytest.mark.parametrize(
    ("keyword", "shown"),
    [
        ({"is_causal": True}, "is_causal=True"),
        ({"attn_mask": torch.ones(16, 16, dtype=torch.bool)}, "attn_mask=tensor of shape (16, 16)"),
        ({"window": (4, 0)}, "window=(4, 0)"),
        ({"softcap": 30.0}, "softcap=30.0"),
        ({"sinks": torch.zeros(2)}, "sinks=tensor of shape (2,)"),
        ({"dropout_p": 0.1}, "dropout_p=0.1"),
    ],
)
def test_ring_attention_refuses_the_keywords_a_block_mask_takes_the_place_of(keyword, shown):
    q = torch.randn(1, 2, 16, 4)
    with pytest.raises(
        ValueError, match=rf"take the place of .*got {re.escape(shown)} beside them"
    ):
        ring_attention(q, q, q, block_mask=_block_mask("causal", 16, 2), **keyword)


@pytest.mark.parametrize("block", [4, 6, 16])
def test_a_pairs_block_mask_keeps_the_full_masks_scores_of_the_pair(block):
    """Every pair of chunks of 8 of N = 48 (block 4: on block edges; 6 and 16: inside
    blocks): the pair's BlockMask keeps exactly the full one's scores at global positions,
    and says empty only where it keeps none."""
    n = 48
    full = _block_mask("causal-document", n, 2, block)
    q = torch.zeros(1, 2, n, 8)
    table = BlockTable.of(full, q, q, 1)
    kept = table.keep(1, slice(0, n), slice(0, n), q.device)
    assert kept is not None
    for q0 in range(0, n, 8):
        for k0 in range(0, n, 8):
            local, empty = pair_block_mask(full, table.status, (q0, k0), (8, 8))
            assert pair_block_mask(full, table.status, (q0, k0), (8, 8))[0] is local
            qp = torch.zeros(1, 2, 8, 8)
            pair = BlockTable.of(local, qp, qp, 1).keep(1, slice(0, 8), slice(0, 8), q.device)
            want = kept[..., q0 : q0 + 8, k0 : k0 + 8]
            got = torch.ones_like(want) if pair is None else pair
            assert torch.equal(got, want), (q0, k0)
            assert not empty or not want.any(), (q0, k0)
            if block == 4:  # on block edges the empty pairs are exactly those keeping nothing
                assert empty == (not want.any()), (q0, k0)


def test_the_pairs_are_kept_across_calls_until_what_they_are_built_from_changes():
    """A ring call's pairs (each a FlexCall: the BlockMask's table read, its mask_mod
    checked) are the previous call's with the same BlockMask, score_mod, scale and shapes;
    a change of what the mask_mod reads, in place, rebuilds them."""
    n = 32
    docs = torch.arange(n) // 8
    full = attngrad.create_block_mask(lambda b, h, i, j: (docs[i] == docs[j]) & (j <= i),
                                      None, None, n, n, BLOCK_SIZE=4)  # fmt: skip
    whole, q = torch.zeros(1, 2, n, 8), torch.randn(1, 2, n // 2, 8)

    def pair(scale: float = 0.5) -> object:
        table = BlockTable.of(full, whole, whole, 1)  # as the call's check reads it
        return FlexPairs.kept(None, full, table, (), "flash", scale, q, q, q).pair((16, 0), q, q, q)

    first = pair()
    assert pair() is first
    docs[16:] = 0  # documents 2 and 3 merge into 0: the mask_mod reads docs
    again = pair()
    assert again is not first and pair() is again
    assert pair(0.25) is not again


def test_the_ring_refuses_a_strategy_that_is_not_a_block_kernel():
    q = torch.randn(1, 2, 16, 4)
    with pytest.raises(ValueError, match=r"strategy must be one of 'auto', 'flash'.*"
                       r"scheme='all_to_all' takes every strategy.*got 'explicit'"):  # fmt: skip
        flex_ring_attention(q, q, q, scheme="ring", strategy="explicit")


DOCS = [1500, 300, 640, 100, 900, 400, 192, 64]  # docs/ring.md's 8 documents, N = 4096


def _ring_time(w: list[list[int]]) -> int:
    """T of docs/ring.md: the steps' largest shares, summed (step s: rank r's queries against
    rank r - s's keys)."""
    p = len(w)
    return sum(max(w[r][(r - s) % p] for r in range(p)) for s in range(p))


def test_balanced_layout_evens_out_each_step_of_the_ring():
    cu = [0, *torch.tensor(DOCS).cumsum(0).tolist()]
    perm = balanced_layout(cu, 4)
    assert torch.equal(perm.sort().values, torch.arange(4096))
    work = rank_work(cu, 4, perm)
    mean = sum(work) / 4
    assert sum(work) == sum(block_work(cu)) and max(work) <= 1.1 * mean, work
    assert _ring_time(rank_pairs(cu, 4, perm)) <= 1.15 * mean
    assert _ring_time(rank_pairs(cu, 4, "zigzag")) > 1.5 * mean  # what it is there for
    # two ranks: equal totals, and equal shares at each step
    assert rank_pairs(cu, 2, balanced_layout(cu, 2)) == [[44, 33], [33, 44]]
    # a BlockMask of the same documents counts the same blocks
    docs = torch.repeat_interleave(torch.arange(8), torch.tensor(DOCS))
    mask = attngrad.create_block_mask(
        lambda b, h, i, j: (j <= i) & (docs[i] == docs[j]), None, None, 4096, 4096
    )
    assert block_work(mask) == block_work(cu)
    assert rank_pairs(mask, 4, balanced_layout(mask, 4)) == rank_pairs(cu, 4, perm)


@pytest.mark.parametrize(("world", "n"), [(2, 4096), (3, 6144), (4, 4096), (8, 8192)])
def test_balanced_layout_keeps_every_ranks_total_within_a_tenth_of_the_mean(world, n):
    # 8 causal documents cut at random: the step swaps lower T but may not unsettle the totals
    gen = torch.Generator().manual_seed(world)
    for _ in range(25):
        cu = [0, *sorted((torch.randperm(n - 1, generator=gen)[:7] + 1).tolist()), n]
        perm = balanced_layout(cu, world)
        work = rank_work(cu, world, perm)
        mean = sum(work) / world
        assert max(abs(w - mean) for w in work) <= 0.1 * mean, (cu, work)
        assert _ring_time(rank_pairs(cu, world, perm)) <= _ring_time(
            rank_pairs(cu, world, "zigzag")
        ), cu


def test_pairs_need_whole_blocks_on_each_rank():
    with pytest.raises(ValueError, match=r"cuts blocks of 4 between two ranks \(N = 36, P = 2\)"):
        rank_pairs([0, 5, 9, 30, 33], 2, "contiguous", block=4)
