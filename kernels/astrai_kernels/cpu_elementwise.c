/* The elementwise pieces of a CPU decoder layer, one call each: RMSNorm, rotary embedding (in place) and the gated
 * activation of a gated MLP, in the engine's dtype (0 float32, 1 bfloat16, 2 float16) with float32 arithmetic.
 *
 * Built into the same library as cpu_attention.c by `astrai.kernels.cpu_kernels` (that module says when and why).
 * Written for astrai. Why: in a decode step each of these is 5-10 torch ops on a few thousand elements (a norm:
 * upcast, pow, mean, add, rsqrt, two multiplies, a downcast), each dispatched and forked over the OpenMP team on its
 * own; a decode step of SmolLM2-135M ran about 600 of them. One call per piece reads and writes each element once.
 *
 * Rounding follows the torch code these replace (astrai/models/layers.py), operation by operation: where torch
 * rounds an intermediate to the dtype (bfloat16 / float16), so does this code, and no multiply-add is contracted
 * (the pragma below), so rotary is bitwise the torch result and the norm and activation differ only by the order of
 * the norm's sum and the last bit of exp.
 *
 * Layouts: `rows` tokens, row r of an input at element offset r * stride (last dim contiguous); outputs contiguous.
 */

#pragma GCC optimize("fp-contract=off")

#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "cpu_common.h"

/* Parallel only above this many elements: below it a fork/join of the team costs more than the work. */
#define PARALLEL_ELEMENTS 16384

typedef int32_t v16i __attribute__((vector_size(64)));

/* Elements i .. i + 15 of the dtype array p as float32. */
static inline __attribute__((always_inline)) v16 vget(const char *p, int64_t i, const int dtype) {
    return load16(p + (dtype == F32 ? 4 : 2) * i, dtype);
}

/* Each lane of x rounded to bfloat16 (nearest, ties to even; NaN kept NaN), as 16 bits. With AVX-512 BF16 one
 * instruction (which also flushes float32 subnormals, below 1.2e-38, to zero); else integer arithmetic. */
static inline __attribute__((always_inline)) v16u16 vbf16(v16 x) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
    __m512 in;
    memcpy(&in, &x, sizeof in);
    const __m256bh packed = _mm512_cvtneps_pbh(in);
    v16u16 h;
    memcpy(&h, &packed, sizeof h);
    return h;
#else
    v16u32 bits;
    memcpy(&bits, &x, sizeof bits);
    const v16u32 nan = (v16u32)((bits & 0x7fffffffu) > 0x7f800000u);  /* all ones where NaN */
    const v16u32 rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    return __builtin_convertvector((rounded & ~nan) | (((bits | 0x400000u) >> 16) & nan), v16u16);
#endif
}

/* The bfloat16 rounding of each lane in the high half of a 32-bit lane (a float32 holding the bfloat16 value). */
static inline __attribute__((always_inline)) v16u32 vbf16_bits(v16 x) {
    return __builtin_convertvector(vbf16(x), v16u32) << 16;
}

static inline __attribute__((always_inline)) void vput(char *p, int64_t i, v16 x, const int dtype) {
    if (dtype == F32) {
        memcpy(p + 4 * i, &x, sizeof x);
    } else if (dtype == BF16) {
        const v16u16 h = vbf16(x);
        memcpy(p + 2 * i, &h, sizeof h);
    } else {
#if HAVE_F16
        const v16f16 h = __builtin_convertvector(x, v16f16);
        memcpy(p + 2 * i, &h, sizeof h);
#endif
    }
}

/* Each lane rounded to the dtype and back (the value torch holds after an op in that dtype). */
static inline __attribute__((always_inline)) v16 vround(v16 x, const int dtype) {
    if (dtype == BF16) {
        const v16u32 bits = vbf16_bits(x);
        memcpy(&x, &bits, sizeof x);
    } else if (dtype == F16) {
#if HAVE_F16
        x = __builtin_convertvector(__builtin_convertvector(x, v16f16), v16);
#endif
    }
    return x;
}

/* Lane-wise: a where mask (all ones), else b. */
static inline __attribute__((always_inline)) v16 vselect(v16i mask, v16 a, v16 b) {
    v16i ai, bi;
    memcpy(&ai, &a, sizeof ai);
    memcpy(&bi, &b, sizeof bi);
    const v16i r = (ai & mask) | (bi & ~mask);
    memcpy(&a, &r, sizeof a);
    return a;
}

/* exp of each lane (Cody-Waite reduction x = n ln2 + r, |r| <= ln2 / 2, n to nearest; exp(r) by Cephes' degree-6
 * expf polynomial (S. Moshier, Cephes Math Library, public domain: the coefficients); 2^n built in the exponent
 * bits), x clamped to [-87, 88] (results ~1.6e-38 and ~1.7e38 there instead of 0 and inf, which the activations
 * below turn into the same outputs). Within 2 ulp of expf. */
