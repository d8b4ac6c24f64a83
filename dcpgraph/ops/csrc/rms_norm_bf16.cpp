// The CPU kernel of dcpgraph::rms_norm_bf16 (schema in dcpgraph/ops/library.py; built by
// dcpgraph/ops/rms_norm.py): HF's RMSNorm of a bf16 tensor, rms_norm_rows.h's row loop for bf16,
//   h = float(x);  v = mean(h^2, -1);  y = bf16(float(w) * float(bf16(h * (1 / sqrt(v + eps)))))
// equal bit for bit to eager torch's `w * (h * rsqrt(mean(h.pow(2), -1) + eps)).to(bf16)`.
#include <torch/extension.h>
#include <torch/library.h>
#include <c10/util/BFloat16.h>

#include "rms_norm_rows.h"

namespace {

// The op's meaning (rms_norm.py's rms_norm_reference), run for inputs the row loop does not take.
at::Tensor eager(const at::Tensor& x, const at::Tensor& w, double eps) {
  const at::Tensor h = x.to(at::kFloat);
  const at::Tensor n = h * at::rsqrt(h.pow(2).mean({-1}, true) + eps);
  return w * n.to(x.scalar_type());
}

at::Tensor rms_norm_bf16_op(const at::Tensor& x, const at::Tensor& w, double eps) {
  return dcpgraph_rms_norm::rms_norm_rows<c10::BFloat16>(x, w, eps, &eager);
}

bool loaded() { return true; }

}  // namespace

TORCH_LIBRARY_IMPL(dcpgraph, CPU, m) { m.impl("rms_norm_bf16", &rms_norm_bf16_op); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("loaded", &loaded, "the module loaded (its CPU kernel for dcpgraph::rms_norm_bf16 is registered)");
  m.def("rms_norm_bf16", &rms_norm_bf16_op, "HF RMSNorm of a bf16 tensor (the op's CPU kernel)");
}
