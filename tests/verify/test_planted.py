"""The error rule fails planted bugs at realistic sizes, and passes correct code there.

Each bug of `attngrad.verify.planted` is a copy of strategy "flash" with one
mistake that fires in one dtype: it must fail the rule in that dtype on every
case (ratio > 1), and the same copy must pass in another dtype, so the
failure is the mistake's and not the copy's.  Every run but SDPA's has its
lse judged too: the 16-bit lse bug is caught there (its 16-bit gradients are
as close as plain 16-bit PyTorch's, which the rule allows).  Sizes as kernels
meet them: N from 97 to 1024, d from 59 to 128, flash on several tiles in
both directions with a partial last tile.  At N = 1024 (about a second per
judgement in float64) only the bugs nearest the bound run: the 16-bit
gradients 5% off (bfloat16's plain run is the least accurate), the missing
row sum, and the 16-bit lse, as the lse's bound grows with N (`lse_floor`).
What each case's runs are judged against (`expect_case`: the float64
reference, the plain run and the bounds) is computed once per case and shared
by every bug and every correct code run on it.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from attngrad.strategies import REGISTRY, flash
from attngrad.verify.cases import Case
from attngrad.verify.check import expect_case
from attngrad.verify.planted import (
    BUGS,
    Bug,
    Mutation,
    broken_kernel,
    bug_ratio,
    bug_ratios,
    correct_kernels,
    correct_ratio,
    flash_on,
    margins,
    mutant,
    planted,
)
from attngrad.verify.verify import verify
from helpers import case

Blocks = tuple[int, int]
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# a dtype each bug is correct code in
OTHER = {
    torch.bfloat16: torch.float16,
    torch.float16: torch.bfloat16,
    torch.float32: torch.bfloat16,
}
# the bugs also judged at N = 1024, d = 128 (module docstring)
AT_LARGE = {"dq 5% off", "dk 5% off", "dv 5% off", "no row sum", "16-bit lse"}
# each case's expectation at seed 0, shared by the tests that run code on it
_expected = functools.cache(expect_case)


def _grid(dtype: torch.dtype) -> list[tuple[Case, Blocks]]:
    """The cases of one dtype, each with flash's tiles (block_q, block_k)."""
    return [
        # 32-row tiles over 97: three full tiles and one of a single row, each way
        (case((1,), 2, 2, 97, 97, 59, mask="causal", dtype=dtype), (32, 32)),
        # GQA, Nq != Nk and a float mask (its gradient judged too), partial tiles both ways
        (case((1,), 4, 2, 257, 333, 64, mask="float", dtype=dtype), (64, 64)),
    ]


def _large(dtype: torch.dtype) -> tuple[Case, Blocks]:
    return case((1,), 1, 1, 1024, 1024, 128, dtype=dtype), (64, 64)


def _caught_params() -> list[object]:
    params = []
    for bug in BUGS:
        runs = _grid(bug.dtype) + ([_large(bug.dtype)] if bug.name in AT_LARGE else [])
        params += [pytest.param(bug, c, b, id=f"{bug.id}-{c.id}") for c, b in runs]
    return params


@pytest.mark.parametrize(("bug", "c", "blocks"), _caught_params())
def test_bug_fails_the_rule(bug: Bug, c: Case, blocks: Blocks) -> None:
    ratio = bug_ratio(bug, c, blocks, expected=_expected(c))
    assert ratio > 1.0, f"{bug.id} passes the rule on {c.id}: ratio {ratio:.3g} on {bug.breaks}"


@pytest.mark.parametrize("bug", BUGS, ids=lambda b: b.id)
def test_bug_is_correct_in_another_dtype(bug: Bug) -> None:
    c, blocks = _grid(OTHER[bug.dtype])[1]
    ratios = bug_ratios(bug, c, blocks, expected=_expected(c))
    assert "lse" in ratios and "dmask" in ratios, ratios
    assert max(ratios.values()) <= 1.0, f"{bug.id} fails in {c.id} too: {ratios}"


@pytest.mark.parametrize(
    ("c", "blocks"),
    [pytest.param(c, b, id=c.id) for dtype in DTYPES for c, b in [*_grid(dtype), _large(dtype)]],
)
def test_correct_code_passes(c: Case, blocks: Blocks) -> None:
    kernels = correct_kernels(blocks)
    ratios = {
        name: correct_ratio(kernel, c, name, expected=_expected(c))
        for name, kernel in kernels.items()
    }
    assert max(ratios.values()) <= 1.0, f"{c.id}: {ratios}"


def test_margins_gap() -> None:
    c, blocks = _grid(torch.bfloat16)[0]
    bugs = [b for b in BUGS if b.dtype == torch.bfloat16 and b.name in ("dq 5% off", "zeros")]
    m = margins([c], bugs, blocks)
    assert [r.bug for r in m.bugs] == bugs
    assert {r.code for r in m.correct} == set(correct_kernels())
    assert m.worst_correct(torch.bfloat16) == max(r.ratio for r in m.correct) <= 1.0
    for r in m.bugs:
        assert r.caught and r.case == c.id
        assert m.power(r) > 1.0


def test_verify_fails_a_broken_kernel_in_its_dtype() -> None:
    bug = next(b for b in BUGS if b.name == "dq 5% off" and b.dtype == torch.bfloat16)
    cases = [case((1,), 4, 2, 256, 300, 64, dtype=dtype) for dtype in (bug.dtype, OTHER[bug.dtype])]
    broken = verify(broken_kernel(bug), cases=cases, gradcheck=False)
    assert not broken.passed
    assert [r.passed for r in broken.cases] == [False, True], [r.message for r in broken.cases]
    assert "dq" in broken.cases[0].message and "dk" not in broken.cases[0].message
    correct = verify(flash_on(), cases=cases, gradcheck=False)
    assert correct.passed, [r.message for r in correct.cases]


@pytest.mark.parametrize("pattern", ["no such text in flash.py", "torch."])
def test_mutation_must_match_once(pattern: str) -> None:
    bug = dataclasses.replace(BUGS[0], mutation=Mutation(pattern, "{fires}"))
    with pytest.raises(ValueError, match="not once"):
        mutant(bug)


def test_every_mutation_changes_flash() -> None:
    def code(module, name):
        return getattr(module.Flash, name).__code__.co_code

    for bug in BUGS:
        if bug.mutation is not None:
            changed = [
                f for f in ("forward", "backward_into") if code(mutant(bug), f) != code(flash, f)
            ]
            assert len(changed) == 1, (bug.id, changed)
    zeros = next(b for b in BUGS if b.mutation is None)
    with pytest.raises(ValueError, match="no mutation"):
        mutant(zeros)


def test_planted_swaps_and_restores() -> None:
    bug = BUGS[0]
    with pytest.raises(RuntimeError), planted(bug) as module:
        assert module is mutant(bug) and REGISTRY["flash"] is module.strategy
        raise RuntimeError
    assert REGISTRY["flash"] is flash.strategy
