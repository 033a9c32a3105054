// The AVX-512 variant of the op's attention loop (decoder_layers.cpp's attention_rows) for bf16 queries, keys and
// values, the activation dtype of the lab's CPU defaults. It computes the same numbers as the portable loop:
// - a score is a float64 sum of exact products of two bf16 inputs, exact itself (barring an exponent spread over
//   ~30 bits), so the order of its adds (eight lanes, then _mm512_reduce_add_pd) gives the same number;
// - the softmax is ATen's float64 softmax over the same [kv_heads, shared * T, S] scores;
// - each row's weighted sum of values adds its visible keys in key order, one float64 multiply and one add per
//   element as the portable loop (no fused multiply-add: the product of a weight and a value is not exact), then
//   rounds double -> float -> bf16.
// What differs is the work: the cache is read as bf16 in place for any number of rows (the portable loop widens the
// whole cache to float64 for a verify forward), and each key and value is widened once per kv head and used for all
// of its query rows (the heads that share it times the T rows) instead of once per row (values: up to four rows, as
// in a decode step, widen each value in registers where they use it; more rows widen them into a buffer once). A
// row's numbers do not depend on the other rows, on T or on the thread count: threads split keys (scores) and value
// columns, never a sum.
#include "attention.h"
#include "bf16_avx512.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <limits>
#include <vector>

