"""Strategy "fused": its C++ kernels' own promises beyond the shared grids.

The conformance grid, gradcheck, the edge inputs and the property tests run
"fused" with every other strategy (it is in `helpers.TENSOR_STRATEGIES`); here:
results bitwise identical for any thread count (the backward's slabs included),
the dropout mask bit for bit, each engine of the tile products, accuracy
against flash's on edge inputs, the ops' own argument checks, the fake kernels
under torch.compile, the build cache and `attngrad build`, and the fallback
where the kernels cannot be built.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from contextlib import contextmanager

import pytest
import torch

import attngrad
from attngrad.cli.app import main
from attngrad.core.contract import Shapes
from attngrad.core.dropout import Dropout, draw_seed, keep_mask
from attngrad.strategies import resolve
from attngrad.strategies.fused import build
from attngrad.tools.memory import measure_saved_bytes
from attngrad.verify.cases import Case, make_inputs, outputs_and_grads
from attngrad.verify.check import strategy_fn
from attngrad.verify.rule import judge
from helpers import StrictRule, assert_rule, case


@contextmanager
def threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _run(shape, seed: int = 0, **kw):
    """O, lse and the gradients of q, k, v and a float mask, for [B, Hq, Hkv, Nq, Nk, d]."""
    b, hq, hkv, nq, nk, d = shape
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, nq, d, generator=g, requires_grad=True)
    k = torch.randn(b, hkv, nk, d, generator=g, requires_grad=True)
    v = torch.randn(b, hkv, nk, d, generator=g, requires_grad=True)
    bias = torch.randn(b, hq, nq, nk, generator=g, requires_grad=True)
    torch.manual_seed(seed)  # dropout's seed
    out, lse = attngrad.attention(
        q, k, v, attn_mask=bias, strategy="fused", enable_gqa=hq != hkv, return_lse=True, **kw
    )
    grads = torch.autograd.grad((out.square().sum(), lse.sum()), (q, k, v, bias))
    return (out, lse, *grads)


@pytest.mark.parametrize(
    "shape",
    [(1, 1, 1, 300, 280, 64), (1, 3, 3, 200, 200, 32), (2, 4, 2, 130, 150, 64)],
    ids=["B1H1", "B1H3", "B2H4:2"],
)
@pytest.mark.parametrize(
    "kw",
    [{}, {"window": (None, 0)}, {"dropout_p": 0.3, "softcap": 5.0, "block_q": 48}],
    ids=["plain", "causal", "dropout-softcap"],
)
def test_bitwise_identical_for_any_thread_count(shape, kw):
    # 40-key blocks: the backward's units split each kv head's keys into slabs where B * Hkv
    # is small (4 for B1H1, 3 for B1H3, 2 for B2H4:2), each summing its own dQ; the bits
    # must not move
    kw = {"block_k": 40, **kw}
    with threads(1):
        one = _run(shape, **kw)
    with threads(2):
        two = _run(shape, **kw)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv", "dbias"), one, two, strict=True):
        assert torch.equal(a, b), name
        assert torch.isfinite(a).all(), name


@pytest.mark.parametrize("p", [0.2, 0.75])
def test_dropout_mask_is_the_hash_bit_for_bit(p):
    # q = 0 makes every row's P uniform (1 / Nk) and v = I makes O the mask itself:
    # O[i, j] = Z[i, j] / (Nk (1 - p)); dV = (P Z)^T dO / (1 - p) shows it again
    b, h, n = 2, 3, 40
    q = torch.zeros(b, h, n, 8, dtype=torch.float64, requires_grad=True)
    k = torch.zeros(b, h, n, 8, dtype=torch.float64)
    v = torch.eye(n, dtype=torch.float64).expand(b, h, n, n).clone().requires_grad_(True)
    torch.manual_seed(3)
    drop = Dropout(p, *draw_seed(torch.device("cpu"), None))
    expected = keep_mask(drop, b, h, n, n, torch.device("cpu")).to(torch.float64)
    for strategy in ("fused", "flash"):
        torch.manual_seed(3)
        out = attngrad.attention(q, k, v, dropout_p=p, strategy=strategy, block_q=16, block_k=8)
        assert torch.equal(out != 0, expected != 0), strategy
        (dv,) = torch.autograd.grad(out, v, torch.eye(n, dtype=torch.float64).expand(b, h, n, n))
        assert torch.equal(dv.transpose(-2, -1) != 0, expected != 0), strategy


def _use_engine(engine: str, monkeypatch) -> None:
    """Calls run the tile products through ``engine`` until the test ends."""
    library = build.load()
    monkeypatch.setattr(
        build, "_loaded", build.Library(library.path, engine, library.rates, library.peak)
    )


@pytest.mark.parametrize("engine", build.ENGINES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_every_engine_of_the_tile_products(engine, dtype, monkeypatch):
    _use_engine(engine, monkeypatch)
    c = case((1,), 4, 2, 97, 130, 40, 24, "float", dtype=dtype, window=(None, 3))
    inputs = make_inputs(c)
    for tiles in ((None, None), (7, 5)):
        fn = strategy_fn("fused", block_q=tiles[0], block_k=tiles[1])
        assert_rule(c, inputs, outputs_and_grads(fn, c, inputs, c.dtype))


@pytest.mark.parametrize("engine", build.ENGINES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_every_engine_recomputes_the_scores_bit_for_bit(engine, dtype, monkeypatch):
    """One key per row: P is exactly 1 when backward's scores are forward's, so dv = P^T dO is
    the two rows' dO added, bit for bit; scores other by one rounding (a BLAS that sums in
    another order for backward's tile, MKL's dgemm under the aten engine) make P = exp(+-u|S|)
    and miss it in most draws."""
    _use_engine(engine, monkeypatch)
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        q = (10 * torch.randn(1, 2, 2, 9, generator=gen)).to(dtype)
        k = (10 * torch.randn(1, 2, 1, 9, generator=gen)).to(dtype)
        v = torch.randn(1, 2, 1, 1, generator=gen).to(dtype).requires_grad_()
        dout = torch.randn(1, 2, 2, 1, generator=gen).to(dtype)
        out = attngrad.attention(q, k, v, strategy="fused")
        (dv,) = torch.autograd.grad(out, v, dout)
        assert torch.equal(dv, dout.sum(-2, keepdim=True))


def test_fake_kernels_trace_under_torch_compile():
    q, k, v = (torch.randn(1, 2, 50, 16) for _ in range(3))
    args = (None,) * 6

    def forward(q, k, v):
        o, stats = torch.ops.attngrad_fused.forward(q, k, v, *args, 0.25, 0.0, 0, 1.0, 16, 16, 1)
        return o * 2, stats

    build.load()
    compiled = torch.compile(forward, fullgraph=True, backend="aot_eager")
    got, want = compiled(q, k, v), forward(q, k, v)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fq, fk, fv = (mode.from_tensor(t) for t in (q, k, v))
        o, stats = torch.ops.attngrad_fused.forward(fq, fk, fv, *args, 0.25, 0.0, 0, 1.0, 16, 16, 1)
        assert o.shape == (1, 2, 50, 16) and stats.shape == (1, 2, 50, 2)


def test_library_lives_in_the_cache_dir_per_torch_and_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNGRAD_CACHE_DIR", str(tmp_path))
    directory = build.library_dir()
    assert directory.parent == tmp_path / "fused"
    assert torch.__version__.split("+")[0] in directory.name
    assert build.capability() in directory.name


def test_a_build_removes_only_other_builds_unused_for_a_week(tmp_path, monkeypatch):
    """Two checkouts of different sources on one machine keep their builds while in use."""
    monkeypatch.setenv("ATTNGRAD_CACHE_DIR", str(tmp_path))
    directory = build.library_dir()
    stem = directory.name.rsplit("-", 1)[0]
    recent, old, other_torch = (
        directory.parent / name for name in (f"{stem}-aaaa", f"{stem}-bbbb", "torch0.0-x-cccc")
    )
    for d in (directory, recent, old, other_torch):
        d.mkdir(parents=True)
    week_ago = time.time() - build.UNUSED_SECONDS - 60
    for d in (old, other_torch):
        os.utime(d, (week_ago, week_ago))
    build._prune(directory)
    assert directory.exists() and recent.exists() and other_torch.exists()
    assert not old.exists()
    os.utime(recent, (week_ago, week_ago))
    build._mark_used(recent)  # a process loads it: kept a week more
    build._prune(directory)
    assert recent.exists()


def test_build_command_prints_where_the_library_went(capsys):
    assert main(["build", "--json", "-"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["library"] == str(build.load().path)
    assert os.path.exists(report["library"])
    assert report["engine"] in build.ENGINES
    assert set(report["rates_gflops"]) <= set(build.ENGINES)
    assert report["fma_peak_gflops"] > 0


def test_build_says_busy_where_an_engine_beat_the_peak(capsys, monkeypatch):
    # a peak probed while another process held the core: below what the products reached
    library = build.load()
    low = dataclasses.replace(library, peak=0.5 * max(library.rates.values()))
    monkeypatch.setattr(build, "load", lambda: low)
    assert main(["build"]) == 0
    out = capsys.readouterr().out
    assert "the machine was busy while the peak was probed" in out and "%" not in out


def test_the_engine_is_the_fastest_attention_and_a_tie_goes_to_the_faster_products():
    rates = {"brgemm": 115.0, "micro": 108.0, "aten": 97.0}
    clear = {"brgemm": 0.150, "micro": 0.140, "aten": 0.170}  # micro 7% ahead: it wins
    assert build._fastest(clear, rates) == "micro"
    tied = {"brgemm": 0.1451, "micro": 0.1446, "aten": 0.170}  # 0.3% apart: the rate decides
    assert build._fastest(tied, rates) == "brgemm"
    assert build._fastest({"micro": 0.1, "aten": 0.1}, {"micro": 90.0, "aten": 97.0}) == "aten"


def test_one_process_measures_the_engines_while_the_others_wait_for_its_record(
    tmp_path, monkeypatch
):
    """Two loads at once on a new build (two ranks of a job): the second waits on the lock
    and reads the first one's record instead of measuring beside it."""
    measuring = threading.Event()
    calls = []

    def measure(directory):
        calls.append(directory)
        measuring.set()
        time.sleep(0.3)  # the other load arrives meanwhile
        return {"micro": 100.0, "aten": 90.0}, {"micro": 0.1, "aten": 0.2}

    monkeypatch.setattr(build, "_measure", measure)
    monkeypatch.setattr(build, "fma_peak", lambda: 110.0)
    monkeypatch.delenv("ATTNGRAD_FUSED_ENGINE", raising=False)
    found = []
    first = threading.Thread(target=lambda: found.append(build._engine(tmp_path)))
    first.start()
    assert measuring.wait(10)
    found.append(build._engine(tmp_path))  # blocks until the first one's record is written
    first.join()
    assert len(calls) == 1
    assert found == [("micro", {"micro": 100.0, "aten": 90.0}, 110.0)] * 2


