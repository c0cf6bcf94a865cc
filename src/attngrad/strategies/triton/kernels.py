"""Triton kernels of strategy "triton": the flash algorithm, fused.

Four kernels over contiguous q: [B, Hq, Nq, d], k: [B, Hkv, Nk, d],
v: [B, Hkv, Nk, dv] (GQA: query head h reads key/value head h // G):

* `attention_forward`   one program per (query block, batch*query head): online
  softmax over the key tiles the band allows; writes O and the row statistics
  Stats = (m, log l) (see `attngrad.core.ops`).
* `attention_delta`     Delta = rowsum(O * dO), one program per query block, as the
  diagonal of dO O^T: the product that forms dP (`_dot_rows`), so that dP - Delta
  is exactly 0 where a row's P is one-hot.
* `attention_dkdv`      one program per (key block, batch*kv head): walks the G
  query heads of its group and the query tiles the band allows; dK and dV
  are summed in registers and written once (deterministic, no atomics).
* `attention_dq`        one program per (query block, batch*query head): dQ, and
  dS itself where the caller needs a bias gradient.

Scores.  S = scale * q k^T, capped to c tanh(S / c) under a softcap
(HAS_SOFTCAP), then the bias added; every score outside Nq x Nk, the band or
the keep mask is -inf.  The band (`attngrad.core.band.Band`) comes as per-row
intervals Lo[i] <= j < Hi[i] (int64 [Nq]); a block of query rows visits the
keys [min lo, max hi) of its rows, and the dK/dV kernel's key block the rows
[min First, max Stop) of its keys (`Band.query_span`, int64 [Nk]).  A row
past Nq, a key past Nk, or a row that attends nothing has the empty interval
(Nk, 0) (or (Nq, 0)), which never widens a block's range; without a band
every real row's interval is [0, Nk), so one comparison masks bounds and
band alike.  Backward: dS = P * (dP - Delta) is the gradient of the capped,
biased score (the bias's, stored with STORE_DS); q and k take
dS * (1 - tanh(S / c)^2) under a softcap.

Scores stay in natural units until the row max m is subtracted; the softmax
is exp2((s - m) * log2 e), never exp2 of a score itself, so no finite score
overflows (finfo.min * log2 e would).  Scale, log2 e, the softcap c and the
dropout factor 1 / (1 - p) come in a small tensor of the accumulation dtype
(Scales = [scale, log2 e, c, 1 / (1 - p)]): a Python float argument would
reach a compiled kernel as float32 and cost float64 its precision.  The grid
is (batch * heads, blocks): the first grid axis has no 65535 limit.  Head
dims are padded to a power of two >= 16 inside the kernels (masked loads),
never in memory.  A row that attends nothing has l = 0: O = 0, Stats =
(0, +inf), and backward rebuilds its P as exp2(-inf) = 0.

Dropout (HAS_DROPOUT, `attngrad.core.dropout`): the keep mask Z of a tile comes
from precomputed int32 words, RowWords [B*Hq, Nq] and ColWords [Nk], by the
per-score steps of `Dropout.tiles` (`_kept`), bit for bit the mask every
strategy draws.  Forward sums l over the undropped P and O over P * Z,
scaled by 1 / (1 - p); backward uses dV = (P Z / (1 - p))^T dO and
dP = (dO v^T) Z / (1 - p), Delta = rowsum(dO * O) as without dropout.

Registers.  What the compile report (`attngrad.tools.kernel_report`) found and
these kernels do about it: a tile's elements are addressed from a 64-bit
pointer to its corner by 32-bit offsets (`_tile_at`; 64-bit per element only
under WIDE_TILES, for masks or dS whose rows are so long that a tile spans
2**31 elements), and the dots over the head dim run in slices of CHUNK
columns read again from memory when they run on FMA units (float32 without
TF32, float64: `_dot_rows`), since an FMA dot keeps its operands' whole rows
in each thread's registers.  Tiles, warps and stages per GPU come from
`attngrad.strategies.triton.configs`.

Scores bit for bit.  Backward rebuilds P = exp2((S - m) log2 e - log2 l) from
the saved statistics, so the dK/dV kernel (k q^T) and the dQ kernel must form
each score with the bits forward formed it with: at |S| u ~ 1e-3 one more
rounding moves every P of the row.  FMA dots sum in column order whatever the
tile; in the interpreter, whose tl.dot is numpy's BLAS, each entry of a product
over the head dim is one numpy sum of its own products (REPEATABLE, `_repeatable`).

Import this module only after deciding on TRITON_INTERPRET: Triton reads it
when the kernels are decorated.  In the interpreter, importing it installs
`attngrad.strategies.triton.interpreter` (the same results, bit for bit, in
about 40% of the interpreter's time as shipped).
"""

