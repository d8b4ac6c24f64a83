// Software prefetch schedule of the AMX paged decoder (paged_decode_amx.h, which defines Caches
// before including this inside its AMX guard).
#pragma once

namespace amx {

// Software prefetch (into L2) spread through a key group's work: the lines of the tokens
// prefetch_blocks blocks ahead, rounded up to whole key groups (K rows, then V rows unless they
// are a prefix of K's; for fp8 also each new line of their scales), a few lines per step(). A
// scattered table hides the next address from the hardware prefetcher, and a burst of
// prefetches finds every fill buffer busy: most are dropped
// (measured: a per-group burst changed nothing, the same lines spread over the group's work made
// GQA 8:1 decode at 128K 1.4x (bf16) and 1.8x (fp8) faster).
template <class T>
class Prefetcher {
 public:
  // ``tok``: tokens per key group (the decoder's step).
  Prefetcher(const Caches<T>& c, int64_t tok) : c_(c), tok_(tok) {
    krow_ = (c.d * int64_t(sizeof(T)) + 63) / 64;
    vrow_ = c.value_prefix ? 0 : (c.dv * int64_t(sizeof(T)) + 63) / 64;
  }
  // Start the group at token t of request r (item end t1), expecting ``calls`` step() calls.
  void start(int64_t r, int64_t h, int64_t t, int64_t t1, int64_t calls) {
    u_ = t + (c_.prefetch_blocks * c_.bsz + tok_ - 1) / tok_ * tok_;
    end_ = c_.prefetch_blocks > 0 ? std::min(u_ + tok_, t1) : u_;
    line_ = 0;
    table_ = c_.table + r * c_.width;
    h_ = h;
    blk_ = u_ / c_.bsz;
    off_ = u_ % c_.bsz;
    if (u_ < end_) locate();
    const int64_t lines = std::max<int64_t>(0, end_ - u_) * (krow_ + vrow_);
    per_ = calls > 0 ? (lines + calls - 1) / calls : lines;
  }
  // The next ``per_`` lines. Addresses come from the current token's row pointers (found once
  // per token: a table lookup and a division per line took bf16 GQA 8:1 decode in cache from 34
  // to 46 ns a token).
  inline void step() {
    int64_t line = line_, u = u_;
    for (int64_t i = 0; i < per_ && u < end_; ++i) {
      __builtin_prefetch(line < krow_ ? krow_ptr_ + line * 64 : vrow_ptr_ + (line - krow_) * 64, 0, 2);
      if (++line == krow_ + vrow_) {
        line = 0;
        ++u;
        if (++off_ == c_.bsz) {
          off_ = 0;
          ++blk_;
        }
        if (u < end_) locate();
      }
    }
    line_ = line;
    u_ = u;
  }
  void finish() {
    per_ = int64_t(1) << 40;
    step();
  }

 private:
  // The current token's row pointers; for fp8 also a prefetch of its scales' lines where they
  // differ from the last token's.
  void locate() {
    const int64_t b = table_[blk_];
    krow_ptr_ = reinterpret_cast<const char*>(c_.kp + b * c_.ks0 + off_ * c_.ks1 + h_ * c_.ks2);
    vrow_ptr_ = reinterpret_cast<const char*>(c_.vp + b * c_.vs0 + off_ * c_.vs1 + h_ * c_.vs2);
    if constexpr (std::is_same_v<T, uint8_t>) {
      scale_line(c_.ksp + b * c_.kss0 + off_ * c_.kss1 + h_ * c_.kss2, kscale_line_);
      if (!c_.value_prefix) scale_line(c_.vsp + b * c_.vss0 + off_ * c_.vss1 + h_ * c_.vss2, vscale_line_);
    }
  }
  static void scale_line(const float* p, uintptr_t& last) {
    const uintptr_t line = reinterpret_cast<uintptr_t>(p) >> 6;
    if (line == last) return;
    last = line;
    __builtin_prefetch(p, 0, 2);
  }

  const Caches<T>& c_;
  const int64_t tok_;
  int64_t krow_, vrow_, u_ = 0, end_ = 0, line_ = 0, per_ = 0, h_ = 0, blk_ = 0, off_ = 0;
  const int32_t* table_ = nullptr;
  const char* krow_ptr_ = nullptr;
  const char* vrow_ptr_ = nullptr;
  uintptr_t kscale_line_ = 0, vscale_line_ = 0;  // the last scale lines prefetched
};

}  // namespace amx