namespace attention {
namespace {

constexpr int64_t kLanes = 8;       // float64 lanes of a 512-bit vector
constexpr int64_t kMaxChunks = 16;  // head dims up to 128
constexpr int64_t kKeyBlock = 32;   // keys per score task
constexpr int64_t kColumnChunks = 2;  // 8-double chunks of the head dim per value task
constexpr int64_t kSerialWork = int64_t(1) << 15;  // multiply-adds below which one thread runs the whole loop

// eight bf16 -> eight float64, exact (a bf16 is the high half of its float)
__attribute__((target("avx512f"))) inline __m512d widen8(const uint16_t* p) {
  const __m256i bits = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_cvtps_pd(_mm256_castsi256_ps(_mm256_slli_epi32(bits, 16)));
}

// scores[r, s] for the query rows of one kv head (q: [R, dim] float64) against its keys s in [s0, s1)
__attribute__((target("avx512f"))) void scores_block(const double* q, int64_t R, int64_t rows, const uint16_t* k,
                                                   int64_t dim, int64_t keys, int64_t s0, int64_t s1,
                                                   const bool* hidden, double scaling, double* out) {
  const int64_t chunks = dim / kLanes;
  __m512d key[kMaxChunks];
  for (int64_t s = s0; s < s1; ++s) {
    for (int64_t c = 0; c < chunks; ++c) key[c] = widen8(k + s * dim + c * kLanes);
    for (int64_t r = 0; r < R; ++r) {
      const double* qr = q + r * dim;
      __m512d sum = _mm512_mul_pd(_mm512_loadu_pd(qr), key[0]);
      for (int64_t c = 1; c < chunks; ++c) sum = _mm512_fmadd_pd(_mm512_loadu_pd(qr + c * kLanes), key[c], sum);
      const int64_t t = r % rows;  // the query row of task r (exact_attention's [shared * T] layout)
      out[r * keys + s] = (hidden != nullptr && hidden[t * keys + s]) ? -std::numeric_limits<double>::infinity()
                                                                       : _mm512_reduce_add_pd(sum) * scaling;
    }
  }
}

// acc[r, columns] = sum over s in order of weights[r, s] * v[s, columns] for chunks [c0, c0 + C) of the head dim, for
// the rows [r0, r0 + RB): the accumulators stay in registers and each value is read once per block of rows, widened
// here from the bf16 values v (kWiden) or from their widened copy `widened` [keys, C * 8]
template <int RB, int C, bool kWiden>
__attribute__((target("avx512f"))) void values_rows(const double* weights, int64_t r0, const uint16_t* v,
                                                  const double* widened, int64_t keys, double* acc, int64_t dim,
                                                  int64_t c0) {
  __m512d sum[RB][C];
  for (int r = 0; r < RB; ++r) {
    for (int c = 0; c < C; ++c) sum[r][c] = _mm512_setzero_pd();
  }
  for (int64_t s = 0; s < keys; ++s) {
    __m512d value[C];
    for (int c = 0; c < C; ++c) {
      value[c] = kWiden ? widen8(v + s * dim + (c0 + c) * kLanes) : _mm512_loadu_pd(widened + (s * C + c) * kLanes);
    }
    for (int r = 0; r < RB; ++r) {
      const double w = weights[(r0 + r) * keys + s];
      if (w == 0) continue;  // a masked key (or an underflowed weight) adds exactly nothing
      const __m512d weight = _mm512_set1_pd(w);
      for (int c = 0; c < C; ++c) sum[r][c] = _mm512_add_pd(sum[r][c], _mm512_mul_pd(weight, value[c]));
    }
  }
  for (int r = 0; r < RB; ++r) {
    for (int c = 0; c < C; ++c) _mm512_storeu_pd(acc + (r0 + r) * dim + (c0 + c) * kLanes, sum[r][c]);
  }
}

// every row's weighted sum of values for chunks [c0, c0 + C) of the head dim: up to four rows widen each value where
// they use it; more rows widen the values once, then take them in blocks of four
template <int C>
__attribute__((target("avx512f"))) void values_block(const double* weights, int64_t R, const uint16_t* v,
                                                   int64_t dim, int64_t keys, int64_t c0, double* acc) {
  switch (R) {
    case 1: return values_rows<1, C, true>(weights, 0, v, nullptr, keys, acc, dim, c0);
    case 2: return values_rows<2, C, true>(weights, 0, v, nullptr, keys, acc, dim, c0);
    case 3: return values_rows<3, C, true>(weights, 0, v, nullptr, keys, acc, dim, c0);
    case 4: return values_rows<4, C, true>(weights, 0, v, nullptr, keys, acc, dim, c0);
    default: break;
  }
  thread_local std::vector<double> widened;
  widened.resize(keys * C * kLanes);
  for (int64_t s = 0; s < keys; ++s) {
    for (int c = 0; c < C; ++c) _mm512_storeu_pd(widened.data() + (s * C + c) * kLanes, widen8(v + s * dim + (c0 + c) * kLanes));
  }
  int64_t r0 = 0;
  for (; r0 + 4 <= R; r0 += 4) values_rows<4, C, false>(weights, r0, v, widened.data(), keys, acc, dim, c0);
  for (; r0 < R; ++r0) values_rows<1, C, false>(weights, r0, v, widened.data(), keys, acc, dim, c0);
}

// the query rows [1, heads, T, dim] of bf16 bits as float64 (exact) in exact_attention's layout [kv_heads, shared * T,
// dim]
__attribute__((target("avx512f"))) void widen_queries(const uint16_t* q_bits, int64_t heads, int64_t rows,
                                                    int64_t shared, int64_t R, int64_t dim, double* q) {
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t t = 0; t < rows; ++t) {
      const int64_t kv = h / shared, r = (h % shared) * rows + t;
      for (int64_t j = 0; j < dim; j += kLanes) {
        _mm512_storeu_pd(q + (kv * R + r) * dim + j, widen8(q_bits + (h * rows + t) * dim + j));
      }
    }
  }
}

// out [1, T, heads, dim] = bf16(float(acc)) for each head's rows (double -> float -> bf16, each rounding to nearest
// even, as the scalar casts: _mm512_cvtpd_ps rounds in the default mode, bf16_avx512.h as c10::BFloat16)
__attribute__((target("avx512f,avx512bw"))) void write_rows(const double* acc, int64_t heads, int64_t rows,
                                                          int64_t shared, int64_t R, int64_t dim, c10::BFloat16* o) {
  const bool vectors = bf16x16::bf16_vectors() && dim % 16 == 0;
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t t = 0; t < rows; ++t) {
      const double* a = acc + ((h / shared) * R + (h % shared) * rows + t) * dim;
      c10::BFloat16* row = o + (t * heads + h) * dim;
      int64_t j = 0;
      for (; vectors && j < dim; j += 16) {
        const __m256 low = _mm512_cvtpd_ps(_mm512_loadu_pd(a + j)), high = _mm512_cvtpd_ps(_mm512_loadu_pd(a + j + 8));
        bf16x16::store(row + j, _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(low)),
                                                                  _mm256_castps_pd(high), 1)));
      }
      for (; j < dim; ++j) row[j] = static_cast<c10::BFloat16>(static_cast<float>(a[j]));
    }
  }
}

