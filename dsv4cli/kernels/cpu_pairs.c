/* Routed experts' GEMMs on a widened stack, for x86-64 CPUs with AVX2 and FMA (no AVX-512 VNNI: there
   torch's int8 GEMM is slow, and small int8 expert weights are held as fp32 of their values).

   y[p] = x[rows[p]] W[group[p]]^T for (row, expert) pairs sorted by expert, W [E, N, K] the int8 stack
   packed in blocks of 16 output columns, each block's k steps side by side ([E][N/16][K][16]): an
   expert's blocks are one sequential read (the fp32 [K, E*N] layout torch's GEMMs read strides across
   pages, and its 4x bytes fell out of the caches between layers: 244 us a projection in a step where
   the kernel alone took 39). Only the routed pairs are computed: torch's dense GEMM against every expert
   does E/k times the work, and its gather copies each pair's weight. A run of pairs on one expert goes
   TILE rows at a time, each block read once per tile, the tile's 2 * TILE accumulators in registers.

   x holds int8 values as fp32 (the quantised rows), the weights are widened in registers: every product
   and partial sum is an integer below 2^24, exact in fp32 in any order, so the result is the reference's
   bit for bit. */
#include <immintrin.h>
#include <stdint.h>

#define TILE 6
#define COLS 16

#define INLINE static inline __attribute__((always_inline))

/* One 16-column block of an expert's weight, [K][16] int8, against n rows: 16 int8 weights a k step,
   widened exactly to fp32 in registers. */
INLINE void pairs_tile(const float *x, int64_t K, const int64_t *rows, const int8_t *w, int64_t nblocks,
                       float *y, const int n) {
    const float *xr[TILE];
    for (int m = 0; m < n; m++) xr[m] = x + rows[m] * K;
    for (int64_t b = 0; b < nblocks; b++) {
        __m256 acc[2 * TILE];
        for (int i = 0; i < 2 * n; i++) acc[i] = _mm256_setzero_ps();
        const int8_t *wb = w + b * K * COLS;
        for (int64_t k = 0; k < K; k++) {
            __m128i v = _mm_loadu_si128((const __m128i *)(wb + k * COLS));
            __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
            __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8)));
            for (int m = 0; m < n; m++) {
                __m256 xb = _mm256_broadcast_ss(xr[m] + k);
                acc[2 * m] = _mm256_fmadd_ps(xb, w0, acc[2 * m]);
                acc[2 * m + 1] = _mm256_fmadd_ps(xb, w1, acc[2 * m + 1]);
            }
        }
        for (int m = 0; m < n; m++) {
            _mm256_storeu_ps(y + m * nblocks * COLS + b * COLS, acc[2 * m]);
            _mm256_storeu_ps(y + m * nblocks * COLS + b * COLS + 8, acc[2 * m + 1]);
        }
    }
}

/* x [R, K] fp32 (int8 values); rows, group [P] (group sorted; rows index x); w [E][N/16][K][16] int8
   (`native.pack_pairs`); y [P, N]. */
void dsv4_wide_pairs_mm(const float *x, int64_t K, const int64_t *rows, const int64_t *group, int64_t P,
                        const int8_t *w, int64_t N, float *y) {
    const int64_t nblocks = N / COLS;
    for (int64_t p0 = 0; p0 < P;) {
        int64_t p1 = p0 + 1;
        while (p1 < P && group[p1] == group[p0]) p1++;
        const int8_t *we = w + group[p0] * N * K;
        for (int64_t t = p0; t < p1; t += TILE) {
            int n = p1 - t < TILE ? (int)(p1 - t) : TILE;
            float *yt = y + t * N;
            switch (n) {        /* a constant row count each: the tile's loops unrolled */
            case 1: pairs_tile(x, K, rows + t, we, nblocks, yt, 1); break;
            case 2: pairs_tile(x, K, rows + t, we, nblocks, yt, 2); break;
            case 3: pairs_tile(x, K, rows + t, we, nblocks, yt, 3); break;
            case 4: pairs_tile(x, K, rows + t, we, nblocks, yt, 4); break;
            case 5: pairs_tile(x, K, rows + t, we, nblocks, yt, 5); break;
            default: pairs_tile(x, K, rows + t, we, nblocks, yt, 6); break;
            }
        }
        p0 = p1;
    }
}
