/* A persistent pool of kernel threads: one call splits a kernel's rows between the caller
 * and up to MAX_WORKERS workers that wait for work by spinning, then sleep on a futex.
 *
 * Why not Python threads: a kernel split over a pooled Python thread cost ~0.2 ms per call
 * on the 2-vCPU VMs here (the worker wakes from an idle vCPU, takes the GIL, converts its
 * ctypes arguments), against 0.1-1 ms kernels, ~300 of them per engine step. A worker that
 * spins between kernels picks a job up in well under a microsecond. It spins for SPIN_NS
 * after its last job (a step's Python between kernels and between steps is shorter than
 * that), yielding the core now and then to any other thread that wants it, then sleeps, so
 * an idle engine leaves its cores alone.
 *
 * Jobs name a kernel by index (KERNELS below) and pass its arguments as int64 words (data
 * pointers and sizes, in the kernel's order without its begin/end) plus one float; the rows
 * [0, n) are cut into contiguous ranges of near-equal weight (row count, or a weight per
 * row), the first range run by the caller. One job at a time: a second caller that finds
 * the pool busy runs its job alone. */
#define _GNU_SOURCE
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#if defined(__x86_64__)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#else
#define CPU_RELAX() ((void)0)
#endif

#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#define MAX_WORKERS 63
#define SPIN_NS 2000000  /* 2 ms */

typedef void (*range_fn)(const int64_t *a, double f, int64_t begin, int64_t end);

#define P(i) ((void *)a[i])
static void k_decode_f32(const int64_t *a, double f, int64_t b, int64_t e) {
    paged_decode_f32(P(0), a[1], P(2), P(3), P(4), a[5], P(6), P(7), b, e, a[8], a[9], a[10],
                     a[11], (float)f, P(12), a[13], a[14], a[15], P(16));
}
static void k_decode_bf16(const int64_t *a, double f, int64_t b, int64_t e) {
    paged_decode_bf16(P(0), a[1], P(2), P(3), P(4), a[5], P(6), P(7), b, e, a[8], a[9], a[10],
                      a[11], (float)f, P(12), a[13], a[14], a[15], P(16));
}
static void k_prefill_bf16(const int64_t *a, double f, int64_t b, int64_t e) {
    paged_prefill_bf16(P(0), a[1], P(2), P(3), P(4), a[5], P(6), P(7), P(8), b, e, a[9], a[10],
                       a[11], a[12], (float)f, P(13), a[14], a[15], a[16], a[17], a[18], a[19],
                       P(20));
}
static void k_norm_f32(const int64_t *a, double f, int64_t b, int64_t e) {
    add_rms_norm_f32(P(0), P(1), P(2), P(3), b, e, a[4], (float)f);
}
static void k_norm_bf16(const int64_t *a, double f, int64_t b, int64_t e) {
    add_rms_norm_bf16(P(0), P(1), P(2), P(3), b, e, a[4], (float)f);
}
static void k_rope_f32(const int64_t *a, double f, int64_t b, int64_t e) {
    (void)f;
    rope_f32(P(0), a[1], P(2), P(3), P(4), b, e, a[5], a[6]);
}
static void k_rope_bf16(const int64_t *a, double f, int64_t b, int64_t e) {
    (void)f;
    rope_bf16(P(0), a[1], P(2), P(3), P(4), b, e, a[5], a[6]);
}
static void k_silu_f32(const int64_t *a, double f, int64_t b, int64_t e) {
    (void)f;
    silu_mul_f32(P(0), P(1), b, e, a[2]);
}
static void k_silu_bf16(const int64_t *a, double f, int64_t b, int64_t e) {
    (void)f;
    silu_mul_bf16(P(0), P(1), b, e, a[2]);
}
/* x, x_stride, K, packed, bias, out, out_stride, N, M (rows: x and out advance by rows) */
static void k_gemm_rows(const int64_t *a, double f, int64_t b, int64_t e) {
    (void)f;
    const uint16_t *x = (const uint16_t *)a[0] + b * a[1];
    uint16_t *out = (uint16_t *)a[5] + b * a[6];
    gemm_bf16_panels(x, a[1], e - b, a[2], P(3), P(4), out, a[6], a[7], 0, (a[7] + 63) / 64, a[9]);
}
/* the same words; the ranges are panels of 64 outputs, every thread takes all M rows */
static void k_gemm_panels(const int64_t *a, double f, int64_t b, int64_t e) {
    (void)f;
    gemm_bf16_panels(P(0), a[1], a[8], a[2], P(3), P(4), P(5), a[6], a[7], b, e, a[9]);
}
/* the same words on AMX's tiles (gemm_amx.c), split by panels */
static void k_gemm_amx(const int64_t *a, double f, int64_t b, int64_t e) {
    (void)f;
    gemm_amx_panels(P(0), a[1], a[8], a[2], P(3), P(4), P(5), a[6], a[7], b, e, a[9]);
}
/* x, x_stride, K, Kb, bf16, per_row, qx, dx, dxs (rows of x) */
static void k_quantize_q8(const int64_t *a, double f, int64_t b, int64_t e) {
    (void)f;
    quantize_rows_q8(P(0), a[1], a[2], a[3], a[4], a[5], P(6), P(7), P(8), b, e);
}
/* One kind's panels [pb, pe) (its own numbering) of the outputs [n0, n0 + n) of out, for M rows
 * of the quantized activations; `a`: the words below (Kb, isa, bias, out_stride, out_bf16).
 * QUANT_KIND_MXFP4 goes to gemm_mxfp4.c, QUANT_KIND_Q6 to gemm_q6.c, QUANT_KIND_Q4K to
 * gemm_q4k.c, the others to gemm_quant.c. */
