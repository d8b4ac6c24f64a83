// y = x @ W^T (+ b) for fp32 x [M, K] and fp32 W [N, K] (nn.Linear's layout), for few rows (decode:
// M = batch). Built by dcpgraph/ops/linear_f32.py.
//
// A decode step's linears do M multiply-adds per weight, so for small M they are bound by how fast W
// streams from memory. torch's fp32 GEMM reads W at about memory speed for one row (a GEMV) but
// packs it for two or more rows, and a packed copy of a weight that does not fit in cache costs
// another read and a write of it: measured on a Zen 2 core, a 4096x4096 weight at M = 4 took 3.5x
// the time of M = 1. This kernel reads W once, in place: a register block of MB x rows by NB W rows
// keeps MB*NB 8-wide fp32 accumulators (MB*NB + MB + 1 <= 16 AVX2 registers, or MB*NB + NB + 1 where
// the W side stays), each W vector feeding MB FMAs and each x vector NB; a block's sums are reduced
// horizontally once per K. The K tail (K % 8) uses masked loads of W and x (zeros add nothing).
// More than 4 rows run as blocks of 4 over the same W rows, which are then in L1/L2.
//
// W rows are grouped into blocks spread over W (rows b, b + N/nb, ...): each of the nb streams runs on
// through the following rows, so a hardware prefetcher ramps up once per stream rather than once per
// row (the bf16 kernel measured this on Zen 2). Threads split the blocks (at::parallel_for).
//
// linear_f32_op is the CPU kernel of the op dcpgraph::linear_f32 (schema in dcpgraph/ops/library.py),
// registered when this module loads; it applies the rule set by configure() once the Python side's
// self-check passed and runs at::linear for every other call.
#include <torch/extension.h>
#include <torch/library.h>
#include <ATen/Parallel.h>

#include <immintrin.h>
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#define DCP_HAVE_F32_DOT 1
#else
#define DCP_HAVE_F32_DOT 0
#endif

namespace {

#if DCP_HAVE_F32_DOT

inline float hsum8(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 h = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_shuffle_ps(h, h, 1)));
}

// The first n lanes (0 < n < 8) of an 8-lane load; zeros after, never reading past them.
inline __m256i tail_mask(int64_t n) {
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), lanes);
}

// sums[i * NB + j] = dot(x row i, W row j) over K.
template <int MB, int NB>
inline void dot_block(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t K, float* sums) {
  __m256 acc[MB][NB];
#pragma GCC unroll 8
  for (int i = 0; i < MB; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_setzero_ps();
  auto step = [&](int64_t k, auto load) {
    if constexpr (MB * NB + MB + 1 <= 16) {
      __m256 xv[MB];
#pragma GCC unroll 8
      for (int i = 0; i < MB; ++i) xv[i] = load(x + i * ldx + k);
#pragma GCC unroll 8
      for (int j = 0; j < NB; ++j) {
        const __m256 wv = load(w + j * ldw + k);
#pragma GCC unroll 8
        for (int i = 0; i < MB; ++i) acc[i][j] = _mm256_fmadd_ps(xv[i], wv, acc[i][j]);
      }
    } else {
      __m256 wv[NB];
#pragma GCC unroll 8
      for (int j = 0; j < NB; ++j) wv[j] = load(w + j * ldw + k);
#pragma GCC unroll 8
      for (int i = 0; i < MB; ++i) {
        const __m256 xv = load(x + i * ldx + k);
#pragma GCC unroll 8
        for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
      }
    }
  };
  auto whole = [](const float* p) { return _mm256_loadu_ps(p); };
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {  // a 64-byte line of each W row per round
    step(k, whole);
    step(k + 8, whole);
  }
  for (; k + 8 <= K; k += 8) step(k, whole);
  if (k < K) {
    const __m256i mask = tail_mask(K - k);
    step(k, [mask](const float* p) { return _mm256_maskload_ps(p, mask); });
  }
#pragma GCC unroll 8
  for (int i = 0; i < MB; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) sums[i * NB + j] = hsum8(acc[i][j]);
}

using BlockFn = void (*)(const float*, int64_t, const float*, int64_t, int64_t, float*);

template <int NB>
BlockFn block_for_rows(int64_t mb) {
  switch (mb) {
    case 1: return &dot_block<1, NB>;
    case 2: return &dot_block<2, NB>;
    case 3: return &dot_block<3, NB>;
    default: return &dot_block<4, NB>;
  }
}

constexpr int kMaxRowsPerBlock = 4;
// W rows per block for mb x rows: MB*NB accumulators within AVX2's 16 registers.
inline int w_rows_per_block(int64_t mb) { return mb == 1 ? 8 : mb == 2 ? 6 : mb == 3 ? 4 : 3; }

BlockFn block_fn(int64_t mb, int nb) {
  switch (nb) {
    case 8: return block_for_rows<8>(mb);
    case 6: return block_for_rows<6>(mb);
    case 4: return block_for_rows<4>(mb);
    case 3: return block_for_rows<3>(mb);
    default: return block_for_rows<1>(mb);
  }
}

#endif  // DCP_HAVE_F32_DOT

// y = x·Wᵀ (+ b) for 2-D fp32 x [M, K], W [N, K], y [M, N] with dense rows; false where the build
// has no kernel (the caller then runs torch's).
bool linear_f32(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias, at::Tensor& y) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && y.dim() == 2, "linear_f32: x, W and y must be 2-D");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat && y.scalar_type() == at::kFloat,
              "linear_f32: x, W and y must be fp32");
  TORCH_CHECK(x.stride(1) == 1 && w.stride(1) == 1 && y.stride(1) == 1, "linear_f32: rows must be dense");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K && y.size(0) == M && y.size(1) == N, "linear_f32: shapes do not match");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N),
              "linear_f32: bias must be a dense fp32 [N]");
