// The fp32 multiply-add rate of one thread (a benchmark diagnostic, not a kernel of the library):
// the compute ceiling of the paged decode kernel's fp32 path, which does every product of a
// query row and a converted K/V element as one lane of a vector FMA.
//
// fma_lanes_per_second(iterations) runs ``iterations`` rounds of CHAINS independent vector FMAs
// (a_c = a_c * m + a: enough chains to cover the FMA latency on every x86 core since
// Haswell, ~4-5 cycles at 2 a cycle) on the build's widest vectors (AVX-512: 16 lanes, AVX2 + FMA:
// 8) and returns multiply-add lanes per second of wall time. The values stay finite (m < 1) and
// the result is consumed, so nothing is folded away.
#include <torch/extension.h>

#include <immintrin.h>

#include <chrono>
#include <cstdint>

namespace {

constexpr int CHAINS = 12;

#if defined(__AVX512F__)
using V = __m512;
constexpr int LANES = 16;
inline V set1(float x) { return _mm512_set1_ps(x); }
inline V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline float first(V v) { return _mm512_cvtss_f32(v); }
#elif defined(__AVX2__) && defined(__FMA__)
using V = __m256;
constexpr int LANES = 8;
inline V set1(float x) { return _mm256_set1_ps(x); }
inline V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline float first(V v) { return _mm256_cvtss_f32(v); }
#endif

}  // namespace

// Multiply-add lanes per second, and the lanes per vector (0, 0 where the build has no vector FMA).
std::tuple<double, int64_t> fma_lanes_per_second(int64_t iterations) {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  // Twelve named accumulators (an array of them stayed in memory: every FMA a load and a store).
  V a0 = set1(1.000f), a1 = set1(1.001f), a2 = set1(1.002f), a3 = set1(1.003f), a4 = set1(1.004f),
    a5 = set1(1.005f), a6 = set1(1.006f), a7 = set1(1.007f), a8 = set1(1.008f), a9 = set1(1.009f),
    a10 = set1(1.010f), a11 = set1(1.011f);
  const V m = set1(0.999f), a = set1(0.001f);
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < iterations; ++i) {
    a0 = fma(a0, m, a); a1 = fma(a1, m, a); a2 = fma(a2, m, a); a3 = fma(a3, m, a);
    a4 = fma(a4, m, a); a5 = fma(a5, m, a); a6 = fma(a6, m, a); a7 = fma(a7, m, a);
    a8 = fma(a8, m, a); a9 = fma(a9, m, a); a10 = fma(a10, m, a); a11 = fma(a11, m, a);
    // kept as written, in registers
    __asm__ volatile("" : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5));
    __asm__ volatile("" : "+v"(a6), "+v"(a7), "+v"(a8), "+v"(a9), "+v"(a10), "+v"(a11));
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const float sink = first(a0) + first(a1) + first(a2) + first(a3) + first(a4) + first(a5) + first(a6) +
                     first(a7) + first(a8) + first(a9) + first(a10) + first(a11);
  TORCH_CHECK(sink == sink, "fma_peak: NaN");
  return {static_cast<double>(iterations) * CHAINS * LANES / seconds, LANES};
#else
  (void)iterations;
  return {0.0, 0};
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("fma_lanes_per_second", &fma_lanes_per_second, "fp32 multiply-add lanes per second of one thread");
}
