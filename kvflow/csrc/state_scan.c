/* The state layers' prompt chunks (kvflow/layers: gated_deltanet.py, mamba2.py): each
 * request's tokens through its recurrence, one token after another, the state read from its
 * slot and left there after the chunk's last token (and copied into a snapshot slot after a
 * given token, for a prefix-cache save).
 *
 *   gdn_chunk_rows   Gated DeltaNet, per value head (as state_update.c's one-token step):
 *                        S <- exp(g) S;  S <- S + k (beta (v - S^T k))^T;  o = S^T q
 *   ssm_chunk_rows   Mamba2's SSD, per head:
 *                        S <- exp(dt A) S + dt x B^T;  y = S C      (the D skip is the caller's)
 *
 * Why sequential, not the chunked (WY / SSD) matrix form: a head's work is O(T dk dv) either
 * way, and for chunks of a few hundred tokens the one pass keeps the state near the core
 * across a block's tokens (Gated DeltaNet: strips of S, 32 or 16 columns x dk rows, in L1,
 * one pass over them per token; Mamba2: a row of S in registers), with no triangular solves
 * and no T x T products. Work units: (chunk, head) (Gated DeltaNet: and a group of the head's
 * columns, where there are more threads than heads); a unit prepares its tokens' inputs
 * SCAN_BLOCK at a time (normalised q and k, v, the gates) in fp32. Paths: 0 scalar (the
 * tests' reference, the one-token kernel's order of operations), 1 AVX2 + FMA, 2 AVX-512
 * (the same sums, grouped differently: fp32 rounding apart). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "simd.h"
#include "state.h"

#define HEAD_MAX 512    /* dk, dv, P and N up to this (state_update.py checks) */
#define SCAN_BLOCK 32   /* tokens whose inputs a unit prepares at a time */

/* -- Gated DeltaNet: nb tokens over columns [j0, je) of S [dk][dv] --------------------------
 * q, k [nb][dk] (normalised, q scaled), v [nb][dv], eg = exp(g) and beta [nb]; o row t at
 * o + t * o_stride. The scalar path and the vector paths' tails. */
static void gdn_tokens_columns(float *S, int64_t dk, int64_t dv, int64_t j0, int64_t je, int64_t nb,
                               const float *q, const float *k, const float *v, const float *eg,
                               const float *beta, float *o, int64_t o_stride)
{
    float kv[HEAD_MAX];
    for (int64_t t = 0; t < nb; t++) {
        const float *kt = k + t * dk, *qt = q + t * dk, *vt = v + t * dv;
        float *ot = o + t * o_stride;
        for (int64_t j = j0; j < je; j++) kv[j] = 0.f;
        for (int64_t i = 0; i < dk; i++)
            for (int64_t j = j0; j < je; j++) kv[j] += S[i * dv + j] * eg[t] * kt[i];
        for (int64_t j = j0; j < je; j++) {
            kv[j] = (vt[j] - kv[j]) * beta[t];
            ot[j] = 0.f;
        }
        for (int64_t i = 0; i < dk; i++)
            for (int64_t j = j0; j < je; j++) {
                const float s = S[i * dv + j] * eg[t] + kt[i] * kv[j];
                S[i * dv + j] = s;
                ot[j] += s * qt[i];
            }
    }
}

/* -- Mamba2: nb tokens through S [P][N] ------------------------------------------------------
 * dA [nb], xdt [nb][P], B, C [nb][N]; y row t at y + t * y_stride, accumulated into (the
 * caller zeroes it). Columns [n0, N): the scalar path (n0 = 0) and the vector paths' tails. */
static void ssm_tokens_columns(float *S, int64_t P, int64_t N, int64_t n0, int64_t nb,
                               const float *dA, const float *xdt, const float *B, const float *C,
                               float *y, int64_t y_stride)
{
    for (int64_t p = 0; p < P; p++) {
        float *s = S + p * N;
        for (int64_t t = 0; t < nb; t++) {
            const float *b = B + t * N, *c = C + t * N, xp = xdt[t * P + p];
            float acc = 0.f;
            for (int64_t n = n0; n < N; n++) {
                s[n] = s[n] * dA[t] + xp * b[n];
                acc += s[n] * c[n];
            }
            y[t * y_stride + p] += acc;
        }
    }
}

