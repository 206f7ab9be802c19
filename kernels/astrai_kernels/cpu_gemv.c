/* A few rows times a weight matrix, y = x W^T (+ b), for the engine's CPU decode steps of one or a few rows.
 *
 * Built into the same library as cpu_attention.c and cpu_elementwise.c by `astrai.kernels.cpu_kernels`. Written for
 * astrai. Why: at one row a decode step is a matrix-vector product per weight, bound by how fast the weights stream
 * from memory; oneDNN's prepacked products (`astrai.rollout.packed_linear`) read about 21 GB/s there on a 2-core AMD
 * EPYC whose float32 sum over as many bytes reads 28.6. This kernel reads each weight row once, in its stored (out,
 * in) layout, 12 rows at a time (12 independent sums: 4 and 8 rows streamed slower), and multiplies them by every
 * input row while they are in the cache. SmolLM2-135M's 120 layer products of a decode step, two threads, best of
 * three (docs/kernels.md): one row 15.4 ms in float32 against oneDNN's 20.9 and 9.7 ms in bfloat16 against 12.6;
 * two rows 16.8 / 21.6 and 10.0 / 12.2; four rows 19.8 / 17.6 and 11.8 / 10.6 (oneDNN ahead from here on).
 *
 * Arithmetic: float32 products summed in float32 (in an order of its own: results differ from oneDNN's or MKL's by
 * the sum's rounding, about 1e-6 relative in float32), the bias added in float32, the result rounded once to the
 * output dtype (as `F.linear` in bfloat16 rounds its float32 accumulator). bfloat16 on a CPU with AVX-512 BF16 uses
 * its dot-product instruction (vdpbf16ps: exact products, float32 sums, input subnormals read as zero).
 *
 * Layouts: x (M, K) with row stride x_row, last dim contiguous; W (N, K) contiguous; b (N,) or NULL; y (M, N)
 * contiguous. One dtype for all.
 */

#include <stdint.h>
#include <string.h>
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define HAVE_DPBF16 1
#else
#define HAVE_DPBF16 0
#endif

#include "cpu_common.h"

/* Parallel only above this many multiply-adds: below it a fork/join of the team costs more than the work. */
#define PARALLEL_MACS 65536
/* Weight rows per task, multiplied together (independent sums: the loads of several rows in flight). */
#define ROWS 12

static inline float hsum16(v16 a) {
    float s = 0.0f;
    for (int i = 0; i < 16; i++) s += a[i];
    return s;
}

/* sums[r] = dot(x row, W row n + r) for r < nrows (1 .. ROWS), float32 sums. */
static inline __attribute__((always_inline)) void dots(const char *x, const char *W, int64_t n, int64_t nrows,
                                                       int64_t K, float *sums, const int dtype) {
    const int64_t es = dtype == F32 ? 4 : 2;
    int64_t k = 0;
#if HAVE_DPBF16
    if (dtype == BF16) {
        __m512 acc[ROWS];
        for (int r = 0; r < ROWS; r++) acc[r] = _mm512_setzero_ps();
        for (; k + 32 <= K; k += 32) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(x + 2 * k));
            for (int r = 0; r < ROWS; r++)
                if (r < nrows)
                    acc[r] = _mm512_dpbf16_ps(acc[r], xv,
                                              (__m512bh)_mm512_loadu_si512((const void *)(W + ((n + r) * K + k) * 2)));
        }
        for (int r = 0; r < ROWS; r++) sums[r] = _mm512_reduce_add_ps(acc[r]);
    }
#endif
    if (k == 0) {
        v16 acc[ROWS];
        for (int r = 0; r < ROWS; r++) acc[r] = (v16){0};
        for (; k + 16 <= K; k += 16) {
            const v16 xv = load16(x + es * k, dtype);
            for (int r = 0; r < ROWS; r++)
                if (r < nrows) acc[r] += xv * load16(W + es * ((n + r) * K + k), dtype);
        }
        for (int r = 0; r < ROWS; r++) sums[r] = hsum16(acc[r]);
    }
    for (; k < K; k++) {
        const float xk = load1(x + es * k, dtype);
        for (int r = 0; r < nrows; r++) sums[r] += xk * load1(W + es * ((n + r) * K + k), dtype);
    }
}

static inline __attribute__((always_inline)) void gemv_impl(const char *x, int64_t x_row, int64_t M, const char *W,
                                                            const char *b, int64_t N, int64_t K, char *y,
                                                            int num_threads, const int dtype) {
    const int64_t es = dtype == F32 ? 4 : 2;
    const int64_t tasks = (N + ROWS - 1) / ROWS;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (M * N * K >= PARALLEL_MACS && num_threads > 1)
    for (int64_t t = 0; t < tasks; t++) {
        const int64_t n = t * ROWS, nrows = N - n < ROWS ? N - n : ROWS;
        for (int64_t m = 0; m < M; m++) {
            float sums[ROWS];
            dots(x + m * x_row * es, W, n, nrows, K, sums, dtype);
            for (int64_t r = 0; r < nrows; r++)
                store1(y + es * (m * N + n + r), b ? sums[r] + load1(b + es * (n + r), dtype) : sums[r], dtype);
        }
    }
}

/* y = x W^T + b as above; 0, or 2 for a dtype this library does not read. */
int astrai_gemv(const void *x, int64_t x_row, int64_t M, const void *W, const void *b, int64_t N, int64_t K, void *y,
                int dtype, int num_threads) {
    if (!dtype_supported(dtype)) return 2;
    if (dtype == F32)
        gemv_impl(x, x_row, M, W, b, N, K, y, num_threads, F32);
    else if (dtype == BF16)
        gemv_impl(x, x_row, M, W, b, N, K, y, num_threads, BF16);
    else
        gemv_impl(x, x_row, M, W, b, N, K, y, num_threads, F16);
    return 0;
}
