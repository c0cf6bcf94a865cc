// Strategy "fused": flash attention's forward, backward and forward mode as C++ CPU kernels.
//
// The passes walk [block_q, block_k] tiles of the scores on key-block boundaries that are
// multiples of block_k (the same tiles in all), skipping those the band masks entirely.
// Per tile, the products run through one engine (`products.h`) and every elementwise step --
// cap, bias, mask, max, exp, row sums, dropout, dS -- runs on the tile while it is in cache
// (`tile.h`):
//
//   forward   units (b, kv head, query block):  S = (s q) k^T, online softmax, O += P v;
//                                               writes O and (m, log l)
//   backward  units (b, kv head, slab of key blocks):  per key block, over the query heads
//             of the group and the row blocks that reach it: P, dV += P^T dO, dP = dO v^T,
//             dS, dK += dS^T (s q), dQ += dS k; dK, dV written whole, dQ summed per slab
//   tangent   units as forward's, the same walk of key tiles (`tangent.h`): P rebuilt from
//             (m, log l), S' = [s q' | s q] [k^T ; k'^T] (+ bias'), O' and lse' (forward mode)
//   forward_tangent  forward and tangent in one walk (`tangent.h`): O, (m, log l) bit for
//             bit as forward's, O' and lse' from the same tiles' E = exp(S - m), rescaled
//             with forward's sums when m moves (forward mode when the tangents are known
//             before the primal call)
//   second    units (b, kv head, slab of query blocks), each block's key tiles walked twice
//             (`second.h`): P, dP, G = L(g), W = dO g_v^T kept and the row sums r, rho'
//             formed, then dS, S-hat, D-hat and the gradients of <g, (dq, dk, dv, dbias)>
//             (double backward, Hessian-vector products); grad k, grad v summed per slab
//
// Units are independent (no atomics on results: each dK/dV row and each slab's dQ rows
// belong to one unit), the partition is a function of the shape alone, and each unit's
// arithmetic does not depend on which thread runs it: results are bitwise identical for
// any thread count.  Threads take units from a shared counter.
//
// A score program (`program.h`: a FlexAttention score_mod traced in Python) runs on each
// tile row after the softcap, before the bias; backward keeps the capped rows, and after dS'
// (the gradient at the program's output, what a bias gradient stores) runs the backward
// program per row into dS, before the softcap's slope.  Its SCATTERs add captured tensors'
// gradients into buffers of the unit's own, summed in unit order afterwards: bitwise the
// same for any thread count too.
//
// A relative score_mod (S' = S + t(b, h, i - j)) arrives instead as its term along the
// diagonals, D (`Problem::diagonal`), added to each row like a bias; backward sums dS' along
// the diagonals into dD per unit, and the units' sums join in unit order.
//
// A BlockMask arrives as a band (lo, hi) when each row keeps one interval of keys; else as
// the band of its rows' non-empty blocks, its block status [Bm, Hm, QB, KB] and its mask_mod
// as a mask program (`tile.h`, `mask_blocks`): both passes skip a tile whose blocks are all
// empty for its head, mask empty blocks, keep full ones and run the mask program on the rows'
// segments in partial ones, whatever the tile and block sizes.  A score program's bounds
// checks and backward's zeroing of dS read the tile's verdicts.  (A dense keep [B, Hq, Nq,
// Nk] remains for a mask_mod that does not compile.)
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "peak.h"
#include "products.h"
#include "second.h"
#include "tangent.h"
#include "tile.h"

