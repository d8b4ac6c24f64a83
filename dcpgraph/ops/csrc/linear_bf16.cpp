// y = x @ W^T (+ b) for bf16 x [M, K] and bf16 W [N, K] (nn.Linear's layout), fp32 accumulation,
// bf16 output, for few rows (decode: M = batch). Built by dcpgraph/ops/linear.py.
//
// A decode step's linears read every weight once and do M multiply-adds per weight, so for small M
// they are bound by how fast W streams from memory. AVX512-BF16's vdpbf16ps multiplies 32 bf16
// pairs into 16 fp32 sums: one 64-byte load of a W row (32 consecutive k) against the same 32 k of
// an x row, which is W's natural row-major layout, so W is read exactly once, straight from where
// nn.Linear keeps it. A register block of MB x rows by NB W rows keeps MB*NB accumulators
// (MB*NB + NB + 1 <= 32 vector registers), each W line feeding MB dot products and each x line NB;
// a block's partial sums are reduced horizontally once per K. The K tail (K % 32) uses masked loads
// (zeros add nothing). Threads split N (at::parallel_for), so each streams its own rows of W.
// Software prefetch `prefetch` bytes ahead on every W row it streams (0: none).
//
// For more rows (M up to 16) each W byte feeds M multiply-adds, more than vdpbf16ps keeps up with
// at memory speed on one core, so linear_bf16_amx uses AMX instead, as Y^T = W . X^T: the A tile
// is 16 W rows x 32 k loaded straight from W (row stride = W's), the B tile is X^T for those 32 k
// in AMX's pair-interleaved (VNNI) layout, 16 k-pairs x 16 m x 2, built once per call into a
// zero-padded buffer (rows m >= M and k >= K are zeros), and the C tile holds 16 n x 16 m fp32
// sums. Two W row blocks share each B tile (tiles 0,1: C; 2,3: A; 4: B; 5,6,7: A and B of the
// K % 32 tail, configured with that width). K must be even (a tail pair never reads past a row);
// W rows beyond the last multiple of 16 use the vdpbf16ps kernel.
//
// linear_bf16_op is the CPU kernel of the op dcpgraph::linear_bf16 (schema in dcpgraph/ops/library.py),
// registered when this module loads, so a call costs what torch's linear does to dispatch: it
// applies the same rule as dcpgraph.ops.linear.native_kernel (parameters set by configure() once
// the Python side's self-check passed) and runs at::linear for everything else.
#include <torch/extension.h>
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <immintrin.h>
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>
#include "line_aligned.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define DCP_HAVE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#else
#define DCP_HAVE_AMX 0
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define DCP_HAVE_BF16_DOT 1
#else
#define DCP_HAVE_BF16_DOT 0
#endif
// AVX2 + FMA without bf16 dot products (AMD Zen 1-3, Intel before Cooper Lake): the same register
// blocks in fp32, 8 k at a time: W widened in registers (a bf16 is the high half of its fp32), x
// widened once per call, fp32 FMAs; blocks spread over W's rows (kSpreadBlocks).
#if !DCP_HAVE_BF16_DOT && defined(__AVX2__) && defined(__FMA__)
#define DCP_HAVE_FMA_DOT 1
#else
#define DCP_HAVE_FMA_DOT 0
#endif
#define DCP_HAVE_DOT (DCP_HAVE_BF16_DOT || DCP_HAVE_FMA_DOT)

