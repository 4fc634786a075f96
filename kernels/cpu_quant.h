// Quantized KV rows for kvchat's CPU attention kernels: the codes of an int8, fp8 (e4m3fn)
// or packed int4 row (kernels/quant.py) decoded to float32, as scalars or as vectors, and
// their group scales (float32 or float16) applied. Shared by the decode and prefill kernels.

#pragma once

#include <ATen/ATen.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include "cpu_vec.h"

#include <array>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace kvchat_cpu_quant {

using namespace kvchat_cpu_vec;

enum class Codes { kInt8, kFp8, kInt4 };

template <typename S>
inline float scale_value(const S* p) {
  if constexpr (std::is_same_v<S, float>) {
    return *p;
  } else {
    return static_cast<float>(*p);  // c10::Half: exact
  }
}

// fp8 e4m3fn code -> float, by c10's conversion (exact: every code is a float32 value).
inline const float* fp8_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int b = 0; b < 256; ++b)
      t[b] = static_cast<float>(
          c10::Float8_e4m3fn(static_cast<uint8_t>(b), c10::Float8_e4m3fn::from_bits()));
    return t;
  }();
  return table.data();
}

// One row's codes as floats (before the scale): head_dim values.
template <Codes C>
inline void decode_codes(const uint8_t* src, int64_t head_dim, float* dst) {
  if constexpr (C == Codes::kInt8) {
    const int8_t* codes = reinterpret_cast<const int8_t*>(src);
#pragma omp simd
    for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<float>(codes[d]);
  } else if constexpr (C == Codes::kFp8) {
    const float* table = fp8_table();
    for (int64_t d = 0; d < head_dim; ++d) dst[d] = table[src[d]];
  } else {  // channel 2j in the low nibble of byte j, 2j + 1 in the high; each code + 8
    for (int64_t j = 0; j < head_dim / 2; ++j) {
      dst[2 * j] = static_cast<float>(static_cast<int>(src[j] & 0xF) - 8);
      dst[2 * j + 1] = static_cast<float>(static_cast<int>(src[j] >> 4) - 8);
    }
  }
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
// A row's NV vectors of codes, from p, as floats (before the scale; fp8: times 2^-8).
//
// fp8 e4m3fn through float16: the byte sign-extended to 16 bits and shifted left by 7 puts
// its exponent and mantissa fields (4 + 3 bits) at the top of float16's (5 + 10) and its sign
// on bit 15 (bit 14, a copy of the sign, is cleared). float16's exponent bias is 8 more than
// e4m3's, so that is the value times 2^-8, for subnormals as well (e4m3's are float16
// subnormals, which vcvtph2ps converts exactly: it ignores denormals-are-zero). The 2^8 goes
// into the scale (`code_factor`): 4 instructions per vector, where building the float32
// fields (and mending the subnormals) takes 10.
//
// int4: the low and high nibbles of 16 bytes split and interleaved back into channel order
// as bytes (128-bit operations), less the offset 8, then widened: two vectors at a time.
#if defined(__AVX512F__)
inline Vec widen_i8(__m128i bytes) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)); }
inline __m128i load_bytes(const uint8_t* p) {  // LANES bytes
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
}
inline __m128i load_half_bytes(const uint8_t* p) {  // LANES / 2 bytes
  return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
}
inline Vec fp8_scaled(__m128i bytes) {
  const __m256i h = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(bytes), 7),
                                     _mm256_set1_epi16(static_cast<int16_t>(0xBFFF)));
  return _mm512_cvtph_ps(h);
}
#else
inline Vec widen_i8(__m128i bytes) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)); }
inline __m128i load_bytes(const uint8_t* p) {
  return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
}
inline __m128i load_half_bytes(const uint8_t* p) {
  int32_t four;
  std::memcpy(&four, p, sizeof(four));
  return _mm_cvtsi32_si128(four);
}
inline Vec fp8_scaled(__m128i bytes) {
  const __m128i h = _mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(bytes), 7),
                                  _mm_set1_epi16(static_cast<int16_t>(0xBFFF)));
  return _mm256_cvtph_ps(h);
}
inline Vec widen_i8_high(__m128i bytes) {  // bytes 8..15
  return widen_i8(_mm_srli_si128(bytes, 8));
}
#endif

// int4 bytes -> their codes (nibble - 8) as int8, in channel order: channels 0-15 (from bytes
// 0-7), or with `high` channels 16-31 (from bytes 8-15).
inline __m128i int4_codes(__m128i packed, bool high) {
  const __m128i mask = _mm_set1_epi8(0x0F), offset = _mm_set1_epi8(8);
  const __m128i lo = _mm_and_si128(packed, mask);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(packed, 4), mask);
  return _mm_sub_epi8(high ? _mm_unpackhi_epi8(lo, hi) : _mm_unpacklo_epi8(lo, hi), offset);
}

template <Codes C, int NV>
inline void load_codes(const uint8_t* p, Vec* x) {
  if constexpr (C == Codes::kInt8) {
    for (int i = 0; i < NV; ++i) x[i] = widen_i8(load_bytes(p + i * LANES));
  } else if constexpr (C == Codes::kFp8) {
    for (int i = 0; i < NV; ++i) x[i] = fp8_scaled(load_bytes(p + i * LANES));
  } else {
    int i = 0;
    for (; i + 1 < NV; i += 2) {  // LANES bytes: 2 * LANES channels
      const __m128i packed = load_bytes(p + i * LANES / 2);
#if defined(__AVX512F__)
      x[i] = widen_i8(int4_codes(packed, false));
      x[i + 1] = widen_i8(int4_codes(packed, true));
#else
      const __m128i codes = int4_codes(packed, false);
      x[i] = widen_i8(codes);
      x[i + 1] = widen_i8_high(codes);
#endif
    }
    if (i < NV) x[i] = widen_i8(int4_codes(load_half_bytes(p + i * LANES / 2), false));
  }
}

