"""Triton's interpreter patches triton.language once per launch, not once per helper call.

The interpreter runs a kernel launch by swapping triton.language's builtins (tl.load,
tl.dot, ...) for numpy ones (``_patch_lang``, undone when the launch ends), then calling the
kernel once per program instance.  Each call of a ``@triton.jit`` helper inside the kernel
(``InterpretedFunction.__call__``) calls ``_patch_lang`` again, which walks every member of
triton.language, its tensor class and tl.math with ``inspect.getmembers`` (~7 ms a call)
to find builtins -- already swapped by the launch, so it swaps nothing new.  The triton
strategy's kernels call their helpers thousands of times a launch: this redundant walk was
~45% of the suite's time in the interpreter.

`install` makes a helper's ``_patch_lang`` a no-op when the launch in progress has already
patched every triton.language module the helper sees (its globals' ``tl``, ``tl.core``):
the kernel's modules when the launch began, and those of any helper patched since (the
interpreter never undoes a helper's patch, so it holds to the launch's end).  The first
helper that sees another module (tl.core, for triton.language's own jit functions such as
tl.zeros and tl.sum) is patched as before.  What the
kernels compute is unchanged: the same builtins run, patched by the launch.  Outside a
launch (or on a Triton whose interpreter lacks these names) nothing changes.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any


def install() -> bool:
    """Patch Triton's interpreter as above; returns whether it did (False: no Triton, or an
    interpreter whose structure differs from the one this was written against)."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except Exception:  # no Triton, or one that does not import here
        return False
    executor = getattr(interpreter, "GridExecutor", None)
    function = getattr(interpreter, "InterpretedFunction", None)
    real_patch_lang = getattr(interpreter, "_patch_lang", None)
    if executor is None or function is None or real_patch_lang is None:
        return False
    if getattr(real_patch_lang, "_once_per_launch", False):
        return True  # installed already

    # one entry per launch in progress: None until the launch has patched its modules, then
    # the ids of the triton.language modules it patched
    launches: list[frozenset[int] | None] = []

    @functools.cache
    def modules_of(fn: Any) -> frozenset[int]:
        """The triton.language modules ``_patch_lang`` patches for ``fn`` (as it finds them)."""
        return frozenset(
            id(value)
            for value in fn.__globals__.values()
            if inspect.ismodule(value) and value in (tl, tl.core)
        )

    class _Nothing:
        """The scope of a patch that changed nothing: restoring it changes nothing."""

        def restore(self) -> None:
            pass

    @functools.wraps(real_patch_lang)
    def patch_lang(fn: Any) -> Any:
        if launches and launches[-1] is not None and modules_of(fn) <= launches[-1]:
            return _Nothing()  # a helper inside a launch whose patches cover it
        scope = real_patch_lang(fn)
        if launches:  # the launch's own patch, or a helper's: neither is undone before the end
            launches[-1] = (launches[-1] or frozenset()) | modules_of(fn)
        return scope

    patch_lang._once_per_launch = True  # type: ignore[attr-defined]
    real_call = executor.__call__

    @functools.wraps(real_call)
    def launch(self: Any, *args: Any, **kwargs: Any) -> Any:
        launches.append(None)
        try:
            return real_call(self, *args, **kwargs)
        finally:
            launches.pop()

    interpreter._patch_lang = patch_lang
    executor.__call__ = launch
    return True
