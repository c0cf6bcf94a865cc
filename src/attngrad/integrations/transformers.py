"""attngrad as an ``attn_implementation`` of Hugging Face transformers.

::

    from transformers import AutoModelForCausalLM
    from attngrad.integrations.transformers import register

    register()                                   # "attngrad", strategy="auto"
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="attngrad")
    # or, on a model already built:  model.set_attn_implementation("attngrad")

    register("attngrad-tiled", strategy="flash")  # another name, another strategy

`register` puts two things under the name: the attention function
(`attention_forward` bound to the strategy) in ``transformers.AttentionInterface``
and transformers' own ``sdpa_mask`` in ``transformers.masking_utils.
AttentionMaskInterface``.  Without a mask builder transformers hands a custom
attention function no padding mask at all; with ``sdpa_mask`` the function
receives exactly what transformers' ``sdpa`` receives: a 4-D bool mask
``[B, 1, Nq, Nk]`` (True = attend; causal, padding, sliding window, packed
sequences and any model overlay already in it) or None where a plain causal or
bidirectional call needs none.

How each keyword transformers passes is read (``attention_forward``)
--------------------------------------------------------------------
Shapes: query ``[B, Hq, Nq, d]``, key ``[B, Hkv, Nk, d]``, value
``[B, Hkv, Nk, dv]``; returns ``(out [B, Nq, Hq, dv] contiguous, None)``.

* ``scaling`` -> ``scale`` (None: 1/sqrt(d)); ``dropout`` -> ``dropout_p``
  (the models already pass 0 outside training; the mask is drawn from
  torch's default generator, so ``torch.manual_seed`` reproduces a step).
* Hq != Hkv -> ``enable_gqa=True``: k and v are never repeated.
* ``attention_mask``: a 4-D bool (True = attend) or float (additive) tensor
  broadcastable to ``[B, Hq, Nq, Nk]`` is authoritative: nothing (no
  ``is_causal``, no sliding window) is added on top of it, since it may hold
  bidirectional overlays, and under a static cache its keys are slots that a
  band placed by position would cut wrongly.  A float mask that requires
  grad gets its gradient.
* Causality, as ``sdpa_attention_forward`` does it: the ``is_causal`` keyword,
  else ``module.is_causal`` (default True), and only when ``attention_mask``
  is None and Nq > 1 (a single query attends every key it is given: the
  decoding step).  Causal with Nk > Nq > 1 and no mask is the prefill of an
  empty static cache: as sdpa does, keys (and ``position_bias``) are cropped
  to the first Nq, which is SDPA's top-left alignment.
* ``sliding_window=w`` (key j visible from query i when i - w < j <= i,
  transformers' ``sliding_window_overlay``), only when there is no mask (a
  mask already holds the window): ``window=(w - 1, 0)`` on a causal module,
  aligned bottom-right when Nq < Nk (a KV cache: the last query sits at the
  last key); ``window=(w, w)`` on a bidirectional module (|i - j| <= w, the
  ``sliding_window_bidirectional_overlay`` that sdpa's and eager's masks
  use; transformers' flash path uses (w - 1, w - 1) there).  transformers
  omits the mask only where the window cannot bite (Nk < w), so this agrees
  with sdpa, which never reads ``sliding_window``.
* ``softcap`` -> ``softcap`` (Gemma 2); ``s_aux`` (gpt-oss) or ``sinks`` ->
  ``sinks`` ``[Hq]``, their gradient returned.
* ``position_bias`` (T5) ``[B or 1, H, Nq, Nk]``: joined with the mask into
  one float ``attn_mask`` as sdpa's ``create_position_bias_mask`` does
  (bias + float mask; bias where a bool mask is True), except that a False
  entry becomes -inf rather than finfo.min: the same softmax wherever a row
  attends at least one key, and a zero output for a row that attends
  nothing (finfo.min would give that row the mean of v).  Without a mask,
  the bias is the float mask and causality is ``is_causal``.  Its gradient
  flows back to the bias.
* ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (packed sequences, FlashAttention's
  keywords, e.g. from ``DataCollatorWithFlattening(return_flash_attn_kwargs=
  True)``) -> ``cu_seqlens_q`` / ``cu_seqlens_k``: segment s of the queries
  attends segment s of the keys only, causal and windows bottom-right in
  each pair as FlashAttention's varlen kernels place them.  With a batch of
  several rows they index the rows laid end to end, as FlashAttention does.
  A mask given too (transformers builds one from ``position_ids``) still
  applies: the call attends where both allow.  ``max_length_q`` /
  ``max_length_k`` are implied by them and ignored.
* Refused: ``output_attentions=True`` (no attention weights are formed; use
  ``attn_implementation="eager"``), and the keywords of paged attention,
  continuous batching and sparse attention (``indices``, ``block_indices``,
  ``block_table``, ``k_cache``, ...), ``head_mask``, flex's ``score_mod`` and
  ``block_mask``.  Other keywords (``position_ids``, ``cache_position``,
  ``use_cache``, ...) do not change the attention and are ignored, as sdpa
  ignores them.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from attngrad.api import attention
from attngrad.core.contract import ArgumentError, ArgumentTypeError
from attngrad.strategies import STRATEGIES

__all__ = ["RESERVED_NAMES", "attention_forward", "register", "registered"]

# transformers' own implementations, and the names it gives a meaning to
RESERVED_NAMES: frozenset[str] = frozenset(
    {
        "eager",
        "sdpa",
        "paged|eager",
        "flex_attention",
        "flash_attention_2",
        "flash_attention_3",
        "flash_attention_4",
    }
)

# name -> strategy, for the names this module registered (re-registering one is allowed)
_REGISTERED: dict[str, str] = {}

_INSTALL_HINT = (
    "attngrad.integrations.transformers needs Hugging Face transformers: "
    "pip install 'attngrad[hf]' (or pip install transformers)."
)

# keywords that change the attention and that attngrad cannot honour -> what to use instead
_REFUSED: dict[str, str] = {
    "indices": (
        "sparse attention indices (e.g. DeepSeek V3.2's top-k keys) are consumed by flash "
        "kernels only; use attn_implementation='sdpa' or 'eager', which fold them into the mask"
    ),
    "block_indices": (
        "block-sparse attention indices are consumed by dedicated kernels only; use "
        "attn_implementation='sdpa' or 'eager'"
    ),
    "block_table": "paged attention (continuous batching) needs attn_implementation='sdpa' or 'paged|eager'",
    "page_table": "paged attention (continuous batching) needs attn_implementation='sdpa' or 'paged|eager'",
    "k_cache": "paged attention (continuous batching) needs attn_implementation='sdpa' or 'paged|eager'",
    "v_cache": "paged attention (continuous batching) needs attn_implementation='sdpa' or 'paged|eager'",
    "cache_seqlens": "paged attention (continuous batching) needs attn_implementation='sdpa' or 'paged|eager'",
    "read_index": "paged attention (continuous batching) needs attn_implementation='sdpa' or 'paged|eager'",
    "write_index": "paged attention (continuous batching) needs attn_implementation='sdpa' or 'paged|eager'",
    "head_mask": "a head mask multiplies the attention weights; use attn_implementation='eager'",
    "layer_head_mask": "a head mask multiplies the attention weights; use attn_implementation='eager'",
    "score_mod": "a flex score_mod needs attn_implementation='flex_attention'",
    "block_mask": "a flex BlockMask needs attn_implementation='flex_attention'",
}


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as error:  # pragma: no cover - exercised without transformers
        raise ImportError(_INSTALL_HINT) from error
    return transformers


def registered() -> dict[str, str]:
    """The names `register` has registered in this process, each with its strategy."""
    return dict(_REGISTERED)


def register(name: str = "attngrad", strategy: str = "auto") -> str:
    """Register attngrad under ``name`` as a transformers ``attn_implementation``; return ``name``.

    Puts `attention_forward` bound to ``strategy`` in ``transformers.AttentionInterface``
    and transformers' ``sdpa_mask`` in ``transformers.masking_utils.AttentionMaskInterface``,
    so the function receives sdpa's 4-D bool masks ``[B, 1, Nq, Nk]`` (or None).  Then::

        model = AutoModelForCausalLM.from_config(cfg, attn_implementation=name)
        model.set_attn_implementation(name)          # on a model already built

    Calling it again with another name registers another implementation, e.g.
    ``register("attngrad-tiled", strategy="flash")`` (a name may not contain
    "flash"); with a name it registered before, it rebinds that name to ``strategy``.

    name: a new name.  transformers gives names containing "flash", "sdpa" or
    "flex_attention", names with "|", and hub kernel names ("org/repo") a meaning of
    their own, and "eager" and the other built-in names are taken: those raise
    ValueError, as does a name another library registered.
    strategy: one of ``attngrad.STRATEGIES`` or "auto" (`attngrad.attention`).

    Raises ImportError when transformers is not installed.
    """
    _check_name(name)
    _check_strategy(strategy)
    transformers = _transformers()
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    interface = transformers.AttentionInterface
    taken = interface._global_mapping.get(name)
    mask_taken = AttentionMaskInterface._global_mapping.get(name)
    if mask_taken is not None and mask_taken is not sdpa_mask:
        taken = taken or mask_taken
    if taken is not None and name not in _REGISTERED:
        raise ArgumentError(
            f"name={name!r} is already registered in transformers' AttentionInterface or AttentionMaskInterface (by "
            f"{getattr(taken, '__qualname__', taken)!r}); pass another name, e.g. "
            f"register({(name + '-attngrad')!r}, strategy={strategy!r})."
        )
    forward = functools.partial(attention_forward, strategy=strategy)
    functools.update_wrapper(forward, attention_forward)
    interface.register(name, forward)
    AttentionMaskInterface.register(name, sdpa_mask)
    _REGISTERED[name] = strategy
    return name


def _check_name(name: object) -> None:
    hint = "e.g. register('attngrad') or register('attngrad-explicit', strategy='explicit')"
    if not isinstance(name, str):
        raise ArgumentTypeError(
            f"name must be a str, got {name!r:.80} of type {type(name).__name__}; {hint}."
        )
    lowered = name.lower()
    reason = None
    if not name.strip():
        reason = "it is empty"
    elif name in RESERVED_NAMES:
        reason = "it is one of transformers' own implementations"
    elif "flash" in lowered:
        reason = (
            "transformers treats every name containing 'flash' as a FlashAttention kernel "
            "(it checks for flash_attn or loads a kernel from the Hub)"
        )
    elif "sdpa" in lowered:
        reason = "transformers runs its SDPA dispatch checks on every name containing 'sdpa'"
    elif "flex_attention" in lowered:
        reason = (
            "transformers runs its flex-attention checks on every name containing 'flex_attention'"
        )
    elif "|" in name:
        reason = "transformers reads a 'prefix|' as a paged-attention prefix"
    elif "/" in name or ":" in name:
        reason = (
            "transformers loads names of the form 'org/repo[@rev][:fn]' as kernels from the Hub"
        )
    if reason is not None:
        raise ArgumentError(
            f"name={name!r} cannot be registered: {reason}; pick another name, {hint}."
        )


def _check_strategy(strategy: object) -> None:
    choices = ("auto", *STRATEGIES)
    if not isinstance(strategy, str) or strategy not in choices:
        error = TypeError if not isinstance(strategy, str) else ValueError
        raise error(
            f"strategy={strategy!r:.80} is not an attngrad strategy; choose one of "
            f"{', '.join(repr(s) for s in choices)} (see attngrad.attention)."
        )


def _attentions_requested(output_attentions: object) -> bool:
    """Whether the caller asked for attention weights (the keyword, or transformers' recorder)."""
    if output_attentions:
        return True
    try:  # models that pop output_attentions (GPT-2) still record through this collector
        from transformers.utils.output_capturing import _active_collector
    except ImportError:  # pragma: no cover - older or newer transformers
        return False
    collected = _active_collector.get()  # type: ignore[no-untyped-call]
    return isinstance(collected, dict) and any(str(k).endswith("attentions") for k in collected)


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    position_bias: torch.Tensor | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    max_length_q: int | None = None,
    max_length_k: int | None = None,
    output_attentions: bool | None = None,
    *,
    strategy: str = "auto",
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """A transformers attention function running `attngrad.attention`.

    query ``[B, Hq, Nq, d]``, key ``[B, Hkv, Nk, d]``, value ``[B, Hkv, Nk, dv]``
    (Hq a multiple of Hkv); attention_mask None or 4-D, bool (True = attend) or
    float (additive), broadcastable to ``[B, Hq, Nq, Nk]``; sinks / s_aux ``[Hq]``;
    position_bias ``[B or 1, Hq, Nq, Nk]``; cu_seq_lens_q/k 1-D cumulative lengths.
    Returns ``(out [B, Nq, Hq, dv] contiguous, None)``: no attention weights.
    How each keyword maps: the module docstring.
    """
    if _attentions_requested(output_attentions):
        raise ArgumentError(
            "attngrad forms no attention weights, so output_attentions=True cannot be served; "
            "use attn_implementation='eager' for attention weights (e.g. "
            "model.set_attn_implementation('eager'))."
        )
    for name, why in _REFUSED.items():
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"attngrad cannot honour the keyword {name!r}: {why}.")
    if sinks is not None and s_aux is not None and sinks is not s_aux:
        raise ArgumentError("both s_aux and sinks were given; pass the attention sinks once.")
    sink = s_aux if s_aux is not None else sinks
    mask = _check_mask(attention_mask, query, key)
    causal_module = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    heads_q, seq_q = query.shape[1], query.shape[2]
    packed = cu_seq_lens_q is not None or cu_seq_lens_k is not None

    align = "top-left"
    causal = False
    window: tuple[int | None, int | None] | None = None
    if packed:
        # FlashAttention's varlen semantics: causal and windows bottom-right in each segment
        align = "bottom-right"
        if mask is None:
            causal = causal_module
            window = _window(sliding_window, causal_module)
    elif mask is None:
        causal = causal_module and seq_q > 1
        if causal and key.shape[2] > seq_q:  # empty static-cache prefill: sdpa crops the keys
            key, value = key[:, :, :seq_q], value[:, :, :seq_q]
            if position_bias is not None:
                position_bias = position_bias[..., :seq_q]
        window = _window(sliding_window, causal_module)
        if window is not None and causal_module and seq_q < key.shape[2]:
            align = "bottom-right"  # a KV cache: the last query sits at the last key

    attn_mask: torch.Tensor | None = mask
    if position_bias is not None:
        attn_mask = _with_position_bias(position_bias, mask)
        if causal:  # attngrad takes is_causal or a mask: the causal band as a window instead
            window = (None if window is None else window[0], 0)
            causal = False

    batch = query.shape[0]
    if packed and batch > 1:  # the rows laid end to end, as FlashAttention's varlen API takes them
        if attn_mask is not None:
            raise ArgumentError(
                f"cu_seq_lens_q/k with a batch of {batch} rows and an attention_mask: packed "
                "sequences come as one row (batch 1); pass input_ids of shape [1, total]."
            )
        query, key, value = (_end_to_end(t) for t in (query, key, value))

    out = attention(
        query,
        key,
        value,
        attn_mask=attn_mask,
        dropout_p=float(dropout or 0.0),
        is_causal=causal,
        scale=scaling,
        enable_gqa=heads_q != key.shape[1],
        strategy=strategy,
        window=window,
        softcap=softcap,
        sinks=sink,
        align=align,
        cu_seqlens_q=cu_seq_lens_q,
        cu_seqlens_k=cu_seq_lens_k if cu_seq_lens_k is not None else cu_seq_lens_q,
    )
    if packed and batch > 1:
        out = out.reshape(heads_q, batch, seq_q, -1).transpose(0, 1)
    return out.transpose(1, 2).contiguous(), None


