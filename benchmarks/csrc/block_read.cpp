// The read ceiling of a block table: every byte of the blocks a table names, read in the table's
// order with nothing else to do (a benchmark diagnostic, not a kernel of the library).
//
// read_blocks(tensors, table, blocks, prefetch) walks table[r, 0:blocks] for every request row r
// and, for each named physical block b, reads the bytes of every tensor's b-th slice (dim 0, one
// block: contiguous rows) as 64-byte vectors (the last one masked), summing them as uint64 lanes so nothing can be
// skipped. With ``prefetch`` > 0, each line of the block ``prefetch`` entries ahead is prefetched
// (into L2) as the matching line of the current block is read, the spread schedule the paged
// decode kernels use. Threads split the walk into contiguous ranges of table entries.
#include <torch/extension.h>

#include <immintrin.h>

#include <cstdint>
#include <vector>

namespace {

struct Slice {
  const char* base;
  int64_t stride;  // bytes between consecutive blocks (dim 0)
  int64_t bytes;   // bytes of one block
};

uint64_t read_range(const std::vector<Slice>& slices, const int32_t* entries, int64_t n, int64_t prefetch) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  __m512i acc = _mm512_setzero_si512();
#elif defined(__AVX2__)
  __m256i acc = _mm256_setzero_si256();
  uint64_t tail = 0;
#else
  uint64_t acc = 0;
#endif
  for (int64_t i = 0; i < n; ++i) {
    const int64_t blk = entries[i];
    const int64_t ahead = prefetch > 0 && i + prefetch < n ? entries[i + prefetch] : -1;
    for (const Slice& s : slices) {
      const char* p = s.base + blk * s.stride;
      const char* f = ahead >= 0 ? s.base + ahead * s.stride : nullptr;
      for (int64_t x = 0; x < s.bytes; x += 64) {
        if (f) __builtin_prefetch(f + x, 0, 2);
        const int64_t left = std::min<int64_t>(64, s.bytes - x);
#if defined(__AVX512F__) && defined(__AVX512BW__)
        const __mmask64 mk = left == 64 ? ~__mmask64(0) : (__mmask64(1) << left) - 1;
        acc = _mm512_add_epi64(acc, _mm512_maskz_loadu_epi8(mk, p + x));
#elif defined(__AVX2__)
        // Two 32-byte loads a line; a short last line's bytes one at a time (a reader with no
        // vector loads at all would measure its own instructions, not the memory).
        int64_t w = 0;
        for (; w + 32 <= left; w += 32)
          acc = _mm256_add_epi64(acc, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + x + w)));
        for (; w < left; ++w) tail += static_cast<uint8_t>(p[x + w]);
#else
        for (int64_t w = 0; w < left; ++w) acc += static_cast<uint8_t>(p[x + w]);
#endif
      }
    }
  }
#if defined(__AVX512F__) && defined(__AVX512BW__)
  return static_cast<uint64_t>(_mm512_reduce_add_epi64(acc));
#elif defined(__AVX2__)
  alignas(32) uint64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), acc);
  return lanes[0] + lanes[1] + lanes[2] + lanes[3] + tail;
#else
  return acc;
#endif
}

}  // namespace

int64_t read_blocks(const std::vector<at::Tensor>& tensors, const at::Tensor& table, int64_t blocks, int64_t prefetch) {
  TORCH_CHECK(table.scalar_type() == at::kInt && table.dim() == 2 && table.is_contiguous(),
              "read_blocks: table must be a contiguous int32 [requests, width] tensor");
  TORCH_CHECK(blocks >= 0 && blocks <= table.size(1), "read_blocks: blocks must lie in [0, ", table.size(1), "]");
  std::vector<Slice> slices;
  for (const at::Tensor& t : tensors) {
    TORCH_CHECK(t.device().is_cpu() && t.dim() >= 1, "read_blocks: CPU tensors with a block dimension");
    const int64_t row = t.numel() / std::max<int64_t>(t.size(0), 1) * t.element_size();
    TORCH_CHECK(t[0].is_contiguous(), "read_blocks: each block must be contiguous");
    slices.push_back({static_cast<const char*>(t.data_ptr()), t.stride(0) * t.element_size(), row});
  }
  const int64_t rows = table.size(0), width = table.size(1), total = rows * blocks;
  const int32_t* tab = table.data_ptr<int32_t>();
  std::vector<uint64_t> sums(at::get_num_threads(), 0);
  at::parallel_for(0, total, 1, [&](int64_t begin, int64_t end) {
    uint64_t s = 0;
    for (int64_t i = begin; i < end;) {  // one request row's entries at a time
      const int64_t r = i / blocks, stop = std::min(end, (r + 1) * blocks);
      s += read_range(slices, tab + r * width + i % blocks, stop - i, prefetch);
      i = stop;
    }
    sums[at::get_thread_num()] += s;
  });
  uint64_t s = 0;
  for (uint64_t x : sums) s += x;
  return static_cast<int64_t>(s & 0x7FFFFFFFFFFFFFFFull);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("read_blocks", &read_blocks, "read every byte of a table's blocks"); }
