/* A vector of floats handled as one value, for the C kernels built on the learner's machine (`cbuild.py`).

   `vec` holds VL floats, as many as one register of this CPU takes (-march=native): 16 with AVX-512, 8 with
   AVX2, 4 otherwise (SSE, NEON). It uses GCC and Clang vector extensions: the compiler turns each operation
   on it into one vector instruction. A wider vec than the registers would be correct too, but GCC keeps
   such a value in memory between operations: the loops ran three times slower on an AVX2 EPYC with a
   16-float vec. The kernels are written for any VL; their data layouts (16 rows per 4-bit tile, head_dim a
   multiple of 16) do not depend on it. float32 or bfloat16 in memory, float32 in registers. */
#ifndef MINILLM_VEC_H
#define MINILLM_VEC_H

#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
#define VL 16
#elif defined(__AVX2__)
#define VL 8
#else
#define VL 4
#endif

typedef float vec __attribute__((vector_size(VL * 4)));
typedef int32_t ivec __attribute__((vector_size(VL * 4)));

static inline vec splat(float x) { return (vec){0} + x; }

static inline float hsum(vec x) {
    float s = 0.0f;
    for (int i = 0; i < VL; i++) s += x[i];
    return s;
}

static inline vec floats_at(const float *p) {                /* VL float32 numbers */
    vec v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline vec load_vec(const void *p, int bf16) {        /* VL numbers; bfloat16 widened to float32 */
    if (!bf16) return floats_at(p);
    vec x;
#if defined(__AVX512F__)
    __m512i w = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
    memcpy(&x, &w, sizeof x);
#elif defined(__AVX2__)
    __m256i w = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
    memcpy(&x, &w, sizeof x);
#else
    uint16_t h[VL];
    int32_t w[VL];
    memcpy(h, p, sizeof h);
    for (int i = 0; i < VL; i++) w[i] = (int32_t)h[i] << 16;
    memcpy(&x, w, sizeof x);
#endif
    return x;
}

/* VL bytes -> VL int32, zero-extended (u8) or sign-extended (i8). GCC 12 turns the one-line vector
   conversion into scalar moves, so x86 gets its widening instruction by name; other CPUs the loop. */
static inline ivec load_u8(const void *p) {
    ivec r;
#if defined(__AVX512F__)
    __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    memcpy(&r, &v, sizeof r);
#elif defined(__AVX2__)
    __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    memcpy(&r, &v, sizeof r);
#else
    for (int i = 0; i < VL; i++) r[i] = ((const uint8_t *)p)[i];
#endif
    return r;
}

static inline ivec load_i8(const void *p) {
    ivec r;
#if defined(__AVX512F__)
    __m512i v = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p));
    memcpy(&r, &v, sizeof r);
#elif defined(__AVX2__)
    __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p));
    memcpy(&r, &v, sizeof r);
#else
    for (int i = 0; i < VL; i++) r[i] = ((const int8_t *)p)[i];
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