static inline __attribute__((always_inline)) v16 vexp(v16 x) {
    x = vselect(x < -87.0f, (v16){0} - 87.0f, x);
    x = vselect(x > 88.0f, (v16){0} + 88.0f, x);
    const v16 n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  /* round to nearest: 1.5 * 2^23 */
    const v16 r = x - n * 0.693359375f + n * 2.12194440e-4f;
    v16 p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const v16 y = p * r * r + r + 1.0f;
    const v16i bits = (__builtin_convertvector(n, v16i) + 127) << 23;
    v16 two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return y * two_n;
}

static inline __attribute__((always_inline)) v16 vsilu(v16 v) { return v / (1.0f + vexp(-v)); }

/* GELU, tanh form: 0.5 g (1 + tanh(y)), y = sqrt(2/pi) (g + 0.044715 g^3), computed as g / (1 + exp(-2y)) (the
 * same function: 1 + tanh(y) = 2 / (1 + exp(-2y))), which has no cancellation where tanh(y) is near -1. */
static inline __attribute__((always_inline)) v16 vgelu(v16 v) {
    const v16 y = 0.7978845608028654f * (v + 0.044715f * v * v * v);
    return v / (1.0f + vexp(-2.0f * y));
}

/* A lane count's tail: the last n < 16 elements through a 16-lane buffer. */
static inline __attribute__((always_inline)) v16 vget_n(const char *p, int64_t i, int64_t n, const int dtype) {
    char buf[64] = {0};
    memcpy(buf, p + (dtype == F32 ? 4 : 2) * i, (size_t)(n * (dtype == F32 ? 4 : 2)));
    return vget(buf, 0, dtype);
}

static inline __attribute__((always_inline)) void vput_n(char *p, int64_t i, int64_t n, v16 x, const int dtype) {
    char buf[64];
    vput(buf, 0, x, dtype);
    memcpy(p + (dtype == F32 ? 4 : 2) * i, buf, (size_t)(n * (dtype == F32 ? 4 : 2)));
}

/* Runs the statements for lanes i .. i + 15 of [0, n), then once more for the last n % 16 (_w lanes wide). */
#define LANES(i, n, ...)                                                                       \
    do {                                                                                       \
        int64_t i = 0;                                                                         \
        for (; i + 16 <= (n); i += 16) { const int64_t _w = 16; (void)_w; __VA_ARGS__ }        \
        if (i < (n)) { const int64_t _w = (n) - i; (void)_w; __VA_ARGS__ }                     \
    } while (0)
#define LOAD(p, i) (_w == 16 ? vget((p), (i), dtype) : vget_n((p), (i), _w, dtype))
#define STORE(p, i, x) (_w == 16 ? vput((p), (i), (x), dtype) : vput_n((p), (i), _w, (x), dtype))

/* RMSNorm (Zhang & Sennrich 2019) as astrai's RMSNorm.forward: h = x / sqrt(mean(x^2) + eps) in float32, then
 * out = round(w * round(h)) (w in the dtype; HF Llama), or with unit_offset out = round(h * (1 + w)) (HF Gemma).
 * x: (rows, H) at row stride x_row; w: (H,); out: (rows, H) contiguous; all of one dtype. */
static inline __attribute__((always_inline)) void rmsnorm_impl(const char *x, int64_t x_row, const char *w, char *out,
                                                                int64_t rows, int64_t H, float eps, int unit_offset,
                                                                int num_threads, const int dtype) {
    const int64_t elem = dtype == F32 ? 4 : 2;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows * H >= PARALLEL_ELEMENTS && num_threads > 1)
    for (int64_t r = 0; r < rows; ++r) {
        const char *xr = x + r * x_row * elem;
        char *o = out + r * H * elem;
        v16 acc = {0};
        LANES(i, H, { const v16 v = LOAD(xr, i); acc += v * v; });
        float total = 0.0f;
        for (int k = 0; k < 16; ++k) total += acc[k];
        const float inv = 1.0f / sqrtf(total / (float)H + eps);
        if (unit_offset)
            LANES(i, H, { STORE(o, i, LOAD(xr, i) * inv * (1.0f + LOAD(w, i))); });
        else
            LANES(i, H, { STORE(o, i, LOAD(w, i) * vround(LOAD(xr, i) * inv, dtype)); });
    }
}

