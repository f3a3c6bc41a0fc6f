/* out = x @ w.T (+ bias) for GGUF Q6_K weights as the file stores them (6.5625 bits a weight),
 * against activations quantized to int8 per block of 32 (gemm_quant.c's quantize_rows_q8).
 * Q6_K: per super-block of 256 inputs an fp16 d, per sub-block of 16 an int8 scale sc and
 * 6-bit values q: w = d * sc * (q - 32).
 *
 * Weight layout (kvflow/model/quant/packing.py, kind "q6"): gemm_quant.c's panels of 16
 * outputs and its "quads" (inputs k..k+3 of the 16 outputs in a 64-byte vector), one
 * 3360-byte record per super-block (210 B per output, the file's own bytes):
 *   8 blocks of 32 inputs, 384 B each: 4 vectors of the values' low 4 bits (vector j: quad j
 *       in its low nibbles, quad j + 4 in its high ones, as a q4 record), then 2 vectors of
 *       their top 2 bits (vector h: quad 4h + s at bits 2s, 2s + 1);
 *   int8 sc[16 sub-blocks][16 outputs] (256 B); fp16 d[16 outputs] (32 B).
 * A block of 32 inputs is two sub-blocks (quads 0..3 and 4..7). q is unsigned (0..63), so it
 * is the unsigned operand of `vpdpbusd` / `vpmaddubsw` against the signed activations; the 32
 * comes off each sub-block's integer sum as 32 * (the activations' sum over those 16), and
 * the sub-block scales multiply the exact int32 sums:
 *   sum_k w_k x_k = sum_blocks d * dx * (sc0 * (q.x - 32 s0) + sc1 * (q.x - 32 s1)).
 *
 * Paths (chosen at load, passed as `isa`): 0 scalar (the tests' reference), 1 AVX2, 2 AVX-512
 * VNNI; one row (decode) streams the records with a prefetch ahead, more rows go in tiles
 * that unpack a block once for all their rows. The float sums are in the same order on every
 * path and tile size: a row's numbers do not depend on its batch. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "q6.h"
#include "panel_store.h"
#include "simd.h"

#define QP 16
#define QB 32
#define Q6_PREFETCH 8192
#define Q6_TILE 8 /* rows, AVX-512 (AVX2: 4, its 16 registers) */
#define Q6_PANEL_BLOCK (128 * 1024)

/* the 6-bit value of output o, input 4j + t of block `blk` (j: quad 0..7) */
static inline int q6_value(const uint8_t *blk, int o, int j, int t) {
    const int i = 4 * o + t;
    const int lo = j < 4 ? blk[64 * (j & 3) + i] & 0x0f : blk[64 * (j & 3) + i] >> 4;
    const int hi = (blk[256 + 64 * (j >> 2) + i] >> (2 * (j & 3))) & 3;
    return lo | hi << 4;
}

/* ---- scalar reference ------------------------------------------------------------------ */
static void panel_scalar(const int8_t *qx, const float *dx, int64_t Kb, int64_t rows,
                         const uint8_t *panel, float *res)
{
    for (int64_t r = 0; r < rows; r++) {
        float acc[QP] = {0};
        for (int64_t b = 0; b < Kb; b++) {
            const uint8_t *rec = panel + (b / 8) * Q6_REC, *blk = rec + (b % 8) * Q6_BLOCK;
            const int8_t *sc = (const int8_t *)(rec + Q6_SC) + (b % 8) * 2 * QP;
            const int8_t *xq = qx + r * Kb * QB + b * QB;
            for (int o = 0; o < QP; o++) {
                int32_t isum = 0;
                for (int s = 0; s < 2; s++) {
                    int32_t dot = 0;
                    for (int j = 4 * s; j < 4 * s + 4; j++)
                        for (int t = 0; t < 4; t++)
                            dot += (q6_value(blk, o, j, t) - 32) * xq[4 * j + t];
                    isum += sc[s * QP + o] * dot;
                }
                const float d = f16_to_float(((const uint16_t *)(rec + Q6_D))[o]);
                acc[o] += (float)isum * (d * dx[r * Kb + b]);
            }
        }
        memcpy(res + r * QP, acc, sizeof acc);
    }
}

