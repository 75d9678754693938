/* Paged decode attention for a CPU: each request's keys and values read in place from the pool's pages.

   The torch backend gathers a request's pages into a copy and hands it to SDPA: every key is read,
   written and read again, and SDPA runs one query row per head. This kernel is the CPU's version of the
   Triton decode kernel: one task per (request, KV head); the G query heads that share that KV head
   attend together (each key is loaded once for all G of them); keys come a tile of VL at a time through
   the block table; the softmax is kept online (running max m, running sum l, accumulator acc), so nothing
   the size of the context is ever written.

   Shapes (float32 or bfloat16, given by `bf16`; head_dim D a multiple of 16):
       q      rows at q + row * sq_n + head * sq_h, D numbers each (H heads, G = H / Hkv per KV head)
       k, v   (num_blocks, bs, Hkv, D) contiguous: key t of a request is in page table[t / bs], slot t % bs
       table  (n, W) int32: request i's pages;  rows (n,) int64: its query row;  lens (n,) int32: its keys
       out    rows at out + row * so_n + head * so_h

   `vec` (vec.h) is VL floats handled as one value, one register of this CPU (VL = 16, 8 or 4). Built at first
   use by `cpu_kernel.py`; the engine falls back to gather + SDPA where there is no compiler. */
#include <math.h>

#include "../vec.h"

#define TILE VL      /* keys per online-softmax update: one vec of scores per query head */
#define MAX_G 16
#define MAX_DV (256 / VL)    /* head_dim up to 256: DV = head_dim / VL vecs */

/* e^x for x <= 0 (scores minus the running max), VL at a time: 2^(x log2 e) split into 2^i (written into
   the exponent bits) and e^f, |f| <= ln2 / 2, by its Taylor series to f^6 (relative error about 1e-7). */