/* -- AVX2 ------------------------------------------------------------------------------------ */
#ifdef KVFLOW_AVX2
/* as the AVX-512 path (below): W strips of 8 columns, one pass over them per token */
#define GDN_STRIPS_AVX2(W)                                                                     \
    do {                                                                                         \
        __m256 kv[W], d[W], acc[W], nkv[W];                                                      \
        for (int w = 0; w < W; w++) kv[w] = _mm256_setzero_ps();                                 \
        for (int64_t i = 0; i < dk; i++)                                                         \
            for (int w = 0; w < W; w++)                                                          \
                kv[w] = _mm256_fmadd_ps(_mm256_loadu_ps(S + i * dv + j + 8 * w),                \
                                        _mm256_set1_ps(k[i]), kv[w]);                            \
        for (int64_t t = 0; t < nb; t++) {                                                       \
            const float *kt = k + t * dk, *qt = q + t * dk;                                      \
            const float *kn = t + 1 < nb ? kt + dk : kt; /* the last token's: unused */          \
            const __m256 veg = _mm256_set1_ps(eg[t]), vb = _mm256_set1_ps(beta[t]);              \
            for (int w = 0; w < W; w++) {                                                        \
                d[w] = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(v + t * dv + j + 8 * w),     \
                                                   _mm256_mul_ps(kv[w], veg)), vb);              \
                acc[w] = nkv[w] = _mm256_setzero_ps();                                           \
            }                                                                                    \
            for (int64_t i = 0; i < dk; i++) {                                                   \
                const __m256 vk = _mm256_set1_ps(kt[i]), vq = _mm256_set1_ps(qt[i]);             \
                const __m256 vn = _mm256_set1_ps(kn[i]);                                         \
                for (int w = 0; w < W; w++) {                                                    \
                    float *s = S + i * dv + j + 8 * w;                                          \
                    const __m256 x = _mm256_fmadd_ps(vk, d[w], _mm256_mul_ps(_mm256_loadu_ps(s), veg)); \
                    _mm256_storeu_ps(s, x);                                                      \
                    acc[w] = _mm256_fmadd_ps(x, vq, acc[w]);                                     \
                    nkv[w] = _mm256_fmadd_ps(x, vn, nkv[w]);                                     \
                }                                                                                \
            }                                                                                    \
            for (int w = 0; w < W; w++) {                                                        \
                _mm256_storeu_ps(o + t * o_stride + j + 8 * w, acc[w]);                         \
                kv[w] = nkv[w];                                                                  \
            }                                                                                    \
        }                                                                                        \
    } while (0)

static void gdn_tokens_avx2(float *S, int64_t dk, int64_t dv, int64_t j0, int64_t je, int64_t nb, const float *q,
                            const float *k, const float *v, const float *eg, const float *beta,
                            float *o, int64_t o_stride)
{
    int64_t j = j0;
    for (; j + 16 <= je; j += 16) GDN_STRIPS_AVX2(2);
    for (; j + 8 <= je; j += 8) GDN_STRIPS_AVX2(1);
    if (j < je) gdn_tokens_columns(S, dk, dv, j, je, nb, q, k, v, eg, beta, o, o_stride);
}
#undef GDN_STRIPS_AVX2

