// Dequantization of quantized expert weights on the CPU (kt_ft/quant/formats.py holds the torch
// twins the tests compare against, bitwise).
//
// FP8 block format (DeepSeek-V3 `quant_method: fp8`): codes float8 e4m3fn [rows, cols], one float32
// scale per block x block tile; W = value(code) * scale, computed in float32 and rounded once to
// the output type. A tile's 256 possible outputs are one small table (value(c) * scale rounded),
// so the inner loop is a byte load, a table load and a store: no float arithmetic per element,
// and one pass over the codes and the output (torch's own fp8 conversion is scalar and ~8x slower
// for an expert's weight).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "team.h"

namespace {

// e4m3fn (bias 7, no infinities, 0x7f / 0xff NaN) -> its float value
float e4m3_value(unsigned c) {
    const unsigned mag = c & 0x7Fu, exp = mag >> 3, man = mag & 7u;
    float v;
    if (mag == 0x7Fu)
        v = std::numeric_limits<float>::quiet_NaN();
    else if (exp == 0)
        v = std::ldexp(static_cast<float>(man), -9);  // subnormal: man / 8 * 2^-6
    else
        v = std::ldexp(static_cast<float>(8 + man), static_cast<int>(exp) - 10);  // (1 + man/8) 2^(exp-7)
    return (c & 0x80u) ? -v : v;
}

// float -> bf16 bits, round to nearest even (NaN stays a quiet NaN), as torch rounds
uint16_t to_bf16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
    return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

struct Values {
    float v[256];
    Values() {
        for (unsigned c = 0; c < 256; ++c) v[c] = e4m3_value(c);
    }
};
const Values kValues;

using ktft::team;

template <class T>
void tile(const uint8_t* q, int64_t ldq, T* out, int64_t ldo, int64_t r0, int64_t r1, int64_t c0, int64_t c1,
          const T* table) {
    for (int64_t r = r0; r < r1; ++r) {
        const uint8_t* src = q + r * ldq;
        T* dst = out + r * ldo;
        for (int64_t c = c0; c < c1; ++c) dst[c] = table[src[c]];
    }
}

}  // namespace

extern "C" {

// W[rows, cols] = value(q) * scale[r / block, c / block] for `experts` weights one after another
// (expert e's codes at q + e * q_stride, scales at scale + e * s_stride, output at
// out + e * o_stride; strides in elements). Row strides ldq, lds, ldo. out_f32: 1 float32
// output, 0 bf16 bits. Work items: one block row of one expert. Returns 0.
int ktft_dequant_fp8_block(int64_t experts, int64_t rows, int64_t cols, int64_t block, const uint8_t* q,
                           int64_t ldq, int64_t q_stride, const float* scale, int64_t lds, int64_t s_stride,
                           void* out, int64_t ldo, int64_t o_stride, int out_f32, int threads) {
    const int64_t brows = (rows + block - 1) / block, items = experts * brows;
    threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, items)));
    std::atomic<int64_t> next{0};
    auto worker = [&]() {
        float tf[256];
        uint16_t tb[256];
        for (int64_t it; (it = next.fetch_add(1)) < items;) {
            const int64_t e = it / brows, br = it % brows;
            const int64_t r0 = br * block, r1 = std::min(rows, r0 + block);
            const uint8_t* qe = q + e * q_stride;
            const float* se = scale + e * s_stride + br * lds;
            for (int64_t c0 = 0, bc = 0; c0 < cols; c0 += block, ++bc) {
                const int64_t c1 = std::min(cols, c0 + block);
                const float s = se[bc];
                if (out_f32) {
                    for (int c = 0; c < 256; ++c) tf[c] = kValues.v[c] * s;
                    tile(qe, ldq, static_cast<float*>(out) + e * o_stride, ldo, r0, r1, c0, c1, tf);
                } else {
                    for (int c = 0; c < 256; ++c) tb[c] = to_bf16(kValues.v[c] * s);
                    tile(qe, ldq, static_cast<uint16_t*>(out) + e * o_stride, ldo, r0, r1, c0, c1, tb);
                }
            }
        }
    };
    team(threads, worker);
    return 0;
}

}  // extern "C"
