"""The ring scheme's derivatives and keywords: forward mode, double backward, window, softcap
and attn_mask through ``ring_attention(..., scheme="ring")``.

One group of 4 forked gloo processes runs every case at P = 2, 3 and 4 (subgroups of
ranks 0..P-1), reusing the all-to-all tests' case machinery (`test_all_to_all`: the
cases' sizes, each rank's part of the inputs, the derivatives a case asks for, the
reassembly); the first test that needs the group launches it under a file lock, so
pytest-xdist's workers share one launch.  Judged as there: float64 against the
single-process `attngrad.attention` call (same strategy) to 1e-10, float32 by the rule
of `attngrad.verify.rule` against the float64 reference.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from process_group import join, launch, shared_run
from test_all_to_all import A2ACase, _gather, _run, _single_fn, _sized
from test_all_to_all import _inputs as case_inputs

import attngrad
from attngrad.ring import ring_attention, shard, unshard
from attngrad.ring.comm import RingComm
from attngrad.verify.rule import judge_outputs

F32 = torch.float32


def _cases() -> list[A2ACase]:
    """P = 2, 3, 4; each keyword first order and under one derivative, zigzag and contiguous."""
    cases = []
    for world in (2, 3, 4):
        cases += [
            A2ACase(_sized(world, mask="causal"), world, order="forward"),
            A2ACase(_sized(world, mask="causal"), world, order="second"),
            A2ACase(_sized(world, mask="causal"), world, strategy="fused", order="hvp"),
            A2ACase(_sized(world, mask="causal", dtype=F32), world, "contiguous"),
        ]
    cases += [
        # window: a band at each pair's global offset; pairs it leaves empty are skipped
        A2ACase(_sized(2, window=(3, 1)), 2),
        A2ACase(_sized(3, window=(2, 0), dtype=F32), 3, "contiguous"),
        A2ACase(_sized(4, window=(3, 2)), 4, "contiguous", order="second"),
        A2ACase(_sized(3, mask="causal", window=(4, None)), 3, order="forward"),
        # softcap
        A2ACase(_sized(2, softcap=1.5, mask="causal"), 2),
        A2ACase(_sized(3, softcap=2.0), 3, order="second"),
        A2ACase(_sized(4, softcap=1.5, mask="causal"), 4, "contiguous", order="forward"),
        # a float mask: rows cut like q, keys the whole sequence; its gradient is the rows'
        A2ACase(_sized(2, mask="float", mask_shape=(4, 8, 8)), 2),
        A2ACase(_sized(3, mask="float", mask_shape=(2, 1, 12, 12), dtype=F32), 3),
        A2ACase(_sized(4, mask="float", mask_shape=(8, 16, 16)), 4, order="second"),
        A2ACase(_sized(2, mask="float", mask_shape=(4, 8, 8), softcap=2.0), 2, order="forward"),
        # a bool mask, query row 1 attending nothing (make_inputs)
        A2ACase(_sized(2, mask="bool", mask_shape=(4, 8, 8)), 2, "contiguous"),
        A2ACase(_sized(3, mask="bool", mask_shape=(2, 1, 12, 12)), 3, order="second"),
        A2ACase(_sized(4, mask="bool", mask_shape=(16, 16)), 4, order="forward"),
        # everything at once, with the fused block kernel, sinks and dropout
        A2ACase(
            _sized(3, mask="float", mask_shape=(6, 12, 12), window=(5, 1), softcap=3.0),
            3,
            strategy="fused",
            order="second",
        ),
        # per-token sinks: a shared one's gradient is each rank's share, and a penalty on shares differs
        A2ACase(_sized(2, mask="causal", sinks="token", window=(3, 0)), 2, order="second"),
        A2ACase(_sized(2, mask="causal", dropout=0.3, softcap=2.0), 2, order="forward"),
        # forward over reverse with every keyword the pairs take
        A2ACase(
            _sized(
                3, mask="float", mask_shape=(6, 12, 12), window=(4, 2), softcap=2.0, dropout=0.25
            ),
            3,
            order="hvp",
        ),
        A2ACase(
            _sized(2, mask="bool", mask_shape=(8, 8), sinks="token"),
            2,
            "contiguous",
            strategy="fused",
            order="hvp",
        ),
        # a second derivative with dropout, on both block kernels
        A2ACase(_sized(2, mask="causal", dropout=0.3), 2, strategy="fused", order="second"),
        A2ACase(_sized(4, window=(5, 1), dropout=0.2), 4, order="second"),
        A2ACase(_sized(4, mask="bool", mask_shape=(16, 16), window=(6, 2)), 4, strategy="fused"),
    ]
    return cases


CASES = _cases()
CASE_INPUTS = {ac.id: seed for seed, ac in enumerate(CASES)}


def _inputs(ac: A2ACase) -> dict:
    """The case's full float64 inputs, and tangents for forward mode."""
    return case_inputs(ac, CASE_INPUTS, 20_000)


