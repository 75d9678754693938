/* A decode step's matrix products at the speed of memory: y (M, N) = x (M, K) @ W (N, K)^T for a few rows.

   With one row of x, each weight is used once: the product can only be as fast as W streams from memory.
   A general matrix-multiply library tiles for reuse that one row does not have, and on some CPUs its
   one-row path streams at a fraction of the machine's copy bandwidth (notebook 14 measures it). This loop
   does the obvious thing: each thread takes a slice of W's rows, reads each weight row once from start to
   end, and multiplies it with every row of x while it is in cache.

   `vec` (vec.h) is VL floats handled as one value, one register of this CPU (VL = 16, 8 or 4). x and y
   are float32 or bfloat16 (widened to float32 as they are read); sums are float32. W is one of
     matvec        float32 or bfloat16, x's dtype
     matvec_int8   int8 codes with one float32 scale per row: w = q * scale (the quantized output head)
     matvec_q4_1   llama.cpp's Q4_1 blocks of 32 weights (4-bit codes q, two float16 d and m per block,
                   w = q * d + m), the file's values re-laid out in tiles of 16 rows (see tile_q4_1).
                   Codes widen to floats in registers; no bfloat16 round trip.
   K must be a multiple of 16 (of 32 for Q4_1). Built at first use by `cbuild.py`. */
#include <stdlib.h>
#include "../vec.h"

#define ROWS 4       /* weight rows a thread takes at a time */
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

/* x's m rows in float32, once per call, so the loops below read them as floats (bfloat16 x is widened). */
static float *float_rows(const void *x, int m, int K, int bf16) {
    float *xf = malloc(sizeof(float) * m * K);
    if (xf)
        for (int64_t j = 0; j < (int64_t)m * K; j += VL) {
            vec v = load_vec((const char *)x + j * (bf16 ? 2 : 4), bf16);
            memcpy(xf + j, &v, sizeof v);
        }
    return xf;
}

/* Weight rows [r0, r0 + n) against the m rows of x, one row at a time, each read from start to end (K = KV
   * VL). Reading four rows side by side, a column of 16 from each in turn, streamed at half the speed on an
   AVX-512 EPYC: memory serves one long run better than four short interleaved ones. Two sums per row of x
   keep two chains of additions going. `kind` 0: float32 W, 1: bfloat16 W, 2: int8 W times scale[row]. */
static inline __attribute__((always_inline)) vec weights_at(const char *row, int c, int kind) {   /* column c */
    if (kind == 2) return __builtin_convertvector(load_i8(row + c * VL), vec);
    return load_vec(row + c * VL * (kind == 0 ? 4 : 2), kind);
}

static inline __attribute__((always_inline)) void
rows_of(const float *x, const char *w, const float *scale, char *y, int m, int64_t N, int KV, int64_t r0,
        int n, int kind, int bf16_out) {
    const int es = kind == 0 ? 4 : kind == 1 ? 2 : 1;
    for (int r = 0; r < n; r++) {
        const char *p = w + (r0 + r) * (int64_t)KV * VL * es;
        vec acc[MAX_M][2];
        for (int i = 0; i < m; i++) acc[i][0] = acc[i][1] = (vec){0};
        int c = 0;
        for (; c + 2 <= KV; c += 2)
            for (int h = 0; h < 2; h++) {
                vec wv = weights_at(p, c + h, kind);
                for (int i = 0; i < m; i++) acc[i][h] += wv * floats_at(x + ((int64_t)i * KV + c + h) * VL);
            }
        if (c < KV) {
            vec wv = weights_at(p, c, kind);
            for (int i = 0; i < m; i++) acc[i][0] += wv * floats_at(x + ((int64_t)i * KV + c) * VL);
        }
        float s = kind == 2 ? scale[r0 + r] : 1.0f;
        for (int i = 0; i < m; i++)
            store_float(y, (int64_t)i * N + r0 + r, hsum(acc[i][0] + acc[i][1]) * s, bf16_out);
    }
}

static int rows_all(const void *x, const void *w, const float *scale, void *y, int m, int64_t N, int K, int kind,
                    int bf16, int threads) {
    if (m < 1 || m > MAX_M || K % 16 != 0) return -1;
    float *xf = float_rows(x, m, K, bf16);
    if (!xf) return -1;
    int KV = K / VL;
    int64_t blocks = (N + ROWS - 1) / ROWS;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t b = 0; b < blocks; b++) {
        int64_t r0 = b * ROWS;
        int n = N - r0 < ROWS ? (int)(N - r0) : ROWS;
        switch (kind * 2 + (m == 1)) {                           /* each case compiled on its own */
        case 0: rows_of(xf, w, scale, y, m, N, KV, r0, n, 0, bf16); break;
        case 1: rows_of(xf, w, scale, y, 1, N, KV, r0, n, 0, bf16); break;
        case 2: rows_of(xf, w, scale, y, m, N, KV, r0, n, 1, bf16); break;
        case 3: rows_of(xf, w, scale, y, 1, N, KV, r0, n, 1, bf16); break;
        case 4: rows_of(xf, w, scale, y, m, N, KV, r0, n, 2, bf16); break;
        default: rows_of(xf, w, scale, y, 1, N, KV, r0, n, 2, bf16);
        }
    }
    free(xf);
    return 0;
}

