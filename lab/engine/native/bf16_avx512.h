// bf16 <-> float for sixteen values at a time with AVX-512, the same bits as c10's scalar conversions: widening is
// exact (a bf16 is the high half of its float), narrowing rounds to nearest even and turns a NaN into 0x7FC0, as
// c10::BFloat16(float) does. The op's elementwise loops (decoder_layers.cpp) and the attention's (attention_avx512.cpp)
// use them where `bf16_vectors()` says the CPU runs them, and the scalar conversions otherwise.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace bf16x16 {

// whether this CPU runs the functions below (AVX-512 F and BW)
inline bool bf16_vectors() {
  static const bool cpu = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  return cpu;
}

__attribute__((target("avx512f,avx512bw"))) inline __m512 widen(const void* bits) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(static_cast<const __m256i*>(bits)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// the float bits of bf16(x) in the high halves (round to nearest even; NaN -> 0x7FC0)
__attribute__((target("avx512f,avx512bw"))) inline __m512i rounded_bits(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i sum = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  return _mm512_mask_blend_epi32(nan, sum, _mm512_set1_epi32(0x7FC00000));
}

// bf16(x) widened back to float: the value a reduced-precision intermediate holds
__attribute__((target("avx512f,avx512bw"))) inline __m512 round(__m512 x) {
  return _mm512_castsi512_ps(_mm512_and_si512(rounded_bits(x), _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// bf16(x) stored as sixteen bf16 values
__attribute__((target("avx512f,avx512bw"))) inline void store(void* out, __m512 x) {
  _mm256_storeu_si256(static_cast<__m256i*>(out), _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded_bits(x), 16)));
}

// -x (the sign bit flipped, as the float negation)
__attribute__((target("avx512f,avx512bw"))) inline __m512 negate(__m512 x) {
  const __m512i sign = _mm512_set1_epi32(static_cast<int>(0x80000000u));
  return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x), sign));
}

}  // namespace bf16x16
