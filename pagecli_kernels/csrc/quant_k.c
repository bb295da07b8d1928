/*
 * The 256-value K-quant super-blocks Q4_K, Q5_K and Q6_K: dequantization into float32, and
 * the register-fused decode kernels (rows: one weight row against up to 8 input rows; wide:
 * four weight rows against one input row, with prefetch).
 *
 * Per format: the portable loop (the readable spec, ggml's dequantize_row_*), then AVX2 and
 * AVX-512 versions with the same bits. Sub-block scales are products of f16 and 6- or 8-bit
 * integers, formed once per sub-block in float32 exactly as gguf.quants does:
 * Q4_K/Q5_K value = (d * sc) * q - (dmin * m), Q6_K value = (d * sc) * (q - 32).
 */
#include "quant_blocks.h"

#include <float.h>
#include <math.h>

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

/* A Q4_K/Q5_K super-block's eight 6-bit scales sc_j and mins m_j as bytes (sc[0..2) and
 * m[0..2) hold four each), unpacked four at a time by 32-bit words (what k_scale_min does one
 * at a time): sc_0..3 and m_0..3 are the low six bits of bytes 0..3 and 4..7; sc_4..7 and
 * m_4..7 are the low and high nibbles of bytes 8..11 under the top two bits of bytes 0..3 and
 * 4..7. */
static inline void k_scale_words(const uint8_t *scales, uint32_t sc[2], uint32_t m[2]) {
    const uint32_t six = 0x3f3f3f3fu, nibble = 0x0f0f0f0fu, two = 0x03030303u;
    uint32_t u[3];
    memcpy(u, scales, sizeof u);
    sc[0] = u[0] & six;
    sc[1] = (u[2] & nibble) | (((u[0] >> 6) & two) << 4);
    m[0] = u[1] & six;
    m[1] = ((u[2] >> 4) & nibble) | (((u[1] >> 6) & two) << 4);
}

/* The 8 (scale, min) float pairs of a Q4_K/Q5_K super-block: ds[j] = d * sc_j and ms[j] =
 * dmin * m_j (each product exact in float32). */
TARGET_AVX2 static inline void k_scales(const uint8_t *scales, float d, float dmin, float *ds,
                                        float *ms) {
    uint32_t sc[2], m[2];
    k_scale_words(scales, sc, m);
    const __m256 vsc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const void *)sc)));
    const __m256 vm = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const void *)m)));
    _mm256_storeu_ps(ds, _mm256_mul_ps(_mm256_set1_ps(d), vsc));
    _mm256_storeu_ps(ms, _mm256_mul_ps(_mm256_set1_ps(dmin), vm));
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

/* Q6_K's 32 values of group g of a half, minus 32, as bytes in q[0..32): ql's low (g < 2) or
 * high nibbles of its 32 bytes at l, under qh's 2-bit field g, put together as bytes (32
 * values an instruction) before they are widened 8 at a time for the float32 products. */
TARGET_AVX2 static inline void q6_32_bytes(const uint8_t *l, const uint8_t *qh, int g,
                                           int8_t *q) {
    const __m256i nib = _mm256_set1_epi8(0x0F), two = _mm256_set1_epi8(0x03);
    const __m256i lv = _mm256_loadu_si256((const __m256i *)l);
    const __m256i hv = _mm256_loadu_si256((const __m256i *)qh);
    /* 16-bit shifts: the bytes' masks below drop what crosses from the neighbour byte */
    const __m256i lo = _mm256_and_si256(g >> 1 ? _mm256_srli_epi16(lv, 4) : lv, nib);
    const __m256i hi = _mm256_and_si256(_mm256_srl_epi16(hv, _mm_cvtsi32_si128(2 * g)), two);
    const __m256i v = _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)); /* 0..63, no carries */
    _mm256_storeu_si256((__m256i *)q, _mm256_sub_epi8(v, _mm256_set1_epi8(32)));
}

TARGET_AVX2 static void dequant_q6_K_avx2(const void *blocks, float *out, int64_t num_blocks) {
    const block_q6_K *b = blocks;
    int8_t q[32] __attribute__((aligned(32)));
    for (int64_t i = 0; i < num_blocks; i++) {
        const float d = _cvtsh_ss(b[i].d);
        for (int h = 0; h < 2; h++, out += 128) {
            const uint8_t *ql = b[i].ql + 64 * h, *qh = b[i].qh + 32 * h;
            const int8_t *sc = b[i].scales + 8 * h;
            for (int g = 0; g < 4; g++) { /* 32 values: ql[0..32) or [32..64), nibble g / 2 */
                q6_32_bytes(ql + 32 * (g & 1), qh, g, q);
                for (int k = 0; k < 32; k += 8) {
                    const float dsc = d * (float)sc[2 * g + k / 16];
                    const __m128i eight = _mm_loadl_epi64((const void *)(q + k));
                    put8(out + 32 * g + k, _mm256_cvtepi8_epi32(eight), dsc, 0.0f);
                }
            }
        }
    }
}

/* dsc[i] = d * scales[i], the 16 sub-block scales (each product exact in float32). */
TARGET_AVX512 static inline void q6_scales(const block_q6_K *b, float dsc[16]) {
    const __m512i sc = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)b->scales));
    _mm512_storeu_ps(dsc, _mm512_mul_ps(_mm512_set1_ps(_cvtsh_ss(b->d)), _mm512_cvtepi32_ps(sc)));
}

TARGET_AVX512 static void dequant_q6_K_avx512(const void *blocks, float *out,
                                              int64_t num_blocks) {
    const block_q6_K *b = blocks;
    for (int64_t i = 0; i < num_blocks; i++) {
        float dsc[16];
        q6_scales(&b[i], dsc);
        for (int h = 0; h < 2; h++, out += 128) {
            __m512i v[2];
            q6_half_bytes(b[i].ql + 64 * h, b[i].qh + 32 * h, &v[0], &v[1]);
#pragma GCC unroll 8 /* q6_lane's c a constant */
            for (int c = 0; c < 8; c++)
                _mm512_storeu_ps(out + 16 * c,
                                 _mm512_mul_ps(_mm512_set1_ps(dsc[8 * h + c]), q6_lane(v, c)));
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
        float dsc[16];
        q6_scales(&b[s], dsc);
        for (int h = 0; h < 2; h++) {
            __m512i v[2];
            q6_half_bytes(b[s].ql + 64 * h, b[s].qh + 32 * h, &v[0], &v[1]);
            const int64_t base = s * QK_K + 128 * h;
#pragma GCC unroll 8 /* q6_lane's c a constant: else a switch, and v on the stack */
            for (int c = 0; c < 8; c++) /* 16 values each, in order */
                ROWS_FMA16(c & 1, _mm512_mul_ps(_mm512_set1_ps(dsc[8 * h + c]), q6_lane(v, c)),
                           base + 16 * c)
        }
    }
    ROWS_END
}
ROWS_DISPATCH(rows_q6_K_avx512)

/* ---- small batches: R rows against 2-4 input rows (AVX-512; SMALL_*: quant_blocks.h) ------
 * Each row dequantized as its rows kernel does it, the products in the same order. Q4_K's
 * runs on Intel's CPUs only, at 2-4 rows (quant_linear_cpu.c's fused): its rows kernel forms a
 * table per sub-block once for all inputs, and an earlier small-batch kernel (the tables
 * formed again per 16 values, or two rows' tables beside the sums) ran 5-12% slower than it
 * at 2-4 rows on an AMD EPYC Zen 4, while on a Xeon with AMX this one (each pair of
 * sub-blocks' tables formed once per row, as the wide kernel does) takes 2 rows in 0.53 of the
 * rows kernel's time. */

SMALL_KERNEL(small_q6_K_avx512) {
    SMALL_BEGIN
    for (int64_t s = 0; s < nb; s++) {
        const block_q6_K *b[4];
        float dsc[4][16];
        for (int r = 0; r < R; r++) {
            b[r] = (const block_q6_K *)((const uint8_t *)w + r * row_bytes) + s;
            WIDE_PREFETCH_BLOCK(b[r], (int)sizeof(block_q6_K))
            q6_scales(b[r], dsc[r]);
        }
        for (int h = 0; h < 2; h++) {
            __m512i v[4][2];
            for (int r = 0; r < R; r++)
                q6_half_bytes(b[r]->ql + 64 * h, b[r]->qh + 32 * h, &v[r][0], &v[r][1]);
            const int64_t base = s * QK_K + 128 * h;
#pragma GCC unroll 8 /* q6_lane's c a constant */
            for (int c = 0; c < 8; c++) {
                __m512 wv[4];
                for (int r = 0; r < R; r++)
                    wv[r] = _mm512_mul_ps(_mm512_set1_ps(dsc[r][8 * h + c]), q6_lane(v[r], c));
                SMALL_FMA16(c & 1, wv, base + 16 * c)
            }
        }
    }
    SMALL_END
}
SMALL_DISPATCH(small_q6_K_avx512)

SMALL_KERNEL(small_q4_K_avx512) {
    const __m512 levels = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    SMALL_BEGIN
    for (int64_t s = 0; s < nb; s++) {
        const block_q4_K *b[4];
        float ds[4][8], ms[4][8];
        for (int r = 0; r < R; r++) {
            b[r] = (const block_q4_K *)((const uint8_t *)w + r * row_bytes) + s;
            WIDE_PREFETCH_BLOCK(b[r], (int)sizeof(block_q4_K))
            k_scales(b[r]->scales, _cvtsh_ss(b[r]->d), _cvtsh_ss(b[r]->dmin), ds[r], ms[r]);
        }
        const int64_t base = s * QK_K;
        for (int j = 0; j < 8; j += 2) {
            __m512 t0[4], t1[4], wv[4];
            __m512i q0[4], q1[4];
            for (int r = 0; r < R; r++) {
                t0[r] = _mm512_fmsub_ps(levels, _mm512_set1_ps(ds[r][j]), _mm512_set1_ps(ms[r][j]));
                t1[r] = _mm512_fmsub_ps(levels, _mm512_set1_ps(ds[r][j + 1]),
                                        _mm512_set1_ps(ms[r][j + 1]));
                const uint8_t *qs = b[r]->qs + 16 * j;
                q0[r] = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)qs));
                q1[r] = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qs + 16)));
            }
            for (int r = 0; r < R; r++) wv[r] = _mm512_permutexvar_ps(q0[r], t0[r]);
            SMALL_FMA16(0, wv, base + 32 * j)
            for (int r = 0; r < R; r++)
                wv[r] = _mm512_permutexvar_ps(_mm512_srli_epi32(q0[r], 4), t1[r]);
            SMALL_FMA16(1, wv, base + 32 * j + 32)
            for (int r = 0; r < R; r++) wv[r] = _mm512_permutexvar_ps(q1[r], t0[r]);
            SMALL_FMA16(0, wv, base + 32 * j + 16)
            for (int r = 0; r < R; r++)
                wv[r] = _mm512_permutexvar_ps(_mm512_srli_epi32(q1[r], 4), t1[r]);
            SMALL_FMA16(1, wv, base + 32 * j + 48)
        }
    }
    SMALL_END
}
SMALL_DISPATCH(small_q4_K_avx512)

