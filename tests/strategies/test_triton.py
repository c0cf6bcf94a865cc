"""Strategy "triton": its kernels in Triton's interpreter (CPU tensors, TRITON_INTERPRET=1).

The strategy also runs through every strategy-parametrized test of the suite;
this file adds what is its own: head dims 16..256 padded inside the kernels,
tile skipping, block sizes, the bias gradient's broadcasts, the errors where
it cannot run, and the band (alignment, windows, packed segments), softcap
and dropout against a float64 reference built here from the full score
matrix (plain torch ops, autograd for the gradients).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import attngrad
from attngrad.core.band import Band
from attngrad.core.contract import Shapes
from attngrad.core.dropout import Dropout, draw_seed, keep_mask
from attngrad.core.interface import Backward, Problem
from attngrad.strategies import available, resolve, unavailable_reason
from attngrad.strategies.triton import configs, interpreter
from attngrad.strategies.triton import strategy as triton_strategy
from attngrad.tools import kernel_report
from attngrad.tools.ledger import ledger_row
from attngrad.verify.cases import Case, make_inputs, outputs_and_grads
from helpers import assert_rule, assert_scores_rebuilt_bit_for_bit, case

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
kernels = pytest.importorskip(
    "attngrad.strategies.triton.kernels"
)  # after conftest set TRITON_INTERPRET

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


# -- band, softcap and dropout against a float64 reference ---------------------


def _band(nq, nk, is_causal=False, window=None, align="top-left", segments=None):
    """The `Band` attention builds from these arguments (causal: right = min(right, 0))."""
    left, right = window if window is not None else (None, None)
    if is_causal:
        right = 0 if right is None else min(right, 0)
    return Band.of(nq, nk, left, right, align, segments)


def _reference(q, k, v, bias=None, band=None, softcap=None, dropout=None):
    """(O, lse) from the full score matrix; q: [B, Hq, Nq, d], k, v: [B, Hkv, Nk, d | dv].

    S = q k^T / sqrt(d), capped, biased, masked outside the band; P of live
    rows (dead rows: P = 0, lse = -inf), times Z / (1 - p) under dropout.
    """
    b, hq, nq, d = q.shape
    g, nk = hq // k.shape[1], k.shape[2]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ k.transpose(-2, -1) / math.sqrt(d)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if bias is not None:
        s = s + bias
    if band is not None:
        j = torch.arange(nk)
        s = s.masked_fill((j < band.lo[:, None]) | (j >= band.hi[:, None]), float("-inf"))
    live = s.amax(-1, keepdim=True) > float("-inf")
    s = s.masked_fill(~live, 0.0)  # dead rows: finite, and cut off below
    p = torch.softmax(s, -1) * live
    lse = torch.where(live.squeeze(-1), torch.logsumexp(s, -1), float("-inf"))
    if dropout is not None:
        p = p * keep_mask(dropout, b, hq, nq, nk, CPU) * dropout.scale
    return p @ v, lse


def _dropout(p):
    """The `Dropout` attention draws from ``_generator()`` at dropout_p = p."""
    return Dropout(p, *draw_seed(CPU, _generator()))


def _generator():
    return torch.Generator().manual_seed(0)


def _inputs(b, hq, hkv, nq, nk, d, dtype=torch.float64, bias_shape=None):
    """q, k, v (and a bias of ``bias_shape``) requiring grad, drawn in float64 and rounded."""
    shapes = [(b, hq, nq, d), (b, hkv, nk, d), (b, hkv, nk, d)]
    shapes += [bias_shape] if bias_shape is not None else []
    return [torch.randn(s, dtype=torch.float64).to(dtype).requires_grad_() for s in shapes]


def _results(fn, tensors, dout, dlse):
    """O, lse and the gradients of <O, dout> + <lse, dlse> (dead rows' lse left out)."""
    out, lse = fn(*tensors)
    loss = (out * dout).sum() + (lse.masked_fill(lse == float("-inf"), 0.0) * dlse).sum()
    return [out, lse, *torch.autograd.grad(loss, tensors)]


def _runs(tensors, softcap=None, dropout_p=0.0, **kwargs):
    """Triton's, the float64 reference's and the plain (reference in the inputs' dtype) results.

    Each: O, lse, dq, dk, dv[, dbias] on ``tensors`` (q, k, v[, bias]), the
    gradients of one random <O, dout> + <lse, dlse>.  ``kwargs``: attention's
    band arguments (is_causal, window, align, cu_seqlens_q/k).
    """
    q, k, v = tensors[:3]
    cu = [kwargs.get(f"cu_seqlens_{x}") for x in "qk"]
    segments = None if cu[0] is None else tuple(tuple(c.tolist()) for c in cu)
    bands = {n: kwargs[n] for n in ("is_causal", "window", "align") if n in kwargs}
    band = _band(q.shape[2], k.shape[2], segments=segments, **bands)
    dropout = _dropout(dropout_p) if dropout_p > 0 else None
    dout = torch.randn(*q.shape[:3], v.shape[-1], dtype=torch.float64)
    dlse = torch.randn(q.shape[:3], dtype=torch.float64)

    def triton(q, k, v, bias=None):
        return attngrad.attention(
            q, k, v, bias, dropout_p, enable_gqa=True, strategy="triton", block_q=16,
            block_k=16, return_lse=True, softcap=softcap, generator=_generator(), **kwargs,
        )  # fmt: skip

    def reference(q, k, v, bias=None):
        return _reference(q, k, v, bias, band, softcap, dropout)

    wide = [t.detach().double().requires_grad_() for t in tensors]
    narrow = dout.to(q.dtype), dlse.to(q.dtype)
    return (
        _results(triton, tensors, *narrow),
        _results(reference, wide, dout, dlse),
        _results(reference, tensors, *narrow),
    )


_NAMES = ("out", "lse", "dq", "dk", "dv", "dbias")


def _assert_close(got, want, *_):
    """float64: triton within rounding of the reference, result by result."""
    for name, g, w in zip(_NAMES, got, want, strict=False):  # dbias only with a bias
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize(
    ("nq", "nk", "kwargs"),
    [
        (13, 37, {"is_causal": True}),
        (37, 13, {"is_causal": True}),
        (29, 23, {"window": (5, 2)}),
        (23, 29, {"window": (4, 3), "is_causal": True}),
    ],
    ids=["causal-Nq<Nk", "causal-Nq>Nk", "window", "causal-window"],
)
def test_bottom_right_band_with_gqa(nq, nk, kwargs):
    tensors = _inputs(1, 4, 2, nq, nk, 16)
    _assert_close(*_runs(tensors, align="bottom-right", **kwargs))


@pytest.mark.parametrize("align", ["top-left", "bottom-right"])
def test_packed_segments_with_an_empty_key_segment(align):
    # segment 1 has 4 queries and no key: dead rows (O = 0, lse = -inf, zero gradients)
    cu_q, cu_k = torch.tensor([0, 9, 13, 30]), torch.tensor([0, 12, 12, 26])
    tensors = _inputs(1, 2, 1, 30, 26, 16)
    runs = _runs(tensors, is_causal=True, align=align, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    out, lse, dq = runs[0][:3]
    assert out[:, :, 9:13].eq(0).all() and dq[:, :, 9:13].eq(0).all()
    assert lse[:, :, 9:13].eq(float("-inf")).all()
    _assert_close(*runs)


def test_softcap_with_a_bias_gradient_and_window():
    tensors = _inputs(2, 2, 2, 21, 35, 16, bias_shape=(2, 21, 35))
    with torch.no_grad():
        tensors[0].mul_(3.0)  # scores well past the cap c = 2
    _assert_close(*_runs(tensors, softcap=2.0, window=(None, 4)))


@pytest.mark.parametrize("softcap", [0.05, 1.0, 30.0])
def test_softcap_in_float32_within_twice_the_plain_error(softcap):
    # per result: max |triton - ref| <= 2 max |plain - ref| + u max |ref|
    tensors = _inputs(1, 2, 1, 19, 27, 16, torch.float32, bias_shape=(19, 27))
    got, want, plain = _runs(tensors, softcap=softcap)
    u = torch.finfo(torch.float32).eps / 2
    for name, g, w, p in zip(_NAMES, got, want, plain, strict=True):  # with a bias
        assert g.dtype == torch.float32, name
        w = w.masked_fill(w.isinf(), 0.0)
        error, plain_error = ((t.double() - w).abs().max() for t in (g, p))
        assert error <= 2 * plain_error + u * w.abs().max(), (name, error, plain_error)


@triton.jit
def _tanh_kernel(X, Y, n, BLOCK: tl.constexpr):
    """Y = the kernels' tanh of X, elementwise over n entries."""
    at = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Y + at, kernels._tanh(tl.load(X + at, mask=at < n)), mask=at < n)


def test_tanh_is_accurate_to_the_dtype_near_zero_too():
    # the kernels' own tanh (the interpreter has no tl.tanh): relative error within 2 eps
    grid = torch.cat(
        [torch.logspace(-30, 3, 4000, dtype=torch.float64), torch.linspace(0, 3, 4001)]
    )
    for dtype in (torch.float32, torch.float64):
        x = torch.cat([grid, -grid]).to(dtype)
        y = torch.empty_like(x)
        _tanh_kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024)
        want = torch.tanh(x.double())
        relative = (y.double() - want).abs() / want.abs().clamp_min(1e-300)
        assert relative.max() <= 2 * torch.finfo(dtype).eps, dtype


