// The routed experts' activation, fused: the elementwise work of the CPU expert op between its
// products (kt_ft/kernels/grouped.py's torch ops are the reference twin the tests compare with).
//
// Per (token, expert) row, with gu = [g | u] the gate/up pre-activations [rows, 2I]:
//
//   forward:  h = silu(g) * u                                   [rows, I]
//             (and gu narrowed to bf16, round to nearest even, for the backward to keep)
//   backward: from gu (fp32 or bf16), q [rows, I] (the gradient of h per unit routing weight:
//             dY (Wd + s Bd Ad)) and w [rows] (the row's routing weight):
//             h = silu(g) u;  grad_w = sum_i h_i q_i;  dh = w q;
//             dg = dh u silu'(g), silu'(g) = sig(g) (1 + g (1 - sig(g)));  du = dh silu(g)
//
// In torch these are ~3 passes forward and ~9 backward over [rows, I] fp32 arrays (each a read
// and a write of tens of MB a DeepSeek-V2-Lite layer); here one pass each, a row at a time.
// exp is a Cephes-style polynomial (range reduction by ln 2, degree-6 polynomial: within a few ulp
// of expf over the clamped range) in gcc's vector extensions at each path's width; the paths
// differ only in width and in whether a*b+c contracts to an fma.

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "bf16.h"
#include "rows.h"

// the wide vector helpers below are always inlined into functions of their own width: the ABI of
// an out-of-line call that gcc warns about never happens
#pragma GCC diagnostic ignored "-Wpsabi"


namespace {

constexpr int64_t ROWS_PER_ITEM = 8;           // a work item: ~8 x 2I x 4 B (~90 KB at I = 1408)

#define KTFT_INLINE __attribute__((always_inline)) inline

// W-lane vectors (gcc's vector extensions): the same source at each path's width (W = 4 on the
// x86-64-v2 baseline, 8 AVX2, 16 AVX-512); auto-vectorizing the scalar loops left some paths
// scalar (gcc does not if-convert the clamp at every width)
template <int W>
struct Vec {
    typedef float f __attribute__((vector_size(W * 4)));
    typedef int32_t i __attribute__((vector_size(W * 4)));
    typedef uint32_t u __attribute__((vector_size(W * 4)));
    typedef uint16_t h __attribute__((vector_size(W * 2)));
};

template <class V>
KTFT_INLINE V load(const void* p) {
    V v;
    std::memcpy(&v, p, sizeof v);
    return v;
}

template <class V>
KTFT_INLINE void store(void* p, const V& v) {
    std::memcpy(p, &v, sizeof v);
}

// e^x = 2^n e^r, n = round(x / ln 2) (by the 1.5 * 2^23 trick: the sum's low mantissa bits hold
// n), |r| <= ln2 / 2, e^r a degree-6 polynomial; x clamped so 2^n stays a normal float. F is a
// float or a vector of them, I the matching int32 type.
template <class F, class I>
KTFT_INLINE F exp_poly(F x) {
    x = x < -87.0f ? F{} - 87.0f : x;
    x = x > 88.0f ? F{} + 88.0f : x;
    const F t = x * 1.44269504088896341f + 12582912.0f;
    const F n = t - 12582912.0f;
    const F r = x - n * 0.693359375f + n * 2.12194440e-4f;  // ln 2 in two parts (n * hi exact)
    F p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    I ni;
    std::memcpy(&ni, &t, sizeof ni);
    const I bits = (ni - 0x4B400000 + 127) << 23;
    F scale;
    std::memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

// the scalar twin for row tails (a ternary on a scalar float is an ordinary branch)
KTFT_INLINE float exp1(float x) { return exp_poly<float, int32_t>(x); }

template <int W>
KTFT_INLINE typename Vec<W>::f widen_bf16(const uint16_t* p) {
    using V = Vec<W>;
    return reinterpret_cast<typename V::f>(__builtin_convertvector(load<typename V::h>(p), typename V::u) << 16);
}

// float -> bf16 bits, round to nearest even (NaN stays a quiet NaN), as torch rounds
template <int W>
KTFT_INLINE typename Vec<W>::h narrow_bf16(typename Vec<W>::f v) {
    using V = Vec<W>;
    const typename V::u u = reinterpret_cast<typename V::u>(v);
    const typename V::u rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    const typename V::u nan = (u >> 16) | 0x0040u;
    return __builtin_convertvector((u & 0x7FFFFFFFu) > 0x7F800000u ? nan : rounded, typename V::h);
}

KTFT_INLINE float widen1(uint16_t v) { return ktft::bf16_to_f32(v); }

KTFT_INLINE uint16_t narrow1(float f) { return ktft::to_bf16(f); }

struct Fwd {
    int64_t inter;
    const float* gu;
    int64_t ldgu;
    float* h;
    int64_t ldh;
    uint16_t* keep;  // null: no narrowed copy
    int64_t ldk;
};

struct Bwd {
    int64_t inter;
    const void* gu;
    int gu_bf16;
    int64_t ldgu;
    const float* q;
    int64_t ldq;
    const float* w;
    float* h;
    int64_t ldh;
    float* dgu;
    int64_t lddgu;
    float* grad_w;
};

template <int W>
KTFT_INLINE void fwd_row(const Fwd& a, int64_t r) {
    using F = typename Vec<W>::f;
    using I = typename Vec<W>::i;
    const float* g = a.gu + r * a.ldgu;
    const float* u = g + a.inter;
    float* h = a.h + r * a.ldh;
    int64_t i = 0;
    for (; i + W <= a.inter; i += W) {
        const F gi = load<F>(g + i);
        store(h + i, gi / (exp_poly<F, I>(-gi) + 1.0f) * load<F>(u + i));
    }
    for (; i < a.inter; ++i) h[i] = g[i] / (exp1(-g[i]) + 1.0f) * u[i];
    if (a.keep) {
        uint16_t* k = a.keep + r * a.ldk;
        for (i = 0; i + W <= 2 * a.inter; i += W) store(k + i, narrow_bf16<W>(load<F>(g + i)));
        for (; i < 2 * a.inter; ++i) k[i] = narrow1(g[i]);
    }
}

// one element's backward (F a float or a vector): writes h, dg, du; returns h * q
template <class F, class I>
KTFT_INLINE F bwd_elem(F g, F u, F q, float w, float* h, float* dg, float* du) {
    const F sg = 1.0f / (exp_poly<F, I>(-g) + 1.0f);
    const F silu = g * sg;
    const F hv = silu * u;
    const F dh = q * w;
    const F dgv = dh * u * (sg * (g * (1.0f - sg) + 1.0f));
    const F duv = dh * silu;
    std::memcpy(h, &hv, sizeof hv);
    std::memcpy(dg, &dgv, sizeof dgv);
    std::memcpy(du, &duv, sizeof duv);
    return hv * q;
}

template <int W, class T>
KTFT_INLINE float bwd_row_t(const Bwd& a, const T* g, int64_t r) {
    using F = typename Vec<W>::f;
    using I = typename Vec<W>::i;
    const T* u = g + a.inter;
    const float* q = a.q + r * a.ldq;
    float* h = a.h + r * a.ldh;
    float* dg = a.dgu + r * a.lddgu;
    float* du = dg + a.inter;
    const float w = a.w[r];
    F acc{};
    int64_t i = 0;
    for (; i + W <= a.inter; i += W) {
        F gi, ui;
        if constexpr (sizeof(T) == 2) {
            gi = widen_bf16<W>(g + i);
            ui = widen_bf16<W>(u + i);
        } else {
            gi = load<F>(g + i);
            ui = load<F>(u + i);
        }
        acc += bwd_elem<F, I>(gi, ui, load<F>(q + i), w, h + i, dg + i, du + i);
    }
    float hq = 0.0f;
    for (int j = 0; j < W; ++j) hq += acc[j];
    for (; i < a.inter; ++i) {
        float gi, ui;
        if constexpr (sizeof(T) == 2) {
            gi = widen1(g[i]);
            ui = widen1(u[i]);
        } else {
            gi = g[i];
            ui = u[i];
        }
        hq += bwd_elem<float, int32_t>(gi, ui, q[i], w, h + i, dg + i, du + i);
    }
    return hq;
}

template <int W>
KTFT_INLINE void bwd_row(const Bwd& a, int64_t r) {
    a.grad_w[r] = a.gu_bf16 ? bwd_row_t<W>(a, static_cast<const uint16_t*>(a.gu) + r * a.ldgu, r)
                            : bwd_row_t<W>(a, static_cast<const float*>(a.gu) + r * a.ldgu, r);
}


// the row loops per path: the same source at each vector width
void fwd_base(const Fwd& a, int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) fwd_row<4>(a, r);
}
KTFT_T_AVX2 void fwd_avx2(const Fwd& a, int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) fwd_row<8>(a, r);
}
KTFT_T_AVX512 void fwd_avx512(const Fwd& a, int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) fwd_row<16>(a, r);
}
void bwd_base(const Bwd& a, int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) bwd_row<4>(a, r);
}
KTFT_T_AVX2 void bwd_avx2(const Bwd& a, int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) bwd_row<8>(a, r);
}
KTFT_T_AVX512 void bwd_avx512(const Bwd& a, int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) bwd_row<16>(a, r);
}

}  // namespace

