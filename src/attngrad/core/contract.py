"""Input checks for `attngrad.attention`, and the errors they raise.

Every check raises `ArgumentError` (a ``ValueError``) or `ArgumentTypeError`
(a ``TypeError``) that names the argument, shows the value it got and
suggests a fix.  Both are also ``RuntimeError``s, which is what PyTorch's
``scaled_dot_product_attention`` raises on bad arguments, so code written
for either catches them.  Nothing here modifies a tensor.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import TypeGuard

import torch

__all__ = [
    "DTYPES",
    "ArgumentError",
    "ArgumentTypeError",
    "Shapes",
    "check_flag",
    "dtype_name",
    "is_int",
    "pair",
    "validate_attention",
    "validate_blocks",
    "validate_strategy",
]


class ArgumentError(ValueError, RuntimeError):
    """A bad argument value: a shape that does not fit, a size or a name out of range.

    ``except ValueError`` catches it, and so does ``except RuntimeError``, which
    is what PyTorch's ``scaled_dot_product_attention`` raises on bad arguments.

    >>> import attngrad
    >>> q = torch.randn(1, 2, 8, 16)
    >>> try:
    ...     attngrad.attention(q, q, q, strategy="fast")
    ... except RuntimeError as e:
    ...     print(type(e).__name__, isinstance(e, ValueError))
    ArgumentError True
    """


class ArgumentTypeError(TypeError, RuntimeError):
    """An argument of the wrong type or dtype.

    ``except TypeError`` catches it, and so does ``except RuntimeError``, as for
    PyTorch's ``scaled_dot_product_attention``.
    """


# The floating dtypes attention accepts, by the names the CLI takes.
DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def dtype_name(dtype: torch.dtype) -> str:
    """The name a dtype goes by in `DTYPES`, tables and files: ``torch.float32`` -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")


def pair(a: int, b: int, sep: str) -> str:
    """``8`` when equal, else ``8:2`` (GQA heads, d:dv) or ``64 x 128`` (Nq x Nk)."""
    return str(a) if a == b else f"{a}{sep}{b}"


@dataclass(frozen=True)
class Shapes:
    """The sizes of one attention call.

    q: [*lead, Hq, Nq, d], k: [*lead, Hkv, Nk, d], v: [*lead, Hkv, Nk, dv];
    ``headless``: the inputs were SDPA's 2-D q: [Nq, d], k: [Nk, d], v: [Nk, dv]
    (lead = (), one head), so the output is [Nq, dv] and lse [Nq].
    """

    lead: tuple[int, ...]
    heads_q: int
    heads_kv: int
    seq_q: int
    seq_k: int
    head_dim: int
    value_dim: int
    headless: bool = False

    @staticmethod
    def of(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Shapes:
        """The sizes of canonical q: [B, Hq, Nq, d], k: [B, Hkv, Nk, d], v: [B, Hkv, Nk, dv]."""
        return Shapes((q.shape[0],), q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3],
                      v.shape[3])  # fmt: skip

    @property
    def batch(self) -> int:
        """All leading dims flattened into one batch dim."""
        return math.prod(self.lead)

    @property
    def groups(self) -> int:
        """Query heads per key/value head (1 without GQA)."""
        return self.heads_q // self.heads_kv

    @property
    def score_shape(self) -> tuple[int, ...]:
        """[*lead, Hq, Nq, Nk] ([Nq, Nk] headless), the shape a mask must broadcast to."""
        return (*self._lead_and_heads, self.seq_q, self.seq_k)

    @property
    def out_shape(self) -> tuple[int, ...]:
        """[*lead, Hq, Nq, dv] ([Nq, dv] headless), the output's shape."""
        return (*self._lead_and_heads, self.seq_q, self.value_dim)

    @property
    def lse_shape(self) -> tuple[int, ...]:
        """[*lead, Hq, Nq] ([Nq] headless), lse's shape."""
        return (*self._lead_and_heads, self.seq_q)

    @property
    def _lead_and_heads(self) -> tuple[int, ...]:
        return self.lead if self.headless else (*self.lead, self.heads_q)


def _check_tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ArgumentTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}: {t!r:.80}")
    if t.dtype not in DTYPES.values():
        raise ArgumentTypeError(
            f"{name} has dtype {t.dtype}; attention takes float64, float32, float16 or "
            f"bfloat16 tensors. Try {name}.float()."
        )
    if t.ndim < 2:
        raise ArgumentError(
            f"{name} must have at least 2 dims [..., seq_len, head_dim] (SDPA's [..., heads, "
            f"seq_len, head_dim], or [seq_len, head_dim] for one head), got shape "
            f"{tuple(t.shape)}. For a single position use {name}.unsqueeze(0)."
        )
    return t


