"""`attngrad.attention` on every strategy: gradcheck, the error rule of
`attngrad.verify.check` against the float64 reference in every dtype, dead rows, partial requires_grad,
dtypes, what the explicit strategy saves, dropout and causal alignment.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import attngrad
from attngrad.verify.cases import make_inputs, outputs_and_grads, received
from attngrad.verify.check import run_case, strategy_fn
from attngrad.verify.rule import PLAIN, REFERENCE, case_floors, judge, unit_roundoff
from helpers import TENSOR_STRATEGIES, assert_rule, case, dtype_name

STRATEGIES = attngrad.STRATEGIES
LOW_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ALL_DTYPES = (torch.float64, *LOW_DTYPES)

by_strategy = pytest.mark.parametrize("strategy", STRATEGIES)
by_tensor_strategy = pytest.mark.parametrize("strategy", TENSOR_STRATEGIES)


# ---------------------------------------------------------------------------
# gradcheck in float64: each case takes code the others do not

# (Hq, Hkv, Nq, Nk, d, mask, fast_mode).  Full gradcheck perturbs every input element one at
# a time and builds the Jacobian row by row: seconds for d = 4 and N <= 7 (the time goes with
# d), minutes for N = 97 or d = 59, where fast_mode checks a random projection instead.  Every
# mask kind runs in full mode, with and without GQA; the fast cases take sizes that no vector
# width divides (Nk = 97, d = 59), where the fused kernels' products end in a partial vector.
GRADCHECK_CASES = [
    (2, 2, 7, 7, 4, "none", False),  # the plain path
    # one bias per query head: under GQA its gradient must not be summed per group
    (4, 2, 7, 7, 4, "float", False),
    (4, 2, 7, 7, 4, "bool", False),  # the keep mask shared by a group, a dead row
    (2, 2, 1, 7, 4, "causal", False),  # a single query row: top-left, it sees key 0 alone
    # a single key: every live row puts all its weight on it (P = 1, dS = 0, dmask = 0)
    (4, 2, 7, 1, 4, "float", False),
    (4, 2, 7, 97, 8, "bool", True),  # Nq < Nk, keys past a vector width, a dead row
    (4, 2, 97, 7, 59, "causal", True),  # Nq > Nk: with is_causal, rows 7.. attend every key
    (2, 2, 97, 97, 59, "float", True),  # every size odd and wide, the bias at [Hq, Nq, Nk]
]


def _gradcheck_params():
    for hq, hkv, nq, nk, d, mask, fast in GRADCHECK_CASES:
        case_id = case((2,), hq, hkv, nq, nk, d, d, mask).id + ("-fast" if fast else "")
        marks = [] if fast else [pytest.mark.slow]  # a full Jacobian: ~1 s, fast mode ~20 ms
        yield pytest.param(hq, hkv, nq, nk, d, mask, fast, id=case_id, marks=marks)


@by_tensor_strategy
@pytest.mark.parametrize(("hq", "hkv", "nq", "nk", "d", "mask", "fast"), list(_gradcheck_params()))
def test_gradcheck(strategy, hq, hkv, nq, nk, d, mask, fast):
    b = 2
    q = torch.randn(b, hq, nq, d, dtype=torch.float64, requires_grad=True)
    k = torch.randn(b, hkv, nk, d, dtype=torch.float64, requires_grad=True)
    v = torch.randn(b, hkv, nk, d, dtype=torch.float64, requires_grad=True)
    inputs = [q, k, v]
    fixed_mask = None
    if mask == "bool":
        # shared across heads; every row keeps key 0 but row 1, which attends nothing (its
        # gradient must be 0, not NaN); a single query row stays live, or the function
        # gradcheck differentiates would be zero everywhere
        fixed_mask = torch.rand(b, 1, nq, nk) > 0.3
        fixed_mask[..., 0] = True
        if nq > 1:
            fixed_mask[:, :, 1] = False
    elif mask == "float":
        # one bias per query head: under GQA its gradient must not be summed per group
        inputs.append(torch.randn(hq, nq, nk, dtype=torch.float64, requires_grad=True))

    def call(q, k, v, *bias):
        m = bias[0] if bias else fixed_mask
        return attngrad.attention(
            q, k, v, m, is_causal=mask == "causal", enable_gqa=hq != hkv, strategy=strategy
        )

    assert torch.autograd.gradcheck(call, tuple(inputs), fast_mode=fast)


# ---------------------------------------------------------------------------
# float64: out and every gradient against the reference, by the one rule

SDPA_CASES = [
    # the course chapter's [B, N, d] layout: no lead dims, the first dim plays the heads
    case((), 3, 3, 6, 6, 8, 8),
    case((), 3, 3, 6, 6, 8, 8, "causal"),
    case((), 3, 3, 6, 9, 8, 8, "float", (6, 9)),
    case((), 3, 3, 6, 9, 8, 8, "bool", (3, 6, 9)),
    # 4-D, value head dim != qk head dim, float masks broadcast every way SDPA allows;
    # each broadcast dim makes dmask a sum over that dim
    case((2,), 4, 4, 5, 7, 8, 6, "float", ()),
    case((2,), 4, 4, 5, 7, 8, 6, "float", (7,)),
    case((2,), 4, 4, 5, 7, 8, 6, "float", (5, 7)),
    case((2,), 4, 4, 5, 7, 8, 6, "float", (1, 5, 7)),
    case((2,), 4, 4, 5, 7, 8, 6, "float", (2, 1, 5, 7)),
    case((2,), 4, 4, 5, 7, 8, 6, "float", (2, 4, 1, 7)),
    case((2,), 4, 4, 5, 7, 8, 6, "float", (2, 4, 5, 7)),
    # a bias constant along each row shifts no probability: its true gradient is ~0
    case((2,), 4, 4, 5, 7, 8, 6, "float", (2, 4, 5, 1)),
    case((2,), 4, 4, 5, 7, 8, 6, "bool", (7,)),
    case((2,), 4, 4, 5, 7, 8, 6, "bool", (2, 1, 5, 7)),
    case((2,), 4, 4, 5, 7, 8, 6, "bool", (2, 4, 1, 7)),
    # scale given (not a power of two, and one above 1 that sharpens the softmax)
    case((2,), 4, 4, 5, 7, 8, 6, "none", scale=0.3),
    case((2,), 4, 4, 5, 7, 8, 6, "causal", scale=1.7),
    case((2,), 4, 4, 5, 7, 8, 6, "float", (5, 7), scale=0.3),
    # enable_gqa
    case((2,), 4, 2, 5, 7, 8, 6),
    case((2,), 6, 2, 5, 7, 8, 6, "causal"),
    case((2,), 4, 2, 5, 7, 8, 6, "float", (4, 5, 7)),
    case((2,), 4, 2, 5, 7, 8, 6, "float", (2, 4, 1, 7)),
    case((2,), 4, 1, 5, 7, 8, 6, "bool", (2, 1, 5, 7)),  # one k/v head for all
    # 5-D: two lead dims, masks broadcast over some of them
    case((2, 3), 2, 1, 4, 9, 8, 8, "float", (3, 1, 4, 9)),
    case((2, 3), 2, 2, 4, 9, 8, 8, "float", (2, 1, 1, 1, 9)),
    case((2, 3), 2, 2, 4, 9, 8, 8, "bool", (2, 3, 2, 4, 9)),
    case((2, 3), 4, 2, 4, 9, 8, 5, "causal"),
    # is_causal with Nq != Nk: SDPA aligns the mask to the top-left corner
    case((2,), 2, 2, 9, 4, 8, 8, "causal"),
    case((2,), 2, 2, 4, 9, 8, 8, "causal"),
    case((2,), 4, 2, 9, 4, 8, 6, "causal"),
    case((2,), 4, 2, 4, 9, 8, 6, "causal"),
]


def _judged(strategy: str, c, inputs=None, **kwargs):
    """Run ``strategy`` on the case (its `make_inputs` unless given) and assert the rule."""
    inputs = make_inputs(c) if inputs is None else inputs
    fn = strategy_fn(strategy)
    got = outputs_and_grads(lambda *a, **kw: fn(*a, **kw, **kwargs), c, inputs, c.dtype)
    assert_rule(c, inputs, got)
    return got


@by_tensor_strategy
@pytest.mark.parametrize("c", SDPA_CASES, ids=lambda c: c.id)
def test_float64_obeys_the_rule(strategy, c):
    _judged(strategy, c)


def test_auto_strategy_obeys_the_rule():
    _judged("auto", case((2,), 4, 2, 5, 7, 8, 6, "float", (4, 5, 7)))


@by_strategy
def test_non_contiguous_inputs(strategy):
    # Models keep q/k/v as [B, N, H, d] and transpose to [B, H, N, d], and the mask may be a
    # transposed view.  Any .view() on a caller's tensor would raise or misread here.
    f64 = dict(dtype=torch.float64)
    q = torch.randn(2, 5, 4, 8, **f64).transpose(1, 2)
    k = torch.randn(2, 7, 2, 8, **f64).transpose(1, 2)
    v = torch.randn(2, 7, 2, 6, **f64).transpose(1, 2)
    mask = torch.randn(4, 7, 5, **f64).transpose(-1, -2)
    dout = torch.randn(2, 4, 5, 6, **f64).transpose(-1, -2).contiguous().transpose(-1, -2)
    inputs = {"q": q, "k": k, "v": v, "mask": mask, "dout": dout}
    assert not any(t.is_contiguous() for t in inputs.values())
    # the leaves outputs_and_grads makes are clones, which keep a dense layout's strides: the
    # transposes reach attention (stride-0 views do not: test_stride_zero_keys_and_values)
    _judged(strategy, case((2,), 4, 2, 5, 7, 8, 6, "float", (4, 5, 7)), inputs)


def _expanded_run(fn, leaves: dict[str, torch.Tensor], dout: torch.Tensor, gqa: bool):
    """out and the leaves' gradients of ``fn`` on k, v expanded to [B, Hkv, Nk, *] from leaves.

    leaves: q [B, Hq, Nq, d], k [1, 1, Nk, d] (stride 0 along batch and heads once expanded),
    v [B, 1, Nk, dv] (stride 0 along heads).  Asserts the views that reach fn have stride 0.
    """
    b, hkv = leaves["q"].shape[0], 2
    k = leaves["k"].expand(b, hkv, *leaves["k"].shape[-2:])
    v = leaves["v"].expand(b, hkv, *leaves["v"].shape[-2:])
    assert k.stride()[:2] == (0, 0) and v.stride(1) == 0
    out = fn(leaves["q"], k, v, enable_gqa=gqa)
    grads = torch.autograd.grad(out, list(leaves.values()), dout)
    return {"out": out.detach(), **{"d" + n: g for n, g in zip(leaves, grads, strict=True)}}


@by_strategy
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=dtype_name)
def test_stride_zero_keys_and_values(strategy, dtype):
    # k and v as expanded views of smaller leaves (stride 0), as a model sharing one k/v
    # across the batch or heads passes them: backward must sum dk, dv over the expanded dims
    # into the leaves, never write through a stride-0 view.  Judged by the rule on the
    # leaves' gradients: the reference's and the plain run's, summed alike; each summed
    # floor is the sum of its terms' floors plus the sum's own rounding in the dtype.
    c = case((2,), 4, 2, 5, 7, 8, 6, dtype=dtype)
    inputs = make_inputs(c)
    small = {"q": inputs["q"], "k": inputs["k"][:1, :1], "v": inputs["v"][:, :1]}
    exact = {n: t.to(dtype).double() for n, t in small.items()}
    dout = inputs["dout"]
    got = _expanded_run(strategy_fn(strategy), _leaves(small, dtype), dout.to(dtype), True)
    ref = _expanded_run(REFERENCE, _leaves(exact, torch.float64), dout.to(dtype).double(), True)
    plain = _expanded_run(PLAIN, _leaves(exact, dtype), dout.to(dtype), True)
    full = dict(received(inputs, dtype))
    full["k"], full["v"] = (exact[n].expand_as(inputs[n]) for n in ("k", "v"))
    floors = case_floors(c, full)
    verdicts = []
    for name, r in ref.items():
        summed = floors[name].shape != r.shape
        floor = floors[name].sum_to_size(r.shape) + summed * unit_roundoff(dtype) * r.abs()
        verdicts.append(judge(name, got[name], r, floor, plain[name]))
    failed = [str(v) for v in verdicts if not v.passed]
    assert not failed, failed


def _leaves(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Fresh leaves in ``dtype`` requiring grad."""
    return {n: t.detach().to(dtype).clone().requires_grad_() for n, t in tensors.items()}


