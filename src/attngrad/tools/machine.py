"""The machine a figure was measured on: processor, threads, matmul rate and FMA peak.

Every command and benchmark that prints a figure prints `Machine.line` above it and
adds `Machine.columns` to each CSV row, so a number never travels without the machine
it came from.  The matmul rate is calibrated by time, not by size (`gemm_rate`): a
2048² float16 GEMM takes minutes on a CPU without float16 matmul units and
milliseconds on a GPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from attngrad.core.contract import dtype_name
from attngrad.core.host import processor_name

__all__ = [
    "BUSY",
    "BUSY_NOTE",
    "MAX_GEMM_SIZE",
    "Machine",
    "fma_rate",
    "gemm_rate",
    "of_peak",
    "probe",
    "processor_name",
    "tile_rate",
]

# Growth stops here: on a GPU even 8192³ takes milliseconds, and the rate has long
# stopped rising with the size.
MAX_GEMM_SIZE = 8192
_FIRST_SIZE = 64
_ALIGN = 64  # sizes stay multiples of a BLAS-friendly block


@dataclass(frozen=True)
class Machine:
    """Where figures were measured: ``processor`` (CPU model or GPU name), intra-op
    ``threads`` (`torch.get_num_threads`) and the ``gemm_size``² GEMM rate in
    ``gemm_dtype``, GFLOP/s; on CPU, the tile products' rate and the float32 FMA peak
    (`fma_rate`), both times the threads, where fused's kernels are built."""

    processor: str
    threads: int
    gemm_dtype: str
    gemm_size: int
    gemm_gflops: float
    tile_gflops: float | None = None
    fma_gflops: float | None = None

    def of_peak(self, gflops: float) -> str:
        """A rate as a fraction of the FMA peak, e.g. ``"71.8%"`` (``"-"`` where unmeasured,
        `BUSY` where the rate beat the peak: see `of_peak`)."""
        return "-" if not self.fma_gflops else of_peak(gflops, self.fma_gflops)

    @property
    def ceiling_gflops(self) -> float:
        """What attention's products can reach here: the tile rate where measured, else the GEMM's."""
        return max(self.gemm_gflops, self.tile_gflops or 0.0)

    def line(self) -> str:
        """One header line, e.g. ``machine: AMD EPYC, 2 threads, float32 GEMM 1536² 61.2 GFLOP/s``
        (then the tile products' ceiling, where measured)."""
        tiles = (
            ""
            if self.tile_gflops is None
            else f", tile products {self.tile_gflops:.1f} GFLOP/s ({self.threads} x one thread's)"
        )
        peak = (
            ""
            if self.fma_gflops is None
            else f", float32 FMA peak {self.fma_gflops:.1f} GFLOP/s ({self.capability})"
        )
        return (
            f"machine: {self.processor}, {self.threads} threads, {self.gemm_dtype} GEMM "
            f"{self.gemm_size}² {self.gemm_gflops:.1f} GFLOP/s{tiles}{peak}"
        )

    @property
    def capability(self) -> str:
        """The vector width ATen runs at here (``ATEN_CPU_CAPABILITY`` lowers it)."""
        return str(torch.backends.cpu.get_cpu_capability())

    def columns(self) -> dict[str, object]:
        """The same facts as CSV columns, appended to every row."""
        return {
            "machine": self.processor,
            "threads": self.threads,
            "gemm_dtype": self.gemm_dtype,
            "gemm_size": self.gemm_size,
            "gemm_gflops": f"{self.gemm_gflops:.6g}",
            "tile_gflops": "" if self.tile_gflops is None else f"{self.tile_gflops:.6g}",
            "fma_peak_gflops": "" if self.fma_gflops is None else f"{self.fma_gflops:.6g}",
            "capability": self.capability,
        }


# What a fraction of the FMA peak reads where a rate beat the peak, and why it can
BUSY = "busy*"
BUSY_NOTE = (
    "* faster than the FMA peak, which no kernel can be: the machine was busy while the "
    "peak was probed, so it came out low; fractions of it are unreliable -- measure again "
    "on a quiet machine"
)


def of_peak(gflops: float, peak_gflops: float) -> str:
    """``gflops`` as a fraction of the FMA peak, e.g. ``"71.8%"``; `BUSY` above the peak
    (footnoted by `BUSY_NOTE`), where a figure over 100% would only mislead.

    >>> of_peak(71.8, 100.0), of_peak(141.0, 100.0)
    ('71.8%', 'busy*')
    """
    return BUSY if gflops > peak_gflops else f"{gflops / peak_gflops:.1%}"


