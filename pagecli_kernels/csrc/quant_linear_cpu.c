/*
 * Quantized linear layers for the CPU: y = x @ dequant(W).T with float32 activations and
 * float32 sums, W in a GGUF block format (quant_blocks.h; the formats are quant_q4_q8.c,
 * quant_q5.c and quant_k.c) or float32 rows taken as blocks (quant_f32.c).
 *
 * Paths, chosen by the number of input rows m:
 *   - m <= fused_rows (decode; FUSED_MAX_ROWS = 8 unless pagecli_quant_set_fused_rows asked
 *     for more): each thread takes contiguous ranges of W's output rows (one range each; for
 *     m == 1, guided chunks) and streams them once. For m == 1, a format's wide kernel takes
 *     WIDE_ROWS rows of W at a time (one for the float formats), with software prefetch. For
 *     m = 2..8 on AVX-512, a format's small-batch kernel (Q8_0, Q4_0, Q4_1, Q6_K; Q4_K at 2-4 on
 *     Intel's CPUs) takes SMALL_ROWS(m) rows of W against up to SMALL_MAX_M inputs (5-8 in two
 *     passes), sharing each load of x; at m = 5..8 on Intel's CPUs, the half-sum kernels (those
 *     formats', Q4_K's, IQ4_NL's and MXFP4's) take MANY_ROWS(m) rows of W against all m inputs
 *     instead, one of the rows kernel's two sums per pass (many_batch), and past 8 rows (a
 *     speculative step's verify rows, fused_rows above 8) the same kernels take the inputs in
 *     parts of 4-8 against each set of W's rows in turn (many_parts). The last rows, and every
 *     other case, go row by row: a format's register-fused rows kernel (every format on AVX2 and
 *     AVX-512) dequantizes a row in registers and dots it with up to ROWS_MAX input rows at a time
 *     (ROWS_GROUP rows of W against each ROWS_MAX inputs in turn while they are in the cache, and x
 *     in L1-sized pieces where its rows are long: rows_piece_blocks); the portable path dequantizes
 *     a chunk of the row into an L1 buffer and dots it with the input rows. Every one of these sums
 *     each (row of W, input row) in the order of the format's one-row kernels: an output has the
 *     same bits at 1 input row or at fused_rows, beside any other rows (what speculative decoding's
 *     verify rows need).
 *     Q4_K and Q6_K take the integer paths instead (pagecli_quant_int_dots): on AVX-512 VNNI,
 *     a batch-1 kernel over WIDE_ROWS rows of W (int_batch_one) and a kernel for 2 or more
 *     input rows that gives each input the batch-1 bits (int_many_rows: x packed and taken in
 *     L1-sized pieces by groups of rows of W), taken only under INT_ON (see int_choice; Q4_K
 *     on AMD's CPUs only, see vnni_q4_k_choice); on AVX2 the same two
 *     (the batch-1 kernel's rows of W one after another, each with the other kernel's
 *     one-input body) for any m up to there, and for Q4_0 and Q4_1 too under INT_ON.
 *     Decode is bound by the bytes of W read, so W is read once, packed.
 *   - larger m (batched decode, prefill): each thread dequantizes a panel of W's rows into a
 *     cache-resident float32 buffer and multiplies it with the m rows through the BLAS sgemm
 *     that Python hands over (torch's MKL, run single-threaded inside the thread), or through
 *     gemm_f32.c's kernel on CPUs that are not Intel's (pagecli_quant_gemm), or, with
 *     neither, through the fused path;
 *   - larger m, on CPUs with AMX (pagecli_quant_tiles) and the formats that gemm_quant_amx.c
 *     splits (a scale per 32 values: Q8_0, Q4_0, Q4_1, Q4_K, Q5_K; and Q6_K): AMX's tiles
 *     instead of the panels, BLAS or not.
 *
 * Runtime dispatch: the instruction-set path (portable, AVX2+FMA, AVX-512) is the best one the
 * CPU runs (cpu_features.c), unless pagecli_quant_set_isa() chose a lower one (tests run every
 * path). The
 * library itself is built for the baseline ISA, so the portable path runs anywhere; only the
 * functions marked TARGET_* use newer instructions.
 *
 * Layouts: W [n, k] as n rows of row_bytes (k / block values blocks each); x [m, k] with row
 * stride ldx (elements); y [m, n] with row stride ldy. k is a multiple of the block size.
 * Functions return 0, or QUANT_E_* below.
 */
#include <omp.h>
#include <stdlib.h>

#include "quant_blocks.h"

#include "cpu_entry_points.h"
#include "cpu_features.h"
#include "gemm_f32.h"

#if QUANT_X86
#include <immintrin.h>
#endif

#define QUANT_E_FORMAT -1 /* unknown type, or k not a multiple of its block */
#define QUANT_E_ROW -2    /* a row id outside [0, n) */
#define QUANT_E_MEMORY -3 /* no memory for a panel */

#define FUSED_MAX_ROWS 8      /* input rows the fused path takes by default, and at once */
#define FUSED_ROWS_LIMIT 4096 /* the most pagecli_quant_set_fused_rows allows */
#define CHUNK_VALUES 4096     /* weights dequantized at once by the fused path: 16 KiB */
#define PANEL_BYTES (1 << 20) /* float32 panel of the sgemm path, per thread: in L2 */
#define PANEL_PAD 16            /* floats after each row of a native GEMM's panel */
/* The native GEMM's panels have at least this many rows, past PANEL_BYTES where k is long: it
 * sweeps a panel a block of k at a time (gemm_sweep), so only a block of the panel needs to
 * stay in the L2, and each pass over x then serves more rows. */
#define NATIVE_PANEL_ROWS 128
/* A product of at most one strip of input rows (GEMM_TOKENS: a MoE expert's tokens in a
 * prefill) reads each panel value once, so the panel is kept small enough to be read back from
 * the L2 (512 KiB on a Zen 3) rather than the L3: Q4_K 1536 x 2048 over 32 rows, 2 Zen 3
 * threads, 136-148 GFLOP/s against 100-113 with the panels above. */
#define ONE_STRIP_PANEL_BYTES (1 << 18)
#define ROWS_X_BYTES (16 << 10) /* a piece of x the rows kernels take at once: in the L1 */
#define ROWS_GROUP 8 /* rows of W against each piece of x in turn */
#define MANY_X_BYTES (16 << 10) /* a piece of x the half-sum kernels take at once: in the L1 */
#define MANY_GROUPS 4 /* groups of W's rows against each piece of x in turn */

typedef void (*sgemm_fn)(const char *transa, const char *transb, const int *m, const int *n,
                         const int *k, const float *alpha, const float *a, const int *lda,
                         const float *b, const int *ldb, const float *beta, float *c,
                         const int *ldc);
typedef int (*set_threads_fn)(int);

/* Who multiplies the panels (pagecli_quant_set_gemm); GEMM_OFF: nobody, the fused path takes
 * every batch (tests). */
enum gemm_choice { GEMM_AUTO = 0, GEMM_BLAS = 1, GEMM_NATIVE = 2, GEMM_OFF = 3 };
static int gemm_choice = GEMM_AUTO;

static sgemm_fn blas_sgemm;
static set_threads_fn blas_set_threads_local;
static int chosen_isa = -1;

/* ---- dispatch ----------------------------------------------------------------------------- */

/* Choose a path (0 portable, 1 AVX2, 2 AVX-512); -1 if the CPU lacks it. */
int pagecli_quant_set_isa(int isa) {
    if (isa < ISA_PORTABLE || isa > cpu_features()->best_isa) return -1;
    chosen_isa = isa;
    return 0;
}

