// AMX-BF16 paged decode for bf16 queries over bf16 or fp8 KV caches (one work item at a time).
//
// Included by paged_decode.cpp (outside its anonymous namespace, after the AVX-512 helper exp512);
// compiled only when the compiler targets AMX-BF16 (DCPGRAPH_HAVE_AMX). The process must have
// been granted the AMX tile state (permission_error() asks the OS once); every thread loads its
// tile configuration before its first item (configure()) and releases it after its last. This
// file is the arithmetic of Decoder; its operands (queries, key and value rows in place or
// staged, row bounds, folded fp8 scales) come from amx_operands.h, register helpers from
// amx_registers.h and the prefetch schedule from amx_prefetch.h. Items of at most 8 query rows
// take amx_packed.h's PackedDecoder instead (the caller picks by PackedDecoder::fits).
//
// For one item (request, KV head, key range) with M = G * lq query rows, in groups of 16 (a
// query-row group j), over key groups of TOK tokens (TOK / 16 16-token tiles q; PREFIX_TOK, ROWS_TOK):
//   scores   S^T[t, n] = K[t, :] . Q[n, :]    A = 16 key rows as they lie in the cache (row stride
//            of the block; bf16, 16 rows of one block, width a multiple of 32) or as staged bf16;
//            B = the queries in VNNI layout, built once per item.
//   softmax  online, per query row, in fp32: m' = max(m, max_t s), p = exp(s - m'),
//            l' = l e^(m - m') + sum_t p, O <- O e^(m - m').
//   values   O[n, 32 c + 2 i + e] += sum_t P[n, t] V[t, 32 c + 2 i + e]   (e = 0, 1)
//            B = 16 value rows x 32 columns as they lie in memory (a tile row is one token's
//            64 bytes, so its dword i holds columns 2 i and 2 i + 1): no value staging. The
//            A operands carry P[n, t] in the low (e = 0) or the high (e = 1) half of each dword
//            and zero in the other, so one product picks the even columns and the other the odd
//            ones (twice the tile products of a token-pair interleave, none of its copying).
//            Even columns accumulate at o[32 c + i], odd at o[32 c + 16 + i]; run() interleaves.
//            (PackedDecoder puts both halves in one A tile and keeps the accumulators in tiles.)
// Query rows are processed in blocks of JB row groups (256 rows), each block over the keys any of
// its rows sees, so a long chunk's output accumulators stay in L2 while its keys stream past
// (flash attention's order); decode has one block. With per-token bounds (a chunked prefill's
// causal mask) a row's scores past its bound are -inf and its weights 0, and a row group stops
// at the largest bound of its rows.
// P is rounded to bf16 for the value product only (as flash attention does for bf16 models); the
// normaliser l sums the fp32 p. Scores accumulate in fp32 from exact bf16 products.
//
// fp8 rows are staged as the exact bf16 forms of their e4m3 values (a table lookup, NaN kept).
// Where each K row and each V row has one scale (heads no wider than a scale group: GQA), the
// scales are folded instead of applied: s[t] = scale * ks[t] * (K8[t] . q) and P[n, t] is
// rounded to bf16 as p * vs[t] (l sums p). For a power-of-two scale (what quant.quantize_fp8
// writes) both equal the products of the dequantised values exactly; for any other scale they
// skip the dequantised value's rounding to bf16. Rows with several scale groups (MLA's latent
// and rope) get their scales applied while staged: a row whose scales are all powers of two 2^k
// (in range) adds each group's k to the exponents, exactly; any other row multiplies in fp32 and
// rounds to bf16 (as the torch path's dequantisation to bf16 does).
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512F__) && \
    defined(__AVX512VBMI__)
#define DCPGRAPH_HAVE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "amx_registers.h"

namespace amx {

constexpr int64_t MAX_QT = 4;           // most 16-token tiles in a key group (score tiles 0-3)
constexpr int64_t COLS = 16;             // query rows per query-row group (a tile's fp32 columns)
constexpr int64_t JB = 16;               // query-row groups per block (one pass over the keys)
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

// Tiles 0-7 all 16 rows x 64 bytes (roles per phase: see scores() and values()). The
// configuration lives in static storage and a compiler barrier precedes the load: gcc's
// _tile_loadconfig tells the compiler it reads only 8 bytes, so a stack copy's other stores
// could be dropped or sunk past it.
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
  const int64_t* bound;  // per query token: it sees keys j < bound[token] (causal chunks); null: all
};

