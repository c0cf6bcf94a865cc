"""Strategy "triton" compiled on a CUDA GPU (skipped without one).

Run with TRITON_INTERPRET=0 so that the kernels compile instead of being
interpreted (benchmarks/run_gpu.sh does).  Sizes are larger than the
interpreter's: many tiles, partial last tiles, head dims 64..256.
"""

from __future__ import annotations

import pytest
import torch

import attngrad
from attngrad.reference import reference_attention
from attngrad.strategies import unavailable_reason
from attngrad.verify import two_x_bound

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or unavailable_reason("triton", torch.device("cuda")) is not None,
    reason="needs a CUDA GPU and Triton",
)

CUDA = torch.device("cuda")


def _inputs(b, hq, hkv, nq, nk, d, dv, mask_kind):
    gen = torch.Generator(device=CUDA).manual_seed(0)

    def randn(*shape):
        return torch.randn(shape, generator=gen, device=CUDA, dtype=torch.float64)

    q, k, v = randn(b, hq, nq, d), randn(b, hkv, nk, d), randn(b, hkv, nk, dv)
    dout = randn(b, hq, nq, dv)
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(nq, nk, generator=gen, device=CUDA) > 0.3
        mask[1] = False  # a row that attends nothing
    elif mask_kind == "float":
        mask = randn(hq, nq, nk)
        mask[:, 1] = float("-inf")
    return q, k, v, mask, dout


def _run(q, k, v, mask, dout, dtype, fn, **kw):
    leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    m = None
    if mask is not None:
        m = mask if mask.dtype == torch.bool else mask.to(dtype).requires_grad_()
        if m.requires_grad:
            leaves.append(m)
    out = fn(*leaves[:3], attn_mask=m, **kw)
    return [out, *torch.autograd.grad(out, leaves, dout.to(dtype))]


CASES = [
    # (B, Hq, Hkv, Nq, Nk, d, dv, mask, causal)
    (2, 4, 4, 1000, 1000, 64, 64, None, False),
    (2, 4, 4, 1000, 1000, 64, 64, None, True),
    (1, 8, 2, 777, 1025, 128, 128, None, True),
    (1, 4, 4, 513, 300, 80, 48, "bool", False),
    (2, 4, 2, 600, 600, 128, 128, "float", False),
    (1, 2, 2, 384, 384, 256, 256, None, True),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_two_x_rule_against_float64_reference(case, dtype):
    *sizes, mask_kind, causal = case
    q, k, v, mask, dout = _inputs(*sizes, mask_kind)
    kw = {"is_causal": causal, "enable_gqa": True}
    ref = _run(q, k, v, mask, dout, torch.float64, reference_attention, **kw)
    plain = _run(q, k, v, mask, dout, dtype, reference_attention, **kw)
    got = _run(q, k, v, mask, dout, dtype, attngrad.attention, strategy="triton", **kw)
    for g, p, r in zip(got, plain, ref, strict=True):
        assert g.dtype == dtype and not g.isnan().any()
        err = (g.double() - r).abs().max().item()
        bound = two_x_bound((p.double() - r).abs().max().item(), dtype, r.abs().max().item())
        assert err <= bound, (err, bound)


def test_float64_matches_the_reference():
    q, k, v, mask, dout = _inputs(1, 4, 2, 300, 257, 64, 64, "float")
    kw = {"enable_gqa": True}
    ref = _run(q, k, v, mask, dout, torch.float64, reference_attention, **kw)
    got = _run(q, k, v, mask, dout, torch.float64, attngrad.attention, strategy="triton", **kw)
    for g, r in zip(got, ref, strict=True):
        torch.testing.assert_close(g, r, atol=1e-9, rtol=0)


def test_window_matches_flash():
    q, k, v, _, dout = _inputs(1, 4, 4, 700, 700, 64, 64, None)
    kw = {"window": (100, 0)}
    want = _run(q, k, v, None, dout, torch.float32, attngrad.attention, strategy="flash", **kw)
    got = _run(q, k, v, None, dout, torch.float32, attngrad.attention, strategy="triton", **kw)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=2e-5, rtol=1e-4)


def test_backward_is_deterministic():
    q, k, v, _, dout = _inputs(2, 8, 2, 1024, 1024, 128, 128, None)
    first = _run(q, k, v, None, dout, torch.bfloat16, attngrad.attention, strategy="triton")
    again = _run(q, k, v, None, dout, torch.bfloat16, attngrad.attention, strategy="triton")
    for a, b in zip(first, again, strict=True):
        assert torch.equal(a, b)


def _graph_nodes(out: torch.Tensor) -> list[str]:
    """Names of every node of out's grad_fn graph."""
    names, stack = [], [out.grad_fn]
    while stack:
        node = stack.pop()
        if node is not None:
            names.append(type(node).__name__)
            stack += [n for n, _ in node.next_functions]
    return names


def test_auto_is_triton_on_cuda():
    q = torch.randn(1, 2, 64, 64, device=CUDA, requires_grad=True)
    assert "TritonAttentionBackward" in _graph_nodes(attngrad.attention(q, q, q))