/* The path in use. */
int pagecli_quant_isa(void) {
    if (chosen_isa < 0) chosen_isa = cpu_features()->best_isa;
    return chosen_isa;
}

/* Where the wide kernels prefetch W (quant_blocks.h): the L2 on AMD CPUs before Zen 5
 * (family 0x1A), the L1 elsewhere, chosen when the library loads;
 * pagecli_quant_set_prefetch() overrides it. */
int pagecli_quant_prefetch_l2;

static int default_prefetch_l2(void) {
    const int family = cpu_features()->amd_family;
    return family != 0 && family < 0x1a;
}

/* The CPU's default, decided once when the library loads. */
__attribute__((constructor)) static void choose_defaults(void) {
    pagecli_quant_prefetch_l2 = default_prefetch_l2();
}

/* Prefetch into the L1 (level 1), the L2 (level 2), or as the CPU suggests (0);
 * -1 for any other level. */
int pagecli_quant_set_prefetch(int level) {
    if (level < 0 || level > 2) return -1;
    pagecli_quant_prefetch_l2 = level == 0 ? default_prefetch_l2() : level == 2;
    return 0;
}

/* The cache level the wide kernels prefetch into: 1 or 2. */
int pagecli_quant_prefetch(void) { return pagecli_quant_prefetch_l2 ? 2 : 1; }

/* The BLAS sgemm (Fortran interface, 32-bit ints) for the panel path, and optionally the
 * function that limits its threads for the calling thread (MKL_Set_Num_Threads_Local).
 * NULL turns the panel path off. */
void pagecli_quant_set_blas(void *sgemm, void *set_threads_local) {
    blas_sgemm = (sgemm_fn)sgemm;
    blas_set_threads_local = (set_threads_fn)set_threads_local;
}

/* Multiply panels with gemm_f32.c (GEMM_NATIVE) or the BLAS (GEMM_BLAS), or choose (GEMM_AUTO):
 * the native kernel where the path is AVX-512 or AVX2 on a CPU that is not Intel's (MKL does
 * not run its AVX-512 code there, and its AVX2 code was slower than the native kernel on a
 * Zen 3: gemm_f32.c says what was measured); or no panels (GEMM_OFF); -1 for any other
 * value. */
int pagecli_quant_set_gemm(int choice) {
    if (choice < GEMM_AUTO || choice > GEMM_OFF) return -1;
    gemm_choice = choice;
    return 0;
}

/* Who multiplies the panels of large batches (prefill) now: GEMM_NATIVE, GEMM_BLAS, or 0 when
 * neither (the fused path takes every batch); gemm_for says it for a batch's size. */
int pagecli_quant_gemm(void) {
    if (gemm_choice == GEMM_OFF) return 0;
    if (gemm_choice == GEMM_NATIVE) return GEMM_NATIVE;
    const int isa = pagecli_quant_isa();
    if (gemm_choice == GEMM_AUTO && (isa == ISA_AVX512 || isa == ISA_AVX2) &&
        !cpu_features()->intel)
        return GEMM_NATIVE;
    return blas_sgemm ? GEMM_BLAS : 0;
}

/* Input rows from GEMM_TOKENS up to which the native kernel multiplies the panels of an
 * Intel CPU too under GEMM_AUTO (batched decode), where MKL's sgemm is slower; it wins from a
 * few hundred rows on, and below one whole 32-row strip. The shapes of a 64-sequence decode
 * step of the default GGUF (30 layers' Q4_1 projections from memory and the Q8_0 head,
 * benchmarks/RESULTS.md), 2-core Xeon with AMX, 2 threads: 60.1-61.2 ms native against
 * 65.7-66.2 ms MKL; float32 rows 3072 x 576 in cache: 315 against 290 GFLOP/s at 64 rows,
 * 341 against 371-377 at 512. */
#define NATIVE_ROWS_INTEL 128

/* Values a row from which the native kernel takes an Intel CPU's panels at every batch under
 * GEMM_AUTO: MKL's sgemm keeps up with it on short rows only. Through the library (the
 * quantized panels, tiles off), 2-core Xeon with AMX, 2 threads, 512 rows, GFLOP/s MKL
 * against native: the default model's shapes (k 576 and 1536) 266 against 226; the 1B
 * shape's (2048, 8192) 221 against 248; the 8B shape's (4096, 14336) 181 against 254. */
#define NATIVE_K_INTEL 2048

/* pagecli_quant_gemm for a batch of m rows of k values. */
static int gemm_for(int64_t m, int64_t k) {
    const int gemm = pagecli_quant_gemm();
    if (gemm == GEMM_BLAS && gemm_choice == GEMM_AUTO && pagecli_quant_isa() == ISA_AVX512 &&
        m >= GEMM_TOKENS && (m <= NATIVE_ROWS_INTEL || k >= NATIVE_K_INTEL))
        return GEMM_NATIVE;
    return gemm;
}

/* Whether batches of the formats gemm_quant_amx.c splits multiply on AMX's tiles
 * (gemm_quant_amx.c, 1.4-1.7x the float32 panels' rate): on (TILES_ON, refused where the
 * tiles cannot run: no AMX granted, or no AVX-512, which their packing and scaling use), off,
 * or as the CPU suggests (TILES_AUTO: on the AVX-512 path where the tiles are granted). */
enum { TILES_AUTO = 0, TILES_OFF = 1, TILES_ON = 2 };
static int tiles_choice = TILES_AUTO;

/* Choose; returns 0, -1 for an unknown choice, -2 for TILES_ON where the tiles cannot run. */
int pagecli_quant_set_tiles(int choice) {
    if (choice < TILES_AUTO || choice > TILES_ON) return -1;
    const struct cpu_features *cpu = cpu_features();
    if (choice == TILES_ON && (!cpu->amx_granted || cpu->best_isa != ISA_AVX512)) return -2;
    tiles_choice = choice;
    return 0;
}

/* 1 where batches of those formats take the tiles now, else 0. */
int pagecli_quant_tiles(void) {
    if (tiles_choice == TILES_AUTO)
        return pagecli_quant_isa() == ISA_AVX512 && cpu_features()->amx_granted;
    return tiles_choice == TILES_ON;
}

/* Whether products of the formats with an integer path (Q4_K, Q6_K: struct int_split) take
 * it; on the AVX2 path also Q4_0 and Q4_1 (quant_q4_q8.c), under INT_ON only. INT_AUTO:
 * batch-1 products on the AVX-512 path of a CPU with AVX512_VNNI, and the fused path's Q4_K
 * and Q6_K products of any number of rows on the AVX2 path. INT_ON: the fused path's
 * products of any number of rows on either path, each row with its batch-1 bits
 * (speculative decoding's steps with drafts ask for it on AVX-512, and an engine of one
 * sequence at a time for all its steps: engine/spec_decode/invariance.py); under auto,
 * AVX-512's 2-8 rows keep the float kernels, which decoded 4-8 sequences of a 1B Q4_K_M
 * 1.3-1.4x faster on a Zen 4 (Q6_K's small-batch kernel shares each load of x between two
 * weight rows). AVX2's Q4_0 and Q4_1 at 2-8 rows are slower on the integer path too, and
 * there auto keeps the float kernels at every batch, so that a row has one kernel's bits
 * whatever the batch.
 * INT_OFF: the float kernels. INT_ON is refused where the CPU runs neither. */
enum { INT_AUTO = 0, INT_OFF = 1, INT_ON = 2 };
#ifdef INT_DEFAULT_OFF /* benchmarks/kernel_variants.py: the float kernels' variant */
static int int_choice = INT_OFF;
#else
static int int_choice = INT_AUTO;
#endif

