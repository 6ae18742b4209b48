// kt-ft's CPU GEMMs for frozen bf16 expert weights, from plain C++ to AMX-BF16.
//
// The two products the CPU expert op spends its time in, for one expert's weight W [N, K]
// (bf16, row-major, row stride ldw) and fp32 activations:
//
//   NT (forward):  C[M, N] = beta * C + A[M, K] @ W[N, K]^T    (gate_up [2I, H], down [H, I])
//   NN (backward): C[M, K] = beta * C + A[M, N] @ W[N, K]      (grad through the frozen weight)
//
// Both are written as one generic product C[M, n] = A[M, k] @ B[k, n] where B is W read
// through two strides (B(k, n) = w[k * bk + n * bn]): NT has bk = 1, bn = ldw; NN bk = ldw,
// bn = 1. W is never copied whole: at most a block of it is repacked per thread (or, AMX NT,
// none: tiles are loaded from W itself).
//
// Paths (one binary for every x86-64 CPU: ISA-specific functions carry gcc target attributes,
// the best one is chosen at run time from CPUID and XGETBV, and a forced one the CPU or its OS
// lacks is refused):
//   * scalar: plain loops for CPUs without AVX2 (and the tests' exact-fp32 twin);
//   * AVX2 + FMA: 6x16 fp32 register tile; a KC x NC block of B is widened to fp32 (a bf16 is the
//     high half of an fp32: a 16-bit shift) into 16-column panels streamed from L1/L2;
//   * AVX-512F: the same packing, a 12x32 fp32 tile (24 zmm accumulators, masked edges);
//   * AVX512-BF16: A is rounded to bf16 (round to nearest even) once per call; NN packs B as bf16
//     pairs (VNNI: [k/2][16 columns][2]), vdpbf16ps into a 12x32 fp32 tile; NT computes C^T with
//     W's k pairs broadcast from the expert's rows in place and A packed as pairs (the AMX
//     layout), 12 rows of W x 32 rows of A a tile, transposed into C (no packing of W);
//   * AMX-BF16: A rounded to bf16 as above, 16x32 bf16 tiles, tdpbf16ps into 2x2 fp32 16x16
//     accumulator tiles over the whole K. NT swaps the operands, C^T = W @ A^T, so the W tiles are
//     loaded from the expert's weight in place (only edge tiles are copied) and A is packed as
//     the pair-interleaved operand; NN packs a 64-column strip of W as bf16 pairs.
// The bf16 paths differ from the fp32 ones only by A's rounding to bf16 (relative 2^-8 per
// element): bf16 x bf16 products are exact in fp32 and are summed in fp32.
// Weights kept quantized (FP8, INT8, INT4, MXFP4: kernels/quant_decode.h) take the same paths:
// the fp32 ones decode the codes into their packed panels, the scalar and bf16 ones decode a work
// item's rows or columns into a bf16 slab first; either way the bits of the bf16 GEMM over the
// dequantized weight (ktft_grouped_gemm_quant).
// Threads: the caller's count, plain std::threads per call taking work items from an atomic
// counter (no OpenMP: torch ships its own runtime, and two spinning OpenMP pools on the same
// cores slow each other down). The bf16 paths first round A (one pass, same team), then compute.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#include "quant_decode.h"
#include "team.h"

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define KTFT_X86 1
#endif

namespace {

typedef uint16_t bf16;

// ordered: each path's CPU requirements include the previous one's (ISA <= best runs)
enum Isa { ISA_AUTO = 0, ISA_SCALAR = 1, ISA_AVX2 = 2, ISA_AVX512 = 3, ISA_AVX512BF16 = 4, ISA_AMX = 5 };

constexpr int64_t KC = 256;       // fp32 paths' k block: a 16-column panel is KC * 64 B = 16 KiB (L1)
constexpr int64_t KC_BF16 = 512;  // vdpbf16ps k block: a 16-column panel of pairs is 16 KiB too
constexpr int64_t NC = 128;       // columns of one work item: its fp32 packed block is 128 KiB (L2)
constexpr int64_t NC_AMX_NN = 512;  // AMX NN: 1 KiB of each W row a work item (long DRAM bursts)
constexpr int64_t KC_AMX_NN = 256;  // x 256 rows: a 256 KiB block of pairs (L2)
constexpr int64_t MC_AMX = 128;     // AMX NN rows of A a pass over the block (64 KiB of A: L1/L2)
constexpr int MR = 6, NR = 16;    // AVX2 tile
constexpr int MR512 = 12;         // AVX-512 tiles: 12 rows x 2 panels = 24 of the 32 zmm registers
constexpr int64_t TILE_K = 32;    // bf16 elements in an AMX tile row (64 bytes)

inline int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

using ktft::bf16_to_f32;

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
    int64_t zero_rows;          // rows M .. M + zero_rows of C are set to 0 (padding rows of the caller)
    const bf16* ap = nullptr;   // A rounded to bf16 (bf16 paths), in the layout of that path
    // W kept quantized (b unused): each work item decodes the part of expert `expert`'s weight it
    // reads into its thread's slab first (run())
    const ktft::QuantW* q = nullptr;
    int64_t expert = 0;
};

inline bool is_nt(const Gemm& g) { return g.bk == 1; }

// store mode of a result block: 0 store, 1 add to C, 2 beta * C + acc
inline int first_mode(float beta) { return beta == 0.f ? 0 : beta == 1.f ? 1 : 2; }

// ---------------------------------------------------------------- scalar path

// The plain twin of the fp32 paths: fp32 accumulation of exact bf16->fp32 products, k inner.
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

#ifdef KTFT_X86

// ---------------------------------------------------------------- CPU detection

uint64_t xgetbv0() {
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return (static_cast<uint64_t>(hi) << 32) | lo;
}

