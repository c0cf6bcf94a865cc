"""Pieces the strategies share, so that no strategy imports another.

* `declare`: the shapes of what a strategy can keep for backward beyond q, k, v
  (P, O, the row statistics); each strategy's `saves` names its own.
* `runs_anywhere`: the `unavailable_reason` of the strategies made of plain
  tensor ops.
* The chunked passes of "explicit" and "recompute" (`chunk_rows`,
  `forward_chunks`, `backward_chunks`): both walk P in chunks of query rows, so
  a chunk of S, dP and dS stays in cache between the matmuls that make and use
  it and the matmuls run at their cache-resident rate instead of streaming
  [Nq, Nk] matrices through memory.  A chunk spans only the keys its
  causal/window band allows (`chunks`); the rest of P is zero and never
  computed.  A chunk holds whole rows, so a row that attends nothing shows as
  a row of -inf scores and `attngrad.core.ops.softmax_` gives it P = 0.
* `rebuilt_probabilities`: tiles of P rebuilt from the saved statistics, for
  every strategy that does not keep P (recompute's backward; forward mode and
  second order of recompute, flash, fused and triton).
* `add_kernel_gradients`: the whole gradients a kernel wrote (fused, triton)
  added into backward's accumulators.

Over the canonical layout q: [B, Hq, Nq, d], k: [B, Hkv, Nk, d],
v: [B, Hkv, Nk, dv]; G = Hq / Hkv query heads share a key/value head.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from attngrad.core import ops
from attngrad.core.contract import Shapes
from attngrad.core.dropout import Dropout
from attngrad.core.heads import group_heads, take_rows
from attngrad.core.scores import ScoreMods, add_bias_gradient_
from attngrad.strategies.base import Grads

__all__ = [
    "CHUNK_BYTES",
    "ProbabilityChunks",
    "add_kernel_gradients",
    "backward_chunks",
    "chunk_rows",
    "chunks",
    "declare",
    "forward_chunks",
    "masked_scores",
    "rebuilt_probabilities",
    "runs_anywhere",
]

# P of one chunk: (rows, cols) -> [B, Hkv, G*r, c] in the compute dtype.
ProbabilityChunks = Callable[[slice, slice], torch.Tensor]

# Bytes of one chunk of scores across all (batch, head) pairs: small enough to
# stay in this class of CPU's L2/L3 between the matmul that writes it and the
# ops that read it, large enough that each matmul has rows to work with.
CHUNK_BYTES = 8 * 2**20


def declare(shapes: Shapes, *names: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """The declaration (`attngrad.strategies.base`) of the tensors ``names`` among:

    "p": P [B, Hq, Nq, Nk] and "o": O [B, Hq, Nq, dv], in the input dtype
    (kind "input"); "stats": (m, log l) [B, Hq, Nq, 2], in the compute dtype
    (kind "stats").
    """
    rows = (shapes.batch, shapes.heads_q, shapes.seq_q)
    known = {
        "p": ((*rows, shapes.seq_k), "input"),
        "o": ((*rows, shapes.value_dim), "input"),
        "stats": ((*rows, 2), "stats"),
    }
    return {name: known[name] for name in names}


def runs_anywhere(device: torch.device) -> str | None:
    """Plain tensor ops: they run on every device (no reason not to)."""
    return None


def chunk_rows(shapes: Shapes, dtype: torch.dtype, block_q: int | None, block_k: int | None) -> int:
    """Query rows per chunk, so that a chunk's [B, Hq, rows, Nk] float32 scores fill ~CHUNK_BYTES."""
    return max(16, CHUNK_BYTES // max(1, 4 * shapes.batch * shapes.heads_q * shapes.seq_k))


def masked_scores(
    q5: torch.Tensor, k: torch.Tensor, mask: ScoreMods, scale: float, rows: slice, cols: slice
) -> torch.Tensor:
    """Masked scores of query rows ``rows`` against keys ``cols``, in the compute dtype.

    q5: [B, Hkv, G, Nq, d] (grouped query heads), k: [B, Hkv, Nk, d] in the
    compute dtype -> S: [B, Hkv, G, r, c].  Forward and the rebuilt P
    (`rebuilt_probabilities`) both call this, so S is bit for bit the same in both.
    """
    b, hkv, g = q5.shape[:3]
    r, c = rows.stop - rows.start, cols.stop - cols.start
    s = ops.scores(take_rows(q5, rows).to(k.dtype), k[:, :, cols], scale)  # (B, Hkv, G*r, c)
    return mask.apply_(s.view(b, hkv, g, r, c), rows, cols)


def chunks(mask: ScoreMods, rows_per_chunk: int) -> Iterator[tuple[slice, slice]]:
    """(rows, cols): each chunk of query rows with the keys its causal/window band allows.

    Keys outside the band are never computed; their P stays zero.
    """
    for r0 in range(0, mask.seq_q, rows_per_chunk):
        rows = slice(r0, min(r0 + rows_per_chunk, mask.seq_q))
        yield rows, slice(*mask.key_span(rows))


def forward_chunks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: ScoreMods,
    scale: float,
    rows_per_chunk: int,
    p: torch.Tensor | None,
    stats: torch.Tensor | None,
) -> torch.Tensor:
    """O: [B, Hq, Nq, dv] in the input dtype, chunk by chunk, filling ``p`` and ``stats``.

    q: [B, Hq, Nq, d], k: [B, Hkv, Nk, d], v: [B, Hkv, Nk, dv].  ``p``
    ([B, Hkv, G, Nq, Nk], zero outside the band) collects P, ``stats``
    ([B, Hkv, G, Nq, 2]) the row statistics (m, log l); None skips either,
    and each chunk of P is dropped once O has used it.
    """
    b, hq, nq, _ = q.shape
    hkv, dv = k.shape[1], v.shape[-1]
    g, dtype = hq // hkv, ops.compute_dtype(q.dtype)
    q5, k, v = group_heads(q, hkv), k.to(dtype), v.to(dtype)
    o = q.new_empty(b, hq, nq, dv)  # a base tensor, not a view: callers may edit it in place
    o5 = group_heads(o, hkv)
    drop = None if mask.dropout is None else mask.dropout.tiles(q, k, dtype)
    for rows, cols in chunks(mask, rows_per_chunk):
        s = masked_scores(q5, k, mask, scale, rows, cols)  # (B, Hkv, G, r, c)
        p_c, stats_c = ops.softmax_(s)
        if stats is not None:
            stats[:, :, :, rows] = stats_c
        if p is not None:
            p[:, :, :, rows, cols] = p_c
        p_c = p_c.flatten(2, 3)  # (B, Hkv, G*r, c)
        if drop is not None:  # P * Z; the 1 / (1 - p) goes onto O
            Dropout.apply_(p_c, drop(rows, cols))
        o_c = ops.attend(p_c, v[:, :, cols])  # (B, Hkv, G*r, dv)
        if mask.dropout is not None:
            o_c.mul_(mask.dropout.scale)
        o5[:, :, :, rows] = o_c.view(b, hkv, g, rows.stop - rows.start, dv)
    return o