/* Choose; returns 0, -1 for an unknown choice, -2 for INT_ON without VNNI. */
int pagecli_quant_set_int_dots(int choice) {
    if (choice < INT_AUTO || choice > INT_ON) return -1;
    if (choice == INT_ON && !cpu_features()->avx512_vnni && cpu_features()->best_isa < ISA_AVX2)
        return -2;
    int_choice = choice;
    return 0;
}

/* Whether Q4_K takes AVX-512 VNNI's integer kernels where the integer paths run (above): on
 * AMD's CPUs, where they beat the float kernels (Zen 4); not on Intel's, where the float
 * kernels read Q4_K at batch 1 faster (a 2-core Xeon with AMX: 17.1 against 14.8 GB/s, and a
 * 1B Q4_K_M decoded 1.03x, a Qwen3-30B-A3B shape 1.13x as fast; benchmarks/RESULTS.md), so
 * there Q4_K keeps the float kernels at every batch, each row with the bits it has alone.
 * Q6_K's integer kernel is the faster on both. VNNI_Q4_K_ON is refused without VNNI. */
enum { VNNI_Q4_K_AUTO = 0, VNNI_Q4_K_OFF = 1, VNNI_Q4_K_ON = 2 };
static int vnni_q4_k_choice = VNNI_Q4_K_AUTO;

/* Choose; returns 0, -1 for an unknown choice, -2 for VNNI_Q4_K_ON without VNNI. */
int pagecli_quant_set_vnni_q4_k(int choice) {
    if (choice < VNNI_Q4_K_AUTO || choice > VNNI_Q4_K_ON) return -1;
    if (choice == VNNI_Q4_K_ON && !cpu_features()->avx512_vnni) return -2;
    vnni_q4_k_choice = choice;
    return 0;
}

/* 1 where Q4_K may take VNNI's integer kernels (when the integer paths run), else 0. */
int pagecli_quant_vnni_q4_k(void) {
    if (!cpu_features()->avx512_vnni || vnni_q4_k_choice == VNNI_Q4_K_OFF) return 0;
    return vnni_q4_k_choice == VNNI_Q4_K_ON || !cpu_features()->intel;
}

/* 1 under INT_ON (AVX2's Q4_0 and Q4_1 take their integer path then), else 0. */
int pagecli_quant_int_dots_on(void) { return int_choice == INT_ON; }

/* 1 where products of those formats take an integer path now, else 0. */
int pagecli_quant_int_dots(void) {
    if (int_choice == INT_OFF) return 0;
    const int isa = pagecli_quant_isa();
    return isa == ISA_AVX2 || (isa == ISA_AVX512 && cpu_features()->avx512_vnni);
}

static const struct quant_format *format_of(int type) {
    switch (type) {
    case QT_F32: return &FORMAT_F32;
    case QT_BF16: return &FORMAT_BF16;
    case QT_Q8_0: return &FORMAT_Q8_0;
    case QT_Q4_0: return &FORMAT_Q4_0;
    case QT_Q4_1: return &FORMAT_Q4_1;
    case QT_IQ4_NL: return &FORMAT_IQ4_NL;
    case QT_MXFP4: return &FORMAT_MXFP4;
    case QT_IQ4_XS: return &FORMAT_IQ4_XS;
    case QT_Q5_0: return &FORMAT_Q5_0;
    case QT_Q5_1: return &FORMAT_Q5_1;
    case QT_Q4_K: return &FORMAT_Q4_K;
    case QT_Q5_K: return &FORMAT_Q5_K;
    case QT_Q6_K: return &FORMAT_Q6_K;
    default: return NULL;
    }
}

/* ---- float32 dot products, one per path (n is a multiple of 32) --------------------------- */

typedef float (*dot_fn)(const float *a, const float *b, int64_t n);

static float dot_portable(const float *a, const float *b, int64_t n) {
    float s[4] = {0, 0, 0, 0}; /* four chains, so that the loop does not wait on one add */
    for (int64_t i = 0; i < n; i += 4)
        for (int j = 0; j < 4; j++) s[j] += a[i + j] * b[i + j];
    return (s[0] + s[1]) + (s[2] + s[3]);
}

#if QUANT_X86
TARGET_AVX2 static float dot_avx2(const float *a, const float *b, int64_t n) {
    __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    for (int64_t i = 0; i < n; i += 32) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
        s2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 16), _mm256_loadu_ps(b + i + 16), s2);
        s3 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 24), _mm256_loadu_ps(b + i + 24), s3);
    }
    return hsum256(_mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
}

TARGET_AVX512 static float dot_avx512(const float *a, const float *b, int64_t n) {
    __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    int64_t i = 0;
    for (; i + 64 <= n; i += 64) {
        s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), s0);
        s1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), s1);
        s2 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 32), _mm512_loadu_ps(b + i + 32), s2);
        s3 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 48), _mm512_loadu_ps(b + i + 48), s3);
    }
    if (i < n) { /* the last 32 */
        s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), s0);
        s1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), s1);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)));
}
static const dot_fn DOTS[3] = {dot_portable, dot_avx2, dot_avx512};
#else
static const dot_fn DOTS[3] = {dot_portable, NULL, NULL};
#endif

/* ---- the two paths -------------------------------------------------------------------------- */

static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* `for (int64_t I = 0; I < N; I++) BODY` on num_threads threads under the OpenMP pragma text
 * PRAGMA, or on the calling thread alone when num_threads is 1: a region of one thread still
 * makes a team, about a microsecond, as much as forking two threads, and
 * layer_program_cpu.c's moe_decode calls the fused paths from inside its own region, once for
 * each thread, expert and part. */
#define FOR_THREADS(PRAGMA, num_threads, I, N, ...)                                            \
    do {                                                                                       \
        if ((num_threads) == 1) {                                                              \
            for (int64_t I = 0; I < (N); I++) {                                                \
                __VA_ARGS__                                                                    \
            }                                                                                  \
        } else {                                                                               \
            _Pragma(PRAGMA) for (int64_t I = 0; I < (N); I++) {                                \
                __VA_ARGS__                                                                    \
            }                                                                                  \
        }                                                                                      \
    } while (0)

/* The m input rows of x split by `split` (struct int_split) into the calling thread's buffer,
 * grown as needed: one struct per row, then each row's parts. NULL where a row cannot be split
 * (the float kernels then take the call) or the buffer cannot grow. */
static __thread float *split_buf; /* gemm_reserve's: 64-byte aligned, in floats */
static __thread int64_t split_cap;

static const struct int_split *split_rows(int_split_fn split, int64_t block_values,
                                          int64_t blocks, const float *x, int64_t ldx,
                                          int64_t m) {
    const int64_t values = blocks * block_values;
    /* each row's parts 64-byte aligned: a 64-byte load of them one cache line */
    const int64_t each = (values * 2 * (int64_t)sizeof(int16_t) +
                          (blocks + values / 32) * (int64_t)sizeof(float) + 63) / 64 * 64;
    const int64_t head = (m * (int64_t)sizeof(struct int_split) + 63) / 64 * 64;
    if (gemm_reserve(&split_buf, &split_cap, (head + m * each) / (int64_t)sizeof(float)))
        return NULL;
    struct int_split *parts = (struct int_split *)split_buf;
    uint8_t *space = (uint8_t *)split_buf + head;
    for (int64_t i = 0; i < m; i++) {
        int16_t *a = (int16_t *)(space + i * each);
        float *tail = (float *)(a + 2 * values);
        parts[i] = (struct int_split){a, a + values, tail, tail + blocks};
        if (split(x + i * ldx, blocks, &parts[i])) return NULL;
    }
    return parts;
}

