/*
 * bfloat16 products with float32 sums, y[m, n] = x[m, k] @ W[n, k].T with x and W bfloat16 and
 * y float32: a bfloat16 model's projections on the CPU (layers/linear.BF16Linear, and
 * layer_program_cpu.c in bfloat16, which must run the same kernel to stay bit for bit).
 *
 * Why our own: torch's bfloat16 GEMM (oneDNN) cannot be called from the one-call decoder
 * layers, and the Python loop around it cost a 64-sequence bfloat16 decode step 10-15 ms of
 * host time (benchmarks/step_floor.py). On CPUs with AVX512_BF16, VDPBF16PS multiplies
 * bfloat16 pairs exactly and adds them into float32 sums, as oneDNN's kernels there do.
 *
 * Numerics: a product of two bfloat16 values is exact in float32. Each pair's two products are
 * added to a running float32 sum one after the other (VDPBF16PS, which also takes denormal
 * inputs and results as zero), over PAIR_CHUNK pairs at a time; the chunks' sums are then
 * added up. The portable loop does the same in C (odd value first, as Intel documents the
 * instruction; denormals kept). So the result is the float64 dot product up to float32
 * rounding of the sums, as with oneDNN, in another order.
 *
 * Paths, by the number of input rows m:
 *   - m <= pagecli_quant_fused_rows() (decode: 8 unless a step with drafts or the user asked
 *     for more): x widened to float32 (exact), then quant_linear_cpu.c's bfloat16 row kernels,
 *     which stream W once at memory speed (quant_bf16.c) and give each row the bits it has
 *     alone (speculative decoding's verify rows);
 *   - larger m, as pagecli_bf16_gemm() says:
 *       - AMX's tiles (CPUs with AMX) or the pair GEMM: x's bfloat16 pairs (32 bits each)
 *         packed into token strips by gemm_f32.c's packer, then each thread sweeps a
 *         micro-kernel over its panels of W's rows, in place: the tiles hold AMX_ROWS rows x
 *         GEMM_TOKENS tokens of sums in four tiles, W's rows loaded into tiles as they lie
 *         (tiles_sweep); the pair GEMM (gemm_f32.c's gemm_sweep) GEMM_ROWS rows x
 *         GEMM_TOKENS tokens of sums in 24 registers, each W pair broadcast from its row;
 *       - "float32" (CPUs without native bfloat16 products on the AVX2 path), or "off" when
 *         called anyway: x widened and quant_linear's float32 panels.
 * The pair GEMM runs VDPBF16PS on the AVX-512 path of a CPU with AVX512_BF16, the portable
 * loop elsewhere (tests force it there with pagecli_bf16_set_gemm). On AMX CPUs the tiles
 * beat oneDNN's own AMX GEMM up to a few hundred rows (BF16Linear.TILES_ROWS); there the pair
 * GEMM ran at 220 GFLOP/s, under float32's 330.
 */
#include <omp.h>
#include <stdlib.h>

#include "quant_blocks.h"

#include "amx.h"
#include "bf16.h"
#include "cpu_entry_points.h"
#include "cpu_features.h"
#include "gemm_f32.h"

/* VDPBF16PS through its intrinsics: GCC 10 and clang 9 on; older compilers build the
 * portable loop only */
#if QUANT_X86 && (__clang_major__ >= 9 || (!defined(__clang__) && __GNUC__ >= 10))
#define BF16_X86 1
#else
#define BF16_X86 0
#endif

#if BF16_X86
#include <immintrin.h>
#define TARGET_AVX512_BF16                                                                     \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")))
#endif

#define PAIR_CHUNK 32          /* pairs summed apart, then added up (64 values, as gemm_f32.c) */
#define PANEL_BYTES (1 << 20)  /* bytes of W rows per panel, per thread */
#define AMX_ROWS 32            /* W rows per AMX micro-block (two tiles' height) */
#define E_FORMAT -1            /* k not whole 32-value blocks */
#define E_MEMORY -3            /* no memory for the packed or widened input */

/* Who multiplies more rows than the row kernels take (pagecli_bf16_set_gemm, pagecli_bf16_gemm). */
enum {
    BF16_GEMM_AUTO = 0,
    BF16_GEMM_OFF = 1,
    BF16_GEMM_PAIRS = 2,
    BF16_GEMM_TILES = 3,
    BF16_GEMM_FLOAT32 = 4
};
static int gemm_choice = BF16_GEMM_AUTO;

