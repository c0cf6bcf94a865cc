r"""What rounding can do to each result of attention: the numbers the error rule's bound is made of.

`magnitudes` takes a call apart in float64 -- its scores, probabilities and
gradients, through the steps of `attngrad.verify.formula` -- and returns, for
out, dq, dk, dv (dmask, dsinks) and lse, four bounds per element
(`Magnitudes`; the derivation is `magnitudes`' docstring):

* A_x, the magnitude: the last step that forms x on absolute values, what
  the order of a sum can cost;
* C_x, the sensitivity: what a perturbation of every score moves x by (its
  core, how far P moves, is `_probability_move`: "the P move");
* R_x, the readback: what Delta = rowsum(dO o O) costs when O is read back
  as the kernel stored it;
* K_x, the kept bound: what P and dS kept in the 16-bit dtype for the
  products cost.

`flex_magnitudes` does the same for a FlexAttention call: its score function
in the cap's place (its slope, curvature and roundings from
`attngrad.verify.score_rounding`), its BlockMask in the mask's, and one
more result, dtheta, the gradient of the tensor the score function reads.

`attngrad.verify.rule` turns them into the rule's floor and kept bound.
The words (magnitude, sensitivity, readback, kept, the P move, floor) are
defined once in the glossary, docs/glossary.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from attngrad.verify.flex_reference import block_keep
from attngrad.verify.formula import (
    Band,
    Window,
    cap,
    dropped,
    expand_kv,
    masked_scores,
    raw_scores,
    row_softmax,
    score_scale,
    with_sinks,
)
from attngrad.verify.score_rounding import ScoreAnalysis, analyse

__all__ = ["LAMBDA", "Magnitudes", "flex_magnitudes", "magnitudes"]

# lambda of the probabilistic bound of a sum of n rounded terms (Higham and Mary, SIAM J. Sci.
# Comput. 41(5), 2019): |error| <= lambda sqrt(n) u max-term-scale, with probability at least
# 1 - 2 exp(-lambda^2 / 2) = 1 - 3e-8 per sum (`attngrad.verify.rule` explains the rule it serves)
LAMBDA = 6.0


@dataclass(frozen=True)
class _Scores:
    """The forward pieces `magnitudes` bounds from, float64 [..., Hq, Nq, Nk] (p_sink: [..., Hq, Nq]).

    x: the raw scores s q k^T; slope: d T / d X (1 without a softcap or score
    function; signed); keep: the kept entries; p: the sink-normalised softmax;
    p_sink: the sink's share of each row (0 without sinks); c_cap: the bound on
    T's perturbation from the product and the cap (or score function), c_s:
    with the bias add, 0 where not kept; bend: the bound on the slope's move,
    per unit of the score error (0 where T = X).
    """

    x: torch.Tensor
    slope: torch.Tensor
    keep: torch.Tensor
    p: torch.Tensor
    p_sink: torch.Tensor
    c_cap: torch.Tensor
    c_s: torch.Tensor
    bend: torch.Tensor

    @staticmethod
    def of(
        q: torch.Tensor,
        ke: torch.Tensor,
        s: float,
        mask: torch.Tensor | None,
        band: Band,
        softcap: float | None,
        sinks: torch.Tensor | None,
        score_error: float,
    ) -> _Scores:
        """From float64 q [..., Hq, Nq, d], k per query head, and the call's options."""
        x = raw_scores(q, ke, s)
        t = cap(x, softcap)
        scores, keep = masked_scores(t, mask, band)
        p_all = row_softmax(with_sinks(scores, sinks))
        p, p_sink = p_all[..., : x.shape[-1]], p_all[..., x.shape[-1] :].sum(-1)
        slope = torch.ones_like(x) if softcap is None else 1 - torch.tanh(x / softcap) ** 2
        c_cap = slope * abs(s) * (q.abs() @ ke.abs().transpose(-2, -1))
        if softcap is not None:
            c_cap = c_cap + slope * x.abs() + 2 * t.abs()
        c_cap = c_cap.masked_fill(~keep, 0.0)
        c_s = c_cap
        if mask is not None and mask.dtype != torch.bool:
            c_s = c_s + torch.minimum(scores.abs(), t.abs() / score_error).masked_fill(~keep, 0.0)
        bend = torch.zeros_like(x)
        if softcap is not None:  # the slope 1 - tanh^2 moves with T: by 2 |tanh| C_T / c
            bend = 2 * torch.tanh(x / softcap).abs() * c_cap / softcap
        return _Scores(x, slope, keep, p, p_sink, c_cap, c_s, bend)

    @staticmethod
    def flex(
        q: torch.Tensor, ke: torch.Tensor, s: float, f: ScoreAnalysis | None, keep: torch.Tensor
    ) -> _Scores:
        """From float64 q [B, Hq, Nq, d], k per query head, a score function's analysis on
        X = s q k^T (None: T = X) and the BlockMask's keep [B, Hq, Nq, Nk] (`flex_magnitudes`)."""
        x = raw_scores(q, ke, s)
        c_x = abs(s) * (q.abs() @ ke.abs().transpose(-2, -1))
        if f is None:
            t, slope, c_cap, bend = x, torch.ones_like(x), c_x, torch.zeros_like(x)
        else:
            t, slope = f.value, f.slope
            c_cap = slope.abs() * c_x + f.rounding
            bend = f.curvature * c_x + f.slope_rounding
        keep = keep & (t != float("-inf"))
        p = row_softmax(t.masked_fill(~keep, float("-inf")))
        # where a score is dropped nothing of f reaches a result (and f may be anything there)
        slope, c_cap, bend = (torch.where(keep, y, 0.0) for y in (slope, c_cap, bend))
        none = torch.zeros_like(p[..., 0])
        return _Scores(x, slope, keep, p, none, c_cap, c_cap, bend)


