/* The compressors' pooling for x86-64 CPUs with AVX-512: each block a call closes pools its candidate rows (the
   window ring's rows of earlier calls and this call's rows, read in place by index) into one KV entry, a
   per-channel softmax of the gate over the rows weighting the kv rows.

   torch gathers the candidates of every block slot a call has, closing or not, into fp32 copies of kv and gate
   and runs a where, a masked fill, a softmax, a product and a sum over them: ~1 ms an HCA layer (128 rows x 512
   channels) in every decode step on a Zen 4 core, for a block that closes once in 128 steps
   (docs/decisions.md: The compressors' pooling in one native pass). Here a slot whose block does not close is
   written as zeros (the engine sends it to the sink slot, never read), and a closing one runs channels in
   vectors: the maximum, exp, sum and weighted sum over its rows in order, masked rows skipped.

   Row j of a block's span * ratio candidates gives output channel o its channel (j / ratio) * D + o: ratio 4's
   overlapping blocks take the first half of the earlier block's rows and the second half of their own. */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "cpu_exp.h"

/* ring_kv, ring_gate [B][R][C] and kv, gate [B][S][C] fp32 (rows C apart, sequences the batch strides apart);
   per block slot [B][n] whether it closes, and per candidate [B][n][c] whether it is read from the ring, its
   ring row, its chunk row and whether it exists; c = span * ratio, C = span * D. out [B][n][D] fp32. D a
   multiple of 16. */
void dsv4_compress_blocks(const float *ring_kv, const float *ring_gate, int64_t ring_stride, const float *kv,
                          const float *gate, int64_t chunk_stride, int64_t B, int64_t n, int64_t c, int64_t C,
                          int64_t D, int64_t ratio, const uint8_t *closes, const uint8_t *from_ring,
                          const int64_t *ring_row, const int64_t *chunk_row, const uint8_t *valid, float *out,
                          int threads) {
    _Pragma("omp parallel for num_threads(threads) schedule(static) if (threads > 1 && B * n > 1)")
    for (int64_t item = 0; item < B * n; item++) {
        const int64_t b = item / n;
        float *o = out + item * D;
        if (!closes[item]) {
            memset(o, 0, D * sizeof *o);
            continue;
        }
        const float *rows_kv[1024], *rows_gate[1024];   /* the block's existing candidates, in order */
        int64_t m = 0;
        for (int64_t j = 0; j < c && j < 1024; j++) {
            int64_t at = item * c + j;
            if (!valid[at]) continue;
            int64_t shift = j / ratio * D;           /* the channel half this row gives */
            if (from_ring[at]) {
                rows_kv[m] = ring_kv + b * ring_stride + ring_row[at] * C + shift;
                rows_gate[m] = ring_gate + b * ring_stride + ring_row[at] * C + shift;
            } else {
                rows_kv[m] = kv + b * chunk_stride + chunk_row[at] * C + shift;
                rows_gate[m] = gate + b * chunk_stride + chunk_row[at] * C + shift;
            }
            m++;
        }
        for (int64_t d = 0; d < D; d += 16) {
            __m512 mx = _mm512_set1_ps(-__builtin_inff());
            for (int64_t j = 0; j < m; j++) mx = _mm512_max_ps(mx, _mm512_loadu_ps(rows_gate[j] + d));
            __m512 sum = _mm512_setzero_ps(), acc = _mm512_setzero_ps();
            for (int64_t j = 0; j < m; j++) {
                __m512 e = exp_le0(_mm512_sub_ps(_mm512_loadu_ps(rows_gate[j] + d), mx));
                sum = _mm512_add_ps(sum, e);
                acc = _mm512_fmadd_ps(e, _mm512_loadu_ps(rows_kv[j] + d), acc);
            }
            _mm512_storeu_ps(o + d, _mm512_div_ps(acc, sum));
        }
    }
}
