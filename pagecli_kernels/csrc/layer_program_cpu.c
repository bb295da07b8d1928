/*
 * A model's decoder layers as one call on the CPU: an interpreter of the model's layer
 * program (pagecli/models/blocks.py writes it; pagecli_kernels/layers_cpu.py binds it). Each
 * family lists its ops per layer (norm, linear, rotary, attention with its window and sinks,
 * act * up, residual add, all-reduce), and this loop runs the list. At decode sizes the
 * Python loop of the same layers costs more in dispatch than in arithmetic (30 layers x a
 * dozen calls, each tens of microseconds of Python for microseconds of work).
 *
 * Every op runs the kernel the Python loop runs for it (cpu_ops.c, quant_linear_cpu.c,
 * paged_attention_cpu.c), with the same arguments and thread count, in the same order, so
 * the result is bit-for-bit the loop's. In bfloat16 (dtype 1) it also rounds where the loop's
 * tensors are bfloat16: a projection sums in float32 (gemm_bf16.c for bfloat16 weights, as
 * layers/linear.BF16Linear; the float32 drivers on the widened input for block formats),
 * adds the float32 bias and rounds; attention takes the query widened and its float32 output
 * is rounded; the residual adds round (torch's bfloat16 add).
 *
 * Buffers: the step's activations live in BUF_* buffers of [T, widths[b]] values of dtype,
 * row-major (BUF_HIDDEN is the caller's residual stream, updated in place). An op names its
 * buffers and the column where its values start in each.
 *
 * The program: num_ops ops of OP_FIELDS int64 each, field 0 the opcode (OP_*), the others as
 * each op's enum below says; floats are stored as the bits of a float32 in the low 32 bits.
 *
 *   OP_NORM       out[dst] = rms_norm(x[src]) per row or per head (num_heads heads of width
 *                 values; 1 head: the row), with has_delta first x[src] += x[delta]; the
 *                 weight applied as weight_mode says (cpu_ops.c)
 *   OP_LINEAR     x[dst] = x[src] @ W.T (+ bias), W one projection (projection table below)
 *   OP_ROTARY     q and k heads of a buffer rotated in place by rope table `rope`
 *   OP_ATTENTION  store k, v of the step's tokens into the layer's caches, then paged
 *                 attention of q over them per group (decodes, prefill chunks), with the
 *                 layer's window and sinks, into x[dst]; the layer's KV cache group (one
 *                 per layer type, pagecli/engine/kv_groups.py) picks its slots and tables
 *   OP_ACT_MUL    x[dst] = act(gate) * up for gate/up side by side in x[src]
 *   OP_ADD        x[dst] += x[src] (has_scale: x[src] * scale, rounded, first)
 *   OP_ALL_REDUCE x[buf] summed over the tensor-parallel ranks (float32)
 *   OP_SPLIT_HEADS per row, heads pairs of `width` values from col, [x0 y0 x1 y1 ...] ->
 *                 [x0 x1 ... y0 y1 ...] (gated attention's query and gate of each head)
 *   OP_GATE_MUL   x[dst] *= sigmoid(x[src] from col) over width values (float32)
 *   OP_MOE        a sparse mixture-of-experts MLP from x[src] into x[dst] (float32): the
 *                 router, softmax and top k per token (or gpt-oss's top k of the logits,
 *                 then their softmax), then each chosen expert once over
 *                 all its tokens (gathered), its outputs times their routing weights added
 *                 per token in ascending expert order, and a gated shared expert; its table
 *                 of MOE_FIELDS gives the projections (pagecli_moe runs the same for the loop);
 *                 decode-sized steps run all chosen experts in one parallel region (moe_decode)
 *   OP_DELTANET   a Gated DeltaNet layer's step from its input projection x[src] into
 *                 x[dst] (gated_delta_cpu.c; float32): its table of DELTA_FIELDS gives the
 *                 weights, the state stores and the shape; each sequence's state slot and
 *                 token start come with the step (state_slots, state_starts)
 *
 * A projection: int64 [PROJECTION_FIELDS]: its float32 bias (0: none), its number of parts (1
 * to MAX_PARTS), then each part's type, weight and rows: a projection's rows may come in
 * parts of different formats (a Q4_K_M file keeps some v projections in Q6_K beside Q4_K q
 * and k), each writing its columns of the output, as layers/quant_linear.QuantLinear's do.
 *
 * Other layouts:
 *   dtype    0: float32, 1: bfloat16, the type of hidden, every buffer, cos/sin and the
 *            caches (biases, and the norm weights of weight_mode 1, are float32)
 *   ropes    [num_ropes, 3] int64: cos and sin, [T, rotary_dim] of dtype each, and rotary_dim
 *   slot_mapping [num_kv_groups, T] int64, rows slot_stride apart (slot < 0: not stored)
 *   groups   [num_groups, GROUP_FIELDS] int64: token_start, num_tokens, num_seqs,
 *            block_tables (int32 [num_kv_groups, num_seqs, table_stride], kv_group_stride
 *            values between KV cache groups), table_stride, seq_lens (int32),
 *            query_start_loc (int32 [num_seqs + 1], from 0 within the group), split_tokens,
 *            kv_group_stride
 *   caches   [num_blocks, block_size, KVH, D] of dtype, every layer's K and V with the same
 *            strides (checked by the caller)
 *   state_slots [num_state_seqs] int64, state_starts [num_state_seqs + 1] int32: the step's
 *            sequences' recurrent state slots and first tokens (decodes, then prefills), for
 *            OP_DELTANET (NULL and 0 for models without recurrent layers)
 *   final_norm NULL, or [H] (dtype, or float32 with final_mode 1): then also final_out [T, H]
 *            = rms_norm(hidden; final_norm, final_eps), the model's last norm
 *   timings  NULL, or [2] float64 seconds to add to: inside the projections, inside K/V stores
 *            and attention (benchmarks/step_floor.py: what is left is glue and small ops)
 *   tp       NULL, or a tensor-parallel rank's shared-memory collective (float32 only), int64
 *            [TP_FIELDS]: segment base, slot floats, rank, size, the last collective number
 *            (advanced here, one per OP_ALL_REDUCE), time limit in ms, nanoseconds spent in
 *            the collectives (added to), as layers/parallel.py's all-reduce
 * Returns 0, or LAYERS_E_* (the failing op is not reported: the binding checked the program,
 * so a failure is the step's arguments, and the first layer already fails).
 */
