/* 16 floats handled as one value, for the C kernels built on the learner's machine (`native.py`).

   `vec` uses GCC and Clang vector extensions: the compiler turns each operation on it into this CPU's
   vector instructions (-march=native): one AVX-512 register, two AVX2 registers, four NEON registers.
   float32 or bfloat16 in memory, float32 in registers. */
#ifndef MINILLM_VEC16_H
#define MINILLM_VEC16_H

#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

typedef float vec __attribute__((vector_size(64)));
typedef int32_t ivec __attribute__((vector_size(64)));

static inline vec splat(float x) { return (vec){0} + x; }

static inline float hsum(vec x) {
    float s = 0.0f;
    for (int i = 0; i < 16; i++) s += x[i];
    return s;
}

static inline vec load_vec(const void *p, int bf16) {        /* 16 numbers; bfloat16 widened to float32 */
    vec x;
    if (!bf16) {
        memcpy(&x, p, sizeof x);
        return x;
    }
    uint16_t h[16];
    int32_t w[16];
    memcpy(h, p, sizeof h);
    for (int i = 0; i < 16; i++) w[i] = (int32_t)h[i] << 16;
    memcpy(&x, w, sizeof x);
    return x;
}

/* 16 bytes -> 16 int32, zero-extended (u8) or sign-extended (i8). GCC 12 turns the one-line vector
   conversion into 16 scalar moves, so x86 gets its widening instruction by name; other CPUs the loop. */
static inline ivec load_u8(const void *p) {
    ivec r;
#if defined(__AVX512F__)
    __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    memcpy(&r, &v, 64);
#elif defined(__AVX2__)
    __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)((const char *)p + 8)));
    memcpy(&r, &a, 32);
    memcpy((char *)&r + 32, &b, 32);
#else
    for (int i = 0; i < 16; i++) r[i] = ((const uint8_t *)p)[i];
#endif
    return r;
}

static inline ivec load_i8(const void *p) {
    ivec r;
#if defined(__AVX512F__)
    __m512i v = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p));
    memcpy(&r, &v, 64);
#elif defined(__AVX2__)
    __m256i a = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p));
    __m256i b = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((const char *)p + 8)));
    memcpy(&r, &a, 32);
    memcpy((char *)&r + 32, &b, 32);
#else
    for (int i = 0; i < 16; i++) r[i] = ((const int8_t *)p)[i];
#endif
    return r;
}

static inline uint16_t float_to_bf16(float f) {             /* round to nearest, ties to even (as torch) */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);   /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline void store_float(void *base, int64_t i, float v, int bf16) {   /* base[i] = v, as float32 or bfloat16 */
    if (bf16) ((uint16_t *)base)[i] = float_to_bf16(v);
    else ((float *)base)[i] = v;
}

#endif