/* Multiply more rows than the row kernels take with AMX's tiles (3), the pair GEMM (2), the
 * float32 panels on the widened input (4), never (1: the caller keeps torch's GEMM), or as the
 * CPU suggests (0): on the AVX-512 path, the tiles where we can use them, else the pair GEMM
 * where the CPU has AVX512_BF16 and no AMX (where it has AMX that this build or kernel cannot
 * use, torch's oneDNN may still: the pair GEMM ran at a fifth of its rate there); on the AVX2
 * path the float32 panels (torch's bfloat16 GEMM, without native products there, ran at a
 * third to an eighth of their rate from 4 to 512 rows on an AVX2 AMD EPYC,
 * benchmarks/bf16_rows.py); torch's elsewhere. Forced, the tiles run whatever the path.
 * Returns 0, -1 for an unknown choice, -2 for the tiles where they cannot run. */
int pagecli_bf16_set_gemm(int choice) {
    if (choice < BF16_GEMM_AUTO || choice > BF16_GEMM_FLOAT32) return -1;
    const struct cpu_features *cpu = cpu_features();
    if (choice == BF16_GEMM_TILES && (!cpu->amx_granted || cpu->best_isa != ISA_AVX512))
        return -2; /* the tiles' writer and padding use AVX-512 too */
    gemm_choice = choice;
    return 0;
}

/* Who multiplies more rows than the row kernels take now: 2 AMX's tiles, 1 the pair GEMM, 3
 * the float32 panels on the widened input, 0 nobody (the caller keeps torch's GEMM; called
 * anyway, the float32 panels). */
int pagecli_bf16_gemm(void) {
    switch (gemm_choice) {
    case BF16_GEMM_OFF: return 0;
    case BF16_GEMM_PAIRS: return 1;
    case BF16_GEMM_TILES: return 2;
    case BF16_GEMM_FLOAT32: return 3;
    }
    const int isa = pagecli_quant_isa();
    if (isa == ISA_AVX2) return 3;
    if (isa != ISA_AVX512) return 0; /* the portable path: no native GEMM */
    const struct cpu_features *cpu = cpu_features();
    return cpu->amx_granted ? 2 : BF16_X86 && cpu->avx512_bf16 && !cpu->amx;
}

/* 1 where the CPU has AMX's bfloat16 tiles and the kernel granted them. */
int pagecli_bf16_tiles(void) { return cpu_features()->amx_granted; }

/* 1 where the pair GEMM runs VDPBF16PS (else the portable loop). */
int pagecli_bf16_gemm_native(void) {
    return BF16_X86 && pagecli_quant_isa() == ISA_AVX512 && cpu_features()->avx512_bf16;
}

static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* ---- micro-kernels: sums[r][j] = dot(x[strip token j], W row r) over `pairs` pairs --------- */

/* (gemm_micro_fn: xt and w hold bfloat16 pairs, 32 bits each) */
static void pairs_portable(const float *xt_pairs, const float *w_pairs, int64_t ldw,
                           int64_t pairs, int rows, int tokens, float *sums, int accumulate) {
    (void)tokens;
    const uint32_t *xt = (const uint32_t *)xt_pairs, *w = (const uint32_t *)w_pairs;
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < GEMM_TOKENS; j++) {
            float total = accumulate ? sums[r * GEMM_TOKENS + j] : 0.0f;
            for (int64_t p0 = 0; p0 < pairs; p0 += PAIR_CHUNK) {
                float s = 0.0f;
                for (int64_t p = p0; p < min64(p0 + PAIR_CHUNK, pairs); p++) {
                    const uint32_t a = xt[p * GEMM_TOKENS + j], b = w[r * ldw + p];
                    s += bf16_to_f32((uint16_t)(a >> 16)) * bf16_to_f32((uint16_t)(b >> 16));
                    s += bf16_to_f32((uint16_t)a) * bf16_to_f32((uint16_t)b);
                }
                total += s;
            }
            sums[r * GEMM_TOKENS + j] = total;
        }
}

