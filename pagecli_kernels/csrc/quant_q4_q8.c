/*
 * The 32-value block formats Q8_0, Q4_0, Q4_1, IQ4_NL and MXFP4, and IQ4_XS (IQ4_NL's
 * 32-value sub-blocks in super-blocks of 256): dequantization into float32.
 *
 * Per format: the portable loop (the readable spec, ggml's dequantize_row_*), then AVX2 and
 * AVX-512 versions that give the same bits, then the fused decode kernels (rows, wide). Q4_1's
 * d * q + m is rounded twice in gguf.quants.dequantize; since d * q (an f16 times a 4-bit
 * integer) is exact in float32, an FMA's single rounding gives the same bits, so the kernels
 * may use one. See quant_blocks.h.
 */
#include "quant_blocks.h"

#include <math.h>

#if QUANT_X86
#include <immintrin.h>
#endif

/* ---- Q8_0: d * q ------------------------------------------------------------------------ */

static void dequant_q8_0_portable(const void *blocks, float *out, int64_t num_blocks) {
    const block_q8_0 *b = blocks;
    for (int64_t i = 0; i < num_blocks; i++, out += QK8_0) {
        const float d = f16_to_f32(b[i].d);
        for (int j = 0; j < QK8_0; j++) out[j] = (float)b[i].qs[j] * d;
    }
}

/* ---- Q4_0: d * (q - 8) ------------------------------------------------------------------ */

static void dequant_q4_0_portable(const void *blocks, float *out, int64_t num_blocks) {
    const block_q4_0 *b = blocks;
    for (int64_t i = 0; i < num_blocks; i++, out += QK4_0) {
        const float d = f16_to_f32(b[i].d);
        for (int j = 0; j < QK4_0 / 2; j++) {
            out[j] = d * (float)((b[i].qs[j] & 0xF) - 8);
            out[j + QK4_0 / 2] = d * (float)((b[i].qs[j] >> 4) - 8);
        }
    }
}

/* ---- Q4_1: d * q + m -------------------------------------------------------------------- */

static void dequant_q4_1_portable(const void *blocks, float *out, int64_t num_blocks) {
    const block_q4_1 *b = blocks;
    for (int64_t i = 0; i < num_blocks; i++, out += QK4_1) {
        const float d = f16_to_f32(b[i].d), m = f16_to_f32(b[i].m);
        for (int j = 0; j < QK4_1 / 2; j++) {
            out[j] = d * (float)(b[i].qs[j] & 0xF) + m;
            out[j + QK4_1 / 2] = d * (float)(b[i].qs[j] >> 4) + m;
        }
    }
}

/* ---- IQ4_NL: d * IQ4_NL_VALUES[q] (the product of an f16 and a 7-bit integer: exact) ---- */

static void dequant_iq4_nl_portable(const void *blocks, float *out, int64_t num_blocks) {
    const block_iq4_nl *b = blocks;
    for (int64_t i = 0; i < num_blocks; i++, out += QK4_0) {
        const float d = f16_to_f32(b[i].d);
        for (int j = 0; j < QK4_0 / 2; j++) {
            out[j] = d * (float)IQ4_NL_VALUES[b[i].qs[j] & 0xF];
            out[j + QK4_0 / 2] = d * (float)IQ4_NL_VALUES[b[i].qs[j] >> 4];
        }
    }
}

/* ---- IQ4_XS: (d * (ls - 32)) * IQ4_NL_VALUES[q] per 32-value sub-block ------------------ */

static void dequant_iq4_xs_portable(const void *blocks, float *out, int64_t num_blocks) {
    const block_iq4_xs *b = blocks;
    for (int64_t i = 0; i < num_blocks; i++) {
        const float d = f16_to_f32(b[i].d);
        for (int s = 0; s < QK_K / 32; s++, out += 32) {
            const float dl = iq4_xs_scale(&b[i], d, s);
            const uint8_t *qs = b[i].qs + 16 * s;
            for (int j = 0; j < 16; j++) {
                out[j] = dl * (float)IQ4_NL_VALUES[qs[j] & 0xF];
                out[j + 16] = dl * (float)IQ4_NL_VALUES[qs[j] >> 4];
            }
        }
    }
}

/* ---- MXFP4: e8m0_half(e) * MXFP4_VALUES[q] (a power of two times a small integer) ------- */