/* Returns 0, or -1 when the shapes are past its limits (the caller checks first). */
int matvec(const void *x, const void *w, void *y, int m, int64_t N, int K, int bf16, int threads) {
    return rows_all(x, w, NULL, y, m, N, K, bf16, bf16, threads);
}

/* int8 W (N, K) with one scale per row: y = scale * (q . x). */
int matvec_int8(const void *x, const int8_t *w, const float *scale, void *y, int m, int64_t N, int K, int bf16,
                int threads) {
    return rows_all(x, w, scale, y, m, N, K, 2, bf16, threads);
}

/* Q4_1 weights as this loop reads them, in tiles of 16 rows (`matvec.q4_tiles` lays them out): for tile t and
   block g, 256 bytes codes[t][g][p][r], row r's weights 2p (low nibble) and 2p + 1 (high nibble) of the block,
   then d[t][g][r] and m[t][g][r] (float16). One 16-byte load gives two columns of 16 rows, TV = 16 / VL
   vectors each, multiplied by one number of x. Per block: y_r += d_r (q_r . x) + m_r sum(x), 16 rows at once. */
#define TV (16 / VL)

static inline vec load_halves(const uint16_t *p) {          /* VL float16 -> VL floats */
    vec r;
#if defined(__AVX512F__)
    __m512 v = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
    memcpy(&r, &v, sizeof r);
#elif defined(__AVX2__) && defined(__F16C__)
    __m256 v = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    memcpy(&r, &v, sizeof r);
#elif VL == 4 && defined(__F16C__)
    __m128 v = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)p));
    memcpy(&r, &v, sizeof r);
#else
    for (int i = 0; i < VL; i++) r[i] = half_to_float(p[i]);
#endif
    return r;
}

#define PREFETCH 2048   /* bytes: eight blocks of a tile ahead (the best of 512 to 4096 on an AVX-512 EPYC) */

static inline __attribute__((always_inline)) void
tile_q4_1(const float *x, const float *xsum, const uint8_t *codes, const uint16_t *d, const uint16_t *mn, char *y,
          int m, int64_t N, int K, int64_t t, int bf16) {
    const int G = K / 32;
    vec total[MAX_M][TV];
    for (int i = 0; i < m; i++)
        for (int h = 0; h < TV; h++) total[i][h] = (vec){0};
    for (int g = 0; g < G; g++) {
        const uint8_t *c = codes + (t * G + g) * 256;
        vec even[MAX_M][TV], odd[MAX_M][TV];                  /* two sums: two chains of additions */
        for (int i = 0; i < m; i++)
            for (int h = 0; h < TV; h++) even[i][h] = odd[i][h] = (vec){0};
        for (int p = 0; p < 16; p++) {
            if (p % 4 == 0) __builtin_prefetch(c + PREFETCH + p * 16);   /* ask for memory ahead of use */
            for (int h = 0; h < TV; h++) {                    /* rows h VL .. h VL + VL - 1 of the tile */
                ivec v = load_u8(c + p * 16 + h * VL);
                vec w0 = __builtin_convertvector(v & 15, vec), w1 = __builtin_convertvector(v >> 4, vec);
                for (int i = 0; i < m; i++) {
                    const float *xi = x + (int64_t)i * K + g * 32 + 2 * p;
                    even[i][h] += w0 * xi[0];
                    odd[i][h] += w1 * xi[1];
                }
            }
        }
        for (int h = 0; h < TV; h++) {
            vec dv = load_halves(d + (t * G + g) * 16 + h * VL), mv = load_halves(mn + (t * G + g) * 16 + h * VL);
            for (int i = 0; i < m; i++) total[i][h] += (even[i][h] + odd[i][h]) * dv + mv * xsum[i * G + g];
        }
    }
    for (int i = 0; i < m; i++)
        for (int r = 0; r < 16; r++) store_float(y, (int64_t)i * N + t * 16 + r, total[i][r / VL][r % VL], bf16);
}

int matvec_q4_1(const void *x, const uint8_t *codes, const uint16_t *d, const uint16_t *mn, void *y, int m,
                int64_t N, int K, int bf16, int threads) {
    if (m < 1 || m > MAX_M || K % 32 != 0 || N % 16 != 0 || K > 32 * MAX_GROUPS) return -1;
    int G = K / 32;
    float xsum[MAX_M * MAX_GROUPS];                              /* each block's sum of x, for the m term */
    float *xf = float_rows(x, m, K, bf16);
    if (!xf) return -1;
    for (int i = 0; i < m; i++)
        for (int g = 0; g < G; g++) {
            const float *xg = xf + (int64_t)i * K + g * 32;
            vec sum = floats_at(xg);
            for (int j = VL; j < 32; j += VL) sum += floats_at(xg + j);
            xsum[i * G + g] = hsum(sum);
        }
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < N / 16; t++) {
        if (m == 1) tile_q4_1(xf, xsum, codes, d, mn, (char *)y, 1, N, K, t, bf16);
        else tile_q4_1(xf, xsum, codes, d, mn, (char *)y, m, N, K, t, bf16);
    }
    free(xf);
    return 0;
}
