// What the products with 8-bit activation blocks share (lowbit_w4a8.cpp: Q4_1 weights, lowbit_w8a8.cpp: Q8_0
// weights): step 1, each row of x quantized per block of 32 inputs, d = max |x| / 127, q = round_half_even(x * (1 /
// d)) in [-127, 127] (q = 0 where d = 0), its integer sum and s = d * sum(q), all in float; the instruction-set
// variants both products have; the dispatch of a tile kernel by its row count.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "bf16_avx512.h"
#include "lowbit_common.h"

namespace lowbit {
namespace a8 {

constexpr int64_t kBlock = 32;  // inputs per weight / activation block (lab.engine.quant.GROUP)
constexpr int64_t kCols = 16;   // output columns per tile of the packed weights
constexpr int kMaxRows = 8;     // rows per pass over a tile's weights (registers)

struct Q8Rows {  // step 1's quantized activations
  std::vector<int8_t> q;     // [M, K]
  std::vector<float> d, s;   // [M, K / 32]
  std::vector<int32_t> sum;  // [M, K / 32], sum(q)
  int64_t m = 0;
};

// Where a product's [M, N] outputs go: float32, or bf16 rounded once as c10::BFloat16(float) does (to nearest even,
// NaN -> 0x7FC0), each written by the tile that computed it (no float copy of the result, no conversion pass).
struct Outputs {
  float* floats = nullptr;   // [M, N], or
  uint16_t* bf16 = nullptr;  // [M, N] bf16 bits
  int64_t n = 0;
  void put(int64_t r, int64_t c, float value) const {
    if (bf16 != nullptr) {
      bf16[r * n + c] = to_bf16(value);
    } else {
      floats[r * n + c] = value;
    }
  }
  void put16(int64_t r, int64_t c, const float* values) const {  // row r, columns c .. c + 15
    for (int64_t i = 0; i < 16; ++i) put(r, c + i, values[i]);
  }
};

__attribute__((target("avx512f,avx512bw"))) inline void put16(const Outputs& out, int64_t r, int64_t c, __m512 values) {
  if (out.bf16 != nullptr) {
    bf16x16::store(out.bf16 + r * out.n + c, values);
  } else {
    _mm512_storeu_ps(out.floats + r * out.n + c, values);
  }
}

// The [M, N] result of a product of x: bf16 for bf16 x (written by the tiles), else float32 (`finished` converts
// it to x's dtype), with the Outputs that point into it
inline std::pair<at::Tensor, Outputs> result(const at::Tensor& x, int64_t m, int64_t n) {
  if (x.scalar_type() == at::kBFloat16) {
    at::Tensor out = at::empty({m, n}, x.options());
    return {out, Outputs{nullptr, reinterpret_cast<uint16_t*>(out.data_ptr()), n}};
  }
  at::Tensor out = at::empty({m, n}, x.options().dtype(at::kFloat));
  return {out, Outputs{out.data_ptr<float>(), nullptr, n}};
}

inline at::Tensor finished(const at::Tensor& out, const at::Tensor& x) {
  return out.scalar_type() == x.scalar_type() ? out : out.to(x.scalar_type());
}

inline float half_value(uint16_t bits) { return static_cast<float>(c10::Half(bits, c10::Half::from_bits())); }

// step 1 for one block of 32 floats (the definition the vector variants below are tested against)
inline void quantize_block(const float* v, int8_t* q, float& d_out, float& s_out, int32_t& sum_out) {
  float amax = 0.0f;
  for (int64_t j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(v[j]));
  const float d = amax / 127.0f;
  const float inverse = d != 0.0f ? 1.0f / d : 0.0f;
  int32_t sum = 0;
  for (int64_t j = 0; j < kBlock; ++j) {
    const float scaled = v[j] * inverse;
    const int32_t value = static_cast<int32_t>(std::nearbyint(scaled));  // the default rounding: half to even
    q[j] = static_cast<int8_t>(value);
    sum += value;
  }
  d_out = d;
  s_out = d * static_cast<float>(sum);
  sum_out = sum;
}

inline void size_rows(int64_t m, int64_t k, Q8Rows& out) {
  out.m = m;
  out.q.resize(m * k);
  out.d.resize(m * k / kBlock);
  out.s.resize(m * k / kBlock);
  out.sum.resize(m * k / kBlock);
}

inline void quantize_rows_reference(const float* x, int64_t blocks, Q8Rows& out) {
  for (int64_t b = 0; b < blocks; ++b) {
    quantize_block(x + b * kBlock, out.q.data() + b * kBlock, out.d[b], out.s[b], out.sum[b]);
  }
}

// The same numbers with vector instructions: max |x| is exact in any order, x * (1 / d) is the same one float
// product per input, and the conversion to int32 rounds half to even (the default MXCSR mode, as nearbyint).
__attribute__((target("avx512f"))) inline void quantize_rows_avx512(const float* x, int64_t blocks, Q8Rows& out) {
  for (int64_t b = 0; b < blocks; ++b) {
    const __m512 lo = _mm512_loadu_ps(x + b * kBlock), hi = _mm512_loadu_ps(x + b * kBlock + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    const float d = amax / 127.0f;
    const __m512 inverse = _mm512_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
    const __m512i q_lo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inverse));
    const __m512i q_hi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inverse));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out.q.data() + b * kBlock), _mm512_cvtepi32_epi8(q_lo));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out.q.data() + b * kBlock + 16), _mm512_cvtepi32_epi8(q_hi));
    const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q_lo, q_hi));
    out.d[b] = d;
    out.s[b] = d * static_cast<float>(sum);
    out.sum[b] = sum;
  }
}

