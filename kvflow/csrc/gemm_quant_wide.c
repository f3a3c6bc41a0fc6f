/* out = x @ w.T for quantized weights (gemm_quant.c's panel layout) and many rows x: the
 * weights are widened to floats on the fly, a little at a time, into this thread's scratch,
 * and multiplied there with float activations, so the widening is paid once per weight and
 * shared by every row of the step.
 *
 * For a prefill or a batch the int8 GEMM is no faster per row than a float GEMM (the int8
 * products save half the multiplies, and quantizing the activations and scaling every block
 * of 32 gives it back), while the widening costs a few instructions per weight, once: with
 * M rows it is 1/M of the work. With few rows it is the other way round (the weight stream is
 * the time, and int8 reads a quarter of bf16's bytes), so decode keeps gemm_quant.c.
 *
 * Two paths, chosen at load from the CPU (the caller passes `isa` as gemm_quant.c's):
 *   AVX512-BF16 (bf16 activations and output): four panels of 16 outputs widen into one panel
 *       of gemm_bf16.c's layout ([K/2][64][2] bf16, in L2), which gemm_bf16.c's `vdpbf16ps`
 *       tiles then multiply: the same kernel as the bf16 model's projections.
 *   AVX2 + FMA (anything else: fp32 activations, Zen 3): one panel of 16 outputs widens to
 *       fp32 [K][16] and tiles of up to 6 rows accumulate with FMA.
 * The widened weight is d * q + m in fp32 (rounded once to bf16 on the first path): the
 * dequantised weight exactly, so the results are dequantise-then-matmul's. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "q6.h"
#include "simd.h"

#define QP 16
#define QB 32
#define Q4_REC 320
#define Q8_REC 544
#define GROUP 4 /* quantized panels per widened panel of 64 outputs (gemm_bf16.c's width) */

static __thread struct { void *buf; size_t cap; } wide_scratch;

static void *scratch_for(size_t bytes)
{
    if (bytes > wide_scratch.cap) {
        free(wide_scratch.buf);
        wide_scratch.buf = aligned_alloc(64, (bytes + 63) & ~(size_t)63);
        wide_scratch.cap = wide_scratch.buf ? bytes : 0;
    }
    return wide_scratch.buf;
}

/* quantized value t (0..31) of output o in a record */
static inline int record_q(const uint8_t *rec, int q8, int o, int t)
{
    const int j = t / 4, b = t % 4;
    if (q8)
        return (int8_t)rec[64 * j + 4 * o + b];
    return j < 4 ? rec[64 * j + 4 * o + b] & 0x0f : rec[64 * (j - 4) + 4 * o + b] >> 4;
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define WIDE_AVX2 1

/* one panel of 16 outputs -> fp32 [Kb * 32][16] */
static void widen_f32(const uint8_t *panel, int64_t Kb, int q8, float *dst)
{
    const int rec_bytes = q8 ? Q8_REC : Q4_REC;
    for (int64_t b = 0; b < Kb; b++) {
        const uint8_t *rec = panel + b * rec_bytes;
        float d[QP], m[QP];
        _mm256_storeu_ps(d, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + (q8 ? 512 : 256)))));
        _mm256_storeu_ps(d + 8, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + (q8 ? 528 : 272)))));
        if (q8) {
            memset(m, 0, sizeof m);
        } else {
            _mm256_storeu_ps(m, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + 288))));
            _mm256_storeu_ps(m + 8, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + 304))));
        }
        float *row = dst + b * QB * QP;
        for (int t = 0; t < QB; t++)
            for (int o = 0; o < QP; o++)
                row[t * QP + o] = d[o] * (float)record_q(rec, q8, o, t) + m[o];
    }
}

static inline float act(const void *x, int64_t i, int bf16)
{
    return bf16 ? bf16_to_float(((const uint16_t *)x)[i]) : ((const float *)x)[i];
}

#define F32_TILE 6
static inline __attribute__((always_inline)) void
tile_f32(const void *x, int64_t x_stride, int bf16, int rows, int64_t K, const float *w,
         const float *bias, int64_t nv, void *out, int64_t out_stride, int out_bf16)
{
    __m256 acc[F32_TILE][2];
    for (int r = 0; r < rows; r++)
        acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        const __m256 w0 = _mm256_loadu_ps(w + k * QP), w1 = _mm256_loadu_ps(w + k * QP + 8);
        for (int r = 0; r < rows; r++) {
            const __m256 xv = _mm256_set1_ps(act(x, r * x_stride + k, bf16));
            acc[r][0] = _mm256_fmadd_ps(w0, xv, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(w1, xv, acc[r][1]);
        }
    }
    for (int r = 0; r < rows; r++) {
        float res[QP];
        _mm256_storeu_ps(res, acc[r][0]);
        _mm256_storeu_ps(res + 8, acc[r][1]);
        for (int64_t o = 0; o < nv; o++) {
            const float v = res[o] + (bias ? bias[o] : 0.f);
            if (out_bf16)
                ((uint16_t *)out)[r * out_stride + o] = float_to_bf16(v);
            else
                ((float *)out)[r * out_stride + o] = v;
        }
    }
}

