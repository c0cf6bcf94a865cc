r"""The steps of attention's definition, in plain PyTorch ops, shared by the reference and its bounds.

`attngrad.verify.reference` composes them into the float64 reference (its
module docstring writes the formula these steps follow, one line each);
`attngrad.verify.bounds` takes the same scores and probabilities apart to
bound what rounding does to each result.  Shapes: q [..., Hq, Nq, d], k and
v per query head after `expand_kv`, scores S and probabilities P
[..., Hq, Nq, Nk].

`Band` builds the causal/window band and the packed segments from their
definition, not from `attngrad.core.band`, so the strategies' band is
checked against an independent one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = [
    "Band",
    "Window",
    "cap",
    "dropped",
    "expand_kv",
    "masked_scores",
    "probabilities",
    "raw_scores",
    "row_softmax",
    "score_scale",
    "sink_column",
    "with_sinks",
]

Window = tuple[int | None, int | None] | None


@dataclass(frozen=True)
class Band:
    """Which keys each query may reach: is_causal, window, align and packed segments.

    cu_q, cu_k: cumulative segment lengths [0, ..., N] (None: one segment of everything).
    """

    is_causal: bool = False
    window: Window = None
    align: str = "top-left"
    cu_q: torch.Tensor | None = None
    cu_k: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.align not in ("top-left", "bottom-right"):
            raise ValueError(f"align must be 'top-left' or 'bottom-right', got {self.align!r}")
        if self.cu_q is None and self.cu_k is not None:
            raise ValueError("cu_seqlens_k was given without cu_seqlens_q; pass both")

    def _cumulative(self, nq: int, nk: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(cu_q, cu_k) int64 on the CPU: one segment of everything without any, k = q without k."""
        if self.cu_q is None:
            return torch.tensor([0, nq]), torch.tensor([0, nk])
        cu_k = self.cu_q if self.cu_k is None else self.cu_k
        return self.cu_q.cpu().to(torch.int64), cu_k.cpu().to(torch.int64)

    @property
    def only_causal(self) -> bool:
        """True when the band is at most SDPA's is_causal: no window, no segments, top-left."""
        return self.window is None and self.cu_q is None and self.align == "top-left"

    def keep(self, nq: int, nk: int, device: torch.device) -> torch.Tensor:
        """[Nq, Nk] bool: key j is in query i's segment and inside its causal/window band.

        Inside a segment of len_q queries and len_k keys, query i (counted
        from the segment's start) sits at key i + off, off = 0 (top-left) or
        len_k - len_q (bottom-right); it keeps key j when j - (i + off) is
        at most 0 (causal), at least -left and at most right (window).
        """
        cu_q, cu_k = self._cumulative(nq, nk)
        seg_q, pos_q = _segment_positions(cu_q)
        seg_k, pos_k = _segment_positions(cu_k)
        if self.align == "bottom-right":
            pos_q = pos_q + (cu_k.diff() - cu_q.diff())[seg_q]
        offset = pos_k.unsqueeze(0) - pos_q.unsqueeze(1)  # key minus the query's own key position
        keep = seg_q.unsqueeze(1) == seg_k.unsqueeze(0)
        left, right = self.window if self.window is not None else (None, None)
        if self.is_causal:
            keep &= offset <= 0
        if left is not None:
            keep &= offset >= -left
        if right is not None:
            keep &= offset <= right
        return keep.to(device)


def _segment_positions(cu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(segment, position inside it) of every position: int64 [N] each, from cu [0, ..., N]."""
    lengths = cu.diff()
    segment = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    return segment, torch.arange(segment.numel()) - cu[segment]


def expand_kv(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, enable_gqa: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v repeated per query head when ``enable_gqa`` (query head h uses kv head h // G)."""
    if not enable_gqa:
        return key, value
    groups = query.shape[-3] // key.shape[-3]
    return key.repeat_interleave(groups, dim=-3), value.repeat_interleave(groups, dim=-3)


def score_scale(query: torch.Tensor, scale: float | None) -> float:
    return 1 / math.sqrt(query.shape[-1]) if scale is None else scale


def raw_scores(
    query: torch.Tensor, key: torch.Tensor, scale: float, scale_first: bool = False
) -> torch.Tensor:
    """X = scale q k^T [..., Hq, Nq, Nk]: (q k^T) s, or (s q) k^T with ``scale_first``."""
    if scale_first:
        return (query * scale) @ key.transpose(-2, -1)
    return query @ key.transpose(-2, -1) * scale


def cap(x: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """T = c tanh(X / c), or X without a softcap."""
    return x if softcap is None else softcap * torch.tanh(x / softcap)


def masked_scores(
    t: torch.Tensor, attn_mask: torch.Tensor | None, band: Band
) -> tuple[torch.Tensor, torch.Tensor]:
    """(S, keep): t plus a float mask, -inf where a bool mask or the band drops a key."""
    keep = band.keep(t.shape[-2], t.shape[-1], t.device)
    s = t
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        keep = keep & attn_mask
    elif attn_mask is not None:
        s = s + attn_mask
    keep = keep & (s != float("-inf"))
    return s.masked_fill(~keep, float("-inf")), keep


def sink_column(s: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """The sinks as one more score column: [..., Hq, Nq, 1] (sinks [Hq] or like [..., Hq, Nq])."""
    sigma = sinks.unsqueeze(-1) if sinks.ndim == 1 else sinks
    return sigma.to(s.dtype).expand(s.shape[:-1]).unsqueeze(-1)


def with_sinks(s: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """[S, sigma]: [..., Nq, Nk + 1] with sinks, S itself without."""
    return s if sinks is None else torch.cat([s, sink_column(s, sinks)], dim=-1)


def row_softmax(s: torch.Tensor) -> torch.Tensor:
    """softmax along the last dim with P = 0 on rows whose every score is -inf."""
    dead = (s == float("-inf")).all(dim=-1, keepdim=True)
    return torch.softmax(s.masked_fill(dead, 0.0), dim=-1).masked_fill(dead, 0.0)


def probabilities(s: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """P [..., Nq, Nk]: the softmax of each row over its keys and its sink, the sink dropped."""
    return row_softmax(with_sinks(s, sinks))[..., : s.shape[-1]]


def _keep_factor(dropout_p: float) -> float:
    """1 / (1 - p), the factor of a kept entry; 0 when p = 1 (nothing is kept)."""
    return 0.0 if dropout_p >= 1.0 else 1.0 / (1.0 - dropout_p)


def dropped(p: torch.Tensor, dropout_mask: torch.Tensor | None, dropout_p: float) -> torch.Tensor:
    """P o Z / (1 - p): P with the dropped entries zeroed and the kept ones scaled."""
    if dropout_mask is None:
        if dropout_p > 0:
            raise ValueError(
                f"dropout_p={dropout_p} needs dropout_mask, the bool keep mask Z: the reference "
                "draws no random numbers (attngrad.core.dropout.keep_mask gives attention's)."
            )
        return p
    return p.masked_fill(~dropout_mask, 0.0) * _keep_factor(dropout_p)
