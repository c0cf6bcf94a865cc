"""The slow, obviously right attention every strategy is judged against.

`reference_attention` (and `reference_lse`, the rows' log-sum-exp): plain
PyTorch ops differentiated by autograd, to every order.  k and v
are repeated per query head, the mask and the window are applied to a full
score matrix, and rows that attend no key get P = 0.  Run in float64 it is
the reference.

`plain_attention`: the plain computation in a dtype that the 2x rule
compares with.  `magnitudes`: the last step of each quantity on absolute
values, the numbers the error rule of `attngrad.verify` derives its floor
from.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

__all__ = ["magnitudes", "plain_attention", "reference_attention", "reference_lse"]

Window = tuple[int | None, int | None] | None


def _keep(nq: int, nk: int, is_causal: bool, window: Window, device: torch.device) -> torch.Tensor:
    """[Nq, Nk] bool: key j is inside query i's causal/window band (top-left aligned)."""
    offset = torch.arange(nk, device=device).unsqueeze(0) - torch.arange(
        nq, device=device
    ).unsqueeze(1)
    keep = torch.ones(nq, nk, dtype=torch.bool, device=device)
    left, right = window if window is not None else (None, None)
    if is_causal:
        keep &= offset <= 0
    if left is not None:
        keep &= offset >= -left
    if right is not None:
        keep &= offset <= right
    return keep


def _expand_kv(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, enable_gqa: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v repeated per query head when ``enable_gqa`` (query head h uses kv head h // G)."""
    if not enable_gqa:
        return key, value
    groups = query.shape[-3] // key.shape[-3]
    return key.repeat_interleave(groups, dim=-3), value.repeat_interleave(groups, dim=-3)


def _scale(query: torch.Tensor, scale: float | None) -> float:
    return 1 / math.sqrt(query.shape[-1]) if scale is None else scale


def _masked_scores(
    x: torch.Tensor, attn_mask: torch.Tensor | None, is_causal: bool, window: Window
) -> tuple[torch.Tensor, torch.Tensor]:
    """(S, keep): x plus a float mask, -inf where a bool mask or the band drops a key."""
    keep = _keep(x.shape[-2], x.shape[-1], is_causal, window, x.device)
    s = x
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        keep = keep & attn_mask
    elif attn_mask is not None:
        s = s + attn_mask
    keep = keep & (s != float("-inf"))
    return s.masked_fill(~keep, float("-inf")), keep


def _softmax(s: torch.Tensor) -> torch.Tensor:
    """softmax along the last dim with P = 0 on rows whose every score is -inf."""
    dead = (s == float("-inf")).all(dim=-1, keepdim=True)
    return torch.softmax(s.masked_fill(dead, 0.0), dim=-1).masked_fill(dead, 0.0)


def reference_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    window: Window = None,
) -> torch.Tensor:
    """softmax(scale * q k^T + mask) v, in the inputs' dtype.

    query: [..., Hq, Nq, d], key: [..., Hkv, Nk, d], value: [..., Hkv, Nk, dv],
    attn_mask broadcastable to [..., Hq, Nq, Nk] -> [..., Hq, Nq, dv].
    ``window=(left, right)`` keeps key j for query i when i - left <= j <= i + right.
    """
    key, value = _expand_kv(query, key, value, enable_gqa)
    s, _ = _masked_scores(
        query @ key.transpose(-2, -1) * _scale(query, scale), attn_mask, is_causal, window
    )
    return _softmax(s) @ value


def reference_lse(
    query: torch.Tensor,
    key: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    window: Window = None,
) -> torch.Tensor:
    """log-sum-exp of each row's scaled, masked scores: [..., Hq, Nq]; -inf on a dead row.

    Differentiable except on dead rows (whose gradient would be 0/0).
    """
    key, _ = _expand_kv(query, key, key, enable_gqa)
    s, _ = _masked_scores(
        query @ key.transpose(-2, -1) * _scale(query, scale), attn_mask, is_causal, window
    )
    return torch.logsumexp(s, dim=-1)


def plain_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    window: Window = None,
) -> torch.Tensor:
    """The plain PyTorch computation of the 2x rule, in the inputs' dtype.

    `reference_attention` itself for 16-bit and float32 inputs.  In float64
    the reference *is* that computation, so the plain one is PyTorch's SDPA
    under its MATH backend: float64 in another order, whose distance from the
    reference is float64's own rounding (which large logits make large).  A
    window joins the mask as a band (SDPA has none).
    """
    if query.dtype != torch.float64:
        return reference_attention(
            query, key, value, attn_mask, is_causal, scale, enable_gqa, window
        )
    if window is not None:
        band = _keep(query.shape[-2], key.shape[-2], is_causal, window, query.device)
        if attn_mask is None or attn_mask.dtype == torch.bool:
            attn_mask = band if attn_mask is None else attn_mask & band
        else:
            attn_mask = attn_mask.masked_fill(~band, float("-inf"))
        is_causal = False
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa
        )


