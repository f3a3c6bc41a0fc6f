/* The kernels' entry points, for pool.c (which runs them split over its threads). */
#ifndef KVFLOW_KERNELS_H
#define KVFLOW_KERNELS_H
#include <stdint.h>

void paged_decode_f32(const void *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                      const int64_t *block_tables, int64_t bt_stride, const int64_t *seq_lens,
                      const int64_t *rows, int64_t row_begin, int64_t row_end, int64_t H, int64_t KVH,
                      int64_t D, int64_t block_size, float scale, void *out, int64_t out_stride,
                      int64_t io_bf16, int64_t window, const float *sinks);
void paged_decode_bf16(const void *q, int64_t q_stride, const uint16_t *k_cache,
                       const uint16_t *v_cache, const int64_t *block_tables, int64_t bt_stride,
                       const int64_t *seq_lens, const int64_t *rows, int64_t row_begin,
                       int64_t row_end, int64_t H, int64_t KVH, int64_t D, int64_t block_size,
                       float scale, void *out, int64_t out_stride, int64_t io_bf16,
                       int64_t window, const float *sinks);
void paged_decode_q8(const void *q, int64_t q_stride, const uint8_t *k_cache,
                     const uint8_t *v_cache, const int64_t *block_tables, int64_t bt_stride,
                     const int64_t *seq_lens, const int64_t *rows, int64_t row_begin,
                     int64_t row_end, int64_t H, int64_t KVH, int64_t D, int64_t block_size,
                     float scale, void *out, int64_t out_stride, int64_t io_bf16, int64_t window,
                     const float *sinks, int64_t kind, int64_t isa, int64_t k_scale_bits,
                     int64_t v_scale_bits);
void paged_prefill_bf16(const uint16_t *q, int64_t q_stride, const void *k_cache,
                        const void *v_cache, const int64_t *block_tables, int64_t bt_stride,
                        const int64_t *token_start, const int64_t *query_len, const int64_t *seq_len,
                        int64_t work_begin, int64_t work_end, int64_t H, int64_t KVH, int64_t D,
                        int64_t block_size, float scale, void *out, int64_t out_stride,
                        int64_t out_bf16, int64_t window, int64_t kv_kind, int64_t kv_scale_bits,
                        int64_t isa, const float *sinks);
int prefill_amx_available(void);
void add_rms_norm_f32(float *residual, const float *delta, const float *weight, float *out,
                      int64_t begin, int64_t end, int64_t n, float eps);
void add_rms_norm_bf16(uint16_t *residual, const uint16_t *delta, const uint16_t *weight,
                       uint16_t *out, int64_t begin, int64_t end, int64_t n, float eps);
void rope_f32(float *qkv, int64_t stride, const int64_t *positions, const float *cos_table,
              const float *sin_table, int64_t begin, int64_t end, int64_t n_heads, int64_t dim);
void rope_bf16(uint16_t *qkv, int64_t stride, const int64_t *positions, const float *cos_table,
               const float *sin_table, int64_t begin, int64_t end, int64_t n_heads, int64_t dim);
void silu_mul_f32(const float *gate_up, float *out, int64_t begin, int64_t end, int64_t n);
void silu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t begin, int64_t end, int64_t n);
void gemm_bf16_panels(const uint16_t *x, int64_t x_stride, int64_t M, int64_t K,
                      const uint16_t *packed, const uint16_t *bias, uint16_t *out,
                      int64_t out_stride, int64_t N, int64_t p_begin, int64_t p_end,
                      int64_t silu_mul);
int gemm_amx_available(void);
void gemm_amx_panels(const uint16_t *x, int64_t x_stride, int64_t M, int64_t K,
                     const uint16_t *packed, const uint16_t *bias, uint16_t *out,
                     int64_t out_stride, int64_t N, int64_t p_begin, int64_t p_end,
                     int64_t silu_mul);
void quantize_rows_q8(const void *x, int64_t x_stride, int64_t K, int64_t Kb, int64_t bf16,
                      int64_t per_row, int8_t *qx, float *dx, float *dxs, int64_t begin,
                      int64_t end);
void gemm_quant_panels(const int8_t *qx, const float *dx, const float *dxs, int64_t Kb,
                       int64_t M, const uint8_t *packed, int64_t kind, int64_t isa,
                       const float *bias, void *out, int64_t out_stride, int64_t N,
                       int64_t out_bf16, int64_t p_begin, int64_t p_end);
