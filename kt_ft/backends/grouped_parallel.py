"""``torch-ep``: the ``torch`` backend with experts computed in parallel, one thread per core.

The ``torch`` backend runs each expert's products one after another, every product spread over
all ``cpu_infer`` threads by oneDNN. An expert's product is small (T·k/E rows: 256 at 4096 tokens
for Qwen3-30B-A3B), and splitting it 16 ways leaves each thread little work per synchronisation.
Here each of ``threads`` worker threads takes whole experts (balanced by rows: largest first, to
the least loaded worker) and runs their products single-threaded; the GIL is released inside
every product, so the workers compute at once. Same arithmetic as ``torch`` (the same products
into the same buffers; only which thread runs them differs), so the same parity tests apply.

Whether it is faster depends on the machine: measure with ``kt-ft bench --parts op`` (it runs
every backend). Threads: a worker sets its own OpenMP thread count to 1 (a per-thread setting);
``torch.set_num_threads`` also sets MKL's and torch's global counts, so the caller's count is
restored after the workers start.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from kt_ft.backends.base import ExpertWeights
from kt_ft.backends.grouped import GroupedTorchBackend
from kt_ft.backends.grouped_layout import _Group, _Layout


def balance(counts: list[int], workers: int) -> list[list[int]]:
    """Experts with rows split over ``workers`` lists, each expert whole: largest first, each to
    the list with the fewest rows so far (ties: the lower list). Empty lists are dropped."""
    loads = [0] * workers
    out: list[list[int]] = [[] for _ in range(workers)]
    for e in sorted((e for e, n in enumerate(counts) if n), key=lambda e: (-counts[e], e)):
        w = min(range(workers), key=lambda i: (loads[i], i))
        out[w].append(e)
        loads[w] += counts[e]
    return [sorted(o) for o in out if o]


class ExpertParallelTorchBackend(GroupedTorchBackend):
    name = "torch-ep"

    def __init__(self) -> None:
        super().__init__()
        self._threads = 0
        self._pool: ThreadPoolExecutor | None = None
        self._workers_n = 0

    def prepare(self, weights: ExpertWeights, threads: int | None = None, max_tokens: int = 4096) -> None:
        self._threads = threads or torch.get_num_threads()

    def _workers(self) -> ThreadPoolExecutor:
        if self._pool is None:
            n = self._threads or torch.get_num_threads()
            caller = torch.get_num_threads()
            started = threading.Barrier(n)

            def start() -> None:
                torch.set_num_threads(1)
                started.wait()  # every worker thread exists (the pool spawns one per waiting task)

            self._pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix="kt-ft-expert")
            self._workers_n = n
            for f in [self._pool.submit(start) for _ in range(n)]:
                f.result()
            torch.set_num_threads(caller)  # MKL's and torch's global counts back for the caller
        return self._pool

    def _for_experts(self, layout: _Layout, *products: Callable[[int, slice], object]) -> None:
        slices = dict(layout.slices)
        pool = self._workers()

        def run(experts: list[int]) -> None:
            for e in experts:
                for fn in products:
                    fn(e, slices[e])

        for f in [pool.submit(run, chunk) for chunk in balance(layout.counts, self._workers_n)]:
            f.result()  # re-raises a worker's error here

    def _for_groups(self, layout: _Layout, *products: Callable[[_Group], object]) -> None:
        # whole experts per thread here too: each expert a group of one, on its worker
        groups = {e: _Group([e], sl, 1, sl.stop - sl.start) for e, sl in layout.slices}
        self._for_experts(layout, *[lambda e, _sl, fn=fn: fn(groups[e]) for fn in products])

    def __del__(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
