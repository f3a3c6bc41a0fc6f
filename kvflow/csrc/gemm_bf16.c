/* out = x @ w.T (+ bias) for bf16 x and w, on CPUs with AVX512-BF16; built for the few rows
 * of a decode step, and level with oneDNN on prefills.
 *
 * Decode steps multiply a handful of rows by every weight of the model: the time is the
 * weight stream from memory, and oneDNN's small-row kernels read it at well under the
 * core's streaming rate. Here the weight is packed once into panels of 64 outputs, each
 * a contiguous run over K in pairs, [N/64][K/2][64][2], so a step reads one sequential
 * stream; each 64-byte load of weights feeds one `vdpbf16ps` per row (fp32 accumulators,
 * rows broadcast two bf16 at a time), and results round to bf16 once, as oneDNN's do.
 *
 * Rows go in tiles of at most 6 (6 x 4 accumulators stay in registers); a panel is
 * reread from L2 for each further tile. K must be even (the pack pads N to a multiple
 * of 64 with zero weights).
 *
 * With `silu_mul`, the weight is an MLP's gate and up projections packed so that panel p
 * holds gate outputs 32p..32p+31 then the same up outputs: the panel's results round to bf16
 * as above and leave as bf16(bf16(silu(gate)) * up) in output columns 32p..32p+31, so the
 * [M, 2I] gate/up activations are never written (the same numbers as silu_mul after). */
#include <stdint.h>
#include <string.h>

#include "kernels.h"
#include "simd.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>

#define PANEL 64          /* outputs per panel: four zmm of fp32 accumulators */
#define MAX_TILE 6        /* rows per tile */

static inline __attribute__((always_inline)) void
panel_tile(const uint16_t *x, int64_t x_stride, int rows, int64_t kpairs,
           const uint16_t *panel, const uint16_t *bias, uint16_t *out, int64_t out_stride,
           int64_t n_valid, const char *pf, int64_t pf_lines, int64_t pf_done, int silu_mul)
{
    __m512 acc[MAX_TILE][4];
    for (int m = 0; m < rows; m++)
        for (int j = 0; j < 4; j++)
            acc[m][j] = _mm512_setzero_ps();
    /* this tile's share of the next panel (pf_lines lines from line pf_done), spread evenly
     * over its K loop, so the memory stream keeps going while later tiles work from L2 */
    const char *pf_line = pf + 64 * pf_done;
    int64_t pf_credit = 0;
    for (int64_t kp = 0; kp < kpairs; kp++) {
        const uint16_t *w = panel + kp * (2 * PANEL);
        for (pf_credit += pf_lines; pf_credit >= kpairs; pf_credit -= kpairs, pf_line += 64)
            _mm_prefetch(pf_line, _MM_HINT_T1);
        __m512bh w0 = (__m512bh)_mm512_loadu_si512(w);
        __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + 32);
        __m512bh w2 = (__m512bh)_mm512_loadu_si512(w + 64);
        __m512bh w3 = (__m512bh)_mm512_loadu_si512(w + 96);
        for (int m = 0; m < rows; m++) {
            const __m512bh xb = bcast_pair_at(x + m * x_stride + 2 * kp);
            acc[m][0] = _mm512_dpbf16_ps(acc[m][0], w0, xb);
            acc[m][1] = _mm512_dpbf16_ps(acc[m][1], w1, xb);
            acc[m][2] = _mm512_dpbf16_ps(acc[m][2], w2, xb);
            acc[m][3] = _mm512_dpbf16_ps(acc[m][3], w3, xb);
        }
    }
    if (silu_mul) { /* accumulators 0, 1: gate; 2, 3: up (a whole panel: I % 32 == 0) */
        for (int j = 0; j < 2; j++)
            for (int m = 0; m < rows; m++)
                _mm256_storeu_si256((__m256i *)(out + m * out_stride + 16 * j),
                                    silu_mul16_bf16(round16_bf16(acc[m][j]), round16_bf16(acc[m][j + 2])));
        return;
    }
    /* lane l of accumulator j is output 16j + l of the panel */
    for (int j = 0; j < 4; j++) {
        int64_t left = n_valid - 16 * j;
        if (left <= 0)
            break;
        __mmask16 mask = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
        __m512 b = _mm512_setzero_ps();
        if (bias) {
            b = widen16_bf16(_mm256_maskz_loadu_epi16(mask, bias + 16 * j));
        }
        for (int m = 0; m < rows; m++) {
            __m256bh r = _mm512_cvtneps_pbh(_mm512_add_ps(acc[m][j], b));
            _mm256_mask_storeu_epi16(out + m * out_stride + 16 * j, mask, (__m256i)r);
        }
    }
}

