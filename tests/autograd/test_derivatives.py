"""Every derivative on every strategy: double backward, forward mode, torch.func, lse.

Each is compared in float64 with autograd through the plain composite
(`attngrad.verify.reference`), whose derivatives of any order autograd takes op by
op, and checked with gradcheck / gradgradcheck.  float64 rounding of these
small problems is ~1e-15 relative; 1e-9 leaves room for error growth through
two differentiations while a wrong term (O(1) relative) fails by far.
"""

from __future__ import annotations

import pytest
import torch
from torch.autograd import gradcheck, gradgradcheck
from torch.utils._python_dispatch import TorchDispatchMode

import attngrad
from attngrad.core.ops import compute_dtype
from attngrad.strategies import unavailable_reason
from attngrad.verify.reference import reference_attention, reference_lse
from attngrad.verify.rule import score_error, unit_roundoff
from helpers import TENSOR_STRATEGIES

TOL = 1e-9

# (name, q/k/v/mask shapes, options): Nq != Nk, dv != d, GQA, causal, window, scale,
# a broadcast float mask requiring grad, bool masks with a row that attends nothing
CASES = {
    "plain": ((1, 2, 5, 4), (1, 2, 7, 4), (1, 2, 7, 3), None, {}),
    "gqa-causal": ((2, 4, 6, 4), (2, 2, 6, 4), (2, 2, 6, 4), None, {"is_causal": True, "enable_gqa": True}),
    "float-mask-window": (
        (1, 2, 5, 4), (1, 1, 7, 4), (1, 1, 7, 5), (1, 5, 7),
        {"window": (2, 1), "scale": 0.3, "enable_gqa": True},
    ),
    "bool-dead-row": ((1, 2, 5, 3), (1, 2, 6, 3), (1, 2, 6, 3), "bool", {}),
    "finite-dead-row": ((1, 1, 4, 3), (1, 1, 5, 3), (1, 1, 5, 3), "dead-float", {}),
}  # fmt: skip


def _tiny(shape: tuple[int, ...]) -> tuple[int, ...]:
    """A shape with sequence lengths and head dims cut to at most 4 and 2 (for gradgradcheck)."""
    *lead, n, d = shape
    return (*lead, min(n, 4), min(d, 2))


def _inputs(
    name: str, seed: int = 0, tiny: bool = False
) -> tuple[list[torch.Tensor], dict[str, object]]:
    """[q, k, v] (+ a float mask) as float64 leaves requiring grad, and the call's options.

    ``tiny``: sequences of at most 4 and head dims of at most 2, so that
    gradgradcheck's finite differences (two per input element) stay quick.
    """
    qs, ks, vs, ms, options = CASES[name]
    if tiny:
        qs, ks, vs = _tiny(qs), _tiny(ks), _tiny(vs)
        ms = ms if not isinstance(ms, tuple) else (*ms[:-2], qs[-2], ks[-2])
        options = {k: v for k, v in options.items() if k != "window"} | (
            {"window": (1, 1)} if "window" in options else {}
        )
    gen = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(s, generator=gen, dtype=torch.float64) for s in (qs, ks, vs)]
    options = dict(options)
    if ms == "bool":
        keep = torch.rand(qs[-2], ks[-2], generator=gen) > 0.3
        keep[1] = False  # query row 1 attends nothing
        options["attn_mask"] = keep
    elif ms == "dead-float":  # a float mask whose row 2 is -inf throughout: a dead row
        bias = torch.randn(qs[-2], ks[-2], generator=gen, dtype=torch.float64)
        bias[2] = float("-inf")
        tensors.append(bias)
    elif ms is not None:
        tensors.append(torch.randn(ms, generator=gen, dtype=torch.float64))
    return [t.requires_grad_() for t in tensors], options


def _fn(strategy: str | None, options: dict[str, object], lse: bool = False):
    """(q, k, v[, mask]) -> out (and lse): attngrad's strategy, or the composite when None."""

    def run(q, k, v, mask=None):
        kw = dict(options)
        if mask is not None:
            kw["attn_mask"] = mask
        if strategy is None:
            ref = {
                n: kw.get(n) for n in ("attn_mask", "is_causal", "scale", "enable_gqa", "window")
            }
            ref["is_causal"] = bool(ref["is_causal"])
            ref["enable_gqa"] = bool(ref["enable_gqa"])
            out = reference_attention(q, k, v, **ref)  # type: ignore[arg-type]
            if not lse:
                return out
            return out, reference_lse(q, k, **ref)  # type: ignore[arg-type]
        blocks = {"block_q": 2, "block_k": 3} if strategy == "flash" else {}
        return attngrad.attention(q, k, v, strategy=strategy, return_lse=lse, **blocks, **kw)

    return run


