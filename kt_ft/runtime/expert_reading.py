"""Fill the fused routed-expert tensors straight from the safetensors files: one copy in RAM.

transformers loads a checkpoint through a memory mapping of each file: building a fused
``gate_up_proj`` [E, 2I, H] from the per-expert tensors reads every expert page through the
mapping, and those pages count in the process's RSS (RssFile) for as long as the file stays
mapped, which is the whole ``from_pretrained``; the fused tensor itself is new private memory
(RssAnon). Peak RSS is thus about two copies of the experts (measured: scripts/load_memory.py).

Here the routed experts are loaded on ``meta`` by ``from_pretrained`` and filled afterwards:
each target tensor is allocated once (``torch.empty``, or a caller's allocator, e.g. a shared
mapping), each expert's bytes are read with ``os.preadv`` straight into its slice (no mapping,
so the page cache is not in RSS; a dtype other than the load dtype goes through a one-expert
buffer and ``copy_``), and after each layer the file range is dropped from the page cache
(``POSIX_FADV_DONTNEED``) so that the kernel's cache does not hold a second copy either.
"""

from __future__ import annotations

import ctypes
import os
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from kt_ft.base.errors import KTConfigError
from kt_ft.base.log import fmt_bytes, get_logger
from kt_ft.formats.expert_files import ParamSource, Piece

logger = get_logger(__name__)

Allocator = Callable[[str, tuple[int, ...], torch.dtype], torch.Tensor]


def _cpu_empty(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype)


def _bytes_of(t: torch.Tensor) -> memoryview:
    """A writable byte view of contiguous CPU tensor ``t`` (no copy), valid while ``t`` lives.
    Through ctypes, not ``Tensor.numpy()``: exporting to numpy marks the storage non-resizable for
    good, and a backend holding its own copy of the weights frees kt-ft's by resizing its storage
    to 0 (``moe/function.py`` ``ExpertRunner._free_base``)."""
    n = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


def _read_into(fd: int, offset: int, buf: memoryview, file: Path) -> None:
    done = 0
    while done < len(buf):
        n = os.preadv(fd, [buf[done:]], offset + done)
        if n <= 0:
            raise KTConfigError(
                f"{file}: ended at byte {offset + done}, expected {len(buf) - done} more (truncated?)"
            )
        done += n


def _fill_piece(fd: int, piece: Piece, dst: torch.Tensor) -> None:
    """``dst``: the target slice (contiguous, the piece's element count, the load dtype); a
    transposed piece ([in, out] for a [out, in] slice) goes through a buffer and is transposed."""
    if piece.transposed:
        tmp = torch.empty(piece.shape, dtype=piece.dtype)
        _read_into(fd, piece.offset, _bytes_of(tmp), piece.file)
        dst.copy_(tmp.t())
        return
    if piece.dtype == dst.dtype:
        _read_into(fd, piece.offset, _bytes_of(dst), piece.file)
    else:
        tmp = torch.empty(piece.shape, dtype=piece.dtype)
        _read_into(fd, piece.offset, _bytes_of(tmp), piece.file)
        dst.copy_(tmp.view(dst.shape))


def _drop_cache(fd: int, ranges: list[tuple[int, int]]) -> None:
    """Drop [start, end) ranges from the page cache, merged (``fadvise`` skips pages mapped by
    a process, e.g. non-expert tensors transformers keeps as mmap views)."""
    if not hasattr(os, "posix_fadvise"):
        return
    ranges.sort()
    start, end = ranges[0]
    for s, e in [*ranges[1:], (None, None)]:
        if s is not None and s <= end:
            end = max(end, e)
            continue
        os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_DONTNEED)
        if s is not None:
            start, end = s, e


def _layer_of(name: str) -> str:
    return name.rpartition(".")[0].rpartition(".")[0]  # model.layers.0.mlp.experts.gate_up_proj -> ...mlp


def _point_at(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name)
    setattr(module, attr, nn.Parameter(tensor, requires_grad=getattr(module, attr).requires_grad))


def fill_routed_experts(
    model: nn.Module, sources: list[ParamSource], allocate: Allocator | None = None
) -> int:
    """Allocate and read every parameter of ``sources`` (on ``meta`` in ``model``: its dtype is the
    load dtype) and point the model's parameter at it. Returns the bytes filled."""
    allocate = allocate or _cpu_empty
    by_layer: dict[str, list[ParamSource]] = defaultdict(list)
    for src in sources:
        by_layer[_layer_of(src.name)].append(src)
    fds: dict[Path, int] = {}
    total = 0
    try:
        bar = tqdm(by_layer.items(), desc="routed experts -> CPU RAM", unit="layer", total=len(by_layer))
        for _, layer_sources in bar:
            ranges: dict[Path, list[tuple[int, int]]] = defaultdict(list)
            for src in layer_sources:
                current = model.get_parameter(src.name)
                dtype = current.dtype
                target = allocate(src.name, src.shape, dtype)
                for piece in src.pieces:
                    fd = fds.get(piece.file)
                    if fd is None:
                        fd = fds[piece.file] = os.open(piece.file, os.O_RDONLY)
                    dst = target[piece.expert]
                    if piece.rows is not None:
                        dst = dst[piece.rows[0] : piece.rows[1]]
                    _fill_piece(fd, piece, dst)
                    ranges[piece.file].append((piece.offset, piece.offset + piece.nbytes))
                _point_at(model, src.name, target)
                total += target.numel() * target.element_size()
            for file, rs in ranges.items():
                _drop_cache(fds[file], rs)
            bar.set_postfix_str(fmt_bytes(total))
    finally:
        for fd in fds.values():
            os.close(fd)
    layouts = sorted({s.layout for s in sources})
    logger.info(
        f"routed experts: {fmt_bytes(total)} in {len(by_layer)} layers read from the safetensors files "
        f"({', '.join(layouts)} layout) straight into CPU RAM"
    )
    return total
