// Thread teams of kt-ft's C++ CPU kernels: plain std::threads per call, the caller one of them,
// taking work items from an atomic counter the worker closes over.
#pragma once

#include <thread>
#include <vector>

namespace ktft {

// Runs worker() on `threads` threads (the caller's one of them) and waits for all.
template <class F>
void team(int threads, F&& worker) {
    std::vector<std::thread> pool;
    for (int t = 1; t < threads; ++t) pool.emplace_back(worker);
    worker();
    for (auto& t : pool) t.join();
}

}  // namespace ktft
