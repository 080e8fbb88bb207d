/* Few-row GEMMs for x86-64 CPUs with AVX-512 VNNI (and AMX for int8 where there is one):
   y [M,N] = x [M,K] W^T, each weight byte read once.

   A decode step multiplies 1-16 rows by weights far larger than any cache, so its GEMMs are the
   weights' streaming read. The packed layout keeps that read sequential: blocks of 32 output
   channels, and within a block the channels of each k step side by side, so one pass over a block
   feeds up to 8 rows' accumulators (more rows: the block, now in L2, is read again per 8 rows; with
   1-4 rows, 2-4 blocks are read side by side). Every output channel sums its products in the same
   order whatever M is, so a row's result does not depend on the rows beside it.

   int8:  wp [N/32][K/4][32][4] uint8 = w + 128 (VNNI and AMX's TDPBSUD multiply signed x bytes by
          unsigned w bytes); the sums of (w+128) x are exact int32, less 128 sum(x) per row, returned
          as float (unit scales). A 16-channel half of a block over 64 k is an AMX B tile as it lies.
   float: wp [N/32][K][32] fp32, or bf16 (a weight whose values are bf16, as the checkpoints store
          them: half the bytes to read, widened exactly in registers, the same sums) as [N/32][K][16][2],
          channels j and 16 + j side by side: a 32-bit lane widens to both with one shift and one mask,
          where unpacking 16-bit values to 32 bits took three shuffles that share the FMAs' ports (the gain:
          docs/decisions.md, Our own few-row GEMMs). */
#include "cpu_load.h"
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define BLOCK 32
#define TILE_ROWS 8
/* Tiles of 5-8 rows read one block and spend long on each line: they ask for the weight PREFETCH bytes ahead.
   Tiles of 1-4 rows read 2-4 blocks side by side, which the hardware prefetchers follow by themselves: there
   the instructions cost. Measured on Sapphire Rapids and Zen 4: docs/decisions.md, Software prefetch. */
#define PREFETCH 4096
#define PREFETCH_ROWS 5

#define INLINE static inline __attribute__((always_inline))

/* A tile: `rows` rows of x against `streams` blocks read side by side (a few concurrent streams read
   faster than one: docs/decisions.md, Our own few-row GEMMs), rows * streams <= 8 so
   the 2 * rows * streams accumulators stay in registers. Blocks are `stride` elements apart. */
INLINE void int8_tile(const int8_t *x, int64_t K, const uint8_t *w, int64_t stride, const int32_t *xsum,
                      float *y, int64_t N, const int rows, const int streams) {
    __m512i acc[2 * TILE_ROWS];
    for (int i = 0; i < 2 * rows * streams; i++) acc[i] = _mm512_setzero_si512();
    for (int64_t k = 0; k < K; k += 4, w += 4 * BLOCK) {
        __m512i xk[TILE_ROWS];
        for (int m = 0; m < rows; m++) xk[m] = _mm512_set1_epi32(*(const int32_t *)(x + m * K + k));
        for (int s = 0; s < streams; s++) {
            const uint8_t *ws = w + s * stride;
            if (rows >= PREFETCH_ROWS) {
                _mm_prefetch((const char *)ws + PREFETCH, _MM_HINT_T0);
                _mm_prefetch((const char *)ws + PREFETCH + 64, _MM_HINT_T0);
            }
            __m512i w0 = _mm512_loadu_si512(ws), w1 = _mm512_loadu_si512(ws + 64);
            for (int m = 0; m < rows; m++) {
                acc[2 * (s * rows + m)] = _mm512_dpbusd_epi32(acc[2 * (s * rows + m)], w0, xk[m]);
                acc[2 * (s * rows + m) + 1] = _mm512_dpbusd_epi32(acc[2 * (s * rows + m) + 1], w1, xk[m]);
            }
        }
    }
    for (int s = 0; s < streams; s++)
        for (int m = 0; m < rows; m++) {
            __m512i c = _mm512_set1_epi32(128 * xsum[m]);
            float *out = y + m * N + s * BLOCK;
            _mm512_storeu_ps(out, _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[2 * (s * rows + m)], c)));
            _mm512_storeu_ps(out + 16, _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[2 * (s * rows + m) + 1], c)));
        }
}

/* fp32 sums run in chunks of FLOAT_CHUNK k steps, each added to the row's total: one chain of K
   additions had several times the rms error of MKL's GEMM at large K; chunks of 32 keep it near MKL's at
   the same speed as longer ones (docs/decisions.md: Our own few-row GEMMs, Exactness). */
