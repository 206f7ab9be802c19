/* A few rows times a weight matrix, y = x W^T (+ b), for the engine's CPU decode steps of one to a few rows.
 *
 * Built into the same library as cpu_attention.c and cpu_elementwise.c by `astrai.kernels.cpu_kernels`. Written for
 * astrai. Why: at one row a decode step is a matrix-vector product per weight, bound by how fast the weights stream
 * from memory; oneDNN's prepacked products (`astrai.rollout.packed_linear`) read about 21 GB/s there on a 2-core AMD
 * EPYC whose float32 sum over as many bytes reads 28.6. This kernel reads the weights in their stored (out, in) layout.
 * One row: 12 weight rows per task at a time (12 independent sums: 4 and 8 rows streamed slower), times the input row.
 * Several rows (AVX-512): a register tile of 8 weight rows times 2 input rows (16 sums, each weight and input vector
 * loaded once for 8 or 2 products), over the input rows in pairs while the 8 weight rows stay in the cache; without
 * AVX-512 (16 vector registers) the one-row form runs row by row. SmolLM2-135M's 120 layer products of a decode
 * step, two threads, best of three (docs/kernels.md): one row 15.4 ms in float32 against oneDNN's 20.9 and 9.7 ms
 * in bfloat16 against 12.6; eight rows 22.9 / 20.8 and 15.6 / 15.8 (the row-by-row form took 27.0 / 17.0).
 *
 * Arithmetic: float32 products summed in float32, each output in 16 lanes over the width in order, the lanes summed
 * by one tree (`sum16x4`), the tail of the width (below 16 or 32) added one by one with fused multiply-adds: so an
 * output row is the same bits whatever the number of rows beside it, the tile or the one-row form, and the thread
 * count. The order differs from oneDNN's or MKL's (about 1e-6 relative in float32). The bias is added in float32 and
 * the result rounded once to the output dtype (as `F.linear` in bfloat16 rounds its float32 accumulator). bfloat16
 * on a CPU with AVX-512 BF16 uses its dot-product instruction (vdpbf16ps: exact products, float32 sums, input
 * subnormals read as zero).
 *
 * Layouts: x (M, K) with row stride x_row, last dim contiguous; W (N, K) contiguous; b (N,) or NULL; y (M, N)
 * contiguous. One dtype for all.
 */

#include <stdint.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define HAVE_DPBF16 1
#else
#define HAVE_DPBF16 0
#endif

#include "cpu_common.h"

/* Parallel only above this many multiply-adds: below it a fork/join of the team costs more than the work. */
#define PARALLEL_MACS 65536
/* Weight rows per task at one input row (independent sums: the loads of several rows in flight). */
#define ROWS_ONE 12
#if defined(__AVX512F__)
/* Several input rows: a tile of ROWS_MANY weight rows times TILE_M input rows (16 sums in 32 vector registers). */
#define ROWS_MANY 8
#define TILE_M 2
#else
#define ROWS_MANY 12
#define TILE_M 1
#endif
#define MAX_R 12 /* the larger of ROWS_ONE and ROWS_MANY */
#define MAX_M 2  /* TILE_M at most */

/* The sums of the 16 lanes of a, b, c and d into out[0..3], each by the same tree: lane i + lane i+8, then + i+4,
 * then (0 + 2) + (1 + 3). */
static inline __attribute__((always_inline)) void sum16x4(v16 a, v16 b, v16 c, v16 d, float *out) {
#if defined(__AVX512F__)
    const __m512 A = (__m512)a, B = (__m512)b, C = (__m512)c, D = (__m512)d;
    /* 128-bit quarters [a0 a1 b0 b1] + [a2 a3 b2 b3]: lanes i + i+8 of a and b */
    const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(A, B, 0x44), _mm512_shuffle_f32x4(A, B, 0xEE));
    const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(C, D, 0x44), _mm512_shuffle_f32x4(C, D, 0xEE));
    /* quarter j: the 4 partial sums (i + i+8) + (i+4 + i+12) of a, b, c, d */
    const __m512 g = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
    const __m512 p = _mm512_add_ps(g, _mm512_permute_ps(g, 0x4E)); /* element 0: g0 + g2, 1: g1 + g3 */
    const __m512 q = _mm512_add_ps(p, _mm512_permute_ps(p, 0xB1)); /* element 0: (g0 + g2) + (g1 + g3) */
    float t[16];
    _mm512_storeu_ps(t, q);
    out[0] = t[0], out[1] = t[4], out[2] = t[8], out[3] = t[12];
