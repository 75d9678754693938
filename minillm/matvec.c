/* A decode step's matrix products at the speed of memory: y (M, N) = x (M, K) @ W (N, K)^T for a few rows.

   With one row of x, each weight is used once: the product can only be as fast as W streams from memory.
   A general matrix-multiply library tiles for reuse that one row does not have, and on some CPUs its
   one-row path streams at a fraction of the machine's copy bandwidth (notebook 14 measures it). This loop
   does the obvious thing: each thread takes a slice of W's rows, reads each weight row once from start to
   end, and multiplies it with every row of x while it is in cache. Four weight rows go together, so each
   piece of x loaded serves four of them.

   `vec` (vec16.h) is 16 floats handled as one value, compiled to this CPU's vector instructions. x and y
   are float32 or bfloat16 (widened to float32 as they are read); sums are float32. W is one of
     matvec        float32 or bfloat16, x's dtype
     matvec_int8   int8 codes with one float32 scale per row: w = q * scale (the quantized output head)
     matvec_q4_1   llama.cpp's Q4_1 blocks of 32 weights (4-bit codes q, two float16 d and m per block,
                   w = q * d + m), the file's values re-laid out in tiles of 16 rows (see tile_q4_1).
                   Codes widen to floats in registers; no bfloat16 round trip.
   K must be a multiple of 16 (of 32 for Q4_1). Built at first use by `native.py`. */
#include <stdlib.h>
#include "vec16.h"

#define ROWS 4       /* weight rows per step of the inner loop */
#define MAX_M 8      /* rows of x per call */
#define MAX_GROUPS 1024   /* Q4_1 blocks per row: K <= 32768 */

static inline float half_to_float(uint16_t h) {            /* IEEE float16 -> float32 */
#ifdef __FLT16_MAX__
    _Float16 f;
    memcpy(&f, &h, 2);
    return (float)f;
#else                                                         /* finite values: move the bits, rescale */
    uint32_t u = (uint32_t)(h & 0x7fff) << 13;
    float f;
    memcpy(&f, &u, 4);
    f *= 0x1p112f;                                            /* exponent bias 15 -> 127, subnormals too */
    return (h & 0x8000) ? -f : f;
#endif
}

/* rows [r0, r0 + n) of W against the m rows of x (K = KV * 16). */
static inline __attribute__((always_inline)) void
block(const char *x, const char *w, char *y, int m, int64_t N, int KV, int64_t r0, int n, int bf16) {
    const int es = bf16 ? 2 : 4;
    const int64_t row_bytes = (int64_t)KV * 16 * es;
    vec acc[MAX_M][ROWS];
    for (int i = 0; i < m; i++)
        for (int r = 0; r < ROWS; r++) acc[i][r] = (vec){0};
    for (int c = 0; c < KV; c++) {
        vec wv[ROWS];
        for (int r = 0; r < n; r++) {
            const char *p = w + (r0 + r) * row_bytes + (int64_t)c * 16 * es;
            wv[r] = load_vec(p, bf16);
        }
        for (int i = 0; i < m; i++) {
            vec xv = load_vec(x + ((int64_t)i * KV + c) * 16 * es, bf16);
            for (int r = 0; r < n; r++) acc[i][r] += wv[r] * xv;
        }
    }
    for (int i = 0; i < m; i++)
        for (int r = 0; r < n; r++) store_float(y, (int64_t)i * N + r0 + r, hsum(acc[i][r]), bf16);
}

/* Returns 0, or -1 when the shapes are past its limits (the caller checks first). */
int matvec(const void *x, const void *w, void *y, int m, int64_t N, int K, int bf16, int threads) {
    if (m < 1 || m > MAX_M || K % 16 != 0) return -1;
    int KV = K / 16;
    int64_t blocks = (N + ROWS - 1) / ROWS;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t b = 0; b < blocks; b++) {
        int64_t r0 = b * ROWS;
        int n = N - r0 < ROWS ? (int)(N - r0) : ROWS;
        if (n == ROWS) block((const char *)x, (const char *)w, (char *)y, m, N, KV, r0, ROWS, bf16);
        else block((const char *)x, (const char *)w, (char *)y, m, N, KV, r0, n, bf16);
    }
    return 0;
}

/* rows [r0, r0 + n) of int8 W (N, K) against the m rows of x: y = scale * (q . x). */
static inline __attribute__((always_inline)) void
block_int8(const char *x, const int8_t *w, const float *scale, char *y, int m, int64_t N, int KV, int64_t r0,
           int n, int bf16) {
    const int es = bf16 ? 2 : 4;
    vec acc[MAX_M][ROWS];
    for (int i = 0; i < m; i++)
        for (int r = 0; r < ROWS; r++) acc[i][r] = (vec){0};
    for (int c = 0; c < KV; c++) {
        vec wv[ROWS];
        for (int r = 0; r < n; r++) {
            const int8_t *p = w + ((r0 + r) * KV + c) * 16;
            if (c % 4 == 0) __builtin_prefetch(p + (int64_t)ROWS * KV * 16);   /* the next block's row */
            wv[r] = __builtin_convertvector(load_i8(p), vec);
        }
        for (int i = 0; i < m; i++) {
            vec xv = load_vec(x + ((int64_t)i * KV + c) * 16 * es, bf16);
            for (int r = 0; r < n; r++) acc[i][r] += wv[r] * xv;
        }
    }
    for (int i = 0; i < m; i++)
        for (int r = 0; r < n; r++) store_float(y, (int64_t)i * N + r0 + r, hsum(acc[i][r]) * scale[r0 + r], bf16);
}

