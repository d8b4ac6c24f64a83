// fp32 vectors of the build's widest x86 ISA, for the fp32-arithmetic paged decode path
// (paged_decode.cpp): 16 lanes under AVX-512F, 8 under AVX2 + FMA (AMD Zen 1-3, Intel before
// Skylake-SP, most desktop CPUs). The micro-kernels are written once against ``Simd``; each
// build instantiates them for one width (-march=native picks it). DCPGRAPH_SIMD is 0 where
// neither ISA is available (the scalar loops of paged_decode.cpp then serve fp32 caches only).
//
// Lane masks are the vector's first ``n`` lanes (n clamped to [0, W]): a __mmask16 under
// AVX-512, a lane count under AVX2. Loops take their whole vectors with ``All`` (the unmasked
// overloads, so an inner loop carries no mask and, under AVX2, no branch) and only a tail with a
// mask.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define DCPGRAPH_SIMD 1
#include <immintrin.h>
#else
#define DCPGRAPH_SIMD 0
#endif

#if DCPGRAPH_SIMD
namespace simd {

// Every lane live: the unmasked overload of each load and store (a loop's whole vectors).
struct All {};

inline const __m128i* as128(const void* p) { return static_cast<const __m128i*>(p); }

#ifdef __AVX512F__
struct Simd {
  using V = __m512;
  using Mask = __mmask16;
  static constexpr int W = 16;
  static Mask first(int64_t n) { return n >= 16 ? 0xFFFF : n <= 0 ? 0 : static_cast<Mask>((1u << n) - 1u); }
  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V load(const float* p, Mask m) { return _mm512_maskz_loadu_ps(m, p); }
  static V load(const float* p, All) { return _mm512_loadu_ps(p); }
  // the first m lanes from p, ``fill`` in the others (nothing read there)
  static V load_else(const float* p, Mask m, float fill) { return _mm512_mask_loadu_ps(_mm512_set1_ps(fill), m, p); }
  static void store(float* p, Mask m, V v) { _mm512_mask_storeu_ps(p, m, v); }
  static void store(float* p, All, V v) { _mm512_storeu_ps(p, v); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static float sum(V v) { return _mm512_reduce_add_ps(v); }
  // all-ones lanes where x is NaN, zero elsewhere; the lanes of a or b
  static V nan_lanes(V x) {
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_castsi512_ps(_mm512_set1_epi32(-1)));
  }
  static V either(V a, V b) { return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(a), _mm512_castps_si512(b))); }
  // 2^n for integral n in [-126, 0] (exp's range reduction)
  static V scale_pow2(V y, V n) { return _mm512_scalef_ps(y, n); }
  static V round(V x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  // Integer-lane helpers of the fp8 loader: bytes zero-extended to 32-bit lanes.
  using I = __m512i;
  static I bytes(const uint8_t* p, Mask m) { return _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, p)); }
  static I bytes(const uint8_t* p, All) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(as128(p))); }
  static I words(const uint16_t* p, Mask m) { return _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)); }
  static I words(const uint16_t* p, All) {
    return _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static I sbytes(const uint8_t* p, Mask m) { return _mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, p)); }
  static I sbytes(const uint8_t* p, All) { return _mm512_cvtepi8_epi32(_mm_loadu_si128(as128(p))); }
  // v with NaN in the lanes where a == b
  static V nan_where_eq(I a, I b, V v) {
    return _mm512_mask_mov_ps(v, _mm512_cmpeq_epi32_mask(a, b), _mm512_set1_ps(NAN));
  }
  static I iset1(int32_t x) { return _mm512_set1_epi32(x); }
  static I iand(I a, I b) { return _mm512_and_si512(a, b); }
  static I ior(I a, I b) { return _mm512_or_si512(a, b); }
  static I iadd(I a, I b) { return _mm512_add_epi32(a, b); }
  template <int k> static I shl(I a) { return _mm512_slli_epi32(a, k); }
  static V as_float(I a) { return _mm512_castsi512_ps(a); }
  static I as_int(V a) { return _mm512_castps_si512(a); }
  static V to_float(I a) { return _mm512_cvtepi32_ps(a); }
  // where(a >= b) x else y, per 32-bit lane
  static V select_ge(I a, I b, V x, V y) { return _mm512_mask_blend_ps(_mm512_cmpge_epi32_mask(a, b), y, x); }
};
#else
struct Simd {
  using V = __m256;
  using Mask = int;  // live lanes: the first ``Mask`` of 8
  static constexpr int W = 8;
  static Mask first(int64_t n) { return n >= 8 ? 8 : n <= 0 ? 0 : static_cast<Mask>(n); }
  static __m256i lanes(Mask m) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(m), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V load(const float* p, Mask m) { return m == 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, lanes(m)); }
  static V load(const float* p, All) { return _mm256_loadu_ps(p); }
  static V load_else(const float* p, Mask m, float fill) {
    if (m == 8) return _mm256_loadu_ps(p);
    const __m256i live = lanes(m);
    return _mm256_blendv_ps(_mm256_set1_ps(fill), _mm256_maskload_ps(p, live), _mm256_castsi256_ps(live));
  }
  static void store(float* p, Mask m, V v) {
    if (m == 8)
      _mm256_storeu_ps(p, v);
    else
      _mm256_maskstore_ps(p, lanes(m), v);
  }
  static void store(float* p, All, V v) { _mm256_storeu_ps(p, v); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static float sum(V v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  // all-ones lanes where x is NaN, zero elsewhere; the lanes of a or b
  static V nan_lanes(V x) { return _mm256_cmp_ps(x, x, _CMP_UNORD_Q); }
  static V either(V a, V b) { return _mm256_or_ps(a, b); }
  // 2^n for integral n in [-126, 0]: n + 127 as an fp32 exponent field (a normal number)
  static V scale_pow2(V y, V n) {
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
  }
  static V round(V x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  using I = __m256i;
  static I bytes(const uint8_t* p, All) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64(as128(p))); }
  static I words(const uint16_t* p, All) { return _mm256_cvtepu16_epi32(_mm_loadu_si128(as128(p))); }
  static I sbytes(const uint8_t* p, All) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64(as128(p))); }
  static I sbytes(const uint8_t* p, Mask m) { return _mm256_cvtepi8_epi32(_mm256_castsi256_si128(widen_bytes(p, m))); }
  static V nan_where_eq(I a, I b, V v) { return _mm256_or_ps(v, _mm256_castsi256_ps(_mm256_cmpeq_epi32(a, b))); }
  // the first m bytes at p in the low bytes, zeros after (a tail: no read past p + m)
  static __m256i widen_bytes(const uint8_t* p, Mask m) {
    alignas(16) uint8_t b[16] = {};
    std::memcpy(b, p, static_cast<size_t>(m));
    return _mm256_castsi128_si256(_mm_load_si128(as128(b)));
  }
  static I bytes(const uint8_t* p, Mask m) {
    if (m == 8) return _mm256_cvtepu8_epi32(_mm_loadl_epi64(as128(p)));
    return _mm256_cvtepu8_epi32(_mm256_castsi256_si128(widen_bytes(p, m)));
  }
  static I words(const uint16_t* p, Mask m) {
    if (m == 8) return _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    alignas(16) uint16_t w[8] = {};
    std::memcpy(w, p, static_cast<size_t>(m) * 2);
    return _mm256_cvtepu16_epi32(_mm_load_si128(as128(w)));
  }
  static I iset1(int32_t x) { return _mm256_set1_epi32(x); }
  static I iand(I a, I b) { return _mm256_and_si256(a, b); }
  static I ior(I a, I b) { return _mm256_or_si256(a, b); }
  static I iadd(I a, I b) { return _mm256_add_epi32(a, b); }
  template <int k> static I shl(I a) { return _mm256_slli_epi32(a, k); }
  static V as_float(I a) { return _mm256_castsi256_ps(a); }
  static I as_int(V a) { return _mm256_castps_si256(a); }
  static V to_float(I a) { return _mm256_cvtepi32_ps(a); }
  static V select_ge(I a, I b, V x, V y) {  // a >= b  <=>  !(b > a)
    return _mm256_blendv_ps(x, y, _mm256_castsi256_ps(_mm256_cmpgt_epi32(b, a)));
  }
};
#endif

// exp(x) for x <= 0 (softmax weights): Cody-Waite range reduction, degree-7 Taylor, times 2^n.
inline Simd::V exp_nonpositive(Simd::V x) {
  using S = Simd;
  x = S::max(x, S::set1(-87.0f));
  const S::V n = S::round(S::mul(x, S::set1(1.44269504088896341f)));
  S::V r = S::fmadd(n, S::set1(-0.693359375f), x);
  r = S::fmadd(n, S::set1(2.12194440e-4f), r);
  S::V y = S::set1(1.f / 5040.f);
  y = S::fmadd(y, r, S::set1(1.f / 720.f));
  y = S::fmadd(y, r, S::set1(1.f / 120.f));
  y = S::fmadd(y, r, S::set1(1.f / 24.f));
  y = S::fmadd(y, r, S::set1(1.f / 6.f));
  y = S::fmadd(y, r, S::set1(0.5f));
  y = S::fmadd(y, r, S::set1(1.f));
  y = S::fmadd(y, r, S::set1(1.f));
  return S::scale_pow2(y, n);
}

}  // namespace simd
#endif
