// AMX-BF16 paged decode for bf16 queries over bf16 or fp8 KV caches (one work item at a time).
//
// Included by paged_decode.cpp after its AVX-512 loaders (LoadFP8) and exp512; compiled only when
// the compiler targets AMX-BF16 (DCPGRAPH_HAVE_AMX). The process must have been granted the AMX
// tile state (permission_error() asks the OS once); every thread loads its tile configuration
// before its first item (configure()) and releases it after its last.
//
// For one item (request, KV head, key range) with M = G * lq query rows, in groups of 16 columns
// (a query-row group "mg"), over key groups of 32 tokens:
//   scores   S^T[t, n] = K[t, :] . Q[n, :]            (A = 16 key rows read in place from the
//            cache with its row stride, or staged as bf16 when they are not 16 rows of one block,
//            the width is not a multiple of 32, or the cache is fp8; B = the queries in VNNI
//            layout, built once per item)
//   softmax  online, per query column, in fp32: m' = max(m, max_t s), p = exp(s - m'),
//            l' = l e^(m - m') + sum_t p, O <- O e^(m - m')
//   values   O[n, :] += P[n, t] V[t, :]                 (A = P rounded to bf16, transposed to
//            [n, t]; B = V rows staged token-pair interleaved (VNNI), 32 tokens per step)
// P is rounded to bf16 for the value product only (as flash attention does for bf16 models); the
// normaliser l sums the fp32 p. Scores accumulate in fp32 from exact bf16 products, so the LSE
// matches an fp32 reference on the same bf16 values to fp32 rounding; the output carries P's
// bf16 rounding (relative error ~2^-9 per weight, averaged over the keys).
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512F__)
#define DCPGRAPH_HAVE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace amx {

constexpr int64_t TOK = 32;   // tokens per key group (one value-product step)
constexpr int64_t COLS = 16;  // query rows per query-row group (a tile's fp32 columns)
constexpr int64_t TILE_ELEMS = 16 * 32;  // bf16 elements in one 16 x 64-byte tile

// Empty when this process may use AMX tiles; otherwise why not (asked once per process).
inline const std::string& permission_error() {
  static const std::string err = [] {
    constexpr long kReqXcompPerm = 0x1023;  // ARCH_REQ_XCOMP_PERM
    constexpr long kXtiledata = 18;         // XFEATURE_XTILEDATA
    if (syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) != 0)
      return std::string("the OS refused the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM: ") +
             std::strerror(errno) + ")";
    return std::string();
  }();
  return err;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-7 all 16 rows x 64 bytes. 0,1: score accumulators; 2,3: key rows; 4: queries (VNNI);
// 5: P [n, t]; 6: values (VNNI); 7: output accumulator. The configuration lives in static storage
// and a compiler barrier precedes the load: gcc's _tile_loadconfig tells the compiler it reads
// only 8 bytes, so a stack copy's other stores could be dropped or sunk past it.
inline void configure() {
  static const TileConfig config = [] {
    TileConfig c;
    for (int i = 0; i < 8; ++i) {
      c.colsb[i] = 64;
      c.rows[i] = 16;
    }
    return c;
  }();
  asm volatile("" ::: "memory");
  _tile_loadconfig(&config);
}

// Everything one item needs to know about the caches and the request batch.
template <class T>
struct Caches {
  const uint16_t* q;  // bf16 [T, Hq, d]
  int64_t hq, g, d, dv, bsz, width;
  const int32_t* table;
  const int64_t* cu;
  const T* kp;
  const T* vp;
  int64_t ks0, ks1, ks2, vs0, vs1, vs2;
  const float* ksp;  // fp8 scales [NB, B, H, groups] (unused for bf16)
  const float* vsp;
  int64_t kss0, kss1, kss2, vss0, vss1, vss2, group;
  bool value_prefix;
  float scale;
  int64_t prefetch_blocks;
};

