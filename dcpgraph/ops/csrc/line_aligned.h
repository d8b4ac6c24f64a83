// Vectors whose storage starts on a 64-byte cache line (LineVector), for the paged decode
// kernels' working buffers. malloc aligns to 16 bytes, so a 64-byte vector load or store, or a
// 64-byte AMX tile row, at a multiple of 64 elements' bytes into such a buffer would span two
// cache lines: two line accesses where one would do.
#pragma once

#include <cstddef>
#include <new>
#include <vector>

template <class E>
struct LineAligned {
  using value_type = E;
  LineAligned() = default;
  template <class U>
  LineAligned(const LineAligned<U>&) {}
  E* allocate(std::size_t n) { return static_cast<E*>(::operator new(n * sizeof(E), std::align_val_t(64))); }
  void deallocate(E* p, std::size_t) { ::operator delete(p, std::align_val_t(64)); }
  template <class U>
  bool operator==(const LineAligned<U>&) const { return true; }
  template <class U>
  bool operator!=(const LineAligned<U>&) const { return false; }
};

template <class E>
using LineVector = std::vector<E, LineAligned<E>>;