/* as the AVX-512 path (below): R rows of S, 32 columns each, in registers for all nb tokens */
#define SSM_ROWS_AVX2(R)                                                                       \
    do {                                                                                         \
        __m256 st[R][4];                                                                         \
        for (int r = 0; r < R; r++)                                                              \
            for (int v = 0; v < 4; v++) st[r][v] = _mm256_loadu_ps(S + (p + r) * N + n0 + 8 * v); \
        for (int64_t t = 0; t < nb; t++) {                                                       \
            const float *b = B + t * N + n0, *c = C + t * N + n0;                                \
            const __m256 vda = _mm256_set1_ps(dA[t]);                                            \
            __m256 bv[4], cv[4];                                                                 \
            for (int v = 0; v < 4; v++) {                                                        \
                bv[v] = _mm256_loadu_ps(b + 8 * v);                                             \
                cv[v] = _mm256_loadu_ps(c + 8 * v);                                             \
            }                                                                                    \
            for (int r = 0; r < R; r++) {                                                        \
                const __m256 vx = _mm256_set1_ps(xdt[t * P + p + r]);                            \
                for (int v = 0; v < 4; v++)                                                      \
                    st[r][v] = _mm256_fmadd_ps(vx, bv[v], _mm256_mul_ps(st[r][v], vda));         \
                __m256 acc = _mm256_mul_ps(st[r][0], cv[0]);                                     \
                for (int v = 1; v < 4; v++) acc = _mm256_fmadd_ps(st[r][v], cv[v], acc);         \
                y[t * y_stride + p + r] += hsum8(acc);                            \
            }                                                                                    \
        }                                                                                        \
        for (int r = 0; r < R; r++)                                                              \
            for (int v = 0; v < 4; v++) _mm256_storeu_ps(S + (p + r) * N + n0 + 8 * v, st[r][v]); \
    } while (0)

static void ssm_tokens_avx2(float *S, int64_t P, int64_t N, int64_t nb, const float *dA,
                            const float *xdt, const float *B, const float *C, float *y,
                            int64_t y_stride)
{
    int64_t n0 = 0;
    for (; n0 + 32 <= N; n0 += 32) {
        int64_t p = 0;
        for (; p + 2 <= P; p += 2) SSM_ROWS_AVX2(2);
        for (; p < P; p++) SSM_ROWS_AVX2(1);
    }
    if (n0 < N) ssm_tokens_columns(S, P, N, n0, nb, dA, xdt, B, C, y, y_stride);
}
#undef SSM_ROWS_AVX2
#endif

/* -- AVX-512 --------------------------------------------------------------------------------- */
#ifdef __AVX512F__
/* W strips of 16 columns (W = 2, or 1 for the last odd one) through nb tokens, one pass over
 * the strips per token: the pass that writes S_t also reads S_t^T q_t (the output) and
 * S_t^T k_{t+1} (the next token's read), so only the block's first token needs a pass of its
 * own. The strips (dk rows x 64 bytes each) stay in L1 across the block. */
#define GDN_STRIPS_AVX512(W)                                                                     \
    do {                                                                                         \
        __m512 kv[W], d[W], acc[W], nkv[W];                                                      \
        for (int w = 0; w < W; w++) kv[w] = _mm512_setzero_ps();                                 \
        for (int64_t i = 0; i < dk; i++)                                                         \
            for (int w = 0; w < W; w++)                                                          \
                kv[w] = _mm512_fmadd_ps(_mm512_loadu_ps(S + i * dv + j + 16 * w),                \
                                        _mm512_set1_ps(k[i]), kv[w]);                            \
        for (int64_t t = 0; t < nb; t++) {                                                       \
            const float *kt = k + t * dk, *qt = q + t * dk;                                      \
            const float *kn = t + 1 < nb ? kt + dk : kt; /* the last token's: unused */          \
            const __m512 veg = _mm512_set1_ps(eg[t]), vb = _mm512_set1_ps(beta[t]);              \
            for (int w = 0; w < W; w++) {                                                        \
                d[w] = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(v + t * dv + j + 16 * w),     \
                                                   _mm512_mul_ps(kv[w], veg)), vb);              \
                acc[w] = nkv[w] = _mm512_setzero_ps();                                           \
            }                                                                                    \
            for (int64_t i = 0; i < dk; i++) {                                                   \
                const __m512 vk = _mm512_set1_ps(kt[i]), vq = _mm512_set1_ps(qt[i]);             \
                const __m512 vn = _mm512_set1_ps(kn[i]);                                         \
                for (int w = 0; w < W; w++) {                                                    \
                    float *s = S + i * dv + j + 16 * w;                                          \
                    const __m512 x = _mm512_fmadd_ps(vk, d[w], _mm512_mul_ps(_mm512_loadu_ps(s), veg)); \
                    _mm512_storeu_ps(s, x);                                                      \
                    acc[w] = _mm512_fmadd_ps(x, vq, acc[w]);                                     \
                    nkv[w] = _mm512_fmadd_ps(x, vn, nkv[w]);                                     \
                }                                                                                \
            }                                                                                    \
            for (int w = 0; w < W; w++) {                                                        \
                _mm512_storeu_ps(o + t * o_stride + j + 16 * w, acc[w]);                         \
                kv[w] = nkv[w];                                                                  \
            }                                                                                    \
        }                                                                                        \
    } while (0)

