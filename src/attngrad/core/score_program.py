r"""A score function as a straight-line program of row operations, with its pullback.

The fused kernels cannot call Python, so a ``score_mod`` they run is first traced
(``make_fx``, on one score with 4-d indices, so ``table[h, q_idx - kv_idx]`` is a gather
and not a Python integer) into a list of instructions, each one elementwise op on a row
of the tile: loads (the score, b, h, q_idx, kv_idx, constants, a captured tensor read at
indices computed from them), arithmetic, comparisons, ``where``, casts and the pointwise
functions of the ops' table below.  Every value is either F (the compute dtype) or I
(int64; bools as 0/1).  The kernels interpret the list per row of each tile while the
tile is in cache (``csrc/program.h``).

Its pullback is derived here, once, by reverse mode over the instructions: a second
program that reads the raw score S and the cotangent dS' of S' = f(S, theta) (``GRAD``),
recomputes what it needs of the forward values, and gives dS = dS' * df/dS, with
``SCATTER`` instructions adding (df/dtheta)^T dS' into each captured tensor's gradient at
the indices it was read at.  The derivative rules are torch's (``where`` routes to the
branch taken, ``clamp`` passes the gradient inside its bounds, ties of ``minimum`` and
``maximum`` split it in half).

A BlockMask's ``mask_mod(b, h, q_idx, kv_idx) -> bool`` compiles the same way
(`compile_mask`): the four indices are its loads, its result an I register (1 = the score
is kept), and it has no pullback.  The kernels run it on the partial blocks of the mask
alone, as torch's compiled kernel calls it.

A function with an op outside the table is not compiled: `compile_score` (`compile_mask`)
returns the reason, naming the op, and the call runs on the tensor-op tiles (a mask: as a
dense keep mask).  Programs are cached per function -- per code object where its closure
holds only scalars, tensors and None, so a closure made anew at each call is traced once
(`_owner`) -- compute dtype, captured shapes and the Python scalars its closure holds.
"""

from __future__ import annotations

import contextlib
import math
import types
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch._functorch.pyfunctorch import temporarily_clear_interpreter_stack
from torch.autograd import forward_ad
from torch.fx.experimental.proxy_tensor import make_fx

from attngrad.core.pointwise import INDEX, Reads

if TYPE_CHECKING:
    from attngrad.core.score_function import ScoreFunction

__all__ = [
    "Instruction",
    "MaskProgram",
    "Program",
    "ScoreProgram",
    "compile_mask",
    "compile_score",
    "encode",
    "program_of",
]

F, I = "F", "I"  # noqa: E741 -- the two kinds of value: compute dtype, int64

# opcode -> the kind it writes (None: writes nothing)
KINDS: dict[str, str | None] = {
    "SCORE": F, "GRAD": F, "BATCH": I, "HEAD": I, "QUERY": I, "KEY": I,
    "CONST_F": F, "CONST_I": I, "GATHER_F": F, "GATHER_I": I, "SCATTER": None,
    **dict.fromkeys(
        ["ADD_F", "SUB_F", "MUL_F", "DIV_F", "MIN_F", "MAX_F", "NEG_F", "ABS_F", "EXP_F", "LOG_F", "TANH_F", "SIGMOID_F", "SQRT_F", "FLOOR_F", "FLOORDIV_F", "REMAINDER_F", "WHERE_F", "TO_F"], F),
    **dict.fromkeys(
        ["LT_F", "LE_F", "GT_F", "GE_F", "EQ_F", "NE_F", "ADD_I", "SUB_I", "MUL_I", "MIN_I", "MAX_I", "AND_I", "OR_I", "XOR_I", "NEG_I", "ABS_I", "NOT_I", "FLOORDIV_I", "REMAINDER_I", "LT_I", "LE_I", "GT_I", "GE_I", "EQ_I", "NE_I", "WHERE_I", "TO_I"], I),
}  # fmt: skip
_VARYING = frozenset({"SCORE", "GRAD", "KEY"})  # loads that differ along a row


@dataclass(frozen=True)
class Instruction:
    """``op`` on the registers ``args`` (and ``imm``: a constant's value; a gather's or
    scatter's capture number), writing register ``dst`` (SSA: one writer each)."""

    op: str
    dst: int
    args: tuple[int, ...] = ()
    imm: float = 0.0
    capture: int = -1
    uniform: bool = True


@dataclass(frozen=True, eq=False)  # compared by identity: the ops' encoding is cached per program
class Program:
    """Instructions and the register holding the result (S' forward, dS backward)."""

    instructions: tuple[Instruction, ...]
    out: int


