/* Sparse multi-query attention for x86-64 CPUs with AVX-512: each query row's heads against the KV rows its
   sources let it see (a window ring, the chunk's own rows, the compressed blocks: all of them or an indexer's
   top-k, gathered by index and read in place), one softmax over them and a per-head sink logit.

   torch runs it as gathers, fp32 copies of every row read, two einsums a source, a concatenation and a
   softmax: at V4 Flash's 64 heads x 512 dims a CSA layer's query took ~1.7 ms on a Zen 4 core, ~2 ms a row when a
   step verifies drafts (docs/decisions.md: Sparse attention in one native pass). Here one work item is one query
   row and up to 64 of its heads, the heads across the vector lanes (q held transposed, [D][heads]): the logits
   of a few keys at a time (each key widened to fp32 once, its dims broadcast in turn), the softmax in lanes,
   then the weighted sum of the keys (K = V) into a transposed accumulator. Masked keys are skipped, as their
   exp(-inf) = 0 adds nothing in torch's.

   Every output is the same chain of operations whatever the call: a logit is its dims' products in order, one
   fused multiply-add each, from zero; the softmax's maximum and sum run over the seen keys in order, the sink's
   term first in the sum; an output's sum runs over the seen keys in order. A row's result does not depend on
   the rows, heads or threads beside it, so verifying drafts gives plain decoding's numbers. */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_exp.h"
#include "cpu_load.h"

#define INLINE static inline __attribute__((always_inline))
#define MAX_SOURCES 8
#define MAX_VECTORS 4           /* head vectors (16 heads each) per work item */
#define KEY_CHUNK 64            /* keys widened to fp32 at once for the weighted sum */

/* D elements of a key row, fp32 or bf16, as fp32. */
INLINE void widen(const void *row, int bf16, int64_t D, float *out) {
    for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(out + d, load16(row, bf16, d));
}

/* The logits of `group` keys (kf, fp32 rows of D) against qt [D][16 * hv]: lg[g][16 * hv]. */
INLINE void logits_group(const float *qt, const float *kf, int64_t D, float *lg, const int hv, const int group) {
    __m512 acc[24];
    for (int i = 0; i < group * hv; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d++) {
        __m512 qd[MAX_VECTORS];
        for (int v = 0; v < hv; v++) qd[v] = _mm512_loadu_ps(qt + d * 16 * hv + 16 * v);
        for (int g = 0; g < group; g++) {
            __m512 k = _mm512_set1_ps(kf[g * D + d]);
            for (int v = 0; v < hv; v++) acc[g * hv + v] = _mm512_fmadd_ps(qd[v], k, acc[g * hv + v]);
        }
    }
    for (int g = 0; g < group; g++)
        for (int v = 0; v < hv; v++) _mm512_storeu_ps(lg + (g * hv + v) * 16, acc[g * hv + v]);
}

/* ot[d][16 * hv] += sum over the n keys of p[k][16 * hv] * kf[k][d], for dims [d0, d0 + DB). */
INLINE void values_block(const float *p, const float *kf, int64_t n, int64_t D, int64_t d0, float *ot,
                         const int hv, const int DB) {
    __m512 acc[16];
    for (int j = 0; j < DB; j++)
        for (int v = 0; v < hv; v++) acc[j * hv + v] = _mm512_loadu_ps(ot + (d0 + j) * 16 * hv + 16 * v);
    for (int64_t k = 0; k < n; k++) {
        __m512 pv[MAX_VECTORS];
        for (int v = 0; v < hv; v++) pv[v] = _mm512_loadu_ps(p + k * 16 * hv + 16 * v);
        for (int j = 0; j < DB; j++) {
            __m512 x = _mm512_set1_ps(kf[k * D + d0 + j]);
            for (int v = 0; v < hv; v++) acc[j * hv + v] = _mm512_fmadd_ps(pv[v], x, acc[j * hv + v]);
        }
    }
    for (int j = 0; j < DB; j++)
        for (int v = 0; v < hv; v++) _mm512_storeu_ps(ot + (d0 + j) * 16 * hv + 16 * v, acc[j * hv + v]);
}

struct source {
    const void *kv;             /* rows of D, fp32 or bf16 */
    int bf16;
    int64_t batch_stride, rows; /* elements between sequences; rows a sequence has */
    const uint8_t *mask;        /* bool, [B][S][M] at the strides below */
    const int64_t *idx;         /* the rows to read, [B][S][M], or NULL: rows 0..M-1 */
    int64_t M, mask_stride[3], idx_stride[3];
};

