"""Property test: random shapes, masks, windows, scales, dtypes and edge values hold the one rule.

Each example draws every SDPA-legal broadcast of a bool or float mask, a
sliding window with open sides (alone or with the mask), either alignment,
packed segments (empty ones too), a softcap, sinks per head or per token,
dropout, GQA layouts, a scale, a dtype, logits up to |S| ~ 1e4 and biases at the dtype's finfo.min,
at a huge positive value and at -1e9, sequences of up to 28 and the tiled strategies'
tiles (their own or small ones: `helpers.SMALL_TILES`, so several tiles merge), and judges
output and every gradient against the float64 reference with `attngrad.verify.rule`.  No
NaN, no tolerance of the test's own.  An example whose reference is zero throughout (every
row dead) must give exact zeros; where the rule's 2x term would pass zeros (the plain run
in a 16-bit dtype far off at large logits), the rule without it judges (`StrictRule`).
"""

from __future__ import annotations

import importlib.util
import inspect
import itertools
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from hypothesis import HealthCheck, Phase, event, example, given, settings
from hypothesis import strategies as st

import attngrad
import attngrad.strategies.triton as triton_package
from attngrad.core.contract import Shapes
from attngrad.verify.cases import (
    AttentionFn,
    Case,
    Inputs,
    call_sdpa,
    make_inputs,
    make_leaves,
    outputs_and_grads,
)
from attngrad.verify.rule import expect, judge_run
from helpers import (
    SMALL_TILES,
    SMALL_TILES_ONLY,
    StrictRule,
    assert_passed,
    attention_fn,
    blind_to_zeros,
)

DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
# the dtypes whose normal range holds every P and dS a strategy keeps in them for its products:
# the kept bound (`kept_bound`) is relative, u |P|, while a P below float16's smallest normal
# (6.1e-5) is off by up to u tiny absolute, so float16 is judged by the full rule only
KEPT_IN_RANGE = (torch.float64, torch.float32, torch.bfloat16)
EDGES = ("none", "finfo-min-row", "finfo-min-some", "huge-one", "minus-1e9")


