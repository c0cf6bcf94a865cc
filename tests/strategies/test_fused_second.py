"""The second-order pass in fused's C++ kernels (``csrc/second.h``) against float64.

What autograd calls when fused's gradients are differentiated again: double backward with
``create_graph=True`` (a gradient penalty, Hessian-vector products), ``torch.func.hessian``
and jacfwd(jacrev).  Every test but the fallback's runs with the shared tiled pass
(`attngrad.autograd.second_order.second_order`) made to raise, so each answer is the
kernel's.  The loss L = <O, w> + <lse, w_lse> + (|O|^2 + |lse|^2) / 2 makes dO and dlse depend on
O and lse, so their gradients are exercised too.  float64 agrees with autograd through the
reference to 1e-9 with every keyword; each cotangent is checked on its own (a term the
kernel dropped shows); float32 and bfloat16 pass the error rule against the plain
computation's own double backward; results are bitwise the same for any thread count.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from test_fused_tangent import (  # _library: the autouse fixture that builds the kernels
    CASES,
    TOL64,
    Call,
    _causal,
    _library,  # noqa: F401
    _plain,
    refuse,
    threads,
)
from torch.nn.attention.flex_attention import create_block_mask

import attngrad
from attngrad.autograd import second_order
from attngrad.strategies.fused.strategy import Fused
from attngrad.verify.derivatives import relative_error
from attngrad.verify.reference import reference_attention
from attngrad.verify.rule import judge, rounding_floor


@pytest.fixture
def kernel_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The shared tiled pass raises: double backward must take fused's kernel."""
    refuse(monkeypatch, second_order, "second_order", "the shared tiled second-order pass")


def _draws(call: Call, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        n: torch.randn(t.shape, generator=g, dtype=torch.float64) for n, t in call.primals.items()
    }


def _second(
    fn: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    primals: dict[str, torch.Tensor],
    cotangents: dict[str, torch.Tensor],
    dtype: torch.dtype | None = None,
    seed: int = 2,
) -> tuple[torch.Tensor, ...]:
    """The gradients of <g, cotangents> w.r.t. the primals, g = grad(L, primals) with
    create_graph=True, L = <O, w> + <lse, w_lse> + (|O|^2 + |lse|^2) / 2, lse over the rows
    that attend something (inputs cast to ``dtype`` first, when given)."""
    cast = (lambda t: t) if dtype is None else (lambda t: t.to(dtype))
    leaves = {n: cast(t).detach().requires_grad_() for n, t in primals.items()}
    out, lse = fn(**leaves)
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out.shape, generator=g, dtype=torch.float64).to(out.dtype)
    w_lse = torch.randn(lse.shape, generator=g, dtype=torch.float64).to(lse.dtype)
    live = torch.isfinite(lse.detach())
    lse = lse.masked_fill(~live, 0)
    loss = (out * w).sum() + (lse * w_lse).sum() + (out.square().sum() + lse.square().sum()) / 2
    names = list(leaves)
    firsts = torch.autograd.grad(loss, [leaves[n] for n in names], create_graph=True)
    inner = sum((a * cast(cotangents[n])).sum() for n, a in zip(names, firsts, strict=True))
    return torch.autograd.grad(inner, [leaves[n] for n in names])