from __future__ import annotations

import triton
import triton.language as tl

from attngrad.strategies.triton import interpreter

__all__ = [
    "INTERPRETED",
    "attention_delta",
    "attention_dkdv",
    "attention_dq",
    "attention_forward",
]


@triton.jit
def _narrow(x, dtype: tl.constexpr, UPCAST: tl.constexpr):
    """float32 ``x`` to ``dtype``, rounded to nearest even as the GPU does.

    UPCAST (bfloat16 in the interpreter): the interpreter cuts float32 to
    bfloat16 by dropping the low 16 bits (toward zero, up to a whole unit off,
    always the same way) and garbles subnormals, so the bits are rounded and
    moved by hand; NaN stays NaN.
    """
    if UPCAST:  # noqa: SIM102 - constexpr ifs, each compiled away on its own
        if dtype == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            bits = tl.where(x != x, 0x7FC0, bits).to(tl.uint16)
            return bits.to(tl.bfloat16, bitcast=True)
    return x.to(dtype)


@triton.jit
def _widen(x, dtype: tl.constexpr, UPCAST: tl.constexpr):
    """``x`` to the wider ``dtype``; exact.  UPCAST: bfloat16's bits moved by hand, as the
    interpreter garbles its subnormals (`_narrow`)."""
    if UPCAST:  # noqa: SIM102 - constexpr ifs, each compiled away on its own
        if x.dtype == tl.bfloat16:
            bits = x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16
            return bits.to(tl.float32, bitcast=True).to(dtype)
    return x.to(dtype)


