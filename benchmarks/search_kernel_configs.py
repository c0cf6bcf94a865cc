"""Search the triton strategy's tiles, warps and stages with the compile report; no GPU needed.

    python benchmarks/search_kernel_configs.py [--targets sm_80 sm_90] [--mode masks] [--jobs N]

For every slot of `attngrad.strategies.triton.configs` (target, dot kind, padded head dim,
kernel), the candidates of `CANDIDATES` are compiled in one parallel batch, in
``--mode`` (default "masks": bias with its gradient, keep mask and band at once;
"all" adds softcap and dropout, for the heavy tier) and every other mode of its
tier, with GQA, and at a length that is not a multiple of 16 (`_variants`).  A slot takes its
first candidate, in preference order, that compiles without a spill (float64:
at most `kernel_report.FLOAT64_SPILL_BYTES`) with shared memory at most 90% of
the target's limit; where none does, the one that spills least, flagged.
Prints the rows of the table with the registers and shared bytes behind each.
"""

from __future__ import annotations

import argparse
import sys

from attngrad.core.progress import Progress
from attngrad.strategies.triton import ptxas
from attngrad.strategies.triton.configs import KINDS, Config
from attngrad.strategies.triton.ptxas import Bound, Resources
from attngrad.tools import kernel_report
from attngrad.tools.kernel_report import SHARED_FRACTION, TARGETS, Target, Variant

# (block_m, block_n, warps) per dot kind, preferred first: the query-block kernels
# (forward, dQ) want wide row tiles, dK/dV wide key tiles (block_n).  Tensor-core dots
# (16-bit, TF32) afford large tiles; FMA dots (float32, float64) hold (rows + columns
# per thread) x the reduced dim in registers, so small ones.
_QUERY = {
    "mma16": [(128, 64, 8), (128, 64, 4), (128, 32, 8), (64, 64, 4), (64, 32, 8), (64, 32, 4),
              (32, 32, 4), (32, 16, 4), (32, 16, 8), (16, 16, 4)],
    "tf32": [(128, 32, 8), (64, 64, 4), (64, 32, 8), (64, 32, 4), (32, 32, 4), (32, 16, 4),
             (32, 16, 8), (16, 16, 4), (16, 16, 8)],
    "fma32": [(64, 16, 4), (32, 32, 4), (32, 16, 4), (16, 16, 4), (16, 16, 8)],
    "fma64": [(32, 16, 4), (16, 16, 4), (16, 16, 8)],
}  # fmt: skip
_KEYS = {
    "mma16": [
        (32, 128, 8),
        (64, 64, 8),
        (32, 64, 8),
        (32, 64, 4),
        (16, 64, 4),
        (16, 32, 4),
        (16, 32, 8),
        (16, 16, 4),
        (16, 16, 8),
    ],
    "tf32": [
        (32, 64, 8),
        (32, 64, 4),
        (16, 64, 4),
        (16, 32, 4),
        (16, 32, 8),
        (16, 16, 4),
        (16, 16, 8),
    ],
    "fma32": [(16, 64, 4), (16, 32, 4), (16, 16, 4), (16, 16, 8)],
    "fma64": [(16, 32, 4), (16, 16, 4), (16, 16, 8)],
}
CANDIDATES = {"forward": _QUERY, "dq": _QUERY, "dkdv": _KEYS}
# tensor-core dots over wide heads may also take the head dim in slices of 64 columns
# (`kernels._dot_rows`): q, k, v, dO then stay in memory, not in registers
_SLICED = {("mma16", 256), ("tf32", 128), ("tf32", 256)}


def _chunks(kind: str, hd: int) -> tuple[int, ...]:
    """The head-dim slices a slot tries (0: the launcher's default, whole on tensor cores and 32
    on FMA units): 64 for the wide tensor-core dots of `_SLICED`, 16 for FMA dots, whose rows
    of 32 columns may still spill (float32 d = 128 dK/dV under Triton 3.6)."""
    if (kind, hd) in _SLICED:
        return (0, 64)
    return (0, 16) if kind.startswith("fma") else (0,)


_VARIANT = {
    "mma16": ("float16", "ieee"),
    "tf32": ("float32", "tf32"),
    "fma32": ("float32", "ieee"),
    "fma64": ("float64", "ieee"),
}
_BYTES = {"mma16": 2, "tf32": 4, "fma32": 4, "fma64": 8}


def _stages(kind: str, head_dim: int) -> int:
    """Pipeline depth: 3 for rows up to 256 bytes, fewer as rows widen (shared memory)."""
    row_bytes = _BYTES[kind] * head_dim
    return 3 if row_bytes <= 256 else (2 if row_bytes <= 512 else 1)


