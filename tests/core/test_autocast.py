"""Autocast: attngrad casts its inputs as autocast casts SDPA's, and runs its own precisions inside."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import attngrad
from attngrad.verify.reference import reference_attention
from helpers import tiny_llama

B, H, N, D = 2, 4, 24, 16


def _qkv(dtypes: tuple[torch.dtype, ...]) -> list[torch.Tensor]:
    shapes = [(B, H, N, D), (B, 2, N, D), (B, 2, N, D)]
    return [torch.randn(s).to(t).requires_grad_() for s, t in zip(shapes, dtypes, strict=True)]


@pytest.mark.parametrize("autocast_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("strategy", ["explicit", "flash"])
def test_mixed_dtypes_run_in_the_autocast_dtype(strategy: str, autocast_dtype: torch.dtype) -> None:
    # RoPE leaves q and k in float32 while v comes out of a 16-bit projection
    q, k, v = _qkv((torch.float32, torch.float32, autocast_dtype))
    with torch.autocast("cpu", autocast_dtype):
        o = attngrad.attention(q, k, v, is_causal=True, enable_gqa=True, strategy=strategy)
        o_sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert o.dtype == o_sdpa.dtype == autocast_dtype
    # the same as casting by hand outside autocast, bit for bit
    casted = [t.detach().to(autocast_dtype).requires_grad_() for t in (q, k, v)]
    o_ref = attngrad.attention(*casted, is_causal=True, enable_gqa=True, strategy=strategy)
    assert torch.equal(o, o_ref)
    dout = torch.randn_like(o)
    grads = torch.autograd.grad(o, (q, k, v), dout)
    grads_ref = torch.autograd.grad(o_ref, casted, dout)
    for g, g_ref, t in zip(grads, grads_ref, (q, k, v), strict=True):
        assert g.dtype == t.dtype  # the cast is differentiable: each input gets its own dtype
        assert not g.isnan().any()
        assert torch.equal(g, g_ref.to(t.dtype))


def test_backward_inside_autocast_is_backward_outside() -> None:
    q, k, v = _qkv((torch.float32,) * 3)
    dout = torch.randn(B, H, N, D)
    grads = []
    for inside in (True, False):
        with torch.autocast("cpu", torch.bfloat16):
            o = attngrad.attention(q, k, v, enable_gqa=True, strategy="flash")
            if inside:
                grads.append(torch.autograd.grad(o, (q, k, v), dout.bfloat16()))
        if not inside:
            grads.append(torch.autograd.grad(o, (q, k, v), dout.bfloat16()))
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)


def test_two_times_rule_against_sdpa_under_autocast() -> None:
    q, k, v = _qkv((torch.float32,) * 3)
    ref = reference_attention(q.double(), k.double(), v.double(), is_causal=True, enable_gqa=True)
    with torch.autocast("cpu", torch.bfloat16):
        ours = attngrad.attention(q, k, v, is_causal=True, enable_gqa=True, strategy="flash")
        sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    err = (ours.double() - ref).abs().max()
    err_sdpa = (sdpa.double() - ref).abs().max()
    # floor: one bfloat16 rounding of the output's magnitude
    floor = torch.finfo(torch.bfloat16).eps * ref.abs().max()
    assert err <= 2 * err_sdpa + floor, (err, err_sdpa)


def test_float64_and_bool_masks_are_not_cast() -> None:
    q, k, v = _qkv((torch.float64,) * 3)
    keep = torch.rand(N, N) > 0.3
    with torch.autocast("cpu", torch.bfloat16):
        o = attngrad.attention(q, k, v, attn_mask=keep, enable_gqa=True)
    assert o.dtype == torch.float64


def test_float_bias_is_cast_and_gets_its_gradient() -> None:
    q, k, v = _qkv((torch.float32,) * 3)
    bias = torch.randn(1, 1, N, N, requires_grad=True)
    with torch.autocast("cpu", torch.bfloat16):
        o = attngrad.attention(q, k, v, attn_mask=bias, enable_gqa=True)
    (g,) = torch.autograd.grad(o.float().sum(), bias)
    assert g.dtype == torch.float32 and g.shape == bias.shape and not g.isnan().any()


def test_mixed_dtypes_outside_autocast_stay_a_type_error() -> None:
    q, k, v = _qkv((torch.float32, torch.float32, torch.bfloat16))
    with pytest.raises(TypeError, match="dtype"):
        attngrad.attention(q, k, v, enable_gqa=True)


def test_caller_tensors_are_not_modified() -> None:
    q, k, v = _qkv((torch.float32, torch.float32, torch.bfloat16))
    before = [t.detach().clone() for t in (q, k, v)]
    with torch.autocast("cpu", torch.bfloat16):
        attngrad.attention(q, k, v, enable_gqa=True).float().sum().backward()
    for t, b in zip((q, k, v), before, strict=True):
        assert t.dtype == b.dtype and torch.equal(t.detach(), b)


def test_llama_under_autocast_runs_as_sdpa_does() -> None:
    # RoPE leaves q, k in float32 while v comes from a bfloat16 projection
    model = tiny_llama()  # skips without transformers
    from attngrad.integrations.transformers import register

    name = register("attngrad-autocast", strategy="flash")
    ids = torch.randint(0, 64, (2, 16))
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[0, :4] = 0
    live = mask.bool()
    model.set_attn_implementation("sdpa")  # eager's float64 softmax is NaN on left padding
    ref = model.double()(ids, attention_mask=mask).logits[live].detach()
    model.float()
    logits = {}
    for impl in ("sdpa", name):
        model.set_attn_implementation(impl)
        with torch.autocast("cpu", torch.bfloat16):
            out = model(ids, attention_mask=mask).logits
        out.float().sum().backward()
        assert all(not p.grad.isnan().any() for p in model.parameters())
        model.zero_grad()
        logits[impl] = out[live].double()
    err, err_sdpa = ((logits[i] - ref).abs().max() for i in (name, "sdpa"))
    floor = torch.finfo(torch.bfloat16).eps * ref.abs().max()
    assert err <= 2 * err_sdpa + floor, (err, err_sdpa)


def test_causal_bias_passes_autocast() -> None:
    from torch.nn.attention.bias import causal_lower_right

    q = torch.randn(1, 2, 4, 8)
    k = torch.randn(1, 2, 6, 8)
    with torch.autocast("cpu", torch.bfloat16):
        o = attngrad.attention(q, k, k, attn_mask=causal_lower_right(4, 6))
        o_sdpa = F.scaled_dot_product_attention(q, k, k, attn_mask=causal_lower_right(4, 6))
    assert o.dtype == o_sdpa.dtype == torch.bfloat16
