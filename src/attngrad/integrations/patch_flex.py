"""`patch_flex_attention`: torch's ``flex_attention`` runs `attngrad.flex_attention` inside.

For code that calls FlexAttention itself and that you do not want to edit --
a model of your own, or transformers' ``attn_implementation="flex_attention"``::

    with attngrad.patch_flex_attention(strategy="flash"):
        loss = model(x).loss          # each flex_attention call is attngrad's, strategy "flash"
        loss.backward()               # on CPU too, where torch's flex has no backward

What is routed, for the block only:

* the attribute ``torch.nn.attention.flex_attention.flex_attention``, for
  calls that look it up when they run;
* every name that a loaded module bound to that function before the block,
  e.g. by ``from torch.nn.attention.flex_attention import flex_attention``
  (any alias): each module's globals in ``sys.modules`` are searched for the
  function object itself and rebound.  attngrad's own modules are left as
  they are, so a reference that compares with torch's function stays torch's;
* transformers' ``compile_friendly_flex_attention`` (and every name bound to
  it, as Doge's modeling file does): it hands calls to a singleton holding
  ``torch.compile(flex_attention)`` compiled at its first call, which no
  rebinding reaches; the patched one calls attngrad and drops its
  ``training`` argument.  This is patched when transformers is imported
  before the block (a model built from it has imported it);
* ``torch.nn.attention.flex_attention.create_block_mask`` and every name bound
  to it (transformers' ``masking_utils`` and ``integrations.flex_attention``
  bind it at import), by the same search: `attngrad.create_block_mask` builds
  the same ``BlockMask`` without a compiler.  transformers passes
  ``_compile=True``, an Inductor compile of the mask per new shape (tens of
  seconds on a CPU for a model's first step, ~20 s for each new sequence
  length); attngrad's takes milliseconds and ignores ``_compile``.  Under
  ``torch.compile`` it hands the call to torch's builder, which Dynamo traces.

Nothing in the patched route compiles with Inductor, and nothing waits on a
compiler without saying so first: the one compiler left is the ``fused``
strategy's C++ build, once per machine and torch version, which prints what
it compiles and how long it takes before it starts (``attngrad build`` does
it ahead of time).

Leaving the block rebinds every name that holds the block's function -- also
one bound inside the block, by a module imported there -- to what was there
when it began, also when the block raises; blocks nest.  Backward needs no
patch: the autograd graph recorded inside holds attngrad's nodes.  The patch
is process-wide: other threads calling flex_attention inside the block run
attngrad too.  Under torch.compile the patched call breaks the graph
(`attngrad.flex_attention` runs eagerly).

Names, not references: a module global kept to compare with torch's function
(``REFERENCE = flex_attention``) is rebound like any other, while the
function held in a dict, a class attribute, a closure or a
``functools.partial`` is not reached.  Entering and leaving each search the
loaded modules once (about 10 ms with torch and transformers loaded): put
the block around the training loop, not inside each step.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch

from attngrad.api import flex_attention as attngrad_flex_attention
from attngrad.core.block_mask import create_block_mask as attngrad_create_block_mask
from attngrad.core.contract import validate_strategy
from attngrad.strategies import STRATEGIES

__all__ = ["patch_flex_attention"]

TORCH_MODULE = "torch.nn.attention.flex_attention"
HF_MODULE = "transformers.integrations.flex_attention"
HF_FUNCTION = "compile_friendly_flex_attention"


def patch_flex_attention(strategy: str = "auto") -> contextlib.AbstractContextManager[None]:
    """Route torch's ``flex_attention`` (and transformers' calls of it) to `attngrad.flex_attention`,
    and its ``create_block_mask`` to `attngrad.create_block_mask` (no compiler).

    strategy: one of `attngrad.STRATEGIES` or "auto", used by every patched call
    (checked here, before anything is patched; "fused" and "triton" refuse
    score functions and BlockMasks, so a model's calls need "auto", "explicit",
    "recompute" or "flash").  Also usable as a decorator
    (``@attngrad.patch_flex_attention("flash")``).

    >>> from torch.nn.attention import flex_attention as fa
    >>> q = torch.randn(1, 2, 8, 4, requires_grad=True)
    >>> with patch_flex_attention("explicit"):
    ...     fa.flex_attention(q, q, q).sum().backward()
    >>> q.grad.shape
    torch.Size([1, 2, 8, 4])
    """
    validate_strategy(strategy, STRATEGIES)
    return _patched(strategy)


def _module_dicts() -> list[dict[str, Any]]:
    """The globals of every loaded module outside attngrad, each once (``__mp_main__`` is ``__main__``)."""
    seen: dict[int, dict[str, Any]] = {}
    for name, module in list(sys.modules.items()):
        if not isinstance(module, types.ModuleType) or name.partition(".")[0] == "attngrad":
            continue
        namespace = module.__dict__
        seen.setdefault(id(namespace), namespace)
    return list(seen.values())


def _rebind(swaps: list[tuple[object, object]]) -> None:
    """Every module global that is an ``old`` (by identity) becomes its ``new``: one pass for all."""
    by_id = {id(old): new for old, new in swaps}  # the olds are alive in swaps: ids are theirs
    for namespace in _module_dicts():
        for name, value in list(namespace.items()):
            new = by_id.get(id(value))
            if new is not None:
                namespace[name] = new


def _hf_module() -> types.ModuleType | None:
    """transformers' flex integration, if transformers is loaded (imported here then if needed)."""
    if "transformers" not in sys.modules:
        return None
    try:
        return importlib.import_module(HF_MODULE)
    except ImportError:  # a transformers without flex support
        return None


@contextlib.contextmanager
def _patched(strategy: str) -> Iterator[None]:
    torch_flex = importlib.import_module(TORCH_MODULE)

    def flex_attention(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        score_mod: Callable[..., torch.Tensor] | None = None,
        block_mask: Any = None,
        scale: float | None = None,
        enable_gqa: bool = False,
        return_lse: bool = False,
        kernel_options: dict[str, Any] | None = None,
        *,
        return_aux: Any = None,
    ) -> Any:
        """torch's signature and shapes: [B, Hq, Nq, d], [B, Hkv, Nk, d], [B, Hkv, Nk, dv]."""
        return attngrad_flex_attention(
            query, key, value, score_mod, block_mask, scale, enable_gqa, return_lse,
            kernel_options, return_aux=return_aux, strategy=strategy,
        )  # fmt: skip

    def compile_friendly_flex_attention(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        training: bool = False,
        **kwargs: Any,
    ) -> Any:
        """transformers' wrapper without its compiled singleton (``training`` only picked a compile mode)."""
        return flex_attention(query, key, value, **kwargs)

    @functools.wraps(attngrad_create_block_mask)
    def create_block_mask(*args: Any, **kwargs: Any) -> Any:
        """`attngrad.create_block_mask`: torch's BlockMask, no compiler (``_compile`` ignored)."""
        return attngrad_create_block_mask(*args, **kwargs)

    swaps: list[tuple[object, object]] = [
        (torch_flex.flex_attention, flex_attention),
        (torch_flex.create_block_mask, create_block_mask),
    ]
    hf = _hf_module()
    if hf is not None and hasattr(hf, HF_FUNCTION):
        swaps.append((getattr(hf, HF_FUNCTION), compile_friendly_flex_attention))
    _rebind(swaps)
    try:
        yield
    finally:  # a name bound inside the block to a patched function is restored too
        _rebind([(new, old) for old, new in swaps])
