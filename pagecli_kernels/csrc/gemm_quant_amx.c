/*
 * GGUF blocks times float32 activations on AMX's tiles, for batches (prefill, batched decode):
 * y[m, n] = x[m, k] @ dequant(W[n, k]).T with x and y float32 and float32 sums, as
 * quant_linear_cpu.c's float32 panels compute it, at 1.4-1.7x their rate (2-core Xeon with AMX,
 * 16 to 256 rows, benchmarks/RESULTS.md).
 *
 * Which formats: those whose every 32 values share one scale and one offset, value =
 * scale * q + offset with q a small integer: Q8_0 (q -128..127, no offset), Q4_0 (q - 8),
 * Q4_1, and the sub-blocks of Q4_K and Q5_K (scale d * sc, offset -dmin * m); and Q6_K, value
 * = d * (sc * (q - 32)), whose 8-bit scale per 16 values goes into the weight: the integer
 * w = sc * (q - 32) (at most 12 significant bits) is split exactly into two bfloat16 parts,
 * w = hi + lo (hi: w's top 8 significant bits, lo: the rest, at most 4), each multiplied with
 * the three parts of x, and the super-block's sum is multiplied by d once. Float rows keep
 * the float32 panels.
 *
 * Numerics. The activations are not rounded:
 *   - each input value is split exactly into three bfloat16 parts, x = hi + mid + lo (hi: x's
 *     top 8 significant bits, mid: the next 8 of the rest, lo: the remaining at most 8 bits);
 *   - q is exact in bfloat16 (at most 8 bits), so every product q * part is exact in float32
 *     (at most 16 bits); so are Q6_K's hi and lo;
 *   - TDPBF16PS adds those products into float32 sums, one per block of 32 values (Q6_K: of
 *     256) and output;
 *   - the block's sum times its scale, plus its offset times the block's float32 sum of x,
 *     is added to the output's float32 total.
 * So the result is sum over blocks of (scale * sum(q * x) + offset * sum(x)): the products of
 * the weights scale * q + offset as they are, where the dequantization (and transformers'
 * float32 reference) rounds each such weight to float32 once (Q4_1, Q4_K, Q5_K, Q6_K: a
 * difference of at most half an ulp of the weight; Q8_0 and Q4_0 weights are exact either
 * way), then float32 rounding of the sums and of the scale's product, in another order than
 * the float32 panels'. The error is bounded by sum |x| (|scale * q| + |offset|) rather than
 * sum |x| |w|; the kernel tests hold it to the same per-format tolerance against float64 as
 * the panels.
 * TDPBF16PS takes denormal inputs as zero, so an input below 2^-103 in magnitude can lose its
 * lowest bits; an infinite input gives NaN, and inputs near float32's largest values (1e34
 * on) can overflow the unscaled block sums where the panels' products stay finite.
 *
 * Layout. k is taken in pieces of at most KC_VALUES values a row (k_piece: whole blocks; half
 * that past two strips of tokens, where a panel's rows are many and each strip of x is read
 * from beyond the L2 once a panel), so that a panel of many rows fits in the L2 whatever k is.
 * For each piece, each thread turns a panel of W's rows into bfloat16 codes of q (rows the piece's
 * codes and 32 more apart, so that a tile's 16 rows do not fall in one set of the L1; Q6_K: each
 * 32 values' 32 hi codes, then their 32 lo codes; whole 32-row micro-blocks, zero past W's end)
 * and per-block scales and offsets. x is packed once per call by all threads: per 32-token strip
 * and block, the three parts as 16 pairs x 32 tokens of 32-bit pairs (TDPBF16PS's second operand),
 * and the block's sums of x. A micro-block is 32 rows x 32 tokens, four 16 x 16 tiles of sums
 * (tmm0-3); per 32 values and weight part two tiles of codes (tmm4-5), two of each part of x
 * (tmm6-7), twelve TDPBF16PS. At the end of a block (Q6_K: of 8 times 32 values, two weight parts)
 * the sums go to memory and are scaled into the micro-block's totals with AVX-512, a few rows
 * after each group of four of the next micro-block's tile products (a block's scaling in one
 * piece between two blocks' products keeps the tiles idle while it runs, likely by filling
 * the reorder buffer). Two micro-blocks are swept together, each block of x loaded for both. At
 * the end of a piece the totals are written out by gemm_f32.c's transposing writer, and the
 * next piece reads them back and goes on adding blocks to them in order: the sums are the
 * same, bit for bit, whatever the pieces.
 */
