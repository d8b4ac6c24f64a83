// AMX-BF16 paged decode for bf16 queries over bf16 or fp8 KV caches (one work item at a time).
//
// Included by paged_decode.cpp (outside its anonymous namespace, after the AVX-512 helpers exp512
// and Item); compiled only when the compiler targets AMX-BF16 (DCPGRAPH_HAVE_AMX). The process
// must have been granted the AMX tile state (permission_error() asks the OS once); every thread
// loads its tile configuration before its first item (configure()) and releases it after its
// last. One file over the project's ~450-line guide: the Decoder's phases share its per-thread
// buffers and the tile-register roles, which splitting would scatter.
//
// For one item (request, KV head, key range) with M = G * lq query rows, in groups of 16 columns
// (a query-row group), over key groups of 64 tokens:
//   scores   S^T[t, n] = K[t, :] . Q[n, :]            (A = 16 key rows read in place from the
//            cache with its row stride, or staged as bf16 when they are not 16 rows of one block,
//            the width is not a multiple of 32, or the cache is fp8; B = the queries in VNNI
//            layout, built once per item; four 16-token score tiles per step)
//   softmax  online, per query column, in fp32: m' = max(m, max_t s), p = exp(s - m'),
//            l' = l e^(m - m') + sum_t p, O <- O e^(m - m')
//   values   O[n, :] += P[n, t] V[t, :]                 (A = P rounded to bf16, transposed to
//            [n, t] in registers; B = 64 columns of V rows at a time, token pairs interleaved,
//            staged in an 8 KiB L1 buffer; four independent output tiles)
// P is rounded to bf16 for the value product only (as flash attention does for bf16 models); the
// normaliser l sums the fp32 p. Scores accumulate in fp32 from exact bf16 products, so the LSE
// matches an fp32 reference on the same bf16 values to fp32 rounding; the output carries P's
// bf16 rounding (relative error ~2^-9 per weight, averaged over the keys). fp8 bytes become bf16
// exactly; their scales multiply the fp32 partial scores of their group (keys) and the weights
// before rounding (values), so fp8 costs no precision beyond bf16's.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512F__)
#define DCPGRAPH_HAVE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace amx {

constexpr int64_t TOK = 64;   // tokens per key group (two 32-token value-product steps)
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

// 32 e4m3fn bytes (masked lanes zero) as 32 bf16, exactly: normals move their exponent and
// mantissa bits into bf16's fields (bias 7 -> 127), subnormals m * 2^-9 come from a table.
inline __m512i fp8_to_bf16(const uint8_t* src, __mmask32 mk) {
  const __m512i x = _mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(mk, src));
  const __m512i em = _mm512_and_si512(x, _mm512_set1_epi16(0x7F));
  const __m512i normal = _mm512_add_epi16(_mm512_slli_epi16(em, 4), _mm512_set1_epi16(120 << 7));
  const __m512i sub_table = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                             0x3C60, 0x3C40, 0x3C20, 0x3C00, 0x3BC0, 0x3B80, 0x3B00, 0);
  const __m512i sub = _mm512_permutexvar_epi16(em, sub_table);
  const __m512i v = _mm512_mask_blend_epi16(_mm512_cmplt_epu16_mask(em, _mm512_set1_epi16(8)), normal, sub);
  return _mm512_or_si512(v, _mm512_slli_epi16(_mm512_and_si512(x, _mm512_set1_epi16(0x80)), 8));
}

inline __mmask32 mask32(int64_t width, int64_t x) {
  return x >= width ? 0 : width - x >= 32 ? 0xFFFFFFFFu : static_cast<__mmask32>((1u << (width - x)) - 1u);
}

// Per-thread buffers and the item loop body. ``T``: uint16_t (bf16 cache) or uint8_t (fp8: the
// stored bytes become bf16 exactly; each scale group's scale multiplies its partial scores
// (keys) or the softmax weights before their bf16 rounding (values), so no value is rounded
// twice).
template <class T>
class Decoder {
 public:
  static constexpr bool kFp8 = std::is_same_v<T, uint8_t>;
  static constexpr int64_t KS = TOK / 32;  // value-product steps (32 tokens) per key group

