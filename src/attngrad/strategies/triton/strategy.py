"""Strategy "triton": the flash algorithm as fused Triton kernels (`attngrad.strategies.triton.kernels`).

Same saved tensors as "flash" (q, k, v, O, the row statistics (m, log l),
plus the caller's mask) and the same tiles skipped under the band (causal,
window, alignment, packed segments: `attngrad.core.band`).  The softcap and
dropout run inside the kernels; dropout's mask is never stored: each kernel
rebuilds its tiles from the hash of `attngrad.core.dropout`.  Forward is one kernel;
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

import importlib.metadata
import importlib.util
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from attngrad.core.contract import ArgumentError, Shapes
from attngrad.core.interface import Backward, Problem, Saved
from attngrad.core.ops import LOG2E, compute_dtype, join_lse_cotangent_
from attngrad.core.scores import ScoreMods
from attngrad.strategies.base import AttentionFunction
from attngrad.strategies.common import (
    KeepsOutput,
    KernelMods,
    add_kernel_gradients,
    kernel_refusal,
)
from attngrad.strategies.triton import configs

__all__ = [
    "MAX_HEAD_DIM",
    "Launch",
    "Tiles",
    "Triton",
    "TritonAttention",
    "check_head_dims",
    "dry_run",
    "strategy",
    "tf32_enabled",
]

MAX_HEAD_DIM = 256
MAX_BLOCK = 256  # the largest tile side: the table's, or a caller's (`tiles` checks)
MIN_BLOCK = 16  # tl.dot's smallest operand side: the least tile side and padded head dim


def _interpreter_reason() -> str | None:
    """Why Triton's interpreter cannot run the kernels here, or None: Triton 3.6's turns a
    scalar (a one-element array) into an int with int(), which numpy 2.4 refuses."""
    if configs.triton_version() >= (3, 7):
        return None
    numpy = importlib.metadata.version("numpy")
    if configs.release(numpy) >= (2, 4):
        return (
            f"strategy='triton' in the interpreter of Triton {configs.triton_version_text()} "
            f"needs numpy < 2.4 (it converts one-element arrays with int(); numpy {numpy} "
            "refuses): pip install 'numpy<2.4', or Triton >= 3.7."
        )
    return None


def check_head_dims(head_dim: int, value_dim: int) -> None:
    """ArgumentError (a ValueError) unless both head dims fit the kernels (<= MAX_HEAD_DIM)."""
    if max(head_dim, value_dim) > MAX_HEAD_DIM:
        raise ArgumentError(
            f"strategy='triton' supports head dims up to {MAX_HEAD_DIM}, got "
            f"d={head_dim}, dv={value_dim}; use strategy='flash' for larger heads."
        )


def _interpreting() -> bool:
    """Whether the kernels run in Triton's interpreter (fixed once they are imported)."""
    loaded = sys.modules.get("attngrad.strategies.triton.kernels")
    if loaded is not None:
        return bool(loaded.INTERPRETED)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _kernels() -> ModuleType:
    from attngrad.strategies.triton import kernels

    return kernels


def _pow2(n: int) -> int:
    """n padded to a power of two, at least MIN_BLOCK."""
    return max(MIN_BLOCK, 1 << max(0, n - 1).bit_length())


