"""The host allocator's policy for a kt-ft training process: large blocks straight from the OS.

glibc's malloc serves a block of at least ``M_MMAP_THRESHOLD`` bytes with its own ``mmap`` and
gives it back on free. By default that threshold adapts: each time a mapped block is freed it
rises to that block's size (up to 32 MiB), so from then on blocks of a few MiB to 32 MiB (a
layer's [tokens, hidden] activations, the CPU op's per-call results and gradients) come from the
heaps instead, one heap per thread that allocates (the forward's, autograd's backward thread,
the loaders'). A heap returns freed memory to the OS only from its top, so blocks that outlive a
step (each layer's output kept for its backward) pin the freed space below them: the process's
resident memory grows by memory nothing uses (``docs/benchmarks.md`` has a measurement).

``KT_FT_MMAP_THRESHOLD`` fixes the threshold (which also stops its adapting): blocks from that
size up are mapped and unmapped again. The CPU op's large temporaries come from buffers it keeps
(``kernels/grouped.py``), so the page faults of fresh mappings fall on the few blocks that leave
the op. ``0`` keeps glibc's default. Only glibc has ``mallopt``; elsewhere this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util

from kt_ft.base.settings import get

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number (malloc.h)
_applied: int | None = None


def threshold_bytes() -> int:
    """``KT_FT_MMAP_THRESHOLD`` in bytes (a number of bytes, or with a K/M suffix); 0: off."""
    raw = str(get("KT_FT_MMAP_THRESHOLD")).strip().upper()
    scale = {"K": 2**10, "M": 2**20}.get(raw[-1:], 1)
    digits = raw[:-1] if scale > 1 else raw
    if not digits.isdigit():
        raise ValueError(
            f"KT_FT_MMAP_THRESHOLD={raw!r}: a size in bytes (e.g. 4194304 or 4M), or 0 for glibc's default"
        )
    return int(digits) * scale


def apply(logger=None) -> int:
    """Set glibc's mmap threshold from ``KT_FT_MMAP_THRESHOLD`` once a process (before the weights
    load). Returns the threshold set in bytes, 0 when none was (off, or not glibc)."""
    global _applied
    if _applied is not None:
        return _applied
    want = threshold_bytes()
    _applied = 0
    if want <= 0:
        return 0
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc: its own allocator's policy stays
        return 0
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # glibc caps the threshold at 32 MiB (HEAP_MAX / 2 on 64-bit); mallopt returns 1 on success
    if mallopt(M_MMAP_THRESHOLD, min(want, 32 * 2**20)) == 1:
        _applied = min(want, 32 * 2**20)
        if logger is not None:
            logger.info(
                f"host allocator: blocks of {_applied / 2**20:g} MiB and more are mapped and unmapped per use "
                "(KT_FT_MMAP_THRESHOLD; 0 keeps glibc's adaptive threshold)"
            )
    return _applied
