// RMSNorm for the CPU in one op: y = x * rsqrt(mean(x^2) + eps) * w, with torch's rounding.
//
// A decode step norms a few rows twice per layer; as torch ops that is a float cast, the fused
// norm (itself several ops), a cast back and a multiply, each paying dispatch and a fresh
// tensor for a few KiB of work. The arithmetic is Hugging Face's: float32 statistics; a
// half-precision x is normalised in float32, rounded to its type, then scaled by the weight
// and rounded again (weight * norm(x.float()).to(dtype)); float32 scales in float32.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>

namespace {

template <typename T>
void norm_rows(const T* x, const T* w, T* y, int64_t hidden, double eps, int64_t begin,
               int64_t end) {
  for (int64_t r = begin; r < end; ++r) {
    const T* xr = x + r * hidden;
    T* yr = y + r * hidden;
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < hidden; ++i) {
      const float v = static_cast<float>(xr[i]);
      sum += v * v;
    }
    const float inv = 1.0f / std::sqrt(sum / static_cast<float>(hidden) + static_cast<float>(eps));
    for (int64_t i = 0; i < hidden; ++i) {
      if constexpr (std::is_same_v<T, float>) {
        yr[i] = xr[i] * inv * w[i];
      } else {
        const T normed = static_cast<T>(static_cast<float>(xr[i]) * inv);
        yr[i] = static_cast<T>(static_cast<float>(w[i]) * static_cast<float>(normed));
      }
    }
  }
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const int64_t hidden = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == hidden, "weight must be [hidden]");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "x and weight share a dtype");
  const at::Tensor xc = x.contiguous();
  const at::Tensor wc = weight.contiguous();
  at::Tensor y = at::empty_like(xc);
  const int64_t rows = hidden ? xc.numel() / hidden : 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = xc.data_ptr<scalar_t>();
    const scalar_t* wp = wc.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    // A few rows (a decode step) run on the calling thread: a parallel region costs more.
    at::parallel_for(0, rows, 32, [&](int64_t begin, int64_t end) {
      norm_rows<scalar_t>(xp, wp, yp, hidden, eps, begin, end);
    });
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvchat_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvchat_cpu, CPU, m) { m.impl("rms_norm", &rms_norm); }
