"""FSDP2 (``torch.distributed.fsdp.fully_shard``) beside kt-ft's CPU experts: tensor-level helpers.

Under FSDP2 the non-expert parameters (attention, shared experts, router, PEFT LoRA) are
``DTensor`` shards, while every ``KTExperts`` parameter is handed to ``fully_shard`` as an
ignored parameter and stays a plain CPU tensor: not sharded, not moved to the GPU, not reduced
by FSDP (kt-ft averages the expert-LoRA gradients itself, see ``kt_ft.runtime.distributed``). A model
therefore mixes the two kinds, which torch's whole-model helpers refuse ("got mixed
torch.Tensor and DTensor"). This module does those few whole-model operations kind by kind:

* ``clip_grad_norm_``: the global gradient norm (DTensor shards reduced over the FSDP mesh, the
  plain expert-LoRA gradients added once: they are identical on every rank after kt-ft's
  all-reduce), then the same scaling of every gradient;
* ``full_optimizer_state`` / ``shard_optimizer_state``: the optimizer state as whole tensors in
  torch's own index-keyed layout, i.e. exactly what a one-process or DDP run writes to
  ``optimizer.pt`` (so a checkpoint resumes under DDP, FSDP2 or one process alike), and back;
* ``gather_full`` / ``copy_full_into``: whole adapter tensors out of, and into, live shards.

Every function that gathers is a collective: all ranks call it, in the same order.
No transformers / LLaMA-Factory imports here (``kt_ft.integrations.trainer.fsdp`` wires these
into the HF Trainer).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


def _dtensor_cls():
    from torch.distributed.tensor import DTensor

    return DTensor


def is_sharded(t: object) -> bool:
    """True for a ``DTensor`` (an FSDP2 shard), False for a plain tensor (or anything else)."""
    return isinstance(t, _dtensor_cls())


def gather_full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a DTensor all-gathered (a collective), a plain tensor as is."""
    return t.full_tensor() if is_sharded(t) else t


def shard_like(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``full`` (the whole tensor, on every rank) as a DTensor laid out like ``like`` (same mesh
    and placements, ``like``'s device), cut locally: every rank already holds ``full``, so
    nothing is communicated (``src_data_rank=None``). A plain ``like``: ``full`` on its device."""
    if not is_sharded(like):
        return full.to(like.device)
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full.to(like.device), like.device_mesh, like.placements, src_data_rank=None)


@torch.no_grad()
def copy_full_into(target: torch.Tensor, full: torch.Tensor) -> None:
    """Copy the whole tensor ``full`` into ``target`` (a live parameter or a view of one),
    shard-wise when ``target`` is a DTensor."""
    if tuple(full.shape) != tuple(target.shape):
        raise ValueError(f"shape {tuple(full.shape)} does not match the parameter's {tuple(target.shape)}")
    target.copy_(shard_like(full.to(target.dtype), target))


def _split_by_grad(parameters: Iterable[nn.Parameter]) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(parameters with a DTensor gradient, parameters with a plain gradient); no gradient: neither."""
    sharded, plain = [], []
    for p in parameters:
        if p.grad is not None:
            (sharded if is_sharded(p.grad) else plain).append(p)
    return sharded, plain


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[nn.Parameter], max_norm: float, norm_type: float = 2.0
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for a model mixing FSDP2 shards and plain (replicated)
    parameters: returns the total norm over all gradients, as one process would compute it over
    whole tensors, and scales every gradient by ``min(1, max_norm / (norm + 1e-6))``.

    Sharded gradients: their norm is a partial DTensor, reduced over the FSDP mesh by
    ``full_tensor()``. Plain gradients must hold the same values on every rank (kt-ft's expert
    LoRA after its all-reduce): each rank adds their norm once, locally."""
    norm_type = float(norm_type)
    sharded, plain = _split_by_grad(parameters)
    if not sharded and not plain:
        return torch.tensor(0.0)
    device = (sharded or plain)[0].grad.device
    parts = []
    if sharded:
        norm = torch.nn.utils.get_total_norm([p.grad for p in sharded], norm_type)
        parts.append(gather_full(norm).to(device))
    if plain:
        parts.append(torch.nn.utils.get_total_norm([p.grad for p in plain], norm_type).to(device))
    total = torch.linalg.vector_norm(torch.stack(parts), norm_type)
    for group in _by_device(sharded) + _by_device(plain):
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total.to(group[0].grad.device))
    return total


def _by_device(params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
    groups: dict[torch.device, list[nn.Parameter]] = {}
    for p in params:
        groups.setdefault(p.grad.device, []).append(p)
    return list(groups.values())


def unfuse_mixed_groups(optimizer: torch.optim.Optimizer) -> int:
    """Turn off the fused / foreach kernels of every parameter group in which FSDP2 shards and
    plain tensors share a device; return how many groups changed.

    Those kernels take all of a group's tensors on one device in one call, which DTensor refuses
    when plain tensors are among them: a CPU-only run, or FSDP2's CPU offload beside kt-ft's CPU
    expert LoRA. (On GPUs without offload the shards are on the GPU and the expert LoRA on the
    CPU: different calls, nothing to change.) The per-tensor loop computes the same update."""
    changed = 0
    for group in optimizer.param_groups:
        sharded = {p.device for p in group["params"] if is_sharded(p)}
        plain = {p.device for p in group["params"] if not is_sharded(p)}
        if not sharded & plain:
            continue
        flags = [k for k in ("fused", "foreach") if group.get(k)]
        for k in flags:
            group[k] = False
        changed += bool(flags)
    return changed


def _optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Parameters in the order ``Optimizer.state_dict`` numbers them (groups, then members)."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def full_optimizer_state(optimizer: torch.optim.Optimizer) -> dict:
    """``optimizer.state_dict()`` with every DTensor state all-gathered to a whole CPU tensor
    (plain tensors to the CPU as they are): the layout a one-process run saves. A collective:
    every rank walks the states in the same (index, key) order."""
    sd = optimizer.state_dict()
    state = {}
    for index in sorted(sd["state"]):
        entry = {}
        for key in sorted(sd["state"][index]):
            value = sd["state"][index][key]
            entry[key] = gather_full(value).detach().cpu() if isinstance(value, torch.Tensor) else value
        state[index] = entry
    return {"state": state, "param_groups": sd["param_groups"]}


def shard_optimizer_state(sd: dict, optimizer: torch.optim.Optimizer) -> dict:
    """A whole-tensor optimizer state dict (``full_optimizer_state``'s, or a one-process / DDP
    ``optimizer.pt``) made loadable into ``optimizer`` whose parameters may be DTensors: each
    state shaped like its DTensor parameter becomes a DTensor laid out like it (local cut, no
    communication); scalars (``step``) and plain parameters' states stay as they are."""
    params = _optimizer_params(optimizer)
    if len(params) != sum(len(g["params"]) for g in sd["param_groups"]):
        raise ValueError(
            f"the optimizer state has {sum(len(g['params']) for g in sd['param_groups'])} parameters, "
            f"this optimizer {len(params)}"
        )
    state = {}
    for index, entry in sd["state"].items():
        p = params[int(index)]
        state[index] = {
            key: shard_like(value, p)
            if is_sharded(p) and isinstance(value, torch.Tensor) and tuple(value.shape) == tuple(p.shape)
            else value
            for key, value in entry.items()
        }
    return {"state": state, "param_groups": sd["param_groups"]}
