// kvchat's paged prefill attention for the CPU: a chunk of new tokens of each sequence against
// the sequence's cached prefix and, causally, against each other, read in place through the
// block table.
//
// torch's CPU flash kernel (what the reference calls) runs a 2,000-token prefill of a 64-wide
// head at 85-170 GFLOP/s on AVX-512, where the model's linear layers run at ~850 through
// oneDNN: most of a long prompt's time to first token went there. Here a task is (sequence,
// KV head, tile of BQ new tokens): its rows are the tile's tokens times the GQA group's query
// heads (scaled once, in float32), so every key and value row brought into registers serves
// all of them. The keys are walked KT at a time (as far as the tile's last token sees): the
// tile's K rows are widened to float32 and transposed into a [D][KT] panel, the scores of R
// rows at once are broadcast FMAs into KT / LANES vectors of keys each, an online softmax in
// float32 keeps each row's running maximum and sum, and the weighted V rows are added into
// the rows' float32 accumulators, R rows by the head's D / LANES vectors in registers. The
// arithmetic is float32 throughout, like the reference's, up to summation order. bfloat16
// caches on CPUs with AVX512-BF16 take attend_tile_bf16 instead: pairs of products in one
// instruction, the probabilities rounded to bfloat16 for P V as torch's kernel rounds them.
//
// Tasks are taken by the threads as they come free, the longest first: a thread whose core
// another process shares takes fewer, where a fixed split would hold every other thread at the
// end of the call for it.
//
// Plain caches (the model's dtype) run `prefill_attention`; quantized ones (int8, fp8 e4m3fn,
// packed int4: kernels/quant.py) `prefill_attention_quantized`, the same tiles with each K and
// V row decoded into them as it is read (kernels/cpu_quant.h), where the reference dequantizes
// the whole context first. With a bfloat16 query on AVX512-BF16 the rows are rounded to
// bfloat16 as they are decoded (the reference dequantizes to the query's dtype) and take
// attend_tile_bf16's pair products: a quantized prefill then costs about 1.1x a plain one,
// against 1.4x through the float32 tiles. Full attention only, head sizes a multiple of the
// vector width; anything else takes the reference (kernels/torch_ops.py decides).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "cpu_quant.h"
#include "cpu_vec.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

