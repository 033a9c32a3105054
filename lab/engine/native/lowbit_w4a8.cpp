// The w4a8 product of lowbit_mm.h (lab.engine.quant.W4A8Linear): 4-bit weight blocks times 8-bit activation blocks
// with integer dot products, the numerics llama.cpp uses for Q4_1 weights (its Q8_1 activation blocks), defined so
// that a row's result depends neither on the other rows nor on the thread count nor on the instruction set:
//   1. each row of x is quantized per block of 32 inputs: d = max |x| / 127, q = round_half_even(x * (1 / d)) in
//      [-127, 127] (q = 0 where d = 0), s = d * sum(q), all in float;
//   2. per (row, column, block) the integer dot product i = sum_j w_j q_j of the weight nibbles w in [0, 15] (exact
//      in any order: at most 32 * 15 * 127 in magnitude);
//   3. per (row, column) acc = 0, then for each block g in order: acc += (d_w d_x) * i; acc += m_w * s (every product
//      and sum one correctly rounded float operation; compiled with -ffp-contract=off: no fused multiply-adds);
//      the output is acc in the input's dtype, rounded once (bf16: by the
//      tile that computed it, as c10::BFloat16(float), a8::Outputs).
// Step 2 is the only one the variants compute differently (AVX-512 VNNI, AVX-VNNI, AVX2, plain C++), and it is exact,
// so every variant gives the same bits; threads split the output columns only.
// Weight layout (lab.engine.quant.pack_w4a8): columns in tiles of 16; per tile and block, 4 x 64 bytes where byte
// 4c + i of part p holds input 8p + i of column c in its low nibble and input 8p + 4 + i in its high nibble (so each
// 32-bit lane of a 64-byte part is one column's 4 consecutive inputs, the operand of a VNNI dot product), then the
// block's scales d and minima m as fp16 bits [tiles, K / 32, 2, 16] (an int16 tensor).
#include <torch/library.h>

#include <tuple>

#include "lowbit_a8.h"

namespace lowbit {
namespace {

using a8::half_value;
using a8::kBlock;
using a8::kCols;
using a8::Q8Rows;
constexpr int64_t kBlockBytes = 256;  // one tile's nibbles of one block: 4 parts of 64 bytes

struct W4Weights {
  const uint8_t* packed;   // [N / 16, K / 32, 256]
  const uint16_t* scales;  // [N / 16, K / 32, 2, 16] fp16 bits: d, then m
  int64_t n, k;
};

// step 3 for one (row, column): the blocks' integer dot products `dots` [K / 32] combined in block order
inline float combine(const float* dw, const float* mw, int64_t stride, const float* dx, const float* sx,
                     const int32_t* dots, int64_t blocks) {
  float acc = 0.0f;
  for (int64_t g = 0; g < blocks; ++g) {
    const float scale = dw[g * stride] * dx[g];
    const float product = scale * static_cast<float>(dots[g]);
    acc = acc + product;
    const float offset = mw[g * stride] * sx[g];
    acc = acc + offset;
  }
  return acc;
}

void w4a8_reference(const Q8Rows& a, const W4Weights& w, const a8::Outputs& out) {
  const int64_t blocks = w.k / kBlock, tiles = w.n / kCols;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<int32_t> dots(blocks);
    std::vector<float> dw(blocks * kCols), mw(blocks * kCols);
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t g = 0; g < blocks; ++g) {
        const uint16_t* sc = w.scales + (t * blocks + g) * 2 * kCols;
        for (int64_t c = 0; c < kCols; ++c) {
          dw[g * kCols + c] = half_value(sc[c]);
          mw[g * kCols + c] = half_value(sc[kCols + c]);
        }
      }
      for (int64_t c = 0; c < kCols; ++c) {
        for (int64_t r = 0; r < a.m; ++r) {
          const int8_t* q = a.q.data() + r * w.k;
          for (int64_t g = 0; g < blocks; ++g) {
            const uint8_t* bytes = w.packed + (t * blocks + g) * kBlockBytes;
            int32_t dot = 0;
            for (int64_t j = 0; j < kBlock; ++j) {
              const int64_t part = j / 8, high = (j % 8) / 4, i = j % 4;
              const uint8_t byte = bytes[part * 64 + c * 4 + i];
              dot += static_cast<int32_t>(high ? byte >> 4 : byte & 15) * q[g * kBlock + j];
            }
            dots[g] = dot;
          }
          out.put(r, t * kCols + c, combine(dw.data() + c, mw.data() + c, kCols, a.d.data() + r * blocks,
                                            a.s.data() + r * blocks, dots.data(), blocks));
        }
      }
    }
  });
}

