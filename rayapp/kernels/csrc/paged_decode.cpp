// Paged decode attention on CPU: one query token per sequence reads its keys and values in place, page
// by page (no gather copy, no padding to the longest context), with scores, softmax and sums in float32.
// Built and loaded by rayapp/kernels/native.py; it must match
// rayapp.kernels.attention.ref_paged_decode_attention (tests/kernels/test_attention.py).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "common.h"

namespace {

using rayapp::dot;
using rayapp::exp_in_place;
#if defined(__AVX512F__) && defined(__AVX512BW__)
using rayapp::load16;
#endif

constexpr int64_t kMaxHeads = 256;  // query heads of a layer (native.MAX_HEADS)

#if defined(__AVX512F__) && defined(__AVX512BW__)
// Lane t of the result is the sum of v[t]'s 16 lanes (v is overwritten): a tree of pairwise sums across the 16
// vectors at once, in a fixed order, instead of one horizontal reduction per vector.
inline __m512 sum_lanes16(__m512* v) {
  alignas(64) static const int32_t kEven[16] = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
  alignas(64) static const int32_t kOdd[16] = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
  const __m512i even = _mm512_load_si512(kEven), odd = _mm512_load_si512(kOdd);
  for (int n = 16; n > 1; n /= 2)
    for (int j = 0; j < n / 2; ++j)
      v[j] = _mm512_add_ps(_mm512_permutex2var_ps(v[2 * j], even, v[2 * j + 1]),
                           _mm512_permutex2var_ps(v[2 * j], odd, v[2 * j + 1]));
  return v[0];
}
#endif

// Attention of sequence b's query heads of KV heads [h0, h1): its pages are read once, row by row, each row
// (one token's K or V of those heads) contiguous, so memory streams in order whatever the head count.
// q, out: [B, Hq, D]; k_cache, v_cache: [P, bs, Hkv, D]; pages: that sequence's page ids; n: its length.
template <typename T, int64_t D>
struct Decode {
  const T *q, *k_cache, *v_cache;
  T* out;
  int64_t Hq, Hkv, G, bs;
  float scale;

  void run(int64_t b, int64_t h0, int64_t h1, const int64_t* pages, int64_t n, std::vector<float>& qf,
           std::vector<float>& acc, std::vector<float>& scores) const {
    const int64_t heads = (h1 - h0) * G;  // query heads of this item, in order
    const int64_t row_stride = Hkv * D;   // between two tokens of a page
    const T* qb = q + (b * Hq + h0 * G) * D;
    qf.resize(heads * D);
    for (int64_t i = 0; i < heads * D; ++i) qf[i] = static_cast<float>(qb[i]) * scale;
    // [heads, stride]; room past n for the 16-lane stores of the vector path.
    const int64_t stride = (n + 15) / 16 * 16 + 16;
    scores.resize(heads * stride);
    acc.assign(heads * D, 0.f);
    scores_of(h0, h1, pages, n, qb, qf.data(), scores.data(), stride);
    float sums[kMaxHeads];
    for (int64_t i = 0; i < heads; ++i) {
      float* si = scores.data() + i * stride;
      const float top = *std::max_element(si, si + n);
      for (int64_t t = 0; t < n; ++t) si[t] -= top;
      sums[i] = exp_in_place(si, n);
    }
    values_of(h0, h1, pages, n, scores.data(), stride, acc.data());
    T* ob = out + (b * Hq + h0 * G) * D;
    for (int64_t i = 0; i < heads; ++i) {
      const float inv = 1.f / sums[i];
      for (int64_t d = 0; d < D; ++d) ob[i * D + d] = static_cast<T>(acc[i * D + d] * inv);
    }
  }

#if defined(__AVX512F__) && defined(__AVX512BW__)
  static constexpr int64_t kV = D / 16;  // float32 vectors of a row