def _bound(
    target: Target, variant: Variant, kind: str, kernel: str, candidate: tuple[int, ...]
) -> Bound:
    block_m, block_n, warps, stages, chunk = candidate
    for name, args, fn in kernel_report.launches(variant, target.arch):
        if name == f"attention_{kernel}":
            tried = {**args, "BLOCK_M": block_m, "BLOCK_N": block_n}
            default = 32 if kind.startswith("fma") else 256  # the launcher's, by dot kind
            tried.update(num_warps=warps, num_stages=stages, CHUNK=chunk or default)
            return ptxas.bind(fn, tried, target.arch)
    raise LookupError(kernel)


def _fits(target: Target, kind: str, got: Resources) -> bool:
    allowed = kernel_report.FLOAT64_SPILL_BYTES if kind == "fma64" else 0
    return (
        not got.error
        and got.shared_bytes <= SHARED_FRACTION * target.shared_limit
        and got.spill_stores <= allowed
    )


# the mask modes of each tier (`configs`: a softcap or dropout makes a call heavy)
_TIER_MODES = {
    "masks": ("none", "causal", "window", "bool", "bias", "masks"),
    "all": ("softcap", "dropout", "all"),
}


def _variants(kind: str, hd: int, mode: str) -> list[Variant]:
    """What a candidate must compile without spills for: every mode of ``mode``'s tier
    (modes are not monotone in registers: a keep mask alone may spill where all masks at
    once do not), with GQA as the report's grid has it, ``mode`` at a length that is not a
    multiple of 16 (other alignment, other binaries), and no mask at that length; but what
    the installed Triton cannot compile (the launcher refuses it)."""
    dtype, precision = _VARIANT[kind]
    modes = _TIER_MODES[mode]
    variants = [
        *(Variant(dtype, precision, hd, m, 1) for m in modes),
        *(Variant(dtype, precision, hd, m, 4) for m in ("none", "masks", "all") if m in modes),
        Variant(dtype, precision, hd, mode, 1, 1000),
        Variant(dtype, precision, hd, "none", 1, 1000),
    ]
    return [v for v in variants if kernel_report.compiles(v)]


def search(
    targets: list[Target], mode: str, jobs: int | None, only: set[tuple[str, int, str]] | None
) -> dict:
    """{slot: (the chosen candidate, its worst Resources[, True when nothing fits])}."""
    plan = {}
    for target in targets:
        for kind in KINDS:
            for hd in (64, 128, 256):
                for kernel, by_kind in CANDIDATES.items():
                    if only is not None and (kind, hd, kernel) not in only:
                        continue
                    chunks = _chunks(kind, hd)
                    for bm, bn, warps in by_kind[kind]:
                        for chunk in chunks:
                            candidate = (bm, bn, warps, _stages(kind, hd), chunk)
                            plan[(target, kind, hd, kernel), candidate] = [
                                _bound(target, v, kind, kernel, candidate)
                                for v in _variants(kind, hd, mode)
                            ]
    work = {
        b.key: (b, f"{s[0].name} {s[1]} {s[2]} {s[3]} {c}")
        for (s, c), bounds in plan.items()
        for b in bounds
    }
    with Progress(len(work), "search") as bar:
        cache = ptxas.default_cache_dir()
        results = kernel_report.compile_all(list(work.values()), jobs, cache, bar.step)
    chosen: dict = {}
    for (slot, candidate), bounds in plan.items():  # in preference order per slot
        got = [results[b.key] for b in bounds]
        worst = max(got, key=lambda r: (bool(r.error), r.spill_stores, r.shared_bytes))
        if slot not in chosen and all(_fits(slot[0], slot[1], r) for r in got):
            chosen[slot] = (candidate, worst)
    for (slot, candidate), bounds in plan.items():  # nothing fits: the fewest spills, flagged
        worst = max((results[b.key] for b in bounds), key=lambda r: r.spill_stores)
        if slot not in chosen or (
            len(chosen[slot]) > 2 and worst.spill_stores < chosen[slot][1].spill_stores
        ):
            chosen[slot] = (candidate, worst, True)
    return chosen


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", nargs="+", default=list(TARGETS), choices=list(TARGETS))
    parser.add_argument("--mode", default="masks", choices=kernel_report.MASKS)
    parser.add_argument("--jobs", type=int, default=None)
    parser.add_argument(
        "--only",
        nargs="+",
        metavar="KIND:HD:KERNEL",
        help="search these slots only, e.g. tf32:64:dkdv",
    )
    args = parser.parse_args()
    only = None
    if args.only:
        only = {(k, int(hd), kernel) for k, hd, kernel in (o.split(":") for o in args.only)}
    chosen = search([TARGETS[t] for t in args.targets], args.mode, args.jobs, only)
    for (target, kind, hd, kernel), (candidate, got, *flag) in sorted(
        chosen.items(), key=lambda item: (item[0][0].arch, *item[0][1:])
    ):
        config = Config(*candidate)
        print(
            f"({target.arch}, {kind!r}, {hd}, {kernel!r}): Config{tuple(vars(config).values())},"
            f"  # {got.registers} regs, {got.shared_bytes} B shared "
            f"({got.shared_bytes / target.shared_limit:.0%}), spill {got.spill_stores} B"
            + ("  NOTHING FITS" if flag else "")
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
