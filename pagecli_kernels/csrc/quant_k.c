/*
 * The 256-value K-quant super-blocks Q4_K, Q5_K and Q6_K: dequantization into float32.
 *
 * Per format: the portable loop (the readable spec, ggml's dequantize_row_*), then AVX2 and
 * AVX-512 versions with the same bits. Sub-block scales are products of f16 and 6- or 8-bit
 * integers, formed once per sub-block in float32 exactly as gguf.quants does:
 * Q4_K/Q5_K value = (d * sc) * q - (dmin * m), Q6_K value = (d * sc) * (q - 32).
 */
#include "quant_blocks.h"

#if QUANT_X86
#include <immintrin.h>
#endif

/* ---- Q4_K ------------------------------------------------------------------------------- */

static void dequant_q4_K_portable(const void *blocks, float *out, int64_t num_blocks) {
    const block_q4_K *b = blocks;
    for (int64_t i = 0; i < num_blocks; i++) {
        const float d = f16_to_f32(b[i].d), dmin = f16_to_f32(b[i].dmin);
        const uint8_t *q = b[i].qs;
        for (int j = 0; j < 8; j += 2, q += 32, out += 64) {
            uint8_t sc, m;
            k_scale_min(j, b[i].scales, &sc, &m);
            const float d1 = d * (float)sc, m1 = dmin * (float)m;
            k_scale_min(j + 1, b[i].scales, &sc, &m);
            const float d2 = d * (float)sc, m2 = dmin * (float)m;
            for (int l = 0; l < 32; l++) out[l] = d1 * (float)(q[l] & 0xF) - m1;
            for (int l = 0; l < 32; l++) out[l + 32] = d2 * (float)(q[l] >> 4) - m2;
        }
    }
}

/* ---- Q5_K ------------------------------------------------------------------------------- */

static void dequant_q5_K_portable(const void *blocks, float *out, int64_t num_blocks) {
    const block_q5_K *b = blocks;
    for (int64_t i = 0; i < num_blocks; i++) {
        const float d = f16_to_f32(b[i].d), dmin = f16_to_f32(b[i].dmin);
        const uint8_t *ql = b[i].qs, *qh = b[i].qh;
        for (int j = 0; j < 8; j += 2, ql += 32, out += 64) {
            uint8_t sc, m;
            k_scale_min(j, b[i].scales, &sc, &m);
            const float d1 = d * (float)sc, m1 = dmin * (float)m;
            k_scale_min(j + 1, b[i].scales, &sc, &m);
            const float d2 = d * (float)sc, m2 = dmin * (float)m;
            for (int l = 0; l < 32; l++) {
                const int hi1 = (qh[l] >> j) & 1, hi2 = (qh[l] >> (j + 1)) & 1;
                out[l] = d1 * (float)((ql[l] & 0xF) | (hi1 << 4)) - m1;
                out[l + 32] = d2 * (float)((ql[l] >> 4) | (hi2 << 4)) - m2;
            }
        }
    }
}

/* ---- Q6_K ------------------------------------------------------------------------------- */

static void dequant_q6_K_portable(const void *blocks, float *out, int64_t num_blocks) {
    const block_q6_K *b = blocks;
    for (int64_t i = 0; i < num_blocks; i++) {
        const float d = f16_to_f32(b[i].d);
        float dsc[QK_K / 16];
        for (int s = 0; s < QK_K / 16; s++) dsc[s] = d * (float)b[i].scales[s];
        for (int h = 0; h < 2; h++, out += 128) {
            const uint8_t *ql = b[i].ql + 64 * h, *qh = b[i].qh + 32 * h;
            const float *sc = dsc + 8 * h;
            for (int l = 0; l < 32; l++) {
                const int is = l / 16;
                const int q1 = ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
                const int q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
                const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                out[l] = sc[is + 0] * (float)q1;
                out[l + 32] = sc[is + 2] * (float)q2;
                out[l + 64] = sc[is + 4] * (float)q3;
                out[l + 96] = sc[is + 6] * (float)q4;
            }
        }
    }
}

