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
 * Weights in half precision (`wdt`: 1 bf16, 2 fp16; 0 is fp32): the same panels of 16-bit
 * values, widened to fp32 in registers as each line is loaded (bf16: its 16 bits become a
 * float's top half, by a shift or a mask; fp16: F16C's vcvtph2ps), then the same FMAs in the
 * same order. Both widenings are
 * exact, so the result is bit for bit the fp32 GEMV's over the widened weights, while a decode
 * step streams half the bytes. (A batch-1 step is bound by that stream, not by the FMAs.)
 *
 * Software prefetch: a line GEMV_PF fp32 lines (2 KiB) ahead is requested per line read, for CPUs whose
 * L2 streamer stops at 4 KiB page boundaries. On the shared Zen 4 here, A/B runs of 0, 16, 32
 * and 64 lines could not be told apart (run-to-run spread ~30%); measure again on a quiet host.
 */
#include <stdint.h>
#include <string.h>

#include "kernels.h"
#include "simd.h"

#define GP 16          /* outputs per panel */
#ifndef GEMV_PF
#define GEMV_PF 32     /* prefetch distance in fp32 lines (2 KiB); 0: none */
#endif
#define PF_BYTES (GEMV_PF * GP * 4)
#ifndef GEMV_GROUP_BYTES
#define GEMV_GROUP_BYTES (256 << 10)  /* weights of the panels a row tile runs over: half a Zen 3's L2 */
#endif

static void finish(const float *res, int rows, const float *bias, int64_t n0, int64_t nv,
                   float *out, int64_t out_stride)
{
    for (int r = 0; r < rows; r++)
        for (int64_t j = 0; j < nv; j++)
            out[r * out_stride + n0 + j] = res[r * GP + j] + (bias ? bias[n0 + j] : 0.0f);
}

static inline float widen(const void *w, int wdt, int64_t i)
{
    if (wdt == 1) return bf16_to_float(((const uint16_t *)w)[i]);
    if (wdt == 2) return f16_to_float(((const uint16_t *)w)[i]);
    return ((const float *)w)[i];
}

static void panel_scalar(const float *x, int64_t x_stride, int rows, int64_t K,
                         const void *w, int wdt, float *res)
{
    for (int r = 0; r < rows; r++) {
        float acc[GP] = {0};
        for (int64_t k = 0; k < K; k++) {
            const float xv = x[r * x_stride + k];
            for (int j = 0; j < GP; j++)
                acc[j] += xv * widen(w, wdt, k * GP + j);
        }
        memcpy(res + r * GP, acc, sizeof acc);
    }
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define GEMV_AVX2 1
#define AVX2_TILE 6

/* one line of 16 weights as two ymm of fp32, from each storage type */
#define LINE_AVX2_F32(p, w0, w1) \
    const __m256 w0 = _mm256_loadu_ps((const float *)(p)), w1 = _mm256_loadu_ps((const float *)(p) + 8)
/* bf16 in one 32-byte load: each 32-bit lane holds outputs 2i (low half) and 2i + 1 (high
 * half), so a shift gives the even outputs' floats and a mask the odd ones' (two ops, where
 * zero-extending each half takes four). w0/w1 then hold outputs 0,2,..,14 / 1,3,..,15: every
 * output still sums in the same order; ORDER_AVX2_BF16 puts them back in place at the end. */
#define LINE_AVX2_BF16(p, w0, w1)                                                    \
    const __m256i w0##i = _mm256_loadu_si256((const __m256i *)(p));                     \
    const __m256 w0 = _mm256_castsi256_ps(_mm256_slli_epi32(w0##i, 16)),                \
                 w1 = _mm256_castsi256_ps(_mm256_and_si256(w0##i, _mm256_set1_epi32((int)0xffff0000u)))
/* even outputs in a0, odd in a1 -> outputs 0..7 in a0, 8..15 in a1 */
#define ORDER_AVX2_BF16(a0, a1) do {                                                 \
        const __m256 lo = _mm256_unpacklo_ps(a0, a1), hi = _mm256_unpackhi_ps(a0, a1);  \
        a0 = _mm256_permute2f128_ps(lo, hi, 0x20);                                      \
        a1 = _mm256_permute2f128_ps(lo, hi, 0x31);                                      \
    } while (0)
#define ORDER_NONE(a0, a1) do { } while (0)
#define LINE_AVX2_F16(p, w0, w1)                                                     \
    const __m256 w0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p))),           \
                 w1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p) + 1))

