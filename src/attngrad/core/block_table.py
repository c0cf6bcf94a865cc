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
  when every block the tile touches is full for every (b, h).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from attngrad.core.contract import ArgumentError, ArgumentTypeError
from attngrad.core.score_function import MaskFunction

__all__ = ["EMPTY", "FULL", "PARTIAL", "BlockTable"]

EMPTY, PARTIAL, FULL = 0, 1, 2


def _status(
    num: torch.Tensor, indices: torch.Tensor, blocks_k: int, value: int, status: torch.Tensor
) -> None:
    """status[..., qb, j] = max(status, value) for the first num[..., qb] blocks j listed."""
    listed = torch.arange(indices.shape[-1]) < num.unsqueeze(-1)  # [Bm, Hm, QB, K]
    idx = indices.long().clamp(0, blocks_k - 1)
    src = listed.to(torch.uint8) * value  # unlisted entries add nothing under max
    status.scatter_reduce_(-1, idx, src, reduce="amax")


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
        blocks_k = -(-nk // bk)
        if qb < -(-nq // bq):
            raise ArgumentError(
                f"block_mask has {qb} query blocks of {bq} but Nq = {nq} needs {-(-nq // bq)}; "
                "build it for these lengths."
            )
        status = torch.zeros(bm, hm, qb, blocks_k, dtype=torch.uint8)
        _status(block_mask.kv_num_blocks.cpu(), block_mask.kv_indices.cpu(), blocks_k, PARTIAL, status)
        if block_mask.full_kv_num_blocks is not None:
            full_idx = block_mask.full_kv_indices
            assert full_idx is not None
            _status(block_mask.full_kv_num_blocks.cpu(), full_idx.cpu(), blocks_k, FULL, status)
        mask = MaskFunction.of(block_mask.mask_mod, q.device, batch, heads)
        return BlockTable(status[:, :, : -(-nq // bq)].contiguous(), (bq, bk), nq, nk, mask)

    def folded(self, batch: int) -> BlockTable:
        """For a call whose batch folds vmap's samples (`attngrad.autograd.batching`)."""
        return replace(self, mask=self.mask.folded(batch))

    def _blocks(self, rows: slice, cols: slice) -> torch.Tensor:
        """The statuses of every block the tile touches: [Bm, Hm, qb, kb]."""
        bq, bk = self.block
        r0, r1 = rows.start or 0, self.seq_q if rows.stop is None else rows.stop
        c0, c1 = cols.start or 0, self.seq_k if cols.stop is None else cols.stop
        return self.status[:, :, r0 // bq : -(-r1 // bq), c0 // bk : -(-c1 // bk)]

    def skips(self, rows: slice, cols: slice) -> bool:
        """Whether every block the tile touches is empty for every (b, h)."""
        return not bool(self._blocks(rows, cols).any())

    def key_span(self, rows: slice) -> tuple[int, int]:
        """[c0, c1): from the first to the last key block that rows reach (0, 0 if none)."""
        bk = self.block[1]
        reached = self._blocks(rows, slice(0, self.seq_k)).amax(dim=(0, 1, 2)).nonzero()
        if reached.numel() == 0:
            return 0, 0
        return int(reached[0]) * bk, min(self.seq_k, (int(reached[-1]) + 1) * bk)

    def keep(
        self, folded: int, rows: slice, cols: slice, device: torch.device
    ) -> torch.Tensor | None:
        """The tile's bool keep mask [B, H, r, c], or None when it keeps every score."""
        blocks = self._blocks(rows, cols)
        if bool((blocks == FULL).all()):
            return None
        keep = self.mask.keep(folded, rows, cols, device)
        if bool((blocks == PARTIAL).all()):
            return keep
        bq, bk = self.block
        r0, c0 = rows.start, cols.start
        # each score's block status, cut to the tile
        status = blocks.repeat_interleave(bq, dim=2).repeat_interleave(bk, dim=3)
        status = status[:, :, r0 % bq : r0 % bq + keep.shape[2], c0 % bk : c0 % bk + keep.shape[3]]
        status = status.to(device)
        return (keep & (status != EMPTY)) | (status == FULL)
