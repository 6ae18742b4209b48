// kt-ft's CPU GEMMs for frozen bf16 expert weights on CPUs without native bf16 arithmetic.
//
// The two products the CPU expert op spends its time in, for one expert's weight W [N, K]
// (bf16, row-major, row stride ldw) and fp32 activations:
//
//   NT (forward):  C[M, N] = beta * C + A[M, K] @ W[N, K]^T    (gate_up [2I, H], down [H, I])
//   NN (backward): C[M, K] = beta * C + A[M, N] @ W[N, K]      (grad through the frozen weight)
//
// Both are written as one generic product C[M, n] = A[M, k] @ B[k, n] where B is W read
// through two strides (B(k, n) = w[k * bk + n * bn]): NT has bk = 1, bn = ldw; NN bk = ldw,
// bn = 1. W is never copied whole: a KC x NC block of B is converted to fp32 (a bf16 is the
// high half of an fp32, so conversion is a 16-bit shift) into a per-thread packing buffer laid
// out as 16-column panels, which the register-tile micro-kernel streams from L1/L2.
//
// Paths (chosen at run time, one binary for every x86-64 CPU):
//   * AVX2 + FMA: 6x16 fp32 register tile (12 accumulators), function-level target attributes;
//   * scalar: plain loops for CPUs without AVX2 (and the tests' reference twin of the above);
//   * AVX-512: not written yet; ktft_best_isa() reports AVX2 there (hook: ISA_AVX512).
// Threads: the caller's count, plain std::threads per call taking (group, column chunk) work
// items from an atomic counter (no OpenMP: torch ships its own runtime, and two spinning
// OpenMP pools on the same cores slow each other down).

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define KTFT_X86 1
#endif

