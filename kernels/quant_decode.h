// Quantized expert weights decoded to bf16, a row segment at a time: the weight panels of the
// GEMMs over quantized experts (expert_gemm.cpp, `ktft_grouped_gemm_quant`) and the whole-weight
// dequantizer (dequant.cpp) share these.
//
// Every format's value is code value * scale computed in float32 and rounded once to bf16 (to
// nearest even, NaN kept quiet), as kt_ft/backends/quant.py's torch dequantizers compute it: a
// GEMM over the decoded panels is the bf16 GEMM over `QuantFormat.dequantize(parts, bf16)`, bit
// for bit. Formats (W [rows, cols] per expert, `cols` the input size):
//   * FP8 (DeepSeek-V3 `quant_method: fp8`): e4m3fn byte codes, float32 scale per 128 x 128 block;
//   * INT8 (compressed-tensors int-quantized, channel): int8 codes, one scale per row;
//   * INT4 (compressed-tensors pack-quantized, group 32): 8 codes an int32 word, code j of the word
//     in bits 4j..4j+3 (so column c is byte c/2's low nibble for even c, high for odd), code = q + 8;
//     a bf16 / fp16 / float32 scale per 32 columns;
//   * MXFP4 (OCP microscaling, gpt-oss): fp4 e2m1 codes (bit 3 the sign, bits 0-2 index 0, 0.5, 1,
//     1.5, 2, 3, 4, 6), byte c/2's low nibble for even c as INT4; an e8m0 scale (2^(s - 127)) per 32.
// The AVX2 + F16C path decodes 8 columns a step, the AVX-512BW one (bf16 outputs) 16, 16 rows at a
// time where the GEMMs read short pieces of many rows; all give the plain loops' bits (they round
// the same float32 product); segments never cross a scale group. Outputs are bf16 bits, or floats
// holding those bf16 values (the fp32 GEMM paths' packed panels).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "bf16.h"

