"""Pieces the strategies share, so that no strategy imports another.

* `declare`: the shapes of what a strategy can keep for backward beyond q, k, v
  (P, O, the row statistics); each strategy's `saves` names its own.
* `RowChunked`, the base of "explicit" and "recompute": both walk P in chunks
  of query rows (`RowChunks`, `forward_chunks`, `backward_chunks`), so a chunk
  of S, dP and dS stays in cache between the matmuls that make and use it and
  the matmuls run at their cache-resident rate instead of streaming [Nq, Nk]
  matrices through memory.  A chunk spans only the keys its causal/window
  band allows (`chunks`); the rest of P is zero and never computed.  A chunk
  holds whole rows, so a row that attends nothing shows as a row of -inf
  scores and `attngrad.core.ops.softmax_` gives it P = 0.  Backward is the
  same for both: the chunked backward on the strategy's ``probabilities``
  (the saved P, or P rebuilt from the statistics).
* `KeepsOutput`, the base of "flash", "fused" and "triton": they save O and
  the row statistics, take block sizes and mask each rebuilt tile again.
* `KernelMods`: the `ScoreMods` flattened into what a fused kernel reads
  (fused's C++ ops, triton's kernels), and `add_kernel_gradients`: the whole
  gradients such a kernel wrote, added into backward's accumulators.

Over the canonical layout q: [B, Hq, Nq, d], k: [B, Hkv, Nk, d],
v: [B, Hkv, Nk, dv]; G = Hq / Hkv query heads share a key/value head.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TypeVar

import torch

from attngrad.core import ops
from attngrad.core.contract import Shapes
from attngrad.core.dropout import Dropout
from attngrad.core.heads import group_heads, take_rows
from attngrad.core.interface import Backward, Declaration, Grads, Problem, Strategy
from attngrad.core.probabilities import ProbabilityTiles, masked_scores, rebuilt_records
from attngrad.core.score_program import program_of
from attngrad.core.scores import ScoreMods

__all__ = [
    "CHUNK_BYTES",
    "KeepsOutput",
    "KernelMods",
    "RowChunked",
    "RowChunks",
    "add_kernel_gradients",
    "backward_chunks",
    "chunks",
    "declare",
    "forward_chunks",
    "kernel_refusal",
]

# Bytes of one chunk of scores across all (batch, head) pairs: small enough to
# stay in this class of CPU's L2/L3 between the matmul that writes it and the
# ops that read it, large enough that each matmul has rows to work with.
CHUNK_BYTES = 8 * 2**20

T = TypeVar("T")


def declare(shapes: Shapes, *names: str) -> Declaration:
    """The declaration (`attngrad.core.interface.Strategy.saves`) of the tensors ``names``:

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


# -- the chunked passes of explicit and recompute ------------------------------


@dataclass(frozen=True)
class RowChunks:
    """The tiles of explicit and recompute: chunks of ``rows`` whole query rows."""

    rows: int


def chunks(mods: ScoreMods, rows_per_chunk: int) -> Iterator[tuple[slice, slice]]:
    """(rows, cols): each chunk of query rows with the keys its causal/window band allows.

    Keys outside the band are never computed; their P stays zero.
    """
    for r0 in range(0, mods.seq_q, rows_per_chunk):
        rows = slice(r0, min(r0 + rows_per_chunk, mods.seq_q))
        yield rows, slice(*mods.key_span(rows))


