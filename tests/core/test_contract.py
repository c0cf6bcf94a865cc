"""The input contract of `attngrad.attention`, and that it never writes to its inputs.

Each bad call must raise `attngrad.ArgumentError` (a ValueError) or
`attngrad.ArgumentTypeError` (a TypeError) whose message names the argument at
fault, never a bare RuntimeError from deep inside a matmul.  Both are also
RuntimeErrors, what PyTorch's SDPA raises on bad arguments, so code written
against SDPA catches them too.
"""

from __future__ import annotations

import pytest
import torch

import attngrad
from attngrad.verify.cases import MASK_KINDS

STRATEGIES = attngrad.STRATEGIES
B, HQ, HKV, NQ, NK, D, DV = 2, 4, 2, 5, 7, 8, 6


def t(*shape: int, dtype: torch.dtype = torch.float32, device: str = "cpu") -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64).to(dtype=dtype, device=device)


def good(**override: object) -> dict[str, object]:
    """A valid GQA call (Hq=4, Hkv=2, Nq=5, Nk=7, d=8, dv=6) with some arguments replaced."""
    kwargs: dict[str, object] = dict(
        query=t(B, HQ, NQ, D),
        key=t(B, HKV, NK, D),
        value=t(B, HKV, NK, DV),
        enable_gqa=True,
    )
    kwargs.update(override)
    return kwargs


def case(make, error, *names, shows=(), id):
    """One row of the table: the call's kwargs (built lazily), the error, words the message must contain."""
    return pytest.param(make, error, names, shows, id=id)


