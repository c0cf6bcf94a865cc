r"""Planted bugs: copies of strategy "flash" with one mistake each, to show the rule rejects them.

An error rule is only as good as what it fails.  Each `Bug` is a copy of
`attngrad.strategies.flash` with one exact textual replacement in its source
(`Mutation`), exec'd as a module of its own; `planted` swaps it into
`attngrad.strategies.REGISTRY` (where the eager route looks the strategy up at
each call) and restores the real one after.  The mistake fires in the bug's
dtype only (the mutated line tests ``q.dtype``), so the same copy is correct
code in every other dtype: a bug that passes there proves the mutation is
real and the rule's failure is about its dtype.  A replacement whose pattern
is not in flash.py exactly once raises, so a change to flash.py breaks a
mutant loudly instead of planting nothing.

`BUGS`, per dtype it fires in:

* ``dq``, ``dk``, ``dv`` off by 5% (bfloat16, float16) or 1% (float32);
* ``no row sum``: the softmax backward without its row sum, dS = P o dP;
* ``16-bit lse``: the saved row statistics (m, log l) rounded to the 16-bit
  input dtype (to bfloat16 in float32: a float32 kernel keeping its statistics
  in 16 bits), so the returned lse is theirs and backward rebuilds P from them;
* ``no rescale``: the tile merge of forward that forgets to rescale the
  running sum l_i by alpha = exp(m_old - m_new) when the row max grows;
* ``zeros``: out and every gradient zero (no copy of flash: the real one
  times zero, `broken_kernel`).

`broken_kernel` turns a bug into a function with SDPA's signature (what
`attngrad.verify.verify.verify` judges; with ``return_lse``, one that returns
(out, lse) as attention does); `bug_ratio`, `correct_ratio` and `margins`
measure the rule's power: the smallest ratio (error over bound, > 1 fails) a
bug reaches over some cases, against the worst ratio of correct code
(`correct_kernels`: explicit, recompute, flash with the same tiles and
PyTorch's own SDPA) on the same cases.  Every run but SDPA's (which returns
no lse) has its lse judged too (`attngrad.verify.rule.lse_floor`): the 16-bit
lse's gradients are as far off as plain 16-bit PyTorch's, which the rule's 2x
term allows; its lse, which the rule judges without that term, is not.
"""

from __future__ import annotations

import functools
import inspect
import math
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from attngrad.core.contract import dtype_name
from attngrad.strategies import REGISTRY, flash
from attngrad.verify.cases import AttentionFn, Case
from attngrad.verify.check import expect_case, run_case, strategy_fn
from attngrad.verify.rule import Expected

__all__ = [
    "BLOCKS",
    "BUGS",
    "GRADIENT_ERRORS",
    "Bug",
    "BugRatio",
    "CodeRatio",
    "Kernel",
    "Margins",
    "Mutation",
    "broken_kernel",
    "bug_ratio",
    "bug_ratios",
    "correct_kernels",
    "correct_ratio",
    "flash_on",
    "margins",
    "mutant",
    "planted",
]

# flash's tiles in every run here (block_q, block_k): several in both directions at N >= 128
BLOCKS = (64, 64)
# how far off a planted gradient is: the rule's 16-bit bound spans several units of roundoff
# (bfloat16's u = 0.4%), so 5% there; float32's u = 6e-8 puts 1% far outside its bound
GRADIENT_ERRORS = {torch.bfloat16: 0.05, torch.float16: 0.05, torch.float32: 0.01}
# the text of the mutated line that stands for "the bug fires here"
_FIRES = "{fires}"


@dataclass(frozen=True)
class Mutation:
    """One exact textual replacement in flash.py's source.

    ``replacement`` writes ``{fires}`` where the mutated code tests whether
    the bug fires (``q.dtype == torch.<dtype>``; ``q`` is the input in both
    `flash.forward` and `flash.backward_into`).
    """

    pattern: str
    replacement: str


