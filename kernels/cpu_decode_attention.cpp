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
// Plain caches (the model's dtype) and full attention only; a quantized cache, a sliding
// window or attention sinks take the reference (kernels/torch_ops.py decides).
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
#include <c10/util/Half.h>

#include "cpu_vec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

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

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvchat_cpu, m) {
  m.def("decode_attention(Tensor query, Tensor key_cache, Tensor value_cache, "
        "Tensor block_tables, Tensor seq_lens, float scale, Tensor(a!) out, "
        "bool vectorized=True) -> ()");
}

TORCH_LIBRARY_IMPL(kvchat_cpu, CPU, m) { m.impl("decode_attention", &decode_attention); }
