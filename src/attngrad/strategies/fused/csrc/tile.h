// One tile of scores, in cache: the steps every pass runs between its products.
//
// A tile is S[r, c] for query rows i0 .. i0 + r of head (b, h) against keys
// j0 .. j0 + c, row-major with leading dimension ld.  `mask_tile` caps, runs the
// score program (`program.h`), biases and masks it exactly as
// `attngrad.core.scores.ScoreMods.apply_` does (same order: softcap, score_mod,
// diagonal term, bias, bool mask, BlockMask, band); every pass calls it on the same
// product, so backward's scores are bit for bit forward's.  `keeps` is the dropout hash
// of `attngrad.core.dropout`, finished per score.
//
// A BlockMask that is no band arrives as its blocks' status and its mask_mod compiled
// (`Problem::status`, `Problem::mask_program`), read per row and key block whatever the
// tiles' sizes: an empty block masks its scores, a full one keeps them, a partial one runs
// the mask program on its segment of the row (`mask_blocks`).  No [Nq, Nk] keep is made.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <type_traits>
#include <new>
#include <vector>

#include "elementary.h"
#include "program.h"

namespace attngrad_fused {

// Scratch on 64-byte boundaries, like ATen's own buffers: a product then sees the same
// alignment in every pass and on every thread (a BLAS may take another path for another one).
template <typename T>
struct Aligned {
  using value_type = T;
  Aligned() = default;
  template <typename U>
  Aligned(const Aligned<U>&) {}
  T* allocate(std::size_t n) {
    void* p = std::aligned_alloc(64, ((n * sizeof(T) + 63) / 64) * 64);
    if (p == nullptr) throw std::bad_alloc();
    return static_cast<T*>(p);
  }
  void deallocate(T* p, std::size_t) { std::free(p); }
  template <typename U>
  bool operator==(const Aligned<U>&) const { return true; }
  template <typename U>
  bool operator!=(const Aligned<U>&) const { return false; }
};

template <typename T>
using Buffer = std::vector<T, Aligned<T>>;

// A BlockMask's block statuses (`attngrad.core.block_table`).
constexpr uint8_t kEmpty = 0, kPartial = 1, kFull = 2;

// The call: sizes, the score modifiers and the tiles, as the ops receive them.
template <typename T>
struct Problem {
  int64_t B, Hq, Hkv, G, Nq, Nk, d, dv;
  int64_t block_q, block_k;
  T scale, cap;           // cap = 0: no softcap
  T keep_scale;           // 1 / (1 - p) with dropout, else 1
  int32_t threshold;      // dropout keeps a score where its hash y < threshold
  const T* bias = nullptr;  // [B, Hq, Nq, Nk] through strides (0 where broadcast)
  int64_t sb[4] = {0, 0, 0, 0};
  const bool* keep = nullptr;  // likewise, true where a score is kept
  int64_t sk[4] = {0, 0, 0, 0};
  const int64_t* lo = nullptr;  // band: query i attends keys lo[i] <= j < hi[i]
  const int64_t* hi = nullptr;
  const int32_t* row_words = nullptr;  // dropout: [B * Hq, Nq] and [Nk]
  const int32_t* col_words = nullptr;
  const Program* program = nullptr;       // the score_mod's forward program, or none
  const Program* grad_program = nullptr;  // its backward program (the backward op's)
  // A relative score_mod, S' = S + t(b, h, i - j), as its term along the diagonals:
  // D[b, h, j - i + Nq - 1] = t(b, h, i - j), [B, Hq, Nq + Nk - 1] contiguous, or none.
  const T* diagonal = nullptr;
  // A BlockMask read by blocks: status [Bm, Hm, QB, KB] uint8 contiguous (kEmpty, kPartial,
  // kFull) of blocks of mask_bq x mask_bk scores, b and h read modulo Bm and Hm, and the
  // mask program run on partial blocks; or none.
  const uint8_t* status = nullptr;
  int64_t status_b = 1, status_h = 1, status_q = 0, status_k = 0;
  int64_t mask_bq = 1, mask_bk = 1;
  const Program* mask_program = nullptr;