static void gdn_tokens_avx512(float *S, int64_t dk, int64_t dv, int64_t j0, int64_t je, int64_t nb, const float *q,
                              const float *k, const float *v, const float *eg, const float *beta,
                              float *o, int64_t o_stride)
{
    int64_t j = j0;
    for (; j + 32 <= je; j += 32) GDN_STRIPS_AVX512(2);
    for (; j + 16 <= je; j += 16) GDN_STRIPS_AVX512(1);
    if (j < je) gdn_tokens_columns(S, dk, dv, j, je, nb, q, k, v, eg, beta, o, o_stride);
}
#undef GDN_STRIPS_AVX512

/* R rows of S (p .. p + R - 1), 64 columns each from n0, in registers for all nb tokens; the
 * rows share each token's B and C loads, and their R independent chains keep the FMA units
 * busy (one row alone waits on its multiply-add latency token after token) */
#define SSM_ROWS_AVX512(R)                                                                       \
    do {                                                                                         \
        __m512 st[R][4];                                                                         \
        for (int r = 0; r < R; r++)                                                              \
            for (int v = 0; v < 4; v++) st[r][v] = _mm512_loadu_ps(S + (p + r) * N + n0 + 16 * v); \
        for (int64_t t = 0; t < nb; t++) {                                                       \
            const float *b = B + t * N + n0, *c = C + t * N + n0;                                \
            const __m512 vda = _mm512_set1_ps(dA[t]);                                            \
            __m512 bv[4], cv[4];                                                                 \
            for (int v = 0; v < 4; v++) {                                                        \
                bv[v] = _mm512_loadu_ps(b + 16 * v);                                             \
                cv[v] = _mm512_loadu_ps(c + 16 * v);                                             \
            }                                                                                    \
            for (int r = 0; r < R; r++) {                                                        \
                const __m512 vx = _mm512_set1_ps(xdt[t * P + p + r]);                            \
                for (int v = 0; v < 4; v++)                                                      \
                    st[r][v] = _mm512_fmadd_ps(vx, bv[v], _mm512_mul_ps(st[r][v], vda));         \
                __m512 acc = _mm512_mul_ps(st[r][0], cv[0]);                                     \
                for (int v = 1; v < 4; v++) acc = _mm512_fmadd_ps(st[r][v], cv[v], acc);         \
                y[t * y_stride + p + r] += _mm512_reduce_add_ps(acc);                            \
            }                                                                                    \
        }                                                                                        \
        for (int r = 0; r < R; r++)                                                              \
            for (int v = 0; v < 4; v++) _mm512_storeu_ps(S + (p + r) * N + n0 + 16 * v, st[r][v]); \
    } while (0)

static void ssm_tokens_avx512(float *S, int64_t P, int64_t N, int64_t nb, const float *dA,
                              const float *xdt, const float *B, const float *C, float *y,
                              int64_t y_stride)
{
    int64_t n0 = 0;
    for (; n0 + 64 <= N; n0 += 64) {
        int64_t p = 0;
        for (; p + 2 <= P; p += 2) SSM_ROWS_AVX512(2);
        for (; p < P; p++) SSM_ROWS_AVX512(1);
    }
    if (n0 < N) ssm_tokens_columns(S, P, N, n0, nb, dA, xdt, B, C, y, y_stride);
}
#undef SSM_ROWS_AVX512
#endif

/* the next block of a chunk's tokens from t0 (of n): SCAN_BLOCK at most, ending after token
 * `after` where the block holds it (the snapshot's point) */