#if BF16_X86
/* One copy per constant R (1..GEMM_ROWS), as gemm_f32.c's micro_avx512_r. */
TARGET_AVX512_BF16 static inline __attribute__((always_inline)) void
pairs_avx512_r(const uint32_t *xt, const uint32_t *w, int64_t ldw, int64_t pairs, float *sums,
               int accumulate, const int R) {
    for (int64_t p0 = 0; p0 < pairs; p0 += PAIR_CHUNK) {
        __m512 acc[GEMM_ROWS][2];
        for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
        const int64_t end = min64(p0 + PAIR_CHUNK, pairs);
        for (int64_t p = p0; p < end; p++) {
            const __m512bh x0 = (__m512bh)_mm512_load_si512(xt + p * GEMM_TOKENS);
            const __m512bh x1 = (__m512bh)_mm512_load_si512(xt + p * GEMM_TOKENS + 16);
            for (int r = 0; r < R; r++) {
                const __m512bh b = (__m512bh)_mm512_set1_epi32((int)w[r * ldw + p]);
                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], x0, b);
                acc[r][1] = _mm512_dpbf16_ps(acc[r][1], x1, b);
            }
        }
        for (int r = 0; r < R; r++) {
            float *s = sums + r * GEMM_TOKENS;
            if (p0 || accumulate) {
                acc[r][0] = _mm512_add_ps(_mm512_load_ps(s), acc[r][0]);
                acc[r][1] = _mm512_add_ps(_mm512_load_ps(s + 16), acc[r][1]);
            }
            _mm512_store_ps(s, acc[r][0]);
            _mm512_store_ps(s + 16, acc[r][1]);
        }
    }
}

TARGET_AVX512_BF16 static void pairs_avx512(const float *xt_pairs, const float *w_pairs,
                                            int64_t ldw, int64_t pairs, int rows, int tokens,
                                            float *sums, int accumulate) {
    (void)tokens;
    const uint32_t *xt = (const uint32_t *)xt_pairs, *w = (const uint32_t *)w_pairs;
    GEMM_ROWS_SWITCH(rows, pairs_avx512_r, xt, w, ldw, pairs, sums, accumulate)
}
#endif

/* Rows of W per panel: a multiple of `unit` within PANEL_BYTES, the panels split evenly over
 * the threads where W allows it. */
static int64_t panel_rows(int64_t n, int64_t k, int num_threads, int unit) {
    int64_t most = PANEL_BYTES / (int64_t)(k * sizeof(uint16_t));
    most = most < unit ? unit : most - most % unit;
    const int64_t rounds = (n + most * num_threads - 1) / (most * num_threads);
    const int64_t per_panel = (n + rounds * num_threads - 1) / (rounds * num_threads);
    return (per_panel + unit - 1) / unit * unit;
}

#if AMX_X86
/* ---- AMX: TDPBF16PS on tiles ----------------------------------------------------------------
 * A micro-block is AMX_ROWS = 32 rows of W x GEMM_TOKENS = 32 tokens, as four 16 x 16 tiles of
 * float32 sums (tmm0-3). Per 16 pairs of k: two tiles of W's rows loaded as they lie in memory
 * (tmm4-5: 16 rows x 16 pairs each, rows k values apart; TDPBF16PS's first operand), two of the
 * packed input (tmm6-7: 16 pairs x 16 tokens, from the same token strips as the pair GEMM's),
 * four TDPBF16PS. The sums are stored as gemm_sweep's micro-kernels leave theirs (W row r, token
 * j at r * GEMM_TOKENS + j) and written out by the same writer. TDPBF16PS, like VDPBF16PS,
 * multiplies bfloat16 values exactly and adds into float32 sums, denormals taken as zero;
 * Intel does not say in which order it adds a tile row's 32 products, so this path is tested
 * against float64 only. */

/* y[tok][r] for the tokens of x (packed, m rows, `pairs` pairs) and W's rows [0, count), rows
 * k values apart; `pad` holds AMX_ROWS * k values for a last micro-block that passes W's end
 * (panels are whole micro-blocks, so only W's end has fewer than AMX_ROWS rows; NULL where W
 * has none such). Single-threaded, tiles configured. */
TARGET_AMX static void tiles_sweep(const uint16_t *w, int64_t k, int64_t count,
                                   const uint32_t *xt, int64_t m, float *y, int64_t ldy,
                                   uint16_t *pad) {
    float sums[AMX_ROWS * GEMM_TOKENS] __attribute__((aligned(64)));
    const int64_t pairs = k / 2, strips = (m + GEMM_TOKENS - 1) / GEMM_TOKENS;
    const int64_t stride = k * (int64_t)sizeof(uint16_t);
    for (int64_t t0 = 0; t0 < strips; t0 += 8) /* 256 tokens' pairs stay in the L2 */
        for (int64_t r0 = 0; r0 < count; r0 += AMX_ROWS) {
            const int rows = (int)min64(AMX_ROWS, count - r0);
            const uint16_t *a = w + r0 * k;
            if (rows < AMX_ROWS) { /* W ends inside this micro-block */
                for (int64_t i = 0; i < AMX_ROWS * k; i++) pad[i] = i < rows * k ? a[i] : 0;
                MEMORY_BARRIER();
                a = pad;
            }
            for (int64_t t = t0; t < min64(t0 + 8, strips); t++) {
                const uint32_t *b = xt + t * pairs * GEMM_TOKENS;
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                for (int64_t p = 0; p < pairs; p += 16) {
                    _tile_loadd(4, a + 2 * p, stride);
                    _tile_loadd(5, a + 16 * k + 2 * p, stride);
                    amx_products(b + p * GEMM_TOKENS);
                }
                amx_store_sums(sums);
                const int64_t tok = t * GEMM_TOKENS;
                amx_write_sums(sums, rows, min64(GEMM_TOKENS, m - tok), y + tok * ldy + r0, ldy);
            }
        }
}

