// kvchat's decode-step linear for the CPU: y[m, n] = sum_k x[m, k] * W[n, k] (+ b[n]) for the
// few rows m of a decode step, with W as stored ([out_features, in_features], row-major).
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
#include <torch/library.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
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
    static_cast<c10::Half*>(y)[i] = c10::Half(v);
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

// Dot products of weight row n with NX rows of x, over all of in_features:
// out[j] = W[n] . x[j]. One row at a time, front to back: a single sequential stream per
// thread is what reaches the memory bandwidth (several rows interleaved, or software
// prefetches, measured slower on Zen 4). UNROLL independent sums per x row hide the FMA
// latency when NX is small.
template <WeightType WT, int NX>
inline void dot_row(const void* w, int64_t n, const float* x, int64_t in_features,
                    float* out) {
  const int64_t base = n * in_features;
  int64_t k = 0;
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  constexpr int UNROLL = NX >= 4 ? 1 : 4 / NX;
  Vec acc[NX][UNROLL];
  for (int j = 0; j < NX; ++j)
    for (int u = 0; u < UNROLL; ++u) acc[j][u] = vzero();
  for (; k + UNROLL * LANES <= in_features; k += UNROLL * LANES) {
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

template <WeightType WT>
void gemv_rows(const void* w, const float* x, int64_t num_x, int64_t in_features,
               int64_t out_features, int64_t begin, int64_t end, void* y, const void* bias) {
  float out[X_BLOCK];
  // x rows in blocks of X_BLOCK: each weight row is read from memory once, then from L1.
  for (int64_t n = begin; n < end; ++n) {
    for (int64_t j0 = 0; j0 < num_x; j0 += X_BLOCK) {
      const int64_t nx = std::min<int64_t>(X_BLOCK, num_x - j0);
      const float* xj = x + j0 * in_features;
      switch (nx) {
        case 1: dot_row<WT, 1>(w, n, xj, in_features, out); break;
        case 2: dot_row<WT, 2>(w, n, xj, in_features, out); break;
        case 3: dot_row<WT, 3>(w, n, xj, in_features, out); break;
        default: dot_row<WT, 4>(w, n, xj, in_features, out); break;
      }
      for (int64_t j = 0; j < nx; ++j)
        store<WT>(y, (j0 + j) * out_features + n, out[j], bias, n);
    }
  }
}

at::Tensor gemv(const at::Tensor& x, const at::Tensor& weight,
                const c10::optional<at::Tensor>& bias) {
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

  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = out_features;
  at::Tensor y = at::empty(out_shape, x.options());
  void* yp = y.data_ptr();
  const void* wp = weight.data_ptr();
  const void* bp = nullptr;
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == out_features, "bias must have out_features elements");
    b = bias->to(dtype).contiguous();
    bp = b.data_ptr();
  }
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
        case WeightType::f32: gemv_rows<WeightType::f32>(wp, xp, num_x, in_features, out_features, begin, end, yp, bp); break;
        case WeightType::bf16: gemv_rows<WeightType::bf16>(wp, xp, num_x, in_features, out_features, begin, end, yp, bp); break;
        case WeightType::f16: gemv_rows<WeightType::f16>(wp, xp, num_x, in_features, out_features, begin, end, yp, bp); break;
      }
    });
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvchat_cpu, m) {
  m.def("gemv(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvchat_cpu, CPU, m) { m.impl("gemv", &gemv); }
