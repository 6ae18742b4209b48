// Dequantization of quantized expert weights on the CPU (kt_ft/quant/formats.py holds the torch
// twins the tests compare against, bitwise).
//
// INT8 per-channel format (compressed-tensors int-quantized): codes int8 [rows, cols], one float32
// scale per row; W = code * scale, rounded once. Same scheme as FP8 below with a 1 x cols tile
// (torch writes an int8 x float32 product to bf16 ~17x slower than to float32 on 2 AVX2 cores).
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

// the float value of each of the 256 codes of a format: kind 0 e4m3fn, 1 int8 (two's complement)
struct Values {
    float v[256];
    explicit Values(int kind) {
        for (unsigned c = 0; c < 256; ++c)
            v[c] = kind == 0 ? e4m3_value(c) : static_cast<float>(static_cast<int8_t>(static_cast<uint8_t>(c)));
    }
};
const Values kValues[2] = {Values(0), Values(1)};

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


// W[rows, cols] = value(q) * scale[r / block_r, c / block_c] for `experts` weights one after
// another (expert e's codes at q + e * q_stride, scales at scale + e * s_stride, output at
// out + e * o_stride; strides in elements). Row strides ldq, lds, ldo. out_f32: 1 float32 output,
// 0 bf16 bits. Work items: one block row of one expert.
void dequant_tiles(const float* values, int64_t experts, int64_t rows, int64_t cols, int64_t block_r,
                   int64_t block_c, const uint8_t* q, int64_t ldq, int64_t q_stride, const float* scale, int64_t lds,
                   int64_t s_stride, void* out, int64_t ldo, int64_t o_stride, int out_f32, int threads) {
    const int64_t brows = (rows + block_r - 1) / block_r, items = experts * brows;
    threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, items)));
    std::atomic<int64_t> next{0};
    auto worker = [&]() {
        float tf[256];
        uint16_t tb[256];
        for (int64_t it; (it = next.fetch_add(1)) < items;) {
            const int64_t e = it / brows, br = it % brows;
            const int64_t r0 = br * block_r, r1 = std::min(rows, r0 + block_r);
            const uint8_t* qe = q + e * q_stride;
            const float* se = scale + e * s_stride + br * lds;
            for (int64_t c0 = 0, bc = 0; c0 < cols; c0 += block_c, ++bc) {
                const int64_t c1 = std::min(cols, c0 + block_c);
                const float s = se[bc];
                if (out_f32) {
                    for (int c = 0; c < 256; ++c) tf[c] = values[c] * s;
                    tile(qe, ldq, static_cast<float*>(out) + e * o_stride, ldo, r0, r1, c0, c1, tf);
                } else {
                    for (int c = 0; c < 256; ++c) tb[c] = to_bf16(values[c] * s);
                    tile(qe, ldq, static_cast<uint16_t*>(out) + e * o_stride, ldo, r0, r1, c0, c1, tb);
                }
            }
        }
    };
    team(threads, worker);
}

}  // namespace

extern "C" {

// FP8 block: dequant_tiles with block x block tiles of e4m3fn codes. Returns 0.
int ktft_dequant_fp8_block(int64_t experts, int64_t rows, int64_t cols, int64_t block, const uint8_t* q,
                           int64_t ldq, int64_t q_stride, const float* scale, int64_t lds, int64_t s_stride,
                           void* out, int64_t ldo, int64_t o_stride, int out_f32, int threads) {
    dequant_tiles(kValues[0].v, experts, rows, cols, block, block, q, ldq, q_stride, scale, lds, s_stride, out, ldo,
                  o_stride, out_f32, threads);
    return 0;
}

// INT8 per channel: dequant_tiles with 1 x cols tiles of int8 codes (scale [rows, 1] per expert,
// row stride lds). Returns 0.
int ktft_dequant_int8_rows(int64_t experts, int64_t rows, int64_t cols, const uint8_t* q, int64_t ldq,
                           int64_t q_stride, const float* scale, int64_t lds, int64_t s_stride, void* out,
                           int64_t ldo, int64_t o_stride, int out_f32, int threads) {
    dequant_tiles(kValues[1].v, experts, rows, cols, 1, cols, q, ldq, q_stride, scale, lds, s_stride, out, ldo,
                  o_stride, out_f32, threads);
    return 0;
}

}  // extern "C"
