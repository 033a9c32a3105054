// The decoder layers of a Llama model for a row-invariant decode step or verify forward, or a batch of decode steps of
// sequences with their own caches, as one C++ call
// (lab/engine/native_forward.py says when it is used).
//
// Each step computes the bits the Python forward (lab/engine/lean_forward.py over transformers' LlamaRMSNorm /
// LlamaAttention / LlamaMLP, and lab/engine/quant.py's linears) computes: the float products and the SiLU as the same
// ATen calls, the bf16 low-bit products as lowbit_mm.h's kernels (ATen's bits, one unpacking for all rows), the norms
// and elementwise steps as loops doing ATen's float operations in ATen's order. What goes away is the Python
// interpreter, most of the ATen calls between the products, and the copy of every layer's whole cache per forward
// (extend_cache writes the new positions in place). The attention is lab/engine/invariance.py's
// exact_attention computed by one loop per (head, query row) instead of its batched float64
// products (see exact_attention below for why the results agree); for bf16 on an AVX-512 CPU by the loop of
// attention_avx512.cpp, which computes the same numbers.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "attention.h"
#include "bf16_avx512.h"
#include "lowbit_mm.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

// How a linear layer multiplies (lab.engine.native_forward.LINEAR_KINDS)
constexpr int64_t kTwoRowFloat = 0;  // nn.Linear with lab.engine.invariance's 2D / two-row forward: params weight
constexpr int64_t kInt8 = 1;         // lab.engine.quant.Int8Linear: params qweight, scales
constexpr int64_t kInt4 = 2;         // lab.engine.quant.Int4Linear: params packed, scales_and_zeros
constexpr int64_t kW4A8 = 3;         // lab.engine.quant.W4A8Linear: params packed, scales (lowbit_w4a8.cpp)
constexpr int64_t kGroup = 32;       // lab.engine.quant.GROUP

// A cursor over the flat parameter list and the flat integer spec built by lab.engine.native_forward.
struct Reader {
  at::TensorList params;
  at::IntArrayRef spec;
  size_t p = 0, s = 0;
  const at::Tensor& tensor() { return params.at(p++); }
  int64_t integer() { return spec.at(s++); }
};

// Reads one linear's spec and parameters and applies it to x [..., K] (returns [..., N]).
at::Tensor linear(Reader& in, const at::Tensor& x) {
  const int64_t kind = in.integer(), has_bias = in.integer(), features = in.integer(), out_features = in.integer();
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end() - 1);
  out_shape.push_back(out_features);
  at::Tensor flat = x.reshape({-1, features});  // [M, K]
  at::Tensor y;
  if (kind == kTwoRowFloat) {
    const at::Tensor& weight = in.tensor();
    c10::optional<at::Tensor> bias;
    if (has_bias) bias = in.tensor();
    if (flat.size(0) == 1) {
      y = at::linear(at::cat({flat, flat}), weight, bias).slice(0, 0, 1);
    } else {
      y = at::linear(flat, weight, bias);
    }
    return y.reshape(out_shape);
  }
  const at::Tensor& packed = in.tensor();
  const at::Tensor& scales = in.tensor();
  if (kind == kW4A8) {  // its own numerics: no ATen kernel computes them, so the switch below does not apply
    y = lowbit::w4a8_mm(flat, packed, scales, lowbit::kBest);  // it widens x to a contiguous float copy itself
    if (has_bias) y = y + in.tensor();
    return y.reshape(out_shape);
  }
  const bool lowbit = lowbit::active();
  if (flat.scalar_type() != scales.scalar_type()) flat = flat.to(scales.scalar_type());
  if (!flat.is_contiguous()) flat = flat.contiguous();
  // the row-efficient kernels of lowbit_mm.h where they take the product (bf16), ATen's with the same bits otherwise
  if (kind == kInt8) {
    y = lowbit && lowbit::int8_takes(flat, packed, scales) ? lowbit::int8_mm(flat, packed, scales, lowbit::kBest)
                                                 : at::_weight_int8pack_mm(flat, packed, scales);
  } else {
    TORCH_CHECK(kind == kInt4, "unknown linear kind ", kind);
    y = lowbit && lowbit::int4_takes(flat, packed, scales) ? lowbit::int4_mm(flat, packed, scales, lowbit::kBest)
                                                 : at::_weight_int4pack_mm_for_cpu(flat, packed, kGroup, scales);
  }
  if (has_bias) y = y + in.tensor();
  return y.reshape(out_shape);
}

// Reads a group of linears that take the same input: their outputs side by side (one joined product, or the
// separate products concatenated, as lab.engine.quant.JoinedLinears does).
at::Tensor joined(Reader& in, const at::Tensor& x) {
  const int64_t parts = in.integer();
  if (parts == 1) return linear(in, x);
  std::vector<at::Tensor> outputs;
  for (int64_t i = 0; i < parts; ++i) outputs.push_back(linear(in, x));
  return at::cat(outputs, -1);
}

