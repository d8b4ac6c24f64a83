// Operands of the AMX paged decoder's tile products (paged_decode_amx.h, which defines Caches,
// Rows and the tile constants and includes this inside its AMX guard): the queries as B tiles,
// the key and value rows of a key group as tiles in place in the cache or staged as bf16, the
// rows' key bounds, and the fp8 scales folded into the scores and weights. Where the rows come
// from; paged_decode_amx.h's Decoder does the arithmetic on them.
#pragma once

namespace amx {

// ``T``: uint16_t (bf16 cache) or uint8_t (fp8); ``TOK``: tokens per key group.
template <class T, int64_t TOK>
class Operands {
 public:
  static constexpr bool kFp8 = std::is_same_v<T, uint8_t>;
  static constexpr int64_t QT = TOK / 16;  // token tiles per key group

  // ``mgroups``: the most query-row groups an item has; ``pf``: the prefetcher whose step() the
  // staging loops call.
  Operands(const Caches<T>& c, int64_t mgroups, Prefetcher<T>& pf)
      : fold(kFp8 && !c.value_prefix && c.group >= c.d && c.group >= c.dv), jb(mgroups * COLS), jmax(mgroups),
        jmin(mgroups), c_(c), dp_((c.d + 31) / 32 * 32), dvp_((c.dv + 31) / 32 * 32),
        qv_(mgroups * (dp_ / 32) * TILE_ELEMS), kst_(TOK * dp_), vst_(TOK * dvp_), pf_(pf) {
    if constexpr (kFp8) {
      lut_ = fp8_lut();
      // scale group of each 32-element step (16: a padding step, whose step word stays 0)
      chunk_group_.resize(std::max(dp_, dvp_) / 32);
      for (size_t x = 0; x < chunk_group_.size(); ++x) {
        const int64_t g = int64_t(x) * 32 / c.group;
        chunk_group_[x] = static_cast<uint8_t>(int64_t(x) * 32 < std::max(c.d, c.dv) && g < 16 ? g : 16);
      }
    }
    std::fill(kf, kf + TOK, c.scale);
    std::fill(vf, vf + TOK, 1.f);
  }

  // The queries of row group j as B tiles (dp / 32 of them, one per 32-column step).
  const uint16_t* queries(int64_t j) const { return qv_.data() + j * (dp_ / 32) * TILE_ELEMS; }

  // fp8 with one scale per K row and per V row (GQA heads up to a scale group wide): the rows are
  // staged unscaled and the scales folded into the scores (kf: softmax scale x key scale per
  // token) and the weights (vf: value scale per token); otherwise kf holds the softmax scale.
  const bool fold;
  float kf[TOK], vf[TOK];
  std::vector<int32_t> jb;          // keys each query row sees (see row_bounds)
  std::vector<int64_t> jmax, jmin;  // per query-row group

  // Per query row (column n of group j) the number of keys it sees in [0, t1): jb[16 j + n];
  // jmax[j] / jmin[j] over the group's rows. Unbounded rows see all t1 keys; padding columns
  // none (their weights are masked to zero, but they do not make a group take the masked path).
  void row_bounds(int64_t r, int64_t m, int64_t mg, int64_t t1) {
    for (int64_t j = 0; j < mg; ++j) {
      int64_t hi = 0, lo = t1;
      for (int64_t n = 0; n < COLS; ++n) {
        const int64_t i = j * COLS + n;
        int64_t b = 0;
        if (i < m) b = c_.bound ? std::min(t1, c_.bound[c_.cu[r] + i / c_.g]) : t1;
        jb[i] = static_cast<int32_t>(std::max<int64_t>(b, 0));
        hi = std::max(hi, b);
        if (i < m) lo = std::min(lo, b);
      }
      jmax[j] = hi;
      jmin[j] = c_.bound ? std::max<int64_t>(lo, 0) : t1;
    }
  }

  // Queries of (r, h) as B tiles: qv[j][kk] is [16 pairs of d][16 columns x 2] bf16, column n of
  // group j holding query row 16 j + n (row jr * g + gi: token jr, head h * g + gi); zero padded.
  void build_queries(int64_t r, int64_t h, int64_t lq, int64_t mg) {
    const int64_t ksteps = dp_ / 32;
    std::fill(qv_.begin(), qv_.begin() + mg * ksteps * TILE_ELEMS, uint16_t(0));
    const __m512i at = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                          _mm512_set1_epi32(16));
    for (int64_t jr = 0; jr < lq; ++jr)
      for (int64_t gi = 0; gi < c_.g; ++gi) {
        const int64_t i = jr * c_.g + gi, n = i % COLS;
        const uint16_t* src = c_.q + ((c_.cu[r] + jr) * c_.hq + h * c_.g + gi) * c_.d;
        int32_t* dst = reinterpret_cast<int32_t*>(qv_.data() + (i / COLS) * ksteps * TILE_ELEMS);
        // dword (2 elements) p of each 32-element step goes to row p, column n of its tile
        const __m512i idx = _mm512_add_epi32(at, _mm512_set1_epi32(static_cast<int32_t>(n)));
        for (int64_t x = 0; x < c_.d; x += 32)
          _mm512_i32scatter_epi32(dst + (x / 32) * (TILE_ELEMS / 2), idx, _mm512_maskz_loadu_epi16(mask32(c_.d, x), src + x), 4);
      }
  }

