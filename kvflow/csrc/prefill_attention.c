/* Causal attention for prompt tokens (a prefill or a chunk of one) over a bf16 paged cache,
 * on CPUs with AVX512-BF16: flash-attention style, one (sequence, kv head) at a time.
 *
 * Every query row of a prompt reads the same keys. The sequence's keys and values of one kv
 * head are copied once into scratch, block after block, as the cache holds them (tiles.h:
 * keys [D/2][16][2], values [8][D][2], bf16 pairs), so a tile of query rows x heads (TILE =
 * 12 accumulators) takes 16 scores, or 16 output dims, per `vdpbf16ps` with no horizontal
 * sums; an online softmax (running max and sum per row and head, in fp32) folds the keys two
 * blocks at a time into the tile's outputs (one max, sum and rescale per 32 keys, and each
 * broadcast q or probability pair feeds two dot products: 1.2-1.3x one block at a time).
 * As in PyTorch's bf16 flash attention, the probabilities enter the dot products rounded to
 * bf16; scores and sums are fp32.
 *
 * Layout as paged_attention.c but q in bf16: q [*, H, D] bf16, caches in tiles (tiles.h) bf16, out
 * [*, H, D] fp32, or bf16 (rounded to nearest even) with out_bf16. Sequence s has query_len[s] rows from token token_start[s], the last at
 * position seq_len[s] - 1; its keys are positions 0..seq_len[s]-1 through its block table
 * (those of this step must already be written). Work item w is sequence w / KVH, kv head
 * w % KVH; query head h reads kv head h / (H / KVH). Needs D % 32 == 0, bs == 16 and
 * TILE % (H / KVH) == 0; paged_prefill_bf16_supported() says whether a shape qualifies.
 *
 * With a sliding window (window > 0) a query at position p sees keys p - window + 1 .. p only:
 * a tile starts at the block of its first row's first key, and a sequence's blocks before the
 * window of its first query are never read (the sliding-window KV cache may have handed them
 * back: their table entries are the null block).
 *
 * A one-byte cache (kv_kind 1: int8 with a scale per token after each tile, 2: fp8 e4m3 at a
 * per-tensor scale for K and one for V; kvflow/attention/kv_layout.py) is widened as it is copied
 * into that scratch: each value times its scale, rounded once to bf16 (fp8 values are bf16
 * numbers: exact at a power-of-two scale), the same tile layout, so the rest runs unchanged.
 * An fp8 cache whose D is a power of two holds rotated keys and values (rotation.h): each
 * token's are rotated back as they are widened, so queries and outputs stay as they are.
 *
 * On CPUs with AMX (isa 1, where prefill_amx_available() says the tiles are built and the
 * kernel may use them) the same tiles go through the AMX tile unit instead: the cache's key
 * tiles are already AMX's B layout for q x K^T (16 dim pairs x 16 keys), its value tiles for
 * P x V (16 key pairs x 16 dims), so a tile of up to 16 (row, head) pairs takes the scores of
 * up to 64 keys in 2 * NB * D / 32 tile products, the softmax runs on AVX-512 over those
 * scores as above, and P (bf16) x V is another D / 8 products per 64 keys, added to the
 * rescaled outputs.
 *
 * Attention sinks (sinks [H] fp32, one logit per query head, or NULL): each (row, head)'s
 * sink joins its softmax's denominator once, when the tile is stored (tile_store), on both
 * the AVX512-BF16 and the AMX path. */
#define _GNU_SOURCE /* syscall(), for AMX's permission */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "kernels.h"
#include "rotation.h"
#include "simd.h"
#include "tiles.h"

#define TILE 12 /* rows x heads per tile: 12 score and 12 output accumulators */
#define KB 16   /* keys per block: the transposed scratch's lane count */

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>

/* keys and values of blocks b0.. up to key n-1 of kv head kh, block after block: the cache's own tiles (tiles.h),
 * as 32-bit words kt[b][d/2][j] = k(16b + j)[d, d+1], vt[b][j/2][d] = (v(16b + j)[d],
 * v(16b + j + 1)[d]), with zeros past n (a slot not yet written may hold anything) */
