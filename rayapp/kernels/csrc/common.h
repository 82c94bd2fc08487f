// Helpers shared by the CPU kernels in this directory.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <algorithm>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace rayapp {

// x * y summed over D, in a fixed order (the same every call): 16 lanes the compiler vectorizes. Without
// -ffast-math (which a shared library must not use: GCC then links crtfastmath, flushing denormals for the whole
// process) GCC will not reorder a sum, so the lanes are spelled out.
template <int64_t D>
inline float dot(const float* x, const float* y) {
  float lanes[16] = {};
  for (int64_t d = 0; d < D; d += 16)
    for (int64_t j = 0; j < 16; ++j) lanes[j] += x[d + j] * y[d + j];
  for (int64_t w = 8; w >= 1; w /= 2)
    for (int64_t j = 0; j < w; ++j) lanes[j] += lanes[j + w];
  return lanes[0];
}

// exp(x) for x <= 0 in place, within 3 ulp of exp: 2^n * p(r) with x = n ln2 + r, |r| <= ln2 / 2 (Cody-Waite
// split of ln2, a degree-6 polynomial). Plain arithmetic, so the loop vectorizes without libm; returns the sum.
inline float exp_in_place(float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float v = std::max(x[i], -87.0f);  // below that, expf is under float's normal range: 0 either way
    const float k = (v * 1.44269504f + 12582912.f) - 12582912.f;  // round(v / ln2), exact for |v| < 2^22
    const float r = (v - k * 0.693145752f) - k * 1.42860677e-6f;
    float p = 1.38888889e-3f;
    p = p * r + 8.33333333e-3f;
    p = p * r + 4.16666667e-2f;
    p = p * r + 1.66666667e-1f;
    p = p * r + 0.5f;
    p = p * r + 1.f;
    p = p * r + 1.f;
    const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, sizeof scale);
    x[i] = p * scale;
  }
  // Summed in 16 lanes, in a fixed order: a running sum in the loop above would keep it from vectorizing.
  float lanes[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int64_t j = 0; j < 16; ++j) lanes[j] += x[i + j];
  for (int64_t j = 0; i + j < n; ++j) lanes[j] += x[i + j];
  for (int64_t w = 8; w >= 1; w /= 2)
    for (int64_t j = 0; j < w; ++j) lanes[j] += lanes[j + w];
  return lanes[0];
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// 16 cache values as float32.
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#endif

// f(std::integral_constant<int64_t, D>{}) for a head dim the kernels are compiled for (native.HEAD_DIMS).
template <typename F>
void with_head_dim(int64_t D, F&& f) {
  if (D == 64) {
    f(std::integral_constant<int64_t, 64>{});
  } else {
    TORCH_CHECK(D == 128, "head_dim ", D, " is not compiled (native.HEAD_DIMS)");
    f(std::integral_constant<int64_t, 128>{});
  }
}

}  // namespace rayapp