/* The activations' sums per 16 (the sub-blocks), 2 per block, into this thread's scratch */
static __thread struct { int32_t *buf; size_t cap; } s16_scratch;

static const int32_t *sums16(const int8_t *qx, size_t n16) {
    if (n16 > s16_scratch.cap) {
        free(s16_scratch.buf);
        s16_scratch.buf = malloc(n16 * sizeof(int32_t));
        s16_scratch.cap = s16_scratch.buf ? n16 : 0;
    }
    if (s16_scratch.buf)
        for (size_t i = 0; i < n16; i++) {
            int32_t s = 0;
            for (int j = 0; j < 16; j++)
                s += qx[16 * i + j];
            s16_scratch.buf[i] = s;
        }
    return s16_scratch.buf;
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define Q6_AVX2 1

/* the top 2 bits of quad s (0..3) of vector h, moved to bits 4..5 (16-bit shifts: what crosses
 * a byte is masked off) */
static inline __m256i top2_256(__m256i h, int s) {
    const __m256i m = _mm256_set1_epi8(0x30);
    switch (s) {
    case 0: return _mm256_and_si256(_mm256_slli_epi16(h, 4), m);
    case 1: return _mm256_and_si256(_mm256_slli_epi16(h, 2), m);
    case 2: return _mm256_and_si256(h, m);
    default: return _mm256_and_si256(_mm256_srli_epi16(h, 2), m);
    }
}

/* half h (8 outputs) of block `blk`: its 8 quads of values 0..63 */
static inline __attribute__((always_inline)) void unpack_avx2(const uint8_t *blk, int h, __m256i q[8]) {
    const __m256i low = _mm256_set1_epi8(0x0f);
    const __m256i h0 = _mm256_loadu_si256((const __m256i *)(blk + 256 + 32 * h));
    const __m256i h1 = _mm256_loadu_si256((const __m256i *)(blk + 320 + 32 * h));
    for (int j = 0; j < 4; j++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 64 * j + 32 * h));
        q[j] = _mm256_or_si256(_mm256_and_si256(v, low), top2_256(h0, j));
        q[j + 4] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low), top2_256(h1, j));
    }
}

static inline __m256i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* one row's block against half h: d * dx * (sc0 * dot0 + sc1 * dot1) added to acc. Two quads'
 * `vpmaddubsw` pairs (63 * 127 * 2 each) still fit int16 when added. */
static inline __attribute__((always_inline)) __m256
block_avx2(const __m256i q[8], const int8_t *xq, const int32_t *s16, const int8_t *sc, int h,
           __m256 ddx, __m256 acc)
{
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i isum = _mm256_setzero_si256();
    for (int s = 0; s < 2; s++) {
        const __m256i p01 = _mm256_add_epi16(_mm256_maddubs_epi16(q[4 * s], bcast4(xq + 16 * s)),
                                             _mm256_maddubs_epi16(q[4 * s + 1], bcast4(xq + 16 * s + 4)));
        const __m256i p23 = _mm256_add_epi16(_mm256_maddubs_epi16(q[4 * s + 2], bcast4(xq + 16 * s + 8)),
                                             _mm256_maddubs_epi16(q[4 * s + 3], bcast4(xq + 16 * s + 12)));
        __m256i dot = _mm256_add_epi32(_mm256_madd_epi16(p01, ones), _mm256_madd_epi16(p23, ones));
        dot = _mm256_add_epi32(dot, _mm256_set1_epi32(-32 * s16[s]));
        const __m256i scv = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(sc + s * QP + 8 * h)));
        isum = _mm256_add_epi32(isum, _mm256_mullo_epi32(dot, scv));
    }
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), ddx, acc);
}