extern "C" {

// h[r, :I] = silu(gu[r, :I]) * gu[r, I:2I] for r < rows (fp32, row strides ldgu, ldh); keep
// (null: none) gets gu[r, :2I] rounded to bf16 bits (row stride ldk). isa as ktft_gemm_bf16's
// (0: the best this CPU runs). Returns the path used, < 0 on error.
int ktft_silu_mul_fwd(int64_t rows, int64_t inter, const float* gu, int64_t ldgu, float* h, int64_t ldh,
                      uint16_t* keep, int64_t ldk, int threads, int isa) {
    const Fwd a{inter, gu, ldgu, h, ldh, keep, ldk};
    return ktft::run_rows(rows, ROWS_PER_ITEM, a, threads, isa, fwd_base, fwd_avx2, fwd_avx512);
}

// The backward described at the top: gu fp32 (gu_bf16 = 0) or bf16 bits (1) [rows, 2I], q fp32
// [rows, I], w fp32 [rows] -> h fp32 [rows, I], dgu fp32 [rows, 2I], grad_w fp32 [rows] (the
// row sums of h * q, summed in fp32). Returns the path used, < 0 on error.
int ktft_silu_mul_bwd(int64_t rows, int64_t inter, const void* gu, int gu_bf16, int64_t ldgu, const float* q,
                      int64_t ldq, const float* w, float* h, int64_t ldh, float* dgu, int64_t lddgu, float* grad_w,
                      int threads, int isa) {
    const Bwd a{inter, gu, gu_bf16, ldgu, q, ldq, w, h, ldh, dgu, lddgu, grad_w};
    return ktft::run_rows(rows, ROWS_PER_ITEM, a, threads, isa, bwd_base, bwd_avx2, bwd_avx512);
}

}  // extern "C"
