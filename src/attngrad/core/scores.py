"""What happens to the scores S = scale q k^T before the softmax and to P after it, in one form.

`attention` accepts SDPA's conventions (a bool mask, True = attend; a float
mask added to the scores; ``is_causal``) and beyond them a sliding
``window=(left, right)``, its ``align``-ment, packed segments, ``softcap``
and ``dropout_p``.  A `ScoreMods` holds them as every strategy applies them:

* the score modifications, pointwise functions of each score applied in
  order, its ``chain`` (`attngrad.core.modification`): the ``softcap``,
  c tanh(S / c) (`attngrad.core.softcap.Softcap`; Gemma 2), a FlexAttention
  ``score`` function (`attngrad.core.score_function.ScoreFunction`),
  S' = score_mod(S, b, h, i, j), and the float mask, a ``bias`` added to the
  scores (`attngrad.core.bias.Bias`);
* ``keep``: a bool mask; it and the bias are 4-D tensors ``[Bm, Hm, Nqm, Nkm]``,
  each dim 1 or the full size, so they stay broadcast views of what the caller
  passed (`split_mask`);
* a band (`attngrad.core.band.Band`): query i attends keys lo(i) <= j < hi(i),
  from ``is_causal``, the window, the alignment and the segments (decided in
  `attngrad.core.band`, which draws its pictures);
* a FlexAttention BlockMask's ``blocks`` (`attngrad.core.block_table.BlockTable`):
  its empty tiles skipped, ``mask_mod`` on its partial ones;
* ``dropout`` (`attngrad.core.dropout.Dropout`), applied to P after the softmax.

Every strategy applies them the same way, to the whole score matrix or to one
tile of it: the chain, then the masks; the band also tells the tiled
strategies which tiles to skip.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from attngrad.core.band import Band, BandSpec
from attngrad.core.bias import Bias, tile
from attngrad.core.block_table import BlockTable
from attngrad.core.contract import Shapes
from attngrad.core.dropout import Dropout
from attngrad.core.heads import group_heads
from attngrad.core.modification import Chain, Records, ScoreModification
from attngrad.core.score_function import ScoreFunction
from attngrad.core.softcap import Softcap

__all__ = ["ScoreMods", "split_mask"]


def _to_4d(attn_mask: torch.Tensor, shapes: Shapes) -> torch.Tensor:
    """[..., Hm, Nqm, Nkm] broadcastable to the scores -> [Bm, Hm, Nqm, Nkm].

    Bm is 1 when the mask is shared by every batch entry, else the flattened
    batch.  Only views and (where the lead dims are partly broadcast) one
    reshape: autograd carries a float mask's gradient back through them,
    summing over the dims that were broadcast.
    """
    ndim = len(shapes.lead) + 3  # [*lead, Hq, Nq, Nk], also for headless [Nq, d] inputs
    m = attn_mask.reshape((1,) * (ndim - attn_mask.ndim) + tuple(attn_mask.shape))
    lead = m.shape[:-3]
    if all(n == 1 for n in lead):
        return m.reshape(1, *m.shape[-3:])
    return m.expand(*shapes.lead, *m.shape[-3:]).reshape(shapes.batch, *m.shape[-3:])


def split_mask(
    attn_mask: torch.Tensor | None, shapes: Shapes
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(bias, keep) [Bm, Hm, Nqm, Nkm] views of ``attn_mask``: a float mask is a bias, a bool one keeps."""
    if attn_mask is None:
        return None, None
    m = _to_4d(attn_mask, shapes)
    return (None, m) if m.dtype == torch.bool else (m, None)


