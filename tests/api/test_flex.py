"""`attngrad.flex_attention`: every score_mod and BlockMask, every derivative, on every strategy
that runs them.

What each result is judged against:

* the forward (out, lse) against torch's own eager ``flex_attention`` (which runs on CPU only
  when nothing requires grad: it gets detached inputs and a score_mod over detached captures);
* every gradient -- q, k, v and each tensor the score_mod captures (closures, leaves, a tensor
  computed from a parameter before the call) -- against `dense_flex`, a float64 reference
  written here that evaluates the score and mask functions over the whole [B, H, Nq, Nk]
  index grid by broadcasting (not torch.vmap, as attngrad and torch do), softmaxes with
  dead rows at zero, and lets autograd differentiate it;
* gradcheck, gradgradcheck and forward-mode gradcheck in float64 on tiny sizes, and
  torch.func's transforms against the same transforms of `dense_flex`;
* 16-bit results by the 2x rule of DESIGN.md against a plain dense run in the dtype.

``RUNS``: the strategies that run a score_mod, each at its own tiles, plus flash at small
tiles and recompute at 16-row chunks (at these lengths their own tiles and chunks are one,
and the merges across tiles -- the running max's rescale, each tile's share of a captured
gradient -- would not run).  fused runs each score function in its kernels the way it
would at any size: a relative one as its term along the diagonals, a softcap as the
kernels' own, any other as a program.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import pytest
import torch
from torch.nn.attention.flex_attention import (
    AuxRequest,
    and_masks,
    create_block_mask,
    or_masks,
)
from torch.nn.attention.flex_attention import flex_attention as torch_flex

import attngrad
import attngrad.call.flex
import attngrad.strategies.common
import attngrad.strategies.flash
from attngrad.core.interface import Backward
from attngrad.core.score_function import ScoreFunction
from attngrad.core.tiling import tile_sizes
from attngrad.strategies.fused.strategy import Fused

F64 = torch.float64
ScoreMod = Callable[..., torch.Tensor]
MaskMod = Callable[..., torch.Tensor]

# torch's eager flex_attention warns on every call that it is not compiled
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

RUNS = ("explicit", "recompute", "recompute-chunks", "flash", "flash-tiles", "fused")


@pytest.fixture(params=RUNS)
def run(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Callable[..., Any]:
    """`attngrad.flex_attention` on one of `RUNS`."""
    return _runner(request.param, monkeypatch)


def _runner(name: str, monkeypatch: pytest.MonkeyPatch) -> Callable[..., Any]:
    strategy = name.split("-")[0]
    if name == "flash-tiles":
        # 7 x 5 tiles without a BlockMask; under one, the whole multiples of its blocks
        # nearest 7 x 5 (one block each way)
        def small(shapes: Any, block_q: int | None = None, block_k: int | None = None) -> Any:
            return tile_sizes(shapes, block_q or 7, block_k or 5)

        monkeypatch.setattr(attngrad.strategies.flash, "tile_sizes", small)
    if name == "recompute-chunks":
        monkeypatch.setattr(attngrad.strategies.common, "CHUNK_BYTES", 1)  # 16-row chunks

    def fn(*args: Any, **kwargs: Any) -> Any:
        return attngrad.flex_attention(*args, strategy=strategy, **kwargs)

    fn.name = name  # type: ignore[attr-defined]
    return fn


# -- the float64 reference ----------------------------------------------------------


def grid(
    b: int, h: int, nq: int, nk: int, device: torch.device | None = None
) -> tuple[torch.Tensor, ...]:
    """b, h, q_idx, kv_idx as int32 tensors broadcasting to [B, H, Nq, Nk]."""
    return tuple(
        torch.arange(n, dtype=torch.int32, device=device).view(
            [n if a == axis else 1 for a in range(4)]
        )
        for axis, n in enumerate((b, h, nq, nk))
    )


def keep_of(mask_mod: MaskMod | None, b: int, h: int, nq: int, nk: int) -> torch.Tensor:
    """mask_mod over the whole grid: bool [B, H, Nq, Nk]."""
    if mask_mod is None:
        return torch.ones(b, h, nq, nk, dtype=torch.bool)
    return mask_mod(*grid(b, h, nq, nk)).expand(b, h, nq, nk)


def dense_flex(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    score_mod: ScoreMod | None = None,
    keep: torch.Tensor | None = None,
    scale: float | None = None,
    softmax_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out [B, Hq, Nq, dv], lse [B, Hq, Nq], max_scores [B, Hq, Nq]) by the definition.

    q: [B, Hq, Nq, d]; k, v: [B, Hkv, Nk, d|dv] (query head h reads kv head h // (Hq/Hkv));
    keep: bool, broadcasting to [B, Hq, Nq, Nk] (`keep_of`).  A row that keeps nothing:
    out 0, lse and max_scores -inf, and no gradient.  In float64 this is the reference;
    in a 16-bit dtype with ``softmax_dtype=torch.float32`` it is the plain run of the 2x
    rule (scores, products and the score_mod in the dtype, the softmax in float32).
    """
    bsz, hq, nq, d = q.shape
    g = hq // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    nk = k.shape[2]
    s = (q @ k.transpose(-1, -2)) * (d**-0.5 if scale is None else scale)  # [B, Hq, Nq, Nk]
    if score_mod is not None:
        s = score_mod(s, *grid(bsz, hq, nq, nk)).expand(bsz, hq, nq, nk)
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))  # no gradient into a masked score
    work = s if softmax_dtype is None else s.to(softmax_dtype)
    best = work.amax(-1, keepdim=True)
    live = best > float("-inf")
    m = torch.where(live, best, 0).detach()  # the softmax does not depend on the shift
    e = torch.exp(work - m)  # exactly 0 where masked
    total = e.sum(-1, keepdim=True)
    p = (e / torch.where(live, total, 1)).to(v.dtype)
    lse = torch.where(live, total.log() + m, float("-inf")).squeeze(-1)
    return p @ v, lse, best.squeeze(-1).detach()


