/*
 * The body of one work item of paged_attention_cpu.c, written once and included once per
 * instruction-set path with:
 *   PA_SUFFIX  the name suffix (portable, avx2, avx512)
 *   PA_TARGET  the function attribute of the path (empty for portable)
 *   PA_W       floats per vector register (4, 8, 16); dp, the padded head_dim, is a multiple
 *              of 16 and TC is 16, so every width divides both
 * It defines static void item_<PA_SUFFIX>(const Problem *, const Item *, const Scratch *).
 */
#define PA_CAT2(a, b) a##_##b
#define PA_CAT(a, b) PA_CAT2(a, b)
#define PA_NAME(x) PA_CAT(x, PA_SUFFIX)
#define PA_FN PA_TARGET static inline __attribute__((always_inline))

/* PA_W floats; aligned(4) makes loads and stores through it unaligned-safe. */
typedef float PA_NAME(vf) __attribute__((vector_size(PA_W * 4), aligned(4)));
typedef uint32_t PA_NAME(vu) __attribute__((vector_size(PA_W * 4), aligned(4)));
typedef uint16_t PA_NAME(vh) __attribute__((vector_size(PA_W * 2), aligned(2)));
#define VF PA_NAME(vf)
#define VU PA_NAME(vu)
#define VH PA_NAME(vh)
#define LOADF(ptr) (*(const VF *)(ptr))

PA_FN float PA_NAME(hsum)(VF v) {
    float a = 0.0f;
    for (int i = 0; i < PA_W; ++i) a += v[i];
    return a;
}

/* head_dim elements of kv_dtype at src as dp floats at dst, zero padded. */
PA_FN void PA_NAME(load_row)(float *dst, const char *src, int head_dim, int dp, int kv_dtype) {
    if (head_dim % PA_W == 0) {
        for (int d = 0; d < head_dim; d += PA_W) {
            VF v;
            if (kv_dtype == KV_F32) {
                v = LOADF((const float *)src + d);
            } else {
                const VU h = __builtin_convertvector(*(const VH *)((const uint16_t *)src + d), VU);
                if (kv_dtype == KV_BF16) {
                    v = (VF)(h << 16);
                } else { /* IEEE half, exact as in f16_to_f32 */
                    const VU em = (h & 0x7fff) << 13;
                    const VF f = (VF)em * 0x1p112f;
                    const VU inf_nan = (VU)(em >= (0x7c00u << 13)); /* all ones where true */
                    v = (VF)((VU)f | (inf_nan & 0x7f800000u) | ((h & 0x8000) << 16));
                }
            }
            *(VF *)(dst + d) = v;
        }
    } else {
        for (int d = 0; d < head_dim; ++d) {
            if (kv_dtype == KV_F32)
                dst[d] = ((const float *)src)[d];
            else if (kv_dtype == KV_BF16)
                dst[d] = bf16_to_f32(((const uint16_t *)src)[d]);
            else
                dst[d] = f16_to_f32(((const uint16_t *)src)[d]);
        }
    }
    for (int d = head_dim; d < dp; ++d) dst[d] = 0.0f;
}

/* s[r * TC + j] = q_r . k_j for a few rows: one dot product per pair. */
PA_FN void PA_NAME(scores_dot)(const float *q, const float *const *krow, float *s, int num_rows,
                               int n, int dp) {
    for (int r = 0; r < num_rows; ++r) {
        const float *qr = q + (int64_t)r * dp;
        for (int j = 0; j < n; ++j) {
            VF a0 = {0}, a1 = {0};
            int d = 0;
            for (; d + 2 * PA_W <= dp; d += 2 * PA_W) {
                a0 += LOADF(qr + d) * LOADF(krow[j] + d);
                a1 += LOADF(qr + d + PA_W) * LOADF(krow[j] + d + PA_W);
            }
            for (; d < dp; d += PA_W) a0 += LOADF(qr + d) * LOADF(krow[j] + d);
            s[r * TC + j] = PA_NAME(hsum)(a0 + a1);
        }
    }
}