@by_strategy
@pytest.mark.parametrize(
    ("nq", "nk", "b"),
    [(4, 0, 2), (0, 4, 2), (4, 4, 0)],
    ids=["no-keys", "no-queries", "no-batch"],
)
def test_empty_dims_match_sdpa(strategy, nq, nk, b):
    # with no keys every row attends nothing: SDPA gives zeros, not NaN
    q = torch.randn(b, 2, nq, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(b, 2, nk, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(b, 2, nk, 6, dtype=torch.float64, requires_grad=True)
    out = attngrad.attention(q, k, v, strategy=strategy)
    assert out.shape == (b, 2, nq, 6)
    assert (out == 0).all()
    out.sum().backward()
    for t in (q, k, v):
        assert t.grad is not None and t.grad.shape == t.shape and (t.grad == 0).all()


# ---------------------------------------------------------------------------
# the rule in float32, bfloat16, float16: 2x plain PyTorch in the dtype + the floor

TWO_X_CASES = [
    case((2,), 4, 2, 97, 97, 59, 59),  # d = 59: 1/sqrt(d) is inexact
    case((2,), 4, 2, 97, 97, 59, 59, "causal"),
    case((1,), 2, 2, 33, 200, 16, 24, "bool", (1, 1, 33, 200)),
    case((1,), 4, 4, 64, 128, 64, 64, "float", (4, 64, 128)),
    case((), 3, 3, 7, 1, 8, 8, "causal"),  # one key: P is exactly one
]


@by_tensor_strategy
@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=dtype_name)
@pytest.mark.parametrize("c", TWO_X_CASES, ids=lambda c: c.id)
def test_low_precision_obeys_the_rule(strategy, dtype, c):
    _judged(strategy, dataclasses.replace(c, dtype=dtype))


# Cases outside `attngrad check`'s default grid, judged by the harness's run_case.
HARNESS_CASES = [
    case((3,), 6, 2, 29, 13, 40, 40, "float"),
    case((2,), 2, 1, 5, 31, 12, 20, "bool", dtype=torch.bfloat16),
    case((), 4, 4, 50, 50, 32, 32, "causal", dtype=torch.float16),
    case((2,), 2, 2, 16, 16, 16, 16, dtype=torch.float32),
]


@by_strategy
@pytest.mark.parametrize("c", HARNESS_CASES, ids=lambda c: c.id)
def test_conformance_harness_cases(strategy, c):
    if strategy == "triton" and c.shapes.lead == (3,):
        # Triton's interpreter pays per program (per batch entry and head): one batch entry
        # keeps what the case is about (GQA 6:2, a float mask, Nq > Nk, d = 40)
        c = dataclasses.replace(c, shapes=dataclasses.replace(c.shapes, lead=(1,)))
    result = run_case(strategy, c)
    assert result.passed, (result.message, result.errors, result.bounds)
    assert set(result.errors) == {"out", "dq", "dk", "dv", "lse"} | (
        {"dmask"} if c.mask == "float" else set()
    )
    if c.dtype == torch.float64:
        assert result.gradcheck_passed is True


# ---------------------------------------------------------------------------
# rows that attend no key: zero output, zero (finite) gradients


def _dead_row_mask(kind: str, b: int, h: int, nq: int, nk: int):
    """A [B, H, Nq, Nk] mask with query row 2 dead everywhere and row 4 dead in (b=0, h=1) only."""
    keep = torch.rand(b, h, nq, nk) > 0.3
    keep[..., :, 0] = True  # every other row keeps at least one key
    keep[..., 2, :] = False
    keep[0, 1, 4, :] = False
    if kind == "bool":
        return keep, keep
    bias = torch.randn(b, h, nq, nk, dtype=torch.float64)
    return bias.masked_fill(~keep, float("-inf")), keep


@by_strategy
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=dtype_name)
@pytest.mark.parametrize("hkv", [4, 2], ids=["H4", "H4:2"])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_fully_masked_rows(strategy, dtype, hkv, kind):
    b, hq, nq, nk, d = 2, 4, 6, 9, 8
    mask, keep = _dead_row_mask(kind, b, hq, nq, nk)
    dead = ~keep.any(dim=-1)  # [B, Hq, Nq]
    c = case((b,), hq, hkv, nq, nk, d, d, kind, tuple(mask.shape), dtype=dtype)
    inputs = make_inputs(c)
    inputs["mask"] = mask
    got = _judged(strategy, c, inputs)

    assert (got["out"][dead] == 0).all(), "a dead row's output must be exactly 0"
    for name, g in got.items():
        assert torch.isfinite(g).all(), name
    assert (got["dq"][dead] == 0).all()
    if kind == "float":
        assert (got["dmask"][dead] == 0).all()
        # -inf entries of live rows get no probability and so no gradient either
        assert (got["dmask"][~keep] == 0).all()


