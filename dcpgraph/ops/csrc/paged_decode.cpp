// Paged decode attention over a block table, reading K/V in place (no gather copy).
//
// Row r's query rows q[cu[r]:cu[r+1]] attend to its first lens[r] cached tokens; local key j lives
// at physical block table[r, j / B], slot j % B. For each (request, KV head, key chunk) the G query
// heads of that KV head (times the request's query rows) are processed together: every K/V row is
// read once per KV head, with an online softmax (running max/sum per row) over spans of key blocks. Chunks
// of one request are merged by LSE at the end (split-K, so one long request uses every thread).
// When the values are a prefix of the key rows (MLA's latent: v = k[..., :dv]) they are read from
// the key rows themselves.
//
// KV element types: fp32; bf16 and float8_e4m3fn (with fp32 scales [NB, B, H, ceil(D/group)], one
// per ``scale_group`` elements of a row) are converted to fp32 in registers as they are loaded
// (AVX-512 or AVX2 + FMA builds: simd_f32.h). fp32 queries: all arithmetic is fp32. bf16 queries (a bf16 model) over a
// bf16/fp8 cache: the AMX-BF16 path of paged_decode_amx.h (bf16 products, fp32 accumulation and
// softmax, P rounded to bf16 for the value product), on builds and processes that have AMX.
// Outputs out [T, Hq, Dv] fp32 and natural-log lse [T, Hq] fp32; rows with no keys are left as
// the caller initialised them ((0, -inf)).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <optional>
#include <tuple>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <string>
#include <vector>

#include "simd_f32.h"  // DCPGRAPH_SIMD: the fp32 vectors of AVX-512 or AVX2 builds

#include "kv_cache_write.h"  // the cache-write op's CPU kernel, registered with this extension
#include "merge_lse.h"       // merge_attention's CPU kernel (called from dcpgraph/ops/merge_native.py)
#include "line_aligned.h"

namespace {

constexpr int64_t RB = 4;  // query rows per register block
constexpr int64_t kMinChunkTokens = 256;  // the shortest split-K chunk when requests are split across threads

// s[i * ss + t] = <q_i, k_t> for rows i < m, tokens t < nt (k_t = kb + t * ks).
inline void block_scores(const float* q, int64_t m, int64_t d, const float* kb, int64_t ks, int64_t nt,
                         float* s, int64_t ss) {
  int64_t i = 0;
  for (; i + RB <= m; i += RB) {
    const float* q0 = q + i * d;
    const float* q1 = q0 + d;
    const float* q2 = q1 + d;
    const float* q3 = q2 + d;
    for (int64_t t = 0; t < nt; ++t) {
      const float* k = kb + t * ks;
      float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
      for (int64_t x = 0; x < d; ++x) {
        const float kv = k[x];
        a0 += q0[x] * kv;
        a1 += q1[x] * kv;
        a2 += q2[x] * kv;
        a3 += q3[x] * kv;
      }
      s[i * ss + t] = a0;
      s[(i + 1) * ss + t] = a1;
      s[(i + 2) * ss + t] = a2;
      s[(i + 3) * ss + t] = a3;
    }
  }
  for (; i < m; ++i) {
    const float* qi = q + i * d;
    int64_t t = 0;
    for (; t + 4 <= nt; t += 4) {  // one row: four tokens at a time (four independent sums)
      const float* k0 = kb + t * ks;
      const float* k1 = k0 + ks;
      const float* k2 = k1 + ks;
      const float* k3 = k2 + ks;
      float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
      for (int64_t x = 0; x < d; ++x) {
        const float qv = qi[x];
        a0 += qv * k0[x];
        a1 += qv * k1[x];
        a2 += qv * k2[x];
        a3 += qv * k3[x];
      }
      s[i * ss + t] = a0;
      s[i * ss + t + 1] = a1;
      s[i * ss + t + 2] = a2;
      s[i * ss + t + 3] = a3;
    }
    for (; t < nt; ++t) {
      const float* k = kb + t * ks;
      float a = 0.f;
#pragma omp simd reduction(+ : a)
      for (int64_t x = 0; x < d; ++x) a += qi[x] * k[x];
      s[i * ss + t] = a;
    }
  }
}

// acc[i, :] += sum_t p[i * ps + t] * v_t for rows i < m (v_t = vb + t * vs, dv wide).
inline void block_values(const float* p, int64_t ps, int64_t m, const float* vb, int64_t vs, int64_t nt,
                         int64_t dv, float* acc) {
  int64_t i = 0;
  for (; i + RB <= m; i += RB) {
    float* a0 = acc + i * dv;
    float* a1 = a0 + dv;
    float* a2 = a1 + dv;
    float* a3 = a2 + dv;
    const float* p0 = p + i * ps;
    for (int64_t t = 0; t < nt; ++t) {
      const float* v = vb + t * vs;
      const float w0 = p0[t], w1 = p0[ps + t], w2 = p0[2 * ps + t], w3 = p0[3 * ps + t];
#pragma omp simd
      for (int64_t x = 0; x < dv; ++x) {
        const float vv = v[x];
        a0[x] += w0 * vv;
        a1[x] += w1 * vv;
        a2[x] += w2 * vv;
        a3[x] += w3 * vv;
      }
    }
  }
  for (; i < m; ++i) {
    float* a = acc + i * dv;
    const float* pi = p + i * ps;
    int64_t t = 0;
    for (; t + 4 <= nt; t += 4) {
      const float* v0 = vb + t * vs;
      const float* v1 = v0 + vs;
      const float* v2 = v1 + vs;
      const float* v3 = v2 + vs;
      const float w0 = pi[t], w1 = pi[t + 1], w2 = pi[t + 2], w3 = pi[t + 3];
#pragma omp simd
      for (int64_t x = 0; x < dv; ++x) a[x] += w0 * v0[x] + w1 * v1[x] + w2 * v2[x] + w3 * v3[x];
    }
    for (; t < nt; ++t) {
      const float* v = vb + t * vs;
      const float w = pi[t];
#pragma omp simd
      for (int64_t x = 0; x < dv; ++x) a[x] += w * v[x];
    }
  }
}


// Software prefetch of one block's K/V rows spread over the work of the current block: start()
// names the rows (``rows`` tokens from k/v, row strides in bytes) and how many step() calls the
// block makes; each step() issues its share of the lines. A burst of a block's lines at once finds
// the fill buffers busy and most are dropped (the AMX decoder's measurement, amx_prefetch.h).
// The lines go as runs of one row, K's then V's, token by token: a run is a loop of prefetches
// with no per-line branch (per-line bookkeeping cost GQA 8:1 bf16 in cache ~10 of its 97 ns a
// token on a Zen 2 core). All of a block's K rows first, then its V rows, read GQA 8:1 from memory
// 11-27% slower on the Intel AVX-512 host (fp32 and bf16 caches, contiguous and scattered tables).
class RowPrefetch {
 public:
  RowPrefetch(int64_t kbytes, int64_t vbytes, int64_t kstride, int64_t vstride)
      : klines_((kbytes + 63) / 64), vlines_((vbytes + 63) / 64), kstride_(kstride), vstride_(vstride) {}
  void start(const char* k, const char* v, int64_t rows, int64_t calls) {
    k_ = k;
    v_ = v;
    rows_ = rows;
    row_ = 0;
    values_ = false;
    left_ = rows * (klines_ + vlines_);
    per_ = (left_ + calls - 1) / std::max<int64_t>(calls, 1);
    if (rows > 0) begin_run();
  }
  // The lines step() calls have not issued (all of them where the block's work makes none).
  void rest() {
    per_ = left_;
    (*this)();
  }
  // The next per_ lines, in runs.
  void operator()() {
    int64_t n = std::min(per_, left_);
    left_ -= n;
    while (n > 0) {
      const int64_t run = std::min(n, run_left_);
      for (int64_t i = 0; i < run; ++i) __builtin_prefetch(p_ + i * 64, 0, 2);
      p_ += run * 64;
      run_left_ -= run;
      n -= run;
      if (run_left_ == 0 && left_ + n > 0) next_run();
    }
  }

 private:
  // The run of row ``row_`` of K (or V); next_run: V's row after K's, then the next row's K.
  void begin_run() {
    const int64_t lines = values_ ? vlines_ : klines_, stride = values_ ? vstride_ : kstride_;
    p_ = (values_ ? v_ : k_) + row_ * stride;
    run_left_ = lines;
  }
  void next_run() {
    if (!values_ && vlines_ > 0) {
      values_ = true;
    } else {
      values_ = false;
      ++row_;
    }
    begin_run();
  }