int astrai_rmsnorm(const void *x, int64_t x_row, const void *w, void *out, int64_t rows, int64_t H, float eps,
                   int unit_offset, int dtype, int num_threads) {
    if (!dtype_supported(dtype)) return 2;
    if (dtype == F32)
        rmsnorm_impl(x, x_row, w, out, rows, H, eps, unit_offset, num_threads, F32);
    else if (dtype == BF16)
        rmsnorm_impl(x, x_row, w, out, rows, H, eps, unit_offset, num_threads, BF16);
    else
        rmsnorm_impl(x, x_row, w, out, rows, H, eps, unit_offset, num_threads, F16);
    return 0;
}

/* Rotary embedding (RoFormer, Su et al. 2021), halves layout, in place, as astrai's apply_rotary:
 * x' = round(round(x * cos) + round(rotate_half(x) * sin)), rotate_half([a, b]) = [-b, a].
 * x: (rows, heads, D) at row stride x_row and head stride D; cos, sin: (rows, D) contiguous; one dtype. */
static inline __attribute__((always_inline)) void rotary_impl(char *x, int64_t x_row, const char *cos, const char *sin,
                                                               int64_t rows, int64_t heads, int64_t D, int num_threads,
                                                               const int dtype) {
    const int64_t elem = dtype == F32 ? 4 : 2, half = D / 2;
#pragma omp parallel for num_threads(num_threads) schedule(static) \
    if (rows * heads * D >= PARALLEL_ELEMENTS && num_threads > 1)
    for (int64_t r = 0; r < rows; ++r) {
        const char *c = cos + r * D * elem, *s = sin + r * D * elem;
        for (int64_t h = 0; h < heads; ++h) {
            char *p = x + (r * x_row + h * D) * elem;
            LANES(i, half, {
                const v16 a = LOAD(p, i), b = LOAD(p, i + half);
                const v16 lo = vround(a * LOAD(c, i), dtype) + vround(-b * LOAD(s, i), dtype);
                const v16 hi = vround(b * LOAD(c, i + half), dtype) + vround(a * LOAD(s, i + half), dtype);
                STORE(p, i, lo);
                STORE(p, i + half, hi);
            });
        }
    }
}

int astrai_rotary(void *x, int64_t x_row, const void *cos, const void *sin, int64_t rows, int64_t heads, int64_t D,
                  int dtype, int num_threads) {
    if (!dtype_supported(dtype) || D % 2) return 2;
    if (dtype == F32)
        rotary_impl(x, x_row, cos, sin, rows, heads, D, num_threads, F32);
    else if (dtype == BF16)
        rotary_impl(x, x_row, cos, sin, rows, heads, D, num_threads, BF16);
    else
        rotary_impl(x, x_row, cos, sin, rows, heads, D, num_threads, F16);
    return 0;
}

/* The gated MLP's activation (Shazeer 2020), as astrai's MLP.forward: out = round(round(act(gate)) * up), act =
 * SiLU, g / (1 + exp(-g)) (gelu == 0), or GELU's tanh form (gelu == 1), in float32 (torch's GELU computes
 * 1 + tanh(y) directly, so where it is far below 1 the two differ by torch's cancellation error, ~1e-7 |g|).
 * gate_up: (rows, 2 I) at row stride gu_row, gate the first I columns, up the last I; out: (rows, I) contiguous. */
static inline __attribute__((always_inline)) void gated_impl(const char *gu, int64_t gu_row, char *out, int64_t rows,
                                                              int64_t I, int gelu, int num_threads, const int dtype) {
    const int64_t elem = dtype == F32 ? 4 : 2;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows * I >= PARALLEL_ELEMENTS && num_threads > 1)
    for (int64_t r = 0; r < rows; ++r) {
        const char *g = gu + r * gu_row * elem, *u = g + I * elem;
        char *o = out + r * I * elem;
        if (gelu)
            LANES(i, I, { STORE(o, i, vround(vgelu(LOAD(g, i)), dtype) * LOAD(u, i)); });
        else
            LANES(i, I, { STORE(o, i, vround(vsilu(LOAD(g, i)), dtype) * LOAD(u, i)); });
    }
}

int astrai_gated_activation(const void *gate_up, int64_t gu_row, void *out, int64_t rows, int64_t I, int gelu,
                            int dtype, int num_threads) {
    if (!dtype_supported(dtype)) return 2;
    if (dtype == F32)
        gated_impl(gate_up, gu_row, out, rows, I, gelu, num_threads, F32);
    else if (dtype == BF16)
        gated_impl(gate_up, gu_row, out, rows, I, gelu, num_threads, BF16);
    else
        gated_impl(gate_up, gu_row, out, rows, I, gelu, num_threads, F16);
    return 0;
}

/* One decode step's keys and values of one layer stored in both caches at once: the paged cache (the source of
 * truth: token b's (Nkv, D) key at slot slots[b]) and `DenseDecodeCache`'s copies in the kernel's layout (row b,
 * position positions[b]: keys (B, Nkv, D, cap) transposed, values (B, Nkv, cap, D)). k, v: (B, Nkv, D) at row
 * strides k_row, v_row (elements), head stride D; pages (slots, Nkv, D) contiguous; all of one dtype (copied
 * bit for bit). */
