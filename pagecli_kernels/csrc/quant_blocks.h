/*
 * GGUF block formats for the CPU's quantized linear kernels: each block struct declared once,
 * the f16 conversion, and the per-format entry points that quant_linear_cpu.c dispatches to.
 *
 * A format's kernels only dequantize: they turn whole blocks into float32 values, exactly
 * those of gguf.quants.dequantize (every value is an f16 scale times a small integer, or two
 * such products' difference, computed in the same order; an FMA is used only where its
 * product is exact in float32, so it rounds as the separate operations do; the dequantization
 * tests check every format bit for bit). The activations are never quantized; the driver
 * multiplies the float32 weights with them (batches on AMX's tiles multiply the weights'
 * scale * q + offset unrounded instead, gemm_quant_amx.c).
 *
 * Layouts follow ggml (ggml-common.h); QK_K = 256 values per K-quant super-block.
 */
#ifndef PAGECLI_QUANT_BLOCKS_H
#define PAGECLI_QUANT_BLOCKS_H

#include <stdint.h>
#include <string.h>

#include "cpu_features.h"

#define QK4_0 32
#define QK4_1 32
#define QK5_0 32
#define QK5_1 32
#define QK8_0 32
#define QK_K 256
#define K_SCALE_SIZE 12

typedef uint16_t f16_bits;

typedef struct __attribute__((packed)) {
    f16_bits d;          /* scale */
    int8_t qs[QK8_0];    /* value = d * qs[j] */
} block_q8_0;            /* 34 bytes */

typedef struct __attribute__((packed)) {
    f16_bits d;
    uint8_t qs[QK4_0 / 2]; /* value j: d * ((qs[j] & 15) - 8); j + 16: d * ((qs[j] >> 4) - 8) */
} block_q4_0;              /* 18 bytes */

typedef struct __attribute__((packed)) {
    f16_bits d, m;         /* value j: d * (qs[j] & 15) + m; j + 16: d * (qs[j] >> 4) + m */
    uint8_t qs[QK4_1 / 2];
} block_q4_1;              /* 20 bytes */

/* IQ4_NL: Q4_0's layout, each 4-bit index into a fixed non-linear table (ggml's
 * kvalues_iq4nl): value j: d * IQ4_NL_VALUES[qs[j] & 15]; j + 16: [qs[j] >> 4] */
typedef struct __attribute__((packed)) {
    f16_bits d;
    uint8_t qs[QK4_0 / 2];
} block_iq4_nl; /* 18 bytes */
static const int8_t IQ4_NL_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                         1,    13,   25,  38,  53,  69,  89,  113};

/* IQ4_XS: super-blocks of 256 values, 8 sub-blocks of 32 as IQ4_NL's (the same table and
 * nibble order) with a 6-bit scale each: sub-block s's value j is
 * (d * (ls_s - 32)) * IQ4_NL_VALUES[q], ls_s = low nibble s of scales_l (s / 2's byte, high
 * nibble for odd s) | bits 2s..2s+1 of scales_h << 4. d * (ls - 32) is exact in float32
 * (an f16 times a 6-bit integer); its product with the level is rounded once, as ggml's
 * and gguf's dequantization round it. */
typedef struct __attribute__((packed)) {
    f16_bits d;
    uint16_t scales_h;
    uint8_t scales_l[QK_K / 64];
    uint8_t qs[QK_K / 2]; /* sub-block s: qs[16 s + j] low nibble value j, high j + 16 */
} block_iq4_xs;           /* 136 bytes */

/* sub-block s's scale of an IQ4_XS super-block: d * (ls - 32) */
static inline float iq4_xs_scale(const block_iq4_xs *b, float d, int s) {
    const int low = (b->scales_l[s / 2] >> (4 * (s % 2))) & 0xF;
    const int high = (b->scales_h >> (2 * s)) & 3;
    return d * (float)((low | high << 4) - 32);
}

/* MXFP4 (gpt-oss's experts): an E8M0 exponent and 32 FP4 (E2M1) values as Q4_0's nibbles;
 * value j: d * MXFP4_VALUES[q] with d = e8m0_half(e), a power of two (exact products) */
