// The int4 product of lowbit_mm.h: x [M, K] bf16 times 4-bit weights in ATen's packed layout, each weight tile
// unpacked once for all M rows (in registers for up to 6 rows, through a tile in the L1 cache beyond), each output
// the bits of ATen's AVX-512 kernel: w = fma(q - 8, s, z) in float (s, z the bf16 scale and zero widened), then
// acc = fma(a_k, w_k, acc) over k = 0, 1, ..., K - 1 in order, rounded once to bf16. Every step is a correctly
// rounded float operation, so the AVX-512, AVX2 and plain C++ variants give the same bits; threads split the output
// columns only, so a row's result depends neither on the other rows nor on the thread count.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "lowbit_common.h"

namespace lowbit {
namespace {

constexpr int64_t kGroup = 32;  // weights per scale / zero (lab.engine.quant.GROUP)
constexpr int64_t kTile = 64;   // output columns per task
constexpr int64_t kChunk = 64;  // k per unpacked tile: 64 x 64 floats, 16 KB, stay in the L1 cache

// ---- int4: ATen's packed layout -----------------------------------------------------------------------------------
// Output channels come in blocks of `block` (64 in ATen's AVX-512 layout, 32 otherwise) stored one after the other,
// [K, block / 2] bytes each. A full block of the AVX-512 / AVX2 layout puts channel j and j + block / 2 in the low
// and high nibble of byte j; the plain layout and partial blocks put channels 2i and 2i + 1 in byte i.
struct Int4Weights {
  const uint8_t* packed;
  const uint16_t* scales_and_zeros;  // [K / 32, N, 2] bf16 bits
  int64_t n, k, layout;
};

inline int nibble(const Int4Weights& w, int64_t n, int64_t k) {
  const int64_t block = w.layout == 64 ? 64 : 32;
  const int64_t b = n / block, j = n % block, width = std::min(block, w.n - b * block);
  const uint8_t* base = w.packed + b * block * w.k / 2;
  if (width == block && w.layout != 0) {
    const uint8_t byte = base[k * block / 2 + j % (block / 2)];
    return j < block / 2 ? byte & 15 : byte >> 4;
  }
  const uint8_t byte = base[k * width / 2 + j / 2];
  return j % 2 == 0 ? byte & 15 : byte >> 4;
}

// Where the nibbles of channels c ... c + 15 (c a multiple of 16) lie: the byte of input k is base[k * stride (+ i)],
// found once per tile (no division per load).
struct Unit {
  const uint8_t* base;
  int64_t stride;
  int mode;  // 0: low nibbles of 16 bytes, 1: their high nibbles, 2: 8 bytes holding two channels each
};

inline Unit unit_of(const Int4Weights& w, int64_t c) {
  const int64_t block = w.layout == 64 ? 64 : 32;
  const int64_t b = c / block, j = c % block, width = std::min(block, w.n - b * block);
  const uint8_t* base = w.packed + b * block * w.k / 2;
  if (width == block && w.layout != 0) return Unit{base + j % (block / 2), block / 2, j >= block / 2 ? 1 : 0};
  return Unit{base + j / 2, width / 2, 2};
}

// the 16 nibbles of a unit at input k, one per byte
inline __m128i nibbles16(const Unit& u, int64_t k) {
  const __m128i low = _mm_set1_epi8(15);
  const uint8_t* p = u.base + k * u.stride;
  if (u.mode != 2) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm_and_si128(u.mode == 1 ? _mm_srli_epi16(bytes, 4) : bytes, low);
  }
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm_unpacklo_epi8(_mm_and_si128(bytes, low), _mm_and_si128(_mm_srli_epi16(bytes, 4), low));
}

// Software prefetch of the packed bytes `ahead` inputs on (the hardware prefetcher alone leaves a decode step
// waiting on memory), and of the next group's scales.
constexpr int64_t kAhead = 64;
inline void prefetch_unit(const Unit& u, int64_t k, int64_t k_end) {
  if (k + kAhead < k_end) _mm_prefetch(reinterpret_cast<const char*>(u.base + (k + kAhead) * u.stride), _MM_HINT_T0);
}

void tile_scales(const Int4Weights& w, int64_t g, int64_t c0, int64_t width, float* s, float* z) {
  const uint16_t* row = w.scales_and_zeros + (g * w.n + c0) * 2;
  for (int64_t j = 0; j < width; ++j) {
    s[j] = bf16_value(row[2 * j]);
    z[j] = bf16_value(row[2 * j + 1]);
  }
  std::fill(s + width, s + kTile, 0.0f);
  std::fill(z + width, z + kTile, 0.0f);
}

void int4_reference(const float* a, int64_t m, const Int4Weights& w, uint16_t* out) {
  at::parallel_for(0, w.n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t r = 0; r < m; ++r) {
        float acc = 0.0f;
        for (int64_t k = 0; k < w.k; ++k) {
          const uint16_t* sz = w.scales_and_zeros + ((k / kGroup) * w.n + n) * 2;
          const float weight = std::fma(static_cast<float>(nibble(w, n, k)) - 8.0f, bf16_value(sz[0]),
                                        bf16_value(sz[1]));
          acc = std::fma(a[r * w.k + k], weight, acc);
        }
        out[r * w.n + n] = to_bf16(acc);
      }
    }
  });
}

