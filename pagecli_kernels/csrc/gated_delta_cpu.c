/*
 * A Gated DeltaNet layer's step on the CPU (pagecli/layers/gated_delta.py has the math and
 * the torch version): from the input projection's rows to the gated norm's, one call, run
 * the same by the Python loop (fused_cpu.gated_delta) and by the layer program (OP_DELTANET).
 *
 * mixed [T, ld_mixed] float32: each token's projection, [q (Hk dk) | k (Hk dk) | v (Hv dv) |
 * z (Hv dv) | b (Hv) | a (Hv)]; the step's tokens are num_seqs sequences, sequence s the
 * tokens [starts[s], starts[s + 1]) with its state in slot slots[s] of conv_states [slots,
 * C, K - 1] (the last K - 1 inputs of the C = 2 Hk dk + Hv dv conv channels) and ssm_states
 * [slots, Hv, dk, dv]. Per sequence, in token order:
 *
 *   x     = silu(causal depthwise conv of the conv channels over the kept inputs, then the
 *           sequence's), the conv window kept for the next step
 *   q, k  = l2-normalized per key head (q times dk^-1/2); value head h reads key head
 *           h // (Hv / Hk), or h mod Hk when `tiled` (llama.cpp's GGUF order)
 *   beta  = sigmoid(b), decay = exp(A * softplus(a + dt_bias)), A = -exp(A_log) < 0
 *   S     = decay S + k delta^T,  delta = beta (v - decay S^T k)        S: [dk, dv]
 *   o     = S^T q = decay (S_old^T q) + delta (k . q)
 *   out   = rms_norm(o) * norm_w * silu(z)   per value head, into out [T, ld_out]
 *
 * One token's update reads S once for S^T k and S^T q together, then rewrites it, a block of
 * columns at a time (the rewrite finds the block in L1): one read and one write of a head's
 * dk x dv floats from memory per token. Decodes and prefill chunks take
 * the same token-by-token recurrence (a prefill's states stay in cache between its tokens);
 * the work is spread over (sequence, value head) pairs. Returns 0, or -1 (a slot outside
 * [0, num_slots)), -2 (no memory for the scratch rows).
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_entry_points.h"

#define CLONES __attribute__((target_clones("avx512f", "avx2", "default")))

static inline float silu(float x) { return x / (1.0f + expf(-x)); }

/* torch's softplus (beta 1, threshold 20) */
static inline float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

typedef float v8f __attribute__((vector_size(32), aligned(4))); /* 8 floats, any alignment */
#define BLOCK 32 /* state columns a block keeps in registers: 4 vectors per sum */

static inline v8f load8(const float *p) { return *(const v8f *)p; }
static inline void store8(float *p, v8f x) { *(v8f *)p = x; }

/* One value head's state through one token (the module comment); o [dv], scratch [2 dv].
 * BLOCK columns of S at a time: S^T k and S^T q of the block summed in registers over the
 * dk rows, then the block's delta and o, then the block's rows rewritten while still in L1:
 * S is read from memory once and written once per token. */
CLONES static void delta_token(float *restrict S, const float *restrict q,
                               const float *restrict k, const float *restrict v, float decay,
                               float beta, int dk, int dv, float *restrict o,
                               float *restrict scratch) {
    float kq = 0.0f;
    for (int i = 0; i < dk; ++i) kq += k[i] * q[i];
    int j0 = 0;
    for (; j0 + BLOCK <= dv; j0 += BLOCK) {
        v8f sk[4] = {0}, sq[4] = {0};
        for (int i = 0; i < dk; ++i) {
            const float *row = S + (int64_t)i * dv + j0;
            const float ki = k[i], qi = q[i];
            for (int u = 0; u < 4; ++u) {
                const v8f r = load8(row + 8 * u);
                sk[u] += ki * r;
                sq[u] += qi * r;
            }
        }
        v8f delta[4];
        for (int u = 0; u < 4; ++u) {
            delta[u] = (load8(v + j0 + 8 * u) - decay * sk[u]) * beta;
            store8(o + j0 + 8 * u, decay * sq[u] + delta[u] * kq);
        }
        for (int i = 0; i < dk; ++i) {
            float *row = S + (int64_t)i * dv + j0;
            const float ki = k[i];
            for (int u = 0; u < 4; ++u)
                store8(row + 8 * u, decay * load8(row + 8 * u) + ki * delta[u]);
        }
    }
    if (j0 == dv) return;
    /* the columns past the last whole block (dv not a multiple of BLOCK) */
    const int rest = dv - j0;
    float *restrict sk = scratch, *restrict sq = scratch + rest;
    for (int j = 0; j < rest; ++j) sk[j] = sq[j] = 0.0f;
    for (int i = 0; i < dk; ++i) {
        const float ki = k[i], qi = q[i];
        const float *restrict row = S + (int64_t)i * dv + j0;
        for (int j = 0; j < rest; ++j) {
            sk[j] += ki * row[j];
            sq[j] += qi * row[j];
        }
    }
    for (int j = 0; j < rest; ++j) {
        const float delta = (v[j0 + j] - decay * sk[j]) * beta;
        o[j0 + j] = decay * sq[j] + delta * kq;
        sk[j] = delta;
    }
    for (int i = 0; i < dk; ++i) {
        const float ki = k[i];
        float *restrict row = S + (int64_t)i * dv + j0;
        for (int j = 0; j < rest; ++j) row[j] = decay * row[j] + ki * sk[j];
    }
}