#if QUANT_X86

/* The 8 (scale, min) float pairs of a Q4_K/Q5_K super-block. */
static inline void k_scales(const uint8_t *scales, float d, float dmin, float *ds, float *ms) {
    for (int j = 0; j < 8; j++) {
        uint8_t sc, m;
        k_scale_min(j, scales, &sc, &m);
        ds[j] = d * (float)sc;
        ms[j] = dmin * (float)m;
    }
}

/* out[0..8) = ds * q - ms for 8 int32 values q. */
TARGET_AVX2 static inline void put8(float *out, __m256i q, float ds, float ms) {
    const __m256 v = _mm256_mul_ps(_mm256_set1_ps(ds), _mm256_cvtepi32_ps(q));
    _mm256_storeu_ps(out, _mm256_sub_ps(v, _mm256_set1_ps(ms)));
}
TARGET_AVX512 static inline void put16(float *out, __m512i q, float ds, float ms) {
    const __m512 v = _mm512_mul_ps(_mm512_set1_ps(ds), _mm512_cvtepi32_ps(q));
    _mm512_storeu_ps(out, _mm512_sub_ps(v, _mm512_set1_ps(ms)));
}

TARGET_AVX2 static void dequant_q4_K_avx2(const void *blocks, float *out, int64_t num_blocks) {
    const block_q4_K *b = blocks;
    const __m128i low = _mm_set1_epi8(0xF);
    for (int64_t i = 0; i < num_blocks; i++) {
        float ds[8], ms[8];
        k_scales(b[i].scales, _cvtsh_ss(b[i].d), _cvtsh_ss(b[i].dmin), ds, ms);
        for (int j = 0; j < 8; j += 2, out += 64) {
            for (int h = 0; h < 32; h += 16) {
                const __m128i q = _mm_loadu_si128((const __m128i *)(b[i].qs + 16 * j + h));
                const __m128i lo = _mm_and_si128(q, low);
                const __m128i hi = _mm_and_si128(_mm_srli_epi16(q, 4), low);
                put8(out + h, _mm256_cvtepu8_epi32(lo), ds[j], ms[j]);
                put8(out + h + 8, _mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)), ds[j], ms[j]);
                put8(out + 32 + h, _mm256_cvtepu8_epi32(hi), ds[j + 1], ms[j + 1]);
                put8(out + 40 + h, _mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)), ds[j + 1],
                     ms[j + 1]);
            }
        }
    }
}

/* AVX-512: a 16-entry table per sub-block, table[q] = (d * sc) * q - (dmin * m). */
TARGET_AVX512 static void dequant_q4_K_avx512(const void *blocks, float *out,
                                              int64_t num_blocks) {
    const block_q4_K *b = blocks;
    const __m512 levels = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int64_t i = 0; i < num_blocks; i++) {
        float ds[8], ms[8];
        k_scales(b[i].scales, _cvtsh_ss(b[i].d), _cvtsh_ss(b[i].dmin), ds, ms);
        for (int j = 0; j < 8; j += 2, out += 64) {
            const __m512 t0 = _mm512_sub_ps(_mm512_mul_ps(_mm512_set1_ps(ds[j]), levels),
                                            _mm512_set1_ps(ms[j]));
            const __m512 t1 = _mm512_sub_ps(_mm512_mul_ps(_mm512_set1_ps(ds[j + 1]), levels),
                                            _mm512_set1_ps(ms[j + 1]));
            for (int h = 0; h < 32; h += 16) {
                const __m512i q = _mm512_cvtepu8_epi32(
                    _mm_loadu_si128((const __m128i *)(b[i].qs + 16 * j + h)));
                _mm512_storeu_ps(out + h, _mm512_permutexvar_ps(q, t0));
                _mm512_storeu_ps(out + 32 + h,
                                 _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), t1));
            }
        }
    }
}