/* ROWS rows by one panel of WT weights, U lines per step each with its own accumulators
 * (ROWS * U * 2 ymm, at most 8). A macro, not an inlined function: accumulator arrays of
 * exactly this size stay in registers (a larger array, partly used, went to the stack on
 * every step). */
#define TILE_AVX2(T, WT, LINE, ORDER, ROWS, U)                                                    \
static void tile_avx2_##T##_##ROWS(const float *x, int64_t xs, int64_t K, const WT *w, float *res) \
{                                                                                            \
    __m256 acc[ROWS][U][2];                                                                  \
    for (int r = 0; r < ROWS; r++)                                                           \
        for (int u = 0; u < U; u++)                                                          \
            acc[r][u][0] = acc[r][u][1] = _mm256_setzero_ps();                               \
    int64_t k = 0;                                                                           \
    for (; k + U <= K; k += U) {                                                             \
        for (int u = 0; u < U; u++) {                                                        \
            const WT *line = w + (k + u) * GP;                                               \
            if (GEMV_PF) _mm_prefetch((const char *)line + PF_BYTES, _MM_HINT_T0);           \
            LINE(line, w0, w1);                                                              \
            for (int r = 0; r < ROWS; r++) {                                                 \
                const __m256 xv = _mm256_broadcast_ss(x + r * xs + k + u);                   \
                acc[r][u][0] = _mm256_fmadd_ps(xv, w0, acc[r][u][0]);                        \
                acc[r][u][1] = _mm256_fmadd_ps(xv, w1, acc[r][u][1]);                        \
            }                                                                                \
        }                                                                                    \
    }                                                                                        \
    for (; k < K; k++) {                                                                     \
        LINE(w + k * GP, w0, w1);                                                            \
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
        ORDER(a0, a1);                                                                       \
        _mm256_storeu_ps(res + r * GP, a0);                                                  \
        _mm256_storeu_ps(res + r * GP + 8, a1);                                              \
    }                                                                                        \
}                                                                                            \

/* Five or six rows by one panel: the long-batch tiles (up to 12 accumulators, two weight lines
 * and a broadcast: 15 of the 16 ymm). Named accumulators, not an array: with an array gcc
 * stored them all back to the stack on every k (it did for five and six rows), which capped
 * the tile at ~40% of the FMA rate; not inlined, since inlined into the panel function gcc
 * spilled them again. Rows past ROWS are compile-time dead code. */
#define FMA2_AVX2(r) do {                                                                    \
        if (ROWS > r) {                                                                      \
            const __m256 xv = _mm256_broadcast_ss(x##r + k);                                 \
            c##r##0 = _mm256_fmadd_ps(xv, w0, c##r##0);                                      \
            c##r##1 = _mm256_fmadd_ps(xv, w1, c##r##1);                                      \
        }                                                                                    \
    } while (0)
