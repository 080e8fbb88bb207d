/* Routed experts' GEMMs for x86-64 CPUs with AVX2 (no AVX-512 VNNI: there torch's int8 GEMM is slow),
   as the torch op dsv4::expert_pairs_mm, and int8 linears' as dsv4::pairs_linear (their shape
   functions are `native.py`'s).

   y[p] = x[rows[p]] W[group[p]]^T for (row, expert) pairs sorted by expert, x int8, W [E, N, K] the int8
   stack packed in blocks of 16 output columns, each block's k steps side by side in pairs
   ([E][N/16][K/2][16][2]): an expert's blocks are one sequential read (the fp32 [K, E*N] layout torch's
   GEMMs read strides across pages, and its 4x bytes fell out of the caches between layers: the profile
   in benchmarks/README.md, `dsv4 bench`). Only the routed pairs are computed: torch's
   dense GEMM against every expert does E/k times the work, and its gather copies each pair's weight. A
   run of pairs on one expert goes block by block, each block through every tile of TILE rows (from cache
   after the first), the tile's 2 * TILE accumulators in registers.

   Each k pair of 8 columns is one vpmaddwd of the weights widened to int16 against the row's two x
   values: int32 sums, exact up to K = MAX_K, converted to fp32 as torch's .float() of torch._int_mm's
   int32 sums, so the result is that bit for bit (exact in fp32 up to K = 1024). Faster than fp32 FMAs of
   the weights widened in registers, which spent four conversions on every 16 weights where a tile's one
   or two rows then used them twice (docs/decisions.md: Small int8 weights widened).

   Tiles of 3 or more rows spend long enough on each line that the hardware prefetcher falls behind: they ask
   for the weight AHEAD k pairs ahead (1-2 rows were slower with it: docs/decisions.md, Software prefetch).

   A C++ op, not a Python custom op: a step calls it a dozen times or more, and a Python op's dispatch
   inside a compiled graph cost more than the kernel's own time (docs/decisions.md: Small int8 weights
   widened). */
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <stdint.h>
#include <numeric>
#include <vector>
#include <torch/library.h>

#define TILE 6
#define COLS 16
#define MAX_K 131072   /* K products of |v| <= 128 sum within int32 */
#define AHEAD 64       /* k pairs (32 bytes each) a tile of 3 or more rows asks for ahead */
#define PAR_BYTES (256 << 10)    /* weight bytes a thread takes at least: less costs more to split than it saves */

#define INLINE static inline __attribute__((always_inline))

/* One block of 16 output columns for a tile of n rows (their k pairs xr, [n][K/2]) against an expert's
   [N/16][K/2][16][2] weight. */
INLINE void pairs_tile(const int32_t *xr, int64_t K2, const int8_t *wb, float *y, int64_t N, const int n) {
    __m256i acc[2 * TILE];
    for (int i = 0; i < 2 * n; i++) acc[i] = _mm256_setzero_si256();
    for (int64_t k = 0; k < K2; k++) {
        if (n >= 3 && (k & 1) == 0)     /* one line a request */
            _mm_prefetch((const char *)(wb + (k + AHEAD) * 2 * COLS), _MM_HINT_T0);
        __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(wb + k * 2 * COLS)));
        __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(wb + k * 2 * COLS + COLS)));
        for (int m = 0; m < n; m++) {
            __m256i xb = _mm256_set1_epi32(xr[m * K2 + k]);
            acc[2 * m] = _mm256_add_epi32(acc[2 * m], _mm256_madd_epi16(xb, w0));
            acc[2 * m + 1] = _mm256_add_epi32(acc[2 * m + 1], _mm256_madd_epi16(xb, w1));
        }
    }
    for (int m = 0; m < n; m++) {
        _mm256_storeu_ps(y + m * N, _mm256_cvtepi32_ps(acc[2 * m]));
        _mm256_storeu_ps(y + m * N + 8, _mm256_cvtepi32_ps(acc[2 * m + 1]));
    }
}

/* A run of pairs on one expert splits its blocks across torch's threads (at least PAR_BYTES of weight a
   thread; with one thread no parallel region at all): each block is read once, then from cache by the run's
   every tile. Blocks are independent, so the sums are the same bits for any thread count. */
