// Forward mode in the fused kernels: the tangents of O and lse along (q', k', v', bias', D').
// Two passes: `tangent_pass` after autograd's forward (below), and `forward_tangent_pass`,
// O and O' in one online-softmax walk where the tangents are known before the call (at the
// end); both run each tile's tangent step through `tangent_tile`.
//
// Autograd runs the primal forward first, so the row statistics (m, log l) are final when
// this pass runs and each tile's P is rebuilt from them exactly as backward rebuilds it
// (`tile.h`, `probabilities`).  Per query row, with S' the scores' tangent pushed through
// the score modifications (`attngrad.autograd.tangent`):
//
//   S'  = slope * s (q' k^T + q k'^T) + D' + bias'
//         (slope: 1 - tanh^2 with a softcap, times f'(x) with a score program f, its
//         backward program run with GRAD = 1 (`mask_with_slope`), else 1; D': a relative
//         score_mod's term's tangent along its captured tensors' tangents, by diagonal,
//         `Problem::diagonal`)
//   mu  = rowsum(P * S') = lse'
//   O'  = (P * S') v + P v' - mu O                 (dropout: both products take M = Z / (1 - p))
//
// One walk over each block of query rows' key tiles, the forward's own
// (`Problem::for_each_key_tile`: band, BlockMask and keep handled as forward handles them):
//
//   S   = (s q) k^T, masked, P = exp((S - m) - log l)
//   S'  = [s q' | s q] [k^T ; k'^T]   (one product of inner dim 2d; d where one tangent is
//         None, none where both are), times the slope, plus D' and bias'
//   mu += rowsum(P * S'),   acc += (P * S' Z) v + (P Z) v'
//
// then O' = acc / (1 - p) - mu O and lse' = mu.  A unit (b, kv head, block of query rows)
// owns its rows of O' and lse' for every query head of the group: the results are bitwise
// the same for any thread count.  Extra memory: the panels of [k, k'] and O(block) scratch
// per thread.  A score program's captured tensors have no tangent here: the Python side runs
// a call whose captured tensors move through the shared tiled pass instead.
#pragma once

#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstdint>
#include <memory>

#include "products.h"
#include "tile.h"

namespace attngrad_fused {

// The tangents as the pass reads them (nullptr / false: zero).
template <typename T>
struct Direction {
  const T* q = nullptr;     // q' [B, Hq, Nq, d] contiguous
  bool k = false;           // k' given: each key panel holds k'^T below k^T (`TangentOperands`)
  const T* v = nullptr;     // v' [B, Hkv, Nk, dv] contiguous
  const T* bias = nullptr;  // bias' at the scores' [B, Hq, Nq, Nk] through strides sb
  int64_t sb[4] = {0, 0, 0, 0};
  const T* diagonal = nullptr;  // D' like `Problem::diagonal`: a relative score_mod's term

