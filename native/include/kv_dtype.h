/*
 * The KV cache's element types (enum pa_dtype in paged_attention.h) and their conversions
 * to and from float, shared by the CPU library and the CUDA library (host and device), so
 * every backend stores the same bits for the same values; the torch backend's conversions
 * (torch's own, round to nearest even) give the same bits too, and tests hold them to it.
 *
 * Row layout: one token's K (or V) of one KV head is a row. float32 / bfloat16 / float16 /
 * fp8 rows are head_size elements. An int8 row is head_size int8 values followed by its
 * float16 scale (2 bytes): x = q * scale, scale = max|x| / 127 (at least 2^-14, the smallest
 * normal float16), q = round(x / scale) -- computed when the row is written, like llama.cpp's
 * q8_0 but per row of a head. fp8 rows hold x / layer_scale (saturated at the format's largest
 * finite value), the layer's K and V scales being 1.0 unless calibrated (vLLM's convention).
 */
#ifndef PA_KV_DTYPE_H
#define PA_KV_DTYPE_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__CUDACC__)
#define PA_HD __host__ __device__ __forceinline__
#else
#define PA_HD inline
#endif

namespace pa_kv {

constexpr int kInt8ScaleBytes = 2;   // the float16 scale after an int8 row's values
constexpr float kInt8MinScale = 6.103515625e-05f;  // 2^-14: int8 scales stay normal float16
constexpr float kFp8E4m3Max = 448.f, kFp8E5m2Max = 57344.f;

PA_HD uint32_t float_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

PA_HD float bits_float(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

PA_HD float bf16_to_float(uint16_t v) { return bits_float(static_cast<uint32_t>(v) << 16); }

PA_HD uint16_t float_to_bf16(float f) {  // round to nearest even; NaN stays NaN
    uint32_t bits = float_bits(f);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return static_cast<uint16_t>(bits >> 16);
}

PA_HD float half_to_float(uint16_t h) {
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    const uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
    if (exp == 0) {  // zero or subnormal: mant * 2^-24
        const float v = static_cast<float>(mant) * 5.9604644775390625e-08f;
        return bits_float(float_bits(v) | sign);
    }
    if (exp == 31) return bits_float(sign | 0x7f800000u | (mant << 13));  // inf, NaN
    return bits_float(sign | ((exp + 112u) << 23) | (mant << 13));
}

// A float as a float of `mant` mantissa bits, exponent bias `bias` and largest finite
// encoding `max_code`, round to nearest even, saturating (the magnitude bits only; the
// caller adds the sign). Covers float16 (10, 15, 0x7bff) and the fp8 formats.
PA_HD uint32_t round_magnitude(float a, int mant, int bias, uint32_t max_code, float max_value) {
    if (!(a < max_value)) return a != a ? 0x7fu : max_code;  // (0x7f: fp8's NaN)
    const float min_normal = bits_float(static_cast<uint32_t>(127 - bias + 1) << 23);
    if (a < min_normal) {  // subnormal: a multiple of 2^(1 - bias - mant), rounded half to even
        const float unit = bits_float(static_cast<uint32_t>(127 + 1 - bias - mant) << 23);
        // (a power-of-two division, exact; rintf rounds half to even; 2^mant, reached by
        // rounding up, is the smallest normal's encoding)
        return static_cast<uint32_t>(rintf(a / unit));
    }
    const int shift = 23 - mant;
    uint32_t bits = float_bits(a);
    bits += (1u << (shift - 1)) - 1u + ((bits >> shift) & 1u);
    const uint32_t code = (bits >> shift) - (static_cast<uint32_t>(127 - bias) << mant);
    return code > max_code ? max_code : code;
}

PA_HD uint16_t float_to_half(float f) {
    const uint32_t bits = float_bits(f);
    const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
    const float a = bits_float(bits & 0x7fffffffu);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);  // NaN
    if (a >= 65520.f) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds past the largest: inf
    return static_cast<uint16_t>(sign | round_magnitude(a, 10, 15, 0x7bffu, 65520.f));
}

// fp8 from a float already divided by the layer's scale; saturating, as vLLM stores fp8 caches.
PA_HD uint8_t float_to_e4m3(float f) {
    const uint32_t bits = float_bits(f);
    const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
    return static_cast<uint8_t>(sign | round_magnitude(bits_float(bits & 0x7fffffffu), 3, 7, 0x7eu, kFp8E4m3Max));
}

PA_HD uint8_t float_to_e5m2(float f) {
    const uint32_t bits = float_bits(f);
    const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
    return static_cast<uint8_t>(sign | round_magnitude(bits_float(bits & 0x7fffffffu), 2, 15, 0x7bu, kFp8E5m2Max));
}

// e5m2 is the high byte of a float16; e4m3's magnitude bits, moved up 7 places, read as a
// float16 of 1/256 the value (its exponent bias is 8 below float16's), subnormals included.
PA_HD float e5m2_to_float(uint8_t v) { return half_to_float(static_cast<uint16_t>(v) << 8); }

PA_HD float e4m3_to_float_over_256(uint8_t v) {
    return half_to_float(static_cast<uint16_t>(((v & 0x80u) << 8) | ((v & 0x7fu) << 7)));
}

PA_HD float e4m3_to_float(uint8_t v) { return e4m3_to_float_over_256(v) * 256.f; }

// int8 row: the scale, then the values (see the top of this file).
PA_HD float int8_scale(float amax) {
    const float s = amax / 127.f;
    return half_to_float(float_to_half(s > kInt8MinScale ? s : kInt8MinScale));
}

PA_HD int8_t int8_value(float x, float scale) {
    float q = x / scale;
    q = q > 127.f ? 127.f : (q < -127.f ? -127.f : (q == q ? q : 0.f));  // (NaN: 0)
    return static_cast<int8_t>(rintf(q));  // half to even, as torch.round
}

}  // namespace pa_kv

#endif /* PA_KV_DTYPE_H */
