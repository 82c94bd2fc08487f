// Decode attention over vLLM's CPU KV cache (its `vec` packing), each KV head reading its own list of pages: the
// sparse decode of rayapp's `retrieval` plugin (rayapp/vllm_ext/retrieval_backend.py). vLLM's cache is one tensor
// per layer, [num_blocks, Hkv, bs, 2 * D]; per page and head, K transposed ([D, bs]) then V by token ([bs, D]).
// Each (sequence, KV head) is cut into runs of kRun pages, one work item each (so one long sequence still uses
// every thread); a run's partial softmax is merged with its neighbours' by their maxima at the end. bfloat16 pages
// of a multiple of 32 tokens go through AVX512-BF16 dot products, two rows at a time. Built by
// rayapp/kernels/native.py; it must match rayapp.kernels.retrieval.ref_sparse_decode_attention on the same pages
// (tests/kernels/test_native.py).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "common.h"

namespace {

constexpr int64_t kRun = 8;    // pages per work item
constexpr int64_t kAhead = 2;  // pages prefetched ahead, into L2 (pages are scattered: no hardware prefetch)

#if defined(__AVX512F__) && defined(__AVX512BW__)
using rayapp::exp_in_place;
using rayapp::load16;

// GB: query heads scored together (a divisor of G), each key and value row loaded once for them.
template <typename T, int64_t D, int64_t GB>
struct VecPages {
  static constexpr int64_t kV = D / 16;                      // float32 vectors of a row
  static constexpr int64_t VB = kV * GB <= 16 ? GB : 1;      // heads of a values pass: at most 16 accumulators
#if defined(__AVX512BF16__)
  static constexpr bool kPairs = std::is_same_v<T, c10::BFloat16>;
#else
  static constexpr bool kPairs = false;
#endif
  const T* q;
  const T* cache;
  int64_t Hq, Hkv, G, bs, P;  // P: pages listed per (sequence, head)
  const int64_t* pages;       // [B, Hkv, P]
  const int64_t* lens;        // [B]
  float scale;

  const T* keys(int64_t page, int64_t h) const { return cache + (page * Hkv + h) * 2 * bs * D; }

  // The page's K and V cache lines into L2, ahead of their use.
  void prefetch(int64_t page, int64_t h) const {
    const char* bytes = reinterpret_cast<const char*>(keys(page, h));
    for (int64_t off = 0; off < 2 * bs * D * static_cast<int64_t>(sizeof(T)); off += 64)
      _mm_prefetch(bytes + off, _MM_HINT_T1);
  }