namespace attngrad_fused {

namespace {

using at::Tensor;

template <typename T>
struct RowScratch {  // forward: one block of query rows
  Buffer<T> q, s, acc, m, l, shift;
  std::unique_ptr<Runner<T>> run;   // the score program's registers, when there is one
  std::unique_ptr<Runner<T>> mask;  // the mask program's, likewise
  Buffer<uint8_t> blocks;           // the tile's BlockMask verdicts, for run's bounds checks
};

// A BlockMask's verdicts per score of a tile are kept where a score program reads them.
template <typename T>
bool wants_verdicts(const Problem<T>& pb) {
  return pb.status != nullptr && (pb.program != nullptr || pb.grad_program != nullptr);
}

template <typename T>
Problem<T> problem(const Tensor& q, const Tensor& k, const Tensor& v,
                   const std::optional<Tensor>& bias, const std::optional<Tensor>& keep,
                   const std::optional<Tensor>& lo, const std::optional<Tensor>& hi,
                   const std::optional<Tensor>& row_words, const std::optional<Tensor>& col_words,
                   double scale, double cap, int64_t threshold, double keep_scale,
                   int64_t block_q, int64_t block_k) {
  Problem<T> pb;
  pb.B = q.size(0);
  pb.Hq = q.size(1);
  pb.Nq = q.size(2);
  pb.d = q.size(3);
  pb.Hkv = k.size(1);
  pb.Nk = k.size(2);
  pb.dv = v.size(3);
  pb.G = pb.Hq / pb.Hkv;
  pb.block_q = block_q;
  pb.block_k = block_k;
  pb.scale = static_cast<T>(scale);
  pb.cap = static_cast<T>(cap);
  pb.keep_scale = static_cast<T>(keep_scale);
  pb.threshold = static_cast<int32_t>(threshold);
  if (bias) {
    pb.bias = bias->data_ptr<T>();
    for (int a = 0; a < 4; ++a) pb.sb[a] = bias->stride(a);
  }
  if (keep) {
    pb.keep = keep->data_ptr<bool>();
    for (int a = 0; a < 4; ++a) pb.sk[a] = keep->stride(a);
  }
  if (lo) {
    pb.lo = lo->data_ptr<int64_t>();
    pb.hi = hi->data_ptr<int64_t>();
  }
  if (row_words) {
    pb.row_words = row_words->data_ptr<int32_t>();
    pb.col_words = col_words->data_ptr<int32_t>();
  }
  return pb;
}

template <typename T>
void forward_impl(const Problem<T>& pb, Engine engine, const T* q, const T* kt, const T* v, T* o,
                  T* stats) {
  const int64_t bq = pb.block_q, bk = pb.block_k, d = pb.d, dv = pb.dv, nk = pb.Nk;
  const T neg_inf = -std::numeric_limits<T>::infinity();
  for_each_unit<RowScratch<T>>(
      pb.B * pb.Hkv * pb.row_blocks(), engine,
      [&] {
        RowScratch<T> s;
        s.q.resize(bq * d);
        s.s.resize(bq * bk);
        s.acc.resize(bq * dv);
        s.m.resize(bq);
        s.l.resize(bq);
        s.shift.resize(bq);
        if (pb.program != nullptr) s.run = std::make_unique<Runner<T>>(*pb.program, bk);
        if (pb.mask_program != nullptr) s.mask = std::make_unique<Runner<T>>(*pb.mask_program, bk);
        if (wants_verdicts(pb)) s.blocks.resize(bq * bk);
        return s;
      },
      [&](int64_t u, RowScratch<T>& w) {
        int64_t b, hk, blk;
        pb.row_unit(u, b, hk, blk);
        const int64_t i0 = blk * bq, r = std::min(bq, pb.Nq - i0);
        const T* kt_h = kt + (b * pb.Hkv + hk) * pb.key_blocks() * d * bk;
        const T* v_h = v + (b * pb.Hkv + hk) * nk * dv;
        T *m = w.m.data(), *l = w.l.data(), *shift = w.shift.data();
        for (int64_t g = 0; g < pb.G; ++g) {
          const int64_t h = hk * pb.G + g, bh = b * pb.Hq + h;
          scaled_rows(q + (bh * pb.Nq + i0) * d, r, d, pb.scale, w.q.data(), d);
          std::fill(m, m + r, neg_inf);
          std::fill(l, l + r, T(0));
          std::fill(shift, shift + r, T(0));
          std::fill(w.acc.begin(), w.acc.end(), T(0));
          pb.for_each_key_tile(b, h, i0, r, [&](int64_t kb, int64_t a, int64_t c) {
            const int64_t j0 = kb * bk + a;
            T* S = w.s.data();
            score_product(engine, r, c, d, w.q.data(), d, kt_h + kb * d * bk + a, bk, S, bk);
            mask_tile(pb, b, h, i0, r, j0, c, S, bk, static_cast<T*>(nullptr), w.run.get(),
                      static_cast<T*>(nullptr), w.mask.get(),
                      w.blocks.empty() ? nullptr : w.blocks.data());
            for (int64_t ii = 0; ii < r; ++ii) {
              const T alpha = online_row(S + ii * bk, c, m[ii], l[ii], shift[ii],
                                         pb.row_words != nullptr);
              rescale(w.acc.data() + ii * dv, dv, alpha);
            }
            if (pb.row_words != nullptr) drop(pb, bh, i0, r, j0, c, S, bk);
            product(engine, r, dv, c, S, bk, v_h + j0 * dv, dv, w.acc.data(), dv, true);
          });
          T* o_h = o + (bh * pb.Nq + i0) * dv;
          T* st = stats + (bh * pb.Nq + i0) * 2;
          for (int64_t ii = 0; ii < r; ++ii)
            finish_row(w.acc.data() + ii * dv, dv, pb.keep_scale, l[ii], shift[ii],
                       o_h + ii * dv, st + 2 * ii);
        }
      });
}

// dS of one tile in place over dP: P * (dP - Delta), or with dropout (P Z) * dP - P * Delta;
// P itself becomes P Z (what dV needs) when dropout is on.
template <typename T>
void score_gradient(const Problem<T>& pb, int64_t bh, int64_t i0, int64_t r, int64_t j0, int64_t c,
                    T* P, T* dP, int64_t ld, const T* delta) {
  if (pb.row_words == nullptr) {
    for (int64_t ii = 0; ii < r; ++ii) {
      T* p = P + ii * ld;
      T* dp = dP + ii * ld;
      const T dl = delta[ii];
      for (int64_t j = 0; j < c; ++j) dp[j] = (dp[j] - dl) * p[j];
    }
    return;
  }
  const int32_t* cols = pb.col_words + j0;
  for (int64_t ii = 0; ii < r; ++ii) {
    const int32_t row = pb.row_words[bh * pb.Nq + i0 + ii];
    T* p = P + ii * ld;
    T* dp = dP + ii * ld;
    const T dl = delta[ii];
    for (int64_t j = 0; j < c; ++j) {
      const T pz = keeps(row, cols[j], pb.threshold) ? p[j] : T(0);
      dp[j] = dp[j] * pz - p[j] * dl;
      p[j] = pz;
    }
  }
}

template <typename T>
struct Operands {  // what the backward pass reads
  const T *q, *k, *v, *dout, *stats, *delta;
};

// The rebuilt P (P Z under dropout) and dS of the tile of rows i0 .. i0 + r of head (b, h)
// against keys j0 .. j0 + c, into S and dS; kt, vt: the key block's panels of k^T and v^T
// ([d, block_k] and [dv, block_k]), so S is the very product forward took.
template <typename T>
void tile_gradient(const Problem<T>& pb, Engine engine, const Operands<T>& x, int64_t b, int64_t h,
                   int64_t i0, int64_t r, int64_t j0, int64_t c, const T* qs, const T* dos,
                   const T* kt, const T* vt, T* S, T* dS, T* slope, Runner<T>* run, T* raw,
                   Runner<T>* mask, uint8_t* blocks) {
  const int64_t bk = pb.block_k, bh = b * pb.Hq + h;
  score_product(engine, r, c, pb.d, qs, pb.d, kt, bk, S, bk);
  mask_tile(pb, b, h, i0, r, j0, c, S, bk, slope, run, raw, mask, blocks);
  probabilities(r, c, S, bk, x.stats + (bh * pb.Nq + i0) * 2);
  product(engine, r, c, pb.dv, dos, pb.dv, vt, bk, dS, bk, false);
  score_gradient(pb, bh, i0, r, j0, c, S, dS, bk, x.delta + bh * pb.Nq + i0);
}

template <typename T>
void slope_(int64_t r, int64_t c, T* dS, const T* slope, int64_t ld) {
  for (int64_t ii = 0; ii < r; ++ii)
    for (int64_t j = 0; j < c; ++j) dS[ii * ld + j] *= slope[ii * ld + j];
}

// The panel of key block rows x[c, w] (dense) transposed: [w, block] with leading dim block.
template <typename T>
void panel(int64_t c, int64_t w, const T* x, T* out, int64_t block) {
  transpose(c, w, x, w, out, block);
}

template <typename T>
struct KeyScratch {  // one block of keys: its panels, one tile's operands and its sums
  Buffer<T> kt, vt, q, dout, s, ds, slope, t, dk, dv;
  Buffer<T> raw;                        // the capped scores, the backward program's SCORE
  std::unique_ptr<Runner<T>> run, grad;  // the score program's forward and backward runners
  std::unique_ptr<Runner<T>> mask;       // the mask program's
  Buffer<uint8_t> blocks;                // the tile's BlockMask verdicts, for the programs
  T* ddiagonal = nullptr;  // dD's sums of this unit, [G, Nq + Nk - 1], when wanted
};

template <typename T>
KeyScratch<T> key_scratch(const Problem<T>& pb) {
  const int64_t bq = pb.block_q, bk = pb.block_k;
  KeyScratch<T> s;
  s.kt.resize(pb.d * bk);
  s.vt.resize(pb.dv * bk);
  s.q.resize(bq * pb.d);
  s.dout.resize(bq * pb.dv);
  s.s.resize(bq * bk);
  s.ds.resize(bq * bk);
  if (pb.cap != T(0)) s.slope.resize(bq * bk);
  s.t.resize(bq * bk);
  s.dk.resize(bk * pb.d);
  s.dv.resize(bk * pb.dv);
  if (pb.program != nullptr) s.run = std::make_unique<Runner<T>>(*pb.program, bk);
  if (pb.grad_program != nullptr) {
    s.raw.resize(bq * bk);
    s.grad = std::make_unique<Runner<T>>(*pb.grad_program, bk);
  }
  if (pb.mask_program != nullptr) s.mask = std::make_unique<Runner<T>>(*pb.mask_program, bk);
  if (wants_verdicts(pb)) s.blocks.resize(bq * bk);
  return s;
}

// The key blocks [first[rb], stop[rb]) each block of query rows reaches, as in forward.
template <typename T>
struct Spans {
  std::vector<int64_t> first, stop;
  explicit Spans(const Problem<T>& pb) : first(pb.row_blocks()), stop(pb.row_blocks()) {
    for (int64_t rb = 0; rb < pb.row_blocks(); ++rb)
      pb.key_block_span(rb * pb.block_q, std::min(pb.Nq, (rb + 1) * pb.block_q), first[rb],
                        stop[rb]);
  }
};

// dK and dV of key block kb of kv head (b, hk), written whole, and dS k added into the rows of
// `dq` ([B, Hq, Nq, d]; this unit's alone); dS itself into ds_out when asked for.
template <typename T>
void key_block(const Problem<T>& pb, Engine engine, const Operands<T>& x, const Spans<T>& spans,
               int64_t b, int64_t hk, int64_t kb, KeyScratch<T>& w, T* dk, T* dv, T* dq,
               T* ds_out) {
  const int64_t bq = pb.block_q, bk = pb.block_k, d = pb.d, dvd = pb.dv, nk = pb.Nk;
  const int64_t j0 = kb * bk, c = std::min(bk, nk - j0), bhk = b * pb.Hkv + hk;
  const T* k_h = x.k + bhk * nk * d;
  panel(c, d, k_h + j0 * d, w.kt.data(), bk);  // the panel forward read
  panel(c, dvd, x.v + (bhk * nk + j0) * dvd, w.vt.data(), bk);
  std::fill(w.dk.begin(), w.dk.end(), T(0));
  std::fill(w.dv.begin(), w.dv.end(), T(0));
  T* slope = w.slope.empty() ? nullptr : w.slope.data();
  uint8_t* blocks = w.blocks.empty() ? nullptr : w.blocks.data();
  for (int64_t g = 0; g < pb.G; ++g) {
    const int64_t h = hk * pb.G + g, bh = b * pb.Hq + h;
    for (int64_t rb = 0; rb < pb.row_blocks(); ++rb) {
      if (kb < spans.first[rb] || kb >= spans.stop[rb]) continue;
      const int64_t i0 = rb * bq, r = std::min(bq, pb.Nq - i0);
      int64_t a, e;  // forward's columns of this tile (`Problem::tile_columns`)
      pb.tile_columns(i0, i0 + r, j0, c, a, e);
      if (a == e) continue;
      const int64_t ja = j0 + a, ca = e - a;
      if (pb.tile_empty(b, h, i0, i0 + r, ja, ja + ca)) continue;  // as forward skipped it
      scaled_rows(x.q + (bh * pb.Nq + i0) * d, r, d, pb.scale, w.q.data(), d);
      scaled_rows(x.dout + (bh * pb.Nq + i0) * dvd, r, dvd, pb.keep_scale, w.dout.data(), dvd);
      tile_gradient(pb, engine, x, b, h, i0, r, ja, ca, w.q.data(), w.dout.data(),
                    w.kt.data() + a, w.vt.data() + a, w.s.data(), w.ds.data(), slope,
                    w.run.get(), w.raw.empty() ? nullptr : w.raw.data(), w.mask.get(), blocks);
      // dV += (P Z)^T dO and dK += dS^T (s q), the tile read transposed
      product_transposed_a(engine, ca, dvd, r, w.s.data(), bk, w.dout.data(), dvd,
                           w.dv.data() + a * dvd, dvd, true, w.t.data());
      store_score_gradient(pb, bh, i0, r, ja, ca, w.ds.data(), ds_out);
      if (w.ddiagonal != nullptr) diagonal_gradient(pb, g, i0, r, ja, ca, w.ds.data(), w.ddiagonal);
      if (w.grad != nullptr)
        program_gradient(pb, *w.grad, b, h, i0, r, ja, ca, w.raw.data(), blocks, w.ds.data());
      if (slope != nullptr) slope_(r, ca, w.ds.data(), slope, bk);
      product_transposed_a(engine, ca, d, r, w.ds.data(), bk, w.q.data(), d,
                           w.dk.data() + a * d, d, true, w.t.data());
      product(engine, r, d, ca, w.ds.data(), bk, k_h + ja * d, d, dq + (bh * pb.Nq + i0) * d, d,
              true);
    }
  }
  std::copy(w.dk.begin(), w.dk.begin() + c * d, dk + (bhk * nk + j0) * d);
  std::copy(w.dv.begin(), w.dv.begin() + c * dvd, dv + (bhk * nk + j0) * dvd);
}

// The backward pass: units (b, kv head, slab of key blocks), each walking its key blocks in
// order; slab 0 adds dS k into dq, slab s > 0 into partial[s - 1], and the partials join dq
// in slab order afterwards (then dq *= scale): no atomics, the same sums for any threads.
//
// With a backward program, `dcaptured` holds one buffer per captured tensor (nullptr: not
// wanted); each unit adds into zeroed buffers of its own (`Runner::dcaptured`, the wanted
// captures side by side), which join the results in unit order afterwards.  dD
// (`ddiagonal`, [B, Hq, Nq + Nk - 1], nullptr: not wanted) likewise, per unit [G, Nq + Nk - 1].
template <typename T>
void backward_pass(const Problem<T>& pb, Engine engine, const Operands<T>& x, T* dq, T* dk,
                   T* dv, T* ds_out, const std::vector<T*>& dcaptured, T* ddiagonal) {
  const Spans<T> spans(pb);
  const int64_t slabs = slab_count(pb, pb.key_blocks()), group = pb.G * pb.Nq * pb.d;
  std::vector<int64_t> cost(pb.key_blocks(), 1);  // a key block's tiles, + 1: its panels and sums
  for (int64_t kb = 0; kb < pb.key_blocks(); ++kb)
    for (size_t rb = 0; rb < spans.first.size(); ++rb)
      cost[kb] += kb >= spans.first[rb] && kb < spans.stop[rb];
  const std::vector<int64_t> edge = slab_edges(cost, slabs);
  const int64_t size = pb.B * pb.Hq * pb.Nq * pb.d, units = pb.B * pb.Hkv * slabs;
  Buffer<T> partial((slabs - 1) * size);  // each unit zeroes its own rows
  std::vector<int64_t> offset(dcaptured.size(), -1);  // capture a's place in a unit's buffers
  int64_t wanted = 0;
  for (size_t a = 0; a < dcaptured.size(); ++a) {
    if (dcaptured[a] == nullptr) continue;
    offset[a] = wanted;
    wanted += pb.grad_program->captured[a].numel;
  }
  Buffer<T> captured(units * wanted);  // each unit zeroes its own
  const int64_t diagonal = ddiagonal == nullptr ? 0 : pb.G * pb.diagonals();
  Buffer<T> diagonal_sums(units * diagonal);  // likewise
  for_each_unit<KeyScratch<T>>(
      units, engine, [&] { return key_scratch(pb); },
      [&](int64_t u, KeyScratch<T>& w) {
        const int64_t s = u % slabs, hk = (u / slabs) % pb.Hkv, b = u / (slabs * pb.Hkv);
        if (w.grad != nullptr) {
          T* own = captured.data() + u * wanted;
          std::fill(own, own + wanted, T(0));
          for (size_t a = 0; a < offset.size(); ++a)
            w.grad->dcaptured[a] = offset[a] < 0 ? nullptr : own + offset[a];
        }
        if (diagonal > 0) {
          w.ddiagonal = diagonal_sums.data() + u * diagonal;
          std::fill(w.ddiagonal, w.ddiagonal + diagonal, T(0));
        }
        T* target = s == 0 ? dq : partial.data() + (s - 1) * size;
        T* rows = target + (b * pb.Hq + hk * pb.G) * pb.Nq * pb.d;  // the group's rows
        std::fill(rows, rows + group, T(0));
        for (int64_t kb = edge[s]; kb < edge[s + 1]; ++kb)
          key_block(pb, engine, x, spans, b, hk, kb, w, dk, dv, target, ds_out);
      });
  join_slabs(dq, partial.data(), slabs, size, pb.scale);
  // units u = (b * Hkv + hk) * slabs + s: dD of (b, hk)'s heads sums its slabs in order
  if (diagonal > 0)
    join_units(ddiagonal, diagonal_sums.data(), units / slabs, slabs, diagonal, diagonal);
  for (size_t a = 0; a < offset.size(); ++a) {
    if (offset[a] < 0) continue;
    const int64_t numel = pb.grad_program->captured[a].numel;
    const T* from = captured.data() + offset[a];
    at::parallel_for(0, numel, 1 << 12, [&](int64_t begin, int64_t end) {
      for (int64_t e = begin; e < end; ++e) {
        T sum = from[e];
        for (int64_t u = 1; u < units; ++u) sum += from[u * wanted + e];
        dcaptured[a][e] = sum;
      }
    });
  }
}

// The ops' arguments, checked as `attngrad.strategies.fused.strategy` passes them; a
// caller of the raw ops gets a ValueError or TypeError naming the argument.
void check_inputs(const Tensor& q, const Tensor& k, const Tensor& v, int64_t block_q,
                  int64_t block_k, int64_t engine) {
  TORCH_CHECK_VALUE(q.device().is_cpu(), "attngrad_fused: q must be a CPU tensor, got ",
                    q.device());
  TORCH_CHECK_TYPE(q.scalar_type() == at::kFloat || q.scalar_type() == at::kDouble,
                   "attngrad_fused: q must be float32 or float64 (upcast 16-bit inputs), got ",
                   q.scalar_type());
  const char* names[] = {"q", "k", "v"};
  const Tensor* ts[] = {&q, &k, &v};
  for (int i = 0; i < 3; ++i) {
    const Tensor& t = *ts[i];
    TORCH_CHECK_VALUE(t.dim() == 4 && t.is_contiguous() && t.device().is_cpu(), "attngrad_fused: ",
                      names[i], " must be a contiguous CPU [B, H, N, d] tensor, got shape ",
                      t.sizes());
    TORCH_CHECK_TYPE(t.scalar_type() == q.scalar_type(), "attngrad_fused: ", names[i],
                     " must have q's dtype ", q.scalar_type(), ", got ", t.scalar_type());
  }
  TORCH_CHECK_VALUE(k.size(0) == q.size(0) && v.size(0) == q.size(0), "attngrad_fused: q, k, v ",
                    "need one batch size, got ", q.size(0), ", ", k.size(0), ", ", v.size(0));
  TORCH_CHECK_VALUE(k.size(1) > 0 ? q.size(1) % k.size(1) == 0 && v.size(1) == k.size(1)
                                  : q.size(1) == 0,
                    "attngrad_fused: q's heads must be a multiple of k's and v's, got ", q.size(1),
                    ", ", k.size(1), ", ", v.size(1));
  TORCH_CHECK_VALUE(k.size(3) == q.size(3) && v.size(2) == k.size(2), "attngrad_fused: k must be ",
                    "[B, Hkv, Nk, d] for q's d and v [B, Hkv, Nk, dv], got ", k.sizes(), ", ",
                    v.sizes());
  TORCH_CHECK_VALUE(block_q >= 1 && block_k >= 1, "attngrad_fused: block_q and block_k must be ",
                    ">= 1, got ", block_q, ", ", block_k);
  TORCH_CHECK_VALUE(engine >= 0 && engine <= 2, "attngrad_fused: engine must be 0, 1 or 2, got ",
                    engine);
}

// An optional argument, when given: `shape` elements in `dtype` where it is read.
void check_optional(const std::optional<Tensor>& t, const char* name, at::ScalarType dtype,
                    int64_t numel) {
  if (!t) return;
  TORCH_CHECK_TYPE(t->scalar_type() == dtype, "attngrad_fused: ", name, " must be ", dtype,
                   ", got ", t->scalar_type());
  TORCH_CHECK_VALUE(t->device().is_cpu(), "attngrad_fused: ", name, " must be on the CPU");
  if (numel >= 0)
    TORCH_CHECK_VALUE(t->is_contiguous() && t->numel() == numel, "attngrad_fused: ", name,
                      " must be contiguous with ", numel, " elements, got shape ", t->sizes());
}

void check_mask(const Tensor& q, const Tensor& k, const std::optional<Tensor>& bias,
                const std::optional<Tensor>& keep, const std::optional<Tensor>& lo,
                const std::optional<Tensor>& hi, const std::optional<Tensor>& row_words,
                const std::optional<Tensor>& col_words) {
  const std::vector<int64_t> scores = {q.size(0), q.size(1), q.size(2), k.size(2)};
  for (const auto* t : {&bias, &keep})
    if (*t)
      TORCH_CHECK_VALUE((*t)->sizes() == at::IntArrayRef(scores), "attngrad_fused: the mask must ",
                        "be [B, Hq, Nq, Nk] = ", at::IntArrayRef(scores), " (a broadcast view ",
                        "will do), got ", (*t)->sizes());
  check_optional(bias, "bias", q.scalar_type(), -1);
  check_optional(keep, "keep", at::kBool, -1);
  TORCH_CHECK_VALUE(lo.has_value() == hi.has_value(), "attngrad_fused: lo and hi come together");
  check_optional(lo, "lo", at::kLong, q.size(2));
  check_optional(hi, "hi", at::kLong, q.size(2));
  TORCH_CHECK_VALUE(row_words.has_value() == col_words.has_value(),
                    "attngrad_fused: row_words and col_words come together");
  check_optional(row_words, "row_words", at::kInt, q.size(0) * q.size(1) * q.size(2));
  check_optional(col_words, "col_words", at::kInt, k.size(2));
}

// k: [B, H, N, x] -> [B, H, ceil(N / block), x, block]: each key block's panel of k^T
// (zero past N), so a tile's product reads one dense [x, block] panel.  With `below` (like
// k): [.., 2x, block], its panel of below^T under k^T's (forward mode's [k^T ; k'^T]).
template <typename T>
Tensor panels(const Tensor& k, int64_t block, const std::optional<Tensor>& below = std::nullopt) {
  const int64_t bh = k.size(0) * k.size(1), n = k.size(2), x = k.size(3);
  const int64_t blocks = (n + block - 1) / block, rows = below ? 2 * x : x;
  Tensor out = at::zeros({k.size(0), k.size(1), blocks, rows, block}, k.options());
  const T* src = k.data_ptr<T>();
  const T* low = below ? below->data_ptr<T>() : nullptr;
  T* dst = out.data_ptr<T>();
  at::parallel_for(0, bh * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const int64_t kb = u % blocks, c = std::min(block, n - kb * block);
      const int64_t from = ((u / blocks) * n + kb * block) * x;
      panel(c, x, src + from, dst + u * rows * block, block);
      if (low != nullptr) panel(c, x, low + from, dst + (u * rows + x) * block, block);
    }
  });
  return out;
}