#define FLOAT_CHUNK 32

/* The 32 weights of one k step of a block, as fp32: read as they are, or bf16 widened (exactly): each lane
   holds channel j in its low half and 16 + j in its high half. */
INLINE void block_weights(const void *w, int64_t i, const int bf16, __m512 *lo, __m512 *hi) {
    if (bf16) {
        __m512i v = _mm512_loadu_si512((const uint16_t *)w + i);
        *lo = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
        *hi = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xffff0000u)));
    } else {
        *lo = _mm512_loadu_ps((const float *)w + i);
        *hi = _mm512_loadu_ps((const float *)w + i + 16);
    }
}

/* `w` (fp32, or bf16 with `bf16`): the first block, element `stride` the next; sums in fp32 either way,
   so a bf16-held weight gives the bits its fp32 copy gives. */
INLINE void float_tile(const float *x, int64_t K, const void *w, int64_t stride, float *y, int64_t N,
                       const int rows, const int streams, const int bf16) {
    __m512 acc[2 * TILE_ROWS];
    const int size = bf16 ? 2 : 4;
    for (int64_t k0 = 0; k0 < K; k0 += FLOAT_CHUNK) {
        int64_t k1 = k0 + FLOAT_CHUNK < K ? k0 + FLOAT_CHUNK : K;
        for (int i = 0; i < 2 * rows * streams; i++) acc[i] = _mm512_setzero_ps();
        for (int64_t k = k0; k < k1; k++) {
            __m512 xk[TILE_ROWS];
            for (int m = 0; m < rows; m++) xk[m] = _mm512_set1_ps(x[m * K + k]);
            for (int s = 0; s < streams; s++) {
                int64_t i = s * stride + k * BLOCK;
                if (rows >= PREFETCH_ROWS) {
                    const char *next = (const char *)w + i * size + PREFETCH;
                    _mm_prefetch(next, _MM_HINT_T0);
                    if (!bf16) _mm_prefetch(next + 64, _MM_HINT_T0);
                }
                __m512 w0, w1;
                block_weights(w, i, bf16, &w0, &w1);
                for (int m = 0; m < rows; m++) {
                    acc[2 * (s * rows + m)] = _mm512_fmadd_ps(w0, xk[m], acc[2 * (s * rows + m)]);
                    acc[2 * (s * rows + m) + 1] = _mm512_fmadd_ps(w1, xk[m], acc[2 * (s * rows + m) + 1]);
                }
            }
        }
        for (int s = 0; s < streams; s++)
            for (int m = 0; m < rows; m++) {
                float *out = y + m * N + s * BLOCK;
                __m512 lo = acc[2 * (s * rows + m)], hi = acc[2 * (s * rows + m) + 1];
                if (k0) {
                    lo = _mm512_add_ps(lo, _mm512_loadu_ps(out));
                    hi = _mm512_add_ps(hi, _mm512_loadu_ps(out + 16));
                }
                _mm512_storeu_ps(out, lo);
                _mm512_storeu_ps(out + 16, hi);
            }
    }
}

/* Blocks read side by side for a tile of this many rows, a block `block_bytes` long. One float row over blocks
   under 64 KiB reads them one after another: four such short streams never get going (the Markov head's
   [129280 x 256] bf16, 16 KiB blocks; docs/decisions.md: One float row over short blocks). */
static int streams_for(int64_t rows, int64_t block_bytes) {
    return rows == 1 && block_bytes < (64 << 10) ? 1 : rows <= 2 ? 4 : rows <= 4 ? 2 : 1;
}

/* Constant rows and streams per call, so each tile's loops unroll and its accumulators stay in registers. */
#define BY_SHAPE(rows, streams, call) switch ((rows) * 8 + (streams)) { \
    case 1 * 8 + 4: call(1, 4); break; case 2 * 8 + 4: call(2, 4); break; \
    case 3 * 8 + 2: call(3, 2); break; case 4 * 8 + 2: call(4, 2); break; \
    case 1 * 8 + 1: call(1, 1); break; case 2 * 8 + 1: call(2, 1); break; case 3 * 8 + 1: call(3, 1); break; \
    case 4 * 8 + 1: call(4, 1); break; case 5 * 8 + 1: call(5, 1); break; case 6 * 8 + 1: call(6, 1); break; \
    case 7 * 8 + 1: call(7, 1); break; case 8 * 8 + 1: call(8, 1); break; default: __builtin_trap(); }

