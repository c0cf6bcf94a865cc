"""The interface every strategy implements: what a call hands it, what it answers.

Over the canonical layout q: [B, Hq, Nq, d], k: [B, Hkv, Nk, d],
v: [B, Hkv, Nk, dv] and the call's `attngrad.core.scores.ScoreMods`, a call
hands a strategy one typed object, never a list of positional arguments:

    Problem[T]   q, k, v, mods (the score modifications), scale, tiles (the
                 strategy's own tile type T)
    Backward[T]  a Problem, what forward saved, the cotangents dout (and
                 dlse), and the accumulators grads = (dq, dk, dv, dbias) and
                 dcaptured (the score function's captured tensors), each None
                 when that gradient is not wanted

and a `Strategy[T]` answers:

    unavailable_reason(device) -> str | None        why it cannot run here, or None
    tiles(shapes, dtype, block_q, block_k) -> T     its tile choice (raises on bad sizes)
    saves(shapes) -> Declaration                    what ``forward`` keeps beyond q, k, v:
        {name: (shape, kind)}, kind "input" stored in the input dtype, "stats"
        in the compute dtype; always "stats" [B, Hq, Nq, 2] = (m, log l)
    forward(problem) -> (O, saved)
        O: [B, Hq, Nq, dv] in the input dtype, a base tensor (callers may edit it);
        saved: {name: tensor} as declared; "o" is O itself
    backward_into(backward) -> None
        adds this call's gradients into backward.grads: accumulators in the
        compute dtype shaped like q, k, v and the bias (views welcome); dlse
        [B, Hq, Nq] (or None), lse's cotangent, joins dS as dlse * P
    probabilities(problem, saved) -> p_tile
        p_tile(rows, cols) -> P's tile [B, Hkv, G*r, c] in the compute dtype
        (read only): rebuilt from the statistics unless the strategy keeps P.
        Forward mode (`attngrad.autograd.tangent`) and the second-order
        backward (`attngrad.autograd.second_order`) walk tiles of it.
    pass_blocks(problem) -> Blocks                  the tiles those passes walk
    tangent(problem, saved, tangents, o) -> (O', lse') | None
        forward mode in the strategy's own kernels, or None (the default):
        then `attngrad.autograd.tangent` runs the shared tiled pass
    keeps_mods, tiled, function                     whether backward reads the
        mask again, whether it takes block_q and block_k, its `AttentionFunction`

The interface lives here, below autograd, because the autograd Functions
(`attngrad.autograd`) call it; the strategies themselves and their
`attngrad.strategies.base.AttentionFunction` sit above.  `Plan` is the
tensor-free part of a call those Functions carry from forward to backward.
`saved_bytes` turns a declaration into bytes: the one place the
saved-memory formula lives.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar

import torch

from attngrad.core.contract import Shapes
from attngrad.core.ops import compute_dtype
from attngrad.core.probabilities import ProbabilityTiles, rebuilt_probabilities
from attngrad.core.scores import ScoreMods
from attngrad.core.tiling import Blocks, tile_sizes

__all__ = [
    "Backward",
    "Declaration",
    "Grads",
    "Plan",
    "Problem",
    "Saved",
    "Strategy",
    "saved_bytes",
]

Grads = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]
Saved = dict[str, torch.Tensor]
Declaration = dict[str, tuple[tuple[int, ...], str]]

T = TypeVar("T")


@dataclass(frozen=True, eq=False)  # holds tensors: compared by identity
class Problem(Generic[T]):
    """What a call hands a strategy.

    q: [B, Hq, Nq, d], k: [B, Hkv, Nk, d], v: [B, Hkv, Nk, dv].
    mods: the masks (keep, band, BlockMask), the score modifications (softcap, a score
        function, the bias: ``mods.chain``) and dropout.
    scale: the scores' factor; tiles: the strategy's own tile choice.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mods: ScoreMods
    scale: float
    tiles: T

    @property
    def shapes(self) -> Shapes:
        return Shapes.of(self.q, self.k, self.v)

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype: float32 for 16-bit inputs, else the inputs' own."""
        return compute_dtype(self.q.dtype)


