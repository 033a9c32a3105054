// The w8a8 product of lowbit_mm.h (lab.engine.quant.W8A8Linear, the LM head at precision w4a8): 8-bit weight blocks
// (ggml's Q8_0: w = d_w q_w, q_w in [-128, 127], one fp16 scale per 32 inputs) times 8-bit activation blocks (step 1
// of lowbit_a8.h) with integer dot products, the numerics llama.cpp uses for a Q8_0 tensor, defined so that a row's
// result depends neither on the other rows nor on the thread count nor on the instruction set:
//   1. each row of x quantized per block of 32 (lowbit_a8.h);
//   2. per (row, column, block) the integer dot product i = sum_j q_w,j q_x,j (exact in any order: at most
//      32 * 128 * 127 in magnitude);
//   3. per (row, column) acc = 0, then for each block g in order: acc += (d_w d_x) * i (each product and sum one
//      correctly rounded float operation; -ffp-contract=off); the output is acc in the input's dtype, rounded once
//      (bf16: by the tile that computed it, as c10::BFloat16(float), a8::Outputs).
// Step 2 is the only one the variants compute differently, and it is exact, so every variant gives the same bits:
// the VNNI ones multiply the weights offset to unsigned bytes (q_w + 128) and subtract 128 sum(q_x); AVX2 multiplies
// |q_w| by q_x with q_w's sign (maddubs cannot saturate: 2 * 128 * 127 < 2^15); plain C++ multiplies as written.
// Threads split the output columns only.
// Weight layout (lab.engine.quant.pack_w8a8): columns in tiles of 16; per tile and block, 8 x 64 bytes where byte
// 4c + i of part p holds q_w + 128 of input 4p + i of column c (each 32-bit lane of a part is one column's 4
// consecutive inputs, the operand of a VNNI dot product), then the blocks' scales d_w as fp16 bits [tiles, K / 32, 16]
// (an int16 tensor).
#include <torch/library.h>

#include "lowbit_a8.h"

namespace lowbit {
namespace {

using a8::half_value;
using a8::kBlock;
using a8::kCols;
using a8::Q8Rows;
constexpr int64_t kBlockBytes = kBlock * kCols;  // one tile's bytes of one block: 8 parts of 64 bytes
constexpr int kParts = 8;

struct W8Weights {
  const uint8_t* packed;   // [N / 16, K / 32, 512], q_w + 128
  const uint16_t* scales;  // [N / 16, K / 32, 16] fp16 bits
  int64_t n, k;
};

void w8a8_reference(const Q8Rows& a, const W8Weights& w, const a8::Outputs& out) {
  const int64_t blocks = w.k / kBlock, tiles = w.n / kCols;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t c = 0; c < kCols; ++c) {
        for (int64_t r = 0; r < a.m; ++r) {
          const int8_t* q = a.q.data() + r * w.k;
          float acc = 0.0f;
          for (int64_t g = 0; g < blocks; ++g) {
            const uint8_t* bytes = w.packed + (t * blocks + g) * kBlockBytes;
            int32_t dot = 0;
            for (int64_t j = 0; j < kBlock; ++j) {
              const int32_t weight = static_cast<int32_t>(bytes[(j / 4) * 64 + c * 4 + j % 4]) - 128;
              dot += weight * q[g * kBlock + j];
            }
            const float scale = half_value(w.scales[(t * blocks + g) * kCols + c]) * a.d[r * blocks + g];
            const float product = scale * static_cast<float>(dot);
            acc = acc + product;
          }
          out.put(r, t * kCols + c, acc);
        }
      }
    }
  });
}

// ---- AVX-512 VNNI: one 512-bit register per 64-byte part, a column per 32-bit lane ---------------------------------
template <int R>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void tile_avx512vnni(const Q8Rows& a, int64_t r0,
                                                                            const W8Weights& w, int64_t t,
                                                                            const a8::Outputs& out) {
  const int64_t blocks = w.k / kBlock;
  const uint8_t* packed = w.packed + t * blocks * kBlockBytes;
  const uint16_t* scales = w.scales + t * blocks * kCols;
  __m512 acc[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < blocks; ++g) {
    const uint8_t* bytes = packed + g * kBlockBytes;
    if (g + 1 < blocks) {
#pragma GCC unroll 8
      for (int p = 0; p < kParts; ++p) _mm_prefetch(reinterpret_cast<const char*>(bytes + kBlockBytes + p * 64), _MM_HINT_T0);
    }
    __m512i wv[kParts];
#pragma GCC unroll 8
    for (int p = 0; p < kParts; ++p) wv[p] = _mm512_loadu_si512(bytes + p * 64);
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + g * kCols)));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const int32_t* x = reinterpret_cast<const int32_t*>(a.q.data() + (r0 + r) * w.k + g * kBlock);
      __m512i even = _mm512_setzero_si512(), odd = _mm512_setzero_si512();
