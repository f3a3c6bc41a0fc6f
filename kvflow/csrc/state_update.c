/* The state layers' kernels (kvflow/layers: short_conv.py, gated_deltanet.py, mamba2.py), each
 * reading and writing the per-request states in their slots in place (no gather, no scatter):
 *
 *   causal_conv_rows   the causal depthwise convolution of each request's tokens over its
 *                      window (state [slots][taps][C] then the tokens), optional bias and SiLU,
 *                      then the window's last taps rows become the state (and a snapshot's, for
 *                      a prefix-cache save after a given token); a decode is a one-token chunk.
 *                      Work units: (request, block of CONV_BLOCK channels).
 *   gdn_decode_rows    Gated DeltaNet's recurrent step for one token of a request, per value
 *                      head: q, k L2-normalised (q scaled by dk^-0.5), beta = sigmoid(b),
 *                      g = -exp(A_log) softplus(a + dt_bias), then
 *                          S <- exp(g) S;  S <- S + k (beta (v - S^T k))^T;  o = S^T q
 *                      S [dk][dv] fp32. Work units: (request, value head).
 *   ssm_decode_rows    Mamba2's selective state update for one token, per head: dt =
 *                      softplus(dt + dt_bias) clamped, then
 *                          S <- exp(dt A) S + dt x B^T;  y = S C      (the D skip is the caller's)
 *                      S [P][N] fp32. Work units: (request, head).
 *   ssm_gated_norm_rows  then, in a decode-only step, the D skip, the gate silu(z) and the
 *                      RMSNorm over each group's channels, times the weight, rounded once
 *                      into the model dtype. Work units: rows.
 *
 * Activations are the model's dtype (bf16 or fp32, `bf16` flags); sums in fp32, each in the
 * PyTorch reference's order up to FMA contraction (fp32 rounding). Paths (chosen at load,
 * passed as `isa`): 0 scalar (the tests' reference), 1 AVX2 + FMA, 2 AVX-512. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"
#include "simd.h"
#include "state.h"

#define CONV_BLOCK 128   /* channels per conv work unit */
#define CONV_MAX_TAPS 8  /* kernel sizes up to this (the models': 3 and 4) */
#define HEAD_MAX 512     /* dk, dv, P and N up to this (state_update.py checks) */

/* the conv's output for one channel: bias, rounding to the model dtype, then SiLU (PyTorch's
 * F.silu on the rounded tensor) */
static inline float conv_finish(float acc, const float *bias, int64_t c, int bf, int silu)
{
    if (bias) acc += bias[c];
    acc = round_to(bf, acc);
    return silu ? acc / (1.f + expf(-acc)) : acc;
}

/* -- scalar ------------------------------------------------------------------------------- */
static void conv_scalar(const float *wt, int64_t K, int64_t cb, const void *const *src, int bf,
                        const float *bias, int silu, void *dst)
{
    for (int64_t c = 0; c < cb; c++) {
        float acc = 0.f;
        for (int64_t j = 0; j < K; j++) acc += ld(src[j], bf, c) * wt[j * CONV_BLOCK + c];
        st(dst, bf, c, conv_finish(acc, bias, c, bf, silu));
    }
}

/* one head's step over columns [j0, dv) of S [dk][dv]: kv = (eg S)^T k, delta = beta (v - kv),
 * S <- eg S + k delta^T, o = S^T q (the vector paths' tails, and the scalar path: j0 = 0) */
static void gdn_head_columns(float *S, int64_t dk, int64_t dv, int64_t j0, float eg, float beta,
                             const float *k, const float *v, const float *q, float *o)
{
    float kv[HEAD_MAX];
    for (int64_t j = j0; j < dv; j++) kv[j] = 0.f;
    for (int64_t i = 0; i < dk; i++)
        for (int64_t j = j0; j < dv; j++) kv[j] += S[i * dv + j] * eg * k[i];
    for (int64_t j = j0; j < dv; j++) {
        kv[j] = (v[j] - kv[j]) * beta;
        o[j] = 0.f;
    }
    for (int64_t i = 0; i < dk; i++)
        for (int64_t j = j0; j < dv; j++) {
            const float s = S[i * dv + j] * eg + k[i] * kv[j];
            S[i * dv + j] = s;
            o[j] += s * q[i];
        }
}