static void dequant_mxfp4_portable(const void *blocks, float *out, int64_t num_blocks) {
    const block_mxfp4 *b = blocks;
    for (int64_t i = 0; i < num_blocks; i++, out += QK4_0) {
        const float d = e8m0_half(b[i].e);
        for (int j = 0; j < QK4_0 / 2; j++) {
            out[j] = d * (float)MXFP4_VALUES[b[i].qs[j] & 0xF];
            out[j + QK4_0 / 2] = d * (float)MXFP4_VALUES[b[i].qs[j] >> 4];
        }
    }
}

#if QUANT_X86

TARGET_AVX2 static void dequant_mxfp4_avx2(const void *blocks, float *out, int64_t n) {
    dequant_mxfp4_portable(blocks, out, n);
}
TARGET_AVX512 static void dequant_mxfp4_avx512(const void *blocks, float *out, int64_t n) {
    dequant_mxfp4_portable(blocks, out, n);
}

/* IQ4_NL's dequantization on the wide paths: the portable loop's bits (its products are
 * exact), the decode kernels below carry the vector work */
TARGET_AVX2 static void dequant_iq4_nl_avx2(const void *blocks, float *out, int64_t n) {
    dequant_iq4_nl_portable(blocks, out, n);
}
TARGET_AVX512 static void dequant_iq4_nl_avx512(const void *blocks, float *out, int64_t n) {
    dequant_iq4_nl_portable(blocks, out, n);
}
TARGET_AVX2 static void dequant_iq4_xs_avx2(const void *blocks, float *out, int64_t n) {
    dequant_iq4_xs_portable(blocks, out, n);
}
TARGET_AVX512 static void dequant_iq4_xs_avx512(const void *blocks, float *out, int64_t n) {
    dequant_iq4_xs_portable(blocks, out, n);
}

/* 8 or 16 bytes as int32 lanes, float. */
TARGET_AVX2 static inline __m256 u8x8_ps(__m128i v) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
}
TARGET_AVX512 static inline __m512 u8x16_ps(__m128i v) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v));
}

TARGET_AVX2 static void dequant_q8_0_avx2(const void *blocks, float *out, int64_t num_blocks) {
    const block_q8_0 *b = blocks;
    for (int64_t i = 0; i < num_blocks; i++, out += QK8_0) {
        const __m256 d = _mm256_set1_ps(_cvtsh_ss(b[i].d));
        for (int j = 0; j < QK8_0; j += 8) {
            const __m128i q = _mm_loadl_epi64((const __m128i *)(b[i].qs + j));
            const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
            _mm256_storeu_ps(out + j, _mm256_mul_ps(v, d));
        }
    }
}

TARGET_AVX512 static void dequant_q8_0_avx512(const void *blocks, float *out,
                                              int64_t num_blocks) {
    const block_q8_0 *b = blocks;
    for (int64_t i = 0; i < num_blocks; i++, out += QK8_0) {
        const __m512 d = _mm512_set1_ps(_cvtsh_ss(b[i].d));
        for (int j = 0; j < QK8_0; j += 16) {
            const __m128i q = _mm_loadu_si128((const __m128i *)(b[i].qs + j));
            const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q));
            _mm512_storeu_ps(out + j, _mm512_mul_ps(v, d));
        }
    }
}

TARGET_AVX2 static void dequant_q4_0_avx2(const void *blocks, float *out, int64_t num_blocks) {
    const block_q4_0 *b = blocks;
    const __m128i low = _mm_set1_epi8(0xF), eight = _mm_set1_epi8(8);
    for (int64_t i = 0; i < num_blocks; i++, out += QK4_0) {
        const __m256 d = _mm256_set1_ps(_cvtsh_ss(b[i].d));
        const __m128i q = _mm_loadu_si128((const __m128i *)b[i].qs);
        const __m128i lo = _mm_sub_epi8(_mm_and_si128(q, low), eight);
        const __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(q, 4), low), eight);
        const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
        for (int p = 0; p < 4; p++) {
            const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(parts[p]));
            _mm256_storeu_ps(out + 8 * p, _mm256_mul_ps(d, v));
        }
    }
}

/* AVX-512: 4-bit values through a 16-entry table per block, table[q] = d * (q - 8), computed
 * with gguf's rounding: a permute instead of converting and scaling every value. */
TARGET_AVX512 static void dequant_q4_0_avx512(const void *blocks, float *out,
                                              int64_t num_blocks) {
    const block_q4_0 *b = blocks;
    const __m512 levels = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    for (int64_t i = 0; i < num_blocks; i++, out += QK4_0) {
        const __m512 table = _mm512_mul_ps(_mm512_set1_ps(_cvtsh_ss(b[i].d)), levels);
        const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)b[i].qs));
        _mm512_storeu_ps(out, _mm512_permutexvar_ps(q, table)); /* low nibbles: index bits */
        _mm512_storeu_ps(out + 16, _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table));
    }
}

