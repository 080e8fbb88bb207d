/* y [M,N] = x [M,K] W^T with W in the official release's own formats, read as shipped (memory-mapped, never
   widened in memory): FP8 E4M3 with an fp32 scale per 128 x 128 tile, and packed FP4 E2M1 with an E8M0 scale per
   32 inputs (`reference.fp8_to_float`, `reference.fp4_to_float`). fp32 products and sums.

   A decode step multiplies 1-16 rows by weights far larger than the caches: R weight rows are read side by side
   and each weight vector, decoded once in registers, goes into the sums of up to MR rows of x (past MR rows the
   same R weight rows are decoded again, from L1), so the weight is read once. R rows read side by side are R
   short streams (a row is 1-8 KiB) that the hardware prefetchers follow badly, so while a unit of R rows is read,
   the next unit's rows are asked into L2 line by line in address order, at the pace the unit is read (into L1
   was slower; the reads measured: docs/decisions.md, The release's FP8 and FP4 are multiplied as stored).

   FP8: for a byte b, the fp16 with bits ((b & 0x7f) << 7) | ((b & 0x80) << 8) is e4m3(b) * 2^-8 exactly
        (normals and subnormals; 0x7f and 0xff, NaN in E4M3, come out finite): a sign extension, a shift, a mask
        and vcvtph2ps decode a vector. The 2^8 and the tile's scale go into x: per 128-row tile of W,
        x' = x * 256 * scale[tile row, column tile], so the tile's rows multiply bare decoded bytes.
   FP4, AVX-512: a 16-entry fp32 table in one register, indexed by the low 4 bits of each 32-bit lane (vpermps).
        64 bytes (4 groups of 32 inputs) in 16 lanes give nibble t of every lane after a shift by 4t: inputs
        8l + t, which x is laid out to match; the 8 products per lane are summed, then multiplied by the lane's
        group scale (lanes 4g..4g+3 are group g) and added to the row's sums.
   FP4, AVX2: a byte table (vpshufb) gives each nibble's fp16 high byte (E2M1's fp16 low bytes are 0), widened
        by vcvtph2ps; x per group as its 16 even inputs, then its 16 odd; a group's products are summed, then
        multiplied by its scale and added to the row's sums.
   E8M0's e = 0 (2^-127) is read as 0 (its bits as fp32); e = 255 (NaN) as 2^128 (infinity).

   Every output is the same chain of operations whatever M, R, the threads or the rows beside it, so a row's
   result does not depend on the others. Built twice from this file: with AVX-512 (16 lanes) and with AVX2
   (8 lanes) for CPUs without it. The AVX-512 build on CPUs with VNNI and BF16 also has a bf16 run's faster
   kernels (fast mode, at the end): FP4 against x quantised to int8, FP8 against x in bf16. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define INLINE static inline __attribute__((always_inline))
#define FP8_TILE 128
#define FP4_GROUP 32
#define MR_MAX 4                /* x rows per register tile, at most */
#define R_MAX 8                 /* weight rows per register tile, at most */
#ifndef X_BLOCK_BYTES
#define X_BLOCK_BYTES (1 << 20)
#endif

#ifdef __AVX512F__
#define VL 16
typedef __m512 vf;
#define vzero _mm512_setzero_ps
#define vload _mm512_loadu_ps
#define vfma _mm512_fmadd_ps
#define vmul _mm512_mul_ps

INLINE float vsum(vf v) { return _mm512_reduce_add_ps(v); }

INLINE vf fp8_decode(const uint8_t *p) {
    __m256i h = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p));
    return _mm512_cvtph_ps(_mm256_and_si256(_mm256_slli_epi16(h, 7), _mm256_set1_epi16((short)0xbfff)));
}
#else
#define VL 8
typedef __m256 vf;
#define vzero _mm256_setzero_ps
#define vload _mm256_loadu_ps
#define vfma _mm256_fmadd_ps
#define vmul _mm256_mul_ps

INLINE float vsum(vf v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

INLINE vf fp8_decode(const uint8_t *p) {
    __m128i h = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)p));
    return _mm256_cvtph_ps(_mm_and_si128(_mm_slli_epi16(h, 7), _mm_set1_epi16((short)0xbfff)));
}
#endif

#define FP8_CHUNK (4 * VL)      /* bytes (and inputs) of a row per step */
#define FP4_CHUNK 64            /* bytes of a row per step: 128 inputs, 4 groups */

