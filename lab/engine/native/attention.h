// The op's attention variants beside decoder_layers.cpp's portable loop (attention_avx512.cpp says how they agree).
#pragma once

#include <ATen/ATen.h>

namespace attention {

// A [1, heads, S, d] key or value tensor as the loops read it: rows of d contiguous, each head's rows `stride(1)`
// elements apart (a cache extended in place is a view of a longer buffer); a contiguous copy when it is not so.
inline at::Tensor rows_contiguous(const at::Tensor& x) {
  return x.stride(3) == 1 && x.stride(2) == x.size(3) ? x : x.contiguous();
}

// Whether the AVX-512 loop takes this attention: bf16 query / keys / values, a head dim that is a multiple of 8 up to
// 128, a CPU with AVX-512F.
bool avx512_takes(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value);

// query [1, heads, T, d], key / value [1, kv_heads, S, d] bf16 (any head stride), hidden [T, S] bool or nullptr (true:
// not seen);
// returns [1, T, heads, d] bf16: the numbers of decoder_layers.cpp's attention_rows.
at::Tensor avx512_rows(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const bool* hidden,
                       double scaling);

}  // namespace attention