#else
    const v16 v[4] = {a, b, c, d};
    for (int j = 0; j < 4; j++) {
        float f[8], g[4];
        for (int i = 0; i < 8; i++) f[i] = v[j][i] + v[j][i + 8];
        for (int i = 0; i < 4; i++) g[i] = f[i] + f[i + 4];
        out[j] = (g[0] + g[2]) + (g[1] + g[3]);
    }
#endif
}

/* sums[m * MAX_R + r] = dot(x row m, W row n + r) for m < MB, r < nrows (R a multiple of 4, R and MB compile-time
 * constants where inlined; rows past nrows repeat the last one and are not stored). */
static inline __attribute__((always_inline)) void tile(const char *x, int64_t x_row, const char *W, int64_t n,
                                                       int64_t nrows, int64_t K, float *sums, const int R,
                                                       const int MB, const int dtype) {
    const int64_t es = dtype == F32 ? 4 : 2;
    const char *w[MAX_R];
#pragma GCC unroll 16
    for (int r = 0; r < R; r++) w[r] = W + es * (n + (r < nrows ? r : nrows - 1)) * K;
    v16 acc[MAX_M][MAX_R]; /* fixed sizes, fully unrolled loops: kept in registers */
#pragma GCC unroll 16
    for (int m = 0; m < MB; m++)
#pragma GCC unroll 16
        for (int r = 0; r < R; r++) acc[m][r] = (v16){0};
    int64_t k = 0;
#if HAVE_DPBF16
    if (dtype == BF16) {
        for (; k + 32 <= K; k += 32) {
            __m512bh wv[MAX_R];
#pragma GCC unroll 16
            for (int r = 0; r < R; r++) wv[r] = (__m512bh)_mm512_loadu_si512((const void *)(w[r] + 2 * k));
#pragma GCC unroll 16
            for (int m = 0; m < MB; m++) {
                const __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(x + 2 * (m * x_row + k)));
#pragma GCC unroll 16
                for (int r = 0; r < R; r++) acc[m][r] = (v16)_mm512_dpbf16_ps((__m512)acc[m][r], xv, wv[r]);
            }
        }
    }
#endif
    if (k == 0) {
        for (; k + 16 <= K; k += 16) {
            v16 wv[MAX_R];
#pragma GCC unroll 16
            for (int r = 0; r < R; r++) wv[r] = load16(w[r] + es * k, dtype);
#pragma GCC unroll 16
            for (int m = 0; m < MB; m++) {
                const v16 xv = load16(x + es * (m * x_row + k), dtype);
#pragma GCC unroll 16
                for (int r = 0; r < R; r++) acc[m][r] += xv * wv[r];
            }
        }
    }
#pragma GCC unroll 16
    for (int m = 0; m < MB; m++)
#pragma GCC unroll 16
        for (int r = 0; r < R; r += 4)
            sum16x4(acc[m][r], acc[m][r + 1], acc[m][r + 2], acc[m][r + 3], sums + m * MAX_R + r);
    for (; k < K; k++)
        for (int m = 0; m < MB; m++) {
            const float xk = load1(x + es * (m * x_row + k), dtype);
            for (int r = 0; r < R; r++)
                sums[m * MAX_R + r] = __builtin_fmaf(xk, load1(w[r] + es * k, dtype), sums[m * MAX_R + r]);
        }
}

static inline __attribute__((always_inline)) void gemv_impl(const char *x, int64_t x_row, int64_t M, const char *W,
                                                            const char *b, int64_t N, int64_t K, char *y,
                                                            int num_threads, const int dtype) {
    const int64_t es = dtype == F32 ? 4 : 2;
    const int64_t R = M == 1 ? ROWS_ONE : ROWS_MANY;
    const int64_t tasks = (N + R - 1) / R;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (M * N * K >= PARALLEL_MACS && num_threads > 1)
    for (int64_t t = 0; t < tasks; t++) {
        const int64_t n = t * R, nrows = N - n < R ? N - n : R;
        float sums[MAX_M * MAX_R];
        for (int64_t m = 0; m < M;) {
            const char *xm = x + es * m * x_row;
            int64_t mb = 1;
            if (M == 1)
                tile(xm, x_row, W, n, nrows, K, sums, ROWS_ONE, 1, dtype);
            else if (M - m >= TILE_M)
                tile(xm, x_row, W, n, nrows, K, sums, ROWS_MANY, TILE_M, dtype), mb = TILE_M;
            else
                tile(xm, x_row, W, n, nrows, K, sums, ROWS_MANY, 1, dtype);
            for (int64_t i = 0; i < mb; i++)
                for (int64_t r = 0; r < nrows; r++) {
                    const float s = sums[i * MAX_R + r];
                    store1(y + es * ((m + i) * N + n + r), b ? s + load1(b + es * (n + r), dtype) : s, dtype);
                }
            m += mb;
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