// Linux refuses AMX tile data to a process that did not ask (kernel >= 5.16; older ones lack
// the request and cannot run AMX at all): asked once, process-wide.
bool request_amx_permission() {
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

// The best path both the CPU (CPUID) and the OS (XCR0: the register state it saves) support.
int detect_isa() {
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return ISA_SCALAR;
    const bool fma = c & (1u << 12), osxsave = c & (1u << 27), avx = c & (1u << 28);
    if (!osxsave || !avx) return ISA_SCALAR;
    const uint64_t xcr0 = xgetbv0();
    if ((xcr0 & 0x6) != 0x6) return ISA_SCALAR;  // SSE and AVX state
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return ISA_SCALAR;
    const unsigned subleaves = a;
    const bool avx2 = b & (1u << 5), avx512f = b & (1u << 16), avx512bw = b & (1u << 30);
    const bool avx512vl = b & (1u << 31), amx_bf16 = d & (1u << 22), amx_tile = d & (1u << 24);
    unsigned a1 = 0, b1, c1, d1;
    if (subleaves >= 1) __get_cpuid_count(7, 1, &a1, &b1, &c1, &d1);
    const bool avx512bf16 = a1 & (1u << 5);
    if (!avx2 || !fma) return ISA_SCALAR;
    if (!avx512f || (xcr0 & 0xE0) != 0xE0) return ISA_AVX2;  // opmask, ZMM_Hi256, Hi16_ZMM state
    if (!avx512bf16 || !avx512bw || !avx512vl) return ISA_AVX512;
    if (!amx_tile || !amx_bf16 || (xcr0 & 0x60000) != 0x60000) return ISA_AVX512BF16;  // XTILECFG/DATA
    return request_amx_permission() ? ISA_AMX : ISA_AVX512BF16;
}

#else
int detect_isa() { return ISA_SCALAR; }
#endif

std::atomic<int> isa_cap{ISA_AMX};  // ktft_limit_isa: the tests' stand-in for an older CPU

int best_isa() {
    static const int detected = detect_isa();
    return std::min(detected, isa_cap.load());
}

#ifdef KTFT_X86

// ---------------------------------------------------------------- AVX2 path

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
// columns past the matrix zero (their results are never stored). Used by the AVX-512F path too.
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

// pack_b_avx2 for a weight kept quantized (g.q): the codes decoded straight into the fp32 panels,
// each value rounded to bf16 as the dequantizers round it (so the products are those of the bf16
// GEMM over the dequantized weight, bit for bit). NT: a panel's 16 W rows (kc inputs each) decoded
// into `tmp` [16][KC] (L1), then transposed 8 x 8 into the panel; NN: the kc W rows' nc columns
// decoded into the panels in place. Columns past the matrix are zero.
AVX2 void pack_b_quant(const Gemm& g, int64_t k0, int64_t kc, int64_t n0, int64_t nc, float* dst, float* tmp) {
    const bool vec = __builtin_cpu_supports("f16c");
    if (is_nt(g)) {
        for (int64_t p = 0; p < nc; p += NR, dst += kc * NR) {
            const int64_t cols = std::min<int64_t>(NR, nc - p);
            ktft::decode_rows(*g.q, g.expert, n0 + p, n0 + p + cols, k0, k0 + kc, tmp, KC, vec);
            for (int64_t i = cols; i < NR; ++i) std::fill(tmp + i * KC, tmp + i * KC + kc, 0.f);
            int64_t k = 0;
            for (; k + 8 <= kc; k += 8)
                for (int half = 0; half < 2; ++half) {
                    __m256 r[8];
                    for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(tmp + (half * 8 + i) * KC + k);
                    transpose8(r);
                    for (int j = 0; j < 8; ++j) _mm256_store_ps(dst + (k + j) * NR + half * 8, r[j]);
                }
            for (; k < kc; ++k)
                for (int j = 0; j < NR; ++j) dst[k * NR + j] = tmp[j * KC + k];
        }
        return;
    }
    ktft::decode_rows_panels(*g.q, g.expert, k0, k0 + kc, n0, n0 + nc, dst, kc * NR, vec);
    const int64_t tail = nc % NR;  // the last panel's columns past nc
    if (tail) {
        float* last = dst + (nc / NR) * kc * NR;
        for (int64_t k = 0; k < kc; ++k) std::fill(last + k * NR + tail, last + (k + 1) * NR, 0.f);
    }
}

// the fp32 paths' packing: bf16 weights widened, or quantized ones decoded
AVX2 inline void pack_b_f32(const Gemm& g, int64_t k0, int64_t kc, int64_t n0, int64_t nc, float* dst, float* tmp) {
    if (g.q)
        pack_b_quant(g, k0, kc, n0, nc, dst, tmp);
    else
        pack_b_avx2(g, k0, kc, n0, nc, dst);
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

// Columns [n0, n1) of one product, all rows; pack is KC * NC floats, 64-byte aligned.
AVX2 void gemm_avx2(const Gemm& g, int64_t n0, int64_t n1, void* pack_mem) {
    float* pack = static_cast<float*>(pack_mem);
    alignas(64) float tmp[NR * KC];  // quantized W: decoded rows (NC <= NR * KC columns for NN)
    for (int64_t k0 = 0; k0 < g.K || (k0 == 0 && g.K == 0); k0 += KC) {
        const int64_t kc = std::min(KC, g.K - k0);
        const int mode = k0 > 0 ? 1 : first_mode(g.beta);
        pack_b_f32(g, k0, kc, n0, n1 - n0, pack, tmp);
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

// ---------------------------------------------------------------- AVX-512 helpers

#define AVX512 __attribute__((target("avx2,fma,avx512f")))
#define AVX512BF16 __attribute__((target("avx2,fma,avx512f,avx512bw,avx512vl,avx512bf16")))
#define AMX __attribute__((target("avx2,fma,avx512f,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16")))

// the lanes of 16 columns starting at column j of a block `cols` wide (masked edges)
inline __mmask16 lanes(int cols, int j) {
    const int n = std::max(0, std::min(16, cols - j));
    return static_cast<__mmask16>(n == 16 ? 0xFFFF : (1u << n) - 1);
}

// C[0:16 lanes of m] = x (mode 0), C + x (1), beta * C + x (2); masked-off lanes untouched/unread
AVX512 inline void store16(float* c, __m512 x, __mmask16 m, int mode, float beta) {
    if (mode == 1)
        x = _mm512_add_ps(x, _mm512_maskz_loadu_ps(m, c));
    else if (mode == 2)
        x = _mm512_fmadd_ps(_mm512_set1_ps(beta), _mm512_maskz_loadu_ps(m, c), x);
    _mm512_mask_storeu_ps(c, m, x);
}

// r[j] = column j of the 16 rows r[0..15] (32-bit elements): 32-bit, 64-bit, then 128-bit lanes
AVX512 inline void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    __m512i u[16];  // u[4i + c], lane L: rows 4i..4i+3 of column 4L + c
    for (int i = 0; i < 16; i += 4) {
        u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int c = 0; c < 4; ++c) {
        const __m512i v0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x88);  // lanes 0, 2 of rows 0-7
        const __m512i v1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xDD);  // lanes 1, 3
        const __m512i w0 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x88);
        const __m512i w1 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xDD);
        r[c] = _mm512_shuffle_i32x4(v0, w0, 0x88);       // lane 0: column c
        r[4 + c] = _mm512_shuffle_i32x4(v1, w1, 0x88);   // lane 1: column 4 + c
        r[8 + c] = _mm512_shuffle_i32x4(v0, w0, 0xDD);   // lane 2
        r[12 + c] = _mm512_shuffle_i32x4(v1, w1, 0xDD);  // lane 3
    }
}

// ---------------------------------------------------------------- AVX-512F fp32 path

// R rows x NP 16-column panels (fp32, [kc][16] each, panel_stride floats apart) of C
template <int R, int NP>
AVX512 void kernel_avx512(int64_t kc, const float* a, int64_t lda, const float* bp, int64_t panel_stride,
                          float* c, int64_t ldc, int cols, int mode, float beta) {
    __m512 acc[R][NP];
#pragma GCC unroll 12
    for (int i = 0; i < R; ++i)
        for (int j = 0; j < NP; ++j) acc[i][j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < kc; ++k) {
        __m512 b[NP];
        for (int j = 0; j < NP; ++j) b[j] = _mm512_load_ps(bp + j * panel_stride + k * NR);
#pragma GCC unroll 12
        for (int i = 0; i < R; ++i) {
            const __m512 av = _mm512_set1_ps(a[i * lda + k]);
            for (int j = 0; j < NP; ++j) acc[i][j] = _mm512_fmadd_ps(av, b[j], acc[i][j]);
        }
    }
#pragma GCC unroll 12
    for (int i = 0; i < R; ++i)
        for (int j = 0; j < NP; ++j) store16(c + i * ldc + 16 * j, acc[i][j], lanes(cols, 16 * j), mode, beta);
}

