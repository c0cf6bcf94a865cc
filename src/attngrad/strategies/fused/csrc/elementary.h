// Elementary functions of float vectors as the kernels take them per score: e^x (`exp_vec`,
// three ways) and tanh (`tanh_vec`).  float64 always takes Sleef's, through at::vec.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <type_traits>

namespace attngrad_fused {

// How e^x of a float32 vector is taken (float64 always takes Sleef's exp):
// * kFast: ATen's polynomial exp (`exp_u20`, the one SDPA's own CPU kernels use: range
//   reduction, a degree-5 polynomial, fewer instructions than Sleef's exp).  It forms
//   2^(n - 1), n = round(x / ln 2), from the exponent bits: below -125.5 ln 2 (n = -126, a
//   zero exponent field) it returns 0 where e^x is a subnormal number or one of the smallest
//   normal ones, and it clamps a NaN to a finite number.
// * kTiny: kFast, but a vector with a lane below -125 ln 2 (a score 87 below its row's max,
//   or -inf) takes the polynomial at x + 44, where it does not flush, times e^-44: one
//   rounding of a normal number into the subnormal range (x + 44 is exact: a finer grid
//   than x's), -inf still 0.  For rows whose shift or statistics are finite: no lane is NaN
//   there (the row's max, or m, would be).
// * kExact: Sleef's exp, which keeps NaN: rows whose shift or statistics are NaN or infinite.
enum class Exp { kFast, kTiny, kExact };

template <Exp kHow, typename T>
inline at::vec::Vectorized<T> exp_vec(const at::vec::Vectorized<T>& x) {
  using Vec = at::vec::Vectorized<T>;
  if constexpr (!std::is_same_v<T, float> || kHow == Exp::kExact) {
    return x.exp();
  } else if constexpr (kHow == Exp::kFast) {
    return x.exp_u20();
  } else {
    const Vec low(-86.643394f);  // -125 ln 2
    const Vec below = x < low;   // all ones where true
    constexpr int none = (1 << Vec::size()) - 1;  // zero_mask: a bit per lane that is 0
    if (below.zero_mask() == none) return x.exp_u20();
    const Vec lift(44.0f), fall(7.78113224e-20f);  // fall = e^-44
    return (x + (below & lift)).exp_u20() * Vec::blendv(Vec(1.0f), fall, below);
  }
}

// tanh of a float32 vector, in fewer instructions than Sleef's tanh (the softcap's and a
// score program's TANH_F, once per score in each pass).  Odd, so on a = |x|:
// * a < 0.625: a + a^3 P(a^2), P of degree 4 fitted here to tanh's series (its relative
//   error below 5e-9 on the interval, under float32's rounding);
// * else (1 - u) / (1 + u), u = e^(-2a) by `exp_u20` (its 1-2 ulp reach tanh damped by
//   u / (1 - u^2) <= 0.4 at a = 0.625); for a past 44, u flushes to 0 and tanh is 1.
// The sign of x restored by its bit; NaN stays NaN (exp_u20 alone would make it finite).
// A vector whose every lane is near (a softcap's scores are mostly far below its cap) takes
// the polynomial alone, on x itself (odd, so the sign comes with it): the exp and the
// division, most of the cost, are skipped.
// Within 3 ulp of tanh over all float32 (tests/strategies/test_fused_program.py sweeps it).
template <typename T>
inline at::vec::Vectorized<T> tanh_vec(const at::vec::Vectorized<T>& x) {
  using Vec = at::vec::Vectorized<T>;
  if constexpr (!std::is_same_v<T, float>) {
    return x.tanh();
  } else {
    const Vec sign_bit(-0.0f);
    const Vec a = x.abs();
    const Vec a2 = a * a;
    Vec p(-0.005704980343580246f);
    p = at::vec::fmadd(p, a2, Vec(0.020639080554246902f));
    p = at::vec::fmadd(p, a2, Vec(-0.05373971164226532f));
    p = at::vec::fmadd(p, a2, Vec(0.13331441581249237f));
    p = at::vec::fmadd(p, a2, Vec(-0.3333328068256378f));
    const Vec is_near = a < Vec(0.625f);  // all bits set where true; NaN lanes false
    // zero_mask: a bit per lane equal to 0.0, i.e. per false lane of the comparison
    if (is_near.zero_mask() == 0) return at::vec::fmadd(p * a2, x, x);
    const Vec near = at::vec::fmadd(p * a2, a, a);
    const Vec u = (a * Vec(-2.0f)).exp_u20();
    const Vec one(1.0f);
    const Vec far = (one - u) / (one + u);
    const Vec t = Vec::blendv(far, near, is_near);
    const Vec signed_t = t | (x & sign_bit);
    return Vec::blendv(signed_t, x, x != x);  // NaN lanes: x itself
  }
}

}  // namespace attngrad_fused