static void qgemm_kind(const int64_t *a, int64_t kind, const uint8_t *packed, int64_t n0, int64_t n,
                       const int8_t *qx, const float *dx, const float *dxs, int64_t M, char *out,
                       int64_t pb, int64_t pe)
{
    const int64_t kb = a[3], isa = a[6], stride = a[9], bf16 = a[11];
    const float *bias = a[7] ? (const float *)a[7] + n0 : NULL;
    out += n0 * (bf16 ? 2 : 4);
    if (kind == QUANT_KIND_MXFP4)
        gemm_mxfp4_panels(qx, dx, kb, M, packed, isa, bias, out, stride, n, bf16, pb, pe);
    else if (kind == QUANT_KIND_Q6)
        gemm_q6_panels(qx, dx, kb, M, packed, isa, bias, out, stride, n, bf16, pb, pe);
    else if (kind == QUANT_KIND_Q4K)
        gemm_q4k_panels(qx, dx, dxs, kb, M, packed, isa, bias, out, stride, n, bf16, pb, pe);
    else
        gemm_quant_panels(qx, dx, dxs, kb, M, packed, kind, isa, bias, out, stride, n, bf16, pb, pe);
}

/* A QUANT_KIND_PARTS weight (a fused projection whose parts are stored in different kinds, a
 * Q4_K_M file's qkv with a Q6_K v): its packed bytes start with int64 words [count, then per
 * part: kind, first output, outputs (a multiple of 16 but the last), byte offset of its
 * panels]. Each part runs its own kernel into its columns of out. */
static void qgemm_parts(const int64_t *a, const int8_t *qx, const float *dx, const float *dxs,
                        int64_t M, char *out, int64_t pb, int64_t pe)
{
    int64_t count;
    memcpy(&count, (const void *)a[4], 8); /* a cached weight may start at any byte */
    for (int64_t i = 0; i < count; i++) {
        int64_t part[4];
        memcpy(part, (const char *)a[4] + 8 + 32 * i, sizeof part);
        const int64_t p0 = part[1] / 16, p1 = p0 + (part[2] + 15) / 16;
        const int64_t lo = pb > p0 ? pb : p0, hi = pe < p1 ? pe : p1;
        if (lo < hi)
            qgemm_kind(a, part[0], (const uint8_t *)a[4] + part[3], part[1], part[2], qx, dx, dxs, M,
                       out, lo - p0, hi - p0);
    }
}

/* qx, dx, dxs, Kb, packed, kind, isa, bias, out, out_stride, N, out_bf16, M (rows) */
static void k_qgemm_rows(const int64_t *a, double f, int64_t b, int64_t e) {
    (void)f;
    const int64_t kb = a[3];
    const int8_t *qx = (const int8_t *)a[0] + b * kb * 32;
    const float *dx = (const float *)a[1] + b * kb, *dxs = (const float *)a[2] + b * kb;
    char *out = (char *)a[8] + b * a[9] * (a[11] ? 2 : 4);
    if (a[5] == QUANT_KIND_PARTS)
        qgemm_parts(a, qx, dx, dxs, e - b, out, 0, (a[10] + 15) / 16);
    else
        qgemm_kind(a, a[5], P(4), 0, a[10], qx, dx, dxs, e - b, out, 0, (a[10] + 15) / 16);
}
/* the same words; the ranges are panels of 16 outputs, every thread takes all M rows */
static void k_qgemm_panels(const int64_t *a, double f, int64_t b, int64_t e) {
    (void)f;
    if (a[5] == QUANT_KIND_PARTS)
        qgemm_parts(a, P(0), P(1), P(2), a[12], P(8), b, e);
    else
        qgemm_kind(a, a[5], P(4), 0, a[10], P(0), P(1), P(2), a[12], P(8), b, e);
}
/* x, x_stride, K, Kb, x_bf16, M, packed, kind, isa, bias, out, out_stride, N, out_bf16,
 * failed (int64_t *): the ranges are groups of 64 outputs, every thread takes all M rows */
