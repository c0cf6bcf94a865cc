"""Compile a recorded Triton launch for a CUDA target without a GPU, and read what ptxas used.

Triton builds a kernel for ``GPUTarget("cuda", arch, 32)`` with the ptxas its
wheel ships; no driver is needed until the binary is loaded.  `bind` turns a
launch (`attngrad.strategies.triton.strategy.Launch`) into exactly what a launch on
that target would compile: Triton's own binder gives the signature and its
specializations (pointer alignment, integers equal to 1 or divisible by 16),
so the report's binary is the one the GPU would run.  `compile_bound` runs
Triton's pipeline down to the cubin and parses ptxas's ``-v`` log for the
registers, spills and stack of each thread; the shared memory of a block is
Triton's own figure from the compiled metadata.

Results are cached as small JSON files under the cache directory, keyed by
Triton's compile key (the kernel's source and everything it calls, the
signature, the options, the target and the ptxas version), so a second
report in the same job compiles nothing again.

Triton's binder (``create_function_from_signature``, ``JITFunction._pack_args``)
is internal API; this module is tested with the Triton it is installed with
and raises `UnsupportedTriton` where those change.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from attngrad.core.cache import cache_root

__all__ = [
    "Bound",
    "Resources",
    "UnsupportedTriton",
    "bind",
    "cached",
    "compile_bound",
    "default_cache_dir",
    "parse_ptxas_log",
]


class UnsupportedTriton(RuntimeError):
    """The installed Triton lacks the internals this module builds on."""


@dataclass(frozen=True)
class Resources:
    """What one compiled kernel uses.

    shared_bytes: shared memory per block; registers: per thread; spill_stores,
    spill_loads: bytes of registers spilled to local memory and read back, per
    thread; stack_bytes: the stack frame.  error: why it did not compile, else "".
    """

    shared_bytes: int
    registers: int
    spill_stores: int
    spill_loads: int
    stack_bytes: int
    error: str = ""


@dataclass(frozen=True)
class Bound:
    """A launch bound for a target: all `compile_bound` needs, picklable for worker processes."""

    kernel: str  # the name in attngrad.strategies.triton.kernels
    arch: int
    signature: dict[str, str]
    constexprs: dict[tuple[int, ...], Any]
    attrs: dict[tuple[int, ...], Any]
    options: dict[str, Any]
    key: str  # Triton's compile key, hashed


def default_cache_dir() -> Path:
    """`attngrad.core.cache.cache_root` / kernels."""
    return cache_root() / "kernels"


def _target(arch: int) -> Any:
    from triton.backends.compiler import GPUTarget

    return GPUTarget("cuda", arch, 32)


def bind(kernel: Any, args: dict[str, object], arch: int) -> Bound:
    """Bind ``args`` (a launch's arguments by name, launch options included) for sm_<arch>."""
    from triton.compiler import ASTSource, get_cache_key, make_backend
    from triton.runtime import jit

    backend = make_backend(_target(arch))
    try:
        from triton import knobs  # what `_compile` sets: Triton 3.4 and later

        knobs.nvidia.dump_ptxas_log, knobs.compilation.always_compile  # noqa: B018
        binder = jit.create_function_from_signature(kernel.signature, kernel.params, backend)
        bound_args, specialization, options = binder(**args)
        launch_options = {n: v for n, v in args.items() if n not in kernel.arg_names}
        options, signature, constexprs, attrs = kernel._pack_args(
            backend, launch_options, bound_args, specialization, options
        )
    except (AttributeError, ImportError, TypeError) as e:
        raise UnsupportedTriton(
            f"binding a launch with this Triton failed ({type(e).__name__}: {e}); the compile "
            "report builds on the binder of Triton 3.6 to 3.9: pip install 'triton>=3.6,<3.10'"
        ) from e
    src = ASTSource(kernel, signature, constexprs, attrs)
    key = get_cache_key(src, backend, options, env_vars={})
    return Bound(
        kernel=kernel.__name__,
        arch=arch,
        signature=signature,
        constexprs=constexprs,
        attrs=attrs,
        options=dict(options.__dict__),
        key=hashlib.sha256(key.encode()).hexdigest(),
    )


_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGISTERS = re.compile(r"Used (\d+) registers")


def parse_ptxas_log(log: str) -> tuple[int, int, int, int]:
    """(registers, spill stores, spill loads, stack frame) from ptxas -v output of one kernel."""
    frame, registers = _FRAME.search(log), _REGISTERS.search(log)
    if frame is None or registers is None:
        raise ValueError(f"no resource usage in the ptxas log:\n{log}")
    stack, stores, loads = (int(g) for g in frame.groups())
    return int(registers.group(1)), stores, loads, stack


def cached(bound: Bound, cache_dir: Path | None) -> Resources | None:
    """What `compile_bound` found for ``bound`` before, read from ``cache_dir``; None if
    it never compiled it there."""
    path = None if cache_dir is None else cache_dir / f"{bound.key}.json"
    if path is None or not path.is_file():
        return None
    return Resources(**json.loads(path.read_text()))


def compile_bound(bound: Bound, cache_dir: Path | None) -> Resources:
    """Compile ``bound`` to a cubin (or read the cached result) and say what it uses."""
    found = cached(bound, cache_dir)
    if found is not None:
        return found
    resources = _compile(bound)
    if cache_dir is not None and not resources.error:
        cache_dir.mkdir(parents=True, exist_ok=True)
        path = cache_dir / f"{bound.key}.json"
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(asdict(resources)))
        partial.replace(path)  # atomic: parallel reports never read half a file
    return resources


def _compile(bound: Bound) -> Resources:
    import triton
    from triton import knobs
    from triton.compiler import ASTSource

    from attngrad.strategies.triton import kernels

    src = ASTSource(getattr(kernels, bound.kernel), bound.signature, bound.constexprs, bound.attrs)
    log = io.StringIO()
    # always_compile: a hit in Triton's own cache would skip ptxas and so its log
    with (
        knobs.compilation.scope(),
        knobs.nvidia.scope(),
        contextlib.redirect_stdout(log),
    ):
        knobs.compilation.always_compile = True
        knobs.nvidia.dump_ptxas_log = True
        try:
            compiled = triton.compile(src, target=_target(bound.arch), options=bound.options)
        except Exception as e:  # any compiler failure is the report's finding
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            return Resources(0, 0, 0, 0, 0, error=f"{type(e).__name__}: {first}"[:300])
    registers, stores, loads, stack = parse_ptxas_log(log.getvalue())
    return Resources(int(compiled.metadata.shared), registers, stores, loads, stack)