TARGET_AVX2 static void dequant_q4_1_avx2(const void *blocks, float *out, int64_t num_blocks) {
    const block_q4_1 *b = blocks;
    const __m128i low = _mm_set1_epi8(0xF);
    for (int64_t i = 0; i < num_blocks; i++, out += QK4_1) {
        const __m256 d = _mm256_set1_ps(_cvtsh_ss(b[i].d));
        const __m256 m = _mm256_set1_ps(_cvtsh_ss(b[i].m));
        const __m128i q = _mm_loadu_si128((const __m128i *)b[i].qs);
        const __m128i lo = _mm_and_si128(q, low);
        const __m128i hi = _mm_and_si128(_mm_srli_epi16(q, 4), low);
        const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
        for (int p = 0; p < 4; p++) {
            const __m256 v = _mm256_mul_ps(d, u8x8_ps(parts[p]));
            _mm256_storeu_ps(out + 8 * p, _mm256_add_ps(v, m));
        }
    }
}

TARGET_AVX512 static void dequant_q4_1_avx512(const void *blocks, float *out,
                                              int64_t num_blocks) {
    const block_q4_1 *b = blocks;
    const __m512 levels = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int64_t i = 0; i < num_blocks; i++, out += QK4_1) {
        const __m512 table = _mm512_add_ps(
            _mm512_mul_ps(_mm512_set1_ps(_cvtsh_ss(b[i].d)), levels),
            _mm512_set1_ps(_cvtsh_ss(b[i].m))); /* d * q + m, rounded twice as gguf does */
        const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)b[i].qs));
        _mm512_storeu_ps(out, _mm512_permutexvar_ps(q, table));
        _mm512_storeu_ps(out + 16, _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table));
    }
}

/* f16 -> f32 for every bit pattern (quant_blocks.h), filled once when the library loads. */
float pagecli_f16_table[1 << 16];

__attribute__((constructor)) static void fill_f16_table(void) {
    for (uint32_t h = 0; h < (1u << 16); h++) pagecli_f16_table[h] = f16_to_f32((f16_bits)h);
}

#define SCALE(h) _mm512_set1_ps(pagecli_f16_table[(h)]) /* a broadcast load */

/* ---- one block's 32 weights in registers (AVX-512) -----------------------------------------
 * As two vectors, values 0..15 and 16..31, bit for bit gguf's; the rows, small-batch and
 * wide kernels below all take their weights from these. The 4-bit formats read a 16-entry table
 * per block, table[q] = d * (q - 8) or d * q + m: a permute replaces the int-to-float
 * conversion and the scaling of every weight. */

TARGET_AVX512 static inline __attribute__((always_inline)) void
weights_q8_0(const block_q8_0 *b, __m512 *w0, __m512 *w1) {
    const __m512 d = SCALE(b->d);
    const __m128i q0 = _mm_loadu_si128((const __m128i *)b->qs);
    const __m128i q1 = _mm_loadu_si128((const __m128i *)(b->qs + 16));
    *w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0)), d);
    *w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1)), d);
}

TARGET_AVX512 static inline __attribute__((always_inline)) void
weights_q4_0(const block_q4_0 *b, __m512 *w0, __m512 *w1) {
    const __m512 levels = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    const __m512 table = _mm512_mul_ps(SCALE(b->d), levels);
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)b->qs));
    *w0 = _mm512_permutexvar_ps(q, table); /* low nibbles: index bits */
    *w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table);
}

TARGET_AVX512 static inline __attribute__((always_inline)) void
weights_q4_1(const block_q4_1 *b, __m512 *w0, __m512 *w1) {
    const __m512 levels = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    /* d * q is exact, so one rounding of d * q + m is gguf's two */
    const __m512 table = _mm512_fmadd_ps(levels, SCALE(b->d), SCALE(b->m));
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)b->qs));
    *w0 = _mm512_permutexvar_ps(q, table);
    *w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table);
}

/* ---- register-fused decode rows, small-batch and wide kernels, per format (AVX-512) -------
 * rows: one weight row against up to ROWS_MAX inputs; small: R rows against 2-4 inputs
 * (SMALL_*: quant_blocks.h); many: R rows against 5-8 inputs, values 0..15 of every block
 * (the rows kernel's first sum) in one pass and 16..31 in the other (MANY_*); wide: WIDE_ROWS
 * rows against one input, so that eight FMA chains run side by side and each 32 values of x
 * are loaded once for the four (WIDE_*: quant_blocks.h). */

