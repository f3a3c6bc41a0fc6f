/* Decode attention and the KV write over a one-byte KV cache (the `kv_cache_dtype` fp8 and
 * int8; kvflow/attention/kv_layout.py says how they are stored). Same tiles as tiles.h, one byte
 * a value:
 *   fp8 (kind 1):  e4m3 values, one per-tensor scale for K and one for V (k_scale, v_scale);
 *   int8 (kind 0): a (block, kv head) is bs * D int8 values, then bs fp32 scales, one per token
 *                  (absmax / 127 of that token's row), so a tile is bs * (D + 4) bytes.
 * Values are widened in registers as they are read, never written back out in a wider dtype:
 * scores[t] = scale * s_k(t) * <q, K8(t)>, out = sum_t p(t) * s_v(t) * V8(t) / sum_t p(t), the
 * per-token scales applied once per key (to the score, to the weight) rather than per value.
 *
 * Four paths, chosen by the caller (kvflow/model/kernels.py picks the widest this CPU has):
 * isa 0 a scalar reference (any shape), isa 1 AVX2 (8 lanes; bs % 8 == 0, D % 16 == 0),
 * isa 2 AVX-512 (16 lanes; bs % 16 == 0, D % 16 == 0), isa 3 AVX512-BF16 (fp8 only, AVX-512's
 * shapes; int8 runs the AVX-512 row there). fp8 is widened through fp16 bits (F16C's
 * vcvtph2ps, exact): e4m3 s.eeee.mmm -> fp16 s.0eeee.mmm0000000 is the value / 256, the 256
 * folded into the scales; the AVX512-BF16 row looks the same value / 256 up as bf16 and
 * multiplies by bf16 queries and weights (vdpbf16ps). q is fp32 or bf16, out fp32 or bf16, as paged_decode_*.
 * An fp8 cache whose D is a power of two holds rotated keys and values (rotation.h): the
 * kernel rotates each query head on entry and each output head back at the end, in fp32. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "kernels.h"
#include "rotation.h"
#include "simd.h"
#include "tiles.h"

enum { KV_INT8 = 0, KV_FP8 = 1 };
enum { ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_AVX512 = 2, ISA_AVX512_BF16 = 3 };

/* e4m3fn -> fp32, exact (0x7f/0xff are NaN) */
static inline float fp8_to_float(uint8_t b) {
    const uint32_t e = (b >> 3) & 15, m = b & 7;
    union { uint32_t u; float f; } x;
    if (e == 15 && m == 7) x.f = NAN;
    else if (e == 0) x.f = (float)m * 0x1p-9f;
    else x.u = ((e + 120) << 23) | (m << 20);
    return b & 0x80 ? -x.f : x.f;
}

/* fp32 -> e4m3fn, rounding to nearest even, saturating at +-448 (as torch's clamp then .to) */
static inline uint8_t float_to_fp8(float f) {
    union { float f; uint32_t u; } x = { f };
    const uint8_t sign = (uint8_t)((x.u >> 24) & 0x80);
    x.u &= 0x7fffffffu;
    if (x.u > 0x7f800000u) return sign | 0x7f; /* NaN */
    if (x.f >= 448.f) return sign | 0x7e;
    if (x.f < 0x1p-6f) /* subnormal: multiples of 2^-9 (8 of them round up to the first normal) */
        return sign | (uint8_t)nearbyintf(x.f * 512.f);
    /* keep 3 mantissa bits, nearest even; a carry into the exponent is the right answer */
    uint32_t u = x.u + 0x7ffffu + ((x.u >> 20) & 1u);
    u &= ~0xfffffu;
    const int e = (int)(u >> 23) - 127 + 7;
    return sign | (uint8_t)((e << 3) | ((u >> 20) & 7));
}

/* K (or V) value (t, d) of a tile, dequantized without its scale */
static inline float q8_at(const uint8_t *tile, int64_t i, int kind) {
    return kind == KV_FP8 ? fp8_to_float(tile[i]) : (float)(int8_t)tile[i];
}

/* the token scales of an int8 tile (after its bs * D values) */
static inline const float *tile_scales(const uint8_t *tile, int64_t bs, int64_t D) {
    return (const float *)(tile + bs * D);
}

typedef struct {
    const uint8_t *k_cache, *v_cache;
    int64_t H, KVH, D, bs, tile; /* tile: bytes of one (block, kv head) */
    int kind;
    float k_scale, v_scale;      /* fp8's per-tensor scales */
    const float *sinks;          /* [H] each head's attention sink, or NULL (simd.h's sink_of) */
} q8_geom;

