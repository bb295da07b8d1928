/*
 * The decoder layers of a Llama-family model as one call (CPU; float32 activations with
 * GGUF-quantized or float32 projections, or bfloat16 activations with bfloat16 or
 * GGUF-quantized projections): what pagecli/models/llama.py's per-layer Python loop does,
 * without the Python. At decode sizes that loop's cost is dispatch, not arithmetic: 30 layers
 * x 11 calls, each a few to tens of microseconds of Python for microseconds of work.
 *
 * Every layer runs the same kernels, with the same arguments and thread count, in the same
 * order as the Python loop (cpu_ops.c, quant_linear_cpu.c, paged_attention_cpu.c), so the
 * result is bit-for-bit the loop's. In bfloat16 (dtype 1) it also rounds where the loop's
 * tensors are bfloat16: a projection sums in float32 (gemm_bf16.c for bfloat16 weights, as
 * layers/linear.BF16Linear; the float32 drivers on the widened input for block formats),
 * adds the float32 bias and rounds; attention takes the query widened and its float32 output
 * is rounded; the residual adds round (torch's bfloat16 add):
 *
 *   normed = rms_norm(hidden; input_layernorm)
 *   qkv    = normed @ dequant(W_qkv).T (+ bias)           [T, Q + 2 KV]
 *   rotary(q, k) in place (qk_pairs: q/k rows in llama.cpp's order, each head's rotary halves
 *   interleaved as a GGUF read in place keeps them, deinterleaved on the way); store k, v
 *   attn   = paged attention of q over the cache, per group (decode part, prefill part)
 *   hidden += attn @ dequant(W_o).T; normed = rms_norm(hidden; post_attention_layernorm)
 *   hidden += down(silu(gate) * up)  with gate_up = normed @ dequant(W_gate_up).T
 *
 * Layouts:
 *   layers   [num_layers, LAYER_FIELDS] int64: the fields below, pointers as integers
 *   dtype    0: float32, 1: bfloat16, the type of hidden, the norm weights, cos/sin and the
 *            caches (the biases are float32 in both)
 *   hidden   [T, H] of dtype, contiguous, updated in place
 *   cos/sin  [T, D] of dtype, the step's rotary table rows
 *   slot_mapping [T] int64 (slot < 0: not stored)
 *   groups   [num_groups, GROUP_FIELDS] int64: token_start, num_tokens, num_seqs,
 *            block_tables (int32 [num_seqs, table_stride]), table_stride, seq_lens (int32),
 *            query_start_loc (int32 [num_seqs + 1], from 0 within the group), split_tokens
 *   caches   [num_blocks, block_size, KVH, D] of dtype, K and V with the same strides
 *   final_norm NULL, or [H] of dtype: then also final_out [T, H] = rms_norm(hidden; final_norm,
 *            final_eps), the model's last norm (the kernel and arguments of the Python RMSNorm)
 *   timings  NULL, or [2] float64 seconds to add to: inside the projections, inside K/V stores
 *            and attention (benchmarks/step_floor.py: what is left is glue and small ops)
 *   tp       NULL, or a tensor-parallel rank's shared-memory collective (float32 only), int64
 *            [TP_FIELDS]: segment base, slot floats, rank, size, the last collective number
 *            (advanced here, two per layer), time limit in ms, nanoseconds spent in the
 *            collectives (added to): o_proj's and down's outputs are summed over the ranks
 *            (shm_collective.c) before they join the residual, as layers/parallel.py does
 * Returns 0, or LAYERS_E_* (the failing layer is not reported: every layer has the same
 * shapes, so a failure is the step's arguments, and the first layer already fails).
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "cpu_entry_points.h" /* the kernels this file strings together */
#include "quant_blocks.h"     /* QT_BF16 */

#define LAYERS_E_BLOCK -1  /* a block id outside [0, num_blocks) */
#define LAYERS_E_MEMORY -2 /* no memory for the work buffers */
#define LAYERS_E_SLOT -3   /* a slot past the cache */
#define LAYERS_E_FORMAT -4 /* a weight format the kernels do not know */
#define LAYERS_E_PARTS -5  /* a projection's parts: not 1 to MAX_PARTS, or rows not adding up */
#define LAYERS_E_COLLECTIVE -6 /* a tensor-parallel collective timed out or was aborted */

