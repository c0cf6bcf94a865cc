"""A `torch.nn.attention.flex_attention.BlockMask` as the tiled strategies walk it.

A BlockMask, built by torch's ``create_block_mask`` (or ``and_masks``,
``or_masks``, ``BlockMask.from_kv_blocks``), splits the scores [Nq, Nk] into
blocks of BLOCK_SIZE = (bq, bk) and lists, per (batch, head, query block),
the key blocks that are *partial* (``mask_mod`` decides each score) and
*full* (every score kept, ``mask_mod`` not called); the rest are *empty*
(every score masked).  `BlockTable` holds that as one status per block,

    status: uint8 [Bm, Hm, ceil(Nq / bq), ceil(Nk / bk)],  EMPTY 0, PARTIAL 1, FULL 2

(Bm, Hm are 1 when the mask is shared by every batch entry or head), and
answers for any tile (rows, cols) of the strategies, whose tiles need not
line up with the blocks:

* `skips`: every block the tile touches is empty for every (b, h), so the
  tile is never computed;
* `key_span`: the keys a block of rows reaches (the strategies' row chunks
  span only those);
* `keep`: the tile's bool mask [B, H, r, c] -- ``mask_mod`` on the scores
  of partial blocks, True in full blocks, False in empty ones -- or None
  when every block the tile touches is full for every (b, h);
* `rows_of_blocks`: for the fused kernels, which read a band of keys per row
  ([lo, hi) int64 [Nq]): the band alone when every row keeps one interval of
  keys, the same for every (b, h) -- causal, sliding windows, documents,
  prefix-LM (``mask_mod`` called on partial blocks only) -- else the rows'
  spans of non-empty blocks and the status, which the kernels read block by
  block, running ``mask_mod`` compiled (`attngrad.core.score_program.compile_mask`)
  on partial blocks: global tokens, dilated windows, masks that differ by head;
* `rows_of_keys`: the same band, or the spans and the whole keep
  [B, H, Nq, Nk] (O(Nq * Nk) bytes), for a ``mask_mod`` that does not compile.

torch's compiled kernel calls ``mask_mod`` on partial blocks only, and a score
function on kept blocks only: a function that reads a table valid only there
(paged attention's ``table[b, kv_idx // page]``) is valid for it.  Here a tile is
evaluated whole, as long as that works; where it raises an index error
(`out_of_bounds`), ``mask_mod`` runs again at the tile's partial blocks' scores
alone, one vmap over those points (`over_points`), as the score function does at
the kept scores (`attngrad.core.score_function`).  `is_no_mask` recognises
torch's "no mask" BlockMask (``_create_empty_block_mask``), which stands for
block_mask=None.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from attngrad.core.contract import ArgumentError, ArgumentTypeError
from attngrad.core.pointwise import (
    INDEX,
    Reads,
    TileIndex,
    broadcast_axes,
    check_arity,
    explain,
    one_thread,
    over_tile,
)

__all__ = [
    "EMPTY",
    "FULL",
    "MIXED",
    "PARTIAL",
    "BlockTable",
    "MaskFunction",
    "is_no_mask",
    "out_of_bounds",
    "over_points",
]

EMPTY, PARTIAL, FULL = 0, 1, 2

# BlockMask -> {(folded, batch, heads, device, captured versions): its rows' band or None}
_BANDS: weakref.WeakKeyDictionary[object, dict[tuple[Any, ...], Any]] = weakref.WeakKeyDictionary()
MIXED = 3  # a block whose status differs between (b, h)


def _status(
    num: torch.Tensor, indices: torch.Tensor, blocks_k: int, value: int, status: torch.Tensor
) -> None:
    """status[..., qb, j] = max(status, value) for the first num[..., qb] blocks j listed."""
    listed = torch.arange(indices.shape[-1]) < num.unsqueeze(-1)  # [Bm, Hm, QB, K]
    idx = indices.long().clamp(0, blocks_k - 1)
    src = listed.to(torch.uint8) * value  # unlisted entries add nothing under max
    status.scatter_reduce_(-1, idx, src, reduce="amax")


def _tensors(block_mask: object) -> tuple[torch.Tensor, ...]:
    """A BlockMask's block lists (its tensors that an in-place change would make stale)."""
    names = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices")
    found = (getattr(block_mask, n, None) for n in names)
    return tuple(t for t in found if isinstance(t, torch.Tensor))