@dataclass(frozen=True)
class ScoreProgram:
    """A score function's forward program and pullback.

    made: tensors the function built itself (``torch.tensor(16.0)``), read by the programs
    as captures after the real ones (capture numbers len(captured) ..); wanted: the
    captures (by number) whose gradient the pullback scatters.
    """

    forward: Program
    pullback: Program
    made: tuple[torch.Tensor, ...]
    wanted: tuple[int, ...]


@dataclass(frozen=True)
class MaskProgram:
    """A mask function's program: ``program.out`` an I register, 1 where the score is kept.

    made: tensors the function built itself, read as captures after the real ones.
    """

    program: Program
    made: tuple[torch.Tensor, ...]


class Unsupported(Exception):
    """The function uses an op the kernels do not run (the message names it)."""


# -- building ---------------------------------------------------------------


class _Builder:
    """Emits instructions, numbering registers, folding repeated constants and loads."""

    def __init__(self) -> None:
        self.code: list[Instruction] = []
        self.kind: list[str] = []
        self.uniform: list[bool] = []
        self.rule: dict[int, str] = {}
        self._seen: dict[tuple[Any, ...], int] = {}

    def emit(
        self,
        op: str,
        *args: int,
        imm: float = 0.0,
        capture: int = -1,
        uniform: bool | None = None,
        rule: str = "",
    ) -> int:
        """Register of ``op`` on ``args`` (an earlier one's when it was emitted already).

        uniform: the value is the same along a row (default: from the arguments);
        rule: "clamp" marks a MIN/MAX of a clamp (`_pullback`'s derivative)."""
        key = (op, args, imm, capture, rule)
        if key in self._seen and op != "SCATTER":
            return self._seen[key]
        kind = KINDS[op]
        dst = len(self.kind)
        if uniform is None:
            uniform = op not in _VARYING and all(self.uniform[a] for a in args)
        self.code.append(Instruction(op, dst if kind else -1, args, imm, capture, uniform))
        self.kind.append(kind or F)
        self.uniform.append(uniform)
        self._seen[key] = dst
        if rule:
            self.rule[dst] = rule
        return dst

    def const(self, value: float, kind: str) -> int:
        return self.emit("CONST_F" if kind == F else "CONST_I", imm=float(value))

    def as_kind(self, x: int, kind: str) -> int:
        if self.kind[x] == kind:
            return x
        return self.emit("TO_F" if kind == F else "TO_I", x)

    def program(self, out: int) -> Program:
        """The instructions ``out`` and the scatters depend on, renumbered densely."""
        live = {out}
        keep: list[Instruction] = []
        for ins in reversed(self.code):
            if ins.op == "SCATTER" or ins.dst in live:
                keep.append(ins)
                live.update(ins.args)
        keep.reverse()
        number = {ins.dst: n for n, ins in enumerate(i for i in keep if i.dst >= 0)}
        args_of = {i.dst for i in keep if i.dst >= 0}
        assert all(a in args_of for i in keep for a in i.args)
        renamed = tuple(
            Instruction(
                i.op, number[i.dst] if i.dst >= 0 else -1, tuple(number[a] for a in i.args),
                i.imm, i.capture, i.uniform,
            )
            for i in keep
        )  # fmt: skip
        return Program(renamed, number[out])


# -- tracing: aten ops -> instructions ----------------------------------------

# aten op -> the stem of its F and I opcodes (``ADD`` -> ADD_F, ADD_I)
_BINARY = {
    "add": "ADD", "sub": "SUB", "mul": "MUL", "minimum": "MIN", "maximum": "MAX",
    "floor_divide": "FLOORDIV", "remainder": "REMAINDER",
}  # fmt: skip
_UNARY_F = {
    "neg": "NEG_F", "abs": "ABS_F", "exp": "EXP_F", "log": "LOG_F", "tanh": "TANH_F",
    "sigmoid": "SIGMOID_F", "sqrt": "SQRT_F", "floor": "FLOOR_F",
}  # fmt: skip
_COMPARE = {"lt": "LT", "le": "LE", "gt": "GT", "ge": "GE", "eq": "EQ", "ne": "NE"}
_LOGICAL = {
    "logical_and": "AND_I", "logical_or": "OR_I", "logical_xor": "XOR_I",
    "bitwise_and": "AND_I", "bitwise_or": "OR_I", "bitwise_xor": "XOR_I",
}  # fmt: skip
_SAME = frozenset(
    [
        "clone",
        "alias",
        "expand",
        "view",
        "reshape",
        "_unsafe_view",
        "unsqueeze",
        "squeeze",
        "lift_fresh_copy",
        "contiguous",
    ]
)
_FILLS = frozenset(
    [
        "new_ones",
        "new_zeros",
        "new_full",
        "full",
        "scalar_tensor",
        "ones_like",
        "zeros_like",
        "full_like",
    ]
)


