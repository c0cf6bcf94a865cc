r"""A conformance case: its sizes and options, its inputs, and any function run on them.

`Case` names what one judgement is about (shapes, dtype, mask kind and
`attngrad.attention`'s options beyond SDPA's); `default_cases` is the grid
`attngrad check` runs; `make_inputs` draws a case's float64 q, k, v, mask,
sinks and upstream gradient, the same numbers for every dtype.
`outputs_and_grads` runs any SDPA-like function on them: out and every
gradient (dq, dk, dv and, for a float mask, dmask, for sinks, dsinks).

A flex case (``flex`` set: a scenario of `attngrad.verify.flex_cases`) is
called with ``flex_attention``'s signature instead (`call_case`): its score
function and BlockMask, and the tensor theta its score function reads and
learns, drawn by `make_inputs` beside q, k, v (its gradient: "dtheta").
`flex_cases` is its grid.

A dropout case hands every call a generator seeded alike (`DROPOUT_SEED`),
and the reference functions apply the keep mask attention draws from it
(`dropout_mask`, `as_attention`), so all of them see one mask.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import cast

import torch

from attngrad.core.contract import Shapes, dtype_name, pair
from attngrad.core.dropout import Dropout, draw_seed, keep_mask
from attngrad.verify.flex_cases import GRID, block_mask, draw_theta, scenario
from attngrad.verify.formula import Window

__all__ = [
    "DROPOUT_SEED",
    "MASK_KINDS",
    "SINK_KINDS",
    "AttentionFn",
    "Case",
    "Inputs",
    "as_attention",
    "call_case",
    "call_flex",
    "call_sdpa",
    "call_with",
    "default_cases",
    "default_mask_shape",
    "dropout_mask",
    "flex_cases",
    "input_tensor",
    "long_cases",
    "make_inputs",
    "make_leaves",
    "outputs_and_grads",
    "received",
    "reference_keywords",
]

MASK_KINDS = ("none", "causal", "bool", "float")
# attention sinks: none, one logit per head ([Hq]) or one per query row ([*lead, Hq, Nq])
SINK_KINDS = ("none", "head", "token")
# the seed of the generator every dropout case hands attention (fresh at each call), so every
# strategy, every pass of gradcheck and the reference see one keep mask
DROPOUT_SEED = 0xD0

Inputs = dict[str, torch.Tensor | None]
AttentionFn = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class Case:
    """One conformance case: the sizes, the dtype and what constrains the scores.

    ``mask`` is one of MASK_KINDS; ``mask_shape`` the shape of a bool/float
    mask (anything broadcastable to the scores [*lead, Hq, Nq, Nk]; None: the
    case's default).  ``scale`` None is 1/sqrt(d); ``window``, ``softcap``
    and ``align`` as in `attngrad.attention`.  ``enable_gqa`` None means
    "when Hq != Hkv".  ``sinks``: one of SINK_KINDS (`make_inputs` draws
    them).  ``segments``: packed sequences as (query lengths, key lengths),
    e.g. ``((3, 2), (2, 4))`` for cu_seqlens_q = [0, 3, 5], cu_seqlens_k =
    [0, 2, 6].  ``dropout``: dropout_p, drawn from a generator seeded with
    `DROPOUT_SEED`.  ``flex``: a scenario of `attngrad.verify.flex_cases`
    (its name): the case calls ``flex_attention`` with its score function and
    BlockMask, and nothing else (mask "none", SDPA's options only); the
    tensor its score function reads is in `theta_dtype`.
    """

    shapes: Shapes
    dtype: torch.dtype = torch.float64
    mask: str = "none"
    mask_shape: tuple[int, ...] | None = None
    scale: float | None = None
    window: Window = None
    enable_gqa: bool | None = None
    softcap: float | None = None
    sinks: str = "none"
    align: str = "top-left"
    segments: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    dropout: float = 0.0
    flex: str | None = None

    def __post_init__(self) -> None:
        if self.flex is not None:
            scenario(self.flex)  # a name it knows
            if len(self.shapes.lead) != 1:
                raise ValueError(
                    f"a flex case takes 4-d inputs [B, H, N, d], got lead {self.shapes.lead}"
                )

    @property
    def theta_dtype(self) -> torch.dtype:
        """The dtype of a flex case's theta: float32 beside bfloat16 q, k, v (a model's
        parameters under mixed precision, whose gradient PyTorch then sums in float32),
        else the case's dtype (float16: a table held in 16 bits, summed in 16 bits by the
        plain run)."""
        return torch.float32 if self.dtype == torch.bfloat16 else self.dtype

    def input_dtypes(self, dtype: torch.dtype) -> dict[str, torch.dtype]:
        """The inputs whose dtype differs from ``dtype`` in a run in ``dtype``: theta
        (`theta_dtype`) in a run in the case's own dtype; none otherwise (float64)."""
        if self.flex is None or dtype != self.dtype or self.theta_dtype == dtype:
            return {}
        return {"theta": self.theta_dtype} if scenario(self.flex).theta is not None else {}

    @property
    def gqa(self) -> bool:
        """The ``enable_gqa`` the case calls attention with."""
        if self.enable_gqa is not None:
            return self.enable_gqa
        return self.shapes.heads_q != self.shapes.heads_kv

    @property
    def id(self) -> str:
        """A readable id built from the shape, e.g. ``B2-H4:2-N33x47-d16:24-float32-causal``.

        ``B`` lists the leading dims (``Bnone`` without any: the chapter's
        ``[B, N, d]`` layout, whose first dim plays the heads); ``H4:2`` is Hq:Hkv,
        ``N17x47`` Nq x Nk, ``d59:24`` d:dv.  Equal pairs are written once.
        Attention's options beyond SDPA's come before the mask, so no id is
        another's beginning: ``bottom-right``, ``cap1.5`` (softcap),
        ``sink:head``, ``seg10+7+16x20+0+27`` (the query and key segments'
        lengths), ``drop0.2`` (dropout_p); ``w8,2`` (window) and ``scale0.3``
        come after it.  A flex case ends in ``flex:<scenario>`` in the mask's place
        (``[theta:float32]`` where its theta's dtype is not the case's).
        """
        sh = self.shapes
        batch = "x".join(map(str, sh.lead)) or "none"
        parts = [
            f"B{batch}",
            "H" + pair(sh.heads_q, sh.heads_kv, ":"),
            "N" + pair(sh.seq_q, sh.seq_k, "x"),
            "d" + pair(sh.head_dim, sh.value_dim, ":"),
            dtype_name(self.dtype),
            *self._options(),
            self.mask + ("" if self.mask_shape is None else str(list(self.mask_shape))),
        ]
        if self.flex is not None:  # in place of the mask: flex_attention has none
            theta = self.input_dtypes(self.dtype).get("theta")
            parts[-1] = f"flex:{self.flex}" + (f"[theta:{dtype_name(theta)}]" if theta else "")
        if self.window is not None:
            parts.append(f"w{self.window[0]},{self.window[1]}")
        if self.scale is not None:
            parts.append(f"scale{self.scale:g}")
        return "-".join(parts).replace(" ", "")

    def _options(self) -> list[str]:
        """The id's parts for the options beyond SDPA's (`id`)."""
        parts = [] if self.align == "top-left" else [self.align]
        if self.softcap is not None:
            parts.append(f"cap{self.softcap:g}")
        if self.sinks != "none":
            parts.append(f"sink:{self.sinks}")
        if self.segments is not None:
            parts.append("seg" + "x".join("+".join(map(str, n)) for n in self.segments))
        if self.dropout:
            parts.append(f"drop{self.dropout:g}")
        return parts

    @property
    def kwargs(self) -> dict[str, object]:
        """The keyword arguments the case passes to an SDPA-like function (`attention`'s).

        Only what the case sets beyond SDPA's is_causal and enable_gqa; a
        dropout case gets a fresh ``generator`` seeded with `DROPOUT_SEED` at
        each access.  The sinks are an input (`make_inputs`), not a keyword here.
        A flex case: ``enable_gqa`` and ``scale`` (flex_attention's), where set.
        """
        if self.flex is not None:
            flex: dict[str, object] = {"enable_gqa": True} if self.gqa else {}
            return flex if self.scale is None else {**flex, "scale": self.scale}
        kw: dict[str, object] = {"is_causal": self.mask == "causal", "enable_gqa": self.gqa}
        if self.scale is not None:
            kw["scale"] = self.scale
        if self.window is not None:
            kw["window"] = self.window
        if self.softcap is not None:
            kw["softcap"] = self.softcap
        if self.align != "top-left":
            kw["align"] = self.align
        if self.segments is not None:
            kw["cu_seqlens_q"], kw["cu_seqlens_k"] = (_cumulative(n) for n in self.segments)
        if self.dropout:
            kw["dropout_p"] = self.dropout
            kw["generator"] = torch.Generator().manual_seed(DROPOUT_SEED)
        return kw