typedef void (*Kernel512Fn)(int64_t, const float*, int64_t, const float*, int64_t, float*, int64_t, int, int,
                            float);
template <int NP>
constexpr Kernel512Fn KERNELS_AVX512[MR512 + 1] = {
    nullptr,                 kernel_avx512<1, NP>,  kernel_avx512<2, NP>,  kernel_avx512<3, NP>,
    kernel_avx512<4, NP>,    kernel_avx512<5, NP>,  kernel_avx512<6, NP>,  kernel_avx512<7, NP>,
    kernel_avx512<8, NP>,    kernel_avx512<9, NP>,  kernel_avx512<10, NP>, kernel_avx512<11, NP>,
    kernel_avx512<12, NP>};

// Columns [n0, n1) of one product, all rows; the AVX2 path's packing (fp32 16-column panels),
// two panels a micro-kernel call.
AVX512 void gemm_avx512(const Gemm& g, int64_t n0, int64_t n1, void* pack_mem) {
    float* pack = static_cast<float*>(pack_mem);
    alignas(64) float tmp[NR * KC];  // quantized W: decoded rows (NC <= NR * KC columns for NN)
    for (int64_t k0 = 0; k0 < g.K || (k0 == 0 && g.K == 0); k0 += KC) {
        const int64_t kc = std::min(KC, g.K - k0);
        const int mode = k0 > 0 ? 1 : first_mode(g.beta);
        pack_b_f32(g, k0, kc, n0, n1 - n0, pack, tmp);
        for (int64_t p = n0; p < n1; p += 2 * NR) {
            const float* bp = pack + (p - n0) * kc;
            const int cols = static_cast<int>(std::min<int64_t>(2 * NR, n1 - p));
            for (int64_t m = 0; m < g.M; m += MR512) {
                const int rows = static_cast<int>(std::min<int64_t>(MR512, g.M - m));
                const Kernel512Fn fn = cols > NR ? KERNELS_AVX512<2>[rows] : KERNELS_AVX512<1>[rows];
                fn(kc, g.a + m * g.lda + k0, g.lda, bp, kc * NR, g.c + m * g.ldc + p, g.ldc, cols, mode, g.beta);
            }
        }
        if (g.K == 0) break;
    }
}

// ---------------------------------------------------------------- A rounded to bf16 (bf16 paths)

// Row-major A of the bf16 paths: [round_up(M, 16)][round_up(K, 32)], zero past M and K, so AMX
// can load 16 x 32 tiles of it and vdpbf16ps can read any k pair.
inline int64_t a_rows_ld(int64_t K) { return round_up(K, TILE_K); }

// dst[0:kp] = A row rounded to bf16 (to nearest even), zero past k
AVX512BF16 void round_row(const float* a, int64_t K, int64_t kp, bf16* dst) {
    int64_t k = 0;
    for (; k < K; k += 16) {
        const __mmask16 m = lanes(static_cast<int>(std::min<int64_t>(16, K - k)), 0);
        const __m256bh h = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, a + k));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + k), reinterpret_cast<const __m256i&>(h));
    }
    for (k = round_up(K, 16); k < kp; ++k) dst[k] = 0;
    // masked-off lanes above were stored as 0 already (bf16 of +0.0)
}

// rows [r0, r1) of the row-major layout
AVX512BF16 void pack_a_rows(const Gemm& g, int64_t r0, int64_t r1, bf16* dst) {
    const int64_t ld = a_rows_ld(g.K);
    for (int64_t m = r0; m < r1; ++m) {
        if (m < g.M)
            round_row(g.a + m * g.lda, g.K, ld, dst + m * ld);
        else
            std::memset(dst + m * ld, 0, ld * sizeof(bf16));
    }
}

// AMX NT's A (the second tdpbf16ps operand, C^T = W @ A^T): for 16 rows of A (one m tile) and
// 32 k (one step), a 1 KiB tile [16 k pairs][16 rows][2]; tiles ordered (m tile, step).
// Rows [r0, r1) (multiples of 16) of A. Sixteen rows are rounded at a time, then each step's
// [16 rows][16 pairs] block is transposed in registers and stored as whole cache lines (one
// 4-byte store per pair, 64 bytes apart, was 6-7% of a 128- or 192-row product at K = 2,048).
AVX512BF16 void pack_a_pairs(const Gemm& g, int64_t r0, int64_t r1, bf16* dst) {
    const int64_t ld = a_rows_ld(g.K), steps = ld / TILE_K, pairs = ld / 2;
    std::vector<uint32_t> rows(16 * pairs);  // 16 rows rounded to bf16, read as k pairs
    uint32_t* out = reinterpret_cast<uint32_t*>(dst);
    for (int64_t m0 = r0; m0 < r1; m0 += 16) {
        for (int i = 0; i < 16; ++i) {
            uint32_t* row = rows.data() + i * pairs;
            if (m0 + i < g.M)
                round_row(g.a + (m0 + i) * g.lda, g.K, ld, reinterpret_cast<bf16*>(row));
            else
                std::fill(row, row + pairs, 0u);
        }
        uint32_t* tiles = out + (m0 / 16) * steps * 256;
        for (int64_t s = 0; s < steps; ++s) {
            __m512i r[16];
            for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(rows.data() + i * pairs + s * 16);
            transpose16(r);  // r[p] = pair p of the 16 rows
            for (int p = 0; p < 16; ++p) _mm512_storeu_si512(tiles + s * 256 + p * 16, r[p]);
        }
    }
}

// ---------------------------------------------------------------- B as bf16 pairs (VNNI)

// NN's pairs: rows k and k+1 of W side by side, 16 columns at a time. Row pair outer, panels
// inner: each W row is read front to back (the hardware prefetchers follow that; a column
// panel at a time would jump a row stride every 32 bytes). Full panels only.
AVX512BF16 void pack_pairs_nn(const Gemm& g, int64_t k0, int64_t pairs, int64_t n0, int64_t panels, bf16* dst,
                              int64_t panel_stride) {
    const int64_t full = std::max<int64_t>(0, std::min(pairs, (g.K - k0) / 2));  // both rows inside W
    for (int64_t q = 0; q < full; ++q) {
        const bf16* r = g.b + (k0 + 2 * q) * g.bk + n0;
        for (int64_t p = 0; p < panels; ++p) {
            const __m512i lo =
                _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + 16 * p)));
            const __m512i hi =
                _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + g.bk + 16 * p)));
            _mm512_storeu_si512(dst + p * panel_stride + q * 32, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
        }
    }
}