static void pairs_mm(const int8_t *x, int64_t K, const int64_t *rows, const int64_t *group, int64_t P,
                     const int8_t *w, int64_t N, float *y) {
    const int64_t nblocks = N / COLS, K2 = K / 2, grain = (PAR_BYTES + K * COLS - 1) / (K * COLS);
    int64_t longest = 0;
    for (int64_t p0 = 0, p = 0; p <= P; p++)
        if (p == P || group[p] != group[p0]) {
            longest = p - p0 > longest ? p - p0 : longest;
            p0 = p;
        }
    std::vector<int32_t> xr(longest * K2);     /* a run's rows as k pairs of two int16 in one int32 (vpmaddwd's) */
    for (int64_t p0 = 0; p0 < P;) {
        int64_t p1 = p0 + 1;
        while (p1 < P && group[p1] == group[p0]) p1++;
        for (int64_t p = p0; p < p1; p++) {
            const int8_t *xp = x + rows[p] * K;
            for (int64_t k = 0; k < K2; k++)
                xr[(p - p0) * K2 + k] = (int32_t)((uint16_t)xp[2 * k] | ((uint32_t)(uint16_t)xp[2 * k + 1] << 16));
        }
        const int8_t *we = w + group[p0] * N * K;
        const int32_t *xrun = xr.data();
        const int64_t first = p0, last = p1;
        auto blocks = [=](int64_t b0, int64_t b1) {
            for (int64_t b = b0; b < b1; b++)
                for (int64_t t = first; t < last; t += TILE) {
                    const int32_t *xt = xrun + (t - first) * K2;
                    const int8_t *wb = we + b * K * COLS;
                    float *yt = y + t * N + b * COLS;
                    switch (last - t < TILE ? (int)(last - t) : TILE) {    /* a constant row count each: unrolled */
                    case 1: pairs_tile(xt, K2, wb, yt, N, 1); break;
                    case 2: pairs_tile(xt, K2, wb, yt, N, 2); break;
                    case 3: pairs_tile(xt, K2, wb, yt, N, 3); break;
                    case 4: pairs_tile(xt, K2, wb, yt, N, 4); break;
                    case 5: pairs_tile(xt, K2, wb, yt, N, 5); break;
                    default: pairs_tile(xt, K2, wb, yt, N, 6); break;
                    }
                }
        };
        if (at::get_num_threads() > 1 && nblocks >= 2 * grain)
            at::parallel_for(0, nblocks, grain, blocks);
        else
            blocks(0, nblocks);
        p0 = p1;
    }
}

static void check(const at::Tensor &x, const at::Tensor &packed) {
    TORCH_CHECK(x.scalar_type() == at::kChar && x.dim() == 2 && x.size(1) <= MAX_K && packed.scalar_type() == at::kChar
                && packed.dim() == 5 && packed.size(2) * 2 == x.size(1) && packed.size(3) == COLS,
                "pair GEMMs: x [R, K<=131072] int8, packed [E, N/16, K/2, 16, 2] int8");
}

/* x [R, K] int8; rows, group [P] int64 (group sorted, rows index x); packed [E, N/16, K/2, 16, 2] int8
   (`native.pack_pairs`) -> y fp32 [P, N]. */
static at::Tensor expert_pairs_mm(const at::Tensor &x, const at::Tensor &rows, const at::Tensor &group,
                                  const at::Tensor &packed) {
    check(x, packed);
    TORCH_CHECK(rows.scalar_type() == at::kLong && group.scalar_type() == at::kLong && rows.numel() == group.numel(),
                "expert_pairs_mm: rows and group [P] int64");
    const at::Tensor xc = x.contiguous(), rc = rows.contiguous(), gc = group.contiguous(), wc = packed.contiguous();
    const int64_t n = packed.size(1) * COLS;
    at::Tensor y = at::empty({rows.numel(), n}, x.options().dtype(at::kFloat));
    pairs_mm(xc.data_ptr<int8_t>(), x.size(1), rc.data_ptr<int64_t>(), gc.data_ptr<int64_t>(), rows.numel(),
             wc.data_ptr<int8_t>(), n, y.data_ptr<float>());
    return y;
}

/* An int8 linear's GEMM (`cpu.widen_w8a8`): x [M, K] int8 against one weight packed as a one-expert
   stack [1, N/16, K/2, 16, 2] -> fp32 [M, N]: every row a pair of expert 0. */
static at::Tensor pairs_linear(const at::Tensor &x, const at::Tensor &packed) {
    check(x, packed);
    const int64_t m = x.size(0), n = packed.size(1) * COLS;
    std::vector<int64_t> rows(m), group(m, 0);
    std::iota(rows.begin(), rows.end(), 0);
    const at::Tensor xc = x.contiguous(), wc = packed.contiguous();
    at::Tensor y = at::empty({m, n}, x.options().dtype(at::kFloat));
    pairs_mm(xc.data_ptr<int8_t>(), x.size(1), rows.data(), group.data(), m, wc.data_ptr<int8_t>(), n,
             y.data_ptr<float>());
    return y;
}

TORCH_LIBRARY_FRAGMENT(dsv4, m) {
    m.def("expert_pairs_mm(Tensor x, Tensor rows, Tensor group, Tensor packed) -> Tensor");
    m.def("pairs_linear(Tensor x, Tensor packed) -> Tensor");
}

TORCH_LIBRARY_IMPL(dsv4, CPU, m) {
    m.impl("expert_pairs_mm", expert_pairs_mm);
    m.impl("pairs_linear", pairs_linear);
}