#include <omp.h>
#include <stdlib.h>

#include "quant_blocks.h"

#include "amx.h"
#include "cpu_entry_points.h"
#include "gemm_f32.h"
#if AMX_X86
#include "transpose16.h"
#endif

#define BLOCK 32               /* values per scale (Q6_K: per step of its 256) */
#define PARTS 3                /* bfloat16 parts of an input value */
#define AMX_ROWS 32            /* W rows per micro-block (two tiles' height) */
#define PAIRS (BLOCK / 2)      /* pairs per block: one tile's depth */
/* Bytes of q codes per panel, per thread, in the L2: more rows per panel read each block of x
 * from memory fewer times, which pays where there are many tokens; with few, the panel's split
 * and sweep fit the L2 better. */
#define PANEL_BYTES(strips) ((strips) > 2 ? 1 << 20 : 1 << 19)
#define X_BYTES (1 << 19)      /* bytes of packed x swept per W micro-block: in the L2 */
#define KC_VALUES 2048         /* values of a row a piece of k, up to 2 strips (32 rows: 128 KiB) */
#define E_FORMAT -1
#define E_MEMORY -3

/* Floats per token strip and block of packed x: the parts' pairs, as 32-bit values. */
#define PACKED_BLOCK (PARTS * PAIRS * GEMM_TOKENS)

#if AMX_X86

static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* ---- W: a row's blocks as bfloat16 codes of q, scales and offsets -------------------------- */

/* (blocks of a row; k values) -> q[k] codes, scale[k / 32], offset[k / 32] (NULL where the
 * format has none) */
typedef void (*split_fn)(const void *row, int64_t k, uint16_t *q, float *scale, float *offset);

/* The bfloat16 codes of the integers 0..31 (minus `bias`), as a 32-word table for VPERMW. */
TARGET_AMX static inline __m512i int_codes(int bias) {
    uint16_t codes[32];
    for (int i = 0; i < 32; i++) {
        const float f = (float)(i - bias);
        uint32_t bits;
        memcpy(&bits, &f, sizeof bits);
        codes[i] = (uint16_t)(bits >> 16); /* exact: at most 5 significant bits */
    }
    return _mm512_loadu_si512(codes);
}

/* 32 values 0..31 (bytes) -> their codes from `table`, stored at q. */
TARGET_AMX static inline void store_codes(__m256i values, __m512i table, uint16_t *q) {
    _mm512_storeu_si512(q, _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(values), table));
}

/* 16 bytes as their low nibbles (values 0..15), then their high ones (16..31). */
TARGET_AMX static inline __m256i nibbles(const uint8_t *qs) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)qs), low = _mm_set1_epi8(0xF);
    return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_and_si128(raw, low)),
                                   _mm_and_si128(_mm_srli_epi16(raw, 4), low), 1);
}

/* The top 16 bits of each float: its bfloat16 truncation, kept in place. */
TARGET_AMX static inline __m512 top_bits(__m512 v) {
    return _mm512_castsi512_ps(
        _mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32((int)0xFFFF0000u)));
}

/* 16 floats' bfloat16 codes (each exact in bfloat16), stored at q. */
TARGET_AMX static inline void store_float_codes(__m512 v, uint16_t *q) {
    _mm256_storeu_si256((__m256i *)q,
                        _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16)));
}