int astrai_store_kv(const void *k, int64_t k_row, const void *v, int64_t v_row, const int64_t *slots,
                    void *k_pages, void *v_pages, const int64_t *positions, void *dense_keys, void *dense_values,
                    int64_t B, int64_t Nkv, int64_t D, int64_t cap, int dtype) {
    if (!dtype_supported(dtype)) return 2;
    const int64_t elem = dtype == F32 ? 4 : 2, head = D * elem;
    for (int64_t b = 0; b < B; ++b) {
        const char *kb = (const char *)k + b * k_row * elem, *vb = (const char *)v + b * v_row * elem;
        memcpy((char *)k_pages + slots[b] * Nkv * head, kb, (size_t)(Nkv * head));
        memcpy((char *)v_pages + slots[b] * Nkv * head, vb, (size_t)(Nkv * head));
        const int64_t pos = positions[b];
        for (int64_t h = 0; h < Nkv; ++h) {
            memcpy((char *)dense_values + (((b * Nkv + h) * cap + pos) * D) * elem, vb + h * head, (size_t)head);
            char *kt = (char *)dense_keys + ((b * Nkv + h) * D * cap + pos) * elem;
            const char *src = kb + h * head;
            if (elem == 4)
                for (int64_t d = 0; d < D; ++d) memcpy(kt + d * cap * 4, src + d * 4, 4);
            else
                for (int64_t d = 0; d < D; ++d) memcpy(kt + d * cap * 2, src + d * 2, 2);
        }
    }
    return 0;
}

typedef double v16d __attribute__((vector_size(128)));
#define LANE_INDEX ((v16i){0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15})

/* The sampler's first pass over one step's logits (`astrai.rollout.row_sampling.sample_rows`), one row per task:
 * maxes[r] = max_i scaled[r, i]; probs[r, i] = exp(scaled[r, i] - maxes[r]) (float32; columns V .. C * chunk
 * zeroed); chunk_mass[r, c] = the float64 sum of probs[r, c * chunk .. (c + 1) * chunk). scaled: (R, V) float32 at
 * row stride s_row; probs: (R, C * chunk) contiguous float32; chunk_mass: (R, C) float64; chunk a multiple of 16.
 * A row whose max is not finite (a NaN anywhere counts) gets its max written and nothing else (the caller
 * raises). exp of a difference below -87 is 0 (a -inf logit is never drawn). */
int astrai_softmax_chunks(const float *scaled, int64_t s_row, int64_t R, int64_t V, int64_t chunk, float *probs,
                          double *chunk_mass, float *maxes, int num_threads) {
    if (chunk % 16) return 2;
    const int dtype = F32;
    const int64_t C = (V + chunk - 1) / chunk;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (R * V >= PARALLEL_ELEMENTS && num_threads > 1)
    for (int64_t r = 0; r < R; ++r) {
        const char *x = (const char *)(scaled + r * s_row);
        float *p = probs + r * C * chunk;
        v16 top = (v16){0} - INFINITY;
        LANES(i, V, {
            const v16 v = _w == 16 ? vget(x, i, F32) : vselect(LANE_INDEX < (int32_t)_w,
                                                              vget_n(x, i, _w, F32), (v16){0} - INFINITY);
            top = vselect((v > top) | (v != v), v, top);  /* a NaN wins, so the caller sees it in the max */
        });
        float m = top[0];
        for (int k = 1; k < 16; ++k) m = (top[k] > m || top[k] != top[k]) ? top[k] : m;
        maxes[r] = m;
        if (!isfinite(m)) continue;
        for (int64_t c = 0; c < C; ++c) {
            const int64_t start = c * chunk, n = (start + chunk <= V ? chunk : V - start);
            v16d acc = {0};
            LANES(i, n, {
                const v16 d = LOAD(x, start + i) - m;
                const v16 e = vselect(d < -87.0f, (v16){0}, vexp(d));  /* exp below -87 (and of -inf) is 0 */
                const v16 kept = _w == 16 ? e : vselect(LANE_INDEX < (int32_t)_w, e, (v16){0});
                memcpy(p + start + i, &kept, sizeof kept);  /* past n: zeros, inside the row's padded width */
                acc += __builtin_convertvector(kept, v16d);
            });
            for (int64_t i = start + n + ((n % 16) ? 16 - n % 16 : 0); i < start + chunk; ++i) p[i] = 0.0f;
            double total = 0.0;
            for (int k = 0; k < 16; ++k) total += acc[k];
            chunk_mass[r * C + c] = total;
        }
    }
    return 0;
}
