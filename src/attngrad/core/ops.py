r"""Local forward and backward ops of scaled-dot-product attention.

Per batch and head, with ``q: [Nq, d]``, ``k: [Nk, d]``, ``v: [Nk, dv]``::

    S = scale * q @ k^T        (+ bias, masked entries = -inf)   [Nq, Nk]
    P = softmax(S, dim=-1)                                        [Nq, Nk]
    O = P @ v                                                     [Nq, dv]

and backward from ``dO = dout``::

    dV = P^T @ dO
    dP = dO @ v^T
    dS = P * (dP - rowsum(P * dP))      rowsum(P * dP) == rowsum(dO * O) =: Delta
    dq = scale * dS @ k        dk = scale * dS^T @ q        dbias = dS

Each forward step sits right above the local backward that differentiates it.

Row statistics.  The softmax of a row is P = exp(S - m) / l with m = max_j S
and l = sum_j exp(S - m); the O(N) strategies save ``stats`` = (m, log l) per
row instead of lse = m + log l, and rebuild P = exp((S - m) - log l).  One
float lse cannot do that when |m| dwarfs log l: a bias of finfo.min rounds
lse to m and loses log l (P = 1 instead of 1/Nk), and at |S| ~ 1e3 its
rounding scales every P of the row by exp(|m| u), which saturated rows
(dS ~ 0) turn into large gradient errors.  S - m, in contrast, is exact near
the max.  exp runs as exp2 of (S - m) * log2(e): the difference is formed
first, so no finite score overflows on the way (finfo.min * log2(e) would),
and exp2 is about twice as fast as exp on CPU.
Every op works on any number of leading batch dims (``[..., N, d]``).
"""

from __future__ import annotations

import math

import torch

LOG2E = 1.0 / math.log(2.0)  # exp(x) == exp2(x * LOG2E)

__all__ = [
    "LOG2E",
    "attend",
    "compute_dtype",
    "delta",
    "join_lse_cotangent_",
    "log_normalizer",
    "lse",
    "probabilities_",
    "probability_gradient",
    "query_key_gradients",
    "scores",
    "softmax",
    "softmax_",
    "softmax_backward",
    "softmax_backward_",
    "value_gradient",
]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the strategies compute in: float64 for float64 inputs, else float32.

    16-bit inputs are upcast tile by tile (scores, softmax and accumulators in
    float32, like the fused GPU kernels); results are cast back to the input
    dtype, and saved tensors keep it (the row statistics stay float32).
    """
    return torch.float64 if dtype == torch.float64 else torch.float32


def scores(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """S = scale * q @ k^T.   q: [..., Nq, d], k: [..., Nk, d] -> S: [..., Nq, Nk].

    The scale is applied to q ([Nq, d]) rather than to S ([Nq, Nk]): one pass
    over N*d elements instead of N*N.

    >>> scores(torch.ones(1, 2, 4), torch.ones(1, 3, 4), 0.5).shape
    torch.Size([1, 2, 3])
    """
    return torch.matmul(q * scale, k.transpose(-2, -1))


def query_key_gradients(
    ds: torch.Tensor, q: torch.Tensor, k: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Backward of `scores`: dq = scale * dS @ k, dk = scale * dS^T @ q.

    ds: [..., Nq, Nk], q: [..., Nq, d], k: [..., Nk, d] -> (dq: like q, dk: like k).
    Both branches carry the same scale.
    """
    dq = torch.matmul(ds, k) * scale
    dk = torch.matmul(ds.transpose(-2, -1), q) * scale
    return dq, dk


def _shift(m: torch.Tensor) -> torch.Tensor:
    """The row max as a shift: 0 for a row with no finite score (so exp(-inf - 0) = 0)."""
    return m.masked_fill(m == float("-inf"), 0.0)


def log_normalizer(l_sum: torch.Tensor) -> torch.Tensor:
    """log l, with +inf for a row that attends nothing (l = 0): exp(S - m - inf) = 0."""
    return torch.where(l_sum == 0, float("inf"), torch.log(l_sum))


