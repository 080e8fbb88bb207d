/* Routed experts' GEMMs on a widened stack, for x86-64 CPUs with AVX2 and FMA (no AVX-512 VNNI: there
   torch's int8 GEMM is slow, and small int8 expert weights are held as fp32 of their values).

   y[p] = x[rows[p]] . W[:, group[p]*N : (group[p]+1)*N] for (row, expert) pairs sorted by expert, with
   W [K, E*N] the widened stack. Only the routed pairs are computed: torch's dense GEMM against every
   expert does E/k times the work, and its gather copies each pair's weight. A run of pairs on one expert
   goes TILE rows at a time, each 16-column block of the expert's slice read once per tile, the tile's
   2 * TILE accumulators in registers.

   x and W hold int8 values (the quantised rows, the int8 weights): every product and partial sum is an
   integer below 2^24, exact in fp32 in any order, so the result is the reference's bit for bit. */
#include <immintrin.h>
#include <stdint.h>

#define TILE 6
#define COLS 16

#define INLINE static inline __attribute__((always_inline))

INLINE void pairs_tile(const float *x, int64_t K, const int64_t *rows, const float *w, int64_t ldw, float *y,
                       int64_t N, const int n) {
    const float *xr[TILE];
    for (int m = 0; m < n; m++) xr[m] = x + rows[m] * K;
    for (int64_t c = 0; c < N; c += COLS) {
        __m256 acc[2 * TILE];
        for (int i = 0; i < 2 * n; i++) acc[i] = _mm256_setzero_ps();
        const float *wc = w + c;
        for (int64_t k = 0; k < K; k++, wc += ldw) {
            __m256 w0 = _mm256_loadu_ps(wc), w1 = _mm256_loadu_ps(wc + 8);
            for (int m = 0; m < n; m++) {
                __m256 b = _mm256_broadcast_ss(xr[m] + k);
                acc[2 * m] = _mm256_fmadd_ps(b, w0, acc[2 * m]);
                acc[2 * m + 1] = _mm256_fmadd_ps(b, w1, acc[2 * m + 1]);
            }
        }
        for (int m = 0; m < n; m++) {
            _mm256_storeu_ps(y + m * N + c, acc[2 * m]);
            _mm256_storeu_ps(y + m * N + c + 8, acc[2 * m + 1]);
        }
    }
}

/* x [R, K]; rows, group [P] (group sorted; rows index x); w [K, E*N] row-major; y [P, N]. N % 16 == 0. */
void dsv4_wide_pairs_mm(const float *x, int64_t K, const int64_t *rows, const int64_t *group, int64_t P,
                        const float *w, int64_t E, int64_t N, float *y) {
    for (int64_t p0 = 0; p0 < P;) {
        int64_t p1 = p0 + 1;
        while (p1 < P && group[p1] == group[p0]) p1++;
        const float *we = w + group[p0] * N;
        for (int64_t t = p0; t < p1; t += TILE) {
            int n = p1 - t < TILE ? (int)(p1 - t) : TILE;
            float *yt = y + t * N;
            switch (n) {        /* a constant row count each: the tile's loops unrolled */
            case 1: pairs_tile(x, K, rows + t, we, E * N, yt, N, 1); break;
            case 2: pairs_tile(x, K, rows + t, we, E * N, yt, N, 2); break;
            case 3: pairs_tile(x, K, rows + t, we, E * N, yt, N, 3); break;
            case 4: pairs_tile(x, K, rows + t, we, E * N, yt, N, 4); break;
            case 5: pairs_tile(x, K, rows + t, we, E * N, yt, N, 5); break;
            default: pairs_tile(x, K, rows + t, we, E * N, yt, N, 6); break;
            }
        }
        p0 = p1;
    }
}
