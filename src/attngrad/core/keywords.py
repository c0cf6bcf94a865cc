"""Checks of `attngrad.attention`'s keywords beyond SDPA's.

``softcap``, ``sinks``, ``align``, ``cu_seqlens_q`` / ``cu_seqlens_k``,
``generator`` and SDPA's own ``CausalBias`` masks.  Like `attngrad.core.contract`,
each check raises ``ValueError`` or ``TypeError`` naming the argument, showing
the value and suggesting a fix; nothing here modifies a tensor.
"""

from __future__ import annotations

import itertools
import math
import numbers

import torch
from torch.nn.attention.bias import CausalBias, CausalVariant

from attngrad.core.band import ALIGNMENTS
from attngrad.core.contract import Shapes

__all__ = [
    "causal_bias_alignment",
    "validate_align",
    "validate_generator",
    "validate_segments",
    "validate_sinks",
    "validate_softcap",
]


def validate_softcap(softcap: object) -> float | None:
    """``softcap``: None, or a finite real c > 0 (scores become c * tanh(S / c))."""
    if softcap is None:
        return None
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise TypeError(
            f"softcap must be a positive float or None, got {softcap!r:.80} of type "
            f"{type(softcap).__name__}; e.g. softcap=50.0 (Gemma 2's attention cap)."
        )
    cap = float(softcap)
    if not (math.isfinite(cap) and cap > 0):
        raise ValueError(
            f"softcap must be finite and > 0, got {softcap!r}: scores become "
            "softcap * tanh(scores / softcap). Pass None for no cap."
        )
    return cap


def validate_align(align: object) -> str:
    """``align``: "top-left" (SDPA's) or "bottom-right" (FlashAttention 2's)."""
    if not isinstance(align, str) or align not in ALIGNMENTS:
        raise ValueError(
            f"align must be 'top-left' or 'bottom-right', got {align!r}. 'bottom-right' "
            "places query i at key i + Nk - Nq (decoding with a KV cache); 'top-left' at key i."
        )
    return align


def causal_bias_alignment(bias: CausalBias, shapes: Shapes, is_causal: bool, align: str) -> str:
    """The alignment an SDPA ``CausalBias`` attn_mask stands for (it means is_causal=True)."""
    if is_causal:
        raise ValueError(
            "attn_mask is a CausalBias and is_causal=True was given too; pass one of them "
            "(the CausalBias already makes the call causal)."
        )
    if (bias.seq_len_q, bias.seq_len_kv) != (shapes.seq_q, shapes.seq_k):
        raise ValueError(
            f"attn_mask is a CausalBias for seq_len_q={bias.seq_len_q}, seq_len_kv="
            f"{bias.seq_len_kv}, but query has Nq={shapes.seq_q} and key Nk={shapes.seq_k}; "
            "build it with causal_upper_left(Nq, Nk) or causal_lower_right(Nq, Nk)."
        )
    variant = "bottom-right" if bias.variant == CausalVariant.LOWER_RIGHT else "top-left"
    if align != "top-left" and align != variant:
        raise ValueError(
            f"attn_mask is a {variant} CausalBias but align={align!r}; drop align (the "
            "CausalBias sets the alignment) or pass is_causal=True with the alignment you want."
        )
    return variant


def _check_cu(
    name: str, cu: object, length: int, device: torch.device, read: bool = True
) -> tuple[int, ...]:
    """The cumulative lengths as ints; with ``read=False`` only the tensor's type, dtype,
    shape and device are checked (no host read: under torch.compile) and () returned."""
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be a 1-D integer torch.Tensor, got {type(cu).__name__}")
    if cu.ndim != 1 or cu.dtype not in (torch.int32, torch.int64) or cu.numel() < 2:
        raise ValueError(
            f"{name} must be a 1-D int32/int64 tensor [0, ..., N] of at least 2 entries, got "
            f"dtype {cu.dtype}, shape {tuple(cu.shape)}. Build it with "
            "torch.cumsum(lengths, 0) and a leading 0."
        )
    if cu.device != device:
        raise ValueError(f"{name} is on {cu.device} but query is on {device}; move it there.")
    if not read:
        return ()
    values = tuple(int(x) for x in cu.tolist())
    steps = [b - a for a, b in itertools.pairwise(values)]
    if values[0] != 0 or min(steps) < 0 or values[-1] != length:
        shown = list(values) if len(values) <= 12 else [*values[:6], "...", *values[-3:]]
        raise ValueError(
            f"{name} must start at 0, never decrease and end at the sequence length {length}, "
            f"got {shown}. It holds the cumulative segment lengths [0, n0, n0 + n1, ..., {length}]."
        )
    return values