TARGET_AVX2 static void dequant_q5_K_avx2(const void *blocks, float *out, int64_t num_blocks) {
    const block_q5_K *b = blocks;
    const __m128i low = _mm_set1_epi8(0xF);
    const __m256i one = _mm256_set1_epi32(1);
    for (int64_t i = 0; i < num_blocks; i++) {
        float ds[8], ms[8];
        k_scales(b[i].scales, _cvtsh_ss(b[i].d), _cvtsh_ss(b[i].dmin), ds, ms);
        for (int j = 0; j < 8; j += 2, out += 64) {
            for (int h = 0; h < 32; h += 8) {
                const __m128i q = _mm_loadl_epi64((const __m128i *)(b[i].qs + 16 * j + h));
                const __m256i qh = _mm256_cvtepu8_epi32(
                    _mm_loadl_epi64((const __m128i *)(b[i].qh + h)));
                const __m256i h1 = _mm256_and_si256(_mm256_srli_epi32(qh, j), one);
                const __m256i h2 = _mm256_and_si256(_mm256_srli_epi32(qh, j + 1), one);
                const __m256i lo = _mm256_cvtepu8_epi32(_mm_and_si128(q, low));
                const __m256i hi = _mm256_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(q, 4), low));
                put8(out + h, _mm256_or_si256(lo, _mm256_slli_epi32(h1, 4)), ds[j], ms[j]);
                put8(out + 32 + h, _mm256_or_si256(hi, _mm256_slli_epi32(h2, 4)), ds[j + 1],
                     ms[j + 1]);
            }
        }
    }
}

TARGET_AVX512 static void dequant_q5_K_avx512(const void *blocks, float *out,
                                              int64_t num_blocks) {
    const block_q5_K *b = blocks;
    const __m128i low = _mm_set1_epi8(0xF);
    const __m512i one = _mm512_set1_epi32(1);
    for (int64_t i = 0; i < num_blocks; i++) {
        float ds[8], ms[8];
        k_scales(b[i].scales, _cvtsh_ss(b[i].d), _cvtsh_ss(b[i].dmin), ds, ms);
        for (int j = 0; j < 8; j += 2, out += 64) {
            for (int h = 0; h < 32; h += 16) {
                const __m128i q = _mm_loadu_si128((const __m128i *)(b[i].qs + 16 * j + h));
                const __m512i qh =
                    _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b[i].qh + h)));
                const __m512i h1 = _mm512_and_si512(_mm512_srli_epi32(qh, j), one);
                const __m512i h2 = _mm512_and_si512(_mm512_srli_epi32(qh, j + 1), one);
                const __m512i lo = _mm512_cvtepu8_epi32(_mm_and_si128(q, low));
                const __m512i hi = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(q, 4), low));
                put16(out + h, _mm512_or_si512(lo, _mm512_slli_epi32(h1, 4)), ds[j], ms[j]);
                put16(out + 32 + h, _mm512_or_si512(hi, _mm512_slli_epi32(h2, 4)), ds[j + 1],
                      ms[j + 1]);
            }
        }
    }
}

/* Q6_K: 6-bit values of one 128-value half, as int32 lanes minus 32 (ql low/high nibble
 * `shift`, qh's 2-bit field `field`). */
TARGET_AVX2 static inline __m256i q6_8(const uint8_t *ql, const uint8_t *qh, int shift,
                                       int field) {
    const __m256i l = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)ql));
    const __m256i h = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)qh));
    const __m256i lo = _mm256_and_si256(_mm256_srli_epi32(l, shift), _mm256_set1_epi32(0xF));
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi32(h, 2 * field), _mm256_set1_epi32(3));
    return _mm256_sub_epi32(_mm256_or_si256(lo, _mm256_slli_epi32(hi, 4)),
                            _mm256_set1_epi32(32));
}
TARGET_AVX512 static inline __m512i q6_16(const uint8_t *ql, const uint8_t *qh, int shift,
                                          int field) {
    const __m512i l = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)ql));
    const __m512i h = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)qh));
    const __m512i lo = _mm512_and_si512(_mm512_srli_epi32(l, shift), _mm512_set1_epi32(0xF));
    const __m512i hi = _mm512_and_si512(_mm512_srli_epi32(h, 2 * field), _mm512_set1_epi32(3));
    return _mm512_sub_epi32(_mm512_or_si512(lo, _mm512_slli_epi32(hi, 4)),
                            _mm512_set1_epi32(32));
}

