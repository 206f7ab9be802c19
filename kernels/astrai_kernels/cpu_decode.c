/* One decode token of each of a few rows through every decoder layer in one call: the engine's CPU decode steps of
 * one to a few rows.
 *
 * Built into the same library as the other sources by `astrai.kernels.cpu_kernels`. Written for astrai. Why: at one
 * row a decode step of SmolLM2-135M on a 2-core CPU is ~13 ms of weight streaming and, between the 121 products,
 * ~5 ms of Python and dispatch (module calls, views, ctypes calls, allocations), whose code and data the streamed
 * weights keep evicting from the caches; vLLM's CPU build compiles that glue away. Here each layer is the same
 * sequence of the library's own pieces as `astrai.rollout.cpu_decode.FlatTrunk` runs from Python: RMSNorm, the fused
 * q/k/v product (`astrai_gemv`), per-head q/k norms, rotary, the KV store, dense decode attention, the output
 * product, residual adds, the gated MLP; with the same rounding at every step (each intermediate rounded to the
 * dtype where torch rounds it), so results differ from the Python path only by the products' sum order.
 *
 * Layouts: h (B, H) the residual stream, updated in place; weights as the model holds them ((out, in) contiguous);
 * caches as `DenseDecodeCache` and the paged workspace hold them (row b of the dense copies is the step's row b);
 * slots, positions (int64) and lens (int32) (B,); cos, sin (B, D); scratch at least `astrai_decode_scratch_bytes`
 * for B rows.
 */

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "cpu_common.h"

int astrai_gemv(const void *x, int64_t x_row, int64_t M, const void *W, const void *b, int64_t N, int64_t K, void *y,
                int dtype, int num_threads);
int astrai_rmsnorm(const void *x, int64_t x_row, const void *w, void *out, int64_t rows, int64_t H, float eps,
                   int unit_offset, int dtype, int num_threads);
int astrai_rotary(void *x, int64_t x_row, const void *cos, const void *sin, int64_t rows, int64_t heads, int64_t D,
                  int dtype, int num_threads);
int astrai_gated_activation(const void *gate_up, int64_t gu_row, void *out, int64_t rows, int64_t I, int gelu,
                            int dtype, int num_threads);
int astrai_store_kv(const void *k, int64_t k_row, const void *v, int64_t v_row, const int64_t *slots,
                    void *k_pages, void *v_pages, const int64_t *positions, void *dense_keys, void *dense_values,
                    int64_t B, int64_t Nkv, int64_t D, int64_t cap, int dtype);
int astrai_dense_decode_attention(const void *q, int64_t q_row, const void *keys, const void *values,
                                  const int32_t *lens, int64_t B, int64_t Nh, int64_t Nkv, int64_t D, int64_t cap,
                                  int dtype, float scale, int64_t window, float softcap, float *out,
                                  int num_threads);

/* One layer's tensors (NULL where the layer has none) and options. Mirrored by `cpu_kernels.DecodeLayer`. */
struct astrai_decode_layer {
    const void *input_norm, *post_attention_norm, *pre_feedforward_norm, *post_feedforward_norm, *q_norm, *k_norm;
    const void *qkv_weight, *qkv_bias, *o_weight, *o_bias, *gate_up_weight, *down_weight, *down_bias;
    void *k_pages, *v_pages, *dense_keys, *dense_values;
    int64_t window; /* 0: none */
    float softcap;  /* 0: none */
    int32_t local_rotary, gelu;
};

/* The model's sizes and the step's inputs. Mirrored by `cpu_kernels.DecodeStep`. */
struct astrai_decode_step {
    int64_t layers, B, H, Nh, Nkv, D, I, cap;
    const int64_t *slots, *positions;
    const int32_t *lens;
    const void *cos, *sin, *cos_local, *sin_local; /* (B, D) each, the dtype */
    int32_t dtype, unit_offset, num_threads;
    float eps, scale;
};

static inline int64_t align64(int64_t n) { return (n + 63) / 64 * 64; }

/* Bytes of scratch `astrai_decode_token` needs for B rows of these sizes. */
int64_t astrai_decode_scratch_bytes(int64_t B, int64_t H, int64_t Nh, int64_t Nkv, int64_t D, int64_t I, int dtype) {
    const int64_t e = dtype == F32 ? 4 : 2;
    return align64(B * H * e) * 2 + align64(B * (Nh + 2 * Nkv) * D * e) + align64(B * Nh * D * 4) +
           align64(B * Nh * D * e) + align64(B * 2 * I * e) + align64(B * I * e);
}

