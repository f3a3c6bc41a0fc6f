/* Fused elementwise steps of a Llama layer, one pass over memory each instead of the 4-6
 * PyTorch ops (and allocations) that each would take. Row ranges [begin, end) let the caller
 * split the work between threads. Numerics follow Hugging Face's LlamaModel: in fp32, and in
 * bf16 with a bf16 rounding wherever PyTorch's bf16 ops round (each op's result). */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include "kernels.h"
#include "simd.h"
#include "tiles.h"

/* one bf16 rounding of an fp32 value, kept as fp32 */
static inline float round_bf16(float f) { return bf16_to_float(float_to_bf16(f)); }

/* residual[t] += delta[t] (when delta is given), then
 * out[t] = weight * residual[t] * rsqrt(mean(residual[t]^2) + eps) */
void add_rms_norm_f32(float *residual, const float *delta, const float *weight, float *out,
                      int64_t begin, int64_t end, int64_t n, float eps) {
    for (int64_t t = begin; t < end; t++) {
        float *x = residual + t * n;
        float *o = out + t * n;
        float ss = 0.f;
        if (delta) {
            const float *d = delta + t * n;
            for (int64_t i = 0; i < n; i++) x[i] += d[i];
        }
#pragma omp simd reduction(+:ss)
        for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
        const float r = 1.f / sqrtf(ss / (float)n + eps);
        for (int64_t i = 0; i < n; i++) o[i] = weight[i] * (x[i] * r);
    }
}

/* In place on the q and k heads of each row of qkv (row stride `stride`): HF's rotate_half
 * RoPE, x * cos + rotate_half(x) * sin, with cos/sin rows of the table [max_pos, dim]. */
void rope_f32(float *qkv, int64_t stride, const int64_t *positions, const float *cos_table,
              const float *sin_table, int64_t begin, int64_t end, int64_t n_heads, int64_t dim) {
    const int64_t half = dim / 2;
    for (int64_t t = begin; t < end; t++) {
        const float *c = cos_table + positions[t] * dim, *s = sin_table + positions[t] * dim;
        for (int64_t h = 0; h < n_heads; h++) {
            float *x = qkv + t * stride + h * dim;
            for (int64_t i = 0; i < half; i++) {
                const float x1 = x[i], x2 = x[i + half];
                x[i] = x1 * c[i] - x2 * s[i];
                x[i + half] = x2 * c[i + half] + x1 * s[i + half];
            }
        }
    }
}

/* out[t] = silu(gate_up[t, :n]) * gate_up[t, n:2n] */
void silu_mul_f32(const float *gate_up, float *out, int64_t begin, int64_t end, int64_t n) {
    for (int64_t t = begin; t < end; t++) {
        const float *g = gate_up + t * 2 * n, *u = g + n;
        float *o = out + t * n;
        int64_t i = 0;
#ifdef KVFLOW_AVX2
        const __m256 one = _mm256_set1_ps(1.f);
        for (; i + 8 <= n; i += 8) {
            const __m256 gv = _mm256_loadu_ps(g + i);
            const __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv))));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(gv, sig), _mm256_loadu_ps(u + i)));
        }
#endif
        for (; i < n; i++) o[i] = g[i] / (1.f + expf(-g[i])) * u[i];
    }
}

/* bf16 activations. residual[t] += delta[t] (rounded), then
 * out[t] = bf16(weight * bf16(residual[t] * rsqrt(mean(residual[t]^2) + eps))) */