// D (`Problem::diagonal`), when given: [B, Hq, Nq + Nk - 1] contiguous in q's dtype, and no
// score program beside it (it is the score_mod's).
void check_diagonal(const Tensor& q, const Tensor& k, const std::optional<Tensor>& code,
                    const std::optional<Tensor>& diagonal) {
  if (!diagonal) return;
  TORCH_CHECK_VALUE(!code, "attngrad_fused: a score_mod comes as a program (code) or as its ",
                    "diagonal term, not both");
  check_optional(diagonal, "diagonal", q.scalar_type(),
                 q.size(0) * q.size(1) * (q.size(2) + k.size(2) - 1));
}

// The ops' score or mask program (code None: none), checked against the compute dtype of q.
std::optional<Program> program_of(const char* which, const Tensor& q,
                                  const std::optional<Tensor>& code,
                                  const std::optional<Tensor>& constants,
                                  const std::optional<Tensor>& indices, int64_t out,
                                  const std::optional<at::TensorList>& captured, int64_t batch,
                                  Role role) {
  if (!code) return std::nullopt;
  return make_program(which, *code, constants, indices, out, captured.value_or(at::TensorList()),
                      batch, q.scalar_type(), role);
}

// A BlockMask read by blocks (`Problem::status`), when given: status uint8 [Bm, Hm,
// ceil(Nq / block_q), ceil(Nk / block_k)] contiguous, Bm dividing B and Hm dividing Hq (1
// where the mask is shared), each entry empty (0), partial (1) or full (2), and its mask
// program (mask_code) beside it.
void check_blocks(const Tensor& q, const Tensor& k, const std::optional<Tensor>& status,
                  const std::optional<Tensor>& mask_code, int64_t block_q, int64_t block_k) {
  TORCH_CHECK_VALUE(status.has_value() == mask_code.has_value(), "attngrad_fused: a BlockMask's ",
                    "status and its mask program (mask_code) come together, got ",
                    status ? "status alone" : "mask_code alone");
  if (!status) return;
  TORCH_CHECK_VALUE(block_q >= 1 && block_k >= 1, "attngrad_fused: mask_block_q and ",
                    "mask_block_k must be >= 1, got ", block_q, ", ", block_k);
  TORCH_CHECK_TYPE(status->scalar_type() == at::kByte, "attngrad_fused: status must be uint8, ",
                   "got ", status->scalar_type());
  const int64_t qb = (q.size(2) + block_q - 1) / block_q, kb = (k.size(2) + block_k - 1) / block_k;
  const bool shape = status->dim() == 4 && status->size(0) >= 1 && status->size(1) >= 1 &&
                     q.size(0) % status->size(0) == 0 && q.size(1) % status->size(1) == 0 &&
                     status->size(2) == qb && status->size(3) == kb;
  TORCH_CHECK_VALUE(shape && status->is_contiguous() && status->device().is_cpu(),
                    "attngrad_fused: status must be a contiguous CPU [Bm, Hm, ", qb, ", ", kb,
                    "] tensor (Bm dividing B = ", q.size(0), ", Hm dividing Hq = ", q.size(1),
                    ", blocks of ", block_q, " x ", block_k, " scores), got shape ",
                    status->sizes());
  TORCH_CHECK_VALUE(status->numel() == 0 || status->max().item<uint8_t>() <= kFull,
                    "attngrad_fused: status entries must be 0 (empty), 1 (partial) or 2 (full)");
}

