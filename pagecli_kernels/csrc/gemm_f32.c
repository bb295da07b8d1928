/*
 * float32 GEMM for the quantized linear drivers' panel path (quant_linear_cpu.c): y = x @ P.T
 * for a panel P of W's rows, already float32 (a dequantized panel, or float32 weights in
 * place), and many input rows x (prefill, batched decode).
 *
 * Why our own: MKL takes its AVX-512 code on Intel CPUs only. On an AMD EPYC Zen 5 (2 cores,
 * AVX-512 on full-width units) torch's MKL sgemm ran at 155-168 GFLOP/s (64 to 2048 rows x
 * 576 x 1536), oneDNN at 358-413, and the micro-kernel below at 375-433 in a C harness
 * (benchmarks/RESULTS.md). On an AMD EPYC Zen 3 (AVX2, 2 cores), at Llama-3.2-1B's Q4_K
 * projections over 512 rows, MKL's AVX2 sgemm ran the panels at 0.73 of the FMA peak and the
 * AVX2 micro-kernel below at 0.78 (its down projection, k = 8192: 108-130 against 139-162
 * GFLOP/s), and at 16 rows (batched decode) 61-76 against 82-108; a 16-sequence decode of
 * that 1B went from 35.7 to 53.2 tokens/s. The driver uses it where the CPU is not Intel's,
 * on the AVX-512 and AVX2 paths (pagecli_quant_set_gemm overrides).
 *
 * Layout. The micro-kernel vectorizes over input rows ("tokens"), so the panel's rows are
 * read as they are, one float at a time, broadcast: only x is repacked, once per call, into
 * strips of GEMM_TOKENS tokens, xt[strip][kk][j] = x[strip * GEMM_TOKENS + j][kk], zero past
 * m. A micro-block (one micro-kernel call) keeps GEMM_ROWS x GEMM_TOKENS sums in 24 registers
 * over GEMM_CHUNK values of k at a time (each chunk's products summed in order, the chunks'
 * sums then added up), and writes them out transposed, as runs of GEMM_ROWS consecutive floats
 * of y's rows. The AVX2 micro-kernel takes the same micro-block in parts of 6 rows x 16 tokens
 * (16 registers), and a last half of at most 8 tokens in one part of 12 rows x 8 tokens, each
 * sum in the same order, so the paths agree bit for bit. The sweep blocks k for the caches
 * without changing that order (gemm_sweep).
 */
#include <stdlib.h>
#include <string.h>

#include "quant_blocks.h"

#include "gemm_f32.h"

#if QUANT_X86
#include <immintrin.h>

#include "transpose16.h"
#endif

#define GEMM_CHUNK 64 /* values of k summed apart, then added up: error grows with k / 64 + 64 */
/* Values of k ahead of the one it multiplies that the AVX-512 micro-kernel asks for x into the
 * L1 (8 KiB of the strip ahead). A micro-block's 32 KiB of x comes from the L2 or beyond, and
 * the hardware prefetcher left the FMAs waiting on it: on an AMD EPYC Zen 5, one thread, a
 * 128-row panel over 512 tokens ran at 0.78-0.81 of the FMA peak without, 0.85 with (k 2048),
 * and 0.72 against 0.85 at k 8192 (benchmarks/RESULTS.md). */
#define X_AHEAD 64
#define STRIP_GROUP 4 /* token strips swept at a time: 128 tokens */
#define SWEEP_K 256   /* values of k swept at a time: a group's x, 128 KiB, stays in the L2 */

static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* *buf holds at least `need` floats, 64-byte aligned: a thread's work buffer, kept for its
 * next call and grown when too small. Returns 0, or -1 (then *buf is NULL) without memory. */
int gemm_reserve(float **buf, int64_t *cap, int64_t need) {
    if (*cap >= need) return 0;
    free(*buf);
    *buf = aligned_alloc(64, (size_t)((need * (int64_t)sizeof(float) + 63) / 64 * 64));
    *cap = *buf ? need : 0;
    return *buf ? 0 : -1;
}

/* ---- packing x ------------------------------------------------------------------------------ */