def _cdiv(n: int, block: int) -> int:
    """Programs to cover n rows in blocks (at least one, which writes nothing when n = 0)."""
    return max(1, -(-n // block))


@dataclass(frozen=True)
class Tiles:
    """The call's tile choice (`tiles`): the caller's block sizes (None: the table's)."""

    block_q: int | None
    block_k: int | None


@dataclass(frozen=True)
class Launch:
    """One kernel launch as `dry_run` records it: the JIT function, its grid and arguments."""

    kernel: object
    grid: tuple[int, ...]
    args: dict[str, object]


_DRY_RUN: ContextVar[tuple[int, list[Launch]] | None] = ContextVar("dry_run", default=None)


@contextmanager
def dry_run(arch: int) -> Iterator[list[Launch]]:
    """Inside, `forward` and `backward_into` record their launches, as chosen for sm_<arch>.

    Nothing runs: the tensors the launchers allocate stay unwritten.  This is
    how `attngrad.tools.kernel_report` learns what would be compiled for a GPU it
    does not have; CPU tensors will do.
    """
    launches: list[Launch] = []
    token = _DRY_RUN.set((arch, launches))
    try:
        yield launches
    finally:
        _DRY_RUN.reset(token)


def _launch(kernel: Any, grid: tuple[int, ...], **args: object) -> None:
    recording = _DRY_RUN.get()
    if recording is None:
        kernel[grid](**args)
    else:
        recording[1].append(Launch(kernel, grid, args))


def _arch(device: torch.device) -> int | None:
    """sm_<arch> the launches are for: the dry run's, the CUDA device's, None in the interpreter."""
    recording = _DRY_RUN.get()
    if recording is not None:
        return recording[0]
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return 10 * major + minor
    return None


def tf32_enabled() -> bool:
    """Whether PyTorch lets float32 matmuls on CUDA use TF32, as the user set it.

    ``torch.backends.cuda.matmul.allow_tf32 = True``, the newer
    ``torch.backends.cuda.matmul.fp32_precision = "tf32"`` (or the global
    ``torch.backends.fp32_precision``) and ``torch.set_float32_matmul_precision("high")``
    all read back through fp32_precision (PyTorch 2.9 and later; before it,
    ``allow_tf32`` is the one switch); off by default, as in PyTorch.
    """
    matmul = torch.backends.cuda.matmul
    precision = getattr(matmul, "fp32_precision", None)
    if precision is None:
        return bool(matmul.allow_tf32)
    if precision == "none":
        precision = getattr(torch.backends, "fp32_precision", "none")
    return bool(precision == "tf32")


def _config(
    kernel: str,
    dtype: torch.dtype,
    head_dim: int,
    seq: tuple[int, int],
    mods: ScoreMods,
    tiles: Tiles,
    arch: int | None,
) -> tuple[dict[str, int], dict[str, object]]:
    """(BLOCK_M, BLOCK_N, CHUNK by name; the launch options) of ``kernel`` for a call of ``dtype``.

    The table's choice for sm_<arch> (`attngrad.strategies.triton.configs`; in the
    interpreter `_INTERPRETER`'s large tiles) and the mask's tier (a softcap or dropout is heavy), the caller's
    block sizes over it, never beyond the padded sequence lengths seq =
    (Nq, Nk).  CHUNK: the head-dim slices of the dots over d (`kernels._dot_rows`):
    the table's, else `FMA_CHUNK` where the dots run on FMA units (float32
    without TF32, float64) and whole (MAX_HEAD_DIM) on tensor cores.  The
    launch options, on a GPU only: num_warps, num_stages, and FMA contraction
    on (Triton's default so far, said aloud).
    """
    heavy = mods.softcap is not None or mods.dropout is not None
    tf32 = _tf32(dtype, arch)
    if _DRY_RUN.get() is None:  # the compile report shows what fails to compile as such
        _check_compiles(dtype, mods, arch)
    if arch is None:
        config = _INTERPRETER[kernel]
    else:
        kind = configs.dot_kind(torch.finfo(dtype).bits // 8, tf32)
        config = configs.choose(kernel, kind, head_dim, arch, heavy)
    fma = dtype == torch.float64 or (dtype == torch.float32 and not tf32)
    tile = {
        "BLOCK_M": min(tiles.block_q or config.block_m, _pow2(seq[0])),
        "BLOCK_N": min(tiles.block_k or config.block_n, _pow2(seq[1])),
        # the interpreter's dots are numpy's whatever the width: no slices unless the table's
        "CHUNK": config.chunk or (FMA_CHUNK if fma and arch is not None else MAX_HEAD_DIM),
    }
    if arch is None:
        return tile, {}
    launch = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    return tile, {**launch, "enable_fp_fusion": True}


def _check_compiles(dtype: torch.dtype, mods: ScoreMods, arch: int | None) -> None:
    """RuntimeError where the installed Triton cannot compile the kernels for the call
    (`configs.compiles`: Triton 3.6 and float64 with a bool mask)."""
    if arch is None or configs.compiles(dtype == torch.float64, mods.keep is not None):
        return
    raise RuntimeError(
        f"strategy='triton' cannot compile float64 with a bool mask for sm_{arch} under "
        f"Triton {configs.triton_version_text()} (its float64 MMA lowering "
        "fails); pass the mask as a float bias (0 where kept, -inf elsewhere), pick "
        "strategy='flash', or use Triton >= 3.7."
    )


# The interpreter's tiles: large, so that few run (its cost is per tile operation, and the
# GPU's register limits do not apply); tests that need many tiles pass block sizes.
_INTERPRETER = {
    "forward": configs.Config(128, 64, 4, 1),
    "delta": configs.Config(64, 0, 4, 1),
    "dkdv": configs.Config(32, 128, 4, 1),
    "dq": configs.Config(128, 32, 4, 1),
}


def _tf32(dtype: torch.dtype, arch: int | None) -> bool:
    """Whether the dots of a float32 call run in TF32: on a GPU, when `tf32_enabled`."""
    return dtype == torch.float32 and arch is not None and tf32_enabled()


FMA_CHUNK = (
    32  # head-dim columns per slice of an FMA dot (`attngrad.strategies.triton.kernels._dot_rows`)
)


def _dots(dtype: torch.dtype, arch: int | None) -> dict[str, object]:
    """The kernels' ACC, UPCAST, PRECISION, REPEATABLE for inputs of ``dtype`` (see `attngrad.strategies.triton.kernels._dot`).

    ACC: float64 for float64, else float32; PRECISION: "tf32" for float32 on a
    GPU when `tf32_enabled`, else "ieee"; UPCAST: bfloat16 in the interpreter;
    REPEATABLE: in the interpreter, each entry of the products over the head dim
    (S, dP, Delta) the same numpy sum whatever the tile (`attngrad.strategies.triton.kernels._dot_rows`).
    """
    tl = _kernels().tl
    return {
        "ACC": tl.float64 if dtype == torch.float64 else tl.float32,
        "UPCAST": arch is None and dtype == torch.bfloat16,
        "PRECISION": "tf32" if _tf32(dtype, arch) else "ieee",
        "REPEATABLE": arch is None,
    }


def _mod_args(
    mods: ScoreMods, shape: tuple[int, int, int, int], device: torch.device
) -> dict[str, object]:
    """The kernels' arguments from the mods by name, for scores [B, Hq, Nq, Nk] on ``device``.

    Bias and Keep with their strides at the scores' shape (sbb..sbn, seb..sen),
    the band's Lo, Hi, dropout's RowWords (int32 [B*Hq, Nq]), ColWords (int32
    [Nk]) and threshold (`attngrad.strategies.common.KernelMods`), and the HAS_*
    flags; absent pieces are None pointers.  WIDE_TILES when a tile of
    MAX_BLOCK x MAX_BLOCK scores could span 2**31 elements of the bias, the
    keep mask or dS [B*Hq, Nq, Nk] (the kernels' 32-bit offsets inside a tile
    would overflow).
    """
    m = KernelMods.of(mods, shape, device)
    args: dict[str, object] = {"WIDE_TILES": MAX_BLOCK * shape[3] >= 2**31}
    for name, prefix, t in (("Bias", "sb", m.bias), ("Keep", "se", m.keep)):
        strides = (0, 0, 0, 0) if t is None else t.stride()
        args[name] = t
        args.update({prefix + dim: n for dim, n in zip("bhmn", strides, strict=True)})
        if MAX_BLOCK * (abs(strides[2]) + abs(strides[3])) >= 2**31:
            args["WIDE_TILES"] = True
    return {
        **args,
        "Lo": m.lo,
        "Hi": m.hi,
        "RowWords": m.row_words,
        "ColWords": m.col_words,
        "threshold": m.threshold,
        "HAS_BIAS": m.bias is not None,
        "HAS_KEEP": m.keep is not None,
        "HAS_BAND": m.lo is not None,
        "HAS_SOFTCAP": m.softcap is not None,
        "HAS_DROPOUT": m.row_words is not None,
    }


def _query_span_args(mods: ScoreMods, device: torch.device) -> dict[str, object]:
    """First, Stop: int64 [Nk], the query rows first <= i < stop that attend each key (dK/dV)."""
    if mods.band is None:
        return {"First": None, "Stop": None}
    first, stop = mods.band.query_span()
    return {"First": first.to(device), "Stop": stop.to(device)}


def _scales(scale: float, mods: ScoreMods, like: torch.Tensor) -> torch.Tensor:
    """[scale, log2 e, softcap c, 1 / (1 - p)] in the accumulation dtype of ``like`` (see kernels).

    c and 1 / (1 - p) are 1 where there is no softcap or no dropout (then unread).
    """
    cap = 1.0 if mods.softcap is None else mods.softcap
    keep_scale = 1.0 if mods.dropout is None else mods.dropout.scale
    return torch.tensor([scale, LOG2E, cap, keep_scale], dtype=like.dtype, device=like.device)


def _sizes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> dict[str, object]:
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


class TritonAttention(AttentionFunction):
    """`AttentionFunction` of strategy "triton" (TritonAttentionBackward in the graph)."""


class Triton(KeepsOutput[Tiles]):
    """flash's algorithm as fused Triton kernels (see the module docstring); block sizes
    are powers of two up to MAX_BLOCK."""

    name = "triton"
    function = TritonAttention

    def refuses(self, mods: ScoreMods) -> str | None:
        return kernel_refusal(self.name, mods, reads_blocks=False)

    def unavailable_reason(self, device: torch.device) -> str | None:
        """Why strategy "triton" cannot run on ``device`` tensors here, or None when it can."""
        if importlib.util.find_spec("triton") is None:
            return (
                "strategy='triton' needs Triton, which is not installed: "
                "pip install 'attngrad[gpu]' (or pick strategy='flash')."
            )
        if device.type == "cuda":
            return None
        if device.type == "cpu" and _interpreting():
            return _interpreter_reason()
        return (
            f"strategy='triton' runs on CUDA tensors, got {device.type} tensors. "
            "On CPU it runs only in Triton's interpreter: set TRITON_INTERPRET=1 before attngrad "
            "first uses it (slow; meant for tests), or pick strategy='flash'."
        )

    def tiles(
        self, shapes: Shapes, dtype: torch.dtype, block_q: int | None, block_k: int | None
    ) -> Tiles:
        """The caller's block sizes, kept for the launchers.

        ArgumentError for head dims the kernels do not take, or block sizes that are
        not powers of two from MIN_BLOCK to MAX_BLOCK.
        """
        check_head_dims(shapes.head_dim, shapes.value_dim)
        for name, size in (("block_q", block_q), ("block_k", block_k)):
            if size is not None and (size < MIN_BLOCK or size > MAX_BLOCK or size & (size - 1)):
                raise ArgumentError(
                    f"{name}={size}: Triton tiles must be a power of two from {MIN_BLOCK} to "
                    f"{MAX_BLOCK}, e.g. 16, 32, 64 or 128 (or None to choose from the shape)."
                )
        return Tiles(block_q, block_k)

    def forward(self, problem: Problem[Tiles]) -> tuple[torch.Tensor, Saved]:
        """O: [B, Hq, Nq, dv] (input dtype) and {"o": O, "stats": [B, Hq, Nq, 2]} (compute dtype).

        The kernels read dense rows, so non-contiguous inputs are copied first.
        """
        q, k, v = (t.contiguous() for t in (problem.q, problem.k, problem.v))
        mods, tiles = problem.mods, problem.tiles
        b, hq, nq, _ = q.shape
        nk = k.shape[2]
        o = q.new_empty(b, hq, nq, v.shape[-1])
        stats = torch.empty(b, hq, nq, 2, dtype=compute_dtype(q.dtype), device=q.device)
        head_dim, arch = max(q.shape[-1], v.shape[-1]), _arch(q.device)
        tile, launch = _config("forward", q.dtype, head_dim, (nq, nk), mods, tiles, arch)
        _launch(
            _kernels().attention_forward, (b * hq, _cdiv(nq, tile["BLOCK_M"])),
            Q=q, K=k, V=v, Out=o, Stats=stats, **_mod_args(mods, (b, hq, nq, nk), q.device),
            Scales=_scales(problem.scale, mods, stats), **_sizes(q, k, v),
            **tile, **_dots(q.dtype, arch), **launch,
        )  # fmt: skip
        return o, {"o": o, "stats": stats}

    def backward_into(self, backward: Backward[Tiles]) -> None:
        """Add dq, dk, dv and dbias into backward.grads (see `attngrad.core.interface`).

        saved: `forward`'s O and stats (or ring attention's final ones for these
        rows).  The kernels write whole gradients, which are then added into the
        accumulators.
        """
        problem, saved, grads = backward.problem, backward.saved, backward.grads
        mods, tiles = problem.mods, problem.tiles
        q, k, v, o, stats = (
            t.contiguous() for t in (problem.q, problem.k, problem.v, saved["o"], saved["stats"])
        )
        kernels = _kernels()
        b, hq, nq, d = q.shape
        hkv, nk, dv_dim = k.shape[1], k.shape[2], v.shape[-1]
        dout = backward.dout.contiguous()
        sizes, head_dim, arch = _sizes(q, k, v), max(d, dv_dim), _arch(q.device)
        shape = (b, hq, nq, nk)
        masks = {**_mod_args(mods, shape, q.device), "Scales": _scales(problem.scale, mods, stats)}
        delta = stats.new_empty(b, hq, nq)
        dots = _dots(q.dtype, arch)
        tile, launch = _config("delta", q.dtype, head_dim, (nq, nk), mods, tiles, arch)
        _launch(
            kernels.attention_delta, (b * hq, _cdiv(nq, tile["BLOCK_M"])),
            Out=o, DO=dout, Delta=delta, nq=nq, dv=dv_dim,
            BLOCK_M=tile["BLOCK_M"], BLOCK_DV=sizes["BLOCK_DV"], CHUNK=tile["CHUNK"],
            **dots, **launch,
        )  # fmt: skip
        join_lse_cotangent_(delta, backward.dlse)  # dS = P * (dP - Delta + dlse)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        tile, launch = _config("dkdv", q.dtype, head_dim, (nq, nk), mods, tiles, arch)
        _launch(
            kernels.attention_dkdv, (b * hkv, _cdiv(nk, tile["BLOCK_N"])),
            Q=q, K=k, V=v, DO=dout, Stats=stats, Delta=delta, DK=dk, DV=dv, **masks,
            **_query_span_args(mods, q.device), **sizes,
            **tile, **dots, **launch,
        )  # fmt: skip
        dbias = grads[3]
        # dS at the scores' shape, only for a bias gradient; skipped tiles stay zero
        ds = torch.zeros(shape, dtype=stats.dtype, device=q.device) if dbias is not None else stats
        tile, launch = _config("dq", q.dtype, head_dim, (nq, nk), mods, tiles, arch)
        _launch(
            kernels.attention_dq, (b * hq, _cdiv(nq, tile["BLOCK_M"])),
            Q=q, K=k, V=v, DO=dout, Stats=stats, Delta=delta, DQ=dq, DS=ds, **masks, **sizes,
            **tile, **dots, **launch, STORE_DS=dbias is not None,
        )  # fmt: skip
        add_kernel_gradients(grads, (dq, dk, dv), ds)


strategy = Triton()