typedef struct __attribute__((packed)) {
    uint8_t e;
    uint8_t qs[QK4_0 / 2];
} block_mxfp4; /* 17 bytes */
static const int8_t MXFP4_VALUES[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* ggml's ggml_e8m0_to_fp32_half: 2^(e - 128) (the E2M1 values above are doubled) */
static inline float e8m0_half(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* The 5-bit formats: value j's low 4 bits as in Q4_0/Q4_1 (qs[j] & 15 for j < 16, else
 * qs[j - 16] >> 4), its fifth bit bit j of qh (a little-endian uint32). */
typedef struct __attribute__((packed)) {
    f16_bits d;
    uint8_t qh[4];
    uint8_t qs[QK5_0 / 2]; /* value j: d * (q_j - 16) */
} block_q5_0;              /* 22 bytes */

typedef struct __attribute__((packed)) {
    f16_bits d, m;
    uint8_t qh[4];
    uint8_t qs[QK5_1 / 2]; /* value j: d * q_j + m */
} block_q5_1;              /* 24 bytes */

typedef struct __attribute__((packed)) {
    f16_bits d, dmin;             /* super-block scales of the 6-bit sub-block scales/mins */
    uint8_t scales[K_SCALE_SIZE]; /* 8 sub-blocks of 32: 6-bit scale and min each */
    uint8_t qs[QK_K / 2];         /* 4-bit values; 32 bytes hold sub-blocks 2i (low), 2i+1 */
} block_q4_K;                     /* 144 bytes */

typedef struct __attribute__((packed)) {
    f16_bits d, dmin;
    uint8_t scales[K_SCALE_SIZE];
    uint8_t qh[QK_K / 8];  /* bit i of qh[l]: the fifth bit of value l of sub-block i */
    uint8_t qs[QK_K / 2];
} block_q5_K;              /* 176 bytes */

typedef struct __attribute__((packed)) {
    uint8_t ql[QK_K / 2];     /* low 4 bits */
    uint8_t qh[QK_K / 4];     /* high 2 bits */
    int8_t scales[QK_K / 16]; /* one 8-bit scale per 16 values */
    f16_bits d;
} block_q6_K;                 /* 210 bytes */

/* ggml's type ids (GGMLQuantizationType), the ids Python passes in. */
enum quant_type {
    QT_F32 = 0, /* float32 rows taken as 32-value blocks (quant_f32.c) */
    QT_Q4_0 = 2,
    QT_Q4_1 = 3,
    QT_Q5_0 = 6,
    QT_Q5_1 = 7,
    QT_Q8_0 = 8,
    QT_Q4_K = 12,
    QT_Q5_K = 13,
    QT_Q6_K = 14,
    QT_IQ4_NL = 20,
    QT_IQ4_XS = 23,
    QT_MXFP4 = 39,
    QT_BF16 = 30, /* bfloat16 rows taken as 32-value blocks (quant_bf16.c) */
};

/* Exact f16 -> f32 (normals, subnormals, inf, nan), bit by bit: the portable spec. */
static inline float f16_to_f32(f16_bits h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else { /* subnormal: normalize */
        exp = 113;
        while (!(man & 0x400)) {
            man <<= 1;
            exp--;
        }
        bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* The 6-bit scale and min of sub-block j (0..7) of a Q4_K/Q5_K super-block. */
static inline void k_scale_min(int j, const uint8_t *q, uint8_t *sc, uint8_t *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* Dequantize `num_blocks` consecutive blocks into out[num_blocks * block values]. */
typedef void (*dequant_fn)(const void *blocks, float *out, int64_t num_blocks);

/* out[i] = dot(dequant(row), x[i * ldx ...]) for i < m <= ROWS_MAX: one row of W against m
 * input rows, dequantized in registers (the fused decode kernel; optional per format). A row
 * may be taken in pieces of whole blocks (row, x and num_blocks then those of the piece), so
 * that the piece of x stays in the L1: `phase` ROWS_FIRST starts the sums at zero (else they
 * are loaded from `state`, ROWS_STATE floats, 64-byte aligned), ROWS_LAST reduces them into
 * out (else they are stored back into state). The pieces of a row then add the same products
 * in the same order as one call over the whole row, so both give the same bits. */
#define ROWS_MAX 8
#define ROWS_FIRST 1
#define ROWS_LAST 2
#define ROWS_STATE (ROWS_MAX * 2 * 16)
typedef void (*rows_fn)(const void *row, int64_t num_blocks, const float *x, int64_t ldx, int m,
                        float *out, float *state, int phase);

/* out[r] = dot(dequant(W row r), x) for the WIDE_ROWS rows at w, w + row_bytes, ...: several
 * rows against one input row (decode at batch 1), their FMA chains interleaved so that none
 * waits on its own latency. Optional per format. */
#ifndef WIDE_ROWS /* -DWIDE_ROWS=n: benchmarks/kernel_variants.py builds variants */
#define WIDE_ROWS 4
#endif
typedef void (*wide_fn)(const void *w, int64_t row_bytes, int64_t num_blocks, const float *x,
                        float *out);

/* Batch-1 products on integer dot products (AVX-512 VNNI): the input row split once per
 * call into int16 parts (quant_k.c's split_x), then `rows` (<= WIDE_ROWS) rows of W at a
 * time against it. split returns nonzero where the row cannot be split (a non-finite value,
 * or magnitudes near float32's limits): the float kernels take that call. */
struct int_split {
    int16_t *a, *b; /* x = scale * (a + b * 2^-15), per super-block, in the kernel's order */
    float *scale;   /* per super-block: a power of two */
    float *sums;    /* per 32-value sub-block: the sum of x */
};
typedef int (*int_split_fn)(const float *x, int64_t num_blocks, const struct int_split *out);
typedef void (*int_wide_fn)(const void *w, int64_t row_bytes, int64_t num_blocks, int rows,
                            const struct int_split *x, float *out);

/* The AVX2 integer paths' kernels for any number of input rows (quant_k.c, quant_q4_q8.c;
 * AVX-512 VNNI's are int_many_fn, below): out[i] = dot(dequant(row), x_i) for the m <=
 * INT_ROWS_MAX inputs split into xs[0..m), one weight row at a time. The products of a
 * super-block are summed as integers (exact, in any order) and scaled per super-block in
 * float32 in the same order for every input, so an output has the same bits whatever m is
 * and whichever rows are beside it. */
#define INT_ROWS_MAX 4
typedef void (*int_rows_fn)(const void *row, int64_t num_blocks, const struct int_split *xs,
                            int m, float *out);

/* The split of the AVX2 integer paths (quant_k.c): x in the values' own order, one scale per
 * group of `values` (a multiple of 32). */
int pagecli_split2_groups(const float *x, int64_t groups, int values, const struct int_split *out);

/* The AVX-512 VNNI integer kernels for 2-8 input rows (int_many_fn): the `rows` (at most
 * INT_MANY_ROWS) rows of W at w, w + row_bytes, ... against m (2..INT_MANY_MAX) inputs split
 * as struct int_split and packed (struct int_packed), y[i * ldy + r]; each output has the
 * batch-1 bits. */
#define INT_MANY_MAX 8
#define INT_MANY_ROWS 8
#ifndef INT_PIECE_BYTES
#define INT_PIECE_BYTES 16384
#endif
struct int_packed {
    const int16_t *x;   /* super-block s, 32-value group g, input i: its 32 a parts, then its 32
                           b parts, at x + ((s * 8 + g) * m + i) * 64 (64-byte aligned) */
    const float *scale; /* scale[s * m + i] */
    const float *sums;  /* sums[(s * m + i) * 8 + j]: input i's sum over sub-block j of s */
};
typedef void (*int_many_fn)(const void *w, int64_t row_bytes, int64_t num_blocks, int rows,
                            const struct int_packed *xs, int m, float *y, int64_t ldy);

/* int_rows_fn for the kernels `prefix`_`name`_m, M = m (<= INT_ROWS_MAX) a constant each. */
#define INT_ROWS_DISPATCH(target, prefix, name)                                                \
    target static void prefix##_rows_##name(const void *row, int64_t nb,                       \
                                            const struct int_split *xs, int m, float *out) {   \
        switch (m) {                                                                           \
        case 1: prefix##_##name##_m(row, nb, xs, out, 1); break;                               \
        case 2: prefix##_##name##_m(row, nb, xs, out, 2); break;                               \
        case 3: prefix##_##name##_m(row, nb, xs, out, 3); break;                               \
        default: prefix##_##name##_m(row, nb, xs, out, 4); break;                              \
        }                                                                                      \
    }

/* int_wide_fn for the AVX2 integer kernels `prefix`_`name`_m: `rows` rows of W against one
 * input, one after another, each the rows kernel's one-input body (the same bits, without a
 * call and its bookkeeping per row: at 576 values a row, the default model's, those were a
 * fifth of Q4_1's time; side by side a block at a time, the rows' accumulators left the
 * registers: 0.9x). */
#define INT_WIDE_SEQUENTIAL(target, prefix, name)                                              \
    target static void prefix##_wide_##name(const void *w, int64_t row_bytes, int64_t nb,      \
                                            int rows, const struct int_split *xs, float *out) { \
        for (int r = 0; r < rows; r++)                                                         \
            prefix##_##name##_m((const uint8_t *)w + r * row_bytes, nb, xs, out + r, 1);       \
    }

/* The small-batch kernels (small_fn): out[i * R + r] = dot(dequant(W row r), x[i * ldx ...])
 * for the R = SMALL_ROWS(m) rows at w, w + row_bytes, ... and m = 2..SMALL_MAX_M input rows:
 * a small batch's decode, the weights dequantized once for all m inputs and each load of x
 * shared by the R rows, with the wide kernels' prefetch (WIDE_PREFETCH). Each (row, input)
 * sums in the order of the rows kernel: the same bits. */
#define SMALL_MAX_M 4
#define SMALL_ROWS(m) ((m) == 2 ? 4 : 2)
typedef void (*small_fn)(const void *w, int64_t row_bytes, int64_t num_blocks, const float *x,
                         int64_t ldx, int m, float *out);

/* The half-sum kernels (many_fn): 5-8 input rows (AVX-512), where the small-batch kernels'
 * two accumulators per (row, input) would not fit the registers, and the parts of 4-8 rows of
 * larger batches (many_parts). A call adds, for the R = MANY_ROWS(m) rows at w, w + row_bytes,
 * ... and each of the m inputs, only the products that the rows kernel adds into one of its two
 * accumulators (`half`: acc[half], the same 16-value lanes in the same order), so R * m
 * accumulators (12 at 4 inputs, 15-18 at 5-6, 14-16 at 7-8) share each load of x between R
 * rows. The two halves' sums go to `state` between calls (MANY_STATE floats, 64-byte aligned):
 * `phase` ROWS_FIRST starts them at zero, and the call of half 1 under ROWS_LAST reduces
 * acc[0] + acc[1] into out[i * R + r] as the rows kernel does. A row is taken in pieces of at
 * most MANY_PIECE_VALUES values, each piece's half 0 then half 1 (x's piece in the L1): the
 * same sums in the same order, the rows kernel's bits. `scratch` (MANY_SCRATCH floats) carries
 * what half 0 unpacks for half 1 of a piece (the K-quants' scales). */
#define MANY_MIN_M 5
#define MANY_ROWS(m) ((m) <= 6 ? 3 : 2)
#define MANY_STATE (3 * 6 * 2 * 16) /* R * M * 2 vectors at most (3 x 6; 2 x 8 is fewer) */
#define MANY_PIECE_VALUES 4096 /* 16 K-quant super-blocks */
#define MANY_SCRATCH (3 * (MANY_PIECE_VALUES / 256) * 16) /* 16 floats a row, super-block */
typedef void (*many_fn)(const void *w, int64_t row_bytes, int64_t num_blocks, const float *x,
                        int64_t ldx, int m, int half, int phase, float *state, float *scratch,
                        float *out);

struct quant_format {
    int type;
    int block_values; /* values per block */
    int block_bytes;
    dequant_fn dequant[3]; /* per cpu_isa; NULL where the build lacks that path */
    rows_fn rows[3];       /* per cpu_isa; NULL: dequantize into a buffer, then dot */
    wide_fn wide[3];       /* per cpu_isa; NULL: rows() one at a time */
    int wide_rows;         /* rows a wide kernel takes at once; 0: WIDE_ROWS */
    int_split_fn split;        /* the integer path of AVX-512 VNNI; NULL: none */
    int_wide_fn int_wide;      /* its batch-1 kernel */
    small_fn small;            /* 2-4 input rows, AVX-512 (below); NULL: the rows kernel */
    int_split_fn split2;       /* the integer path of AVX2 (any number of input rows) */
    int_rows_fn int_rows2;
    int_wide_fn int_wide2;     /* its batch-1 kernel over several rows of W (the same bits) */
    int int2_when_on;          /* 1: that path only under int_dots on (Q4_0, Q4_1) */
    int_rows_fn int_rows2_on;  /* under int_dots on, kernels with other bits (Q4_K); NULL: */
    int_wide_fn int_wide2_on;  /* int_rows2 and int_wide2 */
    many_fn many;              /* 5-8 input rows, AVX-512 (below); NULL: the other kernels */
    int_many_fn int_many;      /* its kernel for 2 or more input rows (the same bits) */
};

/* The float formats' wide kernels take one row at a time: their arithmetic is light enough
 * for one row's FMA chains, and each extra row is one more stream of W to prefetch. With 4
 * rows against 1, the 30 layers and output projection of the default model streamed float32
 * at 39.9 against 49.0 GB/s, bfloat16 at 27.9 against 31.2 (AMD Zen 5, 2 threads, alternating
 * in one process); Q4_0 and Q4_1 were faster with 4 (benchmarks/RESULTS.md). */
#define FLOAT_WIDE_ROWS 1

/* Helpers for the register-fused row kernels: acc[i][k] += w * x[i][off..off+16). The kernel
 * body is always inlined into one copy per constant m, so acc stays in registers. */
#define ROWS_FMA16(k, w, off)                                                                  \
    for (int i_ = 0; i_ < M; i_++)                                                             \
        acc[i_][k] = _mm512_fmadd_ps((w), _mm512_loadu_ps(x + i_ * ldx + (off)), acc[i_][k]);
#define ROWS_BEGIN                                                                             \
    __m512 acc[ROWS_MAX][2];                                                                   \
    for (int i_ = 0; i_ < M; i_++) {                                                           \
        const int fresh_ = phase & ROWS_FIRST;                                                 \
        acc[i_][0] = fresh_ ? _mm512_setzero_ps() : _mm512_load_ps(state + 32 * i_);           \
        acc[i_][1] = fresh_ ? _mm512_setzero_ps() : _mm512_load_ps(state + 32 * i_ + 16);      \
    }
#define ROWS_END                                                                               \
    for (int i_ = 0; i_ < M; i_++) {                                                           \
        if (phase & ROWS_LAST) {                                                               \
            out[i_] = _mm512_reduce_add_ps(_mm512_add_ps(acc[i_][0], acc[i_][1]));             \
        } else {                                                                               \
            _mm512_store_ps(state + 32 * i_, acc[i_][0]);                                      \
            _mm512_store_ps(state + 32 * i_ + 16, acc[i_][1]);                                 \
        }                                                                                      \
    }
/* The entry point of kernel NAME: dispatch m to a constant. */
#define ROWS_DISPATCH(NAME)                                                                    \
    TARGET_AVX512 static void NAME(const void *row, int64_t nb, const float *x, int64_t ldx,   \
                                   int m, float *out, float *state, int phase) {               \
        switch (m) {                                                                           \
        case 1: NAME##_m(row, nb, x, ldx, out, state, phase, 1); break;                        \
        case 2: NAME##_m(row, nb, x, ldx, out, state, phase, 2); break;                        \
        case 3: NAME##_m(row, nb, x, ldx, out, state, phase, 3); break;                        \
        case 4: NAME##_m(row, nb, x, ldx, out, state, phase, 4); break;                        \
        case 5: NAME##_m(row, nb, x, ldx, out, state, phase, 5); break;                        \
        case 6: NAME##_m(row, nb, x, ldx, out, state, phase, 6); break;                        \
        case 7: NAME##_m(row, nb, x, ldx, out, state, phase, 7); break;                        \
        default: NAME##_m(row, nb, x, ldx, out, state, phase, 8); break;                       \
        }                                                                                      \
    }
#define ROWS_KERNEL(NAME)                                                                      \
    TARGET_AVX512 static inline __attribute__((always_inline)) void NAME##_m(                 \
        const void *row, int64_t nb, const float *x, int64_t ldx, float *out, float *state,    \
        const int phase, const int M)

/* Defined in quant_q4_q8.c, quant_q5.c and quant_k.c. */
extern const struct quant_format FORMAT_Q8_0, FORMAT_Q4_0, FORMAT_Q4_1, FORMAT_IQ4_NL;
extern const struct quant_format FORMAT_MXFP4, FORMAT_IQ4_XS;
extern const struct quant_format FORMAT_Q5_0, FORMAT_Q5_1;
extern const struct quant_format FORMAT_Q4_K, FORMAT_Q5_K, FORMAT_Q6_K;
extern const struct quant_format FORMAT_F32;  /* quant_f32.c */
extern const struct quant_format FORMAT_BF16; /* quant_bf16.c */

#if defined(__x86_64__) || defined(__i386__)
#define QUANT_X86 1
#define TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
#define TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))
#define TARGET_VNNI                                                                            \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))
#else
#define QUANT_X86 0
#endif

/* Software prefetch: the wide kernels read a group's adjacent rows side by side,
 * so they prefetch the same spot whole groups ahead, PREFETCH_BYTES or more (the hardware
 * streamer alone leaves the arithmetic waiting on memory: 12 against 19 GB/s on 2 cores of
 * a Xeon streaming Q4_1 from DRAM). Prefetching past W's end is harmless.
 *
 * Where the lines go depends on the CPU. Into the L1 (PREFETCHT0) suits the Xeon above. On
 * an AMD Zen 4, the same distance into the L2 only (PREFETCHT1) streamed Q8_0 at 30.7
 * against 15.6 GB/s and Q4_1 at 20.3 against 17.0 (2 cores, DRAM). On an AMD Zen 5 the L1
 * won again (Q4_1 24.9 against 22.7 GB/s; a batch-1 step 3-5% faster in two alternating
 * runs). So the library starts with the L2 on AMD CPUs before Zen 5 and the L1 elsewhere
 * (quant_linear_cpu.c), and pagecli_quant_set_prefetch() can choose either (benchmarks
 * compare them). */
#ifndef PREFETCH_BYTES /* -DPREFETCH_BYTES=n: benchmarks/kernel_variants.py builds variants */
#define PREFETCH_BYTES 6144
#endif
extern int pagecli_quant_prefetch_l2; /* nonzero: the wide kernels prefetch into the L2 */
static inline int64_t wide_prefetch_distance(int64_t row_bytes, int rows) {
    const int64_t group = rows * row_bytes;
    return (PREFETCH_BYTES + group - 1) / group * group;
}

#if QUANT_X86
#include <immintrin.h>

/* f16 -> f32 for every bit pattern (256 KiB, filled once from the exact portable conversion,
 * quant_q4_q8.c): a scale then costs two loads, and no shuffle-port work (a vector conversion
 * and broadcast per block would cost as much of that port as the weights themselves). */
extern float pagecli_f16_table[1 << 16];

/* Prefetch the line at p into the L2 (l2 nonzero) or the L1; a hint must be a constant.
 * Always inlined: GCC 12 otherwise left both prefetches out of the small-batch kernels' loops. */
static inline __attribute__((always_inline)) void prefetch_w(int l2, const void *p) {
    if (l2)
        _mm_prefetch((const char *)p, _MM_HINT_T1);
    else
        _mm_prefetch((const char *)p, _MM_HINT_T0);
}

/* The wide kernels' frame (AVX-512): acc[r][0..2) per row, prefetching `ahead` bytes past each
 * block read (WIDE_PREFETCH: the line of a small block; WIDE_PREFETCH_BLOCK: every line of a
 * K-quant super-block). */
#define WIDE_PREFETCH(b) prefetch_w(l2, (const char *)(b) + ahead)
#define WIDE_PREFETCH_BLOCK(b, bytes)                                                          \
    for (int o_ = 0; o_ < (bytes); o_ += 64) prefetch_w(l2, (const char *)(b) + ahead + o_);
#define WIDE_BEGIN                                                                             \
    const int64_t ahead = wide_prefetch_distance(row_bytes, WIDE_ROWS);                        \
    const int l2 = pagecli_quant_prefetch_l2;                                                  \
    __m512 acc[WIDE_ROWS][2];                                                                  \
    for (int r_ = 0; r_ < WIDE_ROWS; r_++) acc[r_][0] = acc[r_][1] = _mm512_setzero_ps();
#define WIDE_END                                                                               \
    for (int r_ = 0; r_ < WIDE_ROWS; r_++)                                                     \
        out[r_] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r_][0], acc[r_][1]));