// Per-thread buffers and the item loop body. ``T``: uint16_t (bf16 cache) or uint8_t (fp8).
template <class T>
class Decoder {
 public:
  static constexpr bool kFp8 = std::is_same_v<T, uint8_t>;

  Decoder(const Caches<T>& c, int64_t max_m)
      : c_(c), dp_((c.d + 31) / 32 * 32), dvp_((c.dv + 31) / 32 * 32), mgroups_((max_m + COLS - 1) / COLS),
        qv_(mgroups_ * (dp_ / 32) * TILE_ELEMS), kst_(TOK * dp_), vrows_(kFp8 && !c.value_prefix ? TOK * dvp_ : 0),
        vst_((dvp_ / 16) * TILE_ELEMS), pt_(mgroups_ * TILE_ELEMS), s_(TOK * COLS),
        o_(mgroups_ * COLS * dvp_), mx_(mgroups_ * COLS), sm_(mgroups_ * COLS) {}

  // Keys [t0, t1) of request r, KV head h: unnormalised acc [m, dv], running max and sum [m].
  void run(int64_t r, int64_t h, int64_t t0, int64_t t1, float* acc, float* mx, float* sm) {
    const int64_t lq = c_.cu[r + 1] - c_.cu[r], m = lq * c_.g, mg = (m + COLS - 1) / COLS;
    build_queries(r, h, lq, mg);
    std::fill(o_.begin(), o_.begin() + mg * COLS * dvp_, 0.f);
    std::fill(mx_.begin(), mx_.begin() + mg * COLS, -INFINITY);
    std::fill(sm_.begin(), sm_.begin() + mg * COLS, 0.f);
    for (int64_t t = t0; t < t1; t += TOK) {
      const int64_t nt = std::min(TOK, t1 - t);
      prefetch(r, h, t, t1);
      const uint16_t* krow[2];
      int64_t kstride[2];
      key_rows(r, h, t, nt, krow, kstride);
      for (int64_t j = 0; j < mg; ++j) {
        scores(krow, kstride, nt, j);
        softmax(nt, j);
      }
      stage_values(r, h, t, nt, krow, kstride);
      values(mg);
    }
    for (int64_t i = 0; i < m; ++i) {
      const float* src = o_.data() + (i / COLS) * COLS * dvp_ + (i % COLS) * dvp_;
      std::copy(src, src + c_.dv, acc + i * c_.dv);
      mx[i] = mx_[i];
      sm[i] = sm_[i];
    }
  }

 private:
  // Queries of (r, h) as B tiles: qv[j][kk] is [16 pairs of d][16 columns x 2] bf16, column n of
  // group j holding query row 16 j + n (row jr * g + gi: token jr, head h * g + gi); zero padded.
  void build_queries(int64_t r, int64_t h, int64_t lq, int64_t mg) {
    const int64_t ksteps = dp_ / 32;
    std::fill(qv_.begin(), qv_.begin() + mg * ksteps * TILE_ELEMS, uint16_t(0));
    for (int64_t jr = 0; jr < lq; ++jr)
      for (int64_t gi = 0; gi < c_.g; ++gi) {
        const int64_t i = jr * c_.g + gi, n = i % COLS;
        const uint16_t* src = c_.q + ((c_.cu[r] + jr) * c_.hq + h * c_.g + gi) * c_.d;
        uint16_t* dst = qv_.data() + (i / COLS) * ksteps * TILE_ELEMS;
        for (int64_t x = 0; x < c_.d; ++x)
          dst[(x / 32) * TILE_ELEMS + ((x % 32) / 2) * 32 + n * 2 + (x % 2)] = src[x];
      }
  }