@dataclass(frozen=True)
class Bug:
    """A planted bug: what it breaks and how, in one dtype.

    ``breaks``: the quantities it makes wrong (of `attngrad.verify.rule.GRADIENTS`;
    the ones a case has are judged).  ``mutation`` None: every output and
    gradient zero (`broken_kernel`), no copy of flash.
    """

    name: str
    dtype: torch.dtype
    breaks: tuple[str, ...]
    about: str
    mutation: Mutation | None

    @property
    def id(self) -> str:
        """``name-dtype``, e.g. ``dq-5%-off-bfloat16``: readable in test ids and tables."""
        return f"{self.name.replace(' ', '-')}-{dtype_name(self.dtype)}"


def _gradient_bugs(dtype: torch.dtype) -> list[Bug]:
    """dq, dk and dv each off by `GRADIENT_ERRORS` in ``dtype``."""
    off = GRADIENT_ERRORS[dtype]
    factor = f"({1 - off!r} if {_FIRES} else 1.0)"
    sites = {  # each gradient where it leaves its accumulator
        "dq": ("torch.matmul(ds, kc).view(b, hkv, g, r, d).mul_(scale)",
               f"torch.matmul(ds, kc).view(b, hkv, g, r, d).mul_(scale * {factor})"),
        "dk": ("dk[:, :, cols] += dk_c", f"dk[:, :, cols] += dk_c * {factor}"),
        "dv": ("dv[:, :, cols] += dv_c", f"dv[:, :, cols] += dv_c * {factor}"),
    }  # fmt: skip
    return [
        Bug(f"{name} {off:.0%} off", dtype, (name,), f"{name} times {1 - off:g}", Mutation(*site))
        for name, site in sites.items()
    ]


def _structural_bugs(dtype: torch.dtype) -> list[Bug]:
    """The mistakes of the algorithm itself, in ``dtype``."""
    gradients = ("dq", "dk", "dv", "dmask", "dsinks")
    no_row_sum = Mutation(
        "ds = dp.sub_(delta_b).mul_(p)", f"ds = (dp if {_FIRES} else dp.sub_(delta_b)).mul_(p)"
    )
    # a 16-bit kernel's statistics in its own dtype; a float32 kernel's in bfloat16
    kept = f"torch.{dtype_name(dtype if dtype.itemsize == 2 else torch.bfloat16)}"
    lse16 = Mutation(
        "torch.cat((shift, log_normalizer(l_i)), -1)",
        f"torch.cat((shift, log_normalizer(l_i)), -1).to({kept} if {_FIRES} else dtype).to(dtype)",
    )
    no_rescale = Mutation("l_i.mul_(alpha).add_(", f"(l_i if {_FIRES} else l_i.mul_(alpha)).add_(")
    return [
        Bug("no row sum", dtype, ("dq", "dk", "dmask"), "dS = P o dP, without - Delta", no_row_sum),
        Bug("16-bit lse", dtype, ("lse", *gradients), f"stats (m, log l) in {kept}", lse16),
        Bug("no rescale", dtype, ("out", "lse", *gradients), "l_i not times alpha", no_rescale),
        Bug("zeros", dtype, ("out", "lse", *gradients), "out, lse, every gradient 0", None),
    ]


BUGS: tuple[Bug, ...] = tuple(
    bug
    for dtype in (torch.bfloat16, torch.float16, torch.float32)
    for bug in (*_gradient_bugs(dtype), *_structural_bugs(dtype))
)


@functools.cache
def mutant(bug: Bug) -> types.ModuleType:
    """A copy of `attngrad.strategies.flash` with ``bug``'s mutation, as a module of its own.

    Raises ValueError when the mutation's pattern is not in flash.py exactly
    once, or when the bug has no mutation (``zeros``).
    """
    if bug.mutation is None:
        raise ValueError(f"bug {bug.id!r} has no mutation: run it through broken_kernel")
    source = inspect.getsource(flash)
    pattern = bug.mutation.pattern
    found = source.count(pattern)
    if found != 1:
        raise ValueError(
            f"bug {bug.id!r}: {pattern!r} occurs {found} times in {flash.__file__}, not once; "
            "update the mutation to the strategy's current source"
        )
    fires = f"(q.dtype == torch.{dtype_name(bug.dtype)})"
    mutated = source.replace(pattern, bug.mutation.replacement.replace(_FIRES, fires))
    name = f"{flash.__name__}_planted_{bug.id}"
    module = types.ModuleType(name)
    exec(compile(mutated, f"<{name}>", "exec"), module.__dict__)
    return module