TARGET_AMX static void split_q8_0(const void *row, int64_t k, uint16_t *q, float *scale,
                                  float *offset) {
    (void)offset;
    const block_q8_0 *b = row;
    for (int64_t i = 0; i < k / QK8_0; i++, q += QK8_0) {
        scale[i] = _cvtsh_ss(b[i].d);
        const __m128i lo = _mm_loadu_si128((const __m128i *)b[i].qs);
        const __m128i hi = _mm_loadu_si128((const __m128i *)(b[i].qs + 16));
        /* int8 -> float: exact, and exact in bfloat16 */
        store_float_codes(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo)), q);
        store_float_codes(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi)), q + 16);
    }
}

TARGET_AMX static void split_q4_0(const void *row, int64_t k, uint16_t *q, float *scale,
                                  float *offset) {
    (void)offset;
    const block_q4_0 *b = row;
    const __m512i table = int_codes(8);
    for (int64_t i = 0; i < k / QK4_0; i++, q += QK4_0) {
        scale[i] = _cvtsh_ss(b[i].d);
        store_codes(nibbles(b[i].qs), table, q);
    }
}

TARGET_AMX static void split_q4_1(const void *row, int64_t k, uint16_t *q, float *scale,
                                  float *offset) {
    const block_q4_1 *b = row;
    const __m512i table = int_codes(0);
    for (int64_t i = 0; i < k / QK4_1; i++, q += QK4_1) {
        scale[i] = _cvtsh_ss(b[i].d);
        offset[i] = _cvtsh_ss(b[i].m);
        store_codes(nibbles(b[i].qs), table, q);
    }
}

/* Sub-block j's scale d * sc and offset -(dmin * m), computed as the dequantization does. */
static inline void k_scale_offset(int j, const uint8_t *scales, float d, float dmin,
                                  float *scale, float *offset) {
    uint8_t sc, m;
    k_scale_min(j, scales, &sc, &m);
    *scale = d * (float)sc;
    *offset = -(dmin * (float)m);
}

TARGET_AMX static void split_q4_K(const void *row, int64_t k, uint16_t *q, float *scale,
                                  float *offset) {
    const block_q4_K *b = row;
    const __m512i table = int_codes(0);
    const __m256i low = _mm256_set1_epi8(0xF);
    for (int64_t i = 0; i < k / QK_K; i++) {
        const float d = _cvtsh_ss(b[i].d), dmin = _cvtsh_ss(b[i].dmin);
        for (int j = 0; j < 8; j += 2, q += 64, scale += 2, offset += 2) {
            k_scale_offset(j, b[i].scales, d, dmin, scale, offset);
            k_scale_offset(j + 1, b[i].scales, d, dmin, scale + 1, offset + 1);
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(b[i].qs + 16 * j));
            store_codes(_mm256_and_si256(raw, low), table, q);
            store_codes(_mm256_and_si256(_mm256_srli_epi16(raw, 4), low), table, q + 32);
        }
    }
}

TARGET_AMX static void split_q5_K(const void *row, int64_t k, uint16_t *q, float *scale,
                                  float *offset) {
    const block_q5_K *b = row;
    const __m512i table = int_codes(0);
    const __m256i low = _mm256_set1_epi8(0xF), one = _mm256_set1_epi8(1);
    for (int64_t i = 0; i < k / QK_K; i++) {
        const float d = _cvtsh_ss(b[i].d), dmin = _cvtsh_ss(b[i].dmin);
        const __m256i qh = _mm256_loadu_si256((const __m256i *)b[i].qh);
        for (int j = 0; j < 8; j += 2, q += 64, scale += 2, offset += 2) {
            k_scale_offset(j, b[i].scales, d, dmin, scale, offset);
            k_scale_offset(j + 1, b[i].scales, d, dmin, scale + 1, offset + 1);
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(b[i].qs + 16 * j));
            /* bit j of qh[l], then bit j + 1: the fifth bit of value l of sub-blocks j, j + 1 */
            const __m256i h0 = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(j)), one);
            const __m256i h1 =
                _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(j + 1)), one);
            store_codes(_mm256_or_si256(_mm256_and_si256(raw, low), _mm256_slli_epi16(h0, 4)),
                        table, q);
            store_codes(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(raw, 4), low),
                                        _mm256_slli_epi16(h1, 4)),
                        table, q + 32);
        }
    }
}

