/* out = x @ w.T (+ bias) for quantized weights: 4-bit (GGUF Q4_0, Q4_1, Q4_K) and 8-bit
 * (GGUF Q8_0 and everything requantized to it; kvflow's int8 W8A8) against activations
 * quantized to int8 on the fly. The weights are never widened to floats.
 *
 * Weight layout (kvflow/model/quant/packing.py writes it): panels of QP = 16 outputs, each a
 * contiguous run of records, one per block of 32 inputs. In a record, 64-byte vectors hold
 * "quads": input k..k+3 of all 16 outputs, output o's four values in bytes 4o..4o+3, so one
 * broadcast of four activation bytes feeds 16 outputs with one `vpdpbusd` (or
 * `vpmaddubsw` + `vpmaddwd` on AVX2) and no horizontal sums.
 *   q4 record (320 B): 4 vectors, vector v holds quad v in its low nibbles and quad v + 4 in
 *       its high ones (values 0..15, unsigned); then fp16 scale d[16] and fp16 min m[16]:
 *       weight = d * q + m (Q4_0: m = -8 d; Q4_K: its sub-block's scale and min).
 *   q4s record (288 B): q4's 4 vectors and fp16 d[16], no min: weight = d * (q - 8) (GGUF
 *       Q4_0 as stored, 18 B per 32 weights).
 *   q8 record (544 B): 8 vectors of signed int8 (-128..127: GGUF's Q8_0 and kvflow's own
 *       stop at -127, compressed-tensors checkpoints reach -128), then fp16 scale d[16]: GGUF
 *       Q8_0's 34 B per 32 weights.
 * Q6_K has its own records and kernels (gemm_q6.c).
 *
 * Activations (quantize_rows_q8): per row and block of 32 inputs, int8 values in -127..127,
 * scale dx (x ~ dx * q) and dxs = dx * (sum of the block's q), which carries q4's min term:
 *   sum_k w_k x_k = sum_blocks dx * (d * sum(q_w q_x) + m * sum(q_x)).
 * `per_row` gives a whole row one scale (int8 W8A8's per-token scales). Offsets that a kind
 * implies (q4s's 8, and the 128 by which the VNNI path reads q8 weights as unsigned) come off
 * the integer sum as offset * (the block's sum of q_x), one number per row and block
 * (block_sums), so no record stores a per-output correction.
 *
 * Paths (chosen at load, passed as `isa`): 0 scalar (the tests' reference), 1 AVX2,
 * 2 AVX-512 VNNI. One row (batch-1 decode) has its own loop per path (gemv_*: the weights
 * streamed once, independent sums per block); more rows go in tiles (the unpacked block of
 * weights is reused by every row of the tile); threads split panels (few rows: each streams
 * its share of the weights) or rows (many rows). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "simd.h"

#define QP 16
#define QB 32
#define Q4_REC 320
#define Q8_REC 544
#define Q4S_REC 288
#define PANEL_BLOCK_BYTES (128 * 1024)
/* How far ahead (bytes) the one-row loops ask for the weights. The hardware prefetcher stops at
 * each 4 KiB page, so a row streaming a projection waited on DRAM at every page start (~26 GB/s
 * of ~38 one thread can read); asking 8 KiB ahead, one prefetch per cache line of each record,
 * keeps the stream going across pages (panels are contiguous: past a panel's end is the next
 * one). 2-4 KiB was too close to help, 16-32 KiB no better (benchmarks/quant_gemv_stream.py). */
#define GEMV_PREFETCH 8192

static inline float load_act(const void *x, int64_t i, int bf16) {
    if (bf16) {
        union { uint32_t u; float f; } v = { (uint32_t)((const uint16_t *)x)[i] << 16 };
        return v.f;
    }
    return ((const float *)x)[i];
}

/* One block of 32 activations -> int8 q, its scale and dx * sum(q), given its largest |x|:
 * the scalar rounding (and the reference for the vector ones below, which give the same
 * bytes: the same fp32 products, rounded to nearest even, clamped). */
