/* Paged attention for decode rows (one query token per request), read straight from the
 * block-paged KV cache: each request touches only its own blocks, nothing is gathered or
 * padded. Plain C with AVX2/FMA intrinsics where the CPU has them (a scalar loop otherwise),
 * called through ctypes with the GIL released; the caller splits rows between threads.
 *
 * Layout: q [*, H, D] fp32 or bf16 (row stride q_stride elements), caches [blocks, bs, KVH, D]
 * (fp32 or bf16), out [*, H, D] fp32 or bf16 (row stride out_stride). Row r of the work is token
 * rows[r] of q/out, with seq_lens[r] keys reached through block_tables[r * bt_stride ...].
 * Query head h reads kv head h / (H / KVH) (grouped-query attention).
 *
 * Per row, two passes over its blocks (one block of one kv head is a few contiguous rows):
 * scores[h][t] = scale * <q_h, k_t>, a softmax per head, then out_h = sum_t p[h][t] v_t. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "kernels.h"
#include "simd.h"

static inline float load1_f32(const float *p) { return *p; }
static inline float load1_bf16(const uint16_t *p) { return bf16_to_float(*p); }

#ifdef KVFLOW_AVX2
static inline __m256 load8_f32(const float *p) { return _mm256_loadu_ps(p); }
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

/* exp(s - max) in place over n scores; returns 1 / their sum (the caller scales the output). */
static float softmax_unnormalised(float *s, int64_t n) {
    float m = -INFINITY, sum = 0.f;
    int64_t t = 0;
#ifdef KVFLOW_AVX2
    __m256 vm = _mm256_set1_ps(-INFINITY);
    for (; t + 8 <= n; t += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(s + t));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vm), _mm256_extractf128_ps(vm, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    m = _mm_cvtss_f32(m4);
#endif
    for (; t < n; t++) m = s[t] > m ? s[t] : m;
    t = 0;
#ifdef KVFLOW_AVX2
    vm = _mm256_set1_ps(m);
    __m256 vs = _mm256_setzero_ps();
    for (; t + 8 <= n; t += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), vm));
        _mm256_storeu_ps(s + t, e);
        vs = _mm256_add_ps(vs, e);
    }
    sum = hsum8(vs);
#endif
    for (; t < n; t++) { s[t] = expf(s[t] - m); sum += s[t]; }
    return 1.f / sum;
}

