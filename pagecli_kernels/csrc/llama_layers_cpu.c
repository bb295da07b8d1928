/*
 * The decoder layers of a Llama-family model as one call (CPU, float32, GGUF-quantized
 * projections): what pagecli/models/llama.py's per-layer Python loop does, without the
 * Python. At decode sizes that loop's cost is dispatch, not arithmetic: 30 layers x 11 calls,
 * each a few to tens of microseconds of Python for microseconds of work.
 *
 * Every layer runs the same kernels, with the same arguments and thread count, in the same
 * order as the Python loop (cpu_ops.c, quant_linear_cpu.c, paged_attention_cpu.c), so the
 * result is bit-for-bit the loop's:
 *
 *   normed = rms_norm(hidden; input_layernorm)
 *   qkv    = normed @ dequant(W_qkv).T (+ bias)           [T, Q + 2 KV]
 *   rotary(q, k) in place; store k, v into the layer's cache slots
 *   attn   = paged attention of q over the cache, per group (decode part, prefill part)
 *   hidden += attn @ dequant(W_o).T; normed = rms_norm(hidden; post_attention_layernorm)
 *   hidden += down(silu(gate) * up)  with gate_up = normed @ dequant(W_gate_up).T
 *
 * Layouts:
 *   layers   [num_layers, LAYER_FIELDS] int64: the fields below, pointers as integers
 *   hidden   [T, H] float32, contiguous, updated in place
 *   cos/sin  [T, D] float32, the step's rotary table rows
 *   slot_mapping [T] int64 (slot < 0: not stored)
 *   groups   [num_groups, GROUP_FIELDS] int64: token_start, num_tokens, num_seqs,
 *            block_tables (int32 [num_seqs, table_stride]), table_stride, seq_lens (int32),
 *            query_start_loc (int32 [num_seqs + 1], from 0 within the group), split_tokens
 *   caches   [num_blocks, block_size, KVH, D] float32, K and V with the same strides
 *   final_norm NULL, or [H] float32: then also final_out [T, H] = rms_norm(hidden; final_norm,
 *            final_eps), the model's last norm (the kernel and arguments of the Python RMSNorm)
 *   timings  NULL, or [2] float64 seconds to add to: inside the projections, inside K/V stores
 *            and attention (benchmarks/step_floor.py: what is left is glue and small ops)
 * Returns 0, or LAYERS_E_* (the failing layer is not reported: every layer has the same
 * shapes, so a failure is the step's arguments, and the first layer already fails).
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_entry_points.h" /* the kernels this file strings together */

#define LAYERS_E_BLOCK -1  /* a block id outside [0, num_blocks) */
#define LAYERS_E_MEMORY -2 /* no memory for the work buffers */
#define LAYERS_E_SLOT -3   /* a slot past the cache */
#define LAYERS_E_FORMAT -4 /* a weight format the kernels do not know */

/* per projection: type, weight, bias (0: none), in that order */
enum {
    F_INPUT_NORM, F_POST_NORM, F_QKV_TYPE, F_QKV, F_QKV_BIAS, F_O_TYPE, F_O, F_O_BIAS,
    F_GATE_UP_TYPE, F_GATE_UP, F_GATE_UP_BIAS, F_DOWN_TYPE, F_DOWN, F_DOWN_BIAS, F_K_CACHE,
    F_V_CACHE, LAYER_FIELDS
};
enum {
    G_TOKEN_START, G_NUM_TOKENS, G_NUM_SEQS, G_BLOCK_TABLES, G_TABLE_STRIDE, G_SEQ_LENS,
    G_QUERY_START_LOC, G_SPLIT_TOKENS, GROUP_FIELDS
};

#define PTR(v) ((void *)(intptr_t)(v))

/* y = x @ W.T (+ bias, added afterwards as torch's `out += bias` does) */
static int linear(const int64_t *layer, int type_field, const float *x, int64_t m, int64_t k,
                  float *y, int64_t n, int num_threads, double *timings) {
    const double start = timings ? omp_get_wtime() : 0.0;
    const int status = pagecli_quant_linear((int)layer[type_field], PTR(layer[type_field + 1]),
                                            n, k, x, k, m, y, n, num_threads);
    const float *bias = PTR(layer[type_field + 2]);
    if (status == 0 && bias) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (m >= 64)
        for (int64_t t = 0; t < m; ++t)
            for (int64_t j = 0; j < n; ++j) y[t * n + j] += bias[j];
    }
    if (timings) timings[0] += omp_get_wtime() - start;
    return status == 0 ? 0 : status == -3 ? LAYERS_E_MEMORY : LAYERS_E_FORMAT;
}

