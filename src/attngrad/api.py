"""`attention`: a drop-in for `torch.nn.functional.scaled_dot_product_attention`."""

from __future__ import annotations

import math
from typing import Literal, overload

import torch
from torch.nn.attention.bias import CausalBias

from attngrad.core.amp import autocast_inputs, outside_autocast
from attngrad.core.contract import (
    check_flag,
    validate_attention,
    validate_blocks,
    validate_strategy,
    validate_window,
)
from attngrad.core.dropout import Dropout, draw_seed
from attngrad.core.keywords import (
    causal_bias_alignment,
    validate_align,
    validate_generator,
    validate_segments,
    validate_sinks,
    validate_softcap,
)
from attngrad.core.masks import Mask, causal_band, split_mask
from attngrad.core.sinks import merge_sinks
from attngrad.integrations import torch_compile as compiled
from attngrad.strategies import MODULES, STRATEGIES, TILED, base, resolve

__all__ = ["attention"]


@overload
def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | CausalBias | None = ...,
    dropout_p: float = ...,
    is_causal: bool = ...,
    scale: float | None = ...,
    enable_gqa: bool = ...,
    *,
    strategy: str = ...,
    window: tuple[int | None, int | None] | None = ...,
    block_q: int | None = ...,
    block_k: int | None = ...,
    return_lse: Literal[False] = ...,
    softcap: float | None = ...,
    sinks: torch.Tensor | None = ...,
    align: str = ...,
    cu_seqlens_q: torch.Tensor | None = ...,
    cu_seqlens_k: torch.Tensor | None = ...,
    generator: torch.Generator | None = ...,
) -> torch.Tensor: ...


@overload
def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | CausalBias | None = ...,
    dropout_p: float = ...,
    is_causal: bool = ...,
    scale: float | None = ...,
    enable_gqa: bool = ...,
    *,
    strategy: str = ...,
    window: tuple[int | None, int | None] | None = ...,
    block_q: int | None = ...,
    block_k: int | None = ...,
    return_lse: Literal[True],
    softcap: float | None = ...,
    sinks: torch.Tensor | None = ...,
    align: str = ...,
    cu_seqlens_q: torch.Tensor | None = ...,
    cu_seqlens_k: torch.Tensor | None = ...,
    generator: torch.Generator | None = ...,
) -> tuple[torch.Tensor, torch.Tensor]: ...