/* ---- 5-8 input rows: one half of the rows kernel's sums a call (AVX-512; MANY_*) ----------
 * Each row dequantized as its rows kernel does it, the products that go into acc[HALF] in
 * its order: Q4_K's sub-blocks j = HALF, HALF + 2, ... (the low nibbles of its bytes for half
 * 0, the high ones for half 1), Q6_K's 16-value lanes c = HALF, HALF + 2, ... of each half
 * super-block. */

MANY_KERNEL(many_q4_K_avx512) {
    const __m512 levels = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    MANY_BEGIN
    /* scratch: row r's super-block s's ds[8] then ms[8] at (r * nb + s) * 16, from half 0 */
    if (!HALF)
        for (int r = 0; r < R; r++)
            for (int64_t s = 0; s < nb; s++) {
                const block_q4_K *b = (const block_q4_K *)((const uint8_t *)w + r * row_bytes) + s;
                float *dm = scratch + (r * nb + s) * 16;
                k_scales(b->scales, _cvtsh_ss(b->d), _cvtsh_ss(b->dmin), dm, dm + 8);
            }
    for (int64_t s = 0; s < nb; s++) {
        const block_q4_K *b[3];
        const float *dm[3];
        for (int r = 0; r < R; r++) {
            b[r] = (const block_q4_K *)((const uint8_t *)w + r * row_bytes) + s;
            MANY_PREFETCH_BLOCK(b[r], (int)sizeof(block_q4_K))
            dm[r] = scratch + (r * nb + s) * 16;
        }
        const int64_t base = s * QK_K;
        for (int j = HALF; j < 8; j += 2) {
            __m512 t[3], wv[3];
            for (int r = 0; r < R; r++)
                t[r] = _mm512_fmsub_ps(levels, _mm512_set1_ps(dm[r][j]),
                                       _mm512_set1_ps(dm[r][8 + j]));
            for (int h = 0; h < 32; h += 16) {
                for (int r = 0; r < R; r++) {
                    const __m512i q = _mm512_cvtepu8_epi32(
                        _mm_loadu_si128((const __m128i *)(b[r]->qs + 16 * (j - HALF) + h)));
                    wv[r] = _mm512_permutexvar_ps(HALF ? _mm512_srli_epi32(q, 4) : q, t[r]);
                }
                MANY_FMA16(wv, base + 32 * j + h)
            }
        }
    }
    MANY_END
}
MANY_DISPATCH(many_q4_K_avx512)

MANY_KERNEL(many_q6_K_avx512) {
    MANY_BEGIN
    /* scratch: row r's super-block s's 16 scales d * sc at (r * nb + s) * 16, from half 0 */
    if (!HALF)
        for (int r = 0; r < R; r++)
            for (int64_t s = 0; s < nb; s++)
                q6_scales((const block_q6_K *)((const uint8_t *)w + r * row_bytes) + s,
                          scratch + (r * nb + s) * 16);
    for (int64_t s = 0; s < nb; s++) {
        const block_q6_K *b[3];
        const float *dsc[3];
        for (int r = 0; r < R; r++) {
            b[r] = (const block_q6_K *)((const uint8_t *)w + r * row_bytes) + s;
            MANY_PREFETCH_BLOCK(b[r], (int)sizeof(block_q6_K))
            dsc[r] = scratch + (r * nb + s) * 16;
        }
        for (int h = 0; h < 2; h++) {
            __m512i v[3][2];
            for (int r = 0; r < R; r++)
                q6_half_bytes(b[r]->ql + 64 * h, b[r]->qh + 32 * h, &v[r][0], &v[r][1]);
            const int64_t base = s * QK_K + 128 * h;
#pragma GCC unroll 4 /* q6_lane's c a constant */
            for (int c = HALF; c < 8; c += 2) {
                __m512 wv[3];
                for (int r = 0; r < R; r++)
                    wv[r] = _mm512_mul_ps(_mm512_set1_ps(dsc[r][8 * h + c]), q6_lane(v[r], c));
                MANY_FMA16(wv, base + 16 * c)
            }
        }
    }
    MANY_END
}
MANY_DISPATCH(many_q6_K_avx512)

/* ---- WIDE_ROWS rows against one input row (AVX-512) ----------------------------------------
 * Batch-1 decode, as quant_q4_q8.c's wide kernels: the rows' FMA chains side by side, each
 * super-block prefetched `ahead` (all of its cache lines). A row's sums go into its two
 * accumulators in the order of its rows kernel above, so both give the same bits. */

/* Q4_K: per pair of sub-blocks, the 64 values of x are loaded once for the four rows. */
TARGET_AVX512 static void wide_q4_K_avx512(const void *w, int64_t row_bytes, int64_t nb,
                                           const float *x, float *out) {
    const __m512 levels = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    WIDE_BEGIN
    for (int64_t s = 0; s < nb; s++) {
        const block_q4_K *b[WIDE_ROWS];
        float ds[WIDE_ROWS][8], ms[WIDE_ROWS][8];
        for (int r = 0; r < WIDE_ROWS; r++) {
            b[r] = (const block_q4_K *)((const uint8_t *)w + r * row_bytes) + s;
            WIDE_PREFETCH_BLOCK(b[r], (int)sizeof(block_q4_K))
            k_scales(b[r]->scales, _cvtsh_ss(b[r]->d), _cvtsh_ss(b[r]->dmin), ds[r], ms[r]);
        }
        const float *xs = x + s * QK_K;
        for (int j = 0; j < 8; j += 2) {
            const __m512 x0 = _mm512_loadu_ps(xs + 32 * j), x1 = _mm512_loadu_ps(xs + 32 * j + 16);
            const __m512 x2 = _mm512_loadu_ps(xs + 32 * j + 32);
            const __m512 x3 = _mm512_loadu_ps(xs + 32 * j + 48);
            for (int r = 0; r < WIDE_ROWS; r++) {
                /* (d * sc) * q is exact, so one rounding of it minus dmin * m is gguf's */
                const __m512 t0 = _mm512_fmsub_ps(levels, _mm512_set1_ps(ds[r][j]),
                                                  _mm512_set1_ps(ms[r][j]));
                const __m512 t1 = _mm512_fmsub_ps(levels, _mm512_set1_ps(ds[r][j + 1]),
                                                  _mm512_set1_ps(ms[r][j + 1]));
                const uint8_t *qs = b[r]->qs + 16 * j;
                const __m512i q0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)qs));
                const __m512i q1 =
                    _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qs + 16)));
                acc[r][0] = _mm512_fmadd_ps(_mm512_permutexvar_ps(q0, t0), x0, acc[r][0]);
                acc[r][1] = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(q0, 4), t1),
                                            x2, acc[r][1]);
                acc[r][0] = _mm512_fmadd_ps(_mm512_permutexvar_ps(q1, t0), x1, acc[r][0]);
                acc[r][1] = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(q1, 4), t1),
                                            x3, acc[r][1]);
            }
        }
    }
    WIDE_END
}

/* Q5_K: a fifth bit from qh picks the upper half of a 32-entry table (permutex2var). */
TARGET_AVX512 static void wide_q5_K_avx512(const void *w, int64_t row_bytes, int64_t nb,
                                           const float *x, float *out) {
    const __m512 lo16 = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 hi16 = _mm512_add_ps(lo16, _mm512_set1_ps(16));
    const __m512i low = _mm512_set1_epi32(0xF), bit4 = _mm512_set1_epi32(16);
    WIDE_BEGIN
    for (int64_t s = 0; s < nb; s++) {
        const block_q5_K *b[WIDE_ROWS];
        float ds[WIDE_ROWS][8], ms[WIDE_ROWS][8];
        for (int r = 0; r < WIDE_ROWS; r++) {
            b[r] = (const block_q5_K *)((const uint8_t *)w + r * row_bytes) + s;
            WIDE_PREFETCH_BLOCK(b[r], (int)sizeof(block_q5_K))
            k_scales(b[r]->scales, _cvtsh_ss(b[r]->d), _cvtsh_ss(b[r]->dmin), ds[r], ms[r]);
        }
        const float *xs = x + s * QK_K;
        for (int j = 0; j < 8; j += 2) {
            const __m128i bit0 = _mm_set1_epi8((char)(1 << j));
            const __m128i bit1 = _mm_set1_epi8((char)(2 << j));
            for (int h = 0; h < 32; h += 16) {
                const __m512 x0 = _mm512_loadu_ps(xs + 32 * j + h);
                const __m512 x1 = _mm512_loadu_ps(xs + 32 * j + 32 + h);
                for (int r = 0; r < WIDE_ROWS; r++) {
                    __m512 t[2][2]; /* [sub-block][values 0..15 / 16..31] */
                    for (int u = 0; u < 2; u++) {
                        const __m512 d = _mm512_set1_ps(ds[r][j + u]);
                        const __m512 m = _mm512_set1_ps(ms[r][j + u]);
                        t[u][0] = _mm512_fmsub_ps(lo16, d, m);
                        t[u][1] = _mm512_fmsub_ps(hi16, d, m);
                    }
                    const __m512i q = _mm512_cvtepu8_epi32(
                        _mm_loadu_si128((const __m128i *)(b[r]->qs + 16 * j + h)));
                    const __m128i qh = _mm_loadu_si128((const __m128i *)(b[r]->qh + h));
                    const __m512i i0 = _mm512_and_si512(q, low), i1 = _mm512_srli_epi32(q, 4);
                    const __m512i f0 = _mm512_mask_or_epi32(i0, _mm_test_epi8_mask(qh, bit0), i0,
                                                            bit4);
                    const __m512i f1 = _mm512_mask_or_epi32(i1, _mm_test_epi8_mask(qh, bit1), i1,
                                                            bit4);
                    acc[r][0] = _mm512_fmadd_ps(_mm512_permutex2var_ps(t[0][0], f0, t[0][1]), x0,
                                                acc[r][0]);
                    acc[r][1] = _mm512_fmadd_ps(_mm512_permutex2var_ps(t[1][0], f1, t[1][1]), x1,
                                                acc[r][1]);
                }
            }
        }
    }
    WIDE_END
}