  // The statuses of the key blocks of row i of head (b, h).
  const uint8_t* block_row(int64_t b, int64_t h, int64_t i) const {
    const int64_t bh = (b % status_b) * status_h + h % status_h;
    return status + (bh * status_q + i / mask_bq) * status_k;
  }

  // Whether the BlockMask masks every score of rows i0 .. i1 against keys j0 .. j1 of head
  // (b, h): then no pass computes the tile (every P of it is 0).
  bool tile_empty(int64_t b, int64_t h, int64_t i0, int64_t i1, int64_t j0, int64_t j1) const {
    if (status == nullptr) return false;
    for (int64_t qb = i0 / mask_bq; qb <= (i1 - 1) / mask_bq; ++qb) {
      const uint8_t* row = block_row(b, h, qb * mask_bq);
      for (int64_t kb = j0 / mask_bk; kb <= (j1 - 1) / mask_bk; ++kb)
        if (row[kb] != kEmpty) return false;
    }
    return true;
  }

  int64_t diagonals() const { return Nq + Nk - 1; }
  // D's entries for row (b, h, i), keys j0 .. : ascending with j.
  const T* diagonal_row(int64_t b, int64_t h, int64_t i, int64_t j0) const {
    return diagonal + (b * Hq + h) * diagonals() + (j0 - i + Nq - 1);
  }

  int64_t row_blocks() const { return (Nq + block_q - 1) / block_q; }
  int64_t key_blocks() const { return (Nk + block_k - 1) / block_k; }

  // Unit u of a pass by blocks of query rows (forward, tangent) -> (b, kv head, block),
  // blocks in reverse order (the band's longest rows first).
  void row_unit(int64_t u, int64_t& b, int64_t& hk, int64_t& blk) const {
    blk = row_blocks() - 1 - u % row_blocks();
    hk = (u / row_blocks()) % Hkv;
    b = u / (row_blocks() * Hkv);
  }

  // [first, stop) of the key blocks that rows i0 .. i1 reach (the band's span, aligned).
  void key_block_span(int64_t i0, int64_t i1, int64_t& first, int64_t& stop) const {
    int64_t c0 = 0, c1 = Nk;
    if (lo != nullptr) {
      c0 = Nk;
      c1 = 0;
      for (int64_t i = i0; i < i1; ++i) {
        if (lo[i] >= hi[i]) continue;  // a row that attends nothing
        c0 = std::min(c0, lo[i]);
        c1 = std::max(c1, hi[i]);
      }
    }
    if (c0 >= c1) {
      first = stop = 0;
      return;
    }
    first = c0 / block_k;
    stop = (c1 + block_k - 1) / block_k;
  }

  // The tile of rows i0 .. i1 against keys j0 .. j0 + c, narrowed to the columns [j0 + a,
  // j0 + e) some row's band reaches (a = e = 0: none): the rest is masked in every row, so
  // no pass computes it -- on the diagonal of a causal mask, half the tile.  A function of
  // the tile alone, so forward and backward multiply the same shapes.
  void tile_columns(int64_t i0, int64_t i1, int64_t j0, int64_t c, int64_t& a,
                    int64_t& e) const {
    a = 0;
    e = c;
    if (lo == nullptr) return;
    a = c;
    e = 0;
    for (int64_t i = i0; i < i1; ++i) {
      if (lo[i] >= hi[i]) continue;
      a = std::min(a, std::max<int64_t>(lo[i] - j0, 0));
      e = std::max(e, std::min<int64_t>(hi[i] - j0, c));
    }
    if (a >= e) a = e = 0;
  }

