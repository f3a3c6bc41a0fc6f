/* out = x @ w.T (+ bias) for GGUF Q4_K weights as the file stores them (4.5 bits a weight),
 * against activations quantized to int8 per block of 32 (gemm_quant.c's quantize_rows_q8).
 * Q4_K: per super-block of 256 inputs an fp16 d and dmin and 8 sub-blocks of 32, each with a
 * 6-bit scale sc and min mn (12 bytes for the 16 of them) and 4-bit values q:
 * w = d * sc * q - dmin * mn.
 *
 * Weight layout (kvflow/model/quant/packing.py, kind "q4k"): gemm_quant.c's panels of 16
 * outputs and its "quads", one 2304-byte record per super-block (144 B per output, the file's
 * own bytes): 8 blocks of 32 inputs, each a q4 record's 4 vectors of nibbles (vector j: quad
 * j in its low nibbles, quad j + 4 in its high ones; 256 B); the file's 12 scale bytes as
 * [12][16 outputs] (192 B); fp16 d[16] and dmin[16] (64 B). Each super-block's scales and
 * mins are unpacked once per panel into floats d * sc and -dmin * mn, then a block is q4's:
 *   sum_k w_k x_k = sum_blocks dx * (d sc) * sum(q q_x) + (-dmin mn) * dx * sum(q_x).
 *
 * Paths (chosen at load, passed as `isa`): 0 scalar (the tests' reference), 1 AVX2, 2 AVX-512
 * VNNI; one row (decode) streams the records with a prefetch ahead, more rows go in tiles that
 * unpack a block once for all their rows. The float sums are in the same order on every path
 * and tile size: a row's numbers do not depend on its batch. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "panel_store.h"
#include "simd.h"

#define QP 16
#define QB 32
#define Q4K_BLOCK 256  /* one block of 32 inputs' nibbles */
#define Q4K_SC 2048    /* the packed scales' offset in a record */
#define Q4K_D 2240     /* fp16 d[16], then dmin[16] */
#define Q4K_REC 2304   /* per 256 inputs */
#define Q4K_PREFETCH 8192
#define Q4K_TILE 8 /* rows, AVX-512 (AVX2: 4, its 16 registers) */
#define Q4K_PANEL_BLOCK (128 * 1024)