@by_strategy
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_every_row_masked(strategy, kind):
    # the extreme case: nothing attends anything, so every gradient is zero
    q, k, v = (torch.randn(2, 3, 5, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    if kind == "bool":
        mask = torch.zeros(5, 5, dtype=torch.bool)
    else:
        mask = torch.full((5, 5), float("-inf"), dtype=torch.float64, requires_grad=True)
    out = attngrad.attention(q, k, v, mask, strategy=strategy)
    leaves = (q, k, v) + ((mask,) if kind == "float" else ())
    grads = torch.autograd.grad(out, leaves, torch.randn_like(out))
    assert (out == 0).all()
    for g in grads:
        assert (g == 0).all()


# ---------------------------------------------------------------------------
# any subset of inputs requiring grad

SUBSETS = [
    (),
    ("q",),
    ("k",),
    ("v",),
    ("mask",),
    ("q", "k"),
    ("k", "v"),
    ("q", "mask"),
    ("v", "mask"),
    ("q", "k", "v"),
    ("q", "k", "v", "mask"),
]


@by_strategy
@pytest.mark.parametrize("subset", SUBSETS, ids=lambda s: "+".join(s) or "nothing")
def test_gradients_of_any_subset(strategy, subset):
    c = case((2,), 4, 2, 5, 7, 8, 6, "float", (4, 5, 7))
    inputs = make_inputs(c)
    leaves = {
        n: inputs[n].detach().clone().requires_grad_(n in subset)  # type: ignore[union-attr]
        for n in ("q", "k", "v", "mask")
    }
    out = attngrad.attention(
        leaves["q"], leaves["k"], leaves["v"], leaves["mask"], enable_gqa=True, strategy=strategy
    )
    got = {"out": out.detach()}
    if not subset:
        assert not out.requires_grad and out.grad_fn is None
    else:
        out.backward(inputs["dout"])
    for name, t in leaves.items():
        if name in subset:
            assert t.grad is not None, f"{name} requires grad but got none"
            got["d" + name] = t.grad
        else:
            assert t.grad is None, f"{name} does not require grad but got one"
    assert_rule(c, inputs, got)


# ---------------------------------------------------------------------------
# dtypes


@by_strategy
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_name)
@pytest.mark.parametrize("mask", ["none", "causal", "bool", "float"])
def test_output_and_gradient_dtypes_follow_input(strategy, dtype, mask):
    c = case((2,), 4, 2, 5, 7, 8, 6, mask, (4, 5, 7) if mask in ("bool", "float") else None)
    got = _judged(strategy, dataclasses.replace(c, dtype=dtype))
    for name, t in got.items():
        assert t.dtype == dtype, f"{name} is {t.dtype}"
        assert not t.isnan().any(), f"{name} has NaN"


# ---------------------------------------------------------------------------
# what the explicit strategy saves for backward

SAVED_CASES = [
    case((2,), 4, 4, 5, 7, 8, 6),
    case((2,), 6, 2, 5, 7, 8, 6, "causal"),  # GQA: k, v saved unexpanded
    case((2,), 4, 2, 5, 7, 8, 6, "float", (4, 5, 7)),  # the bias: a view of the caller's
    case((2,), 4, 2, 5, 7, 8, 6, "float", (2, 1, 1, 7)),
    case((), 3, 3, 6, 9, 8, 8, "bool", (6, 9)),  # the course chapter's [B, N, d] layout
    case((2, 3), 4, 1, 4, 9, 8, 8, "float", (3, 1, 4, 9)),  # two lead dims
]


@pytest.mark.skipif("explicit" not in STRATEGIES, reason="no explicit strategy")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_name)
@pytest.mark.parametrize("c", SAVED_CASES, ids=lambda c: c.id)
def test_explicit_saves_q_k_v_p_and_row_statistics_only(c, dtype):
    inputs = make_inputs(c)
    q, k, v = (inputs[n].to(dtype).requires_grad_() for n in "qkv")  # type: ignore[union-attr]
    mask = inputs["mask"]
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(dtype).requires_grad_()
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = attngrad.attention(
            q, k, v, mask, is_causal=c.mask == "causal", enable_gqa=c.gqa, strategy="explicit"
        )

    sh = c.shapes
    batch = sh.batch
    hq, hkv, nq, nk, d, dv = (
        sh.heads_q,
        sh.heads_kv,
        sh.seq_q,
        sh.seq_k,
        sh.head_dim,
        sh.value_dim,
    )
    if mask is not None and mask.requires_grad:  # kept for its own second derivative
        # as attngrad's 4-D form: a view of the caller's mask, or (lead dims partly
        # broadcast, here (3,) against (2, 3)) the one reshape forward made anyway
        lead = mask.shape[:-3]
        bm = 1 if all(n == 1 for n in lead) else c.shapes.batch
        shape4 = (bm, *mask.shape[-3:]) if mask.ndim >= 3 else None
        biases = [s for s in saved if s.dtype == mask.dtype and tuple(s.shape) == shape4]
        assert len(biases) == 1
        if bm == 1 or tuple(lead) == tuple(c.shapes.lead):
            assert biases[0].untyped_storage().data_ptr() == mask.untyped_storage().data_ptr()
        saved = [s for s in saved if s is not biases[0]]
    assert len(saved) == 5, [tuple(t.shape) for t in saved]
    rest = list(saved)
    for name, t in (("q", q), ("k", k), ("v", v)):
        same = [s for s in rest if s.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()]
        assert len(same) == 1, f"{name} is not saved as itself (a copy or an expansion?)"
        s = same[0]
        assert s.numel() == t.numel()
        assert s.untyped_storage().nbytes() == t.untyped_storage().nbytes()
        rest.remove(s)
    p, stats = sorted(rest, key=lambda t: -t.numel())
    assert p.shape == (batch, hq, nq, nk)  # one [Nq, Nk] matrix per query head, like SDPA's P
    assert p.dtype == dtype
    assert stats.shape == (batch, hq, nq, 2)  # (m, log l) per row: lse comes from them
    b = q.element_size()
    expected = b * (batch * hq * nq * d + batch * hkv * nk * d + batch * hkv * nk * dv)
    expected += b * batch * hq * nq * nk + stats.element_size() * batch * hq * nq * 2
    assert sum(t.numel() * t.element_size() for t in saved) == expected
    out.backward(inputs["dout"].to(dtype))  # the five saved tensors are enough for backward