  // tile(kb, a, c): each key tile rows i0 .. i0 + r of head (b, h) reach, in key order:
  // key block kb, narrowed to its columns kb * block_k + a .. + c (`tile_columns`), tiles
  // the band or the BlockMask masks entirely skipped.  The walk of the passes by blocks of
  // query rows (forward, tangent), so they compute the same tiles.
  template <typename Tile>
  void for_each_key_tile(int64_t b, int64_t h, int64_t i0, int64_t r, Tile tile) const {
    int64_t first, stop;
    key_block_span(i0, i0 + r, first, stop);
    for (int64_t kb = first; kb < stop; ++kb) {
      int64_t a, e;
      tile_columns(i0, i0 + r, kb * block_k, std::min(block_k, Nk - kb * block_k), a, e);
      if (a == e) continue;
      const int64_t j0 = kb * block_k + a;
      if (tile_empty(b, h, i0, i0 + r, j0, j0 + e - a)) continue;
      tile(kb, a, e - a);
    }
  }
};

// r rows of x ([r, d], dense) times s, into dst (leading dimension ld).
template <typename T>
void scaled_rows(const T* x, int64_t r, int64_t d, T s, T* dst, int64_t ld) {
  for (int64_t i = 0; i < r; ++i)
    for (int64_t j = 0; j < d; ++j) dst[i * ld + j] = x[i * d + j] * s;
}

// The largest score of a row s[0 .. c) (NaN if any is), and P = exp(s - shift) in place
// with the sum of P.  Independent chains of vectors, reduced at the end: one chain would
// wait on each max's or add's latency at every vector.
template <typename T>
inline T row_max(const T* s, int64_t c) {
  using Vec = at::vec::Vectorized<T>;
  constexpr int64_t W = Vec::size();
  const Vec neg_inf(-std::numeric_limits<T>::infinity());
  Vec m0 = neg_inf, m1 = neg_inf, m2 = neg_inf, m3 = neg_inf;
  int64_t j = 0;
  for (; j + 4 * W <= c; j += 4 * W) {
    m0 = at::vec::maximum(m0, Vec::loadu(s + j));
    m1 = at::vec::maximum(m1, Vec::loadu(s + j + W));
    m2 = at::vec::maximum(m2, Vec::loadu(s + j + 2 * W));
    m3 = at::vec::maximum(m3, Vec::loadu(s + j + 3 * W));
  }
  for (; j < c; j += W) {  // the rest, a partial vector padded with -inf
    const int64_t n = std::min(W, c - j);
    m0 = at::vec::maximum(m0, Vec::set(neg_inf, Vec::loadu(s + j, n), n));
  }
  const Vec m = at::vec::maximum(at::vec::maximum(m0, m1), at::vec::maximum(m2, m3));
  return at::vec::vec_reduce_all<T>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, m);
}

template <Exp kHow, typename T>
inline T exp_row_impl(T* s, int64_t c, T shift) {
  using Vec = at::vec::Vectorized<T>;
  constexpr int64_t W = Vec::size();
  const Vec sh(shift);
  Vec l0(T(0)), l1(T(0));  // two chains: more would spill the exp's constants on AVX2
  int64_t j = 0;
  for (; j + 2 * W <= c; j += 2 * W) {
    const Vec p0 = exp_vec<kHow>(Vec::loadu(s + j) - sh);
    const Vec p1 = exp_vec<kHow>(Vec::loadu(s + j + W) - sh);
    p0.store(s + j);
    p1.store(s + j + W);
    l0 = l0 + p0;
    l1 = l1 + p1;
  }
  for (; j < c; j += W) {
    const int64_t n = std::min(W, c - j);
    const Vec p = exp_vec<kHow>(Vec::loadu(s + j, n) - sh);
    p.store(s + j, n);
    l0 = l0 + Vec::set(Vec(T(0)), p, n);
  }
  return at::vec::vec_reduce_all<T>([](Vec& a, Vec& b) { return a + b; }, l0 + l1);
}

