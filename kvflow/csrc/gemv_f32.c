/* out = x @ w.T (+ bias) in fp32 for the few rows of a decode step (M up to ~8).
 *
 * At one row a decode step is the weight stream: every weight is read once and used once per
 * row, so the time is bytes over the rate one core streams them from memory. oneDNN's fp32
 * kernels reach well under that rate at M = 1 (benchmarks/gemv_f32.py). Here the weight is
 * packed once at load into panels of 16 outputs, [ceil(N/16)][K][16]: input k of a panel's
 * 16 outputs is one 64-byte line, and a panel is one sequential stream. Each line is loaded
 * once and multiplied by a broadcast of x[r][k] for every row r of the tile (fp32 FMAs into
 * per-row accumulators; no horizontal sums), so an activation load serves 16 outputs and a
 * weight load serves all the tile's rows.
 *
 * Paths (chosen at load, passed as `isa`): 0 scalar (the tests' reference), 1 AVX2 + FMA
 * (a line is two ymm), 2 AVX-512 (one zmm). Rows go in tiles (AVX2 up to 4, AVX-512 up to 8)
 * with two or more independent accumulators per output so the FMA latency stays hidden at
 * one row; a panel (36-96 KiB at this model's K) is reread from L2 for further tiles.
 * Threads split panels (kvflow/csrc/gemv.py: gemv_f32), each streaming its own share.
 *
 * Software prefetch: a line GEMV_PF lines ahead is requested per line read, for CPUs whose
 * L2 streamer stops at 4 KiB page boundaries. On the shared Zen 4 here, A/B runs of 0, 16, 32
 * and 64 lines could not be told apart (run-to-run spread ~30%); measure again on a quiet host.
 */
#include <stdint.h>
#include <string.h>

#include "kernels.h"
#include "simd.h"

#define GP 16          /* outputs per panel */
#ifndef GEMV_PF
#define GEMV_PF 32     /* prefetch distance in lines (2 KiB); 0: none */
#endif

static void finish(const float *res, int rows, const float *bias, int64_t n0, int64_t nv,
                   float *out, int64_t out_stride)
{
    for (int r = 0; r < rows; r++)
        for (int64_t j = 0; j < nv; j++)
            out[r * out_stride + n0 + j] = res[r * GP + j] + (bias ? bias[n0 + j] : 0.0f);
}

static void panel_scalar(const float *x, int64_t x_stride, int rows, int64_t K,
                         const float *w, float *res)
{
    for (int r = 0; r < rows; r++) {
        float acc[GP] = {0};
        for (int64_t k = 0; k < K; k++) {
            const float xv = x[r * x_stride + k];
            for (int j = 0; j < GP; j++)
                acc[j] += xv * w[k * GP + j];
        }
        memcpy(res + r * GP, acc, sizeof acc);
    }
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define GEMV_AVX2 1
#define AVX2_TILE 4

/* ROWS rows by one panel, U lines per step each with its own accumulators (ROWS * U * 2
 * ymm, at most 8). A macro, not an inlined function: accumulator arrays of exactly this size
 * stay in registers (a larger array, partly used, went to the stack on every step). */
#define TILE_AVX2(ROWS, U)                                                                   \
static void tile_avx2_##ROWS(const float *x, int64_t xs, int64_t K, const float *w, float *res) \
{                                                                                            \
    __m256 acc[ROWS][U][2];                                                                  \
    for (int r = 0; r < ROWS; r++)                                                           \
        for (int u = 0; u < U; u++)                                                          \
            acc[r][u][0] = acc[r][u][1] = _mm256_setzero_ps();                               \
    int64_t k = 0;                                                                           \
    for (; k + U <= K; k += U) {                                                             \
        for (int u = 0; u < U; u++) {                                                        \
            const float *line = w + (k + u) * GP;                                            \
            if (GEMV_PF) _mm_prefetch((const char *)(line + GEMV_PF * GP), _MM_HINT_T0);     \
            const __m256 w0 = _mm256_loadu_ps(line), w1 = _mm256_loadu_ps(line + 8);         \
            for (int r = 0; r < ROWS; r++) {                                                 \
                const __m256 xv = _mm256_broadcast_ss(x + r * xs + k + u);                   \
                acc[r][u][0] = _mm256_fmadd_ps(xv, w0, acc[r][u][0]);                        \
                acc[r][u][1] = _mm256_fmadd_ps(xv, w1, acc[r][u][1]);                        \
            }                                                                                \
        }                                                                                    \
    }                                                                                        \
    for (; k < K; k++) {                                                                     \
        const __m256 w0 = _mm256_loadu_ps(w + k * GP), w1 = _mm256_loadu_ps(w + k * GP + 8); \
        for (int r = 0; r < ROWS; r++) {                                                     \
            const __m256 xv = _mm256_broadcast_ss(x + r * xs + k);                           \
            acc[r][0][0] = _mm256_fmadd_ps(xv, w0, acc[r][0][0]);                            \
            acc[r][0][1] = _mm256_fmadd_ps(xv, w1, acc[r][0][1]);                            \
        }                                                                                    \
    }                                                                                        \
    for (int r = 0; r < ROWS; r++) {                                                         \
        __m256 a0 = acc[r][0][0], a1 = acc[r][0][1];                                         \
        for (int u = 1; u < U; u++) {                                                        \
            a0 = _mm256_add_ps(a0, acc[r][u][0]);                                            \
            a1 = _mm256_add_ps(a1, acc[r][u][1]);                                            \
        }                                                                                    \
        _mm256_storeu_ps(res + r * GP, a0);                                                  \
        _mm256_storeu_ps(res + r * GP + 8, a1);                                              \
    }                                                                                        \
}
TILE_AVX2(1, 4)
TILE_AVX2(2, 2)
TILE_AVX2(3, 1)
TILE_AVX2(4, 1)

static void panel_avx2(const float *x, int64_t xs, int rows, int64_t K, const float *w, float *res)
{
    switch (rows) {
    case 1: tile_avx2_1(x, xs, K, w, res); break;
    case 2: tile_avx2_2(x, xs, K, w, res); break;
    case 3: tile_avx2_3(x, xs, K, w, res); break;
    default: tile_avx2_4(x, xs, K, w, res); break;
    }
}
#endif

#ifdef __AVX512F__
#define GEMV_AVX512 1
#define AVX512_TILE 8

/* as TILE_AVX2 with one zmm per line: ROWS * U accumulators, at most 16 */
#define TILE_AVX512(ROWS, U)                                                                 \
static void tile_avx512_##ROWS(const float *x, int64_t xs, int64_t K, const float *w, float *res) \
{                                                                                            \
    __m512 acc[ROWS][U];                                                                     \
    for (int r = 0; r < ROWS; r++)                                                           \
        for (int u = 0; u < U; u++)                                                          \
            acc[r][u] = _mm512_setzero_ps();                                                 \
    int64_t k = 0;                                                                           \
    for (; k + U <= K; k += U) {                                                             \
        for (int u = 0; u < U; u++) {                                                        \
            const float *line = w + (k + u) * GP;                                            \
            if (GEMV_PF) _mm_prefetch((const char *)(line + GEMV_PF * GP), _MM_HINT_T0);     \
            const __m512 wv = _mm512_loadu_ps(line);                                         \
            for (int r = 0; r < ROWS; r++)                                                   \
                acc[r][u] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * xs + k + u]), wv, acc[r][u]); \
        }                                                                                    \
    }                                                                                        \
    for (; k < K; k++) {                                                                     \
        const __m512 wv = _mm512_loadu_ps(w + k * GP);                                       \
        for (int r = 0; r < ROWS; r++)                                                       \
            acc[r][0] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * xs + k]), wv, acc[r][0]);       \
    }                                                                                        \
    for (int r = 0; r < ROWS; r++) {                                                         \
        __m512 a = acc[r][0];                                                                \
        for (int u = 1; u < U; u++)                                                          \
            a = _mm512_add_ps(a, acc[r][u]);                                                 \
        _mm512_storeu_ps(res + r * GP, a);                                                   \
    }                                                                                        \
}
TILE_AVX512(1, 4)
TILE_AVX512(2, 4)
TILE_AVX512(3, 4)
TILE_AVX512(4, 2)
TILE_AVX512(5, 2)
TILE_AVX512(6, 2)
TILE_AVX512(7, 2)
TILE_AVX512(8, 2)

