/*
 * Paged attention for the CPU: decode tokens and prefill chunks over a cached prefix, for
 * float32, bfloat16 and float16 caches, reading every K/V row in place through the block
 * table (no gathered copy) and accumulating in float32.
 *
 * One entry point serves both phases: sequence s has q_len = query_start_loc[s + 1] -
 * query_start_loc[s] new tokens, the last of its seq_lens[s] cached ones, so new token j sits
 * at position seq_len - q_len + j and attends to positions 0..that one (bottom-right aligned
 * causal mask). A decode is the q_len == 1 case. With a sliding window of w tokens, that token
 * attends to positions max(0, pos - w + 1)..pos only (transformers' `sliding_window`: the
 * window counts the token itself). With attention sinks, head h's softmax has one more term in
 * its denominator, e^(sinks[h] - max), which weighs no value (gpt-oss): the running sum of an
 * item starts at 1 with the sink as its maximum; with split-K, that of the first split's.
 *
 * Work is cut into items: (sequence, slice of query tokens, kv heads, context split); a decode's
 * item takes all of its sequence's kv heads (item_heads). For each of its kv heads, an item's
 * query rows are its tokens times the head's GQA group, so each cached K/V row is brought in
 * once per item and used by every row. Context tokens go by in chunks of TC with an online
 * softmax (running max and sum per row). With split_tokens > 0 a sequence's context is also
 * cut into splits of that many tokens (split-K), each item keeps its unnormalised partial
 * result, and a second pass combines them: one long sequence then keeps every thread busy.
 * Items are shared among OpenMP threads dynamically.
 *
 * The item body is compiled three times: for AVX-512 and AVX2 (per-function target
 * attributes) and for the baseline of the architecture (the portable path, plain C on vector
 * extensions). cpu_features.c's pagecli_isa_supported() says which ones this CPU runs; the
 * caller picks one.
 *
 * Layouts (element strides; the last dimension of the caches is contiguous):
 *   query, out     [num_tokens, num_heads, head_dim] float32, contiguous
 *   k/v cache      [num_blocks, block_size, num_kv_heads, head_dim], same strides, kv_dtype
 *   block_tables   [num_seqs, table_stride] int32
 *   seq_lens       [num_seqs] int32, 1 <= seq_lens[s] <= table width * block_size
 *   query_start_loc [num_seqs + 1] int32, 1 <= q_len <= seq_len
 *   window          tokens a query sees, itself included; 0: every earlier token
 *   sinks           NULL, or [num_heads] float32 logits (already in the scores' units)
 * Returns 0, -1 when a block id is outside [0, num_blocks), -2 when out of memory.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "cpu_entry_points.h"
#include "cpu_features.h"
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#include "transpose16.h"
#endif

enum { KV_F32 = 0, KV_BF16 = 1, KV_F16 = 2 };

#define TC 16       /* context tokens per chunk */
#define MAX_ROWS 64 /* query rows per item (slice tokens x group), at least one token */
#define TRANSPOSE_MIN_ROWS 8 /* from this many rows on, scores go through K transposed */
#define INLINE static inline __attribute__((always_inline))

typedef struct {
    const float *query;
    const char *k_cache, *v_cache; /* bytes */
    int64_t num_blocks, stride_block, stride_slot, stride_head;
    const int32_t *block_tables;
    int64_t table_stride;
    const int32_t *seq_lens, *query_start_loc;
    const float *sinks; /* NULL or [num_heads] */
    float *out;
    float *partial; /* split-K: [num_tokens, num_heads, max_splits, dp + 2] */
    int num_heads, num_kv_heads, head_dim, dp, block_size, group, kv_dtype, elem_size;
    int slice_tokens, split_tokens, max_splits;
    int window; /* 0: none */
    float scale;
} Problem;

typedef struct {
    int seq, kv_head, kv_heads, q_begin, q_end, split; /* q_* index the sequence's new tokens;
                                                          kv heads [kv_head, + kv_heads) */
} Item;

typedef struct {
    float *q;     /* [rows, dp], query rows times scale (zero padded to dp) */
    float *acc;   /* [rows, dp] */
    float *m, *l; /* [rows]: running max and sum */
    float *s;     /* [rows, TC]: scores, then probabilities */
    float *kr;    /* [TC, dp]: K rows converted to float32 */
    float *vr;    /* [TC, dp]: V rows converted */
    float *kt;    /* [dp, TC]: K transposed */
} Scratch;

