"""A slow interpreter of score programs on whole score matrices, in torch ops: what the
fused kernels' interpreter must give, for the programs' own tests."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from attngrad.core.score_program import Program

_BINARY = {
    "ADD": torch.add, "SUB": torch.sub, "MUL": torch.mul, "MIN": torch.minimum,
    "MAX": torch.maximum, "AND": torch.bitwise_and, "OR": torch.bitwise_or,
    "XOR": torch.bitwise_xor, "FLOORDIV": lambda a, b: torch.div(a, b, rounding_mode="floor"),
    "REMAINDER": torch.remainder, "LT": torch.lt, "LE": torch.le, "GT": torch.gt,
    "GE": torch.ge, "EQ": torch.eq, "NE": torch.ne,
}  # fmt: skip
_UNARY = {
    "NEG": torch.neg, "ABS": torch.abs, "EXP": torch.exp, "LOG": torch.log, "TANH": torch.tanh,
    "SIGMOID": torch.sigmoid, "SQRT": torch.sqrt, "FLOOR": torch.floor, "NOT": torch.bitwise_not,
}  # fmt: skip


def run(
    program: Program,
    scores: torch.Tensor,
    captured: Sequence[torch.Tensor],
    batch: int,
    grad: torch.Tensor | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(the program's result at every score of scores [B, H, Nq, Nk], the captures'
    scattered gradients)."""
    _B, _H, _Nq, _Nk = scores.shape
    dtype = scores.dtype
    axes = [torch.arange(n).view(*(1,) * a, n, *(1,) * (3 - a)) for a, n in enumerate(scores.shape)]
    loads = {
        "SCORE": scores, "GRAD": grad, "BATCH": axes[0] % batch, "HEAD": axes[1],
        "QUERY": axes[2], "KEY": axes[3],
    }  # fmt: skip
    reads = [t.to(dtype) if t.is_floating_point() else t.long() for t in captured]
    sums = [torch.zeros_like(t) for t in reads]
    r: dict[int, torch.Tensor] = {}
    for ins in program.instructions:
        name, _, kind = ins.op.rpartition("_")
        a = [r[x] for x in ins.args]
        if ins.op in loads:
            out = loads[ins.op]
        elif name == "CONST":
            out = torch.tensor(ins.imm, dtype=dtype if kind == "F" else torch.int64)
        elif name == "GATHER":
            t = reads[ins.capture]
            idx = [torch.broadcast_to(x, scores.shape) for x in a]
            out = t[tuple(idx)] if idx else t.expand(scores.shape)
        elif ins.op == "SCATTER":
            value, *idx = (torch.broadcast_to(x, scores.shape) for x in a)
            if idx:
                sums[ins.capture].index_put_(tuple(idx), value.to(dtype), accumulate=True)
            else:  # a 0-d capture
                sums[ins.capture] += value.sum()
            continue
        elif name == "WHERE":
            out = torch.where(a[0] != 0, a[1], a[2])
        elif ins.op == "TO_F":
            out = a[0].to(dtype)
        elif ins.op == "TO_I":
            out = a[0].long()
        elif name == "DIV":
            out = a[0] / a[1]
        elif name in _BINARY:
            out = _BINARY[name](a[0], a[1])
        else:
            out = _UNARY[name](a[0])
        if out.dtype == torch.bool or not out.is_floating_point():
            out = out.long()
        r[ins.dst] = out
    return torch.broadcast_to(r[program.out], scores.shape).clone(), sums
