"""Building and loading strategy "fused"'s C++ kernels, once per torch version and CPU.

The kernels (``csrc/``) are compiled the PyTorch way, with
`torch.utils.cpp_extension` (ninja and the system's C++ compiler), into
``<cache>/fused/<tag>/`` (`attngrad.core.cache.cache_root`: $ATTNGRAD_CACHE_DIR,
else ~/.cache/attngrad).  The tag names the torch version, the CPU model, the
vector width ATen runs at (`torch.backends.cpu.get_cpu_capability`, which
``ATEN_CPU_CAPABILITY`` lowers) and a digest of the sources, so a process finds
a library built for exactly its torch and CPU and loads it without compiling:
only the first call on a machine needs a compiler.  ``attngrad build`` builds
ahead of time.

The library registers the ops ``attngrad_fused::forward``, ``::backward``, ``::tangent``
(forward mode, ``csrc/tangent.h``), ``::program_rows`` (score programs, ``csrc/program.h``,
run on rows: the test op), ``::program_ops``, ``::product_rate`` and ``::fma_peak`` with
``TORCH_LIBRARY``; `load` adds the fake (meta) kernels of forward, backward and
program_rows, so ``torch.compile(fullgraph=True)`` traces them.  Loading also
settles the engine of the tile products (`Library.engine`): each engine of
``csrc/products.h`` is timed on the tiles' shapes and on a small attention
call, once per library, and the one with the fastest attention is kept beside
it (``ATTNGRAD_FUSED_ENGINE`` overrides, for benchmarks).
"""

from __future__ import annotations

import contextlib
import contextvars
import glob
import hashlib
import importlib.metadata
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from attngrad.core.cache import cache_root
from attngrad.core.host import processor_name

__all__ = [
    "ENGINES",
    "NAME",
    "BuildError",
    "Library",
    "because",
    "capability",
    "fma_peak",
    "library_dir",
    "load",
    "loaded_or_built",
    "missing_tools",
    "product_rate",
    "tile_shapes",
    "unavailable_reason",
]

NAME = "attngrad_fused"
SOURCE_DIR = Path(__file__).parent / "csrc"
SOURCES = ("fused.cpp",)
HEADERS = ("elementary.h", "peak.h", "products.h", "program.h", "second.h", "tangent.h", "tile.h")
# what a compiler without OpenMP says (not just any error: every command line has -fopenmp)
_NO_OPENMP = re.compile(r"omp\.h|unsupported option '-fopenmp'|cannot find -l(?:g|i)?omp")
ENGINES = ("brgemm", "micro", "aten")  # the order of csrc/products.h's Engine

# The vector width at::vec compiles for: ATen's own names and the flags that enable them.
_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
}


class BuildError(RuntimeError):
    """The kernels could not be built or loaded here; the message says what to install."""


@dataclass(frozen=True)
class Library:
    """The loaded kernels: where they are, and the tile products' engine.

    rates: GFLOP/s of each engine on one thread over `tile_shapes` (the
    slowest shape's): what the products alone reach.  The engine itself was
    chosen by a small attention call's time (`_engine`).  peak: one core's
    float32 FMA peak at the vector width the library was built for, GFLOP/s
    (`fma_peak`): the limit every rate is a fraction of.
    """

    path: Path
    engine: str
    rates: dict[str, float]
    peak: float

    @property
    def engine_id(self) -> int:
        """The engine as the ops take it."""
        return ENGINES.index(self.engine)


def capability() -> str:
    """The vector width ATen runs at here: "AVX512", "AVX2", "DEFAULT", ..."""
    return str(torch.backends.cpu.get_cpu_capability())


def _digest() -> str:
    h = hashlib.sha256()
    for name in (*SOURCES, *HEADERS):
        h.update((SOURCE_DIR / name).read_bytes())
    h.update(" ".join(_flags()).encode())
    return h.hexdigest()[:12]


def _flags() -> list[str]:
    cap = capability()
    defines = [f"-DCPU_CAPABILITY={cap}", f"-DCPU_CAPABILITY_{cap}"] if cap in _FLAGS else []
    # OpenMP: at::parallel_for is a header template, threaded only where the extension itself
    # is compiled with OpenMP; it then shares torch's runtime (the same libgomp.so.1 soname)
    return ["-O3", "-fopenmp", *_FLAGS.get(cap, []), *defines]


def library_dir() -> Path:
    """``<cache>/fused/<torch version>-<CPU>-<capability>-<sources' digest>``."""
    cpu = hashlib.sha256(processor_name().encode()).hexdigest()[:8]
    version = importlib.metadata.version("torch")
    return cache_root() / "fused" / f"torch{version}-cpu{cpu}-{capability()}-{_digest()}"