def test_dropout_mask_is_keep_mask_bit_for_bit():
    # v = identity (Nk = dv): O = P * Z / (1 - p) itself, so O's zeros are Z's
    p, (b, hq, nq, nk) = 0.3, (2, 4, 21, 32)
    q, k = (
        torch.randn(b, hq, nq, 16, dtype=torch.float64),
        torch.randn(b, 2, nk, 16, dtype=torch.float64),
    )
    v = torch.eye(nk, dtype=torch.float64).expand(b, 2, nk, nk)
    out = attngrad.attention(
        q, k, v, dropout_p=p, enable_gqa=True, strategy="triton", block_q=16, block_k=16,
        generator=_generator(),
    )  # fmt: skip
    z = keep_mask(_dropout(p), b, hq, nq, nk, CPU)
    assert torch.equal(out != 0, z)
    torch.testing.assert_close(out, _reference(q, k, v, dropout=_dropout(p))[0])


def test_dropout_with_softcap_bias_band_gqa_and_lse():
    tensors = _inputs(1, 4, 2, 25, 34, 16, bias_shape=(4, 25, 34))
    _assert_close(*_runs(tensors, softcap=3.0, dropout_p=0.3, window=(9, 0), align="bottom-right"))


def test_dropout_of_one_gives_zeros():
    # O = 0 and dV = 0; lse is the undropped P's, and dq, dk come from its cotangent alone
    tensors = _inputs(1, 2, 2, 20, 20, 16)
    got, want, _ = _runs(tensors, dropout_p=1.0, is_causal=True)
    assert got[0].eq(0).all() and got[4].eq(0).all() and got[1].isfinite().all()
    _assert_close(got, want)


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


