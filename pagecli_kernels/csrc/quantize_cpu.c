/*
 * float32 rows -> Q4_K blocks, for load-time quantization (pagecli/loader/quantize.py).
 *
 * ggml's quantize_row_q4_K_ref: per 256-value super-block, eight 32-value sub-blocks each get
 * a scale and a minimum from make_qkx2_quants (nmax 15, rmin -1, rdelta 0.1, nstep 20,
 * weights av_x + |x|: the weighted least-squares fit over 21 candidate scales), then 6-bit
 * sub-block scales and mins under two f16 super-block scales, then the 4-bit levels.
 *
 * Every float32 operation is the reference's, in its order, with no contraction into FMAs
 * (fp-contract off); the sums over a sub-block's 32 values run in numpy's order (eight
 * running sums, then ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))), so the output is
 * byte for byte that of quantize.py's numpy port, which the tests compare it with (ggml's C
 * sums left to right, so a rare tie may round differently from ggml; the format is the same).
 * Eight running sums also let the compiler vectorize. Rows are shared among OpenMP threads.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_entry_points.h"

#define EXACT __attribute__((optimize("fp-contract=off")))
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define CLONES
#endif
#define INLINE static inline __attribute__((always_inline))

#define QK 256
#define Q4_K_BYTES 144
#define GGML_Q4_K 12

/* numpy's float32 sum of 32 values (pairwise_sum for n <= 128) */
INLINE EXACT float sum32(const float *a) {
    float r[8];
    for (int j = 0; j < 8; ++j) r[j] = a[j];
    for (int i = 8; i < 32; i += 8)
        for (int j = 0; j < 8; ++j) r[j] += a[i + j];
    return ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
}

/* np.rint of a value known to lie in [-2^22, 2^22]: round half to even, as the FPU does */
INLINE EXACT float rint_small(float v) {
    const float magic = 12582912.0f; /* 1.5 * 2^23 */
    return (v + magic) - magic;
}

/* clip(rint(v), 0, nmax), v first clamped into a range where rint_small is exact */
INLINE EXACT float level(float v, float nmax) {
    v = v < -1.0f ? -1.0f : v > nmax + 1.0f ? nmax + 1.0f : v;
    const float l = rint_small(v);
    return l < 0.0f ? 0.0f : l > nmax ? nmax : l;
}

INLINE EXACT uint16_t to_f16(float f) {
    _Float16 h = (_Float16)f; /* round to nearest even, as numpy's astype(float16) */
    uint16_t bits;
    memcpy(&bits, &h, 2);
    return bits;
}

INLINE EXACT float from_f16(uint16_t bits) {
    _Float16 h;
    memcpy(&h, &bits, 2);
    return (float)h;
}

/* Eight float32 lanes (GCC's vector extension: AVX2/AVX-512 registers in the clones, SSE
 * pairs in the default one). A sub-block's 32 values are four of them, so a sum in numpy's
 * order is four vector adds and tree8 of the lanes. */
typedef float v8 __attribute__((vector_size(32)));
typedef int32_t m8 __attribute__((vector_size(32)));

INLINE v8 vsel(m8 mask, v8 a, v8 b) { return (v8)((mask & (m8)a) | (~mask & (m8)b)); }
INLINE v8 splat(float f) { return (v8){f, f, f, f, f, f, f, f}; }

INLINE EXACT float vtree(v8 r) {
    return ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
}

/* clip(rint(v), 0, nmax) per lane, v first clamped to [-1, nmax + 1] (rint exact there) */
INLINE EXACT v8 vlevel(v8 v, float nmax) {
    const v8 lo = splat(-1.0f), hi = splat(nmax + 1.0f), magic = splat(12582912.0f);
    v = vsel(v < lo, lo, v);
    v = vsel(v > hi, hi, v);
    v8 l = (v + magic) - magic;
    l = vsel(l < splat(0.0f), splat(0.0f), l);
    return vsel(l > splat(nmax), splat(nmax), l);
}

/* make_qkx2_quants over one sub-block: its scale and -min (its levels are recomputed from
 * the 6-bit scales afterwards, as the reference does) */
