r"""The catalogue of known mistakes: for each stage, the wrong formulas learners write.

A wrong stage is diagnosed by running every known mistake of that stage on the
same probes (`attngrad.learn.engine`): a mistake explains the learner's numbers
when, on every probe, both raise or both give the same values (to float64
rounding), and on at least one probe both give values.  Each `Mistake` names
what went wrong and hints at the fix; `FALLBACK_HINTS` answer a failure no
mistake explains.

This module runs inside the child process that `attngrad.learn.grade` starts,
so it imports nothing but the standard library, torch and the child's other
modules (`attngrad.learn.grade.CHILD_MODULES`; importing the ``attngrad``
package costs seconds): the parent loads them by file path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from attngrad.learn.stages import FUNCTION_STAGES, Fn, Outputs, rowsum, transposed

__all__ = ["FALLBACK_HINTS", "MISTAKES", "Mistake"]


@dataclass(frozen=True)
class Mistake:
    id: str
    stage: str
    explanation: str
    hint: str
    fn: Callable[..., Outputs]


def _m(id: str, stage: str, explanation: str, hint: str) -> Callable[[Fn], Mistake]:
    def wrap(fn: Fn) -> Mistake:
        return Mistake(id, stage, explanation, hint, fn)

    return wrap


V, P, S, QK = FUNCTION_STAGES

MISTAKES: tuple[Mistake, ...] = (
    _m(
        "value-missing-transpose",
        V,
        "dV was computed as P·dO: P is used without its transpose",
        "O = P·V, so dV = Pᵀ·dO; transpose the last two dims of p (p.transpose(-2, -1))",
    )(lambda p, do: (p @ do,)),
    _m(
        "value-swapped-operands",
        V,
        "dV was computed as dOᵀ·P, the transpose of the right answer",
        "put P first: dV = Pᵀ·dO has the shape of V, [B, Nk, d]",
    )(lambda p, do: (transposed(do) @ p,)),
    _m(
        "probability-missing-transpose",
        P,
        "dP was computed as dO·V: V is used without its transpose",
        "O = P·V, so dP = dO·Vᵀ; transpose the last two dims of v",
    )(lambda do, v: (do @ v,)),
    _m(
        "probability-swapped-operands",
        P,
        "dP was computed as V·dOᵀ, the transpose of the right answer",
        "put dO first: dP = dO·Vᵀ has the shape of P, [B, Nq, Nk]",
    )(lambda do, v: (v @ transposed(do),)),
    _m(
        "softmax-no-rowsum",
        S,
        "dS was computed as P∘dP: the row-sum term is missing",
        "subtract each row's weighted sum: dS = P∘(dP − rowsum(P∘dP))",
    )(lambda p, dp: (p * dp,)),
    _m(
        "softmax-rowsum-wrong-dim",
        S,
        "the weighted sum was taken over the query dim (dim=-2) instead of the key dim",
        "sum over the last dim: (p * dp).sum(dim=-1, keepdim=True)",
    )(lambda p, dp: (p * (dp - (p * dp).sum(dim=-2, keepdim=True)),)),
    _m(
        "softmax-keepdim-lost",
        S,
        "the row sum lost its last dim, so it broadcast along the wrong axis",
        "keep the summed dim: (p * dp).sum(dim=-1, keepdim=True) has shape [B, N, 1]",
    )(lambda p, dp: (p * (dp - (p * dp).sum(dim=-1)),)),
    _m(
        "softmax-missing-p",
        S,
        "dS was computed as dP − rowsum(P∘dP): the outer factor P is missing",
        "multiply by P at the end: dS = P∘(dP − rowsum(P∘dP))",
    )(lambda p, dp: (dp - rowsum(p * dp),)),
    _m(
        "softmax-sign",
        S,
        "dS has the wrong sign: P∘(rowsum(P∘dP) − dP)",
        "the row sum is subtracted from dP: dS = P∘(dP − rowsum(P∘dP))",
    )(lambda p, dp: (p * (rowsum(p * dp) - dp),)),
    _m(
        "softmax-sign",
        S,
        "the row sum was added instead of subtracted: P∘(dP + rowsum(P∘dP))",
        "the row sum is subtracted from dP: dS = P∘(dP − rowsum(P∘dP))",
    )(lambda p, dp: (p * (dp + rowsum(p * dp)),)),
    _m(
        "softmax-unweighted-rowsum",
        S,
        "the row sum is rowsum(dP), not the weighted rowsum(P∘dP)",
        "weight by the probabilities before summing: (p * dp).sum(dim=-1, keepdim=True)",
    )(lambda p, dp: (p * (dp - rowsum(dp)),)),
    _m(
        "qk-missing-scale",
        QK,
        "dQ and dK miss the scale factor 1/√d",
        "S = s·Q·Kᵀ, so both gradients carry s: dQ = s·dS·K, dK = s·dSᵀ·Q",
    )(lambda ds, q, k, s: (ds @ k, transposed(ds) @ q)),
    _m(
        "qk-missing-scale",
        QK,
        "dK misses the scale factor 1/√d (dQ has it)",
        "both branches carry the same scale: dK = s·dSᵀ·Q",
    )(lambda ds, q, k, s: (s * ds @ k, transposed(ds) @ q)),
    _m(
        "qk-missing-scale",
        QK,
        "dQ misses the scale factor 1/√d (dK has it)",
        "both branches carry the same scale: dQ = s·dS·K",
    )(lambda ds, q, k, s: (ds @ k, s * transposed(ds) @ q)),
    _m(
        "qk-wrong-scale",
        QK,
        "the scale was applied twice (s² = 1/d)",
        "multiply by scale once; it is already 1/√d",
    )(lambda ds, q, k, s: (s * s * ds @ k, s * s * transposed(ds) @ q)),
    _m(
        "qk-wrong-scale",
        QK,
        "the gradients were multiplied by √d instead of 1/√d",
        "scale is 1/√d: multiply by it, do not divide by it",
    )(lambda ds, q, k, s: (ds @ k / s, transposed(ds) @ q / s)),
    _m(
        "key-missing-transpose",
        QK,
        "dK was computed as s·dS·Q: dS is used without its transpose",
        "S = s·Q·Kᵀ, so dK = s·dSᵀ·Q; transpose ds before multiplying by q",
    )(lambda ds, q, k, s: (s * ds @ k, s * ds @ q)),
    _m(
        "query-extra-transpose",
        QK,
        "dQ was computed as s·dSᵀ·K: dS should not be transposed for the query",
        "dQ = s·dS·K uses dS as it is; only dK needs dSᵀ",
    )(lambda ds, q, k, s: (s * transposed(ds) @ k, s * transposed(ds) @ q)),
    _m(
        "qk-swapped",
        QK,
        "dQ and dK are exchanged: the function returned (dK, dQ)",
        "return (dq, dk) in that order: dq = s·dS·K (like q), dk = s·dSᵀ·Q (like k)",
    )(lambda ds, q, k, s: (s * transposed(ds) @ q, s * ds @ k)),
)

FALLBACK_HINTS = {
    "not-implemented": "replace the `raise NotImplementedError` with the formula in the docstring",
    "shape-mismatch": "compare the result's shape with the one in the docstring",
    "non-finite": "the result holds NaN or inf; look for a division or log",
    "wrong-dtype": "compute in the inputs' dtype (float64 here); do not cast",
    "wrong-values": "re-derive the formula step by step and compare with the docstring",
    "crashed": "run the function yourself on small [B, N, d] tensors and read the traceback",
    "timeout": "the function did not return in time; look for a loop that never ends",
}
