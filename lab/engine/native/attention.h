// The op's attention variants beside decoder_layers.cpp's portable loop (attention_avx512.cpp says how they agree).
#pragma once

#include <ATen/ATen.h>

namespace attention {

// Whether the AVX-512 loop takes this attention: bf16 query / keys / values, a head dim that is a multiple of 8 up to
// 128, a CPU with AVX-512F.
bool avx512_takes(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value);

// query [1, heads, T, d], key / value [1, kv_heads, S, d] bf16, hidden [T, S] bool or nullptr (true: not seen);
// returns [1, T, heads, d] bf16: the numbers of decoder_layers.cpp's attention_rows.
at::Tensor avx512_rows(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const bool* hidden,
                       double scaling);

}  // namespace attention