BAD_CALLS = [
    # --- tensors at all, floating point, enough dims
    case(lambda: good(query=[[1.0]]), TypeError, "query", id="query-is-a-list"),
    case(lambda: good(key=3.0), TypeError, "key", id="key-is-a-float"),
    case(lambda: good(value=None), TypeError, "value", id="value-is-None"),
    case(
        lambda: good(query=torch.ones(B, HQ, NQ, D, dtype=torch.int64)),
        TypeError,
        "query",
        shows=("int64",),
        id="query-int64",
    ),
    case(
        lambda: good(key=torch.ones(B, HKV, NK, D, dtype=torch.int32)),
        TypeError,
        "key",
        id="key-int32",
    ),
    case(
        lambda: good(value=torch.ones(B, HKV, NK, DV, dtype=torch.bool)),
        TypeError,
        "value",
        id="value-bool",
    ),
    case(lambda: good(query=t(NQ, D)), ValueError, "query", id="query-2d"),
    case(lambda: good(key=t(NK, D)), ValueError, "key", id="key-2d"),
    case(lambda: good(value=t(DV)), ValueError, "value", id="value-1d"),
    case(lambda: good(key=t(HKV, NK, D)), ValueError, "key", id="key-3d-query-4d"),
    # --- one dtype, one device
    case(lambda: good(key=t(B, HKV, NK, D, dtype=torch.float64)), TypeError, "key", id="key-f64"),
    case(
        lambda: good(value=t(B, HKV, NK, DV, dtype=torch.bfloat16)),
        TypeError,
        "value",
        id="value-bf16",
    ),
    # "meta" stands in for a second device on a CPU-only machine
    case(lambda: good(key=t(B, HKV, NK, D, device="meta")), ValueError, "key", id="key-meta"),
    case(
        lambda: good(value=t(B, HKV, NK, DV, device="meta")),
        ValueError,
        "value",
        id="value-meta",
    ),
    # --- shapes that do not fit together
    case(lambda: good(key=t(3, HKV, NK, D)), ValueError, "key", id="batch-2-vs-3"),
    case(lambda: good(value=t(B, 1, NK, DV)), ValueError, "value", id="value-heads-2-vs-1"),
    case(lambda: good(value=t(B, HKV, NK + 1, DV)), ValueError, "value", id="seq-k-7-vs-v-8"),
    case(lambda: good(key=t(B, HKV, NK, D + 1)), ValueError, "key", id="head-dim-8-vs-9"),
    case(
        lambda: good(query=t(B, HQ, NQ, 0), key=t(B, HKV, NK, 0)),
        ValueError,
        "head_dim",
        id="head-dim-0",
    ),
    case(
        lambda: good(key=t(B, 3, NK, D), value=t(B, 3, NK, DV)),
        ValueError,
        "enable_gqa",
        shows=("4", "3"),
        id="gqa-heads-4-not-multiple-of-3",
    ),
    case(
        lambda: good(enable_gqa=False),
        ValueError,
        "query",
        shows=("enable_gqa=True",),
        id="heads-4-vs-2-without-gqa",
    ),
    # --- the mask
    case(lambda: good(attn_mask=[[True]]), TypeError, "attn_mask", id="mask-is-a-list"),
    # broadcasting would grow the scores by a leading dim instead of matching them
    case(
        lambda: good(attn_mask=t(1, B, HQ, NQ, NK)),
        ValueError,
        "attn_mask",
        id="mask-extra-lead-dim",
    ),
    case(lambda: good(attn_mask=t(NQ, NK + 1)), ValueError, "attn_mask", id="mask-wrong-Nk"),
    case(lambda: good(attn_mask=t(NQ + 1, NK)), ValueError, "attn_mask", id="mask-wrong-Nq"),
    case(lambda: good(attn_mask=t(3, NQ, NK)), ValueError, "attn_mask", id="mask-wrong-heads"),
    # under GQA a mask has one entry per *query* head; Hkv heads do not broadcast
    case(lambda: good(attn_mask=t(HKV, NQ, NK)), ValueError, "attn_mask", id="mask-kv-heads"),
    case(lambda: good(attn_mask=t(3, 1, NQ, NK)), ValueError, "attn_mask", id="mask-batch-3"),
    case(
        lambda: good(attn_mask=torch.ones(NQ, NK, dtype=torch.int64)),
        TypeError,
        "attn_mask",
        id="mask-int64",
    ),
    case(
        lambda: good(attn_mask=t(NQ, NK, dtype=torch.float64)),
        TypeError,
        "attn_mask",
        shows=("float64", "float32"),
        id="mask-f64-with-f32-query",
    ),
    case(
        lambda: good(attn_mask=t(NQ, NK, device="meta")),
        ValueError,
        "attn_mask",
        id="mask-meta",
    ),
    case(
        lambda: good(attn_mask=torch.ones(NQ, NK, dtype=torch.bool), is_causal=True),
        ValueError,
        "is_causal",
        "attn_mask",
        id="mask-and-is_causal",
    ),
    # --- flags, scale, dropout, strategy
    case(lambda: good(is_causal="yes"), TypeError, "is_causal", id="is_causal-str"),
    case(lambda: good(is_causal=None), TypeError, "is_causal", id="is_causal-None"),
    case(lambda: good(enable_gqa=1), TypeError, "enable_gqa", id="enable_gqa-int"),
    case(lambda: good(scale=float("nan")), ValueError, "scale", shows=("nan",), id="scale-nan"),
    case(lambda: good(scale=float("inf")), ValueError, "scale", shows=("inf",), id="scale-inf"),
    case(lambda: good(scale=-float("inf")), ValueError, "scale", id="scale-minus-inf"),
    case(lambda: good(scale="0.5"), TypeError, "scale", id="scale-str"),
    case(lambda: good(scale=torch.tensor(0.5)), TypeError, "scale", id="scale-tensor"),
    case(lambda: good(scale=True), TypeError, "scale", id="scale-bool"),
    case(lambda: good(dropout_p=-0.1), ValueError, "dropout_p", id="dropout-negative"),
    case(lambda: good(dropout_p=1.5), ValueError, "dropout_p", id="dropout-1.5"),
    case(lambda: good(dropout_p=float("nan")), ValueError, "dropout_p", id="dropout-nan"),
    case(lambda: good(dropout_p="0.1"), TypeError, "dropout_p", id="dropout-str"),
    case(lambda: good(strategy="fastest"), ValueError, "strategy", id="strategy-unknown"),
    case(lambda: good(strategy=None), ValueError, "strategy", id="strategy-None"),
    case(lambda: good(strategy="EXPLICIT"), ValueError, "strategy", id="strategy-wrong-case"),
    # regression: float8 passed the floating-point check and failed inside backward
    case(
        lambda: good(query=t(B, HQ, NQ, D).to(torch.float8_e4m3fn)),
        TypeError,
        "query",
        shows=("float8_e4m3fn", "bfloat16"),
        id="query-float8",
    ),
    # a float is not a tile size, whatever its value: a type error, not "must be positive"
    case(
        lambda: good(strategy="flash", block_q=16.0),
        TypeError,
        "block_q",
        shows=("16.0",),
        id="block_q-float",
    ),
]