/* The integer batch-1 paths (AVX-512 VNNI's; AVX2's): x split once, then WIDE_ROWS rows at a
 * time, the last rows (fewer) through the same kernel, so that a row's result does not
 * depend on its neighbours. Returns 0 where split_rows gives nothing. */
static int int_batch_one(int_split_fn split, int_wide_fn kernel, const struct quant_format *f,
                         const uint8_t *w, int64_t row_bytes, int64_t n, int64_t blocks,
                         const float *x, float *y, int num_threads) {
    const struct int_split *parts = split_rows(split, f->block_values, blocks, x, 0, 1);
    if (!parts) return 0;
    const int64_t groups = (n + WIDE_ROWS - 1) / WIDE_ROWS;
    FOR_THREADS("omp parallel for num_threads(num_threads) schedule(guided, 2)", num_threads, g,
                groups, {
        const int rows = (int)min64(WIDE_ROWS, n - g * WIDE_ROWS);
        kernel(w + g * WIDE_ROWS * row_bytes, row_bytes, blocks, rows, parts, y + g * WIDE_ROWS);
    });
    return 1;
}

/* pagecli_quant_set_small_batches's choice */
enum small_choice { SMALL_AUTO = 0, SMALL_OFF = 1, SMALL_ON = 2 };
static int small_choice = SMALL_AUTO;

/* 0 where batches of 2-8 rows go to rows() over whole rows (small_batches off) */
static inline int small_batches_on(void) { return small_choice != SMALL_OFF; }

/* 0 (auto: the small-batch kernels for 2-8 input rows, pieces of x where it does not fit the
 * L1; Q4_K's small-batch kernel and the half-sum kernels on Intel's CPUs only), 1 (none: the
 * rows kernel over whole rows, the same bits; tests) or 2 (on: all of them on every CPU with
 * AVX-512: the same bits, for tests and measurements on other CPUs); -1 for another choice. */
int pagecli_quant_set_small_batches(int choice) {
    if (choice < SMALL_AUTO || choice > SMALL_ON) return -1;
    small_choice = choice;
    return 0;
}

/* 1 where the small-batch kernels and the pieces of x are on (auto or on), 0 where off. */
int pagecli_quant_small_batches(void) { return small_batches_on(); }

/* 1 where Q4_K's small-batch kernel and the half-sum kernels run too: auto on Intel's CPUs,
 * or on. */
int pagecli_quant_small_batches_all(void) {
    return small_choice == SMALL_ON || (small_choice == SMALL_AUTO && cpu_features()->intel);
}

/* AVX2's integer paths for any number of input rows (int_rows_fn): each of the m input rows
 * split once, then each thread's weight rows one at a time against up to INT_ROWS_MAX inputs
 * at a time (m cut into even groups: 5 = 3 + 2), ROWS_GROUP rows of W against each group of
 * inputs in turn while they are in the cache. Returns 0 where split_rows gives nothing. */
static int int_rows(int_split_fn split, int_rows_fn kernel, const struct quant_format *f,
                    const uint8_t *w, int64_t row_bytes, int64_t n, int64_t blocks,
                    const float *x, int64_t ldx, int64_t m, float *y, int64_t ldy,
                    int num_threads) {
    const struct int_split *parts = split_rows(split, f->block_values, blocks, x, ldx, m);
    if (!parts) return 0;
    const int64_t groups = (n + ROWS_GROUP - 1) / ROWS_GROUP;
    const int64_t passes = (m + INT_ROWS_MAX - 1) / INT_ROWS_MAX;
    FOR_THREADS("omp parallel for num_threads(num_threads) schedule(guided, 1)", num_threads, g,
                groups, {
        const int64_t r0 = g * ROWS_GROUP, count_rows = min64(ROWS_GROUP, n - r0);
        for (int64_t i = 0, p = 0; p < passes; p++) {
            const int count = (int)((m - i) / (passes - p));
            for (int64_t r = 0; r < count_rows; r++) {
                float out[INT_ROWS_MAX];
                kernel(w + (r0 + r) * row_bytes, blocks, parts + i, count, out);
                for (int t = 0; t < count; t++) y[(i + t) * ldy + r0 + r] = out[t];
            }
            i += count;
        }
    });
    return 1;
}

/* The m split inputs packed for int_many_fn (struct int_packed, quant_blocks.h), in the
 * calling thread's buffer, grown as needed; 0 where it cannot grow. */
static __thread float *pack_buf; /* gemm_reserve's: 64-byte aligned, in floats */
static __thread int64_t pack_cap;

static int int_pack(const struct int_split *parts, int64_t m, int64_t blocks,
                    struct int_packed *out) {
    const int64_t words = blocks * QK_K * 2 * m; /* 64-byte aligned: one cache line a load */
    if (gemm_reserve(&pack_buf, &pack_cap, words / 2 + blocks * m * 9)) return 0;
    int16_t *p = (int16_t *)pack_buf;
    float *scale = (float *)(p + words), *sums = scale + blocks * m;
    for (int64_t s = 0; s < blocks; s++)
        for (int64_t g = 0; g < QK_K / 32; g++)
            for (int64_t i = 0; i < m; i++, p += 64) {
                memcpy(p, parts[i].a + s * QK_K + 32 * g, 32 * sizeof(int16_t));
                memcpy(p + 32, parts[i].b + s * QK_K + 32 * g, 32 * sizeof(int16_t));
            }
    for (int64_t s = 0; s < blocks; s++)
        for (int64_t i = 0; i < m; i++) {
            scale[s * m + i] = parts[i].scale[s];
            memcpy(sums + (s * m + i) * 8, parts[i].sums + 8 * s, 8 * sizeof(float));
        }
    *out = (struct int_packed){(const int16_t *)pack_buf, scale, sums};
    return 1;
}

/* The VNNI integer path's kernels for several input rows where a format has them
 * (int_many_fn): each of the m input rows split and packed once, then each thread's groups
 * of INT_MANY_ROWS rows of W against up to INT_MANY_MAX inputs a pass (m cut into even
 * groups). Returns 0 where split_rows gives nothing. */
static int int_many_rows(int_split_fn split, int_many_fn kernel, const struct quant_format *f,
                         const uint8_t *w, int64_t row_bytes, int64_t n, int64_t blocks,
                         const float *x, int64_t ldx, int64_t m, float *y, int64_t ldy,
                         int num_threads) {
    const int64_t passes = (m + INT_MANY_MAX - 1) / INT_MANY_MAX;
    for (int64_t i = 0, p = 0; p < passes; p++) {
        const int count = (int)((m - i) / (passes - p)); /* 2..8, as m >= 2 */
        const struct int_split *parts =
            split_rows(split, f->block_values, blocks, x + i * ldx, ldx, count);
        struct int_packed packed;
        if (!parts || !int_pack(parts, count, blocks, &packed)) return 0;
        const int64_t groups = (n + INT_MANY_ROWS - 1) / INT_MANY_ROWS;
        FOR_THREADS("omp parallel for num_threads(num_threads) schedule(guided, 1)",
                    num_threads, g, groups, {
            const int64_t r0 = g * INT_MANY_ROWS;
            kernel(w + r0 * row_bytes, row_bytes, blocks, (int)min64(INT_MANY_ROWS, n - r0),
                   &packed, count, y + i * ldy + r0, ldy);
        });
        i += count;
    }
    return 1;
}

/* Blocks of a row taken at once, block_x bytes of x each: all of them (at most `most`) where
 * they take at most twice `bytes`, else pieces whose x takes `bytes` (whole blocks, at least
 * one; at most `most`). */