/* exp(x) for x <= 0 (a score minus its row maximum): 2^n * p(r) with r = x - n ln2 in
 * [-ln2/2, ln2/2] and Cephes' degree-6 polynomial (about 1 ulp); vectorizes. */
INLINE float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float y = x * 1.44269504088896341f;
    const float n = (y + 12582912.0f) - 12582912.0f; /* round to nearest, |y| < 2^22 */
    float r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23; /* 2^n as a float's bits */
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return p * two_n;
}

/* IEEE half to float, exact for every input (normals, subnormals, inf, NaN), branch free:
 * move exponent and mantissa into place and rebias by multiplying by 2^112. */
INLINE float f16_to_f32(uint16_t h) {
    const uint32_t em = (uint32_t)(h & 0x7fff) << 13;
    float f;
    memcpy(&f, &em, sizeof f);
    f *= 0x1p112f;
    uint32_t w;
    memcpy(&w, &f, sizeof w);
    if (em >= (0x7c00u << 13)) w |= 0x7f800000u; /* inf or NaN stays inf or NaN */
    w |= (uint32_t)(h & 0x8000) << 16;
    memcpy(&f, &w, sizeof f);
    return f;
}

/* Byte offset in either cache of context token t's row for the kv head at `head_off`
 * (elements), through the sequence's block table. */
INLINE int64_t row_offset(const Problem *p, const int32_t *table, int64_t head_off, int t) {
    return ((int64_t)table[t / p->block_size] * p->stride_block +
            (int64_t)(t % p->block_size) * p->stride_slot + head_off) *
           p->elem_size;
}

/* Prefetch `row_bytes` of the K and V rows from kv head `head_off` on for context tokens
 * [t_begin, t_begin + TC) (cut at c_end) into the L1 (level 1) or the L2 (level 2). */
INLINE void prefetch_rows(const Problem *p, const int32_t *table, int64_t head_off,
                          int row_bytes, int t_begin, int c_end, int level) {
    const int t_end = c_end < t_begin + TC ? c_end : t_begin + TC;
    for (int t = t_begin; t < t_end; ++t) {
        const int64_t off = row_offset(p, table, head_off, t);
        for (int b = 0; b < row_bytes; b += 64) {
            if (level == 1) {
                __builtin_prefetch(p->k_cache + off + b, 0, 3);
                __builtin_prefetch(p->v_cache + off + b, 0, 3);
            } else {
                __builtin_prefetch(p->k_cache + off + b, 0, 2);
                __builtin_prefetch(p->v_cache + off + b, 0, 2);
            }
        }
    }
}

/* The first context position a query at `pos` sees (its window's start, or 0). */
INLINE int visible_from(const Problem *p, int pos) {
    const int lo = p->window > 0 ? pos - p->window + 1 : 0;
    return lo > 0 ? lo : 0;
}

/* The context positions sequence s's new tokens see, [*lo, seq_len), and its splits. */
static int seq_splits(const Problem *p, int s, int *lo) {
    const int seq_len = p->seq_lens[s];
    const int q_len = p->query_start_loc[s + 1] - p->query_start_loc[s];
    *lo = visible_from(p, seq_len - q_len);
    const int span = seq_len - *lo;
    return p->split_tokens > 0 ? (span + p->split_tokens - 1) / p->split_tokens : 1;
}

/* kv heads per item for a slice of `tokens` query tokens: as many as MAX_ROWS rows hold, at
 * least one. An item takes its kv heads one after the other, each over the whole context, so
 * a decode's item reads every head's rows of its sequence, side by side in each slot, on one
 * core: the others come into its L2 along with the first (hardware prefetch). With one kv
 * head per item, two cores took neighbouring heads of one sequence at once, each fetching
 * the other's rows too. 64 sequences x 300 tokens, 30 layers' caches, 2-core Xeon (AMX), 2
 * threads: float32 54.9 -> 48.8 ms, bfloat16 38.5 -> 33.2. */