static inline void quant_block_scalar(const float *vals, float amax, int8_t *q, float *d, float *ds)
{
    const float scale = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
    int sum = 0;
    for (int j = 0; j < QB; j++) {
        float v = nearbyintf(vals[j] * inv);
        v = v > 127.f ? 127.f : v < -127.f ? -127.f : v;
        q[j] = (int8_t)v;
        sum += (int)v;
    }
    *d = scale;
    *ds = scale * (float)sum;
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define QUANT_ACT_512 1
/* a whole block of 32 (k0 + 32 <= K); its scale from `row_amax` (the row's largest |x|, per-row
 * scales) or, when that is negative, from the block's own largest |x| */
static inline void quant_block_vec(const char *xr, int64_t k0, int bf16, float row_amax, int8_t *q,
                                   float *d, float *ds)
{
    __m512 v0, v1;
    if (bf16) {
        v0 = load16_bf16((const uint16_t *)xr + k0);
        v1 = load16_bf16((const uint16_t *)xr + k0 + 16);
    } else {
        v0 = _mm512_loadu_ps((const float *)xr + k0);
        v1 = _mm512_loadu_ps((const float *)xr + k0 + 16);
    }
    const float amax = row_amax >= 0.f ? row_amax
        : _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    const float scale = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
    const __m512 vinv = _mm512_set1_ps(inv);
    const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
    const __m512i i0 = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(v0, vinv)), lo), hi);
    const __m512i i1 = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(v1, vinv)), lo), hi);
    _mm_storeu_si128((__m128i *)q, _mm512_cvtepi32_epi8(i0));
    _mm_storeu_si128((__m128i *)(q + 16), _mm512_cvtepi32_epi8(i1));
    *d = scale;
    *ds = scale * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1));
}
#elif defined(__AVX2__) && defined(__FMA__)
#define QUANT_ACT_256 1
static inline float hmax8(__m256 a) {
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
    return _mm_cvtss_f32(m4);
}

static inline void quant_block_vec(const char *xr, int64_t k0, int bf16, float row_amax, int8_t *q,
                                   float *d, float *ds)
{
    __m256 v[4];
    for (int i = 0; i < 4; i++)
        v[i] = bf16 ? load8_bf16((const uint16_t *)xr + k0 + 8 * i)
                    : _mm256_loadu_ps((const float *)xr + k0 + 8 * i);
    const __m256 sign = _mm256_set1_ps(-0.f);
    const float amax = row_amax >= 0.f ? row_amax : hmax8(
        _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                      _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3]))));
    const float scale = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
    const __m256 vinv = _mm256_set1_ps(inv);
    const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
    __m256i iv[4], sum = _mm256_setzero_si256();
    for (int i = 0; i < 4; i++) {
        iv[i] = _mm256_min_epi32(_mm256_max_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v[i], vinv)), lo), hi);
        sum = _mm256_add_epi32(sum, iv[i]);
    }
    /* int32 -> int8 (all within -127..127): packs keep the order within 128-bit lanes */
    const __m256i w01 = _mm256_packs_epi32(iv[0], iv[1]), w23 = _mm256_packs_epi32(iv[2], iv[3]);
    const __m256i b = _mm256_packs_epi16(w01, w23);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(b, order));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
    *d = scale;
    *ds = scale * (float)_mm_cvtsi128_si32(s4);
}
#endif

/* The largest |x| of a row of K activations (a max: the same value in any order; a NaN is
 * passed over, as fmaxf does: the max takes its second operand when the first is NaN) */
static float row_abs_max(const char *xr, int64_t K, int bf16)
{
    int64_t k = 0;
    float amax = 0.f;
#if defined(QUANT_ACT_512)
    __m512 a = _mm512_setzero_ps();
    for (; k + 16 <= K; k += 16)
        a = _mm512_max_ps(_mm512_abs_ps(bf16 ? load16_bf16((const uint16_t *)xr + k)
                                             : _mm512_loadu_ps((const float *)xr + k)), a);
    amax = _mm512_reduce_max_ps(a);
#elif defined(QUANT_ACT_256)
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 a = _mm256_setzero_ps();
    for (; k + 8 <= K; k += 8)
        a = _mm256_max_ps(_mm256_andnot_ps(sign, bf16 ? load8_bf16((const uint16_t *)xr + k)
                                                       : _mm256_loadu_ps((const float *)xr + k)), a);
    amax = hmax8(a);
#endif
    for (; k < K; k++)
        amax = fmaxf(amax, fabsf(load_act(xr, k, bf16)));
    return amax;
}

/* Rows [begin, end) of x [M, K] (bf16 or fp32) -> qx [M, Kb * 32] int8, dx and dxs [M, Kb];
 * inputs past K are zeros. Whole blocks go through the vector code where the build has it,
 * with per-block scales or with the row's (int8 W8A8: its largest |x|, found in vector code
 * too), since prefill quantizes M x K values per projection. */
