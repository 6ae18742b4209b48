"""GPU work of a MoE block run beside the CPU expert op: shared experts overlap the routed ones.

The CPU op blocks the host while it computes the routed experts. GPU kernels queued *before*
it keep the GPU busy meanwhile; kernels queued after it wait. HF's MoE blocks call the shared
experts either after the routed experts (DeepSeek-V2/V3, GLM-4.5: ``experts(...)`` then
``hidden_states + shared_experts(residuals)``) or before the router (Qwen2-MoE, Qwen3.5-MoE:
``shared_expert(x)``, then ``gate(x)``, whose result the CPU op waits for, so the GPU finishes
the shared expert before the host can even start the CPU op). Either way nothing overlaps.

``SharedBeside`` reorders that, without changing a number (the same modules on the same data,
summed in the same order):

* forward: ``KTExperts`` starts the copies of the CPU op's inputs, then calls ``start(x)``, which
  queues the shared branch's kernels (on a graph of its own), then blocks in the CPU op while
  the GPU computes them; the block's later call of the shared branch takes that result
  (``take``) instead of computing it again;
* backward: the shared result joins the model's graph after the CPU op (``_AttachBeside``), so
  autograd runs its backward first: it starts the copy of the CPU op's incoming gradient (the
  same tensor: the block's output gradient), then queues the shared branch's backward kernels,
  and only then does the CPU op's backward block the host.

How each family's block is handled (``install_shared_beside``):

* ``shared_experts`` called after the routed experts with the block input (DeepSeek-V2/V3,
  GLM-4.5): the shared module's ``forward`` is wrapped on the instance (state-dict names and
  PEFT's LoRA layers inside it unchanged) to return the started result for that input;
* ``shared_expert`` + ``shared_expert_gate`` called before the router (Qwen2-MoE, Qwen3.5-MoE):
  the block's ``forward`` is replaced by the same computation in the order router, routed
  experts (the gated shared branch started beside them), sum (``gated_shared_block_forward``).

If a block ever calls its shared branch with another input than the one started (a transformers
version that changed the block), ``take`` finds nothing, the branch runs as usual (correct, the
started work is wasted) and a warning says the overlap is off.

On the CPU (tests, CPU-only training) the same code runs; it only reorders CPU work.
"""

from __future__ import annotations

import types
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kt_ft.base.log import get_logger
from kt_ft.runtime.function import prefetch_grad_out
from kt_ft.runtime.inner_graph import inner_grads, take_inner

logger = get_logger(__name__)

# blocks whose forward is shared_expert(x) -> gate(x) -> experts(...) -> sigmoid-gated sum
GATED_SHARED_BLOCKS = ("Qwen2MoeSparseMoeBlock", "Qwen3_5MoeSparseMoeBlock")


class _AttachBeside(torch.autograd.Function):
    """apply((out, leaves), x, *params) -> out: joins ``out``, computed on a graph of its own from
    ``leaves`` (``[x.detach()]`` plus the branch's trainable parameters ``params``), to the
    model's graph at this point. The parameters are inputs too, so the result needs a gradient
    whenever they do (the first layer's input may not), and their gradients come back through
    the model's graph (AccumulateGrad, DDP's hooks) like any other parameter's."""

    @staticmethod
    def forward(ctx, inner, *inputs):
        ctx.inner = inner
        return inner[0].detach()

    @staticmethod
    def backward(ctx, grad):
        out, leaves = take_inner(ctx, "shared experts beside the CPU op")
        # the block output's gradient is also the CPU op's incoming gradient: start its copy
        # before queuing this branch's kernels (the CPU op's backward comes next)
        prefetch_grad_out(grad.reshape(-1, grad.shape[-1]))
        return (None, *inner_grads(out, leaves, grad))