def _cumulative(lengths: tuple[int, ...]) -> torch.Tensor:
    """cu_seqlens [0, n0, n0 + n1, ...] (int64) of segment lengths."""
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int64)


def default_cases() -> list[Case]:
    """The grid `attngrad check` runs: every dtype x mask kind x layout, the
    options beyond SDPA's, and the long 16-bit cases (`long_cases`).

    Odd sizes on purpose (33, 47, 59) so no tile or vector width divides them.
    """
    layouts = [
        Shapes((2,), 2, 2, 33, 33, 16, 16),
        # GQA with Nq != Nk and a value dim unlike the query/key dim
        Shapes((1,), 4, 2, 17, 47, 59, 24),
        # the course chapter's [B, N, d] layout (no leading dims) and two leading dims
        Shapes((), 3, 3, 97, 97, 8, 8),
        # one key: P = 1 and dS = 0 exactly in plain math
        Shapes((2, 2), 2, 1, 7, 1, 8, 8),
    ]
    dtypes = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
    grid = [
        Case(layout, dtype, mask) for dtype in dtypes for mask in MASK_KINDS for layout in layouts
    ]
    return grid + _feature_cases(layouts[0], layouts[1]) + long_cases()


def long_cases() -> list[Case]:
    """16-bit cases long enough to span several tiles of any tiled kernel.

    Nq = 256, Nk = 300 (GQA 2:1, d = 64): a 16-bit bug shows at the sizes
    16-bit kernels run at (a gradient 5% off, lost in the small cases' few
    elements, fails here), and a kernel with tiles of 64 or 128 -- and
    attngrad's flash, whose default key tile is 256 -- merges several.
    """
    long = Shapes((1,), 2, 1, 256, 300, 64, 64)
    return [Case(long, torch.bfloat16, "causal"), Case(long, torch.float16, "float")]