#if PA_W == 16
/* AVX-512, few rows (decodes): each row's TC = 16 dot products as vectors, then one
 * transposing reduction tree (46 shuffles and adds for 16 sums, against some 30 operations
 * for each horizontal sum of scores_dot). Tokens past n score 0 (masked by the caller). */
PA_FN void PA_NAME(scores_tree)(const float *q, const float *const *krow, float *s, int num_rows,
                                int n, int dp) {
    /* the tree leaves token 4 (L % 4) + L / 4 in lane L: this puts them back in order */
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    for (int r = 0; r < num_rows; ++r) {
        const float *qr = q + (int64_t)r * dp;
        __m512 t[16], u[8], v[4], w[2];
        for (int j = 0; j < 16; ++j) {
            __m512 a = _mm512_setzero_ps(), b = _mm512_setzero_ps();
            if (j < n) {
                int d = 0;
                for (; d + 32 <= dp; d += 32) {
                    a = _mm512_fmadd_ps(_mm512_loadu_ps(qr + d), _mm512_loadu_ps(krow[j] + d), a);
                    b = _mm512_fmadd_ps(_mm512_loadu_ps(qr + d + 16),
                                        _mm512_loadu_ps(krow[j] + d + 16), b);
                }
                if (d < dp)
                    a = _mm512_fmadd_ps(_mm512_loadu_ps(qr + d), _mm512_loadu_ps(krow[j] + d), a);
            }
            t[j] = _mm512_add_ps(a, b);
        }
        for (int i = 0; i < 8; ++i) /* 128-bit quarters: a's two sums, then b's */
            u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0x44),
                                 _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0xEE));
        for (int i = 0; i < 4; ++i) /* one quarter per token */
            v[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x88),
                                 _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xDD));
        for (int i = 0; i < 2; ++i) /* within quarters: pairs of lanes */
            w[i] = _mm512_add_ps(_mm512_shuffle_ps(v[2 * i], v[2 * i + 1], 0x44),
                                 _mm512_shuffle_ps(v[2 * i], v[2 * i + 1], 0xEE));
        const __m512 z = _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], 0x88),
                                       _mm512_shuffle_ps(w[0], w[1], 0xDD));
        _mm512_storeu_ps(s + r * TC, _mm512_permutexvar_ps(order, z));
    }
}

/* bfloat16 keys and values read straight from the cache (AVX-512, few rows: decodes). Every
 * 32-bit lane of a row holds a pair of values, dims 2i and 2i + 1: the pair's high half is
 * the odd dim's bfloat16 bits, and the float32 values are the lane shifted left by 16 (even)
 * or with its low half cleared (odd), exactly. No widened copy and no reduction tree:
 *   - keys: the chunk's 16 rows transposed as pairs (16 x 16 lanes per 32 dims), so each
 *     pair lane gives two vectors of one dim over the 16 tokens, and each query row's 16
 *     scores accumulate in two vectors (even dims, odd dims), added at the end;
 *   - values: acc keeps each 32 dims as the even dims' 16 sums, then the odd dims' (the
 *     layout that split_pairs undoes at the end of the item).
 * Needs head_dim a multiple of 32 (dp == head_dim). */
#if PA_W == 16
PA_FN __m512 PA_NAME(even_dims)(__m512 pairs) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_castps_si512(pairs), 16));
}

PA_FN __m512 PA_NAME(odd_dims)(__m512 pairs) {
    return _mm512_castsi512_ps(
        _mm512_and_si512(_mm512_castps_si512(pairs), _mm512_set1_epi32((int)0xffff0000u)));
}

