// Fused Adam/AdamW step for CPU tensors (colossal-kernels).
//
// One pass per element: read the grad (fp32, fp16 or bf16), multiply by the inverse loss
// scale, update the fp32 param, exp_avg and exp_avg_sq, and optionally write an fp16/bf16/fp32
// copy of the updated param. The library exposes a plain C ABI (no torch headers) and is
// called through ctypes, which releases the GIL for the duration of a call. Work is split into
// fixed-size chunks across all tensors of a call, one contiguous range of chunks per OpenMP
// thread, and a thread done with its range takes over the rest of a slower one's (WorkRanges);
// the caller passes the thread count of every call (torch.get_num_threads(), not
// OMP_NUM_THREADS).
//
// Instruction sets are chosen at run time, so one build (compiled for the baseline of its
// architecture, no -march=native) serves every CPU of that architecture:
//   avx512   16 floats per vector, two vectors per iteration (x86 with AVX-512F),
//   avx2     8 floats per vector, four vectors per iteration (x86 with AVX2, FMA and F16C),
//   portable a loop specialised per dtype pair that the compiler vectorises for the baseline.
// The caller may ask for a specific one (the Python side reads COLOSSAL_CPU_ADAM_ISA); every
// path computes the same formula and rounds fp16/bf16 copies to nearest even.

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#if (defined(__GNUC__) || defined(__clang__)) && (defined(__x86_64__) || defined(__i386__))
#define COLOSSAL_ADAM_X86 1
#include <cpuid.h>
#include <immintrin.h>
#define TARGET_AVX512 __attribute__((target("avx512f,avx2,fma,f16c")))
#define TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
#endif