def backward_chunks(
    grads: Grads,
    dout: torch.Tensor,
    dlse: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    p_chunk: ProbabilityChunks,
    mask: ScoreMods,
    scale: float,
    rows_per_chunk: int,
) -> None:
    """Add (dq, dk, dv, dbias) from dout: [B, Hq, Nq, dv] into ``grads``, chunk by chunk of P.

    dlse: [B, Hq, Nq], lse's cotangent, or None; it adds dlse * P to dS.

    ``p_chunk(rows, cols)`` gives P's chunk as [B, Hkv, G*r, c] in the
    compute dtype: read from the saved P (explicit) or rebuilt from the row
    statistics (recompute); it is read, never written.  Of ``mask`` only the
    band (to skip keys P is zero for), the dropout (its Z regenerated chunk by
    chunk) and the softcap (whose slope is rebuilt from q k^T) are used.  A
    None accumulator is not computed.
    """
    dq, dk, dv, dbias = grads
    b, hq, _, d = q.shape
    hkv = k.shape[1]
    g, dtype = hq // hkv, ops.compute_dtype(q.dtype)
    need_ds = dq is not None or dk is not None or dbias is not None
    dropout = mask.dropout
    if dropout is not None:  # dV = (P * Z)^T dO / (1 - p), dP = (dO v^T) * Z / (1 - p)
        dout = dout.to(dtype) * dropout.scale
    q5, do5 = group_heads(q, hkv), group_heads(dout, hkv)
    dlse5 = None if dlse is None else group_heads(dlse.unsqueeze(-1), hkv)
    k, v = k.to(dtype), v.to(dtype)
    drop = None if dropout is None else dropout.tiles(q, k, dtype)
    for rows, cols in chunks(mask, rows_per_chunk):
        r, c = rows.stop - rows.start, cols.stop - cols.start
        p_c = p_chunk(rows, cols)  # (B, Hkv, G*r, c)
        do_c = take_rows(do5, rows).to(dtype)  # (B, Hkv, G*r, dv)
        bits = None if drop is None else drop(rows, cols)
        if dv is not None:
            p_v = p_c if bits is None else Dropout.dropped(p_c, bits.clone())
            dv[:, :, cols] += ops.value_gradient(p_v, do_c)
        if not need_ds:
            continue
        dp = ops.probability_gradient(do_c, v[:, :, cols])
        if bits is not None:
            Dropout.apply_(dp, bits)
        ds = ops.softmax_backward_(p_c, dp)
        if dlse5 is not None:  # lse = m + log l: d lse / dS = P
            ds.addcmul_(p_c, take_rows(dlse5, rows).to(dtype))
        if dbias is not None:
            add_bias_gradient_(dbias, ds.view(b, hkv, g, r, c), rows, cols)
        if dq is not None or dk is not None:
            q_c = take_rows(q5, rows).to(dtype)
            if mask.softcap is not None:  # through c tanh(S / c): dS * (1 - tanh^2)
                t = ops.capped_tanh(q_c, k[:, :, cols], scale, mask.softcap)
                ds.mul_(ops.cap_slope(t))
            dq_c, dk_c = ops.query_key_gradients(ds, q_c, k[:, :, cols], scale)
            if dq is not None:
                group_heads(dq, hkv)[:, :, :, rows] += dq_c.view(b, hkv, g, r, d)
            if dk is not None:
                dk[:, :, cols] += dk_c