# ---------------------------------------------------------------------------
# dropout and causal alignment


@by_strategy
def test_dropout_zero_is_accepted(strategy):
    q = torch.randn(1, 2, 4, 8, dtype=torch.float64)
    plain = attngrad.attention(q, q, q, strategy=strategy)
    for p in (0.0, 0):
        assert torch.equal(attngrad.attention(q, q, q, dropout_p=p, strategy=strategy), plain)
        _judged(strategy, case((1,), 2, 2, 4, 4, 8, 8), dropout_p=p)


@by_strategy
@pytest.mark.parametrize(("nq", "nk"), [(9, 4), (4, 9)], ids=["Nq9>Nk4", "Nq4<Nk9"])
def test_causal_is_aligned_top_left(strategy, nq, nk):
    c = case((2,), 3, 3, nq, nk, 8, 5, "causal")
    inputs = make_inputs(c)
    q, k, v = (inputs[n] for n in "qkv")
    out = _judged(strategy, c, inputs)["out"]  # the reference aligns top-left
    # top-left: query 0 sees key 0 only (bottom-right would let it see nk - nq + 1 keys);
    # its one probability is exactly 1, so its output is exactly v[0]
    assert torch.equal(out[..., 0, :], v[..., 0, :])
    # query i >= min(Nq, Nk) - 1 sees keys 0..min(Nq, Nk) - 1 (every key when Nq >= Nk): the
    # same tiles and scores as no mask over those keys
    seen = min(nq, nk)
    full = attngrad.attention(q, k[..., :seen, :], v[..., :seen, :], strategy=strategy)
    assert out[..., seen - 1 :, :].numel() > 0
    assert torch.equal(out[..., seen - 1 :, :], full[..., seen - 1 :, :])


