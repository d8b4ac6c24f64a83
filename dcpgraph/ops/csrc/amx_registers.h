// Register-level helpers of the AMX paged decoder (paged_decode_amx.h): masks, fp8 e4m3 -> bf16
// conversion by table (exact) and a row's group scales, a 16 x 16 transpose of 32-bit lanes, the
// even/odd output interleave, and the two-token vectors and weight tile of the packed rows.
// Compiled only with AMX-BF16 code (included from inside paged_decode_amx.h's guard).
#pragma once

#include <cmath>
#include <cstring>

namespace amx {

inline __mmask32 mask32(int64_t width, int64_t x) {
  return x >= width ? 0 : width - x >= 32 ? 0xFFFFFFFFu : static_cast<__mmask32>((1u << (width - x)) - 1u);
}

// e4m3fn -> bf16 by table (AVX512-VBMI): the exact bf16 form of each of the 128 magnitudes is
// looked up as two byte tables (vpermi2b reads an index's low 7 bits, so the sign bit needs no
// masking), the sign is or-ed into the high byte, and the bytes are interleaved into words. The
// input bytes are first permuted so that the in-lane interleave yields elements in order. NaN
// (0x7F / 0xFF) becomes the bf16 NaN 0xFFC0 whatever its sign (a scale keeps it NaN). Five
// shuffles and one logic op per 64 elements.
struct Fp8Lut {
  __m512i order, lo0, lo1, hi0, hi1;
};
// The tables, built once per process (a Decoder is made per call and thread: only the five
// register loads are per call).
inline Fp8Lut fp8_lut() {
  struct alignas(64) Bytes {
    uint8_t order[64], lo[128], hi[128];
  };
  static const Bytes t = [] {
    Bytes b{};
    for (int lane = 0; lane < 4; ++lane)
      for (int j = 0; j < 8; ++j) {  // unpacklo takes bytes 0-7 of a lane, unpackhi bytes 8-15
        b.order[16 * lane + j] = static_cast<uint8_t>(8 * lane + j);
        b.order[16 * lane + 8 + j] = static_cast<uint8_t>(32 + 8 * lane + j);
      }
    for (int m = 0; m < 128; ++m) {
      const int e = m >> 3, f = m & 7;
      uint16_t w;
      if (m == 0x7F) {
        w = 0xFFC0;
      } else {  // value 2^(e-7) (1 + f/8), or f 2^-9 for e = 0: at most four significant bits
        const float v = e ? std::ldexp(1.f + f / 8.f, e - 7) : std::ldexp(static_cast<float>(f), -9);
        uint32_t u;
        std::memcpy(&u, &v, 4);
        w = static_cast<uint16_t>(u >> 16);
      }
      b.lo[m] = static_cast<uint8_t>(w & 0xFF);
      b.hi[m] = static_cast<uint8_t>(w >> 8);
    }
    return b;
  }();
  return {_mm512_load_si512(t.order), _mm512_load_si512(t.lo), _mm512_load_si512(t.lo + 64), _mm512_load_si512(t.hi),
          _mm512_load_si512(t.hi + 64)};
}
// 64 e4m3fn bytes as 64 bf16 (elements 0-31 in a, 32-63 in b), exactly.
inline void fp8x64_to_bf16(const Fp8Lut& t, __m512i x, __m512i& a, __m512i& b) {
  const __m512i xp = _mm512_permutexvar_epi8(t.order, x);
  const __m512i lo = _mm512_permutex2var_epi8(t.lo0, xp, t.lo1);
  const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(t.hi0, xp, t.hi1), xp,
                                               _mm512_set1_epi8(static_cast<char>(0x80)), 0xF8);
  a = _mm512_unpacklo_epi8(lo, hi);
  b = _mm512_unpackhi_epi8(lo, hi);
}