TARGET_AVX2 static void dequant_q6_K_avx2(const void *blocks, float *out, int64_t num_blocks) {
    const block_q6_K *b = blocks;
    for (int64_t i = 0; i < num_blocks; i++) {
        const float d = _cvtsh_ss(b[i].d);
        for (int h = 0; h < 2; h++, out += 128) {
            const uint8_t *ql = b[i].ql + 64 * h, *qh = b[i].qh + 32 * h;
            const int8_t *sc = b[i].scales + 8 * h;
            for (int g = 0; g < 4; g++) { /* 32 values: ql[0..32) or [32..64), nibble g / 2 */
                const uint8_t *l = ql + 32 * (g & 1);
                for (int k = 0; k < 32; k += 8) {
                    const float dsc = d * (float)sc[2 * g + k / 16];
                    put8(out + 32 * g + k, q6_8(l + k, qh + k, 4 * (g >> 1), g), dsc, 0.0f);
                }
            }
        }
    }
}

TARGET_AVX512 static void dequant_q6_K_avx512(const void *blocks, float *out,
                                              int64_t num_blocks) {
    const block_q6_K *b = blocks;
    for (int64_t i = 0; i < num_blocks; i++) {
        const float d = _cvtsh_ss(b[i].d);
        for (int h = 0; h < 2; h++, out += 128) {
            const uint8_t *ql = b[i].ql + 64 * h, *qh = b[i].qh + 32 * h;
            const int8_t *sc = b[i].scales + 8 * h;
            for (int g = 0; g < 4; g++) {
                const uint8_t *l = ql + 32 * (g & 1);
                for (int k = 0; k < 32; k += 16) {
                    const float dsc = d * (float)sc[2 * g + k / 16];
                    const __m512i q = q6_16(l + k, qh + k, 4 * (g >> 1), g);
                    _mm512_storeu_ps(out + 32 * g + k,
                                     _mm512_mul_ps(_mm512_set1_ps(dsc), _mm512_cvtepi32_ps(q)));
                }
            }
        }
    }
}

/* ---- register-fused decode rows (AVX-512) -------------------------------------------------
 * Q4_K and Q5_K take their weights from per-sub-block tables, table[q] = (d * sc) * q -
 * (dmin * m) (16 entries for 4 bits, 32 for Q5_K's 5), rounded as gguf rounds them; Q6_K
 * converts and scales as its dequantization does. */

ROWS_KERNEL(rows_q4_K_avx512) {
    const block_q4_K *b = row;
    const __m512 levels = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    ROWS_BEGIN
    for (int64_t s = 0; s < nb; s++) {
        float ds[8], ms[8];
        k_scales(b[s].scales, _cvtsh_ss(b[s].d), _cvtsh_ss(b[s].dmin), ds, ms);
        const int64_t base = s * QK_K;
        for (int j = 0; j < 8; j += 2) {
            const __m512 t0 = _mm512_sub_ps(_mm512_mul_ps(_mm512_set1_ps(ds[j]), levels),
                                            _mm512_set1_ps(ms[j]));
            const __m512 t1 = _mm512_sub_ps(_mm512_mul_ps(_mm512_set1_ps(ds[j + 1]), levels),
                                            _mm512_set1_ps(ms[j + 1]));
            for (int h = 0; h < 32; h += 16) {
                const __m512i q = _mm512_cvtepu8_epi32(
                    _mm_loadu_si128((const __m128i *)(b[s].qs + 16 * j + h)));
                const __m512 w0 = _mm512_permutexvar_ps(q, t0);
                const __m512 w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), t1);
                ROWS_FMA16(0, w0, base + 32 * j + h)
                ROWS_FMA16(1, w1, base + 32 * j + 32 + h)
            }
        }
    }
    ROWS_END
}
ROWS_DISPATCH(rows_q4_K_avx512)

