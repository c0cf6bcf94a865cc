// The machine's limit: one core's float32 FMA peak at the vector width ATen runs at.
//
// A loop of independent fused multiply-adds on `at::vec` vectors, kChains accumulators
// deep -- more than an FMA's latency times the FMA units of any x86 core (4 cycles x 2
// units on Zen and Intel's big cores), so the units never wait on a result -- with no
// loads or stores inside the loop.  Nothing a kernel computes can beat this rate on one
// thread; a tile product or a whole attention call is judged as a fraction of it.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <vector>

namespace attngrad_fused {

// 12 chains fit AVX2's 16 vector registers beside the two operands; AVX-512 has 32.
constexpr int kChains = 12;

// GFLOP/s of `reps` x kChains independent float32 FMAs per step, on this thread.
inline double fma_rate(int64_t reps) {
  using Vec = at::vec::Vectorized<float>;
  Vec acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = Vec(1.0f + 1e-3f * c);
  const Vec a(0.999999f), b(1e-7f);  // acc = acc * a + b stays finite for any reps
  auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < reps; ++i) {
    for (int c = 0; c < kChains; ++c) acc[c] = at::vec::fmadd(acc[c], a, b);
  }
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  volatile float sink = 0.0f;  // the chains' results are used: the loop cannot be dropped
  float lanes[Vec::size()];
  for (int c = 0; c < kChains; ++c) {
    acc[c].store(lanes);
    sink = sink + lanes[0];
  }
  return 2.0 * Vec::size() * kChains * static_cast<double>(reps) / seconds / 1e9;
}

// The FMA peak of one core (`threads` false), or of the intra-op threads all running the
// probe at once (`threads` true, their rates summed): a core's clock under load on every
// core is what a threaded kernel gets, often less than one core's alone.
inline double fma_peak(int64_t reps, bool threads) {
  if (!threads) return fma_rate(reps);
  const int64_t n = at::get_num_threads();
  std::vector<double> rates(n, 0.0);
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) rates[t] = fma_rate(reps);
  });
  double sum = 0.0;
  for (double r : rates) sum += r;
  return sum;
}

}  // namespace attngrad_fused