#endif

static __thread float *widened;
static __thread int64_t widened_cap;
static __thread float *packed;
static __thread int64_t packed_cap;
static __thread float *padded; /* AMX: a last micro-block of W's rows, zero past W's end */
static __thread int64_t padded_cap;

/* y[m, n] = x[m, k] @ W[n, k].T: W and x bfloat16 (rows ldx values apart), y float32 (rows
 * ldy apart); k a multiple of 32. Returns 0, or E_FORMAT, E_MEMORY. */
int pagecli_bf16_linear(const void *w, int64_t n, int64_t k, const void *x, int64_t ldx,
                        int64_t m, float *y, int64_t ldy, int num_threads) {
    if (k % 32 || k <= 0) return E_FORMAT;
    if (m <= 0 || n <= 0) return 0;
    const uint16_t *xs = x;
    const int gemm = pagecli_bf16_gemm();
    if (m <= pagecli_quant_fused_rows() || gemm == 0 || gemm == 3) { /* the float32 drivers */
        if (gemm_reserve(&widened, &widened_cap, m * k)) return E_MEMORY;
        for (int64_t t = 0; t < m; t++)
            for (int64_t i = 0; i < k; i++) widened[t * k + i] = bf16_to_f32(xs[t * ldx + i]);
        return pagecli_quant_linear(QT_BF16, w, n, k, widened, k, m, y, ldy, num_threads);
    }
    const int tiles_path = AMX_X86 && gemm == 2;
    const int isa = tiles_path ? ISA_AVX512 : pagecli_quant_isa();
    gemm_micro_fn micro = pairs_portable;
#if BF16_X86
    if (pagecli_bf16_gemm_native()) micro = pairs_avx512;
#endif
    const int64_t pairs = k / 2, strips = (m + GEMM_TOKENS - 1) / GEMM_TOKENS;
    if (ldx % 2 || gemm_reserve(&packed, &packed_cap, gemm_packed_floats(m, pairs)))
        return ldx % 2 ? E_FORMAT : E_MEMORY;
    float *const xt = packed; /* the calling thread's buffer, shared with the team below */
    const uint32_t *rows_w = w;
    const int64_t rows = panel_rows(n, k, num_threads, tiles_path ? AMX_ROWS : GEMM_ROWS);
    const int64_t num_panels = (n + rows - 1) / rows;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        /* a bfloat16 pair is 32 bits: packed as gemm_f32.c packs floats, bits unchanged */
#pragma omp for schedule(static)
        for (int64_t t = 0; t < strips; t++)
            gemm_pack_x(isa, (const float *)xs, ldx / 2, m, pairs, xt, t);
#if AMX_X86
        if (tiles_path) {
            const int tail = n % AMX_ROWS != 0;
            if (tail && gemm_reserve(&padded, &padded_cap, AMX_ROWS * k / 2)) failed = 1;
            amx_begin();
#pragma omp for schedule(static)
            for (int64_t p = 0; p < num_panels; p++) {
                const int64_t first = p * rows;
                if (!failed)
                    tiles_sweep((const uint16_t *)w + first * k, k, min64(rows, n - first),
                                (const uint32_t *)xt, m, y + first, ldy,
                                tail ? (uint16_t *)padded : NULL);
            }
            amx_end();
        } else
#endif
#pragma omp for schedule(static)
        for (int64_t p = 0; p < num_panels; p++) {
            const int64_t first = p * rows;
            gemm_sweep(isa, micro, NULL, xt, m, pairs,
                       (const float *)(rows_w + first * pairs), pairs, min64(rows, n - first),
                       y + first, ldy);
        }
    }
    return failed ? E_MEMORY : 0;
}
