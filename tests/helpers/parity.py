"""The pair behind the whole-model parity tests (tests/test_parity.py and the tests built on it):
a kt-ft model and a transformers + PEFT reference from the same init, whose expert LoRA is a plain
pure-torch loop, and the loop that trains either."""

from __future__ import annotations

import copy

import torch
from peft import LoraConfig, get_peft_model
from torch import nn

from helpers.tiny_models import tiny_model
from kt_ft.backends.base import ExpertSpec, ExpertWeights, LoraTensors
from kt_ft.backends.reference import reference_moe
from kt_ft.formats.lora_layout import LORA_NAMES
from kt_ft.plan.builtin import resolve_rule_path
from kt_ft.plan.families import FAMILIES
from kt_ft.plan.family import unwrap_peft
from kt_ft.plan.loader import load_rules
from kt_ft.plan.placement import make_plan
from kt_ft.runtime.experts import KTExperts
from kt_ft.runtime.patch import replace_routed_experts

# PEFT LoRA targets of the tiny models' attention
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]


class PlainLoRAExperts(nn.Module):
    """The reference: HF's frozen fused experts + expert LoRA, computed by a plain loop under autograd.
    ``spec``: the family's layout (gpt_oss: transposed, interleaved, with HF's biases). Its forward
    returns the experts' output [T, H] in ``hidden_states``' dtype."""

    def __init__(self, hf, lora: dict[str, torch.Tensor], scaling: float, spec=None):
        super().__init__()
        self.gate_up_proj, self.down_proj = hf.gate_up_proj, hf.down_proj
        self.biases = (getattr(hf, "gate_up_proj_bias", None), getattr(hf, "down_proj_bias", None))
        self.spec = spec or ExpertSpec()
        for n in LORA_NAMES:
            setattr(self, n, nn.Parameter(lora[n].clone()))
        self.scaling = scaling

    def forward(self, hidden_states, top_k_index, top_k_weights):
        lora = LoraTensors(*(getattr(self, n) for n in LORA_NAMES))
        base = ExpertWeights(self.gate_up_proj, self.down_proj, *self.biases, spec=self.spec)
        return reference_moe(hidden_states, top_k_index, top_k_weights, base, lora, self.scaling).to(
            hidden_states.dtype
        )


def build_pair(
    backend: str,
    chunk_size: int,
    seed: int = 0,
    rank: int = 4,
    alpha: int = 8,
    family: str = "qwen3_moe",
    targets: list[str] | None = None,
    **overrides,
):
    """(kt-ft model, reference model) of ``family`` from the same init: two fp32 PEFT models.

    Both have LoRA on ``targets`` (default: attention), lora_B drawn N(0, 0.02^2); the kt one has its
    routed experts replaced by KTExperts (family's built-in rule, expert lora_B drawn N(0, 0.05^2)),
    the reference by PlainLoRAExperts holding a copy of kt-ft's expert-LoRA init. ``overrides``:
    config overrides of the tiny model.
    """
    fam = FAMILIES[family]
    base = tiny_model(family, seed=seed, **overrides)
    peft_model = get_peft_model(
        base, LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets or ATTN, lora_dropout=0.0)
    )
    # PEFT inits lora_B with zeros: make it non-zero so the attention LoRA path is exercised too.
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    ref_model = copy.deepcopy(peft_model)

    plan = make_plan(peft_model, load_rules(resolve_rule_path(fam.builtin_rule)), fam, backend, 2)
    replace_routed_experts(peft_model, plan, rank, alpha / rank, chunk_size, seed=seed + 1)
    kt_modules = {n: m for n, m in peft_model.named_modules() if isinstance(m, KTExperts)}
    with torch.no_grad():  # non-zero B: the expert-LoRA path contributes from step 0
        for m in kt_modules.values():
            for n in ("gate_b", "up_b", "down_b"):
                getattr(m, n).normal_(0, 0.05)
    for name, m in kt_modules.items():
        parent_name, _, child = name.rpartition(".")
        parent = ref_model.get_submodule(parent_name)
        lora = {n: getattr(m, n).detach() for n in LORA_NAMES}
        hf = unwrap_peft(getattr(parent, child))  # newer PEFT wraps fused experts when targeted
        setattr(parent, child, PlainLoRAExperts(hf, lora, alpha / rank, m.spec))
    return peft_model, ref_model


def train(model, batches, steps, gc: bool) -> list[float]:
    """``steps`` AdamW steps (lr 1e-2, torch's defaults otherwise) of ``model`` on ``batches`` in turn
    (token ids [B, S], their own labels), with reentrant gradient checkpointing when ``gc``;
    returns the loss of each step (Python floats)."""
    if gc:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        model.enable_input_require_grads()
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2)
    losses = []
    for step in range(steps):
        ids = batches[step % len(batches)]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def expert_lora(model) -> dict[str, torch.Tensor]:
    """``"<module name>.<lora name>"`` -> a detached copy of that expert-LoRA tensor, for every
    module holding expert LoRA (KTExperts or PlainLoRAExperts), as the module stores it: gate_a / up_a
    [E, r, H], gate_b / up_b [E, I, r], down_a [E, r, I], down_b [E, H, r] (fp32 in these tests)."""
    return {
        f"{n}.{k}": getattr(m, k).detach().clone()
        for n, m in model.named_modules()
        if hasattr(m, "gate_a") and hasattr(m, "down_b")
        for k in LORA_NAMES
    }