#include <math.h>
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
#define LAYERS_E_PROGRAM -7    /* an op the interpreter does not know, or a buffer out of range */
#define LAYERS_E_STATE -8 /* a recurrent state slot outside the layer's stores */

enum {
    BUF_HIDDEN, BUF_NORMED, BUF_QKV, BUF_ATTN, BUF_PROJ, BUF_GATE_UP, BUF_ACT, BUF_MIXED,
    BUF_VALUES, NUM_BUFS
};
enum {
    OP_NORM = 1, OP_LINEAR, OP_ROTARY, OP_ATTENTION, OP_ACT_MUL, OP_ADD, OP_ALL_REDUCE,
    OP_SPLIT_HEADS, OP_GATE_MUL, OP_DELTANET, OP_MOE
};
#define OP_FIELDS 16
enum { /* OP_NORM */
    N_SRC = 1, N_SRC_COL, N_HAS_DELTA, N_DELTA, N_DST, N_DST_COL, N_HEADS, N_WIDTH, N_WEIGHT,
    N_EPS, N_WEIGHT_MODE
};
enum { L_SRC = 1, L_DST, L_IN, L_OUT, L_PROJECTION }; /* OP_LINEAR */
enum { /* OP_ROTARY */
    R_BUF = 1, R_Q_COL, R_K_COL, R_Q_HEADS, R_K_HEADS, R_HEAD_DIM, R_ROTARY_DIM, R_PAIRS, R_ROPE
};
enum { /* OP_ATTENTION */
    A_SRC = 1, A_Q_COL, A_K_COL, A_V_COL, A_DST, A_K_CACHE, A_V_CACHE, A_HEADS, A_KV_HEADS,
    A_HEAD_DIM, A_WINDOW, A_SINKS, A_SCALE, A_KV_GROUP
};
enum { M_SRC = 1, M_DST, M_INTER, M_ACT };                 /* OP_ACT_MUL */
enum { D_DST = 1, D_SRC, D_WIDTH, D_HAS_SCALE, D_SCALE }; /* OP_ADD */
enum { U_BUF = 1, U_WIDTH };                              /* OP_ALL_REDUCE */
enum { H_BUF = 1, H_COL, H_HEADS, H_WIDTH };              /* OP_SPLIT_HEADS */
enum { Y_DST = 1, Y_SRC, Y_SRC_COL, Y_WIDTH };            /* OP_GATE_MUL */
enum { X_SRC = 1, X_DST, X_TABLE };                       /* OP_DELTANET, OP_MOE */
/* an OP_MOE table: the expert count, top k, renormalize (0/1), each expert's width, the
 * activation (0 silu, 1 gelu-tanh, 2 gpt-oss's clamped SwiGLU), the router's projection
 * table, a pointer to [E, 2] projection tables (each expert's gate_up and down), the shared
 * expert's width (0: none) and its gate_up, down and gate projection tables, the routing
 * (0 softmax then top k, 1 top k of the logits then their softmax), and the clamped
 * SwiGLU's alpha and limit as float32 bits (projection tables carry the biases) */
enum {
    MOE_EXPERTS, MOE_TOP_K, MOE_NORM, MOE_INTER, MOE_ACT, MOE_ROUTER, MOE_TABLES,
    MOE_SHARED_INTER, MOE_SHARED_GATE_UP, MOE_SHARED_DOWN, MOE_SHARED_GATE, MOE_ROUTING,
    MOE_ALPHA, MOE_LIMIT, MOE_FIELDS
};
/* an OP_DELTANET table: float32 pointers (conv kernel [C, K], A and dt_bias [Hv], the gated
 * norm's weight [dv], conv states [slots, C, K - 1], recurrent states [slots, Hv, dk, dv]),
 * then sizes; the norm's eps as float32 bits */
enum {
    DN_CONV, DN_A, DN_DT_BIAS, DN_NORM, DN_CONV_STATES, DN_SSM_STATES, DN_SLOTS, DN_KERNEL,
    DN_K_HEADS, DN_V_HEADS, DN_K_DIM, DN_V_DIM, DN_TILED, DN_EPS, DELTA_FIELDS
};

#define MAX_PARTS 4
_Static_assert(MAX_PARTS <= QUANT_MAX_PARTS, "pagecli_quant_linear_parts takes them all");
enum { P_BIAS, P_NUM_PARTS, P_PARTS, PROJECTION_FIELDS = P_PARTS + 3 * MAX_PARTS };
enum {
    G_TOKEN_START, G_NUM_TOKENS, G_NUM_SEQS, G_BLOCK_TABLES, G_TABLE_STRIDE, G_SEQ_LENS,
    G_QUERY_START_LOC, G_SPLIT_TOKENS, G_KV_GROUP_STRIDE, GROUP_FIELDS
};
enum { TP_BASE, TP_SLOT, TP_RANK, TP_SIZE, TP_NUMBER, TP_TIMEOUT_MS, TP_NANOS, TP_FIELDS };

#define PTR(v) ((void *)(intptr_t)(v))

static float as_float(int64_t bits) {
    const uint32_t b = (uint32_t)bits;
    float f;
    memcpy(&f, &b, sizeof f);
    return f;
}

/* Sum a [n] float32 buffer over the tensor-parallel ranks. */
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

/* y = x @ W.T (+ bias, added afterwards as torch's `out += bias` does), x [m, k] and y [m, n]
 * of dtype, W the projection's parts one after the other. bfloat16 sums into the float32
 * scratch rows y32 and rounds, as the loop's layers do: a bfloat16 weight through gemm_bf16.c
 * (layers/linear.BF16Linear), a block format through the float32 drivers with x widened into
 * x32 (layers/quant_linear.QuantLinear). */
