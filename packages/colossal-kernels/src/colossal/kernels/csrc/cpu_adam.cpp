// Fused Adam/AdamW step for CPU tensors (colossal-kernels).
//
// One pass per element: read the grad (fp32, fp16 or bf16), multiply by the inverse loss
// scale, update the fp32 param, exp_avg and exp_avg_sq, and optionally write an fp16/bf16/fp32
// copy of the updated param. The library exposes a plain C ABI (no torch headers, so it builds
// in seconds) and is called through ctypes, which releases the GIL for the duration of a call.
// Work is split into fixed-size chunks across all tensors of a call and shared by OpenMP
// threads. With AVX-512 the inner loop handles 16 floats per iteration; elsewhere a portable
// scalar loop (auto-vectorised by the compiler) is used.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX512F__)
#include <immintrin.h>
#define COLOSSAL_ADAM_AVX512 1
#endif

namespace {

constexpr int64_t kChunk = 1 << 15;  // elements per work item (multiple of 16)

enum DType : int32_t { kNone = -1, kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

inline uint32_t f32_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float bits_f32(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

// IEEE half <-> float (round to nearest even), after Maratyszcza's FP16 library.
inline float half_to_float(uint16_t h) {
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const float normalized = bits_f32((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  const float denormalized = bits_f32((two_w >> 17) | (126u << 23)) - 0.5f;
  const uint32_t result =
      sign | (two_w < (1u << 27) ? f32_bits(denormalized) : f32_bits(normalized));
  return bits_f32(result);
}

inline uint16_t float_to_half(float f) {
  float base = (std::fabs(f) * 0x1.0p+112f) * 0x1.0p-110f;
  const uint32_t w = f32_bits(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  base = bits_f32((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = f32_bits(base);
  const uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
  const uint32_t mantissa_bits = bits & 0x00000FFFu;
  const uint32_t nonsign = exp_bits + mantissa_bits;
  return static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

inline float bf16_to_float(uint16_t h) { return bits_f32(static_cast<uint32_t>(h) << 16); }

inline uint16_t float_to_bf16(float f) {
  uint32_t u = f32_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

struct Hyper {
  float beta1, beta2, eps, lr, weight_decay, grad_scale_inv;
  int adamw_mode;
};

struct TensorArgs {
  float* param;
  const void* grad;
  float* exp_avg;
  float* exp_avg_sq;
  void* copy;
  int32_t grad_dtype;
  int32_t copy_dtype;
  float step_size;         // lr / (1 - beta1^t)
  float inv_bc2_sqrt;      // 1 / sqrt(1 - beta2^t)
};

inline float load_grad_scalar(const void* g, int32_t dtype, int64_t i) {
  switch (dtype) {
    case kFloat16: return half_to_float(static_cast<const uint16_t*>(g)[i]);
    case kBFloat16: return bf16_to_float(static_cast<const uint16_t*>(g)[i]);
    default: return static_cast<const float*>(g)[i];
  }
}

inline void store_copy_scalar(void* c, int32_t dtype, int64_t i, float x) {
  switch (dtype) {
    case kFloat16: static_cast<uint16_t*>(c)[i] = float_to_half(x); break;
    case kBFloat16: static_cast<uint16_t*>(c)[i] = float_to_bf16(x); break;
    case kFloat32: static_cast<float*>(c)[i] = x; break;
    default: break;
  }
}

void scalar_range(const TensorArgs& t, const Hyper& h, int64_t begin, int64_t end) {
  const float omb1 = 1.0f - h.beta1, omb2 = 1.0f - h.beta2;
  const float decay = 1.0f - h.lr * h.weight_decay;
  const bool l2 = !h.adamw_mode && h.weight_decay != 0.0f;
  const bool decoupled = h.adamw_mode && h.weight_decay != 0.0f;
  for (int64_t i = begin; i < end; ++i) {
    float g = load_grad_scalar(t.grad, t.grad_dtype, i) * h.grad_scale_inv;
    float p = t.param[i];
    if (l2) g += h.weight_decay * p;
    float m = t.exp_avg[i];
    m = m + omb1 * (g - m);
    float v = h.beta2 * t.exp_avg_sq[i] + omb2 * g * g;
    const float denom = std::sqrt(v) * t.inv_bc2_sqrt + h.eps;
    if (decoupled) p *= decay;
    p = p - t.step_size * (m / denom);
    t.exp_avg[i] = m;
    t.exp_avg_sq[i] = v;
    t.param[i] = p;
    store_copy_scalar(t.copy, t.copy_dtype, i, p);
  }
}

#ifdef COLOSSAL_ADAM_AVX512
inline __m512 load_grad16(const void* g, int32_t dtype, int64_t i) {
  if (dtype == kFloat32) return _mm512_loadu_ps(static_cast<const float*>(g) + i);
  const __m256i raw =
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(g) + i));
  if (dtype == kFloat16) return _mm512_cvtph_ps(raw);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

inline __m256i to_bf16_16(__m512 x) {
#if defined(__AVX512BF16__)
  return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x));
#else
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  r = _mm512_srli_epi32(r, 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(_mm512_srli_epi32(u, 16),
                                                   _mm512_set1_epi32(0x40)));
  return _mm512_cvtepi32_epi16(r);
#endif
}

inline void store_copy16(void* c, int32_t dtype, int64_t i, __m512 x) {
  if (dtype == kFloat32) {
    _mm512_storeu_ps(static_cast<float*>(c) + i, x);
  } else if (dtype == kFloat16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(c) + i),
                        _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  } else if (dtype == kBFloat16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(c) + i),
                        to_bf16_16(x));
  }
}

void simd_range(const TensorArgs& t, const Hyper& h, int64_t begin, int64_t end) {
  const __m512 b1 = _mm512_set1_ps(h.beta1), omb1 = _mm512_set1_ps(1.0f - h.beta1);
  const __m512 b2 = _mm512_set1_ps(h.beta2), omb2 = _mm512_set1_ps(1.0f - h.beta2);
  const __m512 eps = _mm512_set1_ps(h.eps), wd = _mm512_set1_ps(h.weight_decay);
  const __m512 decay = _mm512_set1_ps(1.0f - h.lr * h.weight_decay);
  const __m512 scale = _mm512_set1_ps(h.grad_scale_inv);
  const __m512 step_size = _mm512_set1_ps(t.step_size);
  const __m512 inv_bc2 = _mm512_set1_ps(t.inv_bc2_sqrt);
  const bool l2 = !h.adamw_mode && h.weight_decay != 0.0f;
  const bool decoupled = h.adamw_mode && h.weight_decay != 0.0f;
  (void)b1;
  int64_t i = begin;
  const int64_t vec_end = begin + ((end - begin) / 16) * 16;
  for (; i < vec_end; i += 16) {
    __m512 g = _mm512_mul_ps(load_grad16(t.grad, t.grad_dtype, i), scale);
    __m512 p = _mm512_loadu_ps(t.param + i);
    if (l2) g = _mm512_fmadd_ps(wd, p, g);
    __m512 m = _mm512_loadu_ps(t.exp_avg + i);
    m = _mm512_fmadd_ps(omb1, _mm512_sub_ps(g, m), m);
    __m512 v = _mm512_mul_ps(b2, _mm512_loadu_ps(t.exp_avg_sq + i));
    v = _mm512_fmadd_ps(_mm512_mul_ps(omb2, g), g, v);
    const __m512 denom = _mm512_fmadd_ps(_mm512_sqrt_ps(v), inv_bc2, eps);
    if (decoupled) p = _mm512_mul_ps(p, decay);
    p = _mm512_fnmadd_ps(step_size, _mm512_div_ps(m, denom), p);
    _mm512_storeu_ps(t.exp_avg + i, m);
    _mm512_storeu_ps(t.exp_avg_sq + i, v);
    _mm512_storeu_ps(t.param + i, p);
    if (t.copy_dtype != kNone) store_copy16(t.copy, t.copy_dtype, i, p);
  }
  if (i < end) scalar_range(t, h, i, end);
}
#endif

}  // namespace

extern "C" {

// Bumped whenever the signature below changes; the loader checks it.
int colossal_adam_abi_version() { return 1; }

// 1 when the AVX-512 path was compiled in, 0 for the portable scalar loop.
int colossal_adam_simd() {
#ifdef COLOSSAL_ADAM_AVX512
  return 1;
#else
  return 0;
#endif
}

// One Adam/AdamW step over n tensors. Arrays have n entries; copies[i] may be null (with
// copy_dtypes[i] == -1). grad_scale_inv multiplies every grad (1 / loss-scale divisor).
void colossal_adam_step(int64_t n, const int64_t* numels, float* const* params,
                        const void* const* grads, float* const* exp_avgs,
                        float* const* exp_avg_sqs, void* const* copies,
                        const int32_t* grad_dtypes, const int32_t* copy_dtypes,
                        const float* step_sizes, const float* inv_bc2_sqrts, float beta1,
                        float beta2, float eps, float lr, float weight_decay, int adamw_mode,
                        float grad_scale_inv, int num_threads) {
  const Hyper h{beta1, beta2, eps, lr, weight_decay, grad_scale_inv, adamw_mode};
  std::vector<TensorArgs> tensors(static_cast<size_t>(n));
  std::vector<std::pair<int64_t, int64_t>> work;  // (tensor, chunk start)
  for (int64_t k = 0; k < n; ++k) {
    tensors[k] = TensorArgs{params[k],      grads[k],       exp_avgs[k],
                            exp_avg_sqs[k], copies[k],      grad_dtypes[k],
                            copies[k] ? copy_dtypes[k] : kNone, step_sizes[k],
                            inv_bc2_sqrts[k]};
    for (int64_t s = 0; s < numels[k]; s += kChunk) work.emplace_back(k, s);
  }
  const int64_t items = static_cast<int64_t>(work.size());
  if (num_threads < 1) num_threads = 1;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (items > 1)
  for (int64_t w = 0; w < items; ++w) {
    const int64_t k = work[w].first;
    const int64_t begin = work[w].second;
    const int64_t end = begin + kChunk < numels[k] ? begin + kChunk : numels[k];
#ifdef COLOSSAL_ADAM_AVX512
    simd_range(tensors[k], h, begin, end);
#else
    scalar_range(tensors[k], h, begin, end);
#endif
  }
}

}  // extern "C"