#ifdef KVFLOW_AVX2
/* ND = D / 8 is a literal at each call site, so the accumulators stay in registers. */
#define DEFINE_VEC(SUFFIX, KV_T)                                                               \
/* dst[j] = scale * <q, k[j * stride ..]> for j < 8 */                                         \
static inline __attribute__((always_inline)) void dot8_##SUFFIX(                               \
        const float *q, const KV_T *k, int64_t stride, const int ND, float scale, float *dst) { \
    __m256 a[8];                                                                               \
    for (int j = 0; j < 8; j++) a[j] = _mm256_setzero_ps();                                    \
    for (int i = 0; i < ND; i++) {                                                             \
        const __m256 qv = _mm256_loadu_ps(q + 8 * i);                                          \
        for (int j = 0; j < 8; j++)                                                            \
            a[j] = _mm256_fmadd_ps(qv, load8_##SUFFIX(k + j * stride + 8 * i), a[j]);          \
    }                                                                                          \
    __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));        \
    __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));        \
    __m256 s = _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20),                             \
                             _mm256_permute2f128_ps(h0, h1, 0x31));                            \
    _mm256_storeu_ps(dst, _mm256_mul_ps(s, _mm256_set1_ps(scale)));                            \
}                                                                                              \
/* acc[0..D) += sum_t p[t] * v[t * stride ..] */                                               \
static inline __attribute__((always_inline)) void axpy_rows_##SUFFIX(                          \
        float *acc, const float *p, const KV_T *v, int64_t n, int64_t stride, const int ND) {  \
    __m256 s[32];                                                                              \
    for (int i = 0; i < ND; i++) s[i] = _mm256_loadu_ps(acc + 8 * i);                          \
    for (int64_t t = 0; t < n; t++) {                                                          \
        const __m256 pt = _mm256_set1_ps(p[t]);                                                \
        for (int i = 0; i < ND; i++)                                                           \
            s[i] = _mm256_fmadd_ps(pt, load8_##SUFFIX(v + t * stride + 8 * i), s[i]);          \
    }                                                                                          \
    for (int i = 0; i < ND; i++) _mm256_storeu_ps(acc + 8 * i, s[i]);                          \
}
DEFINE_VEC(f32, float)
DEFINE_VEC(bf16, uint16_t)
#endif

/* One row's attention; ND is D / 8 for the vector path, 0 for the scalar one. */
#define DEFINE_ROW(SUFFIX, KV_T, ND, VEC)                                                      \
static void row_##SUFFIX##_##ND(const float *q, const KV_T *k_cache, const KV_T *v_cache,      \
                                const int64_t *table, int64_t L, int64_t H, int64_t KVH,       \
                                int64_t D, int64_t bs, float scale, float *scores, float *out) { \
    const int64_t G = H / KVH, tok = KVH * D, blk = bs * KVH * D;                              \
    for (int64_t b0 = 0; b0 < L; b0 += bs) {                                                   \
        const KV_T *kb = k_cache + table[b0 / bs] * blk;                                       \
        const int64_t n = L - b0 < bs ? L - b0 : bs;                                           \
        const KV_T *nk = b0 + bs < L ? k_cache + table[b0 / bs + 1] * blk : NULL;             \
        for (int64_t kh = 0; kh < KVH; kh++)                                                   \
            for (int64_t g = 0; g < G; g++) {                                                  \
                if (nk && g == 0) /* this head's keys of the next block: spread prefetch */   \
                    for (int64_t t = 0; t < n; t++)                                            \
                        for (int64_t c = 0; c < D; c += 64 / (int64_t)sizeof(KV_T))            \
                            __builtin_prefetch(nk + t * tok + kh * D + c, 0, 2);               \
                const int64_t h = kh * G + g;                                                  \
                const float *qh = q + h * D;                                                   \
                const KV_T *k = kb + kh * D;                                                   \
                float *sh = scores + h * L + b0;                                               \
                int64_t t = 0;                                                                 \
                VEC(for (; t + 8 <= n; t += 8) dot8_##SUFFIX(qh, k + t * tok, tok, ND, scale, sh + t);) \
                for (; t < n; t++) {                                                           \
                    float s = 0.f;                                                             \
                    for (int64_t d = 0; d < D; d++) s += qh[d] * load1_##SUFFIX(k + t * tok + d); \
                    sh[t] = s * scale;                                                         \
                }                                                                              \
            }                                                                                  \
    }                                                                                          \
    float inv_sum[H];                                                                          \
    for (int64_t h = 0; h < H; h++) inv_sum[h] = softmax_unnormalised(scores + h * L, L);      \
    memset(out, 0, sizeof(float) * (size_t)(H * D));                                          \
    for (int64_t b0 = 0; b0 < L; b0 += bs) {                                                   \
        const KV_T *vb = v_cache + table[b0 / bs] * blk;                                       \
        const int64_t n = L - b0 < bs ? L - b0 : bs;                                           \
        const KV_T *nv = b0 + bs < L ? v_cache + table[b0 / bs + 1] * blk : NULL;             \
        for (int64_t kh = 0; kh < KVH; kh++)                                                   \
            for (int64_t g = 0; g < G; g++) {                                                  \
                if (nv && g == 0)                                                              \
                    for (int64_t t = 0; t < n; t++)                                            \
                        for (int64_t c = 0; c < D; c += 64 / (int64_t)sizeof(KV_T))            \
                            __builtin_prefetch(nv + t * tok + kh * D + c, 0, 2);               \
                const int64_t h = kh * G + g;                                                  \
                const float *p = scores + h * L + b0;                                          \
                const KV_T *v = vb + kh * D;                                                   \
                float *a = out + h * D;                                                        \
                VEC(axpy_rows_##SUFFIX(a, p, v, n, tok, ND); continue;)                        \
                for (int64_t t = 0; t < n; t++)                                                \
                    for (int64_t d = 0; d < D; d++) a[d] += p[t] * load1_##SUFFIX(v + t * tok + d); \
            }                                                                                  \
    }                                                                                          \
    for (int64_t h = 0; h < H; h++)                                                            \
        for (int64_t d = 0; d < D; d++) out[h * D + d] *= inv_sum[h];                          \
}

#define SCALAR(x)
#define VECTOR(x) x
DEFINE_ROW(f32, float, 0, SCALAR)
DEFINE_ROW(bf16, uint16_t, 0, SCALAR)
#ifdef KVFLOW_AVX2
DEFINE_ROW(f32, float, 8, VECTOR)
DEFINE_ROW(f32, float, 16, VECTOR)
DEFINE_ROW(bf16, uint16_t, 8, VECTOR)
DEFINE_ROW(bf16, uint16_t, 16, VECTOR)
#endif

#ifdef __AVX512F__
/* bf16 cache on AVX-512: one pass over each key serves every query head of its group. The
 * AVX2 row above widens a bf16 key once per query head (three times with SmolLM2's 9/3
 * heads) and is bound by that widening; here each key is widened once, into 16-float
 * vectors, for the G <= 4 heads that read it. D is a multiple of 64. */
static inline __m256 fold512(__m512 a) {
    return _mm256_add_ps(_mm512_castps512_ps256(a),
                         _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}
/* the four sums of a0..a3, in order */
static inline __m128 reduce4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
    __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(fold512(a0), fold512(a1)),
                              _mm256_hadd_ps(fold512(a2), fold512(a3)));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* scores of the G heads at q (rows D apart) for the n keys at k (rows `tok` apart); the same
 * keys of the next block (nk, or NULL) are prefetched as these are read, spread over the loop
 * (one burst per block ran 1.2x slower: 149 ms against 122 for a W1-sized step) */
static inline __attribute__((always_inline)) void scores_group_bf16(
        const float *q, const uint16_t *k, int64_t n, int64_t tok, int64_t D, const int G,
        float scale, float *sh, int64_t L, const uint16_t *nk) {
    const __m128 sc = _mm_set1_ps(scale);
    int64_t t = 0;
    for (; t + 4 <= n; t += 4) {
        __m512 acc[4][4];
        for (int g = 0; g < G; g++)
            for (int j = 0; j < 4; j++) acc[g][j] = _mm512_setzero_ps();
        if (nk)
            for (int j = 0; j < 4; j++)
                for (int64_t c = 0; c < D; c += 32) __builtin_prefetch(nk + (t + j) * tok + c, 0, 2);
        for (int64_t c = 0; c < D; c += 16) {
            __m512 kv[4];
            for (int j = 0; j < 4; j++) kv[j] = load16_bf16(k + (t + j) * tok + c);
            for (int g = 0; g < G; g++) {
                const __m512 qv = _mm512_loadu_ps(q + g * D + c);
                for (int j = 0; j < 4; j++) acc[g][j] = _mm512_fmadd_ps(qv, kv[j], acc[g][j]);
            }
        }
        for (int g = 0; g < G; g++)
            _mm_storeu_ps(sh + g * L + t,
                          _mm_mul_ps(reduce4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]), sc));
    }
    for (; t < n; t++) {
        __m512 acc[4];
        for (int g = 0; g < G; g++) acc[g] = _mm512_setzero_ps();
        for (int64_t c = 0; c < D; c += 16) {
            const __m512 kv = load16_bf16(k + t * tok + c);
            for (int g = 0; g < G; g++)
                acc[g] = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * D + c), kv, acc[g]);
        }
        for (int g = 0; g < G; g++) sh[g * L + t] = _mm512_reduce_add_ps(acc[g]) * scale;
    }
}