namespace {

constexpr int64_t kChunk = 1 << 15;  // elements per work item (multiple of 16)
// Steps over at least this many elements (> 100 MB moved, far beyond any cache) write the
// working copies with non-temporal stores: the copy is write-only, so a normal store would
// first read each cache line (2 more bytes per element of 28 with a bf16 copy).
constexpr int64_t kStreamMinElements = 1 << 22;

enum DType : int32_t { kNone = -1, kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };
enum Isa : int32_t { kAuto = -1, kPortable = 0, kAvx2 = 1, kAvx512 = 2 };

std::atomic<int> g_last_threads{0};

inline uint32_t f32_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float bits_f32(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

// IEEE half <-> float (round to nearest even), after Maratyszcza's FP16 library.
inline float half_to_float(uint16_t h) {
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const float normalized = bits_f32((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  const float denormalized = bits_f32((two_w >> 17) | (126u << 23)) - 0.5f;
  const uint32_t normal = 0u - static_cast<uint32_t>(two_w >= (1u << 27));  // mask, no branch
  return bits_f32(sign | (f32_bits(normalized) & normal) | (f32_bits(denormalized) & ~normal));
}

inline uint16_t float_to_half(float f) {
  float base = (std::fabs(f) * 0x1.0p+112f) * 0x1.0p-110f;
  const uint32_t w = f32_bits(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  bias = bias < 0x71000000u ? 0x71000000u : bias;  // a select, not a branch (vectorises)
  base = bits_f32((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = f32_bits(base);
  const uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
  const uint32_t mantissa_bits = bits & 0x00000FFFu;
  const uint32_t nonsign = exp_bits + mantissa_bits;
  const uint32_t nan = 0u - static_cast<uint32_t>(shl1_w > 0xFF000000u);  // mask, no branch
  return static_cast<uint16_t>((sign >> 16) | (0x7E00u & nan) | (nonsign & ~nan));
}

inline float bf16_to_float(uint16_t h) { return bits_f32(static_cast<uint32_t>(h) << 16); }

// Branch-free (both results, then a select) so the portable loop vectorises.
inline uint16_t float_to_bf16(float f) {
  const uint32_t u = f32_bits(f);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  const uint32_t quiet_nan = (u >> 16) | 0x40u;
  return static_cast<uint16_t>((u & 0x7FFFFFFFu) > 0x7F800000u ? quiet_nan : rounded);
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
  bool stream_copy;        // non-temporal copy stores (copy 64-byte aligned, large step)
};

using RangeFn = void (*)(const TensorArgs&, const Hyper&, int64_t, int64_t);

// ---- portable: one loop per (grad dtype, copy dtype), no per-element dispatch ----------------

template <int G>
inline float load_grad_scalar(const void* g, int64_t i) {
  if (G == kFloat16) return half_to_float(static_cast<const uint16_t*>(g)[i]);
  if (G == kBFloat16) return bf16_to_float(static_cast<const uint16_t*>(g)[i]);
  return static_cast<const float*>(g)[i];
}

template <int C>
inline void store_copy_scalar(void* c, int64_t i, float x) {
  if (C == kFloat16) static_cast<uint16_t*>(c)[i] = float_to_half(x);
  if (C == kBFloat16) static_cast<uint16_t*>(c)[i] = float_to_bf16(x);
  if (C == kFloat32) static_cast<float*>(c)[i] = x;
}

enum Decay : int { kNoDecay = 0, kL2 = 1, kDecoupled = 2 };

inline int decay_kind(const Hyper& h) {
  if (h.weight_decay == 0.0f) return kNoDecay;
  return h.adamw_mode ? kDecoupled : kL2;
}

// Weight decay is a template parameter: a branch in the loop keeps it from vectorising.
template <int G, int C, int W>
void portable_loop(const TensorArgs& t, const Hyper& h, int64_t begin, int64_t end) {
  const float b2 = h.beta2, omb1 = 1.0f - h.beta1, omb2 = 1.0f - h.beta2;
  const float wd = h.weight_decay, decay = 1.0f - h.lr * h.weight_decay;
  const float scale = h.grad_scale_inv, eps = h.eps;
  const float step_size = t.step_size, inv_bc2 = t.inv_bc2_sqrt;
  float* __restrict__ param = t.param;
  float* __restrict__ exp_avg = t.exp_avg;
  float* __restrict__ exp_avg_sq = t.exp_avg_sq;
  const void* grad = t.grad;
  void* copy = t.copy;
  for (int64_t i = begin; i < end; ++i) {
    float g = load_grad_scalar<G>(grad, i) * scale;
    float p = param[i];
    if (W == kL2) g += wd * p;
    float m = exp_avg[i];
    m = m + omb1 * (g - m);
    const float v = b2 * exp_avg_sq[i] + omb2 * g * g;
    const float denom = std::sqrt(v) * inv_bc2 + eps;
    if (W == kDecoupled) p *= decay;
    p = p - step_size * (m / denom);
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    param[i] = p;
    store_copy_scalar<C>(copy, i, p);
  }
}

template <int G, int C>
void portable_range(const TensorArgs& t, const Hyper& h, int64_t begin, int64_t end) {
  switch (decay_kind(h)) {
    case kL2: portable_loop<G, C, kL2>(t, h, begin, end); break;
    case kDecoupled: portable_loop<G, C, kDecoupled>(t, h, begin, end); break;
    default: portable_loop<G, C, kNoDecay>(t, h, begin, end); break;
  }
}

// Picks the instantiation of ``Range<G, C>`` for a tensor's dtypes (C == kNone: no copy).
template <template <int, int> class Range>
RangeFn pick(int32_t grad_dtype, int32_t copy_dtype) {
  static const RangeFn table[3][4] = {
      {Range<kFloat32, kNone>::run, Range<kFloat32, kFloat32>::run,
       Range<kFloat32, kFloat16>::run, Range<kFloat32, kBFloat16>::run},
      {Range<kFloat16, kNone>::run, Range<kFloat16, kFloat32>::run,
       Range<kFloat16, kFloat16>::run, Range<kFloat16, kBFloat16>::run},
      {Range<kBFloat16, kNone>::run, Range<kBFloat16, kFloat32>::run,
       Range<kBFloat16, kFloat16>::run, Range<kBFloat16, kBFloat16>::run},
  };
  return table[grad_dtype][copy_dtype + 1];
}

template <int G, int C>
struct Portable {
  static void run(const TensorArgs& t, const Hyper& h, int64_t b, int64_t e) {
    portable_range<G, C>(t, h, b, e);
  }
};

#ifdef COLOSSAL_ADAM_X86
// ---- AVX2 + FMA + F16C: four 8-float vectors per iteration -----------------------------------

template <int G>
TARGET_AVX2 inline __m256 avx2_load_grad(const void* g, int64_t i) {
  if (G == kFloat32) return _mm256_loadu_ps(static_cast<const float*>(g) + i);
  const __m128i raw =
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(g) + i));
  if (G == kFloat16) return _mm256_cvtph_ps(raw);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

// bf16 bits (round to nearest even, NaN kept quiet) in the low half of each 32-bit lane.
TARGET_AVX2 inline __m256i avx2_bf16_bits(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i hi = _mm256_srli_epi32(u, 16);
  const __m256i lsb = _mm256_and_si256(hi, _mm256_set1_epi32(1));
  const __m256i r =
      _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(r, _mm256_or_si256(hi, _mm256_set1_epi32(0x40)), nan);
}

TARGET_AVX2 inline void avx2_store256(__m256i* dst, __m256i x, bool stream) {
  if (stream) {
    _mm256_stream_si256(dst, x);
  } else {
    _mm256_storeu_si256(dst, x);
  }
}

// Copy elements i..i+15; ``stream`` needs i's address 32-byte aligned.
template <int C>
TARGET_AVX2 inline void avx2_store_copy(void* c, int64_t i, __m256 a, __m256 b, bool stream) {
  if (C == kFloat32) {
    __m256i* out = reinterpret_cast<__m256i*>(static_cast<float*>(c) + i);
    avx2_store256(out, _mm256_castps_si256(a), stream);
    avx2_store256(out + 1, _mm256_castps_si256(b), stream);
  } else if (C == kFloat16) {
    const __m128i lo = _mm256_cvtps_ph(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m128i hi = _mm256_cvtps_ph(b, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    avx2_store256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(c) + i),
                  _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1), stream);
  } else if (C == kBFloat16) {
    // packus works per 128-bit lane: [a0-3 b0-3 a4-7 b4-7]; restore the order.
    const __m256i packed = _mm256_packus_epi32(avx2_bf16_bits(a), avx2_bf16_bits(b));
    avx2_store256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(c) + i),
                  _mm256_permute4x64_epi64(packed, 0xD8), stream);
  }
}

template <int G, int C>
TARGET_AVX2 void avx2_range(const TensorArgs& t, const Hyper& h, int64_t begin, int64_t end) {
  const __m256 b2 = _mm256_set1_ps(h.beta2), omb1 = _mm256_set1_ps(1.0f - h.beta1);
  const __m256 omb2 = _mm256_set1_ps(1.0f - h.beta2), eps = _mm256_set1_ps(h.eps);
  const __m256 wd = _mm256_set1_ps(h.weight_decay);
  const __m256 decay = _mm256_set1_ps(1.0f - h.lr * h.weight_decay);
  const __m256 scale = _mm256_set1_ps(h.grad_scale_inv);
  const __m256 step_size = _mm256_set1_ps(t.step_size);
  const __m256 inv_bc2 = _mm256_set1_ps(t.inv_bc2_sqrt);
  const bool l2 = !h.adamw_mode && h.weight_decay != 0.0f;
  const bool decoupled = h.adamw_mode && h.weight_decay != 0.0f;
  float* __restrict__ param = t.param;
  float* __restrict__ exp_avg = t.exp_avg;
  float* __restrict__ exp_avg_sq = t.exp_avg_sq;
  // Updates elements j..j+15 (two vectors) into p.
  const auto update = [&](int64_t j, __m256* p) TARGET_AVX2 {
    for (int k = 0; k < 2; ++k) {
      const int64_t e = j + 8 * k;
      __m256 g = _mm256_mul_ps(avx2_load_grad<G>(t.grad, e), scale);
      p[k] = _mm256_loadu_ps(param + e);
      if (l2) g = _mm256_fmadd_ps(wd, p[k], g);
      __m256 m = _mm256_loadu_ps(exp_avg + e);
      m = _mm256_fmadd_ps(omb1, _mm256_sub_ps(g, m), m);
      __m256 v = _mm256_mul_ps(b2, _mm256_loadu_ps(exp_avg_sq + e));
      v = _mm256_fmadd_ps(_mm256_mul_ps(omb2, g), g, v);
      const __m256 denom = _mm256_fmadd_ps(_mm256_sqrt_ps(v), inv_bc2, eps);
      if (decoupled) p[k] = _mm256_mul_ps(p[k], decay);
      p[k] = _mm256_fnmadd_ps(step_size, _mm256_div_ps(m, denom), p[k]);
      _mm256_storeu_ps(exp_avg + e, m);
      _mm256_storeu_ps(exp_avg_sq + e, v);
      _mm256_storeu_ps(param + e, p[k]);
    }
  };
  int64_t i = begin;
  // 32 elements per iteration, their copy stored last: the two halves of a 64-byte line of
  // an fp16/bf16 copy are written back to back (a non-temporal line leaves at once).
  for (const int64_t pair_end = begin + ((end - begin) / 32) * 32; i < pair_end; i += 32) {
    __m256 p[4];
    update(i, p);
    update(i + 16, p + 2);
    if (C != kNone) {
      avx2_store_copy<C>(t.copy, i, p[0], p[1], t.stream_copy);
      avx2_store_copy<C>(t.copy, i + 16, p[2], p[3], t.stream_copy);
    }
  }
  if (end - i >= 16) {
    __m256 p[2];
    update(i, p);
    if (C != kNone) avx2_store_copy<C>(t.copy, i, p[0], p[1], t.stream_copy);
    i += 16;
  }
  if (C != kNone && t.stream_copy) _mm_sfence();  // order them before the region's end
  if (i < end) portable_range<G, C>(t, h, i, end);
}

template <int G, int C>
struct Avx2 {
  static void run(const TensorArgs& t, const Hyper& h, int64_t b, int64_t e) {
    avx2_range<G, C>(t, h, b, e);
  }
};

// ---- AVX-512F: 16 floats per vector ----------------------------------------------------------

template <int G>
TARGET_AVX512 inline __m512 avx512_load_grad(const void* g, int64_t i) {
  if (G == kFloat32) return _mm512_loadu_ps(static_cast<const float*>(g) + i);
  const __m256i raw =
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(g) + i));
  if (G == kFloat16) return _mm512_cvtph_ps(raw);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// Integer rounding rather than AVX512-BF16's vcvtneps2bf16, which flushes denormals to zero.
TARGET_AVX512 inline __m256i avx512_to_bf16(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i hi = _mm512_srli_epi32(u, 16);
  const __m512i lsb = _mm512_and_si512(hi, _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  r = _mm512_srli_epi32(r, 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(hi, _mm512_set1_epi32(0x40)));
  return _mm512_cvtepi32_epi16(r);
}

// Copy elements i..i+15; ``stream`` needs i's address 64-byte aligned.
template <int C>
TARGET_AVX512 inline void avx512_store_copy(void* c, int64_t i, __m512 x, bool stream) {
  if (C == kFloat32) {
    float* out = static_cast<float*>(c) + i;
    if (stream) {
      _mm512_stream_ps(out, x);
    } else {
      _mm512_storeu_ps(out, x);
    }
  } else if (C == kFloat16) {
    avx2_store256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(c) + i),
                  _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), stream);
  } else if (C == kBFloat16) {
    avx2_store256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(c) + i),
                  avx512_to_bf16(x), stream);
  }
}