// The BlockMask read by blocks into pb (checked by `check_blocks`), when given.
template <typename T>
void read_blocks(Problem<T>& pb, const std::optional<Tensor>& status,
                 const std::optional<Program>& mask, int64_t block_q, int64_t block_k) {
  if (!status) return;
  pb.status = status->data_ptr<uint8_t>();
  pb.status_b = status->size(0);
  pb.status_h = status->size(1);
  pb.status_q = status->size(2);
  pb.status_k = status->size(3);
  pb.mask_bq = block_q;
  pb.mask_bk = block_k;
  pb.mask_program = &*mask;
}

std::tuple<Tensor, Tensor> forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                   const std::optional<Tensor>& bias,
                                   const std::optional<Tensor>& keep,
                                   const std::optional<Tensor>& lo, const std::optional<Tensor>& hi,
                                   const std::optional<Tensor>& row_words,
                                   const std::optional<Tensor>& col_words, double scale, double cap,
                                   int64_t threshold, double keep_scale, int64_t block_q,
                                   int64_t block_k, int64_t engine,
                                   const std::optional<Tensor>& code,
                                   const std::optional<Tensor>& constants,
                                   const std::optional<Tensor>& indices, int64_t out,
                                   std::optional<at::TensorList> captured, int64_t batch,
                                   const std::optional<Tensor>& diagonal,
                                   const std::optional<Tensor>& mask_code,
                                   const std::optional<Tensor>& mask_constants,
                                   const std::optional<Tensor>& mask_indices, int64_t mask_out,
                                   std::optional<at::TensorList> mask_captured,
                                   int64_t mask_batch, const std::optional<Tensor>& status,
                                   int64_t mask_block_q, int64_t mask_block_k) {
  check_inputs(q, k, v, block_q, block_k, engine);
  check_mask(q, k, bias, keep, lo, hi, row_words, col_words);
  check_diagonal(q, k, code, diagonal);
  check_blocks(q, k, status, mask_code, mask_block_q, mask_block_k);
  const std::optional<Program> program =
      program_of("code", q, code, constants, indices, out, captured, batch, Role::kForward);
  const std::optional<Program> mask =
      program_of("mask_code", q, mask_code, mask_constants, mask_indices, mask_out,
                 mask_captured, mask_batch, Role::kMask);
  Tensor o = at::empty({q.size(0), q.size(1), q.size(2), v.size(3)}, q.options());
  Tensor stats = at::empty({q.size(0), q.size(1), q.size(2), 2}, q.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "attngrad_fused::forward", [&] {
    Tensor kt = panels<scalar_t>(k, block_k);
    auto pb = problem<scalar_t>(q, k, v, bias, keep, lo, hi, row_words, col_words, scale, cap,
                                threshold, keep_scale, block_q, block_k);
    pb.program = program ? &*program : nullptr;
    pb.diagonal = diagonal ? diagonal->data_ptr<scalar_t>() : nullptr;
    read_blocks(pb, status, mask, mask_block_q, mask_block_k);
    forward_impl<scalar_t>(pb, static_cast<Engine>(engine), q.data_ptr<scalar_t>(),
                           kt.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
                           o.data_ptr<scalar_t>(), stats.data_ptr<scalar_t>());
  });
  return {o, stats};
}

