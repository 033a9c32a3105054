// Row-efficient low-bit matrix products with ATen's bits (lowbit_int4.cpp, lowbit_int8.cpp;
// lab/engine/native_forward.py says where they run), shared by the decoder layers op and the Python linears' ops.
#pragma once

#include <ATen/ATen.h>

namespace lowbit {

// Instruction sets of the kernels: kBest picks the widest one this CPU supports at run time.
constexpr int64_t kBest = -1;
constexpr int64_t kReference = 0;  // plain C++ (std::fma): the definition the vector variants are tested against
constexpr int64_t kAvx2 = 1;       // AVX2 + FMA
constexpr int64_t kAvx512 = 2;     // AVX-512F
constexpr int64_t kAvxVnni = 3;    // AVX2 + AVX-VNNI (256-bit integer dot products; the w4a8 product only)
constexpr int64_t kAvx512Vnni = 4;  // AVX-512 with VNNI (the w4a8 product only)

// Whether the decoder layers use these kernels (the switch lab.engine.quant.set_lowbit_kernels sets; on by default).
bool active();

// The packed layout ATen's _convert_weight_to_int4pack_for_cpu produces in this build (64: its AVX-512 layout, 32:
// its AVX2 layout, 0: its plain one), found once by packing test matrices; -1 when none of them matches.
int64_t int4_layout();

// Whether the int4 / int8 kernels take this product (bf16 activations and scales, shapes they cover).
bool int4_takes(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales_and_zeros);
bool int8_takes(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales);

// x [M, K] bf16 times the 4-bit weight ([N, K / 2] packed by ATen, scales_and_zeros [K / 32, N, 2]) -> [M, N]
// bf16, each output the bits of at::_weight_int4pack_mm_for_cpu's AVX-512 kernel.
at::Tensor int4_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales_and_zeros,
                   int64_t variant);

// x [M, K] bf16 times the int8 weight [N, K] with per-channel scales [N] -> [M, N] bf16, each output the bits of
// at::_weight_int8pack_mm's AVX-512 kernel.
at::Tensor int8_mm(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales, int64_t variant);

// x [M, K] (bf16, fp16 or float32) times 4-bit weight blocks with 8-bit activation blocks (lowbit_w4a8.cpp: packed
// [N / 16, K / 32, 256] uint8, scales [N / 16, K / 32, 2, 16] int16 holding fp16 bits) -> [M, N] in x's dtype; the same bits in every
// variant (kReference, kAvx2, kAvxVnni, kAvx512Vnni), at any row and thread count.
bool w4a8_takes(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales);
at::Tensor w4a8_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, int64_t variant);

// x [M, K] (bf16, fp16 or float32) times 8-bit weight blocks (ggml's Q8_0) with 8-bit activation blocks
// (lowbit_w8a8.cpp: packed [N / 16, K / 32, 512] uint8, scales [N / 16, K / 32, 16] int16 holding fp16 bits) -> [M, N]
// in x's dtype; the same bits in every variant of the w4a8 product, at any row and thread count.
bool w8a8_takes(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales);
at::Tensor w8a8_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, int64_t variant);

}  // namespace lowbit