INLINE float e8m0(uint8_t e) {
    uint32_t bits = (uint32_t)e << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* The next unit's rows, asked into L2 a line at a time in address order: `rows` rows of `row_bytes` from p,
   `stride` bytes apart (past the weight's end for its last unit: a prefetch never faults). */
struct ahead {
    const uint8_t *p;
    int64_t stride, row_bytes, at;
    int rows;
};

INLINE void ahead_line(struct ahead *a) {
    if (a->rows <= 0) return;
    _mm_prefetch((const char *)a->p + a->at, _MM_HINT_T1);
    if ((a->at += 64) >= a->row_bytes) {
        a->at = 0;
        a->p += a->stride;
        a->rows--;
    }
}

/* R weight rows w[r] (the unit's rows; past `rows` they repeat its last, their sums dropped) against MR rows of
   x' (xs, rows KP floats apart). `chunks` whole chunks from the rows, then one from `tail` (R rows of FP8_CHUNK
   bytes, zero past K) unless it is NULL. */
INLINE void fp8_tile(const uint8_t *const *w, struct ahead *next, int64_t chunks, const uint8_t *tail,
                     const float *xs, int64_t KP, float *y, int64_t N, int rows, const int R, const int MR) {
    vf acc[R_MAX * MR_MAX];
    for (int i = 0; i < R * MR; i++) acc[i] = vzero();
    for (int64_t c = 0; c <= chunks; c++) {
        if (c == chunks && !tail) break;
        int64_t k = c * FP8_CHUNK;
        const uint8_t *src[R_MAX];
        for (int r = 0; r < R; r++) {
            if (next) ahead_line(next);
            src[r] = c < chunks ? w[r] + k : tail + r * FP8_CHUNK;
        }
        for (int u = 0; u < FP8_CHUNK / VL; u++) {
            vf wv[R_MAX];
            for (int r = 0; r < R; r++) wv[r] = fp8_decode(src[r] + u * VL);
            for (int m = 0; m < MR; m++) {
                vf xv = vload(xs + m * KP + k + u * VL);
                for (int r = 0; r < R; r++) acc[r * MR + m] = vfma(wv[r], xv, acc[r * MR + m]);
            }
        }
    }
    for (int r = 0; r < rows; r++)
        for (int m = 0; m < MR; m++) y[m * N + r] = vsum(acc[r * MR + m]);
}

#ifdef __AVX512F__
#define FP4_X_CHUNK 128         /* x' floats per chunk */

/* x' for FP4: chunk c, step t, lane l holds input 128c + 8l + t (nibble t of lane l's 4 bytes). */
INLINE int64_t fp4_x_at(int64_t j) { return j / 128 * 128 + j % 8 * 16 + j % 128 / 8; }

/* The chunk's 4 group scales (bytes s[0..3]) on their lanes, as fp32. */
INLINE __m512 fp4_lane_scales(const uint8_t *s) {
    int32_t four;
    memcpy(&four, s, 4);
    __m512i e = _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),
                                         _mm512_cvtepu8_epi32(_mm_cvtsi32_si128(four)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(e, 23));
}

/* R rows of packed E2M1 w[r] with their E8M0 scales s[r] against MR rows of x' (fp4_x_at). */
INLINE void fp4_tile(const uint8_t *const *w, const uint8_t *const *s, struct ahead *next, int64_t chunks,
                     const uint8_t *tail, const uint8_t *tail_s, const float *xs, int64_t KP, float *y, int64_t N,
                     int rows, const int R, const int MR) {
    const __m512 table = _mm512_setr_ps(0, .5f, 1, 1.5f, 2, 3, 4, 6, -0.f, -.5f, -1, -1.5f, -2, -3, -4, -6);
    vf acc[R_MAX * MR_MAX];
    for (int i = 0; i < R * MR; i++) acc[i] = vzero();
    for (int64_t c = 0; c <= chunks; c++) {
        if (c == chunks && !tail) break;
        int64_t k = c * FP4_CHUNK;
        __m512i v[R_MAX];
        for (int r = 0; r < R; r++) {
            if (next) ahead_line(next);
            v[r] = _mm512_loadu_si512(c < chunks ? w[r] + k : tail + r * FP4_CHUNK);
        }
        vf part[R_MAX * MR_MAX];
        for (int t = 0; t < 8; t++) {
            vf wt[R_MAX];
            for (int r = 0; r < R; r++) wt[r] = _mm512_permutexvar_ps(_mm512_srli_epi32(v[r], 4 * t), table);
            for (int m = 0; m < MR; m++) {
                vf xv = vload(xs + m * KP + c * FP4_X_CHUNK + t * VL);
                for (int r = 0; r < R; r++)
                    part[r * MR + m] = t ? vfma(wt[r], xv, part[r * MR + m]) : vmul(wt[r], xv);
            }
        }
        for (int r = 0; r < R; r++) {
            vf sc = fp4_lane_scales(c < chunks ? s[r] + c * 4 : tail_s + r * 4);
            for (int m = 0; m < MR; m++) acc[r * MR + m] = vfma(part[r * MR + m], sc, acc[r * MR + m]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int m = 0; m < MR; m++) y[m * N + r] = vsum(acc[r * MR + m]);
}
#else
#define FP4_X_CHUNK 128

/* x' for FP4: per group of 32, its 16 even inputs, then its 16 odd ones. */
INLINE int64_t fp4_x_at(int64_t j) { return j / 32 * 32 + j % 2 * 16 + j % 32 / 2; }

/* One group of one row: 16 bytes -> each nibble's fp16 high byte, even inputs' (low nibbles) and odd ones'. */
INLINE void fp4_group(const uint8_t *p, __m128i *even, __m128i *odd) {
    const __m128i table = _mm_setr_epi8(0x00, 0x38, 0x3c, 0x3e, 0x40, 0x42, 0x44, 0x46, (char)0x80, (char)0xb8,
                                        (char)0xbc, (char)0xbe, (char)0xc0, (char)0xc2, (char)0xc4, (char)0xc6);
    __m128i b = _mm_loadu_si128((const __m128i *)p), low = _mm_set1_epi8(0x0f);
    *even = _mm_shuffle_epi8(table, _mm_and_si128(b, low));
    *odd = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(b, 4), low));
}

/* Vector v (x' order) of a group's values: fp16 words with the high bytes `even` (v 0, 1) or `odd` (v 2, 3). */
INLINE vf fp4_vector(__m128i even, __m128i odd, int v) {
    __m128i h = v < 2 ? even : odd, zero = _mm_setzero_si128();
    return _mm256_cvtph_ps(v % 2 ? _mm_unpackhi_epi8(zero, h) : _mm_unpacklo_epi8(zero, h));
}

/* Per group: its 32 products per row of x summed, then times the group's scale into the row's sums. */
INLINE void fp4_tile(const uint8_t *const *w, const uint8_t *const *s, struct ahead *next, int64_t chunks,
                     const uint8_t *tail, const uint8_t *tail_s, const float *xs, int64_t KP, float *y, int64_t N,
                     int rows, const int R, const int MR) {
    vf acc[R_MAX * MR_MAX];
    for (int i = 0; i < R * MR; i++) acc[i] = vzero();
    for (int64_t c = 0; c <= chunks; c++) {
        if (c == chunks && !tail) break;
        int64_t k = c * FP4_CHUNK;
        const uint8_t *src[R_MAX], *src_s[R_MAX];
        for (int r = 0; r < R; r++) {
            if (next) ahead_line(next);
            src[r] = c < chunks ? w[r] + k : tail + r * FP4_CHUNK;
            src_s[r] = c < chunks ? s[r] + c * 4 : tail_s + r * 4;
        }
        for (int g = 0; g < FP4_CHUNK * 2 / FP4_GROUP; g++) {
            __m128i even[R_MAX], odd[R_MAX];
            vf part[R_MAX * MR_MAX];
            for (int r = 0; r < R; r++) fp4_group(src[r] + g * 16, &even[r], &odd[r]);
            for (int v = 0; v < 4; v++) {
                vf wv[R_MAX];
                for (int r = 0; r < R; r++) wv[r] = fp4_vector(even[r], odd[r], v);
                for (int m = 0; m < MR; m++) {
                    vf xv = vload(xs + m * KP + c * FP4_X_CHUNK + g * FP4_GROUP + v * VL);
                    for (int r = 0; r < R; r++)
                        part[r * MR + m] = v ? vfma(wv[r], xv, part[r * MR + m]) : vmul(wv[r], xv);
                }
            }
            for (int r = 0; r < R; r++) {
                vf sc = _mm256_set1_ps(e8m0(src_s[r][g]));
                for (int m = 0; m < MR; m++) acc[r * MR + m] = vfma(part[r * MR + m], sc, acc[r * MR + m]);
            }
        }
    }
    for (int r = 0; r < rows; r++)
        for (int m = 0; m < MR; m++) y[m * N + r] = vsum(acc[r * MR + m]);
}
#endif

/* Weight rows read side by side (R), more where there are fewer rows of x, and x rows per tile (MR): as many
   accumulators as the registers hold. Each (R, MR) is a call of its own, so the tile's loops unroll. */
#define CASE(R, MR, call) case (R) * 8 + (MR): call(R, MR); break;
#ifdef __AVX512F__
#define FP8_ROWS(M) ((M) == 1 ? 8 : 4)
#define FP8_MR 4
#define FP8_SHAPES(call) CASE(8, 1, call) CASE(4, 1, call) CASE(4, 2, call) CASE(4, 3, call) CASE(4, 4, call)
#define FP4_ROWS(M) 4
#define FP4_MR 2
#define FP4_SHAPES(call) CASE(4, 1, call) CASE(4, 2, call)
#else
#define FP8_ROWS(M) ((M) == 1 ? 4 : 2)
#define FP8_MR 4
#define FP8_SHAPES(call) CASE(4, 1, call) CASE(2, 1, call) CASE(2, 2, call) CASE(2, 3, call) CASE(2, 4, call)
#define FP4_ROWS(M) ((M) == 1 ? 2 : 1)
#define FP4_MR 4
#define FP4_SHAPES(call) CASE(2, 1, call) CASE(1, 1, call) CASE(1, 2, call) CASE(1, 3, call) CASE(1, 4, call)
#endif
#define BY_SHAPE(R, mr, SHAPES, call) switch ((R) * 8 + (mr)) { SHAPES(call) default: __builtin_trap(); }

/* A unit's R row pointers: `rows` rows from p, `stride` bytes apart, the last repeated. */
INLINE void unit_rows(const uint8_t *p, int64_t stride, int rows, int R, const uint8_t **out) {
    for (int r = 0; r < R; r++) out[r] = p + (r < rows ? r : rows - 1) * stride;
}

static int fp8_block(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, int64_t w_stride,
                     const float *scale, int64_t scale_stride, int row0, int col0, float *y, int threads) {
    const int R = FP8_ROWS(M < FP8_MR ? M : FP8_MR);
    int64_t chunks = K / FP8_CHUNK, rest = K - chunks * FP8_CHUNK, KP = (chunks + (rest != 0)) * FP8_CHUNK;
    /* units: up to R rows within one 128-row tile, so a unit's rows share their x' */
    int64_t tiles = (row0 + N + FP8_TILE - 1) / FP8_TILE, units = 0;
    int64_t *start = malloc((N / R + tiles + 1) * sizeof *start);
    if (!start) return -1;
    for (int64_t i = 0; i < N;) {
        int64_t end = (row0 + i) / FP8_TILE * FP8_TILE + FP8_TILE - row0;
        for (end = end < N ? end : N; i < end; i += R) start[units++] = i;
        i = end;
    }
    start[units] = N;
    int failed = 0;
    _Pragma("omp parallel num_threads(threads) if (threads > 1)")
    {
        /* x' for the tile `have` (x * 256 * its scales, zeros past K), and the rows' last partial chunk */
        float *xs = aligned_alloc(64, (M * KP * sizeof(float) + 63) / 64 * 64);
        uint8_t *tail = calloc(R, FP8_CHUNK);
        int64_t have = -1;
        if (!xs || !tail) {
            _Pragma("omp atomic write")
            failed = 1;
        }
        _Pragma("omp for schedule(static)")
        for (int64_t u = 0; u < units; u++) {
            if (!xs || !tail) continue;
            int64_t i = start[u], tile = (row0 + i) / FP8_TILE;
            int rows = (int)(start[u + 1] - i);
            if (tile != have) {
                const float *srow = scale + tile * scale_stride;
                for (int64_t m = 0; m < M; m++) {
                    for (int64_t j = 0; j < K;) {       /* column tile by column tile */
                        int64_t end = (col0 + j) / FP8_TILE * FP8_TILE + FP8_TILE - col0;
                        float c = 256.0f * srow[(col0 + j) / FP8_TILE];
                        for (end = end < K ? end : K; j < end; j++) xs[m * KP + j] = x[m * K + j] * c;
                    }
                    memset(xs + m * KP + K, 0, (KP - K) * sizeof(float));
                }
                have = tile;
            }
            const uint8_t *wr[R_MAX];
            unit_rows(w + i * w_stride, w_stride, rows, R, wr);
            for (int r = 0; r < R && rest; r++) memcpy(tail + r * FP8_CHUNK, wr[r] + chunks * FP8_CHUNK, rest);
            struct ahead next = {w + (i + R) * w_stride, w_stride, K, 0, R};
            for (int64_t m0 = 0; m0 < M; m0 += FP8_MR) {
                int mr = M - m0 < FP8_MR ? (int)(M - m0) : FP8_MR;
#define FP8_CALL(r_, mr_) fp8_tile(wr, m0 ? NULL : &next, chunks, rest ? tail : NULL, xs + m0 * KP, KP, \
                                   y + m0 * N + i, N, rows, r_, mr_)
                BY_SHAPE(R, mr, FP8_SHAPES, FP8_CALL)
            }
        }
        free(xs);
        free(tail);
    }
    free(start);
    return failed ? -1 : 0;
}

