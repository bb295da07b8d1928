/*
 * bfloat16 <-> float32 as torch converts them, for the files of csrc/ that work in bfloat16.
 */
#ifndef PAGECLI_BF16_H
#define PAGECLI_BF16_H

#include <stdint.h>
#include <string.h>

/* widening: exact (a bfloat16 is the top half of a float32) */
static inline __attribute__((always_inline)) float bf16_to_f32(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* rounding to nearest even; a NaN stays a NaN (quieted) */
static inline __attribute__((always_inline)) uint16_t f32_to_bf16(float f) {
    uint32_t w;
    memcpy(&w, &f, sizeof w);
    if ((w & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((w >> 16) | 0x40);
    w += 0x7fffu + ((w >> 16) & 1);
    return (uint16_t)(w >> 16);
}

#endif
