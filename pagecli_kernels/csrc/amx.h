/*
 * AMX's tiles, shared by the files that use them (gemm_bf16.c: bfloat16 weights;
 * gemm_quant_amx.c: GGUF blocks): whether the build can, the target attribute, one tile
 * configuration (eight 16 x 64-byte tiles), and the barrier that orders tile instructions
 * against C's loads and stores. Whether the CPU and kernel grant the tiles is decided once
 * in cpu_features.c (cpu_features()->amx_granted).
 */
#ifndef PAGECLI_AMX_H
#define PAGECLI_AMX_H

#include <stdint.h>

#include "quant_blocks.h"

#include "gemm_f32.h"

/* AMX's tile intrinsics: GCC 11 and clang 12 on, 64-bit Linux (the kernel grants the tiles'
 * state to a process that asks, Linux 5.16 on) */
#if QUANT_X86 && defined(__linux__) && defined(__x86_64__) &&                                  \
    (__clang_major__ >= 12 || (!defined(__clang__) && __GNUC__ >= 11))
#define AMX_X86 1
#include <immintrin.h>
#define TARGET_AMX                                                                             \
    __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx2,fma,f16c")))

/* Every tile 16 rows of 64 bytes: as float32 sums, 16 x 16; as bfloat16, 16 x 32 (pairs). */
static const struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((aligned(64))) amx_tile_config = {
    .palette = 1,
    .colsb = {64, 64, 64, 64, 64, 64, 64, 64},
    .rows = {16, 16, 16, 16, 16, 16, 16, 16},
};

/* Configure the tiles for this thread, and give them back (their state is large). */
TARGET_AMX static inline void amx_begin(void) { _tile_loadconfig(&amx_tile_config); }
TARGET_AMX static inline void amx_end(void) { _tile_release(); }
#else
#define AMX_X86 0
#endif

/* The tile instructions are asm statements that name no memory: order them against the C
 * code's stores and loads of the same buffers. */
#define MEMORY_BARRIER() __asm__ volatile("" ::: "memory")

#if AMX_X86
/* A micro-block of 32 W rows x GEMM_TOKENS tokens keeps its float32 sums in tmm0-3 (rows 0-15
 * and 16-31, tokens 0-15 and 16-31); tmm4-5 hold 16 pairs of k of W's rows 0-15 and 16-31.
 * amx_products adds their products with 16 pairs of the packed input at b (32-bit pairs,
 * GEMM_TOKENS to a row: gemm_pack_x's token strips, or a part of a block in gemm_quant_amx.c's
 * packing): tokens 0-15 into tmm6, 16-31 into tmm7, four TDPBF16PS. */
TARGET_AMX static inline void amx_products(const uint32_t *b) {
    _tile_loadd(6, b, GEMM_TOKENS * 4);
    _tile_loadd(7, b + 16, GEMM_TOKENS * 4);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
}

/* tmm0-3 into sums as gemm_sweep's micro-kernels leave theirs (W row r, token j at
 * r * GEMM_TOKENS + j), ordered before the C code reads them. */
TARGET_AMX static inline void amx_store_sums(float *sums) {
    _tile_stored(0, sums, GEMM_TOKENS * 4);
    _tile_stored(1, sums + 16, GEMM_TOKENS * 4);
    _tile_stored(2, sums + 16 * GEMM_TOKENS, GEMM_TOKENS * 4);
    _tile_stored(3, sums + 16 * GEMM_TOKENS + 16, GEMM_TOKENS * 4);
    MEMORY_BARRIER();
}

/* y[j][r] = sums[r * GEMM_TOKENS + j] for r < rows <= 32, j < tokens: gemm_f32.c's writer, for
 * each half of the micro-block's rows. */
static inline void amx_write_sums(const float *sums, int rows, int64_t tokens, float *y,
                                  int64_t ldy) {
    gemm_write_sums(ISA_AVX512, sums, rows < 16 ? rows : 16, tokens, y, ldy);
    if (rows > 16)
        gemm_write_sums(ISA_AVX512, sums + 16 * GEMM_TOKENS, rows - 16, tokens, y + 16, ldy);
}
#endif

#endif
