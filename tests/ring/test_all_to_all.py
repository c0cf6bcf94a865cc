"""The all-to-all scheme (``ring_attention(..., scheme="all_to_all")``): every keyword, every derivative.

One group of 4 spawned gloo processes (a FileStore in a temporary folder) runs every
case at P = 2, 3 and 4 (subgroups of ranks 0..P-1), then the cross-rank errors, then a
peer that dies inside an all-to-all; the first test that needs it launches it, under a
file lock, so that pytest-xdist's workers share one launch.  Each rank saves its shards
of out, lse and every derivative; the tests reassemble them with `unshard` and judge
them: float64 against the single-process `attngrad.attention` call (same strategy,
same seed) to 1e-10, float32 by the rule of `attngrad.verify.rule` against the float64
reference.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from duals import forward_mode, forward_over_reverse
from process_group import join, launch, shared_run

import attngrad
from attngrad.core.dropout import Dropout, keep_mask, mix32
from attngrad.ring import ring_attention, shard, unshard
from attngrad.ring.all_to_all import _mix, _unmix, head_blocks, retarget
from attngrad.ring.comm import RingComm
from attngrad.verify.cases import Case, make_inputs
from attngrad.verify.rule import judge_outputs
from helpers import case

# ---------------------------------------------------------------------------
# dropout's head offset, without a process group


def test_unmix_inverts_mix_and_mix_is_the_cores():
    words = torch.randint(0, 2**32, (64,), dtype=torch.int64)
    assert [_mix(w) for w in words.tolist()] == mix32(words).tolist()
    assert all(_unmix(_mix(w)) == w for w in words.tolist())


@pytest.mark.parametrize(
    ("start", "heads", "group", "blocks"),
    [
        (0, 4, 1, [(0, 4)]),
        (4, 4, 2, [(0, 4)]),
        (6, 6, 1, [(0, 2), (2, 6)]),  # global heads 6, 7, then 8 .. 11
        (3, 3, 3, [(0, 1), (1, 3)]),  # inside one GQA group
        (0, 6, 3, [(0, 2), (2, 3), (3, 4), (4, 6)]),  # 2 heads never straddle a group of 3
    ],
)
def test_head_blocks_are_aligned_powers_of_two_that_keep_gqa_groups(start, heads, group, blocks):
    assert head_blocks(start, heads, group) == blocks


@pytest.mark.parametrize(("batch", "heads_q", "world"), [(2, 8, 2), (3, 9, 3), (1, 12, 4)])
def test_retargeted_blocks_draw_the_gathered_calls_mask(batch, heads_q, world):
    """Rank r's local call over its heads, block by block, draws the bits of the full call."""
    drop = Dropout(0.4, 123456789, 987654321)
    n = 6
    full = keep_mask(drop, batch, heads_q, n, n, torch.device("cpu"))  # [B*Hq, n, n] as B, Hq
    full = full.view(batch, heads_q, n, n)
    hl = heads_q // world
    for rank in range(world):
        for b in range(batch):
            start = b * heads_q + rank * hl
            for h0, h1 in head_blocks(start, hl, 1):
                z = keep_mask(retarget(drop, start + h0), 1, h1 - h0, n, n, torch.device("cpu"))
                want = full[b, rank * hl + h0 : rank * hl + h1]
                assert torch.equal(z.view_as(want), want), (rank, b, h0)


# ---------------------------------------------------------------------------
# one process: the fallback and the argument errors