static int fp4_block(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, int64_t w_stride,
                     const uint8_t *scale, int64_t scale_stride, float *y, int threads) {
    const int R = FP4_ROWS(M < FP4_MR ? M : FP4_MR);
    int64_t chunks = K / 2 / FP4_CHUNK, rest = K / 2 - chunks * FP4_CHUNK;
    int64_t KP = (chunks + (rest != 0)) * FP4_X_CHUNK, units = (N + R - 1) / R;
    float *xs = aligned_alloc(64, (M * KP * sizeof(float) + 63) / 64 * 64);
    if (!xs) return -1;
    for (int64_t m = 0; m < M; m++) {
        for (int64_t j = 0; j < K; j++) xs[m * KP + fp4_x_at(j)] = x[m * K + j];
        for (int64_t j = K; j < KP; j++) xs[m * KP + fp4_x_at(j)] = 0.0f;
    }
    int failed = 0;
    _Pragma("omp parallel num_threads(threads) if (threads > 1)")
    {
        uint8_t *tail = calloc(R, FP4_CHUNK), *tail_s = calloc(R, 4);      /* the last partial chunk, zeros past K */
        if (!tail || !tail_s) {
            _Pragma("omp atomic write")
            failed = 1;
        }
        _Pragma("omp for schedule(static)")
        for (int64_t u = 0; u < units; u++) {
            if (!tail || !tail_s) continue;
            int64_t i = u * R;
            int rows = (int)(N - i < R ? N - i : R);
            const uint8_t *wr[R_MAX], *sr[R_MAX];
            unit_rows(w + i * w_stride, w_stride, rows, R, wr);
            unit_rows(scale + i * scale_stride, scale_stride, rows, R, sr);
            for (int r = 0; r < R && rest; r++) {
                memcpy(tail + r * FP4_CHUNK, wr[r] + chunks * FP4_CHUNK, rest);
                memcpy(tail_s + r * 4, sr[r] + chunks * 4, rest / (FP4_GROUP / 2));
            }
            struct ahead next = {w + (i + R) * w_stride, w_stride, K / 2, 0, R};
            for (int64_t m0 = 0; m0 < M; m0 += FP4_MR) {
                int mr = M - m0 < FP4_MR ? (int)(M - m0) : FP4_MR;
#define FP4_CALL(r_, mr_) fp4_tile(wr, sr, m0 ? NULL : &next, chunks, rest ? tail : NULL, tail_s, xs + m0 * KP, KP, \
                                   y + m0 * N + i, N, rows, r_, mr_)
                BY_SHAPE(R, mr, FP4_SHAPES, FP4_CALL)
            }
        }
        free(tail);
        free(tail_s);
    }
    free(xs);
    return failed ? -1 : 0;
}

#ifdef __cplusplus
extern "C" {
#endif

/* Rows of x per block: a block's x' (K floats a row, padded to a chunk) fits in L2 beside the weight rows; the
   weight is read once per block. */
static int64_t x_block(int64_t K) {
    int64_t rows = (X_BLOCK_BYTES / 4 / (K + FP4_X_CHUNK)) / MR_MAX * MR_MAX;
    return rows > MR_MAX ? rows : MR_MAX;
}

/* x [M,K] fp32; w [N,K] E4M3 bytes, rows w_stride bytes apart; scale fp32 [.., scale_stride]: tile (0,0) starts
   row0 rows and col0 columns (both < 128) before w's first element. y [M,N]. Returns -1 where its scratch
   memory could not be had (y then undefined), else 0. */
int dsv4_fp8_mm(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, int64_t w_stride,
                const float *scale, int64_t scale_stride, int row0, int col0, float *y, int threads) {
    for (int64_t m0 = 0, mb = x_block(K); m0 < M; m0 += mb)
        if (fp8_block(x + m0 * K, M - m0 < mb ? M - m0 : mb, K, w, N, w_stride, scale, scale_stride, row0, col0,
                      y + m0 * N, threads))
            return -1;
    return 0;
}

/* x [M,K] fp32 (K a multiple of 32); w [N,K/2] packed E2M1, rows w_stride bytes apart; scale [N,K/32] E8M0,
   rows scale_stride bytes apart. y [M,N]. Returns -1 where its scratch memory could not be had (y then
   undefined), else 0. */
int dsv4_fp4_mm(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, int64_t w_stride,
                const uint8_t *scale, int64_t scale_stride, float *y, int threads) {
    for (int64_t m0 = 0, mb = x_block(K); m0 < M; m0 += mb)
        if (fp4_block(x + m0 * K, M - m0 < mb ? M - m0 : mb, K, w, N, w_stride, scale, scale_stride, y + m0 * N,
                      threads))
            return -1;
    return 0;
}

/* ---- fast mode: a bf16 run's activations (built only with AVX-512 VNNI and BF16) --------------------------

   FP4 x int8 (`dsv4_fp4_mm_q8`): x quantised per row as W8A8 quantises it (`dsv4_quantize_rows`, cpu_quant.c,
   linked in: q = round(x / sx), sx = max(amax, floor) / 127), the E2M1 codes read as the exact integers
   2 e2m1 + 12 (0..24, unsigned for vpdpbusd; the 12 is taken back as -12 times the group's sum of q, the sums'
   starting value), so each group's 32 products sum exactly in int32; each group's sum times its E8M0 scale
   into the row's fp32 sums, and those times sx / 2. A step is 16 groups (256 bytes of a row, 4 vectors): a
   4 x 4 transpose of the 32-bit lanes within each 128-bit lane puts the 4 lanes of a group (32 codes, 8 lanes
   once split into nibbles) into one lane of 4 vectors, so 8 vpdpbusd leave lane L with group q8_group(L)'s
   sum, and one conversion and one multiply-add per step take all 16 into the fp32 sums. The 8 vpdpbusd run
   as several chains (exact integer sums: their split changes nothing), so that a row's sums do not wait on
   vpdpbusd's latency.

   FP8 x bf16 (`dsv4_fp8_mm_bf16`): the bf16 with bits ((b & 0x7f) << 4) | ((b & 0x80) << 8) is e4m3(b) * 2^-120
   exactly: b into a word's high byte (an unpack), an arithmetic shift by 4 and a mask decode 32 bytes, on
   ports vdpbf16ps leaves free (Zen 4). vdpbf16ps sums pairs of products in fp32, per 128-input tile in one
   chain (two added at its end cost 5-7 % at 4-6 rows of x), and the tile's sums go times its scale into the
   row's. vdpbf16ps reads bf16 subnormals as 0 and writes fp32 subnormals as 0: E4M3's subnormals (|v| < 2^-6)
   count as 0, and products of the decoded weights (2^-126 and up) with x below 1 would be lost, so x comes in
   times 2^64 (exact for |x| < 2^64; bf16 subnormals become normal; products |x e4m3| from 2^-70 up are kept)
   and the tile scales times 2^120 / 2^64 = 2^56.

   x is laid out step by step (tile by tile), the block's rows side by side in each, so a tile's rows of x are
   one pointer apart by constants. From OUTER_MIN_ROWS rows (prefill) FP8 runs the same chains with 16 outputs
   to a vector (outer_tile). As in the exact kernels, every output is the same chain of operations whatever the
   rows beside it or the threads. */
#if defined(__AVX512VNNI__) && defined(__AVX512BF16__)
#include "cpu_load.h"
#define Q8_STEP 512             /* inputs per step: 16 groups */
#define AHEAD_UNITS 2           /* the weight is asked into L2 this many units ahead */
#define GROUP_BYTES (256 << 10) /* the weight rows that meet each x row while in L2 */
#define FAST_R 2                /* weight rows read side by side */
/* with one row of x, more: a unit's fixed work (its pointers, scales, sums' reductions) over more bytes; 1 KiB
   FP8 rows read at 0.75 of the streaming read with 2, 0.9-1.0 with 4 (docs/decisions.md) */
#define ONE_ROW_R 4
#define ONE_ROW_FP4_K 2048      /* FP4 rows of more inputs keep FAST_R: with 4, their registers spill */
#define STREAM_ROW_BYTES 4096   /* FP8 rows up to this long read in long streams with one row of x */
#define FAST_MR 4               /* x rows per register tile, at most */
#define FAST_ROWS(mr, call) switch (mr) { case 1: call(1); break; case 2: call(2); break; case 3: call(3); break; \
                                          default: call(4); }
/* M rows of x make as few register tiles as they can, as even as they can be (5 rows: 3 + 2, not 4 + 1), each
   tile's x' one block of memory. An FP4 tile takes one weight row against 5 to 8 rows of x where M allows (each
   decoded weight vector read more often: the decoding's shuffles share a port with vpdpbusd on Zen 4), as many
   as keep the tile's x' within X_TILE_BYTES of L1 (6 at 4,096 inputs, 8 at 2,048; 8 at 4,096 thrash L1):
   1.1-1.2x the FP4 GEMM of 6-256 rows against tiles of 2 x 4 (benchmarks/README.md). */
#define FP4_WIDE_ROWS 5         /* the fewest rows of x an FP4 tile of one weight row takes */
#define FP4_WIDE_MR 8
#define X_TILE_BYTES (24 << 10)
#define WIDE_ROWS(mr, call) switch (mr) { case 5: call(5); break; case 6: call(6); break; case 7: call(7); break; \
                                          default: call(8); }
#define Q8_CHAINS(n) ((n) >= 5 ? 1 : (n) >= 3 ? 2 : 4)     /* per row of x, for n rows of x and w in flight */
#define UNROLL _Pragma("GCC unroll 16")     /* loops over arrays of vectors, whole: the vectors stay in registers */

void dsv4_quantize_rows(const void *x, int bf16, int64_t R, int64_t D, float floor, int8_t *q, float *scale);

/* Lane L of a step's sums holds group q8_group(L) of its 16; the map is its own inverse. */
INLINE int q8_group(int L) { return L % 4 * 4 + L / 4; }

/* M rows of x as `count` register tiles of at most `most` rows, as even as can be: tile j's first row and rows. */
INLINE int64_t tile_count(int64_t M, int64_t most) { return (M + most - 1) / most; }

INLINE int64_t tile_first(int64_t M, int64_t count, int64_t j) {
    return j * (M / count) + (j < M % count ? j : M % count);
}

INLINE int tile_rows(int64_t M, int64_t count, int64_t j) { return (int)(M / count + (j < M % count)); }

/* A vector's 16 lanes summed in a fixed tree (GCC's _mm512_reduce_add_ps): upper 8 lanes onto the lower 8, then
   4 onto 4, then lanes 0 + 2 and 1 + 3, then those two. (outer_tile's reduce16: the same, lane by lane.) */