// A tangent, when given: contiguous CPU, shaped and typed like `like`.
void check_like(const std::optional<Tensor>& t, const char* name, const Tensor& like) {
  if (!t) return;
  TORCH_CHECK_VALUE(t->sizes() == like.sizes() && t->is_contiguous() && t->device().is_cpu(),
                    "attngrad_fused: ", name, " must be a contiguous CPU tensor of shape ",
                    like.sizes(), ", got ", t->sizes());
  TORCH_CHECK_TYPE(t->scalar_type() == like.scalar_type(), "attngrad_fused: ", name,
                   " must have q's dtype ", like.scalar_type(), ", got ", t->scalar_type());
}

// The tangents' checks, both forward-mode ops' (and the second-order op's cotangents,
// `prefix` "g"): tq, tk, tv like q, k, v; tbias at the scores' shape; tdiagonal like the
// diagonal term D (and only beside it).
void check_tangents(const Tensor& q, const Tensor& k, const Tensor& v,
                    const std::optional<Tensor>& tq, const std::optional<Tensor>& tk,
                    const std::optional<Tensor>& tv, const std::optional<Tensor>& tbias,
                    const std::optional<Tensor>& diagonal, const std::optional<Tensor>& tdiagonal,
                    const std::string& prefix = "t") {
  check_mask(q, k, tbias, std::nullopt, std::nullopt, std::nullopt, std::nullopt, std::nullopt);
  check_diagonal(q, k, std::nullopt, diagonal);
  TORCH_CHECK_VALUE(diagonal || !tdiagonal, "attngrad_fused: ", prefix, "diagonal without a ",
                    "diagonal");
  check_diagonal(q, k, std::nullopt, tdiagonal);
  check_like(tq, (prefix + "q").c_str(), q);
  check_like(tk, (prefix + "k").c_str(), k);
  check_like(tv, (prefix + "v").c_str(), v);
}

// The tangents as the passes read them (`Direction`).
template <typename T>
Direction<T> direction(const std::optional<Tensor>& tq, const std::optional<Tensor>& tk,
                       const std::optional<Tensor>& tv, const std::optional<Tensor>& tbias,
                       const std::optional<Tensor>& tdiagonal) {
  Direction<T> dir;
  dir.diagonal = tdiagonal ? tdiagonal->data_ptr<T>() : nullptr;
  dir.q = tq ? tq->data_ptr<T>() : nullptr;
  dir.k = tk.has_value();
  dir.v = tv ? tv->data_ptr<T>() : nullptr;
  if (tbias) {
    dir.bias = tbias->data_ptr<T>();
    for (int a = 0; a < 4; ++a) dir.sb[a] = tbias->stride(a);
  }
  return dir;
}

// A score program for the forward-mode ops: its forward program and its backward one
// (whose GRAD = 1 gives the slope f'(x)), given together or not at all.
std::pair<std::optional<Program>, std::optional<Program>> slope_programs(
    const Tensor& q, const std::optional<Tensor>& code, const std::optional<Tensor>& constants,
    const std::optional<Tensor>& indices, int64_t out, std::optional<at::TensorList> captured,
    int64_t batch, const std::optional<Tensor>& grad_code,
    const std::optional<Tensor>& grad_constants, const std::optional<Tensor>& grad_indices,
    int64_t grad_out) {
  TORCH_CHECK_VALUE(code.has_value() == grad_code.has_value(), "attngrad_fused: forward mode ",
                    "takes a score program's code and grad_code together (grad_code: its ",
                    "backward program, for its slope), got ", code ? "code alone" : "grad_code alone");
  return {program_of("code", q, code, constants, indices, out, captured, batch, Role::kForward),
          program_of("grad_code", q, grad_code, grad_constants, grad_indices, grad_out, captured,
                     batch, Role::kBackward)};
}

// Both forward-mode ops (`tangent.h`): with forward's o and stats, the tangent pass after
// autograd's forward; without them (nullopt), the one pass, which makes O and the
// statistics too.  Returns (O, stats, O', lse'); O and stats undefined in the tangent pass.
std::tuple<Tensor, Tensor, Tensor, Tensor> forward_mode(
    const Tensor& q, const Tensor& k, const Tensor& v, const std::optional<Tensor>& o_in,
    const std::optional<Tensor>& stats_in, const std::optional<Tensor>& tq,
    const std::optional<Tensor>& tk, const std::optional<Tensor>& tv,
    const std::optional<Tensor>& tbias,
    const std::optional<Tensor>& bias, const std::optional<Tensor>& keep,
    const std::optional<Tensor>& lo, const std::optional<Tensor>& hi,
    const std::optional<Tensor>& row_words, const std::optional<Tensor>& col_words, double scale,
    double cap, int64_t threshold, double keep_scale, int64_t block_q, int64_t block_k,
    int64_t engine, const std::optional<Tensor>& mask_code,
    const std::optional<Tensor>& mask_constants, const std::optional<Tensor>& mask_indices,
    int64_t mask_out, std::optional<at::TensorList> mask_captured, int64_t mask_batch,
    const std::optional<Tensor>& status, int64_t mask_block_q, int64_t mask_block_k,
    const std::optional<Tensor>& diagonal, const std::optional<Tensor>& tdiagonal,
    const std::optional<Tensor>& code, const std::optional<Tensor>& constants,
    const std::optional<Tensor>& indices, int64_t out, std::optional<at::TensorList> captured,
    int64_t batch, const std::optional<Tensor>& grad_code,
    const std::optional<Tensor>& grad_constants, const std::optional<Tensor>& grad_indices,
    int64_t grad_out) {
  check_inputs(q, k, v, block_q, block_k, engine);
  check_mask(q, k, bias, keep, lo, hi, row_words, col_words);
  check_tangents(q, k, v, tq, tk, tv, tbias, diagonal, tdiagonal);
  check_blocks(q, k, status, mask_code, mask_block_q, mask_block_k);
  check_diagonal(q, k, code, diagonal);
  const auto [program, grad_program] =
      slope_programs(q, code, constants, indices, out, captured, batch, grad_code,
                     grad_constants, grad_indices, grad_out);
  const bool one_pass = !o_in.has_value();
  const Tensor out_like = at::empty({q.size(0), q.size(1), q.size(2), v.size(3)}, q.options());
  if (!one_pass) {
    check_like(o_in, "o", out_like);
    check_optional(stats_in, "stats", q.scalar_type(), 2 * q.size(0) * q.size(1) * q.size(2));
  }
  const std::optional<Program> mask =
      program_of("mask_code", q, mask_code, mask_constants, mask_indices, mask_out,
                 mask_captured, mask_batch, Role::kMask);
  Tensor o = one_pass ? at::empty_like(out_like) : Tensor();
  Tensor stats = one_pass ? at::empty({q.size(0), q.size(1), q.size(2), 2}, q.options()) : Tensor();
  Tensor dout = at::empty_like(out_like);
  Tensor dlse = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "attngrad_fused::forward_mode", [&] {
    // k'^T below k^T in each key block's panel: one product of inner dim 2d forms S'
    const Tensor kt = panels<scalar_t>(k, block_k, tk);
    auto pb = problem<scalar_t>(q, k, v, bias, keep, lo, hi, row_words, col_words, scale, cap,
                                threshold, keep_scale, block_q, block_k);
    read_blocks(pb, status, mask, mask_block_q, mask_block_k);
    pb.diagonal = diagonal ? diagonal->data_ptr<scalar_t>() : nullptr;
    pb.program = program ? &*program : nullptr;
    pb.grad_program = grad_program ? &*grad_program : nullptr;
    const TangentOperands<scalar_t> x{
        q.data_ptr<scalar_t>(), kt.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
        one_pass ? nullptr : o_in->data_ptr<scalar_t>(),
        one_pass ? nullptr : stats_in->data_ptr<scalar_t>(), kt.size(3)};
    const Direction<scalar_t> dir = direction<scalar_t>(tq, tk, tv, tbias, tdiagonal);
    if (one_pass)
      forward_tangent_pass<scalar_t>(pb, static_cast<Engine>(engine), x, dir,
                                     o.data_ptr<scalar_t>(), stats.data_ptr<scalar_t>(),
                                     dout.data_ptr<scalar_t>(), dlse.data_ptr<scalar_t>());
    else
      tangent_pass<scalar_t>(pb, static_cast<Engine>(engine), x, dir,
                             dout.data_ptr<scalar_t>(), dlse.data_ptr<scalar_t>());
  });
  return {o, stats, dout, dlse};
}

