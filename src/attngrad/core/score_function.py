r"""FlexAttention's score and mask functions, evaluated tile by tile, with their derivatives.

A ``score_mod(score, b, h, q_idx, kv_idx) -> score`` changes each scaled score
S = scale * q k^T; a ``mask_mod(b, h, q_idx, kv_idx) -> bool`` says which
scores are kept.  Both are written for one score, with 0-d int32 indices (h
the query head), as torch defines them; here they run over a whole tile
[B, H, r, c] at once under nested ``torch.vmap`` (torch's own eager route does
the same), so control flow on tensor values is refused, as torch refuses it.

The tensors a score function reads beyond its arguments -- a learnable ALiBi
slope, a relative-position table, a bias computed earlier in the model -- are
its *captures*.  `ScoreFunction.of` finds them by running the function once
under a `torch.overrides.TorchFunctionMode` that sees every tensor each op
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
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch._C._functorch import (
    _add_batch_dim,
    _remove_batch_dim,
    _vmap_decrement_nesting,
    _vmap_increment_nesting,
)
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from attngrad.core.contract import ArgumentError, ArgumentTypeError
from attngrad.core.ops import compute_dtype

__all__ = ["MaskFunction", "ScoreFunction", "TileIndex", "one_thread"]

_INDEX = torch.int32


def _tensors(tree: object) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


class _Reads(TorchFunctionMode):
    """While a score or mask function runs: record the tensors it reads that it did not
    make (``record``), or swap the captured tensors for others (``swap``, by identity)."""

    def __init__(self, made: Sequence[torch.Tensor], swap: dict[int, torch.Tensor] | None) -> None:
        super().__init__()
        self.made = {id(t) for t in made}
        self.keep: list[torch.Tensor] = list(made)  # alive, so that no id is reused meanwhile
        self.read: dict[int, torch.Tensor] = {}
        self.swap = swap

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if self.swap is not None:
            swap = self.swap
            args, kwargs = pytree.tree_map_only(
                torch.Tensor, lambda t: swap.get(id(t), t), (args, kwargs)
            )
            return func(*args, **kwargs)
        for t in _tensors((args, kwargs)):
            if id(t) not in self.made and id(t) not in self.read:
                self.read[id(t)] = t
        out = func(*args, **kwargs)
        made = _tensors(out)
        self.keep += made
        self.made.update(id(t) for t in made)
        return out


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Run the block's ops on one thread: a sum then rounds the same for any thread count,
    and small host-side ops do not wait on a busy machine's other threads."""
    threads = torch.get_num_threads()
    if threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@dataclass(frozen=True)
class TileIndex:
    """The indices of a tile of scores [B, H, r, c]: b (folded batch entries map to b mod
    ``batch``), h (query heads), q_idx = rows, kv_idx = cols, as int32 on ``device``."""

    b: torch.Tensor
    h: torch.Tensor
    i: torch.Tensor
    j: torch.Tensor

    @staticmethod
    def of(
        batch: int, folded: int, heads: int, rows: slice, cols: slice, device: torch.device
    ) -> TileIndex:
        def span(a: int, b: int) -> torch.Tensor:
            return torch.arange(a, b, dtype=_INDEX, device=device)

        return TileIndex(
            span(0, folded) % batch, span(0, heads), span(rows.start, rows.stop),
            span(cols.start, cols.stop),
        )  # fmt: skip


def _check_arity(fn: object, name: str, count: int, example: str) -> None:
    if not callable(fn):
        raise ArgumentTypeError(
            f"{name} must be a function {example}, got {type(fn).__name__} {fn!r}."
        )
    try:
        inspect.signature(fn).bind(*range(count))
    except TypeError:
        raise ArgumentTypeError(
            f"{name} must take {count} positional arguments {example}, got {fn!r} with "
            f"signature {inspect.signature(fn)}."
        ) from None
    except ValueError:  # a builtin without a signature: its call will say
        pass


def _over_tile(
    point: Callable[..., Any],
    s: torch.Tensor | None,
    index: TileIndex,
    extra: Sequence[torch.Tensor] = (),
) -> Any:
    """``point`` (one score, 0-d arguments) over a tile at once, as nested vmaps would run
    it: over b, then h, q_idx and kv_idx (innermost), the score s: [B, H, r, c] (or None,
    for a mask function) batched along each; ``extra`` passed whole.  The levels are
    entered by hand: ``torch.vmap``'s argument handling costs more than a tile's ops."""
    axes = [index.b, index.h, index.i, index.j]
    levels: list[tuple[int, int]] = []
    try:
        for n, ax in enumerate(axes):
            level = _vmap_increment_nesting(ax.shape[0], "error")
            levels.append((level, ax.shape[0]))
            if s is not None:
                s = _add_batch_dim(s, 0, level)
            axes[n] = _add_batch_dim(ax, 0, level)
        out = point(*(() if s is None else (s,)), *axes, *extra)
        while levels:
            level, size = levels.pop()
            if isinstance(out, torch.Tensor):
                out = _remove_batch_dim(out, level, size, 0)
            _vmap_decrement_nesting()
        return out
    finally:
        for _ in levels:
            _vmap_decrement_nesting()