INLINE EXACT void qkx2(const float *xp, const float *wp, float *scale_out, float *min_out) {
    const float nmax = 15.0f;
    v8 x[4], w[4];
    memcpy(x, xp, sizeof x);
    memcpy(w, wp, sizeof w);
    float xmin = xp[0], xmax = xp[0];
    for (int i = 1; i < 32; ++i) {
        xmin = xp[i] < xmin ? xp[i] : xmin;
        xmax = xp[i] > xmax ? xp[i] : xmax;
    }
    xmin = xmin < 0.0f ? xmin : 0.0f;
    const v8 vxmin = splat(xmin);
    const float sum_w = vtree(((w[0] + w[1]) + w[2]) + w[3]);
    const float sum_x = vtree(((w[0] * x[0] + w[1] * x[1]) + w[2] * x[2]) + w[3] * x[3]);
    const int flat = xmax == xmin;
    const float span = flat ? 1.0f : xmax - xmin;
    float iscale = nmax / span;
    float scale = 1.0f / iscale;
    v8 err = splat(0.0f);
    for (int c = 0; c < 4; ++c) {
        const v8 l = vlevel(splat(iscale) * (x[c] - vxmin), nmax);
        const v8 diff = splat(scale) * l + vxmin - x[c];
        const v8 e = w[c] * diff * diff;
        err = c ? err + e : e;
    }
    float best_error = vtree(err);
    float best_min = xmin;
    if (!flat)
        for (int step = 0; step < 21; ++step) {
            iscale = (-1.0f + 0.1f * (float)step + nmax) / span;
            v8 lf[4], rl = splat(0.0f), rl2 = rl, rxl = rl;
            for (int c = 0; c < 4; ++c) {
                lf[c] = vlevel(splat(iscale) * (x[c] - vxmin), nmax);
                const v8 wl = w[c] * lf[c];
                const v8 wl2 = wl * lf[c], wxl = wl * x[c];
                rl = c ? rl + wl : wl;
                rl2 = c ? rl2 + wl2 : wl2;
                rxl = c ? rxl + wxl : wxl;
            }
            const float sum_l = vtree(rl), sum_l2 = vtree(rl2), sum_xl = vtree(rxl);
            const float det = sum_w * sum_l2 - sum_l * sum_l;
            if (!(det > 0.0f)) continue;
            float this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
            float this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
            if (this_min > 0.0f) {
                this_scale = sum_xl / (sum_l2 > 0.0f ? sum_l2 : 1.0f);
                this_min = 0.0f;
            }
            v8 cur = splat(0.0f);
            for (int c = 0; c < 4; ++c) {
                const v8 diff = splat(this_scale) * lf[c] + splat(this_min) - x[c];
                const v8 e = w[c] * diff * diff;
                cur = c ? cur + e : e;
            }
            const float cur_error = vtree(cur);
            if (cur_error < best_error) {
                best_error = cur_error;
                scale = this_scale;
                best_min = this_min;
            }
        }
    if (flat) scale = 0.0f;
    *scale_out = scale;
    *min_out = -best_min;
}

INLINE EXACT uint8_t six_bits(float inv, float v) {
    /* min(nearest_int(inv * v), 63) as uint8 (numpy's astype wraps a negative, as C's cast) */
    const float r = rintf(inv * v);
    const int32_t i = (int32_t)r;
    return (uint8_t)(i < 63 ? i : 63);
}

CLONES EXACT static void q4_k_block(const float *x, uint8_t *out) {
    float w[32], scales[8], mins[8];
    for (int j = 0; j < 8; ++j) {
        const float *xs = x + 32 * j;
        float sq[32];
        for (int i = 0; i < 32; ++i) sq[i] = xs[i] * xs[i];
        const float av_x = sqrtf(sum32(sq) / 32.0f);
        for (int i = 0; i < 32; ++i) w[i] = av_x + fabsf(xs[i]);
        qkx2(xs, w, &scales[j], &mins[j]);
    }
    float max_scale = scales[0], max_min = mins[0];
    for (int j = 1; j < 8; ++j) {
        max_scale = scales[j] > max_scale ? scales[j] : max_scale;
        max_min = mins[j] > max_min ? mins[j] : max_min;
    }
    max_scale = max_scale > 0.0f ? max_scale : 0.0f;
    max_min = max_min > 0.0f ? max_min : 0.0f;
    const float inv_scale = max_scale > 0.0f ? 63.0f / max_scale : 0.0f;
    const float inv_min = max_min > 0.0f ? 63.0f / max_min : 0.0f;
    uint8_t ls[8], lm[8];
    for (int j = 0; j < 8; ++j) {
        ls[j] = six_bits(inv_scale, scales[j]);
        lm[j] = six_bits(inv_min, mins[j]);
    }
    const uint16_t d16 = to_f16(max_scale / 63.0f), dmin16 = to_f16(max_min / 63.0f);
    memcpy(out, &d16, 2);
    memcpy(out + 2, &dmin16, 2);
    uint8_t *packed = out + 4, *qs = out + 16;
    for (int j = 0; j < 4; ++j) {
        packed[j] = (uint8_t)(ls[j] | ((ls[j + 4] >> 4) << 6));
        packed[j + 4] = (uint8_t)(lm[j] | ((lm[j + 4] >> 4) << 6));
        packed[j + 8] = (uint8_t)((ls[j + 4] & 0xF) | ((lm[j + 4] & 0xF) << 4));
    }
    const float d_super = from_f16(d16), dmin_super = from_f16(dmin16);
    uint8_t levels[256];
    for (int j = 0; j < 8; ++j) {
        const float d = d_super * (float)ls[j];
        const float dm = dmin_super * (float)lm[j];
        for (int i = 0; i < 32; ++i)
            levels[32 * j + i] = d != 0.0f ? (uint8_t)level((x[32 * j + i] + dm) / d, 15.0f) : 0;
    }
    for (int j = 0; j < 4; ++j)
        for (int i = 0; i < 32; ++i)
            qs[32 * j + i] = (uint8_t)(levels[64 * j + i] | (levels[64 * j + 32 + i] << 4));
}

int pagecli_quantize_rows(int ggml_type, const float *x, int64_t rows, int64_t cols,
                          uint8_t *out, int num_threads) {
    if (ggml_type != GGML_Q4_K) return -1;
    if (rows < 0 || cols <= 0 || cols % QK) return -2;
    const int64_t blocks = cols / QK;
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 4)
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t b = 0; b < blocks; ++b)
            q4_k_block(x + r * cols + b * QK, out + (r * blocks + b) * Q4_K_BYTES);
    return 0;
}