/* s[r * TC + j] = q_r . k_j for r < num_rows, j < n (tokens past n score 0). */
PA_FN void PA_NAME(scores_pairs)(const float *q, const uint16_t *const *krow, float *s,
                                 int num_rows, int n, int dp) {
    for (int r0 = 0; r0 < num_rows; r0 += 4) {
        const int rows = num_rows - r0 < 4 ? num_rows - r0 : 4;
        __m512 a[4][2];
        for (int r = 0; r < 4; ++r) a[r][0] = a[r][1] = _mm512_setzero_ps();
        for (int c = 0; c < dp; c += 32) {
            __m512 t[16];
            for (int j = 0; j < 16; ++j)
                t[j] = j < n ? _mm512_loadu_ps((const float *)(krow[j] + c)) : _mm512_setzero_ps();
            transpose16(t); /* t[i]: pair i of the 32 dims, over the tokens */
            for (int i = 0; i < 16; ++i) {
                const __m512 even = PA_NAME(even_dims)(t[i]), odd = PA_NAME(odd_dims)(t[i]);
                for (int r = 0; r < rows; ++r) {
                    const float *qr = q + (int64_t)(r0 + r) * dp + c + 2 * i;
                    a[r][0] = _mm512_fmadd_ps(_mm512_set1_ps(qr[0]), even, a[r][0]);
                    a[r][1] = _mm512_fmadd_ps(_mm512_set1_ps(qr[1]), odd, a[r][1]);
                }
            }
        }
        for (int r = 0; r < rows; ++r)
            _mm512_storeu_ps(s + (r0 + r) * TC, _mm512_add_ps(a[r][0], a[r][1]));
    }
}

/* acc_r += sum_j p[r * TC + j] v_j, acc in the pair layout above, three rows at a time over
 * 64 dims (12 sums in registers). */
PA_FN void PA_NAME(accumulate_pairs)(float *acc, const float *p, const uint16_t *const *vrow,
                                     int num_rows, int n, int dp) {
    for (int r0 = 0; r0 < num_rows; r0 += 3) {
        const int rows = num_rows - r0 < 3 ? num_rows - r0 : 3;
        for (int c = 0; c < dp; c += 64) {
            const int halves = dp - c >= 64 ? 2 : 1; /* 32-dim halves in this block */
            __m512 a[3][4];
            for (int r = 0; r < rows; ++r)
                for (int x = 0; x < 2 * halves; ++x)
                    a[r][x] = _mm512_loadu_ps(acc + (int64_t)(r0 + r) * dp + c + 16 * x);
            for (int j = 0; j < n; ++j) {
                __m512 v[4];
                for (int h = 0; h < halves; ++h) {
                    const __m512 pairs = _mm512_loadu_ps((const float *)(vrow[j] + c + 32 * h));
                    v[2 * h] = PA_NAME(even_dims)(pairs);
                    v[2 * h + 1] = PA_NAME(odd_dims)(pairs);
                }
                for (int r = 0; r < rows; ++r) {
                    const __m512 w = _mm512_set1_ps(p[(r0 + r) * TC + j]);
                    for (int x = 0; x < 2 * halves; ++x)
                        a[r][x] = _mm512_fmadd_ps(w, v[x], a[r][x]);
                }
            }
            for (int r = 0; r < rows; ++r)
                for (int x = 0; x < 2 * halves; ++x)
                    _mm512_storeu_ps(acc + (int64_t)(r0 + r) * dp + c + 16 * x, a[r][x]);
        }
    }
}

/* acc's rows from the pair layout back to dims in order. */
PA_FN void PA_NAME(split_pairs)(float *acc, int num_rows, int dp) {
    const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
    for (int64_t i = 0; i < (int64_t)num_rows * dp; i += 32) {
        const __m512 even = _mm512_loadu_ps(acc + i), odd = _mm512_loadu_ps(acc + i + 16);
        _mm512_storeu_ps(acc + i, _mm512_permutex2var_ps(even, lo, odd));
        _mm512_storeu_ps(acc + i + 16, _mm512_permutex2var_ps(even, hi, odd));
    }
}
#endif

