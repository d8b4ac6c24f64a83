// Register-level helpers of the AMX paged decoder (paged_decode_amx.h): masks, fp8 e4m3 -> bf16
// conversion (exact, and with a row's scale applied), and a 16 x 16 transpose of 32-bit lanes.
// Compiled only with AMX-BF16 code (included from inside paged_decode_amx.h's guard).
#pragma once

#include <cstring>

namespace amx {

inline __mmask32 mask32(int64_t width, int64_t x) {
  return x >= width ? 0 : width - x >= 32 ? 0xFFFFFFFFu : static_cast<__mmask32>((1u << (width - x)) - 1u);
}

// 32 e4m3fn bytes (masked lanes zero) as 32 bf16, exactly: normals move their exponent and
// mantissa bits into bf16's fields (bias 7 -> 127), subnormals m * 2^-9 come from a table.
inline __m512i fp8_to_bf16(const uint8_t* src, __mmask32 mk) {
  const __m512i x = _mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(mk, src));
  const __m512i sub_table = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                             0x3C60, 0x3C40, 0x3C20, 0x3C00, 0x3BC0, 0x3B80, 0x3B00, 0);
  const __m512i normal = _mm512_add_epi16(_mm512_and_si512(_mm512_slli_epi16(x, 4), _mm512_set1_epi16(0x7F0)),
                                          _mm512_set1_epi16(120 << 7));
  const __mmask32 sub = _mm512_testn_epi16_mask(x, _mm512_set1_epi16(0x78));  // exponent field 0
  const __m512i v = _mm512_mask_permutexvar_epi16(normal, sub, x, sub_table);  // index: low 5 bits
  // sign: bit 7 of the byte to bit 15
  return _mm512_ternarylogic_epi32(v, _mm512_slli_epi16(x, 8), _mm512_set1_epi16(static_cast<int16_t>(0x8000)), 0xF8);
}

// How one scale group of a row becomes bf16: a power of two 2^k within [2^-117, 2^119] is an
// exponent step k << 7 (nonzero lanes only; the exact bf16 forms' exponents 118..135 stay normal);
// any other scale multiplies in fp32.
struct RowScale {
  bool exact;
  int16_t step;
  float value;
};
inline RowScale row_scale(float s) {
  uint32_t b;
  std::memcpy(&b, &s, 4);
  const int32_t k = static_cast<int32_t>((b >> 23) & 0xFF) - 127;
  if ((b & 0x807FFFFFu) == 0 && k >= -117 && k <= 119) return {true, static_cast<int16_t>(k * 128), s};
  return {false, 0, s};
}
inline __m512i fp8_scaled(const uint8_t* src, __mmask32 mk, const RowScale& s) {
  const __m512i v = fp8_to_bf16(src, mk);
  if (s.exact) return _mm512_mask_add_epi16(v, _mm512_test_epi16_mask(v, _mm512_set1_epi16(0x7FFF)), v,
                                            _mm512_set1_epi16(s.step));
  const __m512 f = _mm512_set1_ps(s.value);
  const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(v)), 16));
  const __m512 hi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(v, 1)), 16));
  return (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(hi, f), _mm512_mul_ps(lo, f));
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

}  // namespace amx
