// kvchat's paged decode attention for the CPU: one query token per sequence against its
// context in the paged KV cache, read in place through the block table.
//
// The torch reference gathers each sequence's blocks into contiguous K and V, builds a mask
// and runs SDPA: four ops and two copies of the context per layer, which on the CPU cost more
// than the attention itself (a decode step's contexts are a few hundred KiB, but the weight
// stream has just pushed them out of cache). Here each (sequence, KV head) is one task: the
// scores of its query heads (the GQA group) over the context, a softmax, the weighted sum of
// V, all in float32 like the reference, read straight from the cache's blocks.
//
// Full attention only: a sliding window or attention sinks take the reference
// (kernels/torch_ops.py decides). Plain caches (the model's dtype) run `decode_attention`;
// quantized ones (int8, fp8 e4m3fn, packed int4: kernels/quant.py) `decode_attention_quantized`
// (at the end of this file), which decodes each K and V row in registers instead of the
// reference's dequantized copy of the whole context.
//
// Where the head dimension is a multiple of the vector width (AVX-512: 16 floats, AVX2: 8),
// the scores, the softmax's exponentials and the weighted sum of V run in vector registers,
// the query heads of the group against each K and V row while it is in registers; the
// context is walked block by block (no division per token). A scalar loop of one dot product
// at a time, with a libm exp per score, cost about 0.45 us per context token and layer on
// Zen 4 (bench model, 4 KV heads of 64): at a 500-token context a quarter of a decode step.
// Other head sizes, and CPUs with neither ISA, take the plain loop below (as does a call
// with vectorized=False: the tests and bench/cpu_attention.py compare the two).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include "cpu_quant.h"
#include "cpu_vec.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using namespace kvchat_cpu_quant;  // kernels/cpu_quant.h

constexpr int64_t MAX_HEAD_DIM = 512;

template <typename T>
inline void row_to_float(const T* src, int64_t n, float* dst) {
  if constexpr (std::is_same_v<T, float>) {
    for (int64_t i = 0; i < n; ++i) dst[i] = src[i];
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t w = static_cast<uint32_t>(bits[i]) << 16;
      float f;
      std::memcpy(&f, &w, sizeof(f));
      dst[i] = f;
    }
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
  }
}

inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

template <typename T>
void attend(const T* query,  // [num_seqs, num_heads, head_dim], rows of stride_qs / stride_qh
            const T* key_cache, const T* value_cache,  // [blocks, block_size, kv_heads, D]
            const int32_t* block_tables, int64_t stride_bt,  // [num_seqs, max_blocks]
            const int32_t* seq_lens, T* out, int64_t num_kv_heads, int64_t group,
            int64_t head_dim, int64_t block_size, int64_t stride_cb, int64_t stride_ct,
            int64_t stride_ch, int64_t stride_qs, int64_t stride_qh, int64_t stride_os,
            int64_t stride_oh, float scale, int64_t task_begin, int64_t task_end) {
  std::vector<float> q(group * head_dim), acc(group * head_dim), row(head_dim), scores;
  for (int64_t task = task_begin; task < task_end; ++task) {
    const int64_t s = task / num_kv_heads;
    const int64_t h = task % num_kv_heads;
    const int64_t len = seq_lens[s];
    const int32_t* table = block_tables + s * stride_bt;
    for (int64_t g = 0; g < group; ++g)
      row_to_float(query + s * stride_qs + (h * group + g) * stride_qh, head_dim,
                   q.data() + g * head_dim);
    scores.assign(group * len, 0.0f);
    for (int64_t t = 0; t < len; ++t) {
      const int64_t slot = table[t / block_size] * stride_cb + (t % block_size) * stride_ct;
      row_to_float(key_cache + slot + h * stride_ch, head_dim, row.data());
      for (int64_t g = 0; g < group; ++g)
        scores[g * len + t] = dot(q.data() + g * head_dim, row.data(), head_dim) * scale;
    }
    for (int64_t g = 0; g < group; ++g) {  // softmax over the context, per query head
      float* sg = scores.data() + g * len;
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t t = 0; t < len; ++t) m = std::max(m, sg[t]);
      float sum = 0.0f;
      for (int64_t t = 0; t < len; ++t) {
        sg[t] = std::exp(sg[t] - m);
        sum += sg[t];
      }
      const float inv = 1.0f / sum;
      for (int64_t t = 0; t < len; ++t) sg[t] *= inv;
    }
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t t = 0; t < len; ++t) {
      const int64_t slot = table[t / block_size] * stride_cb + (t % block_size) * stride_ct;
      row_to_float(value_cache + slot + h * stride_ch, head_dim, row.data());
      for (int64_t g = 0; g < group; ++g) {
        const float p = scores[g * len + t];
        float* a = acc.data() + g * head_dim;
#pragma omp simd
        for (int64_t d = 0; d < head_dim; ++d) a[d] += p * row[d];
      }
    }
    for (int64_t g = 0; g < group; ++g) {
      T* o = out + s * stride_os + (h * group + g) * stride_oh;
      for (int64_t d = 0; d < head_dim; ++d) o[d] = static_cast<T>(acc[g * head_dim + d]);
    }
  }
}