# -- the cases --------------------------------------------------------------------


@dataclass(frozen=True)
class Sizes:
    b: int = 2
    hq: int = 2
    hkv: int = 2
    nq: int = 40  # not a multiple of the BlockMask's 16: the last block is cut
    nk: int = 40
    d: int = 8
    dv: int = 8

    def __str__(self) -> str:
        return f"B{self.b}-H{self.hq}x{self.hkv}-N{self.nq}x{self.nk}-d{self.d}x{self.dv}"


Params = dict[str, torch.Tensor]


def _no_params(s: Sizes, gen: torch.Generator) -> Params:
    return {}


@dataclass(frozen=True)
class Flex:
    """One kind of call: a score_mod over learnable captures and a mask_mod.

    score(sizes, params) -> score_mod: the captures are ``params`` (float64 leaves drawn by
    ``params(sizes, gen)``) or tensors made from them before the call; mask(sizes) ->
    mask_mod; mask_bh: whether the mask depends on b, h (the BlockMask is built per entry,
    per head); block: the BlockMask's BLOCK_SIZE (None: torch's default, 128).
    """

    name: str
    score: Callable[[Sizes, Params], ScoreMod] | None = None
    params: Callable[[Sizes, torch.Generator], Params] = _no_params
    mask: Callable[[Sizes], MaskMod] | None = None
    sizes: Sizes = Sizes()
    block: int | tuple[int, int] | None = 16
    mask_bh: tuple[bool, bool] = (False, False)
    scale: float | None = None
    gqa: bool = False

    def block_mask(self) -> Any:
        if self.mask is None:
            return None
        s = self.sizes
        kw = {} if self.block is None else {"BLOCK_SIZE": self.block}
        b, h = (s.b if self.mask_bh[0] else None), (s.hq if self.mask_bh[1] else None)
        return create_block_mask(self.mask(s), b, h, s.nq, s.nk, device="cpu", **kw)

    def keep(self) -> torch.Tensor | None:
        s = self.sizes
        return None if self.mask is None else keep_of(self.mask(s), s.b, s.hq, s.nq, s.nk)

    def score_mod(self, params: Params) -> ScoreMod | None:
        return None if self.score is None else self.score(self.sizes, params)


# score functions


def _alibi_fixed(s: Sizes, p: Params) -> ScoreMod:
    slopes = torch.tensor([2.0 ** (-(n + 1)) for n in range(s.hq)], dtype=F64)
    return lambda x, b, h, i, j: x + slopes[h] * (j - i)


def _slopes(s: Sizes, gen: torch.Generator) -> Params:
    return {"slopes": torch.rand(s.hq, generator=gen, dtype=F64) * 0.3 + 0.05}


def _alibi(s: Sizes, p: Params) -> ScoreMod:
    slopes = p["slopes"]
    return lambda x, b, h, i, j: x + slopes[h] * (j - i)


def _softcap(s: Sizes, p: Params) -> ScoreMod:
    return lambda x, b, h, i, j: 0.8 * torch.tanh(x / 0.8)


def _cap(s: Sizes, gen: torch.Generator) -> Params:
    return {"cap": torch.tensor(1.2, dtype=F64)}  # 0-d capture


def _softcap_learn(s: Sizes, p: Params) -> ScoreMod:
    cap = p["cap"]
    return lambda x, b, h, i, j: cap * torch.tanh(x / cap)


def _table(s: Sizes, gen: torch.Generator) -> Params:
    return {"table": torch.randn(s.hq, s.nq + s.nk - 1, generator=gen, dtype=F64)}


def _relpos(s: Sizes, p: Params) -> ScoreMod:
    table = p["table"]  # [H, Nq + Nk - 1], read at q_idx - kv_idx
    return lambda x, b, h, i, j: x + table[h, i - j + s.nk - 1]


T5_BUCKETS, T5_MAX_DISTANCE = 8, 24


def t5_bucket(rel: torch.Tensor) -> torch.Tensor:
    """T5's bidirectional relative-position bucket of kv_idx - q_idx (int32 in, int32 out)."""
    half = T5_BUCKETS // 2
    exact = half // 2
    n = rel.abs()
    far = exact + (
        torch.log(n.to(F64).clamp(min=1) / exact)
        / math.log(T5_MAX_DISTANCE / exact)
        * (half - exact)
    ).to(torch.int32)
    far = far.clamp(max=half - 1)
    return (rel > 0).to(torch.int32) * half + torch.where(n < exact, n, far)


def _t5_table(s: Sizes, gen: torch.Generator) -> Params:
    return {"t5": torch.randn(s.hq, T5_BUCKETS, generator=gen, dtype=F64)}


def _t5(s: Sizes, p: Params) -> ScoreMod:
    t5 = p["t5"]
    return lambda x, b, h, i, j: x + t5[h, t5_bucket(j - i)]


def _batch_slopes(s: Sizes, gen: torch.Generator) -> Params:
    return {"slopes": torch.rand(s.b, s.hq, generator=gen, dtype=F64) * 0.3 + 0.05}


def _alibi_per_batch(s: Sizes, p: Params) -> ScoreMod:
    slopes = p["slopes"]  # [B, H]: reads b, so vmap's samples folded into the batch must not
    return lambda x, b, h, i, j: x + slopes[b, h] * (j - i)


def _gates(s: Sizes, gen: torch.Generator) -> Params:
    return {"gate": torch.randn(s.hq, generator=gen, dtype=F64)}


def _gate(s: Sizes, p: Params) -> ScoreMod:
    gate = p["gate"]
    return lambda x, b, h, i, j: x * torch.sigmoid(gate[h])


def _dense(s: Sizes, gen: torch.Generator) -> Params:
    return {"bias": torch.randn(s.b, s.hq, s.nq, s.nk, generator=gen, dtype=F64)}


