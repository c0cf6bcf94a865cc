"""Input checks of `ring_attention`: on this rank's shard, then across the ring.

Like `attngrad.core.contract`: `ArgumentError`/`ArgumentTypeError` (ValueError/
TypeError, and RuntimeError as SDPA's) naming the argument, its value and a fix.  The cross-rank check is one small all_gather of what every rank
must agree on; all ranks see the same table and raise the same error.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from attngrad.core.contract import DTYPES, ArgumentError, ArgumentTypeError, Shapes
from attngrad.ring.comm import RingComm
from attngrad.ring.layout import LAYOUTS, validate_layout

__all__ = [
    "SCHEMES",
    "Settings",
    "block_mask_of",
    "check_same_shards",
    "documents_of",
    "process_group",
    "tensor_kind",
    "validate_ring",
    "validate_scheme",
]

_DTYPES = list(DTYPES.values())
SCHEMES = ("ring", "all_to_all")
_NONE = -1  # an absent window side, mask or sinks
_BOOL = 1  # a bool attn_mask; a float one is 2 + its dtype's index in _DTYPES
# requires_grad's bits, in this order ("score_mod": a tensor it captures)
_GRADS = ("q", "k", "v", "attn_mask", "sinks", "score_mod")


@dataclass(frozen=True)
class Settings:
    """What every rank must pass alike besides the shapes (`check_same_shards`).

    mask: the attn_mask as (kind, Bm, Hm, rows, keys) -- kind `_BOOL` or 2 + the
    float dtype's index -- or () without one; sinks: (kind, Bs, Hs, rows) of
    the same kinds, or (); requires_grad: which of `_GRADS` need a gradient (the
    backward collectives run only for those).  Under `attngrad.ring.flex_ring_attention`:
    score_mod: whether one is given; block_mask: `block_mask_of` the BlockMask, or ().
    documents: packed documents' `documents_of`, or ().
    """

    is_causal: bool
    layout: str
    scale: float
    dropout_p: float
    scheme: str = "ring"
    window: tuple[int | None, int | None] | None = None
    softcap: float | None = None
    mask: tuple[int, ...] = ()
    sinks: tuple[int, ...] = ()
    requires_grad: tuple[str, ...] = ()
    score_mod: bool = False
    block_mask: tuple[int, ...] = ()
    documents: tuple[int, ...] = ()


def block_mask_of(block_mask: object) -> tuple[int, ...]:
    """A BlockMask as every rank must pass it: (Bm, Hm, Nq, Nk, bq, bk, partial, full), the
    last two its counts of partial and full blocks (a cheap fingerprint of its blocks)."""
    num = block_mask.kv_num_blocks  # type: ignore[attr-defined]
    full = block_mask.full_kv_num_blocks  # type: ignore[attr-defined]
    bm, hm = num.shape[:2]
    nq, nk = (int(x) for x in block_mask.seq_lengths)  # type: ignore[attr-defined]
    bq, bk = (int(x) for x in block_mask.BLOCK_SIZE)  # type: ignore[attr-defined]
    counts = [int(num.sum()), 0 if full is None else int(full.sum())]
    return (int(bm), int(hm), nq, nk, bq, bk, *counts)


def documents_of(segments: tuple[int, ...]) -> tuple[int, ...]:
    """Packed documents' boundaries [0, ..., N] as (count, a 63-bit digest of them)."""
    digest = hashlib.blake2b(struct.pack(f"<{len(segments)}q", *segments), digest_size=8)
    return (len(segments) - 1, int.from_bytes(digest.digest(), "little") >> 1)


def _block_mask(words: list[int]) -> object:
    if words[0] == 0:
        return None
    bm, hm, nq, nk, bq, bk, partial, full = words[1:]
    return (
        f"BlockMask(B={bm}, H={hm}, {nq}x{nk}, BLOCK_SIZE=({bq}, {bk}), "
        f"{partial} partial and {full} full blocks)"
    )


def _documents(words: list[int]) -> object:
    return None if words[0] == 0 else f"{words[1]} documents (digest {words[2]:016x})"


def tensor_kind(t: torch.Tensor) -> int:
    """The kind code of a mask or sinks tensor in `Settings`."""
    return _BOOL if t.dtype == torch.bool else 2 + _DTYPES.index(t.dtype)


def _bits(x: float) -> int:
    """The float64 ``x`` as the int64 of its bits (exact, so equal floats compare equal)."""
    (bits,) = struct.unpack("<q", struct.pack("<d", x))
    return int(bits)