def _library_file(directory: Path) -> Path:
    return directory / f"{NAME}.so"


# A build lock older than this was left by a build that was killed (torch's lock file is
# removed when a build ends, also when it fails).
STALE_LOCK_SECONDS = 600


def _with_ninja_on_path() -> None:
    """Put this environment's scripts (where pip put ninja) on PATH: an unactivated venv's
    ``bin`` is not, and torch looks for ``ninja`` there."""
    scripts = sysconfig.get_path("scripts")
    path = os.environ.get("PATH", "")
    if scripts and scripts not in path.split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join([scripts, path]) if path else scripts


def missing_tools() -> str | None:
    """What to install before the kernels can be compiled, or None."""
    from torch.utils.cpp_extension import is_ninja_available

    compiler = os.environ.get("CXX", "c++")
    words = shlex.split(compiler) or ["c++"]  # e.g. CXX="ccache g++": each word must exist
    missing = [w for w in words if shutil.which(w) is None]
    if missing:
        return (
            f"no C++ compiler was found ({missing[0]!r} of $CXX={compiler!r} is not on PATH): "
            "install one (e.g. `apt install g++`, `dnf install gcc-c++`) or point $CXX at it"
        )
    _with_ninja_on_path()
    if not is_ninja_available():
        return "ninja is not installed: `pip install ninja`"
    return None


def _check_lock(directory: Path) -> None:
    """BuildError on a build lock a killed build left behind (a later build would wait on it)."""
    lock = directory / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except OSError:
        return
    if age > STALE_LOCK_SECONDS:
        raise BuildError(
            f"strategy='fused' found the lock of a build that did not finish ({lock}, "
            f"{age / 60:.0f} minutes old): run `attngrad build --force` to build again."
        )


def _compile(directory: Path, quiet: bool) -> None:
    missing = missing_tools()
    if missing is not None:
        raise BuildError(f"strategy='fused' compiles C++ kernels once per machine, but {missing}.")
    from torch.utils.cpp_extension import load as load_extension

    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise BuildError(
            f"strategy='fused' cannot write its build to {directory} ({e.strerror}): point "
            "$ATTNGRAD_CACHE_DIR at a writable folder."
        ) from e
    _check_lock(directory)
    if not quiet:
        print(
            f"attngrad: {_why.get()}, and this machine has no build of them for torch "
            f"{torch.__version__} ({capability()}) yet: compiling {', '.join(SOURCES)} into "
            f"{directory} now, once per machine and torch version -- {_ESTIMATE} (`attngrad "
            "build` does it ahead of time) ...",
            file=sys.stderr,
            flush=True,
        )
    start = time.perf_counter()
    log = io.StringIO()
    try:
        with contextlib.redirect_stdout(log):
            load_extension(
                NAME,
                [str(SOURCE_DIR / s) for s in SOURCES],
                extra_cflags=_flags(),
                extra_ldflags=["-fopenmp"],
                extra_include_paths=[str(SOURCE_DIR)],
                build_directory=str(directory),
                is_python_module=False,
                verbose=False,
            )
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:  # a compiler that fails
        hint = (
            " The compiler has no OpenMP: with clang, install libomp (or use g++)."
            if _NO_OPENMP.search(str(e) + log.getvalue())
            else ""
        )
        raise BuildError(
            f"strategy='fused' could not compile its C++ kernels in {directory}: {e}\n"
            f"{log.getvalue()[-4000:]}{hint}"
        ) from e
    if not quiet:
        print(
            f"attngrad: compiled in {time.perf_counter() - start:.0f} s; measuring the tile "
            "products' engines and the FMA peak (a few seconds) ...",
            file=sys.stderr,
            flush=True,
        )
    _prune(directory)


# A build of other sources for the same torch and CPU is removed once no process has loaded
# it for this long: two checkouts of different versions on one machine (two venvs, a clone
# beside a working tree) each keep theirs while in use, where removing every other build at
# once deleted one under a process that was building or loading it.
UNUSED_SECONDS = 7 * 24 * 3600


def _prune(directory: Path) -> None:
    """Remove the builds of other sources for this torch and CPU (same tag, other digest)
    that no process has loaded for `UNUSED_SECONDS` (`_mark_used`)."""
    stem = directory.name.rsplit("-", 1)[0]
    cutoff = time.time() - UNUSED_SECONDS
    for other in directory.parent.glob(f"{glob.escape(stem)}-*"):
        if other != directory and other.is_dir() and other.stat().st_mtime < cutoff:
            shutil.rmtree(other, ignore_errors=True)


