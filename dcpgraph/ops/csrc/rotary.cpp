// HF's rotary embedding (the CPU kernel of dcpgraph::rotary_embedding, schema in
// dcpgraph/ops/library.py; built by dcpgraph/ops/rotary.py):
//   y = x * cos + rotate_half(x) * sin,   rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2])
// for x [B, H, T, D] (any strides) and cos/sin of x's dtype broadcastable to it. Eager torch
// computes each of the two products and the sum in fp32 and rounds each to x's dtype (bf16, fp16;
// for fp32 the rounding is the fp32 operation's own; negation is exact). This does the same three
// roundings element by element, built without contraction into fused multiply-adds, so the results
// are equal bit for bit, in one pass instead of seven eager ops and their temporaries.
#include <torch/extension.h>
#include <torch/library.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

namespace {

at::Tensor rotary_reference(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t half = x.size(-1) / 2;
  const at::Tensor rotated = at::cat({-x.narrow(-1, half, x.size(-1) - half), x.narrow(-1, 0, half)}, -1);
  return x * cos + rotated * sin;
}

// One element: the op's three roundings to T (float: each fp32 operation rounds once).
template <class T>
inline T rotate(float x, float r, float c, float s) {
  const T p(x * c), q(r * s);
  return T(static_cast<float>(p) + static_cast<float>(q));
}

template <class T>
void rotary_rows(const at::Tensor& x, const at::Tensor& c, const at::Tensor& s, at::Tensor& y) {
  const at::IntArrayRef shape = x.sizes();
  const int64_t n0 = shape[0], n1 = shape[1], n2 = shape[2], d = shape[3], half = d / 2;
  const T* xp = x.data_ptr<T>();
  const T* cp = c.data_ptr<T>();
  const T* sp = s.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  const int64_t xs = x.stride(3), cs = c.stride(3), ss = s.stride(3), ys = y.stride(3);
  for (int64_t a = 0; a < n0; ++a)
    for (int64_t b = 0; b < n1; ++b)
      for (int64_t t = 0; t < n2; ++t) {
        const T* xr = xp + a * x.stride(0) + b * x.stride(1) + t * x.stride(2);
        const T* cr = cp + a * c.stride(0) + b * c.stride(1) + t * c.stride(2);
        const T* sr = sp + a * s.stride(0) + b * s.stride(1) + t * s.stride(2);
        T* yr = yp + a * y.stride(0) + b * y.stride(1) + t * y.stride(2);
        for (int64_t i = 0; i < half; ++i)
          yr[i * ys] = rotate<T>(static_cast<float>(xr[i * xs]), -static_cast<float>(xr[(i + half) * xs]),
                                 static_cast<float>(cr[i * cs]), static_cast<float>(sr[i * ss]));
        for (int64_t i = half; i < d; ++i)
          yr[i * ys] = rotate<T>(static_cast<float>(xr[i * xs]), static_cast<float>(xr[(i - half) * xs]),
                                 static_cast<float>(cr[i * cs]), static_cast<float>(sr[i * ss]));
      }
}

at::Tensor rotary_op(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const auto t = x.scalar_type();
  const bool mine = (t == at::kBFloat16 || t == at::kHalf || t == at::kFloat) && cos.scalar_type() == t &&
                    sin.scalar_type() == t && x.dim() == 4 && x.size(3) % 2 == 0 && x.size(3) > 0 &&
                    cos.dim() <= 4 && sin.dim() <= 4 && x.device().is_cpu();
  if (!mine) return rotary_reference(x, cos, sin);  // anything else: eager torch's own sequence
  at::Tensor c, s;
  try {  // broadcast to x's shape (stride 0 on broadcast dims); a shape that does not is torch's to report
    c = cos.expand(x.sizes());
    s = sin.expand(x.sizes());
  } catch (const c10::Error&) {
    return rotary_reference(x, cos, sin);
  }
  at::Tensor y = at::empty_like(x);
  if (t == at::kBFloat16) rotary_rows<c10::BFloat16>(x, c, s, y);
  else if (t == at::kHalf) rotary_rows<c10::Half>(x, c, s, y);
  else rotary_rows<float>(x, c, s, y);
  return y;
}

bool loaded() { return true; }

}  // namespace

TORCH_LIBRARY_IMPL(dcpgraph, CPU, m) { m.impl("rotary_embedding", &rotary_op); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("loaded", &loaded, "the module loaded (its CPU kernel for dcpgraph::rotary_embedding is registered)");
  m.def("rotary_embedding", &rotary_op, "HF rotary embedding (the op's CPU kernel)");
}
