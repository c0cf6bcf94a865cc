r"""FlexAttention's conformance cases: the score functions and BlockMasks the grid runs.

A `FlexScenario` is one way models call ``flex_attention``: a ``score_mod``
(which may read a learnable tensor theta, whose gradient is judged too), a
``mask_mod`` turned into a ``BlockMask`` by torch's ``create_block_mask``, or
both.  `SCENARIOS` holds the grid's; `flex_cases` puts each on a layout in
every dtype (`attngrad.verify.cases.Case` with ``flex`` set).  Blocks are
`BLOCK` = 16 square, so the layouts' odd lengths (61, 37, 53) end in a
padded block, and every mask has empty, full and partial blocks.

The functions are written as torch documents them, for one score with 0-d
int32 indices, and take theta as an argument, so each caller (the float64
reference, the plain run, the implementation judged) builds its own closure
over its own copy of theta (a leaf in its dtype).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from attngrad.core.contract import Shapes

__all__ = [
    "BLOCK",
    "GRID",
    "SCENARIOS",
    "FlexScenario",
    "MaskMod",
    "ScoreMod",
    "block_mask",
    "draw_theta",
    "scenario",
]

ScoreMod = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor
]
MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

# the BlockMasks' block size: small, so the grid's lengths span several blocks of each status
BLOCK = 16
# relative positions past this distance share one bucket (T5's clipped buckets)
RELATIVE_REACH = 8
SOFTCAP = 1.5
WINDOW = 12
PREFIX = 20
# document lengths of the square layout's 61 positions: no boundary on a block's edge
DOCUMENTS = (23, 17, 21)


@dataclass(frozen=True)
class FlexScenario:
    """One use of flex_attention: ``score(theta)`` builds the score_mod (None: none),
    ``mask(Nq, Nk)`` the mask_mod of the BlockMask (None: no BlockMask), ``theta(shapes,
    generator)`` draws the float64 tensor the score_mod reads and learns (None: none)."""

    name: str
    score: Callable[[torch.Tensor | None], ScoreMod] | None = None
    mask: Callable[[int, int], MaskMod] | None = None
    theta: Callable[[Shapes, torch.Generator], torch.Tensor] | None = None


# -- score functions ---------------------------------------------------------------


def _alibi(theta: torch.Tensor | None) -> ScoreMod:
    """ALiBi with learnable slopes theta [Hq]: s + theta[h] (j - i)."""
    assert theta is not None

    def score_mod(s: torch.Tensor, b: torch.Tensor, h: torch.Tensor, i: torch.Tensor,
                  j: torch.Tensor) -> torch.Tensor:  # fmt: skip
        return s + theta[h] * (j - i)

    return score_mod


def _alibi_slopes(shapes: Shapes, gen: torch.Generator) -> torch.Tensor:
    """ALiBi's geometric slopes 2^(-8 (h + 1) / H), each moved by a random factor near 1
    (so that rounding them to 16 bits is not exact)."""
    h = torch.arange(1, shapes.heads_q + 1, dtype=torch.float64)
    jitter = torch.randn(shapes.heads_q, generator=gen, dtype=torch.float64)
    return 2.0 ** (-8 * h / shapes.heads_q) * torch.exp(0.2 * jitter)


def _softcap(theta: torch.Tensor | None) -> ScoreMod:
    """Gemma-2's soft cap: c tanh(s / c)."""

    def score_mod(s: torch.Tensor, b: torch.Tensor, h: torch.Tensor, i: torch.Tensor,
                  j: torch.Tensor) -> torch.Tensor:  # fmt: skip
        return SOFTCAP * torch.tanh(s / SOFTCAP)

    return score_mod


def _relative(theta: torch.Tensor | None) -> ScoreMod:
    """A learnable relative-position table theta [Hq, 2 R + 1]: s + theta[h, clip(j - i) + R]."""
    assert theta is not None

    def score_mod(s: torch.Tensor, b: torch.Tensor, h: torch.Tensor, i: torch.Tensor,
                  j: torch.Tensor) -> torch.Tensor:  # fmt: skip
        bucket = torch.clamp(j - i, -RELATIVE_REACH, RELATIVE_REACH) + RELATIVE_REACH
        return s + theta[h, bucket]

    return score_mod