static void k_qgemm_wide(const int64_t *a, double f, int64_t b, int64_t e) {
    (void)f;
    if (gemm_quant_wide(P(0), a[1], a[2], a[3], a[4], a[5], P(6), a[7], a[8], P(9), P(10), a[11],
                        a[12], a[13], b, e) != 0)
        *(int64_t *)a[14] = 1; /* only ever set to 1: no race that matters */
}
/* x, x_stride, M, K, packed, bias, out, out_stride, N, isa, wdt (the weights' storage: 0
 * fp32, 1 bf16, 2 fp16): the ranges are panels of 16 outputs, every thread takes all M rows */
static void k_gemv_f32(const int64_t *a, double f, int64_t b, int64_t e) {
    (void)f;
    gemv_f32_panels(P(0), a[1], a[2], a[3], P(4), P(5), P(6), a[7], a[8], a[9], a[10], b, e);
}
/* LoRA's shrink + expand (lora.c): x, x_stride, x_bf16, K, A, Bt, n_slices, R, ranks, starts,
 * N, slots, s, y, y_stride, y_bf16, isa; the ranges are rows */
static void k_lora(const int64_t *a, double f, int64_t b, int64_t e) {
    (void)f;
    lora_apply(P(0), a[1], a[2], a[3], P(4), P(5), a[6], a[7], P(8), P(9), a[10], P(11), P(12),
               P(13), a[14], a[15], a[16], b, e);
}
static void k_decode_q8(const int64_t *a, double f, int64_t b, int64_t e) {
    paged_decode_q8(P(0), a[1], P(2), P(3), P(4), a[5], P(6), P(7), b, e, a[8], a[9], a[10],
                    a[11], (float)f, P(12), a[13], a[14], a[15], P(16), a[17], a[18], a[19],
                    a[20]);
}
/* the state layers' kernels (state_update.c), their words in its order; units as it says */
static void k_causal_conv(const int64_t *a, double f, int64_t b, int64_t e) {
    (void)f;
    causal_conv_rows(P(0), a[1], P(2), a[3], P(4), P(5), P(6), P(7), P(8), P(9), P(10), P(11),
                     a[12], a[13], a[14], a[15], a[16], b, e);
}
/* the float: the gated norm's eps */
static void k_gdn_decode(const int64_t *a, double f, int64_t b, int64_t e) {
    gdn_decode_rows(P(0), a[1], P(2), a[3], P(4), P(5), P(6), P(7), P(8), P(9), a[10], a[11],
                    a[12], a[13], P(14), a[15], P(16), (float)f, P(17), a[18], a[19], a[20], b, e);
}
/* dt_min and dt_max as float32 bits */
static void k_ssm_decode(const int64_t *a, double f, int64_t b, int64_t e) {
    (void)f;
    float lo, hi;
    const uint32_t lo_bits = (uint32_t)a[14], hi_bits = (uint32_t)a[15];
    memcpy(&lo, &lo_bits, 4);
    memcpy(&hi, &hi_bits, 4);
    ssm_decode_rows(P(0), a[1], P(2), a[3], P(4), P(5), P(6), P(7), P(8), P(9), a[10], a[11],
                    a[12], a[13], lo, hi, a[16], a[17], b, e);
}
/* the float: eps */
static void k_ssm_gated_norm(const int64_t *a, double f, int64_t b, int64_t e) {
    ssm_gated_norm_rows(P(0), P(1), a[2], P(3), a[4], P(5), P(6), (float)f, P(7), a[8], a[9],
                        a[10], a[11], b, e);
}
/* state_scan.c's prompt chunks; the SSD's dt_min and dt_max as float32 bits */
static void k_gdn_chunk(const int64_t *a, double f, int64_t b, int64_t e) {
    (void)f;
    gdn_chunk_rows(P(0), a[1], P(2), a[3], P(4), P(5), P(6), P(7), P(8), P(9), P(10), P(11),
                   P(12), a[13], a[14], a[15], a[16], a[17], a[18], a[19], b, e);
}
static void k_ssm_chunk(const int64_t *a, double f, int64_t b, int64_t e) {
    (void)f;
    float lo, hi;
    const uint32_t lo_bits = (uint32_t)a[17], hi_bits = (uint32_t)a[18];
    memcpy(&lo, &lo_bits, 4);
    memcpy(&hi, &hi_bits, 4);
    ssm_chunk_rows(P(0), a[1], P(2), a[3], P(4), P(5), P(6), P(7), P(8), P(9), P(10), P(11),
                   P(12), a[13], a[14], a[15], a[16], lo, hi, a[19], a[20], b, e);
}
/* the float: the gated norm's eps */
static void k_gdn_gated_norm(const int64_t *a, double f, int64_t b, int64_t e) {
    gdn_gated_norm_rows(P(0), P(1), a[2], P(3), (float)f, P(4), a[5], a[6], a[7], a[8], b, e);
}
#undef P

