/* A decode step's decoder layers in one call from Python, the way a CUDA graph replays a step.
 *
 * At batch 1 each of a layer's seven kernels (norm + qkv, RoPE, KV write, decode attention,
 * o_proj, norm + gate_up + SiLU, down) costs ~10-17 us of Python, torch.empty and ctypes
 * around it: over 30 layers, about as long as the projections themselves. Here the same C
 * functions run in the same order, split over the same pool (pool.c) with the same thresholds,
 * so the numbers are bit-identical to the per-layer path (kvflow/models/llama.py); only the
 * Python between them is gone. kvflow/model/decode_graph.py builds the words and decides
 * which steps come here (decode-only, few rows, every projection quantized or on the fp32
 * GEMV). The KV cache is fp32, bf16 or one byte a value (fp8, int8: paged_attention_quant.c's
 * write_kv_q8 and paged_decode_q8 on the path the per-layer path picks, with its scales).
 *
 * `step` (per call) and `layers` (num_layers records of LAYER_WORDS, built once at load) are
 * int64 words: pointers, sizes and two doubles stored as their bits. */
#include <stdint.h>
#include <string.h>

#include "kernels.h"
#include "simd.h"

/* a projection's words: for a quantized one (P_GEMM 0) as quant_linear takes them; for the
 * fp32 GEMV (P_GEMM 1) its panels, weight storage code (gemv_f32.c's `wdt`) in P_KIND, its
 * instruction set code in P_ISA, N and K; for the bf16 panel GEMM (P_GEMM 2) its panels,
 * whether they are a gate_up pack with SiLU * up fused (P_KIND), N and K (the others unused) */
enum { P_PACKED, P_KIND, P_ISA, P_PER_ROW, P_N, P_K, P_KB, P_WIDE_ROWS, P_GEMM, PROJ_WORDS };
enum { GEMM_QUANT, GEMM_GEMV_F32, GEMM_PANELS_BF16 };

enum {
    L_IN_NORM, L_POST_NORM, L_EPS, L_SCALE, L_QKV_BIAS, L_K_CACHE, L_V_CACHE, L_K_SCALE,
    L_V_SCALE, L_HEADS,
    L_KV_HEADS, L_HEAD_DIM, L_QK_SCALE, L_QKV, L_O = L_QKV + PROJ_WORDS, L_GATE_UP = L_O + PROJ_WORDS,
    L_DOWN = L_GATE_UP + PROJ_WORDS, LAYER_WORDS = L_DOWN + PROJ_WORDS
};

/* a layer's K and V scales (L_K_SCALE, L_V_SCALE) are fp8's, as fp32 bits (unused otherwise);
 * L_QK_SCALE: NULL, or the fp32 multipliers of a row's q and k heads after RoPE (an fp8
 * cache's key scales, model/key_scales.py: powers of two, so the products are exact) */

/* per step: rows, the residual stream x [M, hidden] (updated in place), whether activations
 * are bf16, the KV cache's dtype (KV_*), threads, positions, cos/sin tables, the scratch
 * outputs (qkv [M, qkv_n], attention [M, H * D], o [M, hidden], act [M, I], down
 * [M, hidden]: down is the last layer's MLP output, not yet added to x), the attention
 * groups (GROUP_WORDS each), each layer's group (NULL: group 0 for all), the normed rows
 * [M, hidden] and, for a float gate_up whose SiLU is not fused, its product [M, 2I];
 * the qkv bias is fp32 for a quantized qkv or the GEMV, bf16 for the panels (as each reads it) */
enum {
    S_M, S_X, S_X_BF16, S_KV_DTYPE, S_THREADS, S_POSITIONS, S_COS, S_SIN, S_QKV, S_ATTN, S_O,
    S_ACT, S_DOWN, S_GROUPS, S_LAYER_GROUP, S_NORMED, S_GATE_UP, S_Q8_ISA, S_ATTN_IO, STEP_WORDS
};
/* S_KV_DTYPE's codes; for the one-byte ones S_Q8_ISA is paged_decode_q8's `isa`. S_ATTN_IO:
 * paged_decode_bf16's io bits past q and out in bf16 (4: prefetch every next block) */