void quantize_rows_q8(const void *x, int64_t x_stride, int64_t K, int64_t Kb, int64_t bf16,
                      int64_t per_row, int8_t *qx, float *dx, float *dxs, int64_t begin,
                      int64_t end)
{
    const int64_t Kp = Kb * QB;
    for (int64_t r = begin; r < end; r++) {
        const char *xr = (const char *)x + r * x_stride * (bf16 ? 2 : 4);
        int8_t *q = qx + r * Kp;
        float *d = dx + r * Kb, *ds = dxs + r * Kb;
        const float row_amax = per_row ? row_abs_max(xr, K, (int)bf16) : -1.f;
        for (int64_t b = 0; b < Kb; b++) {
#if defined(QUANT_ACT_512) || defined(QUANT_ACT_256)
            if ((b + 1) * QB <= K) {
                quant_block_vec(xr, b * QB, (int)bf16, row_amax, q + b * QB, d + b, ds + b);
                continue;
            }
#endif
            float vals[QB];
            float amax = 0.f;
            for (int j = 0; j < QB; j++) {
                const int64_t k = b * QB + j;
                vals[j] = k < K ? load_act(xr, k, (int)bf16) : 0.f;
                amax = fmaxf(amax, fabsf(vals[j]));
            }
            quant_block_scalar(vals, per_row ? row_amax : amax, q + b * QB, d + b, ds + b);
        }
    }
}

static inline void store_out(void *out, int64_t i, float v, int bf16) {
    if (bf16) {
        union { float f; uint32_t u; } x = { v };
        uint16_t h;
        if ((x.u & 0x7fffffffu) > 0x7f800000u)
            h = (uint16_t)((x.u >> 16) | 0x40);
        else
            h = (uint16_t)((x.u + 0x7fffu + ((x.u >> 16) & 1u)) >> 16);
        ((uint16_t *)out)[i] = h;
    } else {
        ((float *)out)[i] = v;
    }
}

/* one panel's 16 sums for one row -> out (+ bias), masked to the outputs that exist */
static inline void finish_row(const float *acc, const float *bias, int64_t n0, int64_t nv,
                              void *out, int64_t row_off, int bf16)
{
    for (int64_t o = 0; o < nv; o++)
        store_out(out, row_off + n0 + o, acc[o] + (bias ? bias[n0 + o] : 0.f), bf16);
}

/* a tile of rows against one panel: its 16 sums per row into res; sx: the rows' block sums
 * (block_sums below) where the kind's path needs them */
typedef void (*qtile_fn)(const int8_t *, const float *, const float *, const int32_t *, int64_t,
                         const uint8_t *, float *);
/* one row against one panel (the decode loops), the same words */
typedef qtile_fn qgemv_fn;

/* the kinds of this file (kernels.h): their records' bytes and where d starts in one */
enum { KQ4 = 0, KQ8 = 1, KQ4S = 3 };
static inline int rec_bytes_of(int kind) { return kind == KQ8 ? Q8_REC : kind == KQ4S ? Q4S_REC : Q4_REC; }
static inline int d_offset(int kind) { return kind == KQ8 ? 512 : 256; }
/* the integer sum's start for a block whose activations sum to s: the q8 VNNI path multiplies
 * w + 128, q4s multiplies its stored q = w + 8; both take the offset times s back off */
static inline int32_t start_of(int kind, int32_t s) { return kind == KQ8 ? -128 * s : kind == KQ4S ? -8 * s : 0; }

