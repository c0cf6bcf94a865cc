"""Score programs: the fused kernels' interpreter of traced score_mods (``csrc/program.h``).

Programs are built by hand here (`Program`, op names mapped to numbers through
``program_ops()``).  Each op runs through the test op ``program_rows`` against the torch
expression it stands for; the kernels run a hand-built ALiBi program, S' = S + slope[h] *
(j - i), against `attngrad.attention` with the same bias given as a float mask.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch

import attngrad
from attngrad.strategies.fused import build

DTYPES = [torch.float32, torch.float64]
B, H, NQ, NK = 2, 3, 5, 11  # program_rows' scores: odd sizes, more keys than queries


@pytest.fixture(scope="module", autouse=True)
def _library() -> None:
    build.load()


def ops() -> dict[str, int]:
    return {name: k for k, name in enumerate(torch.ops.attngrad_fused.program_ops())}


@dataclass
class Program:
    """A straight-line program as the ops take it; register k is the k-th value emitted."""

    rows: list[list[int]] = field(default_factory=list)
    constants: list[float] = field(default_factory=list)
    indices: list[int] = field(default_factory=list)
    registers: int = 0

    def _emit(self, name, dst, a=-1, b=-1, c=-1, uniform=False, constant=0.0):
        self.rows.append([ops()[name], dst, a, b, c, int(uniform)])
        self.constants.append(constant)

    def op(self, name, a=-1, b=-1, c=-1, *, uniform=False, constant=0.0) -> int:
        dst, self.registers = self.registers, self.registers + 1
        self._emit(name, dst, a, b, c, uniform, constant)
        return dst

    def const(self, name, value, *, uniform=True) -> int:
        return self.op(name, uniform=uniform, constant=value)

    def gather(self, name, capture, index_registers, *, uniform=False) -> int:
        offset = len(self.indices)
        self.indices += index_registers
        return self.op(name, capture, offset, len(index_registers), uniform=uniform)

    def scatter(self, value, capture, index_registers) -> None:
        offset = len(self.indices)
        self.indices += index_registers
        self._emit("SCATTER", value, capture, offset, len(index_registers))

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        code = torch.tensor(self.rows, dtype=torch.int64).reshape(-1, 6)
        constants = torch.tensor(self.constants, dtype=torch.float64)
        return code, constants, torch.tensor(self.indices, dtype=torch.int64)


def rows(p, out, scores, grad=None, captured=(), batch=1, wanted=()):
    """program_rows: (outputs [B, H, Nq, Nk], dcaptured)."""
    return torch.ops.attngrad_fused.program_rows(
        *p.tensors(), out, list(captured), scores, grad, batch, list(wanted)
    )


def scores_with_specials(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(B, H, NQ, NK, generator=g, dtype=torch.float64) * 3
    s.view(-1)[:8] = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, 2.0, -2.5, 1e-30])
    return s.to(dtype)


def close(got, want):
    torch.testing.assert_close(got, want, equal_nan=True, rtol=4e-6, atol=1e-30)


def same(got, want):
    """Bit for bit, NaN where NaN."""
    torch.testing.assert_close(got, want, equal_nan=True, rtol=0, atol=0)


UNARY = {
    "NEG_F": torch.neg,
    "ABS_F": torch.abs,
    "EXP_F": torch.exp,
    "LOG_F": torch.log,
    "TANH_F": torch.tanh,
    "SIGMOID_F": torch.sigmoid,
    "SQRT_F": torch.sqrt,
    "FLOOR_F": torch.floor,
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(UNARY))
def test_each_unary_float_op_is_its_torch_function(name, dtype):
    s = scores_with_specials(dtype)
    p = Program()
    out = p.op(name, p.op("SCORE"))
    close(rows(p, out, s)[0], UNARY[name](s))


BINARY = {
    "ADD_F": torch.add,
    "SUB_F": torch.sub,
    "MUL_F": torch.mul,
    "DIV_F": torch.div,
    "MIN_F": torch.minimum,  # NaN on either side wins
    "MAX_F": torch.maximum,
    "FLOORDIV_F": torch.floor_divide,
    "REMAINDER_F": torch.remainder,
}


def second_operand(dtype):
    """GRAD's rows for the binary ops: divisors of every sign, 0, NaN and inf among them."""
    g = scores_with_specials(dtype, seed=1)
    g.view(-1)[8:16] = torch.tensor([0.0, -0.0, 0.1, -0.1, 3.0, -3.0, math.nan, -math.inf])
    return g


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(BINARY))
def test_each_binary_float_op_is_its_torch_function(name, dtype):
    s, g = scores_with_specials(dtype), second_operand(dtype)
    p = Program()
    out = p.op(name, p.op("SCORE"), p.op("GRAD"))
    got = rows(p, out, s, g)[0]
    if name in ("FLOORDIV_F", "REMAINDER_F"):  # torch's own algorithm, bit for bit
        same(got, BINARY[name](s, g))
    close(got, BINARY[name](s, g))


