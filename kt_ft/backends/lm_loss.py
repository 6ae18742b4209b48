"""The causal-LM loss of a training forward without the [tokens, vocab] logits: ``lm_head`` and the
cross entropy computed a chunk of tokens at a time, the gradient of the hidden states taken in the
same pass.

Why: transformers computes the logits of every token (bf16), then their float32 copy, the
log-softmax and, in the backward, its gradient: ~14 bytes a logit (``rules/report.py``
``LOSS_BYTES_PER_LOGIT``), 4.1 GiB for Qwen3-30B-A3B's 151,936-token vocabulary at 2,048 tokens,
all alive at the turn from forward to backward where a step's GPU memory peaks. Here a chunk's
logits (``CHUNK_BYTES`` of float32) live only inside the loop, and the backward keeps the hidden
states' gradient [tokens, H] in the model's dtype: GPU memory the placement can give to experts instead.

What is computed is transformers' ``ForCausalLMLoss``: labels shifted left (``ignore_index``
-100), logits ``lm_head(h)`` in the model's dtype then float32, cross entropy summed and divided
by ``num_items_in_batch`` when the trainer passes it, else by the count of counted tokens; the MoE
auxiliary loss added as the model would (``router_aux_loss_coef``). The gradient reaching ``h`` is
transformers' too: the float32 gradient of the logits (softmax - one-hot, over the divisor) cast
to the model's dtype, times ``W``; the incoming gradient (the trainer's 1 / accumulation steps) is
applied afterwards in float32, exact for powers of two. Only where that is the whole story:
``lm_head`` a frozen plain ``nn.Linear``, the model's loss ``ForCausalLMLoss``, no logit scaling or
soft-capping in its config (``supported``); elsewhere the model's own forward runs.

``install(model)`` swaps the forward of the model's causal-LM module (an instance attribute: the
class and other instances are untouched); evaluation, generation and calls without labels go to
the original forward unchanged.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from kt_ft.backends import cpu_fp32
from kt_ft.base.log import get_logger

logger = get_logger(__name__)

CHUNK_BYTES = 128 * 2**20  # float32 logits of one chunk (the softmax and the model-dtype copy: ~2x more)
IGNORE_INDEX = -100
# config attributes that change the logits after lm_head (a model that sets one keeps its own loss)
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_softcapping", "logit_scale", "logits_scaling")


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def supported(config) -> bool:
    """Whether a model of ``config`` can take the chunked loss (by its config alone)."""
    for c in {id(config): config, id(_text_config(config)): _text_config(config)}.values():
        if any(getattr(c, a, None) not in (None, 0, 1, 1.0) for a in _LOGIT_TRANSFORMS):
            return False
    return True


def loss_bytes(tokens: int, vocab: int, hidden: int) -> int:
    """GPU bytes the chunked loss holds at its peak: a chunk's float32 logits and log-probabilities,
    or the latter and their model-dtype copy (<= 2.5 x ``CHUNK_BYTES``, less for a short
    micro-batch), and the hidden states' gradient (counted at 4 bytes an entry: the model's dtype or
    less)."""
    return min(tokens * vocab * 4, CHUNK_BYTES) * 5 // 2 + tokens * hidden * 4


def causal_lm_module(model: nn.Module) -> nn.Module | None:
    """The module that owns ``lm_head`` as a submodule of its own (PEFT's wrappers only forward the
    attribute), or None."""
    for m in model.modules():
        if isinstance(m._modules.get("lm_head"), nn.Module) and hasattr(m, "loss_function"):
            return m
    return None


class _Hidden(nn.Module):
    """Stands in for ``lm_head`` during one forward: returns what it gets (the final hidden states)."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h


def install(model: nn.Module) -> str | None:
    """Give ``model``'s causal-LM module the chunked training loss; returns why not (None: done)."""
    lm = causal_lm_module(model)
    if lm is None:
        return "no module with an lm_head and a loss_function"
    if not supported(lm.config):
        return "the config scales or soft-caps the logits"
    if getattr(lm, "_kt_ft_chunked_loss", False):
        return None
    head = lm.lm_head
    if type(head) is not nn.Linear:
        return f"lm_head is a {type(head).__name__} (LoRA or another wrapper), not a plain nn.Linear"
    from transformers.loss.loss_utils import ForCausalLMLoss  # why: transformers loads with the model

    if getattr(lm, "loss_function", None) is not ForCausalLMLoss:  # (ForConditionalGeneration maps to it)
        return f"the model's loss is {getattr(lm, 'loss_type', None)}, not transformers' ForCausalLMLoss"
    original = lm.forward

    # the original's signature (inspect follows __wrapped__): the HF Trainer keeps only the dataset
    # columns the forward names (remove_unused_columns)
    @functools.wraps(original)
    def forward(*args, labels=None, **kwargs):
        head = lm.lm_head
        keep = kwargs.get("logits_to_keep", 0)
        if (
            labels is None
            or not lm.training
            or not torch.is_grad_enabled()
            or keep not in (0, None)
            or type(head) is not nn.Linear
            or head.weight.requires_grad
        ):
            return original(*args, labels=labels, **kwargs)
        num_items = kwargs.pop("num_items_in_batch", None)
        shift_labels = kwargs.pop("shift_labels", None)
        lm.lm_head = _Hidden()
        try:
            out = original(*args, labels=None, **kwargs)
        finally:
            lm.lm_head = head
        hidden = out.logits  # [B, T, H]: what lm_head would have been given
        if shift_labels is None:
            shift_labels = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
        targets = shift_labels.reshape(-1).to(hidden.device)
        h = hidden.reshape(-1, hidden.shape[-1])
        divisor = num_items if num_items is not None else (targets != IGNORE_INDEX).sum()
        loss = chunked_lm_loss(h, head.weight, head.bias, targets, divisor)
        aux = getattr(out, "aux_loss", None)
        if aux is not None:  # the model adds it only when it computed the loss itself
            loss = loss + _aux_coef(lm) * aux.to(loss.device)
        # item assignment: a ModelOutput keeps its dict and attributes in step only this way
        out["loss"] = loss
        out["logits"] = None  # nothing of [tokens, vocab] leaves the call
        return out

    lm.forward = forward
    lm._kt_ft_chunked_loss = True
    return None


