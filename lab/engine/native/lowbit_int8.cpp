// Row-efficient low-bit matrix products for bf16 activations with the bits of ATen's AVX-512 kernels (lowbit_mm.h):
// the int8 product, the switch and the ops; the int4 product is lowbit_int4.cpp.
//
// ATen's _weight_int4pack_mm_for_cpu and _weight_int8pack_mm work in blocks of 4 rows and unpack the weights again
// for every block. The kernels here read and unpack each weight tile once for a block of up to 6 rows (int4: once
// for all rows), and compute each output exactly as ATen's AVX-512 kernel does, whatever M, the other rows, the
// thread count or the instruction set. int8 (one scale per output channel): w = float(q) * s, 16 partial sums
// (lane l adds k = l, l + 16, ... with fma in order), then the lanes summed in _mm512_reduce_add_ps's tree (8 + 8,
// 4 + 4, 2 + 2, 1 + 1), rounded to bf16. Every step is a correctly rounded float operation, so the AVX-512, AVX2 and
// plain C++ variants give the same bits; threads split the output columns only.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <vector>

#include "lowbit_common.h"

namespace lowbit {
namespace {

constexpr int64_t kLanes = 16;  // the int8 kernel's partial sums (ATen's __m512)

// ---- int8 ---------------------------------------------------------------------------------------------------------
// _mm512_reduce_add_ps's order: lanes i + 8 onto i, then i + 4 onto i, then i + 2 onto i, then lane 1 onto lane 0
inline float lane_sum(const float* v) {
  float t8[8], t4[4];
  for (int i = 0; i < 8; ++i) t8[i] = v[i] + v[i + 8];
  for (int i = 0; i < 4; ++i) t4[i] = t8[i] + t8[i + 4];
  return (t4[0] + t4[2]) + (t4[1] + t4[3]);
}

struct Int8Weights {
  const int8_t* q;        // [N, K]
  const uint16_t* scales;  // [N] bf16 bits
  int64_t n, k;
};

void int8_reference(const float* a, int64_t m, const Int8Weights& w, uint16_t* out) {
  at::parallel_for(0, w.n, 1, [&](int64_t begin, int64_t end) {
    float lanes[kLanes];
    for (int64_t n = begin; n < end; ++n) {
      const float scale = bf16_value(w.scales[n]);
      for (int64_t r = 0; r < m; ++r) {
        std::fill(lanes, lanes + kLanes, 0.0f);
        for (int64_t k = 0; k < w.k; ++k) {
          const float weight = static_cast<float>(w.q[n * w.k + k]) * scale;
          lanes[k % kLanes] = std::fma(a[r * w.k + k], weight, lanes[k % kLanes]);
        }
        out[r * w.n + n] = to_bf16(lane_sum(lanes));
      }
    }
  });
}

// rows r < R of a times 4 weight rows starting at n (rows past the last repeat it; only real columns are stored)
template <int R>
__attribute__((target("avx512f"))) void int8_rows_avx512(const float* a, const Int8Weights& w, int64_t n,
                                                         uint16_t* out) {
  const int8_t* q[4];
  __m512 scale[4], c[R][4];
  for (int j = 0; j < 4; ++j) {
    const int64_t col = std::min(n + j, w.n - 1);
    q[j] = w.q + col * w.k;
    scale[j] = _mm512_set1_ps(bf16_value(w.scales[col]));
  }
#pragma GCC unroll 24
  for (int i = 0; i < R * 4; ++i) c[i / 4][i % 4] = _mm512_setzero_ps();
  for (int64_t k = 0; k < w.k; k += kLanes) {
    __m512 v[4];
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q[j] + k));
      v[j] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)), scale[j]);
    }
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m512 x = _mm512_loadu_ps(a + r * w.k + k);
      c[r][0] = _mm512_fmadd_ps(x, v[0], c[r][0]);
      c[r][1] = _mm512_fmadd_ps(x, v[1], c[r][1]);
      c[r][2] = _mm512_fmadd_ps(x, v[2], c[r][2]);
      c[r][3] = _mm512_fmadd_ps(x, v[3], c[r][3]);
    }
  }
  float lanes[kLanes];
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < 4 && n + j < w.n; ++j) {
      _mm512_storeu_ps(lanes, c[r][j]);
      out[r * w.n + n + j] = to_bf16(lane_sum(lanes));
    }
  }
}