template <Codes C>
constexpr float code_factor() {  // what load_codes' values still take (fp8: 2^8)
  return C == Codes::kFp8 ? 256.0f : 1.0f;
}

// How a row's scales apply: one per row (folded into the score / probability), one per run of
// whole vectors (group_size a multiple of LANES: a broadcast per vector), or any other
// grouping (a per-channel scale row, built per K/V row: formats kvchat does not write today).
enum class ScaleMode { kRow, kVectors, kChannels };

// Multiplies the row's vectors by their scales; returns what the score or probability still
// takes (the row's scale in kRow mode, else 1). vector_group[i]: vector i's group.
template <Codes C, typename S, int NV>
inline float apply_scales(ScaleMode mode, const S* sr, const int64_t* vector_group,
                          int64_t num_groups, int64_t group_size, Vec* x, float* chan) {
  constexpr float factor = code_factor<C>();
  if (mode == ScaleMode::kRow) return scale_value(sr) * factor;
  if (mode == ScaleMode::kVectors) {
    for (int i = 0; i < NV; ++i)
      x[i] = vmul(x[i], vset1(scale_value(sr + vector_group[i]) * factor));
  } else {
    for (int64_t gi = 0; gi < num_groups; ++gi) {
      const float v = scale_value(sr + gi) * factor;
      for (int64_t d = gi * group_size; d < (gi + 1) * group_size; ++d) chan[d] = v;
    }
    for (int i = 0; i < NV; ++i) x[i] = vmul(x[i], vload(chan + i * LANES));
  }
  return 1.0f;
}
#endif

// What the checks below found: the codes and the scales' dtype.
struct QuantLayout {
  Codes codes;
  bool half_scales;
};

// The checks both quantized attention kernels make of their query [tokens, H, D], cache
// [B, T, Hkv, D (int4: D / 2)] and scales [B, T, Hkv, groups], and of the output.
inline QuantLayout check_quantized(const at::Tensor& query, const at::Tensor& key_cache,
                                   const at::Tensor& value_cache, const at::Tensor& key_scales,
                                   const at::Tensor& value_scales, const at::Tensor& out) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4 && key_scales.dim() == 4,
              "query [tokens, H, D], cache [B, T, Hkv, D (int4: D / 2)], scales [B, T, Hkv, groups]");
  const at::ScalarType kind = key_cache.scalar_type();
  TORCH_CHECK(kind == at::kChar || kind == at::kFloat8_e4m3fn || kind == at::kByte,
              "a quantized cache is int8, float8_e4m3fn or uint8 (packed int4)");
  const bool packed = kind == at::kByte;
  const int64_t num_heads = query.size(1), head_dim = query.size(2);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  const int64_t num_groups = key_scales.size(3);
  TORCH_CHECK(key_cache.size(3) * (packed ? 2 : 1) == head_dim, "cache head_dim (",
              key_cache.size(3), packed ? " bytes of int4" : "", ") is not the query's (",
              head_dim, ")");
  TORCH_CHECK(value_cache.scalar_type() == kind && value_cache.sizes() == key_cache.sizes() &&
                  value_cache.strides() == key_cache.strides(),
              "key and value caches share a dtype, a shape and strides");
  TORCH_CHECK(key_scales.size(0) == key_cache.size(0) && key_scales.size(1) == block_size &&
                  key_scales.size(2) == num_kv_heads,
              "scales [B, T, Hkv, groups] of the cache's blocks");
  TORCH_CHECK(num_groups >= 1 && head_dim % num_groups == 0,
              "the scale groups divide head_dim");
  TORCH_CHECK(key_scales.scalar_type() == at::kFloat || key_scales.scalar_type() == at::kHalf,
              "scales are float32 or float16");
  TORCH_CHECK(value_scales.scalar_type() == key_scales.scalar_type() &&
                  value_scales.sizes() == key_scales.sizes() &&
                  value_scales.strides() == key_scales.strides(),
              "key and value scales share a dtype, a shape and strides");
  TORCH_CHECK(num_heads % num_kv_heads == 0, "heads must be a multiple of KV heads");
  TORCH_CHECK(query.stride(2) == 1 && key_cache.stride(3) == 1 && out.stride(2) == 1 &&
                  (num_groups == 1 || key_scales.stride(3) == 1),
              "head_dim (and the scale groups) must be contiguous");
  TORCH_CHECK(query.scalar_type() == at::kFloat || query.scalar_type() == at::kBFloat16 ||
                  query.scalar_type() == at::kHalf,
              "query is float32, bfloat16 or float16");
  TORCH_CHECK(out.scalar_type() == query.scalar_type() && out.sizes() == query.sizes(),
              "out has the query's dtype and shape");
  const Codes codes = kind == at::kChar ? Codes::kInt8 : packed ? Codes::kInt4 : Codes::kFp8;
  return {codes, key_scales.scalar_type() == at::kHalf};
}

}  // namespace kvchat_cpu_quant