def test_the_fma_peak_bounds_the_tile_products():
    """The peak is a limit: no engine's products run faster on one thread (15% for the noise
    between two measurements), and a probe that counted wrong would break that."""
    library = build.load()
    fresh = build.fma_peak(seconds=0.02)
    assert 0.5 * library.peak < fresh < 2 * library.peak
    assert max(library.rates.values()) <= 1.15 * max(library.peak, fresh)


def test_auto_takes_fused_on_cpu_from_its_threshold():
    shapes = Shapes(
        lead=(1,), heads_q=8, heads_kv=8, seq_q=1024, seq_k=1024, head_dim=64, value_dim=64
    )
    assert resolve("auto", shapes, False, False, torch.device("cpu")) == "fused"
    assert resolve("auto", shapes, True, False, torch.device("cpu")) == "fused"


_NO_COMPILER = textwrap.dedent(
    """
    import warnings, torch, attngrad
    from attngrad.strategies import resolve
    from attngrad.core.contract import Shapes
    q, k, v = (torch.randn(1, 2, 300, 16) for _ in range(3))
    try:
        attngrad.attention(q, k, v, strategy="fused")
    except RuntimeError as e:
        print("ERROR", e)
    shapes = Shapes.of(q, k, v)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        picks = [resolve("auto", shapes, True, False, q.device) for _ in range(3)]
        out = attngrad.attention(q, k, v, block_q=64)
    print("PICKS", picks, "WARNINGS", len(caught), caught[0].message if caught else "")
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    print("CLOSE", torch.allclose(out, ref, atol=1e-5))
    """
)


