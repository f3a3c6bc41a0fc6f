/* What the kernel files share: bf16 and fp16 widening, bf16 rounding, the AVX2 switch and vectorised exps. */
#ifndef KVFLOW_SIMD_H
#define KVFLOW_SIMD_H
#include <stdint.h>
#include <string.h>

/* bf16 -> fp32 is exact: the 16 bits become the top half of the float */
static inline float bf16_to_float(uint16_t v) {
    union { uint32_t u; float f; } x = { (uint32_t)v << 16 };
    return x.f;
}

/* IEEE half -> fp32, exact (subnormals, infinities and NaNs included) */
static inline float f16_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    union { uint32_t u; float f; } x;
    if (e == 0) {
        x.f = (float)m * 0x1p-24f; /* zero or subnormal: exact in float */
        x.u |= sign;
    } else if (e == 31) {
        x.u = sign | 0x7f800000u | (m << 13);
    } else {
        x.u = sign | ((e + 112u) << 23) | (m << 13);
    }
    return x.f;
}

/* fp32 -> bf16, rounding to nearest even (as torch's .to(torch.bfloat16)); NaN stays NaN. */
static inline uint16_t float_to_bf16(float f) {
    union { float f; uint32_t u; } x = { f };
    if ((x.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x.u >> 16) | 0x40);
    return (uint16_t)((x.u + 0x7fffu + ((x.u >> 16) & 1u)) >> 16);
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KVFLOW_AVX2 1

static inline __m256 load8_bf16(const uint16_t *p) {
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* exp(x) for 8 floats: Cephes' polynomial, about 1 ulp in float over [-87.3, 88.3]
 * (inputs are clamped to it). */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
    __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500E-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
#endif

#ifdef __AVX512F__
#include <immintrin.h>
/* 16 bf16 values widened to fp32 (exact) */
static inline __m512 widen16_bf16(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
static inline __m512 load16_bf16(const uint16_t *p) {
    return widen16_bf16(_mm256_loadu_si256((const __m256i *)p));
}

/* exp8 for 16 floats (AVX-512); -inf gives 0 */
static inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.3f));
    __m512 fx = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
    x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), x);
    __m512 y = _mm512_set1_ps(1.9875691500E-4f);
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507E-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073E-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894E-2f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459E-1f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201E-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(fx), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}

#ifdef __AVX512BF16__
/* one bf16 rounding (nearest even), kept as fp32 */
static inline __m512 round16_bf16(__m512 v) { return widen16_bf16((__m256i)_mm512_cvtneps_pbh(v)); }

/* a 32-bit pair of bf16 values in every lane, for `vdpbf16ps`: given, or read from p (any
 * alignment) */
static inline __m512bh bcast_pair(uint32_t pair) { return (__m512bh)_mm512_set1_epi32((int)pair); }
static inline __m512bh bcast_pair_at(const uint16_t *p) {
    uint32_t pair;
    memcpy(&pair, p, sizeof pair);
    return bcast_pair(pair);
}

/* bf16(bf16(silu(g)) * u) for 16 bf16-exact g and u, as PyTorch's bf16 ops round. An exact
 * division: a reciprocal estimate moved results across bf16 rounding boundaries (2 ulps off
 * PyTorch in 0.07% of outputs). */
static inline __m256i silu_mul16_bf16(__m512 g, __m512 u) {
    const __m512 d = _mm512_add_ps(_mm512_set1_ps(1.f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), g)));
    return (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(round16_bf16(_mm512_div_ps(g, d)), u));
}
#endif
#endif
/* The paged attention kernels' softmax (paged_attention.c, paged_attention_quant.c). */
#include <math.h>
#ifdef KVFLOW_AVX2
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

/* A head's attention sink (a learned logit that joins the softmax's denominator as a key whose
 * value is zero), -inf where the model has none (`sinks` NULL): adding exp(-inf) changes nothing. */
static inline float sink_of(const float *sinks, int64_t h) { return sinks ? sinks[h] : -INFINITY; }

/* The softmax's denominator over its keys' `sum` (taken at max `m`) with a sink joined: its
 * exp(sink - m) added (where it overflows, the output is 0 to fp32's precision anyway). */
static inline float with_sink(float sum, float m, float sink) {
    return sink > -INFINITY ? sum + expf(sink - m) : sum;
}

/* exp(s - max) in place over n scores; returns 1 / their sum, `sink` joined (sink_of; the
 * caller scales the output). */
static inline float softmax_unnormalised(float *s, int64_t n, float sink) {
    float m = -INFINITY, sum = 0.f;
    int64_t t = 0;
#ifdef KVFLOW_AVX2
    __m256 vm = _mm256_set1_ps(-INFINITY);
    for (; t + 8 <= n; t += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(s + t));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vm), _mm256_extractf128_ps(vm, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    m = _mm_cvtss_f32(m4);
#endif
    for (; t < n; t++) m = s[t] > m ? s[t] : m;
    t = 0;
#ifdef KVFLOW_AVX2
    vm = _mm256_set1_ps(m);
    __m256 vs = _mm256_setzero_ps();
    for (; t + 8 <= n; t += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), vm));
        _mm256_storeu_ps(s + t, e);
        vs = _mm256_add_ps(vs, e);
    }
    sum = hsum8(vs);
#endif
    for (; t < n; t++) { s[t] = expf(s[t] - m); sum += s[t]; }
    return 1.f / with_sink(sum, m, sink);
}

#endif
