/* A transformer block for a few rows of float32 activations in one or two calls.

   A single-stream decode step of the course model runs over a thousand PyTorch operators, and apart from
   the matrix products each does almost nothing: an RMSNorm of 576 numbers, RoPE on 15 heads of 64, a SiLU
   of 1,536. What each costs is mostly the dispatch around it (notebook 14 counts them). This file does, in
   plain loops, what `Block.before_attention` and `Block.after_attention` do (`model.py`):

     block_before   h = RMSNorm(x); qkv = h Wqkv^T; RoPE on the query and key heads of qkv
     block_after    x = x + out Wo^T;  x = x + Wdown (SiLU(gate) * up), (gate, up) = RMSNorm(x) Wgu^T

   and, where the attention context is a contiguous float32 cache with causal attention, the whole block:

     block_layer    block_before; write K, V into the cache; attend; block_after

   The products are `matvec.c`'s, for whichever format each weight is in (float32, int8 rows, Q4_1 blocks).
   With the two halves, attention stays with the caller, so every attention context (a paged pool, a
   quantized cache) works as before. Built at first use by `cbuild.py`. */
#include <math.h>
#include <stdlib.h>
#include "matvec.c"

enum { W_FLOAT32 = 0, W_INT8 = 2, W_Q4_1 = 3 };
#define MAX_HEAD_VECS (256 / VL)   /* head_dim up to 256 */

typedef struct {          /* one weight (N, K) in its format; a, b, c are its tensors' data */
    int kind;
    const void *a, *b, *c;   /* float32: W. int8: codes, row scales. Q4_1: codes, d, m */
    int64_t N;
    int K;
} weight;

static int product(const float *x, weight w, float *y, int m, int threads) {   /* y (m, N) = x (m, K) W^T */
    switch (w.kind) {
    case W_FLOAT32: return matvec(x, w.a, y, m, w.N, w.K, 0, threads);
    case W_INT8: return matvec_int8(x, w.a, w.b, y, m, w.N, w.K, 0, threads);
    case W_Q4_1: return matvec_q4_1(x, w.a, w.b, w.c, y, m, w.N, w.K, 0, threads);
    }
    return -1;
}

static void rms_norm(const float *x, const float *gain, float eps, float *out, int m, int d) {
    for (int i = 0; i < m; i++) {
        const float *xi = x + (int64_t)i * d;
        float ss = 0.0f;
        for (int j = 0; j < d; j++) ss += xi[j] * xi[j];
        float r = 1.0f / sqrtf(ss / d + eps);
        for (int j = 0; j < d; j++) out[(int64_t)i * d + j] = xi[j] * r * gain[j];
    }
}

/* qkv out, head-major (B, heads, T, hd) with m = B T rows: the product, then RoPE on the first `rot_heads`
   heads (queries and keys). Row i turns by table row i % table_rows of cos and sin (hd each; sin's first
   half already negated, as `rope_tables` makes them): out_j = x_j cos_j + x_(j +- hd/2) sin_j. */
int block_before(const float *x, int m, int T, int d, const float *gain, float eps,
                 int kind, const void *a, const void *b, const void *c, int64_t N,
                 const float *cos, const float *sin, int table_rows, int rot_heads, int hd,
                 float *qkv, int threads) {
    if (m < 1 || m > MAX_M || T < 1 || m % T || hd % 2 || N % hd || rot_heads * (int64_t)hd > N) return -1;
    float *h = malloc(sizeof(float) * m * (d + N));
    if (!h) return -1;
    float *rows = h + (int64_t)m * d;                                  /* the product, (m, heads hd) */
    rms_norm(x, gain, eps, h, m, d);
    int rc = product(h, (weight){kind, a, b, c, N, d}, rows, m, threads);
    int half = hd / 2, heads = (int)(N / hd);
    for (int i = 0; i < m && !rc; i++) {
        const float *co = cos + (int64_t)(i % table_rows) * hd, *si = sin + (int64_t)(i % table_rows) * hd;
        for (int head = 0; head < heads; head++) {
            const float *v = rows + (int64_t)i * N + (int64_t)head * hd;
            float *o = qkv + (((int64_t)(i / T) * heads + head) * T + i % T) * hd;
            if (head >= rot_heads) {
                memcpy(o, v, sizeof(float) * hd);
                continue;
            }
            for (int j = 0; j < half; j++) {
                float lo = v[j], hi = v[j + half];
                o[j] = lo * co[j] + hi * si[j];
                o[j + half] = hi * co[j + half] + lo * si[j + half];
            }
        }
    }
    free(h);
    return rc;
}

