// HF's RMSNorm of a bf16 tensor (the CPU kernel of dcpgraph::rms_norm_bf16, schema in
// dcpgraph/ops/library.py; built by dcpgraph/ops/rms_norm.py):
//   h = float(x);  v = mean(h^2, -1);  y = bf16(float(w) * float(bf16(h * (1 / sqrt(v + eps)))))
// equal bit for bit to eager torch's `w * (h * rsqrt(mean(h.pow(2), -1) + eps)).to(bf16)`: the mean is
// ATen's own reduction of the squares (so the same fp32 sums in the same order), the rest is elementwise with the
// same IEEE operations and roundings, done in one pass per row instead of five more eager ops and
// their temporaries.
#include <torch/extension.h>
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstdint>

namespace {

using bf16 = c10::BFloat16;

void norm_row(const bf16* x, const bf16* w, int64_t K, float mean_square, float eps, bf16* y) {
  const float r = 1.0f / std::sqrt(mean_square + eps);
  for (int64_t i = 0; i < K; ++i) {
    const bf16 normed(static_cast<float>(x[i]) * r);  // round to nearest even, as .to(bf16)
    y[i] = bf16(static_cast<float>(w[i]) * static_cast<float>(normed));
  }
}

at::Tensor rms_norm_bf16_op(const at::Tensor& x, const at::Tensor& w, double eps) {
  if (!(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16 && x.dim() > 0 && w.dim() == 1 &&
        w.numel() == x.size(-1) && x.size(-1) > 0 && w.is_contiguous())) {
    // Anything else: eager torch's own sequence (the op's meaning).
    const at::Tensor h = x.to(at::kFloat);
    const at::Tensor n = h * at::rsqrt(h.pow(2).mean({-1}, true) + eps);
    return w * n.to(x.scalar_type());
  }
  const at::Tensor xc = x.contiguous();
  const int64_t K = x.size(-1), rows = xc.numel() / K;
  const bf16* xp = xc.data_ptr<bf16>();
  // h.pow(2) is h * h (exact inputs, one rounding), written here; the mean stays ATen's reduction.
  at::Tensor squares = at::empty({rows, K}, x.options().dtype(at::kFloat));
  float* sq = squares.data_ptr<float>();
  for (int64_t i = 0; i < rows * K; ++i) {
    const float h = static_cast<float>(xp[i]);
    sq[i] = h * h;
  }
  const at::Tensor mean_square = squares.mean({-1}, true);
  at::Tensor y = at::empty_like(xc);
  const bf16* wp = w.data_ptr<bf16>();
  const float* mp = mean_square.data_ptr<float>();
  bf16* yp = y.data_ptr<bf16>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / K), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) norm_row(xp + r * K, wp, K, mp[r], e, yp + r * K);
  });
  return y;
}

bool loaded() { return true; }

}  // namespace

TORCH_LIBRARY_IMPL(dcpgraph, CPU, m) { m.impl("rms_norm_bf16", &rms_norm_bf16_op); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("loaded", &loaded, "the module loaded (its CPU kernel for dcpgraph::rms_norm_bf16 is registered)");
  m.def("rms_norm_bf16", &rms_norm_bf16_op, "HF RMSNorm of a bf16 tensor (the op's CPU kernel)");
}