# ---------------------------------------------------------------------------
# SDPA's 2-D inputs: one head, no batch


def _sdpa_2d_inputs(mask: str, nq: int = 7, nk: int = 11, d: int = 8, dv: int = 5):
    """q [Nq, d], k [Nk, d], v [Nk, dv] (float64, requiring grad) and SDPA's keywords."""
    torch.manual_seed(0)
    q = torch.randn(nq, d, dtype=torch.float64, requires_grad=True)
    k = torch.randn(nk, d, dtype=torch.float64, requires_grad=True)
    v = torch.randn(nk, dv, dtype=torch.float64, requires_grad=True)
    keywords: dict[str, object] = {}
    if mask == "causal":
        keywords["is_causal"] = True
    elif mask == "bool":  # [Nq, Nk], the diagonal kept so no row is dead (SDPA gives NaN there)
        keep = torch.rand(nq, nk) > 0.4
        keep[torch.arange(nq), torch.arange(nq)] = True
        keywords["attn_mask"] = keep
    elif mask == "float-row":  # [Nk], broadcast over the rows, with its gradient
        keywords["attn_mask"] = torch.randn(nk, dtype=torch.float64, requires_grad=True)
    elif mask == "float":  # [Nq, Nk], with its gradient
        keywords["attn_mask"] = torch.randn(nq, nk, dtype=torch.float64, requires_grad=True)
    return q, k, v, keywords