/* 16 one-byte values -> fp32 (int8 as integers; fp8 through fp16 bits, value / 256) */
static inline __m512 widen16_byte(const uint8_t *p, int kind) {
    const __m128i b = _mm_loadu_si128((const __m128i *)p);
    if (kind == 1) return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
    /* bits s.eeee.mmm at 14..7, then s carried from bit 14 up to 15 */
    const __m256i a = _mm256_slli_epi16(_mm256_cvtepu8_epi16(b), 7);
    return _mm512_cvtph_ps(_mm256_add_epi16(a, _mm256_and_si256(a, _mm256_set1_epi16(0x4000))));
}

/* one (block, kv head) tile of a one-byte cache into bf16 words, the same layout: key element
 * i is token (i / 2) % 16, value element i token (i / (2D)) * 2 + i % 2 */
static void widen_tile(const uint8_t *src, int kind, float fp8_scale, int64_t D, int is_value,
                       uint16_t *dst) {
    float s[KB];
    for (int j = 0; j < KB; j++)
        s[j] = kind == 1 ? ((const float *)(src + KB * D))[j] : fp8_scale * 256.f;
    /* per 16 elements: keys are 8 tokens x 2 dims, values 8 dims x a key pair */
    for (int64_t i = 0; i < KB * D; i += 16) {
        float f[16];
        for (int e = 0; e < 16; e++)
            f[e] = is_value ? s[((i + e) / (2 * D)) * 2 + (e & 1)] : s[((i + e) / 2) % KB];
        const __m512 x = _mm512_mul_ps(widen16_byte(src + i, kind), _mm512_loadu_ps(f));
        _mm256_storeu_si256((__m256i *)(dst + i), (__m256i)_mm512_cvtneps_pbh(x));
    }
}

/* one fp8 tile of rotated keys (or values) back to plain ones in bf16, the same layout: widened
 * to fp32 times the scale, the butterflies run over each token's D values, 16 tokens at once,
 * then times 1 / sqrt(D) and rounded to bf16 (kv_layout.read_rows' operations, in its order) */
static void widen_rotated_tile(const uint8_t *src, float fp8_scale, int64_t D, int is_value,
                               uint16_t *dst) {
    float x[KB * D];
    const __m512 unit = _mm512_set1_ps(fp8_scale * 256.f); /* the widened fp8 is value / 256 */
    for (int64_t i = 0; i < KB * D; i += 16)
        _mm512_storeu_ps(x + i, _mm512_mul_ps(widen16_byte(src + i, 2), unit));
    if (!is_value) { /* keys [D/2][KB][2]: dims d, d + 1 side by side, dim pairs KB * 2 apart */
        for (int64_t e = 0; e < KB * D; e += 2) {
            const float a = x[e], b = x[e + 1];
            x[e] = a + b;
            x[e + 1] = a - b;
        }
        for (int64_t h = 2; h < D; h <<= 1) /* dim pairs c and c + h / 2 */
            for (int64_t c = 0; c < D / 2; c += h)
                for (int64_t e = c * 2 * KB; e < (c + h / 2) * 2 * KB; e++) {
                    const float a = x[e], b = x[e + h * KB];
                    x[e] = a + b;
                    x[e + h * KB] = a - b;
                }
    } else { /* values [KB/2][D][2]: dim d of a key pair's at 2d, 2d + 1 */
        for (int64_t h = 1; h < D; h <<= 1)
            for (int64_t j = 0; j < KB / 2; j++)
                for (int64_t i = 0; i < D; i += 2 * h)
                    for (int64_t e = (j * D + i) * 2; e < (j * D + i + h) * 2; e++) {
                        const float a = x[e], b = x[e + 2 * h];
                        x[e] = a + b;
                        x[e + 2 * h] = a - b;
                    }
    }
    const __m512 s = _mm512_set1_ps(hadamard_norm(D));
    for (int64_t i = 0; i < KB * D; i += 16)
        _mm256_storeu_si256((__m256i *)(dst + i),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(x + i), s)));
}