def _feature_cases(square: Shapes, wide: Shapes) -> list[Case]:
    """Attention beyond SDPA's options, each on its own, in float64 and float32, then all in bfloat16.

    square: Nq = Nk; wide: GQA with Nq < Nk.  Dropout at p = 0.2 (and p = 1:
    all zeros) checks that every strategy draws the reference's one mask.
    Bottom-right alignment with Nq > Nk leaves the first Nq - Nk rows dead;
    the packed cases have an empty key segment (its queries attend nothing).
    """
    tall = Shapes((2,), 2, 2, 29, 13, 16, 16)
    packed = Shapes((1,), 2, 2, 33, 47, 16, 16)
    f64, f32 = torch.float64, torch.float32
    both = [
        Case(square, mask="float", dropout=0.2),
        Case(square, mask="float", softcap=1.5),
        Case(square, mask="bool", sinks="token"),  # with make_inputs' dead row
        Case(tall, mask="causal", align="bottom-right"),
    ]
    return [
        *(replace(c, dtype=dtype) for dtype in (f64, f32) for c in both),
        Case(wide, f64, "causal", dropout=1.0),
        Case(wide, f64, sinks="head"),
        Case(wide, f64, "causal", align="bottom-right"),
        Case(wide, f64, window=(8, 2), align="bottom-right"),
        Case(packed, f64, "causal", align="bottom-right", segments=((10, 7, 16), (20, 0, 27))),
        # and an empty query segment: keys 9-15 are attended by no query
        Case(replace(packed, seq_k=33), f32, "causal", segments=((12, 0, 9, 12), (9, 7, 0, 17))),
        # everything at once: causal as the window (None, 0), beside a float mask
        Case(
            wide, torch.bfloat16, "float", window=(None, 0), align="bottom-right",
            softcap=1.5, sinks="head", dropout=0.2,
        ),
    ]  # fmt: skip


def flex_cases() -> list[Case]:
    """FlexAttention's grid: each scenario of `attngrad.verify.flex_cases` in every dtype.

    The masks and ALiBi run on a square layout whose 61 positions end in a
    padded block; the score functions without a mask and prefix-LM on GQA with
    Nq < Nk and dv != d (softcap's and the table's h is the query head).
    """
    square = Shapes((2,), 2, 2, 61, 61, 16, 16)
    wide = Shapes((1,), 4, 2, 37, 53, 16, 24)
    layouts = {"softcap": wide, "relative": wide, "prefix": wide}
    dtypes = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
    return [Case(layouts.get(name, square), dtype, flex=name) for dtype in dtypes for name in GRID]


def default_mask_shape(case: Case) -> tuple[int, ...]:
    """ "bool": shared across heads [*lead, 1, Nq, Nk]; "float": shared across the batch."""
    sh = case.shapes
    if case.mask == "bool":
        return (*sh.lead, 1, sh.seq_q, sh.seq_k)
    return (sh.heads_q, sh.seq_q, sh.seq_k)


