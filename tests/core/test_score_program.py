"""Score programs (`attngrad.core.score_program`): traced score functions and their
pullbacks, run by a torch-op interpreter (`score_program_eval`), against autograd on the
function itself, in float64; each derivative rule planted wrong is caught."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from attngrad.core import score_program
from attngrad.core.pointwise import Reads, TileIndex, broadcast_axes
from attngrad.core.score_program import RULES, ScoreProgram, compile_score
from score_program_eval import run

B, H, N = 2, 3, 6
_g = torch.Generator().manual_seed(7)


def _randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=_g, dtype=torch.float64)


slope, g, table, t5 = _randn(H), _randn(H), _randn(H, 2 * N - 1), _randn(H, 32)
scale0 = _randn(())
keys = torch.randint(0, N, (H, N), generator=_g)


def t5_buckets(s, b, h, i, j):  # type: ignore[no-untyped-def]
    d = (i - j).abs()
    big = (torch.log(d.float().clamp(min=1) / 2) / torch.log(torch.tensor(16.0)) * 8).long()
    bucket = torch.where(d < 2, d, torch.clamp(2 + big, max=15))
    return s + t5[h, bucket + 16 * (i > j)]


FUNCTIONS: dict[str, tuple[Callable[..., torch.Tensor], list[torch.Tensor]]] = {
    "alibi": (lambda s, b, h, i, j: s + slope[h] * (j - i), [slope]),
    "relative": (lambda s, b, h, i, j: s + table[h, i - j + N - 1], [table]),
    "t5": (t5_buckets, [t5]),
    "gate": (lambda s, b, h, i, j: s * torch.sigmoid(g[h]), [g]),
    "softcap": (lambda s, b, h, i, j: 2.5 * torch.tanh(s / 2.5), []),
    "branches": (
        lambda s, b, h, i, j: torch.where(
            i >= j,
            torch.maximum(s, g[h]).abs().sqrt() * torch.exp(-s.clamp(-1, 0.5)),
            s.clamp(min=0.2) % 0.7,
        ),
        [g],
    ),
    "smooth": (
        lambda s, b, h, i, j: (
            torch.log(1 + s * s)
            - (s - g[h]).abs() / (2 + torch.minimum(s, g[h]))
            + torch.floor(s)
            + s.detach() // 0.3
            - (-s)
        ),
        [g],
    ),
    "integers": (
        lambda s, b, h, i, j: (
            torch.where(((i > j) & ~(j == 0)) | (b == 1), s, -s)
            + table[(i * 3 + j) % H, (j // 2) - i.clamp(max=3) + N]
        ),
        [table],
    ),
    "alpha": (
        lambda s, b, h, i, j: (
            torch.add(s, g[h], alpha=0.5)
            - torch.sub(s, slope[h], alpha=2.0)
            + torch.rsub(s, g[h], alpha=3.0)
        ),
        [g, slope],
    ),
    "int_capture": (lambda s, b, h, i, j: s + table[h, keys[h, j]], [table, keys]),
    "scalars": (
        lambda s, b, h, i, j: s * scale0 + torch.tensor(2.0) * g[0][()] + table[0][h],
        [scale0, g, table],
    ),
}


def _scores() -> torch.Tensor:
    s = _randn(B, H, N, N)
    s[..., 0] = g.view(1, H, 1)  # ties of maximum / minimum with g[h]
    s[..., 1] = -1.0  # on a clamp's bounds
    s[..., 2] = 0.5
    return s


S, DS = _scores(), _randn(B, H, N, N)


def _reference(fn: Callable[..., torch.Tensor], captured: list[torch.Tensor]):  # type: ignore[no-untyped-def]
    """(f(S), dS, d captured) by autograd on the function itself."""
    x = S.clone().requires_grad_()
    theta = [t.clone().requires_grad_(t.is_floating_point()) for t in captured]
    index = TileIndex.of(B, B, H, slice(0, N), slice(0, N), torch.device("cpu"))
    with Reads((), {id(c): t for c, t in zip(captured, theta, strict=True)}):
        y = fn(x, *broadcast_axes(index)).expand(S.shape)
    inputs = [x, *(t for t in theta if t.requires_grad)]
    grads = torch.autograd.grad(y, inputs, DS, allow_unused=True, materialize_grads=True)
    return y.detach(), grads[0], list(grads[1:])


def _compiled(fn: Callable[..., torch.Tensor], captured: list[torch.Tensor]) -> ScoreProgram:
    program = compile_score(fn, captured, torch.float64, [t.is_floating_point() for t in captured])
    assert isinstance(program, ScoreProgram), program
    return program


def _errors(name: str) -> tuple[float, float, float]:
    fn, captured = FUNCTIONS[name]
    program = _compiled(fn, captured)
    reads = [*captured, *program.made]
    values, _ = run(program.forward, S, reads, B)
    ds, sums = run(program.pullback, S, reads, B, DS)
    y, ref_ds, ref_theta = _reference(fn, captured)
    theta = [sums[n] for n in program.wanted]
    dtheta = max(
        ((a - b).abs().max().item() for a, b in zip(theta, ref_theta, strict=True)), default=0.0
    )
    return (values - y).abs().max().item(), (ds - ref_ds).abs().max().item(), dtheta


@pytest.mark.parametrize("name", FUNCTIONS)
def test_programs_and_pullbacks_match_autograd(name: str) -> None:
    values, ds, dtheta = _errors(name)
    # the same ops in the same order on the same values; torch's add and sub with alpha may
    # round x + alpha y once (a fused multiply-add), the program rounds alpha y first
    assert values == 0.0 or (name == "alpha" and values <= 1e-14), values
    assert ds <= 1e-12 and dtheta <= 1e-12, (ds, dtheta)


def test_row_constant_values_are_marked_uniform() -> None:
    program = _compiled(*FUNCTIONS["alibi"])
    uniform = {i.op: i.uniform for i in program.forward.instructions}
    assert uniform["GATHER_F"] and uniform["HEAD"] and uniform["QUERY"]
    assert not uniform["KEY"] and not uniform["SCORE"] and not uniform["ADD_F"]
    (scatter,) = [i for i in program.pullback.instructions if i.op == "SCATTER"]
    assert scatter.uniform  # slope[h]'s gradient: one sum per row


@pytest.mark.parametrize("op", sorted(RULES))
def test_a_wrong_derivative_rule_is_caught(op: str, monkeypatch: pytest.MonkeyPatch) -> None:
    right = RULES[op]

    def wrong(b, ins, grad, add):  # type: ignore[no-untyped-def]
        right(b, ins, b.emit("MUL_F", grad, b.const(1.001, "F")), add)

    users = [name for name in FUNCTIONS if op in _ops(name)]
    assert users, f"no function uses {op}"
    monkeypatch.setitem(RULES, op, wrong)
    monkeypatch.setattr(score_program, "_CACHE", type(score_program._CACHE)())
    worst = max(max(_errors(name)[1:]) for name in users)
    assert worst > 1e-6, f"no function's derivative caught a wrong {op} rule"


def _ops(name: str) -> set[str]:
    return {i.op for i in _compiled(*FUNCTIONS[name]).forward.instructions}


def test_an_op_outside_the_table_is_named() -> None:
    reason = compile_score(lambda s, b, h, i, j: torch.sin(s), [], torch.float32, [])
    assert isinstance(reason, str) and "sin" in reason


def test_programs_are_cached_per_closure_constant() -> None:
    def softcap(c: float) -> Callable[..., torch.Tensor]:
        return lambda s, b, h, i, j: c * torch.tanh(s / c)

    f = softcap(2.0)
    assert compile_score(f, [], torch.float64, []) is compile_score(f, [], torch.float64, [])
    a, b = (_compiled(softcap(c), []) for c in (2.0, 3.0))
    assert {i.imm for i in a.forward.instructions} != {i.imm for i in b.forward.instructions}


def test_a_closure_made_at_each_call_is_traced_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # a model's forward defines its score_mod anew each call: one trace per code object
    # while the closure holds scalars and tensors (the tensors read by identity at run time);
    # another scalar traces again, and a closure holding anything else is cached per function
    traced: list[object] = []
    compile_ = score_program._compile

    def counted(fn, *args):  # type: ignore[no-untyped-def]
        traced.append(fn)
        return compile_(fn, *args)

    monkeypatch.setattr(score_program, "_compile", counted)
    monkeypatch.setattr(score_program, "_CACHE", type(score_program._CACHE)())

    def alibi(m: torch.Tensor, c: float) -> Callable[..., torch.Tensor]:
        return lambda s, b, h, i, j: s * c - m[h] * (i - j)

    one, two = torch.rand(4), torch.rand(4)
    first = compile_score(alibi(one, 1.0), [one], torch.float64, [True])
    assert compile_score(alibi(two, 1.0), [two], torch.float64, [True]) is first
    assert len(traced) == 1
    compile_score(alibi(two, 2.0), [two], torch.float64, [True])
    assert len(traced) == 2

    def listed(m: list[float]) -> Callable[..., torch.Tensor]:
        return lambda s, b, h, i, j: s * m[0]

    for _ in range(2):
        compile_score(listed([1.0]), [], torch.float64, [])
    assert len(traced) == 4


def _traced_imm(fn: Callable[..., torch.Tensor], captured: list[torch.Tensor]) -> object:
    """What ``fn``'s compiled forward program computes, as its instructions (op, imm)."""
    program = compile_score(fn, captured, torch.float64, [False] * len(captured))
    assert not isinstance(program, str), program
    return [(i.op, i.imm) for i in program.forward.instructions]