// Copy elements i..i+31 (two vectors): a whole 64-byte line per store for fp16/bf16 copies,
// so a non-temporal line is written at once; ``stream`` needs i's address 64-byte aligned.
template <int C>
TARGET_AVX512 inline void avx512_store_copy2(void* c, int64_t i, __m512 a, __m512 b,
                                             bool stream) {
  if (C == kFloat32) {
    avx512_store_copy<C>(c, i, a, stream);
    avx512_store_copy<C>(c, i + 16, b, stream);
    return;
  }
  __m256i lo, hi;
  if (C == kFloat16) {
    lo = _mm512_cvtps_ph(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    hi = _mm512_cvtps_ph(b, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  } else {
    lo = avx512_to_bf16(a);
    hi = avx512_to_bf16(b);
  }
  const __m512i x = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
  __m512i* out = reinterpret_cast<__m512i*>(static_cast<uint16_t*>(c) + i);
  if (stream) {
    _mm512_stream_si512(out, x);
  } else {
    _mm512_storeu_si512(out, x);
  }
}

template <int G, int C>
TARGET_AVX512 void avx512_range(const TensorArgs& t, const Hyper& h, int64_t begin,
                                int64_t end) {
  const __m512 b2 = _mm512_set1_ps(h.beta2), omb1 = _mm512_set1_ps(1.0f - h.beta1);
  const __m512 omb2 = _mm512_set1_ps(1.0f - h.beta2), eps = _mm512_set1_ps(h.eps);
  const __m512 wd = _mm512_set1_ps(h.weight_decay);
  const __m512 decay = _mm512_set1_ps(1.0f - h.lr * h.weight_decay);
  const __m512 scale = _mm512_set1_ps(h.grad_scale_inv);
  const __m512 step_size = _mm512_set1_ps(t.step_size);
  const __m512 inv_bc2 = _mm512_set1_ps(t.inv_bc2_sqrt);
  const bool l2 = !h.adamw_mode && h.weight_decay != 0.0f;
  const bool decoupled = h.adamw_mode && h.weight_decay != 0.0f;
  float* __restrict__ param = t.param;
  float* __restrict__ exp_avg = t.exp_avg;
  float* __restrict__ exp_avg_sq = t.exp_avg_sq;
  // Updates elements j..j+15 and returns the new param.
  const auto update = [&](int64_t j) TARGET_AVX512 {
    __m512 g = _mm512_mul_ps(avx512_load_grad<G>(t.grad, j), scale);
    __m512 p = _mm512_loadu_ps(param + j);
    if (l2) g = _mm512_fmadd_ps(wd, p, g);
    __m512 m = _mm512_loadu_ps(exp_avg + j);
    m = _mm512_fmadd_ps(omb1, _mm512_sub_ps(g, m), m);
    __m512 v = _mm512_mul_ps(b2, _mm512_loadu_ps(exp_avg_sq + j));
    v = _mm512_fmadd_ps(_mm512_mul_ps(omb2, g), g, v);
    const __m512 denom = _mm512_fmadd_ps(_mm512_sqrt_ps(v), inv_bc2, eps);
    if (decoupled) p = _mm512_mul_ps(p, decay);
    p = _mm512_fnmadd_ps(step_size, _mm512_div_ps(m, denom), p);
    _mm512_storeu_ps(exp_avg + j, m);
    _mm512_storeu_ps(exp_avg_sq + j, v);
    _mm512_storeu_ps(param + j, p);
    return p;
  };
  int64_t i = begin;
  for (const int64_t pair_end = begin + ((end - begin) / 32) * 32; i < pair_end; i += 32) {
    const __m512 p0 = update(i);
    const __m512 p1 = update(i + 16);
    if (C != kNone) avx512_store_copy2<C>(t.copy, i, p0, p1, t.stream_copy);
  }
  if (end - i >= 16) {
    const __m512 p = update(i);
    if (C != kNone) avx512_store_copy<C>(t.copy, i, p, t.stream_copy);
    i += 16;
  }
  if (C != kNone && t.stream_copy) _mm_sfence();  // order them before the region's end
  if (i < end) portable_range<G, C>(t, h, i, end);
}

template <int G, int C>
struct Avx512 {
  static void run(const TensorArgs& t, const Hyper& h, int64_t b, int64_t e) {
    avx512_range<G, C>(t, h, b, e);
  }
};

bool cpu_has_f16c() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  return __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C) != 0;
}
#endif  // COLOSSAL_ADAM_X86