/* Per projection: its bias (0: none), its number of parts (1 to MAX_PARTS), then each part's
 * type, weight and rows: a projection's rows may come in parts of different formats (a Q4_K_M
 * file keeps some v projections in Q6_K beside Q4_K q and k), each part writing its columns of
 * the output, as layers/quant_linear.QuantLinear's parts do. */
#define MAX_PARTS 3
enum { P_BIAS, P_NUM_PARTS, P_PARTS, PROJECTION_FIELDS = P_PARTS + 3 * MAX_PARTS };
enum {
    F_INPUT_NORM, F_POST_NORM, F_QKV, F_O = F_QKV + PROJECTION_FIELDS,
    F_GATE_UP = F_O + PROJECTION_FIELDS, F_DOWN = F_GATE_UP + PROJECTION_FIELDS,
    F_K_CACHE = F_DOWN + PROJECTION_FIELDS, F_V_CACHE, LAYER_FIELDS
};
enum {
    G_TOKEN_START, G_NUM_TOKENS, G_NUM_SEQS, G_BLOCK_TABLES, G_TABLE_STRIDE, G_SEQ_LENS,
    G_QUERY_START_LOC, G_SPLIT_TOKENS, GROUP_FIELDS
};

#define PTR(v) ((void *)(intptr_t)(v))

enum { TP_BASE, TP_SLOT, TP_RANK, TP_SIZE, TP_NUMBER, TP_TIMEOUT_MS, TP_NANOS, TP_FIELDS };

/* Sum a projection's [n] float32 output over the tensor-parallel ranks. */
static int all_reduce(int64_t *tp, float *x, int64_t n) {
    const double start = omp_get_wtime();
    const int status = pagecli_shm_all_reduce((char *)PTR(tp[TP_BASE]), tp[TP_SLOT],
                                              (int32_t)tp[TP_RANK], (int32_t)tp[TP_SIZE],
                                              ++tp[TP_NUMBER], x, n, 1e-3 * tp[TP_TIMEOUT_MS]);
    tp[TP_NANOS] += (int64_t)(1e9 * (omp_get_wtime() - start));
    return status ? LAYERS_E_COLLECTIVE : 0;
}

/* the elementwise loops vectorized for the CPU at hand (the library's baseline is SSE2) */
#define CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#define PARALLEL_VALUES 16384 /* elementwise loops of at least this many values share threads */

/* bfloat16 <-> float32 (bf16.h) over count values */
CLONES static void widen_bf16(const uint16_t *in, float *out, int64_t count, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (count >= PARALLEL_VALUES)
    for (int64_t i = 0; i < count; ++i) out[i] = bf16_to_f32(in[i]);
}

CLONES static void narrow_bf16(const float *in, uint16_t *out, int64_t count, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (count >= PARALLEL_VALUES)
    for (int64_t i = 0; i < count; ++i) out[i] = f32_to_bf16(in[i]);
}

/* a += b elementwise over count values of dtype (bfloat16: each sum rounded) */
CLONES static void add_into(void *a, const void *b, int64_t count, int dtype, int num_threads) {
    if (dtype == 0) {
        float *x = a;
        const float *y = b;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (count >= PARALLEL_VALUES)
        for (int64_t i = 0; i < count; ++i) x[i] += y[i];
        return;
    }
    uint16_t *x = a;
    const uint16_t *y = b;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (count >= PARALLEL_VALUES)
    for (int64_t i = 0; i < count; ++i) x[i] = f32_to_bf16(bf16_to_f32(x[i]) + bf16_to_f32(y[i]));
}

/* y = x @ W.T (+ bias, added afterwards as torch's `out += bias` does), x [m, k] and y [m, n]
 * of dtype, W the projection's parts one after the other. bfloat16 sums into the float32
 * scratch rows y32 and rounds, as the loop's layers do: a bfloat16 weight through gemm_bf16.c
 * (layers/linear.BF16Linear), a block format through the float32 drivers with x widened into
 * x32 (layers/quant_linear.QuantLinear). */