int pagecli_llama_layers(const int64_t *layers, int num_layers, float *hidden, int64_t T,
                         int64_t H, int num_heads, int num_kv_heads, int head_dim, int64_t inter,
                         float eps, const float *cos, const float *sin,
                         const int64_t *slot_mapping, int64_t num_blocks, int block_size,
                         int64_t stride_block, int64_t stride_slot, int64_t stride_head,
                         const int64_t *groups, int num_groups, float scale, int attention_isa,
                         int num_threads, const float *final_norm, float final_eps,
                         float *final_out, double *timings) {
    const int64_t Q = (int64_t)num_heads * head_dim, KV = (int64_t)num_kv_heads * head_dim;
    const int64_t QKV = Q + 2 * KV;
    /* work buffers: normed [T, H], qkv [T, QKV], query and attn [T, Q], proj [T, H],
     * gate_up [T, 2I], act [T, I]; each 64-byte aligned, as torch's tensors are, so that the
     * kernels (and MKL's sgemm in the panel path) see the inputs the Python loop hands them */
    const int64_t sizes[7] = {T * H, T * QKV, T * Q, T * Q, T * H, T * 2 * inter, T * inter};
    int64_t offsets[7], total = 0;
    for (int i = 0; i < 7; ++i) {
        offsets[i] = total;
        total += (sizes[i] + 15) / 16 * 16;
    }
    float *buf = aligned_alloc(64, sizeof(float) * (size_t)(total ? total : 16));
    if (!buf) return LAYERS_E_MEMORY;
    float *normed = buf + offsets[0], *qkv = buf + offsets[1], *query = buf + offsets[2];
    float *attn = buf + offsets[3], *proj = buf + offsets[4], *gate_up = buf + offsets[5];
    float *act = buf + offsets[6];
    int status = 0;

    for (int l = 0; l < num_layers && status == 0; ++l) {
        const int64_t *layer = layers + (int64_t)l * LAYER_FIELDS;
        void *k_cache = PTR(layer[F_K_CACHE]), *v_cache = PTR(layer[F_V_CACHE]);

        pagecli_rms_norm(hidden, NULL, PTR(layer[F_INPUT_NORM]), normed, T, H, H, 0, H, eps, 0,
                         num_threads);
        if ((status = linear(layer, F_QKV_TYPE, normed, T, H, qkv, QKV, num_threads, timings)))
            break;
        pagecli_rotary(qkv, qkv + Q, cos, sin, T, num_heads, num_kv_heads, head_dim, QKV, QKV,
                       0);
        const double attention_start = timings ? omp_get_wtime() : 0.0;
        if (pagecli_store_kv(qkv + Q, qkv + Q + KV, QKV, QKV, k_cache, v_cache, stride_block,
                             stride_slot, slot_mapping, T, KV, 4, block_size,
                             num_blocks * block_size)) {
            status = LAYERS_E_SLOT;
            break;
        }
#pragma omp parallel for num_threads(num_threads) schedule(static) if (T >= 64)
        for (int64_t t = 0; t < T; ++t)
            memcpy(query + t * Q, qkv + t * QKV, sizeof(float) * (size_t)Q);
        for (int g = 0; g < num_groups && status == 0; ++g) {
            const int64_t *grp = groups + (int64_t)g * GROUP_FIELDS;
            const int64_t first = grp[G_TOKEN_START];
            const int a = pagecli_paged_attention(
                attention_isa, 0, query + first * Q, k_cache, v_cache, num_blocks, stride_block,
                stride_slot, stride_head, PTR(grp[G_BLOCK_TABLES]), grp[G_TABLE_STRIDE],
                PTR(grp[G_SEQ_LENS]), PTR(grp[G_QUERY_START_LOC]), attn + first * Q,
                (int)grp[G_NUM_SEQS], num_heads, num_kv_heads, head_dim, block_size, scale,
                (int)grp[G_SPLIT_TOKENS], num_threads);
            if (a) status = a == -1 ? LAYERS_E_BLOCK : LAYERS_E_MEMORY;
        }
        if (timings) timings[1] += omp_get_wtime() - attention_start;
        if (status) break;
        if ((status = linear(layer, F_O_TYPE, attn, T, Q, proj, H, num_threads, timings))) break;
        pagecli_rms_norm(hidden, proj, PTR(layer[F_POST_NORM]), normed, T, H, H, H, H, eps, 0,
                         num_threads); /* hidden += proj first */
        if ((status = linear(layer, F_GATE_UP_TYPE, normed, T, H, gate_up, 2 * inter,
                             num_threads, timings)))
            break;
        pagecli_silu_mul(gate_up, act, T, inter, 2 * inter, inter, 0, num_threads);
        if ((status = linear(layer, F_DOWN_TYPE, act, T, inter, proj, H, num_threads, timings)))
            break;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (T >= 64)
        for (int64_t i = 0; i < T * H; ++i) hidden[i] += proj[i];
    }
    if (status == 0 && final_norm)
        pagecli_rms_norm(hidden, NULL, final_norm, final_out, T, H, H, 0, H, final_eps, 0,
                         num_threads);
    free(buf);
    return status;
}