namespace {

using bf16 = c10::BFloat16;

#if DCP_HAVE_BF16_DOT

// x rows as the dot kernel reads them: bf16, multiplied in pairs by vdpbf16ps.
using XElem = bf16;

inline __m512bh load_bf16(const bf16* p) {
  return (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(p));
}

inline __m512bh load_bf16_masked(const bf16* p, __mmask32 mask) {
  return (__m512bh)_mm512_maskz_loadu_epi16(mask, reinterpret_cast<const void*>(p));
}

// sums[i * NB + j] = dot(x row i, W row j) over K.
template <int MB, int NB>
inline void dot_block(const bf16* x, int64_t ldx, const bf16* w, int64_t ldw, int64_t K, int64_t prefetch,
                      float* sums) {
  __m512 acc[MB][NB];
#pragma GCC unroll 8
  for (int i = 0; i < MB; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    __m512bh wv[NB];
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) {
      wv[j] = load_bf16(w + j * ldw + k);
      if (prefetch > 0) _mm_prefetch(reinterpret_cast<const char*>(w + j * ldw + k) + prefetch, _MM_HINT_T0);
    }
#pragma GCC unroll 8
    for (int i = 0; i < MB; ++i) {
      const __m512bh xv = load_bf16(x + i * ldx + k);
#pragma GCC unroll 8
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
    }
  }
  if (k < K) {
    const __mmask32 mask = static_cast<__mmask32>((1ull << (K - k)) - 1);
    __m512bh wv[NB];
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) wv[j] = load_bf16_masked(w + j * ldw + k, mask);
#pragma GCC unroll 8
    for (int i = 0; i < MB; ++i) {
      const __m512bh xv = load_bf16_masked(x + i * ldx + k, mask);
#pragma GCC unroll 8
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MB; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) sums[i * NB + j] = _mm512_reduce_add_ps(acc[i][j]);
}

#elif DCP_HAVE_FMA_DOT