enum { KV_F32, KV_BF16, KV_INT8, KV_FP8 };
/* one KV cache group's metadata: slot mapping, decode block tables and their row stride,
 * seq_lens, rows, block size, sliding window (0: none) */
enum { G_SLOTS, G_TABLES, G_BT_STRIDE, G_SEQ_LENS, G_ROWS, G_BLOCK_SIZE, G_WINDOW, GROUP_WORDS };

#define PARALLEL_VALUES (1 << 13) /* ops.py's MIN_PARALLEL_VALUES */
#define PARALLEL_HEAD_KEYS 256    /* attention/c_kernels.py's MIN_PARALLEL_HEAD_KEYS */

/* the first n values of each of M rows (row stride `stride`) times s, in place (the layer's
 * qk_scale: powers of two, so neither fp32 nor bf16 rounds but past their range; rounded there
 * as torch's in-place multiply of the per-layer path rounds) */
static void scale_qk(void *rows, int64_t stride, int64_t M, int64_t n, const float *s, int64_t bf16) {
    for (int64_t r = 0; r < M; r++) {
        if (bf16) {
            uint16_t *x = (uint16_t *)rows + r * stride;
            for (int64_t i = 0; i < n; i++)
                x[i] = float_to_bf16(bf16_to_float(x[i]) * s[i]);
        } else {
            float *x = (float *)rows + r * stride;
            for (int64_t i = 0; i < n; i++)
                x[i] *= s[i];
        }
    }
}

/* the record sizes, for decode_graph.py to check its word lists against: 0 a projection's,
 * 1 a layer's, 2 a step's, 3 a group's */
int64_t decode_step_layout(int64_t which) {
    const int64_t sizes[4] = {PROJ_WORDS, LAYER_WORDS, STEP_WORDS, GROUP_WORDS};
    return which >= 0 && which < 4 ? sizes[which] : -1;
}

static double as_double(int64_t bits) {
    double d;
    memcpy(&d, &bits, sizeof d);
    return d;
}

/* gemv.py's gemv_f32: out [M, N] = x [M, K] @ w.T (+ bias), the pool splitting panels */
static void gemv(const int64_t *p, const void *x, const float *bias, void *out, int64_t M,
                 int64_t threads) {
    const int64_t N = p[P_N];
    const int64_t gargs[11] = {(int64_t)x, p[P_K], M, p[P_K], p[P_PACKED], (int64_t)bias,
                               (int64_t)out, N, N, p[P_ISA], p[P_KIND]};
    kernel_pool_run(POOL_GEMV_F32, gargs, 0.0, (N + 15) / 16, NULL, threads);
}

/* gemm.py's panel_gemm at decode rows (under its ROW_SPLIT_ROWS): out [M, N] bf16 = x @ w.T
 * (+ bf16 bias), or with a gate_up pack SiLU * up [M, N/2]; the pool splits panels of 64 */
static void panels_bf16(const int64_t *p, const void *x, const void *bias, void *out, int64_t M,
                        int64_t threads) {
    const int64_t N = p[P_N], fused = p[P_KIND];
    const int64_t gargs[10] = {(int64_t)x, p[P_K], p[P_K], p[P_PACKED], (int64_t)bias,
                               (int64_t)out, fused ? N / 2 : N, N, M, fused};
    kernel_pool_run(POOL_GEMM_PANELS, gargs, 0.0, (N + 63) / 64, NULL, threads);
}

/* the float GEMMs: the bf16 panels or the fp32 GEMV */
static void float_gemm(const int64_t *p, const void *x, const void *bias, void *out, int64_t M,
                       int64_t threads) {
    if (p[P_GEMM] == GEMM_PANELS_BF16)
        panels_bf16(p, x, bias, out, M, threads);
    else
        gemv(p, x, bias, out, M, threads);
}