// Forward's P = exp(S - shift) over a row, in place, and its sum (`Exp`; a NaN or infinite
// shift keeps its NaN).  P below 2^-125 matter to O only under dropout (`tiny`), where the
// row's P = 1 may be dropped and O, so Delta, made of the rest.  Without it O holds that
// P = 1 (and l >= 1): they move each O element by less than 2^-125 sum_j |v_j|, far below
// the rounding of the P = 1 term -- unless v is 0 there for every key whose P is above.
template <typename T>
inline T exp_row_(T* s, int64_t c, T shift, bool tiny) {
  if (!std::isfinite(shift)) return exp_row_impl<Exp::kExact>(s, c, shift);
  return tiny ? exp_row_impl<Exp::kTiny>(s, c, shift) : exp_row_impl<Exp::kFast>(s, c, shift);
}

// One tile row of the online softmax (forward's and the one-pass forward mode's): the row
// s[0 .. c) of scores becomes E = exp(s - shift), m, l and shift move to the new running
// max; returns alpha, the factor what the row summed before takes (1: the max stayed put).
template <typename T>
inline T online_row(T* s, int64_t c, T& m, T& l, T& shift, bool tiny) {
  const T neg_inf = -std::numeric_limits<T>::infinity();
  const T mx = row_max(s, c);  // NaN if any score is, and then m stays NaN
  const T m_new = std::isnan(mx) ? mx : std::max(m, mx);
  // a row with no key yet keeps m = -inf; shift by 0 so exp(-inf) = 0, not NaN
  const T sh = m_new == neg_inf ? T(0) : m_new;
  const T sum = exp_row_(s, c, sh, tiny);
  // the running max most often stays put after the first tiles: no exp then
  const T alpha = m_new == m ? T(1) : std::exp(m - sh);
  l = l * alpha + sum;
  m = m_new;
  shift = sh;
  return alpha;
}

// x[0 .. n) *= alpha unless alpha is 1 (the running max moved: rescale what a row summed).
template <typename T>
inline void rescale(T* x, int64_t n, T alpha) {
  if (alpha != T(1))
    for (int64_t e = 0; e < n; ++e) x[e] *= alpha;
}

// The end of a row of the online softmax: O = acc (1 / (1 - p)) / l into o[0 .. dv) and the
// statistics (shift, log l) into st[0 .. 2); returns the divisor (l, or 1 on a dead row).
template <typename T>
inline T finish_row(const T* acc, int64_t dv, T keep_scale, T l, T shift, T* o, T* st) {
  const T denom = l == T(0) ? T(1) : l;
  for (int64_t x = 0; x < dv; ++x) o[x] = acc[x] * keep_scale / denom;
  st[0] = shift;
  st[1] = l == T(0) ? std::numeric_limits<T>::infinity() : std::log(l);
  return denom;
}

// Dropout: the hash's last steps for key j of a row whose word is `row`.
inline bool keeps(int32_t row, int32_t col, int32_t threshold) {
  uint32_t x = static_cast<uint32_t>(row ^ col);
  int32_t y = static_cast<int32_t>(x + x * x) >> 1;  // x (x + 1) / 2 mod 2^31
  return y < threshold;
}

// Whether the call's mask keeps key j of row (b, h, i): its bool mask, its band and, with a
// BlockMask read by blocks, `blocks` (the row's verdicts from `mask_blocks`, at keys j0 ..;
// nullptr: none).  Where a score program indexed out of bounds, this decides.
template <typename T>
bool kept(const Problem<T>& pb, int64_t b, int64_t h, int64_t i, int64_t j, int64_t j0,
          const uint8_t* blocks) {
  if (pb.keep != nullptr && !pb.keep[b * pb.sk[0] + h * pb.sk[1] + i * pb.sk[2] + j * pb.sk[3]])
    return false;
  if (blocks != nullptr && blocks[j - j0] == 0) return false;
  return pb.lo == nullptr || (j >= pb.lo[i] && j < pb.hi[i]);
}