def _mark_used(directory: Path) -> None:
    """Note that a process loads this build now (its directory's mtime), which keeps it
    from `_prune`; a read-only cache is left as it is."""
    with contextlib.suppress(OSError):
        os.utime(directory)


_loaded: Library | None = None
_failure: BuildError | None = None
_lock = threading.Lock()

# What a first build says of its length: one C++ file at -O3, measured at 30-40 s on one
# core of a 2-core AMD EPYC (the compiler runs on one core whatever the machine has)
_ESTIMATE = "usually 30 to 60 s"
# Why the kernels are wanted now, as the first build says it (`because` sets it)
_why: contextvars.ContextVar[str] = contextvars.ContextVar(
    "why", default="strategy 'fused' runs on its C++ CPU kernels"
)


@contextlib.contextmanager
def because(why: str) -> Iterator[None]:
    """Within the block, a first build says ``why`` the kernels are wanted now, e.g.
    ``"strategy 'auto' takes fused's C++ kernels for CPU tensors"``.

    A no-op once the kernels are loaded, and under ``torch.compile``'s tracing, which
    cannot record a ContextVar's change (a first build there says the default reason)."""
    if torch.compiler.is_compiling() or _loaded is not None:
        yield
        return
    token = _why.set(why)
    try:
        yield
    finally:
        _why.reset(token)


def loaded_or_built() -> Library | None:
    """The kernels where this process loaded them or this machine built them already; None
    where using them would mean compiling first (a figure that can go without them does)."""
    if _loaded is not None:
        return _loaded
    if _failure is not None or not _library_file(library_dir()).exists():
        return None
    try:
        return load()
    except BuildError:
        return None


def load(quiet: bool = False) -> Library:
    """The kernels, compiled first when this torch and CPU have no library yet; once per process.

    BuildError when they cannot be built or loaded here (its message says what to do).
    """
    global _loaded, _failure
    if _loaded is not None:  # every call after the first: no lock on attention's path
        return _loaded
    with _lock:
        if _loaded is not None:
            return _loaded
        if _failure is not None:
            raise _failure
        directory = library_dir()
        try:
            path = _library_file(directory)
            if not path.exists():
                _compile(directory, quiet)
            _mark_used(directory)
            _load_library(path)
            _register_fakes()
            engine, rates, peak = _engine(directory)
        except BuildError as e:
            _failure = e
            raise
        _loaded = Library(path, engine, rates, peak)
        return _loaded


def _load_library(path: Path) -> None:
    """Load the ops once into this process; BuildError for a library that does not load."""
    if hasattr(torch.ops, NAME) and hasattr(getattr(torch.ops, NAME), "forward"):
        return
    try:
        torch.ops.load_library(str(path))  # type: ignore[no-untyped-call]
    except OSError as e:
        raise BuildError(
            f"strategy='fused' could not load {path} ({e}): run `attngrad build --force` to "
            "build it again."
        ) from e


@torch._dynamo.assume_constant_result  # type: ignore[untyped-decorator]
def unavailable_reason() -> str | None:
    """Why the kernels cannot run here (what to install), or None once they are loaded.

    A constant of the process: under torch.compile it is answered once, eagerly, while
    tracing (loading may compile, take a lock and measure: nothing to trace).
    """
    try:
        load()
    except BuildError as e:
        return str(e)
    return None


def tile_shapes(block_q: int = 128, block_k: int = 256, d: int = 64) -> list[tuple[int, int, int]]:
    """The products (M, N, K) of one tile: S = q k^T, O += P v, dK += dS^T q."""
    return [(block_q, block_k, d), (block_q, d, block_k), (block_k, d, block_q)]