static int item_heads(const Problem *p, int tokens) {
    const int heads = MAX_ROWS / (tokens * p->group);
    return heads < 1 ? 1 : heads > p->num_kv_heads ? p->num_kv_heads : heads;
}

/* The items of sequence s (q_len new tokens, `splits` context splits), written to `out`
 * unless it is NULL; returns how many. Counting and filling walk the same loops. */
static int64_t seq_items(const Problem *p, int s, int q_len, int splits, Item *out) {
    int64_t count = 0;
    for (int q0 = 0; q0 < q_len; q0 += p->slice_tokens) {
        const int q1 = q0 + p->slice_tokens < q_len ? q0 + p->slice_tokens : q_len;
        const int heads = item_heads(p, q1 - q0);
        for (int h = 0; h < p->num_kv_heads; h += heads)
            for (int k = 0; k < splits; ++k, ++count) {
                const int nh = p->num_kv_heads - h < heads ? p->num_kv_heads - h : heads;
                if (out) out[count] = (Item){s, h, nh, q0, q1, k};
            }
    }
    return count;
}

typedef void (*ItemFn)(const Problem *, const Item *, const Scratch *);

/* The item body, once per instruction-set path (see paged_attention_cpu_body.h). */
#define PA_SUFFIX portable
#define PA_TARGET
#define PA_W 4
#include "paged_attention_cpu_body.h"
#undef PA_W
#undef PA_TARGET
#undef PA_SUFFIX

#if defined(__x86_64__) || defined(__i386__)
#define PA_SUFFIX avx2
#define PA_TARGET __attribute__((target("avx2,fma")))
#define PA_W 8
#include "paged_attention_cpu_body.h"
#undef PA_W
#undef PA_TARGET
#undef PA_SUFFIX

#define PA_SUFFIX avx512
#define PA_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")))
#define PA_W 16
#include "paged_attention_cpu_body.h"
#undef PA_W
#undef PA_TARGET
#undef PA_SUFFIX
#endif

static ItemFn item_fn(int isa) {
#if defined(__x86_64__) || defined(__i386__)
    if (isa == ISA_AVX512) return item_avx512;
    if (isa == ISA_AVX2) return item_avx2;
#endif
    return item_portable;
}

/* Combine the splits of every (token, head): out = sum_k e^(m_k - M) acc_k / sum_k e^(m_k - M) l_k. */
static void combine_splits(const Problem *p, int num_tokens, const int *token_splits,
                           int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t th = 0; th < (int64_t)num_tokens * p->num_heads; ++th) {
        const float *part = p->partial + th * p->max_splits * (p->dp + 2);
        const int splits = token_splits[th / p->num_heads];
        float big = -INFINITY;
        for (int k = 0; k < splits; ++k) {
            const float m = part[k * (p->dp + 2)];
            big = m > big ? m : big;
        }
        float *o = p->out + th * p->head_dim;
        for (int d = 0; d < p->head_dim; ++d) o[d] = 0.0f;
        float sum = 0.0f; /* a sink is in the first split's partial sums (the item body) */
        for (int k = 0; k < splits; ++k) {
            const float *pk = part + k * (p->dp + 2);
            if (pk[0] == -INFINITY) continue; /* a split wholly past this token's position */
            const float wgt = exp_nonpositive(pk[0] - big);
            sum += wgt * pk[1];
            for (int d = 0; d < p->head_dim; ++d) o[d] += wgt * pk[2 + d];
        }
        const float inv = 1.0f / sum;
        for (int d = 0; d < p->head_dim; ++d) o[d] *= inv;
    }
}