__attribute__((target("avx2"))) inline void quantize_rows_avx2(const float* x, int64_t blocks, Q8Rows& out) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t b = 0; b < blocks; ++b) {
    const float* v = x + b * kBlock;
    __m256 parts[4];
    __m256 top = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      parts[i] = _mm256_loadu_ps(v + 8 * i);
      top = _mm256_max_ps(top, _mm256_andnot_ps(sign, parts[i]));
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, top);
    float amax = 0.0f;
    for (const float lane : lanes) amax = std::max(amax, lane);
    const float d = amax / 127.0f;
    const __m256 inverse = _mm256_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
    alignas(32) int32_t values[kBlock];
    __m256i total = _mm256_setzero_si256();
    for (int i = 0; i < 4; ++i) {
      const __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(parts[i], inverse));
      _mm256_store_si256(reinterpret_cast<__m256i*>(values + 8 * i), q);
      total = _mm256_add_epi32(total, q);
    }
    alignas(32) int32_t sums[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(sums), total);
    int32_t sum = 0;
    for (const int32_t s : sums) sum += s;
    for (int64_t j = 0; j < kBlock; ++j) out.q[b * kBlock + j] = static_cast<int8_t>(values[j]);
    out.d[b] = d;
    out.s[b] = d * static_cast<float>(sum);
    out.sum[b] = sum;
  }
}

// x [M, K] (bf16, fp16 or float32) quantized by step 1 into the calling thread's buffer, with the widest
// instruction set `variant` allows (every one gives the same bits; kReference: the plain definition)
inline const Q8Rows& quantized(const at::Tensor& x, int64_t variant = kBest) {
  thread_local Q8Rows rows;
  thread_local std::vector<float> buffer;
  at::Tensor wide;
  const float* values;
  if (x.scalar_type() == at::kBFloat16) {
    values = widened(x, buffer);  // exact, without a tensor allocation per product
  } else {
    wide = x.to(at::kFloat).contiguous();
    values = wide.data_ptr<float>();
  }
  const int64_t m = x.size(0), k = x.size(1), blocks = m * k / kBlock;
  size_rows(m, k, rows);
  const bool vector512 = variant == kBest || variant == kAvx512 || variant == kAvx512Vnni;
  const bool vector256 = vector512 || variant == kAvx2 || variant == kAvxVnni;
  if (vector512 && lowbit::supports(kAvx512)) {
    quantize_rows_avx512(values, blocks, rows);
  } else if (vector256 && lowbit::supports(kAvx2)) {
    quantize_rows_avx2(values, blocks, rows);
  } else {
    quantize_rows_reference(values, blocks, rows);
  }
  return rows;
}

// lowbit_common.h's `supports` for these products' variants; the 256-bit ones also widen fp16 scales with F16C
inline bool supports(int64_t variant) {
  if (variant != kReference && variant != kAvx2 && variant != kAvxVnni && variant != kAvx512Vnni) return false;
  return lowbit::supports(variant) &&
         (variant == kReference || variant == kAvx512Vnni || __builtin_cpu_supports("f16c"));
}

inline std::vector<int64_t> variants() {
  std::vector<int64_t> out;
  for (const int64_t v : {kReference, kAvx2, kAvxVnni, kAvx512Vnni}) {
    if (supports(v)) out.push_back(v);
  }
  return out;
}

// kBest as the widest variant this CPU runs (found once), else the variant asked for, checked
inline int64_t resolve(int64_t variant, const char* product) {
  static const int64_t best = variants().back();
  if (variant == kBest) return best;
  TORCH_CHECK(supports(variant), product, ": instruction-set variant ", variant, " is not supported by this CPU");
  return variant;
}

// a tile kernel instantiated for 1 to kMaxRows rows: Pick<R>::fn
template <typename Fn, template <int> class Pick>
Fn pick_rows(int rows) {
  switch (rows) {
    case 1: return Pick<1>::fn;
    case 2: return Pick<2>::fn;
    case 3: return Pick<3>::fn;
    case 4: return Pick<4>::fn;
    case 5: return Pick<5>::fn;
    case 6: return Pick<6>::fn;
    case 7: return Pick<7>::fn;
    default: return Pick<8>::fn;
  }
}

// the rows in passes of at most kMaxRows, of even size (9 rows as 5 + 4, not 8 + 1), the tiles over the threads
template <typename Each>
void over_tiles(int64_t rows, int64_t tiles, const Each& each) {
  const int64_t passes = (rows + kMaxRows - 1) / kMaxRows, per_pass = (rows + passes - 1) / passes;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t r0 = 0; r0 < rows; r0 += per_pass) each(t, r0, static_cast<int>(std::min(per_pass, rows - r0)));
    }
  });
}

}  // namespace a8
}  // namespace lowbit
