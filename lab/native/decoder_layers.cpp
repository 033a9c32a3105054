// The decoder layers of a Llama model for a row-invariant decode step or verify forward, as one C++ call
// (lab/native_forward.py says when it is used).
//
// Every tensor op below but the attention is the ATen op, with the same arguments in the same order, that the
// Python forward (lab/lean_forward.py over transformers' LlamaRMSNorm / LlamaAttention / LlamaMLP, and
// lab/quant.py's linears) performs, so those results are the same bits; what goes away is the Python
// interpreter between the ~100 ops of each layer. The attention is lab/invariance.py's exact_attention computed
// by one loop per (head, query row) instead of its batched float64 products (see exact_attention below for why
// the results agree).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

namespace {

// How a linear layer multiplies (lab.native_forward.LINEAR_KINDS)
constexpr int64_t kTwoRowFloat = 0;  // nn.Linear with lab.invariance's 2D / two-row forward: params weight
constexpr int64_t kInt8 = 1;         // lab.quant.Int8Linear: params qweight, scales
constexpr int64_t kInt4 = 2;         // lab.quant.Int4Linear: params packed, scales_and_zeros
constexpr int64_t kGroup = 32;       // lab.quant.GROUP

// A cursor over the flat parameter list and the flat integer spec built by lab.native_forward.
struct Reader {
  const std::vector<at::Tensor>& params;
  const std::vector<int64_t>& spec;
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
  if (flat.scalar_type() != scales.scalar_type()) flat = flat.to(scales.scalar_type());
  if (!flat.is_contiguous()) flat = flat.contiguous();
  if (kind == kInt8) {
    y = at::_weight_int8pack_mm(flat, packed, scales);
  } else {
    TORCH_CHECK(kind == kInt4, "unknown linear kind ", kind);
    y = at::_weight_int4pack_mm_for_cpu(flat, packed, kGroup, scales);
  }
  if (has_bias) y = y + in.tensor();
  return y.reshape(out_shape);
}

// Reads a group of linears that take the same input: their outputs side by side (one joined product, or the
// separate products concatenated, as lab.lean_forward's _Joined does).
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

// transformers' rotate_half: cat(-x2, x1) over the last dimension
at::Tensor rotate_half(const at::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  at::Tensor x1 = x.slice(-1, 0, half);
  at::Tensor x2 = x.slice(-1, half, std::numeric_limits<int64_t>::max());
  return at::cat({-x2, x1}, -1);
}

// one value widened to float64 (exact); bf16 is the upper half of a float32, widened by a shift the compiler
// vectorizes, other types go through c10's conversion
template <typename scalar_t>
inline double widen(scalar_t x) {
  return static_cast<double>(static_cast<float>(x));
}

template <>
inline double widen<c10::BFloat16>(c10::BFloat16 x) {
  const uint32_t word = static_cast<uint32_t>(x.x) << 16;
  float value;
  std::memcpy(&value, &word, sizeof(value));
  return value;
}

// lab.invariance.exact_attention's number, softmax(q k^T * scaling) v in float64 rounded back once, with the
// same-valued steps: scores are exact float64 sums of exact products of the reduced-precision inputs (any order
// gives the same number, so the loop below gives the bits of exact_attention's batched product), the softmax is
// ATen's float64 softmax over the same [kv_heads, shared * T, S] scores, and each row's weighted sum of values
// adds its visible keys in order in float64 (exact_attention's batched product adds in another order: the
// results differ only where that ~1e-16 relative difference lands on a bf16 rounding boundary; its docstring
// gives the odds), then rounds double -> float -> bf16 / fp16 as ATen's conversion does. A row's loop does not
// depend on the other rows or on masked keys (they have weight exactly 0 and add nothing).
// query [1, heads, T, d], key / value [1, kv_heads, S, d], hidden_keys [T, S] bool; returns [1, T, heads, d].
template <typename scalar_t>
at::Tensor attention_rows(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                          const bool* hidden, double scaling) {
  const int64_t heads = query.size(1), rows = query.size(2), dim = query.size(3);
  const int64_t kv_heads = key.size(1), keys = key.size(2), shared = heads / kv_heads;
  const at::Tensor qc = query.contiguous(), kc = key.contiguous(), vc = value.contiguous();
  const scalar_t* q = qc.data_ptr<scalar_t>();
  const scalar_t* k = kc.data_ptr<scalar_t>();
  const scalar_t* v = vc.data_ptr<scalar_t>();
  // scores [kv_heads, shared * T, S] as exact_attention lays them out (query head h = kv * shared + i)
  at::Tensor scores = at::empty({kv_heads, shared * rows, keys}, query.options().dtype(at::kDouble));
  double* score_data = scores.data_ptr<double>();
  at::parallel_for(0, kv_heads * shared * rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<double> query_row(dim);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t kv = task / (shared * rows), i = task % (shared * rows);
      const int64_t h = kv * shared + i / rows, t = i % rows;
      const scalar_t* q_row = q + (h * rows + t) * dim;
      for (int64_t j = 0; j < dim; ++j) query_row[j] = widen(q_row[j]);
      const double* qd = query_row.data();
      const scalar_t* k_head = k + kv * keys * dim;
      double* out = score_data + task * keys;
      const bool* hidden_row = hidden == nullptr ? nullptr : hidden + t * keys;
      int64_t s = 0;
      for (; s + 4 <= keys; s += 4) {  // four keys at a time: four independent sums keep the FMA units busy
        const scalar_t *k0 = k_head + s * dim, *k1 = k0 + dim, *k2 = k1 + dim, *k3 = k2 + dim;
        double s0 = 0, s1 = 0, s2 = 0, s3 = 0;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
        for (int64_t j = 0; j < dim; ++j) {
          s0 += qd[j] * widen(k0[j]);
          s1 += qd[j] * widen(k1[j]);
          s2 += qd[j] * widen(k2[j]);
          s3 += qd[j] * widen(k3[j]);
        }
        out[s] = s0, out[s + 1] = s1, out[s + 2] = s2, out[s + 3] = s3;
      }
      for (; s < keys; ++s) {
        const scalar_t* k_row = k_head + s * dim;
        double score = 0;
#pragma omp simd reduction(+ : score)
        for (int64_t j = 0; j < dim; ++j) score += qd[j] * widen(k_row[j]);
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
  at::parallel_for(0, kv_heads * shared * rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<double> acc(dim);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t kv = task / (shared * rows), i = task % (shared * rows);
      const int64_t h = kv * shared + i / rows, t = i % rows;
      const double* w = weight_data + task * keys;
      const scalar_t* v_head = v + kv * keys * dim;
      double* a = acc.data();
      std::fill(a, a + dim, 0.0);
      for (int64_t s = 0; s < keys; ++s) {
        if (w[s] == 0) continue;  // a masked key (or an underflowed weight) adds exactly nothing
        const scalar_t* v_row = v_head + s * dim;
        const double weight = w[s];
#pragma omp simd
        for (int64_t j = 0; j < dim; ++j) a[j] += weight * widen(v_row[j]);
      }
      scalar_t* o = out_data + (t * heads + h) * dim;
      for (int64_t j = 0; j < dim; ++j) o[j] = static_cast<scalar_t>(static_cast<float>(a[j]));
    }
  });
  return out;
}

}  // namespace

