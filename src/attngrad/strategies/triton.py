"""Strategy "triton": the flash algorithm as fused Triton kernels (`attngrad.kernels`).

Same saved tensors as "flash" (q, k, v, O, the row statistics (m, log l),
plus the caller's mask) and the same tiles skipped under the band (causal,
window, alignment, packed segments: `attngrad.band`).  The softcap and
dropout run inside the kernels; dropout's mask is never stored: each kernel
rebuilds its tiles from the hash of `attngrad.dropout`.  Forward is one kernel;
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

from attngrad.contract import Shapes
from attngrad.masks import Mask
from attngrad.ops import LOG2E, compute_dtype
from attngrad.strategies import flash, recompute
from attngrad.strategies.base import AttentionFunction, Grads

__all__ = [
    "KEEPS_MASK",
    "MAX_HEAD_DIM",
    "Function",
    "TritonAttention",
    "backward_into",
    "check_head_dims",
    "choose_blocks",
    "forward",
    "probabilities",
    "saves",
    "tiles",
    "unavailable_reason",
]

KEEPS_MASK = True  # the backward kernels mask each rebuilt tile again
saves = flash.saves  # the same O and stats as flash
probabilities = recompute.probabilities  # P rebuilt from them, for forward mode and second order

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


def tiles(
    shapes: Shapes, dtype: torch.dtype, block_q: int | None, block_k: int | None
) -> dict[str, tuple[int, int]]:
    """`choose_blocks` for the call's sizes; ValueError for head dims the kernels do not take."""
    check_head_dims(shapes.head_dim, shapes.value_dim)
    row_bytes = max(shapes.head_dim, shapes.value_dim) * torch.finfo(dtype).bits // 8
    return choose_blocks(shapes.seq_q, shapes.seq_k, row_bytes, block_q, block_k)


def _mask_args(
    mask: Mask, shape: tuple[int, int, int, int], device: torch.device
) -> dict[str, object]:
    """The kernels' mask arguments by name, for scores of shape [B, Hq, Nq, Nk] on ``device``.

    Bias, Keep and their strides, the band's Lo, Hi, dropout's words and
    threshold, and the HAS_* flags; absent pieces are None pointers.
    """
    band = mask.band
    return {
        **_tensor_args(mask, shape),
        "Lo": None if band is None else band.lo.to(device),
        "Hi": None if band is None else band.hi.to(device),
        **_dropout_args(mask, shape, device),
        "HAS_BIAS": mask.bias is not None,
        "HAS_KEEP": mask.keep is not None,
        "HAS_BAND": band is not None,
        "HAS_SOFTCAP": mask.softcap is not None,
        "HAS_DROPOUT": mask.dropout is not None,
    }


def _tensor_args(mask: Mask, shape: tuple[int, int, int, int]) -> dict[str, object]:
    """Bias and Keep with their strides broadcast to the scores' shape (sbb..sbn, seb..sen)."""
    args: dict[str, object] = {}
    for name, prefix, t in (("Bias", "sb", mask.bias), ("Keep", "se", mask.keep)):
        strides = (0, 0, 0, 0) if t is None else t.expand(shape).stride()
        args[name] = t
        args.update({prefix + dim: n for dim, n in zip("bhmn", strides, strict=True)})
    return args


def _dropout_args(
    mask: Mask, shape: tuple[int, int, int, int], device: torch.device
) -> dict[str, object]:
    """RowWords (int32 [B*Hq, Nq]), ColWords (int32 [Nk]) and the threshold of mask.dropout.

    The words are `attngrad.dropout.Dropout.row_words` / ``col_words`` at the
    block's global positions; the kernels finish the hash per score.
    """
    dropout = mask.dropout
    if dropout is None:
        return {"RowWords": None, "ColWords": None, "threshold": 0}
    b, hq, nq, nk = shape
    return {
        "RowWords": dropout.row_words(b, hq, mask.heads_kv, slice(0, nq), device),
        "ColWords": dropout.col_words(slice(0, nk), device),
        "threshold": dropout.threshold,
    }


def _query_span_args(mask: Mask, device: torch.device) -> dict[str, object]:
    """First, Stop: int64 [Nk], the query rows first <= i < stop that attend each key (dK/dV)."""
    if mask.band is None:
        return {"First": None, "Stop": None}
    first, stop = mask.band.query_span()
    return {"First": first.to(device), "Stop": stop.to(device)}


def _scales(scale: float, mask: Mask, like: torch.Tensor) -> torch.Tensor:
    """[scale, log2 e, softcap c, 1 / (1 - p)] in the accumulation dtype of ``like`` (see kernels).

    c and 1 / (1 - p) are 1 where the mask has no softcap or no dropout (then unread).
    """
    cap = 1.0 if mask.softcap is None else mask.softcap
    keep_scale = 1.0 if mask.dropout is None else mask.dropout.scale
    return torch.tensor([scale, LOG2E, cap, keep_scale], dtype=like.dtype, device=like.device)


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