/* ---- scalar reference ------------------------------------------------------------------ */
static void panel_scalar(const int8_t *qx, const float *dx, const float *dxs, int64_t Kb,
                         int64_t rows, const uint8_t *panel, int kind, const float *bias,
                         int64_t n0, int64_t nv, void *out, int64_t out_stride, int bf16)
{
    const int64_t Kp = Kb * QB;
    for (int64_t r = 0; r < rows; r++) {
        float acc[QP] = {0};
        for (int64_t b = 0; b < Kb; b++) {
            const int8_t *xq = qx + r * Kp + b * QB;
            const uint8_t *rec = panel + b * rec_bytes_of(kind);
            const uint16_t *d16 = (const uint16_t *)(rec + d_offset(kind));
            for (int o = 0; o < QP; o++) {
                int32_t dot = 0;
                for (int j = 0; j < 8; j++)
                    for (int t = 0; t < 4; t++) {
                        int w;
                        if (kind == KQ8)
                            w = (int8_t)rec[64 * j + 4 * o + t];
                        else
                            w = j < 4 ? rec[64 * j + 4 * o + t] & 0x0f : rec[64 * (j - 4) + 4 * o + t] >> 4;
                        if (kind == KQ4S)
                            w -= 8;
                        dot += w * xq[4 * j + t];
                    }
                acc[o] += dx[r * Kb + b] * f16_to_float(d16[o]) * (float)dot;
                if (kind == KQ4)
                    acc[o] += dxs[r * Kb + b] * f16_to_float(d16[QP + o]);
            }
        }
        finish_row(acc, bias, n0, nv, out, r * out_stride, bf16);
    }
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define QUANT_AVX2 1

/* one record's cache lines (a record's last line may be the next record's first) */
static inline void prefetch_record(const uint8_t *p, int rec_bytes) {
    for (int l = 0; l < rec_bytes; l += 64)
        _mm_prefetch((const char *)p + l, _MM_HINT_T0);
}

static inline __m256i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* AVX2: the panel in two halves of 8 outputs (bytes 0..31 and 32..63 of each vector) */
static inline __attribute__((always_inline)) void
tile_avx2(const int8_t *qx, const float *dx, const float *dxs, const int32_t *sx, int64_t Kb,
          int rows, const uint8_t *panel, int kind, __m256 acc[][2])
{
    const int64_t Kp = Kb * QB;
    const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(0x0f);
    for (int h = 0; h < 2; h++) {
        for (int64_t b = 0; b < Kb; b++) {
            const uint8_t *rec = panel + b * rec_bytes_of(kind);
            __m256i w[8];
            __m256 d, m = _mm256_setzero_ps();
            if (kind == KQ8) {
                for (int j = 0; j < 8; j++)
                    w[j] = _mm256_loadu_si256((const __m256i *)(rec + 64 * j + 32 * h));
            } else {
                for (int j = 0; j < 4; j++) {
                    __m256i v = _mm256_loadu_si256((const __m256i *)(rec + 64 * j + 32 * h));
                    w[j] = _mm256_and_si256(v, low);
                    w[j + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                }
                if (kind == KQ4)
                    m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + 288 + 16 * h)));
            }
            d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + d_offset(kind) + 16 * h)));
            for (int r = 0; r < rows; r++) {
                const int8_t *xq = qx + r * Kp + b * QB;
                __m256i sum;
                if (kind == KQ8) { /* |w| * (x with w's sign): |w| <= 128 (a checkpoint's -128
                                    * too) and |x| <= 127, so a pair stays under 2^15 */
                    sum = _mm256_setzero_si256();
                    for (int j = 0; j < 8; j++) {
                        const __m256i xb = bcast4(xq + 4 * j);
                        const __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(w[j]), _mm256_sign_epi8(xb, w[j]));
                        sum = _mm256_add_epi32(sum, _mm256_madd_epi16(p, ones));
                    }
                } else { /* 8 pairs of 15 * 127 stay under 2^15 in int16 */
                    __m256i s16 = _mm256_maddubs_epi16(w[0], bcast4(xq));
                    for (int j = 1; j < 8; j++)
                        s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(w[j], bcast4(xq + 4 * j)));
                    sum = _mm256_madd_epi16(s16, ones);
                    if (kind == KQ4S)
                        sum = _mm256_add_epi32(sum, _mm256_set1_epi32(start_of(kind, sx[r * Kb + b])));
                }
                const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(dx[r * Kb + b]));
                acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), scale, acc[r][h]);
                if (kind == KQ4)
                    acc[r][h] = _mm256_fmadd_ps(m, _mm256_set1_ps(dxs[r * Kb + b]), acc[r][h]);
            }
        }
    }
}

#define AVX2_TILE 4
#define AVX2_FN(R, Q) static void avx2_##R##_##Q(const int8_t *qx, const float *dx,            \
        const float *dxs, const int32_t *sx, int64_t Kb, const uint8_t *panel, float *res) {   \
    __m256 acc[R][2];                                                                         \
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();                  \
    tile_avx2(qx, dx, dxs, sx, Kb, R, panel, Q, acc);                                         \
    for (int r = 0; r < R; r++) {                                                             \
        _mm256_storeu_ps(res + r * QP, acc[r][0]);                                            \
        _mm256_storeu_ps(res + r * QP + 8, acc[r][1]); } }
AVX2_FN(1, 0) AVX2_FN(2, 0) AVX2_FN(3, 0) AVX2_FN(4, 0)
AVX2_FN(1, 1) AVX2_FN(2, 1) AVX2_FN(3, 1) AVX2_FN(4, 1)
AVX2_FN(1, 3) AVX2_FN(2, 3) AVX2_FN(3, 3) AVX2_FN(4, 3)
static const qtile_fn AVX2_TILES[3][AVX2_TILE + 1] = {
    {0, avx2_1_0, avx2_2_0, avx2_3_0, avx2_4_0}, {0, avx2_1_1, avx2_2_1, avx2_3_1, avx2_4_1},
    {0, avx2_1_3, avx2_2_3, avx2_3_3, avx2_4_3}};

/* AVX2, one row (decode): each record read once, both halves of the panel from it, and the
 * integer sums kept in separate chains (low and high quads) so that consecutive blocks'
 * integer work overlaps. The float sums are the tile loop's, in its order (weights, then mins,
 * block after block, one accumulator): a row's numbers do not depend on how many rows share
 * its batch, so greedy tokens stay the same alone, batched or verifying drafts. */
