// The CPU kernels of dcpgraph::rms_norm_bf16 and dcpgraph::rms_norm_f32 (schemas in
// dcpgraph/ops/library.py; one build, dcpgraph/ops/rms_norm_kernel.py): HF's RMSNorm, rms_norm_rows.h's
// row loop for c10::BFloat16 and for float,
//   h = float(x);  v = mean(h^2, -1);  y = T(float(w) * float(T(h * (1 / sqrt(v + eps)))))
// equal bit for bit to eager torch's `w * (h * rsqrt(mean(h.pow(2), -1) + eps)).to(T)` (for T = float
// both casts return their input: `w * (x * rsqrt(mean(x.pow(2), -1) + eps))`).
#include <torch/extension.h>
#include <torch/library.h>
#include <c10/util/BFloat16.h>

#include "rms_norm_rows.h"

namespace {

// Both ops' meaning (rms_norm.py's and rms_norm_f32.py's references), run for inputs the row loop
// does not take.
at::Tensor eager(const at::Tensor& x, const at::Tensor& w, double eps) {
  const at::Tensor h = x.to(at::kFloat);
  const at::Tensor n = h * at::rsqrt(h.pow(2).mean({-1}, true) + eps);
  return w * n.to(x.scalar_type());
}

at::Tensor rms_norm_bf16_op(const at::Tensor& x, const at::Tensor& w, double eps) {
  return dcpgraph_rms_norm::rms_norm_rows<c10::BFloat16>(x, w, eps, &eager);
}

at::Tensor rms_norm_f32_op(const at::Tensor& x, const at::Tensor& w, double eps) {
  return dcpgraph_rms_norm::rms_norm_rows<float>(x, w, eps, &eager);
}

bool loaded() { return true; }

}  // namespace

TORCH_LIBRARY_IMPL(dcpgraph, CPU, m) {
  m.impl("rms_norm_bf16", &rms_norm_bf16_op);
  m.impl("rms_norm_f32", &rms_norm_f32_op);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("loaded", &loaded, "the module loaded (its CPU kernels for dcpgraph::rms_norm_bf16/_f32 are registered)");
  m.def("rms_norm_bf16", &rms_norm_bf16_op, "HF RMSNorm of a bf16 tensor (the op's CPU kernel)");
  m.def("rms_norm_f32", &rms_norm_f32_op, "HF RMSNorm of an fp32 tensor (the op's CPU kernel)");
}
