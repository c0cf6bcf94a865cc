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
derivative of f (f is elementwise in S), taken by the evaluator of the
function's form, chosen once when the function is built
(`attngrad.core.score_forms`: general, elementwise on broadcast indices, or
relative):

    pullback:  dS = dS' * df/dS,  dtheta += (df/dtheta)^T dS'            (first order)
    push:      S'-dot = df/dS * S-dot + df/dtheta * theta-dot            (forward mode)
    second:    J^T S-hat + grad_(S, theta) <dS', J (S-dot, theta-dot)>   (second order)

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

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, TypeVar

import torch

from attngrad.core.contract import ArgumentError
from attngrad.core.modification import Parameters, ScoreModification
from attngrad.core.ops import compute_dtype
from attngrad.core.pointwise import INDEX, Reads, TileIndex, check_arity, explain, over_tile
from attngrad.core.score_forms import TERM_KEY, Form, Relative, check_score, form_of

if TYPE_CHECKING:
    from attngrad.core.block_table import BlockTable

__all__ = ["TERM_KEY", "ScoreFunction"]

V = TypeVar("V")


@dataclass(frozen=True, eq=False)  # holds a function and tensors: compared by identity
class ScoreFunction(ScoreModification):
    """A ``score_mod`` over tiles, with the tensors it captures (see the module docstring):
    a score modification (`attngrad.core.modification`) whose tensors are the captures and
    whose record of a tile is the scores it was applied to.

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
    whole tile raises an index error (module docstring); point: the (b, h, q_idx, kv_idx) it
    was checked at, a point where it is valid (a compiler's trace runs it there too).
    Each of the forms (general,
    elementwise, relative) has its evaluator, `form`, chosen when the function is built.
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
    point: tuple[int, int, int, int] = (0, 0, 0, 0)
    form: Form = field(init=False, compare=False, repr=False)  # its evaluator (`form_of`)

    def __post_init__(self) -> None:
        object.__setattr__(self, "form", form_of(self))

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
            check_score(out, s)
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
            identity[0], point=at,
        )  # fmt: skip

    def within(self, blocks: BlockTable | None) -> ScoreFunction:
        """The same function under the call's BlockMask (``blocks``; None: no mask)."""
        return replace(self, blocks=blocks)

    def with_captured(self, captured: Sequence[torch.Tensor]) -> ScoreFunction:
        """The same function reading ``captured`` (saved, unwrapped or batched copies)."""
        return replace(self, captured=tuple(captured))

    def folded(self, batch: int) -> ScoreFunction:
        """For a call whose batch folds vmap's samples: entry b reads b mod ``batch``."""
        blocks = None if self.blocks is None else self.blocks.folded(batch)
        return replace(self, batch=batch, blocks=blocks)

    records = True

    def parameters_of(self, bias: V, captured: Sequence[V]) -> tuple[V, ...]:
        """The entries of its captured tensors."""
        return tuple(captured)

    @property
    def grads_wanted(self) -> tuple[bool, ...]:
        """Which captures can take a gradient (floating point)."""
        return tuple(t.is_floating_point() for t in self.captured)

    def read(self, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """The captures as the tiles read them: 16-bit floats in ``dtype`` (float32)."""
        return tuple(
            t.to(dtype) if t.is_floating_point() and t.dtype.itemsize < dtype.itemsize else t
            for t in self.captured
        )

    @property
    def term(self) -> Form:
        """A relative function's term t(b, h, q_idx, 0) score by score, evaluated at
        q_idx = i - j (`TERM_KEY` as the key columns): what fused adds along the diagonals."""
        assert isinstance(self.form, Relative), "only a relative function has a term"
        return self.form.term

    # -- the form's evaluator (`attngrad.core.score_forms.Form`) on a tile ------------

    def values_(
        self, s5: torch.Tensor, rows: slice, cols: slice, raw: torch.Tensor | None = None
    ) -> torch.Tensor:
        """S' = score_mod(S) on the tile s5: [B, Hkv, G, r, c] raw scores, in place.

        ``raw``: receives a copy of s5's scores, which the `pullback_` of the same tile
        that follows (a backward pass's) reads; it is left as it is until then.
        """
        if raw is not None:
            raw.copy_(s5)
        return self.form.values_(s5, rows, cols, raw)

    def pullback_(
        self, raw: torch.Tensor | None, rows: slice, cols: slice, ds: torch.Tensor,
        dcaptured: Parameters,
    ) -> torch.Tensor:  # fmt: skip
        """dS = dS' * df/dS in place in ``ds``; dcaptured[n] += (df/dtheta_n)^T dS'.

        raw: the tile's raw scores [B, Hkv, G, r, c]; ds: dS' like it (or folded
        [B, Hkv, G*r, c]); dcaptured: accumulators like the captures (compute
        dtype), None where no gradient is wanted.
        """
        assert raw is not None
        return self.form.pullback_(raw, rows, cols, ds, dcaptured)

    def push(
        self, raw: torch.Tensor | None, rows: slice, cols: slice, s_dot: torch.Tensor,
        captured_dot: Parameters,
    ) -> torch.Tensor:  # fmt: skip
        """S'-dot = df/dS * s_dot + df/dtheta * theta_dot on the tile: [B, Hkv, G*r, c].

        raw: [B, Hkv, G, r, c] raw scores; s_dot like raw (or folded); captured_dot:
        tangents like the captures, None = zero.
        """
        assert raw is not None
        return self.form.push(raw, rows, cols, s_dot, captured_dot)

    def second(
        self, raw: torch.Tensor | None, rows: slice, cols: slice, ds: torch.Tensor,
        s_hat: torch.Tensor | None, s_dot: torch.Tensor | None, captured_dot: Parameters,
        dcaptured: Parameters,
    ) -> torch.Tensor | None:  # fmt: skip
        """The second-order pass's step through f (see `attngrad.autograd.second_order`).

        With S-hat the cotangent of S' and (s_dot, captured_dot) the direction
        (G_raw, g_theta): returns the raw scores' cotangent J_S^T S-hat +
        d/dS <dS', J (s_dot, theta_dot)> [B, Hkv, G*r, c] (None when both are
        zero), and adds the captures' part into ``dcaptured`` (None = not wanted).
        """
        assert raw is not None
        return self.form.second(raw, rows, cols, ds, s_hat, s_dot, captured_dot, dcaptured)
