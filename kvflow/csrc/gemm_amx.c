/* out = x @ w.T (+ bias) on AMX's tiles, reading the same bf16 panels as gemm_bf16.c, so that
 * a model keeps one copy of its weights on CPUs with AMX: the panels' AVX512-BF16 kernel for
 * decode-sized batches, this one for longer ones (before, oneDNN's AMX GEMM read a second,
 * blocked copy of every weight).
 *
 * A panel [K/2][64][2] is already AMX's B layout: the tile of outputs 16j..16j+15 and k pairs
 * kp..kp+15 is 16 rows of 64 bytes, 256 bytes apart. Per panel and tile of 16 rows: tmm0 holds
 * 16 rows x 32 k of x, tmm1-2 take the panel's four B tiles in turn, tmm4-7 accumulate the
 * panel's 64 outputs in fp32; results round to bf16 once (+ bias first), as the panels' do.
 * With `silu_mul` (a [gate; up] panel: 32 gate then the same 32 up outputs) the panel leaves
 * as bf16(bf16(silu(gate)) * up) in columns 32p..32p+31. K must be a multiple of 32.
 *
 * x comes in AMX's A layout, [ceil(M/16)][K/32][16][32] (gemm.py packs it, the last tile of
 * rows zero-padded): each A tile is 1 KiB in one piece. Read in place, x's rows are K * 2 bytes
 * apart, which for K = 2048 puts all 16 rows of a tile in one L1 set: the tile came from L2 at
 * every k step. */
#define _GNU_SOURCE
#include <stdint.h>
#include <string.h>

#include "kernels.h"
#include "simd.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>

#define PANEL 64
#define TROWS 16

int gemm_amx_available(void) { return prefill_amx_available(); }

static void configure(void) {
    struct { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) { c.rows[t] = TROWS; c.colsb[t] = 64; }
    _tile_loadconfig(&c);
}

/* The panel's 64 outputs for one tile of 16 rows (a: its K/32 A tiles) into c [16][64] fp32 */
static inline void panel_rows16(const uint16_t *a, int64_t K, const uint16_t *panel, float *c) {
    _tile_zero(4); _tile_zero(5); _tile_zero(6); _tile_zero(7);
    for (int64_t k = 0; k < K; k += 32) {
        const uint16_t *b = panel + (k / 2) * (2 * PANEL);
        _tile_loadd(0, a + k * TROWS, 64);
        _tile_loadd(1, b, 4 * PANEL);
        _tile_dpbf16ps(4, 0, 1);
        _tile_loadd(2, b + 32, 4 * PANEL);
        _tile_dpbf16ps(5, 0, 2);
        _tile_loadd(1, b + 64, 4 * PANEL);
        _tile_dpbf16ps(6, 0, 1);
        _tile_loadd(2, b + 96, 4 * PANEL);
        _tile_dpbf16ps(7, 0, 2);
    }
    _tile_stored(4, c, 4 * PANEL);
    _tile_stored(5, c + 16, 4 * PANEL);
    _tile_stored(6, c + 32, 4 * PANEL);
    _tile_stored(7, c + 48, 4 * PANEL);
}

static void store_rows(const float *c, int rows, const uint16_t *bias, uint16_t *out,
                       int64_t out_stride, int64_t n_valid, int silu_mul) {
    for (int m = 0; m < rows; m++) {
        const float *cm = c + m * PANEL;
        uint16_t *om = out + m * out_stride;
        if (silu_mul) {
            for (int j = 0; j < 2; j++)
                _mm256_storeu_si256((__m256i *)(om + 16 * j),
                                    silu_mul16_bf16(round16_bf16(_mm512_loadu_ps(cm + 16 * j)),
                                                    round16_bf16(_mm512_loadu_ps(cm + 16 * j + 32))));
            continue;
        }
        for (int j = 0; j < 4; j++) {
            int64_t left = n_valid - 16 * j;
            if (left <= 0)
                break;
            __mmask16 mask = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
            __m512 v = _mm512_loadu_ps(cm + 16 * j);
            if (bias)
                v = _mm512_add_ps(v, widen16_bf16(_mm256_maskz_loadu_epi16(mask, bias + 16 * j)));
            _mm256_mask_storeu_epi16(om + 16 * j, mask, (__m256i)_mm512_cvtneps_pbh(v));
        }
    }
}

/* Panels [p_begin, p_end) of out[M, N] = x[M, K] @ w.T (+ bias), every row; gemm_bf16_panels'
 * words, x in the A layout above (x_stride unused). */
void gemm_amx_panels(const uint16_t *x, int64_t x_stride, int64_t M, int64_t K,
                     const uint16_t *packed, const uint16_t *bias, uint16_t *out,
                     int64_t out_stride, int64_t N, int64_t p_begin, int64_t p_end,
                     int64_t silu_mul)
{
    (void)x_stride;
    if (!prefill_amx_available() || K % 32 != 0)
        return; /* the caller checks gemm_amx_available() and K first */
    configure();
    float c[TROWS * PANEL] __attribute__((aligned(64)));
    int64_t panel_size = (K / 2) * 2 * PANEL;
    for (int64_t p = p_begin; p < p_end; p++) {
        const uint16_t *panel = packed + p * panel_size;
        int64_t n0 = p * PANEL, nv = N - n0 < PANEL ? N - n0 : PANEL;
        const uint16_t *b = bias ? bias + n0 : 0;
        uint16_t *o = out + (silu_mul ? n0 / 2 : n0);
        for (int64_t m0 = 0; m0 < M; m0 += TROWS) {
            int rows = M - m0 < TROWS ? (int)(M - m0) : TROWS;
            panel_rows16(x + m0 * K, K, panel, c);
            store_rows(c, rows, b, o + m0 * out_stride, out_stride, nv, (int)silu_mul);
        }
    }
    _tile_release();
}
#else
int gemm_amx_available(void) { return 0; }

void gemm_amx_panels(const uint16_t *x, int64_t x_stride, int64_t M, int64_t K,
                     const uint16_t *packed, const uint16_t *bias, uint16_t *out,
                     int64_t out_stride, int64_t N, int64_t p_begin, int64_t p_end,
                     int64_t silu_mul)
{
    (void)x; (void)x_stride; (void)M; (void)K; (void)packed; (void)bias; (void)out;
    (void)out_stride; (void)N; (void)p_begin; (void)p_end; (void)silu_mul;
}
#endif