// NT's pairs: a k pair is one 32-bit word of a W row, so 16 rows x 16 pairs transpose into 16
// pair rows of the panel. Pairs [0, return value) of the panel at column n are done.
AVX512BF16 int64_t pack_pairs_nt(const Gemm& g, int64_t k0, int64_t pairs, int64_t n, bf16* dst) {
    int64_t q = 0;
    for (; q + 16 <= pairs && k0 + 2 * (q + 16) <= g.K; q += 16) {
        __m512i r[16];
        for (int j = 0; j < 16; ++j) r[j] = _mm512_loadu_si512(g.b + (n + j) * g.bn + k0 + 2 * q);
        transpose16(r);  // r[i] = pair q + i of the 16 columns
        for (int i = 0; i < 16; ++i) _mm512_storeu_si512(dst + (q + i) * 32, r[i]);
    }
    return q;
}

// Pack B[k0:k0+2*pairs, n0:n0+nc] as panels of 16 columns, each [pairs][16][2] (the pair
// (k, k+1) of a column side by side: vdpbf16ps / tdpbf16ps's second operand); zero past K and
// past the columns. k0 is even.
AVX512BF16 void pack_b_pairs(const Gemm& g, int64_t k0, int64_t pairs, int64_t n0, int64_t nc, bf16* dst) {
    const int64_t k_end = std::min(g.K, k0 + 2 * pairs), full_panels = nc / 16, stride = pairs * 32;
    int64_t nn_done = 0;  // pair rows of the full panels the NN fast loop did
    if (g.bn == 1) {
        pack_pairs_nn(g, k0, pairs, n0, full_panels, dst, stride);
        nn_done = std::max<int64_t>(0, std::min(pairs, (g.K - k0) / 2));
    }
    for (int64_t p = 0; p < nc; p += 16) {
        bf16* panel = dst + p / 16 * stride;
        const int64_t cols = std::min<int64_t>(16, nc - p), n = n0 + p;
        int64_t q = 0;  // pair rows done by a fast loop
        if (cols == 16) q = g.bn == 1 ? nn_done : g.bk == 1 ? pack_pairs_nt(g, k0, pairs, n, panel) : 0;
        for (; q < pairs; ++q)  // edges: element by element, zero past the matrix
            for (int j = 0; j < 16; ++j)
                for (int h = 0; h < 2; ++h) {
                    const int64_t k = k0 + 2 * q + h;
                    panel[q * 32 + j * 2 + h] = j < cols && k < k_end ? g.b[k * g.bk + (n + j) * g.bn] : 0;
                }
    }
}

// ---------------------------------------------------------------- AVX512-BF16 path

inline uint32_t load_pair(const bf16* p) {
    uint32_t v;
    std::memcpy(&v, p, sizeof v);
    return v;
}

// R rows of A (bf16, row stride lda) x NP panels of bf16 pairs: C += A @ B over `pairs` k pairs
template <int R, int NP>
AVX512BF16 void kernel_bf16(int64_t pairs, const bf16* a, int64_t lda, const bf16* bp, int64_t panel_stride,
                            float* c, int64_t ldc, int cols, int mode, float beta) {
    __m512 acc[R][NP];
#pragma GCC unroll 12
    for (int i = 0; i < R; ++i)
        for (int j = 0; j < NP; ++j) acc[i][j] = _mm512_setzero_ps();
    for (int64_t q = 0; q < pairs; ++q) {
        __m512bh b[NP];
        for (int j = 0; j < NP; ++j) b[j] = (__m512bh)_mm512_loadu_si512(bp + j * panel_stride + q * 32);
#pragma GCC unroll 12
        for (int i = 0; i < R; ++i) {
            const __m512bh av = (__m512bh)_mm512_set1_epi32(static_cast<int>(load_pair(a + i * lda + 2 * q)));
            for (int j = 0; j < NP; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], av, b[j]);
        }
    }
#pragma GCC unroll 12
    for (int i = 0; i < R; ++i)
        for (int j = 0; j < NP; ++j) store16(c + i * ldc + 16 * j, acc[i][j], lanes(cols, 16 * j), mode, beta);
}

typedef void (*KernelBf16Fn)(int64_t, const bf16*, int64_t, const bf16*, int64_t, float*, int64_t, int, int,
                             float);
template <int NP>
constexpr KernelBf16Fn KERNELS_BF16[MR512 + 1] = {
    nullptr,              kernel_bf16<1, NP>,  kernel_bf16<2, NP>,  kernel_bf16<3, NP>,
    kernel_bf16<4, NP>,   kernel_bf16<5, NP>,  kernel_bf16<6, NP>,  kernel_bf16<7, NP>,
    kernel_bf16<8, NP>,   kernel_bf16<9, NP>,  kernel_bf16<10, NP>, kernel_bf16<11, NP>,
    kernel_bf16<12, NP>};

// NT with W read in place: C^T[n, m] = sum_k W[n, k] A[m, k] over R rows of W (their k pairs
// broadcast straight from the expert's memory) and MB blocks of 16 rows of A (packed as pairs,
// pack_a_pairs' layout: for each pair q, 16 rows' pairs in one vector). No packing of W at all;
// the [R, 16 MB] result is transposed through a small buffer into C's rows.
template <int R, int MB>
AVX512BF16 void kernel_bf16_nt(const Gemm& g, int64_t n, int64_t m, const uint32_t* ap, int64_t block_stride,
                               int mode) {
    const int64_t full = g.K / 2;  // whole pairs inside W's rows (an odd K's last k: below)
    __m512 acc[R][MB];
#pragma GCC unroll 12
    for (int i = 0; i < R; ++i)
        for (int j = 0; j < MB; ++j) acc[i][j] = _mm512_setzero_ps();
    const bf16* w = g.b + n * g.bn;
    for (int64_t q = 0; q < full; ++q) {
        __m512bh a[MB];
        for (int j = 0; j < MB; ++j) a[j] = (__m512bh)_mm512_loadu_si512(ap + j * block_stride + q * 16);
#pragma GCC unroll 12
        for (int i = 0; i < R; ++i) {
            const __m512bh wv = (__m512bh)_mm512_set1_epi32(static_cast<int>(load_pair(w + i * g.bn + 2 * q)));
            for (int j = 0; j < MB; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], wv, a[j]);
        }
    }
    if (g.K % 2) {  // the last k alone: W's pair read as (W[n, K-1], 0), never past the row
        __m512bh a[MB];
        for (int j = 0; j < MB; ++j) a[j] = (__m512bh)_mm512_loadu_si512(ap + j * block_stride + full * 16);
        for (int i = 0; i < R; ++i) {
            const __m512bh wv = (__m512bh)_mm512_set1_epi32(static_cast<int>(w[i * g.bn + g.K - 1]));
            for (int j = 0; j < MB; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], wv, a[j]);
        }
    }
    alignas(64) float t[R][16 * MB];
    for (int i = 0; i < R; ++i)
        for (int j = 0; j < MB; ++j) _mm512_store_ps(&t[i][16 * j], acc[i][j]);
    const int64_t rows = std::min<int64_t>(16 * MB, g.M - m);
    for (int64_t r = 0; r < rows; ++r) {
        float* c = g.c + (m + r) * g.ldc + n;
        for (int i = 0; i < R; ++i) {
            const float v = t[i][r];
            c[i] = mode == 0 ? v : mode == 1 ? c[i] + v : g.beta * c[i] + v;
        }
    }
}