/* The conv of channels [c0, c1) of one sequence's n tokens (rows of x, ld apart) after the
 * K - 1 inputs its state keeps; outputs (silu) into y [n, C]; the state keeps the new last
 * K - 1 inputs. Tokens past the first K - 1 read only the sequence's rows: those go row by
 * row over the channels (unit stride, vectorized), with the kernel taps wt [K, C]. */
CLONES static void conv_channels(const float *x, int64_t ld, int64_t n, const float *w,
                                 const float *wt, int K, float *state, int64_t C, int64_t c0,
                                 int64_t c1, float *y) {
    const int keep = K - 1;
    const int64_t head = n < keep ? n : keep; /* tokens whose window reaches into the state */
    for (int64_t c = c0; c < c1; ++c) {
        const float *kept = state + c * keep, *wc = w + c * K;
        for (int64_t t = 0; t < head; ++t) {
            float acc = 0.0f;
            for (int j = 0; j < K; ++j) {
                const int64_t p = t - keep + j; /* < 0: a kept input */
                acc += wc[j] * (p < 0 ? kept[keep + p] : x[p * ld + c]);
            }
            y[t * C + c] = silu(acc);
        }
    }
    for (int64_t t = head; t < n; ++t) {
        float *out = y + t * C;
        for (int64_t c = c0; c < c1; ++c) out[c] = 0.0f;
        for (int j = 0; j < K; ++j) {
            const float *in = x + (t - keep + j) * ld, *tap = wt + (int64_t)j * C;
            for (int64_t c = c0; c < c1; ++c) out[c] += tap[c] * in[c];
        }
        for (int64_t c = c0; c < c1; ++c) out[c] = silu(out[c]);
    }
    for (int64_t c = c0; c < c1; ++c) { /* the new window: the last `keep` of [kept, inputs] */
        float *kept = state + c * keep, window[16];
        for (int j = 0; j < keep; ++j) {
            const int64_t p = n - keep + j;
            window[j] = p < 0 ? kept[keep + p] : x[p * ld + c];
        }
        memcpy(kept, window, sizeof(float) * (size_t)keep);
    }
}