INLINE float hsum16(__m512 a) {
    __m256 t3 = _mm256_add_ps(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)),
                              _mm512_castps512_ps256(a));
    __m128 t6 = _mm_add_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
    __m128 t8 = _mm_add_ps(t6, _mm_movehl_ps(t6, t6));
    return _mm_cvtss_f32(_mm_add_ss(t8, _mm_shuffle_ps(t8, t8, 1)));
}

/* With one row of x a unit's R weight rows are Q apart (rows v, v + Q, ...; Q = N / R rounded up, plus one so that
   the R streams don't fall on the same cache sets), so each of the R streams reads on through the weight unit after
   unit, as the hardware prefetchers follow it: R adjacent rows (1-4 KiB each) are R short streams that read at
   ~0.75 of a plain read even with the next unit asked into L2 by hand, R long ones at ~1.0 without
   (docs/decisions.md, One row of x in R long streams). Every output keeps its chain of operations. */
INLINE int64_t stream_gap(int64_t N, int R) { return (N + R - 1) / R + 1; }

INLINE int64_t stream_units(int64_t N, int R) { return stream_gap(N, R) < N ? stream_gap(N, R) : N; }

/* Unit v's R row indices (v < N; rows past N read row v again, their sums dropped); how many are rows of the
   weight. */
INLINE int stream_unit(int64_t v, int64_t N, int R, int64_t *row) {
    int rows = 0;
    for (int r = 0; r < R; r++) {
        row[r] = v + r * stream_gap(N, R);
        if (row[r] < N) rows = r + 1;
        else row[r] = v;
    }
    return rows;
}

/* Units (of `unit_bytes` of weight) per group: within GROUP_BYTES, and a group for each thread at least. */
static int64_t fast_group(int64_t units, int64_t unit_bytes, int threads) {
    int64_t group = GROUP_BYTES / unit_bytes + 1, share = (units + threads - 1) / threads;
    return group < share ? group : share > 0 ? share : 1;
}

/* The E2M1 codes (nibble h of each byte of t) as 2 e2m1 + 12. */
INLINE __m512i q8_codes(__m512i t, int h) {
    const __m512i table = _mm512_broadcast_i32x4(_mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8,
                                                               6, 4, 0));
    return _mm512_shuffle_epi8(table, _mm512_and_si512(h ? _mm512_srli_epi16(t, 4) : t, _mm512_set1_epi8(0x0f)));
}

/* R rows of packed E2M1 w[r] with their scales s[r] against MR rows of x', the tile's (q8_layout). Step c's x'
   rows are at xq + c * MR * 512 (512 bytes each: vector 2t + h, lane L, byte b is input 32 q8_group(L) + 8t + 2b
   + h), their sums' starting values at xc + c * MR * 16. `steps` whole steps from the rows, then one from `tail`
   (R rows of 256 bytes, tail_s of 16 scales, zeros past K) unless it is NULL. `ahead`: rows asked into L2 as these are
   read (or NULL). y = the sums times hx (sx / 2), row r's output at y[r * yst] (row m of x's N further on). */
INLINE void q8_tile(const uint8_t *const *w, const uint8_t *const *s, const uint8_t *const *ahead, int64_t steps,
                    const uint8_t *tail, const uint8_t *tail_s, const int8_t *xq, const int32_t *xc,
                    const float *hx, float *y, int64_t N, int rows, const int R, const int MR, int64_t yst) {
    const int CH = Q8_CHAINS(R * MR);
    const __m128i lanes = _mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);    /* q8_group */
    __m512 acc[FAST_R * FAST_MR];                       /* R * MR <= 8 */
    for (int i = 0; i < R * MR; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t c = 0; c <= steps; c++) {
        if (c == steps && !tail) break;
        const int8_t *xs = xq + c * MR * Q8_STEP;
        __m512i t[ONE_ROW_R][4], sum[FAST_R * FAST_MR];     /* R * MR * CH <= 8 */
        for (int r = 0; r < R; r++) {
            const uint8_t *p = c < steps ? w[r] + c * (Q8_STEP / 2) : tail + r * (Q8_STEP / 2);
            __m512i l[4];
            for (int i = 0; i < 4; i++) {
                if (ahead) _mm_prefetch((const char *)ahead[r] + c * (Q8_STEP / 2) + 64 * i, _MM_HINT_T1);
                l[i] = _mm512_loadu_si512(p + 64 * i);
            }
            __m512i a0 = _mm512_unpacklo_epi32(l[0], l[1]), a1 = _mm512_unpackhi_epi32(l[0], l[1]);
            __m512i a2 = _mm512_unpacklo_epi32(l[2], l[3]), a3 = _mm512_unpackhi_epi32(l[2], l[3]);
            t[r][0] = _mm512_unpacklo_epi64(a0, a2), t[r][1] = _mm512_unpackhi_epi64(a0, a2);
            t[r][2] = _mm512_unpacklo_epi64(a1, a3), t[r][3] = _mm512_unpackhi_epi64(a1, a3);
        }
        UNROLL
        for (int i = 0; i < R * MR; i++)
            UNROLL
            for (int k = 0; k < CH; k++)
                sum[i * CH + k] = k ? _mm512_setzero_si512() : _mm512_load_si512(xc + (c * MR + i % MR) * 16);
        UNROLL
        for (int v = 0; v < 8; v++) {
            __m512i code[ONE_ROW_R];
            for (int r = 0; r < R; r++) code[r] = q8_codes(t[r][v / 2], v % 2);
            for (int m = 0; m < MR; m++) {
                __m512i xv = _mm512_load_si512(xs + m * Q8_STEP + v * 64);
                for (int r = 0; r < R; r++) {
                    __m512i *chain = &sum[(r * MR + m) * CH + v % CH];
                    *chain = _mm512_dpbusd_epi32(*chain, code[r], xv);
                }
            }
        }
        for (int r = 0; r < R; r++) {
            const uint8_t *e = c < steps ? s[r] + c * 16 : tail_s + r * 16;
            __m512i bits = _mm512_cvtepu8_epi32(_mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)e), lanes));
            __m512 sc = _mm512_castsi512_ps(_mm512_slli_epi32(bits, 23));
            for (int m = 0; m < MR; m++) {
                __m512i *chains = &sum[(r * MR + m) * CH];
                UNROLL
                for (int k = CH / 2; k; k /= 2)
                    UNROLL
                    for (int j = 0; j < k; j++) chains[j] = _mm512_add_epi32(chains[j], chains[j + k]);
                acc[r * MR + m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(chains[0]), sc, acc[r * MR + m]);
            }
        }
    }
    for (int r = 0; r < R && r < rows; r++)
        for (int m = 0; m < MR; m++) y[m * N + r * yst] = hsum16(acc[r * MR + m]) * hx[m];
}

/* The register tiles of one weight row that M rows of x make, for K inputs (FP4); how many weight rows a unit
   reads side by side; the register tiles they make. */
static int64_t q8_wide_tiles(int64_t M, int64_t K) {
    int64_t most = X_TILE_BYTES / K;
    return tile_count(M, most < 1 ? 1 : most > FP4_WIDE_MR ? FP4_WIDE_MR : most);
}

static int q8_unit_rows(int64_t M, int64_t K) {
    return M == 1 ? (K <= ONE_ROW_FP4_K ? ONE_ROW_R : FAST_R) : M / q8_wide_tiles(M, K) >= FP4_WIDE_ROWS ? 1 : FAST_R;
}

static int64_t q8_tiles(int64_t M, int64_t K) {
    return q8_unit_rows(M, K) == 1 ? q8_wide_tiles(M, K) : tile_count(M, FAST_MR);
}

/* x' for the FP4 kernel: rows of x quantised, their groups' sums times -12, and sx / 2; tile by tile (q8_tiles),
   each tile's rows step by step, side by side (q8_tile): a tile's x' is one block of memory, its rows of a step
   adjacent (each row whole, a tile's rows of a step 4 KiB apart, ran 25-30 % slower). */
static void q8_layout(const int8_t *q, int64_t M, int64_t K, int64_t steps, int8_t *xq, int32_t *xc, float *hx) {
    int64_t count = q8_tiles(M, K);
    /* a group's 32 inputs as its 8 lanes: lane 2t + h is inputs 8t + h, + 2, + 4, + 6 */
    const __m256i order = _mm256_broadcastsi128_si256(_mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13,
                                                                    15));
    const __m256i bias = _mm256_set1_epi8((char)0x80);
    memset(xq, 0, steps * M * Q8_STEP);
    memset(xc, 0, steps * M * 16 * sizeof *xc);
    for (int64_t m = 0, rt = 0; m < M; m++) {
        hx[m] *= 0.5f;          /* the codes are twice E2M1's values */
        while (tile_first(M, count, rt + 1) <= m) rt++;           /* row m's register tile */
        int64_t m0 = tile_first(M, count, rt), mr = tile_rows(M, count, rt);
        for (int64_t g = 0; g < K / 32; g++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(q + m * K + g * 32));
            int64_t at = m0 * steps + g / 16 * mr + m - m0;     /* row m's step g / 16 */
            int32_t lanes[8];
            _mm256_storeu_si256((__m256i *)lanes, _mm256_shuffle_epi8(v, order));
            int L = q8_group((int)(g % 16));
            for (int i = 0; i < 8; i++) memcpy(xq + at * Q8_STEP + i * 64 + L * 4, &lanes[i], 4);
            __m256i sums = _mm256_sad_epu8(_mm256_xor_si256(v, bias), _mm256_setzero_si256());   /* of q + 128 */
            int64_t sum = _mm256_extract_epi64(sums, 0) + _mm256_extract_epi64(sums, 1) +
                          _mm256_extract_epi64(sums, 2) + _mm256_extract_epi64(sums, 3) - 32 * 128;
            xc[at * 16 + L] = (int32_t)(-12 * sum);
        }
    }
}