static inline vec exp_nonpositive(vec x) {
    vec t = x * 1.44269504f;
    ivec below = t < -126.0f;                                /* below: ~1e-38, as good as 0 (-inf too) */
    t = (vec)(((ivec)t & ~below) | ((ivec)splat(-126.0f) & below));
    ivec i = __builtin_convertvector(t - 0.5f, ivec);        /* rounds t, which is <= 0 */
    vec f = (t - __builtin_convertvector(i, vec)) * 0.69314718f;
    vec p = 1.0f + f * (1.0f + f * (0.5f + f * (1.0f / 6 + f * (1.0f / 24 + f * (1.0f / 120 + f * (1.0f / 720))))));
    ivec bits = (i + 127) << 23;
    vec scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* VL vectors in, one out: lane j is the sum of d[j]'s lanes. Each round adds the two halves of every pair of
   vectors, side by side (VL - 1 vector additions in all, with their shuffles), where summing each vector
   alone is VL dependent scalar additions; the kernel read 1.1-1.4x faster for it. The sums come in another
   order than one by one: equal to rounding. AVX-512 and AVX2; other CPUs sum one vector at a time. */
#define SH(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#if VL == 16
#define SUM_EACH 1
static inline vec sum_each(const vec d[16]) {
    vec e[8], f[4], h[2];
    for (int k = 0; k < 8; k++)      /* lanes 0-7: d[2k]'s halves added, 8-15: d[2k + 1]'s */
        e[k] = SH(d[2 * k], d[2 * k + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
             + SH(d[2 * k], d[2 * k + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int k = 0; k < 4; k++)      /* four lanes each for d[4k .. 4k + 3] */
        f[k] = SH(e[2 * k], e[2 * k + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27)
             + SH(e[2 * k], e[2 * k + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int k = 0; k < 2; k++)      /* two lanes each for d[8k .. 8k + 7] */
        h[k] = SH(f[2 * k], f[2 * k + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29)
             + SH(f[2 * k], f[2 * k + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    return SH(h[0], h[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30)
         + SH(h[0], h[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}
#elif VL == 8
#define SUM_EACH 1
static inline vec sum_each(const vec d[8]) {
    vec e[4], f[2];
    for (int k = 0; k < 4; k++)      /* lanes 0-3: d[2k]'s halves added, 4-7: d[2k + 1]'s */
        e[k] = SH(d[2 * k], d[2 * k + 1], 0, 1, 2, 3, 8, 9, 10, 11) + SH(d[2 * k], d[2 * k + 1], 4, 5, 6, 7, 12, 13, 14, 15);
    for (int k = 0; k < 2; k++)      /* two lanes each for d[4k .. 4k + 3] */
        f[k] = SH(e[2 * k], e[2 * k + 1], 0, 1, 4, 5, 8, 9, 12, 13) + SH(e[2 * k], e[2 * k + 1], 2, 3, 6, 7, 10, 11, 14, 15);
    return SH(f[0], f[1], 0, 2, 4, 6, 8, 10, 12, 14) + SH(f[0], f[1], 1, 3, 5, 7, 9, 11, 13, 15);
}
#endif
#undef SH

/* One request, one KV head: its query heads g0 .. g0 + G - 1 (of Gall per KV head) over its len keys.
   G and DV are constants where the caller dispatches on them (always inlined), so q and acc stay in
   registers. */
static inline __attribute__((always_inline)) void
attend_one(const char *q, int64_t sq_n, int64_t sq_h, const char *k, const char *v, const int32_t *table,
           int64_t row, int len, int bs, int Hkv, int Gall, int g0, const int G, const int DV, int h, float scale, int bf16,
           char *out, int64_t so_n, int64_t so_h) {
    const int esize = bf16 ? 2 : 4;
    vec qv[MAX_G][MAX_DV], acc[MAX_G][MAX_DV];
    float m[MAX_G], l[MAX_G];
    for (int g = 0; g < G; g++) {
        for (int c = 0; c < DV; c++) {
            qv[g][c] = load_vec(q + (row * sq_n + (int64_t)(h * Gall + g0 + g) * sq_h + c * VL) * esize, bf16) * scale;
            acc[g][c] = splat(0.0f);
        }
        m[g] = -INFINITY;
        l[g] = 0.0f;
    }
    const int64_t row_stride = (int64_t)Hkv * DV * VL;          /* numbers from one slot to the next */
    for (int t0 = 0; t0 < len; t0 += TILE) {
        int n = len - t0 < TILE ? len - t0 : TILE;
        const char *kr[TILE], *vr[TILE];
        for (int j = 0; j < n; j++) {                            /* the tile's rows, through the table */
            int t = t0 + j;
            int64_t at = ((int64_t)table[t / bs] * bs + t % bs) * row_stride + (int64_t)h * DV * VL;
            kr[j] = k + at * esize;
            vr[j] = v + at * esize;
        }
        for (int t = t0 + TILE; t < len && t < t0 + 2 * TILE; t++) {   /* ask for the next tile's rows now */
            int64_t at = ((int64_t)table[t / bs] * bs + t % bs) * row_stride + (int64_t)h * DV * VL;
            for (int c = 0; c < DV * VL * esize; c += 64) {      /* into L2 (locality 2): into L1, the */
                __builtin_prefetch(k + at * esize + c, 0, 2);    /* requests wait for L1's few miss slots, */
                __builtin_prefetch(v + at * esize + c, 0, 2);    /* and the kernel read 1.45x slower */
            }
        }
        vec s[MAX_G];                                            /* scores, lane j = key t0 + j */
#ifdef SUM_EACH
        vec dots[MAX_G][TILE];                                   /* q . k lane by lane, summed below */
        for (int j = 0; j < TILE; j++) {                         /* each key loaded once for all G */
            if (j >= n) {
                for (int g = 0; g < G; g++) dots[g][j] = splat(0.0f);
                continue;
            }
            vec kj[MAX_DV];
            for (int c = 0; c < DV; c++) kj[c] = load_vec(kr[j] + c * VL * esize, bf16);
            for (int g = 0; g < G; g++) {
                vec d = qv[g][0] * kj[0];
                for (int c = 1; c < DV; c++) d += qv[g][c] * kj[c];
                dots[g][j] = d;
            }
        }
        for (int g = 0; g < G; g++) {
            s[g] = sum_each(dots[g]);
            for (int j = n; j < TILE; j++) s[g][j] = -INFINITY;
        }
#else
        for (int g = 0; g < G; g++) s[g] = splat(-INFINITY);
        for (int j = 0; j < n; j++) {                            /* s = q . k, each key loaded once */
            vec kj[MAX_DV];
            for (int c = 0; c < DV; c++) kj[c] = load_vec(kr[j] + c * VL * esize, bf16);
            for (int g = 0; g < G; g++) {
                vec d = qv[g][0] * kj[0];
                for (int c = 1; c < DV; c++) d += qv[g][c] * kj[c];
                s[g][j] = hsum(d);
            }
        }
#endif
        vec p[MAX_G];
        for (int g = 0; g < G; g++) {                            /* the online softmax, one tile */
            float mx = m[g];
            for (int j = 0; j < n; j++) mx = s[g][j] > mx ? s[g][j] : mx;
            p[g] = exp_nonpositive(s[g] - mx);                   /* lanes past n: e^-inf = 0 */
            float correction = exp_nonpositive(splat(m[g] - mx))[0];   /* 0 on the first tile (m = -inf) */
            l[g] = l[g] * correction + hsum(p[g]);
            m[g] = mx;
            for (int c = 0; c < DV; c++) acc[g][c] *= correction;
        }
        for (int j = 0; j < n; j++) {                            /* acc += p . v, each value loaded once */
            vec vj[MAX_DV];
            for (int c = 0; c < DV; c++) vj[c] = load_vec(vr[j] + c * VL * esize, bf16);
            for (int g = 0; g < G; g++)
                for (int c = 0; c < DV; c++) acc[g][c] += p[g][j] * vj[c];
        }
    }
    for (int g = 0; g < G; g++) {
        int64_t at = row * so_n + (int64_t)(h * Gall + g0 + g) * so_h;
        float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;           /* no keys: zeros */
        for (int c = 0; c < DV; c++) {
            vec x = acc[g][c] * inv;
            for (int i = 0; i < VL; i++) store_float(out, at + c * VL + i, x[i], bf16);
        }
    }
}

#define CASE(g, dv) \
    if (G == g && DV == dv) { \
        attend_one(q, sq_n, sq_h, k, v, tab, row, len, bs, Hkv, Gall, g0, g, dv, h, scale, bf16, out, so_n, so_h); \
        continue; \
    }

/* The query heads of KV head h, at most MAX_G at a time (more share a KV head only in multi-query models). */
static void attend_dispatch(const char *q, int64_t sq_n, int64_t sq_h, const char *k, const char *v,
                            const int32_t *tab, int64_t row, int len, int bs, int Hkv, int Gall, int DV, int h,
                            float scale, int bf16, char *out, int64_t so_n, int64_t so_h) {
    for (int g0 = 0; g0 < Gall; g0 += MAX_G) {
        int G = Gall - g0 < MAX_G ? Gall - g0 : MAX_G;
        CASE(3, 64 / VL)     /* the course model: 9 query heads over 3 KV heads, head_dim 64 */
        CASE(1, 64 / VL)
        CASE(2, 64 / VL)
        CASE(4, 64 / VL)
        CASE(4, 128 / VL)    /* 128-dim heads */
        CASE(8, 128 / VL)
        attend_one(q, sq_n, sq_h, k, v, tab, row, len, bs, Hkv, Gall, g0, G, DV, h, scale, bf16, out, so_n, so_h);
    }
}

/* Returns 0, or -1 when the shapes are past the kernel's limits (the caller checks first). */
int paged_decode(const void *q, int64_t sq_n, int64_t sq_h, const void *k, const void *v,
                 const int32_t *table, int W, const int64_t *rows, const int32_t *lens, int n,
                 int bs, int H, int Hkv, int D, float scale, int bf16,
                 void *out, int64_t so_n, int64_t so_h, int threads) {
    int G = H / Hkv, DV = D / VL;
    if (DV > MAX_DV || G * Hkv != H || D % 16 != 0) return -1;
    #pragma omp parallel for collapse(2) schedule(dynamic, 1) num_threads(threads)
    for (int i = 0; i < n; i++)
        for (int h = 0; h < Hkv; h++)
            attend_dispatch((const char *)q, sq_n, sq_h, (const char *)k, (const char *)v, table + (int64_t)i * W,
                            rows[i], lens[i], bs, Hkv, G, DV, h, scale, bf16, (char *)out, so_n, so_h);
    return 0;
}
