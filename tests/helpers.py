"""Shared helpers of the test suite: readable ids, inputs, the SDPA MATH oracle.

Plain functions (not fixtures) because parametrize ids are built at collection
time.  Test modules import them as ``from helpers import ...``; pytest puts
this folder on ``sys.path`` (the default "prepend" import mode).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import attngrad

MASK_KINDS = ("none", "causal", "bool", "float")

# "triton" runs here in Triton's interpreter at about a second per call: the
# large grids (gradcheck, SDPA agreement, windows, properties, the ledger) run
# over the tensor-op strategies, and tests/test_triton.py gives triton the same
# checks on a smaller grid; the other strategy-parametrized tests include it.
TENSOR_STRATEGIES = tuple(s for s in attngrad.STRATEGIES if s != "triton")
GRAD_NAMES = ("dq", "dk", "dv", "dmask")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def shape_id(
    lead: Sequence[int],
    heads_q: int,
    heads_kv: int,
    seq_q: int,
    seq_k: int,
    head_dim: int,
    value_dim: int | None = None,
    *extra: object,
) -> str:
    """A test id built from the shape, e.g. ``B2-H4:2-N7x97-d8-causal``.

    ``B`` lists the leading dims (``Bnone`` for the course chapter's ``[H, N, d]``
    layout); ``H4:2`` is Hq:Hkv (GQA), ``N7x97`` is Nq x Nk, ``d59:24`` is
    head dim : value dim.  Equal pairs are written once.  ``extra`` parts
    (mask kind, dtype...) are appended with dashes.
    """
    batch = "x".join(map(str, lead)) if lead else "none"
    heads = f"{heads_q}" + (f":{heads_kv}" if heads_kv != heads_q else "")
    seq = f"{seq_q}" + (f"x{seq_k}" if seq_k != seq_q else "")
    dv = head_dim if value_dim is None else value_dim
    dims = f"{head_dim}" + (f":{dv}" if dv != head_dim else "")
    parts = [f"B{batch}", f"H{heads}", f"N{seq}", f"d{dims}"]
    for e in extra:
        parts.append(dtype_name(e) if isinstance(e, torch.dtype) else str(e))
    return "-".join(parts)


@dataclass(frozen=True)
class Problem:
    """One attention call's sizes and mask.

    q: [*lead, Hq, Nq, d], k: [*lead, Hkv, Nk, d], v: [*lead, Hkv, Nk, dv].
    ``mask`` is one of MASK_KINDS; ``mask_shape`` is the shape of a bool/float
    mask (anything broadcastable to [*lead, Hq, Nq, Nk]); None means the full
    [Nq, Nk] shape.
    """

    lead: tuple[int, ...]
    heads_q: int
    heads_kv: int
    seq_q: int
    seq_k: int
    head_dim: int
    value_dim: int
    mask: str = "none"
    mask_shape: tuple[int, ...] | None = None
    scale: float | None = None

    @property
    def gqa(self) -> bool:
        return self.heads_q != self.heads_kv

    @property
    def id(self) -> str:
        extra: list[object] = [self.mask]
        if self.mask in ("bool", "float") and self.mask_shape is not None:
            extra[0] = f"{self.mask}[{','.join(map(str, self.mask_shape))}]"
        if self.scale is not None:
            extra.append(f"scale{self.scale}")
        return shape_id(
            self.lead,
            self.heads_q,
            self.heads_kv,
            self.seq_q,
            self.seq_k,
            self.head_dim,
            self.value_dim,
            *extra,
        )

    @property
    def score_shape(self) -> tuple[int, ...]:
        return (*self.lead, self.heads_q, self.seq_q, self.seq_k)


def make_problem_inputs(
    pb: Problem,
    dtype: torch.dtype = torch.float64,
    gen: torch.Generator | None = None,
    dead_row: bool = False,
) -> dict[str, torch.Tensor | None]:
    """Leaf tensors q, k, v, mask (float masks require grad) and an upstream dout.

    Everything is drawn in float64 and then cast, so every dtype sees the same
    numbers.  ``dead_row`` makes query row 1 of the mask attend nothing
    (when the mask has a query-row dim of more than one row).
    """

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=torch.float64)

    q = randn(*pb.lead, pb.heads_q, pb.seq_q, pb.head_dim)
    k = randn(*pb.lead, pb.heads_kv, pb.seq_k, pb.head_dim)
    v = randn(*pb.lead, pb.heads_kv, pb.seq_k, pb.value_dim)
    dout = randn(*pb.lead, pb.heads_q, pb.seq_q, pb.value_dim)
    shape = pb.mask_shape if pb.mask_shape is not None else (pb.seq_q, pb.seq_k)
    mask: torch.Tensor | None = None
    if pb.mask == "bool":
        mask = torch.rand(shape, generator=gen, dtype=torch.float64) > 0.3
        if dead_row and len(shape) >= 2 and shape[-2] > 1:
            mask[..., min(1, shape[-2] - 1), :] = False
    elif pb.mask == "float":
        mask = randn(*shape)
        if dead_row and len(shape) >= 2 and shape[-2] > 1:
            mask[..., min(1, shape[-2] - 1), :] = float("-inf")
    out: dict[str, torch.Tensor | None] = {
        "q": q.to(dtype).requires_grad_(),
        "k": k.to(dtype).requires_grad_(),
        "v": v.to(dtype).requires_grad_(),
        "mask": None,
        "dout": dout.to(dtype),
    }
    if mask is not None:
        out["mask"] = mask if mask.dtype == torch.bool else mask.to(dtype).requires_grad_()
    return out


def sdpa_math(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """PyTorch's own SDPA, pinned to the MATH backend (the float64-exact one)."""
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(
            query,
            key,
            value,
            attn_mask=attn_mask,
            dropout_p=dropout_p,
            is_causal=is_causal,
            scale=scale,
            enable_gqa=enable_gqa,
        )