def test_one_code_object_never_serves_another_functions_program() -> None:
    # what the key must tell apart among functions of one code object: a bound method's
    # instance, keyword-only defaults, None cells by position, a tensor read for its shape
    class Scaled:
        def __init__(self, c: float) -> None:
            self.c = c

        def mod(self, s, b, h, i, j):  # type: ignore[no-untyped-def]
            return s * self.c

    assert _traced_imm(Scaled(1.0).mod, []) != _traced_imm(Scaled(3.0).mod, [])

    def keyword(c: float) -> Callable[..., torch.Tensor]:
        def f(s, b, h, i, j, *, k=c):  # type: ignore[no-untyped-def]
            return s * k

        return f

    assert _traced_imm(keyword(1.0), []) != _traced_imm(keyword(5.0), [])

    def either(scale: float | None, bias: float | None) -> Callable[..., torch.Tensor]:
        def f(s, b, h, i, j):  # type: ignore[no-untyped-def]
            return s * scale if bias is None else s + bias

        return f

    assert _traced_imm(either(2.0, None), []) != _traced_imm(either(None, 2.0), [])

    def shaped(w: torch.Tensor) -> Callable[..., torch.Tensor]:
        return lambda s, b, h, i, j: s + (i - j) * w.shape[0]

    assert _traced_imm(shaped(torch.ones(4)), []) != _traced_imm(shaped(torch.ones(7)), [])