// IndexError where the program `run` just ran on row (b, h, i), keys j0 .., indexed a
// captured tensor out of bounds at a position the mask keeps (`blocks` as for `kept`).
template <typename T>
void check_bounds(const Problem<T>& pb, const Runner<T>& run, int64_t b, int64_t h, int64_t i,
                  int64_t j0, int64_t c, const uint8_t* blocks) {
  for (const auto& e : run.oob) {
    const int64_t from = e.column < 0 ? 0 : e.column, to = e.column < 0 ? c : e.column + 1;
    for (int64_t jj = from; jj < to; ++jj)
      TORCH_CHECK_INDEX(!kept(pb, b, h, i, j0 + jj, j0, blocks),
                        run.describe(e, b, h, i, j0 + jj));
  }
}

// Zero where the mask drops a key of row (b, h, i) (dS after the backward program, as flex's
// backward: there GRAD = 0, and a program may still make NaN of it, 0 * inf); `blocks` as
// for `kept`.
template <typename T>
void zero_masked(const Problem<T>& pb, int64_t b, int64_t h, int64_t i, int64_t j0, int64_t c,
                 const uint8_t* blocks, T* ds) {
  if (blocks != nullptr)
    for (int64_t j = 0; j < c; ++j) ds[j] = blocks[j] != 0 ? ds[j] : T(0);
  if (pb.keep != nullptr) {
    const bool* keep = pb.keep + b * pb.sk[0] + h * pb.sk[1] + i * pb.sk[2] + j0 * pb.sk[3];
    for (int64_t j = 0; j < c; ++j) ds[j] = keep[j * pb.sk[3]] ? ds[j] : T(0);
  }
  if (pb.lo != nullptr) {
    int64_t a = std::clamp<int64_t>(pb.lo[i] - j0, 0, c);
    int64_t e = std::clamp<int64_t>(pb.hi[i] - j0, 0, c);
    if (a >= e) a = e = c;
    std::fill(ds, ds + a, T(0));
    std::fill(ds + e, ds + c, T(0));
  }
}

// x[0 .. c) += y[0 .. c).
template <typename T>
inline void add_row(T* x, const T* y, int64_t c) {
  using Vec = at::vec::Vectorized<T>;
  at::vec::map2([](Vec a, Vec b) { return a + b; }, x, x, y, c);
}

// A BlockMask's blocks on row (b, h, i), keys j0 .. j0 + c, one key block's segment at a
// time: -inf in an empty block, the mask program's verdict in a partial one (mask_mod runs
// there alone, as torch's kernel calls it), a full one untouched.  `blocks` (nullptr: not
// wanted) gets 1 where the score is kept, 0 where not.  IndexError where the mask program
// reads out of bounds (in a partial block: torch evaluates mask_mod there too).
template <typename T>
void mask_blocks(const Problem<T>& pb, Runner<T>& mask, int64_t b, int64_t h, int64_t i,
                 int64_t j0, int64_t c, T* s, uint8_t* blocks) {
  const T neg_inf = -std::numeric_limits<T>::infinity();
  const uint8_t* row = pb.block_row(b, h, i);
  for (int64_t j = j0, end = j0 + c; j < end;) {
    const int64_t kb = j / pb.mask_bk, stop = std::min(end, (kb + 1) * pb.mask_bk);
    const int64_t n = stop - j;
    T* x = s + (j - j0);
    uint8_t* v = blocks == nullptr ? nullptr : blocks + (j - j0);
    if (row[kb] == kFull) {
      if (v != nullptr) std::fill_n(v, n, uint8_t(1));
    } else if (row[kb] == kPartial) {
      const int64_t* keep = mask.verdict(b, h, i, j, n);
      if (!mask.oob.empty()) {
        const auto& e = mask.oob.front();
        TORCH_CHECK_INDEX(false, mask.describe(e, b, h, i, j + std::max<int64_t>(e.column, 0)));
      }
      for (int64_t t = 0; t < n; ++t) x[t] = keep[t] != 0 ? x[t] : neg_inf;
      if (v != nullptr)
        for (int64_t t = 0; t < n; ++t) v[t] = keep[t] != 0;
    } else {
      std::fill_n(x, n, neg_inf);
      if (v != nullptr) std::fill_n(v, n, uint8_t(0));
    }
    j = stop;
  }
}

