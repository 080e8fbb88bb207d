/* RoPE (`reference.rope`) in one pass: every row's last 2 * half dims rotated in interleaved pairs, the rest
   copied. torch runs it as ~10 ops (slices, four products, a stack, a cat), each a dispatch and a
   temporary; a decode step calls it 3-4 times an attention layer. The same products and sums, in the same
   order and unfused (-ffp-contract=off): the reference's bits. */
#include <stdint.h>
#include <string.h>

/* x, out [R][H][D] fp32; cos, sin [R][half]: row r's H heads share row r of the tables. */
void dsv4_rope(const float *x, int64_t R, int64_t H, int64_t D, const float *cos, const float *sin, int64_t half,
               float *out) {
    const int64_t keep = D - 2 * half;
    for (int64_t r = 0; r < R; r++) {
        const float *c = cos + r * half, *s = sin + r * half;
        for (int64_t h = 0; h < H; h++) {
            const float *xi = x + (r * H + h) * D;
            float *o = out + (r * H + h) * D;
            memcpy(o, xi, keep * sizeof(float));
            for (int64_t i = 0; i < half; i++) {
                const float a = xi[keep + 2 * i], b = xi[keep + 2 * i + 1];
                o[keep + 2 * i] = a * c[i] - b * s[i];
                o[keep + 2 * i + 1] = a * s[i] + b * c[i];
            }
        }
    }
}