def out_of_bounds(err: BaseException) -> bool:
    """Whether ``err`` is torch's index error: an index past a tensor's size (IndexError from
    ``t[idx]``, RuntimeError from ``gather``, ``index_select`` and their kin)."""
    if isinstance(err, IndexError):
        return True
    text = str(err)
    return isinstance(err, RuntimeError) and ("out of bounds" in text or "out of range" in text)


def over_points(
    point: Callable[..., torch.Tensor],
    points: Sequence[torch.Tensor],
    whole: Sequence[torch.Tensor] = (),
    elementwise: bool = False,
) -> torch.Tensor:
    """``point(*points, *whole)`` -- written for 0-d arguments -- at P scattered points: each
    of ``points`` [P] (a score and b, h, q_idx, kv_idx), ``whole`` passed whole.  One vmap
    over the points (an elementwise function: one call on the [P] tensors).  Returns [P]."""
    if elementwise:
        out = point(*points, *whole)
    else:
        dims = (0,) * len(points) + (None,) * len(whole)
        out = torch.vmap(point, in_dims=dims)(*points, *whole)
    return out.expand(points[0].shape)


def is_no_mask(block_mask: object, seq_q: int, seq_k: int) -> bool:
    """Whether ``block_mask`` keeps every score of [Nq, Nk]: torch's ``noop_mask`` over one
    block each way at least Nq x Nk, listed everywhere -- what torch's flex_attention builds
    for block_mask=None (``_create_empty_block_mask``, its seq_lengths (1, 1) whatever the
    call's)."""
    from torch.nn.attention.flex_attention import BlockMask, noop_mask

    if not isinstance(block_mask, BlockMask) or block_mask.mask_mod is not noop_mask:
        return False
    bq, bk = (int(x) for x in block_mask.BLOCK_SIZE)
    num = block_mask.kv_num_blocks
    if bq < seq_q or bk < seq_k or num.shape[-1] != 1:
        return False
    if block_mask.full_kv_num_blocks is not None:
        num = num + block_mask.full_kv_num_blocks
    return bool((num >= 1).all())