def _close(got: torch.Tensor | None, want: torch.Tensor | None) -> None:
    if want is None:
        assert got is None or not got.any()
        return
    assert got is not None and torch.isfinite(got).all()
    err = (got - want).abs().max().item()
    assert err <= TOL * (1 + want.abs().max().item()), err


def _second_order(fn, inputs: list[torch.Tensor], penalty: bool) -> tuple[torch.Tensor, ...]:
    """Gradients of sum_i <dL/dx_i, u_i> (+ a penalty |dL/dq|^2) w.r.t. every input.

    L = <out, w> (dO = w, constant) or, with ``penalty``, L = |out|^2 / 2, whose
    dO = out depends on the inputs (the second-order path through dO).
    """
    gen = torch.Generator().manual_seed(1)
    out = fn(*inputs)
    w = torch.randn(out.shape, generator=gen, dtype=out.dtype)
    loss = (out * out).sum() / 2 if penalty else (out * w).sum()
    grads = torch.autograd.grad(loss, inputs, create_graph=True)
    us = [torch.randn(g.shape, generator=gen, dtype=g.dtype) for g in grads]
    total = sum((g * u).sum() for g, u in zip(grads, us, strict=True)) + grads[0].pow(2).sum()
    return torch.autograd.grad(total, inputs, allow_unused=True)


@pytest.mark.parametrize("penalty", [False, True], ids=["constant-dO", "dO-depends"])
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("strategy", TENSOR_STRATEGIES)
def test_double_backward_matches_the_composite(strategy: str, name: str, penalty: bool) -> None:
    inputs, options = _inputs(name)
    got = _second_order(_fn(strategy, options), inputs, penalty)
    want = _second_order(_fn(None, options), inputs, penalty)
    for g, w in zip(got, want, strict=True):
        _close(g, w)


@pytest.mark.parametrize("name", ["plain", "gqa-causal", "float-mask-window", "bool-dead-row"])
@pytest.mark.parametrize("strategy", TENSOR_STRATEGIES)
def test_gradgradcheck(strategy: str, name: str) -> None:
    inputs, options = _inputs(name, tiny=True)
    assert gradgradcheck(_fn(strategy, options), inputs)


@pytest.mark.parametrize("strategy", TENSOR_STRATEGIES)
def test_gradgradcheck_of_lse_and_batched_checks(strategy: str) -> None:
    inputs, options = _inputs("float-mask-window", tiny=True)
    fn = _fn(strategy, options, lse=True)
    assert gradcheck(fn, inputs, check_batched_grad=True, check_forward_ad=True)
    assert gradgradcheck(fn, inputs, check_batched_grad=True, check_fwd_over_rev=True)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("strategy", TENSOR_STRATEGIES)
def test_jvp_of_out_and_lse_matches_the_composite(strategy: str, name: str) -> None:
    inputs, options = _inputs(name)
    primals = tuple(t.detach() for t in inputs)
    gen = torch.Generator().manual_seed(2)
    tangents = tuple(torch.randn(t.shape, generator=gen, dtype=t.dtype) for t in primals)
    (out, lse), (d_out, d_lse) = torch.func.jvp(_fn(strategy, options, lse=True), primals, tangents)
    (ref, ref_lse), (d_ref, d_ref_lse) = torch.func.jvp(
        _fn(None, options, lse=True), primals, tangents
    )
    _close(out, ref)
    _close(d_out, d_ref)
    live = torch.isfinite(ref_lse)
    assert bool((~live).any()) == name.endswith("dead-row") and live.any()
    assert torch.equal(lse[~live], ref_lse[~live])  # -inf on rows that attend nothing
    _close(lse[live], ref_lse[live])
    _close(d_lse[live], d_ref_lse[live])
    assert not d_lse[~live].any()
    # the same through torch.autograd.forward_ad dual tensors
    import torch.autograd.forward_ad as fwAD

    with fwAD.dual_level():
        duals = [fwAD.make_dual(p, t) for p, t in zip(primals, tangents, strict=True)]
        dual_out, _ = _fn(strategy, options, lse=True)(*duals)
        _close(fwAD.unpack_dual(dual_out).tangent, d_ref)


