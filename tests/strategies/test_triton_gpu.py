"""Strategy "triton" compiled on a CUDA GPU (skipped without one).

Run with TRITON_INTERPRET=0 so that the kernels compile instead of being
interpreted (benchmarks/run_gpu.sh does).  Sizes are larger than the
interpreter's: many tiles, partial last tiles, head dims 64..256.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import attngrad
from attngrad.strategies import unavailable_reason
from attngrad.verify.cases import make_inputs, outputs_and_grads
from attngrad.verify.check import strategy_fn
from helpers import assert_rule, assert_scores_rebuilt_bit_for_bit, case

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or unavailable_reason("triton", torch.device("cuda")) is not None,
    reason="needs a CUDA GPU and Triton",
)

CUDA = torch.device("cuda")


def _on_cuda(c):
    """`make_inputs` (drawn on the CPU, the same numbers every run) moved to the GPU.

    Query row 1 attends nothing: make_inputs kills it in a bool mask, -inf here in a float one.
    """
    inputs = make_inputs(c)
    if c.mask == "float":
        inputs["mask"][..., 1, :] = float("-inf")  # type: ignore[index]
    return {n: None if t is None else t.to(CUDA) for n, t in inputs.items()}


def _judge(c, strategy="triton", inputs=None):
    """Run ``strategy`` on the case on the GPU; assert the rule; the results."""
    inputs = _on_cuda(c) if inputs is None else inputs
    got = outputs_and_grads(strategy_fn(strategy), c, inputs, c.dtype)
    assert_rule(c, inputs, got)
    return got


CASES = [
    # (B, Hq, Hkv, Nq, Nk, d, dv, mask, causal)
    (2, 4, 4, 1000, 1000, 64, 64, None, False),
    (2, 4, 4, 1000, 1000, 64, 64, None, True),
    (1, 8, 2, 777, 1025, 128, 128, None, True),
    (1, 4, 4, 513, 300, 80, 48, "bool", False),
    (2, 4, 2, 600, 600, 128, 128, "float", False),
    (1, 2, 2, 384, 384, 256, 256, None, True),
]


def _case(b, hq, hkv, nq, nk, d, dv, mask_kind, causal, dtype):
    kind = mask_kind or ("causal" if causal else "none")
    mask_shape = {"bool": (nq, nk), "float": (hq, nq, nk)}.get(kind)
    return case((b,), hq, hkv, nq, nk, d, dv, kind, mask_shape, dtype=dtype, enable_gqa=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("sizes", CASES, ids=str)
def test_rule_against_float64_reference(sizes, dtype):
    _judge(_case(*sizes, dtype))


def test_float64_obeys_the_rule():
    _judge(_case(1, 4, 2, 300, 257, 64, 64, "float", False, torch.float64))


def test_window_obeys_the_rule_like_flash():
    c = dataclasses.replace(_case(1, 4, 4, 700, 700, 64, 64, None, False, torch.float32),
                            window=(100, 0))  # fmt: skip
    inputs = _on_cuda(c)
    for strategy in ("flash", "triton"):
        _judge(c, strategy, inputs)


def test_backward_is_deterministic():
    c = _case(2, 8, 2, 1024, 1024, 128, 128, None, False, torch.bfloat16)
    inputs = _on_cuda(c)
    fn = strategy_fn("triton")
    first = outputs_and_grads(fn, c, inputs, c.dtype)
    again = outputs_and_grads(fn, c, inputs, c.dtype)
    for name in first:
        assert torch.equal(first[name], again[name]), name


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


def test_band_softcap_and_dropout_agree_with_flash_in_float64():
    # compiled: the per-row band over packed segments, the kernels' tanh and the dropout
    # hash against flash's tensor ops (float64, so any difference beyond rounding is a bug)
    def leaf(*shape):
        return torch.randn(*shape, dtype=torch.float64, device=CUDA).requires_grad_()

    q, k, v, bias = leaf(2, 4, 300, 64), leaf(2, 2, 333, 64), leaf(2, 2, 333, 48), leaf(4, 300, 333)
    cu_q = torch.tensor([0, 100, 180, 300], device=CUDA)
    cu_k = torch.tensor([0, 150, 150, 333], device=CUDA)  # segment 1: no keys, dead rows
    dout, dlse = (
        torch.randn(2, 4, 300, 48, dtype=torch.float64, device=CUDA),
        torch.randn(2, 4, 300, dtype=torch.float64, device=CUDA),
    )
    results = {}
    for strategy in ("flash", "triton"):
        out, lse = attngrad.attention(
            q, k, v, bias, 0.2, enable_gqa=True, strategy=strategy, softcap=20.0,
            window=(64, 0), align="bottom-right", cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
            generator=torch.Generator(CUDA).manual_seed(0), return_lse=True,
        )  # fmt: skip
        loss = (out * dout).sum() + (lse.masked_fill(lse.isinf(), 0.0) * dlse).sum()
        results[strategy] = [out, lse, *torch.autograd.grad(loss, (q, k, v, bias))]
    for name, got, want in zip(
        ("out", "lse", "dq", "dk", "dv", "dbias"), results["triton"], results["flash"], strict=True
    ):
        torch.testing.assert_close(
            got, want, rtol=1e-9, atol=1e-11, msg=lambda m, n=name: f"{n}: {m}"
        )


@pytest.fixture
def tf32_matmuls():
    """PyTorch's float32 matmuls on CUDA in TF32 for the test, as a user sets it."""
    matmul = torch.backends.cuda.matmul
    before = matmul.fp32_precision
    matmul.fp32_precision = "tf32"
    yield
    matmul.fp32_precision = before