def _kind_of(dtype: torch.dtype) -> str:
    return F if dtype.is_floating_point else I


class _Lowering:
    """One fx graph of a traced score function -> instructions (see `compile_score`)."""

    def __init__(self, captured: Sequence[torch.Tensor], gm: torch.fx.GraphModule) -> None:
        self.b = _Builder()
        self.captured = list(captured)
        self.made: list[torch.Tensor] = []
        self.gm = gm
        self.value: dict[torch.fx.Node, Any] = {}  # register, Python number or a view

    def capture_number(self, t: torch.Tensor) -> int:
        for n, c in enumerate(self.captured):
            if c is t:
                return n
        for n, c in enumerate(self.made):
            if c is t:
                return len(self.captured) + n
        self.made.append(t)
        return len(self.captured) + len(self.made) - 1

    def operand(self, x: Any, kind: str) -> int:
        """A register of ``kind`` for an fx argument (a node's register or a Python number)."""
        if isinstance(x, torch.fx.Node):
            v = self.value[x]
            if isinstance(v, _View):
                v = self.gather(v, [])
            return self.b.as_kind(v, kind)
        if isinstance(x, (bool, int, float)):
            return self.b.const(float(x), kind)
        raise Unsupported(f"an argument {x!r}")

    def kind(self, x: Any) -> str:
        if isinstance(x, torch.fx.Node):
            v = self.value[x]
            return self.b.kind[v] if isinstance(v, int) else _kind_of(v.tensor.dtype)
        return F if isinstance(x, float) else I

    def gather(self, view: _View, index: list[int]) -> int:
        t = view.tensor
        registers = [self.b.const(v, I) for v in view.prefix] + index
        if not index and t.numel() == 1:  # a one-element tensor used whole: broadcast
            registers = [self.b.const(0, I)] * t.dim()
        if len(registers) != t.dim():
            raise Unsupported(
                f"a captured tensor of shape {tuple(t.shape)} read at {len(registers)} indices "
                "(the kernels read one element per score: index every dim)"
            )
        op = "GATHER_F" if t.is_floating_point() else "GATHER_I"
        return self.b.emit(op, *registers, capture=view.capture)

    def run(self, placeholders: dict[str, str]) -> Any:
        """Lower every node; the graph's output argument (a node, or a Python number)."""
        out: Any = None
        for node in self.gm.graph.nodes:
            if node.op == "placeholder":
                self.value[node] = self.b.emit(placeholders[node.name])
            elif node.op == "get_attr":
                t = getattr(self.gm, node.target)
                self.value[node] = _View(self.capture_number(t), t, ())
            elif node.op == "call_function":
                self.value[node] = self.call(node)
            elif node.op == "output":
                out = node.args[0]
        return out

    def call(self, node: torch.fx.Node) -> Any:
        target = node.target
        name = getattr(target, "__name__", str(target)).split(".")[0]
        args: tuple[Any, ...] = tuple(node.args)
        kwargs: dict[str, Any] = dict(node.kwargs)
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            raise Unsupported(f"{target} (it returns no tensor)")
        kind = _kind_of(val.dtype)
        b = self.b
        if name in _SAME:
            v = self.value[args[0]]
            if isinstance(v, _View) and tuple(val.shape) != v.tensor.shape[len(v.prefix) :]:
                raise Unsupported(f"{name} of a captured tensor")
            return v
        if name == "detach":  # x + 0, which the pullback does not pass through
            x = self.operand(args[0], kind)
            return b.emit(f"ADD_{kind}", x, b.const(0, kind), rule="stop") if kind == F else x
        if name == "select":
            v = self.value[args[0]]
            if not isinstance(v, _View) or args[1] != len(v.prefix) or not isinstance(args[2], int):
                raise Unsupported("select of a computed tensor")
            return _View(v.capture, v.tensor, (*v.prefix, args[2] % v.tensor.shape[len(v.prefix)]))
        if name == "index":
            v = self.value[args[0]]
            if not isinstance(v, _View) or any(i is None for i in args[1]):
                raise Unsupported("indexing of a computed tensor")
            return self.gather(v, [self.operand(i, I) for i in args[1]])
        if name in _FILLS:
            fill = {"new_ones": 1, "ones_like": 1, "new_zeros": 0, "zeros_like": 0}.get(name)
            if fill is None:
                fill = args[-1] if name != "scalar_tensor" else args[0]
            return b.const(float(fill), kind)
        if name == "_to_copy":
            dtype = kwargs.get("dtype", val.dtype)
            x = self.operand(args[0], self.kind(args[0]))
            if dtype == torch.bool:
                zero = b.const(0, b.kind[x])
                return b.emit("NE_F" if b.kind[x] == F else "NE_I", x, zero)
            return b.as_kind(x, _kind_of(dtype))
        if name in ("add", "sub", "rsub") and "alpha" in kwargs:  # x +- alpha y
            x, y = (args[1], args[0]) if name == "rsub" else (args[0], args[1])
            scaled = self.binary("mul", y, kwargs["alpha"], kind)
            stem = "ADD" if name == "add" else "SUB"
            return b.emit(f"{stem}_{kind}", self.operand(x, kind), scaled)
        if name == "rsub":
            return self.binary("sub", args[1], args[0], kind)
        if name in _BINARY:
            return self.binary(name, args[0], args[1], kind)
        if name == "div":
            mode = kwargs.get("rounding_mode")
            if mode is None:
                return b.emit("DIV_F", self.operand(args[0], F), self.operand(args[1], F))
            if mode != "floor":
                raise Unsupported(f"div with rounding_mode={mode!r}")
            return self.binary("floor_divide", args[0], args[1], kind)
        if name in _UNARY_F and kind == F:
            return b.emit(_UNARY_F[name], self.operand(args[0], F))
        if name in ("neg", "abs") and kind == I:
            return b.emit(f"{name.upper()}_I", self.operand(args[0], I))
        if name == "pow" and isinstance(args[1], (int, float)) and args[1] in (2, 0.5):
            x = self.operand(args[0], kind)
            return b.emit(f"MUL_{kind}", x, x) if args[1] == 2 else b.emit("SQRT_F", x)
        if name == "relu":
            x = self.operand(args[0], kind)
            zero = b.const(0, kind)
            return b.emit(f"WHERE_{kind}", b.emit(f"GT_{kind}", x, zero), x, zero)
        if name in ("clamp", "clamp_min", "clamp_max"):
            low = args[1] if name != "clamp_max" else None
            high = (args[2] if len(args) > 2 else kwargs.get("max")) if name == "clamp" else None
            if name == "clamp_max":
                high = args[1]
            return self.clamp(self.operand(args[0], kind), low, high, kind)
        if name in _COMPARE:
            k = F if F in (self.kind(args[0]), self.kind(args[1])) else I
            return b.emit(
                f"{_COMPARE[name]}_{k}", self.operand(args[0], k), self.operand(args[1], k)
            )
        if name in _LOGICAL:
            logical = name.startswith("logical")
            x, y = (self.truth(a) if logical else self.operand(a, I) for a in args[:2])
            return b.emit(_LOGICAL[name], x, y)
        if name == "logical_not":
            return b.emit("EQ_I", self.truth(args[0]), b.const(0, I))
        if name == "bitwise_not":
            x = self.operand(args[0], I)
            if args[0].meta["val"].dtype == torch.bool:
                return b.emit("EQ_I", x, b.const(0, I))
            return b.emit("NOT_I", x)
        if name == "where":
            cond = self.truth(args[0])
            return b.emit(
                f"WHERE_{kind}", cond, self.operand(args[1], kind), self.operand(args[2], kind)
            )
        raise Unsupported(str(target))

    def truth(self, x: Any) -> int:
        """A 0/1 register: x itself when it is a bool, else x != 0."""
        r = self.operand(x, self.kind(x))
        val = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
        if isinstance(val, torch.Tensor) and val.dtype == torch.bool:
            return r
        k = self.b.kind[r]
        return self.b.emit(f"NE_{k}", r, self.b.const(0, k))

    def binary(self, name: str, x: Any, y: Any, kind: str) -> int:
        op = _BINARY[name]
        return self.b.emit(f"{op}_{kind}", self.operand(x, kind), self.operand(y, kind))

    def clamp(self, x: int, low: Any, high: Any, kind: str) -> int:
        """max(x, low) then min(., high), marked so that the pullback passes the gradient
        where low <= x <= high, as torch's clamp does (`minimum`'s ties would halve it)."""
        out = x
        for op, bound in (("MAX", low), ("MIN", high)):
            if bound is not None:
                out = self.b.emit(f"{op}_{kind}", out, self.operand(bound, kind), rule="clamp")
        return out