def test_without_a_process_group_all_to_all_is_attention_with_every_keyword():
    assert not dist.is_initialized()
    q = torch.randn(2, 4, 8, 4, dtype=torch.float64)
    kv = torch.randn(2, 2, 8, 4, dtype=torch.float64)
    mask = torch.randn(4, 8, 8, dtype=torch.float64)
    sinks = torch.randn(4, dtype=torch.float64)
    kw = {"window": (3, 1), "softcap": 2.0, "sinks": sinks, "return_lse": True}
    got = ring_attention(q, kv, kv, scheme="all_to_all", attn_mask=mask, strategy="flash", **kw)
    want = attngrad.attention(q, kv, kv, mask, enable_gqa=True, strategy="flash", **kw)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"scheme": "ulysses"}, ValueError, "scheme must be one of 'ring', 'all_to_all'"),
        ({"softcap": -1.0}, ValueError, "softcap must be finite and > 0"),
        (
            {"is_causal": True, "attn_mask": torch.zeros(8, 8)},
            ValueError,
            "is_causal=True and an attn_mask",
        ),
        ({"scheme": "all_to_all", "strategy": "x"}, ValueError, "'auto', 'explicit'.*local call"),
        ({"scheme": "all_to_all", "softcap": -1.0}, ValueError, "softcap must be finite and > 0"),
    ],
)
def test_bad_scheme_arguments_raise_naming_the_fix(kwargs, error, match):
    q = torch.randn(1, 2, 8, 4)
    with pytest.raises(error, match=match):
        ring_attention(q, q, q, **kwargs)


# ---------------------------------------------------------------------------
# the cases the process group runs


@dataclass(frozen=True)
class A2ACase:
    """One all-to-all call at ``world`` ranks: the full problem as a `verify.Case`.

    ``order``: "first" (out, lse and the gradients of a loss on both: out * dout
    plus sin(lse) in float64, out * dout alone in float32, which the rule judges),
    "second" (those gradients with create_graph=True, then the gradients of the
    penalty sum of their squares), "hvp" (the gradients' tangents along the inputs'
    tangents: forward over reverse, Hessian-vector products) or "forward" (out's and
    lse's tangents, forward_ad).
    """

    case: Case
    world: int
    layout: str = "zigzag"
    strategy: str = "flash"
    order: str = "first"

    @property
    def id(self) -> str:
        return f"P{self.world}-{self.layout}-{self.strategy}-{self.order}-{self.case.id}"


def _sized(world: int, **kw: object) -> Case:
    """[2, Hq = 2P, N = 4P, d = 4] against [2, Hkv = P, N, dv = 3], GQA, float64 unless said."""
    n = 4 * world
    lead = kw.pop("lead", (2,))
    hq, hkv = kw.pop("heads", (2 * world, world))
    mask, mask_shape = kw.pop("mask", "none"), kw.pop("mask_shape", None)
    return case(lead, hq, hkv, n, n, 4, 3, mask, mask_shape, enable_gqa=True, **kw)  # type: ignore[arg-type]


F32 = torch.float32