// Bit i set when Isa i can run here (the OS-usability of AVX state is checked by libgcc).
int supported_mask() {
  int mask = 1 << kPortable;
#ifdef COLOSSAL_ADAM_X86
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    cpu_has_f16c();
  if (avx2) mask |= 1 << kAvx2;
  if (avx2 && __builtin_cpu_supports("avx512f")) mask |= 1 << kAvx512;
#endif
  return mask;
}

int resolve(int32_t requested) {
  static const int mask = supported_mask();
  if (requested == kAuto) {
    for (int isa = kAvx512; isa > kPortable; --isa) {
      if (mask & (1 << isa)) return isa;
    }
    return kPortable;
  }
  if (requested < kPortable || requested > kAvx512 || !(mask & (1 << requested))) return -1;
  return requested;
}

RangeFn range_fn(int isa, int32_t grad_dtype, int32_t copy_dtype) {
#ifdef COLOSSAL_ADAM_X86
  if (isa == kAvx512) return pick<Avx512>(grad_dtype, copy_dtype);
  if (isa == kAvx2) return pick<Avx2>(grad_dtype, copy_dtype);
#endif
  (void)isa;
  return pick<Portable>(grad_dtype, copy_dtype);
}

// Work items 0..items-1 shared by the threads of a step: one contiguous range per thread
// (what a static schedule gives), taken from the front by its owner; a thread whose range is
// done takes the others' remaining items from their back, one at a time. On a quiet machine
// each thread streams through its own range; when a thread is preempted (a machine shared
// with other work), the others finish its range instead of waiting for it at the region's
// end. A range is one 64-bit word (next << 32 | end) changed by compare-and-swap, so an item
// is run exactly once; items that no thread owns (a team smaller than asked for) are taken
// the same way. Items are at most 2^32 - 1 (about 1.4e14 elements in 32768-element items).
class WorkRanges {
 public:
  WorkRanges(int64_t items, int parts) : slots_(static_cast<size_t>(parts)) {
    for (int t = 0; t < parts; ++t) {
      const uint64_t lo = static_cast<uint64_t>(items * t / parts);
      const uint64_t hi = static_cast<uint64_t>(items * (t + 1) / parts);
      slots_[static_cast<size_t>(t)].range.store((lo << 32) | hi, std::memory_order_relaxed);
    }
  }

