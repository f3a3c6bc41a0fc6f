/* How K/V sit in the paged cache. Each cache is [blocks, KVH, bs, D] in size: one tile of bs
 * keys x D dims per block and kv head, its values in pairs so that one vector load serves
 * many keys (for scores) or many dims (for the weighted sum of values) with no horizontal sum:
 *   keys:   dims paired,  [D/2][bs][2]: K(t, d) at ((d / 2) * bs + t) * 2 + d % 2
 *   values: keys paired,  [bs/2][D][2]: V(t, d) at ((t / 2) * D + d) * 2 + t % 2
 * bs and D are even. As 32-bit words of a bf16 cache: key word (c, t) = K(t, 2c..2c+1) at
 * c * bs + t, value word (j, d) = (V(2j, d), V(2j + 1, d)) at j * D + d. kvflow/attention/kv_layout.py
 * is the same layout for PyTorch. */
#ifndef KVFLOW_TILES_H
#define KVFLOW_TILES_H
#include <stdint.h>

static inline int64_t k_tile_at(int64_t t, int64_t d, int64_t bs) { return ((d >> 1) * bs + t) * 2 + (d & 1); }
static inline int64_t v_tile_at(int64_t t, int64_t d, int64_t D) { return ((t >> 1) * D + d) * 2 + (t & 1); }
#endif