static int64_t piece_blocks(int64_t block_x, int64_t blocks, int64_t bytes, int64_t most) {
    if (blocks * block_x <= 2 * bytes) return min64(blocks, most);
    const int64_t fit = min64(bytes / block_x, most);
    return fit > 0 ? fit : 1;
}

/* Blocks of a row that the rows kernels take at once against `m` input rows: all of them
 * where those rows of x take at most twice ROWS_X_BYTES (the L1 holds them, or nearly), else
 * a piece whose rows take ROWS_X_BYTES (whole blocks, at least one). At m = 8 over 2048 values
 * x is 64 KiB: read again from the L2 for every row of W, it bounded the kernels. */
static int64_t rows_piece_blocks(const struct quant_format *f, int64_t m, int64_t blocks) {
    if (!small_batches_on()) return blocks;
    const int64_t block_x = min64(m, ROWS_MAX) * f->block_values * (int64_t)sizeof(float);
    return piece_blocks(block_x, blocks, ROWS_X_BYTES, blocks);
}

/* Rows [from, n) of y = x @ W.T on this thread through the AVX-512 rows kernel over whole
 * rows: the rows a group of the small-batch or half-sum kernels leaves over (the same order of
 * sums, so the same bits). */
static void rows_alone(const struct quant_format *f, const uint8_t *w, int64_t row_bytes,
                       int64_t from, int64_t n, int64_t blocks, const float *x, int64_t ldx,
                       int64_t m, float *y, int64_t ldy) {
    for (int64_t row = from; row < n; row++) {
        float acc[ROWS_MAX];
        f->rows[ISA_AVX512](w + row * row_bytes, blocks, x, ldx, (int)m, acc, NULL,
                            ROWS_FIRST | ROWS_LAST);
        for (int64_t i = 0; i < m; i++) y[i * ldy + row] = acc[i];
    }
}

/* y = x @ W.T for m = 2..SMALL_MAX_M input rows through the format's small-batch kernel,
 * SMALL_ROWS(m) rows of W at a time; the last rows, fewer than that, through its rows kernel
 * (the same order of sums, so the same bits). */
static void small_batch(const struct quant_format *f, const uint8_t *w, int64_t row_bytes,
                        int64_t n, int64_t blocks, const float *x, int64_t ldx, int64_t m,
                        float *y, int64_t ldy, int num_threads) {
    const int64_t group = SMALL_ROWS(m), groups = n / group;
    FOR_THREADS("omp parallel for num_threads(num_threads) schedule(guided, 2)", num_threads, g,
                groups, {
        float out[8];
        f->small(w + g * group * row_bytes, row_bytes, blocks, x, ldx, (int)m, out);
        for (int64_t i = 0; i < m; i++)
            for (int64_t r = 0; r < group; r++) y[i * ldy + g * group + r] = out[i * group + r];
    });
    rows_alone(f, w, row_bytes, groups * group, n, blocks, x, ldx, m, y, ldy);
}

/* Blocks of a row that the half-sum kernels take at once against m input rows: all of them
 * where those rows of x take at most twice MANY_X_BYTES, else pieces of MANY_X_BYTES (whole
 * blocks, at least one); at most MANY_PIECE_VALUES values. Each call of a piece touches half
 * of its x. */
static int64_t many_piece_blocks(const struct quant_format *f, int64_t m, int64_t blocks) {
    const int64_t block_x = m * f->block_values * (int64_t)sizeof(float);
    return piece_blocks(block_x, blocks, MANY_X_BYTES, MANY_PIECE_VALUES / f->block_values);
}

/* Rows r0 .. r0 + count * group of y = x @ W.T for m = 4..ROWS_MAX input rows through the
 * format's half-sum kernel: the count groups of group = MANY_ROWS(m) rows of W against each
 * piece of x in turn (half 0, then half 1) while it is in the L1. `state` holds count
 * MANY_STATE blocks. */
static inline void many_groups(const struct quant_format *f, const uint8_t *w,
                               int64_t row_bytes, int64_t r0, int64_t count, int64_t blocks,
                               const float *x, int64_t ldx, int64_t m, float *y, int64_t ldy,
                               float (*state)[MANY_STATE], float *scratch) {
    const int64_t group = MANY_ROWS(m), piece = many_piece_blocks(f, m, blocks);
    float out[3 * ROWS_MAX];
    for (int64_t b0 = 0; b0 < blocks; b0 += piece) {
        const int64_t nb = min64(piece, blocks - b0);
        const int phase = (b0 == 0 ? ROWS_FIRST : 0) | (b0 + nb == blocks ? ROWS_LAST : 0);
        for (int64_t g = 0; g < count; g++) {
            const int64_t row = r0 + g * group;
            const uint8_t *wg = w + row * row_bytes + b0 * f->block_bytes;
            for (int half = 0; half < 2; half++)
                f->many(wg, row_bytes, nb, x + b0 * f->block_values, ldx, (int)m, half, phase,
                        state[g], scratch, out);
            if (phase & ROWS_LAST)
                for (int64_t i = 0; i < m; i++)
                    for (int64_t r = 0; r < group; r++)
                        y[i * ldy + row + r] = out[i * group + r];
        }
    }
}

/* y = x @ W.T for m = MANY_MIN_M..ROWS_MAX input rows: MANY_GROUPS groups of MANY_ROWS(m)
 * rows of W at a time (many_groups); the last rows, fewer than a group, through the rows
 * kernel (the same order of sums, so the same bits). */
static void many_batch(const struct quant_format *f, const uint8_t *w, int64_t row_bytes,
                       int64_t n, int64_t blocks, const float *x, int64_t ldx, int64_t m,
                       float *y, int64_t ldy, int num_threads) {
    const int64_t group = MANY_ROWS(m), groups = n / group;
    const int64_t sets = (groups + MANY_GROUPS - 1) / MANY_GROUPS;
    FOR_THREADS("omp parallel for num_threads(num_threads) schedule(guided, 1)", num_threads,
                set, sets, {
        float state[MANY_GROUPS][MANY_STATE] __attribute__((aligned(64)));
        float scratch[MANY_SCRATCH] __attribute__((aligned(64)));
        const int64_t g0 = set * MANY_GROUPS, count = min64(MANY_GROUPS, groups - g0);
        many_groups(f, w, row_bytes, g0 * group, count, blocks, x, ldx, m, y, ldy, state,
                    scratch);
    });
    rows_alone(f, w, row_bytes, groups * group, n, blocks, x, ldx, m, y, ldy);
}

/* Rows of W in each thread's share of many_parts: 4 groups of MANY_ROWS 3, or 6 of 2. */
#define MANY_SET_ROWS 12

/* y = x @ W.T for more than ROWS_MAX input rows (a verify step of 8 drafts or more) through
 * the half-sum kernels: the inputs cut into even parts of 4-8 rows (m / ceil(m / ROWS_MAX)),
 * and each set of MANY_SET_ROWS rows of W against every part in turn (many_groups), while
 * those rows stay in the cache: W is read from memory once. The last rows, fewer than a set,
 * through the rows kernel, each part alone (the same order of sums, so the same bits).
 * Against the rows kernel, which takes 8 inputs at a time (a 2-core Xeon with AMX, the 1B
 * shape's projections at 9, 12 and 16 rows, two runs): Q4_K 0.81, 0.84-0.85 and 0.90-0.91
 * the time, Q4_0 0.90-0.91, 0.93-0.97 and 0.90-0.95. */
