// HF's RMSNorm over the last dimension of a tensor of element type T (float or c10::BFloat16), the
// CPU kernel behind dcpgraph::rms_norm_bf16 and dcpgraph::rms_norm_f32 (both in rms_norm.cpp):
//   h = float(x);  v = mean(h^2, -1);  y = T(float(w) * float(T(h * (1 / sqrt(v + eps)))))
// equal bit for bit to eager torch's `w * (h * rsqrt(mean(h.pow(2), -1) + eps)).to(T)` on a contiguous
// x: the mean is ATen's own reduction of the squares (the same fp32 sums in the same order), the rest is
// elementwise with the same IEEE operations and roundings (for T = float both roundings are the
// identity, as both casts return their input), done in one pass per row instead of the eager chain's
// further ops and temporaries. Built without -ffast-math: 1/sqrt must stay exact, not an approximate
// reciprocal square root.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/core/ScalarType.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace dcpgraph_rms_norm {

// One row: y = T(float(w) * float(T(float(x) * r))), r = 1 / sqrt(mean_square + eps).
template <typename T>
void norm_row(const T* x, const T* w, int64_t K, float mean_square, float eps, T* y) {
  const float r = 1.0f / std::sqrt(mean_square + eps);
  for (int64_t i = 0; i < K; ++i) {
    const T normed(static_cast<float>(x[i]) * r);  // round to nearest even, as .to(T); none for float
    y[i] = T(static_cast<float>(w[i]) * static_cast<float>(normed));
  }
}

using EagerNorm = at::Tensor (*)(const at::Tensor& x, const at::Tensor& w, double eps);

// The op: rows of a T tensor with a contiguous 1-D T weight of x.size(-1) > 0 elements run the kernel;
// anything else runs `eager`, the op's own eager torch sequence (its meaning, as its Python reference).
template <typename T>
at::Tensor rms_norm_rows(const at::Tensor& x, const at::Tensor& w, double eps, EagerNorm eager) {
  constexpr at::ScalarType kType = c10::CppTypeToScalarType<T>::value;
  if (!(x.scalar_type() == kType && w.scalar_type() == kType && x.dim() > 0 && w.dim() == 1 &&
        w.numel() == x.size(-1) && x.size(-1) > 0 && w.is_contiguous())) {
    return eager(x, w, eps);
  }
  const at::Tensor xc = x.contiguous();
  const int64_t K = x.size(-1), rows = xc.numel() / K;
  const T* xp = xc.data_ptr<T>();
  // h.pow(2) is h * h (exact inputs for bf16, one rounding), written here; the mean stays ATen's reduction.
  at::Tensor squares = at::empty({rows, K}, x.options().dtype(at::kFloat));
  float* sq = squares.data_ptr<float>();
  for (int64_t i = 0; i < rows * K; ++i) {
    const float h = static_cast<float>(xp[i]);
    sq[i] = h * h;
  }
  const at::Tensor mean_square = squares.mean({-1}, true);
  at::Tensor y = at::empty_like(xc);
  const T* wp = w.data_ptr<T>();
  const float* mp = mean_square.data_ptr<float>();
  T* yp = y.data_ptr<T>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / K), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) norm_row(xp + r * K, wp, K, mp[r], e, yp + r * K);
  });
  return y;
}

}  // namespace dcpgraph_rms_norm
