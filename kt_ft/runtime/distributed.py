"""Data-parallel kt-ft: one process per GPU (torchrun, ``FORCE_TORCHRUN=1 llamafactory-cli
train``, ``accelerate launch``), each computing its own micro-batches' routed experts on the
CPU, all on the same read-only expert weights (``kt_ft.runtime.shared_weights``).

Who reduces which gradient
--------------------------
The HF Trainer wraps the PEFT model in ``DistributedDataParallel``. DDP would, on its own,

* broadcast every parameter and buffer from rank 0 at wrap time: all frozen routed-expert
  weights included (hundreds of GB, written into each rank's memory, which turns the shared
  read-only pages into private copies);
* refuse the module on a GPU machine: HF passes ``device_ids=[local_rank]``, which DDP only
  accepts for a module on one device, and kt-ft's experts stay on the CPU; with
  ``device_ids=None`` it would try to all-reduce CPU tensors over NCCL, which cannot.

So every parameter of a ``KTExperts`` module (frozen base weights and the six expert-LoRA
tensors) is hidden from DDP (``_ddp_params_and_buffers_to_ignore``), and ``ExpertGradSync``
averages the expert-LoRA gradients itself over a gloo process group (gloo reduces CPU
tensors; on a CPU-only run it is also the default backend). It does so once per optimizer
step, inside the backward of the last micro-batch (the one after which the Trainer steps, as
accelerate's ``GradientState.sync_gradients`` says), as soon as every expert-LoRA gradient of
that backward has arrived, so clipping and the optimizer see averaged gradients, exactly as
DDP would have left them: sum over ranks / world size. The router's
``top_k_weights`` gradient flows back into the router's own (DDP-managed) parameters, and the
attention / shared-expert PEFT LoRA stay DDP's job.

Why not one all-reduce per parameter, launched as its gradient arrives: gloo matches
collectives by call order, and on a GPU machine the order in which autograd finishes the CPU
parameters' gradients is not guaranteed to be the same on every rank. One pass over a fixed
list, once all have arrived, is. (Overlapping that all-reduce with the backward is future
work: per layer, in layer order.)

The expert LoRA is not sharded: every rank holds all of it, its AdamW state is an ordinary
(unsharded) ``optimizer.pt`` written by rank 0, and a checkpoint resumes on any number of
processes.
"""

from __future__ import annotations

import torch
from torch import nn

from kt_ft.backends.base import lora_changed
from kt_ft.base.log import get_logger
from kt_ft.base.processes import gloo_group, topology
from kt_ft.runtime.adapter import kt_expert_modules
from kt_ft.runtime.experts import KTExperts

logger = get_logger(__name__)


def kt_expert_param_names(model: nn.Module) -> list[str]:
    """Dotted names (as ``model.named_parameters()`` gives them) of every KTExperts parameter:
    frozen base weights and expert LoRA."""
    names = []
    for module_name, module in model.named_modules():
        if isinstance(module, KTExperts):
            names += [f"{module_name}.{n}" for n, _ in module.named_parameters(recurse=False)]
    return names


def _accelerate_syncs_now() -> bool:
    """True when the Trainer steps the optimizer after this backward (accelerate's
    GradientState; the Trainer sets it before each micro-batch). True without accelerate."""
    try:
        from accelerate.state import GradientState
    except ImportError:
        return True
    if not GradientState._shared_state:
        return True
    return bool(GradientState().sync_gradients)


class ExpertGradSync:
    """Averages the expert-LoRA gradients over all ranks (gloo) once per optimizer step, as soon
    as the backward that precedes the step has produced all of them. See the module docstring
    for why DDP does not do it.

    ``params``: the expert-LoRA parameters in one fixed order (the same on every rank: the
    model's module order). Gradients are fp32 CPU tensors shaped like the parameters.

    Each trainable parameter's post-accumulate-grad hook fires once per backward; the hook that
    completes the set runs the all-reduce. Not ``queue_callback`` at the end of the backward:
    under reentrant gradient checkpointing (LLaMA-Factory's default) each layer's backward is a
    nested backward of its own, so a queued callback would run once per layer, each time over
    all layers. ``check_complete`` (called before the optimizer step) turns a set that never
    completed into an error instead of a silently unsynchronized step.
    """

    def __init__(self, params: list[nn.Parameter], group) -> None:
        self.params = params
        self.group = group
        self.world_size = torch.distributed.get_world_size(group)
        self.reductions = 0  # all-reduces run (one per optimizer step)
        self._seen: set[int] = set()
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]

    def _trainable(self) -> list[nn.Parameter]:
        return [p for p in self.params if p.requires_grad]  # the same on every rank (same recipe)

    def _on_grad(self, param: torch.Tensor) -> None:
        if not _accelerate_syncs_now():
            return  # a micro-batch before the last one: gradients keep accumulating locally
        self._seen.add(id(param))
        if len(self._seen) == len(self._trainable()):
            self.all_reduce()

    def all_reduce(self) -> None:
        """grad <- sum over ranks / world size, for every expert-LoRA param that trains."""
        import torch.distributed as dist

        self._seen.clear()
        trainable = self._trainable()
        works = []
        for p in trainable:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            works.append(dist.all_reduce(p.grad, group=self.group, async_op=True))
        for w in works:
            w.wait()
        for p in trainable:
            p.grad.div_(self.world_size)
        self.reductions += 1

    def check_complete(self) -> None:
        """Raise if a backward left some expert-LoRA gradients unreduced (called before a step)."""
        if self._seen:
            raise RuntimeError(
                f"kt-ft: only {len(self._seen)} of {len(self._trainable())} expert-LoRA gradients arrived in the "
                "backward before this optimizer step; they were not averaged across ranks"
            )

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def setup_data_parallel(model: nn.Module) -> ExpertGradSync | None:
    """Prepare a kt-ft model for DDP when this process is one of several (else None):
    hide the KTExperts parameters from DDP, make the expert LoRA identical on every rank
    (global rank 0's), and install the gloo gradient averaging."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    topo = topology()
    if not topo.distributed:
        return None
    ignored = kt_expert_param_names(model)
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignored)
    group = gloo_group()
    params = [p for m in kt_expert_modules(model) for p in m.lora_tensors()]
    with torch.no_grad():
        for p in params:  # the same LoRA init on every rank, whatever each rank's RNG did
            dist.broadcast(p.data, src=0, group=group)
    for m in kt_expert_modules(model):
        m.runner.backend.lora_updated()
    lora_changed()
    sync = ExpertGradSync(params, group)
    model._kt_ft_grad_sync = sync
    logger.info(
        f"data parallel: rank {topo.rank} of {topo.world_size} ({topo.local_world_size} on this machine); "
        f"{len(ignored)} routed-expert params hidden from DDP / FSDP2; expert-LoRA grads ({len(params)} tensors) "
        "averaged over gloo before each optimizer step"
    )
    return sync