/* Q6_K: w = sc * (q - 32), exact in float32 (a 7-bit times a 5-bit magnitude, or a power of
 * two); hi its top 8 significant bits, lo = w - hi (exact, at most 4 bits). Per 32 values of
 * the row: 32 hi codes, then 32 lo codes; one scale, d, per 256 values, in scale[i * 8]. */
TARGET_AMX static void split_q6_K(const void *row, int64_t k, uint16_t *q, float *scale,
                                  float *offset) {
    (void)offset;
    const block_q6_K *b = row;
    for (int64_t i = 0; i < k / QK_K; i++) {
        scale[i * (QK_K / BLOCK)] = _cvtsh_ss(b[i].d);
        for (int h = 0; h < 2; h++) {
            __m512i v[2];
            q6_half_bytes(b[i].ql + 64 * h, b[i].qh + 32 * h, &v[0], &v[1]);
#pragma GCC unroll 8 /* q6_lane's c a constant */
            for (int c = 0; c < 8; c++) {
                const __m512 w = _mm512_mul_ps(_mm512_set1_ps((float)b[i].scales[8 * h + c]),
                                               q6_lane(v, c));
                const __m512 hi = top_bits(w);
                /* values 16c..16c+16 of the half: step c / 2, first or second 16 */
                uint16_t *at = q + (4 * h + c / 2) * 2 * BLOCK + 16 * (c & 1);
                store_float_codes(hi, at);
                store_float_codes(_mm512_sub_ps(w, hi), at + BLOCK);
            }
        }
        q += 2 * QK_K;
    }
}

/* The formats this path takes: values and bytes per block (k must be whole blocks), whether
 * values have an offset, the bfloat16 parts of a weight (codes per value), the 32-value steps
 * that share a scale (an offset only with one), and the split. */
static const struct tiles_format {
    int type, block_values, block_bytes, has_offset, weight_parts, steps;
    split_fn split;
} TILES_FORMATS[] = {
    {QT_Q8_0, QK8_0, sizeof(block_q8_0), 0, 1, 1, split_q8_0},
    {QT_Q4_0, QK4_0, sizeof(block_q4_0), 0, 1, 1, split_q4_0},
    {QT_Q4_1, QK4_1, sizeof(block_q4_1), 1, 1, 1, split_q4_1},
    {QT_Q4_K, QK_K, sizeof(block_q4_K), 1, 1, 1, split_q4_K},
    {QT_Q5_K, QK_K, sizeof(block_q5_K), 1, 1, 1, split_q5_K},
    {QT_Q6_K, QK_K, sizeof(block_q6_K), 0, 2, QK_K / BLOCK, split_q6_K},
};

static const struct tiles_format *tiles_format_of(int type) {
    for (size_t i = 0; i < sizeof TILES_FORMATS / sizeof TILES_FORMATS[0]; i++)
        if (TILES_FORMATS[i].type == type) return &TILES_FORMATS[i];
    return NULL;
}

/* ---- x: three bfloat16 parts per value, and each block's sum -------------------------------- */

/* The 32-bit pairs of part values (even value in the low half, as a row of codes lies). */
TARGET_AMX static inline __m512i pair(__m512 even, __m512 odd) {
    return _mm512_or_si512(_mm512_srli_epi32(_mm512_castps_si512(even), 16),
                           _mm512_castps_si512(odd));
}

/* Token strip `strip` of x (m rows, k values, rows ldx apart) into xs (PACKED_BLOCK floats per
 * block: part p's pair i of token j at (p * PAIRS + i) * GEMM_TOKENS + j) and sums (GEMM_TOKENS
 * per block: sum(x) over the block's 32 values, in order); zero past m. */
