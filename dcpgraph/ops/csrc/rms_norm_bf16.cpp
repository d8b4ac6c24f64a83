// HF's RMSNorm of a bf16 tensor in one pass over each row (the CPU kernel of dcpgraph::rms_norm_bf16,
// schema in dcpgraph/ops/library.py; built by dcpgraph/ops/rms_norm.py):
//   h = float(x);  r = 1 / sqrt(sum(h^2) / K + eps);  y = bf16(float(w) * float(bf16(h * r)))
// the same two roundings as `w * (h * rsqrt(mean(h^2) + eps)).to(bf16)` in eager torch (which takes
// eight ops and as many temporaries); only the order of the fp32 sum of squares differs.
#include <torch/extension.h>
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <immintrin.h>
#include <cmath>
#include <cstdint>

namespace {

using bf16 = c10::BFloat16;

#if defined(__AVX512F__) && defined(__AVX512BW__)
inline __m512 load16(const bf16* p) {  // 16 bf16 -> fp32 (exact: the bits shifted up)
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}
#endif

void norm_row(const bf16* x, const bf16* w, int64_t K, float eps, bf16* y) {
  float sum = 0.0f;
  int64_t k = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  for (; k + 32 <= K; k += 32) {
    const __m512 a = load16(x + k), b = load16(x + k + 16);
    acc0 = _mm512_fmadd_ps(a, a, acc0);
    acc1 = _mm512_fmadd_ps(b, b, acc1);
  }
  sum = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
#endif
  for (; k < K; ++k) {
    const float h = static_cast<float>(x[k]);
    sum += h * h;
  }
  const float r = 1.0f / std::sqrt(sum / static_cast<float>(K) + eps);
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
  at::Tensor y = at::empty_like(xc);
  const int64_t K = x.size(-1), rows = xc.numel() / K;
  const bf16* xp = xc.data_ptr<bf16>();
  const bf16* wp = w.data_ptr<bf16>();
  bf16* yp = y.data_ptr<bf16>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / K), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) norm_row(xp + r * K, wp, K, e, yp + r * K);
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