class Magnitudes(NamedTuple):
    """What the error rule's floor is made of (`magnitudes`), each a dict of float64
    tensors shaped like out, dq, dk, dv (dmask, dsinks).

    magnitude: A_x; sensitivity: C_x, per unit of ``score_error``; readback:
    R_x and kept: K_x, per unit roundoff of the dtype O, P and dS are kept in;
    lse: rowsum(P o C_S) [..., Hq, Nq], how far each row's lse moves per unit
    of ``score_error`` (d lse / d S = P), 0 on a dead row.
    """

    magnitude: dict[str, torch.Tensor]
    sensitivity: dict[str, torch.Tensor]
    readback: dict[str, torch.Tensor]
    kept: dict[str, torch.Tensor]
    lse: torch.Tensor


@dataclass(frozen=True)
class _Path:
    """One of the two (A or C) bounds on the pieces the results are made of, float64.

    p: the bound on P [..., Hq, Nq, Nk]; ds: on dS; dx: on dX = slope o dS;
    dsink: on d sigma per row [..., Hq, Nq].
    """

    p: torch.Tensor
    ds: torch.Tensor
    dx: torch.Tensor
    dsink: torch.Tensor


def _magnitude_path(f: _Scores, a_dp: torch.Tensor) -> _Path:
    """A: P, A_dS = P o (A_dP + A_Dlt / (1 - p_sink)), slope o A_dS and p_sink A_Dlt (`magnitudes`)."""
    a_dlt = (f.p * a_dp).sum(-1)
    # attngrad merges a sink after the keys' own softmax (`attngrad.core.sinks`): its Delta and the
    # merge's lse gradient are each rowsum(P_keys o A_dP), P_keys = P / (1 - p_sink), and cancel
    # to the sink-normalised Delta; a row that is all sink (P = 0) contributes nothing
    keys = f.p.sum(-1)  # 1 - p_sink, without its cancellation when the sink takes the row
    a_row = torch.where(keys > 0, a_dlt / keys.clamp(min=torch.finfo(keys.dtype).tiny), 0.0)
    a_ds = f.p * (a_dp + a_row.unsqueeze(-1))
    return _Path(f.p, a_ds, f.slope.abs() * a_ds, f.p_sink * a_dlt)