/* y (m, d) = x + out Wo^T, then y += Wdown (SiLU(gate) * up), (gate, up) = RMSNorm(y) Wgu^T. out is attention's
   output (B, H, T, hd) at strides (so_b, so_h, so_t, 1), with m = B T; Ko = H hd. */
int block_after(const float *x0, float *x, const float *out, int64_t so_b, int64_t so_h, int64_t so_t, int T, int hd,
                int m, int d, const float *gain, float eps,
                int ko, const void *oa, const void *ob, const void *oc, int Ko,
                int kg, const void *ga, const void *gb, const void *gc, int64_t ffn2,
                int kd, const void *da, const void *db, const void *dc, int threads) {
    if (m < 1 || m > MAX_M || T < 1 || m % T || ffn2 % 2 || Ko % hd) return -1;
    int64_t ffn = ffn2 / 2;
    float *t = malloc(sizeof(float) * m * (d + ffn2 + ffn + Ko));
    if (!t) return -1;
    float *h = t, *gu = t + (int64_t)m * d, *act = gu + (int64_t)m * ffn2, *o = act + (int64_t)m * ffn;
    for (int i = 0; i < m; i++)                                       /* out (B, H, T, hd) -> o (B T, H hd) */
        for (int head = 0; head < Ko / hd; head++)
            memcpy(o + (int64_t)i * Ko + (int64_t)head * hd, out + (i / T) * so_b + head * so_h + (i % T) * so_t,
                   sizeof(float) * hd);
    int rc = product(o, (weight){ko, oa, ob, oc, d, Ko}, h, m, threads);
    if (rc) goto done;
    for (int64_t j = 0; j < (int64_t)m * d; j++) x[j] = x0[j] + h[j];
    rms_norm(x, gain, eps, h, m, d);
    rc = product(h, (weight){kg, ga, gb, gc, ffn2, d}, gu, m, threads);
    if (rc) goto done;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t j = 0; j < (int64_t)m * ffn; j++) {
        int64_t i = j / ffn, k = j % ffn;
        float g = gu[i * ffn2 + k], u = gu[i * ffn2 + ffn + k];
        act[j] = g / (1.0f + expf(-g)) * u;                          /* SiLU(gate) * up */
    }
    rc = product(act, (weight){kd, da, db, dc, d, (int)ffn}, h, m, threads);
    if (rc) goto done;
    for (int64_t j = 0; j < (int64_t)m * d; j++) x[j] += h[j];
done:
    free(t);
    return rc;
}

/* Attention of each sequence's T new rows over its cache, after writing their K and V into it.
   qkv (B, H + 2 n_kv, T, hd) as block_before writes it; kc, vc (B, n_kv, max_len, hd), the cache of one layer.
   Sequence b's new rows go to slots starts[b] .. starts[b] + T - 1 and row t attends slots 0 .. starts[b] + t
   (causal). Query head h reads KV head h / (H / n_kv) (grouped-query attention). out (B, H, T, hd).
   softmax(q.k / sqrt(hd)) over the slots, in two passes: the scores and their maximum, then exp and V. */
