/* Float linears' few-row GEMM for x86-64 CPUs with AVX2 and FMA (no AVX-512: there `cpu_gemm.c` has its own),
   as the torch op dsv4::float_linear (its shape function is `native.py`'s).

   y = x W^T, x fp32 [M, K], W packed as `native.pack_float` lays it out: blocks of 32 output columns, each
   block's k steps one after another ([N/32][K][32]), in fp32 or bf16 (a weight whose values are bf16, read
   as half the bytes and widened exactly). MKL's fp32 GEMM reads V4 Flash's LM head [129280 x 4096] near the
   streaming read with one row but far below it with two or more (docs/decisions.md: Float weights take an
   AVX2 few-row GEMM): a DSpark step verifies 2-6 rows a slot and drafts 6, so the head took most of it.
   Here a block is one sequential read, taken KC k steps at a time so that every pass over it (tiles of rows,
   halves of 16 columns) after the first reads the chunk from cache: the weight leaves memory once for up to
   ROWS rows. Blocks split across torch's threads.

   A bf16 tile of 2 or more rows spends long enough on each line that the hardware prefetcher falls behind:
   it asks for the block AHEAD lines ahead (fp32 and one row gained nothing: docs/decisions.md, Software
   prefetch).

   Each output sums the same fp32 multiply-add chains in the same order whatever the row count, tile or thread
   count: a row's logits don't depend on which other rows share its step. */
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <stdint.h>
#include <torch/library.h>

#define TILE 6      /* rows a pass at most (`tile`) */
#define BLOCK 32    /* output columns per packed block (native.BLOCK) */
#define KC 512      /* k steps per chunk: a block's chunk is 32-64 KB, read from cache by every tile */
#define SUM 64      /* k steps per multiply-add chain, its sum then added to the total: rounding errors as MKL's */
#define PAR_BYTES (256 << 10)    /* weight bytes a thread takes at least: less costs more to split than it saves */
#define AHEAD 64    /* k steps (64-byte lines of a bf16 block) a tile of 2 or more bf16 rows asks for ahead */
#define ROWS 48     /* rows per group: a group's x at one chunk (96 KB) stays in cache too; a prefill's many
                       rows go group by group, each reading the weight again (48 multiply-adds per weight read) */

#define INLINE static inline __attribute__((always_inline))

/* 16 weights as two vectors of 8 fp32. bf16 widens by interleaving zero below each value: one load and two
   unpacks, the columns then in lane order 0-3 8-11 | 4-7 12-15 (`Weights<W>::interleaved`), put back in place
   when the sums are stored. */
template <typename W> struct Weights;

template <> struct Weights<float> {
    static constexpr bool interleaved = false;
    INLINE void load(const float *w, __m256 &lo, __m256 &hi) {
        lo = _mm256_loadu_ps(w);
        hi = _mm256_loadu_ps(w + 8);
    }
};

template <> struct Weights<uint16_t> {
    static constexpr bool interleaved = true;
    INLINE void load(const uint16_t *w, __m256 &lo, __m256 &hi) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)w), zero = _mm256_setzero_si256();
        lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, v));
        hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, v));
    }
};

/* y[0..16) += a 16-column pair of sums (in `Weights` order); the first chain's sum is stored as it is. */
template <typename W>
INLINE void add_sums(float *y, __m256 lo, __m256 hi, bool first) {
    if constexpr (Weights<W>::interleaved) {
        const __m256 a = _mm256_permute2f128_ps(lo, hi, 0x20), b = _mm256_permute2f128_ps(lo, hi, 0x31);
        lo = a;
        hi = b;
    }
    _mm256_storeu_ps(y, first ? lo : _mm256_add_ps(lo, _mm256_loadu_ps(y)));
    _mm256_storeu_ps(y + 8, first ? hi : _mm256_add_ps(hi, _mm256_loadu_ps(y + 8)));
}

/* n rows x `halves` 16-column halves of a block (from column `w`) over k in [k0, k1): chains of SUM
   multiply-adds, each chain's sum added to y's total. Every output's chains are the same whatever the shape
   of its tile, so `rows_tile` picks the shape by row count and weight type: 6 rows x 16 columns (12 chains,
   2 weight vectors and x in the 16 ymm registers), or 1-3 rows x 32 columns (four chains a row: one row's
   multiply-adds don't wait on each other's latency). */