@overload
def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | CausalBias | None = ...,
    dropout_p: float = ...,
    is_causal: bool = ...,
    scale: float | None = ...,
    enable_gqa: bool = ...,
    *,
    strategy: str = ...,
    window: tuple[int | None, int | None] | None = ...,
    block_q: int | None = ...,
    block_k: int | None = ...,
    return_lse: bool,
    softcap: float | None = ...,
    sinks: torch.Tensor | None = ...,
    align: str = ...,
    cu_seqlens_q: torch.Tensor | None = ...,
    cu_seqlens_k: torch.Tensor | None = ...,
    generator: torch.Generator | None = ...,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | CausalBias | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    strategy: str = "auto",
    window: tuple[int | None, int | None] | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
    return_lse: bool = False,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    align: str = "top-left",
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    r"""Scaled-dot-product attention with a hand-written backward.

    Same arguments and conventions as
    ``torch.nn.functional.scaled_dot_product_attention``::

        query: [..., Hq, Nq, d]     key: [..., Hkv, Nk, d]     value: [..., Hkv, Nk, dv]
        attn_mask: broadcastable to [..., Hq, Nq, Nk]; bool (True = attend) or
                   float (added to the scores; its gradient is returned when it
                   requires grad, summed over the dims it was broadcast along)
        returns:   [..., Hq, Nq, dv]

    The course chapter's ``[B, N, d]`` layout is the case of no leading dims (the first
    dim plays the heads).  ``is_causal`` masks key j > query i, aligned to the
    top-left corner (Nq=2, Nk=4: ``x...`` / ``xx..``).  ``scale`` defaults to
    1/sqrt(d).  ``enable_gqa`` lets Hq be a multiple of Hkv: query head h uses
    key/value head h // (Hq/Hkv); dK/dV are summed over each group and k, v
    are never expanded.  A query row that attends no key gets a zero output and
    zero gradients.

    Beyond SDPA:

    * ``window=(left, right)``: query i attends key j only when
      i - left <= j <= i + right (None = unbounded on that side); combines
      with ``is_causal`` and ``attn_mask``.  ``(2, 0)`` with Nq = Nk = 4::

          j:  0 1 2 3
          i=0 x . . .
          i=1 x x . .
          i=2 x x x .
          i=3 . x x x

    * ``strategy``: the execution path, one of ``attngrad.STRATEGIES`` or
      ``"auto"``.  ``"explicit"`` saves P for backward (O(N^2) memory);
      ``"recompute"`` saves each row's max and log-normalizer and rebuilds
      P from them in backward, one chunk of query rows at a time;
      ``"flash"`` tiles both passes with an online softmax (O(N) memory);
      ``"triton"`` runs the flash algorithm as fused Triton kernels on CUDA
      (``pip install 'attngrad[gpu]'``; on CPU only under TRITON_INTERPRET=1).
      ``"auto"`` takes triton on CUDA when Triton is installed; otherwise
      flash when Nq * Nk >= 2**20 (2**18 with ``is_causal`` or a window) or
      block sizes are given, else explicit — about where `attngrad bench`
      finds flash faster on CPU.
    * ``block_q``, ``block_k``: tile sizes of the tiled strategies (default:
      chosen from the shape).
    * ``return_lse=True`` returns ``(out, lse)``: lse ``[..., Hq, Nq]`` is the
      natural log-sum-exp of each row's scaled, masked scores (float32 for
      16/32-bit inputs, float64 for float64; -inf on a row that attends
      nothing), differentiable like the output.

    Every derivative works on every strategy: backward, double backward
    (``create_graph=True``), forward mode (``torch.func.jvp``,
    ``torch.autograd.forward_ad``) and the ``torch.func`` transforms
    (``grad``, ``vjp``, ``vmap``, ``jacrev``, ``jacfwd``, ``hessian``), at
    the strategy's memory cost: the tiled strategies stay O(N) under all of
    them.  Third derivatives raise NotImplementedError.

    * ``dropout_p``: SDPA's attention dropout, on P after the softmax: each
      entry kept with probability 1 - p and scaled by 1 / (1 - p) (p = 1
      gives zeros).  The mask is a hash of (seed, offset, batch * head,
      query position, key position) (`attngrad.core.dropout`), never stored: every
      strategy draws the same mask bit for bit and backward regenerates it.
      Seed and offset are one draw from ``generator`` (default: the
      device's default generator, so ``torch.manual_seed`` reproduces a call).
    * ``softcap=c``: scores become c * tanh(S / c), S = scale * q k^T, before
      the mask or bias is added (Gemma 2).
    * ``sinks``: logits that join every row's softmax denominator and carry
      no value (gpt-oss): ``[Hq]`` (per head) or broadcastable to
      ``[..., Hq, Nq]`` (per token); their gradient is returned.  lse then
      counts them too; a row that attends no key gets a zero output.
    * ``align``: where ``is_causal`` and ``window`` sit when Nq != Nk:
      ``"top-left"`` (SDPA's: query i at key i) or ``"bottom-right"``
      (FlashAttention 2's: query i at key i + Nk - Nq, what decoding with a
      KV cache needs).  SDPA's ``CausalBias`` masks (``causal_upper_left``,
      ``causal_lower_right``) are accepted as ``attn_mask`` too.
    * ``cu_seqlens_q``, ``cu_seqlens_k``: packed sequences, 1-D int tensors
      of cumulative lengths [0, ..., Nq] / [0, ..., Nk] (k defaults to q
      when Nq = Nk).  Query segment s attends key segment s only; causal,
      window and alignment apply inside each pair, an empty key segment
      gives zero rows, and the tiled strategies skip every tile outside
      the segments.  See `attngrad.core.band` for pictures.

    In models:

    * Under ``torch.autocast`` the inputs are cast as autocast casts SDPA's
      (floating-point tensors other than float64 go to the autocast dtype, so
      float32 q, k and a bfloat16 v run in bfloat16) and the output has that
      dtype; the strategies then run with autocast off, in their own
      precisions (`attngrad.core.amp`).  Outside autocast, mixed dtypes are a
      TypeError.
    * Under ``torch.compile`` the call becomes two opaque ops, forward and
      backward (`attngrad.integrations.torch_compile`): no graph break, ``fullgraph=True``
      works, results equal eager's; first order only there, and dropout
      draws from the default generator (``generator=`` is refused).
    * `attngrad.patch_sdpa` routes code that calls SDPA itself to this
      function; `attngrad.integrations.transformers.register` plugs it into
      Hugging Face transformers models.

    >>> q = torch.randn(2, 8, 16, 64)
    >>> attention(q, q, q, is_causal=True).shape
    torch.Size([2, 8, 16, 64])
    """
    query, key, value, attn_mask = autocast_inputs(query, key, value, attn_mask)
    causal_bias = attn_mask if isinstance(attn_mask, CausalBias) else None
    shapes = validate_attention(
        query, key, value, None if causal_bias is not None else attn_mask, dropout_p, is_causal, scale,
        enable_gqa,
    )  # fmt: skip
    align = validate_align(align)
    if causal_bias is not None:  # SDPA's causal masks: is_causal with their alignment
        align = causal_bias_alignment(causal_bias, shapes, is_causal, align)
        attn_mask, is_causal = None, True
    validate_strategy(strategy, STRATEGIES)
    check_flag("return_lse", return_lse)
    band = validate_window(window)
    cap = validate_softcap(softcap)
    compiling = torch.compiler.is_compiling()
    # under torch.compile the segments' values are read when the op runs (`attngrad.integrations.torch_compile`)
    segments = validate_segments(
        cu_seqlens_q, cu_seqlens_k, shapes, query.device, read=not compiling
    )
    sink = validate_sinks(sinks, query, shapes)
    generator = validate_generator(generator, query.device)
    banded = is_causal or band is not None or cu_seqlens_q is not None
    tiling_given = block_q is not None or block_k is not None
    name = resolve(strategy, shapes, tiling_given, banded, query.device)
    block_q, block_k = validate_blocks(block_q, block_k, name)
    q = query.reshape(shapes.batch, shapes.heads_q, shapes.seq_q, shapes.head_dim)
    k = key.reshape(shapes.batch, shapes.heads_kv, shapes.seq_k, shapes.head_dim)
    v = value.reshape(shapes.batch, shapes.heads_kv, shapes.seq_k, shapes.value_dim)
    s = 1.0 / math.sqrt(shapes.head_dim) if scale is None else float(scale)
    with outside_autocast(q.device.type):
        if compiling:
            if generator is not None:
                raise ValueError(
                    "generator= is not supported under torch.compile; dropout there draws from "
                    "the default generator (seed it with torch.manual_seed)."
                )
            o, lse = compiled.attention(
                name, q, k, v, split_mask(attn_mask, shapes), (cu_seqlens_q, cu_seqlens_k),
                causal_band(band, is_causal), align, cap, dropout_p, s, block_q, block_k,
            )  # fmt: skip
        else:
            dropout = None
            if dropout_p > 0:
                dropout = Dropout(float(dropout_p), *draw_seed(query.device, generator))
            mask = Mask.build(
                attn_mask, is_causal, band, shapes, align, segments, cap, dropout, query.device
            )
            options = {"block_q": block_q, "block_k": block_k} if name in TILED else {}
            o, lse = base.attention(MODULES[name], q, k, v, mask, s, **options)
    out = o.reshape(*shapes.lead, shapes.heads_q, shapes.seq_q, shapes.value_dim)
    lse = lse.reshape(*shapes.lead, shapes.heads_q, shapes.seq_q)
    if sink is not None:
        out, lse = merge_sinks(out, lse, sink)
    return (out, lse) if return_lse else out
