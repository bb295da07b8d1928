/*
 * The 32-value block formats Q8_0, Q4_0 and Q4_1: dequantization into float32.
 *
 * Per format: the portable loop (the readable spec, ggml's dequantize_row_*), then AVX2 and
 * AVX-512 versions that give the same bits (a product, then a sum, never an FMA: Q4_1's
 * d * q + m is rounded twice in gguf.quants.dequantize too). See quant_blocks.h.
 */
#include "quant_blocks.h"

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

#if QUANT_X86

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

/* ---- register-fused decode rows (AVX-512) -------------------------------------------------
 * 4-bit formats take their weights from a 16-entry table per block, table[q] = d * q + m (or
 * d * (q - 8)), computed with the same two roundings as gguf: a permute replaces the
 * int-to-float conversion and the scaling of every weight. */

ROWS_KERNEL(rows_q8_0_avx512) {
    const block_q8_0 *b = row;
    ROWS_BEGIN
    for (int64_t j = 0; j < nb; j++) {
        const __m512 d = _mm512_set1_ps(_cvtsh_ss(b[j].d));
        const __m128i q0 = _mm_loadu_si128((const __m128i *)b[j].qs);
        const __m128i q1 = _mm_loadu_si128((const __m128i *)(b[j].qs + 16));
        const __m512 w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0)), d);
        const __m512 w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1)), d);
        ROWS_FMA16(0, w0, 32 * j)
        ROWS_FMA16(1, w1, 32 * j + 16)
    }
    ROWS_END
}
ROWS_DISPATCH(rows_q8_0_avx512)

ROWS_KERNEL(rows_q4_0_avx512) {
    const block_q4_0 *b = row;
    const __m512 levels = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    ROWS_BEGIN
    for (int64_t j = 0; j < nb; j++) {
        const __m512 table = _mm512_mul_ps(_mm512_set1_ps(_cvtsh_ss(b[j].d)), levels);
        const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)b[j].qs));
        ROWS_FMA16(0, _mm512_permutexvar_ps(q, table), 32 * j) /* low nibbles: index bits */
        ROWS_FMA16(1, _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table), 32 * j + 16)
    }
    ROWS_END
}
ROWS_DISPATCH(rows_q4_0_avx512)

ROWS_KERNEL(rows_q4_1_avx512) {
    const block_q4_1 *b = row;
    const __m512 levels = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    ROWS_BEGIN
    for (int64_t j = 0; j < nb; j++) {
        const __m512 table = _mm512_add_ps(
            _mm512_mul_ps(_mm512_set1_ps(_cvtsh_ss(b[j].d)), levels),
            _mm512_set1_ps(_cvtsh_ss(b[j].m)));
        const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)b[j].qs));
        ROWS_FMA16(0, _mm512_permutexvar_ps(q, table), 32 * j)
        ROWS_FMA16(1, _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table), 32 * j + 16)
    }
    ROWS_END
}
ROWS_DISPATCH(rows_q4_1_avx512)

#define PATHS(name)                                                                            \
    {dequant_##name##_portable, dequant_##name##_avx2, dequant_##name##_avx512},               \
        {NULL, NULL, rows_##name##_avx512}
#else
#define PATHS(name) {dequant_##name##_portable, NULL, NULL}, {NULL, NULL, NULL}
#endif

const struct quant_format FORMAT_Q8_0 = {QT_Q8_0, QK8_0, sizeof(block_q8_0), PATHS(q8_0)};
const struct quant_format FORMAT_Q4_0 = {QT_Q4_0, QK4_0, sizeof(block_q4_0), PATHS(q4_0)};
const struct quant_format FORMAT_Q4_1 = {QT_Q4_1, QK4_1, sizeof(block_q4_1), PATHS(q4_1)};