def _explain(err: RuntimeError, name: str) -> Exception:
    """A clearer error for a function vmap cannot run (control flow on a tensor's value)."""
    text = str(err)
    if "data-dependent control flow" in text or "item()" in text or "Boolean value" in text:
        return ArgumentError(
            f"{name} uses a tensor's value in Python control flow (an if, while, bool() or "
            f".item()); it runs over whole tiles of scores at once, as in torch's "
            f"flex_attention. Write it with tensor ops: torch.where(cond, a, b) instead of "
            f"`a if cond else b`. ({text.splitlines()[0]})"
        )
    return err


@dataclass(frozen=True, eq=False)  # holds a function and tensors: compared by identity
class ScoreFunction:
    """A ``score_mod`` over tiles, with the tensors it captures (see the module docstring).

    fn: the user's function; keys: the identities of the captured tensors in the
    closure (``captured_originals``, which the closure keeps alive anyway);
    captured: the tensors read in their place (the Function's inputs), same
    order; batch: B of the call (a folded batch entry b reads b mod batch);
    heads: Hq.
    """

    fn: Callable[..., torch.Tensor]
    keys: tuple[int, ...]
    captured: tuple[torch.Tensor, ...]
    batch: int
    heads: int
    captured_originals: tuple[torch.Tensor, ...] = ()
    _cache: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @staticmethod
    def of(fn: object, q: torch.Tensor, batch: int) -> ScoreFunction:
        """Check ``fn`` on q's device and dtype and find its captures; q: [B, Hq, Nq, d]."""
        _check_arity(fn, "score_mod", 5, "score_mod(score, b, h, q_idx, kv_idx) -> score")
        assert callable(fn)
        dtype = compute_dtype(q.dtype)
        score = torch.zeros(1, 1, 1, 1, dtype=dtype, device=q.device)
        index = TileIndex.of(1, 1, 1, slice(0, 1), slice(0, 1), q.device)
        reads = _Reads((score, *index.__dict__.values()), None)

        def point(s: torch.Tensor, b: torch.Tensor, h: torch.Tensor, i: torch.Tensor,
                  j: torch.Tensor) -> torch.Tensor:  # fmt: skip
            reads.keep += [s, b, h, i, j]
            reads.made.update(id(t) for t in (s, b, h, i, j))
            with reads:
                out: torch.Tensor = fn(s, b, h, i, j)
            _check_score(out, s)
            return out

        try:
            _over_tile(point, score, index)
        except RuntimeError as err:
            raise _explain(err, "score_mod") from err
        captured = tuple(reads.read.values())
        for t in captured:
            if t.device != q.device:
                raise ArgumentError(
                    f"score_mod reads a tensor on {t.device} (shape {tuple(t.shape)}) but the "
                    f"query is on {q.device}; move the tensor to {q.device}."
                )
        keys = tuple(id(t) for t in captured)
        return ScoreFunction(fn, keys, captured, batch, q.shape[1], captured)

    def with_captured(self, captured: Sequence[torch.Tensor]) -> ScoreFunction:
        """The same function reading ``captured`` (saved, unwrapped or batched copies)."""
        return replace(self, captured=tuple(captured), _cache={})

    def folded(self, batch: int) -> ScoreFunction:
        """For a call whose batch folds vmap's samples: entry b reads b mod ``batch``."""
        return replace(self, batch=batch, _cache={})

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

    def _tile_fn(self, index: TileIndex) -> Callable[..., torch.Tensor]:
        """F(s [B, H, r, c], *captured) -> S' [B, H, r, c] on one tile."""
        fn, keys = self.fn, self.keys
        originals = self.captured_originals

        def point(s: torch.Tensor, b: torch.Tensor, h: torch.Tensor, i: torch.Tensor,
                  j: torch.Tensor, *captured: torch.Tensor) -> torch.Tensor:  # fmt: skip
            swap = {k: t for k, t, o in zip(keys, captured, originals, strict=True) if t is not o}
            with _Reads((), swap) if swap else contextlib.nullcontext():
                out = fn(s, b, h, i, j)
            _check_score(out, s)
            return out.to(s.dtype)

        def tile(s: torch.Tensor, *captured: torch.Tensor) -> torch.Tensor:
            if s.numel() == 0:  # a tile with no keys (or rows): nothing to evaluate
                return s.clone()
            try:
                return _over_tile(point, s, index, captured)  # type: ignore[no-any-return]
            except RuntimeError as err:
                raise _explain(err, "score_mod") from err

        return tile

    def _index(self, s5: torch.Tensor, rows: slice, cols: slice) -> TileIndex:
        b, hkv, g = s5.shape[:3]
        return TileIndex.of(self.batch, b, hkv * g, rows, cols, s5.device)

    @staticmethod
    def _flat(s5: torch.Tensor) -> torch.Tensor:
        b, hkv, g, r, c = s5.shape
        return s5.reshape(b, hkv * g, r, c)

    def values_(
        self, s5: torch.Tensor, rows: slice, cols: slice, keep_graph: bool = False
    ) -> torch.Tensor:
        """S' = score_mod(S) on the tile s5: [B, Hkv, G, r, c] raw scores, in place.

        ``keep_graph``: evaluate it differentiably and keep its graph for the
        `pullback_` of the same tile that follows (a backward pass's), which then
        does not evaluate it again.
        """
        if keep_graph:
            with torch.enable_grad():
                leaves = self._leaves(s5.clone(), rows, cols)  # s5 is overwritten next
            self._cache["graph"] = ((rows.start, rows.stop, cols.start, cols.stop), leaves)
            return s5.copy_(leaves[2].detach().view(s5.shape))
        f = self._tile_fn(self._index(s5, rows, cols))
        with torch.no_grad():
            out = f(self._flat(s5), *self._read(s5.dtype))
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
        f = self._tile_fn(self._index(raw, rows, cols))
        return x, theta, f(x, *theta)

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
        b, hkv, gq, r, c = raw.shape
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
        b, hkv, gq, r, c = raw.shape
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