def _ring_fn(ac: A2ACase, group=None):
    def fn(q, k, v, mask, sinks, kw):
        return ring_attention(
            q, k, v, attn_mask=mask, sinks=sinks, layout=ac.layout, strategy=ac.strategy,
            return_lse=True, group=group, timeout=TIMEOUT, **kw,
        )  # fmt: skip

    return fn


# ---------------------------------------------------------------------------
# the worker: every case at P = 2, 3, 4, then torch.func at P = 2

TIMEOUT = 20.0
WORLD = 4


def _transforms(out_and_lse, inputs: list[torch.Tensor]) -> dict[str, object]:
    """torch.func's transforms of f(q, k, v), the out of ``out_and_lse(q, k, v)``, and of the
    loss f(...)^2 summed: the jvp, the gradient, a vjp, forward over reverse (an HVP; also of
    a loss linear in f, and of one of lse alone) and the gradient of a gradient penalty."""
    q, k, v, tq, _, _ = inputs

    def f(q, k, v):
        return out_and_lse(q, k, v)[0]

    def loss(q, k, v):
        return f(q, k, v).square().sum()

    def penalty(q):
        return torch.func.grad(loss)(q, k, v).square().sum()

    return {
        "jvp": lambda: torch.func.jvp(f, (q, k, v), tuple(inputs[3:]))[1],
        "grad": lambda: torch.func.grad(loss, argnums=(0, 1, 2))(q, k, v),
        "vjp": lambda: torch.func.vjp(f, q, k, v)[1](inputs[3]),
        "jvp(grad)": lambda: torch.func.jvp(lambda x: torch.func.grad(loss)(x, k, v), (q,), (tq,))[
            1
        ],
        "grad(grad)": lambda: torch.func.grad(penalty)(q),
        # a loss linear in the output: the gradients' tangents come from q's alone
        "jvp(grad), linear": lambda: torch.func.jvp(
            torch.func.grad(lambda x: (f(x, k, v) * inputs[4]).sum()), (q,), (tq,)
        )[1],
        "jvp(grad), lse": lambda: torch.func.jvp(
            torch.func.grad(lambda x: (out_and_lse(x, k, v)[1] * inputs[4][..., 0]).sum()),
            (q,),
            (tq,),
        )[1],
    }


def _func_inputs(world: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randn(2, 4, 4 * world, 4, generator=gen, dtype=torch.float64) for _ in range(6)]


def _torch_func(rank: int, world: int, group) -> dict[str, tuple[str, object]]:
    """torch.func's transforms through the ring (P = 2, fused blocks): by name, ("ok", the
    result) or (error kind, message)."""
    mine = [shard(x, rank, world, "zigzag") for x in _func_inputs(world)]

    def f(q, k, v):
        return ring_attention(
            q, k, v, is_causal=True, layout="zigzag", group=group, strategy="fused",
            return_lse=True,
        )  # fmt: skip

    results = {}
    for name, run in _transforms(f, mine).items():
        try:
            results[name] = ("ok", run())
        except Exception as e:
            results[name] = (type(e).__name__, str(e))
    return results