// 8 bf16 at p widened to fp32 (exact).
inline __m256 widen8(const bf16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 widen8(const bf16* p, int64_t n) {  // the first n, zeros after
  alignas(16) uint16_t b[8] = {};
  std::memcpy(b, p, static_cast<size_t>(n) * sizeof(uint16_t));
  return widen8(reinterpret_cast<const bf16*>(b));
}

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// x rows as the dot kernel reads them: fp32, widened once per call (exact), so a register block
// widens only its W vectors (a widen is a load, a zero-extend and a shift, on the pipes the FMAs
// leave free), and an x vector is one load.
using XElem = float;

// sums[i * NB + j] = dot(x row i, W row j) over K: each W vector widened once and used MB times,
// each x vector loaded once and used NB times. One operand side stays in registers for a step: the
// MB x vectors while the W vectors pass through one at a time (MB*NB + MB + 1 <= 16 registers), or,
// where that does not fit (MB = 4, NB = 3), the NB W vectors while the x vectors pass (MB*NB + NB + 1).
// x rows are zero-padded to a multiple of 8 (ldx >= K rounded up), so a K tail reads x whole.
template <int MB, int NB>
inline void dot_block(const float* x, int64_t ldx, const bf16* w, int64_t ldw, int64_t K, int64_t prefetch,
                      float* sums) {
  __m256 acc[MB][NB];
#pragma GCC unroll 8
  for (int i = 0; i < MB; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_setzero_ps();
  auto step = [&](int64_t k, auto widen) {
    if constexpr (MB * NB + MB + 1 <= 16) {
      __m256 xv[MB];
#pragma GCC unroll 8
      for (int i = 0; i < MB; ++i) xv[i] = _mm256_loadu_ps(x + i * ldx + k);
#pragma GCC unroll 8
      for (int j = 0; j < NB; ++j) {
        const __m256 wv = widen(w + j * ldw + k);
#pragma GCC unroll 8
        for (int i = 0; i < MB; ++i) acc[i][j] = _mm256_fmadd_ps(xv[i], wv, acc[i][j]);
      }
    } else {
      __m256 wv[NB];
#pragma GCC unroll 8
      for (int j = 0; j < NB; ++j) wv[j] = widen(w + j * ldw + k);
#pragma GCC unroll 8
      for (int i = 0; i < MB; ++i) {
        const __m256 xv = _mm256_loadu_ps(x + i * ldx + k);
#pragma GCC unroll 8
        for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
      }
    }
  };
  auto whole = [](const bf16* p) { return widen8(p); };
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {  // a 64-byte line of each W row per round
    if (prefetch > 0)
#pragma GCC unroll 8
      for (int j = 0; j < NB; ++j) _mm_prefetch(reinterpret_cast<const char*>(w + j * ldw + k) + prefetch, _MM_HINT_T0);
#pragma GCC unroll 4
    for (int u = 0; u < 32; u += 8) step(k + u, whole);
  }
  for (; k + 8 <= K; k += 8) step(k, whole);
  if (k < K) {
    // The K tail: W's last n elements, zeros after (never read past the row); x is zero there too.
    const int64_t n = K - k;
    step(k, [n](const bf16* p) { return widen8(p, n); });
  }
#pragma GCC unroll 8
  for (int i = 0; i < MB; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) sums[i * NB + j] = hsum8(acc[i][j]);
}

#endif

#if DCP_HAVE_DOT

using BlockFn = void (*)(const XElem*, int64_t, const bf16*, int64_t, int64_t, int64_t, float*);

// dot_block<mb, NB> for a runtime mb in 1..4 (the M tail of a block of 4 rows).
template <int NB>
BlockFn block_for_rows(int64_t mb) {
  switch (mb) {
    case 1: return &dot_block<1, NB>;
    case 2: return &dot_block<2, NB>;
    case 3: return &dot_block<3, NB>;
    default: return &dot_block<4, NB>;
  }
}

// Rows of x per register block, and W rows per block for that many x rows: MB*NB accumulators
// (AVX-512's 32 vector registers, AVX2's 16).
constexpr int kMaxRowsPerBlock = 4;
inline int w_rows_per_block(int64_t mb) {
#if DCP_HAVE_BF16_DOT
  return mb == 1 ? 8 : mb == 2 ? 6 : mb == 3 ? 5 : 4;
#else
  return mb == 1 ? 8 : mb == 2 ? 6 : mb == 3 ? 4 : 3;
#endif
}

// Which W rows share a register block. Contiguous (rows n0 .. n0 + nb - 1): the streams are as long as
// a row. Spread (rows b, b + N/nb, b + 2N/nb, ...): each of the nb streams runs on through the
// following rows, as long as N/nb rows, and the last N % nb rows run one at a time after them. A hardware
// prefetcher ramps up once per stream, so short rows read much faster spread (measured on a Zen 2 core,
// M = 1, weights streamed from memory: K = 1024 at 18.5-20.6 GB/s spread against 12.3-13.0 contiguous,
// where a plain x.sum() read 16.2; K = 2816 about even, 17.6-18.1 against 16.9-17.5). The AVX-512 build
// keeps the contiguous blocks it was measured with.
constexpr bool kSpreadBlocks = DCP_HAVE_FMA_DOT != 0;

BlockFn block_fn(int64_t mb, int nb) {
  switch (nb) {
    case 8: return block_for_rows<8>(mb);
    case 6: return block_for_rows<6>(mb);
    case 5: return block_for_rows<5>(mb);
    case 4: return block_for_rows<4>(mb);
    case 3: return block_for_rows<3>(mb);
    case 2: return block_for_rows<2>(mb);
    default: return block_for_rows<1>(mb);
  }
}

// y[i * ldy + n0 + j * row_step] = bf16(sums[i * nb + j] + bias) for i < mb, j < nb.
void store_rows(const float* sums, int64_t mb, int nb, const float* bias, int64_t n0, int64_t row_step, bf16* y,
                int64_t ldy) {
  for (int64_t i = 0; i < mb; ++i)
    for (int j = 0; j < nb; ++j) {
      const int64_t n = n0 + j * row_step;
      y[i * ldy + n] = bf16(sums[i * nb + j] + (bias ? bias[n] : 0.0f));  // round to nearest even
    }
}

#endif  // DCP_HAVE_DOT

// The checks both kernels make on y = x·Wᵀ (+ b); returns the bias's data (nullptr without one).
[[maybe_unused]] const float* checked_args(const at::Tensor& x, const at::Tensor& w,
                                           const c10::optional<at::Tensor>& bias, const at::Tensor& y,
                                           const char* who) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && y.dim() == 2, who, ": x, W and y must be 2-D");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16 && y.scalar_type() == at::kBFloat16,
              who, ": x, W and y must be bf16");
  TORCH_CHECK(x.stride(1) == 1 && w.stride(1) == 1 && y.stride(1) == 1, who, ": rows must be dense");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K && y.size(0) == M && y.size(1) == N, who, ": shapes do not match");
  if (!bias.has_value()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
              who, ": bias must be a dense fp32 [N]");
  return bias->data_ptr<float>();
}

