/* What the C sources of astrai's CPU kernel library share (cpu_attention.c, cpu_elementwise.c, cpu_gemv.c,
 * cpu_decode.c): the dtype codes of `cpu_kernels.DTYPE_CODES`, whether this compiler has float16, the 16-lane vector
 * types (GCC vector extension: AVX-512, AVX2 or SSE code as -march allows, loaded and stored unaligned), the load
 * of 16 elements or one as float32, and the rounded store of one.
 * Written for astrai. `cpu_kernels` hashes this header into the library's cache key with the sources. */

#ifndef ASTRAI_CPU_COMMON_H
#define ASTRAI_CPU_COMMON_H

#include <stdint.h>
#include <string.h>

enum { F32 = 0, BF16 = 1, F16 = 2 };

#if defined(__FLT16_MAX__)
#define HAVE_F16 1
#else
#define HAVE_F16 0
#endif

/* 1 when the library reads `dtype` (float32 and bfloat16 always, float16 where the compiler has _Float16). */
static inline int dtype_supported(int dtype) { return dtype == F32 || dtype == BF16 || (dtype == F16 && HAVE_F16); }

typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef uint16_t v16u16 __attribute__((vector_size(32), aligned(2)));
typedef uint32_t v16u32 __attribute__((vector_size(64)));
#if HAVE_F16
typedef _Float16 v16f16 __attribute__((vector_size(32), aligned(2)));
#endif

/* The 16 elements at p (of dtype, a compile-time constant where inlined) as float32 (bfloat16 and float16 convert
 * exactly). */
static inline __attribute__((always_inline)) v16 load16(const char *p, const int dtype) {
    v16 x;
    if (dtype == F32) {
        memcpy(&x, p, sizeof x);
    } else if (dtype == BF16) {
        v16u16 h;
        memcpy(&h, p, sizeof h);
        const v16u32 bits = __builtin_convertvector(h, v16u32) << 16;
        memcpy(&x, &bits, sizeof x);
    } else {
#if HAVE_F16
        v16f16 h;
        memcpy(&h, p, sizeof h);
        x = __builtin_convertvector(h, v16);
#else
        memset(&x, 0, sizeof x);
#endif
    }
    return x;
}

/* The element at p (of dtype) as float32. */
static inline __attribute__((always_inline)) float load1(const char *p, const int dtype) {
    if (dtype == F32) {
        float f;
        memcpy(&f, p, sizeof f);
        return f;
    }
    if (dtype == BF16) {
        uint16_t h;
        memcpy(&h, p, sizeof h);
        const uint32_t bits = (uint32_t)h << 16;
        float f;
        memcpy(&f, &bits, sizeof f);
        return f;
    }
#if HAVE_F16
    _Float16 h;
    memcpy(&h, p, sizeof h);
    return (float)h;
#else
    return 0.0f;
#endif
}

/* x rounded to dtype (nearest, ties to even; NaN kept NaN) and stored at p. */
static inline __attribute__((always_inline)) void store1(char *p, float x, const int dtype) {
    if (dtype == F32) {
        memcpy(p, &x, sizeof x);
    } else if (dtype == BF16) {
        uint32_t bits;
        memcpy(&bits, &x, sizeof bits);
        const uint16_t h = (bits & 0x7fffffffu) > 0x7f800000u
                               ? (uint16_t)((bits >> 16) | 0x40u)
                               : (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
        memcpy(p, &h, sizeof h);
    } else {
#if HAVE_F16
        const _Float16 h = (_Float16)x;
        memcpy(p, &h, sizeof h);
#endif
    }
}

#endif
