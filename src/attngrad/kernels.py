"""Triton kernels of strategy "triton": the flash algorithm, fused.

Four kernels over contiguous q: [B, Hq, Nq, d], k: [B, Hkv, Nk, d],
v: [B, Hkv, Nk, dv] (GQA: query head h reads key/value head h // G):

* `attention_forward`   one program per (query block, batch*query head): online
  softmax over the key tiles the band allows; writes O and the row statistics
  Stats = (m, log l) (see `attngrad.ops`).
* `attention_delta`     Delta = rowsum(O * dO), one program per query block.
* `attention_dkdv`      one program per (key block, batch*kv head): walks the G
  query heads of its group and the query tiles the band allows; dK and dV
  are summed in registers and written once (deterministic, no atomics).
* `attention_dq`        one program per (query block, batch*query head): dQ, and
  dS itself where the caller needs a bias gradient.

Scores stay in natural units (q k^T * scale + bias) until the row max m is
subtracted; the softmax is exp2((s - m) * log2 e), never exp2 of a score
itself, so no finite score overflows (finfo.min * log2 e would).  The scale
and log2 e come in a small tensor of the accumulation dtype (Scales =
[scale, log2 e]): a Python float argument would reach a compiled kernel as
float32 and cost float64 its precision.  The grid is
(batch * heads, blocks): the first grid axis has no 65535 limit.  Head dims are padded to a power of two >= 16 inside the kernels
(masked loads), never in memory.  Every score outside Nq x Nk, the band or the
keep mask is -inf; a row that attends nothing has l = 0: O = 0, Stats =
(0, +inf), and backward rebuilds its P as exp2(-inf) = 0.

Import this module only after deciding on TRITON_INTERPRET: Triton reads it
when the kernels are decorated.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = [
    "INTERPRETED",
    "attention_delta",
    "attention_dkdv",
    "attention_dq",
    "attention_forward",
]


@triton.jit
def _dot(a, b, ACC: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """a @ b accumulated in ACC.  UPCAST: widen bfloat16 operands first (the
    interpreter's bfloat16 dot is wrong; products of bfloat16 are exact in
    float32, so the result is the same as the GPU's)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=PRECISION, out_dtype=ACC)


@triton.jit
def _load_tile(Ptr, head, offs_r, n, offs_c, width):
    """Rows offs_r of head ``head`` of a contiguous [heads, n, width] tensor; zero past n, width."""
    at = (head * n + offs_r[:, None]) * width + offs_c[None, :]
    return tl.load(Ptr + at, mask=(offs_r[:, None] < n) & (offs_c[None, :] < width), other=0.0)


@triton.jit
def _store_tile(Ptr, head, offs_r, n, offs_c, width, value):
    """Store ``value`` into rows offs_r of head ``head`` (the layout of `_load_tile`)."""
    at = (head * n + offs_r[:, None]) * width + offs_c[None, :]
    tl.store(Ptr + at, value.to(Ptr.dtype.element_ty),
             mask=(offs_r[:, None] < n) & (offs_c[None, :] < width))  # fmt: skip


@triton.jit
def _mask_scores(
    s,
    qi,
    kj,
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
    nq,
    nk,
    left,
    right,
    HAS_BIAS: tl.constexpr,
    HAS_KEEP: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
):
    """Scores s with the bias added and -inf wherever query qi may not
    see key kj (bounds, band, keep mask).  qi, kj broadcast against s; mask
    offsets in int64 (a mask may hold 2**31 elements)."""
    qi = qi.to(tl.int64)
    kj = kj.to(tl.int64)
    valid = (qi < nq) & (kj < nk)
    if HAS_LEFT:
        valid = valid & (kj >= qi - left)
    if HAS_RIGHT:
        valid = valid & (kj <= qi + right)
    if HAS_KEEP:
        keep = tl.load(Keep + b * seb + h * seh + qi * sem + kj * sen, mask=valid, other=0)
        valid = valid & (keep != 0)
    if HAS_BIAS:
        bias = tl.load(Bias + b * sbb + h * sbh + qi * sbm + kj * sbn, mask=valid, other=0.0)
        s = s + bias.to(s.dtype)
    return tl.where(valid, s, float("-inf"))


@triton.jit
def _heads(bh, heads_q, groups):
    """(batch, query head, batch * Hkv + kv head) of the program of bh = batch * Hq + head."""
    b = bh // heads_q
    h = bh % heads_q
    return b, h, b * (heads_q // groups) + h // groups


@triton.jit
def _scales(Scales):
    """(scale, log2 e) from the Scales tensor, in its dtype."""
    return tl.load(Scales), tl.load(Scales + 1)


@triton.jit
def _key_range(
    m0, nk, left, right, BLOCK_M: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr
):
    """[lo, hi): the keys query rows [m0, m0 + BLOCK_M) can reach under the band."""
    lo = 0
    hi = nk
    if HAS_LEFT:
        lo = tl.maximum(m0 - left, 0)
    if HAS_RIGHT:
        hi = tl.minimum(m0 + BLOCK_M + right, nk)
    return lo, hi


@triton.jit
def attention_forward(
    Q, K, V, Out, Stats, Bias, Keep,
    sbb, sbh, sbm, sbn, seb, seh, sem, sen,
    Scales,
    heads_q, groups, nq, nk, d, dv, left, right,
    HAS_BIAS: tl.constexpr, HAS_KEEP: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    ACC: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    m0 = tl.program_id(1) * BLOCK_M
    bh = tl.program_id(0).to(tl.int64)  # offsets in int64: B*H*N*d may pass 2**31
    scale, log2e = _scales(Scales)
    b, h, bhk = _heads(bh, heads_q, groups)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = _load_tile(Q, bh, offs_m, nq, offs_d, d)
    m_i = tl.full([BLOCK_M], float("-inf"), ACC)
    l_i = tl.zeros([BLOCK_M], ACC)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], ACC)
    lo, hi = _key_range(m0, nk, left, right, BLOCK_M, HAS_LEFT, HAS_RIGHT)
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        k = _load_tile(K, bhk, offs_n, nk, offs_d, d)
        v = _load_tile(V, bhk, offs_n, nk, offs_dv, dv)
        s = _dot(q, tl.trans(k), ACC, UPCAST, PRECISION) * scale
        s = _mask_scores(s, offs_m[:, None], offs_n[None, :], b, h, Bias, Keep,
                         sbb, sbh, sbm, sbn, seb, seh, sem, sen, nq, nk, left, right,
                         HAS_BIAS, HAS_KEEP, HAS_LEFT, HAS_RIGHT)  # fmt: skip
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # a row with no key yet keeps m = -inf: shift it by 0 so exp2(-inf) = 0, not NaN
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2((s - shift[:, None]) * log2e)
        alpha = tl.exp2((m_i - shift) * log2e)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, ACC, UPCAST, PRECISION)
        m_i = m_new
    dead = l_i == 0.0
    o = acc / tl.where(dead, 1.0, l_i)[:, None]
    shift = tl.where(m_i == float("-inf"), 0.0, m_i)
    log_l = tl.where(dead, float("inf"), tl.log(tl.where(dead, 1.0, l_i)))
    _store_tile(Out, bh, offs_m, nq, offs_dv, dv, o)
    tl.store(Stats + (bh * nq + offs_m) * 2, shift, mask=offs_m < nq)
    tl.store(Stats + (bh * nq + offs_m) * 2 + 1, log_l, mask=offs_m < nq)


