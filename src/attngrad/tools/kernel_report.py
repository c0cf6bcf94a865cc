"""The compile report: every kernel configuration the triton strategy launches, built for a GPU.

For each call configuration of the grid (dtype and dot precision, head dim,
mask mode, GQA), the strategy's own launchers run under
`attngrad.strategies.triton.strategy.dry_run` for the target, which records the four
launches (forward, delta, dK/dV, dQ) with the tiles, warps and stages they
choose; `attngrad.strategies.triton.ptxas` builds each one for the target with Triton
and ptxas and reads registers, spills and shared memory.  No GPU is needed.

Mask modes (each sets what the kernels specialize on):

  none     no mask                       causal   is_causal (the band)
  window   a sliding window (the band)   bool     a bool keep mask
  bias     a float bias with its gradient (dQ also stores dS)
  masks    bias with its gradient, keep mask and band at once: every mask
  softcap  scores capped by c tanh(S/c)  dropout  dropout of P
  all      masks, softcap and dropout at once: the most registers any
           launch needs

The grid: float16, bfloat16, float32 (IEEE dots and TF32 dots), float64 ×
head dims 64, 80, 128, 256 × the eight modes, and GQA (4 query heads per
key head) with no mask, masks and all; Nq = Nk = 1024 (more than any tile,
so tiles are the table's), and 1000 at d = 128 with no mask and with all.  ``quick`` keeps what decides the
light tier of the table: float16 and float32 (both precisions) at head dims
64, 128, 256, GQA, mode masks.

Verdict per configuration: ok when nothing spills (float64: at most
`FLOAT64_SPILL_BYTES` of spill stores, reported) and shared memory stays at
most 90% of the target's per-block limit (`TARGETS`).  The table of the
rows: `attngrad.cli.kernels`.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import multiprocessing
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from attngrad.core.contract import Shapes
from attngrad.core.dropout import Dropout
from attngrad.core.interface import Backward, Problem
from attngrad.core.scores import ScoreMods
from attngrad.strategies.triton import configs, ptxas
from attngrad.strategies.triton.ptxas import Bound, Resources

__all__ = [
    "FLOAT64_SPILL_BYTES",
    "MASKS",
    "SHARED_FRACTION",
    "TARGETS",
    "Plan",
    "Row",
    "Target",
    "Variant",
    "as_json",
    "compile_all",
    "compiles",
    "grid",
    "launches",
    "plan",
    "report",
    "summary",
]


@dataclass(frozen=True)
class Target:
    """A CUDA target: its name, sm_<arch>, and the shared memory one block may opt in to."""

    name: str
    arch: int
    shared_limit: int


# cudaDevAttrMaxSharedMemoryPerBlockOptin: A100 163 KiB, H100/H200 227 KiB
TARGETS = {t.name: t for t in (Target("sm_80", 80, 166_912), Target("sm_90", 90, 232_448))}
SHARED_FRACTION = 0.9
FLOAT64_SPILL_BYTES = 256
MASKS = ("none", "causal", "window", "bool", "bias", "masks", "softcap", "dropout", "all")


@dataclass(frozen=True)
class Variant:
    """One call configuration: dtype, dot precision ("ieee" or "tf32"), d = dv, mask mode,
    Hq / Hkv, and Nq = Nk (1024, or 1000: lengths not a multiple of 16 compile other binaries,
    which Triton specializes on the alignment it can prove)."""

    dtype: str
    precision: str
    head_dim: int
    mask: str
    groups: int
    seq: int = 1024

    @property
    def label(self) -> str:
        dtype = "float32+tf32" if self.precision == "tf32" else self.dtype
        gqa = f" gqa{self.groups}" if self.groups > 1 else ""
        seq = f" N={self.seq}" if self.seq != 1024 else ""
        return f"{dtype} d={self.head_dim} {self.mask}{gqa}{seq}"


def _precisions(dtype: str) -> tuple[str, ...]:
    return ("ieee", "tf32") if dtype == "float32" else ("ieee",)


def grid(quick: bool = False) -> list[Variant]:
    """The report's call configurations (module docstring), but those the installed Triton
    cannot compile (the launcher refuses them)."""
    if quick:
        return [
            Variant(dtype, precision, d, "masks", 4)
            for dtype in ("float16", "float32")
            for precision in _precisions(dtype)
            for d in (64, 128, 256)
        ]
    out = []
    for dtype in ("float16", "bfloat16", "float32", "float64"):
        for precision in _precisions(dtype):
            for d in (64, 80, 128, 256):
                out += [Variant(dtype, precision, d, mode, 1) for mode in MASKS]
                out += [Variant(dtype, precision, d, m, 4) for m in ("none", "masks", "all")]
            out += [Variant(dtype, precision, 128, mode, 1, 1000) for mode in ("none", "all")]
    return [v for v in out if compiles(v)]


def compiles(variant: Variant) -> bool:
    """Whether the installed Triton compiles the variant (`configs.compiles`); the launcher
    refuses the calls it does not (Triton 3.6: float64 with a bool mask)."""
    return configs.compiles(variant.dtype == "float64", variant.mask in ("bool", "masks", "all"))


def _mods(variant: Variant, hq: int, hkv: int) -> tuple[ScoreMods, bool]:
    """The call's ScoreMods, and whether the bias needs its gradient."""
    mode, n = variant.mask, variant.seq
    dtype = getattr(torch, variant.dtype)
    shapes = Shapes((1,), hq, hkv, n, n, variant.head_dim, variant.head_dim)
    bias = torch.zeros(hq, n, n, dtype=dtype) if mode in ("bias", "masks", "all") else None
    keep = torch.ones(n, n, dtype=torch.bool) if mode in ("bool", "masks", "all") else None
    mods = ScoreMods.build(
        bias if bias is not None else keep,
        is_causal=mode in ("causal", "masks", "all"),
        window=(128, 0) if mode == "window" else None,
        shapes=shapes,
        softcap=30.0 if mode in ("softcap", "all") else None,
        dropout=Dropout(0.1, 0, 0) if mode in ("dropout", "all") else None,
    )
    if mode in ("masks", "all"):
        mods = dataclasses.replace(mods, keep=keep[None, None] if keep is not None else None)
    return mods, bias is not None