template <typename W, int n, int halves>
INLINE void tile(const float *x, int64_t K, const W *w, int64_t k0, int64_t k1, float *y, int64_t N) {
    for (int64_t s0 = k0; s0 < k1; s0 += SUM) {
        const int64_t s1 = s0 + SUM < k1 ? s0 + SUM : k1;
        __m256 acc[n * halves * 2];
        for (int i = 0; i < n * halves * 2; i++) acc[i] = _mm256_setzero_ps();
        for (int64_t k = s0; k < s1; k++) {
            if constexpr (Weights<W>::interleaved && n >= 2)
                _mm_prefetch((const char *)(w + (k + AHEAD) * BLOCK), _MM_HINT_T0);
            for (int h = 0; h < halves; h++) {
                __m256 lo, hi;
                Weights<W>::load(w + k * BLOCK + h * 16, lo, hi);
                for (int m = 0; m < n; m++) {
                    const __m256 xb = _mm256_broadcast_ss(x + m * K + k);
                    acc[2 * (m * halves + h)] = _mm256_fmadd_ps(xb, lo, acc[2 * (m * halves + h)]);
                    acc[2 * (m * halves + h) + 1] = _mm256_fmadd_ps(xb, hi, acc[2 * (m * halves + h) + 1]);
                }
            }
        }
        for (int m = 0; m < n; m++)
            for (int h = 0; h < halves; h++)
                add_sums<W>(y + m * N + h * 16, acc[2 * (m * halves + h)], acc[2 * (m * halves + h) + 1], s0 == 0);
    }
}

/* n rows of a block's chunk: 1-3 as one tile of 32 columns; 4-6 fp32 as 3 rows and the rest, bf16 as two
   tiles of 16 columns (bf16's widening made its 3-row tiles the slower, while fp32's are the faster:
   docs/decisions.md, Float weights take an AVX2 few-row GEMM). */
template <typename W, int n>
INLINE void rows_tile(const float *x, int64_t K, const W *wb, int64_t k0, int64_t k1, float *y, int64_t N) {
    if constexpr (n <= 3) {
        tile<W, n, 2>(x, K, wb, k0, k1, y, N);
    } else if constexpr (!Weights<W>::interleaved) {
        tile<W, 3, 2>(x, K, wb, k0, k1, y, N);
        tile<W, n - 3, 2>(x + 3 * K, K, wb, k0, k1, y + 3 * N, N);
    } else {
        tile<W, n, 1>(x, K, wb, k0, k1, y, N);
        tile<W, n, 1>(x, K, wb + 16, k0, k1, y + 16, N);
    }
}

template <typename W>
static void float_mm(const float *x, int64_t M, int64_t K, const W *w, int64_t N, float *y) {
    for (int64_t r0 = 0; r0 < M; r0 += ROWS) {
        const int64_t r1 = r0 + ROWS < M ? r0 + ROWS : M;
        const int64_t bytes = K * BLOCK * sizeof(W), grain = (PAR_BYTES + bytes - 1) / bytes;
        at::parallel_for(0, N / BLOCK, grain, [&](int64_t b0, int64_t b1) {
            for (int64_t b = b0; b < b1; b++) {
                const W *wb = w + b * K * BLOCK;
                for (int64_t k0 = 0; k0 < K; k0 += KC) {
                    const int64_t k1 = k0 + KC < K ? k0 + KC : K;
                    for (int64_t t = r0; t < r1; t += TILE) {
                        const float *xt = x + t * K;
                        float *yt = y + t * N + b * BLOCK;
                        switch (r1 - t < TILE ? r1 - t : TILE) {     /* a constant row count each: unrolled */
                        case 1: rows_tile<W, 1>(xt, K, wb, k0, k1, yt, N); break;
                        case 2: rows_tile<W, 2>(xt, K, wb, k0, k1, yt, N); break;
                        case 3: rows_tile<W, 3>(xt, K, wb, k0, k1, yt, N); break;
                        case 4: rows_tile<W, 4>(xt, K, wb, k0, k1, yt, N); break;
                        case 5: rows_tile<W, 5>(xt, K, wb, k0, k1, yt, N); break;
                        default: rows_tile<W, 6>(xt, K, wb, k0, k1, yt, N); break;
                        }
                    }
                }
            }
        });
    }
}

/* x [M, K] fp32; packed [N/32, K, 32] fp32 or bf16 (`native.pack_float`) -> y fp32 [M, N]. */
static at::Tensor float_linear(const at::Tensor &x, const at::Tensor &packed) {
    TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && packed.dim() == 3 && packed.size(1) == x.size(1)
                && packed.size(2) == BLOCK && (packed.scalar_type() == at::kFloat || packed.scalar_type() == at::kBFloat16),
                "float_linear: x [M, K] fp32, packed [N/32, K, 32] fp32 or bf16");
    const at::Tensor xc = x.contiguous(), wc = packed.contiguous();
    const int64_t m = x.size(0), k = x.size(1), n = packed.size(0) * BLOCK;
    at::Tensor y = at::empty({m, n}, x.options());
    if (m == 0 || n == 0)
        return y;
    if (k == 0)
        return y.zero_();
    if (wc.scalar_type() == at::kFloat)
        float_mm(xc.data_ptr<float>(), m, k, wc.data_ptr<float>(), n, y.data_ptr<float>());
    else
        float_mm(xc.data_ptr<float>(), m, k, (const uint16_t *)wc.data_ptr<at::BFloat16>(), n, y.data_ptr<float>());
    return y;
}

TORCH_LIBRARY_FRAGMENT(dsv4, m) {
    m.def("float_linear(Tensor x, Tensor packed) -> Tensor");
}

TORCH_LIBRARY_IMPL(dsv4, CPU, m) {
    m.impl("float_linear", float_linear);
}