static inline __attribute__((always_inline)) void
gemv_avx2_block(const uint8_t *rec, const int8_t *xq, float dxb, float dxsb, int32_t sxb, int kind,
                __m256 acc[2])
{
    const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(0x0f);
    const __m256 vdx = _mm256_set1_ps(dxb);
    for (int h = 0; h < 2; h++) {
        __m256i sum;
        if (kind == KQ8) {
            /* |w| * (x with w's sign), as tile_avx2: a checkpoint's -128 weights too */
            __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
            for (int j = 0; j < 8; j += 2) {
                const __m256i w0 = _mm256_loadu_si256((const __m256i *)(rec + 64 * j + 32 * h));
                const __m256i w1 = _mm256_loadu_si256((const __m256i *)(rec + 64 * j + 64 + 32 * h));
                const __m256i x0 = bcast4(xq + 4 * j), x1 = bcast4(xq + 4 * j + 4);
                s0 = _mm256_add_epi32(s0, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w0), _mm256_sign_epi8(x0, w0)), ones));
                s1 = _mm256_add_epi32(s1, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w1), _mm256_sign_epi8(x1, w1)), ones));
            }
            sum = _mm256_add_epi32(s0, s1);
        } else {
            __m256i lo = _mm256_setzero_si256(), hi = _mm256_setzero_si256();
            for (int j = 0; j < 4; j++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(rec + 64 * j + 32 * h));
                lo = _mm256_add_epi16(lo, _mm256_maddubs_epi16(_mm256_and_si256(v, low), bcast4(xq + 4 * j)));
                hi = _mm256_add_epi16(hi, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 4), low),
                                                               bcast4(xq + 16 + 4 * j)));
            }
            sum = _mm256_add_epi32(_mm256_madd_epi16(lo, ones), _mm256_madd_epi16(hi, ones));
            if (kind == KQ4S)
                sum = _mm256_add_epi32(sum, _mm256_set1_epi32(start_of(kind, sxb)));
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + d_offset(kind) + 16 * h)));
        acc[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(d, vdx), acc[h]);
        if (kind == KQ4) {
            const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + 288 + 16 * h)));
            acc[h] = _mm256_fmadd_ps(m, _mm256_set1_ps(dxsb), acc[h]);
        }
    }
}

static void gemv_avx2(const int8_t *qx, const float *dx, const float *dxs, const int32_t *sx,
                      int64_t Kb, const uint8_t *panel, int kind, float *res)
{
    const int rec_bytes = rec_bytes_of(kind);
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t b = 0; b < Kb; b++) {
        prefetch_record(panel + b * rec_bytes + GEMV_PREFETCH, rec_bytes);
        gemv_avx2_block(panel + b * rec_bytes, qx + b * QB, dx[b], dxs[b], sx ? sx[b] : 0, kind, acc);
    }
    for (int h = 0; h < 2; h++)
        _mm256_storeu_ps(res + 8 * h, acc[h]);
}
/* the kinds' three tile tables and gemv calls, one code each */
#define AVX2_GEMV(K) static void gemv_avx2_##K(const int8_t *qx, const float *dx, const float *dxs, \
        const int32_t *sx, int64_t Kb, const uint8_t *panel, float *res) {                          \
    gemv_avx2(qx, dx, dxs, sx, Kb, panel, K, res); }
AVX2_GEMV(0) AVX2_GEMV(1) AVX2_GEMV(3)
static const qgemv_fn AVX2_GEMVS[3] = {gemv_avx2_0, gemv_avx2_1, gemv_avx2_3};
#endif

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define QUANT_VNNI 1

/* acc += a (unsigned bytes) . the 4 signed bytes at p, broadcast to every lane: the broadcast
 * folded into the instruction ({1to16}), which gcc does not do for _mm512_set1_epi32 of a
 * load; a separate vpbroadcastd took a vector slot per vpdpbusd */
static inline __m512i dpbusd_bcast(__m512i acc, __m512i a, const int8_t *p) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(a), "m"(*(const int32_t *)p));
    return acc;
}

/* `vpdpbusd` takes its first operand unsigned: a q8 weight w is read as w + 128 (its sign bit
 * flipped), against the signed activations, and the block's integer sum starts from
 * -128 * (the activations' sum), so no per-weight correction is stored. */
static inline __m512i unsigned_q8(const uint8_t *p) {
    return _mm512_xor_si512(_mm512_loadu_si512(p), _mm512_set1_epi8((char)0x80));
}