def _problem(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> dict[str, object]:
    """The kernels' sizes by name, from q: [B, Hq, Nq, d], k: [B, Hkv, Nk, d], v: [.., dv]."""
    hq, nq, d = q.shape[1:]
    hkv, nk, dv = k.shape[1], k.shape[2], v.shape[-1]
    return {
        "heads_q": hq,
        "groups": hq // hkv,
        "nq": nq,
        "nk": nk,
        "d": d,
        "dv": dv,
        "BLOCK_D": _pow2(d),
        "BLOCK_DV": _pow2(dv),
    }


def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Mask,
    scale: float,
    blocks: dict[str, tuple[int, int]],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """O: [B, Hq, Nq, dv] (input dtype) and {"o": O, "stats": [B, Hq, Nq, 2]} (compute dtype).

    q: [B, Hq, Nq, d], k: [B, Hkv, Nk, d], v: [B, Hkv, Nk, dv]; the kernels
    read dense rows, so non-contiguous inputs are copied first.
    """
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    b, hq, nq, _ = q.shape
    o = q.new_empty(b, hq, nq, v.shape[-1])
    stats = torch.empty(b, hq, nq, 2, dtype=compute_dtype(q.dtype), device=q.device)
    block_m, block_n = blocks["forward"]
    grid = (b * hq, _cdiv(nq, block_m))
    shape = (b, hq, nq, k.shape[2])
    _kernels().attention_forward[grid](
        q, k, v, o, stats, **_mask_args(mask, shape, q.device), Scales=_scales(scale, mask, stats),
        **_problem(q, k, v), BLOCK_M=block_m, BLOCK_N=block_n,
        **_launch_options(q.dtype, max(q.shape[-1], v.shape[-1])),
    )  # fmt: skip
    return o, {"o": o, "stats": stats}


def backward_into(
    grads: Grads,
    dout: torch.Tensor,
    dlse: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    saved: dict[str, torch.Tensor],
    mask: Mask,
    scale: float,
    blocks: dict[str, tuple[int, int]],
) -> None:
    """Add dq, dk, dv and dbias into ``grads`` (see `attngrad.strategies.base`).

    dout: [B, Hq, Nq, dv]; saved: `forward`'s O and stats (or ring attention's
    final ones for these rows).  The kernels write whole gradients, which are
    then added into the accumulators.
    """
    q, k, v, o, stats = (t.contiguous() for t in (q, k, v, saved["o"], saved["stats"]))
    kernels = _kernels()
    b, hq, nq, d = q.shape
    hkv, nk, dv_dim = k.shape[1], k.shape[2], v.shape[-1]
    dout = dout.contiguous()
    problem, options = _problem(q, k, v), _launch_options(q.dtype, max(d, dv_dim))
    shape = (b, hq, nq, nk)
    masks = {**_mask_args(mask, shape, q.device), "Scales": _scales(scale, mask, stats)}
    delta = stats.new_empty(b, hq, nq)
    block_m = min(64, _pow2(nq))  # rows x dv elements of O and dO in registers
    kernels.attention_delta[(b * hq, _cdiv(nq, block_m))](
        o, dout, delta, nq, dv_dim,
        BLOCK_M=block_m, BLOCK_DV=problem["BLOCK_DV"], ACC=options["ACC"],
    )  # fmt: skip
    if dlse is not None:  # dS = P * (dP - Delta + dlse): lse's cotangent joins Delta
        delta -= dlse.to(delta.dtype)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    block_m, block_n = blocks["dkdv"]
    kernels.attention_dkdv[(b * hkv, _cdiv(nk, block_n))](
        q, k, v, dout, stats, delta, dk, dv, **masks, **_query_span_args(mask, q.device),
        **problem, BLOCK_M=block_m, BLOCK_N=block_n, **options,
    )  # fmt: skip
    dbias = grads[3]
    # dS at the scores' shape, only for a bias gradient; skipped tiles stay zero
    ds = torch.zeros(shape, dtype=stats.dtype, device=q.device) if dbias is not None else stats
    block_m, block_n = blocks["dq"]
    kernels.attention_dq[(b * hq, _cdiv(nq, block_m))](
        q, k, v, dout, stats, delta, dq, ds, **masks,
        **problem, BLOCK_M=block_m, BLOCK_N=block_n, **options, STORE_DS=dbias is not None,
    )  # fmt: skip
    if dbias is not None:
        dbias += ds.sum_to_size(dbias.shape)
    for total, part in zip(grads[:3], (dq, dk, dv), strict=True):
        if total is not None:
            total += part


class TritonAttention(AttentionFunction):
    """`AttentionFunction` of strategy "triton" (TritonAttentionBackward in the graph)."""


Function = TritonAttention