static void ssm_scalar(float *S, int64_t P, int64_t N, float dA, const float *xdt,
                       const float *B, const float *C, float *y)
{
    for (int64_t p = 0; p < P; p++) {
        float acc = 0.f;
        for (int64_t n = 0; n < N; n++) {
            const float s = S[p * N + n] * dA + xdt[p] * B[n];
            S[p * N + n] = s;
            acc += s * C[n];
        }
        y[p] = acc;
    }
}

/* -- AVX2 --------------------------------------------------------------------------------- */
#ifdef KVFLOW_AVX2
#define STATE_AVX2 1
/* fp32 -> bf16 bits (nearest even) in the low half of each lane; NaN not kept (activations) */
static inline __m256i bf16_bits8(__m256 v)
{
    const __m256i u = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    return _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd)), 16);
}
static inline __m256 ld8(const void *p, int bf, int64_t i)
{
    return bf ? load8_bf16((const uint16_t *)p + i) : _mm256_loadu_ps((const float *)p + i);
}
static inline __m256 round8(int bf, __m256 v)
{
    return bf ? _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits8(v), 16)) : v;
}
static inline void st8(void *p, int bf, int64_t i, __m256 v)
{
    if (bf) {
        const __m256i b = bf16_bits8(v);
        const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
        _mm_storeu_si128((__m128i *)((uint16_t *)p + i), packed);
    } else {
        _mm256_storeu_ps((float *)p + i, v);
    }
}

static void conv_avx2(const float *wt, int64_t K, int64_t cb, const void *const *src, int bf,
                      const float *bias, int silu, void *dst)
{
    int64_t c = 0;
    for (; c + 8 <= cb; c += 8) {
        __m256 acc = _mm256_mul_ps(ld8(src[0], bf, c), _mm256_loadu_ps(wt + c));
        for (int64_t j = 1; j < K; j++)
            acc = _mm256_fmadd_ps(ld8(src[j], bf, c), _mm256_loadu_ps(wt + j * CONV_BLOCK + c), acc);
        if (bias) acc = _mm256_add_ps(acc, _mm256_loadu_ps(bias + c));
        acc = round8(bf, acc);
        if (silu)
            acc = _mm256_div_ps(acc, _mm256_add_ps(_mm256_set1_ps(1.f),
                                                   exp8(_mm256_sub_ps(_mm256_setzero_ps(), acc))));
        st8(dst, bf, c, acc);
    }
    for (; c < cb; c++) {
        float acc = 0.f;
        for (int64_t j = 0; j < K; j++) acc += ld(src[j], bf, c) * wt[j * CONV_BLOCK + c];
        st(dst, bf, c, conv_finish(acc, bias, c, bf, silu));
    }
}

/* one head's step, 8 columns of S at a time: its S^T k read, then (the column block still in
 * L1) its update and output; S crosses the memory once */
static void gdn_head_avx2(float *S, int64_t dk, int64_t dv, float eg, float beta, const float *k,
                          const float *v, const float *q, float *o)
{
    const __m256 veg = _mm256_set1_ps(eg);
    int64_t j = 0;
    for (; j + 8 <= dv; j += 8) {
        __m256 kv = _mm256_setzero_ps();
        for (int64_t i = 0; i < dk; i++)
            kv = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_loadu_ps(S + i * dv + j), veg),
                                 _mm256_set1_ps(k[i]), kv);
        const __m256 d = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(v + j), kv), _mm256_set1_ps(beta));
        __m256 acc = _mm256_setzero_ps();
        for (int64_t i = 0; i < dk; i++) {
            float *s = S + i * dv + j;
            const __m256 x = _mm256_fmadd_ps(_mm256_set1_ps(k[i]), d, _mm256_mul_ps(_mm256_loadu_ps(s), veg));
            _mm256_storeu_ps(s, x);
            acc = _mm256_fmadd_ps(x, _mm256_set1_ps(q[i]), acc);
        }
        _mm256_storeu_ps(o + j, acc);
    }
    if (j < dv) gdn_head_columns(S, dk, dv, j, eg, beta, k, v, q, o);
}