// ---- AVX-512 VNNI: one 512-bit register per 64-byte part, a column per 32-bit lane ---------------------------------
template <int R>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void tile_avx512vnni(const Q8Rows& a, int64_t r0,
                                                                            const W4Weights& w, int64_t t,
                                                                            const a8::Outputs& out) {
  const int64_t blocks = w.k / kBlock;
  const uint8_t* packed = w.packed + t * blocks * kBlockBytes;
  const uint16_t* scales = w.scales + t * blocks * 2 * kCols;
  const __m512i low = _mm512_set1_epi8(15);
  __m512 acc[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < blocks; ++g) {
    const uint8_t* bytes = packed + g * kBlockBytes;
    if (g + 2 < blocks) {
#pragma GCC unroll 4
      for (int p = 0; p < 4; ++p) _mm_prefetch(reinterpret_cast<const char*>(bytes + 2 * kBlockBytes + p * 64), _MM_HINT_T0);
    }
    __m512i wv[8];
#pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) {
      const __m512i part = _mm512_loadu_si512(bytes + p * 64);
      wv[2 * p] = _mm512_and_si512(part, low);
      wv[2 * p + 1] = _mm512_and_si512(_mm512_srli_epi16(part, 4), low);
    }
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + g * 2 * kCols)));
    const __m512 mw =
        _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + g * 2 * kCols + kCols)));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const int32_t* x = reinterpret_cast<const int32_t*>(a.q.data() + (r0 + r) * w.k + g * kBlock);
      __m512i even = _mm512_setzero_si512(), odd = _mm512_setzero_si512();
#pragma GCC unroll 4
      for (int p = 0; p < 4; ++p) {
        even = _mm512_dpbusd_epi32(even, wv[2 * p], _mm512_set1_epi32(x[2 * p]));
        odd = _mm512_dpbusd_epi32(odd, wv[2 * p + 1], _mm512_set1_epi32(x[2 * p + 1]));
      }
      const __m512 dots = _mm512_cvtepi32_ps(_mm512_add_epi32(even, odd));
      const int64_t b = (r0 + r) * blocks + g;
      acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(_mm512_mul_ps(dw, _mm512_set1_ps(a.d[b])), dots));
      acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(mw, _mm512_set1_ps(a.s[b])));
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) a8::put16(out, r0 + r, t * kCols, acc[r]);
}