// The scales and zeros of 16 columns as two float vectors: each (scale, zero) pair of bf16 is one 32-bit word, the
// scale in its low half (exact widening: a bf16 is the high half of its float).
__attribute__((target("avx512f"))) inline void scales16(const uint16_t* pairs, __m512& s, __m512& z) {
  const __m512i words = _mm512_loadu_si512(pairs);
  s = _mm512_castsi512_ps(_mm512_slli_epi32(words, 16));
  z = _mm512_castsi512_ps(_mm512_and_si512(words, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// 16 floats rounded to bf16 as c10's conversion does (nearest even; NaN as 0x7FC0), stored at dst
__attribute__((target("avx512f"))) inline void store_bf16(uint16_t* dst, __m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtepi32_epi16(rounded));
}

// Unpacks weights k0 ... k0 + kc - 1 of the tile's columns to floats tile[kk][64] (columns past `width` are 0).
__attribute__((target("avx512f"))) void unpack_avx512(const Int4Weights& w, int64_t c0, int64_t width, int64_t k0,
                                                      int64_t kc, float* tile, float* s, float* z) {
  const __m512 eight = _mm512_set1_ps(8.0f);
  if (w.layout == 64 && width == kTile) {  // ATen's AVX-512 layout: byte j of input k holds columns j and j + 32
    const uint8_t* packed = w.packed + c0 * w.k / 2;
    const __m512i low = _mm512_set1_epi32(15);
    __m512 sv[4], zv[4];
    for (int64_t kk = 0; kk < kc; ++kk) {
      const int64_t k = k0 + kk;
      if (k % kGroup == 0) {
        for (int u = 0; u < 4; ++u) scales16(w.scales_and_zeros + ((k / kGroup) * w.n + c0) * 2 + u * 32, sv[u], zv[u]);
      }
      if (k + kAhead < w.k) _mm_prefetch(reinterpret_cast<const char*>(packed + (k + kAhead) * 32), _MM_HINT_T0);
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(packed + k * 32));
      const __m512i first = _mm512_cvtepu8_epi32(_mm256_castsi256_si128(bytes));
      const __m512i second = _mm512_cvtepu8_epi32(_mm256_extracti128_si256(bytes, 1));
      const __m512i q[4] = {_mm512_and_si512(first, low), _mm512_and_si512(second, low), _mm512_srli_epi32(first, 4),
                            _mm512_srli_epi32(second, 4)};
      for (int u = 0; u < 4; ++u) {
        const __m512 value = _mm512_fmadd_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(q[u]), eight), sv[u], zv[u]);
        _mm512_storeu_ps(tile + kk * kTile + u * 16, value);
      }
    }
    return;
  }
  Unit units[kTile / 16];
  for (int64_t u = 0; u * 16 < width; ++u) units[u] = unit_of(w, c0 + u * 16);
  for (int64_t kk = 0; kk < kc; ++kk) {
    const int64_t k = k0 + kk;
    if (k % kGroup == 0) tile_scales(w, k / kGroup, c0, width, s, z);
    for (int64_t u = 0; u * 16 < width; u += (units[u].mode == 2 ? 1 : 2)) prefetch_unit(units[u], k, w.k);
    for (int64_t u = 0; u < kTile / 16; ++u) {
      __m512 value = _mm512_setzero_ps();
      if (u * 16 < width) {
        const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(nibbles16(units[u], k)));
        value = _mm512_fmadd_ps(_mm512_sub_ps(q, eight), _mm512_loadu_ps(s + u * 16), _mm512_loadu_ps(z + u * 16));
      }
      _mm512_storeu_ps(tile + kk * kTile + u * 16, value);
    }
  }
}

