r"""FlexAttention's score function, evaluated tile by tile, with its derivatives.

A ``score_mod(score, b, h, q_idx, kv_idx) -> score`` changes each scaled score
S = scale * q k^T; a ``mask_mod(b, h, q_idx, kv_idx) -> bool`` says which
scores are kept.  Both are written for one score, with 0-d int32 indices (h
the query head), as torch defines them; here they run over a whole tile
[B, H, r, c] at once under nested ``torch.vmap`` (torch's own eager route does
the same), so control flow on tensor values is refused, as torch refuses it.

The tensors a score function reads beyond its arguments -- a learnable ALiBi
slope, a relative-position table, a bias computed earlier in the model -- are
its *captures*.  `ScoreFunction.of` finds them by running the function once
under `attngrad.core.pointwise.Reads`, which sees every tensor each op
reads: whatever the function did not make itself was captured.  They become
inputs of the attention's autograd Function, so autograd and ``torch.func``
route their gradients; every later evaluation substitutes the tensors the
Function holds for the ones the closure holds (by identity), so the same
function runs on saved, unwrapped or batched copies.

With S' = f(S, theta) on a tile, every derivative the strategies need is a
derivative of f, taken with autograd on the tile (f is elementwise in S):

    pullback:  dS = dS' * df/dS,  dtheta += (df/dtheta)^T dS'            (first order)
    push:      S'-dot = df/dS * S-dot + df/dtheta * theta-dot            (forward mode)
    second:    J^T S-hat + grad_(S, theta) <dS', J (S-dot, theta-dot)>   (second order)

Each tile's dtheta is formed on one thread and added in the tiles' fixed
order, so captured gradients are bitwise the same for any thread count.
Captures in 16-bit dtypes are read in float32 (the compute dtype), so their
gradients accumulate in float32 and are cast back once.

A function may be valid only where the call's BlockMask keeps scores, as torch's
compiled kernel evaluates it: a paged-attention ``table[b, kv_idx - offset[b]]`` reads
past its table in another batch entry's blocks.  Where a tile's evaluation raises an
index error (`attngrad.core.block_table.out_of_bounds`), it is evaluated again at the
tile's kept scores alone, one vmap over those points, the others left as they are (the
mask makes them -inf and nothing flows back through them); every pass above does so,
and the common path costs nothing more.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from attngrad.core.block_table import out_of_bounds, over_points
from attngrad.core.contract import ArgumentError, ArgumentTypeError
from attngrad.core.ops import compute_dtype
from attngrad.core.pointwise import (
    INDEX,
    Reads,
    TileIndex,
    broadcast_tile,
    check_arity,
    explain,
    one_thread,
    over_tile,
)
from attngrad.core.toeplitz import diagonal_sums, toeplitz

if TYPE_CHECKING:
    from attngrad.core.block_table import BlockTable

__all__ = ["ScoreFunction"]

_KEY = slice(0, 1)  # a relative function's term is evaluated at q_idx = i - j, kv_idx = 0


@dataclass(frozen=True, eq=False)  # holds a function and tensors: compared by identity
class ScoreFunction:
    """A ``score_mod`` over tiles, with the tensors it captures (see the module docstring).

    fn: the user's function; keys: the identities of the captured tensors in the
    closure (``captured_originals``, which the closure keeps alive anyway);
    captured: the tensors read in their place (the Function's inputs), same
    order; batch: B of the call (a folded batch entry b reads b mod batch);
    heads: Hq; elementwise: every op of it acts on each score alone
    (`attngrad.core.pointwise.Reads`), so a tile runs it once on broadcast indices
    instead of under vmap; relative: it is ``score + x(b, h, q_idx - kv_idx)``, so a tile
    evaluates x at its r + c - 1 distances only (`attngrad.core.toeplitz`); identity: it
    returns its score argument unchanged (torch's ``_identity``), so a call runs without
    it; blocks: the call's BlockMask, whose kept scores a tile falls back to where the
    whole tile raises an index error (module docstring).
    """

    fn: Callable[..., torch.Tensor]
    keys: tuple[int, ...]
    captured: tuple[torch.Tensor, ...]
    batch: int
    heads: int
    captured_originals: tuple[torch.Tensor, ...] = ()
    elementwise: bool = False
    relative: bool = False
    identity: bool = False
    blocks: BlockTable | None = None
    _cache: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @staticmethod
    def of(
        fn: object, q: torch.Tensor, batch: int, at: tuple[int, int, int, int] = (0, 0, 0, 0)
    ) -> ScoreFunction:
        """Check ``fn`` on q's device and dtype and find its captures; q: [B, Hq, Nq, d].
        ``fn`` is called once, at (b, h, q_idx, kv_idx) = ``at``."""
        check_arity(fn, "score_mod", 5, "score_mod(score, b, h, q_idx, kv_idx) -> score")
        assert callable(fn)
        dtype = compute_dtype(q.dtype)
        score = torch.zeros(1, 1, 1, 1, dtype=dtype, device=q.device)
        index = TileIndex(*(torch.tensor([n], dtype=INDEX, device=q.device) for n in at))
        reads = Reads((score, *index.__dict__.values()), None)

        def point(s: torch.Tensor, b: torch.Tensor, h: torch.Tensor, i: torch.Tensor,
                  j: torch.Tensor) -> torch.Tensor:  # fmt: skip
            reads.keep += [s, b, h, i, j]
            reads.made.update(id(t) for t in (s, b, h, i, j))
            reads.name(s=s, b=b, h=h, i=i, j=j)
            with reads:
                out: torch.Tensor = fn(s, b, h, i, j)
            _check_score(out, s)
            relative.append(reads.relative(out))
            identity.append(out is s)
            return out

        relative: list[bool] = []
        identity: list[bool] = []

        try:
            over_tile(point, score, index)
        except RuntimeError as err:
            raise explain(err, "score_mod") from err
        captured = tuple(reads.read.values())
        for t in captured:
            if t.device != q.device:
                raise ArgumentError(
                    f"score_mod reads a tensor on {t.device} (shape {tuple(t.shape)}) but the "
                    f"query is on {q.device}; move the tensor to {q.device}."
                )
        keys = tuple(id(t) for t in captured)
        return ScoreFunction(
            fn, keys, captured, batch, q.shape[1], captured, reads.elementwise, relative[0],
            identity[0],
        )  # fmt: skip

    def within(self, blocks: BlockTable | None) -> ScoreFunction:
        """The same function under the call's BlockMask (``blocks``; None: no mask)."""
        return replace(self, blocks=blocks, _cache={})

    def with_captured(self, captured: Sequence[torch.Tensor]) -> ScoreFunction:
        """The same function reading ``captured`` (saved, unwrapped or batched copies)."""
        return replace(self, captured=tuple(captured), _cache={})

    def folded(self, batch: int) -> ScoreFunction:
        """For a call whose batch folds vmap's samples: entry b reads b mod ``batch``."""
        blocks = None if self.blocks is None else self.blocks.folded(batch)
        return replace(self, batch=batch, blocks=blocks, _cache={})

    @property
    def grads_wanted(self) -> tuple[bool, ...]:
        """Which captures can take a gradient (floating point)."""
        return tuple(t.is_floating_point() for t in self.captured)

    # -- evaluating ---------------------------------------------------------

    def _read(self, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """The captures as the tiles read them: 16-bit floats in ``dtype`` (float32)."""
        return tuple(
            t.to(dtype) if t.is_floating_point() and t.dtype.itemsize < dtype.itemsize else t
            for t in self.captured
        )

    def _point(self) -> Callable[..., torch.Tensor]:
        """f(s, b, h, q_idx, kv_idx, *captured) -> S', reading ``captured`` in the closure's
        captures' place (s and the indices 0-d, or broadcasting for an elementwise f)."""
        fn, keys = self.fn, self.keys
        originals = self.captured_originals
        elementwise = self.elementwise

        def point(s: torch.Tensor, b: torch.Tensor, h: torch.Tensor, i: torch.Tensor,
                  j: torch.Tensor, *captured: torch.Tensor) -> torch.Tensor:  # fmt: skip
            swap = {k: t for k, t, o in zip(keys, captured, originals, strict=True) if t is not o}
            with Reads((), swap) if swap else contextlib.nullcontext():
                out = fn(s, b, h, i, j)
            if elementwise and isinstance(out, torch.Tensor):  # broadcast onto the tile
                out = out.expand(s.shape)
            _check_score(out, s)
            return out.to(s.dtype)

        return point

    def _tile_fn(self, index: TileIndex) -> Callable[..., torch.Tensor]:
        """F(s [B, H, r, c], *captured) -> S' [B, H, r, c] on one tile."""
        point = self._point()
        run = broadcast_tile if self.elementwise else over_tile

        def tile(s: torch.Tensor, *captured: torch.Tensor) -> torch.Tensor:
            if s.numel() == 0:  # a tile with no keys (or rows): nothing to evaluate
                return s.clone()
            try:
                return run(point, s, index, captured)  # type: ignore[no-any-return]
            except RuntimeError as err:
                raise explain(err, "score_mod") from err

        return tile

    def _evaluate(
        self, x: torch.Tensor, rows: slice, cols: slice, theta: Sequence[torch.Tensor]
    ) -> torch.Tensor:
        """f(x, theta) on the tile x [B, H, r, c]; where the whole tile raises an index
        error, at the BlockMask's kept scores alone (`_at_kept`)."""
        index = TileIndex.of(self.batch, x.shape[0], x.shape[1], rows, cols, x.device)
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
            y = over_points(self._point(), points, theta, self.elementwise)
        except RuntimeError as err:
            raise explain(err, "score_mod") from err
        return x.index_put(at, y)

    def _fallback(self, err: Exception) -> ScoreFunction:
        """A relative function whose distances raised ``err``: itself score by score, which
        falls back to the BlockMask's kept scores (re-raises any other error)."""
        if self.blocks is None or not out_of_bounds(err):
            raise err
        return self._pointwise

    def _index(self, s5: torch.Tensor, rows: slice, cols: slice) -> TileIndex:
        b, hkv, g = s5.shape[:3]
        return TileIndex.of(self.batch, b, hkv * g, rows, cols, s5.device)

    @staticmethod
    def _flat(s5: torch.Tensor) -> torch.Tensor:
        b, hkv, g, r, c = s5.shape
        return s5.reshape(b, hkv * g, r, c)

    def _distances(
        self, s5: torch.Tensor, rows: slice, cols: slice
    ) -> tuple[torch.Tensor, slice] | None:
        """For a relative function: zero scores [B, Hkv, G, r + c - 1, 1] at the distances
        i - j of the tile s5 [B, Hkv, G, r, c], ascending, and those distances as a
        q_idx slice (with kv_idx 0); None for an empty tile."""
        b, hkv, g, r, c = s5.shape
        if r == 0 or c == 0:
            return None
        low = rows.start - (cols.stop - 1)
        return s5.new_zeros(b, hkv, g, r + c - 1, 1), slice(low, rows.stop - cols.start)

    @property
    def _pointwise(self) -> ScoreFunction:
        """This function evaluated score by score (a relative one's fallback)."""
        if "pointwise" not in self._cache:
            self._cache["pointwise"] = replace(self, relative=False, _cache={})
        return self._cache["pointwise"]  # type: ignore[no-any-return]

    @property
    def _terms(self) -> ScoreFunction:
        """A relative function's term at its distances: score by score, at no real position
        (so no BlockMask to fall back to)."""
        if "terms" not in self._cache:
            self._cache["terms"] = replace(self, relative=False, blocks=None, _cache={})
        return self._cache["terms"]  # type: ignore[no-any-return]

    def values_(
        self, s5: torch.Tensor, rows: slice, cols: slice, raw: torch.Tensor | None = None
    ) -> torch.Tensor:
        """S' = score_mod(S) on the tile s5: [B, Hkv, G, r, c] raw scores, in place.

        ``raw``: a copy of s5's scores, left as it is until the `pullback_` of the same
        tile that follows (a backward pass's): the function is evaluated differentiably
        on it and its graph kept, so that the pullback does not evaluate it again.
        """
        if self.relative:
            at = self._distances(s5, rows, cols)
            if at is not None:
                z, d = at
                try:
                    with torch.no_grad():
                        x = self._tile_fn(self._index(z, d, _KEY))(
                            self._flat(z), *self._read(z.dtype)
                        )
                except Exception as err:
                    return self._fallback(err).values_(s5, rows, cols)
                b, hkv, g, r, c = s5.shape
                s5 += toeplitz(x.view(b, hkv, g, -1), r, c)
            return s5
        if raw is not None:
            with torch.enable_grad():
                leaves = self._leaves(raw, rows, cols)
            self._cache["graph"] = ((rows.start, rows.stop, cols.start, cols.stop), leaves)
            return s5.copy_(leaves[2].detach().view(s5.shape))
        with torch.no_grad():
            out = self._evaluate(self._flat(s5), rows, cols, self._read(s5.dtype))
        return s5.copy_(out.view(s5.shape))

    def _leaves(
        self, raw: torch.Tensor, rows: slice, cols: slice
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], torch.Tensor]:
        """(x, theta, y = f(x, theta)) on the tile, x and theta fresh leaves that require
        grad (theta where floating), for autograd to differentiate f."""
        x = self._flat(raw).detach().requires_grad_()
        read = self._read(raw.dtype)
        theta = tuple(
            t.detach().requires_grad_(w) for t, w in zip(read, self.grads_wanted, strict=True)
        )
        return x, theta, self._evaluate(x, rows, cols, theta)

    def pullback_(
        self,
        raw: torch.Tensor,
        rows: slice,
        cols: slice,
        ds: torch.Tensor,
        dcaptured: Sequence[torch.Tensor | None],
    ) -> torch.Tensor:
        """dS = dS' * df/dS in place in ``ds``; dcaptured[n] += (df/dtheta_n)^T dS'.

        raw: the tile's raw scores [B, Hkv, G, r, c]; ds: dS' like it (or folded
        [B, Hkv, G*r, c]); dcaptured: accumulators like the captures (compute
        dtype), None where no gradient is wanted.
        """
        wanted = [n for n, d in enumerate(dcaptured) if d is not None]
        if self.relative:  # df/dS = 1; dtheta through the term, from dS' summed by distance
            at = self._distances(raw, rows, cols)
            if wanted and at is not None:
                z, d = at
                with one_thread():
                    dx = diagonal_sums(ds.reshape(raw.shape))
                try:  # (it raises before it adds anything into dcaptured)
                    self._terms.pullback_(z, d, _KEY, dx.view(z.shape), dcaptured)
                except Exception as err:
                    return self._fallback(err).pullback_(raw, rows, cols, ds, dcaptured)
            return ds
        kept = self._cache.pop("graph", None)
        with torch.enable_grad(), one_thread() if wanted else contextlib.nullcontext():
            if kept is not None and kept[0] == (rows.start, rows.stop, cols.start, cols.stop):
                x, theta, y = kept[1]
            else:
                x, theta, y = self._leaves(raw, rows, cols)
            inputs = (x, *(theta[n] for n in wanted))
            grads = torch.autograd.grad(
                y, inputs, ds.reshape(y.shape), allow_unused=True, materialize_grads=True
            )
        for n, g in zip(wanted, grads[1:], strict=True):
            acc = dcaptured[n]
            assert acc is not None
            acc += g
        return ds.copy_(grads[0].view(ds.shape))

    def push(
        self,
        raw: torch.Tensor,
        rows: slice,
        cols: slice,
        s_dot: torch.Tensor,
        captured_dot: Sequence[torch.Tensor | None],
    ) -> torch.Tensor:
        """S'-dot = df/dS * s_dot + df/dtheta * theta_dot on the tile: [B, Hkv, G*r, c].

        raw: [B, Hkv, G, r, c] raw scores; s_dot like raw (or folded); captured_dot:
        tangents like the captures, None = zero.  f is elementwise in S, so
        df/dS is one vector-Jacobian product with ones; the captures' part is
        the derivative in w of <(df/dtheta)^T w, theta_dot> (reverse mode
        twice: this also runs inside an outer forward-mode pass, where forward
        mode cannot nest).
        """
        moving = [n for n, d in enumerate(captured_dot) if d is not None and self.grads_wanted[n]]
        b, hkv, gq, r, c = raw.shape
        if self.relative:  # s_dot plus the term's tangent, at its distances
            out = s_dot.reshape(b, hkv, gq * r, c)
            at = self._distances(raw, rows, cols)
            if moving and at is not None:
                z, d = at
                try:
                    x_dot = self._terms.push(z, d, _KEY, torch.zeros_like(z), captured_dot)
                except Exception as err:
                    return self._fallback(err).push(raw, rows, cols, s_dot, captured_dot)
                out = out + toeplitz(x_dot.view(b, hkv, gq, -1), r, c).reshape(out.shape)
            return out
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
        self,
        raw: torch.Tensor,
        rows: slice,
        cols: slice,
        ds: torch.Tensor,
        s_hat: torch.Tensor | None,
        s_dot: torch.Tensor | None,
        captured_dot: Sequence[torch.Tensor | None],
        dcaptured: Sequence[torch.Tensor | None],
    ) -> torch.Tensor | None:
        """The second-order pass's step through f (see `attngrad.autograd.second_order`).

        With S-hat the cotangent of S' and (s_dot, captured_dot) the direction
        (G_raw, g_theta): returns the raw scores' cotangent J_S^T S-hat +
        d/dS <dS', J (s_dot, theta_dot)> [B, Hkv, G*r, c] (None when both are
        zero), and adds the captures' part into ``dcaptured`` (None = not wanted).
        """
        direction = s_dot is not None or any(d is not None for d in captured_dot)
        if s_hat is None and not direction:
            return None
        wanted = [n for n, d in enumerate(dcaptured) if d is not None]
        b, hkv, gq, r, c = raw.shape
        if self.relative:  # J_S = 1 and no second derivative in S: only theta's part
            at = self._distances(raw, rows, cols)
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
                    self._terms.second(z, d, _KEY, sums[0], sums[1], None, captured_dot, dcaptured)
                except Exception as err:
                    pointwise = self._fallback(err)
                    return pointwise.second(
                        raw, rows, cols, ds, s_hat, s_dot, captured_dot, dcaptured
                    )
            return None if s_hat is None else s_hat.reshape(b, hkv, gq * r, c)
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
                    if captured_dot[n] is not None:
                        total = total + (g * captured_dot[n].to(g.dtype)).sum()  # type: ignore[union-attr]
            grads = torch.autograd.grad(
                total, (x, *(theta[n] for n in wanted)), allow_unused=True, materialize_grads=True
            )
        for n, g in zip(wanted, grads[1:], strict=True):
            acc = dcaptured[n]
            assert acc is not None
            acc += g
        return grads[0].reshape(b, hkv, gq * r, c)


def _check_score(out: object, s: torch.Tensor) -> None:
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