def check_flag(name: str, value: object) -> None:
    """ArgumentTypeError unless ``value`` is True or False (``name`` is the argument's)."""
    if not isinstance(value, bool):
        raise ArgumentTypeError(f"{name} must be True or False, got {value!r}")


def _check_scale(scale: object) -> None:
    if scale is None:
        return
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise ArgumentTypeError(
            f"scale must be a real number or None, got {scale!r:.80} of type "
            f"{type(scale).__name__}. Pass float(scale), or None for 1/sqrt(head_dim)."
        )
    if not math.isfinite(scale):
        raise ArgumentError(
            f"scale must be finite, got {scale!r}. Pass None for the default 1/sqrt(head_dim)."
        )


def _check_dropout(dropout_p: object) -> None:
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise ArgumentTypeError(
            f"dropout_p must be a float in [0, 1], got {dropout_p!r:.80} of type "
            f"{type(dropout_p).__name__}. Pass 0.0 to disable dropout."
        )
    if not 0.0 <= float(dropout_p) <= 1.0:  # NaN fails too
        raise ArgumentError(
            f"dropout_p must be in [0, 1], got {dropout_p!r}: the probability of dropping each "
            "attention weight. Use 0.0 to disable dropout (e.g. in eval mode)."
        )


def _check_same_kind(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    for name, t in (("key", key), ("value", value)):
        if t.dtype != query.dtype:
            raise ArgumentTypeError(
                f"{name} has dtype {t.dtype} but query has {query.dtype}; all three must match. "
                f"Try {name}.to(query.dtype)."
            )
        if t.device != query.device:
            raise ArgumentError(
                f"{name} is on {t.device} but query is on {query.device}; all three must be on "
                f"one device. Try {name}.to(query.device)."
            )
        if t.ndim != query.ndim:
            raise ArgumentError(
                f"{name} has {t.ndim} dims (shape {tuple(t.shape)}) but query has {query.ndim} "
                f"(shape {tuple(query.shape)}); q, k, v must all be [..., heads, seq_len, head_dim]."
            )


def _shapes(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, enable_gqa: bool
) -> Shapes:
    q, k, v = query.shape, key.shape, value.shape
    headless = query.ndim == 2  # SDPA's [N, d]: one head, no batch
    if not q[:-3] == k[:-3] == v[:-3]:
        raise ArgumentError(
            f"batch dims differ: query {tuple(q)}, key {tuple(k)}, value {tuple(v)}; "
            "the dims before [heads, seq_len, head_dim] must be equal."
        )
    if not headless and k[-3] != v[-3]:
        raise ArgumentError(
            f"key has {k[-3]} heads but value has {v[-3]} (key {tuple(k)}, value {tuple(v)}); "
            "key and value must have the same number of heads."
        )
    if k[-2] != v[-2]:
        raise ArgumentError(
            f"key has seq_len {k[-2]} but value has {v[-2]} (key {tuple(k)}, value {tuple(v)}); "
            "each key needs one value."
        )
    if q[-1] != k[-1]:
        raise ArgumentError(
            f"query head_dim {q[-1]} differs from key head_dim {k[-1]} (query {tuple(q)}, key "
            f"{tuple(k)}); q @ k^T needs them equal."
        )
    if q[-1] == 0 or v[-1] == 0:
        raise ArgumentError(f"head_dim must be at least 1, got query {tuple(q)}, value {tuple(v)}.")
    hq, hkv = (1, 1) if headless else (q[-3], k[-3])
    if hq == 0 or hkv == 0:
        raise ArgumentError(
            f"heads (dim -3) must be at least 1, got query {tuple(q)}, key {tuple(k)}."
        )
    if enable_gqa:
        if hq % hkv != 0:
            raise ArgumentError(
                f"with enable_gqa=True, query heads ({hq}) must be a multiple of key/value heads "
                f"({hkv}); query {tuple(q)}, key {tuple(k)}."
            )
    elif hq != hkv:
        hint = " Try enable_gqa=True." if hkv and hq % hkv == 0 else ""
        raise ArgumentError(
            f"query has {hq} heads but key/value have {hkv} (query {tuple(q)}, key {tuple(k)})."
            + hint
        )
    return Shapes(
        lead=tuple(q[:-3]),
        heads_q=hq,
        heads_kv=hkv,
        seq_q=q[-2],
        seq_k=k[-2],
        head_dim=q[-1],
        value_dim=v[-1],
        headless=headless,
    )


def _check_mask(attn_mask: object, query: torch.Tensor, shapes: Shapes, is_causal: bool) -> None:
    if attn_mask is None:
        return
    if not isinstance(attn_mask, torch.Tensor):
        raise ArgumentTypeError(
            f"attn_mask must be a torch.Tensor or None, got {type(attn_mask).__name__}"
        )
    if is_causal:
        raise ArgumentError(
            "is_causal=True and an attn_mask were both given; pass one of them. To combine "
            "them, build the causal part into the mask: with causal = torch.ones(Nq, Nk, "
            "dtype=torch.bool).tril(), a bool mask becomes attn_mask & causal and a float mask "
            "attn_mask.masked_fill(~causal, float('-inf')). (window=(None, 0) also combines "
            "a causal band with any mask.)"
        )
    if attn_mask.dtype != torch.bool and attn_mask.dtype != query.dtype:
        raise ArgumentTypeError(
            f"attn_mask has dtype {attn_mask.dtype}; it must be bool (True = attend) or the "
            f"query's dtype {query.dtype} (added to the scores). "
            f"Try attn_mask.to(torch.bool) or attn_mask.to({query.dtype})."
        )
    if attn_mask.device != query.device:
        raise ArgumentError(
            f"attn_mask is on {attn_mask.device} but query is on {query.device}. "
            "Try attn_mask.to(query.device)."
        )
    target = shapes.score_shape
    shape = tuple(attn_mask.shape)
    fits = len(shape) <= len(target) and all(
        m in (1, t)
        for m, t in zip(reversed(shape), reversed(target[len(target) - len(shape) :]), strict=True)
    )
    if not fits:
        raise ArgumentError(
            f"attn_mask has shape {shape}, which does not broadcast to the scores' shape "
            f"{target} ([..., heads, seq_q, seq_k]); each mask dim must be 1 or equal the "
            "matching score dim."
        )


def validate_attention(
    query: object,
    key: object,
    value: object,
    attn_mask: object,
    dropout_p: object,
    is_causal: object,
    scale: object,
    enable_gqa: object,
) -> Shapes:
    """Check the arguments of `attngrad.attention`; return the call's sizes."""
    q = _check_tensor("query", query)
    k = _check_tensor("key", key)
    v = _check_tensor("value", value)
    _check_same_kind(q, k, v)
    check_flag("is_causal", is_causal)
    check_flag("enable_gqa", enable_gqa)
    _check_scale(scale)
    _check_dropout(dropout_p)
    shapes = _shapes(q, k, v, bool(enable_gqa))
    _check_mask(attn_mask, q, shapes, bool(is_causal))
    return shapes


def validate_strategy(strategy: object, available: tuple[str, ...]) -> str:
    """Check the strategy name against ``available`` (plus "auto")."""
    if not isinstance(strategy, str) or strategy not in (*available, "auto"):
        choices = ", ".join(repr(s) for s in ("auto", *available))
        raise ArgumentError(f"unknown strategy {strategy!r}; choose one of {choices}.")
    return strategy


def is_int(x: object) -> TypeGuard[numbers.Integral]:
    """An integer of any kind (Python, numpy, ...), but not a bool."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def validate_blocks(
    block_q: object, block_k: object, strategy: str, tiled: tuple[str, ...]
) -> tuple[int | None, int | None]:
    """Tile sizes: positive ints, and only for the tiled strategies ``tiled``.

    ``strategy`` is the resolved one (not "auto"); ``tiled`` comes from the
    registry (`attngrad.strategies.TILED`).  What sizes a strategy takes
    beyond that is its own `tiles`' check.  Returns them as Python ints (or None).
    """
    sizes: list[int | None] = []
    for name, value in (("block_q", block_q), ("block_k", block_k)):
        if value is None:
            sizes.append(None)
            continue
        if not is_int(value):
            raise ArgumentTypeError(
                f"{name} must be an int or None (chosen from the shape), got {value!r} of type "
                f"{type(value).__name__}. Try {name}=int({value!r})."
            )
        size = int(value)
        if size < 1:
            raise ArgumentError(
                f"{name} must be a positive int or None (chosen from the shape), got {size}"
            )
        if strategy not in tiled:
            raise ArgumentError(
                f"{name}={size} only applies to the tiled strategies "
                f"{', '.join(repr(s) for s in tiled[:-1])} and {tiled[-1]!r}, not {strategy!r}. "
                f"Drop it or pass strategy={tiled[0]!r}."
            )
        sizes.append(size)
    return sizes[0], sizes[1]
