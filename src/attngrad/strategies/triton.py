"""Strategy "triton": the flash algorithm as fused Triton kernels (`attngrad.kernels`).

Same saved tensors as "flash" (q, k, v, O, the row statistics (m, log l),
plus the caller's mask) and
the same tiles skipped under a causal/window band.  Forward is one kernel;
backward is three: Delta = rowsum(O * dO), dK/dV by key block (walking the
query heads of a GQA group, so no atomics and a deterministic sum) and dQ by
query block.  With a float mask that requires grad, the dQ kernel also writes
dS at the scores' shape [B, Hq, Nq, Nk] (float32, or float64), which is then
summed over the dims the mask broadcasts: that one gradient costs O(Nq * Nk)
memory.

Runs on CUDA tensors; on CPU tensors only under TRITON_INTERPRET=1 (Triton's
interpreter, which is how the tests run these kernels).  Triton itself is the
optional extra ``attngrad[gpu]``.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType

import torch
from torch.autograd.function import FunctionCtx

from attngrad.masks import Mask, bias_meta
from attngrad.ops import LOG2E, compute_dtype
from attngrad.strategies.first_order import first_order_only

__all__ = [
    "MAX_HEAD_DIM",
    "TritonAttention",
    "attention",
    "check_head_dims",
    "choose_blocks",
    "tiles_for",
    "unavailable_reason",
]

MAX_HEAD_DIM = 256


def unavailable_reason(device: torch.device) -> str | None:
    """Why strategy "triton" cannot run on ``device`` tensors here, or None when it can."""
    if importlib.util.find_spec("triton") is None:
        return (
            "strategy='triton' needs Triton, which is not installed: "
            "pip install 'attngrad[gpu]' (or pick strategy='flash')."
        )
    if device.type == "cuda" or (device.type == "cpu" and _interpreting()):
        return None
    return (
        f"strategy='triton' runs on CUDA tensors, got {device.type} tensors. "
        "On CPU it runs only in Triton's interpreter: set TRITON_INTERPRET=1 before attngrad "
        "first uses it (slow; meant for tests), or pick strategy='flash'."
    )


def check_head_dims(head_dim: int, value_dim: int) -> None:
    """ValueError unless both head dims fit the kernels (<= MAX_HEAD_DIM)."""
    if max(head_dim, value_dim) > MAX_HEAD_DIM:
        raise ValueError(
            f"strategy='triton' supports head dims up to {MAX_HEAD_DIM}, got "
            f"d={head_dim}, dv={value_dim}; use strategy='flash' for larger heads."
        )


def _interpreting() -> bool:
    """Whether the kernels run in Triton's interpreter (fixed once they are imported)."""
    loaded = sys.modules.get("attngrad.kernels")
    if loaded is not None:
        return bool(loaded.INTERPRETED)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _kernels() -> ModuleType:
    from attngrad import kernels

    return kernels


def _pow2(n: int) -> int:
    """n padded to a power of two, at least 16 (tl.dot's smallest operand side)."""
    return max(16, 1 << max(0, n - 1).bit_length())