#define BLOCK_KERNELS(name)                                                                    \
    ROWS_KERNEL(rows_##name##_avx512) {                                                        \
        const block_##name *b = row;                                                           \
        ROWS_BEGIN                                                                             \
        for (int64_t j = 0; j < nb; j++) {                                                     \
            __m512 w0, w1;                                                                     \
            weights_##name(&b[j], &w0, &w1);                                                   \
            ROWS_FMA16(0, w0, 32 * j)                                                          \
            ROWS_FMA16(1, w1, 32 * j + 16)                                                     \
        }                                                                                      \
        ROWS_END                                                                               \
    }                                                                                          \
    ROWS_DISPATCH(rows_##name##_avx512)                                                        \
                                                                                               \
    SMALL_KERNEL(small_##name##_avx512) {                                                      \
        SMALL_BEGIN                                                                            \
        for (int64_t j = 0; j < nb; j++) {                                                     \
            __m512 w0[4], w1[4];                                                               \
            for (int r = 0; r < R; r++) {                                                      \
                const block_##name *b =                                                        \
                    (const block_##name *)((const uint8_t *)w + r * row_bytes) + j;            \
                WIDE_PREFETCH(b);                                                              \
                weights_##name(b, &w0[r], &w1[r]);                                             \
            }                                                                                  \
            SMALL_FMA32(w0, w1, 32 * j)                                                        \
        }                                                                                      \
        SMALL_END                                                                              \
    }                                                                                          \
    SMALL_DISPATCH(small_##name##_avx512)                                                      \
                                                                                               \
    MANY_KERNEL(many_##name##_avx512) {                                                        \
        MANY_BEGIN                                                                             \
        (void)scratch;                                                                         \
        for (int64_t j = 0; j < nb; j++) {                                                     \
            __m512 wv[3];                                                                      \
            for (int r = 0; r < R; r++) {                                                      \
                const block_##name *b =                                                        \
                    (const block_##name *)((const uint8_t *)w + r * row_bytes) + j;            \
                if (!HALF) WIDE_PREFETCH(b);                                                   \
                __m512 w0, w1; /* the half not taken is never computed */                      \
                weights_##name(b, &w0, &w1);                                                   \
                wv[r] = HALF ? w1 : w0;                                                        \
            }                                                                                  \
            MANY_FMA16(wv, 32 * j + 16 * HALF)                                                 \
        }                                                                                      \
        MANY_END                                                                               \
    }                                                                                          \
    MANY_DISPATCH(many_##name##_avx512)                                                        \
                                                                                               \
    TARGET_AVX512 static void wide_##name##_avx512(const void *w, int64_t row_bytes, int64_t nb, \
                                                   const float *x, float *out) {               \
        WIDE_BEGIN                                                                             \
        for (int64_t j = 0; j < nb; j++) {                                                     \
            const __m512 x0 = _mm512_loadu_ps(x + 32 * j);                                     \
            const __m512 x1 = _mm512_loadu_ps(x + 32 * j + 16);                                \
            for (int r = 0; r < WIDE_ROWS; r++) {                                              \
                const block_##name *b =                                                        \
                    (const block_##name *)((const uint8_t *)w + r * row_bytes) + j;            \
                WIDE_PREFETCH(b);                                                              \
                __m512 w0, w1;                                                                 \
                weights_##name(b, &w0, &w1);                                                   \
                acc[r][0] = _mm512_fmadd_ps(w0, x0, acc[r][0]);                                \
                acc[r][1] = _mm512_fmadd_ps(w1, x1, acc[r][1]);                                \
            }                                                                                  \
        }                                                                                      \
        WIDE_END                                                                               \
    }

/* The 32 nibbles at qs through a 16-entry table of floats: values 0..15, then 16..31 (the
 * non-linear formats, whose table is the block's scale times fixed levels) */
TARGET_AVX512 static inline __attribute__((always_inline)) void
table_weights(const uint8_t *qs, __m512 table, __m512 *w0, __m512 *w1) {
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)qs));
    *w0 = _mm512_permutexvar_ps(q, table); /* low nibbles: index bits */
    *w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table);
}

TARGET_AVX512 static inline __attribute__((always_inline)) void
weights_iq4_nl(const block_iq4_nl *b, __m512 *w0, __m512 *w1) {
    const __m512 levels = _mm512_setr_ps(-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38,
                                         53, 69, 89, 113);
    table_weights(b->qs, _mm512_mul_ps(SCALE(b->d), levels), w0, w1);
}

TARGET_AVX512 static inline __attribute__((always_inline)) void
weights_mxfp4(const block_mxfp4 *b, __m512 *w0, __m512 *w1) {
    const __m512 levels =
        _mm512_setr_ps(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
    table_weights(b->qs, _mm512_mul_ps(_mm512_set1_ps(e8m0_half(b->e)), levels), w0, w1);
}

/* IQ4_XS (AVX-512): each sub-block's table is its scale times IQ4_NL's levels; the rows and
 * wide kernels add a row's sub-blocks in order into its two accumulators (the same bits in
 * either). */
#define IQ4_LEVELS                                                                             \
    _mm512_setr_ps(-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)

ROWS_KERNEL(rows_iq4_xs_avx512) {
    const block_iq4_xs *b = row;
    const __m512 levels = IQ4_LEVELS;
    ROWS_BEGIN
    for (int64_t j = 0; j < nb; j++) {
        const float d = pagecli_f16_table[b[j].d];
        for (int s = 0; s < QK_K / 32; s++) {
            __m512 w0, w1;
            const __m512 dl = _mm512_set1_ps(iq4_xs_scale(&b[j], d, s));
            table_weights(b[j].qs + 16 * s, _mm512_mul_ps(dl, levels), &w0, &w1);
            ROWS_FMA16(0, w0, QK_K * j + 32 * s)
            ROWS_FMA16(1, w1, QK_K * j + 32 * s + 16)
        }
    }
    ROWS_END
}
ROWS_DISPATCH(rows_iq4_xs_avx512)

TARGET_AVX512 static void wide_iq4_xs_avx512(const void *w, int64_t row_bytes, int64_t nb,
                                             const float *x, float *out) {
    const __m512 levels = IQ4_LEVELS;
    WIDE_BEGIN
    for (int64_t j = 0; j < nb; j++) {
        for (int r = 0; r < WIDE_ROWS; r++) {
            const block_iq4_xs *b = (const block_iq4_xs *)((const uint8_t *)w + r * row_bytes) + j;
            WIDE_PREFETCH_BLOCK(b, (int)sizeof(block_iq4_xs))
        }
        for (int s = 0; s < QK_K / 32; s++) {
            const __m512 x0 = _mm512_loadu_ps(x + QK_K * j + 32 * s);
            const __m512 x1 = _mm512_loadu_ps(x + QK_K * j + 32 * s + 16);
            for (int r = 0; r < WIDE_ROWS; r++) {
                const block_iq4_xs *b =
                    (const block_iq4_xs *)((const uint8_t *)w + r * row_bytes) + j;
                const __m512 dl = _mm512_set1_ps(iq4_xs_scale(b, pagecli_f16_table[b->d], s));
                __m512 w0, w1;
                table_weights(b->qs + 16 * s, _mm512_mul_ps(dl, levels), &w0, &w1);
                acc[r][0] = _mm512_fmadd_ps(w0, x0, acc[r][0]);
                acc[r][1] = _mm512_fmadd_ps(w1, x1, acc[r][1]);
            }
        }
    }
    WIDE_END
}

BLOCK_KERNELS(q8_0)
BLOCK_KERNELS(q4_0)
BLOCK_KERNELS(q4_1)
BLOCK_KERNELS(iq4_nl)
BLOCK_KERNELS(mxfp4)

/* ---- one block's 32 weights in registers (AVX2), and its rows and wide kernels -----------
 * No 16-entry permute on AVX2: each 8 weights are widened, converted and scaled, fma(q, d, m)
 * with m = 0 for Q8_0 and Q4_0 (d * q is exact, so this is gguf's rounding). The rows and wide
 * kernels come from AVX2_BLOCK32_KERNELS (quant_blocks.h). */

TARGET_AVX2 static inline __attribute__((always_inline)) void
avx2_weights_q8_0(const block_q8_0 *b, __m256 w[4]) {
    const __m256 d = _mm256_set1_ps(pagecli_f16_table[b->d]), zero = _mm256_setzero_ps();
    for (int k = 0; k < 4; k++) {
        const __m128i q = _mm_loadl_epi64((const __m128i *)(b->qs + 8 * k));
        w[k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d, zero);
    }
}

/* The 32 nibbles of a Q4 block, values 0..15 then 16..31, as four vectors of 8 floats less
 * `bias` (8 for Q4_0, 0 for Q4_1), times d plus m. */
TARGET_AVX2 static inline __attribute__((always_inline)) void
avx2_nibbles(const uint8_t *qs, int bias, __m256 d, __m256 m, __m256 w[4]) {
    const __m128i low = _mm_set1_epi8(0xF), b8 = _mm_set1_epi8((char)bias);
    const __m128i q = _mm_loadu_si128((const __m128i *)qs);
    const __m128i lo = _mm_sub_epi8(_mm_and_si128(q, low), b8);
    const __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(q, 4), low), b8);
    const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int k = 0; k < 4; k++)
        w[k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(parts[k])), d, m);
}

