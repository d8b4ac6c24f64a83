// Software prefetch schedule of the AMX paged decoder (paged_decode_amx.h, which defines Caches
// and TOK before including this inside its AMX guard).
#pragma once

namespace amx {

// Software prefetch (into L2) spread through a key group's work: the lines of the tokens
// prefetch_blocks blocks ahead, rounded up to whole key groups (K rows, then V rows unless they
// are a prefix of K's), a few lines per step(). A scattered table hides the next address from the
// hardware prefetcher, and a burst of prefetches finds every fill buffer busy: most are dropped
// (measured: a per-group burst changed nothing, the same lines spread over the group's work made
// GQA 8:1 decode at 128K 1.4x (bf16) and 1.8x (fp8) faster).
template <class T>
class Prefetcher {
 public:
  explicit Prefetcher(const Caches<T>& c) : c_(c) {
    krow_ = (c.d * int64_t(sizeof(T)) + 63) / 64;
    vrow_ = c.value_prefix ? 0 : (c.dv * int64_t(sizeof(T)) + 63) / 64;
  }
  // Start the group at token t of request r (item end t1), expecting ``calls`` step() calls.
  void start(int64_t r, int64_t h, int64_t t, int64_t t1, int64_t calls) {
    u_ = t + (c_.prefetch_blocks * c_.bsz + TOK - 1) / TOK * TOK;
    end_ = c_.prefetch_blocks > 0 ? std::min(u_ + TOK, t1) : u_;
    line_ = 0;
    table_ = c_.table + r * c_.width;
    h_ = h;
    const int64_t lines = std::max<int64_t>(0, end_ - u_) * (krow_ + vrow_);
    per_ = calls > 0 ? (lines + calls - 1) / calls : lines;
  }
  inline void step() {
    for (int64_t i = 0; i < per_ && u_ < end_; ++i) {
      const int64_t blk = table_[u_ / c_.bsz], off = u_ % c_.bsz;
      const char* p = line_ < krow_
                          ? reinterpret_cast<const char*>(c_.kp + blk * c_.ks0 + off * c_.ks1 + h_ * c_.ks2) + line_ * 64
                          : reinterpret_cast<const char*>(c_.vp + blk * c_.vs0 + off * c_.vs1 + h_ * c_.vs2) + (line_ - krow_) * 64;
      __builtin_prefetch(p, 0, 2);
      if (++line_ == krow_ + vrow_) {
        line_ = 0;
        ++u_;
      }
    }
  }
  void finish() {
    per_ = int64_t(1) << 40;
    step();
  }

 private:
  const Caches<T>& c_;
  int64_t krow_, vrow_, u_ = 0, end_ = 0, line_ = 0, per_ = 0, h_ = 0;
  const int32_t* table_ = nullptr;
};

}  // namespace amx
