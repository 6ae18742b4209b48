// Row-parallel kernels of kt-ft's CPU library (expert_act.cpp, expert_rows.cpp): one function per
// vector width, the widest this CPU runs chosen at each call, rows split into work items over a
// thread team.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "team.h"

extern "C" int ktft_best_isa(void);  // expert_gemm.cpp: the best path here, capped by ktft_limit_isa

#if defined(__x86_64__)
#define KTFT_T_AVX2 __attribute__((target("avx2,fma")))
#define KTFT_T_AVX512 __attribute__((target("avx2,fma,avx512f")))
#else
#define KTFT_T_AVX2
#define KTFT_T_AVX512
#endif

namespace ktft {

constexpr int ISA_AVX2 = 2, ISA_AVX512 = 3;  // expert_gemm.cpp's Isa codes

template <class A>
using RowsFn = void (*)(const A&, int64_t, int64_t);

// Runs fn(args, r0, r1) over rows [0, rows) in items of `per_item` rows on `threads` threads, fn the
// baseline, AVX2 or AVX-512 build: the best this CPU runs, capped by `isa` (0: no cap). Returns the
// path used, -2 for an ISA the CPU lacks (nothing computed).
template <class A>
int run_rows(int64_t rows, int64_t per_item, const A& args, int threads, int isa, RowsFn<A> base, RowsFn<A> avx2,
             RowsFn<A> avx512) {
    const int best = ktft_best_isa();
    if (isa == 0) isa = best;
    if (isa < 1 || isa > best) return -2;
    const RowsFn<A> fn = isa >= ISA_AVX512 ? avx512 : isa >= ISA_AVX2 ? avx2 : base;
    const int64_t items = (rows + per_item - 1) / per_item;
    std::atomic<int64_t> next{0};
    auto worker = [&]() {
        for (int64_t it; (it = next.fetch_add(1)) < items;) fn(args, it * per_item, std::min(rows, (it + 1) * per_item));
    };
    team(static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, items))), worker);
    return isa;
}

}  // namespace ktft