def test_floor_division_of_floats_is_torchs_not_floor_of_the_quotient():
    # 1 // 0.1 is 9 (fmod's quotient), floor(1 / 0.1) is 10
    s = torch.ones(1, 1, 1, 4, dtype=torch.float64) * torch.tensor([1.0, -1.0, 1.0, 7.5])
    g = torch.tensor([0.1, 0.1, -0.1, -2.0], dtype=torch.float64).expand(1, 1, 1, 4)
    p = Program()
    out = p.op("FLOORDIV_F", p.op("SCORE"), p.op("GRAD"))
    got = rows(p, out, s, g.contiguous())[0]
    assert got.flatten().tolist() == [9.0, -10.0, -10.0, -4.0]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", ["LT_F", "LE_F", "GT_F", "GE_F", "EQ_F", "NE_F"])
def test_float_comparisons_give_zero_or_one(name, dtype):
    s, g = scores_with_specials(dtype), second_operand(dtype)
    s.view(-1)[20:24] = g.view(-1)[20:24]  # some ties
    fn = {"LT_F": torch.lt, "LE_F": torch.le, "GT_F": torch.gt, "GE_F": torch.ge}
    fn |= {"EQ_F": torch.eq, "NE_F": torch.ne}
    p = Program()
    out = p.op("TO_F", p.op(name, p.op("SCORE"), p.op("GRAD")))
    assert torch.equal(rows(p, out, s, g)[0], fn[name](s, g).to(dtype))


def int_operands():
    """[B, H, Nq, Nk] int64 pairs: both signs, 0 on the left, never 0 on the right."""
    g = torch.Generator().manual_seed(2)
    x = torch.randint(-20, 21, (B, H, NQ, NK), generator=g)
    y = torch.randint(1, 8, (B, H, NQ, NK), generator=g) * (torch.randint(0, 2, x.shape) * 2 - 1)
    x.view(-1)[:4] = torch.tensor([2**62, -(2**62), 2**63 - 1, -(2**63)])  # wrap around
    y.view(-1)[:4] = 3
    return x, y


def load_ints(p, captures):
    """Registers holding captures[c][b, h, q_idx, kv_idx]: a 4-D gather per capture."""
    at = [p.op("BATCH"), p.op("HEAD", uniform=True), p.op("QUERY", uniform=True), p.op("KEY")]
    return [p.gather("GATHER_I", c, at) for c in range(captures)]


INT_BINARY = {
    "ADD_I": torch.add,
    "SUB_I": torch.sub,
    "MUL_I": torch.mul,
    "MIN_I": torch.minimum,
    "MAX_I": torch.maximum,
    "AND_I": torch.bitwise_and,
    "OR_I": torch.bitwise_or,
    "XOR_I": torch.bitwise_xor,
    "FLOORDIV_I": torch.floor_divide,  # rounds toward -inf
    "REMAINDER_I": torch.remainder,  # the divisor's sign, Python's %
    "LT_I": torch.lt,
    "LE_I": torch.le,
    "GT_I": torch.gt,
    "GE_I": torch.ge,
    "EQ_I": torch.eq,
    "NE_I": torch.ne,
}