def magnitudes(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dout: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    window: Window = None,
    unit_roundoff: float = 2.0**-53,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    r"""(A_x, C_x) for out, dq, dk, dv (and dmask for a float mask), in float64, shaped like x.

    A_x, the size of the last step that forms x, evaluated on absolute values
    (P >= 0 needs none):

        A_out = P |v|                   A_dv = P^T |dO|
        A_dP  = |dO| |v|^T              A_Dlt = rowsum(P o A_dP)
        A_dS  = P o (A_dP + A_Dlt)      (dS = P o (dP - Delta))
        A_dq  = s A_dS |k|              A_dk = s A_dS^T |q|
        A_dmask = A_dS, summed over the dims the mask broadcasts

    C_x, what the rounding of the scores does to x: a perturbation of each
    score by at most C_S = s |q| |k|^T + min(|S|, |s q k^T| / u) (the product
    and the bias add, which can lose at most what it added) moves P by at most
    C_P = P o (C_S + rowsum(P o C_S)), and so, to first order,

        C_out = C_P |v|     C_dv = C_P^T |dO|     C_dS = C_P o (|dP - Dlt| + rowsum(P o |dP|))
        C_dq = s C_dS |k|   C_dk = s C_dS^T |q|   C_dmask = C_dS, summed like the mask

    Masked entries and dead rows contribute nothing (P = 0 there).  With GQA,
    dk and dv terms are summed over each kv head's query heads like dk and dv.
    """
    s = _scale(query, scale)
    q, k, v, do = (t.double() for t in (query, key, value, dout))
    mask = attn_mask if attn_mask is None or attn_mask.dtype == torch.bool else attn_mask.double()
    ke, ve = _expand_kv(q, k, v, enable_gqa)
    x = q @ ke.transpose(-2, -1) * s
    scores, keep = _masked_scores(x, mask, is_causal, window)
    p = _softmax(scores)
    dp = do @ ve.transpose(-2, -1)
    a_dp = do.abs() @ ve.abs().transpose(-2, -1)
    a_ds = p * (a_dp + (p * a_dp).sum(-1, keepdim=True))
    c_s = s * (q.abs() @ ke.abs().transpose(-2, -1))
    if mask is not None and mask.dtype != torch.bool:
        c_s = c_s + torch.minimum(scores.abs(), x.abs() / unit_roundoff)
    c_s = c_s.masked_fill(~keep, 0.0)
    c_p = p * (c_s + (p * c_s).sum(-1, keepdim=True))
    delta = (p * dp).sum(-1, keepdim=True)
    c_ds = c_p * ((dp - delta).abs() + (p * dp.abs()).sum(-1, keepdim=True))
    parts = []
    for pp, ds in ((p, a_ds), (c_p, c_ds)):
        part = {
            "out": pp @ ve.abs(),
            "dq": s * (ds @ ke.abs()),
            "dk": s * (ds.transpose(-2, -1) @ q.abs()),
            "dv": pp.transpose(-2, -1) @ do.abs(),
        }
        if enable_gqa and q.shape[-3] != k.shape[-3]:
            groups = q.shape[-3] // k.shape[-3]
            for name in ("dk", "dv"):
                t = part[name]
                part[name] = t.reshape(*t.shape[:-3], k.shape[-3], groups, *t.shape[-2:]).sum(-3)
        if mask is not None and mask.dtype != torch.bool:
            part["dmask"] = ds.sum_to_size(mask.shape)
        parts.append(part)
    return parts[0], parts[1]