static void gather_pairs(const void *k_cache, const void *v_cache, const int64_t *table,
                         int64_t b0, int64_t n, int64_t KVH, int64_t D, int64_t kh, uint32_t *kt,
                         uint32_t *vt, int kind, float k_scale, float v_scale) {
    const int64_t tile = KB * D, half = D / 2;
    const int64_t tile_bytes = kind == 0 ? 2 * tile : kind == 1 ? KB * (D + 4) : tile;
    for (int64_t b = b0; b * KB < n; b++) { /* blocks before b0 are left as they are, unread */
        uint32_t *kd = kt + b * half * KB, *vd = vt + b * KB / 2 * D;
        const uint8_t *ks = (const uint8_t *)k_cache + (table[b] * KVH + kh) * tile_bytes;
        const uint8_t *vs = (const uint8_t *)v_cache + (table[b] * KVH + kh) * tile_bytes;
        if (kind == 0) {
            memcpy(kd, ks, sizeof(uint16_t) * (size_t)tile);
            memcpy(vd, vs, sizeof(uint16_t) * (size_t)tile);
        } else if (kind == 2 && fp8_rotated(D)) {
            widen_rotated_tile(ks, k_scale, D, 0, (uint16_t *)kd);
            widen_rotated_tile(vs, v_scale, D, 1, (uint16_t *)vd);
        } else {
            widen_tile(ks, kind, k_scale, D, 0, (uint16_t *)kd);
            widen_tile(vs, kind, v_scale, D, 1, (uint16_t *)vd);
        }
        const int64_t m = n - b * KB;
        if (m >= KB) continue;
        for (int64_t c = 0; c < half; c++)
            for (int64_t j = m; j < KB; j++) kd[c * KB + j] = 0;
        for (int64_t j = m; j < KB; j++) /* key j is the low (even j) or high half of its word */
            for (int64_t d = 0; d < D; d++) vd[j / 2 * D + d] &= j % 2 ? 0xFFFFu : 0u;
    }
}

/* Which of the 16 keys of the block starting at key k0 a query at position pos sees: keys
 * <= pos (causal) and, with a window, > pos - window */
static inline __mmask16 visible_keys(int64_t pos, int64_t k0, int64_t window) {
    const int64_t vis = pos - k0 + 1;
    __mmask16 keep = vis >= KB ? (__mmask16)0xFFFF : vis <= 0 ? (__mmask16)0 : (__mmask16)((1u << vis) - 1);
    if (window > 0) { /* keys j < lo of this block are before the window */
        const int64_t lo = pos - window + 1 - k0;
        if (lo >= KB) keep = 0;
        else if (lo > 0) keep &= (__mmask16)(0xFFFFu << lo);
    }
    return keep;
}

/* One row's online-softmax step over the raw scores of NB blocks from block b: the running
 * max and sum updated, the blocks' probabilities written to p (16 bf16 a block); returns the
 * factor the row's outputs so far are to be scaled by. exp(-inf) = 0 on the first block; a row
 * that has seen no key yet (a window starts past these blocks) keeps its zeros. */
static inline __attribute__((always_inline)) float softmax_fold(
        const int NB, const __m512 *raw, int64_t pos, int64_t b, int64_t window, float scale,
        float *mx, float *sum, uint16_t *p) {
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    __m512 si[4], m = ninf;
    __mmask16 keep[4];
    for (int u = 0; u < NB; u++) {
        keep[u] = visible_keys(pos, (b + u) * KB, window);
        si[u] = _mm512_mask_blend_ps(keep[u], ninf, _mm512_mul_ps(raw[u], _mm512_set1_ps(scale)));
        m = _mm512_max_ps(m, si[u]);
    }
    const float bm = _mm512_reduce_max_ps(m);
    const float m_new = bm > *mx ? bm : *mx;
    const float corr = m_new == -INFINITY ? 1.f : expf(*mx - m_new);
    __m512 total = _mm512_setzero_ps();
    for (int u = 0; u < NB; u++) {
        const __m512 e = _mm512_maskz_mov_ps(keep[u], exp16(_mm512_sub_ps(si[u], _mm512_set1_ps(m_new))));
        total = _mm512_add_ps(total, e);
        _mm256_storeu_si256((__m256i *)(p + 16 * u), (__m256i)_mm512_cvtneps_pbh(e));
    }
    *sum = *sum * corr + _mm512_reduce_add_ps(total);
    *mx = m_new;
    return corr;
}