static void ssm_avx2(float *S, int64_t P, int64_t N, float dA, const float *xdt, const float *B,
                     const float *C, float *y)
{
    const __m256 vda = _mm256_set1_ps(dA);
    for (int64_t p = 0; p < P; p++) {
        float *s = S + p * N;
        const __m256 vx = _mm256_set1_ps(xdt[p]);
        __m256 acc = _mm256_setzero_ps();
        int64_t n = 0;
        for (; n + 8 <= N; n += 8) {
            const __m256 v = _mm256_fmadd_ps(vx, _mm256_loadu_ps(B + n), _mm256_mul_ps(_mm256_loadu_ps(s + n), vda));
            _mm256_storeu_ps(s + n, v);
            acc = _mm256_fmadd_ps(v, _mm256_loadu_ps(C + n), acc);
        }
        float tail = 0.f;
        for (; n < N; n++) {
            s[n] = s[n] * dA + xdt[p] * B[n];
            tail += s[n] * C[n];
        }
        y[p] = hsum8(acc) + tail;
    }
}
#endif

/* -- AVX-512 ------------------------------------------------------------------------------ */
#ifdef __AVX512F__
#define STATE_AVX512 1
static inline __m512i bf16_bits16(__m512 v)
{
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    return _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd)), 16);
}
static inline __m512 ld16(const void *p, int bf, int64_t i)
{
    return bf ? load16_bf16((const uint16_t *)p + i) : _mm512_loadu_ps((const float *)p + i);
}
static inline __m512 round16(int bf, __m512 v)
{
    return bf ? _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits16(v), 16)) : v;
}
static inline void st16(void *p, int bf, int64_t i, __m512 v)
{
    if (bf) _mm256_storeu_si256((__m256i *)((uint16_t *)p + i), _mm512_cvtepi32_epi16(bf16_bits16(v)));
    else _mm512_storeu_ps((float *)p + i, v);
}

static void conv_avx512(const float *wt, int64_t K, int64_t cb, const void *const *src, int bf,
                        const float *bias, int silu, void *dst)
{
    int64_t c = 0;
    for (; c + 16 <= cb; c += 16) {
        __m512 acc = _mm512_mul_ps(ld16(src[0], bf, c), _mm512_loadu_ps(wt + c));
        for (int64_t j = 1; j < K; j++)
            acc = _mm512_fmadd_ps(ld16(src[j], bf, c), _mm512_loadu_ps(wt + j * CONV_BLOCK + c), acc);
        if (bias) acc = _mm512_add_ps(acc, _mm512_loadu_ps(bias + c));
        acc = round16(bf, acc);
        if (silu)
            acc = _mm512_div_ps(acc, _mm512_add_ps(_mm512_set1_ps(1.f),
                                                   exp16(_mm512_sub_ps(_mm512_setzero_ps(), acc))));
        st16(dst, bf, c, acc);
    }
    for (; c < cb; c++) {
        float acc = 0.f;
        for (int64_t j = 0; j < K; j++) acc += ld(src[j], bf, c) * wt[j * CONV_BLOCK + c];
        st(dst, bf, c, conv_finish(acc, bias, c, bf, silu));
    }
}