TARGET_AVX512 static void wide_q6_K_avx512(const void *w, int64_t row_bytes, int64_t nb,
                                           const float *x, float *out) {
    WIDE_BEGIN
    for (int64_t s = 0; s < nb; s++) {
        const float *xs = x + s * QK_K;
        for (int r = 0; r < WIDE_ROWS; r++) {
            const block_q6_K *b = (const block_q6_K *)((const uint8_t *)w + r * row_bytes) + s;
            WIDE_PREFETCH_BLOCK(b, (int)sizeof(block_q6_K))
            float dsc[16];
            q6_scales(b, dsc);
            for (int h = 0; h < 2; h++) {
                __m512i v[2];
                q6_half_bytes(b->ql + 64 * h, b->qh + 32 * h, &v[0], &v[1]);
#pragma GCC unroll 8 /* q6_lane's c a constant */
                for (int c = 0; c < 8; c++) {
                    const __m512 wv = _mm512_mul_ps(_mm512_set1_ps(dsc[8 * h + c]), q6_lane(v, c));
                    acc[r][c & 1] =
                        _mm512_fmadd_ps(wv, _mm512_loadu_ps(xs + 128 * h + 16 * c), acc[r][c & 1]);
                }
            }
        }
    }
    WIDE_END
}

/* ---- AVX2 rows and wide kernels ------------------------------------------------------------
 * Each 8 weights converted and scaled, fma(q, d * sc, -(dmin * m)) (one rounding of an exact
 * product minus an exact product, as gguf rounds it) or (d * sc) * (q - 32). One walk over a
 * super-block per format (K_AVX2_*, the walks of AVX2_KERNELS in quant_blocks.h: EMIT(k, w,
 * off) for each 8 weights w at value off of the row, into accumulator k & 1) feeds both
 * kernels, so a row sums in the same order alone or beside other rows, at one input row or
 * several. */

/* 8 bytes as int32 lanes, float. */
TARGET_AVX2 static inline __m256 u8x8_ps(__m128i v) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
}

#define K_AVX2_Q4_K(name, b, base, EMIT)                                                       \
    do {                                                                                       \
        const __m128i low_ = _mm_set1_epi8(0xF);                                               \
        float ds_[8], ms_[8];                                                                  \
        k_scales((b)->scales, _cvtsh_ss((b)->d), _cvtsh_ss((b)->dmin), ds_, ms_);              \
        for (int j_ = 0; j_ < 8; j_ += 2) {                                                    \
            const __m256 d0_ = _mm256_set1_ps(ds_[j_]), m0_ = _mm256_set1_ps(-ms_[j_]);        \
            const __m256 d1_ = _mm256_set1_ps(ds_[j_ + 1]), m1_ = _mm256_set1_ps(-ms_[j_ + 1]); \
            for (int h_ = 0; h_ < 32; h_ += 16) {                                              \
                const __m128i q_ = _mm_loadu_si128((const __m128i *)((b)->qs + 16 * j_ + h_)); \
                const __m128i lo_ = _mm_and_si128(q_, low_);                                   \
                const __m128i hi_ = _mm_and_si128(_mm_srli_epi16(q_, 4), low_);                \
                const int64_t o_ = (base) + 32 * j_ + h_;                                      \
                EMIT(0, _mm256_fmadd_ps(u8x8_ps(lo_), d0_, m0_), o_)                           \
                EMIT(1, _mm256_fmadd_ps(u8x8_ps(_mm_srli_si128(lo_, 8)), d0_, m0_), o_ + 8)    \
                EMIT(0, _mm256_fmadd_ps(u8x8_ps(hi_), d1_, m1_), o_ + 32)                      \
                EMIT(1, _mm256_fmadd_ps(u8x8_ps(_mm_srli_si128(hi_, 8)), d1_, m1_), o_ + 40)   \
            }                                                                                  \
        }                                                                                      \
    } while (0)

#define K_AVX2_Q5_K(name, b, base, EMIT)                                                       \
    do {                                                                                       \
        const __m128i low_ = _mm_set1_epi8(0xF);                                               \
        const __m256i one_ = _mm256_set1_epi32(1);                                             \
        float ds_[8], ms_[8];                                                                  \
        k_scales((b)->scales, _cvtsh_ss((b)->d), _cvtsh_ss((b)->dmin), ds_, ms_);              \
        for (int j_ = 0; j_ < 8; j_ += 2) {                                                    \
            const __m256 d0_ = _mm256_set1_ps(ds_[j_]), m0_ = _mm256_set1_ps(-ms_[j_]);        \
            const __m256 d1_ = _mm256_set1_ps(ds_[j_ + 1]), m1_ = _mm256_set1_ps(-ms_[j_ + 1]); \
            for (int h_ = 0; h_ < 32; h_ += 8) {                                               \
                const __m128i q_ = _mm_loadl_epi64((const __m128i *)((b)->qs + 16 * j_ + h_)); \
                const __m256i qh_ =                                                            \
                    _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)((b)->qh + h_)));    \
                const __m256i h0_ = _mm256_and_si256(_mm256_srli_epi32(qh_, j_), one_);        \
                const __m256i h1_ = _mm256_and_si256(_mm256_srli_epi32(qh_, j_ + 1), one_);    \
                const __m256i lo_ = _mm256_cvtepu8_epi32(_mm_and_si128(q_, low_));             \
                const __m256i hi_ =                                                            \
                    _mm256_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(q_, 4), low_));          \
                const __m256i v0_ = _mm256_or_si256(lo_, _mm256_slli_epi32(h0_, 4));           \
                const __m256i v1_ = _mm256_or_si256(hi_, _mm256_slli_epi32(h1_, 4));           \
                EMIT(h_ >> 3, _mm256_fmadd_ps(_mm256_cvtepi32_ps(v0_), d0_, m0_),              \
                     (base) + 32 * j_ + h_)                                                    \
                EMIT((h_ >> 3) + 1, _mm256_fmadd_ps(_mm256_cvtepi32_ps(v1_), d1_, m1_),        \
                     (base) + 32 * j_ + 32 + h_)                                               \
            }                                                                                  \
        }                                                                                      \
    } while (0)

/* Putting 32 values together in bytes before widening them (where they were widened 8 at a
 * time and put together in int32 lanes) took the rows from memory from 3.7 to 5.0 GB/s of
 * weights per thread, the same bits (AMD EPYC Zen 3, one thread, Llama-3.2-1B shapes:
 * benchmarks/quant_kernels.py). */
