"""Strategy "triton": its kernels in Triton's interpreter (CPU tensors, TRITON_INTERPRET=1).

The strategy also runs through every strategy-parametrized test of the suite;
this file adds what is its own: head dims 16..256 padded inside the kernels,
tile skipping, block sizes, the bias gradient's broadcasts, and the errors
where it cannot run.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import attngrad
from attngrad.contract import Shapes
from attngrad.ledger import Layout, ledger_row
from attngrad.reference import reference_attention
from attngrad.strategies import available, resolve, unavailable_reason
from attngrad.strategies import triton as triton_strategy
from attngrad.verify import two_x_bound

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(
    unavailable_reason("triton", CPU) is not None,
    reason=str(unavailable_reason("triton", CPU)),
)


def _grads(out: torch.Tensor, inputs: list[torch.Tensor], dout: torch.Tensor):
    return torch.autograd.grad(out, inputs, dout)


def _band(nq: int, nk: int, window) -> torch.Tensor:
    """The window as an additive mask [Nq, Nk]: 0 inside, -inf outside."""
    left, right = window
    offset = torch.arange(nk)[None, :] - torch.arange(nq)[:, None]  # j - i
    inside = torch.ones(nq, nk, dtype=torch.bool)
    if left is not None:
        inside &= offset >= -left
    if right is not None:
        inside &= offset <= right
    return torch.zeros(nq, nk, dtype=torch.float64).masked_fill(~inside, float("-inf"))


def _compare_to_reference(q, k, v, dout, atol=1e-9, **kw):
    """float64 inputs: output and every gradient within ``atol`` of the reference."""
    inputs = [t for t in (q, k, v, kw.get("attn_mask")) if t is not None and t.requires_grad]
    out = attngrad.attention(q, k, v, strategy="triton", **kw)
    ref_kw = {key: val for key, val in kw.items() if key not in ("block_q", "block_k", "window")}
    if kw.get("window") is not None:
        ref_kw["attn_mask"] = kw["attn_mask"] + _band(q.shape[-2], k.shape[-2], kw["window"])
    want = reference_attention(q, k, v, **ref_kw)
    torch.testing.assert_close(out, want, atol=atol, rtol=0)
    for got, ref in zip(_grads(out, inputs, dout), _grads(want, inputs, dout), strict=True):
        assert not got.isnan().any()
        torch.testing.assert_close(got, ref, atol=atol, rtol=0)


def _leaf(*shape: int, dtype=torch.float64) -> torch.Tensor:
    return torch.randn(*shape, dtype=dtype).requires_grad_()


@pytest.mark.parametrize(("d", "dv"), [(16, 16), (24, 24), (40, 72), (128, 128), (200, 256)])
def test_head_dims_up_to_256_padded_inside_the_kernel(d, dv):
    q, k, v = _leaf(1, 2, 19, d), _leaf(1, 2, 23, d), _leaf(1, 2, 23, dv)
    _compare_to_reference(q, k, v, torch.randn(1, 2, 19, dv, dtype=torch.float64))


def test_head_dim_above_256_names_the_limit():
    q = torch.randn(1, 1, 4, 264)
    with pytest.raises(ValueError, match="256"):
        attngrad.attention(q, q, q, strategy="triton")


@pytest.mark.parametrize("window", [(None, 0), (5, 3), (7, 0), (0, None), (None, 2)], ids=str)
def test_many_tiles_with_band_gqa_and_bias_gradient(window):
    # 16 x 16 tiles over 53 x 61 scores: partial tiles at both ends, skipped ones inside
    q, k, v = _leaf(1, 4, 53, 16), _leaf(1, 2, 61, 16), _leaf(1, 2, 61, 8)
    bias = _leaf(4, 53, 61)
    _compare_to_reference(
        q, k, v, torch.randn(1, 4, 53, 8, dtype=torch.float64),
        attn_mask=bias, window=window, enable_gqa=True, block_q=16, block_k=16,
    )  # fmt: skip


@pytest.mark.parametrize("kind", ["causal", "bool"])
def test_many_tiles_with_causal_or_bool_mask(kind):
    q, k, v = _leaf(2, 2, 53, 16), _leaf(2, 2, 40, 16), _leaf(2, 2, 40, 16)
    kw = {"is_causal": True} if kind == "causal" else {"attn_mask": torch.rand(53, 40) > 0.4}
    _compare_to_reference(
        q, k, v, torch.randn(2, 2, 53, 16, dtype=torch.float64), block_q=16, block_k=16, **kw
    )


@pytest.mark.parametrize(
    "mask_shape", [(1, 1, 1, 29), (2, 1, 17, 29), (1, 4, 17, 1), (17, 29)], ids=str
)
def test_bias_gradient_sums_over_broadcast_dims(mask_shape):
    q, k, v = _leaf(2, 4, 17, 16), _leaf(2, 4, 29, 16), _leaf(2, 4, 29, 16)
    bias = _leaf(*mask_shape)
    _compare_to_reference(
        q, k, v, torch.randn(2, 4, 17, 16, dtype=torch.float64), attn_mask=bias, window=(None, 0)
    )


def test_gradcheck_across_tiles_with_gqa_bias_and_window():
    q, k, v = _leaf(1, 2, 18, 16), _leaf(1, 1, 20, 16), _leaf(1, 1, 20, 16)
    bias = _leaf(18, 20)

    def call(q, k, v, bias):
        return attngrad.attention(
            q, k, v, attn_mask=bias, window=(6, 2), enable_gqa=True,
            strategy="triton", block_q=16, block_k=16,
        )  # fmt: skip

    assert torch.autograd.gradcheck(call, (q, k, v, bias), fast_mode=True)


def test_skipped_tiles_are_never_read():
    # causal with Nq = 16 < Nk = 64: keys 16.. are outside every query's band.  If a
    # kernel visited their tiles, the NaN there would reach O or the gradients.
    q = _leaf(1, 1, 16, 16)
    k, v = torch.randn(1, 1, 64, 16, dtype=q.dtype), torch.randn(1, 1, 64, 16, dtype=q.dtype)
    k[..., 16:, :] = float("nan")
    v[..., 16:, :] = float("nan")
    k.requires_grad_()
    v.requires_grad_()
    out = attngrad.attention(q, k, v, is_causal=True, strategy="triton", block_q=16, block_k=16)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert not out.isnan().any() and not dq.isnan().any()
    # the unreachable keys get exactly zero gradient, their NaN never multiplied in
    assert dk[..., 16:, :].eq(0).all() and dv[..., 16:, :].eq(0).all()
    kv = (k.detach()[..., :16, :], v.detach()[..., :16, :])
    want = reference_attention(q.detach(), *kv, is_causal=True)
    torch.testing.assert_close(out.detach(), want, atol=1e-12, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_two_x_rule_with_gqa_and_float_mask(dtype):
    q64, k64, v64 = _leaf(1, 4, 45, 64), _leaf(1, 2, 45, 64), _leaf(1, 2, 45, 64)
    bias64 = _leaf(45, 45)
    dout64 = torch.randn(1, 4, 45, 64, dtype=torch.float64)
    kw = {"enable_gqa": True}
    leaves = [q64, k64, v64, bias64]
    ref = reference_attention(q64, k64, v64, attn_mask=bias64, **kw)
    ref_grads = _grads(ref, leaves, dout64)
    low = [t.detach().to(dtype).requires_grad_() for t in leaves]
    plain = reference_attention(*low[:3], attn_mask=low[3], **kw)  # the plain path in dtype
    out = attngrad.attention(*low[:3], attn_mask=low[3], strategy="triton", **kw)
    assert out.dtype == dtype
    pairs = [(out, plain, ref)]
    grads = _grads(out, low, dout64.to(dtype))
    plain_grads = _grads(plain, low, dout64.to(dtype))
    pairs += list(zip(grads, plain_grads, ref_grads, strict=True))
    for got, base, want in pairs:
        assert got.dtype == dtype and not got.isnan().any()
        err = (got.double() - want).abs().max().item()
        base_err = (base.double() - want).abs().max().item()
        bound = two_x_bound(base_err, dtype, want.abs().max().item())
        assert err <= bound, (err, bound)


def test_saves_what_flash_saves():
    q, k = _leaf(1, 4, 20, 16, dtype=torch.float32), _leaf(1, 2, 24, 16, dtype=torch.float32)
    v = _leaf(1, 2, 24, 8, dtype=torch.float32)
    shapes: dict[str, list[tuple[tuple[int, ...], torch.dtype]]] = {}
    for strategy in ("flash", "triton"):
        saved: list[torch.Tensor] = []

        def pack(t, saved=saved):
            saved.append(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            attngrad.attention(q, k, v, enable_gqa=True, strategy=strategy)
        shapes[strategy] = [(tuple(t.shape), t.dtype) for t in saved]
    assert shapes["triton"] == shapes["flash"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_ledger_predicts_saved_bytes_byte_for_byte(dtype):
    layout = Layout(2, 4, 2, 24, 40, 16, 8, dtype, causal=True)
    row = ledger_row("triton", layout, peak=False)
    assert (
        row.predicted_saved
        == row.measured_saved
        == ledger_row("flash", layout, peak=False).measured_saved
    )


@pytest.mark.parametrize("value", [8, 24, 100, 512])
def test_block_sizes_must_be_powers_of_two_from_16_to_256(value):
    q = torch.randn(1, 1, 8, 16)
    with pytest.raises(ValueError, match="power of two from 16 to 256"):
        attngrad.attention(q, q, q, strategy="triton", block_q=value)


def test_default_blocks_fit_the_sequence():
    blocks = triton_strategy.choose_blocks(20, 5, 128, None, None)
    assert blocks["forward"] == (32, 16) and blocks["dkdv"] == (32, 16)
    assert triton_strategy.choose_blocks(4096, 4096, 128, 64, None)["dq"] == (64, 32)
    # wider head rows take narrower tiles: float64 at d = 256 is 2 KiB a row
    assert triton_strategy.choose_blocks(4096, 4096, 2048, None, None)["forward"] == (32, 16)


def test_auto_picks_triton_on_cuda_only():
    shapes = Shapes((1,), 8, 8, 256, 256, 64, 64)
    assert resolve("auto", shapes, False, device=torch.device("cuda")) == "triton"
    # head dims past the kernels' 256 stay on the tensor-op strategies, even on CUDA
    wide = Shapes((1,), 8, 8, 256, 256, 300, 300)
    assert resolve("auto", wide, False, device=torch.device("cuda")) == "explicit"
    assert resolve("auto", shapes, False, device=CPU) == "explicit"
    # the interpreter makes it runnable on CPU for the conformance check, not for timing
    assert "triton" in available(CPU, interpreted=True)
    assert "triton" not in available(CPU)


def test_without_triton_installed_the_error_says_how_to_get_it(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a)
    )
    q = torch.randn(1, 1, 4, 16)
    with pytest.raises(RuntimeError, match=r"attngrad\[gpu\]"):
        attngrad.attention(q, q, q, strategy="triton")
    shapes = Shapes((1,), 1, 1, 4, 4, 16, 16)
    assert resolve("auto", shapes, False, device=torch.device("cuda")) == "explicit"


def test_cpu_tensors_without_the_interpreter_are_refused():
    code = (
        "import torch, attngrad\n"
        "q = torch.randn(1, 1, 4, 16)\n"
        "try:\n"
        "    attngrad.attention(q, q, q, strategy='triton')\n"
        "except RuntimeError as e:\n"
        "    print(e)\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert "CUDA" in out.stdout and "TRITON_INTERPRET=1" in out.stdout


def test_commands_refuse_triton_cleanly_where_it_cannot_run():
    code = (
        "from attngrad import cli\n"
        "for argv in (['check', '--strategy', 'triton'], ['explain', '--strategy', 'triton'],\n"
        "             ['bench', '--strategy', 'triton', '--seq', '16'],\n"
        "             ['ledger', '--path', 'triton', '--seq-q', '16']):\n"
        "    print(argv[0], cli.main(argv))\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["check", "2", "explain", "2", "bench", "2", "ledger", "2"]
    assert out.stderr.count("TRITON_INTERPRET=1") == 4
    assert "Traceback" not in out.stderr


def test_ledger_leaves_out_the_interpreters_peak():
    layout = Layout(1, 2, 2, 16, 16, 16, 16, torch.float32)
    row = ledger_row("triton", layout)
    assert row.peak is None and row.peak_beyond_io is None