// fp8x64_to_bf16 with the elements of a (0-31) and of b (32-63) scaled by the powers of two whose
// exponent steps are sa and sb (exponent_steps): k << 7 added to every lane that is neither zero
// nor NaN (the exact bf16 forms' exponents 118..135 stay normal for k in [-117, 119]). Those
// lanes come from the input bytes in one compare for all 64 (two word compares per 32 outputs
// would sit on the shuffle port the table lookup already fills).
inline void fp8x64_to_bf16_stepped(const Fp8Lut& t, __m512i x, int16_t sa, int16_t sb, __m512i& a, __m512i& b) {
  fp8x64_to_bf16(t, x, a, b);
  const __m512i mag = _mm512_and_si512(x, _mm512_set1_epi8(0x7F));
  const __mmask64 live = _mm512_cmplt_epu8_mask(_mm512_sub_epi8(mag, _mm512_set1_epi8(1)), _mm512_set1_epi8(0x7E));
  a = _mm512_mask_add_epi16(a, static_cast<__mmask32>(live), a, _mm512_set1_epi16(sa));
  b = _mm512_mask_add_epi16(b, static_cast<__mmask32>(live >> 32), b, _mm512_set1_epi16(sb));
}

// v (32 bf16) times s, in fp32, rounded to bf16: the scale of a row not all of whose group
// scales are powers of two in range (those rows take exponent_steps instead). A power of two in
// range comes out exact here too.
inline __m512i scale_bf16(__m512i v, float s) {
  const __m512 f = _mm512_set1_ps(s);
  const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(v)), 16));
  const __m512 hi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(v, 1)), 16));
  return (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(hi, f), _mm512_mul_ps(lo, f));
}

// The exponent steps k << 7 of a row's ``groups`` (at most 16) scales into steps[0..groups), and
// 0 into the rest, when every one is a power of two 2^k within [2^-117, 2^119]; false, and
// steps untouched, otherwise.
inline bool exponent_steps(const float* scales, int64_t groups, int16_t (&steps)[32]) {
  if (groups > 16) return false;
  const __mmask16 lanes = static_cast<__mmask16>((1u << groups) - 1u);
  const __m512i b = _mm512_castps_si512(_mm512_maskz_loadu_ps(lanes, scales));
  const __m512i k = _mm512_sub_epi32(_mm512_srli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x7F800000)), 23),
                                     _mm512_set1_epi32(127));
  const __mmask16 pow2 = _mm512_testn_epi32_mask(b, _mm512_set1_epi32(static_cast<int32_t>(0x807FFFFFu)));
  const __mmask16 in_range = _mm512_cmpge_epi32_mask(k, _mm512_set1_epi32(-117)) &
                             _mm512_cmple_epi32_mask(k, _mm512_set1_epi32(119));
  if ((pow2 & in_range & lanes) != lanes) return false;
  _mm512_storeu_si512(steps, _mm512_zextsi256_si512(_mm512_maskz_cvtepi32_epi16(lanes, _mm512_slli_epi32(k, 7))));
  return true;
}
// r[i][c] -> r[c][i] for a 16 x 16 matrix of 32-bit elements: 32-bit and 64-bit interleaves
// leave u[4 g + k] with columns 4 L + k of rows 4 g .. 4 g + 3 in 128-bit lane L; a 4 x 4
// transpose of 128-bit lanes then gathers each column.
inline void transpose16_epi32(__m512i* r) {
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

// One output row of dv fp32 columns from accumulators that hold, for each 32-column chunk c, the
// 16 even columns at even(c) and the 16 odd ones at odd(c) (column 32 c + 2 i + e is element i
// of the e-th): the even/odd value products' output in column order.
template <class Even, class Odd>
inline void interleave_row(Even even, Odd odd, int64_t dv, float* dst) {
  const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
  for (int64_t x = 0; x < dv; x += 32) {
    const __m512 a = _mm512_loadu_ps(even(x / 32)), b = _mm512_loadu_ps(odd(x / 32));
    const int64_t left = dv - x;
    const __mmask16 m0 = left >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1u);
    const __mmask16 m1 = left >= 32 ? 0xFFFF : left <= 16 ? 0 : static_cast<__mmask16>((1u << (left - 16)) - 1u);
    _mm512_mask_storeu_ps(dst + x, m0, _mm512_permutex2var_ps(a, lo, b));
    _mm512_mask_storeu_ps(dst + x + 16, m1, _mm512_permutex2var_ps(a, hi, b));
  }
}

