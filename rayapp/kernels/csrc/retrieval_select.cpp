// Retrieval block selection on CPU: each (sequence, KV head) scores its middle blocks against the step's queries
// and keeps the top k, in one pass over the block representations, read in place from a per-page store. Built with
// paged_decode.cpp by rayapp/kernels/native.py; it must match rayapp.kernels.retrieval.score_blocks("multimean")
// followed by select_topk_blocks (tests/kernels/test_native.py).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <vector>

#include "common.h"

namespace {

// The best dot product of G queries qf [G, D] with R representative keys rep [R, D].
template <int64_t D>
inline float best_dot(const float* qf, int64_t G, const float* rep, int64_t R) {
  float best = -std::numeric_limits<float>::infinity();
#if defined(__AVX512F__)
  for (int64_t r = 0; r < R; ++r, rep += D) {
    __m512 row[D / 16];
    for (int64_t j = 0; j < D / 16; ++j) row[j] = _mm512_loadu_ps(rep + 16 * j);
    for (int64_t g = 0; g < G; ++g) {
      __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qf + g * D), row[0]);
      for (int64_t j = 1; j < D / 16; ++j) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qf + g * D + 16 * j), row[j], acc);
      best = std::max(best, _mm512_reduce_add_ps(acc));
    }
  }
#else
  for (int64_t r = 0; r < R; ++r)
    for (int64_t g = 0; g < G; ++g) best = std::max(best, rayapp::dot<D>(qf + g * D, rep + r * D));
#endif
  return best;
}

constexpr int64_t kAhead = 2;   // blocks prefetched ahead
constexpr int64_t kChunk = 64;  // blocks scored per work item, so one long sequence still uses every thread

// q: [B, Hq, D]; reps: [Hkv, P, R, D] float32, block i of sequence b of head h at reps[h, keys[b, i]];
// out: [B, Hkv, K] (K = max k), the k[b] best of the first n[b] blocks ascending, 0 past k[b].
template <typename T, int64_t D>
void select(const T* q, const float* reps, const int64_t* keys, const int64_t* n, const int64_t* k, int64_t* out,
            int64_t B, int64_t Hq, int64_t Hkv, int64_t P, int64_t R, int64_t N, int64_t K) {
  const int64_t G = Hq / Hkv, chunks = (N + kChunk - 1) / kChunk;
  std::vector<float> scores(B * Hkv * N);
  at::parallel_for(0, B * Hkv * chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t row = item / chunks, b = row / Hkv, h = row % Hkv;
      const int64_t first = item % chunks * kChunk, last = std::min(first + kChunk, n[b]);
      if (first >= last) continue;
      const T* qb = q + (b * Hq + h * G) * D;
      for (int64_t i = 0; i < G * D; ++i) qf[i] = static_cast<float>(qb[i]);
      float* s = scores.data() + row * N;
      const float* head = reps + h * P * R * D;
      for (int64_t i = first; i < last; ++i) {
#if defined(__AVX512F__)
        // The blocks' representations are scattered by page: fetch the one kAhead blocks on while this one scores.
        if (i + kAhead < last) {
          const char* next = reinterpret_cast<const char*>(head + keys[b * N + i + kAhead] * R * D);
          for (int64_t line = 0; line < R * D * 4; line += 64) _mm_prefetch(next + line, _MM_HINT_T0);
        }
#endif
        const float best = best_dot<D>(qf.data(), G, head + keys[b * N + i] * R * D, R);
        s[i] = std::isnan(best) ? -std::numeric_limits<float>::infinity() : best;
      }
    }
  });
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> order;
    for (int64_t row = begin; row < end; ++row) {
      const int64_t b = row / Hkv;
      const float* s = scores.data() + row * N;
      // Best first, the lower block first among equals (a strict order whatever the scores).
      const auto better = [s](int64_t x, int64_t y) { return s[x] > s[y] || (s[x] == s[y] && x < y); };
      order.resize(n[b]);
      std::iota(order.begin(), order.end(), 0);
      std::nth_element(order.begin(), order.begin() + k[b], order.end(), better);
      std::sort(order.begin(), order.begin() + k[b]);
      int64_t* o = out + row * K;
      std::copy(order.begin(), order.begin() + k[b], o);
      std::fill(o + k[b], o + K, 0);
    }
  });
}

at::Tensor select_retrieval_blocks(const at::Tensor& q, const at::Tensor& reps, const at::Tensor& block_keys,
                                   const at::Tensor& num_blocks, const at::Tensor& num_selected) {
  TORCH_CHECK(q.dim() == 3 && reps.dim() == 4, "q must be [B, Hq, D] and reps [Hkv, P, R, D]");
  TORCH_CHECK(reps.scalar_type() == at::kFloat && reps.is_contiguous(), "reps must be contiguous float32");
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t Hkv = reps.size(0), P = reps.size(1), R = reps.size(2);
  TORCH_CHECK(reps.size(3) == D && Hq % Hkv == 0, "query heads must be a multiple of reps' KV heads, of one dim");
  const auto keys = block_keys.to(at::kLong).contiguous();
  const auto n = num_blocks.to(at::kLong).contiguous(), k = num_selected.to(at::kLong).contiguous();
  TORCH_CHECK(keys.dim() == 2 && keys.size(0) == B && n.numel() == B && k.numel() == B,
              "block_keys must be [B, N], num_blocks and num_selected [B]");
  const int64_t N = keys.size(1);
  const auto *kp = keys.data_ptr<int64_t>(), *np = n.data_ptr<int64_t>(), *sp = k.data_ptr<int64_t>();
  int64_t K = 0;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(0 <= sp[b] && sp[b] <= np[b] && np[b] <= N, "row ", b, ": selects ", sp[b], " of ", np[b],
                " blocks (of ", N, ")");
    for (int64_t i = 0; i < np[b]; ++i)
      TORCH_CHECK(kp[b * N + i] >= 0 && kp[b * N + i] < P, "block_keys[", b, ", ", i, "] = ", kp[b * N + i],
                  " is not a row of reps");
    K = std::max(K, sp[b]);
  }
  const auto qc = q.contiguous();
  auto out = at::empty({B, Hkv, K}, q.options().dtype(at::kLong));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "select_retrieval_blocks", [&] {
    const auto run = [&](auto head_dim) {
      select<scalar_t, decltype(head_dim)::value>(qc.data_ptr<scalar_t>(), reps.data_ptr<float>(), kp, np, sp,
                                                  out.data_ptr<int64_t>(), B, Hq, Hkv, P, R, N, K);
    };
    rayapp::with_head_dim(D, run);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(rayapp_cpu, m) {
  m.def("select_retrieval_blocks(Tensor q, Tensor reps, Tensor block_keys, Tensor num_blocks, "
        "Tensor num_selected) -> Tensor");
  m.impl("select_retrieval_blocks", c10::DispatchKey::CPU, TORCH_FN(select_retrieval_blocks));
}