  const int64_t klines_, vlines_, kstride_, vstride_;
  const char* k_ = nullptr;  // the block's first K and V rows
  const char* v_ = nullptr;
  const char* p_ = nullptr;  // the next line of the current run
  int64_t rows_ = 0, row_ = 0, left_ = 0, per_ = 0, run_left_ = 0;
  bool values_ = false;
};

// The value rows of one table block whose softmax weights wait in the score buffer: ``nt`` rows
// from ``v`` (``vs`` elements apart; their scales from ``sc``, ``vss`` floats apart), weighted by
// score columns ``off`` .. ``off + nt``.
template <class T>
struct ValueRows {
  const T* v;
  const float* sc;
  int64_t nt, off;
};

#if DCPGRAPH_SIMD
using simd::Simd;
using Vec = Simd::V;
using Lanes = Simd::Mask;
using simd::All;
constexpr int64_t W = Simd::W;  // fp32 lanes per vector

// An optimisation barrier on v's value: it stays computed as written (no reassociation through it).
inline void opaque(Vec& v) { __asm__("" : "+v"(v)); }

// KV element loaders: W consecutive elements of one cache row from offset x (a multiple of W)
// as fp32 in a register (lanes past the mask zero; ``All``: every lane). fp8 only: ``sc`` is the
// row's fp32 scales and vg[x / W] the index of the scale of vector x / W (scale groups are
// multiples of 16 elements, so one vector has one scale).

struct LoadF32 {
  using T = float;
  template <class M>
  static inline Vec load(const T* row, const float*, int64_t x, M mk, const int32_t* = nullptr) {
    return Simd::load(row + x, mk);
  }
};

struct LoadBF16 {  // bf16 -> fp32 is exact: the 16 bits become the high half of the fp32 word
  using T = uint16_t;
  template <class M>
  static inline Vec load(const T* row, const float*, int64_t x, M mk, const int32_t* = nullptr) {
    return Simd::as_float(Simd::shl<16>(Simd::words(row + x, mk)));
  }
};

// float8_e4m3fn bytes s.eeee.mmm, times the row's scale for this group. The sign-extended byte
// shifted left by 20 and masked to sign | eeee.mmm is the fp32 number e4m3 * 2^-120 exactly
// (eeee.mmm lands on the top of fp32's exponent and mantissa fields; a subnormal e4m3 becomes
// an fp32 denormal of the same ratio), so one exact multiply by 2^120 and the scale's finish it:
// eight vector ops where building the exponent and blending in the subnormals took fourteen.
// NaN (s.1111.111) is set apart. Needs denormal inputs kept (MXCSR.DAZ clear, as a process starts
// and as torch leaves it unless set_flush_denormal(True)); LoadFP8Exact otherwise.
struct LoadFP8 {
  using T = uint8_t;
  template <class M>
  static inline Vec load(const T* row, const float* sc, int64_t x, M mk, const int32_t* vg) {
    using S = Simd;
    const S::I f = S::iand(S::shl<20>(S::sbytes(row + x, mk)), S::iset1(static_cast<int32_t>(0x87F00000u)));
    const Vec v = S::nan_where_eq(S::iand(f, S::iset1(0x7FF00000)), S::iset1(0x07F00000), S::as_float(f));
    Vec e = S::mul(v, S::set1(0x1p120f));  // e4m3 exactly
    opaque(e);  // so -ffast-math cannot multiply 2^120 into the scale first (inf from scales of 2^8 up)
    return S::mul(e, S::set1(sc[vg[x / W]]));
  }
};

// The same values without fp32 denormals (for threads that treat denormal inputs as zero).
struct LoadFP8Exact {
  using T = uint8_t;
  template <class M>
  static inline Vec load(const T* row, const float* sc, int64_t x, M mk, const int32_t* vg) {
    using S = Simd;
    const S::I b = S::bytes(row + x, mk);
    const S::I em = S::iand(b, S::iset1(0x7F));
    // Normal (e > 0): exponent and mantissa bits moved into fp32's fields, bias 7 -> 127.
    const Vec normal = S::as_float(S::iadd(S::shl<20>(em), S::iset1(120 << 23)));
    // Subnormal (e = 0): m * 2^-9, computed without fp32 denormals.
    const Vec sub = S::mul(S::to_float(em), S::set1(1.0f / 512.0f));
    Vec v = S::select_ge(em, S::iset1(8), normal, sub);
    v = S::as_float(S::ior(S::as_int(v), S::shl<24>(S::iand(b, S::iset1(0x80)))));
    v = S::nan_where_eq(em, S::iset1(0x7F), v);  // s.1111.111
    return S::mul(v, S::set1(sc[vg[x / W]]));
  }
};

// LoadFP8 without its scale, its 2^120 or setting NaN apart: e4m3 * 2^-120 exactly, for rows with
// one scale each in blocks checked to hold no NaN code (fp8_rows_hold_nan). The scales and the
// 2^120 go to the other operand instead (FOLD_UP: the queries, and V's scales applied to the
// weights, see scale_columns): (a * 2^120) * (e * 2^-120) is the product a * e with the same
// rounding wherever a * 2^120 stays finite, so the sums are bit for bit those of the full loader.
// Three vector ops a vector, as bf16's widen, and none on the FMA pipes.
struct LoadFP8Unscaled {
  using T = uint8_t;
  template <class M>
  static inline Vec load(const T* row, const float*, int64_t x, M mk, const int32_t* = nullptr) {
    using S = Simd;
#ifdef __AVX512F__
    return S::as_float(S::iand(S::shl<20>(S::sbytes(row + x, mk)), S::iset1(static_cast<int32_t>(0x87F00000u))));
#else
    // AVX2: the mask (sign | eeee.mmm) is a memory operand, not a register held across the tile's
    // loop: a 4 x 3 tile (12 accumulators, 3 K or V vectors, a query or weight) holding it too
    // spilled an accumulator to the stack, and that store-reload chain doubled the tile's time.
    alignas(32) static constexpr int32_t keep[8] = {
        int32_t(0x87F00000u), int32_t(0x87F00000u), int32_t(0x87F00000u), int32_t(0x87F00000u),
        int32_t(0x87F00000u), int32_t(0x87F00000u), int32_t(0x87F00000u), int32_t(0x87F00000u)};
    S::I v = S::shl<20>(S::sbytes(row + x, mk));
    __asm__("vpand %1, %0, %0" : "+x"(v) : "m"(*reinterpret_cast<const __m256i*>(keep)));
    return S::as_float(v);
#endif
  }
};
// What LoadFP8Unscaled's other operand is multiplied by, and the bound below which that operand
// (queries; softmax weights <= 1 times V's scales) must stay so the product stays finite.
constexpr float FOLD_UP = 0x1p120f;
constexpr float FOLD_BOUND = 0x1p7f;

// Whether every |x[i]| (i < n) is below FOLD_BOUND (NaN is not).
inline bool below_fold_bound(const float* x, int64_t n, int64_t stride = 1) {
  bool ok = true;
  for (int64_t i = 0; i < n; ++i) ok = ok && std::fabs(x[i * stride]) < FOLD_BOUND;
  return ok;
}

// Whether any of ``rows`` rows of n e4m3fn bytes (``stride`` apart) is NaN (s.1111.111).
inline bool fp8_rows_hold_nan(const uint8_t* p, int64_t stride, int64_t rows, int64_t n) {
  const __m256i low7 = _mm256_set1_epi8(0x7F);
  __m256i hit = _mm256_setzero_si256();
  bool tail = false;
  for (int64_t t = 0; t < rows; ++t) {
    const uint8_t* r = p + t * stride;
    int64_t x = 0;
    for (; x + 32 <= n; x += 32) {
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + x));
      hit = _mm256_or_si256(hit, _mm256_cmpeq_epi8(_mm256_and_si256(b, low7), low7));
    }
    for (; x < n; ++x) tail = tail || (r[x] & 0x7F) == 0x7F;
  }
  return tail || !_mm256_testz_si256(hit, hit);
}

// s[t * ts + i] *= scale of token t, for rows i < m and tokens t < nt: a per-row fp8 scale applied
// to a block's scores (K's scales) or softmax weights (V's), since (q . k) * c = q . (k * c).
// ``up``: a power of two the scales are multiplied by (exactly) first. Where ts < W (a few rows,
// column_stride), W / ts tokens share a vector: the columns are scaled as one run of nt * ts
// floats, padding rows too (finite: they stay finite).
inline void scale_columns(float* s, int64_t ts, int64_t m, int64_t nt, const float* sc, int64_t scs, float up = 1.f) {
  if (ts < W) {
    alignas(64) float c[W];
    const int64_t per = W / ts;  // tokens a vector
    for (int64_t t0 = 0; t0 < nt; t0 += per) {
      const int64_t tokens = std::min(per, nt - t0);
      for (int64_t j = 0; j < tokens; ++j) {
        const float x = sc[(t0 + j) * scs] * up;
        for (int64_t r = 0; r < ts; ++r) c[j * ts + r] = x;
      }
      const Lanes mk = Simd::first(tokens * ts);
      Simd::store(s + t0 * ts, mk, Simd::mul(Simd::load(s + t0 * ts, mk), Simd::load(c, mk)));
    }
    return;
  }
  for (int64_t t = 0; t < nt; ++t) {
    const Vec c = Simd::set1(sc[t * scs] * up);
    for (int64_t u = 0; u < m; u += W) {
      const Lanes mk = Simd::first(m - u);
      Simd::store(s + t * ts + u, mk, Simd::mul(Simd::load(s + t * ts + u, mk), c));
    }
  }
}

