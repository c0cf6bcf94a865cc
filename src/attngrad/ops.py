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

The flash strategy keeps scores in base 2 — S2 = S * log2(e), with log2(e)
folded into q's scale and the bias — because exp2 runs about 3x faster than
exp on CPU and exp(S - lse) == exp2(S2 - lse * log2(e)).  Forward and backward
must then both use base 2: P rebuilt from an lse of the other base differs by
the rounding of S * log2(e), which float32 gradients notice.
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
    "lse_shift",
    "probabilities",
    "probability_gradient",
    "query_key_gradients",
    "scores",
    "softmax",
    "softmax_backward",
    "softmax_backward_",
    "softmax_lse",
    "value_gradient",
]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the strategies compute in: float64 for float64 inputs, else float32.

    16-bit inputs are upcast tile by tile (scores, softmax and accumulators in
    float32, like the fused GPU kernels); results are cast back to the input
    dtype, and saved tensors keep it (lse stays float32).
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


def softmax(s: torch.Tensor, dead_rows: torch.Tensor | None = None) -> torch.Tensor:
    """P = softmax(S, dim=-1), with rows that attend nothing set to zero.

    s: [..., Nq, Nk] -> P: same shape.  ``dead_rows`` ([..., Nq], bool,
    broadcastable against the rows of ``s``) marks rows whose every score is
    -inf; plain softmax would give NaN there (0/0), the attention convention
    is P = 0 so that O = 0 and every gradient is zero.
    """
    p = torch.softmax(s, dim=-1)
    if dead_rows is not None and bool(dead_rows.any()):
        p.masked_fill_(dead_rows.unsqueeze(-1), 0.0)
    return p


def softmax_lse(
    s: torch.Tensor, dead_rows: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """P = `softmax` (S) and lse = logsumexp(S, dim=-1): [..., Nq, Nk] -> (P, [..., Nq]).

    lse comes from P's largest entry: P_max = exp(m - lse) with m = max_j S,
    so lse = m - log(P_max).  P_max >= 1/Nk keeps full relative precision and
    it costs two row reductions instead of a second exp pass.  A dead row has
    lse = -inf.
    """
    if s.shape[-1] == 0:  # no keys: every row is dead
        return torch.softmax(s, dim=-1), s.new_full(s.shape[:-1], float("-inf"))
    m = s.amax(dim=-1)
    p = softmax(s, dead_rows)
    p_max = p.amax(dim=-1)
    lse = torch.where(p_max > 0, m - torch.log(p_max), float("-inf"))
    return p, lse


def lse_shift(lse: torch.Tensor, unit: float = 1.0) -> torch.Tensor:
    """lse * unit as the row shift that rebuilds P: [..., Nq] -> [..., Nq, 1].

    ``unit`` is 1 for natural-base scores, LOG2E for base-2 ones.  A dead row
    (lse = -inf) gets +inf, so that its P is exp(-inf) = 0, not NaN.
    """
    return torch.where(lse == float("-inf"), float("inf"), lse * unit).unsqueeze(-1)


def probabilities(s: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """P = exp(S - lse), rebuilt in place in ``s`` from the saved lse.

    s: [..., Nq, Nk] masked scores, computed exactly as in forward;
    lse: [..., Nq] -> P in the storage of s.
    """
    # exp(x) as exp2(x * log2 e), x = S - lse formed first: the extra rounding
    # is relative to |x|, small wherever P is not, and exp2 is ~3x faster on CPU
    return s.sub_(lse_shift(lse)).mul_(LOG2E).exp2_()


def softmax_backward_(p: torch.Tensor, dp: torch.Tensor) -> torch.Tensor:
    """In-place `softmax_backward`: overwrites ``dp`` with dS and returns it.

    Used by the strategies on buffers they own; it avoids a second [Nq, Nk]
    allocation:  dp <- P * dP;  dp <- dp - P * rowsum(dp).
    """
    pdp = dp.mul_(p)  # P * dP
    rowsum = pdp.sum(dim=-1, keepdim=True)  # [..., Nq, 1]
    return pdp.addcmul_(p, rowsum, value=-1.0)


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