  // Runs fn(item) for thread ``self``'s items, then for the items left in the other ranges.
  template <class Fn>
  void run(int self, const Fn& fn) {
    const size_t parts = slots_.size();
    int64_t item = 0;
    while (take(slots_[static_cast<size_t>(self) % parts], true, &item)) fn(item);
    for (size_t d = 1; d < parts; ++d) {
      Slot& victim = slots_[(static_cast<size_t>(self) + d) % parts];
      while (take(victim, false, &item)) fn(item);
    }
  }

 private:
  struct alignas(64) Slot {  // one cache line each: owners do not contend
    std::atomic<uint64_t> range{0};
  };

  static bool take(Slot& slot, bool front, int64_t* item) {
    uint64_t cur = slot.range.load(std::memory_order_relaxed);
    for (;;) {
      const uint64_t next = cur >> 32, end = cur & 0xFFFFFFFFu;
      if (next >= end) return false;
      const uint64_t want = front ? (((next + 1) << 32) | end) : ((next << 32) | (end - 1));
      // Relaxed: items touch disjoint memory, and the region's end orders their writes.
      if (slot.range.compare_exchange_weak(cur, want, std::memory_order_relaxed)) {
        *item = static_cast<int64_t>(front ? next : end - 1);
        return true;
      }
    }
  }