int matvec_int8(const void *x, const int8_t *w, const float *scale, void *y, int m, int64_t N, int K, int bf16,
                int threads) {
    if (m < 1 || m > MAX_M || K % 16 != 0) return -1;
    int KV = K / 16;
    int64_t blocks = (N + ROWS - 1) / ROWS;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t b = 0; b < blocks; b++) {
        int64_t r0 = b * ROWS;
        int n = N - r0 < ROWS ? (int)(N - r0) : ROWS;
        if (n == ROWS) block_int8((const char *)x, w, scale, (char *)y, m, N, KV, r0, ROWS, bf16);
        else block_int8((const char *)x, w, scale, (char *)y, m, N, KV, r0, n, bf16);
    }
    return 0;
}

/* Q4_1 weights as this loop reads them, in tiles of 16 rows (`matvec.q4_tiles` lays them out): for tile t and
   block g, 256 bytes codes[t][g][p][r], row r's weights 2p (low nibble) and 2p + 1 (high nibble) of the block,
   then d[t][g][r] and m[t][g][r] (float16). One 16-byte load gives two columns of 16 rows: one vector each,
   multiplied by one number of x. Per block: y_r += d_r (q_r . x) + m_r sum(x), 16 rows at once. */
static inline vec load_half16(const uint16_t *p) {          /* 16 float16 -> 16 floats */
    vec r;
#if defined(__AVX512F__)
    __m512 v = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
    memcpy(&r, &v, 64);
#elif defined(__F16C__)
    __m256 a = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    __m256 b = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 8)));
    memcpy(&r, &a, 32);
    memcpy((char *)&r + 32, &b, 32);
#else
    for (int i = 0; i < 16; i++) r[i] = half_to_float(p[i]);
#endif
    return r;
}

#define PREFETCH 2048   /* bytes: eight blocks of a tile ahead (the best of 512 to 4096 on an AVX-512 EPYC) */

static inline __attribute__((always_inline)) void
tile_q4_1(const float *x, const float *xsum, const uint8_t *codes, const uint16_t *d, const uint16_t *mn, char *y,
          int m, int64_t N, int K, int64_t t, int bf16) {
    const int G = K / 32;
    vec total[MAX_M];
    for (int i = 0; i < m; i++) total[i] = (vec){0};
    for (int g = 0; g < G; g++) {
        const uint8_t *c = codes + (t * G + g) * 256;
        vec even[MAX_M], odd[MAX_M];                          /* two sums: two chains of additions */
        for (int i = 0; i < m; i++) even[i] = odd[i] = (vec){0};
        for (int p = 0; p < 16; p++) {
            if (p % 4 == 0) __builtin_prefetch(c + PREFETCH + p * 16);   /* ask for memory ahead of use */
            ivec v = load_u8(c + p * 16);
            vec w0 = __builtin_convertvector(v & 15, vec), w1 = __builtin_convertvector(v >> 4, vec);
            for (int i = 0; i < m; i++) {
                const float *xi = x + (int64_t)i * K + g * 32 + 2 * p;
                even[i] += w0 * xi[0];
                odd[i] += w1 * xi[1];
            }
        }
        vec dv = load_half16(d + (t * G + g) * 16), mv = load_half16(mn + (t * G + g) * 16);
        for (int i = 0; i < m; i++) total[i] += (even[i] + odd[i]) * dv + mv * xsum[i * G + g];
    }
    for (int i = 0; i < m; i++)
        for (int r = 0; r < 16; r++) store_float(y, (int64_t)i * N + t * 16 + r, total[i][r], bf16);
}

int matvec_q4_1(const void *x, const uint8_t *codes, const uint16_t *d, const uint16_t *mn, void *y, int m,
                int64_t N, int K, int bf16, int threads) {
    if (m < 1 || m > MAX_M || K % 32 != 0 || N % 16 != 0 || K > 32 * MAX_GROUPS) return -1;
    int G = K / 32;
    const int es = bf16 ? 2 : 4;
    float xsum[MAX_M * MAX_GROUPS];
    float *xf = malloc(sizeof(float) * m * K);                  /* x in float32 */
    if (!xf) return -1;
    for (int i = 0; i < m; i++)
        for (int g = 0; g < G; g++) {
            const char *xg = (const char *)x + ((int64_t)i * G + g) * 32 * es;
            vec lo = load_vec(xg, bf16), hi = load_vec(xg + 16 * es, bf16);
            memcpy(xf + (int64_t)i * K + g * 32, &lo, 64);
            memcpy(xf + (int64_t)i * K + g * 32 + 16, &hi, 64);
            xsum[i * G + g] = hsum(lo + hi);
        }
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < N / 16; t++) {
        if (m == 1) tile_q4_1(xf, xsum, codes, d, mn, (char *)y, 1, N, K, t, bf16);
        else tile_q4_1(xf, xsum, codes, d, mn, (char *)y, m, N, K, t, bf16);
    }
    free(xf);
    return 0;
}