/* The small-batch kernels (small_fn): acc[r][i][0..2) for R weight rows and M input rows
 * (R * M <= 8: 16 registers), the body one copy per constant (R, M). SMALL_FMA32(w0, w1, off):
 * the 32 weights of a block of each row (w0[r], w1[r]) against x[i][off..off+32) for every
 * input; SMALL_FMA16(k, w, off): 16 weights of each row into the rows' accumulators k. */
#define SMALL_BEGIN                                                                            \
    const int64_t ahead = wide_prefetch_distance(row_bytes, R);                                \
    const int l2 = pagecli_quant_prefetch_l2;                                                  \
    __m512 acc[4][SMALL_MAX_M][2];                                                             \
    for (int r_ = 0; r_ < R; r_++)                                                             \
        for (int i_ = 0; i_ < M; i_++) acc[r_][i_][0] = acc[r_][i_][1] = _mm512_setzero_ps();
#define SMALL_FMA32(w0, w1, off)                                                               \
    for (int i_ = 0; i_ < M; i_++) {                                                           \
        const __m512 x0_ = _mm512_loadu_ps(x + i_ * ldx + (off));                              \
        const __m512 x1_ = _mm512_loadu_ps(x + i_ * ldx + (off) + 16);                         \
        for (int r_ = 0; r_ < R; r_++) {                                                       \
            acc[r_][i_][0] = _mm512_fmadd_ps((w0)[r_], x0_, acc[r_][i_][0]);                   \
            acc[r_][i_][1] = _mm512_fmadd_ps((w1)[r_], x1_, acc[r_][i_][1]);                   \
        }                                                                                      \
    }
