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
//
// On CPUs with AVX2 (and F16C, which every AVX2 CPU has) both formats take 8 codes a step instead:
// an e4m3 code's bits moved into a float16's (its value / 256, exactly: e4m3's subnormals become
// float16 subnormals), widened by F16C, times 256 * scale; an int8 code widened to float32, times
// the scale; then rounded to bf16 as the table's entries are. value * scale and (value / 256) *
// (256 * scale) are the same real number, so the rounding, and the bits, are the table's. The
// table path stays for other CPUs and for the tests (``ktft_limit_isa`` caps the path).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "quant_decode.h"
#include "team.h"

extern "C" int ktft_best_isa(void);  // expert_gemm.cpp: the best path here, capped by ktft_limit_isa

namespace {

using ktft::e4m3_value;
using ktft::to_bf16;

constexpr int KIND_FP8 = 0, KIND_INT8 = 1;
constexpr int ISA_AVX2 = 2;  // expert_gemm.cpp's Isa: AVX2 + FMA with the OS's AVX state, or better

// the float value of each of the 256 codes of a format (KIND_FP8: e4m3fn, KIND_INT8: two's complement)
struct Values {
    float v[256];
    explicit Values(int kind) {
        for (unsigned c = 0; c < 256; ++c)
            v[c] = kind == KIND_FP8 ? e4m3_value(c)
                                    : static_cast<float>(static_cast<int8_t>(static_cast<uint8_t>(c)));
    }
};
const Values kValues[2] = {Values(KIND_FP8), Values(KIND_INT8)};

using ktft::team;

// one segment of a row: n codes, one scale; out to of (float32) or ob (bf16 bits), whichever is set
void segment_table(const uint8_t* src, int64_t n, const float* tf, const uint16_t* tb, float* of, uint16_t* ob) {
    if (of)
        for (int64_t c = 0; c < n; ++c) of[c] = tf[src[c]];
    else
        for (int64_t c = 0; c < n; ++c) ob[c] = tb[src[c]];
}

#if defined(__x86_64__)
#define AVX2_F16C KTFT_AVX2_F16C
using ktft::bf16x8;
using ktft::e4m3x8_over_256;

bool has_avx2() { return ktft_best_isa() >= ISA_AVX2 && __builtin_cpu_supports("f16c"); }

AVX2_F16C inline void store8(__m256 v, float* of, uint16_t* ob, int64_t c) {
    if (of)
        _mm256_storeu_ps(of + c, v);
    else
        _mm_storeu_si128(reinterpret_cast<__m128i*>(ob + c), bf16x8(v));
}

AVX2_F16C void segment_avx2(int kind, const uint8_t* src, int64_t n, float s, float* of, uint16_t* ob) {
    int64_t c = 0;
    if (kind == KIND_FP8) {
        const __m256 vs = _mm256_set1_ps(s * 256.f);  // exact: a power of two
        for (; c + 8 <= n; c += 8) store8(_mm256_mul_ps(e4m3x8_over_256(src + c), vs), of, ob, c);
    } else {
        const __m256 vs = _mm256_set1_ps(s);
        for (; c + 8 <= n; c += 8) {
            const __m128i x = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + c));
            store8(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(x)), vs), of, ob, c);
        }
    }
    const float* values = kValues[kind].v;
    for (; c < n; ++c) {
        const float v = values[src[c]] * s;
        if (of)
            of[c] = v;
        else
            ob[c] = to_bf16(v);
    }
}
#else
bool has_avx2() { return false; }
void segment_avx2(int, const uint8_t*, int64_t, float, float*, uint16_t*) {}
#endif

// W[rows, cols] = value(q) * scale[r / block_r, c / block_c] for `experts` weights one after
// another (expert e's codes at q + e * q_stride, scales at scale + e * s_stride, output at
// out + e * o_stride; strides in elements). Row strides ldq, lds, ldo. out_f32: 1 float32 output,
// 0 bf16 bits. Work items: one block row of one expert, written row by row.
void dequant_tiles(int kind, int64_t experts, int64_t rows, int64_t cols, int64_t block_r, int64_t block_c,
                   const uint8_t* q, int64_t ldq, int64_t q_stride, const float* scale, int64_t lds, int64_t s_stride,
                   void* out, int64_t ldo, int64_t o_stride, int out_f32, int threads) {
    const int64_t brows = (rows + block_r - 1) / block_r, items = experts * brows;
    const int64_t bcols = (cols + block_c - 1) / block_c;
    const bool vec = has_avx2();
    const float* values = kValues[kind].v;
    threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, items)));
    std::atomic<int64_t> next{0};
    auto worker = [&]() {
        std::vector<float> tf;  // table path: the block row's tables, 256 entries a column block
        std::vector<uint16_t> tb;
        for (int64_t it; (it = next.fetch_add(1)) < items;) {
            const int64_t e = it / brows, br = it % brows;
            const int64_t r0 = br * block_r, r1 = std::min(rows, r0 + block_r);
            const uint8_t* qe = q + e * q_stride;
            const float* se = scale + e * s_stride + br * lds;
            float* of = out_f32 ? static_cast<float*>(out) + e * o_stride : nullptr;
            uint16_t* ob = out_f32 ? nullptr : static_cast<uint16_t*>(out) + e * o_stride;
            if (!vec) {
                if (out_f32)
                    tf.resize(bcols * 256);
                else
                    tb.resize(bcols * 256);
                for (int64_t bc = 0; bc < bcols; ++bc)
                    for (int c = 0; c < 256; ++c) {
                        const float v = values[c] * se[bc];
                        if (out_f32)
                            tf[bc * 256 + c] = v;
                        else
                            tb[bc * 256 + c] = to_bf16(v);
                    }
            }
            for (int64_t r = r0; r < r1; ++r) {
                const uint8_t* src = qe + r * ldq;
                float* ofr = of ? of + r * ldo : nullptr;
                uint16_t* obr = ob ? ob + r * ldo : nullptr;
                for (int64_t bc = 0, c0 = 0; c0 < cols; ++bc, c0 += block_c) {
                    const int64_t n = std::min(cols, c0 + block_c) - c0;
                    float* ofs = ofr ? ofr + c0 : nullptr;
                    uint16_t* obs = obr ? obr + c0 : nullptr;
                    if (vec)
                        segment_avx2(kind, src + c0, n, se[bc], ofs, obs);
                    else
                        segment_table(src + c0, n, out_f32 ? &tf[bc * 256] : nullptr,
                                      out_f32 ? nullptr : &tb[bc * 256], ofs, obs);
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
    dequant_tiles(KIND_FP8, experts, rows, cols, block, block, q, ldq, q_stride, scale, lds, s_stride, out, ldo,
                  o_stride, out_f32, threads);
    return 0;
}

// INT8 per channel: dequant_tiles with 1 x cols tiles of int8 codes (scale [rows, 1] per expert,
// row stride lds). Returns 0.
int ktft_dequant_int8_rows(int64_t experts, int64_t rows, int64_t cols, const uint8_t* q, int64_t ldq,
                           int64_t q_stride, const float* scale, int64_t lds, int64_t s_stride, void* out,
                           int64_t ldo, int64_t o_stride, int out_f32, int threads) {
    dequant_tiles(KIND_INT8, experts, rows, cols, 1, cols, q, ldq, q_stride, scale, lds, s_stride, out, ldo,
                  o_stride, out_f32, threads);
    return 0;
}

}  // extern "C"
