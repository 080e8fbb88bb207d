/* What the native CPU ops share: a value or 16 of a row held in fp32 or bf16, as fp32 (bf16 widened exactly: its
   bits are fp32's top half); an fp32 rounded to bf16 as torch's .to(torch.bfloat16) rounds it. */
#ifndef DSV4_CPU_LOAD_H
#define DSV4_CPU_LOAD_H
#include <immintrin.h>
#include <stdint.h>

static inline __attribute__((always_inline)) float load1(const void *p, int bf16, int64_t i) {
    if (!bf16) return ((const float *)p)[i];
    uint32_t u = (uint32_t)((const uint16_t *)p)[i] << 16;
    float f;
    __builtin_memcpy(&f, &u, 4);
    return f;
}

static inline __attribute__((always_inline)) __m512 load16(const void *p, int bf16, int64_t i) {
    if (bf16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i))), 16));
    return _mm512_loadu_ps((const float *)p + i);
}

static inline float round_bf16(float v) {      /* to the nearest, ties to even; NaN kept */
    uint32_t u;
    __builtin_memcpy(&u, &v, 4);
    if ((u & 0x7fffffff) > 0x7f800000) return v;
    u = (u + 0x7fff + ((u >> 16) & 1)) & 0xffff0000u;
    __builtin_memcpy(&v, &u, 4);
    return v;
}

#endif