// -- the vector path ------------------------------------------------------------------------

using namespace kvchat_cpu_vec;  // kernels/cpu_vec.h

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
// In place: s[i] = exp(s[i] - max(s)); returns the sum.
inline float softmax_numerators(float* s, int64_t n) {
  int64_t i = 0;
  float m = -std::numeric_limits<float>::infinity();
  if (n >= LANES) {
    Vec vm = vload(s);
    for (i = LANES; i + LANES <= n; i += LANES) vm = vmax(vm, vload(s + i));
    m = vhmax(vm);
  }
  for (; i < n; ++i) m = std::max(m, s[i]);
  const Vec vmv = vset1(m);
  Vec vsum = vzero();
  for (i = 0; i + LANES <= n; i += LANES) {
    const Vec e = vexp(vadd(vload(s + i), vmul(vmv, vset1(-1.0f))));
    vstore(s + i, e);
    vsum = vadd(vsum, e);
  }
  float sum = vhsum(vsum);
  for (; i < n; ++i) {
    s[i] = std::exp(s[i] - m);
    sum += s[i];
  }
  return sum;
}

// One task per (sequence, KV head), NV vectors per head row.
template <typename T, int NV>
void attend_vec(const T* query, const T* key_cache, const T* value_cache,
                const int32_t* block_tables, int64_t stride_bt, const int32_t* seq_lens, T* out,
                int64_t num_kv_heads, int64_t group, int64_t head_dim, int64_t block_size,
                int64_t stride_cb, int64_t stride_ct, int64_t stride_ch, int64_t stride_qs,
                int64_t stride_qh, int64_t stride_os, int64_t stride_oh, float scale,
                int64_t task_begin, int64_t task_end) {
  std::vector<float> q(group * head_dim), acc(group * head_dim), scores, inv(group);
  for (int64_t task = task_begin; task < task_end; ++task) {
    const int64_t s = task / num_kv_heads;
    const int64_t h = task % num_kv_heads;
    const int64_t len = seq_lens[s];
    const int32_t* table = block_tables + s * stride_bt;
    for (int64_t g = 0; g < group; ++g) {  // the query heads, scaled once
      float* qg = q.data() + g * head_dim;
      row_to_float(query + s * stride_qs + (h * group + g) * stride_qh, head_dim, qg);
      for (int64_t d = 0; d < head_dim; ++d) qg[d] *= scale;
    }
    scores.resize(group * len);
    for (int64_t b = 0, t = 0; t < len; ++b) {  // scores: each K row against the group
      const T* block = key_cache + table[b] * stride_cb + h * stride_ch;
      const int64_t n = std::min(block_size, len - t);
      for (int64_t j = 0; j < n; ++j, ++t) {
        const T* k = block + j * stride_ct;
        Vec kv[NV];
        for (int i = 0; i < NV; ++i) kv[i] = load_row(k + i * LANES);
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = q.data() + g * head_dim;
          Vec a = vmul(vload(qg), kv[0]);
          for (int i = 1; i < NV; ++i) a = vfma(vload(qg + i * LANES), kv[i], a);
          scores[g * len + t] = vhsum(a);
        }
      }
    }
    for (int64_t g = 0; g < group; ++g)
      inv[g] = 1.0f / softmax_numerators(scores.data() + g * len, len);
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t b = 0, t = 0; t < len; ++b) {  // the weighted sum of the V rows
      const T* block = value_cache + table[b] * stride_cb + h * stride_ch;
      const int64_t n = std::min(block_size, len - t);
      for (int64_t j = 0; j < n; ++j, ++t) {
        const T* v = block + j * stride_ct;
        Vec vv[NV];
        for (int i = 0; i < NV; ++i) vv[i] = load_row(v + i * LANES);
        for (int64_t g = 0; g < group; ++g) {
          const Vec p = vset1(scores[g * len + t]);
          float* a = acc.data() + g * head_dim;
          for (int i = 0; i < NV; ++i) vstore(a + i * LANES, vfma(p, vv[i], vload(a + i * LANES)));
        }
      }
    }
    for (int64_t g = 0; g < group; ++g) {
      T* o = out + s * stride_os + (h * group + g) * stride_oh;
      const float* a = acc.data() + g * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) o[d] = static_cast<T>(a[d] * inv[g]);
    }
  }
}
#endif