static void panel_avx512(const float *x, int64_t xs, int rows, int64_t K, const float *w, float *res)
{
    switch (rows) {
    case 1: tile_avx512_1(x, xs, K, w, res); break;
    case 2: tile_avx512_2(x, xs, K, w, res); break;
    case 3: tile_avx512_3(x, xs, K, w, res); break;
    case 4: tile_avx512_4(x, xs, K, w, res); break;
    case 5: tile_avx512_5(x, xs, K, w, res); break;
    case 6: tile_avx512_6(x, xs, K, w, res); break;
    case 7: tile_avx512_7(x, xs, K, w, res); break;
    default: tile_avx512_8(x, xs, K, w, res); break;
    }
}
#endif

/* The paths this build has: bit 0 scalar, bit 1 AVX2, bit 2 AVX-512. */
int64_t gemv_f32_isas(void)
{
    int64_t isas = 1;
#ifdef GEMV_AVX2
    isas |= 2;
#endif
#ifdef GEMV_AVX512
    isas |= 4;
#endif
    return isas;
}

typedef void (*panel_fn)(const float *x, int64_t xs, int rows, int64_t K, const float *w, float *res);

/* Panels [p_begin, p_end) of out[M, N] (fp32, row stride out_stride) for all M rows of x;
 * `packed` is [ceil(N/16)][K][16] fp32, `bias` fp32 [N] or NULL. */
void gemv_f32_panels(const float *x, int64_t x_stride, int64_t M, int64_t K, const float *packed,
                     const float *bias, float *out, int64_t out_stride, int64_t N, int64_t isa,
                     int64_t p_begin, int64_t p_end)
{
    panel_fn panel = panel_scalar;
    int tile = 8;
#ifdef GEMV_AVX2
    if (isa == 1) { panel = panel_avx2; tile = AVX2_TILE; }
#endif
#ifdef GEMV_AVX512
    if (isa == 2) { panel = panel_avx512; tile = AVX512_TILE; }
#endif
    float res[8 * GP];
    for (int64_t p = p_begin; p < p_end; p++) {
        const int64_t n0 = p * GP, nv = N - n0 < GP ? N - n0 : GP;
        const float *w = packed + p * K * GP;
        for (int64_t m0 = 0; m0 < M; m0 += tile) {
            const int rows = M - m0 < tile ? (int)(M - m0) : tile;
            panel(x + m0 * x_stride, x_stride, rows, K, w, res);
            finish(res, rows, bias, n0, nv, out + m0 * out_stride, out_stride);
        }
    }
}