def rebuilt_probabilities(
    q: torch.Tensor,
    k: torch.Tensor,
    saved: dict[str, torch.Tensor],
    mask: ScoreMods,
    scale: float,
) -> ProbabilityChunks:
    """Tiles of P = exp((S - m) - log l), rebuilt from saved["stats"]: [B, Hkv, G*r, c].

    S comes from the same `masked_scores` as the chunked forward, so it is bit
    for bit the S the statistics were taken from; compute dtype, fresh.
    """
    hkv = k.shape[1]
    q5, kc = group_heads(q, hkv), k.to(ops.compute_dtype(q.dtype))
    stats5 = group_heads(saved["stats"], hkv)  # (B, Hkv, G, Nq, 2)

    def p_chunk(rows: slice, cols: slice) -> torch.Tensor:
        s = masked_scores(q5, kc, mask, scale, rows, cols)  # (B, Hkv, G, r, c)
        return ops.probabilities_(s, stats5[:, :, :, rows]).flatten(2, 3)

    return p_chunk


def add_kernel_gradients(
    grads: Grads, parts: tuple[torch.Tensor, torch.Tensor, torch.Tensor], ds: torch.Tensor
) -> None:
    """Add a kernel's whole dq, dk, dv (``parts``) into the accumulators ``grads`` wanted.

    ds: dS at the scores' shape [B, Hq, Nq, Nk], summed over the dims the bias
    broadcasts into grads' dbias (read only when dbias is wanted).
    """
    if grads[3] is not None:
        grads[3].add_(ds.sum_to_size(grads[3].shape))
    for total, part in zip(grads[:3], parts, strict=True):
        if total is not None:
            total += part