// ---- 256-bit variants: each 64-byte part as two registers (columns 0-7, 8-15) ----------------------------------------
// DOT(acc, w, x) adds to each 32-bit lane of acc the dot product of its 4 unsigned weight bytes and 4 signed bytes.
#define LOWBIT_W4A8_TILE_256(NAME, TARGET, DOT)                                                                      \
  template <int R>                                                                                                   \
  __attribute__((target(TARGET))) void NAME(const Q8Rows& a, int64_t r0, const W4Weights& w, int64_t t,          \
                                            const a8::Outputs& out) {                                                        \
    const int64_t blocks = w.k / kBlock;                                                                             \
    const uint8_t* packed = w.packed + t * blocks * kBlockBytes;                                                     \
    const uint16_t* scales = w.scales + t * blocks * 2 * kCols;                                                      \
    const __m256i low = _mm256_set1_epi8(15);                                                                        \
    __m256 acc[R][2];                                                                                                \
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();                                         \
    for (int64_t g = 0; g < blocks; ++g) {                                                                           \
      const uint8_t* bytes = packed + g * kBlockBytes;                                                               \
      if (g + 2 < blocks) {                                                                                          \
        for (int p = 0; p < 4; ++p)                                                                                  \
          _mm_prefetch(reinterpret_cast<const char*>(bytes + 2 * kBlockBytes + p * 64), _MM_HINT_T0);                \
      }                                                                                                              \
      __m256i wv[8][2];                                                                                              \
      for (int p = 0; p < 4; ++p) {                                                                                  \
        for (int h = 0; h < 2; ++h) {                                                                                \
          const __m256i part = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes + p * 64 + h * 32));       \
          wv[2 * p][h] = _mm256_and_si256(part, low);                                                                \
          wv[2 * p + 1][h] = _mm256_and_si256(_mm256_srli_epi16(part, 4), low);                                      \
        }                                                                                                            \
      }                                                                                                              \
      const uint16_t* sc = scales + g * 2 * kCols;                                                                   \
      const __m256 dw[2] = {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc))),                 \
                            _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + 8)))};            \
      const __m256 mw[2] = {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + kCols))),         \
                            _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + kCols + 8)))};    \
      for (int r = 0; r < R; ++r) {                                                                                  \
        const int32_t* x = reinterpret_cast<const int32_t*>(a.q.data() + (r0 + r) * w.k + g * kBlock);              \
        const int64_t b = (r0 + r) * blocks + g;                                                                     \
        const __m256 dx = _mm256_set1_ps(a.d[b]), sx = _mm256_set1_ps(a.s[b]);                                      \
        for (int h = 0; h < 2; ++h) {                                                                                \
          __m256i even = _mm256_setzero_si256(), odd = _mm256_setzero_si256();                                       \
          for (int p = 0; p < 4; ++p) {                                                                              \
            even = DOT(even, wv[2 * p][h], _mm256_set1_epi32(x[2 * p]));                                             \
            odd = DOT(odd, wv[2 * p + 1][h], _mm256_set1_epi32(x[2 * p + 1]));                                       \
          }                                                                                                          \
          const __m256 dots = _mm256_cvtepi32_ps(_mm256_add_epi32(even, odd));                                       \
          acc[r][h] = _mm256_add_ps(acc[r][h], _mm256_mul_ps(_mm256_mul_ps(dw[h], dx), dots));                       \
          acc[r][h] = _mm256_add_ps(acc[r][h], _mm256_mul_ps(mw[h], sx));                                            \
        }                                                                                                            \
      }                                                                                                              \
    }                                                                                                                \
    for (int r = 0; r < R; ++r) {                                                                                    \
      alignas(32) float values[kCols];                                                                               \
      _mm256_store_ps(values, acc[r][0]);                                                                            \
      _mm256_store_ps(values + 8, acc[r][1]);                                                                        \
      out.put16(r0 + r, t * kCols, values);                                                                          \
    }                                                                                                                \
  }

// AVX2: unsigned x signed byte pairs to int16 (at most 2 * 15 * 127, no saturation), then pairs of those to int32
#define LOWBIT_DOT_AVX2(acc, w, x) \
  _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)))
#define LOWBIT_DOT_AVXVNNI(acc, w, x) _mm256_dpbusd_avx_epi32(acc, w, x)

LOWBIT_W4A8_TILE_256(tile_avx2, "avx2,fma,f16c", LOWBIT_DOT_AVX2)
LOWBIT_W4A8_TILE_256(tile_avxvnni, "avx2,fma,f16c,avxvnni", LOWBIT_DOT_AVXVNNI)

#undef LOWBIT_W4A8_TILE_256
#undef LOWBIT_DOT_AVX2
#undef LOWBIT_DOT_AVXVNNI

using TileFn = void (*)(const Q8Rows&, int64_t, const W4Weights&, int64_t, const a8::Outputs&);

template <int R> struct Avx512Vnni { static constexpr TileFn fn = tile_avx512vnni<R>; };
template <int R> struct AvxVnni { static constexpr TileFn fn = tile_avxvnni<R>; };
template <int R> struct Avx2 { static constexpr TileFn fn = tile_avx2<R>; };