def strategy_fn(strategy: str) -> Callable[..., torch.Tensor]:
    def fn(*args: object, **kwargs: object) -> torch.Tensor:
        return attngrad.attention(*args, strategy=strategy, **kwargs)  # type: ignore[arg-type]

    return fn


def run_problem(
    fn: Callable[..., torch.Tensor],
    pb: Problem,
    inputs: dict[str, torch.Tensor | None],
    dtype: torch.dtype | None = None,
) -> dict[str, torch.Tensor]:
    """Call ``fn`` SDPA-style on fresh leaves cast to ``dtype``; return out and grads.

    The returned tensors keep ``fn``'s dtype (compare in float64 yourself).
    """
    dtype = dtype or inputs["q"].dtype  # type: ignore[union-attr]
    leaves = {n: inputs[n].detach().to(dtype).requires_grad_() for n in "qkv"}  # type: ignore[union-attr]
    mask = inputs["mask"]
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.detach().to(dtype).requires_grad_()
        leaves["mask"] = mask
    out = fn(
        leaves["q"],
        leaves["k"],
        leaves["v"],
        mask,
        is_causal=pb.mask == "causal",
        scale=pb.scale,
        enable_gqa=pb.gqa,
    )
    grads = torch.autograd.grad(out, list(leaves.values()), inputs["dout"].to(dtype))  # type: ignore[union-attr]
    result = {"out": out.detach()}
    for name, g in zip(leaves, grads, strict=True):
        result["d" + name] = g
    return result


def max_abs_err(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    return float((a.double() - b.double()).abs().max())


def magnitude(t: torch.Tensor) -> float:
    """max(1, max|t|): the scale an absolute tolerance is taken relative to."""
    return max(1.0, float(t.double().abs().max())) if t.numel() else 1.0


def assert_close_f64(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], tol: float = 1e-9):
    """Every entry of ``ref`` (out and gradients) within ``tol`` * magnitude, no NaN."""
    assert got.keys() == ref.keys()
    for name, r in ref.items():
        g = got[name]
        assert g.shape == r.shape, f"{name}: shape {tuple(g.shape)} != {tuple(r.shape)}"
        assert not g.isnan().any(), f"{name} has NaN"
        err = max_abs_err(g, r)
        assert err <= tol * magnitude(r), f"{name}: max abs error {err:.3e} > {tol:g}"


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