at::Tensor exact_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                           const c10::optional<at::Tensor>& hidden_keys, double scaling) {
  TORCH_CHECK(query.dim() == 4 && query.size(0) == 1 && key.size(0) == 1, "exact_attention: one sequence");
  TORCH_CHECK(query.size(1) % key.size(1) == 0, "exact_attention: query heads are a multiple of kv heads");
  at::Tensor hidden;
  if (hidden_keys.has_value()) {
    hidden = hidden_keys->to(at::kBool).contiguous();
    TORCH_CHECK(hidden.size(0) == query.size(2) && hidden.size(1) == key.size(2), "exact_attention: mask [T, S]");
  }
  const bool* hidden_data = hidden.defined() ? hidden.data_ptr<bool>() : nullptr;
  at::Tensor out;
  AT_DISPATCH_REDUCED_FLOATING_TYPES(query.scalar_type(), "exact_attention", [&] {
    out = attention_rows<scalar_t>(query, key, value, hidden_data, scaling);
  });
  return out;
}

// hidden [1, T, H] (the embeddings); per layer the past keys / values [1, kv_heads, P, d]; cos / sin [1, T, d];
// hidden_keys [T, P + T] bool or None (lab.invariance._hidden_keys). Returns the final-norm hidden states, each
// layer's keys and values with the T new positions appended, and (when record) each layer's output.
std::tuple<at::Tensor, std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>> decoder_layers(
    const at::Tensor& embeds, at::TensorList past_keys, at::TensorList past_values, const at::Tensor& cos,
    const at::Tensor& sin, const c10::optional<at::Tensor>& hidden_keys, at::TensorList params,
    at::IntArrayRef spec, int64_t heads, int64_t kv_heads, int64_t head_dim, double scaling, double eps,
    bool record) {
  const std::vector<at::Tensor> param_list(params.begin(), params.end());
  const std::vector<int64_t> spec_list(spec.begin(), spec.end());
  Reader in{param_list, spec_list};
  const int64_t layers = static_cast<int64_t>(past_keys.size());
  const int64_t batch = embeds.size(0), tokens = embeds.size(1);
  const int64_t rotated = heads + kv_heads;  // query heads, then key heads, then value heads
  const at::Tensor cos_heads = cos.unsqueeze(1), sin_heads = sin.unsqueeze(1);
  std::vector<at::Tensor> keys, values, recorded;
  at::Tensor hidden = embeds;
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor& input_norm = in.tensor();
    const at::Tensor& post_norm = in.tensor();
    // attention (LlamaAttention.forward at inference, as lab.lean_forward._attention)
    at::Tensor normed = rms_norm(hidden, input_norm, eps);
    at::Tensor states = joined(in, normed).view({batch, tokens, -1, head_dim}).transpose(1, 2);
    at::Tensor qk = states.slice(1, 0, rotated);
    at::Tensor query_key = (qk * cos_heads) + (rotate_half(qk) * sin_heads);
    at::Tensor query = query_key.slice(1, 0, heads);
    at::Tensor key = query_key.slice(1, heads, std::numeric_limits<int64_t>::max());
    at::Tensor value = states.slice(1, rotated, std::numeric_limits<int64_t>::max());
    keys.push_back(at::cat({past_keys[l], key}, -2));
    values.push_back(at::cat({past_values[l], value}, -2));
    at::Tensor attended = exact_attention(query, keys.back(), values.back(), hidden_keys, scaling);
    hidden = hidden + linear(in, attended.reshape({batch, tokens, -1}).contiguous());
    // MLP (LlamaMLP.forward with SiLU, as lab.lean_forward._mlp)
    at::Tensor mlp_in = rms_norm(hidden, post_norm, eps);
    at::Tensor gate_up = joined(in, mlp_in);
    const int64_t intermediate = in.integer();  // the gate's output size
    std::vector<at::Tensor> halves = gate_up.split_with_sizes({intermediate, gate_up.size(-1) - intermediate}, -1);
    hidden = hidden + linear(in, at::silu(halves[0]) * halves[1]);
    if (record) recorded.push_back(hidden);
  }
  const at::Tensor& final_norm = in.tensor();
  TORCH_CHECK(in.p == param_list.size() && in.s == spec_list.size(), "decoder_layers: spec and parameters disagree");
  return {rms_norm(hidden, final_norm, eps), keys, values, recorded};
}

TORCH_LIBRARY(decoding_lab, m) {
  m.def(
      "decoder_layers(Tensor embeds, Tensor[] past_keys, Tensor[] past_values, Tensor cos, Tensor sin, "
      "Tensor? hidden_keys, Tensor[] params, int[] spec, int heads, int kv_heads, int head_dim, float scaling, "
      "float eps, bool record) -> (Tensor, Tensor[], Tensor[], Tensor[])",
      &decoder_layers);
  m.def("exact_attention(Tensor query, Tensor key, Tensor value, Tensor? hidden_keys, float scaling) -> Tensor",
        &exact_attention);
}
