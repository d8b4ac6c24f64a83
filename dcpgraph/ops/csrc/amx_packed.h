// AMX paged decode of items with at most 8 query rows (GQA decode; speculative verification
// where G * lq <= 8) and values at most 128 wide, over 32-token key groups (two 16-token tiles).
//
// Included at the end of paged_decode_amx.h (inside its AMX guard), which defines Caches, Rows,
// the tile constants and Decoder, the path for every other item; operands come from
// amx_operands.h as there. What differs:
//   values   one A tile carries both halves of the even/odd value product: rows n < 8 hold
//            P[n, t] in the low half of each dword, rows 8 + n in the high half. One product
//            with a value tile then yields chunk c's even columns in accumulator rows n and its
//            odd ones in rows 8 + n, so the dv / 32 accumulator tiles fit in tiles 4-7 and stay
//            there for the whole item: no accumulator loads or stores per key group, half the
//            value products of Decoder's, one weight tile per token tile. When a row's running
//            max rises its accumulator rows are stored, scaled and reloaded (rescale_resident).
//   softmax  two tokens per vector (8 rows each), so no exp lane is spent on padding columns.
// Tiles 0, 1: the two token tiles' scores, then value rows; 2: queries, then weights; 3: key
// rows, then value rows; 4-7: the accumulators.
#pragma once

namespace amx {

// ``T``: uint16_t (bf16 cache) or uint8_t (fp8).
template <class T>
class PackedDecoder {
 public:
  static constexpr int64_t TOK = ROWS_TOK;
  static constexpr int64_t QT = TOK / 16;
  static_assert(QT == 2, "a packed key group is two 16-token tiles");

  // Whether an item with m query rows over values dv wide takes this path.
  static bool fits(int64_t m, int64_t dv) { return m <= COLS / 2 && dv <= 4 * 32; }

  explicit PackedDecoder(const Caches<T>& c)
      : c_(c), dp_((c.d + 31) / 32 * 32), dvp_((c.dv + 31) / 32 * 32), pf_(c, TOK), in_(c, 1, pf_) {}

  // Keys [t0, t1) of request r, KV head h: unnormalised acc [m, dv], running max and sum [m].
  void run(int64_t r, int64_t h, int64_t t0, int64_t t1, float* acc, float* mx, float* sm) {
    const int64_t lq = c_.cu[r + 1] - c_.cu[r], m = lq * c_.g, chunks = dvp_ / 32;
    in_.build_queries(r, h, lq, 1);
    std::fill(mx_, mx_ + COLS, -INFINITY);
    std::fill(sm_, sm_ + COLS, 0.f);
    in_.row_bounds(r, m, 1, t1);
    _tile_zero(4);
    if (chunks > 1) _tile_zero(5);
    if (chunks > 2) _tile_zero(6);
    if (chunks > 3) _tile_zero(7);
    const int64_t end = std::max(t0, in_.jmax[0]);
    for (int64_t t = t0; t < end; t += TOK) {
      Rows keys, values;
      // step() calls per token tile: key rows, one per 32-column score step, softmax (two), values
      const int64_t nt = in_.load_group(r, h, t, end, QT * (1 + dp_ / 32 + 2 + 1), keys, values);
      scores(keys, nt);
      softmax(t, nt);
      this->values(values, (nt + 15) / 16, chunks);
      pf_.finish();
    }
    float* o = o_;  // chunk c at o[256 c]: 16 rows x 16 fp32 columns, even in row n, odd in 8 + n
    store_resident(o, chunks);
    for (int64_t n = 0; n < m; ++n) {
      interleave_row([&](int64_t c) { return o + 256 * c + 16 * n; },
                     [&](int64_t c) { return o + 256 * c + 16 * (n + COLS / 2); }, c_.dv, acc + n * c_.dv);
      mx[n] = mx_[n];
      sm[n] = sm_[n];
    }
  }

