// HF's RMSNorm of an fp32 tensor (the CPU kernel of dcpgraph::rms_norm_f32, schema in
// dcpgraph/ops/library.py; built by dcpgraph/ops/rms_norm_f32.py):
//   v = mean(x^2, -1);  y = w * (x * (1 / sqrt(v + eps)))
// equal bit for bit to eager torch's `w * (x * rsqrt(mean(x.pow(2), -1) + eps))` on a contiguous x:
// the mean is ATen's own reduction of the squares (the same fp32 sums in the same order), the rest is
// elementwise with the same IEEE operations, one pass per row instead of four more eager ops and
// their temporaries.
#include <torch/extension.h>
#include <torch/library.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>

namespace {

void norm_row(const float* x, const float* w, int64_t K, float mean_square, float eps, float* y) {
  const float r = 1.0f / std::sqrt(mean_square + eps);
  for (int64_t i = 0; i < K; ++i) y[i] = w[i] * (x[i] * r);
}

at::Tensor rms_norm_f32_op(const at::Tensor& x, const at::Tensor& w, double eps) {
  if (!(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat && x.dim() > 0 && w.dim() == 1 &&
        w.numel() == x.size(-1) && x.size(-1) > 0 && w.is_contiguous())) {
    // Anything else: eager torch's own sequence (the op's meaning).
    return w * (x * at::rsqrt(x.pow(2).mean({-1}, true) + eps));
  }
  const at::Tensor xc = x.contiguous();
  const int64_t K = x.size(-1), rows = xc.numel() / K;
  const float* xp = xc.data_ptr<float>();
  // x.pow(2) is x * x (one rounding), written here; the mean stays ATen's reduction.
  at::Tensor squares = at::empty({rows, K}, xc.options());
  float* sq = squares.data_ptr<float>();
  for (int64_t i = 0; i < rows * K; ++i) sq[i] = xp[i] * xp[i];
  const at::Tensor mean_square = squares.mean({-1}, true);
  at::Tensor y = at::empty_like(xc);
  const float* wp = w.data_ptr<float>();
  const float* mp = mean_square.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / K), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) norm_row(xp + r * K, wp, K, mp[r], e, yp + r * K);
  });
  return y;
}

bool loaded() { return true; }

}  // namespace

TORCH_LIBRARY_IMPL(dcpgraph, CPU, m) { m.impl("rms_norm_f32", &rms_norm_f32_op); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("loaded", &loaded, "the module loaded (its CPU kernel for dcpgraph::rms_norm_f32 is registered)");
  m.def("rms_norm_f32", &rms_norm_f32_op, "HF RMSNorm of an fp32 tensor (the op's CPU kernel)");
}