/* the quantized kinds: 0 q4, 1 q8, 3 q4s (gemm_quant.c), 2 MXFP4 (gemm_mxfp4.c), 4 q6 (gemm_q6.c),
 * 5 q4k (gemm_q4k.c) */
#define QUANT_KIND_MXFP4 2
#define QUANT_KIND_Q6 4
#define QUANT_KIND_Q4K 5
#define QUANT_KIND_PARTS 6 /* parts of different kinds (pool.c) */
void gemm_q4k_panels(const int8_t *qx, const float *dx, const float *dxs, int64_t Kb, int64_t M,
                     const uint8_t *packed, int64_t isa, const float *bias, void *out,
                     int64_t out_stride, int64_t N, int64_t out_bf16, int64_t p_begin,
                     int64_t p_end);
void gemm_q6_panels(const int8_t *qx, const float *dx, int64_t Kb, int64_t M,
                    const uint8_t *packed, int64_t isa, const float *bias, void *out,
                    int64_t out_stride, int64_t N, int64_t out_bf16, int64_t p_begin,
                    int64_t p_end);
void gemm_mxfp4_panels(const int8_t *qx, const float *dx, int64_t Kb, int64_t M,
                       const uint8_t *packed, int64_t isa, const float *bias, void *out,
                       int64_t out_stride, int64_t N, int64_t out_bf16, int64_t p_begin,
                       int64_t p_end);
int64_t gemm_quant_wide_takes(int64_t kind, int64_t isa, int64_t K, int64_t x_bf16, int64_t out_bf16);
int64_t gemm_quant_wide(const void *x, int64_t x_stride, int64_t K, int64_t Kb, int64_t x_bf16,
                        int64_t M, const uint8_t *packed, int64_t kind, int64_t isa,
                        const float *bias, void *out, int64_t out_stride, int64_t N,
                        int64_t out_bf16, int64_t g_begin, int64_t g_end);
void gemv_f32_panels(const float *x, int64_t x_stride, int64_t M, int64_t K, const void *packed,
                     const float *bias, float *out, int64_t out_stride, int64_t N, int64_t isa,
                     int64_t wdt, int64_t p_begin, int64_t p_end);
void write_kv_f32(const float *k, const float *v, int64_t src_stride, const int64_t *slots,
                  float *k_cache, float *v_cache, int64_t begin, int64_t end, int64_t KVH, int64_t D,
                  int64_t bs);
void write_kv_bf16(const float *k, const float *v, int64_t src_stride, const int64_t *slots,
                   uint16_t *k_cache, uint16_t *v_cache, int64_t begin, int64_t end, int64_t KVH,
                   int64_t D, int64_t bs);
void copy_kv_bf16(const uint16_t *k, const uint16_t *v, int64_t src_stride, const int64_t *slots,
                  uint16_t *k_cache, uint16_t *v_cache, int64_t begin, int64_t end, int64_t KVH,
                  int64_t D, int64_t bs);
void write_kv_q8(const void *k, const void *v, int64_t src_stride, const int64_t *slots,
                 uint8_t *k_cache, uint8_t *v_cache, int64_t begin, int64_t end, int64_t KVH,
                 int64_t D, int64_t bs, int64_t kind, int64_t src_bf16, int64_t k_scale_bits,
                 int64_t v_scale_bits);
void hadamard_rotate_rows(float *x, int64_t rows, int64_t D);
int64_t hadamard_lanes(void);
void lora_shrink(const void *x, int64_t x_stride, int64_t x_bf16, int64_t K, const float *A,
                 int64_t n_slices, int64_t R, const int64_t *ranks, const int64_t *slots,
                 float *s, int64_t isa, int64_t begin, int64_t end);
void lora_expand(const float *s, int64_t n_slices, int64_t R, const int64_t *ranks,
                 const float *Bt, const int64_t *starts, int64_t N, const int64_t *slots, void *y,
                 int64_t y_stride, int64_t y_bf16, int64_t isa, int64_t begin, int64_t end);
void lora_apply(const void *x, int64_t x_stride, int64_t x_bf16, int64_t K, const float *A,
                const float *Bt, int64_t n_slices, int64_t R, const int64_t *ranks,
                const int64_t *starts, int64_t N, const int64_t *slots, float *s, void *y,
                int64_t y_stride, int64_t y_bf16, int64_t isa, int64_t begin, int64_t end);