ROWS_KERNEL(rows_q5_K_avx512) {
    const block_q5_K *b = row;
    const __m512 lo16 = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 hi16 = _mm512_add_ps(lo16, _mm512_set1_ps(16));
    const __m512i low = _mm512_set1_epi32(0xF), one = _mm512_set1_epi32(1);
    ROWS_BEGIN
    for (int64_t s = 0; s < nb; s++) {
        float ds[8], ms[8];
        k_scales(b[s].scales, _cvtsh_ss(b[s].d), _cvtsh_ss(b[s].dmin), ds, ms);
        const int64_t base = s * QK_K;
        for (int j = 0; j < 8; j += 2) {
            __m512 t[2][2]; /* [sub-block][values 0..15 / 16..31] */
            for (int u = 0; u < 2; u++) {
                const __m512 d = _mm512_set1_ps(ds[j + u]), m = _mm512_set1_ps(ms[j + u]);
                t[u][0] = _mm512_sub_ps(_mm512_mul_ps(d, lo16), m);
                t[u][1] = _mm512_sub_ps(_mm512_mul_ps(d, hi16), m);
            }
            for (int h = 0; h < 32; h += 16) {
                const __m512i q = _mm512_cvtepu8_epi32(
                    _mm_loadu_si128((const __m128i *)(b[s].qs + 16 * j + h)));
                const __m512i qh =
                    _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b[s].qh + h)));
                const __m512i i0 = _mm512_or_si512(
                    _mm512_and_si512(q, low),
                    _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(qh, j), one), 4));
                const __m512i i1 = _mm512_or_si512(
                    _mm512_srli_epi32(q, 4),
                    _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(qh, j + 1), one), 4));
                ROWS_FMA16(0, _mm512_permutex2var_ps(t[0][0], i0, t[0][1]), base + 32 * j + h)
                ROWS_FMA16(1, _mm512_permutex2var_ps(t[1][0], i1, t[1][1]),
                           base + 32 * j + 32 + h)
            }
        }
    }
    ROWS_END
}
ROWS_DISPATCH(rows_q5_K_avx512)

ROWS_KERNEL(rows_q6_K_avx512) {
    const block_q6_K *b = row;
    ROWS_BEGIN
    for (int64_t s = 0; s < nb; s++) {
        const float d = _cvtsh_ss(b[s].d);
        for (int h = 0; h < 2; h++) {
            const uint8_t *ql = b[s].ql + 64 * h, *qh = b[s].qh + 32 * h;
            const int8_t *sc = b[s].scales + 8 * h;
            const int64_t base = s * QK_K + 128 * h;
            for (int g = 0; g < 4; g++) {
                const uint8_t *l = ql + 32 * (g & 1);
                for (int k = 0; k < 32; k += 16) {
                    const __m512 dsc = _mm512_set1_ps(d * (float)sc[2 * g + k / 16]);
                    const __m512i q = q6_16(l + k, qh + k, 4 * (g >> 1), g);
                    ROWS_FMA16(k >> 4, _mm512_mul_ps(dsc, _mm512_cvtepi32_ps(q)),
                               base + 32 * g + k)
                }
            }
        }
    }
    ROWS_END
}
ROWS_DISPATCH(rows_q6_K_avx512)

#define PATHS(name)                                                                            \
    {dequant_##name##_portable, dequant_##name##_avx2, dequant_##name##_avx512},               \
        {NULL, NULL, rows_##name##_avx512}
#else
#define PATHS(name) {dequant_##name##_portable, NULL, NULL}, {NULL, NULL, NULL}
#endif

const struct quant_format FORMAT_Q4_K = {QT_Q4_K, QK_K, sizeof(block_q4_K), PATHS(q4_K)};
const struct quant_format FORMAT_Q5_K = {QT_Q5_K, QK_K, sizeof(block_q5_K), PATHS(q5_K)};
const struct quant_format FORMAT_Q6_K = {QT_Q6_K, QK_K, sizeof(block_q6_K), PATHS(q6_K)};