#define F32_FN(R) static void f32_##R(const void *x, int64_t xs, int bf, int64_t K,            \
        const float *w, const float *b, int64_t nv, void *o, int64_t os, int ob) {             \
    tile_f32(x, xs, bf, R, K, w, b, nv, o, os, ob); }
F32_FN(1) F32_FN(2) F32_FN(3) F32_FN(4) F32_FN(5) F32_FN(6)
typedef void (*f32_fn)(const void *, int64_t, int, int64_t, const float *, const float *,
                       int64_t, void *, int64_t, int);
static const f32_fn F32_TILES[F32_TILE + 1] = {0, f32_1, f32_2, f32_3, f32_4, f32_5, f32_6};

static int64_t wide_f32(const void *x, int64_t x_stride, int64_t K, int64_t Kb, int x_bf16,
                        int64_t M, const uint8_t *packed, int q8, const float *bias, void *out,
                        int64_t out_stride, int64_t N, int out_bf16, int64_t g_begin, int64_t g_end)
{
    const int64_t panel_bytes = Kb * (q8 ? Q8_REC : Q4_REC), panels = (N + QP - 1) / QP;
    float *w = scratch_for((size_t)(Kb * QB * QP) * sizeof(float));
    if (!w)
        return -1;
    const int64_t tiles = (M + F32_TILE - 1) / F32_TILE, xe = x_bf16 ? 2 : 4, oe = out_bf16 ? 2 : 4;
    for (int64_t p = g_begin * GROUP; p < g_end * GROUP && p < panels; p++) {
        const int64_t n0 = p * QP, nv = N - n0 < QP ? N - n0 : QP;
        widen_f32(packed + p * panel_bytes, Kb, q8, w);
        for (int64_t t = 0, m0 = 0; t < tiles; t++) {
            const int64_t rows = (M - m0) / (tiles - t);
            F32_TILES[rows]((const char *)x + m0 * x_stride * xe, x_stride, x_bf16, K, w,
                            bias ? bias + n0 : 0, nv, (char *)out + (m0 * out_stride + n0) * oe,
                            out_stride, out_bf16);
            m0 += rows;
        }
    }
    return 0;
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define WIDE_BF16 1

/* one quad vector of a record (input 4j + t of output o in byte 4o + t, as int8 or 0..15)
 * -> rows kp and kp + 1 of the bf16 panel, outputs col..col+15 (pairs of inputs) */
static inline __attribute__((always_inline)) void
widen_quad_bf16(__m512i quad, int q8, const __m512 dq[4], const __m512 mq[4], uint16_t *row)
{
    __m256bh h[4];
#define QUARTER(c) do {                                                                         \
        const __m128i by = _mm512_extracti32x4_epi32(quad, c);                                 \
        const __m512i iv = q8 ? _mm512_cvtepi8_epi32(by) : _mm512_cvtepu8_epi32(by);           \
        h[c] = _mm512_cvtneps_pbh(_mm512_fmadd_ps(_mm512_cvtepi32_ps(iv), dq[c], mq[c]));      \
    } while (0)
    QUARTER(0); QUARTER(1); QUARTER(2); QUARTER(3);
#undef QUARTER
    /* dword 2o + s of lo (outputs 0..7) / hi (8..15): output o's inputs 2s, 2s + 1 */
    const __m512i lo = _mm512_inserti64x4(_mm512_castsi256_si512((__m256i)h[0]), (__m256i)h[1], 1);
    const __m512i hi = _mm512_inserti64x4(_mm512_castsi256_si512((__m256i)h[2]), (__m256i)h[3], 1);
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    _mm512_storeu_si512(row, _mm512_permutex2var_epi32(lo, even, hi));
    _mm512_storeu_si512(row + 2 * 64, _mm512_permutex2var_epi32(lo, odd, hi));
}