// LlamaRMSNorm.forward
at::Tensor rms_norm(const at::Tensor& hidden, const at::Tensor& weight, double eps) {
  const auto input_dtype = hidden.scalar_type();
  at::Tensor h = hidden.to(at::kFloat);
  at::Tensor variance = h.pow(2).mean({-1}, /*keepdim=*/true);
  h = h * at::rsqrt(variance + eps);
  return weight * h.to(input_dtype);
}

// ---- Elementwise steps and the norm without an ATen call per op -------------------------------------------------
// Each function below computes what the ATen ops it replaces compute, bit for bit: reduced-precision values are
// widened to float, each op is one float operation (compiled with -ffp-contract=off: no fused multiply-adds),
// and each result ATen would store in bf16 / fp16 is rounded to it (round to nearest even, as ATen's conversion).
// `lanes` is the width of the float vectors of ATen's sum kernel on this CPU (8 where it runs its AVX2 build,
// as it does even on AVX-512 CPUs; found by lab.engine.native_forward comparing row_sums with torch.sum; 0: use the
// ATen ops).
// They run for bf16 only (the dtype CPU users run; fp16 rows differed from ATen's in the norm in tests, so fp16
// keeps the ATen ops).

template <typename scalar_t>
inline float wide(scalar_t x) {
  return static_cast<float>(x);
}

template <typename scalar_t>
inline scalar_t narrow(float x) {
  return static_cast<scalar_t>(x);  // c10's round-to-nearest-even conversion
}

// ATen's float sum of a contiguous row (SumKernel's cascade_sum: vectorized_inner_sum over `lanes`-wide vectors,
// row_sum with four interleaved vector accumulators, multi_row_sum's four levels), so that the same row gives
// the same float.
float aten_row_sum(const float* x, int64_t n, int64_t lanes) {
  if (n < lanes) lanes = 1;  // cascade_sum's scalar_inner_sum: the same row_sum over single floats
  const int64_t vectors = n / lanes;
  constexpr int64_t ilp = 4, levels = 4;
  const int64_t rows = vectors / ilp;  // multi_row_sum over `rows` steps of `ilp` vectors
  int64_t log2 = 0;
  while ((int64_t(1) << log2) < rows) ++log2;  // CeilLog2
  const int64_t power = std::max<int64_t>(4, log2 / levels), step = int64_t(1) << power, mask = step - 1;
  std::vector<float> acc(levels * ilp * lanes, 0.0f);  // acc[level][k][lane]
  auto at = [&](int64_t level, int64_t k) { return acc.data() + (level * ilp + k) * lanes; };
  auto add_vector = [&](float* into, const float* from) {
    for (int64_t l = 0; l < lanes; ++l) into[l] += from[l];
  };
  int64_t i = 0;
  for (; i + step <= rows;) {
    for (int64_t j = 0; j < step; ++j, ++i) {
      for (int64_t k = 0; k < ilp; ++k) add_vector(at(0, k), x + (i * ilp + k) * lanes);
    }
    for (int64_t j = 1; j < levels; ++j) {
      for (int64_t k = 0; k < ilp; ++k) {
        add_vector(at(j, k), at(j - 1, k));
        std::fill(at(j - 1, k), at(j - 1, k) + lanes, 0.0f);
      }
      if ((i & (mask << (j * power))) != 0) break;
    }
  }
  for (; i < rows; ++i) {
    for (int64_t k = 0; k < ilp; ++k) add_vector(at(0, k), x + (i * ilp + k) * lanes);
  }
  for (int64_t j = 1; j < levels; ++j) {
    for (int64_t k = 0; k < ilp; ++k) add_vector(at(0, k), at(j, k));
  }
  float* partial = at(0, 0);  // row_sum: the vectors left over, then the four accumulators
  for (int64_t v = rows * ilp; v < vectors; ++v) add_vector(partial, x + v * lanes);
  for (int64_t k = 1; k < ilp; ++k) add_vector(partial, at(0, k));
  float total = 0.0f;  // vectorized_inner_sum: the scalar tail, then the lanes in order
  for (int64_t e = vectors * lanes; e < n; ++e) total += x[e];
  for (int64_t l = 0; l < lanes; ++l) total += partial[l];
  return total;
}

// ---- The loops below, sixteen bf16 values at a time on an AVX-512 CPU (bf16_avx512.h: the same conversions) ------
// Each returns how many leading elements it did (a multiple of 16); the scalar loop does the rest. Every lane does the
// float operations of the scalar loop in its order, so the results are the same bits.
template <typename scalar_t>
__attribute__((target("avx512f,avx512bw"))) int64_t norm_squares_avx512(const scalar_t* row, int64_t n, float* widened,
                                                                      float* squares) {
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m512 x = bf16x16::widen(row + j);
    _mm512_storeu_ps(widened + j, x);
    _mm512_storeu_ps(squares + j, _mm512_mul_ps(x, x));
  }
  return j;
}