def _cases() -> list[A2ACase]:
    cases = []
    for world in (2, 3, 4):
        n = 4 * world
        cases += [
            A2ACase(_sized(world, mask="causal", scale=0.4), world, "contiguous"),
            A2ACase(_sized(world, mask="causal"), world),
            A2ACase(_sized(world, mask="causal", dtype=F32), world),
            A2ACase(_sized(world, dtype=F32), world, "contiguous"),
            A2ACase(_sized(world, mask="causal"), world, order="second"),
            A2ACase(_sized(world, mask="causal"), world, order="forward"),
            A2ACase(_sized(world, mask="causal", dropout=0.3), world),
            # float mask, one row per head: traded like q
            A2ACase(_sized(world, mask="float", mask_shape=(2 * world, n, n)), world),
        ]
    cases += [
        # P = 3 with 9 query heads over 3 kv heads: dropout in blocks of 2 and 1 heads
        A2ACase(_sized(3, heads=(9, 3), mask="causal", dropout=0.5), 3, order="second"),
        # 5 heads per rank: entry 0's blocks are 4 + 1 heads, entry 1's (from head 10) 2 + 2 + 1
        A2ACase(_sized(2, heads=(10, 2), mask="causal", dropout=0.3), 2),
        A2ACase(_sized(2, window=(3, 1)), 2),
        A2ACase(_sized(2, window=(2, 0), dtype=F32), 2, "contiguous"),
        A2ACase(_sized(2, softcap=1.5, mask="float"), 2, order="second"),
        # a mask shared by the heads: gathered whole, its gradient scattered back
        A2ACase(_sized(2, mask="float", mask_shape=(2, 1, 8, 8), dtype=F32), 2),
        A2ACase(_sized(4, mask="float", mask_shape=(1, 16, 16)), 4, order="second"),
        A2ACase(_sized(2, mask="bool"), 2, "contiguous"),
        # a mask shared by the rows (a key bias): sliced, its gradient summed over ranks
        A2ACase(_sized(2, mask="float", mask_shape=(4, 1, 8)), 2),
        A2ACase(_sized(2, sinks="head", mask="causal"), 2),
        A2ACase(_sized(3, sinks="token", dtype=F32), 3),
        A2ACase(_sized(2, sinks="token", mask="causal"), 2, order="second"),
        A2ACase(_sized(2, mask="float", sinks="head"), 2, order="forward"),
        A2ACase(_sized(2, mask="causal", dropout=0.3, window=(None, 2)), 2, order="forward"),
        A2ACase(_sized(2, mask="causal", lead=()), 2, strategy="explicit"),
        A2ACase(_sized(4, mask="causal", dropout=0.2), 4, strategy="recompute"),
        A2ACase(_sized(2, mask="causal", softcap=3.0), 2, strategy="auto", order="second"),
    ]
    return cases


CASES = _cases()
CASE_INPUTS = {ac.id: seed for seed, ac in enumerate(CASES)}


def _inputs(ac: A2ACase, seeds: dict[str, int] = CASE_INPUTS, tangent_seed: int = 10_000) -> dict:
    """The case's full float64 inputs, and tangents for forward mode (`_tangent_names`);
    ``seeds``: its table's seed per case id, ``tangent_seed`` where the tangents' seeds start."""
    seed = seeds[ac.id]
    full = make_inputs(ac.case, seed)
    gen = torch.Generator().manual_seed(tangent_seed + seed)
    for name in ("q", "k", "v", "mask", "sinks"):
        t = full.get(name)
        if t is not None and t.is_floating_point():
            full["t" + name] = torch.randn(t.shape, generator=gen, dtype=torch.float64)
    return full


def _rows_sharded(t: torch.Tensor, n: int) -> bool:
    """Whether t [..., rows, x] holds one row per query position (else it is row-shared)."""
    return t.ndim >= 2 and t.shape[-2] == n and n > 1


def _mine(ac: A2ACase, full: dict, rank: int, world: int) -> dict[str, torch.Tensor]:
    """Rank's part of every input: q, k, v, dout and a row mask cut along the sequence, a
    token sink's rows, row-shared tensors as they are; in the case's dtype (bool as is)."""
    n, layout = ac.case.shapes.seq_q, ac.layout
    mine = {}
    for name, t in full.items():
        if t is None:
            continue
        base = name.removeprefix("t")
        if base in ("q", "k", "v", "dout") or (base == "mask" and _rows_sharded(t, n)):
            t = shard(t, rank, world, layout)
        elif base == "sinks" and ac.case.sinks == "token":
            t = shard(t.unsqueeze(-1), rank, world, layout).squeeze(-1)
        mine[name] = t.to(ac.case.dtype) if t.is_floating_point() else t
    return mine


def _leaf_names(ac: A2ACase, mine: dict) -> list[str]:
    names = ["q", "k", "v"]
    if "mask" in mine and mine["mask"].is_floating_point():
        names.append("mask")
    return names + (["sinks"] if "sinks" in mine else [])