def launches(variant: Variant, arch: int) -> list[tuple[str, dict[str, object], object]]:
    """(kernel name, its launch arguments, the JIT function) of one forward and backward.

    The triton strategy's launchers under `dry_run` for sm_<arch>, on CPU
    tensors of the variant's sizes (nothing runs).
    """
    from attngrad.strategies.triton import strategy as triton_strategy

    hkv = 2 if variant.groups == 1 else 1
    hq = hkv * variant.groups
    dtype, d, n = getattr(torch, variant.dtype), variant.head_dim, variant.seq
    q = torch.zeros(1, hq, n, d, dtype=dtype)
    k = v = torch.zeros(1, hkv, n, d, dtype=dtype)
    mods, bias_grad = _mods(variant, hq, hkv)
    triton = triton_strategy.strategy
    tiles = triton.tiles(Shapes.of(q, k, v), dtype, None, None)
    matmul = torch.backends.cuda.matmul
    before = matmul.fp32_precision
    matmul.fp32_precision = "tf32" if variant.precision == "tf32" else "ieee"
    try:
        with triton_strategy.dry_run(arch) as recorded:
            problem = Problem(q, k, v, mods, d**-0.5, tiles)
            o, saved = triton.forward(problem)
            grads = [torch.zeros_like(t) for t in (q, k, v)]
            dbias = torch.zeros(hq, n, n, dtype=dtype) if bias_grad else None
            accumulators = (grads[0], grads[1], grads[2], dbias)
            triton.backward_into(Backward(problem, saved, o, None, accumulators))
    finally:
        matmul.fp32_precision = before
    return [(launch.kernel.__name__, launch.args, launch.kernel) for launch in recorded]  # type: ignore[attr-defined]


@dataclass(frozen=True)
class Row:
    """One launched kernel of one variant, as compiled for the target."""

    kernel: str
    variant: Variant
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    resources: Resources
    target: Target
    chunk: int = 0  # head-dim columns per slice of the dots over d (0: delta, no such dot)

    @property
    def spill_bytes(self) -> int:
        return self.resources.spill_stores

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def problems(self) -> list[str]:
        r, limit = self.resources, self.target.shared_limit
        if r.error:
            return [f"does not compile: {r.error}"]
        out = []
        if r.shared_bytes > limit:
            out.append(f"shared memory {r.shared_bytes} B exceeds the {limit} B limit")
        elif r.shared_bytes > SHARED_FRACTION * limit:
            out.append(f"shared memory {r.shared_bytes / limit:.1%} of the limit (> 90%)")
        allowed = FLOAT64_SPILL_BYTES if self.variant.dtype == "float64" else 0
        if r.spill_stores > allowed:
            out.append(f"spills {r.spill_stores} B (allowed {allowed} B)")
        return out

    @property
    def verdict(self) -> str:
        if self.problems:
            return "; ".join(self.problems)
        return f"ok, spills {self.spill_bytes} B" if self.spill_bytes else "ok"


def _short(kernel: str) -> str:
    return kernel.removeprefix("attention_")


@dataclass(frozen=True)
class Plan:
    """What `report` compiles: each launch (kernel name, variant, arguments, bound for the target)."""

    target: Target
    launches: list[tuple[str, Variant, dict[str, object], Bound]]

    @property
    def distinct(self) -> dict[str, tuple[Bound, str]]:
        """The distinct binaries by compile key, each with what it is (e.g. causal and window
        compile the same kernel, and so does the delta kernel of every mask mode)."""
        return {b.key: (b, f"{_short(n)} {v.label}") for n, v, _, b in self.launches}


