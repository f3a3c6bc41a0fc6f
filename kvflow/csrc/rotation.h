/* The fp8 KV cache's rotation (kvflow/attention/kv_layout.py, docs/kv_cache_quantization.md). Where
 * head_dim D is a power of two, an fp8 cache stores each token's key and value of a kv head as
 * e4m3 of H x / sqrt(D), H the D x D Sylvester-Hadamard matrix: the few large channels a head's
 * keys carry are spread over all D values, so e4m3's relative rounding error falls on many
 * small terms of a dot product instead of on its one or two largest. H / sqrt(D) is orthonormal
 * and symmetric, its own inverse: queries are rotated the same way (scores unchanged), and the
 * weighted sum of rotated values is rotated back.
 *
 * The transform is the fast Walsh-Hadamard one: butterflies (a, b) -> (a + b, a - b) of stride
 * 1, 2, 4, ... in that order, then the norm. The AVX-512 and AVX2 paths (chosen by the build's
 * flags, D a multiple of their lanes) run the same additions in the same order as the scalar
 * one and as kv_layout.hadamard_rotate, so every path gives the same bits. */
#ifndef KVFLOW_ROTATION_H
#define KVFLOW_ROTATION_H
#include <math.h>
#include <stdint.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

static inline int fp8_rotated(int64_t D) { return D >= 2 && (D & (D - 1)) == 0; }

/* 1 / sqrt(D) in fp32, as kv_layout.hadamard_norm */
static inline float hadamard_norm(int64_t D) { return 1.f / sqrtf((float)D); }

/* the butterflies of stride h .. D / 2 over x[0..D) */
static inline void hadamard_strides_from(float *x, int64_t D, int64_t h) {
    for (; h < D; h <<= 1)
        for (int64_t i = 0; i < D; i += 2 * h)
            for (int64_t j = i; j < i + h; j++) {
                const float a = x[j], b = x[j + h];
                x[j] = a + b;
                x[j + h] = a - b;
            }
}

#if defined(__AVX512F__)
/* one stage inside a register: lane i gets x_i + x_{i+h} where bit h of i is clear (y holds
 * each lane's partner), x_{i-h} - x_i where it is set */
static inline __m512 hadamard_stage16(__m512 x, __m512 y, __mmask16 high) {
    return _mm512_mask_sub_ps(_mm512_add_ps(x, y), high, y, x);
}

/* strides 1, 2, 4, 8 over 16 lanes */
static inline __m512 hadamard16(__m512 x) {
    x = hadamard_stage16(x, _mm512_permute_ps(x, 0xB1), 0xAAAA);
    x = hadamard_stage16(x, _mm512_permute_ps(x, 0x4E), 0xCCCC);
    x = hadamard_stage16(x, _mm512_shuffle_f32x4(x, x, 0xB1), 0xF0F0);
    return hadamard_stage16(x, _mm512_shuffle_f32x4(x, x, 0x4E), 0xFF00);
}
#define HADAMARD_LANES 16
#elif defined(__AVX2__)
static inline __m256 hadamard_stage8(__m256 x, __m256 y, const int high) {
    return _mm256_blend_ps(_mm256_add_ps(x, y), _mm256_sub_ps(y, x), high);
}

/* strides 1, 2, 4 over 8 lanes */
static inline __m256 hadamard8(__m256 x) {
    x = hadamard_stage8(x, _mm256_permute_ps(x, 0xB1), 0xAA);
    x = hadamard_stage8(x, _mm256_permute_ps(x, 0x4E), 0xCC);
    return hadamard_stage8(x, _mm256_permute2f128_ps(x, x, 0x01), 0xF0);
}
#define HADAMARD_LANES 8
#else
#define HADAMARD_LANES 0
#endif

/* x <- H x / sqrt(D), D a power of two: the strides inside a vector register by permutes, the
 * longer ones (whole registers against each other) as the scalar loop, which gcc vectorizes */
static inline void hadamard_rotate(float *x, int64_t D) {
    int64_t h = 1;
#if HADAMARD_LANES == 16
    if (D % 16 == 0) {
        for (int64_t i = 0; i < D; i += 16)
            _mm512_storeu_ps(x + i, hadamard16(_mm512_loadu_ps(x + i)));
        h = 16;
    }
#elif HADAMARD_LANES == 8
    if (D % 8 == 0) {
        for (int64_t i = 0; i < D; i += 8)
            _mm256_storeu_ps(x + i, hadamard8(_mm256_loadu_ps(x + i)));
        h = 8;
    }
#endif
    hadamard_strides_from(x, D, h);
    const float s = hadamard_norm(D);
    for (int64_t d = 0; d < D; d++) x[d] *= s;
}
#endif