  // The key group at token t (item end ``end``): its tokens located, the prefetcher started for
  // ``calls`` step() calls, its key and value rows as tile operands; returns its token count.
  int64_t load_group(int64_t r, int64_t h, int64_t t, int64_t end, int64_t calls, Rows& keys, Rows& values) {
    const int64_t nt = std::min(TOK, end - t);
    locate(r, t, nt);
    pf_.start(r, h, t, end, calls);
    key_rows(h, nt, keys);
    value_rows(h, nt, keys, values);
    return nt;
  }

  // blk_[i], off_[i]: physical block and slot of token t + i (i < n), walking the table with one
  // division per call (a division per token cost more than the rest of the bookkeeping).
  void locate(int64_t r, int64_t t, int64_t n) {
    int64_t b = t / c_.bsz, off = t % c_.bsz;
    const int32_t* row = c_.table + r * c_.width;
    for (int64_t i = 0; i < n; ++i) {
      blk_[i] = row[b];
      off_[i] = off;
      if (++off == c_.bsz) {
        off = 0;
        ++b;
      }
    }
  }
  // Key rows as A operands: bf16 in place when 16 rows of one block and the width a multiple of
  // 32 (rows past nt are read and their scores ignored), otherwise staged (rows past nt zero).
  void key_rows(int64_t h, int64_t nt, Rows& keys) {
    for (int64_t qi = 0; qi < QT; ++qi) {
      pf_.step();
      keys.base[qi] = nullptr;
      keys.stride[qi] = 0;
      const int64_t cnt = std::max<int64_t>(0, std::min<int64_t>(16, nt - qi * 16));
      if (cnt == 0) continue;
      if (!kFp8 && c_.d % 32 == 0 && one_block(qi)) {
        keys.base[qi] = reinterpret_cast<const uint16_t*>(key_at(h, qi * 16));
        keys.stride[qi] = c_.ks1 * 2;
        continue;
      }
      keys.base[qi] = stage_tile(qi, cnt, c_.d, dp_, kst_.data() + qi * 16 * dp_,
                                 [&](int64_t e) { return key_at(h, e); }, [&](int64_t e) { return key_scales(h, e); });
      if (fold)
        for (int64_t e = qi * 16; e < qi * 16 + cnt; ++e) kf[e] = c_.scale * key_scales(h, e)[0];
      keys.stride[qi] = dp_ * 2;
    }
  }

  // Value rows as B operands (32 columns per tile): in place when a full tile of 16 bf16 rows of
  // one block with the width a multiple of 32 (MLA: the key rows' first dv columns, in place or
  // as staged), otherwise staged with rows past nt zero (a garbage row times a zero weight could
  // be NaN).
  void value_rows(int64_t h, int64_t nt, const Rows& keys, Rows& values) {
    for (int64_t qi = 0; qi < QT; ++qi) {
      values.base[qi] = nullptr;
      values.stride[qi] = 0;
      const int64_t cnt = std::max<int64_t>(0, std::min<int64_t>(16, nt - qi * 16));
      if (cnt == 0) continue;
      if (c_.value_prefix && (kFp8 || keys.base[qi] == kst_.data() + qi * 16 * dp_ || cnt == 16)) {
        values.base[qi] = keys.base[qi];  // staged key rows are zero past nt
        values.stride[qi] = keys.stride[qi];
        continue;
      }
      if (!kFp8 && !c_.value_prefix && cnt == 16 && c_.dv % 32 == 0 && one_block(qi)) {
        values.base[qi] = reinterpret_cast<const uint16_t*>(value_at(h, qi * 16));
        values.stride[qi] = c_.vs1 * 2;
        continue;
      }
      // value_at / value_scales also address a prefix of the key rows (same pointer and strides)
      values.base[qi] = stage_tile(qi, cnt, c_.dv, dvp_, vst_.data() + qi * 16 * dvp_,
                                   [&](int64_t e) { return value_at(h, e); },
                                   [&](int64_t e) { return value_scales(h, e); });
      if (fold)
        for (int64_t e = qi * 16; e < qi * 16 + cnt; ++e) vf[e] = value_scales(h, e)[0];
      values.stride[qi] = dvp_ * 2;
    }
  }