# attngrad's class for each kind of argument error in the table
ARGUMENT_ERRORS = {ValueError: attngrad.ArgumentError, TypeError: attngrad.ArgumentTypeError}


@pytest.mark.parametrize(("make", "error", "names", "shows"), BAD_CALLS)
def test_bad_input_is_rejected_by_name(make, error, names, shows):
    kwargs = make()
    kwargs.setdefault("strategy", STRATEGIES[0])
    with pytest.raises(Exception) as info:
        attngrad.attention(**kwargs)
    assert type(info.value) is ARGUMENT_ERRORS[error], f"{type(info.value).__name__}: {info.value}"
    message = str(info.value)
    for word in (*names, *shows):
        assert word in message, f"{word!r} not in {message!r}"


@pytest.mark.parametrize(("make", "error", "names", "shows"), BAD_CALLS)
def test_bad_input_is_caught_as_sdpa_errors_are_and_as_python_errors(make, error, names, shows):
    kwargs = make()
    kwargs.setdefault("strategy", STRATEGIES[0])
    with pytest.raises(RuntimeError) as as_sdpa:  # code written for SDPA's errors
        attngrad.attention(**kwargs)
    with pytest.raises(error) as as_python:  # code written for ValueError / TypeError
        attngrad.attention(**kwargs)
    assert str(as_sdpa.value) == str(as_python.value)


def _sdpa_error(**kwargs: object) -> RuntimeError:
    """What PyTorch's SDPA raises for the same call (to show the two are caught alike)."""
    with pytest.raises(RuntimeError) as info:
        torch.nn.functional.scaled_dot_product_attention(**kwargs)
    return info.value


def test_one_except_clause_catches_sdpa_and_attngrad_alike():
    # 4 query heads over 3 k/v heads: both reject it, and `except RuntimeError` catches both
    kwargs = good(key=t(B, 3, NK, D), value=t(B, 3, NK, DV))
    _sdpa_error(**kwargs)
    with pytest.raises(RuntimeError, match=r"query heads \(4\) must be a multiple"):
        attngrad.attention(**kwargs)


# The exact messages of a few errors: their classes changed, their words did not.
EXACT_MESSAGES = [
    pytest.param(
        dict(strategy="fastest"),
        attngrad.ArgumentError,
        "unknown strategy 'fastest'; choose one of 'auto', 'explicit', 'recompute', 'flash', "
        "'fused', 'triton'.",
        id="strategy-unknown",
    ),
    pytest.param(
        dict(strategy="explicit", block_q=32),
        attngrad.ArgumentError,
        "block_q=32 only applies to the tiled strategies 'flash', 'fused' and 'triton', not 'explicit'. "
        "Drop it or pass strategy='flash'.",
        id="block_q-on-explicit",
    ),
    pytest.param(
        dict(is_causal="yes"),
        attngrad.ArgumentTypeError,
        "is_causal must be True or False, got 'yes'",
        id="is_causal-str",
    ),
]


@pytest.mark.parametrize(("override", "error", "message"), EXACT_MESSAGES)
def test_error_messages_are_unchanged(override, error, message):
    with pytest.raises(error) as info:
        attngrad.attention(**good(**override))
    assert str(info.value) == message


