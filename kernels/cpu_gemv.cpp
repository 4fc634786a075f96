// kvchat's decode-step linear for the CPU: y[m, n] = sum_k x[m, k] * W[n, k] (+ b[n]) for the
// few rows m of a decode step, with W as stored ([out_features, in_features], row-major); and,
// at the end of the file, widen_gemm: the same for a prefill chunk's many rows and a
// half-precision W on CPUs without a native half GEMM.
//
// A decode step is a weight stream: every weight is read once per step and each is used for
// only m multiply-adds, so the time is the bytes of W over the memory bandwidth. The kernel
// reads W once, front to back, one row after another, and keeps the m rows of x (converted to float32 once,
// up to MAX_ROWS x in_features floats) in cache. Half-precision weights are widened to
// float32 in registers: x and the sums stay float32, like F.linear's reference on a CPU.
//
// Output rows are split across torch's intra-op threads (at::parallel_for), the pool every
// other op of the step runs on. Built by kernels/cpu_gemv.py for the machine it runs on
// (-march=native): AVX-512, AVX2 + FMA, or plain C++ where neither is present.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <torch/library.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <algorithm>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t MAX_ROWS = 16;  // rows of x one call takes (Linear sends more to GEMM)
constexpr int64_t X_BLOCK = 4;    // rows of x per pass over a block of W (from L1)

enum class WeightType { f32, bf16, f16 };

inline float bf16_to_float(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

inline float f16_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t mant = h & 0x3ff;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    exp = 113;
    while ((mant & 0x400) == 0) {
      mant <<= 1;
      exp--;
    }
    bits = sign | (exp << 23) | ((mant & 0x3ff) << 13);
  }
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
#endif
}

template <WeightType WT>
inline float weight_at(const void* w, int64_t i) {
  if constexpr (WT == WeightType::f32) {
    return static_cast<const float*>(w)[i];
  } else if constexpr (WT == WeightType::bf16) {
    return bf16_to_float(static_cast<const uint16_t*>(w)[i]);
  } else {
    return f16_to_float(static_cast<const uint16_t*>(w)[i]);
  }
}

// y[i] = v (+ bias[n]), rounded to the weight's type (round to nearest even, as torch does).
template <WeightType WT>
inline void store(void* y, int64_t i, float v, const void* bias, int64_t n) {
  if (bias != nullptr) v += weight_at<WT>(bias, n);
  if constexpr (WT == WeightType::f32) {
    static_cast<float*>(y)[i] = v;
  } else if constexpr (WT == WeightType::bf16) {
    static_cast<c10::BFloat16*>(y)[i] = c10::BFloat16(v);
  } else {
#if defined(__F16C__)
    static_cast<uint16_t*>(y)[i] = _cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT);  // one instruction
#else
    static_cast<c10::Half*>(y)[i] = c10::Half(v);
#endif
  }
}

#if defined(__AVX512F__)
constexpr int64_t LANES = 16;
using Vec = __m512;

template <WeightType WT>
inline Vec load_w(const void* w, int64_t i) {
  if constexpr (WT == WeightType::f32) {
    return _mm512_loadu_ps(static_cast<const float*>(w) + i);
  } else if constexpr (WT == WeightType::bf16) {
    const __m256i h = _mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(w) + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else {
    const __m256i h = _mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(w) + i));
    return _mm512_cvtph_ps(h);
  }
}
inline Vec load_x(const float* x) { return _mm512_loadu_ps(x); }
inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(Vec v) { return _mm512_reduce_add_ps(v); }
inline Vec vadd(Vec a, Vec b) { return _mm512_add_ps(a, b); }
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int64_t LANES = 8;
using Vec = __m256;