/* One weight a q8_run reads: N rows of packed E2M1 (w_stride bytes apart) with their E8M0 scales; y [M, N]. */
struct q8_job {
    const uint8_t *w, *scale;
    int64_t N, w_stride, scale_stride;
    float *y;
};

/* The weights of `jobs` (at most 4, of K inputs each) against M rows of x' (q8_layout's xq, xc, hx), their units
   shared among the threads as one list: one parallel region for a MoE expert's w1 and w3. */
static int q8_run(const struct q8_job *jobs, int n_jobs, int64_t K, const int8_t *xq, const int32_t *xc,
                  const float *hx, int64_t M, int threads) {
    const int R = q8_unit_rows(M, K);
    const int64_t m_tiles = q8_tiles(M, K);
    int64_t steps = K / Q8_STEP, rest = K / 2 - steps * (Q8_STEP / 2), S = steps + (rest != 0), units = 0, first[4];
    for (int j = 0; j < n_jobs; j++) {
        first[j] = units;
        units += M == 1 ? stream_units(jobs[j].N, R) : (jobs[j].N + R - 1) / R;
    }
    int64_t group = fast_group(units, R * (K / 2 + K / 32), threads);
    int failed = 0;
    _Pragma("omp parallel num_threads(threads) if (threads > 1)")
    {
        uint8_t *tail = calloc(R, Q8_STEP / 2), *tail_s = calloc(R, 16);
        if (!tail || !tail_s) {
            _Pragma("omp atomic write")
            failed = 1;
        }
        _Pragma("omp for schedule(static)")
        for (int64_t g = 0; g < units; g += group)
            for (int64_t mt = 0; mt < m_tiles; mt++) {
                int64_t m0 = tile_first(M, m_tiles, mt);
                int mr = tile_rows(M, m_tiles, mt);
                for (int64_t u = g; u < g + group && u < units; u++) {
                    if (!tail || !tail_s) continue;
                    int j = n_jobs - 1;
                    while (first[j] > u) j--;
                    const struct q8_job *job = &jobs[j];
                    int64_t i = (u - first[j]) * R, N = job->N, ws = job->w_stride, ss = job->scale_stride;
                    int rows = (int)(N - i < R ? N - i : R);
                    const uint8_t *wr[R_MAX], *sr[R_MAX], *ar[R_MAX];
                    int64_t row[R_MAX], yst = 1;
                    if (M == 1) {               /* R long streams (stream_unit) */
                        i = u - first[j], yst = stream_gap(N, R);
                        rows = stream_unit(i, N, R, row);
                        for (int r = 0; r < R; r++) wr[r] = job->w + row[r] * ws, sr[r] = job->scale + row[r] * ss;
                    } else {
                        unit_rows(job->w + i * ws, ws, rows, R, wr);
                        unit_rows(job->scale + i * ss, ss, rows, R, sr);
                        unit_rows(job->w + (i + AHEAD_UNITS * R) * ws, ws, R, R, ar);   /* past the end: no fault */
                    }
                    for (int r = 0; r < R && rest; r++) {
                        memcpy(tail + r * (Q8_STEP / 2), wr[r] + steps * (Q8_STEP / 2), rest);
                        memcpy(tail_s + r * 16, sr[r] + steps * 16, rest / (FP4_GROUP / 2));
                    }
#define Q8_CALL(r_, mr_) q8_tile(wr, sr, m0 ? NULL : ar, steps, rest ? tail : NULL, tail_s, xq + m0 * S * Q8_STEP, \
                                 xc + m0 * S * 16, hx + m0, job->y + m0 * N + i, N, rows, r_, mr_, 1)
#define Q8_FAST(mr_) Q8_CALL(FAST_R, mr_)
#define Q8_WIDE(mr_) Q8_CALL(1, mr_)
                    if (M == 1 && R == ONE_ROW_R)
                        q8_tile(wr, sr, NULL, steps, rest ? tail : NULL, tail_s, xq, xc, hx, job->y + i, N, rows,
                                ONE_ROW_R, 1, yst);
                    else if (M == 1)
                        q8_tile(wr, sr, NULL, steps, rest ? tail : NULL, tail_s, xq, xc, hx, job->y + i, N, rows,
                                FAST_R, 1, yst);
                    else if (R == FAST_R)
                        FAST_ROWS(mr, Q8_FAST)
                    else
                        WIDE_ROWS(mr, Q8_WIDE)
                }
            }
        free(tail);
        free(tail_s);
    }
    return failed ? -1 : 0;
}

/* x' scratch for M rows of K inputs (q8_layout's). */
struct q8_x {
    int8_t *xq;
    int32_t *xc;
    float *hx;
};

static int q8_alloc(struct q8_x *x, int64_t M, int64_t K) {
    int64_t all = (K + Q8_STEP - 1) / Q8_STEP;
    x->xq = aligned_alloc(64, all * M * Q8_STEP);
    x->xc = aligned_alloc(64, all * M * 64);
    x->hx = malloc(M * sizeof *x->hx);
    return x->xq && x->xc && x->hx ? 0 : -1;
}

static void q8_free(struct q8_x *x) {
    free(x->xq), free(x->xc), free(x->hx);
}

static int q8_block(const void *x, int bf16, int64_t M, int64_t K, const uint8_t *w, int64_t N, int64_t w_stride,
                    const uint8_t *scale, int64_t scale_stride, float floor, float *y, int threads) {
    struct q8_x xs = {0};
    int8_t *q = malloc(M * K);
    if (!q || q8_alloc(&xs, M, K)) {
        free(q), q8_free(&xs);
        return -1;
    }
    dsv4_quantize_rows(x, bf16, M, K, floor, q, xs.hx);
    q8_layout(q, M, K, (K + Q8_STEP - 1) / Q8_STEP, xs.xq, xs.xc, xs.hx);
    free(q);
    struct q8_job job = {w, scale, N, w_stride, scale_stride, y};
    int failed = q8_run(&job, 1, K, xs.xq, xs.xc, xs.hx, M, threads);
    q8_free(&xs);
    return failed;
}

#define BF16_CHUNK 64           /* bytes of a weight row per step: two vectors of bf16 */

/* 64 E4M3 bytes as bf16 times 2^-120 (each byte a word's high byte, shifted down with its sign, the copies of
   the sign masked away): bytes 0-7 of each 128-bit lane in `lo`, 8-15 in `hi`. */
INLINE void fp8_bf16(__m512i b, __m512i *lo, __m512i *hi) {
    const __m512i zero = _mm512_setzero_si512(), keep = _mm512_set1_epi16((short)0x87f0);
    *lo = _mm512_and_si512(_mm512_srai_epi16(_mm512_unpacklo_epi8(zero, b), 4), keep);
    *hi = _mm512_and_si512(_mm512_srai_epi16(_mm512_unpackhi_epi8(zero, b), 4), keep);
}

/* Where a weight row's K inputs lie in x' (from column col0 on: x' column col0 + j is input j): `tiles` tiles of
   FP8_TILE columns; chunk c is columns 64c..64c+63 (weight bytes from row + 64c - col0), chunks first..last hold
   inputs, the first and last in part. */
struct cols {
    int64_t tiles, first, last;
    __mmask64 first_mask, last_mask;
    int col0;
};

INLINE struct cols cols_of(int64_t K, int col0) {
    int64_t last = (col0 + K - 1) / BF16_CHUNK, n = col0 + K - last * BF16_CHUNK;
    return (struct cols){(col0 + K + FP8_TILE - 1) / FP8_TILE, col0 / BF16_CHUNK, last, ~0ull << (col0 % BF16_CHUNK),
                         n == BF16_CHUNK ? ~0ull : (1ull << n) - 1, col0};
}

/* The bytes of chunk c that hold inputs. */
INLINE __mmask64 chunk_mask(const struct cols *cl, int64_t c) {
    return c < cl->first || c > cl->last ? 0 : (c == cl->first ? cl->first_mask : ~0ull) &
                                               (c == cl->last ? cl->last_mask : ~0ull);
}

/* R weight rows against MR rows of x' (bf16 times 2^64 in column tiles, `cl`). Tile t's rows of x' are at
   xs + t * MR * 128 (bf16_layout), 128 a row: chunk 2t + h's vectors lo, hi (fp8_bf16's order) at 64h, 64h + 32.
   Weight row r's tile t sums go times sc[r * scst + t] into the row's, its output at y[r * yst] (row m of x's N
   further on). `ahead`: rows asked into L2 as these are read (or NULL). */
