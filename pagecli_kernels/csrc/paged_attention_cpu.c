/*
 * Paged decode attention for the CPU, float32: one new query token per sequence attends over
 * the sequence's cached tokens, read in place through its block table.
 *
 * The torch path (pagecli_kernels/cpu.py) first gathers every sequence's K/V into a padded
 * copy and then runs SDPA over it: the cache is read, written and read again. Decode
 * attention is bound by memory traffic, so this kernel brings each cached K and V row in from
 * memory once, straight from its block. Work is split over sequences with OpenMP; within a
 * sequence, the query heads of one kv head (the GQA group) reuse its rows from the cache.
 *
 * Built at run time by pagecli_kernels/native.py (cc -O3 -march=native -fopenmp) and called
 * through ctypes; any failure to build leaves the torch path in charge.
 *
 * Layouts (element strides; the last dimension of the caches is contiguous):
 *   query, out     [num_seqs, num_heads, head_dim], contiguous
 *   k/v cache      [num_blocks, block_size, num_kv_heads, head_dim]
 *   block_tables   [num_seqs, table_stride] int32
 *   seq_lens       [num_seqs] int32, 1 <= seq_lens[i] <= table width * block_size
 * Returns 0, -1 when a block id is outside [0, num_blocks), -2 when out of memory.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* 8 floats; aligned(4) makes loads and stores through it unaligned-safe (GCC and Clang). */
typedef float v8f __attribute__((vector_size(32), aligned(4)));

static inline float hsum8(v8f v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

/* exp(x) for x <= 0 (a score minus its row maximum), vectorizable: 2^n * p(r) with
 * r = x - n ln2 in [-ln2/2, ln2/2] and Cephes' degree-6 polynomial (about 1 ulp). */
static inline float exp_nonpositive(float x) {
    x = fmaxf(x, -87.0f);
    const float n = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
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

#define TOKENS 4 /* cached tokens scored together: independent accumulation chains */

int pagecli_paged_decode_f32(const float *query, const float *k_cache, const float *v_cache,
                             int64_t num_blocks, int64_t block_stride, int64_t slot_stride,
                             int64_t head_stride, const int32_t *block_tables,
                             int64_t table_stride, const int32_t *seq_lens, float *out,
                             int num_seqs, int num_heads, int num_kv_heads, int head_dim,
                             int block_size, float scale, int num_threads) {
    const int group = num_heads / num_kv_heads;
    const int vec = head_dim % 8 == 0; /* 64, 80, 96, 128: whole 8-float chunks */
    int max_len = 0;
    for (int s = 0; s < num_seqs; ++s)
        if (seq_lens[s] > max_len) max_len = seq_lens[s];
    int status = 0;

#pragma omp parallel num_threads(num_threads)
    {
        /* scores[hq * stride + t]: a head's scores, then their exponentials */
        float *scores = malloc(sizeof(float) * (size_t)num_heads * (size_t)(max_len + TOKENS));
        float *acc = malloc(sizeof(float) * (size_t)num_heads * (size_t)head_dim);
        float *inv_sum = malloc(sizeof(float) * (size_t)num_heads);
        const float **rows = malloc(sizeof(float *) * (size_t)(max_len + TOKENS));
        const int ok = scores && acc && inv_sum && rows;
        if (!ok) {
#pragma omp atomic write
            status = -2;
        }
        const int64_t stride = max_len + TOKENS;

#pragma omp for schedule(dynamic, 1)
        for (int64_t s = 0; s < num_seqs; ++s) {
            if (!ok) continue;
            const int len = seq_lens[s];
            const int32_t *table = block_tables + s * table_stride;
            int bad_block = 0;

            /* where each cached token's K row (all kv heads) lives; V is at the same offset */
            for (int t = 0; t < len; ++t) {
                const int32_t block = table[t / block_size];
                if (block < 0 || block >= num_blocks) {
                    bad_block = 1;
                    break;
                }
                rows[t] = k_cache + block * block_stride + (int64_t)(t % block_size) * slot_stride;
            }
            if (bad_block) {
#pragma omp atomic write
                status = -1;
                continue;
            }
            for (int t = len; t < len + TOKENS; ++t) rows[t] = rows[len - 1]; /* tail padding */

            /* pass 1: scaled scores q . k, TOKENS cached tokens at a time, every head */
            for (int t = 0; t < len; t += TOKENS) {
                for (int hq = 0; hq < num_heads; ++hq) {
                    const float *qh = query + (s * num_heads + hq) * head_dim;
                    const int64_t koff = (int64_t)(hq / group) * head_stride;
                    float *sh = scores + hq * stride;
                    if (vec) {
                        v8f a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
                        for (int d = 0; d < head_dim; d += 8) {
                            const v8f qv = *(const v8f *)(qh + d);
                            a0 += qv * *(const v8f *)(rows[t] + koff + d);
                            a1 += qv * *(const v8f *)(rows[t + 1] + koff + d);
                            a2 += qv * *(const v8f *)(rows[t + 2] + koff + d);
                            a3 += qv * *(const v8f *)(rows[t + 3] + koff + d);
                        }
                        sh[t] = hsum8(a0) * scale;
                        sh[t + 1] = hsum8(a1) * scale;
                        sh[t + 2] = hsum8(a2) * scale;
                        sh[t + 3] = hsum8(a3) * scale;
                    } else {
                        for (int j = 0; j < TOKENS; ++j) {
                            float dot = 0.0f;
                            for (int d = 0; d < head_dim; ++d) dot += qh[d] * rows[t + j][koff + d];
                            sh[t + j] = dot * scale;
                        }
                    }
                }
            }
            /* softmax numerators and 1 / their sum, per query head */
            for (int hq = 0; hq < num_heads; ++hq) {
                float *sh = scores + hq * stride;
                float m = -INFINITY;
#pragma omp simd reduction(max : m)
                for (int t = 0; t < len; ++t) m = fmaxf(m, sh[t]);
                float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
                for (int t = 0; t < len; ++t) {
                    sh[t] = exp_nonpositive(sh[t] - m);
                    sum += sh[t];
                }
                inv_sum[hq] = 1.0f / sum;
            }

            /* pass 2: the probability-weighted sum of the value rows */
            memset(acc, 0, sizeof(float) * (size_t)num_heads * (size_t)head_dim);
            const int64_t v_offset = v_cache - k_cache;
            for (int t = 0; t < len; ++t) {
                const float *v_row = rows[t] + v_offset;
                for (int hq = 0; hq < num_heads; ++hq) {
                    const float p = scores[hq * stride + t];
                    const float *v = v_row + (int64_t)(hq / group) * head_stride;
                    float *ah = acc + (int64_t)hq * head_dim;
                    if (vec) {
                        for (int d = 0; d < head_dim; d += 8)
                            *(v8f *)(ah + d) += p * *(const v8f *)(v + d);
                    } else {
                        for (int d = 0; d < head_dim; ++d) ah[d] += p * v[d];
                    }
                }
            }
            for (int hq = 0; hq < num_heads; ++hq) {
                float *o = out + (s * num_heads + hq) * head_dim;
                const float *ah = acc + (int64_t)hq * head_dim;
                for (int d = 0; d < head_dim; ++d) o[d] = ah[d] * inv_sum[hq];
            }
        }
        free(scores);
        free(acc);
        free(inv_sum);
        free((void *)rows);
    }
    return status;
}