static void pack_portable(const float *x, int64_t ldx, int64_t m, int64_t k, float *xt,
                          int64_t strip) {
    float *dst = xt + strip * k * GEMM_TOKENS;
    for (int64_t kk = 0; kk < k; kk++)
        for (int j = 0; j < GEMM_TOKENS; j++) {
            const int64_t tok = strip * GEMM_TOKENS + j;
            dst[kk * GEMM_TOKENS + j] = tok < m ? x[tok * ldx + kk] : 0.0f;
        }
}

#if QUANT_X86
TARGET_AVX512 static void pack_avx512(const float *x, int64_t ldx, int64_t m, int64_t k,
                                      float *xt, int64_t strip) {
    float *dst = xt + strip * k * GEMM_TOKENS;
    for (int half = 0; half < GEMM_TOKENS / 16; half++) {
        const int64_t tok0 = strip * GEMM_TOKENS + half * 16;
        for (int64_t kk = 0; kk < k; kk += 16) { /* k is whole 32-value blocks */
            __m512 r[16];
            for (int j = 0; j < 16; j++)
                r[j] = tok0 + j < m ? _mm512_loadu_ps(x + (tok0 + j) * ldx + kk)
                                    : _mm512_setzero_ps();
            transpose16(r);
            for (int i = 0; i < 16; i++)
                _mm512_store_ps(dst + (kk + i) * GEMM_TOKENS + half * 16, r[i]);
        }
    }
}

/* r[i] (8 rows of 8 floats) transposed in place. */
TARGET_AVX2 static inline __attribute__((always_inline)) void transpose8(__m256 r[8]) {
    __m256 t[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++)
        for (int h = 0; h < 2; h++) {
            r[4 * i + 2 * h] = _mm256_shuffle_ps(t[4 * i + h], t[4 * i + h + 2], 0x44);
            r[4 * i + 2 * h + 1] = _mm256_shuffle_ps(t[4 * i + h], t[4 * i + h + 2], 0xEE);
        }
    /* each 128-bit half now holds a 4 x 4 transposed quad: swap the quads across the rows */
    for (int i = 0; i < 4; i++) {
        t[i] = _mm256_permute2f128_ps(r[i], r[i + 4], 0x20);
        t[i + 4] = _mm256_permute2f128_ps(r[i], r[i + 4], 0x31);
    }
    for (int i = 0; i < 8; i++) r[i] = t[i];
}

TARGET_AVX2 static void pack_avx2(const float *x, int64_t ldx, int64_t m, int64_t k, float *xt,
                                  int64_t strip) {
    float *dst = xt + strip * k * GEMM_TOKENS;
    for (int part = 0; part < GEMM_TOKENS / 8; part++) {
        const int64_t tok0 = strip * GEMM_TOKENS + part * 8;
        for (int64_t kk = 0; kk < k; kk += 8) { /* k is whole 32-value blocks */
            __m256 r[8];
            for (int j = 0; j < 8; j++)
                r[j] = tok0 + j < m ? _mm256_loadu_ps(x + (tok0 + j) * ldx + kk)
                                    : _mm256_setzero_ps();
            transpose8(r);
            for (int i = 0; i < 8; i++)
                _mm256_store_ps(dst + (kk + i) * GEMM_TOKENS + part * 8, r[i]);
        }
    }
}
#endif

/* Strip `strip` of x into xt (64-byte aligned, gemm_packed_floats(m, k) floats in all). */
void gemm_pack_x(int isa, const float *x, int64_t ldx, int64_t m, int64_t k, float *xt,
                 int64_t strip) {
#if QUANT_X86
    if (isa == ISA_AVX512) {
        pack_avx512(x, ldx, m, k, xt, strip);
        return;
    }
    if (isa == ISA_AVX2) {
        pack_avx2(x, ldx, m, k, xt, strip);
        return;
    }
#endif
    (void)isa;
    pack_portable(x, ldx, m, k, xt, strip);
}

/* ---- micro-kernels -------------------------------------------------------------------------- */

/* y[tok][r] for the tokens of one strip (fewer where the strip passes m) and `rows` panel rows. */
static void write_sums(const float *sums, int rows, int64_t tokens, float *y, int64_t ldy) {
    for (int64_t j = 0; j < tokens; j++)
        for (int r = 0; r < rows; r++) y[j * ldy + r] = sums[r * GEMM_TOKENS + j];
}