template <WeightType WT>
inline Vec load_w(const void* w, int64_t i) {
  if constexpr (WT == WeightType::f32) {
    return _mm256_loadu_ps(static_cast<const float*>(w) + i);
  } else if constexpr (WT == WeightType::bf16) {
    const __m128i h = _mm_loadu_si128(
        reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(w) + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  } else {
    const __m128i h = _mm_loadu_si128(
        reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(w) + i));
    return _mm256_cvtph_ps(h);
  }
}
inline Vec load_x(const float* x) { return _mm256_loadu_ps(x); }
inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec vadd(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline float vsum(Vec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#else
constexpr int64_t LANES = 0;
#endif

// Software prefetch distance of the PREFETCH variant: this far ahead of the loads, one
// prefetch per cache line. Whether it helps depends on the CPU (faster for half-precision
// weights on Zen 3, slower on Zen 4), so the engine measures both variants at start-up.
constexpr int64_t PREFETCH_BYTES = 1024;
constexpr int64_t CACHE_LINE = 64;

template <WeightType WT>
inline void prefetch_ahead(const void* w, int64_t i, int64_t count) {
  constexpr int64_t elem = WT == WeightType::f32 ? 4 : 2;
  const char* p = static_cast<const char*>(w) + i * elem + PREFETCH_BYTES;
  for (int64_t off = 0; off < count * elem; off += CACHE_LINE) __builtin_prefetch(p + off);
}

// Dot products of weight row n with NX rows of x, over all of in_features:
// out[j] = W[n] . x[j]. One row at a time, front to back: a single sequential stream per
// thread is what reaches the memory bandwidth (several rows interleaved measured slower on
// Zen 3 and Zen 4). UNROLL independent sums per x row hide the FMA latency when NX is small.
template <WeightType WT, int NX, bool PREFETCH>
inline void dot_row(const void* w, int64_t n, const float* x, int64_t in_features,
                    float* out) {
  const int64_t base = n * in_features;
  int64_t k = 0;
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  // One x row: two sums of 8 lanes (AVX2: four measured 7-12% slower on Zen 3) or four of 16
  // (AVX-512); more rows are independent sums themselves.
  constexpr int UNROLL = NX >= 4 ? 1 : (NX == 1 && LANES == 8 ? 2 : 4 / NX);
  Vec acc[NX][UNROLL];
  for (int j = 0; j < NX; ++j)
    for (int u = 0; u < UNROLL; ++u) acc[j][u] = vzero();
  for (; k + UNROLL * LANES <= in_features; k += UNROLL * LANES) {
    if constexpr (PREFETCH) prefetch_ahead<WT>(w, base + k, UNROLL * LANES);
    for (int u = 0; u < UNROLL; ++u) {
      const Vec wv = load_w<WT>(w, base + k + u * LANES);
      for (int j = 0; j < NX; ++j)
        acc[j][u] = vfma(wv, load_x(x + j * in_features + k + u * LANES), acc[j][u]);
    }
  }
  for (; k + LANES <= in_features; k += LANES) {
    const Vec wv = load_w<WT>(w, base + k);
    for (int j = 0; j < NX; ++j) acc[j][0] = vfma(wv, load_x(x + j * in_features + k), acc[j][0]);
  }
  for (int j = 0; j < NX; ++j) {
    Vec sum = acc[j][0];
    for (int u = 1; u < UNROLL; ++u) sum = vadd(sum, acc[j][u]);
    out[j] = vsum(sum);
  }
#else
  for (int j = 0; j < NX; ++j) out[j] = 0.0f;
#endif
  for (; k < in_features; ++k) {  // the tail (or everything, without vector units)
    const float wk = weight_at<WT>(w, base + k);
    for (int j = 0; j < NX; ++j) out[j] += wk * x[j * in_features + k];
  }
}

#if defined(__AVX512BF16__)
// bfloat16 weights and bfloat16 x (a bfloat16 model's activations, so nothing is rounded):
// vdpbf16ps multiplies 32 pairs and adds them into 16 float32 sums in one instruction, half
// the work of widening the weights first (which is compute-bound on two cores).
template <int NX>
inline void dot_row_bf16(const uint16_t* w, int64_t n, const uint16_t* x, int64_t in_features,
                         float* out) {
  const uint16_t* row = w + n * in_features;
  constexpr int UNROLL = NX >= 2 ? 1 : 2;
  __m512 acc[NX][UNROLL];
  for (int j = 0; j < NX; ++j)
    for (int u = 0; u < UNROLL; ++u) acc[j][u] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + UNROLL * 32 <= in_features; k += UNROLL * 32) {
    for (int u = 0; u < UNROLL; ++u) {
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(row + k + u * 32);
      for (int j = 0; j < NX; ++j) {
        const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + j * in_features + k + u * 32);
        acc[j][u] = _mm512_dpbf16_ps(acc[j][u], wv, xv);
      }
    }
  }
  for (; k + 32 <= in_features; k += 32) {
    const __m512bh wv = (__m512bh)_mm512_loadu_si512(row + k);
    for (int j = 0; j < NX; ++j) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + j * in_features + k);
      acc[j][0] = _mm512_dpbf16_ps(acc[j][0], wv, xv);
    }
  }
  for (int j = 0; j < NX; ++j) {
    __m512 sum = acc[j][0];
    for (int u = 1; u < UNROLL; ++u) sum = _mm512_add_ps(sum, acc[j][u]);
    out[j] = _mm512_reduce_add_ps(sum);
  }
  for (; k < in_features; ++k) {
    const float wk = bf16_to_float(row[k]);
    for (int j = 0; j < NX; ++j) out[j] += wk * bf16_to_float(x[j * in_features + k]);
  }
}