#ifdef __AMX_INT8__
/* AMX (Sapphire Rapids and later): a tile multiply does 16 rows x 16 channels x 64 k, so rows past
   the few that VNNI keeps at the weight's bandwidth (and prefill's hundreds) still stream the weight.
   Linux hands out the tile registers on request (arch_prctl), once per process. */
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* Tiles: 0-3 sums (rows 0-15 of the pair x channels 0-15 and 16-31, then rows 16-31), 4-5 x, 6-7 w. */
static void configure_tiles(int rows0, int rows1) {
    struct tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    int rows[8] = {rows0, rows0, rows1, rows1, rows0, rows1, 16, 16};
    for (int t = 0; t < 8; t++) {
        c.rows[t] = (uint8_t)rows[t];
        c.colsb[t] = rows[t] ? 64 : 0;
    }
    _tile_loadconfig(&c);
}

static void amx_sums_out(int rows, const int32_t *sums, const int32_t *xsum, float *y, int64_t N) {
    for (int m = 0; m < rows; m++) {
        __m512i c = _mm512_set1_epi32(128 * xsum[m]);
        _mm512_storeu_ps(y + m * N, _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_loadu_si512(sums + 16 * m), c)));
    }
}

/* One block of 32 channels against every row, 32 rows at a time: each k step loads the block's
   two 16-channel halves once for both 16-row tiles. `config` holds the row counts configured. */
static void amx_block(const int8_t *x, int64_t M, int64_t K, const uint8_t *w, const int32_t *xsum,
                      float *y, int64_t N, int *config) {
    int32_t sums[16 * 16];
    for (int64_t m0 = 0; m0 < M; m0 += 32) {
        int rows0 = M - m0 < 16 ? (int)(M - m0) : 16;
        int rows1 = M - m0 - 16 <= 0 ? 0 : M - m0 - 16 < 16 ? (int)(M - m0 - 16) : 16;
        if (config[0] != rows0 || config[1] != rows1) {
            configure_tiles(rows0, rows1);
            config[0] = rows0, config[1] = rows1;
        }
        const int8_t *x0 = x + m0 * K, *x1 = x0 + 16 * K;
        _tile_zero(0);
        _tile_zero(1);
        if (rows1) {
            _tile_zero(2);
            _tile_zero(3);
        }
        for (int64_t k = 0; k < K; k += 64) {
            _tile_loadd(6, w + k * BLOCK, 4 * BLOCK);
            _tile_loadd(7, w + k * BLOCK + 64, 4 * BLOCK);
            _tile_loadd(4, x0 + k, K);
            _tile_dpbsud(0, 4, 6);
            _tile_dpbsud(1, 4, 7);
            if (rows1) {
                _tile_loadd(5, x1 + k, K);
                _tile_dpbsud(2, 5, 6);
                _tile_dpbsud(3, 5, 7);
            }
        }
        float *out = y + m0 * N;
        _tile_stored(0, sums, 64);
        amx_sums_out(rows0, sums, xsum + m0, out, N);
        _tile_stored(1, sums, 64);
        amx_sums_out(rows0, sums, xsum + m0, out + 16, N);
        if (rows1) {
            _tile_stored(2, sums, 64);
            amx_sums_out(rows1, sums, xsum + m0 + 16, out + 16 * N, N);
            _tile_stored(3, sums, 64);
            amx_sums_out(rows1, sums, xsum + m0 + 16, out + 16 * N + 16, N);
        }
    }
}
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* Both GEMMs: the blocks split across threads in groups of `streams`; a group's blocks go through
   every 8-row tile of x (from L2 after the first), the last blocks one at a time. */
#define GEMM_BLOCKS(TILE, BLOCK_BYTES)                                                             \
    int64_t blocks = N / BLOCK, streams = streams_for(M < TILE_ROWS ? M : TILE_ROWS, BLOCK_BYTES);  \
    int64_t groups = blocks / streams, count = groups + blocks % streams;                           \
    _Pragma("omp parallel for schedule(static) num_threads(threads) if (threads > 1)")             \
    for (int64_t g = 0; g < count; g++) {                                                           \
        int64_t b = g < groups ? g * streams : groups * streams + (g - groups);                     \
        int n = g < groups ? (int)streams : 1;                                                       \
        for (int64_t m0 = 0; m0 < M; m0 += TILE_ROWS) {                                             \
            int rows = M - m0 < TILE_ROWS ? (int)(M - m0) : TILE_ROWS;                               \
            BY_SHAPE(rows, n, TILE)                                                                     \
        }                                                                                           \
    }

/* Whether this process may use AMX tiles (asks Linux once); 0 where the build or the CPU has none. */
int dsv4_amx_enable(void) {
#ifdef __AMX_INT8__
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
#else
    return 0;
#endif
}