  Decoder(const Caches<T>& c, int64_t max_m)
      : c_(c), dp_((c.d + 31) / 32 * 32), dvp_((c.dv + 31) / 32 * 32), ostride_(dvp_ + 16),
        mgroups_((max_m + COLS - 1) / COLS), kgroups_(kFp8 ? (c.d + c.group - 1) / c.group : 1),
        vgroups_(kFp8 ? (c.dv + c.group - 1) / c.group : 1), qv_(mgroups_ * (dp_ / 32) * TILE_ELEMS),
        kst_(TOK * dp_), vst_(2 * 4 * KS * TILE_ELEMS),
        pt_(mgroups_ * vgroups_ * KS * TILE_ELEMS), s_(TOK * COLS), part_(kFp8 ? TOK * COLS : 0), 
        ksc_(kFp8 ? TOK * kgroups_ : 0), vsc_(kFp8 ? vgroups_ * TOK : 0), o_(mgroups_ * COLS * ostride_),
        mx_(mgroups_ * COLS), sm_(mgroups_ * COLS) {}

  // Keys [t0, t1) of request r, KV head h: unnormalised acc [m, dv], running max and sum [m].
  void run(int64_t r, int64_t h, int64_t t0, int64_t t1, float* acc, float* mx, float* sm) {
    const int64_t lq = c_.cu[r + 1] - c_.cu[r], m = lq * c_.g, mg = (m + COLS - 1) / COLS;
    build_queries(r, h, lq, mg);
    std::fill(o_.begin(), o_.begin() + mg * COLS * ostride_, 0.f);
    std::fill(mx_.begin(), mx_.begin() + mg * COLS, -INFINITY);
    std::fill(sm_.begin(), sm_.begin() + mg * COLS, 0.f);
    for (int64_t t = t0; t < t1; t += TOK) {
      const int64_t nt = std::min(TOK, t1 - t);
      prefetch(r, h, t, t1);
      const uint16_t* krow[TOK / 16];
      int64_t kstride[TOK / 16];
      locate(r, t, nt);
      key_rows(r, h, t, nt, krow, kstride);
      value_rows(r, h, t, nt, krow, kstride);
      for (int64_t j = 0; j < mg; ++j) {
        scores(krow, kstride, nt, j);
        softmax(nt, j);
      }
      values(mg);
    }
    for (int64_t i = 0; i < m; ++i) {  // undo the staging's column order (stage_chunk)
      const float* src = o_.data() + (i / COLS) * COLS * ostride_ + (i % COLS) * ostride_;
      float* dst = acc + i * c_.dv;
      // column x + 8 a + 4 b + c of the output sits at x + 16 b + 4 a + c of the accumulator
      const __m512i lo = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
      const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
      for (int64_t x = 0; x < c_.dv; x += 32) {
        const __m512 a = _mm512_loadu_ps(src + x), b = _mm512_loadu_ps(src + x + 16);
        const int64_t left = c_.dv - x;
        const __mmask16 m0 = left >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1u);
        const __mmask16 m1 = left >= 32 ? 0xFFFF : left <= 16 ? 0 : static_cast<__mmask16>((1u << (left - 16)) - 1u);
        _mm512_mask_storeu_ps(dst + x, m0, _mm512_permutex2var_ps(a, lo, b));
        _mm512_mask_storeu_ps(dst + x + 16, m1, _mm512_permutex2var_ps(a, hi, b));
      }
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
        int32_t* dst = reinterpret_cast<int32_t*>(qv_.data() + (i / COLS) * ksteps * TILE_ELEMS);
        // dword (2 elements) p of each 32-element step goes to row p, column n of its tile
        const __m512i at = _mm512_add_epi32(_mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11,
                                                                                 12, 13, 14, 15),
                                                               _mm512_set1_epi32(16)),
                                            _mm512_set1_epi32(static_cast<int32_t>(n)));
        for (int64_t x = 0; x < c_.d; x += 32)
          _mm512_i32scatter_epi32(dst + (x / 32) * (TILE_ELEMS / 2), at, _mm512_maskz_loadu_epi16(mask32(c_.d, x), src + x), 4);
      }
  }

  // blk_[i], off_[i]: physical block and slot of token t + i (i < n), walking the table with one
  // division per call (a division per token cost more than the rest of the bookkeeping).
  void locate(int64_t r, int64_t t, int64_t n) {
    int64_t b = t / c_.bsz, off = t % c_.bsz;
    const int32_t* row = c_.table + r * c_.width;
    for (int64_t i = 0; i < n; ++i) {
      blk_[i] = row[b];
      off_[i] = off;
      if (++off == c_.bsz) {
        off = 0;
        ++b;
      }
    }
  }
  const T* key_at(int64_t h, int64_t i) const { return c_.kp + blk_[i] * c_.ks0 + off_[i] * c_.ks1 + h * c_.ks2; }
  const T* value_at(int64_t h, int64_t i) const { return c_.vp + blk_[i] * c_.vs0 + off_[i] * c_.vs1 + h * c_.vs2; }

  // ``width`` elements of a cache row as ``padded`` bf16 (fp8: exact, unscaled), zero padded.
  static void to_bf16(const T* row, int64_t width, int64_t padded, uint16_t* dst) {
    for (int64_t x = 0; x < padded; x += 32) {
      const __mmask32 mk = mask32(width, x);
      __m512i v;
      if constexpr (kFp8) v = fp8_to_bf16(row + x, mk);
      else v = _mm512_maskz_loadu_epi16(mk, row + x);
      _mm512_storeu_si512(dst + x, v);
    }
  }

  // The key rows of tokens [t, t + nt) as 16-row A operands (base, byte stride): in place when
  // 16 rows of one block are bf16 and 32-multiple wide (rows past nt are read but masked),
  // otherwise staged as bf16 (rows past nt zero). fp8: the rows' scales go to ksc_[t][group].
  void key_rows(int64_t r, int64_t h, int64_t t, int64_t nt, const uint16_t** krow, int64_t* kstride) {
    for (int64_t qi = 0; qi < TOK / 16; ++qi) {
      const int64_t u0 = t + qi * 16, cnt = std::max<int64_t>(0, std::min<int64_t>(16, t + nt - u0));
      krow[qi] = nullptr;
      kstride[qi] = 0;
      if (cnt == 0) continue;
      if constexpr (!kFp8) {
        if (c_.d % 32 == 0 && off_[qi * 16] + 16 <= c_.bsz) {
          krow[qi] = reinterpret_cast<const uint16_t*>(key_at(h, qi * 16));
          kstride[qi] = c_.ks1 * 2;
          continue;
        }
      }
      uint16_t* dst = kst_.data() + qi * 16 * dp_;
      for (int64_t i = 0; i < 16; ++i) {
        if (i < cnt) {
          to_bf16(key_at(h, qi * 16 + i), c_.d, dp_, dst + i * dp_);
          if constexpr (kFp8) {
            const int64_t e = qi * 16 + i;
            const float* sc = c_.ksp + blk_[e] * c_.kss0 + off_[e] * c_.kss1 + h * c_.kss2;
            std::copy(sc, sc + kgroups_, ksc_.data() + e * kgroups_);
          }
        } else {
          std::fill(dst + i * dp_, dst + (i + 1) * dp_, uint16_t(0));
          if constexpr (kFp8) std::fill_n(ksc_.data() + (qi * 16 + i) * kgroups_, kgroups_, 0.f);
        }
      }
      krow[qi] = dst;
      kstride[qi] = dp_ * 2;
    }
  }

  // s_[t, n] = K[t, :] . Q[16 j + n, :] for the key group (fp32, 64 x 16). fp8: per scale group
  // g the partial product over its columns, times the key row's scale for g.
  void scores(const uint16_t* const* krow, const int64_t* kstride, int64_t nt, int64_t j) {
    const int64_t ksteps = dp_ / 32, per = kFp8 ? c_.group / 32 : ksteps;
    const uint16_t* qb = qv_.data() + j * ksteps * TILE_ELEMS;
    const int64_t nq = (nt + 15) / 16;
    for (int64_t g = 0; g < kgroups_; ++g) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t kk = g * per; kk < std::min(ksteps, (g + 1) * per); ++kk) {
        _tile_loadd(4, qb + kk * TILE_ELEMS, 64);
        _tile_loadd(5, krow[0] + kk * 32, kstride[0]);
        _tile_dpbf16ps(0, 5, 4);
        if (nq > 1) {
          _tile_loadd(6, krow[1] + kk * 32, kstride[1]);
          _tile_dpbf16ps(1, 6, 4);
        }
        if (nq > 2) {
          _tile_loadd(5, krow[2] + kk * 32, kstride[2]);
          _tile_dpbf16ps(2, 5, 4);
        }
        if (nq > 3) {
          _tile_loadd(6, krow[3] + kk * 32, kstride[3]);
          _tile_dpbf16ps(3, 6, 4);
        }
      }
      float* dst = kFp8 ? part_.data() : s_.data();
      _tile_stored(0, dst, 64);
      _tile_stored(1, dst + 16 * COLS, 64);
      _tile_stored(2, dst + 32 * COLS, 64);
      _tile_stored(3, dst + 48 * COLS, 64);
      if constexpr (kFp8) {
        for (int64_t t = 0; t < nt; ++t) {
          const __m512 w = _mm512_set1_ps(ksc_[t * kgroups_ + g]);
          const __m512 p = _mm512_loadu_ps(part_.data() + t * COLS);
          const __m512 prev = g == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(s_.data() + t * COLS);
          _mm512_storeu_ps(s_.data() + t * COLS, _mm512_fmadd_ps(p, w, prev));
        }
      }
    }
  }

  // Online softmax of the key group for query-row group j (lanes = query rows), then P as the
  // bf16 A operands pt_[j][vg][ks] ([16 rows][32 tokens], tokens past nt zero; fp8: the weights
  // times the value rows' scales of value group vg, before rounding).
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
    const __mmask16 grew = _mm512_cmp_ps_mask(nm, old, _CMP_GT_OQ) &
                           _mm512_cmp_ps_mask(old, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
    if (grew) {  // rescale the rows whose running max rose (rows that had no keys yet hold zeros)
      const __m512 alpha = exp512(_mm512_sub_ps(old, nm));
      alignas(64) float a[COLS];
      _mm512_store_ps(a, alpha);
      _mm512_storeu_ps(smp, _mm512_mask_mul_ps(_mm512_loadu_ps(smp), grew, _mm512_loadu_ps(smp), alpha));
      float* o = o_.data() + j * COLS * ostride_;
      for (int n = 0; n < COLS; ++n) {
        if (!((grew >> n) & 1)) continue;
        const __m512 an = _mm512_set1_ps(a[n]);
        float* on = o + n * ostride_;
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
    for (int64_t vg = 0; vg < vgroups_; ++vg)
      weights_as_tiles(s, kFp8 ? vsc_.data() + vg * TOK : nullptr, pt_.data() + (j * vgroups_ + vg) * KS * TILE_ELEMS);
  }

  // The A operands P[n, t] (two tiles of [16 rows][32 tokens] bf16) from p [64 t][16 n] fp32,
  // each token's weights times w[t] first when given: token pairs rounded and interleaved into
  // dwords (one row of 16 per pair), then two 16 x 16 dword transposes.
  static void weights_as_tiles(const float* p, const float* w, uint16_t* pt) {
    const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                           21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    for (int64_t ks = 0; ks < KS; ++ks) {
      __m512i r[16];
      for (int i = 0; i < 16; ++i) {
        const int64_t t = ks * 32 + 2 * i;
        __m512 a = _mm512_loadu_ps(p + t * COLS), b = _mm512_loadu_ps(p + (t + 1) * COLS);
        if (w) {
          a = _mm512_mul_ps(a, _mm512_set1_ps(w[t]));
          b = _mm512_mul_ps(b, _mm512_set1_ps(w[t + 1]));
        }
        r[i] = _mm512_permutexvar_epi16(pairs, (__m512i)_mm512_cvtne2ps_pbh(b, a));
      }
      transpose16_epi32(r);
      for (int n = 0; n < 16; ++n) _mm512_storeu_si512(pt + ks * TILE_ELEMS + n * 32, r[n]);
    }
  }

  // r[i][c] -> r[c][i] for a 16 x 16 matrix of 32-bit elements: 32-bit and 64-bit interleaves
  // leave u[4 g + k] with columns 4 L + k of rows 4 g .. 4 g + 3 in 128-bit lane L; a 4 x 4
  // transpose of 128-bit lanes then gathers each column.
  static void transpose16_epi32(__m512i* r) {
    __m512i t[16], u[16];
    for (int i = 0; i < 8; ++i) {
      t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
      t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int g = 0; g < 4; ++g) {
      u[4 * g + 0] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
      u[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
      u[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
      u[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
    }
    for (int k = 0; k < 4; ++k) {
      const __m512i x0 = _mm512_shuffle_i32x4(u[k], u[4 + k], _MM_SHUFFLE(1, 0, 1, 0));
      const __m512i x1 = _mm512_shuffle_i32x4(u[k], u[4 + k], _MM_SHUFFLE(3, 2, 3, 2));
      const __m512i x2 = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], _MM_SHUFFLE(1, 0, 1, 0));
      const __m512i x3 = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], _MM_SHUFFLE(3, 2, 3, 2));
      r[k] = _mm512_shuffle_i32x4(x0, x2, _MM_SHUFFLE(2, 0, 2, 0));
      r[4 + k] = _mm512_shuffle_i32x4(x0, x2, _MM_SHUFFLE(3, 1, 3, 1));
      r[8 + k] = _mm512_shuffle_i32x4(x1, x3, _MM_SHUFFLE(2, 0, 2, 0));
      r[12 + k] = _mm512_shuffle_i32x4(x1, x3, _MM_SHUFFLE(3, 1, 3, 1));
    }
  }

  // The value rows of the key group rows_[t] (null past nt): bf16 rows, MLA's values being the
  // first dv columns of the key rows (in place or as staged); a separate fp8 value cache's rows
  // as stored (load_values converts them), their scales in vsc_[group][t].
  void value_rows(int64_t r, int64_t h, int64_t t, int64_t nt, const uint16_t* const* krow,
                  const int64_t* kstride) {
    const uint16_t** rows = rows_;
    for (int64_t i = 0; i < TOK; ++i) {
      if (i >= nt) {
        rows[i] = nullptr;
      } else if (c_.value_prefix) {
        rows[i] = reinterpret_cast<const uint16_t*>(reinterpret_cast<const char*>(krow[i / 16]) +
                                                    (i % 16) * kstride[i / 16]);
      } else if constexpr (kFp8) {  // stored bytes, converted as stage_chunk loads them
        rows[i] = reinterpret_cast<const uint16_t*>(value_at(h, i));
      } else {
        rows[i] = reinterpret_cast<const uint16_t*>(value_at(h, i));
      }
    }
    if constexpr (kFp8) {
      for (int64_t i = 0; i < TOK; ++i)
        for (int64_t vg = 0; vg < vgroups_; ++vg) {
          float w = 0.f;
          if (i < nt && c_.value_prefix) {
            w = ksc_[i * kgroups_ + vg];
          } else if (i < nt) {
            w = c_.vsp[blk_[i] * c_.vss0 + off_[i] * c_.vss1 + h * c_.vss2 + vg];
          }
          vsc_[vg * TOK + i] = w;
        }
    }
  }

  // Columns [16 c0, 16 (c0 + n)) of the value rows as B tiles vst[c][ks] ([16 token pairs][16
  // columns x 2], tokens 32 ks..; rows past nt zero). One 128-bit-lane interleave per 32
  // columns x: element (p, 2 i + e) of the tile 2 c' (+1) holds V[32 ks + 2 p + e, x + 8 (i / 4)
  // (+ 4) + i % 4], so the output's columns come out in that order (run() undoes it once per item).
  // A chunk (at most 8 tiles, 8 KiB; two buffers) stays in L1 for its products.
  // 32 elements from column x of a value row as bf16: fp8 rows that are not a prefix of the
  // (staged) key rows hold the cache's bytes, converted here.
  __m512i load_values(const uint16_t* row, int64_t x, __mmask32 mk) const {
    if constexpr (kFp8) {
      if (!c_.value_prefix) return fp8_to_bf16(reinterpret_cast<const uint8_t*>(row) + x, mk);
    }
    return _mm512_maskz_loadu_epi16(mk, row + x);
  }

  void stage_chunk(int64_t c0, int64_t n, uint16_t* vst) {
    const int64_t dv = c_.dv;
    for (int64_t pr = 0; pr < TOK / 2; ++pr) {
      const uint16_t* a = rows_[2 * pr];
      const uint16_t* b = rows_[2 * pr + 1];
      const int64_t ks = pr / 16, p = pr % 16;
      for (int64_t c = 0; c < n; c += 2) {
        const int64_t x = (c0 + c) * 16;
        const __mmask32 mk = mask32(dv, x);
        const __m512i va = a ? load_values(a, x, mk) : _mm512_setzero_si512();
        const __m512i vb = b ? load_values(b, x, mk) : _mm512_setzero_si512();
        uint16_t* dst = vst + (c * KS + ks) * TILE_ELEMS + p * 32;
        _mm512_storeu_si512(dst, _mm512_unpacklo_epi16(va, vb));
        _mm512_storeu_si512(dst + KS * TILE_ELEMS, _mm512_unpackhi_epi16(va, vb));
      }
    }
  }

  // O[j][n, 16 c ..] += P[j][n, :] . V[:, 16 c ..]: column tiles four at a time (tiles 2-5 hold
  // four independent accumulators, 0-1 the two 32-token steps of P, 6-7 alternate values).
  template <int N>
  void value_tiles(float* o, int64_t c0, const uint16_t* vst) {  // columns of tiles c0.. staged in vst
    const int64_t st = ostride_ * 4;
    _tile_loadd(2, o + (c0 + 0) * 16, st);
    if (N > 1) _tile_loadd(3, o + (c0 + 1) * 16, st);
    if (N > 2) _tile_loadd(4, o + (c0 + 2) * 16, st);
    if (N > 3) _tile_loadd(5, o + (c0 + 3) * 16, st);
    for (int64_t ks = 0; ks < KS; ++ks) {
      const uint16_t* v = vst + ks * TILE_ELEMS;
      _tile_loadd(6, v + 0 * KS * TILE_ELEMS, 64);
      if (ks == 0) _tile_dpbf16ps(2, 0, 6);
      else _tile_dpbf16ps(2, 1, 6);
      if (N > 1) {
        _tile_loadd(7, v + 1 * KS * TILE_ELEMS, 64);
        if (ks == 0) _tile_dpbf16ps(3, 0, 7);
        else _tile_dpbf16ps(3, 1, 7);
      }
      if (N > 2) {
        _tile_loadd(6, v + 2 * KS * TILE_ELEMS, 64);
        if (ks == 0) _tile_dpbf16ps(4, 0, 6);
        else _tile_dpbf16ps(4, 1, 6);
      }
      if (N > 3) {
        _tile_loadd(7, v + 3 * KS * TILE_ELEMS, 64);
        if (ks == 0) _tile_dpbf16ps(5, 0, 7);
        else _tile_dpbf16ps(5, 1, 7);
      }
    }
    _tile_stored(2, o + (c0 + 0) * 16, st);
    if (N > 1) _tile_stored(3, o + (c0 + 1) * 16, st);
    if (N > 2) _tile_stored(4, o + (c0 + 2) * 16, st);
    if (N > 3) _tile_stored(5, o + (c0 + 3) * 16, st);
  }

  // Column chunks of up to four tiles inside one value scale group: stage, then every query-row
  // group's product (P tiles of that scale group).
  void values(int64_t mg) {
    static_assert(KS == 2, "value_tiles holds the two 32-token steps of P in tiles 0 and 1");
    const int64_t ctiles = dvp_ / 16;
    const int64_t per_group = kFp8 ? c_.group / 16 : ctiles;  // column tiles per value scale group
    auto width = [&](int64_t c) { return std::min<int64_t>({4, ctiles - c, (c / per_group + 1) * per_group - c}); };
    // Double-buffered: chunk c + n is staged before chunk c's tile loads, so the tile unit never
    // waits for vector stores it would read right after they were issued.
    stage_chunk(0, width(0), vst_.data());
    for (int64_t c = 0, buf = 0; c < ctiles; buf ^= 1) {
      const int64_t n = width(c);
      const uint16_t* vst = vst_.data() + buf * 4 * KS * TILE_ELEMS;
      if (c + n < ctiles) stage_chunk(c + n, width(c + n), vst_.data() + (buf ^ 1) * 4 * KS * TILE_ELEMS);
      for (int64_t j = 0; j < mg; ++j) {
        const uint16_t* pt = pt_.data() + (j * vgroups_ + c / per_group) * KS * TILE_ELEMS;
        _tile_loadd(0, pt, 64);
        _tile_loadd(1, pt + TILE_ELEMS, 64);
        float* o = o_.data() + j * COLS * ostride_;
        if (n == 4) value_tiles<4>(o, c, vst);
        else value_tiles<2>(o, c, vst);
      }
      c += n;
    }
  }

  // Software prefetch of the rows prefetch_blocks blocks ahead (a scattered table hides the next
  // address from the hardware prefetcher).
  void prefetch(int64_t r, int64_t h, int64_t t, int64_t t1) const {
    if (c_.prefetch_blocks <= 0) return;
    const int64_t ahead = t + c_.prefetch_blocks * std::max<int64_t>(c_.bsz, TOK);
    const int32_t* row = c_.table + r * c_.width;
    int64_t blk = ahead / c_.bsz, off = ahead % c_.bsz;
    for (int64_t u = ahead; u < std::min(ahead + TOK, t1); ++u) {
      const char* pk = reinterpret_cast<const char*>(c_.kp + row[blk] * c_.ks0 + off * c_.ks1 + h * c_.ks2);
      for (int64_t b = 0; b < c_.d * int64_t(sizeof(T)); b += 64) __builtin_prefetch(pk + b, 0, 2);
      if (!c_.value_prefix) {
        const char* pv = reinterpret_cast<const char*>(c_.vp + row[blk] * c_.vs0 + off * c_.vs1 + h * c_.vs2);
        for (int64_t b = 0; b < c_.dv * int64_t(sizeof(T)); b += 64) __builtin_prefetch(pv + b, 0, 2);
      }
      if (++off == c_.bsz) {
        off = 0;
        ++blk;
      }
    }
  }

  const Caches<T>& c_;
  const int64_t dp_, dvp_, ostride_, mgroups_, kgroups_, vgroups_;
  std::vector<uint16_t> qv_, kst_, vst_, pt_;
  std::vector<float> s_, part_, ksc_, vsc_, o_, mx_, sm_;
  const uint16_t* rows_[TOK];
  int64_t blk_[TOK], off_[TOK];
};

}  // namespace amx
#endif