// The vector path's entry for this head size, or nullptr (the plain loop).
template <typename T>
using AttendFn = void (*)(const T*, const T*, const T*, const int32_t*, int64_t, const int32_t*,
                          T*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                          int64_t, int64_t, int64_t, int64_t, float, int64_t, int64_t);

template <typename T>
AttendFn<T> vector_path(int64_t head_dim) {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  if (head_dim % LANES != 0) return nullptr;
  switch (head_dim / LANES) {
    case 1: return attend_vec<T, 1>;
    case 2: return attend_vec<T, 2>;
    case 3: return attend_vec<T, 3>;
    case 4: return attend_vec<T, 4>;
    case 5: return attend_vec<T, 5>;
    case 6: return attend_vec<T, 6>;
    case 8: return attend_vec<T, 8>;
    case 10: return attend_vec<T, 10>;
    case 12: return attend_vec<T, 12>;
    case 16: return attend_vec<T, 16>;
    default: return nullptr;
  }
#else
  (void)head_dim;
  return nullptr;
#endif
}

void decode_attention(const at::Tensor& query, const at::Tensor& key_cache,
                      const at::Tensor& value_cache, const at::Tensor& block_tables,
                      const at::Tensor& seq_lens, double scale, at::Tensor& out,
                      bool vectorized) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4, "query [S, H, D], cache [B, T, Hkv, D]");
  const int64_t num_seqs = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == head_dim && value_cache.sizes() == key_cache.sizes(),
              "cache shape");
  TORCH_CHECK(key_cache.strides() == value_cache.strides(), "key and value caches share strides");
  TORCH_CHECK(num_heads % num_kv_heads == 0, "heads must be a multiple of KV heads");
  TORCH_CHECK(head_dim <= MAX_HEAD_DIM, "head_dim up to ", MAX_HEAD_DIM);
  TORCH_CHECK(query.stride(2) == 1 && key_cache.stride(3) == 1 && out.stride(2) == 1,
              "head_dim must be contiguous");
  TORCH_CHECK(query.scalar_type() == key_cache.scalar_type() &&
                  out.scalar_type() == query.scalar_type(),
              "query, cache and out share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "block tables and seq lens are int32");
  TORCH_CHECK(block_tables.stride(1) == 1 && seq_lens.is_contiguous(), "int32 tables contiguous");
  TORCH_CHECK(out.sizes() == query.sizes(), "out has the query's shape");
  if (num_seqs == 0) return;
  const int64_t group = num_heads / num_kv_heads;
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(),
                                  "decode_attention", [&] {
    const AttendFn<scalar_t> fast = vectorized ? vector_path<scalar_t>(head_dim) : nullptr;
    at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
      (fast != nullptr ? fast : attend<scalar_t>)(query.data_ptr<scalar_t>(), key_cache.data_ptr<scalar_t>(),
                       value_cache.data_ptr<scalar_t>(), tables, block_tables.stride(0), lens,
                       out.data_ptr<scalar_t>(), num_kv_heads, group, head_dim, block_size,
                       key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
                       query.stride(0), query.stride(1), out.stride(0), out.stride(1),
                       static_cast<float>(scale), begin, end);
    });
  });
}