def forward_chunks(
    problem: Problem[RowChunks], p: torch.Tensor | None, stats: torch.Tensor | None
) -> torch.Tensor:
    """O: [B, Hq, Nq, dv] in the input dtype, chunk by chunk, filling ``p`` and ``stats``.

    ``p`` ([B, Hkv, G, Nq, Nk], zero outside the band) collects P, ``stats``
    ([B, Hkv, G, Nq, 2]) the row statistics (m, log l); None skips either,
    and each chunk of P is dropped once O has used it.
    """
    q, mods = problem.q, problem.mods
    b, hq, nq, _ = q.shape
    hkv, dv = problem.k.shape[1], problem.v.shape[-1]
    g, dtype = hq // hkv, problem.dtype
    q5, k, v = group_heads(q, hkv), problem.k.to(dtype), problem.v.to(dtype)
    o = q.new_empty(b, hq, nq, dv)  # a base tensor, not a view: callers may edit it in place
    o5 = group_heads(o, hkv)
    drop = None if mods.dropout is None else mods.dropout.tiles(q, k, dtype)
    for rows, cols in chunks(mods, problem.tiles.rows):
        s = masked_scores(q5, k, mods, problem.scale, rows, cols)  # (B, Hkv, G, r, c)
        p_c, stats_c = ops.softmax_(s)
        if stats is not None:
            stats[:, :, :, rows] = stats_c
        if p is not None:
            p[:, :, :, rows, cols] = p_c
        p_c = p_c.flatten(2, 3)  # (B, Hkv, G*r, c)
        if drop is not None:  # P * Z; the 1 / (1 - p) goes onto O
            Dropout.apply_(p_c, drop(rows, cols))
        o_c = ops.attend(p_c, v[:, :, cols])  # (B, Hkv, G*r, dv)
        if mods.dropout is not None:
            o_c.mul_(mods.dropout.scale)
        o5[:, :, :, rows] = o_c.view(b, hkv, g, rows.stop - rows.start, dv)
    return o


def backward_chunks(backward: Backward[RowChunks], p_chunk: ProbabilityTiles) -> None:
    """Add (dq, dk, dv, dbias) from backward.dout into backward.grads, chunk by chunk of P.

    dlse, lse's cotangent, adds dlse * P to dS.  ``p_chunk(rows, cols)``
    gives P's chunk as [B, Hkv, G*r, c] in the compute dtype: read from the
    saved P (explicit) or rebuilt from the row statistics (recompute); it is
    read, never written.  Of the mods only the band (to skip keys P is zero
    for), the dropout (its Z regenerated chunk by chunk) and the score
    modifications (dS carried back through them, their records rebuilt from
    q k^T) are used.  A None accumulator is not computed.
    """
    problem, dout, dlse = backward.problem, backward.dout, backward.dlse
    dq, dk, dv, dbias = backward.grads
    q, mods, scale = problem.q, problem.mods, problem.scale
    b, hq, _, d = q.shape
    hkv = problem.k.shape[1]
    g, dtype = hq // hkv, problem.dtype
    dcaptured = backward.dcaptured
    need_ds = any(t is not None for t in (dq, dk, dbias, *dcaptured))
    dtheta = mods.chain.parameters_of(dbias, dcaptured)  # the modifications' tensors' gradients
    dropout = mods.dropout
    if dropout is not None:  # dV = (P * Z)^T dO / (1 - p), dP = (dO v^T) * Z / (1 - p)
        dout = dout.to(dtype) * dropout.scale
    q5, do5 = group_heads(q, hkv), group_heads(dout, hkv)
    dlse5 = None if dlse is None else group_heads(dlse.unsqueeze(-1), hkv)
    k, v = problem.k.to(dtype), problem.v.to(dtype)
    drop = None if dropout is None else dropout.tiles(q, k, dtype)
    for rows, cols in chunks(mods, problem.tiles.rows):
        r = rows.stop - rows.start
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
        q_c = take_rows(q5, rows).to(dtype)
        records = rebuilt_records(mods, q_c, k[:, :, cols], scale, rows, cols)
        mods.chain.pullback_(ds, rows, cols, records, dtheta)  # dS' -> dS
        if dq is not None or dk is not None:
            dq_c, dk_c = ops.query_key_gradients(ds, q_c, k[:, :, cols], scale)
            if dq is not None:
                group_heads(dq, hkv)[:, :, :, rows] += dq_c.view(b, hkv, g, r, d)
            if dk is not None:
                dk[:, :, cols] += dk_c