namespace {

using namespace kvchat_cpu_vec;    // kernels/cpu_vec.h
using namespace kvchat_cpu_quant;  // kernels/cpu_quant.h

constexpr int64_t BQ = 32;  // new tokens per task

// A thread's working memory, reused from task to task.
struct Scratch {
  std::vector<float> f;
  std::vector<uint32_t> w;  // bfloat16 pairs
  std::vector<c10::BFloat16> decoded;  // attend_tile_bf16: a quantized tile's K and V rows
};

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
// Keys per tile, as vectors of scores per row: 64 keys on AVX-512, 32 on AVX2 (the row's
// maximum, sum and rescale are paid once per tile, so wider is cheaper, up to the registers).
constexpr int NKV = 4;
constexpr int64_t KT = NKV * LANES;
constexpr int64_t R = LANES == 16 ? 4 : 2;  // rows whose scores are in registers together

// Where a task's K and V rows come from, as float32: a plain cache (the model's dtype), each
// row widened...
template <typename T, int NV>
struct PlainRows {
  const T* key_cache;
  const T* value_cache;
  int64_t stride_cb, stride_ct, stride_ch;
  void load(const T* cache, int64_t block, int64_t j, int64_t h, float* dst) const {
    const T* src = cache + block * stride_cb + j * stride_ct + h * stride_ch;
    for (int i = 0; i < NV; ++i) vstore(dst + i * LANES, load_row(src + i * LANES));
  }
  void key(int64_t block, int64_t j, int64_t h, float* dst) const {
    load(key_cache, block, j, h, dst);
  }
  void value(int64_t block, int64_t j, int64_t h, float* dst) const {
    load(value_cache, block, j, h, dst);
  }
  // attend_tile_bf16 reads rows in the cache's own bfloat16, in place
  static constexpr bool kDecodes = false;
  const T* key_row(int64_t block, int64_t j, int64_t h, c10::BFloat16*) const {
    return key_cache + block * stride_cb + j * stride_ct + h * stride_ch;
  }
  const T* value_row(int64_t block, int64_t j, int64_t h, c10::BFloat16*) const {
    return value_cache + block * stride_cb + j * stride_ct + h * stride_ch;
  }
};

// ...or a quantized one (int8, fp8, packed int4: kernels/cpu_quant.h), each row's codes
// decoded and multiplied by their group's scale (code * scale in float32, as the reference
// dequantizes), once per task for all the rows of the tile that read it.
struct QuantSource {
  const uint8_t* key_cache;  // [blocks, block_size, kv_heads, D (int4: D / 2)], bytes
  const uint8_t* value_cache;
  const void* key_scales;  // [blocks, block_size, kv_heads, num_groups], float or Half
  const void* value_scales;
  int64_t num_groups;
  int64_t stride_cb, stride_ct, stride_ch;  // the caches', in bytes
  int64_t stride_sb, stride_st, stride_sh;  // the scale caches', in elements
};

template <Codes C, typename S, int NV>
struct QuantRows {
  static constexpr int64_t D = NV * LANES;
  const QuantSource& src;
  ScaleMode mode;
  int64_t group_size;
  int64_t vector_group[NV];
  explicit QuantRows(const QuantSource& source) : src(source) {
    group_size = D / src.num_groups;
    // one scale a row is a group of the whole row: never folded into the scores here
    mode = group_size % LANES == 0 ? ScaleMode::kVectors : ScaleMode::kChannels;
    for (int i = 0; i < NV; ++i) vector_group[i] = i * LANES / group_size;
  }
  void load(const uint8_t* cache, const void* scales, int64_t block, int64_t j, int64_t h,
            float* dst) const {
    Vec x[NV];
    load_codes<C, NV>(cache + block * src.stride_cb + j * src.stride_ct + h * src.stride_ch, x);
    const S* sr = static_cast<const S*>(scales) + block * src.stride_sb + j * src.stride_st +
                  h * src.stride_sh;
    alignas(64) float chan[D];
    apply_scales<C, S, NV>(mode, sr, vector_group, src.num_groups, group_size, x, chan);
    for (int i = 0; i < NV; ++i) vstore(dst + i * LANES, x[i]);
  }
  void key(int64_t block, int64_t j, int64_t h, float* dst) const {
    load(src.key_cache, src.key_scales, block, j, h, dst);
  }
  void value(int64_t block, int64_t j, int64_t h, float* dst) const {
    load(src.value_cache, src.value_scales, block, j, h, dst);
  }
  // attend_tile_bf16 reads rows decoded into `buf` and rounded to bfloat16, as the reference
  // dequantizes for a bfloat16 query (code * scale in float32, then rounded)
  static constexpr bool kDecodes = true;
  const c10::BFloat16* key_row(int64_t block, int64_t j, int64_t h, c10::BFloat16* buf) const {
    return to_bf16(src.key_cache, src.key_scales, block, j, h, buf);
  }
  const c10::BFloat16* value_row(int64_t block, int64_t j, int64_t h, c10::BFloat16* buf) const {
    return to_bf16(src.value_cache, src.value_scales, block, j, h, buf);
  }
  const c10::BFloat16* to_bf16(const uint8_t* cache, const void* scales, int64_t block,
                               int64_t j, int64_t h, c10::BFloat16* buf) const {
    alignas(64) float row[D];
    load(cache, scales, block, j, h, row);
    for (int i = 0; i < NV; ++i) store_row(buf + i * LANES, vload(row + i * LANES));
    return buf;
  }
};

// One task: tokens [t0, t1) of a sequence's Q new ones, KV head h. NV vectors per head row;
// the K and V rows from `rows_in` (PlainRows or QuantRows).
template <typename T, int NV, typename Rows>
void attend_tile(const T* query, int64_t stride_qt, int64_t stride_qh, const Rows& rows_in,
                 const int32_t* table, int64_t block_size, int64_t seq_len, int64_t q_len,
                 int64_t t0, int64_t t1, int64_t h, int64_t group, float scale, T* out,
                 int64_t stride_ot, int64_t stride_oh, Scratch& scratch) {
  constexpr int64_t D = NV * LANES;
  std::vector<float>& buf = scratch.f;
  constexpr int PVC = NV < 4 ? NV : 4;  // R x PVC accumulators stay in registers
  static_assert(NV % PVC == 0, "head vectors in whole groups");
  const int64_t past = seq_len - q_len;  // tokens cached before the chunk
  const int64_t rows = (t1 - t0) * group;
  const int64_t rows_pad = (rows + R - 1) / R * R;
  buf.resize(rows_pad * D * 2 + rows_pad * 2 + D * KT * 2);
  float* q = buf.data();                  // [rows_pad, D] scaled query rows
  float* acc = q + rows_pad * D;          // [rows_pad, D]
  float* row_max = acc + rows_pad * D;    // [rows_pad]
  float* row_sum = row_max + rows_pad;    // [rows_pad]
  float* kt = row_sum + rows_pad;         // [D, KT] the key tile, transposed
  float* vt = kt + D * KT;                // [KT, D] the value tile
  // row r = token (t0 + r / group), query head (h * group + r % group)
  for (int64_t r = 0; r < rows_pad; ++r) {
    float* qr = q + r * D;
    if (r < rows) {
      const T* src = query + (t0 + r / group) * stride_qt + (h * group + r % group) * stride_qh;
      for (int i = 0; i < NV; ++i) vstore(qr + i * LANES, vmul(load_row(src + i * LANES), vset1(scale)));
    } else {
      std::fill(qr, qr + D, 0.0f);
    }
    std::fill(acc + r * D, acc + (r + 1) * D, 0.0f);
    row_max[r] = -std::numeric_limits<float>::infinity();
    row_sum[r] = 0.0f;
  }
  const int64_t end = past + t1;  // keys the tile's last token sees
  const Vec lowest = vset1(std::numeric_limits<float>::lowest());  // above -inf: masked keys
  alignas(64) float s[R][KT];
  for (int64_t k0 = 0; k0 < end; k0 += KT) {
    const int64_t nk = std::min(KT, end - k0);
    // the tile's keys and values, widened; keys past `end` are zero (and masked below)
    for (int64_t j = 0; j < KT; ++j) {
      if (j < nk) {
        const int64_t t = k0 + j;
        const int64_t block = table[t / block_size], slot = t % block_size;
        alignas(64) float krow[D];
        rows_in.key(block, slot, h, krow);
        rows_in.value(block, slot, h, vt + j * D);
        for (int64_t d = 0; d < D; ++d) kt[d * KT + j] = krow[d];
      } else {
        for (int64_t d = 0; d < D; ++d) kt[d * KT + j] = 0.0f;
        std::fill(vt + j * D, vt + (j + 1) * D, 0.0f);
      }
    }
    // the first token (by position) that sees the whole tile: earlier ones need the mask
    const int64_t unmasked_from = k0 + KT - 1 - past;  // token index within the chunk
    for (int64_t r0 = 0; r0 < rows_pad; r0 += R) {
      // scores of R rows against the KT keys: 2 * R accumulators
      Vec a[R][NKV];
      for (int64_t i = 0; i < R; ++i)
        for (int c = 0; c < NKV; ++c) a[i][c] = vzero();
      for (int64_t d = 0; d < D; ++d) {
        Vec kv[NKV];
        for (int c = 0; c < NKV; ++c) kv[c] = vload(kt + d * KT + c * LANES);
        for (int64_t i = 0; i < R; ++i) {
          const Vec qv = vset1(q[(r0 + i) * D + d]);
          for (int c = 0; c < NKV; ++c) a[i][c] = vfma(qv, kv[c], a[i][c]);
        }
      }
      for (int64_t i = 0; i < R; ++i)
        for (int c = 0; c < NKV; ++c) vstore(s[i] + c * LANES, a[i][c]);
      // the causal mask (and keys past the tile's end): a token sees keys up to its position
      for (int64_t i = 0; i < R; ++i) {
        const int64_t r = r0 + i;
        const int64_t tok = t0 + std::min(r, rows - 1) / group;
        if (tok < unmasked_from || nk < KT) {
          const int64_t visible = std::min(past + tok + 1 - k0, nk);  // keys this row sees
          for (int64_t j = std::max<int64_t>(visible, 0); j < KT; ++j)
            s[i][j] = -std::numeric_limits<float>::infinity();
        }
      }
      // online softmax: rescale each row's accumulator by exp(old max - new max)
      float alpha[R];
      for (int64_t i = 0; i < R; ++i) {
        const int64_t r = r0 + i;
        Vec mt = vload(s[i]);
        for (int c = 1; c < NKV; ++c) mt = vmax(mt, vload(s[i] + c * LANES));
        const float m_tile = vhmax(mt);
        const float m_new = std::max(row_max[r], m_tile);
        if (m_new == -std::numeric_limits<float>::infinity()) {  // sees none of these keys
          alpha[i] = 1.0f;
          for (int c = 0; c < NKV; ++c) vstore(s[i] + c * LANES, vzero());
          continue;
        }
        alpha[i] = row_max[r] == -std::numeric_limits<float>::infinity()
                       ? 0.0f
                       : std::exp(row_max[r] - m_new);
        const Vec mv = vset1(-m_new);
        // vexp clamps its argument (exp(-inf) is not zero there): masked keys are zeroed here
        Vec sum = vzero();
        for (int c = 0; c < NKV; ++c) {
          const Vec e = vload(s[i] + c * LANES);
          const Vec pv = vblend_ge(e, lowest, vexp(vadd(e, mv)), vzero());
          vstore(s[i] + c * LANES, pv);
          sum = vadd(sum, pv);
        }
        row_sum[r] = row_sum[r] * alpha[i] + vhsum(sum);
        row_max[r] = m_new;
      }
      // acc[r] = acc[r] * alpha + sum_j p[r][j] * v[j], PVC vectors of the row at a time
      for (int c0 = 0; c0 < NV; c0 += PVC) {
        Vec o[R][PVC];
        for (int64_t i = 0; i < R; ++i) {
          const Vec al = vset1(alpha[i]);
          for (int v = 0; v < PVC; ++v)
            o[i][v] = vmul(vload(acc + (r0 + i) * D + (c0 + v) * LANES), al);
        }
        for (int64_t j = 0; j < nk; ++j) {
          Vec vv[PVC];
          for (int v = 0; v < PVC; ++v) vv[v] = vload(vt + j * D + (c0 + v) * LANES);
          for (int64_t i = 0; i < R; ++i) {
            const Vec p = vset1(s[i][j]);
            for (int v = 0; v < PVC; ++v) o[i][v] = vfma(p, vv[v], o[i][v]);
          }
        }
        for (int64_t i = 0; i < R; ++i)
          for (int v = 0; v < PVC; ++v) vstore(acc + (r0 + i) * D + (c0 + v) * LANES, o[i][v]);
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    T* dst = out + (t0 + r / group) * stride_ot + (h * group + r % group) * stride_oh;
    const float inv = 1.0f / row_sum[r];
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(acc[r * D + d] * inv);
  }
}

// attend_tile over a plain cache: the kernel's TileFn.
template <typename T, int NV>
void attend_tile_plain(const T* query, int64_t stride_qt, int64_t stride_qh, const T* key_cache,
                       const T* value_cache, int64_t stride_cb, int64_t stride_ct,
                       int64_t stride_ch, const int32_t* table, int64_t block_size,
                       int64_t seq_len, int64_t q_len, int64_t t0, int64_t t1, int64_t h,
                       int64_t group, float scale, T* out, int64_t stride_ot, int64_t stride_oh,
                       Scratch& scratch) {
  const PlainRows<T, NV> rows{key_cache, value_cache, stride_cb, stride_ct, stride_ch};
  attend_tile<T, NV>(query, stride_qt, stride_qh, rows, table, block_size, seq_len, q_len, t0,
                     t1, h, group, scale, out, stride_ot, stride_oh, scratch);
}

// attend_tile over a quantized cache of codes C and scales S: the quantized kernel's tiles.
template <typename T, Codes C, typename S, int NV>
void attend_tile_quant(const T* query, int64_t stride_qt, int64_t stride_qh,
                       const QuantSource& source, const int32_t* table, int64_t block_size,
                       int64_t seq_len, int64_t q_len, int64_t t0, int64_t t1, int64_t h,
                       int64_t group, float scale, T* out, int64_t stride_ot, int64_t stride_oh,
                       Scratch& scratch) {
  const QuantRows<C, S, NV> rows(source);
  attend_tile<T, NV>(query, stride_qt, stride_qh, rows, table, block_size, seq_len, q_len, t0,
                     t1, h, group, scale, out, stride_ot, stride_oh, scratch);
}

#if defined(__AVX512BF16__)
// bfloat16 caches on CPUs with AVX512-BF16: the dot products as VDPBF16PS, which multiplies
// pairs of bfloat16 values exactly and adds both products into a float32 lane, so one
// instruction does the work of two float32 FMAs and nothing is widened. The layout turns so
// that the scores' lanes are rows: q's rows are transposed once per task into [D / 2][rows]
// pairs, each key's pairs are broadcast from the cache in place (no key tile is built), and
// the online softmax runs down the lanes, each row's maximum and sum in a lane of its own
// (no horizontal reductions). The probabilities are rounded to bfloat16 for P V, as torch's
// CPU flash kernel and flash attention on GPUs do, each pair of keys' values interleaved
// once per tile; the maximum, the sums and the accumulators stay float32.
constexpr int64_t BKT = 64;  // keys per tile
constexpr int64_t JB = 4;    // keys whose scores are in registers together
constexpr int64_t RVB = 4;   // row vectors whose scores are in registers together

inline uint32_t load_pair(const c10::BFloat16* p) {  // two adjacent values as one word
  uint32_t w;
  std::memcpy(&w, p, sizeof(w));
  return w;
}

inline __m512 dot_pairs(__m512 acc, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}

// Scores of row vectors [rv0, rv0 + RB) against keys j0..j0 + JB of the tile, scaled.
template <int RB, int64_t DP>
inline void score_block(const uint32_t* qt, int64_t rows_pad, const c10::BFloat16* const* keys,
                        int64_t rv0, int64_t j0, __m512 scale, float* s) {
  __m512 a[JB][RB];
  for (int j = 0; j < JB; ++j)
    for (int b = 0; b < RB; ++b) a[j][b] = _mm512_setzero_ps();
  for (int64_t p = 0; p < DP; ++p) {
    __m512i qv[RB];
    for (int b = 0; b < RB; ++b)
      qv[b] = _mm512_loadu_si512(qt + p * rows_pad + (rv0 + b) * 16);
    for (int j = 0; j < JB; ++j) {
      const __m512i kb = _mm512_set1_epi32(static_cast<int>(load_pair(keys[j0 + j] + 2 * p)));
      for (int b = 0; b < RB; ++b) a[j][b] = dot_pairs(a[j][b], kb, qv[b]);
    }
  }
  for (int j = 0; j < JB; ++j)
    for (int b = 0; b < RB; ++b)
      _mm512_storeu_ps(s + (j0 + j) * rows_pad + (rv0 + b) * 16, _mm512_mul_ps(a[j][b], scale));
}

template <int NV, typename Rows>
void attend_tile_bf16(const c10::BFloat16* query, int64_t stride_qt, int64_t stride_qh,
                      const Rows& rows_in, const int32_t* table, int64_t block_size,
                      int64_t seq_len, int64_t q_len, int64_t t0, int64_t t1, int64_t h,
                      int64_t group, float scale, c10::BFloat16* out, int64_t stride_ot,
                      int64_t stride_oh, Scratch& scratch) {
  constexpr int64_t D = NV * 16;
  constexpr int64_t DP = D / 2;  // pairs of a head row
  constexpr int PVC = NV < 4 ? NV : 4;
  constexpr int64_t R = 4;  // rows whose P V accumulators are in registers together
  static_assert(NV % PVC == 0, "head vectors in whole groups");
  const int64_t past = seq_len - q_len;
  const int64_t rows = (t1 - t0) * group;
  const int64_t nrv = (rows + 15) / 16;
  const int64_t rows_pad = nrv * 16;
  scratch.f.resize(rows_pad * D + rows_pad * 4 + BKT * rows_pad);
  scratch.w.resize(DP * rows_pad + BKT / 2 * rows_pad + BKT / 2 * D);
  float* acc = scratch.f.data();          // [rows_pad, D]
  float* row_max = acc + rows_pad * D;    // [rows_pad]
  float* row_sum = row_max + rows_pad;    // [rows_pad]
  float* alpha = row_sum + rows_pad;      // [rows_pad] this tile's rescale
  float* sees = alpha + rows_pad;         // [rows_pad] the last key (by position) a row sees
  float* s = sees + rows_pad;             // [BKT, rows_pad] scores, rows in lanes
  static const c10::BFloat16 zero[D] = {};  // the rows of keys past the tile's end
  uint32_t* qt = scratch.w.data();        // [DP, rows_pad] query pairs, transposed
  uint32_t* pw = qt + DP * rows_pad;      // [BKT / 2, rows_pad] probability pairs
  uint32_t* vw = pw + BKT / 2 * rows_pad; // [BKT / 2, D] value pairs, interleaved by key
  if constexpr (Rows::kDecodes) scratch.decoded.resize(2 * BKT * D);
  c10::BFloat16* decoded = scratch.decoded.data();  // [2, BKT, D] a quantized tile's K, V rows
  // row r = token (t0 + r / group), query head (h * group + r % group)
  for (int64_t r = 0; r < rows_pad; ++r) {
    if (r < rows) {
      const c10::BFloat16* src =
          query + (t0 + r / group) * stride_qt + (h * group + r % group) * stride_qh;
      for (int64_t p = 0; p < DP; ++p) qt[p * rows_pad + r] = load_pair(src + 2 * p);
      sees[r] = static_cast<float>(past + t0 + r / group);
    } else {
      for (int64_t p = 0; p < DP; ++p) qt[p * rows_pad + r] = 0;
      sees[r] = static_cast<float>(past + t1 - 1);
    }
    row_max[r] = -std::numeric_limits<float>::infinity();
    row_sum[r] = 0.0f;
  }
  std::fill(acc, acc + rows_pad * D, 0.0f);
  const int64_t end = past + t1;  // keys the tile's last token sees
  const __m512 scale_v = _mm512_set1_ps(scale);
  // words 2i and 2i + 1 of the interleave: key 2p's and key 2p + 1's probability of row i
  const __m512i interleave = _mm512_set_epi16(
      31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4,
      19, 3, 18, 2, 17, 1, 16, 0);
  const c10::BFloat16* keys[BKT];
  const c10::BFloat16* values[BKT];
  for (int64_t k0 = 0; k0 < end; k0 += BKT) {
    const int64_t nk = std::min(BKT, end - k0);
    const int64_t nk_up = (nk + JB - 1) / JB * JB;  // keys scored (the rest read the zero row)
    for (int64_t j = 0; j < BKT; ++j) {
      if (j < nk) {
        const int64_t t = k0 + j;
        const int64_t block = table[t / block_size], slot = t % block_size;
        keys[j] = rows_in.key_row(block, slot, h, decoded + j * D);
        values[j] = rows_in.value_row(block, slot, h, decoded + (BKT + j) * D);
      } else {
        keys[j] = values[j] = zero;
      }
    }
    // values of keys 2p and 2p + 1 interleaved: word d of pair p holds both keys' element d
    const int64_t pairs = (nk + 1) / 2;
    for (int64_t p = 0; p < pairs; ++p) {
      for (int64_t c = 0; c < NV; ++c) {
        const __m512i lo = _mm512_cvtepu16_epi32(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(values[2 * p] + c * 16)));
        const __m512i hi = _mm512_cvtepu16_epi32(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(values[2 * p + 1] + c * 16)));
        _mm512_storeu_si512(vw + p * D + c * 16, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
      }
    }
    for (int64_t j0 = 0; j0 < nk_up; j0 += JB) {
      int64_t rv0 = 0;
      for (; rv0 + RVB <= nrv; rv0 += RVB) score_block<RVB, DP>(qt, rows_pad, keys, rv0, j0, scale_v, s);
      switch (nrv - rv0) {
        case 3: score_block<3, DP>(qt, rows_pad, keys, rv0, j0, scale_v, s); break;
        case 2: score_block<2, DP>(qt, rows_pad, keys, rv0, j0, scale_v, s); break;
        case 1: score_block<1, DP>(qt, rows_pad, keys, rv0, j0, scale_v, s); break;
        default: break;
      }
    }
    // the causal mask is needed where the task's first token does not see the whole tile
    const bool masked = k0 + nk - 1 > past + t0;
    for (int64_t rv = 0; rv < nrv; ++rv) {
      const __m512 last = _mm512_sub_ps(_mm512_loadu_ps(sees + rv * 16),
                                        _mm512_set1_ps(static_cast<float>(k0)));
      __mmask16 seen[BKT];  // rows that see key j
      __m512 m_tile = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      for (int64_t j = 0; j < nk; ++j) {
        seen[j] = masked ? _mm512_cmp_ps_mask(_mm512_set1_ps(static_cast<float>(j)), last, _CMP_LE_OQ)
                         : static_cast<__mmask16>(0xFFFF);
        m_tile = _mm512_mask_max_ps(m_tile, seen[j], m_tile, _mm512_loadu_ps(s + j * rows_pad + rv * 16));
      }
      // every row sees key 0 of the first tile: the maximum is finite from then on
      const __m512 m_old = _mm512_loadu_ps(row_max + rv * 16);
      const __m512 m_new = _mm512_max_ps(m_old, m_tile);
      const __m512 al = vexp(_mm512_sub_ps(m_old, m_new));  // m_old = -inf: ~0, on a zero sum
      __m512 sum = _mm512_setzero_ps();
      for (int64_t p = 0; p < pairs; ++p) {
        __m512 e[2];
        for (int k = 0; k < 2; ++k) {
          const int64_t j = 2 * p + k;
          e[k] = j < nk ? _mm512_maskz_mov_ps(seen[j], vexp(_mm512_sub_ps(
                                                            _mm512_loadu_ps(s + j * rows_pad + rv * 16), m_new)))
                        : _mm512_setzero_ps();
          sum = _mm512_add_ps(sum, e[k]);
        }
        const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(e[1], e[0]);
        _mm512_storeu_si512(pw + p * rows_pad + rv * 16, _mm512_permutexvar_epi16(interleave, both));
      }
      _mm512_storeu_ps(row_sum + rv * 16,
                       _mm512_fmadd_ps(_mm512_loadu_ps(row_sum + rv * 16), al, sum));
      _mm512_storeu_ps(row_max + rv * 16, m_new);
      _mm512_storeu_ps(alpha + rv * 16, al);
    }
    // acc[r] = acc[r] * alpha[r] + sum_p (p[r][2p] v[2p] + p[r][2p + 1] v[2p + 1])
    for (int64_t r0 = 0; r0 < rows_pad; r0 += R) {
      for (int c0 = 0; c0 < NV; c0 += PVC) {
        __m512 o[R][PVC];
        for (int64_t i = 0; i < R; ++i) {
          const __m512 al = _mm512_set1_ps(alpha[r0 + i]);
          for (int v = 0; v < PVC; ++v)
            o[i][v] = _mm512_mul_ps(_mm512_loadu_ps(acc + (r0 + i) * D + (c0 + v) * 16), al);
        }
        for (int64_t p = 0; p < pairs; ++p) {
          __m512i vv[PVC];
          for (int v = 0; v < PVC; ++v) vv[v] = _mm512_loadu_si512(vw + p * D + (c0 + v) * 16);
          for (int64_t i = 0; i < R; ++i) {
            const __m512i pb = _mm512_set1_epi32(static_cast<int>(pw[p * rows_pad + r0 + i]));
            for (int v = 0; v < PVC; ++v) o[i][v] = dot_pairs(o[i][v], pb, vv[v]);
          }
        }
        for (int64_t i = 0; i < R; ++i)
          for (int v = 0; v < PVC; ++v)
            _mm512_storeu_ps(acc + (r0 + i) * D + (c0 + v) * 16, o[i][v]);
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    c10::BFloat16* dst = out + (t0 + r / group) * stride_ot + (h * group + r % group) * stride_oh;
    const float sr = 1.0f / row_sum[r];
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<c10::BFloat16>(acc[r * D + d] * sr);
  }
}

// attend_tile_bf16 over a plain bfloat16 cache (the kernel's TileFn) or a quantized one.
template <int NV>
void attend_tile_bf16_plain(const c10::BFloat16* query, int64_t stride_qt, int64_t stride_qh,
                            const c10::BFloat16* key_cache, const c10::BFloat16* value_cache,
                            int64_t stride_cb, int64_t stride_ct, int64_t stride_ch,
                            const int32_t* table, int64_t block_size, int64_t seq_len,
                            int64_t q_len, int64_t t0, int64_t t1, int64_t h, int64_t group,
                            float scale, c10::BFloat16* out, int64_t stride_ot,
                            int64_t stride_oh, Scratch& scratch) {
  const PlainRows<c10::BFloat16, NV> rows{key_cache, value_cache, stride_cb, stride_ct,
                                          stride_ch};
  attend_tile_bf16<NV>(query, stride_qt, stride_qh, rows, table, block_size, seq_len, q_len, t0,
                       t1, h, group, scale, out, stride_ot, stride_oh, scratch);
}

template <Codes C, typename S, int NV>
void attend_tile_bf16_quant(const c10::BFloat16* query, int64_t stride_qt, int64_t stride_qh,
                            const QuantSource& source, const int32_t* table, int64_t block_size,
                            int64_t seq_len, int64_t q_len, int64_t t0, int64_t t1, int64_t h,
                            int64_t group, float scale, c10::BFloat16* out, int64_t stride_ot,
                            int64_t stride_oh, Scratch& scratch) {
  const QuantRows<C, S, NV> rows(source);
  attend_tile_bf16<NV>(query, stride_qt, stride_qh, rows, table, block_size, seq_len, q_len, t0,
                       t1, h, group, scale, out, stride_ot, stride_oh, scratch);
}
#endif

template <typename T>
using TileFn = void (*)(const T*, int64_t, int64_t, const T*, const T*, int64_t, int64_t,
                        int64_t, const int32_t*, int64_t, int64_t, int64_t, int64_t, int64_t,
                        int64_t, int64_t, float, T*, int64_t, int64_t, Scratch&);

template <typename T>
TileFn<T> tile_fn(int64_t head_dim) {
  if (head_dim % LANES != 0) return nullptr;
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    switch (head_dim / 16) {
      case 1: return attend_tile_bf16_plain<1>;
      case 2: return attend_tile_bf16_plain<2>;
      case 4: return attend_tile_bf16_plain<4>;
      case 8: return attend_tile_bf16_plain<8>;
      case 16: return attend_tile_bf16_plain<16>;
      default: return nullptr;
    }
  }
#endif
  switch (head_dim / LANES) {
    case 1: return attend_tile_plain<T, 1>;
    case 2: return attend_tile_plain<T, 2>;
    case 4: return attend_tile_plain<T, 4>;
    case 8: return attend_tile_plain<T, 8>;
    case 16: return attend_tile_plain<T, 16>;
    default: return nullptr;
  }
}

template <typename T>
using QuantTileFn = void (*)(const T*, int64_t, int64_t, const QuantSource&, const int32_t*,
                             int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float,
                             T*, int64_t, int64_t, Scratch&);

template <typename T, Codes C, typename S>
QuantTileFn<T> quant_tile_fn(int64_t head_dim) {
  if (head_dim % LANES != 0) return nullptr;
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {  // the rows rounded to bfloat16 pairs
    switch (head_dim / 16) {
      case 1: return attend_tile_bf16_quant<C, S, 1>;
      case 2: return attend_tile_bf16_quant<C, S, 2>;
      case 4: return attend_tile_bf16_quant<C, S, 4>;
      case 8: return attend_tile_bf16_quant<C, S, 8>;
      case 16: return attend_tile_bf16_quant<C, S, 16>;
      default: return nullptr;
    }
  }
#endif
  switch (head_dim / LANES) {
    case 1: return attend_tile_quant<T, C, S, 1>;
    case 2: return attend_tile_quant<T, C, S, 2>;
    case 4: return attend_tile_quant<T, C, S, 4>;
    case 8: return attend_tile_quant<T, C, S, 8>;
    case 16: return attend_tile_quant<T, C, S, 16>;
    default: return nullptr;
  }
}

template <typename T>
QuantTileFn<T> quant_tile_fn(Codes codes, bool half_scales, int64_t head_dim) {
  switch (codes) {
    case Codes::kInt8:
      return half_scales ? quant_tile_fn<T, Codes::kInt8, c10::Half>(head_dim)
                         : quant_tile_fn<T, Codes::kInt8, float>(head_dim);
    case Codes::kFp8:
      return half_scales ? quant_tile_fn<T, Codes::kFp8, c10::Half>(head_dim)
                         : quant_tile_fn<T, Codes::kFp8, float>(head_dim);
    default:
      return half_scales ? quant_tile_fn<T, Codes::kInt4, c10::Half>(head_dim)
                         : quant_tile_fn<T, Codes::kInt4, float>(head_dim);
  }
}
#endif

// Runs run(task_seq, t0, t1, h) for every (tile of BQ new tokens, KV head) of the call.
// A task's cost grows with the keys its tile sees: the longest go first, and each thread takes
// the next task when it is free, so a thread slowed by other work on its core takes fewer of
// them instead of holding the others at the end of the call.
template <typename Run>
void run_tiles(const int32_t* lens, const int32_t* starts, int64_t num_seqs, int64_t num_kv_heads,
               const Run& run) {
  std::vector<std::pair<int64_t, int64_t>> tiles;  // (sequence, first new token of the tile)
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t q_len = starts[s + 1] - starts[s];
    TORCH_CHECK(q_len >= 0 && q_len <= lens[s], "sequence ", s, ": more new tokens than its length");
    for (int64_t t = 0; t < q_len; t += BQ) tiles.emplace_back(s, t);
  }
  if (tiles.empty()) return;
  const int64_t num_tasks = static_cast<int64_t>(tiles.size()) * num_kv_heads;
  std::vector<int64_t> order(tiles.size());
  std::iota(order.begin(), order.end(), 0);
  auto keys_seen = [&](int64_t i) {
    const auto [s, t0] = tiles[i];
    const int64_t q_len = starts[s + 1] - starts[s];
    return lens[s] - q_len + std::min(t0 + BQ, q_len);
  };
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return keys_seen(a) > keys_seen(b); });
  std::atomic<int64_t> next{0};
  const int64_t num_threads =
      std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_tasks));
  at::parallel_for(0, num_threads, 1, [&](int64_t, int64_t) {
    Scratch scratch;
    for (int64_t task = next++; task < num_tasks; task = next++) {
      const auto [s, t0] = tiles[order[task / num_kv_heads]];
      const int64_t q_len = starts[s + 1] - starts[s];
      run(s, t0, std::min(t0 + BQ, q_len), task % num_kv_heads, q_len, scratch);
    }
  });
}