TARGET_AVX2 static inline __attribute__((always_inline)) void
avx2_weights_q4_0(const block_q4_0 *b, __m256 w[4]) {
    avx2_nibbles(b->qs, 8, _mm256_set1_ps(pagecli_f16_table[b->d]), _mm256_setzero_ps(), w);
}

TARGET_AVX2 static inline __attribute__((always_inline)) void
avx2_weights_q4_1(const block_q4_1 *b, __m256 w[4]) {
    avx2_nibbles(b->qs, 0, _mm256_set1_ps(pagecli_f16_table[b->d]),
                 _mm256_set1_ps(pagecli_f16_table[b->m]), w);
}

/* The non-linear 4-bit formats: each of the 32 nibbles at qs looked up in the 16 int8
 * `levels` (a byte shuffle), widened and times d (exact: small integers times a scale) */
TARGET_AVX2 static inline __attribute__((always_inline)) void
avx2_table_nibbles(const uint8_t *qs, const int8_t *levels, __m256 d, __m256 w[4]) {
    const __m128i low = _mm_set1_epi8(0xF);
    const __m128i values = _mm_loadu_si128((const __m128i *)levels);
    const __m128i q = _mm_loadu_si128((const __m128i *)qs);
    const __m128i lo = _mm_shuffle_epi8(values, _mm_and_si128(q, low));
    const __m128i hi = _mm_shuffle_epi8(values, _mm_and_si128(_mm_srli_epi16(q, 4), low));
    const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    const __m256 zero = _mm256_setzero_ps();
    for (int k = 0; k < 4; k++)
        w[k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(parts[k])), d, zero);
}