void gemv_rows_bf16(const uint16_t* w, const uint16_t* x, int64_t num_x, int64_t in_features,
                    int64_t out_features, int64_t begin, int64_t end, void* y,
                    const void* bias) {
  float out[X_BLOCK];
  for (int64_t n = begin; n < end; ++n) {
    for (int64_t j0 = 0; j0 < num_x; j0 += X_BLOCK) {
      const int64_t nx = std::min<int64_t>(X_BLOCK, num_x - j0);
      const uint16_t* xj = x + j0 * in_features;
      switch (nx) {
        case 1: dot_row_bf16<1>(w, n, xj, in_features, out); break;
        case 2: dot_row_bf16<2>(w, n, xj, in_features, out); break;
        case 3: dot_row_bf16<3>(w, n, xj, in_features, out); break;
        default: dot_row_bf16<4>(w, n, xj, in_features, out); break;
      }
      for (int64_t j = 0; j < nx; ++j)
        store<WeightType::bf16>(y, (j0 + j) * out_features + n, out[j], bias, n);
    }
  }
}
#endif

template <WeightType WT, bool PREFETCH>
void gemv_rows(const void* w, const float* x, int64_t num_x, int64_t in_features,
               int64_t out_features, int64_t begin, int64_t end, void* y, const void* bias) {
  float out[X_BLOCK];
  // x rows in blocks of X_BLOCK: each weight row is read from memory once, then from L1.
  for (int64_t n = begin; n < end; ++n) {
    for (int64_t j0 = 0; j0 < num_x; j0 += X_BLOCK) {
      const int64_t nx = std::min<int64_t>(X_BLOCK, num_x - j0);
      const float* xj = x + j0 * in_features;
      switch (nx) {
        case 1: dot_row<WT, 1, PREFETCH>(w, n, xj, in_features, out); break;
        case 2: dot_row<WT, 2, PREFETCH>(w, n, xj, in_features, out); break;
        case 3: dot_row<WT, 3, PREFETCH>(w, n, xj, in_features, out); break;
        default: dot_row<WT, 4, PREFETCH>(w, n, xj, in_features, out); break;
      }
      for (int64_t j = 0; j < nx; ++j)
        store<WT>(y, (j0 + j) * out_features + n, out[j], bias, n);
    }
  }
}

// y's shape: x's, with out_features last.
at::Tensor output_for(const at::Tensor& x, int64_t out_features) {
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = out_features;
  return at::empty(out_shape, x.options());
}

// The bias in the weight's dtype (kept alive in `holder`), or nullptr.
const void* bias_data(const c10::optional<at::Tensor>& bias, int64_t out_features,
                      at::ScalarType dtype, at::Tensor& holder) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  TORCH_CHECK(bias->numel() == out_features, "bias must have out_features elements");
  holder = bias->to(dtype).contiguous();
  return holder.data_ptr();
}

template <WeightType WT>
void gemv_rows_variant(bool prefetch, const void* w, const float* x, int64_t num_x,
                       int64_t in_features, int64_t out_features, int64_t begin, int64_t end,
                       void* y, const void* bias) {
  if (prefetch) {
    gemv_rows<WT, true>(w, x, num_x, in_features, out_features, begin, end, y, bias);
  } else {
    gemv_rows<WT, false>(w, x, num_x, in_features, out_features, begin, end, y, bias);
  }
}