def softmax_(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """P = softmax(S) in place in ``s``, and the row statistics: [..., Nq, Nk] -> (P, stats).

    stats: [..., Nq, 2] = (m, log l), m = max_j S (0 on a dead row), l = sum_j
    exp(S - m) (log l = +inf on a dead row).  A row whose every score is -inf
    (masked) gets P = 0: exp2 gives 0 everywhere, l = 0, and nothing divides
    by it, so no dead-row mask is needed.
    """
    if s.shape[-1] == 0:  # no keys: every row is dead
        stats = s.new_zeros(*s.shape[:-1], 2)
        stats[..., 1] = float("inf")
        return s, stats
    m = _shift(s.amax(dim=-1, keepdim=True))  # [..., Nq, 1]
    p = s.sub_(m).mul_(LOG2E).exp2_()
    l_sum = p.sum(dim=-1, keepdim=True)
    p.div_(l_sum.masked_fill(l_sum == 0, 1.0))
    return p, torch.cat((m, log_normalizer(l_sum)), dim=-1)


def softmax(s: torch.Tensor) -> torch.Tensor:
    """P = softmax(S, dim=-1): [..., Nq, Nk] -> same shape, zero on rows that attend nothing.

    A row whose every score is -inf (fully masked) would be 0/0 = NaN in plain
    softmax; the attention convention is P = 0, so that O = 0 and every
    gradient is zero.  Out of place, so autograd can differentiate it.
    """
    if s.shape[-1] == 0:
        return s.clone()
    m = _shift(s.amax(dim=-1, keepdim=True)).detach()  # a row shift: P does not depend on it
    p = torch.exp2((s - m) * LOG2E)
    l_sum = p.sum(dim=-1, keepdim=True)
    return p / l_sum.masked_fill(l_sum == 0, 1.0)


def lse(stats: torch.Tensor) -> torch.Tensor:
    """logsumexp of each row from its statistics: [..., Nq, 2] -> [..., Nq]; -inf on a dead row."""
    m, log_l = stats.unbind(-1)
    return torch.where(log_l == float("inf"), float("-inf"), m + log_l)


def probabilities_(s: torch.Tensor, stats: torch.Tensor) -> torch.Tensor:
    """P = exp((S - m) - log l), rebuilt in place in ``s`` from saved row statistics.

    s: [..., Nq, Nk] masked scores, computed exactly as in forward (so S - m
    is exact near the max); stats: [..., Nq, 2] -> P in the storage of s.
    """
    m, log_l = stats[..., 0:1], stats[..., 1:2]
    # (S - m) * log2(e) - log l * log2(e) as one add: -log2(l) + log2(e) * (S - m)
    return torch.add(log_l * -LOG2E, s.sub_(m), alpha=LOG2E, out=s).exp2_()


def softmax_backward_(p: torch.Tensor, dp: torch.Tensor) -> torch.Tensor:
    """In-place `softmax_backward`: overwrites ``dp`` with dS and returns it.

    Used by the strategies on buffers they own; it avoids a second [Nq, Nk]
    allocation:  dp <- P * dP;  dp <- dp - P * rowsum(dp).
    """
    pdp = dp.mul_(p)  # P * dP
    rowsum = pdp.sum(dim=-1, keepdim=True)  # [..., Nq, 1]
    return pdp.addcmul_(p, rowsum, value=-1.0)


def join_lse_cotangent_(delta: torch.Tensor, dlse: torch.Tensor | None) -> torch.Tensor:
    """Delta - dlse in place: with lse = m + log l (d lse / dS = P), lse's cotangent
    enters dS = P * (dP - Delta + dlse) through Delta.  delta, dlse: [..., Nq]."""
    if dlse is not None:
        delta -= dlse.to(delta.dtype)
    return delta


def delta(
    dout: torch.Tensor, o: torch.Tensor, dlse: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """Delta = rowsum(dO * O) - dlse in ``dtype``: dout, o: [..., Nq, dv] -> [..., Nq].

    rowsum(dO * O) == rowsum(P * dP), so the tiled backward needs no pass over
    P for it; one batched dot per row, no [..., Nq, dv] product is formed.
    """
    rows = torch.einsum("...nd,...nd->...n", dout.to(dtype), o.to(dtype))
    return join_lse_cotangent_(rows, dlse)


def softmax_backward(p: torch.Tensor, dp: torch.Tensor) -> torch.Tensor:
    """Backward of `softmax` along the last dim: dS = P * (dP - rowsum(P * dP)).

    p, dp: [..., Nq, Nk] -> dS: same shape.  Each row of dS sums to zero: the
    row-sum term removes the component along the normalisation direction.
    """
    return softmax_backward_(p, dp.clone())


def attend(p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """O = P @ v.   p: [..., Nq, Nk], v: [..., Nk, dv] -> O: [..., Nq, dv]."""
    return torch.matmul(p, v)


def value_gradient(p: torch.Tensor, dout: torch.Tensor) -> torch.Tensor:
    """Backward of `attend` for v: dV = P^T @ dO.

    p: [..., Nq, Nk], dout: [..., Nq, dv] -> dV: [..., Nk, dv].
    """
    return torch.matmul(p.transpose(-2, -1), dout)


def probability_gradient(dout: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Backward of `attend` for P: dP = dO @ v^T.

    dout: [..., Nq, dv], v: [..., Nk, dv] -> dP: [..., Nq, Nk].
    """
    return torch.matmul(dout, v.transpose(-2, -1))
