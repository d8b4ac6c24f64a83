// dcpgraph::kv_cache_write_'s CPU kernel (schema in dcpgraph/ops/library.py, meaning in
// dcpgraph/ops/paged.py's write_slots): for every token t whose slot s = slot_mapping[t] is >= 0,
//   cache[s / B, s % B, ...] = new[t, ...]          (cache [NB, B, ...], new [T, ...])
// and slot -1 (a DCP rank that does not own the token) writes nothing. Every slot is checked
// before any row is written, so a bad slot raises IndexError with the cache untouched.
// Registered as the op's CPU kernel when the extension loads; runs once per layer per step, where
// the Python kernel's mask, sync and index_copy_ cost several times the copy itself.
#pragma once

#include <torch/extension.h>
#include <torch/library.h>

#include <c10/util/Float8_e4m3fn.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace kv_write {

// new's rows land as dense rows of the cache: dims 2.. of the cache are contiguous and equal new's
// dims 1.., and new is contiguous in the cache's dtype.
inline bool dense_rows(const at::Tensor& cache, const at::Tensor& src) {
  if (cache.dim() < 3 || src.dim() != cache.dim() - 1 || src.scalar_type() != cache.scalar_type() ||
      !src.is_contiguous() || !cache.device().is_cpu() || !src.device().is_cpu())
    return false;
  int64_t expect = 1;
  for (int64_t i = cache.dim() - 1; i >= 2; --i) {
    if (cache.size(i) != src.size(i - 1) || (cache.size(i) != 1 && cache.stride(i) != expect)) return false;
    expect *= cache.size(i);
  }
  return true;
}

// slot_mapping as contiguous int64 (itself when it is one), or an undefined tensor when it is not
// a 1-D int32/int64 CPU tensor of ``tokens`` slots.
inline at::Tensor slots_of(const at::Tensor& slot_mapping, int64_t tokens) {
  const auto st = slot_mapping.scalar_type();
  if (slot_mapping.dim() != 1 || slot_mapping.size(0) != tokens || !(st == at::kLong || st == at::kInt) ||
      !slot_mapping.device().is_cpu())
    return at::Tensor();
  return st == at::kLong && slot_mapping.is_contiguous() ? slot_mapping : slot_mapping.to(at::kLong).contiguous();
}

// Every slot inside the cache's NB * B slots (-1 passes): checked before any row is written.
inline void check_slots(const int64_t* slots, int64_t tokens, const at::Tensor& cache, const char* op) {
  const int64_t total = cache.size(0) * cache.size(1);
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK_INDEX(slots[t] < total, op, ": slot ", slots[t], " of token ", t, " is outside the cache's ", total,
                      " slots");
}

inline void copy_rows(at::Tensor& cache, const at::Tensor& src, const int64_t* slots, int64_t tokens) {
  check_slots(slots, tokens, cache, "kv_cache_write_");
  const int64_t block = cache.size(1), elem = cache.element_size(), row = src.numel() / std::max<int64_t>(tokens, 1) * elem;
  char* base = static_cast<char*>(cache.data_ptr());
  const char* from = static_cast<const char*>(src.data_ptr());
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t s = slots[t];
    if (s < 0) continue;
    std::memcpy(base + ((s / block) * cache.stride(0) + (s % block) * cache.stride(1)) * elem, from + t * row, row);
  }
}

inline void kv_cache_write_cpu(at::Tensor& cache, const at::Tensor& src, const at::Tensor& slot_mapping) {
  if (dense_rows(cache, src)) {
    const at::Tensor slots = slots_of(slot_mapping, src.size(0));
    if (slots.defined()) return copy_rows(cache, src, slots.data_ptr<int64_t>(), src.size(0));
  }
  // Anything else: write_slots' own sequence.
  std::vector<int64_t> flat_shape{-1};
  for (int64_t i = 2; i < cache.dim(); ++i) flat_shape.push_back(cache.size(i));
  at::Tensor flat = cache.view(flat_shape);
  const at::Tensor owned = slot_mapping.ge(0);
  if (owned.all().item<bool>()) {
    flat.index_copy_(0, slot_mapping.to(at::kLong), src.to(cache.scalar_type()));
  } else {
    flat.index_copy_(0, slot_mapping.index({owned}).to(at::kLong), src.index({owned}).to(cache.scalar_type()));
  }
}