namespace ktft {

enum QuantKind : int32_t { Q_FP8 = 0, Q_INT8 = 1, Q_INT4 = 2, Q_MXFP4 = 3 };
enum ScaleType : int32_t { S_F32 = 0, S_BF16 = 1, S_F16 = 2, S_E8M0 = 3 };

// One part of a quantized expert weight (the gate rows, the up rows, or all rows), for every
// expert. Shared with Python through ctypes (kt_ft/backends/native.py `_QuantPart`): keep the
// field order and types.
struct QuantPart {
    int32_t kind;         // QuantKind
    int32_t scale_type;   // ScaleType
    int64_t rows;         // rows of this part
    int64_t block_rows;   // rows sharing a scale row (FP8 128, others 1)
    int64_t group;        // columns sharing a scale (FP8 128, INT4 / MXFP4 32, INT8 the row's cols)
    const uint8_t* codes;
    int64_t code_estride, code_ld;  // bytes between experts, between rows
    const void* scale;
    int64_t scale_estride, scale_ld;  // elements between experts, between scale rows
};

// A whole weight: its parts stacked in row order, `cols` inputs.
struct QuantW {
    const QuantPart* parts;
    int nparts;
    int64_t cols;
};

inline float bits_f32(uint32_t u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

// e4m3fn (bias 7, no infinities, 0x7f / 0xff NaN) -> its float value
inline float e4m3_value(unsigned c) {
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

// IEEE half bits -> float (scales stored as fp16)
inline float f16_value(uint16_t h) {
    const unsigned sign = h >> 15, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
    float v;
    if (exp == 0)
        v = std::ldexp(static_cast<float>(man), -24);
    else if (exp == 31)
        v = man ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
    else
        v = std::ldexp(static_cast<float>(1024 + man), static_cast<int>(exp) - 25);
    return sign ? -v : v;
}

constexpr float kE2M1[8] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};

// scale i of a part's scales (i in elements from the expert's first)
inline float scale_value(const QuantPart& p, const void* base, int64_t i) {
    switch (p.scale_type) {
        case S_BF16: return bits_f32(static_cast<uint32_t>(static_cast<const uint16_t*>(base)[i]) << 16);
        case S_F16: return f16_value(static_cast<const uint16_t*>(base)[i]);
        case S_E8M0: {  // 2^(s - 127) as float bits: s the exponent field (0: the subnormal 2^-127; 255: inf)
            const uint32_t s = static_cast<const uint8_t*>(base)[i];
            return bits_f32(s ? s << 23 : 0x00400000u);
        }
        default: return static_cast<const float*>(base)[i];
    }
}

// the first scale of expert e in part p (scale_value's base)
inline const void* expert_scales(const QuantPart& p, int64_t e) {
    const size_t bytes = p.scale_type == S_F32 ? 4 : p.scale_type == S_E8M0 ? 1 : 2;
    return static_cast<const uint8_t*>(p.scale) + e * p.scale_estride * static_cast<int64_t>(bytes);
}

// the value of column c of a row (codes: the row's first byte), before the scale
inline float code_value(int kind, const uint8_t* codes, int64_t c) {
    switch (kind) {
        case Q_FP8: return e4m3_value(codes[c]);
        case Q_INT8: return static_cast<float>(static_cast<int8_t>(codes[c]));
        default: {
            const unsigned nib = (codes[c >> 1] >> ((c & 1) * 4)) & 0xFu;
            if (kind == Q_INT4) return static_cast<float>(static_cast<int>(nib) - 8);
            const float m = kE2M1[nib & 7u];
            return (nib & 8u) ? -m : m;
        }
    }
}

// Where decoded column j of a row segment goes. Row<T>: a row of T (uint16_t: bf16 bits; float:
// floats holding bf16 values, the fp32 GEMM paths); Panels: the fp32 paths' NN packing, 16
// columns a panel, `stride` floats from one panel to the next (8 consecutive j from a multiple of
// 8 stay contiguous in both).
template <class T>
struct Row {
    T* p;
    T* at(int64_t j) const { return p + j; }
};
struct Panels {
    float* p;
    int64_t stride;
    float* at(int64_t j) const { return p + (j >> 4) * stride + (j & 15); }
};

inline void put(uint16_t* d, float v) { *d = to_bf16(v); }
inline void put(float* d, float v) { *d = bf16_to_f32(to_bf16(v)); }

// out.at(j0 + j) = bf16(value(column c0 + j) * s) for j < n, plain loop
template <class Out>
inline void segment_scalar(int kind, const uint8_t* codes, int64_t c0, int64_t n, float s, Out out, int64_t j0) {
    for (int64_t j = 0; j < n; ++j) put(out.at(j0 + j), code_value(kind, codes, c0 + j) * s);
}

#if defined(__x86_64__)
#define KTFT_AVX2_F16C __attribute__((target("avx2,fma,f16c")))

// 8 floats -> 8 bf16 bits: to_bf16's arithmetic a lane at a time
KTFT_AVX2_F16C inline __m128i bf16x8(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb)), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40)), nan);
    // each 128-bit lane packs to [its 4 values, the same 4]: keep quarters 0 and 2
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08));
}

// 8 floats rounded to bf16 as to_bf16 rounds, kept as floats (low 16 bits cleared). No NaN
// branch: every NaN reaching here is a quieted one (an e4m3 NaN code decodes to 0x7FC00000; a NaN
// scale is quieted by the product), whose bit 22 survives the rounding's carry, so it stays NaN.
KTFT_AVX2_F16C inline __m256 bf16_round8(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb));
    return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// Exact: the value needs no rounding to be a bf16 (MXFP4: an e2m1 value, 2 significant bits,