bool linear_bf16(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias, at::Tensor& y,
                 int64_t prefetch) {
#if DCP_HAVE_DOT
  const float* b = checked_args(x, w, bias, y, "linear_bf16");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const bf16* xp = x.data_ptr<bf16>();
  const bf16* wp = w.data_ptr<bf16>();
  bf16* yp = y.data_ptr<bf16>();
  const int64_t ldx = x.stride(0), ldw = w.stride(0), ldy = y.stride(0);
#if DCP_HAVE_FMA_DOT
  // x widened to fp32 once (exact), rows zero-padded to a multiple of 8.
  const int64_t ldxe = (K + 7) / 8 * 8;
  LineVector<float> xwide(static_cast<size_t>(M * ldxe), 0.0f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) xwide[m * ldxe + k] = static_cast<float>(xp[m * ldx + k]);
  const XElem* xe = xwide.data();
#else
  const XElem* xe = xp;
  const int64_t ldxe = ldx;
#endif
  const int64_t mb_full = M < kMaxRowsPerBlock ? M : kMaxRowsPerBlock;
  const int nb = w_rows_per_block(mb_full);
  // Full blocks b < N / nb hold W rows b * step + j * spread, j < nb (contiguous: step nb, spread 1;
  // spread: step 1, spread N / nb); the last N % nb rows run one at a time after them.
  const int64_t blocks = N / nb;
  const int64_t step = kSpreadBlocks ? 1 : nb, spread = kSpreadBlocks ? blocks : 1;
  auto run_rows = [&](int64_t n0, int rows, int64_t row_step, float* sums) {
    for (int64_t m0 = 0; m0 < M; m0 += mb_full) {
      const int64_t mb = std::min<int64_t>(mb_full, M - m0);
      block_fn(mb, rows)(xe + m0 * ldxe, ldxe, wp + n0 * ldw, row_step * ldw, K, prefetch, sums);
      store_rows(sums, mb, rows, b, n0, row_step, yp + m0 * ldy, ldy);
    }
  };
  // ~64 KiB of W per task at least, so small layers do not pay for waking threads.
  const int64_t grain = std::max<int64_t>(1, (64 * 1024) / std::max<int64_t>(1, nb * K * 2));
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    float sums[kMaxRowsPerBlock * 8];
    for (int64_t blk = begin; blk < end; ++blk) run_rows(blk * step, nb, spread, sums);
  });
  float sums[kMaxRowsPerBlock];
  for (int64_t n = blocks * nb; n < N; ++n) run_rows(n, 1, 1, sums);
  return true;
#else
  (void)x; (void)w; (void)bias; (void)y; (void)prefetch;
  return false;  // built for a CPU without AVX512-BF16 or AVX2 + FMA
#endif
}

#if DCP_HAVE_AMX && DCP_HAVE_BF16_DOT

// Linux keeps AMX state off until a process asks for it (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA).
bool amx_permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

struct TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

void configure_tiles(int tail_pairs) {
  TileConfig cfg;
  for (int t = 0; t < 5; ++t) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
  if (tail_pairs > 0) {
    for (int t = 5; t < 7; ++t) { cfg.rows[t] = 16; cfg.colsb[t] = static_cast<uint16_t>(tail_pairs * 4); }
    cfg.rows[7] = static_cast<uint8_t>(tail_pairs);
    cfg.colsb[7] = 64;
  }
  _tile_loadconfig(&cfg);
}