@contextmanager
def planted(bug: Bug) -> Iterator[types.ModuleType]:
    """Strategy "flash" is ``bug``'s mutant inside the block (the real one again after)."""
    real, module = REGISTRY["flash"], mutant(bug)
    REGISTRY["flash"] = module.strategy
    try:
        yield module
    finally:
        REGISTRY["flash"] = real


def flash_on(blocks: tuple[int, int] = BLOCKS, **options: object) -> AttentionFn:
    """`attngrad.attention` with strategy "flash" on tiles ``blocks`` (block_q, block_k) and
    ``options`` (e.g. return_lse=True): the strategy `attngrad.strategies.REGISTRY` holds at
    the call, a mutant inside `planted`."""
    return strategy_fn("flash", block_q=blocks[0], block_k=blocks[1], **options)


def broken_kernel(
    bug: Bug, blocks: tuple[int, int] = BLOCKS, return_lse: bool = False
) -> AttentionFn:
    """``bug`` as a function with SDPA's signature (and attention's keywords, e.g. sinks):
    flash's mutant on tiles ``blocks``, or for ``zeros``, flash's answer times zero in
    the bug's dtype (a graph whose every gradient is zero) and an lse of zeros.
    return_lse: it returns (out, lse [..., Hq, Nq]), as attention does."""
    run_flash = flash_on(blocks, return_lse=return_lse)

    def kernel(query: torch.Tensor, *args: object, **kwargs: object) -> Any:
        if bug.mutation is not None:
            with planted(bug):
                return run_flash(query, *args, **kwargs)
        got = run_flash(query, *args, **kwargs)
        if query.dtype != bug.dtype:
            return got
        if return_lse:
            out, lse = got
            return out * 0.0, torch.zeros_like(lse)
        return got * 0.0

    kernel.__name__ = kernel.__qualname__ = f"planted_{bug.id.replace('-', '_')}"
    return kernel


class Kernel(NamedTuple):
    """Code to judge: ``fn`` SDPA-like, ``lse`` the same code returning (out, lse) (None: it
    returns no lse, as SDPA)."""

    fn: AttentionFn
    lse: AttentionFn | None = None


def _strategy(name: str, **options: object) -> Kernel:
    return Kernel(strategy_fn(name, **options), strategy_fn(name, return_lse=True, **options))


def correct_kernels(blocks: tuple[int, int] = BLOCKS) -> dict[str, Kernel]:
    """The correct code a bug is measured against: the real strategies explicit, recompute
    and flash (on tiles ``blocks``, as `broken_kernel`'s) and PyTorch's own SDPA."""
    return {
        "explicit": _strategy("explicit"),
        "recompute": _strategy("recompute"),
        "flash": _strategy("flash", block_q=blocks[0], block_k=blocks[1]),
        "sdpa": Kernel(F.scaled_dot_product_attention),
    }


def _ratios(
    name: str, kernel: Kernel, case: Case, seed: int, expected: Expected | None
) -> dict[str, float]:
    """The rule's ratio of each quantity of ``kernel`` on ``case``, lse with them when it
    returns one (`run_case`, judged by ``expected``; a crash raises)."""
    fn, lse = kernel
    result = run_case(name, case, seed, False, fn, derivatives=False, lse=lse, expected=expected)
    if not result.ratios:
        raise RuntimeError(f"{name} on {case.id}: {result.message}")
    return result.ratios


def bug_ratios(
    bug: Bug,
    case: Case,
    blocks: tuple[int, int] = BLOCKS,
    seed: int = 0,
    expected: Expected | None = None,
) -> dict[str, float]:
    """The ratio (error / bound, > 1 fails) of each quantity ``bug`` breaks that ``case`` has.

    In another dtype than the bug's, the mutant is correct code: every
    quantity's ratio instead.  expected: `expect_case` of (case, seed), shared
    by every code judged on the case (None: computed here).
    """
    kernel = Kernel(broken_kernel(bug, blocks), broken_kernel(bug, blocks, return_lse=True))
    ratios = _ratios(bug.id, kernel, case, seed, expected)
    judged = bug.breaks if case.dtype == bug.dtype else tuple(ratios)
    return {name: ratios[name] for name in judged if name in ratios}