def test_tf32_dots_obey_the_rule_against_pytorch_in_tf32(tf32_matmuls):
    # the plain float32 run the rule compares with is PyTorch's own, on the GPU with TF32 on
    c = _case(2, 4, 2, 600, 600, 128, 128, "float", False, torch.float32)
    inputs = _on_cuda(c)
    tf32 = _judge(c, inputs=inputs)
    torch.backends.cuda.matmul.fp32_precision = "ieee"
    ieee = outputs_and_grads(strategy_fn("triton"), c, inputs, c.dtype)
    # TF32 keeps 10 mantissa bits: its output cannot equal the IEEE dots' bit for bit
    assert not torch.equal(tf32["out"], ieee["out"])


@pytest.mark.parametrize(("dtype", "precision"), [("float16", "ieee"), ("float32", "tf32")])
def test_compile_report_matches_the_kernels_this_gpu_built(dtype, precision):
    # what `attngrad kernels` predicts without a GPU (registers, local memory, shared bytes)
    # is what the driver reports for the kernels built here, and the target's shared-memory
    # limit is this GPU's
    from attngrad.strategies.triton.ptxas import bind, compile_bound, default_cache_dir
    from attngrad.tools import kernel_report

    major, minor = torch.cuda.get_device_capability()
    arch = 10 * major + minor
    limit = torch.cuda.get_device_properties(CUDA).shared_memory_per_block_optin
    target = kernel_report.TARGETS.get(f"sm_{arch}")
    if target is not None:
        assert target.shared_limit == limit
    variant = kernel_report.Variant(dtype, precision, 128, "all", 4)
    for name, args, fn in kernel_report.launches(variant, arch):
        predicted = compile_bound(bind(fn, args, arch), default_cache_dir())
        # the recorded arguments carry the precision: PRECISION="tf32" for the tf32 variant
        on_gpu = fn.warmup(**{n: _to_cuda(a) for n, a in args.items()}, grid=(1,))
        on_gpu._init_handles()
        assert predicted.registers == on_gpu.n_regs, name
        # the driver's n_spills is the local memory (the stack frame) in 4-byte words
        assert predicted.stack_bytes // 4 == on_gpu.n_spills, name
        assert predicted.shared_bytes == on_gpu.metadata.shared <= limit, name


def _to_cuda(a):
    return a.to(CUDA) if isinstance(a, torch.Tensor) else a


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_backward_rebuilds_the_scores_forward_formed_bit_for_bit(dtype, head_dim):
    # the invariant of tests/strategies/test_triton.py on compiled kernels: forward, dK/dV
    # (k q^T) and dQ form every score with the same bits in their own tiles.  FMA dots sum in
    # column order; tensor-core dots are assumed to round alike whichever operand is first, and
    # the kernels' head-dim slices (`configs` CHUNK, which differ between kernels at d = 256)
    # to chain into one accumulator: this is where that is checked
    assert_scores_rebuilt_bit_for_bit("triton", dtype, CUDA, {}, head_dim)