template <typename scalar_t>
__attribute__((target("avx512f,avx512bw"))) int64_t norm_scale_avx512(const float* widened, const scalar_t* gain,
                                                                    float scale, int64_t n, scalar_t* out) {
  const __m512 factor = _mm512_set1_ps(scale);
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m512 normed = bf16x16::round(_mm512_mul_ps(_mm512_loadu_ps(widened + j), factor));
    bf16x16::store(out + j, _mm512_mul_ps(bf16x16::widen(gain + j), normed));
  }
  return j;
}

// one rotary row of `dim` (half a multiple of 16): out = bf16(bf16(x c) + bf16(rotate_half(x) s))
template <typename scalar_t>
__attribute__((target("avx512f,avx512bw"))) void rotary_row_avx512(const scalar_t* x, const scalar_t* c,
                                                                 const scalar_t* s, int64_t half, scalar_t* out) {
  for (int64_t j = 0; j < half; j += 16) {
    const __m512 low = bf16x16::widen(x + j), high = bf16x16::widen(x + half + j);
    const __m512 first_low = bf16x16::round(_mm512_mul_ps(low, bf16x16::widen(c + j)));
    const __m512 second_low = bf16x16::round(_mm512_mul_ps(bf16x16::negate(high), bf16x16::widen(s + j)));
    bf16x16::store(out + j, _mm512_add_ps(first_low, second_low));
    const __m512 first_high = bf16x16::round(_mm512_mul_ps(high, bf16x16::widen(c + half + j)));
    const __m512 second_high = bf16x16::round(_mm512_mul_ps(low, bf16x16::widen(s + half + j)));
    bf16x16::store(out + half + j, _mm512_add_ps(first_high, second_high));
  }
}

template <typename scalar_t, bool multiply>
__attribute__((target("avx512f,avx512bw"))) int64_t combine_avx512(const scalar_t* x, const scalar_t* y, int64_t n,
                                                                 scalar_t* out) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 a = bf16x16::widen(x + i), b = bf16x16::widen(y + i);
    bf16x16::store(out + i, multiply ? _mm512_mul_ps(a, b) : _mm512_add_ps(a, b));
  }
  return i;
}

// LlamaRMSNorm.forward: w * bf16(x * rsqrt(mean(x^2) + eps)) with x widened to float (pow(2) is x * x, mean is
// the cascade sum divided by n, rsqrt is 1 / sqrt).
template <typename scalar_t>
at::Tensor rms_norm_rows(const at::Tensor& hidden, const at::Tensor& weight, double eps, int64_t lanes) {
  const at::Tensor x = hidden.contiguous(), w = weight.contiguous();
  const int64_t n = x.size(-1), rows = x.numel() / n;
  at::Tensor out = at::empty_like(x);
  const scalar_t* in = x.data_ptr<scalar_t>();
  const scalar_t* gain = w.data_ptr<scalar_t>();
  scalar_t* o = out.data_ptr<scalar_t>();
  const float epsilon = static_cast<float>(eps), count = static_cast<float>(n);
  std::vector<float> widened(n), squares(n);
  const bool vectors = std::is_same_v<scalar_t, c10::BFloat16> && bf16x16::bf16_vectors();
  for (int64_t r = 0; r < rows; ++r) {
    const scalar_t* row = in + r * n;
    const int64_t done = vectors ? norm_squares_avx512(row, n, widened.data(), squares.data()) : 0;
    for (int64_t j = done; j < n; ++j) {
      widened[j] = wide(row[j]);
      squares[j] = widened[j] * widened[j];
    }
    const float variance = aten_row_sum(squares.data(), n, lanes) / count;
    const float scale = 1.0f / std::sqrt(variance + epsilon);
    const int64_t scaled = vectors ? norm_scale_avx512(widened.data(), gain, scale, n, o + r * n) : 0;
    for (int64_t j = scaled; j < n; ++j) {
      o[r * n + j] = narrow<scalar_t>(wide(gain[j]) * wide(narrow<scalar_t>(widened[j] * scale)));
    }
  }
  return out;
}

// (states * cos) + (rotate_half(states) * sin) for states [B, heads, T, d] (a view), cos / sin [B, T, d]:
// each product and the sum rounded to the reduced type as ATen's three ops and rotate_half's negation do.
template <typename scalar_t>
at::Tensor rotary_rows(const at::Tensor& states, const at::Tensor& cos, const at::Tensor& sin) {
  const at::Tensor x = states.contiguous(), c = cos.contiguous(), s = sin.contiguous();
  const int64_t batch = x.size(0), heads = x.size(1), tokens = x.size(2), dim = x.size(3), half = dim / 2;
  at::Tensor out = at::empty_like(x);
  const scalar_t* in = x.data_ptr<scalar_t>();
  const scalar_t* cp = c.data_ptr<scalar_t>();
  const scalar_t* sp = s.data_ptr<scalar_t>();
  scalar_t* o = out.data_ptr<scalar_t>();
  const bool vectors = std::is_same_v<scalar_t, c10::BFloat16> && bf16x16::bf16_vectors() && half % 16 == 0;
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t t = 0; t < tokens; ++t) {
        const scalar_t* row = in + ((b * heads + h) * tokens + t) * dim;
        const scalar_t* cr = cp + (b * tokens + t) * dim;
        const scalar_t* sr = sp + (b * tokens + t) * dim;
        scalar_t* orow = o + ((b * heads + h) * tokens + t) * dim;
        if (vectors) {
          rotary_row_avx512(row, cr, sr, half, orow);
          continue;
        }
        for (int64_t j = 0; j < dim; ++j) {
          const float rotated = j < half ? -wide(row[j + half]) : wide(row[j - half]);
          const scalar_t first = narrow<scalar_t>(wide(row[j]) * wide(cr[j]));
          const scalar_t second = narrow<scalar_t>(rotated * wide(sr[j]));
          orow[j] = narrow<scalar_t>(wide(first) + wide(second));
        }
      }
    }
  }
  return out;
}

