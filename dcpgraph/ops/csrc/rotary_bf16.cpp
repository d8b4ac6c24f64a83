// HF's rotary embedding of a bf16 tensor (the CPU kernel of dcpgraph::rotary_bf16, schema in
// dcpgraph/ops/library.py; built by dcpgraph/ops/rotary.py):
//   y = x * cos + rotate_half(x) * sin,   rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2])
// for x [B, H, T, D] bf16 (any strides) and cos/sin bf16 broadcastable to it. Eager torch computes
// each of the two products and the sum in fp32 and rounds each to bf16 (negation is exact); this
// does the same three roundings element by element, so the results are equal bit for bit, in one
// pass instead of seven eager ops and their temporaries.
#include <torch/extension.h>
#include <torch/library.h>
#include <c10/util/BFloat16.h>

#include <cstdint>

namespace {

using bf16 = c10::BFloat16;

at::Tensor rotary_reference(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t half = x.size(-1) / 2;
  const at::Tensor rotated = at::cat({-x.narrow(-1, half, x.size(-1) - half), x.narrow(-1, 0, half)}, -1);
  return x * cos + rotated * sin;
}

at::Tensor rotary_bf16_op(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const bool mine = x.scalar_type() == at::kBFloat16 && cos.scalar_type() == at::kBFloat16 &&
                    sin.scalar_type() == at::kBFloat16 && x.dim() == 4 && x.size(3) % 2 == 0 && x.size(3) > 0 &&
                    cos.dim() <= 4 && sin.dim() <= 4 && x.device().is_cpu();
  if (!mine) return rotary_reference(x, cos, sin);  // anything else: eager torch's own sequence
  const at::IntArrayRef shape = x.sizes();
  at::Tensor c, s;
  try {  // broadcast to x's shape (stride 0 on broadcast dims); a shape that does not is torch's to report
    c = cos.expand(shape);
    s = sin.expand(shape);
  } catch (const c10::Error&) {
    return rotary_reference(x, cos, sin);
  }
  at::Tensor y = at::empty_like(x);
  const int64_t n0 = shape[0], n1 = shape[1], n2 = shape[2], d = shape[3], half = d / 2;
  const bf16* xp = x.data_ptr<bf16>();
  const bf16* cp = c.data_ptr<bf16>();
  const bf16* sp = s.data_ptr<bf16>();
  bf16* yp = y.data_ptr<bf16>();
  for (int64_t a = 0; a < n0; ++a)
    for (int64_t b = 0; b < n1; ++b)
      for (int64_t t = 0; t < n2; ++t) {
        const bf16* xr = xp + a * x.stride(0) + b * x.stride(1) + t * x.stride(2);
        const bf16* cr = cp + a * c.stride(0) + b * c.stride(1) + t * c.stride(2);
        const bf16* sr = sp + a * s.stride(0) + b * s.stride(1) + t * s.stride(2);
        bf16* yr = yp + a * y.stride(0) + b * y.stride(1) + t * y.stride(2);
        const int64_t xs = x.stride(3), cs = c.stride(3), ss = s.stride(3), ys = y.stride(3);
        for (int64_t i = 0; i < d; ++i) {
          const float xi = static_cast<float>(xr[i * xs]);
          const float ri = i < half ? -static_cast<float>(xr[(i + half) * xs]) : static_cast<float>(xr[(i - half) * xs]);
          const bf16 p(xi * static_cast<float>(cr[i * cs]));  // x * cos, rounded to bf16
          const bf16 q(ri * static_cast<float>(sr[i * ss]));  // rotate_half(x) * sin, rounded
          yr[i * ys] = bf16(static_cast<float>(p) + static_cast<float>(q));
        }
      }
  return y;
}

bool loaded() { return true; }

}  // namespace

TORCH_LIBRARY_IMPL(dcpgraph, CPU, m) { m.impl("rotary_bf16", &rotary_bf16_op); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("loaded", &loaded, "the module loaded (its CPU kernel for dcpgraph::rotary_bf16 is registered)");
  m.def("rotary_bf16", &rotary_bf16_op, "HF rotary embedding of a bf16 tensor (the op's CPU kernel)");
}