/* A tile's start: pair i = row i / G, head kh * G + i % G, rows past the sequence repeating its
 * last row; their positions, their q rows into qa (D bf16 each), outputs, maxima and sums
 * cleared. Returns the block of the first key the tile's first row sees. */
static int64_t tile_begin(const uint16_t *q, int64_t q_stride, int64_t row0, int64_t rows,
                          int64_t pos0, int64_t window, int64_t D, int64_t kh, int G, int M,
                          int64_t *pos, uint16_t *qa, float *o, float *mx, float *sum) {
    for (int i = 0; i < M; i++) {
        const int64_t r = i / G < rows ? i / G : rows - 1;
        pos[i] = pos0 + r;
        memcpy(qa + i * D, q + (row0 + r) * q_stride + (kh * G + i % G) * D, sizeof(uint16_t) * (size_t)D);
        mx[i] = -INFINITY;
        sum[i] = 0.f;
    }
    memset(o, 0, sizeof(float) * (size_t)(M * D));
    return window > 0 && pos0 - window + 1 > 0 ? (pos0 - window + 1) / KB : 0;
}

/* A tile's end: its real rows' outputs over their sums, fp32 or rounded to bf16. A head's
 * attention sink (sinks [H], or NULL) joins its sum here, at the row's final max: the online
 * softmax's outputs and sum are both relative to that max, so exp(sink - max) added to the
 * sum is the sink's share of every fold (simd.h's with_sink). */
static void tile_store(const float *o, const float *sum, const float *mx, const float *sinks,
                       int64_t row0, int64_t rows, int64_t D, int64_t kh, int G, int M, void *out,
                       int64_t out_stride, int out_bf16) {
    for (int i = 0; i < M && i / G < rows; i++) {
        const int64_t at = (row0 + i / G) * out_stride + (kh * G + i % G) * D;
        const __m512 inv = _mm512_set1_ps(1.f / with_sink(sum[i], mx[i], sink_of(sinks, kh * G + i % G)));
        for (int64_t d = 0; d < D; d += 16) { /* D % 32 == 0 */
            const __m512 r = _mm512_mul_ps(_mm512_loadu_ps(o + i * D + d), inv);
            if (out_bf16)
                _mm256_storeu_si256((__m256i *)((uint16_t *)out + at + d), (__m256i)_mm512_cvtneps_pbh(r));
            else
                _mm512_storeu_ps((float *)out + at + d, r);
        }
    }
}

/* Fold NB consecutive key blocks from block b into one tile's running max, sum and outputs:
 * one online-softmax update (reductions, rescale) per NB * 16 keys, and each broadcast of a
 * q pair or a probability pair feeds NB dot products. */