TARGET_AMX static void pack_parts(const float *x, int64_t ldx, int64_t m, int64_t k,
                                  uint32_t *xs, float *sums, int64_t strip) {
    const int64_t blocks = k / BLOCK;
    for (int half = 0; half < GEMM_TOKENS / 16; half++) {
        const int64_t tok0 = strip * GEMM_TOKENS + half * 16;
        for (int64_t b = 0; b < blocks; b++) {
            __m512 v[BLOCK]; /* v[i]: value i of the block, 16 tokens */
            for (int h = 0; h < 2; h++) {
                for (int j = 0; j < 16; j++)
                    v[16 * h + j] = tok0 + j < m
                                        ? _mm512_loadu_ps(x + (tok0 + j) * ldx + b * BLOCK + 16 * h)
                                        : _mm512_setzero_ps();
                transpose16(v + 16 * h);
            }
            uint32_t *dst = xs + (strip * blocks + b) * PACKED_BLOCK + half * 16;
            __m512 total = v[0];
            for (int i = 1; i < BLOCK; i++) total = _mm512_add_ps(total, v[i]);
            _mm512_store_ps(sums + (strip * blocks + b) * GEMM_TOKENS + half * 16, total);
            for (int i = 0; i < PAIRS; i++) {
                __m512 e = v[2 * i], o = v[2 * i + 1];
                for (int p = 0; p < PARTS; p++) { /* the rest is exact: it drops the top bits */
                    const __m512 eh = top_bits(e), oh = top_bits(o);
                    _mm512_store_si512(dst + (p * PAIRS + i) * GEMM_TOKENS, pair(eh, oh));
                    e = _mm512_sub_ps(e, eh);
                    o = _mm512_sub_ps(o, oh);
                }
            }
        }
    }
}

/* ---- the micro-blocks ----------------------------------------------------------------------- */

/* A micro-block's sums of one block of scales (Q6_K: of 8), waiting to be scaled into its
 * totals: sums (32 rows x 32 tokens), the block's scale s[r * blocks] and offset o[r * blocks]
 * of each row r (o NULL: none), x's sums over the block at xb; `first` (the first block of k)
 * sets the totals instead of adding to them. */
struct pending {
    const float *sums, *s, *o, *xb;
    float *total;
    int first;
};

/* Rows [r0, r1) of p: total plus sums times scale, plus offset times x's sums. */
TARGET_AMX static inline void scale_rows(const struct pending *p, int64_t blocks, int r0,
                                         int r1) {
    const __m512 x0 = _mm512_load_ps(p->xb), x1 = _mm512_load_ps(p->xb + 16);
    for (int r = r0; r < r1; r++) {
        float *tr = p->total + r * GEMM_TOKENS;
        const float *sr = p->sums + r * GEMM_TOKENS;
        const __m512 d = _mm512_set1_ps(p->s[r * blocks]);
        __m512 t0v = _mm512_mul_ps(d, _mm512_load_ps(sr));
        __m512 t1v = _mm512_mul_ps(d, _mm512_load_ps(sr + 16));
        if (p->o) {
            const __m512 c = _mm512_set1_ps(p->o[r * blocks]);
            t0v = _mm512_fmadd_ps(c, x0, t0v);
            t1v = _mm512_fmadd_ps(c, x1, t1v);
        }
        if (!p->first) {
            t0v = _mm512_add_ps(_mm512_load_ps(tr), t0v);
            t1v = _mm512_add_ps(_mm512_load_ps(tr + 16), t1v);
        }
        _mm512_store_ps(tr, t0v);
        _mm512_store_ps(tr + 16, t1v);
    }
}

/* The next `count` rows of p still to scale (`done` of them are), if p holds sums. */
TARGET_AMX static inline void scale_more(const struct pending *p, int64_t blocks, int *done,
                                         int count) {
    if (!p->sums || *done >= AMX_ROWS) return;
    const int to = *done + count < AMX_ROWS ? *done + count : AMX_ROWS;
    scale_rows(p, blocks, *done, to);
    *done = to;
}