#if DCP_HAVE_F32_DOT
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t ldx = x.stride(0), ldw = w.stride(0), ldy = y.stride(0);
  const int64_t mb_full = std::min<int64_t>(M, kMaxRowsPerBlock);
  const int nb = w_rows_per_block(mb_full);
  const int64_t blocks = N / nb;  // block blk holds W rows blk + j * blocks, j < nb
  auto run_rows = [&](int64_t n0, int rows, int64_t row_step, float* sums) {
    for (int64_t m0 = 0; m0 < M; m0 += mb_full) {
      const int64_t mb = std::min<int64_t>(mb_full, M - m0);
      block_fn(mb, rows)(xp + m0 * ldx, ldx, wp + n0 * ldw, row_step * ldw, K, sums);
      for (int64_t i = 0; i < mb; ++i)
        for (int j = 0; j < rows; ++j) {
          const int64_t n = n0 + j * row_step;
          yp[(m0 + i) * ldy + n] = sums[i * rows + j] + (b ? b[n] : 0.0f);
        }
    }
  };
  // ~64 KiB of W per task at least, so small layers do not pay for waking threads.
  const int64_t grain = std::max<int64_t>(1, (64 * 1024) / std::max<int64_t>(1, nb * K * 4));
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    float sums[kMaxRowsPerBlock * 8];
    for (int64_t blk = begin; blk < end; ++blk) run_rows(blk, nb, blocks, sums);
  });
  float sums[kMaxRowsPerBlock];
  for (int64_t n = blocks * nb; n < N; ++n) run_rows(n, 1, 1, sums);
  return true;
#else
  return false;  // built for a CPU without AVX2 + FMA
#endif
}

bool has_kernel() { return DCP_HAVE_F32_DOT != 0; }

// What linear_f32_op dispatches on; off until configure() is called after the self-check.
struct OpConfig {
  bool enabled = false;
  int64_t max_rows = 0;
};
OpConfig g_config;
std::atomic<int64_t> g_calls[2];  // native, torch

void configure(bool enabled, int64_t max_rows) { g_config = OpConfig{enabled, max_rows}; }

std::vector<int64_t> kernel_calls() { return {g_calls[0].load(), g_calls[1].load()}; }

at::Tensor linear_f32_op(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  const OpConfig cfg = g_config;
  bool native = cfg.enabled && x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat && x.device().is_cpu() &&
                w.device().is_cpu() && w.dim() == 2 && w.stride(1) == 1 && x.dim() > 0 && x.size(-1) == w.size(1) &&
                w.size(1) > 0 &&
                (!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->device().is_cpu() &&
                                       bias->dim() == 1 && bias->numel() == w.size(0)));
  const int64_t rows = native ? x.numel() / w.size(1) : 0;
  native = native && rows > 0 && rows <= cfg.max_rows;
  g_calls[native ? 0 : 1].fetch_add(1, std::memory_order_relaxed);
  if (!native) return at::linear(x, w, bias);
  const int64_t N = w.size(0), K = w.size(1);
  at::Tensor x2 = x.reshape({-1, K});
  if (x2.stride(1) != 1) x2 = x2.contiguous();
  at::Tensor y = at::empty({x2.size(0), N}, x.options());
  c10::optional<at::Tensor> dense_bias;
  if (bias.has_value()) dense_bias = bias->contiguous();
  TORCH_CHECK(linear_f32(x2, w, dense_bias, y), "dcpgraph::linear_f32: the native kernel declined a call its rule accepted");
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = N;
  return y.view(sizes);
}

}  // namespace

TORCH_LIBRARY_IMPL(dcpgraph, CPU, m) { m.impl("linear_f32", &linear_f32_op); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("configure", &configure, "enable the op's CPU kernel for calls of up to max_rows rows");
  m.def("kernel_calls", &kernel_calls, "calls of the op's CPU kernel so far: [native, torch]");
  m.def("linear_f32", &linear_f32, "y = x @ W^T (+ b) in fp32, W read once");
  m.def("has_kernel", &has_kernel, "whether this build has the AVX2 + FMA kernel");
}