static void gdn_head_avx512(float *S, int64_t dk, int64_t dv, float eg, float beta,
                            const float *k, const float *v, const float *q, float *o)
{
    const __m512 veg = _mm512_set1_ps(eg);
    int64_t j = 0;
    for (; j + 16 <= dv; j += 16) {
        __m512 kv = _mm512_setzero_ps();
        for (int64_t i = 0; i < dk; i++)
            kv = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_loadu_ps(S + i * dv + j), veg),
                                 _mm512_set1_ps(k[i]), kv);
        const __m512 d = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(v + j), kv), _mm512_set1_ps(beta));
        __m512 acc = _mm512_setzero_ps();
        for (int64_t i = 0; i < dk; i++) {
            float *s = S + i * dv + j;
            const __m512 x = _mm512_fmadd_ps(_mm512_set1_ps(k[i]), d, _mm512_mul_ps(_mm512_loadu_ps(s), veg));
            _mm512_storeu_ps(s, x);
            acc = _mm512_fmadd_ps(x, _mm512_set1_ps(q[i]), acc);
        }
        _mm512_storeu_ps(o + j, acc);
    }
    if (j < dv) gdn_head_columns(S, dk, dv, j, eg, beta, k, v, q, o);
}

static void ssm_avx512(float *S, int64_t P, int64_t N, float dA, const float *xdt,
                       const float *B, const float *C, float *y)
{
    const __m512 vda = _mm512_set1_ps(dA);
    for (int64_t p = 0; p < P; p++) {
        float *s = S + p * N;
        const __m512 vx = _mm512_set1_ps(xdt[p]);
        __m512 acc = _mm512_setzero_ps();
        int64_t n = 0;
        for (; n + 16 <= N; n += 16) {
            const __m512 v = _mm512_fmadd_ps(vx, _mm512_loadu_ps(B + n), _mm512_mul_ps(_mm512_loadu_ps(s + n), vda));
            _mm512_storeu_ps(s + n, v);
            acc = _mm512_fmadd_ps(v, _mm512_loadu_ps(C + n), acc);
        }
        float tail = 0.f;
        for (; n < N; n++) {
            s[n] = s[n] * dA + xdt[p] * B[n];
            tail += s[n] * C[n];
        }
        y[p] = _mm512_reduce_add_ps(acc) + tail;
    }
}
#endif

int64_t state_update_isas(void)
{
    int64_t isas = 1;
#ifdef STATE_AVX2
    isas |= 2;
#endif
#ifdef STATE_AVX512
    isas |= 4;
#endif
    return isas;
}

/* The conv over requests' tokens. x [T][x_stride] and out [T][out_stride] (channels
 * contiguous), state [slots][taps][C], all in the model dtype (`bf16`); weight [C][K] and bias
 * [C] (or NULL) too. Request i: tokens [starts[i], starts[i] + lens[i]), its state in slot
 * slots[i]; snap_slot[i] >= 0 keeps the window after its token snap_after[i] there (both
 * NULL: no snapshots). Units:
 * i * blocks + b for blocks = ceil(C / CONV_BLOCK). */