// a + b or a * b of two same-shaped reduced-precision tensors, rounded once (ATen's add / mul)
template <typename scalar_t, bool multiply>
at::Tensor combine_rows(const at::Tensor& a, const at::Tensor& b) {
  const at::Tensor x = a.contiguous(), y = b.contiguous();
  at::Tensor out = at::empty_like(x);
  const scalar_t* xp = x.data_ptr<scalar_t>();
  const scalar_t* yp = y.data_ptr<scalar_t>();
  scalar_t* o = out.data_ptr<scalar_t>();
  const int64_t n = x.numel();
  const bool vectors = std::is_same_v<scalar_t, c10::BFloat16> && bf16x16::bf16_vectors();
  for (int64_t i = vectors ? combine_avx512<scalar_t, multiply>(xp, yp, n, o) : 0; i < n; ++i) {
    o[i] = narrow<scalar_t>(multiply ? wide(xp[i]) * wide(yp[i]) : wide(xp[i]) + wide(yp[i]));
  }
  return out;
}

// transformers' rotate_half: cat(-x2, x1) over the last dimension
at::Tensor rotate_half(const at::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  at::Tensor x1 = x.slice(-1, 0, half);
  at::Tensor x2 = x.slice(-1, half, std::numeric_limits<int64_t>::max());
  return at::cat({-x2, x1}, -1);
}

// aten_row_sum of each row of a float [R, n] tensor (for lab.engine.native_forward's check of `lanes` against ATen)
at::Tensor row_sums(const at::Tensor& x, int64_t lanes) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && lanes > 0, "row_sums: float [R, n], lanes > 0");
  const at::Tensor c = x.contiguous();
  at::Tensor out = at::empty({c.size(0)}, c.options());
  for (int64_t r = 0; r < c.size(0); ++r) {
    out.data_ptr<float>()[r] = aten_row_sum(c.data_ptr<float>() + r * c.size(1), c.size(1), lanes);
  }
  return out;
}

// The steps of a layer: the loops above when `lanes` is known and the dtypes agree, else the ATen ops.
at::Tensor norm_step(const at::Tensor& hidden, const at::Tensor& weight, double eps, int64_t lanes) {
  if (lanes == 0 || hidden.scalar_type() != at::kBFloat16 || weight.scalar_type() != at::kBFloat16) {
    return rms_norm(hidden, weight, eps);
  }
  at::Tensor out;
  AT_DISPATCH_REDUCED_FLOATING_TYPES(hidden.scalar_type(), "rms_norm", [&] {
    out = rms_norm_rows<scalar_t>(hidden, weight, eps, lanes);
  });
  return out;
}

at::Tensor rotary_step(const at::Tensor& states, const at::Tensor& cos, const at::Tensor& sin, int64_t lanes) {
  if (lanes == 0 || states.scalar_type() != at::kBFloat16 || cos.scalar_type() != at::kBFloat16 ||
      sin.scalar_type() != at::kBFloat16) {
    return (states * cos.unsqueeze(1)) + (rotate_half(states) * sin.unsqueeze(1));
  }
  at::Tensor out;
  AT_DISPATCH_REDUCED_FLOATING_TYPES(states.scalar_type(), "rotary", [&] { out = rotary_rows<scalar_t>(states, cos, sin); });
  return out;
}

template <bool multiply>
at::Tensor combine_step(const at::Tensor& a, const at::Tensor& b, int64_t lanes) {
  if (lanes == 0 || a.scalar_type() != at::kBFloat16 || b.scalar_type() != at::kBFloat16 || a.sizes() != b.sizes()) {
    return multiply ? a * b : a + b;
  }
  at::Tensor out;
  AT_DISPATCH_REDUCED_FLOATING_TYPES(a.scalar_type(), "combine", [&] { out = combine_rows<scalar_t, multiply>(a, b); });
  return out;
}

// a key or value as double: exact from bf16 / fp16 (through float, as ATen widens them) and from double
template <typename kv_t>
inline double to_double(kv_t x) {
  return static_cast<double>(static_cast<float>(x));
}
inline double to_double(double x) { return x; }

