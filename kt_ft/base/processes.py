"""Where this process sits among the ranks of a run, and the few collectives kt-ft needs (over
gloo: CPU tensors, no GPU stream): torch.distributed only, nothing of kt-ft's model. Below the
plan (``lora_home`` asks ``topology``) and the runtime (``distributed.py``: DDP setup).
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass

_GLOO_GROUP = None


@dataclass(frozen=True)
class Topology:
    """Where this process sits: global rank / world size (torch.distributed), and its rank and
    count on this machine (torchrun's and accelerate's LOCAL_RANK / LOCAL_WORLD_SIZE)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def topology() -> Topology:
    """This process's topology; one process (all zeros and ones) without an initialized group."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return Topology()
    world = dist.get_world_size()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return Topology(dist.get_rank(), world, int(os.environ.get("LOCAL_RANK", 0)), local_world)


def threads_per_rank(cpu_infer: int | None, topo: Topology | None = None) -> int | None:
    """Each local rank's share of ``cpu_infer`` (the machine's expert threads): at least 1."""
    topo = topo or topology()
    if cpu_infer is None or topo.local_world_size <= 1:
        return cpu_infer
    return max(1, cpu_infer // topo.local_world_size)


def gloo_group():
    """A gloo process group over all ranks (created once; every rank must call this, in the same
    order as the other collectives). On a CPU-only run the default group is gloo already."""
    global _GLOO_GROUP
    import torch.distributed as dist

    if _GLOO_GROUP is None:
        _GLOO_GROUP = dist.group.WORLD if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
    return _GLOO_GROUP


def barrier() -> None:
    """All ranks meet (over gloo: no GPU stream involved); a no-op in one process."""
    import torch.distributed as dist

    if topology().distributed:
        dist.barrier(group=gloo_group())


def broadcast_object(obj):
    """Global rank 0's ``obj`` on every rank (``obj`` as is in one process)."""
    import torch.distributed as dist

    if not topology().distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=gloo_group())
    return box[0]


def new_run_token() -> str:
    """A name shared by all ranks of this run (global rank 0's random token)."""
    return broadcast_object(uuid.uuid4().hex[:16])
