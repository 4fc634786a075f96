// A decode layer's small ops on the CPU, one dispatch each. rotary_cache_write: the start of
// the attention: rotate q and k (RoPE, the rotate-half form) straight out of the fused qkv
// projection, write the rotated k and v into the paged cache at their slots, return the rotated q.
//
// As torch ops that is a slice, a view, a cat, a multiply and an addcmul for the rotation,
// then a check for padding slots and two index_puts: a dozen dispatches and temporaries for a
// few KiB per token. Rounding follows the torch path: x * cos rounded to the model dtype,
// then + rotate_half(x) * signed_sin in float32, rounded once. Plain caches only (the model's
// dtype); a quantized cache takes the torch path. silu_mul: the MLP's silu(gate) * up in one
// pass over the rows, the sigmoid's exp and the product in vectors (kernels/cpu_vec.h) where
// the CPU has them: a libm exp per element cost about 17 us of a 4096-wide row, 12 times a
// step.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "cpu_vec.h"

namespace {

using namespace kvchat_cpu_vec;

// silu(x) = x * sigmoid(x) in float32 for n values, into out: sigmoid from e = exp(-|x|)
// (an argument <= 0, what vexp takes), 1 / (1 + e) for x >= 0 and e / (1 + e) below.
template <typename T>
inline void silu_row(const T* x, float* out, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  const Vec one = vset1(1.0f), zero = vzero();
  for (; i + LANES <= n; i += LANES) {
    const Vec v = load_row(x + i);
    const Vec e = vexp(vmul(vmax(v, vmul(v, vset1(-1.0f))), vset1(-1.0f)));  // exp(-|x|)
    const Vec num = vblend_ge(v, zero, one, e);  // 1 where x >= 0, else e
    vstore(out + i, vmul(v, vdiv(num, vadd(one, e))));
  }
#endif
  for (; i < n; ++i) {
    const float f = static_cast<float>(x[i]);
    out[i] = f / (1.0f + std::exp(-f));
  }
}

template <typename T>
inline void rotate(const T* x, const T* cos, const T* ssin, int64_t head_dim, T* out) {
  const int64_t half = head_dim / 2;
  for (int64_t j = 0; j < head_dim; ++j) {
    const float swapped = static_cast<float>(x[j < half ? j + half : j - half]);
    const T xc = static_cast<T>(static_cast<float>(x[j]) * static_cast<float>(cos[j]));
    out[j] = static_cast<T>(static_cast<float>(xc) + swapped * static_cast<float>(ssin[j]));
  }
}

at::Tensor rotary_cache_write(const at::Tensor& qkv, const at::Tensor& cos,
                              const at::Tensor& signed_sin, at::Tensor& key_cache,
                              at::Tensor& value_cache, const at::Tensor& slot_mapping,
                              int64_t num_heads, int64_t num_kv_heads) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1, "qkv must be [T, (Hq + 2 Hkv) D], rows dense");
  const int64_t num_tokens = qkv.size(0);
  const int64_t head_dim = key_cache.size(3);
  TORCH_CHECK(qkv.size(1) == (num_heads + 2 * num_kv_heads) * head_dim, "qkv width");
  TORCH_CHECK(key_cache.size(2) == num_kv_heads && value_cache.sizes() == key_cache.sizes(),
              "cache shape");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "contiguous caches");
  TORCH_CHECK(qkv.scalar_type() == key_cache.scalar_type() &&
                  value_cache.scalar_type() == key_cache.scalar_type() &&
                  cos.scalar_type() == qkv.scalar_type() &&
                  signed_sin.scalar_type() == qkv.scalar_type(),
              "qkv, tables and caches share a dtype");
  TORCH_CHECK(head_dim % 2 == 0, "head_dim must be even");
  const at::Tensor c = cos.reshape({num_tokens, head_dim}).contiguous();
  const at::Tensor s = signed_sin.reshape({num_tokens, head_dim}).contiguous();
  const at::Tensor slots = slot_mapping.to(at::kLong).contiguous();
  TORCH_CHECK(slots.numel() == num_tokens, "one slot per token");
  at::Tensor q = at::empty({num_tokens, num_heads, head_dim}, qkv.options());
  const int64_t row = key_cache.stride(1);  // elements per slot (Hkv * D)
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(),
                                  "rotary_cache_write", [&] {
    const scalar_t* xp = qkv.data_ptr<scalar_t>();
    const scalar_t* cp = c.data_ptr<scalar_t>();
    const scalar_t* sp = s.data_ptr<scalar_t>();
    const int64_t* slot = slots.data_ptr<int64_t>();
    scalar_t* qp = q.data_ptr<scalar_t>();
    scalar_t* kc = key_cache.data_ptr<scalar_t>();
    scalar_t* vc = value_cache.data_ptr<scalar_t>();
    const int64_t stride_t = qkv.stride(0);
    at::parallel_for(0, num_tokens, 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t* x = xp + t * stride_t;
        const scalar_t* ct = cp + t * head_dim;
        const scalar_t* st = sp + t * head_dim;
        for (int64_t h = 0; h < num_heads; ++h)
          rotate(x + h * head_dim, ct, st, head_dim, qp + (t * num_heads + h) * head_dim);
        if (slot[t] < 0) continue;  // a padding token: nothing to cache
        scalar_t* kd = kc + slot[t] * row;
        scalar_t* vd = vc + slot[t] * row;
        const scalar_t* k = x + num_heads * head_dim;
        const scalar_t* v = k + num_kv_heads * head_dim;
        for (int64_t h = 0; h < num_kv_heads; ++h)
          rotate(k + h * head_dim, ct, st, head_dim, kd + h * head_dim);
        for (int64_t i = 0; i < num_kv_heads * head_dim; ++i) vd[i] = v[i];
      }
    });
  });
  return q;
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "gate_up must be [T, 2 I]");
  const at::Tensor x = gate_up.contiguous();
  const int64_t rows = x.size(0), inter = x.size(1) / 2;
  at::Tensor out = at::empty({rows, inter}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_mul", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      constexpr int64_t CHUNK = 256;
      float act[CHUNK];
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* g = xp + r * 2 * inter;
        const scalar_t* u = g + inter;
        scalar_t* o = op + r * inter;
        for (int64_t c = 0; c < inter; c += CHUNK) {
          const int64_t n = std::min(CHUNK, inter - c);
          silu_row(g + c, act, n);
          int64_t i = 0;
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
          for (; i + LANES <= n; i += LANES)
            store_row(o + c + i, vmul(vround_to<scalar_t>(vload(act + i)), load_row(u + c + i)));
#endif
          for (; i < n; ++i) {
            // torch: silu(gate) rounded to the dtype, times up, rounded again
            const scalar_t a = static_cast<scalar_t>(act[i]);
            o[c + i] = static_cast<scalar_t>(static_cast<float>(a) * static_cast<float>(u[c + i]));
          }
        }
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvchat_cpu, m) {
  m.def("rotary_cache_write(Tensor qkv, Tensor cos, Tensor signed_sin, Tensor(a!) key_cache, "
        "Tensor(b!) value_cache, Tensor slot_mapping, int num_heads, int num_kv_heads) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvchat_cpu, CPU, m) {
  m.impl("rotary_cache_write", &rotary_cache_write);
  m.impl("silu_mul", &silu_mul);
}
