/*
 * The small per-layer ops of a CPU step as single calls: each replaces several torch ops
 * whose dispatch cost, at decode sizes, exceeds their arithmetic (see benchmarks/step_floor.py).
 *
 *   pagecli_store_kv      write each token's K/V row into its cache slot (skips slot < 0)
 *   pagecli_argmax_f32    greedy sampling: the first index of each row's maximum (a NaN wins,
 *                         as in torch.argmax)
 *   pagecli_rms_norm      y = w * (x * rsqrt(mean(x^2) + eps)), optionally after x += delta;
 *                         over whole rows or each head of a row (q/k norms), the weight
 *                         applied to the rounded (Llama) or the float32 (Gemma, OLMo) product
 *   pagecli_rotary        q, k rotated in place (transformers' rotate_half convention), all of
 *                         each head or its first rotary_dim values (partial rotary)
 *   pagecli_act_mul       y = act(gate) * up over a [T, 2 * I] gate/up row, act silu or
 *                         gelu with the tanh approximation
 *   pagecli_swiglu_oai    gpt-oss's clamped SwiGLU over a [T, 2 * I] gate/up row:
 *                         (clamp(up) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)
 *   pagecli_add_scaled    x += y, or x += y * scale (Granite's residual multiplier)
 *   pagecli_apply_token_bitmask_f32
 *                         structured outputs: -inf, in place, for every token a grammar's
 *                         bitmask (llguidance's layout) forbids
 *
 * float32 and bfloat16 tensors. The elementwise steps round as torch's separate ops do
 * (fp-contract off, bfloat16 rounded after every op torch rounds after), so results equal the
 * torch path's except for the order of the RMSNorm sum and the exp inside silu.
 * Rows are shared among OpenMP threads when there are enough of them.
 * Layouts: every row's last dimension is contiguous; row strides are in elements.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "cpu_entry_points.h"

/* fp-contract off: each op rounds as torch's does. no-trapping-math changes no result (it only
 * lets GCC assume that no floating-point exception traps), and without it GCC 12 vectorizes
 * none of the activation loops (a comparison before the conversions reads to it as control
 * flow: SiLU ran at 0.16 Gvalues/s on 2 Zen 3 cores, torch at 0.8). */
#define EXACT __attribute__((optimize("fp-contract=off", "no-trapping-math")))
/* the helpers below take the options of the functions they go into (GCC inlines a function
 * with other optimize options only when told to) */
#define INLINE EXACT __attribute__((always_inline))

INLINE static inline float bf16_rounded(float f) { return bf16_to_f32(f32_to_bf16(f)); }

/* dtype: 0 float32, 1 bfloat16 */
INLINE static inline float load(const void *p, int64_t i, int dtype) {
    return dtype ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

INLINE static inline void store(void *p, int64_t i, float v, int dtype) {
    if (dtype)
        ((uint16_t *)p)[i] = f32_to_bf16(v);
    else
        ((float *)p)[i] = v;
}

/* what torch's op in this dtype returns: bfloat16 results are rounded */
INLINE static inline float as_dtype(float v, int dtype) { return dtype ? bf16_rounded(v) : v; }

int pagecli_store_kv(const void *key, const void *value, int64_t stride_key, int64_t stride_value,
                     void *k_cache, void *v_cache, int64_t stride_block, int64_t stride_slot,
                     const int64_t *slot_mapping, int64_t num_tokens, int64_t row_elems,
                     int64_t elem_size, int64_t block_size, int64_t num_slots) {
    for (int64_t t = 0; t < num_tokens; ++t)
        if (slot_mapping[t] >= num_slots) return -1;
    for (int64_t t = 0; t < num_tokens; ++t) {
        const int64_t slot = slot_mapping[t];
        if (slot < 0) continue;
        const int64_t at = (slot / block_size) * stride_block + (slot % block_size) * stride_slot;
        memcpy((char *)k_cache + at * elem_size, (const char *)key + t * stride_key * elem_size,
               (size_t)(row_elems * elem_size));
        memcpy((char *)v_cache + at * elem_size,
               (const char *)value + t * stride_value * elem_size,
               (size_t)(row_elems * elem_size));
    }
    return 0;
}

/* one pass in chunks of 64: a chunk's maximum (vectorized) is only searched for its index when
 * it beats the best so far */
__attribute__((target_clones("avx512f", "avx2", "default"))) void pagecli_argmax_f32(
    const float *logits, int64_t num_rows, int64_t num_cols, int64_t stride, int64_t *out,
    int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_rows > 1)
    for (int64_t r = 0; r < num_rows; ++r) {
        const float *x = logits + r * stride;
        float best = -INFINITY;
        int64_t index = 0;
        for (int64_t c0 = 0; c0 < num_cols; c0 += 64) {
            const int64_t n = num_cols - c0 < 64 ? num_cols - c0 : 64;
            const float *xc = x + c0;
            float chunk = -INFINITY;
            int nan = 0;
#pragma omp simd reduction(max : chunk) reduction(| : nan)
            for (int64_t c = 0; c < n; ++c) {
                chunk = xc[c] > chunk ? xc[c] : chunk;
                nan |= xc[c] != xc[c];
            }
            if (nan) { /* the first NaN wins, as in torch.argmax */
                int64_t c = 0;
                while (xc[c] == xc[c]) ++c;
                index = c0 + c;
                break;
            }
            if (chunk > best) {
                int64_t c = 0;
                while (xc[c] != chunk) ++c;
                best = chunk;
                index = c0 + c;
            }
        }
        out[r] = index;
    }
}