def run_int(name, x, y=None):
    """The I op over gathered x (and y), returned through TO_F in float64."""
    p = Program()
    regs = load_ints(p, 1 if y is None else 2)
    out = p.op("TO_F", p.op(name, *regs))
    s = torch.zeros(B, H, NQ, NK, dtype=torch.float64)
    return rows(p, out, s, captured=[x] if y is None else [x, y], batch=B)[0]


@pytest.mark.parametrize("name", list(INT_BINARY))
def test_each_integer_op_is_its_torch_function(name):
    x, y = int_operands()
    assert torch.equal(run_int(name, x, y), INT_BINARY[name](x, y).to(torch.float64))


def test_integer_floor_division_and_remainder_of_negatives_are_pythons():
    x = torch.tensor([7, -7, 7, -7, 0, -1]).expand(B, H, NQ, 6).contiguous()
    y = torch.tensor([2, 2, -2, -2, 3, 5]).expand(B, H, NQ, 6).contiguous()
    x, y = (torch.nn.functional.pad(t, (0, NK - 6), value=1) for t in (x, y))
    div = run_int("FLOORDIV_I", x, y)[0, 0, 0, :6].tolist()
    rem = run_int("REMAINDER_I", x, y)[0, 0, 0, :6].tolist()
    assert div == [a // b for a, b in zip([7, -7, 7, -7, 0, -1], [2, 2, -2, -2, 3, 5], strict=True)]
    assert rem == [a % b for a, b in zip([7, -7, 7, -7, 0, -1], [2, 2, -2, -2, 3, 5], strict=True)]


@pytest.mark.parametrize("name", ["FLOORDIV_I", "REMAINDER_I"])
def test_integer_division_by_zero_raises(name):
    x, y = int_operands()
    y.view(-1)[17] = 0
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        run_int(name, x, y)


@pytest.mark.parametrize(
    "name, fn",
    [("NEG_I", torch.neg), ("ABS_I", torch.abs), ("NOT_I", torch.bitwise_not)],
)
def test_each_unary_integer_op_is_its_torch_function(name, fn):
    x, _ = int_operands()
    assert torch.equal(run_int(name, x), fn(x).to(torch.float64))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_casts_truncate_toward_zero_and_nan_or_out_of_range_become_zero(dtype):
    s = scores_with_specials(dtype)
    s.view(-1)[8:12] = torch.tensor([-2.7, 2.7, 1e30, -1e30])
    p = Program()
    out = p.op("TO_F", p.op("TO_I", p.op("SCORE")))
    finite = s.isfinite() & (s.abs() < 2**62)
    want = torch.where(finite, s, 0).long().to(dtype)
    assert torch.equal(rows(p, out, s)[0], want)
    # int64 -> float rounds to nearest, as torch's .to()
    big = torch.tensor([2**53 + 1, -(2**60) - 1, 3, 2**24 + 1]).repeat(B, H, NQ, 3)[..., :NK]
    p = Program()
    (reg,) = load_ints(p, 1)
    out = p.op("TO_F", reg)
    got = rows(p, out, torch.zeros(B, H, NQ, NK, dtype=dtype), captured=[big], batch=B)[0]
    assert torch.equal(got, big.contiguous().to(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_constants_and_where(dtype):
    s, g = scores_with_specials(dtype), second_operand(dtype)
    p = Program()
    score, grad = p.op("SCORE"), p.op("GRAD")
    tenth = p.const("CONST_F", 0.1)
    three = p.const("CONST_I", -3.7)  # truncated: -3
    pick = p.op("WHERE_F", p.op("LT_F", score, grad), score, grad)
    key = p.op("KEY")
    ints = p.op("WHERE_I", p.op("GT_I", key, p.const("CONST_I", 4)), key, three)
    out = p.op("ADD_F", p.op("MUL_F", pick, tenth), p.op("TO_F", ints))
    j = torch.arange(NK)
    want = torch.where(s < g, s, g) * torch.tensor(0.1, dtype=dtype) + torch.where(j > 4, j, -3)
    same(rows(p, out, s, g)[0], want.to(dtype))


def test_loads_are_the_row_position():
    p = Program()
    regs = [p.op("BATCH", uniform=True), p.op("HEAD", uniform=True), p.op("QUERY"), p.op("KEY")]
    weights = [1000.0, 100.0, 10.0, 1.0]
    out = p.const("CONST_F", 0.0, uniform=False)
    for r, w in zip(regs, weights, strict=True):
        out = p.op("ADD_F", out, p.op("MUL_F", p.op("TO_F", r), p.const("CONST_F", w)))
    s = torch.zeros(3, H, NQ, NK, dtype=torch.float64)
    b, h, i, j = torch.meshgrid(*(torch.arange(n) for n in s.shape), indexing="ij")
    want = (b % 2) * 1000.0 + h * 100.0 + i * 10.0 + j
    assert torch.equal(rows(p, out, s, batch=2)[0], want.double())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gathers_wrap_negative_indices_once_at_any_rank(dtype):
    g = torch.Generator().manual_seed(3)
    flat = torch.randn(7, generator=g, dtype=dtype)  # indexed by kv_idx - 4: -4 .. 6
    cube = torch.randn(H, NQ, NK, generator=g, dtype=dtype)  # by [h, q_idx - Nq, -1 - kv_idx]
    scalar = torch.tensor(2.5, dtype=dtype)  # a 0-d capture
    p = Program()
    key, query, head = p.op("KEY"), p.op("QUERY"), p.op("HEAD", uniform=True)
    a = p.gather("GATHER_F", 0, [p.op("SUB_I", key, p.const("CONST_I", 4))])
    neg_q = p.op("SUB_I", query, p.const("CONST_I", NQ))
    neg_k = p.op("SUB_I", p.const("CONST_I", -1), key)
    b = p.gather("GATHER_F", 1, [head, neg_q, neg_k])
    c = p.gather("GATHER_F", 2, [], uniform=True)
    out = p.op("ADD_F", p.op("ADD_F", a, b), p.op("MUL_F", c, p.op("SCORE")))
    s = scores_with_specials(dtype)
    got = rows(p, out, s, captured=[flat, cube, scalar])[0]
    j = torch.arange(NK)
    want = flat[j - 4] + cube.flip(-1) + scalar * s
    close(got, want.expand_as(s))


@pytest.mark.parametrize(
    "op, shift", [("ADD_I", 2), ("SUB_I", NK + 1)], ids=["past-the-end", "below-minus-size"]
)
def test_an_out_of_bounds_gather_raises_index_error(op, shift):
    p = Program()
    out = p.gather("GATHER_F", 0, [p.op(op, p.op("KEY"), p.const("CONST_I", shift))])
    s = torch.zeros(B, H, NQ, NK)
    with pytest.raises(IndexError, match=r"captured tensor 0 of shape \[11\] at index"):
        rows(p, out, s, captured=[torch.zeros(NK)])


def test_scatter_adds_like_index_put_with_accumulate():
    g = torch.Generator().manual_seed(4)
    grad = torch.randn(B, H, NQ, NK, generator=g, dtype=torch.float64)
    p = Program()
    value = p.op("GRAD")
    key, query, head = p.op("KEY"), p.op("QUERY", uniform=True), p.op("HEAD", uniform=True)
    bucket = p.op("REMAINDER_I", p.op("SUB_I", key, query), p.const("CONST_I", 4))
    p.scatter(value, 0, [head, p.op("SUB_I", bucket, p.const("CONST_I", 4))])  # negative: wraps
    p.scatter(p.op("MUL_F", value, value), 1, [head])  # one position per row: summed first
    p.scatter(value, 2, [])  # a 0-d capture
    p.scatter(value, 3, [key])  # not wanted
    captured = [torch.zeros(H, 4, dtype=torch.float64), torch.zeros(H, dtype=torch.float64)]
    captured += [torch.zeros((), dtype=torch.float64), torch.zeros(NK, dtype=torch.float64)]
    out, dcaptured = rows(p, value, torch.zeros_like(grad), grad, captured, 1, [True] * 3 + [False])
    assert torch.equal(out, grad)
    _, h, i, j = torch.meshgrid(*(torch.arange(n) for n in grad.shape), indexing="ij")
    wants = [
        torch.zeros(H, 4, dtype=torch.float64).index_put_(
            (h.flatten(), ((j - i) % 4).flatten()), grad.flatten(), accumulate=True
        ),
        torch.zeros(H, dtype=torch.float64).index_put_(
            (h.flatten(),), (grad * grad).flatten(), accumulate=True
        ),
        grad.sum(),
    ]
    for got, want in zip(dcaptured[:3], wants, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert dcaptured[3].numel() == 0  # not wanted: an empty tensor


def test_a_uniform_row_gives_the_bits_of_a_full_row():
    def alibi(uniform):
        p = Program()
        score, query = p.op("SCORE"), p.op("QUERY", uniform=uniform)
        rel = p.op("TO_F", p.op("SUB_I", p.op("KEY"), query))
        slope = p.gather("GATHER_F", 0, [p.op("HEAD", uniform=uniform)], uniform=uniform)
        scaled = p.op("MUL_F", slope, p.const("CONST_F", 0.7, uniform=uniform), uniform=uniform)
        curve = p.op("TANH_F", scaled, uniform=uniform)
        return p, p.op("ADD_F", score, p.op("MUL_F", rel, curve))

    s = scores_with_specials(torch.float32)
    slopes = torch.randn(H)
    (p, out), (q, out_q) = alibi(True), alibi(False)
    same(rows(p, out, s, captured=[slopes])[0], rows(q, out_q, s, captured=[slopes])[0])


@pytest.mark.parametrize(
    "build_bad, match",
    [
        (lambda p: p.op("ADD_F", p.op("SCORE"), 5), "before any instruction writes it"),
        (lambda p: p.op("NEG_F", p.op("KEY")), "reads register 0 as F"),
        (lambda p: p.op("NEG_F", p.op("SCORE"), uniform=True), "marked uniform"),
        (lambda p: p.op("GRAD"), "backward programs"),
    ],
    ids=["unwritten", "kind", "uniform", "grad-in-forward"],
)
def test_a_malformed_program_is_a_value_error(build_bad, match):
    p = Program()
    out = build_bad(p)
    with pytest.raises(ValueError, match=match):
        rows(p, out, torch.zeros(1, 1, 2, 3))


# --- the kernels: ALiBi as a program against the same bias as a float mask ---------------


def alibi_programs():
    """Forward S + slope[h] * (j - i) and backward: dS = dS', dslope[h] += dS' (j - i)."""
    fwd = Program()
    rel = fwd.op("TO_F", fwd.op("SUB_I", fwd.op("KEY"), fwd.op("QUERY", uniform=True)))
    slope = fwd.gather("GATHER_F", 0, [fwd.op("HEAD", uniform=True)], uniform=True)
    out = fwd.op("ADD_F", fwd.op("SCORE"), fwd.op("MUL_F", rel, slope))
    bwd = Program()
    grad = bwd.op("GRAD")
    rel = bwd.op("TO_F", bwd.op("SUB_I", bwd.op("KEY"), bwd.op("QUERY", uniform=True)))
    bwd.scatter(bwd.op("MUL_F", grad, rel), 0, [bwd.op("HEAD", uniform=True)])
    return (fwd, out), (bwd, grad)


def fused_with_program(q, k, v, dout, slopes, programs, causal, tiles=(16, 8)):
    """The raw ops with the program: O, dq, dk, dv, dslope."""
    (fwd, out), (bwd, grad_out) = programs
    n = q.shape[2]
    band = [torch.zeros(n, dtype=torch.int64), torch.arange(1, n + 1)] if causal else [None, None]
    mods = [None, None, *band, None, None]
    engine, scale = build.load().engine_id, q.shape[-1] ** -0.5
    o, stats = torch.ops.attngrad_fused.forward(
        q, k, v, *mods, scale, 0.0, 0, 1.0, *tiles, engine, *fwd.tensors(), out, [slopes], 1
    )
    delta = (o * dout).sum(-1)
    dq, dk, dv, _, (dslope,), _ = torch.ops.attngrad_fused.backward(
        dout, q, k, v, stats, delta, *mods, scale, 0.0, 0, 1.0, *tiles, engine, False,
        *fwd.tensors(), out, [slopes], 1, *bwd.tensors(), grad_out, [True],
    )  # fmt: skip
    return o, dq, dk, dv, dslope


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_alibi_program_matches_the_same_bias_as_a_float_mask(dtype, causal):
    b, hq, hkv, n, d = 2, 4, 2, 37, 16
    g = torch.Generator().manual_seed(5)
    q = torch.randn(b, hq, n, d, generator=g, dtype=dtype)
    k, v = (torch.randn(b, hkv, n, d, generator=g, dtype=dtype) for _ in range(2))
    dout = torch.randn(b, hq, n, d, generator=g, dtype=dtype)
    slopes = torch.rand(hq, generator=g, dtype=dtype)
    o, dq, dk, dv, dslope = fused_with_program(q, k, v, dout, slopes, alibi_programs(), causal)

    qr, kr, vr, sr = (t.clone().requires_grad_() for t in (q, k, v, slopes))
    rel = (torch.arange(n)[None, :] - torch.arange(n)[:, None]).to(dtype)
    bias = (sr[:, None, None] * rel).expand(b, hq, n, n)
    want = attngrad.attention(
        qr, kr, vr, attn_mask=bias, window=(None, 0) if causal else None, enable_gqa=True,
        strategy="fused", block_q=16, block_k=8,
    )  # fmt: skip
    grads = torch.autograd.grad(want, (qr, kr, vr, sr), dout)
    tol = {"rtol": 2e-5, "atol": 2e-5} if dtype == torch.float32 else {"rtol": 1e-10, "atol": 1e-10}
    torch.testing.assert_close(o, want, **tol)
    for got, ref in zip((dq, dk, dv, dslope), grads, strict=True):
        torch.testing.assert_close(got, ref, **tol)


def test_captured_gradients_are_the_same_bits_for_any_thread_count():
    g = torch.Generator().manual_seed(6)
    q, k, v, dout = (torch.randn(1, 2, 70, 8, generator=g) for _ in range(4))
    slopes = torch.rand(2, generator=g)
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append(fused_with_program(q, k, v, dout, slopes, alibi_programs(), True))
    finally:
        torch.set_num_threads(before)
    for one, two in zip(*results, strict=True):
        assert torch.equal(one, two)


def relative_table_program():
    """S + table[(i - j) - N]: in bounds where j <= i (causal), out of bounds above it."""
    p = Program()
    rel = p.op("SUB_I", p.op("QUERY", uniform=True), p.op("KEY"))
    rel = p.op("SUB_I", rel, p.const("CONST_I", 37))
    return p, p.op("ADD_F", p.op("SCORE"), p.gather("GATHER_F", 0, [rel]))


def test_the_kernels_raise_index_error_only_where_the_mask_keeps_an_out_of_bounds_read():
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 2, 37, 8, generator=g) for _ in range(3))
    table = torch.randn(37, generator=g)
    p, out = relative_table_program()
    engine = build.load().engine_id
    band = [torch.zeros(37, dtype=torch.int64), torch.arange(1, 38)]
    args = (0.35, 0.0, 0, 1.0, 16, 8, engine, *p.tensors(), out, [table], 1)
    o, _ = torch.ops.attngrad_fused.forward(q, k, v, None, None, *band, None, None, *args)
    rel = torch.arange(37)[:, None] - torch.arange(37)[None, :]
    bias = torch.where(rel >= 0, table[(rel - 37).clamp(min=-37)], 0.0)
    want = attngrad.attention(
        q, k, v, attn_mask=bias, window=(None, 0), strategy="fused", scale=0.35
    )
    torch.testing.assert_close(o, want, rtol=2e-5, atol=2e-5)
    with pytest.raises(IndexError, match=r"captured tensor 0 of shape \[37\] at index \(-\d+\)"):
        torch.ops.attngrad_fused.forward(q, k, v, *(None,) * 6, *args)


def test_tanh_is_within_3_ulp_over_float32():
    """TANH_F (and the softcap: `tanh_vec`) on a sweep of float32 bit patterns, every
    exponent, both signs and the specials, against tanh in float64."""
    bits = torch.arange(0, 0x7F800000, 997, dtype=torch.int64).to(torch.int32)
    x = bits.view(torch.float32)
    specials = torch.tensor([math.inf, -math.inf, math.nan, 0.0, -0.0, 0.625, -0.625, 44.0])
    x = torch.cat([x, -x, specials])
    p = Program()
    out = p.op("TANH_F", p.op("SCORE"))
    got = rows(p, out, x.reshape(1, 1, 1, -1))[0].reshape(-1)
    want = torch.tanh(x.double())
    assert torch.equal(got.isnan(), want.isnan())
    finite = want.isfinite()
    assert torch.equal(got[~finite & ~want.isnan()], want[~finite & ~want.isnan()].float())
    assert torch.equal(torch.signbit(got[finite]), torch.signbit(want[finite]))
    w = want[finite].float().abs()
    ulp = (torch.nextafter(w, torch.tensor(math.inf)) - w).double()
    assert float(((got[finite].double() - want[finite]).abs() / ulp).max()) <= 3.0
    # the same bits whatever a lane's neighbours: sorted, a vector is mostly all near (the
    # polynomial alone) or all far; shuffled, most mix both
    order = torch.randperm(x.numel(), generator=torch.Generator().manual_seed(0))
    shuffled = rows(p, out, x[order].reshape(1, 1, 1, -1))[0].reshape(-1)
    assert torch.equal(shuffled.view(torch.int32), got[order].view(torch.int32))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_softcap_score_mod_runs_as_the_kernels_softcap(dtype):
    g = torch.Generator().manual_seed(10)
    q, k, v = (torch.randn(1, 2, 70, 8, generator=g, dtype=dtype) * 4 for _ in range(3))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    results = []
    for call in (
        lambda: attngrad.flex_attention(
            q, k, v, lambda s, b, h, i, j: 3.0 * torch.tanh(s / 3.0), strategy="fused"
        ),
        lambda: attngrad.attention(q, k, v, softcap=3.0, strategy="fused"),
    ):
        o = call()
        results.append((o, *torch.autograd.grad(o.sum(), (q, k, v))))
    for got, want in zip(*results, strict=True):
        assert torch.equal(got, want)


def test_closures_made_at_each_call_read_their_own_tensors() -> None:
    # one trace serves every closure of the same code (`score_program._owner`): each call's
    # kernels still read that call's captured tensors, and its gradient reaches them
    g = torch.Generator().manual_seed(21)
    q, k, v = (torch.randn(1, 2, 40, 8, generator=g, dtype=torch.float64) for _ in range(3))
    i, j = torch.arange(40)[:, None], torch.arange(40)[None, :]

    def gated(gate: torch.Tensor):  # type: ignore[no-untyped-def]
        def score(s, b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
            return s * torch.sigmoid(gate[h]) + (q_idx - kv_idx) * 0.25

        return score

    for values in ([0.5, 2.0], [-1.0, 3.0]):
        gate = torch.tensor(values, dtype=torch.float64, requires_grad=True)
        out = attngrad.flex_attention(q, k, v, score_mod=gated(gate), strategy="fused")
        (got,) = torch.autograd.grad(out.square().sum(), gate)
        ref_gate = gate.detach().clone().requires_grad_()
        scores = q @ k.transpose(-2, -1) * 8**-0.5
        scores = scores * torch.sigmoid(ref_gate)[:, None, None] + (i - j) * 0.25
        ref = torch.softmax(scores, dim=-1) @ v
        (want,) = torch.autograd.grad(ref.square().sum(), ref_gate)
        assert torch.allclose(out, ref, rtol=1e-12, atol=1e-12)
        assert torch.allclose(got, want, rtol=1e-10, atol=1e-12)
