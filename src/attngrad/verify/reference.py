r"""The slow, obviously right attention every strategy is judged against.

`reference_attention` (and `reference_lse`, the rows' log-sum-exp): plain
PyTorch ops differentiated by autograd, to every order, straight from the
definition on the full score matrix::

    X = scale q k^T                       k, v repeated per query head (GQA)
    T = c tanh(X / c)                     with a softcap c, else T = X
    S = T + bias, -inf where not kept     keep: bool mask, causal/window band, segments
    P = softmax([S, sigma])[..., :Nk]     sigma: the sinks' column, dropped after
    O = (P o Z / (1 - p)) v               Z: the given dropout keep mask (0 when p = 1)

Rows that attend nothing (no key and no finite sink) get P = 0.  The band
is built from its definition (`attngrad.verify.formula.Band`) -- each
position's segment and its place inside it, query i of a segment sitting at
key i (top-left) or at key i + len_k - len_q (bottom-right) -- not from
`attngrad.core.band`, so the strategies' band is checked against an
independent one.  Run in float64 it
is the reference.

`plain_attention`: the plain computation in a dtype that the 2x rule
compares with (the "plain run" of the glossary, docs/glossary.md).  The
steps themselves live in `attngrad.verify.formula`; what rounding can do to
each result, the numbers the error rule of `attngrad.verify.rule` derives
its floor from, in `attngrad.verify.bounds`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from attngrad.verify.formula import (
    Band,
    Window,
    cap,
    dropped,
    expand_kv,
    masked_scores,
    probabilities,
    raw_scores,
    score_scale,
    sink_column,
    with_sinks,
)

__all__ = ["plain_attention", "reference_attention", "reference_lse"]


def _scores(
    query: torch.Tensor,
    key: torch.Tensor,
    attn_mask: torch.Tensor | None,
    scale: float | None,
    band: Band,
    softcap: float | None,
    scale_first: bool = False,
) -> torch.Tensor:
    """S [..., Hq, Nq, Nk]: scaled, capped, biased and masked; key already per query head."""
    t = cap(raw_scores(query, key, score_scale(query, scale), scale_first), softcap)
    return masked_scores(t, attn_mask, band)[0]


def _attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    scale: float | None,
    enable_gqa: bool,
    band: Band,
    softcap: float | None,
    sinks: torch.Tensor | None,
    dropout: tuple[torch.Tensor | None, float],
    scale_first: bool = False,
) -> torch.Tensor:
    """O of the module docstring; ``scale_first``: the raw scores as (s q) k^T (`raw_scores`)."""
    key, value = expand_kv(query, key, value, enable_gqa)
    s = _scores(query, key, attn_mask, scale, band, softcap, scale_first)
    return dropped(probabilities(s, sinks), *dropout) @ value


def reference_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    window: Window = None,
    *,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    align: str = "top-left",
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    dropout_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """softmax(cap(scale * q k^T) + mask) v with `attngrad.attention`'s options, in the inputs' dtype.

    query: [..., Hq, Nq, d], key: [..., Hkv, Nk, d], value: [..., Hkv, Nk, dv],
    attn_mask broadcastable to [..., Hq, Nq, Nk] -> [..., Hq, Nq, dv].
    ``window=(left, right)``, ``align``, ``cu_seqlens_q`` / ``cu_seqlens_k``
    (k defaults to q), ``softcap`` and ``sinks`` ([Hq] or broadcastable to
    [..., Hq, Nq]) as in `attngrad.attention`.  ``dropout_mask``: bool keep
    mask Z broadcastable to the scores; P becomes P o Z / (1 - dropout_p)
    (zeros for p = 1).  A ``dropout_p`` > 0 without a mask is a ValueError.
    """
    band = Band(is_causal, window, align, cu_seqlens_q, cu_seqlens_k)
    return _attention(
        query, key, value, attn_mask, scale, enable_gqa, band, softcap, sinks,
        (dropout_mask, dropout_p),
    )  # fmt: skip


def reference_lse(
    query: torch.Tensor,
    key: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    window: Window = None,
    *,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    align: str = "top-left",
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
) -> torch.Tensor:
    """log-sum-exp of each row's scores and its sink: [..., Hq, Nq]; -inf on a dead row.

    The options as in `reference_attention`; dropout, applied after the
    softmax, does not enter it.  Differentiable except on dead rows (whose
    gradient would be 0/0).
    """
    key, _ = expand_kv(query, key, key, enable_gqa)
    band = Band(is_causal, window, align, cu_seqlens_q, cu_seqlens_k)
    s = _scores(query, key, attn_mask, scale, band, softcap)
    return torch.logsumexp(with_sinks(s, sinks), dim=-1)


def plain_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    window: Window = None,
    *,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    align: str = "top-left",
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    dropout_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """The plain PyTorch computation of the 2x rule, in the inputs' dtype (options as the reference's).

    `reference_attention` itself for 16-bit and float32 inputs.  In float64
    the reference *is* that computation, so the plain one is float64 in
    another order, whose distance from the reference is float64's own
    rounding (which large logits make large): PyTorch's SDPA under its MATH
    backend, with a window, alignment or segments joining the mask as a
    band and sinks as one more key (zero key and value, the sink as its
    bias).  SDPA has no softcap and draws its own dropout mask, so with
    either the float64 plain run is the reference's formula with the
    scale applied to q before the product, (s q) k^T, as SDPA MATH scales
    its operands first.
    """
    band = Band(is_causal, window, align, cu_seqlens_q, cu_seqlens_k)
    if query.dtype == torch.float64 and softcap is None and dropout_mask is None:
        return _sdpa_math(query, key, value, attn_mask, scale, enable_gqa, band, sinks)
    scale_first = query.dtype == torch.float64
    return _attention(
        query, key, value, attn_mask, scale, enable_gqa, band, softcap, sinks,
        (dropout_mask, dropout_p), scale_first,
    )  # fmt: skip


def _band_into_mask(attn_mask: torch.Tensor | None, band: torch.Tensor) -> torch.Tensor:
    """The band [Nq, Nk] joined with attn_mask: a bool mask and-ed, a float one -inf outside."""
    if attn_mask is None or attn_mask.dtype == torch.bool:
        return band if attn_mask is None else attn_mask & band
    return attn_mask.masked_fill(~band, float("-inf"))


def _sink_as_key(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    sinks: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(k, v, float mask) with one more key: zero key and value whose bias is the sink.

    Its score q . 0 * scale + sigma is sigma exactly, so SDPA's softmax over
    the Nk + 1 keys is the softmax with the sink; the mask becomes
    [..., Hq, Nq, Nk + 1] (a bool one as 0 / -inf).
    """
    scores = (*query.shape[:-1], key.shape[-2])
    bias = torch.zeros(scores, dtype=query.dtype, device=query.device)
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        bias = bias.masked_fill(~attn_mask, float("-inf"))
    elif attn_mask is not None:
        bias = bias + attn_mask
    zero = key.new_zeros(*key.shape[:-2], 1, key.shape[-1])
    key = torch.cat([key, zero], dim=-2)
    value = torch.cat([value, value.new_zeros(*value.shape[:-2], 1, value.shape[-1])], dim=-2)
    return key, value, torch.cat([bias, sink_column(bias, sinks)], dim=-1)


def _sdpa_math(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    scale: float | None,
    enable_gqa: bool,
    band: Band,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """SDPA's MATH backend on the call, the band and the sinks expressed as SDPA can take them."""
    is_causal = band.is_causal
    if not band.only_causal or sinks is not None:  # SDPA's is_causal is top-left over all keys
        keep = band.keep(query.shape[-2], key.shape[-2], query.device)
        attn_mask, is_causal = _band_into_mask(attn_mask, keep), False
    if sinks is not None:
        key, value, attn_mask = _sink_as_key(query, key, value, attn_mask, sinks)
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa
        )