def make_inputs(case: Case, seed: int = 0, dead_row: bool = True) -> Inputs:
    """float64 q, k, v, mask, sinks and an upstream gradient dout for the case, from ``seed``
    (and theta, for a flex case: `attngrad.verify.flex_cases.draw_theta`).

    Every dtype sees the same numbers (cast later).  A bool mask keeps about
    70% of the scores; a float mask is standard normal.  ``dead_row``: query
    row 1 of a bool mask attends nothing (-inf everywhere in a float mask is
    left to the tests that want it).  Sinks ([Hq] per head, [*lead, Hq, Nq]
    per token; None without) are normal around log Nk, so a sink takes
    about half of each row.
    """
    gen = torch.Generator().manual_seed(seed)
    sh = case.shapes

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    inputs: Inputs = {
        "q": randn(*sh.lead, sh.heads_q, sh.seq_q, sh.head_dim),
        "k": randn(*sh.lead, sh.heads_kv, sh.seq_k, sh.head_dim),
        "v": randn(*sh.lead, sh.heads_kv, sh.seq_k, sh.value_dim),
        "mask": None,
        "dout": randn(*sh.lead, sh.heads_q, sh.seq_q, sh.value_dim),
    }
    shape = case.mask_shape or default_mask_shape(case)
    if case.mask == "bool":
        keep = torch.rand(*shape, generator=gen, dtype=torch.float64) > 0.3
        if dead_row and len(shape) >= 2 and shape[-2] > 1:
            keep[..., 1, :] = False
        inputs["mask"] = keep
    elif case.mask == "float":
        inputs["mask"] = randn(*shape)
    sinks = {"none": None, "head": (sh.heads_q,), "token": (*sh.lead, sh.heads_q, sh.seq_q)}
    sink_shape = sinks[case.sinks]
    inputs["sinks"] = None if sink_shape is None else randn(*sink_shape) + math.log(sh.seq_k)
    if case.flex is not None:
        inputs["theta"] = draw_theta(case.flex, sh, gen)
    return inputs


def input_tensor(inputs: Inputs, name: str) -> torch.Tensor:
    """inputs[name], one that every case has (q, k, v, dout)."""
    t = inputs[name]
    assert t is not None
    return t


def received(
    inputs: Inputs, dtype: torch.dtype, dtypes: Mapping[str, torch.dtype] | None = None
) -> Inputs:
    """The inputs as an implementation in ``dtype`` receives them, in float64: each floating
    tensor rounded to ``dtype`` (those named in ``dtypes`` to theirs, `Case.input_dtypes`)
    and back (a bool mask and None as they are).

    What the float64 reference is taken on (`attngrad.verify.rule`), so it
    answers for the numbers the implementation was given ("received inputs"
    in the glossary, docs/glossary.md).  New tensors; the
    caller's are left alone.
    """
    dtypes = dtypes or {}
    return {
        name: t
        if t is None or not t.is_floating_point()
        else t.detach().to(dtypes.get(name, dtype)).double()
        for name, t in inputs.items()
    }


def make_leaves(
    inputs: Inputs,
    dtype: torch.dtype = torch.float64,
    mask_grad: bool = True,
    theta_grad: bool = True,
    dtypes: Mapping[str, torch.dtype] | None = None,
) -> dict[str, torch.Tensor]:
    """Fresh leaves in ``dtype`` (those named in ``dtypes`` in theirs, `Case.input_dtypes`) of
    what attention is differentiated in: q, k, v, a float mask, sinks, a flex case's theta.

    ``mask_grad`` False leaves a float mask out (a function that gives no dmask),
    ``theta_grad`` False theta (one that gives no dtheta).
    """
    dtypes = dtypes or {}
    names = ["q", "k", "v"]
    mask = inputs["mask"]
    if mask_grad and mask is not None and mask.dtype != torch.bool:
        names.append("mask")
    if inputs.get("sinks") is not None:
        names.append("sinks")
    if theta_grad and inputs.get("theta") is not None:
        names.append("theta")
    return {
        n: input_tensor(inputs, n).detach().to(dtypes.get(n, dtype)).clone().requires_grad_()
        for n in names
    }


