/* The q6 record (GGUF Q6_K as stored; gemm_q6.c's header has the layout): its offsets and the
 * unpacking of one block of 32 inputs to 8 quads of values 0..63, shared by gemm_q6.c and the
 * widened path (gemm_quant_wide.c). */
#ifndef KVFLOW_Q6_H
#define KVFLOW_Q6_H
#include <stdint.h>

#define Q6_BLOCK 384   /* one block of 32 inputs' values */
#define Q6_SC 3072     /* the int8 sub-block scales' offset in a record, [16 sub-blocks][16] */
#define Q6_D 3328      /* the fp16 d's */
#define Q6_REC 3360    /* per 256 inputs */

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
/* the top 2 bits of quad s (0..3) of a top-bits vector, moved to bits 4..5 (16-bit shifts: what
 * crosses a byte is masked off) */
static inline __m512i q6_top2(__m512i h, int s) {
    const __m512i m = _mm512_set1_epi8(0x30);
    switch (s) {
    case 0: return _mm512_and_si512(_mm512_slli_epi16(h, 4), m);
    case 1: return _mm512_and_si512(_mm512_slli_epi16(h, 2), m);
    case 2: return _mm512_and_si512(h, m);
    default: return _mm512_and_si512(_mm512_srli_epi16(h, 2), m);
    }
}

/* (v & 0x0f) | t in one instruction */
static inline __m512i q6_low_or(__m512i v, __m512i t) {
    return _mm512_ternarylogic_epi32(v, _mm512_set1_epi8(0x0f), t, 0xEA);
}

/* block `blk` -> its 8 quads of 6-bit values (quads 0..3: the first sub-block of 16) */
static inline __attribute__((always_inline)) void q6_unpack512(const uint8_t *blk, __m512i q[8]) {
    const __m512i h0 = _mm512_loadu_si512(blk + 256), h1 = _mm512_loadu_si512(blk + 320);
    for (int j = 0; j < 4; j++) {
        const __m512i v = _mm512_loadu_si512(blk + 64 * j);
        q[j] = q6_low_or(v, q6_top2(h0, j));
        q[j + 4] = q6_low_or(_mm512_srli_epi16(v, 4), q6_top2(h1, j));
    }
}
#endif
#endif
