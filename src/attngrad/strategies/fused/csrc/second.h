// The second-order pass in the fused kernels: what autograd calls when fused's gradients are
// differentiated again (`attngrad.autograd.second_order` has the derivation; its notation).
//
// For cotangents g = (g_q, g_k, g_v, g_bias, D') of the first-order gradients (D': the
// cotangents of a relative score_mod's captured tensors pushed onto its term, by diagonal),
// per query row, with P rebuilt from the statistics and M = Z / (1 - p) under dropout:
//
//   G     = slope * s (g_q k^T + q g_k^T) + D' + g_bias     (slope = 1 - t^2 with a softcap)
//   dP    = (dO v^T) M,   W = (dO g_v^T) M
//   Delta = rowsum(P dP),  r = rowsum(P G),  rho' = rowsum(P G dP) - r Delta + rowsum(P W)
//   c     = Delta - dlse,  Y = dP - c,  dS = P Y,  H = G - r
//   D-hat = P H,  S-hat = P (H Y + W - rho')
//
//   grad v  += (D-hat M)^T dO          grad dO = (D-hat M) v + (P M) g_v   grad dlse = r
//   grad q   = s (S-hat k + dS g_k)    grad k += s (S-hat^T q + dS^T g_q)   grad bias = S-hat
//
// with, under a softcap (t = tanh(x / cap) its record, x-dot = s (g_q k^T + q g_k^T)), S-hat
// and dS taken onto the raw scores first: S-hat <- slope S-hat - 2 t slope x-dot dS / cap,
// dS <- slope dS.  A relative score_mod's term gets dS and S-hat summed along the diagonals
// (dd, dd_hat), from which its captured tensors' second-order terms follow in tensor ops.
//
// r and rho' are row sums over every key before any tile's S-hat: so a unit (b, kv head,
// slab of query row blocks) walks each block of query rows' key tiles twice.  The first walk
// forms each tile's P, dP, G and W (five products: S, dP, W and G's of inner dim 2d) and
// keeps them, [block_q, block_k] per tile, for the second; the second forms dS, D-hat and
// S-hat from them in place and takes the five gradient products (grad q's two, grad k's two,
// grad v's; grad dO's two more where it is wanted).  Ten products a tile against the
// fifteen of a walk for the row sums and a walk for the gradients; the kept tiles cost
// 4 block_q Nk floats per thread (7 with a softcap: its slope, t and x-dot too; O(N)).  grad q and grad dO rows belong to their unit;
// grad k and grad v are summed per slab (slab 0 into the result, slab s > 0 into a
// partial), the partials joined in slab order afterwards, as dD's and dD-hat's sums are:
// the same bits for any thread count.
//
// Where the keys are a block of a longer sequence (ring attention's pairs), the row sums are
// over every key while a call sees some: a call that wants only the row sums
// (`SecondOutputs::sums`) stops after the first walk with its keys' share, and a call given
// the sums over every key (`SecondOperands::sums`) walks its tiles twice with those.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <memory>
#include <vector>

#include "products.h"
#include "tangent.h"
#include "tile.h"

namespace attngrad_fused {

// What the second-order pass reads: q, k [B, Hkv, Nk, d] and g_k (like k, or nullptr), v,
// g_v (like v, or nullptr) and dO; the statistics [B, Hq, Nq, 2] and dlse [B, Hq, Nq] (or
// nullptr); the key panels kt (`TangentOperands::kt`: k^T, with g_k^T below where g_k is
// given; `rows` each) and those of v^T and g_v^T ([B, Hkv, KB, dv, block_k]); and the row
// sums over every key (`ROW_SUMS` each row) when these keys are only some of them (nullptr:
// the first walk's own).
template <typename T>
struct SecondOperands {
  const T *q, *k, *gk, *v, *gv, *dout, *stats, *dlse;
  const T *kt, *vt, *gvt;
  int64_t rows;
  const T* sums = nullptr;
};

// The first walk's row sums, each additive over key tiles, in this order per row:
// rowsum(P dP) = Delta, rowsum(P G) = r, rowsum(P G dP) and rowsum(P W); rho' = the third
// - r Delta + the fourth.  A pass over some of the keys (a ring's pair) returns its share.
constexpr int64_t ROW_SUMS = 4;

// Where the pass writes (nullptr: not wanted): grad dO [B, Hq, Nq, dv], r [B, Hq, Nq],
// grad q, grad k, grad v (like q, k, v), S-hat at the scores' [B, Hq, Nq, Nk] (a bias's
// gradient), the diagonal sums of dS and S-hat like D (a relative score_mod's), and the
// first walk's row sums.
template <typename T>
struct SecondOutputs {
  T *dout = nullptr, *r = nullptr, *q = nullptr, *k = nullptr, *v = nullptr;
  T *s_hat = nullptr, *dd = nullptr, *dd_hat = nullptr;
  T* sums = nullptr;  // the first walk's row sums, [B, Hq, Nq, ROW_SUMS]