static void micro_portable(const float *xt, const float *w, int64_t ldw, int64_t k, int rows,
                           int tokens, float *sums, int accumulate) {
    (void)tokens;
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < GEMM_TOKENS; j++) {
            float total = accumulate ? sums[r * GEMM_TOKENS + j] : 0.0f;
            for (int64_t k0 = 0; k0 < k; k0 += GEMM_CHUNK) {
                float s = 0.0f;
                for (int64_t kk = k0; kk < min64(k0 + GEMM_CHUNK, k); kk++)
                    s += w[r * ldw + kk] * xt[kk * GEMM_TOKENS + j];
                total += s;
            }
            sums[r * GEMM_TOKENS + j] = total;
        }
}

#if QUANT_X86
/* write_sums with the sums transposed 16 x 16 in registers: a masked store of `rows` floats
 * per token instead of a scalar store per value. */
TARGET_AVX512 static void write_sums_avx512(const float *sums, int rows, int64_t tokens,
                                            float *y, int64_t ldy) {
    const __mmask16 mask = (__mmask16)((1u << rows) - 1);
    for (int half = 0; half * 16 < tokens; half++) {
        __m512 r[16];
        for (int i = 0; i < 16; i++)
            r[i] = i < rows ? _mm512_load_ps(sums + i * GEMM_TOKENS + half * 16)
                            : _mm512_setzero_ps();
        transpose16(r);
        const int64_t count = min64(16, tokens - half * 16);
        for (int j = 0; j < count; j++)
            _mm512_mask_storeu_ps(y + (half * 16 + j) * ldy, mask, r[j]);
    }
}

#endif

/* y[j][r] = sums[r * GEMM_TOKENS + j] for j < tokens <= GEMM_TOKENS and r < rows <= 16: a
 * micro-block's sums (or 16 of its rows) written out as runs of `rows` floats of y's rows. */
void gemm_write_sums(int isa, const float *sums, int rows, int64_t tokens, float *y,
                     int64_t ldy) {
#if QUANT_X86
    if (isa == ISA_AVX512) {
        write_sums_avx512(sums, rows, tokens, y, ldy);
        return;
    }
#endif
    (void)isa;
    write_sums(sums, rows, tokens, y, ldy);
}

#if QUANT_X86
/* One copy per constant R (1..GEMM_ROWS): R x 2 sums of 16 tokens in registers, over
 * GEMM_CHUNK values of k at a time, each chunk's sums then added to the micro-block's. */
TARGET_AVX512 static inline __attribute__((always_inline)) void
micro_avx512_r(const float *xt, const float *w, int64_t ldw, int64_t k, float *sums, int accumulate,
               const int R) {
    for (int64_t k0 = 0; k0 < k; k0 += GEMM_CHUNK) {
        __m512 acc[GEMM_ROWS][2];
        for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
        const int64_t end = min64(k0 + GEMM_CHUNK, k);
        for (int64_t kk = k0; kk < end; kk++) {
            const __m512 x0 = _mm512_load_ps(xt + kk * GEMM_TOKENS);
            const __m512 x1 = _mm512_load_ps(xt + kk * GEMM_TOKENS + 16);
            _mm_prefetch((const char *)(xt + (kk + X_AHEAD) * GEMM_TOKENS), _MM_HINT_T0);
            _mm_prefetch((const char *)(xt + (kk + X_AHEAD) * GEMM_TOKENS + 16), _MM_HINT_T0);
            for (int r = 0; r < R; r++) {
                const __m512 b = _mm512_set1_ps(w[r * ldw + kk]);
                acc[r][0] = _mm512_fmadd_ps(b, x0, acc[r][0]);
                acc[r][1] = _mm512_fmadd_ps(b, x1, acc[r][1]);
            }
        }
        for (int r = 0; r < R; r++) {
            float *s = sums + r * GEMM_TOKENS;
            if (k0 || accumulate) {
                acc[r][0] = _mm512_add_ps(_mm512_load_ps(s), acc[r][0]);
                acc[r][1] = _mm512_add_ps(_mm512_load_ps(s + 16), acc[r][1]);
            }
            _mm512_store_ps(s, acc[r][0]);
            _mm512_store_ps(s + 16, acc[r][1]);
        }
    }
}

