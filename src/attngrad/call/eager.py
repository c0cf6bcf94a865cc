"""The eager route of a `Call`: its strategy's autograd.Function, applied once.

Dropout's (seed, offset) is drawn here, from the call's generator, and the
band laid out here, once per call; the strategy's `AttentionFunction` then
saves what its backward needs (`attngrad.strategies.base`).
"""

from __future__ import annotations

import torch

from attngrad.call.call import Call
from attngrad.core.dropout import Dropout, draw_seed
from attngrad.core.interface import Problem
from attngrad.strategies import REGISTRY
from attngrad.strategies.base import differentiable

__all__ = ["run"]


def run(
    call: Call, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(O: [B, Hq, Nq, dv], lse: [B, Hq, Nq]) of ``call`` over q: [B, Hq, Nq, d], k, v
    (`Call.inputs`).

    lse is in the compute dtype, -inf on rows that attend nothing.
    """
    strategy = REGISTRY[call.strategy]
    dropout = None
    if call.dropout_p > 0:
        dropout = Dropout(call.dropout_p, *draw_seed(q.device, call.generator))
    band = call.band.build(call.shapes.seq_q, call.shapes.seq_k, q.device)
    mods = call.score_mods(band, dropout)
    problem = Problem(q, k, v, mods, call.scale, call.tiles(strategy, q))
    o, lse, _ = differentiable(strategy, problem)
    return o, lse
