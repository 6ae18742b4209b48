// bf16 <-> float32 bits, as torch converts (one definition for every kernel file).
#pragma once

#include <cstdint>
#include <cstring>

namespace ktft {

// bf16 bits -> the float they are (the high half of a float32)
inline float bf16_to_f32(uint16_t v) {
    const uint32_t u = static_cast<uint32_t>(v) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

// float -> bf16 bits, round to nearest even (NaN stays a quiet NaN), as torch rounds
inline uint16_t to_bf16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
    return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

}  // namespace ktft