def test_patch_sdpa_and_ring_attention_raise_the_same_errors():
    with pytest.raises(attngrad.ArgumentError, match="unknown strategy 'fastest'"):
        attngrad.patch_sdpa("fastest")
    q = t(1, 2, 8, D)
    with pytest.raises(attngrad.ArgumentError, match="timeout must be"):
        attngrad.ring_attention(q, q, q, timeout=0)
    with pytest.raises(attngrad.ArgumentTypeError, match="group must be"):
        attngrad.ring_attention(q, q, q, group="world")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_bad_input_is_rejected_before_any_strategy_runs(strategy):
    # the same contract whichever strategy is asked for
    with pytest.raises(ValueError, match="attn_mask"):
        attngrad.attention(**good(attn_mask=t(NQ, NK + 1), strategy=strategy))


def test_heads_that_cannot_group_get_no_enable_gqa_hint():
    # 4 query heads over 3 k/v heads: enable_gqa=True would fail too, so do not suggest it
    with pytest.raises(ValueError) as info:
        attngrad.attention(**good(key=t(B, 3, NK, D), value=t(B, 3, NK, DV), enable_gqa=False))
    assert "query" in str(info.value)
    assert "enable_gqa=True" not in str(info.value)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(scale=0.0),  # SDPA accepts any finite scale, even 0 (uniform attention)
        dict(scale=-1.5),
        dict(scale=2),  # an int is a number
        dict(dropout_p=0),
        dict(attn_mask=t(NK)),  # [Nk] broadcasts over every query row
        dict(attn_mask=t(B, HQ, NQ, NK)),
        dict(attn_mask=torch.tensor(0.25)),  # a 0-d mask broadcasts to everything
        dict(key=t(B, HQ, NK, D), value=t(B, HQ, NK, DV)),  # enable_gqa=True with equal heads
    ],
    ids=[
        "scale-0",
        "scale-negative",
        "scale-int",
        "dropout-int-0",
        "mask-Nk",
        "mask-full",
        "mask-0d",
        "gqa-equal-heads",
    ],
)
def test_edge_values_that_are_valid(kwargs):
    out = attngrad.attention(**good(**kwargs), strategy=STRATEGIES[0])
    assert out.shape == (B, HQ, NQ, DV)
    assert torch.isfinite(out).all()


# ---------------------------------------------------------------------------
# no call modifies a tensor the caller passed


def _inputs(mask_kind: str, dtype: torch.dtype):
    q = t(B, HQ, NQ, D, dtype=dtype).requires_grad_()
    k = t(B, HKV, NK, D, dtype=dtype).requires_grad_()
    v = t(B, HKV, NK, DV, dtype=dtype).requires_grad_()
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(B, 1, NQ, NK) > 0.3
        mask[:, :, 1] = False  # a dead row: the path that fills P with zeros
    elif mask_kind == "float":
        mask = t(HQ, NQ, NK, dtype=dtype)
        mask[2, 3] = float("-inf")
        mask.requires_grad_()
    return q, k, v, mask


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("mask_kind", MASK_KINDS)
def test_inputs_are_never_modified(strategy, dtype, mask_kind):
    q, k, v, mask = _inputs(mask_kind, dtype)
    dout = t(B, HQ, NQ, DV, dtype=dtype)
    passed = {"q": q, "k": k, "v": v, "dout": dout}
    if mask is not None:
        passed["mask"] = mask
    clones = {n: x.detach().clone() for n, x in passed.items()}
    versions = {n: x._version for n, x in passed.items()}

    out = attngrad.attention(
        q, k, v, mask, is_causal=mask_kind == "causal", enable_gqa=True, strategy=strategy
    )
    out.backward(dout)

    for name, x in passed.items():
        assert x._version == versions[name], f"{name} was written in place"
        assert torch.equal(x.detach(), clones[name]), f"{name} changed"


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_backward_twice_gives_the_same_gradients(strategy):
    # the explicit backward works on P in place (softmax_backward_); a second
    # backward over the same graph must still see the saved P untouched
    q, k, v, mask = _inputs("float", torch.float64)
    out = attngrad.attention(q, k, v, mask, enable_gqa=True, strategy=strategy)
    dout = torch.randn_like(out)
    first = torch.autograd.grad(out, (q, k, v, mask), dout, retain_graph=True)
    second = torch.autograd.grad(out, (q, k, v, mask), dout)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)