// Cap, run the score program or add the diagonal term, bias and mask the tile in place;
// with a softcap, `slope` (like S) gets 1 - tanh^2 and `tanh` (like S; nullptr: not
// wanted) t = tanh(S / cap), the softcap's record that the second-order pass reads.
// `run`: the forward program's runner, or nullptr (no program: no work per score beyond a
// test per row); `raw`: where backward keeps the capped rows (like S) for its backward
// program's SCORE, or nullptr.  With a BlockMask read by blocks, `mask` runs its mask
// program and `blocks` (like S; nullptr: not wanted, but wanted whenever `run` is given)
// gets `mask_blocks`' verdicts, which the bounds checks and backward's `zero_masked` read.
template <typename T>
void mask_tile(const Problem<T>& pb, int64_t b, int64_t h, int64_t i0, int64_t r, int64_t j0,
               int64_t c, T* S, int64_t ld, T* slope, Runner<T>* run = nullptr,
               T* raw = nullptr, Runner<T>* mask = nullptr, uint8_t* blocks = nullptr,
               T* tanh = nullptr) {
  using Vec = at::vec::Vectorized<T>;
  constexpr int64_t W = Vec::size();
  const T neg_inf = -std::numeric_limits<T>::infinity();
  for (int64_t ii = 0; ii < r; ++ii) {
    const int64_t i = i0 + ii;
    T* s = S + ii * ld;
    if (pb.cap != T(0)) {
      const Vec cap(pb.cap), one(T(1));
      T* sl = slope == nullptr ? nullptr : slope + ii * ld;
      T* th = tanh == nullptr ? nullptr : tanh + ii * ld;
      for (int64_t j = 0; j < c; j += W) {
        int64_t n = std::min(W, c - j);
        Vec t = tanh_vec(Vec::loadu(s + j, n) / cap);
        if (sl != nullptr) (one - t * t).store(sl + j, n);
        if (th != nullptr) t.store(th + j, n);
        (t * cap).store(s + j, n);
      }
    }
    if (run != nullptr) {
      const T* score = s;
      if (raw != nullptr) {
        std::copy(s, s + c, raw + ii * ld);
        score = raw + ii * ld;
      }
      const T* out = run->run(b, h, i, j0, c, score, nullptr, s);
      if (out != s) std::copy(out, out + c, s);
    }
    if (pb.diagonal != nullptr) add_row(s, pb.diagonal_row(b, h, i, j0), c);
    if (pb.bias != nullptr) {
      const T* bias = pb.bias + b * pb.sb[0] + h * pb.sb[1] + i * pb.sb[2] + j0 * pb.sb[3];
      const int64_t step = pb.sb[3];
      if (step == 1) {
        add_row(s, bias, c);
      } else {
        for (int64_t j = 0; j < c; ++j) s[j] += bias[j * step];
      }
    }
    if (pb.keep != nullptr) {
      const bool* keep = pb.keep + b * pb.sk[0] + h * pb.sk[1] + i * pb.sk[2] + j0 * pb.sk[3];
      const int64_t step = pb.sk[3];
      for (int64_t j = 0; j < c; ++j) s[j] = keep[j * step] ? s[j] : neg_inf;
    }
    uint8_t* verdicts = blocks == nullptr ? nullptr : blocks + ii * ld;
    if (pb.status != nullptr) mask_blocks(pb, *mask, b, h, i, j0, c, s, verdicts);
    if (pb.lo != nullptr) {
      int64_t a = std::clamp<int64_t>(pb.lo[i] - j0, 0, c);
      int64_t e = std::clamp<int64_t>(pb.hi[i] - j0, 0, c);
      if (a >= e) a = e = c;  // a row that attends nothing here
      std::fill(s, s + a, neg_inf);
      std::fill(s + e, s + c, neg_inf);
    }
    if (run != nullptr && !run->oob.empty()) check_bounds(pb, *run, b, h, i, j0, c, verdicts);
  }
}