  // Run r of (b, h): pages [r * kRun, ...) up to the sequence's last token. Writes its max, sum and unnormalized
  // output per query head: part[g] = {max, sum, acc[D]}.
  void run(int64_t b, int64_t h, int64_t r, float* part, std::vector<float>& qf, std::vector<float>& w,
           std::vector<T>& wb) const {
    const int64_t n = lens[b], first = r * kRun * bs, last = std::min(n, first + kRun * bs), m = last - first;
    const int64_t* list = pages + (b * Hkv + h) * P;
    const T* qh = q + (b * Hq + h * G) * D;
    qf.resize(G * D);
    for (int64_t i = 0; i < G * D; ++i) qf[i] = static_cast<float>(qh[i]) * scale;
    const int64_t p0 = r * kRun, p1 = (last + bs - 1) / bs, stride = (p1 - p0) * bs;  // whole pages of scores
    const bool pairs = kPairs && bs % 32 == 0;
    w.resize(G * stride);
    for (int64_t a = 0; a < kAhead && p0 + a < p1; ++a) prefetch(list[p0 + a], h);
    for (int64_t p = p0; p < p1; ++p) {
      if (p + kAhead < p1) prefetch(list[p + kAhead], h);
      const T* kt = keys(list[p], h);
      const int64_t t0 = p * bs - first, valid = std::min(bs, last - p * bs);
      for (int64_t g0 = 0; g0 < G; g0 += GB) {
        if (pairs)
          score_pairs(kt, qh + g0 * D, valid, w.data() + g0 * stride + t0, stride);
        else
          score_rows(kt, qf.data() + g0 * D, valid, w.data() + g0 * stride + t0, stride);
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      float* wg = w.data() + g * stride;  // scores past m (a partial last page's unwritten slots) are cut
      const float top = *std::max_element(wg, wg + m);
      for (int64_t t = 0; t < m; ++t) wg[t] -= top;
      float* out = part + g * (D + 2);
      out[0] = top;
      out[1] = exp_in_place(wg, m);
      std::fill(out + 2, out + 2 + D, 0.f);
    }
    if (pairs) {
      wb.resize(G * stride);
      for (int64_t i = 0; i < G * stride; ++i) wb[i] = static_cast<T>(w[i]);
    }
    for (int64_t p = p0; p < p1; ++p) {
      const T* v = keys(list[p], h) + bs * D;  // [bs, D]
      const int64_t t0 = p * bs - first, valid = std::min(bs, last - p * bs);
      for (int64_t g0 = 0; g0 < G; g0 += VB) {
        float* acc = part + g0 * (D + 2) + 2;
        const int64_t even = pairs ? valid / 2 * 2 : 0;
        if (even > 0) value_pairs(v, wb.data() + g0 * stride + t0, stride, even, acc);
        value_rows(v, w.data() + g0 * stride + t0, stride, even, valid, acc);
      }
    }
  }

  // Scores of GB query heads (qf: [GB, D], scaled) for tokens [0, valid) of a page (kt: K^T, [D, bs]) into
  // w[i * stride + t], 64 tokens at a time, each row of K^T loaded once for the GB heads.
  void score_rows(const T* kt, const float* qf, int64_t valid, float* w, int64_t stride) const {
    for (int64_t c = 0; c < valid; c += 64) {
      const int64_t nv = std::min<int64_t>(4, (bs - c) / 16);
      __m512 acc[GB][4];
      for (int64_t i = 0; i < GB; ++i)
        for (int64_t j = 0; j < 4; ++j) acc[i][j] = _mm512_setzero_ps();
      for (int64_t d = 0; d < D; ++d) {
        __m512 k[4];
        for (int64_t j = 0; j < 4; ++j) k[j] = j < nv ? load16(kt + d * bs + c + 16 * j) : _mm512_setzero_ps();
        for (int64_t i = 0; i < GB; ++i) {
          const __m512 qd = _mm512_set1_ps(qf[i * D + d]);
          for (int64_t j = 0; j < 4; ++j) acc[i][j] = _mm512_fmadd_ps(qd, k[j], acc[i][j]);
        }
      }
      for (int64_t i = 0; i < GB; ++i)
        for (int64_t j = 0; j < nv; ++j) _mm512_storeu_ps(w + i * stride + c + 16 * j, acc[i][j]);
    }
  }

  // acc[i] += sum_t w[i * stride + t] v_t over tokens [t0, t1) of a page (v: [bs, D]), one value row at a time.
  void value_rows(const T* v, const float* w, int64_t stride, int64_t t0, int64_t t1, float* acc) const {
    if (t0 >= t1) return;
    __m512 a[VB][kV];
    for (int64_t i = 0; i < VB; ++i)
      for (int64_t j = 0; j < kV; ++j) a[i][j] = _mm512_loadu_ps(acc + i * (D + 2) + 16 * j);
    for (int64_t t = t0; t < t1; ++t) {
      __m512 x[kV];
      for (int64_t j = 0; j < kV; ++j) x[j] = load16(v + t * D + 16 * j);
      for (int64_t i = 0; i < VB; ++i) {
        const __m512 wt = _mm512_set1_ps(w[i * stride + t]);
        for (int64_t j = 0; j < kV; ++j) a[i][j] = _mm512_fmadd_ps(wt, x[j], a[i][j]);
      }
    }
    for (int64_t i = 0; i < VB; ++i)
      for (int64_t j = 0; j < kV; ++j) _mm512_storeu_ps(acc + i * (D + 2) + 16 * j, a[i][j]);
  }

#if defined(__AVX512BF16__)
  // Interleaving two rows of 32 bfloat16 (unpacklo/hi_epi16) pairs them up within each 128-bit lane: a dot
  // product's float32 lane e then holds element 8 * (e / 4) + e % 4 of the rows (lo) or that + 4 (hi). These
  // indices put elements 0-15 (first) and 16-31 (second) back in order from (lo, hi).
  static __m512i unpair_index(int64_t half) {
    alignas(64) int32_t idx[16];
    for (int32_t x = 0; x < 16; ++x) {
      const int32_t lane = 2 * static_cast<int32_t>(half) + x / 8, within = x % 8;
      idx[x] = within < 4 ? 4 * lane + within : 16 + 4 * lane + within - 4;
    }
    return _mm512_load_si512(idx);
  }

  // score_rows for bfloat16 with bs a multiple of 32: two rows of K^T (d, d + 1) at a time, 32 tokens, against
  // the raw bfloat16 query pairs (q: [GB, D]), scaled after.
  void score_pairs(const T* kt, const T* qh, int64_t valid, float* w, int64_t stride) const {
    const __m512i first = unpair_index(0), second = unpair_index(1);
    const __m512 s = _mm512_set1_ps(scale);
    for (int64_t c = 0; c < valid; c += 32) {
      __m512 lo[GB], hi[GB];
      for (int64_t i = 0; i < GB; ++i) lo[i] = hi[i] = _mm512_setzero_ps();
      for (int64_t d = 0; d < D; d += 2) {
        const __m512i r0 = _mm512_loadu_si512(kt + d * bs + c), r1 = _mm512_loadu_si512(kt + (d + 1) * bs + c);
        const __m512bh plo = (__m512bh)_mm512_unpacklo_epi16(r0, r1), phi = (__m512bh)_mm512_unpackhi_epi16(r0, r1);
        for (int64_t i = 0; i < GB; ++i) {
          int32_t pair;
          std::memcpy(&pair, qh + i * D + d, sizeof pair);
          const __m512bh qq = (__m512bh)_mm512_set1_epi32(pair);
          lo[i] = _mm512_dpbf16_ps(lo[i], plo, qq);
          hi[i] = _mm512_dpbf16_ps(hi[i], phi, qq);
        }
      }
      for (int64_t i = 0; i < GB; ++i) {
        _mm512_storeu_ps(w + i * stride + c, _mm512_mul_ps(_mm512_permutex2var_ps(lo[i], first, hi[i]), s));
        _mm512_storeu_ps(w + i * stride + c + 16, _mm512_mul_ps(_mm512_permutex2var_ps(lo[i], second, hi[i]), s));
      }
    }
  }

  // value_rows for bfloat16 over tokens [0, even) (even: an even count), two value rows (t, t + 1) at a time
  // against the bfloat16 weight pairs wb.
  void value_pairs(const T* v, const T* wb, int64_t stride, int64_t even, float* acc) const {
    constexpr int64_t kHalves = D / 32;
    const __m512i first = unpair_index(0), second = unpair_index(1);
    __m512 lo[VB][kHalves], hi[VB][kHalves];
    for (int64_t i = 0; i < VB; ++i)
      for (int64_t j = 0; j < kHalves; ++j) lo[i][j] = hi[i][j] = _mm512_setzero_ps();
    for (int64_t t = 0; t < even; t += 2) {
      __m512bh plo[kHalves], phi[kHalves];
      for (int64_t j = 0; j < kHalves; ++j) {
        const __m512i r0 = _mm512_loadu_si512(v + t * D + 32 * j), r1 = _mm512_loadu_si512(v + (t + 1) * D + 32 * j);
        plo[j] = (__m512bh)_mm512_unpacklo_epi16(r0, r1);
        phi[j] = (__m512bh)_mm512_unpackhi_epi16(r0, r1);
      }
      for (int64_t i = 0; i < VB; ++i) {
        int32_t pair;
        std::memcpy(&pair, wb + i * stride + t, sizeof pair);
        const __m512bh ww = (__m512bh)_mm512_set1_epi32(pair);
        for (int64_t j = 0; j < kHalves; ++j) {
          lo[i][j] = _mm512_dpbf16_ps(lo[i][j], plo[j], ww);
          hi[i][j] = _mm512_dpbf16_ps(hi[i][j], phi[j], ww);
        }
      }
    }
    for (int64_t i = 0; i < VB; ++i)
      for (int64_t j = 0; j < kHalves; ++j) {
        float* a = acc + i * (D + 2) + 32 * j;
        _mm512_storeu_ps(a, _mm512_add_ps(_mm512_loadu_ps(a), _mm512_permutex2var_ps(lo[i][j], first, hi[i][j])));
        _mm512_storeu_ps(a + 16, _mm512_add_ps(_mm512_loadu_ps(a + 16),
                                               _mm512_permutex2var_ps(lo[i][j], second, hi[i][j])));
      }
  }
#else
  void score_pairs(const T*, const T*, int64_t, float*, int64_t) const {}
  void value_pairs(const T*, const T*, int64_t, int64_t, float*) const {}
#endif
};

template <typename T, int64_t D, int64_t GB>
void decode(const VecPages<T, D, GB>& kernel, int64_t B, T* out) {
  const int64_t Hkv = kernel.Hkv, G = kernel.G, bs = kernel.bs;
  std::vector<int64_t> offsets(B + 1, 0);  // work items of sequences before b, per KV head
  for (int64_t b = 0; b < B; ++b) offsets[b + 1] = offsets[b] + (kernel.lens[b] + kRun * bs - 1) / (kRun * bs);
  const int64_t runs = offsets[B], part_size = G * (D + 2);
  std::vector<float> parts(runs * Hkv * part_size);
  at::parallel_for(0, runs * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf, w;
    std::vector<T> wb;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t run = item / Hkv, h = item % Hkv;
      const int64_t b = std::upper_bound(offsets.begin(), offsets.end(), run) - offsets.begin() - 1;
      kernel.run(b, h, run - offsets[b], parts.data() + item * part_size, qf, w, wb);
    }
  });
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / Hkv, h = item % Hkv;
      for (int64_t g = 0; g < G; ++g) {
        float top = -std::numeric_limits<float>::infinity(), sum = 0.f, acc[D] = {};
        for (int64_t run = offsets[b]; run < offsets[b + 1]; ++run)
          top = std::max(top, parts[(run * Hkv + h) * part_size + g * (D + 2)]);
        for (int64_t run = offsets[b]; run < offsets[b + 1]; ++run) {
          const float* part = parts.data() + (run * Hkv + h) * part_size + g * (D + 2);
          const float f = std::exp(part[0] - top);
          sum += f * part[1];
          for (int64_t d = 0; d < D; ++d) acc[d] += f * part[2 + d];
        }
        T* o = out + (b * kernel.Hq + h * G + g) * D;
        for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(acc[d] / sum);
      }
    }
  });
}
#endif