// times a power of two >= 2^-127)
template <bool Exact>
KTFT_AVX2_F16C inline void store8(uint16_t* dst, __m256 v) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), bf16x8(v));
}
template <bool Exact>
KTFT_AVX2_F16C inline void store8(float* dst, __m256 v) {
    _mm256_storeu_ps(dst, Exact ? v : bf16_round8(v));
}

// 8 e4m3 codes -> their values / 256 as float32 (an e4m3 code's bits moved into a float16's:
// exact, subnormals included; 0x7f / 0xff NaN). (16 a step through one 256-bit register measured
// 2x slower in the GEMMs' access order.)
KTFT_AVX2_F16C inline __m256 e4m3x8_over_256(const uint8_t* src) {
    const __m128i x = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src)));
    const __m128i m7f = _mm_set1_epi16(0x7F);
    const __m128i mag = _mm_and_si128(x, m7f);
    __m128i h = _mm_or_si128(_mm_slli_epi16(mag, 7), _mm_and_si128(x, _mm_set1_epi16(static_cast<int16_t>(0x8000))));
    h = _mm_blendv_epi8(h, _mm_set1_epi16(0x7E00), _mm_cmpeq_epi16(mag, m7f));
    return _mm256_cvtph_ps(h);
}

// the 8 nibbles of 4 bytes (column c0 even: byte c0/2 onwards), low nibble first, as int32 lanes
KTFT_AVX2_F16C inline __m256i nibbles8(const uint8_t* bytes) {
    uint32_t w;
    std::memcpy(&w, bytes, 4);
    const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    return _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(w)), shifts), _mm256_set1_epi32(0xF));
}

// 8 codes from column c (a multiple of 8) of a row, as float values before the scale
template <int Kind>
KTFT_AVX2_F16C inline __m256 values8(const uint8_t* codes, int64_t c) {
    if (Kind == Q_INT8)
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + c))));
    const __m256i nib = nibbles8(codes + c / 2);
    if (Kind == Q_INT4) return _mm256_cvtepi32_ps(_mm256_sub_epi32(nib, _mm256_set1_epi32(8)));
    // e2m1: the magnitude from the table (permutevar reads each lane's low 3 bits), bit 3 the sign
    const __m256 m = _mm256_permutevar8x32_ps(_mm256_loadu_ps(kE2M1), nib);
    return _mm256_or_ps(m, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_srli_epi32(nib, 3), 31)));
}

// columns c0.. (c0 a multiple of 8) of one scale group, 8 a step; returns how many were done
template <int Kind, class Out>
KTFT_AVX2_F16C inline int64_t segment8(const uint8_t* codes, int64_t c0, int64_t n, float s, Out out, int64_t j0) {
    constexpr bool exact = Kind == Q_MXFP4;
    int64_t j = 0;
    if (Kind == Q_FP8) {
        const __m256 vs = _mm256_set1_ps(s * 256.f);  // exact: a power of two
        for (; j + 8 <= n; j += 8) store8<exact>(out.at(j0 + j), _mm256_mul_ps(e4m3x8_over_256(codes + c0 + j), vs));
        return j;
    }
    const __m256 vs = _mm256_set1_ps(s);
    for (; j + 8 <= n; j += 8) store8<exact>(out.at(j0 + j), _mm256_mul_ps(values8<Kind>(codes, c0 + j), vs));
    return j;
}

// R rows at once: columns [c0, c0 + n) of one scale group of rows codes[0..R), scales s[0..R),
// into outs[i].at(j0 + j). The rows' loads interleave, so R cache misses are in flight at a time
// (one row after the other, each row's first load waited for memory alone: the packing stalled on
// it ~3/4 of its time at DeepSeek-V3's row stride).
template <int Kind, int R, class Out>
KTFT_AVX2_F16C inline int64_t segment8_rows(const uint8_t* const* codes, int64_t c0, int64_t n, const float* s,
                                            const Out* outs, int64_t j0) {
    constexpr bool exact = Kind == Q_MXFP4;
    __m256 vs[R];
    for (int i = 0; i < R; ++i) vs[i] = _mm256_set1_ps(Kind == Q_FP8 ? s[i] * 256.f : s[i]);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        __m256 v[R];
        for (int i = 0; i < R; ++i)
            v[i] = Kind == Q_FP8 ? e4m3x8_over_256(codes[i] + c0 + j) : values8<Kind == Q_FP8 ? Q_INT8 : Kind>(codes[i], c0 + j);
        for (int i = 0; i < R; ++i) store8<exact>(outs[i].at(j0 + j), _mm256_mul_ps(v[i], vs[i]));
    }
    return j;
}