typedef void (*KernelBf16NtFn)(const Gemm&, int64_t, int64_t, const uint32_t*, int64_t, int);
template <int MB>
constexpr KernelBf16NtFn KERNELS_BF16_NT[MR512 + 1] = {
    nullptr,                  kernel_bf16_nt<1, MB>,  kernel_bf16_nt<2, MB>,  kernel_bf16_nt<3, MB>,
    kernel_bf16_nt<4, MB>,    kernel_bf16_nt<5, MB>,  kernel_bf16_nt<6, MB>,  kernel_bf16_nt<7, MB>,
    kernel_bf16_nt<8, MB>,    kernel_bf16_nt<9, MB>,  kernel_bf16_nt<10, MB>, kernel_bf16_nt<11, MB>,
    kernel_bf16_nt<12, MB>};

// NT columns [n0, n1), all rows: g.ap is A packed as pairs (pack_a_pairs); W strips of MR512 rows,
// each over every 32-row block of A (the strip, MR512 x K bf16, stays in L2 meanwhile).
AVX512BF16 void gemm_avx512bf16_nt(const Gemm& g, int64_t n0, int64_t n1) {
    const int64_t m_pad = round_up(g.M, 16), block_stride = a_rows_ld(g.K) / 2 * 16;  // uint32s a 16-row block
    const uint32_t* ap = reinterpret_cast<const uint32_t*>(g.ap);
    const int mode = first_mode(g.beta);
    for (int64_t n = n0; n < n1; n += MR512) {
        const int r = static_cast<int>(std::min<int64_t>(MR512, n1 - n));
        for (int64_t m = 0; m < m_pad; m += 32) {
            const bool two = m_pad - m > 16;
            (two ? KERNELS_BF16_NT<2> : KERNELS_BF16_NT<1>)[r](g, n, m, ap + m / 16 * block_stride, block_stride,
                                                            mode);
        }
    }
}

// Columns [n0, n1), all rows; g.ap is A in the row-major bf16 layout; pack holds KC_BF16 / 2
// pairs x NC columns.
AVX512BF16 void gemm_avx512bf16(const Gemm& g, int64_t n0, int64_t n1, void* pack_mem) {
    bf16* pack = static_cast<bf16*>(pack_mem);
    const int64_t lda = a_rows_ld(g.K);
    for (int64_t k0 = 0; k0 < g.K || (k0 == 0 && g.K == 0); k0 += KC_BF16) {
        const int64_t pairs = (std::min(KC_BF16, g.K - k0) + 1) / 2;
        const int mode = k0 > 0 ? 1 : first_mode(g.beta);
        pack_b_pairs(g, k0, pairs, n0, n1 - n0, pack);
        for (int64_t p = n0; p < n1; p += 2 * NR) {
            const bf16* bp = pack + (p - n0) * pairs * 2;
            const int cols = static_cast<int>(std::min<int64_t>(2 * NR, n1 - p));
            for (int64_t m = 0; m < g.M; m += MR512) {
                const int rows = static_cast<int>(std::min<int64_t>(MR512, g.M - m));
                const KernelBf16Fn fn = cols > NR ? KERNELS_BF16<2>[rows] : KERNELS_BF16<1>[rows];
                fn(pairs, g.ap + m * lda + k0, lda, bp, pairs * 32, g.c + m * g.ldc + p, g.ldc, cols, mode,
                   g.beta);
            }
        }
        if (g.K == 0) break;
    }
}

// ---------------------------------------------------------------- AMX-BF16 path