/* logits [S, stride] float32, rows [R] (distinct, each in [0, S), checked by the caller), mask
 * [R, mask_words] contiguous: token t of rows[r] is allowed iff bit t % 32 of mask[r][t / 32] is
 * set; tokens past 32 * mask_words are forbidden. Most words of a grammar's mask are all ones
 * (free text) or all zeros (a few allowed tokens), so those skip the per-bit select. One thread:
 * 64 rows of 49,152 take about 0.2 ms, less than an OpenMP fork and join costs on a busy CPU. */
__attribute__((target_clones("avx512f", "avx2", "default"))) void
pagecli_apply_token_bitmask_f32(float *logits, int64_t logits_stride, int64_t vocab,
                                const int32_t *mask, int64_t mask_words, const int64_t *rows,
                                int64_t num_rows) {
    const int64_t covered = vocab < 32 * mask_words ? vocab : 32 * mask_words;
    const int64_t full_words = covered / 32;
    for (int64_t r = 0; r < num_rows; ++r) {
        float *x = logits + rows[r] * logits_stride;
        const uint32_t *m = (const uint32_t *)(mask + r * mask_words);
        for (int64_t w = 0; w < full_words; ++w) {
            const uint32_t bits = m[w];
            float *xw = x + 32 * w;
            if (bits == UINT32_MAX) continue;
            if (bits == 0) {
                for (int b = 0; b < 32; ++b) xw[b] = -INFINITY;
                continue;
            }
            for (int b = 0; b < 32; ++b) xw[b] = (bits >> b) & 1u ? xw[b] : -INFINITY;
        }
        for (int64_t t = 32 * full_words; t < covered; ++t) /* the last, partial word */
            if (!((m[full_words] >> (t % 32)) & 1u)) x[t] = -INFINITY;
        for (int64_t t = covered; t < vocab; ++t) x[t] = -INFINITY;
    }
}

/* exp(x) for x <= 0, vectorizable (the same polynomial as paged_attention_cpu.c) */
INLINE static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float y = x * 1.44269504088896341f;
    const float shifted = y + 12582912.0f; /* 1.5 * 2^23: n in the low bits of the significand */
    const float n = shifted - 12582912.0f; /* round to nearest, |y| < 2^22 */
    float r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    /* 2^n from shifted's bits, 0x4B400000 + n, whose high bits the shift drops: no float to
     * int conversion (n + 127 >= 1, as x >= -87) */
    uint32_t bits;
    memcpy(&bits, &shifted, sizeof bits);
    bits = (bits + 127u) << 23;
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return p * two_n;
}

#define ROW INLINE static inline
/* x86-64-v4 (AVX-512 F, BW, DQ, VL), not plain avx512f: without BW and VL, GCC 12 left the
 * bfloat16 rows of SiLU x up scalar, 12x slower than with them (Zen 4, 64 rows) */
#define CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))

/* weight_mode 0: out = w * round(x * inv) with w of dtype (transformers' Llama RMSNorm);
 * 1: out = round(w * x * inv) with w float32 (Gemma's 1 + w, kept as float32, and OLMo 2) */
ROW void rms_row(void *x, const void *delta, const void *weight, void *out, int64_t hidden,
                 float eps, const int dtype, const int weight_mode) {
    float sum = 0.0f;
    for (int64_t i = 0; i < hidden; ++i) {
        float v = load(x, i, dtype);
        if (delta) { /* the residual add, written back: torch's `hidden + delta` */
            v = as_dtype(v + load(delta, i, dtype), dtype);
            store(x, i, v, dtype);
        }
        sum += v * v;
    }
    const float inv = 1.0f / sqrtf(sum / (float)hidden + eps);
    if (weight_mode) {
        for (int64_t i = 0; i < hidden; ++i)
            store(out, i, ((const float *)weight)[i] * (load(x, i, dtype) * inv), dtype);
        return;
    }
    for (int64_t i = 0; i < hidden; ++i) {
        const float h = as_dtype(load(x, i, dtype) * inv, dtype);
        store(out, i, load(weight, i, dtype) * h, dtype);
    }
}