// segment_scalar, 8 columns a step where c0 is a multiple of 8 (the nibble formats' bytes align)
template <class Out>
KTFT_AVX2_F16C inline void segment_avx2(int kind, const uint8_t* codes, int64_t c0, int64_t n, float s, Out out,
                                        int64_t j0) {
    int64_t j = 0;
    if (c0 % 8 == 0 && j0 % 8 == 0) switch (kind) {
            case Q_FP8: j = segment8<Q_FP8>(codes, c0, n, s, out, j0); break;
            case Q_INT8: j = segment8<Q_INT8>(codes, c0, n, s, out, j0); break;
            case Q_INT4: j = segment8<Q_INT4>(codes, c0, n, s, out, j0); break;
            default: j = segment8<Q_MXFP4>(codes, c0, n, s, out, j0); break;
        }
    segment_scalar(kind, codes, c0 + j, n - j, s, out, j0 + j);
}
#endif

// out.at(c - c0) = row r of part p of expert e, column c, for c in [c0, c1); vec: the AVX2 + F16C
// path (the caller checked the CPU has it)
template <class Out>
inline void decode_part_row(const QuantPart& p, int64_t e, int64_t r, int64_t c0, int64_t c1, Out out, bool vec) {
    const uint8_t* codes = p.codes + e * p.code_estride + r * p.code_ld;
    const void* scales = expert_scales(p, e);
    const int64_t srow = (r / p.block_rows) * p.scale_ld;
    for (int64_t c = c0; c < c1;) {
        const int64_t gi = c / p.group, end = std::min(c1, (gi + 1) * p.group);
        const float s = scale_value(p, scales, srow + gi);
#if defined(__x86_64__)
        if (vec)
            segment_avx2(p.kind, codes, c, end - c, s, out, c - c0);
        else
#endif
            segment_scalar(p.kind, codes, c, end - c, s, out, c - c0);
        c = end;
    }
    (void)vec;
}

// the part of w holding row r, and r within it
inline const QuantPart& part_of(const QuantW& w, int64_t& r) {
    int i = 0;
    while (i + 1 < w.nparts && r >= w.parts[i].rows) r -= w.parts[i++].rows;
    return w.parts[i];
}

// the rows of w from r to the end of r's part
inline int64_t rows_left_in_part(const QuantW& w, int64_t r) {
    const QuantPart& p = part_of(w, r);
    return p.rows - r;
}

#if defined(__x86_64__)
#define KTFT_AVX512BW __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl")))