/* h = round(h + x), n elements (torch's add in the dtype). */
static void add_(char *h, const char *x, int64_t n, int dtype) {
    const int64_t e = dtype == F32 ? 4 : 2;
    for (int64_t i = 0; i < n; i++) store1(h + e * i, load1(h + e * i, dtype) + load1(x + e * i, dtype), dtype);
}

/* Every layer for one token of each of B rows; h (B, H) in place. 0, 1 out of memory (attention), 2 an unsupported
 * dtype. */
int astrai_decode_token(const struct astrai_decode_step *s, const struct astrai_decode_layer *layers, void *h_,
                        void *scratch) {
    const int dt = s->dtype, nt = s->num_threads;
    const int64_t e = dt == F32 ? 4 : 2, B = s->B, H = s->H, Nh = s->Nh, Nkv = s->Nkv, D = s->D, I = s->I;
    const int64_t qkv_n = (Nh + 2 * Nkv) * D;
    char *h = h_, *x = scratch, *o = x + align64(B * H * e), *qkv = o + align64(B * H * e);
    float *attn = (float *)(qkv + align64(B * qkv_n * e));
    char *attn_t = (char *)attn + align64(B * Nh * D * 4), *gu = attn_t + align64(B * Nh * D * e);
    char *a = gu + align64(B * 2 * I * e);
    int status = 0;
    for (int64_t l = 0; l < s->layers && !status; l++) {
        const struct astrai_decode_layer *L = layers + l;
        const void *cos = L->local_rotary ? s->cos_local : s->cos, *sin = L->local_rotary ? s->sin_local : s->sin;
        status |= astrai_rmsnorm(h, H, L->input_norm, x, B, H, s->eps, s->unit_offset, dt, nt);
        status |= astrai_gemv(x, H, B, L->qkv_weight, L->qkv_bias, qkv_n, H, qkv, dt, nt);
        if (L->q_norm) /* per head, in place (the norm reads each element before writing it) */
            for (int64_t b = 0; b < B; b++) {
                char *row = qkv + b * qkv_n * e;
                status |= astrai_rmsnorm(row, D, L->q_norm, row, Nh, D, s->eps, s->unit_offset, dt, nt);
                status |= astrai_rmsnorm(row + Nh * D * e, D, L->k_norm, row + Nh * D * e, Nkv, D, s->eps,
                                         s->unit_offset, dt, nt);
            }
        status |= astrai_rotary(qkv, qkv_n, cos, sin, B, Nh + Nkv, D, dt, nt);
        const char *k = qkv + Nh * D * e, *v = k + Nkv * D * e;
        status |= astrai_store_kv(k, qkv_n, v, qkv_n, s->slots, L->k_pages, L->v_pages, s->positions, L->dense_keys,
                                  L->dense_values, B, Nkv, D, s->cap, dt);
        status |= astrai_dense_decode_attention(qkv, qkv_n, L->dense_keys, L->dense_values, s->lens, B, Nh, Nkv, D,
                                                s->cap, dt, s->scale, L->window, L->softcap, attn, nt);
        for (int64_t i = 0; i < B * Nh * D; i++) store1(attn_t + e * i, attn[i], dt);
        status |= astrai_gemv(attn_t, Nh * D, B, L->o_weight, L->o_bias, H, Nh * D, o, dt, nt);
        if (L->pre_feedforward_norm) { /* Gemma 2/3: each sublayer's output normalised before its residual add */
            status |= astrai_rmsnorm(o, H, L->post_attention_norm, o, B, H, s->eps, s->unit_offset, dt, nt);
            add_(h, o, B * H, dt);
            status |= astrai_rmsnorm(h, H, L->pre_feedforward_norm, x, B, H, s->eps, s->unit_offset, dt, nt);
        } else {
            add_(h, o, B * H, dt);
            status |= astrai_rmsnorm(h, H, L->post_attention_norm, x, B, H, s->eps, s->unit_offset, dt, nt);
        }
        status |= astrai_gemv(x, H, B, L->gate_up_weight, NULL, 2 * I, H, gu, dt, nt);
        status |= astrai_gated_activation(gu, 2 * I, a, B, I, L->gelu, dt, nt);
        status |= astrai_gemv(a, I, B, L->down_weight, L->down_bias, H, I, o, dt, nt);
        if (L->post_feedforward_norm)
            status |= astrai_rmsnorm(o, H, L->post_feedforward_norm, o, B, H, s->eps, s->unit_offset, dt, nt);
        add_(h, o, B * H, dt);
    }
    return status;
}