void causal_conv_rows(const void *x, int64_t x_stride, void *out, int64_t out_stride, void *state,
                      const void *weight, const void *bias, const int64_t *starts,
                      const int64_t *lens, const int64_t *slots, const int64_t *snap_after,
                      const int64_t *snap_slot, int64_t C, int64_t K, int64_t bf16, int64_t silu,
                      int64_t isa, int64_t begin, int64_t end)
{
    const int bf = (int)bf16, esz = bf ? 2 : 4;
    const int64_t taps = K - 1, blocks = (C + CONV_BLOCK - 1) / CONV_BLOCK;
    float wt[CONV_MAX_TAPS * CONV_BLOCK], b[CONV_BLOCK];
    for (int64_t u = begin; u < end; u++) {
        const int64_t i = u / blocks, c0 = (u % blocks) * CONV_BLOCK;
        const int64_t cb = C - c0 < CONV_BLOCK ? C - c0 : CONV_BLOCK, n = lens[i];
        if (n == 0) continue;
        for (int64_t c = 0; c < cb; c++) {
            for (int64_t j = 0; j < K; j++) wt[j * CONV_BLOCK + c] = ld(weight, bf, (c0 + c) * K + j);
            if (bias) b[c] = ld(bias, bf, c0 + c);
        }
        char *own = (char *)state + slots[i] * taps * C * esz;
        /* row r of the request's window: its state's rows, then its tokens */
#define WINDOW(r) ((r) < taps ? own + ((r) * C + c0) * esz \
                              : (const char *)x + ((starts[i] + (r) - taps) * x_stride + c0) * esz)
        for (int64_t t = 0; t < n; t++) {
            const void *src[CONV_MAX_TAPS];
            for (int64_t j = 0; j < K; j++) src[j] = WINDOW(t + j);
            void *dst = (char *)out + ((starts[i] + t) * out_stride + c0) * esz;
            const float *bp = bias ? b : NULL;
            if (isa == 2) {
#ifdef STATE_AVX512
                conv_avx512(wt, K, cb, src, bf, bp, (int)silu, dst);
#endif
            } else if (isa == 1) {
#ifdef STATE_AVX2
                conv_avx2(wt, K, cb, src, bf, bp, (int)silu, dst);
#endif
            } else {
                conv_scalar(wt, K, cb, src, bf, bp, (int)silu, dst);
            }
        }
        if (snap_slot && snap_slot[i] >= 0) { /* before the state moves on: it may read the state's rows */
            char *snap = (char *)state + snap_slot[i] * taps * C * esz;
            for (int64_t r = 0; r < taps; r++)
                memcpy(snap + (r * C + c0) * esz, WINDOW(snap_after[i] + 1 + r), (size_t)(cb * esz));
        }
        for (int64_t r = 0; r < taps; r++) /* rows move up: row r reads row n + r > r */
            memmove(own + (r * C + c0) * esz, WINDOW(n + r), (size_t)(cb * esz));
#undef WINDOW
    }
}

/* Gated DeltaNet's gated norm of one head's output o [dv] (overwritten): RMSNorm with eps
 * over o rounded to the model dtype, times norm [dv], times silu(z) (z [dv]), each rounding of
 * the layer's _gated_norm kept, into dst [dv] in the model dtype. */
static void gated_norm_head(float *o, int64_t dv, const void *z, const void *norm, float eps, int bf,
                            void *dst)
{
    float ss = 0.f;
    for (int64_t j = 0; j < dv; j++) {
        o[j] = round_to(bf, o[j]);
        ss += o[j] * o[j];
    }
    const float inv = 1.f / sqrtf(ss / (float)dv + eps);
    for (int64_t j = 0; j < dv; j++) {
        const float zj = ld(z, bf, j);
        const float n = round_to(bf, round_to(bf, o[j] * inv) * ld(norm, bf, j));
        st(dst, bf, j, n * (zj / (1.f + expf(-zj))));
    }
}

/* Gated DeltaNet's step for one token of each request r: its token's row rows[r] of x
 * [T][x_stride] (the conv's output q|k|v: nk * dk, nk * dk, nv * dv channels) and of ba
 * [T][ba_stride] (b's nv values, then a's), its state in slot slots[r] of state
 * [slots][nv][dk][dv]; out [T][nv][dv] fp32. With z (the gate, [T][z_stride], nv * dv
 * values a row) the head's output is gated-normed as the layer's _gated_norm does (RMSNorm
 * with eps, times norm [dv], times silu(z), each rounding of the model dtype kept) into gated
 * [T][gated_stride] in the model dtype instead, and out is not written. Units: r * nv + h. */
