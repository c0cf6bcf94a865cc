"""Strategy "explicit": forward saves q, k, v and the whole probability matrix P.

Backward is the four local ops of `attngrad.ops` on the saved P:
dV = P^T dO, dP = dO v^T, dS = P * (dP - rowsum(P * dP)), dq/dk = scale * dS k / dS^T q.
Saved bytes: b * (B*Hq*Nq*d + B*Hkv*Nk*(d + dv)) + b * B*Hq*Nq*Nk.

Both passes walk P in chunks of query rows: a chunk of S, dP and dS stays in
cache between the matmuls that make and use it, so the matmuls run at their
cache-resident rate instead of streaming [Nq, Nk] matrices through memory.
P itself is written once and read once.  A chunk spans only the keys its
causal/window band allows; the rest of P is zero and never computed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch.autograd.function import FunctionCtx

from attngrad import ops
from attngrad.heads import group_heads, take_rows
from attngrad.masks import Mask, add_bias_gradient_, bias_meta
from attngrad.strategies.first_order import first_order_only

__all__ = [
    "ExplicitAttention",
    "attention",
    "chunks",
    "explicit_backward",
    "explicit_forward",
    "masked_scores",
    "output_and_stats",
    "row_chunks",
    "saved_probabilities",
]

# P of one chunk: (rows, cols) -> [B, Hkv, G*r, c] in the compute dtype.
ProbabilityChunks = Callable[[slice, slice], torch.Tensor]

# Bytes of one chunk of scores across all (batch, head) pairs: small enough to
# stay in this class of CPU's L2/L3 between the matmul that writes it and the
# ops that read it, large enough that each matmul has rows to work with.
CHUNK_BYTES = 8 * 2**20


def row_chunks(q: torch.Tensor, nk: int) -> Iterator[slice]:
    """Slices of query rows whose [B, Hq, rows, Nk] float32 scores fill ~CHUNK_BYTES."""
    b, hq, nq, _ = q.shape
    rows = max(16, CHUNK_BYTES // max(1, 4 * b * hq * nk))
    for r0 in range(0, nq, rows):
        yield slice(r0, min(r0 + rows, nq))


def masked_scores(
    q5: torch.Tensor, k: torch.Tensor, mask: Mask, scale: float, rows: slice, cols: slice
) -> torch.Tensor:
    """Masked scores of query rows ``rows`` against keys ``cols``, in the compute dtype.

    q5: [B, Hkv, G, Nq, d] (grouped query heads), k: [B, Hkv, Nk, d] in the
    compute dtype -> S: [B, Hkv, G, r, c].  Forward and the recompute
    backward both call this, so S is bit for bit the same in both.
    """
    b, hkv, g = q5.shape[:3]
    r, c = rows.stop - rows.start, cols.stop - cols.start
    s = ops.scores(take_rows(q5, rows).to(k.dtype), k[:, :, cols], scale)  # (B, Hkv, G*r, c)
    return mask.apply_(s.view(b, hkv, g, r, c), rows, cols)


def chunks(q: torch.Tensor, mask: Mask) -> Iterator[tuple[slice, slice]]:
    """(rows, cols): each chunk of query rows with the keys its causal/window band allows.

    Keys outside the band are never computed; their P stays zero.
    """
    for rows in row_chunks(q, mask.seq_k):
        yield rows, slice(*mask.key_span(rows))


def _forward_chunks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Mask,
    scale: float,
    p: torch.Tensor | None,
    stats: torch.Tensor | None,
) -> torch.Tensor:
    """O: [B, Hq, Nq, dv] in the input dtype, chunk by chunk, filling ``p`` and ``stats``.

    q: [B, Hq, Nq, d], k: [B, Hkv, Nk, d], v: [B, Hkv, Nk, dv].  ``p``
    ([B, Hkv, G, Nq, Nk], zero outside the band) collects P, ``stats``
    ([B, Hkv, G, Nq, 2]) the row statistics (m, log l); None skips either.
    A chunk holds whole rows (every key the band allows), so a row that
    attends nothing shows as a row of -inf scores: `ops.softmax_` gives it P = 0.
    """
    b, hq, nq, _ = q.shape
    hkv, dv = k.shape[1], v.shape[-1]
    g, dtype = hq // hkv, ops.compute_dtype(q.dtype)
    q5, k, v = group_heads(q, hkv), k.to(dtype), v.to(dtype)
    o = q.new_empty(b, hq, nq, dv)  # a base tensor, not a view: callers may edit it in place
    o5 = group_heads(o, hkv)
    for rows, cols in chunks(q, mask):
        s = masked_scores(q5, k, mask, scale, rows, cols)  # (B, Hkv, G, r, c)
        p_c, stats_c = ops.softmax_(s)
        if stats is not None:
            stats[:, :, :, rows] = stats_c
        if p is not None:
            p[:, :, :, rows, cols] = p_c
        o_c = ops.attend(p_c.flatten(2, 3), v[:, :, cols])  # (B, Hkv, G*r, dv)
        o5[:, :, :, rows] = o_c.view(b, hkv, g, rows.stop - rows.start, dv)
    return o


def explicit_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """O: [B, Hq, Nq, dv] and the whole P: [B, Hq, Nq, Nk], both in the input dtype.

    q: [B, Hq, Nq, d], k: [B, Hkv, Nk, d], v: [B, Hkv, Nk, dv].
    """
    b, hq, nq, _ = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    g = hq // hkv
    p = q.new_zeros(b, hkv, g, nq, nk) if mask.banded else q.new_empty(b, hkv, g, nq, nk)
    o = _forward_chunks(q, k, v, mask, scale, p, stats=None)
    return o, p.view(b, hq, nq, nk)


def output_and_stats(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """O: [B, Hq, Nq, dv] (input dtype) and stats: [B, Hq, Nq, 2] (m, log l; compute dtype).

    Each chunk of P is dropped once O has used it: the whole P never exists.
    """
    b, hq, nq, _ = q.shape
    hkv = k.shape[1]
    dtype = ops.compute_dtype(q.dtype)
    stats = torch.empty(b, hkv, hq // hkv, nq, 2, dtype=dtype, device=q.device)
    o = _forward_chunks(q, k, v, mask, scale, None, stats)
    return o, stats.view(b, hq, nq, 2)


def saved_probabilities(p: torch.Tensor, heads_kv: int) -> ProbabilityChunks:
    """Chunks of a saved P: [B, Hq, Nq, Nk], for `explicit_backward` (read, never written)."""
    p5 = group_heads(p, heads_kv)
    dtype = ops.compute_dtype(p.dtype)
    return lambda rows, cols: take_rows(p5[..., cols], rows).to(dtype)


def explicit_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    p_chunk: ProbabilityChunks,
    mask: Mask,
    scale: float,
    needs: tuple[bool, ...],
    bias_meta: tuple[torch.Size, torch.dtype] | None = None,
) -> tuple[torch.Tensor | None, ...]:
    """(dq, dk, dv, dbias) from dout: [B, Hq, Nq, dv], chunk by chunk of P.

    ``p_chunk(rows, cols)`` gives P's chunk as [B, Hkv, G*r, c] in the
    compute dtype: read from the saved P (`saved_probabilities`) or rebuilt
    from lse (recompute); it is read, never written.  Only the band of
    ``mask`` is used (to skip keys P is zero for).
    ``needs`` says which of (dq, dk, dv) to compute; the others are None.
    dbias is computed when ``bias_meta`` = (shape, dtype) of the bias is given.
    Gradients come back in their inputs' dtypes.
    """
    b, hq, nq, d = q.shape
    hkv, nk, dv_dim = k.shape[1], k.shape[2], v.shape[-1]
    g, dtype = hq // hkv, ops.compute_dtype(q.dtype)
    need_dq, need_dk, need_dv = needs[:3]
    need_ds = need_dq or need_dk or bias_meta is not None
    q5, do5 = group_heads(q, hkv), group_heads(dout, hkv)
    k, v = k.to(dtype), v.to(dtype)
    dq = torch.empty(b, hkv, g, nq, d, dtype=dtype, device=q.device) if need_dq else None
    dk = torch.zeros(b, hkv, nk, d, dtype=dtype, device=q.device) if need_dk else None
    dv = torch.zeros(b, hkv, nk, dv_dim, dtype=dtype, device=q.device) if need_dv else None
    dbias = None
    if bias_meta is not None:
        dbias = torch.zeros(bias_meta[0], dtype=dtype, device=q.device)
    for rows, cols in chunks(q, mask):
        r, c = rows.stop - rows.start, cols.stop - cols.start
        p_c = p_chunk(rows, cols)  # (B, Hkv, G*r, c)
        do_c = take_rows(do5, rows).to(dtype)  # (B, Hkv, G*r, dv)
        if dv is not None:
            dv[:, :, cols] += ops.value_gradient(p_c, do_c)
        if not need_ds:
            continue
        ds = ops.softmax_backward_(p_c, ops.probability_gradient(do_c, v[:, :, cols]))
        if dbias is not None:
            add_bias_gradient_(dbias, ds.view(b, hkv, g, r, c), rows, cols)
        if need_dq or need_dk:
            q_c = take_rows(q5, rows).to(dtype)
            dq_c, dk_c = ops.query_key_gradients(ds, q_c, k[:, :, cols], scale)
            if dq is not None:
                dq[:, :, :, rows] = dq_c.view(b, hkv, g, r, d)
            if dk is not None:
                dk[:, :, cols] += dk_c
    grads = (
        None if dq is None else dq.view(b, hq, nq, d).to(q.dtype),
        None if dk is None else dk.to(q.dtype),
        None if dv is None else dv.to(q.dtype),
    )
    bias_grad = None if dbias is None or bias_meta is None else dbias.to(bias_meta[1])
    return (*grads, bias_grad)


class ExplicitAttention(torch.autograd.Function):
    """autograd.Function over q: [B, Hq, Nq, d], k: [B, Hkv, Nk, d], v: [B, Hkv, Nk, dv].

    ``bias`` and ``keep`` are ``mask.tensors`` passed as arguments so that
    autograd routes the bias gradient ([Bm, Hm, Nqm, Nkm], like the bias).
    """

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        bias: torch.Tensor | None,
        keep: torch.Tensor | None,
        mask: Mask,
        scale: float,
    ) -> torch.Tensor:
        o, p = explicit_forward(q, k, v, mask.with_tensors(bias, keep), scale)
        ctx.save_for_backward(q, k, v, p)
        ctx.band = mask.with_tensors(None, None)
        ctx.scale = scale
        ctx.bias_meta = bias_meta(bias)
        return o

    @staticmethod
    @first_order_only("explicit")
    def backward(ctx: FunctionCtx, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, p = ctx.saved_tensors
        meta = ctx.bias_meta if ctx.needs_input_grad[3] else None
        p_chunk = saved_probabilities(p, k.shape[1])
        grads = explicit_backward(
            dout, q, k, v, p_chunk, ctx.band, ctx.scale, ctx.needs_input_grad, meta
        )
        return (*grads, None, None, None)


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask, scale: float
) -> torch.Tensor:
    """O: [B, Hq, Nq, dv] for q: [B, Hq, Nq, d], k: [B, Hkv, Nk, d], v: [B, Hkv, Nk, dv]."""
    return ExplicitAttention.apply(q, k, v, *mask.tensors, mask, scale)