void add_rms_norm_bf16(uint16_t *residual, const uint16_t *delta, const uint16_t *weight,
                       uint16_t *out, int64_t begin, int64_t end, int64_t n, float eps) {
    for (int64_t t = begin; t < end; t++) {
        uint16_t *x = residual + t * n;
        uint16_t *o = out + t * n;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
        if (n % 16 == 0) { /* the add and the sum of squares in one pass, 16 at a time */
            __m512 acc = _mm512_setzero_ps();
            for (int64_t i = 0; i < n; i += 16) {
                __m512 xv = load16_bf16(x + i);
                if (delta) {
                    const __m256i sum = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(xv, load16_bf16(delta + t * n + i)));
                    _mm256_storeu_si256((__m256i *)(x + i), sum);
                    xv = widen16_bf16(sum);
                }
                acc = _mm512_fmadd_ps(xv, xv, acc);
            }
            const __m512 r = _mm512_set1_ps(1.f / sqrtf(_mm512_reduce_add_ps(acc) / (float)n + eps));
            for (int64_t i = 0; i < n; i += 16) {
                const __m512 y = round16_bf16(_mm512_mul_ps(load16_bf16(x + i), r));
                _mm256_storeu_si256((__m256i *)(o + i),
                                    (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(load16_bf16(weight + i), y)));
            }
            continue;
        }
#endif
        float ss = 0.f;
        if (delta) {
            const uint16_t *d = delta + t * n;
#pragma omp simd
            for (int64_t i = 0; i < n; i++) x[i] = float_to_bf16(bf16_to_float(x[i]) + bf16_to_float(d[i]));
        }
#pragma omp simd reduction(+:ss)
        for (int64_t i = 0; i < n; i++) ss += bf16_to_float(x[i]) * bf16_to_float(x[i]);
        const float r = 1.f / sqrtf(ss / (float)n + eps);
#pragma omp simd
        for (int64_t i = 0; i < n; i++)
            o[i] = float_to_bf16(bf16_to_float(weight[i]) * round_bf16(bf16_to_float(x[i]) * r));
    }
}

/* bf16 qkv, fp32 cos/sin tables (rounded to bf16 as `.to(bf16)` does): each product and the
 * sum rounded, as x * cos + rotate_half(x) * sin runs in bf16. */
void rope_bf16(uint16_t *qkv, int64_t stride, const int64_t *positions, const float *cos_table,
               const float *sin_table, int64_t begin, int64_t end, int64_t n_heads, int64_t dim) {
    const int64_t half = dim / 2;
    float c[dim], s[dim];
    for (int64_t t = begin; t < end; t++) {
        const float *ct = cos_table + positions[t] * dim, *st = sin_table + positions[t] * dim;
        for (int64_t i = 0; i < dim; i++) { c[i] = round_bf16(ct[i]); s[i] = round_bf16(st[i]); }
        for (int64_t h = 0; h < n_heads; h++) {
            uint16_t *x = qkv + t * stride + h * dim;
            int64_t i0 = 0;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
            for (; i0 + 16 <= half; i0 += 16) { /* 16 pairs at a time, the same roundings */
                const __m512 x1 = load16_bf16(x + i0), x2 = load16_bf16(x + i0 + half);
                const __m512 a = _mm512_add_ps(round16_bf16(_mm512_mul_ps(x1, _mm512_loadu_ps(c + i0))),
                                               round16_bf16(_mm512_mul_ps(x2, _mm512_sub_ps(_mm512_setzero_ps(), _mm512_loadu_ps(s + i0)))));
                const __m512 b = _mm512_add_ps(round16_bf16(_mm512_mul_ps(x2, _mm512_loadu_ps(c + i0 + half))),
                                               round16_bf16(_mm512_mul_ps(x1, _mm512_loadu_ps(s + i0 + half))));
                _mm256_storeu_si256((__m256i *)(x + i0), (__m256i)_mm512_cvtneps_pbh(a));
                _mm256_storeu_si256((__m256i *)(x + i0 + half), (__m256i)_mm512_cvtneps_pbh(b));
            }
#endif
#pragma omp simd
            for (int64_t i = i0; i < half; i++) {
                const float x1 = bf16_to_float(x[i]), x2 = bf16_to_float(x[i + half]);
                x[i] = float_to_bf16(round_bf16(x1 * c[i]) + round_bf16(-x2 * s[i]));
                x[i + half] = float_to_bf16(round_bf16(x2 * c[i + half]) + round_bf16(x1 * s[i + half]));
            }
        }
    }
}

#ifdef KVFLOW_AVX2
/* float_to_bf16 for 8 values, still in the upper halves of 32-bit lanes */
static inline __m256i round8_bf16_bits(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb));
    const __m256i quiet = _mm256_or_si256(u, _mm256_set1_epi32(0x400000));
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    return _mm256_and_si256(_mm256_blendv_epi8(r, quiet, nan), _mm256_set1_epi32((int)0xffff0000u));
}
static inline __m256 round8_bf16(__m256 v) { return _mm256_castsi256_ps(round8_bf16_bits(v)); }
static inline void store8_bf16(uint16_t *p, __m256 v) {
    const __m256i h = _mm256_srli_epi32(round8_bf16_bits(v), 16);
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(h, h), 0x08);
    _mm_storeu_si128((__m128i *)p, _mm256_castsi256_si128(packed));
}
#endif