// 16 codes from column c (a multiple of 16) of a row, as float values before the scale (FP8's / 256)
template <int Kind>
KTFT_AVX512BW inline __m512 values16(const uint8_t* codes, int64_t c) {
    if (Kind == Q_FP8) {  // e4m3x8_over_256's bit moves, 16 lanes of 16 bits
        const __m256i x = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + c)));
        const __m256i m7f = _mm256_set1_epi16(0x7F);
        const __m256i mag = _mm256_and_si256(x, m7f);
        __m256i h = _mm256_or_si256(_mm256_slli_epi16(mag, 7),
                                    _mm256_and_si256(x, _mm256_set1_epi16(static_cast<int16_t>(0x8000))));
        h = _mm256_mask_mov_epi16(h, _mm256_cmpeq_epi16_mask(mag, m7f), _mm256_set1_epi16(0x7E00));
        return _mm512_cvtph_ps(h);
    }
    if (Kind == Q_INT8)
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + c))));
    // 8 bytes -> 16 nibbles in column order (byte j: low nibble column 2j, high 2j + 1)
    const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + c / 2)));
    const __m128i lohi = _mm_or_si128(_mm_and_si128(b, _mm_set1_epi16(0xF)), _mm_slli_epi16(_mm_srli_epi16(b, 4), 8));
    const __m512i nib = _mm512_cvtepu8_epi32(lohi);
    if (Kind == Q_INT4) return _mm512_cvtepi32_ps(_mm512_sub_epi32(nib, _mm512_set1_epi32(8)));
    const __m512 table = _mm512_setr_ps(0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -0.5f, -1.f, -1.5f, -2.f, -3.f,
                                        -4.f, -6.f);
    return _mm512_permutexvar_ps(nib, table);
}

// 16 floats -> 16 bf16 bits, to_bf16's arithmetic (NaN: quiet, upper bits kept)
KTFT_AVX512BW inline __m256i bf16x16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb)), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
    return _mm512_cvtepi32_epi16(r);
}

// segment8_rows for bf16 outputs, 16 columns a step with AVX-512 (the bf16 GEMM paths' slabs)
template <int Kind, int R>
KTFT_AVX512BW inline int64_t segment16_rows(const uint8_t* const* codes, int64_t c0, int64_t n, const float* s,
                                            const Row<uint16_t>* outs, int64_t j0) {
    __m512 vs[R];
    for (int i = 0; i < R; ++i) vs[i] = _mm512_set1_ps(Kind == Q_FP8 ? s[i] * 256.f : s[i]);
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
        __m512 v[R];
        for (int i = 0; i < R; ++i) v[i] = values16<Kind>(codes[i], c0 + j);
        for (int i = 0; i < R; ++i)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(outs[i].at(j0 + j)), bf16x16(_mm512_mul_ps(v[i], vs[i])));
    }
    return j;
}

template <int R>
KTFT_AVX512BW inline int64_t segment16_rows_any(int kind, const uint8_t* const* codes, int64_t c0, int64_t n,
                                                const float* s, const Row<uint16_t>* outs, int64_t j0) {
    switch (kind) {
        case Q_FP8: return segment16_rows<Q_FP8, R>(codes, c0, n, s, outs, j0);
        case Q_INT8: return segment16_rows<Q_INT8, R>(codes, c0, n, s, outs, j0);
        case Q_INT4: return segment16_rows<Q_INT4, R>(codes, c0, n, s, outs, j0);
        default: return segment16_rows<Q_MXFP4, R>(codes, c0, n, s, outs, j0);
    }
}
#endif

#if defined(__x86_64__)
// rows [r, r + R) of W (expert e; all inside one part), columns [c0, c1): row r + i into outs[i]
// (column c at outs[i].at(c - c0)); the rows' loads interleave (segment8_rows)
template <int R, class Out, bool Wide = false>
KTFT_AVX2_F16C inline void decode_rows_interleaved(const QuantW& w, int64_t e, int64_t r, int64_t c0, int64_t c1,
                                                   const Out* outs) {
    int64_t pr = r;
    const QuantPart& p = part_of(w, pr);
    const uint8_t* codes[R];
    for (int i = 0; i < R; ++i) codes[i] = p.codes + e * p.code_estride + (pr + i) * p.code_ld;
    const void* scales = expert_scales(p, e);
    for (int64_t c = c0; c < c1;) {
        const int64_t gi = c / p.group, end = std::min(c1, (gi + 1) * p.group);
        float s[R];
        for (int i = 0; i < R; ++i) s[i] = scale_value(p, scales, ((pr + i) / p.block_rows) * p.scale_ld + gi);
        int64_t j = 0;
        if constexpr (Wide && std::is_same<Out, Row<uint16_t>>::value)
            if (c % 16 == 0) j = segment16_rows_any<R>(p.kind, codes, c, end - c, s, outs, c - c0);
        if (c % 8 == 0 && (c - c0) % 8 == 0 && j == 0) switch (p.kind) {
                case Q_FP8: j = segment8_rows<Q_FP8, R, Out>(codes, c, end - c, s, outs, c - c0); break;
                case Q_INT8: j = segment8_rows<Q_INT8, R, Out>(codes, c, end - c, s, outs, c - c0); break;
                case Q_INT4: j = segment8_rows<Q_INT4, R, Out>(codes, c, end - c, s, outs, c - c0); break;
                default: j = segment8_rows<Q_MXFP4, R, Out>(codes, c, end - c, s, outs, c - c0); break;
            }
        for (int i = 0; i < R; ++i) segment_scalar(p.kind, codes[i], c + j, end - c - j, s[i], outs[i], c - c0 + j);
        c = end;
    }
}
#endif