@dataclass(frozen=True, eq=False)
class MaskFunction:
    """A ``mask_mod(b, h, q_idx, kv_idx) -> bool`` over tiles: True where a score is kept.

    batch: B of the call (a folded batch entry b reads b mod batch); heads: Hq.
    """

    fn: Callable[..., torch.Tensor]
    batch: int
    heads: int

    @staticmethod
    def of(fn: object, device: torch.device, batch: int, heads: int) -> MaskFunction:
        """Check ``fn``: four arguments, a bool result, no capture that requires grad."""
        _check_arity(fn, "mask_mod", 4, "mask_mod(b, h, q_idx, kv_idx) -> bool")
        assert callable(fn)
        index = TileIndex.of(1, 1, 1, slice(0, 1), slice(0, 1), device)
        reads = _Reads(tuple(index.__dict__.values()), None)

        def point(
            b: torch.Tensor, h: torch.Tensor, i: torch.Tensor, j: torch.Tensor
        ) -> torch.Tensor:
            reads.keep += [b, h, i, j]
            reads.made.update(id(t) for t in (b, h, i, j))
            with reads:
                out: torch.Tensor = fn(b, h, i, j)
            return out

        try:
            out = _over_tile(point, None, index)
        except RuntimeError as err:
            raise _explain(err, "mask_mod") from err
        if not isinstance(out, torch.Tensor) or out.dtype != torch.bool:
            got = f"dtype {out.dtype}" if isinstance(out, torch.Tensor) else type(out).__name__
            raise ArgumentTypeError(
                f"mask_mod must return a bool tensor (True = keep the score), got {got}. "
                "Return a comparison, e.g. `q_idx >= kv_idx`."
            )
        for t in reads.read.values():
            if t.requires_grad:
                raise ArgumentError(
                    f"mask_mod reads a tensor that requires grad (shape {tuple(t.shape)}): a "
                    "mask is not differentiable. Pass it detached (t.detach()), or put a "
                    "learnable term into score_mod."
                )
        return MaskFunction(fn, batch, heads)

    def folded(self, batch: int) -> MaskFunction:
        return replace(self, batch=batch)

    def keep(self, folded: int, rows: slice, cols: slice, device: torch.device) -> torch.Tensor:
        """mask_mod over the tile: bool [B, H, r, c] (B the folded batch)."""
        index = TileIndex.of(self.batch, folded, self.heads, rows, cols, device)
        fn = self.fn

        def point(
            b: torch.Tensor, h: torch.Tensor, i: torch.Tensor, j: torch.Tensor
        ) -> torch.Tensor:
            return fn(b, h, i, j)

        with torch.no_grad():
            try:
                keep: torch.Tensor = _over_tile(point, None, index)
            except RuntimeError as err:
                raise _explain(err, "mask_mod") from err
        return keep.expand(index.b.shape[0], index.h.shape[0], *keep.shape[2:])