#define STORE2_AVX2(r, ORDER) do {                                                           \
        if (ROWS > r) {                                                                      \
            ORDER(c##r##0, c##r##1);                                                         \
            _mm256_storeu_ps(res + r * GP, c##r##0);                                         \
            _mm256_storeu_ps(res + r * GP + 8, c##r##1);                                     \
        }                                                                                    \
    } while (0)
#define TILE_NAMED_AVX2(T, WT, LINE, ORDER, R)                                               \
__attribute__((noinline)) static void tile_avx2_##T##_##R(const float *x, int64_t xs, int64_t K, const WT *w, float *res) \
{                                                                                            \
    enum { ROWS = R };                                                                       \
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, \
           c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;                 \
    const float *x0 = x, *x1 = x + xs, *x2 = x + 2 * xs, *x3 = x + 3 * xs, *x4 = x + 4 * xs, \
                *x5 = x + 5 * xs;                                                            \
    (void)x5; (void)c50; (void)c51;                                                          \
    for (int64_t k = 0; k < K; k++) {                                                        \
        const WT *line = w + k * GP;                                                         \
        if (GEMV_PF) _mm_prefetch((const char *)line + PF_BYTES, _MM_HINT_T0);               \
        LINE(line, w0, w1);                                                                  \
        FMA2_AVX2(0); FMA2_AVX2(1); FMA2_AVX2(2); FMA2_AVX2(3); FMA2_AVX2(4); FMA2_AVX2(5);  \
    }                                                                                        \
    STORE2_AVX2(0, ORDER); STORE2_AVX2(1, ORDER); STORE2_AVX2(2, ORDER);                     \
    STORE2_AVX2(3, ORDER); STORE2_AVX2(4, ORDER); STORE2_AVX2(5, ORDER);                     \
}

/* the tiles of one storage type, and the panel that picks one by row count */
#define PANEL_AVX2(T, WT, LINE, ORDER)                                                       \
TILE_AVX2(T, WT, LINE, ORDER, 1, 4)                                                          \
TILE_AVX2(T, WT, LINE, ORDER, 2, 2)                                                          \
TILE_AVX2(T, WT, LINE, ORDER, 3, 1)                                                          \
TILE_AVX2(T, WT, LINE, ORDER, 4, 1)                                                          \
TILE_NAMED_AVX2(T, WT, LINE, ORDER, 5)                                                       \
TILE_NAMED_AVX2(T, WT, LINE, ORDER, 6)                                                       \
static void panel_avx2_##T(const float *x, int64_t xs, int rows, int64_t K, const void *w, float *res) \
{                                                                                            \
    switch (rows) {                                                                          \
    case 1: tile_avx2_##T##_1(x, xs, K, (const WT *)w, res); break;                          \
    case 2: tile_avx2_##T##_2(x, xs, K, (const WT *)w, res); break;                          \
    case 3: tile_avx2_##T##_3(x, xs, K, (const WT *)w, res); break;                          \
    case 4: tile_avx2_##T##_4(x, xs, K, (const WT *)w, res); break;                          \
    case 5: tile_avx2_##T##_5(x, xs, K, (const WT *)w, res); break;                          \
    default: tile_avx2_##T##_6(x, xs, K, (const WT *)w, res); break;                         \
    }                                                                                        \
}
PANEL_AVX2(f32, float, LINE_AVX2_F32, ORDER_NONE)
PANEL_AVX2(bf16, uint16_t, LINE_AVX2_BF16, ORDER_AVX2_BF16)
PANEL_AVX2(f16, uint16_t, LINE_AVX2_F16, ORDER_NONE)
#endif

#ifdef __AVX512F__
#define GEMV_AVX512 1
#define AVX512_TILE 8

#define LINE_AVX512_F32(p) _mm512_loadu_ps((const float *)(p))
#define LINE_AVX512_BF16(p) load16_bf16((const uint16_t *)(p))
#define LINE_AVX512_F16(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))

/* as TILE_AVX2 with one zmm per line: ROWS * U accumulators, at most 16 */
#define TILE_AVX512(T, WT, LINE, ROWS, U)                                                    \
static void tile_avx512_##T##_##ROWS(const float *x, int64_t xs, int64_t K, const WT *w, float *res) \
{                                                                                            \
    __m512 acc[ROWS][U];                                                                     \
    for (int r = 0; r < ROWS; r++)                                                           \
        for (int u = 0; u < U; u++)                                                          \
            acc[r][u] = _mm512_setzero_ps();                                                 \
    int64_t k = 0;                                                                           \
    for (; k + U <= K; k += U) {                                                             \
        for (int u = 0; u < U; u++) {                                                        \
            const WT *line = w + (k + u) * GP;                                               \
            if (GEMV_PF) _mm_prefetch((const char *)line + PF_BYTES, _MM_HINT_T0);           \
            const __m512 wv = LINE(line);                                                    \
            for (int r = 0; r < ROWS; r++)                                                   \
                acc[r][u] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * xs + k + u]), wv, acc[r][u]); \
        }                                                                                    \
    }                                                                                        \
    for (; k < K; k++) {                                                                     \
        const __m512 wv = LINE(w + k * GP);                                                  \
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

#define PANEL_AVX512(T, WT, LINE)                                                            \
TILE_AVX512(T, WT, LINE, 1, 4)                                                               \
TILE_AVX512(T, WT, LINE, 2, 4)                                                               \
TILE_AVX512(T, WT, LINE, 3, 4)                                                               \
TILE_AVX512(T, WT, LINE, 4, 2)                                                               \
TILE_AVX512(T, WT, LINE, 5, 2)                                                               \
TILE_AVX512(T, WT, LINE, 6, 2)                                                               \
TILE_AVX512(T, WT, LINE, 7, 2)                                                               \
TILE_AVX512(T, WT, LINE, 8, 2)                                                               \
static void panel_avx512_##T(const float *x, int64_t xs, int rows, int64_t K, const void *w, float *res) \
{                                                                                            \
    switch (rows) {                                                                          \
    case 1: tile_avx512_##T##_1(x, xs, K, (const WT *)w, res); break;                        \
    case 2: tile_avx512_##T##_2(x, xs, K, (const WT *)w, res); break;                        \
    case 3: tile_avx512_##T##_3(x, xs, K, (const WT *)w, res); break;                        \
    case 4: tile_avx512_##T##_4(x, xs, K, (const WT *)w, res); break;                        \
    case 5: tile_avx512_##T##_5(x, xs, K, (const WT *)w, res); break;                        \
    case 6: tile_avx512_##T##_6(x, xs, K, (const WT *)w, res); break;                        \
    case 7: tile_avx512_##T##_7(x, xs, K, (const WT *)w, res); break;                        \
    default: tile_avx512_##T##_8(x, xs, K, (const WT *)w, res); break;                       \
    }                                                                                        \
}
PANEL_AVX512(f32, float, LINE_AVX512_F32)
PANEL_AVX512(bf16, uint16_t, LINE_AVX512_BF16)
PANEL_AVX512(f16, uint16_t, LINE_AVX512_F16)
#endif

/* The paths this build has: bit 0 scalar, bit 1 AVX2 (with FMA and F16C), bit 2 AVX-512. */
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

typedef void (*panel_fn)(const float *x, int64_t xs, int rows, int64_t K, const void *w, float *res);

/* Panels [p_begin, p_end) of out[M, N] (fp32, row stride out_stride) for all M rows of x;
 * `packed` is [ceil(N/16)][K][16] in fp32 (wdt 0), bf16 (1) or fp16 (2), `bias` fp32 [N] or
 * NULL. */
void gemv_f32_panels(const float *x, int64_t x_stride, int64_t M, int64_t K, const void *packed,
                     const float *bias, float *out, int64_t out_stride, int64_t N, int64_t isa,
                     int64_t wdt, int64_t p_begin, int64_t p_end)
{
    panel_fn panel = NULL;
    int tile = 8;
#ifdef GEMV_AVX2
    if (isa == 1) {
        panel = wdt == 1 ? panel_avx2_bf16 : wdt == 2 ? panel_avx2_f16 : panel_avx2_f32;
        tile = AVX2_TILE;
    }
#endif
#ifdef GEMV_AVX512
    if (isa == 2) {
        panel = wdt == 1 ? panel_avx512_bf16 : wdt == 2 ? panel_avx512_f16 : panel_avx512_f32;
        tile = AVX512_TILE;
    }
#endif
    const int64_t esize = wdt == 0 ? 4 : 2;
    /* Panels in groups that fit L2 together; each tile of rows runs over a whole group, so the
     * tile's activations stay in L1 while the group's weights are reread from L2 (a long batch
     * is then a GEMM at close to the FMA rate, not a stream of x from L3 per panel). */
    const int64_t pbytes = K * GP * esize;
    const int64_t group = pbytes >= GEMV_GROUP_BYTES ? 1 : GEMV_GROUP_BYTES / pbytes;
    float res[8 * GP];
    for (int64_t g0 = p_begin; g0 < p_end; g0 += group) {
        const int64_t g1 = g0 + group < p_end ? g0 + group : p_end;
        for (int64_t m0 = 0; m0 < M; m0 += tile) {
            const int rows = M - m0 < tile ? (int)(M - m0) : tile;
            for (int64_t p = g0; p < g1; p++) {
                const int64_t n0 = p * GP, nv = N - n0 < GP ? N - n0 : GP;
                const void *w = (const char *)packed + p * pbytes;
                if (panel)
                    panel(x + m0 * x_stride, x_stride, rows, K, w, res);
                else
                    panel_scalar(x + m0 * x_stride, x_stride, rows, K, w, (int)wdt, res);
                finish(res, rows, bias, n0, nv, out + m0 * out_stride, out_stride);
            }
        }
    }
}