#define SWEPT 2 /* micro-blocks swept together: a block of x is loaded for all of them */

/* total[r * GEMM_TOKENS + j] = y[j][r] for r < rows <= 32, j < tokens <= 32, zero elsewhere:
 * amx_write_sums's inverse, to go on with a micro-block's totals over another piece of k. */
TARGET_AMX static void read_sums(float *total, int rows, int64_t tokens, const float *y,
                                 int64_t ldy) {
    for (int rh = 0; rh < AMX_ROWS / 16; rh++) {
        const int n = rows - 16 * rh;
        const __mmask16 mask = n <= 0 ? 0 : n >= 16 ? 0xFFFF : (__mmask16)((1u << n) - 1);
        for (int half = 0; half < GEMM_TOKENS / 16; half++) {
            __m512 v[16];
            for (int j = 0; j < 16; j++)
                v[j] = half * 16 + j < tokens
                           ? _mm512_maskz_loadu_ps(mask, y + (half * 16 + j) * ldy + 16 * rh)
                           : _mm512_setzero_ps();
            transpose16(v);
            for (int i = 0; i < 16; i++)
                _mm512_store_ps(total + (16 * rh + i) * GEMM_TOKENS + half * 16, v[i]);
        }
    }
}

/* y[tok][r] for the tokens of xs (m rows) and the panel's rows [0, count) of format f over
 * blocks [b0, b0 + blocks) of k (xs and xsum: xblocks a strip): codes q (whole micro-blocks,
 * rows ld codes apart), scale and offset (`blocks` per row, a block's at its first 32
 * values; offset NULL: none). `resume`: y holds the sums of blocks [0, b0), which these go on
 * from, in order. Each micro-block's block of products is scaled while the tiles take the
 * next one's (its rows spread among that one's tile products, so that the reorder buffer
 * always holds tile work). Single-threaded, tiles configured. */