@triton.jit
def attention_delta(
    Out, DO, Delta, nq, dv,
    BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    """Delta = rowsum(O * dO): [B*Hq, Nq] in ACC."""
    bh = tl.program_id(0).to(tl.int64)  # offsets in int64: B*H*N*d may pass 2**31
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    o = _load_tile(Out, bh, offs_m, nq, offs_dv, dv).to(ACC)
    do = _load_tile(DO, bh, offs_m, nq, offs_dv, dv).to(ACC)
    tl.store(Delta + bh * nq + offs_m, tl.sum(o * do, 1), mask=offs_m < nq)


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
    Q, K, V, DO, Stats, Delta, DK, DV, Bias, Keep,
    sbb, sbh, sbm, sbn, seb, seh, sem, sen,
    Scales,
    heads_q, groups, nq, nk, d, dv, left, right,
    HAS_BIAS: tl.constexpr, HAS_KEEP: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    ACC: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """dK = scale * sum_g dS_g^T q_g and dV = sum_g P_g^T dO_g for one key block,
    working in the transposed orientation (keys along rows)."""
    n0 = tl.program_id(1) * BLOCK_N
    bhk = tl.program_id(0).to(tl.int64)  # offsets in int64: B*H*N*d may pass 2**31
    scale, log2e = _scales(Scales)
    heads_kv = heads_q // groups
    b = bhk // heads_kv
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    k = _load_tile(K, bhk, offs_n, nk, offs_d, d)
    v = _load_tile(V, bhk, offs_n, nk, offs_dv, dv)
    dk = tl.zeros([BLOCK_N, BLOCK_D], ACC)
    dv_acc = tl.zeros([BLOCK_N, BLOCK_DV], ACC)
    # query rows i with kj - right <= i <= kj + left for some key kj of the block
    lo = 0
    hi = nq
    if HAS_RIGHT:
        lo = tl.maximum(n0 - right, 0)
    if HAS_LEFT:
        hi = tl.minimum(n0 + BLOCK_N + left, nq)
    for g in range(groups):
        h = (bhk % heads_kv) * groups + g
        bh = b * heads_q + h
        for m0 in range(lo, hi, BLOCK_M):
            offs_m = m0 + tl.arange(0, BLOCK_M)
            q = _load_tile(Q, bh, offs_m, nq, offs_d, d)
            do = _load_tile(DO, bh, offs_m, nq, offs_dv, dv)
            m, neg_log2_l, delta = _row_stats(Stats, Delta, bh, offs_m, nq, log2e)
            s_t = _dot(k, tl.trans(q), ACC, UPCAST, PRECISION) * scale  # [BLOCK_N, BLOCK_M]
            s_t = _mask_scores(s_t, offs_m[None, :], offs_n[:, None], b, h, Bias, Keep,
                               sbb, sbh, sbm, sbn, seb, seh, sem, sen, nq, nk, left, right,
                               HAS_BIAS, HAS_KEEP, HAS_LEFT, HAS_RIGHT)  # fmt: skip
            p_t = tl.exp2((s_t - m[None, :]) * log2e + neg_log2_l[None, :])
            dv_acc += _dot(p_t.to(do.dtype), do, ACC, UPCAST, PRECISION)
            dp_t = _dot(v, tl.trans(do), ACC, UPCAST, PRECISION)
            ds_t = p_t * (dp_t - delta[None, :])
            dk += _dot(ds_t.to(q.dtype), q, ACC, UPCAST, PRECISION)
    _store_tile(DK, bhk, offs_n, nk, offs_d, d, dk * scale)
    _store_tile(DV, bhk, offs_n, nk, offs_dv, dv, dv_acc)


@triton.jit
def attention_dq(
    Q, K, V, DO, Stats, Delta, DQ, DS, Bias, Keep,
    sbb, sbh, sbm, sbn, seb, seh, sem, sen,
    Scales,
    heads_q, groups, nq, nk, d, dv, left, right,
    HAS_BIAS: tl.constexpr, HAS_KEEP: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    ACC: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    STORE_DS: tl.constexpr,
):  # fmt: skip
    """dQ = scale * dS k for one query block; with STORE_DS also dS into DS [B*Hq, Nq, Nk]."""
    m0 = tl.program_id(1) * BLOCK_M
    bh = tl.program_id(0).to(tl.int64)  # offsets in int64: B*H*N*d may pass 2**31
    scale, log2e = _scales(Scales)
    b, h, bhk = _heads(bh, heads_q, groups)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = _load_tile(Q, bh, offs_m, nq, offs_d, d)
    do = _load_tile(DO, bh, offs_m, nq, offs_dv, dv)
    m, neg_log2_l, delta = _row_stats(Stats, Delta, bh, offs_m, nq, log2e)
    dq = tl.zeros([BLOCK_M, BLOCK_D], ACC)
    lo, hi = _key_range(m0, nk, left, right, BLOCK_M, HAS_LEFT, HAS_RIGHT)
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        k = _load_tile(K, bhk, offs_n, nk, offs_d, d)
        v = _load_tile(V, bhk, offs_n, nk, offs_dv, dv)
        s = _dot(q, tl.trans(k), ACC, UPCAST, PRECISION) * scale
        s = _mask_scores(s, offs_m[:, None], offs_n[None, :], b, h, Bias, Keep,
                         sbb, sbh, sbm, sbn, seb, seh, sem, sen, nq, nk, left, right,
                         HAS_BIAS, HAS_KEEP, HAS_LEFT, HAS_RIGHT)  # fmt: skip
        p = tl.exp2((s - m[:, None]) * log2e + neg_log2_l[:, None])
        dp = _dot(do, tl.trans(v), ACC, UPCAST, PRECISION)
        ds = p * (dp - delta[:, None])
        if STORE_DS:
            _store_tile(DS, bh, offs_m, nq, offs_n, nk, ds)
        dq += _dot(ds.to(k.dtype), k, ACC, UPCAST, PRECISION)
    _store_tile(DQ, bh, offs_m, nq, offs_d, d, dq * scale)


INTERPRETED: bool = type(attention_forward).__name__ == "InterpretedFunction"