TARGET_AVX2 static inline __attribute__((always_inline)) void
avx2_weights_iq4_nl(const block_iq4_nl *b, __m256 w[4]) {
    avx2_table_nibbles(b->qs, IQ4_NL_VALUES, _mm256_set1_ps(pagecli_f16_table[b->d]), w);
}

TARGET_AVX2 static inline __attribute__((always_inline)) void
avx2_weights_mxfp4(const block_mxfp4 *b, __m256 w[4]) {
    avx2_table_nibbles(b->qs, MXFP4_VALUES, _mm256_set1_ps(e8m0_half(b->e)), w);
}

AVX2_BLOCK32_KERNELS(q8_0)
AVX2_BLOCK32_KERNELS(q4_0)
AVX2_BLOCK32_KERNELS(q4_1)
AVX2_BLOCK32_KERNELS(iq4_nl)
AVX2_BLOCK32_KERNELS(mxfp4)

/* ---- the 4-bit formats of 32-value blocks on integer products (AVX2) -------------------
 * As for Q4_K and Q6_K on AVX2 (quant_k.c), each input row is split into two int16 parts,
 * here with a scale per 32-value block: x = s_b * (A + B * 2^-15), s_b a power of two
 * (pagecli_split2_groups: 29 bits relative to the block's largest value). Each weight's
 * integer (q - 8 for Q4_0, q for Q4_1) multiplies A and B with vpmaddwd: four products per
 * int32 lane a block, |.| < 2^24, so the sums and their conversion are exact. Each block's
 * two sums are scaled by d * s_b (exact: the block's scale times a power of two) into two
 * float32 accumulators, and Q4_1's minimums add m * sum(x_b), block after block. The float
 * kernels widen, convert and scale every weight before its product; at one input row
 * and one thread these read a 1B-shaped Q4_1 1.29x and Q4_0 1.64x as fast (AMD EPYC Zen 3,
 * benchmarks/RESULTS.md), but at 4-8 rows 0.6-0.8x, and a row must have one kernel's bits
 * at every batch (speculative decoding's verify rows, the grouped experts): so they run under
 * int_dots on only, at every batch (the choice for single-stream decode; under auto the
 * float kernels take every batch). Every input row takes the same function, so a row's
 * output has the same bits at any number of input rows. */

