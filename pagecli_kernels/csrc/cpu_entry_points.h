/*
 * The C entry points of the native library (native.py builds every file of csrc/ into one
 * library) that other files of it call: declared once here, and included by the files that
 * define them, so the compiler checks that each declaration matches its definition.
 */
#ifndef PAGECLI_CPU_ENTRY_POINTS_H
#define PAGECLI_CPU_ENTRY_POINTS_H

#include <stdint.h>

/* quant_linear_cpu.c */
int pagecli_quant_isa(void);
int pagecli_quant_linear(int type, const void *w, int64_t n, int64_t k, const float *x,
                         int64_t ldx, int64_t m, float *y, int64_t ldy, int num_threads);
/* the parts of one projection, W's rows one part after the other (QUANT_MAX_PARTS at most) */
#define QUANT_MAX_PARTS 4
int pagecli_quant_linear_parts(int num_parts, const int *types, const void *const *ws,
                               const int64_t *rows, int64_t k, const float *x, int64_t ldx,
                               int64_t m, float *y, int64_t ldy, int num_threads);
int pagecli_quant_fused_rows(void); /* batches of up to this many rows: the fused kernels */
int64_t pagecli_quant_row_bytes(int type, int64_t k); /* -1: unknown type or shape */

/* quantize_cpu.c: float32 rows -> Q4_K blocks (0, or -1 a type it does not make, -2 a shape) */
int pagecli_quantize_rows(int ggml_type, const float *x, int64_t rows, int64_t cols,
                          uint8_t *out, int num_threads);

/* shm_collective.c: 0, or -1 a time-out, -2 aborted, -3 larger than a slot */
int64_t pagecli_shm_header_bytes(int32_t size);
int pagecli_shm_all_reduce(char *base, int64_t slot_floats, int32_t rank, int32_t size,
                           int64_t number, float *x, int64_t n, double timeout_s);
int pagecli_shm_gather(char *base, int64_t slot_floats, int32_t rank, int32_t size,
                       int64_t number, const float *x, int64_t n, float *out, double timeout_s);
void pagecli_shm_abort(char *base, int32_t size);

/* gemm_bf16.c */
int pagecli_bf16_linear(const void *w, int64_t n, int64_t k, const void *x, int64_t ldx,
                        int64_t m, float *y, int64_t ldy, int num_threads);

/* gemm_quant_amx.c */
int pagecli_quant_tiles_format(int type);
int pagecli_quant_set_int_dots(int choice);
int pagecli_quant_set_small_batches(int choice); /* quant_linear_cpu.c */
int pagecli_quant_small_batches_all(void); /* quant_linear_cpu.c */
int pagecli_quant_int_dots(void);
int pagecli_quant_int_dots_on(void);
int pagecli_quant_set_vnni_q4_k(int choice); /* quant_linear_cpu.c */
int pagecli_quant_vnni_q4_k(void);
int pagecli_quant_tiles_linear(int type, const void *w, int64_t row_bytes, int64_t n, int64_t k,
                               const float *x, int64_t ldx, int64_t m, float *y, int64_t ldy,
                               int num_threads);

/* paged_attention_cpu.c */
int pagecli_paged_attention(int isa, int kv_dtype, const float *query, const void *k_cache,
                            const void *v_cache, int64_t num_blocks, int64_t stride_block,
                            int64_t stride_slot, int64_t stride_head, const int32_t *block_tables,
                            int64_t table_stride, const int32_t *seq_lens,
                            const int32_t *query_start_loc, float *out, int num_seqs,
                            int num_heads, int num_kv_heads, int head_dim, int block_size,
                            float scale, int window, const float *sinks, int split_tokens,
                            int num_threads);

/* cpu_ops.c */
int pagecli_store_kv(const void *key, const void *value, int64_t stride_key, int64_t stride_value,
                     void *k_cache, void *v_cache, int64_t stride_block, int64_t stride_slot,
                     const int64_t *slot_mapping, int64_t num_tokens, int64_t row_elems,
                     int64_t elem_size, int64_t block_size, int64_t num_slots);
void pagecli_rms_norm(void *x, const void *delta, const void *weight, void *out,
                      int64_t num_rows, int64_t num_heads, int64_t width, int64_t stride_x,
                      int64_t stride_delta, int64_t stride_out, float eps, int dtype,
                      int weight_mode, int num_threads);
void pagecli_rotary(void *q, void *k, const void *cos, const void *sin, int64_t num_tokens,
                    int64_t num_q_heads, int64_t num_k_heads, int64_t head_dim,
                    int64_t rotary_dim, int64_t stride_q, int64_t stride_k, int dtype,
                    int pairs);
void pagecli_act_mul(const void *gate_up, void *out, int64_t num_rows, int64_t inter,
                     int64_t stride_in, int64_t stride_out, int dtype, int act,
                     int num_threads);
void pagecli_swiglu_oai(const void *gate_up, void *out, int64_t num_rows, int64_t inter,
                        int64_t stride_in, int64_t stride_out, int dtype, float alpha,
                        float limit, int num_threads);
void pagecli_add_scaled(void *x, const void *y, int64_t num_rows, int64_t width,
                        int64_t stride_x, int64_t stride_y, float scale, int has_scale,
                        int dtype, int num_threads);

/* layer_program_cpu.c: a sparse MoE MLP as the layer program's OP_MOE computes it */
int pagecli_moe(const int64_t *table, const float *x, int64_t T, int64_t H, float *out,
                int num_threads);

/* gated_delta_cpu.c: 0, or -1 a slot outside the stores, -2 no memory */
int pagecli_gated_delta(const float *mixed, int64_t ld_mixed, int64_t T, const float *conv_w,
                        int K, const float *A, const float *dt_bias, const float *norm_w,
                        float eps, float *conv_states, float *ssm_states, int64_t num_slots,
                        const int64_t *slots, const int32_t *starts, int num_seqs, int nk,
                        int nv, int dk, int dv, int tiled, float *out, int64_t ld_out,
                        int num_threads);
void pagecli_gate_mul(float *x, const float *gate, int64_t num_rows, int64_t width,
                      int64_t stride_x, int64_t stride_gate, int num_threads);

#endif