static int linear(const int64_t *proj, const void *x, int64_t m, int64_t k, void *y, int64_t n,
                  int dtype, float *x32, float *y32, int num_threads, double *timings) {
    const double start = timings ? omp_get_wtime() : 0.0;
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
    int types[MAX_PARTS], bf16_rows = 0;
    const void *ws[MAX_PARTS];
    int64_t rows[MAX_PARTS];
    for (int p = 0; p < proj[P_NUM_PARTS]; p++) {
        types[p] = (int)proj[P_PARTS + 3 * p];
        ws[p] = PTR(proj[P_PARTS + 3 * p + 1]);
        rows[p] = proj[P_PARTS + 3 * p + 2];
        bf16_rows |= dtype && types[p] == QT_BF16;
    }
    if (!bf16_rows) /* the block formats (and float32 rows): x packed once for all parts */
        status = pagecli_quant_linear_parts((int)proj[P_NUM_PARTS], types, ws, rows, k, xf, k,
                                            m, yf, n, num_threads);
    int64_t first = 0; /* the part's first output column */
    for (int p = 0; bf16_rows && p < proj[P_NUM_PARTS] && status == 0; p++) {
        if (dtype && types[p] == QT_BF16)
            status = pagecli_bf16_linear(ws[p], rows[p], k, x, k, m, yf + first, n, num_threads);
        else
            status = pagecli_quant_linear(types[p], ws[p], rows[p], k, xf, k, m, yf + first, n,
                                          num_threads);
        first += rows[p];
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

/* Columns [c0, c1) of linear's y for float32 x and y, on the calling thread: the parts'
 * rows in that range, then their bias. A row of W sums the same whatever rows are computed
 * beside it on the fused kernels (batches of up to pagecli_quant_fused_rows rows), so a
 * projection cut into column ranges gives linear's bits there. */
static int linear_cols(const int64_t *proj, const float *x, int64_t m, int64_t k, float *y,
                       int64_t n, int64_t c0, int64_t c1) {
    if (proj[P_NUM_PARTS] < 1 || proj[P_NUM_PARTS] > MAX_PARTS) return LAYERS_E_PARTS;
    int64_t first = 0; /* the part's first output column */
    for (int p = 0; p < proj[P_NUM_PARTS]; p++) {
        const int type = (int)proj[P_PARTS + 3 * p];
        const uint8_t *w = PTR(proj[P_PARTS + 3 * p + 1]);
        const int64_t rows = proj[P_PARTS + 3 * p + 2];
        const int64_t lo = c0 > first ? c0 : first, hi = c1 < first + rows ? c1 : first + rows;
        if (lo < hi) {
            const int64_t row_bytes = pagecli_quant_row_bytes(type, k);
            if (row_bytes < 0) return LAYERS_E_FORMAT;
            const int status = pagecli_quant_linear(type, w + (lo - first) * row_bytes, hi - lo,
                                                    k, x, k, m, y + lo, n, 1);
            if (status) return status == -3 ? LAYERS_E_MEMORY : LAYERS_E_FORMAT;
        }
        first += rows;
    }
    if (first != n) return LAYERS_E_PARTS;
    const float *bias = PTR(proj[P_BIAS]);
    for (int64_t t = 0; bias && t < m; ++t)
        for (int64_t j = c0; j < c1; ++j) y[t * n + j] += bias[j];
    return 0;
}

/* What one step shares with every op. */
typedef struct {
    char *buf[NUM_BUFS];
    int64_t width[NUM_BUFS];
    int64_t T;
    int dtype, es, num_threads, attention_isa;
    float *query, *attn, *x32, *y32; /* float32 scratch: [T, max Q] twice, bfloat16's rows */
    const int64_t *ropes;
    int num_ropes;
    const int64_t *slot_mapping;
    int64_t slot_stride;
    int num_kv_groups;
    int64_t num_blocks, stride_block, stride_slot, stride_head;
    int block_size;
    const int64_t *groups;
    int num_groups;
    double *timings;
    int64_t *tp;
    const int64_t *state_slots;
    const int32_t *state_starts;
    int num_state_seqs;
} Step;

/* A buffer's columns [col, col + count) exist. */
static int in_buffer(const Step *s, int64_t b, int64_t col, int64_t count) {
    return b >= 0 && b < NUM_BUFS && col >= 0 && count >= 0 && col + count <= s->width[b];
}

static char *at(const Step *s, int64_t b, int64_t col) {
    return s->buf[b] + col * s->es;
}

static int op_norm(const Step *s, const int64_t *op) {
    const int64_t heads = op[N_HEADS], width = op[N_WIDTH];
    if (!in_buffer(s, op[N_SRC], op[N_SRC_COL], heads * width) ||
        !in_buffer(s, op[N_DST], op[N_DST_COL], heads * width) ||
        (op[N_HAS_DELTA] && (!in_buffer(s, op[N_DELTA], 0, heads * width) || heads != 1)))
        return LAYERS_E_PROGRAM;
    const void *delta = op[N_HAS_DELTA] ? at(s, op[N_DELTA], 0) : NULL;
    pagecli_rms_norm(at(s, op[N_SRC], op[N_SRC_COL]), delta, PTR(op[N_WEIGHT]),
                     at(s, op[N_DST], op[N_DST_COL]), s->T, heads, width, s->width[op[N_SRC]],
                     op[N_HAS_DELTA] ? s->width[op[N_DELTA]] : 0, s->width[op[N_DST]],
                     as_float(op[N_EPS]), s->dtype, (int)op[N_WEIGHT_MODE], s->num_threads);
    return 0;
}

static int op_linear(const Step *s, const int64_t *op) {
    if (!in_buffer(s, op[L_SRC], 0, op[L_IN]) || !in_buffer(s, op[L_DST], 0, op[L_OUT]) ||
        op[L_IN] != s->width[op[L_SRC]] || op[L_OUT] != s->width[op[L_DST]] ||
        op[L_SRC] == op[L_DST])
        return LAYERS_E_PROGRAM; /* whole rows: the kernels take unit-stride [T, k] inputs */
    return linear(PTR(op[L_PROJECTION]), s->buf[op[L_SRC]], s->T, op[L_IN], s->buf[op[L_DST]],
                  op[L_OUT], s->dtype, s->x32, s->y32, s->num_threads, s->timings);
}

static int op_rotary(const Step *s, const int64_t *op) {
    const int64_t d = op[R_HEAD_DIM], rd = op[R_ROTARY_DIM];
    if (!in_buffer(s, op[R_BUF], op[R_Q_COL], op[R_Q_HEADS] * d) ||
        !in_buffer(s, op[R_BUF], op[R_K_COL], op[R_K_HEADS] * d) || op[R_ROPE] < 0 ||
        op[R_ROPE] >= s->num_ropes || s->ropes[3 * op[R_ROPE] + 2] != rd || rd > d || rd % 2 ||
        rd > 512)
        return LAYERS_E_PROGRAM;
    const int64_t *rope = s->ropes + 3 * op[R_ROPE];
    const int64_t stride = s->width[op[R_BUF]];
    pagecli_rotary(at(s, op[R_BUF], op[R_Q_COL]), at(s, op[R_BUF], op[R_K_COL]), PTR(rope[0]),
                   PTR(rope[1]), s->T, op[R_Q_HEADS], op[R_K_HEADS], d, rd, stride, stride,
                   s->dtype, (int)op[R_PAIRS]);
    return 0;
}

static int op_attention(const Step *s, const int64_t *op) {
    const int num_heads = (int)op[A_HEADS], num_kv_heads = (int)op[A_KV_HEADS];
    const int head_dim = (int)op[A_HEAD_DIM];
    const int64_t Q = (int64_t)num_heads * head_dim, KV = (int64_t)num_kv_heads * head_dim;
    const int64_t src = op[A_SRC], ld = in_buffer(s, src, 0, 0) ? s->width[src] : 0;
    if (!in_buffer(s, src, op[A_Q_COL], Q) || !in_buffer(s, src, op[A_K_COL], KV) ||
        !in_buffer(s, src, op[A_V_COL], KV) || !in_buffer(s, op[A_DST], 0, Q) ||
        s->width[op[A_DST]] != Q || Q > s->width[BUF_ATTN] || s->stride_head != head_dim ||
        num_kv_heads < 1 || num_heads % num_kv_heads || op[A_KV_GROUP] < 0 ||
        op[A_KV_GROUP] >= s->num_kv_groups)
        return LAYERS_E_PROGRAM;
    const int64_t kv_group = op[A_KV_GROUP];
    const double start = s->timings ? omp_get_wtime() : 0.0;
    void *k_cache = PTR(op[A_K_CACHE]), *v_cache = PTR(op[A_V_CACHE]);
    const int64_t T = s->T;
    if (pagecli_store_kv(at(s, src, op[A_K_COL]), at(s, src, op[A_V_COL]), ld, ld, k_cache,
                         v_cache, s->stride_block, s->stride_slot,
                         s->slot_mapping + kv_group * s->slot_stride, T, KV,
                         s->es, s->block_size, s->num_blocks * s->block_size))
        return LAYERS_E_SLOT;
    const char *q = at(s, src, op[A_Q_COL]);
#pragma omp parallel for num_threads(s->num_threads) schedule(static) if (T >= 64)
    for (int64_t t = 0; t < T; ++t) {
        if (s->dtype == 0) {
            memcpy(s->query + t * Q, (const float *)q + t * ld, sizeof(float) * (size_t)Q);
            continue;
        }
        const uint16_t *row = (const uint16_t *)q + t * ld;
        for (int64_t i = 0; i < Q; ++i) s->query[t * Q + i] = bf16_to_f32(row[i]);
    }
    /* float32: straight into the destination buffer; bfloat16: rounded into it below */
    float *out = s->dtype ? s->attn : (float *)s->buf[op[A_DST]];
    int status = 0;
    for (int g = 0; g < s->num_groups && status == 0; ++g) {
        const int64_t *grp = s->groups + (int64_t)g * GROUP_FIELDS;
        const int64_t first = grp[G_TOKEN_START];
        const int32_t *tables =
            (const int32_t *)PTR(grp[G_BLOCK_TABLES]) + kv_group * grp[G_KV_GROUP_STRIDE];
        const int a = pagecli_paged_attention(
            s->attention_isa, s->dtype, s->query + first * Q, k_cache, v_cache, s->num_blocks,
            s->stride_block, s->stride_slot, s->stride_head, tables,
            grp[G_TABLE_STRIDE], PTR(grp[G_SEQ_LENS]), PTR(grp[G_QUERY_START_LOC]),
            out + first * Q, (int)grp[G_NUM_SEQS], num_heads, num_kv_heads, head_dim,
            s->block_size, as_float(op[A_SCALE]), (int)op[A_WINDOW], PTR(op[A_SINKS]),
            (int)grp[G_SPLIT_TOKENS], s->num_threads);
        if (a) status = a == -1 ? LAYERS_E_BLOCK : LAYERS_E_MEMORY;
    }
    if (s->timings) s->timings[1] += omp_get_wtime() - start;
    if (status == 0 && s->dtype)
        narrow_bf16(s->attn, (uint16_t *)s->buf[op[A_DST]], T * Q, s->num_threads);
    return status;
}

static int op_act_mul(const Step *s, const int64_t *op) {
    const int64_t inter = op[M_INTER];
    if (!in_buffer(s, op[M_SRC], 0, 2 * inter) || !in_buffer(s, op[M_DST], 0, inter) ||
        op[M_ACT] < 0 || op[M_ACT] > 1)
        return LAYERS_E_PROGRAM;
    pagecli_act_mul(s->buf[op[M_SRC]], s->buf[op[M_DST]], s->T, inter, s->width[op[M_SRC]],
                    s->width[op[M_DST]], s->dtype, (int)op[M_ACT], s->num_threads);
    return 0;
}

static int op_add(const Step *s, const int64_t *op) {
    const int64_t width = op[D_WIDTH];
    if (!in_buffer(s, op[D_DST], 0, width) || !in_buffer(s, op[D_SRC], 0, width))
        return LAYERS_E_PROGRAM;
    pagecli_add_scaled(s->buf[op[D_DST]], s->buf[op[D_SRC]], s->T, width, s->width[op[D_DST]],
                       s->width[op[D_SRC]], as_float(op[D_SCALE]), (int)op[D_HAS_SCALE],
                       s->dtype, s->num_threads);
    return 0;
}

static int op_all_reduce(const Step *s, const int64_t *op) {
    if (!s->tp) return 0; /* one rank: nothing to sum */
    const int64_t width = op[U_WIDTH];
    if (!in_buffer(s, op[U_BUF], 0, width) || width != s->width[op[U_BUF]])
        return LAYERS_E_PROGRAM;
    return all_reduce(s->tp, (float *)s->buf[op[U_BUF]], s->T * width);
}

static int op_split_heads(const Step *s, const int64_t *op) {
    const int64_t heads = op[H_HEADS], width = op[H_WIDTH], span = 2 * heads * width;
    if (!in_buffer(s, op[H_BUF], op[H_COL], span) || heads < 1 || width < 1)
        return LAYERS_E_PROGRAM;
    char *tmp = malloc((size_t)(span * s->es));
    if (!tmp) return LAYERS_E_MEMORY;
    const size_t piece = (size_t)(width * s->es);
    for (int64_t t = 0; t < s->T; ++t) {
        char *row = s->buf[op[H_BUF]] + (t * s->width[op[H_BUF]] + op[H_COL]) * s->es;
        memcpy(tmp, row, (size_t)(span * s->es));
        for (int64_t h = 0; h < heads; ++h) {
            memcpy(row + h * piece, tmp + 2 * h * piece, piece);
            memcpy(row + (heads + h) * piece, tmp + (2 * h + 1) * piece, piece);
        }
    }
    free(tmp);
    return 0;
}

static int op_gate_mul(const Step *s, const int64_t *op) {
    const int64_t width = op[Y_WIDTH];
    if (s->dtype != 0) return LAYERS_E_FORMAT;
    if (!in_buffer(s, op[Y_DST], 0, width) || !in_buffer(s, op[Y_SRC], op[Y_SRC_COL], width))
        return LAYERS_E_PROGRAM;
    pagecli_gate_mul((float *)s->buf[op[Y_DST]], (const float *)at(s, op[Y_SRC], op[Y_SRC_COL]),
                     s->T, width, s->width[op[Y_DST]], s->width[op[Y_SRC]], s->num_threads);
    return 0;
}

static int op_deltanet(const Step *s, const int64_t *op) {
    const int64_t *d = PTR(op[X_TABLE]);
    const int64_t C = 2 * d[DN_K_HEADS] * d[DN_K_DIM] + d[DN_V_HEADS] * d[DN_V_DIM];
    const int64_t in = C + d[DN_V_HEADS] * d[DN_V_DIM] + 2 * d[DN_V_HEADS];
    if (s->dtype != 0) return LAYERS_E_FORMAT;
    if (!in_buffer(s, op[X_SRC], 0, in) || !in_buffer(s, op[X_DST], 0, d[DN_V_HEADS] * d[DN_V_DIM]))
        return LAYERS_E_PROGRAM;
    if (s->num_state_seqs < 1 || s->state_starts[0] != 0 ||
        s->state_starts[s->num_state_seqs] != s->T)
        return LAYERS_E_STATE;
    const int status = pagecli_gated_delta(
        (const float *)s->buf[op[X_SRC]], s->width[op[X_SRC]], s->T, PTR(d[DN_CONV]),
        (int)d[DN_KERNEL], PTR(d[DN_A]), PTR(d[DN_DT_BIAS]), PTR(d[DN_NORM]),
        as_float(d[DN_EPS]), PTR(d[DN_CONV_STATES]), PTR(d[DN_SSM_STATES]), d[DN_SLOTS],
        s->state_slots, s->state_starts, s->num_state_seqs, (int)d[DN_K_HEADS],
        (int)d[DN_V_HEADS], (int)d[DN_K_DIM], (int)d[DN_V_DIM], (int)d[DN_TILED],
        (float *)s->buf[op[X_DST]], s->width[op[X_DST]], s->num_threads);
    return status == 0 ? 0 : status == -2 ? LAYERS_E_MEMORY : LAYERS_E_STATE;
}

/* An expert's activation over n rows of gate_up [n, 2I] into a [n, I] (float32); act 2: the
 * clamped SwiGLU of the table m. */
static void expert_act(const int64_t *m, const float *gu, float *a, int64_t n, int64_t inter,
                       int act, int num_threads) {
    if (act == 2)
        pagecli_swiglu_oai(gu, a, n, inter, 2 * inter, inter, 0, as_float(m[MOE_ALPHA]),
                           as_float(m[MOE_LIMIT]), num_threads);
    else
        pagecli_act_mul(gu, a, n, inter, 2 * inter, inter, 0, act, num_threads);
}

/* sums[tokens[i]][lo, hi) += y[i][lo, hi) * w[i] for i < n (rows H apart): each expert's
 * outputs times their routing weights, added per token in the order the rows come. */
static void add_weighted(float *sums, const int64_t *tokens, const float *w, const float *y,
                         int64_t n, int64_t H, int64_t lo, int64_t hi) {
    for (int64_t i = 0; i < n; ++i) {
        float *sum = sums + tokens[i] * H;
        for (int64_t h = lo; h < hi; ++h) {
            const float scaled = y[i * H + h] * w[i];
            sum[h] += scaled;
        }
    }
}

/* The gated MLP of one expert over n gathered rows x [n, H] into y [n, H] (float32), with
 * scratch gate_up [n, 2I] and act [n, I]. */
static int expert_mlp(const int64_t *m, const int64_t *gate_up, const int64_t *down,
                      const float *x, int64_t n, int64_t H, int64_t inter, int act, float *gu,
                      float *a, float *y, int num_threads, double *timings) {
    int status = linear(gate_up, x, n, H, gu, 2 * inter, 0, NULL, NULL, num_threads, timings);
    if (status) return status;
    expert_act(m, gu, a, n, inter, act, num_threads);
    return linear(down, a, n, inter, y, H, 0, NULL, NULL, num_threads, timings);
}

/* Piece t's share [lo, hi) of n columns cut into nt pieces, in whole groups of 16. */
static void column_share(int64_t n, int t, int nt, int64_t *lo, int64_t *hi) {
    const int64_t per = ((n + nt - 1) / nt + 15) / 16 * 16;
    *lo = t * per < n ? t * per : n;
    *hi = *lo + per < n ? *lo + per : n;
}

/* Whether expert c's tokens (rows [starts[c], starts[c + 1]) of `rows`) are consecutive: then
 * its inputs are x's own rows, else they are gathered. */
static int consecutive(const int64_t *rows, const int64_t *starts, int64_t c) {
    for (int64_t i = starts[c] + 1; i < starts[c + 1]; ++i)
        if (rows[i] != rows[i - 1] + 1) return 0;
    return 1;
}

/* Pieces of an expert's projection of n columns for nt threads: two a thread, each of at
 * least MOE_PIECE_ROWS rows (each piece's call splits its input again on the integer paths,
 * a microsecond or less beside tens of microseconds of rows). */
#define MOE_PIECE_ROWS 64
static int projection_pieces(int64_t n, int nt) {
    const int64_t most = (n + MOE_PIECE_ROWS - 1) / MOE_PIECE_ROWS;
    return (int)(2 * nt < most ? 2 * nt : most);
}

/* The chosen experts of a decode-sized step (T up to the fused kernels' rows) in one parallel
 * region: the threads take pieces of the chosen experts' gate_up columns (projection_pieces
 * of each expert, dynamically: a thread slowed by a neighbour on its core takes fewer), then
 * each its share of the activation rows, then pieces of the down projections' columns, then
 * each its share of the hidden columns of the weighted sums (each token's experts added in
 * ascending order, as the loop adds them). The loop forks and joins the threads twice for
 * each expert (16 times a layer at top 8), which at batch 1 on many cores costs more than an
 * expert's few rows a thread; here it is three barriers a layer. Expert c has the flat rows
 * [starts[c], starts[c + 1]) of rows (its tokens), rw (their routing weights) and the scratch
 * xg [*, H] (its inputs, where they are not consecutive rows of xin), gu [*, 2I], a [*, I],
 * yo [*, H]. The bits are the loop's: linear_cols gives linear's, and each row's activation
 * and each sum are computed as there. */
static int moe_decode(const int64_t *m, const int64_t *chosen, const int64_t *starts,
                      int64_t count, const int64_t *rows, const float *rw, const float *xin,
                      int64_t H, int64_t inter, int act_kind, float *xg, float *gu, float *a,
                      float *yo, float *sums, int num_threads) {
    const int64_t *tables = PTR(m[MOE_TABLES]), total = starts[count];
    for (int64_t c = 0; c < count; ++c) /* at batch 1 none: each expert has x's row */
        if (!consecutive(rows, starts, c))
            for (int64_t i = starts[c]; i < starts[c + 1]; ++i)
                memcpy(xg + i * H, xin + rows[i] * H, sizeof(float) * (size_t)H);
    int status = 0;
#pragma omp parallel num_threads(num_threads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int pieces = projection_pieces(2 * inter, nt);
        int mine = 0;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < count * pieces; ++item) {
            const int64_t c = item / pieces;
            const float *xc = consecutive(rows, starts, c) ? xin + rows[starts[c]] * H
                                                           : xg + starts[c] * H;
            int64_t lo, hi;
            column_share(2 * inter, (int)(item % pieces), pieces, &lo, &hi);
            if (lo < hi && !mine)
                mine = linear_cols(PTR(tables[2 * chosen[c]]), xc, starts[c + 1] - starts[c], H,
                                   gu + starts[c] * 2 * inter, 2 * inter, lo, hi);
        }
        const int64_t r0 = total * t / nt, r1 = total * (t + 1) / nt; /* activation rows */
        if (r0 < r1)
            expert_act(m, gu + r0 * 2 * inter, a + r0 * inter, r1 - r0, inter, act_kind, 1);
#pragma omp barrier
        const int down_pieces = projection_pieces(H, nt);
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < count * down_pieces; ++item) {
            const int64_t c = item / down_pieces;
            int64_t lo, hi;
            column_share(H, (int)(item % down_pieces), down_pieces, &lo, &hi);
            if (lo < hi && !mine)
                mine = linear_cols(PTR(tables[2 * chosen[c] + 1]), a + starts[c] * inter,
                                   starts[c + 1] - starts[c], inter, yo + starts[c] * H, H, lo,
                                   hi);
        }
        int64_t lo, hi;
        column_share(H, t, nt, &lo, &hi);
        add_weighted(sums, rows, rw, yo, total, H, lo, hi); /* in ascending expert order */
        if (mine) {
#pragma omp critical(moe_decode_status)
            if (!status) status = mine;
        }
    }
    return status;
}