/* out of the G heads (rows D apart) += sum_t p_g[t] v_t over the n values at v (and the next
 * block's values at nv prefetched on the way, as for the keys) */
static inline __attribute__((always_inline)) void values_group_bf16(
        float *out, const float *p, int64_t L, const uint16_t *v, int64_t n, int64_t tok,
        int64_t D, const int G, const uint16_t *nv) {
    for (int64_t c = 0; c < D; c += 64) {
        __m512 acc[4][4];
        for (int g = 0; g < G; g++)
            for (int i = 0; i < 4; i++) acc[g][i] = _mm512_loadu_ps(out + g * D + c + 16 * i);
        for (int64_t t = 0; t < n; t++) {
            if (nv) for (int i = 0; i < 4; i += 2) __builtin_prefetch(nv + t * tok + c + 16 * i, 0, 2);
            __m512 vv[4];
            for (int i = 0; i < 4; i++) vv[i] = load16_bf16(v + t * tok + c + 16 * i);
            for (int g = 0; g < G; g++) {
                const __m512 pg = _mm512_set1_ps(p[g * L + t]);
                for (int i = 0; i < 4; i++) acc[g][i] = _mm512_fmadd_ps(pg, vv[i], acc[g][i]);
            }
        }
        for (int g = 0; g < G; g++)
            for (int i = 0; i < 4; i++) _mm512_storeu_ps(out + g * D + c + 16 * i, acc[g][i]);
    }
}

