"""vmap for the attention Functions: a vmapped dim folds into the batch.

Attention is independent per batch entry, so under ``torch.vmap`` (and so
``torch.func.jacrev``/``jacfwd``/``hessian``, per-sample gradients and
``is_grads_batched``) a call over V samples of per-sample tensors
[B, ...] is one call over [V*B, ...]: tensors not vmapped are expanded to
every sample first (a copy).  A mask tensor [Bm, ...] (Bm = 1 or B) is
expanded to B before folding, since one shared across the batch is still
per sample under vmap; its gradient is summed back to Bm per sample.
A dropout mask stays the per-sample one: entry b of the folded batch draws
the bits of entry b mod B (`attngrad.core.dropout.Dropout.folded`), and a
FlexAttention score or mask function reads batch index b mod B.  A score
function's captured tensors are shared by every sample: when one is
vmapped, or their per-sample gradients are asked for, the samples run one
by one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch._C._functorch import is_legacy_batchedtensor

from attngrad.core.interface import Plan

__all__ = ["apply", "fold_all", "unfold", "unfold_mask_gradient", "vmap_rule"]


def _leading(t: torch.Tensor, dim: int | None, size: int) -> torch.Tensor:
    """[V, ...]: the vmapped dim moved to the front, or ``t`` expanded V times."""
    if dim is None:
        return t.unsqueeze(0).expand(size, *t.shape)
    return t.movedim(dim, 0)


def fold_all(
    args: Sequence[object],
    in_dims: Sequence[int | None],
    size: int,
    masks: Sequence[int],
    whole: Sequence[int] = (),
) -> list[object]:
    """args with each tensor folded to [V*B, ...].

    args[i] for i in ``masks`` are mask tensors [Bm, ...]; those in ``whole``
    (not vmapped) pass unchanged; every other tensor is per-sample [B, ...]
    (the first of them sets B).  Non-tensors pass.
    """
    leading = [
        _leading(a, d, size) if isinstance(a, torch.Tensor) and i not in whole else a
        for i, (a, d) in enumerate(zip(args, in_dims, strict=True))
    ]
    batch = next(
        a.shape[1]
        for i, a in enumerate(leading)
        if isinstance(a, torch.Tensor) and i not in masks and i not in whole
    )
    folded: list[object] = []
    for i, a in enumerate(leading):
        if isinstance(a, torch.Tensor) and i not in whole:
            if i in masks:
                a = a.expand(size, batch, *a.shape[2:])
            a = a.reshape(size * a.shape[1], *a.shape[2:])
        folded.append(a)
    return folded


def unfold(t: object, size: int) -> object:
    """[V*B, ...] -> [V, B, ...] (vmapped at dim 0); anything else passes."""
    if not isinstance(t, torch.Tensor):
        return t
    return t.view(size, t.shape[0] // size, *t.shape[1:])


def unfold_mask_gradient(t: torch.Tensor | None, size: int, batch_mask: int) -> object:
    """A folded mask gradient [V*B, ...] -> [V, Bm, ...], summed over B when Bm = 1."""
    if t is None:
        return None
    g = t.view(size, t.shape[0] // size, *t.shape[1:])
    return g.sum(dim=1, keepdim=True) if batch_mask == 1 and g.shape[1] != 1 else g


def _plan(args: Sequence[object]) -> Plan[Any]:
    return next(a for a in args if isinstance(a, Plan))


def vmap_rule(
    function: Any, info: Any, in_dims: Sequence[int | None], args: Sequence[object]
) -> tuple[tuple[object, ...], tuple[int | None, ...]]:
    """The vmap staticmethod of an attention Function: fold, apply once, unfold.

    ``function.roles(plan)`` gives (masks, captured, mask_outputs): the
    positions of mask tensors among ``args``, those of the score function's
    captured tensors, and output position -> the mask argument whose gradient
    it is.  Captured tensors are shared by the whole call, not per sample:
    when one is vmapped, or the Function returns their (per-sample)
    gradients, the samples run one by one instead (`_per_sample`).
    """
    size = info.batch_size
    masks, captured, mask_outputs = function.roles(_plan(args))
    if captured and (
        function.GRADIENTS_OF_CAPTURED or any(in_dims[i] is not None for i in captured)
    ):
        return _per_sample(function, size, in_dims, args)
    folded = fold_all(args, in_dims, size, masks, captured)
    batch = next(
        _leading(a, d, size).shape[1]
        for i, (a, d) in enumerate(zip(args, in_dims, strict=True))
        if isinstance(a, torch.Tensor) and i not in masks and i not in captured
    )
    folded = [_keep_batch_index(a, batch) for a in folded]
    out = function.apply(*folded)
    out = out if isinstance(out, tuple) else (out,)
    result: list[object] = []
    for i, t in enumerate(out):
        j = mask_outputs.get(i)
        if j is not None and isinstance(t, torch.Tensor):
            per_sample = _leading(args[j], in_dims[j], size)  # type: ignore[arg-type]
            result.append(unfold_mask_gradient(t, size, per_sample.shape[1]))
        else:
            result.append(unfold(t, size))
    return tuple(result), tuple(0 if isinstance(t, torch.Tensor) else None for t in result)


def _per_sample(
    function: Any, size: int, in_dims: Sequence[int | None], args: Sequence[object]
) -> tuple[tuple[object, ...], tuple[int | None, ...]]:
    """vmap as a loop: ``function`` once per sample, the outputs stacked at dim 0."""
    runs = []
    for n in range(size):
        sample = [
            a.select(d, n) if isinstance(a, torch.Tensor) and d is not None else a
            for a, d in zip(args, in_dims, strict=True)
        ]
        out = function.apply(*sample)
        runs.append(out if isinstance(out, tuple) else (out,))
    result = tuple(
        None if parts[0] is None else torch.stack(parts) for parts in zip(*runs, strict=True)
    )
    return result, tuple(None if t is None else 0 for t in result)


def _keep_batch_index(arg: object, batch: int) -> object:
    """A Plan whose dropout, score and mask functions still read the per-sample batch
    index of a ``batch``-entry call."""
    if isinstance(arg, Plan):
        mods = arg.mods
        if mods.dropout is not None or mods.score is not None or mods.blocks is not None:
            return replace(arg, mods=mods.folded(batch))
    return arg


@dataclass(frozen=True)
class _Info:
    batch_size: int


def _legacy_level() -> int:
    """The nesting level of the innermost `torch._vmap_internals` vmap now running."""
    level = torch._C._vmapmode_increment_nesting()
    torch._C._vmapmode_decrement_nesting()
    return int(level) - 1


def apply(function: Any, *args: object) -> Any:
    """``function.apply(*args)``, folding legacy vmap's batched tensors first.

    ``torch.autograd.grad(..., is_grads_batched=True)`` and gradcheck's
    batched checks run backward and jvp under the older vmap of
    ``torch._vmap_internals``, which does not call a Function's vmap
    staticmethod: the strategies' tile code would then meet batched tensors
    op by op.  Here they are unwrapped (batch dim first), folded as
    `vmap_rule` does, and the outputs wrapped back.
    """
    if not any(isinstance(a, torch.Tensor) and is_legacy_batchedtensor(a) for a in args):
        return function.apply(*args)
    level = _legacy_level()
    physical: list[object] = []
    in_dims: list[int | None] = []
    size = 1
    for a in args:
        if isinstance(a, torch.Tensor) and is_legacy_batchedtensor(a):
            a = torch._remove_batch_dim(a, level, 1, 0)  # the batched dim, at 0
            size = a.shape[0]
            in_dims.append(0)
        else:
            in_dims.append(None)
        physical.append(a)
    out, dims = vmap_rule(function, _Info(size), in_dims, physical)
    wrapped = tuple(
        t if d is None else torch._add_batch_dim(t, 0, level)  # type: ignore[arg-type]
        for t, d in zip(out, dims, strict=True)
    )
    return wrapped if len(wrapped) > 1 else wrapped[0]