// acc[r][0..63] += the tile applied to rows r < R of a (each output one fma per k, in k order)
template <int R>
__attribute__((target("avx512f"))) void rows_avx512(const float* a, int64_t lda, const float* tile, int64_t kc,
                                                    float* acc) {
  __m512 c[R][4];
#pragma GCC unroll 24
  for (int i = 0; i < R * 4; ++i) c[i / 4][i % 4] = _mm512_loadu_ps(acc + (i / 4) * kTile + (i % 4) * 16);
  for (int64_t kk = 0; kk < kc; ++kk) {
    const float* t = tile + kk * kTile;
    const __m512 w0 = _mm512_loadu_ps(t), w1 = _mm512_loadu_ps(t + 16), w2 = _mm512_loadu_ps(t + 32),
                 w3 = _mm512_loadu_ps(t + 48);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m512 x = _mm512_set1_ps(a[r * lda + kk]);
      c[r][0] = _mm512_fmadd_ps(x, w0, c[r][0]);
      c[r][1] = _mm512_fmadd_ps(x, w1, c[r][1]);
      c[r][2] = _mm512_fmadd_ps(x, w2, c[r][2]);
      c[r][3] = _mm512_fmadd_ps(x, w3, c[r][3]);
    }
  }
#pragma GCC unroll 24
  for (int i = 0; i < R * 4; ++i) _mm512_storeu_ps(acc + (i / 4) * kTile + (i % 4) * 16, c[i / 4][i % 4]);
}

// Rows r < R of a times one full tile of 64 columns in ATen's AVX-512 layout (byte j of input k holds columns j and
// j + 32), unpacking each weight in registers once for the R rows (a product of at most 6 rows): out[r][c0 ...].
template <int R>
__attribute__((target("avx512f"))) void fused_avx512(const float* a, const Int4Weights& w, int64_t c0,
                                                     uint16_t* out) {
  const uint8_t* packed = w.packed + c0 * w.k / 2;  // [K, 32] bytes
  // q - 8 for q = 0 ... 15, looked up by the low 4 bits of each 32-bit lane (one permute instead of mask, convert, sub)
  const __m512 centred = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
  __m512 c[R][4], s[4], z[4];
#pragma GCC unroll 24
  for (int i = 0; i < R * 4; ++i) c[i / 4][i % 4] = _mm512_setzero_ps();
  for (int64_t g = 0; g < w.k / kGroup; ++g) {
    const uint16_t* pairs = w.scales_and_zeros + (g * w.n + c0) * 2;
#pragma GCC unroll 4
    for (int u = 0; u < 4; ++u) scales16(pairs + u * 32, s[u], z[u]);
    if (g + 1 < w.k / kGroup) {
      _mm_prefetch(reinterpret_cast<const char*>(pairs + w.n * 2), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(pairs + w.n * 2 + 64), _MM_HINT_T0);
    }
    for (int64_t k = g * kGroup; k < (g + 1) * kGroup; ++k) {
      if (k + kAhead < w.k) _mm_prefetch(reinterpret_cast<const char*>(packed + (k + kAhead) * 32), _MM_HINT_T0);
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(packed + k * 32));
      const __m512i first = _mm512_cvtepu8_epi32(_mm256_castsi256_si128(bytes));  // columns 0-15 | 32-47
      const __m512i second = _mm512_cvtepu8_epi32(_mm256_extracti128_si256(bytes, 1));  // 16-31 | 48-63
      __m512 v[4];
      v[0] = _mm512_permutexvar_ps(first, centred);
      v[1] = _mm512_permutexvar_ps(second, centred);
      v[2] = _mm512_permutexvar_ps(_mm512_srli_epi32(first, 4), centred);
      v[3] = _mm512_permutexvar_ps(_mm512_srli_epi32(second, 4), centred);
#pragma GCC unroll 4
      for (int u = 0; u < 4; ++u) v[u] = _mm512_fmadd_ps(v[u], s[u], z[u]);
#pragma GCC unroll 6
      for (int r = 0; r < R; ++r) {
        const __m512 x = _mm512_set1_ps(a[r * w.k + k]);
        c[r][0] = _mm512_fmadd_ps(x, v[0], c[r][0]);
        c[r][1] = _mm512_fmadd_ps(x, v[1], c[r][1]);
        c[r][2] = _mm512_fmadd_ps(x, v[2], c[r][2]);
        c[r][3] = _mm512_fmadd_ps(x, v[3], c[r][3]);
      }
    }
  }
#pragma GCC unroll 24
  for (int i = 0; i < R * 4; ++i) store_bf16(out + (i / 4) * w.n + c0 + (i % 4) * 16, c[i / 4][i % 4]);
}

