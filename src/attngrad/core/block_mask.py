"""`create_block_mask`: torch's ``BlockMask`` from a ``mask_mod``, built without a compiler.

torch's ``create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, ...)`` evaluates ``mask_mod``
on every score [B, H, Q_LEN, KV_LEN] under four nested ``vmap``s, then sums each block;
with ``_compile=True`` (what transformers passes) it first compiles that with Inductor,
once per shape: seconds to tens of seconds on a CPU, which a small model's step waits on.
This builds the same ``BlockMask`` -- the same ``kv_num_blocks``, ``kv_indices``,
``full_kv_num_blocks``, ``full_kv_indices`` (and the q-side lists torch derives from them),
``BLOCK_SIZE``, ``mask_mod`` and ``seq_lengths`` -- with plain tensor ops:

* ``mask_mod`` is classified once, on one score, as the flex strategies classify it
  (`attngrad.core.block_table.MaskFunction`, `attngrad.core.pointwise.Reads`): made of
  elementwise ops only (comparisons, arithmetic, ``and_masks``/``or_masks``, a captured
  tensor indexed at every position, as ``padding[b, kv_idx]``), it runs on broadcast
  indices b [B, 1, 1, 1], h [1, H, 1, 1], q_idx [1, 1, r, 1], kv_idx [1, 1, 1, c], once
  per chunk of blocks, and a mask that ignores b or h is evaluated once for all of them;
  any other runs under nested vmap, torch's own semantics;
* a block is *full* when every score in it is kept, *partial* when some are, *empty*
  otherwise; a block that runs past Q_LEN or KV_LEN counts its missing scores as masked,
  as torch's padding does, so it is never full;
* memory is bounded: ``mask_mod`` sees at most `CHUNK` scores per call (whole blocks,
  at least one), never [B, H, Q_LEN, KV_LEN] at once.

The indices passed to ``mask_mod`` are int32, as flex_attention passes them when it
evaluates the partial blocks (torch's ``create_block_mask`` passes int64: the same
masks, unless a mask's arithmetic overflows int32).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch.nn.attention import flex_attention as torch_flex

from attngrad.core.block_table import MaskFunction
from attngrad.core.contract import ArgumentError, ArgumentTypeError, check_flag, is_int
from attngrad.core.pointwise import INDEX, TileIndex, broadcast_axes, explain, one_thread, over_tile

__all__ = ["CHUNK", "create_block_mask", "torch_create_block_mask"]

CHUNK = 1 << 22  # scores per call of mask_mod (whole blocks, at least one)
DEFAULT_BLOCK = 128  # torch's _DEFAULT_SPARSE_BLOCK_SIZE

# torch's own builder, held here: the flex patch rebinds torch's module attribute to a wrapper
torch_create_block_mask: Callable[..., Any] = torch_flex.create_block_mask


def create_block_mask(
    mask_mod: Callable[..., torch.Tensor],
    B: int | None,
    H: int | None,
    Q_LEN: int,
    KV_LEN: int,
    device: torch.device | str | int | None = None,
    BLOCK_SIZE: int | tuple[int, int] = DEFAULT_BLOCK,
    _compile: bool = False,
    separate_full_blocks: bool = True,
    compute_dq_write_order: bool = False,
    dq_kv_order: bool = True,
) -> Any:
    """torch's ``create_block_mask``, the same arguments and the same ``BlockMask``, no compiler.

    A drop-in for ``torch.nn.attention.flex_attention.create_block_mask``: ``mask_mod(b, h,
    q_idx, kv_idx) -> bool`` (True keeps the score), B and H (None: one mask shared by
    every batch entry or head), Q_LEN, KV_LEN, ``device`` (default: torch's, the current
    accelerator or the CPU), ``BLOCK_SIZE`` (an int or (q, kv)); ``separate_full_blocks``,
    ``compute_dq_write_order`` and ``dq_kv_order`` as torch's.  ``_compile`` is accepted and
    ignored: nothing is compiled, so the first call for a new shape costs what every call
    costs (3 ms for a small model's padded causal mask at N = 32; about 60 ms for a causal
    mask at N = 4096 on one CPU thread, where torch's compiled builder, once compiled, takes
    20 ms; the same at N = 16384, 0.6 s).  The result works with
    `attngrad.flex_attention` and torch's ``flex_attention`` alike.

    Under ``torch.compile`` (while Dynamo traces the caller) it hands the call to torch's
    own builder, which Dynamo traces.

    >>> import attngrad
    >>> def causal(b, h, q_idx, kv_idx):
    ...     return q_idx >= kv_idx
    >>> mask = attngrad.create_block_mask(causal, None, None, 300, 300, device="cpu")
    >>> mask.kv_num_blocks.tolist(), mask.full_kv_num_blocks.tolist()  # the last block is cut
    ([[[1, 1, 3]]], [[[0, 1, 0]]])
    """
    if torch.compiler.is_compiling():
        return torch_create_block_mask(
            mask_mod, B, H, Q_LEN, KV_LEN, device, BLOCK_SIZE, False,
            separate_full_blocks=separate_full_blocks,
            compute_dq_write_order=compute_dq_write_order, dq_kv_order=dq_kv_order,
        )  # fmt: skip
    batch, heads = _size("B", B), _size("H", H)
    nq, nk = _length("Q_LEN", Q_LEN), _length("KV_LEN", KV_LEN)
    bq, bk = _block_size(BLOCK_SIZE)
    check_flag("separate_full_blocks", separate_full_blocks)
    check_flag("compute_dq_write_order", compute_dq_write_order)
    check_flag("dq_kv_order", dq_kv_order)
    where = _device(device)
    small = batch * heads * nq * nk <= CHUNK  # a few small ops: not worth waking threads
    with one_thread() if small else contextlib.nullcontext():
        mask = MaskFunction.of(mask_mod, where, batch, heads)
        kept_some, kept_all = _block_statuses(mask, nq, nk, (bq, bk), where)
    if separate_full_blocks:
        partial, full = kept_some & ~kept_all, kept_all
    else:
        partial, full = kept_some, None
    kv_num_blocks, kv_indices = _ordered(partial)
    full_num, full_indices = (None, None) if full is None else _ordered(full)
    block_mask = torch_flex.BlockMask.from_kv_blocks(
        kv_num_blocks, kv_indices, full_num, full_indices, BLOCK_SIZE=BLOCK_SIZE,
        mask_mod=mask_mod, seq_lengths=(nq, nk),
    )  # fmt: skip
    if compute_dq_write_order:
        _add_dq_write_order(block_mask, dq_kv_order)
    return block_mask


def _size(name: str, value: object) -> int:
    if value is None:
        return 1
    if not is_int(value):
        raise ArgumentTypeError(
            f"{name} must be an int or None (one mask shared by every "
            f"{'batch entry' if name == 'B' else 'head'}), got {value!r} of type "
            f"{type(value).__name__}. Pass {name}=int(...) or {name}=None."
        )
    if int(value) < 1:
        raise ArgumentError(
            f"{name} must be a positive int or None, got {int(value)}. Pass {name}=None for "
            "one mask shared by all."
        )
    return int(value)


def _length(name: str, value: object) -> int:
    if not is_int(value):
        raise ArgumentTypeError(
            f"{name} must be an int (a sequence length), got {value!r} of type "
            f"{type(value).__name__}. Pass {name}=int(...)."
        )
    if int(value) < 1:
        raise ArgumentError(f"{name} must be a positive int (a sequence length), got {int(value)}.")
    return int(value)


def _block_size(value: object) -> tuple[int, int]:
    sizes = value if isinstance(value, (tuple, list)) else (value, value)
    if len(sizes) != 2 or not all(is_int(s) for s in sizes):
        raise ArgumentTypeError(
            f"BLOCK_SIZE must be an int or a pair of ints (Q_BLOCK_SIZE, KV_BLOCK_SIZE), got "
            f"{value!r}. Pass e.g. BLOCK_SIZE=128 or BLOCK_SIZE=(128, 64)."
        )
    bq, bk = (int(s) for s in sizes)
    if bq < 1 or bk < 1:
        raise ArgumentError(
            f"BLOCK_SIZE must be positive, got {value!r}. Pass e.g. BLOCK_SIZE={DEFAULT_BLOCK}."
        )
    return bq, bk


def _device(device: object) -> torch.device:
    if device is None:  # torch's default: the current accelerator, else the CPU
        accelerator = getattr(torch, "accelerator", None)
        current = accelerator.current_accelerator() if accelerator is not None else None
        return torch.device("cpu" if current is None else current)
    try:
        where: torch.device = torch.device(device)  # type: ignore[call-overload]
        return where
    except (RuntimeError, TypeError) as err:
        raise ArgumentError(
            f"device must name a device (e.g. 'cpu', 'cuda', torch.device('cuda', 0)), got "
            f"{device!r}: {err}"
        ) from None


def _evaluate(
    mask: MaskFunction, rows: range, cols: range, length: tuple[int, int], device: torch.device
) -> torch.Tensor:
    """``mask_mod`` on the scores [rows, cols] of every (b, h), the positions at or past
    ``length`` = (Q_LEN, KV_LEN) masked (torch pads with False): bool [b', h', r, c], b' in
    (1, B) and h' in (1, H) (1 where an elementwise mask does not depend on it)."""
    nq, nk = length
    i = torch.arange(rows.start, rows.stop, dtype=INDEX, device=device)
    j = torch.arange(cols.start, cols.stop, dtype=INDEX, device=device)
    whole = TileIndex.of(mask.batch, mask.batch, mask.heads, slice(0, 0), slice(0, 0), device)
    # a block past the end reads the last position there (a captured table has no more)
    index = replace(whole, i=i.clamp(max=nq - 1), j=j.clamp(max=nk - 1))
    fn = mask.fn

    def point(b: torch.Tensor, h: torch.Tensor, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        return fn(b, h, i, j)

    r, c = len(rows), len(cols)
    with torch.no_grad():
        try:
            keep = fn(*broadcast_axes(index)) if mask.elementwise else over_tile(point, None, index)
        except RuntimeError as err:
            raise explain(err, "mask_mod") from err
        if not isinstance(keep, torch.Tensor) or keep.dtype != torch.bool:
            got = f"dtype {keep.dtype}" if isinstance(keep, torch.Tensor) else type(keep).__name__
            raise ArgumentTypeError(
                f"mask_mod must return a bool tensor (True = keep the score), got {got}. "
                "Return a comparison of its arguments, e.g. `q_idx >= kv_idx`."
            )
        try:
            shape = torch.broadcast_shapes(keep.shape, (1, 1, r, c))  # type: ignore[no-untyped-call]
        except RuntimeError:
            shape = torch.Size()
        if len(shape) != 4 or shape[0] not in (1, mask.batch) or shape[1] not in (1, mask.heads):
            raise ArgumentError(
                f"mask_mod returned shape {tuple(keep.shape)} over a block of (B, H, rows, keys) "
                f"= ({mask.batch}, {mask.heads}, {r}, {c}): it must return one bool per score. "
                "Index captured tensors at every position, e.g. `doc[q_idx] == doc[kv_idx]`."
            )
        if rows.stop > nq or cols.stop > nk:
            keep = keep & ((i < nq).view(-1, 1) & (j < nk)).view(1, 1, r, c)
        return keep.expand(shape).contiguous()


def _block_statuses(
    mask: MaskFunction, nq: int, nk: int, block: tuple[int, int], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(some kept, all kept): bool [B, H, ceil(nq / bq), ceil(nk / bk)] per block."""
    bq, bk = block
    blocks_q, blocks_k = -(-nq // bq), -(-nk // bk)
    shape = (mask.batch, mask.heads, blocks_q, blocks_k)
    some = torch.zeros(shape, dtype=torch.bool, device=device)
    every = torch.zeros(shape, dtype=torch.bool, device=device)
    per_call = max(1, CHUNK // (mask.batch * mask.heads * bq * bk))  # blocks per call
    step_k = min(blocks_k, per_call)
    step_q = max(1, per_call // step_k)
    for q0 in range(0, blocks_q, step_q):
        q1 = min(blocks_q, q0 + step_q)
        for k0 in range(0, blocks_k, step_k):
            k1 = min(blocks_k, k0 + step_k)
            keep = _evaluate(
                mask, range(q0 * bq, q1 * bq), range(k0 * bk, k1 * bk), (nq, nk), device
            )
            # as bytes: max and min over the inner (contiguous) axis first, several times
            # faster than any and all over the block's two axes
            tiles = keep.view(torch.uint8).view(*keep.shape[:2], q1 - q0, bq, k1 - k0, bk)
            some[:, :, q0:q1, k0:k1] = tiles.amax(5).amax(3).bool()
            every[:, :, q0:q1, k0:k1] = tiles.amin(5).amin(3).bool()
    return some, every


def _ordered(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(num_blocks int32 [..., rows], indices int32 [..., rows, cols]): each row's listed
    blocks first, ascending, then the others, as torch orders them."""
    dense = dense.to(torch.int32)
    num = dense.sum(dim=-1).to(torch.int32)
    indices = torch.argsort(dense, dim=-1, descending=True, stable=True).to(torch.int32)
    return num.contiguous(), indices.contiguous()


def _add_dq_write_order(block_mask: Any, dq_kv_order: bool) -> None:
    """What torch's builder adds for ``compute_dq_write_order=True`` (its own function)."""
    compute = getattr(torch_flex, "_compute_dq_write_order_from_block_mask", None)
    if compute is None:
        raise ArgumentError(
            f"compute_dq_write_order=True needs a torch whose BlockMask has a dQ write order; "
            f"torch {torch.__version__} has none. Leave it False."
        )
    order, order_full = compute(block_mask, dq_kv_order=dq_kv_order)
    block_mask.dq_write_order = order
    block_mask.dq_write_order_full = order_full
    block_mask.dq_kv_order = None
    block_mask.dq_kv_order_spt = dq_kv_order