@dataclass(frozen=True)
class _View:
    """A captured tensor, with the leading indices ``select`` fixed (``table[0]``)."""

    capture: int
    tensor: torch.Tensor
    prefix: tuple[int, ...]


# -- the pullback ---------------------------------------------------------------

# A rule adds the cotangents of an instruction's arguments, given g, the cotangent of its
# value y: rule(b, ins, g, add), add(x, cotangent) for argument register x.
Rule = Callable[[_Builder, Instruction, int, Callable[[int, int], None]], None]


def _where(b: _Builder, cond: int, x: int, z: int) -> int:
    return b.emit("WHERE_F", cond, x, z)


def _add_rule(b: _Builder, ins: Instruction, g: int, add: Callable[[int, int], None]) -> None:
    add(ins.args[0], g)
    add(ins.args[1], g)


def _sub_rule(b: _Builder, ins: Instruction, g: int, add: Callable[[int, int], None]) -> None:
    add(ins.args[0], g)
    add(ins.args[1], b.emit("NEG_F", g))


def _mul_rule(b: _Builder, ins: Instruction, g: int, add: Callable[[int, int], None]) -> None:
    x, z = ins.args
    add(x, b.emit("MUL_F", g, z))
    add(z, b.emit("MUL_F", g, x))


def _div_rule(b: _Builder, ins: Instruction, g: int, add: Callable[[int, int], None]) -> None:
    gx = b.emit("DIV_F", g, ins.args[1])  # d(x / z) = dx / z - (x / z) dz / z
    add(ins.args[0], gx)
    add(ins.args[1], b.emit("NEG_F", b.emit("MUL_F", gx, ins.dst)))