// -- quantized caches -----------------------------------------------------------------------
//
// int8, fp8 (e4m3fn) or packed int4 codes, with one scale (float32 or float16) per group of
// channels of each (token, KV head) row: value = code * scale (kernels/quant.py). The torch
// reference gathers the context and dequantizes it whole (int4 through several elementwise
// ops), then runs SDPA on the copy; here each row is decoded as it is read, into float32, and
// the arithmetic is the plain kernel's. The query is converted (and multiplied by the softmax
// scale) once per task, so the kernels below are templated on the code format, the scale type
// and the row's vector count only; the query's dtype is the driver's concern.
//
// With one scale per row (a single group), q . (codes * s) = (q . codes) * s and
// p * (codes * s) = (p * s) * codes: the scale multiplies the score and the probability, not
// every element (the same float32 arithmetic up to rounding order). With several groups, each
// row's codes are multiplied by their group's scale in registers, once per row for the whole
// GQA group of query heads.
//
// The vector path is laid out differently from `attend_vec` in two places, each worth about
// 6% of the time per row on Zen 4 (head_dim 64, 3 query heads per KV head; the same kernel
// laid out like `attend_vec` took 1.15-1.2x as long): the horizontal sum per score (once per
// row and query head) becomes a transposed sum of LANES rows at once, and the V accumulators,
// loaded and stored for every row and query head there, stay in registers across LANES rows,
// which are decoded once into a small buffer that each query head of the group reads back.
// Decoding itself costs little: with the codes replaced by constants the time per row did not
// change measurably.

struct QuantArgs {
  const uint8_t* key_cache;  // [blocks, block_size, kv_heads, D (int4: D / 2)], bytes
  const uint8_t* value_cache;
  const void* key_scales;  // [blocks, block_size, kv_heads, num_groups], float or Half
  const void* value_scales;
  const int32_t* block_tables;  // [num_seqs, max_blocks]
  int64_t stride_bt;
  const int32_t* seq_lens;
  int64_t num_kv_heads, group, head_dim, block_size, num_groups;
  int64_t stride_cb, stride_ct, stride_ch;  // the caches', in bytes (one-byte elements)
  int64_t stride_sb, stride_st, stride_sh;  // the scale caches', in elements
};

// Rows handled together by the vector path (one score vector), 1 without one.
constexpr int64_t CHUNK = LANES > 0 ? LANES : 1;

// A task's buffers, kept across the tasks of a thread.
struct Scratch {
  std::vector<float> scores;  // [group, len]
  std::vector<float> inv;     // [group]
  std::vector<float> row;     // [head_dim]: the plain loop's dequantized row
  std::vector<float> chan;    // [head_dim]: a row's scale per channel (odd groupings)
  std::vector<float> part;    // [group, CHUNK, CHUNK]: partial dot products, to reduce
  std::vector<float> rows;    // [CHUNK, head_dim]: decoded V rows
  std::vector<float> row_scales;  // [CHUNK]: what each row's score / probability takes
  std::vector<float> probs;       // [CHUNK]
};

