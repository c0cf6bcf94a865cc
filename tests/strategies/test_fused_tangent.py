"""Forward mode in fused's C++ kernels (``csrc/tangent.h``): O' and lse' against float64.

Two kernels: the one-pass ``forward_tangent`` (O and O' together, where the tangents are
known before the call: torch.func.jvp, jacfwd, forward_ad dual levels) and the tangent
pass after autograd's forward (``tangent``, where they are not); the case table runs
through both (``path``), each with the other made to raise.  Both take a score function
that is relative (learnable ALiBi, a relative table: its term D and its tangent D' along
the diagonals, the captured tensor moving) or a softcap written as one.

Every test but the fallback's runs with the shared tiled pass
(`attngrad.autograd.tangent.tiled_tangent`) made to raise, so each answer here is the
kernel's.  float64 agrees with torch.func.jvp through the reference to 1e-9 with every
keyword; float32 and bfloat16 pass the error rule (`attngrad.verify.rule`) with a floor
derived for the tangent below (`_floors`); each tangent's term is checked on its own, so a
term the kernel dropped shows; results are bitwise the same for any thread count.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

import attngrad
from attngrad.autograd import tangent
from attngrad.core.dropout import Dropout, draw_seed, keep_mask
from attngrad.strategies.fused import build
from attngrad.strategies.fused.strategy import Fused
from attngrad.verify.derivatives import relative_error
from attngrad.verify.reference import plain_attention, reference_attention, reference_lse
from attngrad.verify.rule import judge, rounding_floor

TILES = {"block_q": 16, "block_k": 24}  # several tiles each way at these sizes
TOL64 = 1e-9


@pytest.fixture(scope="module", autouse=True)
def _library() -> None:
    build.load()


def refuse(monkeypatch: pytest.MonkeyPatch, owner: object, name: str, what: str) -> None:
    """``owner.name`` raises AssertionError saying ``what`` ran: a test that must not reach it."""

    def refused(*args: object) -> None:
        raise AssertionError(f"{what} ran")

    monkeypatch.setattr(owner, name, refused)


@pytest.fixture
def kernel_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The shared tiled pass raises: forward mode must take fused's kernel."""
    refuse(monkeypatch, tangent, "tiled_tangent", "the shared tiled tangent pass, not the kernel,")


@pytest.fixture
def one_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """The two-pass kernel raises: forward mode must take the one-pass kernel."""
    refuse(monkeypatch, Fused, "tangent", "the two-pass tangent kernel, not the one pass,")


