/* out = x @ w.T (+ bias) for MXFP4 weights (gpt-oss's experts, OCP microscaling: per block of
 * 32 inputs one e8m0 exponent and 32 e2m1 values) against activations quantized to int8 per
 * block of 32 (gemm_quant.c's quantize_rows_q8), as llama.cpp multiplies them: the e2m1 values
 * doubled are the integers {0, 1, 2, 3, 4, 6, 8, 12} and their negatives, looked up from the
 * 4-bit code with a byte shuffle, so a block's dot product is exact in int32; the e8m0 scale
 * 2^(e - 127), halved for the doubling, and the activations' scale multiply it once per block.
 *
 * Weight layout (kvflow/model/quant/packing.py, kind "mxfp4"): gemm_quant.c's panels of 16
 * outputs, one 272-byte record per block of 32 inputs: the q4 record's four 64-byte vectors of
 * nibbles (vector v: inputs 4v..4v+3 of the 16 outputs in its low nibbles, 16+4v.. in its high
 * ones), here e2m1 codes (bit 3 the sign), then the 16 outputs' e8m0 bytes: 4.25 bits a weight,
 * the checkpoint's own size.
 *
 * Paths (chosen at load, passed as `isa`): 0 scalar (the tests' reference), 1 AVX2
 * (`vpmaddubsw` of |w| and x carrying w's sign), 2 AVX-512 VNNI (`vpdpbusd` of x + 128 against
 * the signed weights, less 128 * the block's weight sum, found by the same instruction). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "panel_store.h"
#include "simd.h"

#define QP 16
#define QB 32
#define MX_REC 272
#define MX_TILE 4

static const int8_t E2M1_X2[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* 2^(e - 128): the block's scale, halved for the doubled values (e = 255, NaN in the format,
 * is read as 2^127: no checkpoint has it) */
static inline float e8m0_half(uint8_t e) { return ldexpf(1.f, (int)e - 128); }

static void finish(const float *acc, int64_t rows, const float *bias, int64_t n0, int64_t nv,
                   void *out, int64_t out_stride, int bf16)
{
    for (int64_t r = 0; r < rows; r++)
        for (int64_t o = 0; o < nv; o++)
            store_out(out, r * out_stride + n0 + o, acc[r * QP + o] + (bias ? bias[n0 + o] : 0.f), bf16);
}

/* ---- scalar reference ------------------------------------------------------------------ */
static void panel_scalar(const int8_t *qx, const float *dx, int64_t Kb, int64_t rows,
                         const uint8_t *panel, float *res)
{
    for (int64_t r = 0; r < rows; r++) {
        float *acc = res + r * QP;
        memset(acc, 0, QP * sizeof(float));
        for (int64_t b = 0; b < Kb; b++) {
            const int8_t *xq = qx + r * Kb * QB + b * QB;
            const uint8_t *rec = panel + b * MX_REC;
            for (int o = 0; o < QP; o++) {
                int32_t dot = 0;
                for (int j = 0; j < 8; j++)
                    for (int t = 0; t < 4; t++) {
                        const uint8_t v = rec[64 * (j & 3) + 4 * o + t];
                        dot += E2M1_X2[j < 4 ? v & 0x0f : v >> 4] * xq[4 * j + t];
                    }
                acc[o] = fmaf((float)dot, e8m0_half(rec[256 + o]) * dx[r * Kb + b], acc[o]);
            }
        }
    }
}

#if defined(__AVX2__) && defined(__FMA__)
#define MX_AVX2 1
/* 8 outputs' scales 2^(e - 128) from their e8m0 bytes (e < 2: the subnormals, as ldexpf) */
static inline __m256 e8m0_half8(const uint8_t *e) {
    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)e));
    const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(v, _mm256_set1_epi32(1)), 23);
    const __m256i sub = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), v);
    const __m256i small = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), v);
    return _mm256_castsi256_ps(_mm256_blendv_epi8(normal, sub, small));
}

static inline __m256i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* a tile of rows against one panel, in two halves of 8 outputs; a block's 32 products of at
 * most 12 * 127, summed in int16 (pairs by vpmaddubsw, then 8 of those), stay under 2^15 */
