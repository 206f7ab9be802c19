/* Decode attention on CPU over the dense per-row copies of `DenseDecodeCache` (decode_cache.py), in float32.
 *
 * Built at first use by `astrai.kernels.cpu_kernels` (the C compiler with -O3 -march=native -fopenmp, linked
 * against the OpenMP runtime torch already loaded); that module says why and when. Written for astrai; the exp
 * polynomial's coefficients are Cephes' (S. Moshier, Cephes Math Library, public domain), the code is not.
 *
 * One call is one layer of one decode step:
 *   q:      (B, Nh, D), row stride q_row elements, head stride D, last dim contiguous
 *   keys:   (B, Nkv, D, cap) contiguous (transposed: each (row, kv head, d) holds its positions contiguously)
 *   values: (B, Nkv, cap, D) contiguous
 *   lens:   (B,) int32, row b's keys are positions [0, lens[b]) (this step's own key already appended)
 *   out:    (B, Nh, D) contiguous float32
 * q, keys and values share one dtype: 0 float32, 1 bfloat16, 2 float16 (bfloat16 / float16 convert exactly).
 * Query head h uses kv head h / G, G = Nh / Nkv. Row b attends to positions [start, n), n = lens[b], start =
 * n - window when 0 < window < n. Scores s = scale * q.k (the sum over d in order), soft-capped as
 * softcap * tanh(s / softcap) when softcap > 0, a softmax, and the probability-weighted sum of values, all in
 * float32. One (row, kv head) pair is one task of one thread, so the result does not depend on the thread count.
 * Returns 0; 1 when a buffer could not be allocated; 2 for a dtype this build does not support.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_common.h"

/* 1 when this build runs its tasks on OpenMP threads (else it would use one thread). */
int astrai_cpu_attention_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* 1 when this build reads `dtype`. */
int astrai_cpu_attention_supports(int dtype) { return dtype_supported(dtype); }

#ifndef PREFETCH
#define PREFETCH 64
#endif

/* exp(x) for x <= 0 in plain arithmetic, so that the softmax loop vectorizes (the C library's expf is a scalar
 * call): x = n ln2 + r with |r| <= ln2 / 2 (Cody-Waite, ln2 in two parts), exp(r) by Cephes' degree-6 expf
 * polynomial, times 2^n built in the exponent bits; within 2 ulp of expf. x below -87 is clamped to -87 (the result
 * is then ~1.6e-38 instead of a smaller number, beside a softmax total >= 1). */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float n = floorf(x * 1.44269504088896341f + 0.5f);
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const float y = p * r * r + r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return y * two_n;
}

/* In place: s[0..len) -> softmax(s), len >= 1. */
static inline void softmax(float *restrict s, int64_t len) {
    float top = s[0], total = 0.0f;
#pragma omp simd reduction(max : top)
    for (int64_t i = 0; i < len; ++i) top = s[i] > top ? s[i] : top;
#pragma omp simd reduction(+ : total)
    for (int64_t i = 0; i < len; ++i) {
        s[i] = exp_nonpositive(s[i] - top);
        total += s[i];
    }
    const float inv = 1.0f / total;
#pragma omp simd
    for (int64_t i = 0; i < len; ++i) s[i] *= inv;
}

/* Scores of NG (<= 4) queries qf[0..NG) (rows of D floats) against the keys of positions [t0, t0 + 32) of a
 * transposed key matrix k (rows of cap elements): two 16-position tiles at once, so 2 NG independent sums over d. */
static inline __attribute__((always_inline)) void scores_32(const float *restrict qf, const char *k, int64_t D,
                                                             int64_t cap, int64_t t0, const int dtype, const int NG,
                                                             float *restrict s, int64_t stride) {
    const int64_t elem = dtype == F32 ? 4 : 2;
    v16 lo[4] = {{0}}, hi[4] = {{0}};
    for (int64_t d = 0; d < D; ++d) {
        const v16 a = load16(k + (d * cap + t0) * elem, dtype), c = load16(k + (d * cap + t0 + 16) * elem, dtype);
        __builtin_prefetch(k + (d * cap + t0 + PREFETCH) * elem);  /* 64 row streams: help the prefetcher */
        for (int g = 0; g < NG; ++g) {
            lo[g] += qf[g * D + d] * a;
            hi[g] += qf[g * D + d] * c;
        }
    }
    for (int g = 0; g < NG; ++g) {
        memcpy(s + g * stride + t0, &lo[g], sizeof(v16));
        memcpy(s + g * stride + t0 + 16, &hi[g], sizeof(v16));
    }
}

/* o[g][d0, d0 + 64) = sum over t < len of p[g][t] * v[t][d0, d0 + 64) for NG (<= 4) queries: 4 NG independent sums. */
static inline __attribute__((always_inline)) void values_64(const float *restrict p, int64_t stride, const char *v,
                                                            int64_t D, int64_t len, int64_t d0, const int dtype,
                                                            const int NG, float *restrict o) {
    const int64_t elem = dtype == F32 ? 4 : 2;
    v16 acc[4][4] = {{{0}}};
    for (int64_t t = 0; t < len; ++t) {
        const char *row = v + (t * D + d0) * elem;
        const v16 x0 = load16(row, dtype), x1 = load16(row + 16 * elem, dtype), x2 = load16(row + 32 * elem, dtype),
                  x3 = load16(row + 48 * elem, dtype);
        for (int g = 0; g < NG; ++g) {
            const float w = p[g * stride + t];
            acc[g][0] += w * x0;
            acc[g][1] += w * x1;
            acc[g][2] += w * x2;
            acc[g][3] += w * x3;
        }
    }
    for (int g = 0; g < NG; ++g) memcpy(o + g * D + d0, acc[g], sizeof acc[g]);
}