@pytest.fixture(params=["one-pass", "two-pass"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each kernel in turn, the other one raising."""
    if request.param == "one-pass":
        request.getfixturevalue("one_pass")
    else:
        refuse(monkeypatch, Fused, "forward_tangent", "the one-pass kernel, not the two passes,")
        monkeypatch.setattr(Fused, "one_pass_tangent", lambda self, problem, tangents: False)
    return str(request.param)


@contextmanager
def threads(n: int):  # type: ignore[no-untyped-def]
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclass
class Call:
    """One call: its tensors (``primals``, each with a tangent; ``fixed``: a bool mask),
    fused's (O, lse) and the reference's from them (with ``options``, its keywords), and a
    dense keep of its scores (band included) for the floors."""

    primals: dict[str, torch.Tensor]
    fused: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    reference: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    keep: torch.Tensor | None = None  # the floors' mask, [Nq, Nk] or like the scores
    fixed: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)  # the reference's keywords


def _sdpa_call(shape: tuple[int, ...], mask: str | None = None, **kw: Any) -> Callable[..., Call]:
    """A `Call` builder over attngrad.attention: shape (B, Hq, Hkv, Nq, Nk, d, dv), the
    mask "float" (with a tangent), "broadcast" ([Nq, Nk], with a tangent), "bool" (a dead
    row), "padding" (a bias at finfo.min on the last keys of batch 0) or None; ``kw``: the
    call's keywords ("sinks" gets a tangent)."""
    b, hq, hkv, nq, nk, d, dv = shape

    def build_call(dtype: torch.dtype, seed: int = 0) -> Call:
        g = torch.Generator().manual_seed(seed)
        x = {
            "q": torch.randn(b, hq, nq, d, generator=g, dtype=torch.float64),
            "k": torch.randn(b, hkv, nk, d, generator=g, dtype=torch.float64),
            "v": torch.randn(b, hkv, nk, dv, generator=g, dtype=torch.float64),
        }
        fixed: dict[str, Any] = {}
        if mask in ("float", "broadcast"):
            size = (1, hq, nq, nk) if mask == "float" else (nq, nk)
            x["mask"] = torch.randn(size, generator=g, dtype=torch.float64)
        elif mask == "padding":
            pad = torch.zeros(b, 1, 1, nk, dtype=torch.float64)
            pad[0, ..., nk - 5 :] = torch.finfo(dtype).min
            x["mask"] = pad
        elif mask == "bool":
            keep = torch.rand(b, hq, nq, nk, generator=g) > 0.3
            keep[:, :, 3] = False  # rows that attend nothing
            fixed["mask"] = keep
        options = dict(kw)
        if "sinks" in options:
            x["sinks"] = options.pop("sinks") * torch.randn(hq, generator=g, dtype=torch.float64)
        x = {n: t.to(dtype).double() for n, t in x.items()}  # rounded as the kernel receives
        if mask == "padding":  # finfo.min of the dtype, not its rounding
            x["mask"] = x["mask"].clamp(min=torch.finfo(dtype).min)
        gqa = {"enable_gqa": hq != hkv}
        dropout = options.pop("dropout_p", 0.0)
        z = None
        if dropout:
            drop = Dropout(
                dropout, *draw_seed(torch.device("cpu"), torch.Generator().manual_seed(7))
            )
            z = keep_mask(drop, b, hq, nq, nk, torch.device("cpu"))

        def fused(**t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            t = {n: a.to(dtype) if n != "mask" or mask != "padding" else a for n, a in t.items()}
            extra = {"generator": torch.Generator().manual_seed(7)} if dropout else {}
            out, lse = attngrad.attention(
                t["q"], t["k"], t["v"], attn_mask=t.get("mask", fixed.get("mask")),
                sinks=t.get("sinks"), dropout_p=dropout, return_lse=True, strategy="fused",
                **TILES, **gqa, **options, **extra,
            )  # fmt: skip
            return out, lse

        def reference(**t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            m = t.get("mask", fixed.get("mask"))
            out = reference_attention(
                t["q"], t["k"], t["v"], m, sinks=t.get("sinks"), dropout_mask=z,
                dropout_p=dropout, **gqa, **options,
            )  # fmt: skip
            return out, reference_lse(t["q"], t["k"], m, sinks=t.get("sinks"), **gqa, **options)

        keep = fixed.get("mask")
        if options.get("is_causal"):  # the band as the floors read it
            keep = torch.ones(nq, nk, dtype=torch.bool).tril()
        return Call(x, fused, reference, keep, fixed, {**gqa, **options})

    return build_call


def _causal(b: torch.Tensor, h: torch.Tensor, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
    return i >= j


def _dilated(b: torch.Tensor, h: torch.Tensor, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
    return (j % 3 == 0) & (i >= j)


def _flex_call(mask_mod: Callable[..., torch.Tensor]) -> Callable[..., Call]:
    """A `Call` builder over attngrad.flex_attention with a BlockMask of ``mask_mod``
    (B=2, H=2, N=80, blocks of 16: a band for causal, a mask program for dilated)."""
    b, h, n, d = 2, 2, 80, 16

    def build_call(dtype: torch.dtype, seed: int = 0) -> Call:
        g = torch.Generator().manual_seed(seed)
        x = {name: torch.randn(b, h, n, d, generator=g).to(dtype).double() for name in "qkv"}
        blocks = create_block_mask(mask_mod, None, None, n, n, "cpu", BLOCK_SIZE=16)
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        keep = mask_mod(torch.tensor(0), torch.tensor(0), i, j)

        def fused(**t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            q, k, v = (t[n_].to(dtype) for n_ in "qkv")
            out, lse = attngrad.flex_attention(
                q, k, v, block_mask=blocks, return_lse=True, strategy="fused"
            )
            return out, lse

        def reference(**t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return (
                reference_attention(t["q"], t["k"], t["v"], keep),
                reference_lse(t["q"], t["k"], keep),
            )

        return Call(x, fused, reference, keep, {"mask": keep})

    return build_call


def _scored_call(kind: str) -> Callable[..., Call]:
    """A `Call` builder over attngrad.flex_attention with a causal BlockMask and a score
    function the kernels take: "alibi" (learnable slopes [H], s - slopes[h] (i - j)),
    "relative-table" (a learnable table [H, 2N - 1] read at i - j + N - 1), both relative,
    their captured tensor a primal with its tangent ("theta"), "softcap" (2 tanh(s / 2),
    the kernels' softcap) or "program" (s + gate[h] tanh(s), a fixed gate: a program whose
    slope 1 + gate (1 - tanh^2) varies score by score).  B=1, H=3, N=300: several of fused's default 128 x 256 tiles each
    way (flex_attention takes no tile sizes), so the one pass rescales with D added."""
    b, h, n, d = 1, 3, 300, 8
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    keep = i >= j

    def term(theta: torch.Tensor) -> torch.Tensor:  # [H, N, N], what the function adds
        if kind == "alibi":
            return -theta[:, None, None] * (i - j)
        return theta[:, i - j + n - 1]

    gate = torch.linspace(-1.0, 2.0, h, dtype=torch.float64)

    def build_call(dtype: torch.dtype, seed: int = 0) -> Call:
        g = torch.Generator().manual_seed(seed)
        x = {name: torch.randn(b, h, n, d, generator=g).to(dtype).double() for name in "qkv"}
        if kind == "alibi":
            x["theta"] = torch.rand(h, generator=g).to(dtype).double()
        elif kind == "relative-table":
            x["theta"] = torch.randn(h, 2 * n - 1, generator=g).to(dtype).double()
        blocks = create_block_mask(_causal, None, None, n, n, "cpu")

        def fused(**t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            q, k, v = (t[n_].to(dtype) for n_ in "qkv")
            theta = t.get("theta", torch.zeros(())).to(dtype)
            gate_c = gate.to(dtype)

            def score(s, b_, h_, i_, j_):  # type: ignore[no-untyped-def]
                if kind == "alibi":
                    return s - theta[h_] * (i_ - j_)
                if kind == "relative-table":
                    return s + theta[h_, i_ - j_ + n - 1]
                if kind == "program":
                    return s + gate_c[h_] * torch.tanh(s)
                return 2.0 * torch.tanh(s / 2.0)

            out, lse = attngrad.flex_attention(
                q, k, v, score_mod=score, block_mask=blocks, return_lse=True, strategy="fused"
            )
            return out, lse

        def reference(**t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            if kind == "program":
                scores = t["q"] @ t["k"].transpose(-2, -1) * d**-0.5
                scores = scores + gate[:, None, None] * torch.tanh(scores)
                scores = scores.masked_fill(~keep, float("-inf"))
                return torch.softmax(scores, dim=-1) @ t["v"], torch.logsumexp(scores, dim=-1)
            if kind == "softcap":
                return (
                    reference_attention(t["q"], t["k"], t["v"], keep, softcap=2.0),
                    reference_lse(t["q"], t["k"], keep, softcap=2.0),
                )
            bias = term(t["theta"]).masked_fill(~keep, float("-inf"))
            return reference_attention(t["q"], t["k"], t["v"], bias), reference_lse(
                t["q"], t["k"], bias
            )

        return Call(x, fused, reference, keep, {"mask": keep})

    return build_call


SHAPE = (2, 3, 3, 37, 45, 16, 12)
CASES: dict[str, Callable[..., Call]] = {
    "plain": _sdpa_call(SHAPE),
    "bias": _sdpa_call(SHAPE, "float"),
    "bias-broadcast": _sdpa_call(SHAPE, "broadcast"),
    "bool-dead-row": _sdpa_call(SHAPE, "bool"),
    "padding": _sdpa_call(SHAPE, "padding"),
    "causal": _sdpa_call(SHAPE, is_causal=True),
    "window": _sdpa_call(SHAPE, "float", window=(6, 3)),
    "gqa-causal": _sdpa_call((2, 4, 2, 37, 45, 16, 12), is_causal=True),
    "dropout": _sdpa_call(SHAPE, "float", dropout_p=0.3),
    "softcap": _sdpa_call(SHAPE, "float", softcap=2.0),
    "sinks": _sdpa_call(SHAPE, window=(None, 0), sinks=1.0),
    "blockmask-causal": _flex_call(_causal),
    "blockmask-dilated": _flex_call(_dilated),
    # score functions the kernels take (the one pass too), the captured tensors moving
    "flex-alibi": _scored_call("alibi"),
    "flex-relative-table": _scored_call("relative-table"),
    "flex-softcap": _scored_call("softcap"),
    "flex-program": _scored_call("program"),
}


def _tangents(call: Call, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        n: torch.randn(t.shape, generator=g, dtype=torch.float64) for n, t in call.primals.items()
    }


def _jvp(
    fn: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    primals: dict[str, torch.Tensor],
    tangents: dict[str, torch.Tensor],
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(O', lse') of fn along ``tangents`` (inputs cast to ``dtype`` first, when given)."""
    names = list(primals)
    cast = (lambda t: t) if dtype is None else (lambda t: t.to(dtype))

    def call(*xs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return fn(**dict(zip(names, xs, strict=True)))

    args = tuple(cast(primals[n]) for n in names)
    dirs = tuple(cast(tangents[n]) for n in names)
    _, (d_out, d_lse) = torch.func.jvp(call, args, dirs)
    return d_out, d_lse


def _check64(call: Call, tangents: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's (O', lse') in float64 against the reference's, within 1e-9; lse' is 0 on
    rows that attend nothing (the reference's is NaN there)."""
    d_out, d_lse = _jvp(call.fused, call.primals, tangents)
    r_out, r_lse = _jvp(call.reference, call.primals, tangents)
    assert relative_error({"out": d_out}, {"out": r_out}) <= TOL64
    live = torch.isfinite(call.reference(**call.primals)[1])
    assert relative_error({"lse": d_lse[live]}, {"lse": r_lse[live]}) <= TOL64
    assert not d_lse[~live].any() and torch.isfinite(d_out).all()
    return d_out, d_lse


@pytest.mark.usefixtures("kernel_only", "path")
@pytest.mark.parametrize("name", list(CASES))
def test_float64_matches_the_reference(name: str) -> None:
    call = CASES[name](torch.float64)
    _check64(call, _tangents(call))


@pytest.mark.usefixtures("kernel_only", "path")
@pytest.mark.parametrize(
    "name", ["softcap", "gqa-causal", "dropout", "blockmask-dilated", "flex-relative-table"]
)
def test_each_tangent_is_its_own_term(name: str) -> None:
    # one input moves at a time: each of the kernel's terms (q' k^T, q k'^T, P v', bias',
    # sinks', a relative term's D') is checked alone against the reference, and moves the
    # answer
    call = CASES[name](torch.float64)
    full = _tangents(call)
    for moved in full:
        alone = {n: t if n == moved else torch.zeros_like(t) for n, t in full.items()}
        d_out, d_lse = _check64(call, alone)
        assert d_out.abs().max() > 1e-3 or d_lse.abs().max() > 1e-3, moved


@pytest.mark.usefixtures("kernel_only")
def test_none_tangents_and_non_contiguous_inputs() -> None:
    # q, k, v, their tangents and the bias as transposed views; torch.func.jvp over q and v
    # only (k' and bias' None), then over the bias only
    g = torch.Generator().manual_seed(3)
    q, k, v, tq, tv = (torch.randn(2, 41, 3, 16, generator=g, dtype=torch.float64).transpose(1, 2)
                       for _ in range(5))  # fmt: skip
    bias = torch.randn(2, 3, 41, 41, generator=g, dtype=torch.float64).transpose(-2, -1)
    tb = torch.randn(2, 3, 41, 41, generator=g, dtype=torch.float64).transpose(-2, -1)
    assert not q.is_contiguous() and not bias.is_contiguous()

    def ours(q: torch.Tensor, v: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = attngrad.attention(q, k, v, attn_mask=m, strategy="fused", **TILES)
        return out

    def ref(q: torch.Tensor, v: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        return reference_attention(q, k, v, m)

    for fn_ours, fn_ref, primals, dirs in (
        (lambda q, v: ours(q, v, bias), lambda q, v: ref(q, v, bias), (q, v), (tq, tv)),
        (lambda m: ours(q, v, m), lambda m: ref(q, v, m), (bias,), (tb,)),
    ):
        got = torch.func.jvp(fn_ours, primals, dirs)[1]
        want = torch.func.jvp(fn_ref, primals, dirs)[1]
        assert relative_error({"out": got}, {"out": want}) <= TOL64


def _floors(
    call: Call, tangents: dict[str, torch.Tensor], dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    """The rule's floors of O' and lse' (`attngrad.verify.rule.rounding_floor`), derived for
    O' = (P o S') v + P v' - mu O, mu = rowsum(P o S') = lse', in float64 from the call's
    inputs (no dropout, softcap or sinks here):

    * sums (A): (P o |S'|)|v| + P |v'| + |mu| |O|, and S' itself, a 2d-term sum of
      C_S' = s (|q'||k|^T + |q||k'|^T) + |bias'|, through P: (P o C_S')|v| + rowsum(P o C_S')|O|;
      lse': rowsum(P o |S'|) + rowsum(P o C_S');
    * the scores' rounding (C): a move of every score by e C_S (C_S = s |q||k|^T + |bias|)
      moves P by at most P o (C_S + rowsum(P o C_S)) per unit e: O' by that times
      (|S'| |v| + |v'| + |mu| |O|), and by rowsum(P o C_S o |S'|) |O| through mu;
    * O as stored in the dtype and read back (R): |mu| |O|.
    """
    x, t = call.primals, tangents
    q, k, v = x["q"], x["k"], x["v"]
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    tk, tv = t["k"].repeat_interleave(g, 1), t["v"].repeat_interleave(g, 1)
    s = q.shape[-1] ** -0.5
    bias = x.get("mask", torch.zeros(()))
    tb = t.get("mask", torch.zeros(()))
    scores = s * q @ k.transpose(-2, -1) + bias
    keep = torch.ones_like(scores, dtype=torch.bool) if call.keep is None else call.keep
    p = torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1).nan_to_num()
    sd = (s * (t["q"] @ k.transpose(-2, -1) + q @ tk.transpose(-2, -1)) + tb).abs()
    cs = s * q.abs() @ k.abs().transpose(-2, -1) + bias.abs()
    csd = s * (t["q"].abs() @ k.abs().transpose(-2, -1) + q.abs() @ tk.abs().transpose(-2, -1))
    csd = csd + tb.abs()
    o = (p @ v).abs()
    mu = (p * sd).sum(-1, keepdim=True)
    row = lambda a: a.sum(-1, keepdim=True)  # noqa: E731
    a_out = (p * sd) @ v.abs() + p @ tv.abs() + mu * o + (p * csd) @ v.abs() + row(p * csd) * o
    moved = p * (cs + row(p * cs))  # P's move per unit e
    c_out = (moved * sd) @ v.abs() + moved @ tv.abs() + row(moved) * mu * o + row(p * cs * sd) * o
    a_lse, c_lse = row(p * sd) + row(p * csd), row(moved * sd) + row(p * cs * sd)
    n = max(2 * q.shape[-1], v.shape[-1], k.shape[-2])
    d = q.shape[-1]
    return (
        rounding_floor(a_out, c_out, dtype, n, d, readback=mu * o),
        rounding_floor(a_lse, c_lse, dtype, n, d).squeeze(-1),
    )


@pytest.mark.usefixtures("kernel_only", "path")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["plain", "bias", "padding", "gqa-causal", "blockmask-dilated"])
def test_low_precision_passes_the_rule(name: str, dtype: torch.dtype) -> None:
    call = CASES[name](dtype)
    tangents = {n: t.to(dtype).double() for n, t in _tangents(call).items()}
    got = _jvp(call.fused, call.primals, tangents, dtype)
    ref = _jvp(call.reference, call.primals, tangents)
    plain = _jvp(_plain(call), call.primals, tangents, dtype)
    floors = _floors(call, tangents, dtype)
    assert got[0].dtype == dtype and got[1].dtype == torch.float32
    for what, a, r, p, f in zip(("out'", "lse'"), got, ref, plain, floors, strict=True):
        verdict = judge(what, a, r, f, p)
        assert verdict.passed, str(verdict)
        # a tangent 1% off in float32, 5% in bfloat16, fails the same rule
        off = 1.01 if dtype == torch.float32 else 1.05
        assert not judge(what, a.double() * off, r, f, p).passed, what


def _plain(call: Call) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """The plain PyTorch computation of the call in its dtype (the rule's 2x baseline)."""

    def plain(**t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v, m = t["q"], t["k"], t["v"], t.get("mask", call.fixed.get("mask"))
        out = plain_attention(q, k, v, m, **call.options)
        return out, reference_lse(q, k, m, **call.options)

    return plain


@pytest.mark.usefixtures("kernel_only")
def test_gradcheck_with_forward_ad() -> None:
    g = torch.Generator().manual_seed(4)
    x = [torch.randn(*s, generator=g, dtype=torch.float64, requires_grad=True)
         for s in ((1, 2, 5, 3), (1, 1, 6, 3), (1, 1, 6, 2), (1, 2, 5, 6))]  # fmt: skip

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: torch.Tensor) -> Any:
        return attngrad.attention(
            q, k, v, attn_mask=m, enable_gqa=True, softcap=1.5, window=(None, 1),
            return_lse=True, strategy="fused", block_q=2, block_k=4,
        )  # fmt: skip

    assert torch.autograd.gradcheck(fn, x, check_forward_ad=True, check_batched_forward_grad=True)


@pytest.mark.usefixtures("kernel_only", "one_pass")
def test_jacfwd_matches_the_reference() -> None:
    # jacfwd vmaps the tangent: the batch folding happens before the kernel runs
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 6, 4, generator=g, dtype=torch.float64) for _ in range(3))
    bias = torch.randn(2, 6, 6, generator=g, dtype=torch.float64)

    def ours(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        return attngrad.attention(q, k, v, attn_mask=m, strategy="fused", block_q=4, block_k=4)

    got = torch.func.jacfwd(ours, argnums=(0, 1, 2, 3))(q, k, v, bias)
    want = torch.func.jacfwd(reference_attention, argnums=(0, 1, 2, 3))(q, k, v, bias)
    for a, b in zip(got, want, strict=True):
        assert relative_error({"j": a}, {"j": b}) <= TOL64


@pytest.mark.usefixtures("kernel_only", "path")
def test_bitwise_identical_for_any_thread_count() -> None:
    call = CASES["dropout"](torch.float32)
    tangents = _tangents(call)
    with threads(1):
        one = _jvp(call.fused, call.primals, tangents, torch.float32)
    with threads(2):
        two = _jvp(call.fused, call.primals, tangents, torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(one, two, strict=True))


@pytest.mark.usefixtures("kernel_only")
def test_a_relative_score_function_runs_in_the_kernel() -> None:
    # learnable ALiBi with a causal BlockMask: its term's tangent D' joins S' by diagonal
    g = torch.Generator().manual_seed(8)
    q, k, v, tq, tk = (torch.randn(2, 3, 50, 8, generator=g, dtype=torch.float64) for _ in range(5))
    slopes, t_slopes = torch.rand(3, generator=g, dtype=torch.float64), torch.randn(3, generator=g)
    blocks = create_block_mask(_causal, None, None, 50, 50, "cpu", BLOCK_SIZE=16)
    i, j = torch.arange(50)[:, None], torch.arange(50)[None, :]

    def ours(q: torch.Tensor, k: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        def alibi(s, b, h, i, j):  # type: ignore[no-untyped-def]
            return s - m[h] * (i - j)

        out: torch.Tensor = attngrad.flex_attention(
            q, k, v, score_mod=alibi, block_mask=blocks, strategy="fused"
        )
        return out

    def ref(q: torch.Tensor, k: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        bias = (-m[:, None, None] * (i - j)).masked_fill(i < j, float("-inf"))
        return reference_attention(q, k, v, bias)

    for dirs in ((tq, tk, t_slopes.double()), (0 * tq, 0 * tk, t_slopes.double())):
        _, got = torch.func.jvp(ours, (q, k, slopes), dirs)
        _, want = torch.func.jvp(ref, (q, k, slopes), dirs)
        assert relative_error({"out": got}, {"out": want}) <= TOL64 and got.abs().max() > 1e-3


def test_a_score_function_falls_back_to_the_tiled_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[bool] = []
    tiled = tangent.tiled_tangent

    def counted(*args: Any) -> tuple[torch.Tensor, torch.Tensor]:
        ran.append(True)
        return tiled(*args)

    monkeypatch.setattr(tangent, "tiled_tangent", counted)
    g = torch.Generator().manual_seed(6)
    q, k, v, tq = (torch.randn(1, 2, 20, 8, generator=g, dtype=torch.float64) for _ in range(4))
    table, t_table = (torch.randn(2, 20, 20, generator=g, dtype=torch.float64) for _ in range(2))

    def ours(q: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        def score(s, b, h, i, j):  # type: ignore[no-untyped-def]
            return s + table[h, i, j]

        out: torch.Tensor = attngrad.flex_attention(q, k, v, score_mod=score, strategy="fused")
        return out

    _, got = torch.func.jvp(ours, (q, table), (tq, t_table))
    _, want = torch.func.jvp(
        lambda q, m: reference_attention(q, k, v, m), (q, table), (tq, t_table)
    )
    assert ran and relative_error({"out": got}, {"out": want}) <= TOL64


# The one-pass kernel (``csrc/tangent.h``, `forward_tangent_pass`).


@pytest.mark.usefixtures("kernel_only", "one_pass")
@pytest.mark.parametrize("name", list(CASES))
def test_one_pass_primal_is_the_plain_forward_bit_for_bit(name: str) -> None:
    # O and lse from the one pass are forward's own bits (the same products, online_row and
    # finish_row), so backward after a forward-mode call rebuilds forward's P
    call = CASES[name](torch.float32)
    primals = {n: t.float() for n, t in call.primals.items()}
    plain = call.fused(**primals)
    names = list(primals)

    def fn(*xs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return call.fused(**dict(zip(names, xs, strict=True)))

    dirs = tuple(t.float() for t in _tangents(call).values())
    out, _ = torch.func.jvp(fn, tuple(primals.values()), dirs)
    assert all(torch.equal(a, b) for a, b in zip(out, plain, strict=True))


def _small(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g, dtype=torch.float64)
            for s in ((1, 2, 9, 4), (1, 1, 11, 4), (1, 1, 11, 3), (1, 2, 9, 11))]  # fmt: skip


def _ours(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = attngrad.attention(
        q, k, v, attn_mask=m, enable_gqa=True, softcap=1.5, window=(None, 2),
        strategy="fused", block_q=4, block_k=4,
    )  # fmt: skip
    return out


def _theirs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return reference_attention(q, k, v, m, enable_gqa=True, softcap=1.5, window=(None, 2))


@pytest.mark.usefixtures("kernel_only", "one_pass")
def test_one_pass_under_a_dual_level_then_backward() -> None:
    # forward_ad: the dual level's tangents go into the one pass; then backward through the
    # same call (FusedForwardTangentBackward) gives forward's gradients
    x, t = _small(11), _small(12)
    leaves = [a.clone().requires_grad_() for a in x]
    with torch.autograd.forward_ad.dual_level():
        duals = [torch.autograd.forward_ad.make_dual(a, b) for a, b in zip(leaves, t, strict=True)]
        out = _ours(*duals)
        primal, tangent_ = torch.autograd.forward_ad.unpack_dual(out)
        cotangent = torch.randn_like(primal)
        got = torch.autograd.grad(primal, leaves, cotangent)
    _, want_t = torch.func.jvp(_theirs, tuple(x), tuple(t))
    assert relative_error({"t": tangent_}, {"t": want_t}) <= TOL64
    ref = [a.clone().requires_grad_() for a in x]
    want = torch.autograd.grad(_theirs(*ref), ref, cotangent)
    for a, b in zip(got, want, strict=True):
        assert relative_error({"g": a}, {"g": b}) <= TOL64


@pytest.mark.usefixtures("kernel_only")
def test_second_derivatives_around_the_one_pass() -> None:
    # hessian (jacfwd over jacrev: the one pass declines under a grad transform) against
    # the reference; forward over forward (jvp of jvp: two forward levels) is declined too,
    # and takes the two-pass way, which refuses it as before rather than answer wrongly
    x = _small(13)
    x = [x[0][..., :5, :], x[1][..., :6, :], x[2][..., :6, :], x[3][..., :5, :6]]
    x = [a.contiguous() for a in x]

    def loss(f: Callable[..., torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda q: (f(q, *x[1:]) ** 2).sum()

    got = torch.func.jacfwd(torch.func.jacrev(loss(_ours)))(x[0])
    want = torch.func.jacfwd(torch.func.jacrev(loss(_theirs)))(x[0])
    assert relative_error({"h": got}, {"h": want}) <= TOL64
    t1, t2 = _small(14)[0][..., :5, :], _small(15)[0][..., :5, :]

    def inner(f: Callable[..., torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda q: torch.func.jvp(lambda a: f(a, *x[1:]), (q,), (t1,))[1]

    with pytest.raises(NotImplementedError):
        torch.func.jvp(inner(_ours), (x[0],), (t2,))


def test_the_one_pass_runs_where_the_tangents_are_known(monkeypatch: pytest.MonkeyPatch) -> None:
    # counted: torch.func.jvp and a dual level take it, a relative score function's call
    # too (a captured tensor moving alone included) and a program whose captured tensors do
    # not move; a plain call, a program whose captured tensor moves and reverse mode alone
    # do not
    ran: list[bool] = []
    one = Fused.forward_tangent

    def counted(self: Fused, *args: Any) -> Any:
        ran.append(True)
        return one(self, *args)

    monkeypatch.setattr(Fused, "forward_tangent", counted)
    x, t = _small(16), _small(17)
    torch.func.jvp(_ours, tuple(x), tuple(t))
    assert len(ran) == 1
    with torch.autograd.forward_ad.dual_level():
        _ours(*(torch.autograd.forward_ad.make_dual(a, b) for a, b in zip(x, t, strict=True)))
    assert len(ran) == 2
    _ours(*x)
    torch.func.grad(lambda q: _ours(q, *x[1:]).sum())(x[0])

    def scored(q: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = attngrad.flex_attention(
            q, x[1].expand(1, 2, 11, 4), x[2].expand(1, 2, 11, 3),
            score_mod=lambda s, b, h, i, j: s * 0.5, strategy="fused",
        )  # fmt: skip
        return out

    torch.func.jvp(scored, (x[0],), (t[0],))  # a program: its slope from its pullback
    assert len(ran) == 3

    def gated(q: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = attngrad.flex_attention(
            q, x[1].expand(1, 2, 11, 4), x[2].expand(1, 2, 11, 3),
            score_mod=lambda s, b, h, i, j: s * torch.sigmoid(gate[h]), strategy="fused",
        )  # fmt: skip
        return out

    gate = torch.rand(2, dtype=torch.float64)
    torch.func.jvp(gated, (x[0], gate), (t[0], torch.randn_like(gate)))  # its gate moves
    assert len(ran) == 3
    slopes = torch.rand(2, dtype=torch.float64)
    torch.func.jvp(lambda m: _alibi(*x[:3], m), (slopes,), (torch.randn_like(slopes),))
    assert len(ran) == 4


def test_a_wrong_one_pass_tangent_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    # a planted bug, O' 1e-6 off: the float64 check fails
    one = Fused.forward_tangent

    def off(self: Fused, *args: Any) -> Any:
        o, saved, do, dlse = one(self, *args)
        return o, saved, do * (1 + 1e-6), dlse

    monkeypatch.setattr(Fused, "forward_tangent", off)
    call = CASES["plain"](torch.float64)
    with pytest.raises(AssertionError):
        _check64(call, _tangents(call))


# The one pass with a score function the kernels take (relative, or a softcap written as one).


def _alibi(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slopes: torch.Tensor) -> torch.Tensor:
    """Learnable ALiBi (slopes [Hq]) through flex_attention on fused (GQA)."""

    def score(s, b, h, i, j):  # type: ignore[no-untyped-def]
        return s - slopes[h] * (i - j)

    out: torch.Tensor = attngrad.flex_attention(
        q, k, v, score_mod=score, enable_gqa=True, strategy="fused"
    )
    return out


def _alibi_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slopes: torch.Tensor
) -> torch.Tensor:
    i, j = torch.arange(q.shape[-2])[:, None], torch.arange(k.shape[-2])[None, :]
    return reference_attention(q, k, v, -slopes[:, None, None] * (i - j), enable_gqa=True)


@pytest.fixture
def one_pass_calls(monkeypatch: pytest.MonkeyPatch) -> list[set[str]]:
    """The calls of the one-pass op ``forward_tangent``, each as the keywords it was given
    (not None); the op still runs."""
    op = torch.ops.attngrad_fused.forward_tangent
    calls: list[set[str]] = []

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append({n for n, a in kwargs.items() if a is not None})
        return op(*args, **kwargs)

    monkeypatch.setattr(torch.ops.attngrad_fused, "forward_tangent", spy)
    return calls


@pytest.mark.usefixtures("kernel_only", "one_pass")
@pytest.mark.parametrize("name", ["flex-alibi", "flex-relative-table", "flex-softcap"])
def test_a_score_function_the_kernels_take_runs_in_the_one_pass(
    name: str, one_pass_calls: list[set[str]]
) -> None:
    # tangents on q, k, v and the captured tensor, then on the captured tensor alone (q, k,
    # v' None): the one-pass op runs, with D and D' where the function is relative
    call = CASES[name](torch.float64)
    tangents = _tangents(call)
    _check64(call, tangents)
    if "theta" in call.primals:
        x = call.primals

        def fn(theta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return call.fused(**{**x, "theta": theta})

        def ref(theta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return call.reference(**{**x, "theta": theta})

        got = torch.func.jvp(fn, (x["theta"],), (tangents["theta"],))[1]
        want = torch.func.jvp(ref, (x["theta"],), (tangents["theta"],))[1]
        assert relative_error({"out": got[0]}, {"out": want[0]}) <= TOL64
        assert got[0].abs().max() > 1e-3
    terms = {"diagonal", "tdiagonal"} if name != "flex-softcap" else set()
    assert one_pass_calls and all(c & {"diagonal", "tdiagonal"} == terms for c in one_pass_calls)


@pytest.mark.usefixtures("kernel_only", "one_pass")
def test_one_pass_jacfwd_over_the_captured_tensor(one_pass_calls: list[set[str]]) -> None:
    # jacfwd over q and the slopes (their tangents vmapped: the samples run one by one), and
    # vmap over a jvp whose slopes' tangent is shared (the samples folded into the batch)
    q, k, v, _ = _small(18)
    slopes = torch.rand(2, generator=torch.Generator().manual_seed(19), dtype=torch.float64)
    got = torch.func.jacfwd(_alibi, argnums=(0, 3))(q, k, v, slopes)
    want = torch.func.jacfwd(_alibi_reference, argnums=(0, 3))(q, k, v, slopes)
    for a, b in zip(got, want, strict=True):
        assert relative_error({"j": a}, {"j": b}) <= TOL64
    tq = torch.randn(3, *q.shape, dtype=torch.float64)
    t_slopes = torch.randn_like(slopes)

    def along(f: Callable[..., torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda t: torch.func.jvp(lambda a, m: f(a, k, v, m), (q, slopes), (t, t_slopes))[1]

    got_v = torch.vmap(along(_alibi))(tq)
    assert relative_error({"t": got_v}, {"t": torch.vmap(along(_alibi_reference))(tq)}) <= TOL64
    assert one_pass_calls


@pytest.mark.usefixtures("kernel_only", "one_pass")
def test_one_pass_with_a_moving_captured_tensor_then_backward() -> None:
    # a dual level over q, k, v and the slopes: the one pass takes the slopes' tangent as
    # an input of FusedForwardTangent, and backward through it gives every gradient,
    # the slopes' included
    x, t = _small(20)[:3], _small(21)[:3]
    g = torch.Generator().manual_seed(22)
    x.append(torch.rand(2, generator=g, dtype=torch.float64))
    t.append(torch.randn(2, generator=g, dtype=torch.float64))
    leaves = [a.clone().requires_grad_() for a in x]
    with torch.autograd.forward_ad.dual_level():
        duals = [torch.autograd.forward_ad.make_dual(a, b) for a, b in zip(leaves, t, strict=True)]
        out = _alibi(*duals)
        primal, tangent_ = torch.autograd.forward_ad.unpack_dual(out)
        assert type(out.grad_fn).__name__ == "FusedForwardTangentBackward"
        cotangent = torch.randn_like(primal)
        got = torch.autograd.grad(primal, leaves, cotangent)
    _, want_t = torch.func.jvp(_alibi_reference, tuple(x), tuple(t))
    assert relative_error({"t": tangent_}, {"t": want_t}) <= TOL64
    ref = [a.clone().requires_grad_() for a in x]
    want = torch.autograd.grad(_alibi_reference(*ref), ref, cotangent)
    for a, b in zip(got, want, strict=True):
        assert relative_error({"g": a}, {"g": b}) <= TOL64


@pytest.mark.usefixtures("kernel_only", "one_pass")
@pytest.mark.parametrize("dropped", [("tdiagonal",), ("diagonal", "tdiagonal")], ids=["D'", "D"])
def test_a_one_pass_that_drops_the_term_is_caught(
    dropped: tuple[str, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    # planted bugs in the one pass: D' left out (the float64 check of O' fails) or the term
    # itself (O is then not the plain forward's)
    op = torch.ops.attngrad_fused.forward_tangent
    ran: list[bool] = []

    def without(*args: Any, **kwargs: Any) -> Any:
        ran.append(True)
        return op(*args, **{**kwargs, **dict.fromkeys(dropped)})

    monkeypatch.setattr(torch.ops.attngrad_fused, "forward_tangent", without)
    call = CASES["flex-alibi"](torch.float64)
    names, tangents = list(call.primals), _tangents(call)

    def fn(*xs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return call.fused(**dict(zip(names, xs, strict=True)))

    (o, _), (d_out, _) = torch.func.jvp(fn, tuple(call.primals.values()), tuple(tangents.values()))
    r_out = _jvp(call.reference, call.primals, tangents)[0]
    assert ran
    if dropped == ("tdiagonal",):
        assert relative_error({"out": d_out}, {"out": r_out}) > 1e-3
    else:
        assert not torch.equal(o, call.fused(**call.primals)[0])