@pytest.mark.parametrize("strategy", TENSOR_STRATEGIES)
def test_torch_func_transforms_match_the_composite(strategy: str) -> None:
    inputs, options = _inputs("float-mask-window")
    q, k, v, mask = (t.detach() for t in inputs)
    ours, ref = _fn(strategy, options), _fn(None, options)

    def loss(f):
        return lambda q, k, v, mask: (f(q, k, v, mask) ** 2).sum()

    for transform in (torch.func.grad, torch.func.jacrev, torch.func.jacfwd, torch.func.hessian):
        got = transform(loss(ours), argnums=(0, 1, 2, 3))(q, k, v, mask)
        want = transform(loss(ref), argnums=(0, 1, 2, 3))(q, k, v, mask)
        for g, w in zip(
            torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want), strict=True
        ):
            _close(g, w)
    out, pull = torch.func.vjp(ours, q, k, v, mask)
    _, ref_pull = torch.func.vjp(ref, q, k, v, mask)
    cot = torch.randn_like(out)
    for g, w in zip(pull(cot), ref_pull(cot), strict=True):
        _close(g, w)
    jac = torch.func.jacrev(ours, argnums=1)(q, k, v, mask)
    _close(jac, torch.func.jacrev(ref, argnums=1)(q, k, v, mask))


@pytest.mark.parametrize("strategy", TENSOR_STRATEGIES)
def test_per_sample_gradients_equal_a_loop(strategy: str) -> None:
    # a tiny attention layer: per-sample gradients of its projection weights, vmap(grad)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, 6, 8, generator=gen, dtype=torch.float64)  # 4 samples of [N=6, d=8]
    mask = torch.randn(6, 6, generator=gen, dtype=torch.float64)
    params = {n: torch.randn(8, 8, generator=gen, dtype=torch.float64) for n in ("wq", "wk", "wv")}

    def loss(params, mask, x):
        q, k, v = (x @ params[n] for n in ("wq", "wk", "wv"))
        heads = [t.view(6, 2, 4).transpose(0, 1).unsqueeze(0) for t in (q, k, v)]
        out = attngrad.attention(*heads, attn_mask=mask, strategy=strategy)
        return out.pow(2).sum()

    batched = torch.func.vmap(torch.func.grad(loss, argnums=(0, 1)), in_dims=(None, None, 0))(
        params, mask, x
    )
    for i in range(x.shape[0]):
        one = torch.func.grad(loss, argnums=(0, 1))(params, mask, x[i])
        for n in params:
            _close(batched[0][n][i], one[0][n])
        _close(batched[1][i], one[1])


@pytest.mark.parametrize("strategy", TENSOR_STRATEGIES)
def test_is_grads_batched_rows_equal_separate_backwards(strategy: str) -> None:
    inputs, options = _inputs("gqa-causal")
    out = _fn(strategy, options)(*inputs)
    cots = torch.randn(3, *out.shape, dtype=out.dtype)
    batched = torch.autograd.grad(out, inputs, cots, is_grads_batched=True, retain_graph=True)
    for i in range(3):
        one = torch.autograd.grad(out, inputs, cots[i], retain_graph=True)
        for b, o in zip(batched, one, strict=True):
            _close(b[i], o)


def test_triton_double_backward_and_jvp_match_the_composite() -> None:
    reason = unavailable_reason("triton", torch.device("cpu"))
    if reason is not None:
        pytest.skip(reason)
    inputs, options = _inputs("float-mask-window")
    got = _second_order(_fn("triton", options), inputs, penalty=True)
    want = _second_order(_fn(None, options), inputs, penalty=True)
    for g, w in zip(got, want, strict=True):
        _close(g, w)
    primals = tuple(t.detach() for t in inputs)
    tangents = tuple(torch.ones_like(t) for t in primals)
    _, (d_out, d_lse) = torch.func.jvp(_fn("triton", options, lse=True), primals, tangents)
    _, (d_ref, d_ref_lse) = torch.func.jvp(_fn(None, options, lse=True), primals, tangents)
    _close(d_out, d_ref)
    _close(d_lse, d_ref_lse)