@triton.jit
def _dot(a, b, ACC: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """a @ b accumulated in ACC.  UPCAST: widen bfloat16 operands first (the
    interpreter's bfloat16 dot is wrong; products of bfloat16 are exact in
    float32, so the result is the same as the GPU's)."""
    if UPCAST:
        a32, b32 = _widen(a, tl.float32, UPCAST), _widen(b, tl.float32, UPCAST)
        return tl.dot(a32, b32, input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=PRECISION, out_dtype=ACC)


@triton.jit
def _tile_at(head, r0, offs_r, n, c0, offs_c, width, WIDE: tl.constexpr):
    """(corner, offsets): element (r0, c0) of head ``head`` of a contiguous [heads, n, width]
    tensor, 64-bit (head is int64), and the tile's elements rows offs_r, columns offs_c
    from it, 32-bit unless WIDE (a tile that may span 2**31 elements): a 64-bit offset
    per element would cost registers the tiles need."""
    corner = (head * n + r0) * width + c0
    if WIDE:
        dr = (offs_r - r0).to(tl.int64)
        dc = (offs_c - c0).to(tl.int64)
    else:
        dr = (offs_r - r0).to(tl.int32)
        dc = (offs_c - c0).to(tl.int32)
    return corner, dr[:, None] * width + dc[None, :]


@triton.jit
def _load_tile(Ptr, head, r0, offs_r, n, offs_c, width):
    """Rows offs_r (from r0) of head ``head`` of a contiguous [heads, n, width] tensor (width
    a head dim, <= 256); zero past n, width."""
    corner, at = _tile_at(head, r0, offs_r, n, 0, offs_c, width, False)
    mask = (offs_r[:, None] < n) & (offs_c[None, :] < width)
    return tl.load(Ptr + corner + at, mask=mask, other=0.0)


@triton.jit
def _store_tile(
    Ptr, head, r0, offs_r, n, c0, offs_c, width, value, WIDE: tl.constexpr, UPCAST: tl.constexpr
):
    """Store ``value`` into rows offs_r (from r0), columns offs_c (from c0) of head ``head``
    (the layout of `_load_tile`; any width when WIDE), rounded as `_narrow` rounds."""
    corner, at = _tile_at(head, r0, offs_r, n, c0, offs_c, width, WIDE)
    mask = (offs_r[:, None] < n) & (offs_c[None, :] < width)
    tl.store(Ptr + corner + at, _narrow(value, Ptr.dtype.element_ty, UPCAST), mask=mask)


@triton.jit
def _tile_or_none(Ptr, head, r0, offs_r, n, offs_c, width, WHOLE: tl.constexpr):
    """`_load_tile` when WHOLE, else nothing (0.0): `_dot_rows` then reads the tile in slices."""
    if WHOLE:  # noqa: SIM108 - a constexpr if: only one branch is compiled
        tile = _load_tile(Ptr, head, r0, offs_r, n, offs_c, width)
    else:
        tile = 0.0
    return tile


@triton.jit
def _dot_rows(
    A, a_head, a0, offs_a, na, a,
    B, b_head, b0, offs_b, nb, b,
    width,
    BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_W: tl.constexpr, CHUNK: tl.constexpr,
    ACC: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, REPEATABLE: tl.constexpr,
):  # fmt: skip
    """a @ b^T over the head dim: rows offs_a of A's head a_head times rows offs_b of B's.

    CHUNK >= BLOCK_W: the loaded tiles a, b (`_tile_or_none`).  Otherwise the
    product is summed over slices of CHUNK columns read from memory: an FMA
    dot (float32 without TF32, float64) keeps the whole width of its operands'
    rows in each thread's registers, which spills at d = 128.

    REPEATABLE (the interpreter, whose CHUNK is whole): each entry is summed by
    one numpy reduction over its own products (`_repeatable`), so it has the
    same bits whatever the tile's shape and whichever operand comes first.  The scores
    S = q k^T are formed by three kernels (forward, dK/dV as k q^T, dQ) and
    dP = dO v^T by two, next to Delta = rowsum(dO * O) (`attention_delta`);
    numpy's BLAS rounds a product differently by shape and operand order on
    some CPUs, and at |S| u ~ 1e-3 one rounding of S moves every P of its row.
    """
    if REPEATABLE:
        out = _repeatable(a, b, ACC, UPCAST)
    elif CHUNK >= BLOCK_W:
        out = _dot(a, tl.trans(b), ACC, UPCAST, PRECISION)
    else:
        out = tl.zeros([BLOCK_A, BLOCK_B], ACC)
        for c0 in range(0, BLOCK_W, CHUNK):
            offs_c = c0 + tl.arange(0, CHUNK)
            a_c = _load_tile(A, a_head, a0, offs_a, na, offs_c, width)
            b_c = _load_tile(B, b_head, b0, offs_b, nb, offs_c, width)
            out += _dot(a_c, tl.trans(b_c), ACC, UPCAST, PRECISION)
    return out


@triton.jit
def _repeatable(a, b, ACC: tl.constexpr, UPCAST: tl.constexpr):
    """a @ b^T in ACC: [A, W] x [B, W] -> [A, B], each entry by the same sum of its products.

    The products a[i, c] b[j, c] are formed in ACC (exact for 16-bit
    operands) into a [A, W, B] tile that numpy lays out with W innermost, and
    numpy's pairwise sum over W adds them: entry (i, j) depends on rows a[i]
    and b[j] alone, bit for bit the entry (j, i) of b @ a^T and the entry of
    any other tile holding the two rows.  Interpreter only.
    """
    a = _widen(a, ACC, UPCAST)
    b = _widen(b, ACC, UPCAST)
    return tl.sum(a[:, :, None] * tl.trans(b)[None, :, :], 1)


@triton.jit
def _spans(Lo, Hi, offs, n, full, HAS_BAND: tl.constexpr):
    """(lo, hi): the intervals [lo, hi) of entries offs of int64 [n] pointers Lo, Hi.

    Empty ones (lo >= hi) and entries past n become (full, 0); without a band
    every entry below n spans [0, full).  So min(lo), max(hi) over a block
    cover exactly what its entries reach (nothing: an empty range)."""
    live = offs < n
    if HAS_BAND:
        lo = tl.load(Lo + offs, mask=live, other=full)
        hi = tl.load(Hi + offs, mask=live, other=0)
        live = lo < hi
    else:
        lo = tl.zeros_like(offs)
        hi = tl.zeros_like(offs) + full
    return tl.where(live, lo, full), tl.where(live, hi, 0)


@triton.jit
def _tanh(x):
    """tanh(x) to the precision of x's dtype (float32 or float64), relative near 0 too.

    |x| < 0.625: x (Q + z P) / Q with z = x^2 (Cephes' rational approximation,
    accurate to float64); else sign(x) (1 - e) / (1 + e) with e = exp(-2|x|)
    <= 0.29, free of cancellation.  One division either way."""
    a = tl.abs(x)
    z = x * x
    p = (-9.64399179425052238628e-1 * z - 9.92877231001918586564e1) * z - 1.61468768441708447952e3
    q = ((z + 1.12811678491632931402e2) * z + 2.23548839060100448583e3) * z
    q = q + 4.84406305325125486048e3
    e = tl.exp2(a * -2.8853900817779268)  # exp(-2|x|) = exp2(-2 log2(e) |x|)
    small = a < 0.625
    num = tl.where(small, x * (q + z * p), tl.where(x < 0, e - 1.0, 1.0 - e))
    return num / tl.where(small, q, 1.0 + e)


@triton.jit
def _capped(s, cap, HAS_SOFTCAP: tl.constexpr):
    """(c tanh(s / c), its slope 1 - tanh(s / c)^2) under a softcap c, else (s, 1)."""
    if HAS_SOFTCAP:
        t = _tanh(s / cap)
        out = cap * t
        slope = 1.0 - t * t
    else:
        out = s
        slope = 1.0
    return out, slope


@triton.jit
def _mask_scores(
    s,
    qi,
    kj,
    i0,
    j0,
    lo,
    hi,
    b,
    h,
    Bias,
    Keep,
    sbb,
    sbh,
    sbm,
    sbn,
    seb,
    seh,
    sem,
    sen,
    HAS_BIAS: tl.constexpr,
    HAS_KEEP: tl.constexpr,
    WIDE_TILES: tl.constexpr,
):
    """Scores s with the bias added and -inf wherever query qi may not see key
    kj: outside its interval lo <= kj < hi (`_spans`: bounds and band) or the
    keep mask.  qi, kj, lo, hi broadcast against s; (i0, j0) is the tile's
    first query and key.  The mask is read through a 64-bit pointer to score
    (i0, j0), then 32-bit offsets inside the tile (a mask may hold 2**31
    elements; a 64-bit offset per score costs registers), or 64-bit ones when
    WIDE_TILES (strides so long that a tile spans 2**31 elements)."""
    valid = (kj >= lo) & (kj < hi)
    if WIDE_TILES:
        di = (qi - i0).to(tl.int64)
        dj = (kj - j0).to(tl.int64)
    else:  # below BLOCK_M, BLOCK_N: exact in int32 whatever the index dtype
        di = (qi - i0).to(tl.int32)
        dj = (kj - j0).to(tl.int32)
    i0 = tl.cast(i0, tl.int64)  # a loop index: a plain int in the interpreter
    j0 = tl.cast(j0, tl.int64)
    if HAS_KEEP:
        corner = Keep + b * seb + h * seh + i0 * sem + j0 * sen
        keep = tl.load(corner + (di * sem + dj * sen), mask=valid, other=0)
        valid = valid & (keep != 0)
    if HAS_BIAS:
        corner = Bias + b * sbb + h * sbh + i0 * sbm + j0 * sbn
        bias = tl.load(corner + (di * sbm + dj * sbn), mask=valid, other=0.0)
        s = s + bias.to(s.dtype)
    return tl.where(valid, s, float("-inf"))


@triton.jit
def _kept(row, col, threshold):
    """Z: True where dropout keeps a score, from int32 row and column words that
    broadcast to the tile (`attngrad.core.dropout`): x = row ^ col,
    y = (x + x * x) >> 1 (wrapping, arithmetic shift), kept iff y < threshold."""
    x = row ^ col
    return ((x + x * x) >> 1) < threshold


@triton.jit
def _heads(bh, heads_q, groups):
    """(batch, query head, batch * Hkv + kv head) of the program of bh = batch * Hq + head."""
    b = bh // heads_q
    h = bh % heads_q
    return b, h, b * (heads_q // groups) + h // groups


@triton.jit
def _scales(Scales):
    """(scale, log2 e, softcap c, dropout's 1 / (1 - p)) from the Scales tensor, in its dtype."""
    return tl.load(Scales), tl.load(Scales + 1), tl.load(Scales + 2), tl.load(Scales + 3)


@triton.jit
def attention_forward(
    Q, K, V, Out, Stats, Bias, Keep, Lo, Hi, RowWords, ColWords,
    sbb, sbh, sbm, sbn, seb, seh, sem, sen,
    Scales,
    heads_q, groups, nq, nk, d, dv, threshold,
    HAS_BIAS: tl.constexpr, HAS_KEEP: tl.constexpr, HAS_BAND: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_DROPOUT: tl.constexpr, WIDE_TILES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    ACC: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, CHUNK: tl.constexpr,
    REPEATABLE: tl.constexpr,
):  # fmt: skip
    m0 = tl.program_id(1) * BLOCK_M
    bh = tl.program_id(0).to(tl.int64)  # offsets in int64: B*H*N*d may pass 2**31
    scale, log2e, cap, keep_scale = _scales(Scales)
    b, h, bhk = _heads(bh, heads_q, groups)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = _tile_or_none(Q, bh, m0, offs_m, nq, offs_d, d, CHUNK >= BLOCK_D)
    lo, hi = _spans(Lo, Hi, offs_m, nq, nk, HAS_BAND)
    if HAS_DROPOUT:
        row_words = tl.load(RowWords + bh * nq + offs_m, mask=offs_m < nq, other=0)
    m_i = tl.full([BLOCK_M], float("-inf"), ACC)
    l_i = tl.zeros([BLOCK_M], ACC)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], ACC)
    for n0 in range(tl.min(lo), tl.max(hi), BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        k = _tile_or_none(K, bhk, n0, offs_n, nk, offs_d, d, CHUNK >= BLOCK_D)
        v = _load_tile(V, bhk, n0, offs_n, nk, offs_dv, dv)
        s = _dot_rows(Q, bh, m0, offs_m, nq, q, K, bhk, n0, offs_n, nk, k, d,
                      BLOCK_M, BLOCK_N, BLOCK_D, CHUNK, ACC, UPCAST, PRECISION, REPEATABLE)  # fmt: skip
        s, _ = _capped(s * scale, cap, HAS_SOFTCAP)
        s = _mask_scores(s, offs_m[:, None], offs_n[None, :], m0, n0, lo[:, None], hi[:, None],
                         b, h, Bias, Keep, sbb, sbh, sbm, sbn, seb, seh, sem, sen,
                         HAS_BIAS, HAS_KEEP, WIDE_TILES)  # fmt: skip
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # a row with no key yet keeps m = -inf: shift it by 0 so exp2(-inf) = 0, not NaN
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2((s - shift[:, None]) * log2e)
        alpha = tl.exp2((m_i - shift) * log2e)
        l_i = l_i * alpha + tl.sum(p, 1)  # the undropped P's normalizer
        if HAS_DROPOUT:
            col_words = tl.load(ColWords + offs_n, mask=offs_n < nk, other=0)
            p = tl.where(_kept(row_words[:, None], col_words[None, :], threshold), p, 0.0)
        acc = acc * alpha[:, None] + _dot(_narrow(p, v.dtype, UPCAST), v, ACC, UPCAST, PRECISION)
        m_i = m_new
    dead = l_i == 0.0
    o = acc / tl.where(dead, 1.0, l_i)[:, None]
    if HAS_DROPOUT:
        o = o * keep_scale
    shift = tl.where(m_i == float("-inf"), 0.0, m_i)
    log_l = tl.where(dead, float("inf"), tl.log(tl.where(dead, 1.0, l_i)))
    _store_tile(Out, bh, m0, offs_m, nq, 0, offs_dv, dv, o, False, UPCAST)
    tl.store(Stats + (bh * nq + offs_m) * 2, shift, mask=offs_m < nq)
    tl.store(Stats + (bh * nq + offs_m) * 2 + 1, log_l, mask=offs_m < nq)


@triton.jit
def attention_delta(
    Out, DO, Delta, nq, dv,
    BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr,
    ACC: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, CHUNK: tl.constexpr,
    REPEATABLE: tl.constexpr,
):  # fmt: skip
    """Delta = rowsum(O * dO): [B*Hq, Nq] in ACC, the diagonal of dO O^T.

    Formed by the product that forms dP = dO v^T in the other kernels
    (`_dot_rows`): where a row's P is one-hot, its O is that key's row of v
    bit for bit, and dP - Delta there is exactly 0, as in exact arithmetic.
    A rowsum of O * dO rounds in another order, and dS = P (dP - Delta) would
    keep |dP| u of that difference at P = 1: dq and dk off by |dO| |v| |k| u
    where they are 0, past float16's range at inputs near its max.  The
    square product costs BLOCK_M times the rows' own work, still a small
    fraction of the dQ kernel's.
    """
    bh = tl.program_id(0).to(tl.int64)  # offsets in int64: B*H*N*d may pass 2**31
    m0 = tl.program_id(1) * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    do = _tile_or_none(DO, bh, m0, offs_m, nq, offs_dv, dv, CHUNK >= BLOCK_DV)
    o = _tile_or_none(Out, bh, m0, offs_m, nq, offs_dv, dv, CHUNK >= BLOCK_DV)
    products = _dot_rows(DO, bh, m0, offs_m, nq, do, Out, bh, m0, offs_m, nq, o, dv,
                         BLOCK_M, BLOCK_M, BLOCK_DV, CHUNK, ACC, UPCAST, PRECISION, REPEATABLE)  # fmt: skip
    diagonal = tl.where(offs_m[:, None] == offs_m[None, :], products, 0.0)
    tl.store(Delta + bh * nq + offs_m, tl.sum(diagonal, 1), mask=offs_m < nq)


@triton.jit
def _row_stats(Stats, Delta, bh, offs_m, nq, log2e):
    """(m, -log2 l, Delta) of rows offs_m: P = exp2((s - m) * log2 e - log2 l).

    -log2 l is -inf on a dead row (log l = +inf) and past Nq (so P = 0 there)."""
    at = (bh * nq + offs_m) * 2
    m = tl.load(Stats + at, mask=offs_m < nq, other=0.0)
    log_l = tl.load(Stats + at + 1, mask=offs_m < nq, other=float("inf"))
    delta = tl.load(Delta + bh * nq + offs_m, mask=offs_m < nq, other=0.0)
    return m, -log_l * log2e, delta


@triton.jit
def attention_dkdv(
    Q, K, V, DO, Stats, Delta, DK, DV, Bias, Keep, Lo, Hi, RowWords, ColWords, First, Stop,
    sbb, sbh, sbm, sbn, seb, seh, sem, sen,
    Scales,
    heads_q, groups, nq, nk, d, dv, threshold,
    HAS_BIAS: tl.constexpr, HAS_KEEP: tl.constexpr, HAS_BAND: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_DROPOUT: tl.constexpr, WIDE_TILES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    ACC: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, CHUNK: tl.constexpr,
    REPEATABLE: tl.constexpr,
):  # fmt: skip
    """dK = scale * sum_g dS_g^T q_g and dV = sum_g P~_g^T dO_g for one key block,
    working in the transposed orientation (keys along rows); query rows
    [min First, max Stop) of the block's keys only."""
    n0 = tl.program_id(1) * BLOCK_N
    bhk = tl.program_id(0).to(tl.int64)  # offsets in int64: B*H*N*d may pass 2**31
    scale, log2e, cap, keep_scale = _scales(Scales)
    heads_kv = heads_q // groups
    b = bhk // heads_kv
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    k = _tile_or_none(K, bhk, n0, offs_n, nk, offs_d, d, CHUNK >= BLOCK_D)
    v = _tile_or_none(V, bhk, n0, offs_n, nk, offs_dv, dv, CHUNK >= BLOCK_DV)
    if HAS_DROPOUT:
        col_words = tl.load(ColWords + offs_n, mask=offs_n < nk, other=0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], ACC)
    dv_acc = tl.zeros([BLOCK_N, BLOCK_DV], ACC)
    first, stop = _spans(First, Stop, offs_n, nk, nq, HAS_BAND)
    for g in range(groups):
        h = (bhk % heads_kv) * groups + g
        bh = b * heads_q + h
        for m0 in range(tl.min(first), tl.max(stop), BLOCK_M):
            offs_m = m0 + tl.arange(0, BLOCK_M)
            q = _load_tile(Q, bh, m0, offs_m, nq, offs_d, d)
            do = _load_tile(DO, bh, m0, offs_m, nq, offs_dv, dv)
            m, neg_log2_l, delta = _row_stats(Stats, Delta, bh, offs_m, nq, log2e)
            lo, hi = _spans(Lo, Hi, offs_m, nq, nk, HAS_BAND)
            s_t = _dot_rows(K, bhk, n0, offs_n, nk, k, Q, bh, m0, offs_m, nq, q, d,
                            BLOCK_N, BLOCK_M, BLOCK_D, CHUNK, ACC, UPCAST, PRECISION, REPEATABLE)  # fmt: skip
            s_t, slope_t = _capped(s_t * scale, cap, HAS_SOFTCAP)  # [BLOCK_N, BLOCK_M]
            s_t = _mask_scores(s_t, offs_m[None, :], offs_n[:, None], m0, n0,
                               lo[None, :], hi[None, :], b, h, Bias, Keep,
                               sbb, sbh, sbm, sbn, seb, seh, sem, sen,
                               HAS_BIAS, HAS_KEEP, WIDE_TILES)  # fmt: skip
            p_t = tl.exp2((s_t - m[None, :]) * log2e + neg_log2_l[None, :])
            dp_t = _dot_rows(V, bhk, n0, offs_n, nk, v, DO, bh, m0, offs_m, nq, do, dv,
                             BLOCK_N, BLOCK_M, BLOCK_DV, CHUNK, ACC, UPCAST, PRECISION, REPEATABLE)  # fmt: skip
            if HAS_DROPOUT:
                row_words = tl.load(RowWords + bh * nq + offs_m, mask=offs_m < nq, other=0)
                kept = _kept(row_words[None, :], col_words[:, None], threshold)
                pv_t = tl.where(kept, p_t * keep_scale, 0.0)
                dp_t = tl.where(kept, dp_t * keep_scale, 0.0)
            else:
                pv_t = p_t
            dv_acc += _dot(_narrow(pv_t, do.dtype, UPCAST), do, ACC, UPCAST, PRECISION)
            ds_t = p_t * (dp_t - delta[None, :])
            if HAS_SOFTCAP:
                ds_t = ds_t * slope_t
            dk += _dot(_narrow(ds_t, q.dtype, UPCAST), q, ACC, UPCAST, PRECISION)
    _store_tile(DK, bhk, n0, offs_n, nk, 0, offs_d, d, dk * scale, False, UPCAST)
    _store_tile(DV, bhk, n0, offs_n, nk, 0, offs_dv, dv, dv_acc, False, UPCAST)


