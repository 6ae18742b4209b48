"""One copy of the frozen routed-expert weights per machine, shared by all its ranks.

transformers loads a MoE checkpoint's experts into fused ``gate_up_proj`` [E, 2I, H] /
``down_proj`` [E, H, I] tensors that it builds from the per-expert tensors of the files: new
anonymous (private) memory, so N ranks on one machine would hold N copies. With several ranks
on a machine, kt-ft instead:

1. reads the routed experts on local rank 0 only; the other local ranks load them on the
   ``meta`` device (shapes only, nothing read: ``meta_device_map``);
2. local rank 0 creates one file ``kt-ft-experts-<run token>.bin`` in a RAM-backed directory
   (``/dev/shm``, or ``$KT_FT_SHARED_DIR``), mapped ``MAP_SHARED``
   (``torch.UntypedStorage.from_file(shared=True)``), and reads each fused tensor straight from
   the checkpoint into it (``fill``: ``kt_ft.runtime.expert_reading``, no private copy), or, where
   transformers loaded them, copies them in layer by layer and frees its private copy;
3. every other local rank maps the same file and points its meta parameters at it;
4. once all have mapped it, local rank 0 unlinks the file: the pages live as long as a
   process maps them and go away with the last one (no leftover in /dev/shm after a crash
   that happens later).

``KT_FT_SHARED_DIR=off`` turns this off (each rank then holds a private copy), to compare.

All ranks then compute on the same physical pages (kt-ft never writes base weights: they are
frozen and DDP is kept away from them, see ``kt_ft.runtime.distributed``). Each tensor starts on a
4 KiB boundary of the file; the layout (name, shape, dtype, offset) comes from the
parameters' metadata, identical on every rank, and rank 0's is broadcast and checked.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from kt_ft.base.errors import KTConfigError
from kt_ft.base.log import fmt_bytes, get_logger
from kt_ft.base.processes import barrier, broadcast_object, new_run_token
from kt_ft.base.settings import enabled, get

logger = get_logger(__name__)

SHARED_DIR_ENV = "KT_FT_SHARED_DIR"  # "off" (or 0): every rank loads its own private copy
FILE_PREFIX = "kt-ft-experts-"
ALIGN = 4096
BASE_NAMES = ("gate_up_proj", "down_proj")


@dataclass(frozen=True)
class Slot:
    """Where one base tensor lives in the shared file."""

    name: str  # dotted parameter name, e.g. model.layers.0.mlp.experts.gate_up_proj
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int  # bytes from the file start, a multiple of ALIGN

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()


def sharing_enabled(local_world_size: int) -> bool:
    """Several ranks on this machine, and not turned off with KT_FT_SHARED_DIR=off."""
    return local_world_size > 1 and enabled(SHARED_DIR_ENV)


def shared_dir() -> Path:
    return Path(get(SHARED_DIR_ENV))


def expert_base_params(model: nn.Module, expert_names: list[str]) -> list[tuple[str, nn.Parameter]]:
    """(dotted name, parameter) of the fused base tensors of each routed-experts module, in
    ``expert_names`` order."""
    out = []
    for module_name in expert_names:
        module = model.get_submodule(module_name)
        for n in BASE_NAMES:
            out.append((f"{module_name}.{n}", getattr(module, n)))
    return out


def _point_at(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Replace parameter ``name`` by a frozen one on ``tensor`` (a meta parameter cannot take
    CPU data through ``.data``; a new Parameter object works for both)."""
    module_name, _, attr = name.rpartition(".")
    setattr(model.get_submodule(module_name), attr, nn.Parameter(tensor, requires_grad=False))