TARGET_AVX512 static void micro_avx512(const float *xt, const float *w, int64_t ldw, int64_t k,
                                       int rows, int tokens, float *sums, int accumulate) {
    (void)tokens;
    GEMM_ROWS_SWITCH(rows, micro_avx512_r, xt, w, ldw, k, sums, accumulate)
}

/* micro_avx512_r for a strip's first 16 tokens only (a strip of at most 16: a batched decode
 * of up to 16 sequences, or the last strip of a batch), the same sums in the same order. The
 * full strip would spend half its FMAs on the zero tokens past m. */
TARGET_AVX512 static inline __attribute__((always_inline)) void
micro_half_avx512_r(const float *xt, const float *w, int64_t ldw, int64_t k, float *sums,
                    int accumulate, const int R) {
    for (int64_t k0 = 0; k0 < k; k0 += GEMM_CHUNK) {
        __m512 acc[GEMM_ROWS];
        for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
        const int64_t end = min64(k0 + GEMM_CHUNK, k);
        for (int64_t kk = k0; kk < end; kk++) {
            const __m512 x0 = _mm512_load_ps(xt + kk * GEMM_TOKENS);
            for (int r = 0; r < R; r++)
                acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(w[r * ldw + kk]), x0, acc[r]);
        }
        for (int r = 0; r < R; r++) {
            float *s = sums + r * GEMM_TOKENS;
            if (k0 || accumulate) acc[r] = _mm512_add_ps(_mm512_load_ps(s), acc[r]);
            _mm512_store_ps(s, acc[r]);
        }
    }
}

TARGET_AVX512 static void micro_half_avx512(const float *xt, const float *w, int64_t ldw,
                                            int64_t k, int rows, int tokens, float *sums,
                                            int accumulate) {
    (void)tokens;
    GEMM_ROWS_SWITCH(rows, micro_half_avx512_r, xt, w, ldw, k, sums, accumulate)
}

/* AVX2 has 16 registers: a micro-block's sums are taken AVX2_ROWS rows x 16 tokens at a time
 * (12 sums, the 2 vectors of x and a broadcast weight), each part over one chunk of k while
 * the chunk's x (GEMM_CHUNK x GEMM_TOKENS floats) and W (GEMM_ROWS x GEMM_CHUNK) stay in L1.
 * Each sum is the AVX-512 kernel's: a chunk's products in order by FMA, the chunks' sums then
 * added up, so the two paths give the same bits. */
#define AVX2_ROWS 6