def bug_ratio(
    bug: Bug,
    case: Case,
    blocks: tuple[int, int] = BLOCKS,
    seed: int = 0,
    expected: Expected | None = None,
) -> float:
    """The largest of `bug_ratios`: > 1, the rule fails ``bug`` on ``case``."""
    return max(bug_ratios(bug, case, blocks, seed, expected).values())


def correct_ratio(
    kernel: Kernel,
    case: Case,
    name: str = "correct",
    seed: int = 0,
    expected: Expected | None = None,
) -> float:
    """The largest ratio over every quantity of correct code ``kernel`` on ``case`` (<= 1
    passes); expected as in `bug_ratios`."""
    return max(_ratios(name, kernel, case, seed, expected).values())


@dataclass(frozen=True)
class CodeRatio:
    """Correct code's worst ratio in one dtype over the cases, the case it was on and the
    quantity (out, a gradient, lse)."""

    code: str
    dtype: torch.dtype
    ratio: float
    case: str
    quantity: str


@dataclass(frozen=True)
class BugRatio:
    """A bug's figure: over the cases in its dtype, the smallest of its largest ratio on the
    quantities it breaks (`bug_ratio`), the case it was on and the quantity that ratio is of."""

    bug: Bug
    ratio: float
    case: str
    quantity: str

    @property
    def caught(self) -> bool:
        return self.ratio > 1.0


@dataclass(frozen=True)
class Margins:
    """The rule's power on a grid: correct code's worst ratios and each bug's smallest."""

    correct: list[CodeRatio]
    bugs: list[BugRatio]

    def worst_correct(self, dtype: torch.dtype) -> float:
        """Correct code's worst ratio in ``dtype`` (nan when none ran in it)."""
        return max((c.ratio for c in self.correct if c.dtype == dtype), default=math.nan)

    def power(self, bug: BugRatio) -> float:
        """The gap: ``bug``'s smallest ratio over correct code's worst in its dtype."""
        return bug.ratio / self.worst_correct(bug.bug.dtype)


def _worst(ratios: Mapping[str, float]) -> tuple[float, str]:
    """The largest ratio of one run and its quantity."""
    name = max(ratios, key=ratios.__getitem__)
    return ratios[name], name


def _extreme(
    figures: Mapping[str, tuple[float, str]], pick: Callable[..., str]
) -> tuple[float, str, str]:
    """figures: case -> (ratio, quantity); ``pick`` (min or max) chooses the case by ratio:
    its ratio, the case and the quantity."""
    case = pick(figures, key=figures.__getitem__)
    return figures[case][0], case, figures[case][1]


def margins(
    cases: Sequence[Case],
    bugs: Sequence[Bug] = BUGS,
    blocks: tuple[int, int] = BLOCKS,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> Margins:
    """Correct code (`correct_kernels`) on every case and each bug on the cases in its dtype.

    A bug with no case in its dtype is left out, and so is correct code in a
    dtype no case has.  progress: called with a note after each code or bug.
    """
    step = progress or (lambda note: None)
    dtypes = list(dict.fromkeys(c.dtype for c in cases))
    expected = {c: expect_case(c, seed) for c in cases}  # shared by every code on the case
    correct = []
    for name, kernel in correct_kernels(blocks).items():
        for dtype in dtypes:
            figures = {
                c.id: _worst(_ratios(name, kernel, c, seed, expected[c]))
                for c in cases
                if c.dtype == dtype
            }
            correct.append(CodeRatio(name, dtype, *_extreme(figures, max)))
        step(name)
    found = []
    for bug in bugs:
        mine = [c for c in cases if c.dtype == bug.dtype]
        figures = {c.id: _worst(bug_ratios(bug, c, blocks, seed, expected[c])) for c in mine}
        if figures:
            found.append(BugRatio(bug, *_extreme(figures, min)))
            step(bug.id)
    return Margins(correct, found)