// Whether this build runs a head of `head_dim` here (else the caller takes the reference).
bool prefill_attention_supported(int64_t head_dim) {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  return tile_fn<float>(head_dim) != nullptr;
#else
  (void)head_dim;
  return false;
#endif
}

// The checks both prefill kernels make of the batch's int32 tables; returns num_seqs.
int64_t check_batch(const at::Tensor& block_tables, const at::Tensor& seq_lens,
                    const at::Tensor& query_start_loc) {
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  query_start_loc.scalar_type() == at::kInt,
              "block tables, seq lens and query starts are int32");
  TORCH_CHECK(block_tables.stride(1) == 1 && seq_lens.is_contiguous() &&
                  query_start_loc.is_contiguous(),
              "int32 tables contiguous");
  const int64_t num_seqs = seq_lens.size(0);
  TORCH_CHECK(query_start_loc.size(0) == num_seqs + 1, "query_start_loc has num_seqs + 1 entries");
  return num_seqs;
}

void prefill_attention(const at::Tensor& query, const at::Tensor& key_cache,
                       const at::Tensor& value_cache, const at::Tensor& block_tables,
                       const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                       double scale, at::Tensor& out) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4, "query [T, H, D], cache [B, T, Hkv, D]");
  const int64_t num_heads = query.size(1), head_dim = query.size(2);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == head_dim && value_cache.sizes() == key_cache.sizes(),
              "cache shape");
  TORCH_CHECK(key_cache.strides() == value_cache.strides(), "key and value caches share strides");
  TORCH_CHECK(num_heads % num_kv_heads == 0, "heads must be a multiple of KV heads");
  TORCH_CHECK(prefill_attention_supported(head_dim), "head_dim ", head_dim,
              " is not supported by this build");
  TORCH_CHECK(query.stride(2) == 1 && key_cache.stride(3) == 1 && out.stride(2) == 1,
              "head_dim must be contiguous");
  TORCH_CHECK(query.scalar_type() == key_cache.scalar_type() &&
                  out.scalar_type() == query.scalar_type(),
              "query, cache and out share a dtype");
  TORCH_CHECK(out.sizes() == query.sizes(), "out has the query's shape");
  const int64_t num_seqs = check_batch(block_tables, seq_lens, query_start_loc);
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  const int64_t group = num_heads / num_kv_heads;
  const int32_t* tables = block_tables.data_ptr<int32_t>();
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(),
                                  "prefill_attention", [&] {
    const TileFn<scalar_t> fn = tile_fn<scalar_t>(head_dim);
    run_tiles(lens, starts, num_seqs, num_kv_heads,
              [&](int64_t s, int64_t t0, int64_t t1, int64_t h, int64_t q_len, Scratch& scratch) {
      fn(query.data_ptr<scalar_t>() + starts[s] * query.stride(0), query.stride(0),
         query.stride(1), key_cache.data_ptr<scalar_t>(), value_cache.data_ptr<scalar_t>(),
         key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
         tables + s * block_tables.stride(0), block_size, lens[s], q_len, t0, t1, h, group,
         static_cast<float>(scale), out.data_ptr<scalar_t>() + starts[s] * out.stride(0),
         out.stride(0), out.stride(1), scratch);
    });
  });