/* Scalar reference: one value at a time. */
static void row_scalar(const q8_geom *g, const float *q, const int64_t *table, int64_t L,
                       int64_t skip, float scale, float *scores, int64_t Ls, float *out) {
    const int64_t G = g->H / g->KVH, D = g->D, bs = g->bs;
    for (int64_t h = 0; h < g->H; h++) {
        const float *qh = q + h * D;
        for (int64_t t = 0; t < L; t++) {
            const uint8_t *k = g->k_cache + (table[t / bs] * g->KVH + h / G) * g->tile;
            float s = 0.f;
            for (int64_t d = 0; d < D; d++) s += qh[d] * q8_at(k, k_tile_at(t % bs, d, bs), g->kind);
            const float ks = g->kind == KV_FP8 ? g->k_scale : tile_scales(k, bs, D)[t % bs];
            scores[h * Ls + t] = t < skip ? -INFINITY : s * scale * ks;
        }
        const float inv = softmax_unnormalised(scores + h * Ls, L, sink_of(g->sinks, h));
        float *a = out + h * D;
        memset(a, 0, sizeof(float) * (size_t)D);
        for (int64_t t = 0; t < L; t++) {
            const uint8_t *v = g->v_cache + (table[t / bs] * g->KVH + h / G) * g->tile;
            const float vs = g->kind == KV_FP8 ? g->v_scale : tile_scales(v, bs, D)[t % bs];
            const float p = scores[h * Ls + t] * vs;
            for (int64_t d = 0; d < D; d++) a[d] += p * q8_at(v, v_tile_at(t % bs, d, D), g->kind);
        }
        for (int64_t d = 0; d < D; d++) a[d] *= inv;
    }
}

/* The weights of one block's n keys for the value pass: p(t) * s_v(t) (int8) or p(t) (fp8,
 * whose v_scale multiplies the output), zero past n (pairs of keys are read together). */
static inline void block_weights(const q8_geom *g, const float *p, const uint8_t *v, int64_t n,
                                 float *w) {
    if (g->kind == KV_INT8) {
        const float *vs = tile_scales(v, g->bs, g->D);
        for (int64_t t = 0; t < n; t++) w[t] = p[t] * vs[t];
    } else {
        memcpy(w, p, sizeof(float) * (size_t)n);
    }
    for (int64_t t = n; t < g->bs; t++) w[t] = 0.f;
}

#if defined(KVFLOW_AVX2) && defined(__F16C__)
#define HAVE_AVX2_Q8 1
/* 8 bytes -> 8 floats: int8 as integers, fp8 as value / 256 */
static inline __m256 widen8_q8(const uint8_t *p, int kind) {
    const __m128i b = _mm_loadl_epi64((const __m128i *)p);
    if (kind == KV_INT8) return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    /* bits s.eeee.mmm at 14..7, then s carried from bit 14 up to 15 */
    const __m128i a = _mm_slli_epi16(_mm_cvtepu8_epi16(b), 7);
    return _mm256_cvtph_ps(_mm_add_epi16(a, _mm_and_si128(a, _mm_set1_epi16(0x4000))));
}

/* 8 lanes (a: 4 items x (even, odd) halves, then b: the next 4) -> the 8 items' sums, in order */
static inline __m256 pair_sums8_q8(__m256 a, __m256 b) {
    const __m256 h = _mm256_hadd_ps(a, b); /* items 0 1 4 5 2 3 6 7 */
    return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(h), 0xD8));
}

/* AVX2, for GN (a literal, <= 4) query heads h0.. of one kv head: each tile is widened once for
 * all of them. Scores of 8 keys per pass (two loads of 4 keys x 2 dims per dim pair); values 4
 * dims x 2 keys per load, by each head's broadcast pair of weights. */
static inline __attribute__((always_inline)) void scores8_group(
        const q8_geom *g, const float *q, const uint8_t *k, int64_t n, const float *ks,
        float *scores, int64_t Ls, int64_t b0, int64_t h0, const int GN) {
    const int64_t D = g->D, bs = g->bs;
    const int kind = g->kind;
    for (int64_t t = 0; t < n; t += 8) {
        __m256 lo[4], hi[4];
        for (int i = 0; i < GN; i++) lo[i] = hi[i] = _mm256_setzero_ps();
        for (int64_t c = 0; c < D / 2; c++) {
            const uint8_t *kc = k + (c * bs + t) * 2;
            const __m256 x0 = widen8_q8(kc, kind), x1 = widen8_q8(kc + 8, kind);
            for (int i = 0; i < GN; i++) {
                const __m256 qq = _mm256_castpd_ps(_mm256_broadcast_sd((const double *)(q + (h0 + i) * D + 2 * c)));
                lo[i] = _mm256_fmadd_ps(qq, x0, lo[i]);
                hi[i] = _mm256_fmadd_ps(qq, x1, hi[i]);
            }
        }
        for (int i = 0; i < GN; i++) {
            float tmp[8];
            _mm256_storeu_ps(tmp, _mm256_mul_ps(pair_sums8_q8(lo[i], hi[i]), _mm256_loadu_ps(ks + t)));
            memcpy(scores + (h0 + i) * Ls + b0 + t, tmp, sizeof(float) * (size_t)(n - t < 8 ? n - t : 8));
        }
    }
}

