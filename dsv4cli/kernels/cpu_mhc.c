/* mHC around every sub-layer, for x86-64 CPUs with AVX-512: the small work either side of its one GEMM.

   In torch, mHC is ~150 ops a sub-layer (the Sinkhorn alone ~120: a sum, an add and a divide per
   normalisation), two sub-layers a layer; at decode's 1-6 rows each op costs its dispatch, not its
   arithmetic (docs/decisions.md: mHC in three native calls). Here each is one call:
   - `dsv4_mhc_pre_tail`: from the mixing GEMM's output (torch's), the RMS scaling, the pre / post
     sigmoids, the comb logits, and the collapsed input x = sum_i pre_i h_i (`reference.mhc_pre`);
   - `dsv4_mhc_sinkhorn`: each token's n x n comb through the same steps in the same order as
     `reference.mhc_sinkhorn` (softmax over each row, + eps, a column normalisation, then iters - 1
     rounds of row then column normalisation, every denominator + eps, every sum in index order);
   - `dsv4_mhc_post`: the new streams post_k x + sum_j comb[j][k] h_j (`reference.mhc_post`).
   exp is libm's, where torch has its own vectorised one, and the RMS's sum of squares runs in 16 lanes:
   within a few fp32 ulps of torch. A token's results depend on its own values alone. */
#include <math.h>

#include "cpu_load.h"

#define INLINE static inline __attribute__((always_inline))

#define MAX_N 8     /* V4's configs hold 4 copies of the stream; the caller checks n */

/* Divide each of the n lines of c (n x n, row-major) by its sum + eps: the rows with (line, step) strides
   (n, 1), the columns with (1, n). */
static void normalise(float *c, int64_t n, float eps, int64_t line, int64_t step) {
    for (int64_t a = 0; a < n; a++) {
        float *v = c + a * line, s = 0.0f;
        for (int64_t b = 0; b < n; b++) s += v[b * step];
        s += eps;
        for (int64_t b = 0; b < n; b++) v[b * step] = v[b * step] / s;
    }
}

/* logits, out: [T][n][n] fp32, row-major per token. */
void dsv4_mhc_sinkhorn(const float *logits, int64_t T, int64_t n, float eps, int64_t iters, float *out) {
    for (int64_t t = 0; t < T; t++) {
        const float *l = logits + t * n * n;
        float c[MAX_N * MAX_N];
        for (int64_t i = 0; i < n; i++) {
            float m = l[i * n], s = 0.0f;
            for (int64_t j = 1; j < n; j++) m = l[i * n + j] > m ? l[i * n + j] : m;
            for (int64_t j = 0; j < n; j++) s += c[i * n + j] = expf(l[i * n + j] - m);
            for (int64_t j = 0; j < n; j++) c[i * n + j] = c[i * n + j] / s + eps;
        }
        normalise(c, n, eps, 1, n);              /* the columns */
        for (int64_t k = 1; k < iters; k++) {
            normalise(c, n, eps, n, 1);          /* the rows, then the columns */
            normalise(c, n, eps, 1, n);
        }
        for (int64_t i = 0; i < n * n; i++) out[t * n * n + i] = c[i];
    }
}

INLINE float sigmoid(float v) { return 1.0f / (1.0f + expf(-v)); }

/* h [T][n][D] (D a multiple of 16), mix [T][(2 + n) n] = h flattened @ fn^T; scale [3], base [(2 + n) n].
   Out: x [T][D] fp32, post [T][n], comb [T][n][n] (logits). */
void dsv4_mhc_pre_tail(const void *h, int bf16, int64_t T, int64_t n, int64_t D, const float *mix,
                       const float *scale, const float *base, float norm_eps, float hc_eps, float *x, float *post,
                       float *comb) {
    const int64_t m = (2 + n) * n;
    for (int64_t t = 0; t < T; t++) {
        const int64_t row = t * n * D;
        __m512 sq = _mm512_setzero_ps();
        for (int64_t i = 0; i < n * D; i += 16) {
            __m512 v = load16(h, bf16, row + i);
            sq = _mm512_add_ps(sq, _mm512_mul_ps(v, v));
        }
        const float r = 1.0f / sqrtf(_mm512_reduce_add_ps(sq) / (float)(n * D) + norm_eps);
        const float *mt = mix + t * m;
        float pre[8];
        for (int64_t i = 0; i < n; i++) {
            pre[i] = sigmoid(mt[i] * r * scale[0] + base[i]) + hc_eps;
            post[t * n + i] = 2.0f * sigmoid(mt[n + i] * r * scale[1] + base[n + i]);
        }
        for (int64_t i = 0; i < n * n; i++) comb[t * n * n + i] = mt[2 * n + i] * r * scale[2] + base[2 * n + i];
        for (int64_t d = 0; d < D; d += 16) {
            __m512 acc = _mm512_mul_ps(_mm512_set1_ps(pre[0]), load16(h, bf16, row + d));
            for (int64_t i = 1; i < n; i++)
                acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_set1_ps(pre[i]), load16(h, bf16, row + i * D + d)));
            _mm512_storeu_ps(x + t * D + d, acc);
        }
    }
}

/* x [T][D] (the sub-layer's output), h [T][n][D], post [T][n], comb [T][n][n] (normalised), both float
   inputs fp32 or bf16 alike. Out: [T][n][D] fp32, out[k] = post_k x + sum_j comb[j][k] h_j. */
void dsv4_mhc_post(const void *x, const void *h, int bf16, int64_t T, int64_t n, int64_t D, const float *post,
                   const float *comb, float *out) {
    for (int64_t t = 0; t < T; t++) {
        const float *c = comb + t * n * n;
        for (int64_t k = 0; k < n; k++) {
            const __m512 pk = _mm512_set1_ps(post[t * n + k]);
            float *o = out + (t * n + k) * D;
            for (int64_t d = 0; d < D; d += 16) {
                __m512 acc = _mm512_mul_ps(_mm512_set1_ps(c[k]), load16(h, bf16, t * n * D + d));
                for (int64_t j = 1; j < n; j++)
                    acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_set1_ps(c[j * n + k]),
                                                           load16(h, bf16, (t * n + j) * D + d)));
                _mm512_storeu_ps(o + d, _mm512_add_ps(_mm512_mul_ps(pk, load16(x, bf16, t * D + d)), acc));
            }
        }
    }
}