// X [M, K] (M <= 16, K even) as B tiles: chunk c, pair p, row m -> the bf16 pair x[m, 32c + 2p : +2],
// zeros beyond. Moved as 32-bit pairs (a pair is contiguous in x and in the tile).
LineVector<uint32_t> vnni_b_tiles(const bf16* x, int64_t ldx, int64_t M, int64_t K) {
  const int64_t chunks = (K + 31) / 32;
  const int64_t pairs = K / 2;
  LineVector<uint32_t> b(static_cast<size_t>(chunks * 256), 0u);
  const __m512i slot = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_epi32(16));
  for (int64_t m = 0; m < M; ++m) {
    const bf16* row = x + m * ldx;
    int64_t p = 0;
    for (; p + 16 <= pairs; p += 16)  // a chunk's 16 pairs of row m, one 64-byte load, 16 slots 64 bytes apart
      _mm512_i32scatter_epi32(b.data() + (p >> 4) * 256 + m, slot, _mm512_loadu_si512(row + 2 * p), 4);
    for (; p < pairs; ++p) {
      uint32_t pair;
      std::memcpy(&pair, row + 2 * p, sizeof(pair));
      b[(p >> 4) * 256 + (p & 15) * 16 + m] = pair;
    }
  }
  return b;
}

// fp32 -> bf16 bits, round to nearest even, NaN -> 0x7FC0: c10::BFloat16's conversion, 16 at a time.
inline __m256i to_bf16_bits(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC00000));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

// C (+ bias) of one 16-row W block, c[n * 16 + m], transposed into y's rows: row m gathers its 16 n.
void store_tile(const float* c, int64_t M, const float* bias, int64_t n0, bf16* y, int64_t ldy) {
  const __m512i column = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_epi32(16));
  const __m512 b = bias ? _mm512_loadu_ps(bias + n0) : _mm512_setzero_ps();
  for (int64_t m = 0; m < M; ++m) {
    const __m512 v = _mm512_add_ps(_mm512_i32gather_ps(column, c + m, 4), b);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + m * ldy + n0), to_bf16_bits(v));
  }
}

#endif