static inline __attribute__((always_inline)) void values8_group(
        const q8_geom *g, const uint8_t *v, int64_t n, const float *w, int64_t wstride,
        float *out, int64_t h0, const int GN) {
    const int64_t D = g->D;
    const int kind = g->kind;
    const __m256 even = _mm256_castsi256_ps(_mm256_set1_epi64x(0xFFFFFFFF));
    for (int64_t d0 = 0; d0 < D; d0 += 8) {
        __m256 a0[4], a1[4];
        for (int i = 0; i < GN; i++) a0[i] = a1[i] = _mm256_setzero_ps();
        for (int64_t j = 0; 2 * j < n; j++) {
            const uint8_t *vj = v + (j * D + d0) * 2;
            __m256 x0 = widen8_q8(vj, kind), x1 = widen8_q8(vj + 8, kind);
            if (2 * j + 1 == n) { /* no key past n */
                x0 = _mm256_and_ps(x0, even);
                x1 = _mm256_and_ps(x1, even);
            }
            for (int i = 0; i < GN; i++) {
                const __m256 ww = _mm256_castpd_ps(_mm256_broadcast_sd((const double *)(w + i * wstride + 2 * j)));
                a0[i] = _mm256_fmadd_ps(ww, x0, a0[i]);
                a1[i] = _mm256_fmadd_ps(ww, x1, a1[i]);
            }
        }
        for (int i = 0; i < GN; i++) {
            float *o = out + (h0 + i) * D + d0;
            _mm256_storeu_ps(o, _mm256_add_ps(_mm256_loadu_ps(o), pair_sums8_q8(a0[i], a1[i])));
        }
    }
}