# -- lse as an output ---------------------------------------------------------------


# the roundings of each term exp(S_j - m) beyond the sum's: the shift, exp (a few ulp), a rescale
EXP_ROUNDINGS = 4
# of m + log l: log, the add, a change of base and back, the store
LSE_ROUNDINGS = 5


def _lse_bound(
    q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """How far lse, computed in the compute dtype from q, k in ``dtype``, may be from its float64
    value on those same (rounded) inputs: [*, Nq], for the live rows.

    q: [..., Nq, d], k: [..., Nk, d] in float64 (exactly the inputs' values); lse: the
    reference [..., Nq].  With u the unit roundoff of the compute dtype (float32 for 16-bit
    inputs, else the dtype), C_j = s |q| . |k_j| and S_j = s q . k_j:

    * each score is a d-term product, scaled (and, in a kernel that works in base 2, times
      log2 e): |fl(S_j) - S_j| <= e C_j with e = `score_error` (the rule's: LAMBDA sqrt(d)
      + SCORE_ROUNDINGS units, beyond the worst case (d + 4) u for d <= 36, so on any BLAS);
      lse is 1-Lipschitz in the max norm of the scores (its gradient P sums to 1), so lse
      moves by at most e max_j C_j;
    * l = sum_j exp(S_j - m) is a sum of Nk positive terms, each off by a few roundings of
      its own size (the shift, exp's few ulp, a tile's rescale): relative error at most
      (Nk + EXP_ROUNDINGS) u, which log l turns into an absolute error of as much;
    * m + log l: log l rounded once (|log l| = |lse - m| <= |lse| + max|S|), the sum
      rounded once, a change of base and back rounds m and lse once each, and lse is
      stored once: LSE_ROUNDINGS u (|lse| + max_j C_j).

    A planted lse kept in bfloat16 (|lse| 2^-9 off) fails this by orders of magnitude.
    """
    u = unit_roundoff(compute_dtype(dtype))
    c = (q.abs() @ k.abs().transpose(-2, -1)).amax(-1) / q.shape[-1] ** 0.5  # max_j C_j
    nk = k.shape[-2]
    return score_error(dtype, q.shape[-1]) * c + u * (
        nk + EXP_ROUNDINGS + LSE_ROUNDINGS * (lse.abs() + c)
    )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("strategy", TENSOR_STRATEGIES)
def test_lse_is_the_rows_logsumexp_in_float32_or_float64(strategy: str, dtype: torch.dtype) -> None:
    inputs, options = _inputs("bool-dead-row")
    q, k, v = (t.detach().to(dtype) for t in inputs)
    out, lse = attngrad.attention(q, k, v, strategy=strategy, return_lse=True, **options)
    assert lse.shape == out.shape[:-1]
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    # the float64 reference on the inputs as attention received them (q.double() is exact)
    ref = reference_lse(q.double(), k.double(), options["attn_mask"])  # type: ignore[arg-type]
    assert torch.equal(lse[..., 1], torch.full_like(lse[..., 1], float("-inf")))  # dead row
    live = torch.isfinite(ref)
    assert live.sum() == live.numel() - lse[..., 1].numel()  # every other row attends
    bound = _lse_bound(q.double(), k.double(), ref, dtype)
    err = (lse.double() - ref).abs()
    assert (err[live] <= bound[live]).all(), (err[live] / bound[live]).max()


@pytest.mark.parametrize("strategy", TENSOR_STRATEGIES)
def test_a_loss_on_lse_alone_backpropagates_dlse_times_p(strategy: str) -> None:
    inputs, options = _inputs("gqa-causal")
    _, lse = _fn(strategy, options, lse=True)(*inputs)
    got = torch.autograd.grad(lse.sum(), inputs)
    want = torch.autograd.grad(
        _fn(None, options, lse=True)(*inputs)[1].sum(), inputs, allow_unused=True
    )
    for g, w in zip(got, want, strict=True):
        _close(g, w)  # v: lse does not depend on it, its gradient is zero


# -- what stays refused, and memory ---------------------------------------------------------


@pytest.mark.parametrize("strategy", TENSOR_STRATEGIES)
def test_third_derivatives_raise(strategy: str) -> None:
    inputs, options = _inputs("plain")
    out = _fn(strategy, options)(*inputs)
    (g,) = torch.autograd.grad(out.pow(2).sum(), inputs[:1], create_graph=True)
    (h,) = torch.autograd.grad(g.pow(2).sum(), inputs[:1], create_graph=True)
    with pytest.raises(NotImplementedError, match="third derivatives"):
        torch.autograd.grad(h.sum(), inputs[:1])


class _LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any tensor an op returns."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


FEATURES = {
    "plain": {},
    "dropout": {"dropout_p": 0.2, "generator": torch.Generator().manual_seed(0)},
    "softcap": {"softcap": 4.0},
    "sinks": {"sinks": torch.zeros(2, dtype=torch.float64)},
    "packed-bottom-right": {
        "cu_seqlens_q": torch.tensor([0, 100, 512]),
        "window": (None, 0),  # causal beside a mask
        "align": "bottom-right",
    },
}


@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("order", ["double-backward", "jvp"])
def test_flash_never_forms_a_score_matrix_under_second_order(order: str, feature: str) -> None:
    b, h, n, d = 1, 2, 512, 16
    q, k, v = (torch.randn(b, h, n, d, dtype=torch.float64, requires_grad=True) for _ in range(3))
    mask = torch.randn(1, 1, 1, n, dtype=torch.float64, requires_grad=True)  # a key bias
    tile = 64 * 128
    kw = {"strategy": "flash", "block_q": 64, "block_k": 128, **FEATURES[feature]}

    def run() -> None:
        if order == "jvp":
            primals = (q.detach(), k.detach(), v.detach())
            torch.func.jvp(
                lambda q, k, v: attngrad.attention(q, k, v, **kw),
                primals, tuple(torch.ones_like(t) for t in primals),
            )  # fmt: skip
            return
        out = attngrad.attention(q, k, v, mask, **kw)
        grads = torch.autograd.grad(out.pow(2).sum(), (q, k, v, mask), create_graph=True)
        torch.autograd.grad(sum(g.sum() for g in grads), (q, k, v, mask))

    with _LargestTensor() as seen:
        run()
    # one tile per (batch, head) at most, or an [N, d] row block: never [N, N]
    assert seen.largest <= max(b * h * tile, b * h * n * d), seen.largest
    assert seen.largest < b * h * n * n // 4


def test_return_lse_must_be_a_bool() -> None:
    q = torch.randn(1, 1, 3, 2)
    with pytest.raises(TypeError, match="return_lse must be True or False, got 'yes'"):
        attngrad.attention(q, q, q, return_lse="yes")  # type: ignore[call-overload]


def test_triton_second_order_and_jvp_with_every_keyword_match_flash() -> None:
    """Dropout, softcap, sinks, bottom-right alignment and packed segments at once."""
    reason = unavailable_reason("triton", torch.device("cpu"))
    if reason is not None:
        pytest.skip(reason)
    torch.manual_seed(3)
    q = torch.randn(1, 4, 9, 8, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(1, 2, 12, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    sinks = torch.randn(4, dtype=torch.float64, requires_grad=True)
    inputs = [q, k, v, sinks]

    def fn(strategy: str):  # type: ignore[no-untyped-def]
        def call(
            q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: torch.Tensor
        ) -> torch.Tensor:
            return attngrad.attention(
                q, k, v, enable_gqa=True, strategy=strategy, is_causal=True,
                align="bottom-right", softcap=3.0, sinks=s, dropout_p=0.25,
                generator=torch.Generator().manual_seed(9),
                cu_seqlens_q=torch.tensor([0, 4, 9]), cu_seqlens_k=torch.tensor([0, 3, 12]),
            )  # fmt: skip

        return call

    got = _second_order(fn("triton"), inputs, penalty=True)
    want = _second_order(fn("flash"), inputs, penalty=True)
    for g, w in zip(got, want, strict=True):
        _close(g, w)
    primals = tuple(t.detach() for t in inputs)
    tangents = tuple(torch.ones_like(t) for t in primals)
    _close(
        torch.func.jvp(fn("triton"), primals, tangents)[1],
        torch.func.jvp(fn("flash"), primals, tangents)[1],
    )
