"""`attention`: a drop-in for `torch.nn.functional.scaled_dot_product_attention`."""

from __future__ import annotations

from typing import Literal, overload

import torch
from torch.nn.attention.bias import CausalBias

from attngrad.call import Call, compiled, eager
from attngrad.core.amp import autocast_inputs, outside_autocast

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

    As in SDPA, 2-D inputs are one head with no batch: query [Nq, d], key
    [Nk, d], value [Nk, dv] and attn_mask broadcastable to [Nq, Nk] give
    [Nq, dv] (and lse [Nq]).

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
      backward (`attngrad.call.compiled`): no graph break, ``fullgraph=True``
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
    compiling = torch.compiler.is_compiling()
    call = Call.build(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
        strategy=strategy, window=window, block_q=block_q, block_k=block_k,
        return_lse=return_lse, softcap=softcap, sinks=sinks, align=align,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, generator=generator,
        compiling=compiling,
    )  # fmt: skip
    q, k, v = call.inputs(query, key, value)
    with outside_autocast(q.device.type):
        o, lse = (compiled if compiling else eager).run(call, q, k, v)
    return call.outputs(o, lse)