  // Whether anything beyond the row sums is wanted: else the second walk is skipped.
  bool gradients() const {
    return dout != nullptr || r != nullptr || q != nullptr || k != nullptr || v != nullptr ||
           s_hat != nullptr || dd != nullptr;
  }
};

template <typename T>
struct SecondScratch {  // one unit's: a block of query rows and its key tiles
  Buffer<T> qs, a, dos, dq, ddo, t;   // s q, [s g_q | s q], dO / (1 - p), sums, transposes
  // The kept tiles, [block_q, block_k] each per key tile: P, dP, G, W and a softcap's slope,
  // t and x-dot, in one tensor (from torch's allocator, so memory profiles count them).
  at::Tensor kept;
  T *p, *dp, *g, *w, *slope = nullptr, *tanh = nullptr, *raw = nullptr;
  Buffer<T> delta, rsum, rho, pgdp;   // per row
  std::vector<std::array<int64_t, 3>> tiles;  // the walk's (kb, first column, columns)
  std::unique_ptr<Runner<T>> mask;
  T *dd = nullptr, *dd_hat = nullptr;  // this unit's diagonal sums, [G, Nq + Nk - 1] each
};

template <typename T>
SecondScratch<T> second_scratch(const Problem<T>& pb, int64_t inner) {
  const int64_t bq = pb.block_q, bk = pb.block_k, kept = pb.key_blocks() * bq * bk;
  SecondScratch<T> s;
  s.qs.resize(bq * pb.d);
  s.a.resize(bq * std::max<int64_t>(inner, 1));
  s.dos.resize(bq * pb.dv);
  s.dq.resize(bq * pb.d);
  s.ddo.resize(bq * pb.dv);
  s.t.resize(bq * bk);
  const bool cap = pb.cap != T(0);
  s.kept = at::empty({(cap ? 7 : 4) * kept}, c10::CppTypeToScalarType<T>::value);
  T* next = s.kept.template data_ptr<T>();
  for (T** x : {&s.p, &s.dp, &s.g, &s.w}) *x = next, next += kept;
  if (cap)
    for (T** x : {&s.slope, &s.tanh, &s.raw}) *x = next, next += kept;
  for (Buffer<T>* x : {&s.delta, &s.rsum, &s.rho, &s.pgdp}) x->resize(bq);
  s.tiles.reserve(pb.key_blocks());
  if (pb.mask_program != nullptr) s.mask = std::make_unique<Runner<T>>(*pb.mask_program, bk);
  return s;
}

// The first walk's sums over one tile row: rowsum(P dP), rowsum(P G), rowsum(P G dP) and
// rowsum(P W) added into the four.
template <typename T>
inline void row_sums(const T* p, const T* dp, const T* g, const T* w, int64_t c, T& delta,
                     T& r, T& pgdp, T& pw) {
  using Vec = at::vec::Vectorized<T>;
  constexpr int64_t W = Vec::size();
  Vec sd(T(0)), sr(T(0)), sg(T(0)), sw(T(0));
  for (int64_t j = 0; j < c; j += W) {
    const int64_t n = std::min(W, c - j);
    const Vec pv = Vec::set(Vec(T(0)), Vec::loadu(p + j, n), n);  // zero past c
    const Vec dpv = Vec::loadu(dp + j, n), pg = pv * Vec::loadu(g + j, n);
    sd = at::vec::fmadd(pv, dpv, sd);
    sr = sr + pg;
    sg = at::vec::fmadd(pg, dpv, sg);
    sw = at::vec::fmadd(pv, Vec::loadu(w + j, n), sw);
  }
  auto sum = [](const Vec& x) {
    return at::vec::vec_reduce_all<T>([](Vec& a, Vec& b) { return a + b; }, x);
  };
  delta += sum(sd);
  r += sum(sr);
  pgdp += sum(sg);
  pw += sum(sw);
}

// The second walk's step on one tile row, in place: dS = P (dP - c) over dP, S-hat =
// P ((G - r) Y + W - rho) over G, D-hat = P (G - r) over W.
template <typename T>
inline void hat_row(const T* p, T* dp, T* g, T* w, int64_t c, T c_row, T r, T rho) {
  using Vec = at::vec::Vectorized<T>;
  constexpr int64_t W = Vec::size();
  const Vec cv(c_row), rv(r), rhov(rho);
  for (int64_t j = 0; j < c; j += W) {
    const int64_t n = std::min(W, c - j);
    const Vec pv = Vec::loadu(p + j, n), y = Vec::loadu(dp + j, n) - cv;
    const Vec h = Vec::loadu(g + j, n) - rv;
    const Vec t = at::vec::fmadd(h, y, Vec::loadu(w + j, n) - rhov);
    (pv * y).store(dp + j, n);
    (pv * t).store(g + j, n);
    (pv * h).store(w + j, n);
  }
}

// A softcap's second-order step on one tile row, in place: S-hat onto the raw scores,
// slope S-hat - 2 t slope x-dot dS / cap, then dS <- slope dS.
template <typename T>
inline void cap_row(const T* slope, const T* t, const T* x_dot, T* ds, T* s_hat, int64_t c,
                    T cap) {
  using Vec = at::vec::Vectorized<T>;
  constexpr int64_t W = Vec::size();
  const Vec k(T(-2) / cap);
  for (int64_t j = 0; j < c; j += W) {
    const int64_t n = std::min(W, c - j);
    const Vec sl = Vec::loadu(slope + j, n), dsv = Vec::loadu(ds + j, n);
    const Vec curve = Vec::loadu(t + j, n) * sl * k;  // the curvature, d slope / dx
    (at::vec::fmadd(Vec::loadu(x_dot + j, n) * dsv, curve, sl * Vec::loadu(s_hat + j, n)))
        .store(s_hat + j, n);
    (sl * dsv).store(ds + j, n);
  }
}

// The first walk over the key tiles of rows i0 .. i0 + r of head (b, h): each tile's P, dP,
// G and W kept (file comment), and the rows' sums (`ROW_SUMS`) in `w.delta`, `w.rsum`,
// `w.pgdp` and `w.rho`.  A: the rows' [s g_q | s q] (`tangent_rows`), `inner` wide.
template <typename T>
void first_walk(const Problem<T>& pb, Engine engine, const SecondOperands<T>& x,
                const Direction<T>& dir, int64_t b, int64_t h, int64_t i0, int64_t r,
                const T* A, int64_t inner, SecondScratch<T>& w) {
  const int64_t bk = pb.block_k, tile = pb.block_q * bk, bh = b * pb.Hq + h;
  const int64_t bhk = b * pb.Hkv + h / pb.G, kb_all = pb.key_blocks();
  const T* kt_h = x.kt + bhk * kb_all * x.rows * bk;
  const T* vt_h = x.vt + bhk * kb_all * pb.dv * bk;
  const T* gvt_h = x.gvt == nullptr ? nullptr : x.gvt + bhk * kb_all * pb.dv * bk;
  const int64_t from = dir.q != nullptr ? 0 : pb.d;  // the panel's rows A meets
  const bool cap = pb.cap != T(0);
  T *delta = w.delta.data(), *rs = w.rsum.data(), *pgdp = w.pgdp.data(), *pw = w.rho.data();
  std::fill(delta, delta + r, T(0));
  std::fill(rs, rs + r, T(0));
  std::fill(pgdp, pgdp + r, T(0));
  std::fill(pw, pw + r, T(0));
  w.tiles.clear();
  pb.for_each_key_tile(b, h, i0, r, [&](int64_t kb, int64_t ka, int64_t c) {
    const int64_t n = static_cast<int64_t>(w.tiles.size()), j0 = kb * bk + ka;
    w.tiles.push_back({kb, ka, c});
    T *P = w.p + n * tile, *dP = w.dp + n * tile;
    T *G = w.g + n * tile, *Wt = w.w + n * tile;
    T* slope = cap ? w.slope + n * tile : nullptr;
    const T* panel = kt_h + kb * x.rows * bk + ka;
    score_product(engine, r, c, pb.d, w.qs.data(), pb.d, panel, bk, P, bk);  // forward's S
    mask_tile(pb, b, h, i0, r, j0, c, P, bk, slope, static_cast<Runner<T>*>(nullptr),
              static_cast<T*>(nullptr), w.mask.get(), static_cast<uint8_t*>(nullptr),
              cap ? w.tanh + n * tile : nullptr);
    probabilities(r, c, P, bk, x.stats + (bh * pb.Nq + i0) * 2);
    product(engine, r, c, pb.dv, w.dos.data(), pb.dv, vt_h + kb * pb.dv * bk + ka, bk, dP, bk,
            false);
    if (gvt_h != nullptr)
      product(engine, r, c, pb.dv, w.dos.data(), pb.dv, gvt_h + kb * pb.dv * bk + ka, bk, Wt,
              bk, false);
    else
      for (int64_t ii = 0; ii < r; ++ii) std::fill(Wt + ii * bk, Wt + ii * bk + c, T(0));
    if (pb.row_words != nullptr) {
      drop(pb, bh, i0, r, j0, c, dP, bk);
      drop(pb, bh, i0, r, j0, c, Wt, bk);
    }
    // G: the direction's raw product, its slope, then D' and g_bias (as forward mode's S')
    if (inner > 0) product(engine, r, c, inner, A, inner, panel + from * bk, bk, G, bk, false);
    for (int64_t ii = 0; ii < r; ++ii) {
      const int64_t i = i0 + ii;
      T* g = G + ii * bk;
      if (inner == 0) std::fill(g, g + c, T(0));
      if (cap) {
        std::copy(g, g + c, w.raw + n * tile + ii * bk);  // x-dot, the softcap's
        for (int64_t j = 0; j < c; ++j) g[j] *= slope[ii * bk + j];
      }
      if (dir.diagonal != nullptr)
        add_row(g, dir.diagonal + (bh * pb.diagonals() + j0 - i + pb.Nq - 1), c);
      if (dir.bias != nullptr) {
        const T* gb = dir.bias + b * dir.sb[0] + h * dir.sb[1] + i * dir.sb[2] + j0 * dir.sb[3];
        for (int64_t j = 0; j < c; ++j) g[j] += gb[j * dir.sb[3]];
      }
      row_sums(P + ii * bk, dP + ii * bk, g, Wt + ii * bk, c, delta[ii], rs[ii], pgdp[ii],
               pw[ii]);
    }
  });
}

// The rows' sums after `first_walk`: stored into `out` (this pass's share) where wanted,
// replaced by those over every key where given (`x.sums`), then rho' = rowsum(P G dP) -
// r Delta + rowsum(P W) into w.rho (which held rowsum(P W)).  row0: the rows' first index
// in [B, Hq, Nq].
template <typename T>
void settle_row_sums(const SecondOperands<T>& x, T* out, int64_t row0, int64_t r,
                     SecondScratch<T>& w) {
  std::array<T*, ROW_SUMS> sums{w.delta.data(), w.rsum.data(), w.pgdp.data(), w.rho.data()};
  for (int64_t ii = 0; ii < r; ++ii)
    for (int64_t a = 0; a < ROW_SUMS; ++a) {
      const int64_t at = (row0 + ii) * ROW_SUMS + a;
      if (out != nullptr) out[at] = sums[a][ii];
      if (x.sums != nullptr) sums[a][ii] = x.sums[at];
    }
  for (int64_t ii = 0; ii < r; ++ii) w.rho[ii] += w.pgdp[ii] - w.rsum[ii] * w.delta[ii];
}

// The second walk over the tiles `first_walk` kept: dS, S-hat and D-hat in place, S-hat
// and the diagonal sums stored where wanted, then the gradient products: grad q's and grad
// dO's rows into w.dq and w.ddo, grad k's and grad v's into gk and gv (the unit's slab,
// rows of kv head (b, hk)).  A as `first_walk`'s; gq_rows: s g_q of the rows (or nullptr).
template <typename T>
void second_walk(const Problem<T>& pb, Engine engine, const SecondOperands<T>& x,
                 const SecondOutputs<T>& out, int64_t b, int64_t h, int64_t i0, int64_t r,
                 const T* gq_rows, int64_t ldg, SecondScratch<T>& w, T* gk, T* gv) {
  const int64_t bk = pb.block_k, tile = pb.block_q * bk, bh = b * pb.Hq + h;
  const int64_t bhk = b * pb.Hkv + h / pb.G, d = pb.d, dv = pb.dv, g = h % pb.G;
  const T* k_h = x.k + bhk * pb.Nk * d;
  const T* gk_h = x.gk == nullptr ? nullptr : x.gk + bhk * pb.Nk * d;
  const T* v_h = x.v + bhk * pb.Nk * dv;
  const T* gv_h = x.gv == nullptr ? nullptr : x.gv + bhk * pb.Nk * dv;
  const T* dlse = x.dlse == nullptr ? nullptr : x.dlse + bh * pb.Nq + i0;
  std::fill(w.dq.begin(), w.dq.begin() + r * d, T(0));
  std::fill(w.ddo.begin(), w.ddo.begin() + r * dv, T(0));
  for (size_t n = 0; n < w.tiles.size(); ++n) {
    const auto [kb, ka, c] = w.tiles[n];
    const int64_t j0 = kb * bk + ka;
    T *P = w.p + n * tile, *dS = w.dp + n * tile;
    T *s_hat = w.g + n * tile, *d_hat = w.w + n * tile;
    for (int64_t ii = 0; ii < r; ++ii) {
      const T c_row = w.delta[ii] - (dlse == nullptr ? T(0) : dlse[ii]);
      hat_row(P + ii * bk, dS + ii * bk, s_hat + ii * bk, d_hat + ii * bk, c, c_row,
              w.rsum[ii], w.rho[ii]);
    }
    store_score_gradient(pb, bh, i0, r, j0, c, s_hat, out.s_hat);
    if (w.dd != nullptr) {
      diagonal_gradient(pb, g, i0, r, j0, c, dS, w.dd);
      diagonal_gradient(pb, g, i0, r, j0, c, s_hat, w.dd_hat);
    }
    if (pb.cap != T(0))
      for (int64_t ii = 0; ii < r; ++ii) {
        const int64_t at = n * tile + ii * bk;
        cap_row(w.slope + at, w.tanh + at, w.raw + at, dS + ii * bk,
                s_hat + ii * bk, c, pb.cap);
      }
    if (pb.row_words != nullptr) {  // D-hat M and P M, (1 - p) in dO's rows
      drop(pb, bh, i0, r, j0, c, d_hat, bk);
      if (out.dout != nullptr && gv_h != nullptr) drop(pb, bh, i0, r, j0, c, P, bk);
    }
    T* t = w.t.data();
    if (gv != nullptr)
      product_transposed_a(engine, c, dv, r, d_hat, bk, w.dos.data(), dv, gv + j0 * dv, dv,
                           true, t);
    if (out.dout != nullptr) {
      product(engine, r, dv, c, d_hat, bk, v_h + j0 * dv, dv, w.ddo.data(), dv, true);
      if (gv_h != nullptr)
        product(engine, r, dv, c, P, bk, gv_h + j0 * dv, dv, w.ddo.data(), dv, true);
    }
    if (out.q != nullptr) {
      product(engine, r, d, c, s_hat, bk, k_h + j0 * d, d, w.dq.data(), d, true);
      if (gk_h != nullptr) product(engine, r, d, c, dS, bk, gk_h + j0 * d, d, w.dq.data(), d, true);
    }
    if (gk != nullptr) {
      product_transposed_a(engine, c, d, r, s_hat, bk, w.qs.data(), d, gk + j0 * d, d, true, t);
      if (gq_rows != nullptr)
        product_transposed_a(engine, c, d, r, dS, bk, gq_rows, ldg, gk + j0 * d, d, true, t);
    }
  }
}

// The pass (file comment).  Units (b, kv head, slab of row blocks); `inner` and `from` as
// the tangent pass's (A against the panels).
template <typename T>
void second_pass(const Problem<T>& pb, Engine engine, const SecondOperands<T>& x,
                 const Direction<T>& dir, const SecondOutputs<T>& out) {
  const int64_t bq = pb.block_q, d = pb.d, dv = pb.dv, nk = pb.Nk;
  const int64_t inner = ((dir.q != nullptr) + dir.k) * d;
  const int64_t blocks = pb.row_blocks(), slabs = slab_count(pb, blocks);
  std::vector<int64_t> cost(blocks, 1);  // a row block's key tiles, + 1: its rows' own work
  for (int64_t rb = 0; rb < blocks; ++rb) {
    int64_t first, stop;
    pb.key_block_span(rb * bq, std::min(pb.Nq, (rb + 1) * bq), first, stop);
    cost[rb] += stop - first;
  }
  const std::vector<int64_t> edge = slab_edges(cost, slabs);
  const int64_t units = pb.B * pb.Hkv * slabs, kv = nk * d, kvv = nk * dv;
  const int64_t size_k = pb.B * pb.Hkv * kv, size_v = pb.B * pb.Hkv * kvv;
  // slab s > 0's sums of grad k and grad v (each unit zeroes its own rows)
  const auto dtype = c10::CppTypeToScalarType<T>::value;
  const at::Tensor part_k = at::empty({out.k == nullptr ? 0 : (slabs - 1) * size_k}, dtype);
  const at::Tensor part_v = at::empty({out.v == nullptr ? 0 : (slabs - 1) * size_v}, dtype);
  const int64_t diagonal = out.dd == nullptr ? 0 : pb.G * pb.diagonals();
  // dd's and dd_hat's per unit, each zeroed by its unit
  const at::Tensor diagonal_sums = at::empty({2 * units * diagonal}, dtype);
  for_each_unit<SecondScratch<T>>(
      units, engine, [&] { return second_scratch(pb, inner); },
      [&](int64_t u, SecondScratch<T>& w) {
        const int64_t s = u % slabs, hk = (u / slabs) % pb.Hkv, b = u / (slabs * pb.Hkv);
        const int64_t bhk = b * pb.Hkv + hk;
        T* gk = out.k == nullptr ? nullptr
                : (s == 0 ? out.k : part_k.data_ptr<T>() + (s - 1) * size_k) + bhk * kv;
        T* gv = out.v == nullptr ? nullptr
                : (s == 0 ? out.v : part_v.data_ptr<T>() + (s - 1) * size_v) + bhk * kvv;
        if (gk != nullptr) std::fill(gk, gk + kv, T(0));
        if (gv != nullptr) std::fill(gv, gv + kvv, T(0));
        if (diagonal > 0) {
          w.dd = diagonal_sums.data_ptr<T>() + 2 * u * diagonal;
          w.dd_hat = w.dd + diagonal;
          std::fill(w.dd, w.dd + 2 * diagonal, T(0));
        }
        for (int64_t rb = edge[s]; rb < edge[s + 1]; ++rb) {
          const int64_t i0 = rb * bq, r = std::min(bq, pb.Nq - i0);
          for (int64_t g = 0; g < pb.G; ++g) {
            const int64_t h = hk * pb.G + g, row0 = (b * pb.Hq + h) * pb.Nq + i0;
            const T* A = tangent_rows(pb, x.q, dir, row0, r, inner, w.qs.data(), w.a.data());
            scaled_rows(x.dout + row0 * dv, r, dv, pb.keep_scale, w.dos.data(), dv);
            first_walk(pb, engine, x, dir, b, h, i0, r, A, inner, w);
            settle_row_sums(x, out.sums, row0, r, w);
            if (!out.gradients()) continue;
            if (out.r != nullptr) std::copy(w.rsum.begin(), w.rsum.begin() + r, out.r + row0);
            const T* gq_rows = dir.q == nullptr ? nullptr : A;  // s g_q, A's first d columns
            second_walk(pb, engine, x, out, b, h, i0, r, gq_rows, inner, w, gk, gv);
            if (out.q != nullptr)
              for (int64_t e = 0; e < r * d; ++e) out.q[row0 * d + e] = w.dq[e] * pb.scale;
            if (out.dout != nullptr)
              for (int64_t e = 0; e < r * dv; ++e)
                out.dout[row0 * dv + e] = w.ddo[e] * pb.keep_scale;
          }
        }
      });
  if (slabs > 1) {
    if (out.k != nullptr) join_slabs(out.k, part_k.data_ptr<T>(), slabs, size_k, T(1));
    if (out.v != nullptr) join_slabs(out.v, part_v.data_ptr<T>(), slabs, size_v, T(1));
  }
  if (diagonal == 0) return;
  // units u = (b * Hkv + hk) * slabs + s: the sums of (b, hk)'s heads join in slab order
  const T* sums = diagonal_sums.data_ptr<T>();
  join_units(out.dd, sums, units / slabs, slabs, diagonal, 2 * diagonal);
  join_units(out.dd_hat, sums + diagonal, units / slabs, slabs, diagonal, 2 * diagonal);
}

}  // namespace attngrad_fused