/* packed_linear.linear, or with `silu_mul` linear_silu_mul (its SiLU * up into out [M, N/2]:
 * quant_linear and a gate_up pack of panels fuse it; else the product goes through `gate_up`,
 * then ops.silu_mul's kernel and split) */
static int64_t project(const int64_t *p, const void *x, const void *bias, void *out, int64_t M,
                       int64_t bf16, int64_t threads, int64_t silu_mul, void *gate_up) {
    if (p[P_GEMM] == GEMM_QUANT)
        return quant_linear(x, p[P_K], p[P_K], p[P_KB], bf16, p[P_PER_ROW],
                            (const uint8_t *)p[P_PACKED], p[P_KIND], p[P_ISA],
                            (const float *)bias, out, p[P_N],
                            bf16, M, threads, p[P_WIDE_ROWS], silu_mul);
    if (!silu_mul || (p[P_GEMM] == GEMM_PANELS_BF16 && p[P_KIND])) {
        float_gemm(p, x, bias, out, M, threads);
        return 0;
    }
    const int64_t half = p[P_N] / 2;
    float_gemm(p, x, bias, gate_up, M, threads);
    const int64_t sargs[3] = {(int64_t)gate_up, (int64_t)out, half};
    kernel_pool_run(bf16 ? POOL_SILU_BF16 : POOL_SILU_F32, sargs, 0.0, M, NULL,
                    M * half >= PARALLEL_VALUES ? threads : 1);
    return 0;
}

/* packed_linear.norm_linear: RMSNorm(residual += delta) * norm_weight into `normed`
 * (ops.add_rms_norm's kernel and split, as quant_linear_normed runs it too), then the
 * projection */
static int64_t project_normed(const int64_t *p, void *residual, const void *delta,
                              const void *norm_weight, double eps, const void *bias, void *out,
                              int64_t M, int64_t bf16, int64_t threads, int64_t silu_mul,
                              void *normed, void *gate_up) {
    const int64_t K = p[P_K];
    const int64_t nargs[5] = {(int64_t)residual, (int64_t)delta, (int64_t)norm_weight,
                              (int64_t)normed, K};
    kernel_pool_run(bf16 ? POOL_NORM_BF16 : POOL_NORM_F32, nargs, eps, M, NULL,
                    M * K >= PARALLEL_VALUES ? threads : 1);
    return project(p, normed, bias, out, M, bf16, threads, silu_mul, gate_up);
}