bool linear_bf16_amx(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias, at::Tensor& y,
                     int64_t prefetch) {
#if DCP_HAVE_AMX && DCP_HAVE_BF16_DOT
  if (!amx_permitted()) return false;
  const float* b = checked_args(x, w, bias, y, "linear_bf16_amx");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(M >= 1 && M <= 16 && K % 2 == 0, "linear_bf16_amx: needs 1 <= M <= 16 and an even K");
  const bf16* xp = x.data_ptr<bf16>();
  const bf16* wp = w.data_ptr<bf16>();
  bf16* yp = y.data_ptr<bf16>();
  const int64_t ldx = x.stride(0), ldw = w.stride(0), ldy = y.stride(0);
  const LineVector<uint32_t> btiles = vnni_b_tiles(xp, ldx, M, K);  // tile rows on cache lines
  const uint32_t* bt = btiles.data();  // 256 pairs (1 KiB) per chunk
  const int64_t full = K / 32;
  const int tail_pairs = static_cast<int>((K % 32) / 2);
  const int64_t stride = ldw * static_cast<int64_t>(sizeof(bf16));
  const int64_t pf = prefetch / static_cast<int64_t>(sizeof(bf16));
  const int64_t groups = (N / 16 + 1) / 2;  // pairs of 16-row blocks (the last may be a single block)
  const int64_t grain = std::max<int64_t>(1, (64 * 1024) / std::max<int64_t>(1, 32 * K * 2));
  at::parallel_for(0, groups, grain, [&](int64_t begin, int64_t end) {
    configure_tiles(tail_pairs);
    alignas(64) float c[2 * 256];
    for (int64_t g = begin; g < end; ++g) {
      const int64_t n0 = g * 32;
      const bool two = n0 + 32 <= N;
      const bf16* w0 = wp + n0 * ldw;
      const bf16* w1 = w0 + 16 * ldw;
      _tile_zero(0);
      _tile_zero(1);
      for (int64_t ch = 0; ch < full; ++ch) {
        const int64_t k = ch * 32;
        if (pf > 0)
          for (int r = 0; r < (two ? 32 : 16); ++r)
            _mm_prefetch(reinterpret_cast<const char*>(w0 + r * ldw + k + pf), _MM_HINT_T0);
        _tile_loadd(4, bt + ch * 256, 64);
        _tile_loadd(2, w0 + k, stride);
        _tile_dpbf16ps(0, 2, 4);
        if (two) {
          _tile_loadd(3, w1 + k, stride);
          _tile_dpbf16ps(1, 3, 4);
        }
      }
      if (tail_pairs > 0) {
        const int64_t k = full * 32;
        _tile_loadd(7, bt + full * 256, 64);
        _tile_loadd(5, w0 + k, stride);
        _tile_dpbf16ps(0, 5, 7);
        if (two) {
          _tile_loadd(6, w1 + k, stride);
          _tile_dpbf16ps(1, 6, 7);
        }
      }
      _tile_stored(0, c, 64);
      store_tile(c, M, b, n0, yp, ldy);
      if (two) {
        _tile_stored(1, c + 256, 64);
        store_tile(c + 256, M, b, n0 + 16, yp, ldy);
      }
    }
    _tile_release();
  });
  // W rows past the last multiple of 16: the vdpbf16ps kernel, a row at a time.
  float sums[16];
  for (int64_t n = (N / 16) * 16; n < N; ++n)
    for (int64_t m0 = 0; m0 < M; m0 += kMaxRowsPerBlock) {
      const int64_t mb = std::min<int64_t>(kMaxRowsPerBlock, M - m0);
      block_fn(mb, 1)(xp + m0 * ldx, ldx, wp + n * ldw, ldw, K, 0, sums);
      store_rows(sums, mb, 1, b, n, 1, yp + m0 * ldy, ldy);
    }
  return true;
#else
  (void)x; (void)w; (void)bias; (void)y; (void)prefetch;
  return false;  // built without AMX-BF16, or not on Linux
#endif
}

bool has_amx() {
#if DCP_HAVE_AMX && DCP_HAVE_BF16_DOT
  return amx_permitted();
#else
  return false;
#endif
}

bool has_bf16_dot() { return DCP_HAVE_BF16_DOT != 0; }

// The instruction set of the register-block kernel linear_bf16: "avx512bf16", "avx2" or "" (none built).
std::string dot_isa() { return DCP_HAVE_BF16_DOT ? "avx512bf16" : DCP_HAVE_FMA_DOT ? "avx2" : ""; }

// What linear_bf16_op dispatches on; off until configure() is called after the self-check.
struct OpConfig {
  bool enabled = false;
  bool amx = false;
  int64_t max_rows = 0;
  int64_t dot_max_rows = 0;
  int64_t prefetch_amx = 0;
  int64_t prefetch_dot = 0;
  bool fp32_beyond = false;  // calls of more than max_rows rows in fp32 (linear_fp32) instead of torch's bf16
};
OpConfig g_config;
std::atomic<int64_t> g_calls[4];  // amx, dot, torch, fp32

void configure(bool enabled, bool amx, int64_t max_rows, int64_t dot_max_rows, int64_t prefetch_amx,
               int64_t prefetch_dot, bool fp32_beyond) {
  g_config = OpConfig{enabled, amx, max_rows, dot_max_rows, prefetch_amx, prefetch_dot, fp32_beyond};
}

std::vector<int64_t> kernel_calls() {
  return {g_calls[0].load(), g_calls[1].load(), g_calls[2].load(), g_calls[3].load()};
}

