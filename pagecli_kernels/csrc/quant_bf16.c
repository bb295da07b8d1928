/*
 * bfloat16 weights through the quantized linear drivers (quant_linear_cpu.c): a row of k
 * bfloat16 values taken as k / 32 "blocks" of 64 bytes, as quant_f32.c does for float32. A
 * bfloat16 model's decode products (one to a few input rows) then stream the weights once at
 * memory speed: torch's bfloat16 matrix-vector product ran at a third of the read bandwidth
 * (Zen 4, 2 threads). Dequantizing is exact (a bfloat16 is the top half of a float32); the
 * input rows are float32 and so are the sums. Larger batches stay with torch's bfloat16 GEMM
 * (layers/linear.py), which the CPU's native bfloat16 dot products make faster than the
 * float32 panels here.
 */
#include "quant_blocks.h"

#if QUANT_X86
#include <immintrin.h>
#endif

static void dequant_bf16(const void *blocks, float *out, int64_t num_blocks) {
    const uint16_t *h = blocks;
    uint32_t *bits = (uint32_t *)out;
    for (int64_t i = 0; i < num_blocks * 32; i++) bits[i] = (uint32_t)h[i] << 16;
}

#if QUANT_X86

/* 16 bfloat16 values at p as float32 */
TARGET_AVX512 static inline __m512 widen16(const uint16_t *p) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

/* 8 bfloat16 values at p as float32 */
TARGET_AVX2 static inline __m256 widen8(const uint16_t *p) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

ROWS_KERNEL(rows_bf16_avx512) {
    const uint16_t *w = row;
    ROWS_BEGIN
    for (int64_t j = 0; j < nb; j++) {
        ROWS_FMA16(0, widen16(w + 32 * j), 32 * j)
        ROWS_FMA16(1, widen16(w + 32 * j + 16), 32 * j + 16)
    }
    ROWS_END
}
ROWS_DISPATCH(rows_bf16_avx512)

TARGET_AVX512 static void wide_bf16_avx512(const void *w, int64_t row_bytes, int64_t nb,
                                           const float *x, float *out) {
    const int64_t ahead = wide_prefetch_distance(row_bytes, FLOAT_WIDE_ROWS);
    const int l2 = pagecli_quant_prefetch_l2;
    __m512 acc[FLOAT_WIDE_ROWS][2];
    for (int r = 0; r < FLOAT_WIDE_ROWS; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t j = 0; j < nb; j++) {
        const __m512 x0 = _mm512_loadu_ps(x + 32 * j), x1 = _mm512_loadu_ps(x + 32 * j + 16);
        for (int r = 0; r < FLOAT_WIDE_ROWS; r++) {
            const uint16_t *b = (const uint16_t *)((const uint8_t *)w + r * row_bytes) + 32 * j;
            prefetch_w(l2, (const char *)b + ahead);
            acc[r][0] = _mm512_fmadd_ps(widen16(b), x0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(widen16(b + 16), x1, acc[r][1]);
        }
    }
    for (int r = 0; r < FLOAT_WIDE_ROWS; r++)
        out[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));
}

/* AVX2 rows: weights k of each 32 into accumulator k & 1, the wide kernel's order. */
ROWS2_KERNEL(rows_bf16_avx2) {
    const uint16_t *w = row;
    ROWS2_BEGIN
    for (int64_t j = 0; j < nb; j++)
        for (int k = 0; k < 4; k++) ROWS2_FMA8(k, widen8(w + 32 * j + 8 * k), 32 * j + 8 * k)
    ROWS2_END
}
ROWS2_DISPATCH(rows_bf16_avx2)

TARGET_AVX2 static void wide_bf16_avx2(const void *w, int64_t row_bytes, int64_t nb,
                                       const float *x, float *out) {
    const int64_t ahead = wide_prefetch_distance(row_bytes, FLOAT_WIDE_ROWS);
    const int l2 = pagecli_quant_prefetch_l2;
    __m256 acc[FLOAT_WIDE_ROWS][2];
    for (int r = 0; r < FLOAT_WIDE_ROWS; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t j = 0; j < nb; j++) {
        for (int r = 0; r < FLOAT_WIDE_ROWS; r++) {
            const uint16_t *b = (const uint16_t *)((const uint8_t *)w + r * row_bytes) + 32 * j;
            prefetch_w(l2, (const char *)b + ahead);
            for (int k = 0; k < 4; k++)
                acc[r][k & 1] = _mm256_fmadd_ps(widen8(b + 8 * k),
                                                _mm256_loadu_ps(x + 32 * j + 8 * k), acc[r][k & 1]);
        }
    }
    for (int r = 0; r < FLOAT_WIDE_ROWS; r++) out[r] = hsum256(_mm256_add_ps(acc[r][0], acc[r][1]));
}

const struct quant_format FORMAT_BF16 = {QT_BF16,
                                         32,
                                         32 * sizeof(uint16_t),
                                         {dequant_bf16, dequant_bf16, dequant_bf16},
                                         {NULL, rows_bf16_avx2, rows_bf16_avx512},
                                         {NULL, wide_bf16_avx2, wide_bf16_avx512},
                                         FLOAT_WIDE_ROWS};
#else
const struct quant_format FORMAT_BF16 = {
    QT_BF16, 32, 32 * sizeof(uint16_t), {dequant_bf16, NULL, NULL}, {NULL, NULL, NULL}, {NULL}};
#endif