static inline __attribute__((always_inline)) void
tile_avx2(const int8_t *qx, const float *dx, const int32_t *s16, int64_t Kb, int rows,
          const uint8_t *panel, float *res)
{
    __m256 acc[4][2];
    for (int r = 0; r < rows; r++)
        acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < Kb; b++) {
        const uint8_t *rec = panel + (b / 8) * Q6_REC, *blk = rec + (b % 8) * Q6_BLOCK;
        const int8_t *sc = (const int8_t *)(rec + Q6_SC) + (b % 8) * 2 * QP;
        if (rows == 1)
            _mm_prefetch((const char *)blk + Q6_PREFETCH, _MM_HINT_T0);
        for (int h = 0; h < 2; h++) {
            __m256i q[8];
            unpack_avx2(blk, h, q);
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + Q6_D + 16 * h)));
#pragma GCC unroll 4
            for (int r = 0; r < rows; r++)
                acc[r][h] = block_avx2(q, qx + r * Kb * QB + b * QB, s16 + (r * Kb + b) * 2, sc, h,
                                       _mm256_mul_ps(d, _mm256_set1_ps(dx[r * Kb + b])), acc[r][h]);
        }
    }
    for (int r = 0; r < rows; r++) {
        _mm256_storeu_ps(res + r * QP, acc[r][0]);
        _mm256_storeu_ps(res + r * QP + 8, acc[r][1]);
    }
}
#endif

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define Q6_VNNI 1

static inline __m512i dpbusd_bcast(__m512i acc, __m512i a, const int8_t *p) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(a), "m"(*(const int32_t *)p));
    return acc;
}

/* one row's block: two sub-blocks in two chains, each from -32 * its activations' sum */
static inline __attribute__((always_inline)) __m512
block_vnni(const __m512i q[8], const int8_t *xq, const int32_t *s16, const int8_t *sc, __m512 ddx,
           __m512 acc)
{
    __m512i a = _mm512_set1_epi32(-32 * s16[0]), b = _mm512_set1_epi32(-32 * s16[1]);
    for (int j = 0; j < 4; j++) {
        a = dpbusd_bcast(a, q[j], xq + 4 * j);
        b = dpbusd_bcast(b, q[j + 4], xq + 16 + 4 * j);
    }
    const __m512i sc0 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)sc));
    const __m512i sc1 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(sc + QP)));
    const __m512i isum = _mm512_add_epi32(_mm512_mullo_epi32(a, sc0), _mm512_mullo_epi32(b, sc1));
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), ddx, acc);
}

static inline __attribute__((always_inline)) void
tile_vnni(const int8_t *qx, const float *dx, const int32_t *s16, int64_t Kb, int rows,
          const uint8_t *panel, float *res)
{
    __m512 acc[Q6_TILE];
    for (int r = 0; r < rows; r++)
        acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < Kb; b++) {
        const uint8_t *rec = panel + (b / 8) * Q6_REC, *blk = rec + (b % 8) * Q6_BLOCK;
        const int8_t *sc = (const int8_t *)(rec + Q6_SC) + (b % 8) * 2 * QP;
        if (rows == 1)
            for (int l = 0; l < Q6_BLOCK; l += 64)
                _mm_prefetch((const char *)blk + Q6_PREFETCH + l, _MM_HINT_T0);
        __m512i q[8];
        q6_unpack512(blk, q);
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rec + Q6_D)));
#pragma GCC unroll 8
        for (int r = 0; r < rows; r++)
            acc[r] = block_vnni(q, qx + r * Kb * QB + b * QB, s16 + (r * Kb + b) * 2, sc,
                                _mm512_mul_ps(d, _mm512_set1_ps(dx[r * Kb + b])), acc[r]);
    }
    for (int r = 0; r < rows; r++)
        _mm512_storeu_ps(res + r * QP, acc[r]);
}
#endif

/* a tile of 1..Q6_TILE rows against one panel, one function per path and row count (the
 * accumulators stay in registers) */
typedef void (*q6tile_fn)(const int8_t *, const float *, const int32_t *, int64_t, const uint8_t *,
                          float *);
