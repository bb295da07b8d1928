/*
 * The 32-value 5-bit block formats Q5_0 and Q5_1: dequantization into float32, and the fused
 * decode kernels (rows, wide).
 *
 * llama.cpp's K-quant mixes (Q4_K_M, ...) store the matrices whose rows are not whole
 * 256-value super-blocks in these (Gemma-3 1B's 1152 features, Qwen2.5-0.5B's 896), so such
 * models' files are full of them.
 *
 * Per format: the portable loop (the readable spec, ggml's dequantize_row_*), then AVX2, whose
 * one block reader (avx2_weights_q5_0/q5_1) feeds the dequantization, rows and wide kernels. There
 * is no AVX-512 version: the AVX-512 path runs the AVX2 functions (the format tables below),
 * so that the code CPUs with AVX-512 run is the code tested on AVX2 ones; nor small-batch
 * kernels or an integer path (their fields are NULL: the rows kernel takes 2-8 input rows on
 * both paths).
 * The values are gguf's bit for bit: d * (q - 16) is exact in float32 (an f16 times a 5-bit
 * integer), and so is Q5_1's d * q, so one FMA's rounding of d * q + m is gguf's two.
 * See quant_blocks.h.
 */
#include "quant_blocks.h"

#if QUANT_X86
#include <immintrin.h>
#endif

/* The fifth bits of a block's values as a uint32: bit j for value j. */
static inline uint32_t q5_high(const uint8_t qh[4]) {
    return (uint32_t)qh[0] | (uint32_t)qh[1] << 8 | (uint32_t)qh[2] << 16 | (uint32_t)qh[3] << 24;
}

/* ---- Q5_0: d * (q - 16) ----------------------------------------------------------------- */

static void dequant_q5_0_portable(const void *blocks, float *out, int64_t num_blocks) {
    const block_q5_0 *b = blocks;
    for (int64_t i = 0; i < num_blocks; i++, out += QK5_0) {
        const float d = f16_to_f32(b[i].d);
        const uint32_t high = q5_high(b[i].qh);
        for (int j = 0; j < QK5_0 / 2; j++) {
            const int q0 = (b[i].qs[j] & 0xF) | (int)((high >> j) & 1) << 4;
            const int q1 = (b[i].qs[j] >> 4) | (int)((high >> (j + 16)) & 1) << 4;
            out[j] = d * (float)(q0 - 16);
            out[j + QK5_0 / 2] = d * (float)(q1 - 16);
        }
    }
}

/* ---- Q5_1: d * q + m -------------------------------------------------------------------- */

static void dequant_q5_1_portable(const void *blocks, float *out, int64_t num_blocks) {
    const block_q5_1 *b = blocks;
    for (int64_t i = 0; i < num_blocks; i++, out += QK5_1) {
        const float d = f16_to_f32(b[i].d), m = f16_to_f32(b[i].m);
        const uint32_t high = q5_high(b[i].qh);
        for (int j = 0; j < QK5_1 / 2; j++) {
            const int q0 = (b[i].qs[j] & 0xF) | (int)((high >> j) & 1) << 4;
            const int q1 = (b[i].qs[j] >> 4) | (int)((high >> (j + 16)) & 1) << 4;
            out[j] = d * (float)q0 + m;
            out[j + QK5_1 / 2] = d * (float)q1 + m;
        }
    }
}

#if QUANT_X86

/* ---- one block's 32 weights in registers (AVX2) --------------------------------------------
 * As four vectors, values 0..7, 8..15, 16..23 and 24..31, bit for bit gguf's. Each q is built
 * in its int32 lane: the nibbles widened straight from memory (values j and j + 16 share byte
 * j), the fifth bit shifted out of qh by a per-lane count. Building the 32 q as bytes first
 * (ggml's bytes_from_bits_32) and widening them after took 9 shuffles per block against 2 here:
 * at batch 1 on one thread, Q5_0's wide kernel took 1.27-1.34x Q4_0's time that way, 0.97-1.01x
 * this way (AMD EPYC Zen 3; 2048 x 8192 in the L3, and 64 x 2048 in the L2). */

/* Value j's low nibble in lane j % 8 of nib[j / 8], its fifth bit at bit 4 of that lane of
 * hb[j / 8] (unmasked: qh's other bits lie around it). */