void gdn_decode_rows(const void *x, int64_t x_stride, const void *ba, int64_t ba_stride,
                     const float *A_log, const float *dt_bias, float *state,
                     const int64_t *rows, const int64_t *slots, float *out, int64_t nk,
                     int64_t nv, int64_t dk, int64_t dv, const void *z, int64_t z_stride,
                     const void *norm, float eps, void *gated, int64_t gated_stride,
                     int64_t bf16, int64_t isa, int64_t begin, int64_t end)
{
    const int bf = (int)bf16;
    const int64_t groups = nv / nk;
    const float scale = 1.f / sqrtf((float)dk);
    float q[HEAD_MAX], k[HEAD_MAX], v[HEAD_MAX];
    int64_t normed = -1; /* the (row, k head) q and k hold */
    for (int64_t u = begin; u < end; u++) {
        const int64_t r = u / nv, h = u % nv, kh = h / groups, row = rows[r];
        const int64_t xr = row * x_stride;
        if (normed != r * nk + kh) { /* l2norm(q) * dk^-0.5, l2norm(k) */
            float sq = 0.f, sk = 0.f;
            for (int64_t i = 0; i < dk; i++) {
                q[i] = ld(x, bf, xr + kh * dk + i);
                k[i] = ld(x, bf, xr + nk * dk + kh * dk + i);
                sq += q[i] * q[i];
                sk += k[i] * k[i];
            }
            const float iq = 1.f / sqrtf(sq + 1e-6f), ik = 1.f / sqrtf(sk + 1e-6f);
            for (int64_t i = 0; i < dk; i++) {
                q[i] = q[i] * iq * scale;
                k[i] *= ik;
            }
            normed = r * nk + kh;
        }
        const float beta = round_to(bf, 1.f / (1.f + expf(-ld(ba, bf, row * ba_stride + h))));
        const float g = -expf(A_log[h]) * softplus(ld(ba, bf, row * ba_stride + nv + h) + dt_bias[h]);
        const float eg = expf(g);
        float *S = state + (slots[r] * nv + h) * dk * dv, ob[HEAD_MAX];
        float *o = z ? ob : out + (row * nv + h) * dv;
        const int64_t xv = xr + 2 * nk * dk + h * dv;
        for (int64_t j = 0; j < dv; j++) v[j] = ld(x, bf, xv + j);
        if (isa == 2) {
#ifdef STATE_AVX512
            gdn_head_avx512(S, dk, dv, eg, beta, k, v, q, o);
#endif
        } else if (isa == 1) {
#ifdef STATE_AVX2
            gdn_head_avx2(S, dk, dv, eg, beta, k, v, q, o);
#endif
        } else {
            gdn_head_columns(S, dk, dv, 0, eg, beta, k, v, q, o);
        }
        if (z) gated_norm_head(o, dv, (const char *)z + (row * z_stride + h * dv) * (bf ? 2 : 4), norm, eps, bf,
                               (char *)gated + (row * gated_stride + h * dv) * (bf ? 2 : 4));
    }
}

/* Gated DeltaNet's output for rows [begin, end) of units (row, head) = u / nv, u % nv: o
 * [T][nv][dv] fp32 (the recurrence's), z [T][z_stride] (nv * dv values a row), norm [dv];
 * gated [T][gated_stride] in the model dtype, as gated_norm_head makes it. */
void gdn_gated_norm_rows(const float *o, const void *z, int64_t z_stride, const void *norm,
                         float eps, void *gated, int64_t gated_stride, int64_t nv, int64_t dv,
                         int64_t bf16, int64_t begin, int64_t end)
{
    const int bf = (int)bf16, esz = bf ? 2 : 4;
    float buf[HEAD_MAX];
    for (int64_t u = begin; u < end; u++) {
        const int64_t row = u / nv, h = u % nv;
        memcpy(buf, o + u * dv, sizeof(float) * (size_t)dv);
        gated_norm_head(buf, dv, (const char *)z + (row * z_stride + h * dv) * esz, norm, eps, bf,
                        (char *)gated + (row * gated_stride + h * dv) * esz);
    }
}