#ifndef PREFETCH_BLOCKS
#define PREFETCH_BLOCKS 1
#endif
static inline __attribute__((always_inline)) void row_bf16_group(
        const float *q, const uint16_t *k_cache, const uint16_t *v_cache, const int64_t *table,
        int64_t L, int64_t H, int64_t KVH, int64_t D, int64_t bs, float scale, float *scores,
        float *out, const int G) {
    const int64_t tok = KVH * D, blk = bs * KVH * D, nblocks = (L + bs - 1) / bs;
    for (int64_t b0 = 0; b0 < L; b0 += bs) {
        const uint16_t *kb = k_cache + table[b0 / bs] * blk;
        const int64_t n = L - b0 < bs ? L - b0 : bs;
        /* prefetch PREFETCH_BLOCKS ahead in the stream of this row's key blocks, then its value
         * blocks (one block ahead left ~100 ns of lead, about one memory latency) */
        const int64_t ahead = b0 / bs + PREFETCH_BLOCKS;
        const uint16_t *nk = ahead < nblocks ? k_cache + table[ahead] * blk
                           : ahead - nblocks < nblocks ? v_cache + table[ahead - nblocks] * blk : NULL;
        for (int64_t kh = 0; kh < KVH; kh++)
            scores_group_bf16(q + kh * G * D, kb + kh * D, n, tok, D, G, scale,
                              scores + kh * G * L + b0, L, nk ? nk + kh * D : NULL);
    }
    float inv_sum[H];
    for (int64_t h = 0; h < H; h++) inv_sum[h] = softmax_unnormalised(scores + h * L, L);
    memset(out, 0, sizeof(float) * (size_t)(H * D));
    for (int64_t b0 = 0; b0 < L; b0 += bs) {
        const uint16_t *vb = v_cache + table[b0 / bs] * blk;
        const int64_t n = L - b0 < bs ? L - b0 : bs;
        const int64_t ahead = b0 / bs + PREFETCH_BLOCKS;
        const uint16_t *nv = ahead < nblocks ? v_cache + table[ahead] * blk : NULL;
        for (int64_t kh = 0; kh < KVH; kh++)
            values_group_bf16(out + kh * G * D, scores + kh * G * L + b0, L, vb + kh * D, n, tok, D, G,
                              nv ? nv + kh * D : NULL);
    }
    for (int64_t h = 0; h < H; h++)
        for (int64_t d = 0; d < D; d++) out[h * D + d] *= inv_sum[h];
}

