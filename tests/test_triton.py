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
from attngrad.ledger import ledger_row
from attngrad.strategies import available, resolve, unavailable_reason
from attngrad.strategies import triton as triton_strategy
from attngrad.verify import Case, make_inputs, outputs_and_grads
from helpers import assert_rule, case

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(
    unavailable_reason("triton", CPU) is not None,
    reason=str(unavailable_reason("triton", CPU)),
)


def _triton(**kwargs):
    """attention on "triton" as an SDPA-like function for verify; ``kwargs`` (tiles) added."""

    def fn(q, k, v, mask, **kw):
        return attngrad.attention(q, k, v, mask, strategy="triton", **kw, **kwargs)

    return fn


def _judge(c, inputs=None, **kwargs):
    """Run triton on the case (its `make_inputs` unless given); assert the rule."""
    inputs = make_inputs(c) if inputs is None else inputs
    assert_rule(c, inputs, outputs_and_grads(_triton(**kwargs), c, inputs, c.dtype))


def _leaf(*shape: int, dtype=torch.float64) -> torch.Tensor:
    return torch.randn(*shape, dtype=dtype).requires_grad_()


@pytest.mark.parametrize(("d", "dv"), [(16, 16), (24, 24), (40, 72), (128, 128), (200, 256)])
def test_head_dims_up_to_256_padded_inside_the_kernel(d, dv):
    _judge(case((1,), 2, 2, 19, 23, d, dv))


def test_head_dim_above_256_names_the_limit():
    q = torch.randn(1, 1, 4, 264)
    with pytest.raises(ValueError, match="256"):
        attngrad.attention(q, q, q, strategy="triton")


@pytest.mark.parametrize("window", [(None, 0), (5, 3), (7, 0), (0, None), (None, 2)], ids=str)
def test_many_tiles_with_band_gqa_and_bias_gradient(window):
    # 16 x 16 tiles over 53 x 61 scores: partial tiles at both ends, skipped ones inside
    c = case((1,), 4, 2, 53, 61, 16, 8, "float", (4, 53, 61), window=window)
    _judge(c, block_q=16, block_k=16)


@pytest.mark.parametrize("kind", ["causal", "bool"])
def test_many_tiles_with_causal_or_bool_mask(kind):
    _judge(case((2,), 2, 2, 53, 40, 16, 16, kind, (53, 40) if kind == "bool" else None),
           block_q=16, block_k=16)  # fmt: skip


@pytest.mark.parametrize(
    "mask_shape", [(1, 1, 1, 29), (2, 1, 17, 29), (1, 4, 17, 1), (17, 29)], ids=str
)
def test_bias_gradient_sums_over_broadcast_dims(mask_shape):
    _judge(case((2,), 4, 4, 17, 29, 16, 16, "float", mask_shape, window=(None, 0)))


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
    c = case((1,), 1, 1, 16, 16, 16, 16, "causal")  # the keys a query can reach
    inputs = make_inputs(c)
    inputs["dout"] = torch.ones(1, 1, 16, 16, dtype=torch.float64)
    q = inputs["q"].clone().requires_grad_()
    k, v = torch.randn(1, 1, 64, 16, dtype=q.dtype), torch.randn(1, 1, 64, 16, dtype=q.dtype)
    k[..., :16, :], v[..., :16, :] = inputs["k"], inputs["v"]
    k[..., 16:, :] = float("nan")
    v[..., 16:, :] = float("nan")
    k.requires_grad_()
    v.requires_grad_()
    out = attngrad.attention(q, k, v, is_causal=True, strategy="triton", block_q=16, block_k=16)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), inputs["dout"])
    assert not out.isnan().any() and not dq.isnan().any()
    # the unreachable keys get exactly zero gradient, their NaN never multiplied in
    assert dk[..., 16:, :].eq(0).all() and dv[..., 16:, :].eq(0).all()
    got = {"out": out.detach(), "dq": dq, "dk": dk[..., :16, :], "dv": dv[..., :16, :]}
    assert_rule(c, inputs, got)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_low_precision_rule_with_gqa_and_float_mask(dtype):
    _judge(case((1,), 4, 2, 45, 45, 64, 64, "float", (45, 45), dtype=dtype))


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
    layout = Case(Shapes((2,), 4, 2, 24, 40, 16, 8), dtype, "causal")
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
        "             ['ledger', '--strategy', 'triton', '--seq-q', '16']):\n"
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
    layout = Case(Shapes((1,), 2, 2, 16, 16, 16, 16), torch.float32)
    row = ledger_row("triton", layout)
    assert row.peak is None and row.peak_beyond_io is None
