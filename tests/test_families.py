"""Every supported MoE family: kt-ft training == transformers + PEFT + pure-torch expert LoRA.

For each family's tiny demo model (dense layers, shared experts, grouped / sigmoid routing,
hybrid attention as the family has them), both models start from the same init, with PEFT
LoRA on every nn.Linear but the router and lm_head (attention, shared experts and their
gate, dense MLPs) and a trainable router weight, and take the same AdamW steps.
Tolerances (fp32, SGD steps): losses rel 1e-5 per step; final expert LoRA abs 1e-4 and router weight
grads of the first step rel 1e-4 / abs 1e-6 (summation order differs between the grouped
kernel and the per-expert loop).
"""

from __future__ import annotations

import pytest
import torch
from helpers.families import moe_layers
from helpers.parity import build_pair, expert_lora
from helpers.tiny_models import tiny_model
from torch import nn
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from kt_ft.base.errors import KTConfigError
from kt_ft.plan.families import FAMILIES
from kt_ft.plan.family import family_of, find_routed_experts
from kt_ft.runtime.experts import KTExperts

STEPS = 3
SHARED = ("shared_expert", "shared_experts", "shared_expert_gate")  # HF names of shared-expert parts

# (family, config overrides, why): one case per family, plus DeepSeek-V2's group-limited routing.
CASES = [(f, {}) for f in FAMILIES] + [
    ("deepseek_v2", dict(topk_method="group_limited_greedy", n_group=4, topk_group=2)),
]


def _skip_if_missing(family: str) -> None:
    if FAMILIES[family].demo_type not in CONFIG_MAPPING:
        pytest.skip(f"{family}: model type {FAMILIES[family].demo_type!r} is not in this transformers")