@dataclass(frozen=True, eq=False)
class MaskFunction:
    """A ``mask_mod(b, h, q_idx, kv_idx) -> bool`` over tiles: True where a score is kept.

    batch: B of the call (a folded batch entry b reads b mod batch); heads: Hq;
    elementwise: every op of it acts on each score alone (`attngrad.core.pointwise.Reads`),
    so a tile runs it once on broadcast indices instead of under vmap; captured: the
    tensors it reads that it did not make (what its compiled program reads); point: the
    (b, h, q_idx, kv_idx) it was checked at, a point where it is valid (a compiler's trace
    runs it there too).
    """

    fn: Callable[..., torch.Tensor]
    batch: int
    heads: int
    elementwise: bool = False
    captured: tuple[torch.Tensor, ...] = ()
    point: tuple[int, int, int, int] = (0, 0, 0, 0)

    @staticmethod
    def of(
        fn: object,
        device: torch.device,
        batch: int,
        heads: int,
        at: tuple[int, int, int, int] = (0, 0, 0, 0),
    ) -> MaskFunction:
        """Check ``fn``: four arguments, a bool result, no capture that requires grad; it is
        called once, at (b, h, q_idx, kv_idx) = ``at``."""
        check_arity(fn, "mask_mod", 4, "mask_mod(b, h, q_idx, kv_idx) -> bool")
        assert callable(fn)
        index = TileIndex(*(torch.tensor([n], dtype=INDEX, device=device) for n in at))
        reads = Reads(tuple(index.__dict__.values()), None)

        def point(
            b: torch.Tensor, h: torch.Tensor, i: torch.Tensor, j: torch.Tensor
        ) -> torch.Tensor:
            reads.keep += [b, h, i, j]
            reads.made.update(id(t) for t in (b, h, i, j))
            with reads:
                out: torch.Tensor = fn(b, h, i, j)
            return out

        try:
            out = over_tile(point, None, index)
        except RuntimeError as err:
            raise explain(err, "mask_mod") from err
        if not isinstance(out, torch.Tensor) or out.dtype != torch.bool:
            got = f"dtype {out.dtype}" if isinstance(out, torch.Tensor) else type(out).__name__
            raise ArgumentTypeError(
                f"mask_mod must return a bool tensor (True = keep the score), got {got}. "
                "Return a comparison, e.g. `q_idx >= kv_idx`."
            )
        for t in reads.read.values():
            if t.requires_grad:
                raise ArgumentError(
                    f"mask_mod reads a tensor that requires grad (shape {tuple(t.shape)}): a "
                    "mask is not differentiable. Pass it detached (t.detach()), or put a "
                    "learnable term into score_mod."
                )
        return MaskFunction(fn, batch, heads, reads.elementwise, tuple(reads.read.values()), at)

    def folded(self, batch: int) -> MaskFunction:
        return replace(self, batch=batch)

    def keep(
        self, folded: int, rows: slice, cols: slice | torch.Tensor, device: torch.device
    ) -> torch.Tensor:
        """mask_mod over the tile: bool [B, H, r, c] (B the folded batch); ``cols`` a slice
        of keys or their indices (int32 [c], e.g. several blocks' at once)."""
        if isinstance(cols, slice):
            index = TileIndex.of(self.batch, folded, self.heads, rows, cols, device)
        else:
            whole = TileIndex.of(self.batch, folded, self.heads, rows, slice(0, 0), device)
            index = replace(whole, j=cols.to(device=device, dtype=whole.j.dtype))
        fn = self.fn

        def point(
            b: torch.Tensor, h: torch.Tensor, i: torch.Tensor, j: torch.Tensor
        ) -> torch.Tensor:
            return fn(b, h, i, j)

        with torch.no_grad():
            try:
                keep: torch.Tensor = (
                    fn(*broadcast_axes(index))
                    if self.elementwise
                    else over_tile(point, None, index)
                )
            except RuntimeError as err:
                raise explain(err, "mask_mod") from err
        shape = (index.b.shape[0], index.h.shape[0], index.i.shape[0], index.j.shape[0])
        return keep.expand(shape)

    def at(self, where: torch.Tensor, rows: slice, cols: slice) -> torch.Tensor:
        """mask_mod at the scores ``where`` is True (bool [B, H, r, c] of the tile rows x cols,
        B the folded batch), False elsewhere: bool [B, H, r, c]."""
        folded, heads = where.shape[:2]
        index = TileIndex.of(self.batch, folded, heads, rows, cols, where.device)
        at = where.nonzero(as_tuple=True)
        keep = torch.zeros(where.shape, dtype=torch.bool, device=where.device)
        if at[0].numel() == 0:
            return keep
        fn = self.fn

        def point(
            b: torch.Tensor, h: torch.Tensor, i: torch.Tensor, j: torch.Tensor
        ) -> torch.Tensor:
            return fn(b, h, i, j)

        points = (index.b[at[0]], index.h[at[1]], index.i[at[2]], index.j[at[3]])
        with torch.no_grad():
            try:
                keep[at] = over_points(point, points, elementwise=self.elementwise)
            except RuntimeError as err:
                raise explain(err, "mask_mod") from err
        return keep