// The backward program on each row of the tile: SCORE = the capped row (raw), GRAD = dS'
// (in dS), its out into dS, zero where the mask drops a key; then the bounds check.
// `blocks`: the tile's BlockMask verdicts (`mask_tile`), or nullptr.
template <typename T>
void program_gradient(const Problem<T>& pb, Runner<T>& grad, int64_t b, int64_t h, int64_t i0,
                      int64_t r, int64_t j0, int64_t c, const T* raw, const uint8_t* blocks,
                      T* dS) {
  const int64_t bk = pb.block_k;
  for (int64_t ii = 0; ii < r; ++ii) {
    T* ds = dS + ii * bk;
    const uint8_t* verdicts = blocks == nullptr ? nullptr : blocks + ii * bk;
    const T* out = grad.run(b, h, i0 + ii, j0, c, raw + ii * bk, ds, ds);
    if (out != ds) std::copy(out, out + c, ds);
    zero_masked(pb, b, h, i0 + ii, j0, c, verdicts, ds);
    if (!grad.oob.empty()) check_bounds(pb, grad, b, h, i0 + ii, j0, c, verdicts);
  }
}

// P = exp((S - m) - log l) in place from the row statistics (m, log l) of rows i0 .., every
// P kept (`Exp::kTiny`): a key whose every P is below 2^-125 has dV and dK made of them alone.
template <typename T>
void probabilities(int64_t r, int64_t c, T* S, int64_t ld, const T* stats) {
  using Vec = at::vec::Vectorized<T>;
  constexpr int64_t W = Vec::size();
  for (int64_t ii = 0; ii < r; ++ii) {
    T* s = S + ii * ld;
    const Vec m(stats[2 * ii]), log_l(stats[2 * ii + 1]);
    const bool finite = std::isfinite(stats[2 * ii]) && std::isfinite(stats[2 * ii + 1]);
    for (int64_t j = 0; j < c; j += W) {
      int64_t n = std::min(W, c - j);
      const Vec x = (Vec::loadu(s + j, n) - m) - log_l;
      (finite ? exp_vec<Exp::kTiny>(x) : exp_vec<Exp::kExact>(x)).store(s + j, n);
    }
  }
}

// Z applied to P in place (dropped entries become 0) for rows i0 .. of head bh.
template <typename T>
void drop(const Problem<T>& pb, int64_t bh, int64_t i0, int64_t r, int64_t j0, int64_t c, T* P,
          int64_t ld) {
  const int32_t* cols = pb.col_words + j0;
  for (int64_t ii = 0; ii < r; ++ii) {
    const int32_t row = pb.row_words[bh * pb.Nq + i0 + ii];
    T* p = P + ii * ld;
    for (int64_t j = 0; j < c; ++j) p[j] = keeps(row, cols[j], pb.threshold) ? p[j] : T(0);
  }
}

// A[r, c] (leading dim lda) -> At[c, r] (leading dim ldt), in 16 x 16 blocks of at::vec.
// Forward's panels of k^T and backward's are both made here, the same way.
template <typename T>
void transpose(int64_t r, int64_t c, const T* A, int64_t lda, T* At, int64_t ldt) {
  constexpr int64_t kB = 16;
  for (int64_t i = 0; i < r; i += kB)
    for (int64_t j = 0; j < c; j += kB)
      at::vec::transpose_mxn<T>(A + i * lda + j, lda, At + j * ldt + i, ldt,
                                static_cast<int>(std::min(kB, r - i)),
                                static_cast<int>(std::min(kB, c - j)));
}

// dS of a tile into ds_out [B, Hq, Nq, Nk] (a bias's gradient), when asked for.
template <typename T>
void store_score_gradient(const Problem<T>& pb, int64_t bh, int64_t i0, int64_t r, int64_t j0,
                         int64_t c, const T* dS, T* ds_out) {
  if (ds_out == nullptr) return;
  T* dst = ds_out + (bh * pb.Nq + i0) * pb.Nk + j0;
  for (int64_t ii = 0; ii < r; ++ii)
    std::copy(dS + ii * pb.block_k, dS + ii * pb.block_k + c, dst + ii * pb.Nk);
}