def _probability_move(
    p: torch.Tensor, p_sink: torch.Tensor, c_s: torch.Tensor, u: float
) -> torch.Tensor:
    """C_P: how far P can move, over u, when each score moves by at most u C_S ("the P
    move" of the glossary, docs/glossary.md).

    A score moves P through its own exponential and through the row's sum, in
    the same direction: P_j' = P_j exp(d_j) / (P_j exp(d_j) + p_sink + sum_{i != j}
    P_i exp(d_i)) with |d_i| <= a_i = u C_S_i (the sink's logit is exact).  With
    O_j = p_sink + sum_{i != j} P_i (the rest of the row), P_j' is largest with
    d_j = a_j and every other d_i = -a_i, a rise of

        P_j (L_j + S_j (1 - exp(-a_j))) / (P_j + S_j exp(-a_j)),
        S_j = p_sink + sum_{i != j} P_i exp(-a_i),  L_j = O_j - S_j = sum_{i != j} P_i (1 - exp(-a_i))

    and smallest the other way round, a fall of

        P_j (H_j + O_j (1 - exp(-a_j))) / (P_j exp(-a_j) + O_j + H_j),  H_j = sum_{i != j} P_i expm1(a_i)

    (P_j when H_j is infinite: a score at finfo.min that may move by itself; 0
    for a P_j alone in its row).  Every sum leaves key j out by prefix and suffix
    sums, never by subtraction: a P_j of 1e-30 beside keys that move by units
    keeps its bound.  To first order both are P o ((1 - P) o C_S + rowsum(P o C_S)
    - P o C_S) u: a row whose P is one-hot does not move, as its one score
    appears above and below.  A kernel that recomputes its scores in backward
    must get them bit for bit (P rebuilt from other scores than the saved
    statistics' is not normalised: at |S| u ~ 1e-3 every P of the row moves).
    The exact form matters in a row's exponential tail when u C_S reaches a few
    units (scores of 1e4 and more in float32: P = exp(-54) moved by exp(6)), and
    the fall where a bias swamps the scores and the row's largest P drops to
    uniform.
    """
    a = u * c_s
    live = p > 0
    # expm1 throughout: no cancellation where u C_S is small; exp(-a) never overflows
    shrink, grow = -torch.expm1(-a), torch.where(live, p * torch.expm1(a), 0.0)
    decay = torch.exp(-a)
    sink = p_sink.unsqueeze(-1)
    others = sink + _others(p)  # O_j
    kept = sink + _others(p * decay)  # S_j
    rise = p * (_others(p * shrink) + kept * shrink) / (p + kept * decay)
    highs = _others(grow)  # H_j
    below = p * decay + others + highs
    fall = torch.where(below > 0, (highs + others * shrink) / below, 0.0)
    fall = torch.where(highs.isinf(), 1.0, fall)
    move = torch.maximum(rise.clamp(max=1 - p), (p * fall).clamp(max=p))
    return torch.where(live, move, 0.0) / u


def _others(x: torch.Tensor) -> torch.Tensor:
    """sum_{i != j} x_i along the last dim, for each j: the sums before j and after j added,
    never the row's sum minus x_j (which cancels where x_j dominates, and is inf - inf where
    x_j is infinite)."""
    zero = torch.zeros_like(x[..., :1])
    before = torch.cat((zero, x[..., :-1].cumsum(-1)), -1)
    after = torch.cat((x[..., 1:].flip(-1).cumsum(-1).flip(-1), zero), -1)
    return before + after


def _sensitivity_path(f: _Scores, dp: torch.Tensor, score_error: float) -> _Path:
    """C: C_P, C_dS, C_dX and C_dsink from the score perturbation C_S (`magnitudes`)."""
    p, c_s = f.p, f.c_s
    c_p = _probability_move(p, f.p_sink, c_s, score_error)
    delta = (p * dp).sum(-1, keepdim=True)
    # P's move, and Delta's through every P of the row (which dominates where dP = 0: a key
    # dropout removed, beside keys that underflow) times P as moved, P + e C_P <= 1
    # (`_probability_move` caps the rise at 1 - P): Delta' - Delta reaches dS through P'
    c_delta = (c_p * dp.abs()).sum(-1, keepdim=True)
    c_ds = c_p * ((dp - delta).abs() + (p * dp.abs()).sum(-1, keepdim=True))
    c_ds = c_ds + (p + score_error * c_p) * c_delta
    c_dx = f.slope.abs() * c_ds + f.bend * (p * (dp - delta)).abs()  # the slope moves too
    # d sigma = -p_sink Delta likewise: the share's move times Delta, Delta's times the share
    # as moved
    c_sink = f.p_sink * (p * c_s).sum(-1)
    moved_sink = (f.p_sink + score_error * c_sink).clamp(max=1.0)
    c_dsink = c_sink * delta.squeeze(-1).abs() + moved_sink * c_delta.squeeze(-1)
    return _Path(c_p, c_ds, c_dx, c_dsink)