TARGET_AVX2 static inline __attribute__((always_inline)) void
micro_avx2_part(const float *xt, const float *w, int64_t ldw, int64_t k0, int64_t end,
                float *sums, int add, const int R) {
    __m256 acc[AVX2_ROWS][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t kk = k0; kk < end; kk++) {
        const __m256 x0 = _mm256_load_ps(xt + kk * GEMM_TOKENS);
        const __m256 x1 = _mm256_load_ps(xt + kk * GEMM_TOKENS + 8);
        for (int r = 0; r < R; r++) {
            const __m256 b = _mm256_broadcast_ss(w + r * ldw + kk);
            acc[r][0] = _mm256_fmadd_ps(b, x0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(b, x1, acc[r][1]);
        }
    }
    for (int r = 0; r < R; r++) {
        float *s = sums + r * GEMM_TOKENS;
        if (add) {
            acc[r][0] = _mm256_add_ps(_mm256_load_ps(s), acc[r][0]);
            acc[r][1] = _mm256_add_ps(_mm256_load_ps(s + 8), acc[r][1]);
        }
        _mm256_store_ps(s, acc[r][0]);
        _mm256_store_ps(s + 8, acc[r][1]);
    }
}

/* Rows r0.. (count of them, at most AVX2_ROWS) x the 16 tokens at `half` of the strip. */
TARGET_AVX2 static inline __attribute__((always_inline)) void
micro_avx2_rows(const float *xt, const float *w, int64_t ldw, int64_t k0, int64_t end,
                float *sums, int add, int half, int count) {
    const float *x = xt + 16 * half;
    float *s = sums + 16 * half;
    switch (count) {
    case 1: micro_avx2_part(x, w, ldw, k0, end, s, add, 1); break;
    case 2: micro_avx2_part(x, w, ldw, k0, end, s, add, 2); break;
    case 3: micro_avx2_part(x, w, ldw, k0, end, s, add, 3); break;
    case 4: micro_avx2_part(x, w, ldw, k0, end, s, add, 4); break;
    case 5: micro_avx2_part(x, w, ldw, k0, end, s, add, 5); break;
    default: micro_avx2_part(x, w, ldw, k0, end, s, add, AVX2_ROWS); break;
    }
}

/* R rows (at most GEMM_ROWS) x the 8 tokens from `at`: a last half of at most 8 tokens (12
 * sums, one vector of x), the same sums lane by lane. */
TARGET_AVX2 static inline __attribute__((always_inline)) void
micro_avx2_quarter(const float *xt, const float *w, int64_t ldw, int64_t k0, int64_t end,
                   float *sums, int add, const int R) {
    __m256 acc[GEMM_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t kk = k0; kk < end; kk++) {
        const __m256 x0 = _mm256_load_ps(xt + kk * GEMM_TOKENS);
        for (int r = 0; r < R; r++)
            acc[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(w + r * ldw + kk), x0, acc[r]);
    }
    for (int r = 0; r < R; r++) {
        float *s = sums + r * GEMM_TOKENS;
        if (add) acc[r] = _mm256_add_ps(_mm256_load_ps(s), acc[r]);
        _mm256_store_ps(s, acc[r]);
    }
}

/* The micro-block's first `tokens` tokens (1..GEMM_TOKENS): 16-token halves by parts of
 * AVX2_ROWS rows, and a last half of at most 8 tokens by micro_avx2_quarter over all rows. The
 * sums past `tokens` in a half that is computed are zeros' sums; the others are left. */
TARGET_AVX2 static inline __attribute__((always_inline)) void
micro_avx2_tokens(const float *xt, const float *w, int64_t ldw, int64_t k, int rows, int tokens,
                  float *sums, int accumulate) {
    const int halves = tokens > 16 ? 2 : 1, last = tokens - 16 * (halves - 1);
    const int full = last > 8 ? halves : halves - 1; /* halves taken whole */
    for (int64_t k0 = 0; k0 < k; k0 += GEMM_CHUNK) {
        const int64_t end = min64(k0 + GEMM_CHUNK, k);
        const int add = k0 || accumulate;
        for (int r0 = 0; r0 < rows; r0 += AVX2_ROWS) {
            const int count = rows - r0 < AVX2_ROWS ? rows - r0 : AVX2_ROWS;
            for (int half = 0; half < full; half++)
                micro_avx2_rows(xt, w + r0 * ldw, ldw, k0, end, sums + r0 * GEMM_TOKENS, add,
                                half, count);
        }
        if (full < halves) {
            const int at = 16 * full;
            GEMM_ROWS_SWITCH(rows, micro_avx2_quarter, xt + at, w, ldw, k0, end, sums + at, add)
        }
    }
}

TARGET_AVX2 static void micro_avx2(const float *xt, const float *w, int64_t ldw, int64_t k,
                                   int rows, int tokens, float *sums, int accumulate) {
    micro_avx2_tokens(xt, w, ldw, k, rows, tokens, sums, accumulate);
}

#endif

/* y[tok][r] = the dot product of x's row tok with w's row r, for tok < m and r < count, through
 * `micro` (w's rows ldw 32-bit values apart, x packed by gemm_pack_x; k values of 32 bits each:
 * floats here, bfloat16 pairs in gemm_bf16.c), and through `micro_half` (NULL: none) for a
 * strip of at most 16 tokens. Single-threaded; the drivers split W's rows over the threads.
 *
 * Blocked for the caches: STRIP_GROUP strips at a time, and within them SWEEP_K values of k at
 * a time, swept by every micro-block of W's rows while that block of x stays in the L2 (a
 * strip of x over all of k is 256 KiB at k = 2048, 1 MiB at 8192). The sums of each
 * (micro-block, strip) wait in a buffer between the blocks of k, and each block continues
 * them (the micro-kernels' `accumulate`), so every sum keeps the order of one pass over k.
 *
 * The finished sums of a group of strips go to a staging buffer first, each token's `count`
 * outputs side by side, and then to y as one run of whole cache lines a token. Written to y
 * directly, each micro-block put 12 floats in each of 32 rows of y, rows ldy floats apart: at
 * the widths of a model's projections (ldy a multiple of 1024 floats) all of them in one set of
 * the L1 and, at 16384 (a 1B's gate and up), of the L2, partial lines that each of the next
 * micro-blocks fetched again (one thread, 128 rows x 2048 x 512 tokens on an AMD EPYC Zen 5:
 * 0.88 of the FMA peak with y 16384 floats wide against 0.92 with y 128 wide; staged, 0.92). */
void gemm_sweep(int isa, gemm_micro_fn micro, gemm_micro_fn micro_half, const float *xt,
                int64_t m, int64_t k, const float *w, int64_t ldw, int64_t count, float *y,
                int64_t ldy) {
    static __thread float *store;
    static __thread int64_t store_cap;
    float one[GEMM_ROWS * GEMM_TOKENS] __attribute__((aligned(64)));
    const int64_t strips = (m + GEMM_TOKENS - 1) / GEMM_TOKENS;
    const int64_t blocks = (count + GEMM_ROWS - 1) / GEMM_ROWS;
    const int64_t block_floats = GEMM_ROWS * GEMM_TOKENS;
    /* one block of k (k is short, or no store could be had) keeps each sum in `one` */
    const int kblocks = k > SWEEP_K &&
                        !gemm_reserve(&store, &store_cap, blocks * STRIP_GROUP * block_floats);
    const int64_t step = kblocks ? SWEEP_K : k;
    static __thread float *stage;
    static __thread int64_t stage_cap;
    const int64_t lds = (count + 15) / 16 * 16; /* each token's row: whole lines */
    const int staged = !gemm_reserve(&stage, &stage_cap, lds * STRIP_GROUP * GEMM_TOKENS);
    for (int64_t t0 = 0; t0 < strips; t0 += STRIP_GROUP) {
        const int64_t t1 = min64(t0 + STRIP_GROUP, strips);
        for (int64_t k0 = 0; k0 < k; k0 += step) {
            const int64_t kc = min64(step, k - k0), last = k0 + kc == k;
            for (int64_t b = 0; b < blocks; b++) {
                const int64_t r0 = b * GEMM_ROWS;
                const int rows = (int)min64(GEMM_ROWS, count - r0);
                for (int64_t t = t0; t < t1; t++) {
                    const int64_t tok = t * GEMM_TOKENS;
                    const gemm_micro_fn fn = micro_half && m - tok <= 16 ? micro_half : micro;
                    float *sums = kblocks ? store + (b * STRIP_GROUP + t - t0) * block_floats : one;
                    fn(xt + (t * k + k0) * GEMM_TOKENS, w + r0 * ldw + k0, ldw, kc, rows,
                       (int)min64(GEMM_TOKENS, m - tok), sums, k0 > 0);
                    if (last)
                        gemm_write_sums(isa, sums, rows, min64(GEMM_TOKENS, m - tok),
                                        staged ? stage + (t - t0) * GEMM_TOKENS * lds + r0
                                               : y + tok * ldy + r0,
                                        staged ? lds : ldy);
                }
            }
            if (last && staged)
                for (int64_t j = t0 * GEMM_TOKENS; j < min64(t1 * GEMM_TOKENS, m); j++)
                    memcpy(y + j * ldy, stage + (j - t0 * GEMM_TOKENS) * lds,
                           (size_t)count * sizeof(float));
        }
    }
}

/* gemm_sweep with the float32 micro-kernel of the path: w's rows at row stride ldw (floats). */
void gemm_panel(int isa, const float *xt, int64_t m, int64_t k, const float *w, int64_t ldw,
                int64_t count, float *y, int64_t ldy) {
    gemm_micro_fn micro = micro_portable, micro_half = NULL;
#if QUANT_X86
    if (isa == ISA_AVX512) micro = micro_avx512, micro_half = micro_half_avx512;
    if (isa == ISA_AVX2) micro = micro_avx2; /* it takes the strip's tokens by halves itself */
#endif
    gemm_sweep(isa, micro, micro_half, xt, m, k, w, ldw, count, y, ldy);
}
