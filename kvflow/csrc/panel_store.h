/* Storing a panel's sums (16 outputs of one row, + bias) as fp32 or bf16: shared by the GEMMs
 * of the quantized kinds that keep each kind in its own file (gemm_q6.c, gemm_q4k.c,
 * gemm_mxfp4.c). bf16 rounds to nearest even, as float_to_bf16 (simd.h). */
#ifndef KVFLOW_PANEL_STORE_H
#define KVFLOW_PANEL_STORE_H

#include <stdint.h>

#include "simd.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#define PANEL_OUTPUTS 16

static inline void store_out(void *out, int64_t i, float v, int bf16) {
    if (bf16)
        ((uint16_t *)out)[i] = float_to_bf16(v);
    else
        ((float *)out)[i] = v;
}

/* one row's sums of a panel (+ bias) -> out: 16 at once where the build has AVX512-BF16 (the
 * rounding store_out's), else one by one */
static inline void store_row(const float *res, const float *bias, int64_t n0, int64_t nv, void *out,
                             int64_t at, int bf16)
{
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    if (nv == PANEL_OUTPUTS) {
        __m512 v = _mm512_loadu_ps(res);
        if (bias)
            v = _mm512_add_ps(v, _mm512_loadu_ps(bias + n0));
        if (bf16)
            _mm256_storeu_si256((__m256i *)((uint16_t *)out + at), (__m256i)_mm512_cvtneps_pbh(v));
        else
            _mm512_storeu_ps((float *)out + at, v);
        return;
    }
#endif
    for (int64_t o = 0; o < nv; o++)
        store_out(out, at + o, res[o] + (bias ? bias[n0 + o] : 0.f), bf16);
}

#endif
