// bfloat16 and float16 <-> float32 conversions for the CPU handler, round-to-nearest-even like
// the GPU's __float2bfloat16_rn / __float2half_rn. XLA hands these dtypes over as raw uint16 bits.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace lnbwd {

inline uint32_t FloatBits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float BitsFloat(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

// bfloat16 is the top half of a float32.
inline float Bf16ToFloat(uint16_t h) { return BitsFloat(static_cast<uint32_t>(h) << 16); }
inline uint16_t FloatToBf16(float f) {
  const uint32_t u = FloatBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);  // quiet NaN
  const uint32_t round = 0x7fffu + ((u >> 16) & 1u);   // ties go to the even neighbour
  return static_cast<uint16_t>((u + round) >> 16);
}

// float16: 1 sign bit, 5 exponent bits (bias 15), 10 mantissa bits.
inline float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t man = h & 0x3ffu;
  if (exp == 0) {   // zero or subnormal: man * 2^-24
    const float f = std::ldexp(static_cast<float>(man), -24);
    return sign ? -f : f;
  }
  if (exp == 31) return BitsFloat(sign | 0x7f800000u | (man << 13));   // inf or NaN
  return BitsFloat(sign | ((exp + 112u) << 23) | (man << 13));         // rebias 15 -> 127
}

inline uint16_t FloatToHalf(float f) {
  const uint32_t u = FloatBits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a >= 0x7f800000u) return sign | (a > 0x7f800000u ? 0x7e00u : 0x7c00u);   // NaN or inf
  if (a >= 0x477ff000u) return sign | 0x7c00u;     // 65520 and up round to inf
  if (a < 0x38800000u) {                           // below 2^-14: subnormal (units of 2^-24)
    return sign | static_cast<uint16_t>(std::nearbyint(BitsFloat(a) * 16777216.0f));
  }
  const uint32_t rounded = a + 0x0fffu + ((a >> 13) & 1u);   // round 23 -> 10 mantissa bits
  return sign | static_cast<uint16_t>((rounded - (112u << 23)) >> 13);
}

}  // namespace lnbwd