TARGET_AMX static void sweep(const struct tiles_format *f, const uint16_t *q, const float *scale,
                             const float *offset, int64_t b0, int64_t blocks, int64_t xblocks,
                             int resume, int64_t count, const uint32_t *xs, const float *xsum,
                             int64_t m, float *y, int64_t ldy) {
    float sums[2][AMX_ROWS * GEMM_TOKENS] __attribute__((aligned(64)));
    float total[SWEPT][AMX_ROWS * GEMM_TOKENS] __attribute__((aligned(64)));
    const int64_t strips = (m + GEMM_TOKENS - 1) / GEMM_TOKENS;
    const int parts = f->weight_parts, steps = f->steps;
    const int64_t ld = blocks * BLOCK * parts + BLOCK, stride = ld * (int64_t)sizeof(uint16_t);
    const int groups = steps * parts * PARTS;         /* a block's groups of tile products */
    const int per = (AMX_ROWS + groups - 1) / groups; /* rows scaled after each */
    int64_t group = X_BYTES / (blocks * PACKED_BLOCK * 4);
    group = group < 1 ? 1 : group;
    for (int64_t t0 = 0; t0 < strips; t0 += group)
        for (int64_t r0 = 0; r0 < count; r0 += SWEPT * AMX_ROWS) {
            const int swept = (int)min64(SWEPT, (count - r0 + AMX_ROWS - 1) / AMX_ROWS);
            for (int64_t t = t0; t < min64(t0 + group, strips); t++) {
                const int64_t tok = t * GEMM_TOKENS, tokens = min64(GEMM_TOKENS, m - tok);
                const uint32_t *xt = xs + (t * xblocks + b0) * PACKED_BLOCK; /* the piece's */
                if (resume)
                    for (int g = 0; g < swept; g++) {
                        const int64_t r = r0 + g * AMX_ROWS;
                        read_sums(total[g], (int)min64(AMX_ROWS, count - r), tokens,
                                  y + tok * ldy + r, ldy);
                    }
                struct pending prev = {0}; /* no sums yet */
                int slot = 0;
                for (int64_t b = 0; b < blocks; b += steps)
                    for (int g = 0; g < swept; g++) {
                        const int64_t r = r0 + g * AMX_ROWS;
                        const uint16_t *a = q + r * ld;
                        int done = 0; /* prev's rows scaled */
                        _tile_zero(0);
                        _tile_zero(1);
                        _tile_zero(2);
                        _tile_zero(3);
                        for (int64_t i = b; i < b + steps; i++) {
                            const uint32_t *bx = xt + i * PACKED_BLOCK;
                            for (int w = 0; w < parts; w++) {
                                const uint16_t *c = a + (i * parts + w) * BLOCK;
                                _tile_loadd(4, c, stride);
                                _tile_loadd(5, c + 16 * ld, stride);
                                for (int p = 0; p < PARTS; p++) {
                                    amx_products(bx + p * PAIRS * GEMM_TOKENS);
                                    scale_more(&prev, blocks, &done, per);
                                }
                            }
                        }
                        amx_store_sums(sums[slot]);
                        prev = (struct pending){
                            .sums = sums[slot],
                            .s = scale + r * blocks + b,
                            .o = offset ? offset + r * blocks + b : NULL,
                            .xb = xsum + (t * xblocks + b0 + b) * GEMM_TOKENS,
                            .total = total[g],
                            .first = b == 0 && !resume};
                        slot ^= 1;
                    }
                if (prev.sums) scale_rows(&prev, blocks, 0, AMX_ROWS);
                MEMORY_BARRIER();
                for (int g = 0; g < swept; g++) {
                    const int64_t r = r0 + g * AMX_ROWS;
                    amx_write_sums(total[g], (int)min64(AMX_ROWS, count - r), tokens,
                                   y + tok * ldy + r, ldy);
                }
            }
        }
}

/* The values of k a panel holds at once: k in as few pieces as KC_VALUES values a row allow
 * (half as many past two strips of tokens: twice the panel's rows, each strip of x read half
 * as often), each whole blocks of the format (whole super-blocks for the K-quants), as even as
 * they go. The pieces do not change the sums: each goes on from the last one's totals. */
static int64_t k_piece(const struct tiles_format *f, int64_t k, int64_t strips) {
    const int64_t most = strips > 2 ? KC_VALUES / 2 : KC_VALUES, bv = f->block_values;
    const int64_t pieces = (k + most - 1) / most;
    return ((k + pieces - 1) / pieces + bv - 1) / bv * bv;
}

/* Panels of W's rows: whole micro-blocks, at most PANEL_BYTES of codes each (one micro-block
 * where a micro-block's codes alone pass it), as many per thread, and as even as micro-blocks
 * allow (schedule(static) gives each thread a run of them). Panel p holds micro-blocks
 * [p * micro_blocks / panels, (p + 1) * micro_blocks / panels). */
static int64_t num_panels(int64_t n, int64_t k, int64_t strips, int num_threads) {
    const int64_t micro_blocks = (n + AMX_ROWS - 1) / AMX_ROWS;
    int64_t most = PANEL_BYTES(strips) / (k * (int64_t)sizeof(uint16_t) * AMX_ROWS); /* k: codes */
    most = most < 1 ? 1 : most;
    const int64_t share = (micro_blocks + num_threads - 1) / num_threads;
    const int64_t panels = (share + most - 1) / most * num_threads;
    return panels < micro_blocks ? panels : micro_blocks;
}

static __thread float *packed; /* the calling thread's: x's parts, then the block sums */
static __thread int64_t packed_cap;
static __thread float *panel; /* each thread's: codes, then scales and offsets */
static __thread int64_t panel_cap;

#endif

/* Whether `type`'s blocks take this path (pagecli_quant_tiles_linear). */
int pagecli_quant_tiles_format(int type) {
#if AMX_X86
    return tiles_format_of(type) != NULL;
#else
    (void)type;
    return 0;
#endif
}