def _neg_rule(b: _Builder, ins: Instruction, g: int, add: Callable[[int, int], None]) -> None:
    add(ins.args[0], b.emit("NEG_F", g))


def _abs_rule(b: _Builder, ins: Instruction, g: int, add: Callable[[int, int], None]) -> None:
    x, zero = ins.args[0], b.const(0, F)  # sgn(x) g: 0 at x = 0
    below = _where(b, b.emit("LT_F", x, zero), b.emit("NEG_F", g), zero)
    add(x, _where(b, b.emit("GT_F", x, zero), g, below))


def _extreme_rule(b: _Builder, ins: Instruction, g: int, add: Callable[[int, int], None]) -> None:
    """minimum / maximum: the chosen side, half to each on a tie (torch's rule); for a
    clamp's bound (`_Lowering.clamp`), all to x where it is within the bound."""
    (x, z), zero = ins.args, b.const(0, F)
    if b.rule.get(ins.dst) == "clamp":
        inside = b.emit("GE_F" if ins.op == "MAX_F" else "LE_F", x, z)
        add(x, _where(b, inside, g, zero))
        add(z, _where(b, inside, zero, g))
        return
    order = "LT_F" if ins.op == "MIN_F" else "GT_F"
    tie = _where(b, b.emit("EQ_F", x, z), b.emit("MUL_F", g, b.const(0.5, F)), zero)
    add(x, _where(b, b.emit(order, x, z), g, tie))
    add(z, _where(b, b.emit(order, z, x), g, tie))


def _exp_rule(b: _Builder, ins: Instruction, g: int, add: Callable[[int, int], None]) -> None:
    add(ins.args[0], b.emit("MUL_F", g, ins.dst))


def _log_rule(b: _Builder, ins: Instruction, g: int, add: Callable[[int, int], None]) -> None:
    add(ins.args[0], b.emit("DIV_F", g, ins.args[0]))


def _tanh_rule(b: _Builder, ins: Instruction, g: int, add: Callable[[int, int], None]) -> None:
    y = ins.dst
    add(ins.args[0], b.emit("MUL_F", g, b.emit("SUB_F", b.const(1, F), b.emit("MUL_F", y, y))))


def _sigmoid_rule(b: _Builder, ins: Instruction, g: int, add: Callable[[int, int], None]) -> None:
    y = ins.dst
    slope = b.emit("MUL_F", y, b.emit("SUB_F", b.const(1, F), y))
    add(ins.args[0], b.emit("MUL_F", g, slope))


def _sqrt_rule(b: _Builder, ins: Instruction, g: int, add: Callable[[int, int], None]) -> None:
    add(ins.args[0], b.emit("DIV_F", g, b.emit("MUL_F", ins.dst, b.const(2, F))))


def _remainder_rule(b: _Builder, ins: Instruction, g: int, add: Callable[[int, int], None]) -> None:
    add(ins.args[0], g)  # x - floor(x / z) z
    add(ins.args[1], b.emit("NEG_F", b.emit("MUL_F", g, b.emit("FLOORDIV_F", *ins.args))))


def _where_rule(b: _Builder, ins: Instruction, g: int, add: Callable[[int, int], None]) -> None:
    (cond, x, z), zero = ins.args, b.const(0, F)
    add(x, _where(b, cond, g, zero))
    add(z, _where(b, cond, zero, g))


