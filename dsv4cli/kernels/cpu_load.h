/* What the native CPU ops share: 16 values of a row held in fp32 or bf16, as fp32 (bf16 widened exactly: its
   bits are fp32's top half). */
#ifndef DSV4_CPU_LOAD_H
#define DSV4_CPU_LOAD_H
#include <immintrin.h>
#include <stdint.h>

static inline __attribute__((always_inline)) __m512 load16(const void *p, int bf16, int64_t i) {
    if (bf16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i))), 16));
    return _mm512_loadu_ps((const float *)p + i);
}

#endif
