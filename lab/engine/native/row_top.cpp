// The k largest logits of each row of a [R, V] float32 matrix in one pass over the row: what a decoding round reads
// of the target's rows (the greedy token, the alternatives a trace shows), without ATen's topk and argmax (a partial
// sort per row and a separate scan; docs/benchmarks.md has what each costs on a 49,152-token row).
//
// The order is a definition, the same in every variant: by value, largest first, a NaN above every number (as
// torch.topk and torch.argmax rank it), and equal values by their index, lowest first. So ids[r, 0] is
// torch.argmax(rows[r])'s answer (the first maximal index, or the first NaN), and the whole row of ids is what a
// stable descending sort of the row would put first. Variants: plain C++ (the definition), AVX2 and AVX-512,
// which skip eight or sixteen values at a time while none of them can enter the current top k; they keep the plain
// loop's state and visit the same candidates in the same order, so their answers are the plain loop's.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>
#include <tuple>

#include "lowbit_common.h"

namespace row_top {
namespace {

// a ranks above b (module comment): NaN above every number, then by value; ties are decided by the caller's order
inline bool above(float a, float b) { return (std::isnan(a) && !std::isnan(b)) || a > b; }

// The top k of one row so far, best first: a value enters when it ranks above the k-th (a later index never
// wins a tie), at the place after every kept value it does not rank above.
struct Top {
  float* values;
  int64_t* ids;
  int64_t k;
  int64_t count = 0;

  void offer(float x, int64_t id) {
    if (count == k && !above(x, values[k - 1])) return;
    int64_t at = count < k ? count++ : k - 1;
    for (; at > 0 && above(x, values[at - 1]); --at) {
      values[at] = values[at - 1];
      ids[at] = ids[at - 1];
    }
    values[at] = x;
    ids[at] = id;
  }

  // the value a candidate must rank above (the k-th once k are kept)
  float bar() const { return values[k - 1]; }
};

int64_t fill(const float* row, int64_t v, Top& top) {  // the first k values enter unconditionally
  int64_t j = 0;
  for (; j < v && top.count < top.k; ++j) top.offer(row[j], j);
  return j;
}

void top_reference(const float* row, int64_t v, Top& top) {
  for (int64_t j = fill(row, v, top); j < v; ++j) top.offer(row[j], j);
}

__attribute__((target("avx2"))) void top_avx2(const float* row, int64_t v, Top& top) {
  int64_t j = fill(row, v, top);
  for (; j + 8 <= v; j += 8) {
    const __m256 x = _mm256_loadu_ps(row + j);
    const __m256 bar = _mm256_set1_ps(top.bar());  // a NaN bar: nothing ranks above it, no lane is set
    const __m256 entering = _mm256_or_ps(_mm256_cmp_ps(x, bar, _CMP_GT_OQ), _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    const int lanes = _mm256_movemask_ps(entering);
    for (int bits = lanes; bits; bits &= bits - 1) {
      const int64_t at = j + __builtin_ctz(bits);
      top.offer(row[at], at);
    }
  }
  for (; j < v; ++j) top.offer(row[j], j);
}

__attribute__((target("avx512f"))) void top_avx512(const float* row, int64_t v, Top& top) {
  int64_t j = fill(row, v, top);
  for (; j + 16 <= v; j += 16) {
    const __m512 x = _mm512_loadu_ps(row + j);
    const __mmask16 lanes =
        _mm512_cmp_ps_mask(x, _mm512_set1_ps(top.bar()), _CMP_GT_OQ) | _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    for (unsigned bits = lanes; bits; bits &= bits - 1) {
      const int64_t at = j + __builtin_ctz(bits);
      top.offer(row[at], at);
    }
  }
  for (; j < v; ++j) top.offer(row[j], j);
}

std::tuple<at::Tensor, at::Tensor> row_top(const at::Tensor& rows, int64_t k, int64_t variant) {
  TORCH_CHECK(rows.dim() == 2 && rows.scalar_type() == at::kFloat, "row_top: rows must be a [R, V] float32 matrix");
  TORCH_CHECK(k >= 1 && k <= rows.size(1), "row_top: k = ", k, " must be between 1 and the row length ",
              rows.size(1));
  const at::Tensor c = rows.contiguous();
  const int64_t r_count = c.size(0), v = c.size(1);
  at::Tensor values = at::empty({r_count, k}, c.options());
  at::Tensor ids = at::empty({r_count, k}, c.options().dtype(at::kLong));
  const int64_t chosen = lowbit::resolve(variant);
  TORCH_CHECK(chosen <= lowbit::kAvx512, "row_top: variant ", variant, " is not one of its variants (0, 1, 2)");
  const float* data = c.data_ptr<float>();
  for (int64_t r = 0; r < r_count; ++r) {
    Top top{values.data_ptr<float>() + r * k, ids.data_ptr<int64_t>() + r * k, k};
    const float* row = data + r * v;
    if (chosen == lowbit::kAvx512) {
      top_avx512(row, v, top);
    } else if (chosen == lowbit::kAvx2) {
      top_avx2(row, v, top);
    } else {
      top_reference(row, v, top);
    }
  }
  return {ids, values};
}

}  // namespace
}  // namespace row_top

TORCH_LIBRARY_FRAGMENT(decoding_lab, m) {
  m.def("row_top(Tensor rows, int k, int variant=-1) -> (Tensor, Tensor)", &row_top::row_top);
}
