"""`Call`: one attention call, its arguments checked and put in the form the strategies take.

`attngrad.attention` builds one `Call` from its arguments (`Call.build`), then
runs it eagerly (`attngrad.call.eager`) or, under torch.compile, through two
custom ops (`attngrad.call.compiled`).  The Call is built once, the same way
for both routes: a float or bool ``attn_mask`` becomes the bias or keep view
here and nowhere else, and the band is stated here (`attngrad.core.band.BandSpec`)
and laid out once per call by whichever route runs it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch.nn.attention.bias import CausalBias

from attngrad.core.band import Band, BandSpec, validate_band
from attngrad.core.contract import (
    ArgumentError,
    Shapes,
    check_flag,
    validate_attention,
    validate_blocks,
    validate_strategy,
)
from attngrad.core.dropout import Dropout
from attngrad.core.interface import Strategy
from attngrad.core.keywords import validate_generator, validate_sinks, validate_softcap
from attngrad.core.scores import ScoreMods, split_mask
from attngrad.core.sinks import merge_sinks
from attngrad.strategies import REGISTRY, STRATEGIES, TILED, resolve

__all__ = ["Call"]

T = TypeVar("T")


@dataclass(frozen=True, eq=False)  # holds tensors: compared by identity
class Call:
    """One validated `attngrad.attention` call, as both routes run it.

    strategy: the strategy that runs ("auto" resolved).
    shapes: the sizes, as the caller passed the tensors (`attngrad.core.contract.Shapes`).
    scale: the scores' factor (1/sqrt(d) by default).
    bias, keep: the attn_mask as [Bm, Hm, Nqm, Nkm] views (`attngrad.core.scores.split_mask`).
    band: the band as stated (`attngrad.core.band.BandSpec`); its segments are read
        already, except under torch.compile, where ``cu_seqlens`` are read in the op.
    cu_seqlens: the raw (cu_seqlens_q, cu_seqlens_k).
    softcap, dropout_p, generator: as `attngrad.attention` takes them.
    sinks: broadcastable to [*lead, Hq, Nq], or None.
    return_lse: whether lse is returned too.
    block_q, block_k: the tiled strategies' tile sizes (None: from the shape).
    """

    strategy: str
    shapes: Shapes
    scale: float
    bias: torch.Tensor | None
    keep: torch.Tensor | None
    band: BandSpec
    cu_seqlens: tuple[torch.Tensor | None, torch.Tensor | None]
    softcap: float | None
    dropout_p: float
    generator: torch.Generator | None
    sinks: torch.Tensor | None
    return_lse: bool
    block_q: int | None
    block_k: int | None

    @staticmethod
    def build(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: object,
        dropout_p: float,
        is_causal: bool,
        scale: float | None,
        enable_gqa: bool,
        *,
        strategy: str,
        window: object,
        block_q: int | None,
        block_k: int | None,
        return_lse: bool,
        softcap: float | None,
        sinks: torch.Tensor | None,
        align: str,
        cu_seqlens_q: torch.Tensor | None,
        cu_seqlens_k: torch.Tensor | None,
        generator: torch.Generator | None,
        compiling: bool = False,
    ) -> Call:
        """Check `attngrad.attention`'s arguments (after autocast's casts) and build the call.

        ``compiling``: under torch.compile, where nothing may read a tensor on
        the host (the segments are then read in the op) and dropout draws from
        the default generator.  RuntimeError when the strategy cannot run on
        these tensors here (triton off CUDA without the interpreter).
        """
        # a CausalBias is part of the band; any other attn_mask is checked as SDPA's
        tensor_mask = None if isinstance(attn_mask, CausalBias) else attn_mask
        shapes = validate_attention(
            query, key, value, tensor_mask, dropout_p, is_causal, scale, enable_gqa
        )
        assert tensor_mask is None or isinstance(tensor_mask, torch.Tensor)  # validated
        band = validate_band(
            attn_mask, is_causal, window, align, (cu_seqlens_q, cu_seqlens_k), shapes,
            query.device, read=not compiling,
        )  # fmt: skip
        validate_strategy(strategy, STRATEGIES)
        check_flag("return_lse", return_lse)
        cap = validate_softcap(softcap)
        sink = validate_sinks(sinks, query, shapes)
        generator = validate_generator(generator, query.device)
        if compiling and generator is not None:
            raise ArgumentError(
                "generator= is not supported under torch.compile; dropout there draws from "
                "the default generator (seed it with torch.manual_seed)."
            )
        banded = band.bounded or window is not None or cu_seqlens_q is not None
        tiling_given = block_q is not None or block_k is not None
        name = resolve(strategy, shapes, tiling_given, banded, query.device)
        block_q, block_k = validate_blocks(block_q, block_k, name, TILED)
        reason = REGISTRY[name].unavailable_reason(query.device)
        if reason is not None:
            raise RuntimeError(reason)
        bias, keep = split_mask(tensor_mask, shapes)
        s = 1.0 / math.sqrt(shapes.head_dim) if scale is None else float(scale)
        return Call(
            name, shapes, s, bias, keep, band, (cu_seqlens_q, cu_seqlens_k), cap,
            float(dropout_p), generator, sink, return_lse, block_q, block_k,
        )  # fmt: skip

    def inputs(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q: [B, Hq, Nq, d], k: [B, Hkv, Nk, d], v: [B, Hkv, Nk, dv]: the layout strategies take."""
        sh = self.shapes
        q = query.reshape(sh.batch, sh.heads_q, sh.seq_q, sh.head_dim)
        k = key.reshape(sh.batch, sh.heads_kv, sh.seq_k, sh.head_dim)
        v = value.reshape(sh.batch, sh.heads_kv, sh.seq_k, sh.value_dim)
        return q, k, v

    def tiles(self, strategy: Strategy[T], q: torch.Tensor) -> T:
        """``strategy``'s tiles for the call, from its block sizes, over q: [B, Hq, Nq, d]."""
        return strategy.tiles(self.shapes, q.dtype, self.block_q, self.block_k)

    def score_mods(self, band: Band | None, dropout: Dropout | None) -> ScoreMods:
        """The call's `ScoreMods` over its laid-out ``band`` and drawn ``dropout``."""
        sh = self.shapes
        return ScoreMods(
            self.bias, self.keep, band, sh.heads_kv, sh.seq_q, sh.seq_k, self.softcap, dropout
        )

    def outputs(
        self, o: torch.Tensor, lse: torch.Tensor
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """What `attngrad.attention` returns from O [B, Hq, Nq, dv] and lse [B, Hq, Nq]:
        out [..., Hq, Nq, dv] (and lse [..., Hq, Nq]) with the sinks merged in."""
        sh = self.shapes
        out = o.reshape(*sh.lead, sh.heads_q, sh.seq_q, sh.value_dim)
        lse = lse.reshape(*sh.lead, sh.heads_q, sh.seq_q)
        if self.sinks is not None:
            out, lse = merge_sinks(out, lse, self.sinks)
        if sh.headless:  # [Nq, dv] and [Nq]: SDPA's 2-D inputs
            out, lse = out.reshape(sh.out_shape), lse.reshape(sh.lse_shape)
        return (out, lse) if self.return_lse else out
