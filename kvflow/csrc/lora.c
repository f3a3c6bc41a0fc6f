/* LoRA's batched shrink and expand (Punica's BGMV, S-LoRA): each row t of a flat batch runs
 * under its own adapter slot `slots[t]` (-1: the base model, skipped), and
 *
 *     s[t]  = A[slot] x[t]                       shrink: [rank] per slice, fp32
 *     y[t] += B[slot] s[t]                       expand: into the base projection's output
 *
 * with the adapter's scaling folded into B at load. A fused projection (q|k|v, gate|up) has
 * several slices: slice j's outputs [starts[j], starts[j+1]) read s[t][j * R .. j * R + rank).
 *
 * Layouts (kvflow/model/lora.py keeps them, one per projection and layer, fp32):
 *     A  [slots][n_slices * R][K]   the slice's down-projections, R = max_lora_rank
 *     Bt [slots][R][N]              the up-projections transposed: one rank's N outputs are
 *                                   one stream, so the expand vectorises over outputs
 * and s is [rows][n_slices * R]. Only the first ranks[slot] of each slice's R are read.
 *
 * Rows come grouped by adapter (a request's tokens are contiguous in the batch): up to TILE
 * consecutive rows of one slot share every weight load. x and y are fp32 or bf16 (the bf16
 * output is rounded once, after the fp32 add). Paths (chosen at load, passed as `isa`):
 * 0 scalar (the tests' reference), 1 AVX2 + FMA, 2 AVX-512. Threads split rows: lora_apply
 * runs both halves over a thread's rows in one pool job (one call per projection). */
#include <stdint.h>
#include <string.h>

#include "kernels.h"
#include "simd.h"

#define TILE 4

static inline float ld(const void *p, int bf16, int64_t i)
{
    return bf16 ? bf16_to_float(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void st_add(void *p, int bf16, int64_t i, float v)
{
    if (bf16) {
        uint16_t *q = (uint16_t *)p;
        q[i] = float_to_bf16(bf16_to_float(q[i]) + v);
    } else {
        ((float *)p)[i] += v;
    }
}

/* rows [t, t + n) of one slot: the tile that starts at t */
static int64_t tile_rows(const int64_t *slots, int64_t t, int64_t end)
{
    int64_t n = 1;
    while (n < TILE && t + n < end && slots[t + n] == slots[t]) n++;
    return n;
}

/* -- scalar ------------------------------------------------------------------------------- */
static void shrink_scalar(const void *x, int64_t xs, int bf, int64_t K, const float *a,
                          float *s, int64_t n)
{
    for (int64_t i = 0; i < n; i++) {
        float acc = 0.f;
        for (int64_t k = 0; k < K; k++) acc += ld(x, bf, i * xs + k) * a[k];
        s[i] = acc;
    }
}

static void expand_scalar(const float *s, int64_t ss, int64_t rank, const float *bt, int64_t N,
                          int64_t n0, int64_t n1, void *y, int64_t ys, int bf, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        for (int64_t o = n0; o < n1; o++) {
            float acc = 0.f;
            for (int64_t r = 0; r < rank; r++) acc += s[i * ss + r] * bt[r * N + o];
            st_add(y, bf, i * ys + o, acc);
        }
}

/* -- AVX2 --------------------------------------------------------------------------------- */
#if defined(__AVX2__) && defined(__FMA__)
#define LORA_AVX2 1
static inline __m256 ld8(const void *p, int bf, int64_t i)
{
    return bf ? load8_bf16((const uint16_t *)p + i) : _mm256_loadu_ps((const float *)p + i);
}

static void shrink_avx2(const void *x, int64_t xs, int bf, int64_t K, const float *a, float *s,
                        int64_t n)
{
    __m256 acc[TILE];
    for (int64_t i = 0; i < n; i++) acc[i] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        const __m256 w = _mm256_loadu_ps(a + k);
        for (int64_t i = 0; i < n; i++) acc[i] = _mm256_fmadd_ps(ld8(x, bf, i * xs + k), w, acc[i]);
    }
    for (int64_t i = 0; i < n; i++) {
        float v = hsum8(acc[i]);
        for (int64_t j = k; j < K; j++) v += ld(x, bf, i * xs + j) * a[j];
        s[i] = v;
    }
}

static void expand_avx2(const float *s, int64_t ss, int64_t rank, const float *bt, int64_t N,
                        int64_t n0, int64_t n1, void *y, int64_t ys, int bf, int64_t n)
{
    int64_t o = n0;
    for (; o + 8 <= n1; o += 8) {
        __m256 acc[TILE];
        for (int64_t i = 0; i < n; i++) acc[i] = _mm256_setzero_ps();
        for (int64_t r = 0; r < rank; r++) {
            const __m256 b = _mm256_loadu_ps(bt + r * N + o);
            for (int64_t i = 0; i < n; i++)
                acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(s[i * ss + r]), b, acc[i]);
        }
        for (int64_t i = 0; i < n; i++) {
            float v[8];
            _mm256_storeu_ps(v, acc[i]);
            for (int j = 0; j < 8; j++) st_add(y, bf, i * ys + o + j, v[j]);
        }
    }
    if (o < n1) expand_scalar(s, ss, rank, bt, N, o, n1, y, ys, bf, n);
}
#endif

/* -- AVX-512 ------------------------------------------------------------------------------ */
#ifdef __AVX512F__
#define LORA_AVX512 1
static inline __m512 ld16(const void *p, int bf, int64_t i, __mmask16 m)
{
    if (bf)
        return widen16_bf16(_mm256_maskz_loadu_epi16(m, (const uint16_t *)p + i));
    return _mm512_maskz_loadu_ps(m, (const float *)p + i);
}