void fused_block(int64_t rows, const float* a, const Int4Weights& w, int64_t c0, uint16_t* out) {
  switch (rows) {
    case 1: return fused_avx512<1>(a, w, c0, out);
    case 2: return fused_avx512<2>(a, w, c0, out);
    case 3: return fused_avx512<3>(a, w, c0, out);
    case 4: return fused_avx512<4>(a, w, c0, out);
    case 5: return fused_avx512<5>(a, w, c0, out);
    default: return fused_avx512<6>(a, w, c0, out);
  }
}

__attribute__((target("avx2,fma"))) void unpack_avx2(const Int4Weights& w, int64_t c0, int64_t width, int64_t k0,
                                                     int64_t kc, float* tile, float* s, float* z) {
  const __m256 eight = _mm256_set1_ps(8.0f);
  Unit units[kTile / 16];
  for (int64_t u = 0; u * 16 < width; ++u) units[u] = unit_of(w, c0 + u * 16);
  for (int64_t kk = 0; kk < kc; ++kk) {
    const int64_t k = k0 + kk;
    if (k % kGroup == 0) tile_scales(w, k / kGroup, c0, width, s, z);
    for (int64_t u = 0; u < kTile / 16; ++u) {
      float* out = tile + kk * kTile + u * 16;
      if (u * 16 >= width) {
        _mm256_storeu_ps(out, _mm256_setzero_ps());
        _mm256_storeu_ps(out + 8, _mm256_setzero_ps());
        continue;
      }
      const __m128i q = nibbles16(units[u], k);
      const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q));
      const __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(q, 8)));
      const float* su = s + u * 16;
      const float* zu = z + u * 16;
      _mm256_storeu_ps(out, _mm256_fmadd_ps(_mm256_sub_ps(lo, eight), _mm256_loadu_ps(su), _mm256_loadu_ps(zu)));
      _mm256_storeu_ps(out + 8,
                       _mm256_fmadd_ps(_mm256_sub_ps(hi, eight), _mm256_loadu_ps(su + 8), _mm256_loadu_ps(zu + 8)));
    }
  }
}

// as rows_avx512, over the 32 columns starting at `tile` / `acc` (row stride kTile)
template <int R>
__attribute__((target("avx2,fma"))) void rows_avx2(const float* a, int64_t lda, const float* tile, int64_t kc,
                                                   float* acc) {
  __m256 c[R][4];
#pragma GCC unroll 8
  for (int i = 0; i < R * 4; ++i) c[i / 4][i % 4] = _mm256_loadu_ps(acc + (i / 4) * kTile + (i % 4) * 8);
  for (int64_t kk = 0; kk < kc; ++kk) {
    const float* t = tile + kk * kTile;
    const __m256 w0 = _mm256_loadu_ps(t), w1 = _mm256_loadu_ps(t + 8), w2 = _mm256_loadu_ps(t + 16),
                 w3 = _mm256_loadu_ps(t + 24);
#pragma GCC unroll 2
    for (int r = 0; r < R; ++r) {
      const __m256 x = _mm256_set1_ps(a[r * lda + kk]);
      c[r][0] = _mm256_fmadd_ps(x, w0, c[r][0]);
      c[r][1] = _mm256_fmadd_ps(x, w1, c[r][1]);
      c[r][2] = _mm256_fmadd_ps(x, w2, c[r][2]);
      c[r][3] = _mm256_fmadd_ps(x, w3, c[r][3]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < R * 4; ++i) _mm256_storeu_ps(acc + (i / 4) * kTile + (i % 4) * 8, c[i / 4][i % 4]);
}

void rows_block(int64_t variant, int64_t rows, const float* a, int64_t lda, const float* tile, int64_t kc,
                float* acc) {
  if (variant == kAvx512) {
    switch (rows) {
      case 1: return rows_avx512<1>(a, lda, tile, kc, acc);
      case 2: return rows_avx512<2>(a, lda, tile, kc, acc);
      case 3: return rows_avx512<3>(a, lda, tile, kc, acc);
      case 4: return rows_avx512<4>(a, lda, tile, kc, acc);
      case 5: return rows_avx512<5>(a, lda, tile, kc, acc);
      default: return rows_avx512<6>(a, lda, tile, kc, acc);
    }
  }
  for (int64_t half = 0; half < 2; ++half) {
    if (rows == 1) {
      rows_avx2<1>(a, lda, tile + half * 32, kc, acc + half * 32);
    } else {
      rows_avx2<2>(a, lda, tile + half * 32, kc, acc + half * 32);
    }
  }
}

void int4_vector(int64_t variant, const float* a, int64_t m, const Int4Weights& w, uint16_t* out) {
  const int64_t tiles = (w.n + kTile - 1) / kTile, block_rows = variant == kAvx512 ? 6 : 2;
  const int64_t blocks = (m + block_rows - 1) / block_rows, even_rows = (m + blocks - 1) / blocks;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> tile(kChunk * kTile), acc(m * kTile), s(kTile), z(kTile);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t c0 = t * kTile, width = std::min(kTile, w.n - c0);
      if (variant == kAvx512 && m <= block_rows && w.layout == 64 && width == kTile) {  // one row block
        fused_block(m, a, w, c0, out);
        continue;
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t k0 = 0; k0 < w.k; k0 += kChunk) {
        const int64_t kc = std::min(kChunk, w.k - k0);
        if (variant == kAvx512) {
          unpack_avx512(w, c0, width, k0, kc, tile.data(), s.data(), z.data());
        } else {
          unpack_avx2(w, c0, width, k0, kc, tile.data(), s.data(), z.data());
        }
        for (int64_t r0 = 0; r0 < m; r0 += even_rows) {  // row blocks of even size: 8 rows as 4 + 4, not 6 + 2
          rows_block(variant, std::min(even_rows, m - r0), a + r0 * w.k + k0, w.k, tile.data(), kc,
                     acc.data() + r0 * kTile);
        }
      }
      for (int64_t r = 0; r < m; ++r) {
        for (int64_t j = 0; j < width; ++j) out[r * w.n + c0 + j] = to_bf16(acc[r * kTile + j]);
      }
    }
  });
}