def test_without_a_compiler_fused_says_what_to_install_and_auto_takes_flash(tmp_path):
    env = {**os.environ, "ATTNGRAD_CACHE_DIR": str(tmp_path), "CXX": str(tmp_path / "no-such-c++")}
    done = subprocess.run(
        [sys.executable, "-c", _NO_COMPILER], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    lines = {line.split()[0]: line for line in done.stdout.splitlines()}
    assert "no C++ compiler" in lines["ERROR"] and "install" in lines["ERROR"]
    assert "['flash', 'flash', 'flash']" in lines["PICKS"]
    assert "WARNINGS 1 " in lines["PICKS"] and "no C++ compiler" in lines["PICKS"]
    assert lines["CLOSE"] == "CLOSE True"
    assert not list((tmp_path / "fused").glob("*/*.so"))


# In a fresh cache, with a C++ compiler that fails: what builds, what says so, and why
_FIRST_BUILD = textwrap.dedent(
    """
    import torch
    import attngrad
    from attngrad.strategies.fused import build
    from attngrad.verify.cases import flex_cases, make_inputs
    from attngrad.verify.check import refusal

    from attngrad.tools.bench_step import auto_choice

    case = flex_cases()[0]
    print("REFUSAL", refusal("flash", case, make_inputs(case)), flush=True)
    print("AUTO", auto_choice(1, 2, 16, 8, False), flush=True)  # bench's "auto picks" column
    print("TRIED", build._failure is not None or build._loaded is not None, flush=True)
    q = torch.randn(1, 2, 16, 8)
    attngrad.attention(q, q, q)  # "auto": wants fused, tries to build it, falls back
    print("TRIED", build._failure is not None, flush=True)
    """
)


def test_a_first_build_says_why_now_and_how_long_and_no_command_builds_what_it_skips(tmp_path):
    # a flash-only check asks which strategies refuse a flex case, bench which strategy auto
    # picks: no build for either; a first "auto" call does build, and says that auto wants the kernels and how long it takes
    env = {**os.environ, "ATTNGRAD_CACHE_DIR": str(tmp_path), "CXX": "false"}
    done = subprocess.run(
        [sys.executable, "-c", _FIRST_BUILD], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["REFUSAL None", "AUTO fused", "TRIED False", "TRIED True"]
    (said,) = [line for line in done.stderr.splitlines() if "compiling" in line]
    assert "strategy 'auto' takes fused's C++ kernels for CPU tensors" in said
    assert "once per machine" in said and "30 to 60 s" in said and "attngrad build" in said


def _edge_case(kind: str):
    """(case, inputs) of the edge inputs where recomputing kernels lose digits."""
    if kind == "large-logits":  # |S| ~ 1e3 - 1e4 in float32
        case = Case(Shapes((2,), 2, 2, 50, 70, 16, 8), torch.float32, "causal")
        inputs = make_inputs(case)
        inputs["q"], inputs["k"] = inputs["q"] * 30, inputs["k"] * 30
    elif kind == "finfo-min-padding":  # a padding bias at finfo.min, some rows all padding
        case = Case(
            Shapes((2,), 2, 1, 40, 90, 16, 16), torch.float32, "float", mask_shape=(2, 1, 1, 90)
        )
        inputs = make_inputs(case)
        inputs["mask"][..., 60:] = torch.finfo(torch.float32).min
        inputs["mask"][1] = torch.finfo(torch.float32).min
    else:  # float16 inputs uniform in +-6e4
        case = Case(Shapes((1,), 2, 2, 30, 30, 16, 16), torch.float16, "none")
        inputs = make_inputs(case)
        g = torch.Generator().manual_seed(4)
        for name in ("q", "k", "v"):
            inputs[name] = (torch.rand(inputs[name].shape, generator=g) * 2 - 1) * 6e4
    return case, inputs


@pytest.mark.parametrize("kind", ["large-logits", "finfo-min-padding", "float16-near-max"])
@pytest.mark.parametrize("tiles", [None, (16, 16)], ids=["own-tiles", "16x16"])
def test_as_accurate_as_flash_on_edge_inputs(kind, tiles):
    # the rule with flash as the baseline: |fused - ref| <= max(2 max|flash - ref|, kept) + floor
    case, inputs = _edge_case(kind)
    blocks = {} if tiles is None else {"block_q": tiles[0], "block_k": tiles[1]}
    got = {
        s: outputs_and_grads(strategy_fn(s, **blocks), case, inputs, case.dtype)
        for s in ("fused", "flash")
    }
    rule = StrictRule.of(case, inputs)
    for name, fused in got["fused"].items():
        assert torch.isfinite(fused).all() or not torch.isfinite(rule.ref[name]).all(), name
        verdict = judge(
            name, fused, rule.ref[name], rule.floor[name], got["flash"][name], rule.kept[name]
        )
        assert verdict.passed, str(verdict)


# ATen's polynomial exp forms 2^(n - 1) from the exponent bits and returns 0 below -125.5 ln 2,
# where e^x is still normal down to ln(FLT_MIN) = -87.34 (1.2e-38 .. 1.7e-38), subnormal past it
_BELOW_THE_POLYNOMIAL = (-87.0, -87.05, -87.1, -87.15, -87.2, -87.25, -87.3, -95.0)


@pytest.mark.parametrize("tiles", [None, (1, 3)], ids=["own-tiles", "1x3"])
def test_keeps_the_p_the_polynomial_exp_returns_as_zero(tiles):
    # key 0 holds the row's P = 1, every other key's score sits 87 to 95 below it: their dv and
    # dk are made of those P alone (a vector of them all in the polynomial's gap, too)
    c = case((), 1, 1, 1, 9, 1, 3, dtype=torch.float32)
    inputs = make_inputs(c)
    inputs["q"] = torch.ones(1, 1, 1, dtype=torch.float64)
    inputs["k"] = torch.tensor((0.0, *_BELOW_THE_POLYNOMIAL), dtype=torch.float64).reshape(1, 9, 1)
    blocks = {} if tiles is None else {"block_q": tiles[0], "block_k": tiles[1]}
    got = outputs_and_grads(strategy_fn("fused", **blocks), c, inputs, c.dtype)
    assert (got["dv"][0, 1:] != 0).all()
    assert_rule(c, inputs, got)


def test_saves_what_flash_saves_to_the_byte():
    q, k, v = (torch.randn(1, 4, 300, 32, requires_grad=True) for _ in range(3))
    saved = {
        s: measure_saved_bytes(lambda s=s: attngrad.attention(q, k, v, strategy=s))[0]
        for s in ("fused", "flash")
    }
    assert saved["fused"] == saved["flash"] > 0


def test_block_sizes_beyond_the_sequence_are_the_sequence():
    q, k, v = (torch.randn(1, 2, 10, 8, dtype=torch.float64) for _ in range(3))
    out = attngrad.attention(q, k, v, strategy="fused", block_q=1 << 20, block_k=1 << 20)
    torch.testing.assert_close(out, attngrad.attention(q, k, v, strategy="flash"))


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"block_k": 0}, ValueError, "block_q and block_k must be >= 1"),
        ({"k": torch.randn(1, 3, 10, 8)}, ValueError, "multiple of"),
        ({"q": torch.randn(1, 2, 10, 8, dtype=torch.float16)}, TypeError, "float32 or float64"),
        ({"engine": 7}, ValueError, "engine must be"),
    ],
    ids=["block-0", "heads", "dtype", "engine"],
)
def test_the_raw_ops_name_a_bad_argument(change, error, match):
    build.load()
    args = {"q": torch.randn(1, 2, 10, 8), "k": torch.randn(1, 2, 10, 8), "block_k": 16}
    args.update(change)
    v = torch.randn(*args["k"].shape)
    with pytest.raises(error, match=match):
        torch.ops.attngrad_fused.forward(
            args["q"], args["k"], v, *(None,) * 6, 0.3, 0.0, 0, 1.0, 16, args["block_k"],
            args.get("engine", 1),
        )  # fmt: skip


def test_an_unwritable_cache_or_a_stale_lock_is_a_build_error(tmp_path, monkeypatch):
    monkeypatch.setattr(build, "_loaded", None)
    monkeypatch.setattr(build, "_failure", None)
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    monkeypatch.setenv("ATTNGRAD_CACHE_DIR", str(blocked))
    with pytest.raises(build.BuildError, match="ATTNGRAD_CACHE_DIR at a writable folder"):
        build.load(quiet=True)
    monkeypatch.setattr(build, "_failure", None)
    monkeypatch.setenv("ATTNGRAD_CACHE_DIR", str(tmp_path / "cache"))
    lock = build.library_dir() / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    old = lock.stat().st_mtime - 2 * build.STALE_LOCK_SECONDS
    os.utime(lock, (old, old))
    with pytest.raises(build.BuildError, match="attngrad build --force"):
        build.load(quiet=True)