// Two-token vectors of the packed rows (at most 8 query rows): lanes 0-7 hold token t's rows,
// lanes 8-15 token t + 1's. dup_low8 copies lanes 0-7 to 8-15; swap_halves exchanges the halves
// (a lane-wise op of a vector and its swap folds the two tokens per row).
inline __m512 dup_low8(__m512 v) { return _mm512_shuffle_f32x4(v, v, _MM_SHUFFLE(1, 0, 1, 0)); }
inline __m512i dup_low8(__m512i v) { return _mm512_shuffle_i32x4(v, v, _MM_SHUFFLE(1, 0, 1, 0)); }
inline __m512 swap_halves(__m512 v) { return _mm512_shuffle_f32x4(v, v, _MM_SHUFFLE(1, 0, 3, 2)); }

// The packed weight tile of 16 tokens from their two-token vectors (p[k]: tokens 2 k, 2 k + 1):
// row n < 8 holds P[n, i] as bf16 in the low half of dword i, row 8 + n in the high half, zeros
// elsewhere (16 rows of 64 bytes at dst). As words: z[k] = P of tokens 4 k .. 4 k + 3, word
// 8 j + n = P[n, 4 k + j]; one round of two-source word permutes gathers rows 4 h .. 4 h + 3 of
// tokens 8 g .. 8 g + 7 (word 4 i + r = P[4 h + r, 8 g + i]), a second spreads one row's 16
// tokens over even words. 12 permutes, where a 16 x 16 dword transpose takes 64 shuffles.
inline void pack_weights(const __m512 (&p)[8], uint16_t* dst) {
  struct alignas(64) Index {
    uint16_t gather[2][32], spread[4][32];
  };
  static const Index ix = [] {
    Index x{};
    for (int h = 0; h < 2; ++h)
      for (int i = 0; i < 8; ++i)
        for (int r = 0; r < 4; ++r)
          x.gather[h][4 * i + r] = static_cast<uint16_t>((i < 4 ? 0 : 32) + 8 * (i % 4) + 4 * h + r);
    for (int r = 0; r < 4; ++r)
      for (int i = 0; i < 16; ++i) {
        x.spread[r][2 * i] = static_cast<uint16_t>((i < 8 ? 0 : 32) + 4 * (i % 8) + r);
        x.spread[r][2 * i + 1] = 0;  // zeroed by the mask
      }
    return x;
  }();
  __m512i z[4];
  for (int k = 0; k < 4; ++k) z[k] = (__m512i)_mm512_cvtne2ps_pbh(p[2 * k + 1], p[2 * k]);
  for (int h = 0; h < 2; ++h) {
    const __m512i gather = _mm512_load_si512(ix.gather[h]);
    const __m512i y0 = _mm512_permutex2var_epi16(z[0], gather, z[1]);  // tokens 0-7
    const __m512i y1 = _mm512_permutex2var_epi16(z[2], gather, z[3]);  // tokens 8-15
    for (int r = 0; r < 4; ++r) {
      const int n = 4 * h + r;
      const __m512i row = _mm512_maskz_permutex2var_epi16(0x55555555u, y0, _mm512_load_si512(ix.spread[r]), y1);
      _mm512_storeu_si512(dst + n * 32, row);
      _mm512_storeu_si512(dst + (n + 8) * 32, _mm512_slli_epi32(row, 16));
    }
  }
}

}  // namespace amx