namespace {

typedef uint16_t bf16;

enum Isa { ISA_AUTO = 0, ISA_SCALAR = 1, ISA_AVX2 = 2, ISA_AVX512 = 3 };

constexpr int64_t KC = 256;  // k block: a 16-column panel is KC * 64 B = 16 KiB (L1)
constexpr int64_t NC = 128;  // columns of one work item: its packed block is 128 KiB (L2)
constexpr int MR = 6, NR = 16;

inline float bf16_to_f32(bf16 v) {
    uint32_t u = static_cast<uint32_t>(v) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
}

// One product: C[M, N] = beta * C + A[M, K] @ B[K, N], B(k, n) = b[k * bk + n * bn] (bf16).
struct Gemm {
    const float* a;
    int64_t lda;
    const bf16* b;
    int64_t bk, bn;
    float* c;
    int64_t ldc;
    int64_t M, N, K;
    float beta;
    int64_t zero_rows;  // rows M .. M + zero_rows of C are set to 0 (padding rows of the caller)
};

// ---------------------------------------------------------------- scalar path

// The plain twin of the AVX2 path: fp32 accumulation of exact bf16->fp32 products, k inner.
void gemm_scalar(const Gemm& g, int64_t n0, int64_t n1) {
    for (int64_t m = 0; m < g.M; ++m) {
        const float* a = g.a + m * g.lda;
        float* c = g.c + m * g.ldc;
        for (int64_t n = n0; n < n1; ++n) {
            const bf16* b = g.b + n * g.bn;
            float acc = 0.f;
            for (int64_t k = 0; k < g.K; ++k) acc += a[k] * bf16_to_f32(b[k * g.bk]);
            // beta == 0 must not read C: the caller's buffer may hold NaN garbage
            c[n] = g.beta == 0.f ? acc : g.beta * c[n] + acc;
        }
    }
}

// ---------------------------------------------------------------- AVX2 path
#ifdef KTFT_X86

#define AVX2 __attribute__((target("avx2,fma")))

// 8 bf16 -> 8 fp32 (zero-extend to 32 bits, shift into the high half)
AVX2 inline __m256 load8_bf16(const bf16* p) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

AVX2 inline void transpose8(__m256 r[8]) {
    __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    r[0] = _mm256_permute2f128_ps(s0, s4, 0x20);
    r[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
    r[2] = _mm256_permute2f128_ps(s2, s6, 0x20);
    r[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
    r[4] = _mm256_permute2f128_ps(s0, s4, 0x31);
    r[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
    r[6] = _mm256_permute2f128_ps(s2, s6, 0x31);
    r[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}

// Pack B[k0:k0+kc, n0:n0+nc] as fp32 panels: panel p holds columns n0+16p.. as [kc][16],
// columns past the matrix zero (their results are never stored).
AVX2 void pack_b_avx2(const Gemm& g, int64_t k0, int64_t kc, int64_t n0, int64_t nc, float* dst) {
    for (int64_t p = 0; p < nc; p += NR, dst += kc * NR) {
        const int64_t cols = std::min<int64_t>(NR, nc - p);
        const int64_t n = n0 + p;
        if (cols == NR && g.bn == 1) {  // NN: a panel row is 16 contiguous bf16
            const bf16* src = g.b + k0 * g.bk + n;
            for (int64_t k = 0; k < kc; ++k, src += g.bk) {
                _mm256_store_ps(dst + k * NR, load8_bf16(src));
                _mm256_store_ps(dst + k * NR + 8, load8_bf16(src + 8));
            }
        } else if (cols == NR && g.bk == 1) {  // NT: 16 rows of W, transposed 8x8 at a time
            const bf16* src = g.b + n * g.bn + k0;
            int64_t k = 0;
            for (; k + 8 <= kc; k += 8) {
                for (int half = 0; half < 2; ++half) {
                    __m256 r[8];
                    for (int i = 0; i < 8; ++i) r[i] = load8_bf16(src + (half * 8 + i) * g.bn + k);
                    transpose8(r);  // r[j] = column k+j of the 8 rows
                    for (int j = 0; j < 8; ++j) _mm256_store_ps(dst + (k + j) * NR + half * 8, r[j]);
                }
            }
            for (; k < kc; ++k)
                for (int j = 0; j < NR; ++j) dst[k * NR + j] = bf16_to_f32(src[j * g.bn + k]);
        } else {  // edge panel (or unusual strides): element by element, zero past the edge
            for (int64_t k = 0; k < kc; ++k)
                for (int j = 0; j < NR; ++j)
                    dst[k * NR + j] =
                        j < cols ? bf16_to_f32(g.b[(k0 + k) * g.bk + (n + j) * g.bn]) : 0.f;
        }
    }
}

// mode: 0 store, 1 add to C, 2 beta * C + acc (only the first k block uses beta)
template <int R>
AVX2 void kernel_avx2(int64_t kc, const float* a, int64_t lda, const float* bp, float* c, int64_t ldc,
                      int cols, int mode, float beta) {
    __m256 lo[R], hi[R];
    const float* ar[R];
#pragma GCC unroll 6
    for (int i = 0; i < R; ++i) {
        lo[i] = _mm256_setzero_ps();
        hi[i] = _mm256_setzero_ps();
        ar[i] = a + i * lda;
    }
    for (int64_t k = 0; k < kc; ++k, bp += NR) {
        const __m256 b0 = _mm256_load_ps(bp), b1 = _mm256_load_ps(bp + 8);
#pragma GCC unroll 6
        for (int i = 0; i < R; ++i) {
            const __m256 av = _mm256_broadcast_ss(ar[i] + k);
            lo[i] = _mm256_fmadd_ps(av, b0, lo[i]);
            hi[i] = _mm256_fmadd_ps(av, b1, hi[i]);
        }
    }
    if (cols == NR) {
        const __m256 vb = _mm256_set1_ps(beta);
#pragma GCC unroll 6
        for (int i = 0; i < R; ++i) {
            float* ci = c + i * ldc;
            __m256 x0 = lo[i], x1 = hi[i];
            if (mode == 1) {
                x0 = _mm256_add_ps(x0, _mm256_loadu_ps(ci));
                x1 = _mm256_add_ps(x1, _mm256_loadu_ps(ci + 8));
            } else if (mode == 2) {
                x0 = _mm256_fmadd_ps(vb, _mm256_loadu_ps(ci), x0);
                x1 = _mm256_fmadd_ps(vb, _mm256_loadu_ps(ci + 8), x1);
            }
            _mm256_storeu_ps(ci, x0);
            _mm256_storeu_ps(ci + 8, x1);
        }
        return;
    }
    alignas(32) float tmp[NR];
    // unrolled like the loops above: a run-time index would keep the accumulators in memory
#pragma GCC unroll 6
    for (int i = 0; i < R; ++i) {
        _mm256_store_ps(tmp, lo[i]);
        _mm256_store_ps(tmp + 8, hi[i]);
        float* ci = c + i * ldc;
        for (int j = 0; j < cols; ++j)
            ci[j] = mode == 0 ? tmp[j] : mode == 1 ? ci[j] + tmp[j] : beta * ci[j] + tmp[j];
    }
}

typedef void (*KernelFn)(int64_t, const float*, int64_t, const float*, float*, int64_t, int, int, float);
const KernelFn KERNELS_AVX2[MR + 1] = {nullptr,           kernel_avx2<1>, kernel_avx2<2>, kernel_avx2<3>,
                                       kernel_avx2<4>,    kernel_avx2<5>, kernel_avx2<6>};

// Columns [n0, n1) of one product, all rows; pack is KC * NC floats, 32-byte aligned.
AVX2 void gemm_avx2(const Gemm& g, int64_t n0, int64_t n1, float* pack) {
    for (int64_t k0 = 0; k0 < g.K || (k0 == 0 && g.K == 0); k0 += KC) {
        const int64_t kc = std::min(KC, g.K - k0);
        const int mode = k0 > 0 ? 1 : g.beta == 0.f ? 0 : g.beta == 1.f ? 1 : 2;
        pack_b_avx2(g, k0, kc, n0, n1 - n0, pack);
        // panel outer, rows inner: the 16 KiB panel stays in L1 while A's kc-block (L2) streams
        for (int64_t p = n0; p < n1; p += NR) {
            const float* bp = pack + (p - n0) * kc;
            const int cols = static_cast<int>(std::min<int64_t>(NR, n1 - p));
            for (int64_t m = 0; m < g.M; m += MR) {
                const int rows = static_cast<int>(std::min<int64_t>(MR, g.M - m));
                KERNELS_AVX2[rows](kc, g.a + m * g.lda + k0, g.lda, bp, g.c + m * g.ldc + p, g.ldc, cols,
                                   mode, g.beta);
            }
        }
        if (g.K == 0) break;
    }
}

#endif  // KTFT_X86

int best_isa() {
#ifdef KTFT_X86
    __builtin_cpu_init();
    // ISA_AVX512 would go here once written (avx512f: a 6x32 or 14x32 tile; avx512bf16: dpbf16ps)
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return ISA_AVX2;
#endif
    return ISA_SCALAR;
}

// ---------------------------------------------------------------- threads and work items

// Runs products in column chunks of NC on `threads` threads; returns the ISA used or < 0.
int run(const std::vector<Gemm>& gemms, int threads, int isa) {
    const int best = best_isa();
    if (isa == ISA_AUTO || isa > best) isa = isa == ISA_AUTO ? best : -1;
    if (isa < 0) return -2;  // asked for an ISA this CPU lacks
    std::vector<int64_t> first(gemms.size() + 1, 0);  // first work item of each product
    for (size_t i = 0; i < gemms.size(); ++i) {
        const int64_t chunks = gemms[i].M + gemms[i].zero_rows > 0 ? (gemms[i].N + NC - 1) / NC : 0;
        first[i + 1] = first[i] + chunks;
    }
    const int64_t items = first.back();
    if (items == 0) return isa;
    threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, items)));
    std::atomic<int64_t> next{0};
    auto worker = [&]() {
        float* pack = nullptr;
        if (isa != ISA_SCALAR) pack = static_cast<float*>(std::aligned_alloc(64, KC * NC * sizeof(float)));
        size_t g = 0;
        for (int64_t it; (it = next.fetch_add(1)) < items;) {
            while (first[g + 1] <= it) ++g;  // items are taken in increasing order per thread
            const Gemm& gm = gemms[g];
            const int64_t n0 = (it - first[g]) * NC, n1 = std::min(gm.N, n0 + NC);
            for (int64_t r = gm.M; r < gm.M + gm.zero_rows; ++r)
                std::memset(gm.c + r * gm.ldc + n0, 0, (n1 - n0) * sizeof(float));
            if (gm.M == 0) continue;
#ifdef KTFT_X86
            if (isa != ISA_SCALAR) {
                gemm_avx2(gm, n0, n1, pack);
                continue;
            }
#endif
            gemm_scalar(gm, n0, n1);
        }
        std::free(pack);
    };
    std::vector<std::thread> pool;
    for (int t = 1; t < threads; ++t) pool.emplace_back(worker);
    worker();
    for (auto& t : pool) t.join();
    return isa;
}

Gemm make(int trans_w, int64_t M, int64_t N, int64_t K, const float* a, int64_t lda, const bf16* w, int64_t ldw,
          float* c, int64_t ldc, float beta, int64_t zero_rows = 0) {
    // trans_w (NT): C[M, N] = A[M, K] @ W[N, K]^T;  else (NN): C[M, N] = A[M, K] @ W[K, N]
    return trans_w ? Gemm{a, lda, w, 1, ldw, c, ldc, M, N, K, beta, zero_rows}
                   : Gemm{a, lda, w, ldw, 1, c, ldc, M, N, K, beta, zero_rows};
}

}  // namespace

extern "C" {

// The best ISA this CPU runs: 1 scalar, 2 AVX2+FMA (3 AVX-512: reserved).
int ktft_best_isa(void) { return best_isa(); }

int ktft_abi_version(void) { return 1; }

// One product. trans_w = 1 (NT): C[M, N] = beta C + A[M, K] @ W[N, K]^T, W row stride ldw;
// trans_w = 0 (NN): C[M, N] = beta C + A[M, K] @ W[K, N]. All row-major with the given row
// strides; A, C fp32, W bf16 bits. isa 0 = best available. Returns the ISA used, < 0 on error.
int ktft_gemm_bf16(int trans_w, int64_t M, int64_t N, int64_t K, const float* a, int64_t lda, const uint16_t* w,
                   int64_t ldw, float* c, int64_t ldc, float beta, int threads, int isa) {
    return run({make(trans_w, M, N, K, a, lda, w, ldw, c, ldc, beta)}, threads, isa);
}

// Several experts' products in one call (one thread team, work balanced across them): product
// i uses rows row0[i] .. row0[i] + rows[i] of A and C and expert expert[i]'s weight at
// w + expert[i] * w_stride (elements); then pad[i] rows of C (past its rows) are zeroed (pad may
// be null: none). Shapes as in ktft_gemm_bf16.
int ktft_grouped_gemm_bf16(int trans_w, int64_t groups, const int64_t* expert, const int64_t* row0,
                           const int64_t* rows, const int64_t* pad, int64_t N, int64_t K, const float* a, int64_t lda,
                           const uint16_t* w, int64_t w_stride, int64_t ldw, float* c, int64_t ldc, float beta,
                           int threads, int isa) {
    std::vector<Gemm> gemms;
    gemms.reserve(groups);
    for (int64_t i = 0; i < groups; ++i)
        gemms.push_back(make(trans_w, rows[i], N, K, a + row0[i] * lda, lda, w + expert[i] * w_stride, ldw,
                             c + row0[i] * ldc, ldc, beta, pad ? pad[i] : 0));
    return run(gemms, threads, isa);
}

}  // extern "C"