static inline __attribute__((always_inline)) void fold_blocks(
        const int NB, int64_t b, const uint32_t *kt, const uint32_t *vt, const uint32_t *qp,
        const int64_t *pos, int64_t last, int64_t window, int64_t D, float scale, float *mx,
        float *sum, float *o) {
    const int64_t half = D / 2;
    const uint32_t *ktb = kt + b * half * KB;
    __m512 s[TILE][2];
    for (int i = 0; i < TILE; i++)
        for (int u = 0; u < NB; u++) s[i][u] = _mm512_setzero_ps();
    for (int64_t c = 0; c < half; c++) {
        __m512bh kv[2];
        for (int u = 0; u < NB; u++) kv[u] = (__m512bh)_mm512_loadu_si512(ktb + (u * half + c) * KB);
        for (int i = 0; i < TILE; i++) {
            const __m512bh qb = bcast_pair(qp[i * half + c]);
            for (int u = 0; u < NB; u++) s[i][u] = _mm512_dpbf16_ps(s[i][u], kv[u], qb);
        }
    }
    uint32_t pp[TILE][KB]; /* these blocks' probabilities, bf16 pairs */
    for (int i = 0; i < TILE; i++) {
        const float corr = softmax_fold(NB, s[i], pos[i], b, window, scale, mx + i, sum + i,
                                        (uint16_t *)pp[i]);
        if (corr != 1.f)
            for (int64_t d = 0; d < D; d += 16)
                _mm512_storeu_ps(o + i * D + d, _mm512_mul_ps(_mm512_loadu_ps(o + i * D + d),
                                                              _mm512_set1_ps(corr)));
    }
    /* value pairs of consecutive blocks are consecutive in vt */
    const uint32_t *vtb = vt + b * KB / 2 * D;
    const int64_t left = (last + 1 - b * KB + 1) / 2;
    const int64_t pairs = left < NB * KB / 2 ? left : NB * KB / 2;
    for (int64_t d = 0; d < D; d += 32) {
        __m512 acc[TILE][2];
        for (int i = 0; i < TILE; i++)
            for (int h = 0; h < 2; h++) acc[i][h] = _mm512_loadu_ps(o + i * D + d + 16 * h);
        for (int64_t jp = 0; jp < pairs; jp++) {
            const __m512bh v0 = (__m512bh)_mm512_loadu_si512(vtb + jp * D + d);
            const __m512bh v1 = (__m512bh)_mm512_loadu_si512(vtb + jp * D + d + 16);
            for (int i = 0; i < TILE; i++) {
                const __m512bh pb = bcast_pair(pp[i][jp]);
                acc[i][0] = _mm512_dpbf16_ps(acc[i][0], v0, pb);
                acc[i][1] = _mm512_dpbf16_ps(acc[i][1], v1, pb);
            }
        }
        for (int i = 0; i < TILE; i++)
            for (int h = 0; h < 2; h++) _mm512_storeu_ps(o + i * D + d + 16 * h, acc[i][h]);
    }
}

/* One tile: TILE (row, head) pairs, pair i = row i / G, head kh * G + i % G; rows past the
 * sequence repeat its last row (computed, not stored). */