#define SMALL_FMA16(k, w, off)                                                                 \
    for (int i_ = 0; i_ < M; i_++) {                                                           \
        const __m512 x_ = _mm512_loadu_ps(x + i_ * ldx + (off));                               \
        for (int r_ = 0; r_ < R; r_++)                                                         \
            acc[r_][i_][k] = _mm512_fmadd_ps((w)[r_], x_, acc[r_][i_][k]);                     \
    }
#define SMALL_END                                                                              \
    for (int r_ = 0; r_ < R; r_++)                                                             \
        for (int i_ = 0; i_ < M; i_++)                                                         \
            out[i_ * R + r_] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r_][i_][0], acc[r_][i_][1]));
#define SMALL_KERNEL(NAME)                                                                     \
    TARGET_AVX512 static inline __attribute__((always_inline)) void NAME##_t(                 \
        const void *w, int64_t row_bytes, int64_t nb, const float *x, int64_t ldx, float *out,  \
        const int R, const int M)
#define SMALL_DISPATCH(NAME)                                                                   \
    TARGET_AVX512 static void NAME(const void *w, int64_t row_bytes, int64_t nb, const float *x, \
                                   int64_t ldx, int m, float *out) {                           \
        switch (m) {                                                                           \
        case 2: NAME##_t(w, row_bytes, nb, x, ldx, out, SMALL_ROWS(2), 2); break;              \
        case 3: NAME##_t(w, row_bytes, nb, x, ldx, out, SMALL_ROWS(3), 3); break;              \
        default: NAME##_t(w, row_bytes, nb, x, ldx, out, SMALL_ROWS(4), 4); break;             \
        }                                                                                      \
    }