// lab.engine.invariance.exact_attention's number, softmax(q k^T * scaling) v in float64 rounded back once, with the
// same-valued steps: scores are exact float64 sums of exact products of the reduced-precision inputs (any order
// gives the same number, so the loop below gives the bits of exact_attention's batched product), the softmax is
// ATen's float64 softmax over the same [kv_heads, shared * T, S] scores, and each row's weighted sum of values
// adds its visible keys in order in float64 (exact_attention's batched product adds in another order: the
// results differ only where that ~1e-16 relative difference lands on a bf16 rounding boundary; its docstring
// gives the odds), then rounds double -> float -> bf16 / fp16 as ATen's conversion does. A row's loop does not
// depend on the other rows or on masked keys (they have weight exactly 0 and add nothing).
// query [1, heads, T, d], key / value [1, kv_heads, S, d] (rows of d contiguous, heads *_head_stride apart, as kv_t:
// double, or the reduced type itself, widened where it is read; widening is exact, so both give the same numbers),
// hidden_keys [T, S] bool; returns [1, T, heads, d].
template <typename scalar_t, typename kv_t>
at::Tensor attention_rows(const at::Tensor& query, const kv_t* k, const kv_t* v, int64_t kv_heads, int64_t keys,
                          int64_t k_head_stride, int64_t v_head_stride, const bool* hidden, double scaling) {
  const int64_t heads = query.size(1), rows = query.size(2), dim = query.size(3);
  const int64_t shared = heads / kv_heads;
  const at::Tensor qc = query.contiguous();
  const scalar_t* q = qc.data_ptr<scalar_t>();
  // task = one (query head, row): kv * shared * T + i, query head h = kv * shared + i / T, row t = i % T (the
  // layout of exact_attention's scores [kv_heads, shared * T, S])
  struct Task {
    int64_t kv, h, t;
  };
  auto task_of = [&](int64_t task) {
    const int64_t kv = task / (shared * rows), i = task % (shared * rows);
    return Task{kv, kv * shared + i / rows, i % rows};
  };
  // tasks per thread at least: a decode step's few short tasks stay on one thread (a parallel region costs more)
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 18) / std::max<int64_t>(1, keys * dim));
  at::Tensor scores = at::empty({kv_heads, shared * rows, keys}, query.options().dtype(at::kDouble));
  double* score_data = scores.data_ptr<double>();
  at::parallel_for(0, kv_heads * shared * rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<double> query_row(dim);
    for (int64_t task = begin; task < end; ++task) {
      const auto [kv, h, t] = task_of(task);
      const scalar_t* q_row = q + (h * rows + t) * dim;
      for (int64_t j = 0; j < dim; ++j) query_row[j] = wide(q_row[j]);  // exact
      const double* qd = query_row.data();
      const kv_t* k_head = k + kv * k_head_stride;
      double* out = score_data + task * keys;
      const bool* hidden_row = hidden == nullptr ? nullptr : hidden + t * keys;
      int64_t s = 0;
      for (; s + 4 <= keys; s += 4) {  // four keys at a time: four independent sums keep the FMA units busy
        const kv_t *k0 = k_head + s * dim, *k1 = k0 + dim, *k2 = k1 + dim, *k3 = k2 + dim;
        double s0 = 0, s1 = 0, s2 = 0, s3 = 0;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
        for (int64_t j = 0; j < dim; ++j) {
          s0 += qd[j] * to_double(k0[j]);
          s1 += qd[j] * to_double(k1[j]);
          s2 += qd[j] * to_double(k2[j]);
          s3 += qd[j] * to_double(k3[j]);
        }
        out[s] = s0, out[s + 1] = s1, out[s + 2] = s2, out[s + 3] = s3;
      }
      for (; s < keys; ++s) {
        const kv_t* k_row = k_head + s * dim;
        double score = 0;
#pragma omp simd reduction(+ : score)
        for (int64_t j = 0; j < dim; ++j) score += qd[j] * to_double(k_row[j]);
        out[s] = score;
      }
      for (s = 0; s < keys; ++s) {
        out[s] = (hidden_row != nullptr && hidden_row[s]) ? -std::numeric_limits<double>::infinity()
                                                          : out[s] * scaling;
      }
    }
  });
  const at::Tensor weights = at::softmax(scores, -1);
  const double* weight_data = weights.data_ptr<double>();
  at::Tensor out = at::empty({1, rows, heads, dim}, query.options());
  scalar_t* out_data = out.data_ptr<scalar_t>();
  at::parallel_for(0, kv_heads * shared * rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<double> acc(dim);
    for (int64_t task = begin; task < end; ++task) {
      const auto [kv, h, t] = task_of(task);
      const double* w = weight_data + task * keys;
      const kv_t* v_head = v + kv * v_head_stride;
      double* a = acc.data();
      std::fill(a, a + dim, 0.0);
      for (int64_t s = 0; s < keys; ++s) {
        if (w[s] == 0) continue;  // a masked key (or an underflowed weight) adds exactly nothing
        const kv_t* v_row = v_head + s * dim;
        const double weight = w[s];
#pragma omp simd
        for (int64_t j = 0; j < dim; ++j) a[j] += weight * to_double(v_row[j]);
      }
      scalar_t* o = out_data + (t * heads + h) * dim;
      for (int64_t j = 0; j < dim; ++j) o[j] = static_cast<scalar_t>(static_cast<float>(a[j]));
    }
  });
  return out;
}