// runs fn(begin, end) over [0, tasks) on the threads when the loop has enough work, else on this thread
template <typename F>
void split(int64_t tasks, int64_t work, const F& fn) {
  if (work < kSerialWork) {
    fn(0, tasks);
  } else {
    at::parallel_for(0, tasks, 1, fn);
  }
}

}  // namespace

bool avx512_takes(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value) {
  static const bool cpu = __builtin_cpu_supports("avx512f");
  const int64_t dim = query.size(3);
  return cpu && query.scalar_type() == at::kBFloat16 && key.scalar_type() == at::kBFloat16 &&
         value.scalar_type() == at::kBFloat16 && dim % kLanes == 0 && dim / kLanes <= kMaxChunks;
}

at::Tensor avx512_rows(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const bool* hidden,
                       double scaling) {
  const int64_t heads = query.size(1), rows = query.size(2), dim = query.size(3);
  const int64_t kv_heads = key.size(1), keys = key.size(2), shared = heads / kv_heads, R = shared * rows;
  const at::Tensor qc = query.contiguous(), kc = rows_contiguous(key), vc = rows_contiguous(value);
  const int64_t k_head = kc.stride(1), v_head = vc.stride(1);  // a cache's heads lie capacity rows apart
  const uint16_t* q_bits = reinterpret_cast<const uint16_t*>(qc.data_ptr());
  const uint16_t* k = reinterpret_cast<const uint16_t*>(kc.data_ptr());
  const uint16_t* v = reinterpret_cast<const uint16_t*>(vc.data_ptr());
  // the query rows of each kv head in exact_attention's layout [kv_heads, shared * T, dim], widened (exact)
  std::vector<double> q(kv_heads * R * dim);
  widen_queries(q_bits, heads, rows, shared, R, dim, q.data());
  const int64_t work = heads * rows * keys * dim;
  at::Tensor scores = at::empty({kv_heads, R, keys}, query.options().dtype(at::kDouble));
  double* score_data = scores.data_ptr<double>();
  const int64_t key_blocks = (keys + kKeyBlock - 1) / kKeyBlock;
  split(kv_heads * key_blocks, work, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t kv = task / key_blocks, s0 = (task % key_blocks) * kKeyBlock;
      scores_block(q.data() + kv * R * dim, R, rows, k + kv * k_head, dim, keys, s0,
                   std::min(keys, s0 + kKeyBlock), hidden, scaling, score_data + kv * R * keys);
    }
  });
  const at::Tensor weights = at::softmax(scores, -1);
  const double* weight_data = weights.data_ptr<double>();
  std::vector<double> acc(kv_heads * R * dim);
  const int64_t chunks = dim / kLanes, column_tasks = (chunks + kColumnChunks - 1) / kColumnChunks;
  split(kv_heads * column_tasks, work, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t kv = task / column_tasks, c0 = (task % column_tasks) * kColumnChunks;
      const double* weights = weight_data + kv * R * keys;
      double* rows_acc = acc.data() + kv * R * dim;
      if (c0 + kColumnChunks <= chunks) {
        values_block<kColumnChunks>(weights, R, v + kv * v_head, dim, keys, c0, rows_acc);
      } else {
        values_block<1>(weights, R, v + kv * v_head, dim, keys, c0, rows_acc);
      }
    }
  });
  at::Tensor out = at::empty({1, rows, heads, dim}, query.options());
  write_rows(acc.data(), heads, rows, shared, R, dim, out.data_ptr<c10::BFloat16>());
  return out;
}

}  // namespace attention