/* The half-sum kernels (many_fn): acc[r][i] for R weight rows and M input rows, the half
 * HALF of the rows kernel's sums (R, M and HALF constants of each copy of the body).
 * MANY_FMA16(w, off): 16 weights of each row against x[i][off..off+16) for every input, each
 * load of x kept in a register for the R rows (GCC otherwise folds a load into each FMA, R
 * loads a vector of x: a C harness of Q4_K's kernel, 2 weight rows against 8 inputs, one
 * thread of a Xeon with AMX, 2.45 against 2.72 G FMA/s). */
#define MANY_BEGIN                                                                             \
    const int64_t ahead = wide_prefetch_distance(row_bytes, R);                                \
    const int l2 = pagecli_quant_prefetch_l2;                                                  \
    __m512 acc[3][ROWS_MAX];                                                                   \
    for (int r_ = 0; r_ < R; r_++)                                                             \
        for (int i_ = 0; i_ < M; i_++)                                                         \
            acc[r_][i_] = (phase & ROWS_FIRST)                                                 \
                              ? _mm512_setzero_ps()                                            \
                              : _mm512_load_ps(state + ((r_ * M + i_) * 2 + HALF) * 16);
/* The lines of the blocks at b, prefetched by the first half only (the second reads them from
 * the L1). */