/* sub-block j's 6-bit scale and min from the 12 bytes s (ggml's get_scale_min_k4) */
static inline void scale_min(const uint8_t s[12], int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* one super-block's d * sc and -dmin * mn of the 16 outputs, [8 sub-blocks][16] each */
static inline void unpack_scales_scalar(const uint8_t *rec, float dsc[8][QP], float mmn[8][QP]) {
    for (int o = 0; o < QP; o++) {
        uint8_t s[12];
        for (int i = 0; i < 12; i++)
            s[i] = rec[Q4K_SC + QP * i + o];
        const float d = f16_to_float(((const uint16_t *)(rec + Q4K_D))[o]);
        const float dmin = f16_to_float(((const uint16_t *)(rec + Q4K_D))[QP + o]);
        for (int j = 0; j < 8; j++) {
            int sc, mn;
            scale_min(s, j, &sc, &mn);
            dsc[j][o] = d * (float)sc;
            mmn[j][o] = -(dmin * (float)mn);
        }
    }
}

/* ---- scalar reference ------------------------------------------------------------------ */
static void panel_scalar(const int8_t *qx, const float *dx, const float *dxs, int64_t Kb,
                         int64_t rows, const uint8_t *panel, float *res)
{
    for (int64_t r = 0; r < rows; r++) {
        float acc[QP] = {0}, dsc[8][QP], mmn[8][QP];
        for (int64_t b = 0; b < Kb; b++) {
            const uint8_t *rec = panel + (b / 8) * Q4K_REC, *blk = rec + (b % 8) * Q4K_BLOCK;
            if (b % 8 == 0)
                unpack_scales_scalar(rec, dsc, mmn);
            const int8_t *xq = qx + r * Kb * QB + b * QB;
            for (int o = 0; o < QP; o++) {
                int32_t dot = 0;
                for (int j = 0; j < 8; j++)
                    for (int t = 0; t < 4; t++) {
                        const int byte = blk[64 * (j & 3) + 4 * o + t];
                        dot += (j < 4 ? byte & 0x0f : byte >> 4) * xq[4 * j + t];
                    }
                acc[o] += (float)dot * (dsc[b % 8][o] * dx[r * Kb + b]);
                acc[o] += mmn[b % 8][o] * dxs[r * Kb + b];
            }
        }
        memcpy(res + r * QP, acc, sizeof acc);
    }
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define Q4K_AVX2 1

/* the 16 outputs' sc and mn of the 8 sub-blocks as bytes (16-bit shifts: what crosses a byte
 * is masked off), then d * sc and -dmin * mn as floats */
static inline void unpack_scales_vec(const uint8_t *rec, float dsc[8][QP], float mmn[8][QP]) {
    __m128i s[12], sc[8], mn[8];
    const __m128i m6 = _mm_set1_epi8(63), m4 = _mm_set1_epi8(0x0f), top = _mm_set1_epi8(0x30);
    for (int i = 0; i < 12; i++)
        s[i] = _mm_loadu_si128((const __m128i *)(rec + Q4K_SC + QP * i));
    for (int j = 0; j < 4; j++) {
        sc[j] = _mm_and_si128(s[j], m6);
        mn[j] = _mm_and_si128(s[j + 4], m6);
        sc[j + 4] = _mm_or_si128(_mm_and_si128(s[j + 8], m4), _mm_and_si128(_mm_srli_epi16(s[j], 2), top));
        mn[j + 4] = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(s[j + 8], 4), m4),
                                 _mm_and_si128(_mm_srli_epi16(s[j + 4], 2), top));
    }
#ifdef __AVX512F__
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rec + Q4K_D)));
    const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rec + Q4K_D + 32)));
    for (int j = 0; j < 8; j++) {
        _mm512_storeu_ps(dsc[j], _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(sc[j]))));
        _mm512_storeu_ps(mmn[j], _mm512_xor_ps(_mm512_mul_ps(dmin, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(mn[j]))),
                                               _mm512_set1_ps(-0.f)));
    }
    return;
#endif
    for (int h = 0; h < 2; h++) {
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + Q4K_D + 16 * h)));
        const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + Q4K_D + 32 + 16 * h)));
        const __m256 neg = _mm256_set1_ps(-0.f);
        for (int j = 0; j < 8; j++) {
            const __m256 fs = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sc[j], 8 * h)));
            const __m256 fm = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(mn[j], 8 * h)));
            _mm256_storeu_ps(dsc[j] + 8 * h, _mm256_mul_ps(d, fs));
            _mm256_storeu_ps(mmn[j] + 8 * h, _mm256_xor_ps(_mm256_mul_ps(dmin, fm), neg));
        }
    }
}

static inline __m256i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

static inline __attribute__((always_inline)) void
tile_avx2(const int8_t *qx, const float *dx, const float *dxs, int64_t Kb, int rows,
          const uint8_t *panel, float *res)
{
    const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(0x0f);
    __m256 acc[4][2];
    float dsc[8][QP], mmn[8][QP];
    for (int r = 0; r < rows; r++)
        acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < Kb; b++) {
        const uint8_t *rec = panel + (b / 8) * Q4K_REC, *blk = rec + (b % 8) * Q4K_BLOCK;
        if (b % 8 == 0)
            unpack_scales_vec(rec, dsc, mmn);
        if (rows == 1)
            for (int l = 0; l < Q4K_BLOCK; l += 64)
                _mm_prefetch((const char *)blk + Q4K_PREFETCH + l, _MM_HINT_T0);
        for (int h = 0; h < 2; h++) {
            __m256i w[8];
            for (int j = 0; j < 4; j++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 64 * j + 32 * h));
                w[j] = _mm256_and_si256(v, low);
                w[j + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            }
            const __m256 ds = _mm256_loadu_ps(dsc[b % 8] + 8 * h), mm = _mm256_loadu_ps(mmn[b % 8] + 8 * h);
#pragma GCC unroll 4
            for (int r = 0; r < rows; r++) {
                const int8_t *xq = qx + r * Kb * QB + b * QB;
                __m256i s16 = _mm256_maddubs_epi16(w[0], bcast4(xq)); /* 8 pairs of 15 * 127 fit int16 */
                for (int j = 1; j < 8; j++)
                    s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(w[j], bcast4(xq + 4 * j)));
                const __m256i dot = _mm256_madd_epi16(s16, ones);
                acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(ds, _mm256_set1_ps(dx[r * Kb + b])), acc[r][h]);
                acc[r][h] = _mm256_fmadd_ps(mm, _mm256_set1_ps(dxs[r * Kb + b]), acc[r][h]);
            }
        }
    }
    for (int r = 0; r < rows; r++) {
        _mm256_storeu_ps(res + r * QP, acc[r][0]);
        _mm256_storeu_ps(res + r * QP + 8, acc[r][1]);
    }
}
#endif

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define Q4K_VNNI 1