/* in enum pool_kernel's order (kernels.h) */
static const range_fn KERNELS[] = {
    k_decode_f32, k_decode_bf16, k_prefill_bf16, k_norm_f32, k_norm_bf16, k_rope_f32,
    k_rope_bf16, k_silu_f32, k_silu_bf16, k_gemm_rows, k_gemm_panels, k_quantize_q8,
    k_qgemm_rows, k_qgemm_panels, k_qgemm_wide, k_gemv_f32, k_lora, k_decode_q8,
    k_causal_conv, k_gdn_decode, k_ssm_decode, k_ssm_gated_norm, k_gdn_chunk, k_ssm_chunk,
    k_gdn_gated_norm, k_gemm_amx,
};
#define NUM_KERNELS ((int64_t)(sizeof KERNELS / sizeof KERNELS[0]))

static struct {
    pthread_mutex_t lock;          /* held by the caller of a job for its whole length */
    int workers;                   /* threads started (besides callers) */
    _Atomic uint32_t generation;   /* bumped once per job: the futex word workers wait on */
    _Atomic int sleepers;          /* workers in (or entering) futex_wait */
    _Atomic int pending;           /* workers still running the current job */
    range_fn fn;
    const int64_t *args;
    double farg;
    int64_t bounds[MAX_WORKERS + 2];
    int ranges;                    /* ranges of the current job; worker w takes range w + 1 */
} pool = { .lock = PTHREAD_MUTEX_INITIALIZER };

static long futex(_Atomic uint32_t *word, int op, uint32_t val) {
    return syscall(SYS_futex, (uint32_t *)word, op, val, NULL, NULL, 0);
}

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* arg: the worker's index in the high bits, the generation it starts from in the low 32 */
static void *worker_main(void *arg) {
    const int id = (int)((uintptr_t)arg >> 32);
    uint32_t seen = (uint32_t)(uintptr_t)arg;
    pthread_setname_np(pthread_self(), "kvflow-pool"); /* how tools and tests tell them apart */
    for (;;) {
        /* spin for the next job, then sleep until one is posted */
        int64_t start = now_ns();
        uint32_t g;
        for (int i = 0; (g = atomic_load_explicit(&pool.generation, memory_order_acquire)) == seen; i++) {
            CPU_RELAX();
            if ((i & 1023) != 1023)
                continue;
            sched_yield(); /* a runnable thread waiting for this core (the server's frontend,
                            * an OpenMP worker) goes first */
            if (now_ns() - start > SPIN_NS) {
                atomic_fetch_add(&pool.sleepers, 1);
                if (atomic_load(&pool.generation) == seen)
                    futex(&pool.generation, FUTEX_WAIT_PRIVATE, seen);
                atomic_fetch_sub(&pool.sleepers, 1);
                start = now_ns();
            }
        }
        seen = g;
        if (id + 1 < pool.ranges)
            pool.fn(pool.args, pool.farg, pool.bounds[id + 1], pool.bounds[id + 2]);
        atomic_fetch_sub_explicit(&pool.pending, 1, memory_order_release);
    }
    return NULL;
}

/* a forked child has the pool's memory but none of its threads */
static void forget_workers(void) {
    pool.workers = 0;
    pthread_mutex_init(&pool.lock, NULL);
}