// Whether this thread treats denormal inputs as zero (MXCSR.DAZ, bit 6).
inline bool denormals_are_zero() { return (_mm_getcsr() & 0x0040u) != 0; }

template <class T> struct LoaderForT;
template <> struct LoaderForT<float> { using type = LoadF32; };
template <> struct LoaderForT<uint16_t> { using type = LoadBF16; };
template <> struct LoaderForT<uint8_t> { using type = LoadFP8; };
template <class T> using LoaderFor = typename LoaderForT<T>::type;

// Register tiles (compiled with -march=native): TILE_ROWS query rows x TILE_TOKS tokens for the
// scores and TILE_ROWS rows x VALUE_VECS vectors for the values, so each K/V vector load
// (converted to fp32 in the register) feeds several FMAs and the accumulators stay in registers:
// 4 x 4 + 4 + 1 of AVX-512's 32 registers, 4 x 3 + 3 + 1 of AVX2's 16.
constexpr int TILE_ROWS = 4;
constexpr int TILE_TOKS = W == 16 ? 4 : 3;
constexpr int VALUE_VECS = W == 16 ? 4 : 3;

// s[j * ts + i] = sum of acc[i][j]'s lanes (scores token-major: a token's query rows side by
// side): per token one tree of horizontal adds over the tile's rows, and one store of its sums.
template <int RR, int TT>
inline void store_sums(const Vec (&acc)[RR][TT], float* s, int64_t ts) {
#ifdef __AVX512F__
  if constexpr (RR == 4 && TT == 4) {
    // Sixteen horizontal sums at once, fed token by token: lane 4j + i of r is sum(acc[i][j]).
    __m512 a[8], b[4];
    #pragma GCC unroll 16
    for (int u = 0; u < 8; ++u) {
      const __m512 x = acc[(2 * u) % 4][(2 * u) / 4], y = acc[(2 * u + 1) % 4][(2 * u + 1) / 4];
      a[u] = _mm512_add_ps(_mm512_unpacklo_ps(x, y), _mm512_unpackhi_ps(x, y));
    }
    #pragma GCC unroll 16
    for (int u = 0; u < 4; ++u)
      b[u] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * u], a[2 * u + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                           _mm512_shuffle_ps(a[2 * u], a[2 * u + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 c0 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_f32x4(b[0], b[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512 c1 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_f32x4(b[2], b[3], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512 r = _mm512_add_ps(_mm512_shuffle_f32x4(c0, c1, _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(c0, c1, _MM_SHUFFLE(3, 1, 3, 1)));
    _mm_storeu_ps(s, _mm512_extractf32x4_ps(r, 0));
    _mm_storeu_ps(s + ts, _mm512_extractf32x4_ps(r, 1));
    _mm_storeu_ps(s + 2 * ts, _mm512_extractf32x4_ps(r, 2));
    _mm_storeu_ps(s + 3 * ts, _mm512_extractf32x4_ps(r, 3));
    return;
  }
#else
  if constexpr (RR >= 2) {
    // Per token, pairwise horizontal adds of its (up to four) rows' accumulators: lane i of the
    // low half plus lane i of the high half is sum(acc[i][j]).
    #pragma GCC unroll 16
    for (int j = 0; j < TT; ++j) {
      const __m256 z = _mm256_setzero_ps();
      const __m256 h01 = _mm256_hadd_ps(acc[0][j], acc[1][j]);
      const __m256 h23 = _mm256_hadd_ps(RR > 2 ? acc[RR > 2 ? 2 : 0][j] : z, RR > 3 ? acc[RR > 3 ? 3 : 0][j] : z);
      const __m256 h = _mm256_hadd_ps(h01, h23);
      const __m128 r = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
      if constexpr (RR == 4) {
        _mm_storeu_ps(s + j * ts, r);
      } else {
        alignas(16) float out[4];
        _mm_store_ps(out, r);
        #pragma GCC unroll 4
        for (int i = 0; i < RR; ++i) s[j * ts + i] = out[i];
      }
    }
    return;
  }
#endif
  #pragma GCC unroll 16
  for (int i = 0; i < RR; ++i)
    #pragma GCC unroll 16
    for (int j = 0; j < TT; ++j) s[j * ts + i] = Simd::sum(acc[i][j]);
}

// Keeps v in a register: the compiler would otherwise fold its load into every FMA that reads it,
// and a 4 x 3 AVX2 tile then issues 15 or 16 loads per 12 FMAs (Zen 2 takes two loads a cycle), so
// the tile waits on its loads rather than its FMAs (a query vector; an fp32 K or V vector).
inline void pin_register(Vec& v) {
#ifdef __AVX512F__
  (void)v;  // 32 registers: left to the compiler, as measured there
#else
  opaque(v);
#endif
}

// K/V rows are ``ks`` elements apart and their scale rows ``kss`` floats apart.
template <class L, int RR, int TT>
inline void score_tile(const float* q, int64_t d, const typename L::T* k, int64_t ks, const float* ksc,
                       int64_t kss, const int32_t* vg, float* s, int64_t ts) {
  Vec acc[RR][TT];
  #pragma GCC unroll 16
  for (int i = 0; i < RR; ++i)
    #pragma GCC unroll 16
    for (int j = 0; j < TT; ++j) acc[i][j] = Simd::zero();
  auto step = [&](int64_t x, auto mk) {
    Vec kv[TT];
    #pragma GCC unroll 16
    for (int j = 0; j < TT; ++j) {
      Vec kj = L::load(k + j * ks, ksc + j * kss, x, mk, vg);
      if constexpr (std::is_same_v<L, LoadF32>) pin_register(kj);  // converted vectors are in registers
      kv[j] = kj;
    }
    #pragma GCC unroll 16
    for (int i = 0; i < RR; ++i) {
      Vec qv = Simd::load(q + i * d + x, mk);
      pin_register(qv);
      #pragma GCC unroll 16
      for (int j = 0; j < TT; ++j) acc[i][j] = Simd::fmadd(qv, kv[j], acc[i][j]);
    }
  };
  int64_t x = 0;
  for (; x + W <= d; x += W) step(x, All{});
  if (x < d) step(x, Simd::first(d - x));
  store_sums<RR, TT>(acc, s, ts);
}

struct NoStep {
  void operator()() const {}
};

// One score tile of rr <= TILE_ROWS rows and tt <= TILE_TOKS tokens (run-time sizes).
template <class L, int RR, int TT = TILE_TOKS>
inline void score_tile_of(int64_t tt, const float* q, int64_t d, const typename L::T* k, int64_t ks, const float* ksc,
                          int64_t kss, const int32_t* vg, float* s, int64_t ts) {
  if constexpr (TT > 1) {
    if (tt < TT) return score_tile_of<L, RR, TT - 1>(tt, q, d, k, ks, ksc, kss, vg, s, ts);
  }
  score_tile<L, RR, TT>(q, d, k, ks, ksc, kss, vg, s, ts);
}
template <class L, int RR = TILE_ROWS>
inline void score_tile_of(int64_t rr, int64_t tt, const float* q, int64_t d, const typename L::T* k, int64_t ks,
                          const float* ksc, int64_t kss, const int32_t* vg, float* s, int64_t ts) {
  if constexpr (RR > 1) {
    if (rr < RR) return score_tile_of<L, RR - 1>(rr, tt, q, d, k, ks, ksc, kss, vg, s, ts);
  }
  score_tile_of<L, RR>(tt, q, d, k, ks, ksc, kss, vg, s, ts);
}

// s[t * ts + i] = <q_i, k_t> for rows i < m, tokens t < nt. ``step()`` runs before every
// register tile (the caller's spread prefetch, see RowPrefetch).
template <class L, class Step = NoStep>
inline void block_scores_simd(const float* q, int64_t m, int64_t d, const typename L::T* kb, int64_t ks,
                              const float* ksc, int64_t kss, const int32_t* vg, int64_t nt, float* s, int64_t ts,
                              Step&& step = Step()) {
  for (int64_t i = 0; i < m; i += TILE_ROWS) {
    const int64_t rr = std::min<int64_t>(TILE_ROWS, m - i);
    for (int64_t t = 0; t < nt; t += TILE_TOKS) {
      step();
      score_tile_of<L>(rr, std::min<int64_t>(TILE_TOKS, nt - t), q + i * d, d, kb + t * ks, ks, ksc + t * kss, kss,
                       vg, s + t * ts + i, ts);
    }
  }
}

// acc[i, x0 : x0 + W NV] += sum over the blocks' rows t of p[(off + t) * ts + i] * v_t[x0 : ...]
// (the last vector's lanes ``last``): the accumulators stay in registers across the blocks.
template <class L, int RR, int NV, class M>
inline void value_tile(const float* p, int64_t ts, const ValueRows<typename L::T>* blocks, int64_t nblocks,
                       int64_t vs, int64_t vss, const int32_t* vg, int64_t x0, float* acc, int64_t dv, M last) {
  // vector c's lanes: all but the last vector's, which are ``last``
  auto load_acc = [&](int i, int c) {
    return c == NV - 1 ? Simd::load(acc + i * dv + x0 + W * c, last) : Simd::load(acc + i * dv + x0 + W * c, All{});
  };
  Vec a[RR][NV];
  #pragma GCC unroll 16
  for (int i = 0; i < RR; ++i)
    #pragma GCC unroll 16
    for (int c = 0; c < NV; ++c) a[i][c] = load_acc(i, c);
  for (int64_t b = 0; b < nblocks; ++b) {
    const typename L::T* v = blocks[b].v;
    const float* vsc = blocks[b].sc;
    const float* pb = p + blocks[b].off * ts;
    for (int64_t t = 0; t < blocks[b].nt; ++t) {
      Vec vv[NV];
      #pragma GCC unroll 16
      for (int c = 0; c < NV; ++c) {
        Vec vc = c == NV - 1 ? L::load(v + t * vs, vsc + t * vss, x0 + W * c, last, vg)
                             : L::load(v + t * vs, vsc + t * vss, x0 + W * c, All{}, vg);
        if constexpr (std::is_same_v<L, LoadF32>) pin_register(vc);
        vv[c] = vc;
      }
      #pragma GCC unroll 16
      for (int i = 0; i < RR; ++i) {
        const Vec w = Simd::set1(pb[t * ts + i]);
        #pragma GCC unroll 16
        for (int c = 0; c < NV; ++c) a[i][c] = Simd::fmadd(w, vv[c], a[i][c]);
      }
    }
  }
  #pragma GCC unroll 16
  for (int i = 0; i < RR; ++i)
    #pragma GCC unroll 16
    for (int c = 0; c < NV; ++c) {
      if (c == NV - 1)
        Simd::store(acc + i * dv + x0 + W * c, last, a[i][c]);
      else
        Simd::store(acc + i * dv + x0 + W * c, All{}, a[i][c]);
    }
}

// dst[t * d + x] = row t of a block, converted to fp32 (t < nt, x < d): a stored block staged
// once when several register blocks of query rows would otherwise each convert it again.
template <class L>
inline void stage_rows(const typename L::T* src, int64_t stride, const float* sc, int64_t scs, const int32_t* vg,
                       int64_t nt, int64_t d, float* dst) {
  for (int64_t t = 0; t < nt; ++t) {
    int64_t x = 0;
    for (; x + W <= d; x += W)
      Simd::store(dst + t * d + x, All{}, L::load(src + t * stride, sc + t * scs, x, All{}, vg));
    if (x < d) {
      const Lanes mk = Simd::first(d - x);
      Simd::store(dst + t * d + x, mk, L::load(src + t * stride, sc + t * scs, x, mk, vg));
    }
  }
}

template <class L, int RR, int NV, class M>
inline void value_tile_of(int64_t rr, const float* p, int64_t ts, const ValueRows<typename L::T>* blocks,
                          int64_t nblocks, int64_t vs, int64_t vss, const int32_t* vg, int64_t x0, float* acc,
                          int64_t dv, M last) {
  if constexpr (RR > 1) {
    if (rr < RR) return value_tile_of<L, RR - 1, NV>(rr, p, ts, blocks, nblocks, vs, vss, vg, x0, acc, dv, last);
  }
  value_tile<L, RR, NV>(p, ts, blocks, nblocks, vs, vss, vg, x0, acc, dv, last);
}

// acc[i] += the blocks' value rows weighted by row i of the token-major weights p (p[t * ts + i]),
// for rows i < m. ``step()`` runs before every register tile (the caller's spread prefetch, see
// RowPrefetch).
template <class L, class Step = NoStep>
inline void block_values_simd(const float* p, int64_t ts, int64_t m, const ValueRows<typename L::T>* blocks,
                              int64_t nblocks, int64_t vs, int64_t vss, const int32_t* vg, int64_t dv, float* acc,
                              Step&& step = Step()) {
  for (int64_t i = 0; i < m; i += TILE_ROWS) {
    const int64_t rr = std::min<int64_t>(TILE_ROWS, m - i);
    const float* pi = p + i;
    float* ai = acc + i * dv;
    int64_t x = 0;
    for (; x + W * VALUE_VECS <= dv; x += W * VALUE_VECS) {
      step();
      value_tile_of<L, TILE_ROWS, VALUE_VECS>(rr, pi, ts, blocks, nblocks, vs, vss, vg, x, ai, dv, All{});
    }
    for (; x + W <= dv; x += W) {
      step();
      value_tile_of<L, TILE_ROWS, 1>(rr, pi, ts, blocks, nblocks, vs, vss, vg, x, ai, dv, All{});
    }
    if (x < dv) {
      step();
      value_tile_of<L, TILE_ROWS, 1>(rr, pi, ts, blocks, nblocks, vs, vss, vg, x, ai, dv, Simd::first(dv - x));
    }
  }
}

// Register tiles of one block's scores, each one step() call. A block's prefetch is spread over
// these and its share of its span's value tiles (value_tiles * nt / span): with the values' calls
// left out, a span's lines went out during its scores only (GQA 8:1 from memory, fp32 and bf16
// caches on the Intel host: 2-4% slower). Not where the values are a prefix of the key rows (MLA):
// there the value tiles read lines the scores fetched, so they get no share (bf16 MLA measured the
// same either way, within this host's noise).
inline int64_t score_tiles(int64_t m, int64_t nt) {
  return (m + TILE_ROWS - 1) / TILE_ROWS * ((nt + TILE_TOKS - 1) / TILE_TOKS);
}

// Register tiles of one pass of block_values_simd over a span (each makes one step() call).
inline int64_t value_tiles(int64_t m, int64_t dv) {
  const int64_t chunk = W * VALUE_VECS;
  const int64_t per_rows = dv / chunk + (dv % chunk) / W + (dv % W != 0);
  return (m + TILE_ROWS - 1) / TILE_ROWS * per_rows;
}

// Tokens whose value rows one register tile takes in one pass (fp32 and bf16 caches): a block's
// softmax weights wait in the score buffer until the blocks add up to this many, so a value tile
// loads and stores its accumulators once per span rather than once per 16-token block (GQA 8:1
// bf16 in cache on a Zen 2 core: 115 ns a token at 16-token blocks, 95 at 64 or 128).
constexpr int64_t SPAN_TOKENS = 64;

#ifdef __AVX512F__
// The AMX decoder's softmax (paged_decode_amx.h) takes its exp at 16 lanes.
inline __m512 exp512(__m512 x) { return simd::exp_nonpositive(x); }
#endif

// The stride of the token-major score columns for at most m rows: m rounded up to whole vectors,
// or, below one vector, to a power of two that divides it (W / ts tokens then share a vector, so
// the softmax's loads, exps and stores run full: one query head per KV head on 16 lanes took 16
// times the softmax work of its scores' lanes).
inline int64_t column_stride(int64_t m) {
  if (m >= W) return (m + W - 1) / W * W;
  int64_t ts = 1;
  while (ts < m) ts *= 2;
  return ts;
}

// softmax_columns' per-row steps. take_span_max: row i's shift nm[i] = max(mx[i], bm[i]) (the
// span's column max bm[i]), its sum and accumulator row (acc + i dv) rescaled where the max grew.
// take_span_sums: its sum takes in the span's total tot[i] (NaN for good where nan[i]), its max
// becomes nm[i].
inline void take_span_max(int64_t rows, const float* bm, bool started, float* mx, float* sm, float* acc, int64_t dv,
                          float* nm) {
  for (int64_t i = 0; i < rows; ++i) {
    const float n = started ? std::max(mx[i], bm[i]) : bm[i];
    if (started && n > mx[i]) {
      const float alpha = std::exp(mx[i] - n);
      float* ai = acc + i * dv;
#pragma omp simd
      for (int64_t x = 0; x < dv; ++x) ai[x] *= alpha;
      sm[i] *= alpha;
    }
    nm[i] = n;
  }
}
inline void take_span_sums(int64_t rows, const float* tot, const uint32_t* nan, const float* nm, bool started,
                           float* mx, float* sm) {
  for (int64_t i = 0; i < rows; ++i) {
    sm[i] = nan[i] ? NAN : (started ? sm[i] : 0.f) + tot[i];
    mx[i] = nm[i];
  }
}

// Online softmax over the token-major score columns s[t * ts + i] (t < ncols, i < m; ts from
// column_stride): each row's running max mx[i] and sum sm[i] take in the columns, its accumulator
// row (acc + i dv) is rescaled where the max grew, and the columns become the weights
// exp(s - max). The max and the sums are lane-wise over the tokens, with no chain per row; where
// ts < W a vector holds W / ts tokens, and its lanes i, i + ts, ... (row i) are folded at the end.
// A NaN score makes the row's sum NaN for good (its output and LSE then are, as softmax gives);
// the max is taken over its other scores. Lanes of rows m .. ts (padding) are read and written
// but hold finite numbers or are never used; nothing past column ncols is read or written.
inline void softmax_columns(float* s, int64_t ts, int64_t m, int64_t ncols, bool started, float* mx, float* sm,
                            float* acc, int64_t dv) {
  alignas(64) float bm[W], nm[W], tot[W];
  alignas(64) uint32_t nan[W];
  // Stripes of ``lanes`` rows (one where ts < W), each vector ``step`` floats after the last:
  // ts >= W, a token's W rows a vector; ts < W, a run of ncols * ts floats, lane l row l mod ts,
  // its last vector masked at column ncols.
  const int64_t lanes = std::min<int64_t>(ts, W), step = std::max<int64_t>(ts, W), total = ncols * lanes;
  for (int64_t r0 = 0; r0 < m; r0 += W) {
    const int64_t rows = std::min(lanes, m - r0);
    float* base = s + r0;
    Vec mv = Simd::set1(-3.0e38f), nanv = Simd::zero();
    for (int64_t u = 0, k = 0; u < total; u += W, ++k) {
      const Vec x = Simd::load_else(base + k * step, Simd::first(total - u), -3.0e38f);
      nanv = Simd::either(nanv, Simd::nan_lanes(x));
      mv = Simd::max(x, mv);  // mv where x is NaN
    }
    Simd::store(bm, All{}, mv);
    Simd::store(reinterpret_cast<float*>(nan), All{}, nanv);
    for (int64_t l = ts; l < W; ++l) {  // fold lane l into lane l mod ts (row l mod ts)
      bm[l % ts] = std::max(bm[l % ts], bm[l]);
      nan[l % ts] |= nan[l];
    }
    take_span_max(rows, bm, started, mx + r0, sm + r0, acc + r0 * dv, dv, nm);
    for (int64_t i = rows; i < lanes; ++i) nm[i] = 3.0e38f;  // padding rows: exp(-87), finite
    for (int64_t l = ts; l < W; ++l) nm[l] = nm[l % ts];
    const Vec nmv = Simd::load(nm, All{});
    Vec tv = Simd::zero();
    for (int64_t u = 0, k = 0; u < total; u += W, ++k) {
      float* p = base + k * step;
      const Lanes live = Simd::first(total - u);
      const Vec e = simd::exp_nonpositive(Simd::sub(Simd::load(p, live), nmv));
      Simd::store(p, live, e);
      tv = Simd::add(tv, total - u >= W ? e : Simd::load(p, live));  // zero past column ncols
    }
    Simd::store(tot, All{}, tv);
    for (int64_t l = ts; l < W; ++l) tot[l % ts] += tot[l];
    take_span_sums(rows, tot, nan, nm, started, mx + r0, sm + r0);
  }
}
#else
inline int64_t score_tiles(int64_t, int64_t) { return 1; }
inline int64_t value_tiles(int64_t, int64_t) { return 0; }
constexpr int64_t SPAN_TOKENS = 0;
#endif

template <class L>
struct LoaderType {
  using type = L;
};

struct Item {
  int64_t r, h, t0, t1, slot;  // request, KV head, key range [t0, t1), partial-result slot
};

}  // namespace

#include "paged_decode_amx.h"

// Empty when bf16 queries over bf16/fp8 caches can take the AMX path; otherwise why not.
std::string amx_status() {
#ifdef DCPGRAPH_HAVE_AMX
  return amx::permission_error();
#else
  return "this build has no AMX-BF16 code (the compiler or CPU lacks -mamx-bf16 or -mavx512vbmi)";
#endif
}

// Returns false (and writes nothing) if a block table row is too short or holds an out-of-range
// id where a real block is needed: the caller then takes its checked path, which raises.
template <class T>
bool paged_decode_typed(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const float* ksp, const float* vsp, int64_t kgroups, int64_t vgroups, int64_t group,
                        const at::Tensor& block_table, const at::Tensor& cu_seqlens_q, const at::Tensor& kv_lens,
                        double scale, at::Tensor& out, at::Tensor& lse, int64_t chunk_tokens,
                        int64_t prefetch_blocks, const int64_t* bound) {
  const bool bf16_queries = q.scalar_type() == at::kBFloat16;
  TORCH_CHECK(!bound || bf16_queries, "paged_decode: per-query bounds (kv_bound) need bf16 queries on the AMX path");
  TORCH_CHECK(q.scalar_type() == at::kFloat || (bf16_queries && !std::is_same_v<T, float>),
              "paged_decode: fp32 queries, or bf16 queries over a bf16/fp8 cache");
  TORCH_CHECK(!bf16_queries || amx_status().empty(), "paged_decode: bf16 queries need AMX: ", amx_status());
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && lse.is_contiguous(), "paged_decode: layout");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1, "paged_decode: K/V rows must be dense");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.is_contiguous(), "block_table int32");
  TORCH_CHECK(cu_seqlens_q.scalar_type() == at::kLong && kv_lens.scalar_type() == at::kLong, "int64 lens");
  const int64_t hq = q.size(1), d = q.size(2);
  const int64_t nb = k_cache.size(0), bsz = k_cache.size(1), hkv = k_cache.size(2), dv = v_cache.size(3);
  TORCH_CHECK(k_cache.size(3) == d && hq % hkv == 0 && v_cache.size(2) == hkv && v_cache.size(1) == bsz);
  const int64_t g = hq / hkv;
  const int64_t rows = kv_lens.size(0), width = block_table.size(1);
  const int64_t* cu = cu_seqlens_q.data_ptr<int64_t>();
  const int64_t* lens = kv_lens.data_ptr<int64_t>();
  const int32_t* table = block_table.data_ptr<int32_t>();
  const int64_t ks0 = k_cache.stride(0), ks1 = k_cache.stride(1), ks2 = k_cache.stride(2);
  const int64_t vs0 = v_cache.stride(0), vs1 = v_cache.stride(1), vs2 = v_cache.stride(2);
  const T* kp = static_cast<const T*>(k_cache.data_ptr());
  const T* vp = static_cast<const T*>(v_cache.data_ptr());
  // Scale rows (fp8): [NB, B, H, groups] contiguous; other dtypes read one dummy scale, stride 0.
  static const float kNoScale = 1.f;
  const int64_t kss2 = ksp ? kgroups : 0, kss1 = hkv * kss2, kss0 = kss1 * bsz;
  const int64_t vss2 = vsp ? vgroups : 0, vss1 = hkv * vss2, vss0 = vss1 * bsz;
  if (!ksp) ksp = &kNoScale;
  if (!vsp) vsp = &kNoScale;
  const float* qp = bf16_queries ? nullptr : q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  float* lp = lse.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  // Values inside the key rows (MLA: v = k[..., :dv]): prefetching K covers them.
  const bool value_prefix = vp == kp && vs0 == ks0 && vs1 == ks1 && vs2 == ks2 && dv <= d;

  for (int64_t r = 0; r < rows; ++r) {
    const int64_t n = lens[r];
    if (n <= 0 || cu[r + 1] == cu[r]) continue;
    const int64_t need = (n + bsz - 1) / bsz;
    if (need > width) return false;
    for (int64_t b = 0; b < need; ++b) {
      const int32_t id = table[r * width + b];
      if (id < 0 || id >= nb) return false;
    }
  }
  chunk_tokens = std::max<int64_t>(bsz, (chunk_tokens + bsz - 1) / bsz * bsz);
  std::vector<Item> items;
  std::vector<int64_t> first(rows + 1, 0);  // first item of request r (all its heads and chunks)
  int64_t slots = 0;
  int64_t max_m = 1;
  for (int64_t r = 0; r < rows; ++r) {
    first[r] = static_cast<int64_t>(items.size());
    const int64_t lq = cu[r + 1] - cu[r];
    int64_t n = lens[r];
    if (bound && lq > 0) {  // the keys any of the request's query tokens sees
      int64_t most = 0;
      for (int64_t t = cu[r]; t < cu[r + 1]; ++t) most = std::max(most, bound[t]);
      n = std::min(n, most);
    }
    if (n <= 0 || lq <= 0) continue;
    max_m = std::max(max_m, lq * g);
    for (int64_t h = 0; h < hkv; ++h)
      for (int64_t t0 = 0; t0 < n; t0 += chunk_tokens)
        items.push_back({r, h, t0, std::min(n, t0 + chunk_tokens), slots++});
  }
  first[rows] = static_cast<int64_t>(items.size());
  // Partial results per item: acc [M, dv] (unnormalised), running max and sum [M].
  LineVector<float> pacc(static_cast<size_t>(slots) * max_m * dv);
  std::vector<float> pmax(static_cast<size_t>(slots) * max_m), psum(static_cast<size_t>(slots) * max_m);

#ifdef DCPGRAPH_HAVE_AMX
  if constexpr (!std::is_same_v<T, float>) {
    if (bf16_queries) {
      constexpr bool fp8 = std::is_same_v<T, uint8_t>;
      TORCH_CHECK(!fp8 || (group > 0 && group % 32 == 0),
                  "paged_decode: the AMX path needs an fp8 scale group that is a multiple of 32, not ", group);
      const amx::Caches<T> caches{reinterpret_cast<const uint16_t*>(q.data_ptr()), hq, g, d, dv, bsz, width, table,
                                  cu, kp, vp, ks0, ks1, ks2, vs0, vs1, vs2, ksp, vsp, kss0, kss1, kss2, vss0, vss1,
                                  vss2, group, value_prefix, sc, prefetch_blocks, bound};
      at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
        amx::configure();
        auto run = [&](auto& decoder, const Item& w) {
          decoder.run(w.r, w.h, w.t0, w.t1, pacc.data() + w.slot * max_m * dv, pmax.data() + w.slot * max_m,
                      psum.data() + w.slot * max_m);
        };
        if (value_prefix) {
          amx::Decoder<T, amx::PREFIX_TOK> decoder(caches, max_m);
          for (int64_t it = begin; it < end; ++it) run(decoder, items[it]);
        } else {  // items of at most 8 query rows keep their accumulators in tile registers
          // each decoder made on the thread's first item that needs it (its buffers are per call)
          std::optional<amx::Decoder<T, amx::ROWS_TOK>> decoder;
          std::optional<amx::PackedDecoder<T>> packed;
          for (int64_t it = begin; it < end; ++it) {
            const Item& w = items[it];
            if (amx::PackedDecoder<T>::fits((cu[w.r + 1] - cu[w.r]) * g, dv))
              run(packed ? *packed : packed.emplace(caches), w);
            else
              run(decoder ? *decoder : decoder.emplace(caches, max_m), w);
          }
        }
        _tile_release();
      });
    }
  }
#endif
#if DCPGRAPH_SIMD
  // The scale of each W-element vector of a row (its index among the row's scales; 0 where a row
  // has one scale or none): a table, so no loader divides by the group size.
  std::vector<int32_t> vgroup((std::max(d, dv) + W - 1) / W, 0);
  if (group > 0)
    for (size_t i = 0; i < vgroup.size(); ++i) vgroup[i] = static_cast<int32_t>(int64_t(i) * W / group);
  const bool row_scaled = kgroups == 1 && vgroups == 1 && !value_prefix;
#endif
  if (!bf16_queries) at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    // Value rows of fp32/bf16 blocks and of folded fp8 blocks wait, their weights in the score
    // buffer, until SPAN_TOKENS (other fp8 blocks, converted or staged, go one at a time).
    constexpr bool fp8 = std::is_same_v<T, uint8_t>;
    const int64_t span = std::max(bsz, SPAN_TOKENS);  // the most score columns waiting at once
#if DCPGRAPH_SIMD
    // Scores token-major: column t (a token) holds the rows' scores side by side, ``ts`` apart
    // (column_stride; the padding starts zero, so it stays finite).
    const int64_t ts = column_stride(max_m);
    LineVector<float> sbuf(span * ts);
#else
    const int64_t ss = span;  // scores row-major: row i's columns ``ss`` apart
    LineVector<float> sbuf(max_m * ss);
#endif
    std::vector<ValueRows<T>> waiting;
    int64_t waiting_tokens = 0;
    LineVector<float> qbuf(max_m * d);
    // fp8 blocks staged as fp32 (K rows, then V rows unless they are a prefix of K's).
    LineVector<float> kstage(fp8 ? bsz * d : 0);
    LineVector<float> vstage(fp8 && !value_prefix ? bsz * dv : 0);
#if DCPGRAPH_SIMD
    LineVector<float> qfold(fp8 && row_scaled ? max_m * d : 0);  // qbuf * FOLD_UP (LoadFP8Unscaled's queries)
#endif
    RowPrefetch pf(d * int64_t(sizeof(T)), value_prefix ? 0 : dv * int64_t(sizeof(T)), ks1 * int64_t(sizeof(T)),
                   vs1 * int64_t(sizeof(T)));
    // ``loader``: a LoaderType naming the element loader L of the cache rows
    auto run_items = [&](auto loader) {
      using L [[maybe_unused]] = typename decltype(loader)::type;  // unused by the scalar build
      for (int64_t it = begin; it < end; ++it) {
        const Item& w = items[it];
        const int64_t lq = cu[w.r + 1] - cu[w.r], m = lq * g;
        // Gather this head group's query rows (scaled) into [M, d]: row j * g + gi.
        for (int64_t j = 0; j < lq; ++j)
          for (int64_t gi = 0; gi < g; ++gi) {
            const float* src = qp + ((cu[w.r] + j) * hq + w.h * g + gi) * d;
            float* dst = qbuf.data() + (j * g + gi) * d;
            for (int64_t x = 0; x < d; ++x) dst[x] = src[x] * sc;
          }
        // fp8 rows of one scale: blocks may fold (LoadFP8Unscaled) if the queries times FOLD_UP stay finite
        [[maybe_unused]] bool fold_queries = false;
#if DCPGRAPH_SIMD
        if constexpr (fp8) {
          if (row_scaled && below_fold_bound(qbuf.data(), m * d)) {
            fold_queries = true;
            for (int64_t x = 0; x < m * d; ++x) qfold[x] = qbuf[x] * FOLD_UP;
          }
        }
#endif
        float* acc = pacc.data() + w.slot * max_m * dv;
        float* mx = pmax.data() + w.slot * max_m;
        float* sm = psum.data() + w.slot * max_m;
        std::fill(acc, acc + m * dv, 0.f);
        bool started = false;
#if DCPGRAPH_SIMD
        // Online softmax over the score columns [0, ncols) at s (softmax_columns).
        auto softmax = [&](float* s, int64_t ncols) {
          softmax_columns(s, ts, m, ncols, started, mx, sm, acc, dv);
          started = true;
        };
#else
        // Online softmax over the score columns [0, ncols) of s's rows: each row's running max
        // and sum take in the columns, its accumulator is rescaled where the max grew, and the
        // columns become the weights exp(s - max). A NaN score makes the row's sum NaN for good.
        auto softmax = [&](float* s, int64_t ncols) {
          for (int64_t i = 0; i < m; ++i) {
            float* si = s + i * ss;
            bool nan = false;
            float bm = -3.0e38f;
            for (int64_t u = 0; u < ncols; ++u) {
              nan = nan || std::isnan(si[u]);
              if (!std::isnan(si[u])) bm = std::max(bm, si[u]);
            }
            const float nm = started ? std::max(mx[i], bm) : bm;
            if (started && nm > mx[i]) {
              const float alpha = std::exp(mx[i] - nm);
              float* ai = acc + i * dv;
              for (int64_t x = 0; x < dv; ++x) ai[x] *= alpha;
              sm[i] *= alpha;
            }
            float total = 0.f;
            for (int64_t u = 0; u < ncols; ++u) {
              const float e = std::exp(si[u] - nm);
              si[u] = e;
              total += e;
            }
            sm[i] = nan ? NAN : (started ? sm[i] : 0.f) + total;
            mx[i] = nm;
          }
          started = true;
        };
#endif
        waiting.clear();
        waiting_tokens = 0;
#if DCPGRAPH_SIMD
        // The waiting blocks' span: one softmax over its columns (a row's max, exp and sum once a
        // span rather than once a block), then their value rows.
        auto flush = [&]() {
          softmax(sbuf.data(), waiting_tokens);
          if constexpr (fp8) {  // the weights times V's scales (their sums are taken)
            for (const ValueRows<T>& b : waiting)
              scale_columns(sbuf.data() + b.off * ts, ts, m, b.nt, b.sc, vss1, FOLD_UP);
          }
          using WaitingLoader = std::conditional_t<fp8, LoadFP8Unscaled, L>;
          block_values_simd<WaitingLoader>(sbuf.data(), ts, m, waiting.data(), static_cast<int64_t>(waiting.size()),
                                           vs1, vss1, vgroup.data(), dv, acc, pf);
          waiting.clear();
          waiting_tokens = 0;
        };
#endif
        for (int64_t t = w.t0; t < w.t1;) {
          const int64_t blk = table[w.r * width + t / bsz], off = t % bsz;
          const int64_t nt = std::min(bsz - off, w.t1 - t);
          const T* kb = kp + blk * ks0 + off * ks1 + w.h * ks2;
          const T* vb = vp + blk * vs0 + off * vs1 + w.h * vs2;
          const float* ksb = ksp + blk * kss0 + off * kss1 + w.h * kss2;
          const float* vsb = vsp + blk * vss0 + off * vss1 + w.h * vss2;
          // Prefetch the K/V rows of the block prefetch_blocks ahead (its address comes from the
          // table, which the hardware prefetcher cannot follow for a scattered table), a few lines
          // before each register tile rather than in one burst (see RowPrefetch).
          const int64_t ahead = (t / bsz + prefetch_blocks) * bsz;
          if (prefetch_blocks > 0 && ahead < w.t1) {
            const int64_t pb = table[w.r * width + ahead / bsz];
            // the block's score tiles and its share of its span's value tiles (which take pf too),
            // unless the values are a prefix of the key rows, whose lines the scores already fetch
            const int64_t tiles = score_tiles(m, nt) + (value_prefix ? 0 : value_tiles(m, dv) * nt / span);
            pf.start(reinterpret_cast<const char*>(kp + pb * ks0 + w.h * ks2),
                     reinterpret_cast<const char*>(vp + pb * vs0 + w.h * vs2), std::min(bsz, w.t1 - ahead), tiles);
          } else {
            pf.start(nullptr, nullptr, 0, 1);
          }
#if DCPGRAPH_SIMD
          // One register block of query rows converts each K/V vector once in registers. With more,
          // fp8 blocks are staged in fp32 once and every register block reads the staged copy (its
          // conversion costs more than a store and reload; bf16's shift does not: measured with
          // benchmarks/attention_bandwidth.py, MLA 16 heads fp8 0.76 -> 1.24 GB/s, bf16 2.6 -> 2.2).
          // fp8 rows of one scale each (GQA with head dims up to a scale group) in a block with no
          // NaN code: read unscaled, their scales applied to the block's scores and weights, and not
          // staged (its four-op conversion costs about what a store and reload do: GQA 8:1 in cache
          // on a Zen 2 core, 150 ns a token either way, 166 staged with scales as before).
          bool folded = false;
          if constexpr (std::is_same_v<L, LoadFP8>)
            folded = fold_queries && below_fold_bound(vsb, nt, vss1) && !fp8_rows_hold_nan(kb, ks1, nt, d) &&
                     !fp8_rows_hold_nan(vb, vs1, nt, dv);
          // fp32/bf16 blocks and folded fp8 blocks wait for their span's softmax and values; other
          // fp8 blocks go one at a time (after the span before them).
          const bool waits = !fp8 || folded;
          if (!waits && !waiting.empty()) flush();
          const bool staged = fp8 && m > TILE_ROWS && !folded;
          float* s = sbuf.data() + waiting_tokens * ts;  // this block's score columns
          if (folded) {
            if constexpr (fp8) {
              block_scores_simd<LoadFP8Unscaled>(qfold.data(), m, d, kb, ks1, nullptr, 0, nullptr, nt, s, ts, pf);
              scale_columns(s, ts, m, nt, ksb, kss1);
            }
          } else if (staged) {
            stage_rows<L>(kb, ks1, ksb, kss1, vgroup.data(), nt, d, kstage.data());
            block_scores_simd<LoadF32>(qbuf.data(), m, d, kstage.data(), d, nullptr, 0, nullptr, nt, s, ts, pf);
          } else {
            block_scores_simd<L>(qbuf.data(), m, d, kb, ks1, ksb, kss1, vgroup.data(), nt, s, ts, pf);
          }
          if (waits) {
            waiting.push_back({vb, vsb, nt, waiting_tokens});
            waiting_tokens += nt;
            if (waiting_tokens + bsz > SPAN_TOKENS || t + nt >= w.t1) flush();
          } else {
            softmax(s, nt);
            if (staged) {
              const ValueRows<float> rows{value_prefix ? kstage.data() : vstage.data(), nullptr, nt, 0};
              if (!value_prefix) stage_rows<L>(vb, vs1, vsb, vss1, vgroup.data(), nt, dv, vstage.data());
              block_values_simd<LoadF32>(s, ts, m, &rows, 1, value_prefix ? d : dv, 0, nullptr, dv, acc, pf);
            } else {
              const ValueRows<T> rows{vb, vsb, nt, 0};
              block_values_simd<L>(s, ts, m, &rows, 1, vs1, vss1, vgroup.data(), dv, acc, pf);
            }
          }
#else
          pf.rest();  // the scalar path makes no step() calls: the block's lines at once
          float* s = sbuf.data();
          if constexpr (std::is_same_v<T, float>) {
            block_scores(qbuf.data(), m, d, kb, ks1, nt, s, ss);
            softmax(s, nt);
            block_values(s, ss, m, vb, vs1, nt, dv, acc);
          }
#endif
          pf.rest();  // what rounding left
          t += nt;
        }
      }
    };
#if DCPGRAPH_SIMD
    if constexpr (std::is_same_v<T, uint8_t>) {
      if (denormals_are_zero()) return run_items(LoaderType<LoadFP8Exact>{});
    }
    run_items(LoaderType<LoaderFor<T>>{});
#else
    run_items(LoaderType<void>{});
#endif
  });

  // Merge each (request, head)'s chunks by LSE and write out / lse.
  at::parallel_for(0, rows * hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> o(dv);
    for (int64_t rh = begin; rh < end; ++rh) {
      const int64_t r = rh / hkv, h = rh % hkv;
      const int64_t lq = cu[r + 1] - cu[r], m = lq * g;
      if (lq <= 0) continue;
      const int64_t nchunks = (first[r + 1] - first[r]) / hkv;
      for (int64_t i = 0; i < m; ++i) {
        const int64_t j = i / g, gi = i % g;
        const int64_t row = (cu[r] + j) * hq + h * g + gi;
        float* dst = op + row * dv;
        if (nchunks == 0) continue;  // no keys: the caller's (0, -inf) stays
        const int64_t s0 = items[first[r] + h * nchunks].slot;
        float gm = pmax[s0 * max_m + i];
        for (int64_t c = 1; c < nchunks; ++c) gm = std::max(gm, pmax[(s0 + c) * max_m + i]);
        if (gm == -INFINITY) continue;  // a row bounded to no keys: (0, -inf) as well
        std::fill(o.begin(), o.end(), 0.f);
        float tot = 0.f;
        for (int64_t c = 0; c < nchunks; ++c) {
          const int64_t sl = s0 + c;
          const float wgt = std::exp(pmax[sl * max_m + i] - gm);
          tot += wgt * psum[sl * max_m + i];
          const float* a = pacc.data() + (sl * max_m + i) * dv;
#pragma omp simd
          for (int64_t x = 0; x < dv; ++x) o[x] += wgt * a[x];
        }
        const float inv = 1.f / tot;
#pragma omp simd
        for (int64_t x = 0; x < dv; ++x) dst[x] = o[x] * inv;
        lp[row] = gm + std::log(tot);
      }
    }
  });
  return true;
}