#define K_AVX2_Q6_K(name, b, base, EMIT)                                                       \
    do {                                                                                       \
        int8_t q_[32] __attribute__((aligned(32)));                                            \
        const float d_ = _cvtsh_ss((b)->d);                                                    \
        for (int h_ = 0; h_ < 2; h_++) {                                                       \
            const uint8_t *ql_ = (b)->ql + 64 * h_, *qh_ = (b)->qh + 32 * h_;                  \
            const int8_t *sc_ = (b)->scales + 8 * h_;                                          \
            for (int g_ = 0; g_ < 4; g_++) {                                                   \
                q6_32_bytes(ql_ + 32 * (g_ & 1), qh_, g_, q_);                                 \
                for (int k_ = 0; k_ < 32; k_ += 8) {                                           \
                    const __m256 dsc_ = _mm256_set1_ps(d_ * (float)sc_[2 * g_ + k_ / 16]);     \
                    const __m128i eight_ = _mm_loadl_epi64((const void *)(q_ + k_));           \
                    EMIT(k_ >> 3,                                                              \
                         _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(eight_)),     \
                                         dsc_, _mm256_setzero_ps()),                           \
                         (base) + 128 * h_ + 32 * g_ + k_)                                     \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
    } while (0)

AVX2_KERNELS(q4_K, QK_K, K_AVX2_Q4_K)
AVX2_KERNELS(q5_K, QK_K, K_AVX2_Q5_K)
AVX2_KERNELS(q6_K, QK_K, K_AVX2_Q6_K)

/* ---- Q4_K at batch 1 on integer dot products (AVX-512 VNNI) --------------------------------
 * The float kernels above spend most of their time widening bytes and permuting tables: on
 * Zen 4 a vpmovzxbd or vpermps on 512 bits takes a cycle or two, for 16 weights. Here the
 * input row is split once per call, per super-block of 256 values, into two int16 parts:
 * x = s * (A + B * 2^-15) + e, s a power of two with max|x| / s in [2^13, 2^14), so |A| and
 * |B| <= 2^14 and |e| <= s * 2^-16 <= 2^-29 max|x| (below float32's own rounding of the
 * block's largest value). Each weight's integer q * sc (<= 15 * 63) multiplies A and B
 * exactly (vpdpwssd: 32 products per instruction, int32 sums, at most 16 per lane per
 * super-block: no overflow), and a super-block's two sums are converted and scaled by d * s
 * once. The minimums come from the per-sub-block sums of x: y = sum over super-blocks of
 * d*s*(SA + SB*2^-15) - sum_j (dmin*m_j) * sum(x_j). That is the reordering the kernel tests
 * allow (a block's products summed, then scaled), held to the same float64 tolerance.
 *
 * The order of A and B inside a super-block follows the weights: the 64 bytes of qs of half
 * h (sub-blocks 4h..4h+3) read as 32 words, whose four nibbles k = 0..3 are extracted as
 * words (q & 15, (q >> 4) & 15, ...). Word w of chunk c = 2h + (w >= 16) holds bytes 2w' and
 * 2w'+1 (w' = w % 16) of that chunk: nibble k is value 2w' + (k >> 1) of sub-block
 * 2c + (k & 1): value 32 * (2c + (k & 1)) + 2w' + (k >> 1) of the super-block. */

#define SPLIT_HALF_BITS 14 /* max|x| / s in [2^(BITS-1), 2^BITS) */

/* The split of x (num_blocks super-blocks); nonzero where a value is not finite, or the
 * block's scale would leave float32's normal range. Sixteen values at a time: A = rint(v)
 * and B = rint((v - A) * 2^15) for v = x / s (exact: s a power of two, v - A exact), with
 * the rounding to nearest even that rintf gives. In the Q4_K order, each 32 words (half h,
 * nibble k) are the even or odd values of two sub-blocks (above), taken from the
 * natural order by one two-source word permute. */
TARGET_AVX512 static int split_x(const float *x, int64_t num_blocks, const struct int_split *out,
                                 int q4_order) {
    const __m512 limit = _mm512_set1_ps(FLT_MAX);
    __m512i pick[2]; /* Q4_K order: words of sub-blocks (c, c + 2) at even (k >> 1 = 0) or odd */
    for (int odd = 0; odd < 2; odd++) {
        int16_t idx[32];
        for (int w = 0; w < 32; w++) idx[w] = (int16_t)((w < 16 ? 2 * w : 32 + 2 * (w - 16)) + odd);
        pick[odd] = _mm512_loadu_si512((const void *)idx);
    }
    for (int64_t s = 0; s < num_blocks; s++) {
        const float *xs = x + s * QK_K;
        __m512 most = _mm512_setzero_ps();
        for (int i = 0; i < QK_K; i += 16) {
            const __m512 v = _mm512_abs_ps(_mm512_loadu_ps(xs + i));
            /* inf or NaN: the float kernels propagate it */
            if (_mm512_cmp_ps_mask(v, limit, _CMP_LE_OQ) != 0xFFFF) return -1;
            most = _mm512_max_ps(most, v);
        }
        const float top = _mm512_reduce_max_ps(most);
        int e = 0;
        if (top > 0.0f) frexpf(top, &e); /* top in [2^(e-1), 2^e) */
        const int shift = e - SPLIT_HALF_BITS; /* s = 2^shift */
        if (top > 0.0f && (shift < -100 || shift > 100)) return -1;
        const __m512 inv = _mm512_set1_ps(ldexpf(1.0f, -shift));
        const __m512 wide = _mm512_set1_ps(32768.0f);
        out->scale[s] = ldexpf(1.0f, shift);
        int16_t na[QK_K], nb[QK_K]; /* natural order */
        int16_t *a = q4_order ? na : out->a + s * QK_K, *b = q4_order ? nb : out->b + s * QK_K;
        for (int j = 0; j < 8; j++) {
            const __m512 x0 = _mm512_loadu_ps(xs + 32 * j), x1 = _mm512_loadu_ps(xs + 32 * j + 16);
            out->sums[8 * s + j] = _mm512_reduce_add_ps(_mm512_add_ps(x0, x1));
            for (int half = 0; half < 2; half++) {
                const __m512 v = _mm512_mul_ps(half ? x1 : x0, inv); /* exact: a power of two */
                const __m512 hi = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT |
                                                              _MM_FROUND_NO_EXC);
                const __m512 lo = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_sub_ps(v, hi), wide),
                                                       _MM_FROUND_TO_NEAREST_INT |
                                                           _MM_FROUND_NO_EXC);
                _mm256_storeu_si256((__m256i *)(a + 32 * j + 16 * half),
                                    _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(hi)));
                _mm256_storeu_si256((__m256i *)(b + 32 * j + 16 * half),
                                    _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(lo)));
            }
        }
        if (!q4_order) continue;
        for (int h = 0; h < 2; h++)
            for (int k = 0; k < 4; k++) {
                const int first = 32 * (4 * h + (k & 1)), second = first + 64;
                const int at = 128 * h + 32 * k;
                _mm512_storeu_si512(
                    (void *)(out->a + s * QK_K + at),
                    _mm512_permutex2var_epi16(_mm512_loadu_si512((const void *)(na + first)),
                                              pick[k >> 1],
                                              _mm512_loadu_si512((const void *)(na + second))));
                _mm512_storeu_si512(
                    (void *)(out->b + s * QK_K + at),
                    _mm512_permutex2var_epi16(_mm512_loadu_si512((const void *)(nb + first)),
                                              pick[k >> 1],
                                              _mm512_loadu_si512((const void *)(nb + second))));
            }
    }
    return 0;
}

static int split_x_q4_K(const float *x, int64_t num_blocks, const struct int_split *out) {
    return split_x(x, num_blocks, out, 1);
}

/* Q6_K takes A and B in the values' own order (its 6-bit values are put together in order by
 * q6_half_bytes). */
static int split_x_q6_K(const float *x, int64_t num_blocks, const struct int_split *out) {
    return split_x(x, num_blocks, out, 0);
}

/* The word permutes that give each of Q4_K's 32 words (half h, nibble k: int_q4_K_block) its
 * sub-block's scale: pick[h][k & 1]. */
TARGET_VNNI static inline __attribute__((always_inline)) void q4_K_int_picks(__m512i pick[2][2]) {
    for (int h = 0; h < 2; h++)
        for (int odd = 0; odd < 2; odd++) {
            int16_t idx[32];
            for (int i = 0; i < 32; i++) idx[i] = (int16_t)(4 * h + 2 * (i >= 16) + odd);
            pick[h][odd] = _mm512_loadu_si512((const void *)idx);
        }
}

/* Q6_K's: scale words for values 32c..32c+32 of a half, words 0..15 scale 2c, 16..31 2c+1. */
TARGET_VNNI static inline __attribute__((always_inline)) void q6_K_int_picks(__m512i pick[4]) {
    for (int c = 0; c < 4; c++) {
        int16_t idx[32];
        for (int i = 0; i < 32; i++) idx[i] = (int16_t)(2 * c + (i >= 16));
        pick[c] = _mm512_loadu_si512((const void *)idx);
    }
}

/* Super-blocks a piece of x takes in the integer kernels for m inputs: x's two int16 parts of
 * m inputs in about INT_PIECE_BYTES, at least one. */
static inline int64_t piece_super_blocks(int m, int64_t nb) {
    const int64_t fit = INT_PIECE_BYTES / ((int64_t)m * QK_K * 2 * (int64_t)sizeof(int16_t));
    return fit < 1 ? 1 : fit < nb ? fit : nb;
}

/* acc += d * s * (SA + SB * 2^-15) for a super-block's int32 sums SA, SB of an input split
 * with scale s. */
TARGET_VNNI static inline __attribute__((always_inline)) void int_scale(__m512i ia, __m512i ib,
                                                                          float d, float scale,
                                                                          __m512 *acc) {
    const float ds = d * scale; /* exact: f16 times a power of two */
    *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia), _mm512_set1_ps(ds), *acc);
    *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ib), _mm512_set1_ps(ds * 0x1p-15f), *acc);
}

/* Q4_K's integer kernels' per-super-block scales: the 8 sub-block scales as words (scw, for
 * q4_K_int_picks' permutes) and dmin times the 8 minimums (ms). */
TARGET_VNNI static inline __attribute__((always_inline)) void
q4_K_int_scales(const block_q4_K *b, __m512i *scw, __m256 *ms) {
    uint32_t sc[2], m[2];
    k_scale_words(b->scales, sc, m);
    *scw = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_loadl_epi64((const void *)sc)));
    *ms = _mm256_mul_ps(
        _mm256_set1_ps(_cvtsh_ss(b->dmin)),
        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const void *)m))));
}

/* Q6_K's: the 16 scales as words, those of half 0 in scw[0], of half 1 in scw[1] (low 8
 * words each, for q6_K_int_picks' permutes). */
TARGET_VNNI static inline __attribute__((always_inline)) void
q6_K_int_scales(const block_q6_K *b, __m512i scw[2]) {
    const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)b->scales));
    scw[0] = _mm512_castsi256_si512(sc16);
    scw[1] = _mm512_castsi256_si512(_mm256_permute2x128_si256(sc16, sc16, 0x11));
}

/* Super-block s of one weight row against the input xs (the batch-1 kernel): the weight words
 * of each half, two chains (A, B) per half added as integers (exact), then the float32
 * scaling into acc and the minimum's sums into accm. int_q4_K_piece gives the same bits at
 * 2-8 inputs. */
TARGET_VNNI static inline __attribute__((always_inline)) void
int_q4_K_block(const block_q4_K *b, int64_t s, const struct int_split *xs,
               const __m512i pick[2][2], __m512 *acc, __m256 *accm) {
    const __m512i nib = _mm512_set1_epi16(0x0F);
    __m512i scw;
    __m256 ms;
    q4_K_int_scales(b, &scw, &ms);
    *accm = _mm256_fmadd_ps(ms, _mm256_loadu_ps(xs->sums + 8 * s), *accm);
    __m512i ia = _mm512_setzero_si512(), ib = _mm512_setzero_si512();
    for (int h = 0; h < 2; h++) {
        const __m512i q = _mm512_loadu_si512((const void *)(b->qs + 64 * h));
        const __m512i se = _mm512_permutexvar_epi16(pick[h][0], scw);
        const __m512i so = _mm512_permutexvar_epi16(pick[h][1], scw);
        const __m512i w[4] = {
            _mm512_mullo_epi16(_mm512_and_si512(q, nib), se),
            _mm512_mullo_epi16(_mm512_and_si512(_mm512_srli_epi16(q, 4), nib), so),
            _mm512_mullo_epi16(_mm512_and_si512(_mm512_srli_epi16(q, 8), nib), se),
            _mm512_mullo_epi16(_mm512_srli_epi16(q, 12), so)};
        const int16_t *A = xs->a + s * QK_K + 128 * h, *B = xs->b + s * QK_K + 128 * h;
        __m512i ha = _mm512_setzero_si512(), hb = _mm512_setzero_si512();
        for (int k = 0; k < 4; k++) {
            ha = _mm512_dpwssd_epi32(ha, w[k], _mm512_loadu_si512((const void *)(A + 32 * k)));
            hb = _mm512_dpwssd_epi32(hb, w[k], _mm512_loadu_si512((const void *)(B + 32 * k)));
        }
        ia = _mm512_add_epi32(ia, ha);
        ib = _mm512_add_epi32(ib, hb);
    }
    int_scale(ia, ib, _cvtsh_ss(b->d), xs->scale[s], acc);
}