@dataclass(frozen=True, eq=False)
class Backward(Generic[T]):
    """What a strategy's backward takes: the problem, what forward saved, the cotangents
    dout [B, Hq, Nq, dv] and dlse [B, Hq, Nq] (or None), and the accumulators ``grads``
    (dq, dk, dv, dbias) it adds into, None where a gradient is not wanted, and
    ``dcaptured``, one per captured tensor of the score function (compute dtype).

    saved: forward's tensors, or (ring attention) the final O and statistics of
    these rows over every key.
    """

    problem: Problem[T]
    saved: Saved
    dout: torch.Tensor
    dlse: torch.Tensor | None
    grads: Grads
    dcaptured: tuple[torch.Tensor | None, ...] = ()


class Strategy(ABC, Generic[T]):
    """One execution path of the formulas (see the module docstring); T: its tile type."""

    name: ClassVar[str]
    keeps_mods: ClassVar[bool]  # whether backward reads the mask again
    tiled: ClassVar[bool]  # whether it takes block sizes (block_q, block_k)
    function: ClassVar[type[torch.autograd.Function]]  # its AttentionFunction
    # its ForwardTangentFunction, where `forward_tangent` may run (else None)
    tangent_function: ClassVar[type[torch.autograd.Function] | None] = None

    def unavailable_reason(self, device: torch.device) -> str | None:
        """Why the strategy cannot run on ``device`` tensors here, or None (plain tensor ops
        run on every device)."""
        return None

    def refuses(self, mods: ScoreMods) -> str | None:
        """Why the strategy cannot run a call with these mods, or None (the tensor-op
        strategies run every score function and BlockMask)."""
        return None

    @abstractmethod
    def tiles(
        self, shapes: Shapes, dtype: torch.dtype, block_q: int | None, block_k: int | None
    ) -> T:
        """The strategy's tile choice for a call; ArgumentError for sizes it cannot take."""

    @abstractmethod
    def saves(self, shapes: Shapes) -> Declaration:
        """The declaration of what ``forward`` saves beyond q, k, v."""

    @abstractmethod
    def forward(self, problem: Problem[T]) -> tuple[torch.Tensor, Saved]:
        """O: [B, Hq, Nq, dv] in the input dtype and the saved tensors (see `saves`)."""

    @abstractmethod
    def backward_into(self, backward: Backward[T]) -> None:
        """Add the call's gradients into ``backward.grads``."""

    def probabilities(self, problem: Problem[T], saved: Saved) -> ProbabilityTiles:
        """Tiles of P rebuilt from saved["stats"] (`attngrad.core.probabilities`)."""
        p = problem
        return rebuilt_probabilities(p.q, p.k, saved["stats"], p.mods, p.scale)

    def tangent(
        self,
        problem: Problem[T],
        saved: Saved,
        tangents: tuple[torch.Tensor | None, ...],
        o: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Forward mode in the strategy's own kernels: (O' [B, Hq, Nq, dv] in the input dtype,
        lse' [B, Hq, Nq] in the compute dtype), or None where it has none for this call (the
        default), and `attngrad.autograd.tangent` runs the shared tiled pass.

        tangents = (q', k', v', bias', *captured'), each like its input, None for zero;
        o: forward's O; saved: what forward saved, its statistics final.
        """
        return None

    def one_pass_tangent(
        self, problem: Problem[T], tangents: tuple[torch.Tensor | None, ...]
    ) -> bool:
        """Whether `forward_tangent` computes this call along ``tangents`` (as it takes them;
        default: no strategy's does)."""
        return False

    def forward_tangent(
        self, problem: Problem[T], tangents: tuple[torch.Tensor | None, ...]
    ) -> tuple[torch.Tensor, Saved, torch.Tensor, torch.Tensor] | None:
        """Forward mode in one pass with the forward: (O, saved) as `forward` returns them
        and (O', lse') as `tangent` does, or None where the strategy has no such pass for
        this call (the default: autograd's forward, then `tangent`).

        tangents = (q', k', v', bias', *captured'), as `tangent` takes them: each like its
        input (captured': the score function's captured tensors'), None for zero.  Called
        from `attngrad.strategies.base.ForwardTangentFunction` when the tangents are known
        before the call (`attngrad.strategies.base.differentiable`), where
        `one_pass_tangent` said yes.
        """
        return None

    def second_order(
        self,
        problem: Problem[T],
        saved: Saved,
        cotangents: tuple[torch.Tensor | None, ...],
        dout: torch.Tensor,
        dlse: torch.Tensor | None,
        need: tuple[bool, ...],
        sums: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor | None, ...] | None:
        """The second-order pass in the strategy's own kernels: the gradients of <g, (dq, dk,
        dv, dbias, *dcaptured)> w.r.t. (dout, dlse, q, k, v, bias, *captured) in the compute
        dtype, None where ``need`` says no -- or None where it has none for this call (the
        default), and `attngrad.autograd.second_order` runs the shared tiled pass.

        cotangents g = (g_q, g_k, g_v, g_bias, *g_captured), each like its input, None for
        zero; dout: [B, Hq, Nq, dv]; dlse: [B, Hq, Nq] or None; saved: what forward saved
        (for ring attention's blocks: the rows' final O and statistics over every key).
        sums: None, or the row sums over every key ([B, Hq, Nq, 4], `second_sums`'s summed
        over the key blocks) where k and v are one block of the keys: its gradients are then
        that block's share.
        """
        return None

    def second_sums(
        self,
        problem: Problem[T],
        saved: Saved,
        cotangents: tuple[torch.Tensor | None, ...],
        dout: torch.Tensor,
    ) -> torch.Tensor | None:
        """The row sums of the second-order pass over this call's keys, [B, Hq, Nq, 4] in the
        compute dtype (`attngrad.autograd.second_order.row_sums`: additive over key blocks),
        from the strategy's own kernels; None where `second_order` would be None (the
        default), and the shared tiled pass forms them."""
        return None

    def pass_blocks(self, problem: Problem[T]) -> Blocks:
        """The tiles of forward mode and the second-order backward: flash's defaults."""
        return tile_sizes(problem.shapes)

    def saved_names(self, shapes: Shapes) -> tuple[str, ...]:
        """The names of what it saves beyond q, k, v and O (which is an output)."""
        return tuple(n for n in self.saves(shapes) if n != "o")


@dataclass(frozen=True, eq=False)  # its mods hold the band's tensors: compared by identity
class Plan(Generic[T]):
    """The tensor-free part of a call that the autograd Functions carry from forward to
    backward: the strategy, the mods without their tensors, the scale, the tiles and
    the names of the saved tensors (which travel as tensors)."""

    strategy: Strategy[T]
    mods: ScoreMods
    scale: float
    tiles: T
    names: tuple[str, ...]

    @staticmethod
    def of(problem: Problem[T], strategy: Strategy[T]) -> Plan[T]:
        mods = problem.mods.with_tensors(None, None, ())
        names = strategy.saved_names(problem.shapes)
        return Plan(strategy, mods, problem.scale, problem.tiles, names)

    def problem(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        bias: torch.Tensor | None,
        keep: torch.Tensor | None,
        captured: tuple[torch.Tensor, ...] = (),
    ) -> Problem[T]:
        """The problem over these tensors (saved, or folded by vmap)."""
        mods = self.mods.with_tensors(bias, keep, captured)
        return Problem(q, k, v, mods, self.scale, self.tiles)

    @property
    def n_captured(self) -> int:
        """How many tensors the score function captures (they follow bias and keep)."""
        return 0 if self.mods.score is None else len(self.mods.score.keys)

    def saved(self, o: torch.Tensor | None, tensors: tuple[torch.Tensor, ...]) -> Saved:
        """The strategy's ``saved`` mapping from the saved tensors, with O as "o" when kept."""
        out = dict(zip(self.names, tensors, strict=True))
        if o is not None:
            out["o"] = o
        return out


def saved_bytes(
    strategy: Strategy[Any], shapes: Shapes, dtype: torch.dtype, mask_bytes: int = 0
) -> int:
    """Bytes a call of ``strategy`` keeps from forward to backward.

    q, k, v in the input dtype, then the strategy's declaration (`Strategy.saves`),
    then the caller's mask (``mask_bytes``) when the strategy keeps it.
    """
    b, stat = torch.finfo(dtype).bits // 8, torch.finfo(compute_dtype(dtype)).bits // 8
    sh = shapes
    total = b * sh.batch * (sh.heads_q * sh.seq_q * sh.head_dim)
    total += b * sh.batch * sh.heads_kv * sh.seq_k * (sh.head_dim + sh.value_dim)
    for shape, kind in strategy.saves(shapes).values():
        total += math.prod(shape) * (b if kind == "input" else stat)
    return total + (mask_bytes if strategy.keeps_mods else 0)