/* Rows of num_heads heads of `width` values each (heads back to back within a row; 1 head:
 * the whole row); x may be out (in place). */
CLONES EXACT void pagecli_rms_norm(void *x, const void *delta, const void *weight, void *out,
                                   int64_t num_rows, int64_t num_heads, int64_t width,
                                   int64_t stride_x, int64_t stride_delta, int64_t stride_out,
                                   float eps, int dtype, int weight_mode, int num_threads) {
    const int64_t es = dtype ? 2 : 4;
    const int64_t count = num_rows * num_heads;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (count >= 16)
    for (int64_t i = 0; i < count; ++i) {
        const int64_t r = i / num_heads, at = (i % num_heads) * width;
        char *xr = (char *)x + (r * stride_x + at) * es;
        char *outr = (char *)out + (r * stride_out + at) * es;
        const char *dr = delta ? (const char *)delta + (r * stride_delta + at) * es : NULL;
        if (dtype && weight_mode)
            rms_row(xr, dr, weight, outr, width, eps, 1, 1);
        else if (dtype)
            rms_row(xr, dr, weight, outr, width, eps, 1, 0);
        else
            rms_row(xr, dr, weight, outr, width, eps, 0, 0); /* float32: the modes agree */
    }
}

/* the head's first rotary_dim values rotated (all of them but for partial rotary) */
ROW void rotary_head(void *base, const void *cos, const void *sin, int64_t rotary_dim,
                     const int dtype, const int pairs) {
    const int64_t half = rotary_dim / 2;
    float buf[512];
    if (pairs) /* llama.cpp's order [x0, x_half, x1, x_half+1, ...] read into halves */
        for (int64_t i = 0; i < half; ++i) {
            buf[i] = load(base, 2 * i, dtype);
            buf[half + i] = load(base, 2 * i + 1, dtype);
        }
    else
        for (int64_t d = 0; d < rotary_dim; ++d) buf[d] = load(base, d, dtype);
    for (int64_t d = 0; d < rotary_dim; ++d) {
        /* q * cos + rotate_half(q) * sin, rotate_half(q) = cat(-q2, q1) */
        const float rot = d < half ? -buf[d + half] : buf[d - half];
        const float a = as_dtype(buf[d] * load(cos, d, dtype), dtype);
        const float b = as_dtype(rot * load(sin, d, dtype), dtype);
        store(base, d, a + b, dtype);
    }
}

/* rotary_dim <= head_dim, rotary_dim <= 512 and even (checked by the caller); cos/sin are
 * [num_tokens, rotary_dim]; pairs (with rotary_dim == head_dim): each head arrives in
 * llama.cpp's order (its rotary halves interleaved, as a GGUF's Q/K rows read in place give
 * it) and leaves in transformers' order, rotated */
CLONES EXACT void pagecli_rotary(void *q, void *k, const void *cos, const void *sin,
                                 int64_t num_tokens, int64_t num_q_heads, int64_t num_k_heads,
                                 int64_t head_dim, int64_t rotary_dim, int64_t stride_q,
                                 int64_t stride_k, int dtype, int pairs) {
    const int64_t es = dtype ? 2 : 4;
    for (int64_t t = 0; t < num_tokens; ++t) {
        const char *c = (const char *)cos + t * rotary_dim * es;
        const char *s = (const char *)sin + t * rotary_dim * es;
        for (int64_t h = 0; h < num_q_heads + num_k_heads; ++h) {
            char *base = h < num_q_heads
                             ? (char *)q + (t * stride_q + h * head_dim) * es
                             : (char *)k + (t * stride_k + (h - num_q_heads) * head_dim) * es;
            if (dtype)
                rotary_head(base, c, s, rotary_dim, 1, pairs);
            else
                rotary_head(base, c, s, rotary_dim, 0, pairs);
        }
    }
}

ROW void silu_row(const void *gate_up, void *out, int64_t inter, const int dtype) {
    for (int64_t i = 0; i < inter; ++i) {
        const float g = load(gate_up, i, dtype);
        /* silu(g) = g * sigmoid(g), sigmoid from e = exp(-|g|) so that nothing overflows;
         * one division of a chosen numerator, without branches, so that the loop vectorizes */
        const float e = exp_nonpositive(g < 0.0f ? g : -g);
        const float sig = (g < 0.0f ? e : 1.0f) / (1.0f + e);
        const float s = as_dtype(g * sig, dtype);
        store(out, i, s * load(gate_up, inter + i, dtype), dtype);
    }
}