/* `rows` (<= WIDE_ROWS) rows, one after another per super-block: interleaving them (the rows
 * loop unrolled) spilled the chains' registers and ran at 0.65x this on Zen 4. */
TARGET_VNNI static void int_wide_q4_K(const void *w, int64_t row_bytes, int64_t nb, int rows,
                                      const struct int_split *xs, float *out) {
    const int64_t ahead = wide_prefetch_distance(row_bytes, WIDE_ROWS);
    const int l2 = pagecli_quant_prefetch_l2;
    __m512i pick[2][2];
    q4_K_int_picks(pick);
    __m512 acc[WIDE_ROWS];
    __m256 accm[WIDE_ROWS];
    for (int r = 0; r < WIDE_ROWS; r++) acc[r] = _mm512_setzero_ps(), accm[r] = _mm256_setzero_ps();
    for (int64_t s = 0; s < nb; s++)
        for (int r = 0; r < rows; r++) {
            const block_q4_K *b = (const block_q4_K *)((const uint8_t *)w + r * row_bytes) + s;
            WIDE_PREFETCH_BLOCK(b, (int)sizeof(block_q4_K))
            int_q4_K_block(b, s, xs, pick, &acc[r], &accm[r]);
        }
    for (int r = 0; r < rows; r++) out[r] = _mm512_reduce_add_ps(acc[r]) - hsum256(accm[r]);
}

/* Q6_K: the 6-bit values of each half minus 32 (q6_half_bytes), widened to words and times
 * their 8-bit scale ((q - 32) * sc: |.| <= 4096), against A and B in order; at most 16
 * products per int32 lane per super-block (1.07e9 < 2^31). As int_q4_K_block, one input;
 * int_q6_K_piece gives the same bits at 2-8. */
TARGET_VNNI static inline __attribute__((always_inline)) void
int_q6_K_block(const block_q6_K *b, int64_t s, const struct int_split *xs, const __m512i pick[4],
               __m512 *acc) {
    __m512i scw[2];
    q6_K_int_scales(b, scw);
    __m512i ia = _mm512_setzero_si512(), ib = _mm512_setzero_si512();
    for (int h = 0; h < 2; h++) {
        __m512i v[2], ha = _mm512_setzero_si512(), hb = _mm512_setzero_si512();
        q6_half_bytes(b->ql + 64 * h, b->qh + 32 * h, &v[0], &v[1]);
        for (int c = 0; c < 4; c++) {
            const __m256i bytes = (c & 1) ? _mm512_extracti64x4_epi64(v[c >> 1], 1)
                                          : _mm512_castsi512_si256(v[c >> 1]);
            const __m512i wv = _mm512_mullo_epi16(_mm512_cvtepi8_epi16(bytes),
                                                  _mm512_permutexvar_epi16(pick[c], scw[h]));
            const int64_t o = s * QK_K + 128 * h + 32 * c;
            ha = _mm512_dpwssd_epi32(ha, wv, _mm512_loadu_si512((const void *)(xs->a + o)));
            hb = _mm512_dpwssd_epi32(hb, wv, _mm512_loadu_si512((const void *)(xs->b + o)));
        }
        ia = _mm512_add_epi32(ia, ha);
        ib = _mm512_add_epi32(ib, hb);
    }
    int_scale(ia, ib, _cvtsh_ss(b->d), xs->scale[s], acc);
}

TARGET_VNNI static void int_wide_q6_K(const void *w, int64_t row_bytes, int64_t nb, int rows,
                                      const struct int_split *xs, float *out) {
    const int64_t ahead = wide_prefetch_distance(row_bytes, WIDE_ROWS);
    const int l2 = pagecli_quant_prefetch_l2;
    __m512i pick[4];
    q6_K_int_picks(pick);
    __m512 acc[WIDE_ROWS];
    for (int r = 0; r < WIDE_ROWS; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t s = 0; s < nb; s++)
        for (int r = 0; r < rows; r++) {
            const block_q6_K *b = (const block_q6_K *)((const uint8_t *)w + r * row_bytes) + s;
            WIDE_PREFETCH_BLOCK(b, (int)sizeof(block_q6_K))
            int_q6_K_block(b, s, xs, pick, &acc[r]);
        }
    for (int r = 0; r < rows; r++) out[r] = _mm512_reduce_add_ps(acc[r]);
}


/* The integer kernels for 2-8 input rows (int_many_fn): one weight row against M inputs over
 * super-blocks [s0, s1), each super-block's integer sums kept per input straight in ia / ib
 * (exact: the batch-1 kernel's sums, added in another order), then scaled as the batch-1
 * kernel scales them, so each output has the batch-1 bits. The float sums live in memory
 * (`state`, INT_STATE floats an input, zeroed at s0 = 0: 8-16 registers freed for the integer
 * sums), out[i * ldo] at the last super-block. The row's weight words are made once for all
 * M inputs; x comes packed (struct int_packed). The block this row takes a piece later (or, in
 * the last piece, the row `group` on's) is prefetched. */
#define INT_STATE 24 /* acc (16 floats), Q4_K's accm (8) */

static inline __attribute__((always_inline)) void
int_prefetch_next(const uint8_t *row, int64_t row_bytes, int64_t s, int64_t nb, int64_t piece,
                  int64_t group, int block_bytes, int l2) {
    const int64_t t = s + piece;
    const char *next = t < nb ? (const char *)row + t * block_bytes
                              : (const char *)row + group * row_bytes + (t - nb) * block_bytes;
    for (int p = 0; p < block_bytes; p += 64) prefetch_w(l2, next + p);
}

/* The products of one 32-value group's weight words wv with the M inputs' parts at xg, into
 * each input's integer sums ia[i] (a parts) and ib[i] (b parts). */
TARGET_VNNI static inline __attribute__((always_inline)) void
int_many_dots(__m512i wv, const int16_t *xg, __m512i *ia, __m512i *ib, const int M) {
    for (int i = 0; i < M; i++) {
        ia[i] = _mm512_dpwssd_epi32(ia[i], wv, _mm512_loadu_si512((const void *)(xg + 64 * i)));
        ib[i] =
            _mm512_dpwssd_epi32(ib[i], wv, _mm512_loadu_si512((const void *)(xg + 64 * i + 32)));
    }
}

/* Super-block s's integer sums scaled into each input's float sums in `state`, as the batch-1
 * kernels' int_scale does. */
TARGET_VNNI static inline __attribute__((always_inline)) void
int_many_scale(const __m512i *ia, const __m512i *ib, float d, const struct int_packed *xs,
               int64_t s, float *state, const int M) {
    for (int i = 0; i < M; i++) {
        __m512 acc = _mm512_loadu_ps(state + INT_STATE * i);
        int_scale(ia[i], ib[i], d, xs->scale[s * M + i], &acc);
        _mm512_storeu_ps(state + INT_STATE * i, acc);
    }
}

/* More than this many inputs take a super-block in two halves (int_q4_K_piece, int_q6_K_piece). */
#define INT_MANY_HALVES 5

/* Inputs [i0, i1) of M against a super-block's 8 groups of weight words wv: their integer
 * sums, then their scaling into `state`, as int_many_dots and int_many_scale do for all M. */
TARGET_VNNI static inline __attribute__((always_inline)) void
int_half_dots(const __m512i *wv, const struct int_packed *xs, int64_t s, const int i0,
              const int i1, float d, float *state, const int M) {
    __m512i ia[INT_MANY_MAX / 2], ib[INT_MANY_MAX / 2];
    for (int i = 0; i < i1 - i0; i++) ia[i] = ib[i] = _mm512_setzero_si512();
    for (int g = 0; g < 8; g++) {
        const int16_t *xg = xs->x + (s * 8 + g) * M * 64 + 64 * i0;
        int_many_dots(wv[g], xg, ia, ib, i1 - i0);
    }
    for (int i = 0; i < i1 - i0; i++) {
        float *at = state + INT_STATE * (i0 + i);
        __m512 acc = _mm512_loadu_ps(at);
        int_scale(ia[i], ib[i], d, xs->scale[s * M + i0 + i], &acc);
        _mm512_storeu_ps(at, acc);
    }
}

/* Q4_K's words for the k-th 32 values of a half super-block (64 bytes of codes q; se and so
 * the even and odd sub-blocks' scales): q * sc as int16. */
TARGET_VNNI static inline __attribute__((always_inline)) __m512i
q4_K_int_words(__m512i q, const int k, __m512i nib, __m512i se, __m512i so) {
    const __m512i codes =
        k == 3 ? _mm512_srli_epi16(q, 12) : _mm512_and_si512(_mm512_srli_epi16(q, 4 * k), nib);
    return _mm512_mullo_epi16(codes, (k & 1) ? so : se);
}

/* Q6_K's words for the c-th 32 values of a half super-block: (q - 32) * sc as int16. */
TARGET_VNNI static inline __attribute__((always_inline)) __m512i
q6_K_int_words(const __m512i *v, const int c, __m512i pick, __m512i scw) {
    const __m256i bytes =
        (c & 1) ? _mm512_extracti64x4_epi64(v[c >> 1], 1) : _mm512_castsi512_si256(v[c >> 1]);
    return _mm512_mullo_epi16(_mm512_cvtepi8_epi16(bytes), _mm512_permutexvar_epi16(pick, scw));
}