static void ensure_workers(int wanted) {
    static int registered;
    if (!registered) {
        pthread_atfork(NULL, NULL, forget_workers);
        registered = 1;
    }
    while (pool.workers < wanted) {
        pthread_t t;
        const uintptr_t arg = ((uintptr_t)pool.workers << 32) | atomic_load(&pool.generation);
        if (pthread_create(&t, NULL, worker_main, (void *)arg) != 0)
            break;
        pthread_detach(t);
        pool.workers++;
    }
}

/* bounds[0..parts] of `parts` contiguous ranges of [0, n) of near-equal weight */
static void split(int64_t n, const int64_t *weights, int parts, int64_t *bounds) {
    bounds[0] = 0;
    if (weights == NULL) {
        for (int p = 1; p <= parts; p++)
            bounds[p] = n * p / parts;
        return;
    }
    int64_t total = 0;
    for (int64_t i = 0; i < n; i++)
        total += weights[i];
    int64_t acc = 0, i = 0;
    for (int p = 1; p < parts; p++) {
        /* the first row whose cumulative weight reaches p/parts of the total */
        const int64_t target = total * p / parts;
        while (i < n && acc + weights[i] <= target)
            acc += weights[i++];
        bounds[p] = i;
    }
    bounds[parts] = n;
}

int64_t kernel_pool_num_kernels(void) { return NUM_KERNELS; }

/* Run kernel `kernel` over rows [0, n) on `threads` threads (the caller and threads - 1
 * pool workers); `weights` (n values, or NULL) balances the ranges. */
void kernel_pool_run(int64_t kernel, const int64_t *args, double farg, int64_t n,
                     const int64_t *weights, int64_t threads) {
    const range_fn fn = KERNELS[kernel];
    if (threads > MAX_WORKERS + 1)
        threads = MAX_WORKERS + 1;
    if (threads <= 1 || n < 2 || pthread_mutex_trylock(&pool.lock) != 0) {
        fn(args, farg, 0, n);
        return;
    }
    ensure_workers((int)threads - 1);
    const int parts = (int)(threads - 1 <= pool.workers ? threads : pool.workers + 1);
    pool.fn = fn;
    pool.args = args;
    pool.farg = farg;
    pool.ranges = parts;
    split(n, weights, parts, pool.bounds);
    atomic_store(&pool.pending, pool.workers);
    atomic_fetch_add_explicit(&pool.generation, 1, memory_order_release);
    if (atomic_load(&pool.sleepers) > 0)
        futex(&pool.generation, FUTEX_WAKE_PRIVATE, INT32_MAX);
    fn(args, farg, pool.bounds[0], pool.bounds[1]);
    while (atomic_load_explicit(&pool.pending, memory_order_acquire) > 0)
        CPU_RELAX();
    pthread_mutex_unlock(&pool.lock);
}

/* out [M, N] = x [M, K] @ w.T for a quantized weight, in one call. From `wide_rows` rows
 * (where gemm_quant_wide.c takes the call) the weights are widened to floats per thread and
 * the float activations multiplied as they are, split by groups of 64 outputs. Below it
 * (gemm_quant.c) the rows are quantized to int8 into this thread's scratch, then the int8
 * GEMM runs, each split over `threads` (by rows from QUANT_ROW_SPLIT rows, else by panels of
 * 16 outputs). One call from Python per projection: two pool jobs through ctypes cost more
 * than the GEMM of a decode step. */
#define QUANT_ROW_SPLIT 32
static __thread struct { void *buf; size_t cap; } scratch;
/* the [M, N] product of a gate_up projection whose SiLU * up is the output (`silu_mul`): one
 * call from Python for the MLP's first half, as the bf16 panel GEMM fuses it */
static __thread struct { void *buf; size_t cap; } act_scratch;
#define PARALLEL_VALUES (1 << 13) /* ops.py's MIN_PARALLEL_VALUES */
static __thread struct { void *buf; size_t cap; } norm_scratch;