def product_rate(engine: str, shape: tuple[int, int, int], flops: float = 4e7) -> float:
    """GFLOP/s of ``engine`` on products of ``shape`` (M, N, K), one thread, best of three."""
    m, n, k = shape
    reps = max(8, int(flops // (2 * m * n * k)))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the BLAS engine would otherwise thread a lone product
    try:
        rates = [
            torch.ops.attngrad_fused.product_rate(ENGINES.index(engine), m, n, k, reps)
            for _ in range(3)
        ]
    finally:
        torch.set_num_threads(threads)
    return float(max(rates))


# One probe of the FMA peak: well under a scheduler's time slice, well over the timer's
# resolution and a vector unit's warm-up
_PROBE_SECONDS = 1e-3


def fma_peak(seconds: float = 0.2, threads: bool = False) -> float:
    """The float32 FMA peak, GFLOP/s: independent vector FMAs in registers (``csrc/peak.h``)
    at the vector width the library was built for; of one core (on this thread), or with
    ``threads`` of the intra-op threads all probing at once (their sum: the clock every core
    keeps under load).

    Many short probes over about ``seconds``, the best kept: on a busy machine another
    process takes a core for whole time slices (milliseconds), so a probe shorter than one
    often runs alone where a long probe never does, and noise can only lower a rate.
    """
    probe = torch.ops.attngrad_fused.fma_peak
    start = time.perf_counter()
    probe(10**5, False)  # a first run sizes the others
    reps = max(10**4, int(10**5 * _PROBE_SECONDS / max(time.perf_counter() - start, 1e-7)))
    best, stop = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < stop:
        best = max(best, float(probe(reps, threads)))
    return best


def _attention_seconds(engine: str) -> float:
    """Seconds of one forward and backward and one forward-mode pass (O and O' along
    tangents of q, k, v) of the ops through ``engine`` (best of three): B=1, H=4, N=2048,
    d=64, float32, the default tiles, on the threads there are (at N=1024 the engines tie
    within the noise, most tiles being partial ones).  Forward mode weighs the
    products of a tall inner dimension (P v, P v', (P S') v: three of its six) that the
    first order has two of in seven, where the engines differ most at AVX2's width."""
    from attngrad.strategies.fused.strategy import BLOCK_K, BLOCK_Q

    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, 4, 2048, 64, generator=g) for _ in range(4))
    none = (None,) * 6
    ops, e = torch.ops.attngrad_fused, ENGINES.index(engine)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        o, stats = ops.forward(q, k, v, *none, 0.125, 0.0, 0, 1.0, BLOCK_Q, BLOCK_K, e)
        delta = (o * dout).sum(-1)
        ops.backward(
            dout, q, k, v, stats, delta, *none, 0.125, 0.0, 0, 1.0, BLOCK_Q, BLOCK_K, e, False
        )
        ops.forward_tangent(q, k, v, v, q, k, *none, None, 0.125, 0.0, 0, 1.0, BLOCK_Q, BLOCK_K, e)
        best = min(best, time.perf_counter() - start)
    return best


def _measure(directory: Path) -> tuple[dict[str, float], dict[str, float]]:
    """Each engine's product rate and attention time; BuildError when none runs."""
    rates, seconds = {}, {}
    for engine in ENGINES:
        with contextlib.suppress(RuntimeError):  # an engine this CPU lacks
            rates[engine] = min(product_rate(engine, s) for s in tile_shapes())
            seconds[engine] = _attention_seconds(engine)
    if not seconds:
        raise BuildError(
            f"strategy='fused' loaded {directory} but none of its engines "
            f"({', '.join(ENGINES)}) runs here: run `attngrad build --force`."
        )
    return rates, seconds


# Attention times this close (best of three) are a tie: runs of the same build differ by more.
_TIE = 0.02


def _fastest(seconds: dict[str, float], rates: dict[str, float]) -> str:
    """The engine of the fastest attention; among those within `_TIE` of it, the one whose
    products run fastest (`product_rate`): a tie in the call's time, which the noise decides,
    is broken by what the products alone reach."""
    best = min(seconds.values())
    tied = [e for e, t in seconds.items() if t <= best * (1 + _TIE)]
    return max(tied, key=lambda e: rates.get(e, 0.0))


@contextlib.contextmanager
def _alone(lock: Path) -> Iterator[None]:
    """Hold an exclusive lock on the file ``lock`` (made if missing) while the block runs:
    other processes entering the block wait.  The OS releases it when its process ends, so a
    killed measurement leaves nothing to wait on; without ``fcntl`` (Windows) or a writable
    folder the block runs unlocked."""
    try:
        import fcntl

        handle = open(lock, "a")  # noqa: SIM115 -- closed in the finally below
    except (ImportError, OSError):
        yield
        return
    try:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield
    finally:
        handle.close()  # closing releases the lock


