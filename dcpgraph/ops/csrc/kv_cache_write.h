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

template <class I>
void copy_rows(at::Tensor& cache, const at::Tensor& src, const I* slots, int64_t tokens) {
  const int64_t slots_total = cache.size(0) * cache.size(1), block = cache.size(1);
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK_INDEX(slots[t] < slots_total, "kv_cache_write_: slot ", slots[t], " of token ", t,
                      " is outside the cache's ", slots_total, " slots");
  const int64_t elem = cache.element_size(), row = src.numel() / std::max<int64_t>(tokens, 1) * elem;
  char* base = static_cast<char*>(cache.data_ptr());
  const char* from = static_cast<const char*>(src.data_ptr());
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t s = slots[t];
    if (s < 0) continue;
    std::memcpy(base + ((s / block) * cache.stride(0) + (s % block) * cache.stride(1)) * elem, from + t * row, row);
  }
}

inline void kv_cache_write_cpu(at::Tensor& cache, const at::Tensor& src, const at::Tensor& slot_mapping) {
  const auto st = slot_mapping.scalar_type();
  if (dense_rows(cache, src) && slot_mapping.dim() == 1 && slot_mapping.size(0) == src.size(0) &&
      (st == at::kLong || st == at::kInt) && slot_mapping.device().is_cpu()) {
    const at::Tensor slots = slot_mapping.contiguous();
    if (st == at::kLong) copy_rows(cache, src, slots.data_ptr<int64_t>(), src.size(0));
    else copy_rows(cache, src, slots.data_ptr<int32_t>(), src.size(0));
    return;
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

}  // namespace kv_write

TORCH_LIBRARY_IMPL(dcpgraph, CPU, m) { m.impl("kv_cache_write_", &kv_write::kv_cache_write_cpu); }
