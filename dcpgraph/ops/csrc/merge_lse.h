// dcpgraph::merge_attention's CPU kernel (meaning and edge rules: dcpgraph/ops/merge.py): for
// partials (o_i, lse_i), i < N, over disjoint key sets, per row r and column x
//   l_i = lse_i[r], with NaN and +inf read as -inf (an empty shard)
//   peak = max_i l_i (0 where every l_i is -inf),  s_i = exp(l_i - peak),  total = sum_i s_i
//   lse[r] = peak + log(total)                      (-inf for a row of empty shards)
//   out[r, x] = sum_i (w_i > 0 ? w_i o_i[r, x] : 0) with w_i = s_i / max(total, 1)
// accumulated in fp32 (fp64 for fp64 inputs), so a shard of weight 0 contributes nothing, NaN
// included. One pass over the rows in C++ where the reference runs a dozen eager torch ops (a
// decode step's merge of 3 partials x 8 heads: ~130 us a call in those ops).
#pragma once

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <cmath>
#include <limits>
#include <optional>
#include <tuple>
#include <type_traits>

namespace merge_lse {

constexpr int64_t kMaxParts = 64;  // partials per row (a DCP group and the new tokens; more: the reference)

inline bool floating(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kBFloat16 || t == at::kHalf;
}

template <class LIn>
using LseAcc = std::conditional_t<std::is_same_v<LIn, double>, double, float>;  // the LSE's accumulation

// Row r of lses [N, rows]: w[i] = exp(l_i - peak) / max(total, 1) (the merge weights), and returns
// the merged LSE peak + log(total).
template <class LIn>
inline LseAcc<LIn> row_weights(const LIn* lses, int64_t n, int64_t rows, int64_t r, LseAcc<LIn>* w) {
  using LA = LseAcc<LIn>;
  constexpr LA inf = std::numeric_limits<LA>::infinity();
  LA peak = -inf;
  for (int64_t i = 0; i < n; ++i) {
    const LA l = static_cast<LA>(lses[i * rows + r]);
    w[i] = std::isnan(l) || l == inf ? -inf : l;
    peak = std::max(peak, w[i]);
  }
  if (peak == -inf) peak = 0;
  LA total = 0;
  for (int64_t i = 0; i < n; ++i) {
    w[i] = std::exp(w[i] - peak);
    total += w[i];
  }
  const LA denom = std::max(total, LA(1));
  for (int64_t i = 0; i < n; ++i) w[i] /= denom;
  return peak + std::log(total);
}

template <class O, class LIn>
void merge_rows(const O* outs, const LIn* lses, int64_t n, int64_t rows, int64_t d, O* out, LseAcc<LIn>* lse_out) {
  using LA = LseAcc<LIn>;
  using A = std::conditional_t<std::is_same_v<O, double> || std::is_same_v<LA, double>, double, float>;
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, n * d));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    LA w[kMaxParts];
    for (int64_t r = begin; r < end; ++r) {
      lse_out[r] = row_weights(lses, n, rows, r, w);
      O* o = out + r * d;
      for (int64_t x = 0; x < d; ++x) {
        A acc = 0;
        for (int64_t i = 0; i < n; ++i)
          if (w[i] > 0) acc += static_cast<A>(w[i]) * static_cast<A>(outs[(i * rows + r) * d + x]);
        o[x] = static_cast<O>(acc);
      }
    }
  });
}

// rescale_to_global (dcpgraph/ops/merge.py): lse_g = the merged LSE of lses_all's row (row_weights),
// scaled[r, x] = w > 0 ? w out[r, x] : 0 with w = exp(own - lse_g) (0 where lse_g is -inf; own read
// as row_weights reads it), in the wider of the LSE's accumulation dtype and out's.
template <class O, class LIn, class A>
void rescale_rows(const O* out, const LIn* own, const LIn* lses, int64_t n, int64_t rows, int64_t d, A* scaled,
                  LseAcc<LIn>* lse_out) {
  using LA = LseAcc<LIn>;
  constexpr LA inf = std::numeric_limits<LA>::infinity();
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, n + d));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    LA w[kMaxParts];
    for (int64_t r = begin; r < end; ++r) {
      const LA g = row_weights(lses, n, rows, r, w);
      lse_out[r] = g;
      const LA l = static_cast<LA>(own[r]);
      const LA mine = std::isnan(l) || l == inf ? -inf : l;
      const LA weight = g == -inf ? LA(0) : std::exp(mine - g);
      for (int64_t x = 0; x < d; ++x)
        scaled[r * d + x] = weight > 0 ? static_cast<A>(weight) * static_cast<A>(out[r * d + x]) : A(0);
    }
  });
}