@by_strategy
@pytest.mark.parametrize("mask", ["none", "causal", "bool", "float-row", "float"])
def test_2d_inputs_match_sdpa_forward_and_backward(strategy, mask):
    q, k, v, keywords = _sdpa_2d_inputs(mask)
    leaves = [q, k, v, *(m for m in keywords.values() if isinstance(m, torch.Tensor))]
    leaves = [t for t in leaves if t.requires_grad]
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, **keywords)
    expected_grads = torch.autograd.grad(expected.square().sum(), leaves)
    got = attngrad.attention(q, k, v, strategy=strategy, **keywords)
    assert got.shape == expected.shape == (7, 5)
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-9)
    for g, e in zip(torch.autograd.grad(got.square().sum(), leaves), expected_grads, strict=True):
        assert g.shape == e.shape
        torch.testing.assert_close(g, e, rtol=1e-9, atol=1e-9)


@by_tensor_strategy
def test_2d_inputs_gradcheck_and_lse(strategy):
    q, k, v, keywords = _sdpa_2d_inputs("float", nq=4, nk=5, d=3, dv=2)
    bias = keywords["attn_mask"]

    def call(q, k, v, bias):
        return attngrad.attention(q, k, v, bias, strategy=strategy, return_lse=True)

    assert torch.autograd.gradcheck(call, (q, k, v, bias))
    out, lse = call(q, k, v, bias)
    assert out.shape == (4, 2) and lse.shape == (4,)
    scores = q @ k.T / 3**0.5 + bias
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1), rtol=1e-12, atol=1e-12)