at::Tensor vec_pages_decode_attention(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& page_lists,
                                      const at::Tensor& lens, double scale) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  TORCH_CHECK(q.dim() == 3 && kv_cache.dim() == 4 && page_lists.dim() == 3,
              "q must be [B, Hq, D], kv_cache [num_blocks, Hkv, bs, 2 * D] and page_lists [B, Hkv, P]");
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t num_blocks = kv_cache.size(0), Hkv = kv_cache.size(1), bs = kv_cache.size(2);
  TORCH_CHECK(kv_cache.size(3) == 2 * D && kv_cache.is_contiguous(), "kv_cache must be contiguous [num_blocks, Hkv, ",
              "bs, 2 * D]");
  TORCH_CHECK(q.scalar_type() == kv_cache.scalar_type(), "q and the KV cache must share a dtype");
  TORCH_CHECK(Hq % Hkv == 0 && bs % 16 == 0, "query heads must be a multiple of KV heads and pages of 16k tokens");
  const auto list = page_lists.to(at::kLong).contiguous();
  const auto n = lens.to(at::kLong).contiguous();
  TORCH_CHECK(list.size(0) == B && list.size(1) == Hkv && n.numel() == B, "page_lists must be [B, Hkv, P], lens [B]");
  const int64_t P = list.size(2);
  const auto *lp = list.data_ptr<int64_t>(), *np = n.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(np[b] >= 1 && np[b] <= P * bs, "lens[", b, "] = ", np[b], " is outside 1..", P * bs);
    for (int64_t h = 0; h < Hkv; ++h)
      for (int64_t p = 0; p < (np[b] + bs - 1) / bs; ++p)
        TORCH_CHECK(lp[(b * Hkv + h) * P + p] >= 0 && lp[(b * Hkv + h) * P + p] < num_blocks, "page_lists[", b,
                    ", ", h, ", ", p, "] = ", lp[(b * Hkv + h) * P + p], " is not a page of the cache");
  }
  const auto qc = q.contiguous();
  auto out = at::empty_like(qc);
  AT_DISPATCH_REDUCED_FLOATING_TYPES(q.scalar_type(), "vec_pages_decode_attention", [&] {
    const auto run = [&](auto head_dim) {
      constexpr int64_t kD = decltype(head_dim)::value;
      const auto go = [&](auto heads) {
        const VecPages<scalar_t, kD, decltype(heads)::value> kernel{
            qc.data_ptr<scalar_t>(), kv_cache.data_ptr<scalar_t>(), Hq, Hkv, Hq / Hkv, bs, P, lp, np,
            static_cast<float>(scale)};
        decode(kernel, B, out.data_ptr<scalar_t>());
      };
      const int64_t G = Hq / Hkv;
      if (G % 4 == 0) {
        go(std::integral_constant<int64_t, 4>{});
      } else if (G % 3 == 0) {
        go(std::integral_constant<int64_t, 3>{});
      } else if (G % 2 == 0) {
        go(std::integral_constant<int64_t, 2>{});
      } else {
        go(std::integral_constant<int64_t, 1>{});
      }
    };
    rayapp::with_head_dim(D, run);
  });
  return out;
#else
  TORCH_CHECK(false, "vec_pages_decode_attention needs AVX-512 (native.handles_vec_pages)");
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(rayapp_cpu, m) {
  m.def("vec_pages_decode_attention(Tensor q, Tensor kv_cache, Tensor page_lists, Tensor lens, float scale) -> Tensor");
  m.impl("vec_pages_decode_attention", c10::DispatchKey::CPU, TORCH_FN(vec_pages_decode_attention));
}