@dataclass(frozen=True)
class ScoreMods:
    """The scores' mask and modifiers: what each query may attend to, and what happens to
    its scores and probabilities, as every strategy applies them.

    bias: [Bm, Hm, Nqm, Nkm] float added to the scores, or None.
    keep: [Bm, Hm, Nqm, Nkm] bool, True where a score is kept, or None.
    band: the keys each row may reach (causal, window, alignment, packed
        segments; `attngrad.core.band.Band`), or None for all of them.
    heads_kv: key/value heads; the mask's heads are grouped to match (GQA).
    seq_q, seq_k: Nq and Nk.
    softcap: c, when scores are capped to c * tanh(S / c) first.
    dropout: the call's `attngrad.core.dropout.Dropout` of P, or None.
    score: a FlexAttention score function (with its captured tensors), or None.
    blocks: a FlexAttention BlockMask's tiles and mask function, or None.
    chain: the softcap, the score function and the bias as the score modifications
        they are, in that order (`attngrad.core.modification.Chain`): what the
        strategies evaluate on a tile.
    """

    bias: torch.Tensor | None
    keep: torch.Tensor | None
    band: Band | None
    heads_kv: int
    seq_q: int
    seq_k: int
    softcap: float | None = None
    dropout: Dropout | None = None
    score: ScoreFunction | None = None
    blocks: BlockTable | None = None
    chain: Chain = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        links: list[ScoreModification] = []
        if self.softcap is not None:
            links.append(Softcap(self.softcap))
        if self.score is not None:
            links.append(self.score)
        if self.bias is not None:
            links.append(Bias(self.bias, self.heads_kv))
        object.__setattr__(self, "chain", Chain(tuple(links)))

    @staticmethod
    def build(
        attn_mask: torch.Tensor | None,
        is_causal: bool,
        window: tuple[int | None, int | None] | None,
        shapes: Shapes,
        align: str = "top-left",
        segments: tuple[tuple[int, ...], tuple[int, ...]] | None = None,
        softcap: float | None = None,
        dropout: Dropout | None = None,
        device: torch.device | None = None,
    ) -> ScoreMods:
        """From (already validated) `attention`-style arguments, for tools and tests;
        `attngrad.call` builds a call's from its `attngrad.call.Call`."""
        band = BandSpec.of(window, is_causal, align, segments).build(
            shapes.seq_q, shapes.seq_k, device
        )
        bias, keep = split_mask(attn_mask, shapes)
        return ScoreMods(
            bias, keep, band, shapes.heads_kv, shapes.seq_q, shapes.seq_k, softcap, dropout
        )

    @staticmethod
    def none(heads_kv: int, seq_q: int, seq_k: int) -> ScoreMods:
        """Attend everything."""
        return ScoreMods(None, None, None, heads_kv, seq_q, seq_k)

    @property
    def tensors(self) -> tuple[torch.Tensor | None, ...]:
        """(bias, keep, *captured): what a strategy passes to autograd and saves for
        backward; captured are the score function's tensors (`ScoreFunction`)."""
        captured = () if self.score is None else self.score.captured
        return (self.bias, self.keep, *captured)

    def with_tensors(
        self,
        bias: torch.Tensor | None,
        keep: torch.Tensor | None,
        captured: tuple[torch.Tensor, ...] = (),
    ) -> ScoreMods:
        """The same mods over other (e.g. saved) bias, keep and captured tensors."""
        score = None if self.score is None else self.score.with_captured(captured)
        return replace(self, bias=bias, keep=keep, score=score)

    @property
    def captured(self) -> tuple[torch.Tensor, ...]:
        """The score function's captured tensors (none without one)."""
        return () if self.score is None else self.score.captured

    def folded(self, batch: int) -> ScoreMods:
        """For a call whose batch folds vmap's samples over a ``batch``-entry call: dropout
        and the score and mask functions read each entry's own batch index."""
        return replace(
            self,
            dropout=None if self.dropout is None else self.dropout.folded(batch),
            score=None if self.score is None else self.score.folded(batch),
            blocks=None if self.blocks is None else self.blocks.folded(batch),
        )

    # -- the band ---------------------------------------------------------

    @property
    def banded(self) -> bool:
        """Whether some keys are never computed (a band, or a BlockMask's empty tiles)."""
        return self.band is not None or self.blocks is not None

    def key_span(self, rows: slice) -> tuple[int, int]:
        """[c0, c1): the keys rows [rows.start, rows.stop) can attend under the band and
        the BlockMask.

        Tiles outside it are entirely masked and the tiled strategies skip
        them: with is_causal that is about half of all tiles.
        """
        lo, hi = (0, self.seq_k) if self.band is None else self.band.key_span(rows)
        if self.blocks is not None:
            b_lo, b_hi = self.blocks.key_span(rows)
            lo, hi = max(lo, b_lo), min(hi, b_hi)
        return lo, max(lo, hi)

    def skips(self, rows: slice, cols: slice) -> bool:
        """Whether a BlockMask leaves every score of the tile masked (the tile is skipped)."""
        return self.blocks is not None and self.blocks.skips(rows, cols)

    # -- applying ----------------------------------------------------------

    def apply_(
        self, s: torch.Tensor, rows: slice, cols: slice, records: Records | None = None
    ) -> torch.Tensor:
        """Modify and mask a tile of scores in place and return it.

        s: [B, Hkv, G, r, c], the scaled scores of query rows ``rows`` against
        key columns ``cols``.  ``records``: buffers like s, one per modification of
        the chain (None where it keeps none), that receive the tile's records, which
        the backward of the same tile reads (`attngrad.core.modification.Chain`).
        """
        r, c = _bounds(rows, self.seq_q), _bounds(cols, self.seq_k)
        self.chain.values_(s, r, c, records)
        if self.keep is not None:  # as a -inf bias: a broadcast masked_fill is ~5x slower
            keep = tile(group_heads(self.keep, self.heads_kv), rows, cols)
            blocked = torch.zeros(keep.shape, dtype=s.dtype, device=s.device)
            s.add_(blocked.masked_fill_(keep.logical_not(), float("-inf")))
        if self.band is not None and not self.band.covers(rows, cols):
            s.add_(self.band.bias(r, c, s))  # finite + -inf = -inf
        if self.blocks is not None:
            kept = self.blocks.keep(s.shape[0], r, c, s.device)
            if kept is not None:  # [B, H, r, c]
                s.masked_fill_(kept.logical_not().view(s.shape), float("-inf"))
        return s


def _bounds(s: slice, n: int) -> slice:
    """A slice with explicit bounds: [start or 0, stop or n)."""
    return slice(s.start or 0, n if s.stop is None else s.stop)
