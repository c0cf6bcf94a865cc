"""Input checks of `ring_attention`: on this rank's shard, then across the ring.

Like `attngrad.core.contract`: `ArgumentError`/`ArgumentTypeError` (ValueError/
TypeError, and RuntimeError as SDPA's) naming the argument, its value and a fix.  The cross-rank check is one small all_gather of what every rank
must agree on; all ranks see the same table and raise the same error.
"""

from __future__ import annotations

import math
import struct

import torch

from attngrad.core.contract import DTYPES, ArgumentError, ArgumentTypeError, Shapes
from attngrad.ring.comm import RingComm
from attngrad.ring.layout import LAYOUTS, validate_layout

__all__ = ["check_same_shards", "validate_ring"]

_DTYPES = list(DTYPES.values())
_FIELDS = (
    "batch",
    "heads_q",
    "heads_kv",
    "seq_len",
    "head_dim",
    "value_dim",
    "dtype",
    "is_causal",
    "layout",
    "scale",
    "dropout_p",
)
_FLOATS = ("scale", "dropout_p")  # sent as the int64 of their float64 bits


def validate_ring(
    shapes: Shapes, layout: object, timeout: object, strategy: object, kernels: tuple[str, ...]
) -> None:
    """This rank's own arguments: one sequence shard, a layout that can split it, a timeout."""
    validate_layout(layout)
    if shapes.seq_q != shapes.seq_k:
        raise ArgumentError(
            f"query has {shapes.seq_q} positions but key and value have {shapes.seq_k}; "
            "ring_attention is self-attention over one sharded sequence, so q, k and v are "
            "this rank's shards of it and have one length."
        )
    if layout == "zigzag" and shapes.seq_q % 2:
        raise ArgumentError(
            f"layout='zigzag' splits each rank's shard into two equal chunks, but the shard "
            f"has odd length {shapes.seq_q}. Use a sequence length N divisible by 2 * world "
            "size, or layout='contiguous'."
        )
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise ArgumentTypeError(f"timeout must be a number of seconds, got {timeout!r:.80}.")
    if not (math.isfinite(timeout) and timeout > 0):
        raise ArgumentError(
            f"timeout must be a finite number of seconds > 0, got {timeout!r}; it bounds how "
            "long a rank waits on its ring neighbours (default 60)."
        )
    if strategy not in kernels:
        raise ArgumentError(
            f"strategy must be one of {', '.join(map(repr, kernels))} for ring_attention's "
            f"per-block compute, got {strategy!r}."
        )


def _describe(
    shapes: Shapes,
    dtype: torch.dtype,
    is_causal: bool,
    layout: str,
    scale: float,
    dropout_p: float,
    device: torch.device,
) -> torch.Tensor:
    """What every rank must agree on, as int64 in the order of _FIELDS (floats as their bits)."""
    return torch.tensor(
        [
            shapes.batch,
            shapes.heads_q,
            shapes.heads_kv,
            shapes.seq_q,
            shapes.head_dim,
            shapes.value_dim,
            _DTYPES.index(dtype),
            int(is_causal),
            LAYOUTS.index(layout),
            _bits(scale),
            _bits(dropout_p),
        ],
        dtype=torch.int64,
        device=device,  # where the backend communicates (NCCL: on the GPU)
    )


def _bits(x: float) -> int:
    """The float64 ``x`` as the int64 of its bits (exact, so equal floats compare equal)."""
    (bits,) = struct.unpack("<q", struct.pack("<d", x))
    return int(bits)


def _decode(field: str, value: int) -> object:
    if field == "dtype":
        return _DTYPES[value]
    if field == "layout":
        return LAYOUTS[value]
    if field == "is_causal":
        return bool(value)
    if field in _FLOATS:
        return struct.unpack("<d", struct.pack("<q", value))[0]
    return value


def check_same_shards(
    comm: RingComm,
    q: torch.Tensor,
    shapes: Shapes,
    is_causal: bool,
    layout: str,
    scale: float,
    dropout_p: float,
) -> None:
    """ValueError unless every rank's shard (query ``q``) has the same sizes, dtype and settings.

    dropout_p must agree too: with dropout every rank takes part in one more
    collective (the seed's broadcast), and all ranks drop with one mask.
    """
    mine = _describe(shapes, q.dtype, is_causal, layout, scale, dropout_p, q.device)
    table = torch.stack(comm.all_gather(mine)).cpu()
    differ = [f for i, f in enumerate(_FIELDS) if not bool((table[:, i] == table[0, i]).all())]
    if not differ:
        return
    per_rank = "; ".join(
        f"{f}: " + ", ".join(f"rank {r} {_decode(f, int(v))}" for r, v in enumerate(table[:, i]))
        for i, f in enumerate(_FIELDS)
        if f in differ
    )
    if differ == ["seq_len"]:
        raise ArgumentError(
            f"ring_attention needs shards of equal length on every rank, got {per_rank}. "
            "Cut the sequence with attngrad.ring.shard(x, rank, world, layout), which needs "
            "N divisible by the world size (by twice it for 'zigzag')."
        )
    raise ArgumentError(
        f"ring_attention got different shards or settings on different ranks: {per_rank}. "
        "Every rank passes its shard of the same q, k, v (same batch, heads, head dims and "
        "dtype) and the same is_causal, layout, scale and dropout_p."
    )