#define Q6_FN(P, R) static void P##_##R(const int8_t *qx, const float *dx, const int32_t *s16,   \
        int64_t Kb, const uint8_t *panel, float *res) { tile_##P(qx, dx, s16, Kb, R, panel, res); }
#ifdef Q6_AVX2
Q6_FN(avx2, 1) Q6_FN(avx2, 2) Q6_FN(avx2, 3) Q6_FN(avx2, 4)
static const q6tile_fn AVX2_TILES[5] = {0, avx2_1, avx2_2, avx2_3, avx2_4};
#endif
#ifdef Q6_VNNI
Q6_FN(vnni, 1) Q6_FN(vnni, 2) Q6_FN(vnni, 3) Q6_FN(vnni, 4)
Q6_FN(vnni, 5) Q6_FN(vnni, 6) Q6_FN(vnni, 7) Q6_FN(vnni, 8)
static const q6tile_fn VNNI_TILES[Q6_TILE + 1] = {0, vnni_1, vnni_2, vnni_3, vnni_4, vnni_5, vnni_6,
                                                     vnni_7, vnni_8};
#endif

/* Panels [p_begin, p_end) of out[M, N] (bf16 or fp32, row stride out_stride) for all M rows of
 * the quantized activations (Kb blocks of 32, a multiple of 8); `bias` fp32 [N] or NULL. */
void gemm_q6_panels(const int8_t *qx, const float *dx, int64_t Kb, int64_t M,
                    const uint8_t *packed, int64_t isa, const float *bias, void *out,
                    int64_t out_stride, int64_t N, int64_t out_bf16, int64_t p_begin,
                    int64_t p_end)
{
    const int64_t panel_bytes = (Kb / 8) * Q6_REC;
    const q6tile_fn *tiles = 0;
    int max_tile = 4;
    (void)isa;
#ifdef Q6_AVX2
    if (isa == 1)
        tiles = AVX2_TILES;
#endif
#ifdef Q6_VNNI
    if (isa == 2) {
        tiles = VNNI_TILES;
        max_tile = (out_stride * (out_bf16 ? 2 : 4)) % 4096 ? 8 : 4; /* gemm_quant.c: rows 4 KiB
                                                 apart share an L1 set, past 4 rows they thrash */
    }
#endif
    const int32_t *s16 = tiles ? sums16(qx, (size_t)(M * Kb * 2)) : 0;
    if (!s16)
        tiles = 0; /* no memory for the sums: the scalar reference */
    /* panels in blocks of about Q6_PANEL_BLOCK bytes (kept in L2), each tile of rows over a
     * whole block before the next tile (gemm_quant.c's order for many rows) */
    const int64_t block = panel_bytes >= Q6_PANEL_BLOCK ? 1 : Q6_PANEL_BLOCK / panel_bytes;
    for (int64_t p0 = p_begin; p0 < p_end; p0 += block) {
        const int64_t p1 = p0 + block < p_end ? p0 + block : p_end;
        for (int64_t m0 = 0; m0 < M; m0 += max_tile) {
            const int rows = M - m0 < max_tile ? (int)(M - m0) : max_tile;
            for (int64_t p = p0; p < p1; p++) {
                const int64_t n0 = p * QP, nv = N - n0 < QP ? N - n0 : QP;
                const uint8_t *panel = packed + p * panel_bytes;
                float res[Q6_TILE * QP];
                if (tiles)
                    tiles[rows](qx + m0 * Kb * QB, dx + m0 * Kb, s16 + m0 * Kb * 2, Kb, panel, res);
                else
                    panel_scalar(qx + m0 * Kb * QB, dx + m0 * Kb, Kb, rows, panel, res);
                for (int r = 0; r < rows; r++)
                    store_row(res + r * QP, bias, n0, nv, out, (m0 + r) * out_stride + n0, (int)out_bf16);
            }
        }
    }
}

/* The paths this build has: bit 0 scalar, bit 1 AVX2, bit 2 AVX-512 VNNI. */
int64_t gemm_q6_isas(void)
{
    int64_t isas = 1;
#ifdef Q6_AVX2
    isas |= 2;
#endif
#ifdef Q6_VNNI
    isas |= 4;
#endif
    return isas;
}