/* out[t] = bf16(bf16(silu(gate)) * up) for bf16 gate_up = [gate | up] */
void silu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t begin, int64_t end, int64_t n) {
    for (int64_t t = begin; t < end; t++) {
        const uint16_t *g = gate_up + t * 2 * n, *u = g + n;
        uint16_t *o = out + t * n;
        int64_t i = 0;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
        /* 16 at a time: 2.2x the AVX2 loop's rate on Zen 4 (0.6 against 1.3 ns a value) */
        for (; i + 16 <= n; i += 16)
            _mm256_storeu_si256((__m256i *)(o + i), silu_mul16_bf16(load16_bf16(g + i), load16_bf16(u + i)));
#endif
#ifdef KVFLOW_AVX2
        const __m256 one = _mm256_set1_ps(1.f);
        for (; i + 8 <= n; i += 8) {
            const __m256 gv = load8_bf16(g + i);
            const __m256 sg = _mm256_div_ps(gv, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv))));
            store8_bf16(o + i, _mm256_mul_ps(round8_bf16(sg), load8_bf16(u + i)));
        }
#endif
        for (; i < n; i++) {
            const float gf = bf16_to_float(g[i]);
            o[i] = float_to_bf16(round_bf16(gf / (1.f + expf(-gf))) * bf16_to_float(u[i]));
        }
    }
}

/* K/V rows of tokens begin..end-1 of one step (KVH x D each; k/v rows src_stride apart, as
 * views of qkv) into their slots' places in the cache tiles (tiles.h); CONVERT rounds fp32
 * into a bf16 cache. */
#define DEFINE_WRITE_KV(NAME, SRC_T, DST_T, CONVERT)                                           \
void NAME(const SRC_T *k, const SRC_T *v, int64_t src_stride, const int64_t *slots,            \
          DST_T *k_cache, DST_T *v_cache, int64_t begin, int64_t end, int64_t KVH, int64_t D,  \
          int64_t bs) {                                                                        \
    for (int64_t t = begin; t < end; t++) {                                                    \
        const int64_t blk = slots[t] / bs, j = slots[t] % bs;                                  \
        for (int64_t kh = 0; kh < KVH; kh++) {                                                 \
            DST_T *kt = k_cache + (blk * KVH + kh) * bs * D, *vt = v_cache + (blk * KVH + kh) * bs * D; \
            const SRC_T *kr = k + t * src_stride + kh * D, *vr = v + t * src_stride + kh * D;  \
            for (int64_t d = 0; d < D; d++) {                                                  \
                kt[k_tile_at(j, d, bs)] = CONVERT(kr[d]);                                      \
                vt[v_tile_at(j, d, D)] = CONVERT(vr[d]);                                       \
            }                                                                                  \
        }                                                                                      \
    }                                                                                          \
}
#define SAME(x) (x)
DEFINE_WRITE_KV(write_kv_f32, float, float, SAME)
/* into a bf16 cache from fp32 activations: each value rounded to nearest even */
DEFINE_WRITE_KV(write_kv_bf16, float, uint16_t, float_to_bf16)
/* bf16 activations into a bf16 cache: copies (index_copy_ took ~13 ms of a 2,048-token bf16
 * prefill step) */
DEFINE_WRITE_KV(copy_kv_bf16, uint16_t, uint16_t, SAME)

/* out[t] = index of the largest of the n values of row t (rows `stride` apart), the first one
 * on ties, and the first NaN if the row has one: torch.argmax's answer, read from the bf16
 * logits in place (the fp32 copy plus argmax took ~10 ms for 128 x 49,152 logits). */
void argmax_rows_bf16(const uint16_t *x, int64_t stride, int64_t *out, int64_t begin, int64_t end,
                      int64_t n) {
    for (int64_t t = begin; t < end; t++) {
        const uint16_t *r = x + t * stride;
        float m = -INFINITY;
        int nan = 0;
#pragma omp simd reduction(max:m) reduction(|:nan)
        for (int64_t i = 0; i < n; i++) {
            const float v = bf16_to_float(r[i]);
            m = v > m ? v : m;
            nan |= v != v;
        }
        int64_t best = 0;
        for (int64_t i = 0; i < n; i++) {
            const float v = bf16_to_float(r[i]);
            if (nan ? v != v : v == m) { best = i; break; }
        }
        out[t] = best;
    }
}