/* The decoder layers of one decode-only step; 0, or the first failing kernel's code. */
int64_t decode_layers(const int64_t *step, const int64_t *layers, int64_t num_layers) {
    const int64_t M = step[S_M], bf16 = step[S_X_BF16], kv_dtype = step[S_KV_DTYPE];
    const int64_t q8 = kv_dtype == KV_INT8 || kv_dtype == KV_FP8;
    const int64_t q8_kind = kv_dtype == KV_FP8; /* paged_attention_quant.c's kind */
    const int64_t threads = step[S_THREADS];
    const int64_t *groups = (const int64_t *)step[S_GROUPS];
    const int64_t *layer_group = (const int64_t *)step[S_LAYER_GROUP];
    void *x = (void *)step[S_X], *qkv = (void *)step[S_QKV], *attn = (void *)step[S_ATTN];
    void *o = (void *)step[S_O], *act = (void *)step[S_ACT], *down = (void *)step[S_DOWN];
    void *normed = (void *)step[S_NORMED], *gate_up = (void *)step[S_GATE_UP];
    const size_t esize = bf16 ? 2 : 4;
    for (int64_t i = 0; i < num_layers; i++) {
        const int64_t *l = layers + i * LAYER_WORDS;
        const int64_t *g = groups + (layer_group ? layer_group[i] : 0) * GROUP_WORDS;
        const int64_t H = l[L_HEADS], KVH = l[L_KV_HEADS], D = l[L_HEAD_DIM];
        const int64_t qkv_n = l[L_QKV + P_N];
        const double eps = as_double(l[L_EPS]);
        /* the first layer has no MLP output to add yet */
        int64_t rc = project_normed(l + L_QKV, x, i ? down : NULL, (const void *)l[L_IN_NORM], eps,
                                    (const void *)l[L_QKV_BIAS], qkv, M, bf16, threads, 0,
                                    normed, gate_up);
        if (rc != 0)
            return rc;

        /* RoPE on the q and k heads, in place (ops.rope_) */
        const int64_t rargs[7] = {(int64_t)qkv, qkv_n, step[S_POSITIONS], step[S_COS], step[S_SIN],
                                  H + KVH, D};
        kernel_pool_run(bf16 ? POOL_ROPE_BF16 : POOL_ROPE_F32, rargs, 0.0, M, NULL,
                        M * (H + KVH) * D >= PARALLEL_VALUES ? threads : 1);

        if (l[L_QK_SCALE])
            scale_qk(qkv, qkv_n, M, (H + KVH) * D, (const float *)l[L_QK_SCALE], bf16);

        /* this step's K/V into the cache (kvflow/attention/kv_write.py) */
        const void *k = (const char *)qkv + H * D * esize, *v = (const char *)k + KVH * D * esize;
        const int64_t *slots = (const int64_t *)g[G_SLOTS];
        void *k_cache = (void *)l[L_K_CACHE], *v_cache = (void *)l[L_V_CACHE];
        if (q8)
            write_kv_q8(k, v, qkv_n, slots, k_cache, v_cache, 0, M, KVH, D, g[G_BLOCK_SIZE], q8_kind,
                        bf16, l[L_K_SCALE], l[L_V_SCALE]);
        else if (bf16)
            copy_kv_bf16(k, v, qkv_n, slots, k_cache, v_cache, 0, M, KVH, D, g[G_BLOCK_SIZE]);
        else if (kv_dtype == KV_BF16)
            write_kv_bf16(k, v, qkv_n, slots, k_cache, v_cache, 0, M, KVH, D, g[G_BLOCK_SIZE]);
        else
            write_kv_f32(k, v, qkv_n, slots, k_cache, v_cache, 0, M, KVH, D, g[G_BLOCK_SIZE]);

        /* decode attention, rows split by key count (kvflow/attention/c_kernels.py's CAttention.decode) */
        const int64_t *seq_lens = (const int64_t *)g[G_SEQ_LENS];
        int64_t keys = 0;
        for (int64_t r = 0; r < M; r++)
            keys += seq_lens[r];
        /* no attention sinks here: a model with them never takes this step (decode_graph.why_not) */
        const int64_t aargs[21] = {(int64_t)qkv, qkv_n, (int64_t)k_cache, (int64_t)v_cache,
                                   g[G_TABLES], g[G_BT_STRIDE], g[G_SEQ_LENS], g[G_ROWS], H, KVH, D,
                                   g[G_BLOCK_SIZE], (int64_t)attn, H * D,
                                   bf16 ? 3 | (kv_dtype == KV_BF16 ? step[S_ATTN_IO] : 0) : 0, g[G_WINDOW],
                                   0, q8_kind, step[S_Q8_ISA], l[L_K_SCALE], l[L_V_SCALE]};
        kernel_pool_run(q8 ? POOL_DECODE_Q8 : kv_dtype == KV_BF16 ? POOL_DECODE_BF16 : POOL_DECODE_F32,
                        aargs, as_double(l[L_SCALE]), M, seq_lens,
                        keys * H >= PARALLEL_HEAD_KEYS ? threads : 1);

        rc = project(l + L_O, attn, NULL, o, M, bf16, threads, 0, NULL);
        if (rc == 0)
            rc = project_normed(l + L_GATE_UP, x, o, (const void *)l[L_POST_NORM], eps, NULL, act, M,
                                bf16, threads, 1, normed, gate_up);
        if (rc == 0)
            rc = project(l + L_DOWN, act, NULL, down, M, bf16, threads, 0, NULL);
        if (rc != 0)
            return rc;
    }
    return 0;
}