def _dense_bias(s: Sizes, p: Params) -> ScoreMod:
    bias = p["bias"]
    return lambda x, b, h, i, j: x + bias[b, h, i, j]


def _w(s: Sizes, gen: torch.Generator) -> Params:
    return {"w": torch.randn(s.hq, s.nq, s.nk, generator=gen, dtype=F64)}


def _nonleaf(s: Sizes, p: Params) -> ScoreMod:
    bias = 1.5 * torch.tanh(p["w"])  # made before the call: a captured tensor that is not a leaf
    return lambda x, b, h, i, j: x + bias[h, i, j]


def _bonus(s: Sizes, gen: torch.Generator) -> Params:
    return {"bonus": torch.tensor(0.7, dtype=F64)}


def _global_bonus(s: Sizes, p: Params) -> ScoreMod:
    bonus = p["bonus"]
    is_global = torch.arange(s.nk) < 3  # a captured bool tensor: never differentiated
    return lambda x, b, h, i, j: torch.where(is_global[j], x + bonus, x)


def _several(s: Sizes, p: Params) -> ScoreMod:
    """Three captures at once, the score entering with slope -1 (dS'/dS is not 1)."""
    alibi, rel, bias = _alibi(s, p), _relpos(s, p), _dense_bias(s, p)
    return lambda x, b, h, i, j: bias(rel(alibi(x, b, h, i, j), b, h, i, j), b, h, i, j) - x - x


def _several_params(s: Sizes, gen: torch.Generator) -> Params:
    return {**_slopes(s, gen), **_table(s, gen), **_dense(s, gen)}


# mask functions


def _causal(s: Sizes) -> MaskMod:
    return lambda b, h, i, j: j <= i


def _causal_bottom_right(s: Sizes) -> MaskMod:
    return lambda b, h, i, j: j <= i + (s.nk - s.nq)


def _prefix_lm(s: Sizes) -> MaskMod:
    return lambda b, h, i, j: (j <= i) | (j < 11)