def _seconds(fn: Callable[[], object], device: torch.device) -> float:
    """Wall-clock seconds of one call, the device drained before and after."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def gemm_rate(
    dtype: torch.dtype = torch.float32,
    device: torch.device | None = None,
    budget: float = 0.2,
    repeats: int = 3,
    note: Callable[[str], None] | None = None,
) -> tuple[int, float]:
    """(n, GFLOP/s): the size the calibration settled on and the best rate there.

    Square GEMMs ``[n, n] @ [n, n]`` (2·n³ FLOP) grow from n = 64, each warmed up once
    and timed twice; the next size aims at ``budget`` seconds (the cube root of the time
    ratio, at most twice the size) and growth stops from ``budget / 2`` on (or at
    `MAX_GEMM_SIZE`), so the calibration takes a few times ``budget``.  The rate is that
    of the fastest of ``repeats`` products at the final size.  ``note`` hears one line
    per size.
    """
    if budget <= 0:
        raise ValueError(f"budget must be a positive number of seconds, got {budget}; try 0.2")
    if repeats < 2:
        raise ValueError(f"repeats must be at least 2, got {repeats}; try 3")
    device = device or torch.device("cpu")
    size = _FIRST_SIZE
    while True:
        a, b = (torch.randn(size, size, device=device).to(dtype) for _ in range(2))
        out = torch.matmul(a, b)  # the warm-up, and the output every timed product reuses

        def product(a: torch.Tensor = a, b: torch.Tensor = b, out: torch.Tensor = out) -> None:
            torch.matmul(a, b, out=out)

        best = min(_seconds(product, device) for _ in range(2))  # the first may pay for setup
        if note is not None:
            note(f"GEMM {size}² {str(dtype).removeprefix('torch.')}: {best:.3f} s")
        if best >= budget / 2 or size >= MAX_GEMM_SIZE:
            break
        grow = min(2.0, (budget / max(best, 1e-9)) ** (1 / 3))
        size = min(MAX_GEMM_SIZE, _ALIGN * max(size // _ALIGN + 1, round(size * grow / _ALIGN)))
    for _ in range(repeats - 2):
        best = min(best, _seconds(product, device))
    return size, 2.0 * size**3 / best / 1e9


def probe(
    dtype: torch.dtype = torch.float32,
    device: torch.device | None = None,
    budget: float = 0.2,
    note: Callable[[str], None] | None = None,
) -> Machine:
    """The `Machine` here: its processor, thread count and calibrated ``dtype`` GEMM rate,
    and on CPU the ceiling of attention's tile products (`tile_rate`)."""
    size, gflops = gemm_rate(dtype, device, budget, note=note)
    cpu = device is None or device.type == "cpu"
    return Machine(
        processor=processor_name(device),
        threads=torch.get_num_threads(),
        gemm_dtype=dtype_name(dtype),
        gemm_size=size,
        gemm_gflops=gflops,
        tile_gflops=tile_rate() if cpu and dtype != torch.float64 else None,
        fma_gflops=fma_rate() if cpu else None,
    )


def tile_rate() -> float | None:
    """GFLOP/s the CPU's tile products reach: the fastest engine of strategy "fused"
    (oneDNN's brgemm, its own micro-kernel, the BLAS) on one thread, over attention's
    tile shapes, times the threads; None where fused's kernels are not built (a figure is
    no reason to compile them) or cannot be.

    This, not a multi-threaded square GEMM, is the ceiling of a tiled attention: each
    thread runs its own tiles' products.
    """
    from attngrad.strategies.fused import build

    library = build.loaded_or_built()
    if library is None or not library.rates:
        return None
    return max(library.rates.values()) * torch.get_num_threads()


def fma_rate() -> float | None:
    """The CPU's float32 FMA peak, GFLOP/s: independent vector FMAs in registers, at the
    vector width ATen runs at, on every intra-op thread at once, summed
    (`attngrad.strategies.fused.build.fma_peak`); None where fused's kernels are not
    built (a figure is no reason to compile them) or cannot be.  No kernel on these
    threads can run faster: every attention rate is judged as a fraction of it."""
    from attngrad.strategies.fused import build

    if build.loaded_or_built() is None:
        return None
    return build.fma_peak(threads=True)