// gcc's tile intrinsics are asm statements that do not tell the compiler they touch memory;
// these do ("memory"), so a buffer written by C++ before a tile load is really written.
#define TILE_LOAD(t, base, stride) \
    __asm__ volatile("tileloadd (%0,%1,1), %%tmm" #t ::"r"(base), "r"(static_cast<long>(stride)) : "memory")
#define TILE_STORE(t, base, stride) \
    __asm__ volatile("tilestored %%tmm" #t ", (%0,%1,1)" ::"r"(base), "r"(static_cast<long>(stride)) : "memory")
#define TILE_ZERO(t) __asm__ volatile("tilezero %%tmm" #t ::)
#define TILE_DP(c, a, b) __asm__ volatile("tdpbf16ps %%tmm" #b ", %%tmm" #a ", %%tmm" #c ::)

// palette 1, all 8 tiles 16 rows x 64 bytes (16 x 32 bf16 operands, 16 x 16 fp32 accumulators)
struct alignas(64) TileConfig {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
};

void amx_configure() {  // per thread: the configuration is thread state
    TileConfig cfg;
    for (int t = 0; t < 8; ++t) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = 16;
    }
    __asm__ volatile("ldtilecfg %0" ::"m"(cfg));
}

void amx_release() { __asm__ volatile("tilerelease" ::); }

// a 16 x 16 fp32 result tile (buf, row stride 16) into C's rows x cols corner at c; transposed
// when the tile holds C^T (AMX NT)
AMX void store_tile(const float* buf, bool transposed, float* c, int64_t ldc, int rows, int cols, int mode,
                    float beta) {
    __m512i r[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_load_si512(buf + 16 * i);
    if (transposed) transpose16(r);
    const __mmask16 m = lanes(cols, 0);
    for (int i = 0; i < rows; ++i) store16(c + i * ldc, _mm512_castsi512_ps(r[i]), m, mode, beta);
}

// A W tile (16 rows x 32 k from row n, step s) for AMX NT: in place when whole, else copied
// into buf with zeros past the matrix (a tile load must not read past W's rows or rows' ends)
AMX inline const bf16* w_tile(const Gemm& g, int64_t n, int64_t n1, int64_t s, bf16* buf, int64_t& stride) {
    const int64_t k = s * TILE_K, rows = std::min<int64_t>(16, n1 - n), ks = std::min(TILE_K, g.K - k);
    if (rows == 16 && ks == TILE_K) {
        stride = g.bn * sizeof(bf16);
        return g.b + n * g.bn + k;
    }
    std::memset(buf, 0, 16 * TILE_K * sizeof(bf16));
    for (int64_t r = 0; r < rows; ++r) std::memcpy(buf + r * TILE_K, g.b + (n + r) * g.bn + k, ks * sizeof(bf16));
    stride = TILE_K * sizeof(bf16);
    return buf;
}

// AMX NT: C^T[n:n+16NT, m:m+16MT] over the whole K. Tiles: 0-3 accumulators (n tile i, m tile j
// -> 2i + j), 4-5 W, 6-7 A pairs.
template <int NT, int MT>
AMX void amx_nt_block(const Gemm& g, int64_t n, int64_t n1, int64_t m, bf16* wbuf, float* cbuf, int mode) {
    const int64_t steps = a_rows_ld(g.K) / TILE_K;
    const bf16* ap = g.ap + (m / 16) * steps * 512;  // m tile j + 1 is steps tiles further
    TILE_ZERO(0);
    if constexpr (MT > 1) TILE_ZERO(1);
    if constexpr (NT > 1) TILE_ZERO(2);
    if constexpr (NT > 1 && MT > 1) TILE_ZERO(3);
    for (int64_t s = 0; s < steps; ++s) {
        int64_t ws0, ws1 = 0;
        const bf16* w0 = w_tile(g, n, n1, s, wbuf, ws0);
        TILE_LOAD(4, w0, ws0);
        if constexpr (NT > 1) {
            const bf16* w1 = w_tile(g, n + 16, n1, s, wbuf + 512, ws1);
            TILE_LOAD(5, w1, ws1);
        }
        TILE_LOAD(6, ap + s * 512, 64);
        if constexpr (MT > 1) TILE_LOAD(7, ap + (steps + s) * 512, 64);
        TILE_DP(0, 4, 6);
        if constexpr (MT > 1) TILE_DP(1, 4, 7);
        if constexpr (NT > 1) TILE_DP(2, 5, 6);
        if constexpr (NT > 1 && MT > 1) TILE_DP(3, 5, 7);
    }
    TILE_STORE(0, cbuf, 64);
    if constexpr (MT > 1) TILE_STORE(1, cbuf + 256, 64);
    if constexpr (NT > 1) TILE_STORE(2, cbuf + 512, 64);
    if constexpr (NT > 1 && MT > 1) TILE_STORE(3, cbuf + 768, 64);
    for (int i = 0; i < NT; ++i)
        for (int j = 0; j < MT; ++j) {
            const int rows = static_cast<int>(std::min<int64_t>(16, g.M - m - 16 * j));
            const int cols = static_cast<int>(std::min<int64_t>(16, n1 - n - 16 * i));
            if (rows > 0 && cols > 0)
                store_tile(cbuf + 256 * (2 * i + j), true, g.c + (m + 16 * j) * g.ldc + n + 16 * i, g.ldc, rows,
                           cols, mode, g.beta);
        }
}

// AMX NN: C[m:m+16MT, columns of panels p..p+PT) over steps [s0, s0 + steps) of K (32 each;
// bp: the panels' pairs from step s0). Tiles: 0-3 accumulators (m tile i, panel j -> 2i + j),
// 4-5 A rows, 6-7 B pairs.
template <int MT, int PT>
AMX void amx_nn_block(const Gemm& g, int64_t m, int64_t s0, int64_t steps, const bf16* bp, int64_t panel_stride,
                      int64_t col, int64_t n1, float* cbuf, int mode) {
    const int64_t lda = a_rows_ld(g.K);
    const bf16* a0 = g.ap + m * lda + s0 * TILE_K;
    const bf16* a1 = a0 + 16 * lda;
    TILE_ZERO(0);
    if constexpr (PT > 1) TILE_ZERO(1);
    if constexpr (MT > 1) TILE_ZERO(2);
    if constexpr (MT > 1 && PT > 1) TILE_ZERO(3);
    for (int64_t s = 0; s < steps; ++s) {
        TILE_LOAD(4, a0 + s * TILE_K, lda * sizeof(bf16));
        if constexpr (MT > 1) TILE_LOAD(5, a1 + s * TILE_K, lda * sizeof(bf16));
        TILE_LOAD(6, bp + s * 512, 64);
        if constexpr (PT > 1) TILE_LOAD(7, bp + panel_stride + s * 512, 64);
        TILE_DP(0, 4, 6);
        if constexpr (PT > 1) TILE_DP(1, 4, 7);
        if constexpr (MT > 1) TILE_DP(2, 5, 6);
        if constexpr (MT > 1 && PT > 1) TILE_DP(3, 5, 7);
    }
    TILE_STORE(0, cbuf, 64);
    if constexpr (PT > 1) TILE_STORE(1, cbuf + 256, 64);
    if constexpr (MT > 1) TILE_STORE(2, cbuf + 512, 64);
    if constexpr (MT > 1 && PT > 1) TILE_STORE(3, cbuf + 768, 64);
    for (int i = 0; i < MT; ++i)
        for (int j = 0; j < PT; ++j) {
            const int rows = static_cast<int>(std::min<int64_t>(16, g.M - m - 16 * i));
            const int cols = static_cast<int>(std::min<int64_t>(16, n1 - col - 16 * j));
            if (rows > 0 && cols > 0)
                store_tile(cbuf + 256 * (2 * i + j), false, g.c + (m + 16 * i) * g.ldc + col + 16 * j, g.ldc, rows,
                           cols, mode, g.beta);
        }
}

// per-thread scratch of the AMX path: two edge W tiles, four result tiles, then the NN strip
struct AmxScratch {
    bf16 wbuf[2 * 512];
    float cbuf[4 * 256];
};

AMX void gemm_amx_nt(const Gemm& g, int64_t n0, int64_t n1, AmxScratch& sc) {
    const int mode = first_mode(g.beta);
    const int64_t m_pad = round_up(g.M, 16);
    // n outer: a 32-row strip of W (32 x K bf16) comes from memory once, then from L2 for the
    // other m blocks
    for (int64_t n = n0; n < n1; n += 32) {
        const bool two_n = n1 - n > 16;
        for (int64_t m = 0; m < m_pad; m += 32) {
            const bool two_m = m_pad - m > 16;
            if (two_n && two_m)
                amx_nt_block<2, 2>(g, n, n1, m, sc.wbuf, sc.cbuf, mode);
            else if (two_n)
                amx_nt_block<2, 1>(g, n, n1, m, sc.wbuf, sc.cbuf, mode);
            else if (two_m)
                amx_nt_block<1, 2>(g, n, n1, m, sc.wbuf, sc.cbuf, mode);
            else
                amx_nt_block<1, 1>(g, n, n1, m, sc.wbuf, sc.cbuf, mode);
        }
    }
}

// NN reads W by rows (the reduction), NC_AMX_NN columns of each: a block of KC_AMX_NN rows is
// repacked as bf16 pairs, then every row block of A runs over it; results add up in C across
// blocks (the first block applies beta). (A software prefetch of the next block measured slower.)
AMX void gemm_amx_nn(const Gemm& g, int64_t n0, int64_t n1, AmxScratch& sc, bf16* strip) {
    const int64_t k_pad = a_rows_ld(g.K), m_pad = round_up(g.M, 16), nc = n1 - n0;
    for (int64_t k0 = 0; k0 < k_pad || (k0 == 0 && k_pad == 0); k0 += KC_AMX_NN) {
        const int64_t pairs = std::min(KC_AMX_NN, k_pad - k0) / 2, panel_stride = pairs * 32;
        const int64_t s0 = k0 / TILE_K, steps = pairs / 16;
        const int mode = k0 > 0 ? 1 : first_mode(g.beta);
        pack_b_pairs(g, k0, pairs, n0, nc, strip);  // panels [pairs][16][2]: a 1 KiB tile a step
        for (int64_t mc = 0; mc < m_pad; mc += MC_AMX) {
            const int64_t mc_end = std::min(m_pad, mc + MC_AMX);
            for (int64_t col = n0; col < n1; col += 32) {
                const bf16* bp = strip + (col - n0) / 16 * panel_stride;
                const bool two_p = n1 - col > 16;
                for (int64_t m = mc; m < mc_end; m += 32) {
                    const bool two_m = mc_end - m > 16;
                    if (two_m && two_p)
                        amx_nn_block<2, 2>(g, m, s0, steps, bp, panel_stride, col, n1, sc.cbuf, mode);
                    else if (two_m)
                        amx_nn_block<2, 1>(g, m, s0, steps, bp, panel_stride, col, n1, sc.cbuf, mode);
                    else if (two_p)
                        amx_nn_block<1, 2>(g, m, s0, steps, bp, panel_stride, col, n1, sc.cbuf, mode);
                    else
                        amx_nn_block<1, 1>(g, m, s0, steps, bp, panel_stride, col, n1, sc.cbuf, mode);
                }
            }
        }
        if (k_pad == 0) break;
    }
}

#endif  // KTFT_X86

// ---------------------------------------------------------------- threads and work items

using ktft::team;

bool rounds_a(int isa) { return isa == ISA_AVX512BF16 || isa == ISA_AMX; }

// columns one work item of product g computes
int64_t chunk_cols(const Gemm& g, int isa) { return isa == ISA_AMX && !is_nt(g) && !g.q ? NC_AMX_NN : NC; }


void* aligned_buffer(size_t bytes) { return std::aligned_alloc(64, round_up(std::max<size_t>(bytes, 64), 64)); }

// Buffers kept between calls: the rounded A (a DeepSeek-V2-Lite layer at 2,048 tokens: 35-69 MB a
// product) and each worker's packing block and AMX scratch. Fresh, they came from the OS at every
// call (glibc maps blocks this large) and paid a page fault per 4 KiB at first write: ~50k faults
// a layer's forward and backward. One call at a time uses them (run() holds the lock).
struct Kept {
    void* p = nullptr;
    size_t bytes = 0;
    void* get(size_t want) {
        if (want > bytes) {
            std::free(p);
            bytes = round_up(std::max<size_t>(want, 64), 64);
            p = aligned_buffer(bytes);
        }
        return p;
    }
};

struct Scratch {
    std::mutex lock;
    Kept rounded;
    std::vector<Kept> pack, amx, slab;  // per worker slot
};

Scratch& scratch() {
    static Scratch s;
    return s;
}

// The bf16 paths' first pass: each product's A rounded to bf16 in its path's layout (g.ap set),
// work items of 64 rows; returns the buffer (scratch().rounded: kept for the next call).
bf16* round_inputs(std::vector<Gemm>& gemms, int threads, int isa) {
#ifdef KTFT_X86
    constexpr int64_t ROWS = 64;
    std::vector<int64_t> offset(gemms.size() + 1, 0), first(gemms.size() + 1, 0);
    for (size_t i = 0; i < gemms.size(); ++i) {
        const int64_t m_pad = round_up(gemms[i].M, 16);
        offset[i + 1] = offset[i] + m_pad * a_rows_ld(gemms[i].K);
        first[i + 1] = first[i] + (m_pad + ROWS - 1) / ROWS;
    }
    // every element is written below (padding too): no zeroing pass
    bf16* store = static_cast<bf16*>(scratch().rounded.get(offset.back() * sizeof(bf16)));
    for (size_t i = 0; i < gemms.size(); ++i) gemms[i].ap = store + offset[i];
    std::atomic<int64_t> next{0};
    const int64_t items = first.back();
    auto worker = [&]() {
        size_t g = 0;
        for (int64_t it; (it = next.fetch_add(1)) < items;) {
            while (first[g + 1] <= it) ++g;
            const Gemm& gm = gemms[g];
            const int64_t r0 = (it - first[g]) * ROWS, r1 = std::min(round_up(gm.M, 16), r0 + ROWS);
            bf16* dst = store + offset[g];
            if (is_nt(gm))  // both bf16 paths' NT products read A as pairs (W in place)
                pack_a_pairs(gm, r0, r1, dst);
            else
                pack_a_rows(gm, r0, r1, dst);
        }
    };
    team(static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, items))), worker);
    return store;