  const T* key_ptr(int64_t r, int64_t h, int64_t u) const {
    const int64_t blk = c_.table[r * c_.width + u / c_.bsz];
    return c_.kp + blk * c_.ks0 + (u % c_.bsz) * c_.ks1 + h * c_.ks2;
  }
  const T* value_ptr(int64_t r, int64_t h, int64_t u) const {
    const int64_t blk = c_.table[r * c_.width + u / c_.bsz];
    return c_.vp + blk * c_.vs0 + (u % c_.bsz) * c_.vs1 + h * c_.vs2;
  }
  const float* scale_ptr(const float* base, int64_t s0, int64_t s1, int64_t s2, int64_t r, int64_t h,
                         int64_t u) const {
    const int64_t blk = c_.table[r * c_.width + u / c_.bsz];
    return base + blk * s0 + (u % c_.bsz) * s1 + h * s2;
  }

  // Row u of a cache as dp-wide bf16 (fp8: times its scales, rounded to bf16), zero padded.
  void to_bf16(const T* row, const float* sc, int64_t width, int64_t padded, uint16_t* dst) const {
    for (int64_t x = 0; x < padded; x += 16) {
      const __mmask16 mk = x >= width ? 0 : width - x >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (width - x)) - 1u);
      if constexpr (kFp8) {
        const __m512 v = LoadFP8::load(row, sc, x, mk, c_.group);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + x), (__m256i)_mm512_cvtneps_pbh(v));
      } else {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + x), _mm256_maskz_loadu_epi16(mk, row + x));
      }
    }
  }

  // The key rows of tokens [t, t + nt) as two 16-row A operands (base, byte stride): in place when
  // 16 rows of one block are bf16 and 32-multiple wide (rows past nt are read but masked),
  // otherwise staged as bf16 (rows past nt zero).
  void key_rows(int64_t r, int64_t h, int64_t t, int64_t nt, const uint16_t** krow, int64_t* kstride) {
    for (int half = 0; half < 2; ++half) {
      const int64_t u0 = t + half * 16, cnt = std::max<int64_t>(0, std::min<int64_t>(16, t + nt - u0));
      krow[half] = nullptr;
      kstride[half] = 0;
      if (cnt == 0) continue;
      if constexpr (!kFp8) {
        if (c_.d % 32 == 0 && u0 % c_.bsz + 16 <= c_.bsz) {
          krow[half] = reinterpret_cast<const uint16_t*>(key_ptr(r, h, u0));
          kstride[half] = c_.ks1 * 2;
          continue;
        }
      }
      uint16_t* dst = kst_.data() + half * 16 * dp_;
      for (int64_t i = 0; i < 16; ++i) {
        if (i < cnt) {
          const float* sc = kFp8 ? scale_ptr(c_.ksp, c_.kss0, c_.kss1, c_.kss2, r, h, u0 + i) : nullptr;
          to_bf16(key_ptr(r, h, u0 + i), sc, c_.d, dp_, dst + i * dp_);
        } else {
          std::fill(dst + i * dp_, dst + (i + 1) * dp_, uint16_t(0));
        }
      }
      krow[half] = dst;
      kstride[half] = dp_ * 2;
    }
  }

  // s_[t, n] = K[t, :] . Q[16 j + n, :] for the key group (fp32, 32 x 16).
  void scores(const uint16_t* const* krow, const int64_t* kstride, int64_t nt, int64_t j) {
    const int64_t ksteps = dp_ / 32;
    const uint16_t* qb = qv_.data() + j * ksteps * TILE_ELEMS;
    const bool two = nt > 16;
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t kk = 0; kk < ksteps; ++kk) {
      _tile_loadd(4, qb + kk * TILE_ELEMS, 64);
      _tile_loadd(2, krow[0] + kk * 32, kstride[0]);
      _tile_dpbf16ps(0, 2, 4);
      if (two) {
        _tile_loadd(3, krow[1] + kk * 32, kstride[1]);
        _tile_dpbf16ps(1, 3, 4);
      }
    }
    _tile_stored(0, s_.data(), 64);
    _tile_stored(1, s_.data() + 16 * COLS, 64);
  }

  // Online softmax of the key group for query-row group j (lanes = query rows), then P^T as the
  // bf16 A operand pt_[j] ([16 rows][32 tokens], tokens past nt zero).
  void softmax(int64_t nt, int64_t j) {
    float* s = s_.data();
    const __m512 sc = _mm512_set1_ps(c_.scale);
    __m512 bm = _mm512_set1_ps(-INFINITY);
    for (int64_t t = 0; t < nt; ++t) {
      const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(s + t * COLS), sc);
      _mm512_storeu_ps(s + t * COLS, x);
      bm = _mm512_max_ps(bm, x);
    }
    float* mxp = mx_.data() + j * COLS;
    float* smp = sm_.data() + j * COLS;
    const __m512 old = _mm512_loadu_ps(mxp);
    const __m512 nm = _mm512_max_ps(old, bm);
    const __mmask16 grew = _mm512_cmp_ps_mask(nm, old, _CMP_GT_OQ) & _mm512_cmp_ps_mask(old, old, _CMP_ORD_Q) &
                           _mm512_cmp_ps_mask(old, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
    if (grew) {  // rescale the rows whose running max rose (rows that had no keys yet hold zeros)
      const __m512 alpha = exp512(_mm512_sub_ps(old, nm));
      alignas(64) float a[COLS];
      _mm512_store_ps(a, alpha);
      _mm512_storeu_ps(smp, _mm512_mask_mul_ps(_mm512_loadu_ps(smp), grew, _mm512_loadu_ps(smp), alpha));
      float* o = o_.data() + j * COLS * dvp_;
      for (int n = 0; n < COLS; ++n) {
        if (!((grew >> n) & 1)) continue;
        const __m512 an = _mm512_set1_ps(a[n]);
        float* on = o + n * dvp_;
        for (int64_t x = 0; x < dvp_; x += 16) _mm512_storeu_ps(on + x, _mm512_mul_ps(_mm512_loadu_ps(on + x), an));
      }
    }
    _mm512_storeu_ps(mxp, nm);
    __m512 tot = _mm512_setzero_ps();
    for (int64_t t = 0; t < TOK; ++t) {
      __m512 p = _mm512_setzero_ps();
      if (t < nt) p = exp512(_mm512_sub_ps(_mm512_loadu_ps(s + t * COLS), nm));
      _mm512_storeu_ps(s + t * COLS, p);
      tot = _mm512_add_ps(tot, p);
    }
    _mm512_storeu_ps(smp, _mm512_add_ps(_mm512_loadu_ps(smp), tot));
    // Transpose [32 t][16 n] fp32 -> [16 n][32 t] bf16: row n gathers column n of both halves.
    const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                           _mm512_set1_epi32(COLS));
    uint16_t* pt = pt_.data() + j * TILE_ELEMS;
    for (int n = 0; n < COLS; ++n) {
      const __m512 lo = _mm512_i32gather_ps(idx, s + n, 4);
      const __m512 hi = _mm512_i32gather_ps(idx, s + 16 * COLS + n, 4);
      _mm512_storeu_si512(pt + n * 32, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
  }

  // V rows of the key group as B tiles vst_[c] ([16 token pairs][16 columns x 2], columns 16 c..):
  // element (p, 2 x + e) = V[2 p + e, 16 c + x]; rows past nt zero. MLA's values are the first dv
  // columns of the key rows (in place or as staged); fp8 values are dequantised to bf16 first.
  void stage_values(int64_t r, int64_t h, int64_t t, int64_t nt, const uint16_t* const* krow,
                    const int64_t* kstride) {
    const uint16_t* rows[TOK];
    for (int64_t i = 0; i < TOK; ++i) {
      if (i >= nt) {
        rows[i] = nullptr;
      } else if (c_.value_prefix) {
        rows[i] = reinterpret_cast<const uint16_t*>(reinterpret_cast<const char*>(krow[i / 16]) +
                                                    (i % 16) * kstride[i / 16]);
      } else if constexpr (kFp8) {
        uint16_t* dst = vrows_.data() + i * dvp_;
        to_bf16(value_ptr(r, h, t + i), scale_ptr(c_.vsp, c_.vss0, c_.vss1, c_.vss2, r, h, t + i), c_.dv, dvp_, dst);
        rows[i] = dst;
      } else {
        rows[i] = reinterpret_cast<const uint16_t*>(value_ptr(r, h, t + i));
      }
    }
    const __m512i lo_idx = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38,
                                            6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi_idx = _mm512_add_epi16(lo_idx, _mm512_set1_epi16(16));
    for (int64_t p = 0; p < TOK / 2; ++p) {
      const uint16_t* a = rows[2 * p];
      const uint16_t* b = rows[2 * p + 1];
      for (int64_t x = 0; x < dvp_; x += 32) {
        const __mmask32 mk = x >= c_.dv ? 0 : c_.dv - x >= 32 ? 0xFFFFFFFFu : static_cast<__mmask32>((1u << (c_.dv - x)) - 1u);
        const __m512i va = a ? _mm512_maskz_loadu_epi16(mk, a + x) : _mm512_setzero_si512();
        const __m512i vb = b ? _mm512_maskz_loadu_epi16(mk, b + x) : _mm512_setzero_si512();
        uint16_t* dst = vst_.data() + (x / 16) * TILE_ELEMS + p * 32;
        _mm512_storeu_si512(dst, _mm512_permutex2var_epi16(va, lo_idx, vb));
        _mm512_storeu_si512(dst + TILE_ELEMS, _mm512_permutex2var_epi16(va, hi_idx, vb));
      }
    }
  }

  // O[j][n, 16 c ..] += P[j][n, :] . V[:, 16 c ..] for every query-row group j and column tile c.
  void values(int64_t mg) {
    const int64_t ctiles = dvp_ / 16, ostride = dvp_ * 4;
    for (int64_t j = 0; j < mg; ++j) {
      _tile_loadd(5, pt_.data() + j * TILE_ELEMS, 64);
      float* o = o_.data() + j * COLS * dvp_;
      for (int64_t c = 0; c < ctiles; ++c) {
        _tile_loadd(7, o + c * 16, ostride);
        _tile_loadd(6, vst_.data() + c * TILE_ELEMS, 64);
        _tile_dpbf16ps(7, 5, 6);
        _tile_stored(7, o + c * 16, ostride);
      }
    }
  }

  // Software prefetch of the rows prefetch_blocks blocks ahead (a scattered table hides the next
  // address from the hardware prefetcher).
  void prefetch(int64_t r, int64_t h, int64_t t, int64_t t1) const {
    if (c_.prefetch_blocks <= 0) return;
    const int64_t ahead = t + c_.prefetch_blocks * std::max<int64_t>(c_.bsz, TOK);
    for (int64_t u = ahead; u < std::min(ahead + TOK, t1); ++u) {
      const char* pk = reinterpret_cast<const char*>(key_ptr(r, h, u));
      for (int64_t b = 0; b < c_.d * int64_t(sizeof(T)); b += 64) __builtin_prefetch(pk + b, 0, 2);
      if (!c_.value_prefix) {
        const char* pv = reinterpret_cast<const char*>(value_ptr(r, h, u));
        for (int64_t b = 0; b < c_.dv * int64_t(sizeof(T)); b += 64) __builtin_prefetch(pv + b, 0, 2);
      }
    }
  }

  const Caches<T>& c_;
  const int64_t dp_, dvp_, mgroups_;
  std::vector<uint16_t> qv_, kst_, vrows_, vst_, pt_;
  std::vector<float> s_, o_, mx_, sm_;
};

}  // namespace amx
#endif