static void tile_avx2(const int8_t *qx, const float *dx, int64_t Kb, int rows,
                      const uint8_t *panel, float *res)
{
    const __m128i t128 = _mm_loadu_si128((const __m128i *)E2M1_X2);
    const __m256i table = _mm256_broadcastsi128_si256(t128), low = _mm256_set1_epi8(0x0f);
    const __m256i ones = _mm256_set1_epi16(1);
    for (int h = 0; h < 2; h++) {
        __m256 acc[MX_TILE];
        for (int r = 0; r < rows; r++)
            acc[r] = _mm256_setzero_ps();
        for (int64_t b = 0; b < Kb; b++) {
            const uint8_t *rec = panel + b * MX_REC;
            __m256i w[8], a[8];
            for (int j = 0; j < 4; j++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(rec + 64 * j + 32 * h));
                w[j] = _mm256_shuffle_epi8(table, _mm256_and_si256(v, low));
                w[j + 4] = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(v, 4), low));
            }
            for (int j = 0; j < 8; j++)
                a[j] = _mm256_abs_epi8(w[j]);
            const __m256 s = e8m0_half8(rec + 256 + 8 * h);
            for (int r = 0; r < rows; r++) {
                const int8_t *xq = qx + r * Kb * QB + b * QB;
                __m256i s16 = _mm256_setzero_si256();
                for (int j = 0; j < 8; j++)
                    s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(a[j], _mm256_sign_epi8(bcast4(xq + 4 * j), w[j])));
                const __m256 scale = _mm256_mul_ps(s, _mm256_set1_ps(dx[r * Kb + b]));
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(s16, ones)), scale, acc[r]);
            }
        }
        for (int r = 0; r < rows; r++)
            _mm256_storeu_ps(res + r * QP + 8 * h, acc[r]);
    }
}
#endif

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define MX_VNNI 1
static inline __m512 e8m0_half16(const uint8_t *e) {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)e));
    return _mm512_scalef_ps(_mm512_set1_ps(1.f), _mm512_cvtepi32_ps(_mm512_sub_epi32(v, _mm512_set1_epi32(128))));
}

/* x + 128 as unsigned bytes (the unsigned operand of vpdpbusd), made once per call into this
 * pool thread's scratch; NULL: no memory */
static __thread struct { uint8_t *buf; size_t cap; } xu_scratch;

static const uint8_t *x_plus_128(const int8_t *qx, size_t n) {
    if (n > xu_scratch.cap) {
        free(xu_scratch.buf);
        xu_scratch.buf = malloc(n);
        xu_scratch.cap = xu_scratch.buf ? n : 0;
    }
    if (xu_scratch.buf)
        for (size_t i = 0; i < n; i++)
            xu_scratch.buf[i] = (uint8_t)(qx[i] ^ (int8_t)0x80);
    return xu_scratch.buf;
}

/* acc += the 4 unsigned bytes at p, broadcast, . b (signed): vpdpbusd's memory operand is its
 * signed one, so the broadcast is a register */
static inline __m512i dpbusd_bcast(__m512i acc, const uint8_t *p, __m512i b) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_dpbusd_epi32(acc, _mm512_set1_epi32(v), b);
}