def layout(params: list[tuple[str, nn.Parameter]]) -> tuple[list[Slot], int]:
    """Slots for ``params`` (shape and dtype only: works on meta tensors) and the file size."""
    slots, offset = [], 0
    for name, p in params:
        slot = Slot(name, tuple(p.shape), p.dtype, offset)
        slots.append(slot)
        offset += -(-slot.nbytes // ALIGN) * ALIGN
    return slots, offset


def _view(storage: torch.UntypedStorage, slot: Slot) -> torch.Tensor:
    """The tensor of ``slot`` on ``storage`` (no copy)."""
    itemsize = torch.empty((), dtype=slot.dtype).element_size()
    t = torch.empty(0, dtype=slot.dtype)
    return t.set_(storage, slot.offset // itemsize, slot.shape)


def _check_space(directory: Path, size: int) -> None:
    try:
        st = os.statvfs(directory)
    except OSError as e:
        raise KTConfigError(
            f"{SHARED_DIR_ENV}={directory}: not usable for the shared routed-expert weights ({e}); "
            "set it to an existing directory on tmpfs (RAM) or a local disk, or to off (each rank its "
            "own copy)"
        ) from e
    free = st.f_bavail * st.f_frsize
    if free < size:
        raise KTConfigError(
            f"{directory}: {fmt_bytes(free)} free, the shared routed-expert weights need {fmt_bytes(size)}: "
            f"enlarge it (docker: --shm-size) or set {SHARED_DIR_ENV} to a directory with room "
            "(tmpfs or a local disk: the page cache is shared all the same), or to off (each rank its own copy)"
        )


def share_expert_weights(
    model: nn.Module,
    expert_names: list[str],
    local_rank: int,
    fill: Callable[[Callable[[str, tuple[int, ...], torch.dtype], torch.Tensor]], int] | None = None,
) -> int:
    """Point every rank's routed-expert base tensors at one shared mapping (see module doc).

    ``fill``: on local rank 0, where its experts are still on ``meta``, reads them straight into
    the mapping (``ExpertReader.fill`` with an allocator of views of the file: no private copy
    at all); without it, local rank 0 copies the tensors transformers loaded.
    Collective: every rank of the run calls it, at the same point. Returns the bytes shared.
    """
    params = expert_base_params(model, expert_names)
    slots, size = layout(params)
    token = new_run_token()
    want = broadcast_object([(s.name, s.shape, str(s.dtype)) for s in slots])
    mine = [(s.name, s.shape, str(s.dtype)) for s in slots]
    if mine != want:
        raise KTConfigError(
            f"shared routed-expert weights: this rank's experts {mine[:2]}... differ from rank 0's {want[:2]}...; "
            "every rank must load the same model"
        )
    directory = shared_dir()
    path = directory / f"{FILE_PREFIX}{token}.bin"
    if local_rank == 0:
        _check_space(directory, size)
        with open(path, "wb") as f:
            f.truncate(size)
        storage = torch.UntypedStorage.from_file(str(path), True, size)
        if fill is not None:
            fill(_slot_allocator(storage, slots))
        else:
            with torch.no_grad():
                for slot, (_, p) in zip(slots, params):
                    view = _view(storage, slot)
                    view.copy_(p.data)
                    _point_at(model, slot.name, view)  # the loaded private copy is freed here
    barrier()  # the file is complete
    if local_rank != 0:
        storage = torch.UntypedStorage.from_file(str(path), True, size)
        for slot in slots:
            _point_at(model, slot.name, _view(storage, slot))
    del params  # no reference to the loaded private copies may outlive this call
    barrier()  # every local rank has mapped it
    if local_rank == 0:
        path.unlink()
    logger.info(
        f"routed-expert weights ({fmt_bytes(size)}) shared by this machine's ranks: one MAP_SHARED copy "
        f"from {path} (unlinked; freed with the last process)"
    )
    return size


def _slot_allocator(storage: torch.UntypedStorage, slots: list[Slot]):
    """An ``expert_reading`` allocator: the shared file's view for a base tensor, private memory
    for anything else of the experts module (e.g. gpt_oss's biases, not in the file)."""
    by_name = {s.name: s for s in slots}

    def allocate(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        slot = by_name.get(name)
        if slot is None:
            return torch.empty(shape, dtype=dtype)
        if slot.shape != tuple(shape) or slot.dtype != dtype:
            raise KTConfigError(
                f"{name}: shared slot {slot.shape} {slot.dtype} != loaded {tuple(shape)} {dtype}"
            )
        return _view(storage, slot)

    return allocate


def meta_device_map(device_map: dict, expert_names: list[str]) -> dict:
    """``device_map`` with every routed-experts module on ``meta`` (not read from the files)."""
    return type(device_map)({**device_map, **dict.fromkeys(expert_names, "meta")})