def _gather_rule(b: _Builder, ins: Instruction, g: int, add: Callable[[int, int], None]) -> None:
    uniform = all(b.uniform[a] for a in ins.args)
    b.emit("SCATTER", g, *ins.args, capture=ins.capture, uniform=uniform)


# The derivative of each F op with one; the F ops without one have none (FLOOR_F,
# FLOORDIV_F: piecewise constant; TO_F: from integers; loads: the leaves)
RULES: dict[str, Rule] = {
    "ADD_F": _add_rule, "SUB_F": _sub_rule, "MUL_F": _mul_rule, "DIV_F": _div_rule,
    "NEG_F": _neg_rule, "ABS_F": _abs_rule, "MIN_F": _extreme_rule, "MAX_F": _extreme_rule,
    "EXP_F": _exp_rule, "LOG_F": _log_rule, "TANH_F": _tanh_rule, "SIGMOID_F": _sigmoid_rule,
    "SQRT_F": _sqrt_rule, "REMAINDER_F": _remainder_rule, "WHERE_F": _where_rule,
    "GATHER_F": _gather_rule,
}  # fmt: skip


def _pullback(b: _Builder, forward: list[Instruction], out: int, wanted: set[int]) -> Program:
    """dS and the wanted captures' SCATTERs by reverse mode over ``forward`` (emitted into
    ``b``, after it; `_Builder.program` then keeps the forward values they read)."""
    active: set[int] = set()  # F registers that depend on the score or a wanted capture
    for ins in forward:
        if (
            ins.op == "SCORE"
            or (ins.op == "GATHER_F" and ins.capture in wanted)
            or (
                ins.op in RULES
                and ins.op != "GATHER_F"
                and b.rule.get(ins.dst) != "stop"
                and any(a in active for a in ins.args)
            )
        ):
            active.add(ins.dst)
    adjoint: dict[int, int] = {out: b.emit("GRAD")}

    def add(x: int, g: int) -> None:
        if x in active:
            adjoint[x] = g if x not in adjoint else b.emit("ADD_F", adjoint[x], g)

    score = None
    for ins in reversed(forward):
        if ins.dst not in adjoint or ins.dst not in active:
            continue
        if ins.op == "SCORE":
            score = adjoint[ins.dst]
        else:
            RULES[ins.op](b, ins, adjoint[ins.dst], add)
    return b.program(b.const(0, F) if score is None else score)


# -- compiling, cached ----------------------------------------------------------

_CACHE: weakref.WeakKeyDictionary[Any, dict[tuple[Any, ...], ScoreProgram | MaskProgram | str]] = (
    weakref.WeakKeyDictionary()
)


_EMPTY = object()  # an empty closure cell's stand-in
_PER_OWNER = 64  # programs kept per function or code object, the oldest dropped past it


def _owner(fn: Callable[..., Any]) -> Any:
    """What a function's programs are cached under: its code object where ``fn`` is a plain
    Python function (not a bound method, whose instance the key cannot see) and everything
    its closure and defaults hold is a Python scalar, a tensor (read by identity at run
    time) or None, each described by position in the key (`_closure_key`) -- so a closure
    made anew at each call (a model's forward defining its score_mod) is traced once, not
    at every call; else the function itself."""
    if type(fn) is not types.FunctionType:
        return fn
    plain = (bool, int, float, str, torch.Tensor, type(None))
    if not all(isinstance(x, plain) for x in _held(fn)):
        return fn
    return fn.__code__


def _held(fn: Callable[..., Any]) -> list[Any]:
    """What ``fn``'s closure cells (`_EMPTY` for an empty one), defaults and keyword-only
    defaults (by name) hold, in that order."""
    held: list[Any] = []
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            held.append(cell.cell_contents)
        except ValueError:  # an empty cell
            held.append(_EMPTY)
    held += list(getattr(fn, "__defaults__", None) or ())
    kwdefaults = getattr(fn, "__kwdefaults__", None) or {}
    held += [kwdefaults[name] for name in sorted(kwdefaults)]
    return held


def _closure_key(fn: Callable[..., Any]) -> tuple[Any, ...]:
    """What a program traced from ``fn`` may bake in besides its code, by position: each
    held value's (`_held`) scalar value, tensor shape and dtype, None or emptiness (anything
    else by identity: its function owns the cache then), and the globals it reads from."""

    def describe(x: Any) -> tuple[Any, ...]:
        if x is _EMPTY or x is None:
            return ("empty" if x is _EMPTY else "None",)
        if isinstance(x, (bool, int, float, str)):
            return (type(x).__name__, x)
        if isinstance(x, torch.Tensor):
            return ("tensor", tuple(x.shape), x.dtype)
        return ("object", id(x))

    globals_ = getattr(fn, "__globals__", None)
    return (*(describe(x) for x in _held(fn)), ("globals", id(globals_)))