// 16-row operands of one key group: base and byte stride of each 16-token tile.
struct Rows {
  const uint16_t* base[MAX_QT];
  int64_t stride[MAX_QT];
};

// Token tile i's share of score step kk (32 key columns), in both decoders' score loops: the
// prefetcher stepped, the tile's key rows loaded into tile KT and multiplied into score tile ACC
// against the queries in tile QTILE. A macro because GCC's AMX intrinsics take tile numbers as
// text, so tile roles cannot be function or template parameters.
#define DCPGRAPH_SCORE_TILE(pf, keys, i, kk, KT, ACC, QTILE)              \
  do {                                                                    \
    (pf).step();                                                          \
    _tile_loadd(KT, (keys).base[i] + (kk) * 32, (keys).stride[i]);        \
    _tile_dpbf16ps(ACC, KT, QTILE);                                       \
  } while (0)

}  // namespace amx

#include "amx_prefetch.h"
#include "amx_operands.h"

namespace amx {

// Tokens per key group (the Decoder's TOK): PREFIX_TOK where the values are a prefix of the key
// rows (MLA: the output accumulators, 16 rows x 512 fp32 columns, are loaded and stored once per
// key group, so fewer groups save more), ROWS_TOK where K and V are separate rows. Measured, GQA
// 8:1 with head size 128, 4K tokens in cache, 1 thread: 32 tokens took bf16 from 34 to 30 ns a
// token and fp8 from 52 to 40 (a group's staged fp8 rows, 32 KB at 64 tokens, no longer push the
// rest of the working set out of the 48 KB L1); 16 tokens were slower than either. MLA at 32
// tokens: bf16 94 -> 98 ns, fp8 no better; at 128, no change.
constexpr int64_t PREFIX_TOK = 64, ROWS_TOK = 32;

// Per-thread buffers and the item loop body. ``T``: uint16_t (bf16 cache) or uint8_t (fp8);
// ``TOK``: tokens per key group (ROWS_TOK or PREFIX_TOK).
template <class T, int64_t TOK>
class Decoder {
 public:
  static constexpr bool kFp8 = std::is_same_v<T, uint8_t>;
  static constexpr int64_t QT = TOK / 16;  // token tiles per key group
  static_assert(TOK % 16 == 0 && QT >= 1 && QT <= MAX_QT, "a key group is one to four 16-token tiles");

  Decoder(const Caches<T>& c, int64_t max_m)
      : c_(c), dp_((c.d + 31) / 32 * 32), dvp_((c.dv + 31) / 32 * 32), ostride_(dvp_ + 16),
        mgroups_((max_m + COLS - 1) / COLS), pt_(mgroups_ * QT * 2 * TILE_ELEMS), s_(TOK * COLS),
        o_(mgroups_ * COLS * ostride_), mx_(mgroups_ * COLS), sm_(mgroups_ * COLS), pf_(c, TOK),
        in_(c, mgroups_, pf_) {}

  // Keys [t0, t1) of request r, KV head h: unnormalised acc [m, dv], running max and sum [m].
  void run(int64_t r, int64_t h, int64_t t0, int64_t t1, float* acc, float* mx, float* sm) {
    const int64_t lq = c_.cu[r + 1] - c_.cu[r], m = lq * c_.g, mg = (m + COLS - 1) / COLS;
    in_.build_queries(r, h, lq, mg);
    std::fill(o_.begin(), o_.begin() + mg * COLS * ostride_, 0.f);
    std::fill(mx_.begin(), mx_.begin() + mg * COLS, -INFINITY);
    std::fill(sm_.begin(), sm_.begin() + mg * COLS, 0.f);
    in_.row_bounds(r, m, mg, t1);
    for (int64_t j0 = 0; j0 < mg; j0 += JB) {
      const int64_t j1 = std::min(mg, j0 + JB);
      int64_t end = t0;  // the block's last key + 1
      for (int64_t j = j0; j < j1; ++j) end = std::max(end, in_.jmax[j]);
      for (int64_t t = t0; t < end; t += TOK) {
        Rows keys, values;
        const int64_t nt = in_.load_group(r, h, t, end, calls_per_group(j1 - j0), keys, values);
        int64_t active = 0;
        for (int64_t j = j0; j < j1; ++j) {
          if (t >= in_.jmax[j]) continue;  // every row of group j has seen all its keys
          scores(keys, nt, j);
          softmax(t, nt, j);
          active_[active++] = j;
        }
        this->values(values, (nt + 15) / 16, active);
        pf_.finish();
      }
    }
    // even columns of chunk c at o[32 c + i], odd at o[32 c + 16 + i]
    for (int64_t i = 0; i < m; ++i) {
      const float* src = o_.data() + (i / COLS) * COLS * ostride_ + (i % COLS) * ostride_;
      interleave_row([&](int64_t c) { return src + 32 * c; }, [&](int64_t c) { return src + 32 * c + 16; }, c_.dv,
                     acc + i * c_.dv);
      mx[i] = mx_[i];
      sm[i] = sm_[i];
    }
  }

