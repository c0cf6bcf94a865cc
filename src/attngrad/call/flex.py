"""`FlexCall`: one `attngrad.flex_attention` call, checked and put in the form the strategies take.

FlexAttention's arguments map onto the strategies' `attngrad.core.scores.ScoreMods`:
``score_mod`` becomes its ``score`` (`attngrad.core.score_function.ScoreFunction`,
whose captured tensors become inputs of the strategy's autograd Function) and
``block_mask`` its ``blocks`` (`attngrad.core.block_table.BlockTable`).  The
tiled strategies then take tiles that are whole multiples of the BlockMask's
blocks, so a tile is empty, full or partial as the blocks under it are.

Where torch's own defaults reach attngrad, they mean what they mean to torch: its
identity score_mod (``_identity``, or any function returning its score unchanged)
is no score function, and its "no mask" BlockMask (``_create_empty_block_mask``)
is no BlockMask, so every strategy, fused included, runs them.  A float8 key and
value beside a wider query are computed in the query's dtype, as torch's
flex_attention computes them (it upcasts them in its math).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from attngrad.core.block_table import BlockTable, is_no_mask, out_of_bounds
from attngrad.core.contract import (
    ArgumentError,
    ArgumentTypeError,
    Shapes,
    check_flag,
    validate_attention,
    validate_strategy,
)
from attngrad.core.interface import Problem, Strategy
from attngrad.core.score_function import ScoreFunction
from attngrad.core.scores import ScoreMods
from attngrad.strategies import REGISTRY, STRATEGIES, resolve_for

__all__ = ["FlexCall"]


def _check_layout(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    for name, t in (("query", query), ("key", key), ("value", value)):
        if isinstance(t, torch.Tensor) and t.dim() != 4:
            raise ArgumentError(
                f"flex_attention takes 4-D {name} [B, H, N, d] (as torch's does), got shape "
                f"{tuple(t.shape)}; add the missing dims with {name}.view(...) or "
                f"{name}[None]."
            )


_FLOAT8 = frozenset(
    getattr(torch, name)
    for name in (
        "float8_e4m3fn",
        "float8_e4m3fnuz",
        "float8_e5m2",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
    )
    if hasattr(torch, name)
)


def _widen_float8(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """A float8 key or value beside a wider floating query, in the query's dtype (exact):
    torch's flex_attention takes them so and computes in the query's dtype."""
    if not all(isinstance(t, torch.Tensor) for t in (query, key, value)):
        return key, value
    if not query.is_floating_point() or query.dtype in _FLOAT8:
        return key, value
    key, value = (t.to(query.dtype) if t.dtype in _FLOAT8 else t for t in (key, value))
    return key, value


def _score_function(
    score_mod: object, q: torch.Tensor, batch: int, blocks: BlockTable | None
) -> ScoreFunction | None:
    """``score_mod`` as the strategies take it: None for torch's identity (any function that
    returns its score unchanged); one valid only where the BlockMask keeps scores (a paged
    table's) is checked at the first kept score."""
    try:
        score = ScoreFunction.of(score_mod, q, batch)
    except Exception as err:
        at = None if blocks is None or not out_of_bounds(err) else blocks.first_kept(q.device)
        if at is None:
            raise
        score = ScoreFunction.of(score_mod, q, batch, at)
    return None if score.identity else score.within(blocks)


def _tiles(
    strategy: Strategy[Any], shapes: Shapes, dtype: torch.dtype, blocks: BlockTable | None
) -> Any:
    """The strategy's tiles; for a tiled strategy under a BlockMask, whole multiples of its
    blocks near the strategy's own defaults (fused's 128 x 256 stay 128 x 256 under torch's
    128 x 128 blocks: as the same mask's keyword gets them)."""
    default = strategy.tiles(shapes, dtype, None, None)
    if not strategy.tiled or blocks is None:
        return default
    bq, bk = blocks.block
    block_q = bq * max(1, round(default.block_q / bq))
    block_k = bk * max(1, round(default.block_k / bk))
    return strategy.tiles(shapes, dtype, min(block_q, shapes.seq_q), min(block_k, shapes.seq_k))


@dataclass(frozen=True, eq=False)  # holds tensors: compared by identity
class FlexCall:
    """One validated `attngrad.flex_attention` call.

    strategy: the strategy that runs ("auto" resolved); problem: what it is handed
    (q: [B, Hq, Nq, d], k, v: [B, Hkv, Nk, d|dv], the mods with the score function
    and BlockMask); lse, max_scores: which of them the caller asked for;
    aux: whether they come back as torch's ``AuxOutput``.
    """

    strategy: str
    problem: Problem[Any]
    lse: bool
    max_scores: bool
    aux: bool

    @staticmethod
    def build(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        score_mod: object,
        block_mask: object,
        scale: float | None,
        enable_gqa: bool,
        return_lse: bool,
        kernel_options: object,
        return_aux: object,
        strategy: str,
    ) -> FlexCall:
        """Check `attngrad.flex_attention`'s arguments (after autocast's casts) and build it."""
        _check_layout(query, key, value)
        key, value = _widen_float8(query, key, value)
        if (
            isinstance(query, torch.Tensor) and isinstance(key, torch.Tensor)
            and key.shape[0] == 1 and query.shape[0] > 1 and value.shape[0] == 1
        ):  # fmt: skip
            key = key.expand(query.shape[0], *key.shape[1:])  # one key/value for every entry
            value = value.expand(query.shape[0], *value.shape[1:])
        shapes = validate_attention(query, key, value, None, 0.0, False, scale, enable_gqa)
        check_flag("return_lse", return_lse)
        if kernel_options is not None and not isinstance(kernel_options, dict):
            raise ArgumentTypeError(
                f"kernel_options must be a dict or None, got {type(kernel_options).__name__}."
            )
        lse, max_scores = bool(return_lse), False
        if return_aux is not None:
            if return_lse:
                raise ArgumentError(
                    "return_lse=True and return_aux were both given; pass "
                    "return_aux=AuxRequest(lse=True) alone (return_lse is deprecated in torch)."
                )
            lse, max_scores = bool(return_aux.lse), bool(return_aux.max_scores)  # type: ignore[attr-defined]
        validate_strategy(strategy, STRATEGIES)
        q, k, v = query, key, value
        if is_no_mask(block_mask, shapes.seq_q, shapes.seq_k):
            block_mask = None  # torch's stand-in for block_mask=None
        blocks = None
        if block_mask is not None:
            blocks = BlockTable.of(block_mask, q, k, shapes.batch)
        score = None
        if score_mod is not None:
            score = _score_function(score_mod, q, shapes.batch, blocks)
        mods = ScoreMods(
            None, None, None, shapes.heads_kv, shapes.seq_q, shapes.seq_k, score=score,
            blocks=blocks,
        )  # fmt: skip
        name = resolve_for(strategy, shapes, mods, False, q.device)
        impl = REGISTRY[name]
        reason = impl.unavailable_reason(q.device)
        if reason is not None:
            raise RuntimeError(reason)
        s = 1.0 / math.sqrt(shapes.head_dim) if scale is None else float(scale)
        problem = Problem(q, k, v, mods, s, _tiles(impl, shapes, q.dtype, blocks))
        return FlexCall(name, problem, lse, max_scores, return_aux is not None)

    def outputs(self, o: torch.Tensor, lse: torch.Tensor, stats: torch.Tensor) -> Any:
        """What `attngrad.flex_attention` returns, as torch's does: out [B, Hq, Nq, dv]; with
        return_lse, (out, lse [B, Hq, Nq]); with return_aux, (out, AuxOutput(lse, max_scores)),
        max_scores the row max of the modified scores (-inf on a row that attends nothing)."""
        if self.aux:
            from torch.nn.attention.flex_attention import AuxOutput

            best = None
            if self.max_scores:
                m, log_l = stats.detach().unbind(-1)
                best = torch.where(log_l == float("inf"), float("-inf"), m)
            return o, AuxOutput(lse=lse if self.lse else None, max_scores=best)
        return (o, lse) if self.lse else o