int64_t detect_int4_layout() {
  for (const int64_t layout : {64, 32, 0}) {
    bool matches = true;
    for (const int64_t n : {64, 112, 48, 96, 16}) {  // full blocks and partial ones of both block widths
      const int64_t k = 64;
      at::Tensor q = (at::arange(n * k, at::kInt).reshape({n, k}) * 7 + at::arange(n, at::kInt).unsqueeze(1) / 3)
                         .remainder(16)
                         .to(at::kInt)
                         .contiguous();
      const at::Tensor packed = at::_convert_weight_to_int4pack_for_cpu(q, 1).contiguous();
      if (packed.numel() != n * k / 2) return -1;
      const Int4Weights w{reinterpret_cast<const uint8_t*>(packed.data_ptr()), nullptr, n, k, layout};
      const int32_t* expected = q.data_ptr<int32_t>();
      for (int64_t i = 0; i < n * k && matches; ++i) matches = nibble(w, i / k, i % k) == expected[i];
    }
    if (matches) return layout;
  }
  return -1;
}


}  // namespace

int64_t int4_layout() {
  static const int64_t layout = detect_int4_layout();
  return layout;
}

bool int4_takes(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales_and_zeros) {
  if (x.dim() != 2 || x.scalar_type() != at::kBFloat16 || scales_and_zeros.scalar_type() != at::kBFloat16) {
    return false;
  }
  const int64_t k = x.size(1), n = packed.size(0);
  return int4_layout() >= 0 && packed.dim() == 2 && packed.size(1) == k / 2 && packed.element_size() == 1 &&
         k % kGroup == 0 && n % 16 == 0 && scales_and_zeros.dim() == 3 && scales_and_zeros.size(0) == k / kGroup &&
         scales_and_zeros.size(1) == n && scales_and_zeros.size(2) == 2 && packed.is_contiguous() &&
         scales_and_zeros.is_contiguous();
}

at::Tensor int4_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales_and_zeros,
                   int64_t variant) {
  TORCH_CHECK(int4_takes(x, packed, scales_and_zeros), "int4_mm: bf16 x [M, K], packed [N, K / 2] in ATen's layout, ",
              "scales_and_zeros [K / 32, N, 2] bf16, K a multiple of 32, N of 16");
  variant = resolve(variant);
  thread_local std::vector<float> buffer;
  const float* a = widened(x, buffer);
  const int64_t m = x.size(0), n = packed.size(0);
  at::Tensor out = at::empty({m, n}, x.options());
  const Int4Weights w{reinterpret_cast<const uint8_t*>(packed.data_ptr()),
                      reinterpret_cast<const uint16_t*>(scales_and_zeros.data_ptr()), n, x.size(1), int4_layout()};
  uint16_t* o = reinterpret_cast<uint16_t*>(out.data_ptr());
  if (m == 0 || n == 0) return out;
  if (variant == kReference) {
    int4_reference(a, m, w, o);
  } else {
    int4_vector(variant, a, m, w, o);
  }
  return out;
}

}  // namespace lowbit