INLINE void bf16_tile(const uint8_t *const *w, const uint8_t *const *ahead, const struct cols *cl,
                      const uint16_t *xs, const float *sc, float *y, int64_t N, int rows, const int R, const int MR,
                      int64_t yst, int64_t scst) {
    __m512 acc[R_MAX * FAST_MR];
    for (int i = 0; i < R * MR; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t t = 0; t < cl->tiles; t++) {
        __m512 part[R_MAX * FAST_MR];                   /* the tile's products */
        for (int i = 0; i < R * MR; i++) part[i] = _mm512_setzero_ps();
        const uint16_t *xt = xs + t * MR * FP8_TILE;
        int edge = 2 * t <= cl->first || 2 * t + 1 >= cl->last;      /* chunks outside the inputs read nothing */
        UNROLL
        for (int h = 0; h < 2; h++) {
            int64_t c = 2 * t + h;
            __mmask64 in = chunk_mask(cl, c);
            __m512i lo[R_MAX], hi[R_MAX];
            for (int r = 0; r < R; r++) {
                const uint8_t *p = w[r] + BF16_CHUNK * c - cl->col0;
                if (ahead) _mm_prefetch((const char *)ahead[r] + BF16_CHUNK * c, _MM_HINT_T1);
                fp8_bf16(edge ? _mm512_maskz_loadu_epi8(in, p) : _mm512_loadu_si512(p), &lo[r], &hi[r]);
            }
            for (int m = 0; m < MR; m++) {
                const uint16_t *xm = xt + m * FP8_TILE + 64 * h;
                __m512bh xlo = (__m512bh)_mm512_load_si512(xm), xhi = (__m512bh)_mm512_load_si512(xm + 32);
                for (int r = 0; r < R; r++) {
                    __m512 *p = &part[r * MR + m];
                    *p = _mm512_dpbf16_ps(_mm512_dpbf16_ps(*p, (__m512bh)lo[r], xlo), (__m512bh)hi[r], xhi);
                }
            }
        }
        UNROLL
        for (int i = 0; i < R * MR; i++)
            acc[i] = _mm512_fmadd_ps(part[i], _mm512_set1_ps(sc[i / MR * scst + t]), acc[i]);
    }
    for (int r = 0; r < R && r < rows; r++)
        for (int m = 0; m < MR; m++) y[m * N + r * yst] = hsum16(acc[r * MR + m]);
}

/* One row of x (bf16, K inputs) times 2^64 in columns col0..col0+K-1 of `row` (tiles * 128), zeros elsewhere. */
static void bf16_row(const uint16_t *x, int64_t K, int col0, int64_t tiles, uint16_t *row) {
    const __m512 up = _mm512_set1_ps(0x1p64f);
    memset(row, 0, tiles * FP8_TILE * 2);
    for (int64_t j = 0; j < K; j += 16) {
        __mmask16 in = K - j >= 16 ? 0xffff : (1u << (K - j)) - 1;
        __m512i v = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(in, x + j)), 16);
        v = _mm512_srli_epi32(_mm512_castps_si512(_mm512_mul_ps(_mm512_castsi512_ps(v), up)), 16);
        _mm256_mask_storeu_epi16(row + col0 + j, in, _mm512_cvtepi32_epi16(v));
    }
}

/* x' for the FP8 kernel: rows of x as bf16_row makes them, in `count` register tiles of rows (tile_rows), each
   tile's rows column tile by column tile side by side in bf16_tile's order; `row`: scratch for one row. */
static void bf16_layout(const uint16_t *x, int64_t M, int64_t K, int col0, int64_t tiles, int64_t count,
                        uint16_t *row, uint16_t *xs) {
    for (int64_t m = 0, rt = 0; m < M; m++) {
        while (tile_first(M, count, rt + 1) <= m) rt++;           /* row m's register tile */
        int64_t m0 = tile_first(M, count, rt), mr = tile_rows(M, count, rt);
        bf16_row(x + m * K, K, col0, tiles, row);
        for (int64_t t = 0; t < tiles; t++)             /* each chunk's 8-column runs in fp8_bf16's order */
            for (int h = 0; h < 2; h++)
                for (int l = 0; l < 4; l++)
                    for (int half = 0; half < 2; half++)
                        memcpy(xs + (m0 * tiles + t * mr + m - m0) * FP8_TILE + 64 * h + 32 * half + 8 * l,
                               row + t * FP8_TILE + 64 * h + 16 * l + 8 * half, 16);
    }
}

/* bf16_block for one row of x of up to STREAM_ROW_BYTES inputs: units of ONE_ROW_R weight rows in long streams
   (stream_unit), each row with its own tile scales. (wo_b's rows of 8 KiB read 3-5 % slower so, even with each
   stream's rows asked into L2 ahead: they keep adjacent rows.) */
static int one_row_block(const uint16_t *x, int64_t K, const uint8_t *w, int64_t N, int64_t w_stride,
                         const float *scale, int64_t scale_stride, int row0, int col0, float *y, int threads) {
    const int R = ONE_ROW_R;
    const struct cols cl = cols_of(K, col0);
    const int64_t tiles = cl.tiles, units = stream_units(N, R);
    uint16_t *xs = aligned_alloc(64, tiles * FP8_TILE * 2), *row = malloc(tiles * FP8_TILE * 2);
    if (!xs || !row) {
        free(xs), free(row);
        return -1;
    }
    bf16_layout(x, 1, K, col0, tiles, 1, row, xs);
    free(row);
    int64_t group = fast_group(units, R * K, threads);
    int failed = 0;
    _Pragma("omp parallel num_threads(threads) if (threads > 1)")
    {
        float *sc = malloc(R * tiles * sizeof *sc);         /* each stream's row of tile scales, times 2^56 */
        int64_t tile_row[R_MAX];
        for (int r = 0; r < R; r++) tile_row[r] = -1;
        if (!sc) {
            _Pragma("omp atomic write")
            failed = 1;
        }
        _Pragma("omp for schedule(static)")
        for (int64_t g = 0; g < units; g += group)
            for (int64_t u = g; u < g + group && u < units; u++) {
                if (!sc) continue;
                int64_t i[R_MAX];
                int rows = stream_unit(u, N, R, i);
                const uint8_t *wr[R_MAX];
                for (int r = 0; r < R; r++) {
                    wr[r] = w + i[r] * w_stride;
                    int64_t tr = (row0 + i[r]) / FP8_TILE;
                    if (tr != tile_row[r]) {
                        tile_row[r] = tr;
                        for (int64_t t = 0; t < tiles; t++) sc[r * tiles + t] = scale[tr * scale_stride + t] * 0x1p56f;
                    }
                }
                bf16_tile(wr, NULL, &cl, xs, sc, y + u, N, rows, R, 1, stream_gap(N, R), tiles);
            }
        free(sc);
    }
    free(xs);
    return failed ? -1 : 0;
}

static int bf16_block(const uint16_t *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, int64_t w_stride,
                      const float *scale, int64_t scale_stride, int row0, int col0, float *y, int threads) {
    if (M == 1 && K <= STREAM_ROW_BYTES)
        return one_row_block(x, K, w, N, w_stride, scale, scale_stride, row0, col0, y, threads);
    const int R = M == 1 ? ONE_ROW_R : FAST_R;
    const int64_t m_tiles = tile_count(M, FAST_MR);
    const struct cols cl = cols_of(K, col0);
    const int64_t tiles = cl.tiles;
    int64_t row_tiles = (row0 + N + FP8_TILE - 1) / FP8_TILE, units = 0;
    int64_t *start = malloc((N / R + row_tiles + 1) * sizeof *start);
    uint16_t *xs = aligned_alloc(64, tiles * M * FP8_TILE * 2), *row = malloc(tiles * FP8_TILE * 2);
    if (!start || !xs || !row) {
        free(start), free(xs), free(row);
        return -1;
    }
    for (int64_t i = 0; i < N;) {       /* units: up to R rows within one 128-row tile (one row of scales) */
        int64_t end = (row0 + i) / FP8_TILE * FP8_TILE + FP8_TILE - row0;
        for (end = end < N ? end : N; i < end; i += R) start[units++] = i;
        i = end;
    }
    start[units] = N;
    int64_t group = fast_group(units, R * K, threads);
    bf16_layout(x, M, K, col0, tiles, m_tiles, row, xs);
    free(row);
    int failed = 0;
    _Pragma("omp parallel num_threads(threads) if (threads > 1)")
    {
        float *sc = malloc(tiles * sizeof *sc);
        if (!sc) {
            _Pragma("omp atomic write")
            failed = 1;
        }
        _Pragma("omp for schedule(static)")
        for (int64_t g = 0; g < units; g += group)
            for (int64_t mt = 0; mt < m_tiles; mt++) {
                int64_t m0 = tile_first(M, m_tiles, mt);
                int mr = tile_rows(M, m_tiles, mt);
                for (int64_t u = g; u < g + group && u < units; u++) {
                    if (!sc) continue;
                    int64_t i = start[u];
                    int rows = (int)(start[u + 1] - i);
                    const float *srow = scale + (row0 + i) / FP8_TILE * scale_stride;
                    for (int64_t t = 0; t < tiles; t++) sc[t] = srow[t] * 0x1p56f;
                    const uint8_t *wr[R_MAX], *ar[R_MAX];
                    unit_rows(w + i * w_stride, w_stride, rows, R, wr);
                    unit_rows(w + (i + AHEAD_UNITS * R) * w_stride - col0, w_stride, R, R, ar);
#define BF16_CALL(mr_) bf16_tile(wr, m0 ? NULL : ar, &cl, xs + m0 * tiles * FP8_TILE, sc, y + m0 * N + i, N, rows, \
                                 FAST_R, mr_, 1, 0)
                    if (M == 1)
                        bf16_tile(wr, ar, &cl, xs, sc, y + i, N, rows, ONE_ROW_R, 1, 1, 0);
                    else
                        FAST_ROWS(mr, BF16_CALL)
                }
            }
        free(sc);
    }
    free(start), free(xs);
    return failed ? -1 : 0;
}

/* ---- many rows of x (a prefill chunk's): FP8 with 16 outputs to a vector ---------------------------------

   bf16_tile gives each output 16 partial sums, one per lane ("class" j: the pairs of inputs lane j of fp8_bf16's
   lo and hi vectors hold), each the chain, per 128-input tile, of 4 vdpbf16ps from zero, times the tile's scale,
   into the class's sum; the 16 then add in hsum16's tree. Against many rows of x that layout loads a vector of x
   for every vdpbf16ps (and decodes the weight again per register tile), which holds it to ~0.6 of vdpbf16ps's
   peak (Zen 4). Here a vector holds 16 outputs, a pair of inputs each: the weight decoded once per call (16 rows'
   lo and hi vectors transposed, outer_decode), a weight vector serves OUTER_MR rows of x and a pair of x,
   broadcast, OUTER_V weight vectors. Each class's chain runs whole, class after class, with the same operations
   on the same values, and the 16 classes' sums add in hsum16's tree lane by lane: every output gets the bits
   bf16_tile gives it, whatever the rows beside it. */