/* `amx`: take the AMX path (dsv4_amx_enable said yes, K % 64 == 0, and rows past VNNI's best). */
void dsv4_int8_mm(const int8_t *x, int64_t M, int64_t K, const uint8_t *wp, int64_t N, float *y, int threads,
                  int amx) {
    int32_t xsum[M];
    for (int64_t m = 0; m < M; m++) {
        int32_t s = 0;
        for (int64_t k = 0; k < K; k++) s += x[m * K + k];
        xsum[m] = s;
    }
#ifdef __AMX_INT8__
    if (amx) {
        _Pragma("omp parallel num_threads(threads) if (threads > 1)")
        {
            int config[2] = {-1, -1};
            _Pragma("omp for schedule(static)")
            for (int64_t b = 0; b < N / BLOCK; b++)
                amx_block(x, M, K, wp + b * K * BLOCK, xsum, y + b * BLOCK, N, config);
            _tile_release();
        }
        return;
    }
#endif
#define INT8_TILE(r, s) int8_tile(x + m0 * K, K, wp + b * K * BLOCK, K * BLOCK, xsum + m0, \
                                  y + m0 * N + b * BLOCK, N, r, s)
    GEMM_BLOCKS(INT8_TILE, INT64_MAX)      /* int8: one row reads as fast with one stream as with four */
}

void dsv4_float_mm(const float *x, int64_t M, int64_t K, const float *wp, int64_t N, float *y, int threads) {
#define FLOAT_TILE(r, s) float_tile(x + m0 * K, K, wp + b * K * BLOCK, K * BLOCK, y + m0 * N + b * BLOCK, N, r, s, 0)
    GEMM_BLOCKS(FLOAT_TILE, K * BLOCK * 4)
}

/* dsv4_float_mm with the weight held in bf16 (`wp` [N/32][K][16][2] bf16 bits). */
void dsv4_bf16_mm(const float *x, int64_t M, int64_t K, const uint16_t *wp, int64_t N, float *y, int threads) {
#define BF16_TILE(r, s) float_tile(x + m0 * K, K, wp + b * K * BLOCK, K * BLOCK, y + m0 * N + b * BLOCK, N, r, s, 1)
    GEMM_BLOCKS(BF16_TILE, K * BLOCK * 2)
}

/* ---- routed W8A8 experts, whole ---------------------------------------------------------------
   A decode step runs each routed expert on a few rows. In torch that is some thirty small ops per
   expert around its three GEMMs (gathers, scales, SwiGLU, the per-token quantisation of its
   intermediate, index_add_), a third of the MoE's time at V4 Flash's widths. Here one call runs them
   all, with the reference's arithmetic in the reference's order (kernels/__init__.py `expert_ffn`,
   `reference.w8a8_linear`, `reference.quantize_per_token`), so the sums are its sums; only SwiGLU's
   exp is libm's rather than torch's (both within an ulp). */

#define AMAX_FLOOR 1e-4f    /* reference.AMAX_FLOOR */

/* One row's int8 sums back to values: (acc * token scale) * channel scale, in the activations' dtype. */
static inline void scale_row(const float *acc, float sx, const float *sw, int64_t N, int bf16, float *out) {
    for (int64_t c = 0; c < N; c++) {
        float v = acc[c] * sx * sw[c];
        out[c] = bf16 ? round_bf16(v) : v;
    }
}

/* Symmetric int8 per row: scale = max(amax, floor) / 127, q = round half-even (x / scale). */
static inline float quantize_row(const float *x, int64_t K, int8_t *q) {
    float amax = 0.0f;
    for (int64_t k = 0; k < K; k++) amax = fabsf(x[k]) > amax ? fabsf(x[k]) : amax;
    float scale = (amax > AMAX_FLOOR ? amax : AMAX_FLOOR) / 127.0f;
    for (int64_t k = 0; k < K; k++) {
        float r = nearbyintf(x[k] / scale);
        q[k] = (int8_t)(r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r);
    }
    return scale;
}

/* q [T,D] int8 and xs [T]: the tokens quantised per token. local, rw [T,topk]: each pair's expert,
   relative to this rank's first (pairs outside [0,E) add nothing), and routing weight. w1/w3 [E]
   (packed [I/32][D/4][32][4]), w2 [E] (packed [D/32][I/4][32][4]), s1/s3 [E][I], s2 [E][D]: the
   experts' packed weights and channel scales. With `shared`, entry E is the shared expert, run on
   every row after the routed ones with no routing weight. bf16: the activations are bf16, so each
   projection's output and the weighted intermediate are rounded to it, as the reference's casts do.
   y [T,D] (zeroed by the caller) gets the experts' outputs added in expert order, as index_add_
   adds them. amx_rows: the row count from which a GEMM takes AMX (0: never). Returns how many experts
   it ran (the ones whose weights it read), or -1 where its scratch memory could not be had (y then
   untouched). */