#else
  (void)lens, (void)starts, (void)group, (void)tables;
#endif
}

// Whether this build runs a quantized cache's head of `head_dim` here.
bool prefill_attention_quantized_supported(int64_t head_dim) {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  return quant_tile_fn<float>(Codes::kInt8, true, head_dim) != nullptr;
#else
  (void)head_dim;
  return false;
#endif
}

// prefill_attention over an int8 / fp8 / int4 cache and its scale caches (kernels/quant.py):
// each K and V row decoded into the task's float32 tile as it is read (no dequantized copy of
// the context), then the same arithmetic.
void prefill_attention_quantized(const at::Tensor& query, const at::Tensor& key_cache,
                                 const at::Tensor& value_cache, const at::Tensor& key_scales,
                                 const at::Tensor& value_scales, const at::Tensor& block_tables,
                                 const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                                 double scale, at::Tensor& out) {
  const QuantLayout layout =
      check_quantized(query, key_cache, value_cache, key_scales, value_scales, out);
  const int64_t num_heads = query.size(1), head_dim = query.size(2);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  TORCH_CHECK(prefill_attention_quantized_supported(head_dim), "head_dim ", head_dim,
              " is not supported by this build");
  const int64_t num_seqs = check_batch(block_tables, seq_lens, query_start_loc);
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  const int64_t group = num_heads / num_kv_heads;
  const int32_t* tables = block_tables.data_ptr<int32_t>();
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  const QuantSource source{static_cast<const uint8_t*>(key_cache.data_ptr()),
                           static_cast<const uint8_t*>(value_cache.data_ptr()),
                           key_scales.data_ptr(),
                           value_scales.data_ptr(),
                           key_scales.size(3),
                           key_cache.stride(0),
                           key_cache.stride(1),
                           key_cache.stride(2),
                           key_scales.stride(0),
                           key_scales.stride(1),
                           key_scales.stride(2)};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(),
                                  "prefill_attention_quantized", [&] {
    const QuantTileFn<scalar_t> fn = quant_tile_fn<scalar_t>(layout.codes, layout.half_scales, head_dim);
    run_tiles(lens, starts, num_seqs, num_kv_heads,
              [&](int64_t s, int64_t t0, int64_t t1, int64_t h, int64_t q_len, Scratch& scratch) {
      fn(query.data_ptr<scalar_t>() + starts[s] * query.stride(0), query.stride(0),
         query.stride(1), source, tables + s * block_tables.stride(0), block_size, lens[s],
         q_len, t0, t1, h, group, static_cast<float>(scale),
         out.data_ptr<scalar_t>() + starts[s] * out.stride(0), out.stride(0), out.stride(1),
         scratch);
    });
  });
#else
  (void)lens, (void)starts, (void)group, (void)tables;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvchat_cpu, m) {
  m.def("prefill_attention(Tensor query, Tensor key_cache, Tensor value_cache, "
        "Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, float scale, "
        "Tensor(a!) out) -> ()");
  m.def("prefill_attention_supported(int head_dim) -> bool", &prefill_attention_supported);
  m.def("prefill_attention_quantized(Tensor query, Tensor key_cache, Tensor value_cache, "
        "Tensor key_scales, Tensor value_scales, Tensor block_tables, Tensor seq_lens, "
        "Tensor query_start_loc, float scale, Tensor(a!) out) -> ()");
  m.def("prefill_attention_quantized_supported(int head_dim) -> bool",
        &prefill_attention_quantized_supported);
}

TORCH_LIBRARY_IMPL(kvchat_cpu, CPU, m) {
  m.impl("prefill_attention", &prefill_attention);
  m.impl("prefill_attention_quantized", &prefill_attention_quantized);
}