TARGET_AVX2 static inline __attribute__((always_inline)) void
q5_lanes(const uint8_t *qh, const uint8_t *qs, __m256i nib[4], __m256i hb[4]) {
    const __m256i first = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)qs));
    const __m256i second = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qs + 8)));
    const __m256i low = _mm256_set1_epi32(0xF);
    nib[0] = _mm256_and_si256(first, low);
    nib[1] = _mm256_and_si256(second, low);
    nib[2] = _mm256_srli_epi32(first, 4);
    nib[3] = _mm256_srli_epi32(second, 4);
    uint32_t bits;
    memcpy(&bits, qh, sizeof bits);
    const __m256i all = _mm256_set1_epi32((int)bits);
    /* bit j to bit 4: right by j - 4, or (values 0..7) left by 4 first */
    hb[0] = _mm256_srlv_epi32(_mm256_slli_epi32(all, 4), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    hb[1] = _mm256_srlv_epi32(all, _mm256_setr_epi32(4, 5, 6, 7, 8, 9, 10, 11));
    hb[2] = _mm256_srlv_epi32(all, _mm256_setr_epi32(12, 13, 14, 15, 16, 17, 18, 19));
    hb[3] = _mm256_srlv_epi32(all, _mm256_setr_epi32(20, 21, 22, 23, 24, 25, 26, 27));
}

TARGET_AVX2 static inline __attribute__((always_inline)) void
avx2_weights_q5_0(const block_q5_0 *b, __m256 w[4]) {
    __m256i nib[4], hb[4];
    q5_lanes(b->qh, b->qs, nib, hb);
    const __m256 d = _mm256_set1_ps(pagecli_f16_table[b->d]);
    const __m256i sixteen = _mm256_set1_epi32(16);
    for (int k = 0; k < 4; k++) { /* q - 16: the nibble, less 16 where the fifth bit is clear */
        const __m256i q = _mm256_sub_epi32(nib[k], _mm256_andnot_si256(hb[k], sixteen));
        w[k] = _mm256_mul_ps(_mm256_cvtepi32_ps(q), d);
    }
}

TARGET_AVX2 static inline __attribute__((always_inline)) void
avx2_weights_q5_1(const block_q5_1 *b, __m256 w[4]) {
    __m256i nib[4], hb[4];
    q5_lanes(b->qh, b->qs, nib, hb);
    const __m256 d = _mm256_set1_ps(pagecli_f16_table[b->d]);
    const __m256 m = _mm256_set1_ps(pagecli_f16_table[b->m]);
    const __m256i sixteen = _mm256_set1_epi32(16);
    for (int k = 0; k < 4; k++) { /* d * q is exact: one rounding of d * q + m is gguf's two */
        const __m256i q = _mm256_or_si256(nib[k], _mm256_and_si256(hb[k], sixteen));
        w[k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), d, m);
    }
}

/* ---- dequantization, rows and wide kernels, per format (AVX2) ------------------------------
 * rows: one weight row against up to ROWS_MAX inputs; wide: WIDE_ROWS rows against one input,
 * eight FMA chains side by side (AVX2_BLOCK32_KERNELS: quant_blocks.h, the same order of sums
 * in both). */

#define BLOCK_KERNELS(name)                                                                    \
    TARGET_AVX2 static void dequant_##name##_avx2(const void *blocks, float *out,              \
                                                  int64_t num_blocks) {                        \
        const block_##name *b = blocks;                                                        \
        for (int64_t i = 0; i < num_blocks; i++, out += 32) {                                  \
            __m256 w[4];                                                                       \
            avx2_weights_##name(&b[i], w);                                                     \
            for (int k = 0; k < 4; k++) _mm256_storeu_ps(out + 8 * k, w[k]);                   \
        }                                                                                      \
    }                                                                                          \
    AVX2_BLOCK32_KERNELS(name)

BLOCK_KERNELS(q5_0)
BLOCK_KERNELS(q5_1)

/* The AVX-512 slots hold the AVX2 functions (see the top of this file). */
#define PATHS(name)                                                                            \
    {dequant_##name##_portable, dequant_##name##_avx2, dequant_##name##_avx2},                 \
        {NULL, rows_##name##_avx2, rows_##name##_avx2},                                        \
        {NULL, wide_##name##_avx2, wide_##name##_avx2}
#else
#define PATHS(name) {dequant_##name##_portable, NULL, NULL}, {NULL, NULL, NULL}, {NULL, NULL, NULL}
#endif

const struct quant_format FORMAT_Q5_0 = {QT_Q5_0, QK5_0, sizeof(block_q5_0), PATHS(q5_0)};
const struct quant_format FORMAT_Q5_1 = {QT_Q5_1, QK5_1, sizeof(block_q5_1), PATHS(q5_1)};