int dsv4_routed_experts(const int8_t *q, const float *xs, int64_t T, int64_t D, const int64_t *local,
                         const float *rw, int64_t topk, int64_t E, int shared, const uint8_t *const *w1,
                         const uint8_t *const *w3, const uint8_t *const *w2, const float *const *s1,
                         const float *const *s3, const float *const *s2, int64_t I, float limit, int bf16,
                         float *y, int threads, int64_t amx_rows) {
    int64_t P = T * topk, *start = calloc(E + 2, sizeof *start), *order = malloc((P + T) * sizeof *order);
    int64_t *fill = malloc((E + 1) * sizeof *fill);
    if (!start || !order || !fill) {
        free(start), free(order), free(fill);
        return -1;
    }
    for (int64_t p = 0; p < P; p++)
        if (local[p] >= 0 && local[p] < E) start[local[p] + 1]++;
    for (int64_t e = 0; e < E; e++) start[e + 1] += start[e];
    int64_t most = shared ? T : 1;                   /* at least a row, so no allocation asks for 0 bytes */
    for (int64_t e = 0; e < E; e++) {
        fill[e] = start[e];
        most = start[e + 1] - start[e] > most ? start[e + 1] - start[e] : most;
    }
    for (int64_t p = 0; p < P; p++)                    /* a stable counting sort: rows ascend per expert */
        if (local[p] >= 0 && local[p] < E) order[fill[local[p]]++] = p;
    start[E + 1] = start[E] + (shared ? T : 0);
    for (int64_t t = 0; t < T && shared; t++) order[start[E] + t] = t * topk;     /* every row, once */
    int64_t wide = D > I ? D : I;
    int8_t *xq = malloc(most * wide);
    float *sx = malloc(most * sizeof *sx), *gate = malloc(most * I * sizeof *gate),
          *up = malloc(most * I * sizeof *up), *out = malloc(most * D * sizeof *out), *row = malloc(D * sizeof *row);
    int failed = !xq || !sx || !gate || !up || !out || !row, ran = 0;
    for (int64_t e = 0; e < (failed ? 0 : E + (shared != 0)); e++) {
        int64_t n = start[e + 1] - start[e];
        const int64_t *pairs = order + start[e];
        if (!n) continue;
        ran++;
        for (int64_t i = 0; i < n; i++) {
            int64_t t = pairs[i] / topk;
            __builtin_memcpy(xq + i * D, q + t * D, D);
            sx[i] = xs[t];
        }
        int amx = amx_rows && n >= amx_rows && D % 64 == 0;
        dsv4_int8_mm(xq, n, D, w1[e], I, gate, threads, amx);
        dsv4_int8_mm(xq, n, D, w3[e], I, up, threads, amx);
        for (int64_t i = 0; i < n; i++) {               /* SwiGLU, the routing weight, quantised for w2 */
            float *g = gate + i * I, *u = up + i * I;
            scale_row(g, sx[i], s1[e], I, bf16, g);
            scale_row(u, sx[i], s3[e], I, bf16, u);
            for (int64_t c = 0; c < I; c++) {
                float a = g[c], b = u[c];
                if (limit > 0) {
                    a = a > limit ? limit : a;
                    b = b > limit ? limit : b < -limit ? -limit : b;
                }
                float h = a / (1.0f + expf(-a)) * b;
                if (e < E) h *= rw[pairs[i]];
                g[c] = bf16 ? round_bf16(h) : h;
            }
            sx[i] = quantize_row(g, I, xq + i * I);
        }
        amx = amx_rows && n >= amx_rows && I % 64 == 0;
        dsv4_int8_mm(xq, n, I, w2[e], D, out, threads, amx);
        for (int64_t i = 0; i < n; i++) {
            float *dst = y + pairs[i] / topk * D;
            scale_row(out + i * D, sx[i], s2[e], D, bf16, row);
            for (int64_t c = 0; c < D; c++) dst[c] += row[c];
        }
    }
    free(start), free(order), free(fill), free(xq), free(sx), free(gate), free(up), free(out), free(row);
    return failed ? -1 : ran;
}

#ifdef __cplusplus
}
#endif