// dcpgraph::kv_cache_write_fp8_'s fast path (called by ops/paged.py's write_slots_fp8): each
// owned token's rows quantised as ops/quant.py's quantize_fp8 does, bit for bit, and written with
// their scales. Per (token, head, group of ``group`` elements, the last zero padded):
//   a = max |x|,  scale = a > 0 ? 2^clamp(ceil(log2(fl(a / 448))), kmin, kmax) : 1
//   q = e4m3(clamp(fl(x / scale), -448, 448))                     (round to nearest even)
// with torch's edge cases: a NaN in the group makes its scale 1 (NaN > 0 is false), an infinite
// a gives k = 0 (torch.frexp(inf) has exponent 0). Returns false, writing nothing, when the
// layouts are not dense rows (cache/scales dims 2.. contiguous, new [T, H, D] any float dtype):
// the caller's torch path then writes.
inline bool kv_cache_write_fp8(at::Tensor& cache, const at::Tensor& src, const at::Tensor& slot_mapping,
                               at::Tensor& scales, int64_t group, int64_t kmin, int64_t kmax) {
  if (cache.scalar_type() != at::kFloat8_e4m3fn || cache.dim() != 4 || src.dim() != 3 || scales.dim() != 4 ||
      scales.scalar_type() != at::kFloat || group <= 0 || !cache.device().is_cpu() || !src.device().is_cpu())
    return false;
  const at::Tensor slots = slots_of(slot_mapping, src.size(0));
  if (!slots.defined()) return false;
  const int64_t heads = cache.size(2), d = cache.size(3), groups = (d + group - 1) / group;
  if (src.size(1) != heads || src.size(2) != d || scales.size(0) != cache.size(0) ||
      scales.size(1) != cache.size(1) || scales.size(2) != heads || scales.size(3) != groups ||
      cache.stride(3) != 1 || cache.stride(2) != d || scales.stride(3) != 1 || scales.stride(2) != groups)
    return false;
  const at::Tensor x = src.to(at::kFloat).contiguous();
  const int64_t tokens = src.size(0), block = cache.size(1);
  const int64_t* sp = slots.data_ptr<int64_t>();
  check_slots(sp, tokens, cache, "kv_cache_write_fp8_");
  const float* xp = x.data_ptr<float>();
  auto* cp = reinterpret_cast<c10::Float8_e4m3fn*>(cache.data_ptr());
  float* scp = scales.data_ptr<float>();
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t s = sp[t];
    if (s < 0) continue;
    c10::Float8_e4m3fn* row = cp + (s / block) * cache.stride(0) + (s % block) * cache.stride(1);
    float* srow = scp + (s / block) * scales.stride(0) + (s % block) * scales.stride(1);
    for (int64_t h = 0; h < heads; ++h) {
      const float* xh = xp + (t * heads + h) * d;
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t lo = g * group, hi = std::min(d, lo + group);
        float amax = 0.f;
        bool nan = false;
        for (int64_t i = lo; i < hi; ++i) {
          const float a = std::fabs(xh[i]);
          nan |= std::isnan(a);
          amax = a > amax ? a : amax;
        }
        float scale = 1.f;
        if (!nan && amax > 0.f) {
          const float y = amax / 448.f;
          int e = 0;
          int64_t k = 0;
          if (std::isfinite(y)) {
            const float m = std::frexp(y, &e);
            k = m == 0.5f ? e - 1 : e;
          }
          scale = std::ldexp(1.f, static_cast<int>(std::min(std::max(k, kmin), kmax)));
        }
        srow[h * groups + g] = scale;
        for (int64_t i = lo; i < hi; ++i) {
          const float q = xh[i] / scale;
          row[h * d + i] = c10::Float8_e4m3fn(std::isnan(q) ? q : std::min(std::max(q, -448.f), 448.f));
        }
      }
    }
  }
  return true;
}

}  // namespace kv_write

TORCH_LIBRARY_IMPL(dcpgraph, CPU, m) { m.impl("kv_cache_write_", &kv_write::kv_cache_write_cpu); }