// The plain loop: each row dequantized as the reference does it (code * its group's scale,
// rounded to float32), then `attend`'s arithmetic. q: the task's query heads, already scaled;
// acc: their outputs, normalized.
template <Codes C, typename S>
void attend_quant(const QuantArgs& a, int64_t s, int64_t h, const float* q, float* acc,
                  Scratch& sc) {
  const int64_t len = a.seq_lens[s], group = a.group, head_dim = a.head_dim;
  const int64_t group_size = head_dim / a.num_groups;
  const int32_t* table = a.block_tables + s * a.stride_bt;
  float* row = sc.row.data();
  const auto dequantize = [&](const uint8_t* cache, const void* scales, int64_t t) {
    const int64_t block = table[t / a.block_size], j = t % a.block_size;
    decode_codes<C>(cache + block * a.stride_cb + j * a.stride_ct + h * a.stride_ch, head_dim,
                    row);
    const S* sr = static_cast<const S*>(scales) + block * a.stride_sb + j * a.stride_st +
                  h * a.stride_sh;
    for (int64_t gi = 0; gi < a.num_groups; ++gi) {
      const float sv = scale_value(sr + gi);
      for (int64_t d = gi * group_size; d < (gi + 1) * group_size; ++d) row[d] *= sv;
    }
  };
  sc.scores.assign(group * len, 0.0f);
  float* scores = sc.scores.data();
  for (int64_t t = 0; t < len; ++t) {
    dequantize(a.key_cache, a.key_scales, t);
    for (int64_t g = 0; g < group; ++g) scores[g * len + t] = dot(q + g * head_dim, row, head_dim);
  }
  for (int64_t g = 0; g < group; ++g) {  // softmax over the context, per query head
    float* sg = scores + g * len;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < len; ++t) m = std::max(m, sg[t]);
    float sum = 0.0f;
    for (int64_t t = 0; t < len; ++t) {
      sg[t] = std::exp(sg[t] - m);
      sum += sg[t];
    }
    const float inv = 1.0f / sum;
    for (int64_t t = 0; t < len; ++t) sg[t] *= inv;
  }
  std::fill(acc, acc + group * head_dim, 0.0f);
  for (int64_t t = 0; t < len; ++t) {
    dequantize(a.value_cache, a.value_scales, t);
    for (int64_t g = 0; g < group; ++g) {
      const float p = scores[g * len + t];
      float* ag = acc + g * head_dim;
#pragma omp simd
      for (int64_t d = 0; d < head_dim; ++d) ag[d] += p * row[d];
    }
  }
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
// x: LANES rows of LANES floats -> one vector, lane r the sum of row r: a tree of shuffles and
// adds over all the rows at once (about 3 instructions a row, where a horizontal sum of each
// takes about 8). Each lane only ever adds its own row's partials, so rows past the end of the
// context (stale values) cannot disturb the others.
#if defined(__AVX512F__)
inline Vec reduce_rows(const float* x) {
  __m512 y[8], z[4], w[2];
  for (int k = 0; k < 8; ++k) {  // 256-bit halves: [row 2k | row 2k + 1], 8 partials each
    const __m512 a = vload(x + 2 * k * LANES), b = vload(x + (2 * k + 1) * LANES);
    y[k] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  }
  for (int k = 0; k < 4; ++k)  // 128-bit lane L: row 4k + L, 4 partials
    z[k] = _mm512_add_ps(_mm512_shuffle_f32x4(y[2 * k], y[2 * k + 1], 0x88),
                         _mm512_shuffle_f32x4(y[2 * k], y[2 * k + 1], 0xDD));
  for (int k = 0; k < 2; ++k)  // lane L: rows 8k + L and 8k + 4 + L, 2 partials each
    w[k] = _mm512_add_ps(_mm512_shuffle_ps(z[2 * k], z[2 * k + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_ps(z[2 * k], z[2 * k + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  // lane L: rows L, L + 4, L + 8, L + 12; element 4L + p holds row L + 4p
  const __m512 v = _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_permutexvar_ps(
      _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), v);
}
#else
inline Vec reduce_rows(const float* x) {
  __m256 y[4], z[2];
  for (int k = 0; k < 4; ++k) {  // 128-bit halves: [row 2k | row 2k + 1], 4 partials each
    const __m256 a = vload(x + 2 * k * LANES), b = vload(x + (2 * k + 1) * LANES);
    y[k] = _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
  }
  for (int k = 0; k < 2; ++k)  // lane L: rows 4k + L and 4k + 2 + L, 2 partials each
    z[k] = _mm256_add_ps(_mm256_shuffle_ps(y[2 * k], y[2 * k + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm256_shuffle_ps(y[2 * k], y[2 * k + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  // lane L: rows L, L + 2, L + 4, L + 6; element 4L + p holds row L + 2p
  const __m256 v = _mm256_add_ps(_mm256_shuffle_ps(z[0], z[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm256_shuffle_ps(z[0], z[1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}
#endif

// One task per (sequence, KV head), NV vectors per head row, LANES rows at a time.
template <Codes C, typename S, int NV>
void attend_quant_vec(const QuantArgs& a, int64_t s, int64_t h, const float* q, float* acc,
                      Scratch& sc) {
  constexpr int64_t D = NV * LANES;  // head_dim
  const int64_t len = a.seq_lens[s], group = a.group, num_groups = a.num_groups;
  const int64_t group_size = D / num_groups;
  const ScaleMode mode = num_groups == 1             ? ScaleMode::kRow
                         : group_size % LANES == 0 ? ScaleMode::kVectors
                                                   : ScaleMode::kChannels;
  int64_t vector_group[NV];
  for (int i = 0; i < NV; ++i) vector_group[i] = i * LANES / group_size;
  const int32_t* table = a.block_tables + s * a.stride_bt;
  const S* key_scales = static_cast<const S*>(a.key_scales);
  const S* value_scales = static_cast<const S*>(a.value_scales);
  float* chan = sc.chan.data();
  float* part = sc.part.data();
  float* rows = sc.rows.data();
  float* row_scales = sc.row_scales.data();
  float* probs = sc.probs.data();
  sc.scores.resize(group * len);
  float* scores = sc.scores.data();

  // Scores. Rows past the end of the context, in the last chunk, reduce stale partials into
  // lanes that are not stored.
  for (int64_t t0 = 0, b = 0, j = 0; t0 < len; t0 += LANES) {
    const int64_t n = std::min<int64_t>(LANES, len - t0);
    for (int64_t r = 0; r < n; ++r) {
      const int64_t block = table[b];
      const uint8_t* k = a.key_cache + block * a.stride_cb + j * a.stride_ct + h * a.stride_ch;
      const S* sr = key_scales + block * a.stride_sb + j * a.stride_st + h * a.stride_sh;
      if (++j == a.block_size) {
        j = 0;
        ++b;
      }
      Vec kv[NV];
      load_codes<C, NV>(k, kv);
      row_scales[r] = apply_scales<C, S, NV>(mode, sr, vector_group, num_groups, group_size, kv,
                                             chan);
      for (int64_t g = 0; g < group; ++g) {
        const float* qg = q + g * D;
        Vec x = vmul(vload(qg), kv[0]);
        for (int i = 1; i < NV; ++i) x = vfma(vload(qg + i * LANES), kv[i], x);
        vstore(part + (g * LANES + r) * LANES, x);
      }
    }
    const Vec rs = vload(row_scales);
    for (int64_t g = 0; g < group; ++g) {
      const Vec sv = vmul(reduce_rows(part + g * LANES * LANES), rs);
      float* dst = scores + g * len + t0;
      if (n == LANES) {
        vstore(dst, sv);
      } else {
        float tmp[LANES];
        vstore(tmp, sv);
        std::copy(tmp, tmp + n, dst);
      }
    }
  }
  float* inv = sc.inv.data();
  for (int64_t g = 0; g < group; ++g) inv[g] = 1.0f / softmax_numerators(scores + g * len, len);

  // The weighted sum of V: a chunk's rows decoded (and scaled, where the scale is not the
  // row's) into `rows`, then each query head's accumulators in registers over the chunk.
  std::fill(acc, acc + group * D, 0.0f);
  for (int64_t t0 = 0, b = 0, j = 0; t0 < len; t0 += LANES) {
    const int64_t n = std::min<int64_t>(LANES, len - t0);
    for (int64_t r = 0; r < n; ++r) {
      const int64_t block = table[b];
      const uint8_t* v = a.value_cache + block * a.stride_cb + j * a.stride_ct + h * a.stride_ch;
      const S* sr = value_scales + block * a.stride_sb + j * a.stride_st + h * a.stride_sh;
      if (++j == a.block_size) {
        j = 0;
        ++b;
      }
      Vec vv[NV];
      load_codes<C, NV>(v, vv);
      row_scales[r] = apply_scales<C, S, NV>(mode, sr, vector_group, num_groups, group_size, vv,
                                             chan);
      for (int i = 0; i < NV; ++i) vstore(rows + r * D + i * LANES, vv[i]);
    }
    for (int64_t g = 0; g < group; ++g) {
      const float* pg = scores + g * len + t0;
      if (n == LANES) {
        vstore(probs, vmul(vload(pg), vload(row_scales)));
      } else {
        for (int64_t r = 0; r < n; ++r) probs[r] = pg[r] * row_scales[r];
      }
      float* ag = acc + g * D;
      Vec av[NV];
      for (int i = 0; i < NV; ++i) av[i] = vload(ag + i * LANES);
      for (int64_t r = 0; r < n; ++r) {
        const Vec p = vset1(probs[r]);
        for (int i = 0; i < NV; ++i) av[i] = vfma(p, vload(rows + r * D + i * LANES), av[i]);
      }
      for (int i = 0; i < NV; ++i) vstore(ag + i * LANES, av[i]);
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    float* ag = acc + g * D;
    const Vec iv = vset1(inv[g]);
    for (int i = 0; i < NV; ++i) vstore(ag + i * LANES, vmul(vload(ag + i * LANES), iv));
  }
}
#endif

using QuantFn = void (*)(const QuantArgs&, int64_t, int64_t, const float*, float*, Scratch&);

template <Codes C, typename S>
QuantFn quant_path(int64_t head_dim, bool vectorized) {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  if (vectorized && head_dim % LANES == 0) {
    switch (head_dim / LANES) {
      case 1: return attend_quant_vec<C, S, 1>;
      case 2: return attend_quant_vec<C, S, 2>;
      case 3: return attend_quant_vec<C, S, 3>;
      case 4: return attend_quant_vec<C, S, 4>;
      case 5: return attend_quant_vec<C, S, 5>;
      case 6: return attend_quant_vec<C, S, 6>;
      case 8: return attend_quant_vec<C, S, 8>;
      case 10: return attend_quant_vec<C, S, 10>;
      case 12: return attend_quant_vec<C, S, 12>;
      case 16: return attend_quant_vec<C, S, 16>;
      default: break;
    }
  }
#else
  (void)head_dim;
  (void)vectorized;
#endif
  return attend_quant<C, S>;
}

template <Codes C>
QuantFn quant_path(bool half_scales, int64_t head_dim, bool vectorized) {
  return half_scales ? quant_path<C, c10::Half>(head_dim, vectorized)
                     : quant_path<C, float>(head_dim, vectorized);
}

// The tasks [begin, end) in the query's dtype T: the query heads in, scaled; the outputs out.
template <typename T>
void run_quant_tasks(QuantFn fn, const QuantArgs& a, const T* query, int64_t stride_qs,
                     int64_t stride_qh, T* out, int64_t stride_os, int64_t stride_oh, float scale,
                     int64_t begin, int64_t end) {
  const int64_t group = a.group, head_dim = a.head_dim;
  std::vector<float> q(group * head_dim), acc(group * head_dim);
  Scratch sc;
  sc.inv.resize(group);
  sc.row.resize(head_dim);
  sc.chan.resize(head_dim);
  sc.part.resize(group * CHUNK * CHUNK);
  sc.rows.resize(CHUNK * head_dim);
  sc.row_scales.resize(CHUNK);
  sc.probs.resize(CHUNK);
  for (int64_t task = begin; task < end; ++task) {
    const int64_t s = task / a.num_kv_heads;
    const int64_t h = task % a.num_kv_heads;
    for (int64_t g = 0; g < group; ++g) {
      float* qg = q.data() + g * head_dim;
      row_to_float(query + s * stride_qs + (h * group + g) * stride_qh, head_dim, qg);
      for (int64_t d = 0; d < head_dim; ++d) qg[d] *= scale;
    }
    fn(a, s, h, q.data(), acc.data(), sc);
    for (int64_t g = 0; g < group; ++g) {
      T* o = out + s * stride_os + (h * group + g) * stride_oh;
      const float* ag = acc.data() + g * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) o[d] = static_cast<T>(ag[d]);
    }
  }
}

void decode_attention_quantized(const at::Tensor& query, const at::Tensor& key_cache,
                                const at::Tensor& value_cache, const at::Tensor& key_scales,
                                const at::Tensor& value_scales, const at::Tensor& block_tables,
                                const at::Tensor& seq_lens, double scale, at::Tensor& out,
                                bool vectorized) {
  const QuantLayout layout =
      check_quantized(query, key_cache, value_cache, key_scales, value_scales, out);
  const int64_t num_seqs = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  const int64_t num_groups = key_scales.size(3);
  TORCH_CHECK(head_dim <= MAX_HEAD_DIM, "head_dim up to ", MAX_HEAD_DIM);
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "block tables and seq lens are int32");
  TORCH_CHECK(block_tables.stride(1) == 1 && seq_lens.is_contiguous(), "int32 tables contiguous");
  if (num_seqs == 0) return;
  QuantArgs a;
  a.key_cache = static_cast<const uint8_t*>(key_cache.data_ptr());
  a.value_cache = static_cast<const uint8_t*>(value_cache.data_ptr());
  a.key_scales = key_scales.data_ptr();
  a.value_scales = value_scales.data_ptr();
  a.block_tables = block_tables.data_ptr<int32_t>();
  a.stride_bt = block_tables.stride(0);
  a.seq_lens = seq_lens.data_ptr<int32_t>();
  a.num_kv_heads = num_kv_heads;
  a.group = num_heads / num_kv_heads;
  a.head_dim = head_dim;
  a.block_size = block_size;
  a.num_groups = num_groups;
  a.stride_cb = key_cache.stride(0);
  a.stride_ct = key_cache.stride(1);
  a.stride_ch = key_cache.stride(2);
  a.stride_sb = key_scales.stride(0);
  a.stride_st = key_scales.stride(1);
  a.stride_sh = key_scales.stride(2);
  const bool half = layout.half_scales;
  const QuantFn fn = layout.codes == Codes::kInt8 ? quant_path<Codes::kInt8>(half, head_dim, vectorized)
                     : layout.codes == Codes::kInt4
                         ? quant_path<Codes::kInt4>(half, head_dim, vectorized)
                         : quant_path<Codes::kFp8>(half, head_dim, vectorized);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(),
                                  "decode_attention_quantized", [&] {
    at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
      run_quant_tasks<scalar_t>(fn, a, query.data_ptr<scalar_t>(), query.stride(0),
                                query.stride(1), out.data_ptr<scalar_t>(), out.stride(0),
                                out.stride(1), static_cast<float>(scale), begin, end);
    });
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvchat_cpu, m) {
  m.def("decode_attention(Tensor query, Tensor key_cache, Tensor value_cache, "
        "Tensor block_tables, Tensor seq_lens, float scale, Tensor(a!) out, "
        "bool vectorized=True) -> ()");
  m.def("decode_attention_quantized(Tensor query, Tensor key_cache, Tensor value_cache, "
        "Tensor key_scales, Tensor value_scales, Tensor block_tables, Tensor seq_lens, "
        "float scale, Tensor(a!) out, bool vectorized=True) -> ()");
}

TORCH_LIBRARY_IMPL(kvchat_cpu, CPU, m) {
  m.impl("decode_attention", &decode_attention);
  m.impl("decode_attention_quantized", &decode_attention_quantized);
}