 private:
  // s_[t, n] = K[t, :] . Q[16 j + n, :] for the key group (fp32, TOK x 16). Tiles 0-3: the
  // token tiles' scores; 4: queries; 5, 6: key rows.
  void scores(const Rows& keys, int64_t nt, int64_t j) {
    const int64_t ksteps = dp_ / 32;
    const uint16_t* qb = in_.queries(j);
    const int64_t nq = (nt + 15) / 16;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t kk = 0; kk < ksteps; ++kk) {
      _tile_loadd(4, qb + kk * TILE_ELEMS, 64);
      DCPGRAPH_SCORE_TILE(pf_, keys, 0, kk, 5, 0, 4);
      if (nq > 1) DCPGRAPH_SCORE_TILE(pf_, keys, 1, kk, 6, 1, 4);
      if (nq > 2) DCPGRAPH_SCORE_TILE(pf_, keys, 2, kk, 5, 2, 4);
      if (nq > 3) DCPGRAPH_SCORE_TILE(pf_, keys, 3, kk, 6, 3, 4);
    }
    _tile_stored(0, s_.data(), 64);
    if (QT > 1) _tile_stored(1, s_.data() + 16 * COLS, 64);
    if (QT > 2) _tile_stored(2, s_.data() + 32 * COLS, 64);
    if (QT > 3) _tile_stored(3, s_.data() + 48 * COLS, 64);
  }

