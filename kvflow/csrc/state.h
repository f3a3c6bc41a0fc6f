/* What the state layers' kernels share (state_update.c: one token; state_scan.c: a prompt
 * chunk): activations in the model dtype (bf16 or fp32, the `bf` flag) read and written as
 * fp32, and the gates' scalar functions. */
#ifndef KVFLOW_STATE_H
#define KVFLOW_STATE_H
#include <math.h>
#include <stdint.h>

#include "simd.h"

static inline float ld(const void *p, int bf, int64_t i)
{
    return bf ? bf16_to_float(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline float round_to(int bf, float v) { return bf ? bf16_to_float(float_to_bf16(v)) : v; }

static inline void st(void *p, int bf, int64_t i, float v)
{
    if (bf) ((uint16_t *)p)[i] = float_to_bf16(v);
    else ((float *)p)[i] = v;
}

static inline float softplus(float x) { return x > 20.f ? x : log1pf(expf(x)); }
#endif