def validate_segments(
    cu_seqlens_q: object,
    cu_seqlens_k: object,
    shapes: Shapes,
    device: torch.device,
    read: bool = True,
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """Packed segments (cu_seqlens_q, cu_seqlens_k) as tuples of ints, or None.

    ``cu_seqlens_k`` may be left out when Nq == Nk (self-attention: the same
    segments); both need the same number of segments.  ``read=False`` checks
    only what needs no host read (type, dtype, shape, device, pairing) and
    returns None: under torch.compile the values are read when the op runs.
    """
    if cu_seqlens_q is None and cu_seqlens_k is None:
        return None
    if cu_seqlens_q is None or cu_seqlens_k is None:
        given, missing = (
            ("cu_seqlens_q", "cu_seqlens_k")
            if cu_seqlens_k is None
            else ("cu_seqlens_k", "cu_seqlens_q")
        )
        if shapes.seq_q != shapes.seq_k or cu_seqlens_q is None:
            raise ValueError(
                f"{given} was given without {missing}; pass both (the same tensor when queries "
                "and keys are the same packed sequences)."
            )
        cu_seqlens_k = cu_seqlens_q
    cu_q = _check_cu("cu_seqlens_q", cu_seqlens_q, shapes.seq_q, device, read)
    cu_k = _check_cu("cu_seqlens_k", cu_seqlens_k, shapes.seq_k, device, read)
    if not read:
        return None
    if len(cu_q) != len(cu_k):
        raise ValueError(
            f"cu_seqlens_q has {len(cu_q) - 1} segments but cu_seqlens_k has {len(cu_k) - 1}; "
            "segment s of the queries attends segment s of the keys, so they must pair up."
        )
    return cu_q, cu_k


def validate_sinks(sinks: object, query: torch.Tensor, shapes: Shapes) -> torch.Tensor | None:
    """``sinks`` as a tensor broadcastable to lse's [..., Hq, Nq] (a 1-D [Hq] becomes [Hq, 1])."""
    if sinks is None:
        return None
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"sinks must be a torch.Tensor or None, got {type(sinks).__name__}")
    if sinks.dtype not in (query.dtype, torch.float32):
        raise TypeError(
            f"sinks has dtype {sinks.dtype}; it must be the query's dtype {query.dtype} (or "
            f"float32). Try sinks.to({query.dtype})."
        )
    if sinks.device != query.device:
        raise ValueError(f"sinks is on {sinks.device} but query is on {query.device}; move it.")
    target = (*shapes.lead, shapes.heads_q, shapes.seq_q)
    s = sinks.unsqueeze(-1) if sinks.ndim == 1 else sinks
    fits = s.ndim <= len(target) and all(
        a in (1, t) for a, t in zip(reversed(s.shape), reversed(target), strict=False)
    )
    if sinks.ndim == 0 or not fits:
        raise ValueError(
            f"sinks has shape {tuple(sinks.shape)}; it must be [Hq] = [{shapes.heads_q}] (one "
            f"logit per head) or broadcastable to [..., Hq, Nq] = {target} (per token)."
        )
    return s


def validate_generator(generator: object, device: torch.device) -> torch.Generator | None:
    """``generator``: None (the device's default) or a torch.Generator of the tensors' device type."""
    if generator is None:
        return None
    if not isinstance(generator, torch.Generator):
        raise TypeError(
            f"generator must be a torch.Generator or None, got {type(generator).__name__}; e.g. "
            "generator=torch.Generator().manual_seed(0)."
        )
    if generator.device.type != device.type:
        raise ValueError(
            f"generator is a {generator.device.type} generator but the tensors are on {device}; "
            f"use torch.Generator(device={str(device)!r})."
        )
    return generator
