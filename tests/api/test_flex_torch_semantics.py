"""`attngrad.flex_attention` where torch's own flex tests found it differ from torch.

* A score function (and a ``mask_mod``) valid only where the BlockMask keeps scores -- a
  paged table read at ``kv_idx - offset[b]``, a window's bias read at ``q_idx - kv_idx`` --
  as torch's compiled kernel evaluates it: on every strategy, every derivative
  (q, k, v and the captured table, backward, forward mode, double backward) against the
  float64 reference run with the same function made valid everywhere (its index clamped,
  which changes nothing where the BlockMask keeps scores).
* torch's "no mask" BlockMask (``_create_empty_block_mask``, what torch builds for
  block_mask=None) is no mask; torch's identity score_mod (``_identity``, or any function
  returning its score unchanged) is no score function: every strategy, fused included,
  runs them, as they run a call without them.
* A float8 key and value beside a 16-bit query are computed in the query's dtype, as
  torch's flex_attention computes them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch.nn.attention import flex_attention as torch_flex_module
from torch.nn.attention.flex_attention import BlockMask, create_block_mask
from torch.nn.attention.flex_attention import flex_attention as torch_flex

import attngrad
import attngrad.strategies.common
import attngrad.strategies.flash
from attngrad.call.flex import FlexCall
from attngrad.core.contract import ArgumentError
from attngrad.core.tiling import tile_sizes
from attngrad.strategies import REGISTRY
from attngrad.verify.flex_reference import reference_flex_attention

F64 = torch.float64

# torch's eager flex_attention warns on every call that it is not compiled
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

RUNS = ("explicit", "recompute", "recompute-chunks", "flash", "flash-tiles", "fused")


@pytest.fixture(params=RUNS)
def run(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Callable[..., Any]:
    """`attngrad.flex_attention` on a tensor-op strategy; "-tiles" and "-chunks": tiles of
    one BlockMask block and 16-row chunks, so that a tile holds kept and masked blocks of
    other batch entries side by side."""
    strategy = request.param.split("-")[0]
    if strategy == "fused":
        reason = REGISTRY["fused"].unavailable_reason(torch.device("cpu"))
        if reason is not None:
            pytest.skip(f"fused cannot run here: {reason[:200]}")
    if request.param == "flash-tiles":

        def small(shapes: Any, block_q: int | None = None, block_k: int | None = None) -> Any:
            return tile_sizes(shapes, block_q or 7, block_k or 5)

        monkeypatch.setattr(attngrad.strategies.flash, "tile_sizes", small)
    if request.param == "recompute-chunks":
        monkeypatch.setattr(attngrad.strategies.common, "CHUNK_BYTES", 1)

    def fn(*args: Any, **kwargs: Any) -> Any:
        return attngrad.flex_attention(*args, strategy=strategy, **kwargs)

    fn.strategy = strategy  # type: ignore[attr-defined]
    return fn


# -- 1. functions valid only where the BlockMask keeps scores -----------------------------


@dataclass(frozen=True)
class Paged:
    """Batch entry b owns slot slots[b] of a shared cache (paged attention): the keys
    [offset[b], offset[b] + pages * page), offset[b] = slots[b] * pages * page, of
    Nk = (B + free) * pages * page keys; its table [B, pages * page] is valid at
    ``kv_idx - offset[b]`` in its own keys alone."""

    batch: int = 2
    heads: int = 2
    page: int = 8
    pages: int = 2
    nq: int = 11
    d: int = 4
    slots: tuple[int, ...] = (0, 1)
    free: int = 0  # slots nobody owns

    @property
    def own(self) -> int:
        return self.pages * self.page

    @property
    def nk(self) -> int:
        return (self.batch + self.free) * self.own

    @property
    def offset(self) -> torch.Tensor:
        return torch.tensor(self.slots) * self.own


def _paged_case(name: str, p: Paged) -> tuple[Any, Any, Any, Any, dict[str, torch.Tensor]]:
    """(score_mod(params), its everywhere-valid twin(params), the BlockMask, the reference's
    BlockMask, params) of case ``name``."""
    gen = torch.Generator().manual_seed(3)
    off, own = p.offset, p.own
    # a few keys of each entry's pages are padding (the last ones written)
    valid = torch.arange(own) < torch.tensor([own - 3, own - 5]).view(-1, 1)[: p.batch]
    params = {"table": torch.randn(p.batch, own, generator=gen, dtype=F64)}

    def inside(b: Any, j: Any) -> Any:
        return (j >= off[b]) & (j < off[b] + own)

    def safe(b: Any, j: Any) -> Any:
        return (j - off[b]).clamp(0, own - 1)

    def in_pages(b: Any, h: Any, i: Any, j: Any) -> Any:
        return inside(b, j)

    def in_pages_safe(b: Any, h: Any, i: Any, j: Any) -> Any:
        return inside(b, j)

    block_mask = create_block_mask(in_pages, p.batch, None, p.nq, p.nk, "cpu", BLOCK_SIZE=p.page)
    ref_mask = create_block_mask(in_pages_safe, p.batch, None, p.nq, p.nk, "cpu", p.page)
    if name == "table":  # elementwise: evaluated on broadcast indices

        def score(w: dict[str, torch.Tensor]) -> Any:
            return lambda s, b, h, i, j: s + w["table"][b, j - off[b]]

        def twin(w: dict[str, torch.Tensor]) -> Any:
            return lambda s, b, h, i, j: s + w["table"][b, safe(b, j)]

    elif name == "table-vmap":  # table[b] then [...]: evaluated under vmap

        def score(w: dict[str, torch.Tensor]) -> Any:
            return lambda s, b, h, i, j: s * (1 + w["table"][b][j - off[b]].tanh())

        def twin(w: dict[str, torch.Tensor]) -> Any:
            return lambda s, b, h, i, j: s * (1 + w["table"][b][safe(b, j)].tanh())

    elif name == "mask-too":  # mask_mod valid in the partial blocks alone: padding by page

        def padded(b: Any, h: Any, i: Any, j: Any) -> Any:
            return valid[b, j - off[b]]

        def padded_safe(b: Any, h: Any, i: Any, j: Any) -> Any:
            return inside(b, j) & valid[b, safe(b, j)]

        # each entry's own pages partial, as paged attention's converted mask lists them
        blocks_k = p.nk // p.page
        pages = torch.arange(p.pages, dtype=torch.int32)
        own_blocks = torch.stack([slot * p.pages + pages for slot in p.slots])  # [B, pages]
        others = torch.stack(
            [torch.tensor([x for x in range(blocks_k) if x // p.pages != slot], dtype=torch.int32)
             for slot in p.slots]
        )  # fmt: skip
        blocks_q = -(-p.nq // p.page)
        idx = torch.cat([own_blocks, others], -1)[:, None, None].expand(-1, 1, blocks_q, -1)
        num = torch.full((p.batch, 1, blocks_q), p.pages, dtype=torch.int32)
        block_mask = BlockMask.from_kv_blocks(
            num, idx.contiguous(), BLOCK_SIZE=p.page, mask_mod=padded, seq_lengths=(p.nq, p.nk)
        )
        ref_mask = create_block_mask(padded_safe, p.batch, None, p.nq, p.nk, "cpu", p.page)

        def score(w: dict[str, torch.Tensor]) -> Any:
            return lambda s, b, h, i, j: s + w["table"][b, j - off[b]]

        def twin(w: dict[str, torch.Tensor]) -> Any:
            return lambda s, b, h, i, j: s + w["table"][b, safe(b, j)]

    else:  # "window": a relative bias [H, 2W - 1] read at q_idx - kv_idx inside a window
        width = 2
        params = {"bias": torch.randn(p.heads, 2 * width - 1, generator=gen, dtype=F64)}

        def window(b: Any, h: Any, i: Any, j: Any) -> Any:
            return (i - j < width) & (j - i < width)

        block_mask = create_block_mask(window, None, None, p.nq, p.nk, "cpu", BLOCK_SIZE=p.page)
        ref_mask = block_mask

        def score(w: dict[str, torch.Tensor]) -> Any:
            return lambda s, b, h, i, j: s + w["bias"][h, i - j + width - 1]

        def twin(w: dict[str, torch.Tensor]) -> Any:
            return lambda s, b, h, i, j: (
                s + w["bias"][h, (i - j + width - 1).clamp(0, 2 * width - 2)]
            )

    return score, twin, block_mask, ref_mask, params


PAGED = ["table", "table-vmap", "mask-too", "window"]


def _leaves(p: Paged, params: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(p.batch, p.heads, p.nq, p.d, generator=gen, dtype=F64)
    k, v = (torch.randn(p.batch, p.heads, p.nk, p.d, generator=gen, dtype=F64) for _ in "kv")
    return [t.clone().requires_grad_() for t in (q, k, v, *params.values())]


@pytest.mark.parametrize("name", PAGED)
def test_a_function_valid_only_where_the_mask_keeps_scores(
    name: str, run: Callable[..., Any]
) -> None:
    """Out and every gradient (q, k, v, the captured table) against the float64 reference of
    the same function made valid everywhere."""
    p = Paged()
    score, twin, block_mask, ref_mask, params = _paged_case(name, p)
    ours, theirs = _leaves(p, params), _leaves(p, params)
    names = list(params)
    if name == "table-vmap" and run.strategy == "fused":  # type: ignore[attr-defined]
        with pytest.raises(ArgumentError, match="more than one score's worth"):
            run(*ours[:3], score(dict(zip(names, ours[3:], strict=True))), block_mask)
        return  # chained indexing runs on the tensor-op tiles ("auto" takes them)
    out = run(*ours[:3], score(dict(zip(names, ours[3:], strict=True))), block_mask)
    want = reference_flex_attention(
        *theirs[:3], twin(dict(zip(names, theirs[3:], strict=True))), ref_mask
    )
    torch.testing.assert_close(out, want, rtol=1e-9, atol=1e-12)
    grad = torch.randn_like(want)
    got = torch.autograd.grad(out, ours, grad)
    expected = torch.autograd.grad(want, theirs, grad)
    for what, g, e in zip(["q", "k", "v", *names], got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-9, atol=1e-12, msg=lambda m, w=what: f"{w}: {m}")


@pytest.mark.parametrize("strategy", ["explicit", "recompute", "flash", "fused"])
@pytest.mark.parametrize("name", ["table", "mask-too"])
def test_the_first_score_need_not_be_kept(name: str, strategy: str) -> None:
    """Entry 0's pages come last, past a free slot: the functions raise at (b, h, q_idx,
    kv_idx) = (0, 0, 0, 0), where they are first called to find what they read; they are
    checked at the first score the BlockMask keeps instead."""
    p = Paged(heads=1, page=4, nq=5, slots=(2, 1), free=1)
    score, twin, block_mask, ref_mask, params = _paged_case(name, p)
    ours, theirs = _leaves(p, params), _leaves(p, params)
    out = attngrad.flex_attention(
        *ours[:3], score({"table": ours[3]}), block_mask, strategy=strategy
    )
    want = reference_flex_attention(*theirs[:3], twin({"table": theirs[3]}), ref_mask)
    torch.testing.assert_close(out, want, rtol=1e-9, atol=1e-12)
    got = torch.autograd.grad(out.sum(), ours)
    for g, e in zip(got, torch.autograd.grad(want.sum(), theirs), strict=True):
        torch.testing.assert_close(g, e, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("strategy", ["explicit", "recompute", "flash", "fused"])
def test_a_mask_mod_valid_only_in_partial_blocks_without_a_score_mod(strategy: str) -> None:
    """Every strategy runs the paged mask alone (fused reads it as a dense keep)."""
    if strategy == "fused":
        reason = REGISTRY["fused"].unavailable_reason(torch.device("cpu"))
        if reason is not None:
            pytest.skip(f"fused cannot run here: {reason[:200]}")
    p = Paged(heads=1, page=4, nq=5, slots=(2, 1), free=1)
    _, _, block_mask, ref_mask, _ = _paged_case("mask-too", p)
    ours, theirs = _leaves(p, {}), _leaves(p, {})
    out = attngrad.flex_attention(*ours, block_mask=block_mask, strategy=strategy)
    want = reference_flex_attention(*theirs, block_mask=ref_mask)
    torch.testing.assert_close(out, want, rtol=1e-9, atol=1e-12)
    got = torch.autograd.grad(out.sum(), ours)
    for g, e in zip(got, torch.autograd.grad(want.sum(), theirs), strict=True):
        torch.testing.assert_close(g, e, rtol=1e-9, atol=1e-12)


def _paged_function(
    name: str, strategy: str
) -> tuple[Callable[..., torch.Tensor], list[torch.Tensor]]:
    p = Paged(batch=2, heads=1, page=2, pages=2, nq=3, d=2)
    score, _, block_mask, _, params = _paged_case(name, p)
    names = list(params)

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *w: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = attngrad.flex_attention(
            q, k, v, score(dict(zip(names, w, strict=True))), block_mask, strategy=strategy
        )
        return out

    return fn, _leaves(p, params)


@pytest.mark.parametrize(
    ("name", "strategy"),
    [("mask-too", "explicit"), ("mask-too", "recompute"), ("mask-too", "flash"),
     ("window", "flash"), ("mask-too", "fused"), ("window", "fused")],
)  # fmt: skip
def test_forward_mode_and_double_backward_of_such_a_function(name: str, strategy: str) -> None:
    """push (forward mode) and the second-order pass evaluate it at kept scores too (a
    relative function's term, read at distances the window does not keep, falls back to
    the kept scores in each of them)."""
    fn, leaves = _paged_function(name, strategy)
    assert torch.autograd.gradcheck(
        fn, leaves, check_forward_ad=True, check_backward_ad=False, check_undefined_grad=False,
        check_batched_grad=False, fast_mode=True,
    )  # fmt: skip
    assert torch.autograd.gradgradcheck(fn, leaves, fast_mode=True)


def test_an_index_error_where_the_mask_keeps_scores_is_raised() -> None:
    """Where the BlockMask keeps the scores that read past the table, the error is real."""
    p = Paged()
    table = torch.randn(p.batch, p.own)
    q, k, v = (t.float().detach() for t in _leaves(p, {})[:3])
    off = p.offset

    def reads_past(s: Any, b: Any, h: Any, i: Any, j: Any) -> Any:
        return s + table[b, j - off[b] + 1]  # the last key of each entry reads past its row

    block_mask = create_block_mask(
        lambda b, h, i, j: (j >= off[b]) & (j < off[b] + p.own), p.batch, None, p.nq, p.nk,
        "cpu", BLOCK_SIZE=p.page,
    )  # fmt: skip
    runs = ["explicit", "recompute", "flash"]
    if REGISTRY["fused"].unavailable_reason(torch.device("cpu")) is None:
        runs.append("fused")
    for strategy in runs:
        with pytest.raises(IndexError, match=r"out of (its )?bounds"):
            attngrad.flex_attention(q, k, v, reads_past, block_mask, strategy=strategy)
    with pytest.raises(IndexError, match="out of bounds"):  # no BlockMask: every score kept
        attngrad.flex_attention(q, k, v, lambda s, b, h, i, j: s + table[b, j], strategy="flash")


# -- 2 and 3. torch's stand-ins for block_mask=None and score_mod=None ----------------------

ALL = ("explicit", "recompute", "flash", "fused")


def _resolved(monkeypatch: pytest.MonkeyPatch, strategy: str, *args: Any) -> FlexCall:
    """The call ``strategy`` takes (fused's kernels not compiled for it), then a skip when
    they cannot be compiled here."""
    with monkeypatch.context() as m:
        m.setattr(REGISTRY[strategy], "unavailable_reason", lambda device: None)
        call = FlexCall.build(*args, None, False, False, None, None, strategy)
    reason = REGISTRY[strategy].unavailable_reason(torch.device("cpu"))
    if reason is not None:
        pytest.skip(f"{strategy} took the call but cannot run here: {reason[:200]}")
    return call


def _qkv(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(2)
    return tuple(torch.randn(2, 2, 20, 8, generator=gen).to(dtype) for _ in range(3))


@pytest.mark.parametrize("strategy", ALL)
def test_torchs_no_mask_block_mask_is_no_mask(
    strategy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    q, k, v = _qkv()
    empty = torch_flex_module._create_empty_block_mask(q, k)
    assert tuple(empty.seq_lengths) == (1, 1)  # torch's, whatever the call's lengths
    call = _resolved(monkeypatch, strategy, q, k, v, None, empty)
    assert call.problem.mods.blocks is None
    out = attngrad.flex_attention(q, k, v, block_mask=empty, strategy=strategy)
    torch.testing.assert_close(out, attngrad.flex_attention(q, k, v, strategy=strategy))
    torch.testing.assert_close(out, torch_flex(q, k, v), rtol=1e-5, atol=1e-5)


def _returns_its_score(s: torch.Tensor, b: Any, h: Any, i: Any, j: Any) -> torch.Tensor:
    return s


IDENTITIES = {
    "torch-identity": torch_flex_module._identity,
    "lambda": lambda s, b, h, i, j: s,
    "def": _returns_its_score,
}


@pytest.mark.parametrize("strategy", ALL)
@pytest.mark.parametrize("name", IDENTITIES)
def test_an_identity_score_mod_is_no_score_function(
    name: str, strategy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    q, k, v = _qkv()
    identity = IDENTITIES[name]
    call = _resolved(monkeypatch, strategy, q, k, v, identity, None)
    assert call.problem.mods.score is None
    out = attngrad.flex_attention(q, k, v, identity, strategy=strategy)
    torch.testing.assert_close(out, attngrad.flex_attention(q, k, v, strategy=strategy))
    torch.testing.assert_close(out, torch_flex(q, k, v, identity), rtol=1e-5, atol=1e-5)


def test_a_score_mod_that_changes_the_score_stays() -> None:
    q, k, v = _qkv()
    call = FlexCall.build(
        q, k, v, lambda s, b, h, i, j: s * 1, None, None, False, False, None, None, "flash"
    )
    assert call.problem.mods.score is not None


# -- 4. a float8 key and value beside a 16-bit query ---------------------------------------


@pytest.mark.parametrize("strategy", ["explicit", "recompute", "flash"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("f8", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_a_float8_key_and_value_are_read_in_the_querys_dtype(
    f8: torch.dtype, dtype: torch.dtype, strategy: str
) -> None:
    q, k, v = _qkv(dtype)
    k8, v8 = k.to(f8), v.to(f8)
    q.requires_grad_()
    out = attngrad.flex_attention(q, k8, v8, lambda s, b, h, i, j: s - (i - j).abs() / 8,
                                  strategy=strategy)  # fmt: skip
    assert out.dtype == dtype
    (dq,) = torch.autograd.grad(out.float().sum(), q)
    q2 = q.detach().clone().requires_grad_()
    same = attngrad.flex_attention(
        q2, k8.to(dtype), v8.to(dtype), lambda s, b, h, i, j: s - (i - j).abs() / 8,
        strategy=strategy,
    )  # fmt: skip
    (dq2,) = torch.autograd.grad(same.float().sum(), q2)
    assert torch.equal(out, same) and torch.equal(dq, dq2)
    with torch.no_grad():  # torch's own flex_attention takes them too, in the query's dtype
        theirs = torch_flex(q.detach(), k8, v8, lambda s, b, h, i, j: s - (i - j).abs() / 8)
    assert theirs.dtype == dtype
    torch.testing.assert_close(out.float(), theirs.float(), rtol=0.02, atol=0.02)


def test_a_float8_query_is_refused_naming_it() -> None:
    q, k, v = (t.to(torch.float8_e4m3fn) for t in _qkv())
    with pytest.raises(TypeError, match=r"query has dtype torch.float8_e4m3fn.*Try query"):
        attngrad.flex_attention(q, k, v)