  // scores[i, t] = q_i . k_t, 16 tokens of one KV head at a time, their 16 dot products reduced together. With
  // AVX512-BF16, bfloat16 keys are multiplied as they are stored (products exact, pairs summed in float32) and the
  // scale applied after; otherwise the keys are converted to float32 once into a tile every query head reads.
  void scores_of(int64_t h0, int64_t h1, const int64_t* pages, int64_t n, [[maybe_unused]] const T* qb,
                 const float* qf, float* scores, int64_t stride) const {
    alignas(64) float tile[16 * D];
#if defined(__AVX512BF16__)
    constexpr bool kPairs = std::is_same_v<T, c10::BFloat16>;
#else
    constexpr bool kPairs = false;
#endif
    for_each_run(k_cache, v_cache, h0, h1, pages, n, [&](const T* rows, int64_t h, int64_t c0, int64_t m) {
      if constexpr (!kPairs) to_tile(rows, m, tile);
      for (int64_t g = 0; g < G; ++g) {
        const int64_t head = (h - h0) * G + g;
        __m512 dots[16];
#if defined(__AVX512BF16__)
        if constexpr (kPairs) {
          const T* qh = qb + head * D;
          __m512bh qv[D / 32];
          for (int64_t j = 0; j < D / 32; ++j) qv[j] = (__m512bh)_mm512_loadu_si512(qh + 32 * j);
          for (int64_t i = 0; i < m; ++i) {
            __m512 sum = _mm512_setzero_ps();
            for (int64_t j = 0; j < D / 32; ++j)
              sum = _mm512_dpbf16_ps(sum, qv[j], (__m512bh)_mm512_loadu_si512(rows + i * Hkv * D + 32 * j));
            dots[i] = sum;
          }
        }
#endif
        if constexpr (!kPairs) {
          __m512 qv[kV];
          for (int64_t j = 0; j < kV; ++j) qv[j] = _mm512_loadu_ps(qf + head * D + 16 * j);
          for (int64_t i = 0; i < m; ++i) {
            __m512 sum = _mm512_mul_ps(qv[0], _mm512_load_ps(tile + i * D));
            for (int64_t j = 1; j < kV; ++j)
              sum = _mm512_fmadd_ps(qv[j], _mm512_load_ps(tile + i * D + 16 * j), sum);
            dots[i] = sum;
          }
        }
        for (int64_t i = m; i < 16; ++i) dots[i] = _mm512_setzero_ps();
        __m512 sums = sum_lanes16(dots);
        if constexpr (kPairs) sums = _mm512_mul_ps(sums, _mm512_set1_ps(scale));
        _mm512_storeu_ps(scores + head * stride + c0, sums);
      }
    });
  }

  // m rows of one KV head (`rows`: the first; the next a token further) as float32, row i at tile + i * D.
  void to_tile(const T* rows, int64_t m, float* tile) const {
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < kV; ++j) _mm512_store_ps(tile + i * D + 16 * j, load16(rows + i * Hkv * D + 16 * j));
  }

  // The page's cache lines into L2, ahead of their use (into L1, the prefetches wait on L1's few miss buffers).
  void prefetch_page(const T* page) const {
    const char* bytes = reinterpret_cast<const char*>(page);
    for (int64_t off = 0; off < bs * Hkv * D * static_cast<int64_t>(sizeof(T)); off += 64)
      _mm_prefetch(bytes + off, _MM_HINT_T1);
  }

  // acc[i] = sum_t w[i, t] v_t, the values of 16 tokens of one KV head converted once, as the keys above.
  void values_of(int64_t h0, int64_t h1, const int64_t* pages, int64_t n, const float* w, int64_t stride,
                 float* acc) const {
    alignas(64) float tile[16 * D];
    for_each_run(v_cache, nullptr, h0, h1, pages, n, [&](const T* rows, int64_t h, int64_t c0, int64_t m) {
      to_tile(rows, m, tile);
      for (int64_t g = 0; g < G; ++g) {
        const int64_t head = (h - h0) * G + g;
        __m512 a[kV];
        for (int64_t j = 0; j < kV; ++j) a[j] = _mm512_loadu_ps(acc + head * D + 16 * j);
        for (int64_t i = 0; i < m; ++i) {
          const __m512 wi = _mm512_set1_ps(w[head * stride + c0 + i]);
          for (int64_t j = 0; j < kV; ++j) a[j] = _mm512_fmadd_ps(wi, _mm512_load_ps(tile + i * D + 16 * j), a[j]);
        }
        for (int64_t j = 0; j < kV; ++j) _mm512_storeu_ps(acc + head * D + 16 * j, a[j]);
      }
    });
  }

  // f(rows, h, c0, m) for each run of up to 16 tokens [c0, c0 + m) within a page, and each KV head h in [h0, h1):
  // `rows` is token c0's row of head h in `cache`, the next token's a row further. Pages in order, the page
  // kAhead further prefetched (pages are scattered, so the hardware prefetcher cannot see them coming), and each
  // page of `also` (the values, while the keys are read) with its page here, so the values pass finds them in L2.
  // bench/decode_attention.py --threads 1, 8 x 700 tokens: 0.54 ms a layer, against 0.86 prefetching the next
  // page into L1.
  template <typename F>
  void for_each_run(const T* cache, const T* also, int64_t h0, int64_t h1, const int64_t* pages, int64_t n,
                    F&& f) const {
    constexpr int64_t kAhead = 3;
    const int64_t page_elems = bs * Hkv * D;
    for (int64_t t0 = 0, p = 0; t0 < n; t0 += bs, ++p) {
      const T* page = cache + pages[p] * page_elems;
      if (p == 0)  // here, not before the loop: hoisted, the kernel measured 20% slower (code layout, on this CPU)
        for (int64_t a = 1; a < kAhead && a * bs < n; ++a) prefetch_page(cache + pages[a] * page_elems);
      if (t0 + kAhead * bs < n) prefetch_page(cache + pages[p + kAhead] * page_elems);
      if (also != nullptr) prefetch_page(also + pages[p] * page_elems);
      for (int64_t c0 = t0, last = std::min(t0 + bs, n); c0 < last; c0 += 16)
        for (int64_t h = h0; h < h1; ++h)
          f(page + (c0 - t0) * Hkv * D + h * D, h, c0, std::min<int64_t>(16, last - c0));
    }
  }
#else
  void scores_of(int64_t h0, int64_t h1, const int64_t* pages, int64_t n, [[maybe_unused]] const T* qb,
                 const float* qf, float* scores, int64_t stride) const {
    alignas(64) float row[D];
    for (int64_t t0 = 0, p = 0; t0 < n; t0 += bs, ++p) {
      const T* k = k_cache + pages[p] * bs * Hkv * D + h0 * D;
      for (int64_t t = t0, last = std::min(t0 + bs, n); t < last; ++t, k += Hkv * D)
        for (int64_t h = 0; h < h1 - h0; ++h) {
          for (int64_t d = 0; d < D; ++d) row[d] = static_cast<float>(k[h * D + d]);
          for (int64_t g = 0; g < G; ++g)
            scores[(h * G + g) * stride + t] = dot<D>(qf + (h * G + g) * D, row);
        }
    }
  }