/* One query row's heads [h0, h0 + 16 hv) (H of them real) against its keys: out [H][D] fp32. */
static void attend_row(const void *q, int q_bf16, int64_t H, int64_t D, float scale, const float *sink,
                       const struct source *src, int n_src, int64_t b, int64_t s, int64_t h0, const int hv,
                       const void **keys, int *key_bf16, float *lg, float *kf, float *qt, float *ot, float *out) {
    const int64_t L = 16 * hv;
    int64_t n = 0;                      /* the keys this row sees, sources in order */
    for (int i = 0; i < n_src; i++) {
        const struct source *c = &src[i];
        const uint8_t *m = c->mask + b * c->mask_stride[0] + s * c->mask_stride[1];
        const int64_t *ix = c->idx ? c->idx + b * c->idx_stride[0] + s * c->idx_stride[1] : NULL;
        const int64_t el = c->bf16 ? 2 : 4;
        for (int64_t j = 0; j < c->M; j++) {
            if (!m[j * c->mask_stride[2]]) continue;
            int64_t row = ix ? ix[j * c->idx_stride[2]] : j;
            row = row < 0 ? 0 : row >= c->rows ? c->rows - 1 : row;
            keys[n] = (const char *)c->kv + (b * c->batch_stride + row * D) * el;
            key_bf16[n++] = c->bf16;
        }
    }
    /* q times the scale (as torch's q.float() * scale rounds it), heads across the lanes */
    memset(qt, 0, D * L * sizeof *qt);
    for (int64_t h = h0; h < h0 + L && h < H; h++)
        for (int64_t d = 0; d < D; d++)
            qt[d * L + h - h0] = load1(q, q_bf16, h * D + d) * scale;
    const int group = hv <= 2 ? 8 : hv == 3 ? 6 : 5;       /* keys a pass: group * hv accumulators */
    int64_t k = 0;
    for (; k + group <= n; k += group) {
        for (int g = 0; g < group; g++) widen(keys[k + g], key_bf16[k + g], D, kf + g * D);
        switch (hv) {
            case 1: logits_group(qt, kf, D, lg + k * L, 1, 8); break;
            case 2: logits_group(qt, kf, D, lg + k * L, 2, 8); break;
            case 3: logits_group(qt, kf, D, lg + k * L, 3, 6); break;
            default: logits_group(qt, kf, D, lg + k * L, 4, 5);
        }
    }
    for (; k < n; k++) {
        widen(keys[k], key_bf16[k], D, kf);
        switch (hv) {
            case 1: logits_group(qt, kf, D, lg + k * L, 1, 1); break;
            case 2: logits_group(qt, kf, D, lg + k * L, 2, 1); break;
            case 3: logits_group(qt, kf, D, lg + k * L, 3, 1); break;
            default: logits_group(qt, kf, D, lg + k * L, 4, 1);
        }
    }
    /* softmax over [logits; sink] per head (lane) */
    for (int v = 0; v < hv; v++) {
        __m512 sk = _mm512_setzero_ps();
        for (int l = 0; l < 16 && h0 + 16 * v + l < H; l++) ((float *)&sk)[l] = sink[h0 + 16 * v + l];
        __m512 mx = sk;
        for (int64_t j = 0; j < n; j++) mx = _mm512_max_ps(mx, _mm512_loadu_ps(lg + j * L + 16 * v));
        __m512 sum = exp_le0(_mm512_sub_ps(sk, mx));
        for (int64_t j = 0; j < n; j++) {
            __m512 e = exp_le0(_mm512_sub_ps(_mm512_loadu_ps(lg + j * L + 16 * v), mx));
            _mm512_storeu_ps(lg + j * L + 16 * v, e);
            sum = _mm512_add_ps(sum, e);
        }
        __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), sum);
        for (int64_t j = 0; j < n; j++)
            _mm512_storeu_ps(lg + j * L + 16 * v, _mm512_mul_ps(_mm512_loadu_ps(lg + j * L + 16 * v), inv));
    }
    /* the weighted sum of the keys, KEY_CHUNK keys widened at a time */
    memset(ot, 0, D * L * sizeof *ot);
    for (int64_t k0 = 0; k0 < n; k0 += KEY_CHUNK) {
        int64_t c = n - k0 < KEY_CHUNK ? n - k0 : KEY_CHUNK;
        for (int64_t j = 0; j < c; j++) widen(keys[k0 + j], key_bf16[k0 + j], D, kf + j * D);
        const int DB = hv == 1 ? 16 : hv == 2 ? 8 : 4;     /* dims a block: D is a multiple of each */
        for (int64_t d0 = 0; d0 < D; d0 += DB)
            switch (hv) {
                case 1: values_block(lg + k0 * L, kf, c, D, d0, ot, 1, 16); break;
                case 2: values_block(lg + k0 * L, kf, c, D, d0, ot, 2, 8); break;
                case 3: values_block(lg + k0 * L, kf, c, D, d0, ot, 3, 4); break;
                default: values_block(lg + k0 * L, kf, c, D, d0, ot, 4, 4);
            }
    }
    for (int64_t h = h0; h < h0 + L && h < H; h++)
        for (int64_t d = 0; d < D; d++) out[h * D + d] = ot[d * L + h - h0];
}