static int64_t block_end(int64_t t0, int64_t n, int64_t after)
{
    const int64_t end = t0 + SCAN_BLOCK < n ? t0 + SCAN_BLOCK : n;
    return after >= t0 && after < end ? after + 1 : end;
}

/* Gated DeltaNet over prompt chunks. Chunk i: tokens [starts[i], starts[i] + lens[i]) of x
 * [T][x_stride] (the conv's output q|k|v: nk * dk, nk * dk, nv * dv channels) and ba
 * [T][ba_stride] (b's nv values, then a's), its state in slot slots[i] of state
 * [slots][nv][dk][dv] fp32; snap_slot[i] >= 0 gets the state after its token snap_after[i]
 * (both NULL: no snapshots). out [T][nv][dv] fp32. Units: (i * nv + h) * cols + c, each
 * head's columns in `cols` groups (1, unless there are more threads than heads to split). */
void gdn_chunk_rows(const void *x, int64_t x_stride, const void *ba, int64_t ba_stride,
                    const float *A_log, const float *dt_bias, float *state, const int64_t *starts,
                    const int64_t *lens, const int64_t *slots, const int64_t *snap_after,
                    const int64_t *snap_slot, float *out, int64_t nk, int64_t nv, int64_t dk,
                    int64_t dv, int64_t cols, int64_t bf16, int64_t isa, int64_t begin, int64_t end)
{
    const int bf = (int)bf16;
    const int64_t groups = nv / nk, head = dk * dv, width = (dv / cols + 15) / 16 * 16;
    const float scale = 1.f / sqrtf((float)dk);
    float *buf = malloc(sizeof(float) * SCAN_BLOCK * (2 * dk + dv + 2));
    if (!buf) abort();
    float *q = buf, *k = q + SCAN_BLOCK * dk, *v = k + SCAN_BLOCK * dk, *eg = v + SCAN_BLOCK * dv;
    float *beta = eg + SCAN_BLOCK;
    for (int64_t u = begin; u < end; u++) {
        const int64_t i = u / cols / nv, h = u / cols % nv, kh = h / groups, n = lens[i];
        const int64_t j0 = u % cols * width, je = j0 + width < dv ? j0 + width : dv;
        const int64_t after = snap_slot && snap_slot[i] >= 0 ? snap_after[i] : -1;
        const float A = -expf(A_log[h]);
        float *S = state + (slots[i] * nv + h) * head;
        if (j0 >= je) continue;
        for (int64_t t0 = 0, t1; t0 < n; t0 = t1) {
            t1 = block_end(t0, n, after);
            for (int64_t t = t0; t < t1; t++) { /* this block's inputs, as the one-token step's */
                const int64_t row = starts[i] + t, xr = row * x_stride, b = t - t0;
                float *qb = q + b * dk, *kb = k + b * dk, sq = 0.f, sk = 0.f;
                for (int64_t c = 0; c < dk; c++) {
                    qb[c] = ld(x, bf, xr + kh * dk + c);
                    kb[c] = ld(x, bf, xr + nk * dk + kh * dk + c);
                    sq += qb[c] * qb[c];
                    sk += kb[c] * kb[c];
                }
                const float iq = 1.f / sqrtf(sq + 1e-6f), ik = 1.f / sqrtf(sk + 1e-6f);
                for (int64_t c = 0; c < dk; c++) {
                    qb[c] = qb[c] * iq * scale;
                    kb[c] *= ik;
                }
                for (int64_t c = j0; c < je; c++) v[b * dv + c] = ld(x, bf, xr + 2 * nk * dk + h * dv + c);
                beta[b] = round_to(bf, 1.f / (1.f + expf(-ld(ba, bf, row * ba_stride + h))));
                eg[b] = expf(A * softplus(ld(ba, bf, row * ba_stride + nv + h) + dt_bias[h]));
            }
            float *o = out + ((starts[i] + t0) * nv + h) * dv;
            if (isa == 2) {
#ifdef __AVX512F__
                gdn_tokens_avx512(S, dk, dv, j0, je, t1 - t0, q, k, v, eg, beta, o, nv * dv);
#endif
            } else if (isa == 1) {
#ifdef KVFLOW_AVX2
                gdn_tokens_avx2(S, dk, dv, j0, je, t1 - t0, q, k, v, eg, beta, o, nv * dv);
#endif
            } else {
                gdn_tokens_columns(S, dk, dv, j0, je, t1 - t0, q, k, v, eg, beta, o, nv * dv);
            }
            if (t1 - 1 == after) /* this unit's columns of the state, into the snapshot's */
                for (int64_t r = 0; r < dk; r++)
                    memcpy(state + (snap_slot[i] * nv + h) * head + r * dv + j0, S + r * dv + j0,
                           sizeof(float) * (size_t)(je - j0));
        }
    }
    free(buf);
}