def lora_targets(model) -> list[str]:
    """LLaMA-Factory's `lora_target: all` (every nn.Linear leaf name but lm_head), minus the router:
    DeepSeek-V2's router is an nn.Linear whose weight HF reads directly (a LoRA on it is dead)."""
    names = {n.rpartition(".")[2] for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    return sorted(names - {"lm_head", "gate"})


ROUTER_WEIGHT = ("mlp.gate.weight", "mlp.router.weight")  # gpt_oss: GptOssTopKRouter at mlp.router


def _router_weights(model) -> dict[str, nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if n.endswith(ROUTER_WEIGHT)}


def _fix_hf_deepseek_v2(model) -> None:
    """transformers 5.6's DeepseekV2Moe group_limited_greedy reads self.num_experts, which it never
    sets; give it the value it means (n_routed_experts). Routing math itself stays HF's."""
    for m in model.modules():
        if type(m).__name__ == "DeepseekV2Moe" and not hasattr(m, "num_experts"):
            m.num_experts = m.config.n_routed_experts


def _train(model, batches) -> tuple[list[float], dict[str, torch.Tensor]]:
    """STEPS SGD steps; returns the losses and the router weight grads of the first step.

    SGD, not AdamW: Adam divides each gradient by its own running magnitude, so an element whose
    gradient is fp32 rounding noise (~1e-9, next to eps 1e-8) moves by up to lr in one
    implementation and not in the other; SGD keeps the final tensors linear in the gradients."""
    model.train()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    losses, router_grads = [], {}
    for step in range(STEPS):
        ids = batches[step % len(batches)]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if step == 0:
            router_grads = {n: p.grad.clone() for n, p in _router_weights(model).items()}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, router_grads


@pytest.mark.parametrize(
    "family,overrides", CASES, ids=[f + ("-" + "-".join(map(str, o.values())) if o else "") for f, o in CASES]
)
def test_family_parity(family, overrides):
    _skip_if_missing(family)
    torch.manual_seed(123)
    batches = [torch.randint(1, 97, (2, 12)) for _ in range(2)]
    targets = lora_targets(tiny_model(family, **overrides))
    kt_model, ref_model = build_pair("torch", 4096, family=family, targets=targets, **overrides)
    for model in (kt_model, ref_model):
        _fix_hf_deepseek_v2(model)
        for p in _router_weights(model).values():
            p.requires_grad_(True)  # the router trains: its grad comes through the routing weights

    # experts replaced on exactly the config's MoE layers, under their real layer index
    kt = {n: m for n, m in kt_model.named_modules() if isinstance(m, KTExperts)}
    config = kt_model.get_base_model().config
    assert [m.layer_idx for m in kt.values()] == moe_layers(config)
    assert all(f"layers.{m.layer_idx}.mlp.experts" in n for n, m in kt.items())
    assert family_of(config) is FAMILIES[family]

    # router, shared experts and dense MLPs are HF's modules, trained with PEFT LoRA when targeted
    kt_types = {n: type(m) for n, m in kt_model.named_modules() if ".experts" not in n}
    ref_types = {n: type(m) for n, m in ref_model.named_modules() if ".experts" not in n}
    assert kt_types == ref_types
    for name in kt:
        block = kt_model.get_submodule(name.rpartition(".")[0])
        # HF's router class (an nn.Linear for DeepSeek-V2), neither kt-ft's nor a PEFT wrapper
        router = getattr(block, "gate", None) or block.router
        assert not type(router).__module__.startswith(("kt_ft", "peft")), type(router)
        # PEFT >= 0.21 turns gate/up/down_proj targets of some MoE families into expert-parameter
        # targets and drops them from target_modules: then the shared experts get no LoRA (PEFT's
        # choice, see README "Known traps"); kt-ft replaces the expert part either way
        mlp_targeted = "down_proj" in kt_model.peft_config["default"].target_modules
        for part in (getattr(block, s) for s in SHARED if hasattr(block, s) and mlp_targeted):
            assert any("lora_A" in n and p.requires_grad for n, p in part.named_parameters())
    trainable_kt = {n for n, p in kt_model.named_parameters() if p.requires_grad}
    trainable_ref = {n for n, p in ref_model.named_parameters() if p.requires_grad}
    assert trainable_kt == trainable_ref
    assert any(n.endswith("experts.gate_a") for n in trainable_kt)
    assert any(n.endswith(ROUTER_WEIGHT) for n in trainable_kt)

    kt_losses, kt_grads = _train(kt_model, batches)
    ref_losses, ref_grads = _train(ref_model, batches)
    torch.testing.assert_close(torch.tensor(kt_losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    assert kt_grads.keys() == ref_grads.keys() and kt_grads
    for n in kt_grads:
        assert kt_grads[n].abs().max() > 0, f"{n}: no gradient reached the router"
        torch.testing.assert_close(kt_grads[n], ref_grads[n], rtol=1e-4, atol=1e-6, msg=n)
    kt_lora, ref_lora = expert_lora(kt_model), expert_lora(ref_model)
    assert kt_lora.keys() == ref_lora.keys() and kt_lora
    for k in kt_lora:
        torch.testing.assert_close(kt_lora[k], ref_lora[k], rtol=0, atol=1e-4, msg=k)


def test_gpt_oss_experts_refused_by_the_silu_layout_check():
    """GptOssExperts (transposed, biased, clamped swish) under a silu family's facts is refused,
    naming every difference: the layout check is per family, not per class name."""
    _skip_if_missing("gpt_oss")
    model = tiny_model("gpt_oss")
    fam = FAMILIES["mixtral"].__class__(**{**vars(FAMILIES["mixtral"]), "experts_class": "GptOssExperts"})
    with pytest.raises(KTConfigError) as e:
        find_routed_experts(model, fam)
    msg = str(e.value)
    assert "[E, 2I, H]" in msg and "bias" in msg and "_apply_gate" in msg


def test_wrong_activation_refused():
    """A config whose hidden_act is not the CPU op's silu is refused before any replacement."""
    config = tiny_model("mixtral").config
    config.hidden_act = "gelu"
    with pytest.raises(KTConfigError, match="hidden_act='gelu'.*valid: 'silu'"):
        family_of(config)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_demo_model_through_llamafactory(family, tmp_path):
    """`kt-ft make-demo-model --family F`, loaded by LLaMA-Factory with `use_kt` and `lora_target: all`:
    experts replaced on the MoE layers, one forward/backward reaches every LoRA (expert and PEFT),
    except DeepSeek-V2's router LoRA, which HF bypasses (it reads `gate.weight` directly)."""
    _skip_if_missing(family)
    pytest.importorskip("llamafactory")
    from llamafactory.hparams import get_train_args
    from llamafactory.model import load_model, load_tokenizer

    from kt_ft.integrations.cli.main import main

    assert main(["make-demo-model", str(tmp_path / "demo"), "--family", family]) == 0
    model_args, _, _, finetuning_args, _ = get_train_args(
        dict(
            model_name_or_path=str(tmp_path / "demo" / "model"),
            stage="sft",
            do_train=True,
            finetuning_type="lora",
            lora_target="all",
            lora_rank=4,
            dataset_dir=str(tmp_path / "demo" / "data"),
            dataset="kt_demo",
            template="qwen",
            output_dir=str(tmp_path / "out"),
            report_to="none",
            use_kt=True,
            cpu_infer=1,
        )
    )
    tokenizer = load_tokenizer(model_args)["tokenizer"]
    model = load_model(tokenizer, model_args, finetuning_args, is_trainable=True)
    kt = [m for m in model.modules() if isinstance(m, KTExperts)]
    assert [m.layer_idx for m in kt] == moe_layers(model.config)
    ids = torch.randint(1, len(tokenizer), (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    # B starts at zero, so only the B tensors get a non-zero gradient on the first step
    assert all(p.grad is not None for m in kt for p in m.lora_tensors())
    assert all(getattr(m, n).grad.abs().max() > 0 for m in kt for n in ("gate_b", "up_b", "down_b"))
    dead = {n.split(".lora_")[0] for n, p in model.named_parameters() if "lora_A" in n and p.grad is None}
    expected_dead = {f"base_model.model.model.layers.{m.layer_idx}.mlp.gate" for m in kt}
    assert dead == (expected_dead if family == "deepseek_v2" else set())