  // Online softmax of the key group, two tokens per vector (lanes 0-7 token t's query rows, 8-15
  // token t + 1's: see dup_low8), so every exp lane is a real row (Decoder::softmax's 16 lanes
  // would be half padding). Pass 1 keeps the scaled scores (-inf where masked or past nt) and
  // each pair's kept lanes for pass 2, which makes the weights as the packed A tiles
  // (pack_weights; times in_.vf[t] when fp8 scales are folded).
  void softmax(int64_t t0, int64_t nt) {
    const float* s = s_;
    float* xs = xs_;  // scaled scores, token pair u at xs + 16 u
    const __m512i second = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const __m512i bound = dup_low8(_mm512_loadu_si512(in_.jb.data()));
    const bool masked = t0 + nt > in_.jmin[0];
    __m512 bm = _mm512_set1_ps(-INFINITY);
    __mmask16 nan = 0;
    for (int64_t u = 0; u < (nt + 1) / 2; ++u) {
      const int64_t t = 2 * u;  // t + 1 <= nt <= TOK - 1 when nt is odd: in s_ and kf, not kept
      __mmask16 keep = t + 1 < nt ? 0xFFFF : 0x00FF;
      const __m512i token = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(t0 + t)), second);
      if (masked) keep &= _mm512_cmplt_epi32_mask(token, bound);
      const __m512 raw = _mm512_mask_loadu_ps(_mm512_loadu_ps(s + t * COLS), 0xFF00, s + t * COLS + 8);
      const __m512 x = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), keep, raw, pair(in_.kf, t));
      _mm512_storeu_ps(xs + 16 * u, x);
      keep_[u] = keep;
      nan |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
      bm = _mm512_max_ps(bm, x);
    }
    bm = _mm512_max_ps(bm, swap_halves(bm));
    nan = static_cast<__mmask16>((nan | nan >> 8) & 0xFF);
    nan = static_cast<__mmask16>(nan | nan << 8);
    float* mxp = mx_;
    float* smp = sm_;
    const __m512 old = dup_low8(_mm512_loadu_ps(mxp));
    const __m512 nm = _mm512_max_ps(old, bm);
    const __mmask16 grew = _mm512_cmp_ps_mask(nm, old, _CMP_GT_OQ) &
                           _mm512_cmp_ps_mask(old, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ) & 0x00FF;
    if (grew) {  // rescale the rows whose running max rose
      const __m512 alpha = exp512(_mm512_sub_ps(old, nm));
      alignas(64) float a[COLS];
      _mm512_store_ps(a, alpha);
      _mm512_storeu_ps(smp, _mm512_mask_mul_ps(_mm512_loadu_ps(smp), grew, _mm512_loadu_ps(smp), alpha));
      rescale_resident(grew, a);
    }
    _mm512_storeu_ps(mxp, nm);
    __m512 tot = _mm512_setzero_ps();
    for (int64_t q = 0; q < (nt + 15) / 16; ++q) {
      pf_.step();
      pf_.step();
      __m512 p[8];
      for (int k = 0; k < 8; ++k) {
        const int64_t u = q * 8 + k, t = 2 * u;
        p[k] = _mm512_setzero_ps();
        if (t >= nt) continue;
        __m512 e = _mm512_maskz_mov_ps(keep_[u], exp512(_mm512_sub_ps(_mm512_loadu_ps(xs + 16 * u), nm)));
        tot = _mm512_add_ps(tot, e);
        if (in_.fold) e = _mm512_maskz_mul_ps(keep_[u], e, pair(in_.vf, t));
        p[k] = e;
      }
      pack_weights(p, pt_ + q * TILE_ELEMS);
    }
    tot = _mm512_add_ps(tot, swap_halves(tot));
    _mm512_storeu_ps(smp, _mm512_mask_mov_ps(_mm512_add_ps(_mm512_loadu_ps(smp), tot), nan, _mm512_set1_ps(NAN)));
  }

  // A per-token factor as a two-token vector: f[t] in lanes 0-7, f[t + 1] in lanes 8-15.
  static __m512 pair(const float* f, int64_t t) {
    return _mm512_mask_mov_ps(_mm512_set1_ps(f[t]), 0xFF00, _mm512_set1_ps(f[t + 1]));
  }

  // s_[t, n] = K[t, :] . Q[n, :] for the key group's (at most two) token tiles: Decoder::scores
  // with tiles 0, 1 for the scores, 2 for the queries and 3 for the key rows.
  void scores(const Rows& keys, int64_t nt) {
    const int64_t ksteps = dp_ / 32, nq = (nt + 15) / 16;
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t kk = 0; kk < ksteps; ++kk) {
      _tile_loadd(2, in_.queries(0) + kk * TILE_ELEMS, 64);
      DCPGRAPH_SCORE_TILE(pf_, keys, 0, kk, 3, 0, 2);
      if (nq > 1) DCPGRAPH_SCORE_TILE(pf_, keys, 1, kk, 3, 1, 2);
    }
    _tile_stored(0, s_, 64);
    _tile_stored(1, s_ + 16 * COLS, 64);
  }

  // Accumulators (tiles 4-7, one per 32-column chunk) += the packed weights times the value rows.
  void values(const Rows& values, int64_t nq, int64_t chunks) {
    for (int64_t q = 0; q < nq; ++q) {
      pf_.step();
      const uint16_t* v = values.base[q];
      const int64_t vs = values.stride[q];
      _tile_loadd(2, pt_ + q * TILE_ELEMS, 64);
      _tile_loadd(0, v, vs);
      _tile_dpbf16ps(4, 2, 0);
      if (chunks > 1) {
        _tile_loadd(1, v + 32, vs);
        _tile_dpbf16ps(5, 2, 1);
      }
      if (chunks > 2) {
        _tile_loadd(3, v + 64, vs);
        _tile_dpbf16ps(6, 2, 3);
      }
      if (chunks > 3) {
        _tile_loadd(0, v + 96, vs);
        _tile_dpbf16ps(7, 2, 0);
      }
    }
  }

  // The resident accumulators to / from o (chunk c at o + 256 c, 64-byte rows).
  void store_resident(float* o, int64_t chunks) {
    _tile_stored(4, o, 64);
    if (chunks > 1) _tile_stored(5, o + 256, 64);
    if (chunks > 2) _tile_stored(6, o + 512, 64);
    if (chunks > 3) _tile_stored(7, o + 768, 64);
  }
  void load_resident(const float* o, int64_t chunks) {
    _tile_loadd(4, o, 64);
    if (chunks > 1) _tile_loadd(5, o + 256, 64);
    if (chunks > 2) _tile_loadd(6, o + 512, 64);
    if (chunks > 3) _tile_loadd(7, o + 768, 64);
  }
  // Rows n and 8 + n of every resident accumulator times a[n] where the running max of query
  // row n rose (grew's bit n).
  void rescale_resident(__mmask16 grew, const float* a) {
    const int64_t chunks = dvp_ / 32;
    float* o = o_;
    store_resident(o, chunks);
    for (int64_t c = 0; c < chunks; ++c)
      for (int n = 0; n < COLS / 2; ++n) {
        if (!((grew >> n) & 1)) continue;
        const __m512 an = _mm512_set1_ps(a[n]);
        for (int e = 0; e < 2; ++e) {
          float* row = o + c * 256 + (e * (COLS / 2) + n) * 16;
          _mm512_storeu_ps(row, _mm512_mul_ps(_mm512_loadu_ps(row), an));
        }
      }
    load_resident(o, chunks);
  }

  const Caches<T>& c_;
  const int64_t dp_, dvp_;
  alignas(64) uint16_t pt_[QT * TILE_ELEMS];  // the packed weight tile per token tile
  alignas(64) float s_[TOK * COLS];           // scores, token t at s_ + 16 t
  alignas(64) float xs_[TOK / 2 * COLS];      // softmax pass 1: scaled scores per token pair
  alignas(64) float o_[4 * 256];              // the resident accumulators, when stored
  alignas(64) float mx_[COLS], sm_[COLS];     // running max and sum per query row (lanes 0-7)
  __mmask16 keep_[TOK / 2];                   // softmax pass 1: each pair's kept lanes
  Prefetcher<T> pf_;
  Operands<T, TOK> in_;
};

}  // namespace amx