@triton.jit
def attention_dq(
    Q, K, V, DO, Stats, Delta, DQ, DS, Bias, Keep, Lo, Hi, RowWords, ColWords,
    sbb, sbh, sbm, sbn, seb, seh, sem, sen,
    Scales,
    heads_q, groups, nq, nk, d, dv, threshold,
    HAS_BIAS: tl.constexpr, HAS_KEEP: tl.constexpr, HAS_BAND: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_DROPOUT: tl.constexpr, WIDE_TILES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    ACC: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, CHUNK: tl.constexpr,
    REPEATABLE: tl.constexpr, STORE_DS: tl.constexpr,
):  # fmt: skip
    """dQ = scale * dS_raw k for one query block; with STORE_DS also dS (the gradient
    of the capped, biased score, the bias's) into DS [B*Hq, Nq, Nk]."""
    m0 = tl.program_id(1) * BLOCK_M
    bh = tl.program_id(0).to(tl.int64)  # offsets in int64: B*H*N*d may pass 2**31
    scale, log2e, cap, keep_scale = _scales(Scales)
    b, h, bhk = _heads(bh, heads_q, groups)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = _tile_or_none(Q, bh, m0, offs_m, nq, offs_d, d, CHUNK >= BLOCK_D)
    do = _tile_or_none(DO, bh, m0, offs_m, nq, offs_dv, dv, CHUNK >= BLOCK_DV)
    m, neg_log2_l, delta = _row_stats(Stats, Delta, bh, offs_m, nq, log2e)
    lo, hi = _spans(Lo, Hi, offs_m, nq, nk, HAS_BAND)
    if HAS_DROPOUT:
        row_words = tl.load(RowWords + bh * nq + offs_m, mask=offs_m < nq, other=0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], ACC)
    for n0 in range(tl.min(lo), tl.max(hi), BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        k = _load_tile(K, bhk, n0, offs_n, nk, offs_d, d)
        v = _tile_or_none(V, bhk, n0, offs_n, nk, offs_dv, dv, CHUNK >= BLOCK_DV)
        s = _dot_rows(Q, bh, m0, offs_m, nq, q, K, bhk, n0, offs_n, nk, k, d,
                      BLOCK_M, BLOCK_N, BLOCK_D, CHUNK, ACC, UPCAST, PRECISION, REPEATABLE)  # fmt: skip
        s, slope = _capped(s * scale, cap, HAS_SOFTCAP)
        s = _mask_scores(s, offs_m[:, None], offs_n[None, :], m0, n0, lo[:, None], hi[:, None],
                         b, h, Bias, Keep, sbb, sbh, sbm, sbn, seb, seh, sem, sen,
                         HAS_BIAS, HAS_KEEP, WIDE_TILES)  # fmt: skip
        p = tl.exp2((s - m[:, None]) * log2e + neg_log2_l[:, None])
        dp = _dot_rows(DO, bh, m0, offs_m, nq, do, V, bhk, n0, offs_n, nk, v, dv,
                       BLOCK_M, BLOCK_N, BLOCK_DV, CHUNK, ACC, UPCAST, PRECISION, REPEATABLE)  # fmt: skip
        if HAS_DROPOUT:
            col_words = tl.load(ColWords + offs_n, mask=offs_n < nk, other=0)
            kept = _kept(row_words[:, None], col_words[None, :], threshold)
            dp = tl.where(kept, dp * keep_scale, 0.0)
        ds = p * (dp - delta[:, None])
        if STORE_DS:
            _store_tile(DS, bh, m0, offs_m, nq, n0, offs_n, nk, ds, WIDE_TILES, UPCAST)
        if HAS_SOFTCAP:
            ds = ds * slope
        dq += _dot(_narrow(ds, k.dtype, UPCAST), k, ACC, UPCAST, PRECISION)
    _store_tile(DQ, bh, m0, offs_m, nq, 0, offs_d, d, dq * scale, False, UPCAST)


INTERPRETED: bool = type(attention_forward).__name__ == "InterpretedFunction"
if INTERPRETED:  # without two costs of the interpreter that change nothing it computes
    interpreter.install()
