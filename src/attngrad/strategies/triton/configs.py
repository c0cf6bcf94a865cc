"""Tiles, warps and pipeline stages of the triton strategy's kernels, by GPU, dots and head dim.

`choose` is what the launchers (`attngrad.strategies.triton.strategy`) use.  A choice
depends on the kernel; the GPU architecture (sm_80, or sm_90 and later: the
shared memory one block may use differs, 163 KiB against 227 KiB); how the
dots run (`KINDS`: tensor cores on 16-bit operands or in TF32, FMA units in
float32 or float64, which keep whole operand rows in registers and so take
far smaller tiles); the head dim padded to a power of two (64 for every
d <= 64, then 128 and 256); and the tier: a softcap or dropout adds per-score
work (tanh, the dropout hash) that holds registers, so those calls take the
heavy tier.

The tables are the output of ``benchmarks/search_kernel_configs.py``, run
under each Triton in `TABLES` (ptxas sees what that Triton's compiler makes
of the kernels: under Triton 3.6, 37 of the newest table's 144 slots and
tiers spilled, and 36 more, float64 with a bool mask, did not compile): for each
slot, of its candidates, largest tiles first, the first that ptxas compiles
without spilling a register in the tier's heaviest mask mode (light: bias
with its gradient, keep mask and band at once; heavy: those plus softcap and
dropout), with GQA and without, at a length that is not a multiple of 16 as
well, and with shared memory at most 90% of the target's per-block limit;
where none does (marked), the one that spills least.  Each
row's comment gives its registers per thread, shared bytes per block and
spill.  `attngrad kernels` then checks every mode against it.  Speed on
hardware is not yet measured: no GPU has run these kernels.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import re
from dataclasses import dataclass

__all__ = [
    "KERNELS",
    "KINDS",
    "TABLES",
    "Config",
    "choose",
    "compiles",
    "dot_kind",
    "family",
    "padded_head_dim",
    "release",
    "table_for",
    "triton_version",
    "triton_version_text",
]

KERNELS = ("forward", "delta", "dkdv", "dq")
# how the kernels' dots run: tensor cores on 16-bit operands, tensor cores in TF32,
# FMA units in float32 (IEEE, no TF32), FMA units in float64
KINDS = ("mma16", "tf32", "fma32", "fma64")


def dot_kind(element_bytes: int, tf32: bool) -> str:
    """The `KINDS` entry of inputs of ``element_bytes`` (2, 4, 8); tf32: float32 dots in TF32."""
    return {2: "mma16", 4: "tf32" if tf32 else "fma32", 8: "fma64"}[element_bytes]


@dataclass(frozen=True)
class Config:
    """One kernel's launch shape.

    block_m: query rows per tile; block_n: keys per tile (the delta kernel
    has no key tiles: 0); num_warps, num_stages: Triton's launch options
    (stages: the software pipeline's depth over the key or query loop);
    chunk: head-dim columns per slice of the dots over d (0: the launcher's
    default for the dot kind: whole on tensor cores, 32 on FMA units).
    """

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    chunk: int = 0


def family(arch: int) -> int:
    """The table an sm_<arch> GPU takes: 90 from Hopper on, else 80 (Ampere's limits)."""
    return 90 if arch >= 90 else 80


def padded_head_dim(head_dim: int) -> int:
    """The table's head-dim tier of ``head_dim``: 64 for d <= 64, else the next power of two."""
    return max(64, 1 << max(0, head_dim - 1).bit_length())


_BYTES = {"mma16": 2, "tf32": 4, "fma32": 4, "fma64": 8}  # of an element, by dot kind

_Key = tuple[int, str, int, str]  # (arch family, dot kind, padded head dim, kernel)


# Light tier: no softcap and no dropout (any mask, band and bias gradient).
_TABLE: dict[_Key, Config] = {
    (80, "fma32", 128, "dkdv"): Config(16, 16, 4, 2),  # 254 regs, 8192 B shared (5%), spill 0 B
    (80, "fma32", 128, "dq"): Config(16, 16, 4, 2),  # 196 regs, 8192 B shared (5%), spill 0 B
    (80, "fma32", 128, "forward"): Config(32, 16, 4, 2),  # 255 regs, 8192 B shared (5%), spill 0 B
    (80, "fma32", 256, "dkdv"): Config(16, 16, 4, 1),  # 226 regs, 37888 B shared (23%), spill 0 B
    (80, "fma32", 256, "dq"): Config(16, 16, 8, 1),  # 182 regs, 16384 B shared (10%), spill 0 B
    (80, "fma32", 256, "forward"): Config(
        32, 16, 4, 1
    ),  # 180 regs, 22528 B shared (13%), spill 0 B
    (80, "fma32", 64, "dkdv"): Config(16, 32, 4, 3),  # 217 regs, 12288 B shared (7%), spill 0 B
    (80, "fma32", 64, "dq"): Config(32, 16, 4, 3),  # 210 regs, 12288 B shared (7%), spill 0 B
    (80, "fma32", 64, "forward"): Config(32, 32, 4, 3),  # 247 regs, 16384 B shared (10%), spill 0 B
    (80, "fma64", 128, "dkdv"): Config(16, 16, 4, 1),  # 252 regs, 43008 B shared (26%), spill 0 B
    (80, "fma64", 128, "dq"): Config(32, 16, 4, 1),  # 255 regs, 16384 B shared (10%), spill 112 B
    (80, "fma64", 128, "forward"): Config(
        32, 16, 4, 1
    ),  # 254 regs, 28672 B shared (17%), spill 0 B
    (80, "fma64", 256, "dkdv"): Config(16, 16, 8, 1),  # 240 regs, 75776 B shared (45%), spill 0 B
    (80, "fma64", 256, "dq"): Config(16, 16, 8, 1),  # 254 regs, 32768 B shared (20%), spill 0 B
    (80, "fma64", 256, "forward"): Config(
        32, 16, 4, 1
    ),  # 255 regs, 45056 B shared (27%), spill 228 B
    (80, "fma64", 64, "dkdv"): Config(16, 32, 4, 2),  # 255 regs, 12288 B shared (7%), spill 24 B
    (80, "fma64", 64, "dq"): Config(32, 16, 4, 2),  # 232 regs, 12288 B shared (7%), spill 0 B
    (80, "fma64", 64, "forward"): Config(32, 16, 4, 2),  # 242 regs, 12288 B shared (7%), spill 0 B
    (80, "mma16", 128, "dkdv"): Config(16, 32, 8, 3),  # 158 regs, 34688 B shared (21%), spill 0 B
    (80, "mma16", 128, "dq"): Config(32, 16, 4, 3),  # 241 regs, 34816 B shared (21%), spill 0 B
    (80, "mma16", 128, "forward"): Config(
        64, 32, 8, 3
    ),  # 255 regs, 53248 B shared (32%), spill 0 B
    (80, "mma16", 256, "dkdv"): Config(16, 32, 8, 2),  # 255 regs, 50624 B shared (30%), spill 0 B
    (80, "mma16", 256, "dq"): Config(32, 16, 4, 2),  # 255 regs, 51200 B shared (31%), spill 0 B
    (80, "mma16", 256, "forward"): Config(
        64, 32, 8, 2
    ),  # 255 regs, 69632 B shared (42%), spill 0 B
    (80, "mma16", 64, "dkdv"): Config(16, 32, 4, 3),  # 230 regs, 18304 B shared (11%), spill 0 B
    (80, "mma16", 64, "dq"): Config(32, 32, 4, 3),  # 229 regs, 28672 B shared (17%), spill 0 B
    (80, "mma16", 64, "forward"): Config(32, 32, 4, 3),  # 235 regs, 24576 B shared (15%), spill 0 B
    (80, "tf32", 128, "dkdv"): Config(16, 32, 4, 2, 64),  # 250 regs, 12288 B shared (7%), spill 0 B
    (80, "tf32", 128, "dq"): Config(32, 16, 4, 2),  # 255 regs, 51200 B shared (31%), spill 0 B
    (80, "tf32", 128, "forward"): Config(
        64, 32, 8, 2, 64
    ),  # 255 regs, 24576 B shared (15%), spill 0 B
    (80, "tf32", 256, "dkdv"): Config(16, 32, 8, 1),  # 255 regs, 114688 B shared (69%), spill 0 B
    (80, "tf32", 256, "dq"): Config(32, 16, 4, 1, 64),  # 255 regs, 16384 B shared (10%), spill 0 B
    (80, "tf32", 256, "forward"): Config(
        32, 16, 4, 1, 64
    ),  # 252 regs, 28672 B shared (17%), spill 0 B
    (80, "tf32", 64, "dkdv"): Config(16, 32, 4, 3),  # 255 regs, 33664 B shared (20%), spill 0 B
    (80, "tf32", 64, "dq"): Config(32, 16, 4, 3),  # 167 regs, 32768 B shared (20%), spill 0 B
    (80, "tf32", 64, "forward"): Config(32, 32, 4, 3),  # 246 regs, 53248 B shared (32%), spill 0 B
    (90, "fma32", 128, "dkdv"): Config(16, 16, 4, 2),  # 244 regs, 8192 B shared (4%), spill 0 B
    (90, "fma32", 128, "dq"): Config(16, 16, 4, 2),  # 208 regs, 8192 B shared (4%), spill 0 B
    (90, "fma32", 128, "forward"): Config(32, 16, 4, 2),  # 255 regs, 8192 B shared (4%), spill 0 B
    (90, "fma32", 256, "dkdv"): Config(16, 16, 4, 1),  # 178 regs, 37888 B shared (16%), spill 0 B
    (90, "fma32", 256, "dq"): Config(16, 16, 8, 1),  # 172 regs, 16384 B shared (7%), spill 0 B
    (90, "fma32", 256, "forward"): Config(
        32, 32, 4, 1
    ),  # 188 regs, 40960 B shared (18%), spill 0 B
    (90, "fma32", 64, "dkdv"): Config(16, 32, 4, 3),  # 204 regs, 12288 B shared (5%), spill 0 B
    (90, "fma32", 64, "dq"): Config(32, 32, 4, 3),  # 245 regs, 16384 B shared (7%), spill 0 B
    (90, "fma32", 64, "forward"): Config(32, 32, 4, 3),  # 226 regs, 16384 B shared (7%), spill 0 B
    (90, "fma64", 128, "dkdv"): Config(16, 32, 4, 1),  # 255 regs, 49152 B shared (21%), spill 136 B
    (90, "fma64", 128, "dq"): Config(32, 16, 4, 1),  # 255 regs, 16384 B shared (7%), spill 0 B
    (90, "fma64", 128, "forward"): Config(
        32, 16, 4, 1
    ),  # 240 regs, 28672 B shared (12%), spill 0 B
    (90, "fma64", 256, "dkdv"): Config(16, 16, 8, 1),  # 255 regs, 75776 B shared (33%), spill 72 B
    (90, "fma64", 256, "dq"): Config(16, 16, 4, 1),  # 255 regs, 32768 B shared (14%), spill 108 B
    (90, "fma64", 256, "forward"): Config(
        32, 16, 4, 1
    ),  # 255 regs, 45056 B shared (19%), spill 164 B
    (90, "fma64", 64, "dkdv"): Config(16, 32, 4, 2),  # 255 regs, 12288 B shared (5%), spill 96 B
    (90, "fma64", 64, "dq"): Config(32, 16, 4, 2),  # 242 regs, 12288 B shared (5%), spill 0 B
    (90, "fma64", 64, "forward"): Config(32, 16, 4, 2),  # 240 regs, 12288 B shared (5%), spill 0 B
    (90, "mma16", 128, "dkdv"): Config(16, 32, 8, 3),  # 180 regs, 34688 B shared (15%), spill 0 B
    (90, "mma16", 128, "dq"): Config(64, 32, 8, 3),  # 255 regs, 90112 B shared (39%), spill 0 B
    (90, "mma16", 128, "forward"): Config(
        64, 32, 8, 3
    ),  # 247 regs, 73728 B shared (32%), spill 0 B
    (90, "mma16", 256, "dkdv"): Config(16, 32, 8, 2, 64),  # 214 regs, 8192 B shared (4%), spill 0 B
    (90, "mma16", 256, "dq"): Config(32, 16, 4, 2, 64),  # 238 regs, 8192 B shared (4%), spill 0 B
    (90, "mma16", 256, "forward"): Config(
        64, 32, 8, 2, 64
    ),  # 252 regs, 40960 B shared (18%), spill 0 B
    (90, "mma16", 64, "dkdv"): Config(32, 128, 8, 3),  # 220 regs, 63232 B shared (27%), spill 0 B
    (90, "mma16", 64, "dq"): Config(64, 32, 8, 3),  # 235 regs, 49152 B shared (21%), spill 0 B
    (90, "mma16", 64, "forward"): Config(
        128, 64, 8, 3
    ),  # 238 regs, 81920 B shared (35%), spill 0 B
    (90, "tf32", 128, "dkdv"): Config(16, 16, 8, 2, 64),  # 172 regs, 8192 B shared (4%), spill 0 B
    (90, "tf32", 128, "dq"): Config(32, 16, 4, 2, 64),  # 218 regs, 12288 B shared (5%), spill 0 B
    (90, "tf32", 128, "forward"): Config(
        64, 32, 8, 2, 64
    ),  # 249 regs, 65536 B shared (28%), spill 0 B
    (90, "tf32", 256, "dkdv"): Config(16, 32, 8, 1),  # 255 regs, 114688 B shared (49%), spill 0 B
    (90, "tf32", 256, "dq"): Config(32, 16, 8, 1),  # 255 regs, 81920 B shared (35%), spill 0 B
    (90, "tf32", 256, "forward"): Config(
        64, 32, 8, 1, 64
    ),  # 252 regs, 65536 B shared (28%), spill 0 B
    (90, "tf32", 64, "dkdv"): Config(16, 16, 8, 3),  # 195 regs, 23424 B shared (10%), spill 0 B
    (90, "tf32", 64, "dq"): Config(32, 16, 4, 3),  # 174 regs, 32768 B shared (14%), spill 0 B
    (90, "tf32", 64, "forward"): Config(64, 32, 8, 3),  # 234 regs, 90112 B shared (39%), spill 0 B
}

# Heavy tier: a softcap or dropout (per-score tanh, hash and selects hold registers).
_HEAVY: dict[_Key, Config] = {
    (80, "fma32", 128, "dkdv"): Config(16, 16, 8, 2),  # 211 regs, 8192 B shared (5%), spill 0 B
    (80, "fma32", 128, "dq"): Config(16, 16, 4, 2),  # 200 regs, 8192 B shared (5%), spill 0 B
    (80, "fma32", 128, "forward"): Config(32, 16, 4, 2),  # 255 regs, 8192 B shared (5%), spill 0 B
    (80, "fma32", 256, "dkdv"): Config(16, 16, 4, 1),  # 233 regs, 36864 B shared (22%), spill 0 B
    (80, "fma32", 256, "dq"): Config(16, 16, 8, 1),  # 170 regs, 16384 B shared (10%), spill 0 B
    (80, "fma32", 256, "forward"): Config(
        32, 16, 4, 1
    ),  # 222 regs, 22528 B shared (13%), spill 0 B
    (80, "fma32", 64, "dkdv"): Config(16, 32, 4, 3),  # 223 regs, 12288 B shared (7%), spill 0 B
    (80, "fma32", 64, "dq"): Config(32, 16, 4, 3),  # 220 regs, 12288 B shared (7%), spill 0 B
    (80, "fma32", 64, "forward"): Config(32, 32, 4, 3),  # 249 regs, 16384 B shared (10%), spill 0 B
    (80, "fma64", 128, "dkdv"): Config(16, 16, 4, 1),  # 245 regs, 43008 B shared (26%), spill 0 B
    (80, "fma64", 128, "dq"): Config(32, 16, 4, 1),  # 255 regs, 16384 B shared (10%), spill 24 B
    (80, "fma64", 128, "forward"): Config(
        32, 16, 4, 1
    ),  # 255 regs, 28672 B shared (17%), spill 0 B
    (80, "fma64", 256, "dkdv"): Config(16, 16, 8, 1),  # 254 regs, 73728 B shared (44%), spill 0 B
    (80, "fma64", 256, "dq"): Config(16, 16, 8, 1),  # 255 regs, 32768 B shared (20%), spill 0 B
    (80, "fma64", 256, "forward"): Config(
        32, 16, 4, 1
    ),  # 255 regs, 45056 B shared (27%), spill 252 B
    (80, "fma64", 64, "dkdv"): Config(16, 32, 4, 2),  # 255 regs, 12288 B shared (7%), spill 32 B
    (80, "fma64", 64, "dq"): Config(32, 16, 4, 2),  # 240 regs, 12288 B shared (7%), spill 0 B
    (80, "fma64", 64, "forward"): Config(32, 16, 4, 2),  # 240 regs, 12288 B shared (7%), spill 0 B
    (80, "mma16", 128, "dkdv"): Config(16, 32, 4, 3),  # 252 regs, 34816 B shared (21%), spill 0 B
    (80, "mma16", 128, "dq"): Config(32, 16, 4, 3),  # 220 regs, 34944 B shared (21%), spill 0 B
    (80, "mma16", 128, "forward"): Config(
        64, 32, 8, 3
    ),  # 248 regs, 53504 B shared (32%), spill 0 B
    (80, "mma16", 256, "dkdv"): Config(16, 32, 8, 2),  # 248 regs, 50688 B shared (30%), spill 0 B
    (80, "mma16", 256, "dq"): Config(32, 16, 4, 2, 64),  # 254 regs, 8192 B shared (5%), spill 0 B
    (80, "mma16", 256, "forward"): Config(
        32, 16, 4, 2
    ),  # 231 regs, 34880 B shared (21%), spill 0 B
    (80, "mma16", 64, "dkdv"): Config(16, 32, 4, 3),  # 228 regs, 18432 B shared (11%), spill 0 B
    (80, "mma16", 64, "dq"): Config(32, 32, 4, 3),  # 228 regs, 28928 B shared (17%), spill 0 B
    (80, "mma16", 64, "forward"): Config(32, 32, 4, 3),  # 250 regs, 24832 B shared (15%), spill 0 B
    (80, "tf32", 128, "dkdv"): Config(16, 16, 4, 2),  # 238 regs, 42496 B shared (25%), spill 0 B
    (80, "tf32", 128, "dq"): Config(32, 16, 4, 2),  # 255 regs, 51264 B shared (31%), spill 0 B
    (80, "tf32", 128, "forward"): Config(
        64, 32, 8, 2, 64
    ),  # 255 regs, 24576 B shared (15%), spill 0 B
    (80, "tf32", 256, "dkdv"): Config(16, 32, 8, 1),  # 255 regs, 114688 B shared (69%), spill 0 B
    (80, "tf32", 256, "dq"): Config(32, 16, 4, 1, 64),  # 254 regs, 28672 B shared (17%), spill 0 B
    (80, "tf32", 256, "forward"): Config(
        32, 16, 4, 1, 64
    ),  # 255 regs, 28672 B shared (17%), spill 0 B
    (80, "tf32", 64, "dkdv"): Config(16, 32, 4, 3),  # 255 regs, 33792 B shared (20%), spill 0 B
    (80, "tf32", 64, "dq"): Config(32, 32, 4, 3),  # 250 regs, 49408 B shared (30%), spill 0 B
    (80, "tf32", 64, "forward"): Config(32, 32, 4, 3),  # 255 regs, 53504 B shared (32%), spill 0 B
    (90, "fma32", 128, "dkdv"): Config(16, 16, 8, 2),  # 176 regs, 8192 B shared (4%), spill 0 B
    (90, "fma32", 128, "dq"): Config(32, 16, 4, 2),  # 255 regs, 8192 B shared (4%), spill 0 B
    (90, "fma32", 128, "forward"): Config(32, 16, 4, 2),  # 254 regs, 8192 B shared (4%), spill 0 B
    (90, "fma32", 256, "dkdv"): Config(16, 16, 4, 1),  # 190 regs, 36864 B shared (16%), spill 0 B
    (90, "fma32", 256, "dq"): Config(16, 16, 8, 1),  # 178 regs, 16384 B shared (7%), spill 0 B
    (90, "fma32", 256, "forward"): Config(
        32, 32, 4, 1
    ),  # 185 regs, 40960 B shared (18%), spill 0 B
    (90, "fma32", 64, "dkdv"): Config(16, 32, 4, 3),  # 213 regs, 12288 B shared (5%), spill 0 B
    (90, "fma32", 64, "dq"): Config(32, 32, 4, 3),  # 251 regs, 16384 B shared (7%), spill 0 B
    (90, "fma32", 64, "forward"): Config(32, 32, 4, 3),  # 228 regs, 16384 B shared (7%), spill 0 B
    (90, "fma64", 128, "dkdv"): Config(16, 16, 4, 1),  # 255 regs, 40960 B shared (18%), spill 64 B
    (90, "fma64", 128, "dq"): Config(32, 16, 4, 1),  # 255 regs, 16384 B shared (7%), spill 44 B
    (90, "fma64", 128, "forward"): Config(
        32, 16, 4, 1
    ),  # 254 regs, 28672 B shared (12%), spill 0 B
    (90, "fma64", 256, "dkdv"): Config(16, 16, 8, 1),  # 255 regs, 73728 B shared (32%), spill 56 B
    (90, "fma64", 256, "dq"): Config(16, 16, 4, 1),  # 255 regs, 32768 B shared (14%), spill 168 B
    (90, "fma64", 256, "forward"): Config(
        16, 16, 4, 1
    ),  # 246 regs, 40960 B shared (18%), spill 0 B
    (90, "fma64", 64, "dkdv"): Config(16, 32, 4, 2),  # 255 regs, 12288 B shared (5%), spill 128 B
    (90, "fma64", 64, "dq"): Config(32, 16, 4, 2),  # 250 regs, 12288 B shared (5%), spill 0 B
    (90, "fma64", 64, "forward"): Config(32, 16, 4, 2),  # 245 regs, 12288 B shared (5%), spill 0 B
    (90, "mma16", 128, "dkdv"): Config(16, 32, 4, 3),  # 218 regs, 34816 B shared (15%), spill 0 B
    (90, "mma16", 128, "dq"): Config(32, 16, 4, 3),  # 212 regs, 34944 B shared (15%), spill 0 B
    (90, "mma16", 128, "forward"): Config(
        64, 32, 8, 3
    ),  # 248 regs, 73984 B shared (32%), spill 0 B
    (90, "mma16", 256, "dkdv"): Config(16, 32, 8, 2),  # 222 regs, 50688 B shared (22%), spill 0 B
    (90, "mma16", 256, "dq"): Config(32, 16, 4, 2, 64),  # 248 regs, 8192 B shared (4%), spill 0 B
    (90, "mma16", 256, "forward"): Config(
        64, 32, 8, 2, 64
    ),  # 253 regs, 40960 B shared (18%), spill 0 B
    (90, "mma16", 64, "dkdv"): Config(32, 128, 8, 3),  # 244 regs, 63488 B shared (27%), spill 0 B
    (90, "mma16", 64, "dq"): Config(64, 32, 8, 3),  # 252 regs, 49408 B shared (21%), spill 0 B
    (90, "mma16", 64, "forward"): Config(
        128, 64, 8, 3
    ),  # 253 regs, 82432 B shared (35%), spill 0 B
    (90, "tf32", 128, "dkdv"): Config(16, 32, 4, 2),  # 250 regs, 59904 B shared (26%), spill 0 B
    (90, "tf32", 128, "dq"): Config(32, 16, 4, 2),  # 255 regs, 51264 B shared (22%), spill 0 B
    (90, "tf32", 128, "forward"): Config(
        64, 32, 8, 2, 64
    ),  # 247 regs, 65536 B shared (28%), spill 0 B
    (90, "tf32", 256, "dkdv"): Config(16, 32, 8, 1),  # 249 regs, 114688 B shared (49%), spill 0 B
    (90, "tf32", 256, "dq"): Config(16, 16, 8, 1, 64),  # 138 regs, 24576 B shared (11%), spill 0 B
    (90, "tf32", 256, "forward"): Config(
        64, 32, 8, 1, 64
    ),  # 255 regs, 65536 B shared (28%), spill 0 B
    (90, "tf32", 64, "dkdv"): Config(16, 32, 4, 3),  # 198 regs, 33792 B shared (15%), spill 0 B
    (90, "tf32", 64, "dq"): Config(32, 32, 4, 3),  # 250 regs, 49408 B shared (21%), spill 0 B
    (90, "tf32", 64, "forward"): Config(64, 32, 8, 3),  # 246 regs, 90368 B shared (39%), spill 0 B
}


# Triton 3.6 (the Triton of PyTorch 2.11's CUDA builds) allocates registers differently: where
# the tiles above spill under it, the search's choice under 3.6 (same method, same comments).
# float64 with a bool mask does not compile under 3.6 at all (the launcher refuses it); its
# other float64 modes search like the rest.  Where nothing fits under 3.6 (float32 dK/dV at
# d = 128, heavy, sm_90: every candidate spills 20 B or more) the newest tiles stay.
_LIGHT_3_6: dict[_Key, Config] = {
    (80, "fma32", 64, "forward"): Config(64, 16, 4, 3),  # 238 regs, 24576 B shared (15%), spill 0 B
    (80, "fma32", 128, "dkdv"): Config(16, 16, 8, 2),  # 102 regs, 21504 B shared (13%), spill 0 B
    (80, "fma64", 256, "forward"): Config(
        16, 16, 4, 1
    ),  # 255 regs, 40960 B shared (25%), spill 0 B
    (80, "mma16", 128, "dkdv"): Config(16, 32, 4, 3),  # 255 regs, 34688 B shared (21%), spill 0 B
    (80, "mma16", 128, "forward"): Config(
        32, 32, 4, 3
    ),  # 255 regs, 45056 B shared (27%), spill 0 B
    (80, "mma16", 256, "dq"): Config(32, 16, 4, 2, 64),  # 255 regs, 14336 B shared (9%), spill 0 B
    (80, "mma16", 256, "forward"): Config(
        32, 16, 4, 2
    ),  # 255 regs, 34816 B shared (21%), spill 0 B
    (80, "tf32", 64, "dkdv"): Config(16, 32, 8, 3),  # 255 regs, 31424 B shared (19%), spill 0 B
    (80, "tf32", 128, "dkdv"): Config(16, 32, 8, 2),  # 255 regs, 59840 B shared (36%), spill 0 B
    (80, "tf32", 256, "dkdv"): Config(
        16, 32, 8, 1, 64
    ),  # 252 regs, 47104 B shared (28%), spill 0 B
    (90, "fma32", 64, "dkdv"): Config(16, 16, 4, 3),  # 140 regs, 17408 B shared (7%), spill 0 B
    (90, "fma32", 64, "forward"): Config(64, 16, 4, 3),  # 224 regs, 24576 B shared (11%), spill 0 B
    (90, "fma32", 256, "dkdv"): Config(16, 16, 8, 1),  # 124 regs, 37888 B shared (16%), spill 0 B
    (90, "fma64", 128, "dkdv"): Config(16, 16, 4, 1),  # 255 regs, 43008 B shared (19%), spill 64 B
    (90, "mma16", 64, "dkdv"): Config(16, 32, 4, 3),  # 245 regs, 18304 B shared (8%), spill 0 B
    (90, "mma16", 64, "forward"): Config(64, 32, 8, 3),  # 206 regs, 40960 B shared (18%), spill 0 B
    (90, "mma16", 128, "dkdv"): Config(16, 16, 4, 3),  # 250 regs, 25984 B shared (11%), spill 0 B
    (90, "tf32", 64, "dkdv"): Config(16, 32, 4, 3),  # 255 regs, 31424 B shared (14%), spill 0 B
    (90, "tf32", 128, "dq"): Config(64, 32, 8, 2, 64),  # 255 regs, 65536 B shared (28%), spill 0 B
    (90, "tf32", 256, "dkdv"): Config(16, 16, 8, 1),  # 167 regs, 81920 B shared (35%), spill 0 B
    (90, "tf32", 256, "forward"): Config(32, 16, 8, 1),  # 202 regs, 51456 B shared (22%), spill 0 B
}

_HEAVY_3_6: dict[_Key, Config] = {
    (80, "mma16", 128, "dkdv"): Config(16, 32, 8, 3),  # 243 regs, 34816 B shared (21%), spill 0 B
    (80, "mma16", 128, "forward"): Config(
        32, 32, 4, 3
    ),  # 255 regs, 45312 B shared (27%), spill 0 B
    (80, "mma16", 256, "dkdv"): Config(
        16, 32, 8, 2, 64
    ),  # 225 regs, 22528 B shared (13%), spill 0 B
    (80, "tf32", 64, "dkdv"): Config(16, 32, 8, 3),  # 241 regs, 31488 B shared (19%), spill 0 B
    (80, "tf32", 64, "dq"): Config(32, 16, 4, 3),  # 227 regs, 36992 B shared (22%), spill 0 B
    (80, "tf32", 256, "dkdv"): Config(
        16, 32, 8, 1, 64
    ),  # 254 regs, 47104 B shared (28%), spill 0 B
    (80, "tf32", 256, "dq"): Config(32, 16, 8, 1, 64),  # 255 regs, 28672 B shared (17%), spill 0 B
    (90, "fma32", 64, "dkdv"): Config(16, 16, 4, 3),  # 114 regs, 17408 B shared (7%), spill 0 B
    (90, "fma32", 128, "dq"): Config(16, 16, 4, 2),  # 158 regs, 12288 B shared (5%), spill 0 B
    (90, "mma16", 64, "dkdv"): Config(16, 64, 4, 3),  # 255 regs, 31744 B shared (14%), spill 0 B
    (90, "mma16", 64, "forward"): Config(64, 32, 8, 3),  # 209 regs, 41216 B shared (18%), spill 0 B
    (90, "mma16", 128, "dkdv"): Config(16, 32, 8, 3),  # 220 regs, 34816 B shared (15%), spill 0 B
    (90, "tf32", 64, "dkdv"): Config(16, 32, 8, 3),  # 215 regs, 31488 B shared (14%), spill 0 B
    (90, "tf32", 64, "dq"): Config(32, 16, 4, 3),  # 228 regs, 36992 B shared (16%), spill 0 B
    (90, "tf32", 128, "dkdv"): Config(16, 32, 8, 2),  # 246 regs, 59904 B shared (26%), spill 0 B
    (90, "tf32", 256, "dkdv"): Config(16, 16, 8, 1),  # 253 regs, 81920 B shared (35%), spill 0 B
    (90, "tf32", 256, "forward"): Config(
        32, 16, 4, 1, 64
    ),  # 255 regs, 28672 B shared (12%), spill 0 B
}

# (light, heavy) by the Triton (major, minor) each was searched under: a Triton takes the newest
# table not newer than itself (`triton_version`), one older than them all the oldest.  3.7 and
# 3.8 take 3.6's, which spills less under them than the newest (their quick reports on sm_90:
# 1 and 3 float32 kernels at 8-16 B; not searched under them)
TABLES: dict[tuple[int, int], tuple[dict[_Key, Config], dict[_Key, Config]]] = {
    (3, 6): ({**_TABLE, **_LIGHT_3_6}, {**_HEAVY, **_HEAVY_3_6}),
    (3, 9): (_TABLE, _HEAVY),
}


# the distributions that install the `triton` module: PyPI's, and PyTorch's own builds
_DISTRIBUTIONS = ("triton", "pytorch-triton", "pytorch-triton-rocm", "pytorch-triton-xpu")


@functools.cache
def triton_version() -> tuple[int, int]:
    """(major, minor) of the installed Triton, from its distribution's metadata (no import), else
    from ``triton.__version__``; the newest table's when Triton is not installed."""
    for name in _DISTRIBUTIONS:
        try:
            return release(importlib.metadata.version(name))
        except importlib.metadata.PackageNotFoundError:
            continue
    if importlib.util.find_spec("triton") is None:
        return max(TABLES)
    import triton  # type: ignore[import-untyped]

    return release(triton.__version__)


def triton_version_text() -> str:
    """`triton_version` as text, e.g. "3.6"."""
    return ".".join(map(str, triton_version()))


def release(version: str) -> tuple[int, int]:
    """(major, minor) of a version string such as "3.6.0" or "2.4.0rc1"."""
    major, minor = (int(re.match(r"\d*", part)[0] or 0) for part in (*version.split("."), "0")[:2])  # type: ignore[index]
    return major, minor


def compiles(float64: bool, keep_mask: bool, version: tuple[int, int] | None = None) -> bool:
    """Whether a Triton of ``version`` (None: the installed one) compiles the kernels of a call
    in float64 (or not) with a bool mask (or not): Triton 3.6 stops on float64 dots beside a
    bool mask's loads, for sm_80 and sm_90 alike (the compile report under it)."""
    version = triton_version() if version is None else version
    return not (version < (3, 7) and float64 and keep_mask)


def table_for(version: tuple[int, int]) -> tuple[dict[_Key, Config], dict[_Key, Config]]:
    """(light, heavy) tiers of the table a Triton of ``version`` (major, minor) takes."""
    fitting = [v for v in TABLES if v <= version]
    return TABLES[max(fitting) if fitting else min(TABLES)]


def choose(
    kernel: str,
    kind: str,
    head_dim: int,
    arch: int,
    heavy: bool = False,
    version: tuple[int, int] | None = None,
) -> Config:
    """The Config of ``kernel`` ("forward", "delta", "dkdv", "dq") on sm_<arch>.

    kind: how the dots run (`KINDS`, `dot_kind`); head_dim: the larger of d
    and dv (<= 256); heavy: the call has a softcap or dropout (per-score work
    that holds registers); version: the Triton (major, minor) that compiles
    it (None: the installed one, `triton_version`).
    """
    if kernel == "delta":  # rows of O and dO in registers: 8 KiB of each a block, 16..64 rows
        rows = 8192 // (padded_head_dim(head_dim) * _BYTES[kind])
        return Config(min(64, max(16, rows)), 0, 4, 1)
    light, heavy_tier = table_for(triton_version() if version is None else version)
    tier = heavy_tier if heavy else light
    return tier[family(arch), kind, padded_head_dim(head_dim), kernel]