TARGET_AVX2 static int split2_x32(const float *x, int64_t num_blocks, const struct int_split *out) {
    return pagecli_split2_groups(x, num_blocks, 32, out);
}

/* A block's 32 nibbles as int16 words: values 0..15 in lo, 16..31 in hi, less `bias`. */
TARGET_AVX2 static inline __attribute__((always_inline)) void
int2_nibbles(const uint8_t *qs, int bias, __m256i *lo, __m256i *hi) {
    const __m256i q = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)qs));
    const __m256i low = _mm256_set1_epi16(0xF), b = _mm256_set1_epi16((short)bias);
    *lo = _mm256_sub_epi16(_mm256_and_si256(q, low), b);
    *hi = _mm256_sub_epi16(_mm256_srli_epi16(q, 4), b);
}

/* Per format: the block's words. */
#define INT2_Q4_0(b, lo, hi) int2_nibbles((b)->qs, 8, lo, hi)
#define INT2_Q4_1(b, lo, hi) int2_nibbles((b)->qs, 0, lo, hi)

/* One block of one weight row, its words lo and hi, against input i: its two sums scaled into
 * acc and accb, and MIN's part into mins. The batch-1 and several-row kernels below both run
 * this, block after block, so a row has the same bits in either. */
#define INT2_BLOCK(MIN, blk, k, lo, hi, xs, acc, accb, mins)                                       \
    do {                                                                                           \
        const int16_t *A_ = (xs).a + 32 * (k), *B_ = (xs).b + 32 * (k);                            \
        const __m256i ia_ =                                                                        \
            _mm256_add_epi32(_mm256_madd_epi16(lo, _mm256_loadu_si256((const void *)A_)),          \
                             _mm256_madd_epi16(hi, _mm256_loadu_si256((const void *)(A_ + 16))));  \
        const __m256i ib_ =                                                                        \
            _mm256_add_epi32(_mm256_madd_epi16(lo, _mm256_loadu_si256((const void *)B_)),          \
                             _mm256_madd_epi16(hi, _mm256_loadu_si256((const void *)(B_ + 16))));  \
        /* exact: the block's scale times a power of two (broadcast from memory: no shuffle) */    \
        const __m256 ds_ = _mm256_mul_ps(_mm256_broadcast_ss(&pagecli_f16_table[(blk)->d]),        \
                                         _mm256_broadcast_ss(&(xs).scale[k]));                     \
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia_), ds_, acc);                                  \
        accb = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ib_), ds_, accb); /* 2^-15 at the end */         \
        MIN((blk), (xs).sums[k], mins);                                                            \
    } while (0)

/* INT2_BLOCK's MIN: Q4_1's minimum (fmaf: the same rounding wherever it is inlined), or none. */
#define INT2_MIN(blk, sum, mins) ((mins) = fmaf(pagecli_f16_table[(blk)->m], (sum), (mins)))
#define INT2_NO_MIN(blk, sum, mins) ((void)0)

/* A row's result from its two accumulators: B's sums carry the 2^-15 here (exact). */
#define INT2_SUM(acc, accb) hsum256(_mm256_fmadd_ps((accb), _mm256_set1_ps(0x1p-15f), (acc)))

/* int2_<name>_m: one weight row of 32-value blocks against M <= INT_ROWS_MAX split inputs;
 * int2_wide_<name>: `rows` (<= WIDE_ROWS) weight rows against one input, one after another. */
#define INT2_BLOCK32(name, type, WORDS, MIN)                                                       \
    TARGET_AVX2 static inline __attribute__((always_inline)) void int2_##name##_m(                 \
        const void *row, int64_t nb, const struct int_split *xs, float *out, const int M) {        \
        const type *blocks = row;                                                                  \
        const int l2 = pagecli_quant_prefetch_l2; /* the rows after this one */                    \
        __m256 acc[INT_ROWS_MAX], accb[INT_ROWS_MAX];                                              \
        float mins[INT_ROWS_MAX];                                                                  \
        for (int i = 0; i < M; i++) acc[i] = accb[i] = _mm256_setzero_ps(), mins[i] = 0.0f;        \
        for (int64_t k = 0; k < nb; k++) {                                                         \
            prefetch_w(l2, (const char *)(blocks + k) + PREFETCH_BYTES);                           \
            __m256i lo, hi; /* the block's words, once for the M inputs */                         \
            WORDS(blocks + k, &lo, &hi);                                                           \
            for (int i = 0; i < M; i++)                                                            \
                INT2_BLOCK(MIN, blocks + k, k, lo, hi, xs[i], acc[i], accb[i], mins[i]);           \
        }                                                                                          \
        for (int i = 0; i < M; i++) out[i] = INT2_SUM(acc[i], accb[i]) + mins[i];                  \
    }                                                                                              \
    INT_ROWS_DISPATCH(TARGET_AVX2, int2, name)                                                     \
    INT_WIDE_SEQUENTIAL(TARGET_AVX2, int2, name)

