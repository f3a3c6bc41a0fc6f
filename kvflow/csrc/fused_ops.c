/* Fused fp32 elementwise steps of a Llama layer, one pass over memory each instead of the
 * 4-6 PyTorch ops (and allocations) that each would take. Row ranges [begin, end) let the
 * caller split the work between threads. Numerics follow Hugging Face's LlamaModel in fp32. */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include "simd.h"

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

/* k_cache[slots[t]] = k[t], v_cache[slots[t]] = v[t] for the rows of one step (each row is
 * `width` = kv_heads * head_dim floats; k/v rows `src_stride` apart, as views of qkv). */
void write_kv_f32(const float *k, const float *v, int64_t src_stride, const int64_t *slots,
                  float *k_cache, float *v_cache, int64_t begin, int64_t end, int64_t width) {
    for (int64_t t = begin; t < end; t++) {
        memcpy(k_cache + slots[t] * width, k + t * src_stride, sizeof(float) * (size_t)width);
        memcpy(v_cache + slots[t] * width, v + t * src_stride, sizeof(float) * (size_t)width);
    }
}

/* fp32 -> bf16, rounding to nearest even (as torch's .to(torch.bfloat16)); NaN stays NaN. */
static inline uint16_t float_to_bf16(float f) {
    union { float f; uint32_t u; } x = { f };
    if ((x.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x.u >> 16) | 0x40);
    return (uint16_t)((x.u + 0x7fffu + ((x.u >> 16) & 1u)) >> 16);
}

static void store_bf16_row(uint16_t *dst, const float *src, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] = float_to_bf16(src[i]);
}

/* The same for a bf16 cache (fp32 activations): each value rounded to nearest even. */
void write_kv_bf16(const float *k, const float *v, int64_t src_stride, const int64_t *slots,
                   uint16_t *k_cache, uint16_t *v_cache, int64_t begin, int64_t end, int64_t width) {
    for (int64_t t = begin; t < end; t++) {
        store_bf16_row(k_cache + slots[t] * width, k + t * src_stride, width);
        store_bf16_row(v_cache + slots[t] * width, v + t * src_stride, width);
    }
}