#define OUTER_MIN_ROWS 48       /* rows of x from which a call takes this kernel */
#define OUTER_BLOCK_ROWS 256    /* rows of x laid out at once (the weight decoded again per block) */
#define OUTER_V 2               /* vectors of 16 outputs per register tile */
#define OUTER_MR FAST_MR        /* rows of x per register tile (FAST_ROWS's shapes) */

/* 16 vectors summed lane by lane in hsum16's tree. */
INLINE __m512 reduce16(const __m512 *a) {
    __m512 t3[8], t6[4];
    for (int i = 0; i < 8; i++) t3[i] = _mm512_add_ps(a[i + 8], a[i]);
    for (int i = 0; i < 4; i++) t6[i] = _mm512_add_ps(t3[i + 4], t3[i]);
    return _mm512_add_ps(_mm512_add_ps(t6[0], t6[2]), _mm512_add_ps(t6[1], t6[3]));
}

/* The next unit's weight rows asked into L2 while a unit's register tiles run: of its `lines` lines (64 bytes,
   `per_row` to a row of `stride` bytes from p; past the weight's end a prefetch never faults), tile `at` of
   `tiles` asks for its share. */
INLINE void outer_ahead(const uint8_t *p, int64_t stride, int64_t per_row, int64_t lines, int64_t at, int64_t tiles) {
    for (int64_t i = lines * at / tiles; i < lines * (at + 1) / tiles; i++)
        _mm_prefetch((const char *)p + i / per_row * stride + i % per_row * 64, _MM_HINT_T1);
}