def _run(ac: A2ACase, full: dict, rank: int, world: int, fn) -> dict[str, torch.Tensor]:
    """out, lse and the case's derivatives of ``fn`` on rank's part (world 1: the whole)."""
    c = ac.case
    mine = _mine(ac, full, rank, world)
    names = _leaf_names(ac, mine)
    kw = {k: v for k, v in c.kwargs.items() if k != "enable_gqa"}

    def call(x: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return fn(x["q"], x["k"], x["v"], x.get("mask", mine.get("mask")), x.get("sinks"), kw)

    tangents = {n: mine.get("t" + n) for n in names}  # forward mode's and hvp's
    if ac.order == "forward":
        return forward_mode(call, {n: mine[n] for n in names}, tangents)
    leaves = {n: mine[n].clone().requires_grad_() for n in names}
    if ac.order == "hvp":  # forward over reverse: the gradients' tangents
        return forward_over_reverse(
            call, leaves, tangents, lambda out, lse: _loss(ac, mine, out, lse)
        )
    out, lse = call(leaves)
    second = ac.order == "second"
    grads = torch.autograd.grad(_loss(ac, mine, out, lse), list(leaves.values()),
                                create_graph=second)  # fmt: skip
    got = {"out": out.detach(), "lse": lse.detach()}
    got |= {"d" + n: g.detach() for n, g in zip(names, grads, strict=True)}
    if second:  # a gradient penalty's gradient
        penalty = sum(g.square().sum() for g in grads)
        seconds = torch.autograd.grad(penalty, list(leaves.values()))
        got |= {"d2" + n: g for n, g in zip(names, seconds, strict=True)}
    return got


def _loss(ac: A2ACase, mine: dict, out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """out * dout; in float64 also sin(lse) and, for a second derivative, out^2 / 2 (so the
    gradients' dout depends on out, as in a gradient penalty on a real loss); the rule
    judges out * dout alone."""
    loss = (out * mine["dout"]).sum()
    if ac.case.dtype == torch.float64:
        loss = loss + torch.where(lse.isfinite(), lse, 0.0).sin().sum()  # a dead row: -inf
        if ac.order in ("second", "hvp"):
            loss = loss + out.square().sum() / 2
    return loss


def _all_to_all_fn(ac: A2ACase, group=None):
    def fn(q, k, v, mask, sinks, kw):
        return ring_attention(
            q, k, v, attn_mask=mask, sinks=sinks, scheme="all_to_all", layout=ac.layout,
            strategy=ac.strategy, return_lse=True, group=group, **kw,
        )  # fmt: skip

    return fn


def _single_fn(ac: A2ACase):
    def fn(q, k, v, mask, sinks, kw):
        return attngrad.attention(
            q, k, v, mask, sinks=sinks, enable_gqa=True, strategy=ac.strategy, return_lse=True,
            **kw,
        )  # fmt: skip

    return fn


def _base(name: str) -> str:
    """What a result is of: d2q, dq, hvpq -> q; tout -> out."""
    for prefix in ("d2", "d", "hvp", "t"):
        if name.startswith(prefix) and name[len(prefix) :] in (
            "q",
            "k",
            "v",
            "mask",
            "sinks",
            "out",
            "lse",
        ):
            return name[len(prefix) :]
    return name


def _gather(ac: A2ACase, ranks: list[dict], full: dict) -> dict[str, torch.Tensor]:
    """The ranks' parts over the whole sequence; a row-shared tensor's gradient summed."""
    n = ac.case.shapes.seq_q
    got = {}
    for name in ranks[0]:
        parts = [res[name] for res in ranks]
        base = _base(name)
        if base == "lse" or (base == "sinks" and ac.case.sinks == "token"):  # [..., H, N/P]
            got[name] = unshard([p.unsqueeze(-1) for p in parts], ac.layout).squeeze(-1)
        elif base == "sinks" or (base == "mask" and not _rows_sharded(full["mask"], n)):
            got[name] = sum(parts)  # each rank's share (an all_reduce in training)
        else:
            got[name] = unshard(parts, ac.layout)
    return got


# ---------------------------------------------------------------------------
# the worker: every case at P = 2, 3, 4, the errors, a peer that dies

TIMEOUT = 3.0
WORLD = 4


def _error_of(call) -> tuple[str, str, float]:
    start = time.monotonic()
    try:
        call()
    except Exception as e:
        return type(e).__name__, str(e), time.monotonic() - start
    return "no error", "", time.monotonic() - start


def _errors(rank: int, group) -> dict[str, tuple[str, str, float]]:
    """The cross-rank and head errors at P = 2 (every rank raises the same)."""
    a2a = {"scheme": "all_to_all", "group": group}
    q3, kv1 = torch.randn(1, 3, 4, 8), torch.randn(1, 1, 4, 8)
    q, kv = torch.randn(1, 4, 4, 8), torch.randn(1, 2, 4, 8)
    mask = torch.zeros(4, 4, 8) if rank == 0 else None
    return {
        "heads": _error_of(lambda: ring_attention(q3, q3, q3, **a2a)),
        "kv_heads": _error_of(lambda: ring_attention(q, kv1, kv1, **a2a)),
        "scheme": _error_of(
            lambda: ring_attention(q, kv, kv, group=group, scheme=("ring", "all_to_all")[rank])
        ),
        "mask": _error_of(lambda: ring_attention(q, kv, kv, attn_mask=mask, **a2a)),
        "softcap": _error_of(lambda: ring_attention(q, kv, kv, softcap=1.0 + rank, **a2a)),
    }


def _torch_func(rank: int, world: int, group) -> dict[str, torch.Tensor]:
    """torch.func.jvp and torch.func.vmap through the collective (P = 2)."""
    gen = torch.Generator().manual_seed(7)
    full = [torch.randn(2, 4, 4 * world, 4, generator=gen, dtype=torch.float64) for _ in range(6)]
    mine = [shard(x, rank, world, "zigzag") for x in full]

    def f(q, k, v):
        return ring_attention(
            q, k, v, is_causal=True, scheme="all_to_all", layout="zigzag", group=group
        )

    _, tangent = torch.func.jvp(f, tuple(mine[:3]), tuple(mine[3:]))
    batched = torch.func.vmap(f)(*mine[:3])  # over the batch dim, [4, 4 * world / P, 4] each
    return {"jvp": tangent, "vmap": batched}


def _peer_dies(rank: int) -> tuple[str, str, float] | None:
    """Rank 3 exits inside its first all-to-all; the others report what they raised."""
    if rank == 3:
        RingComm.all_to_all = lambda self, t, what: os._exit(1)  # type: ignore[method-assign]
    q = torch.randn(1, 4, 4, 4, requires_grad=True)
    return _error_of(
        lambda: ring_attention(q, q, q, scheme="all_to_all", timeout=TIMEOUT).sum().backward()
    )


def _worker(rank: int, store: str, out_dir: str) -> None:
    groups = join(rank, store, WORLD)
    results: dict[str, object] = {}
    for ac in CASES:
        if rank < ac.world:
            fn = _all_to_all_fn(ac, groups[ac.world])
            results[ac.id] = _run(ac, _inputs(ac), rank, ac.world, fn)
    if rank < 2:
        results["errors"] = _errors(rank, groups[2])
        results["func"] = _torch_func(rank, 2, groups[2])
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    dist.barrier()
    torch.save(_peer_dies(rank), Path(out_dir) / f"failure{rank}.pt")
    os._exit(0)  # the group is broken now: do not wait on it at shutdown


@pytest.fixture(scope="session")
def group_run(tmp_path_factory, worker_id) -> dict:
    """The group's results: per-rank dicts, the failures and exit codes; one launch per session
    (`process_group.shared_run`)."""
    out, exits = shared_run(
        tmp_path_factory, worker_id, "all_to_all_group",
        lambda folder: launch(_worker, __name__, folder, WORLD),
    )  # fmt: skip
    assert exits == [0, 0, 0, 1], exits  # rank 3 died on purpose, at the end
    return {
        "ranks": [torch.load(out / f"rank{r}.pt") for r in range(WORLD)],
        "failures": [torch.load(out / f"failure{r}.pt") for r in range(WORLD - 1)],
    }


# ---------------------------------------------------------------------------
# the judgements


@pytest.mark.parametrize("ac", CASES, ids=[ac.id for ac in CASES])
def test_all_to_all_matches_the_single_process_call(ac, group_run):
    full = _inputs(ac)
    got = _gather(ac, [res[ac.id] for res in group_run["ranks"][: ac.world]], full)
    want = _run(ac, full, 0, 1, _single_fn(ac))
    assert got.keys() == want.keys()
    for name, w in want.items():
        assert got[name].dtype == w.dtype, name
        if ac.case.dtype == torch.float64:
            torch.testing.assert_close(got[name], w, rtol=1e-10, atol=1e-10, msg=name)
    if ac.case.dtype != torch.float64:  # by the rule, against the float64 reference
        names = [n for n in ("out", "dq", "dk", "dv", "dmask", "dsinks", "lse") if n in got]
        failed = [str(v) for v in judge_outputs(ac.case, full, got, names) if not v.passed]
        assert not failed, "; ".join(failed)
    if ac.case.dropout:  # the mask is really there
        plain = _run(replace(ac, case=replace(ac.case, dropout=0.0)), full, 0, 1, _single_fn(ac))
        assert not torch.allclose(plain["out"], want["out"])


def test_torch_func_jvp_and_vmap_carry_the_collective(group_run):
    gen = torch.Generator().manual_seed(7)
    full = [torch.randn(2, 4, 8, 4, generator=gen, dtype=torch.float64) for _ in range(6)]

    def f(q, k, v):
        return attngrad.attention(q, k, v, is_causal=True)

    _, tangent = torch.func.jvp(f, tuple(full[:3]), tuple(full[3:]))
    batched = torch.func.vmap(f)(*full[:3])
    ranks = group_run["ranks"][:2]
    for name, want in (("jvp", tangent), ("vmap", batched)):
        got = unshard([res["func"][name] for res in ranks], "zigzag")
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10, msg=name)


def test_heads_that_do_not_divide_by_p_raise_naming_the_scheme_and_the_counts(group_run):
    for rank, res in enumerate(group_run["ranks"][:2]):
        for key, counts in (("heads", "heads (3)"), ("kv_heads", "key/value heads (1)")):
            kind, message, _ = res["errors"][key]
            assert kind == "ArgumentError", (rank, message)
            for part in ("scheme='all_to_all'", "P = 2 ranks", counts, "scheme='ring'"):
                assert part in message, (rank, part, message)


@pytest.mark.parametrize(
    ("key", "table"),
    [
        ("scheme", "scheme: rank 0 ring, rank 1 all_to_all"),
        ("mask", "attn_mask: rank 0 float32[1, 4, 4, 8], rank 1 None"),
        ("softcap", "softcap: rank 0 1.0, rank 1 2.0"),
    ],
)
def test_settings_that_differ_across_ranks_raise_on_every_rank(group_run, key, table):
    for rank, res in enumerate(group_run["ranks"][:2]):
        kind, message, _ = res["errors"][key]
        assert kind == "ArgumentError" and table in message, (rank, message)


def test_a_peer_that_dies_inside_an_all_to_all_raises_the_timeout_error(group_run):
    for rank, failure in enumerate(group_run["failures"]):
        kind, message, elapsed = failure
        assert kind == "RingTimeoutError", (rank, message)
        assert f"rank {rank} of 4: the all-to-all scheme's seq_to_heads" in message
        assert elapsed < TIMEOUT + 20.0, elapsed  # it raised, it did not hang