// Dispatch on the KV dtype. ``k_scales``/``v_scales``: fp8 only (``v_scales`` absent when the values
// are a prefix of the key rows, which then share the key rows' scales).
bool paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const c10::optional<at::Tensor>& k_scales, const c10::optional<at::Tensor>& v_scales,
                  const at::Tensor& block_table, const at::Tensor& cu_seqlens_q, const at::Tensor& kv_lens,
                  double scale, at::Tensor& out, at::Tensor& lse, int64_t chunk_tokens,
                  int64_t prefetch_blocks, int64_t scale_group, const c10::optional<at::Tensor>& kv_bound) {
  const auto kind = k_cache.scalar_type();
  const int64_t* bound = nullptr;
  if (kv_bound.has_value()) {
    TORCH_CHECK(kv_bound->scalar_type() == at::kLong && kv_bound->is_contiguous() && kv_bound->dim() == 1 &&
                    kv_bound->size(0) == q.size(0),
                "paged_decode: kv_bound must be contiguous int64 [T] (one bound per query token)");
    bound = kv_bound->data_ptr<int64_t>();
  }
  TORCH_CHECK(v_cache.scalar_type() == kind, "paged_decode: K and V caches of one dtype");
  if (kind == at::kFloat)
    return paged_decode_typed<float>(q, k_cache, v_cache, nullptr, nullptr, 0, 0, 0, block_table, cu_seqlens_q, kv_lens,
                                     scale, out, lse, chunk_tokens, prefetch_blocks, bound);
#if DCPGRAPH_SIMD
  if (kind == at::kBFloat16)
    return paged_decode_typed<uint16_t>(q, k_cache, v_cache, nullptr, nullptr, 0, 0, 0, block_table, cu_seqlens_q,
                                        kv_lens, scale, out, lse, chunk_tokens, prefetch_blocks, bound);
  if (kind == at::kFloat8_e4m3fn) {
    TORCH_CHECK(k_scales.has_value(), "paged_decode: fp8 K needs its scales");
    const at::Tensor& ks = *k_scales;
    TORCH_CHECK(scale_group > 0 && scale_group % 16 == 0, "paged_decode: the fp8 scale group (", scale_group,
                ") must be a positive multiple of 16");
    auto check_scales = [&](const at::Tensor& sc, const at::Tensor& cache, const char* name) {
      const int64_t groups = (cache.size(3) + scale_group - 1) / scale_group;
      TORCH_CHECK(sc.scalar_type() == at::kFloat && sc.is_contiguous() && sc.dim() == 4 && sc.size(3) == groups &&
                      sc.size(0) == cache.size(0) && sc.size(1) == cache.size(1) && sc.size(2) == cache.size(2),
                  "paged_decode: ", name, " must be contiguous fp32 [NB, B, H, ceil(D/", scale_group, ")]");
      return groups;
    };
    const int64_t kgroups = check_scales(ks, k_cache, "k_scales");
    const bool prefix = v_cache.data_ptr() == k_cache.data_ptr();
    TORCH_CHECK(prefix || v_scales.has_value(), "paged_decode: fp8 V needs its scales (or to be a prefix of K)");
    // A prefix of the key rows reads the key rows' scales (its groups are their first groups).
    const int64_t vgroups = prefix ? kgroups : check_scales(*v_scales, v_cache, "v_scales");
    const float* vsp = prefix ? ks.data_ptr<float>() : v_scales->data_ptr<float>();
    return paged_decode_typed<uint8_t>(q, k_cache, v_cache, ks.data_ptr<float>(), vsp, kgroups, vgroups, scale_group,
                                       block_table,
                                       cu_seqlens_q, kv_lens, scale, out, lse, chunk_tokens, prefetch_blocks, bound);
  }
#endif
  TORCH_CHECK(false, "paged_decode: KV dtype ", kind, " is not supported by this build");
}

