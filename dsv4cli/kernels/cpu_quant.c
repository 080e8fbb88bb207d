/* W8A8's per-token activation quantisation (`reference.quantize_per_token`) in one pass per row:
   scale = max(amax |x|, floor) / 127, q = round-half-even(x / scale), the reference's operations in fp32
   (a true division, not a reciprocal's product), so its bits. torch runs it as ~8 ops, once per int8
   linear's input. */
#include "cpu_load.h"

/* x [R][D] fp32 or bf16 (D a multiple of 16) -> q [R][D] int8, scale [R] fp32. */
void dsv4_quantize_rows(const void *x, int bf16, int64_t R, int64_t D, float floor, int8_t *q, float *scale) {
    const __m512 lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
    for (int64_t r = 0; r < R; r++) {
        __m512 m = _mm512_setzero_ps();
        for (int64_t i = 0; i < D; i += 16) m = _mm512_max_ps(m, _mm512_abs_ps(load16(x, bf16, r * D + i)));
        float amax = _mm512_reduce_max_ps(m);
        const float s = (amax > floor ? amax : floor) / 127.0f;
        scale[r] = s;
        const __m512 vs = _mm512_set1_ps(s);
        for (int64_t i = 0; i < D; i += 16) {
            __m512 v = _mm512_roundscale_ps(_mm512_div_ps(load16(x, bf16, r * D + i), vs),
                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            v = _mm512_min_ps(_mm512_max_ps(v, lo), hi);
            _mm_storeu_si128((__m128i *)(q + r * D + i), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(v)));
        }
    }
}