def _recorded(dtype=torch.float32, nq=20, nk=5, d=16, arch=90, **tiles):
    """{kernel name: recorded launch} of one forward and backward, as chosen for sm_<arch>."""
    q = torch.randn(1, 2, nq, d, dtype=dtype)
    k = v = torch.randn(1, 2, nk, d, dtype=dtype)
    mods = attngrad.core.scores.ScoreMods.none(2, nq, nk)
    triton = triton_strategy.strategy
    blocks = triton.tiles(Shapes.of(q, k, v), dtype, tiles.get("bq"), tiles.get("bk"))
    problem = Problem(q, k, v, mods, 0.25, blocks)
    with triton_strategy.dry_run(arch) as launches:
        o, saved = triton.forward(problem)
        grads = (torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), None)
        triton.backward_into(Backward(problem, saved, o, None, grads))
    return {launch.kernel.__name__: launch for launch in launches}


def _blocks(launch):
    return launch.args["BLOCK_M"], launch.args["BLOCK_N"]


def test_default_blocks_fit_the_sequence():
    short = _recorded(nq=20, nk=5)
    for name in ("forward", "dkdv", "dq"):
        config = configs.choose(name, "fma32", 16, 90)
        # never past the sequences padded to powers of two >= 16: 32 rows, 16 keys
        want = (min(config.block_m, 32), min(config.block_n, 16))
        assert _blocks(short["attention_" + name]) == want
    long = _recorded(nq=4096, nk=4096, bq=64)
    # a given block_q sets every kernel's rows; the keys stay the table's
    config = configs.choose("dq", "fma32", 16, 90)
    assert _blocks(long["attention_dq"]) == (64, config.block_n)
    assert long["attention_dq"].args["num_warps"] == config.num_warps


