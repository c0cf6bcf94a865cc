"""Checks of `attngrad.attention`'s keywords beyond SDPA's: ``softcap``, ``sinks``, ``generator``.

Those that state the band (``window``, ``align``, ``cu_seqlens_q`` /
``cu_seqlens_k``, SDPA's ``CausalBias`` masks) are checked where the band is
built, `attngrad.core.band`.  Like `attngrad.core.contract`,
each check raises `ArgumentError` or `ArgumentTypeError` naming the argument, showing
the value and suggesting a fix; nothing here modifies a tensor.
"""

from __future__ import annotations

import math
import numbers

import torch

from attngrad.core.contract import ArgumentError, ArgumentTypeError, Shapes

__all__ = ["validate_generator", "validate_sinks", "validate_softcap"]


def validate_softcap(softcap: object) -> float | None:
    """``softcap``: None, or a finite real c > 0 (scores become c * tanh(S / c))."""
    if softcap is None:
        return None
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise ArgumentTypeError(
            f"softcap must be a positive float or None, got {softcap!r:.80} of type "
            f"{type(softcap).__name__}; e.g. softcap=50.0 (Gemma 2's attention cap)."
        )
    cap = float(softcap)
    if not (math.isfinite(cap) and cap > 0):
        raise ArgumentError(
            f"softcap must be finite and > 0, got {softcap!r}: scores become "
            "softcap * tanh(scores / softcap). Pass None for no cap."
        )
    return cap


def validate_sinks(sinks: object, query: torch.Tensor, shapes: Shapes) -> torch.Tensor | None:
    """``sinks`` as a tensor broadcastable to lse's [..., Hq, Nq] (a 1-D [Hq] becomes [Hq, 1]).

    With SDPA's 2-D inputs lse is [Nq], so a 1-D ``sinks`` is per token, [Nq] (or [1]).
    """
    if sinks is None:
        return None
    if not isinstance(sinks, torch.Tensor):
        raise ArgumentTypeError(f"sinks must be a torch.Tensor or None, got {type(sinks).__name__}")
    if sinks.dtype not in (query.dtype, torch.float32):
        raise ArgumentTypeError(
            f"sinks has dtype {sinks.dtype}; it must be the query's dtype {query.dtype} (or "
            f"float32). Try sinks.to({query.dtype})."
        )
    if sinks.device != query.device:
        raise ArgumentError(f"sinks is on {sinks.device} but query is on {query.device}; move it.")
    target = (*shapes.lead, shapes.heads_q, shapes.seq_q)
    s = sinks.unsqueeze(-1) if sinks.ndim == 1 and not shapes.headless else sinks
    fits = s.ndim <= len(target) and all(
        a in (1, t) for a, t in zip(reversed(s.shape), reversed(target), strict=False)
    )
    if sinks.ndim == 0 or not fits:
        if shapes.headless:
            raise ArgumentError(
                f"sinks has shape {tuple(sinks.shape)}; with 2-D inputs it must be [Nq] = "
                f"[{shapes.seq_q}] (one logit per query) or [1] (one for all)."
            )
        raise ArgumentError(
            f"sinks has shape {tuple(sinks.shape)}; it must be [Hq] = [{shapes.heads_q}] (one "
            f"logit per head) or broadcastable to [..., Hq, Nq] = {target} (per token)."
        )
    return s


def validate_generator(generator: object, device: torch.device) -> torch.Generator | None:
    """``generator``: None (the device's default) or a torch.Generator of the tensors' device type."""
    if generator is None:
        return None
    if not isinstance(generator, torch.Generator):
        raise ArgumentTypeError(
            f"generator must be a torch.Generator or None, got {type(generator).__name__}; e.g. "
            "generator=torch.Generator().manual_seed(0)."
        )
    if generator.device.type != device.type:
        raise ArgumentError(
            f"generator is a {generator.device.type} generator but the tensors are on {device}; "
            f"use torch.Generator(device={str(device)!r})."
        )
    return generator