// ---- The KV cache, extended in place -------------------------------------------------------------------------
// A layer's cache [1, kv_heads, S, d] is a view of the first S positions of a buffer [1, kv_heads, capacity, d] this
// op allocated (or of a longer tensor it was cropped from): a forward writes its T new keys and values after them
// when the storage has room, and only otherwise copies the cache into a new buffer with room for more positions.
// This relies on the lab's rule that a cache's tensors belong to that cache alone (lab.engine.runtime: no caller keeps
// a cache tensor across a crop; a copy of a cache is a deep copy), so the positions past a cache's length are free.
constexpr int64_t kMinHeadroom = 128;  // positions of room a new buffer gets at least (half the length when more)

// Whether `past` ([1, kv_heads, S, d], rows of d contiguous) can show `length` positions without moving: each head's
// rows are `stride(1)` elements apart and the last head's `length` rows end inside the storage.
bool has_room(const at::Tensor& past, const at::Tensor& fresh, int64_t length) {
  if (past.dim() != 4 || past.size(0) != 1 || past.scalar_type() != fresh.scalar_type()) return false;
  const int64_t heads = past.size(1), dim = past.size(3);
  if (past.stride(3) != 1 || past.stride(2) != dim || (heads > 1 && past.stride(1) < length * dim)) return false;
  const int64_t last = past.storage_offset() + (heads - 1) * past.stride(1) + length * dim;  // elements used
  return last * past.element_size() <= static_cast<int64_t>(past.storage().nbytes());
}

// `past` with `fresh` [1, kv_heads, T, d] appended along the positions (the values at::cat gives)
at::Tensor extend_cache(const at::Tensor& past, const at::Tensor& fresh) {
  const int64_t cached = past.size(2), length = cached + fresh.size(2);
  at::Tensor grown;
  if (has_room(past, fresh, length)) {
    grown = past.as_strided({1, past.size(1), length, past.size(3)}, past.strides(), past.storage_offset());
  } else {
    const int64_t capacity = length + std::max(kMinHeadroom, length / 2);
    grown = at::empty({1, past.size(1), capacity, past.size(3)}, past.options().dtype(fresh.scalar_type()))
                .slice(2, 0, length);
    if (cached > 0) grown.slice(2, 0, cached).copy_(past);
  }
  grown.slice(2, cached, length).copy_(fresh);
  return grown;
}

}  // namespace

// variant: lowbit::kBest (the AVX-512 loop where it takes the call, attention_avx512.cpp) or lowbit::kReference (the
// portable loop above), for the tests that compare them.
at::Tensor exact_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                           const c10::optional<at::Tensor>& hidden_keys, double scaling, int64_t variant) {
  TORCH_CHECK(query.dim() == 4 && query.size(0) == 1 && key.size(0) == 1, "exact_attention: one sequence");
  TORCH_CHECK(query.size(1) % key.size(1) == 0, "exact_attention: query heads are a multiple of kv heads");
  at::Tensor hidden;
  if (hidden_keys.has_value()) {
    hidden = hidden_keys->to(at::kBool).contiguous();
    TORCH_CHECK(hidden.size(0) == query.size(2) && hidden.size(1) == key.size(2), "exact_attention: mask [T, S]");
  }
  const bool* hidden_data = hidden.defined() ? hidden.data_ptr<bool>() : nullptr;
  at::Tensor out;
  if (variant != lowbit::kReference && attention::avx512_takes(query, key, value)) {
    return attention::avx512_rows(query, key, value, hidden_data, scaling);
  }
  const int64_t kv_heads = key.size(1), keys = key.size(2);
  AT_DISPATCH_REDUCED_FLOATING_TYPES(query.scalar_type(), "exact_attention", [&] {
    if (query.size(2) == 1 && key.scalar_type() == query.scalar_type() && value.scalar_type() == query.scalar_type()) {
      // one query row per head (decode steps): the cache read as it is, each element widened where it is used
      const at::Tensor kc = attention::rows_contiguous(key), vc = attention::rows_contiguous(value);
      out = attention_rows<scalar_t, scalar_t>(query, kc.data_ptr<scalar_t>(), vc.data_ptr<scalar_t>(), kv_heads,
                                               keys, kc.stride(1), vc.stride(1), hidden_data, scaling);
    } else {
      // several rows: keys and values widened to double once, not once per query row
      const at::Tensor kc = key.to(at::kDouble).contiguous(), vc = value.to(at::kDouble).contiguous();
      out = attention_rows<scalar_t, double>(query, kc.data_ptr<double>(), vc.data_ptr<double>(), kv_heads, keys,
                                             keys * key.size(3), keys * key.size(3), hidden_data, scaling);
    }
  });
  return out;
}

