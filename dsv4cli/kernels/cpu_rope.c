/* RoPE (`reference.rope`) in one pass: every row's last 2 * half dims rotated in interleaved pairs, the rest
   copied. torch runs it as ~10 ops (slices, four products, a stack, a cat), each a dispatch and a
   temporary; a decode step calls it 3-4 times an attention layer. The same products and sums, in the same
   order and unfused (-ffp-contract=off), in fp32 (bf16 rows widened, the results rounded to nearest even as
   torch's .to(bfloat16) rounds them): the reference's bits. */
#include <stdint.h>
#include <string.h>

#include "cpu_load.h"

/* fp32 to bf16, rounded to nearest even (a NaN to the quiet NaN), as torch rounds. */
static uint16_t float_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}

/* x, out [R][H][D] fp32 (bf16 with `bf16`); cos, sin [R][half] fp32: row r's H heads share row r of the tables. */
void dsv4_rope(const void *x, int bf16, int64_t R, int64_t H, int64_t D, const float *cos, const float *sin,
               int64_t half, void *out) {
    const int64_t keep = D - 2 * half, el = bf16 ? 2 : 4;
    for (int64_t r = 0; r < R; r++) {
        const float *c = cos + r * half, *s = sin + r * half;
        for (int64_t h = 0; h < H; h++) {
            const char *xi = (const char *)x + (r * H + h) * D * el;
            char *o = (char *)out + (r * H + h) * D * el;
            memcpy(o, xi, keep * el);
            for (int64_t i = keep; i < D; i += 2) {
                const int64_t j = (i - keep) / 2;
                const float a = load1(xi, bf16, i), b = load1(xi, bf16, i + 1);
                const float u = a * c[j] - b * s[j], v = a * s[j] + b * c[j];
                if (bf16) {
                    ((uint16_t *)o)[i] = float_bf16(u);
                    ((uint16_t *)o)[i + 1] = float_bf16(v);
                } else {
                    ((float *)o)[i] = u;
                    ((float *)o)[i + 1] = v;
                }
            }
        }
    }
}