class RowChunked(Strategy[RowChunks]):
    """explicit's and recompute's shared shape: chunks of whole query rows in both passes,
    sized so that a chunk's [B, Hq, rows, Nk] float32 scores fill ~CHUNK_BYTES, and the
    chunked backward on the strategy's ``probabilities``."""

    tiled = False  # takes no block sizes: its tiles are chunks of query rows

    def tiles(
        self, shapes: Shapes, dtype: torch.dtype, block_q: int | None, block_k: int | None
    ) -> RowChunks:
        per_row = 4 * shapes.batch * shapes.heads_q * shapes.seq_k
        return RowChunks(max(16, CHUNK_BYTES // max(1, per_row)))

    def backward_into(self, backward: Backward[RowChunks]) -> None:
        backward_chunks(backward, self.probabilities(backward.problem, backward.saved))


class KeepsOutput(Strategy[T]):
    """flash's, fused's and triton's shared shape: forward saves O and the row statistics
    (P is rebuilt from them), the tiles are blocks of the score matrix, and backward
    masks each rebuilt tile again."""

    keeps_mods = True
    tiled = True

    def saves(self, shapes: Shapes) -> Declaration:
        """O: [B, Hq, Nq, dv] in the input dtype, stats: [B, Hq, Nq, 2] in the compute dtype."""
        return declare(shapes, "o", "stats")


# -- what the fused kernels read -------------------------------------------------


def kernel_refusal(
    name: str, mods: ScoreMods, reads_blocks: bool, runs_programs: bool = False
) -> str | None:
    """Why a fused-kernel strategy cannot run these mods, or None: it reads a BlockMask
    only when ``reads_blocks`` (as a band and a keep mask,
    `attngrad.core.block_table.BlockTable.rows_of_keys`), and a score function only when
    ``runs_programs`` and the function compiles to a program
    (`attngrad.core.score_program`; the reason names the op it lacks)."""
    if mods.score is not None and not runs_programs:
        what = "call a Python score_mod"
    elif mods.score is not None:
        program = program_of(mods.score)
        if not isinstance(program, str):
            return None
        what = f"run this score_mod: {program}"
    elif mods.blocks is not None and not reads_blocks:
        what = "read a BlockMask"
    else:
        return None
    return (
        f"{name}'s kernels cannot {what}; strategy='flash', 'recompute' or 'explicit' runs "
        "every score_mod and BlockMask (strategy='auto' picks one)."
    )


@dataclass(frozen=True)
class KernelMods:
    """`ScoreMods` as a fused kernel reads them, for scores [B, Hq, Nq, Nk] on one device.

    bias, keep: broadcast views at the scores' shape (their strides say where
        each score's entry is), or None.
    lo, hi: the band's int64 [Nq] key bounds, or None.
    row_words, col_words: dropout's int32 [B*Hq, Nq] and [Nk] words at the
        call's global positions (`attngrad.core.dropout.Dropout.words`); the
        kernels finish the hash per score.  None without dropout.
    softcap: c, or None; threshold: dropout's keep threshold (0 without);
    keep_scale: 1 / (1 - p) (1 without).
    """

    bias: torch.Tensor | None
    keep: torch.Tensor | None
    lo: torch.Tensor | None
    hi: torch.Tensor | None
    row_words: torch.Tensor | None
    col_words: torch.Tensor | None
    softcap: float | None
    threshold: int
    keep_scale: float

    @staticmethod
    def of(
        mods: ScoreMods,
        shape: tuple[int, int, int, int],
        device: torch.device,
        bias_dtype: torch.dtype | None = None,
    ) -> KernelMods:
        """The kernel's view of ``mods``, the bias converted to ``bias_dtype`` (when given)
        before it is broadcast, so that no [B, Hq, Nq, Nk] copy is made."""
        bias = mods.bias
        if bias is not None:
            bias = (bias if bias_dtype is None else bias.to(bias_dtype)).expand(shape)
        keep = None if mods.keep is None else mods.keep.expand(shape)
        band, dropout = mods.band, mods.dropout
        lo, hi = (None, None) if band is None else (band.lo.to(device), band.hi.to(device))
        if mods.blocks is not None:  # a BlockMask: its rows' keys as a band, else a dense keep
            assert band is None and keep is None  # flex calls carry neither
            lo, hi, dense = mods.blocks.rows_of_keys(shape[0], device)
            keep = None if dense is None else dense.expand(shape)
        if dropout is None:
            return KernelMods(bias, keep, lo, hi, None, None, mods.softcap, 0, 1.0)
        b, hq, nq, nk = shape
        rows, cols = dropout.words(b, hq, mods.heads_kv, nq, nk, device)
        return KernelMods(
            bias, keep, lo, hi, rows, cols, mods.softcap, dropout.threshold, dropout.scale
        )


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