/* Tiles of a fixed row count, so the compiler unrolls the row loop and keeps acc in zmm. */
#define TILE_FN(R) static void tile_##R(const uint16_t *x, int64_t xs, int64_t kp,             \
        const uint16_t *p, const uint16_t *b, uint16_t *o, int64_t os, int64_t nv,            \
        const char *pf, int64_t pl, int64_t pd, int sm) {                                     \
    panel_tile(x, xs, R, kp, p, b, o, os, nv, pf, pl, pd, sm); }
TILE_FN(1) TILE_FN(2) TILE_FN(3) TILE_FN(4) TILE_FN(5) TILE_FN(6)

typedef void (*tile_fn)(const uint16_t *, int64_t, int64_t, const uint16_t *, const uint16_t *,
                        uint16_t *, int64_t, int64_t, const char *, int64_t, int64_t, int);
static const tile_fn TILES[MAX_TILE + 1] = {0, tile_1, tile_2, tile_3, tile_4, tile_5, tile_6};

int gemm_bf16_available(void) { return 1; }

/* Panels [p_begin, p_end) of out[M, N] = x[M, K] @ w.T (+ bias); `packed` from the layout
 * above with K/2 pairs per panel row. Rows are split into near-equal tiles of <= 6. With
 * silu_mul (no bias), N is 2I and out [M, I] (see the top). */
void gemm_bf16_panels(const uint16_t *x, int64_t x_stride, int64_t M, int64_t K,
                     const uint16_t *packed, const uint16_t *bias, uint16_t *out,
                     int64_t out_stride, int64_t N, int64_t p_begin, int64_t p_end,
                     int64_t silu_mul)
{
    int64_t kpairs = K / 2;
    int64_t tiles = (M + MAX_TILE - 1) / MAX_TILE;
    int64_t panel_size = kpairs * 2 * PANEL, panel_lines = panel_size * 2 / 64;
    for (int64_t p = p_begin; p < p_end; p++) {
        const uint16_t *panel = packed + p * panel_size;
        const char *next = p + 1 < p_end ? (const char *)(panel + panel_size) : (const char *)panel;
        int64_t n0 = p * PANEL, nv = N - n0 < PANEL ? N - n0 : PANEL;
        const uint16_t *b = bias ? bias + n0 : 0;
        for (int64_t t = 0, m0 = 0; t < tiles; t++) {
            int64_t rows = (M - m0) / (tiles - t);
            int64_t pf_done = panel_lines * t / tiles, pf_lines = panel_lines * (t + 1) / tiles - pf_done;
            TILES[rows](x + m0 * x_stride, x_stride, kpairs, panel, b,
                        out + m0 * out_stride + (silu_mul ? n0 / 2 : n0), out_stride, nv, next,
                        pf_lines, pf_done, (int)silu_mul);
            m0 += rows;
        }
    }
}
#else
int gemm_bf16_available(void) { return 0; }

void gemm_bf16_panels(const uint16_t *x, int64_t x_stride, int64_t M, int64_t K,
                     const uint16_t *packed, const uint16_t *bias, uint16_t *out,
                     int64_t out_stride, int64_t N, int64_t p_begin, int64_t p_end,
                     int64_t silu_mul)
{
    (void)x; (void)x_stride; (void)M; (void)K; (void)packed; (void)bias; (void)out;
    (void)out_stride; (void)N; (void)p_begin; (void)p_end; (void)silu_mul;
}
#endif