/* Mamba2's SSD over prompt chunks. Chunk i: tokens [starts[i], starts[i] + lens[i]) of x
 * [T][x_stride] (the conv's output x|B|C: nh * P, G * N, G * N channels) and dt
 * [T][dt_stride] (nh raw values: softplus(dt + dt_bias) clamped to [dt_min, dt_max]), its
 * state in slot slots[i] of state [slots][nh][P][N] fp32; snapshots as gdn_chunk_rows'.
 * y [T][nh][P] fp32 (without D x). Units: i * nh + h. */
void ssm_chunk_rows(const void *x, int64_t x_stride, const void *dt, int64_t dt_stride,
                    const float *A_log, const float *dt_bias, float *state, const int64_t *starts,
                    const int64_t *lens, const int64_t *slots, const int64_t *snap_after,
                    const int64_t *snap_slot, float *y, int64_t nh, int64_t G, int64_t P,
                    int64_t N, float dt_min, float dt_max, int64_t bf16, int64_t isa,
                    int64_t begin, int64_t end)
{
    const int bf = (int)bf16;
    const int64_t per_group = nh / G, head = P * N;
    float *buf = malloc(sizeof(float) * SCAN_BLOCK * (P + 2 * N + 1));
    if (!buf) abort();
    float *xdt = buf, *B = xdt + SCAN_BLOCK * P, *C = B + SCAN_BLOCK * N, *dA = C + SCAN_BLOCK * N;
    for (int64_t u = begin; u < end; u++) {
        const int64_t i = u / nh, h = u % nh, g = h / per_group, n = lens[i];
        const int64_t after = snap_slot && snap_slot[i] >= 0 ? snap_after[i] : -1;
        const float A = -expf(A_log[h]);
        float *S = state + (slots[i] * nh + h) * head;
        for (int64_t t0 = 0, t1; t0 < n; t0 = t1) {
            t1 = block_end(t0, n, after);
            for (int64_t t = t0; t < t1; t++) { /* this block's inputs, as the one-token step's */
                const int64_t row = starts[i] + t, xr = row * x_stride, b = t - t0;
                float d = softplus(ld(dt, bf, row * dt_stride + h) + dt_bias[h]);
                d = d < dt_min ? dt_min : d > dt_max ? dt_max : d;
                dA[b] = expf(d * A);
                for (int64_t p = 0; p < P; p++) xdt[b * P + p] = ld(x, bf, xr + h * P + p) * d;
                for (int64_t c = 0; c < N; c++) {
                    B[b * N + c] = ld(x, bf, xr + nh * P + g * N + c);
                    C[b * N + c] = ld(x, bf, xr + nh * P + G * N + g * N + c);
                }
                memset(y + (row * nh + h) * P, 0, sizeof(float) * P);
            }
            float *o = y + ((starts[i] + t0) * nh + h) * P;
            if (isa == 2) {
#ifdef __AVX512F__
                ssm_tokens_avx512(S, P, N, t1 - t0, dA, xdt, B, C, o, nh * P);
#endif
            } else if (isa == 1) {
#ifdef KVFLOW_AVX2
                ssm_tokens_avx2(S, P, N, t1 - t0, dA, xdt, B, C, o, nh * P);
#endif
            } else {
                ssm_tokens_columns(S, P, N, 0, t1 - t0, dA, xdt, B, C, o, nh * P);
            }
            if (t1 - 1 == after) memcpy(state + (snap_slot[i] * nh + h) * head, S, sizeof(float) * head);
        }
    }
    free(buf);
}