/* Mamba2's step for one token of each request r: row rows[r] of x [T][x_stride] (the conv's
 * output x|B|C: nh * P, G * N, G * N channels) and of dt [T][dt_stride] (nh raw values), its
 * state in slot slots[r] of state [slots][nh][P][N]; y [T][nh][P] fp32 (without D x). dt is
 * clamped to [dt_min, dt_max]. Units: r * nh + h. */
void ssm_decode_rows(const void *x, int64_t x_stride, const void *dt, int64_t dt_stride,
                     const float *A_log, const float *dt_bias, float *state, const int64_t *rows,
                     const int64_t *slots, float *y, int64_t nh, int64_t G, int64_t P, int64_t N,
                     float dt_min, float dt_max, int64_t bf16, int64_t isa, int64_t begin,
                     int64_t end)
{
    const int bf = (int)bf16;
    const int64_t per_group = nh / G;
    float xdt[HEAD_MAX], B[HEAD_MAX], C[HEAD_MAX];
    int64_t loaded = -1; /* the (row, group) B and C hold */
    for (int64_t u = begin; u < end; u++) {
        const int64_t r = u / nh, h = u % nh, g = h / per_group, row = rows[r];
        const int64_t xr = row * x_stride;
        if (loaded != r * G + g) {
            for (int64_t n = 0; n < N; n++) {
                B[n] = ld(x, bf, xr + nh * P + g * N + n);
                C[n] = ld(x, bf, xr + nh * P + G * N + g * N + n);
            }
            loaded = r * G + g;
        }
        float d = softplus(ld(dt, bf, row * dt_stride + h) + dt_bias[h]);
        d = d < dt_min ? dt_min : d > dt_max ? dt_max : d;
        const float dA = expf(d * -expf(A_log[h]));
        for (int64_t p = 0; p < P; p++) xdt[p] = ld(x, bf, xr + h * P + p) * d;
        float *S = state + (slots[r] * nh + h) * P * N, *o = y + (row * nh + h) * P;
        if (isa == 2) {
#ifdef STATE_AVX512
            ssm_avx512(S, P, N, dA, xdt, B, C, o);
#endif
        } else if (isa == 1) {
#ifdef STATE_AVX2
            ssm_avx2(S, P, N, dA, xdt, B, C, o);
#endif
        } else {
            ssm_scalar(S, P, N, dA, xdt, B, C, o);
        }
    }
}

/* Mamba2's output after the scan for rows [begin, end) of a step: y [T][nh * P] fp32 (the
 * scan's), x [T][x_stride] (the conv's output, its first nh * P channels), z [T][z_stride],
 * D [nh] fp32, norm [nh * P] (all but y and D in the model dtype):
 *     g = (y + D x) silu(z);  out = norm * g / sqrt(mean over the group's channels of g^2 + eps)
 * out [T][nh * P] in the model dtype (as the layer's _gated_norm, fp32 then one rounding). */
void ssm_gated_norm_rows(const float *y, const void *x, int64_t x_stride, const void *z,
                         int64_t z_stride, const float *D, const void *norm, float eps, void *out,
                         int64_t nh, int64_t P, int64_t G, int64_t bf16, int64_t begin, int64_t end)
{
    const int bf = (int)bf16;
    const int64_t width = nh * P, per = width / G;
    float g[HEAD_MAX * 8];
    for (int64_t t = begin; t < end; t++)
        for (int64_t grp = 0; grp < G; grp++) {
            float ss = 0.f;
            for (int64_t c = 0; c < per; c++) {
                const int64_t ch = grp * per + c;
                const float zc = ld(z, bf, t * z_stride + ch);
                g[c] = (y[t * width + ch] + D[ch / P] * ld(x, bf, t * x_stride + ch)) * (zc / (1.f + expf(-zc)));
                ss += g[c] * g[c];
            }
            const float inv = 1.f / sqrtf(ss / (float)per + eps);
            for (int64_t c = 0; c < per; c++)
                st(out, bf, t * width + grp * per + c, ld(norm, bf, grp * per + c) * (g[c] * inv));
        }
}