TARGET_VNNI static inline __attribute__((always_inline)) void
int_q4_K_piece(const uint8_t *row, int64_t row_bytes, int64_t s0, int64_t s1, int64_t nb,
               const struct int_packed *xs, float *state, float *out, int64_t ldo,
               int64_t piece, int64_t group, const int M) {
    const int l2 = pagecli_quant_prefetch_l2;
    const __m512i nib = _mm512_set1_epi16(0x0F);
    __m512i pick[2][2];
    q4_K_int_picks(pick);
    if (!s0)
        for (int i = 0; i < M; i++) {
            _mm512_storeu_ps(state + INT_STATE * i, _mm512_setzero_ps());
            _mm256_storeu_ps(state + INT_STATE * i + 16, _mm256_setzero_ps());
        }
    for (int64_t s = s0; s < s1; s++) {
        const block_q4_K *b = (const block_q4_K *)row + s;
        int_prefetch_next(row, row_bytes, s, nb, piece, group, (int)sizeof(block_q4_K), l2);
        __m512i scw;
        __m256 ms;
        q4_K_int_scales(b, &scw, &ms);
        for (int i = 0; i < M; i++) {
            float *at = state + INT_STATE * i + 16;
            _mm256_storeu_ps(at, _mm256_fmadd_ps(ms, _mm256_loadu_ps(xs->sums + (s * M + i) * 8),
                                                 _mm256_loadu_ps(at)));
        }
        if (M > INT_MANY_HALVES) { /* as int_q6_K_piece's */
            __m512i wv[8];
            for (int h = 0; h < 2; h++) {
                const __m512i q = _mm512_loadu_si512((const void *)(b->qs + 64 * h));
                const __m512i se = _mm512_permutexvar_epi16(pick[h][0], scw);
                const __m512i so = _mm512_permutexvar_epi16(pick[h][1], scw);
                for (int k = 0; k < 4; k++) wv[4 * h + k] = q4_K_int_words(q, k, nib, se, so);
            }
            int_half_dots(wv, xs, s, 0, (M + 1) / 2, _cvtsh_ss(b->d), state, M);
            int_half_dots(wv, xs, s, (M + 1) / 2, M, _cvtsh_ss(b->d), state, M);
            continue;
        }
        __m512i ia[INT_MANY_MAX], ib[INT_MANY_MAX];
        for (int i = 0; i < M; i++) ia[i] = ib[i] = _mm512_setzero_si512();
        for (int h = 0; h < 2; h++) {
            const __m512i q = _mm512_loadu_si512((const void *)(b->qs + 64 * h));
            const __m512i se = _mm512_permutexvar_epi16(pick[h][0], scw);
            const __m512i so = _mm512_permutexvar_epi16(pick[h][1], scw);
            for (int k = 0; k < 4; k++)
                int_many_dots(q4_K_int_words(q, k, nib, se, so),
                              xs->x + (s * 8 + 4 * h + k) * M * 64, ia, ib, M);
        }
        int_many_scale(ia, ib, _cvtsh_ss(b->d), xs, s, state, M);
    }
    if (s1 == nb)
        for (int i = 0; i < M; i++)
            out[i * ldo] = _mm512_reduce_add_ps(_mm512_loadu_ps(state + INT_STATE * i)) -
                           hsum256(_mm256_loadu_ps(state + INT_STATE * i + 16));
}

TARGET_VNNI static inline __attribute__((always_inline)) void
int_q6_K_piece(const uint8_t *row, int64_t row_bytes, int64_t s0, int64_t s1, int64_t nb,
               const struct int_packed *xs, float *state, float *out, int64_t ldo,
               int64_t piece, int64_t group, const int M) {
    const int l2 = pagecli_quant_prefetch_l2;
    __m512i pick[4];
    q6_K_int_picks(pick);
    if (!s0)
        for (int i = 0; i < M; i++) _mm512_storeu_ps(state + INT_STATE * i, _mm512_setzero_ps());
    for (int64_t s = s0; s < s1; s++) {
        const block_q6_K *b = (const block_q6_K *)row + s;
        int_prefetch_next(row, row_bytes, s, nb, piece, group, (int)sizeof(block_q6_K), l2);
        __m512i scw[2];
        q6_K_int_scales(b, scw);
        if (M > INT_MANY_HALVES) {
            /* two integer sums an input do not fit the registers beside the weight words at
             * 6-8 inputs (the compiler spills them): the super-block's 8 groups of words
             * made first, then the inputs in two halves, each half's sums taken and scaled
             * as one pass of M / 2 inputs would (the same integers, the same scaling) */
            __m512i wv[8];
            for (int h = 0; h < 2; h++) {
                __m512i v[2];
                q6_half_bytes(b->ql + 64 * h, b->qh + 32 * h, &v[0], &v[1]);
                for (int c = 0; c < 4; c++)
                    wv[4 * h + c] = q6_K_int_words(v, c, pick[c], scw[h]);
            }
            int_half_dots(wv, xs, s, 0, (M + 1) / 2, _cvtsh_ss(b->d), state, M);
            int_half_dots(wv, xs, s, (M + 1) / 2, M, _cvtsh_ss(b->d), state, M);
            continue;
        }
        __m512i ia[INT_MANY_MAX], ib[INT_MANY_MAX];
        for (int i = 0; i < M; i++) ia[i] = ib[i] = _mm512_setzero_si512();
        for (int h = 0; h < 2; h++) {
            __m512i v[2];
            q6_half_bytes(b->ql + 64 * h, b->qh + 32 * h, &v[0], &v[1]);
            for (int c = 0; c < 4; c++)
                int_many_dots(q6_K_int_words(v, c, pick[c], scw[h]),
                              xs->x + (s * 8 + 4 * h + c) * M * 64, ia, ib, M);
        }
        int_many_scale(ia, ib, _cvtsh_ss(b->d), xs, s, state, M);
    }
    if (s1 == nb)
        for (int i = 0; i < M; i++)
            out[i * ldo] = _mm512_reduce_add_ps(_mm512_loadu_ps(state + INT_STATE * i));
}

/* int_many_fn: x in pieces of about INT_PIECE_BYTES (whole super-blocks), each piece taken by
 * every row in turn while it is in the L1. One row at a time: two rows side by side (each
 * load of x serving both) ran Q6_K's 2-4 inputs no faster and 3 inputs 1.1x slower (Xeon). */
#define INT_MANY(name)                                                                         \
    TARGET_VNNI static void int_many_##name(const void *w, int64_t row_bytes, int64_t nb,      \
                                            int rows, const struct int_packed *xs, int m,      \
                                            float *y, int64_t ldy) {                           \
        float state[INT_MANY_ROWS * INT_MANY_MAX * INT_STATE];                                 \
        const int64_t piece = piece_super_blocks(m, nb);                                       \
        for (int64_t s0 = 0; s0 < nb; s0 += piece) {                                           \
            const int64_t s1 = s0 + piece < nb ? s0 + piece : nb;                              \
            for (int r = 0; r < rows; r++) {                                                   \
                const uint8_t *p = (const uint8_t *)w + r * row_bytes;                         \
                float *st = state + r * INT_MANY_MAX * INT_STATE;                              \
                switch (m) {                                                                   \
                case 2: int_##name##_piece(p, row_bytes, s0, s1, nb, xs, st, y + r, ldy,      \
                                           piece, rows, 2); break;                             \
                case 3: int_##name##_piece(p, row_bytes, s0, s1, nb, xs, st, y + r, ldy,      \
                                           piece, rows, 3); break;                             \
                case 4: int_##name##_piece(p, row_bytes, s0, s1, nb, xs, st, y + r, ldy,      \
                                           piece, rows, 4); break;                             \
                case 5: int_##name##_piece(p, row_bytes, s0, s1, nb, xs, st, y + r, ldy,      \
                                           piece, rows, 5); break;                             \
                case 6: int_##name##_piece(p, row_bytes, s0, s1, nb, xs, st, y + r, ldy,      \
                                           piece, rows, 6); break;                             \
                case 7: int_##name##_piece(p, row_bytes, s0, s1, nb, xs, st, y + r, ldy,      \
                                           piece, rows, 7); break;                             \
                default: int_##name##_piece(p, row_bytes, s0, s1, nb, xs, st, y + r, ldy,     \
                                            piece, rows, 8); break;                            \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
    }
INT_MANY(q4_K)
INT_MANY(q6_K)

/* ---- Q4_K and Q6_K on integer products (AVX2) ------------------------------------------
 * The AVX2 float kernels above are bound by widening and converting every weight (about 3.5
 * cycles per 8 weights per row on Zen 3, where llama.cpp's 8-bit dots decode the same file
 * at twice pagecli's rate). As on AVX-512 VNNI, each input row is split per super-block into
 * two int16 parts, x = s * (A + B * 2^-15) (split2_x: the same bounds as split_x, in the
 * values' own order), and each weight's integer (q * sc for Q4_K, (q - 32) * sc for Q6_K)
 * multiplies A and B exactly with vpmaddwd (16 products, 8 int32 sums a instruction). A
 * super-block's sums are exact integers, converted and scaled by d * s once; Q4_K's minimums
 * come from the sub-blocks' sums of x. The kernel tests hold it to the float kernels'
 * float64 tolerance. Every input row takes the same function, one weight row at a time, so
 * a row's output has the same bits at 1 input row as at any other count. */

/* The split of x in the values' own order, a scale per group of `values` (256 for the
 * K-quants, 32 for the 32-value formats of quant_q4_q8.c): struct int_split; -1 where a value
 * is not finite or a scale leaves float32's normal range. */