// the same with the 16 lanes as two 8-float halves, two weight rows at a time
template <int R>
__attribute__((target("avx2,fma"))) void int8_rows_avx2(const float* a, const Int8Weights& w, int64_t n,
                                                        uint16_t* out) {
  for (int64_t pair = n; pair < std::min(n + 4, w.n); pair += 2) {
    const int8_t* q[2];
    __m256 scale[2], c[R][2][2];
    for (int j = 0; j < 2; ++j) {
      const int64_t col = std::min(pair + j, w.n - 1);
      q[j] = w.q + col * w.k;
      scale[j] = _mm256_set1_ps(bf16_value(w.scales[col]));
      for (int r = 0; r < R; ++r) c[r][j][0] = c[r][j][1] = _mm256_setzero_ps();
    }
    for (int64_t k = 0; k < w.k; k += kLanes) {
      __m256 v[2][2];
      for (int j = 0; j < 2; ++j) {
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q[j] + k));
        v[j][0] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), scale[j]);
        v[j][1] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8))), scale[j]);
      }
      for (int r = 0; r < R; ++r) {
        const __m256 lo = _mm256_loadu_ps(a + r * w.k + k), hi = _mm256_loadu_ps(a + r * w.k + k + 8);
        for (int j = 0; j < 2; ++j) {
          c[r][j][0] = _mm256_fmadd_ps(lo, v[j][0], c[r][j][0]);
          c[r][j][1] = _mm256_fmadd_ps(hi, v[j][1], c[r][j][1]);
        }
      }
    }
    float lanes[kLanes];
    for (int r = 0; r < R; ++r) {
      for (int j = 0; j < 2 && pair + j < w.n; ++j) {
        _mm256_storeu_ps(lanes, c[r][j][0]);
        _mm256_storeu_ps(lanes + 8, c[r][j][1]);
        out[r * w.n + pair + j] = to_bf16(lane_sum(lanes));
      }
    }
  }
}

void int8_block(int64_t variant, int64_t rows, const float* a, const Int8Weights& w, int64_t n, uint16_t* out) {
  if (variant == kAvx512) {
    switch (rows) {
      case 1: return int8_rows_avx512<1>(a, w, n, out);
      case 2: return int8_rows_avx512<2>(a, w, n, out);
      case 3: return int8_rows_avx512<3>(a, w, n, out);
      case 4: return int8_rows_avx512<4>(a, w, n, out);
      case 5: return int8_rows_avx512<5>(a, w, n, out);
      default: return int8_rows_avx512<6>(a, w, n, out);
    }
  }
  if (rows == 1) return int8_rows_avx2<1>(a, w, n, out);
  return int8_rows_avx2<2>(a, w, n, out);
}

void int8_vector(int64_t variant, const float* a, int64_t m, const Int8Weights& w, uint16_t* out) {
  const int64_t blocks = (w.n + 3) / 4, block_rows = variant == kAvx512 ? 6 : 2;
  at::parallel_for(0, blocks, 16, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t r0 = 0; r0 < m; r0 += block_rows) {
        int8_block(variant, std::min(block_rows, m - r0), a + r0 * w.k, w, b * 4, out + r0 * w.n);
      }
    }
  });
}

std::atomic<bool> kernels_on{true};

}  // namespace

bool active() { return kernels_on.load(std::memory_order_relaxed); }

// turns the kernels on or off in the decoder layers (for A/B measurements); returns the previous setting
bool set_active(bool on) { return kernels_on.exchange(on); }

bool int8_takes(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales) {
  return x.dim() == 2 && x.scalar_type() == at::kBFloat16 && scales.scalar_type() == at::kBFloat16 &&
         qweight.scalar_type() == at::kChar && qweight.dim() == 2 && qweight.size(1) == x.size(1) &&
         x.size(1) % kLanes == 0 && scales.dim() == 1 && scales.size(0) == qweight.size(0) &&
         qweight.is_contiguous() && scales.is_contiguous();
}


at::Tensor int8_mm(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales, int64_t variant) {
  TORCH_CHECK(int8_takes(x, qweight, scales), "int8_mm: bf16 x [M, K], int8 qweight [N, K], bf16 scales [N], ",
              "K a multiple of 16");
  variant = resolve(variant);
  thread_local std::vector<float> buffer;
  const float* a = widened(x, buffer);
  const int64_t m = x.size(0), n = qweight.size(0);
  at::Tensor out = at::empty({m, n}, x.options());
  const Int8Weights w{qweight.data_ptr<int8_t>(), reinterpret_cast<const uint16_t*>(scales.data_ptr()), n, x.size(1)};
  uint16_t* o = reinterpret_cast<uint16_t*>(out.data_ptr());
  if (m == 0 || n == 0) return out;
  if (variant == kReference) {
    int8_reference(a, m, w, o);
  } else {
    int8_vector(variant, a, m, w, o);
  }
  return out;
}

std::vector<int64_t> variants() {
  std::vector<int64_t> out;
  for (const int64_t v : {kReference, kAvx2, kAvx512}) {
    if (supports(v)) out.push_back(v);
  }
  return out;
}

}  // namespace lowbit

TORCH_LIBRARY_FRAGMENT(decoding_lab, m) {
  m.def("int4_mm(Tensor x, Tensor packed, Tensor scales_and_zeros, int variant=-1) -> Tensor", &lowbit::int4_mm);
  m.def("int8_mm(Tensor x, Tensor qweight, Tensor scales, int variant=-1) -> Tensor", &lowbit::int8_mm);
  m.def("int4_layout() -> int", &lowbit::int4_layout);
  m.def("lowbit_variants() -> int[]", &lowbit::variants);
  m.def("lowbit_active(bool on) -> bool", &lowbit::set_active);
}
