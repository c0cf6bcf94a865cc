"""The derivative Functions' flat tensor arguments, named once.

An ``autograd.Function`` takes its tensors as one flat argument list: autograd
routes a gradient to an input by its position, and vmap folds each tensor by
its position.  Each Function of `attngrad.autograd` states its list once, as
a `Layout` of named fields, and reads and writes its arguments by name
(`Args`); which positions vmap treats as masks and which as a score
function's captured tensors follows from the names (`roles`).

    field        tensors            what
    a_q a_k a_v  1 each             a direction like q, k, v (tangents or cotangents)
    a_bias       1                  the direction's part like the bias
    a_captured   plan.n_captured    its part like the score function's captured tensors
    dout dlse    1 each             the cotangents of O [B, Hq, Nq, dv] and lse [B, Hq, Nq]
    q k v        1 each             [B, Hq, Nq, d], [B, Hkv, Nk, d], [B, Hkv, Nk, dv]
    bias keep    1 each             the mask's tensors [Bm, Hm, Nqm, Nkm] (or None)
    o            1                  forward's O (or None where the strategy does not keep it)
    saved        len(plan.names)    the strategy's saved tensors, ``plan.names`` order
    captured     plan.n_captured    the score function's captured tensors

A Function's outputs are a `Layout` too, each output named by the input it is
the gradient of (or, for forward mode, by what it is the tangent of).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from attngrad.core.interface import Plan, Problem, Saved

__all__ = ["Args", "Layout", "roles"]

Tensor = torch.Tensor | None
Group = tuple[torch.Tensor | None, ...]

_GROUPS = frozenset({"a_captured", "saved", "captured"})
# per-sample mask tensors [Bm, ...] (Bm = 1 or B) and the captured tensors shared by the
# whole call: vmap folds the first and never the second (`attngrad.autograd.batching`)
_MASKS = frozenset({"a_bias", "bias", "keep"})
_SHARED = frozenset({"a_captured", "captured"})


@dataclass(frozen=True, eq=False)  # holds tensors: compared by identity
class Args:
    """A Function's tensor arguments by name (the fields of the module docstring); a field
    its layout lacks stays None, or () for a group."""

    a_q: Tensor = None
    a_k: Tensor = None
    a_v: Tensor = None
    a_bias: Tensor = None
    a_captured: Group = ()
    dout: Tensor = None
    dlse: Tensor = None
    q: Tensor = None
    k: Tensor = None
    v: Tensor = None
    bias: Tensor = None
    keep: Tensor = None
    o: Tensor = None
    saved: Group = ()
    captured: Group = ()

    @property
    def direction(self) -> Group:
        """(a_q, a_k, a_v, a_bias, *a_captured)."""
        return (self.a_q, self.a_k, self.a_v, self.a_bias, *self.a_captured)

    def problem(self, plan: Plan[Any]) -> Problem[Any]:
        """The plan's problem over these q, k, v, bias, keep and captured tensors."""
        assert self.q is not None and self.k is not None and self.v is not None
        return plan.problem(self.q, self.k, self.v, self.bias, self.keep, _tensors(self.captured))

    def saved_map(self, plan: Plan[Any]) -> Saved:
        """The strategy's ``saved`` mapping: the saved tensors by name, O as "o" when kept."""
        return plan.saved(self.o, _tensors(self.saved))


def _tensors(group: Group) -> tuple[torch.Tensor, ...]:
    assert all(t is not None for t in group)
    return group  # type: ignore[return-value]


@dataclass(frozen=True)
class Layout:
    """An ordered list of `Args` field names: a Function's flat tensors."""

    names: tuple[str, ...]

    def sizes(self, plan: Plan[Any]) -> tuple[int, ...]:
        """How many tensors each field holds for ``plan``'s call."""
        count = {"saved": len(plan.names), "captured": plan.n_captured}
        return tuple(count.get(n.removeprefix("a_"), 1) if n in _GROUPS else 1 for n in self.names)

    def slices(self, plan: Plan[Any]) -> dict[str, slice]:
        """Each field's positions in the flat list."""
        out, at = {}, 0
        for name, size in zip(self.names, self.sizes(plan), strict=True):
            out[name] = slice(at, at + size)
            at += size
        return out

    def positions(self, plan: Plan[Any], names: frozenset[str]) -> tuple[int, ...]:
        """The flat positions of the fields ``names``, in order."""
        return tuple(
            i
            for name, s in self.slices(plan).items()
            if name in names
            for i in range(s.start, s.stop)
        )

    def split(self, plan: Plan[Any], flat: tuple[Any, ...]) -> Args:
        """The flat list by name."""
        spans = self.slices(plan)
        assert len(flat) == sum(s.stop - s.start for s in spans.values()), (self.names, len(flat))
        parts: dict[str, Any] = {
            n: tuple(flat[s]) if n in _GROUPS else flat[s.start] for n, s in spans.items()
        }
        return Args(**parts)

    def join(self, plan: Plan[Any], args: Args) -> tuple[Any, ...]:
        """The flat list of ``args``' fields; a group left () is None for each of its tensors."""
        out: list[Any] = []
        for name, size in zip(self.names, self.sizes(plan), strict=True):
            value = getattr(args, name)
            if name not in _GROUPS:
                out.append(value)
            else:
                assert len(value) in (0, size), (name, len(value), size)
                out.extend(value or (None,) * size)
        return tuple(out)

    def pick(self, plan: Plan[Any], flat: tuple[Any, ...], fields_of: Layout) -> tuple[Any, ...]:
        """The entries of ``flat`` (laid out as this) at the fields of ``fields_of``, in its order."""
        spans = self.slices(plan)
        return tuple(x for n in fields_of.names for x in flat[spans[n]])


def roles(
    inputs: Layout, outputs: Layout, plan: Plan[Any]
) -> tuple[tuple[int, ...], tuple[int, ...], dict[int, int]]:
    """(masks, captured, mask outputs) of a Function for vmap (`attngrad.autograd.batching`):
    the positions of its mask tensors and of the captured tensors among its inputs, and
    output position -> the mask input it is the gradient of."""
    at = inputs.slices(plan)
    mask_outputs = {
        out.start: at[name].start
        for name, out in outputs.slices(plan).items()
        if name in _MASKS and name in at
    }
    return inputs.positions(plan, _MASKS), inputs.positions(plan, _SHARED), mask_outputs