#define MANY_PREFETCH_BLOCK(b, bytes)                                                          \
    if (!HALF) WIDE_PREFETCH_BLOCK(b, bytes)
#define MANY_FMA16(w, off)                                                                     \
    for (int i_ = 0; i_ < M; i_++) {                                                           \
        __m512 x_ = _mm512_loadu_ps(x + i_ * ldx + (off));                                     \
        __asm__("" : "+v"(x_)); /* one load for the R rows, not one folded into each FMA */    \
        for (int r_ = 0; r_ < R; r_++) acc[r_][i_] = _mm512_fmadd_ps((w)[r_], x_, acc[r_][i_]); \
    }
#define MANY_END                                                                               \
    for (int r_ = 0; r_ < R; r_++)                                                             \
        for (int i_ = 0; i_ < M; i_++) {                                                       \
            float *at_ = state + (r_ * M + i_) * 2 * 16;                                       \
            if (HALF && (phase & ROWS_LAST))                                                   \
                out[i_ * R + r_] =                                                             \
                    _mm512_reduce_add_ps(_mm512_add_ps(_mm512_load_ps(at_), acc[r_][i_]));     \
            else                                                                               \
                _mm512_store_ps(at_ + HALF * 16, acc[r_][i_]);                                 \
        }
#define MANY_KERNEL(NAME)                                                                      \
    TARGET_AVX512 static inline __attribute__((always_inline)) void NAME##_t(                 \
        const void *w, int64_t row_bytes, int64_t nb, const float *x, int64_t ldx,             \
        const int phase, float *state, float *scratch, float *out, const int R, const int M,   \
        const int HALF)
