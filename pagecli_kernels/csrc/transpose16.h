/*
 * A 16 x 16 transpose of 32-bit values in AVX-512 registers, for the files that need one
 * (gemm_f32.c's packer and sums writer, paged_attention_cpu.c's bfloat16 keys). Include it
 * after <immintrin.h>, on x86 only. Its target is plain AVX-512F, which every AVX-512 path's
 * own target includes, so it inlines into each.
 */
#ifndef PAGECLI_TRANSPOSE16_H
#define PAGECLI_TRANSPOSE16_H

#define TRANSPOSE16_FN                                                                         \
    __attribute__((target("avx512f"))) static inline __attribute__((always_inline))

/* r[i] (16 rows of 16) transposed in place. */
TRANSPOSE16_FN void transpose16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++)
        for (int h = 0; h < 2; h++) {
            const __m512d a = _mm512_castps_pd(t[4 * i + h]);
            const __m512d b = _mm512_castps_pd(t[4 * i + h + 2]);
            r[4 * i + 2 * h] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
            r[4 * i + 2 * h + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
        }
    /* lanes now hold 4x4 transposed quads; move the 128-bit quads across the 4 row groups */
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
        r[i + 4] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0x88);
        r[i + 12] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0xdd);
    }
}

#endif