def _float(bits: int) -> float:
    return float(struct.unpack("<d", struct.pack("<q", bits))[0])


def _side(w: int | None) -> int:
    return _NONE if w is None else w


def _tensor(words: list[int]) -> object:
    kind, *dims = words
    if kind == _NONE:
        return None
    name = "bool" if kind == _BOOL else str(_DTYPES[kind - 2]).removeprefix("torch.")
    return f"{name}{dims}"


# (field, width in int64 words, decoder) in the order `_describe` writes them
_FIELDS: tuple[tuple[str, int, Callable[[list[int]], object]], ...] = (
    *((f, 1, lambda w: w[0]) for f in ("batch", "heads_q", "heads_kv", "seq_len")),
    *((f, 1, lambda w: w[0]) for f in ("head_dim", "value_dim")),
    ("dtype", 1, lambda w: _DTYPES[w[0]]),
    ("is_causal", 1, lambda w: bool(w[0])),
    ("layout", 1, lambda w: LAYOUTS[w[0]]),
    ("scale", 1, lambda w: _float(w[0])),
    ("dropout_p", 1, lambda w: _float(w[0])),
    ("scheme", 1, lambda w: SCHEMES[w[0]]),
    ("window", 3, lambda w: None if w[0] == 0 else tuple(None if x == _NONE else x for x in w[1:])),
    ("softcap", 2, lambda w: None if w[0] == 0 else _float(w[1])),
    ("attn_mask", 5, _tensor),
    ("sinks", 4, _tensor),
    ("requires_grad", 1, lambda w: [g for i, g in enumerate(_GRADS) if w[0] >> i & 1]),
    ("score_mod", 1, lambda w: "given" if w[0] else None),
    ("block_mask", 9, _block_mask),
    ("cu_seqlens", 3, _documents),
)


def process_group(group: object) -> dist.ProcessGroup | None:
    """``group`` (None: the default one), or None when there is nothing to shard over: no
    initialised process group, or a group of one rank; TypeError for a non-group."""
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise ArgumentTypeError(
            f"group must be a torch.distributed.ProcessGroup or None (the default group), "
            f"got {type(group).__name__}; make one with dist.new_group(ranks)."
        )
    if not (dist.is_available() and dist.is_initialized()):
        return None
    group = group if group is not None else dist.group.WORLD
    return group if group is not None and dist.get_world_size(group) > 1 else None


def validate_scheme(scheme: object) -> str:
    """The scheme's name, or ValueError naming the choices."""
    if not isinstance(scheme, str) or scheme not in SCHEMES:
        raise ArgumentError(
            f"scheme must be one of {', '.join(map(repr, SCHEMES))}, got {scheme!r:.80}. "
            "'ring' moves k/v blocks around the ranks; 'all_to_all' trades sequence shards "
            "for head shards (H/P heads per rank, every keyword and derivative)."
        )
    return scheme


def validate_ring(
    shapes: Shapes,
    layout: object,
    timeout: object,
    strategy: object,
    kernels: tuple[str, ...],
    role: str = "per-block compute",
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
            f"{role}, got {strategy!r}."
        )


def _describe(shapes: Shapes, dtype: torch.dtype, st: Settings) -> list[int]:
    """What every rank must agree on, as int64 words in the order of _FIELDS."""
    window = [0, 0, 0] if st.window is None else [1, *map(_side, st.window)]
    softcap = [0, 0] if st.softcap is None else [1, _bits(st.softcap)]
    grads = sum(1 << i for i, g in enumerate(_GRADS) if g in st.requires_grad)
    return [
        *(shapes.batch, shapes.heads_q, shapes.heads_kv, shapes.seq_q),
        *(shapes.head_dim, shapes.value_dim, _DTYPES.index(dtype)),
        *(int(st.is_causal), LAYOUTS.index(st.layout), _bits(st.scale), _bits(st.dropout_p)),
        *(SCHEMES.index(st.scheme), *window, *softcap),
        *(st.mask or (_NONE, 0, 0, 0, 0)),
        *(st.sinks or (_NONE, 0, 0, 0)),
        grads,
        int(st.score_mod),
        *((1, *st.block_mask) if st.block_mask else (0,) * 9),
        *((1, *st.documents) if st.documents else (0, 0, 0)),
    ]