/* The row over GN-head groups (AVX2 or AVX-512: SCORES and VALUES are its group functions). */
#define DEFINE_GROUPED_ROW(NAME, SCORES, VALUES)                                               \
static void NAME(const q8_geom *g, const float *q, const int64_t *table, int64_t L,            \
                 int64_t skip, float scale, float *scores, int64_t Ls, float *out) {           \
    const int64_t G = g->H / g->KVH, D = g->D, bs = g->bs, nb = (L + bs - 1) / bs;            \
    const int kind = g->kind;                                                                  \
    const float unit = kind == KV_FP8 ? 256.f : 1.f; /* the widened fp8 is value / 256 */     \
    for (int64_t b = 0; b < nb; b++) {                                                         \
        const int64_t b0 = b * bs, n = L - b0 < bs ? L - b0 : bs;                              \
        for (int64_t kh = 0; kh < g->KVH; kh++) {                                              \
            const uint8_t *k = g->k_cache + (table[b] * g->KVH + kh) * g->tile;                \
            if (b + 1 < nb) /* the next block's key tile, while this one is read */            \
                for (int64_t i = 0; i < g->tile; i += 64)                                      \
                    __builtin_prefetch(g->k_cache + (table[b + 1] * g->KVH + kh) * g->tile + i, 0, 2); \
            float ks[bs];                                                                      \
            for (int64_t t = 0; t < bs; t++)                                                   \
                ks[t] = scale * unit * (kind == KV_FP8 ? g->k_scale : tile_scales(k, bs, D)[t]); \
            for (int64_t h0 = kh * G; h0 < (kh + 1) * G; h0 += 4) {                            \
                switch ((kh + 1) * G - h0 < 4 ? (kh + 1) * G - h0 : 4) {                       \
                case 1: SCORES(g, q, k, n, ks, scores, Ls, b0, h0, 1); break;                  \
                case 2: SCORES(g, q, k, n, ks, scores, Ls, b0, h0, 2); break;                  \
                case 3: SCORES(g, q, k, n, ks, scores, Ls, b0, h0, 3); break;                  \
                default: SCORES(g, q, k, n, ks, scores, Ls, b0, h0, 4); break;                 \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
    }                                                                                          \
    for (int64_t h = 0; h < g->H; h++)                                                         \
        for (int64_t t = 0; t < skip; t++) scores[h * Ls + t] = -INFINITY;                     \
    float inv_sum[g->H];                                                                       \
    for (int64_t h = 0; h < g->H; h++)                                                         \
        inv_sum[h] = softmax_unnormalised(scores + h * Ls, L, sink_of(g->sinks, h))            \
                     * unit * (kind == KV_FP8 ? g->v_scale : 1.f);                             \
    memset(out, 0, sizeof(float) * (size_t)(g->H * D));                                       \
    for (int64_t b = 0; b < nb; b++) {                                                         \
        const int64_t b0 = b * bs, n = L - b0 < bs ? L - b0 : bs;                              \
        for (int64_t kh = 0; kh < g->KVH; kh++) {                                              \
            const uint8_t *v = g->v_cache + (table[b] * g->KVH + kh) * g->tile;                \
            if (b + 1 < nb)                                                                    \
                for (int64_t i = 0; i < g->tile; i += 64)                                      \
                    __builtin_prefetch(g->v_cache + (table[b + 1] * g->KVH + kh) * g->tile + i, 0, 2); \
            for (int64_t h0 = kh * G; h0 < (kh + 1) * G; h0 += 4) {                            \
                const int64_t gn = (kh + 1) * G - h0 < 4 ? (kh + 1) * G - h0 : 4;              \
                float w[4 * bs];                                                               \
                for (int64_t i = 0; i < gn; i++)                                               \
                    block_weights(g, scores + (h0 + i) * Ls + b0, v, n, w + i * bs);           \
                switch (gn) {                                                                  \
                case 1: VALUES(g, v, n, w, bs, out, h0, 1); break;                             \
                case 2: VALUES(g, v, n, w, bs, out, h0, 2); break;                             \
                case 3: VALUES(g, v, n, w, bs, out, h0, 3); break;                             \
                default: VALUES(g, v, n, w, bs, out, h0, 4); break;                            \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
    }                                                                                          \
    for (int64_t h = 0; h < g->H; h++)                                                         \
        for (int64_t d = 0; d < D; d++) out[h * D + d] *= inv_sum[h];                          \
}
DEFINE_GROUPED_ROW(row_avx2, scores8_group, values8_group)
#define AVX2_Q8_SHAPE(D, bs) ((D) % 16 == 0 && (bs) % 8 == 0)
#else
#define HAVE_AVX2_Q8 0
#define AVX2_Q8_SHAPE(D, bs) 0
#define row_avx2 row_scalar
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && HAVE_AVX2_Q8
#define HAVE_AVX512_Q8 1
/* 16 bytes -> 16 floats: int8 as integers, fp8 as value / 256 */
static inline __m512 widen16_q8(const uint8_t *p, int kind) {
    const __m128i b = _mm_loadu_si128((const __m128i *)p);
    if (kind == KV_INT8) return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
    /* bits s.eeee.mmm at 14..7, then s carried from bit 14 up to 15 */
    const __m256i a = _mm256_slli_epi16(_mm256_cvtepu8_epi16(b), 7);
    return _mm512_cvtph_ps(_mm256_add_epi16(a, _mm256_and_si256(a, _mm256_set1_epi16(0x4000))));
}

/* lanes (key, dim parity) of a (keys 0..7) and b (keys 8..15) -> the 16 keys' sums */
static inline __m512 pair_sums16(__m512 a, __m512 b) {
    const __m512i ev = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i od = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    return _mm512_add_ps(_mm512_permutex2var_ps(a, ev, b), _mm512_permutex2var_ps(a, od, b));
}

/* AVX-512, likewise for GN (a literal, <= 4) query heads h0... Scores of 16 keys per pass (two loads of 8 keys x 2 dims per dim pair);
 * values 8 dims x 2 keys per load, by each head's broadcast pair of weights. */
static inline __attribute__((always_inline)) void scores16_group(
        const q8_geom *g, const float *q, const uint8_t *k, int64_t n, const float *ks,
        float *scores, int64_t Ls, int64_t b0, int64_t h0, const int GN) {
    const int64_t D = g->D, bs = g->bs;
    const int kind = g->kind;
    for (int64_t t = 0; t < n; t += 16) {
        __m512 lo[4], hi[4];
        for (int i = 0; i < GN; i++) lo[i] = hi[i] = _mm512_setzero_ps();
        for (int64_t c = 0; c < D / 2; c++) {
            const uint8_t *kc = k + (c * bs + t) * 2;
            const __m512 x0 = widen16_q8(kc, kind), x1 = widen16_q8(kc + 16, kind);
            for (int i = 0; i < GN; i++) {
                const __m512 qq = _mm512_castpd_ps(_mm512_broadcastsd_pd(
                    _mm_load_sd((const double *)(q + (h0 + i) * D + 2 * c))));
                lo[i] = _mm512_fmadd_ps(qq, x0, lo[i]);
                hi[i] = _mm512_fmadd_ps(qq, x1, hi[i]);
            }
        }
        const __mmask16 live = n - t >= 16 ? 0xffff : (__mmask16)((1u << (n - t)) - 1);
        for (int i = 0; i < GN; i++)
            _mm512_mask_storeu_ps(scores + (h0 + i) * Ls + b0 + t, live,
                                  _mm512_mul_ps(pair_sums16(lo[i], hi[i]), _mm512_loadu_ps(ks + t)));
    }
}

static inline __attribute__((always_inline)) void values16_group(
        const q8_geom *g, const uint8_t *v, int64_t n, const float *w, int64_t wstride,
        float *out, int64_t h0, const int GN) {
    const int64_t D = g->D;
    const int kind = g->kind;
    const __mmask16 even = 0x5555;
    for (int64_t d0 = 0; d0 < D; d0 += 16) {
        __m512 a0[4], a1[4];
        for (int i = 0; i < GN; i++) a0[i] = a1[i] = _mm512_setzero_ps();
        for (int64_t j = 0; 2 * j < n; j++) {
            const uint8_t *vj = v + (j * D + d0) * 2;
            __m512 x0 = widen16_q8(vj, kind), x1 = widen16_q8(vj + 16, kind);
            if (2 * j + 1 == n) { /* no key past n */
                x0 = _mm512_maskz_mov_ps(even, x0);
                x1 = _mm512_maskz_mov_ps(even, x1);
            }
            for (int i = 0; i < GN; i++) {
                const __m512 ww = _mm512_castpd_ps(_mm512_broadcastsd_pd(
                    _mm_load_sd((const double *)(w + i * wstride + 2 * j))));
                a0[i] = _mm512_fmadd_ps(ww, x0, a0[i]);
                a1[i] = _mm512_fmadd_ps(ww, x1, a1[i]);
            }
        }
        for (int i = 0; i < GN; i++) {
            float *o = out + (h0 + i) * D + d0;
            _mm512_storeu_ps(o, _mm512_add_ps(_mm512_loadu_ps(o), pair_sums16(a0[i], a1[i])));
        }
    }
}

DEFINE_GROUPED_ROW(row_avx512, scores16_group, values16_group)
#define AVX512_Q8_SHAPE(D, bs) ((D) % 16 == 0 && (bs) % 16 == 0)
#else
#define HAVE_AVX512_Q8 0
#define AVX512_Q8_SHAPE(D, bs) 0
#define row_avx512 row_scalar
#endif

#if HAVE_AVX512_Q8 && defined(__AVX512BF16__)
#define HAVE_AVX512BF16_Q8 1
/* AVX512-BF16, fp8 only: 32 e4m3 values at a time looked up as bf16 (value / 256, exact: e4m3
 * has 3 mantissa bits, and its subnormals are bf16 normals, which vdpbf16ps does not flush) and
 * multiplied by vdpbf16ps, two products a lane: keys by bf16 query pairs, values by bf16 weight
 * pairs. The query and the weights are rounded to bf16 (as the bf16 cache's decode row does);
 * the sums stay fp32. */
static const uint16_t FP8_BF16[128] __attribute__((aligned(64))) = {
    0x0000, 0x3700, 0x3780, 0x37c0, 0x3800, 0x3820, 0x3840, 0x3860, 0x3880, 0x3890, 0x38a0, 0x38b0,
    0x38c0, 0x38d0, 0x38e0, 0x38f0, 0x3900, 0x3910, 0x3920, 0x3930, 0x3940, 0x3950, 0x3960, 0x3970,
    0x3980, 0x3990, 0x39a0, 0x39b0, 0x39c0, 0x39d0, 0x39e0, 0x39f0, 0x3a00, 0x3a10, 0x3a20, 0x3a30,
    0x3a40, 0x3a50, 0x3a60, 0x3a70, 0x3a80, 0x3a90, 0x3aa0, 0x3ab0, 0x3ac0, 0x3ad0, 0x3ae0, 0x3af0,
    0x3b00, 0x3b10, 0x3b20, 0x3b30, 0x3b40, 0x3b50, 0x3b60, 0x3b70, 0x3b80, 0x3b90, 0x3ba0, 0x3bb0,
    0x3bc0, 0x3bd0, 0x3be0, 0x3bf0, 0x3c00, 0x3c10, 0x3c20, 0x3c30, 0x3c40, 0x3c50, 0x3c60, 0x3c70,
    0x3c80, 0x3c90, 0x3ca0, 0x3cb0, 0x3cc0, 0x3cd0, 0x3ce0, 0x3cf0, 0x3d00, 0x3d10, 0x3d20, 0x3d30,
    0x3d40, 0x3d50, 0x3d60, 0x3d70, 0x3d80, 0x3d90, 0x3da0, 0x3db0, 0x3dc0, 0x3dd0, 0x3de0, 0x3df0,
    0x3e00, 0x3e10, 0x3e20, 0x3e30, 0x3e40, 0x3e50, 0x3e60, 0x3e70, 0x3e80, 0x3e90, 0x3ea0, 0x3eb0,
    0x3ec0, 0x3ed0, 0x3ee0, 0x3ef0, 0x3f00, 0x3f10, 0x3f20, 0x3f30, 0x3f40, 0x3f50, 0x3f60, 0x3f70,
    0x3f80, 0x3f90, 0x3fa0, 0x3fb0, 0x3fc0, 0x3fd0, 0x3fe0, 0xffff /* NaN */};

typedef struct { __m512i t0, t1, t2, t3; } fp8_lut;

static inline fp8_lut fp8_lut_load(void) {
    const __m512i *t = (const __m512i *)FP8_BF16;
    return (fp8_lut){_mm512_load_si512(t), _mm512_load_si512(t + 1), _mm512_load_si512(t + 2),
                     _mm512_load_si512(t + 3)};
}

/* 32 e4m3 bytes -> 32 bf16: the magnitude's 7 bits index the table (vpermt2w looks up 64
 * entries by the low 6, bit 6 picks which 64), the sign goes on top */
static inline __m512bh fp8x32_bf16(const uint8_t *p, const fp8_lut *l) {
    const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)p));
    const __m512i lo = _mm512_permutex2var_epi16(l->t0, w, l->t1);
    const __m512i hi = _mm512_permutex2var_epi16(l->t2, w, l->t3);
    const __m512i mag = _mm512_mask_blend_epi16(_mm512_test_epi16_mask(w, _mm512_set1_epi16(0x40)), lo, hi);
    /* mag | (w << 8 & 0x8000) */
    return (__m512bh)_mm512_ternarylogic_epi32(mag, _mm512_slli_epi16(w, 8),
                                               _mm512_set1_epi16((short)0x8000), 0xf8);
}

/* scores of 16 keys per pass for GN query heads: `qv` holds the row's query as bf16 pairs
 * [H][D / 2] (row_avx512_bf16 rounds it); a key tile's 32 bytes at dim pair c are 16 keys x 2
 * dims, so each lane's two products are one key's */
static inline __attribute__((always_inline)) void scores16bf_group(
        const q8_geom *g, const float *qv, const uint8_t *k, int64_t n, const float *ks,
        float *scores, int64_t Ls, int64_t b0, int64_t h0, const int GN) {
    const uint32_t *q = (const uint32_t *)(const void *)qv;
    const int64_t D = g->D, bs = g->bs;
    const fp8_lut l = fp8_lut_load();
    for (int64_t t = 0; t < n; t += 16) {
        __m512 acc[4];
        for (int i = 0; i < GN; i++) acc[i] = _mm512_setzero_ps();
        for (int64_t c = 0; c < D / 2; c++) {
            const __m512bh x = fp8x32_bf16(k + (c * bs + t) * 2, &l);
            for (int i = 0; i < GN; i++)
                acc[i] = _mm512_dpbf16_ps(acc[i], x, (__m512bh)_mm512_set1_epi32((int)q[(h0 + i) * (D / 2) + c]));
        }
        const __mmask16 live = n - t >= 16 ? 0xffff : (__mmask16)((1u << (n - t)) - 1);
        for (int i = 0; i < GN; i++)
            _mm512_mask_storeu_ps(scores + (h0 + i) * Ls + b0 + t, live,
                                  _mm512_mul_ps(acc[i], _mm512_loadu_ps(ks + t)));
    }
}

/* the weighted values: a value tile's 32 bytes at key pair j are 16 dims x 2 keys, each lane's
 * two products one dim's, by the pair's bf16 weights (a key past n: weight 0 and its bytes
 * masked, garbage there may be NaN) */
static inline __attribute__((always_inline)) void values16bf_group(
        const q8_geom *g, const uint8_t *v, int64_t n, const float *w, int64_t wstride,
        float *out, int64_t h0, const int GN) {
    const int64_t D = g->D, pairs = (n + 1) / 2;
    const fp8_lut l = fp8_lut_load();
    uint32_t wp[4][g->bs / 2];
    for (int i = 0; i < GN; i++)
        for (int64_t t = 0; t < n; t += 16) {
            const __mmask16 live = n - t >= 16 ? 0xffff : (__mmask16)((1u << (n - t)) - 1);
            _mm256_storeu_si256((__m256i *)(wp[i] + t / 2),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(live, w + i * wstride + t)));
        }
    for (int64_t d0 = 0; d0 < D; d0 += 16) {
        __m512 acc[4];
        for (int i = 0; i < GN; i++) acc[i] = _mm512_setzero_ps();
        for (int64_t j = 0; j < pairs; j++) {
            __m512bh x = fp8x32_bf16(v + (j * D + d0) * 2, &l);
            if (2 * j + 1 == n) /* no key past n */
                x = (__m512bh)_mm512_maskz_mov_epi16(0x55555555u, (__m512i)x);
            for (int i = 0; i < GN; i++)
                acc[i] = _mm512_dpbf16_ps(acc[i], x, (__m512bh)_mm512_set1_epi32((int)wp[i][j]));
        }
        for (int i = 0; i < GN; i++) {
            float *o = out + (h0 + i) * D + d0;
            _mm512_storeu_ps(o, _mm512_add_ps(_mm512_loadu_ps(o), acc[i]));
        }
    }
}

DEFINE_GROUPED_ROW(row_avx512_bf16_pairs, scores16bf_group, values16bf_group)

/* the row with its query rounded to bf16 pairs first (D % 16 == 0: whole 16-value runs) */
static void row_avx512_bf16(const q8_geom *g, const float *q, const int64_t *table, int64_t L,
                            int64_t skip, float scale, float *scores, int64_t Ls, float *out) {
    uint32_t qp[g->H * g->D / 2];
    for (int64_t i = 0; i < g->H * g->D; i += 16)
        _mm256_storeu_si256((__m256i *)(qp + i / 2), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(q + i)));
    row_avx512_bf16_pairs(g, (const float *)(const void *)qp, table, L, skip, scale, scores, Ls, out);
}
#else
#define HAVE_AVX512BF16_Q8 0
#define row_avx512_bf16 row_avx512
#endif

/* rows x D floats rotated in place (rotation.h), for the tests; the vector lanes the build's
 * rotation runs on (16 AVX-512, 8 AVX2, 0 scalar) */
void hadamard_rotate_rows(float *x, int64_t rows, int64_t D) {
    for (int64_t r = 0; r < rows; r++) hadamard_rotate(x + r * D, D);
}

int64_t hadamard_lanes(void) { return HADAMARD_LANES; }

/* bit i set: path i was built (0 scalar, 1 AVX2, 2 AVX-512, 3 AVX512-BF16: fp8's) */
int64_t paged_decode_q8_isas(void) {
    return 1 | (HAVE_AVX2_Q8 << 1) | (HAVE_AVX512_Q8 << 2) | (HAVE_AVX512BF16_Q8 << 3);
}

typedef void q8_row_fn(const q8_geom *, const float *, const int64_t *, int64_t, int64_t, float,
                       float *, int64_t, float *);

/* The widest of the paths up to `isa` that was built and takes this shape (and kind: the
 * AVX512-BF16 row reads fp8 only; int8 takes the AVX-512 row there). */
static q8_row_fn *pick_q8_row(int64_t isa, int64_t D, int64_t bs, int64_t kind) {
    (void)D, (void)bs, (void)kind; /* unused where no vector path was built */
    if (isa >= ISA_AVX512_BF16 && HAVE_AVX512BF16_Q8 && kind == KV_FP8 && AVX512_Q8_SHAPE(D, bs))
        return row_avx512_bf16;
    if (isa >= ISA_AVX512 && HAVE_AVX512_Q8 && AVX512_Q8_SHAPE(D, bs)) return row_avx512;
    if (isa >= ISA_AVX2 && HAVE_AVX2_Q8 && AVX2_Q8_SHAPE(D, bs)) return row_avx2;
    return row_scalar;
}

/* 1: the path that `isa` asks for serves this shape of an fp8 cache (else a narrower one
 * would). */
int64_t paged_decode_q8_serves(int64_t isa, int64_t D, int64_t bs) {
    if ((isa == ISA_AVX512_BF16 && !HAVE_AVX512BF16_Q8) || (isa == ISA_AVX512 && !HAVE_AVX512_Q8)
        || (isa == ISA_AVX2 && !HAVE_AVX2_Q8)) return 0;
    q8_row_fn *want = isa == ISA_AVX512_BF16 ? row_avx512_bf16 : isa == ISA_AVX512 ? row_avx512
                      : isa == ISA_AVX2 ? row_avx2 : row_scalar;
    return pick_q8_row(isa, D, bs, KV_FP8) == want;
}

/* paged_decode_f32's rows over a one-byte cache (sinks as there): kind 0 int8, 1 fp8 (k_scale,
 * v_scale: fp8's per-tensor scales, as float bits in the low 32 bits of kv_scales), isa as above. */
void paged_decode_q8(const void *q, int64_t q_stride, const uint8_t *k_cache,
                     const uint8_t *v_cache, const int64_t *block_tables, int64_t bt_stride,
                     const int64_t *seq_lens, const int64_t *rows, int64_t row_begin,
                     int64_t row_end, int64_t H, int64_t KVH, int64_t D, int64_t block_size,
                     float scale, void *out, int64_t out_stride, int64_t io_bf16, int64_t window,
                     const float *sinks, int64_t kind, int64_t isa, int64_t k_scale_bits,
                     int64_t v_scale_bits) {
    union { uint32_t u; float f; } ksc = { (uint32_t)k_scale_bits }, vsc = { (uint32_t)v_scale_bits };
    const q8_geom g = {k_cache, v_cache, H, KVH, D, block_size,
                       block_size * (D + (kind == KV_INT8 ? 4 : 0)), (int)kind, ksc.f, vsc.f,
                       sinks};
    int64_t max_len = 1;
    for (int64_t r = row_begin; r < row_end; r++)
        if (seq_lens[r] > max_len) max_len = seq_lens[r];
    const int64_t Ls = max_len + 16; /* the vector rows store whole 16-key runs */
    float *scores = (float *)malloc(sizeof(float) * (size_t)(H * Ls + 2 * H * D));
    float *q32 = scores + H * Ls, *o32 = q32 + H * D;
    q8_row_fn *row = pick_q8_row(isa, D, block_size, kind);
    const int rotated = kind == KV_FP8 && fp8_rotated(D);
    for (int64_t r = row_begin; r < row_end; r++) {
        const float *qr = (const float *)q + rows[r] * q_stride;
        float *orow = (io_bf16 & 2) ? o32 : (float *)out + rows[r] * out_stride;
        if (io_bf16 & 1) {
            const uint16_t *qb = (const uint16_t *)q + rows[r] * q_stride;
            for (int64_t i = 0; i < H * D; i++) q32[i] = bf16_to_float(qb[i]);
            qr = q32;
        }
        if (rotated) { /* scores against rotated keys: the query rotated too */
            if (qr != q32) memcpy(q32, qr, sizeof(float) * (size_t)(H * D));
            for (int64_t h = 0; h < H; h++) hadamard_rotate(q32 + h * D, D);
            qr = q32;
        }
        const int64_t *table = block_tables + r * bt_stride;
        int64_t L = seq_lens[r], skip = 0;
        if (window > 0 && L > window) {
            const int64_t first = (L - window) / block_size;
            table += first;
            skip = L - window - first * block_size;
            L -= first * block_size;
        }
        row(&g, qr, table, L, skip, scale, scores, Ls, orow);
        if (rotated) /* a sum of rotated values, rotated back */
            for (int64_t h = 0; h < H; h++) hadamard_rotate(orow + h * D, D);
        if (io_bf16 & 2) {
            uint16_t *ob = (uint16_t *)out + rows[r] * out_stride;
            for (int64_t i = 0; i < H * D; i++) ob[i] = float_to_bf16(o32[i]);
        }
    }
    free(scores);
}

/* This step's K/V rows [T, KVH, D] (fp32, or bf16 where src_bf16; row stride src_stride) into
 * their slots of a one-byte cache: int8 (kind 0) as rint(x * 127 / absmax) with the token's
 * scale absmax / 127 beside the tile (kv_layout.quantize_int8, the same fp32 operations), fp8
 * (kind 1) as x / scale rounded to e4m3 and saturated (kv_layout.quantize_fp8), after the
 * rotation where D is a power of two (rotation.h). */
void write_kv_q8(const void *k, const void *v, int64_t src_stride, const int64_t *slots,
                 uint8_t *k_cache, uint8_t *v_cache, int64_t begin, int64_t end, int64_t KVH,
                 int64_t D, int64_t bs, int64_t kind, int64_t src_bf16, int64_t k_scale_bits,
                 int64_t v_scale_bits) {
    union { uint32_t u; float f; } ksc = { (uint32_t)k_scale_bits }, vsc = { (uint32_t)v_scale_bits };
    const int64_t tile = bs * (D + (kind == KV_INT8 ? 4 : 0));
    const int rotated = kind == KV_FP8 && fp8_rotated(D);
    float row[D];
    for (int64_t t = begin; t < end; t++) {
        const int64_t blk = slots[t] / bs, at = slots[t] % bs;
        for (int j = 0; j < 2; j++) {
            const void *src = j ? v : k;
            uint8_t *cache = j ? v_cache : k_cache;
            for (int64_t h = 0; h < KVH; h++) {
                const int64_t off = t * src_stride + h * D;
                if (src_bf16)
                    for (int64_t d = 0; d < D; d++) row[d] = bf16_to_float(((const uint16_t *)src)[off + d]);
                else
                    memcpy(row, (const float *)src + off, sizeof(float) * (size_t)D);
                uint8_t *dst = cache + (blk * KVH + h) * tile;
                if (kind == KV_FP8) {
                    const float sc = j ? vsc.f : ksc.f;
                    if (rotated) hadamard_rotate(row, D);
                    for (int64_t d = 0; d < D; d++) {
                        const int64_t i = j ? v_tile_at(at, d, D) : k_tile_at(at, d, bs);
                        dst[i] = float_to_fp8(row[d] / sc);
                    }
                    continue;
                }
                float amax = 0.f;
                for (int64_t d = 0; d < D; d++) amax = fmaxf(amax, fabsf(row[d]));
                const float inv = amax > 0.f ? 127.f / amax : 0.f;
                for (int64_t d = 0; d < D; d++) {
                    float x = nearbyintf(row[d] * inv);
                    x = x > 127.f ? 127.f : x < -127.f ? -127.f : x;
                    const int64_t i = j ? v_tile_at(at, d, D) : k_tile_at(at, d, bs);
                    dst[i] = (uint8_t)(int8_t)x;
                }
                ((float *)(dst + bs * D))[at] = amax / 127.f;
            }
        }
    }
}