def _relative_table(shapes: Shapes, gen: torch.Generator) -> torch.Tensor:
    return 0.5 * torch.randn(
        shapes.heads_q, 2 * RELATIVE_REACH + 1, generator=gen, dtype=torch.float64
    )


# -- mask functions ----------------------------------------------------------------


def _causal(nq: int, nk: int) -> MaskMod:
    def mask_mod(
        b: torch.Tensor, h: torch.Tensor, i: torch.Tensor, j: torch.Tensor
    ) -> torch.Tensor:
        return j <= i

    return mask_mod


def _documents(nq: int, nk: int) -> MaskMod:
    """Packed documents: a query sees the keys of its own document."""
    docs = torch.repeat_interleave(torch.arange(len(DOCUMENTS)), torch.tensor(DOCUMENTS))
    if docs.numel() < max(nq, nk):
        raise ValueError(
            f"the documents {DOCUMENTS} cover {docs.numel()} positions, not {max(nq, nk)}"
        )

    def mask_mod(
        b: torch.Tensor, h: torch.Tensor, i: torch.Tensor, j: torch.Tensor
    ) -> torch.Tensor:
        return docs[i] == docs[j]

    return mask_mod


def _sliding(nq: int, nk: int) -> MaskMod:
    """Causal sliding window: the `WINDOW` latest keys up to the query's own."""

    def mask_mod(
        b: torch.Tensor, h: torch.Tensor, i: torch.Tensor, j: torch.Tensor
    ) -> torch.Tensor:
        return (j <= i) & (i - j < WINDOW)

    return mask_mod


def _prefix(nq: int, nk: int) -> MaskMod:
    """Prefix-LM: the first `PREFIX` keys are seen by every query, the rest causally."""

    def mask_mod(
        b: torch.Tensor, h: torch.Tensor, i: torch.Tensor, j: torch.Tensor
    ) -> torch.Tensor:
        return (j <= i) | (j < PREFIX)

    return mask_mod


def _empty_rows(nq: int, nk: int) -> MaskMod:
    """Causal, with query 5 and the whole second query block (16-31) attending nothing: a
    dead row inside a partial block and a block row with no key block at all."""

    def mask_mod(
        b: torch.Tensor, h: torch.Tensor, i: torch.Tensor, j: torch.Tensor
    ) -> torch.Tensor:
        return (j <= i) & (i // BLOCK != 1) & (i != 5)

    return mask_mod


SCENARIOS: dict[str, FlexScenario] = {
    s.name: s
    for s in (
        FlexScenario("none"),  # a plain call: the probes' base (`attngrad.verify.verify`)
        FlexScenario("alibi", score=_alibi, mask=_causal, theta=_alibi_slopes),
        FlexScenario("softcap", score=_softcap),
        FlexScenario("relative", score=_relative, theta=_relative_table),
        FlexScenario("document", mask=_documents),
        FlexScenario("sliding", mask=_sliding),
        FlexScenario("prefix", mask=_prefix),
        FlexScenario("empty-rows", mask=_empty_rows),
    )
}


# the grid's scenarios (`attngrad.verify.cases.flex_cases`): every one but the plain call
GRID = tuple(name for name in SCENARIOS if name != "none")


def scenario(name: str) -> FlexScenario:
    """The scenario called ``name`` (a key of `SCENARIOS`); ValueError naming them otherwise."""
    if name not in SCENARIOS:
        raise ValueError(f"no flex scenario {name!r}; pick one of {', '.join(SCENARIOS)}")
    return SCENARIOS[name]


@functools.cache
def block_mask(name: str, seq_q: int, seq_k: int) -> object:
    """The scenario's BlockMask for Nq x Nk on the CPU (shared by every batch entry and head),
    built once per process by torch's ``create_block_mask``; None without a mask_mod."""
    mask = scenario(name).mask
    if mask is None:
        return None
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(
        mask(seq_q, seq_k), None, None, seq_q, seq_k, device="cpu", BLOCK_SIZE=BLOCK
    )


def draw_theta(name: str, shapes: Shapes, gen: torch.Generator) -> torch.Tensor | None:
    """The scenario's theta drawn from ``gen`` (float64), or None when it reads none."""
    draw = scenario(name).theta
    return None if draw is None else draw(shapes, gen)