#define FOR_NG(NG_RUNTIME, CALL)           \
    switch (NG_RUNTIME) {                  \
        case 1: CALL(1); break;            \
        case 2: CALL(2); break;            \
        case 3: CALL(3); break;            \
        default: CALL(4); break;           \
    }

/* One task: row b, kv head h, for a compile-time dtype. buf: G * (cap + 32) + G * D floats.
 * Scores are computed 32 positions at a time (a tile that would read past the buffer's capacity takes its last
 * positions one by one), values 64 dims at a time (the last D % 64 dims one by one); queries in groups of 4. */
static inline __attribute__((always_inline)) void attend_impl(
    const char *q, int64_t q_row, const char *keys, const char *values, int64_t n, int64_t b, int64_t h,
    int64_t Nh, int64_t Nkv, int64_t D, int64_t cap, const int dtype, float scale, int64_t window, float softcap,
    float *restrict out, float *restrict buf) {
    const int64_t elem = dtype == F32 ? 4 : 2, G = Nh / Nkv;
    const int64_t start = (window > 0 && n > window) ? n - window : 0, len = n - start, stride = len + 32;
    float *restrict scores = buf, *restrict qf = buf + G * stride;
    for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d) qf[g * D + d] = load1(q + (b * q_row + (h * G + g) * D + d) * elem, dtype);
    const char *k = keys + ((b * Nkv + h) * D * cap + start) * elem;
    for (int64_t g0 = 0; g0 < G; g0 += 4) {
        const int64_t ng = G - g0 < 4 ? G - g0 : 4;
        int64_t t0 = 0;
        for (; t0 < len && start + t0 + 32 <= cap; t0 += 32) {  /* lanes past len: never used */
#define SCORES(NG) scores_32(qf + g0 * D, k, D, cap, t0, dtype, NG, scores + g0 * stride, stride)
            FOR_NG(ng, SCORES)
#undef SCORES
        }
        for (int64_t g = g0; g < g0 + ng; ++g)
            for (int64_t t = t0; t < len; ++t) {
                float acc = 0.0f;
                for (int64_t d = 0; d < D; ++d) acc += qf[g * D + d] * load1(k + (d * cap + t) * elem, dtype);
                scores[g * stride + t] = acc;
            }
    }
    for (int64_t g = 0; g < G; ++g) {
        float *restrict s = scores + g * stride;
        if (softcap > 0.0f) {
            for (int64_t t = 0; t < len; ++t) s[t] = softcap * tanhf(s[t] * scale / softcap);
        } else {
#pragma omp simd
            for (int64_t t = 0; t < len; ++t) s[t] *= scale;
        }
        softmax(s, len);
    }
    const char *v = values + ((b * Nkv + h) * cap + start) * D * elem;
    float *restrict o = out + (b * Nh + h * G) * D;
    for (int64_t g0 = 0; g0 < G; g0 += 4) {
        const int64_t ng = G - g0 < 4 ? G - g0 : 4;
        int64_t d0 = 0;
        for (; d0 + 64 <= D; d0 += 64) {
#define VALUES(NG) values_64(scores + g0 * stride, stride, v, D, len, d0, dtype, NG, o + g0 * D)
            FOR_NG(ng, VALUES)
#undef VALUES
        }
        for (int64_t g = g0; g < g0 + ng; ++g)
            for (int64_t d = d0; d < D; ++d) {
                float acc = 0.0f;
                for (int64_t t = 0; t < len; ++t) acc += scores[g * stride + t] * load1(v + (t * D + d) * elem, dtype);
                o[g * D + d] = acc;
            }
    }
}

static void attend(const char *q, int64_t q_row, const char *keys, const char *values, int64_t n, int64_t b,
                   int64_t h, int64_t Nh, int64_t Nkv, int64_t D, int64_t cap, int dtype, float scale,
                   int64_t window, float softcap, float *restrict out, float *restrict buf) {
    if (dtype == F32)
        attend_impl(q, q_row, keys, values, n, b, h, Nh, Nkv, D, cap, F32, scale, window, softcap, out, buf);
    else if (dtype == BF16)
        attend_impl(q, q_row, keys, values, n, b, h, Nh, Nkv, D, cap, BF16, scale, window, softcap, out, buf);
    else
        attend_impl(q, q_row, keys, values, n, b, h, Nh, Nkv, D, cap, F16, scale, window, softcap, out, buf);
}

int astrai_dense_decode_attention(const void *q, int64_t q_row, const void *keys, const void *values,
                                  const int32_t *lens, int64_t B, int64_t Nh, int64_t Nkv, int64_t D, int64_t cap,
                                  int dtype, float scale, int64_t window, float softcap, float *out,
                                  int num_threads) {
    if (!astrai_cpu_attention_supports(dtype)) return 2;
    const int64_t G = Nh / Nkv;
    int failed = 0;
#pragma omp parallel num_threads(num_threads > 0 ? num_threads : 1) reduction(| : failed)
    {
        float *buf = (float *)malloc(sizeof(float) * (size_t)(G * (cap + 32) + G * D));
        failed = buf == NULL;
#pragma omp for schedule(static)
        for (int64_t task = 0; task < B * Nkv; ++task)
            if (buf != NULL)
                attend((const char *)q, q_row, (const char *)keys, (const char *)values, lens[task / Nkv],
                       task / Nkv, task % Nkv, Nh, Nkv, D, cap, dtype, scale, window, softcap, out, buf);
        free(buf);
    }
    return failed;
}
