"""Host -> GPU copy rate from pageable, pinned (allocator) and cudaHostRegister-ed memory: whether
torch's non_blocking copy of registered rows (kt_ft/runtime/streamed.py) gets the pinned rate.
Run on the GPU machine:

    python -m kt_ft.integrations.bench.probes.register_probe
"""

import time

import torch

from kt_ft.runtime.streamed import is_page_locked

n = 1 << 30


def rate(src: torch.Tensor, dst: torch.Tensor) -> float:
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(3):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return 3 * n / (time.perf_counter() - t0) / 1e9


def main() -> None:
    dst = torch.empty(n, dtype=torch.uint8, device="cuda")
    page = torch.ones(n, dtype=torch.uint8)
    print(f"pageable   {rate(page, dst):6.1f} GB/s  page-locked={is_page_locked(page)}")
    pinned = torch.ones(n, dtype=torch.uint8).pin_memory()
    print(f"pinned     {rate(pinned, dst):6.1f} GB/s  page-locked={is_page_locked(pinned)}")
    cudart = torch.cuda.cudart()
    assert cudart.cudaHostRegister(page.data_ptr(), n, 0) == cudart.cudaError.success
    print(
        f"registered {rate(page, dst):6.1f} GB/s  page-locked={is_page_locked(page)} is_pinned={page.is_pinned()}"
    )
    cudart.cudaHostUnregister(page.data_ptr())


if __name__ == "__main__":
    main()
