// The CPU kernel of dcpgraph::rms_norm_f32 (schema in dcpgraph/ops/library.py; built by
// dcpgraph/ops/rms_norm_f32.py): HF's RMSNorm of an fp32 tensor, rms_norm_rows.h's row loop for float,
//   v = mean(x^2, -1);  y = w * (x * (1 / sqrt(v + eps)))
// equal bit for bit to eager torch's `w * (x * rsqrt(mean(x.pow(2), -1) + eps))` on a contiguous x.
#include <torch/extension.h>
#include <torch/library.h>

#include "rms_norm_rows.h"

namespace {

// The op's meaning (rms_norm_f32.py's rms_norm_f32_reference), run for inputs the row loop does not take.
at::Tensor eager(const at::Tensor& x, const at::Tensor& w, double eps) {
  return w * (x * at::rsqrt(x.pow(2).mean({-1}, true) + eps));
}

at::Tensor rms_norm_f32_op(const at::Tensor& x, const at::Tensor& w, double eps) {
  return dcpgraph_rms_norm::rms_norm_rows<float>(x, w, eps, &eager);
}

bool loaded() { return true; }

}  // namespace

TORCH_LIBRARY_IMPL(dcpgraph, CPU, m) { m.impl("rms_norm_f32", &rms_norm_f32_op); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("loaded", &loaded, "the module loaded (its CPU kernel for dcpgraph::rms_norm_f32 is registered)");
  m.def("rms_norm_f32", &rms_norm_f32_op, "HF RMSNorm of an fp32 tensor (the op's CPU kernel)");
}