@st.composite
def segments(draw: st.DrawFn, seq_q: int, seq_k: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Packed segments' lengths: the same number of query and key segments, empty ones too."""
    count = draw(st.integers(1, 3))

    def lengths(total: int) -> tuple[int, ...]:
        cuts = sorted(draw(st.lists(st.integers(0, total), min_size=count - 1, max_size=count - 1)))
        bounds = [0, *cuts, total]
        return tuple(b - a for a, b in itertools.pairwise(bounds))

    return lengths(seq_q), lengths(seq_k)


Tiles = dict[str, tuple[int, int] | None]
Example = tuple[Case, float, str, int, Tiles]
# sequence lengths: mostly short, a quarter of the draws past one 16-wide tile (two of them:
# Triton's interpreter pays per tile, and a third merges as the second does)
SEQ = st.one_of(st.integers(1, 12), st.integers(1, 12), st.integers(1, 12), st.integers(17, 28))


def tilings(strategy: str) -> list[tuple[int, int] | None]:
    """The tiles a tiled strategy draws from: its own (None, unless `SMALL_TILES_ONLY`) and small."""
    own: list[tuple[int, int] | None] = [] if strategy in SMALL_TILES_ONLY else [None]
    return own + list(SMALL_TILES[strategy])


@st.composite
def examples(draw: st.DrawFn, most: int = 3) -> Example:
    """(case, spread of q and k, edge values of a float mask, seed, each tiled strategy's tiles).

    ``most``: the largest lead dim, kv head count and group size (up to 81 (batch, head)
    pairs at 3; Triton's interpreter runs a program per pair and tile: 2, at most 16)."""
    lead = tuple(draw(st.lists(st.integers(1, most), min_size=0, max_size=2)))
    heads_kv, groups = draw(st.integers(1, most)), draw(st.integers(1, most))
    seq_q, seq_k = draw(SEQ), draw(SEQ)
    head_dim, value_dim = draw(st.integers(1, 9)), draw(st.integers(1, 9))
    shapes = Shapes(lead, heads_kv * groups, heads_kv, seq_q, seq_k, head_dim, value_dim)
    mask = draw(st.sampled_from(["none", "causal", "bool", "float"]))
    score = (*lead, heads_kv * groups, seq_q, seq_k)
    kept = draw(st.integers(0, len(score)))
    mask_shape = tuple(1 if draw(st.booleans()) else n for n in score[len(score) - kept :])
    side = st.one_of(st.none(), st.integers(0, 6))
    window = draw(st.one_of(st.none(), st.tuples(side, side)))
    dtype = draw(st.sampled_from(DTYPES))
    case = Case(
        shapes,
        dtype,
        mask,
        mask_shape if mask in ("bool", "float") else None,
        draw(st.one_of(st.none(), st.floats(0.05, 2.0))),
        window,
        # enable_gqa=True is also valid with equal head counts (groups == 1)
        groups > 1 or draw(st.booleans()),
        softcap=draw(st.one_of(st.none(), st.sampled_from([0.5, 5.0, 50.0]))),
        sinks=draw(st.sampled_from(["none", "none", "head", "token"])),
        align=draw(st.sampled_from(["top-left", "bottom-right"])),
        segments=draw(st.one_of(st.none(), segments(seq_q, seq_k))),
        dropout=draw(st.sampled_from([0.0, 0.0, 0.2, 0.6])),
    )
    # |S| up to spread^2 * sqrt(d) * a few: ~1e4 at spread 30 (16-bit: stay in range)
    spread = draw(st.sampled_from([1.0, 1.0, 10.0, 30.0] if dtype != torch.float16 else [1.0, 4.0]))
    edge = draw(st.sampled_from(EDGES)) if mask == "float" else "none"
    tiles = {s: draw(st.sampled_from(tilings(s))) for s in SMALL_TILES}
    return case, spread, edge, draw(st.integers(0, 2**32 - 1)), tiles


def _edge_values(mask: torch.Tensor, edge: str, dtype: torch.dtype, seed: int) -> None:
    """Fill some of a float mask with the edge values real models send (in place)."""
    info = torch.finfo(dtype)
    some = torch.rand(mask.shape, generator=torch.Generator().manual_seed(seed)) < 0.4
    if edge == "finfo-min-row" and mask.ndim >= 2:
        mask[..., 0, :] = info.min  # padding: every key of a row "masked" with a number
    elif edge == "finfo-min-some":
        mask[some] = info.min
    elif edge == "huge-one":
        mask.view(-1)[0] = info.max * 0.8
    elif edge == "minus-1e9":
        mask[some] = max(-1e9, info.min)


def _check(strategy: str, example: Example) -> None:
    case, spread, edge, seed, tiles = example
    inputs = make_inputs(case, seed)
    inputs["q"] = inputs["q"] * spread
    inputs["k"] = inputs["k"] * spread
    if edge != "none":
        _edge_values(inputs["mask"], edge, case.dtype, seed)
    about = f"{case.id} spread {spread} {edge} tiles {tiles.get(strategy)}: "
    _judge(attention_fn(strategy, tiles.get(strategy)), case, inputs, about)


def _judge(
    fn: AttentionFn, case: Case, inputs: Inputs, about: str, lse: AttentionFn | None = None
) -> None:
    """The rule on ``fn``'s out and gradients (and the lse of ``lse``, called with
    return_lse=True, if given), zeros pinned where the reference is zero throughout, and the
    rule without its 2x term where that term is blind to zeros.  Quantities whose reference
    is beyond the dtype's range (float16 near its max) are left out: no answer is right."""
    got = outputs_and_grads(fn, case, inputs, case.dtype)
    expected = expect(case, inputs)  # the reference, the plain run and the bounds, once
    ref = {n: r for n, r in expected.ref.items() if n != "lse"}
    beyond = {n for n, r in ref.items() if r.abs().max() >= torch.finfo(case.dtype).max}
    got = {n: g for n, g in got.items() if n not in beyond}
    for name, g in got.items():
        assert not g.isinf().any(), f"{about}{name} is infinite where its reference is not"
    if lse is not None:
        with torch.no_grad():
            got["lse"] = call_sdpa(lse, case, inputs, make_leaves(inputs, case.dtype))[1]
    assert_passed(judge_run(expected, got, names=set(got)), about)
    got.pop("lse", None)
    if not any(r.any() for r in ref.values()):
        # every row dead (or dropped): the rule's floor is zero but for underflow, so pin it
        event("reference zero throughout")
        assert all((g == 0).all() for g in got.values()), about + "not exactly zero"
        return
    blind = blind_to_zeros(case, inputs, got, expected)
    if blind and case.dtype in KEPT_IN_RANGE:
        event("judged without the 2x term: " + ", ".join(sorted(blind)))
        strict = StrictRule(expected.ref, expected.floors, expected.kept)
        assert_passed(strict.judge({n: got[n] for n in blind}), about)
    elif blind:
        event("float16, the rule blind to zeros: " + ", ".join(sorted(blind)))


# the autouse seed fixture runs once per test, not per example; harmless here
# because every example seeds its own generator
_SETTINGS = {"deadline": None, "suppress_health_check": [HealthCheck.function_scoped_fixture]}


# bfloat16 at spread 30: a dk formed by one P = exp(-54) whose score the inputs' rounding
# moves by ~6 (the floor's P sensitivity must keep the exponential: bounds._probability_move)
_TAIL = (
    Case(Shapes((), 3, 3, 7, 10, 4, 1), torch.bfloat16, "causal", None, None, None, False),
    30.0, "none", 11, {},
)  # fmt: skip


# float32, a -1e9 bias per query row swamping scores of ~1: the float32 scores of three rows
# round to the bias, their P to uniform, and the row's largest P falls by more than the rule's
# first-order move allowed (`bounds._probability_move` takes the fall as well as the rise)
_SWAMPED = (
    Case(Shapes((2,), 2, 2, 4, 5, 1, 3), torch.float32, "float", (4, 1)),
    1.0, "minus-1e9", 712, {},
)  # fmt: skip


# bfloat16 with dropout, a -1e9 bias on every score: the float32 scores round to the bias, P
# to uniform, and out moves by 8x its own size; its storage in bfloat16 rounds the moved value,
# not the reference's (the floor's u |x_ref| alone fell short by 0.13%: `rule.rounding_floor`)
_SWAMPED_DROPOUT = (
    Case(Shapes((), 2, 1, 17, 2, 2, 3), torch.bfloat16, "float", (1,), None, None, True,
         dropout=0.2),
    1.0, "minus-1e9", 249, {"triton": (16, 16)},
)  # fmt: skip


# float32 at spread 30: key 8's scores sit more than 87 below every row's max, so its P are
# subnormal (below FLT_MIN) and its dk is formed from them alone; an exp that flushes them to
# zero (ATen's polynomial exp does) gives dk = 0 against the reference's ~1e-36
_SUBNORMAL_P = (
    Case(Shapes((), 6, 3, 3, 17, 2, 3), torch.float32, "none", None, None, None, True),
    30.0, "none", 0, {"flash": None, "fused": None, "triton": (16, 16)},
)  # fmt: skip


# bfloat16 with dropout, spread 10: row 0's P = 1 is dropped and every key dropout keeps has
# P below 2^-125, so O, Delta = rowsum(dO o O) and dq (the dropped key's dS = -P Delta) are
# made of those P alone; fused's forward exp flushed them (ATen's polynomial): O = 0 and dq
# 4x past the rule, where the reference's is ~1e-39
_DROPPED_MAX = (
    Case(Shapes((), 1, 1, 19, 19, 9, 1), torch.bfloat16, "float", (), enable_gqa=False,
         dropout=0.6),
    10.0, "none", 81826, {"flash": None, "fused": None, "triton": (16, 16)},
)  # fmt: skip


# the same in float32, spread 30, scale 1.375, batched heads: row 0 of head (0, 1, 0)
_DROPPED_MAX_FLOAT32 = (
    Case(Shapes((2, 2), 2, 2, 5, 5, 4, 1), torch.float32, "none", None, 1.375,
         enable_gqa=False, dropout=0.6),
    30.0, "none", 31832, {"flash": None, "fused": None, "triton": (16, 16)},
)  # fmt: skip


# float32 with dropout, a -1e9 bias on query row 2: its scores round to the bias and P to
# uniform (key 0: 1/3 against the reference's 0.03), and key 0's dP is dropped, so its
# dS = -P' Delta' is Delta's move times P as moved; the bound took P for P' and every
# strategy's dk came out 3x past it (`bounds._sensitivity_path`)
_SWAMPED_DROPPED = (
    Case(Shapes((), 3, 3, 3, 3, 3, 2), torch.float32, "float", (3, 1), enable_gqa=False,
         dropout=0.6),
    1.0, "minus-1e9", 0, {"flash": None, "fused": None, "triton": (16, 16)},
)  # fmt: skip


@pytest.mark.parametrize("strategy", [s for s in attngrad.STRATEGIES if s != "triton"])
@settings(max_examples=120, **_SETTINGS)
@given(example=examples())
@example(example=_TAIL)
@example(example=_SUBNORMAL_P)
@example(example=_SWAMPED)
@example(example=_SWAMPED_DROPOUT)
@example(example=_DROPPED_MAX)
@example(example=_DROPPED_MAX_FLOAT32)
@example(example=_SWAMPED_DROPPED)
def test_every_example_holds_the_rule(strategy, example):
    _check(strategy, example)


def test_the_examples_do_not_move_with_the_modules_loaded(tmp_path, monkeypatch):
    # the examples a seed (or the repeatable profile) draws follow from it alone (conftest):
    # a module of literals loaded between two draws changes none of them
    def draws() -> list[str]:
        seen: list[str] = []

        @settings(max_examples=120, derandomize=True, phases=[Phase.generate], **_SETTINGS)
        @given(example=examples())
        def draw(example: Example) -> None:
            seen.append(repr(example))

        draw()
        return seen

    before = draws()
    path = tmp_path / "literals.py"
    path.write_text("VALUES = (3000000, 123456789, 0.3, 0.77, 1.7)\n")
    spec = importlib.util.spec_from_file_location("literals", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setitem(sys.modules, "literals", module)
    assert draws() == before


@pytest.mark.slow
@settings(max_examples=15, **_SETTINGS)
@given(example=examples(most=2))
def test_every_example_holds_the_rule_on_triton(example):
    # Triton's interpreter takes ~0.1-1 s a call: fewer examples, and fewer batch entries and
    # heads (every layout still drawn: lead dims, GQA, mask broadcasts; the edges have their
    # own property, test_edge_examples_hold_the_rule_on_triton)
    _check("triton", example)


# -- triton at the edges ---------------------------------------------------------------
# The inputs where a kernel that recomputes its scores must rebuild them bit for bit (large
# logits: rows whose P is one-hot, where a score one unit off moves P by |S| u), keep what it
# forms in range (float16 near its max), take padding at finfo.min, and every keyword at once.
EDGE_KINDS = ("large logits", "near max", "padding", "every keyword")
EdgeExample = tuple[str, Case, float, int, tuple[int, int] | None]


@st.composite
def edge_examples(draw: st.DrawFn, kinds: tuple[str, ...] = EDGE_KINDS) -> EdgeExample:
    """(kind, case, size, seed, triton's tiles): sequences past one 16-wide tile, head dims
    of real models; ``size``: q and k's spread (large logits), the inputs' largest magnitude
    (near max), the share of live keys (padding)."""
    kind = draw(st.sampled_from(kinds))
    heads_kv, groups = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    seq_q, seq_k = draw(st.integers(17, 40)), draw(st.integers(17, 40))
    head_dim, value_dim = draw(st.sampled_from([16, 40, 64])), draw(st.sampled_from([8, 40]))
    shapes = Shapes((1,), heads_kv * groups, heads_kv, seq_q, seq_k, head_dim, value_dim)
    gqa = {"enable_gqa": groups > 1}
    if kind == "large logits":
        dtype = draw(st.sampled_from([torch.float32, torch.float64]))
        case = Case(shapes, dtype, draw(st.sampled_from(["none", "causal", "bool"])), **gqa)
        size = draw(st.sampled_from([8.0, 30.0, 100.0]))
    elif kind == "near max":
        case = Case(shapes, torch.float16, draw(st.sampled_from(["none", "causal"])), **gqa)
        size = draw(st.sampled_from([1e3, 6e4]))
    elif kind == "padding":
        case = Case(shapes, draw(st.sampled_from(DTYPES)), "float", (seq_q, seq_k), **gqa)
        size = draw(st.floats(0.1, 0.9))
    else:
        case = Case(
            shapes,
            draw(st.sampled_from(DTYPES)),
            draw(st.sampled_from(["none", "causal", "float"])),
            window=draw(st.sampled_from([None, (6, 0)])),
            softcap=draw(st.sampled_from([5.0, 50.0])),
            sinks=draw(st.sampled_from(["head", "token"])),
            align=draw(st.sampled_from(["top-left", "bottom-right"])),
            segments=draw(segments(seq_q, seq_k)),
            dropout=0.2,
            **gqa,
        )
        size = 1.0
    tiles = draw(st.sampled_from([None, (16, 16)]))
    return kind, case, size, draw(st.integers(0, 2**32 - 1)), tiles


def _edge_inputs(kind: str, case: Case, size: float, seed: int) -> Inputs:
    """The example's inputs: `make_inputs`, then what its kind changes."""
    inputs = make_inputs(case, seed)
    gen = torch.Generator().manual_seed(seed)
    if kind == "large logits":
        inputs["q"] = inputs["q"] * size
        inputs["k"] = inputs["k"] * size
    elif kind == "near max":  # uniform in +-size; dO smaller, so dv = P^T dO stays in range
        for name in ("q", "k", "v", "dout"):
            t = inputs[name]
            assert t is not None
            spread = size / case.shapes.seq_q if name == "dout" else size
            inputs[name] = (torch.rand(t.shape, generator=gen, dtype=t.dtype) * 2 - 1) * spread
    elif kind == "padding":  # keys past the live ones and the last query row, at finfo.min
        mask = inputs["mask"]
        assert mask is not None
        live = max(1, round(size * case.shapes.seq_k))
        mask[..., live:] = torch.finfo(case.dtype).min
        mask[..., -1, :] = torch.finfo(case.dtype).min
    return inputs


def _check_edge(example: EdgeExample) -> None:
    kind, case, size, seed, tiles = example
    inputs = _edge_inputs(kind, case, size, seed)
    fn = attention_fn("triton", tiles)
    lse = None
    if kind == "every keyword":

        def lse(*args: object, **kwargs: object) -> object:
            return fn(*args, return_lse=True, **kwargs)

    _judge(fn, case, inputs, f"{kind} {case.id} size {size:g} tiles {tiles}: ", lse)


# the inputs: float32 q and k scaled by 100 (scores near 3e4), and float16 at its max
_LARGE = ("large logits", Case(Shapes((1,), 2, 2, 50, 50, 64, 64), torch.float32), 100.0, 0, None)
_NEAR_MAX = ("near max", Case(Shapes((1,), 2, 2, 30, 30, 16, 16), torch.float16), 6e4, 0, None)


@pytest.mark.slow
@settings(max_examples=16, **_SETTINGS)
@given(example=edge_examples())
@example(example=_LARGE)
@example(example=_NEAR_MAX)
def test_edge_examples_hold_the_rule_on_triton(example):
    _check_edge(example)


def _scores_through_blas(folder: Path) -> ModuleType:
    """The triton kernels with the defect planted: the dK/dV kernel forms its scores k q^T with
    tl.dot (numpy's BLAS in the interpreter: fused multiply-adds, blocked by shape), while
    forward and the dQ kernel sum each score's products by one numpy sum -- scores one
    rounding apart."""
    kernels = pytest.importorskip("attngrad.strategies.triton.kernels")
    source = inspect.getsource(kernels)
    pattern = (
        "s_t = _dot_rows(K, bhk, n0, offs_n, nk, k, Q, bh, m0, offs_m, nq, q, d,\n"
        "                            BLOCK_N, BLOCK_M, BLOCK_D, CHUNK, ACC, UPCAST, PRECISION, "
        "REPEATABLE)"
    )
    assert source.count(pattern) == 1, "update the planted defect to the kernels' source"
    path = folder / "kernels_scores_through_blas.py"
    path.write_text(source.replace(pattern, pattern.replace("REPEATABLE)", "False)")))
    spec = importlib.util.spec_from_file_location("kernels_scores_through_blas", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # Triton reads each kernel's source from the file
    return module


@pytest.mark.slow
def test_edge_examples_find_scores_rebuilt_in_another_order(monkeypatch, tmp_path):
    # the planted defect passes the rule nowhere it can show: the property, drawing large
    # logits alone and none of the examples, must find an example it fails
    monkeypatch.setattr(triton_package, "kernels", _scores_through_blas(tmp_path))
    search = settings(
        max_examples=6, derandomize=True, database=None, phases=[Phase.generate], **_SETTINGS
    )(given(example=edge_examples(kinds=("large logits",)))(_check_edge))
    with pytest.raises(AssertionError, match="> bound"):
        search()