  void values_of(int64_t h0, int64_t h1, const int64_t* pages, int64_t n, const float* w, int64_t stride,
                 float* acc) const {
    alignas(64) float row[D];
    for (int64_t t0 = 0, p = 0; t0 < n; t0 += bs, ++p) {
      const T* v = v_cache + pages[p] * bs * Hkv * D + h0 * D;
      for (int64_t t = t0, last = std::min(t0 + bs, n); t < last; ++t, v += Hkv * D)
        for (int64_t h = 0; h < h1 - h0; ++h) {
          for (int64_t d = 0; d < D; ++d) row[d] = static_cast<float>(v[h * D + d]);
          for (int64_t g = 0; g < G; ++g) {
            const float wt = w[(h * G + g) * stride + t];
            float* a = acc + (h * G + g) * D;
            for (int64_t d = 0; d < D; ++d) a[d] += wt * row[d];
          }
        }
    }
  }
#endif
};

// Work items: whole sequences when there are enough of them to keep every thread busy, else each
// sequence split by KV heads (a single long sequence still uses every thread).
template <typename T, int64_t D>
void decode(const T* q, const T* k_cache, const T* v_cache, const int64_t* page_table, const int64_t* context_lens,
            T* out, int64_t B, int64_t Hq, int64_t Hkv, int64_t bs, int64_t max_pages, float scale) {
  const Decode<T, D> kernel{q, k_cache, v_cache, out, Hq, Hkv, Hq / Hkv, bs, scale};
  const int64_t splits = B >= at::get_num_threads() ? 1 : Hkv;
  at::parallel_for(0, B * splits, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf, acc, scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / splits, part = item % splits;
      const int64_t h0 = part * Hkv / splits, h1 = (part + 1) * Hkv / splits;
      kernel.run(b, h0, h1, page_table + b * max_pages, context_lens[b], qf, acc, scores);
    }
  });
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& page_table, const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "q must be [B, Hq, D] and the caches [P, bs, Hkv, D]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the KV caches must be contiguous");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type(),
              "q and the KV caches must share a dtype");
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2), bs = k_cache.size(1), Hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && Hq % Hkv == 0 && Hq <= kMaxHeads,
              "query heads must be a multiple of KV heads, at most ", kMaxHeads);
  const auto table = page_table.to(at::kLong).contiguous();
  const auto lens = context_lens.to(at::kLong).contiguous();
  TORCH_CHECK(table.dim() == 2 && table.size(0) == B && lens.numel() == B, "page_table must be [B, pages]");
  const auto* len = lens.data_ptr<int64_t>();
  const auto* pages = table.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(len[b] >= 1 && len[b] <= table.size(1) * bs, "context_lens[", b, "] = ", len[b],
                " is outside 1..", table.size(1) * bs);
    for (int64_t p = 0; p < (len[b] + bs - 1) / bs; ++p)
      TORCH_CHECK(pages[b * table.size(1) + p] >= 0 && pages[b * table.size(1) + p] < k_cache.size(0),
                  "page_table[", b, ", ", p, "] = ", pages[b * table.size(1) + p], " is not a page of the cache");
  }
  const auto qc = q.contiguous();
  auto out = at::empty_like(qc);
  AT_DISPATCH_REDUCED_FLOATING_TYPES(q.scalar_type(), "paged_decode_attention", [&] {
    const auto run = [&](auto head_dim) {
      decode<scalar_t, decltype(head_dim)::value>(
          qc.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
          pages, len, out.data_ptr<scalar_t>(), B, Hq, Hkv, bs, table.size(1),
          static_cast<float>(scale));
    };
    rayapp::with_head_dim(D, run);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(rayapp_cpu, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor page_table, "
        "Tensor context_lens, float scale) -> Tensor");
  m.impl("paged_decode_attention", c10::DispatchKey::CPU, TORCH_FN(paged_decode_attention));
}
