/* The lightning indexer's scan for x86-64 CPUs with AVX-512: score[t] = sum_h w[h] relu(q_h . k_t)
   for every key t of a sequence, in fp32.

   At long contexts a CSA layer's decode step is mostly this scan (64 heads x 128 dims against every
   closed block's key), and on a CPU core it is compute-bound (32 flops per fp32 key byte). torch runs
   it as a bmm into a [heads x keys] product, a relu, and a second bmm for the weighted sum, well below
   the core's fp32 peak (docs/decisions.md: The indexer's scan in one native pass). Here the heads lie
   across the vector lanes (q held transposed, [D][H]), each key's dims are broadcast in turn, and the
   relu and weighted sum run in registers, so only the scores are written.

   Every key's score is the same chain of operations whatever the call: its dims in order, one fused
   multiply-add per head per dim; then the heads' relu(dot) * w summed vector by vector and the lanes
   reduced in a fixed tree. A score does not depend on the keys, rows or threads beside it. */
#include <immintrin.h>
#include <stdint.h>

#define INLINE static inline __attribute__((always_inline))
#define CHUNK 96        /* keys per work item: a multiple of every group size below, ~48 KiB of fp32 keys */

INLINE __m512 key_dim(const void *keys, int bf16, int64_t index) {
    if (bf16) {   /* bf16 widened exactly: its bits are fp32's top half */
        uint32_t bits = (uint32_t)((const uint16_t *)keys)[index] << 16;
        return _mm512_castsi512_ps(_mm512_set1_epi32((int32_t)bits));
    }
    return _mm512_set1_ps(((const float *)keys)[index]);
}

/* `group` keys (rows `stride` elements apart) against one query row: qt [D][16 * hv], w [16 * hv]. */
INLINE void scan_group(const float *qt, const float *w, const void *keys, int64_t stride, int bf16, int64_t D,
                       const int hv, const int group, float *out) {
    __m512 acc[24];
    for (int i = 0; i < group * hv; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d++) {
        __m512 qd[4];
        for (int v = 0; v < hv; v++) qd[v] = _mm512_loadu_ps(qt + d * 16 * hv + 16 * v);
        for (int g = 0; g < group; g++) {
            __m512 k = key_dim(keys, bf16, g * stride + d);
            for (int v = 0; v < hv; v++) acc[g * hv + v] = _mm512_fmadd_ps(qd[v], k, acc[g * hv + v]);
        }
    }
    for (int g = 0; g < group; g++) {
        __m512 s = _mm512_setzero_ps();
        for (int v = 0; v < hv; v++)
            s = _mm512_fmadd_ps(_mm512_max_ps(acc[g * hv + v], _mm512_setzero_ps()), _mm512_loadu_ps(w + 16 * v), s);
        out[g] = _mm512_reduce_add_ps(s);
    }
}

/* Keys [first, last) of one sequence against its rows: groups of `group`, the rest one by one. */
INLINE void scan_chunk(const float *qt, const float *w, const void *keys, int bf16, int64_t D, int64_t S,
                       int64_t T, int64_t first, int64_t last, float *out, const int hv, const int group) {
    const int64_t H = 16 * hv;
    const char *base = (const char *)keys;
    const int64_t el = bf16 ? 2 : 4;
    for (int64_t s = 0; s < S; s++) {
        int64_t t = first;
        for (; t + group <= last; t += group)
            scan_group(qt + s * D * H, w + s * H, base + t * D * el, D, bf16, D, hv, group, out + s * T + t);
        for (; t < last; t++)
            scan_group(qt + s * D * H, w + s * H, base + t * D * el, D, bf16, D, hv, 1, out + s * T + t);
    }
}

/* qt [B][S][D][H] fp32 (each row's heads transposed), w [B][S][H] fp32, keys: B sequences of T rows
   of D (fp32, or bf16 with `bf16`), `batch_stride` elements apart; out [B][S][T] fp32. H = 16, 32,
   48 or 64. */
void dsv4_indexer_scores(const float *qt, const float *w, int64_t B, int64_t S, int64_t H, int64_t D,
                         const void *keys, int64_t batch_stride, int64_t T, int bf16, float *out, int threads) {
    const int64_t chunks = (T + CHUNK - 1) / CHUNK;
    const int64_t el = bf16 ? 2 : 4;
#define SCAN(hv, group) scan_chunk(q, ws, k, bf16, D, S, T, first, last, o, hv, group)
    _Pragma("omp parallel for num_threads(threads) schedule(static) if (threads > 1)")
    for (int64_t item = 0; item < B * chunks; item++) {
        const int64_t b = item / chunks, first = item % chunks * CHUNK;
        const int64_t last = first + CHUNK < T ? first + CHUNK : T;
        const float *q = qt + b * S * D * H, *ws = w + b * S * H;
        const void *k = (const char *)keys + b * batch_stride * el;
        float *o = out + b * S * T;
        switch (H / 16) {
            case 1: SCAN(1, 24); break;
            case 2: SCAN(2, 12); break;
            case 3: SCAN(3, 8); break;
            default: SCAN(4, 6); break;
        }
    }
}