/* gelu(g) with the tanh approximation, as torch writes it: 0.5 g (1 + tanh(b (g + k g^3)));
 * tanh(a) = sign(a) (1 - e) / (1 + e) with e = exp(-2 |a|), which never overflows */
ROW void gelu_tanh_row(const void *gate_up, void *out, int64_t inter, const int dtype) {
    const float beta = 0.7978845608028654f, kappa = 0.044715f; /* sqrt(2 / pi) */
    for (int64_t i = 0; i < inter; ++i) {
        const float g = load(gate_up, i, dtype);
        const float inner = beta * (g + kappa * (g * g * g));
        const float e = exp_nonpositive(-2.0f * (inner < 0.0f ? -inner : inner));
        const float th = (1.0f - e) / (1.0f + e);
        const float s = as_dtype(0.5f * g * (1.0f + (inner < 0.0f ? -th : th)), dtype);
        store(out, i, s * load(gate_up, inter + i, dtype), dtype);
    }
}

/* act: 0 silu, 1 gelu (tanh approximation) */
CLONES EXACT void pagecli_act_mul(const void *gate_up, void *out, int64_t num_rows,
                                  int64_t inter, int64_t stride_in, int64_t stride_out,
                                  int dtype, int act, int num_threads) {
    const int64_t es = dtype ? 2 : 4;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_rows >= 16)
    for (int64_t r = 0; r < num_rows; ++r) {
        const char *in = (const char *)gate_up + r * stride_in * es;
        char *o = (char *)out + r * stride_out * es;
        if (act == 1 && dtype)
            gelu_tanh_row(in, o, inter, 1);
        else if (act == 1)
            gelu_tanh_row(in, o, inter, 0);
        else if (dtype)
            silu_row(in, o, inter, 1);
        else
            silu_row(in, o, inter, 0);
    }
}

/* gpt-oss's clamped SwiGLU as transformers writes it: gate clamped above at `limit`, up to
 * [-limit, limit], then (up + 1) * (gate * sigmoid(gate * alpha)), each op rounded to dtype */
ROW void swiglu_oai_row(const void *gate_up, void *out, int64_t inter, float alpha, float limit,
                        const int dtype) {
    for (int64_t i = 0; i < inter; ++i) {
        float g = load(gate_up, i, dtype), u = load(gate_up, inter + i, dtype);
        g = g > limit ? limit : g;
        u = u > limit ? limit : u < -limit ? -limit : u;
        const float a = as_dtype(g * alpha, dtype);
        const float e = exp_nonpositive(a < 0.0f ? a : -a);
        const float sig = as_dtype((a < 0.0f ? e : 1.0f) / (1.0f + e), dtype);
        const float glu = as_dtype(g * sig, dtype);
        store(out, i, as_dtype(u + 1.0f, dtype) * glu, dtype);
    }
}

CLONES EXACT void pagecli_swiglu_oai(const void *gate_up, void *out, int64_t num_rows,
                                     int64_t inter, int64_t stride_in, int64_t stride_out,
                                     int dtype, float alpha, float limit, int num_threads) {
    const int64_t es = dtype ? 2 : 4;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_rows >= 16)
    for (int64_t r = 0; r < num_rows; ++r) {
        const char *in = (const char *)gate_up + r * stride_in * es;
        char *o = (char *)out + r * stride_out * es;
        if (dtype)
            swiglu_oai_row(in, o, inter, alpha, limit, 1);
        else
            swiglu_oai_row(in, o, inter, alpha, limit, 0);
    }
}

/* x += y (has_scale 0) or x += round(y * scale), each sum rounded to dtype: torch's
 * `x + y * scale`; rows of `width` values */
CLONES EXACT void pagecli_add_scaled(void *x, const void *y, int64_t num_rows, int64_t width,
                                     int64_t stride_x, int64_t stride_y, float scale,
                                     int has_scale, int dtype, int num_threads) {
    const int64_t es = dtype ? 2 : 4;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_rows * width >= 16384)
    for (int64_t r = 0; r < num_rows; ++r) {
        char *xr = (char *)x + r * stride_x * es;
        const char *yr = (const char *)y + r * stride_y * es;
        for (int64_t i = 0; i < width; ++i) {
            const float v = has_scale ? as_dtype(load(yr, i, dtype) * scale, dtype)
                                      : load(yr, i, dtype);
            store(xr, i, load(xr, i, dtype) + v, dtype);
        }
    }
}