static int cache_attend(const float *qkv, float *kc, float *vc, int64_t max_len, const int64_t *starts,
                        int B, int T, int H, int n_kv, int hd, float *out, int threads) {
    const int heads = H + 2 * n_kv, HV = hd / VL;
    int64_t longest = 0;
    for (int b = 0; b < B; b++) {
        if (starts[b] < 0 || starts[b] + T > max_len) return -1;
        longest = starts[b] + T > longest ? starts[b] + T : longest;
        for (int g = 0; g < n_kv; g++)
            for (int t = 0; t < T; t++) {
                int64_t slot = ((int64_t)b * n_kv + g) * max_len + starts[b] + t;
                memcpy(kc + slot * hd, qkv + (((int64_t)b * heads + H + g) * T + t) * hd, sizeof(float) * hd);
                memcpy(vc + slot * hd, qkv + (((int64_t)b * heads + H + n_kv + g) * T + t) * hd, sizeof(float) * hd);
            }
    }
    const float scale = 1.0f / sqrtf((float)hd);
    int failed = 0;
    #pragma omp parallel for schedule(static) num_threads(threads) reduction(|:failed)
    for (int64_t bh = 0; bh < (int64_t)B * H; bh++) {
        int b = (int)(bh / H), h = (int)(bh % H), g = h / (H / n_kv);
        const float *K = kc + ((int64_t)b * n_kv + g) * max_len * hd, *V = vc + ((int64_t)b * n_kv + g) * max_len * hd;
        float *p = malloc(sizeof(float) * longest);
        if (!p) { failed = 1; continue; }
        for (int t = 0; t < T; t++) {
            const float *q = qkv + (((int64_t)b * heads + h) * T + t) * hd;
            int64_t S = starts[b] + t + 1;
            float top = -INFINITY, total = 0.0f;
            for (int64_t j = 0; j < S; j++) {                          /* scores */
                vec acc = {0};
                for (int c = 0; c < HV; c++) acc += floats_at(q + c * VL) * floats_at(K + j * hd + c * VL);
                p[j] = hsum(acc) * scale;
                top = p[j] > top ? p[j] : top;
            }
            vec o[MAX_HEAD_VECS] = {{0}};
            for (int64_t j = 0; j < S; j++) {                          /* weights, and the sum of V they weigh */
                float e = expf(p[j] - top);
                total += e;
                for (int c = 0; c < HV; c++) o[c] += floats_at(V + j * hd + c * VL) * e;
            }
            float *dst = out + (((int64_t)b * H + h) * T + t) * hd;
            for (int c = 0; c < HV; c++) {
                vec r = o[c] / total;
                memcpy(dst + c * VL, &r, sizeof r);
            }
        }
        free(p);
    }
    return failed ? -1 : 0;
}

/* One whole block for a few rows over a contiguous float32 cache: block_before, cache_attend, block_after.
   x, y (m, d) with m = B T; the weights as in block_before and block_after. */
int block_layer(const float *x, float *y, int m, int T, int d, const float *gain1, float eps1,
                int kq, const void *qa, const void *qb, const void *qc,
                const float *cos, const float *sin, int table_rows, int H, int n_kv, int hd,
                float *kc, float *vc, int64_t max_len, const int64_t *starts,
                const float *gain2, float eps2,
                int ko, const void *oa, const void *ob, const void *oc,
                int kg, const void *ga, const void *gb, const void *gc, int64_t ffn2,
                int kd, const void *da, const void *db, const void *dc, int threads) {
    if (m < 1 || m > MAX_M || T < 1 || m % T || hd % 16 || hd > VL * MAX_HEAD_VECS || H % n_kv) return -1;
    const int B = m / T;
    const int64_t N = (int64_t)(H + 2 * n_kv) * hd;
    float *qkv = malloc(sizeof(float) * m * (N + (int64_t)H * hd));
    if (!qkv) return -1;
    float *out = qkv + (int64_t)m * N;
    int rc = block_before(x, m, T, d, gain1, eps1, kq, qa, qb, qc, N, cos, sin, table_rows, H + n_kv, hd, qkv, threads);
    if (!rc) rc = cache_attend(qkv, kc, vc, max_len, starts, B, T, H, n_kv, hd, out, threads);
    if (!rc) rc = block_after(x, y, out, (int64_t)H * T * hd, (int64_t)T * hd, hd, T, hd, m, d, gain2, eps2,
                              ko, oa, ob, oc, H * hd, kg, ga, gb, gc, ffn2, kd, da, db, dc, threads);
    free(qkv);
    return rc;
}