def test_a_scalar_changing_at_every_call_keeps_a_bounded_cache(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # an annealed temperature: a new program per value, the oldest dropped past the cap
    monkeypatch.setattr(score_program, "_CACHE", type(score_program._CACHE)())

    def tempered(t: float) -> Callable[..., torch.Tensor]:
        return lambda s, b, h, i, j: s / t

    fns = [tempered(1.0 + n / 100) for n in range(score_program._PER_OWNER + 10)]
    for fn in fns:
        compile_score(fn, [], torch.float64, [])
    (known,) = score_program._CACHE.values()
    assert len(known) == score_program._PER_OWNER


@pytest.mark.parametrize(
    ("fn", "cap"),
    [
        (lambda s, b, h, i, j: 30.0 * torch.tanh(s / 30.0), 30.0),
        (lambda s, b, h, i, j: torch.tanh(s / 7.5) * 7.5, 7.5),
        (lambda s, b, h, i, j: s.div(2.0).tanh().mul(2.0), 2.0),
        (lambda s, b, h, i, j: 30.0 * torch.tanh(s / 20.0), None),
        (lambda s, b, h, i, j: -3.0 * torch.tanh(s / -3.0), None),
        (lambda s, b, h, i, j: 30.0 * torch.tanh(s * (1 / 30.0)), None),
        (lambda s, b, h, i, j: 30.0 * torch.tanh((s + 1) / 30.0), None),
        (lambda s, b, h, i, j: 30.0 * torch.tanh(s / 30.0) + 1, None),
        (lambda s, b, h, i, j: (s + i - j) * torch.tanh(s / 30.0), None),
    ],
    ids=[
        "c*tanh(s/c)",
        "tanh(s/c)*c",
        "methods",
        "two-caps",
        "negative",
        "times-inverse",
        "shifted",
        "plus-one",
        "not-constant",
    ],
)
def test_softcap_of_finds_exactly_the_softcap(
    fn: Callable[..., torch.Tensor], cap: float | None
) -> None:
    assert score_program.softcap_of(_compiled(fn, []).forward) == cap


@pytest.mark.parametrize("transform", ["grad", "jvp", "vmap"])
def test_a_capture_under_a_torch_func_transform_is_read_as_the_capture(transform: str) -> None:
    """The transform's wrapper of a captured tensor is the closure's tensor to the program:
    read as capture 0, the score as SCORE (not a constant the trace copied)."""
    seen: list[ScoreProgram] = []

    def f(cap: torch.Tensor) -> torch.Tensor:
        fn = lambda s, b, h, i, j: cap * torch.tanh(s / cap)  # noqa: E731
        seen.append(_compiled(fn, [cap]))
        return cap * 2

    cap = torch.tensor([1.5], dtype=torch.float64)
    if transform == "grad":
        torch.func.grad(lambda c: f(c).sum())(cap)
    elif transform == "jvp":
        torch.func.jvp(f, (cap,), (torch.ones_like(cap),))
    else:
        torch.func.vmap(f)(cap.expand(3, 1))
    (program,) = seen
    ops = {(i.op, i.capture) for i in program.forward.instructions}
    assert ("SCORE", -1) in ops and ("GATHER_F", 0) in ops and not program.made