// The attention of B independent sequences, each over its own cache (a batch of decode steps): sequence b's query
// [1, heads, T, d] against its past keys / values with its T new ones appended, by exact_attention, the sequences
// split over the threads (a sequence's loops run as they run alone, so its rows are its own decode step's).
// Returns [B, T, heads, d] and fills keys_out / values_out at [first + b].
static at::Tensor sequences_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                      at::TensorList past_keys, at::TensorList past_values, int64_t first,
                                      std::vector<at::Tensor>& keys_out, std::vector<at::Tensor>& values_out,
                                      double scaling) {
  const int64_t batch = query.size(0);
  std::vector<at::Tensor> attended(batch);
  for (int64_t b = 0; b < batch; ++b) {  // on this thread: an in-place write needs the caller's inference mode
    keys_out[first + b] = extend_cache(past_keys[first + b], key.slice(0, b, b + 1));
    values_out[first + b] = extend_cache(past_values[first + b], value.slice(0, b, b + 1));
  }
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      attended[b] = exact_attention(query.slice(0, b, b + 1), keys_out[first + b], values_out[first + b],
                                    c10::nullopt, scaling, lowbit::kBest);
    }
  });
  return at::cat(attended, 0);
}

// The query, key and value of a layer's attention input [B, T, *] (the q / k / v products, joined or not, then the
// rotary embedding on the query and key heads): query [B, heads, T, d], key / value [B, kv_heads, T, d].
struct Projected {
  at::Tensor query, key, value;
};

Projected project(Reader& in, const at::Tensor& normed, const at::Tensor& cos, const at::Tensor& sin, int64_t heads,
                  int64_t kv_heads, int64_t head_dim, int64_t lanes) {
  const int64_t batch = normed.size(0), tokens = normed.size(1);
  at::Tensor states = joined(in, normed).view({batch, tokens, -1, head_dim}).transpose(1, 2);
  const int64_t rotated = heads + kv_heads;  // query heads, then key heads, then value heads
  at::Tensor query_key = rotary_step(states.slice(1, 0, rotated), cos, sin, lanes);
  return {query_key.slice(1, 0, heads), query_key.slice(1, heads, rotated),
          states.slice(1, rotated, std::numeric_limits<int64_t>::max())};
}

// The rest of a layer after its attention [B, T, heads, d]: residual + o_proj(attended), then that plus the MLP
// (LlamaMLP.forward with SiLU, as lab.engine.lean_forward._mlp) of its post-attention norm.
at::Tensor finish_layer(Reader& in, const at::Tensor& residual, const at::Tensor& attended,
                        const at::Tensor& post_norm, double eps, int64_t lanes) {
  const int64_t batch = residual.size(0), tokens = residual.size(1);
  at::Tensor hidden =
      combine_step<false>(residual, linear(in, attended.reshape({batch, tokens, -1}).contiguous()), lanes);
  at::Tensor gate_up = joined(in, norm_step(hidden, post_norm, eps, lanes));
  const int64_t intermediate = in.integer();  // the gate's output size
  std::vector<at::Tensor> halves = gate_up.split_with_sizes({intermediate, gate_up.size(-1) - intermediate}, -1);
  return combine_step<false>(hidden, linear(in, combine_step<true>(at::silu(halves[0]), halves[1], lanes)), lanes);
}