#pragma GCC unroll 4
      for (int p = 0; p < kParts; p += 2) {
        even = _mm512_dpbusd_epi32(even, wv[p], _mm512_set1_epi32(x[p]));
        odd = _mm512_dpbusd_epi32(odd, wv[p + 1], _mm512_set1_epi32(x[p + 1]));
      }
      const int64_t b = (r0 + r) * blocks + g;
      const __m512i offset = _mm512_set1_epi32(128 * a.sum[b]);
      const __m512 dots = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_add_epi32(even, odd), offset));
      acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(_mm512_mul_ps(dw, _mm512_set1_ps(a.d[b])), dots));
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) a8::put16(out, r0 + r, t * kCols, acc[r]);
}

// ---- 256-bit variants: each 64-byte part as two registers (columns 0-7, 8-15) ----------------------------------------
// PREPARE(part) turns 32 stored bytes into the weight operand; DOT(acc, w, x) adds to each 32-bit lane of acc the dot
// product of 4 weight bytes and 4 signed activation bytes; OFFSET says whether DOT saw q_w + 128 (subtract
// 128 sum(q_x)) or q_w itself.
#define LOWBIT_W8A8_TILE_256(NAME, TARGET, PREPARE, DOT, OFFSET)                                                     \
  template <int R>                                                                                                   \
  __attribute__((target(TARGET))) void NAME(const Q8Rows& a, int64_t r0, const W8Weights& w, int64_t t,           \
                                            const a8::Outputs& out) {                                             \
    const int64_t blocks = w.k / kBlock;                                                                             \
    const uint8_t* packed = w.packed + t * blocks * kBlockBytes;                                                     \
    const uint16_t* scales = w.scales + t * blocks * kCols;                                                          \
    __m256 acc[R][2];                                                                                                \
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();                                         \
    for (int64_t g = 0; g < blocks; ++g) {                                                                           \
      const uint8_t* bytes = packed + g * kBlockBytes;                                                               \
      if (g + 1 < blocks) {                                                                                          \
        for (int p = 0; p < kParts; ++p)                                                                             \
          _mm_prefetch(reinterpret_cast<const char*>(bytes + kBlockBytes + p * 64), _MM_HINT_T0);                    \
      }                                                                                                              \
      __m256i wv[kParts][2];                                                                                         \
      for (int p = 0; p < kParts; ++p) {                                                                             \
        for (int h = 0; h < 2; ++h) {                                                                                \
          wv[p][h] = PREPARE(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes + p * 64 + h * 32)));        \
        }                                                                                                            \
      }                                                                                                              \
      const uint16_t* sc = scales + g * kCols;                                                                       \
      const __m256 dw[2] = {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc))),                 \
                            _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + 8)))};            \
      for (int r = 0; r < R; ++r) {                                                                                  \
        const int32_t* x = reinterpret_cast<const int32_t*>(a.q.data() + (r0 + r) * w.k + g * kBlock);              \
        const int64_t b = (r0 + r) * blocks + g;                                                                     \
        const __m256 dx = _mm256_set1_ps(a.d[b]);                                                                    \
        const __m256i offset = _mm256_set1_epi32(OFFSET ? 128 * a.sum[b] : 0);                                       \
        for (int h = 0; h < 2; ++h) {                                                                                \
          __m256i even = _mm256_setzero_si256(), odd = _mm256_setzero_si256();                                       \
          for (int p = 0; p < kParts; p += 2) {                                                                      \
            even = DOT(even, wv[p][h], _mm256_set1_epi32(x[p]));                                                     \
            odd = DOT(odd, wv[p + 1][h], _mm256_set1_epi32(x[p + 1]));                                               \
          }                                                                                                          \
          const __m256 dots = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_add_epi32(even, odd), offset));             \
          acc[r][h] = _mm256_add_ps(acc[r][h], _mm256_mul_ps(_mm256_mul_ps(dw[h], dx), dots));                       \
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