def _cached(
    fn: Callable[..., Any],
    key: tuple[Any, ...],
    make: Callable[[], ScoreProgram | MaskProgram | str],
) -> ScoreProgram | MaskProgram | str:
    """``make()`` once per (`_owner` of fn, key), at most `_PER_OWNER` kept per owner."""
    try:
        known = _CACHE.setdefault(_owner(fn), {})
    except TypeError:  # a callable that takes no weak reference: compiled each call
        known = {}
    if key not in known:
        if len(known) >= _PER_OWNER:  # a closure scalar that changes at every call
            known.pop(next(iter(known)))
        known[key] = make()
    return known[key]


def softcap_of(program: Program) -> float | None:
    """c where ``program`` is a softcap, S' = c * tanh(S / c) for a constant c > 0 (in either
    order of the product), else None: what the kernels' own softcap computes, in the same
    three roundings, so they may run it in its place."""
    at = {ins.dst: ins for ins in program.instructions}
    out = at[program.out]
    if out.op != "MUL_F":
        return None
    for t, c in (out.args, out.args[::-1]):
        tanh, cap = at[t], at[c]
        if tanh.op != "TANH_F" or cap.op != "CONST_F" or not 0 < cap.imm < math.inf:
            continue
        div = at[tanh.args[0]]
        if (
            div.op == "DIV_F"
            and at[div.args[0]].op == "SCORE"
            and at[div.args[1]].op == "CONST_F"
            and at[div.args[1]].imm == cap.imm
        ):
            return cap.imm
    return None


def program_of(score: ScoreFunction, dtype: torch.dtype = torch.float32) -> ScoreProgram | str:
    """The programs of a call's score function for scores in ``dtype`` (its captures'
    gradients scattered where they can take one), or why the kernels cannot run it."""
    if not score.elementwise:
        return (
            "it reads more than one score's worth at a time (chained indexing, a reduction "
            "or a matmul), which only the tensor-op tiles run"
        )
    return compile_score(score.fn, score.captured_originals, dtype, score.grads_wanted, score.point)


def compile_score(
    fn: Callable[..., torch.Tensor],
    captured: Sequence[torch.Tensor],
    dtype: torch.dtype,
    wanted: Sequence[bool],
    at: tuple[int, int, int, int] = (0, 0, 0, 0),
) -> ScoreProgram | str:
    """``fn``'s programs (module docstring) for scores in ``dtype``, reading ``captured``
    (the tensors its closure holds, by identity), the pullback scattering the gradients of
    the captures ``wanted``; or why it cannot be compiled (the op the kernels lack).  The
    trace runs ``fn`` once, at (b, h, q_idx, kv_idx) = ``at``: a point where it is valid (a
    paged table's function is valid only where the BlockMask keeps scores)."""
    key = (
        at,
        dtype,
        tuple((tuple(t.shape), t.dtype) for t in captured),
        tuple(wanted),
        _closure_key(fn),
    )
    found = _cached(fn, key, lambda: _compile(fn, captured, dtype, wanted, at))
    assert not isinstance(found, MaskProgram)  # a mask's key differs
    return found


def _compile(
    fn: Callable[..., torch.Tensor],
    captured: Sequence[torch.Tensor],
    dtype: torch.dtype,
    wanted: Sequence[bool],
    at: tuple[int, int, int, int],
) -> ScoreProgram | str:
    def example() -> tuple[torch.Tensor, ...]:
        return torch.zeros(1, 1, 1, 1, dtype=dtype), *_indices(at)

    lowered = _lower(fn, captured, example, ("SCORE", "BATCH", "HEAD", "QUERY", "KEY"))
    if isinstance(lowered, str):
        return lowered
    lowering, result = lowered
    try:
        out = lowering.operand(result, F)
    except Unsupported as err:
        return str(err)
    b = lowering.b
    forward = b.program(out)
    chosen = {n for n, w in enumerate(wanted) if w}
    pullback = _pullback(b, list(b.code), out, chosen)
    return ScoreProgram(forward, pullback, tuple(lowering.made), tuple(sorted(chosen)))