/* v[j] lane l <- v[l] lane j (32-bit lanes): unpacks by 32 and 64 bits, then two shuffles of 128-bit lanes. */
INLINE void transpose16(__m512i v[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(v[i], v[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(v[i], v[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        v[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        v[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        v[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        v[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int h = 0; h < 16; h += 8)
        for (int i = 0; i < 4; i++) {
            t[h + i] = _mm512_shuffle_i32x4(v[h + i], v[h + i + 4], 0x88);
            t[h + i + 4] = _mm512_shuffle_i32x4(v[h + i], v[h + i + 4], 0xdd);
        }
    for (int i = 0; i < 8; i++) {
        v[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
        v[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
    }
}

/* The column (of x' rows: col0 included) of the first input of pair s (of chunk 2t + s / 2, in its lo vector
   for s even, hi for odd) of class j in column tile t. */
INLINE int64_t class_column(int64_t t, int j, int s) {
    return 128 * t + 64 * (s / 2) + 16 * (j / 4) + 2 * (j % 4) + 8 * (s % 2);
}

/* Outputs o0..o0+15 decoded (w: output o0's row; `rows` of them in the weight, the others zero): class j, tile t,
   pair s at vector (j * tiles + t) * 4 + s of dec, lane l output o0 + l; and their scales times 2^56, tile t's
   at sc + 16t. */
static void outer_decode(const uint8_t *w, int64_t w_stride, int64_t rows, const struct cols *cl, const float *scale,
                         int64_t scale_stride, int64_t row0, int64_t o0, uint8_t *dec, float *sc) {
    const int64_t tiles = cl->tiles;
    for (int64_t c = 0; c < 2 * tiles; c++) {
        __mmask64 in = chunk_mask(cl, c);
        int edge = c <= cl->first || c >= cl->last;
        __m512i lo[16], hi[16];
        for (int l = 0; l < 16; l++) {
            const uint8_t *p = w + l * w_stride + BF16_CHUNK * c - cl->col0;
            if (l < rows) fp8_bf16(edge ? _mm512_maskz_loadu_epi8(in, p) : _mm512_loadu_si512(p), &lo[l], &hi[l]);
            else lo[l] = hi[l] = _mm512_setzero_si512();
        }
        transpose16(lo);
        transpose16(hi);
        int64_t t = c / 2, s = 2 * (c % 2);
        for (int j = 0; j < 16; j++) {
            _mm512_store_si512(dec + ((j * tiles + t) * 4 + s) * 64, lo[j]);
            _mm512_store_si512(dec + ((j * tiles + t) * 4 + s + 1) * 64, hi[j]);
        }
    }
    for (int64_t t = 0; t < tiles; t++)
        for (int l = 0; l < 16; l++)
            sc[16 * t + l] = l < rows ? scale[(row0 + o0 + l) / FP8_TILE * scale_stride + t] * 0x1p56f : 0.0f;
}

/* V vectors of decoded outputs (dec, vectors dec_stride bytes apart; their scales sc, sc_stride floats apart)
   against MR rows of x'' (xo, rows x_stride pairs apart: class j, tile t, pair s at (j * tiles + t) * 4 + s).
   Lane l of y's vector v, row m: y[m * N + 16 v + l], the first `outs` of them written. */
INLINE void outer_tile(const uint8_t *dec, int64_t dec_stride, const float *sc, int64_t sc_stride,
                       const uint32_t *xo, int64_t x_stride, int64_t tiles, float *y, int64_t N, int64_t outs,
                       const int V, const int MR) {
    __m512 sums[16][OUTER_V * OUTER_MR];
    for (int j = 0; j < 16; j++) {
        __m512 acc[OUTER_V * OUTER_MR];
        for (int i = 0; i < V * MR; i++) acc[i] = _mm512_setzero_ps();
        for (int64_t t = 0; t < tiles; t++) {
            __m512 part[OUTER_V * OUTER_MR];
            for (int i = 0; i < V * MR; i++) part[i] = _mm512_setzero_ps();
            int64_t at = (j * tiles + t) * 4;
            UNROLL
            for (int s = 0; s < 4; s++) {
                __m512bh wv[OUTER_V];
                for (int v = 0; v < V; v++) wv[v] = (__m512bh)_mm512_load_si512(dec + v * dec_stride + (at + s) * 64);
                for (int m = 0; m < MR; m++) {
                    __m512bh xb = (__m512bh)_mm512_set1_epi32((int)xo[m * x_stride + at + s]);
                    for (int v = 0; v < V; v++) part[v * MR + m] = _mm512_dpbf16_ps(part[v * MR + m], wv[v], xb);
                }
            }
            for (int v = 0; v < V; v++) {
                __m512 s = _mm512_load_ps(sc + v * sc_stride + 16 * t);
                for (int m = 0; m < MR; m++) acc[v * MR + m] = _mm512_fmadd_ps(part[v * MR + m], s, acc[v * MR + m]);
            }
        }
        for (int i = 0; i < V * MR; i++) sums[j][i] = acc[i];
    }
    for (int v = 0; v < V; v++) {
        int64_t n = outs - 16 * v;
        if (n <= 0) break;
        __mmask16 keep = n >= 16 ? 0xffff : (__mmask16)((1u << n) - 1);
        for (int m = 0; m < MR; m++) {
            __m512 a[16];
            for (int j = 0; j < 16; j++) a[j] = sums[j][v * MR + m];
            _mm512_mask_storeu_ps(y + m * N + 16 * v, keep, reduce16(a));
        }
    }
}

/* x'' for outer_tile: each row of x times 2^64 as bf16_layout makes it (`row`: scratch for one), its pairs in
   class order. */
static void outer_layout(const uint16_t *x, int64_t M, int64_t K, int col0, int64_t tiles, uint16_t *row,
                         uint32_t *xo) {
    for (int64_t m = 0; m < M; m++, xo += tiles * 64) {
        bf16_row(x + m * K, K, col0, tiles, row);
        for (int j = 0; j < 16; j++)
            for (int64_t t = 0; t < tiles; t++)
                for (int s = 0; s < 4; s++) memcpy(xo + (j * tiles + t) * 4 + s, row + class_column(t, j, s), 4);
    }
}

/* bf16_block's product by outer_tile: units of OUTER_V vectors of outputs, each decoded, then run against every
   register tile of rows while the next unit's rows are asked into L2. */
static int outer_block(const uint16_t *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, int64_t w_stride,
                       const float *scale, int64_t scale_stride, int row0, int col0, float *y, int threads) {
    const struct cols cl = cols_of(K, col0);
    const int64_t tiles = cl.tiles, units = (N + 16 * OUTER_V - 1) / (16 * OUTER_V), vec_dec = tiles * 16 * 4 * 64;
    uint32_t *xo = aligned_alloc(64, M * tiles * 64 * sizeof *xo);
    uint16_t *row = malloc(tiles * FP8_TILE * 2);
    if (!xo || !row) {
        free(xo), free(row);
        return -1;
    }
    outer_layout(x, M, K, col0, tiles, row, xo);
    free(row);
    int failed = 0;
    _Pragma("omp parallel num_threads(threads) if (threads > 1)")
    {
        uint8_t *dec = aligned_alloc(64, OUTER_V * vec_dec);
        float *sc = aligned_alloc(64, OUTER_V * tiles * 16 * sizeof *sc);
        if (!dec || !sc) {
            _Pragma("omp atomic write")
            failed = 1;
        }
        _Pragma("omp for schedule(static)")
        for (int64_t u = 0; u < units; u++) {
            if (!dec || !sc) continue;
            int64_t o0 = u * 16 * OUTER_V, outs = N - o0 < 16 * OUTER_V ? N - o0 : 16 * OUTER_V;
            for (int v = 0; v < OUTER_V; v++)
                outer_decode(w + (o0 + 16 * v) * w_stride, w_stride, outs - 16 * v, &cl, scale, scale_stride, row0,
                             o0 + 16 * v, dec + v * vec_dec, sc + v * tiles * 16);
            int64_t per_row = (col0 + K + 63) / 64, m_tiles = (M + OUTER_MR - 1) / OUTER_MR;
            for (int64_t m0 = 0; m0 < M; m0 += OUTER_MR) {
                int mr = M - m0 < OUTER_MR ? (int)(M - m0) : OUTER_MR;
                outer_ahead(w + (o0 + 16 * OUTER_V) * w_stride - col0, w_stride, per_row, 16 * OUTER_V * per_row,
                            m0 / OUTER_MR, m_tiles);
#define OUTER_CALL(mr_) outer_tile(dec, vec_dec, sc, tiles * 16, xo + m0 * tiles * 64, tiles * 64, tiles, \
                                   y + m0 * N + o0, N, outs, OUTER_V, mr_)
                FAST_ROWS(mr, OUTER_CALL)
            }
        }
        free(dec), free(sc);
    }
    free(xo);
    return failed ? -1 : 0;
}

/* Rows of x per block for the fast kernels: a block's x' (`row_bytes` a row) fits in L2 beside the weight's. */
static int64_t fast_block(int64_t row_bytes) {
    int64_t rows = X_BLOCK_BYTES / row_bytes / FAST_MR * FAST_MR;
    return rows > FAST_MR ? rows : FAST_MR;
}

/* dsv4_fp4_mm's weight against x [M,K] (fp32, or bf16 where `bf16`) quantised per row to int8 with `floor`
   (`reference.quantize_per_token`). Returns -1 where its scratch memory could not be had, else 0. */
int dsv4_fp4_mm_q8(const void *x, int bf16, int64_t M, int64_t K, const uint8_t *w, int64_t N, int64_t w_stride,
                   const uint8_t *scale, int64_t scale_stride, float floor, float *y, int threads) {
    for (int64_t m0 = 0, mb = fast_block(K + K / 8); m0 < M; m0 += mb)
        if (q8_block((const char *)x + m0 * K * (bf16 ? 2 : 4), bf16, M - m0 < mb ? M - m0 : mb, K, w, N, w_stride,
                     scale, scale_stride, floor, y + m0 * N, threads))
            return -1;
    return 0;
}

/* A MoE layer's routed FP4 experts in one call, for a bf16 run (`reference.routed_experts` with each expert's
   three projections through dsv4_fp4_mm_q8): x [T,D] bf16 quantised per row once (the bits each projection's own
   quantisation gives); per expert, its rows' w1 and w3 in one parallel pass, each rounded to bf16, SwiGLU
   (the gate clamped from above at `limit`, the up projection both ways; limit 0: no clamp) times the routing
   weight, rounded to bf16, quantised per row, w2, rounded to bf16 and added to y [T,D] (fp32, zeroed by the
   caller) in expert order, as index_add_ adds them. local, rw [T, topk]: experts (this rank's indices; others
   skipped) and routing weights. Expert e: w1[e], w3[e] [I, D/2] and w2[e] [D, I/2] packed E2M1, rows
   contiguous; s1[e], s3[e] [I, D/32] and s2[e] [D, I/32] E8M0. D and I multiples of 32. Returns how many experts
   it ran, or -1 where its scratch memory could not be had. */
int dsv4_fp4_routed_experts(const uint16_t *x, int64_t T, int64_t D, const int64_t *local, const float *rw,
                            int64_t topk, int64_t E, const uint8_t *const *w1, const uint8_t *const *w3,
                            const uint8_t *const *w2, const uint8_t *const *s1, const uint8_t *const *s3,
                            const uint8_t *const *s2, int64_t I, float limit, float floor, float *y, int threads) {
    int64_t P = T * topk, most = 1, ran = 0;
    int64_t *start = calloc(E + 1, sizeof *start), *order = malloc((P + 1) * sizeof *order);
    for (int64_t p = 0; start && p < P; p++)
        if (local[p] >= 0 && local[p] < E) start[local[p] + 1]++;
    for (int64_t e = 0; start && e < E; e++) {
        most = start[e + 1] > most ? start[e + 1] : most;
        start[e + 1] += start[e];
    }
    int64_t wide = D > I ? D : I;
    int8_t *q = malloc(T * D + most * wide), *rows_q = q + T * D;
    float *sx = malloc(T * sizeof *sx), *gate = malloc(most * I * 2 * sizeof *gate), *up = gate + most * I;
    float *out = malloc(most * D * sizeof *out);
    int64_t *fill = malloc(E * sizeof *fill);
    struct q8_x xs = {0};
    int failed = !start || !order || !q || !sx || !gate || !out || !fill || q8_alloc(&xs, most, wide);
    if (!failed) {
        for (int64_t e = 0; e < E; e++) fill[e] = start[e];
        for (int64_t p = 0; p < P; p++)                /* a stable counting sort: rows ascend per expert */
            if (local[p] >= 0 && local[p] < E) order[fill[local[p]]++] = p;
        dsv4_quantize_rows(x, 1, T, D, floor, q, sx);
    }
    for (int64_t e = 0; e < (failed ? 0 : E); e++) {
        int64_t n = start[e + 1] - start[e];
        const int64_t *pairs = order + start[e];
        if (!n) continue;
        ran++;
        for (int64_t i = 0; i < n; i++) {
            memcpy(rows_q + i * D, q + pairs[i] / topk * D, D);
            xs.hx[i] = sx[pairs[i] / topk];
        }
        q8_layout(rows_q, n, D, (D + Q8_STEP - 1) / Q8_STEP, xs.xq, xs.xc, xs.hx);
        struct q8_job up_jobs[2] = {{w1[e], s1[e], I, D / 2, D / 32, gate}, {w3[e], s3[e], I, D / 2, D / 32, up}};
        if ((failed = q8_run(up_jobs, 2, D, xs.xq, xs.xc, xs.hx, n, threads))) break;
        for (int64_t i = 0; i < n; i++) {
            float *g = gate + i * I, *u = up + i * I, r = rw[pairs[i]];
            for (int64_t c = 0; c < I; c++) {
                float a = round_bf16(g[c]), b = round_bf16(u[c]);
                if (limit > 0) {
                    a = a > limit ? limit : a;
                    b = b > limit ? limit : b < -limit ? -limit : b;
                }
                g[c] = round_bf16(a / (1.0f + expf(-a)) * b * r);
            }
        }
        dsv4_quantize_rows(gate, 0, n, I, floor, rows_q, xs.hx);
        q8_layout(rows_q, n, I, (I + Q8_STEP - 1) / Q8_STEP, xs.xq, xs.xc, xs.hx);
        struct q8_job down = {w2[e], s2[e], D, I / 2, I / 32, out};
        if ((failed = q8_run(&down, 1, I, xs.xq, xs.xc, xs.hx, n, threads))) break;
        for (int64_t i = 0; i < n; i++) {
            float *dst = y + pairs[i] / topk * D;
            for (int64_t c = 0; c < D; c++) dst[c] += round_bf16(out[i * D + c]);
        }
    }
    free(start), free(order), free(q), free(sx), free(gate), free(out), free(fill), q8_free(&xs);
    return failed ? -1 : (int)ran;
}

/* dsv4_fp8_mm with x [M,K] bf16 (|x| < 2^64), in bf16 products (E4M3's subnormals as 0). */
int dsv4_fp8_mm_bf16(const uint16_t *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, int64_t w_stride,
                     const float *scale, int64_t scale_stride, int row0, int col0, float *y, int threads) {
    if (M >= OUTER_MIN_ROWS) {
        for (int64_t m0 = 0; m0 < M; m0 += OUTER_BLOCK_ROWS)
            if (outer_block(x + m0 * K, M - m0 < OUTER_BLOCK_ROWS ? M - m0 : OUTER_BLOCK_ROWS, K, w, N, w_stride,
                            scale, scale_stride, row0, col0, y + m0 * N, threads))
                return -1;
        return 0;
    }
    for (int64_t m0 = 0, mb = fast_block(2 * (K + FP8_TILE)); m0 < M; m0 += mb)
        if (bf16_block(x + m0 * K, M - m0 < mb ? M - m0 : mb, K, w, N, w_stride, scale, scale_stride, row0, col0,
                       y + m0 * N, threads))
            return -1;
    return 0;
}

/* dsv4_fp8_mm_bf16 for G projections whose rows follow one another in the weight (attention's wo_a), in one call:
   x [M][G][K], group g's R rows from row g * R (their scales from row row0 + g * R of the grid), y [M][G][R]. Each
   group's outputs are dsv4_fp8_mm_bf16's for its rows alone. */
int dsv4_fp8_mm_bf16_groups(const uint16_t *x, int64_t M, int64_t G, int64_t K, const uint8_t *w, int64_t R,
                            int64_t w_stride, const float *scale, int64_t scale_stride, int row0, int col0, float *y,
                            int threads) {
    uint16_t *xg = malloc(M * K * sizeof *xg);
    float *yg = malloc(M * R * sizeof *yg);
    int failed = !xg || !yg;
    for (int64_t g = 0; g < G && !failed; g++) {
        for (int64_t m = 0; m < M; m++) memcpy(xg + m * K, x + (m * G + g) * K, K * sizeof *xg);
        int64_t first = row0 + g * R;
        failed = dsv4_fp8_mm_bf16(xg, M, K, w + g * R * w_stride, R, w_stride,
                                  scale + first / FP8_TILE * scale_stride, scale_stride, (int)(first % FP8_TILE), col0,
                                  yg, threads);
        for (int64_t m = 0; m < M && !failed; m++) memcpy(y + (m * G + g) * R, yg + m * R, R * sizeof *yg);
    }
    free(xg), free(yg);
    return failed ? -1 : 0;
}
#endif

#ifdef __cplusplus
}
#endif