 private:
  const T* key_at(int64_t h, int64_t i) const { return c_.kp + blk_[i] * c_.ks0 + off_[i] * c_.ks1 + h * c_.ks2; }
  const T* value_at(int64_t h, int64_t i) const { return c_.vp + blk_[i] * c_.vs0 + off_[i] * c_.vs1 + h * c_.vs2; }
  // fp8 scales of token i's rows (with values a prefix of the keys, vsp and its strides are the keys')
  const float* key_scales(int64_t h, int64_t i) const {
    return c_.ksp + blk_[i] * c_.kss0 + off_[i] * c_.kss1 + h * c_.kss2;
  }
  const float* value_scales(int64_t h, int64_t i) const {
    return c_.vsp + blk_[i] * c_.vss0 + off_[i] * c_.vss1 + h * c_.vss2;
  }

  // Whether the 16 rows of tile qi lie in one block (its rows then have the block's row stride).
  bool one_block(int64_t qi) const { return off_[qi * 16] + 16 <= c_.bsz; }

  // Rows 16 qi .. 16 qi + 15 of the key group as bf16 at dst (row stride ``padded``): the first
  // ``cnt`` from the cache (row(e), scales(e): token e's row and its fp8 scales), the rest zero.
  template <class RowOf, class ScalesOf>
  const uint16_t* stage_tile(int64_t qi, int64_t cnt, int64_t width, int64_t padded, uint16_t* dst, RowOf row,
                             ScalesOf scales) const {
    const Fp8Lut lut = lut_;  // the byte tables in registers for the tile's rows, not reloaded per row
    for (int64_t i = 0; i < cnt; ++i) {
      const int64_t e = qi * 16 + i;
      stage_row(lut, row(e), kFp8 && !fold ? scales(e) : nullptr, width, padded, dst + i * padded);
    }
    std::fill(dst + cnt * padded, dst + 16 * padded, uint16_t(0));
    return dst;
  }

  // ``width`` elements of a cache row as ``padded`` bf16 at dst, zero padded: bf16 copied, fp8
  // converted (tables ``lut``) and, unless ``scales`` is null (folded: see softmax()), scaled per
  // scale group (a multiple of 32 elements). Whole 64-element steps load without a mask (measured:
  // the per-step mask and table reloads were a large share of fp8 GQA staging). A row whose group
  // scales are all powers of two in range (what quant.quantize_fp8 writes) takes each group's
  // exponent step from one vector computed per row (measured, fp8 MLA in cache: a scalar scale
  // check and a division per 32 elements were 20 of 120 ns a token); any other row multiplies
  // in fp32 (scale_bf16).
  void stage_row(const Fp8Lut& lut, const T* row, const float* scales, int64_t width, int64_t padded,
                 uint16_t* dst) const {
    if constexpr (kFp8) {
      alignas(64) int16_t steps[32];  // written by exponent_steps (only rows with scales: not GQA's folded rows)
      const bool stepped = scales && exponent_steps(scales, (width + c_.group - 1) / c_.group, steps);
      for (int64_t x = 0; x < padded; x += 64) {
        const int64_t left = width - x;
        const __m512i raw = left >= 64 ? _mm512_loadu_si512(row + x)
                            : left <= 0 ? _mm512_setzero_si512()
                                        : _mm512_maskz_loadu_epi8((__mmask64(1) << left) - 1, row + x);
        __m512i a, b;
        if (stepped) {
          fp8x64_to_bf16_stepped(lut, raw, steps[chunk_group_[x / 32]],
                                 x + 32 < padded ? steps[chunk_group_[x / 32 + 1]] : 0, a, b);
        } else {
          fp8x64_to_bf16(lut, raw, a, b);
          if (scales) {
            a = scale_bf16(a, x < width ? scales[x / c_.group] : 1.f);
            b = scale_bf16(b, x + 32 < width ? scales[(x + 32) / c_.group] : 1.f);
          }
        }
        _mm512_storeu_si512(dst + x, a);
        if (x + 32 < padded) _mm512_storeu_si512(dst + x + 32, b);
      }
    } else {
      for (int64_t x = 0; x < padded; x += 32) _mm512_storeu_si512(dst + x, _mm512_maskz_loadu_epi16(mask32(width, x), row + x));
    }
  }

  const Caches<T>& c_;
  const int64_t dp_, dvp_;
  LineVector<uint16_t> qv_, kst_, vst_;
  Prefetcher<T>& pf_;
  int64_t blk_[TOK], off_[TOK];
  Fp8Lut lut_{};
  std::vector<uint8_t> chunk_group_;  // fp8: scale group of each 32-element step (16: padding)
};

}  // namespace amx