int64_t quant_linear(const void *x, int64_t x_stride, int64_t K, int64_t Kb, int64_t x_bf16,
                     int64_t per_row, const uint8_t *packed, int64_t kind, int64_t isa,
                     const float *bias, void *out, int64_t N, int64_t out_bf16, int64_t M,
                     int64_t threads, int64_t wide_rows, int64_t silu_mul)
{
    if (silu_mul) { /* out [M, N/2] = silu(gate) * up of the [M, N] product, kept in scratch */
        const size_t bytes = (size_t)(M * N) * (out_bf16 ? 2 : 4);
        if (bytes > act_scratch.cap) {
            free(act_scratch.buf);
            act_scratch.buf = malloc(bytes);
            act_scratch.cap = act_scratch.buf ? bytes : 0;
            if (!act_scratch.buf)
                return -1;
        }
        const int64_t rc = quant_linear(x, x_stride, K, Kb, x_bf16, per_row, packed, kind, isa, bias,
                                        act_scratch.buf, N, out_bf16, M, threads, wide_rows, 0);
        if (rc != 0)
            return rc;
        const int64_t sargs[3] = {(int64_t)act_scratch.buf, (int64_t)out, N / 2};
        kernel_pool_run(out_bf16 ? POOL_SILU_BF16 : POOL_SILU_F32, sargs, 0.0, M, NULL,
                        M * (N / 2) >= PARALLEL_VALUES ? threads : 1);
        return 0;
    }
    if (M >= wide_rows && gemm_quant_wide_takes(kind, isa, K, x_bf16, out_bf16)) {
        int64_t failed = 0;
        const int64_t wargs[15] = {(int64_t)x, x_stride, K, Kb, x_bf16, M, (int64_t)packed, kind,
                                   isa, (int64_t)bias, (int64_t)out, N, N, out_bf16,
                                   (int64_t)&failed};
        kernel_pool_run(POOL_QGEMM_WIDE, wargs, 0.0, (N + 63) / 64, NULL, threads);
        return failed ? -1 : 0;
    }
    const size_t q_bytes = ((size_t)(M * Kb * 32) + 63) & ~(size_t)63, f_bytes = (size_t)(M * Kb) * 4;
    const size_t need = q_bytes + 2 * f_bytes;
    if (need > scratch.cap) {
        free(scratch.buf);
        scratch.buf = malloc(need);
        scratch.cap = scratch.buf ? need : 0;
        if (!scratch.buf)
            return -1;
    }
    int8_t *qx = scratch.buf;
    float *dx = (float *)((char *)scratch.buf + q_bytes), *dxs = dx + M * Kb;
    const int64_t qargs[9] = {(int64_t)x, x_stride, K, Kb, x_bf16, per_row, (int64_t)qx,
                              (int64_t)dx, (int64_t)dxs};
    kernel_pool_run(POOL_QUANTIZE_Q8, qargs, 0.0, M, NULL, M >= 4 * threads ? threads : 1);
    const int64_t gargs[13] = {(int64_t)qx, (int64_t)dx, (int64_t)dxs, Kb, (int64_t)packed, kind,
                               isa, (int64_t)bias, (int64_t)out, N, N, out_bf16, M};
    if (M >= QUANT_ROW_SPLIT)
        kernel_pool_run(POOL_QGEMM_ROWS, gargs, 0.0, M, NULL, threads);
    else
        kernel_pool_run(POOL_QGEMM_PANELS, gargs, 0.0, (N + 15) / 16, NULL, threads);
    return 0;
}

/* quant_linear of RMSNorm(residual += delta) * norm_weight (add_rms_norm's kernel and numbers;
 * residual updated in place, delta may be NULL): the normed rows live only in this thread's
 * scratch, so a decode step's norm and the projection after it are one call from Python. */
int64_t quant_linear_normed(void *residual, const void *delta, const void *norm_weight, double eps,
                            int64_t K, int64_t Kb, int64_t x_bf16, int64_t per_row,
                            const uint8_t *packed, int64_t kind, int64_t isa, const float *bias,
                            void *out, int64_t N, int64_t out_bf16, int64_t M, int64_t threads,
                            int64_t wide_rows, int64_t silu_mul)
{
    const size_t bytes = (size_t)(M * K) * (x_bf16 ? 2 : 4);
    if (bytes > norm_scratch.cap) {
        free(norm_scratch.buf);
        norm_scratch.buf = malloc(bytes);
        norm_scratch.cap = norm_scratch.buf ? bytes : 0;
        if (!norm_scratch.buf)
            return -1;
    }
    const int64_t nargs[5] = {(int64_t)residual, (int64_t)delta, (int64_t)norm_weight,
                              (int64_t)norm_scratch.buf, K};
    kernel_pool_run(x_bf16 ? POOL_NORM_BF16 : POOL_NORM_F32, nargs, eps, M, NULL,
                    M * K >= PARALLEL_VALUES ? threads : 1);
    return quant_linear(norm_scratch.buf, K, K, Kb, x_bf16, per_row, packed, kind, isa, bias, out,
                        N, out_bf16, M, threads, wide_rows, silu_mul);
}