  std::vector<Slot> slots_;
};

}  // namespace

extern "C" {

// Bumped whenever a signature below changes; the loader checks it.
int colossal_adam_abi_version() { return 2; }

// Bit mask of the instruction sets this CPU can run: 1 portable, 2 avx2, 4 avx512.
int colossal_adam_supported_isas() { return supported_mask(); }

// The instruction set a step asked for ``requested`` runs (-1: auto, the best one), or -1 when
// that one cannot run here.
int colossal_adam_resolve_isa(int requested) { return resolve(requested); }

// OpenMP threads of the last step's parallel region (1 when it ran serially).
int colossal_adam_last_threads() { return g_last_threads.load(); }

// One Adam/AdamW step over n tensors. Arrays have n entries; copies[i] may be null (with
// copy_dtypes[i] == -1). grad_scale_inv multiplies every grad (1 / loss-scale divisor).
// Runs on ``num_threads`` OpenMP threads with instruction set ``isa`` (see resolve); returns
// the instruction set it ran, or -1 (and touches nothing) when ``isa`` cannot run here.
int colossal_adam_step(int64_t n, const int64_t* numels, float* const* params,
                       const void* const* grads, float* const* exp_avgs,
                       float* const* exp_avg_sqs, void* const* copies,
                       const int32_t* grad_dtypes, const int32_t* copy_dtypes,
                       const float* step_sizes, const float* inv_bc2_sqrts, float beta1,
                       float beta2, float eps, float lr, float weight_decay, int adamw_mode,
                       float grad_scale_inv, int num_threads, int isa) {
  const int ran = resolve(isa);
  if (ran < 0) return -1;
  const Hyper h{beta1, beta2, eps, lr, weight_decay, grad_scale_inv, adamw_mode};
  std::vector<TensorArgs> tensors(static_cast<size_t>(n));
  std::vector<RangeFn> fns(static_cast<size_t>(n));
  std::vector<std::pair<int64_t, int64_t>> work;  // (tensor, chunk start)
  int64_t total = 0;
  for (int64_t k = 0; k < n; ++k) total += numels[k];
  for (int64_t k = 0; k < n; ++k) {
    const int32_t copy_dtype = copies[k] ? copy_dtypes[k] : kNone;
    // Chunk starts are multiples of kChunk elements, so an aligned copy stays aligned.
    const bool stream = copies[k] && total >= kStreamMinElements &&
                        reinterpret_cast<uintptr_t>(copies[k]) % 64 == 0;
    tensors[k] = TensorArgs{params[k],      grads[k],      exp_avgs[k],
                            exp_avg_sqs[k], copies[k],     grad_dtypes[k],
                            copy_dtype,     step_sizes[k], inv_bc2_sqrts[k],
                            stream};
    fns[k] = range_fn(ran, grad_dtypes[k], copy_dtype);
    for (int64_t s = 0; s < numels[k]; s += kChunk) work.emplace_back(k, s);
  }
  const int64_t items = static_cast<int64_t>(work.size());
  if (num_threads < 1) num_threads = 1;
  const auto run_item = [&](int64_t w) {
    const int64_t k = work[static_cast<size_t>(w)].first;
    const int64_t begin = work[static_cast<size_t>(w)].second;
    const int64_t end = begin + kChunk < numels[k] ? begin + kChunk : numels[k];
    fns[k](tensors[k], h, begin, end);
  };
  g_last_threads.store(1);
  if (items <= 1 || num_threads == 1) {
    for (int64_t w = 0; w < items; ++w) run_item(w);
    return ran;
  }
  WorkRanges ranges(items, num_threads);
#pragma omp parallel num_threads(num_threads)
  {
    int self = 0;
#ifdef _OPENMP
    self = omp_get_thread_num();
    if (self == 0) g_last_threads.store(omp_get_num_threads());
#endif
    ranges.run(self, run_item);
  }
  return ran;
}

}  // extern "C"
