/*
 * AMX's tiles, shared by the files that use them (gemm_bf16.c: bfloat16 weights;
 * gemm_quant_amx.c: GGUF blocks): whether the build can, the target attribute, one tile
 * configuration (eight 16 x 64-byte tiles), and the barrier that orders tile instructions
 * against C's loads and stores. Whether the CPU and kernel grant the tiles is decided once
 * in gemm_bf16.c (pagecli_bf16_tiles).
 */
#ifndef PAGECLI_AMX_H
#define PAGECLI_AMX_H

#include <stdint.h>

#include "quant_blocks.h"

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

#endif