def _aux_coef(lm: nn.Module) -> float:
    """The MoE auxiliary loss's weight where the model keeps it: on the module (text models), else
    in its (text) config (vision-language models)."""
    for owner in (lm, lm.config, _text_config(lm.config)):
        coef = getattr(owner, "router_aux_loss_coef", None)
        if coef is not None:
            return coef
    raise RuntimeError(
        f"{type(lm).__name__} returned an auxiliary loss but names no router_aux_loss_coef: "
        "leave loss out of KT_FT_FUSIONS (e.g. KT_FT_FUSIONS=lora,norm,rope: its own loss) for this model"
    )


def chunked_lm_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    divisor,
) -> torch.Tensor:
    """Σ over counted rows of cross_entropy(hidden @ weight^T + bias, targets) / divisor.

    hidden [N, H] (model dtype), weight [V, H], bias [V] or None, targets [N] int64 (-100: not
    counted), divisor: a number or 0-dim tensor -> 0-dim float32, differentiable w.r.t. hidden."""
    if torch.is_tensor(divisor):
        divisor = divisor.to(hidden.device)
    return _ChunkedLMLoss.apply(hidden, weight, bias, targets, divisor)


class _ChunkedLMLoss(torch.autograd.Function):
    """The loop's few kernels a chunk matter: a training step is bound by the host's per-kernel
    time, and this runs once a micro-batch on the main thread (~30 operators a chunk, ten chunks at
    2,048 tokens of a 152k vocabulary, cost 6.7 ms of host a micro-batch in a profiled run). So the
    per-row values (target index, gradient scale) are made once for all chunks, and a chunk takes
    its log-softmax, the loss of its counted rows (``nll_loss``), and the gradient in place of the
    log-probabilities: exp, minus one at the target, times the row's scale, then through W."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, divisor):
        n, vocab = hidden.shape[0], weight.shape[0]
        # fp32 products on a CPU without bf16 arithmetic (KT_FT_CPU_UPCAST): each chunk upcasts the
        # whole weight a block at a time, so chunks are 4x larger there
        up = cpu_fp32.upcasts(weight.device, weight.dtype)
        rows = max(1, (4 if up else 1) * CHUNK_BYTES // (vocab * 4))
        need = ctx.needs_input_grad[0]
        # in the model's dtype: the product's own output (what autograd through ``.float()`` gives
        # too); the backward applies the incoming gradient in float32
        grad_h = torch.empty(hidden.shape, dtype=weight.dtype, device=hidden.device) if need else None
        inv = 1.0 / divisor if not torch.is_tensor(divisor) else divisor.float().reciprocal()
        if need:  # (the loss itself skips ignored rows through nll_loss's ignore_index)
            counted = targets != IGNORE_INDEX
            safe = torch.where(counted, targets, 0)[:, None]  # [N, 1]: the target's column, 0 if not counted
            scale = (counted.float() * inv)[:, None]  # [N, 1]: 1 / divisor on counted rows, else 0
            minus_one = torch.full((min(rows, n), 1), -1.0, device=hidden.device)
        losses = []
        for s in range(0, n, rows):
            e = min(n, s + rows)
            if up:
                logits = cpu_fp32.linear_fp32(hidden[s:e], weight, bias)
            else:
                logits = F.linear(hidden[s:e], weight, bias).float()  # [c, V], as transformers upcasts
            logp = torch.log_softmax(logits, dim=-1)
            del logits
            losses.append(F.nll_loss(logp, targets[s:e], ignore_index=IGNORE_INDEX, reduction="sum"))
            if need:
                # d loss / d logits = (softmax - one-hot) / divisor on counted rows, cast to the
                # model's dtype (as autograd through ``.float()`` does), then through W
                p = logp.exp_()
                p.scatter_add_(1, safe[s:e], minus_one[: e - s])
                p.mul_(scale[s:e])
                if up:
                    grad_h[s:e] = cpu_fp32.mm_fp32(p, weight)
                else:
                    torch.mm(p.to(weight.dtype), weight, out=grad_h[s:e])
            del logp
        if not losses:  # no rows
            total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        else:
            total = losses[0] if len(losses) == 1 else torch.stack(losses).sum()
        ctx.save_for_backward(grad_h)
        ctx.dtype = hidden.dtype
        return total * inv

    @staticmethod
    def backward(ctx, grad):
        (grad_h,) = ctx.saved_tensors
        if grad_h is None:
            return None, None, None, None, None
        return (grad_h.float() * grad).to(ctx.dtype), None, None, None, None
