r"""Attention dropout from a counter-based hash: the mask is a pure function of positions.

SDPA's semantics: after the softmax, each entry of P is kept with
probability 1 - p and scaled by 1 / (1 - p) (p = 1 keeps nothing)::

    O = (P * Z) v / (1 - p),     Z[b, h, i, j] = keep(seed, offset, b * Hq + h, i, j)

Z is never stored.  Every strategy and every pass (forward, backward, the
second-order and tangent passes) draws the tile of Z it needs from the same
function of (seed, offset, batch*head, query position, key position), so
explicit, recompute, flash, fused, triton and ring attention see one mask, bit for
bit, whatever their tiling.  The hash, in 32-bit words (``mix`` is
MurmurHash3's finalizer, a bijection of 32-bit words)::

    row(bh, i) = mix(mix(mix(mix(seed) ^ offset) ^ bh) ^ i)       O(Nq) per head
    col(j)     = mix(mix(seed ^ 0x9E3779B9) ^ j)                  O(Nk)
    x          = row(bh, i) ^ col(j)                              per score, int32 from here
    y          = (x + x * x) >> 1                                 mod 2^32, arithmetic shift
    keep       = y < T,   T = round((1 - p) 2^31) - 2^30

y is the triangular number x (x + 1) / 2 mod 2^31 (read as a signed 31-bit
word): x -> x (x + 1) / 2 is a permutation of the integers mod 2^31, and x
and x + 2^31 land 2^30 apart, so over 32-bit words every 31-bit value is hit
exactly twice -- y is uniform whenever x is, and the keep rate is exactly
(T + 2^30) / 2^31, i.e. 1 - p to within 2^-31.  Being non-linear (the
square), it breaks the xor structure of row ^ col.  Per score it costs
five integer ops in one buffer (xor, the fused x + x * x, shift, and the
compare done as ``(y - T) >> 31``, which gives -1 where kept and 0 where
dropped: a bit mask that is and-ed into a float tile's bits, so a dropped
entry becomes +0.0 with no comparison or select; y and T both lie in
[-2^30, 2^30], so y - T cannot overflow).  The same steps in Triton are in
`attngrad.strategies.triton.kernels`; `keep_mask` gives the whole mask for tests.

Seed and offset are one draw from the generator of the tensors' device
(``torch.manual_seed`` reproduces a call, ``torch.random.fork_rng`` isolates
it, ``generator=`` overrides it).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from attngrad.core.heads import take_rows

__all__ = ["Dropout", "draw_seed", "keep_mask", "mix32"]

_M32 = 0xFFFFFFFF
_COLUMN_SALT = 0x9E3779B9


def mix32(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finalizer on int64 tensors holding words in [0, 2^32)."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def _signed(h: torch.Tensor) -> torch.Tensor:
    """Words in [0, 2^32) (int64) -> the int32 with the same bits."""
    return (h - ((h >> 31) << 32)).to(torch.int32)


def draw_seed(device: torch.device, generator: torch.Generator | None) -> tuple[int, int]:
    """(seed, offset): one draw of two 32-bit words from ``generator`` or the device's default."""
    if generator is not None:
        device = generator.device
    words = torch.randint(0, 2**32, (2,), dtype=torch.int64, device=device, generator=generator)
    seed, offset = words.tolist()
    return int(seed), int(offset)