/* G is a literal in each branch, so the accumulators of row_bf16_group stay in registers */
static void row_bf16_512(const float *q, const uint16_t *k_cache, const uint16_t *v_cache,
                         const int64_t *table, int64_t L, int64_t H, int64_t KVH, int64_t D,
                         int64_t bs, float scale, float *scores, float *out) {
    switch (H / KVH) {
    case 1: row_bf16_group(q, k_cache, v_cache, table, L, H, KVH, D, bs, scale, scores, out, 1); break;
    case 2: row_bf16_group(q, k_cache, v_cache, table, L, H, KVH, D, bs, scale, scores, out, 2); break;
    case 3: row_bf16_group(q, k_cache, v_cache, table, L, H, KVH, D, bs, scale, scores, out, 3); break;
    default: row_bf16_group(q, k_cache, v_cache, table, L, H, KVH, D, bs, scale, scores, out, 4); break;
    }
}
#define PICK_BF16_512(H, KVH, D) ((D) % 64 == 0 && (H) / (KVH) <= 4)
#else
#define PICK_BF16_512(H, KVH, D) 0
#define row_bf16_512 row_bf16_0
#endif

#ifdef KVFLOW_AVX2
#define PICK_ROW(SUFFIX, D) ((D) == 64 ? row_##SUFFIX##_8 : (D) == 128 ? row_##SUFFIX##_16 : row_##SUFFIX##_0)
#else
#define PICK_ROW(SUFFIX, D) row_##SUFFIX##_0
#endif

#define PICK_ROW_FOR_f32(H, KVH, D) PICK_ROW(f32, D)
#define PICK_ROW_FOR_bf16(H, KVH, D) (PICK_BF16_512(H, KVH, D) ? row_bf16_512 : PICK_ROW(bf16, D))

/* q and out are fp32, or bf16 where io_bf16 has bit 0 (q) / bit 1 (out) set: a bf16 row is
 * widened (exactly) before and rounded (to nearest even, as torch's .to) after, per row. */
#define DEFINE_DECODE(SUFFIX, KV_T)                                                            \
void paged_decode_##SUFFIX(const void *q, int64_t q_stride, const KV_T *k_cache,              \
                           const KV_T *v_cache, const int64_t *block_tables, int64_t bt_stride, \
                           const int64_t *seq_lens, const int64_t *rows, int64_t row_begin,    \
                           int64_t row_end, int64_t H, int64_t KVH, int64_t D,                 \
                           int64_t block_size, float scale, void *out, int64_t out_stride,     \
                           int64_t io_bf16) {                                                  \
    int64_t max_len = 1;                                                                       \
    for (int64_t r = row_begin; r < row_end; r++)                                              \
        if (seq_lens[r] > max_len) max_len = seq_lens[r];                                      \
    float *scores = (float *)malloc(sizeof(float) * (size_t)(H * max_len + 2 * H * D));        \
    float *q32 = scores + H * max_len, *o32 = q32 + H * D;                                     \
    void (*row)(const float *, const KV_T *, const KV_T *, const int64_t *, int64_t, int64_t,  \
                int64_t, int64_t, int64_t, float, float *, float *) = PICK_ROW_FOR_##SUFFIX(H, KVH, D); \
    for (int64_t r = row_begin; r < row_end; r++) {                                            \
        const float *qr = (const float *)q + rows[r] * q_stride;                               \
        float *orow = (io_bf16 & 2) ? o32 : (float *)out + rows[r] * out_stride;               \
        if (io_bf16 & 1) {                                                                     \
            const uint16_t *qb = (const uint16_t *)q + rows[r] * q_stride;                     \
            for (int64_t i = 0; i < H * D; i++) q32[i] = bf16_to_float(qb[i]);                 \
            qr = q32;                                                                          \
        }                                                                                      \
        row(qr, k_cache, v_cache, block_tables + r * bt_stride, seq_lens[r], H, KVH, D,        \
            block_size, scale, scores, orow);                                                  \
        if (io_bf16 & 2) {                                                                     \
            uint16_t *ob = (uint16_t *)out + rows[r] * out_stride;                             \
            for (int64_t i = 0; i < H * D; i++) ob[i] = float_to_bf16(o32[i]);                 \
        }                                                                                      \
    }                                                                                          \
    free(scores);                                                                              \
}
DEFINE_DECODE(f32, float)
DEFINE_DECODE(bf16, uint16_t)