def _cdiv(n: int, block: int) -> int:
    """Programs to cover n rows in blocks (at least one, which writes nothing when n = 0)."""
    return max(1, -(-n // block))


# (rows, keys) per tile of each kernel, by the bytes of one head row (d * element size):
# wide row tiles for forward and dQ, wide key tiles for dK/dV, narrower as rows grow so
# that a kernel's q/k/v/dO tiles, double-buffered, fit in ~200 KiB of shared memory.
_TILES = (
    (256, {"forward": (128, 64), "dkdv": (32, 128), "dq": (128, 32)}),  # 16-bit d <= 128
    (512, {"forward": (64, 32), "dkdv": (32, 64), "dq": (64, 32)}),  # 16-bit d <= 256
    (2048, {"forward": (32, 16), "dkdv": (16, 32), "dq": (32, 16)}),  # float64 d <= 256
)


def choose_blocks(
    seq_q: int, seq_k: int, row_bytes: int, block_q: int | None, block_k: int | None
) -> dict[str, tuple[int, int]]:
    """(rows, keys) per tile for each kernel: "forward", "dkdv", "dq".

    ``row_bytes``: d (the larger of the two head dims) times the element size.
    Defaults follow the usual shapes of these kernels on recent NVIDIA GPUs
    (not yet measured here); a given ``block_q`` / ``block_k`` sets every
    kernel's.  Never beyond the padded sequence lengths.
    """
    defaults = next((tiles for limit, tiles in _TILES if row_bytes <= limit), _TILES[-1][1])
    cap_q, cap_k = _pow2(seq_q), _pow2(seq_k)
    return {
        name: (min(block_q or bq, cap_q), min(block_k or bk, cap_k))
        for name, (bq, bk) in defaults.items()
    }


def tiles_for(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_q: int | None = None,
    block_k: int | None = None,
) -> dict[str, tuple[int, int]]:
    """`choose_blocks` for q: [B, Hq, Nq, d], k: [B, Hkv, Nk, d], v: [B, Hkv, Nk, dv]."""
    row_bytes = max(q.shape[-1], v.shape[-1]) * q.element_size()
    return choose_blocks(q.shape[2], k.shape[2], row_bytes, block_q, block_k)


def _mask_args(mask: Mask, shape: tuple[int, int, int, int]) -> tuple[object, ...]:
    """(Bias, Keep, their 8 strides broadcast to the scores' shape [B, Hq, Nq, Nk])."""
    args: list[object] = []
    strides: list[int] = []
    for t in mask.tensors:
        if t is None:
            args.append(None)
            strides += [0, 0, 0, 0]
        else:
            args.append(t)
            strides += list(t.expand(shape).stride())
    return (*args, *strides)


def _scales(scale: float, like: torch.Tensor) -> torch.Tensor:
    """[scale, log2 e] in the accumulation dtype of ``like`` (see kernels)."""
    return torch.tensor([scale, LOG2E], dtype=like.dtype, device=like.device)


def _launch_options(dtype: torch.dtype, head_dim: int) -> dict[str, object]:
    tl = _kernels().tl
    interpreted = _kernels().INTERPRETED
    options: dict[str, object] = {
        "ACC": tl.float64 if dtype == torch.float64 else tl.float32,
        "UPCAST": interpreted and dtype == torch.bfloat16,
        "PRECISION": "ieee",
    }
    if not interpreted:
        row_bytes = head_dim * torch.finfo(dtype).bits // 8
        options["num_warps"] = 4 if head_dim <= 64 else 8
        options["num_stages"] = 3 if row_bytes <= 256 else (2 if row_bytes <= 512 else 1)
    return options


def _problem(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask) -> dict[str, object]:
    hq, nq, d = q.shape[1:]
    hkv, nk, dv = k.shape[1], k.shape[2], v.shape[-1]
    left, right = mask.left, mask.right
    return {
        "heads_q": hq,
        "groups": hq // hkv,
        "nq": nq,
        "nk": nk,
        "d": d,
        "dv": dv,
        "left": 0 if left is None else left,
        "right": 0 if right is None else right,
        "HAS_BIAS": mask.bias is not None,
        "HAS_KEEP": mask.keep is not None,
        "HAS_LEFT": left is not None,
        "HAS_RIGHT": right is not None,
        "BLOCK_D": _pow2(d),
        "BLOCK_DV": _pow2(dv),
    }


def triton_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Mask,
    scale: float,
    blocks: dict[str, tuple[int, int]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """O: [B, Hq, Nq, dv] (input dtype) and stats: [B, Hq, Nq, 2] (m, log l; float32 or float64).

    q: [B, Hq, Nq, d], k: [B, Hkv, Nk, d], v: [B, Hkv, Nk, dv], contiguous.
    """
    b, hq, nq, _ = q.shape
    o = q.new_empty(b, hq, nq, v.shape[-1])
    stats = torch.empty(b, hq, nq, 2, dtype=compute_dtype(q.dtype), device=q.device)
    block_m, block_n = blocks["forward"]
    grid = (b * hq, _cdiv(nq, block_m))
    shape = (b, hq, nq, k.shape[2])
    _kernels().attention_forward[grid](
        q, k, v, o, stats, *_mask_args(mask, shape), _scales(scale, stats),
        **_problem(q, k, v, mask), BLOCK_M=block_m, BLOCK_N=block_n,
        **_launch_options(q.dtype, max(q.shape[-1], v.shape[-1])),
    )  # fmt: skip
    return o, stats


def triton_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    stats: torch.Tensor,
    mask: Mask,
    scale: float,
    blocks: dict[str, tuple[int, int]],
    bias_meta: tuple[torch.Size, torch.dtype] | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """dq, dk, dv (input dtype) and dbias (its dtype, or None).

    dout, o: [B, Hq, Nq, dv]; stats: [B, Hq, Nq, 2]; q, k, v as in `triton_forward`.
    """
    kernels = _kernels()
    b, hq, nq, d = q.shape
    hkv, nk, dv_dim = k.shape[1], k.shape[2], v.shape[-1]
    dout = dout.contiguous()
    problem, options = _problem(q, k, v, mask), _launch_options(q.dtype, max(d, dv_dim))
    shape = (b, hq, nq, nk)
    masks = _mask_args(mask, shape)
    scales = _scales(scale, stats)
    delta = stats.new_empty(b, hq, nq)
    block_m = min(64, _pow2(nq))  # rows x dv elements of O and dO in registers
    kernels.attention_delta[(b * hq, _cdiv(nq, block_m))](
        o, dout, delta, nq, dv_dim,
        BLOCK_M=block_m, BLOCK_DV=problem["BLOCK_DV"], ACC=options["ACC"],
    )  # fmt: skip
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    block_m, block_n = blocks["dkdv"]
    kernels.attention_dkdv[(b * hkv, _cdiv(nk, block_n))](
        q, k, v, dout, stats, delta, dk, dv, *masks, scales,
        **problem, BLOCK_M=block_m, BLOCK_N=block_n, **options,
    )  # fmt: skip
    # dS at the scores' shape, only for a bias gradient; skipped tiles stay zero
    ds = torch.zeros(shape, dtype=stats.dtype, device=q.device) if bias_meta is not None else stats
    block_m, block_n = blocks["dq"]
    kernels.attention_dq[(b * hq, _cdiv(nq, block_m))](
        q, k, v, dout, stats, delta, dq, ds, *masks, scales,
        **problem, BLOCK_M=block_m, BLOCK_N=block_n, **options, STORE_DS=bias_meta is not None,
    )  # fmt: skip
    dbias = None
    if bias_meta is not None:
        dbias = ds.sum_to_size(bias_meta[0]).to(bias_meta[1])
    return dq, dk, dv, dbias


class TritonAttention(torch.autograd.Function):
    """autograd.Function over q: [B, Hq, Nq, d], k: [B, Hkv, Nk, d], v: [B, Hkv, Nk, dv]."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        bias: torch.Tensor | None,
        keep: torch.Tensor | None,
        mask: Mask,
        scale: float,
        blocks: dict[str, tuple[int, int]],
    ) -> torch.Tensor:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        o, stats = triton_forward(q, k, v, mask.with_tensors(bias, keep), scale, blocks)
        ctx.save_for_backward(q, k, v, o, stats, bias, keep)  # type: ignore[arg-type]
        ctx.mask = mask.with_tensors(None, None)
        ctx.scale, ctx.blocks = scale, blocks
        ctx.bias_meta = bias_meta(bias)
        return o

    @staticmethod
    @first_order_only("triton")
    def backward(ctx: FunctionCtx, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, o, stats, bias, keep = ctx.saved_tensors
        mask = ctx.mask.with_tensors(bias, keep)
        meta = ctx.bias_meta if ctx.needs_input_grad[3] else None
        dq, dk, dv, dbias = triton_backward(
            dout, q, k, v, o, stats, mask, ctx.scale, ctx.blocks, meta
        )
        return dq, dk, dv, dbias, None, None, None, None


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Mask,
    scale: float,
    block_q: int | None = None,
    block_k: int | None = None,
) -> torch.Tensor:
    """O: [B, Hq, Nq, dv] for q: [B, Hq, Nq, d], k: [B, Hkv, Nk, d], v: [B, Hkv, Nk, dv]."""
    reason = unavailable_reason(q.device)
    if reason is not None:
        raise RuntimeError(reason)
    check_head_dims(q.shape[-1], v.shape[-1])
    blocks = tiles_for(q, k, v, block_q, block_k)
    return TritonAttention.apply(q, k, v, *mask.tensors, mask, scale, blocks)