static void shrink_avx512(const void *x, int64_t xs, int bf, int64_t K, const float *a,
                          float *s, int64_t n)
{
    __m512 acc[TILE];
    for (int64_t i = 0; i < n; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
        const __mmask16 m = K - k >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (K - k)) - 1);
        const __m512 w = _mm512_maskz_loadu_ps(m, a + k);
        for (int64_t i = 0; i < n; i++) acc[i] = _mm512_fmadd_ps(ld16(x, bf, i * xs + k, m), w, acc[i]);
    }
    for (int64_t i = 0; i < n; i++) s[i] = _mm512_reduce_add_ps(acc[i]);
}

static void expand_avx512(const float *s, int64_t ss, int64_t rank, const float *bt, int64_t N,
                          int64_t n0, int64_t n1, void *y, int64_t ys, int bf, int64_t n)
{
    for (int64_t o = n0; o < n1; o += 16) {
        const __mmask16 m = n1 - o >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n1 - o)) - 1);
        __m512 acc[TILE];
        for (int64_t i = 0; i < n; i++) acc[i] = _mm512_setzero_ps();
        for (int64_t r = 0; r < rank; r++) {
            const __m512 b = _mm512_maskz_loadu_ps(m, bt + r * N + o);
            for (int64_t i = 0; i < n; i++)
                acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(s[i * ss + r]), b, acc[i]);
        }
        for (int64_t i = 0; i < n; i++) {
            if (bf) {
                uint16_t *q = (uint16_t *)y + i * ys + o;
                float v[16];
                _mm512_storeu_ps(v, _mm512_add_ps(ld16(q, 1, 0, m), acc[i]));
                for (int j = 0; j < 16 && o + j < n1; j++) q[j] = float_to_bf16(v[j]);
            } else {
                float *q = (float *)y + i * ys + o;
                _mm512_mask_storeu_ps(q, m, _mm512_add_ps(_mm512_maskz_loadu_ps(m, q), acc[i]));
            }
        }
    }
}
#endif

int64_t lora_isas(void)
{
    int64_t isas = 1;
#ifdef LORA_AVX2
    isas |= 2;
#endif
#ifdef LORA_AVX512
    isas |= 4;
#endif
    return isas;
}

void lora_shrink(const void *x, int64_t x_stride, int64_t x_bf16, int64_t K, const float *A,
                 int64_t n_slices, int64_t R, const int64_t *ranks, const int64_t *slots,
                 float *s, int64_t isa, int64_t begin, int64_t end)
{
    const int64_t ss = n_slices * R, esz = x_bf16 ? 2 : 4;
    for (int64_t t = begin; t < end;) {
        const int64_t slot = slots[t];
        if (slot < 0) { t++; continue; }
        const int64_t n = tile_rows(slots, t, end), rank = ranks[slot];
        const char *xt = (const char *)x + t * x_stride * esz;
        for (int64_t j = 0; j < n_slices; j++)
            for (int64_t r = 0; r < rank; r++) {
                const float *a = A + ((slot * n_slices + j) * R + r) * K;
                float out[TILE];
                if (isa == 2) {
#ifdef LORA_AVX512
                    shrink_avx512(xt, x_stride, (int)x_bf16, K, a, out, n);
#endif
                } else if (isa == 1) {
#ifdef LORA_AVX2
                    shrink_avx2(xt, x_stride, (int)x_bf16, K, a, out, n);
#endif
                } else {
                    shrink_scalar(xt, x_stride, (int)x_bf16, K, a, out, n);
                }
                for (int64_t i = 0; i < n; i++) s[(t + i) * ss + j * R + r] = out[i];
            }
        t += n;
    }
}

void lora_expand(const float *s, int64_t n_slices, int64_t R, const int64_t *ranks,
                 const float *Bt, const int64_t *starts, int64_t N, const int64_t *slots, void *y,
                 int64_t y_stride, int64_t y_bf16, int64_t isa, int64_t begin, int64_t end)
{
    const int64_t ss = n_slices * R, esz = y_bf16 ? 2 : 4;
    for (int64_t t = begin; t < end;) {
        const int64_t slot = slots[t];
        if (slot < 0) { t++; continue; }
        const int64_t n = tile_rows(slots, t, end), rank = ranks[slot];
        const float *bt = Bt + slot * R * N;
        char *yt = (char *)y + t * y_stride * esz;
        for (int64_t j = 0; j < n_slices && rank > 0; j++) {
            const float *sj = s + t * ss + j * R;
            if (isa == 2) {
#ifdef LORA_AVX512
                expand_avx512(sj, ss, rank, bt, N, starts[j], starts[j + 1], yt, y_stride, (int)y_bf16, n);
#endif
            } else if (isa == 1) {
#ifdef LORA_AVX2
                expand_avx2(sj, ss, rank, bt, N, starts[j], starts[j + 1], yt, y_stride, (int)y_bf16, n);
#endif
            } else {
                expand_scalar(sj, ss, rank, bt, N, starts[j], starts[j + 1], yt, y_stride, (int)y_bf16, n);
            }
        }
        t += n;
    }
}

void lora_apply(const void *x, int64_t x_stride, int64_t x_bf16, int64_t K, const float *A,
                const float *Bt, int64_t n_slices, int64_t R, const int64_t *ranks,
                const int64_t *starts, int64_t N, const int64_t *slots, float *s, void *y,
                int64_t y_stride, int64_t y_bf16, int64_t isa, int64_t begin, int64_t end)
{
    lora_shrink(x, x_stride, x_bf16, K, A, n_slices, R, ranks, slots, s, isa, begin, end);
    lora_expand(s, n_slices, R, ranks, Bt, starts, N, slots, y, y_stride, y_bf16, isa, begin, end);
}