// (out, lse) of merging outs [N, ..., D] by lses [N, ...]; nullopt (the caller's reference runs)
// for what this kernel does not take: non-CPU tensors, mismatched shapes (the reference raises),
// N of 0 or more than kMaxParts, outs or LSEs of other than fp32/fp64/bf16/fp16.
inline std::optional<std::tuple<at::Tensor, at::Tensor>> merge_attention(const at::Tensor& outs,
                                                                        const at::Tensor& lses) {
  if (!outs.device().is_cpu() || !lses.device().is_cpu() || outs.dim() != lses.dim() + 1 || outs.dim() < 2)
    return std::nullopt;
  for (int64_t i = 0; i < lses.dim(); ++i)
    if (outs.size(i) != lses.size(i)) return std::nullopt;
  const auto ot = outs.scalar_type(), lt = lses.scalar_type();
  if (!floating(lt) || !floating(ot)) return std::nullopt;
  const int64_t n = outs.size(0), d = outs.size(-1);
  if (n < 1 || n > kMaxParts) return std::nullopt;
  const int64_t rows = lses.numel() / n;  // lses is outs without its last dim
  const at::Tensor o = outs.contiguous(), l = lses.contiguous();
  auto shape = outs.sizes().vec();
  shape.erase(shape.begin());
  at::Tensor out = at::empty(shape, outs.options());
  // the LSE in its accumulation dtype: fp64 for fp64 LSEs, else fp32
  at::Tensor lse = at::empty(lses.sizes().slice(1), lses.options().dtype(lt == at::kDouble ? at::kDouble : at::kFloat));
  if (rows == 0) return std::make_tuple(out, lse);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, ot, "merge_attention", [&] {
    using O = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, lt, "merge_attention_lse", [&] {
      merge_rows<O, scalar_t>(o.data_ptr<O>(), l.data_ptr<scalar_t>(), n, rows, d, out.data_ptr<O>(),
                              lse.data_ptr<LseAcc<scalar_t>>());
    });
  });
  return std::make_tuple(out, lse);
}

// (scaled, lse_global) of rescale_to_global(out [..., D], lse [...], lses_all [N, ...]); nullopt
// (the reference runs) for what this kernel does not take, as merge_attention's.
inline std::optional<std::tuple<at::Tensor, at::Tensor>> rescale_to_global(const at::Tensor& out, const at::Tensor& lse,
                                                                          const at::Tensor& lses_all) {
  if (!out.device().is_cpu() || !lse.device().is_cpu() || !lses_all.device().is_cpu() ||
      out.dim() != lse.dim() + 1 || lses_all.dim() != lse.dim() + 1 || lse.scalar_type() != lses_all.scalar_type() ||
      !floating(out.scalar_type()) || !floating(lse.scalar_type()))
    return std::nullopt;
  for (int64_t i = 0; i < lse.dim(); ++i)
    if (out.size(i) != lse.size(i) || lses_all.size(i + 1) != lse.size(i)) return std::nullopt;
  const int64_t n = lses_all.size(0), d = out.size(-1), rows = lse.numel();
  if (n < 1 || n > kMaxParts) return std::nullopt;
  const auto lt = lse.scalar_type();
  const auto la = lt == at::kDouble ? at::kDouble : at::kFloat;
  const auto acc = (la == at::kDouble || out.scalar_type() == at::kDouble) ? at::kDouble : at::kFloat;
  const at::Tensor o = out.contiguous(), own = lse.contiguous(), all = lses_all.contiguous();
  at::Tensor scaled = at::empty(out.sizes(), out.options().dtype(acc));
  at::Tensor lse_g = at::empty(lse.sizes(), lse.options().dtype(la));
  if (rows == 0) return std::make_tuple(scaled, lse_g);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "rescale_to_global", [&] {
    using O = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, lt, "rescale_to_global_lse", [&] {
      using LIn = scalar_t;
      if (acc == at::kDouble)
        rescale_rows<O, LIn, double>(o.data_ptr<O>(), own.data_ptr<LIn>(), all.data_ptr<LIn>(), n, rows, d,
                                     scaled.data_ptr<double>(), lse_g.data_ptr<LseAcc<LIn>>());
      else
        rescale_rows<O, LIn, float>(o.data_ptr<O>(), own.data_ptr<LIn>(), all.data_ptr<LIn>(), n, rows, d,
                                    scaled.data_ptr<float>(), lse_g.data_ptr<LseAcc<LIn>>());
    });
  });
  return std::make_tuple(scaled, lse_g);
}

}  // namespace merge_lse