static void many_parts(const struct quant_format *f, const uint8_t *w, int64_t row_bytes,
                       int64_t n, int64_t blocks, const float *x, int64_t ldx, int64_t m,
                       float *y, int64_t ldy, int num_threads) {
    const int64_t parts = (m + ROWS_MAX - 1) / ROWS_MAX, sets = n / MANY_SET_ROWS;
    FOR_THREADS("omp parallel for num_threads(num_threads) schedule(guided, 1)", num_threads,
                set, sets, {
        float state[MANY_SET_ROWS / 2][MANY_STATE] __attribute__((aligned(64)));
        float scratch[MANY_SCRATCH] __attribute__((aligned(64)));
        for (int64_t i = 0, p = 0; p < parts; p++) {
            const int64_t mp = (m - i) / (parts - p);
            many_groups(f, w, row_bytes, set * MANY_SET_ROWS, MANY_SET_ROWS / MANY_ROWS(mp),
                        blocks, x + i * ldx, ldx, mp, y + i * ldy, ldy, state, scratch);
            i += mp;
        }
    });
    for (int64_t i = 0, p = 0; p < parts; p++) {
        const int64_t mp = (m - i) / (parts - p);
        rows_alone(f, w, row_bytes, sets * MANY_SET_ROWS, n, blocks, x + i * ldx, ldx, mp,
                   y + i * ldy, ldy);
        i += mp;
    }
}

/* Fused dequantize-and-dot, for any number of input rows (the rows kernels take up to
 * ROWS_MAX of them at a time against each group of W's rows while it is in the cache; the
 * buffered path FUSED_MAX_ROWS). Each (row of W, input row) sums in the same order whatever
 * m is: the 1-row kernels' order on every path. */
static void fused(const struct quant_format *f, int isa, const uint8_t *w, int64_t row_bytes,
                  int64_t n, int64_t k, const float *x, int64_t ldx, int64_t m, float *y,
                  int64_t ldy, int num_threads) {
    const dequant_fn dequant = f->dequant[isa];
    const dot_fn dot = DOTS[isa];
    const int64_t blocks_per_row = k / f->block_values;
    const int64_t chunk_blocks = CHUNK_VALUES / f->block_values;
    const rows_fn rows = f->rows[isa];
    const wide_fn wide = f->wide[isa];
    const int64_t group = f->wide_rows ? f->wide_rows : WIDE_ROWS;
    const int vnni = isa == ISA_AVX512 && (f->type != QT_Q4_K || pagecli_quant_vnni_q4_k());
    if (m == 1 && f->int_wide && vnni && pagecli_quant_int_dots() &&
        int_batch_one(f->split, f->int_wide, f, w, row_bytes, n, blocks_per_row, x, y,
                      num_threads))
        return;
    if (m >= 2 && f->int_many && vnni && int_choice == INT_ON && pagecli_quant_int_dots() &&
        int_many_rows(f->split, f->int_many, f, w, row_bytes, n, blocks_per_row, x, ldx, m, y,
                      ldy, num_threads))
        return;
    const int int2 = f->int_rows2 && isa == ISA_AVX2 && pagecli_quant_int_dots() &&
                     (!f->int2_when_on || int_choice == INT_ON);
    /* a format's kernels under on, where it has its own (the same ones at every batch) */
    const int on2 = int_choice == INT_ON && f->int_rows2_on;
    const int_wide_fn int_wide2 = on2 ? f->int_wide2_on : f->int_wide2;
    const int_rows_fn int_rows2 = on2 ? f->int_rows2_on : f->int_rows2;
    if (int2 && m == 1 && int_wide2 &&
        int_batch_one(f->split2, int_wide2, f, w, row_bytes, n, blocks_per_row, x, y,
                      num_threads))
        return;
    if (int2 &&
        int_rows(f->split2, int_rows2, f, w, row_bytes, n, blocks_per_row, x, ldx, m, y, ldy,
                 num_threads))
        return;
    if (wide && m == 1 && n >= group) {
        const int64_t groups = n / group;
        /* guided: the threads rarely finish a static half at once (one of them also ran the
         * Python step, or shares its core); the shrinking chunks even out the end */
        FOR_THREADS("omp parallel for num_threads(num_threads) schedule(guided, 8 / group)",
                    num_threads, g, groups, {
            wide(w + g * group * row_bytes, row_bytes, blocks_per_row, x, y + g * group);
        });
        const int64_t done = groups * group;
        if (done == n) return;
        w += done * row_bytes; /* the last rows, fewer than a group, take the paths below */
        y += done;
        n -= done;
    }
    /* 5-8 rows on Intel's CPUs: the half-sum kernels, each weight row unpacked once for all
     * the inputs (two passes of the small-batch kernels unpack it twice, and Q4_K's rows
     * kernel loads x again for every weight row; a 2-core Xeon with AMX, the 1B shape's
     * projections at 5-8 rows: Q4_K 0.89-0.92 and Q6_K 0.81-0.93 the time, the 8B shape's
     * 0.88 and 0.66-0.94; Q8_0 0.72-0.80, Q4_0 0.88-0.94, Q4_1 0.83-0.93, MXFP4 0.91-1.00).
     * Not measured on AMD's CPUs: they keep the other kernels unless small_batches is on. */
    if (f->many && isa == ISA_AVX512 && m >= MANY_MIN_M && pagecli_quant_small_batches_all()) {
        if (m <= ROWS_MAX)
            many_batch(f, w, row_bytes, n, blocks_per_row, x, ldx, m, y, ldy, num_threads);
        else
            many_parts(f, w, row_bytes, n, blocks_per_row, x, ldx, m, y, ldy, num_threads);
        return;
    }
    /* Q4_K's small-batch kernel: up to 4 rows, on Intel's CPUs (a 2-core Xeon with AMX, a 1B
     * shape's projections: 2 rows 52 against 98 ms on the rows kernel, 4 rows 78 against 91,
     * 8 in two passes 151 against 122; an earlier one ran 5-12% slower than the rows kernel
     * at 2-4 rows on a Zen 4) */
    const int small_q4_K = m <= SMALL_MAX_M && pagecli_quant_small_batches_all();
    if (f->small && isa == ISA_AVX512 && m >= 2 && m <= FUSED_MAX_ROWS && small_batches_on() &&
        (f->type != QT_Q4_K || small_q4_K)) {
        /* (more rows: the rows kernels, the same bits, W's rows read from memory once) */
        /* 5-8 rows: two passes of 2-4 (5 = 3 + 2, ..., 8 = 4 + 4) */
        const int64_t passes = (m + SMALL_MAX_M - 1) / SMALL_MAX_M;
        for (int64_t i0 = 0, p = 0; p < passes; p++) {
            const int64_t count = (m - i0) / (passes - p);
            small_batch(f, w, row_bytes, n, blocks_per_row, x + i0 * ldx, ldx, count,
                        y + i0 * ldy, ldy, num_threads);
            i0 += count;
        }
        return;
    }
    if (rows) {
        /* ROWS_GROUP rows of W in turn against each piece of x (one piece: whole rows), their
         * sums kept in `state` between pieces; the next group's rows are prefetched meanwhile,
         * spread over this group's kernel calls, in one piece as in several: with pieces the
         * reads do not run in order, and in one piece the hardware prefetcher alone does not
         * keep up (a 2-core Xeon's AVX2 path, the 1B shape's projections at 2 rows: Q4_0 64.4
         * ms with this prefetch against 106.5 without, Q8_0 80.8 against 101.9) */
        const int64_t piece = rows_piece_blocks(f, m, blocks_per_row);
        const int64_t groups = (n + ROWS_GROUP - 1) / ROWS_GROUP;
        const int64_t pieces = (blocks_per_row + piece - 1) / piece;
        FOR_THREADS("omp parallel for num_threads(num_threads) schedule(static)", num_threads, g,
                    groups, {
            float state[ROWS_GROUP][ROWS_STATE] __attribute__((aligned(64)));
            const int64_t r0 = g * ROWS_GROUP, count_rows = min64(ROWS_GROUP, n - r0);
            const int64_t next_rows = min64(ROWS_GROUP, n - r0 - ROWS_GROUP);
            const uint8_t *next = next_rows > 0 ? w + (r0 + ROWS_GROUP) * row_bytes : w;
            const int64_t lines = next_rows > 0 ? (next_rows * row_bytes + 63) / 64 : 0;
            const int64_t steps = pieces * count_rows * ((m + ROWS_MAX - 1) / ROWS_MAX);
            const int64_t per_step = (lines + steps - 1) / steps;
            int64_t line = 0;
            for (int64_t i = 0; i < m; i += ROWS_MAX) {
                const int count = (int)min64(ROWS_MAX, m - i);
                for (int64_t b0 = 0; b0 < blocks_per_row; b0 += piece) {
                    const int64_t nb = min64(piece, blocks_per_row - b0);
                    const int phase = (b0 == 0 ? ROWS_FIRST : 0) |
                                      (b0 + nb == blocks_per_row ? ROWS_LAST : 0);
                    for (int64_t r = 0; r < count_rows; r++) {
                        for (int64_t e = 0; e < per_step && line < lines; e++, line++)
                            __builtin_prefetch(next + 64 * line, 0, 2);
                        float acc[ROWS_MAX];
                        rows(w + (r0 + r) * row_bytes + b0 * f->block_bytes, nb,
                             x + i * ldx + b0 * f->block_values, ldx, count, acc, state[r], phase);
                        if (phase & ROWS_LAST)
                            for (int t = 0; t < count; t++) y[(i + t) * ldy + r0 + r] = acc[t];
                    }
                }
            }
        });
        return;
    }
    FOR_THREADS("omp parallel for num_threads(num_threads) schedule(static)", num_threads, row, n, {
        float buf[CHUNK_VALUES] __attribute__((aligned(64)));
        const uint8_t *blocks = w + row * row_bytes;
        for (int64_t i0 = 0; i0 < m; i0 += FUSED_MAX_ROWS) {
            const int64_t count = min64(FUSED_MAX_ROWS, m - i0);
            float acc[FUSED_MAX_ROWS] = {0};
            for (int64_t b0 = 0; b0 < blocks_per_row; b0 += chunk_blocks) {
                const int64_t num_blocks = min64(chunk_blocks, blocks_per_row - b0);
                const int64_t offset = b0 * f->block_values;
                const int64_t len = num_blocks * f->block_values;
                dequant(blocks + b0 * f->block_bytes, buf, num_blocks);
                for (int64_t i = 0; i < count; i++)
                    acc[i] += dot(buf, x + (i0 + i) * ldx + offset, len);
            }
            for (int64_t i = 0; i < count; i++) y[(i0 + i) * ldy + row] = acc[i];
        }
    });
}