#define MANY_CASE(NAME, M, HALF)                                                               \
    case (M) * 2 + (HALF):                                                                     \
        NAME##_t(w, row_bytes, nb, x, ldx, phase, state, scratch, out, MANY_ROWS(M), M, HALF); \
        break;
#define MANY_DISPATCH(NAME)                                                                    \
    TARGET_AVX512 static void NAME(const void *w, int64_t row_bytes, int64_t nb, const float *x, \
                                   int64_t ldx, int m, int half, int phase, float *state,      \
                                   float *scratch, float *out) {                               \
        switch (m * 2 + (half != 0)) {                                                         \
            MANY_CASE(NAME, 4, 0) MANY_CASE(NAME, 4, 1)                                        \
            MANY_CASE(NAME, 5, 0) MANY_CASE(NAME, 5, 1) MANY_CASE(NAME, 6, 0)                  \
            MANY_CASE(NAME, 6, 1) MANY_CASE(NAME, 7, 0) MANY_CASE(NAME, 7, 1)                  \
            MANY_CASE(NAME, 8, 0) MANY_CASE(NAME, 8, 1)                                        \
        }                                                                                      \
    }

/* The sum of v's 8 lanes, always in this order (halves, then pairs, then the last two). */
TARGET_AVX2 static inline float hsum256(__m256 v) {
    const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}

/* The same for AVX2: acc[r][0..2) of 8 lanes. */
#define WIDE2_BEGIN                                                                            \
    const int64_t ahead = wide_prefetch_distance(row_bytes, WIDE_ROWS);                        \
    const int l2 = pagecli_quant_prefetch_l2;                                                  \
    __m256 acc[WIDE_ROWS][2];                                                                  \
    for (int r_ = 0; r_ < WIDE_ROWS; r_++) acc[r_][0] = acc[r_][1] = _mm256_setzero_ps();
#define WIDE2_END                                                                              \
    for (int r_ = 0; r_ < WIDE_ROWS; r_++) out[r_] = hsum256(_mm256_add_ps(acc[r_][0], acc[r_][1]));
/* acc[r][k & 1] += w * x[off..off+8) for 8 weights w of row r */
#define WIDE2_FMA(k, w, off)                                                                   \
    acc[r][(k) & 1] = _mm256_fmadd_ps((w), _mm256_loadu_ps(x + (off)), acc[r][(k) & 1]);

/* The rows kernels' frame for AVX2 (rows_fn): acc[i][0..2) of 8 lanes per input row, 16
 * floats of `state` each, the 8 weights k of a block into acc[i][k & 1] (the order of the
 * AVX2 wide kernels, so that a row's sum is the same bits in a group or alone, at one input
 * row or several: speculative decoding's verify rows rely on it). Past 4
 * inputs the accumulators no longer all fit the 16 registers, but one pass over the row was
 * still 5-25% faster than two passes of at most 4 inputs at 5-7 inputs, and as fast at 8
 * (Q5_0 rows in the L2, AMD EPYC Zen 3). */
#define ROWS2_BEGIN                                                                            \
    __m256 acc[ROWS_MAX][2];                                                                   \
    for (int i_ = 0; i_ < M; i_++) {                                                           \
        const int fresh_ = phase & ROWS_FIRST;                                                 \
        acc[i_][0] = fresh_ ? _mm256_setzero_ps() : _mm256_load_ps(state + 16 * i_);           \
        acc[i_][1] = fresh_ ? _mm256_setzero_ps() : _mm256_load_ps(state + 16 * i_ + 8);       \
    }
#define ROWS2_FMA8(k, w, off)                                                                  \
    for (int i_ = 0; i_ < M; i_++)                                                             \
        acc[i_][(k) & 1] =                                                                     \
            _mm256_fmadd_ps((w), _mm256_loadu_ps(x + i_ * ldx + (off)), acc[i_][(k) & 1]);
#define ROWS2_END                                                                              \
    for (int i_ = 0; i_ < M; i_++) {                                                           \
        if (phase & ROWS_LAST) {                                                               \
            out[i_] = hsum256(_mm256_add_ps(acc[i_][0], acc[i_][1]));                          \
        } else {                                                                               \
            _mm256_store_ps(state + 16 * i_, acc[i_][0]);                                      \
            _mm256_store_ps(state + 16 * i_ + 8, acc[i_][1]);                                  \
        }                                                                                      \
    }
#define ROWS2_KERNEL(NAME)                                                                     \
    TARGET_AVX2 static inline __attribute__((always_inline)) void NAME##_m(                   \
        const void *row, int64_t nb, const float *x, int64_t ldx, float *out, float *state,    \
        const int phase, const int M)