// A tile (like dS') summed along its diagonals into dD's rows of head g of the group (dd: a
// unit's [G, Nq + Nk - 1] sums), row by row, each row one vector pass.
template <typename T>
void diagonal_gradient(const Problem<T>& pb, int64_t g, int64_t i0, int64_t r, int64_t j0,
                       int64_t c, const T* dS, T* dd) {
  T* base = dd + g * pb.diagonals() + (j0 + pb.Nq - 1);
  for (int64_t ii = 0; ii < r; ++ii) add_row(base - (i0 + ii), dS + ii * pb.block_k, c);
}

// Slabs per kv head of a pass whose units are (b, kv head, slab of `blocks` blocks): enough
// units for eight threads where B * Hkv is small, at most kMaxSlabs (each slab past the
// first holds a partial sum of what the head's slabs share).  A function of the shape
// alone, so every thread count runs the same partition.
constexpr int64_t kUnits = 8, kMaxSlabs = 4;

template <typename T>
int64_t slab_count(const Problem<T>& pb, int64_t blocks) {
  const int64_t heads = pb.B * pb.Hkv;
  if (heads == 0) return 1;
  return std::clamp<int64_t>((kUnits + heads - 1) / heads, 1,
                             std::min<int64_t>(kMaxSlabs, std::max<int64_t>(1, blocks)));
}

// [edge[s], edge[s + 1]): the blocks of slab s, cut where their costs (cost[n]: block n's,
// the tiles it reaches and its own work) are shared evenly.
inline std::vector<int64_t> slab_edges(const std::vector<int64_t>& cost, int64_t slabs) {
  const int64_t blocks = static_cast<int64_t>(cost.size());
  std::vector<int64_t> total(blocks + 1, 0);  // total[n]: the cost of blocks before n
  for (int64_t n = 0; n < blocks; ++n) total[n + 1] = total[n] + cost[n];
  std::vector<int64_t> edge(slabs + 1, blocks);
  edge[0] = 0;
  for (int64_t s = 1; s < slabs; ++s) {
    const int64_t target = total[blocks] * s / slabs;
    edge[s] = std::lower_bound(total.begin(), total.end(), target) - total.begin();
    edge[s] = std::clamp(edge[s], edge[s - 1], blocks);
  }
  return edge;
}

// Slabs 1 .. slabs - 1's partial sums (`partial`, `size` each) joined into slab 0's, which
// `result` holds, in slab order, then times `scale`: the same sums for any thread count.
template <typename T>
void join_slabs(T* result, const T* partial, int64_t slabs, int64_t size, T scale) {
  at::parallel_for(0, size, 1 << 14, [&](int64_t begin, int64_t end) {
    for (int64_t e = begin; e < end; ++e) {
      T sum = result[e];
      for (int64_t s = 1; s < slabs; ++s) sum += partial[(s - 1) * size + e];
      result[e] = sum * scale;
    }
  });
}

// Units' sums joined per group of `slabs` consecutive units, in unit order: out[g * size + e]
// = sum over s of sums[(g * slabs + s) * stride + e], for g < groups (a unit's `size` sums
// start every `stride` elements).
template <typename T>
void join_units(T* out, const T* sums, int64_t groups, int64_t slabs, int64_t size,
                int64_t stride) {
  at::parallel_for(0, groups * size, 1 << 12, [&](int64_t begin, int64_t end) {
    for (int64_t e = begin; e < end; ++e) {
      const int64_t group = e / size, at = e % size;
      T sum = T(0);
      for (int64_t s = 0; s < slabs; ++s) sum += sums[(group * slabs + s) * stride + at];
      out[e] = sum;
    }
  });
}

}  // namespace attngrad_fused
