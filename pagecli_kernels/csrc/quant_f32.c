/*
 * float32 weights through the quantized linear drivers (quant_linear_cpu.c): a row of k
 * float32 values taken as k / 32 "blocks" of 128 bytes, so that float checkpoints get the
 * same decode paths as GGUF blocks (four rows at a time with prefetch for one input row, up
 * to eight input rows per pass, cache-sized panels through sgemm for more) and the one-call
 * decoder layers of layer_program_cpu.c. Nothing is converted: "dequantizing" is a copy, and
 * the panel path hands sgemm the rows in place.
 */
#include "quant_blocks.h"

#if QUANT_X86
#include <immintrin.h>
#endif

static void dequant_f32(const void *blocks, float *out, int64_t num_blocks) {
    memcpy(out, blocks, (size_t)num_blocks * 32 * sizeof(float));
}

#if QUANT_X86

ROWS_KERNEL(rows_f32_avx512) {
    const float *w = row;
    ROWS_BEGIN
    for (int64_t j = 0; j < nb; j++) {
        ROWS_FMA16(0, _mm512_loadu_ps(w + 32 * j), 32 * j)
        ROWS_FMA16(1, _mm512_loadu_ps(w + 32 * j + 16), 32 * j + 16)
    }
    ROWS_END
}
ROWS_DISPATCH(rows_f32_avx512)

TARGET_AVX512 static void wide_f32_avx512(const void *w, int64_t row_bytes, int64_t nb,
                                          const float *x, float *out) {
    const int64_t ahead = wide_prefetch_distance(row_bytes, FLOAT_WIDE_ROWS);
    const int l2 = pagecli_quant_prefetch_l2;
    __m512 acc[FLOAT_WIDE_ROWS][2];
    for (int r = 0; r < FLOAT_WIDE_ROWS; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t j = 0; j < nb; j++) {
        const __m512 x0 = _mm512_loadu_ps(x + 32 * j), x1 = _mm512_loadu_ps(x + 32 * j + 16);
        for (int r = 0; r < FLOAT_WIDE_ROWS; r++) {
            const float *b = (const float *)((const uint8_t *)w + r * row_bytes) + 32 * j;
            prefetch_w(l2, (const char *)b + ahead);
            prefetch_w(l2, (const char *)b + ahead + 64);
            acc[r][0] = _mm512_fmadd_ps(_mm512_loadu_ps(b), x0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(_mm512_loadu_ps(b + 16), x1, acc[r][1]);
        }
    }
    for (int r = 0; r < FLOAT_WIDE_ROWS; r++)
        out[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));
}

/* AVX2 rows: weights k of each 32 into accumulator k & 1, the wide kernel's order. */
ROWS2_KERNEL(rows_f32_avx2) {
    const float *w = row;
    ROWS2_BEGIN
    for (int64_t j = 0; j < nb; j++)
        for (int k = 0; k < 4; k++) {
            const __m256 v = _mm256_loadu_ps(w + 32 * j + 8 * k);
            ROWS2_FMA8(k, v, 32 * j + 8 * k)
        }
    ROWS2_END
}
ROWS2_DISPATCH(rows_f32_avx2)

TARGET_AVX2 static void wide_f32_avx2(const void *w, int64_t row_bytes, int64_t nb,
                                      const float *x, float *out) {
    const int64_t ahead = wide_prefetch_distance(row_bytes, FLOAT_WIDE_ROWS);
    const int l2 = pagecli_quant_prefetch_l2;
    __m256 acc[FLOAT_WIDE_ROWS][2];
    for (int r = 0; r < FLOAT_WIDE_ROWS; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t j = 0; j < nb; j++) {
        for (int r = 0; r < FLOAT_WIDE_ROWS; r++) {
            const float *b = (const float *)((const uint8_t *)w + r * row_bytes) + 32 * j;
            prefetch_w(l2, (const char *)b + ahead);
            prefetch_w(l2, (const char *)b + ahead + 64);
            for (int k = 0; k < 4; k++)
                acc[r][k & 1] = _mm256_fmadd_ps(_mm256_loadu_ps(b + 8 * k),
                                                _mm256_loadu_ps(x + 32 * j + 8 * k), acc[r][k & 1]);
        }
    }
    for (int r = 0; r < FLOAT_WIDE_ROWS; r++) out[r] = hsum256(_mm256_add_ps(acc[r][0], acc[r][1]));
}

const struct quant_format FORMAT_F32 = {QT_F32,
                                        32,
                                        32 * sizeof(float),
                                        {dequant_f32, dequant_f32, dequant_f32},
                                        {NULL, rows_f32_avx2, rows_f32_avx512},
                                        {NULL, wide_f32_avx2, wide_f32_avx512},
                                        FLOAT_WIDE_ROWS};
#else
const struct quant_format FORMAT_F32 = {
    QT_F32, 32, 32 * sizeof(float), {dequant_f32, NULL, NULL}, {NULL, NULL, NULL}, {NULL}};
#endif