/* y[m, n] = x[m, k] @ dequant(W[n, k]).T for a format that pagecli_quant_tiles_format names:
 * W's rows row_bytes apart, x's rows ldx floats apart, y's rows ldy apart; k whole blocks of
 * the format. The caller checks that the tiles are granted and the CPU has AVX-512
 * (pagecli_quant_tiles). Returns 0, E_FORMAT (another format, or k not whole blocks), or
 * E_MEMORY. */
int pagecli_quant_tiles_linear(int type, const void *w, int64_t row_bytes, int64_t n, int64_t k,
                               const float *x, int64_t ldx, int64_t m, float *y, int64_t ldy,
                               int num_threads) {
#if AMX_X86
    const struct tiles_format *f = tiles_format_of(type);
    if (!f || k % f->block_values) return E_FORMAT;
    if (m <= 0 || n <= 0) return 0;
    const int64_t blocks = k / BLOCK, strips = (m + GEMM_TOKENS - 1) / GEMM_TOKENS;
    if (gemm_reserve(&packed, &packed_cap, strips * blocks * (PACKED_BLOCK + GEMM_TOKENS)))
        return E_MEMORY;
    uint32_t *const xs = (uint32_t *)packed; /* shared with the team below */
    float *const xsum = packed + strips * blocks * PACKED_BLOCK;
    const int64_t piece = k_piece(f, k, strips);
    const int64_t codes = piece * f->weight_parts; /* a row's, a piece */
    const int64_t panels = num_panels(n, codes, strips, num_threads);
    const int64_t micro_blocks = (n + AMX_ROWS - 1) / AMX_ROWS;
    const int64_t rows = (micro_blocks + panels - 1) / panels * AMX_ROWS; /* the most per panel */
    const int64_t panel_floats = rows * (codes + BLOCK) / 2 + 2 * rows * (piece / BLOCK);
    const uint8_t *wb = w;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < strips; t++) pack_parts(x, ldx, m, k, xs, xsum, t);
        if (gemm_reserve(&panel, &panel_cap, panel_floats)) failed = 1;
        amx_begin();
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++) {
            if (failed) continue;
            const int64_t first = p * micro_blocks / panels * AMX_ROWS;
            const int64_t count = min64((p + 1) * micro_blocks / panels * AMX_ROWS, n) - first;
            const int64_t padded = (count + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS;
            for (int64_t k0 = 0; k0 < k; k0 += piece) {
                const int64_t kk = min64(piece, k - k0), kb = kk / BLOCK;
                const int64_t kc = kk * f->weight_parts; /* codes a row */
                uint16_t *q = (uint16_t *)panel;
                float *scale = panel + rows * (codes + BLOCK) / 2, *offset = scale + rows * kb;
                const uint8_t *from = wb + k0 / f->block_values * f->block_bytes;
                for (int64_t r = 0; r < count; r++)
                    f->split(from + (first + r) * row_bytes, kk, q + r * (kc + BLOCK),
                             scale + r * kb, offset + r * kb);
                for (int64_t r = count; r < padded; r++) /* zero rows: finite, not written */
                    memset(q + r * (kc + BLOCK), 0, kc * sizeof(uint16_t));
                for (int64_t i = count * kb; i < padded * kb; i++) scale[i] = offset[i] = 0;
                MEMORY_BARRIER();
                sweep(f, q, scale, f->has_offset ? offset : NULL, k0 / BLOCK, kb, blocks, k0 > 0,
                      count, xs, xsum, m, y + first, ldy);
            }
        }
        amx_end();
    }
    return failed ? E_MEMORY : 0;
#else
    (void)type, (void)w, (void)row_bytes, (void)n, (void)k, (void)x, (void)ldx, (void)m,
        (void)y, (void)ldy, (void)num_threads;
    return E_FORMAT;
#endif
}