def test_2d_mask_must_broadcast_to_nq_nk():
    q, k, v, _ = _sdpa_2d_inputs("none")
    with pytest.raises(ValueError, match=r"does not broadcast to the scores' shape \(7, 11\)"):
        attngrad.attention(q, k, v, torch.ones(1, 7, 11, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"key has 3 dims"):
        attngrad.attention(q, k.unsqueeze(0), v.unsqueeze(0))


@by_tensor_strategy
@pytest.mark.parametrize("per", ["token", "all"])
def test_2d_sinks_are_per_token_as_lse_is(strategy, per):
    # lse of 2-D inputs is [Nq], so a 1-D sinks is [Nq] (or [1]); the same call as
    # [1, 1, N, d] inputs with sinks [1, Nq] (broadcast over [..., Hq, Nq])
    q, k, v, _ = _sdpa_2d_inputs("none")
    sinks = torch.randn(7 if per == "token" else 1, dtype=torch.float64, requires_grad=True)
    out, lse = attngrad.attention(q, k, v, sinks=sinks, strategy=strategy, return_lse=True)
    out4, lse4 = attngrad.attention(
        q[None, None], k[None, None], v[None, None], sinks=sinks.view(1, -1),
        strategy=strategy, return_lse=True,
    )  # fmt: skip
    torch.testing.assert_close(out, out4[0, 0], rtol=0, atol=0)
    torch.testing.assert_close(lse, lse4[0, 0], rtol=0, atol=0)
    (ds,) = torch.autograd.grad((out.square().sum() + lse.sum()), sinks)
    (ds4,) = torch.autograd.grad((out4.square().sum() + lse4.sum()), sinks)
    torch.testing.assert_close(ds, ds4, rtol=1e-12, atol=1e-12)
    assert ds.abs().sum() > 0
    with pytest.raises(ValueError, match=r"with 2-D inputs it must be \[Nq\] = \[7\]"):
        attngrad.attention(q, k, v, sinks=torch.zeros(5, dtype=torch.float64))