/* Rows of W per panel within `bytes` of float32, a multiple of 16 rows, the panels split
 * evenly over the threads where W allows it. */
static int64_t panel_rows_within(int64_t n, int64_t k, int num_threads, int64_t bytes) {
    int64_t most = bytes / (int64_t)(k * sizeof(float));
    most = most < 16 ? 16 : most - most % 16;
    const int64_t rounds = (n + most * num_threads - 1) / (most * num_threads);
    const int64_t per_panel = (n + rounds * num_threads - 1) / (rounds * num_threads);
    return (per_panel + 15) / 16 * 16;
}

/* Rows of W per panel: the panel fits PANEL_BYTES (the native GEMM's: at least
 * NATIVE_PANEL_ROWS rows, or within ONE_STRIP_PANEL_BYTES for one strip of input rows), a
 * multiple of 16 rows, and the panels split evenly over the threads where W allows it. */
static int64_t panel_rows(int64_t n, int64_t k, int64_t m, int num_threads, int native) {
    const int64_t row_bytes = k * (int64_t)sizeof(float);
    int64_t bytes = PANEL_BYTES;
    if (native && m <= GEMM_TOKENS) /* read once, by one strip: let it stay in the L2 */
        bytes = ONE_STRIP_PANEL_BYTES;
    else if (native && bytes < NATIVE_PANEL_ROWS * row_bytes)
        bytes = NATIVE_PANEL_ROWS * row_bytes;
    return panel_rows_within(n, k, num_threads, bytes);
}

static __thread float *panel_buf;
static __thread int64_t panel_cap;
static __thread float *packed_x;
static __thread int64_t packed_cap;

/* Dequantized panels of W (float32 weights: the rows in place) times x through the BLAS
 * sgemm, each thread's panels one sgemm call of one thread each (gemm_f32.c's panels:
 * native_panels). */
static int blas_panels(const struct quant_format *f, int isa, const uint8_t *w,
                       int64_t row_bytes, int64_t n, int64_t k, const float *x, int64_t ldx,
                       int64_t m, float *y, int64_t ldy, int num_threads) {
    const dequant_fn dequant = f->dequant[isa];
    const int64_t blocks_per_row = k / f->block_values;
    const int64_t rows = panel_rows(n, k, m, num_threads, 0);
    const int64_t num_panels = (n + rows - 1) / rows;
    const int in_place = f->type == QT_F32;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        if (!in_place) gemm_reserve(&panel_buf, &panel_cap, rows * k); /* NULL: failed */
        const int previous = blas_set_threads_local ? blas_set_threads_local(1) : 0;
#pragma omp for schedule(static)
        for (int64_t p = 0; p < num_panels; p++) {
            if (!in_place && !panel_buf) {
                failed = 1;
                continue;
            }
            const int64_t first = p * rows, count = min64(rows, n - first);
            const float *panel = in_place ? (const float *)(w + first * row_bytes) : panel_buf;
            for (int64_t r = 0; !in_place && r < count; r++)
                dequant(w + (first + r) * row_bytes, panel_buf + r * k, blocks_per_row);
            /* Column-major view: y^T[first:first+count, :] = panel (count x k) @ x^T (k x m). */
            const int ic = (int)count, im = (int)m, ik = (int)k, ildx = (int)ldx,
                      ildy = (int)ldy;
            const float one = 1.0f, zero = 0.0f;
            blas_sgemm("T", "N", &ic, &im, &ik, &one, panel, &ik, x, &ildx, &zero, y + first,
                       &ildy);
        }
        if (blas_set_threads_local) blas_set_threads_local(previous);
    }
    return failed ? QUANT_E_MEMORY : 0;
}

/* Dequantized panels of W (float32 weights: the rows in place) times x through gemm_f32.c,
 * for the parts of one projection (each its own format, fs[p], with ns[p] rows, all k long;
 * one part: a plain product), their outputs side by side in y: x packed once by all threads
 * for all parts, then all parts' panels shared among the threads in one parallel region
 * (dynamically: they need not be of one size). A panel's rows are k + PANEL_PAD floats apart:
 * at k floats (a multiple of 4 KiB at the usual widths) the micro-kernel's rows would fall in
 * the same L1 sets. An output's sum does not depend on the panel it is in, so each part's
 * outputs have the bits they have alone. */
