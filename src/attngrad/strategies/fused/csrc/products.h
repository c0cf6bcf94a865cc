// Tile products C[M, N] (+)= A[M, K] B[K, N], row-major with leading dimensions.
//
// Three engines compute them, and `attngrad.strategies.fused.build` measures
// each on the tile shapes and hands the fastest to every call:
//   BRGEMM: ATen's cpublas::brgemm, oneDNN's batch-reduce micro-kernel
//           (float32 only; it ships inside the torch wheel);
//   MICRO:  the register-blocked micro-kernel below, in at::vec vectors
//           (float32 and float64);
//   ATEN:   at::mm_out / at::addmm_out on views of the tiles (the BLAS torch
//           was built with; a dispatcher call per product).
// Each product sums over K in order for every element, whatever N or the
// tile's offset, so a score recomputed in backward over the same operands is
// bit for bit forward's.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <cstdint>

namespace attngrad_fused {

enum class Engine : int64_t { BRGEMM = 0, MICRO = 1, ATEN = 2 };

// C[MR rows, NV vectors] (+)= A[MR, K] B[K, NV vectors]; `cols` < NV * width
// masks the last vector (loads and stores of the tail only).
template <typename T, int MR, int NV>
inline void micro_block(int64_t K, const T* A, int64_t lda, const T* B, int64_t ldb, T* C,
                        int64_t ldc, bool add, int64_t cols) {
  using Vec = at::vec::Vectorized<T>;
  constexpr int W = Vec::size();
  Vec acc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = Vec(T(0));
  const bool full = cols == NV * W;
  for (int64_t k = 0; k < K; ++k) {
    const T* b = B + k * ldb;
    Vec bv[NV];
    for (int v = 0; v < NV; ++v) {
      int64_t n = std::min<int64_t>(W, cols - v * W);
      bv[v] = full || n == W ? Vec::loadu(b + v * W) : (n > 0 ? Vec::loadu(b + v * W, n) : Vec(T(0)));
    }
    for (int r = 0; r < MR; ++r) {
      Vec a(A[r * lda + k]);
      for (int v = 0; v < NV; ++v) acc[r][v] = at::vec::fmadd(a, bv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    T* c = C + r * ldc;
    for (int v = 0; v < NV; ++v) {
      int64_t n = std::min<int64_t>(W, cols - v * W);
      if (n <= 0) break;
      Vec out = acc[r][v];
      if (add) out = out + (n == W ? Vec::loadu(c + v * W) : Vec::loadu(c + v * W, n));
      if (n == W) out.store(c + v * W);
      else out.store(c + v * W, n);
    }
  }
}

template <typename T, int MR>
inline void micro_rows(int64_t N, int64_t K, const T* A, int64_t lda, const T* B, int64_t ldb,
                       T* C, int64_t ldc, bool add) {
  constexpr int NV = 2;
  constexpr int64_t step = NV * at::vec::Vectorized<T>::size();
  for (int64_t j = 0; j < N; j += step)
    micro_block<T, MR, NV>(K, A, lda, B + j, ldb, C + j, ldc, add, std::min(step, N - j));
}

template <typename T>
void micro_product(int64_t M, int64_t N, int64_t K, const T* A, int64_t lda, const T* B,
                   int64_t ldb, T* C, int64_t ldc, bool add) {
  constexpr int MR = 6;
  int64_t i = 0;
  for (; i + MR <= M; i += MR) micro_rows<T, MR>(N, K, A + i * lda, lda, B, ldb, C + i * ldc, ldc, add);
  for (; i < M; ++i) micro_rows<T, 1>(N, K, A + i * lda, lda, B, ldb, C + i * ldc, ldc, add);
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

// Release the engine's per-thread state (oneDNN's micro-kernel context) after a pass.
inline void release(Engine engine) {
  if (engine == Engine::BRGEMM) at::native::cpublas::brgemm_release(false);
}

}  // namespace attngrad_fused
