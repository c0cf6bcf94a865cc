// Tile products C[M, N] (+)= A[M, K] B[K, N], row-major with leading dimensions.
//
// Three engines compute them; `attngrad.strategies.fused.build` times each on the
// tile shapes and on a small attention call, and hands the fastest attention's to
// every call:
//   BRGEMM: ATen's cpublas::brgemm, oneDNN's batch-reduce micro-kernel
//           (float32 only; it ships inside the torch wheel);
//   MICRO:  the register-blocked micro-kernel below, in at::vec vectors
//           (float32 and float64);
//   ATEN:   at::mm_out / at::addmm_out on views of the tiles (the BLAS torch
//           was built with; a dispatcher call per product).
// BRGEMM and MICRO sum over K in order for every element, whatever N or the
// tile's offset; a BLAS may pick its order by shape, alignment or thread (MKL's
// dgemm on a 2 x 1 tile: another order than on the forward's).  The scores
// take `score_product`: under ATEN the micro-kernel, so a score recomputed in
// backward, forward mode or the second-order pass over the same operands is bit
// for bit forward's (P rebuilt from other scores than the saved statistics' is
// not normalised).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "tile.h"  // transpose

namespace attngrad_fused {

enum class Engine : int64_t { BRGEMM = 0, MICRO = 1, ATEN = 2 };

// The micro-kernel's register block: MR rows by NV vectors of C stay in registers while
// k runs (6 x 4 vectors on AVX-512's 32 registers, 6 x 2 on AVX2's 16).
template <typename T>
constexpr int kRows = 6;
template <typename T>
constexpr int kVectors = at::vec::Vectorized<T>::size() * sizeof(T) >= 64 ? 4 : 2;

// C[MR, NV vectors] (+)= A[MR, K] B[K, NV vectors]; a `cols` short of NV vectors (the right
// edge) loads and stores only what is there.  kTransA: A is given transposed, as [K, MR]
// with leading dimension lda (its element (r, k) at A[k * lda + r]).
template <typename T, int MR, int NV, bool kFull, bool kTransA = false>
inline void micro_block(int64_t K, const T* A, int64_t lda, const T* B, int64_t ldb, T* C,
                        int64_t ldc, bool add, int64_t cols) {
  using Vec = at::vec::Vectorized<T>;
  constexpr int W = Vec::size();
  Vec acc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = Vec(T(0));
  int64_t width[NV];
  for (int v = 0; v < NV; ++v) width[v] = std::clamp<int64_t>(cols - v * W, 0, W);
  for (int64_t k = 0; k < K; ++k) {
    const T* b = B + k * ldb;
    Vec bv[NV];
    for (int v = 0; v < NV; ++v)
      bv[v] = kFull ? Vec::loadu(b + v * W) : Vec::loadu(b + v * W, width[v]);
    for (int r = 0; r < MR; ++r) {
      const Vec a(kTransA ? A[k * lda + r] : A[r * lda + k]);
      for (int v = 0; v < NV; ++v) acc[r][v] = at::vec::fmadd(a, bv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    T* c = C + r * ldc;
    for (int v = 0; v < NV; ++v) {
      if (kFull) {
        (add ? acc[r][v] + Vec::loadu(c + v * W) : acc[r][v]).store(c + v * W);
      } else if (width[v] > 0) {
        Vec out = add ? acc[r][v] + Vec::loadu(c + v * W, width[v]) : acc[r][v];
        out.store(c + v * W, width[v]);
      }
    }
  }
}

// Column blocks outer, row blocks inner: one [K, NV vectors] slice of B stays in L1 while
// every row block of A passes over it.
template <typename T, bool kFull, bool kTransA>
inline void micro_columns(int64_t M, int64_t K, const T* A, int64_t lda, const T* B, int64_t ldb,
                          T* C, int64_t ldc, bool add, int64_t cols) {
  constexpr int MR = kRows<T>, NV = kVectors<T>;
  const int64_t row_step = kTransA ? 1 : lda;  // from one row of A to the next
  // Blocks of MR rows, then the last rows.  A block of one or two rows keeps too few
  // accumulators to cover the FMAs' latency, so MR + 1 or MR + 2 last rows go as 4 + 3 or
  // 4 + 4 (e.g. 128 = 20 x 6 + 4 + 4).
  int64_t blocks = M / MR, rest = M % MR;
  if (rest > 0 && rest < 3 && blocks > 0) {
    --blocks;
    rest += MR;
  }
  for (int64_t i = 0; i < blocks * MR; i += MR)
    micro_block<T, MR, NV, kFull, kTransA>(K, A + i * row_step, lda, B, ldb, C + i * ldc, ldc,
                                           add, cols);
  int64_t i = blocks * MR;
  if (rest > 5) {
    micro_block<T, 4, NV, kFull, kTransA>(K, A + i * row_step, lda, B, ldb, C + i * ldc, ldc,
                                          add, cols);
    i += 4;
    rest -= 4;
  }
  const T* a = A + i * row_step;
  T* c = C + i * ldc;
  switch (rest) {  // the last rows, in one block of their own height
    case 5: micro_block<T, 5, NV, kFull, kTransA>(K, a, lda, B, ldb, c, ldc, add, cols); break;
    case 4: micro_block<T, 4, NV, kFull, kTransA>(K, a, lda, B, ldb, c, ldc, add, cols); break;
    case 3: micro_block<T, 3, NV, kFull, kTransA>(K, a, lda, B, ldb, c, ldc, add, cols); break;
    case 2: micro_block<T, 2, NV, kFull, kTransA>(K, a, lda, B, ldb, c, ldc, add, cols); break;
    case 1: micro_block<T, 1, NV, kFull, kTransA>(K, a, lda, B, ldb, c, ldc, add, cols); break;
    default: break;
  }
}

template <typename T, bool kTransA = false>
void micro_product(int64_t M, int64_t N, int64_t K, const T* A, int64_t lda, const T* B,
                   int64_t ldb, T* C, int64_t ldc, bool add) {
  constexpr int64_t step = kVectors<T> * at::vec::Vectorized<T>::size();
  int64_t j = 0;
  for (; j + step <= N; j += step)
    micro_columns<T, true, kTransA>(M, K, A, lda, B + j, ldb, C + j, ldc, add, step);
  if (j < N) micro_columns<T, false, kTransA>(M, K, A, lda, B + j, ldb, C + j, ldc, add, N - j);
}

template <typename T>
void aten_product(int64_t M, int64_t N, int64_t K, const T* A, int64_t lda, const T* B,
                  int64_t ldb, T* C, int64_t ldc, bool add) {
  auto options = at::TensorOptions().dtype(c10::CppTypeToScalarType<T>::value);
  auto a = at::from_blob(const_cast<T*>(A), {M, K}, {lda, 1}, options);
  auto b = at::from_blob(const_cast<T*>(B), {K, N}, {ldb, 1}, options);
  auto c = at::from_blob(C, {M, N}, {ldc, 1}, options);
  if (add) at::addmm_out(c, c, a, b);
  else at::mm_out(c, a, b);
}

template <typename T>
inline void product(Engine engine, int64_t M, int64_t N, int64_t K, const T* A, int64_t lda,
                    const T* B, int64_t ldb, T* C, int64_t ldc, bool add) {
  if (M == 0 || N == 0) return;
  if (K == 0) {
    if (!add)
      for (int64_t i = 0; i < M; ++i) std::fill(C + i * ldc, C + i * ldc + N, T(0));
    return;
  }
  if constexpr (std::is_same_v<T, float>) {
    if (engine == Engine::BRGEMM) {
      at::native::cpublas::brgemm(M, N, K, lda, ldb, ldc, add, A, B, C, false);
      return;
    }
  }
  if (engine == Engine::ATEN) aten_product(M, N, K, A, lda, B, ldb, C, ldc, add);
  else micro_product(M, N, K, A, lda, B, ldb, C, ldc, add);
}

// S[M, N] = A[M, K] B[K, N], a tile of scores: `product` through an engine whose order of
// summation is fixed (the header's comment), the same in every pass.
template <typename T>
inline void score_product(Engine engine, int64_t M, int64_t N, int64_t K, const T* A,
                          int64_t lda, const T* B, int64_t ldb, T* C, int64_t ldc) {
  product(engine == Engine::ATEN ? Engine::MICRO : engine, M, N, K, A, lda, B, ldb, C, ldc,
          false);
}

// C[M, N] (+)= A^T B with A given as [K, M] (leading dimension lda): dV += P^T dO and
// dK += dS^T q without transposing the tile.  The micro-kernel reads A transposed as it
// goes; the other engines take a transposed copy in `scratch` ([M, K]).
template <typename T>
inline void product_transposed_a(Engine engine, int64_t M, int64_t N, int64_t K, const T* A,
                                 int64_t lda, const T* B, int64_t ldb, T* C, int64_t ldc,
                                 bool add, T* scratch) {
  if (engine == Engine::MICRO && M > 0 && N > 0 && K > 0) {
    micro_product<T, true>(M, N, K, A, lda, B, ldb, C, ldc, add);
    return;
  }
  transpose(K, M, A, lda, scratch, K);
  product(engine, M, N, K, scratch, K, B, ldb, C, ldc, add);
}

// Release the engine's per-thread state (oneDNN's micro-kernel context) after a pass.
inline void release(Engine engine) {
  if (engine == Engine::BRGEMM) at::native::cpublas::brgemm_release(false);
}

// Run work(unit, scratch) for units 0 .. n - 1 on the intra-op threads, which take units
// from a shared counter; each thread gets its own scratch (made by `scratch()`) and releases
// the engine's state when done.  An error in a unit (a score program's IndexError) stops
// the others taking units and reaches the caller from at::parallel_for.
template <typename Scratch, typename MakeScratch, typename Work>
void for_each_unit(int64_t n, Engine engine, MakeScratch scratch, Work work) {
  std::atomic<int64_t> next{0};
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      Scratch s = scratch();
      try {
        for (int64_t u = next.fetch_add(1); u < n; u = next.fetch_add(1)) work(u, s);
      } catch (...) {
        next.store(n);
        release(engine);
        throw;
      }
      release(engine);
    }
  });
}

}  // namespace attngrad_fused