static void tile_vnni(const uint8_t *xu, const float *dx, int64_t Kb, int rows,
                      const uint8_t *panel, float *res)
{
    const __m512i table = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)E2M1_X2));
    const __m512i low = _mm512_set1_epi8(0x0f), m128 = _mm512_set1_epi8((char)0x80);
    __m512 acc[MX_TILE];
    for (int r = 0; r < rows; r++)
        acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < Kb; b++) {
        const uint8_t *rec = panel + b * MX_REC;
        _mm_prefetch((const char *)rec + 4096, _MM_HINT_T0);
        _mm_prefetch((const char *)rec + 4096 + 64, _MM_HINT_T0);
        _mm_prefetch((const char *)rec + 4096 + 128, _MM_HINT_T0);
        _mm_prefetch((const char *)rec + 4096 + 192, _MM_HINT_T0);
        _mm_prefetch((const char *)rec + 4096 + 256, _MM_HINT_T0);
        __m512i w[8], c0 = _mm512_setzero_si512(), c1 = _mm512_setzero_si512();
        for (int j = 0; j < 4; j++) {
            const __m512i v = _mm512_loadu_si512(rec + 64 * j);
            w[j] = _mm512_shuffle_epi8(table, _mm512_and_si512(v, low));
            w[j + 4] = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
            c0 = _mm512_dpbusd_epi32(c0, m128, w[j]);     /* 128 * the weights' sum */
            c1 = _mm512_dpbusd_epi32(c1, m128, w[j + 4]);
        }
        const __m512i start = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_add_epi32(c0, c1));
        const __m512 s = e8m0_half16(rec + 256);
        for (int r = 0; r < rows; r++) {
            const uint8_t *xr = xu + r * Kb * QB + b * QB;
            __m512i s0 = start, s1 = _mm512_setzero_si512();
            for (int j = 0; j < 8; j += 2) {
                s0 = dpbusd_bcast(s0, xr + 4 * j, w[j]);
                s1 = dpbusd_bcast(s1, xr + 4 * j + 4, w[j + 1]);
            }
            const __m512 scale = _mm512_mul_ps(s, _mm512_set1_ps(dx[r * Kb + b]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)), scale, acc[r]);
        }
    }
    for (int r = 0; r < rows; r++)
        _mm512_storeu_ps(res + r * QP, acc[r]);
}
#endif

/* The paths this build has: bit 0 scalar, bit 1 AVX2, bit 2 AVX-512 VNNI (gemm_quant_isas'
 * bits; a build has both or neither of each). */
int64_t gemm_mxfp4_isas(void)
{
    int64_t isas = 1;
#ifdef MX_AVX2
    isas |= 2;
#endif
#ifdef MX_VNNI
    isas |= 4;
#endif
    return isas;
}

/* Panels [p_begin, p_end) of out[M, N] (bf16 or fp32, row stride out_stride) for all M rows of
 * the quantized activations qx [M, Kb * 32] with scales dx [M, Kb]; `bias` fp32 [N] or NULL.
 * Rows go in tiles of up to MX_TILE over one panel (its records stay in L1 between tiles). */
void gemm_mxfp4_panels(const int8_t *qx, const float *dx, int64_t Kb, int64_t M,
                       const uint8_t *packed, int64_t isa, const float *bias, void *out,
                       int64_t out_stride, int64_t N, int64_t out_bf16, int64_t p_begin,
                       int64_t p_end)
{
    const int64_t panel_bytes = Kb * MX_REC, Kp = Kb * QB;
    const uint8_t *xu = 0;
#ifdef MX_VNNI
    if (isa == 2 && !(xu = x_plus_128(qx, (size_t)(M * Kp))))
        isa = 0; /* no memory for x + 128: the scalar reference */
#endif
    (void)xu;
    for (int64_t p = p_begin; p < p_end; p++) {
        const int64_t n0 = p * QP, nv = N - n0 < QP ? N - n0 : QP;
        const uint8_t *panel = packed + p * panel_bytes;
        for (int64_t m0 = 0; m0 < M; m0 += MX_TILE) {
            const int rows = (int)(M - m0 < MX_TILE ? M - m0 : MX_TILE);
            float res[MX_TILE * QP];
#ifdef MX_VNNI
            if (isa == 2) {
                tile_vnni(xu + m0 * Kp, dx + m0 * Kb, Kb, rows, panel, res);
                finish(res, rows, bias, n0, nv, (char *)out + m0 * out_stride * (out_bf16 ? 2 : 4),
                       out_stride, (int)out_bf16);
                continue;
            }
#endif
#ifdef MX_AVX2
            if (isa == 1) {
                tile_avx2(qx + m0 * Kp, dx + m0 * Kb, Kb, rows, panel, res);
                finish(res, rows, bias, n0, nv, (char *)out + m0 * out_stride * (out_bf16 ? 2 : 4),
                       out_stride, (int)out_bf16);
                continue;
            }
#endif
            panel_scalar(qx + m0 * Kp, dx + m0 * Kb, Kb, rows, panel, res);
            finish(res, rows, bias, n0, nv, (char *)out + m0 * out_stride * (out_bf16 ? 2 : 4),
                   out_stride, (int)out_bf16);
        }
    }
}
