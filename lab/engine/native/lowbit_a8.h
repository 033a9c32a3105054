// What the products with 8-bit activation blocks share (lowbit_w4a8.cpp: Q4_1 weights, lowbit_w8a8.cpp: Q8_0
// weights): step 1, each row of x quantized per block of 32 inputs, d = max |x| / 127, q = round_half_even(x * (1 /
// d)) in [-127, 127] (q = 0 where d = 0), its integer sum and s = d * sum(q), all in float; the instruction-set
// variants both products have; the dispatch of a tile kernel by its row count.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

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

inline float half_value(uint16_t bits) { return static_cast<float>(c10::Half(bits, c10::Half::from_bits())); }

inline void quantize_rows(const float* x, int64_t m, int64_t k, Q8Rows& out) {
  const int64_t blocks = k / kBlock;
  out.m = m;
  out.q.resize(m * k);
  out.d.resize(m * blocks);
  out.s.resize(m * blocks);
  out.sum.resize(m * blocks);
  for (int64_t b = 0; b < m * blocks; ++b) {
    const float* v = x + b * kBlock;
    float amax = 0.0f;
    for (int64_t j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(v[j]));
    const float d = amax / 127.0f;
    const float inverse = d != 0.0f ? 1.0f / d : 0.0f;
    int32_t sum = 0;
    for (int64_t j = 0; j < kBlock; ++j) {
      const float scaled = v[j] * inverse;
      const int32_t q = static_cast<int32_t>(std::nearbyint(scaled));  // the default rounding: half to even
      out.q[b * kBlock + j] = static_cast<int8_t>(q);
      sum += q;
    }
    out.d[b] = d;
    out.s[b] = d * static_cast<float>(sum);
    out.sum[b] = sum;
  }
}

// x [M, K] (bf16, fp16 or float32) quantized by step 1 into the calling thread's buffer
inline const Q8Rows& quantized(const at::Tensor& x) {
  thread_local Q8Rows rows;
  const at::Tensor wide = x.to(at::kFloat).contiguous();
  quantize_rows(wide.data_ptr<float>(), x.size(0), x.size(1), rows);
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