/* The sparse MoE MLP (OP_MOE) of x [T, H] (rows ldx apart) into out [T, ldo] (float32). */
static int moe(const int64_t *m, const float *x, int64_t ldx, int64_t T, int64_t H,
               float *out, int64_t ldo, int num_threads, double *timings) {
    const int64_t E = m[MOE_EXPERTS], k = m[MOE_TOP_K], inter = m[MOE_INTER];
    const int64_t shared = m[MOE_SHARED_INTER], wide = inter > shared ? inter : shared;
    const int act_kind = (int)m[MOE_ACT], routing = (int)m[MOE_ROUTING];
    if (E < 1 || k < 1 || k > E || inter < 1 || shared < 0 || act_kind < 0 || act_kind > 2 ||
        routing < 0 || routing > 1)
        return LAYERS_E_PROGRAM;
    const int64_t *tables = PTR(m[MOE_TABLES]);
    /* decode-sized steps take moe_decode, with every chosen expert's rows at once: R rows of
     * scratch (the loop reuses T of them for one expert at a time) */
    const int decode = num_threads > 1 && T <= pagecli_quant_fused_rows();
    const int64_t R = decode ? T * k : T;
    /* scratch: the unit-stride input [T, H], logits [T, E], routing weights [T, k], the
     * chosen rows' weights [T k], gathered rows [R, H], gate_up [R, 2 wide], act [R, wide],
     * outputs [R, H], the sums [T, H], the shared expert's gate [T] */
    const int64_t floats = T * H + T * E + T * k + T * k + R * H + 3 * R * wide + R * H +
                           T * H + T;
    float *buf = malloc(sizeof(float) * (size_t)floats);
    /* each token's choices [T, k]; the chosen rows' tokens [T k], expert by expert; the chosen
     * experts in ascending order [E] and where their rows start [E + 1]; a count [E + 1] */
    int64_t *ids = malloc(sizeof(int64_t) * (size_t)(2 * T * k + 3 * E + 2));
    char *taken = malloc((size_t)E);
    if (!buf || !ids || !taken) {
        free(buf);
        free(ids);
        free(taken);
        return LAYERS_E_MEMORY;
    }
    float *xin = buf, *logits = xin + T * H, *weights = logits + T * E, *rw = weights + T * k;
    float *xg = rw + T * k, *gu = xg + R * H, *act = gu + 2 * R * wide, *yo = act + R * wide;
    float *sums = yo + R * H, *shared_gate = sums + T * H;
    int64_t *choice = ids, *rows = choice + T * k, *chosen = rows + T * k;
    int64_t *starts = chosen + E, *next = starts + E + 1;
    for (int64_t t = 0; t < T; ++t) memcpy(xin + t * H, x + t * ldx, sizeof(float) * (size_t)H);
    int status = linear(PTR(m[MOE_ROUTER]), xin, T, H, logits, E, 0, NULL, NULL, num_threads,
                        timings);
    /* routing 0: softmax over the experts in float32, the top k (the first of equals),
     * renormalized; routing 1: the top k of the logits, a softmax over those k */
    for (int64_t t = 0; t < T && status == 0; ++t) {
        float *p = logits + t * E, top = p[0], total = 0.0f, picked = 0.0f;
        if (routing == 0) {
            for (int64_t e = 1; e < E; ++e) top = p[e] > top ? p[e] : top;
            for (int64_t e = 0; e < E; ++e) total += (p[e] = expf(p[e] - top));
            for (int64_t e = 0; e < E; ++e) p[e] /= total;
        }
        memset(taken, 0, (size_t)E);
        for (int64_t j = 0; j < k; ++j) {
            int64_t best = -1;
            for (int64_t e = 0; e < E; ++e)
                if (!taken[e] && (best < 0 || p[e] > p[best])) best = e;
            taken[best] = 1;
            choice[t * k + j] = best;
            weights[t * k + j] = p[best];
            picked += p[best];
        }
        if (routing == 1) { /* the largest first: weights[t k] is the softmax's maximum */
            float *w = weights + t * k;
            top = w[0], picked = 0.0f;
            for (int64_t j = 0; j < k; ++j) picked += (w[j] = expf(w[j] - top));
            for (int64_t j = 0; j < k; ++j) w[j] /= picked;
        } else if (m[MOE_NORM])
            for (int64_t j = 0; j < k; ++j) weights[t * k + j] /= picked;
    }
    /* the chosen rows grouped by expert, ascending, each expert's tokens in order */
    int64_t count = 0;
    if (status == 0) {
        memset(next, 0, sizeof(int64_t) * (size_t)(E + 1)); /* then each expert's next row */
        for (int64_t i = 0; i < T * k; ++i) next[choice[i] + 1]++;
        for (int64_t e = 0; e < E; ++e) next[e + 1] += next[e];
        for (int64_t i = 0; i < T * k; ++i) {
            const int64_t at = next[choice[i]]++;
            rows[at] = i / k;
            rw[at] = weights[i];
        }
        for (int64_t e = 0; e < E; ++e) /* next[e]: expert e's end, next[e - 1] its start */
            if (next[e] > (e ? next[e - 1] : 0)) {
                chosen[count] = e;
                starts[count++] = e ? next[e - 1] : 0;
            }
        starts[count] = T * k;
    }
    memset(sums, 0, sizeof(float) * (size_t)(T * H));
    if (status == 0 && decode) {
        const double start = timings ? omp_get_wtime() : 0.0;
        status = moe_decode(m, chosen, starts, count, rows, rw, xin, H, inter, act_kind, xg, gu,
                            act, yo, sums, num_threads);
        if (timings) timings[0] += omp_get_wtime() - start; /* mostly the projections */
    }
    /* each chosen expert once over all its tokens, in ascending expert order */
    for (int64_t c = 0; c < count && status == 0 && !decode; ++c) {
        const int64_t e = chosen[c], n = starts[c + 1] - starts[c];
        const int64_t *tokens = rows + starts[c];
        const float *tw = rw + starts[c];
        for (int64_t i = 0; i < n; ++i)
            memcpy(xg + i * H, xin + tokens[i] * H, sizeof(float) * (size_t)H);
        status = expert_mlp(m, PTR(tables[2 * e]), PTR(tables[2 * e + 1]), xg, n, H, inter,
                            act_kind, gu, act, yo, num_threads, timings);
        if (status == 0) add_weighted(sums, tokens, tw, yo, n, H, 0, H);
    }
    if (status == 0 && shared) { /* sigmoid(gate(x)) * shared(x), added to every token */
        status = linear(PTR(m[MOE_SHARED_GATE]), xin, T, H, shared_gate, 1, 0, NULL, NULL,
                        num_threads, timings);
        if (status == 0)
            status = expert_mlp(m, PTR(m[MOE_SHARED_GATE_UP]), PTR(m[MOE_SHARED_DOWN]), xin, T,
                                H, shared, act_kind, gu, act, yo, num_threads, timings);
        for (int64_t t = 0; t < T && status == 0; ++t) {
            const float g = 1.0f / (1.0f + expf(-shared_gate[t]));
            for (int64_t h = 0; h < H; ++h) {
                const float scaled = g * yo[t * H + h];
                sums[t * H + h] += scaled;
            }
        }
    }
    for (int64_t t = 0; t < T && status == 0; ++t)
        memcpy(out + t * ldo, sums + t * H, sizeof(float) * (size_t)H);
    free(buf);
    free(ids);
    free(taken);
    return status;
}