@dataclass(frozen=True)
class Dropout:
    """The dropout of one call: probability ``p``, its (seed, offset), and where positions start.

    row0, col0: the global positions of local query row 0 and key 0 (ring
    attention's blocks; 0 otherwise): the mask is indexed by global positions.
    batch: the batch of the call as the user made it, when vmap has folded
    samples into the batch (`attngrad.autograd.batching`): entry b draws
    the mask of entry b mod batch, so every vmapped sample (a cotangent of
    jacrev, a batched gradient) sees the forward's mask.
    """

    p: float
    seed: int
    offset: int
    row0: int = 0
    col0: int = 0
    batch: int | None = None

    @property
    def scale(self) -> float:
        """1 / (1 - p), the factor of every kept entry (0 when p = 1: nothing is kept)."""
        return 0.0 if self.p >= 1.0 else 1.0 / (1.0 - self.p)

    @property
    def threshold(self) -> int:
        """T, where y < T keeps a score (module docstring): in [-2^30, 2^30]."""
        return round((1.0 - self.p) * 2**31) - 2**30

    def folded(self, batch: int) -> Dropout:
        """The mask of a call of ``batch`` entries, seen after vmap folds samples into the batch."""
        return self if self.batch is not None else replace(self, batch=batch)

    def shifted(self, rows: int, cols: int) -> Dropout:
        """The same mask seen from a block whose local row 0 / key 0 sit ``rows`` / ``cols`` on."""
        return replace(self, row0=self.row0 + rows, col0=self.col0 + cols)

    def row_words(
        self, batch: int, heads_q: int, heads_kv: int, rows: slice, device: torch.device
    ) -> torch.Tensor:
        """row(bh, i) for query rows ``rows``: int32 [B, Hkv, G, r] (bh = b * Hq + h)."""
        bh = torch.arange(batch * heads_q, dtype=torch.int64, device=device)
        if self.batch is not None:
            bh %= self.batch * heads_q
        i = torch.arange(rows.start, rows.stop, dtype=torch.int64, device=device) + self.row0
        head = mix32(mix32(torch.tensor(self.seed, dtype=torch.int64, device=device)) ^ self.offset)
        words = mix32(mix32(head ^ bh).unsqueeze(-1) ^ i)  # [B*Hq, r]
        return _signed(words).view(batch, heads_kv, heads_q // heads_kv, -1)

    def col_words(self, cols: slice, device: torch.device) -> torch.Tensor:
        """col(j) for keys ``cols``: int32 [c]."""
        j = torch.arange(cols.start, cols.stop, dtype=torch.int64, device=device) + self.col0
        salt = mix32(torch.tensor(self.seed ^ _COLUMN_SALT, dtype=torch.int64, device=device))
        return _signed(mix32(salt ^ j))

    def words(
        self, batch: int, heads_q: int, heads_kv: int, seq_q: int, seq_k: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(row words int32 [B*Hq, Nq], column words int32 [Nk]): what a kernel finishes per score."""
        rows = self.row_words(batch, heads_q, heads_kv, slice(0, seq_q), device)
        return rows.reshape(batch * heads_q, seq_q), self.col_words(slice(0, seq_k), device)

    def tiles(
        self, q: torch.Tensor, k: torch.Tensor, dtype: torch.dtype
    ) -> Callable[[slice, slice], torch.Tensor]:
        """(rows, cols) -> Z's tile as a bit mask [B, Hkv, G*r, c] for q [B, Hq, Nq, d], k.

        All ones where kept, 0 where dropped, an integer as wide as ``dtype``
        (int32 for float32, int64 for float64) for `apply_`.  The row and
        column words are hashed once here (O(N)); each tile costs the five
        per-score ops, in one workspace reused from tile to tile (valid until
        the next tile is asked for; `dropped` may write into it).
        """
        b, hq, nq = q.shape[:3]
        hkv, device = k.shape[1], q.device
        row = self.row_words(b, hq, hkv, slice(0, nq), device).unsqueeze(-1)  # [B, Hkv, G, Nq, 1]
        col = self.col_words(slice(0, k.shape[2]), device)
        work: list[torch.Tensor] = []

        def bits(rows: slice, cols: slice) -> torch.Tensor:
            r = take_rows(row, rows)  # [B, Hkv, G*r, 1]
            c = col[cols]
            shape = (*r.shape[:-1], c.shape[0])
            n = math.prod(shape)
            if not work or work[0].numel() < n:
                work[:] = [torch.empty(n, dtype=torch.int32, device=device)]
            x = torch.bitwise_xor(r, c, out=work[0][:n].view(shape))
            x.addcmul_(x, x).bitwise_right_shift_(1)  # x (x + 1) / 2 mod 2^31
            x.sub_(self.threshold).bitwise_right_shift_(31)
            return x if dtype != torch.float64 else x.to(torch.int64)

        return bits

    @staticmethod
    def apply_(t: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
        """t * Z in place (dropped entries become +0.0) and return t; t float32 or float64.

        The 1 / (1 - p) factor is left to the caller, who can usually fold it
        into a smaller operand (dO, or O once at the end).
        """
        t.view(bits.dtype).bitwise_and_(bits)
        return t

    @staticmethod
    def dropped(t: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
        """t * Z written over ``bits`` (which it consumes), as a tensor of t's dtype; t is kept."""
        return torch.bitwise_and(t.view(bits.dtype), bits, out=bits).view(t.dtype)


def keep_mask(
    dropout: Dropout, batch: int, heads_q: int, seq_q: int, seq_k: int, device: torch.device
) -> torch.Tensor:
    """The whole keep mask Z: bool [B, Hq, Nq, Nk] (for tests and the reference)."""
    q = torch.empty(batch, heads_q, seq_q, 0, device=device)
    k = torch.empty(batch, heads_q, seq_k, 0, device=device)
    bits = dropout.tiles(q, k, torch.float32)(slice(0, seq_q), slice(0, seq_k))
    return (bits != 0).view(batch, heads_q, seq_q, seq_k)