TARGET_AVX2 int pagecli_split2_groups(const float *x, int64_t groups, int values,
                                      const struct int_split *out) {
    const __m256 sign = _mm256_set1_ps(-0.0f), limit = _mm256_set1_ps(FLT_MAX);
    const __m256 wide = _mm256_set1_ps(32768.0f);
    for (int64_t s = 0; s < groups; s++) {
        const float *xs = x + s * values;
        __m256 most = _mm256_setzero_ps();
        for (int i = 0; i < values; i += 8) {
            const __m256 v = _mm256_andnot_ps(sign, _mm256_loadu_ps(xs + i));
            if (_mm256_movemask_ps(_mm256_cmp_ps(v, limit, _CMP_LE_OQ)) != 0xFF) return -1;
            most = _mm256_max_ps(most, v);
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(most), _mm256_extractf128_ps(most, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        const float top = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
        int e = 0;
        if (top > 0.0f) frexpf(top, &e);
        const int shift = e - SPLIT_HALF_BITS;
        if (top > 0.0f && (shift < -100 || shift > 100)) return -1;
        const __m256 inv = _mm256_set1_ps(ldexpf(1.0f, -shift));
        out->scale[s] = ldexpf(1.0f, shift);
        int16_t *a = out->a + s * values, *b = out->b + s * values;
        for (int j = 0; j < values / 32; j++) {
            __m256i ai[4], bi[4];
            __m256 sum = _mm256_setzero_ps();
            for (int q = 0; q < 4; q++) {
                const __m256 xv = _mm256_loadu_ps(xs + 32 * j + 8 * q);
                sum = _mm256_add_ps(sum, xv);
                const __m256 v = _mm256_mul_ps(xv, inv); /* exact: a power of two */
                const __m256 hi = _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                const __m256 lo = _mm256_round_ps(_mm256_mul_ps(_mm256_sub_ps(v, hi), wide),
                                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                ai[q] = _mm256_cvtps_epi32(hi);
                bi[q] = _mm256_cvtps_epi32(lo);
            }
            out->sums[s * (values / 32) + j] = hsum256(sum);
            for (int q = 0; q < 4; q += 2) { /* |values| <= 2^14: the packs never saturate */
                const __m256i pa = /* packs interleave the 128-bit halves: put them back */
                    _mm256_permute4x64_epi64(_mm256_packs_epi32(ai[q], ai[q + 1]), 0xD8);
                const __m256i pb =
                    _mm256_permute4x64_epi64(_mm256_packs_epi32(bi[q], bi[q + 1]), 0xD8);
                _mm256_storeu_si256((__m256i *)(a + 32 * j + 8 * q), pa);
                _mm256_storeu_si256((__m256i *)(b + 32 * j + 8 * q), pb);
            }
        }
    }
    return 0;
}

TARGET_AVX2 static int split2_x(const float *x, int64_t num_blocks, const struct int_split *out) {
    return pagecli_split2_groups(x, num_blocks, QK_K, out);
}

/* acc[i] += scale_i * d * (SA + SB * 2^-15) for a super-block's int32 sums of input i. */
#define INT2_SCALE(ia, ib, d, i)                                                               \
    do {                                                                                       \
        const float ds_ = (d) * xs[i].scale[s]; /* exact: f16 times a power of two */          \
        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia), _mm256_set1_ps(ds_), acc[i]);         \
        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ib), _mm256_set1_ps(ds_ * 0x1p-15f), acc[i]); \
    } while (0)

/* accm[i] += dmin * m_j * (sum of input i's sub-block j), the eight j as lanes: the minimum's
 * part of super-block s, for Q4_K's and Q5_K's integer kernels. */
TARGET_AVX2 static inline __attribute__((always_inline)) void
int2_mins(f16_bits dmin, const uint32_t mw[2], const struct int_split *xs, int64_t s,
          const int M, __m256 *accm) {
    const __m256 ms = _mm256_mul_ps(
        _mm256_set1_ps(_cvtsh_ss(dmin)),
        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const void *)mw))));
    for (int i = 0; i < M; i++)
        accm[i] = _mm256_fmadd_ps(ms, _mm256_loadu_ps(xs[i].sums + 8 * s), accm[i]);
}

/* Q4_K and Q5_K (their blocks differ only in Q5_K's qh, the fifth bit of each value: bit j
 * of qh[l] for value l of sub-block j): each weight's q * sc made once for all the inputs
 * (VPMULLW), then multiplied with both int16 parts of each input. Per super-block at most 32
 * products of |q * sc| <= 31 * 63 (Q4_K: 15 * 63) and |A|, |B| <= 2^14 per int32 lane
 * (1.03e9 < 2^31). */
#define INT2_K45_BODY(type, FIFTH)                                                             \
    const type *blocks = row;                                                                  \
    const int l2 = pagecli_quant_prefetch_l2; /* the rows after this one, PREFETCH_BYTES on */ \
    const __m256i nib = _mm256_set1_epi16(0x0F), five = _mm256_set1_epi16(0x10);               \
    (void)five;                                                                                \
    __m256 acc[INT_ROWS_MAX], accm[INT_ROWS_MAX];                                              \
    for (int i = 0; i < M; i++) acc[i] = accm[i] = _mm256_setzero_ps();                        \
    for (int64_t s = 0; s < nb; s++) {                                                         \
        const type *b = blocks + s;                                                            \
        for (int p = 0; p < (int)sizeof(type); p += 64)                                        \
            prefetch_w(l2, (const char *)b + PREFETCH_BYTES + p);                              \
        uint32_t scw[2], mw[2];                                                                \
        k_scale_words(b->scales, scw, mw);                                                     \
        uint8_t sc[8];                                                                         \
        memcpy(sc, scw, sizeof sc);                                                            \
        uint32_t sw[8]; /* each scale in both words: broadcast from memory, no shuffle */      \
        for (int j = 0; j < 8; j++) sw[j] = sc[j] * 0x10001u;                                  \
        int2_mins(b->dmin, mw, xs, s, M, accm);                                                \
        FIFTH(b, hq4) /* Q5_K: qh of values 16h..16h+15 as words, times 16 */                 \
        __m256i ia[INT_ROWS_MAX], ib[INT_ROWS_MAX];                                            \
        for (int i = 0; i < M; i++) ia[i] = ib[i] = _mm256_setzero_si256();                    \
        for (int j = 0; j < 8; j += 2) {                                                       \
            const __m256i s0 = _mm256_castps_si256(_mm256_broadcast_ss((const float *)&sw[j])); \
            const __m256i s1 =                                                                 \
                _mm256_castps_si256(_mm256_broadcast_ss((const float *)&sw[j + 1]));           \
            for (int h = 0; h < 32; h += 16) {                                                 \
                const __m256i q = _mm256_cvtepu8_epi16(                                        \
                    _mm_loadu_si128((const __m128i *)(b->qs + 16 * j + h)));                   \
                __m256i q0 = _mm256_and_si256(q, nib), q1 = _mm256_srli_epi16(q, 4);           \
                FIFTH##_PUT(hq4[h / 16], j, q0, q1)                                            \
                const __m256i w0 = _mm256_mullo_epi16(q0, s0);                                 \
                const __m256i w1 = _mm256_mullo_epi16(q1, s1);                                 \
                const int64_t o0 = s * QK_K + 32 * j + h, o1 = o0 + 32;                        \
                for (int i = 0; i < M; i++) {                                                  \
                    const int16_t *A = xs[i].a, *B = xs[i].b;                                  \
                    ia[i] = _mm256_add_epi32(                                                  \
                        ia[i], _mm256_madd_epi16(w0, _mm256_loadu_si256((const void *)(A + o0)))); \
                    ib[i] = _mm256_add_epi32(                                                  \
                        ib[i], _mm256_madd_epi16(w0, _mm256_loadu_si256((const void *)(B + o0)))); \
                    ia[i] = _mm256_add_epi32(                                                  \
                        ia[i], _mm256_madd_epi16(w1, _mm256_loadu_si256((const void *)(A + o1)))); \
                    ib[i] = _mm256_add_epi32(                                                  \
                        ib[i], _mm256_madd_epi16(w1, _mm256_loadu_si256((const void *)(B + o1)))); \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
        const float d = _cvtsh_ss(b->d);                                                       \
        for (int i = 0; i < M; i++) INT2_SCALE(ia[i], ib[i], d, i);                            \
    }                                                                                          \
    for (int i = 0; i < M; i++) out[i] = hsum256(acc[i]) - hsum256(accm[i]);

/* Q4_K has no fifth bits; Q5_K's bit j of each value lands on bit 4 after a right shift by j */
#define NO_FIFTH(b, hq4)
#define NO_FIFTH_PUT(hi, j, q0, q1)
#define FIFTH_BITS(b, hq4)                                                                     \
    const __m256i hq4[2] = {                                                                   \
        _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)b->qh)), 4),   \
        _mm256_slli_epi16(                                                                     \
            _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(b->qh + 16))), 4)};
#define FIFTH_BITS_PUT(hi, j, q0, q1)                                                          \
    q0 = _mm256_or_si256(q0, _mm256_and_si256(_mm256_srl_epi16(hi, _mm_cvtsi32_si128(j)), five)); \
    q1 = _mm256_or_si256(q1,                                                                   \
                         _mm256_and_si256(_mm256_srl_epi16(hi, _mm_cvtsi32_si128(j + 1)), five));

TARGET_AVX2 static inline __attribute__((always_inline)) void
int2_q4_K_m(const void *row, int64_t nb, const struct int_split *xs, float *out, const int M) {
    INT2_K45_BODY(block_q4_K, NO_FIFTH)
}

TARGET_AVX2 static inline __attribute__((always_inline)) void
int2_q5_K_m(const void *row, int64_t nb, const struct int_split *xs, float *out, const int M) {
    INT2_K45_BODY(block_q5_K, FIFTH_BITS)
}

/* Q4_K under int_dots on (int2s): each sub-block's products q * A and q * B (q <= 15, |A|,
 * |B| <= 2^14) are summed as integers without its scale (|sum| <= 32 * 15 * 2^14 < 2^23, so
 * exact in float32 too), the eight sums gathered into one vector, converted, and multiplied
 * by d * sc * s (exact: an f16 times a 6-bit integer times a power of two) into a float32
 * accumulator a sub-block (FMA: one rounding a part). At one input row this is 1.08-1.34x
 * as fast as int2_q4_K_m above, whose VPMULLW of each weight by its scale is work for AVX2's
 * multipliers; from two rows on it is 0.78-0.95x as fast (the gathering is done for every
 * input, the scaling once for all; one thread, a Zen 3, benchmarks/RESULTS.md). A row must
 * have one kernel's bits at every batch, so auto takes int2_q4_K_m, and engines of one
 * sequence at a time, whose decode steps are one row, run under on
 * (engine/spec_decode/invariance.py). */
TARGET_AVX2 static inline __attribute__((always_inline)) __m256i int2_pair(__m256i p, __m256i q) {
    /* [p, q, p, q | p, q, p, q]: two sub-blocks' eight lanes each summed to four */
    return _mm256_add_epi32(_mm256_unpacklo_epi32(p, q), _mm256_unpackhi_epi32(p, q));
}