def doc_ids(s: Sizes) -> torch.Tensor:
    """[B, N] document of each token of the packed batch (documents of 8, 14, 2, 16 tokens
    in the first entry at N = 40; two halves in the second)."""
    n = s.nq
    first = torch.bucketize(
        torch.arange(n), torch.tensor([n // 5, 11 * n // 20, 3 * n // 5]), right=True
    )
    second = (torch.arange(n) >= n // 2).long()
    return torch.stack([first, second])[: s.b] if s.b <= 2 else first.expand(s.b, n)


def _document(s: Sizes) -> MaskMod:
    doc = doc_ids(s)
    return lambda b, h, i, j: (doc[b, i] == doc[b, j]) & (j <= i)


def _sliding(s: Sizes) -> MaskMod:
    return lambda b, h, i, j: (j <= i) & (i - j < 9)


def _dilated(s: Sizes) -> MaskMod:
    return lambda b, h, i, j: ((i - j) % 2 == 0) & ((i - j).abs() <= 10)


def _global_tokens(s: Sizes) -> MaskMod:
    return lambda b, h, i, j: (j < 3) | (i < 3) | ((i - j).abs() <= 4)


def _and_or(s: Sizes) -> MaskMod:
    causal = lambda b, h, i, j: j <= i  # noqa: E731
    near = lambda b, h, i, j: i - j < 12  # noqa: E731
    sink = lambda b, h, i, j: j < 2  # noqa: E731
    return or_masks(and_masks(causal, near), sink)


def _per_head(s: Sizes) -> MaskMod:
    return lambda b, h, i, j: (i - j).abs() <= 4 * (h + 1)


def _empty_rows(s: Sizes) -> MaskMod:
    # rows 3, 10, 17, 24, 31 and every row from 32 on (a whole query block) attend nothing
    return lambda b, h, i, j: (i % 7 != 3) & (i < 32) & (j <= i)


CASES = [
    Flex("alibi-fixed-causal", _alibi_fixed, mask=_causal),
    Flex("alibi-learn", _alibi, _slopes),
    Flex("softcap-causal", _softcap, mask=_causal, block=(16, 32)),
    Flex("softcap-learn", _softcap_learn, _cap, scale=0.9),
    Flex("relpos", _relpos, _table),
    Flex("t5", _t5, _t5_table, mask=_sliding, block=(16, 32)),
    Flex("gate-prefix-lm", _gate, _gates, mask=_prefix_lm, scale=0.3),
    Flex("dense-bias-document", _dense_bias, _dense, mask=_document, mask_bh=(True, False)),
    Flex("nonleaf-sliding", _nonleaf, _w, mask=_sliding),
    Flex("alibi-dilated", _alibi, _slopes, mask=_dilated),
    Flex("global-tokens", _global_bonus, _bonus, mask=_global_tokens),
    Flex("and-or-masks", _relpos, _table, mask=_and_or, block=(16, 32)),
    Flex("per-head-mask", _gate, _gates, mask=_per_head, mask_bh=(False, True)),
    Flex("empty-rows", _alibi, _slopes, mask=_empty_rows),
    Flex("mask-only", mask=_document, mask_bh=(True, False)),
    Flex(
        "alibi-per-batch-document",
        _alibi_per_batch,
        _batch_slopes,
        mask=_document,
        mask_bh=(True, False),
    ),
    Flex("gqa", _alibi, _slopes, mask=_causal, sizes=Sizes(hq=4, hkv=2), gqa=True, block=(16, 32)),
    Flex("nq-ne-nk", _relpos, _table, mask=_causal_bottom_right, sizes=Sizes(nq=24, nk=56, dv=12)),
    Flex("several-captures", _several, _several_params, mask=_prefix_lm),
    # torch's default BLOCK_SIZE (128) and a last block of 2 rows
    Flex(
        "default-block",
        _relpos,
        _table,
        mask=_sliding,
        sizes=Sizes(b=1, nq=130, nk=130),
        block=None,
    ),
]


# -- inputs, runs and comparisons ---------------------------------------------------


@dataclass
class Inputs:
    """q: [B, Hq, Nq, d] a transposed view, k: [B, Hkv, Nk, d] a slice of a wider tensor,
    v: [B, Hkv, Nk, dv]; dout like the output; params: the float64 captures."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dout: torch.Tensor
    params: Params

    @staticmethod
    def of(case: Flex, seed: int = 0) -> Inputs:
        s, gen = case.sizes, torch.Generator().manual_seed(seed)
        q = torch.randn(s.b, s.nq, s.hq, s.d, generator=gen, dtype=F64).transpose(1, 2)
        k = torch.randn(s.b, s.hkv, s.nk, s.d + 3, generator=gen, dtype=F64)[..., : s.d]
        v = torch.randn(s.b, s.hkv, s.nk, s.dv, generator=gen, dtype=F64)
        dout = torch.randn(s.b, s.hq, s.nq, s.dv, generator=gen, dtype=F64)
        return Inputs(q, k, v, dout, case.params(s, gen))

    def leaves(self, dtype: torch.dtype = F64) -> tuple[list[torch.Tensor], Params]:
        """Fresh leaves that require grad, q, k, v keeping their strides."""
        # detach(): a new tensor over the same storage and strides (to(F64) would be q itself)
        qkv = [t.detach().to(dtype).requires_grad_() for t in (self.q, self.k, self.v)]
        params = {n: t.to(dtype).detach().clone().requires_grad_() for n, t in self.params.items()}
        return qkv, params


@dataclass
class Expected:
    """One case's inputs, torch's eager outputs and the float64 reference's."""

    case: Flex
    inputs: Inputs
    block_mask: Any
    torch_out: torch.Tensor
    torch_lse: torch.Tensor
    ref: dict[str, torch.Tensor] = field(default_factory=dict)


def reference(case: Flex, inputs: Inputs) -> dict[str, torch.Tensor]:
    """out, lse, max_scores and every gradient (dq, dk, dv, d<capture>) of `dense_flex`."""
    (q, k, v), params = inputs.leaves()
    out, lse, best = dense_flex(q, k, v, case.score_mod(params), case.keep(), case.scale)
    names = ["dq", "dk", "dv", *(f"d{n}" for n in params)]
    grads = torch.autograd.grad(
        out, [q, k, v, *params.values()], inputs.dout, materialize_grads=True
    )
    return {
        "out": out.detach(),
        "lse": lse.detach(),
        "max_scores": best,
        **dict(zip(names, grads, strict=True)),
    }


@pytest.fixture(scope="module", params=CASES, ids=[c.name for c in CASES])
def expected(request: pytest.FixtureRequest) -> Expected:
    case: Flex = request.param
    inputs = Inputs.of(case)
    block_mask = case.block_mask()
    detached = {n: t.detach() for n, t in inputs.params.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out, lse = torch_flex(
            inputs.q, inputs.k, inputs.v, case.score_mod(detached), block_mask, case.scale,
            enable_gqa=case.gqa, return_lse=True,
        )  # fmt: skip
    return Expected(case, inputs, block_mask, out, lse, reference(case, inputs))


def assert_near(got: torch.Tensor, want: torch.Tensor, what: str, rel: float = 1e-10) -> None:
    """float64 agreement: |got - want| <= rel * (|want| + max|want|), -inf where want is."""
    assert got.dtype == want.dtype and got.shape == want.shape, (
        what,
        got.dtype,
        got.shape,
        want.shape,
    )
    assert not got.isnan().any(), f"{what}: NaN"
    inf = want.isinf()
    assert torch.equal(got[inf], want[inf]), f"{what}: infinities differ"
    g, w = got[~inf], want[~inf]
    if w.numel() == 0:
        return
    bound = rel * (w.abs() + w.abs().max() + 1e-300)
    err = (g - w).abs()
    worst = int((err / bound).argmax())
    assert (err <= bound).all(), (
        f"{what}: error {err[worst]:.3g} > {bound[worst]:.3g} (max error {err.max():.3g})"
    )


def flex_grads(
    fn: Callable[..., Any], case: Flex, inputs: Inputs, block_mask: Any, **kwargs: Any
) -> tuple[Any, dict[str, torch.Tensor]]:
    """(what ``fn`` returns, {dq, dk, dv, d<capture>}) on fresh float64 leaves."""
    (q, k, v), params = inputs.leaves()
    result = fn(q, k, v, case.score_mod(params), block_mask, case.scale, case.gqa, **kwargs)
    out = result[0] if isinstance(result, tuple) else result
    grads = torch.autograd.grad(
        out, [q, k, v, *params.values()], inputs.dout, materialize_grads=True
    )
    return result, dict(zip(["dq", "dk", "dv", *(f"d{n}" for n in params)], grads, strict=True))


# -- forward against torch, gradients against the float64 reference -------------------


def test_every_case_matches_torch_and_the_reference(
    expected: Expected, run: Callable[..., Any]
) -> None:
    case, inputs = expected.case, expected.inputs
    # empty-rows: its last query block (a 16-row chunk) attends nothing
    assert not inputs.q.is_contiguous() and not inputs.k.is_contiguous()  # the views are the point
    before = {
        n: t.clone()
        for n, t in (("q", inputs.q), ("k", inputs.k), ("v", inputs.v), *inputs.params.items())
    }
    aux_request = AuxRequest(lse=True, max_scores=True)
    (out, aux), grads = flex_grads(run, case, inputs, expected.block_mask, return_aux=aux_request)
    assert_near(out, expected.torch_out, "out vs torch")
    assert_near(aux.lse, expected.torch_lse, "lse vs torch")
    assert_near(aux.max_scores, expected.ref["max_scores"], "max_scores vs reference")
    assert_near(out, expected.ref["out"], "out vs reference")
    for name, g in grads.items():
        assert_near(g, expected.ref[name], f"{name} vs reference", rel=1e-9)
    now = {
        n: t for n, t in (("q", inputs.q), ("k", inputs.k), ("v", inputs.v), *inputs.params.items())
    }
    for name, t in before.items():
        assert torch.equal(now[name], t), f"the caller's {name} was modified"


@pytest.mark.parametrize("with_score", [True, False], ids=["alibi", "mask-only"])
def test_rows_that_attend_nothing_are_zero(with_score: bool, run: Callable[..., Any]) -> None:
    case = next(c for c in CASES if c.name == "empty-rows")
    case = case if with_score else replace(case, score=None, params=_no_params)
    inputs = Inputs.of(case)
    dead = ~case.keep().any(-1)  # [B, H, Nq]
    assert dead.any() and dead[..., 32:].all()
    (out, lse), grads = flex_grads(run, case, inputs, case.block_mask(), return_lse=True)
    assert (out[dead] == 0).all() and (lse[dead] == float("-inf")).all()
    assert (grads["dq"][dead] == 0).all()
    assert all(not g.isnan().any() for g in grads.values())


@pytest.mark.parametrize("with_score", [True, False], ids=["alibi", "mask-only"])
def test_a_mask_that_keeps_nothing(with_score: bool, run: Callable[..., Any]) -> None:
    """Every row dead: out 0, lse -inf, every gradient (the capture's too) 0, no NaN."""
    case = next(c for c in CASES if c.name == "empty-rows")
    case = case if with_score else replace(case, score=None, params=_no_params)
    inputs = Inputs.of(case)
    nothing = create_block_mask(
        lambda b, h, i, j: (i < 0) & (j <= i), None, None, 40, 40, device="cpu", BLOCK_SIZE=16
    )
    (out, lse), grads = flex_grads(run, case, inputs, nothing, return_lse=True)
    assert (out == 0).all() and (lse == float("-inf")).all()
    assert all((g == 0).all() for g in grads.values())


def test_return_lse_matches_torch(run: Callable[..., Any]) -> None:
    case = CASES[1]
    inputs = Inputs.of(case)
    detached = {n: t.detach() for n, t in inputs.params.items()}
    want_out, want_lse = torch_flex(
        inputs.q, inputs.k, inputs.v, case.score_mod(detached), return_lse=True
    )
    out, lse = run(inputs.q, inputs.k, inputs.v, case.score_mod(detached), return_lse=True)
    assert_near(out, want_out, "out")
    assert_near(lse, want_lse, "lse")
    # lse is differentiable: its gradient in q is the softmax-weighted mean of the scaled keys
    q = inputs.q.detach().requires_grad_()
    _, lse = run(q, inputs.k, inputs.v, return_lse=True)
    (dq,) = torch.autograd.grad(lse.sum(), q)
    p = torch.softmax(q @ inputs.k.transpose(-1, -2) * 8**-0.5, -1)
    assert_near(dq, p @ inputs.k * 8**-0.5, "dq of lse")


def test_a_full_block_keeps_its_scores_without_calling_mask_mod(run: Callable[..., Any]) -> None:
    """A BlockMask's full blocks are kept as they are (as torch's kernels keep them), even
    where its mask_mod would say False: here every key block up to the diagonal is full and
    mask_mod masks everything, so the answer is block-causal attention.  (torch's eager
    route evaluates mask_mod everywhere and answers zeros here instead.)"""
    from torch.nn.attention.flex_attention import BlockMask

    n, blk = 40, 16
    nb = -(-n // blk)
    none = torch.zeros(1, 1, nb, dtype=torch.int32)
    full_num = torch.arange(1, nb + 1, dtype=torch.int32).view(1, 1, nb)
    full_idx = torch.arange(nb, dtype=torch.int32).expand(1, 1, nb, nb).contiguous()
    bm = BlockMask.from_kv_blocks(
        none, torch.zeros(1, 1, nb, nb, dtype=torch.int32), full_num, full_idx,
        BLOCK_SIZE=blk, mask_mod=lambda b, h, i, j: i < 0, seq_lengths=(n, n),
    )  # fmt: skip
    inputs = Inputs.of(CASES[1])
    q, k, v = inputs.q, inputs.k, inputs.v
    i, j = torch.arange(n)[:, None], torch.arange(n)[None]
    keep = (j // blk) <= (i // blk)
    want, _, _ = dense_flex(q, k, v, keep=keep)
    assert_near(run(q, k, v, block_mask=bm), want, "out")


# -- gradcheck, gradgradcheck, forward mode ----------------------------------------

TINY = Sizes(b=1, hq=2, hkv=2, nq=13, nk=13, d=4, dv=3)


def tiny(name: str, **changes: Any) -> Flex:
    """The case ``name`` at tiny sizes (BlockMask blocks of 8, several per row)."""
    case = next(c for c in CASES if c.name == name)
    sizes = changes.pop("sizes", replace(TINY, hq=case.sizes.hq, hkv=case.sizes.hkv))
    if case.sizes.nq != case.sizes.nk:
        sizes = replace(sizes, nq=9, nk=17)
    return replace(case, sizes=sizes, block=8 if case.mask is not None else None, **changes)


GRADCHECK = ["alibi-learn", "softcap-learn", "t5", "dense-bias-document", "nonleaf-sliding",
             "global-tokens", "empty-rows", "gqa", "nq-ne-nk"]  # fmt: skip
GRADGRADCHECK = ["softcap-learn", "nonleaf-sliding", "gqa"]


def _as_function(
    run: Callable[..., Any], case: Flex
) -> tuple[Callable[..., torch.Tensor], list[torch.Tensor]]:
    """(fn(q, k, v, *captures) -> out, its float64 leaves), for the gradcheck family."""
    inputs = Inputs.of(case, seed=1)
    (q, k, v), params = inputs.leaves()
    block_mask, names = case.block_mask(), list(params)

    def fn(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *captures: torch.Tensor
    ) -> torch.Tensor:
        score = case.score_mod(dict(zip(names, captures, strict=True)))
        return run(q, k, v, score, block_mask, case.scale, case.gqa)

    return fn, [q, k, v, *params.values()]


@pytest.mark.parametrize("name", GRADCHECK)
def test_gradcheck(name: str, run: Callable[..., Any]) -> None:
    fn, leaves = _as_function(run, tiny(name))
    assert torch.autograd.gradcheck(fn, leaves, fast_mode=True)


@pytest.mark.parametrize("name", GRADGRADCHECK)
def test_gradgradcheck(name: str, run: Callable[..., Any]) -> None:
    fn, leaves = _as_function(run, tiny(name))
    assert torch.autograd.gradgradcheck(fn, leaves, fast_mode=True)


@pytest.mark.parametrize("name", ["explicit", "flash-tiles"])
def test_gradcheck_slow_mode_one_case(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every column of the Jacobian, not a random projection, on one case with a capture."""
    case = tiny("t5", sizes=replace(TINY, nq=7, nk=7, d=2, dv=2))
    fn, leaves = _as_function(_runner(name, monkeypatch), case)
    assert torch.autograd.gradcheck(fn, leaves)


@pytest.mark.parametrize("name", ["softcap-learn", "t5", "nonleaf-sliding", "empty-rows", "gqa"])
def test_forward_mode_gradcheck(name: str, run: Callable[..., Any]) -> None:
    fn, leaves = _as_function(run, tiny(name))
    assert torch.autograd.gradcheck(
        fn, leaves, check_forward_ad=True, check_backward_ad=False, check_undefined_grad=False,
        check_batched_grad=False, fast_mode=True,
    )  # fmt: skip


# -- torch.func, against the same transforms of the reference ---------------------------

FUNC_CASES = ["alibi-learn", "alibi-per-batch-document", "t5", "softcap-learn"]


def _func_setup(
    name: str, run: Callable[..., Any]
) -> tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor], Inputs, torch.Tensor]:
    """(ours(q, theta), ref(q, theta), inputs, theta): the output as a function of q and the
    case's one capture theta, by ``run`` and by `dense_flex`."""
    case = tiny(name, sizes=replace(TINY, b=2))
    inputs = Inputs.of(case, seed=2)
    ((pname, theta),) = inputs.params.items()
    block_mask, keep = case.block_mask(), case.keep()
    k, v = inputs.k, inputs.v

    def ours(q: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
        return run(q, k, v, case.score_mod({pname: theta}), block_mask, case.scale, case.gqa)

    def ref(q: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
        return dense_flex(q, k, v, case.score_mod({pname: theta}), keep, case.scale)[0]

    return ours, ref, inputs, theta


@pytest.mark.parametrize("name", FUNC_CASES)
def test_torch_func_grad_vjp_jvp(name: str, run: Callable[..., Any]) -> None:
    ours, ref, inputs, theta = _func_setup(name, run)
    q, w = inputs.q, inputs.dout
    loss = lambda f: lambda q, t: (f(q, t) * w).sum()  # noqa: E731
    got = torch.func.grad(loss(ours), argnums=(0, 1))(q, theta)
    want = torch.func.grad(loss(ref), argnums=(0, 1))(q, theta)
    for g, r, what in zip(got, want, ("q", "theta"), strict=True):
        assert_near(g, r, f"grad in {what}", rel=1e-9)
    out, pull = torch.func.vjp(ours, q, theta)
    want_out, want_pull = torch.func.vjp(ref, q, theta)
    assert_near(out, want_out, "vjp out")
    for g, r in zip(pull(w), want_pull(w), strict=True):
        assert_near(g, r, "vjp", rel=1e-9)
    dq, dtheta = torch.randn_like(q), torch.randn_like(theta)
    got_out, got_t = torch.func.jvp(ours, (q, theta), (dq, dtheta))
    want_out, want_t = torch.func.jvp(ref, (q, theta), (dq, dtheta))
    assert_near(got_out, want_out, "jvp out")
    assert_near(got_t, want_t, "jvp tangent", rel=1e-9)


@pytest.mark.parametrize("name", FUNC_CASES)
def test_torch_func_jacobians_and_hessian(name: str, run: Callable[..., Any]) -> None:
    ours, ref, inputs, theta = _func_setup(name, run)
    q, w = inputs.q, inputs.dout
    of_theta = lambda f: lambda t: f(q, t)  # noqa: E731
    want = torch.func.jacrev(of_theta(ref))(theta)
    rev = torch.func.jacrev(of_theta(ours))(theta)
    fwd = torch.func.jacfwd(of_theta(ours))(theta)
    assert_near(rev, want, "jacrev", rel=1e-9)
    assert_near(fwd, want, "jacfwd", rel=1e-9)
    assert_near(rev, fwd, "jacrev vs jacfwd", rel=1e-9)
    loss = lambda f: lambda t: (f(q, t) * w).sum() + (f(q, t) ** 2).sum()  # noqa: E731
    assert_near(
        torch.func.hessian(loss(ours))(theta),
        torch.func.hessian(loss(ref))(theta),
        "hessian",
        rel=1e-8,
    )


@pytest.mark.parametrize("name", FUNC_CASES)
def test_torch_func_vmap(name: str, run: Callable[..., Any]) -> None:
    """vmap over the capture and over q (whose samples fold into the batch: a score_mod that
    reads b must still see each sample's own b)."""
    ours, ref, inputs, theta = _func_setup(name, run)
    q = inputs.q
    thetas = torch.stack([theta, theta * 0.5 + 0.1, -theta])
    got = torch.func.vmap(ours, in_dims=(None, 0))(q, thetas)
    for n in range(3):
        assert_near(got[n], ref(q, thetas[n]), f"vmap over the capture, sample {n}")
    qs = torch.stack([q, 2 * q, q.flip(-1)])
    got = torch.func.vmap(ours, in_dims=(0, None))(qs, theta)
    for n in range(3):
        assert_near(got[n], ref(qs[n], theta), f"vmap over q, sample {n}")
    # gradients of each sample's loss, batched: vmap of grad
    w = inputs.dout
    per = torch.func.vmap(torch.func.grad(lambda t: (ours(q, t) * w).sum()))(thetas)
    for n in range(3):
        want = torch.func.grad(lambda t: (ref(q, t) * w).sum())(thetas[n])
        assert_near(per[n], want, f"vmap of grad, sample {n}", rel=1e-9)


def test_double_backward_through_a_capture(run: Callable[..., Any]) -> None:
    """create_graph=True: d/dtheta <dL/dq, u> against the reference's (a Hessian-vector product)."""
    case = tiny("several-captures")
    inputs = Inputs.of(case, seed=3)

    def hvp(fn: Callable[..., Any]) -> list[torch.Tensor]:
        (q, k, v), params = inputs.leaves()
        out = fn(q, k, v, case.score_mod(params))
        (dq,) = torch.autograd.grad((out * inputs.dout).sum(), q, create_graph=True)
        return list(
            torch.autograd.grad(
                (dq * inputs.q).sum(), [k, v, *params.values()], materialize_grads=True
            )
        )

    keep, block_mask = case.keep(), case.block_mask()
    got = hvp(lambda q, k, v, s: run(q, k, v, s, block_mask, case.scale))
    want = hvp(lambda q, k, v, s: dense_flex(q, k, v, s, keep, case.scale)[0])
    for g, w in zip(got, want, strict=True):
        assert_near(g, w, "second order", rel=1e-9)


# -- determinism of the captured gradients --------------------------------------------


def test_captured_gradients_are_bitwise_reproducible(run: Callable[..., Any]) -> None:
    """Two runs, and one and two threads, give the captured gradients bit for bit."""
    case = replace(next(c for c in CASES if c.name == "several-captures"),
                   sizes=Sizes(b=2, hq=4, hkv=4, nq=72, nk=72, d=16, dv=16))  # fmt: skip
    inputs = Inputs.of(case, seed=4)
    block_mask = case.block_mask()
    threads = torch.get_num_threads()

    def captured_grads(n: int) -> list[torch.Tensor]:
        torch.set_num_threads(n)
        _, grads = flex_grads(run, case, inputs, block_mask)
        return [g for name, g in grads.items() if name not in ("dq", "dk", "dv")]

    try:
        first, again, two = captured_grads(1), captured_grads(1), captured_grads(2)
    finally:
        torch.set_num_threads(threads)
    assert len(first) == 3
    for a, b, c in zip(first, again, two, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)


# -- 16-bit dtypes: the 2x rule --------------------------------------------------------

HALF_CASES = [
    "alibi-fixed-causal",
    "alibi-learn",
    "softcap-learn",
    "relpos",
    "nonleaf-sliding",
    "gqa",
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("name", HALF_CASES)
def test_16_bit_by_the_2x_rule(name: str, dtype: torch.dtype, run: Callable[..., Any]) -> None:
    assert_16_bit_rule(name, dtype, run)


def assert_16_bit_rule(name: str, dtype: torch.dtype, run: Callable[..., Any]) -> None:
    """|got - ref| <= 2 max|plain - ref| + floor, for out and every gradient, where ref is the
    float64 reference on the inputs as rounded to ``dtype`` and plain the same dense
    computation in ``dtype`` (softmax in float32).  The floor: one rounding of the result to
    the dtype (u |ref|) and sums in float32 (n u_32 max|ref|, n the longest sum)."""
    case = next(c for c in CASES if c.name == name)
    inputs = Inputs.of(case, seed=5)
    rounded = Inputs(*(t.to(dtype).to(F64) for t in (inputs.q, inputs.k, inputs.v, inputs.dout)),
                     {n: t.to(dtype).to(F64) for n, t in inputs.params.items()})  # fmt: skip
    ref = reference(case, rounded)
    keep, block_mask = case.keep(), case.block_mask()

    (q, k, v), params = inputs.leaves(dtype)
    out, _, _ = dense_flex(
        q, k, v, case.score_mod(params), keep, case.scale, softmax_dtype=torch.float32
    )
    names = ["dq", "dk", "dv", *(f"d{n}" for n in params)]

    def outputs(out: torch.Tensor, leaves: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """out and its gradients, by name, for the rounded dout."""
        grads = torch.autograd.grad(out, leaves, rounded.dout.to(dtype))
        return {**dict(zip(names, grads, strict=True)), "out": out}

    plain = outputs(out, [q, k, v, *params.values()])
    (q, k, v), params = inputs.leaves(dtype)
    out = run(q, k, v, case.score_mod(params), block_mask, case.scale, case.gqa)
    got = outputs(out, [q, k, v, *params.values()])

    u, u32 = torch.finfo(dtype).eps / 2, torch.finfo(torch.float32).eps / 2
    n = max(case.sizes.nq, case.sizes.nk, case.sizes.d) * case.sizes.b * case.sizes.hq
    for key, g in got.items():
        assert g.dtype == dtype, (key, g.dtype)
        assert not g.isnan().any(), f"{key}: NaN"
        r = ref[key]
        plain_err = (plain[key].to(F64) - r).abs().max()
        bound = 2 * plain_err + u * r.abs() + n * u32 * r.abs().max()
        err = (g.to(F64) - r).abs()
        assert (err <= bound).all(), f"{key}: error {err.max():.3g}, plain's {plain_err:.3g}"


# -- the tests can fail: planted bugs ------------------------------------------------


@pytest.fixture
def planted(monkeypatch: pytest.MonkeyPatch) -> Callable[[float], None]:
    """plant(factor): each tile's share of every captured gradient is scaled by ``factor``;
    on fused, also the kernels' (a program's scatters: no tile share reaches Python)."""

    def plant(factor: float) -> None:
        real = ScoreFunction.pullback_
        real_fused = Fused.backward_into

        def backward_into(self: Fused, backward: Backward[Any]) -> None:
            fresh = tuple(None if d is None else torch.zeros_like(d) for d in backward.dcaptured)
            real_fused(self, replace(backward, dcaptured=fresh))
            for acc, share in zip(backward.dcaptured, fresh, strict=True):
                if acc is not None:
                    acc += factor * share

        def pullback_(
            self: ScoreFunction, raw: Any, rows: Any, cols: Any, ds: Any, dcaptured: Any
        ) -> Any:
            fresh = [None if d is None else torch.zeros_like(d) for d in dcaptured]
            out = real(self, raw, rows, cols, ds, fresh)
            for acc, share in zip(dcaptured, fresh, strict=True):
                if acc is not None:
                    acc += factor * share
            return out

        monkeypatch.setattr(ScoreFunction, "pullback_", pullback_)
        monkeypatch.setattr(Fused, "backward_into", backward_into)

    return plant


@pytest.mark.parametrize("factor", [1.001, 0.0], ids=["0.1%-off", "dropped"])
def test_a_wrong_captured_gradient_fails_the_reference_comparison(
    factor: float, planted: Callable[[float], None], run: Callable[..., Any]
) -> None:
    case = next(c for c in CASES if c.name == "relpos")
    inputs = Inputs.of(case)
    ref = reference(case, inputs)
    _, grads = flex_grads(run, case, inputs, case.block_mask())
    assert_near(grads["dtable"], ref["dtable"], "before the bug", rel=1e-9)
    planted(factor)
    _, grads = flex_grads(run, case, inputs, case.block_mask())
    assert_near(grads["dq"], ref["dq"], "dq: the bug is in the capture's gradient only", rel=1e-9)
    with pytest.raises(AssertionError, match="dtable"):
        assert_near(grads["dtable"], ref["dtable"], "dtable", rel=1e-9)


@pytest.mark.parametrize("name", ["explicit", "flash-tiles"])
def test_a_dropped_captured_gradient_fails_gradcheck(
    name: str, planted: Callable[[float], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    fn, leaves = _as_function(
        _runner(name, monkeypatch), tiny("alibi-learn", sizes=replace(TINY, nq=7, nk=7, d=2, dv=2))
    )
    assert torch.autograd.gradcheck(fn, leaves, fast_mode=True)
    planted(0.0)
    assert not torch.autograd.gradcheck(fn, leaves, fast_mode=True, raise_exception=False)


# ALiBi's slope gradient sums terms (j - i) dS' that cancel: plain bfloat16 errs by ~12% there,
# so the 2x rule cannot see 5% on it; a table's entries (and w's) sum few terms each
@pytest.mark.parametrize("name", ["relpos", "nonleaf-sliding"])
def test_a_5_percent_wrong_captured_gradient_fails_the_16_bit_rule(
    name: str, planted: Callable[[float], None], run: Callable[..., Any]
) -> None:
    planted(1.05)
    param = next(iter(next(c for c in CASES if c.name == name).params(Sizes(), torch.Generator())))
    with pytest.raises(AssertionError, match=f"d{param}: error"):
        assert_16_bit_rule(name, torch.bfloat16, run)


# -- how models use it ----------------------------------------------------------------


class AlibiAttention(torch.nn.Module):
    """A module whose learnable ALiBi slopes its score_mod reads through ``self``."""

    def __init__(self, heads: int, strategy: str) -> None:
        super().__init__()
        self.slopes = torch.nn.Parameter(torch.linspace(0.1, 0.4, heads, dtype=F64))
        self.strategy = strategy

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: Any
    ) -> torch.Tensor:
        def score_mod(s: torch.Tensor, b: Any, h: Any, i: Any, j: Any) -> torch.Tensor:
            return s + self.slopes[h] * (j - i)

        return attngrad.flex_attention(q, k, v, score_mod, block_mask, strategy=self.strategy)


@pytest.mark.parametrize("strategy", ["auto", "explicit", "recompute", "flash"])
def test_a_module_parameter_gets_its_gradient(strategy: str) -> None:
    """loss.backward() fills the module's Parameter.grad (accumulating over two calls)."""
    case = next(c for c in CASES if c.name == "alibi-fixed-causal")
    inputs, block_mask, keep = Inputs.of(case), case.block_mask(), case.keep()
    module = AlibiAttention(case.sizes.hq, strategy)
    (q, k, v), _ = inputs.leaves()
    loss = (module(q, k, v, block_mask) * inputs.dout).sum() + module(
        q, k, v, block_mask
    ).square().sum()
    loss.backward()
    slopes = module.slopes.detach().clone().requires_grad_()
    (rq, rk, rv), _ = inputs.leaves()
    alibi = _alibi(case.sizes, {"slopes": slopes})
    out = dense_flex(rq, rk, rv, alibi, keep)[0]
    ((out * inputs.dout).sum() + out.square().sum()).backward()
    assert_near(module.slopes.grad, slopes.grad, "slopes.grad", rel=1e-9)
    for got, want in ((q, rq), (k, rk), (v, rv)):
        assert_near(got.grad, want.grad, "input grad", rel=1e-9)


def test_a_capture_modified_after_the_forward_is_caught(run: Callable[..., Any]) -> None:
    """An optimizer step between forward and backward (slopes changed in place) raises, as
    autograd does for any saved tensor, instead of differentiating at the new slopes."""
    case = next(c for c in CASES if c.name == "gate-prefix-lm")
    inputs = Inputs.of(case)
    (q, k, v), params = inputs.leaves()
    out = run(q, k, v, case.score_mod(params), case.block_mask(), case.scale)
    with torch.no_grad():
        params["gate"].add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.backward(inputs.dout)