static void tile_bf16(const uint16_t *q, int64_t q_stride, const uint32_t *kt, const uint32_t *vt,
                      int64_t row0, int64_t rows, int64_t pos0, int64_t window, int64_t D,
                      int64_t kh, int G,
                      float scale, void *out, int64_t out_stride, int out_bf16, uint32_t *qp,
                      float *o, const float *sinks) {
    int64_t pos[TILE];
    float mx[TILE], sum[TILE];
    int64_t b = tile_begin(q, q_stride, row0, rows, pos0, window, D, kh, G, TILE, pos,
                           (uint16_t *)qp, o, mx, sum);
    const int64_t last = pos0 + rows - 1; /* the tile's last position */
    for (; (b + 1) * KB <= last; b += 2) /* two whole-or-partial blocks while both hold keys */
        fold_blocks(2, b, kt, vt, qp, pos, last, window, D, scale, mx, sum, o);
    if (b * KB <= last)
        fold_blocks(1, b, kt, vt, qp, pos, last, window, D, scale, mx, sum, o);
    tile_store(o, sum, mx, sinks, row0, rows, D, kh, G, TILE, out, out_stride, out_bf16);
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define AMX_ROWS 16 /* (row, head) pairs per AMX tile */
#define AMX_KEYS 64 /* keys per fold: 4 blocks, one score tile each */

/* Linux hands out AMX's tile state on request, once per process (arch_prctl
 * ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA); without it the first tile instruction faults */
int prefill_amx_available(void) {
    static int ok = -1;
    if (ok < 0) ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    return ok;
}

/* tmm0: A, M rows x 32 bf16 (q dims or probabilities); tmm1-2: B, 16 pair rows x 16 words
 * (key tiles' dim pairs or value tiles' key pairs); tmm4-7: C, M rows x 16 fp32 */
static void amx_configure(int M) {
    struct { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    c.rows[0] = (uint8_t)M; c.colsb[0] = 64;
    for (int t = 1; t <= 2; t++) { c.rows[t] = 16; c.colsb[t] = 64; }
    for (int t = 4; t < 8; t++) { c.rows[t] = (uint8_t)M; c.colsb[t] = 64; }
    _tile_loadconfig(&c);
}

/* Fold NB (1..4) blocks from block b into a tile of M pairs: scores into sc [M][64] through
 * AMX, the online softmax on AVX-512 (pa [M][64]: the probabilities in bf16), then P x V
 * through AMX into part [M][D], added to the rescaled outputs o. An odd NB reads one more
 * block's values at probability zero: the scratch holds a zeroed block past the sequence. */
static void amx_fold(int NB, int64_t b, const uint32_t *kt, const uint32_t *vt, const uint16_t *qa,
                     int M, const int64_t *pos, int64_t window, int64_t D, float scale, float *mx,
                     float *sum, float *o, float *sc, uint16_t *pa, float *part) {
    const int64_t half = D / 2;
    _tile_zero(4); _tile_zero(5); _tile_zero(6); _tile_zero(7);
    for (int64_t e = 0; e < D / 32; e++) { /* dims 32e..32e+31: 16 pair rows of each key tile */
        const uint32_t *kb = kt + b * half * KB + 16 * e * KB;
        _tile_loadd(0, qa + 32 * e, 2 * D);
        _tile_loadd(1, kb, 4 * KB);
        _tile_dpbf16ps(4, 0, 1);
        if (NB > 1) { _tile_loadd(2, kb + half * KB, 4 * KB); _tile_dpbf16ps(5, 0, 2); }
        if (NB > 2) { _tile_loadd(1, kb + 2 * half * KB, 4 * KB); _tile_dpbf16ps(6, 0, 1); }
        if (NB > 3) { _tile_loadd(2, kb + 3 * half * KB, 4 * KB); _tile_dpbf16ps(7, 0, 2); }
    }
    _tile_stored(4, sc, 4 * AMX_KEYS);
    if (NB > 1) _tile_stored(5, sc + 16, 4 * AMX_KEYS);
    if (NB > 2) _tile_stored(6, sc + 32, 4 * AMX_KEYS);
    if (NB > 3) _tile_stored(7, sc + 48, 4 * AMX_KEYS);

    float corr[AMX_ROWS];
    for (int i = 0; i < M; i++) {
        __m512 raw[4];
        for (int u = 0; u < NB; u++) raw[u] = _mm512_loadu_ps(sc + i * AMX_KEYS + 16 * u);
        corr[i] = softmax_fold(NB, raw, pos[i], b, window, scale, mx + i, sum + i, pa + i * AMX_KEYS);
        if (NB & 1) _mm256_storeu_si256((__m256i *)(pa + i * AMX_KEYS + 16 * NB), _mm256_setzero_si256());
    }

    /* P x V: 32 keys (16 value pair rows, consecutive across blocks) per product, 64 dims per
     * pass (four output tiles; D % 32 == 0, so the last pass may have two) */
    const int halves = (NB + 1) / 2;
    for (int64_t dg = 0; dg < D; dg += 64) {
        const int wide = dg + 32 < D;
        _tile_zero(4); _tile_zero(5); _tile_zero(6); _tile_zero(7);
        for (int h = 0; h < halves; h++) {
            const uint32_t *vb = vt + (b * KB / 2 + 16 * h) * D + dg;
            _tile_loadd(0, pa + 32 * h, 2 * AMX_KEYS);
            _tile_loadd(1, vb, 4 * D);
            _tile_dpbf16ps(4, 0, 1);
            _tile_loadd(2, vb + 16, 4 * D);
            _tile_dpbf16ps(5, 0, 2);
            if (wide) {
                _tile_loadd(1, vb + 32, 4 * D);
                _tile_dpbf16ps(6, 0, 1);
                _tile_loadd(2, vb + 48, 4 * D);
                _tile_dpbf16ps(7, 0, 2);
            }
        }
        _tile_stored(4, part + dg, 4 * D);
        _tile_stored(5, part + dg + 16, 4 * D);
        if (wide) {
            _tile_stored(6, part + dg + 32, 4 * D);
            _tile_stored(7, part + dg + 48, 4 * D);
        }
    }
    for (int i = 0; i < M; i++) {
        const __m512 c = _mm512_set1_ps(corr[i]);
        for (int64_t d = 0; d < D; d += 16)
            _mm512_storeu_ps(o + i * D + d, _mm512_fmadd_ps(_mm512_loadu_ps(o + i * D + d), c,
                                                            _mm512_loadu_ps(part + i * D + d)));
    }
}

/* One AMX tile of M = R * G pairs, as tile_bf16's; part: M x D floats of scratch */
static void tile_amx(const uint16_t *q, int64_t q_stride, const uint32_t *kt, const uint32_t *vt,
                     int64_t row0, int64_t rows, int64_t pos0, int64_t window, int64_t D,
                     int64_t kh, int G, int M, float scale, void *out, int64_t out_stride,
                     int out_bf16, uint16_t *qa, float *o, float *part, const float *sinks) {
    int64_t pos[AMX_ROWS];
    float mx[AMX_ROWS], sum[AMX_ROWS], sc[AMX_ROWS * AMX_KEYS];
    uint16_t pa[AMX_ROWS * AMX_KEYS];
    const int64_t last = pos0 + rows - 1;
    for (int64_t b = tile_begin(q, q_stride, row0, rows, pos0, window, D, kh, G, M, pos, qa, o, mx, sum);
         b * KB <= last; b += AMX_KEYS / KB) {
        const int64_t left = last / KB - b + 1;
        amx_fold(left < AMX_KEYS / KB ? (int)left : AMX_KEYS / KB, b, kt, vt, qa, M, pos, window,
                 D, scale, mx, sum, o, sc, pa, part);
    }
    tile_store(o, sum, mx, sinks, row0, rows, D, kh, G, M, out, out_stride, out_bf16);
}
static void amx_release(void) { _tile_release(); }
#else /* built without AMX: never chosen (prefill_amx_available() is 0) */
#define AMX_ROWS 16
int prefill_amx_available(void) { return 0; }
static void amx_configure(int M) { (void)M; }
static void amx_release(void) {}
static void tile_amx(const uint16_t *q, int64_t q_stride, const uint32_t *kt, const uint32_t *vt,
                     int64_t row0, int64_t rows, int64_t pos0, int64_t window, int64_t D,
                     int64_t kh, int G, int M, float scale, void *out, int64_t out_stride,
                     int out_bf16, uint16_t *qa, float *o, float *part, const float *sinks) {
    (void)q; (void)q_stride; (void)kt; (void)vt; (void)row0; (void)rows; (void)pos0; (void)window;
    (void)D; (void)kh; (void)G; (void)M; (void)scale; (void)out; (void)out_stride; (void)out_bf16;
    (void)qa; (void)o; (void)part; (void)sinks;
}
#endif

int paged_prefill_bf16_supported(int64_t H, int64_t KVH, int64_t D, int64_t block_size) {
    return D % 32 == 0 && block_size == KB && H % KVH == 0 && TILE % (H / KVH) == 0;
}

void paged_prefill_bf16(const uint16_t *q, int64_t q_stride, const void *k_cache,
                        const void *v_cache, const int64_t *block_tables, int64_t bt_stride,
                        const int64_t *token_start, const int64_t *query_len, const int64_t *seq_len,
                        int64_t work_begin, int64_t work_end, int64_t H, int64_t KVH, int64_t D,
                        int64_t block_size, float scale, void *out, int64_t out_stride,
                        int64_t out_bf16, int64_t window, int64_t kv_kind, int64_t kv_scale_bits,
                        int64_t isa, const float *sinks) {
    (void)block_size;
    /* fp8's per-tensor scales: K's float bits in the low 32 bits, V's in the high 32 */
    union { uint32_t u; float f; } k_scale = { (uint32_t)kv_scale_bits },
                                   v_scale = { (uint32_t)((uint64_t)kv_scale_bits >> 32) };
    const int G = (int)(H / KVH);
    const int amx = isa == 1 && G <= AMX_ROWS && prefill_amx_available();
    const int R = amx ? AMX_ROWS / G : TILE / G;
    int64_t max_len = 1;
    for (int64_t w = work_begin; w < work_end; w++)
        if (seq_len[w / KVH] > max_len) max_len = seq_len[w / KVH];
    /* one block more than the longest sequence needs: AMX's odd folds read it as zeros */
    const size_t words = (size_t)(((max_len + KB - 1) / KB + 1) * KB * D / 2);
    uint32_t *kt = (uint32_t *)malloc(sizeof(uint32_t) * words);
    uint32_t *vt = (uint32_t *)malloc(sizeof(uint32_t) * words);
    uint32_t *qp = (uint32_t *)malloc(sizeof(uint32_t) * (size_t)(AMX_ROWS * D / 2));
    float *o = (float *)malloc(sizeof(float) * (size_t)(2 * AMX_ROWS * D)); /* outputs, AMX's part */
    if (amx) amx_configure(R * G);
    for (int64_t w = work_begin; w < work_end; w++) {
        const int64_t s = w / KVH, kh = w % KVH;
        const int64_t ql = query_len[s], first = seq_len[s] - ql;
        const int64_t b0 = window > 0 && first - window + 1 > 0 ? (first - window + 1) / KB : 0;
        gather_pairs(k_cache, v_cache, block_tables + s * bt_stride, b0, seq_len[s], KVH, D, kh, kt, vt,
                     (int)kv_kind, k_scale.f, v_scale.f);
        if (amx) { /* the zeroed block past the sequence */
            const int64_t nb = (seq_len[s] + KB - 1) / KB;
            memset(vt + nb * KB / 2 * D, 0, sizeof(uint32_t) * (size_t)(KB / 2 * D));
        }
        for (int64_t r = 0; r < ql; r += R) {
            const int64_t n = ql - r < R ? ql - r : R;
            if (amx)
                tile_amx(q, q_stride, kt, vt, token_start[s] + r, n, first + r, window, D, kh, G,
                         R * G, scale, out, out_stride, (int)out_bf16, (uint16_t *)qp, o,
                         o + AMX_ROWS * D, sinks);
            else
                tile_bf16(q, q_stride, kt, vt, token_start[s] + r, n, first + r, window, D, kh, G,
                          scale, out, out_stride, (int)out_bf16, qp, o, sinks);
        }
    }
    if (amx) amx_release();
    free(kt); free(vt); free(qp); free(o);
}
#else
int prefill_amx_available(void) { return 0; }

int paged_prefill_bf16_supported(int64_t H, int64_t KVH, int64_t D, int64_t block_size) {
    (void)H; (void)KVH; (void)D; (void)block_size;
    return 0;
}

void paged_prefill_bf16(const uint16_t *q, int64_t q_stride, const void *k_cache,
                        const void *v_cache, const int64_t *block_tables, int64_t bt_stride,
                        const int64_t *token_start, const int64_t *query_len, const int64_t *seq_len,
                        int64_t work_begin, int64_t work_end, int64_t H, int64_t KVH, int64_t D,
                        int64_t block_size, float scale, void *out, int64_t out_stride,
                        int64_t out_bf16, int64_t window, int64_t kv_kind, int64_t kv_scale_bits,
                        int64_t isa, const float *sinks) {
    (void)kv_kind; (void)kv_scale_bits; (void)isa; (void)sinks;
    (void)q; (void)q_stride; (void)k_cache; (void)v_cache; (void)block_tables; (void)bt_stride;
    (void)token_start; (void)query_len; (void)seq_len; (void)work_begin; (void)work_end; (void)H;
    (void)KVH; (void)D; (void)block_size; (void)scale; (void)out; (void)out_stride;
    (void)out_bf16; (void)window;
}
#endif