#define ROWS2_DISPATCH(NAME)                                                                   \
    TARGET_AVX2 static void NAME(const void *row, int64_t nb, const float *x, int64_t ldx,     \
                                 int m, float *out, float *state, int phase) {                 \
        switch (m) {                                                                           \
        case 1: NAME##_m(row, nb, x, ldx, out, state, phase, 1); break;                        \
        case 2: NAME##_m(row, nb, x, ldx, out, state, phase, 2); break;                        \
        case 3: NAME##_m(row, nb, x, ldx, out, state, phase, 3); break;                        \
        case 4: NAME##_m(row, nb, x, ldx, out, state, phase, 4); break;                        \
        case 5: NAME##_m(row, nb, x, ldx, out, state, phase, 5); break;                        \
        case 6: NAME##_m(row, nb, x, ldx, out, state, phase, 6); break;                        \
        case 7: NAME##_m(row, nb, x, ldx, out, state, phase, 7); break;                        \
        default: NAME##_m(row, nb, x, ldx, out, state, phase, 8); break;                       \
        }                                                                                      \
    }

/* The AVX2 rows and wide kernels of a block format from one walk over a block: WALK(name, b,
 * base, EMIT) calls EMIT(k, w, off) for each 8 weights w of block b (values off..off+8 of the
 * row; base: the block's first), into accumulator k & 1. Both kernels add them block after
 * block in that order, so a row's sums are the same bits in either: alone or beside other
 * rows at one input row, and at any number of input rows. VALUES: values per block. */
#define AVX2_KERNELS(name, VALUES, WALK)                                                       \
    ROWS2_KERNEL(rows_##name##_avx2) {                                                         \
        const block_##name *b = row;                                                           \
        ROWS2_BEGIN                                                                            \
        for (int64_t j = 0; j < nb; j++) WALK(name, &b[j], j * (VALUES), ROWS2_FMA8);          \
        ROWS2_END                                                                              \
    }                                                                                          \
    ROWS2_DISPATCH(rows_##name##_avx2)                                                         \
                                                                                               \
    TARGET_AVX2 static void wide_##name##_avx2(const void *w, int64_t row_bytes, int64_t nb,   \
                                               const float *x, float *out) {                   \
        WIDE2_BEGIN                                                                            \
        for (int64_t j = 0; j < nb; j++) {                                                     \
            for (int r = 0; r < WIDE_ROWS; r++) {                                              \
                const block_##name *b =                                                        \
                    (const block_##name *)((const uint8_t *)w + r * row_bytes) + j;            \
                WIDE_PREFETCH_BLOCK(b, (int)sizeof(block_##name))                              \
                WALK(name, b, j * (VALUES), WIDE2_FMA);                                        \
            }                                                                                  \
        }                                                                                      \
        WIDE2_END                                                                              \
    }

/* The walk of a 32-value block format (quant_q4_q8.c, quant_q5.c), from its block reader
 * avx2_weights_NAME(b, w): the block's 32 weights as four vectors of 8, bit for bit gguf's
 * (quant_k.c walks its super-blocks itself). */
#define AVX2_WALK32(name, b, base, EMIT)                                                       \
    do {                                                                                       \
        __m256 w_[4];                                                                          \
        avx2_weights_##name((b), w_);                                                          \
        for (int k_ = 0; k_ < 4; k_++) EMIT(k_, w_[k_], (base) + 8 * k_)                       \
    } while (0)
#define AVX2_BLOCK32_KERNELS(name) AVX2_KERNELS(name, 32, AVX2_WALK32)

/* Q6_K: the 6-bit values of a 128-value half are put together 64 at a time in bytes (the low
 * nibbles of ql with qh's 2-bit fields, then the high nibbles), minus 32; each 16 of them are
 * then widened and converted (quant_k.c's dequantization, gemm_quant_amx.c's split). */
TARGET_AVX512 static inline void q6_half_bytes(const uint8_t *ql, const uint8_t *qh, __m512i *v01,
                                               __m512i *v23) {
    const __m512i nib = _mm512_set1_epi8(0x0F), two = _mm512_set1_epi8(0x03);
    const __m512i top = _mm512_set1_epi8(0x30), bias = _mm512_set1_epi8(32);
    const __m256i h = _mm256_loadu_si256((const __m256i *)qh);
    /* bytes 0..31: qh; bytes 32..63: qh >> 2 (fields 1 and 3 where fields 0 and 2 were) */
    const __m512i hz = _mm512_inserti64x4(_mm512_castsi256_si512(h), _mm256_srli_epi16(h, 2), 1);
    const __m512i l = _mm512_loadu_si512((const void *)ql); /* ql[0..64) */
    const __m512i a = _mm512_or_si512(_mm512_and_si512(l, nib),
                                      _mm512_slli_epi16(_mm512_and_si512(hz, two), 4));
    const __m512i c = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l, 4), nib),
                                      _mm512_and_si512(hz, top));
    *v01 = _mm512_sub_epi8(a, bias); /* values 0..63 of the half */
    *v23 = _mm512_sub_epi8(c, bias); /* values 64..127 */
}

/* Values 16c..16c+16 of the half as float32 (c a constant after unrolling). */
TARGET_AVX512 static inline __m512 q6_lane(const __m512i v[2], int c) {
    __m128i q;
    switch (c & 3) {
    case 0: q = _mm512_castsi512_si128(v[c >> 2]); break;
    case 1: q = _mm512_extracti32x4_epi32(v[c >> 2], 1); break;
    case 2: q = _mm512_extracti32x4_epi32(v[c >> 2], 2); break;
    default: q = _mm512_extracti32x4_epi32(v[c >> 2], 3); break;
    }
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q));
}

#endif

#endif
