/* Paged attention for decode rows (one query token per request), read straight from the
 * block-paged KV cache: each request touches only its own blocks, nothing is gathered or
 * padded. Plain C with AVX-512 / AVX2 intrinsics where the CPU has them (a scalar loop
 * otherwise), called through ctypes with the GIL released; the caller splits rows between
 * threads.
 *
 * Layout: q [*, H, D] fp32 or bf16 (row stride q_stride elements), caches in tiles (tiles.h:
 * [blocks, KVH, bs, D], keys with dims paired, values with keys paired; fp32 or bf16), out
 * [*, H, D] fp32 or bf16 (row stride out_stride). Row r of the work is token rows[r] of q/out,
 * with seq_lens[r] keys reached through block_tables[r * bt_stride ...]. Query head h reads kv
 * head h / (H / KVH) (grouped-query attention).
 *
 * Per row, two passes over its tiles: scores[h][t] = scale * <q_h, k_t> for 16 (AVX-512) or
 * 8 (AVX2) keys per pass over a key tile, a softmax per head, then out_h = sum_t p[h][t] v_t
 * with two keys per multiply-add. A block's tile per kv head is a contiguous 2 KiB (bf16,
 * 16 x 64), read front to back: over a run of consecutive blocks (a prompt's, mostly) the
 * hardware prefetcher streams it; where the next block lies elsewhere its tile is prefetched
 * in software while this one is read. W1-sized step, one thread, bf16 (benchmarks/
 * decode_kernel.py --io-bf16): 51-52 ms scattered, 42-43 contiguous, 25.5 with the blocks in
 * cache; the row layout before it ([blocks, bs, KVH, D], fp32 FMAs) took 63-70 ms. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "kernels.h"
#include "simd.h"
#include "tiles.h"

static inline float load1_f32(const float *p) { return *p; }
static inline float load1_bf16(const uint16_t *p) { return bf16_to_float(*p); }

#ifdef KVFLOW_AVX2
static inline __m256 load8_f32(const float *p) { return _mm256_loadu_ps(p); }
#endif

/* Every row function: q fp32 (and qb, the same row in bf16, or NULL), scores [H][Ls] scratch
 * (Ls >= L + 2), out [H][D] fp32; sinks [H] each head's sink logit, or NULL (simd.h). */
typedef void row_fn(const float *q, const uint16_t *qb, const void *k_cache, const void *v_cache,
                    const int64_t *table, int64_t L, int64_t skip, int64_t H, int64_t KVH, int64_t D,
                    int64_t bs, float scale, float *scores, int64_t Ls, float *out,
                    const float *sinks);

/* A sliding window's first block may start before the window: its first `skip` keys are
 * masked (their weights come out as exp(-inf) = 0, or exp8's clamp, ~1e-38). */
static inline void mask_skipped(float *scores, int64_t H, int64_t Ls, int64_t skip) {
    for (int64_t h = 0; h < H; h++)
        for (int64_t t = 0; t < skip; t++) scores[h * Ls + t] = -INFINITY;
}

/* Any shape: one key and one value element at a time. */
#define DEFINE_SCALAR(SUFFIX, KV_T)                                                            \
static void row_scalar_##SUFFIX(const float *q, const uint16_t *qb, const void *kc, const void *vc, \
                                const int64_t *table, int64_t L, int64_t skip, int64_t H,      \
                                int64_t KVH, int64_t D, int64_t bs, float scale, float *scores, \
                                int64_t Ls, float *out, const float *sinks) {                  \
    (void)qb;                                                                                  \
    const KV_T *k_cache = (const KV_T *)kc, *v_cache = (const KV_T *)vc;                       \
    const int64_t G = H / KVH, tile = bs * D;                                                  \
    for (int64_t h = 0; h < H; h++) {                                                          \
        const float *qh = q + h * D;                                                           \
        for (int64_t t = 0; t < L; t++) {                                                      \
            const KV_T *k = k_cache + (table[t / bs] * KVH + h / G) * tile;                    \
            float s = 0.f;                                                                     \
            for (int64_t d = 0; d < D; d++) s += qh[d] * load1_##SUFFIX(k + k_tile_at(t % bs, d, bs)); \
            scores[h * Ls + t] = t < skip ? -INFINITY : s * scale;                             \
        }                                                                                      \
        const float inv = softmax_unnormalised(scores + h * Ls, L, sink_of(sinks, h));         \
        float *a = out + h * D;                                                                \
        memset(a, 0, sizeof(float) * (size_t)D);                                               \
        for (int64_t t = 0; t < L; t++) {                                                      \
            const KV_T *v = v_cache + (table[t / bs] * KVH + h / G) * tile;                    \
            const float p = scores[h * Ls + t];                                                \
            for (int64_t d = 0; d < D; d++) a[d] += p * load1_##SUFFIX(v + v_tile_at(t % bs, d, D)); \
        }                                                                                      \
        for (int64_t d = 0; d < D; d++) a[d] *= inv;                                           \
    }                                                                                          \
}
DEFINE_SCALAR(f32, float)
DEFINE_SCALAR(bf16, uint16_t)