at::Tensor gemv(const at::Tensor& x, const at::Tensor& weight,
                const c10::optional<at::Tensor>& bias, bool prefetch) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "gemv runs on the CPU");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "weight must be contiguous [out, in]");
  const int64_t out_features = weight.size(0);
  const int64_t in_features = weight.size(1);
  TORCH_CHECK(x.size(-1) == in_features, "x's last dim must be in_features");
  const at::ScalarType dtype = weight.scalar_type();
  TORCH_CHECK(x.scalar_type() == dtype, "x and weight must have the same dtype");
  WeightType wt;
  if (dtype == at::kFloat) {
    wt = WeightType::f32;
  } else if (dtype == at::kBFloat16) {
    wt = WeightType::bf16;
  } else if (dtype == at::kHalf) {
    wt = WeightType::f16;
  } else {
    TORCH_CHECK(false, "gemv takes float32, bfloat16 or float16");
  }
  const int64_t num_x = x.numel() / in_features;
  TORCH_CHECK(num_x >= 1 && num_x <= MAX_ROWS, "gemv takes 1 to ", MAX_ROWS, " rows");

  at::Tensor y = output_for(x, out_features);
  void* yp = y.data_ptr();
  const void* wp = weight.data_ptr();
  at::Tensor b;
  const void* bp = bias_data(bias, out_features, dtype, b);
#if defined(__AVX512BF16__)
  if (wt == WeightType::bf16) {
    const at::Tensor xb = x.reshape({num_x, in_features}).contiguous();
    const uint16_t* xp = static_cast<const uint16_t*>(xb.data_ptr());
    at::parallel_for(0, out_features, 16, [&](int64_t begin, int64_t end) {
      gemv_rows_bf16(static_cast<const uint16_t*>(wp), xp, num_x, in_features, out_features,
                     begin, end, yp, bp);
    });
  } else
#endif
  {
    // x as float32 rows, contiguous (a few KiB).
    const at::Tensor x32 = x.reshape({num_x, in_features}).to(at::kFloat).contiguous();
    const float* xp = x32.data_ptr<float>();
    // Each thread streams one contiguous share of the rows.
    at::parallel_for(0, out_features, 16, [&](int64_t begin, int64_t end) {
      switch (wt) {
        case WeightType::f32: gemv_rows_variant<WeightType::f32>(prefetch, wp, xp, num_x, in_features, out_features, begin, end, yp, bp); break;
        case WeightType::bf16: gemv_rows_variant<WeightType::bf16>(prefetch, wp, xp, num_x, in_features, out_features, begin, end, yp, bp); break;
        case WeightType::f16: gemv_rows_variant<WeightType::f16>(prefetch, wp, xp, num_x, in_features, out_features, begin, end, yp, bp); break;
      }
    });
  }
  return y;
}

// -- prefill: half-precision weights on CPUs without a native half GEMM --------------------
//
// widen_gemm(x, weight, bias): F.linear for a bfloat16 / float16 weight and many rows of x,
// computed in float32 (as torch's reference does on a CPU) and rounded once to the weight's
// type. The weight is read as stored and widened in registers; no float32 copy of it is
// written to memory (widening the whole weight first, the "upcast" path, writes and re-reads
// twice its bytes, and torch's emulated half GEMM is many times slower here). x is widened
// once per call.
//
// A tile is TILE_M rows of x by TILE_N weight rows, dot products over all of in_features with
// the sums in registers (TILE_M * TILE_N vectors): per step, TILE_M loads of x, TILE_N of
// the weight and TILE_M * TILE_N FMAs, so the FMA units, not the loads, set the pace. A task
// is GROUP_N weight rows (a few tens of KiB, read from memory once and then from cache) against
// every row of x.

constexpr int TILE_M = 6;                 // rows of x per tile
constexpr int TILE_N = 2;                 // weight rows per tile (6 x 2 measured fastest on Zen 3)
constexpr int64_t GROUP_N = 24 * TILE_N;  // weight rows per task