static int linear(const int64_t *layer, int field, const void *x, int64_t m, int64_t k, void *y,
                  int64_t n, int dtype, float *x32, float *y32, int num_threads,
                  double *timings) {
    const double start = timings ? omp_get_wtime() : 0.0;
    const int64_t *proj = layer + field;
    if (proj[P_NUM_PARTS] < 1 || proj[P_NUM_PARTS] > MAX_PARTS) return LAYERS_E_PARTS;
    int64_t total = 0;
    for (int p = 0; p < proj[P_NUM_PARTS]; p++) total += proj[P_PARTS + 3 * p + 2];
    if (total != n) return LAYERS_E_PARTS; /* checked before any part writes its columns */
    float *yf = dtype ? y32 : y;
    const float *xf = x;
    int status = 0;
    if (dtype) { /* widened once for the block-format parts */
        int widen = 0;
        for (int p = 0; p < proj[P_NUM_PARTS]; p++) widen |= proj[P_PARTS + 3 * p] != QT_BF16;
        if (widen) widen_bf16(x, x32, m * k, num_threads);
        xf = x32;
    }
    int64_t first = 0; /* the part's first output column */
    for (int p = 0; p < proj[P_NUM_PARTS] && status == 0; p++) {
        const int type = (int)proj[P_PARTS + 3 * p];
        const void *w = PTR(proj[P_PARTS + 3 * p + 1]);
        const int64_t rows = proj[P_PARTS + 3 * p + 2];
        if (dtype && type == QT_BF16)
            status = pagecli_bf16_linear(w, rows, k, x, k, m, yf + first, n, num_threads);
        else
            status = pagecli_quant_linear(type, w, rows, k, xf, k, m, yf + first, n, num_threads);
        first += rows;
    }
    const float *bias = PTR(proj[P_BIAS]);
    if (status == 0 && bias) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (m >= 64)
        for (int64_t t = 0; t < m; ++t)
            for (int64_t j = 0; j < n; ++j) yf[t * n + j] += bias[j];
    }
    if (status == 0 && dtype) narrow_bf16(y32, y, m * n, num_threads);
    if (timings) timings[0] += omp_get_wtime() - start;
    return status == 0 ? 0 : status == -3 ? LAYERS_E_MEMORY : LAYERS_E_FORMAT;
}

static int64_t max3(int64_t a, int64_t b, int64_t c) {
    const int64_t ab = a > b ? a : b;
    return ab > c ? ab : c;
}