def _sum_to_sinks(rows: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """A per-row quantity [..., Hq, Nq] summed over the rows each sink logit serves."""
    shape = (*sinks.shape, 1) if sinks.ndim == 1 else sinks.shape
    return rows.sum_to_size(shape).reshape(sinks.shape)


def magnitudes(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dout: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    window: Window = None,
    score_error: float = 2.0**-53,
    *,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    align: str = "top-left",
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    dropout_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> Magnitudes:
    r"""(A_x, C_x, R_x, K_x) for out, dq, dk, dv (dmask for a float mask, dsinks with sinks), float64,
    and lse's move (`Magnitudes`).

    The options as in `reference_attention`.  P below is the sink-normalised
    softmax and p_sink the sink's share of a row; W = Z / (1 - p) with
    dropout, else 1; slope = 1 - tanh^2(X / c) <= 1 with a softcap, else 1.

    A_x, the size of the last step that forms x, evaluated on absolute values
    (P >= 0 needs none):

        A_out = (P o W) |v|             A_dv = (P o W)^T |dO|
        A_dP  = W o |dO| |v|^T          A_Dlt = rowsum(P o A_dP)
        A_dS  = P o (A_dP + A_Dlt / (1 - p_sink))    (dS = P o (dP - Delta))
        A_dq  = s (slope o A_dS) |k|    A_dk = s (slope o A_dS)^T |q|
        A_dmask = A_dS, summed over the dims the mask broadcasts
        A_dsinks = p_sink A_Dlt, summed over the rows each sink serves

    (The 1 / (1 - p_sink) is attngrad's: it merges a sink after the keys'
    own softmax, `attngrad.core.sinks`, so its Delta and the merge's lse gradient
    are each formed at the keys' normalisation and cancel to the sink's; a
    fused kernel that folds the sink into the row statistics would not need it.)

    C_x, what the rounding of the scores does to x, per unit of
    ``score_error`` (e: each score may be off by e C_S): a perturbation of
    each score by at most e C_S, C_S = C_T + min(|S|, |T| / e) (the bias
    add, which can lose at most what it added), C_T = slope o s |q| |k|^T
    (the product, through the cap) + slope o |X| + 2 |T| (the cap's three
    roundings, T = c tanh(X / c)), moves P by at most e C_P, C_P = P o ((1 - P)
    o C_S + rowsum(P o C_S) - P o C_S) (each score moves its P and the row's
    sum alike; the sinks' logits are exact; to first order:
    `_probability_move` keeps the exponential, capped at P and 1 - P, for far
    tails that e C_S moves by units), and so

        C_out = (C_P o W) |v|    C_dv = (C_P o W)^T |dO|     (dP = W o dO v^T)
        C_dS  = C_P o (|dP - Dlt| + rowsum(P o |dP|)) + (P + e C_P) o rowsum(C_P o |dP|)
        C_dX  = slope o C_dS + 2 |tanh(X / c)| o C_T / c o |dS|   (the slope moves too)
        C_dq  = s C_dX |k|       C_dk = s C_dX^T |q|      C_dmask = C_dS, summed like the mask
        C_dsinks = p_sink rowsum(P o C_S) |Dlt| + p_sink' rowsum(C_P o |dP|), summed like
                   the sinks, p_sink' = min(1, p_sink (1 + e rowsum(P o C_S)))

    dS = P o (dP - Delta) is a product of two quantities the scores move:
    dS' - dS = (P' - P) o (dP - Delta) - P' o (Delta' - Delta), so Delta's move
    reaches dS through P as moved, P' <= P + e C_P, not through P (the same
    for the sink's share, d sigma = -p_sink Delta).  The difference is second
    order where P barely moves; where a bias swamps the scores and P moves by
    as much as P itself (to uniform, in float32 beside -1e9), it is the bound:
    a key dropout removed (dP = 0) has dS = -P' Delta', all of it Delta's move.

    R_x, what Delta = rowsum(dO o O) does to x when it is formed from O as
    the kernel gave it, per unit u of the dtype O is kept in: O is off by at
    most u (|O| + K_out) (its storage and a kept P, below), element by
    element, so each row's Delta moves by at most E = RSS(|dO| o (|O| +
    K_out)) (the same for every key of the row; RSS as for K below), and

        R_dS = P o E     R_dq = s E o |(slope o P) k|   (exact: one move per row)
        R_dk = s RSS over rows and O's elements of (slope o P)^T (dO o (|O| + K_out) o q)
        R_dmask = R_dS, summed like the mask
        R_dsinks = p_sink E, summed like the sinks         R_out = R_dv = 0

    K_x, what the sums that take P or dS as kept in the dtype (a fused
    kernel's 16-bit products) do to x, per unit u: each term moves by its own
    rounding, so the sum by at most u sum|terms|, and by at most LAMBDA u
    sqrt(sum terms^2) with the probability of the rule's sums (`LAMBDA`); K_x
    is the smaller (written RSS below, `_rounded_terms`).  Each is rounded once,
    as a fused kernel does: P kept for P v and P^T dO, dS formed from P in the
    compute dtype and kept for dS k and dS^T q (or, unfused, from a kept P):

        K_out = RSS((P o W) v)     K_dv = RSS((P o W)^T dO)     (dX = slope o dS)
        K_dq  = s RSS(dX k)        K_dk = s RSS(dX^T q)         K_dsinks = 0
        K_dmask = RSS of dS, summed like the mask

    With sinks merged after a 16-bit output, O is stored once more (K_out + |O|)
    and dO comes back rounded: 2 K_dv, and dP = dO v^T with it, so dS moves by
    up to u A_dS (K_dq + A_dq, K_dk + A_dk, K_dmask + A_dmask).

    Masked entries and dead rows contribute nothing (P = 0 there).  With GQA,
    dk and dv terms are summed over each kv head's query heads like dk and dv.
    """
    s = score_scale(query, scale)
    q, k, v, do = (t.double() for t in (query, key, value, dout))
    mask = attn_mask if attn_mask is None or attn_mask.dtype == torch.bool else attn_mask.double()
    sigma = None if sinks is None else sinks.double()
    ke, ve = expand_kv(q, k, v, enable_gqa)
    band = Band(is_causal, window, align, cu_seqlens_q, cu_seqlens_k)
    f = _Scores.of(q, ke, s, mask, band, softcap, sigma, score_error)
    w = dropped(torch.ones_like(f.p), dropout_mask, dropout_p)
    x = _Operands(q, k, ke, ve, do, w, abs(s), mask, sigma)
    return _bounds(f, x, score_error)[0]


def _bounds(f: _Scores, x: _Operands, score_error: float) -> tuple[Magnitudes, _Path, _Path]:
    """`magnitudes` from the scores' pieces and the operands, and the two paths it took."""
    dp = x.w * (x.do @ x.ve.transpose(-2, -1))
    a_dp = x.w * (x.do.abs() @ x.ve.abs().transpose(-2, -1))
    paths = (_magnitude_path(f, a_dp), _sensitivity_path(f, dp, score_error))
    a, c = (_results(path, x) for path in paths)
    kept = _kept(f, dp, a, x)
    moved = Magnitudes(a, c, _readback(f, kept["out"], x), kept, (f.p * f.c_s).sum(-1))
    return moved, *paths


@dataclass(frozen=True)
class _Operands:
    """What every bound of `magnitudes` is built from, float64.

    q: [..., Hq, Nq, d], k: [..., Hkv, Nk, d] (ke, ve: per query head), do: dO,
    w: the dropout's factors, like P; s: |scale|; mask and sinks as given (None
    without).
    """

    q: torch.Tensor
    k: torch.Tensor
    ke: torch.Tensor
    ve: torch.Tensor
    do: torch.Tensor
    w: torch.Tensor
    s: float
    mask: torch.Tensor | None
    sinks: torch.Tensor | None

    @property
    def float_mask(self) -> bool:
        """A float mask, whose gradient dmask is bounded too."""
        return self.mask is not None and self.mask.dtype != torch.bool


def _group_sum(t: torch.Tensor, k: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """A per-query-head [..., Hq, n, x] tensor summed over each kv head's query heads (GQA;
    q: [..., Hq, Nq, d], k: [..., Hkv, Nk, d]; as it is without GQA or heads)."""
    if q.ndim < 3 or q.shape[-3] == k.shape[-3]:
        return t
    groups = q.shape[-3] // k.shape[-3]
    return t.reshape(*t.shape[:-3], k.shape[-3], groups, *t.shape[-2:]).sum(-3)


def _rounded_terms(
    a: torch.Tensor, b: torch.Tensor, k: torch.Tensor | None = None, q: torch.Tensor | None = None
) -> torch.Tensor:
    """A bound on sum_j a_ij x_jc where each |x_jc| <= b_jc moves independently: the worst
    case |a| |b|, or LAMBDA times the root-sum-square sqrt(a^2 b^2) where that is smaller
    (sums of more than LAMBDA^2 comparable terms).

    a: [..., m, n], b: [..., n, x] -> [..., m, x]; with k and q given, the per-query-head
    result is summed over each kv head's query heads (GQA) before the root.
    """
    a, b = a.abs(), b.abs()
    worst, squares = a @ b, a**2 @ b**2
    if k is not None and q is not None:
        worst, squares = _group_sum(worst, k, q), _group_sum(squares, k, q)
    return _smaller(worst, squares)


def _smaller(worst: torch.Tensor, squares: torch.Tensor) -> torch.Tensor:
    """The bound on a sum of independently moving terms: the worst case (the sum of their
    bounds) or LAMBDA times the root of the sum of their squares, whichever is smaller."""
    return torch.minimum(worst, LAMBDA * squares.sqrt())


def _kept(
    f: _Scores, dp: torch.Tensor, a: dict[str, torch.Tensor], x: _Operands
) -> dict[str, torch.Tensor]:
    """K_x: the root-sum-square of the terms that sum P or dS kept in the dtype into x (`magnitudes`).

    dp: W o dO v^T, signed; a: the A_x.  With sinks, one more rounding of O and
    of dO (the merge's).
    """
    pw = f.p * x.w
    ds = f.p * (dp - (f.p * dp).sum(-1, keepdim=True))
    dx = f.slope * ds
    part = {
        "out": _rounded_terms(pw, x.ve),
        "dq": x.s * _rounded_terms(dx, x.ke),
        "dk": x.s * _rounded_terms(dx.transpose(-2, -1), x.q, x.k, x.q),
        "dv": _rounded_terms(pw.transpose(-2, -1), x.do, x.k, x.q),
    }
    if x.float_mask:
        shape = x.mask.shape  # type: ignore[union-attr]
        part["dmask"] = _smaller(ds.abs().sum_to_size(shape), (ds**2).sum_to_size(shape))
    if x.sinks is not None:
        # a sink merged after the keys' 16-bit output (as attngrad does, `attngrad.core.sinks`)
        # stores O once more and hands back dO' = dO w rounded: each term of dv moves twice,
        # and dP = dO' v^T moves dS by up to u A_dS
        part["out"] = part["out"] + (pw @ x.ve).abs()
        part["dv"] = 2 * part["dv"]
        for name in ("dq", "dk", "dmask"):
            if name in part:
                part[name] = part[name] + a[name]
        part["dsinks"] = torch.zeros_like(x.sinks)  # d sigma = -p_sink Delta: no kept product
    return part


def _readback(f: _Scores, k_out: torch.Tensor, x: _Operands) -> dict[str, torch.Tensor]:
    """R_x: what Delta = rowsum(dO o O) formed from O as stored in the dtype does to x (`magnitudes`).

    k_out: K_out, O's error from a kept P.  O_ic moves by at most |O_ic| + K_out_ic per unit u,
    each element on its own, so each row's Delta by at most E: the worst case
    rowsum(|dO| o (|O| + K_out)), or LAMBDA times its root-sum-square where
    smaller.  Delta's move is the same for every key of its row, so dS moves
    by P o E and dq by s E |(slope o P) k| exactly; dk sums the moves of every
    (row, O element) behind it (`_rounded_terms`, over rows and elements).
    """
    o = (f.p * x.w) @ x.ve
    e, squares = _delta_move(f, k_out, x)
    px = f.slope * f.p
    pt = x.s * px.abs().transpose(-2, -1)
    q, k = x.q, x.k
    dk = _smaller(_group_sum(pt @ (e * q.abs()), k, q), _group_sum(pt**2 @ (squares * q**2), k, q))
    part = {
        "out": torch.zeros_like(o),
        "dq": x.s * e * (px @ x.ke).abs(),
        "dk": dk,
        "dv": torch.zeros(*k.shape[:-1], x.ve.shape[-1], dtype=o.dtype, device=o.device),
    }
    if x.float_mask:
        part["dmask"] = (f.p * e).sum_to_size(x.mask.shape)  # type: ignore[union-attr]
    if x.sinks is not None:
        part["dsinks"] = _sum_to_sinks(f.p_sink * e.squeeze(-1), x.sinks)
    return part


def _delta_move(f: _Scores, k_out: torch.Tensor, x: _Operands) -> tuple[torch.Tensor, torch.Tensor]:
    """(E, the sum of squares under its root): the bound on each row's move of Delta when O is
    read back as stored, [..., Hq, Nq, 1] (`_readback`)."""
    o = (f.p * x.w) @ x.ve
    moves = x.do.abs() * (o.abs() + k_out)  # what each O element's move does to Delta
    squares = (moves**2).sum(-1, keepdim=True)
    return _smaller(moves.sum(-1, keepdim=True), squares), squares


def _results(path: _Path, x: _Operands) -> dict[str, torch.Tensor]:
    """One path's bound on each result from its P, dS, dX and d sigma bounds (`magnitudes`);
    dk and dv summed over each kv head's group."""
    pw = path.p * x.w
    part = {
        "out": pw @ x.ve.abs(),
        "dq": x.s * (path.dx @ x.ke.abs()),
        "dk": x.s * (path.dx.transpose(-2, -1) @ x.q.abs()),
        "dv": pw.transpose(-2, -1) @ x.do.abs(),
    }
    part["dk"], part["dv"] = (_group_sum(part[n], x.k, x.q) for n in ("dk", "dv"))
    if x.float_mask:
        part["dmask"] = path.ds.sum_to_size(x.mask.shape)  # type: ignore[union-attr]
    if x.sinks is not None:
        part["dsinks"] = _sum_to_sinks(path.dsink, x.sinks)
    return part


def flex_magnitudes(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dout: torch.Tensor,
    score: Callable[[torch.Tensor | None], Callable[..., torch.Tensor]] | None = None,
    theta: torch.Tensor | None = None,
    block_mask: object = None,
    scale: float | None = None,
    enable_gqa: bool = False,
    score_error: float = 2.0**-53,
) -> tuple[Magnitudes, int]:
    r"""`magnitudes` of a FlexAttention call, with dtheta; and the longest sum into dtheta.

    query: [B, Hq, Nq, d], key, value: [B, Hkv, Nk, d|dv], dout like the output;
    score: builds the score_mod from theta
    (`attngrad.verify.flex_cases.FlexScenario.score`; None: none); block_mask:
    torch's BlockMask (None: every score kept).  The int is the most scores
    any one element of theta collects (0 without theta): the rule's n for dtheta.

    The score function f takes the cap's place in `magnitudes`' bounds, from its
    analysis on X = s q k^T (`attngrad.verify.score_rounding.analyse`): the slope
    is f'(X) (|f'| where a magnitude is meant), the scores' perturbation

        C_T = |f'| C_X + C_f          (C_X = s |q| |k|^T: the product, through f)

    with C_f f's own roundings (per unit roundoff of the compute dtype; counted
    here per unit of the score error e, which is larger, as the cap's
    roundings are), and the slope's move in the cap's bend

        |f''| C_X + C_f'              (C_f': the roundings' and autograd's on f')

    The BlockMask's keep takes the band's and bool mask's place; there is no
    float mask, sink or dropout.  With J = dT/dtheta [B, Hq, Nq, Nk, *theta]
    and dS = P o (dP - Delta) the gradient of T, dtheta = sum over the scores
    of dS J, so, summing over the scores:

        A_dtheta = sum |J dS| + sqrt(n_S / n) sum |J| A_dS
        C_dtheta = sum |J| C_dS + (|dJ/dX| C_X + C_J) |dS|
        K_dtheta = RSS of J dS (dS kept in the dtype once)
        R_dtheta = RSS over i, c of w_i dO_ic O_ic and over i, j of w_i P_ij dP_ij,
                   w_i = sum_j J_ij P_ij

    (C_J: J's roundings, from the same analysis.)  A, in units of the rule's
    LAMBDA sqrt(n) u_c (n at least n_theta and n_S, `attngrad.verify.rule.terms`):
    dtheta accumulates n_theta terms J dS (at most LAMBDA sqrt(n_theta) u_c sum |J dS|)
    of which each dS is off by its own sums of at most n_S = max(d, dv, Nk) terms
    (LAMBDA sqrt(n_S) u_c A_dS, as dq's A counts it).  R, from the roundings themselves
    rather than through E (`_readback`): Delta_i = sum_c dO_ic O_ic moves by the
    same delta_i for every key of row i, so dS by P delta_i and dtheta by w_i
    delta_i exactly; O_ic as stored is off by eps_ic O_ic (its storage) plus
    sum_j eta_ij P_ij v_jc (P kept in the dtype for P v), |eps|, |eta| <= u, so
    delta_i = sum_c eps_ic dO_ic O_ic + sum_j eta_ij P_ij dP_ij and dtheta moves
    by a sum of independent roundings: the worst case, or LAMBDA times its
    root-sum-square (`_smaller`).
    """
    s = score_scale(query, scale)
    q, k, v, do = (t.double() for t in (query, key, value, dout))
    ke, ve = expand_kv(q, k, v, enable_gqa)
    grid = (q.shape[0], q.shape[1], q.shape[2], k.shape[-2])
    if block_mask is None:
        keep = torch.ones(grid, dtype=torch.bool, device=q.device)
    else:
        keep = block_keep(block_mask, *grid).to(q.device)
    c_x = abs(s) * (q.abs() @ ke.abs().transpose(-2, -1))
    analysis = None if score is None else analyse(score, raw_scores(q, ke, s), theta)
    f = _Scores.flex(q, ke, s, analysis, keep)
    x = _Operands(q, k, ke, ve, do, torch.ones_like(f.p), abs(s), None, None)
    moved, a_path, c_path = _bounds(f, x, score_error)
    if analysis is None or analysis.jacobian is None:
        return moved, 0
    extra = analysis.jacobian.ndim - 4  # theta's dims

    def per_score(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(*t.shape, *(1,) * extra)

    live = per_score(f.keep)
    signed = torch.where(live, analysis.jacobian, 0.0)
    j = signed.abs()
    assert analysis.jacobian_slope is not None and analysis.jacobian_rounding is not None
    j_move = analysis.jacobian_slope.abs() * per_score(c_x) + analysis.jacobian_rounding
    j_move = torch.where(live, j_move, 0.0)
    dp = do @ ve.transpose(-2, -1)
    ds = f.p * (dp - (f.p * dp).sum(-1, keepdim=True))

    def collect(jac: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return (jac * per_score(t)).sum(dim=(0, 1, 2, 3))

    terms = int((j > 0).sum(dim=(0, 1, 2, 3)).max()) if j.numel() else 0
    inner = max(q.shape[-1], ve.shape[-1], grid[-1])  # the sums that form each dS
    longest = max(terms, inner)
    moved.magnitude["dtheta"] = collect(j, ds.abs()) + math.sqrt(inner / longest) * collect(
        j, a_path.ds
    )
    moved.sensitivity["dtheta"] = collect(j, c_path.ds) + collect(j_move, ds.abs())
    # Delta's move is the same for every key of its row: dtheta moves by it times
    # w = sum_j J P, and Delta by the roundings of O's storage and of P kept for P v
    w = (signed * per_score(f.p)).sum(dim=3)  # [B, Hq, Nq, *theta]
    o_terms, p_terms = do * (f.p @ ve), f.p * dp  # dO o O [.., Nq, dv], P o dP [.., Nq, Nk]
    worst = o_terms.abs().sum(-1) + p_terms.abs().sum(-1)  # [B, Hq, Nq]
    squares = (o_terms**2).sum(-1) + (p_terms**2).sum(-1)
    moved.readback["dtheta"] = _smaller(
        (per_score(worst) * w.abs()).sum(dim=(0, 1, 2)),
        (per_score(squares) * w**2).sum(dim=(0, 1, 2)),
    )
    moved.kept["dtheta"] = _smaller(collect(j, ds.abs()), collect(j**2, ds**2))
    return moved, terms