static inline __attribute__((always_inline)) void
tile_vnni(const int8_t *qx, const float *dx, const float *dxs, const int32_t *sx, int64_t Kb,
          int rows, const uint8_t *panel, int kind, __m512 *acc)
{
    const int64_t Kp = Kb * QB;
    const __m512i low = _mm512_set1_epi8(0x0f);
    const int rec_bytes = rec_bytes_of(kind);
    for (int64_t b = 0; b < Kb; b++) {
        const uint8_t *rec = panel + b * rec_bytes;
        __m512i w[8];
        __m512 m = _mm512_setzero_ps();
        if (kind == KQ8) {
            for (int j = 0; j < 8; j++)
                w[j] = unsigned_q8(rec + 64 * j);
        } else {
            for (int j = 0; j < 4; j++) {
                __m512i v = _mm512_loadu_si512(rec + 64 * j);
                w[j] = _mm512_and_si512(v, low);
                w[j + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            }
            if (kind == KQ4)
                m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rec + 288)));
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rec + d_offset(kind))));
#pragma GCC unroll 8
        for (int r = 0; r < rows; r++) {
            const int8_t *xq = qx + r * Kp + b * QB;
            __m512i sum = kind == KQ4 ? _mm512_setzero_si512() : _mm512_set1_epi32(start_of(kind, sx[r * Kb + b]));
            for (int j = 0; j < 8; j++)
                sum = dpbusd_bcast(sum, w[j], xq + 4 * j);
            const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(dx[r * Kb + b]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), scale, acc[r]);
            if (kind == KQ4)
                acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(dxs[r * Kb + b]), acc[r]);
        }
    }
}

#define VNNI_TILE 8
#define VNNI_FN(R, Q) static void vnni_##R##_##Q(const int8_t *qx, const float *dx,            \
        const float *dxs, const int32_t *sx, int64_t Kb, const uint8_t *panel, float *res) {   \
    __m512 acc[R];                                                                            \
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();                                 \
    tile_vnni(qx, dx, dxs, sx, Kb, R, panel, Q, acc);                                         \
    for (int r = 0; r < R; r++) _mm512_storeu_ps(res + r * QP, acc[r]); }
VNNI_FN(1, 0) VNNI_FN(2, 0) VNNI_FN(3, 0) VNNI_FN(4, 0) VNNI_FN(5, 0) VNNI_FN(6, 0) VNNI_FN(7, 0) VNNI_FN(8, 0)
VNNI_FN(1, 1) VNNI_FN(2, 1) VNNI_FN(3, 1) VNNI_FN(4, 1) VNNI_FN(5, 1) VNNI_FN(6, 1) VNNI_FN(7, 1) VNNI_FN(8, 1)
VNNI_FN(1, 3) VNNI_FN(2, 3) VNNI_FN(3, 3) VNNI_FN(4, 3) VNNI_FN(5, 3) VNNI_FN(6, 3) VNNI_FN(7, 3) VNNI_FN(8, 3)
static const qtile_fn VNNI_TILES[3][VNNI_TILE + 1] = {
    {0, vnni_1_0, vnni_2_0, vnni_3_0, vnni_4_0, vnni_5_0, vnni_6_0, vnni_7_0, vnni_8_0},
    {0, vnni_1_1, vnni_2_1, vnni_3_1, vnni_4_1, vnni_5_1, vnni_6_1, vnni_7_1, vnni_8_1},
    {0, vnni_1_3, vnni_2_3, vnni_3_3, vnni_4_3, vnni_5_3, vnni_6_3, vnni_7_3, vnni_8_3}};

/* AVX-512 VNNI, one row (decode): the same records, streamed with more independent work per
 * block. A 4-bit record's high nibbles are masked in place (v & 0xf0: 16x the value, still
 * exact in int32) and summed in their own chain, shifted down once; q8 sums even and odd quads
 * apart: the tile loop's one chain of 8 `vpdpbusd` per block made each block wait on the
 * last. The float sums stay the tile loop's, in its order (see gemv_avx2_block): a row's
 * numbers do not depend on its batch. */
static inline __attribute__((always_inline)) void
gemv_vnni_block(const uint8_t *rec, const int8_t *xq, float dxb, float dxsb, int32_t sxb, int kind,
                __m512 *acc)
{
    __m512i sum;
    if (kind == KQ8) {
        __m512i s0 = _mm512_set1_epi32(start_of(kind, sxb)), s1 = _mm512_setzero_si512();
        for (int j = 0; j < 8; j += 2) {
            s0 = dpbusd_bcast(s0, unsigned_q8(rec + 64 * j), xq + 4 * j);
            s1 = dpbusd_bcast(s1, unsigned_q8(rec + 64 * j + 64), xq + 4 * j + 4);
        }
        sum = _mm512_add_epi32(s0, s1);
    } else {
        const __m512i low = _mm512_set1_epi8(0x0f), high = _mm512_set1_epi8((char)0xf0);
        __m512i lo = _mm512_set1_epi32(start_of(kind, sxb)), hi = _mm512_setzero_si512();
        for (int j = 0; j < 4; j++) {
            const __m512i v = _mm512_loadu_si512(rec + 64 * j);
            lo = dpbusd_bcast(lo, _mm512_and_si512(v, low), xq + 4 * j);
            hi = dpbusd_bcast(hi, _mm512_and_si512(v, high), xq + 16 + 4 * j);
        }
        sum = _mm512_add_epi32(lo, _mm512_srai_epi32(hi, 4));
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rec + d_offset(kind))));
    *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(d, _mm512_set1_ps(dxb)), *acc);
    if (kind == KQ4) {
        const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rec + 288)));
        *acc = _mm512_fmadd_ps(m, _mm512_set1_ps(dxsb), *acc);
    }
}

