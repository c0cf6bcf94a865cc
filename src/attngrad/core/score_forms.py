r"""The forms of a score function: each evaluates f and its derivatives on a tile.

A `attngrad.core.score_function.ScoreFunction` S' = f(S, theta) takes one of
three forms, found when it is traced (`attngrad.core.pointwise.Reads`), and
picks the evaluator of that form once (`form_of`); each answers the same four
questions on a tile of raw scores S [B, Hkv, G, r, c] at query rows ``rows``
and key columns ``cols`` (slices with explicit bounds):

    values_   S' = f(S, theta), in place
    pullback_ dS = dS' * df/dS in place;  dtheta += (df/dtheta)^T dS'
    push      S'-dot = df/dS * S-dot + df/dtheta * theta-dot
    second    J^T S-hat + grad_(S, theta) <dS', J (S-dot, theta-dot)>   (second order)

* `General`: f runs over the tile under nested vmap, score by score, and
  autograd differentiates it on the tile (f is elementwise in S, so df/dS is
  one vector-Jacobian product with ones).
* `Elementwise`: every op of f acts on each score alone, so f runs once on the
  tile with broadcast indices (`attngrad.core.pointwise.broadcast_tile`),
  differentiated the same way.
* `Relative`: f is S + t(b, h, q_idx - kv_idx), so df/dS = 1 and a tile
  evaluates the term t at its r + c - 1 distances only, as a Toeplitz matrix
  (`attngrad.core.toeplitz`); theta's gradients come from dS' summed along the
  diagonals, through the term's own pullback.

Each tile's dtheta is formed on one thread and added in the tiles' fixed
order, so captured gradients are bitwise the same for any thread count.
Where a tile's evaluation raises an index error and the call has a BlockMask,
f is evaluated again at the tile's kept scores alone (`Pointwise`), as the
module docstring of `attngrad.core.score_function` says.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from attngrad.core.block_table import out_of_bounds, over_points
from attngrad.core.contract import ArgumentTypeError
from attngrad.core.pointwise import (
    Reads,
    TileIndex,
    broadcast_tile,
    explain,
    one_thread,
    over_tile,
)
from attngrad.core.toeplitz import diagonal_sums, toeplitz

if TYPE_CHECKING:
    from attngrad.core.block_table import BlockTable
    from attngrad.core.score_function import ScoreFunction

__all__ = [
    "TERM_KEY",
    "Elementwise",
    "Form",
    "General",
    "Pointwise",
    "Relative",
    "check_score",
    "form_of",
]

TERM_KEY = slice(0, 1)  # a relative function's term is evaluated at q_idx = i - j, kv_idx = 0

Captures = Sequence[torch.Tensor | None]
Point = Callable[..., torch.Tensor]  # a function of one score, run over a tile or points


class Form(ABC):
    """How a score function is evaluated on a tile (module docstring): raw: the tile's raw
    scores [B, Hkv, G, r, c]; dS', S-dot and S-hat like it or folded [B, Hkv, G*r, c];
    one entry per captured tensor in dcaptured (accumulators, compute dtype) and
    captured_dot (tangents), None where not wanted (zero)."""

    @abstractmethod
    def values_(
        self, s5: torch.Tensor, rows: slice, cols: slice, raw: torch.Tensor | None = None
    ) -> torch.Tensor:
        """S' = f(S) on the tile s5 in place; ``raw``: a copy of its scores that the
        `pullback_` of the same tile reads next (a form may keep f's graph on it)."""

    @abstractmethod
    def pullback_(
        self, raw: torch.Tensor, rows: slice, cols: slice, ds: torch.Tensor, dcaptured: Captures
    ) -> torch.Tensor:
        """dS = dS' * df/dS in place in ``ds``; dcaptured[n] += (df/dtheta_n)^T dS'."""

    @abstractmethod
    def push(
        self, raw: torch.Tensor, rows: slice, cols: slice, s_dot: torch.Tensor,
        captured_dot: Captures,
    ) -> torch.Tensor:  # fmt: skip
        """S'-dot = df/dS * s_dot + df/dtheta * theta_dot: [B, Hkv, G*r, c]."""

    @abstractmethod
    def second(
        self, raw: torch.Tensor, rows: slice, cols: slice, ds: torch.Tensor,
        s_hat: torch.Tensor | None, s_dot: torch.Tensor | None, captured_dot: Captures,
        dcaptured: Captures,
    ) -> torch.Tensor | None:  # fmt: skip
        """The raw scores' cotangent J_S^T S-hat + d/dS <dS', J (s_dot, theta_dot)>
        [B, Hkv, G*r, c] (None when both are zero); the captures' part is added into
        ``dcaptured``."""


def _flat(s5: torch.Tensor) -> torch.Tensor:
    """[B, Hkv, G, r, c] -> [B, Hkv*G, r, c]: the heads as the function sees them."""
    b, hkv, g, r, c = s5.shape
    return s5.reshape(b, hkv * g, r, c)


Leaves = tuple[torch.Tensor, tuple[torch.Tensor, ...], torch.Tensor]


class Pointwise(Form):
    """f evaluated score by score on the tile, differentiated by autograd; the forms differ
    in how a tile runs the function written for one score (`_tile`, `_points`)."""

    def __init__(self, f: ScoreFunction, blocks: BlockTable | None) -> None:
        self.f = f
        self.blocks = blocks  # the BlockMask whose kept scores a failing tile falls back to
        self._graph: tuple[tuple[int, int, int, int], Leaves] | None = None

    @abstractmethod
    def _tile(
        self, point: Point, s: torch.Tensor, index: TileIndex, captured: Sequence[torch.Tensor]
    ) -> torch.Tensor:
        """``point`` over the whole tile s [B, H, r, c]."""

    @abstractmethod
    def _points(
        self, point: Point, points: Sequence[torch.Tensor], theta: Sequence[torch.Tensor]
    ) -> torch.Tensor:
        """``point`` at P scattered points (each of ``points`` [P]): [P]."""

    def _shaped(self, out: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        """The function's output as the score it replaces."""
        return out

    def _point(self) -> Point:
        """f(s, b, h, q_idx, kv_idx, *captured) -> S', reading ``captured`` in the closure's
        captures' place (s and the indices 0-d, or broadcasting for `Elementwise`)."""
        fn, keys, originals = self.f.fn, self.f.keys, self.f.captured_originals
        shaped = self._shaped

        def point(s: torch.Tensor, b: torch.Tensor, h: torch.Tensor, i: torch.Tensor,
                  j: torch.Tensor, *captured: torch.Tensor) -> torch.Tensor:  # fmt: skip
            swap = {k: t for k, t, o in zip(keys, captured, originals, strict=True) if t is not o}
            with Reads((), swap) if swap else contextlib.nullcontext():
                out = shaped(fn(s, b, h, i, j), s)
            check_score(out, s)
            return out.to(s.dtype)

        return point

    def _tile_fn(self, index: TileIndex) -> Callable[..., torch.Tensor]:
        """F(s [B, H, r, c], *captured) -> S' [B, H, r, c] on one tile."""
        point = self._point()

        def tile(s: torch.Tensor, *captured: torch.Tensor) -> torch.Tensor:
            if s.numel() == 0:  # a tile with no keys (or rows): nothing to evaluate
                return s.clone()
            try:
                return self._tile(point, s, index, captured)
            except RuntimeError as err:
                raise explain(err, "score_mod") from err

        return tile

    def _evaluate(
        self, x: torch.Tensor, rows: slice, cols: slice, theta: Sequence[torch.Tensor]
    ) -> torch.Tensor:
        """f(x, theta) on the tile x [B, H, r, c]; where the whole tile raises an index
        error, at the BlockMask's kept scores alone (`_at_kept`)."""
        index = TileIndex.of(self.f.batch, x.shape[0], x.shape[1], rows, cols, x.device)
        try:
            return self._tile_fn(index)(x, *theta)
        except Exception as err:
            if self.blocks is None or not out_of_bounds(err):
                raise
            keep = self.blocks.keep(x.shape[0], rows, cols, x.device)
            if keep is None:  # it keeps every score of the tile: a real error
                raise
        return self._at_kept(x, keep, index, theta)

    def _at_kept(
        self, x: torch.Tensor, keep: torch.Tensor, index: TileIndex, theta: Sequence[torch.Tensor]
    ) -> torch.Tensor:
        """x with f(x, theta) at the scores ``keep`` [B, H, r, c] is True (one vmap over those
        points), x itself elsewhere: those scores are masked, -inf whatever f gives."""
        at = keep.nonzero(as_tuple=True)
        if at[0].numel() == 0:
            return x.clone()
        points = (x[at], index.b[at[0]], index.h[at[1]], index.i[at[2]], index.j[at[3]])
        try:
            y = self._points(self._point(), points, theta)
        except RuntimeError as err:
            raise explain(err, "score_mod") from err
        return x.index_put(at, y)

    def _leaves(self, raw: torch.Tensor, rows: slice, cols: slice) -> Leaves:
        """(x, theta, y = f(x, theta)) on the tile, x and theta fresh leaves that require
        grad (theta where floating), for autograd to differentiate f."""
        x = _flat(raw).detach().requires_grad_()
        read = self.f.read(raw.dtype)
        theta = tuple(
            t.detach().requires_grad_(w) for t, w in zip(read, self.f.grads_wanted, strict=True)
        )
        return x, theta, self._evaluate(x, rows, cols, theta)

    def values_(
        self, s5: torch.Tensor, rows: slice, cols: slice, raw: torch.Tensor | None = None
    ) -> torch.Tensor:
        if raw is not None:  # evaluated differentiably, its graph kept for the pullback
            with torch.enable_grad():
                leaves = self._leaves(raw, rows, cols)
            self._graph = ((rows.start, rows.stop, cols.start, cols.stop), leaves)
            return s5.copy_(leaves[2].detach().view(s5.shape))
        with torch.no_grad():
            out = self._evaluate(_flat(s5), rows, cols, self.f.read(s5.dtype))
        return s5.copy_(out.view(s5.shape))

    def pullback_(
        self, raw: torch.Tensor, rows: slice, cols: slice, ds: torch.Tensor, dcaptured: Captures
    ) -> torch.Tensor:
        wanted = [n for n, d in enumerate(dcaptured) if d is not None]
        kept, self._graph = self._graph, None
        with torch.enable_grad(), one_thread() if wanted else contextlib.nullcontext():
            if kept is not None and kept[0] == (rows.start, rows.stop, cols.start, cols.stop):
                x, theta, y = kept[1]
            else:
                x, theta, y = self._leaves(raw, rows, cols)
            inputs = (x, *(theta[n] for n in wanted))
            grads = torch.autograd.grad(
                y, inputs, ds.reshape(y.shape), allow_unused=True, materialize_grads=True
            )
        _add(dcaptured, wanted, grads[1:])
        return ds.copy_(grads[0].view(ds.shape))

    def push(
        self, raw: torch.Tensor, rows: slice, cols: slice, s_dot: torch.Tensor,
        captured_dot: Captures,
    ) -> torch.Tensor:  # fmt: skip
        """df/dS is one vector-Jacobian product with ones; the captures' part is the
        derivative in w of <(df/dtheta)^T w, theta_dot> (reverse mode twice: this also
        runs inside an outer forward-mode pass, where forward mode cannot nest)."""
        wants = self.f.grads_wanted
        moving = [n for n, d in enumerate(captured_dot) if d is not None and wants[n]]
        b, hkv, gq, r, c = raw.shape
        with torch.enable_grad():
            x, theta, y = self._leaves(raw, rows, cols)
            w = torch.ones_like(y, requires_grad=bool(moving))
            grads = torch.autograd.grad(
                y, (x, *(theta[n] for n in moving)), w, create_graph=bool(moving),
                allow_unused=True, materialize_grads=True,
            )  # fmt: skip
            out = grads[0].detach() * s_dot.reshape(y.shape)
            if moving:
                inner = y.new_zeros(())
                for n, g in zip(moving, grads[1:], strict=True):
                    dot = captured_dot[n]
                    assert dot is not None
                    inner = inner + (g * dot.to(g.dtype)).sum()
                (along,) = torch.autograd.grad(inner, w, allow_unused=True, materialize_grads=True)
                out = out + along
        return out.reshape(b, hkv, gq * r, c)

    def second(
        self, raw: torch.Tensor, rows: slice, cols: slice, ds: torch.Tensor,
        s_hat: torch.Tensor | None, s_dot: torch.Tensor | None, captured_dot: Captures,
        dcaptured: Captures,
    ) -> torch.Tensor | None:  # fmt: skip
        direction = s_dot is not None or any(d is not None for d in captured_dot)
        if s_hat is None and not direction:
            return None
        wanted = [n for n, d in enumerate(dcaptured) if d is not None]
        b, hkv, gq, r, c = raw.shape
        with torch.enable_grad(), one_thread() if wanted else contextlib.nullcontext():
            x, theta, y = self._leaves(raw, rows, cols)
            total = y.new_zeros(())
            if s_hat is not None:
                total = total + (y * s_hat.reshape(y.shape)).sum()
            if direction:
                floating = [n for n, t in enumerate(theta) if t.requires_grad]
                first = torch.autograd.grad(
                    y, (x, *(theta[n] for n in floating)), ds.reshape(y.shape),
                    create_graph=True, allow_unused=True, materialize_grads=True,
                )  # fmt: skip
                if s_dot is not None:
                    total = total + (first[0] * s_dot.reshape(y.shape)).sum()
                for n, g in zip(floating, first[1:], strict=True):
                    dot = captured_dot[n]
                    if dot is not None:
                        total = total + (g * dot.to(g.dtype)).sum()
            grads = torch.autograd.grad(
                total, (x, *(theta[n] for n in wanted)), allow_unused=True, materialize_grads=True
            )
        _add(dcaptured, wanted, grads[1:])
        return grads[0].reshape(b, hkv, gq * r, c)


class General(Pointwise):
    """Any score function: the tile under nested vmap (`attngrad.core.pointwise.over_tile`)."""

    def _tile(
        self, point: Point, s: torch.Tensor, index: TileIndex, captured: Sequence[torch.Tensor]
    ) -> torch.Tensor:
        out: torch.Tensor = over_tile(point, s, index, captured)
        return out

    def _points(
        self, point: Point, points: Sequence[torch.Tensor], theta: Sequence[torch.Tensor]
    ) -> torch.Tensor:
        return over_points(point, points, theta)


class Elementwise(Pointwise):
    """A function whose every op acts on each score alone: once on the tile, its indices
    broadcast (`attngrad.core.pointwise.broadcast_tile`)."""

    def _tile(
        self, point: Point, s: torch.Tensor, index: TileIndex, captured: Sequence[torch.Tensor]
    ) -> torch.Tensor:
        out: torch.Tensor = broadcast_tile(point, s, index, captured)
        return out

    def _points(
        self, point: Point, points: Sequence[torch.Tensor], theta: Sequence[torch.Tensor]
    ) -> torch.Tensor:
        return over_points(point, points, theta, elementwise=True)

    def _shaped(self, out: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        """Broadcast onto the tile (an output that is not a tensor is left to the check)."""
        return out.expand(s.shape) if isinstance(out, torch.Tensor) else out


class Relative(Form):
    """S' = S + t(b, h, q_idx - kv_idx): the term ``term`` at a tile's distances, as a
    Toeplitz matrix; where the distances raise an index error under a BlockMask, the
    function score by score (``pointwise``), which falls back to the kept scores."""

    def __init__(self, pointwise: Pointwise, term: Pointwise) -> None:
        self.pointwise = pointwise
        self.term = term  # score by score, at no real position (no BlockMask to fall back to)

    def _fallback(self, err: Exception) -> Pointwise:
        """The function score by score, where the distances raised ``err`` under a
        BlockMask (re-raises any other error)."""
        if self.pointwise.blocks is None or not out_of_bounds(err):
            raise err
        return self.pointwise

    @staticmethod
    def _distances(s5: torch.Tensor, rows: slice, cols: slice) -> tuple[torch.Tensor, slice] | None:
        """Zero scores [B, Hkv, G, r + c - 1, 1] at the distances i - j of the tile s5
        [B, Hkv, G, r, c], ascending, and those distances as a q_idx slice (with kv_idx
        0); None for an empty tile."""
        b, hkv, g, r, c = s5.shape
        if r == 0 or c == 0:
            return None
        low = rows.start - (cols.stop - 1)
        return s5.new_zeros(b, hkv, g, r + c - 1, 1), slice(low, rows.stop - cols.start)

    def values_(
        self, s5: torch.Tensor, rows: slice, cols: slice, raw: torch.Tensor | None = None
    ) -> torch.Tensor:
        at = self._distances(s5, rows, cols)
        if at is None:
            return s5
        z, d = at
        try:
            x = self.term.values_(z, d, TERM_KEY)
        except Exception as err:
            return self._fallback(err).values_(s5, rows, cols)
        b, hkv, g, r, c = s5.shape
        s5 += toeplitz(x.view(b, hkv, g, -1), r, c)
        return s5

    def pullback_(
        self, raw: torch.Tensor, rows: slice, cols: slice, ds: torch.Tensor, dcaptured: Captures
    ) -> torch.Tensor:
        """df/dS = 1; dtheta through the term, from dS' summed by distance."""
        at = self._distances(raw, rows, cols)
        if any(d is not None for d in dcaptured) and at is not None:
            z, d = at
            with one_thread():
                dx = diagonal_sums(ds.reshape(raw.shape))
            try:  # (it raises before it adds anything into dcaptured)
                self.term.pullback_(z, d, TERM_KEY, dx.view(z.shape), dcaptured)
            except Exception as err:
                return self._fallback(err).pullback_(raw, rows, cols, ds, dcaptured)
        return ds

    def push(
        self, raw: torch.Tensor, rows: slice, cols: slice, s_dot: torch.Tensor,
        captured_dot: Captures,
    ) -> torch.Tensor:  # fmt: skip
        """s_dot plus the term's tangent, at its distances."""
        wants = self.term.f.grads_wanted
        moving = any(d is not None and wants[n] for n, d in enumerate(captured_dot))
        b, hkv, gq, r, c = raw.shape
        out = s_dot.reshape(b, hkv, gq * r, c)
        at = self._distances(raw, rows, cols)
        if moving and at is not None:
            z, d = at
            try:
                x_dot = self.term.push(z, d, TERM_KEY, torch.zeros_like(z), captured_dot)
            except Exception as err:
                return self._fallback(err).push(raw, rows, cols, s_dot, captured_dot)
            out = out + toeplitz(x_dot.view(b, hkv, gq, -1), r, c).reshape(out.shape)
        return out

    def second(
        self, raw: torch.Tensor, rows: slice, cols: slice, ds: torch.Tensor,
        s_hat: torch.Tensor | None, s_dot: torch.Tensor | None, captured_dot: Captures,
        dcaptured: Captures,
    ) -> torch.Tensor | None:  # fmt: skip
        """J_S = 1 and no second derivative in S: only theta's part."""
        if s_hat is None and s_dot is None and all(d is None for d in captured_dot):
            return None
        b, hkv, gq, r, c = raw.shape
        at = self._distances(raw, rows, cols)
        wanted = any(d is not None for d in dcaptured)
        moving = any(d is not None for d in captured_dot)
        if wanted and at is not None and (s_hat is not None or moving):
            z, d = at
            with one_thread():
                sums = [
                    None if t is None else diagonal_sums(t.reshape(raw.shape)).view(z.shape)
                    for t in (ds, s_hat)
                ]
            assert sums[0] is not None
            try:  # (it raises before it adds anything into dcaptured)
                self.term.second(z, d, TERM_KEY, sums[0], sums[1], None, captured_dot, dcaptured)
            except Exception as err:
                pointwise = self._fallback(err)
                return pointwise.second(raw, rows, cols, ds, s_hat, s_dot, captured_dot, dcaptured)
        return None if s_hat is None else s_hat.reshape(b, hkv, gq * r, c)


def form_of(f: ScoreFunction) -> Form:
    """The evaluator of ``f``'s form (module docstring), chosen once."""
    pointwise: type[Pointwise] = Elementwise if f.elementwise else General
    if f.relative:
        return Relative(pointwise(f, f.blocks), pointwise(f, None))
    return pointwise(f, f.blocks)


def _add(dcaptured: Captures, wanted: Sequence[int], grads: Sequence[torch.Tensor]) -> None:
    """dcaptured[n] += the gradient of capture n, for each n in ``wanted``."""
    for n, g in zip(wanted, grads, strict=True):
        acc = dcaptured[n]
        assert acc is not None
        acc += g


def check_score(out: object, s: torch.Tensor) -> None:
    """Refuse a score function's output that is not a floating-point score like ``s``."""
    if not isinstance(out, torch.Tensor) or not out.is_floating_point() or out.shape != s.shape:
        got = (
            f"a {out.dtype} tensor of shape {tuple(out.shape)}"
            if isinstance(out, torch.Tensor)
            else f"{type(out).__name__} {out!r}"
        )
        raise ArgumentTypeError(
            "score_mod must return the modified score: a floating-point tensor shaped like "
            f"its `score` argument (one score, 0-d), got {got}. Return e.g. "
            "`score + bias[h]`."
        )
