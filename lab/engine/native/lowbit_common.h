// Helpers shared by the low-bit kernels (lowbit_int4.cpp, lowbit_int8.cpp, lowbit_a8.h): instruction-set variants,
// bf16 bits.
#pragma once

#include <ATen/ATen.h>
#include <immintrin.h>

#include <cstring>
#include <vector>

#include "bf16_avx512.h"
#include "lowbit_mm.h"

namespace lowbit {

inline uint16_t to_bf16(float value) { return c10::BFloat16(value).x; }  // round to nearest even

inline float bf16_value(uint16_t bits) {  // exact: a bf16 is the high half of its float
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float out;
  std::memcpy(&out, &wide, sizeof(out));
  return out;
}

inline bool supports(int64_t variant) {
  switch (variant) {
    case kReference:
      return true;
    case kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case kAvx512:
      return __builtin_cpu_supports("avx512f");
    case kAvxVnni:
      return supports(kAvx2) && __builtin_cpu_supports("avxvnni");
    case kAvx512Vnni:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vnni");
    default:
      return false;
  }
}

inline int64_t resolve(int64_t variant) {
  if (variant == kBest) return supports(kAvx512) ? kAvx512 : supports(kAvx2) ? kAvx2 : kReference;
  TORCH_CHECK(supports(variant), "lowbit: instruction-set variant ", variant, " is not supported by this CPU");
  return variant;
}

__attribute__((target("avx512f,avx512bw"))) inline int64_t widen_avx512(const uint16_t* bits, int64_t n, float* out) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(out + i, bf16x16::widen(bits + i));
  return i;
}

// x [M, K] bf16 as floats (exact) in a buffer of the calling thread (no tensor allocation per product)
inline const float* widened(const at::Tensor& x, std::vector<float>& buffer) {
  const at::Tensor c = x.contiguous();
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(c.data_ptr());
  const int64_t n = c.numel();
  buffer.resize(n);
  for (int64_t i = bf16x16::bf16_vectors() ? widen_avx512(bits, n, buffer.data()) : 0; i < n; ++i) {
    buffer[i] = bf16_value(bits[i]);
  }
  return buffer.data();
}

}  // namespace lowbit
