"""Triton's interpreter (TRITON_INTERPRET=1), without two costs that change nothing it computes.

The interpreter runs a launch by swapping triton.language's builtins (tl.load, tl.dot, ...)
for numpy ones, then calling the kernel once per program instance, each op through
triton.language's semantic layer on numpy arrays.  Two things it does at every step are work
whose result nothing reads:

* **Patching the language again at every helper call.**  Each call of a ``@triton.jit``
  helper inside a kernel (``InterpretedFunction.__call__``) calls ``_patch_lang`` again,
  which walks every member of triton.language, its tensor class and tl.math with
  ``inspect.getmembers`` (~7 ms a call) to find builtins -- already swapped by the launch, so
  it swaps nothing new.  The kernels call their helpers thousands of times a launch: about
  half of the strategy's time in the interpreter.  `install` makes a helper's
  ``_patch_lang`` a no-op when the launch in progress has already patched every
  triton.language module the helper sees (its globals' ``tl``, ``tl.core``): the kernel's
  modules when the launch began, and those of any helper patched since (the interpreter
  never undoes a helper's patch, so it holds to the launch's end).  The first helper that
  sees another module (tl.core, for triton.language's own jit functions such as tl.zeros and
  tl.sum) is patched as before.
* **Overflow checks whose assertion is off.**  With ``sanitize_overflow`` (on in the
  interpreter's options) every integer +, - and * of fewer than 64 bits is redone in int64
  and compared with the type's range, to feed ``device_assert`` -- which does nothing unless
  the options' ``debug`` is on, and the interpreter's never is: about 40% of the time left
  after the first.  `install` turns ``sanitize_overflow`` off where ``debug`` is off (and
  where ``device_assert`` is seen to return early without it: `_assert_needs_debug`).  The
  wrapping int32 arithmetic the kernels rely on (dropout's hash) wraps as before.

Both together: the check grid's triton cases in 40% of the interpreter's time as shipped
(measured on three cases of `attngrad.verify.cases.default_cases`, float64 and float16).

The same builtins run on the same numbers: results are bit for bit those of the interpreter
as shipped.  Outside a launch, without the interpreter, or on a Triton whose interpreter
lacks these names or differs in these places, nothing changes (`install` says which took).
The kernels' module installs it when it finds itself interpreted
(`attngrad.strategies.triton.kernels`); it then holds for any kernel the process
interprets.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import textwrap
from typing import Any

__all__ = ["install"]


def install() -> dict[str, bool]:
    """Patch Triton's interpreter as the module docstring says; idempotent.

    Returns which of the two took: ``{"patch_once_per_launch": ..., "skip_unchecked_overflow":
    ...}`` (False: no Triton, or an interpreter whose structure differs from the one this was
    written against, left as it is).
    """
    try:
        import triton.language as tl  # type: ignore[import-untyped]
        from triton.runtime import interpreter  # type: ignore[import-untyped]
    except Exception:  # no Triton, or one that does not import here
        return {"patch_once_per_launch": False, "skip_unchecked_overflow": False}
    return {
        "patch_once_per_launch": _patch_once_per_launch(interpreter, tl),
        "skip_unchecked_overflow": _skip_unchecked_overflow(interpreter),
    }


def _patch_once_per_launch(interpreter: Any, tl: Any) -> bool:
    """A helper's ``_patch_lang`` does nothing inside a launch that has patched its modules."""
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


def _skip_unchecked_overflow(interpreter: Any) -> bool:
    """``sanitize_overflow`` off in the interpreter's options, where its checks feed nothing."""
    builder: Any = getattr(interpreter, "interpreter_builder", None)
    options: Any = getattr(builder, "options", None)
    fields = {f.name for f in dataclasses.fields(options)} if _instance(options) else set()
    if not {"debug", "sanitize_overflow"} <= fields or options.debug:
        return False
    if not options.sanitize_overflow:
        return True  # off already (installed, or never on)
    if not _assert_needs_debug():
        return False
    builder.options = dataclasses.replace(options, sanitize_overflow=False)
    return True


def _instance(options: object) -> bool:
    """Whether ``options`` is a dataclass instance (InterpreterOptions is a frozen one)."""
    return dataclasses.is_dataclass(options) and not isinstance(options, type)


def _assert_needs_debug() -> bool:
    """Whether triton.language's ``device_assert`` starts with ``if not
    self.builder.options.debug: return``: it checks nothing unless the options' ``debug`` is
    on, which makes the overflow checks dead work without it."""
    try:
        from triton.language.semantic import TritonSemantic  # type: ignore[import-untyped]

        source = textwrap.dedent(inspect.getsource(TritonSemantic.device_assert))
        function = ast.parse(source).body[0]
    except Exception:  # another layout of the semantic layer: leave the checks on
        return False
    if not isinstance(function, ast.FunctionDef):
        return False
    body = function.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    first = body[0] if body else None
    return (
        isinstance(first, ast.If)
        and ast.unparse(first.test) == "not self.builder.options.debug"
        and len(first.body) == 1
        and isinstance(first.body[0], ast.Return)
        and first.body[0].value is None
    )