// Forward mode (`tangent.h`): O' [B, Hq, Nq, dv] and lse' [B, Hq, Nq] along the tangents
// tq, tk, tv (like q, k, v), tbias (like bias, at the scores' shape) and tdiagonal (like
// the diagonal term D), None for zero; o and stats are the forward's.  The mask arguments,
// D and a score program as forward's, with the program's backward one (grad_code) for its
// slope; no tangent of its captured tensors.
std::tuple<Tensor, Tensor> tangent(
    const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o, const Tensor& stats,
    const std::optional<Tensor>& tq, const std::optional<Tensor>& tk,
    const std::optional<Tensor>& tv, const std::optional<Tensor>& tbias,
    const std::optional<Tensor>& bias, const std::optional<Tensor>& keep,
    const std::optional<Tensor>& lo, const std::optional<Tensor>& hi,
    const std::optional<Tensor>& row_words, const std::optional<Tensor>& col_words, double scale,
    double cap, int64_t threshold, double keep_scale, int64_t block_q, int64_t block_k,
    int64_t engine, const std::optional<Tensor>& mask_code,
    const std::optional<Tensor>& mask_constants, const std::optional<Tensor>& mask_indices,
    int64_t mask_out, std::optional<at::TensorList> mask_captured, int64_t mask_batch,
    const std::optional<Tensor>& status, int64_t mask_block_q, int64_t mask_block_k,
    const std::optional<Tensor>& diagonal, const std::optional<Tensor>& tdiagonal,
    const std::optional<Tensor>& code, const std::optional<Tensor>& constants,
    const std::optional<Tensor>& indices, int64_t out, std::optional<at::TensorList> captured,
    int64_t batch, const std::optional<Tensor>& grad_code,
    const std::optional<Tensor>& grad_constants, const std::optional<Tensor>& grad_indices,
    int64_t grad_out) {
  auto [o_, stats_, dout, dlse] = forward_mode(
      q, k, v, o, stats, tq, tk, tv, tbias, bias, keep, lo, hi, row_words, col_words, scale, cap, threshold,
      keep_scale, block_q, block_k, engine, mask_code, mask_constants, mask_indices, mask_out,
      mask_captured, mask_batch, status, mask_block_q, mask_block_k, diagonal, tdiagonal, code,
      constants, indices, out, captured, batch, grad_code, grad_constants, grad_indices,
      grad_out);
  return {dout, dlse};
}

// Forward mode in one pass (`tangent.h`, `forward_tangent_pass`): (O, stats) as `forward`
// returns them, bit for bit, and (O', lse') as `tangent` does, from one walk over the key
// tiles.  Arguments as `tangent`'s, without o and stats.
std::tuple<Tensor, Tensor, Tensor, Tensor> forward_tangent(
    const Tensor& q, const Tensor& k, const Tensor& v, const std::optional<Tensor>& tq,
    const std::optional<Tensor>& tk, const std::optional<Tensor>& tv,
    const std::optional<Tensor>& tbias,
    const std::optional<Tensor>& bias, const std::optional<Tensor>& keep,
    const std::optional<Tensor>& lo, const std::optional<Tensor>& hi,
    const std::optional<Tensor>& row_words, const std::optional<Tensor>& col_words, double scale,
    double cap, int64_t threshold, double keep_scale, int64_t block_q, int64_t block_k,
    int64_t engine, const std::optional<Tensor>& mask_code,
    const std::optional<Tensor>& mask_constants, const std::optional<Tensor>& mask_indices,
    int64_t mask_out, std::optional<at::TensorList> mask_captured, int64_t mask_batch,
    const std::optional<Tensor>& status, int64_t mask_block_q, int64_t mask_block_k,
    const std::optional<Tensor>& diagonal, const std::optional<Tensor>& tdiagonal,
    const std::optional<Tensor>& code, const std::optional<Tensor>& constants,
    const std::optional<Tensor>& indices, int64_t out, std::optional<at::TensorList> captured,
    int64_t batch, const std::optional<Tensor>& grad_code,
    const std::optional<Tensor>& grad_constants, const std::optional<Tensor>& grad_indices,
    int64_t grad_out) {
  return forward_mode(q, k, v, std::nullopt, std::nullopt, tq, tk, tv, tbias, bias, keep, lo, hi, row_words, col_words, scale, cap, threshold,
      keep_scale, block_q, block_k, engine, mask_code, mask_constants, mask_indices, mask_out,
      mask_captured, mask_batch, status, mask_block_q, mask_block_k, diagonal, tdiagonal, code,
      constants, indices, out, captured, batch, grad_code, grad_constants, grad_indices,
      grad_out);
}

// The second-order pass (`second.h`): for the cotangents gq, gk, gv (like q, k, v), gbias
// (like bias, at the scores' shape) and gdiagonal (like the diagonal term D) of the first
// order's gradients, None for zero, the gradients of their inner product with (dq, dk, dv,
// dbias, dD) with respect to (dout, dlse, q, k, v, bias, D): (grad dout, grad dlse = r,
// grad q, grad k, grad v, S-hat at the scores' shape [B, Hq, Nq, Nk], and dS's and
// S-hat's sums along D's diagonals), then the first walk's row sums [B, Hq, Nq, ROW_SUMS]
// over these keys, each an empty [0] tensor where `need` (eight flags in that order; the
// seventh for both diagonal sums) says no; with only the row sums wanted the pass stops
// after its first walk.  dlse: lse's cotangent or None; sums: the row sums over every key
// (like the last output) where these keys are only some of them, or None.  The mask
// arguments and D as forward's; no score program.
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> second(
    const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& stats,
    const std::optional<Tensor>& dlse, const std::optional<Tensor>& gq,
    const std::optional<Tensor>& gk, const std::optional<Tensor>& gv,
    const std::optional<Tensor>& gbias, const std::optional<Tensor>& bias,
    const std::optional<Tensor>& keep, const std::optional<Tensor>& lo,
    const std::optional<Tensor>& hi, const std::optional<Tensor>& row_words,
    const std::optional<Tensor>& col_words, double scale, double cap, int64_t threshold,
    double keep_scale, int64_t block_q, int64_t block_k, int64_t engine,
    const c10::List<bool>& need, const std::optional<Tensor>& mask_code,
    const std::optional<Tensor>& mask_constants, const std::optional<Tensor>& mask_indices,
    int64_t mask_out, std::optional<at::TensorList> mask_captured, int64_t mask_batch,
    const std::optional<Tensor>& status, int64_t mask_block_q, int64_t mask_block_k,
    const std::optional<Tensor>& diagonal, const std::optional<Tensor>& gdiagonal,
    const std::optional<Tensor>& sums) {
  check_inputs(q, k, v, block_q, block_k, engine);
  check_mask(q, k, bias, keep, lo, hi, row_words, col_words);
  check_tangents(q, k, v, gq, gk, gv, gbias, diagonal, gdiagonal, "g");
  check_blocks(q, k, status, mask_code, mask_block_q, mask_block_k);
  TORCH_CHECK_VALUE(need.size() == 8, "attngrad_fused: need must have 8 flags (dout, dlse, q, ",
                    "k, v, bias, diagonal, sums), got ", need.size());
  TORCH_CHECK_VALUE(diagonal || !need.get(6), "attngrad_fused: need[6] (the diagonal sums) ",
                    "without a diagonal");
  const int64_t rows = q.size(0) * q.size(1) * q.size(2);
  const Tensor out_like = at::empty({q.size(0), q.size(1), q.size(2), v.size(3)}, q.options());
  check_like(dout, "dout", out_like);
  check_optional(stats, "stats", q.scalar_type(), 2 * rows);
  check_optional(dlse, "dlse", q.scalar_type(), rows);
  check_optional(sums, "sums", q.scalar_type(), ROW_SUMS * rows);
  const std::optional<Program> mask =
      program_of("mask_code", q, mask_code, mask_constants, mask_indices, mask_out,
                 mask_captured, mask_batch, Role::kMask);
  auto wanted = [&](int n, at::IntArrayRef shape) {
    return need.get(n) ? at::empty(shape, q.options()) : at::empty({0}, q.options());
  };
  Tensor g_dout = wanted(0, out_like.sizes()), r = wanted(1, {q.size(0), q.size(1), q.size(2)});
  Tensor g_q = wanted(2, q.sizes()), g_k = wanted(3, k.sizes()), g_v = wanted(4, v.sizes());
  Tensor s_hat = need.get(5) ? at::zeros({q.size(0), q.size(1), q.size(2), k.size(2)}, q.options())
                             : at::empty({0}, q.options());
  Tensor dd = need.get(6) ? at::empty_like(*diagonal) : at::empty({0}, q.options());
  Tensor dd_hat = need.get(6) ? at::empty_like(*diagonal) : at::empty({0}, q.options());
  Tensor sums_out = wanted(7, {q.size(0), q.size(1), q.size(2), ROW_SUMS});
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "attngrad_fused::second", [&] {
    using T = scalar_t;
    const Tensor kt = panels<T>(k, block_k, gk);  // g_k^T below k^T, as forward mode's k'^T
    const Tensor vt = panels<T>(v, block_k);
    const Tensor gvt = gv ? panels<T>(*gv, block_k) : Tensor();
    auto pb = problem<T>(q, k, v, bias, keep, lo, hi, row_words, col_words, scale, cap,
                         threshold, keep_scale, block_q, block_k);
    read_blocks(pb, status, mask, mask_block_q, mask_block_k);
    pb.diagonal = diagonal ? diagonal->data_ptr<T>() : nullptr;
    auto ptr = [](const std::optional<Tensor>& t) -> const T* {
      return t ? t->data_ptr<T>() : nullptr;
    };
    const SecondOperands<T> x{q.data_ptr<T>(), k.data_ptr<T>(), ptr(gk), v.data_ptr<T>(),
                              ptr(gv), dout.data_ptr<T>(), stats.data_ptr<T>(), ptr(dlse),
                              kt.data_ptr<T>(), vt.data_ptr<T>(),
                              gv ? gvt.data_ptr<T>() : nullptr, kt.size(3), ptr(sums)};
    auto into = [](Tensor& t) -> T* { return t.numel() > 0 ? t.data_ptr<T>() : nullptr; };
    SecondOutputs<T> out;
    out.dout = need.get(0) ? into(g_dout) : nullptr;
    out.r = need.get(1) ? into(r) : nullptr;
    out.q = need.get(2) ? into(g_q) : nullptr;
    out.k = need.get(3) ? into(g_k) : nullptr;
    out.v = need.get(4) ? into(g_v) : nullptr;
    out.s_hat = need.get(5) ? into(s_hat) : nullptr;
    out.dd = need.get(6) ? into(dd) : nullptr;
    out.dd_hat = need.get(6) ? into(dd_hat) : nullptr;
    out.sums = need.get(7) ? into(sums_out) : nullptr;
    second_pass<T>(pb, static_cast<Engine>(engine), x,
                   direction<T>(gq, gk, gv, gbias, gdiagonal), out);
  });
  return {g_dout, r, g_q, g_k, g_v, s_hat, dd, dd_hat, sums_out};
}