int pagecli_paged_attention(int isa, int kv_dtype, const float *query, const void *k_cache,
                            const void *v_cache, int64_t num_blocks, int64_t stride_block,
                            int64_t stride_slot, int64_t stride_head, const int32_t *block_tables,
                            int64_t table_stride, const int32_t *seq_lens,
                            const int32_t *query_start_loc, float *out, int num_seqs,
                            int num_heads, int num_kv_heads, int head_dim, int block_size,
                            float scale, int window, const float *sinks, int split_tokens,
                            int num_threads) {
    Problem p = {0};
    p.query = query;
    p.k_cache = k_cache;
    p.v_cache = v_cache;
    p.num_blocks = num_blocks;
    p.stride_block = stride_block;
    p.stride_slot = stride_slot;
    p.stride_head = stride_head;
    p.block_tables = block_tables;
    p.table_stride = table_stride;
    p.seq_lens = seq_lens;
    p.query_start_loc = query_start_loc;
    p.sinks = sinks;
    p.window = window > 0 ? window : 0;
    p.out = out;
    p.num_heads = num_heads;
    p.num_kv_heads = num_kv_heads;
    p.head_dim = head_dim;
    p.dp = (head_dim + 15) / 16 * 16;
    p.block_size = block_size;
    p.group = num_heads / num_kv_heads;
    p.kv_dtype = kv_dtype;
    p.elem_size = kv_dtype == KV_F32 ? 4 : 2;
    /* a power of two of query tokens per item (16 at most), so rows come in multiples of 8 */
    p.slice_tokens = 16;
    while (p.slice_tokens > 1 && p.slice_tokens * p.group > MAX_ROWS) p.slice_tokens /= 2;
    p.split_tokens = split_tokens;
    p.scale = scale;
    /* scratch rows: a slice's tokens times the group, or an item's several kv heads */
    const int rows = p.slice_tokens * p.group > MAX_ROWS ? p.slice_tokens * p.group : MAX_ROWS;
    const int num_tokens = query_start_loc[num_seqs];

    /* validate the block ids every item will read, and count the items */
    int64_t num_items = 0;
    int max_splits = 1;
    for (int s = 0; s < num_seqs; ++s) {
        const int32_t *table = block_tables + (int64_t)s * table_stride;
        int lo;
        const int splits = seq_splits(&p, s, &lo);
        for (int b = lo / block_size; b < (seq_lens[s] + block_size - 1) / block_size; ++b)
            if (table[b] < 0 || table[b] >= num_blocks) return -1;
        const int q_len = query_start_loc[s + 1] - query_start_loc[s];
        if (splits > max_splits) max_splits = splits;
        num_items += seq_items(&p, s, q_len, splits, NULL);
    }
    p.max_splits = max_splits;
    Item *items = malloc(sizeof(Item) * (size_t)(num_items > 0 ? num_items : 1));
    int *token_splits = NULL;
    if (split_tokens > 0) {
        p.partial = malloc(sizeof(float) * (size_t)num_tokens * (size_t)num_heads *
                           (size_t)max_splits * (size_t)(p.dp + 2));
        token_splits = malloc(sizeof(int) * (size_t)(num_tokens > 0 ? num_tokens : 1));
    }
    if (!items || (split_tokens > 0 && (!p.partial || !token_splits))) {
        free(items);
        free(p.partial);
        free(token_splits);
        return -2;
    }
    int64_t i = 0;
    for (int s = 0; s < num_seqs; ++s) {
        const int q_len = query_start_loc[s + 1] - query_start_loc[s];
        int lo;
        const int splits = seq_splits(&p, s, &lo);
        for (int q = query_start_loc[s]; token_splits && q < query_start_loc[s + 1]; ++q)
            token_splits[q] = splits;
        i += seq_items(&p, s, q_len, splits, items + i);
    }

    const ItemFn fn = item_fn(isa);
    int status = 0;
#pragma omp parallel num_threads(num_threads)
    {
        Scratch w;
        const size_t row_floats = (size_t)rows * (size_t)p.dp;
        float *buf = malloc(sizeof(float) *
                            (2 * row_floats + 2 * (size_t)rows + (size_t)rows * TC +
                             3 * (size_t)TC * (size_t)p.dp));
        if (!buf) {
#pragma omp atomic write
            status = -2;
        } else {
            w.q = buf;
            w.acc = w.q + row_floats;
            w.m = w.acc + row_floats;
            w.l = w.m + rows;
            w.s = w.l + rows;
            w.kr = w.s + (size_t)rows * TC;
            w.vr = w.kr + (size_t)TC * p.dp;
            w.kt = w.vr + (size_t)TC * p.dp;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t k = 0; k < num_items; ++k)
            if (buf) fn(&p, &items[k], &w);
        free(buf);
    }
    if (status == 0 && split_tokens > 0) combine_splits(&p, num_tokens, token_splits, num_threads);
    free(items);
    free(p.partial);
    free(token_splits);
    return status;
}