def _check64(call: Call, cotangents: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The kernel's second derivatives in float64 against the reference's, within 1e-9."""
    got = _second(call.fused, call.primals, cotangents)
    want = _second(call.reference, call.primals, cotangents)
    for name, a, b in zip(call.primals, got, want, strict=True):
        assert torch.isfinite(a).all(), name
        assert relative_error({name: a}, {name: b}) <= TOL64, name
    return got


# a score function run as a program has no second-order kernel: the tiled pass takes it
# (`test_the_kernel_runs_and_declines_a_score_program`)
KERNEL_CASES = [name for name in CASES if name != "flex-program"]


@pytest.mark.usefixtures("kernel_only")
@pytest.mark.parametrize("name", KERNEL_CASES)
def test_float64_matches_the_reference(name: str) -> None:
    call = CASES[name](torch.float64)
    _check64(call, _draws(call, 1))


@pytest.mark.usefixtures("kernel_only")
@pytest.mark.parametrize("name", ["softcap", "gqa-causal", "dropout", "blockmask-dilated"])
def test_each_cotangent_is_its_own_term(name: str) -> None:
    # one gradient's cotangent at a time (g_q: through G's g_q k^T and grad k's dS^T g_q;
    # g_k; g_v: through W and grad dO's P g_v; the mask's: through G and S-hat), each
    # against the reference, and each moves every input's answer
    call = CASES[name](torch.float64)
    full = _draws(call, 1)
    for moved in full:
        alone = {n: t if n == moved else torch.zeros_like(t) for n, t in full.items()}
        got = _check64(call, alone)
        assert all(a.abs().max() > 1e-3 for a in got), moved


@pytest.mark.usefixtures("kernel_only")
def test_the_kernel_runs_and_declines_a_score_program(monkeypatch: pytest.MonkeyPatch) -> None:
    # counted: a plain call and a relative score function take the kernel; a score program
    # (s * 0.5 is no relative term) takes the shared tiled pass and still matches
    ran: list[bool] = []
    kernel = Fused.second_order

    def counted(self: Fused, *args: Any) -> Any:
        result = kernel(self, *args)
        ran.append(result is not None)
        return result

    monkeypatch.setattr(Fused, "second_order", counted)
    call = CASES["plain"](torch.float64)
    _check64(call, _draws(call, 1))
    assert ran == [True]
    monkeypatch.undo()
    monkeypatch.setattr(Fused, "second_order", counted)
    g = torch.Generator().manual_seed(3)
    q, k, v, u = (torch.randn(1, 2, 20, 8, generator=g, dtype=torch.float64) for _ in range(4))

    def halved(q: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = attngrad.flex_attention(
            q, k, v, score_mod=lambda s, b, h, i, j: s * 0.5, strategy="fused"
        )
        return out

    def reference(q: torch.Tensor) -> torch.Tensor:
        return reference_attention(q, k, v, scale=0.5 * 8**-0.5)

    hvps = []
    for f in (halved, reference):
        x = q.clone().requires_grad_()
        (grad,) = torch.autograd.grad(f(x).square().sum(), x, create_graph=True)
        hvps.append(torch.autograd.grad((grad * u).sum(), x)[0])
    assert ran[1:] == [False] and relative_error({"h": hvps[0]}, {"h": hvps[1]}) <= TOL64


def _alibi_call(table: bool) -> Callable[..., Call]:
    """A relative score function with a learnable tensor, through flex_attention with a
    causal BlockMask: ALiBi ``s - exp(m[h]) * (i - j)`` (a curved term: its second
    derivative in m is not zero) or a relative table ``s + t[h, i - j + N - 1]``."""
    b, h, n, d = 2, 3, 50, 8
    blocks = create_block_mask(_causal, None, None, n, n, "cpu", BLOCK_SIZE=16)
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]

    def build_call(dtype: torch.dtype, seed: int = 0) -> Call:
        g = torch.Generator().manual_seed(seed)
        x = {name: torch.randn(b, h, n, d, generator=g).to(dtype).double() for name in "qkv"}
        shape = (h, 2 * n - 1) if table else (h,)
        x["m"] = (0.1 * torch.randn(shape, generator=g, dtype=torch.float64)).to(dtype).double()

        def term(m: torch.Tensor) -> torch.Tensor:
            if table:
                return m[:, i - j + n - 1]
            return -torch.exp(m)[:, None, None] * (i - j)

        def fused(**t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            q, k, v, m = (t[n_].to(dtype) for n_ in ("q", "k", "v", "m"))

            def score(s, b_, h_, i_, j_):  # type: ignore[no-untyped-def]
                if table:
                    return s + m[h_, i_ - j_ + n - 1]
                return s - torch.exp(m[h_]) * (i_ - j_)

            out, lse = attngrad.flex_attention(
                q, k, v, score_mod=score, block_mask=blocks, return_lse=True, strategy="fused"
            )
            return out, lse

        def reference(**t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            bias = term(t["m"]).masked_fill(i < j, float("-inf"))
            out = reference_attention(t["q"], t["k"], t["v"], bias)
            scores = t["q"] @ t["k"].transpose(-2, -1) * d**-0.5 + bias
            return out, torch.logsumexp(scores, dim=-1)

        return Call(x, fused, reference, i >= j)

    return build_call


@pytest.mark.usefixtures("kernel_only")
@pytest.mark.parametrize("table", [False, True], ids=["alibi", "table"])
def test_a_relative_score_function_runs_in_the_kernel(table: bool) -> None:
    # its captured tensor's second-order terms: dS and S-hat summed along the diagonals, then
    # the term's own derivatives; the captured tensor's cotangent moves G by D'
    call = _alibi_call(table)(torch.float64)
    full = _draws(call, 4)
    _check64(call, full)
    alone = {n: t if n == "m" else torch.zeros_like(t) for n, t in full.items()}
    got = _check64(call, alone)
    assert all(a.abs().max() > 1e-4 for a in got)


@pytest.mark.usefixtures("kernel_only")
def test_hessian_and_vmap_take_the_kernel() -> None:
    # torch.func.hessian (jacfwd over jacrev: the gradients' jvp calls the second-order
    # pass, vmapped over the basis) and gradgradcheck, bias and GQA included
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 5, 3, generator=g, dtype=torch.float64) for _ in range(3))
    bias = torch.randn(2, 5, 5, generator=g, dtype=torch.float64)

    def loss(f: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        return lambda q, k, v, m: (f(q, k, v, m) ** 2).sum()

    def ours(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        return attngrad.attention(
            q, k, v, attn_mask=m, softcap=1.5, strategy="fused", block_q=2, block_k=4
        )

    def theirs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        return reference_attention(q, k, v, m, softcap=1.5)

    got = torch.func.hessian(loss(ours), argnums=(0, 1, 2, 3))(q, k, v, bias)
    want = torch.func.hessian(loss(theirs), argnums=(0, 1, 2, 3))(q, k, v, bias)
    for row_a, row_b in zip(got, want, strict=True):
        for a, b in zip(row_a, row_b, strict=True):
            assert relative_error({"h": a}, {"h": b}) <= TOL64
    x = [t[..., :4, :2].clone().requires_grad_() for t in (q, k, v)]
    m = bias[..., :4, :4].clone().requires_grad_()
    assert torch.autograd.gradgradcheck(ours, (*x, m))


def _floors(call: Call, dtype: torch.dtype) -> list[torch.Tensor]:
    """The floor of each second derivative (`rounding_floor`): its float64 magnitude as the
    magnitude of its sums (each result is a few products' sums over at most n = max(2d, Nk)
    terms, run in the compute dtype) and no scores' term (the plain run's error, which the
    rule doubles, carries the scores' rounding)."""
    want = _second(call.reference, call.primals, _draws(call, 1))
    q, k = call.primals["q"], call.primals["k"]
    n, d = max(2 * q.shape[-1], k.shape[-2]), q.shape[-1]
    return [rounding_floor(a.abs(), torch.zeros_like(a), dtype, n, d) for a in want]


@pytest.mark.usefixtures("kernel_only")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["plain", "bias", "padding", "gqa-causal", "blockmask-dilated"])
def test_low_precision_passes_the_rule(name: str, dtype: torch.dtype) -> None:
    call = CASES[name](dtype)
    u = _draws(call, 1)
    got = _second(call.fused, call.primals, u, dtype)
    ref = _second(call.reference, call.primals, u)
    plain = _second(_plain(call), call.primals, u, dtype)
    for what, a, r, p, f in zip(call.primals, got, ref, plain, _floors(call, dtype), strict=True):
        assert a.dtype == dtype
        verdict = judge(what, a, r, f, p)
        assert verdict.passed, str(verdict)
        # an answer 1% off in float32, 5% in bfloat16, fails the same rule
        off = 1.01 if dtype == torch.float32 else 1.05
        assert not judge(what, a.double() * off, r, f, p).passed, what