static inline __m512i dpbusd_bcast(__m512i acc, __m512i a, const int8_t *p) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(a), "m"(*(const int32_t *)p));
    return acc;
}

/* One row: the low nibbles (quads 0..3) and the high ones in place (v & 0xf0: 16x the value,
 * exact in int32, shifted down once), in two chains. More rows: the high nibbles shifted once
 * per block for all of them (the row loop's shift and add cost more than that). */
static inline __attribute__((always_inline)) void
tile_vnni(const int8_t *qx, const float *dx, const float *dxs, int64_t Kb, int rows,
          const uint8_t *panel, float *res)
{
    const __m512i low = _mm512_set1_epi8(0x0f), high = _mm512_set1_epi8((char)0xf0);
    __m512 acc[Q4K_TILE];
    float dsc[8][QP], mmn[8][QP];
    for (int r = 0; r < rows; r++)
        acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < Kb; b++) {
        const uint8_t *rec = panel + (b / 8) * Q4K_REC, *blk = rec + (b % 8) * Q4K_BLOCK;
        if (b % 8 == 0)
            unpack_scales_vec(rec, dsc, mmn);
        if (rows == 1)
            for (int l = 0; l < Q4K_BLOCK; l += 64)
                _mm_prefetch((const char *)blk + Q4K_PREFETCH + l, _MM_HINT_T0);
        __m512i wl[4], wh[4];
        for (int j = 0; j < 4; j++) {
            const __m512i v = _mm512_loadu_si512(blk + 64 * j);
            wl[j] = _mm512_and_si512(v, low);
            wh[j] = rows == 1 ? _mm512_and_si512(v, high) : _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        }
        const __m512 ds = _mm512_loadu_ps(dsc[b % 8]), mm = _mm512_loadu_ps(mmn[b % 8]);
#pragma GCC unroll 8
        for (int r = 0; r < rows; r++) {
            const int8_t *xq = qx + r * Kb * QB + b * QB;
            __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512();
            for (int j = 0; j < 4; j++) {
                lo = dpbusd_bcast(lo, wl[j], xq + 4 * j);
                hi = dpbusd_bcast(hi, wh[j], xq + 16 + 4 * j);
            }
            const __m512i dot = _mm512_add_epi32(lo, rows == 1 ? _mm512_srai_epi32(hi, 4) : hi);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(ds, _mm512_set1_ps(dx[r * Kb + b])), acc[r]);
            acc[r] = _mm512_fmadd_ps(mm, _mm512_set1_ps(dxs[r * Kb + b]), acc[r]);
        }
    }
    for (int r = 0; r < rows; r++)
        _mm512_storeu_ps(res + r * QP, acc[r]);
}
#endif

/* a tile of 1..Q4K_TILE rows against one panel, one function per path and row count (the
 * accumulators stay in registers) */
typedef void (*q4ktile_fn)(const int8_t *, const float *, const float *, int64_t, const uint8_t *,
                           float *);