  bool moves_scores() const { return q != nullptr || k || bias != nullptr || diagonal != nullptr; }
};

// What the tangent pass reads of the primal call: q [B, Hq, Nq, d], v [B, Hkv, Nk, dv],
// O [B, Hq, Nq, dv], the statistics [B, Hq, Nq, 2] (m, log l) and the key panels kt
// [B, Hkv, KB, rows, block_k]: k^T (rows = d), or k^T above k'^T (rows = 2d).
template <typename T>
struct TangentOperands {
  const T *q, *kt, *v, *o, *stats;
  int64_t rows;
};

template <typename T>
struct TangentScratch {  // one block of query rows
  Buffer<T> q, a, s, t, slope, acc, mu;
  Buffer<T> dacc, m, l, shift;  // the one pass's (`forward_tangent_pass`)
  std::unique_ptr<Runner<T>> mask;  // the BlockMask's mask program, when there is one
  // a score program's: its forward and backward runners, the capped scores (its SCORE),
  // its slope f'(x) and the tile's BlockMask verdicts (its bounds checks)
  std::unique_ptr<Runner<T>> run, grad;
  Buffer<T> raw, fprime;
  Buffer<uint8_t> blocks;
};

// S' of one tile row from the raw product (in t, or none: `raw` false) and P: t = P * S'
// with S' = slope * t + D' + bias' (slope, D', bias: nullptr for none, the modifications'
// pushes in the chain's order; bias read every `step` elements); returns rowsum(P * S').
// One pass over the row where the bias is read densely (a strided bias is added first).
template <typename T>
T tangent_row(const T* p, T* t, const T* slope, const T* diagonal, const T* bias, int64_t step,
              bool raw, int64_t c) {
  using Vec = at::vec::Vectorized<T>;
  constexpr int64_t W = Vec::size();
  if (!raw) std::fill(t, t + c, T(0));
  if (bias != nullptr && step != 1) {  // strided: added before the pass, after the slope
    if (slope != nullptr && raw)
      at::vec::map2([](Vec x, Vec s) { return x * s; }, t, t, slope, c);
    slope = nullptr;
    for (int64_t j = 0; j < c; ++j) t[j] += bias[j * step];
    bias = nullptr;
  }
  if (!raw) slope = nullptr;
  auto step_at = [&](int64_t j, int64_t n) {  // P * S' at t[j .. j + n)
    Vec x = Vec::loadu(t + j, n);
    if (slope != nullptr) x = x * Vec::loadu(slope + j, n);
    if (diagonal != nullptr) x = x + Vec::loadu(diagonal + j, n);
    if (bias != nullptr) x = x + Vec::loadu(bias + j, n);
    return Vec::loadu(p + j, n) * x;
  };
  Vec s0(T(0)), s1(T(0));  // two chains, as `exp_row_`
  int64_t j = 0;
  for (; j + 2 * W <= c; j += 2 * W) {
    const Vec x0 = step_at(j, W), x1 = step_at(j + W, W);
    x0.store(t + j);
    x1.store(t + j + W);
    s0 = s0 + x0;
    s1 = s1 + x1;
  }
  for (; j < c; j += W) {
    const int64_t n = std::min(W, c - j);
    const Vec x = step_at(j, n);
    x.store(t + j, n);
    s0 = s0 + Vec::set(Vec(T(0)), x, n);
  }
  return at::vec::vec_reduce_all<T>([](Vec& a, Vec& b) { return a + b; }, s0 + s1);
}

template <typename T>
TangentScratch<T> tangent_scratch(const Problem<T>& pb) {
  const int64_t bq = pb.block_q, bk = pb.block_k;
  TangentScratch<T> s;
  s.q.resize(bq * pb.d);
  s.a.resize(bq * 2 * pb.d);
  s.s.resize(bq * bk);
  s.t.resize(bq * bk);
  if (pb.cap != T(0) || pb.program != nullptr) s.slope.resize(bq * bk);
  s.acc.resize(bq * pb.dv);
  s.mu.resize(bq);
  if (pb.mask_program != nullptr) s.mask = std::make_unique<Runner<T>>(*pb.mask_program, bk);
  if (pb.program != nullptr) {
    s.run = std::make_unique<Runner<T>>(*pb.program, bk);
    s.grad = std::make_unique<Runner<T>>(*pb.grad_program, bk);
    s.raw.resize(bq * bk);
    s.fprime.resize(bq * bk);
    if (pb.status != nullptr) s.blocks.resize(bq * bk);
  }
  return s;
}

// The tile S (rows i0 .. i0 + r of head (b, h), keys j0 .. j0 + c) capped, run through the
// score program, biased and masked (`mask_tile`), and the slope of the score modifications
// into `slope` (nullptr without a softcap or program): the softcap's 1 - t^2 times the
// program's f'(x), its backward program run with GRAD = 1 on the capped scores (zero where
// the mask drops a key; no SCATTER: no captured tensor's tangent reaches this pass).
template <typename T>
void mask_with_slope(const Problem<T>& pb, int64_t b, int64_t h, int64_t i0, int64_t r,
                     int64_t j0, int64_t c, T* S, T* slope, TangentScratch<T>& w) {
  const int64_t bk = pb.block_k;
  uint8_t* blocks = w.blocks.empty() ? nullptr : w.blocks.data();
  T* raw = w.raw.empty() ? nullptr : w.raw.data();
  mask_tile(pb, b, h, i0, r, j0, c, S, bk, slope, w.run.get(), raw, w.mask.get(), blocks);
  if (w.grad == nullptr) return;
  T* fprime = w.fprime.data();
  for (int64_t ii = 0; ii < r; ++ii) std::fill(fprime + ii * bk, fprime + ii * bk + c, T(1));
  program_gradient(pb, *w.grad, b, h, i0, r, j0, c, raw, blocks, fprime);
  for (int64_t ii = 0; ii < r; ++ii) {
    T* sl = slope + ii * bk;
    const T* fp = fprime + ii * bk;
    if (pb.cap != T(0))
      for (int64_t j = 0; j < c; ++j) sl[j] *= fp[j];
    else
      std::copy(fp, fp + c, sl);
  }
}

// One tile's forward-mode step, shared by both passes: P (the tangent pass's probabilities,
// or the one-pass's E = exp(S - m)) in P, the tile's slope (or nullptr); S' formed in t from
// A = a [r, inner] against the panel's rows from `panel` (A's half of [k^T ; k'^T]), then
// mu += rowsum(P * S') and acc += (P * S' Z) v + (P Z) v'; P is left as P Z (dropout).
template <typename T>
void tangent_tile(const Problem<T>& pb, Engine engine, const Direction<T>& dir, int64_t b,
                  int64_t h, int64_t i0, int64_t r, int64_t j0, int64_t c, const T* a,
                  int64_t inner, const T* panel, const T* v_h, const T* tv_h, T* P, T* t,
                  const T* slope, T* mu, T* acc) {
  const int64_t bk = pb.block_k, dv = pb.dv, bh = b * pb.Hq + h;
  if (dir.moves_scores()) {
    if (inner > 0) product(engine, r, c, inner, a, inner, panel, bk, t, bk, false);
    for (int64_t ii = 0; ii < r; ++ii) {
      const int64_t i = i0 + ii;
      const T* bias = dir.bias == nullptr ? nullptr
          : dir.bias + b * dir.sb[0] + h * dir.sb[1] + i * dir.sb[2] + j0 * dir.sb[3];
      const T* diagonal = dir.diagonal == nullptr ? nullptr
          : dir.diagonal + (bh * pb.diagonals() + j0 - i + pb.Nq - 1);
      mu[ii] += tangent_row(P + ii * bk, t + ii * bk, slope == nullptr ? nullptr : slope + ii * bk,
                            diagonal, bias, dir.sb[3], inner > 0, c);
    }
    if (pb.row_words != nullptr) drop(pb, bh, i0, r, j0, c, t, bk);
    product(engine, r, dv, c, t, bk, v_h + j0 * dv, dv, acc, dv, true);
  }
  if (pb.row_words != nullptr) drop(pb, bh, i0, r, j0, c, P, bk);
  if (tv_h != nullptr) product(engine, r, dv, c, P, bk, tv_h + j0 * dv, dv, acc, dv, true);
}

// A's rows for S' (the forward-mode passes, the second-order pass): s q of rows row0 .. into
// qs ([r, d]), and [s q' | s q] (or the half whose tangent is given) into a ([r, inner]);
// returns A.
template <typename T>
const T* tangent_rows(const Problem<T>& pb, const T* q, const Direction<T>& dir, int64_t row0,
                      int64_t r, int64_t inner, T* qs, T* a) {
  const int64_t d = pb.d;
  scaled_rows(q + row0 * d, r, d, pb.scale, qs, d);
  if (dir.q == nullptr) return qs;
  scaled_rows(dir.q + row0 * d, r, d, pb.scale, a, inner);
  if (dir.k) scaled_rows(q + row0 * d, r, d, pb.scale, a + d, inner);
  return a;
}

// The pass (file comment): O' into dout [B, Hq, Nq, dv] and lse' into dlse [B, Hq, Nq].
template <typename T>
void tangent_pass(const Problem<T>& pb, Engine engine, const TangentOperands<T>& x,
                  const Direction<T>& dir, T* dout, T* dlse) {
  const int64_t bq = pb.block_q, bk = pb.block_k, d = pb.d, dv = pb.dv, nk = pb.Nk;
  // S' = A B: A = [s q' | s q] against [k^T ; k'^T], or the half whose tangent is given
  const int64_t inner = ((dir.q != nullptr) + dir.k) * d;
  const int64_t from = dir.q != nullptr ? 0 : d;  // B's first row in the panel
  for_each_unit<TangentScratch<T>>(
      pb.B * pb.Hkv * pb.row_blocks(), engine, [&] { return tangent_scratch(pb); },
      [&](int64_t u, TangentScratch<T>& w) {
        int64_t b, hk, blk;
        pb.row_unit(u, b, hk, blk);
        const int64_t i0 = blk * bq, r = std::min(bq, pb.Nq - i0), bhk = b * pb.Hkv + hk;
        const T* kt_h = x.kt + bhk * pb.key_blocks() * x.rows * bk;
        const T* v_h = x.v + bhk * nk * dv;
        const T* tv_h = dir.v == nullptr ? nullptr : dir.v + bhk * nk * dv;
        T* slope = w.slope.empty() ? nullptr : w.slope.data();
        T *acc = w.acc.data(), *mu = w.mu.data();
        for (int64_t g = 0; g < pb.G; ++g) {
          const int64_t h = hk * pb.G + g, bh = b * pb.Hq + h, row0 = bh * pb.Nq + i0;
          const T* a = tangent_rows(pb, x.q, dir, row0, r, inner, w.q.data(), w.a.data());
          std::fill(acc, acc + r * dv, T(0));
          std::fill(mu, mu + r, T(0));
          pb.for_each_key_tile(b, h, i0, r, [&](int64_t kb, int64_t ka, int64_t c) {
            const int64_t j0 = kb * bk + ka;
            const T* panel = kt_h + kb * x.rows * bk + ka;
            T* P = w.s.data();
            score_product(engine, r, c, d, w.q.data(), d, panel, bk, P, bk);  // forward's S
            mask_with_slope(pb, b, h, i0, r, j0, c, P, slope, w);
            probabilities(r, c, P, bk, x.stats + row0 * 2);
            tangent_tile(pb, engine, dir, b, h, i0, r, j0, c, a, inner, panel + from * bk, v_h,
                         tv_h, P, w.t.data(), slope, mu, acc);
          });
          const T* o_h = x.o + row0 * dv;
          T* do_h = dout + row0 * dv;
          for (int64_t ii = 0; ii < r; ++ii) {
            for (int64_t e = 0; e < dv; ++e)
              do_h[ii * dv + e] = acc[ii * dv + e] * pb.keep_scale - mu[ii] * o_h[ii * dv + e];
            dlse[row0 + ii] = mu[ii];
          }
        }
      });
}

// Forward mode in one pass (`forward_tangent`): O and the statistics (m, log l) as
// `forward_impl` writes them -- the same products, `online_row` and `finish_row`, so the
// same bits -- and with them O' and lse' (x.o and x.stats unused; o, stats, dout, dlse
// written).  Per row, beside forward's running m, l and acc = sum E v (E = exp(S - m),
// everything summed so far rescaled by alpha when m moves):
//
//   t    = sum rowsum(E * S')          -> mu l
//   acc' = sum (E * S' Z) v + (E Z) v' -> (O' + mu O) l (1 - p)
//
// then mu = t / l = lse' and O' = acc' / (1 - p) / l - mu O: six products a tile (S, S', E v
// and the three of `tangent_tile`, as the two passes' seven less forward's repeated S), one
// exp a score.
template <typename T>
void forward_tangent_pass(const Problem<T>& pb, Engine engine, const TangentOperands<T>& x,
                          const Direction<T>& dir, T* o, T* stats, T* dout, T* dlse) {
  const int64_t bq = pb.block_q, bk = pb.block_k, d = pb.d, dv = pb.dv, nk = pb.Nk;
  const int64_t inner = ((dir.q != nullptr) + dir.k) * d;
  const int64_t from = dir.q != nullptr ? 0 : d;
  const T neg_inf = -std::numeric_limits<T>::infinity();
  for_each_unit<TangentScratch<T>>(
      pb.B * pb.Hkv * pb.row_blocks(), engine,
      [&] {
        TangentScratch<T> s = tangent_scratch(pb);
        s.dacc.resize(bq * dv);
        s.m.resize(bq);
        s.l.resize(bq);
        s.shift.resize(bq);
        return s;
      },
      [&](int64_t u, TangentScratch<T>& w) {
        int64_t b, hk, blk;
        pb.row_unit(u, b, hk, blk);
        const int64_t i0 = blk * bq, r = std::min(bq, pb.Nq - i0), bhk = b * pb.Hkv + hk;
        const T* kt_h = x.kt + bhk * pb.key_blocks() * x.rows * bk;
        const T* v_h = x.v + bhk * nk * dv;
        const T* tv_h = dir.v == nullptr ? nullptr : dir.v + bhk * nk * dv;
        T* slope = w.slope.empty() ? nullptr : w.slope.data();
        T *acc = w.acc.data(), *dacc = w.dacc.data(), *mu = w.mu.data();
        T *m = w.m.data(), *l = w.l.data(), *shift = w.shift.data();
        for (int64_t g = 0; g < pb.G; ++g) {
          const int64_t h = hk * pb.G + g, bh = b * pb.Hq + h, row0 = bh * pb.Nq + i0;
          const T* a = tangent_rows(pb, x.q, dir, row0, r, inner, w.q.data(), w.a.data());
          std::fill(acc, acc + r * dv, T(0));
          std::fill(dacc, dacc + r * dv, T(0));
          std::fill(mu, mu + r, T(0));
          std::fill(m, m + r, neg_inf);
          std::fill(l, l + r, T(0));
          std::fill(shift, shift + r, T(0));
          pb.for_each_key_tile(b, h, i0, r, [&](int64_t kb, int64_t ka, int64_t c) {
            const int64_t j0 = kb * bk + ka;
            const T* panel = kt_h + kb * x.rows * bk + ka;
            T* E = w.s.data();
            score_product(engine, r, c, d, w.q.data(), d, panel, bk, E, bk);  // forward's S
            mask_with_slope(pb, b, h, i0, r, j0, c, E, slope, w);
            for (int64_t ii = 0; ii < r; ++ii) {
              const T alpha = online_row(E + ii * bk, c, m[ii], l[ii], shift[ii],
                                         pb.row_words != nullptr);
              rescale(acc + ii * dv, dv, alpha);
              rescale(dacc + ii * dv, dv, alpha);
              rescale(mu + ii, 1, alpha);
            }
            tangent_tile(pb, engine, dir, b, h, i0, r, j0, c, a, inner, panel + from * bk, v_h,
                         tv_h, E, w.t.data(), slope, mu, dacc);
            product(engine, r, dv, c, E, bk, v_h + j0 * dv, dv, acc, dv, true);  // E Z, as forward's
          });
          T* o_h = o + row0 * dv;
          T* do_h = dout + row0 * dv;
          for (int64_t ii = 0; ii < r; ++ii) {
            const T denom = finish_row(acc + ii * dv, dv, pb.keep_scale, l[ii], shift[ii],
                                       o_h + ii * dv, stats + (row0 + ii) * 2);
            const T lse_dot = mu[ii] / denom;
            for (int64_t e = 0; e < dv; ++e)
              do_h[ii * dv + e] =
                  dacc[ii * dv + e] * pb.keep_scale / denom - lse_dot * o_h[ii * dv + e];
            dlse[row0 + ii] = lse_dot;
          }
        }
      });
}

}  // namespace attngrad_fused