template <WeightType WT, int RM, int RN>
void widen_tile(const void* w, const float* x, int64_t in_features, int64_t out_features,
                int64_t m0, int64_t n0, void* y, const void* bias) {
  float out[RM][RN];
  int64_t k = 0;
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  Vec acc[RM][RN];
  for (int i = 0; i < RM; ++i)
    for (int j = 0; j < RN; ++j) acc[i][j] = vzero();
  for (; k + LANES <= in_features; k += LANES) {
    Vec wv[RN];
    for (int j = 0; j < RN; ++j) wv[j] = load_w<WT>(w, (n0 + j) * in_features + k);
    for (int i = 0; i < RM; ++i) {
      const Vec xv = load_x(x + (m0 + i) * in_features + k);
      for (int j = 0; j < RN; ++j) acc[i][j] = vfma(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < RM; ++i)
    for (int j = 0; j < RN; ++j) out[i][j] = vsum(acc[i][j]);
#else
  for (int i = 0; i < RM; ++i)
    for (int j = 0; j < RN; ++j) out[i][j] = 0.0f;
#endif
  for (; k < in_features; ++k) {  // the tail (or everything, without vector units)
    for (int j = 0; j < RN; ++j) {
      const float wk = weight_at<WT>(w, (n0 + j) * in_features + k);
      for (int i = 0; i < RM; ++i) out[i][j] += wk * x[(m0 + i) * in_features + k];
    }
  }
  for (int i = 0; i < RM; ++i)
    for (int j = 0; j < RN; ++j)
      store<WT>(y, (m0 + i) * out_features + n0 + j, out[i][j], bias, n0 + j);
}

template <WeightType WT, int RM>
inline void widen_tile_n(int rn, const void* w, const float* x, int64_t in_features,
                         int64_t out_features, int64_t m0, int64_t n0, void* y, const void* bias) {
  static_assert(TILE_N == 2, "the cases below are TILE_N's");
  if (rn == 1) {
    widen_tile<WT, RM, 1>(w, x, in_features, out_features, m0, n0, y, bias);
  } else {
    widen_tile<WT, RM, 2>(w, x, in_features, out_features, m0, n0, y, bias);
  }
}

// Widens weight rows [n0, n0 + n) into `panel` ([n, in_features] float32).
template <WeightType WT>
void widen_panel(const void* w, int64_t n0, int64_t n, int64_t in_features, float* panel) {
  const int64_t count = n * in_features;
  const int64_t base = n0 * in_features;
  int64_t i = 0;
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  for (; i + LANES <= count; i += LANES) vstore(panel + i, load_w<WT>(w, base + i));
#endif
  const uint16_t* h = static_cast<const uint16_t*>(w) + base;
  for (; i < count; ++i)
    panel[i] = WT == WeightType::bf16 ? bf16_to_float(h[i]) : f16_to_float(h[i]);
}

// Many rows of x (a prefill chunk): each task widens a panel of PANEL_N weight rows into a
// float32 buffer of its own (a few hundred KiB, in L2) and multiplies all of x by it with
// the float32 GEMM, which blocks x and the panel for the caches as the tile loop above
// cannot (x itself is too large for L2 at prefill sizes: each tile re-read it from L3).
// The GEMM runs single-threaded inside the task; tasks split the panels between threads.
constexpr int64_t PANEL_N = 128;
constexpr int64_t PANEL_MIN_ROWS = 32;  // fewer rows of x: the tile loop (x fits in cache)

template <WeightType WT>
void widen_gemm_panels(const void* w, const at::Tensor& x32, int64_t in_features,
                       int64_t panel_n, int64_t first_panel, int64_t last_panel,
                       int64_t out_features, at::Tensor& y32) {
  // The op's own tensors, on a pool thread that does not carry the caller's mode: an
  // inference tensor made in inference mode is written here, which needs the mode too.
  c10::InferenceMode guard;
  at::Tensor panel = at::empty({panel_n, in_features}, x32.options());
  for (int64_t p = first_panel; p < last_panel; ++p) {
    const int64_t n0 = p * panel_n;
    if (n0 >= out_features) break;
    const int64_t n = std::min(panel_n, out_features - n0);
    widen_panel<WT>(w, n0, n, in_features, panel.data_ptr<float>());
    at::Tensor out = y32.narrow(1, n0, n);
    at::mm_out(out, x32, panel.narrow(0, 0, n).t());
  }
}

template <WeightType WT>
void widen_gemm_rows(const void* w, const float* x, int64_t num_x, int64_t in_features,
                     int64_t out_features, int64_t first_group, int64_t last_group, void* y,
                     const void* bias) {
  static_assert(TILE_M == 6, "the cases below are TILE_M's");
  for (int64_t g = first_group; g < last_group; ++g) {
    const int64_t n_end = std::min(out_features, (g + 1) * GROUP_N);
    for (int64_t m0 = 0; m0 < num_x; m0 += TILE_M) {
      const int rm = static_cast<int>(std::min<int64_t>(TILE_M, num_x - m0));
      for (int64_t n0 = g * GROUP_N; n0 < n_end; n0 += TILE_N) {
        const int rn = static_cast<int>(std::min<int64_t>(TILE_N, n_end - n0));
        switch (rm) {
          case 1: widen_tile_n<WT, 1>(rn, w, x, in_features, out_features, m0, n0, y, bias); break;
          case 2: widen_tile_n<WT, 2>(rn, w, x, in_features, out_features, m0, n0, y, bias); break;
          case 3: widen_tile_n<WT, 3>(rn, w, x, in_features, out_features, m0, n0, y, bias); break;
          case 4: widen_tile_n<WT, 4>(rn, w, x, in_features, out_features, m0, n0, y, bias); break;
          case 5: widen_tile_n<WT, 5>(rn, w, x, in_features, out_features, m0, n0, y, bias); break;
          default: widen_tile_n<WT, 6>(rn, w, x, in_features, out_features, m0, n0, y, bias); break;
        }
      }
    }
  }
}

at::Tensor widen_gemm(const at::Tensor& x, const at::Tensor& weight,
                      const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "widen_gemm runs on the CPU");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "weight must be contiguous [out, in]");
  const at::ScalarType dtype = weight.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kHalf,
              "widen_gemm takes bfloat16 or float16 weights");
  TORCH_CHECK(x.scalar_type() == dtype, "x and weight must have the same dtype");
  const int64_t out_features = weight.size(0);
  const int64_t in_features = weight.size(1);
  TORCH_CHECK(in_features >= 1 && x.size(-1) == in_features, "x's last dim must be in_features");
  const int64_t num_x = x.numel() / in_features;

  at::Tensor y = output_for(x, out_features);
  if (num_x == 0 || out_features == 0) return y;
  const at::Tensor x32 = x.reshape({num_x, in_features}).to(at::kFloat).contiguous();
  const float* xp = x32.data_ptr<float>();
  at::Tensor b;
  const void* bp = bias_data(bias, out_features, dtype, b);
  const void* wp = weight.data_ptr();
  if (num_x >= PANEL_MIN_ROWS) {
    at::Tensor y32 = at::empty({num_x, out_features}, x32.options());
    // As many panels per thread for every thread, each at most PANEL_N rows (a multiple of
    // 16): an uneven split would leave a thread idle for a whole panel's GEMM.
    const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
    const int64_t per_thread = (out_features + threads * PANEL_N - 1) / (threads * PANEL_N);
    const int64_t panels = threads * per_thread;
    const int64_t panel_n = ((out_features + panels - 1) / panels + 15) / 16 * 16;
    at::parallel_for(0, panels, per_thread, [&](int64_t first, int64_t last) {
      if (dtype == at::kBFloat16) {
        widen_gemm_panels<WeightType::bf16>(wp, x32, in_features, panel_n, first, last,
                                            out_features, y32);
      } else {
        widen_gemm_panels<WeightType::f16>(wp, x32, in_features, panel_n, first, last,
                                           out_features, y32);
      }
    });
    if (bp != nullptr) y32.add_(b.to(at::kFloat));  // the bias in the weight's dtype, widened
    y.view({num_x, out_features}).copy_(y32);
    return y;
  }
  void* yp = y.data_ptr();
  // Each thread takes whole groups of weight rows: it reads its share of the weight once.
  at::parallel_for(0, (out_features + GROUP_N - 1) / GROUP_N, 1, [&](int64_t first, int64_t last) {
    if (dtype == at::kBFloat16) {
      widen_gemm_rows<WeightType::bf16>(wp, xp, num_x, in_features, out_features, first, last,
                                        yp, bp);
    } else {
      widen_gemm_rows<WeightType::f16>(wp, xp, num_x, in_features, out_features, first, last,
                                       yp, bp);
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvchat_cpu, m) {
  m.def("gemv(Tensor x, Tensor weight, Tensor? bias, bool prefetch=False) -> Tensor");
  m.def("widen_gemm(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvchat_cpu, CPU, m) {
  m.impl("gemv", &gemv);
  m.impl("widen_gemm", &widen_gemm);
}