static int native_panels(int num_parts, const struct quant_format *const *fs, int isa,
                        const void *const *ws, const int64_t *ns, int64_t k, const float *x,
                        int64_t ldx, int64_t m, float *y, int64_t ldy, int num_threads) {
    if (gemm_reserve(&packed_x, &packed_cap, gemm_packed_floats(m, k)))
        return QUANT_E_MEMORY;
    float *const xt = packed_x; /* this thread's buffer, shared with the team below */
    int64_t rows[QUANT_MAX_PARTS], first_unit[QUANT_MAX_PARTS + 1], col[QUANT_MAX_PARTS];
    int64_t most = 0; /* rows of the largest dequantized panel */
    first_unit[0] = 0;
    for (int p = 0; p < num_parts; p++) {
        rows[p] = panel_rows(ns[p], k, m, num_threads, 1);
        first_unit[p + 1] = first_unit[p] + (ns[p] + rows[p] - 1) / rows[p];
        col[p] = p ? col[p - 1] + ns[p - 1] : 0;
        if (fs[p]->type != QT_F32 && rows[p] > most) most = rows[p];
    }
    const int64_t ldp = k + PANEL_PAD;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < (m + GEMM_TOKENS - 1) / GEMM_TOKENS; t++)
            gemm_pack_x(isa, x, ldx, m, k, xt, t);
        if (most) gemm_reserve(&panel_buf, &panel_cap, most * ldp); /* NULL: failed */
#pragma omp for schedule(dynamic, 1)
        for (int64_t u = 0; u < first_unit[num_parts]; u++) {
            int p = 0;
            while (u >= first_unit[p + 1]) p++;
            const struct quant_format *f = fs[p];
            const int in_place = f->type == QT_F32;
            if (!in_place && !panel_buf) {
                failed = 1;
                continue;
            }
            const int64_t row_bytes = k / f->block_values * f->block_bytes;
            const int64_t first = (u - first_unit[p]) * rows[p];
            const int64_t count = min64(rows[p], ns[p] - first);
            const uint8_t *w = (const uint8_t *)ws[p] + first * row_bytes;
            for (int64_t r = 0; !in_place && r < count; r++)
                f->dequant[isa](w + r * row_bytes, panel_buf + r * ldp, k / f->block_values);
            gemm_panel(isa, xt, m, k, in_place ? (const float *)w : panel_buf,
                       in_place ? k : ldp, count, y + col[p] + first, ldy);
        }
    }
    return failed ? QUANT_E_MEMORY : 0;
}

/* ---- entry points ------------------------------------------------------------------------- */

/* Batches of up to this many input rows take the fused path (pagecli_quant_set_fused_rows):
 * FUSED_MAX_ROWS unless a caller asked for more. */
static int fused_rows = FUSED_MAX_ROWS;

/* Batches of up to `rows` input rows (1..FUSED_ROWS_LIMIT) take the fused path, whose every
 * output sums in the order it has at one input row, whatever the batch; larger batches take
 * the panels or tiles (their own order). 0 restores FUSED_MAX_ROWS; -1 for any other value.
 * Speculative decoding asks for its verify batches' size: a row checked beside its drafts
 * then gets the bits it gets alone. */
int pagecli_quant_set_fused_rows(int rows) {
    if (rows < 0 || rows > FUSED_ROWS_LIMIT) return -1;
    fused_rows = rows ? rows : FUSED_MAX_ROWS;
    return 0;
}

/* The number of input rows up to which batches take the fused path now. */
int pagecli_quant_fused_rows(void) { return fused_rows; }

/* Bytes of one row of k values of `type` (-1: an unknown type, or k not whole blocks). */
int64_t pagecli_quant_row_bytes(int type, int64_t k) {
    const struct quant_format *f = format_of(type);
    if (!f || k % f->block_values) return -1;
    return k / f->block_values * f->block_bytes;
}

/* y[m, n] = x[m, k] @ dequant(W[n, k]).T */
int pagecli_quant_linear(int type, const void *w, int64_t n, int64_t k, const float *x,
                         int64_t ldx, int64_t m, float *y, int64_t ldy, int num_threads) {
    const struct quant_format *f = format_of(type);
    if (!f || k % f->block_values) return QUANT_E_FORMAT;
    const int isa = pagecli_quant_isa();
    const int64_t row_bytes = k / f->block_values * f->block_bytes;
    const int fits_int = n < (1LL << 31) && k < (1LL << 31) && m < (1LL << 31) &&
                         ldx < (1LL << 31) && ldy < (1LL << 31);
    if (m <= fused_rows) {
        fused(f, isa, w, row_bytes, n, k, x, ldx, m, y, ldy, num_threads);
        return 0;
    }
    if (pagecli_quant_tiles() && pagecli_quant_tiles_format(type))
        return pagecli_quant_tiles_linear(type, w, row_bytes, n, k, x, ldx, m, y, ldy,
                                          num_threads);
    const int gemm = gemm_for(m, k);
    if (gemm == GEMM_NATIVE)
        return native_panels(1, &f, isa, &w, &n, k, x, ldx, m, y, ldy, num_threads);
    if (gemm == GEMM_BLAS && fits_int)
        return blas_panels(f, isa, w, row_bytes, n, k, x, ldx, m, y, ldy, num_threads);
    fused(f, isa, w, row_bytes, n, k, x, ldx, m, y, ldy, num_threads);
    return 0;
}

/* pagecli_quant_linear for the parts of one projection, y[m, sum of rows] = x @ [W_0; W_1;
 * ...].T, each part (types[p], ws[p], rows[p] rows of k values) into its columns of y, with
 * the bits that part has alone. Where every part takes the native panels, x is packed once
 * and one parallel region takes all their panels (a GGUF file's q/k/v, three tensors of its
 * map, packed x three times and waited at three barriers); otherwise part after part. */
int pagecli_quant_linear_parts(int num_parts, const int *types, const void *const *ws,
                               const int64_t *rows, int64_t k, const float *x, int64_t ldx,
                               int64_t m, float *y, int64_t ldy, int num_threads) {
    if (num_parts < 1 || num_parts > QUANT_MAX_PARTS) return QUANT_E_FORMAT;
    const struct quant_format *fs[QUANT_MAX_PARTS];
    int shared = num_parts > 1 && m > fused_rows && gemm_for(m, k) == GEMM_NATIVE;
    for (int p = 0; p < num_parts; p++) {
        fs[p] = format_of(types[p]);
        if (!fs[p] || k % fs[p]->block_values) return QUANT_E_FORMAT;
        if (pagecli_quant_tiles() && pagecli_quant_tiles_format(types[p])) shared = 0;
    }
    if (shared)
        return native_panels(num_parts, fs, pagecli_quant_isa(), ws, rows, k, x, ldx, m, y,
                             ldy, num_threads);
    int64_t first = 0;
    for (int p = 0; p < num_parts; p++) {
        const int status = pagecli_quant_linear(types[p], ws[p], rows[p], k, x, ldx, m,
                                                y + first, ldy, num_threads);
        if (status) return status;
        first += rows[p];
    }
    return 0;
}

/* out[i, :] = dequant(W[row_ids[i], :]) for i < num_ids (row_ids NULL: rows 0..num_ids). */
int pagecli_quant_dequantize_rows(int type, const void *w, int64_t n, int64_t k,
                                  const int64_t *row_ids, int64_t num_ids, float *out,
                                  int num_threads) {
    const struct quant_format *f = format_of(type);
    if (!f || k % f->block_values) return QUANT_E_FORMAT;
    const dequant_fn dequant = f->dequant[pagecli_quant_isa()];
    const int64_t blocks_per_row = k / f->block_values;
    const int64_t row_bytes = blocks_per_row * f->block_bytes;
    for (int64_t i = 0; row_ids && i < num_ids; i++)
        if (row_ids[i] < 0 || row_ids[i] >= n) return QUANT_E_ROW;
    const uint8_t *rows = w;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_ids > 16)
    for (int64_t i = 0; i < num_ids; i++) {
        const int64_t row = row_ids ? row_ids[i] : i;
        dequant(rows + row * row_bytes, out + i * k, blocks_per_row);
    }
    return 0;
}