def test_dry_run_records_every_launch_repeatable_without_running():
    launches = _recorded(nq=300, nk=200)
    assert list(launches) == [
        "attention_forward",
        "attention_delta",
        "attention_dkdv",
        "attention_dq",
    ]
    fwd = launches["attention_forward"]
    assert fwd.grid == (2, -(-300 // fwd.args["BLOCK_M"]))
    assert fwd.args["PRECISION"] == "ieee"


def test_tf32_follows_pytorchs_matmul_flag_for_float32_only():
    matmul = torch.backends.cuda.matmul
    before = matmul.fp32_precision
    try:
        for setting, want in (("tf32", "tf32"), ("ieee", "ieee")):
            matmul.fp32_precision = setting
            assert triton_strategy.tf32_enabled() == (want == "tf32")
            assert _recorded(nq=64, nk=64)["attention_dq"].args["PRECISION"] == want
            # the other dtypes' dots never change precision
            assert (
                _recorded(torch.float16, nq=64, nk=64)["attention_dq"].args["PRECISION"] == "ieee"
            )
    finally:
        matmul.fp32_precision = before
    assert not triton_strategy.tf32_enabled()  # off by default, as in PyTorch


def test_auto_picks_triton_on_cuda_only():
    shapes = Shapes((1,), 8, 8, 256, 256, 64, 64)
    assert resolve("auto", shapes, False, device=torch.device("cuda")) == "triton"
    # head dims past the kernels' 256 stay on the tensor-op strategies, even on CUDA
    wide = Shapes((1,), 8, 8, 256, 256, 300, 300)
    assert resolve("auto", wide, False, device=torch.device("cuda")) == "explicit"
    assert resolve("auto", shapes, False, device=CPU) != "triton"
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


# What the strategy and the commands say without the interpreter, from one child process with
# TRITON_INTERPRET=0 (Triton reads it when the kernels are first imported): attention's error
# on CPU tensors, then each command's exit status, its stderr apart.
_UNINTERPRETED = """
import contextlib, io, json, torch, attngrad
from attngrad import cli
q = torch.randn(1, 1, 4, 16)
try:
    attngrad.attention(q, q, q, strategy="triton")
    error = ""
except RuntimeError as e:
    error = str(e)
commands = []
for argv in (["check", "--strategy", "triton"], ["explain", "--strategy", "triton"],
             ["bench", "--strategy", "triton", "--seq", "16"],
             ["ledger", "--strategy", "triton", "--seq-q", "16"]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        commands.append((argv[0], cli.main(argv), err.getvalue()))
print(json.dumps({"error": error, "commands": commands}))
"""


@pytest.fixture(scope="module")
def uninterpreted() -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    out = subprocess.run(
        [sys.executable, "-c", _UNINTERPRETED], env=env, capture_output=True, text=True,
        check=True,
    )  # fmt: skip
    assert "Traceback" not in out.stderr, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


def test_cpu_tensors_without_the_interpreter_are_refused(uninterpreted):
    assert "CUDA" in uninterpreted["error"] and "TRITON_INTERPRET=1" in uninterpreted["error"]


def test_commands_refuse_triton_cleanly_where_it_cannot_run(uninterpreted):
    commands = uninterpreted["commands"]
    assert [(name, status) for name, status, _ in commands] == [
        ("check", 2), ("explain", 2), ("bench", 2), ("ledger", 2),
    ]  # fmt: skip
    for name, _, err in commands:
        assert err.count("TRITON_INTERPRET=1") == 1, (name, err)
        assert "Traceback" not in err, (name, err)


def test_ledger_leaves_out_the_interpreters_peak():
    layout = Case(Shapes((1,), 2, 2, 16, 16, 16, 16), torch.float32)
    row = ledger_row("triton", layout)
    assert row.peak is None and row.peak_beyond_io is None


def test_dots_over_the_head_dim_in_slices_equal_whole_ones(monkeypatch):
    # on a GPU, FMA dots (float32, float64) and some wide tensor-core ones take the head dim in
    # slices read again from memory (kernels._dot_rows); the interpreter runs whole dots, in
    # one numpy sum per entry (REPEATABLE), so force slices of 16 through tl.dot here: d = 40 and dv = 72
    # pad to 64 and 128, 4 and 8 slices
    c = case((1,), 4, 2, 37, 29, 40, 72, "float", (4, 37, 29), window=(None, 0))
    inputs = make_inputs(c)
    whole = outputs_and_grads(_triton(), c, inputs, c.dtype)
    sliced = {
        name: dataclasses.replace(config, chunk=16)
        for name, config in triton_strategy._INTERPRETER.items()
    }
    monkeypatch.setattr(triton_strategy, "_INTERPRETER", sliced)
    dots = triton_strategy._dots
    monkeypatch.setattr(triton_strategy, "_dots", lambda *a: {**dots(*a), "REPEATABLE": False})
    chunks, launch = [], triton_strategy._launch

    def spy(kernel, grid, **args):
        chunks.append(args.get("CHUNK"))
        launch(kernel, grid, **args)

    monkeypatch.setattr(triton_strategy, "_launch", spy)
    got = outputs_and_grads(_triton(), c, inputs, c.dtype)
    assert chunks.count(16) == 4  # forward, Delta, dK/dV and dQ really ran in slices
    for name, want in whole.items():
        torch.testing.assert_close(got[name], want, rtol=1e-12, atol=1e-13, msg=name)


@triton.jit
def _round_trip(X, Narrow, Wide, n, BLOCK: tl.constexpr, UPCAST: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    y = kernels._narrow(tl.load(X + offs, mask=offs < n), tl.bfloat16, UPCAST)
    tl.store(Narrow + offs, y, mask=offs < n)
    tl.store(Wide + offs, kernels._widen(y, tl.float32, UPCAST), mask=offs < n)


@pytest.mark.parametrize("upcast", [True, False], ids=["by-hand", "interpreter"])
def test_bfloat16_conversions_round_to_nearest_even_as_on_the_gpu(upcast):
    # regression: the interpreter drops float32's low 16 bits (toward zero, a whole unit
    # off) and garbles subnormals; the kernels' conversions (UPCAST: bfloat16 in the
    # interpreter) must give torch's round-to-nearest-even bits, as the GPU does
    tiny = torch.finfo(torch.float32).tiny
    x = torch.tensor(
        [1 + 2**-8 + 2**-12, 1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-7 - 2**-16), 3.3e38, 3.4e38,
         tiny / 3, -tiny / 7, tiny * (1 - 2**-9), 1e-45, 0.0, -0.0, math.inf, -math.inf],
    )  # fmt: skip
    x = torch.cat([x, torch.randn(50) * 10.0 ** torch.randint(-40, 38, (50,))])
    narrow, wide = torch.empty(len(x), dtype=torch.bfloat16), torch.empty(len(x))
    _round_trip[(1,)](x, narrow, wide, len(x), BLOCK=128, UPCAST=upcast)
    want = x.to(torch.bfloat16)
    same = narrow.view(torch.int16) == want.view(torch.int16)
    if upcast:
        assert same.all(), (x[~same], narrow[~same], want[~same])
        assert torch.equal(wide, want.float())
        nan = torch.full((1,), math.nan)
        _round_trip[(1,)](nan, narrow[:1], wide[:1], 1, BLOCK=16, UPCAST=True)
        assert narrow[:1].isnan().all() and wide[:1].isnan().all()
    else:  # the interpreter alone: what the by-hand rounding is there for
        assert not same.all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("tiles", [{}, {"block_q": 16, "block_k": 16}], ids=["own", "16x16"])
def test_backward_rebuilds_the_scores_forward_formed_bit_for_bit(dtype, tiles):
    # the invariant (`helpers.assert_scores_rebuilt_bit_for_bit`): the dK/dV kernel (which
    # forms k q^T, keys along rows) and the dQ kernel form each score tile with the bits
    # forward formed it with, in their own tile shapes.  Scores one unit off failed it (the
    # interpreter's BLAS under OPENBLAS_CORETYPE=Haswell); tests/verify/test_property.py
    # plants a dK/dV kernel that forms k q^T through the BLAS
    assert_scores_rebuilt_bit_for_bit("triton", dtype, CPU, tiles)


def test_each_triton_takes_the_newest_table_not_newer_than_itself():
    oldest, newest = min(configs.TABLES), max(configs.TABLES)
    assert configs.table_for(oldest) is configs.TABLES[oldest]
    assert configs.table_for((oldest[0], oldest[1] - 1)) is configs.TABLES[oldest]
    assert configs.table_for((newest[0], newest[1] + 5)) is configs.TABLES[newest]
    assert configs.table_for((99, 0)) is configs.TABLES[newest]
    assert configs.release("3.6.0") == (3, 6) and configs.release("2.4.0rc1") == (2, 4)
    assert configs.release("4") == (4, 0)
    # every table holds every slot: a Triton's table is the newest one's, its changes over it
    for light, heavy in configs.TABLES.values():
        assert light.keys() == heavy.keys() == configs.TABLES[newest][0].keys()
    tiles = configs.choose("forward", "mma16", 64, 90, version=oldest)
    assert tiles == configs.TABLES[oldest][0][90, "mma16", 64, "forward"]


def test_the_oldest_triton_is_the_same_in_the_tables_the_extra_and_ci():
    root = Path(__file__).resolve().parents[2]
    extra = re.search(r'gpu = \["triton>=([\d.]+)"\]', (root / "pyproject.toml").read_text())
    make = re.search(r"TRITON_OLDEST := ([\d.]+)", (root / "Makefile").read_text())
    assert extra is not None and make is not None
    oldest = min(configs.TABLES)
    assert configs.release(extra[1]) == oldest == configs.release(make[1])


def test_the_oldest_tritons_interpreter_with_numpy_2_4_is_refused_by_name(monkeypatch):
    # Triton 3.6's interpreter converts one-element arrays with int(), which numpy 2.4 refuses:
    # every kernel would stop with "only 0-dimensional arrays can be converted"
    monkeypatch.setattr(configs, "triton_version", lambda: (3, 6))
    versions = {"numpy": "2.4.1"}
    monkeypatch.setattr(triton_strategy.importlib.metadata, "version", versions.__getitem__)
    reason = unavailable_reason("triton", CPU)
    assert reason is not None and "numpy < 2.4" in reason and "Triton 3.6" in reason
    versions["numpy"] = "2.3.5"
    assert unavailable_reason("triton", CPU) is None


def test_what_the_oldest_triton_cannot_compile_is_refused_by_name(monkeypatch):
    # Triton 3.6 stops compiling float64 dots beside a bool mask's loads (sm_80 and sm_90: the
    # compile report under it: "fp64 don't support largeK MMA"); the call says what to do
    c = case((1,), 2, 2, 20, 20, 16, 16, "bool", dtype=torch.float64)
    inputs = make_inputs(c)
    monkeypatch.setattr(configs, "triton_version", lambda: (3, 6))
    monkeypatch.setattr(triton_strategy, "_interpreter_reason", lambda: None)  # numpy 2.4
    monkeypatch.setattr(triton_strategy, "_arch", lambda device: 80)
    with pytest.raises(RuntimeError, match=r"float64 with a bool mask for sm_80 under Triton 3\.6"):
        outputs_and_grads(_triton(), c, inputs, c.dtype)
    with triton_strategy.dry_run(80) as launches:  # a dry run still records the launches
        outputs_and_grads(_triton(), c, inputs, c.dtype)
    assert launches
    # the compile report leaves them out of its grid under 3.6, and only them
    assert configs.compiles(float64=True, keep_mask=False, version=(3, 6))
    assert configs.compiles(float64=True, keep_mask=True, version=(3, 7))
    variants = kernel_report.grid()
    assert variants and not any(
        v.dtype == "float64" and v.mask in ("bool", "masks", "all") for v in variants
    )
    assert any(v.dtype == "float64" for v in variants)


# -- the interpreter without its dead work (attngrad.strategies.triton.interpreter) ---------


def test_the_kernels_run_in_an_interpreter_without_its_dead_work():
    from triton.runtime import interpreter as triton_interpreter

    # installed when the kernels' module found itself interpreted; installing again is a no-op
    assert kernels.INTERPRETED
    patched = triton_interpreter._patch_lang
    assert getattr(patched, "_once_per_launch", False)
    assert not triton_interpreter.interpreter_builder.options.sanitize_overflow
    assert not triton_interpreter.interpreter_builder.options.debug
    assert interpreter.install() == {"patch_once_per_launch": True, "skip_unchecked_overflow": True}
    assert triton_interpreter._patch_lang is patched


def test_an_interpreter_unlike_the_one_it_knows_is_left_as_it_is(monkeypatch):
    # no launch class to hook: no patch of _patch_lang
    bare = SimpleNamespace(_patch_lang=lambda fn: None)
    assert not interpreter._patch_once_per_launch(bare, tl)
    # options without the fields, or with debug on (device_assert then checks): untouched
    options = SimpleNamespace(debug=False, sanitize_overflow=True)
    assert not interpreter._skip_unchecked_overflow(SimpleNamespace())
    assert not interpreter._skip_unchecked_overflow(
        SimpleNamespace(interpreter_builder=SimpleNamespace(options=options))
    )
    debug = _Options(debug=True)
    builder = SimpleNamespace(options=debug)
    assert not interpreter._skip_unchecked_overflow(SimpleNamespace(interpreter_builder=builder))
    assert builder.options is debug
    # a device_assert that checks whatever the debug flag: the overflow checks stay on
    from triton.language.semantic import TritonSemantic

    def device_assert(self, cond, msg, mask):
        return self.make_tensor(self.builder.create_assert(cond.handle, msg), tl.void)

    builder = SimpleNamespace(options=_Options())
    monkeypatch.setattr(TritonSemantic, "device_assert", device_assert)
    assert not interpreter._skip_unchecked_overflow(SimpleNamespace(interpreter_builder=builder))
    assert builder.options.sanitize_overflow
    monkeypatch.undo()
    assert interpreter._skip_unchecked_overflow(SimpleNamespace(interpreter_builder=builder))
    assert not builder.options.sanitize_overflow and builder.options == _Options(False, False)


@dataclasses.dataclass(frozen=True)
class _Options:
    """The two fields of Triton's InterpreterOptions that `interpreter` reads."""

    debug: bool = False
    sanitize_overflow: bool = True