int pagecli_gated_delta(const float *mixed, int64_t ld_mixed, int64_t T, const float *conv_w,
                        int K, const float *A, const float *dt_bias, const float *norm_w,
                        float eps, float *conv_states, float *ssm_states, int64_t num_slots,
                        const int64_t *slots, const int32_t *starts, int num_seqs, int nk,
                        int nv, int dk, int dv, int tiled, float *out, int64_t ld_out,
                        int num_threads) {
    if (K < 2 || K > 17) return -1;
    for (int s = 0; s < num_seqs; ++s)
        if (slots[s] < 0 || slots[s] >= num_slots) return -1;
    const int64_t key_dim = (int64_t)nk * dk, value_dim = (int64_t)nv * dv;
    const int64_t C = 2 * key_dim + value_dim;
    const int64_t z_col = C, b_col = C + value_dim, a_col = b_col + nv;
    float *x = malloc(sizeof(float) * (size_t)(T * C + 2 * T * nv + 1));
    float *scratch = malloc(sizeof(float) * (size_t)(2 * dv) * (size_t)num_threads);
    if (!x || !scratch) {
        free(x);
        free(scratch);
        return -2;
    }
    float *decay = x + T * C, *beta = decay + T * nv;
    float *wt = malloc(sizeof(float) * (size_t)(K * C)); /* the taps, [K, C] */
    if (!wt) {
        free(x);
        free(scratch);
        return -2;
    }
    for (int64_t c = 0; c < C; ++c)
        for (int j = 0; j < K; ++j) wt[(int64_t)j * C + c] = conv_w[c * K + j];
    /* the conv, a sequence at a time, its channels over the threads */
    for (int s = 0; s < num_seqs; ++s) {
        const int64_t t0 = starts[s], n = starts[s + 1] - t0;
        float *state = conv_states + slots[s] * C * (K - 1);
        const int64_t per = (C + num_threads - 1) / num_threads;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (n * C >= 16384)
        for (int part = 0; part < num_threads; ++part) {
            const int64_t c0 = part * per, c1 = c0 + per < C ? c0 + per : C;
            if (c0 < c1)
                conv_channels(mixed + t0 * ld_mixed, ld_mixed, n, conv_w, wt, K, state, C, c0,
                              c1, x + t0 * C);
        }
    }
    /* q and k normalized per key head; beta and the decay per value head */
    const float q_scale = 1.0f / sqrtf((float)dk);
#pragma omp parallel for num_threads(num_threads) schedule(static) if (T >= 4)
    for (int64_t t = 0; t < T; ++t) {
        float *row = x + t * C;
        for (int h = 0; h < 2 * nk; ++h) {
            float *head = row + (int64_t)h * dk, sum = 0.0f;
            for (int i = 0; i < dk; ++i) sum += head[i] * head[i];
            const float r = 1.0f / sqrtf(sum + 1e-6f), scale = h < nk ? r * q_scale : r;
            for (int i = 0; i < dk; ++i) head[i] *= scale;
        }
        const float *proj = mixed + t * ld_mixed;
        for (int h = 0; h < nv; ++h) {
            beta[t * nv + h] = 1.0f / (1.0f + expf(-proj[b_col + h]));
            decay[t * nv + h] = expf(A[h] * softplus(proj[a_col + h] + dt_bias[h]));
        }
    }
    /* the recurrence, each (sequence, value head) on its own */
    const int per_k = nv / nk;
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1)
    for (int64_t item = 0; item < (int64_t)num_seqs * nv; ++item) {
        const int s = (int)(item / nv), h = (int)(item % nv);
        const int kh = tiled ? h % nk : h / per_k;
        float *S = ssm_states + (slots[s] * nv + h) * (int64_t)dk * dv;
        float *work = scratch + (int64_t)omp_get_thread_num() * 2 * dv;
        for (int64_t t = starts[s]; t < starts[s + 1]; ++t) {
            const float *row = x + t * C;
            delta_token(S, row + (int64_t)kh * dk, row + key_dim + (int64_t)kh * dk,
                        row + 2 * key_dim + (int64_t)h * dv, decay[t * nv + h],
                        beta[t * nv + h], dk, dv, out + t * ld_out + (int64_t)h * dv, work);
        }
    }
    /* the gated norm per value head */
#pragma omp parallel for num_threads(num_threads) schedule(static) if (T >= 4)
    for (int64_t t = 0; t < T; ++t) {
        const float *z = mixed + t * ld_mixed + z_col;
        for (int h = 0; h < nv; ++h) {
            float *o = out + t * ld_out + (int64_t)h * dv, sum = 0.0f;
            for (int j = 0; j < dv; ++j) sum += o[j] * o[j];
            const float r = 1.0f / sqrtf(sum / (float)dv + eps);
            for (int j = 0; j < dv; ++j) o[j] = norm_w[j] * (o[j] * r) * silu(z[h * dv + j]);
        }
    }
    free(x);
    free(scratch);
    free(wt);
    return 0;
}

/* x[t, :width] *= sigmoid(gate[t, :width]) (gated attention's output), float32 rows. */
CLONES void pagecli_gate_mul(float *x, const float *gate, int64_t num_rows, int64_t width,
                             int64_t stride_x, int64_t stride_gate, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_rows * width >= 16384)
    for (int64_t t = 0; t < num_rows; ++t)
        for (int64_t j = 0; j < width; ++j)
            x[t * stride_x + j] *= 1.0f / (1.0f + expf(-gate[t * stride_gate + j]));
}