def _worker(rank: int, store: str, out_dir: str) -> None:
    groups = join(rank, store, WORLD)
    results: dict[str, object] = {}
    for ac in CASES:
        if rank < ac.world:
            results[ac.id] = _run(ac, _inputs(ac), rank, ac.world, _ring_fn(ac, groups[ac.world]))
    if rank < 2:
        results["func"] = _torch_func(rank, 2, groups[2])
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    dist.barrier()
    if rank < 2:  # last, as it breaks the group
        torch.save(_peer_dies_in_second_order(rank, groups[2]), Path(out_dir) / f"dies{rank}.pt")
    os._exit(0)


def _peer_dies_in_second_order(rank: int, group) -> tuple[str, str]:
    """Ranks 0 and 1 take a gradient penalty; rank 1 exits as its second-order pass starts:
    rank 0 reports what it raised."""
    if rank == 1:
        RingComm.any = lambda *args: os._exit(0)  # type: ignore[method-assign]
    q = torch.randn(1, 2, 8, 4, dtype=torch.float64, requires_grad=True)
    try:
        out = ring_attention(q, q, q, is_causal=True, group=group, timeout=TIMEOUT)
        (g,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
        g.square().sum().backward()
    except Exception as e:
        return type(e).__name__, str(e)
    return "no error", ""


@pytest.fixture(scope="session")
def ring_run(tmp_path_factory, worker_id) -> list[dict]:
    """Every rank's results; one launch per session, shared by pytest-xdist's workers."""
    out, exits = shared_run(
        tmp_path_factory,
        worker_id,
        "ring_derivatives_group",
        lambda folder: launch(_worker, __name__, folder, WORLD, deadline=120.0),
    )
    assert exits == [0] * WORLD, exits
    ranks = [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]
    ranks[0]["dies"] = torch.load(out / "dies0.pt")
    return ranks


# ---------------------------------------------------------------------------
# the judgements


@pytest.mark.parametrize("ac", CASES, ids=[ac.id for ac in CASES])
def test_ring_derivatives_match_the_single_process_call(ac, ring_run):
    full = _inputs(ac)
    got = _gather(ac, [res[ac.id] for res in ring_run[: ac.world]], full)
    want = _run(ac, full, 0, 1, _single_fn(ac))
    assert got.keys() == want.keys()
    for name, w in want.items():
        assert got[name].dtype == w.dtype, name
        if ac.case.dtype == torch.float64:
            torch.testing.assert_close(got[name], w, rtol=1e-10, atol=1e-10, msg=name)
    if ac.case.dtype != torch.float64:  # by the rule, against the float64 reference
        names = [n for n in ("out", "dq", "dk", "dv", "dmask", "lse") if n in got]
        failed = [str(v) for v in judge_outputs(ac.case, full, got, names) if not v.passed]
        assert not failed, "; ".join(failed)


@pytest.mark.parametrize(
    "name",
    ["jvp", "grad", "vjp", "jvp(grad)", "grad(grad)", "jvp(grad), linear", "jvp(grad), lse"],
)
def test_torch_func_through_the_ring(ring_run, name):
    def f(q, k, v):
        return attngrad.attention(q, k, v, is_causal=True, strategy="fused", return_lse=True)

    want = _transforms(f, _func_inputs(2))[name]()
    results = [res["func"][name] for res in ring_run[:2]]
    assert all(kind == "ok" for kind, _ in results), results
    for i, w in enumerate(want if isinstance(want, tuple) else (want,)):
        parts = [r if isinstance(r, torch.Tensor) else r[i] for _, r in results]
        torch.testing.assert_close(unshard(parts, "zigzag"), w, rtol=1e-10, atol=1e-10)


def test_a_peer_that_dies_in_the_second_order_pass_raises_on_the_others(ring_run):
    kind, message = ring_run[0]["dies"]
    assert kind == "RingTimeoutError", (kind, message)
    assert "second order" in message and "rank 0 of 2" in message
