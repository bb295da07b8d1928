/*
 * float32 GEMM for the quantized linear drivers' panel path (quant_linear_cpu.c): y = x @ P.T
 * for a panel P of W's rows, already float32 (a dequantized panel, or float32 weights in
 * place), and many input rows x (prefill, batched decode).
 *
 * Why our own: MKL takes its AVX-512 code on Intel CPUs only. On an AMD EPYC Zen 5 (2 cores,
 * AVX-512 on full-width units) torch's MKL sgemm ran at 155-168 GFLOP/s (64 to 2048 rows x
 * 576 x 1536), oneDNN at 358-413, and the micro-kernel below at 375-433 in a C harness
 * (benchmarks/RESULTS.md). The driver uses it where the CPU has AVX-512 and is not Intel's
 * (pagecli_quant_set_gemm overrides); on a Zen 4, whose AVX-512 runs at AVX2's rate, the
 * two should be about even (not measured).
 *
 * Layout. The micro-kernel vectorizes over input rows ("tokens"), so the panel's rows are
 * read as they are, one float at a time, broadcast: only x is repacked, once per call, into
 * strips of GEMM_TOKENS tokens, xt[strip][kk][j] = x[strip * GEMM_TOKENS + j][kk], zero past
 * m. A micro-block (one micro-kernel call) keeps GEMM_ROWS x GEMM_TOKENS sums in 24 registers
 * over GEMM_CHUNK values of k at a time (each chunk's products summed in order, the chunks'
 * sums then added up), and writes them out transposed, as runs of GEMM_ROWS consecutive floats
 * of y's rows.
 */
#include <stdlib.h>

#include "quant_blocks.h"

#include "gemm_f32.h"

#if QUANT_X86
#include <immintrin.h>

#include "transpose16.h"
#endif

#define GEMM_CHUNK 64 /* values of k summed apart, then added up: error grows with k / 64 + 64 */
#define STRIP_GROUP 8 /* token strips swept per W group: 256 tokens x k stay in the L2 */

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
#endif

/* Strip `strip` of x into xt (64-byte aligned, gemm_packed_floats(m, k) floats in all). */
void gemm_pack_x(int isa, const float *x, int64_t ldx, int64_t m, int64_t k, float *xt,
                 int64_t strip) {
#if QUANT_X86
    if (isa == ISA_AVX512) {
        pack_avx512(x, ldx, m, k, xt, strip);
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
                           float *sums) {
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < GEMM_TOKENS; j++) {
            float total = 0.0f;
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
micro_avx512_r(const float *xt, const float *w, int64_t ldw, int64_t k, float *sums, const int R) {
    for (int64_t k0 = 0; k0 < k; k0 += GEMM_CHUNK) {
        __m512 acc[GEMM_ROWS][2];
        for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
        const int64_t end = min64(k0 + GEMM_CHUNK, k);
        for (int64_t kk = k0; kk < end; kk++) {
            const __m512 x0 = _mm512_load_ps(xt + kk * GEMM_TOKENS);
            const __m512 x1 = _mm512_load_ps(xt + kk * GEMM_TOKENS + 16);
            for (int r = 0; r < R; r++) {
                const __m512 b = _mm512_set1_ps(w[r * ldw + kk]);
                acc[r][0] = _mm512_fmadd_ps(b, x0, acc[r][0]);
                acc[r][1] = _mm512_fmadd_ps(b, x1, acc[r][1]);
            }
        }
        for (int r = 0; r < R; r++) {
            float *s = sums + r * GEMM_TOKENS;
            if (k0) {
                acc[r][0] = _mm512_add_ps(_mm512_load_ps(s), acc[r][0]);
                acc[r][1] = _mm512_add_ps(_mm512_load_ps(s + 16), acc[r][1]);
            }
            _mm512_store_ps(s, acc[r][0]);
            _mm512_store_ps(s + 16, acc[r][1]);
        }
    }
}

TARGET_AVX512 static void micro_avx512(const float *xt, const float *w, int64_t ldw, int64_t k,
                                       int rows, float *sums) {
    GEMM_ROWS_SWITCH(rows, micro_avx512_r, xt, w, ldw, k, sums)
}

/* micro_avx512_r for a strip's first 16 tokens only (a strip of at most 16: a batched decode
 * of up to 16 sequences, or the last strip of a batch), the same sums in the same order. The
 * full strip would spend half its FMAs on the zero tokens past m. */
TARGET_AVX512 static inline __attribute__((always_inline)) void
micro_half_avx512_r(const float *xt, const float *w, int64_t ldw, int64_t k, float *sums,
                    const int R) {
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
            if (k0) acc[r] = _mm512_add_ps(_mm512_load_ps(s), acc[r]);
            _mm512_store_ps(s, acc[r]);
        }
    }
}

TARGET_AVX512 static void micro_half_avx512(const float *xt, const float *w, int64_t ldw,
                                            int64_t k, int rows, float *sums) {
    GEMM_ROWS_SWITCH(rows, micro_half_avx512_r, xt, w, ldw, k, sums)
}
#endif

/* y[tok][r] = the dot product of x's row tok with w's row r, for tok < m and r < count, through
 * `micro` (w's rows ldw 32-bit values apart, x packed by gemm_pack_x; k values of 32 bits each:
 * floats here, bfloat16 pairs in gemm_bf16.c), and through `micro_half` (NULL: none) for a
 * strip of at most 16 tokens. Single-threaded; the drivers split W's rows over the threads. */
void gemm_sweep(int isa, gemm_micro_fn micro, gemm_micro_fn micro_half, const float *xt,
                int64_t m, int64_t k, const float *w, int64_t ldw, int64_t count, float *y,
                int64_t ldy) {
    float sums[GEMM_ROWS * GEMM_TOKENS] __attribute__((aligned(64)));
    const int64_t strips = (m + GEMM_TOKENS - 1) / GEMM_TOKENS;
    for (int64_t t0 = 0; t0 < strips; t0 += STRIP_GROUP)
        for (int64_t r0 = 0; r0 < count; r0 += GEMM_ROWS) {
            const int rows = (int)min64(GEMM_ROWS, count - r0);
            for (int64_t t = t0; t < min64(t0 + STRIP_GROUP, strips); t++) {
                const int64_t tok = t * GEMM_TOKENS;
                const gemm_micro_fn fn = micro_half && m - tok <= 16 ? micro_half : micro;
                fn(xt + t * k * GEMM_TOKENS, w + r0 * ldw, ldw, k, rows, sums);
                gemm_write_sums(isa, sums, rows, min64(GEMM_TOKENS, m - tok), y + tok * ldy + r0,
                                ldy);
            }
        }
}

/* gemm_sweep with the float32 micro-kernel of the path: w's rows at row stride ldw (floats). */
void gemm_panel(int isa, const float *xt, int64_t m, int64_t k, const float *w, int64_t ldw,
                int64_t count, float *y, int64_t ldy) {
    gemm_micro_fn micro = micro_portable, micro_half = NULL;
#if QUANT_X86
    if (isa == ISA_AVX512) micro = micro_avx512, micro_half = micro_half_avx512;
#endif
    gemm_sweep(isa, micro, micro_half, xt, m, k, w, ldw, count, y, ldy);
}