// hidden [B, T, H] (the embeddings of B sequences); past keys / values [1, kv_heads, P_b, d] per layer and sequence,
// layer-major (entry l * B + b); cos / sin [B, T, d]; hidden_keys [T, P + T] bool or None (lab.engine.invariance.
// _hidden_keys; B = 1 only: B > 1 is a batch of decode steps, each row seeing its whole cache). Returns the
// final-norm hidden states, each layer's (and sequence's) keys and values with the T new positions appended, and
// (when record) each layer's output.
std::tuple<at::Tensor, std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>> decoder_layers(
    const at::Tensor& embeds, at::TensorList past_keys, at::TensorList past_values, const at::Tensor& cos,
    const at::Tensor& sin, const c10::optional<at::Tensor>& hidden_keys, at::TensorList params,
    at::IntArrayRef spec, int64_t heads, int64_t kv_heads, int64_t head_dim, double scaling, double eps,
    bool record, int64_t lanes) {
  Reader in{params, spec};
  const int64_t batch = embeds.size(0);
  TORCH_CHECK(batch >= 1 && static_cast<int64_t>(past_keys.size()) % batch == 0 &&
                  past_keys.size() == past_values.size(),
              "decoder_layers: past keys / values per layer and sequence");
  TORCH_CHECK(batch == 1 || !hidden_keys.has_value(), "decoder_layers: a hidden-key mask takes one sequence");
  const int64_t layers = static_cast<int64_t>(past_keys.size()) / batch;
  std::vector<at::Tensor> keys(layers * batch), values(layers * batch), recorded;
  at::Tensor hidden = embeds;
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor& input_norm = in.tensor();
    const at::Tensor& post_norm = in.tensor();
    // attention (LlamaAttention.forward at inference, as lab.engine.lean_forward._attention), then the MLP
    const at::Tensor normed = norm_step(hidden, input_norm, eps, lanes);
    const Projected p = project(in, normed, cos, sin, heads, kv_heads, head_dim, lanes);
    at::Tensor attended;
    if (batch == 1) {
      keys[l] = extend_cache(past_keys[l], p.key);
      values[l] = extend_cache(past_values[l], p.value);
      attended = exact_attention(p.query, keys[l], values[l], hidden_keys, scaling, lowbit::kBest);
    } else {
      attended =
          sequences_attention(p.query, p.key, p.value, past_keys, past_values, l * batch, keys, values, scaling);
    }
    hidden = finish_layer(in, hidden, attended, post_norm, eps, lanes);
    if (record) recorded.push_back(hidden);
  }
  const at::Tensor& final_norm = in.tensor();
  TORCH_CHECK(in.p == params.size() && in.s == spec.size(), "decoder_layers: spec and parameters disagree");
  return {norm_step(hidden, final_norm, eps, lanes), keys, values, recorded};
}

// One decoder layer of a draft head (lab.heads.eagle's EAGLE-1 layer, lab.heads.eagle3's EAGLE-3 `midlayer`) for
// one sequence, as decoder_layers runs a target layer but with the attention's input given: q / k / v of
// `attention_input` [1, T, A] (EAGLE-1: the layer's input itself, its input norm being the identity; EAGLE-3:
// [norm(e); norm(g)], 2H wide), the residual stream `residual` [1, T, H], the past keys / values [1, kv_heads, S, d]
// extended in place as decoder_layers does, hidden_keys [T, S + T] bool or None. Parameters: the post-attention
// norm's weight, then the linears as for a target layer. Returns the layer's output [1, T, H] and the extended keys
// and values.
std::tuple<at::Tensor, at::Tensor, at::Tensor> draft_layer(
    const at::Tensor& residual, const at::Tensor& attention_input, const at::Tensor& past_key,
    const at::Tensor& past_value, const at::Tensor& cos, const at::Tensor& sin,
    const c10::optional<at::Tensor>& hidden_keys, at::TensorList params, at::IntArrayRef spec, int64_t heads,
    int64_t kv_heads, int64_t head_dim, double scaling, double eps, int64_t lanes) {
  TORCH_CHECK(residual.dim() == 3 && residual.size(0) == 1 && attention_input.dim() == 3 &&
                  attention_input.size(0) == 1 && attention_input.size(1) == residual.size(1),
              "draft_layer: residual [1, T, H] and attention input [1, T, A] of one sequence");
  Reader in{params, spec};
  const at::Tensor& post_norm = in.tensor();
  const Projected p = project(in, attention_input, cos, sin, heads, kv_heads, head_dim, lanes);
  at::Tensor keys = extend_cache(past_key, p.key), values = extend_cache(past_value, p.value);
  at::Tensor attended = exact_attention(p.query, keys, values, hidden_keys, scaling, lowbit::kBest);
  at::Tensor out = finish_layer(in, residual, attended, post_norm, eps, lanes);
  TORCH_CHECK(in.p == params.size() && in.s == spec.size(), "draft_layer: spec and parameters disagree");
  return {out, keys, values};
}

TORCH_LIBRARY(decoding_lab, m) {
  m.def(
      "decoder_layers(Tensor embeds, Tensor[] past_keys, Tensor[] past_values, Tensor cos, Tensor sin, "
      "Tensor? hidden_keys, Tensor[] params, int[] spec, int heads, int kv_heads, int head_dim, float scaling, "
      "float eps, bool record, int lanes) -> (Tensor, Tensor[], Tensor[], Tensor[])",
      &decoder_layers);
  m.def(
      "draft_layer(Tensor residual, Tensor attention_input, Tensor past_key, Tensor past_value, Tensor cos, "
      "Tensor sin, Tensor? hidden_keys, Tensor[] params, int[] spec, int heads, int kv_heads, int head_dim, "
      "float scaling, float eps, int lanes) -> (Tensor, Tensor, Tensor)",
      &draft_layer);
  m.def("row_sums(Tensor x, int lanes) -> Tensor", &row_sums);
  m.def("rms_norm(Tensor hidden, Tensor weight, float eps, int lanes) -> Tensor", &norm_step);
  m.def("rotary(Tensor states, Tensor cos, Tensor sin, int lanes) -> Tensor", &rotary_step);
  m.def(
      "exact_attention(Tensor query, Tensor key, Tensor value, Tensor? hidden_keys, float scaling, int variant=-1) "
      "-> Tensor",
      &exact_attention);
}