/* The Python loop's entry to the same MoE (layers/moe.py): x [T, H] -> out [T, H] float32.
 * Returns 0 or a LAYERS_E_* status. */
int pagecli_moe(const int64_t *table, const float *x, int64_t T, int64_t H, float *out,
                int num_threads) {
    return moe(table, x, H, T, H, out, H, num_threads, NULL);
}

static int op_moe(const Step *s, const int64_t *op) {
    const int64_t H = s->width[BUF_HIDDEN];
    if (s->dtype != 0) return LAYERS_E_FORMAT;
    if (!in_buffer(s, op[X_SRC], 0, H) || !in_buffer(s, op[X_DST], 0, H) ||
        op[X_SRC] == op[X_DST])
        return LAYERS_E_PROGRAM;
    return moe(PTR(op[X_TABLE]), (const float *)s->buf[op[X_SRC]], s->width[op[X_SRC]], s->T,
               H, (float *)s->buf[op[X_DST]], s->width[op[X_DST]], s->num_threads,
               s->timings);
}

int pagecli_layer_program(const int64_t *program, int64_t num_ops, void *hidden, int64_t T,
                          const int64_t *widths, const int64_t *ropes, int num_ropes,
                          const int64_t *slot_mapping, int64_t slot_stride, int num_kv_groups,
                          int64_t num_blocks, int block_size,
                          int64_t stride_block, int64_t stride_slot, int64_t stride_head,
                          const int64_t *groups, int num_groups, int attention_isa,
                          int num_threads, const void *final_norm, float final_eps,
                          int final_mode, void *final_out, int dtype, double *timings,
                          int64_t *tp, const int64_t *state_slots, const int32_t *state_starts,
                          int num_state_seqs) {
    if (dtype != 0 && dtype != 1) return LAYERS_E_FORMAT;
    if (tp && (dtype != 0 || T * widths[BUF_HIDDEN] > tp[TP_SLOT])) return LAYERS_E_FORMAT;
    Step s = {0};
    s.T = T;
    s.dtype = dtype;
    s.es = dtype ? 2 : 4;
    s.num_threads = num_threads;
    s.attention_isa = attention_isa;
    s.ropes = ropes;
    s.num_ropes = num_ropes;
    s.slot_mapping = slot_mapping;
    s.slot_stride = slot_stride;
    s.num_kv_groups = num_kv_groups;
    s.num_blocks = num_blocks;
    s.block_size = block_size;
    s.stride_block = stride_block;
    s.stride_slot = stride_slot;
    s.stride_head = stride_head;
    s.groups = groups;
    s.num_groups = num_groups;
    s.timings = timings;
    s.tp = tp;
    s.state_slots = state_slots;
    s.state_starts = state_starts;
    s.num_state_seqs = num_state_seqs;
    int64_t wide_in = 0, wide_out = 0; /* bfloat16: the projections' float32 rows */
    for (int b = 0; b < NUM_BUFS; ++b) {
        if (widths[b] < 0) return LAYERS_E_PROGRAM;
        s.width[b] = widths[b];
        wide_in = widths[b] > wide_in ? widths[b] : wide_in;
    }
    wide_out = wide_in;
    /* work buffers, each 64-byte aligned as torch's tensors are, so that the kernels (and
     * MKL's sgemm in the panel path) see the inputs the Python loop hands them: the BUF_*
     * buffers after BUF_HIDDEN, in values of dtype; in float32 the query and attention rows
     * [T, width of BUF_ATTN] and, for bfloat16, the projections' input and output rows */
    int64_t bytes[NUM_BUFS + 4], offsets[NUM_BUFS + 4], total = 0;
    for (int b = 0; b < NUM_BUFS; ++b) bytes[b] = b == BUF_HIDDEN ? 0 : T * widths[b] * s.es;
    bytes[NUM_BUFS] = bytes[NUM_BUFS + 1] = T * widths[BUF_ATTN] * 4;
    bytes[NUM_BUFS + 2] = dtype ? T * wide_in * 4 : 0;
    bytes[NUM_BUFS + 3] = dtype ? T * wide_out * 4 : 0;
    for (int i = 0; i < NUM_BUFS + 4; ++i) {
        offsets[i] = total;
        total += (bytes[i] + 63) / 64 * 64;
    }
    char *work = aligned_alloc(64, (size_t)(total ? total : 64));
    if (!work) return LAYERS_E_MEMORY;
    for (int b = 0; b < NUM_BUFS; ++b) s.buf[b] = work + offsets[b];
    s.buf[BUF_HIDDEN] = hidden;
    s.query = (float *)(work + offsets[NUM_BUFS]);
    s.attn = (float *)(work + offsets[NUM_BUFS + 1]);
    s.x32 = (float *)(work + offsets[NUM_BUFS + 2]);
    s.y32 = (float *)(work + offsets[NUM_BUFS + 3]);

    int status = 0;
    for (int64_t i = 0; i < num_ops && status == 0; ++i) {
        const int64_t *op = program + i * OP_FIELDS;
        switch (op[0]) {
        case OP_NORM: status = op_norm(&s, op); break;
        case OP_LINEAR: status = op_linear(&s, op); break;
        case OP_ROTARY: status = op_rotary(&s, op); break;
        case OP_ATTENTION: status = op_attention(&s, op); break;
        case OP_ACT_MUL: status = op_act_mul(&s, op); break;
        case OP_ADD: status = op_add(&s, op); break;
        case OP_ALL_REDUCE: status = op_all_reduce(&s, op); break;
        case OP_SPLIT_HEADS: status = op_split_heads(&s, op); break;
        case OP_GATE_MUL: status = op_gate_mul(&s, op); break;
        case OP_DELTANET: status = op_deltanet(&s, op); break;
        case OP_MOE: status = op_moe(&s, op); break;
        default: status = LAYERS_E_PROGRAM;
        }
    }
    if (status == 0 && final_norm)
        pagecli_rms_norm(hidden, NULL, final_norm, final_out, T, 1, widths[BUF_HIDDEN],
                         widths[BUF_HIDDEN], 0, widths[BUF_HIDDEN], final_eps, dtype,
                         final_mode, num_threads);
    free(work);
    return status;
}