#else
    (void)gemms, (void)threads, (void)isa;
    return nullptr;
#endif
}

// One work item: columns [n0, n1) of product g on path isa, with this thread's buffers.
struct ThreadBuffers {
    void* pack = nullptr;   // fp32 / bf16-pair block of B, or AMX NN's strip
#ifdef KTFT_X86
    AmxScratch* amx = nullptr;
#endif
};

void compute(const Gemm& g, int64_t n0, int64_t n1, int isa, ThreadBuffers& tb) {
#ifdef KTFT_X86
    switch (isa) {
        case ISA_AVX2: return gemm_avx2(g, n0, n1, tb.pack);
        case ISA_AVX512: return gemm_avx512(g, n0, n1, tb.pack);
        case ISA_AVX512BF16:
            if (is_nt(g)) return gemm_avx512bf16_nt(g, n0, n1);
            return gemm_avx512bf16(g, n0, n1, tb.pack);
        case ISA_AMX:
            if (is_nt(g)) return gemm_amx_nt(g, n0, n1, *tb.amx);
            return gemm_amx_nn(g, n0, n1, *tb.amx, static_cast<bf16*>(tb.pack));
        default: break;
    }
#endif
    (void)isa, (void)tb;
    gemm_scalar(g, n0, n1);
}

// A quantized weight's work item on the scalar and bf16 paths (the fp32 ones decode into their
// panels: pack_b_quant), columns [n0, n1): NT reads rows n0..n1 of W (all K inputs), NN columns
// n0..n1 of W (all its K rows). They are decoded to bf16 into the thread's slab first
// (at most NC x K: 1.8 MiB for a DeepSeek-V3 gate/up chunk, never a whole expert; decoded once,
// read by every row block of A), then the item runs as the bf16 product over the slab: the same
// path, blocking and sums, so the bits of the bf16 GEMM over the dequantized weight.
void compute_quant(const Gemm& g, int64_t n0, int64_t n1, int isa, ThreadBuffers& tb, bf16* slab) {
    const int64_t nc = n1 - n0;
    // the decoders' level: AVX-512BW where the path is a bf16 one (those CPUs have it), AVX2 + F16C
    int level = 0;
#ifdef KTFT_X86
    if (isa >= ISA_AVX512BF16)
        level = 2;
    else if (isa >= ISA_AVX2 && __builtin_cpu_supports("f16c"))
        level = 1;
#endif
    Gemm s = g;
    s.q = nullptr;
    s.b = slab;
    s.c = g.c + n0;
    s.N = nc;
    if (is_nt(g)) {  // W rows n0..n1: [nc][K]
        ktft::decode_rows(*g.q, g.expert, n0, n1, 0, g.K, slab, g.K, level);
        s.bn = g.K;
    } else {  // W[0:K, n0:n1]: [K][ld], ld >= 16 (a row stride of 1 would read as NT: is_nt)
        const int64_t ld = round_up(nc, 16);
        ktft::decode_rows(*g.q, g.expert, 0, g.K, n0, n1, slab, ld, level);
        s.bk = ld;
    }
    compute(s, 0, nc, isa, tb);
}