#ifdef KVFLOW_AVX2
/* 8 lanes (a: 4 items x (even, odd) halves, then b: the next 4) -> the 8 items' sums, in order */
static inline __m256 pair_sums8(__m256 a, __m256 b) {
    const __m256 h = _mm256_hadd_ps(a, b); /* items 0 1 4 5 2 3 6 7 */
    return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(h), 0xD8));
}

/* a[0..3] (keys t..t+3) and a[4..7] (t+4..t+7), one chain per dim pair c % 4: sums of q's
 * dim pairs times the tile's; PF (a literal): prefetch the next tile's row of each pair */
#define DEFINE_SCORES8(SUFFIX, KV_T)                                                           \
static inline __attribute__((always_inline)) void scores8_##SUFFIX(                            \
        __m256 a[8], const float *qh, const KV_T *k, const KV_T *nk, int64_t bs, int64_t D,    \
        int64_t t, const int PF) {                                                             \
    for (int64_t c = 0; c < D / 2; c += 4)                                                     \
        for (int u = 0; u < 4; u++) {                                                          \
            if (PF)                                                                            \
                for (int64_t i = 0; i < 2 * bs; i += 64 / (int64_t)sizeof(KV_T))               \
                    __builtin_prefetch(nk + (c + u) * bs * 2 + i, 0, 2);                       \
            const __m256 qq = _mm256_castpd_ps(_mm256_broadcast_sd((const double *)(qh + 2 * (c + u)))); \
            const KV_T *kk = k + ((c + u) * bs + t) * 2;                                       \
            a[u] = _mm256_fmadd_ps(qq, load8_##SUFFIX(kk), a[u]);                              \
            a[4 + u] = _mm256_fmadd_ps(qq, load8_##SUFFIX(kk + 8), a[4 + u]);                  \
        }                                                                                      \
}
/* acc[0..7] (dims d0..d0+31, each lane a dim and a key parity) += the tile's n values
 * weighed by their probabilities p; PF (a literal): prefetch the next tile's pair rows */
#define DEFINE_VALUES8(SUFFIX, KV_T)                                                           \
static inline __attribute__((always_inline)) void values8_##SUFFIX(                            \
        __m256 acc[8], const float *p, const KV_T *v, const KV_T *nv, int64_t n, int64_t D,    \
        int64_t d0, const int PF) {                                                            \
    for (int64_t j = 0; 2 * j < n; j++) {                                                      \
        if (PF)                                                                                \
            for (int64_t i = 0; i < 2 * D; i += 64 / (int64_t)sizeof(KV_T))                    \
                __builtin_prefetch(nv + j * D * 2 + i, 0, 2);                                  \
        const __m256 pp = _mm256_castpd_ps(_mm256_broadcast_sd((const double *)(p + 2 * j)));  \
        const KV_T *vj = v + (j * D + d0) * 2;                                                 \
        const __m256 keep = 2 * j + 1 < n ? _mm256_castsi256_ps(_mm256_set1_epi32(-1))         \
                          : _mm256_castsi256_ps(_mm256_set1_epi64x(0xFFFFFFFF));               \
        for (int i = 0; i < 8; i++) /* no key past n: never-written slots stay out */          \
            acc[i] = _mm256_fmadd_ps(pp, _mm256_and_ps(load8_##SUFFIX(vj + 8 * i), keep), acc[i]); \
    }                                                                                          \
}
DEFINE_SCORES8(f32, float)
DEFINE_SCORES8(bf16, uint16_t)
DEFINE_VALUES8(f32, float)
DEFINE_VALUES8(bf16, uint16_t)

/* AVX2 (fp32 q; fp32 or bf16 cache), bs % 8 == 0 and D % 32 == 0. Scores: one 8-lane load holds
 * 4 keys x 2 dims, multiplied by the broadcast q pair of those dims; values: 4 dims x 2 keys
 * by the broadcast probability pair. Lanes past a tile's last key are computed and dropped. */
#define DEFINE_AVX2(SUFFIX, KV_T)                                                              \
static void row_avx2_##SUFFIX(const float *q, const uint16_t *qb, const void *kc, const void *vc, \
                              const int64_t *table, int64_t L, int64_t skip, int64_t H,        \
                              int64_t KVH, int64_t D, int64_t bs, float scale, float *scores,   \
                              int64_t Ls, float *out, const float *sinks) {                    \
    (void)qb;                                                                                  \
    const KV_T *k_cache = (const KV_T *)kc, *v_cache = (const KV_T *)vc;                       \
    const int64_t G = H / KVH, tile = bs * D, nb = (L + bs - 1) / bs;                          \
    const __m256 sc = _mm256_set1_ps(scale);                                                   \
    for (int64_t b = 0; b < nb; b++) {                                                         \
        const int64_t b0 = b * bs, n = L - b0 < bs ? L - b0 : bs;                              \
        for (int64_t kh = 0; kh < KVH; kh++) {                                                 \
            const KV_T *k = k_cache + (table[b] * KVH + kh) * tile;                            \
            /* the next block's tile, unless it follows this one in memory (see row_dp_group), \
             * spread over the first pass (fp32, W1-sized step, scattered: 146-150 ms against \
             * 158 for one burst at the tile's start) */                                     \
            const KV_T *nk = b + 1 < nb && table[b + 1] != table[b] + 1                        \
                           ? k_cache + (table[b + 1] * KVH + kh) * tile : NULL;                \
            for (int64_t g = 0; g < G; g++) {                                                  \
                const float *qh = q + (kh * G + g) * D;                                        \
                float *sh = scores + (kh * G + g) * Ls + b0;                                   \
                for (int64_t t = 0; t < n; t += 8) {                                           \
                    /* 8 chains: keys t..t+3 and t+4..t+7, dim pairs c % 4 */                  \
                    __m256 a[8];                                                               \
                    for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_ps();                    \
                    if (nk && g == 0 && t == 0) scores8_##SUFFIX(a, qh, k, nk, bs, D, t, 1);   \
                    else scores8_##SUFFIX(a, qh, k, NULL, bs, D, t, 0);                        \
                    const __m256 lo = _mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3])); \
                    const __m256 hi = _mm256_add_ps(_mm256_add_ps(a[4], a[5]), _mm256_add_ps(a[6], a[7])); \
                    const __m256 s = _mm256_mul_ps(pair_sums8(lo, hi), sc);                    \
                    if (t + 8 <= n) _mm256_storeu_ps(sh + t, s);                               \
                    else {                                                                     \
                        float tmp[8];                                                          \
                        _mm256_storeu_ps(tmp, s);                                              \
                        memcpy(sh + t, tmp, sizeof(float) * (size_t)(n - t));                  \
                    }                                                                          \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
    }                                                                                          \
    mask_skipped(scores, H, Ls, skip);                                                         \
    float inv_sum[H];                                                                          \
    for (int64_t h = 0; h < H; h++) {                                                          \
        inv_sum[h] = softmax_unnormalised(scores + h * Ls, L, sink_of(sinks, h));              \
        scores[h * Ls + L] = 0.f; /* an odd last key's partner */                              \
    }                                                                                          \
    memset(out, 0, sizeof(float) * (size_t)(H * D));                                          \
    for (int64_t b = 0; b < nb; b++) {                                                         \
        const int64_t b0 = b * bs, n = L - b0 < bs ? L - b0 : bs;                              \
        for (int64_t kh = 0; kh < KVH; kh++) {                                                 \
            const KV_T *v = v_cache + (table[b] * KVH + kh) * tile;                            \
            const KV_T *nv = b + 1 < nb && table[b + 1] != table[b] + 1                        \
                           ? v_cache + (table[b + 1] * KVH + kh) * tile : NULL;                \
            for (int64_t g = 0; g < G; g++) {                                                  \
                const float *p = scores + (kh * G + g) * Ls + b0;                              \
                float *o = out + (kh * G + g) * D;                                             \
                for (int64_t d0 = 0; d0 < D; d0 += 32) {                                       \
                    __m256 acc[8];                                                             \
                    for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();                  \
                    if (nv && g == 0 && d0 == 0) values8_##SUFFIX(acc, p, v, nv, n, D, d0, 1);   \
                    else values8_##SUFFIX(acc, p, v, NULL, n, D, d0, 0);                       \
                    for (int i = 0; i < 8; i += 2)                                             \
                        _mm256_storeu_ps(o + d0 + 4 * i, _mm256_add_ps(_mm256_loadu_ps(o + d0 + 4 * i), \
                                                                       pair_sums8(acc[i], acc[i + 1]))); \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
    }                                                                                          \
    for (int64_t h = 0; h < H; h++)                                                            \
        for (int64_t d = 0; d < D; d++) out[h * D + d] *= inv_sum[h];                          \
}
DEFINE_AVX2(f32, float)
DEFINE_AVX2(bf16, uint16_t)
#define AVX2_SHAPE(D, bs) ((D) % 32 == 0 && (bs) % 8 == 0)

/* Prompt tokens in tiles (AVX2, fp32 q and out; fp32 or bf16 cache): TP (token, query head)
 * pairs of one sequence and kv head, the heads of consecutive prompt tokens, share every load
 * of its keys and values, where a row (above) reads them once per head: per dim pair two key
 * loads feed 2 * TP multiply-adds (a row's: 2), per key pair two value loads 2 * TP. Each pair
 * gets the row's numbers bit for bit, so a token's output never depends on whether it came as
 * a row or in a tile, nor on its tile: the same chains (a score's lanes summed over dim pairs
 * c % 4 == u, u = 0..3, then (u0 + u1) + (u2 + u3); a value's per block, added to the output
 * block after block), the same softmax over its own len[m] keys (later keys of the tile weigh
 * 0 and add nothing). TP = 6: 12 accumulators, 2 keys or values and a broadcast in AVX2's 16
 * registers; the four score chains of a pair and its running output wait in L1. */
#define TP 6
#define DEFINE_TILE_AVX2(SUFFIX, KV_T)                                                         \
static void tile_avx2_##SUFFIX(const float *const q[TP], float *const o[TP],                  \
                               const int64_t len[TP], const void *kc, const void *vc,          \
                               const int64_t *table, int64_t kh, int64_t KVH, int64_t D,        \
                               int64_t bs, float scale, float *scores, int64_t Ls,              \
                               const float sink[TP]) {                                         \
    const KV_T *k_cache = (const KV_T *)kc, *v_cache = (const KV_T *)vc;                       \
    int64_t L = 0;                                                                             \
    for (int m = 0; m < TP; m++) L = len[m] > L ? len[m] : L;                                  \
    const int64_t tile = bs * D, nb = (L + bs - 1) / bs;                                       \
    const __m256 sc = _mm256_set1_ps(scale);                                                   \
    for (int64_t b = 0; b < nb; b++) {                                                         \
        const int64_t b0 = b * bs, n = L - b0 < bs ? L - b0 : bs;                              \
        const KV_T *k = k_cache + (table[b] * KVH + kh) * tile;                                \
        for (int64_t t = 0; t < n; t += 8) {                                                   \
            __m256 part[4][TP][2]; /* the row's a[u] and a[4 + u], per pair */                 \
            for (int u = 0; u < 4; u++) {                                                      \
                __m256 a[TP][2];                                                               \
                for (int m = 0; m < TP; m++) a[m][0] = a[m][1] = _mm256_setzero_ps();          \
                for (int64_t c = u; c < D / 2; c += 4) {                                       \
                    const KV_T *kk = k + (c * bs + t) * 2;                                     \
                    const __m256 k0 = load8_##SUFFIX(kk), k1 = load8_##SUFFIX(kk + 8);         \
                    for (int m = 0; m < TP; m++) {                                             \
                        const __m256 qq = _mm256_castpd_ps(                                    \
                            _mm256_broadcast_sd((const double *)(q[m] + 2 * c)));              \
                        a[m][0] = _mm256_fmadd_ps(qq, k0, a[m][0]);                            \
                        a[m][1] = _mm256_fmadd_ps(qq, k1, a[m][1]);                            \
                    }                                                                          \
                }                                                                              \
                for (int m = 0; m < TP; m++) part[u][m][0] = a[m][0], part[u][m][1] = a[m][1]; \
            }                                                                                  \
            for (int m = 0; m < TP; m++) {                                                     \
                const __m256 lo = _mm256_add_ps(_mm256_add_ps(part[0][m][0], part[1][m][0]),   \
                                                _mm256_add_ps(part[2][m][0], part[3][m][0]));  \
                const __m256 hi = _mm256_add_ps(_mm256_add_ps(part[0][m][1], part[1][m][1]),   \
                                                _mm256_add_ps(part[2][m][1], part[3][m][1]));  \
                const __m256 sm = _mm256_mul_ps(pair_sums8(lo, hi), sc);                       \
                float *sh = scores + m * Ls + b0 + t;                                          \
                if (t + 8 <= n) _mm256_storeu_ps(sh, sm);                                      \
                else {                                                                         \
                    float tmp[8];                                                              \
                    _mm256_storeu_ps(tmp, sm);                                                 \
                    memcpy(sh, tmp, sizeof(float) * (size_t)(n - t));                          \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
    }                                                                                          \
    float inv_sum[TP];                                                                         \
    for (int m = 0; m < TP; m++) {                                                             \
        inv_sum[m] = softmax_unnormalised(scores + m * Ls, len[m], sink[m]);                   \
        for (int64_t t = len[m]; t <= L; t++) scores[m * Ls + t] = 0.f; /* later keys, a partner */ \
        memset(o[m], 0, sizeof(float) * (size_t)D);                                            \
    }                                                                                          \
    for (int64_t d0 = 0; d0 < D; d0 += 8)                                                      \
        for (int64_t b = 0; b < nb; b++) {                                                     \
            const int64_t b0 = b * bs, n = L - b0 < bs ? L - b0 : bs;                          \
            const KV_T *v = v_cache + (table[b] * KVH + kh) * tile;                            \
            __m256 acc[TP][2];                                                                 \
            for (int m = 0; m < TP; m++) acc[m][0] = acc[m][1] = _mm256_setzero_ps();          \
            for (int64_t j = 0; 2 * j < n; j++) {                                              \
                const KV_T *vj = v + (j * D + d0) * 2;                                         \
                const __m256 keep = 2 * j + 1 < n ? _mm256_castsi256_ps(_mm256_set1_epi32(-1)) \
                                  : _mm256_castsi256_ps(_mm256_set1_epi64x(0xFFFFFFFF));       \
                const __m256 v0 = _mm256_and_ps(load8_##SUFFIX(vj), keep);                     \
                const __m256 v1 = _mm256_and_ps(load8_##SUFFIX(vj + 8), keep);                 \
                for (int m = 0; m < TP; m++) {                                                 \
                    const __m256 pp = _mm256_castpd_ps(_mm256_broadcast_sd(                    \
                        (const double *)(scores + m * Ls + b0 + 2 * j)));                      \
                    acc[m][0] = _mm256_fmadd_ps(pp, v0, acc[m][0]);                            \
                    acc[m][1] = _mm256_fmadd_ps(pp, v1, acc[m][1]);                            \
                }                                                                              \
            }                                                                                  \
            for (int m = 0; m < TP; m++)                                                       \
                _mm256_storeu_ps(o[m] + d0, _mm256_add_ps(_mm256_loadu_ps(o[m] + d0),          \
                                                          pair_sums8(acc[m][0], acc[m][1])));  \
        }                                                                                      \
    for (int m = 0; m < TP; m++)                                                               \
        for (int64_t d = 0; d < D; d++) o[m][d] *= inv_sum[m];                                 \
}
DEFINE_TILE_AVX2(f32, float)
DEFINE_TILE_AVX2(bf16, uint16_t)
typedef void tile_fn(const float *const q[TP], float *const o[TP], const int64_t len[TP],
                     const void *kc, const void *vc, const int64_t *table, int64_t kh, int64_t KVH,
                     int64_t D, int64_t bs, float scale, float *scores, int64_t Ls,
                     const float sink[TP]);

/* Rows r0 .. r0 + R - 1 (R >= 2 consecutive tokens of one sequence: one table, lens rising by
 * one) through the tiles: per kv head its pairs (token-major) TP at a time, the last tile
 * padded with copies of its last pair whose outputs go to `spare` [D]. */
static void prompt_tiles(tile_fn *tile, const float *q, int64_t q_stride, const void *kc,
                         const void *vc, const int64_t *table, const int64_t *seq_lens,
                         const int64_t *rows, int64_t r0, int64_t R, int64_t H, int64_t KVH,
                         int64_t D, int64_t bs, float scale, float *scores, int64_t Ls,
                         float *out, int64_t out_stride, float *spare, const float *sinks) {
    const int64_t G = H / KVH, pairs = R * G;
    for (int64_t kh = 0; kh < KVH; kh++)
        for (int64_t p0 = 0; p0 < pairs; p0 += TP) {
            const float *qp[TP];
            float *op[TP];
            int64_t len[TP];
            float sink[TP];
            for (int m = 0; m < TP; m++) {
                const int64_t p = p0 + m < pairs ? p0 + m : pairs - 1;
                const int64_t r = r0 + p / G, h = kh * G + p % G;
                qp[m] = q + rows[r] * q_stride + h * D;
                op[m] = p0 + m < pairs ? out + rows[r] * out_stride + h * D : spare;
                len[m] = seq_lens[r];
                sink[m] = sink_of(sinks, h);
            }
            tile(qp, op, len, kc, vc, table, kh, KVH, D, bs, scale, scores, Ls, sink);
        }
}

/* How many rows from r (at most end - r) are consecutive tokens of r's sequence. */
static int64_t prompt_run(const int64_t *rows, const int64_t *seq_lens, const int64_t *tables,
                          int64_t bt_stride, int64_t bs, int64_t r, int64_t end) {
    int64_t n = 1;
    while (r + n < end && rows[r + n] == rows[r] + n && seq_lens[r + n] == seq_lens[r] + n
           && memcmp(tables + (r + n) * bt_stride, tables + r * bt_stride,
                     sizeof(int64_t) * (size_t)((seq_lens[r + n] + bs - 1) / bs)) == 0)
        n++;
    return n;
}
#else
#define AVX2_SHAPE(D, bs) 0
#define row_avx2_f32 row_scalar_f32
#define row_avx2_bf16 row_scalar_bf16
#endif

#ifndef PREFETCH_BLOCKS
#define PREFETCH_BLOCKS 1
#endif
#if defined(__AVX512F__) && defined(__AVX512BF16__)
/* exps of n scores rounded to bf16 and written over the start of their row as bf16 weights
 * (a zero after them when n is odd, so weights pair up); returns 1 / the sum of the rounded
 * weights, which the output is scaled by: the weights it applies then sum to one. As in
 * PyTorch's bf16 flash attention, probabilities enter the value products in bf16. */
static float softmax_bf16(float *s, int64_t n, float sink) {
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    __m512 vm = ninf, vs = _mm512_setzero_ps();
    for (int64_t t = 0; t < n; t += 16) {
        const __mmask16 live = n - t >= 16 ? 0xffff : (__mmask16)((1u << (n - t)) - 1);
        vm = _mm512_max_ps(vm, _mm512_mask_loadu_ps(ninf, live, s + t));
    }
    vm = _mm512_set1_ps(_mm512_reduce_max_ps(vm));
    uint16_t *w = (uint16_t *)s;
    for (int64_t t = 0; t < n; t += 16) { /* each store lands on floats already read */
        const __mmask16 live = n - t >= 16 ? 0xffff : (__mmask16)((1u << (n - t)) - 1);
        const __m256i h = (__m256i)_mm512_cvtneps_pbh(exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, s + t), vm)));
        vs = _mm512_add_ps(vs, _mm512_maskz_mov_ps(live, widen16_bf16(h)));
        _mm256_mask_storeu_epi16(w + t, live, h);
    }
    if (n & 1) w[n] = 0;
    return 1.f / with_sink(_mm512_reduce_add_ps(vs), _mm512_cvtss_f32(vm), sink);
}

/* bf16 q and cache on AVX512-BF16, bs % 16 == 0, D % 64 == 0, G (a literal) <= 4 heads per kv
 * head. Scores: one 16-word load of a key tile is 16 keys x one dim pair, one `vdpbf16ps`
 * per head with that pair of q broadcast (products exact in fp32, sums in fp32). Values:
 * 16 dims x one key pair per load, times the broadcast pair of bf16 weights. */
static inline __attribute__((always_inline)) void row_dp_group(
        const uint16_t *qb, const uint16_t *k_cache, const uint16_t *v_cache, const int64_t *table,
        int64_t L, int64_t skip, int64_t KVH, int64_t D, int64_t bs, float scale, float *scores, int64_t Ls,
        float *out, const float *sinks, const int G, const int pf_all) {
    const int64_t H = KVH * G, tile = bs * D, half = D / 2, nb = (L + bs - 1) / bs;
    const __m512 sc = _mm512_set1_ps(scale);
    for (int64_t b = 0; b < nb; b++) {
        const int64_t b0 = b * bs, n = L - b0 < bs ? L - b0 : bs;
        for (int64_t kh = 0; kh < KVH; kh++) {
            const uint32_t *kt = (const uint32_t *)(k_cache + (table[b] * KVH + kh) * tile);
            /* one block ahead in this kv head's stream of key tiles, then of value tiles, unless
             * it follows this one in memory and !pf_all: the Zen 4's hardware prefetcher streams
             * those (software prefetches beside it ran 1.3x slower over contiguous blocks there);
             * a Xeon with AMX ran 1.46x faster with them (pf_all: 114 -> 78 ms for
             * benchmarks/decode_kernel.py --io-bf16 --contiguous, scattered blocks level) */
            const int64_t ahead = b + PREFETCH_BLOCKS;
            const uint16_t *next = ahead < nb ? (!pf_all && table[ahead] == table[ahead - 1] + 1 ? NULL
                                                 : k_cache + (table[ahead] * KVH + kh) * tile)
                                 : ahead - nb < nb ? v_cache + (table[ahead - nb] * KVH + kh) * tile : NULL;
            const uint16_t *qh = qb + kh * G * D;
            for (int64_t t = 0; t < n; t += 16) {
                __m512 acc[4][2];
                for (int g = 0; g < G; g++) acc[g][0] = acc[g][1] = _mm512_setzero_ps();
                for (int64_t c = 0; c < half; c += 2) {
                    if (t == 0 && next)
                        for (int64_t i = 0; i < 2 * bs; i += 16) __builtin_prefetch(next + (c * bs + i) * 2, 0, 2);
                    const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kt + c * bs + t);
                    const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kt + (c + 1) * bs + t);
                    for (int g = 0; g < G; g++) {
                        acc[g][0] = _mm512_dpbf16_ps(acc[g][0], k0, bcast_pair_at(qh + g * D + 2 * c));
                        acc[g][1] = _mm512_dpbf16_ps(acc[g][1], k1, bcast_pair_at(qh + g * D + 2 * c + 2));
                    }
                }
                const __mmask16 live = n - t >= 16 ? 0xffff : (__mmask16)((1u << (n - t)) - 1);
                for (int g = 0; g < G; g++)
                    _mm512_mask_storeu_ps(scores + (kh * G + g) * Ls + b0 + t, live,
                                          _mm512_mul_ps(_mm512_add_ps(acc[g][0], acc[g][1]), sc));
            }
        }
    }
    mask_skipped(scores, H, Ls, skip);
    float inv_sum[H];
    for (int64_t h = 0; h < H; h++) inv_sum[h] = softmax_bf16(scores + h * Ls, L, sink_of(sinks, h));
    memset(out, 0, sizeof(float) * (size_t)(H * D));
    const __m512i first_key = _mm512_set1_epi32(0xFFFF); /* a value word's even key */
    for (int64_t b = 0; b < nb; b++) {
        const int64_t b0 = b * bs, n = L - b0 < bs ? L - b0 : bs;
        for (int64_t kh = 0; kh < KVH; kh++) {
            const uint32_t *vt = (const uint32_t *)(v_cache + (table[b] * KVH + kh) * tile);
            const int64_t ahead = b + PREFETCH_BLOCKS;
            const uint16_t *next = ahead < nb && (pf_all || table[ahead] != table[ahead - 1] + 1)
                                 ? v_cache + (table[ahead] * KVH + kh) * tile : NULL;
            for (int64_t d0 = 0; d0 < D; d0 += 64) {
                __m512 acc[4][4];
                for (int g = 0; g < G; g++)
                    for (int i = 0; i < 4; i++) acc[g][i] = _mm512_loadu_ps(out + (kh * G + g) * D + d0 + 16 * i);
                for (int64_t j = 0; 2 * j < n; j++) {
                    __m512i x[4];
                    for (int i = 0; i < 4; i++) {
                        if (next) __builtin_prefetch(next + (j * D + d0 + 16 * i) * 2, 0, 2);
                        x[i] = _mm512_loadu_si512(vt + j * D + d0 + 16 * i);
                        if (2 * j + 1 == n) /* no key past n: never-written slots stay out */
                            x[i] = _mm512_and_si512(x[i], first_key);
                    }
                    for (int g = 0; g < G; g++) {
                        const __m512bh w = bcast_pair_at((const uint16_t *)(scores + (kh * G + g) * Ls) + b0 + 2 * j);
                        for (int i = 0; i < 4; i++) acc[g][i] = _mm512_dpbf16_ps(acc[g][i], (__m512bh)x[i], w);
                    }
                }
                for (int g = 0; g < G; g++)
                    for (int i = 0; i < 4; i++) _mm512_storeu_ps(out + (kh * G + g) * D + d0 + 16 * i, acc[g][i]);
            }
        }
    }
    for (int64_t h = 0; h < H; h++) {
        const __m512 inv = _mm512_set1_ps(inv_sum[h]);
        for (int64_t d = 0; d < D; d += 16)
            _mm512_storeu_ps(out + h * D + d, _mm512_mul_ps(_mm512_loadu_ps(out + h * D + d), inv));
    }
}

/* G is a literal in each branch, so row_dp_group's accumulators stay in registers */
#define DEFINE_ROW_DP(NAME, PF_ALL)                                                            \
static void NAME(const float *q, const uint16_t *qb, const void *kc, const void *vc,          \
                 const int64_t *table, int64_t L, int64_t skip, int64_t H, int64_t KVH, int64_t D, \
                 int64_t bs, float scale, float *scores, int64_t Ls, float *out,              \
                 const float *sinks) {                                                         \
    (void)q;                                                                                   \
    const uint16_t *k = (const uint16_t *)kc, *v = (const uint16_t *)vc;                       \
    switch (H / KVH) {                                                                         \
    case 1: row_dp_group(qb, k, v, table, L, skip, KVH, D, bs, scale, scores, Ls, out, sinks, 1, PF_ALL); break; \
    case 2: row_dp_group(qb, k, v, table, L, skip, KVH, D, bs, scale, scores, Ls, out, sinks, 2, PF_ALL); break; \
    case 3: row_dp_group(qb, k, v, table, L, skip, KVH, D, bs, scale, scores, Ls, out, sinks, 3, PF_ALL); break; \
    default: row_dp_group(qb, k, v, table, L, skip, KVH, D, bs, scale, scores, Ls, out, sinks, 4, PF_ALL); break; \
    }                                                                                          \
}
DEFINE_ROW_DP(row_dp, 0)
DEFINE_ROW_DP(row_dp_pf, 1) /* every next block prefetched, contiguous or not */
#define DP_SHAPE(H, KVH, D, bs) ((D) % 64 == 0 && (bs) % 16 == 0 && (H) / (KVH) <= 4)
#else
#define DP_SHAPE(H, KVH, D, bs) 0
#define row_dp ((row_fn *)NULL) /* never picked: every row widens q */
#define row_dp_pf row_dp
#endif

#ifdef KVFLOW_AVX2
#define TILE_PAIRS TP
#define TILES_SERVE(io, window, D, bs) (((io) & 11) == 8 && (window) == 0 && AVX2_SHAPE(D, bs))
#define PROMPT_TILES prompt_tiles
#else
#define TILE_PAIRS 1
#define TILES_SERVE(io, window, D, bs) 0
#define PROMPT_TILES(...) ((void)0)
#define prompt_run(...) 1
#endif

static row_fn *pick_row(int bf16_cache, int q_bf16, int pf_all, int64_t H, int64_t KVH, int64_t D,
                        int64_t bs) {
    if (bf16_cache && q_bf16 && DP_SHAPE(H, KVH, D, bs)) return pf_all ? row_dp_pf : row_dp;
    if (AVX2_SHAPE(D, bs)) return bf16_cache ? row_avx2_bf16 : row_avx2_f32;
    return bf16_cache ? row_scalar_bf16 : row_scalar_f32;
}

/* q and out are fp32, or bf16 where io_bf16 has bit 0 (q) / bit 1 (out) set: a bf16 row is
 * widened (exactly) before and rounded (to nearest even, as torch's .to) after, per row. Bit
 * 2: the AVX512-BF16 row prefetches every next block, contiguous or not (row_dp_pf). Bit 3:
 * the rows are every token of a step (prompt tokens among them): with fp32 q and out, no
 * window and the AVX2 row's shape, runs of two or more consecutive tokens of one sequence go
 * through prompt_tiles (a run of one, a decode, stays a row as in a decode step). `sinks`:
 * [H] fp32, each query head's attention sink (a logit in every softmax's denominator whose
 * value is zero), or NULL for none. */
#define DEFINE_DECODE(SUFFIX, KV_T, BF16_CACHE)                                                \
void paged_decode_##SUFFIX(const void *q, int64_t q_stride, const KV_T *k_cache,              \
                           const KV_T *v_cache, const int64_t *block_tables, int64_t bt_stride, \
                           const int64_t *seq_lens, const int64_t *rows, int64_t row_begin,    \
                           int64_t row_end, int64_t H, int64_t KVH, int64_t D,                 \
                           int64_t block_size, float scale, void *out, int64_t out_stride,     \
                           int64_t io_bf16, int64_t window, const float *sinks) {              \
    int64_t max_len = 1;                                                                       \
    for (int64_t r = row_begin; r < row_end; r++)                                              \
        if (seq_lens[r] > max_len) max_len = seq_lens[r];                                      \
    const int64_t Ls = max_len + 2;                                                            \
    const int64_t Hs = H > TILE_PAIRS ? H : TILE_PAIRS; /* score rows: a row's heads, a tile's pairs */ \
    float *scores = (float *)malloc(sizeof(float) * (size_t)(Hs * Ls + 2 * H * D));            \
    float *q32 = scores + Hs * Ls, *o32 = q32 + H * D;                                         \
    row_fn *row = pick_row(BF16_CACHE, (int)(io_bf16 & 1), (int)(io_bf16 & 4), H, KVH, D, block_size); \
    const int tiles = TILES_SERVE(io_bf16, window, D, block_size);                            \
    float *spare = tiles ? (float *)malloc(sizeof(float) * (size_t)D) : NULL;                  \
    for (int64_t r = row_begin; r < row_end; r++) {                                            \
        if (tiles) {                                                                           \
            const int64_t run = prompt_run(rows, seq_lens, block_tables, bt_stride, block_size, \
                                           r, row_end);                                        \
            if (run > 1) {                                                                     \
                PROMPT_TILES(tile_avx2_##SUFFIX, (const float *)q, q_stride, k_cache, v_cache, \
                             block_tables + r * bt_stride, seq_lens, rows, r, run, H, KVH, D,  \
                             block_size, scale, scores, Ls, (float *)out, out_stride, spare,   \
                             sinks);                                                           \
                r += run - 1;                                                                  \
                continue;                                                                      \
            }                                                                                  \
        }                                                                                      \
        const float *qr = (const float *)q + rows[r] * q_stride;                               \
        const uint16_t *qb = NULL;                                                             \
        float *orow = (io_bf16 & 2) ? o32 : (float *)out + rows[r] * out_stride;               \
        if (io_bf16 & 1) {                                                                     \
            qb = (const uint16_t *)q + rows[r] * q_stride;                                     \
            if (row != row_dp && row != row_dp_pf) /* the dp rows read qb as it is */          \
                for (int64_t i = 0; i < H * D; i++) q32[i] = bf16_to_float(qb[i]);             \
            qr = q32;                                                                          \
        }                                                                                      \
        /* a window reads the blocks from the one holding its first key (seq_len - window) */  \
        const int64_t *table = block_tables + r * bt_stride;                                   \
        int64_t L = seq_lens[r], skip = 0;                                                     \
        if (window > 0 && L > window) {                                                        \
            const int64_t first = (L - window) / block_size;                                   \
            table += first;                                                                    \
            skip = L - window - first * block_size;                                            \
            L -= first * block_size;                                                           \
        }                                                                                      \
        row(qr, qb, k_cache, v_cache, table, L, skip, H, KVH, D, block_size, scale, scores, Ls, \
            orow, sinks);                                                                      \
        if (io_bf16 & 2) {                                                                     \
            uint16_t *ob = (uint16_t *)out + rows[r] * out_stride;                             \
            for (int64_t i = 0; i < H * D; i++) ob[i] = float_to_bf16(o32[i]);                 \
        }                                                                                      \
    }                                                                                          \
    free(scores);                                                                              \
    free(spare);                                                                               \
}
DEFINE_DECODE(f32, float, 0)
DEFINE_DECODE(bf16, uint16_t, 1)