def plan(target: Target, variants: list[Variant]) -> Plan:
    """Record and bind every launch of ``variants`` for ``target`` (quick: nothing compiles)."""
    planned = []
    for variant in variants:
        for name, args, kernel in launches(variant, target.arch):
            planned.append((name, variant, args, ptxas.bind(kernel, args, target.arch)))
    return Plan(target, planned)


def report(
    plan: Plan,
    jobs: int | None = None,
    cache_dir: Path | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[Row]:
    """Compile ``plan``'s distinct binaries; one Row per launch, in grid order.

    jobs: worker processes (default: the CPUs); progress is called once per
    distinct binary, with its description.
    """
    results = compile_all(list(plan.distinct.values()), jobs, cache_dir, progress)
    return [
        Row(
            kernel=_short(name),
            variant=variant,
            block_m=int(args["BLOCK_M"]),  # type: ignore[call-overload]
            block_n=int(args.get("BLOCK_N", 0)),  # type: ignore[call-overload]
            num_warps=int(args["num_warps"]),  # type: ignore[call-overload]
            num_stages=int(args["num_stages"]),  # type: ignore[call-overload]
            resources=results[bound.key],
            target=plan.target,
            chunk=int(args.get("CHUNK", 0)),  # type: ignore[call-overload]
        )
        for name, variant, args, bound in plan.launches
    ]


def compile_all(
    work: list[tuple[Bound, str]],
    jobs: int | None,
    cache_dir: Path | None,
    progress: Callable[[str], None] | None,
) -> dict[str, Resources]:
    """Each bound launch's resources by its compile key, read from ``cache_dir`` where
    compiled before, the others compiled on ``jobs`` processes (default: one per core; none
    started for fewer than two); ``progress`` hears each one done."""
    results: dict[str, Resources] = {}
    todo = []
    for bound, what in work:
        found = ptxas.cached(bound, cache_dir)
        if found is None:
            todo.append((bound, what))
            continue
        results[bound.key] = found
        if progress:
            progress(what)
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(todo)))
    if jobs == 1:
        for bound, what in todo:
            results[bound.key] = ptxas.compile_bound(bound, cache_dir)
            if progress:
                progress(what)
        return results
    # spawn: a fresh interpreter per worker, never a fork of this process's threads
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=context) as pool:
        futures = {
            pool.submit(ptxas.compile_bound, bound, cache_dir): (bound.key, what)
            for bound, what in todo
        }
        for future in concurrent.futures.as_completed(futures):
            key, what = futures[future]
            results[key] = future.result()
            if progress:
                progress(what)
    return results


_HEAVY_MODES = ("softcap", "dropout", "all")


def summary(rows: list[Row]) -> list[Row]:
    """One Row per kernel, dtype and precision, head dim and table tier (light: the mask modes;
    heavy: softcap, dropout or all): the one with the most spill, then registers, then shared
    bytes, as "light modes" / "heavy modes"."""
    worst: dict[tuple[object, ...], Row] = {}
    for row in rows:
        v = row.variant
        heavy = v.mask in _HEAVY_MODES
        key = (row.kernel, v.dtype, v.precision, v.head_dim, heavy)
        if key not in worst or _rank(row) > _rank(worst[key]):
            mode = "heavy modes" if heavy else "light modes"
            worst[key] = dataclasses.replace(
                row, variant=dataclasses.replace(v, mask=mode, groups=1)
            )
    return list(worst.values())


def _rank(row: Row) -> tuple[int, int, int]:
    r = row.resources
    return r.spill_stores, r.registers, r.shared_bytes


def as_json(target: Target, rows: list[Row]) -> dict[str, object]:
    """The report as ``attngrad kernels --json`` writes it."""
    return {
        "target": target.name,
        "triton": configs.triton_version_text(),
        "shared_limit": target.shared_limit,
        "configs": [
            {
                "kernel": row.kernel,
                "dtype": row.variant.dtype,
                "precision": row.variant.precision,
                "head_dim": row.variant.head_dim,
                "mask": row.variant.mask,
                "gqa_groups": row.variant.groups,
                "seq": row.variant.seq,
                "block_m": row.block_m,
                "block_n": row.block_n,
                "num_warps": row.num_warps,
                "num_stages": row.num_stages,
                "head_chunk": row.chunk,
                "shared_bytes": row.resources.shared_bytes,
                "registers": row.resources.registers,
                "spill_bytes": row.resources.spill_stores,
                "spill_loads": row.resources.spill_loads,
                "stack_bytes": row.resources.stack_bytes,
                "ok": row.ok,
                "verdict": row.verdict,
            }
            for row in rows
        ],
    }