def check_same_shards(comm: RingComm, q: torch.Tensor, shapes: Shapes, settings: Settings) -> None:
    """ValueError unless every rank's shard (query ``q``) has the same sizes, dtype and settings.

    dropout_p must agree too: with dropout every rank takes part in one more
    collective (the seed's broadcast), and all ranks drop with one mask; so must
    the scheme and, under all_to_all, the keywords that add collectives (a mask,
    sinks, which inputs need a gradient).
    """
    words = _describe(shapes, q.dtype, settings)
    # where the backend communicates (NCCL: on the GPU)
    mine = torch.tensor(words, dtype=torch.int64, device=q.device)
    table = torch.stack(comm.all_gather(mine)).cpu().tolist()
    per_field: list[tuple[str, list[object]]] = []
    at = 0
    for field, width, decode in _FIELDS:
        values = [decode(row[at : at + width]) for row in table]
        if any(row[at : at + width] != table[0][at : at + width] for row in table):
            per_field.append((field, values))
        at += width
    if not per_field:
        return
    per_rank = "; ".join(
        f"{f}: " + ", ".join(f"rank {r} {v}" for r, v in enumerate(values))
        for f, values in per_field
    )
    if [f for f, _ in per_field] == ["seq_len"]:
        raise ArgumentError(
            f"ring_attention needs shards of equal length on every rank, got {per_rank}. "
            "Cut the sequence with attngrad.ring.shard(x, rank, world, layout), which needs "
            "N divisible by the world size (by twice it for 'zigzag')."
        )
    raise ArgumentError(
        f"ring_attention got different shards or settings on different ranks: {per_rank}. "
        "Every rank passes its shard of the same q, k, v (same batch, heads, head dims and "
        "dtype) and the same is_causal, layout, scale, dropout_p and scheme (and under "
        "scheme='all_to_all' the same window, softcap, attn_mask and sinks shapes, with "
        "gradients wanted for the same of them; under flex_ring_attention a score_mod on "
        "every rank or none, and the same BlockMask, built for the full sequence; under "
        "packed_ring_attention the same cu_seqlens)."
    )


def rows_form(x: torch.Tensor, lead: tuple[int, ...]) -> torch.Tensor:
    """x broadcastable to [*lead, H, n, c] as [Bx, Hx, nx, c], Bx = 1 or prod(lead) (a view
    when x is broadcast over all of lead or none of it)."""
    x = x.reshape((1,) * (len(lead) + 3 - x.ndim) + tuple(x.shape))
    if any(d != 1 for d in x.shape[: len(lead)]):
        x = x.expand(*lead, *x.shape[len(lead) :])
        return x.reshape(math.prod(lead), *x.shape[len(lead) :])
    return x.reshape(1, *x.shape[len(lead) :])


def shard_mask(
    attn_mask: object, q: torch.Tensor, shapes: Shapes, world: int, is_causal: bool
) -> torch.Tensor | None:
    """A rank's attn_mask -- the rows of its shard against every key, broadcastable to
    [..., Hq, N/P, N] -- as [Bm, Hm, nm, Nkm] (`rows_form`: Bm 1 or B, Hm 1 or Hq, nm 1 or
    N/P, Nkm 1 or N), or ValueError/TypeError naming the fix.  Both schemes take it so."""
    if attn_mask is None:
        return None
    if not isinstance(attn_mask, torch.Tensor):
        raise ArgumentTypeError(
            f"attn_mask must be a torch.Tensor or None, got {type(attn_mask).__name__}"
        )
    if is_causal:
        raise ArgumentError(
            "is_causal=True and an attn_mask were both given; pass one of them (window=(None, 0) "
            "combines a causal band with any mask)."
        )
    if attn_mask.dtype != torch.bool and attn_mask.dtype != q.dtype:
        raise ArgumentTypeError(
            f"attn_mask has dtype {attn_mask.dtype}; it must be bool (True = attend) or the "
            f"query's dtype {q.dtype}. Try attn_mask.to({q.dtype})."
        )
    if attn_mask.device != q.device:
        raise ArgumentError(f"attn_mask is on {attn_mask.device} but query is on {q.device}.")
    target = (*shapes.lead, shapes.heads_q, shapes.seq_q, shapes.seq_q * world)
    shape = tuple(attn_mask.shape)
    fits = len(shape) <= len(target) and all(
        m in (1, t) for m, t in zip(reversed(shape), reversed(target), strict=False)
    )
    if shapes.headless or not fits:
        raise ArgumentError(
            f"attn_mask has shape {shape}; each rank passes the rows of its shard against "
            f"every key, broadcastable to [..., Hq, N/P, N] = {target} (keys in the "
            "sequence's true order, rows as the layout cuts them: shard(mask, rank, P, "
            "layout) of the full [..., N, N] mask)."
        )
    return rows_form(attn_mask, shapes.lead)