class SharedBeside:
    """The shared branch of one MoE block, started beside the CPU op.

    ``branch(x [T, H]) -> [T, H]`` in x's dtype on x's device: ``block.shared_experts(x)``, or
    for a gated block ``sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)``. A plain
    object, not an ``nn.Module``: it refers back to the block, which must not become a submodule
    of ``KTExperts``; no closures, so a deep copy of the model stays self-contained.
    """

    def __init__(self, block: nn.Module, gated: bool, where: str) -> None:
        self.block = block
        self.gated = gated
        self.where = where  # the block's dotted name, for warnings
        self._pending: tuple[tuple, Callable[[], torch.Tensor]] | None = None
        self.started = 0  # counters for tests
        self.taken = 0
        self._warned = False
        self._skipped = False  # ``skip``: the block's next call computes the branch itself

    def branch(self, x: torch.Tensor) -> torch.Tensor:
        b = self.block
        if self.gated:
            return F.sigmoid(b.shared_expert_gate(x)) * b.shared_expert(x)
        return type(b.shared_experts).forward(b.shared_experts, x)  # the class's, not the wrapper

    @staticmethod
    def _key(x: torch.Tensor) -> tuple:
        return (x.data_ptr(), x.numel(), x._version, x.dtype, x.device, torch.is_grad_enabled())

    def _warn(self, what: str) -> None:
        if not self._warned:
            self._warned = True
            logger.warning(f"{self.where}: {what}; the shared experts no longer overlap the CPU op")

    def start(self, x: torch.Tensor) -> None:
        """Queue ``branch(x)`` now (x [T, H]); ``take`` of the same data later returns it."""
        self._skipped = False
        if self._pending is not None:
            self._warn("the block did not take the shared experts started for its last call")
        self.started += 1
        key = self._key(x)
        if not torch.is_grad_enabled():
            out = self.branch(x)
            self._pending = (key, lambda: out)
            return
        leaf = x.detach().requires_grad_(x.requires_grad)
        with torch.enable_grad():
            out = self.branch(leaf)
        if not out.requires_grad:  # nothing trainable in the branch and x needs no gradient
            self._pending = (key, lambda: out)
            return
        params = self.trainable_parameters()
        self._pending = (key, lambda: _AttachBeside.apply((out, [leaf, *params]), x, *params))

    def skip(self) -> None:
        """Nothing started for this call (the layer has no CPU op to overlap): the block's call of
        the shared branch computes it as usual, on the model's graph."""
        if self._pending is not None:
            self._warn("the block did not take the shared experts started for its last call")
        self._pending = None
        self._skipped = True

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        """The branch's parameters that need a gradient (PEFT LoRA), read at each call: PEFT may
        wrap the block after kt-ft installed this."""
        b = self.block
        mods = (b.shared_expert, b.shared_expert_gate) if self.gated else (b.shared_experts,)
        return [p for m in mods for p in m.parameters() if p.requires_grad]

    def take(self, x: torch.Tensor) -> torch.Tensor | None:
        """The started result for ``x`` (any shape over the started data) attached to the graph,
        as x's shape; None if nothing was started for this data (the caller computes it)."""
        pending, self._pending = self._pending, None
        if pending is None and self._skipped:
            self._skipped = False
            return None
        if pending is None or pending[0] != self._key(x):
            self._warn("the shared experts were called with another input than the routed experts got")
            return None
        self.taken += 1
        return pending[1]().view(x.shape)


def shared_experts_forward_taking_started(shared: nn.Module, hidden_states, *args, **kwargs):
    """Instance ``forward`` of a block's ``shared_experts``: the result ``KTExperts`` started
    for this input (``shared._kt_beside``), else the class's own forward."""
    if not args and not kwargs:
        got = shared._kt_beside.take(hidden_states)
        if got is not None:
            return got
    return type(shared).forward(shared, hidden_states, *args, **kwargs)


def gated_shared_block_forward(block: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """Qwen2-MoE / Qwen3.5-MoE sparse block, router first: hidden_states [B, S, H] -> [B, S, H].

    The same computation as HF's forward (shared_expert, sigmoid(shared_expert_gate) times it,
    plus the routed experts, summed in that order); HF computes the shared expert before the
    router, here ``KTExperts`` starts it beside the CPU op (``block.experts.beside``)."""
    b, s, h = hidden_states.shape
    x = hidden_states.view(-1, h)
    _, routing_weights, selected_experts = block.gate(x)
    routed = block.experts(x, selected_experts, routing_weights)
    shared = block.experts.beside.take(x)
    if shared is None:
        shared = F.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)
    return (routed + shared).reshape(b, s, h)


def install_shared_beside(block: nn.Module, experts: nn.Module, where: str) -> str | None:
    """Set ``experts.beside`` for ``block``'s shared branch and reroute the block's call of it;
    returns how (None: no shared experts kt-ft knows how to overlap; nothing changed)."""
    if type(block).__name__ in GATED_SHARED_BLOCKS and all(
        isinstance(getattr(block, n, None), nn.Module) for n in ("shared_expert", "shared_expert_gate")
    ):
        experts.beside = SharedBeside(block, gated=True, where=where)
        block.forward = types.MethodType(gated_shared_block_forward, block)
        return "router first, gated shared expert beside the CPU op"
    shared = getattr(block, "shared_experts", None)
    if isinstance(shared, nn.Module):
        experts.beside = SharedBeside(block, gated=False, where=where)
        shared._kt_beside = experts.beside
        shared.forward = types.MethodType(shared_experts_forward_taking_started, shared)
        return "shared experts beside the CPU op"
    return None