def call_sdpa(
    fn: AttentionFn, case: Case, inputs: Inputs, x: Mapping[str, torch.Tensor]
) -> torch.Tensor:
    """``fn`` SDPA-style on x's q, k, v, mask and sinks (a bool mask, not differentiable, from inputs).

    The case's keywords are made afresh (a dropout case's generator with them).
    """
    mask = x.get("mask", inputs["mask"])
    sinks = {"sinks": x["sinks"]} if "sinks" in x else {}
    return fn(x["q"], x["k"], x["v"], mask, **sinks, **case.kwargs)


def call_flex(
    fn: AttentionFn, case: Case, inputs: Inputs, x: Mapping[str, torch.Tensor], **options: object
) -> torch.Tensor:
    """``fn`` flex_attention-style on x's q, k, v: ``fn(q, k, v, score_mod=..., block_mask=...,
    **case.kwargs, **options)``, the score function reading x's theta (else the inputs')."""
    s = scenario(case.flex or "")
    theta = x.get("theta", inputs.get("theta"))
    score_mod = None if s.score is None else s.score(theta)
    blocks = block_mask(s.name, case.shapes.seq_q, case.shapes.seq_k)
    return fn(
        x["q"], x["k"], x["v"], score_mod=score_mod, block_mask=blocks, **case.kwargs, **options
    )


def call_case(
    fn: AttentionFn, case: Case, inputs: Inputs, x: Mapping[str, torch.Tensor]
) -> torch.Tensor:
    """``fn`` on the case: flex_attention-style for a flex case (`call_flex`), else SDPA-style
    (`call_sdpa`)."""
    if case.flex is not None:
        return call_flex(fn, case, inputs, x)
    return call_sdpa(fn, case, inputs, x)


def call_with(
    fn: AttentionFn, case: Case, inputs: Inputs, names: Sequence[str]
) -> Callable[..., torch.Tensor]:
    """``fn`` on the case (`call_case`) as a function of the tensors ``names``, in that order.

    What ``gradcheck``, ``gradgradcheck`` and ``torch.func.jvp`` call: names
    are keys of `make_leaves`; the rest of the call comes from ``inputs``.
    """

    def call(*x: torch.Tensor) -> torch.Tensor:
        return call_case(fn, case, inputs, dict(zip(names, x, strict=True)))

    return call


def outputs_and_grads(
    fn: AttentionFn, case: Case, inputs: Inputs, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Run ``fn`` on the case (`call_case`) on fresh leaves cast to ``dtype``: out and every gradient.

    A float mask, sinks and theta are leaves too (their gradients are "dmask",
    "dsinks" and "dtheta").  Results keep ``fn``'s dtype and are detached.
    """
    leaves = make_leaves(inputs, dtype, dtypes=case.input_dtypes(dtype))
    out = call_case(fn, case, inputs, leaves)
    grads = torch.autograd.grad(out, list(leaves.values()), input_tensor(inputs, "dout").to(dtype))
    return {"out": out.detach(), **{"d" + n: g for n, g in zip(leaves, grads, strict=True)}}


def dropout_mask(
    query: torch.Tensor, key: torch.Tensor, dropout_p: float, generator: torch.Generator | None
) -> torch.Tensor:
    """The keep mask Z `attention` draws from ``generator``: bool [*lead, Hq, Nq, Nk].

    query: [*lead, Hq, Nq, d], key: [*lead, Hkv, Nk, d]; the same (seed,
    offset) draw and hash as attention's (`attngrad.core.dropout`).
    """
    *lead, heads, seq_q, _ = query.shape
    drop = Dropout(float(dropout_p), *draw_seed(query.device, generator))
    z = keep_mask(drop, math.prod(lead), heads, seq_q, key.shape[-2], query.device)
    return z.reshape(*lead, heads, seq_q, key.shape[-2])


def reference_keywords(
    query: torch.Tensor, key: torch.Tensor, kwargs: Mapping[str, object]
) -> dict[str, object]:
    """`attention`'s keywords as the reference functions take them: ``generator`` becomes
    the keep mask attention draws from it (``dropout_mask``)."""
    kw = dict(kwargs)
    generator = cast("torch.Generator | None", kw.pop("generator", None))
    dropout_p = cast(float, kw.get("dropout_p", 0.0))
    if dropout_p > 0:
        kw["dropout_mask"] = dropout_mask(query, key, dropout_p, generator)
    return kw


def as_attention(reference: AttentionFn) -> AttentionFn:
    """A function of `attngrad.verify.reference` called like `attention`: with ``dropout_p`` it
    applies the keep mask attention draws from ``generator`` (`dropout_mask`)."""

    def fn(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        **kwargs: object,
    ) -> torch.Tensor:
        return reference(query, key, value, attn_mask, **reference_keywords(query, key, kwargs))

    return fn
