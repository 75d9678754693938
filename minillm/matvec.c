/* A decode step's matrix products at the speed of memory: y (M, N) = x (M, K) @ W (N, K)^T for a few rows.

   With one row of x, each weight is used once: the product can only be as fast as W streams from memory.
   A general matrix-multiply library tiles for reuse that one row does not have, and on some CPUs its
   one-row path streams at a fraction of the machine's copy bandwidth (notebook 14 measures it). This loop
   does the obvious thing: each thread takes a slice of W's rows, reads each weight row once from start to
   end, and multiplies it with every row of x while it is in cache. Four weight rows go together, so each
   piece of x loaded serves four of them.

   `vec` (vec16.h) is 16 floats handled as one value, compiled to this CPU's vector instructions. W is float32 or bfloat16 (widened to float32 as it is read); x and y have
   W's dtype; sums are float32. K must be a multiple of 16. Built at first use by `native.py`. */
#include "vec16.h"

#define ROWS 4       /* weight rows per step of the inner loop */
#define MAX_M 8      /* rows of x per call */

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