constexpr int ROWS_AT_ONCE = 16;  // rows decoded together where they can (decode_rows_interleaved)

// Rows [r0, r1) of W (expert e), columns [c0, c1): row r into out(r - r0) (an Out). level: 0 plain
// loops, 1 AVX2 + F16C, 2 also AVX-512BW (bf16 outputs 16 columns a step); the caller checked the
// CPU. From level 1, 16 rows of one part at a time through decode_rows_interleaved (rows a few
// cache lines each and a row stride apart, as the GEMMs read them, stalled on each row's first
// load one row at a time: 0.6-0.8x the bf16 GEMM at DeepSeek-V3's [4096, 7168] experts; 16 at
// once, 0.93-0.99x), else row by row.
template <class MakeOut>
inline void decode_block(const QuantW& w, int64_t e, int64_t r0, int64_t r1, int64_t c0, int64_t c1, MakeOut out,
                         int level) {
    for (int64_t r = r0; r < r1;) {
#if defined(__x86_64__)
        if (level > 0 && r + ROWS_AT_ONCE <= r1 && rows_left_in_part(w, r) >= ROWS_AT_ONCE) {
            using Out = decltype(out(0));
            Out outs[ROWS_AT_ONCE];
            for (int i = 0; i < ROWS_AT_ONCE; ++i) outs[i] = out(r - r0 + i);
            if (level > 1)
                decode_rows_interleaved<ROWS_AT_ONCE, Out, true>(w, e, r, c0, c1, outs);
            else
                decode_rows_interleaved<ROWS_AT_ONCE, Out, false>(w, e, r, c0, c1, outs);
            r += ROWS_AT_ONCE;
            continue;
        }
#endif
        int64_t pr = r;
        const QuantPart& p = part_of(w, pr);
        decode_part_row(p, e, pr, c0, c1, out(r - r0), level > 0);
        ++r;
    }
}

// dst[(r - r0) * ld + (c - c0)] = W[r, c] of expert e for rows [r0, r1), columns [c0, c1)
template <class T>
inline void decode_rows(const QuantW& w, int64_t e, int64_t r0, int64_t r1, int64_t c0, int64_t c1, T* dst,
                        int64_t ld, int level) {
    decode_block(w, e, r0, r1, c0, c1, [=](int64_t i) { return Row<T>{dst + i * ld}; }, level);
}

// rows [r0, r1) of W (expert e), columns [c0, c1), into the fp32 paths' NN panels: row r's column
// c0 + j at Panels{dst + (r - r0) * 16, stride}.at(j)
inline void decode_rows_panels(const QuantW& w, int64_t e, int64_t r0, int64_t r1, int64_t c0, int64_t c1,
                               float* dst, int64_t stride, int level) {
    decode_block(w, e, r0, r1, c0, c1, [=](int64_t i) { return Panels{dst + i * 16, stride}; }, level);
}

}  // namespace ktft