// dcaptured: one tensor per captured one, its shape in the compute dtype where wanted (and a
// backward program runs), else an empty [0] tensor.
std::vector<Tensor> captured_gradients(const Program* grad_program,
                                       const std::optional<c10::List<bool>>& wanted,
                                       const at::TensorOptions& options, int64_t count) {
  const int64_t given = wanted ? static_cast<int64_t>(wanted->size()) : 0;
  TORCH_CHECK_VALUE(given == 0 || given == count, "attngrad_fused: wanted must have one flag per ",
                    "captured tensor (", count, "), got ", given);
  std::vector<Tensor> out;
  for (int64_t a = 0; a < count; ++a) {
    if (!grad_program || given == 0 || !wanted->get(a)) {
      out.push_back(at::empty({0}, options));
      continue;
    }
    const Capture& cap = grad_program->captured[a];
    TORCH_CHECK_TYPE(cap.t.scalar_type() == options.dtype().toScalarType(), "attngrad_fused: ",
                     "the gradient of captured tensor ", a, " is wanted, so it must be in the ",
                     "compute dtype ", options.dtype(), ", got ", cap.t.scalar_type());
    out.push_back(at::zeros(cap.t.sizes(), options));
  }
  return out;
}

std::tuple<Tensor, Tensor, Tensor, Tensor, std::vector<Tensor>, Tensor> backward(
    const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& stats,
    const Tensor& delta, const std::optional<Tensor>& bias, const std::optional<Tensor>& keep,
    const std::optional<Tensor>& lo, const std::optional<Tensor>& hi,
    const std::optional<Tensor>& row_words, const std::optional<Tensor>& col_words, double scale,
    double cap, int64_t threshold, double keep_scale, int64_t block_q, int64_t block_k,
    int64_t engine, bool need_ds, const std::optional<Tensor>& code,
    const std::optional<Tensor>& constants, const std::optional<Tensor>& indices, int64_t out,
    std::optional<at::TensorList> captured, int64_t batch, const std::optional<Tensor>& grad_code,
    const std::optional<Tensor>& grad_constants, const std::optional<Tensor>& grad_indices,
    int64_t grad_out, const std::optional<c10::List<bool>>& wanted,
    const std::optional<Tensor>& diagonal, bool need_ddiagonal,
    const std::optional<Tensor>& mask_code, const std::optional<Tensor>& mask_constants,
    const std::optional<Tensor>& mask_indices, int64_t mask_out,
    std::optional<at::TensorList> mask_captured, int64_t mask_batch,
    const std::optional<Tensor>& status, int64_t mask_block_q, int64_t mask_block_k) {
  check_inputs(q, k, v, block_q, block_k, engine);
  check_mask(q, k, bias, keep, lo, hi, row_words, col_words);
  check_diagonal(q, k, code, diagonal);
  check_blocks(q, k, status, mask_code, mask_block_q, mask_block_k);
  TORCH_CHECK_VALUE(diagonal || !need_ddiagonal, "attngrad_fused: need_ddiagonal without a ",
                    "diagonal");
  TORCH_CHECK_VALUE(code.has_value() == grad_code.has_value(), "attngrad_fused: backward takes ",
                    "a score program's code and grad_code together (grad_code: its backward ",
                    "program), got ", code ? "code alone" : "grad_code alone");
  const std::optional<Program> program =
      program_of("code", q, code, constants, indices, out, captured, batch, Role::kForward);
  const std::optional<Program> grad_program =
      program_of("grad_code", q, grad_code, grad_constants, grad_indices, grad_out, captured,
                 batch, Role::kBackward);
  const std::optional<Program> mask =
      program_of("mask_code", q, mask_code, mask_constants, mask_indices, mask_out,
                 mask_captured, mask_batch, Role::kMask);
  const int64_t count = captured ? static_cast<int64_t>(captured->size()) : 0;
  std::vector<Tensor> dcaptured =
      captured_gradients(grad_program ? &*grad_program : nullptr, wanted, q.options(), count);
  const int64_t rows = q.size(0) * q.size(1) * q.size(2);
  TORCH_CHECK_VALUE(dout.sizes() == at::IntArrayRef({q.size(0), q.size(1), q.size(2), v.size(3)}) &&
                        dout.is_contiguous() && dout.scalar_type() == q.scalar_type(),
                    "attngrad_fused: dout must be contiguous [B, Hq, Nq, dv] in q's dtype, got ",
                    dout.sizes());
  check_optional(stats, "stats", q.scalar_type(), 2 * rows);
  check_optional(delta, "delta", q.scalar_type(), rows);
  Tensor dq = at::empty_like(q), dk = at::empty_like(k), dv = at::empty_like(v);
  Tensor ds = need_ds ? at::zeros({q.size(0), q.size(1), q.size(2), k.size(2)}, q.options())
                      : at::empty({0}, q.options());
  Tensor ddiagonal = need_ddiagonal ? at::empty_like(*diagonal) : at::empty({0}, q.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "attngrad_fused::backward", [&] {
    auto pb = problem<scalar_t>(q, k, v, bias, keep, lo, hi, row_words, col_words, scale, cap,
                                threshold, keep_scale, block_q, block_k);
    Operands<scalar_t> x{q.data_ptr<scalar_t>(),    k.data_ptr<scalar_t>(),
                         v.data_ptr<scalar_t>(),    dout.data_ptr<scalar_t>(),
                         stats.data_ptr<scalar_t>(), delta.data_ptr<scalar_t>()};
    pb.program = program ? &*program : nullptr;
    pb.grad_program = grad_program ? &*grad_program : nullptr;
    pb.diagonal = diagonal ? diagonal->data_ptr<scalar_t>() : nullptr;
    read_blocks(pb, status, mask, mask_block_q, mask_block_k);
    std::vector<scalar_t*> into;
    for (Tensor& t : dcaptured) into.push_back(t.numel() > 0 ? t.data_ptr<scalar_t>() : nullptr);
    backward_pass<scalar_t>(pb, static_cast<Engine>(engine), x, dq.data_ptr<scalar_t>(),
                            dk.data_ptr<scalar_t>(), dv.data_ptr<scalar_t>(),
                            need_ds ? ds.data_ptr<scalar_t>() : nullptr, into,
                            need_ddiagonal ? ddiagonal.data_ptr<scalar_t>() : nullptr);
  });
  return {dq, dk, dv, ds, dcaptured, ddiagonal};
}

