/*
 * float32 GEMM for the panel path (gemm_f32.c): x packed once per call into token strips,
 * then each thread multiplies its panels of W's rows with all of them. gemm_bf16.c packs
 * bfloat16 pairs as 32-bit values with the same gemm_pack_x and sweeps its own micro-kernel
 * over them with gemm_sweep.
 */
#ifndef PAGECLI_GEMM_F32_H
#define PAGECLI_GEMM_F32_H

#include <stdint.h>

#define GEMM_ROWS 12   /* W rows per micro-block (a micro-kernel's sums) */
#define GEMM_TOKENS 32 /* input rows per strip and micro-block (two 16-float vectors) */

/* The micro-kernels' dispatch on the rows of a micro-block: KERNEL(..., R) with R a constant
 * 1..GEMM_ROWS, so that each count gets its own copy with the sums in registers. */
#define GEMM_ROWS_SWITCH(rows, KERNEL, ...)                                                    \
    switch (rows) {                                                                            \
    case 1: KERNEL(__VA_ARGS__, 1); break;                                                     \
    case 2: KERNEL(__VA_ARGS__, 2); break;                                                     \
    case 3: KERNEL(__VA_ARGS__, 3); break;                                                     \
    case 4: KERNEL(__VA_ARGS__, 4); break;                                                     \
    case 5: KERNEL(__VA_ARGS__, 5); break;                                                     \
    case 6: KERNEL(__VA_ARGS__, 6); break;                                                     \
    case 7: KERNEL(__VA_ARGS__, 7); break;                                                     \
    case 8: KERNEL(__VA_ARGS__, 8); break;                                                     \
    case 9: KERNEL(__VA_ARGS__, 9); break;                                                     \
    case 10: KERNEL(__VA_ARGS__, 10); break;                                                   \
    case 11: KERNEL(__VA_ARGS__, 11); break;                                                   \
    default: KERNEL(__VA_ARGS__, GEMM_ROWS); break;                                            \
    }

/* Floats of packed x for m rows of k values. */
static inline int64_t gemm_packed_floats(int64_t m, int64_t k) {
    return (m + GEMM_TOKENS - 1) / GEMM_TOKENS * GEMM_TOKENS * k;
}

int gemm_reserve(float **buf, int64_t *cap, int64_t need);
void gemm_pack_x(int isa, const float *x, int64_t ldx, int64_t m, int64_t k, float *xt,
                 int64_t strip);
/* sums[r * GEMM_TOKENS + j] = the dot product of packed token j with w's row r (rows ldw
 * values apart) over k 32-bit values, for r < rows <= GEMM_ROWS and j < tokens <= GEMM_TOKENS
 * (the strip's tokens; a kernel may compute zero sums past them, or leave them); with
 * `accumulate`, added to the sums already there as if their k values had come first (the
 * next chunks of one sum) */
typedef void (*gemm_micro_fn)(const float *xt, const float *w, int64_t ldw, int64_t k, int rows,
                              int tokens, float *sums, int accumulate);
void gemm_write_sums(int isa, const float *sums, int rows, int64_t tokens, float *y,
                     int64_t ldy);
void gemm_sweep(int isa, gemm_micro_fn micro, gemm_micro_fn micro_half, const float *xt,
                int64_t m, int64_t k, const float *w, int64_t ldw, int64_t count, float *y,
                int64_t ldy);
void gemm_panel(int isa, const float *xt, int64_t m, int64_t k, const float *w, int64_t ldw,
                int64_t count, float *y, int64_t ldy);

#endif