#define Q4K_FN(P, R) static void P##_##R(const int8_t *qx, const float *dx, const float *dxs,    \
        int64_t Kb, const uint8_t *panel, float *res) { tile_##P(qx, dx, dxs, Kb, R, panel, res); }
#ifdef Q4K_AVX2
Q4K_FN(avx2, 1) Q4K_FN(avx2, 2) Q4K_FN(avx2, 3) Q4K_FN(avx2, 4)
static const q4ktile_fn AVX2_TILES[5] = {0, avx2_1, avx2_2, avx2_3, avx2_4};
#endif
#ifdef Q4K_VNNI
Q4K_FN(vnni, 1) Q4K_FN(vnni, 2) Q4K_FN(vnni, 3) Q4K_FN(vnni, 4)
Q4K_FN(vnni, 5) Q4K_FN(vnni, 6) Q4K_FN(vnni, 7) Q4K_FN(vnni, 8)
static const q4ktile_fn VNNI_TILES[Q4K_TILE + 1] = {0, vnni_1, vnni_2, vnni_3, vnni_4, vnni_5, vnni_6,
                                                     vnni_7, vnni_8};
#endif

/* Panels [p_begin, p_end) of out[M, N] (bf16 or fp32, row stride out_stride) for all M rows of
 * the quantized activations (Kb blocks of 32, a multiple of 8); `bias` fp32 [N] or NULL. */
void gemm_q4k_panels(const int8_t *qx, const float *dx, const float *dxs, int64_t Kb, int64_t M,
                     const uint8_t *packed, int64_t isa, const float *bias, void *out,
                     int64_t out_stride, int64_t N, int64_t out_bf16, int64_t p_begin,
                     int64_t p_end)
{
    const int64_t panel_bytes = (Kb / 8) * Q4K_REC;
    const q4ktile_fn *tiles = 0;
    int max_tile = 4;
    (void)isa;
#ifdef Q4K_AVX2
    if (isa == 1)
        tiles = AVX2_TILES;
#endif
#ifdef Q4K_VNNI
    if (isa == 2) {
        tiles = VNNI_TILES;
        max_tile = (out_stride * (out_bf16 ? 2 : 4)) % 4096 ? 8 : 4; /* gemm_quant.c: rows 4 KiB
                                                 apart share an L1 set, past 4 rows they thrash */
    }
#endif
    /* panels in blocks of about Q4K_PANEL_BLOCK bytes (kept in L2), each tile of rows over a
     * whole block before the next tile (gemm_quant.c's order for many rows) */
    const int64_t block = panel_bytes >= Q4K_PANEL_BLOCK ? 1 : Q4K_PANEL_BLOCK / panel_bytes;
    for (int64_t p0 = p_begin; p0 < p_end; p0 += block) {
        const int64_t p1 = p0 + block < p_end ? p0 + block : p_end;
        for (int64_t m0 = 0; m0 < M; m0 += max_tile) {
            const int rows = M - m0 < max_tile ? (int)(M - m0) : max_tile;
            for (int64_t p = p0; p < p1; p++) {
                const int64_t n0 = p * QP, nv = N - n0 < QP ? N - n0 : QP;
                const uint8_t *panel = packed + p * panel_bytes;
                float res[Q4K_TILE * QP];
                if (tiles)
                    tiles[rows](qx + m0 * Kb * QB, dx + m0 * Kb, dxs + m0 * Kb, Kb, panel, res);
                else
                    panel_scalar(qx + m0 * Kb * QB, dx + m0 * Kb, dxs + m0 * Kb, Kb, rows, panel, res);
                for (int r = 0; r < rows; r++)
                    store_row(res + r * QP, bias, n0, nv, out, (m0 + r) * out_stride + n0, (int)out_bf16);
            }
        }
    }
}

/* The paths this build has: bit 0 scalar, bit 1 AVX2, bit 2 AVX-512 VNNI. */
int64_t gemm_q4k_isas(void)
{
    int64_t isas = 1;
#ifdef Q4K_AVX2
    isas |= 2;
#endif
#ifdef Q4K_VNNI
    isas |= 4;
#endif
    return isas;
}