TileFn tile_kernel(int64_t variant, int rows) {
  if (variant == kAvx512Vnni) return a8::pick_rows<TileFn, Avx512Vnni>(rows);
  if (variant == kAvxVnni) return a8::pick_rows<TileFn, AvxVnni>(rows);
  return a8::pick_rows<TileFn, Avx2>(rows);
}

void w4a8_vector(int64_t variant, const Q8Rows& a, const W4Weights& w, const a8::Outputs& out) {
  a8::over_tiles(a.m, w.n / kCols, [&](int64_t t, int64_t r0, int rows) { tile_kernel(variant, rows)(a, r0, w, t, out); });
}

}  // namespace

std::vector<int64_t> w4a8_variants() { return a8::variants(); }

bool w4a8_takes(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales) {
  if (x.dim() != 2 || packed.dim() != 3 || scales.dim() != 4) return false;
  const auto dtype = x.scalar_type();
  if (dtype != at::kBFloat16 && dtype != at::kHalf && dtype != at::kFloat) return false;
  const int64_t k = x.size(1);
  return k % kBlock == 0 && packed.scalar_type() == at::kByte && packed.size(1) == k / kBlock &&
         packed.size(2) == kBlockBytes && scales.scalar_type() == at::kShort && scales.size(0) == packed.size(0) &&
         scales.size(1) == k / kBlock && scales.size(2) == 2 && scales.size(3) == kCols && packed.is_contiguous() &&
         scales.is_contiguous();
}

at::Tensor w4a8_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, int64_t variant) {
  TORCH_CHECK(w4a8_takes(x, packed, scales), "w4a8_mm: x [M, K] (bf16, fp16 or float32), packed [N / 16, K / 32, ",
              "256] uint8, scales [N / 16, K / 32, 2, 16] int16 (fp16 bits), K a multiple of 32");
  variant = a8::resolve(variant, "w4a8_mm");
  const int64_t m = x.size(0), n = packed.size(0) * kCols;
  const auto [out, outputs] = a8::result(x, m, n);
  if (m == 0 || n == 0) return a8::finished(out, x);
  const Q8Rows& rows = a8::quantized(x, variant);
  const W4Weights w{packed.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(scales.data_ptr()), n, x.size(1)};
  if (variant == kReference) {
    w4a8_reference(rows, w, outputs);
  } else {
    w4a8_vector(variant, rows, w, outputs);
  }
  return a8::finished(out, x);
}

// step 1 alone: (q [M, K] int8, d [M, K / 32], s [M, K / 32]) of x as `variant` computes it, for tests of the
// Python definition
std::tuple<at::Tensor, at::Tensor, at::Tensor> w4a8_quantize(const at::Tensor& x, int64_t variant) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % kBlock == 0, "w4a8_quantize: x [M, K], K a multiple of 32");
  const int64_t m = x.size(0), k = x.size(1);
  const Q8Rows& rows = a8::quantized(x, a8::resolve(variant, "w4a8_quantize"));
  at::Tensor q = at::empty({m, k}, at::kChar), d = at::empty({m, k / kBlock}, at::kFloat);
  at::Tensor s = at::empty({m, k / kBlock}, at::kFloat);
  std::copy(rows.q.begin(), rows.q.end(), q.data_ptr<int8_t>());
  std::copy(rows.d.begin(), rows.d.end(), d.data_ptr<float>());
  std::copy(rows.s.begin(), rows.s.end(), s.data_ptr<float>());
  return {q, d, s};
}

}  // namespace lowbit

TORCH_LIBRARY_FRAGMENT(decoding_lab, m) {
  m.def("w4a8_mm(Tensor x, Tensor packed, Tensor scales, int variant=-1) -> Tensor", &lowbit::w4a8_mm);
  m.def("w4a8_quantize(Tensor x, int variant=-1) -> (Tensor, Tensor, Tensor)", &lowbit::w4a8_quantize);
  m.def("w4a8_variants() -> int[]", &lowbit::w4a8_variants);
}
