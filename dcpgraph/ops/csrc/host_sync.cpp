// Publish and wait for the shared-memory collectives of ranks on one host
// (dcpgraph/runtime/host_collectives.py). Pointers come from Python as integers into one mapped
// segment; each rank's arrival flag is an int64 on its own cache line.
//
//   publish(dst, src, nbytes, flag, seq): copy the payload into this rank's slot, then a full fence
//     (orders every store of the copy, non-temporal ones included, before the flag), then the flag
//     = seq with release semantics: a rank that sees the flag sees the payload;
//   wait_all(flags, stride, n, seq, spins): whether every flag (n of them, `stride` int64 apart)
//     reached seq, re-reading with acquire loads for at most `spins` rounds (a pause in each), so
//     the caller can yield, check its peers and its deadline between calls.
#include <pybind11/pybind11.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define DCPGRAPH_PAUSE() _mm_pause()
#elif defined(__aarch64__)
#define DCPGRAPH_PAUSE() asm volatile("yield" ::: "memory")
#else
#define DCPGRAPH_PAUSE() ((void)0)
#endif

namespace {

std::atomic<int64_t>* flag_at(std::uintptr_t address) {
  return reinterpret_cast<std::atomic<int64_t>*>(address);
}

void publish(std::uintptr_t dst, std::uintptr_t src, int64_t nbytes, std::uintptr_t flag, int64_t seq) {
  if (nbytes > 0) std::memcpy(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), nbytes);
  std::atomic_thread_fence(std::memory_order_seq_cst);
  flag_at(flag)->store(seq, std::memory_order_release);
}

bool all_arrived(std::uintptr_t flags, int64_t stride, int64_t n, int64_t seq) {
  for (int64_t r = 0; r < n; ++r) {
    if (flag_at(flags + static_cast<std::uintptr_t>(r * stride) * sizeof(int64_t))->load(std::memory_order_acquire) < seq)
      return false;
  }
  return true;
}

bool wait_all(std::uintptr_t flags, int64_t stride, int64_t n, int64_t seq, int64_t spins) {
  pybind11::gil_scoped_release unlocked;  // other Python threads of the rank run meanwhile
  for (int64_t i = 0; i < spins; ++i) {
    if (all_arrived(flags, stride, n, seq)) return true;
    DCPGRAPH_PAUSE();
  }
  return all_arrived(flags, stride, n, seq);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("publish", &publish, "copy a payload into this rank's slot, fence, then set its arrival flag");
  m.def("wait_all", &wait_all, "whether every rank's flag reached seq within `spins` rounds");
}