static inline __attribute__((always_inline)) void
gemv_vnni(const int8_t *qx, const float *dx, const float *dxs, const int32_t *sx, int64_t Kb,
          const uint8_t *panel, int kind, float *res)
{
    const int rec_bytes = rec_bytes_of(kind);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t b = 0; b < Kb; b++) {
        prefetch_record(panel + b * rec_bytes + GEMV_PREFETCH, rec_bytes);
        gemv_vnni_block(panel + b * rec_bytes, qx + b * QB, dx[b], dxs[b], sx ? sx[b] : 0, kind, &acc);
    }
    _mm512_storeu_ps(res, acc);
}
#define VNNI_GEMV(K) static void gemv_vnni_##K(const int8_t *qx, const float *dx, const float *dxs, \
        const int32_t *sx, int64_t Kb, const uint8_t *panel, float *res) {                          \
    gemv_vnni(qx, dx, dxs, sx, Kb, panel, K, res); }
VNNI_GEMV(0) VNNI_GEMV(1) VNNI_GEMV(3)
static const qgemv_fn VNNI_GEMVS[3] = {gemv_vnni_0, gemv_vnni_1, gemv_vnni_3};
#endif

/* finish_row for a whole panel in vector code (a wide, shallow projection like an LM head
 * spends as long storing its outputs one by one as multiplying them): the same numbers,
 * rounded to bf16 to nearest even as store_out does. */
static inline void finish_row16(const float *acc, const float *bias, int64_t n0, void *out,
                                int64_t row_off, int bf16)
{
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    __m512 v = _mm512_loadu_ps(acc);
    if (bias)
        v = _mm512_add_ps(v, _mm512_loadu_ps(bias + n0));
    if (bf16)
        _mm256_storeu_si256((__m256i *)((uint16_t *)out + row_off + n0), (__m256i)_mm512_cvtneps_pbh(v));
    else
        _mm512_storeu_ps((float *)out + row_off + n0, v);
#elif defined(QUANT_AVX2)
    for (int h = 0; h < 2; h++) {
        __m256 v = _mm256_loadu_ps(acc + 8 * h);
        if (bias)
            v = _mm256_add_ps(v, _mm256_loadu_ps(bias + n0 + 8 * h));
        if (!bf16) {
            _mm256_storeu_ps((float *)out + row_off + n0 + 8 * h, v);
            continue;
        }
        const __m256i u = _mm256_castps_si256(v);
        const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
        __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd)), 16);
        const __m256i nan = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
        r = _mm256_blendv_epi8(r, nan, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
        const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
        _mm_storeu_si128((__m128i *)((uint16_t *)out + row_off + n0 + 8 * h), _mm256_castsi256_si128(packed));
    }
#else
    finish_row(acc, bias, n0, QP, out, row_off, bf16);
#endif
}

/* The paths this build has: bit 0 scalar, bit 1 AVX2, bit 2 AVX-512 VNNI. */
int64_t gemm_quant_isas(void)
{
    int64_t isas = 1;
#ifdef QUANT_AVX2
    isas |= 2;
#endif
#ifdef QUANT_VNNI
    isas |= 4;
#endif
    return isas;
}

/* The activations' integer sum per block of 32 (M * Kb of them), which the q8 VNNI path and
 * q4s take back off (start_of), made once per call into this pool thread's scratch of the
 * largest size it has seen; NULL: no memory */
static __thread struct { int32_t *buf; size_t cap; } sx_scratch;

static const int32_t *block_sums(const int8_t *qx, size_t blocks) {
    if (blocks > sx_scratch.cap) {
        free(sx_scratch.buf);
        sx_scratch.buf = malloc(blocks * sizeof(int32_t));
        sx_scratch.cap = sx_scratch.buf ? blocks : 0;
    }
    if (sx_scratch.buf)
        for (size_t i = 0; i < blocks; i++) {
            int32_t s = 0;
            for (int j = 0; j < QB; j++)
                s += qx[i * QB + j];
            sx_scratch.buf[i] = s;
        }
    return sx_scratch.buf;
}