@dataclass(frozen=True, eq=False)  # holds tensors: compared by identity
class BlockTable:
    """A BlockMask's blocks (see the module docstring) and its ``mask_mod``.

    status: uint8 [Bm, Hm, QB, KB] on the host; block: (bq, bk);
    seq_q, seq_k: Nq and Nk; mask: the mask_mod (`MaskFunction`).
    """

    status: torch.Tensor
    block: tuple[int, int]
    seq_q: int
    seq_k: int
    mask: MaskFunction
    kinds: tuple[tuple[int, ...], ...]
    source: object = field(default=None, compare=False, repr=False)  # the BlockMask
    _cache: dict[tuple[str, int], Any] = field(default_factory=dict, compare=False, repr=False)

    @staticmethod
    def of(block_mask: object, q: torch.Tensor, k: torch.Tensor, batch: int) -> BlockTable:
        """Check ``block_mask`` against q: [B, Hq, Nq, d], k: [B, Hkv, Nk, d] and read it."""
        from torch.nn.attention.flex_attention import BlockMask

        if not isinstance(block_mask, BlockMask):
            raise ArgumentTypeError(
                f"block_mask must be a torch.nn.attention.flex_attention.BlockMask (from "
                f"create_block_mask), got {type(block_mask).__name__}."
            )
        nq, nk, heads = q.shape[2], k.shape[2], q.shape[1]
        if tuple(block_mask.seq_lengths) != (nq, nk):
            raise ArgumentError(
                f"block_mask was built for (Q_LEN, KV_LEN) = {tuple(block_mask.seq_lengths)} "
                f"but the query has Nq = {nq} and the key Nk = {nk}; build it for these "
                f"lengths: create_block_mask(mask_mod, B, H, {nq}, {nk})."
            )
        device = block_mask.kv_num_blocks.device
        if device != q.device:
            raise ArgumentError(
                f"block_mask is on {device} but the query is on {q.device}; build it with "
                f"device={str(q.device)!r} (or block_mask.to({str(q.device)!r}))."
            )
        bm, hm, qb = block_mask.kv_num_blocks.shape
        if bm not in (1, batch) or hm not in (1, heads):
            raise ArgumentError(
                f"block_mask has (B, H) = ({bm}, {hm}) but the call has B = {batch} and Hq = "
                f"{heads}; build it with B in (None, {batch}) and H in (None, {heads})."
            )
        bq, bk = (int(x) for x in block_mask.BLOCK_SIZE)
        blocks_q, blocks_k = -(-nq // bq), -(-nk // bk)
        if qb < blocks_q:
            raise ArgumentError(
                f"block_mask has {qb} query blocks of {bq} but Nq = {nq} needs {blocks_q}; "
                "build it for these lengths."
            )
        with one_thread():  # small host-side ops
            status = torch.zeros(bm, hm, qb, blocks_k, dtype=torch.uint8)
            num, idx = block_mask.kv_num_blocks.cpu(), block_mask.kv_indices.cpu()
            _status(num, idx, blocks_k, PARTIAL, status)
            if block_mask.full_kv_num_blocks is not None:
                full_idx = block_mask.full_kv_indices
                assert full_idx is not None
                _status(block_mask.full_kv_num_blocks.cpu(), full_idx.cpu(), blocks_k, FULL, status)
            status = status[:, :, :blocks_q].contiguous()
            same = (status == status[:1, :1]).all(dim=1).all(dim=0)
            kinds = torch.where(same, status[0, 0], MIXED).tolist()
        try:
            mask = MaskFunction.of(block_mask.mask_mod, q.device, batch, heads)
        except Exception as err:  # valid on partial blocks alone: checked at the first one's
            partial = (status == PARTIAL).nonzero()
            if not out_of_bounds(err) or partial.shape[0] == 0:
                raise
            b, h, i, j = partial[0].tolist()
            at = (b, h, i * bq, j * bk)
            mask = MaskFunction.of(block_mask.mask_mod, q.device, batch, heads, at)
        table = tuple(tuple(row) for row in kinds)
        return BlockTable(status, (bq, bk), nq, nk, mask, table, block_mask)

    def folded(self, batch: int) -> BlockTable:
        """For a call whose batch folds vmap's samples (`attngrad.autograd.batching`)."""
        return replace(self, mask=self.mask.folded(batch), _cache={})

    def _range(self, rows: slice, cols: slice) -> tuple[range, range]:
        """The query and key block numbers the tile touches."""
        bq, bk = self.block
        r0, r1 = rows.start or 0, self.seq_q if rows.stop is None else rows.stop
        c0, c1 = cols.start or 0, self.seq_k if cols.stop is None else cols.stop
        return range(r0 // bq, -(-r1 // bq)), range(c0 // bk, -(-c1 // bk))

    def _kinds(self, rows: slice, cols: slice) -> set[int]:
        """The kinds (EMPTY, PARTIAL, FULL, MIXED) of the blocks the tile touches."""
        qbs, kbs = self._range(rows, cols)
        return {self.kinds[i][j] for i in qbs for j in kbs}

    def _blocks(self, rows: slice, cols: slice) -> torch.Tensor:
        """The statuses of every block the tile touches: [Bm, Hm, qb, kb]."""
        qbs, kbs = self._range(rows, cols)
        return self.status[:, :, qbs.start : qbs.stop, kbs.start : kbs.stop]

    def skips(self, rows: slice, cols: slice) -> bool:
        """Whether every block the tile touches is empty for every (b, h)."""
        return self._kinds(rows, cols) == {EMPTY}

    def key_span(self, rows: slice) -> tuple[int, int]:
        """[c0, c1): from the first to the last key block that rows reach (0, 0 if none)."""
        bk = self.block[1]
        qbs, _ = self._range(rows, slice(0, self.seq_k))
        reached = [j for i in qbs for j, kind in enumerate(self.kinds[i]) if kind != EMPTY]
        if not reached:
            return 0, 0
        return min(reached) * bk, min(self.seq_k, (max(reached) + 1) * bk)

    def keep(
        self, folded: int, rows: slice, cols: slice, device: torch.device
    ) -> torch.Tensor | None:
        """The tile's bool keep mask [B, H, r, c], or None when it keeps every score."""
        if rows.stop <= rows.start or cols.stop <= cols.start:  # an empty tile: nothing to mask
            return None
        kinds = self._kinds(rows, cols)
        if kinds == {FULL}:
            return None
        keep: torch.Tensor | None = None
        try:
            keep = self.mask.keep(folded, rows, cols, device)
        except Exception as err:
            if not out_of_bounds(err):
                raise
            # mask_mod is valid on partial blocks alone, as torch's kernel calls it: there only
        if keep is not None and kinds == {PARTIAL}:
            return keep
        status = self._score_status(folded, rows, cols, device)
        if keep is None:
            keep = self.mask.at(status == PARTIAL, rows, cols)
        return (keep & (status != EMPTY)) | (status == FULL)

    def _score_status(
        self, folded: int, rows: slice, cols: slice, device: torch.device
    ) -> torch.Tensor:
        """Each score's block status, cut to the tile: uint8 [B, H, r, c] (B the folded batch)."""
        bq, bk = self.block
        r0, c0 = rows.start, cols.start
        r, c = rows.stop - r0, cols.stop - c0
        blocks = self._blocks(rows, cols)
        status = blocks.repeat_interleave(bq, dim=2).repeat_interleave(bk, dim=3)
        status = status[:, :, r0 % bq : r0 % bq + r, c0 % bk : c0 % bk + c].to(device)
        if status.shape[0] not in (1, folded):  # vmap's samples folded: entry n is b = n mod Bm
            status = status.repeat(folded // status.shape[0], 1, 1, 1)
        return status.expand(folded, self.mask.heads, r, c)

    def first_kept(self, device: torch.device) -> tuple[int, int, int, int] | None:
        """(b, h, q_idx, kv_idx) of the first score the BlockMask keeps, in that order; None
        when it keeps none."""
        bq, bk = self.block
        for b, h, qb, kb in self.status.nonzero().tolist():
            rows = slice(qb * bq, min(self.seq_q, (qb + 1) * bq))
            cols = slice(kb * bk, min(self.seq_k, (kb + 1) * bk))
            keep = self.keep(self.mask.batch, rows, cols, device)
            if keep is None:
                return b, h, rows.start, cols.start
            kept = keep[b, h].nonzero()
            if kept.shape[0]:
                i, j = kept[0].tolist()
                return b, h, rows.start + i, cols.start + j
        return None

    def _exact_rows(
        self, folded: int, rows: slice, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """[lo, hi) of each of ``rows`` when each keeps one interval of keys, the same for
        every (b, h); else None.  ``mask_mod`` is called on partial blocks only: a full
        block adds its keys to every row, an empty one none."""
        bk = self.block[1]
        r = rows.stop - rows.start
        qbs, _ = self._range(rows, slice(0, self.seq_k))
        if len(qbs) != 1 or MIXED in self.kinds[qbs.start]:
            return None  # a row block over several of the mask's blocks, or (b, h)-dependent
        row = self.kinds[qbs.start]
        full = [j for j, kind in enumerate(row) if kind == FULL]
        partial = [j for j, kind in enumerate(row) if kind == PARTIAL]
        big = self.seq_k + 1
        first = torch.full((r,), big, dtype=torch.int64)
        last = torch.full((r,), -1, dtype=torch.int64)
        count = torch.zeros(r, dtype=torch.int64)
        if full:
            c0, c1 = full[0] * bk, min(self.seq_k, (full[-1] + 1) * bk)
            first.fill_(c0)
            last.fill_(c1 - 1)
            count += sum(min(self.seq_k, (j + 1) * bk) - j * bk for j in full)
        if partial:  # mask_mod once over the partial blocks' keys side by side
            idx = torch.cat([torch.arange(j * bk, min(self.seq_k, (j + 1) * bk)) for j in partial])
            try:
                keep = self.mask.keep(folded, rows, idx.to(INDEX), device)  # [B, H, r, c]
            except Exception as err:
                if not out_of_bounds(err):
                    raise
                return None  # the dense keep evaluates it on partial blocks alone
            if not bool((keep == keep[:1, :1]).all()):
                return None
            kept = keep[0, 0].cpu()
            first = torch.minimum(first, torch.where(kept, idx, big).amin(-1))
            last = torch.maximum(last, torch.where(kept, idx, -1).amax(-1))
            count += kept.sum(-1)
        live = count > 0
        if not bool((~live | (last - first + 1 == count)).all()):
            return None
        return torch.where(live, first, 0), torch.where(live, last + 1, 0)

    def rows_of_blocks(
        self, folded: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(lo, hi, status) for a fused kernel that runs ``mask_mod`` itself (module
        docstring): int64 [Nq] bounds of each row's keys, and None when they are exact, else
        the rows' spans of non-empty blocks and ``status`` [Bm, Hm, QB, KB] (the host's)."""
        band = self._band(folded, device)
        if band is not None:
            return *band, None
        return *self._spans(device), self.status

    def rows_of_keys(
        self, folded: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(lo, hi, keep) for a fused kernel (module docstring): int64 [Nq] bounds of each
        row's keys, and None when they are exact, else the bool keep [B, H, Nq, Nk]."""
        lo, hi, status = self.rows_of_blocks(folded, device)
        if status is None:
            return lo, hi, None
        dense = self._cache.get(("dense", folded))
        if dense is None:
            dense = self._cache["dense", folded] = self._dense(folded, device)
        return lo, hi, dense

    def _band(self, folded: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Each row's exact [lo, hi) of keys on ``device``, or None where a row keeps more
        than one interval or (b, h) differ; found once per ``folded`` and BlockMask."""
        key = ("band", folded)
        if key not in self._cache:
            # across calls too, per BlockMask: a model passes the same one to every layer
            # and step; the versions of the tensors its mask_mod reads and of its own block
            # lists say whether the band found still holds
            known = _BANDS.setdefault(self.source, {}) if self.source is not None else {}
            versions = tuple(t._version for t in (*self.mask.captured, *_tensors(self.source)))
            shared = (folded, self.mask.batch, self.mask.heads, str(device), versions)
            if shared not in known:
                small = not self.mask.elementwise  # block by block: small host-side ops
                with one_thread() if small else contextlib.nullcontext():
                    band = self._exact(folded, device)
                for stale in [k for k in known if k[-1] != versions]:
                    del known[stale]  # an older version's band is never asked for again
                known[shared] = None if band is None else (band[0].to(device), band[1].to(device))
            self._cache[key] = known[shared]
        return self._cache[key]  # type: ignore[no-any-return]

    def _exact(self, folded: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.mask.elementwise:  # every partial block at once
            return self._exact_all_rows(folded, device)
        nq, bq = self.seq_q, self.block[0]
        lo = torch.zeros(nq, dtype=torch.int64)
        hi = torch.zeros(nq, dtype=torch.int64)
        for r0 in range(0, nq, bq):
            rows = slice(r0, min(r0 + bq, nq))
            bounds = self._exact_rows(folded, rows, device)
            if bounds is None:
                return None
            lo[rows], hi[rows] = bounds
        return lo, hi

    def _spans(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's span of keys, from its block row's first to last non-empty block."""
        nq, bq = self.seq_q, self.block[0]
        lo = torch.zeros(nq, dtype=torch.int64)
        hi = torch.zeros(nq, dtype=torch.int64)
        for r0 in range(0, nq, bq):
            rows = slice(r0, min(r0 + bq, nq))
            lo[rows], hi[rows] = self.key_span(rows)
        return lo.to(device), hi.to(device)

    def _exact_all_rows(
        self, folded: int, device: torch.device, chunk: int = 64
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`_exact_rows` of every row at once, for an elementwise ``mask_mod``: it runs on the
        partial blocks side by side, at most ``chunk`` blocks per call (a bounded buffer)."""
        (bq, bk), nq, nk = self.block, self.seq_q, self.seq_k
        if any(MIXED in row for row in self.kinds):
            return None
        big = nk + 1
        # the full blocks: per row block, their first key, last key and count, then per row
        starts, ends, counts = [], [], []
        for row in self.kinds:
            full = [j for j, kind in enumerate(row) if kind == FULL]
            starts.append(full[0] * bk if full else big)
            ends.append(min(nk, (full[-1] + 1) * bk) - 1 if full else -1)
            counts.append(sum(min(nk, (j + 1) * bk) - j * bk for j in full))

        def per_row(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64).repeat_interleave(bq)[:nq].clone()

        first, last, count = per_row(starts), per_row(ends), per_row(counts)
        pairs = [
            (i, j) for i, row in enumerate(self.kinds) for j, k in enumerate(row) if k == PARTIAL
        ]
        index = TileIndex.of(
            self.mask.batch, folded, self.mask.heads, slice(0, 0), slice(0, 0), device
        )
        b, h = index.b.view(-1, 1, 1, 1, 1), index.h.view(1, -1, 1, 1, 1)

        def intervals(rows: slice) -> bool:
            live = count[rows] > 0
            return bool((~live | (last[rows] - first[rows] + 1 == count[rows])).all())

        c0, step = 0, 1
        while c0 < len(pairs):
            # the row blocks before this chunk's first are done: one that keeps more than
            # one interval of keys ends the search, so the first chunks are small (a
            # dilated mask's first rows end it after one block)
            if not intervals(slice(0, pairs[c0][0] * bq)):
                return None
            part = torch.tensor(pairs[c0 : c0 + step], dtype=torch.int64)  # [P, 2]
            c0, step = c0 + step, min(chunk, 2 * step)
            qb, kb = part[:, 0], part[:, 1]
            rows = qb[:, None] * bq + torch.arange(bq)  # [P, bq]
            cols = kb[:, None] * bk + torch.arange(bk)  # [P, bk]
            i = rows.clamp(max=nq - 1).to(device=device, dtype=INDEX)
            j = cols.clamp(max=nk - 1).to(device=device, dtype=INDEX)
            with torch.no_grad():
                try:
                    keep = self.mask.fn(b, h, i[None, None, :, :, None], j[None, None, :, None, :])
                except Exception as err:
                    if not out_of_bounds(err):
                        raise
                    return None  # the dense keep evaluates it on partial blocks alone
            keep = keep.expand(index.b.shape[0], index.h.shape[0], *rows.shape, bk)
            if not bool((keep == keep[:1, :1]).all()):
                return None
            kept = keep[0, 0].cpu() & (cols < nk)[:, None, :]  # [P, bq, bk]
            at = cols[:, None, :].expand(kept.shape)
            real = (rows < nq).flatten()
            target = rows.flatten()[real]
            first.scatter_reduce_(
                0, target, torch.where(kept, at, big).amin(-1).flatten()[real], "amin"
            )
            last.scatter_reduce_(
                0, target, torch.where(kept, at, -1).amax(-1).flatten()[real], "amax"
            )
            count.scatter_add_(0, target, kept.sum(-1).flatten()[real])
        if not intervals(slice(0, nq)):
            return None
        live = count > 0
        return torch.where(live, first, 0), torch.where(live, last + 1, 0)

    def _dense(self, folded: int, device: torch.device) -> torch.Tensor:
        """The whole keep, bool [B, H, Nq, Nk], block by block (``mask_mod`` on partial ones)."""
        bq, bk = self.block
        dense = torch.zeros(folded, self.mask.heads, self.seq_q, self.seq_k, dtype=torch.bool,
                            device=device)  # fmt: skip
        for r0 in range(0, self.seq_q, bq):
            rows = slice(r0, min(r0 + bq, self.seq_q))
            for c0 in range(0, self.seq_k, bk):
                cols = slice(c0, min(c0 + bk, self.seq_k))
                if self.skips(rows, cols):
                    continue
                keep = self.keep(folded, rows, cols, device)
                dense[:, :, rows, cols] = True if keep is None else keep
        return dense