// The decode entry (one call per attention layer and step, so everything a call needs is done here
// rather than in Python): returns (out [T, Hq, Dv] in q's dtype, lse [T, Hq] fp32), or nullopt when
// these inputs are not this kernel's (device, dtypes, shapes, a non-dense K/V row) or the table does
// not cover a row (the caller's checked torch path then runs, and raises for the latter). Index
// tensors may be int32 or int64. ``amx``: bf16 queries take the AMX path (else they are computed in
// fp32). ``kv_bound`` (one per query token): applied per query row on the AMX path, as row lengths
// on the fp32 path (nullopt there for a row of several queries). ``chunk_tokens`` <= 0: chosen here so
// the (request, KV head, chunk) items keep every thread busy (one chunk per request on one thread).
std::optional<std::tuple<at::Tensor, at::Tensor>> paged_attention(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const c10::optional<at::Tensor>& k_scales, const c10::optional<at::Tensor>& v_scales,
    const at::Tensor& block_table, const at::Tensor& cu_seqlens_q, const at::Tensor& kv_lens,
    const c10::optional<at::Tensor>& kv_bound, double scale, bool amx, int64_t chunk_tokens,
    int64_t prefetch_blocks, int64_t scale_group) {
  const auto qt = q.scalar_type(), kind = k_cache.scalar_type();
  const bool readable = kind == at::kFloat
#if DCPGRAPH_SIMD
                        || kind == at::kBFloat16 || kind == at::kFloat8_e4m3fn
#endif
      ;
  if (!((qt == at::kFloat || qt == at::kBFloat16) && v_cache.scalar_type() == kind && readable &&
        q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu() && q.dim() == 3 &&
        k_cache.dim() == 4 && v_cache.dim() == 4 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1 &&
        k_cache.size(0) == v_cache.size(0) && k_cache.size(1) == v_cache.size(1) &&
        k_cache.size(2) == v_cache.size(2) && q.size(2) == k_cache.size(3) && q.size(1) % k_cache.size(2) == 0))
    return std::nullopt;
  const bool on_amx = amx && qt == at::kBFloat16 && kind != at::kFloat;
  auto as = [](const at::Tensor& x, at::ScalarType t) {
    return x.scalar_type() == t && x.is_contiguous() ? x : x.to(t).contiguous();
  };
  const at::Tensor queries = as(q, on_amx ? at::kBFloat16 : at::kFloat);
  const at::Tensor table = as(block_table, at::kInt), cu = as(cu_seqlens_q, at::kLong);
  at::Tensor lens = as(kv_lens, at::kLong);
  c10::optional<at::Tensor> bound, ks, vs;
  if (kv_bound.has_value()) bound = as(*kv_bound, at::kLong);
  if (bound.has_value() && !on_amx) {
    // The fp32 path takes bounds as row lengths: a row of one query sees min(len, bound) keys.
    // A row of several queries needs its tokens as rows of their own (the caller's rewrite).
    const int64_t rows = lens.size(0);
    if (cu.size(0) != rows + 1 || bound->size(0) != q.size(0)) return std::nullopt;
    const int64_t* cp = cu.data_ptr<int64_t>();
    const int64_t* bp = bound->data_ptr<int64_t>();
    const int64_t* lp = lens.data_ptr<int64_t>();
    at::Tensor capped = at::empty({rows}, lens.options());
    int64_t* out_lens = capped.data_ptr<int64_t>();
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t lq = cp[r + 1] - cp[r];
      if (lq > 1) return std::nullopt;
      out_lens[r] = lq == 1 ? std::min(lp[r], bp[cp[r]]) : lp[r];
    }
    lens = capped;
    bound.reset();
  }
  if (k_scales.has_value()) ks = as(*k_scales, at::kFloat);
  if (v_scales.has_value()) vs = as(*v_scales, at::kFloat);
  if (chunk_tokens <= 0) {
    const int64_t threads = at::get_num_threads(), items = std::max<int64_t>(1, lens.size(0)) * k_cache.size(2);
    if (threads <= 1 || items >= 4 * threads) {
      chunk_tokens = int64_t(1) << 40;  // no request reaches it: each is one chunk
    } else {
      const int64_t* lp = lens.data_ptr<int64_t>();
      const int64_t longest = lens.numel() ? *std::max_element(lp, lp + lens.numel()) : 0;
      const int64_t splits = (4 * threads + items - 1) / items;
      chunk_tokens = std::max<int64_t>(kMinChunkTokens, (longest + splits - 1) / splits);
    }
  }
  const int64_t tq = q.size(0), hq = q.size(1), dv = v_cache.size(3);
  at::Tensor out = at::zeros({tq, hq, dv}, q.options().dtype(at::kFloat));
  at::Tensor lse = at::full({tq, hq}, -INFINITY, q.options().dtype(at::kFloat));
  if (!paged_decode(queries, k_cache, v_cache, ks, vs, table, cu, lens, scale, out, lse, chunk_tokens,
                    prefetch_blocks, scale_group, bound))
    return std::nullopt;
  return std::make_tuple(qt == at::kFloat ? out : out.to(qt), lse);
}

// The KV dtypes this build reads (bf16 and fp8 need AVX-512 or AVX2 + FMA).
std::vector<std::string> kv_dtypes() {
#if DCPGRAPH_SIMD
  return {"float32", "bfloat16", "float8_e4m3fn"};
#else
  return {"float32"};
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "paged decode attention (fp32/bf16/fp8 KV, in-place block-table reads)");
  m.def("kv_dtypes", &kv_dtypes, "KV cache dtypes this build reads");
  m.def("kv_cache_write_fp8", &kv_write::kv_cache_write_fp8,
        "quantise rows to e4m3 with power-of-two group scales and write them (false: not dense rows)");
  m.def("amx_status", &amx_status, "empty if bf16 queries can take the AMX path, else why not");
  m.def("merge_attention", &merge_lse::merge_attention,
        "exact LSE merge of N partials (None: not this kernel's inputs; the reference runs)");
  m.def("rescale_to_global", &merge_lse::rescale_to_global,
        "this rank's partial scaled to its share of the merge (None: not this kernel's inputs)");
}
