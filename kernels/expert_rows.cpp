// Row moves of the CPU expert op between token order and expert order (kt_ft/kernels/grouped.py's
// torch ops are the reference twin the tests compare with):
//
//   gather:  dst[r, :] = float(src[idx[r], :])            src bf16 or fp32 [T, C] -> fp32 [N, C]
//   combine: out[t, :] = sum_j w[t, j] * src[inv[t k + j], :]   fp32 [N, C] -> fp32 [T, C]
//            (w null: every weight 1), summed in fp32 in slot order
//
// In torch the gather of bf16 tokens is a widening copy of the whole input and then an
// index_select (two passes, a [T, C] temporary); the combine is an index_select into a
// [T k, C] temporary and a batched product over it. Here each is one pass, a row at a time,
// with plain loops gcc vectorizes at each path's width.

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "rows.h"


namespace {

constexpr int64_t ROWS_PER_ITEM = 16;
typedef uint32_t __attribute__((may_alias)) u32_alias;  // fp32 bits written as integers

struct Gather {
    const void* src;
    int src_bf16;
    int64_t lds;
    const int64_t* idx;
    float* dst;
    int64_t ldd;
    int64_t cols;
};

struct Combine {
    const float* src;
    int64_t lds;
    const int64_t* inv;
    const float* w;  // [T, k] or null
    int64_t k;
    float* out;
    int64_t ldo;
    int64_t cols;
};

inline void gather_rows(const Gather& a, int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
        float* d = a.dst + r * a.ldd;
        if (a.src_bf16) {
            const uint16_t* s = static_cast<const uint16_t*>(a.src) + a.idx[r] * a.lds;
            u32_alias* __restrict du = reinterpret_cast<u32_alias*>(d);  // a bf16: its fp32's high half
            const int64_t cols = a.cols;
            for (int64_t c = 0; c < cols; ++c) du[c] = static_cast<uint32_t>(s[c]) << 16;
        } else {
            std::memcpy(d, static_cast<const float*>(a.src) + a.idx[r] * a.lds, a.cols * sizeof(float));
        }
    }
}

inline void combine_rows(const Combine& a, int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
        float* o = a.out + t * a.ldo;
        for (int64_t j = 0; j < a.k; ++j) {
            const float* s = a.src + a.inv[t * a.k + j] * a.lds;
            const float w = a.w ? a.w[t * a.k + j] : 1.0f;
            if (j == 0)
                for (int64_t c = 0; c < a.cols; ++c) o[c] = w * s[c];
            else
                for (int64_t c = 0; c < a.cols; ++c) o[c] += w * s[c];
        }
    }
}


void gather_base(const Gather& a, int64_t r0, int64_t r1) { gather_rows(a, r0, r1); }
KTFT_T_AVX2 void gather_avx2(const Gather& a, int64_t r0, int64_t r1) { gather_rows(a, r0, r1); }
KTFT_T_AVX512 void gather_avx512(const Gather& a, int64_t r0, int64_t r1) { gather_rows(a, r0, r1); }
void combine_base(const Combine& a, int64_t r0, int64_t r1) { combine_rows(a, r0, r1); }
KTFT_T_AVX2 void combine_avx2(const Combine& a, int64_t r0, int64_t r1) { combine_rows(a, r0, r1); }
KTFT_T_AVX512 void combine_avx512(const Combine& a, int64_t r0, int64_t r1) { combine_rows(a, r0, r1); }

}  // namespace

extern "C" {

// dst[r, :cols] = float(src[idx[r], :cols]) for r < rows; src bf16 bits (src_bf16 = 1) or fp32,
// row strides lds, ldd (elements). Indices are trusted (the caller checks them). Returns the path.
int ktft_gather_rows(int64_t rows, int64_t cols, const void* src, int src_bf16, int64_t lds, const int64_t* idx,
                     float* dst, int64_t ldd, int threads, int isa) {
    const Gather a{src, src_bf16, lds, idx, dst, ldd, cols};
    return ktft::run_rows(rows, ROWS_PER_ITEM, a, threads, isa, gather_base, gather_avx2, gather_avx512);
}

// out[t, :cols] = sum_{j < k} w[t k + j] * src[inv[t k + j], :cols] for t < tokens (w null: 1),
// fp32, summed in slot order. Returns the path.
int ktft_combine_rows(int64_t tokens, int64_t k, int64_t cols, const float* src, int64_t lds, const int64_t* inv,
                      const float* w, float* out, int64_t ldo, int threads, int isa) {
    const Combine a{src, lds, inv, w, k, out, ldo, cols};
    return ktft::run_rows(tokens, ROWS_PER_ITEM, a, threads, isa, combine_base, combine_avx2, combine_avx512);
}

}  // extern "C"