// The test op: a program on every row (b, h, i) of scores [B, H, Nq, Nk] over all Nk
// columns (kv_idx = the column), one thread, rows in order: the outputs [B, H, Nq, Nk] and,
// with `grad` (a backward program: GRAD = grad's row), the captured tensors' gradients
// (empty [0] where not wanted).  No mask: any out-of-bounds index raises IndexError.
std::tuple<Tensor, std::vector<Tensor>> program_rows(
    const Tensor& code, const Tensor& constants, const Tensor& indices, int64_t out,
    at::TensorList captured, const Tensor& scores, const std::optional<Tensor>& grad,
    int64_t batch, const c10::List<bool>& wanted) {
  TORCH_CHECK_VALUE(scores.dim() == 4 && scores.device().is_cpu(), "attngrad_fused: scores must ",
                    "be a CPU [B, H, Nq, Nk] tensor, got shape ", scores.sizes());
  TORCH_CHECK_TYPE(scores.scalar_type() == at::kFloat || scores.scalar_type() == at::kDouble,
                   "attngrad_fused: scores must be float32 or float64, got ",
                   scores.scalar_type());
  if (grad)
    TORCH_CHECK_VALUE(grad->sizes() == scores.sizes() &&
                          grad->scalar_type() == scores.scalar_type() && grad->device().is_cpu(),
                      "attngrad_fused: grad must be a CPU tensor like scores (", scores.sizes(),
                      ", ", scores.scalar_type(), "), got ", grad->sizes(), ", ",
                      grad->scalar_type());
  const Program pg = make_program(grad ? "grad_code" : "code", code, constants, indices, out,
                                  captured, batch, scores.scalar_type(),
                                  grad ? Role::kBackward : Role::kForward);
  const std::optional<c10::List<bool>> flags(wanted);
  std::vector<Tensor> dcaptured = captured_gradients(
      grad ? &pg : nullptr, flags, scores.options(), static_cast<int64_t>(captured.size()));
  const Tensor s = scores.contiguous();
  const Tensor g = grad ? grad->contiguous() : Tensor();
  Tensor result = at::empty(s.sizes(), s.options());
  const int64_t B = s.size(0), H = s.size(1), Nq = s.size(2), Nk = s.size(3);
  AT_DISPATCH_FLOATING_TYPES(s.scalar_type(), "attngrad_fused::program_rows", [&] {
    Runner<scalar_t> run(pg, Nk);
    for (size_t a = 0; a < dcaptured.size(); ++a)
      if (dcaptured[a].numel() > 0) run.dcaptured[a] = dcaptured[a].data_ptr<scalar_t>();
    if (Nk == 0) return;
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t i = 0; i < Nq; ++i) {
          const int64_t row = ((b * H + h) * Nq + i) * Nk;
          const scalar_t* score = s.data_ptr<scalar_t>() + row;
          const scalar_t* gr = grad ? g.data_ptr<scalar_t>() + row : nullptr;
          scalar_t* dest = result.data_ptr<scalar_t>() + row;
          const scalar_t* o = run.run(b, h, i, 0, Nk, score, gr, dest);
          for (const auto& e : run.oob)
            TORCH_CHECK_INDEX(false, run.describe(e, b, h, i, e.column < 0 ? 0 : e.column));
          if (o != dest) std::copy(o, o + Nk, dest);
        }
  });
  return {result, dcaptured};
}

// The score programs' op names, in opcode order (`program.h`).
std::vector<std::string> program_ops() { return program_op_names(); }

// GFLOP/s of `reps` products [m, k] x [k, n] on one thread through `engine` (float32).
double product_rate(int64_t engine, int64_t m, int64_t n, int64_t k, int64_t reps) {
  Buffer<float> a(m * k, 0.5f), b(k * n, 0.25f), c(m * n, 0.0f);
  const Engine e = static_cast<Engine>(engine);
  product(e, m, n, k, a.data(), k, b.data(), n, c.data(), n, false);  // warm up, JIT
  auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < reps; ++i)
    product(e, m, n, k, a.data(), k, b.data(), n, c.data(), n, true);
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  release(e);
  return 2.0 * m * n * k * reps / seconds / 1e9;
}

}  // namespace

TORCH_LIBRARY(attngrad_fused, m) {
  m.def(
      "forward(Tensor q, Tensor k, Tensor v, Tensor? bias, Tensor? keep, Tensor? lo, Tensor? hi, "
      "Tensor? row_words, Tensor? col_words, float scale, float cap, int threshold, "
      "float keep_scale, int block_q, int block_k, int engine, Tensor? code=None, "
      "Tensor? constants=None, Tensor? indices=None, int out=-1, Tensor[]? captured=None, "
      "int batch=1, Tensor? diagonal=None, Tensor? mask_code=None, Tensor? mask_constants=None, "
      "Tensor? mask_indices=None, int mask_out=-1, Tensor[]? mask_captured=None, "
      "int mask_batch=1, Tensor? status=None, int mask_block_q=1, int mask_block_k=1) "
      "-> (Tensor, Tensor)");
  m.def(
      "backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor stats, Tensor delta, "
      "Tensor? bias, Tensor? keep, Tensor? lo, Tensor? hi, Tensor? row_words, Tensor? col_words, "
      "float scale, float cap, int threshold, float keep_scale, int block_q, int block_k, "
      "int engine, bool need_ds, Tensor? code=None, Tensor? constants=None, "
      "Tensor? indices=None, int out=-1, Tensor[]? captured=None, int batch=1, "
      "Tensor? grad_code=None, Tensor? grad_constants=None, Tensor? grad_indices=None, "
      "int grad_out=-1, bool[]? wanted=None, Tensor? diagonal=None, bool need_ddiagonal=False, "
      "Tensor? mask_code=None, Tensor? mask_constants=None, Tensor? mask_indices=None, "
      "int mask_out=-1, Tensor[]? mask_captured=None, int mask_batch=1, Tensor? status=None, "
      "int mask_block_q=1, int mask_block_k=1) "
      "-> (Tensor, Tensor, Tensor, Tensor, Tensor[], Tensor)");
  m.def(
      "tangent(Tensor q, Tensor k, Tensor v, Tensor o, Tensor stats, Tensor? tq, Tensor? tk, "
      "Tensor? tv, Tensor? tbias, Tensor? bias, Tensor? keep, Tensor? lo, Tensor? hi, "
      "Tensor? row_words, Tensor? col_words, float scale, float cap, int threshold, "
      "float keep_scale, int block_q, int block_k, int engine, Tensor? mask_code=None, "
      "Tensor? mask_constants=None, Tensor? mask_indices=None, int mask_out=-1, "
      "Tensor[]? mask_captured=None, int mask_batch=1, Tensor? status=None, "
      "int mask_block_q=1, int mask_block_k=1, Tensor? diagonal=None, Tensor? tdiagonal=None, "
      "Tensor? code=None, Tensor? constants=None, Tensor? indices=None, int out=-1, "
      "Tensor[]? captured=None, int batch=1, Tensor? grad_code=None, "
      "Tensor? grad_constants=None, Tensor? grad_indices=None, int grad_out=-1) "
      "-> (Tensor, Tensor)");
  m.def(
      "forward_tangent(Tensor q, Tensor k, Tensor v, Tensor? tq, Tensor? tk, Tensor? tv, "
      "Tensor? tbias, Tensor? bias, Tensor? keep, Tensor? lo, Tensor? hi, Tensor? row_words, "
      "Tensor? col_words, float scale, float cap, int threshold, float keep_scale, int block_q, "
      "int block_k, int engine, Tensor? mask_code=None, Tensor? mask_constants=None, "
      "Tensor? mask_indices=None, int mask_out=-1, Tensor[]? mask_captured=None, "
      "int mask_batch=1, Tensor? status=None, int mask_block_q=1, int mask_block_k=1, "
      "Tensor? diagonal=None, Tensor? tdiagonal=None, "
      "Tensor? code=None, Tensor? constants=None, Tensor? indices=None, int out=-1, "
      "Tensor[]? captured=None, int batch=1, Tensor? grad_code=None, "
      "Tensor? grad_constants=None, Tensor? grad_indices=None, int grad_out=-1) "
      "-> (Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "second(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor stats, Tensor? dlse, "
      "Tensor? gq, Tensor? gk, Tensor? gv, Tensor? gbias, Tensor? bias, Tensor? keep, "
      "Tensor? lo, Tensor? hi, Tensor? row_words, Tensor? col_words, float scale, float cap, "
      "int threshold, float keep_scale, int block_q, int block_k, int engine, bool[] need, "
      "Tensor? mask_code=None, Tensor? mask_constants=None, Tensor? mask_indices=None, "
      "int mask_out=-1, Tensor[]? mask_captured=None, int mask_batch=1, Tensor? status=None, "
      "int mask_block_q=1, int mask_block_k=1, Tensor? diagonal=None, Tensor? gdiagonal=None, "
      "Tensor? sums=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, "
      "Tensor)");
  m.def(
      "program_rows(Tensor code, Tensor constants, Tensor indices, int out, Tensor[] captured, "
      "Tensor scores, Tensor? grad, int batch, bool[] wanted) -> (Tensor, Tensor[])");
  m.def("program_ops() -> str[]", &program_ops);
  m.def("product_rate(int engine, int m, int n, int k, int reps) -> float", &product_rate);
  m.def("fma_peak(int reps, bool threads) -> float", &fma_peak);
}

TORCH_LIBRARY_IMPL(attngrad_fused, CPU, m) {
  m.impl("forward", &forward);
  m.impl("backward", &backward);
  m.impl("tangent", &tangent);
  m.impl("forward_tangent", &forward_tangent);
  m.impl("second", &second);
  m.impl("program_rows", &program_rows);
}

}  // namespace attngrad_fused