/* Panels [p_begin, p_end) of out[M, N] (bf16 or fp32, row stride out_stride) for all M rows of
 * the quantized activations; `kind` 0: q4, 1: q8, 3: q4s; `bias` fp32 [N] or NULL. */
void gemm_quant_panels(const int8_t *qx, const float *dx, const float *dxs, int64_t Kb,
                       int64_t M, const uint8_t *packed, int64_t kind, int64_t isa,
                       const float *bias, void *out, int64_t out_stride, int64_t N,
                       int64_t out_bf16, int64_t p_begin, int64_t p_end)
{
    const int k = (int)kind, slot = k == KQ4S ? 2 : k, bf16 = (int)out_bf16;
    (void)slot; /* a build without vector paths */
    const int64_t panel_bytes = Kb * rec_bytes_of(k), Kp = Kb * QB;
    int max_tile = 1;
    const qtile_fn *tiles = 0;
    qgemv_fn gemv = 0;
    const int32_t *sx = 0;
#ifdef QUANT_AVX2
    if (isa == 1) { tiles = AVX2_TILES[slot]; gemv = AVX2_GEMVS[slot]; max_tile = AVX2_TILE; }
#endif
#ifdef QUANT_VNNI
    if (isa == 2) { tiles = VNNI_TILES[slot]; gemv = VNNI_GEMVS[slot]; max_tile = VNNI_TILE; }
#endif
    if (tiles && (k == KQ4S || (k == KQ8 && isa == 2)) && !(sx = block_sums(qx, (size_t)(M * Kb))))
        tiles = 0; /* no memory for the sums: the scalar reference */
    if (tiles == 0) {
        for (int64_t p = p_begin; p < p_end; p++) {
            const int64_t n0 = p * QP, nv = N - n0 < QP ? N - n0 : QP;
            panel_scalar(qx, dx, dxs, Kb, M, packed + p * panel_bytes, k, bias, n0, nv, out,
                         out_stride, bf16);
        }
        return;
    }
    if (M == 1) { /* decode: one row, its own loop */
        for (int64_t p = p_begin; p < p_end; p++) {
            const int64_t n0 = p * QP, nv = N - n0 < QP ? N - n0 : QP;
            float res[QP];
            gemv(qx, dx, dxs, sx, Kb, packed + p * panel_bytes, res);
            if (nv == QP)
                finish_row16(res, bias, n0, out, 0, bf16);
            else
                finish_row(res, bias, n0, nv, out, 0, bf16);
        }
        return;
    }
    /* Panels go in blocks of about PANEL_BLOCK_BYTES (kept in L2), and each tile of rows runs
     * over a whole block before the next tile: a row's outputs are then written a block-width
     * run at a time. Output rows a multiple of 4 KiB apart (an LM head: 49152 bf16 logits) put
     * every row's stores in one set of the 8-way L1: panel by panel, two tiles of 8 rows took
     * 3.3x one tile's time; and past 4 rows a tile's stores and the weight records it streams
     * still evicted each other (the default model's LM head: 3.8 ms at 5 rows, 8.2 at 8, 1.5 at
     * 4; one thread, Zen 4), so there tiles take at most 4 rows and reread the block from L2. */
    const int64_t block = panel_bytes >= PANEL_BLOCK_BYTES ? 1 : PANEL_BLOCK_BYTES / panel_bytes;
    if ((out_stride * (bf16 ? 2 : 4)) % 4096 == 0 && max_tile > 4)
        max_tile = 4;
    const int64_t ntiles = (M + max_tile - 1) / max_tile;
    for (int64_t p0 = p_begin; p0 < p_end; p0 += block) {
        const int64_t p1 = p0 + block < p_end ? p0 + block : p_end;
        for (int64_t t = 0, m0 = 0; t < ntiles; t++) {
            const int64_t rows = (M - m0) / (ntiles - t);
            for (int64_t p = p0; p < p1; p++) {
                const int64_t n0 = p * QP, nv = N - n0 < QP ? N - n0 : QP;
                float res[16 * QP];
                tiles[rows](qx + m0 * Kp, dx + m0 * Kb, dxs + m0 * Kb, sx ? sx + m0 * Kb : 0, Kb, packed + p * panel_bytes, res);
                for (int64_t r = 0; r < rows; r++) {
                    if (nv == QP)
                        finish_row16(res + r * QP, bias, n0, out, (m0 + r) * out_stride, bf16);
                    else
                        finish_row(res + r * QP, bias, n0, nv, out, (m0 + r) * out_stride, bf16);
                }
            }
            m0 += rows;
        }
    }
}