/* exp_nonpositive on 16 lanes (the same steps). */
PA_FN __m512 PA_NAME(exp16)(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 y = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    const __m512 magic = _mm512_set1_ps(12582912.0f);
    const __m512 n = _mm512_sub_ps(_mm512_add_ps(y, magic), magic);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
    const __m512i bits = _mm512_slli_epi32(
        _mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}
#endif

/* The same for many rows: K transposed once into kt[d * TC + j], then each row's TC scores
 * accumulate in vectors over the tokens (no horizontal sums). PA_R rows at a time keep
 * eight independent accumulation chains in flight whatever the width. */
#define PA_R (8 * PA_W / TC)
#define PA_U (TC / PA_W)
PA_FN void PA_NAME(scores_tr)(const float *q, const float *const *krow, float *s, float *kt,
                              int num_rows, int n, int dp) {
#if PA_W == 16
    /* 16 x 16 transposes in registers (perf: the scalar loop below took about a fifth of the
     * prefill's attention) */
    for (int d0 = 0; d0 < dp; d0 += 16) {
        __m512 t[16];
        for (int j = 0; j < 16; ++j)
            t[j] = j < n ? _mm512_loadu_ps(krow[j] + d0) : _mm512_setzero_ps();
        transpose16(t);
        for (int i = 0; i < 16; ++i) _mm512_storeu_ps(kt + (d0 + i) * TC, t[i]);
    }
#else
    for (int j = 0; j < n; ++j)
        for (int d = 0; d < dp; ++d) kt[d * TC + j] = krow[j][d];
    for (int j = n; j < TC; ++j)
        for (int d = 0; d < dp; ++d) kt[d * TC + j] = 0.0f;
#endif
    int r = 0;
    for (; r + PA_R <= num_rows; r += PA_R) {
        const float *qr = q + (int64_t)r * dp;
        VF a[PA_R][PA_U];
        for (int i = 0; i < PA_R; ++i)
            for (int u = 0; u < PA_U; ++u) a[i][u] = (VF){0};
        for (int d = 0; d < dp; ++d)
            for (int u = 0; u < PA_U; ++u) {
                const VF k = LOADF(kt + d * TC + u * PA_W);
                for (int i = 0; i < PA_R; ++i) a[i][u] += qr[i * dp + d] * k;
            }
        for (int i = 0; i < PA_R; ++i)
            for (int u = 0; u < PA_U; ++u) *(VF *)(s + (r + i) * TC + u * PA_W) = a[i][u];
    }
    for (; r < num_rows; ++r) {
        const float *qr = q + (int64_t)r * dp;
        VF a[PA_U];
        for (int u = 0; u < PA_U; ++u) a[u] = (VF){0};
        for (int d = 0; d < dp; ++d)
            for (int u = 0; u < PA_U; ++u) a[u] += qr[d] * LOADF(kt + d * TC + u * PA_W);
        for (int u = 0; u < PA_U; ++u) *(VF *)(s + r * TC + u * PA_W) = a[u];
    }
}
#undef PA_U
#undef PA_R

/* acc_r += sum_j p[r * TC + j] v_j, two rows' accumulators held in registers over the chunk
 * (eight independent chains). */
PA_FN void PA_NAME(accumulate_v)(float *acc, const float *p, const float *const *vrow,
                                 int num_rows, int n, int dp) {
    int r = 0;
    for (; r + 2 <= num_rows; r += 2) {
        float *ar = acc + (int64_t)r * dp, *br = ar + dp;
        const float *pr = p + r * TC, *qr = pr + TC;
        int d = 0;
        for (; d + 4 * PA_W <= dp; d += 4 * PA_W) {
            VF a0 = LOADF(ar + d), a1 = LOADF(ar + d + PA_W);
            VF a2 = LOADF(ar + d + 2 * PA_W), a3 = LOADF(ar + d + 3 * PA_W);
            VF b0 = LOADF(br + d), b1 = LOADF(br + d + PA_W);
            VF b2 = LOADF(br + d + 2 * PA_W), b3 = LOADF(br + d + 3 * PA_W);
            for (int j = 0; j < n; ++j) {
                const float *v = vrow[j] + d;
                const VF v0 = LOADF(v), v1 = LOADF(v + PA_W);
                const VF v2 = LOADF(v + 2 * PA_W), v3 = LOADF(v + 3 * PA_W);
                a0 += pr[j] * v0;
                a1 += pr[j] * v1;
                a2 += pr[j] * v2;
                a3 += pr[j] * v3;
                b0 += qr[j] * v0;
                b1 += qr[j] * v1;
                b2 += qr[j] * v2;
                b3 += qr[j] * v3;
            }
            *(VF *)(ar + d) = a0;
            *(VF *)(ar + d + PA_W) = a1;
            *(VF *)(ar + d + 2 * PA_W) = a2;
            *(VF *)(ar + d + 3 * PA_W) = a3;
            *(VF *)(br + d) = b0;
            *(VF *)(br + d + PA_W) = b1;
            *(VF *)(br + d + 2 * PA_W) = b2;
            *(VF *)(br + d + 3 * PA_W) = b3;
        }
        for (; d < dp; d += PA_W) {
            VF a0 = LOADF(ar + d), b0 = LOADF(br + d);
            for (int j = 0; j < n; ++j) {
                const VF v0 = LOADF(vrow[j] + d);
                a0 += pr[j] * v0;
                b0 += qr[j] * v0;
            }
            *(VF *)(ar + d) = a0;
            *(VF *)(br + d) = b0;
        }
    }
    for (; r < num_rows; ++r) {
        float *ar = acc + (int64_t)r * dp;
        const float *pr = p + r * TC;
        for (int d = 0; d < dp; d += PA_W) {
            VF a0 = LOADF(ar + d);
            for (int j = 0; j < n; ++j) a0 += pr[j] * LOADF(vrow[j] + d);
            *(VF *)(ar + d) = a0;
        }
    }
}

/* One work item for the padded head_dim dp (a constant in the copies that item() makes, so
 * that the loops over the head's values unroll). The item's rows come in one block per kv
 * head, each block its tokens times the group. */
PA_FN void PA_NAME(item_dp)(const Problem *p, const Item *it, const Scratch *w, const int dp) {
    const int group = p->group, kv_dtype = p->kv_dtype;
    const int seq_len = p->seq_lens[it->seq];
    const int q_start = p->query_start_loc[it->seq];
    const int q_len = p->query_start_loc[it->seq + 1] - q_start;
    const int first_pos = seq_len - q_len; /* position of new token 0 */
    const int block_rows = (it->q_end - it->q_begin) * group; /* rows per kv head */
    const int num_rows = block_rows * it->kv_heads;
    const int32_t *table = p->block_tables + (int64_t)it->seq * p->table_stride;
    /* rows are read in place when no conversion or padding is needed */
    const int direct = kv_dtype == KV_F32 && p->head_dim == dp;
    const int transposed = block_rows >= TRANSPOSE_MIN_ROWS;
#if PA_W == 16
    const int pairs = kv_dtype == KV_BF16 && !transposed && p->head_dim == dp && dp % 32 == 0;
#else
    const int pairs = 0;
#endif

    for (int r = 0; r < num_rows; ++r) {
        const int rb = r % block_rows;
        const int token = q_start + it->q_begin + rb / group;
        const int head = (it->kv_head + r / block_rows) * group + rb % group;
        const float *src = p->query + ((int64_t)token * p->num_heads + head) * p->head_dim;
        float *dst = w->q + (int64_t)r * dp;
        for (int d = 0; d < p->head_dim; ++d) dst[d] = src[d] * p->scale;
        for (int d = p->head_dim; d < dp; ++d) dst[d] = 0.0f;
        /* a sink is one more softmax term that weighs no value: the running maximum starts
         * at it and the running sum at e^0 = 1; split-K: in the first split only (which
         * every row reaches), so a context of one split has the bits of no split */
        const int sink = p->sinks != NULL && it->split == 0;
        w->m[r] = sink ? p->sinks[head] : -INFINITY;
        w->l[r] = sink ? 1.0f : 0.0f;
    }
    memset(w->acc, 0, sizeof(float) * (size_t)num_rows * (size_t)dp);

    /* context of this item: its split, from the first row's window start (0 without a
     * window) to the last row's causal limit */
    int c_begin = visible_from(p, first_pos + it->q_begin);
    int c_end = first_pos + it->q_end; /* last token's position + 1 */
    if (p->split_tokens > 0) {
        const int split_begin = visible_from(p, first_pos) + it->split * p->split_tokens;
        const int split_end = split_begin + p->split_tokens;
        c_begin = split_begin > c_begin ? split_begin : c_begin;
        c_end = split_end < c_end ? split_end : c_end;
    }

    const int64_t head_off0 = (int64_t)it->kv_head * p->stride_head;
    const int row_bytes = p->head_dim * p->elem_size;
    const float *krow[TC], *vrow[TC];
    /* one kv head after the other, each over the whole context: the other heads' rows,
     * side by side with this one's in each slot, come into the L2 with it (hardware
     * prefetch), and wait there for their turn */
    for (int hb = 0; hb < it->kv_heads; ++hb) {
        const int64_t head_off = head_off0 + (int64_t)hb * p->stride_head;
        for (int t0 = c_begin; t0 < c_end; t0 += TC) {
            const int n = c_end - t0 < TC ? c_end - t0 : TC;
            /* The rows of the chunks ahead into the caches while this one computes: they sit
             * in other blocks, wherever the table says, so no hardware prefetcher guesses
             * them; the loads below had waited on memory (perf: most of the kernel's
             * samples). Two chunks ahead into the L2, whose misses can be many in flight, and
             * the next one on into the L1: 64 sequences at 300 tokens, 30 layers' caches
             * from DRAM, AMD Zen 5, went from 84-89 ms to 63 with the L1 prefetch alone and
             * about 50 with both. */
            prefetch_rows(p, table, head_off, row_bytes, t0 + TC, c_end, 1);
            prefetch_rows(p, table, head_off, row_bytes, t0 + 2 * TC, c_end, 2);
            const int r0 = hb * block_rows; /* this kv head's block of rows */
            float *const q = w->q + (int64_t)r0 * dp, *const acc = w->acc + (int64_t)r0 * dp;
            float *const sc = w->s + r0 * TC, *const m = w->m + r0, *const l = w->l + r0;
            for (int j = 0; j < n; ++j) {
                const int64_t off = row_offset(p, table, head_off, t0 + j);
                if (direct || pairs) { /* in place (pairs: bfloat16 rows, cast back below) */
                    krow[j] = (const float *)(p->k_cache + off);
                    vrow[j] = (const float *)(p->v_cache + off);
                } else {
                    float *kd = w->kr + (int64_t)j * dp, *vd = w->vr + (int64_t)j * dp;
                    PA_NAME(load_row)(kd, p->k_cache + off, p->head_dim, dp, kv_dtype);
                    PA_NAME(load_row)(vd, p->v_cache + off, p->head_dim, dp, kv_dtype);
                    krow[j] = kd;
                    vrow[j] = vd;
                }
            }
            if (transposed)
                PA_NAME(scores_tr)(q, krow, sc, w->kt, block_rows, n, dp);
#if PA_W == 16
            else if (pairs)
                PA_NAME(scores_pairs)(q, (const uint16_t *const *)krow, sc, block_rows, n, dp);
#endif
            else
#if PA_W == 16
                PA_NAME(scores_tree)(q, krow, sc, block_rows, n, dp);
#else
                PA_NAME(scores_dot)(q, krow, sc, block_rows, n, dp);
#endif

            /* causal mask and window, online softmax; masked and past-the-chunk scores
             * become 0: row r sees chunk tokens lo <= j < nv */
            for (int r = 0; r < block_rows; ++r) {
                float *s = sc + r * TC;
                const int pos = first_pos + it->q_begin + r / group; /* the row's position */
                const int valid_end = pos - t0 + 1;                  /* j < this */
                const int nv = valid_end < n ? valid_end : n;
                const int lo = visible_from(p, pos) > t0 ? visible_from(p, pos) - t0 : 0;
                if (nv <= lo) {
                    for (int j = 0; j < TC; ++j) s[j] = 0.0f;
                    continue;
                }
                float cm = -INFINITY;
                for (int j = lo; j < nv; ++j) cm = s[j] > cm ? s[j] : cm;
                const float m_old = m[r];
                const float m_new = cm > m_old ? cm : m_old;
                if (m_new > m_old && m_old != -INFINITY) {
                    const float alpha = exp_nonpositive(m_old - m_new);
                    l[r] *= alpha;
                    float *a = acc + (int64_t)r * dp;
                    for (int d = 0; d < dp; d += PA_W) *(VF *)(a + d) *= alpha;
                }
                m[r] = m_new;
#if PA_W == 16
                const __mmask16 live = (__mmask16)((nv >= TC ? 0xFFFFu : (1u << nv) - 1) &
                                                   ~((1u << lo) - 1));
                const __m512 e = _mm512_maskz_mov_ps(
                    live,
                    PA_NAME(exp16)(_mm512_sub_ps(_mm512_loadu_ps(s), _mm512_set1_ps(m_new))));
                _mm512_storeu_ps(s, e);
                l[r] += _mm512_reduce_add_ps(e);
#else
                float sum = 0.0f;
                for (int j = 0; j < TC; ++j) {
                    const float e = exp_nonpositive(s[j] - m_new);
                    s[j] = j >= lo && j < nv ? e : 0.0f;
                    sum += s[j];
                }
                l[r] += sum;
#endif
            }
#if PA_W == 16
            if (pairs)
                PA_NAME(accumulate_pairs)(acc, sc, (const uint16_t *const *)vrow, block_rows, n,
                                          dp);
            else
#endif
                PA_NAME(accumulate_v)(acc, sc, vrow, block_rows, n, dp);
        }
    }
#if PA_W == 16
    if (pairs) PA_NAME(split_pairs)(w->acc, num_rows, dp);
#endif

    for (int r = 0; r < num_rows; ++r) {
        const int rb = r % block_rows;
        const int token = q_start + it->q_begin + rb / group;
        const int head = (it->kv_head + r / block_rows) * group + rb % group;
        const float *a = w->acc + (int64_t)r * dp;
        if (p->split_tokens > 0) {
            float *dst = p->partial +
                         (((int64_t)token * p->num_heads + head) * p->max_splits + it->split) *
                             (dp + 2);
            dst[0] = w->m[r];
            dst[1] = w->l[r];
            memcpy(dst + 2, a, sizeof(float) * (size_t)p->head_dim);
        } else {
            float *o = p->out + ((int64_t)token * p->num_heads + head) * p->head_dim;
            const float inv = 1.0f / w->l[r];
            for (int d = 0; d < p->head_dim; ++d) o[d] = a[d] * inv;
        }
    }
}

/* item_dp with dp a constant for the common head sizes: at dp 64 the score loops ran with
 * their loop control in the way (perf: a quarter of a 64-sequence bfloat16 step's attention
 * samples on the loop over d) */
PA_TARGET static void PA_NAME(item)(const Problem *p, const Item *it, const Scratch *w) {
    if (p->dp == 64)
        PA_NAME(item_dp)(p, it, w, 64);
    else if (p->dp == 128)
        PA_NAME(item_dp)(p, it, w, 128);
    else
        PA_NAME(item_dp)(p, it, w, p->dp);
}

#undef LOADF
#undef VH
#undef VU
#undef VF
#undef PA_FN
#undef PA_NAME
#undef PA_CAT
#undef PA_CAT2