// the paths that read a quantized weight from a decoded bf16 slab (the fp32 paths decode into
// their packed panels instead: pack_b_quant)
bool decodes_to_slab(int isa) { return isa != ISA_AVX2 && isa != ISA_AVX512; }

// bytes of a thread's slab for quantized products on path isa (0: none)
size_t slab_bytes(const std::vector<Gemm>& gemms, int isa) {
    if (!decodes_to_slab(isa)) return 0;
    size_t most = 0;
    for (const Gemm& g : gemms)
        if (g.q) most = std::max(most, static_cast<size_t>(NC * g.K * sizeof(bf16)));
    return most;
}

// bytes of a thread's packing block for these products on path isa
size_t pack_bytes(const std::vector<Gemm>& gemms, int isa) {
    switch (isa) {
        case ISA_SCALAR: return 0;
        case ISA_AVX512BF16: return KC_BF16 * NC * sizeof(bf16);
        case ISA_AMX: return KC_AMX_NN * NC_AMX_NN * sizeof(bf16);
        default: return KC * NC * sizeof(float);
    }
}

// Runs products in column chunks on `threads` threads; returns the ISA used or < 0.
int run(std::vector<Gemm> gemms, int threads, int isa) {
    const int best = best_isa();
    if (isa == ISA_AUTO) isa = best;
    if (isa < ISA_SCALAR || isa > best) return -2;  // an ISA this CPU (or its OS) lacks, or none
    std::vector<int64_t> first(gemms.size() + 1, 0);  // first work item of each product
    for (size_t i = 0; i < gemms.size(); ++i) {
        const int64_t cols = chunk_cols(gemms[i], isa);
        const int64_t chunks = gemms[i].M + gemms[i].zero_rows > 0 ? (gemms[i].N + cols - 1) / cols : 0;
        first[i + 1] = first[i] + chunks;
    }
    const int64_t items = first.back();
    if (items == 0) return isa;
    threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, items)));
    Scratch& kept = scratch();
    std::lock_guard<std::mutex> hold(kept.lock);  // the kept buffers: one call at a time
    if (kept.pack.size() < static_cast<size_t>(threads)) {
        kept.pack.resize(threads);
        kept.amx.resize(threads);
        kept.slab.resize(threads);
    }
    if (rounds_a(isa)) round_inputs(gemms, threads, isa);
    const size_t bytes = pack_bytes(gemms, isa), sbytes = slab_bytes(gemms, isa);
    std::atomic<int64_t> next{0};
    std::atomic<int> slots{0};
    auto worker = [&]() {
        const int slot = slots.fetch_add(1);  // this worker's kept buffers
        ThreadBuffers tb;
        if (bytes) tb.pack = kept.pack[slot].get(bytes);
        bf16* slab = sbytes ? static_cast<bf16*>(kept.slab[slot].get(sbytes)) : nullptr;
#ifdef KTFT_X86
        if (isa == ISA_AMX) {
            tb.amx = static_cast<AmxScratch*>(kept.amx[slot].get(sizeof(AmxScratch)));
            amx_configure();
        }
#endif
        size_t g = 0;
        for (int64_t it; (it = next.fetch_add(1)) < items;) {
            while (first[g + 1] <= it) ++g;  // items are taken in increasing order per thread
            const Gemm& gm = gemms[g];
            const int64_t cols = chunk_cols(gm, isa);
            const int64_t n0 = (it - first[g]) * cols, n1 = std::min(gm.N, n0 + cols);
            for (int64_t r = gm.M; r < gm.M + gm.zero_rows; ++r)
                std::memset(gm.c + r * gm.ldc + n0, 0, (n1 - n0) * sizeof(float));
            if (gm.M > 0) {
                if (gm.q && decodes_to_slab(isa))
                    compute_quant(gm, n0, n1, isa, tb, slab);
                else
                    compute(gm, n0, n1, isa, tb);
            }
        }
#ifdef KTFT_X86
        if (isa == ISA_AMX) amx_release();
#endif
    };
    team(threads, worker);
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

// The best ISA this CPU and OS run: 1 scalar, 2 AVX2+FMA, 3 AVX-512F, 4 AVX512-BF16, 5 AMX-BF16.
int ktft_best_isa(void) { return best_isa(); }

// Caps ktft_best_isa (and what a forced ISA may be) at `cap` as if the CPU lacked the paths
// above it: the tests' way to see the refusal on a CPU that has every path. 0 lifts the cap.
void ktft_limit_isa(int cap) { isa_cap.store(cap <= 0 ? ISA_AMX : cap); }

int ktft_abi_version(void) { return 3; }

// One product. trans_w = 1 (NT): C[M, N] = beta C + A[M, K] @ W[N, K]^T, W row stride ldw;
// trans_w = 0 (NN): C[M, N] = beta C + A[M, K] @ W[K, N]. All row-major with the given row
// strides; A, C fp32, W bf16 bits. isa 0 = best available. Returns the ISA used, < 0 on error
// (-2: an ISA this CPU or its OS does not run; nothing was computed).
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
    return run(std::move(gemms), threads, isa);
}

// ktft_grouped_gemm_bf16 over an expert weight kept quantized: `parts` (nparts of them, rows in
// order; kernels/quant_decode.h) describe every expert's stored codes and scales, W [rows, K]
// (NT: rows = N; NN: rows = K, its columns N). Each work item decodes the rows or columns of W it
// reads to bf16 (a slab of at most 128 x K per thread), then multiplies as the bf16 product: the
// result is ktft_grouped_gemm_bf16's over the weight dequantized to bf16, bit for bit.
// -3: the parts' rows do not add up to W's.
int ktft_grouped_gemm_quant(int trans_w, int64_t groups, const int64_t* expert, const int64_t* row0,
                            const int64_t* rows, const int64_t* pad, int64_t N, int64_t K, const float* a,
                            int64_t lda, const ktft::QuantPart* parts, int nparts, float* c, int64_t ldc,
                            float beta, int threads, int isa) {
    int64_t wrows = 0;
    for (int i = 0; i < nparts; ++i) wrows += parts[i].rows;
    if (nparts < 1 || wrows != (trans_w ? N : K)) return -3;
    const ktft::QuantW w{parts, nparts, trans_w ? K : N};
    std::vector<Gemm> gemms;
    gemms.reserve(groups);
    for (int64_t i = 0; i < groups; ++i) {
        Gemm g = make(trans_w, rows[i], N, K, a + row0[i] * lda, lda, nullptr, 0, c + row0[i] * ldc, ldc, beta,
                      pad ? pad[i] : 0);
        g.q = &w;
        g.expert = expert[i];
        gemms.push_back(g);
    }
    return run(std::move(gemms), threads, isa);
}

}  // extern "C"