/* up to four panels of 16 outputs -> one bf16 panel [Kb * 16][64][2] (missing ones: zeros) */
static void widen_bf16(const uint8_t *packed, int64_t panel_bytes, int64_t Kb, int q8,
                       int npanels, uint16_t *dst)
{
    const int rec_bytes = q8 ? Q8_REC : Q4_REC;
    __m512i spread[4];
    for (int c = 0; c < 4; c++) /* lane l of quarter c is output 4c + l / 4 */
        spread[c] = _mm512_setr_epi32(4 * c, 4 * c, 4 * c, 4 * c, 4 * c + 1, 4 * c + 1, 4 * c + 1,
                                      4 * c + 1, 4 * c + 2, 4 * c + 2, 4 * c + 2, 4 * c + 2,
                                      4 * c + 3, 4 * c + 3, 4 * c + 3, 4 * c + 3);
    const __m512i low = _mm512_set1_epi8(0x0f);
    for (int g = 0; g < GROUP; g++) {
        uint16_t *col = dst + 2 * QP * g;
        if (g >= npanels) {
            for (int64_t kp = 0; kp < Kb * QB / 2; kp++)
                memset(col + kp * 2 * 64, 0, 2 * QP * sizeof(uint16_t));
            continue;
        }
        const uint8_t *panel = packed + g * panel_bytes;
        for (int64_t b = 0; b < Kb; b++) {
            const uint8_t *rec = panel + b * rec_bytes;
            const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rec + (q8 ? 512 : 256))));
            const __m512 m = q8 ? _mm512_setzero_ps()
                                : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rec + 288)));
            __m512 dq[4], mq[4];
            for (int c = 0; c < 4; c++) {
                dq[c] = _mm512_permutexvar_ps(spread[c], d);
                mq[c] = _mm512_permutexvar_ps(spread[c], m);
            }
            uint16_t *rows = col + b * (QB / 2) * 2 * 64; /* kp = 16 b + 2 j (+1) */
            if (q8) {
                for (int j = 0; j < 8; j++)
                    widen_quad_bf16(_mm512_loadu_si512(rec + 64 * j), 1, dq, mq, rows + 2 * j * 2 * 64);
            } else {
                for (int j = 0; j < 4; j++) {
                    const __m512i v = _mm512_loadu_si512(rec + 64 * j);
                    widen_quad_bf16(_mm512_and_si512(v, low), 0, dq, mq, rows + 2 * j * 2 * 64);
                    widen_quad_bf16(_mm512_and_si512(_mm512_srli_epi16(v, 4), low), 0, dq, mq,
                                    rows + 2 * (j + 4) * 2 * 64);
                }
            }
        }
    }
}

/* widen_bf16 for q6 records (Q6_K): per block of 32 inputs, two sub-blocks' scales d * sc and
 * offsets -32 d sc (exact: a power of two), the 6-bit values unsigned */
static void widen_bf16_q6(const uint8_t *packed, int64_t panel_bytes, int64_t Kb, int npanels,
                          uint16_t *dst)
{
    __m512i spread[4];
    for (int c = 0; c < 4; c++)
        spread[c] = _mm512_setr_epi32(4 * c, 4 * c, 4 * c, 4 * c, 4 * c + 1, 4 * c + 1, 4 * c + 1,
                                      4 * c + 1, 4 * c + 2, 4 * c + 2, 4 * c + 2, 4 * c + 2,
                                      4 * c + 3, 4 * c + 3, 4 * c + 3, 4 * c + 3);
    for (int g = 0; g < GROUP; g++) {
        uint16_t *col = dst + 2 * QP * g;
        if (g >= npanels) {
            for (int64_t kp = 0; kp < Kb * QB / 2; kp++)
                memset(col + kp * 2 * 64, 0, 2 * QP * sizeof(uint16_t));
            continue;
        }
        const uint8_t *panel = packed + g * panel_bytes;
        for (int64_t b = 0; b < Kb; b++) {
            const uint8_t *rec = panel + (b / 8) * Q6_REC, *blk = rec + (b % 8) * Q6_BLOCK;
            const int8_t *sc = (const int8_t *)(rec + Q6_SC) + (b % 8) * 2 * QP;
            const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rec + Q6_D)));
            __m512i q[8];
            q6_unpack512(blk, q);
            uint16_t *rows = col + b * (QB / 2) * 2 * 64;
            for (int s = 0; s < 2; s++) {
                const __m512 ds = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                    _mm_loadu_si128((const __m128i *)(sc + s * QP)))));
                const __m512 off = _mm512_mul_ps(ds, _mm512_set1_ps(-32.f));
                __m512 dq[4], mq[4];
                for (int c = 0; c < 4; c++) {
                    dq[c] = _mm512_permutexvar_ps(spread[c], ds);
                    mq[c] = _mm512_permutexvar_ps(spread[c], off);
                }
                for (int j = 4 * s; j < 4 * s + 4; j++)
                    widen_quad_bf16(q[j], 0, dq, mq, rows + 2 * j * 2 * 64);
            }
        }
    }
}