  // Online softmax of the key group for query-row group j (lanes = query rows) over the scores
  // s_[t] * in_.kf[t], then P as the A operands pt_[j][q][e] ([16 rows n][16 tokens] dwords,
  // P[n, t] (times in_.vf[t] when folded) in the low (e = 0) or high (e = 1) half, tokens past nt
  // zero).
  void softmax(int64_t t0, int64_t nt, int64_t j) {
    float* s = s_.data();
    __m512 bm = _mm512_set1_ps(-INFINITY);
    __mmask16 nan = 0;  // rows with a NaN score: their normaliser becomes NaN (so do their outputs)
    // Rows whose bound falls inside this key group: scores past it become -inf (weights 0 below).
    const bool masked = t0 + nt > in_.jmin[j];
    const __m512i bound = _mm512_loadu_si512(in_.jb.data() + j * COLS);
    if (masked) {
      for (int64_t t = 0; t < nt; ++t) {
        const __mmask16 ok = _mm512_cmplt_epi32_mask(_mm512_set1_epi32(static_cast<int32_t>(t0 + t)), bound);
        const __m512 x = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), ok, _mm512_loadu_ps(s + t * COLS),
                                            _mm512_set1_ps(in_.kf[t]));
        _mm512_storeu_ps(s + t * COLS, x);
        nan |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
        bm = _mm512_max_ps(bm, x);
      }
    } else {
      for (int64_t t = 0; t < nt; ++t) {
        const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(s + t * COLS), _mm512_set1_ps(in_.kf[t]));
        nan |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
        bm = _mm512_max_ps(bm, x);
      }
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
    uint16_t* pt = pt_.data() + j * QT * 2 * TILE_ELEMS;
    for (int64_t q = 0; q < (nt + 15) / 16; ++q) {
      pf_.step();
      pf_.step();
      __m512i r[16];
      for (int i = 0; i < 16; ++i) {
        const int64_t t = q * 16 + i;
        __m512 p = _mm512_setzero_ps();
        if (t < nt && masked) {
          const __mmask16 ok = _mm512_cmplt_epi32_mask(_mm512_set1_epi32(static_cast<int32_t>(t0 + t)), bound);
          p = _mm512_maskz_mov_ps(ok, exp512(_mm512_sub_ps(_mm512_loadu_ps(s + t * COLS), nm)));
        } else if (t < nt) {
          p = exp512(_mm512_sub_ps(_mm512_mul_ps(_mm512_loadu_ps(s + t * COLS), _mm512_set1_ps(in_.kf[t])), nm));
        }
        tot = _mm512_add_ps(tot, p);
        if (in_.fold && t < nt) p = _mm512_mul_ps(p, _mm512_set1_ps(in_.vf[t]));
        r[i] = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(p));
      }
      transpose16_epi32(r);
      uint16_t* lo = pt + q * 2 * TILE_ELEMS;
      for (int n = 0; n < 16; ++n) {
        _mm512_storeu_si512(lo + n * 32, r[n]);
        _mm512_storeu_si512(lo + TILE_ELEMS + n * 32, _mm512_slli_epi32(r[n], 16));
      }
    }
    _mm512_storeu_ps(smp, _mm512_mask_mov_ps(_mm512_add_ps(_mm512_loadu_ps(smp), tot), nan, _mm512_set1_ps(NAN)));
  }

  // O[j] += P[j] V over the key group's nq token tiles, two 32-column chunks at a time: tiles
  // 0/1 even/odd columns of chunk c, 2/3 of chunk c + 1; 4/5 P (low/high halves); 6/7 values.
  template <bool kPair>
  void value_chunk(const Rows& values, const uint16_t* pt, int64_t nq, float* o, int64_t c) {
    const int64_t st = ostride_ * 4;
    float* oc = o + c * 32;
    _tile_loadd(0, oc, st);
    _tile_loadd(1, oc + 16, st);
    if (kPair) {
      _tile_loadd(2, oc + 32, st);
      _tile_loadd(3, oc + 48, st);
    }
    for (int64_t q = 0; q < nq; ++q) {
      pf_.step();
      _tile_loadd(4, pt + q * 2 * TILE_ELEMS, 64);
      _tile_loadd(5, pt + q * 2 * TILE_ELEMS + TILE_ELEMS, 64);
      _tile_loadd(6, values.base[q] + c * 32, values.stride[q]);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 5, 6);
      if (kPair) {
        _tile_loadd(7, values.base[q] + c * 32 + 32, values.stride[q]);
        _tile_dpbf16ps(2, 4, 7);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
    _tile_stored(0, oc, st);
    _tile_stored(1, oc + 16, st);
    if (kPair) {
      _tile_stored(2, oc + 32, st);
      _tile_stored(3, oc + 48, st);
    }
  }

  // step() calls per key group: key rows (one per token tile), scores (one per
  // token tile and 32-column step), softmax (two per token tile), values (one per token tile and chunk pair).
  // ``groups``: the query-row groups of the block.
  int64_t calls_per_group(int64_t groups) const {
    return QT + groups * (QT * dp_ / 32 + 2 * QT + QT * ((dvp_ / 32 + 1) / 2));
  }

  void values(const Rows& values, int64_t nq, int64_t active) {
    const int64_t chunks = dvp_ / 32;
    for (int64_t a = 0; a < active; ++a) {
      const int64_t j = active_[a];
      const uint16_t* pt = pt_.data() + j * QT * 2 * TILE_ELEMS;
      float* o = o_.data() + j * COLS * ostride_;
      int64_t c = 0;
      for (; c + 1 < chunks; c += 2) value_chunk<true>(values, pt, nq, o, c);
      if (c < chunks) value_chunk<false>(values, pt, nq, o, c);
    }
  }

  const Caches<T>& c_;
  const int64_t dp_, dvp_, ostride_, mgroups_;
  LineVector<uint16_t> pt_;  // tile operands and tile-stored results: rows on cache lines (measured,
                             // 1 thread, memory-sized: bf16 MLA 71-74 -> 77-78% of x.sum(), fp8
                             // GQA 65-67 -> 69-71%, against malloc's 16-byte alignment)
  LineVector<float> s_, o_;
  std::vector<float> mx_, sm_;
  Prefetcher<T> pf_;
  Operands<T, TOK> in_;  // queries, key and value rows, bounds, folded fp8 scales
  int64_t active_[JB];   // the block's groups that still have keys in this key group
};

}  // namespace amx

#include "amx_packed.h"
#undef DCPGRAPH_SCORE_TILE
#endif