def compile_mask(
    fn: Callable[..., torch.Tensor],
    captured: Sequence[torch.Tensor],
    at: tuple[int, int, int, int] = (0, 0, 0, 0),
) -> MaskProgram | str:
    """``fn``'s program, a ``mask_mod(b, h, q_idx, kv_idx) -> bool`` reading ``captured`` (the
    tensors its closure holds, by identity), its out an I register (1 = kept); or why it
    cannot be compiled (the op the kernels lack).  Cached like `compile_score`."""
    key = ("mask", at, tuple((tuple(t.shape), t.dtype) for t in captured), _closure_key(fn))
    found = _cached(fn, key, lambda: _compile_mask(fn, captured, at))
    assert not isinstance(found, ScoreProgram)  # a score function's key differs
    return found


def _compile_mask(
    fn: Callable[..., torch.Tensor], captured: Sequence[torch.Tensor], at: tuple[int, ...]
) -> MaskProgram | str:
    lowered = _lower(fn, captured, lambda: _indices(at), ("BATCH", "HEAD", "QUERY", "KEY"))
    if isinstance(lowered, str):
        return lowered
    lowering, result = lowered
    try:
        out = lowering.truth(result)  # the kept scores as 0/1, whatever dtype fn returns
    except Unsupported as err:
        return str(err)
    return MaskProgram(lowering.b.program(out), tuple(lowering.made))


def _indices(at: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    """b, h, q_idx, kv_idx as a trace takes them, at the point ``at``: 4-d, so indexing is
    a gather."""
    return tuple(torch.full((1, 1, 1, 1), n, dtype=INDEX) for n in at)


def _lower(
    fn: Callable[..., torch.Tensor],
    captured: Sequence[torch.Tensor],
    example: Callable[[], tuple[torch.Tensor, ...]],
    loads: Sequence[str],
) -> tuple[_Lowering, Any] | str:
    """``fn`` traced on the tensors ``example()`` makes (inside the trace's context: made
    under a torch.func transform they would be its wrappers) and lowered, its arguments the
    ``loads``: the lowering and the graph's output argument, or why it cannot be (the op the
    kernels lack)."""
    swap: dict[int, torch.Tensor] = {}

    def traced(*args: torch.Tensor) -> torch.Tensor:
        with Reads((), swap) if swap else contextlib.nullcontext():
            return fn(*args)

    try:
        # no autograd of either mode, and no torch.func transform, recorded into the trace
        # (a call under jvp or torch.func.grad runs here too); the tensors made in it
        with (
            torch.no_grad(),
            forward_ad._set_fwd_grad_enabled(False),
            temporarily_clear_interpreter_stack(),
        ):
            # the captures as plain tensors: under a transform they are its wrappers, which
            # the trace would copy, no longer the closure's tensors
            plain = [_plain(t) for t in captured]
            swap.update((id(t), p) for t, p in zip(captured, plain, strict=True) if p is not t)
            gm = make_fx(traced)(*example())
        lowering = _Lowering(plain, gm)
        names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        out = lowering.run(dict(zip(names, loads, strict=True)))
    except Unsupported as err:
        return str(err)
    except Exception as err:
        return (
            f"tracing failed ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})"
        )
    return lowering, out


def _plain(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, or for a torch.func wrapper (grad, jvp, vmap) a plain tensor of its
    shape and dtype: the trace reads a capture's shape and dtype, never its values."""
    if not torch._C._functorch.is_functorch_wrapped_tensor(t):
        return t
    return torch.empty(t.shape, dtype=t.dtype)


# -- encoding -----------------------------------------------------------------------


def encode(
    program: Program, opcodes: dict[str, int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(code int64 [n, 6], constants float64 [n], indices int64 [m]) as the kernels read a
    program (``csrc/program.h``): each row (op, dst, a, b, c, uniform); a gather's or
    scatter's a = capture, b = offset of its index registers in ``indices``, c = their
    count (a scatter's dst: the value register it reads)."""
    rows: list[list[int]] = []
    constants: list[float] = []
    indices: list[int] = []
    for ins in program.instructions:
        if ins.op in ("GATHER_F", "GATHER_I", "SCATTER"):
            args = ins.args[1:] if ins.op == "SCATTER" else ins.args
            dst = ins.args[0] if ins.op == "SCATTER" else ins.dst
            row = [dst, ins.capture, len(indices), len(args)]
            indices += args
        else:
            row = [ins.dst, *ins.args, *(-1,) * (3 - len(ins.args))]
        rows.append([opcodes[ins.op], *row, int(ins.uniform)])
        constants.append(ins.imm)
    return (
        torch.tensor(rows, dtype=torch.int64).reshape(-1, 6),
        torch.tensor(constants, dtype=torch.float64),
        torch.tensor(indices, dtype=torch.int64),
    )
