r"""Attention sinks: logits that join every row's softmax denominator and carry no value.

With a sink logit sigma per row (gpt-oss: one per head)::

    P_ij = exp(S_ij) / (sum_j exp(S_ij) + exp(sigma))       O = P v

This is attention without the sink merged with a partial whose output is
zero and whose log-sum-exp is sigma -- the same merge ring attention does
through the row statistics::

    lse' = logaddexp(lse, sigma)        O' = O exp(lse - lse')

So a sink costs O(Nq) elementwise work after any strategy, keeps its memory
class, and its gradient, double backward and forward mode come from
autograd through these two lines and the strategy's differentiable (O, lse):

    d sigma = -exp(sigma - lse') (Delta - dlse'),   Delta = rowsum(dO * O')

A row that attends nothing (lse = -inf) gets O' = 0 and lse' = sigma.
"""

from __future__ import annotations

import torch

__all__ = ["merge_sinks"]


def merge_sinks(
    out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(O', lse') from O [..., Hq, Nq, dv], lse [..., Hq, Nq] and sinks broadcastable to lse.

    Computed in lse's dtype (float32 for 16-bit inputs); O' comes back in O's dtype.
    """
    sigma = sinks.to(lse.dtype)
    # logaddexp by hand around a constant shift: torch.logaddexp's second derivative is
    # NaN where lse = -inf (a row that attends nothing); exp(-inf - shift) = 0 is smooth
    shift = torch.maximum(lse, sigma).detach()
    shift = shift.masked_fill(shift == float("-inf"), 0.0)  # no key and no sink: O stays 0
    weight_o, weight_s = torch.exp(lse - shift), torch.exp(sigma - shift)
    total = shift + torch.log(weight_o + weight_s)
    weight = weight_o / (weight_o + weight_s).masked_fill(total == float("-inf"), 1.0)
    return (out.to(lse.dtype) * weight.unsqueeze(-1)).to(out.dtype), total