void causal_conv_rows(const void *x, int64_t x_stride, void *out, int64_t out_stride, void *state,
                      const void *weight, const void *bias, const int64_t *starts,
                      const int64_t *lens, const int64_t *slots, const int64_t *snap_after,
                      const int64_t *snap_slot, int64_t C, int64_t K, int64_t bf16, int64_t silu,
                      int64_t isa, int64_t begin, int64_t end);
void gdn_decode_rows(const void *x, int64_t x_stride, const void *ba, int64_t ba_stride,
                     const float *A_log, const float *dt_bias, float *state,
                     const int64_t *rows, const int64_t *slots, float *out, int64_t nk,
                     int64_t nv, int64_t dk, int64_t dv, const void *z, int64_t z_stride,
                     const void *norm, float eps, void *gated, int64_t gated_stride,
                     int64_t bf16, int64_t isa, int64_t begin, int64_t end);
void ssm_decode_rows(const void *x, int64_t x_stride, const void *dt, int64_t dt_stride,
                     const float *A_log, const float *dt_bias, float *state, const int64_t *rows,
                     const int64_t *slots, float *y, int64_t nh, int64_t G, int64_t P, int64_t N,
                     float dt_min, float dt_max, int64_t bf16, int64_t isa, int64_t begin,
                     int64_t end);
void ssm_gated_norm_rows(const float *y, const void *x, int64_t x_stride, const void *z,
                         int64_t z_stride, const float *D, const void *norm, float eps, void *out,
                         int64_t nh, int64_t P, int64_t G, int64_t bf16, int64_t begin, int64_t end);
void gdn_gated_norm_rows(const float *o, const void *z, int64_t z_stride, const void *norm,
                         float eps, void *gated, int64_t gated_stride, int64_t nv, int64_t dv,
                         int64_t bf16, int64_t begin, int64_t end);
/* state_scan.c: the state layers' prompt chunks */
void gdn_chunk_rows(const void *x, int64_t x_stride, const void *ba, int64_t ba_stride,
                    const float *A_log, const float *dt_bias, float *state, const int64_t *starts,
                    const int64_t *lens, const int64_t *slots, const int64_t *snap_after,
                    const int64_t *snap_slot, float *out, int64_t nk, int64_t nv, int64_t dk,
                    int64_t dv, int64_t cols, int64_t bf16, int64_t isa, int64_t begin, int64_t end);
void ssm_chunk_rows(const void *x, int64_t x_stride, const void *dt, int64_t dt_stride,
                    const float *A_log, const float *dt_bias, float *state, const int64_t *starts,
                    const int64_t *lens, const int64_t *slots, const int64_t *snap_after,
                    const int64_t *snap_slot, float *y, int64_t nh, int64_t G, int64_t P,
                    int64_t N, float dt_min, float dt_max, int64_t bf16, int64_t isa,
                    int64_t begin, int64_t end);

/* pool.c: its kernels' indices (the order of its KERNELS table), the split runner, and the
 * quantized projections in one call each (decode_step.c chains them) */
enum pool_kernel {
    POOL_DECODE_F32, POOL_DECODE_BF16, POOL_PREFILL_BF16, POOL_NORM_F32, POOL_NORM_BF16,
    POOL_ROPE_F32, POOL_ROPE_BF16, POOL_SILU_F32, POOL_SILU_BF16, POOL_GEMM_ROWS,
    POOL_GEMM_PANELS, POOL_QUANTIZE_Q8, POOL_QGEMM_ROWS, POOL_QGEMM_PANELS, POOL_QGEMM_WIDE,
    POOL_GEMV_F32, POOL_LORA, POOL_DECODE_Q8, POOL_CAUSAL_CONV, POOL_GDN_DECODE, POOL_SSM_DECODE,
    POOL_SSM_GATED_NORM, POOL_GDN_CHUNK, POOL_SSM_CHUNK, POOL_GDN_GATED_NORM, POOL_GEMM_AMX
};
void kernel_pool_run(int64_t kernel, const int64_t *args, double farg, int64_t n,
                     const int64_t *weights, int64_t threads);
int64_t quant_linear(const void *x, int64_t x_stride, int64_t K, int64_t Kb, int64_t x_bf16,
                     int64_t per_row, const uint8_t *packed, int64_t kind, int64_t isa,
                     const float *bias, void *out, int64_t N, int64_t out_bf16, int64_t M,
                     int64_t threads, int64_t wide_rows, int64_t silu_mul);
#endif