/* q [B][S][H][D] (bf16 with q_bf16, else fp32), sink [H] fp32, n_src sources (the arrays give each one's fields,
   strides in elements, idx NULL where the source is read whole); out [B][S][H][D] fp32. D a multiple of 16.
   Returns 0, or -1 without memory for the scratch. */
int dsv4_sparse_attention(const void *q, int q_bf16, int64_t B, int64_t S, int64_t H, int64_t D, float scale,
                          const float *sink, int n_src, const void *const *kv, const int *kv_bf16,
                          const int64_t *kv_batch_stride, const int64_t *kv_rows, const uint8_t *const *mask,
                          const int64_t *const *idx, const int64_t *M, const int64_t *mask_strides,
                          const int64_t *idx_strides, float *out, int threads) {
    struct source src[MAX_SOURCES];
    int64_t n_max = 0;
    if (n_src > MAX_SOURCES) return -1;
    for (int i = 0; i < n_src; i++) {
        src[i] = (struct source){kv[i], kv_bf16[i], kv_batch_stride[i], kv_rows[i], mask[i], idx[i], M[i],
                                 {mask_strides[3 * i], mask_strides[3 * i + 1], mask_strides[3 * i + 2]},
                                 {idx_strides[3 * i], idx_strides[3 * i + 1], idx_strides[3 * i + 2]}};
        n_max += M[i];
    }
    const int64_t vectors = (H + 15) / 16, rows = B * S;
    int64_t per = vectors < MAX_VECTORS ? vectors : MAX_VECTORS;     /* head vectors per work item */
    while (per > 1 && rows * ((vectors + per - 1) / per) < threads) per = (per + 1) / 2;
    const int64_t blocks = (vectors + per - 1) / per, items = rows * blocks;
    const int64_t kf_rows = KEY_CHUNK > 8 ? KEY_CHUNK : 8;
    int failed = 0;
    _Pragma("omp parallel num_threads(threads) if (threads > 1 && items > 1)")
    {
        const int64_t L = 16 * per;
        const void **keys = malloc((n_max + 1) * sizeof *keys);
        int *key_bf16 = malloc((n_max + 1) * sizeof *key_bf16);
        float *lg = aligned_alloc(64, ((n_max + 8) * L * sizeof(float) + 63) / 64 * 64);
        float *kf = aligned_alloc(64, kf_rows * D * sizeof(float));
        float *qt = aligned_alloc(64, D * L * sizeof(float)), *ot = aligned_alloc(64, D * L * sizeof(float));
        if (!keys || !key_bf16 || !lg || !kf || !qt || !ot) {
            _Pragma("omp atomic write")
            failed = 1;
        }
        _Pragma("omp for schedule(static)")
        for (int64_t item = 0; item < items; item++) {
            if (!keys || !key_bf16 || !lg || !kf || !qt || !ot) continue;
            const int64_t row = item / blocks, v0 = item % blocks * per, b = row / S, s = row % S;
            const int hv = (int)(vectors - v0 < per ? vectors - v0 : per);
            const char *qrow = (const char *)q + row * H * D * (q_bf16 ? 2 : 4);
            attend_row(qrow, q_bf16, H, D, scale, sink, src, n_src, b, s, 16 * v0, hv, keys, key_bf16, lg, kf, qt, ot,
                       out + row * H * D);
        }
        free(keys), free(key_bf16), free(lg), free(kf), free(qt), free(ot);
    }
    return failed ? -1 : 0;
}