def _engine(directory: Path) -> tuple[str, dict[str, float], float]:
    """The engine of the tile products, each engine's product rate and the FMA peak
    (`fma_peak`), measured once per library and kept beside it as JSON.

    The rates (`product_rate` over `tile_shapes`) are what the products alone reach; the
    engine is the one whose attention (`_attention_seconds`) is fastest, which also counts
    what the rates cannot: a BLAS packing its operands per call, the caches the tiles
    share; a tie within the noise goes to the higher rate (`_fastest`).  One process of the
    machine measures at a time (`_alone`): the ranks of a job that load the kernels together
    wait for the first one's record, and its timings are not the others' noise.
    """
    record = directory / "engine.json"
    with _alone(directory / "engine.lock"):
        try:
            measured = json.loads(record.read_text())
            rates, seconds = measured["rates"], measured["attention_seconds"]
            peak = float(measured["fma_peak"])
            kept = bool(seconds) and set(seconds) <= set(ENGINES)
        except (OSError, ValueError, KeyError, TypeError):
            kept = False
        if not kept:
            rates, seconds = _measure(directory)
            peak = fma_peak()
            partial = record.with_suffix(f".{os.getpid()}.tmp")
            with contextlib.suppress(OSError):  # a read-only cache measures again next time
                partial.write_text(
                    json.dumps({"rates": rates, "attention_seconds": seconds, "fma_peak": peak})
                )
                os.replace(partial, record)
    chosen = os.environ.get("ATTNGRAD_FUSED_ENGINE") or _fastest(seconds, rates)
    if chosen not in ENGINES:
        raise BuildError(
            f"ATTNGRAD_FUSED_ENGINE={chosen!r} is not an engine; use one of {', '.join(ENGINES)}."
        )
    return chosen, rates, peak


# The backward op's arguments after need_ds, in the schema's order: the score function's
# (a program or a diagonal), then the BlockMask's read by blocks (its mask program, status).
_BACKWARD_PROGRAM_ARGS = (
    "code", "constants", "indices", "out", "captured", "batch",
    "grad_code", "grad_constants", "grad_indices", "grad_out", "wanted",
    "diagonal", "need_ddiagonal",
    "mask_code", "mask_constants", "mask_indices", "mask_out", "mask_captured", "mask_batch",
    "status", "mask_block_q", "mask_block_k",
)  # fmt: skip


def _fake_captured_gradients(
    like: torch.Tensor, captured: object, wanted: object, backward: bool
) -> list[torch.Tensor]:
    """dcaptured as the ops return it: a captured tensor's shape in ``like``'s dtype where its
    gradient is wanted (and a backward program runs), else an empty [0] tensor."""
    tensors = list(captured) if isinstance(captured, (list, tuple)) else []
    flags = list(wanted) if isinstance(wanted, (list, tuple)) else []
    return [
        like.new_empty(c.shape) if backward and a < len(flags) and flags[a] else like.new_empty(0)
        for a, c in enumerate(tensors)
    ]


def _register_fakes() -> None:
    """Shapes of the ops' results without running them (torch.compile's tracing, meta tensors)."""
    if getattr(_register_fakes, "done", False):
        return

    @torch.library.register_fake("attngrad_fused::forward")  # type: ignore[untyped-decorator]
    def _forward(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *_: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        o = q.new_empty(*q.shape[:3], v.shape[3])
        return o, q.new_empty(*q.shape[:3], 2)

    @torch.library.register_fake("attngrad_fused::backward")  # type: ignore[untyped-decorator]
    def _backward(
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *rest: object,
        **program: object,
    ) -> tuple[object, ...]:
        # rest: stats .. engine (15), need_ds, then the score function's arguments (a program
        # or a diagonal) and the BlockMask's, by position or by name, the trailing ones left at
        # their defaults (the BlockMask's change no result's shape)
        need_ds = bool(rest[15])
        named = dict(zip(_BACKWARD_PROGRAM_ARGS, rest[16:], strict=False)) | program
        ds = q.new_empty(*q.shape[:3], k.shape[2]) if need_ds else q.new_empty(0)
        dcaptured = _fake_captured_gradients(
            q, named.get("captured"), named.get("wanted"), named.get("grad_code") is not None
        )
        diagonal = named.get("diagonal")
        ddiagonal = (
            torch.empty_like(diagonal)
            if named.get("need_ddiagonal") and isinstance(diagonal, torch.Tensor)
            else q.new_empty(0)
        )
        grads = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        return *grads, ds, dcaptured, ddiagonal

    @torch.library.register_fake("attngrad_fused::program_rows")  # type: ignore[untyped-decorator]
    def _program_rows(
        code: torch.Tensor,
        constants: torch.Tensor,
        indices: torch.Tensor,
        out: int,
        captured: list[torch.Tensor],
        scores: torch.Tensor,
        grad: torch.Tensor | None,
        batch: int,
        wanted: list[bool],
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        dcaptured = _fake_captured_gradients(scores, captured, wanted, grad is not None)
        return torch.empty_like(scores), dcaptured

    _register_fakes.done = True  # type: ignore[attr-defined]