TARGET_AVX2 static inline __attribute__((always_inline)) __m256i
int2_gather8(__m256i h0, __m256i h1, __m256i h2, __m256i h3) {
    /* h_k = int2_pair(sub-block 2k, sub-block 2k + 1): the eight sub-blocks' sums in order
     * (unpacks and adds: VPHADDD was slower on a Zen 3) */
    const __m256i x =
        _mm256_add_epi32(_mm256_unpacklo_epi64(h0, h1), _mm256_unpackhi_epi64(h0, h1));
    const __m256i y =
        _mm256_add_epi32(_mm256_unpacklo_epi64(h2, h3), _mm256_unpackhi_epi64(h2, h3));
    return _mm256_add_epi32(_mm256_permute2x128_si256(x, y, 0x20),
                            _mm256_permute2x128_si256(x, y, 0x31));
}

TARGET_AVX2 static inline __attribute__((always_inline)) void
int2s_q4_K_m(const void *row, int64_t nb, const struct int_split *xs, float *out, const int M) {
    const block_q4_K *blocks = row;
    const int l2 = pagecli_quant_prefetch_l2; /* the rows after this one, PREFETCH_BYTES on */
    const __m256i nib = _mm256_set1_epi16(0x0F);
    __m256 acc[INT_ROWS_MAX], accm[INT_ROWS_MAX];
    for (int i = 0; i < M; i++) acc[i] = accm[i] = _mm256_setzero_ps();
    for (int64_t s = 0; s < nb; s++) {
        const block_q4_K *b = blocks + s;
        for (int p = 0; p < (int)sizeof(block_q4_K); p += 64)
            prefetch_w(l2, (const char *)b + PREFETCH_BYTES + p);
        uint32_t scw[2], mw[2];
        k_scale_words(b->scales, scw, mw);
        int2_mins(b->dmin, mw, xs, s, M, accm);
        __m256i ha[INT_ROWS_MAX][4], hb[INT_ROWS_MAX][4];
        for (int j = 0; j < 8; j += 2) {
            __m256i pa0[INT_ROWS_MAX], pb0[INT_ROWS_MAX], pa1[INT_ROWS_MAX], pb1[INT_ROWS_MAX];
            for (int i = 0; i < M; i++) pa0[i] = pb0[i] = pa1[i] = pb1[i] = _mm256_setzero_si256();
            for (int h = 0; h < 32; h += 16) {
                const __m256i q =
                    _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(b->qs + 16 * j + h)));
                const __m256i w0 = _mm256_and_si256(q, nib), w1 = _mm256_srli_epi16(q, 4);
                const int64_t o0 = s * QK_K + 32 * j + h, o1 = o0 + 32;
                for (int i = 0; i < M; i++) {
                    const int16_t *A = xs[i].a, *B = xs[i].b;
                    pa0[i] = _mm256_add_epi32(
                        pa0[i], _mm256_madd_epi16(w0, _mm256_loadu_si256((const void *)(A + o0))));
                    pb0[i] = _mm256_add_epi32(
                        pb0[i], _mm256_madd_epi16(w0, _mm256_loadu_si256((const void *)(B + o0))));
                    pa1[i] = _mm256_add_epi32(
                        pa1[i], _mm256_madd_epi16(w1, _mm256_loadu_si256((const void *)(A + o1))));
                    pb1[i] = _mm256_add_epi32(
                        pb1[i], _mm256_madd_epi16(w1, _mm256_loadu_si256((const void *)(B + o1))));
                }
            }
            for (int i = 0; i < M; i++) {
                ha[i][j / 2] = int2_pair(pa0[i], pa1[i]);
                hb[i][j / 2] = int2_pair(pb0[i], pb1[i]);
            }
        }
        const __m256 dsc = _mm256_mul_ps(
            _mm256_set1_ps(_cvtsh_ss(b->d)),
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const void *)scw))));
        for (int i = 0; i < M; i++) {
            const __m256 da = _mm256_mul_ps(dsc, _mm256_set1_ps(xs[i].scale[s])); /* exact */
            const __m256i za = int2_gather8(ha[i][0], ha[i][1], ha[i][2], ha[i][3]);
            const __m256i zb = int2_gather8(hb[i][0], hb[i][1], hb[i][2], hb[i][3]);
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(za), da, acc[i]);
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(zb),
                                     _mm256_mul_ps(da, _mm256_set1_ps(0x1p-15f)), acc[i]);
        }
    }
    for (int i = 0; i < M; i++) out[i] = hsum256(acc[i]) - hsum256(accm[i]);
}

/* Q6_K: |(q - 32) * sc| <= 4096, so a lane takes at most 16 products (a half's) before it
 * is converted: 2^30. */
TARGET_AVX2 static inline __attribute__((always_inline)) void
int2_q6_K_m(const void *row, int64_t nb, const struct int_split *xs, float *out, const int M) {
    const block_q6_K *blocks = row;
    const int l2 = pagecli_quant_prefetch_l2;
    const __m256i nib = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8(0x30);
    const __m256i bias = _mm256_set1_epi8(32);
    __m256 acc[INT_ROWS_MAX];
    for (int i = 0; i < M; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t s = 0; s < nb; s++) {
        const block_q6_K *b = blocks + s;
        for (int p = 0; p < (int)sizeof(block_q6_K); p += 64)
            prefetch_w(l2, (const char *)b + PREFETCH_BYTES + p);
        const float d = _cvtsh_ss(b->d);
        uint32_t sw[16]; /* each (signed) scale in both words, broadcast from memory */
        for (int j = 0; j < 16; j++) sw[j] = (uint16_t)b->scales[j] * 0x10001u;
        for (int h = 0; h < 2; h++) {
            const uint8_t *ql = b->ql + 64 * h, *qh = b->qh + 32 * h;
            const __m256i l0 = _mm256_loadu_si256((const __m256i *)ql);
            const __m256i l1 = _mm256_loadu_si256((const __m256i *)(ql + 32));
            const __m256i hv = _mm256_loadu_si256((const __m256i *)qh);
            /* the 32 values g of the half (q6_32_bytes' order), 0..63 in bytes (32 is taken
             * off below); the 16-bit shifts' crossings are masked off */
            const __m256i v[4] = {
                _mm256_or_si256(_mm256_and_si256(l0, nib),
                                _mm256_and_si256(_mm256_slli_epi16(hv, 4), top)),
                _mm256_or_si256(_mm256_and_si256(l1, nib),
                                _mm256_and_si256(_mm256_slli_epi16(hv, 2), top)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), nib),
                                _mm256_and_si256(hv, top)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), nib),
                                _mm256_and_si256(_mm256_srli_epi16(hv, 2), top))};
            __m256i ia[INT_ROWS_MAX], ib[INT_ROWS_MAX];
            for (int i = 0; i < M; i++) ia[i] = ib[i] = _mm256_setzero_si256();
            for (int g = 0; g < 4; g++) {
                const __m256i q = _mm256_sub_epi8(v[g], bias);
                const __m128i half[2] = {_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)};
                for (int k = 0; k < 2; k++) {
                    const __m256i sc = _mm256_castps_si256(
                        _mm256_broadcast_ss((const float *)&sw[8 * h + 2 * g + k]));
                    const __m256i w = _mm256_mullo_epi16(_mm256_cvtepi8_epi16(half[k]), sc);
                    const int64_t o = s * QK_K + 128 * h + 32 * g + 16 * k;
                    for (int i = 0; i < M; i++) {
                        const __m256i a = _mm256_loadu_si256((const void *)(xs[i].a + o));
                        const __m256i bv = _mm256_loadu_si256((const void *)(xs[i].b + o));
                        ia[i] = _mm256_add_epi32(ia[i], _mm256_madd_epi16(w, a));
                        ib[i] = _mm256_add_epi32(ib[i], _mm256_madd_epi16(w, bv));
                    }
                }
            }
            for (int i = 0; i < M; i++) INT2_SCALE(ia[i], ib[i], d, i);
        }
    }
    for (int i = 0; i < M; i++) out[i] = hsum256(acc[i]);
}

INT_ROWS_DISPATCH(TARGET_AVX2, int2, q4_K)
INT_ROWS_DISPATCH(TARGET_AVX2, int2, q6_K)
INT_ROWS_DISPATCH(TARGET_AVX2, int2s, q4_K)
INT_ROWS_DISPATCH(TARGET_AVX2, int2, q5_K)
INT_WIDE_SEQUENTIAL(TARGET_AVX2, int2, q4_K)
INT_WIDE_SEQUENTIAL(TARGET_AVX2, int2, q6_K)
INT_WIDE_SEQUENTIAL(TARGET_AVX2, int2s, q4_K)
INT_WIDE_SEQUENTIAL(TARGET_AVX2, int2, q5_K)

#define PATHS(name)                                                                            \
    {dequant_##name##_portable, dequant_##name##_avx2, dequant_##name##_avx512},               \
        {NULL, rows_##name##_avx2, rows_##name##_avx512},                                      \
        {NULL, wide_##name##_avx2, wide_##name##_avx512}
#else
#define PATHS(name) {dequant_##name##_portable, NULL, NULL}, {NULL, NULL, NULL}
#endif

#if QUANT_X86
/* VNNI's integer path (batch 1, 2-8 rows), the small-batch and half-sum kernels, AVX2's
 * integer path, and Q4_K's AVX2 kernels under int_dots on */
#define X86_PATHS(name)                                                                        \
    .split = split_x_##name, .int_wide = int_wide_##name, .int_many = int_many_##name,       \
    .small = small_##name##_avx512, .many = many_##name##_avx512, INT2(name)
#define INT2(name) .split2 = split2_x, .int_rows2 = int2_rows_##name, .int_wide2 = int2_wide_##name
#define INT2_ON(name) .int_rows2_on = int2s_rows_##name, .int_wide2_on = int2s_wide_##name
#else
#define X86_PATHS(name) .split = NULL
#define INT2(name) .split2 = NULL
#define INT2_ON(name) .int_rows2_on = NULL
#endif

const struct quant_format FORMAT_Q4_K = {QT_Q4_K, QK_K, sizeof(block_q4_K), PATHS(q4_K),
                                         X86_PATHS(q4_K), INT2_ON(q4_K)};
const struct quant_format FORMAT_Q5_K = {QT_Q5_K, QK_K, sizeof(block_q5_K), PATHS(q5_K),
                                         INT2(q5_K)};
const struct quant_format FORMAT_Q6_K = {QT_Q6_K, QK_K, sizeof(block_q6_K), PATHS(q6_K),
                                         X86_PATHS(q6_K)};
