"""A function of one score, run over a whole tile of scores: FlexAttention's calling convention.

torch's ``score_mod(score, b, h, q_idx, kv_idx)`` and ``mask_mod(b, h, q_idx, kv_idx)``
are written for one score, with 0-d int32 indices (h the query head).  `over_tile` runs
one over a tile [B, H, r, c] at once, as nested ``torch.vmap`` would (torch's own eager
route does the same): control flow on a tensor's value is refused there, as torch refuses
it (`explain` says how to write it instead).  `Reads`, a
`torch.overrides.TorchFunctionMode`, sees every tensor the function's ops read: it finds
the tensors a function captures (whatever it read but did not make), or swaps them for
others by identity; and whether every op acts on each score alone, in which case
`broadcast_tile` runs the function once on broadcast indices instead, with the same result.  `one_thread` runs a block on one thread: a sum then rounds the same
for any thread count.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
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

__all__ = [
    "ELEMENTWISE",
    "INDEX",
    "Reads",
    "TileIndex",
    "broadcast_axes",
    "broadcast_tile",
    "check_arity",
    "explain",
    "one_thread",
    "over_tile",
]

INDEX = torch.int32  # the indices' dtype, as torch passes them


def _tensors(tree: object) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


# Ops that act on each score alone, broadcasting their operands: a function made of these
# (and `_full_index`) gives over a tile, called once on broadcast indices, what nested vmaps
# give, without vmap's per-op cost or its copies of expanded index tensors.
ELEMENTWISE = frozenset(
    """__add__ __radd__ __sub__ __rsub__ __mul__ __rmul__ __truediv__ __rtruediv__
    __floordiv__ __rfloordiv__ __mod__ __rmod__ __pow__ __rpow__ __neg__ __abs__ __and__
    __rand__ __or__ __ror__ __xor__ __rxor__ __invert__ __eq__ __ne__ __lt__ __le__ __gt__
    __ge__ __lshift__ __rshift__ add sub subtract mul multiply div divide true_divide
    floor_divide remainder fmod pow neg negative abs exp exp2 expm1 log log2 log10 log1p sqrt
    rsqrt square reciprocal tanh sigmoid sin cos tan atan atan2 asin acos sinh cosh erf erfc
    relu gelu silu softplus logsigmoid clamp clamp_min clamp_max clip minimum maximum fmin
    fmax where logical_and logical_or logical_not logical_xor bitwise_and bitwise_or
    bitwise_xor bitwise_not eq ne lt le gt ge sign sgn floor ceil round trunc frac to float
    double half bfloat16 long int short bool type_as lerp hypot copysign nan_to_num isnan
    isinf isfinite masked_fill zeros_like ones_like full_like""".split()  # noqa: SIM905
)
# a new tensor of its own size: elementwise when that is () (``q_idx.new_ones(())``, how
# torch's and transformers' ``and_masks`` / ``or_masks`` start)
_CONSTANTS = frozenset({"new_ones", "new_zeros", "new_full", "new_tensor"})
_ADD = frozenset({"add", "__add__", "__radd__"})
_SUBTRACT = frozenset({"sub", "__sub__", "subtract"})
_RELATIVE = frozenset("sbhd")  # the score, b, h and q_idx - kv_idx
_PROPERTIES = frozenset({torch.Tensor.dtype.__get__, torch.Tensor.device.__get__})  # type: ignore[attr-defined]


def _scalar_constant(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """``t.new_ones(())`` and its kin: a 0-d tensor, the same for every score."""
    if name not in _CONSTANTS:
        return False
    if name == "new_tensor":  # new_tensor(data): a Python number
        data = args[1] if len(args) > 1 else kwargs.get("data")
        return isinstance(data, (bool, int, float))
    size = kwargs.get("size", args[1] if len(args) > 1 else None)
    return (
        isinstance(size, (tuple, list, torch.Size))
        and len(size) == 0
        and (len(args) <= 2 or name == "new_full")
    )


def _full_index(base: object, index: object) -> bool:
    """``base[index]`` reads one element per index: every position given, by tensors or ints."""
    entries = index if isinstance(index, tuple) else (index,)
    return (
        isinstance(base, torch.Tensor)
        and len(entries) == base.dim()
        and any(isinstance(e, torch.Tensor) for e in entries)
        and all(
            (isinstance(e, torch.Tensor) and not e.is_floating_point() and e.dtype != torch.bool)
            or (isinstance(e, int) and not isinstance(e, bool))
            for e in entries
        )
    )


class Reads(TorchFunctionMode):
    """While a score or mask function runs: record the tensors it reads that it did not
    make and whether it is elementwise (``record``), or swap the captured tensors for others
    (``swap``, by identity).

    ``elementwise`` stays True while every op is one of `ELEMENTWISE`, reads a dtype or
    device, makes a 0-d constant (``q_idx.new_ones(())``, as ``and_masks`` does), or
    indexes a captured tensor at every position (``table[h, q_idx - kv_idx]``).

    Given the arguments' names (``name``: "s", "b", "h", "i", "j"), it also follows which
    of them each tensor was computed from, with ``q_idx - kv_idx`` (either order, either
    index plus or minus a Python int) counted as one argument "d", and which tensors are
    the score plus a term not computed from it: `relative` says whether a result is
    ``score + x(b, h, q_idx - kv_idx)``.
    """

    def __init__(self, made: Sequence[torch.Tensor], swap: dict[int, torch.Tensor] | None) -> None:
        super().__init__()
        self.made = {id(t) for t in made}
        self.keep: list[torch.Tensor] = list(made)  # alive, so that no id is reused meanwhile
        self.read: dict[int, torch.Tensor] = {}
        self.swap = swap
        self.elementwise = True
        self.sources: dict[int, frozenset[str]] = {}  # what each tensor was computed from
        self.plus_score: set[int] = set()  # tensors that are the score plus a term
        self.arguments: dict[int, str] = {}

    def name(self, **arguments: torch.Tensor) -> None:
        """Follow these arguments through the ops (see the class docstring)."""
        for label, t in arguments.items():
            self.sources[id(t)] = frozenset(label)
            self.arguments[id(t)] = label
        if "s" in arguments:
            self.plus_score.add(id(arguments["s"]))

    def relative(self, out: torch.Tensor) -> bool:
        """Whether ``out`` is the score plus a term of (b, h, q_idx - kv_idx) only, made of
        elementwise ops (so a tile adds a Toeplitz matrix: `attngrad.core.toeplitz`)."""
        return (
            self.elementwise
            and id(out) in self.plus_score
            and self.sources.get(id(out), frozenset()) <= _RELATIVE
        )

    def _follow(
        self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[frozenset[str], bool]:
        """(what an op's result was computed from, whether it is the score plus a term)."""
        sources = frozenset().union(*(self._sources(t) for t in _tensors((args, kwargs))))
        if len(args) != 2 or name not in _ADD | _SUBTRACT:
            return sources, False
        first, second = args
        if name in _SUBTRACT and {self._argument(first), self._argument(second)} == {"i", "j"}:
            return frozenset("d"), False
        pairs = [(first, second)]
        if name in _ADD and "alpha" not in kwargs:
            pairs.append((second, first))
        plus = any(
            isinstance(a, torch.Tensor) and id(a) in self.plus_score and "s" not in self._sources(x)
            for a, x in pairs
        )
        return sources, plus

    def _sources(self, t: object) -> frozenset[str]:
        return self.sources.get(id(t), frozenset()) if isinstance(t, torch.Tensor) else frozenset()

    def _argument(self, t: object) -> str | None:
        """The name of an argument the function was given, if ``t`` is one."""
        return self.arguments.get(id(t)) if isinstance(t, torch.Tensor) else None

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
        if func is torch.Tensor.__getitem__:
            captured = len(args) == 2 and id(args[0]) in self.read
            self.elementwise &= captured and _full_index(*args)
        elif func not in _PROPERTIES:
            name = getattr(func, "__name__", "")
            self.elementwise &= name in ELEMENTWISE or _scalar_constant(name, args, kwargs)
        name = getattr(func, "__name__", "")
        sources, plus = self._follow(name, args, kwargs)
        index = self._moved_index(name, args, kwargs)
        out = func(*args, **kwargs)
        made = _tensors(out)
        self.keep += made
        for t in made:
            self.made.add(id(t))
            if id(t) not in self.arguments:  # an op returning its argument leaves it as it is
                self.sources[id(t)] = sources
                (self.plus_score.add if plus else self.plus_score.discard)(id(t))
                if index is not None:
                    self.arguments[id(t)] = index
        return out

    def _moved_index(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
        """The index ("i" or "j") an op moves by a Python int, else None.

        ``q_idx + q0`` moves a local call's index to the gathered call's
        (`attngrad.ring.shifted`); the result stands for that index, so
        (q_idx + a) - (kv_idx + b) is still a distance, plus a constant."""
        if len(args) != 2 or kwargs or not (name in _ADD or name in _SUBTRACT):
            return None
        first, second = args
        if name in _ADD and isinstance(first, int):  # int + index
            first, second = second, first
        moved = self._argument(first)
        if moved in ("i", "j") and isinstance(second, int) and not isinstance(second, bool):
            return moved
        return None


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
            return torch.arange(a, b, dtype=INDEX, device=device)

        return TileIndex(
            span(0, folded) % batch, span(0, heads), span(rows.start, rows.stop),
            span(cols.start, cols.stop),
        )  # fmt: skip


def check_arity(fn: object, name: str, count: int, example: str) -> None:
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


def broadcast_tile(
    point: Callable[..., Any], s: torch.Tensor, index: TileIndex, extra: Sequence[torch.Tensor] = ()
) -> Any:
    """``point`` called once on the whole tile s: [B, H, r, c] with the indices shaped to
    broadcast against it, [B, 1, 1, 1], [1, H, 1, 1], [1, 1, r, 1], [1, 1, 1, c]: what
    `over_tile` gives for an elementwise function (`Reads.elementwise`)."""
    return point(s, *broadcast_axes(index), *extra)


def broadcast_axes(index: TileIndex) -> tuple[torch.Tensor, ...]:
    """b, h, q_idx, kv_idx of a tile [B, H, r, c] shaped to broadcast against it."""
    b, h, i, j = index.b, index.h, index.i, index.j
    return b.view(-1, 1, 1, 1), h.view(1, -1, 1, 1), i.view(1, 1, -1, 1), j.view(1, 1, 1, -1)


def over_tile(
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


def explain(err: RuntimeError, name: str) -> Exception:
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