// AVX2: the stored byte back to q_w (flip the top bit), then |q_w| (unsigned) times q_x with q_w's sign (sign_epi8
// also zeroes q_x where q_w = 0), pairs to int16 and pairs of those to int32
#define LOWBIT_SIGNED(part) _mm256_xor_si256(part, _mm256_set1_epi8(static_cast<char>(0x80)))
#define LOWBIT_DOT_AVX2(acc, w, x)                                                                                \
  _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w)), \
                                          _mm256_set1_epi16(1)))
#define LOWBIT_AS_STORED(part) (part)
#define LOWBIT_DOT_AVXVNNI(acc, w, x) _mm256_dpbusd_avx_epi32(acc, w, x)

LOWBIT_W8A8_TILE_256(tile_avx2, "avx2,fma,f16c", LOWBIT_SIGNED, LOWBIT_DOT_AVX2, false)
LOWBIT_W8A8_TILE_256(tile_avxvnni, "avx2,fma,f16c,avxvnni", LOWBIT_AS_STORED, LOWBIT_DOT_AVXVNNI, true)

#undef LOWBIT_W8A8_TILE_256
#undef LOWBIT_SIGNED
#undef LOWBIT_DOT_AVX2
#undef LOWBIT_AS_STORED
#undef LOWBIT_DOT_AVXVNNI

using TileFn = void (*)(const Q8Rows&, int64_t, const W8Weights&, int64_t, const a8::Outputs&);

template <int R> struct Avx512Vnni { static constexpr TileFn fn = tile_avx512vnni<R>; };
template <int R> struct AvxVnni { static constexpr TileFn fn = tile_avxvnni<R>; };
template <int R> struct Avx2 { static constexpr TileFn fn = tile_avx2<R>; };

TileFn tile_kernel(int64_t variant, int rows) {
  if (variant == kAvx512Vnni) return a8::pick_rows<TileFn, Avx512Vnni>(rows);
  if (variant == kAvxVnni) return a8::pick_rows<TileFn, AvxVnni>(rows);
  return a8::pick_rows<TileFn, Avx2>(rows);
}

}  // namespace

bool w8a8_takes(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales) {
  if (x.dim() != 2 || packed.dim() != 3 || scales.dim() != 3) return false;
  const auto dtype = x.scalar_type();
  if (dtype != at::kBFloat16 && dtype != at::kHalf && dtype != at::kFloat) return false;
  const int64_t k = x.size(1);
  return k % kBlock == 0 && packed.scalar_type() == at::kByte && packed.size(1) == k / kBlock &&
         packed.size(2) == kBlockBytes && scales.scalar_type() == at::kShort && scales.size(0) == packed.size(0) &&
         scales.size(1) == k / kBlock && scales.size(2) == kCols && packed.is_contiguous() && scales.is_contiguous();
}

at::Tensor w8a8_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, int64_t variant) {
  TORCH_CHECK(w8a8_takes(x, packed, scales), "w8a8_mm: x [M, K] (bf16, fp16 or float32), packed [N / 16, K / 32, ",
              "512] uint8, scales [N / 16, K / 32, 16] int16 (fp16 bits), K a multiple of 32");
  variant = a8::resolve(variant, "w8a8_mm");
  const int64_t m = x.size(0), n = packed.size(0) * kCols;
  const auto [out, outputs] = a8::result(x, m, n);
  if (m == 0 || n == 0) return a8::finished(out, x);
  const Q8Rows& rows = a8::quantized(x, variant);
  const W8Weights w{packed.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(scales.data_ptr()), n, x.size(1)};
  if (variant == kReference) {
    w8a8_reference(rows, w, outputs);
  } else {
    a8::over_tiles(rows.m, n / kCols, [&](int64_t t, int64_t r0, int count) {
      tile_kernel(variant, count)(rows, r0, w, t, outputs);
    });
  }
  return a8::finished(out, x);
}

}  // namespace lowbit

TORCH_LIBRARY_FRAGMENT(decoding_lab, m) {
  m.def("w8a8_mm(Tensor x, Tensor packed, Tensor scales, int variant=-1) -> Tensor", &lowbit::w8a8_mm);
}