int pagecli_llama_layers(const int64_t *layers, int num_layers, void *hidden, int64_t T,
                         int64_t H, int num_heads, int num_kv_heads, int head_dim, int64_t inter,
                         float eps, const void *cos, const void *sin,
                         const int64_t *slot_mapping, int64_t num_blocks, int block_size,
                         int64_t stride_block, int64_t stride_slot, int64_t stride_head,
                         const int64_t *groups, int num_groups, float scale, int attention_isa,
                         int num_threads, const void *final_norm, float final_eps,
                         void *final_out, int dtype, int qk_pairs, double *timings,
                         int64_t *tp) {
    if (dtype != 0 && dtype != 1) return LAYERS_E_FORMAT;
    if (tp && (dtype != 0 || T * H > tp[TP_SLOT])) return LAYERS_E_FORMAT;
    const int64_t Q = (int64_t)num_heads * head_dim, KV = (int64_t)num_kv_heads * head_dim;
    const int64_t QKV = Q + 2 * KV;
    const size_t es = dtype ? sizeof(uint16_t) : sizeof(float); /* bytes of a dtype value */
    /* work buffers, in values of dtype: normed [T, H], qkv [T, QKV], proj [T, H],
     * gate_up [T, 2I], act [T, I], attn_out [T, Q] (bfloat16 only: the rounded attention);
     * in float32: query and attn [T, Q], and for bfloat16 the projections' float32 input and
     * output rows x32 and y32. Each starts 64-byte aligned, as torch's tensors do, so that the
     * kernels (and MKL's sgemm in the panel path) see the inputs the Python loop hands them. */
    const int64_t wide_in = dtype ? T * max3(H, Q, inter) : 0;
    const int64_t wide_out = dtype ? T * max3(QKV, H, 2 * inter) : 0;
    const int64_t bytes[10] = {
        T * H * (int64_t)es, T * QKV * (int64_t)es, T * H * (int64_t)es,
        T * 2 * inter * (int64_t)es, T * inter * (int64_t)es, dtype ? T * Q * (int64_t)es : 0,
        T * Q * 4, T * Q * 4, wide_in * 4, wide_out * 4};
    int64_t offsets[10], total = 0;
    for (int i = 0; i < 10; ++i) {
        offsets[i] = total;
        total += (bytes[i] + 63) / 64 * 64;
    }
    char *buf = aligned_alloc(64, (size_t)(total ? total : 64));
    if (!buf) return LAYERS_E_MEMORY;
    char *normed = buf + offsets[0], *qkv = buf + offsets[1], *proj = buf + offsets[2];
    char *gate_up = buf + offsets[3], *act = buf + offsets[4], *attn_out = buf + offsets[5];
    float *query = (float *)(buf + offsets[6]), *attn = (float *)(buf + offsets[7]);
    float *x32 = (float *)(buf + offsets[8]), *y32 = (float *)(buf + offsets[9]);
    if (!dtype) attn_out = (char *)attn; /* float32: the attention output as it is */
    int status = 0;

    for (int l = 0; l < num_layers && status == 0; ++l) {
        const int64_t *layer = layers + (int64_t)l * LAYER_FIELDS;
        void *k_cache = PTR(layer[F_K_CACHE]), *v_cache = PTR(layer[F_V_CACHE]);

        pagecli_rms_norm(hidden, NULL, PTR(layer[F_INPUT_NORM]), normed, T, H, H, 0, H, eps,
                         dtype, num_threads);
        if ((status = linear(layer, F_QKV, normed, T, H, qkv, QKV, dtype, x32, y32,
                             num_threads, timings)))
            break;
        pagecli_rotary(qkv, qkv + Q * es, cos, sin, T, num_heads, num_kv_heads, head_dim, QKV,
                       QKV, dtype, qk_pairs);
        const double attention_start = timings ? omp_get_wtime() : 0.0;
        if (pagecli_store_kv(qkv + Q * es, qkv + (Q + KV) * es, QKV, QKV, k_cache, v_cache,
                             stride_block, stride_slot, slot_mapping, T, KV, (int64_t)es,
                             block_size, num_blocks * block_size)) {
            status = LAYERS_E_SLOT;
            break;
        }
#pragma omp parallel for num_threads(num_threads) schedule(static) if (T >= 64)
        for (int64_t t = 0; t < T; ++t) {
            if (dtype == 0) {
                memcpy(query + t * Q, (const float *)qkv + t * QKV, sizeof(float) * (size_t)Q);
                continue;
            }
            const uint16_t *row = (const uint16_t *)qkv + t * QKV;
            for (int64_t i = 0; i < Q; ++i) query[t * Q + i] = bf16_to_f32(row[i]);
        }
        for (int g = 0; g < num_groups && status == 0; ++g) {
            const int64_t *grp = groups + (int64_t)g * GROUP_FIELDS;
            const int64_t first = grp[G_TOKEN_START];
            const int a = pagecli_paged_attention(
                attention_isa, dtype, query + first * Q, k_cache, v_cache, num_blocks,
                stride_block, stride_slot, stride_head, PTR(grp[G_BLOCK_TABLES]),
                grp[G_TABLE_STRIDE], PTR(grp[G_SEQ_LENS]), PTR(grp[G_QUERY_START_LOC]),
                attn + first * Q, (int)grp[G_NUM_SEQS], num_heads, num_kv_heads, head_dim,
                block_size, scale, 0, NULL, (int)grp[G_SPLIT_TOKENS], num_threads);
            if (a) status = a == -1 ? LAYERS_E_BLOCK : LAYERS_E_MEMORY;
        }
        if (timings) timings[1] += omp_get_wtime() - attention_start;
        if (status) break;
        if (dtype) narrow_bf16(attn, (uint16_t *)attn_out, T * Q, num_threads);
        if ((status = linear(layer, F_O, attn_out, T, Q, proj, H, dtype, x32, y32,
                             num_threads, timings)))
            break;
        if (tp && (status = all_reduce(tp, (float *)proj, T * H))) break;
        pagecli_rms_norm(hidden, proj, PTR(layer[F_POST_NORM]), normed, T, H, H, H, H, eps,
                         dtype, num_threads); /* hidden += proj first */
        if ((status = linear(layer, F_GATE_UP, normed, T, H, gate_up, 2 * inter, dtype,
                             x32, y32, num_threads, timings)))
            break;
        pagecli_silu_mul(gate_up, act, T, inter, 2 * inter, inter, dtype, num_threads);
        if ((status = linear(layer, F_DOWN, act, T, inter, proj, H, dtype, x32, y32,
                             num_threads, timings)))
            break;
        if (tp && (status = all_reduce(tp, (float *)proj, T * H))) break;
        add_into(hidden, proj, T * H, dtype, num_threads);
    }
    if (status == 0 && final_norm)
        pagecli_rms_norm(hidden, NULL, final_norm, final_out, T, H, H, 0, H, final_eps, dtype,
                         num_threads);
    free(buf);
    return status;
}