INT2_BLOCK32(q4_0, block_q4_0, INT2_Q4_0, INT2_NO_MIN)
INT2_BLOCK32(q4_1, block_q4_1, INT2_Q4_1, INT2_MIN)
/* IQ4_NL and MXFP4 took the same path with their levels looked up (a byte shuffle, widened):
 * slower than their float kernels (MXFP4 at one row 0.85x); Q8_0's bytes widened: as fast as
 * its float kernels, which read it near the memory's rate (1B shape, AMD EPYC Zen 3). Q5_0
 * and Q5_1 would add about ten vector operations a block for the fifth bits to the words
 * (their float kernels already match Q4_0's float rate): not tried. */

/* IQ4_XS (AVX2): each sub-block as an IQ4_NL block under its own scale */
#define AVX2_WALK_IQ4_XS(name, b, base, EMIT)                                                  \
    do {                                                                                       \
        const float d_ = pagecli_f16_table[(b)->d];                                            \
        for (int s_ = 0; s_ < QK_K / 32; s_++) {                                               \
            __m256 w_[4];                                                                      \
            const __m256 dl_ = _mm256_set1_ps(iq4_xs_scale((b), d_, s_));                      \
            avx2_table_nibbles((b)->qs + 16 * s_, IQ4_NL_VALUES, dl_, w_);                     \
            for (int k_ = 0; k_ < 4; k_++) EMIT(k_, w_[k_], (base) + 32 * s_ + 8 * k_)         \
        }                                                                                      \
    } while (0)
AVX2_KERNELS(iq4_xs, QK_K, AVX2_WALK_IQ4_XS)

#define PATHS(name)                                                                            \
    {dequant_##name##_portable, dequant_##name##_avx2, dequant_##name##_avx512},               \
        {NULL, rows_##name##_avx2, rows_##name##_avx512}
#define WIDE(name)                                                                             \
    , {NULL, wide_##name##_avx2, wide_##name##_avx512}, .small = small_##name##_avx512,       \
      .many = many_##name##_avx512
#define INT2(name)                                                                             \
    , .split2 = split2_x32, .int_rows2 = int2_rows_##name, .int_wide2 = int2_wide_##name,     \
      .int2_when_on = 1
#else
#define PATHS(name) {dequant_##name##_portable, NULL, NULL}, {NULL, NULL, NULL}
#define WIDE(name)
#define INT2(name)
#endif

const struct quant_format FORMAT_Q8_0 = {QT_Q8_0, QK8_0, sizeof(block_q8_0),
                                         PATHS(q8_0) WIDE(q8_0)};
const struct quant_format FORMAT_Q4_0 = {QT_Q4_0, QK4_0, sizeof(block_q4_0),
                                         PATHS(q4_0) WIDE(q4_0) INT2(q4_0)};
const struct quant_format FORMAT_IQ4_NL = {QT_IQ4_NL, QK4_0, sizeof(block_iq4_nl),
                                           PATHS(iq4_nl) WIDE(iq4_nl)};
const struct quant_format FORMAT_MXFP4 = {QT_MXFP4, QK4_0, sizeof(block_mxfp4),
                                          PATHS(mxfp4) WIDE(mxfp4)};
#if QUANT_X86
const struct quant_format FORMAT_IQ4_XS = {QT_IQ4_XS, QK_K, sizeof(block_iq4_xs), PATHS(iq4_xs),
                                           {NULL, wide_iq4_xs_avx2, wide_iq4_xs_avx512}};
#else
const struct quant_format FORMAT_IQ4_XS = {QT_IQ4_XS, QK_K, sizeof(block_iq4_xs),
                                           PATHS(iq4_xs)};
#endif
const struct quant_format FORMAT_Q4_1 = {QT_Q4_1, QK4_1, sizeof(block_q4_1),
                                         PATHS(q4_1) WIDE(q4_1) INT2(q4_1)};