// x @ W^T (+ b) computed in fp32 and rounded once to bf16, W widened a slab of rows at a time (at most
// 8 MiB of fp32, so a large weight never has a full fp32 copy): for many rows (prefill) on CPUs whose
// torch bf16 GEMM has no bf16 dot products (AVX2), where torch's fp32 GEMM is several times faster.
at::Tensor linear_fp32(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  const int64_t N = w.size(0), K = w.size(1);
  const at::Tensor xf = x.reshape({-1, K}).to(at::kFloat);
  at::Tensor y = at::empty({xf.size(0), N}, x.options().dtype(at::kFloat));
  const int64_t slab = std::max<int64_t>(16, (int64_t(8) << 20) / (4 * K));
  for (int64_t n0 = 0; n0 < N; n0 += slab) {
    const int64_t n1 = std::min(N, n0 + slab);
    at::Tensor part = y.narrow(1, n0, n1 - n0);
    at::mm_out(part, xf, w.narrow(0, n0, n1 - n0).to(at::kFloat).t());
  }
  if (bias.has_value()) y.add_(bias->to(at::kFloat));
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = N;
  return y.to(at::kBFloat16).view(sizes);
}

at::Tensor linear_bf16_op(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  const OpConfig cfg = g_config;
  int kernel = 2;  // 0: amx, 1: dot, 2: torch, 3: fp32
  if (cfg.enabled && x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16 && x.device().is_cpu() &&
      w.device().is_cpu() && w.dim() == 2 && w.stride(1) == 1 && x.dim() > 0 && x.size(-1) == w.size(1) &&
      w.size(1) > 0 &&
      (!bias.has_value() || (bias->scalar_type() == at::kBFloat16 && bias->device().is_cpu() && bias->dim() == 1 &&
                             bias->numel() == w.size(0)))) {
    const int64_t rows = x.numel() / w.size(1);
    if (rows > 0 && rows <= cfg.max_rows) {
      if (w.size(1) % 2 == 0 && cfg.amx) kernel = 0;
      else if (rows <= cfg.dot_max_rows) kernel = 1;
    } else if (rows > cfg.max_rows && cfg.fp32_beyond) {
      kernel = 3;
    }
  }
  g_calls[kernel].fetch_add(1, std::memory_order_relaxed);
  if (kernel == 2) return at::linear(x, w, bias);
  if (kernel == 3) return linear_fp32(x, w, bias);
  const int64_t N = w.size(0), K = w.size(1);
  at::Tensor x2 = x.reshape({-1, K});
  if (x2.stride(1) != 1) x2 = x2.contiguous();
  at::Tensor y = at::empty({x2.size(0), N}, x.options());
  c10::optional<at::Tensor> fbias;
  if (bias.has_value()) fbias = bias->to(at::kFloat).contiguous();
  const bool ok = kernel == 0 ? linear_bf16_amx(x2, w, fbias, y, cfg.prefetch_amx)
                              : linear_bf16(x2, w, fbias, y, cfg.prefetch_dot);
  TORCH_CHECK(ok, "dcpgraph::linear_bf16: the native kernel declined a call its rule accepted");
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = N;
  return y.view(sizes);
}

}  // namespace

TORCH_LIBRARY_IMPL(dcpgraph, CPU, m) { m.impl("linear_bf16", &linear_bf16_op); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("configure", &configure, "enable the op's CPU kernel with its rule's parameters");
  m.def("kernel_calls", &kernel_calls, "calls of the op's CPU kernel so far: [amx, dot, torch, fp32]");
  m.def("linear_fp32", &linear_fp32, "x @ W^T (+ b) in fp32 (W widened a slab at a time), rounded to bf16");
  m.def("linear_bf16", &linear_bf16, "y = x @ W^T (+ b), bf16 in and out, fp32 accumulation");
  m.def("linear_bf16_amx", &linear_bf16_amx, "the same for 1 <= M <= 16 and even K, on AMX tiles");
  m.def("has_amx", &has_amx, "whether this build has AMX-BF16 and the OS granted it");
  m.def("has_bf16_dot", &has_bf16_dot, "whether this build has the AVX512-BF16 kernel");
  m.def("dot_isa", &dot_isa, "the register-block kernel's instruction set (avx512bf16, avx2) or empty");
}