static int64_t wide_bf16(const uint16_t *x, int64_t x_stride, int64_t K, int64_t Kb, int64_t M,
                         const uint8_t *packed, int kind, const float *bias, uint16_t *out,
                         int64_t out_stride, int64_t N, int64_t g_begin, int64_t g_end)
{
    const int q8 = kind == 1, q6 = kind == QUANT_KIND_Q6;
    const int64_t panel_bytes = q6 ? (Kb / 8) * Q6_REC : Kb * (q8 ? Q8_REC : Q4_REC);
    const int64_t panels = (N + QP - 1) / QP;
    const size_t w_elems = (size_t)(Kb * QB * 64);
    uint16_t *w = scratch_for(w_elems * 2 + 64 * 2);
    if (!w)
        return -1;
    uint16_t *b16 = w + w_elems;
    for (int64_t g = g_begin; g < g_end; g++) {
        const int64_t p0 = g * GROUP, n0 = p0 * QP, nv = N - n0 < 64 ? N - n0 : 64;
        const int np = panels - p0 < GROUP ? (int)(panels - p0) : GROUP;
        if (q6)
            widen_bf16_q6(packed + p0 * panel_bytes, panel_bytes, Kb, np, w);
        else
            widen_bf16(packed + p0 * panel_bytes, panel_bytes, Kb, q8, np, w);
        if (bias)
            for (int64_t o = 0; o < nv; o++)
                b16[o] = float_to_bf16(bias[n0 + o]);
        gemm_bf16_panels(x, x_stride, M, K, w, bias ? b16 : 0, out + n0, out_stride, nv, 0, 1, 0);
    }
    return 0;
}
#endif

/* The wide paths this build has: bit 1 AVX2 (fp32), bit 2 AVX512-BF16. */
int64_t gemm_quant_wide_isas(void)
{
    int64_t isas = 0;
#ifdef WIDE_AVX2
    isas |= 2;
#endif
#ifdef WIDE_BF16
    isas |= 4;
#endif
    return isas;
}

/* Whether gemm_quant_wide takes this call (else the caller runs the int8 GEMM): q4 and q8
 * records on either path, q6 on the bf16 one only. */
int64_t gemm_quant_wide_takes(int64_t kind, int64_t isa, int64_t K, int64_t x_bf16, int64_t out_bf16)
{
    if (kind != 0 && kind != 1 && kind != QUANT_KIND_Q6)
        return 0;
#ifdef WIDE_BF16
    if (isa == 2 && x_bf16 && out_bf16 && K % 2 == 0)
        return 1;
#endif
#ifdef WIDE_AVX2
    if (isa >= 1 && kind != QUANT_KIND_Q6)
        return 1;
#endif
    (void)isa; (void)K; (void)x_bf16; (void)out_bf16;
    return 0;
}

/* Groups [g_begin, g_end) of 64 outputs (four panels of 16) of out[M, N] = x[M, K] @ w.T
 * (+ bias fp32 [N] or NULL), x bf16 or fp32 with row stride x_stride, out likewise;
 * -1: no memory for the scratch. Only where gemm_quant_wide_takes says so. */
int64_t gemm_quant_wide(const void *x, int64_t x_stride, int64_t K, int64_t Kb, int64_t x_bf16,
                        int64_t M, const uint8_t *packed, int64_t kind, int64_t isa,
                        const float *bias, void *out, int64_t out_stride, int64_t N,
                        int64_t out_bf16, int64_t g_begin, int64_t g_end)
{
#ifdef WIDE_BF16
    if (isa == 2 && x_bf16 && out_bf16 && K % 2 == 0)
        return wide_bf16(x, x_stride, K, Kb, M, packed, (int)kind, bias, out, out_stride, N,
                         g_begin, g_end);
#endif
#ifdef WIDE_AVX2
    if (isa >= 1 && kind != QUANT_KIND_Q6)
        return wide_f32(x, x_stride, K, Kb, (int)x_bf16, M, packed, (int)kind, bias, out,
                        out_stride, N, (int)out_bf16, g_begin, g_end);
#endif
    (void)x; (void)x_stride; (void)K; (void)Kb; (void)x_bf16; (void)M; (void)packed; (void)kind;
    (void)isa; (void)bias; (void)out; (void)out_stride; (void)N; (void)out_bf16; (void)g_begin;
    (void)g_end;
    return -1;
}