@pytest.mark.usefixtures("kernel_only")
def test_bitwise_identical_for_any_thread_count() -> None:
    # B * Hkv = 1: four slabs of row blocks, their grad k and grad v joined after the units
    g = torch.Generator().manual_seed(9)
    x = {n: torch.randn(1, 1, 200, 16, generator=g) for n in "qkv"}
    u = {n: torch.randn(1, 1, 200, 16, generator=g) for n in "qkv"}

    def fn(**t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = attngrad.attention(
            t["q"], t["k"], t["v"], is_causal=True, dropout_p=0.2, return_lse=True,
            generator=torch.Generator().manual_seed(1), strategy="fused", block_q=16, block_k=32,
        )  # fmt: skip
        return out, lse

    with threads(1):
        one = _second(fn, x, u)
    with threads(2):
        two = _second(fn, x, u)
    assert all(torch.equal(a, b) for a, b in zip(one, two, strict=True))


@pytest.mark.parametrize("output", range(6))
def test_a_wrong_second_order_output_is_caught(
    output: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a planted bug in each of the kernel's outputs (grad dO, grad dlse, grad q, grad k,
    # grad v, grad bias), 1e-6 off: the float64 check fails
    kernel = Fused.second_order

    def off(self: Fused, *args: Any) -> Any:
        result = list(kernel(self, *args))
        if result[output] is not None:
            result[output] = result[output] * (1 + 1e-6)
        return tuple(result)

    monkeypatch.setattr(Fused, "second_order", off)
    call = CASES["bias"](torch.float64)
    with pytest.raises(AssertionError):
        _check64(call, _draws(call, 1))