def _end_to_end(t: torch.Tensor) -> torch.Tensor:
    """[B, H, N, d] -> [1, H, B * N, d]: the batch rows one after another."""
    return t.transpose(0, 1).reshape(1, t.shape[1], t.shape[0] * t.shape[2], t.shape[3])


def _window(sliding_window: int | None, causal: bool) -> tuple[int | None, int | None] | None:
    """transformers' ``sliding_window=w`` as attngrad's ``window=(left, right)``."""
    if sliding_window is None:
        return None
    w = int(sliding_window)
    if w < 1:
        raise ArgumentError(
            f"sliding_window={sliding_window!r}: it must be a positive int or None."
        )
    return (w - 1, 0) if causal else (w, w)


def _check_mask(mask: object, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor | None:
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise ArgumentTypeError(
            f"attention_mask is a {type(mask).__name__}; attngrad takes a 4-D torch.Tensor or "
            "None (a flex BlockMask needs attn_implementation='flex_attention'). Register with "
            "attngrad.integrations.transformers.register(), which also registers the mask builder."
        )
    if mask.ndim != 4:
        raise ArgumentError(
            f"attention_mask has shape {tuple(mask.shape)}; attngrad takes the 4-D masks "
            f"[B or 1, 1 or Hq, Nq, Nk] = [{query.shape[0]}, {query.shape[1]}, {query.shape[2]}, "
            f"{key.shape[2]}] that transformers' sdpa_mask builds. Register with "
            "attngrad.integrations.transformers.register(), which registers that mask builder."
        )
    return mask


def _with_position_bias(bias: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """T5's position bias joined with the mask into one additive float mask."""
    if mask is None:
        return bias
    if mask.dtype == torch.bool:
        return torch.where(mask, bias, float("-inf"))
    return bias + mask
