"""Strategy "fused": flash's tiles as C++ CPU kernels, every step of a tile while it is in cache.

Same algorithm and saved tensors as "flash" (q, k, v, O and the row
statistics (m, log l), plus the caller's mask): forward is one kernel by blocks
of query rows, backward one by slabs of key blocks (dK and dV written whole, dQ
summed per slab), each tile's mask, max, exp, row sums, dropout and dS computed
between that tile's products instead of one memory pass per tensor op
(``csrc/fused.cpp``).  16-bit inputs
are computed in float32; float32 and float64 as they come.  The dropout mask
is the hash of `attngrad.core.dropout`, bit for bit; a float mask that
requires grad gets its gradient through dS written at the scores' shape
[B, Hq, Nq, Nk] and summed over the dims the mask broadcasts (that one
gradient costs O(Nq * Nk) memory).  Double backward and forward mode run
through the shared tiled passes (`attngrad.autograd`), on P rebuilt from the
saved statistics.

The kernels are compiled once per torch version and CPU
(`attngrad.strategies.fused.build`); where they cannot be, the strategy says
what to install, and "auto" picks flash instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attngrad.core.contract import ArgumentError, Shapes
from attngrad.core.ops import compute_dtype
from attngrad.core.scores import ScoreMods
from attngrad.strategies.base import AttentionFunction, Grads
from attngrad.strategies.common import add_kernel_gradients, declare, rebuilt_probabilities
from attngrad.strategies.fused import build

__all__ = [
    "KEEPS_MASK",
    "TILED",
    "Function",
    "FusedAttention",
    "Tiles",
    "backward_into",
    "forward",
    "probabilities",
    "saves",
    "tiles",
    "unavailable_reason",
]

KEEPS_MASK = True  # backward masks each rebuilt tile again
TILED = True  # takes block sizes (block_q, block_k)
probabilities = rebuilt_probabilities  # P from the saved stats: forward mode, second order

# Tile sizes: of 64x128, 64x256, 128x128 and 128x256, timed side by side (B=1, H=8, N=4096,
# d=64, float32, forward+backward, with and without is_causal), 128x256 and 64x256 led,
# within this machine's noise of each other.
BLOCK_Q = 128
BLOCK_K = 256


@dataclass(frozen=True)
class Tiles:
    """Rows of queries and keys per tile, as the kernels take them."""

    block_q: int
    block_k: int


def saves(shapes: Shapes) -> dict[str, tuple[tuple[int, ...], str]]:
    """O: [B, Hq, Nq, dv] in the input dtype, stats: [B, Hq, Nq, 2] in the compute dtype."""
    return declare(shapes, "o", "stats")


def unavailable_reason(device: torch.device) -> str | None:
    """Why strategy "fused" cannot run on ``device`` tensors here, or None when it can."""
    if device.type != "cpu":
        return (
            f"strategy='fused' runs on CPU tensors, got {device.type} tensors; "
            "on a CUDA GPU pick strategy='triton' (or 'flash')."
        )
    return build.unavailable_reason()


def tiles(shapes: Shapes, dtype: torch.dtype, block_q: int | None, block_k: int | None) -> Tiles:
    """The given block sizes or BLOCK_Q x BLOCK_K (B=1, H=8, N=4096, d=64, float32 measured),
    never beyond Nq and Nk (a tile's scratch is block_q x block_k per thread).

    ArgumentError for a block size below 1.
    """
    for name, size in (("block_q", block_q), ("block_k", block_k)):
        if size is not None and size < 1:
            raise ArgumentError(f"{name}={size}: tiles need at least one row, e.g. 64 or 128.")
    bq = min(block_q or BLOCK_Q, max(1, shapes.seq_q))
    return Tiles(bq, min(block_k or BLOCK_K, max(1, shapes.seq_k)))


def _operands(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Dense tensors in the compute dtype (16-bit inputs upcast; float32/float64 as they are)."""
    return [t.to(compute_dtype(t.dtype)).contiguous() for t in tensors]


def _mask_args(
    mask: ScoreMods, shape: tuple[int, int, int, int], dtype: torch.dtype
) -> list[object]:
    """The ops' mask arguments: bias, keep (broadcast views at the scores' [B, Hq, Nq, Nk]),
    the band's lo and hi, dropout's row and column words, the softcap (0: none), the
    threshold and 1 / (1 - p)."""
    bias = None if mask.bias is None else mask.bias.to(dtype).expand(shape)
    keep = None if mask.keep is None else mask.keep.expand(shape)
    band = mask.band
    lo, hi = (None, None) if band is None else (band.lo.cpu(), band.hi.cpu())
    dropout = mask.dropout
    words: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
    if dropout is not None:
        words = dropout.words(
            shape[0], shape[1], mask.heads_kv, shape[2], shape[3], torch.device("cpu")
        )
    cap = 0.0 if mask.softcap is None else float(mask.softcap)
    threshold = 0 if dropout is None else dropout.threshold
    keep_scale = 1.0 if dropout is None else dropout.scale
    return [bias, keep, lo, hi, *words, cap, threshold, keep_scale]


def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: ScoreMods,
    scale: float,
    tiles: Tiles,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """O: [B, Hq, Nq, dv] (input dtype) and {"o": O, "stats": [B, Hq, Nq, 2]} (compute dtype).

    q: [B, Hq, Nq, d], k: [B, Hkv, Nk, d], v: [B, Hkv, Nk, dv].
    """
    library = build.load()
    qc, kc, vc = _operands(q, k, v)
    shape = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    args = _mask_args(mask, shape, qc.dtype)
    o, stats = torch.ops.attngrad_fused.forward(
        qc, kc, vc, *args[:6], scale, *args[6:], tiles.block_q, tiles.block_k, library.engine_id
    )
    o = o.to(q.dtype)
    return o, {"o": o, "stats": stats}


def backward_into(
    grads: Grads,
    dout: torch.Tensor,
    dlse: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    saved: dict[str, torch.Tensor],
    mask: ScoreMods,
    scale: float,
    tiles: Tiles,
) -> None:
    """The backward kernel from dout: [B, Hq, Nq, dv], its dq, dk, dv (and dS for a bias
    gradient) added into ``grads`` (`attngrad.strategies.base`).

    Delta = rowsum(dO * O) is formed here from saved["o"], which is `forward`'s O
    or, for ring attention's blocks, the final O of these rows over every key
    (with saved["stats"] likewise).
    """
    library = build.load()
    qc, kc, vc, doc = _operands(q, k, v, dout)
    stats = saved["stats"].to(qc.dtype).contiguous()
    # Delta = rowsum(dO * O), lse's cotangent joining it: dS = P * (dP - Delta + dlse)
    delta = torch.einsum("bhnd,bhnd->bhn", doc, saved["o"].to(qc.dtype))
    if dlse is not None:
        delta -= dlse.to(delta.dtype)
    shape = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    args = _mask_args(mask, shape, qc.dtype)
    dq, dk, dv, ds = torch.ops.attngrad_fused.backward(
        doc, qc, kc, vc, stats, delta.contiguous(), *args[:6], scale, *args[6:],
        tiles.block_q, tiles.block_k, library.engine_id, grads[3] is not None,
    )  # fmt: skip
    add_kernel_gradients(grads, (dq, dk, dv), ds)


class FusedAttention(AttentionFunction):
    """`AttentionFunction` of strategy "fused" (FusedAttentionBackward in the graph)."""


Function = FusedAttention
